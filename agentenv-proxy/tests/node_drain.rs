//! `POST` and `DELETE /nodes/{id}/drain`: the gateway asks the scheduler to
//! stop (or resume) placing sandboxes on a node, behind the API key, and
//! shows the node as `draining` in `GET /nodes`.

mod common;

use common::*;
use http::{Request, StatusCode};
use http_body_util::Full;

fn drain_request(method: &str, url: &str, key: Option<&str>) -> Request<Full<bytes::Bytes>> {
    let mut b = Request::builder().method(method).uri(url);
    if let Some(k) = key {
        b = b.header("x-api-key", k);
    }
    b.empty()
}

async fn status_in_list(c: &Cluster, id: &str) -> String {
    let (status, _, body) = get(&c.url("/nodes")).await;
    assert_eq!(status, StatusCode::OK);
    let nodes = json(&body);
    let node = nodes
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["id"] == id)
        .unwrap_or_else(|| panic!("{id} listed in {nodes}"));
    assert!(node["lastHeartbeatUnixMs"].as_i64().unwrap() > 0);
    node["status"].as_str().unwrap().to_string()
}

#[tokio::test]
async fn drain_and_undrain_change_placement_and_the_listed_status() {
    let (a, _) = FakeNode::echo().await;
    let (b, b_log) = FakeNode::echo().await;
    let c = Cluster::two_nodes(&a, &b).await;

    let (status, _, body) = send(drain_request(
        "POST",
        &c.url("/nodes/node-b/drain"),
        Some(API_KEY),
    ))
    .await;
    assert_eq!(status, StatusCode::NO_CONTENT, "{body:?}");
    assert!(body.is_empty());
    assert_eq!(c.count("DrainNode"), 1);
    assert_eq!(status_in_list(&c, "node-b").await, "draining");
    assert_eq!(status_in_list(&c, "node-a").await, "ready");

    // Every create now lands on node-a.
    for _ in 0..4 {
        let (status, _, _) = send(
            Request::post(c.url("/sandboxes"))
                .header("x-api-key", API_KEY)
                .header("content-type", "application/json")
                .body(Full::from(r#"{"templateID":"base"}"#))
                .unwrap(),
        )
        .await;
        assert_eq!(status, StatusCode::OK);
    }
    assert!(b_log.lock().is_empty(), "nothing was placed on node-b");

    let (status, _, _) = send(drain_request(
        "DELETE",
        &c.url("/nodes/node-b/drain"),
        Some(API_KEY),
    ))
    .await;
    assert_eq!(status, StatusCode::NO_CONTENT);
    assert_eq!(status_in_list(&c, "node-b").await, "ready");
}

#[tokio::test]
async fn drain_needs_the_api_key_and_names_unknown_nodes() {
    let (a, _) = FakeNode::echo().await;
    let (b, _) = FakeNode::echo().await;
    let c = Cluster::two_nodes(&a, &b).await;
    let (status, _, body) = send(drain_request("POST", &c.url("/nodes/node-b/drain"), None)).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    assert!(body.is_empty());
    assert_eq!(c.count("DrainNode"), 0, "refused before the scheduler");
    assert_eq!(status_in_list(&c, "node-b").await, "ready");

    let (status, _, body) = send(drain_request(
        "POST",
        &c.url("/nodes/node-z/drain"),
        Some(API_KEY),
    ))
    .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let v = json(&body);
    assert_eq!(v["code"], 404);
    assert!(v["message"].as_str().unwrap().contains("\"node-z\""), "{v}");
}

#[tokio::test]
async fn drain_with_every_node_drained_makes_creates_503() {
    let (a, _) = FakeNode::echo().await;
    let c = Cluster::ready(&[("node-a", &a.endpoint)], options()).await;
    let (status, _, _) = send(drain_request(
        "POST",
        &c.url("/nodes/node-a/drain"),
        Some(API_KEY),
    ))
    .await;
    assert_eq!(status, StatusCode::NO_CONTENT);
    let (status, _, body) = send(
        Request::post(c.url("/sandboxes"))
            .header("x-api-key", API_KEY)
            .body(Full::from(r#"{"templateID":"base"}"#))
            .unwrap(),
    )
    .await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(message(&body).starts_with("no nodes available"));
}
