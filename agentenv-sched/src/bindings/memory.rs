//! Bindings in process memory: a map of id → node and expiry plus a reverse
//! index node → ids. Expired entries go on lookup and on the periodic sweep.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use agentenv_core::proto::scheduler_v1::Node;
use async_trait::async_trait;
use parking_lot::Mutex;
use tokio::time::{Duration, Instant};

use super::{BindingStore, StoreError};

/// Nodes whose bindings the sweep checks per hold of the lock.
const SWEEP_NODES_PER_LOCK: usize = 64;

#[derive(Debug)]
struct Binding {
    node: Arc<Node>,
    expires: Instant,
    /// Recorded by RecordAssignment and not yet listed by a roster of its node.
    pending: bool,
}

#[derive(Default)]
struct Inner {
    by_id: HashMap<Arc<str>, Binding>,
    by_node: HashMap<String, HashSet<Arc<str>>>,
    /// When each node's last roster was reconciled.
    last_reconcile: HashMap<String, Instant>,
    /// One shared `Node` per (id, endpoint), so a million bindings do not hold
    /// a million copies of the same strings.
    interned: HashMap<Node, Arc<Node>>,
}

impl Inner {
    fn intern(&mut self, node: &Node) -> Arc<Node> {
        if let Some(n) = self.interned.get(node) {
            return n.clone();
        }
        let n = Arc::new(node.clone());
        self.interned.insert(node.clone(), n.clone());
        n
    }

    fn unlink(&mut self, node_id: &str, id: &str) {
        if let Some(set) = self.by_node.get_mut(node_id) {
            set.remove(id);
            if set.is_empty() {
                self.by_node.remove(node_id);
            }
        }
    }

    fn remove(&mut self, id: &str) {
        if let Some(b) = self.by_id.remove(id) {
            let node_id = b.node.node_id.clone();
            self.unlink(&node_id, id);
        }
    }

    fn bind(&mut self, id: &str, node: Arc<Node>, expires: Instant, pending: bool) {
        // A refresh by the same node (every id of every roster): one lookup;
        // the id is already in that node's set.
        if let Some(b) = self.by_id.get_mut(id)
            && b.node.node_id == node.node_id
        {
            *b = Binding {
                node,
                expires,
                pending,
            };
            return;
        }
        let key: Arc<str> = match self.by_id.get_key_value(id) {
            Some((k, _)) => k.clone(),
            None => Arc::from(id),
        };
        if let Some(old) = self.by_id.get(id)
            && old.node.node_id != node.node_id
        {
            let old_node = old.node.node_id.clone();
            self.unlink(&old_node, id);
        }
        self.by_node
            .entry(node.node_id.clone())
            .or_default()
            .insert(key.clone());
        self.by_id.insert(
            key,
            Binding {
                node,
                expires,
                pending,
            },
        );
    }
}

/// Bindings in process memory.
pub struct MemoryBindingStore {
    ttl: Duration,
    inner: Mutex<Inner>,
}

impl MemoryBindingStore {
    pub fn new(ttl: Duration) -> Self {
        Self {
            ttl,
            inner: Mutex::new(Inner::default()),
        }
    }

    /// Number of bindings held (expired ones not yet swept included).
    pub fn len(&self) -> usize {
        self.inner.lock().by_id.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[async_trait]
impl BindingStore for MemoryBindingStore {
    async fn get(&self, sandbox_id: &str, now: Instant) -> Result<Option<Node>, StoreError> {
        let mut inner = self.inner.lock();
        let Some(b) = inner.by_id.get(sandbox_id) else {
            return Ok(None);
        };
        if b.expires <= now {
            inner.remove(sandbox_id);
            return Ok(None);
        }
        Ok(Some((*b.node).clone()))
    }

    async fn record(&self, sandbox_id: &str, node: &Node, now: Instant) -> Result<(), StoreError> {
        let id = sandbox_id.trim();
        if id.is_empty() {
            return Ok(());
        }
        let mut inner = self.inner.lock();
        let node = inner.intern(node);
        inner.bind(id, node, now + self.ttl, true);
        Ok(())
    }

    async fn reconcile_node(
        &self,
        node: &Node,
        sandbox_ids: &[String],
        now: Instant,
    ) -> Result<(), StoreError> {
        let roster: HashSet<&str> = sandbox_ids
            .iter()
            .map(|s| s.trim())
            .filter(|s| !s.is_empty())
            .collect();
        let mut inner = self.inner.lock();
        let previous = inner.last_reconcile.insert(node.node_id.clone(), now);
        let ttl = self.ttl;
        // Recorded after the previous roster was processed: this roster may
        // have been sampled before the sandbox existed.
        let too_new = |b: &Binding| {
            b.pending && previous.is_none_or(|p| b.expires.checked_sub(ttl).is_some_and(|r| r > p))
        };
        let stale: Vec<Arc<str>> = inner
            .by_node
            .get(&node.node_id)
            .map(|set| {
                set.iter()
                    .filter(|id| !roster.contains(&***id))
                    .cloned()
                    .collect()
            })
            .unwrap_or_default();
        for id in stale {
            match inner.by_id.get(&id) {
                Some(b) if b.node.node_id == node.node_id && too_new(b) => continue,
                Some(b) if b.node.node_id == node.node_id => {
                    inner.by_id.remove(&id);
                }
                _ => {}
            }
            inner.unlink(&node.node_id, &id);
        }
        if roster.is_empty() {
            return Ok(());
        }
        let shared = inner.intern(node);
        let expires = now + self.ttl;
        for id in roster {
            inner.bind(id, shared.clone(), expires, false);
        }
        Ok(())
    }

    async fn forget_node(&self, node_id: &str) -> Result<(), StoreError> {
        let mut inner = self.inner.lock();
        inner.last_reconcile.remove(node_id);
        for id in inner.by_node.remove(node_id).unwrap_or_default() {
            if inner
                .by_id
                .get(&id)
                .is_some_and(|b| b.node.node_id == node_id)
            {
                inner.by_id.remove(&id);
            }
        }
        Ok(())
    }

    async fn sweep_expired(&self, now: Instant) -> Result<usize, StoreError> {
        // Every binding is in its node's set: the sweep walks the nodes a few
        // at a time, so a million bindings never hold up lookups and
        // heartbeats for the whole walk.
        let nodes: Vec<String> = self.inner.lock().by_node.keys().cloned().collect();
        let mut swept = 0;
        for chunk in nodes.chunks(SWEEP_NODES_PER_LOCK) {
            {
                let mut inner = self.inner.lock();
                for node_id in chunk {
                    let held = &*inner;
                    let expired: Vec<Arc<str>> = held
                        .by_node
                        .get(node_id)
                        .map(|set| {
                            set.iter()
                                .filter(|id| {
                                    held.by_id.get(&***id).is_some_and(|b| b.expires <= now)
                                })
                                .cloned()
                                .collect()
                        })
                        .unwrap_or_default();
                    for id in &expired {
                        inner.remove(id);
                    }
                    swept += expired.len();
                }
            }
            tokio::task::yield_now().await;
        }
        let mut inner = self.inner.lock();
        // A node no binding holds any more is held by the intern table only.
        inner.interned.retain(|_, n| Arc::strong_count(n) > 1);
        Ok(swept)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::node;

    fn ids(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    // What every store does (reconcile, moves, the pending rule, forget_node) is pinned
    // for this store and Redis alike in tests/binding_contract.rs; here: time.

    #[tokio::test]
    async fn binding_is_dead_exactly_at_ttl_and_removed() {
        let store = MemoryBindingStore::new(Duration::from_secs(30));
        let t0 = Instant::now();
        store.record("sbx", &node("a"), t0).await.unwrap();
        let just_before = t0 + Duration::from_secs(30) - Duration::from_nanos(1);
        assert_eq!(
            store.get("sbx", just_before).await.unwrap(),
            Some(node("a"))
        );
        assert_eq!(
            store
                .get("sbx", t0 + Duration::from_secs(30))
                .await
                .unwrap(),
            None
        );
        assert_eq!(store.len(), 0, "the expired binding was removed");
    }

    #[tokio::test]
    async fn record_trims_and_ignores_blank_ids() {
        let store = MemoryBindingStore::new(Duration::from_secs(30));
        let t0 = Instant::now();
        store.record("  sbx  ", &node("a"), t0).await.unwrap();
        store.record("   ", &node("a"), t0).await.unwrap();
        assert_eq!(store.len(), 1);
        assert_eq!(store.get("sbx", t0).await.unwrap(), Some(node("a")));
        assert_eq!(
            store.get("  sbx  ", t0).await.unwrap(),
            None,
            "get does not trim"
        );
    }

    #[tokio::test]
    async fn reconcile_refreshes_ttl_to_heartbeat_time() {
        let store = MemoryBindingStore::new(Duration::from_secs(30));
        let t0 = Instant::now();
        store.record("sbx", &node("a"), t0).await.unwrap();
        let t1 = t0 + Duration::from_secs(20);
        store
            .reconcile_node(&node("a"), &ids(&["sbx"]), t1)
            .await
            .unwrap();
        let t2 = t0 + Duration::from_secs(45);
        assert_eq!(store.get("sbx", t2).await.unwrap(), Some(node("a")));
        assert_eq!(
            store
                .get("sbx", t1 + Duration::from_secs(30))
                .await
                .unwrap(),
            None
        );
    }

    #[tokio::test]
    async fn sweep_drops_expired_bindings_only() {
        let store = MemoryBindingStore::new(Duration::from_secs(30));
        let t0 = Instant::now();
        store.record("old", &node("a"), t0).await.unwrap();
        store
            .record("new", &node("b"), t0 + Duration::from_secs(20))
            .await
            .unwrap();
        let swept = store
            .sweep_expired(t0 + Duration::from_secs(31))
            .await
            .unwrap();
        assert_eq!(swept, 1);
        assert_eq!(store.len(), 1);
        assert_eq!(store.inner.lock().interned.len(), 1);
        assert!(!store.inner.lock().by_node.contains_key("a"));
    }

    #[tokio::test]
    async fn sweep_in_turns_reaches_every_node_and_drops_only_expired_bindings() {
        let store = MemoryBindingStore::new(Duration::from_secs(30));
        let t0 = Instant::now();
        let nodes = 3 * SWEEP_NODES_PER_LOCK + 1;
        for i in 0..nodes {
            let n = node(&format!("n{i}"));
            store
                .reconcile_node(&n, &ids(&[&format!("old{i}")]), t0)
                .await
                .unwrap();
            store
                .record(&format!("new{i}"), &n, t0 + Duration::from_secs(20))
                .await
                .unwrap();
        }
        let swept = store
            .sweep_expired(t0 + Duration::from_secs(31))
            .await
            .unwrap();
        assert_eq!(swept, nodes, "every node's expired binding, none else");
        assert_eq!(store.len(), nodes);
        let later = t0 + Duration::from_secs(31);
        for i in 0..nodes {
            assert_eq!(store.get(&format!("old{i}"), later).await.unwrap(), None);
            assert!(
                store
                    .get(&format!("new{i}"), later)
                    .await
                    .unwrap()
                    .is_some()
            );
        }
    }
}
