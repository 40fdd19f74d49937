//! The official E2B Python SDK (PyPI `e2b`, debug mode) against the agent
//! binary on localhost:49983.
//!
//! The SDK comes from the virtual environment `agentenv_tests::e2b_python`
//! creates once under the target dir (`python3 -m venv`, `pip install e2b`). Debug mode pins port 49983, so
//! this is the only test that uses it, and a file lock keeps two runs of it
//! apart.

mod common;

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

struct KillOnDrop(std::process::Child);
impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn official_e2b_python_sdk_drives_the_agent() {
    let py = match agentenv_tests::e2b_python() {
        Ok(p) => p,
        Err(why) => {
            eprintln!("SKIPPED official_e2b_python_sdk_drives_the_agent: {why}");
            return;
        }
    };
    // Only one user of port 49983 at a time.
    let lock = File::create(agentenv_testkit::target_dir().join("e2b-sdk-49983.lock")).unwrap();
    // SAFETY: flock on a valid fd.
    assert_eq!(unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) }, 0);

    let agent = Command::new(env!("CARGO_BIN_EXE_agentenv-guest"))
        .args(["--port", "49983", "--addr", "127.0.0.1"])
        .env("RUST_LOG", "warn")
        .spawn()
        .expect("starting the agent binary");
    let _agent = KillOnDrop(agent);
    agentenv_testkit::eventually_blocking(
        "the agent to listen on 49983",
        Duration::from_secs(10),
        || std::net::TcpStream::connect("127.0.0.1:49983"),
    );

    let base = tempfile::tempdir().unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/e2b_sdk_script.py");
    let out = Command::new(&py)
        .arg(&script)
        .arg(base.path())
        .env("E2B_DEBUG", "true")
        .env(
            "E2B_API_KEY",
            "e2b_0000000000000000000000000000000000000000",
        )
        .output()
        .expect("running the SDK script");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("{stdout}");
    eprintln!("{stderr}");
    assert!(
        out.status.success(),
        "SDK script failed:\n{stdout}\n{stderr}"
    );
    assert!(stdout.contains("checks passed"), "{stdout}");
}
