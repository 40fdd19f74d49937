//! Authentication, dispatch and routing through a real in-process scheduler
//! to fake nodes on loopback.

mod common;

use std::time::Duration;

use agentenv_proxy::{Gateway, GatewayError, GatewayOptions, InProcessScheduler};
use common::*;
use http::{Request, StatusCode};
use http_body_util::Full;

fn req(method: &str, url: &str) -> http::request::Builder {
    Request::builder().method(method).uri(url)
}

#[tokio::test]
async fn gateway_refuses_an_empty_api_key() {
    let err = gateway_error(GatewayOptions {
        api_key: String::new(),
        ..options()
    });
    assert!(matches!(err, GatewayError::EmptyApiKey));
    assert!(err.to_string().starts_with("API key is required"));
}

/// Why a gateway with `opts` does not start.
fn gateway_error(opts: GatewayOptions) -> GatewayError {
    let sched = agentenv_sched::Scheduler::builder(Default::default())
        .build()
        .unwrap();
    Gateway::new(
        InProcessScheduler::new(std::sync::Arc::new(sched.service())),
        opts,
    )
    .err()
    .expect("the gateway refuses the options")
}

#[tokio::test]
async fn gateway_refuses_an_invalid_proxy_domain() {
    let err = gateway_error(GatewayOptions {
        sandbox_proxy_domains: vec!["not a domain!".into()],
        ..options()
    });
    assert!(
        err.to_string()
            .starts_with("gateway.sandbox_proxy_domains contains invalid domain \"not a domain!\"")
    );
}

#[tokio::test]
async fn nodes_require_exactly_one_correct_api_key() {
    let (node, _) = FakeNode::echo().await;
    let c = Cluster::ready(&[("node-a", &node.endpoint)], options()).await;
    let url = c.url("/nodes");
    let bearer = format!("Bearer {API_KEY}");
    type Case<'a> = (&'a str, Vec<(&'a str, &'a str)>, StatusCode);
    let cases: Vec<Case> = vec![
        ("no key", vec![], StatusCode::UNAUTHORIZED),
        (
            "wrong key",
            vec![("x-api-key", "e2b_wrong_wrong_wrong_wrong_wrong_wrong_00")],
            StatusCode::UNAUTHORIZED,
        ),
        (
            "short key",
            vec![("x-api-key", "e2b")],
            StatusCode::UNAUTHORIZED,
        ),
        (
            "bearer",
            vec![("authorization", bearer.as_str())],
            StatusCode::UNAUTHORIZED,
        ),
        (
            "two keys",
            vec![("x-api-key", API_KEY), ("x-api-key", API_KEY)],
            StatusCode::UNAUTHORIZED,
        ),
        ("right key", vec![("X-API-Key", API_KEY)], StatusCode::OK),
    ];
    for (name, headers, want) in cases {
        let mut b = req("GET", &url);
        for (k, v) in headers {
            b = b.header(k, v);
        }
        let (status, resp_headers, body) = send(b.body(Full::default()).unwrap()).await;
        assert_eq!(status, want, "{name}");
        if want == StatusCode::UNAUTHORIZED {
            assert!(body.is_empty(), "{name}: 401 has an empty body");
            assert!(resp_headers.get("www-authenticate").is_none(), "{name}");
        }
    }
}

#[tokio::test]
async fn local_health_is_204_and_metrics_is_404_without_a_key() {
    let c = Cluster::ready(&[], options()).await;
    let (status, _, body) =
        send(req("GET", &c.url("/health")).body(Full::default()).unwrap()).await;
    assert_eq!(status, StatusCode::NO_CONTENT);
    assert!(body.is_empty());
    let (status, _, body) = send(req("GET", &c.url("/metrics")).empty()).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(message(&body), "404 page not found");
}

#[tokio::test]
async fn data_plane_proxy_requests_skip_the_api_key_and_leave_tokens_to_the_node() {
    let (node, log) = FakeNode::echo().await;
    let c = Cluster::with_sandbox(&node.endpoint, options()).await;
    let tokens: [Option<(&str, &str)>; 4] = [
        None,
        Some(("e2b-traffic-access-token", "wrong")),
        Some(("e2b-traffic-access-token", "right")),
        Some(("x-access-token", "secret")),
    ];
    for (i, token) in tokens.iter().enumerate() {
        let mut b = req("GET", &c.url("/proxy")).e2b_route("sbx-1", "49983");
        if let Some((k, v)) = token {
            b = b.header(*k, *v);
        }
        let (status, _, _) = send(b.body(Full::default()).unwrap()).await;
        assert_eq!(status, StatusCode::OK, "case {i}");
        assert_eq!(c.count("LookupNode"), i + 1);
        if let Some((k, v)) = token {
            assert_eq!(
                log.lock().last().unwrap().headers[*k],
                *v,
                "token passed through"
            );
        }
    }
    // Control plane with data-plane headers still needs the key, and is
    // rejected before any scheduler call.
    let before = c.count("LookupNode");
    let (status, _, _) = send(
        req("POST", &c.url("/sandboxes/sbx-1/pause"))
            .e2b_route("sbx-1", "49983")
            .header("e2b-traffic-access-token", "right")
            .empty(),
    )
    .await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    assert_eq!(c.count("LookupNode"), before);
}

#[tokio::test]
async fn explicit_proxy_path_without_both_headers_is_400_and_never_scheduled() {
    let c = Cluster::ready(&[], options()).await;
    let cases: [(&[(&str, &str)], &str); 3] = [
        (&[], "sandbox id header required"),
        (&[("e2b-sandbox-id", "sbx")], "target port header required"),
        (
            &[("e2b-sandbox-port", "49983")],
            "sandbox id header required",
        ),
    ];
    for (headers, want) in cases {
        let mut b = req("GET", &c.url("/proxy/x"));
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        let (status, _, body) = send(b.body(Full::default()).unwrap()).await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        assert_eq!(message(&body), want);
    }
    assert_eq!(c.count("Schedule"), 0);
    assert_eq!(c.count("LookupNode"), 0);
}

#[tokio::test]
async fn header_routed_requests_go_under_proxy_and_proxy_paths_are_not_doubled() {
    let (node, _) = FakeNode::echo().await;
    let c = Cluster::with_sandbox(&node.endpoint, options()).await;
    for (path, want) in [
        ("/files?path=/tmp", "/proxy/files?path=/tmp"),
        ("/proxy/x", "/proxy/x"),
        ("/", "/proxy/"),
    ] {
        let (status, headers, body) = send(
            req("GET", &c.url(path))
                .agentenv_route("sbx-1", "49983")
                .empty(),
        )
        .await;
        assert_eq!(status, StatusCode::OK, "{path}");
        assert_eq!(json(&body)["uri"], want, "{path}");
        assert_eq!(
            headers["x-agentenv-node-id"], "node-a",
            "debug mode names the node"
        );
    }
}

#[tokio::test]
async fn control_plane_path_id_wins_over_header_id_and_is_forwarded_unprefixed() {
    let (node_a, log_a) = FakeNode::start_logging(StatusCode::CREATED).await;
    let (node_b, log_b) = FakeNode::start_logging(StatusCode::CREATED).await;
    let c = Cluster::two_nodes(&node_a, &node_b).await;
    c.heartbeat("node-a", &["sbx-path"]).await;
    c.heartbeat("node-b", &["sbx-header"]).await;
    let (status, _, _) = send(
        req("POST", &c.url("/sandboxes/sbx-path/connect"))
            .header("x-api-key", API_KEY)
            .e2b_route("sbx-header", "49983")
            .body(Full::from(r#"{"timeout":60}"#))
            .unwrap(),
    )
    .await;
    assert_eq!(status, StatusCode::CREATED);
    assert!(log_b.lock().is_empty(), "the header's node was not used");
    let seen = log_a.lock()[0].clone();
    assert_eq!(seen.uri, "/sandboxes/sbx-path/connect");
    assert_eq!(
        seen.headers["e2b-sandbox-id"], "sbx-header",
        "e2b header forwarded unchanged"
    );
    assert_eq!(seen.body, r#"{"timeout":60}"#);
}

#[tokio::test]
async fn v2_connect_is_routed_by_path_id() {
    let (node_a, log_a) = FakeNode::start_logging(StatusCode::OK).await;
    let (node_b, _) = FakeNode::start_logging(StatusCode::OK).await;
    let c = Cluster::two_nodes(&node_a, &node_b).await;
    c.heartbeat("node-b", &[]).await;
    c.heartbeat("node-a", &["sbx-v2"]).await;
    let (status, _, _) = send(
        req("POST", &c.url("/v2/sandboxes/sbx-v2/connect"))
            .header("x-api-key", API_KEY)
            .body(Full::from("{}"))
            .unwrap(),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(log_a.lock()[0].uri, "/v2/sandboxes/sbx-v2/connect");
    assert_eq!(c.count("Schedule"), 0);
}

#[tokio::test]
async fn any_sandbox_subpath_without_headers_is_routed_by_its_id_not_scheduled() {
    let (node_a, log_a) = FakeNode::echo().await;
    let (node_b, log_b) = FakeNode::echo().await;
    let c = Cluster::two_nodes(&node_a, &node_b).await;
    c.heartbeat("node-b", &["sbx-b"]).await;
    for _ in 0..3 {
        let (status, _, body) = get(&c.url("/sandboxes/sbx-b/files")).await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(json(&body)["uri"], "/sandboxes/sbx-b/files");
    }
    assert_eq!(log_b.lock().len(), 3);
    assert!(log_a.lock().is_empty());
    assert_eq!(c.count("Schedule"), 0);
}

#[tokio::test]
async fn unknown_sandbox_is_404_from_the_scheduler() {
    let (node, _) = FakeNode::echo().await;
    let c = Cluster::ready(&[("node-a", &node.endpoint)], options()).await;
    let (status, _, body) = get(&c.url("/sandboxes/nope")).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(message(&body), "sandbox assignment not found");
}

#[tokio::test]
async fn forwarded_headers_replace_client_values_and_keep_host() {
    let (node, _) = FakeNode::echo().await;
    let c = Cluster::with_sandbox(&node.endpoint, options()).await;
    let (status, _, body) = send(
        req("PUT", &c.url("/sandboxes/sbx-1/network?x=1"))
            .header("host", "api.example.test:8080")
            .header("x-api-key", API_KEY)
            .header("x-forwarded-for", "10.9.9.9, 10.8.8.8")
            .header("x-forwarded-host", "spoofed")
            .header("forwarded", "for=10.9.9.9")
            .header("connection", "keep-alive, x-hop")
            .header("x-hop", "1")
            .body(Full::from("{}"))
            .unwrap(),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let v = json(&body);
    let h = &v["headers"];
    assert_eq!(v["uri"], "/sandboxes/sbx-1/network?x=1");
    assert_eq!(h["host"][0], "api.example.test:8080");
    assert_eq!(h["x-forwarded-for"][0], "127.0.0.1");
    assert_eq!(h["x-forwarded-for"].as_array().unwrap().len(), 1);
    assert_eq!(h["x-forwarded-host"][0], "api.example.test:8080");
    assert_eq!(h["x-forwarded-proto"][0], "http");
    assert_eq!(h["x-forwarded-method"][0], "PUT");
    assert_eq!(h["x-forwarded-uri"][0], "/sandboxes/sbx-1/network?x=1");
    assert_eq!(
        h["x-api-key"][0], API_KEY,
        "the key is forwarded to the node"
    );
    assert!(h.get("forwarded").is_none());
    assert!(
        h.get("x-hop").is_none(),
        "headers named in Connection are dropped"
    );
}

#[tokio::test]
async fn escaped_segments_reach_the_node_unchanged() {
    let (node, _) = FakeNode::echo().await;
    let c = Cluster::with_sandbox(&node.endpoint, options()).await;
    let (status, _, body) = send(
        req(
            "GET",
            &c.url("/files/a%2Fb/%252F/c%20d?path=%2Ftmp%2Fx&y=a+b"),
        )
        .e2b_route("sbx-1", "49983")
        .empty(),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let v = json(&body);
    assert_eq!(
        v["uri"],
        "/proxy/files/a%2Fb/%252F/c%20d?path=%2Ftmp%2Fx&y=a+b"
    );
    assert_eq!(
        v["headers"]["x-forwarded-uri"][0],
        "/files/a%2Fb/%252F/c%20d?path=%2Ftmp%2Fx&y=a+b"
    );
}

#[tokio::test]
async fn health_and_metrics_with_routing_headers_are_proxied_to_the_sandbox() {
    let (node, _) = FakeNode::echo().await;
    let c = Cluster::with_sandbox(&node.endpoint, options()).await;
    for path in ["/health", "/metrics"] {
        let (status, _, body) =
            send(req("GET", &c.url(path)).e2b_route("sbx-1", "49983").empty()).await;
        assert_eq!(status, StatusCode::OK, "{path}");
        let v = json(&body);
        assert_eq!(v["uri"], format!("/proxy{path}"));
        assert_eq!(v["headers"]["e2b-sandbox-port"][0], "49983");
        assert_eq!(v["headers"]["x-forwarded-uri"][0], path);
        // Only a port header: no sandbox to route to.
        let (status, _, body) = send(
            req("GET", &c.url(path))
                .header("e2b-sandbox-port", "49983")
                .empty(),
        )
        .await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{path}");
        assert_eq!(message(&body), "sandbox id header required");
    }
}

#[tokio::test]
async fn host_routes_set_routing_headers_and_override_client_ones() {
    let (node_a, _) = FakeNode::echo().await;
    let (node_b, log_b) = FakeNode::echo().await;
    let c = Cluster::two_nodes(&node_a, &node_b).await;
    c.heartbeat("node-a", &["decoy"]).await;
    c.heartbeat("node-b", &["sbx-host"]).await;
    let host = format!("40988-sbx-host.{DOMAIN}");
    let (status, _, body) = send(
        req("GET", &c.url("/readyz?a=1"))
            .header("host", &host)
            .agentenv_route("decoy", "1")
            .empty(),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "no API key needed on a host route");
    let v = json(&body);
    assert_eq!(v["uri"], "/proxy/readyz?a=1");
    assert_eq!(v["headers"]["host"][0], host);
    assert_eq!(v["headers"]["x-agentenv-sandbox-id"][0], "sbx-host");
    assert_eq!(v["headers"]["x-agentenv-target-port"][0], "40988");
    assert_eq!(v["headers"]["x-forwarded-host"][0], host);
    assert_eq!(v["headers"]["x-forwarded-uri"][0], "/readyz?a=1");
    assert_eq!(log_b.lock().len(), 1);

    for path in ["/health", "/metrics"] {
        let (status, _, body) = send(req("GET", &c.url(path)).header("host", &host).empty()).await;
        assert_eq!(status, StatusCode::OK, "{path}");
        let v = json(&body);
        assert_eq!(v["uri"], format!("/proxy{path}"));
        assert_eq!(v["headers"]["x-agentenv-sandbox-id"][0], "sbx-host");
        assert_eq!(v["headers"]["x-agentenv-target-port"][0], "40988");
    }
}

#[tokio::test]
async fn malformed_host_labels_are_400_with_the_parse_message() {
    let c = Cluster::ready(&[], options()).await;
    let cases = [
        (
            format!("40988-sbx_bad.{DOMAIN}"),
            "invalid sandbox data-plane host: sandbox id is invalid",
        ),
        (
            format!("abc-sbx.{DOMAIN}"),
            "invalid sandbox data-plane host: port is not numeric",
        ),
        (
            format!("70000-sbx.{DOMAIN}"),
            "invalid sandbox data-plane host: port out of range",
        ),
        (
            format!("40988-.{DOMAIN}"),
            "invalid sandbox data-plane host: sandbox id is empty",
        ),
        (
            format!("40988-{}.{DOMAIN}", "a".repeat(58)),
            "invalid sandbox data-plane host: label too long",
        ),
    ];
    for (host, want) in cases {
        let (status, _, body) = send(
            req("GET", &c.url("/x"))
                .header("host", &host)
                .header("x-api-key", API_KEY)
                .empty(),
        )
        .await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{host}");
        assert_eq!(message(&body), want);
        // /health on a bad host is routed (and fails the same way).
        let (status, _, body) =
            send(req("GET", &c.url("/health")).header("host", &host).empty()).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{host}");
        assert_eq!(message(&body), want);
    }
    // A malformed host is not exempt from the key.
    let (status, _, _) = send(
        req("GET", &c.url("/x"))
            .header("host", format!("40988-sbx_bad.{DOMAIN}"))
            .empty(),
    )
    .await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    assert_eq!(c.count("LookupNode") + c.count("Schedule"), 0);
}

#[tokio::test]
async fn no_healthy_node_answers_503() {
    let (node, log) = FakeNode::echo().await;
    // Discovered but never heartbeated: not eligible.
    let c = Cluster::start(&[("node-a", &node.endpoint)], options()).await;
    let (status, _, body) = send(
        req("POST", &c.url("/sandboxes"))
            .header("x-api-key", API_KEY)
            .body(Full::from(r#"{"templateID":"base"}"#))
            .unwrap(),
    )
    .await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    let m = message(&body);
    assert!(m.starts_with("no nodes available: "), "{m}");
    assert!(
        m.contains("GET /nodes") && m.contains("AENV_OBSERVABILITY_SCHEDULER_ENDPOINT"),
        "the message names what to check: {m}"
    );
    assert!(log.lock().is_empty());
}

#[tokio::test]
async fn a_dead_node_is_502_upstream_unavailable() {
    let (node, _) = FakeNode::echo().await;
    let endpoint = node.endpoint.clone();
    node.stop().await;
    let c = Cluster::ready(&[("node-a", &endpoint)], options()).await;
    c.heartbeat("node-a", &["sbx-1"]).await;
    let (status, _, body) = get(&c.url("/sandboxes/sbx-1")).await;
    assert_eq!(status, StatusCode::BAD_GATEWAY);
    assert_eq!(
        message(&body),
        format!("upstream unavailable: node node-a at {endpoint} did not answer")
    );
}

/// A gateway with a 300 ms request timeout in front of `node` answers a
/// request for its sandbox with 504 `upstream timeout`.
async fn assert_upstream_timeout(node: FakeNode) {
    let opts = GatewayOptions {
        request_timeout: Duration::from_millis(300),
        ..options()
    };
    let c = Cluster::with_sandbox(&node.endpoint, opts).await;
    let (status, _, body) = get(&c.url("/sandboxes/sbx-1")).await;
    assert_eq!(status, StatusCode::GATEWAY_TIMEOUT);
    assert_eq!(message(&body), "upstream timeout");
}

#[tokio::test]
async fn a_slow_node_is_504_upstream_timeout() {
    assert_upstream_timeout(FakeNode::hanging().await).await;
}

#[tokio::test]
async fn a_body_that_stalls_past_the_timeout_is_cut_off() {
    let node =
        FakeNode::start(|_req| async { http::Response::new(stalled_body(Some("first"))) }).await;
    let opts = GatewayOptions {
        request_timeout: Duration::from_millis(300),
        ..options()
    };
    let c = Cluster::with_sandbox(&node.endpoint, opts).await;
    let resp = client()
        .request(
            req("GET", &c.url("/sandboxes/sbx-1"))
                .header("x-api-key", API_KEY)
                .empty(),
        )
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    use http_body_util::BodyExt;
    let err = resp.into_body().collect().await;
    assert!(
        err.is_err(),
        "the body must not end cleanly after the deadline"
    );
}

#[tokio::test]
async fn invalid_percent_encoding_is_400() {
    let c = Cluster::ready(&[], options()).await;
    let (status, _, body) = get(&c.url("/sandboxes/a%zz/pause")).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(message(&body).contains("percent-encoding"));
}

#[tokio::test]
async fn per_thread_serving_routes_on_every_thread_and_drains_on_shutdown() {
    let (node, log) = FakeNode::echo().await;
    let c = Cluster::with_sandbox(&node.endpoint, options()).await;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let handle = c
        .gateway
        .serve_threads("127.0.0.1:0".parse().unwrap(), 3, async move {
            let _ = stopped.await;
        })
        .unwrap();
    let addr = handle.local_addr();
    // Fresh connections are spread over the threads by the kernel; each
    // thread has its own upstream pool and must route correctly.
    for i in 0..30 {
        let (status, _, body) = send(
            req("GET", &format!("http://{addr}/item/{i}"))
                .e2b_route("sbx-1", "49983")
                .header("connection", "close")
                .empty(),
        )
        .await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(json(&body)["uri"], format!("/proxy/item/{i}"));
    }
    assert_eq!(log.lock().len(), 30);
    stop.send(()).unwrap();
    handle.wait().await;
    assert!(
        tokio::net::TcpStream::connect(addr).await.is_err(),
        "listeners are closed after shutdown"
    );
}

#[tokio::test]
async fn headers_without_any_body_before_the_timeout_give_504() {
    let node = FakeNode::start(|_req| async { http::Response::new(stalled_body(None)) }).await;
    assert_upstream_timeout(node).await;
}

#[tokio::test]
async fn without_debug_mode_no_node_header_is_added() {
    let (node, _) = FakeNode::echo().await;
    let opts = GatewayOptions {
        debug_mode: false,
        ..options()
    };
    let c = Cluster::with_sandbox(&node.endpoint, opts).await;
    let (status, headers, _) = get(&c.url("/sandboxes/sbx-1")).await;
    assert_eq!(status, StatusCode::OK);
    assert!(headers.get("x-agentenv-node-id").is_none());
}

#[tokio::test]
async fn non_utf8_escapes_are_forwarded_byte_for_byte() {
    let (node, _) = FakeNode::echo().await;
    let c = Cluster::with_sandbox(&node.endpoint, options()).await;
    let (status, _, body) = send(
        req("GET", &c.url("/files/%ff%fe.bin"))
            .e2b_route("sbx-1", "49983")
            .empty(),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(json(&body)["uri"], "/proxy/files/%ff%fe.bin");
}
