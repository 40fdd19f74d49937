//! The attempts must be able to see an escape: run unconfined (root on the test
//! machine, in no sandbox), every attempt that is safe to run there reports
//! `contained: false`. An attempt that reported "contained" here could never fail, and
//! would prove nothing in the attack suite (`tests/tests/attack_suite.rs`).

use std::path::Path;
use std::process::Command;

#[test]
fn unconfined_root_escapes_every_attempt_that_is_safe_to_run_on_the_host() {
    if !nix_root() {
        eprintln!("SKIPPED: the unconfined attempts need root (mknod, mount, raw sockets)");
        return;
    }
    let mut expect = vec![
        "seccomp-filter-on",
        "host-processes-invisible",
        "namespaces-distinct",
        "syscall-userfaultfd",
        "syscall-keyctl",
        "syscall-perf_event_open",
        "syscall-unshare-newuser",
        "mount-tmpfs",
        "unshare-newns",
        "clone-newuser",
        "userns-then-mount",
        "raw-socket-inet",
        "fork-bomb",
        "memory-bomb",
        "disk-fill:/root",
    ];
    // A host setting, not a sandbox, may turn io_uring off.
    if std::fs::read_to_string("/proc/sys/kernel/io_uring_disabled")
        .map(|v| v.trim() == "0")
        .unwrap_or(true)
    {
        expect.push("syscall-io_uring_setup");
    }
    if Path::new("/dev/kvm").exists() {
        expect.push("mknod-kvm:/tmp");
    }
    let own_ns: Vec<String> = ["user", "mnt", "pid", "net", "uts", "ipc", "cgroup"]
        .iter()
        .filter_map(|k| std::fs::read_link(format!("/proc/self/ns/{k}")).ok())
        .map(|l| l.to_string_lossy().into_owned())
        .collect();
    let own_comm = std::fs::read_to_string("/proc/self/comm").unwrap_or_default();
    let out = Command::new(env!("CARGO_BIN_EXE_sandbox-attack"))
        .arg(expect.join(","))
        .args(["--host-ns", &own_ns.join(",")])
        .args(["--host-comm", own_comm.trim()])
        .args(["--fork-max", "64", "--memory-mb", "16"])
        .args(["--disk-cap-mb", "8", "--disk-slack-mb", "8"])
        .output()
        .expect("running sandbox-attack");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "sandbox-attack failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut wrong = Vec::new();
    for name in &expect {
        let line = stdout.lines().find_map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).ok()?;
            (v["attempt"] == *name).then_some(v)
        });
        match line {
            Some(v) if v["contained"] == false => {}
            Some(v) => wrong.push(format!("{name}: {}", v["detail"])),
            None => wrong.push(format!("{name}: no result")),
        }
    }
    assert!(
        wrong.is_empty(),
        "these attempts report \"contained\" for an unconfined root process, so they could never fail:\n{}\n\nfull output:\n{stdout}",
        wrong.join("\n")
    );
}

fn nix_root() -> bool {
    nix::unistd::Uid::effective().is_root()
}
