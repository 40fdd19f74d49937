//! The candidates placement sees: which nodes may take a sandbox follows every change at
//! once (a first heartbeat, a report going stale), while load figures that change with
//! every heartbeat are picked up within [`LOAD_REFRESH`].

mod support;

use agentenv_sched::placement::LeastLoaded;
use agentenv_sched::registry::{LARGE_FLEET, LOAD_REFRESH, NodeRegistry, StaticRegistry};
use support::{beat, node};
use tokio::time::{Duration, Instant};

fn pick(r: &StaticRegistry, now: Instant) -> Option<String> {
    r.pick(now, None, &LeastLoaded, None).map(|n| n.node_id)
}

/// Nodes `a`, `b` and, when `large`, enough idle others that never heartbeat.
fn registry(large: bool) -> StaticRegistry {
    let mut nodes = vec![node("a"), node("b")];
    if large {
        nodes.extend((0..LARGE_FLEET).map(|i| node(&format!("z{i:04}"))));
    }
    StaticRegistry::new(nodes, Duration::from_secs(10))
}

#[test]
fn in_a_small_fleet_every_heartbeat_reaches_placement_at_once() {
    let r = registry(false);
    let t0 = Instant::now();
    r.heartbeat(&beat("a", &["s1"]), t0, 0).unwrap();
    r.heartbeat(&beat("b", &[]), t0, 0).unwrap();
    assert_eq!(pick(&r, t0).as_deref(), Some("b"));
    r.heartbeat(&beat("b", &["x1", "x2", "x3"]), t0, 0).unwrap();
    assert_eq!(pick(&r, t0).as_deref(), Some("a"));
}

#[test]
fn in_a_large_fleet_load_reaches_placement_within_the_refresh_and_membership_at_once() {
    let r = registry(true);
    let t0 = Instant::now();
    r.heartbeat(&beat("a", &["s1"]), t0, 0).unwrap();
    assert_eq!(pick(&r, t0).as_deref(), Some("a"), "the only candidate");
    // b's first heartbeat makes it a candidate at once (and the less loaded one).
    r.heartbeat(&beat("b", &[]), t0, 0).unwrap();
    assert_eq!(pick(&r, t0).as_deref(), Some("b"));
    // b fills up: only its load changed, so placement may see the old figures for a
    // moment, never longer than the refresh.
    r.heartbeat(&beat("b", &["x1", "x2", "x3"]), t0, 0).unwrap();
    let soon = t0 + LOAD_REFRESH / 2;
    assert_eq!(
        pick(&r, soon).as_deref(),
        Some("b"),
        "b's figures of a moment ago"
    );
    assert_eq!(pick(&r, t0 + LOAD_REFRESH).as_deref(), Some("a"));
    // A node whose heartbeats stop leaves the candidates the moment its report is
    // stale, however recent the cached candidates are.
    let t1 = t0 + Duration::from_secs(5);
    r.heartbeat(&beat("b", &["x1", "x2", "x3"]), t1, 0).unwrap();
    let stale = t0 + Duration::from_secs(10) + Duration::from_millis(1);
    assert_eq!(pick(&r, stale).as_deref(), Some("b"), "a is stale");
}
