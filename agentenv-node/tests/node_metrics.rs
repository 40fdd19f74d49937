//! The node's `/metrics` stays bounded whatever clients send: request labels come
//! from fixed sets, so ten thousand distinct HTTP methods make no new series.

mod node_common;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::TokioIo;
use node_common::Node;

/// The distinct `method` label values of the request histogram in `text`.
fn method_labels(text: &str) -> std::collections::BTreeSet<String> {
    text.lines()
        .filter(|l| l.starts_with("agentenv_http_request_duration_seconds_count{"))
        .filter_map(|l| l.split("method=\"").nth(1))
        .filter_map(|rest| rest.split('"').next())
        .map(str::to_string)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_distinct_methods_leave_the_metrics_output_bounded() {
    require_node!();
    let home = tempfile::tempdir().unwrap();
    let node = Node::start(node_common::config(home.path(), 24)).await;
    let addr = node.addr;
    // One keep-alive connection; every request a method never seen before, on the
    // control plane and on the data plane.
    let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .unwrap();
    tokio::spawn(conn);
    let mut statuses = std::collections::BTreeSet::new();
    for i in 0..10_000 {
        let path = if i % 2 == 0 { "/sandboxes" } else { "/proxy/x" };
        let req = hyper::Request::builder()
            .method(format!("M{i:05}").as_str())
            .uri(path)
            .header("host", addr.to_string())
            .body(Empty::<Bytes>::new())
            .unwrap();
        send.ready().await.unwrap();
        let resp = send.send_request(req).await.unwrap();
        statuses.insert(resp.status().as_u16());
        resp.into_body().collect().await.unwrap();
    }
    assert!(statuses.iter().all(|s| *s >= 400), "{statuses:?}");
    let text = node_common::request(addr, "GET", "/metrics", &[], "")
        .await
        .text();
    let methods = method_labels(&text);
    assert!(
        methods.len() <= 10 && methods.contains("OTHER"),
        "the unknown methods share one label: {methods:?}"
    );
    assert!(!text.contains("M00001"), "a client's method became a label");
    assert!(
        text.len() < 64 * 1024,
        "/metrics grew to {} bytes",
        text.len()
    );
    node.stop().await;
}
