//! Changing the node set while the scheduler runs: a reloaded node list
//! (nodes added, removed, replaced) and drains. Called in-process; time is
//! paused so TTLs are exact.

mod support;

use agentenv_core::proto::scheduler_v1::scheduler_server::Scheduler as _;
use agentenv_core::proto::scheduler_v1::*;
use agentenv_sched::{Scheduler, SchedulerService};
use support::{beat, config};
use tokio::time::{Duration, advance};
use tonic::{Code, Request};

fn scheduler(ids: &[&str]) -> Scheduler {
    Scheduler::builder(config(ids)).build().unwrap()
}

async fn heartbeat(svc: &SchedulerService, req: HeartbeatRequest) -> Result<(), tonic::Status> {
    svc.heartbeat(Request::new(req)).await.map(|_| ())
}

/// The node ids of `n` placements.
async fn placements(svc: &SchedulerService, n: usize) -> Vec<String> {
    let mut out = Vec::new();
    for _ in 0..n {
        match svc.schedule(Request::new(ScheduleRequest::default())).await {
            Ok(r) => out.push(r.into_inner().node.unwrap().node_id),
            Err(s) => out.push(format!("{:?}", s.code())),
        }
    }
    out.sort();
    out.dedup();
    out
}

async fn lookup(svc: &SchedulerService, id: &str) -> Result<String, Code> {
    svc.lookup_node(Request::new(LookupNodeRequest {
        sandbox_id: id.into(),
    }))
    .await
    .map(|r| r.into_inner().node.unwrap().node_id)
    .map_err(|s| s.code())
}

async fn status_of(svc: &SchedulerService, id: &str) -> Option<NodeStatus> {
    let nodes = svc
        .list_observed_nodes(Request::new(ListObservedNodesRequest::default()))
        .await
        .unwrap()
        .into_inner()
        .nodes;
    nodes
        .iter()
        .find(|n| n.node_id == id)
        .map(|n| NodeStatus::try_from(n.snapshot.as_ref().unwrap().status).unwrap())
}

async fn drain(svc: &SchedulerService, id: &str) -> Result<DrainNodeResponse, tonic::Status> {
    svc.drain_node(Request::new(DrainNodeRequest { node_id: id.into() }))
        .await
        .map(|r| r.into_inner())
}

async fn undrain(svc: &SchedulerService, id: &str) -> Result<UndrainNodeResponse, tonic::Status> {
    svc.undrain_node(Request::new(UndrainNodeRequest { node_id: id.into() }))
        .await
        .map(|r| r.into_inner())
}

fn metrics_text(s: &Scheduler) -> String {
    let mut out = String::new();
    prometheus_client::encoding::text::encode(&mut out, &s.metrics_registry().lock()).unwrap();
    out
}

#[tokio::test(start_paused = true)]
async fn a_node_added_by_a_reload_takes_placements_once_it_heartbeats() {
    let s = scheduler(&["node-a"]);
    let svc = s.service();
    heartbeat(&svc, beat("node-a", &[])).await.unwrap();
    let e = heartbeat(&svc, beat("node-b", &[])).await.unwrap_err();
    assert_eq!(e.message(), "node is not in scheduler node list");

    let change = svc
        .reload_config(&config(&["node-a"]), &config(&["node-a", "node-b"]))
        .unwrap();
    assert_eq!(change.added, ["node-b"]);
    assert_eq!(change.to_string(), "+node-b");
    // Listed, but not a candidate before its first heartbeat.
    assert_eq!(placements(&svc, 4).await, ["node-a"]);
    heartbeat(&svc, beat("node-b", &[])).await.unwrap();
    assert_eq!(placements(&svc, 4).await, ["node-a", "node-b"]);
    assert!(metrics_text(&s).contains("agentenv_scheduler_config_reloads_total{result=\"ok\"} 1"));
}

#[tokio::test(start_paused = true)]
async fn a_removed_node_keeps_its_sandboxes_routable_until_its_roster_is_empty() {
    let svc = scheduler(&["node-a", "node-b"]).service();
    heartbeat(&svc, beat("node-a", &[])).await.unwrap();
    heartbeat(&svc, beat("node-b", &["sbx-1", "sbx-2", "sbx-3"]))
        .await
        .unwrap();

    let change = svc
        .reload_config(&config(&["node-a", "node-b"]), &config(&["node-a"]))
        .unwrap();
    assert_eq!(
        change.to_string(),
        "-node-b (lingering until its 3 sandboxes are gone)"
    );
    // No placement there from now on, but its sandboxes are still found.
    assert_eq!(placements(&svc, 4).await, ["node-a"]);
    assert_eq!(lookup(&svc, "sbx-1").await.unwrap(), "node-b");
    assert_eq!(status_of(&svc, "node-b").await, Some(NodeStatus::Lingering));

    // Its heartbeats are still taken and keep the bindings fresh.
    heartbeat(&svc, beat("node-b", &["sbx-1"])).await.unwrap();
    assert_eq!(lookup(&svc, "sbx-1").await.unwrap(), "node-b");
    assert_eq!(lookup(&svc, "sbx-2").await.unwrap_err(), Code::NotFound);
    assert_eq!(placements(&svc, 4).await, ["node-a"]);

    // The last sandbox is gone: the node leaves the registry.
    heartbeat(&svc, beat("node-b", &[])).await.unwrap();
    assert_eq!(lookup(&svc, "sbx-1").await.unwrap_err(), Code::NotFound);
    assert_eq!(status_of(&svc, "node-b").await, None);
    let e = heartbeat(&svc, beat("node-b", &[])).await.unwrap_err();
    assert_eq!(
        (e.code(), e.message()),
        (Code::InvalidArgument, "node is not in scheduler node list")
    );
}

#[tokio::test(start_paused = true)]
async fn a_removed_node_without_sandboxes_leaves_at_once_and_can_be_listed_again() {
    let svc = scheduler(&["node-a", "node-b", "node-c"]).service();
    heartbeat(&svc, beat("node-a", &[])).await.unwrap();
    heartbeat(&svc, beat("node-b", &[])).await.unwrap();
    heartbeat(&svc, beat("node-c", &["sbx-1"])).await.unwrap();
    let change = svc
        .reload_config(
            &config(&["node-a", "node-b", "node-c"]),
            &config(&["node-a"]),
        )
        .unwrap();
    assert_eq!(change.dropped, ["node-b"]);
    assert_eq!(change.lingering.len(), 1);
    assert!(heartbeat(&svc, beat("node-b", &[])).await.is_err());

    // Listed again while it still lingers: a candidate again, bindings intact.
    let change = svc
        .reload_config(&config(&["node-a"]), &config(&["node-a", "node-c"]))
        .unwrap();
    assert_eq!(change.restored, ["node-c"]);
    assert_eq!(placements(&svc, 4).await, ["node-a", "node-c"]);
    assert_eq!(lookup(&svc, "sbx-1").await.unwrap(), "node-c");
}

#[tokio::test(start_paused = true)]
async fn a_removed_node_that_unregisters_or_goes_silent_leaves_the_registry() {
    let s = scheduler(&["node-a", "node-b", "node-c"]);
    let svc = s.service();
    for id in ["node-a", "node-b", "node-c"] {
        let sandbox = format!("sbx-of-{id}");
        heartbeat(&svc, beat(id, &[&sandbox])).await.unwrap();
    }
    svc.reload_config(
        &config(&["node-a", "node-b", "node-c"]),
        &config(&["node-a"]),
    )
    .unwrap();

    svc.unregister_node(Request::new(UnregisterNodeRequest {
        node_id: "node-b".into(),
        service_instance_id: "node-b-instance".into(),
    }))
    .await
    .unwrap();
    assert!(heartbeat(&svc, beat("node-b", &[])).await.is_err());

    // node-c stops sending heartbeats; node-a keeps going.
    svc.prune_removed_nodes(Duration::from_secs(60));
    assert!(
        status_of(&svc, "node-c").await.is_some(),
        "still within grace"
    );
    advance(Duration::from_secs(61)).await;
    svc.prune_removed_nodes(Duration::from_secs(60));
    assert_eq!(status_of(&svc, "node-c").await, None);
    assert!(
        status_of(&svc, "node-a").await.is_some(),
        "listed nodes stay"
    );
}

#[tokio::test(start_paused = true)]
async fn an_endpoint_change_replaces_the_node() {
    let svc = scheduler(&["node-a"]).service();
    heartbeat(&svc, beat("node-a", &[])).await.unwrap();
    let mut moved = config(&["node-a"]);
    moved.nodes[0].endpoint = "http://10.0.0.9:8000".into();
    let change = svc.reload_config(&config(&["node-a"]), &moved).unwrap();
    assert_eq!(change.replaced, ["node-a"]);
    // The old observation is gone: not a candidate until the new one heartbeats.
    assert_eq!(placements(&svc, 1).await, ["Unavailable"]);
    heartbeat(&svc, beat("node-a", &[])).await.unwrap();
    let r = svc
        .schedule(Request::new(ScheduleRequest::default()))
        .await
        .unwrap();
    assert_eq!(
        r.into_inner().node.unwrap().endpoint,
        "http://10.0.0.9:8000"
    );
}

#[tokio::test(start_paused = true)]
async fn a_failed_reload_is_counted() {
    let s = scheduler(&["node-a"]);
    s.service()
        .reload_failed(&"scheduler.strategy: unknown strategy");
    assert!(
        metrics_text(&s).contains("agentenv_scheduler_config_reloads_total{result=\"failed\"} 1")
    );
}

#[tokio::test(start_paused = true)]
async fn a_drained_node_gets_no_placement_from_the_moment_the_call_returns() {
    let s = scheduler(&["node-a", "node-b"]);
    let svc = s.service();
    heartbeat(&svc, beat("node-a", &[])).await.unwrap();
    heartbeat(&svc, beat("node-b", &["sbx-1"])).await.unwrap();
    // The candidate list is cached by now.
    assert_eq!(placements(&svc, 4).await, ["node-a", "node-b"]);

    let r = drain(&svc, "node-b").await.unwrap();
    let view = r.node.unwrap();
    assert_eq!(view.snapshot.unwrap().status, NodeStatus::Draining as i32);
    assert_eq!(placements(&svc, 6).await, ["node-a"]);
    assert_eq!(status_of(&svc, "node-b").await, Some(NodeStatus::Draining));
    // Its sandboxes are served; its heartbeats are taken.
    heartbeat(&svc, beat("node-b", &["sbx-1"])).await.unwrap();
    assert_eq!(lookup(&svc, "sbx-1").await.unwrap(), "node-b");
    assert_eq!(status_of(&svc, "node-b").await, Some(NodeStatus::Draining));
    assert!(metrics_text(&s).contains("agentenv_scheduler_observed_nodes{status=\"draining\"} 1"));
    // Draining twice is fine.
    drain(&svc, "node-b").await.unwrap();

    // Drain state survives a reload of the node list.
    svc.reload_config(
        &config(&["node-a", "node-b"]),
        &config(&["node-a", "node-b"]),
    )
    .unwrap();
    assert_eq!(placements(&svc, 4).await, ["node-a"]);

    let r = undrain(&svc, "node-b").await.unwrap();
    assert_eq!(
        r.node.unwrap().snapshot.unwrap().status,
        NodeStatus::Ready as i32
    );
    assert_eq!(placements(&svc, 4).await, ["node-a", "node-b"]);
    assert_eq!(status_of(&svc, "node-b").await, Some(NodeStatus::Ready));
}

#[tokio::test(start_paused = true)]
async fn the_last_node_drained_leaves_no_candidate() {
    let svc = scheduler(&["node-a"]).service();
    heartbeat(&svc, beat("node-a", &[])).await.unwrap();
    drain(&svc, "node-a").await.unwrap();
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
async fn a_node_that_never_heartbeated_can_be_drained() {
    let svc = scheduler(&["node-a", "node-b"]).service();
    heartbeat(&svc, beat("node-a", &[])).await.unwrap();
    assert!(drain(&svc, "node-b").await.unwrap().node.is_none());
    heartbeat(&svc, beat("node-b", &[])).await.unwrap();
    assert_eq!(placements(&svc, 4).await, ["node-a"]);
    assert_eq!(status_of(&svc, "node-b").await, Some(NodeStatus::Draining));
}

#[tokio::test(start_paused = true)]
async fn drain_of_an_unknown_or_blank_node_is_refused_with_a_clear_message() {
    let svc = scheduler(&["node-a"]).service();
    let e = drain(&svc, "node-z").await.unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
    assert!(e.message().contains("\"node-z\""), "{}", e.message());
    assert!(e.message().contains("aenv node ls"), "{}", e.message());
    let e = undrain(&svc, "node-z").await.unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
    let e = drain(&svc, "  ").await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    assert!(
        e.message().starts_with("node_id is required"),
        "{}",
        e.message()
    );
    let e = drain(&svc, &"x".repeat(300)).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
}

#[tokio::test(start_paused = true)]
async fn a_query_only_scheduler_does_not_drain() {
    let svc = Scheduler::builder(config(&["node-a"]))
        .query_only(true)
        .build()
        .unwrap()
        .service();
    let e = drain(&svc, "node-a").await.unwrap_err();
    assert_eq!(e.code(), Code::Unimplemented);
    assert!(
        svc.reload_config(&config(&["node-a"]), &config(&["node-b"]))
            .is_none()
    );
}
