//! The official E2B Python SDK against a real cluster on loopback: scheduler, gateway
//! and two nodes (jail backend, `base` template, static guest agent), all separate
//! processes, the SDK pointed at the gateway for both the API and the data plane. The
//! SDK creates without `secure`: the agent still refuses calls without the sandbox's
//! token, `/init` is refused through the gateway, signed file URLs work.

use std::process::Command;
use std::time::Duration;

use agentenv_tests::{API_KEY, Cluster, api, e2b_python, skip_reason};

#[test]
fn official_e2b_sdk_through_gateway_and_two_nodes() {
    if let Some(r) = skip_reason() {
        eprintln!("SKIPPED: {r}");
        return;
    }
    let py = e2b_python().expect("E2B SDK virtual environment");
    let cluster = Cluster::start(2, 0);
    // Both nodes must be known to the scheduler (heartbeats) before the round robin
    // can spread creates across them.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let (st, v) = api(cluster.gateway, "GET", "/nodes", "");
        let n = v.as_array().map(|a| a.len()).unwrap_or(0);
        if st == 200 && n == 2 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the gateway did not list two nodes: {st} {v}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }

    let gw = format!("http://{}", cluster.gateway);
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/e2b_cluster.py");
    let out = Command::new(&py)
        .arg(script)
        .env("E2B_API_URL", &gw)
        .env("E2B_SANDBOX_URL", &gw)
        .env("E2B_API_KEY", API_KEY)
        .output()
        .expect("run the SDK script");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "SDK script failed:\n{stderr}\n{stdout}"
    );
    let v: serde_json::Value = serde_json::from_str(stdout.trim()).expect("JSON from the script");
    let ids: Vec<String> = v["ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap().to_string())
        .collect();
    // Each command ran in its own sandbox (the jail's hostname is the sandbox id).
    assert_eq!(v["run_a"], format!("hello\n{}\n", ids[0]));
    assert_eq!(v["exit_a"], 0);
    assert_eq!(v["host_b"], ids[1].as_str());
    assert_eq!(v["read"], "abc");
    assert!(
        v["list"]
            .as_array()
            .unwrap()
            .iter()
            .any(|n| n == "agentenv-sdk.txt")
    );
    assert_eq!(v["info"]["sandbox_id"], ids[0].as_str());
    assert_eq!(v["info"]["template_id"], "base");
    assert_eq!(v["info"]["metadata"]["suite"], "cluster");
    let mut sorted = ids.clone();
    sorted.sort();
    assert_eq!(v["listed"], serde_json::json!(sorted));
    assert_eq!(v["pause"], true);
    assert_eq!(v["listed_paused"], serde_json::json!([ids[0]]));
    assert_eq!(
        v["after_resume"], "abc",
        "a resumed sandbox keeps its files"
    );
    assert_eq!(v["run_after_resume"], "resumed\n");
    // No `secure` in the SDK's create, yet every agent call needs the sandbox's token.
    assert_eq!(
        v["has_token"], true,
        "the create answered an envdAccessToken"
    );
    let every = |v: &serde_json::Value, want: u64| {
        ["files", "stat", "processes"]
            .iter()
            .all(|k| v[k].as_u64() == Some(want))
    };
    assert!(
        every(&v["no_token"], 401),
        "without the token: {}",
        v["no_token"]
    );
    assert_eq!(v["wrong_token"], 401);
    assert!(
        every(&v["with_token"], 200),
        "with the token: {}",
        v["with_token"]
    );
    assert_eq!(v["init_via_gateway"], 403, "/init is the node's alone");
    assert_eq!(v["token_after_init"], 200, "the owner keeps access");
    assert_eq!(v["signed_url"], serde_json::json!([200, "s3cret"]));
    assert_eq!(v["tampered_url"], 401, "a signature is for one path");
    assert_eq!(v["kill_a"], true);
    assert_eq!(v["kill_b"], true);
    assert_eq!(v["kill_again"], false);

    // The two sandboxes landed on different nodes: each node's own list (read while
    // they lived) is checked through the nodes' create counters.
    let counts: Vec<u64> = cluster
        .nodes
        .iter()
        .map(|n| {
            let (st, v) = api(n.addr, "GET", "/nodes", "");
            assert_eq!(st, 200);
            v[0]["createSuccesses"].as_u64().unwrap()
        })
        .collect();
    assert_eq!(counts, vec![1, 1], "one create per node");
}
