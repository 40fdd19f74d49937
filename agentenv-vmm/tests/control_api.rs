//! The `agentenv-vmm` binary driven over its control socket: a guest program is started,
//! paused, snapshotted, resumed and stopped; a snapshot is restored by a second process;
//! bad requests get an error and the process keeps serving; a bad configuration ends the
//! process with one line naming the field; a missing socket gives a clear client error.

mod common;
mod support;

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use agentenv_vmm::VmConfig;
use agentenv_vmm::control::{ClientError, SnapshotKind, VmmClient};
use agentenv_vmm::snapshot::{MEMORY_FILE, STATE_FILE};
use common::*;
use support::ending_kernel;

const TIMEOUT: Duration = Duration::from_secs(30);

/// The configuration (`dir/vm.json`) of a VM whose guest prints `ready`, then halts with
/// interrupts off (the vCPU sleeps in the kernel).
fn halting_vm_config(dir: &Path) -> PathBuf {
    let mut c = VmConfig::new(halting_guest(dir));
    c.memory_mib = 32;
    c.serial_output = Some(dir.join("serial.log"));
    let path = dir.join("vm.json");
    std::fs::write(&path, serde_json::to_vec(&c).unwrap()).unwrap();
    path
}

fn vmm(config: &Path, sock: &Path, extra: &[&str]) -> Child {
    Command::new(env!("CARGO_BIN_EXE_agentenv-vmm"))
        .arg("--config")
        .arg(config)
        .arg("--api-sock")
        .arg(sock)
        .args(extra)
        .stdin(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// Sends raw lines on one connection and returns the answer lines.
fn raw_exchange(sock: &Path, lines: &[&str]) -> Vec<serde_json::Value> {
    let mut s = UnixStream::connect(sock).unwrap();
    s.set_read_timeout(Some(TIMEOUT)).unwrap();
    let mut r = BufReader::new(s.try_clone().unwrap());
    let mut out = Vec::new();
    for l in lines {
        s.write_all(l.as_bytes()).unwrap();
        s.write_all(b"\n").unwrap();
        let mut answer = String::new();
        r.read_line(&mut answer).unwrap();
        out.push(serde_json::from_str(&answer).unwrap());
    }
    out
}

/// The `Seccomp:` field of a process's status (0 none, 2 filter).
fn seccomp_mode(pid: u32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("Seccomp:"))
        .unwrap()
        .trim()
        .to_string()
}

fn wait_exit(child: &mut Child) -> std::process::ExitStatus {
    let deadline = std::time::Instant::now() + TIMEOUT;
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return s;
        }
        assert!(std::time::Instant::now() < deadline, "the VMM did not exit");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn a_vm_is_paused_snapshotted_resumed_stopped_and_restored_over_the_socket() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let config = halting_vm_config(dir.path());
    let sock = dir.path().join("api.sock");
    let log = dir.path().join("vmm.log");
    let mut child = vmm(
        &config,
        &sock,
        &["--start", "--log-file", log.to_str().unwrap()],
    );
    let rt = runtime();
    let client = VmmClient::new(&sock, "t1");
    let status = rt.block_on(client.wait_ready(TIMEOUT)).unwrap();
    assert_eq!(status["state"], "running");
    assert_eq!(seccomp_mode(child.id()), "2", "strict is the default");
    assert!(wait_until(TIMEOUT, || {
        std::fs::read_to_string(dir.path().join("serial.log"))
            .unwrap_or_default()
            .contains("ready")
    }));

    // Snapshot of a running VM is refused; the VM keeps running.
    let snap = dir.path().join("snap");
    let e = rt
        .block_on(client.snapshot(&snap, SnapshotKind::Full, TIMEOUT))
        .unwrap_err();
    assert!(
        matches!(&e, ClientError::Refused { message, .. } if message.contains("pause it")),
        "{e}"
    );
    assert_eq!(rt.block_on(client.status()).unwrap()["state"], "running");

    assert_eq!(rt.block_on(client.pause()).unwrap()["state"], "paused");
    let info = rt
        .block_on(client.snapshot(&snap, SnapshotKind::Full, TIMEOUT))
        .unwrap();
    assert_eq!(info["kind"], "full");
    assert!(snap.join(STATE_FILE).is_file());
    assert!(snap.join(MEMORY_FILE).is_file());
    let m = rt.block_on(client.metrics()).unwrap();
    assert_eq!(m["pauses"], 1, "{m}");
    assert_eq!(m["snapshots"], 1, "{m}");
    assert_eq!(m["state"], "paused");
    assert!(m["rss_bytes"].as_u64().unwrap() > 0, "{m}");

    // Bad requests on the same connection get errors; the next good one is served.
    let answers = raw_exchange(
        &sock,
        &[
            "not json",
            r#"{"action":"reboot"}"#,
            r#"{"action":"balloon_set_target","mib":8}"#,
            r#"{"action":"status"}"#,
        ],
    );
    assert!(
        answers[0]["error"]
            .as_str()
            .unwrap()
            .contains("bad request")
    );
    assert!(answers[1]["error"].as_str().unwrap().contains("reboot"));
    assert!(answers[2]["error"].as_str().unwrap().contains("balloon"));
    assert_eq!(answers[3]["ok"]["state"], "paused");

    assert_eq!(rt.block_on(client.resume()).unwrap()["state"], "running");
    let stopped = rt.block_on(client.stop()).unwrap();
    assert_eq!(stopped["state"], "exited");
    assert_eq!(stopped["exit_reason"]["reason"], "stopped");
    assert!(wait_exit(&mut child).success());
    assert!(!sock.exists(), "the socket is removed on exit");
    let e = rt.block_on(client.status()).unwrap_err();
    assert!(
        e.to_string()
            .contains("the VMM process for sandbox t1 is not running"),
        "{e}"
    );
    assert!(
        std::fs::read_to_string(&log).unwrap().contains("VMM ready"),
        "the log file gets the VMM's log"
    );

    // A second process restores the snapshot and runs it.
    let mut restored = vmm(
        &config,
        &sock,
        &["--restore", snap.to_str().unwrap(), "--start"],
    );
    let status = rt.block_on(client.wait_ready(TIMEOUT)).unwrap();
    assert_eq!(status["state"], "running");
    assert_eq!(rt.block_on(client.pause()).unwrap()["state"], "paused");
    rt.block_on(client.stop()).unwrap();
    assert!(wait_exit(&mut restored).success());
}

#[test]
fn without_start_the_vm_waits_for_the_start_action() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let config = halting_vm_config(dir.path());
    let sock = dir.path().join("api.sock");
    let mut child = vmm(&config, &sock, &["--seccomp", "off"]);
    let rt = runtime();
    let client = VmmClient::new(&sock, "t2");
    assert_eq!(
        rt.block_on(client.wait_ready(TIMEOUT)).unwrap()["state"],
        "created"
    );
    assert_eq!(seccomp_mode(child.id()), "0");
    assert!(
        !std::fs::read_to_string(dir.path().join("serial.log"))
            .unwrap_or_default()
            .contains("ready"),
        "the guest ran before start"
    );
    let e = rt.block_on(client.pause()).unwrap_err();
    assert!(e.to_string().contains("send start first"), "{e}");
    assert_eq!(rt.block_on(client.start()).unwrap()["state"], "running");
    assert!(wait_until(TIMEOUT, || {
        std::fs::read_to_string(dir.path().join("serial.log"))
            .unwrap_or_default()
            .contains("ready")
    }));
    rt.block_on(client.stop()).unwrap();
    assert!(wait_exit(&mut child).success());
}

#[test]
fn a_guest_that_ends_ends_the_process() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let c = VmConfig::new(ending_kernel(dir.path()));
    let config = dir.path().join("vm.json");
    std::fs::write(&config, serde_json::to_vec(&c).unwrap()).unwrap();
    let sock = dir.path().join("api.sock");
    let mut child = vmm(&config, &sock, &["--start"]);
    assert!(wait_exit(&mut child).success());
    assert!(!sock.exists());
}

#[test]
fn a_bad_configuration_ends_the_process_with_one_line_naming_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let kernel = dir.path().join("vmlinux");
    std::fs::write(&kernel, b"x").unwrap();
    let mut c = VmConfig::new(&kernel);
    c.memory_mib = 1;
    let config = dir.path().join("vm.json");
    std::fs::write(&config, serde_json::to_vec(&c).unwrap()).unwrap();
    let sock = dir.path().join("api.sock");
    let out = vmm(&config, &sock, &["--start"])
        .wait_with_output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(err.starts_with("agentenv-vmm: "), "{err}");
    assert!(err.contains("memory_mib"), "{err}");
    assert!(!sock.exists(), "nothing listens after a bad configuration");

    // Not JSON at all: the parse error says where.
    std::fs::write(&config, b"{\"vcpus\": 1,").unwrap();
    let out = vmm(&config, &sock, &[]).wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("parsing the VM configuration"), "{err}");
}

#[test]
fn a_client_of_a_missing_socket_says_the_vmm_is_not_running() {
    let dir = tempfile::tempdir().unwrap();
    let rt = runtime();
    let client = VmmClient::new(dir.path().join("nope.sock"), "sbx-9");
    let e = rt.block_on(client.status()).unwrap_err();
    assert_eq!(
        e.to_string(),
        format!(
            "the VMM process for sandbox sbx-9 is not running (no API socket at {})",
            dir.path().join("nope.sock").display()
        )
    );
    let e = rt
        .block_on(client.wait_ready(Duration::from_millis(50)))
        .unwrap_err();
    assert!(matches!(e, ClientError::Timeout { .. }), "{e}");
}

#[test]
fn a_server_that_never_answers_times_the_client_out() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("slow.sock");
    // A listener that accepts and never answers.
    let listener = std::os::unix::net::UnixListener::bind(&sock).unwrap();
    let rt = runtime();
    let client = VmmClient::new(&sock, "slow").with_timeout(Duration::from_millis(100));
    let e = rt.block_on(client.status()).unwrap_err();
    assert!(
        e.to_string().contains("did not answer status within"),
        "{e}"
    );
    drop(listener);
}

#[test]
fn the_balloon_target_is_set_and_its_statistics_read_over_the_socket_under_the_filter() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let config = halting_vm_config(dir.path());
    let mut c: VmConfig = serde_json::from_slice(&std::fs::read(&config).unwrap()).unwrap();
    c.balloon = Some(agentenv_vmm::config::BalloonConfig {
        amount_mib: 0,
        deflate_on_oom: true,
        stats_polling_interval_s: 0,
    });
    std::fs::write(&config, serde_json::to_vec(&c).unwrap()).unwrap();
    let sock = dir.path().join("api.sock");
    // Strict seccomp and no --start: the vCPU thread starts under the filter.
    let mut child = vmm(&config, &sock, &[]);
    let rt = runtime();
    let client = VmmClient::new(&sock, "t3");
    rt.block_on(client.wait_ready(TIMEOUT)).unwrap();
    assert_eq!(seccomp_mode(child.id()), "2");
    assert_eq!(rt.block_on(client.start()).unwrap()["state"], "running");
    assert!(wait_until(TIMEOUT, || {
        std::fs::read_to_string(dir.path().join("serial.log"))
            .unwrap_or_default()
            .contains("ready")
    }));
    assert_eq!(
        rt.block_on(client.balloon_set_target(8)).unwrap()["target_mib"],
        8
    );
    let stats = rt.block_on(client.balloon_stats()).unwrap();
    assert_eq!(stats["target_mib"], 8, "{stats}");
    // The guest program has no balloon driver: nothing is given back.
    assert_eq!(stats["actual_mib"], 0, "{stats}");
    let e = rt.block_on(client.balloon_set_target(64)).unwrap_err();
    assert!(
        e.to_string().contains("more than the guest's 32 MiB"),
        "{e}"
    );
    rt.block_on(client.stop()).unwrap();
    assert!(wait_exit(&mut child).success());
}
