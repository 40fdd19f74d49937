//! Init mode as PID 1 of a fresh PID and mount namespace (made with
//! `unshare`): orphans are reaped, the agent is restarted when it dies, and
//! SIGTERM stops everything cleanly.

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use agentenv_guest::client::GuestClient;
use agentenv_testkit::{eventually, free_port};

fn can_unshare() -> Result<(), String> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Err("needs root for PID and mount namespaces".into());
    }
    let ok = Command::new("unshare")
        .args(["--pid", "--fork", "--mount", "true"])
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    if !ok {
        return Err("`unshare --pid --fork --mount` is not available (util-linux)".into());
    }
    Ok(())
}

async fn run_sh(c: &GuestClient, script: &str) -> String {
    let out = c.run("/bin/sh", &["-c", script]).await.unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[tokio::test]
async fn init_mode_reaps_orphans_restarts_the_agent_and_stops_on_sigterm() {
    if let Err(why) = can_unshare() {
        eprintln!("SKIPPED init mode test: {why}");
        return;
    }
    let port = free_port();
    let mut unshare = Command::new("unshare")
        .args([
            "--pid",
            "--fork",
            "--mount",
            "--propagation",
            "private",
            "--kill-child",
        ])
        .arg(env!("CARGO_BIN_EXE_agentenv-guest"))
        .args(["--init", "--addr", "127.0.0.1", "--port", &port.to_string()])
        .env("RUST_LOG", "warn")
        .env("AGENTENV_GUEST_DEFAULT_WORKDIR", "/")
        .stdin(Stdio::null())
        .spawn()
        .unwrap();
    let url = format!("http://127.0.0.1:{port}");
    let c = GuestClient::new(&url).unwrap();
    eventually(
        "the agent under init to answer /health",
        Duration::from_secs(10),
        || async { c.health().await.ok().filter(|h| *h).map(|_| ()) },
    )
    .await;

    // We are in a new PID namespace with a fresh /proc: PID 1 is init mode.
    let cmdline = run_sh(&c, "tr '\\0' ' ' < /proc/1/cmdline").await;
    assert!(cmdline.contains("--init"), "PID 1 is {cmdline:?}");

    // The agent's own configuration variables do not reach processes.
    let leaked = run_sh(&c, "env | grep -c '^AGENTENV_GUEST_' || true").await;
    assert_eq!(
        leaked.trim(),
        "0",
        "agent configuration leaked into a process"
    );
    assert_eq!(run_sh(&c, "pwd").await.trim(), "/");

    // Processes start with no blocked signal (init's own mask is not
    // inherited), so SIGTERM and Ctrl-C reach them.
    let blocked = run_sh(&c, "grep SigBlk /proc/self/status").await;
    assert_eq!(blocked.trim(), "SigBlk:\t0000000000000000", "{blocked:?}");
    let killed = c
        .run("/bin/sh", &["-c", "kill -TERM $$; sleep 5; echo survived"])
        .await
        .unwrap();
    assert!(
        !String::from_utf8_lossy(&killed.stdout).contains("survived"),
        "SIGTERM was ignored"
    );

    // An orphan is re-parented to PID 1 and reaped when it exits.
    run_sh(&c, "sleep 0.3 & exit 0").await;
    let zombies = "for f in /proc/[0-9]*/stat; do read -r l < $f && case \"$l\" in *') Z '*) echo \"$l\";; esac; done 2>/dev/null";
    let orphan_seen = run_sh(&c, "ps_sleep=0; for f in /proc/[0-9]*/comm; do read -r n < $f 2>/dev/null && [ \"$n\" = sleep ] && ps_sleep=1; done; echo $ps_sleep").await;
    assert_eq!(
        orphan_seen.trim(),
        "1",
        "the orphaned sleep should still be running"
    );
    eventually("the orphan to be reaped", Duration::from_secs(10), || async {
        let z = run_sh(&c, zombies).await;
        let sleeping = run_sh(&c, "for f in /proc/[0-9]*/comm; do read -r n < $f 2>/dev/null && [ \"$n\" = sleep ] && echo y; done").await;
        (z.trim().is_empty() && sleeping.trim().is_empty()).then_some(())
    })
    .await;

    // Kill the agent (the parent of the shell): init restarts it.
    let agent_pid = run_sh(&c, "echo $PPID").await;
    let started = Instant::now();
    let _ = c
        .run("/bin/sh", &["-c", &format!("kill -9 {}", agent_pid.trim())])
        .await;
    eventually(
        "the agent to be restarted",
        Duration::from_secs(15),
        || async {
            let fresh = GuestClient::new(&url).unwrap();
            let pid = fresh.run("/bin/sh", &["-c", "echo $PPID"]).await.ok()?;
            let pid = String::from_utf8_lossy(&pid.stdout).trim().to_string();
            (pid != agent_pid.trim()).then_some(())
        },
    )
    .await;
    eprintln!("agent restarted after {:?}", started.elapsed());

    // SIGTERM to init stops the agent and init exits 0.
    let children = std::fs::read_to_string(format!(
        "/proc/{}/task/{}/children",
        unshare.id(),
        unshare.id()
    ))
    .unwrap();
    let init_pid: i32 = children.split_whitespace().next().unwrap().parse().unwrap();
    // SAFETY: kill has no memory-safety preconditions.
    assert_eq!(unsafe { libc::kill(init_pid, libc::SIGTERM) }, 0);
    let status = eventually(
        "init to exit after SIGTERM",
        Duration::from_secs(15),
        || std::future::ready(unshare.try_wait().unwrap()),
    )
    .await;
    assert!(status.success(), "init exited with {status:?}");
}
