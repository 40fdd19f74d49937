//! Pools on a real cluster (scheduler, gateway, two nodes keeping `base` sandboxes
//! started): the gateway's `GET /nodes` reports each node's pooled sandboxes apart from
//! its running ones (through the heartbeats), and creates through the official E2B
//! Python SDK are served from the pools, each sandbox personalised (its environment,
//! metadata and hostname) and never handed out twice.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use agentenv_tests::{Cluster, api, e2b_python, run_sdk_script, skip_reason};

/// Waits until the gateway lists both nodes each reporting at least `pooled` pooled
/// sandboxes and `running` running ones; returns the list.
fn wait_nodes(cluster: &Cluster, pooled: u64, running: u64) -> serde_json::Value {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (st, v) = api(cluster.gateway, "GET", "/nodes", "");
        let ok = st == 200
            && v.as_array().is_some_and(|a| {
                a.len() == 2
                    && a.iter().all(|n| {
                        n["sandboxPooledCount"].as_u64() >= Some(pooled)
                            && n["sandboxCount"] == running
                    })
            });
        if ok {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "nodes did not report {pooled}+ pooled, {running} running: {st} {v}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn sdk_creates_are_served_by_node_pools_and_nodes_report_pooled_sandboxes_apart() {
    if let Some(r) = skip_reason() {
        eprintln!("SKIPPED: {r}");
        return;
    }
    let py = e2b_python().expect("E2B SDK virtual environment");
    let cluster = Cluster::start_with(2, 39, &|_| {
        vec![("AENV_POOL_TEMPLATES".to_string(), "base=2".to_string())]
    });
    let nodes = wait_nodes(&cluster, 2, 0);
    for n in nodes.as_array().unwrap() {
        // No create came yet: the pools hold their configured size.
        assert_eq!(n["sandboxPooledCount"], 2, "{n}");
        assert_eq!(n["metrics"]["pooledAllocatedCPU"], 4, "{n}");
        assert_eq!(n["metrics"]["allocatedCPU"], 0, "{n}");
        assert!(
            n["metrics"]["pooledAllocatedMemoryBytes"].as_u64().unwrap() > 0,
            "{n}"
        );
    }

    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/e2b_pool.py");
    let v = run_sdk_script(&py, script, &["6"], cluster.gateway, &[]);
    let sandboxes = v["sandboxes"].as_array().unwrap();
    assert_eq!(sandboxes.len(), 6);
    let mut ids = HashSet::new();
    for (i, s) in sandboxes.iter().enumerate() {
        let id = s["id"].as_str().unwrap();
        assert!(ids.insert(id.to_string()), "{id} handed out twice");
        assert_eq!(s["stdout"], format!("mark-{i}\n{id}\nfresh\n"), "{s}");
        assert_eq!(s["metadata"]["i"], i.to_string(), "{s}");
    }
    // Every create was served by a pool: each node counted its claims.
    let claims: u64 = cluster
        .nodes
        .iter()
        .map(|n| {
            let (_, _, text) = agentenv_tests::http(
                n.addr,
                "GET",
                "/metrics",
                &[("x-api-key", agentenv_tests::API_KEY)],
                "",
            );
            text.lines()
                .find_map(|l| l.strip_prefix("agentenv_pool_events_total{event=\"claim\"} "))
                .and_then(|c| c.trim().parse::<u64>().ok())
                .unwrap_or(0)
        })
        .sum();
    assert!(
        claims >= 4,
        "only {claims} of 6 creates were served by a pool"
    );
    // The pools refill (demand may have grown them); the killed sandboxes are gone.
    wait_nodes(&cluster, 2, 0);
    eprintln!(
        "SDK create -> first command with pools (ms): {}",
        v["start_ms"]
    );
}
