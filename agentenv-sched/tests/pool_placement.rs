//! Pool-aware placement through the service: nodes report pooled sandboxes per
//! template in their heartbeats, and a Schedule whose hint names a poolable create of
//! that template goes to them while they hold some, within the resource limits.

mod support;

use agentenv_core::config::{NodeResourceLimit, SchedulerConfig};
use agentenv_core::proto::scheduler_v1::schedule_request_hint::Kind;
use agentenv_core::proto::scheduler_v1::scheduler_server::Scheduler as _;
use agentenv_core::proto::scheduler_v1::*;
use agentenv_sched::{Scheduler, SchedulerService};
use support::{beat, config};
use tonic::Request;

fn service(config: SchedulerConfig) -> SchedulerService {
    Scheduler::builder(config).build().unwrap().service()
}

/// Node `id`'s heartbeat of time `at` with `running` sandboxes and `pooled` (template,
/// count).
async fn report(svc: &SchedulerService, id: &str, at: i64, running: u32, pooled: &[(&str, u32)]) {
    let mut req = beat(id, &[]);
    let s = req.snapshot.as_mut().unwrap();
    s.reported_at_unix_ms = at;
    s.sandbox_count = running;
    s.pooled_sandbox_count = pooled.iter().map(|(_, n)| n).sum();
    s.pooled_by_template = pooled.iter().map(|(t, n)| (t.to_string(), *n)).collect();
    svc.heartbeat(Request::new(req)).await.unwrap();
}

async fn schedule(svc: &SchedulerService, template: &str, poolable: bool) -> String {
    let hint = ScheduleRequestHint {
        kind: Some(Kind::NewSandbox(NewSandboxHint {
            template_id: template.into(),
            poolable,
            ..Default::default()
        })),
    };
    svc.schedule(Request::new(ScheduleRequest { hint: Some(hint) }))
        .await
        .unwrap()
        .into_inner()
        .node
        .unwrap()
        .node_id
}

async fn schedule_n(
    svc: &SchedulerService,
    template: &str,
    poolable: bool,
    n: usize,
) -> Vec<String> {
    let mut out = Vec::new();
    for _ in 0..n {
        out.push(schedule(svc, template, poolable).await);
    }
    out
}

#[tokio::test(start_paused = true)]
async fn creates_go_to_the_node_with_pooled_sandboxes_until_its_reported_ones_are_spoken_for() {
    let svc = service(config(&["a", "b", "c"]));
    report(&svc, "a", 1, 0, &[]).await;
    report(&svc, "b", 1, 0, &[("base", 2)]).await;
    report(&svc, "c", 1, 0, &[("python", 3)]).await;
    assert_eq!(schedule_n(&svc, "base", true, 2).await, ["b", "b"]);
    // b's two are spoken for until it reports again: round robin over all three.
    let rest = schedule_n(&svc, "base", true, 3).await;
    assert_eq!(
        {
            let mut r = rest.clone();
            r.sort();
            r
        },
        ["a", "b", "c"],
        "{rest:?}"
    );
    // b's next heartbeat shows its refilled pool.
    report(&svc, "b", 2, 2, &[("base", 2)]).await;
    assert_eq!(schedule_n(&svc, "base", true, 2).await, ["b", "b"]);
    // A create a pool cannot serve is the strategy's alone.
    let plain = schedule_n(&svc, "python", false, 3).await;
    assert!(plain.contains(&"a".to_string()), "{plain:?}");
    assert_eq!(schedule_n(&svc, "python", true, 3).await, ["c", "c", "c"]);
}

#[tokio::test(start_paused = true)]
async fn a_burst_of_eight_spreads_over_the_pooled_sandboxes_of_two_nodes() {
    let svc = service(config(&["a", "b", "c"]));
    report(&svc, "a", 1, 0, &[("base", 3)]).await;
    report(&svc, "b", 1, 0, &[]).await;
    report(&svc, "c", 1, 0, &[("base", 5)]).await;
    let got = futures::future::join_all((0..8).map(|_| schedule(&svc, "base", true))).await;
    let count = |id: &str| got.iter().filter(|g| *g == id).count();
    assert_eq!((count("a"), count("b"), count("c")), (3, 0, 5), "{got:?}");
}

#[tokio::test(start_paused = true)]
async fn a_node_over_the_resource_limits_gets_no_create_however_many_sandboxes_it_pools() {
    let svc = service(SchedulerConfig {
        node_resource_limit: Some(NodeResourceLimit {
            max_sandbox_count: Some(3),
            ..Default::default()
        }),
        ..config(&["a", "b"])
    });
    report(&svc, "a", 1, 0, &[]).await;
    report(&svc, "b", 1, 4, &[("base", 8)]).await;
    assert_eq!(schedule_n(&svc, "base", true, 4).await, ["a"; 4]);
}

#[tokio::test(start_paused = true)]
async fn with_prefer_pooled_nodes_off_the_strategy_places_every_create() {
    let svc = service(SchedulerConfig {
        prefer_pooled_nodes: false,
        ..config(&["a", "b"])
    });
    report(&svc, "a", 1, 0, &[]).await;
    report(&svc, "b", 1, 0, &[("base", 8)]).await;
    assert_eq!(
        schedule_n(&svc, "base", true, 4).await,
        ["a", "b", "a", "b"]
    );
}
