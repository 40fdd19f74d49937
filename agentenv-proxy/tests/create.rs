//! Creates and forks: schedule hints, body forwarding, RecordAssignment.

mod common;

use agentenv_core::proto::scheduler_v1 as pb;
use agentenv_proxy::GatewayOptions;
use bytes::Bytes;
use common::*;
use http::{Request, StatusCode};
use http_body_util::Full;
use pb::schedule_request_hint::Kind;

fn post(url: &str, body: impl Into<Bytes>) -> Request<Full<Bytes>> {
    Request::post(url)
        .header("x-api-key", API_KEY)
        .header("content-type", "application/json")
        .header("host", "gw.example.test")
        .body(Full::new(body.into()))
        .unwrap()
}

#[tokio::test]
async fn create_schedules_with_a_metadata_hint_forwards_intact_and_records_the_header_id() {
    let created = r#"{"sandboxID":"from-body","templateID":"base"}"#;
    let (node, log) = FakeNode::canned(
        StatusCode::CREATED,
        &[("x-agentenv-sandbox-id", "sbx-new")],
        created,
    )
    .await;
    let c = Cluster::ready(&[("node-a", &node.endpoint)], options()).await;
    let body = r#"{"templateID":"base","metadata":{"team":"alpha"}}"#;
    let (status, headers, resp_body) = send(post(&c.url("/sandboxes"), body)).await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(resp_body, created, "the create body is relayed unchanged");
    assert_eq!(headers["x-agentenv-node-id"], "node-a");

    let hints = c.hints.hints.lock().clone();
    let Some(Some(pb::ScheduleRequestHint {
        kind: Some(Kind::NewSandbox(h)),
    })) = hints.last().cloned()
    else {
        panic!("{hints:?}")
    };
    assert_eq!(h.metadata["team"], "alpha");
    // A pool may serve it: the scheduler may prefer a node holding a pooled `base`.
    assert_eq!((h.template_id.as_str(), h.poolable), ("base", true));

    let seen = log.lock()[0].clone();
    assert_eq!(seen.method, "POST");
    assert_eq!(seen.uri, "/sandboxes");
    assert_eq!(seen.body, body);
    assert_eq!(seen.headers["content-type"], "application/json");
    assert_eq!(seen.headers["host"], "gw.example.test");
    assert_eq!(seen.headers["x-forwarded-proto"], "http");
    assert_eq!(seen.headers["x-forwarded-method"], "POST");
    assert_eq!(seen.headers["x-forwarded-uri"], "/sandboxes");

    // The header id was recorded, not the one in the body.
    assert_eq!(c.lookup("sbx-new").await.unwrap().node_id, "node-a");
    assert_eq!(
        c.lookup("from-body").await.unwrap_err().code(),
        tonic::Code::NotFound
    );
    assert_eq!(c.count("RecordAssignment"), 1);
}

#[tokio::test]
async fn create_without_an_id_header_records_the_id_from_the_body() {
    let created = r#"{"sandboxID":"sbx-body","templateID":"base"}"#;
    let (node, _) = FakeNode::canned(StatusCode::CREATED, &[], created).await;
    let c = Cluster::ready(&[("node-a", &node.endpoint)], options()).await;
    let (status, headers, body) = send(post(&c.url("/sandboxes"), "{}")).await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(body, created);
    assert_eq!(
        headers["content-length"],
        created.len().to_string().as_str()
    );
    assert_eq!(c.lookup("sbx-body").await.unwrap().node_id, "node-a");
    // A later control-plane request is routed by the recorded binding.
    let (status, _, _) = get(&c.url("/sandboxes/sbx-body")).await;
    assert_eq!(status, StatusCode::CREATED);
}

#[tokio::test]
async fn v2_create_is_scheduled_and_recorded() {
    let (node, log) = FakeNode::canned(
        StatusCode::CREATED,
        &[("x-agentenv-sandbox-id", "sbx-v2")],
        "{}",
    )
    .await;
    let c = Cluster::ready(&[("node-a", &node.endpoint)], options()).await;
    let (status, _, _) = send(post(&c.url("/v2/sandboxes"), r#"{"templateID":"base"}"#)).await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(log.lock()[0].uri, "/v2/sandboxes");
    assert_eq!(c.count("Schedule"), 1);
    assert_eq!(c.lookup("sbx-v2").await.unwrap().node_id, "node-a");
}

#[tokio::test]
async fn an_idempotent_create_names_its_template_but_is_not_poolable() {
    let (node, _) = FakeNode::canned(
        StatusCode::CREATED,
        &[("x-agentenv-sandbox-id", "sbx-idem")],
        "{}",
    )
    .await;
    let c = Cluster::ready(&[("node-a", &node.endpoint)], options()).await;
    let mut req = post(&c.url("/v2/sandboxes"), r#"{"templateID":"base"}"#);
    req.headers_mut()
        .insert("idempotency-key", "retry-me".parse().unwrap());
    let (status, _, _) = send(req).await;
    assert_eq!(status, StatusCode::CREATED);
    let hints = c.hints.hints.lock().clone();
    let Some(Some(pb::ScheduleRequestHint {
        kind: Some(Kind::NewSandbox(h)),
    })) = hints.last().cloned()
    else {
        panic!("{hints:?}")
    };
    // Its id comes from the key: no pooled sandbox can be it.
    assert_eq!((h.template_id.as_str(), h.poolable), ("base", false));
}

#[tokio::test]
async fn cold_create_sends_image_hints_and_forwards_the_body() {
    let (node, log) = FakeNode::canned(
        StatusCode::CREATED,
        &[("x-agentenv-sandbox-id", "sbx-cold")],
        "{}",
    )
    .await;
    let c = Cluster::ready(&[("node-a", &node.endpoint)], options()).await;
    let body = r#"{"image":"ubuntu:24.04","cpuCount":2,"memoryMB":512}"#;
    let (status, _, _) = send(post(&c.url("/sandboxes-cold/"), body)).await;
    assert_eq!(status, StatusCode::CREATED);
    let hints = c.hints.hints.lock().clone();
    let Some(Some(pb::ScheduleRequestHint {
        kind: Some(Kind::NewColdSandbox(h)),
    })) = hints.last().cloned()
    else {
        panic!("{hints:?}")
    };
    assert_eq!(h.images, ["ubuntu:24.04"]);
    assert_eq!(h.cpu_count, 2);
    assert_eq!(h.memory_mb, 512);
    assert_eq!(log.lock()[0].body, body);
    assert_eq!(c.lookup("sbx-cold").await.unwrap().node_id, "node-a");
}

#[tokio::test]
async fn a_create_body_over_64_kib_is_forwarded_whole_with_an_empty_hint() {
    let (node, log) = FakeNode::canned(
        StatusCode::CREATED,
        &[("x-agentenv-sandbox-id", "sbx-big")],
        "{}",
    )
    .await;
    let c = Cluster::ready(&[("node-a", &node.endpoint)], options()).await;
    let mut body = br#"{"metadata":{"team":"alpha"},"pad":""#.to_vec();
    body.extend(std::iter::repeat_n(b'x', 100 * 1024));
    body.extend_from_slice(b"\"}");
    let (status, _, _) = send(post(&c.url("/sandboxes"), body.clone())).await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(log.lock()[0].body, body);
    let hints = c.hints.hints.lock().clone();
    assert_eq!(
        hints.last().cloned().flatten(),
        Some(pb::ScheduleRequestHint {
            kind: Some(Kind::NewSandbox(pb::NewSandboxHint::default()))
        })
    );
}

#[tokio::test]
async fn an_oversized_create_response_without_an_id_header_still_reaches_the_client() {
    let mut created = br#"{"sandboxID":"sbx-huge","pad":""#.to_vec();
    created.extend(std::iter::repeat_n(b'y', 8192));
    created.extend_from_slice(b"\"}");
    let (node, _) = FakeNode::canned(StatusCode::CREATED, &[], created.clone()).await;
    let opts = GatewayOptions {
        forward_response_size: 1024,
        ..options()
    };
    let c = Cluster::ready(&[("node-a", &node.endpoint)], opts).await;
    let (status, _, body) = send(post(&c.url("/sandboxes"), "{}")).await;
    assert_eq!(
        status,
        StatusCode::CREATED,
        "a successful create is never turned into an error"
    );
    assert_eq!(body, created);
    assert_eq!(c.count("RecordAssignment"), 0);
}

#[tokio::test]
async fn path_routed_fork_records_every_child() {
    let forked = r#"{"sandboxes":[{"sandboxID":"child-1"},{"sandboxID":"child-2"}]}"#;
    let (node_a, _) = FakeNode::echo().await;
    let (node_b, log_b) = FakeNode::canned(StatusCode::OK, &[], forked).await;
    let c = Cluster::two_nodes(&node_a, &node_b).await;
    c.heartbeat("node-b", &["parent"]).await;
    let (status, _, body) = send(post(&c.url("/sandboxes/parent/fork"), r#"{"count":2}"#)).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body, forked);
    assert_eq!(log_b.lock()[0].uri, "/sandboxes/parent/fork");
    for child in ["child-1", "child-2"] {
        assert_eq!(c.lookup(child).await.unwrap().node_id, "node-b", "{child}");
    }
}

#[tokio::test]
async fn failed_creates_record_nothing() {
    let (node, _) = FakeNode::canned(
        StatusCode::BAD_REQUEST,
        &[("x-agentenv-sandbox-id", "sbx-x")],
        r#"{"code":400,"message":"bad template"}"#,
    )
    .await;
    let c = Cluster::ready(&[("node-a", &node.endpoint)], options()).await;
    let (status, _, body) = send(post(&c.url("/sandboxes"), "{}")).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(message(&body), "bad template");
    assert_eq!(c.count("RecordAssignment"), 0);
}

#[tokio::test]
async fn non_create_requests_without_a_sandbox_are_scheduled_without_a_hint() {
    let (node, log) = FakeNode::echo().await;
    let c = Cluster::ready(&[("node-a", &node.endpoint)], options()).await;
    let (status, _, _) = send(post(&c.url("/templates"), r#"{"alias":"x"}"#)).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(log.lock()[0].uri, "/templates");
    assert_eq!(c.hints.hints.lock().last().cloned(), Some(None));
    assert_eq!(c.count("RecordAssignment"), 0);
}
