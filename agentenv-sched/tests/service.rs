//! The scheduler.v1 service, called in-process (the same trait the gRPC
//! server dispatches to). Time is paused so TTLs are exact.

mod support;

use std::sync::Arc;

use agentenv_core::config::NodeResourceLimit;
use agentenv_core::proto::scheduler_v1::scheduler_server::Scheduler as _;
use agentenv_core::proto::scheduler_v1::*;
use agentenv_sched::{
    BindingStore, NodeRegistry, Scheduler, SchedulerService, StaticRegistry, StoreError,
};
use async_trait::async_trait;
use support::{beat, config, node};
use tokio::time::{Duration, Instant, advance};
use tonic::{Code, Request};

fn service(ids: &[&str]) -> SchedulerService {
    Scheduler::builder(config(ids)).build().unwrap().service()
}

async fn heartbeat(svc: &SchedulerService, req: HeartbeatRequest) -> HeartbeatResponse {
    svc.heartbeat(Request::new(req)).await.unwrap().into_inner()
}

async fn schedule(svc: &SchedulerService) -> Result<String, Code> {
    svc.schedule(Request::new(ScheduleRequest::default()))
        .await
        .map(|r| r.into_inner().node.unwrap().node_id)
        .map_err(|s| s.code())
}

async fn lookup(svc: &SchedulerService, id: &str) -> Result<Node, tonic::Status> {
    svc.lookup_node(Request::new(LookupNodeRequest {
        sandbox_id: id.into(),
    }))
    .await
    .map(|r| r.into_inner().node.unwrap())
}

async fn record(svc: &SchedulerService, id: &str, n: Node) -> Result<(), tonic::Status> {
    svc.record_assignment(Request::new(RecordAssignmentRequest {
        sandbox_id: id.into(),
        node: Some(n),
    }))
    .await
    .map(|_| ())
}

#[tokio::test(start_paused = true)]
async fn record_assignment_then_lookup_returns_the_node() {
    let svc = service(&["node-a", "node-b"]);
    record(&svc, "sbx-1", node("node-b")).await.unwrap();
    assert_eq!(lookup(&svc, "sbx-1").await.unwrap(), node("node-b"));
    assert_eq!(
        lookup(&svc, " sbx-1 ").await.unwrap(),
        node("node-b"),
        "id is trimmed"
    );
}

#[tokio::test(start_paused = true)]
async fn lookup_validates_and_reports_missing_bindings() {
    let svc = service(&["node-a"]);
    let e = lookup(&svc, "  ").await.unwrap_err();
    assert_eq!(
        (e.code(), e.message()),
        (Code::InvalidArgument, "sandbox_id is required")
    );
    let e = lookup(&svc, "nope").await.unwrap_err();
    assert_eq!(
        (e.code(), e.message()),
        (Code::NotFound, "sandbox assignment not found")
    );
}

#[tokio::test(start_paused = true)]
async fn record_assignment_rejects_bad_input_and_unknown_nodes() {
    let svc = service(&["node-a"]);
    let e = record(&svc, " ", node("node-a")).await.unwrap_err();
    assert_eq!(
        (e.code(), e.message()),
        (Code::InvalidArgument, "sandbox_id is required")
    );
    let e = svc
        .record_assignment(Request::new(RecordAssignmentRequest {
            sandbox_id: "s".into(),
            node: None,
        }))
        .await
        .unwrap_err();
    assert_eq!(e.message(), "node_id and endpoint are required");
    let e = record(&svc, "s", node("node-z")).await.unwrap_err();
    assert_eq!(
        (e.code(), e.message()),
        (Code::InvalidArgument, "node is not in scheduler node list")
    );
    let wrong_endpoint = Node {
        node_id: "node-a".into(),
        endpoint: "http://elsewhere:8000".into(),
    };
    let e = record(&svc, "s", wrong_endpoint).await.unwrap_err();
    assert_eq!(
        e.message(),
        "node is not in scheduler node list",
        "endpoint must match too"
    );
}

#[tokio::test(start_paused = true)]
async fn bindings_expire_after_binding_ttl_without_heartbeats() {
    let svc = service(&["node-a"]);
    record(&svc, "sbx", node("node-a")).await.unwrap();
    advance(Duration::from_secs(29)).await;
    assert!(lookup(&svc, "sbx").await.is_ok());
    advance(Duration::from_secs(1)).await;
    assert_eq!(
        lookup(&svc, "sbx").await.unwrap_err().code(),
        Code::NotFound
    );
}

#[tokio::test(start_paused = true)]
async fn list_nodes_includes_lingering_and_follows_replacement() {
    let registry = Arc::new(StaticRegistry::new(
        vec![node("b"), node("a")],
        Duration::from_secs(30),
    ));
    let svc = Scheduler::builder(config(&["unused"]))
        .registry(registry.clone())
        .build()
        .unwrap()
        .service();
    let ids = |r: ListNodesResponse| r.nodes.into_iter().map(|n| n.node_id).collect::<Vec<_>>();
    let r = svc
        .list_nodes(Request::new(ListNodesRequest {}))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(ids(r), ["a", "b"]);
    registry.set(vec![node("c")], vec![node("d")]);
    let r = svc
        .list_nodes(Request::new(ListNodesRequest {}))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(ids(r), ["c", "d"]);
}

#[tokio::test(start_paused = true)]
async fn query_only_serves_lookup_and_nothing_else() {
    let sched = Scheduler::builder(config(&["node-a"]))
        .query_only(true)
        .build()
        .unwrap();
    let svc = sched.service();
    let e = schedule(&svc).await.unwrap_err();
    assert_eq!(e, Code::Unimplemented);
    let e = svc
        .heartbeat(Request::new(beat("node-a", &[])))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Unimplemented);
    assert_eq!(
        lookup(&svc, "sbx").await.unwrap_err().code(),
        Code::NotFound
    );
}

/// A binding store whose backend is down.
struct DownStore;

#[async_trait]
impl BindingStore for DownStore {
    async fn get(&self, _: &str, _: Instant) -> Result<Option<Node>, StoreError> {
        Err(StoreError("connection refused".into()))
    }
    async fn record(&self, _: &str, _: &Node, _: Instant) -> Result<(), StoreError> {
        Err(StoreError("connection refused".into()))
    }
    async fn reconcile_node(&self, _: &Node, _: &[String], _: Instant) -> Result<(), StoreError> {
        Err(StoreError("connection refused".into()))
    }
    async fn forget_node(&self, _: &str) -> Result<(), StoreError> {
        Err(StoreError("connection refused".into()))
    }
}

#[tokio::test(start_paused = true)]
async fn store_failures_are_unavailable() {
    let svc = Scheduler::builder(config(&["node-a"]))
        .binding_store(Arc::new(DownStore))
        .build()
        .unwrap()
        .service();
    let e = lookup(&svc, "sbx").await.unwrap_err();
    assert_eq!(
        (e.code(), e.message()),
        (Code::Unavailable, "binding store unavailable")
    );
    let e = record(&svc, "sbx", node("node-a")).await.unwrap_err();
    assert_eq!(
        (e.code(), e.message()),
        (Code::Unavailable, "binding store unavailable")
    );
    let e = svc
        .heartbeat(Request::new(beat("node-a", &["s"])))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Unavailable);
    // The registry update happened before the store failed.
    let got = svc
        .get_node(Request::new(GetNodeRequest {
            node_id: "node-a".into(),
            cluster_id: String::new(),
        }))
        .await
        .unwrap();
    assert_eq!(got.into_inner().node.unwrap().node_id, "node-a");
}

#[tokio::test(start_paused = true)]
async fn schedule_with_no_healthy_node_is_unavailable() {
    let registry = Arc::new(StaticRegistry::new(vec![], Duration::from_secs(30)));
    let svc = Scheduler::builder(config(&["x"]))
        .registry(registry)
        .build()
        .unwrap()
        .service();
    let e = svc
        .schedule(Request::new(ScheduleRequest::default()))
        .await
        .unwrap_err();
    assert_eq!(
        (e.code(), e.message()),
        (Code::Unavailable, "no nodes available")
    );
}

#[tokio::test(start_paused = true)]
async fn schedule_picks_only_nodes_with_a_fresh_heartbeat() {
    let svc = service(&["node-a", "node-b"]);
    assert_eq!(
        schedule(&svc).await,
        Err(Code::Unavailable),
        "no heartbeat yet"
    );
    heartbeat(&svc, beat("node-a", &[])).await;
    for _ in 0..4 {
        assert_eq!(schedule(&svc).await.unwrap(), "node-a");
    }
    heartbeat(&svc, beat("node-b", &[])).await;
    let mut picks: Vec<_> = Vec::new();
    for _ in 0..4 {
        picks.push(schedule(&svc).await.unwrap());
    }
    picks.sort();
    assert_eq!(
        picks,
        ["node-a", "node-a", "node-b", "node-b"],
        "round robin over both"
    );
    advance(Duration::from_secs(20)).await;
    heartbeat(&svc, beat("node-b", &[])).await;
    advance(Duration::from_secs(11)).await; // node-a's heartbeat is now 31 s old
    for _ in 0..4 {
        assert_eq!(schedule(&svc).await.unwrap(), "node-b");
    }
    advance(Duration::from_secs(20)).await;
    assert_eq!(
        schedule(&svc).await,
        Err(Code::Unavailable),
        "every heartbeat is stale"
    );
}

#[tokio::test(start_paused = true)]
async fn schedule_never_picks_a_lingering_node() {
    let registry = Arc::new(StaticRegistry::new(vec![], Duration::from_secs(30)));
    registry.set(vec![node("a")], vec![node("b")]);
    let svc = Scheduler::builder(config(&["x"]))
        .registry(registry)
        .build()
        .unwrap()
        .service();
    heartbeat(&svc, beat("a", &[])).await;
    heartbeat(&svc, beat("b", &[])).await;
    for _ in 0..6 {
        assert_eq!(schedule(&svc).await.unwrap(), "a");
    }
}

#[tokio::test(start_paused = true)]
async fn schedule_respects_node_resource_limits() {
    let mut cfg = config(&["node-a", "node-b"]);
    cfg.node_resource_limit = Some(NodeResourceLimit {
        max_sandbox_count: Some(1),
        ..Default::default()
    });
    let svc = Scheduler::builder(cfg).build().unwrap().service();
    heartbeat(&svc, beat("node-a", &["s1", "s2"])).await;
    heartbeat(&svc, beat("node-b", &["s3"])).await;
    for _ in 0..4 {
        assert_eq!(schedule(&svc).await.unwrap(), "node-b");
    }
    heartbeat(&svc, beat("node-b", &["s3", "s4"])).await;
    assert_eq!(
        schedule(&svc).await,
        Err(Code::Unavailable),
        "the filter removed everything"
    );
}

#[tokio::test(start_paused = true)]
async fn least_loaded_follows_heartbeat_load() {
    let mut cfg = config(&["node-a", "node-b"]);
    cfg.strategy = "least_loaded".into();
    let svc = Scheduler::builder(cfg).build().unwrap().service();
    heartbeat(&svc, beat("node-a", &["s1", "s2"])).await;
    heartbeat(&svc, beat("node-b", &["s3"])).await;
    assert_eq!(schedule(&svc).await.unwrap(), "node-b");
    heartbeat(&svc, beat("node-b", &["s3", "s4", "s5"])).await;
    assert_eq!(schedule(&svc).await.unwrap(), "node-a");
}

#[tokio::test(start_paused = true)]
async fn get_node_after_heartbeat_is_ready_with_its_sandbox_count() {
    let svc = service(&["node-a"]);
    heartbeat(&svc, beat("node-a", &["s1", "s2"])).await;
    let n = svc
        .get_node(Request::new(GetNodeRequest {
            node_id: "node-a".into(),
            cluster_id: "cluster-1".into(),
        }))
        .await
        .unwrap()
        .into_inner()
        .node
        .unwrap();
    let snap = n.snapshot.unwrap();
    assert_eq!(snap.status, NodeStatus::Ready as i32);
    assert_eq!(snap.sandbox_count, 2);
    assert_eq!(n.endpoint, "http://node-a:8000");
    assert_eq!(n.service_instance_id, "node-a-instance");
    assert!(n.last_seen_unix_ms > 0);
    let e = svc
        .get_node(Request::new(GetNodeRequest {
            node_id: "node-a".into(),
            cluster_id: "other".into(),
        }))
        .await
        .unwrap_err();
    assert_eq!(
        (e.code(), e.message()),
        (Code::NotFound, "observed node not found")
    );
    let e = svc
        .get_node(Request::new(GetNodeRequest {
            node_id: " ".into(),
            cluster_id: String::new(),
        }))
        .await
        .unwrap_err();
    assert_eq!(
        (e.code(), e.message()),
        (Code::InvalidArgument, "node_id is required")
    );
}

#[tokio::test(start_paused = true)]
async fn heartbeat_roster_creates_and_removes_bindings() {
    let svc = service(&["node-a"]);
    heartbeat(&svc, beat("node-a", &["s1", "s2"])).await;
    assert_eq!(lookup(&svc, "s1").await.unwrap(), node("node-a"));
    assert_eq!(lookup(&svc, "s2").await.unwrap(), node("node-a"));
    heartbeat(&svc, beat("node-a", &["s2"])).await;
    assert_eq!(lookup(&svc, "s1").await.unwrap_err().code(), Code::NotFound);
    // Each heartbeat refreshes the TTL.
    for _ in 0..5 {
        advance(Duration::from_secs(20)).await;
        heartbeat(&svc, beat("node-a", &["s2"])).await;
    }
    assert!(lookup(&svc, "s2").await.is_ok());
}

#[tokio::test(start_paused = true)]
async fn heartbeat_rejects_unknown_nodes_and_missing_ids() {
    let svc = service(&["node-a"]);
    let e = svc
        .heartbeat(Request::new(beat("node-z", &[])))
        .await
        .unwrap_err();
    assert_eq!(
        (e.code(), e.message()),
        (Code::InvalidArgument, "node is not in scheduler node list")
    );
    let mut no_id = beat("node-a", &[]);
    no_id.node_id = "  ".into();
    let e = svc.heartbeat(Request::new(no_id)).await.unwrap_err();
    assert_eq!(e.message(), "node_id and service_instance_id are required");
    let mut no_instance = beat("node-a", &[]);
    no_instance.service_instance_id = String::new();
    let e = svc.heartbeat(Request::new(no_instance)).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    // Heartbeats never register nodes.
    let r = svc
        .list_nodes(Request::new(ListNodesRequest {}))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.nodes.len(), 1);
}

#[tokio::test(start_paused = true)]
async fn unregister_is_idempotent_drops_bindings_and_checks_the_instance() {
    let svc = service(&["node-a"]);
    let unregister = |instance: &str| {
        svc.unregister_node(Request::new(UnregisterNodeRequest {
            node_id: "node-a".into(),
            service_instance_id: instance.into(),
        }))
    };
    unregister("anything")
        .await
        .expect("no record yet: success");
    heartbeat(&svc, beat("node-a", &["s1"])).await;
    let e = unregister("other-instance").await.unwrap_err();
    assert_eq!(
        (e.code(), e.message()),
        (Code::FailedPrecondition, "service instance mismatch")
    );
    unregister("node-a-instance").await.unwrap();
    assert_eq!(lookup(&svc, "s1").await.unwrap_err().code(), Code::NotFound);
    unregister("node-a-instance").await.expect("idempotent");
    let r = svc
        .list_observed_nodes(Request::new(ListObservedNodesRequest::default()))
        .await
        .unwrap()
        .into_inner();
    assert!(r.nodes.is_empty());
    let r = svc
        .list_nodes(Request::new(ListNodesRequest {}))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.nodes.len(), 1, "the node stays discovered");
    let e = svc
        .unregister_node(Request::new(UnregisterNodeRequest::default()))
        .await
        .unwrap_err();
    assert_eq!(e.message(), "node_id and service_instance_id are required");
}

#[tokio::test(start_paused = true)]
async fn observed_nodes_filter_by_cluster_and_derive_status() {
    let registry = Arc::new(StaticRegistry::new(vec![], Duration::from_secs(30)));
    registry.set(vec![node("a"), node("b")], vec![node("c")]);
    let svc = Scheduler::builder(config(&["x"]))
        .registry(registry.clone())
        .build()
        .unwrap()
        .service();
    let list = |cluster: &str| {
        let cluster = cluster.to_string();
        let svc = svc.clone();
        async move {
            let mut v: Vec<(String, i32)> = svc
                .list_observed_nodes(Request::new(ListObservedNodesRequest {
                    cluster_id: cluster,
                }))
                .await
                .unwrap()
                .into_inner()
                .nodes
                .into_iter()
                .map(|n| (n.node_id, n.snapshot.unwrap().status))
                .collect();
            v.sort();
            v
        }
    };
    assert!(list("").await.is_empty(), "empty registry observation");
    heartbeat(&svc, beat("a", &[])).await;
    let mut other = beat("b", &[]);
    other.cluster_id = "cluster-2".into();
    heartbeat(&svc, other).await;
    heartbeat(&svc, beat("c", &[])).await;
    let ready = NodeStatus::Ready as i32;
    let lingering = NodeStatus::Lingering as i32;
    let unhealthy = NodeStatus::Unhealthy as i32;
    assert_eq!(
        list("cluster-1").await,
        [("a".into(), ready), ("c".into(), lingering)]
    );
    assert_eq!(list("  ").await.len(), 3);
    assert!(list("cluster-9").await.is_empty());
    advance(Duration::from_secs(30)).await;
    assert_eq!(
        list("cluster-1").await[0].1,
        ready,
        "exactly at the TTL it is still fresh"
    );
    advance(Duration::from_millis(1)).await;
    assert_eq!(
        list("cluster-1").await,
        [("a".into(), unhealthy), ("c".into(), unhealthy)]
    );
    // The endpoint follows discovery.
    registry.set(
        vec![Node {
            node_id: "a".into(),
            endpoint: "http://moved:8000".into(),
        }],
        vec![],
    );
    let nodes = svc
        .list_observed_nodes(Request::new(ListObservedNodesRequest::default()))
        .await
        .unwrap()
        .into_inner()
        .nodes;
    assert_eq!(
        nodes.len(),
        1,
        "observations of undiscovered nodes are dropped"
    );
    assert_eq!(nodes[0].endpoint, "http://moved:8000");
}

fn cpu(v: u32) -> String {
    format!(
        r#"{{"kvm_capabilities":[],"cpuid_modifiers":[{{"leaf":"0x1","subleaf":"0x0","flags":0,"modifiers":[{{"register":"ecx","bitmap":"0b{v:032b}"}}]}}],"msr_modifiers":[]}}"#
    )
}

fn beat_cpu(id: &str, cluster: &str, cfg: &str) -> HeartbeatRequest {
    let mut b = beat(id, &[]);
    b.cluster_id = cluster.into();
    b.machine_info = Some(MachineInfo {
        cpu_config_json: cfg.into(),
        ..Default::default()
    });
    b
}

#[tokio::test(start_paused = true)]
async fn cpu_template_is_withheld_until_every_node_reports_then_sent_once_each() {
    let svc = service(&["a", "b", "c"]);
    let r = heartbeat(&svc, beat_cpu("a", "k1", &cpu(0b1100))).await;
    assert_eq!(
        r.cpu_config_json,
        cpu(0b1100),
        "a single node gets its own config"
    );
    let r = heartbeat(&svc, beat_cpu("b", "k1", "")).await;
    assert!(
        r.cpu_config_json.is_empty(),
        "b has no config yet: withheld"
    );
    assert!(r.cpu_config_wanted);
    let r = heartbeat(&svc, beat_cpu("a", "k1", "")).await;
    assert!(r.cpu_config_json.is_empty());
    assert!(!r.cpu_config_wanted, "a's config was carried forward");
    let r = heartbeat(&svc, beat_cpu("b", "k1", &cpu(0b0110))).await;
    assert_eq!(r.cpu_config_json, cpu(0b0100), "the AND of both");
    let r = heartbeat(&svc, beat_cpu("b", "k1", "")).await;
    assert!(r.cpu_config_json.is_empty(), "exactly once per node");
    let r = heartbeat(&svc, beat_cpu("a", "k1", "")).await;
    assert_eq!(r.cpu_config_json, cpu(0b0100));
    let r = heartbeat(&svc, beat_cpu("a", "k1", "")).await;
    assert!(r.cpu_config_json.is_empty());
    // Another cluster is independent.
    let r = heartbeat(&svc, beat_cpu("c", "k2", &cpu(0b0001))).await;
    assert_eq!(r.cpu_config_json, cpu(0b0001));
}

#[tokio::test(start_paused = true)]
async fn a_fresh_scheduler_asks_nodes_to_resend_their_cpu_config() {
    // Nodes send their config only while the scheduler wants it; a restarted
    // scheduler (a fresh service) wants it again on the first heartbeat.
    let first = service(&["a"]);
    let r = heartbeat(&first, beat_cpu("a", "k1", &cpu(7))).await;
    assert!(!r.cpu_config_wanted);
    let restarted = service(&["a"]);
    let r = heartbeat(&restarted, beat_cpu("a", "k1", "")).await;
    assert!(
        r.cpu_config_wanted,
        "the restarted scheduler lost the config"
    );
    assert!(r.cpu_config_json.is_empty());
    let r = heartbeat(&restarted, beat_cpu("a", "k1", &cpu(7))).await;
    assert_eq!(r.cpu_config_json, cpu(7), "intersection computed again");
    // A heartbeat without machine info drops the stored config.
    let mut bare = beat("a", &[]);
    bare.cluster_id = "k1".into();
    let r = heartbeat(&restarted, bare).await;
    assert!(r.cpu_config_wanted);
}

async fn p2p_beat(svc: &SchedulerService, id: &str, backend: &str, addr: &str) {
    let mut b = beat(id, &[]);
    b.p2p_endpoint = Some(P2pEndpoint {
        backend: backend.into(),
        address: addr.into(),
    });
    heartbeat(svc, b).await;
}

#[tokio::test(start_paused = true)]
async fn p2p_lookup_returns_ready_providers_of_the_backend() {
    let svc = service(&["a", "b", "c", "d"]);
    p2p_beat(&svc, "a", "tcp", "10.0.0.1:7000").await;
    p2p_beat(&svc, "b", "tcp", "10.0.0.2:7000").await;
    p2p_beat(&svc, "c", "rdma", "10.0.0.3:7000").await;
    heartbeat(&svc, beat("d", &[])).await; // no p2p endpoint
    for n in ["a", "b", "c", "d"] {
        svc.record_p2p_artifact(Request::new(RecordP2pArtifactRequest {
            cluster_id: "cluster-1".into(),
            backend: "tcp".into(),
            key: "img".into(),
            node_id: n.into(),
        }))
        .await
        .unwrap();
    }
    let lookup = |exclude: &str| {
        let svc = svc.clone();
        let exclude = exclude.to_string();
        async move {
            let mut v: Vec<(String, String)> = svc
                .lookup_p2p_artifact(Request::new(LookupP2pArtifactRequest {
                    cluster_id: "cluster-1".into(),
                    backend: "tcp".into(),
                    key: "img".into(),
                    exclude_node_id: exclude,
                }))
                .await
                .unwrap()
                .into_inner()
                .peers
                .into_iter()
                .map(|p| (p.node_id, p.endpoint.unwrap().address))
                .collect();
            v.sort();
            v
        }
    };
    assert_eq!(
        lookup("b").await,
        [("a".to_string(), "10.0.0.1:7000".to_string())],
        "c has another backend, d no endpoint, b excluded"
    );
    svc.forget_p2p_artifact(Request::new(ForgetP2pArtifactRequest {
        cluster_id: "cluster-1".into(),
        backend: "tcp".into(),
        key: "img".into(),
        node_id: "a".into(),
    }))
    .await
    .unwrap();
    assert_eq!(lookup("").await.len(), 1, "only b is left");
    svc.unregister_node(Request::new(UnregisterNodeRequest {
        node_id: "b".into(),
        service_instance_id: "b-instance".into(),
    }))
    .await
    .unwrap();
    assert!(lookup("").await.is_empty());
    let peers = svc
        .list_p2p_peers(Request::new(ListP2pPeersRequest {
            cluster_id: String::new(),
            backend: String::new(),
            exclude_node_id: String::new(),
        }))
        .await
        .unwrap()
        .into_inner()
        .peers;
    let mut ids: Vec<_> = peers.into_iter().map(|p| p.node_id).collect();
    ids.sort();
    assert_eq!(ids, ["a", "c"]);
    advance(Duration::from_secs(31)).await;
    let peers = svc
        .list_p2p_peers(Request::new(ListP2pPeersRequest::default()))
        .await
        .unwrap()
        .into_inner()
        .peers;
    assert!(peers.is_empty(), "nodes past their TTL are not peers");
}

#[tokio::test(start_paused = true)]
async fn p2p_calls_validate_their_fields() {
    let svc = service(&["a"]);
    let e = svc
        .record_p2p_artifact(Request::new(RecordP2pArtifactRequest {
            cluster_id: "c".into(),
            backend: "tcp".into(),
            key: " ".into(),
            node_id: "a".into(),
        }))
        .await
        .unwrap_err();
    assert_eq!(
        e.message(),
        "cluster_id, backend, key, and node_id are required"
    );
    let e = svc
        .record_p2p_artifact(Request::new(RecordP2pArtifactRequest {
            cluster_id: "c".into(),
            backend: "tcp".into(),
            key: "k".into(),
            node_id: "zz".into(),
        }))
        .await
        .unwrap_err();
    assert_eq!(e.message(), "node is not in scheduler node list");
    let e = svc
        .forget_p2p_artifact(Request::new(ForgetP2pArtifactRequest::default()))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    let e = svc
        .lookup_p2p_artifact(Request::new(LookupP2pArtifactRequest::default()))
        .await
        .unwrap_err();
    assert_eq!(e.message(), "cluster_id, backend, and key are required");
}

#[tokio::test(start_paused = true)]
async fn report_sandbox_event_is_accepted() {
    let svc = service(&["a"]);
    svc.report_sandbox_event(Request::new(ReportSandboxEventRequest {
        node_id: "whoever".into(),
        events: vec![SandboxEvent {
            sandbox_id: "s".into(),
            event_type: SandboxEventType::Create as i32,
            ..Default::default()
        }],
        ..Default::default()
    }))
    .await
    .unwrap();
}

#[tokio::test(start_paused = true)]
async fn rpc_metrics_record_method_and_status() {
    let sched = Scheduler::builder(config(&["a"])).build().unwrap();
    let svc = sched.service();
    let _ = schedule(&svc).await;
    heartbeat(&svc, beat("a", &[])).await;
    schedule(&svc).await.unwrap();
    let text = agentenv_core::metrics::render(&sched.metrics_registry().lock());
    assert!(
        text.contains(r#"agentenv_scheduler_rpc_duration_seconds_count{rpc="Schedule",status="unavailable"} 1"#),
        "{text}"
    );
    assert!(text.contains(
        r#"agentenv_scheduler_rpc_duration_seconds_count{rpc="Schedule",status="ok"} 1"#
    ));
    assert!(text.contains(
        r#"agentenv_scheduler_rpc_duration_seconds_count{rpc="Heartbeat",status="ok"} 1"#
    ));
    assert!(
        text.contains(r#"agentenv_scheduler_schedule_assignments_total{strategy="round_robin"} 1"#)
    );
    assert!(text.contains(r#"agentenv_scheduler_schedule_duration_seconds_count{strategy="round_robin",status="ok"} 1"#));
}
