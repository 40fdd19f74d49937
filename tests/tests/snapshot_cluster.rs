//! Snapshots across nodes: two nodes share one snapshot store (as one shared mount on
//! every runtime host would be), a sandbox is snapshotted on its node, and sandboxes
//! created from the snapshot through the gateway start on either node with its files.

use std::time::Duration;

use agentenv_tests::{Cluster, api, skip_reason};

#[test]
fn a_snapshot_taken_on_one_node_starts_on_the_other_through_the_gateway() {
    if let Some(r) = skip_reason() {
        eprintln!("SKIPPED: {r}");
        return;
    }
    let cluster = Cluster::start(2, 2);
    let gw = cluster.gateway;
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let (st, v) = api(gw, "GET", "/nodes", "");
        if st == 200 && v.as_array().is_some_and(|a| a.len() == 2) {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the gateway did not list two nodes: {st} {v}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let rt = tokio::runtime::Runtime::new().unwrap();

    let src = cluster.create(r#"{"templateID":"base","timeout":300}"#);
    let src_node = cluster.owner(&src);
    cluster.sh(&rt, &src, "echo cross-node > /root/shared.txt");

    // Snapshot through the gateway: routed to the source's node, published to the store
    // both nodes read.
    let (st, v) = api(
        gw,
        "POST",
        &format!("/sandboxes/{src}/snapshots"),
        r#"{"name":"cluster-snap"}"#,
    );
    assert_eq!(st, 201, "{v}");
    let snap = v["snapshotID"].as_str().unwrap().to_string();
    assert!(
        cluster
            .snapshot_store
            .join(format!("repository/catalog/records/{snap}.json"))
            .is_file()
    );
    // Both nodes know it.
    for n in &cluster.nodes {
        let (st, v) = api(n.addr, "GET", &format!("/snapshots/{snap}"), "");
        assert_eq!(
            (st, v["names"][0].as_str()),
            (200, Some("cluster-snap")),
            "{}",
            n.id
        );
    }

    // Two creates from it through the gateway: the round robin puts one on the node
    // that did not take the snapshot. Both see the file.
    let mut nodes_used = Vec::new();
    for template in [snap.as_str(), "cluster-snap"] {
        let (st, v) = api(
            gw,
            "POST",
            "/v2/sandboxes",
            &format!(r#"{{"templateID":"{template}","timeout":300}}"#),
        );
        assert_eq!(st, 201, "create from {template}: {v}");
        assert_eq!(v["templateID"], snap.as_str());
        let id = v["sandboxID"].as_str().unwrap().to_string();
        nodes_used.push(cluster.owner(&id));
        assert_eq!(cluster.sh(&rt, &id, "cat /root/shared.txt"), "cross-node");
        let (st, _) = api(gw, "DELETE", &format!("/sandboxes/{id}"), "");
        assert_eq!(st, 204);
    }
    assert!(
        nodes_used.iter().any(|&n| n != src_node),
        "no sandbox from the snapshot started on the other node: source on {src_node}, copies on {nodes_used:?}"
    );

    // The gateway lists it once (every node reads the same store).
    let (st, v) = api(gw, "GET", "/snapshots", "");
    assert_eq!(st, 200, "{v}");
    let listed: Vec<&str> = v
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["snapshotID"].as_str().unwrap())
        .collect();
    assert_eq!(listed, [snap.as_str()]);

    // Deleted on one node, gone for the other.
    let other = &cluster.nodes[1 - src_node];
    let (st, _) = api(other.addr, "DELETE", "/templates/cluster-snap", "");
    assert_eq!(st, 204);
    let (st, v) = api(gw, "GET", &format!("/snapshots/{snap}"), "");
    assert_eq!(st, 404, "{v}");
    let (st, v) = api(
        cluster.nodes[src_node].addr,
        "POST",
        "/v2/sandboxes",
        &format!(r#"{{"templateID":"{snap}"}}"#),
    );
    assert_eq!(st, 404, "{v}");
    let (st, _) = api(gw, "DELETE", &format!("/sandboxes/{src}"), "");
    assert_eq!(st, 204);
}
