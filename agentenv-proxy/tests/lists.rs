//! Cluster list fan-out, node list and detail, and the query-only scheduler.

mod common;

use std::sync::Arc;

use agentenv_core::config::{NodeConfig, SchedulerConfig};
use agentenv_core::proto::scheduler_v1 as pb;
use agentenv_core::proto::scheduler_v1::scheduler_server::Scheduler as _;
use agentenv_proxy::{Gateway, GrpcSchedulerClient};
use agentenv_sched::{MemoryBindingStore, Scheduler};
use common::*;
use http::{Request, StatusCode};
use http_body_util::Full;

fn sandbox(id: &str, started: &str) -> serde_json::Value {
    serde_json::json!({
        "templateID": "base", "sandboxID": id, "clientID": "c", "startedAt": started,
        "endAt": "2026-02-01T00:00:00Z", "cpuCount": 1, "memoryMB": 512, "diskSizeMB": 1024,
        "state": "running", "envdVersion": "0.2.0", "unknownField": true
    })
}

async fn list_node(items: serde_json::Value) -> (FakeNode, Log) {
    FakeNode::canned(
        StatusCode::OK,
        &[("content-type", "application/json")],
        items.to_string(),
    )
    .await
}

fn ids(body: &[u8]) -> Vec<String> {
    json(body)
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["sandboxID"].as_str().unwrap().to_string())
        .collect()
}

#[tokio::test]
async fn sandbox_list_fans_out_merges_newest_first_and_forwards_query_and_host() {
    let (a, log_a) = list_node(serde_json::json!([
        sandbox("a-old", "2026-01-01T00:00:01Z"),
        sandbox("dup", "2026-01-01T00:00:05Z"),
    ]))
    .await;
    let (b, log_b) = list_node(serde_json::json!([
        sandbox("b-new", "2026-01-01T00:00:03Z"),
        sandbox("dup", "2026-01-01T00:00:02Z"),
        sandbox("a-tie", "2026-01-01T00:00:03Z"),
    ]))
    .await;
    let c = Cluster::ready(
        &[("node-a", &a.endpoint), ("node-b", &b.endpoint)],
        options(),
    )
    .await;
    let (status, _, body) = send(
        Request::get(c.url("/sandboxes?metadata=team%3Dalpha"))
            .header("host", "api.example.test")
            .header("x-api-key", API_KEY)
            .empty(),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(ids(&body), ["dup", "a-tie", "b-new", "a-old"]);
    let v = json(&body);
    assert_eq!(
        v[0]["startedAt"], "2026-01-01T00:00:05Z",
        "the newer duplicate wins"
    );
    assert!(v[0].get("unknownField").is_none());
    assert!(v[0].get("alias").is_none() && v[0].get("metadata").is_none());
    for log in [&log_a, &log_b] {
        let seen = log.lock()[0].clone();
        assert_eq!(seen.uri, "/sandboxes?metadata=team%3Dalpha");
        assert_eq!(seen.headers["host"], "api.example.test");
        assert_eq!(seen.headers["x-forwarded-host"], "api.example.test");
        assert_eq!(
            seen.headers["x-forwarded-uri"],
            "/sandboxes?metadata=team%3Dalpha"
        );
        assert_eq!(seen.headers["x-api-key"], API_KEY);
    }
}

#[tokio::test]
async fn v2_list_pages_with_next_token_and_hides_paging_from_nodes() {
    let (a, log_a) = list_node(serde_json::json!([
        sandbox(
            "00000000-0000-0000-0000-00000000000a",
            "2026-01-01T00:00:03Z"
        ),
        sandbox(
            "00000000-0000-0000-0000-00000000000c",
            "2026-01-01T00:00:01Z"
        ),
    ]))
    .await;
    let (b, _) = list_node(serde_json::json!([sandbox(
        "00000000-0000-0000-0000-00000000000b",
        "2026-01-01T00:00:02Z"
    )]))
    .await;
    let c = Cluster::ready(
        &[("node-a", &a.endpoint), ("node-b", &b.endpoint)],
        options(),
    )
    .await;
    let (status, headers, body) =
        get(&c.url("/v2/sandboxes?state=running&metadata=team%3Dalpha&limit=2")).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        ids(&body),
        [
            "00000000-0000-0000-0000-00000000000a",
            "00000000-0000-0000-0000-00000000000b"
        ]
    );
    let token = headers["x-next-token"].to_str().unwrap().to_string();
    assert_eq!(
        log_a.lock()[0].uri,
        "/v2/sandboxes?metadata=team%3Dalpha&state=running"
    );

    let (status, headers, body) = get(&c.url(&format!(
        "/v2/sandboxes?state=running&limit=2&nextToken={token}"
    )))
    .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(ids(&body), ["00000000-0000-0000-0000-00000000000c"]);
    assert!(headers.get("x-next-token").is_none());
    assert_eq!(log_a.lock()[1].uri, "/v2/sandboxes?state=running");

    let (status, _, body) = get(&c.url("/v2/sandboxes?limit=abc")).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(message(&body).starts_with("invalid limit"));
    let (status, _, body) = get(&c.url("/v2/sandboxes?nextToken=%21%21")).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(message(&body).starts_with("invalid next token"));
}

#[tokio::test]
async fn a_failing_node_fails_the_whole_list() {
    let (a, _) = list_node(serde_json::json!([])).await;
    let (bad, _) = FakeNode::canned(StatusCode::INTERNAL_SERVER_ERROR, &[], "boom").await;
    let c = Cluster::ready(
        &[("node-a", &a.endpoint), ("node-b", &bad.endpoint)],
        options(),
    )
    .await;
    let (status, _, body) = get(&c.url("/sandboxes")).await;
    assert_eq!(status, StatusCode::BAD_GATEWAY);
    assert_eq!(message(&body), "cluster list unavailable");

    let (denied, _) = FakeNode::canned(StatusCode::UNAUTHORIZED, &[], "").await;
    let c = Cluster::ready(
        &[("node-a", &a.endpoint), ("node-b", &denied.endpoint)],
        options(),
    )
    .await;
    let (status, _, body) = get(&c.url("/sandboxes")).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    assert!(body.is_empty());

    let (garbage, _) = FakeNode::canned(StatusCode::OK, &[], "{not a list").await;
    let c = Cluster::ready(&[("node-a", &garbage.endpoint)], options()).await;
    let (status, _, _) = get(&c.url("/sandboxes")).await;
    assert_eq!(status, StatusCode::BAD_GATEWAY);
}

#[tokio::test]
async fn an_empty_cluster_list_is_502() {
    let c = Cluster::ready(&[], options()).await;
    let (status, _, body) = get(&c.url("/sandboxes")).await;
    assert_eq!(status, StatusCode::BAD_GATEWAY);
    assert_eq!(message(&body), "cluster list unavailable");
}

#[tokio::test]
async fn node_list_filters_by_cluster_and_reports_status() {
    let (a, _) = FakeNode::echo().await;
    let (b, _) = FakeNode::echo().await;
    let c = Cluster::start(
        &[("node-a", &a.endpoint), ("node-b", &b.endpoint)],
        options(),
    )
    .await;
    c.heartbeat_in("node-a", "cluster-1", &["s1", "s2"]).await;
    c.heartbeat_in("node-b", "cluster-2", &[]).await;
    let (status, headers, body) = get(&c.url("/nodes?clusterID=cluster-1")).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(headers["content-type"], "application/json");
    assert!(body.ends_with(b"\n"));
    let v = json(&body);
    let list = v.as_array().unwrap();
    assert_eq!(list.len(), 1);
    assert_eq!(list[0]["id"], "node-a");
    assert_eq!(list[0]["status"], "ready");
    assert_eq!(list[0]["clusterID"], "cluster-1");
    assert_eq!(c.count("ListObservedNodes"), 1);
    let (_, _, body) = get(&c.url("/nodes/")).await;
    assert_eq!(json(&body).as_array().unwrap().len(), 2);
}

#[tokio::test]
async fn node_detail_is_resolved_by_the_scheduler_and_proxied_to_the_node() {
    let (a, log) = FakeNode::echo().await;
    let c = Cluster::start(&[("node-a", &a.endpoint)], options()).await;
    c.heartbeat_in("node-a", "cluster-1", &[]).await;
    let (status, _, body) = get(&c.url("/nodes/node-a?clusterID=cluster-1")).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(json(&body)["uri"], "/nodes/node-a?clusterID=cluster-1");
    assert_eq!(log.lock().len(), 1);
    assert_eq!(c.count("GetNode"), 1);
    let (status, _, body) = get(&c.url("/nodes/node-zz")).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(message(&body), "observed node not found");
}

#[tokio::test]
async fn lookups_use_the_query_only_scheduler_and_records_the_primary_over_grpc() {
    let (node, _) = FakeNode::canned(
        StatusCode::CREATED,
        &[("x-agentenv-sandbox-id", "sbx-new")],
        "{}",
    )
    .await;
    let config = SchedulerConfig {
        nodes: vec![NodeConfig {
            id: "node-a".into(),
            endpoint: node.endpoint.clone(),
        }],
        ..SchedulerConfig::default()
    };
    // The primary and the replica keep separate bindings, so an answer tells
    // which of them was asked.
    let primary = Scheduler::builder(config.clone()).build().unwrap();
    let replica_store = Arc::new(MemoryBindingStore::new(config.binding_ttl));
    let replica = Scheduler::builder(config.clone())
        .query_only(true)
        .binding_store(replica_store.clone())
        .build()
        .unwrap();
    let primary_svc = primary.service();
    primary_svc
        .heartbeat(tonic::Request::new(pb::HeartbeatRequest {
            node_id: "node-a".into(),
            service_instance_id: "i".into(),
            snapshot: Some(pb::NodeSnapshot {
                status: pb::NodeStatus::Ready as i32,
                ..Default::default()
            }),
            ..Default::default()
        }))
        .await
        .unwrap();
    use agentenv_sched::BindingStore;
    replica_store
        .record(
            "sbx-replica",
            &pb::Node {
                node_id: "node-a".into(),
                endpoint: node.endpoint.clone(),
            },
            tokio::time::Instant::now(),
        )
        .await
        .unwrap();

    let serve = |s: Scheduler| async move {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move { s.serve(l, std::future::pending()).await.unwrap() });
        addr
    };
    let primary_addr = serve(primary).await;
    let replica_addr = serve(replica).await;

    let client =
        GrpcSchedulerClient::connect_lazy(&primary_addr.to_string(), &replica_addr.to_string())
            .unwrap();
    let gateway = Gateway::new(client, options()).unwrap();
    let (addr, _stop, _task) = serve_gateway(gateway).await;

    let (status, _, _) = get(&format!("http://{addr}/sandboxes/sbx-replica")).await;
    assert_eq!(
        status,
        StatusCode::CREATED,
        "found only in the replica's bindings"
    );

    let (status, _, _) = send(
        Request::post(format!("http://{addr}/sandboxes"))
            .header("x-api-key", API_KEY)
            .body(Full::from("{}"))
            .unwrap(),
    )
    .await;
    assert_eq!(status, StatusCode::CREATED);
    let recorded = primary_svc
        .lookup_node(tonic::Request::new(pb::LookupNodeRequest {
            sandbox_id: "sbx-new".into(),
        }))
        .await
        .unwrap();
    assert_eq!(
        recorded.into_inner().node.unwrap().node_id,
        "node-a",
        "recorded on the primary"
    );
    // ... and therefore unknown to the replica the gateway looks up with.
    let (status, _, body) = get(&format!("http://{addr}/sandboxes/sbx-new")).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(message(&body), "sandbox assignment not found");
}

#[tokio::test]
async fn a_scheduler_that_is_down_gives_503() {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dead = l.local_addr().unwrap();
    drop(l);
    let client = GrpcSchedulerClient::connect_lazy(&dead.to_string(), "").unwrap();
    let gateway = Gateway::new(client, options()).unwrap();
    let (addr, _stop, _task) = serve_gateway(gateway).await;
    let (status, _, body) = get(&format!("http://{addr}/sandboxes/sbx-1")).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(
        message(&body).starts_with("scheduler unreachable: "),
        "{}",
        message(&body)
    );
    let (status, _, _) = send(Request::get(format!("http://{addr}/health")).empty()).await;
    assert_eq!(
        status,
        StatusCode::NO_CONTENT,
        "health does not depend on the scheduler"
    );
}
