//! How the agent starts a process: a plain one (pipes, the agent's own user)
//! through `posix_spawn`, anything else through std's fork. Both must give
//! the child the same start: its own process group, no blocked signal,
//! `SIGPIPE` at its default, exactly the requested environment, argv[0] as
//! asked, the right working directory; and the same errors.

mod common;

use std::collections::{BTreeMap, HashMap};
use std::os::unix::fs::PermissionsExt;

use agentenv_guest::client::{ClientError, GuestClient, ProcessOutput, collect_output};
use agentenv_guest::connect::Code;
use agentenv_guest::proto::process as pr;
use agentenv_guest::server::AgentOptions;
use common::TestAgent;
use futures::StreamExt;

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

async fn run_with(
    c: &GuestClient,
    cmd: &str,
    args: &[&str],
    envs: &[(&str, &str)],
    cwd: Option<&str>,
) -> Result<ProcessOutput, ClientError> {
    let req = pr::StartRequest {
        process: Some(pr::ProcessConfig {
            cmd: cmd.into(),
            args: args.iter().map(|s| s.to_string()).collect(),
            envs: envs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect::<HashMap<_, _>>(),
            cwd: cwd.map(str::to_string),
        }),
        stdin: Some(false),
        ..Default::default()
    };
    let stream = c.start(&req).await?;
    collect_output(stream.map(|r| r.map(|m| m.event))).await
}

fn text(out: &ProcessOutput) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `SigBlk`/`SigIgn` of a `grep` started by the agent, as numbers.
fn signal_masks(status: &str) -> (u64, u64) {
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .map(|v| u64::from_str_radix(v.trim(), 16).unwrap())
            .unwrap_or_else(|| panic!("no {name} in {status:?}"))
    };
    (field("SigBlk:"), field("SigIgn:"))
}

#[tokio::test]
async fn plain_and_other_user_processes_start_alike() {
    if !is_root() {
        eprintln!("SKIPPED plain_and_other_user_processes_start_alike: needs root");
        return;
    }
    let agent = TestAgent::start(AgentOptions::default()).await;
    let root = GuestClient::new(&agent.url()).unwrap();
    let nobody = GuestClient::new(&agent.url()).unwrap().with_user("nobody");
    for (who, c) in [("root", &root), ("nobody", &nobody)] {
        // Its own process group: /proc/self/stat's pgrp (field 5) is its pid.
        let stat = text(
            &run_with(c, "/bin/cat", &["/proc/self/stat"], &[], None)
                .await
                .unwrap(),
        );
        let f: Vec<&str> = stat
            .rsplit(')')
            .next()
            .unwrap()
            .split_whitespace()
            .collect();
        let pid = stat.split_whitespace().next().unwrap();
        assert_eq!(f[2], pid, "{who}: process group of {stat:?}");

        // No blocked signal; SIGPIPE (13) not ignored although the agent ignores it.
        let status = text(
            &run_with(c, "/bin/grep", &["^Sig", "/proc/self/status"], &[], None)
                .await
                .unwrap(),
        );
        let (blocked, ignored) = signal_masks(&status);
        assert_eq!(blocked, 0, "{who}: blocked signals in {status:?}");
        assert_eq!(ignored & (1 << (libc::SIGPIPE - 1)), 0, "{who}: {status:?}");

        // argv[0] as given, the working directory asked for.
        let out = run_with(c, "/bin/sh", &["-c", "echo \"$0|$PWD\""], &[], Some("/tmp"))
            .await
            .unwrap();
        assert_eq!(text(&out), "/bin/sh|/tmp\n", "{who}");
        let end = out.end.unwrap();
        assert_eq!((end.exit_code, end.exited), (0, true), "{who}");

        // Exactly the agent's environment (without its own settings), the
        // user's names, and what the request adds.
        let out = run_with(c, "/usr/bin/env", &["-0"], &[("ASKED", "yes")], None)
            .await
            .unwrap();
        let got: BTreeMap<String, String> = out
            .stdout
            .split(|b| *b == 0)
            .filter(|kv| !kv.is_empty())
            .map(|kv| {
                let kv = String::from_utf8_lossy(kv);
                let (k, v) = kv.split_once('=').unwrap();
                (k.to_string(), v.to_string())
            })
            .collect();
        let mut want: BTreeMap<String, String> = std::env::vars()
            .filter(|(k, _)| !k.starts_with("AGENTENV_GUEST_"))
            .collect();
        want.entry("PATH".into()).or_insert_with(|| {
            "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into()
        });
        let home = if who == "root" {
            "/root"
        } else {
            "/nonexistent"
        };
        for (k, v) in [
            ("HOME", home),
            ("USER", who),
            ("LOGNAME", who),
            ("ASKED", "yes"),
        ] {
            want.insert(k.into(), v.into());
        }
        assert_eq!(got, want, "{who}");

        // stdin=false: reading stdin ends at once.
        let out = run_with(c, "/bin/cat", &[], &[], None).await.unwrap();
        assert_eq!((out.stdout.len(), out.end.unwrap().exit_code), (0, 0));
    }
    agent.stop().await;
}

#[tokio::test]
async fn a_bare_command_name_is_looked_up_in_the_processes_own_path() {
    let agent = TestAgent::start(AgentOptions::default()).await;
    let c = GuestClient::new(&agent.url()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (first, second) = (dir.path().join("a"), dir.path().join("b"));
    std::fs::create_dir_all(first.join("mytool")).unwrap(); // a directory: skipped
    std::fs::create_dir_all(&second).unwrap();
    let not_exec = dir.path().join("c");
    std::fs::create_dir_all(&not_exec).unwrap();
    std::fs::write(not_exec.join("mytool"), "#!/bin/sh\necho wrong\n").unwrap();
    let tool = second.join("mytool");
    std::fs::write(&tool, "#!/bin/sh\necho \"found $0 $1\"\n").unwrap();
    std::fs::set_permissions(&tool, std::fs::Permissions::from_mode(0o755)).unwrap();
    let path = format!(
        "/nonexistent:{}:{}:{}",
        first.display(),
        not_exec.display(),
        second.display()
    );
    let out = run_with(&c, "mytool", &["x"], &[("PATH", &path)], None)
        .await
        .unwrap();
    // A script's $0 is the file found, as with execvp.
    assert_eq!(text(&out), format!("found {} x\n", tool.display()));

    // Not in the process's PATH (though in the agent's): not found.
    let err = run_with(&c, "sh", &["-c", "true"], &[("PATH", &path)], None)
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some(Code::NotFound), "{err}");
    agent.stop().await;
}

#[tokio::test]
async fn start_errors_name_the_cause_with_their_codes() {
    let agent = TestAgent::start(AgentOptions::default()).await;
    let c = GuestClient::new(&agent.url()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data.txt");
    std::fs::write(&data, "not a program").unwrap();
    let missing = dir.path().join("missing");
    // Executable, but neither a binary nor a script with an interpreter line
    // (exec refuses it, as envd's does).
    let script = dir.path().join("plain-script");
    std::fs::write(&script, "echo no interpreter line\n").unwrap();
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    let cases: [(&str, &[&str], Code); 5] = [
        (missing.to_str().unwrap(), &[], Code::NotFound),
        ("no-such-command-x", &[], Code::NotFound),
        (data.to_str().unwrap(), &[], Code::PermissionDenied),
        (script.to_str().unwrap(), &[], Code::Internal),
        ("/bin/echo", &["nul\0byte"], Code::InvalidArgument),
    ];
    for (cmd, args, code) in cases {
        let err = run_with(&c, cmd, args, &[], None).await.unwrap_err();
        assert_eq!(err.code(), Some(code), "{cmd:?} {args:?}: {err}");
        assert!(err.to_string().contains(cmd), "{cmd:?}: {err}");
    }
    // A directory is not a program either (root may execute anything else).
    let err = run_with(&c, dir.path().to_str().unwrap(), &[], &[], None)
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some(Code::PermissionDenied), "{err}");
    // Nothing is left running or listed after the failures.
    assert!(c.list().await.unwrap().is_empty());
    agent.stop().await;
}
