//! Pool-aware placement on a real cluster (scheduler, gateway, two nodes, only the first
//! keeping `base` sandboxes started): the heartbeats carry each node's pooled sandboxes
//! per template, and the scheduler sends creates a pool can serve to the node holding
//! them (round robin alone would send half to the node without a pool), at once and one
//! after another, while a create a pool cannot serve is placed by the strategy.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use agentenv_tests::{API_KEY, Cluster, api, http, skip_reason};

/// Pooled `base` sandboxes of the first node.
const POOL: usize = 4;

/// Waits until the gateway lists the pooled node with `running` sandboxes (a heartbeat
/// taken after the creates so far) and at least `POOL` pooled `base` sandboxes, and the
/// other with none.
fn wait_pooled(cluster: &Cluster, running: usize) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (st, v) = api(cluster.gateway, "GET", "/nodes", "");
        let node = |id: &str| {
            v.as_array()
                .and_then(|a| a.iter().find(|n| n["id"] == id))
                .cloned()
                .unwrap_or_default()
        };
        let pooled = node(&cluster.nodes[0].id);
        let plain = node(&cluster.nodes[1].id);
        if st == 200
            && pooled["sandboxCount"] == running
            && pooled["sandboxPooledByTemplate"]["base"].as_u64() >= Some(POOL as u64)
            && plain["sandboxPooledCount"] == 0
            && plain["sandboxPooledByTemplate"] == serde_json::json!({})
        {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the nodes did not report {running} running and {POOL} pooled base sandboxes on the first, none on the second: {st} {v}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The node's count of creates its pools served.
fn claims(cluster: &Cluster, node: usize) -> u64 {
    let (_, _, text) = http(
        cluster.nodes[node].addr,
        "GET",
        "/metrics",
        &[("x-api-key", API_KEY)],
        "",
    );
    text.lines()
        .find_map(|l| l.strip_prefix("agentenv_pool_events_total{event=\"claim\"} "))
        .and_then(|c| c.trim().parse().ok())
        .unwrap_or(0)
}

/// The ids of the sandboxes node `node` holds.
fn held(cluster: &Cluster, node: usize) -> BTreeSet<String> {
    let (st, v) = api(cluster.nodes[node].addr, "GET", "/v2/sandboxes", "");
    assert_eq!(st, 200, "{v}");
    v.as_array()
        .unwrap()
        .iter()
        .map(|s| s["sandboxID"].as_str().unwrap().to_string())
        .collect()
}

fn create(gateway: SocketAddr, body: &str) -> String {
    let (st, v) = api(gateway, "POST", "/v2/sandboxes", body);
    assert_eq!(st, 201, "{v}");
    v["sandboxID"].as_str().unwrap().to_string()
}

const PLAIN: &str = r#"{"templateID":"base","timeout":120}"#;

#[test]
fn creates_of_a_pooled_template_go_to_the_node_holding_its_pooled_sandboxes() {
    if let Some(r) = skip_reason() {
        eprintln!("SKIPPED: {r}");
        return;
    }
    let cluster = Cluster::start_with(2, 41, &|i| {
        if i == 0 {
            vec![("AENV_POOL_TEMPLATES".into(), format!("base={POOL}"))]
        } else {
            Vec::new()
        }
    });
    wait_pooled(&cluster, 0);
    // The node's own GET /nodes shows what its heartbeats carry.
    let (st, v) = api(cluster.nodes[0].addr, "GET", "/nodes", "");
    assert_eq!(st, 200, "{v}");
    assert!(
        v[0]["sandboxPooledByTemplate"]["base"].as_u64() >= Some(POOL as u64),
        "{v}"
    );

    // A burst as large as the pool, all at once: every create goes to the pooled node
    // and is served by its pool.
    let before = claims(&cluster, 0);
    let gateway = cluster.gateway;
    let burst: BTreeSet<String> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..POOL)
            .map(|_| s.spawn(move || create(gateway, PLAIN)))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(burst.len(), POOL);
    assert!(
        held(&cluster, 1).is_empty(),
        "a create went to the node without a pool"
    );
    assert!(burst.is_subset(&held(&cluster, 0)));
    assert_eq!(claims(&cluster, 0) - before, POOL as u64);

    // Once the pool is reported refilled, creates one after another go there again
    // (until then its pooled sandboxes count as spoken for).
    wait_pooled(&cluster, POOL);
    let before = claims(&cluster, 0);
    let one_by_one: BTreeSet<String> = (0..POOL).map(|_| create(cluster.gateway, PLAIN)).collect();
    assert!(
        held(&cluster, 1).is_empty(),
        "a create went to the node without a pool"
    );
    assert!(one_by_one.is_subset(&held(&cluster, 0)));
    assert_eq!(claims(&cluster, 0) - before, POOL as u64);

    // Creates no pool serves (own resources, an idempotency key) are the strategy's:
    // round robin gives the node without a pool its share.
    let mut other = Vec::new();
    for i in 0..4 {
        other.push(create(
            cluster.gateway,
            r#"{"templateID":"base","timeout":120,"cpuCount":1}"#,
        ));
        let key = format!("placement-{i}");
        let (st, _, body) = http(
            cluster.gateway,
            "POST",
            "/v2/sandboxes",
            &[
                ("x-api-key", API_KEY),
                ("content-type", "application/json"),
                ("idempotency-key", &key),
            ],
            PLAIN,
        );
        assert_eq!(st, 201, "{body}");
    }
    assert!(
        !held(&cluster, 1).is_empty(),
        "round robin placed none of the creates no pool serves on the second node"
    );
    for id in burst.iter().chain(&one_by_one).chain(&other) {
        let (st, _) = api(cluster.gateway, "DELETE", &format!("/sandboxes/{id}"), "");
        assert_eq!(st, 204, "{id}");
    }
}
