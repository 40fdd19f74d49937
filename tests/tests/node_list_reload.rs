//! The node list changes while the cluster runs (real scheduler, gateway and two
//! `agentenv-node` processes on loopback, nodes 10 and 11): a node added by SIGHUP takes
//! creates; a malformed file on SIGHUP changes nothing; `aenv node drain` stops
//! placement on a node at once and `aenv node undrain` restores it; a node removed by
//! SIGHUP keeps its sandboxes reachable through the gateway until they are deleted,
//! takes no new ones, and then leaves the node list.

use std::collections::BTreeSet;
use std::process::{Command, Output};
use std::time::Duration;

use agentenv_core::proto::scheduler_v1::LookupNodeRequest;
use agentenv_core::proto::scheduler_v1::scheduler_client::SchedulerClient;
use agentenv_testkit::eventually_blocking;
use agentenv_tests::{API_KEY, Cluster, api, binary, envd_token, http, skip_reason, wait_observed};

/// Creates `n` sandboxes through the gateway; their ids.
fn create(cluster: &Cluster, n: usize) -> Vec<String> {
    (0..n)
        .map(|_| cluster.create(r#"{"templateID":"base"}"#))
        .collect()
}

/// The node the scheduler binds `sandbox` to.
fn owner(rt: &tokio::runtime::Runtime, scheduler: &str, sandbox: &str) -> String {
    rt.block_on(async {
        let mut c = SchedulerClient::connect(format!("http://{scheduler}"))
            .await
            .expect("scheduler client");
        c.lookup_node(LookupNodeRequest {
            sandbox_id: sandbox.into(),
        })
        .await
        .unwrap_or_else(|s| panic!("lookup of {sandbox}: {s}"))
        .into_inner()
        .node
        .unwrap()
        .node_id
    })
}

fn owners(rt: &tokio::runtime::Runtime, cluster: &Cluster, ids: &[String]) -> BTreeSet<String> {
    ids.iter()
        .map(|id| owner(rt, &cluster.scheduler, id))
        .collect()
}

fn delete(cluster: &Cluster, ids: &[String]) {
    for id in ids {
        let (st, v) = api(cluster.gateway, "DELETE", &format!("/sandboxes/{id}"), "");
        assert_eq!(st, 204, "{v}");
    }
}

/// The node ids `GET /nodes` lists.
fn listed(cluster: &Cluster) -> BTreeSet<String> {
    let (st, v) = api(cluster.gateway, "GET", "/nodes", "");
    assert_eq!(st, 200, "{v}");
    v.as_array()
        .unwrap()
        .iter()
        .map(|n| n["id"].as_str().unwrap().to_string())
        .collect()
}

/// When the scheduler took `node`'s last heartbeat (Unix ms, as `GET /nodes` says).
fn last_heartbeat(cluster: &Cluster, node: &str) -> i64 {
    let (_, v) = api(cluster.gateway, "GET", "/nodes", "");
    v.as_array()
        .and_then(|a| a.iter().find(|n| n["id"] == node))
        .and_then(|n| n["lastHeartbeatUnixMs"].as_i64())
        .unwrap_or_else(|| panic!("{node} listed: {v}"))
}

/// A sandbox answers through the gateway: its details, and a file its agent reads.
fn assert_reachable(cluster: &Cluster, id: &str) {
    let (st, v) = api(cluster.gateway, "GET", &format!("/sandboxes/{id}"), "");
    assert_eq!((st, v["sandboxID"].as_str()), (200, Some(id)), "{v}");
    let (st, _, body) = http(
        cluster.gateway,
        "GET",
        "/files?path=/etc/hostname",
        &[
            ("e2b-sandbox-id", id),
            ("e2b-sandbox-port", "49983"),
            ("x-access-token", &envd_token(id)),
        ],
        "",
    );
    assert_eq!((st, body.trim()), (200, id));
}

#[test]
fn node_list_reload_and_drain_change_placement_without_interrupting_routing() {
    if let Some(r) = skip_reason() {
        eprintln!("SKIPPED: {r}");
        return;
    }
    // node-10 is listed; node-11 runs but is refused until a reload lists it.
    let cluster = Cluster::start_listing(2, 1, 10, &|_| Vec::new());
    let rt = tokio::runtime::Runtime::new().unwrap();
    let all_nodes = cluster.node_entries.clone();
    let on_10 = create(&cluster, 2);
    assert_eq!(
        owners(&rt, &cluster, &on_10),
        ["node-10".to_string()].into()
    );

    // SIGHUP with node-11 added: it heartbeats and takes creates.
    let v = cluster.reload_scheduler(|c| c["scheduler"]["nodes"] = all_nodes.clone().into());
    assert_eq!(v["message"], "node list reloaded: +node-11", "{v}");
    wait_observed(&cluster.scheduler, &["node-11".to_string()]);
    let both = create(&cluster, 4);
    assert_eq!(
        owners(&rt, &cluster, &both),
        ["node-10".to_string(), "node-11".to_string()].into(),
        "round robin over both nodes"
    );

    // A malformed file, then an invalid one: each reload fails, says why, changes nothing.
    let v = cluster.reload_scheduler_raw("{\"scheduler\": {\"nodes\": [");
    assert_reload_failed(&v, "not valid JSON");
    let v = cluster.reload_scheduler(|c| {
        c["scheduler"]["nodes"] = serde_json::json!([all_nodes[0], all_nodes[0]]);
    });
    assert_reload_failed(&v, "scheduler.nodes");
    let after_bad = create(&cluster, 4);
    assert_eq!(
        owners(&rt, &cluster, &after_bad),
        ["node-10".to_string(), "node-11".to_string()].into(),
        "both nodes still take creates"
    );
    delete(&cluster, &both);
    delete(&cluster, &after_bad);

    // `aenv node drain`: no create lands on node-11 from then on.
    let cfg = tempfile::tempdir().unwrap();
    let aenv = |args: &[&str]| -> Output {
        let o = Command::new(binary("aenv").expect("aenv binary"))
            .args(args)
            .env("XDG_CONFIG_HOME", cfg.path())
            .output()
            .expect("run aenv");
        assert!(
            o.status.success(),
            "aenv {args:?}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        o
    };
    let url = format!("http://{}", cluster.gateway);
    aenv(&["auth", "--url", &url, "--api-key", API_KEY]);
    let (on_11, also_on_10): (Vec<String>, Vec<String>) = create(&cluster, 2)
        .into_iter()
        .partition(|id| owner(&rt, &cluster.scheduler, id) == "node-11");
    assert_eq!((on_11.len(), also_on_10.len()), (1, 1));
    // node-11's heartbeat counts its sandbox before the drain reports it.
    eventually_blocking(
        "node-11 to report its sandbox",
        Duration::from_secs(15),
        || {
            let (_, v) = api(cluster.gateway, "GET", "/nodes", "");
            v.as_array()?
                .iter()
                .find(|n| n["id"] == "node-11" && n["sandboxCount"] == 1)
                .map(|_| ())
        },
    );
    let out = aenv(&["node", "drain", "node-11"]);
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "node-11 is draining: no new sandboxes are placed there; 1 running, 0 paused remain"
    );
    let during_drain = create(&cluster, 4);
    assert_eq!(
        owners(&rt, &cluster, &during_drain),
        ["node-10".to_string()].into(),
        "every create lands on node-10"
    );
    assert_reachable(&cluster, &on_11[0]);
    let out = aenv(&["node", "ls", "--json"]);
    let nodes: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let status = |id: &str| {
        nodes
            .as_array()
            .unwrap()
            .iter()
            .find(|n| n["id"] == id)
            .map(|n| n["status"].clone())
    };
    assert_eq!(status("node-11"), Some("draining".into()), "{nodes}");
    assert_eq!(status("node-10"), Some("ready".into()), "{nodes}");
    let table = aenv(&["node", "ls", "-o", "table"]);
    let table = String::from_utf8_lossy(&table.stdout);
    assert!(
        table
            .lines()
            .any(|l| l.contains("node-11") && l.contains("draining")),
        "{table}"
    );

    // Drain state survives a reload of the same list.
    let v = cluster.reload_scheduler(|c| c["scheduler"]["nodes"] = all_nodes.clone().into());
    assert_eq!(v["message"], "node list reloaded: no change", "{v}");
    let still = create(&cluster, 2);
    assert_eq!(
        owners(&rt, &cluster, &still),
        ["node-10".to_string()].into()
    );

    let out = aenv(&["node", "undrain", "node-11"]);
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "node-11 takes new sandboxes again (status: ready)"
    );
    let undrained = create(&cluster, 4);
    assert_eq!(
        owners(&rt, &cluster, &undrained),
        ["node-10".to_string(), "node-11".to_string()].into()
    );
    delete(&cluster, &during_drain);
    delete(&cluster, &still);
    delete(&cluster, &undrained);
    delete(&cluster, &on_11);
    delete(&cluster, &also_on_10);

    // SIGHUP with node-10 removed while it holds sandboxes: they stay reachable, new
    // creates go to node-11, and node-10 leaves once they are deleted.
    eventually_blocking(
        "node-10 to report its 2 sandboxes",
        Duration::from_secs(15),
        || {
            let (_, v) = api(cluster.gateway, "GET", "/nodes", "");
            v.as_array()?
                .iter()
                .find(|n| n["id"] == "node-10" && n["sandboxCount"] == 2)
                .map(|_| ())
        },
    );
    let v = cluster.reload_scheduler(|c| {
        c["scheduler"]["nodes"] = serde_json::json!([all_nodes[1]]);
    });
    assert_eq!(
        v["message"], "node list reloaded: -node-10 (lingering until its 2 sandboxes are gone)",
        "{v}"
    );
    let after_removal = create(&cluster, 3);
    assert_eq!(
        owners(&rt, &cluster, &after_removal),
        ["node-11".to_string()].into(),
        "no create goes to the removed node"
    );
    // Across several of node-10's heartbeats, its sandboxes answer through the gateway.
    for _ in 0..3 {
        for id in &on_10 {
            assert_reachable(&cluster, id);
            assert_eq!(owner(&rt, &cluster.scheduler, id), "node-10");
        }
        let seen = last_heartbeat(&cluster, "node-10");
        eventually_blocking(
            "another heartbeat of node-10",
            Duration::from_secs(15),
            || (last_heartbeat(&cluster, "node-10") > seen).then_some(()),
        );
    }
    let out = aenv(&["exec", &on_10[0], "cat", "/etc/hostname"]);
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), on_10[0]);
    delete(&cluster, &on_10);
    eventually_blocking(
        "node-10 to leave the node list",
        Duration::from_secs(15),
        || (!listed(&cluster).contains("node-10")).then_some(()),
    );
    assert_eq!(listed(&cluster), ["node-11".to_string()].into());
    delete(&cluster, &after_removal);
}

/// The scheduler's log line `v` says a reload failed, for a reason naming `why`.
fn assert_reload_failed(v: &serde_json::Value, why: &str) {
    assert!(
        v["message"]
            .as_str()
            .is_some_and(|m| m.starts_with("config reload failed")),
        "{v}"
    );
    assert!(v["reason"].as_str().is_some_and(|r| r.contains(why)), "{v}");
}
