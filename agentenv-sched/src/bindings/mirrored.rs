//! The primary scheduler's store on Redis: every write goes to Redis and to a
//! copy in memory, and lookups are answered from the copy when it has the
//! binding.
//!
//! A primary is the only scheduler that writes bindings, so what it wrote is
//! what Redis holds, and a lookup need not wait for a Redis round trip behind
//! thousands of heartbeats a second. The copy never outlives Redis: its
//! bindings expire two thirds of the binding TTL after their last write,
//! the least Redis keeps them after a heartbeat (see the reconcile script).
//! A lookup the copy cannot answer (a restarted primary, a binding written by
//! another scheduler) reads Redis.
//!
//! The copy also spares Redis the heartbeats that change nothing: a roster
//! the copy already holds exactly (no sandbox added, dropped, moved or still
//! pending) is not sent while the node's bindings were refreshed in Redis
//! less than a third of the TTL ago; the next one after that is, and restarts
//! their TTL. Any Redis failure makes the next roster of every node go to
//! Redis.
//!
//! While Redis is down, writes answer UNAVAILABLE but are applied to the copy
//! (a roster is the node's truth either way), so the sandboxes the primary
//! knows stay routable; lookups of any other id answer UNAVAILABLE, as the
//! primary cannot tell whether they exist.

use std::collections::HashMap;

use agentenv_core::proto::scheduler_v1::Node;
use async_trait::async_trait;
use parking_lot::Mutex;
use tokio::time::{Duration, Instant};

use super::{BindingStore, MemoryBindingStore, RedisBindingStore, StoreError};

/// Redis with a copy in memory of what this scheduler wrote.
pub struct MirroredRedisStore {
    redis: RedisBindingStore,
    copy: MemoryBindingStore,
    /// A third of the binding TTL: how long a refresh in Redis lasts.
    refresh_every: Duration,
    /// When each node's bindings last had their TTL restarted in Redis (the
    /// time its roster was sent).
    refreshed: Mutex<HashMap<String, Instant>>,
}

impl MirroredRedisStore {
    /// Mirrors the writes made through `redis`, whose bindings expire `ttl`
    /// after their last refresh.
    pub fn new(redis: RedisBindingStore, ttl: Duration) -> Self {
        Self {
            redis,
            copy: MemoryBindingStore::new(ttl * 2 / 3),
            refresh_every: ttl / 3,
            refreshed: Mutex::new(HashMap::new()),
        }
    }

    /// Passes Redis's answer on; a failure makes every node's next roster go to Redis.
    fn seen<T>(&self, result: Result<T, StoreError>) -> Result<T, StoreError> {
        if result.is_err() {
            self.refreshed.lock().clear();
        }
        result
    }

    /// The Redis behind the copy.
    pub fn redis(&self) -> &RedisBindingStore {
        &self.redis
    }

    /// Bindings held in memory (expired ones not yet swept included).
    pub fn mirrored(&self) -> usize {
        self.copy.len()
    }
}

#[async_trait]
impl BindingStore for MirroredRedisStore {
    async fn get(&self, sandbox_id: &str, now: Instant) -> Result<Option<Node>, StoreError> {
        let id = sandbox_id.trim();
        if let Some(node) = self.copy.get(id, now).await? {
            return Ok(Some(node));
        }
        self.seen(self.redis.get(id, now).await)
    }

    async fn record(&self, sandbox_id: &str, node: &Node, now: Instant) -> Result<(), StoreError> {
        let (id, node_id, endpoint) =
            (sandbox_id.trim(), node.node_id.trim(), node.endpoint.trim());
        if id.is_empty() || node_id.is_empty() || endpoint.is_empty() {
            return Ok(());
        }
        let node = Node {
            node_id: node_id.to_string(),
            endpoint: endpoint.to_string(),
        };
        self.copy.record(id, &node, now).await?;
        self.seen(self.redis.record(id, &node, now).await)
    }

    async fn reconcile_node(
        &self,
        node: &Node,
        sandbox_ids: &[String],
        now: Instant,
    ) -> Result<(), StoreError> {
        let node_id = node.node_id.trim();
        if node_id.is_empty() {
            return Ok(());
        }
        // The Redis store makes no binding without an address; neither does the copy.
        let listed = sandbox_ids.iter().any(|s| !s.trim().is_empty());
        let mut changed = true;
        if !listed || !node.endpoint.trim().is_empty() {
            let trimmed = Node {
                node_id: node_id.to_string(),
                endpoint: node.endpoint.trim().to_string(),
            };
            changed = self.copy.reconcile(&trimmed, sandbox_ids, now);
        }
        if !changed
            && listed
            && self
                .refreshed
                .lock()
                .get(node_id)
                .is_some_and(|at| now.saturating_duration_since(*at) < self.refresh_every)
        {
            return Ok(());
        }
        let refreshed = self.seen(self.redis.reconcile_roster(node, sandbox_ids).await)?;
        let mut memo = self.refreshed.lock();
        if refreshed {
            memo.insert(node_id.to_string(), now);
        } else if !listed {
            memo.remove(node_id);
        }
        Ok(())
    }

    async fn forget_node(&self, node_id: &str) -> Result<(), StoreError> {
        self.copy.forget_node(node_id.trim()).await?;
        self.refreshed.lock().remove(node_id.trim());
        self.seen(self.redis.forget_node(node_id).await)
    }

    async fn sweep_expired(&self, now: Instant) -> Result<usize, StoreError> {
        self.copy.sweep_expired(now).await
    }
}
