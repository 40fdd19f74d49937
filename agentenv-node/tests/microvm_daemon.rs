//! Backend selection at node start: `AENV_BACKEND=auto` takes the jail on a host where
//! microVMs cannot run (these machines: KVM is served by kvm_pvm) and logs why;
//! `AENV_BACKEND=microvm` there fails at start with a message naming what is missing.

mod node_common;

use std::io::Write;
use std::sync::{Arc, Mutex};

use agentenv_node::backend::microvm::unavailable_reason;
use agentenv_node::config::BackendKind;
use agentenv_node::daemon::{Daemon, auto_backend};

/// Log lines written while a guard is held, for this thread.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Captured {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

// A current-thread runtime: the daemon's start-up logs go to this thread's subscriber.
#[tokio::test]
async fn auto_picks_the_jail_where_microvms_cannot_run_and_logs_why() {
    require_node!();
    let home = tempfile::tempdir().unwrap();
    let mut cfg = node_common::config(home.path(), 53);
    cfg.backend = BackendKind::Auto;
    let Some(reason) = unavailable_reason(&cfg.guest_kernel, &cfg.vmm_binary) else {
        println!(
            "NOT RUN HERE: microVMs can run on this host (hardware KVM, kernel {} present), so auto does not fall back to the jail",
            cfg.guest_kernel.display()
        );
        return;
    };
    let (kind, why) = auto_backend(&cfg);
    assert_eq!(kind, BackendKind::Jail);
    assert!(why.contains(&reason), "{why}");
    if std::path::Path::new("/sys/module/kvm_pvm").exists() {
        assert!(why.contains("kvm_pvm"), "{why}");
    }
    let logs = Captured::default();
    let writer = logs.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    let guard = tracing::subscriber::set_default(subscriber);
    node_common::ensure_base().await;
    let d = Daemon::start(cfg).await.expect("daemon start");
    drop(guard);
    assert_eq!(d.orchestrator().backend_kind(), "jail");
    let text = logs.text();
    let line = text
        .lines()
        .find(|l| l.contains("AENV_BACKEND=auto"))
        .unwrap_or_else(|| panic!("no backend choice logged:\n{text}"));
    assert!(line.contains("using the jail backend"), "{line}");
    assert!(line.contains(&reason), "{line}");
    d.run(async {}).await;
}

#[tokio::test]
async fn microvm_on_a_host_without_it_fails_at_start_saying_what_is_missing() {
    require_node!();
    let home = tempfile::tempdir().unwrap();
    let mut cfg = node_common::config(home.path(), 54);
    cfg.backend = BackendKind::Microvm;
    let Some(reason) = unavailable_reason(&cfg.guest_kernel, &cfg.vmm_binary) else {
        println!("NOT RUN HERE: microVMs can run on this host, so AENV_BACKEND=microvm starts");
        return;
    };
    let e = match Daemon::start(cfg).await {
        Ok(_) => panic!("AENV_BACKEND=microvm must fail here"),
        Err(e) => e.to_string(),
    };
    assert_eq!(
        e,
        format!(
            "AENV_BACKEND=microvm cannot run on this host: {reason}; or use AENV_BACKEND=jail (or auto)"
        )
    );
}
