//! Moving a node's paused sandboxes to another node through the gateway: the move
//! reports progress line by line, the sandboxes keep their ids and files, the gateway
//! routes them to their new node at once, and running sandboxes stay where they are.

use std::process::{Command, Output};
use std::time::Duration;

use agentenv_tests::{API_KEY, Cluster, api, binary, http, skip_reason};

const FIRST_IDX: u8 = 24;

/// `POST /nodes/{node}/move` with `body`: status and the progress lines.
fn move_node(gw: std::net::SocketAddr, node: &str, body: &str) -> (u16, Vec<serde_json::Value>) {
    let (st, _, text) = http(
        gw,
        "POST",
        &format!("/nodes/{node}/move"),
        &[("x-api-key", API_KEY), ("content-type", "application/json")],
        body,
    );
    let lines = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l:?} in {text}")))
        .collect();
    (st, lines)
}

#[test]
fn a_nodes_paused_sandboxes_move_to_another_node_and_stay_reachable() {
    if let Some(r) = skip_reason() {
        eprintln!("SKIPPED: {r}");
        return;
    }
    let cluster = Cluster::start(2, FIRST_IDX);
    let gw = cluster.gateway;
    cluster.wait_nodes_listed(2);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let names = [
        format!("node-{FIRST_IDX}"),
        format!("node-{}", FIRST_IDX + 1),
    ];

    // Round robin: two sandboxes on each node.
    let mut on: [Vec<String>; 2] = [Vec::new(), Vec::new()];
    for _ in 0..4 {
        let id = cluster.create(r#"{"templateID":"base","timeout":300}"#);
        cluster.sh(&rt, &id, &format!("echo {id} > /root/me"));
        on[cluster.owner(&id)].push(id);
    }
    assert_eq!(on[0].len(), 2, "{on:?}");
    // The first node's sandboxes: one paused (moves), one running (stays).
    let (paused, running) = (on[0][0].clone(), on[0][1].clone());
    let (st, v) = api(gw, "POST", &format!("/sandboxes/{paused}/pause"), "");
    assert_eq!(st, 204, "{v}");

    let (st, v) = move_node(gw, "no-such-node", "{}");
    assert_eq!(st, 404, "{v:?}");
    let (st, v) = move_node(gw, &names[0], r#"{"bogus":1}"#);
    assert_eq!(st, 400, "{v:?}");
    // Ids go into node paths: only plain ones pass.
    let (st, _, text) = http(
        gw,
        "POST",
        &format!("/nodes/{}/move", names[0]),
        &[("x-api-key", API_KEY), ("content-type", "application/json")],
        r#"{"sandboxIDs":["x/../../templates/base"]}"#,
    );
    assert_eq!(st, 400, "{text}");
    assert!(text.contains("is not a sandbox ID"), "{text}");

    let (st, lines) = move_node(gw, &names[0], "{}");
    assert_eq!(st, 200, "{lines:?}");
    assert_eq!(lines[0]["event"], "start", "{lines:?}");
    assert_eq!(
        lines[0]["sandboxes"],
        serde_json::json!([paused]),
        "{lines:?}"
    );
    assert_eq!(lines[1]["event"], "moved", "{lines:?}");
    assert_eq!(lines[1]["sandboxID"], paused.as_str());
    assert_eq!(lines[1]["to"], names[1].as_str());
    let last = lines.last().unwrap();
    assert_eq!(last["event"], "done", "{lines:?}");
    assert_eq!(
        (last["moved"].as_u64(), last["failed"].as_u64()),
        (Some(1), Some(0))
    );

    // It is on the second node only, and the gateway routes there at once.
    assert_eq!(cluster.owner(&paused), 1);
    let (st, v) = api(gw, "GET", &format!("/sandboxes/{paused}"), "");
    assert_eq!((st, v["state"].as_str()), (200, Some("paused")), "{v}");
    let (st, v) = api(gw, "POST", &format!("/sandboxes/{paused}/resume"), "");
    assert_eq!(st, 201, "{v}");
    assert_eq!(cluster.sh(&rt, &paused, "cat /root/me"), paused);
    // Its carrier snapshot is gone.
    let (st, v) = api(gw, "GET", "/snapshots", "");
    assert_eq!(st, 200, "{v}");
    assert_eq!(v.as_array().map(|a| a.len()), Some(0), "{v}");

    // The running one stayed.
    assert_eq!(cluster.owner(&running), 0);
    assert_eq!(cluster.sh(&rt, &running, "cat /root/me"), running);

    // Nothing paused left: a move of nothing says so and succeeds.
    let (st, lines) = move_node(gw, &names[0], "{}");
    assert_eq!(st, 200, "{lines:?}");
    assert_eq!(lines[0]["sandboxes"], serde_json::json!([]));
    assert_eq!(lines.last().unwrap()["moved"], 0);

    // The binding stays with the new node across heartbeats of both.
    std::thread::sleep(Duration::from_secs(6));
    assert_eq!(cluster.sh(&rt, &paused, "cat /root/me"), paused);

    // With the CLI: drain the first node, pause its last sandbox, move it.
    let cfg = tempfile::tempdir().unwrap();
    let aenv = |args: &[&str]| -> Output {
        Command::new(binary("aenv").expect("aenv binary"))
            .args(args)
            .env("XDG_CONFIG_HOME", cfg.path())
            .output()
            .expect("run aenv")
    };
    let text = |o: &Output| {
        format!(
            "{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        )
    };
    let url = format!("http://{gw}");
    assert!(
        aenv(&["auth", "--url", &url, "--api-key", API_KEY])
            .status
            .success()
    );
    let out = aenv(&["node", "drain", &names[0]]);
    assert!(out.status.success(), "{}", text(&out));
    let (st, v) = api(gw, "POST", &format!("/sandboxes/{running}/pause"), "");
    assert_eq!(st, 204, "{v}");
    // Nowhere to go when the only other node is named but does not exist.
    let out = aenv(&["node", "move", &names[0], "--to", "no-such-node"]);
    assert!(!out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("not a ready node"), "{}", text(&out));
    let out = aenv(&["node", "move", &names[0]]);
    assert!(out.status.success(), "{}", text(&out));
    let said = text(&out);
    assert!(
        said.contains(&format!("moved  {running} -> {}", names[1])),
        "{said}"
    );
    assert!(said.contains("done: 1 moved, 0 failed"), "{said}");
    assert_eq!(cluster.owner(&running), 1);
    // The drained node keeps nothing and takes nothing.
    let out = aenv(&["node", "move", &names[0]]);
    assert!(
        text(&out).contains("has no paused sandbox to move"),
        "{}",
        text(&out)
    );
    let (st, v) = api(gw, "POST", &format!("/sandboxes/{running}/resume"), "");
    assert_eq!(st, 201, "{v}");
    assert_eq!(cluster.sh(&rt, &running, "cat /root/me"), running);
    // A node that cannot take them (draining): the move of the other way says so.
    let (st, v) = api(gw, "POST", &format!("/sandboxes/{running}/pause"), "");
    assert_eq!(st, 204, "{v}");
    let out = aenv(&["node", "move", &names[1]]);
    assert!(!out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("no ready node"), "{}", text(&out));
    assert_eq!(cluster.owner(&running), 1);
    for id in on.iter().flatten() {
        let (st, v) = api(gw, "DELETE", &format!("/sandboxes/{id}"), "");
        assert_eq!(st, 204, "{id}: {v}");
    }
}
