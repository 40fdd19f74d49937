//! Control-plane processes started one by one, for tests that kill and restart them: a
//! config file of the test's own, schedulers (primary or `-query-only`) and gateways on
//! addresses the test chooses, a hard kill, and a client loop that records every status
//! it gets.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::{API_KEY, Proc, binary};

/// The control-plane config of a test cluster of `nodes` (id, address), as
/// [`crate::Cluster`] writes it: loopback listeners on free ports, a 10 s report TTL,
/// 10 min bindings. Edit it before writing it with [`write_config`].
pub fn config(nodes: &[(String, SocketAddr)]) -> serde_json::Value {
    let node_list: Vec<serde_json::Value> = nodes
        .iter()
        .map(|(id, a)| serde_json::json!({"id": id, "endpoint": format!("http://{a}")}))
        .collect();
    serde_json::json!({
        "log_level": "info",
        "log_format": "json",
        "scheduler": {
            "grpc_listen_addr": "127.0.0.1:0",
            "metrics_listen_addr": "127.0.0.1:0",
            "strategy": "round_robin",
            "report_ttl": "10s",
            "binding_ttl": "10m",
            "nodes": node_list,
        },
        "gateway": {
            "http_listen_addr": "127.0.0.1:0",
            "metrics_listen_addr": "127.0.0.1:0",
            "scheduler_addr": "",
            "request_timeout": "120s",
        }
    })
}

/// Writes `config` to `<dir>/<name>.json`.
pub fn write_config(dir: &Path, name: &str, config: &serde_json::Value) -> PathBuf {
    let path = dir.join(format!("{name}.json"));
    std::fs::write(&path, config.to_string()).expect("write config");
    path
}

/// Starts `agentenv-scheduler -config <config> <args>` and waits until it listens;
/// returns the process and its gRPC address.
pub fn start_scheduler(name: &str, config: &Path, args: &[&str]) -> (Proc, String) {
    let mut cmd = Command::new(binary("agentenv-scheduler").expect("scheduler binary"));
    cmd.arg("-config")
        .arg(config)
        .args(args)
        .env("LOG_FORMAT", "json");
    let proc = Proc::spawn(name, cmd);
    let v = proc.wait_for("scheduler listening", Duration::from_secs(30));
    let addr = v["grpc_addr"].as_str().expect("grpc_addr").to_string();
    (proc, addr)
}

/// Starts `agentenv-gateway -config <config>` with the cluster's API key and waits until
/// it listens; returns the process and its HTTP address.
pub fn start_gateway(name: &str, config: &Path) -> (Proc, SocketAddr) {
    let mut cmd = Command::new(binary("agentenv-gateway").expect("gateway binary"));
    cmd.arg("-config")
        .arg(config)
        .env("LOG_FORMAT", "json")
        .env("AENV_API_KEY", API_KEY);
    let proc = Proc::spawn(name, cmd);
    let v = proc.wait_for("gateway listening", Duration::from_secs(30));
    let addr = v["http_addr"]
        .as_str()
        .expect("http_addr")
        .parse()
        .expect("gateway address");
    (proc, addr)
}

/// Kills the process with SIGKILL (no clean shutdown) and reaps it.
pub fn kill_hard(proc: &mut Proc) {
    let pid = nix::unistd::Pid::from_raw(proc.pid() as i32);
    let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
    proc.stop();
}

/// A thread sending one request after another until stopped, keeping each answer's
/// status and body.
pub struct ClientLoop {
    stop: Arc<AtomicBool>,
    seen: Arc<Mutex<Vec<(u16, String)>>>,
    thread: Option<JoinHandle<()>>,
}

impl ClientLoop {
    /// Starts calling `request` (which returns a status and a body) in a loop.
    pub fn start(request: impl Fn() -> (u16, String) + Send + 'static) -> ClientLoop {
        let stop = Arc::new(AtomicBool::new(false));
        let seen = Arc::new(Mutex::new(Vec::new()));
        let thread = {
            let (stop, seen) = (stop.clone(), seen.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    let answer = request();
                    seen.lock().unwrap().push(answer);
                    std::thread::sleep(Duration::from_millis(20));
                }
            })
        };
        ClientLoop {
            stop,
            seen,
            thread: Some(thread),
        }
    }

    /// How many answers so far.
    pub fn count(&self) -> usize {
        self.seen.lock().unwrap().len()
    }

    /// The answers from index `from` on.
    pub fn since(&self, from: usize) -> Vec<(u16, String)> {
        self.seen.lock().unwrap()[from..].to_vec()
    }

    /// Waits until `more` answers came after the `from`-th.
    pub fn wait_for_more(&self, from: usize, more: usize) {
        agentenv_testkit::eventually_blocking(
            format_args!("{more} more answers of the client loop"),
            Duration::from_secs(120),
            || self.count() >= from + more,
        );
    }

    /// Stops the loop and returns every answer.
    pub fn finish(mut self) -> Vec<(u16, String)> {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            t.join().expect("client loop thread");
        }
        self.since(0)
    }
}

impl Drop for ClientLoop {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}
