//! A real cluster on loopback (scheduler, gateway, two `agentenv-node` processes):
//! heartbeat rosters with paused sandboxes, the gateway's cluster-wide list, routing of
//! each sandbox to its owner, and the node binary's start-up and shutdown behaviour.

use std::process::Command;
use std::time::Duration;

use agentenv_core::proto::scheduler_v1::scheduler_client::SchedulerClient;
use agentenv_core::proto::scheduler_v1::{ListObservedNodesRequest, LookupNodeRequest};
use agentenv_testkit::eventually_blocking;
use agentenv_tests::{API_KEY, Cluster, api, binary, http, skip_reason};

fn ids(v: &serde_json::Value) -> Vec<String> {
    let mut out: Vec<String> = v
        .as_array()
        .map(|a| {
            a.iter()
                .map(|s| s["sandboxID"].as_str().unwrap_or_default().to_string())
                .collect()
        })
        .unwrap_or_default();
    out.sort();
    out
}

#[test]
fn heartbeat_roster_carries_paused_sandboxes_and_gateway_lists_the_cluster() {
    if let Some(r) = skip_reason() {
        eprintln!("SKIPPED: {r}");
        return;
    }
    let cluster = Cluster::start(2, 4);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut sched = rt
        .block_on(SchedulerClient::connect(format!(
            "http://{}",
            cluster.scheduler
        )))
        .expect("scheduler client");

    // A sandbox created on node 0 directly (no gateway, so no assignment is recorded),
    // then paused: only its node's heartbeat roster can tell the scheduler about it.
    let n0 = &cluster.nodes[0];
    let (st, v) = api(
        n0.addr,
        "POST",
        "/v2/sandboxes",
        r#"{"templateID":"base","metadata":{"via":"node"}}"#,
    );
    assert_eq!(st, 201, "{v}");
    let direct = v["sandboxID"].as_str().unwrap().to_string();
    let (st, _) = api(n0.addr, "POST", &format!("/sandboxes/{direct}/pause"), "");
    assert_eq!(st, 204);
    let owner = eventually_blocking(
        "the roster to reach the scheduler",
        Duration::from_secs(15),
        || {
            rt.block_on(sched.lookup_node(LookupNodeRequest {
                sandbox_id: direct.clone(),
            }))
            .ok()
            .and_then(|r| r.into_inner().node)
        },
    );
    assert_eq!(owner.node_id, n0.id);
    assert_eq!(owner.endpoint, format!("http://{}", n0.addr));
    let snap = eventually_blocking(
        "a snapshot counting the paused sandbox",
        Duration::from_secs(15),
        || {
            let nodes = rt
                .block_on(sched.list_observed_nodes(ListObservedNodesRequest::default()))
                .ok()?
                .into_inner()
                .nodes;
            let s = nodes.into_iter().find(|n| n.node_id == n0.id)?.snapshot?;
            (s.paused_sandbox_count == 1).then_some(s)
        },
    );
    assert_eq!(snap.sandbox_count, 0);

    // Through the gateway: two creates (round robin: one per node), the direct one routed
    // to its owner by the roster binding.
    let gw = cluster.gateway;
    let mut created = Vec::new();
    for _ in 0..2 {
        let (st, v) = api(
            gw,
            "POST",
            "/v2/sandboxes",
            r#"{"templateID":"base","metadata":{"via":"gateway"}}"#,
        );
        assert_eq!(st, 201, "{v}");
        created.push(v["sandboxID"].as_str().unwrap().to_string());
    }
    let per_node: Vec<Vec<String>> = cluster
        .nodes
        .iter()
        .map(|n| ids(&api(n.addr, "GET", "/v2/sandboxes?metadata=via%3Dgateway", "").1))
        .collect();
    assert_eq!(per_node[0].len(), 1, "{per_node:?}");
    assert_eq!(per_node[1].len(), 1, "{per_node:?}");

    let (st, all) = api(gw, "GET", "/v2/sandboxes", "");
    assert_eq!(st, 200, "{all}");
    let mut expected = created.clone();
    expected.push(direct.clone());
    expected.sort();
    assert_eq!(
        ids(&all),
        expected,
        "the gateway lists every node's sandboxes"
    );
    let paused = api(gw, "GET", "/v2/sandboxes?state=paused", "").1;
    assert_eq!(ids(&paused), vec![direct.clone()]);

    // Each sandbox is reached through the gateway on its owner: the jail's hostname is
    // the sandbox id, and GET /sandboxes/{id} answers from the owner.
    for id in &created {
        let (st, v) = api(gw, "GET", &format!("/sandboxes/{id}"), "");
        assert_eq!((st, v["sandboxID"].as_str()), (200, Some(id.as_str())));
        let (st, _, body) = http(
            gw,
            "GET",
            "/files?path=/etc/hostname",
            &[
                ("e2b-sandbox-id", id),
                ("e2b-sandbox-port", "49983"),
                ("x-access-token", &agentenv_tests::envd_token(id)),
            ],
            "",
        );
        assert_eq!((st, body.trim()), (200, id.as_str()));
    }
    let (st, v) = api(gw, "POST", &format!("/sandboxes/{direct}/connect"), "{}");
    assert_eq!(st, 201, "{v}");
    for id in created.iter().chain([&direct]) {
        let (st, _) = api(gw, "DELETE", &format!("/sandboxes/{id}"), "");
        assert_eq!(st, 204);
    }
    let (_, all) = api(gw, "GET", "/v2/sandboxes", "");
    assert!(ids(&all).is_empty(), "{all}");

    // The nodes sent sandbox events (create, pause, resume, delete) to the scheduler.
    let count = eventually_blocking(
        "sandbox events at the scheduler",
        Duration::from_secs(15),
        || {
            let (st, _, text) = http(cluster.scheduler_metrics, "GET", "/metrics", &[], "");
            let prefix = "agentenv_scheduler_rpc_duration_seconds_count{rpc=\"ReportSandboxEvent\",status=\"ok\"} ";
            let n: u64 = text
                .lines()
                .find_map(|l| l.strip_prefix(prefix))
                .and_then(|v| v.trim().parse().ok())?;
            (st == 200 && n > 0).then_some(n)
        },
    );
    assert!(count >= 1);
}

#[test]
fn node_binary_rejects_bad_config_with_one_line_and_stops_on_sigterm() {
    if let Some(r) = skip_reason() {
        eprintln!("SKIPPED: {r}");
        return;
    }
    let bin = binary("agentenv-node").expect("agentenv-node binary");
    let home = tempfile::tempdir().unwrap();
    for (k, v, needle) in [
        (
            "AENV_OBSERVABILITY_SCHEDULER_ENDPOINT",
            "10.0.0.5:9090",
            "http://",
        ),
        ("AENV_BACKEND", "qemu", "AENV_BACKEND"),
        ("API_ADDR", "localhost", "API_ADDR"),
        ("AENV_API_KEY", "short", "AENV_API_KEY"),
        ("AENV_BACKEND", "microvm", "AENV_BACKEND=jail"),
        (
            "AENV_GUEST_BINARY_PATH",
            "/nonexistent/agentenv-guest",
            "build-static.sh",
        ),
    ] {
        let out = Command::new(&bin)
            .env_clear()
            .env("PATH", std::env::var("PATH").unwrap_or_default())
            .env("AENV_HOME_PATH", home.path())
            .env("API_ADDR", "127.0.0.1:0")
            .env(k, v)
            .output()
            .unwrap();
        assert!(!out.status.success(), "{k}={v} must fail");
        let err = String::from_utf8_lossy(&out.stderr);
        let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
        assert_eq!(lines.len(), 1, "one line: {err}");
        assert!(
            lines[0].starts_with("agentenv-node: ") && lines[0].contains(needle),
            "{err}"
        );
    }

    // A node without AENV_API_KEY generates one (0600), serves, and stops cleanly on
    // SIGTERM, pausing its running sandbox into a durable record.
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], agentenv_tests::free_port()));
    // Index 29: no other test's node.
    let mut env = agentenv_tests::node_env(29, "node-solo", addr, home.path(), None);
    env.retain(|(k, _)| k != "AENV_API_KEY");
    let mut cmd = Command::new(&bin);
    cmd.env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut node = agentenv_tests::Proc::spawn("node-solo", cmd).with_host_rules(
        &agentenv_tests::node_iface_prefix(29),
        std::path::Path::new(agentenv_tests::NODE_RUNTIME_DIR),
    );
    node.wait_for("node listening", Duration::from_secs(120));
    let key_path = home.path().join("secrets/api-key");
    let key = std::fs::read_to_string(&key_path).unwrap();
    assert!(key.starts_with("e2b_") && key.len() == 68, "{key}");
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(
        std::fs::metadata(&key_path).unwrap().permissions().mode() & 0o777,
        0o600
    );
    let (st, _, body) = http(
        addr,
        "POST",
        "/v2/sandboxes",
        &[("x-api-key", &key)],
        r#"{"templateID":"base"}"#,
    );
    assert_eq!(st, 201, "{body}");
    let id = serde_json::from_str::<serde_json::Value>(&body).unwrap()["sandboxID"]
        .as_str()
        .unwrap()
        .to_string();
    let (st, _, _) = http(addr, "GET", "/sandboxes", &[("x-api-key", API_KEY)], "");
    assert_eq!(st, 401, "the generated key, not another, is required");
    let status = node.stop().expect("exit status");
    assert!(status.success(), "SIGTERM is a clean exit: {status:?}");
    assert!(
        home.path()
            .join("persisted-sandboxes")
            .join(format!("{id}.json"))
            .is_file()
    );
}
