//! The behaviours every binding store shares, run against the in-memory store,
//! a real `redis-server`, and Redis with the primary's copy in memory. Each step moves a clock one second on,
//! so the in-memory store sees the order of events the way Redis does.

mod support;

use agentenv_sched::{BindingStore, MemoryBindingStore, MirroredRedisStore, RedisBindingStore};
use agentenv_testkit::redis::RedisServer;
use support::node;
use tokio::time::{Duration, Instant};

const TTL: Duration = Duration::from_secs(30);

fn ids(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

/// A store under test with a clock that moves one second per step.
struct Subject {
    store: Box<dyn BindingStore>,
    now: Instant,
    _redis: Option<RedisServer>,
}

impl Subject {
    fn tick(&mut self) -> Instant {
        self.now += Duration::from_secs(1);
        self.now
    }
    async fn get(&mut self, id: &str) -> Option<String> {
        let now = self.tick();
        self.store.get(id, now).await.unwrap().map(|n| n.node_id)
    }
    async fn record(&mut self, id: &str, on: &str) {
        let now = self.tick();
        self.store.record(id, &node(on), now).await.unwrap();
    }
    async fn reconcile(&mut self, on: &str, roster: &[&str]) {
        let now = self.tick();
        self.store
            .reconcile_node(&node(on), &ids(roster), now)
            .await
            .unwrap();
    }
    async fn forget(&mut self, on: &str) {
        self.store.forget_node(on).await.unwrap();
    }
}

fn memory() -> Subject {
    Subject {
        store: Box::new(MemoryBindingStore::new(TTL)),
        now: Instant::now(),
        _redis: None,
    }
}

async fn on_redis(wrap: fn(RedisBindingStore) -> Box<dyn BindingStore>) -> Subject {
    let server = RedisServer::start();
    let store = RedisBindingStore::connect(&server.addr(), TTL)
        .await
        .unwrap();
    Subject {
        store: wrap(store),
        now: Instant::now(),
        _redis: Some(server),
    }
}

async fn redis() -> Subject {
    on_redis(|s| Box::new(s)).await
}

async fn mirrored() -> Subject {
    on_redis(|s| Box::new(MirroredRedisStore::new(s, TTL))).await
}

async fn a_recorded_binding_is_found(mut s: Subject) {
    assert_eq!(s.get("sbx").await, None);
    s.record("sbx", "a").await;
    assert_eq!(s.get("sbx").await.as_deref(), Some("a"));
    s.record("other", "b").await;
    assert_eq!(s.get("sbx").await.as_deref(), Some("a"));
    assert_eq!(s.get("other").await.as_deref(), Some("b"));
}

async fn record_trims_the_id_and_ignores_a_blank_one(mut s: Subject) {
    s.record("  sbx  ", "a").await;
    s.record("   ", "a").await;
    assert_eq!(s.get("sbx").await.as_deref(), Some("a"));
    s.reconcile("a", &["sbx"]).await;
    s.reconcile("a", &["sbx"]).await;
    assert_eq!(s.get("sbx").await.as_deref(), Some("a"));
}

async fn reconcile_removes_missing_ids_dedups_and_ignores_blanks(mut s: Subject) {
    s.reconcile("a", &["s1", "s2", "s3"]).await;
    s.reconcile("a", &["s1", " s1 ", "", "  ", "s4"]).await;
    assert_eq!(s.get("s1").await.as_deref(), Some("a"));
    assert_eq!(s.get("s4").await.as_deref(), Some("a"));
    assert_eq!(s.get("s2").await, None);
    assert_eq!(s.get("s3").await, None);
    s.reconcile("a", &[]).await;
    assert_eq!(s.get("s1").await, None, "an empty roster drops everything");
    assert_eq!(s.get("s4").await, None);
}

async fn a_reconcile_leaves_other_nodes_bindings_alone(mut s: Subject) {
    s.reconcile("a", &["a1", "a2"]).await;
    s.reconcile("b", &["b1"]).await;
    s.record("b2", "b").await;
    s.reconcile("a", &[]).await;
    assert_eq!(s.get("b1").await.as_deref(), Some("b"));
    assert_eq!(s.get("b2").await.as_deref(), Some("b"));
    assert_eq!(s.get("a1").await, None);
}

async fn bindings_move_and_the_old_owner_cannot_delete_them(mut s: Subject) {
    s.record("s1", "a").await;
    s.record("s2", "a").await;
    s.record("s1", "b").await;
    s.reconcile("b", &["s1", "s2"]).await;
    s.reconcile("a", &[]).await;
    assert_eq!(s.get("s1").await.as_deref(), Some("b"));
    assert_eq!(s.get("s2").await.as_deref(), Some("b"));
    // a re-reporting s1 moves it back; b's roster without it must not
    // delete a's binding.
    s.reconcile("a", &["s1"]).await;
    s.reconcile("b", &["s2"]).await;
    assert_eq!(s.get("s1").await.as_deref(), Some("a"));
    s.reconcile("b", &[]).await;
    assert_eq!(s.get("s1").await.as_deref(), Some("a"));
    assert_eq!(s.get("s2").await, None);
}

async fn a_roster_sampled_before_a_create_does_not_drop_its_binding(mut s: Subject) {
    s.reconcile("a", &["old"]).await;
    s.record("new", "a").await;
    // This roster was sampled before "new" existed.
    s.reconcile("a", &["old"]).await;
    assert_eq!(s.get("new").await.as_deref(), Some("a"));
    // The next roster still omits it: the sandbox is gone.
    s.reconcile("a", &["old"]).await;
    assert_eq!(s.get("new").await, None);
    assert_eq!(s.get("old").await.as_deref(), Some("a"));
}

async fn a_listed_binding_is_dropped_by_the_next_omission(mut s: Subject) {
    s.reconcile("a", &[]).await;
    s.record("s", "a").await;
    s.reconcile("a", &["s"]).await;
    s.reconcile("a", &[]).await;
    assert_eq!(s.get("s").await, None);
}

async fn forget_node_drops_every_binding_of_the_node(mut s: Subject) {
    s.record("s1", "a").await;
    s.record("s2", "b").await;
    s.reconcile("a", &["s3"]).await;
    s.record("s4", "a").await;
    s.forget("a").await;
    assert_eq!(s.get("s1").await, None);
    assert_eq!(s.get("s3").await, None);
    assert_eq!(
        s.get("s4").await,
        None,
        "recorded since the last roster too"
    );
    assert_eq!(s.get("s2").await.as_deref(), Some("b"));
}

macro_rules! every_store {
    ($($name:ident),* $(,)?) => {
        mod memory_store {
            $(
                #[tokio::test]
                async fn $name() {
                    super::$name(super::memory()).await;
                }
            )*
        }
        mod redis_store {
            $(
                #[tokio::test]
                async fn $name() {
                    super::$name(super::redis().await).await;
                }
            )*
        }
        mod mirrored_redis_store {
            $(
                #[tokio::test]
                async fn $name() {
                    super::$name(super::mirrored().await).await;
                }
            )*
        }
    };
}

every_store!(
    a_recorded_binding_is_found,
    record_trims_the_id_and_ignores_a_blank_one,
    reconcile_removes_missing_ids_dedups_and_ignores_blanks,
    a_reconcile_leaves_other_nodes_bindings_alone,
    bindings_move_and_the_old_owner_cannot_delete_them,
    a_roster_sampled_before_a_create_does_not_drop_its_binding,
    a_listed_binding_is_dropped_by_the_next_omission,
    forget_node_drops_every_binding_of_the_node,
);
