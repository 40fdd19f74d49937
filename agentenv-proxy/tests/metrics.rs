//! Gateway metrics: request, upstream and scheduler-RPC histograms with the
//! documented labels, scraped over HTTP.

mod common;

use common::*;
use http::{Request, StatusCode};
use http_body_util::Full;

fn count(text: &str, series: &str) -> f64 {
    metric_value(text, series).unwrap_or_else(|| panic!("no series {series} in\n{text}"))
}

#[tokio::test]
async fn requests_are_labelled_by_route_source_and_status() {
    let (node, _) = FakeNode::canned(
        StatusCode::CREATED,
        &[("x-agentenv-sandbox-id", "sbx-m")],
        "{}",
    )
    .await;
    let c = Cluster::ready(&[("node-a", &node.endpoint)], options()).await;
    let post = |path: &str| {
        Request::post(c.url(path))
            .header("x-api-key", API_KEY)
            .body(Full::from("{}"))
            .unwrap()
    };
    assert_eq!(send(post("/sandboxes")).await.0, StatusCode::CREATED);
    assert_eq!(
        send(post("/sandboxes/sbx-m/pause")).await.0,
        StatusCode::CREATED
    );
    // Unauthenticated: recorded with route_source unknown.
    let (status, _, _) = send(Request::get(c.url("/nodes")).body(Full::default()).unwrap()).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    // Local /health and /metrics are not instrumented.
    send(Request::get(c.url("/health")).empty()).await;
    send(Request::get(c.url("/metrics")).empty()).await;
    // Sandbox-routed /health is.
    send(
        Request::get(c.url("/health"))
            .e2b_route("sbx-m", "49983")
            .empty(),
    )
    .await;

    // Scrape over HTTP, as Prometheus would.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let maddr = listener.local_addr().unwrap();
    tokio::spawn(agentenv_core::metrics::serve(
        listener,
        c.gateway.metrics().registry(),
        std::future::pending(),
    ));
    let (status, _, body) = send(Request::get(format!("http://{maddr}/metrics")).empty()).await;
    assert_eq!(status, StatusCode::OK);
    let text = String::from_utf8(body.to_vec()).unwrap();
    let req = "agentenv_gateway_http_request_duration_seconds_count";
    assert_eq!(
        count(
            &text,
            &format!(
                r#"{req}{{method="POST",route="/sandboxes",route_source="schedule",status="2xx"}}"#
            )
        ),
        1.0
    );
    assert_eq!(
        count(
            &text,
            &format!(
                r#"{req}{{method="POST",route="/sandboxes/{{sandbox_id}}/pause",route_source="path",status="2xx"}}"#
            )
        ),
        1.0
    );
    assert_eq!(
        count(
            &text,
            &format!(r#"{req}{{method="GET",route="/nodes",route_source="unknown",status="4xx"}}"#)
        ),
        1.0
    );
    assert_eq!(
        count(
            &text,
            &format!(
                r#"{req}{{method="GET",route="unmatched",route_source="header",status="2xx"}}"#
            )
        ),
        1.0
    );
    let total: usize = text.lines().filter(|l| l.starts_with(req)).count();
    assert_eq!(
        total, 4,
        "local /health and /metrics are not recorded:\n{text}"
    );
    let up = "agentenv_gateway_upstream_proxy_duration_seconds_count";
    assert_eq!(
        count(
            &text,
            &format!(r#"{up}{{route="/sandboxes",status="2xx"}}"#)
        ),
        1.0
    );
    let rpc = "agentenv_gateway_scheduler_rpc_duration_seconds_count";
    assert_eq!(
        count(&text, &format!(r#"{rpc}{{rpc="Schedule",status="ok"}}"#)),
        1.0
    );
    assert_eq!(
        count(
            &text,
            &format!(r#"{rpc}{{rpc="RecordAssignment",status="ok"}}"#)
        ),
        1.0
    );
    assert_eq!(
        count(&text, &format!(r#"{rpc}{{rpc="LookupNode",status="ok"}}"#)),
        2.0
    );
    assert!(text.contains("agentenv_gateway_open_connections"));
    assert!(
        text.contains(r#"le="0.001""#) && text.contains(r#"le="1800.0""#),
        "shared buckets"
    );
}

#[tokio::test]
async fn scheduler_errors_and_closed_clients_have_their_own_labels() {
    let node = FakeNode::hanging().await;
    let c = Cluster::ready(&[("node-a", &node.endpoint)], options()).await;
    let (status, _, _) = get(&c.url("/sandboxes/unknown")).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    c.heartbeat("node-a", &["sbx-hang"]).await;
    let url = c.url("/sandboxes/sbx-hang");
    let pending = tokio::spawn(async move { get(&url).await });
    let rpc =
        r#"agentenv_gateway_scheduler_rpc_duration_seconds_count{rpc="LookupNode",status="ok"}"#;
    eventually("the hanging request to reach the node", || {
        metric_value(&c.metrics_text(), rpc) == Some(1.0)
    })
    .await;
    pending.abort();
    let closed = r#"agentenv_gateway_http_request_duration_seconds_count{method="GET",route="/sandboxes/{sandbox_id}",route_source="path",status="client_closed"}"#;
    eventually("a client_closed sample", || {
        metric_value(&c.metrics_text(), closed) == Some(1.0)
    })
    .await;
    let text = c.metrics_text();
    assert_eq!(
        count(
            &text,
            r#"agentenv_gateway_scheduler_rpc_duration_seconds_count{rpc="LookupNode",status="not_found"}"#
        ),
        1.0
    );
}

#[tokio::test]
async fn ten_thousand_distinct_methods_make_no_new_series_in_either_lane() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (node, _) = FakeNode::start_logging(StatusCode::OK).await;
    let c = Cluster::with_sandbox(&node.endpoint, options()).await;
    // Raw pipelined requests on one connection: sandbox-routed ones (the fast lane)
    // and control-plane ones (hyper), each with a method never seen before.
    let mut s = tokio::net::TcpStream::connect(c.addr).await.unwrap();
    let (mut rd, mut wr) = s.split();
    let writer = async {
        for i in 0..10_000 {
            let req = if i % 2 == 0 {
                format!(
                    "M{i:05} /x HTTP/1.1\r\nhost: gw\r\ne2b-sandbox-id: sbx-1\r\ne2b-sandbox-port: 49983\r\ncontent-length: 0\r\n\r\n"
                )
            } else {
                format!(
                    "M{i:05} /nodes HTTP/1.1\r\nhost: gw\r\nx-api-key: {API_KEY}\r\ncontent-length: 0\r\n\r\n"
                )
            };
            wr.write_all(req.as_bytes()).await.unwrap();
        }
        wr.write_all(b"GET /health HTTP/1.1\r\nhost: gw\r\nconnection: close\r\n\r\n")
            .await
            .unwrap();
    };
    let mut got = Vec::new();
    let reader = rd.read_to_end(&mut got);
    let (_, read) = tokio::join!(writer, reader);
    read.unwrap();
    let answers = String::from_utf8_lossy(&got).matches("HTTP/1.1 ").count();
    assert_eq!(answers, 10_001, "every request was answered");
    let text = c.metrics_text();
    let methods: std::collections::BTreeSet<&str> = text
        .lines()
        .filter(|l| l.starts_with("agentenv_gateway_http_request_duration_seconds_count{"))
        .filter_map(|l| l.split("method=\"").nth(1)?.split('"').next())
        .collect();
    assert!(
        methods.len() <= 8 && methods.contains("OTHER"),
        "the unknown methods share one label: {methods:?}"
    );
    assert!(!text.contains("M00001"), "a client's method became a label");
    assert!(
        text.len() < 64 * 1024,
        "/metrics grew to {} bytes",
        text.len()
    );
}
