//! The node's `Server-Timing` on creates: every phase of the create path, then the
//! node's total, each a valid non-negative duration, the phases summing to no more than
//! the total; a create that made no sandbox (an idempotent replay) carries none.

mod node_common;

use agentenv_node::timing::parse;
use node_common::{API_KEY, Node, api, delete, request};

/// The phases of a create from a template, in the order the node records them.
const PHASES: &[&str] = &[
    "request",
    "parse",
    "volumes",
    "resolve",
    "bind",
    "admit",
    "template",
    "dir",
    "ids",
    "netns",
    "egress",
    "cgroup",
    "layer",
    "prepare",
    "pipe",
    "userns",
    "state",
    "plan",
    "queue",
    "spawn",
    "watch",
    "agent_ready",
    "init",
    "finish",
    "answer",
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_create_answers_its_phases_in_order_within_the_nodes_total() {
    require_node!();
    let home = tempfile::tempdir().unwrap();
    let node = Node::start(node_common::config(home.path(), 26)).await;
    let addr = node.addr;
    for round in 0..2 {
        let r = api(addr, "POST", "/v2/sandboxes", r#"{"templateID":"base"}"#).await;
        assert_eq!(r.status, 201, "{}", r.text());
        let value = r
            .headers
            .get("server-timing")
            .expect("Server-Timing on a create")
            .to_str()
            .unwrap()
            .to_string();
        let entries = parse(&value).unwrap_or_else(|| panic!("invalid entry in {value}"));
        let names: Vec<&str> = entries.iter().map(|(n, _)| n.as_str()).collect();
        let mut expected = PHASES.to_vec();
        expected.push("node");
        assert_eq!(names, expected, "round {round}: {value}");
        let (phases, total) = entries.split_at(entries.len() - 1);
        let sum: f64 = phases.iter().map(|(_, d)| d).sum();
        // Each entry is rounded to 0.01 ms.
        assert!(
            sum <= total[0].1 + 0.005 * (phases.len() as f64 + 1.0),
            "phases sum to {sum} ms, over the total: {value}"
        );
        assert!(total[0].1 > 0.0, "{value}");
        let id = r.json()["sandboxID"].as_str().unwrap().to_string();
        assert_eq!(delete(addr, &id).await.status, 204);
    }

    // An idempotent retry made no sandbox: its answer has no phases to tell.
    let h = [
        ("x-api-key", API_KEY),
        ("content-type", "application/json"),
        ("idempotency-key", "node-timing-key"),
    ];
    let body = r#"{"templateID":"base"}"#;
    let first = request(addr, "POST", "/v2/sandboxes", &h, body).await;
    assert_eq!(first.status, 201, "{}", first.text());
    assert!(first.headers.contains_key("server-timing"));
    let again = request(addr, "POST", "/v2/sandboxes", &h, body).await;
    assert_eq!(again.status, 201, "{}", again.text());
    assert!(again.headers.contains_key("idempotent-replayed"));
    assert!(
        !again.headers.contains_key("server-timing"),
        "a replay carries no create phases"
    );
    let id = first.json()["sandboxID"].as_str().unwrap().to_string();
    assert_eq!(delete(addr, &id).await.status, 204);
    node.stop().await;
}
