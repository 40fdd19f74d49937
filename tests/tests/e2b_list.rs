//! A cluster of 250 sandboxes listed through the gateway with the official E2B Python SDK
//! in pages of 50: more than a node's own page (100) on each node, every sandbox exactly
//! once, newest first and oldest first.

use agentenv_tests::{Cluster, api, e2b_python, run_sdk_script, skip_reason};

const FIRST_IDX: u8 = 14;
const SANDBOXES: usize = 250;

#[test]
fn a_250_sandbox_cluster_lists_every_sandbox_once_in_pages_of_50() {
    if let Some(r) = skip_reason() {
        eprintln!("SKIPPED: {r}");
        return;
    }
    let py = e2b_python().expect("E2B SDK virtual environment");
    // Pools of /23 (128 sandboxes) per node: more than fit the default /24.
    let cluster = Cluster::start_with(2, FIRST_IDX, &|i| {
        vec![(
            "AENV_JAIL_ADDRESS_POOL".to_string(),
            format!("10.17.{}.0/23", 2 * (FIRST_IDX + i)),
        )]
    });
    cluster.wait_nodes_listed(2);
    let suite = format!("list-{:08x}", rand::random::<u32>());
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/e2b_list.py");
    let v = run_sdk_script(
        &py,
        script,
        &[&suite, &SANDBOXES.to_string()],
        cluster.gateway,
        &[],
    );
    let ids = |k: &str| -> Vec<String> {
        v[k]["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s.as_str().unwrap().to_string())
            .collect()
    };
    let mut created: Vec<String> = v["created"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap().to_string())
        .collect();
    created.sort();
    for order in ["desc", "asc"] {
        assert_eq!(
            v[order]["pages"],
            serde_json::json!([50, 50, 50, 50, 50]),
            "{order}: five full pages, the last without a next token"
        );
        let walked = ids(order);
        let mut sorted = walked.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(sorted.len(), SANDBOXES, "{order}: no sandbox twice");
        assert_eq!(sorted, created, "{order}: every sandbox");
    }
    let starts = |k: &str| -> Vec<f64> {
        v[k]["starts"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s.as_f64().unwrap())
            .collect()
    };
    assert!(
        starts("desc").windows(2).all(|w| w[0] >= w[1]),
        "newest first"
    );
    assert!(
        starts("asc").windows(2).all(|w| w[0] <= w[1]),
        "oldest first"
    );
    // Both nodes held more than one page of their own.
    for n in &cluster.nodes {
        let (st, nodes) = api(n.addr, "GET", "/nodes", "");
        assert_eq!(st, 200);
        assert!(
            nodes[0]["createSuccesses"].as_u64().unwrap() > 100,
            "{}: {nodes}",
            n.id
        );
    }
    assert_eq!(v["killed"], SANDBOXES);
}
