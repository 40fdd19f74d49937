//! The primary's Redis store with its copy in memory, against a real
//! `redis-server`: what the copy answers, when it gives way to Redis, and what
//! it does while Redis is down.

mod support;

use agentenv_sched::{BindingStore, MemoryBindingStore, MirroredRedisStore, RedisBindingStore};
use agentenv_testkit::redis::RedisServer;
use support::node;
use tokio::time::{Duration, Instant};

const TTL: Duration = Duration::from_secs(30);
const KEY: &str = "agentenv:scheduler:bindings:sandbox:";

async fn mirrored(server: &RedisServer) -> MirroredRedisStore {
    let redis = RedisBindingStore::connect(&server.addr(), TTL)
        .await
        .unwrap();
    MirroredRedisStore::new(redis, TTL)
}

async fn owner(store: &dyn BindingStore, id: &str, now: Instant) -> Option<String> {
    store.get(id, now).await.unwrap().map(|n| n.node_id)
}

#[tokio::test]
async fn every_write_reaches_redis_and_the_copy() {
    let server = RedisServer::start();
    let store = mirrored(&server).await;
    let now = Instant::now();
    store.record("rec", &node("a"), now).await.unwrap();
    store
        .reconcile_node(&node("b"), &["beat".into()], now)
        .await
        .unwrap();
    assert_eq!(store.mirrored(), 2);
    for (id, on) in [("rec", "a"), ("beat", "b")] {
        let raw = server.command(&["GET", &format!("{KEY}{id}")]).unwrap();
        assert!(
            raw.contains(&format!("\"node_id\":\"{on}\"")),
            "{id}: {raw}"
        );
    }
    store.forget_node("b").await.unwrap();
    assert_eq!(
        server.command(&["EXISTS", &format!("{KEY}beat")]).unwrap(),
        "0"
    );
    assert_eq!(owner(&store, "beat", now).await, None);
}

#[tokio::test]
async fn a_binding_the_copy_lacks_is_read_from_redis() {
    // What another scheduler wrote, or this one before a restart.
    let server = RedisServer::start();
    let before = mirrored(&server).await;
    before
        .record("old", &node("a"), Instant::now())
        .await
        .unwrap();
    drop(before);
    let store = mirrored(&server).await;
    assert_eq!(store.mirrored(), 0);
    assert_eq!(
        owner(&store, "old", Instant::now()).await.as_deref(),
        Some("a")
    );
    assert_eq!(owner(&store, "never", Instant::now()).await, None);
}

#[tokio::test]
async fn the_copy_answers_for_two_thirds_of_the_ttl_then_redis_does() {
    let server = RedisServer::start();
    let store = mirrored(&server).await;
    let now = Instant::now();
    store.record("sbx", &node("a"), now).await.unwrap();
    // Redis loses the binding (flushed, or expired early): the copy still
    // answers, as Redis will have it again at the node's next roster ...
    server.command(&["DEL", &format!("{KEY}sbx")]).unwrap();
    assert_eq!(owner(&store, "sbx", now).await.as_deref(), Some("a"));
    // ... but never past the least a heartbeat leaves a Redis binding.
    let later = now + TTL * 2 / 3;
    assert_eq!(owner(&store, "sbx", later).await, None);
}

#[tokio::test]
async fn with_redis_down_known_bindings_route_and_everything_else_is_unavailable() {
    let mut server = RedisServer::start();
    let store = mirrored(&server).await;
    let now = Instant::now();
    store.record("known", &node("a"), now).await.unwrap();
    server.kill();

    assert_eq!(owner(&store, "known", now).await.as_deref(), Some("a"));
    let unknown = store.get("unknown", now).await.unwrap_err();
    assert!(unknown.0.contains("redis GET"), "{}", unknown.0);
    // Writes fail for the caller but still reach the copy: a roster is the
    // node's truth whether Redis hears it or not.
    store
        .reconcile_node(&node("a"), &["fresh".into()], now)
        .await
        .unwrap_err();
    assert_eq!(owner(&store, "fresh", now).await.as_deref(), Some("a"));
}

/// Scripts Redis has run so far (not counting a call that found its script
/// not loaded yet and was sent again).
fn scripts_run(server: &RedisServer) -> u64 {
    let stats = server.command(&["INFO", "commandstats"]).unwrap();
    let field = |line: &str, name: &str| -> u64 {
        line.split([':', ','])
            .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0)
    };
    stats
        .lines()
        .filter(|l| l.starts_with("cmdstat_evalsha:") || l.starts_with("cmdstat_eval:"))
        .map(|l| field(l, "calls") - field(l, "failed_calls") - field(l, "rejected_calls"))
        .sum()
}

#[tokio::test]
async fn a_roster_that_changes_nothing_is_sent_once_a_third_of_the_ttl() {
    let server = RedisServer::start();
    let store = mirrored(&server).await;
    let roster = |ids: &[&str]| ids.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let t0 = Instant::now();
    let beat = |ids: Vec<String>, at: Instant| {
        let store = &store;
        async move { store.reconcile_node(&node("a"), &ids, at).await.unwrap() }
    };
    beat(roster(&["s1", "s2"]), t0).await;
    let sent = scripts_run(&server);
    beat(roster(&["s2", "s1"]), t0 + Duration::from_secs(5)).await;
    assert_eq!(scripts_run(&server), sent, "the same roster within TTL/3");
    beat(roster(&["s1", "s2", "s3"]), t0 + Duration::from_secs(6)).await;
    assert_eq!(scripts_run(&server), sent + 1, "a new sandbox goes at once");
    store
        .record("s4", &node("a"), t0 + Duration::from_secs(7))
        .await
        .unwrap();
    beat(
        roster(&["s1", "s2", "s3", "s4"]),
        t0 + Duration::from_secs(8),
    )
    .await;
    assert_eq!(scripts_run(&server), sent + 3, "a recorded sandbox listed");
    beat(roster(&["s1", "s2", "s3", "s4"]), t0 + TTL / 3).await;
    assert_eq!(
        scripts_run(&server),
        sent + 4,
        "the TTL is due for a restart"
    );
    let pttl: i64 = server
        .command(&["PTTL", &format!("{KEY}s1")])
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        pttl > (TTL * 9 / 10).as_millis() as i64,
        "restarted: {pttl} ms"
    );
}

#[tokio::test]
async fn a_replica_reading_redis_sees_every_step_the_primary_took_though_some_rosters_were_not_sent()
 {
    let server = RedisServer::start();
    let primary = mirrored(&server).await;
    let replica = RedisBindingStore::connect(&server.addr(), TTL)
        .await
        .unwrap();
    // What the steps leave, by the in-memory store's rules.
    let model = MemoryBindingStore::new(TTL);
    let t0 = Instant::now();
    let ids = ["s1", "s2", "s3", "s4"];
    type Step = (&'static str, &'static str, &'static [&'static str]);
    // (action, node, ids): rosters repeat within TTL/3, records and moves between them.
    let steps: &[Step] = &[
        ("beat", "a", &["s1", "s2"]),
        ("beat", "a", &["s1", "s2"]),
        ("record", "b", &["s2"]),
        ("beat", "a", &["s1"]),
        ("beat", "b", &["s2", "s3"]),
        ("beat", "b", &["s2", "s3"]),
        ("record", "a", &["s4"]),
        ("beat", "a", &["s1"]),
        ("beat", "a", &["s1"]),
        ("beat", "b", &["s2"]),
        ("forget", "b", &[]),
        ("beat", "a", &["s1", "s3"]),
        ("beat", "a", &["s1", "s3"]),
    ];
    for (i, (action, on, listed)) in steps.iter().enumerate() {
        let now = t0 + Duration::from_secs(i as u64);
        match *action {
            "beat" => {
                let roster: Vec<String> = listed.iter().map(|s| s.to_string()).collect();
                for store in [&primary as &dyn BindingStore, &model] {
                    store.reconcile_node(&node(on), &roster, now).await.unwrap();
                }
            }
            "record" => {
                for store in [&primary as &dyn BindingStore, &model] {
                    store.record(listed[0], &node(on), now).await.unwrap();
                }
            }
            _ => {
                for store in [&primary as &dyn BindingStore, &model] {
                    store.forget_node(on).await.unwrap();
                }
            }
        }
        for id in ids {
            assert_eq!(
                owner(&replica, id, now).await,
                owner(&model, id, now).await,
                "{id} after step {i} ({action} {on} {listed:?})"
            );
        }
    }
}
