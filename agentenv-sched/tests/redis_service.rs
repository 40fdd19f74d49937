//! The scheduler service on a Redis binding store (a real `redis-server`):
//! what callers see while Redis is down, recovery without a restart, and a
//! query-only replica reading what the primary wrote.

mod support;

use agentenv_core::config::{NodeConfig, SchedulerConfig};
use agentenv_core::proto::scheduler_v1::scheduler_server::Scheduler as _;
use agentenv_core::proto::scheduler_v1::*;
use agentenv_sched::{BuildError, Scheduler, SchedulerService};
use agentenv_testkit::eventually;
use agentenv_testkit::redis::RedisServer;
use support::{beat, node};
use tokio::time::Duration;
use tonic::{Code, Request};

fn config(redis: &RedisServer) -> SchedulerConfig {
    SchedulerConfig {
        nodes: vec![NodeConfig {
            id: "node-a".into(),
            endpoint: node("node-a").endpoint,
        }],
        redis_addr: redis.addr(),
        ..SchedulerConfig::default()
    }
}

async fn service(redis: &RedisServer, query_only: bool) -> SchedulerService {
    Scheduler::builder(config(redis))
        .query_only(query_only)
        .build_async()
        .await
        .unwrap()
        .service()
}

async fn lookup(svc: &SchedulerService, id: &str) -> Result<Node, tonic::Status> {
    svc.lookup_node(Request::new(LookupNodeRequest {
        sandbox_id: id.into(),
    }))
    .await
    .map(|r| r.into_inner().node.unwrap())
}

async fn record(svc: &SchedulerService, id: &str) -> Result<(), tonic::Status> {
    svc.record_assignment(Request::new(RecordAssignmentRequest {
        sandbox_id: id.into(),
        node: Some(node("node-a")),
    }))
    .await
    .map(drop)
}

#[tokio::test]
async fn record_then_lookup_and_heartbeats_go_through_redis() {
    let redis = RedisServer::start();
    let svc = service(&redis, false).await;
    record(&svc, "sbx-1").await.unwrap();
    assert_eq!(lookup(&svc, " sbx-1 ").await.unwrap(), node("node-a"));
    assert!(
        redis
            .command(&["GET", "agentenv:scheduler:bindings:sandbox:sbx-1"])
            .unwrap()
            .contains("node-a")
    );
    svc.heartbeat(Request::new(beat("node-a", &["sbx-2"])))
        .await
        .unwrap();
    assert_eq!(lookup(&svc, "sbx-2").await.unwrap(), node("node-a"));
    let missing = lookup(&svc, "nope").await.unwrap_err();
    assert_eq!(missing.code(), Code::NotFound);
    assert_eq!(missing.message(), "sandbox assignment not found");
}

#[tokio::test]
async fn a_restarted_scheduler_finds_the_bindings_in_redis() {
    let redis = RedisServer::start();
    let first = service(&redis, false).await;
    record(&first, "sbx").await.unwrap();
    drop(first);
    let second = service(&redis, false).await;
    assert_eq!(lookup(&second, "sbx").await.unwrap(), node("node-a"));
}

#[tokio::test]
async fn store_down_gives_unavailable_binding_store_unavailable() {
    let mut redis = RedisServer::start();
    let svc = service(&redis, false).await;
    svc.heartbeat(Request::new(beat("node-a", &[])))
        .await
        .unwrap();
    redis.kill();
    // Placement does not need the store.
    svc.schedule(Request::new(ScheduleRequest::default()))
        .await
        .unwrap();
    for status in [
        lookup(&svc, "sbx").await.unwrap_err(),
        record(&svc, "sbx").await.unwrap_err(),
        svc.heartbeat(Request::new(beat("node-a", &["sbx"])))
            .await
            .unwrap_err(),
        svc.unregister_node(Request::new(UnregisterNodeRequest {
            node_id: "node-a".into(),
            service_instance_id: "node-a-instance".into(),
        }))
        .await
        .unwrap_err(),
    ] {
        assert_eq!(status.code(), Code::Unavailable, "{status:?}");
        assert_eq!(status.message(), "binding store unavailable");
    }
}

#[tokio::test]
async fn the_scheduler_recovers_when_redis_returns_on_the_same_port() {
    let mut redis = RedisServer::start();
    let svc = service(&redis, false).await;
    record(&svc, "before").await.unwrap();
    redis.kill();
    assert_eq!(
        lookup(&svc, "unknown").await.unwrap_err().code(),
        Code::Unavailable
    );
    // The primary routes what it wrote from its copy while Redis is down.
    assert_eq!(lookup(&svc, "before").await.unwrap(), node("node-a"));
    redis.restart();
    eventually(
        "RecordAssignment to work again",
        Duration::from_secs(20),
        || {
            let svc = svc.clone();
            async move { record(&svc, "after").await.map_err(|s| s.to_string()) }
        },
    )
    .await;
    assert_eq!(lookup(&svc, "after").await.unwrap(), node("node-a"));
    svc.heartbeat(Request::new(beat("node-a", &["after", "beat"])))
        .await
        .unwrap();
    assert_eq!(lookup(&svc, "beat").await.unwrap(), node("node-a"));
}

#[tokio::test]
async fn a_query_only_replica_answers_lookups_for_the_primarys_bindings() {
    let redis = RedisServer::start();
    let primary = service(&redis, false).await;
    let replica = service(&redis, true).await;
    record(&primary, "sbx").await.unwrap();
    assert_eq!(lookup(&replica, "sbx").await.unwrap(), node("node-a"));
    let missing = lookup(&replica, "nope").await.unwrap_err();
    assert_eq!(missing.code(), Code::NotFound);
    let blank = lookup(&replica, "  ").await.unwrap_err();
    assert_eq!(blank.code(), Code::InvalidArgument);
    assert_eq!(blank.message(), "sandbox_id is required");
}

#[tokio::test]
async fn a_query_only_replica_answers_every_other_call_unimplemented() {
    let redis = RedisServer::start();
    let replica = service(&redis, true).await;
    let codes = [
        replica
            .schedule(Request::new(ScheduleRequest::default()))
            .await
            .map(drop),
        record(&replica, "sbx").await,
        replica
            .heartbeat(Request::new(beat("node-a", &["sbx"])))
            .await
            .map(drop),
        replica
            .list_nodes(Request::new(ListNodesRequest {}))
            .await
            .map(drop),
        replica
            .list_observed_nodes(Request::new(ListObservedNodesRequest::default()))
            .await
            .map(drop),
        replica
            .get_node(Request::new(GetNodeRequest {
                node_id: "node-a".into(),
                ..Default::default()
            }))
            .await
            .map(drop),
        replica
            .unregister_node(Request::new(UnregisterNodeRequest {
                node_id: "node-a".into(),
                service_instance_id: "i".into(),
            }))
            .await
            .map(drop),
        replica
            .report_sandbox_event(Request::new(ReportSandboxEventRequest::default()))
            .await
            .map(drop),
        replica
            .list_p2p_peers(Request::new(ListP2pPeersRequest::default()))
            .await
            .map(drop),
        replica
            .record_p2p_artifact(Request::new(RecordP2pArtifactRequest::default()))
            .await
            .map(drop),
        replica
            .forget_p2p_artifact(Request::new(ForgetP2pArtifactRequest::default()))
            .await
            .map(drop),
        replica
            .lookup_p2p_artifact(Request::new(LookupP2pArtifactRequest::default()))
            .await
            .map(drop),
    ];
    for (i, result) in codes.into_iter().enumerate() {
        let status = result.unwrap_err();
        assert_eq!(status.code(), Code::Unimplemented, "call {i}: {status:?}");
    }
    assert_eq!(
        redis.command(&["DBSIZE"]).unwrap(),
        "0",
        "a replica writes nothing"
    );
}

#[tokio::test]
async fn a_scheduler_without_its_redis_does_not_start_and_says_where_it_looked() {
    let port = agentenv_testkit::free_port();
    let config = SchedulerConfig {
        redis_addr: format!("127.0.0.1:{port}"),
        ..SchedulerConfig::default()
    };
    let err = Scheduler::builder(config.clone())
        .build_async()
        .await
        .err()
        .unwrap();
    assert!(matches!(err, BuildError::Redis(_)), "{err}");
    let msg = err.to_string();
    assert!(msg.starts_with("scheduler.redis_addr: "), "{msg}");
    assert!(msg.contains(&format!("127.0.0.1:{port}")), "{msg}");
    let err = Scheduler::builder(config).build().err().unwrap();
    assert!(matches!(err, BuildError::RedisNeedsAsync), "{err}");
}
