//! The real guest agent (`agentenv-guest --init`) as PID 1 of a jail sandbox: it answers
//! at the sandbox's address and runs a command whose output comes back.

mod common;

use std::path::PathBuf;
use std::time::Duration;

use agentenv_guest::client::GuestClient;
use agentenv_node::backend::SandboxBackend;
use agentenv_node::backend::agent::wait_ready;

/// The agent binary: `AGENTENV_GUEST_BIN`, else one in the workspace's target directory
/// (the static build of `agentenv-guest/build-static.sh`, else `cargo build -p agentenv-guest`).
fn guest_binary() -> Option<PathBuf> {
    agentenv_testkit::bins::find_binary("AGENTENV_GUEST_BIN", "agentenv-guest")
}

/// Creates a sandbox running the real agent with `args`; `Err(agent log)` when it never
/// became ready.
async fn create_with_agent(
    b: &agentenv_node::backend::jail::JailBackend,
    name: &str,
) -> Result<agentenv_node::backend::SandboxInfo, String> {
    let mut spec = common::spec(&common::id(name));
    spec.env.insert("FROM_NODE".into(), "node-env".into());
    let info = b.create(spec).await.unwrap();
    match wait_ready(
        info.address.agent(),
        Duration::from_secs(10),
        Duration::from_millis(2),
    )
    .await
    {
        Ok(()) => Ok(info),
        Err(e) => {
            let log = common::agent_log(b, &info.id);
            b.destroy(&info.id).await.unwrap();
            Err(format!("{e}\nagent log:\n{log}"))
        }
    }
}

/// Runs a shell command through the agent's Connect API; returns its stdout lines.
async fn run(info: &agentenv_node::backend::SandboxInfo, script: &str) -> Vec<String> {
    let client = GuestClient::new(&format!("http://{}", info.address.agent())).unwrap();
    assert!(client.health().await.unwrap());
    let out = client.run("/bin/sh", &["-c", script]).await.unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_string)
        .collect()
}

const SCRIPT: &str =
    "echo hello from $(hostname); echo $FROM_NODE; cat /proc/1/cmdline | tr '\\0' ' '";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guest_agent_answers_at_the_sandbox_address_and_runs_a_command() {
    require_jail!();
    let Some(agent) = guest_binary() else {
        eprintln!(
            "SKIPPED: no agentenv-guest binary: build it with `cargo build -p agentenv-guest` or set AGENTENV_GUEST_BIN"
        );
        return;
    };
    // The agent itself as PID 1 (server mode).
    let (b, _data) = common::backend_with(|c| {
        c.agent_binary = agent.clone();
        c.agent_args = vec![];
    })
    .await;
    let info = create_with_agent(&b, "guest")
        .await
        .unwrap_or_else(|log| panic!("{log}"));
    let lines = run(&info, SCRIPT).await;
    assert_eq!(lines[0], format!("hello from {}", info.id), "{lines:?}");
    assert_eq!(lines[1], "node-env");
    assert_eq!(
        lines[2].trim(),
        "/agentenv/agentenv-guest",
        "PID 1 is the agent"
    );
    b.destroy(&info.id).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guest_agent_in_init_mode_is_pid_1_and_runs_a_command() {
    require_jail!();
    let Some(agent) = guest_binary() else {
        eprintln!(
            "SKIPPED: no agentenv-guest binary: build it with `cargo build -p agentenv-guest` or set AGENTENV_GUEST_BIN"
        );
        return;
    };
    let (b, _data) = common::backend_with(|c| c.agent_binary = agent.clone()).await;
    // The jail mounts /proc, /dev/pts and /dev/shm before exec and forbids
    // mounting: init mode must keep what is in place.
    let info = create_with_agent(&b, "guest-init")
        .await
        .unwrap_or_else(|log| panic!("{log}"));
    let lines = run(&info, SCRIPT).await;
    assert_eq!(lines[0], format!("hello from {}", info.id), "{lines:?}");
    assert_eq!(lines[1], "node-env");
    assert!(
        lines[2].starts_with("/agentenv/agentenv-guest --init"),
        "{lines:?}"
    );
    // Commands start with no blocked signal, so SIGTERM and Ctrl-C reach them.
    let blocked = run(&info, "grep SigBlk /proc/self/status").await;
    assert_eq!(blocked, ["SigBlk:\t0000000000000000"], "{blocked:?}");
    let after_term = run(&info, "kill -TERM $$; echo survived").await;
    assert!(after_term.is_empty(), "SIGTERM was ignored: {after_term:?}");
    b.destroy(&info.id).await.unwrap();
}
