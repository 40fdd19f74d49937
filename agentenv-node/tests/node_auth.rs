//! Authentication of the node: the API key (exactly one `X-API-Key`) for the control
//! plane only; envd and traffic tokens scoped to one sandbox for the data plane.

mod node_common;

use node_common::{API_KEY, Node, api, create, request, run};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_plane_needs_exactly_one_valid_api_key() {
    require_node!();
    let home = tempfile::tempdir().unwrap();
    let node = Node::start(node_common::config(home.path(), 20)).await;
    let addr = node.addr;
    let bearer = format!("Bearer {API_KEY}");
    let cases: Vec<Vec<(&str, &str)>> = vec![
        vec![],
        vec![("x-api-key", "wrong-key-wrong-key-wrong-key-wrong")],
        vec![("x-api-key", API_KEY), ("x-api-key", API_KEY)],
        vec![("authorization", &bearer)],
    ];
    for h in cases {
        for (m, p) in [
            ("GET", "/sandboxes"),
            ("GET", "/v2/sandboxes"),
            ("POST", "/v2/sandboxes"),
            ("GET", "/nodes"),
            ("GET", "/nope"),
        ] {
            let r = request(addr, m, p, &h, "{}").await;
            assert_eq!((r.status, r.body.len()), (401, 0), "{m} {p} with {h:?}");
        }
    }
    let ok = request(addr, "GET", "/sandboxes", &[("X-Api-Key", API_KEY)], "").await;
    assert_eq!(ok.status, 200);
    // Public routes.
    assert_eq!(request(addr, "GET", "/health", &[], "").await.status, 204);
    let m = request(addr, "GET", "/metrics", &[], "").await;
    assert_eq!(m.status, 200);
    assert!(
        m.text().contains("agentenv_http_request_duration_seconds"),
        "{}",
        m.text()
    );
    // Unknown route with the key: JSON 404.
    let r = api(addr, "GET", "/nope", "").await;
    assert_eq!(r.status, 404);
    assert_eq!(r.json()["message"], "route not found: GET /nope");
    node.stop().await;
}

/// Creates a sandbox (`POST path` with `body`, which must answer 201) and returns its id
/// and the token in the answer's field `token`.
async fn create_with_token(
    addr: std::net::SocketAddr,
    path: &str,
    body: &str,
    token: &str,
) -> (String, String) {
    let r = api(addr, "POST", path, body).await;
    assert_eq!(r.status, 201, "{}", r.text());
    let v = r.json();
    (
        v["sandboxID"].as_str().unwrap().to_string(),
        v[token].as_str().unwrap().to_string(),
    )
}

fn path_list() -> &'static str {
    "/proxy/process.Process/List"
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envd_token_is_required_for_every_sandbox_and_scoped_to_one() {
    require_node!();
    let home = tempfile::tempdir().unwrap();
    let node = Node::start(node_common::config(home.path(), 21)).await;
    let addr = node.addr;
    let (a, token_a) = create_with_token(
        addr,
        "/sandboxes",
        r#"{"templateID":"base","secure":true}"#,
        "envdAccessToken",
    )
    .await;
    assert_eq!(token_a, node.orch.tokens().envd_token(&a));
    let r = api(
        addr,
        "POST",
        "/sandboxes",
        r#"{"templateID":"base","secure":true}"#,
    )
    .await;
    let b = r.json()["sandboxID"].as_str().unwrap().to_string();
    let token_b = r.json()["envdAccessToken"].as_str().unwrap().to_string();
    // A create without `secure` (as the current E2B SDK sends it) gets a token too,
    // and its agent requires it.
    let open = create(addr, r#"{"templateID":"base"}"#).await;
    assert_eq!(
        api(addr, "GET", &format!("/sandboxes/{open}"), "")
            .await
            .json()["envdAccessToken"],
        node.orch.tokens().envd_token(&open)
    );
    let r = request(
        addr,
        "POST",
        path_list(),
        &[
            ("e2b-sandbox-id", open.as_str()),
            ("content-type", "application/json"),
        ],
        "{}",
    )
    .await;
    assert_eq!(r.status, 401, "a sandbox created without `secure` is open");

    // No token, the API key, another sandbox's token, two tokens: 401.
    let path = "/proxy/process.Process/List";
    for h in [
        vec![("e2b-sandbox-id", a.as_str())],
        vec![("e2b-sandbox-id", a.as_str()), ("x-api-key", API_KEY)],
        vec![
            ("e2b-sandbox-id", a.as_str()),
            ("x-access-token", token_b.as_str()),
        ],
        vec![
            ("e2b-sandbox-id", a.as_str()),
            ("x-access-token", token_a.as_str()),
            ("x-access-token", token_a.as_str()),
        ],
    ] {
        let r = request(
            addr,
            "POST",
            path,
            &[h.as_slice(), &[("content-type", "application/json")]].concat(),
            "{}",
        )
        .await;
        assert_eq!((r.status, r.body.len()), (401, 0), "{h:?}");
    }
    // `/init` (which would set a new token and environment) is the node's alone: even
    // the sandbox's own token cannot reach it through the data plane.
    for path in ["/proxy/init", "/proxy/init?x=1"] {
        let r = request(
            addr,
            "POST",
            path,
            &[
                ("e2b-sandbox-id", a.as_str()),
                ("x-access-token", token_a.as_str()),
                ("content-type", "application/json"),
            ],
            r#"{"accessToken":"taken-over"}"#,
        )
        .await;
        assert_eq!(r.status, 403, "{path}: {}", r.text());
    }
    assert!(run(addr, &a, Some(&token_b), "true").await.is_err());
    let out = run(addr, &a, Some(&token_a), "echo secure").await.unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "secure\n");
    let out = run(addr, &b, Some(&token_b), "hostname").await.unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), format!("{b}\n"));
    // An insecure sandbox needs nothing.
    run(addr, &open, None, "true").await.unwrap();
    node.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn private_ports_need_the_traffic_token() {
    require_node!();
    let home = tempfile::tempdir().unwrap();
    let node = Node::start(node_common::config(home.path(), 22)).await;
    let addr = node.addr;
    let (id, traffic) = create_with_token(
        addr,
        "/v2/sandboxes",
        r#"{"templateID":"base","network":{"allowPublicTraffic":false}}"#,
        "trafficAccessToken",
    )
    .await;
    let public = create(addr, r#"{"templateID":"base"}"#).await;
    let pr = api(addr, "POST", "/v2/sandboxes", r#"{"templateID":"base"}"#).await;
    assert!(pr.json()["trafficAccessToken"].is_null());
    for sbx in [&id, &public] {
        run(addr, sbx, None, "mkdir -p /srv && echo served > /srv/x && cd /srv && (python3 -m http.server 8080 >/dev/null 2>&1 &) ; for i in $(seq 100); do python3 -c 'import socket; socket.create_connection((\"127.0.0.1\", 8080))' 2>/dev/null && break; sleep 0.05; done")
            .await
            .unwrap();
    }
    let get = |sbx: String, extra: Vec<(&'static str, String)>| async move {
        let mut h: Vec<(&str, &str)> = vec![
            ("e2b-sandbox-id", sbx.as_str()),
            ("e2b-sandbox-port", "8080"),
        ];
        for (k, v) in &extra {
            h.push((k, v.as_str()));
        }
        request(addr, "GET", "/proxy/x", &h, "").await
    };
    let r = get(id.clone(), vec![]).await;
    assert_eq!(r.status, 401);
    let r = get(id.clone(), vec![("x-api-key", API_KEY.to_string())]).await;
    assert_eq!(r.status, 401, "the API key never opens the data plane");
    let other = node.orch.tokens().traffic_token(&public);
    let r = get(id.clone(), vec![("e2b-traffic-access-token", other)]).await;
    assert_eq!(r.status, 401);
    let r = get(
        id.clone(),
        vec![("e2b-traffic-access-token", traffic.clone())],
    )
    .await;
    assert_eq!((r.status, r.text().as_str()), (200, "served\n"));
    let r = get(public.clone(), vec![]).await;
    assert_eq!((r.status, r.text().as_str()), (200, "served\n"));
    // The agent port of a non-secure sandbox stays open even without public traffic.
    run(addr, &id, None, "true").await.unwrap();
    node.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_report_this_node_with_counts() {
    require_node!();
    let home = tempfile::tempdir().unwrap();
    let node = Node::start(node_common::config(home.path(), 23)).await;
    let addr = node.addr;
    let running = create(addr, r#"{"templateID":"base","cpuCount":1,"memoryMB":128}"#).await;
    let paused = create(addr, r#"{"templateID":"base","cpuCount":1,"memoryMB":256}"#).await;
    assert_eq!(
        api(addr, "POST", &format!("/sandboxes/{paused}/pause"), "")
            .await
            .status,
        204
    );
    let v = api(addr, "GET", "/nodes", "").await.json();
    let n = &v[0];
    assert_eq!(n["id"], "test-node-23");
    assert_eq!(n["status"], "ready");
    assert_eq!(
        (n["sandboxCount"].as_u64(), n["sandboxPausedCount"].as_u64()),
        (Some(1), Some(1))
    );
    assert_eq!(n["sandboxStartingCount"], 0);
    assert_eq!(n["metrics"]["allocatedMemoryBytes"], 128u64 << 20);
    assert_eq!(n["metrics"]["pausedAllocatedMemoryBytes"], 256u64 << 20);
    assert!(n["machineInfo"]["cpuModelName"].as_str().is_some());
    let d = api(addr, "GET", "/nodes/test-node-23", "").await;
    assert_eq!(d.status, 200);
    assert_eq!(d.json()["cachedBuilds"], serde_json::json!([]));
    let other = api(addr, "GET", "/nodes?clusterID=another", "")
        .await
        .json();
    assert_eq!(other, serde_json::json!([]));
    // Stage timings of the creates and the pause are on /metrics.
    let m = request(addr, "GET", "/metrics", &[], "").await.text();
    for needle in [
        "agentenv_sandbox_stage_duration_seconds_count{operation=\"create_warm\",stage=\"total\",status=\"success\"} 2",
        "agentenv_sandbox_stage_duration_seconds_count{operation=\"create_warm\",stage=\"agent_ready\",status=\"success\"} 2",
        "agentenv_sandbox_stage_duration_seconds_count{operation=\"pause\",stage=\"total\",status=\"success\"} 1",
        "agentenv_sandbox_stage_inflight{operation=\"pause\",stage=\"total\"} 0",
    ] {
        assert!(m.contains(needle), "{needle} not in:\n{m}");
    }
    let _ = running;
    node.stop().await;
}
