//! The host firewall chains a test's backends install (`AGENTENV-<PREFIX>-…`): an
//! interface prefix of this test process's own, the chains' lines in `iptables-save`,
//! and their removal when the process exits.
//!
//! Tests run in parallel processes, so each removes only its own prefix's chains, and
//! only once its sandboxes' interfaces are gone (the removal refuses otherwise).

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use agentenv_node::host::net;

/// `first` and four letters from the process id: no other test process running now has
/// it (process ids stay below 26^4 on these hosts; above, they wrap around).
pub fn process_prefix(first: char) -> String {
    let mut n = std::process::id() % (26 * 26 * 26 * 26);
    let mut s = String::from(first);
    for _ in 0..4 {
        s.push((b'a' + (n % 26) as u8) as char);
        n /= 26;
    }
    s
}

/// Lines of `iptables-save` (filter and nat tables) that name a chain of `prefix`: its
/// chains, their rules and the jumps to them.
pub fn chain_lines(prefix: &str) -> Vec<String> {
    let needle = format!("AGENTENV-{}-", prefix.to_ascii_uppercase());
    let mut out = Vec::new();
    for table in ["filter", "nat"] {
        let o = std::process::Command::new("iptables-save")
            .args(["-t", table])
            .output()
            .expect("iptables-save");
        assert!(o.status.success(), "iptables-save -t {table} failed");
        out.extend(
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .filter(|l| l.contains(&needle))
                .map(str::to_string),
        );
    }
    out
}

/// How long a removal waits for the kernel to remove the veths of closed namespaces.
pub const LINGER: Duration = Duration::from_secs(10);

/// Removes `prefix`'s chains now; a refusal (sandboxes still there) or failure is
/// reported on stderr, the chains then stay.
pub async fn remove(prefix: &str, runtime_dir: &Path) {
    if let Err(e) = net::uninstall_host_rules(prefix, runtime_dir, LINGER).await {
        eprintln!("host rules of {prefix} stay: {e}");
    }
}

/// [`remove`] from blocking code, on a runtime of its own in a thread of its own (the
/// caller may be inside a runtime).
pub fn remove_blocking(prefix: &str, runtime_dir: &Path) {
    let (p, dir) = (prefix.to_string(), runtime_dir.to_path_buf());
    let r = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| e.to_string())?;
        rt.block_on(remove(&p, &dir));
        Ok::<(), String>(())
    })
    .join();
    match r {
        Ok(Ok(())) => {}
        Ok(Err(e)) => eprintln!("host rules of {prefix} stay: no runtime: {e}"),
        Err(_) => eprintln!("host rules of {prefix} stay: removing them panicked"),
    }
}

static AT_EXIT: Mutex<Vec<(String, PathBuf)>> = Mutex::new(Vec::new());

/// Removes `prefix`'s chains when this test process exits (after the test's backends are
/// gone, whatever the test's outcome).
pub fn remove_at_exit(prefix: &str, runtime_dir: &Path) {
    let mut list = AT_EXIT.lock().unwrap_or_else(|e| e.into_inner());
    if list.iter().any(|(p, d)| p == prefix && d == runtime_dir) {
        return;
    }
    if list.is_empty() {
        // SAFETY: registers a function without arguments that does not unwind (it
        // catches panics) and touches only state that lives until the process ends.
        unsafe { libc::atexit(remove_registered) };
    }
    list.push((prefix.to_string(), runtime_dir.to_path_buf()));
}

extern "C" fn remove_registered() {
    let list = std::mem::take(&mut *AT_EXIT.lock().unwrap_or_else(|e| e.into_inner()));
    // Panics are caught: this runs inside libc's exit and must not unwind.
    let _ = std::panic::catch_unwind(move || {
        for (prefix, dir) in list {
            remove_blocking(&prefix, &dir);
        }
    });
}
