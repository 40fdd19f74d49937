//! The jail backend end to end: real namespaces, cgroups, veth pairs and overlay roots.
//! Needs root; each test says so and returns when it cannot run here.

mod common;

use agentenv_node::backend::{SandboxBackend, SandboxState};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn test_agent_answers_at_the_sandbox_address_and_runs_a_command() {
    require_jail!();
    let (b, _data) = common::backend().await;
    let mut spec = common::spec(&common::id("hello"));
    spec.env
        .insert("GREETING".into(), "hi from the host".into());
    let info = common::create_ready(&b, spec).await;
    assert_eq!(info.state, SandboxState::Running);
    let out = common::sh(
        &info,
        "echo \"$GREETING\"; cat /etc/debian_version; hostname; id -u",
    )
    .await;
    assert_eq!(out.exit, 0, "{out:?}");
    let lines: Vec<&str> = out.stdout.lines().collect();
    assert_eq!(lines[0], "hi from the host");
    assert!(lines[1].starts_with("12."), "bookworm: {lines:?}");
    assert_eq!(lines[2], info.id);
    assert_eq!(lines[3], "0");
    // PID 1 is the agent.
    let out = common::sh(&info, "cat /proc/1/cmdline | tr '\\0' ' '").await;
    assert!(
        out.stdout.contains("/agentenv/agentenv-guest init"),
        "{out:?}"
    );
    assert_eq!(b.list().await.len(), 1);
    b.destroy(&info.id).await.unwrap();
    assert!(b.list().await.is_empty());
}
