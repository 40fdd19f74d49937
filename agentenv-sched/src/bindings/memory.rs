//! Bindings in process memory: a map of id → node plus, per node, the set of
//! its ids. Expired entries go on lookup and on the periodic sweep.
//!
//! A binding recorded by RecordAssignment and not yet listed by its node
//! expires on its own; every other binding of a node was listed by the node's
//! last roster and expires with it. A roster that lists exactly what the
//! node's last one did (the common heartbeat) is recognised by a digest of
//! its ids and costs one map update, not one per sandbox.

use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasher, RandomState};
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
    /// When a pending binding expires (a listed one expires with its node's roster).
    expires: Instant,
    /// Recorded by RecordAssignment and not yet listed by a roster of its node.
    pending: bool,
}

/// A roster's ids, order and repetition aside: their count and two sums of
/// keyed 64-bit hashes. Two different rosters share one only by a collision
/// of both keyed hashes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Digest {
    count: usize,
    sums: (u64, u64),
}

/// One node's bindings.
#[derive(Debug)]
struct NodeBindings {
    ids: HashSet<Arc<str>>,
    /// When the bindings its last roster listed expire.
    listed_until: Instant,
    /// Set while `ids` is exactly the last roster, every binding listed (none
    /// pending) and owned by `owner`: the same roster again changes nothing
    /// but `listed_until`.
    roster: Option<(Digest, Arc<Node>)>,
}

impl NodeBindings {
    fn new(now: Instant) -> Self {
        Self {
            ids: HashSet::new(),
            listed_until: now,
            roster: None,
        }
    }
}

#[derive(Default)]
struct Inner {
    by_id: HashMap<Arc<str>, Binding>,
    by_node: HashMap<String, NodeBindings>,
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

    /// When `b` expires.
    fn expiry(&self, b: &Binding) -> Instant {
        if b.pending {
            return b.expires;
        }
        self.by_node
            .get(&b.node.node_id)
            .map_or(b.expires, |n| n.listed_until)
    }

    fn unlink(&mut self, node_id: &str, id: &str) {
        if let Some(n) = self.by_node.get_mut(node_id) {
            n.ids.remove(id);
            n.roster = None;
            if n.ids.is_empty() {
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

    /// Binds `id`; whether the owner, its endpoint or the pending mark changed
    /// (not just the expiry).
    fn bind(&mut self, id: &str, node: Arc<Node>, expires: Instant, pending: bool) -> bool {
        // A refresh by the same node (every id of every roster): one lookup;
        // the id is already in that node's set.
        if let Some(b) = self.by_id.get_mut(id)
            && (Arc::ptr_eq(&b.node, &node) || b.node.node_id == node.node_id)
        {
            let changed = b.pending != pending || !Arc::ptr_eq(&b.node, &node);
            *b = Binding {
                node,
                expires,
                pending,
            };
            if pending && let Some(n) = self.by_node.get_mut(&b.node.node_id) {
                n.roster = None;
            }
            return changed;
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
        let set = self
            .by_node
            .entry(node.node_id.clone())
            .or_insert_with(|| NodeBindings::new(expires));
        set.ids.insert(key.clone());
        set.roster = None;
        self.by_id.insert(
            key,
            Binding {
                node,
                expires,
                pending,
            },
        );
        true
    }
}

/// Bindings in process memory.
pub struct MemoryBindingStore {
    ttl: Duration,
    inner: Mutex<Inner>,
    /// The keys of the roster digests.
    keys: (RandomState, RandomState),
}

impl MemoryBindingStore {
    pub fn new(ttl: Duration) -> Self {
        Self {
            ttl,
            inner: Mutex::new(Inner::default()),
            keys: (RandomState::new(), RandomState::new()),
        }
    }

    fn digest<'a>(&self, ids: impl Iterator<Item = &'a str>) -> Digest {
        let mut d = Digest {
            count: 0,
            sums: (0, 0),
        };
        for id in ids {
            d.count += 1;
            d.sums.0 = d.sums.0.wrapping_add(self.keys.0.hash_one(id));
            d.sums.1 = d.sums.1.wrapping_add(self.keys.1.hash_one(id));
        }
        d
    }

    /// Makes `sandbox_ids` the node's roster; whether any binding other than
    /// an expiry changed (one added, moved, dropped, kept as pending, or no
    /// longer pending, or the node's endpoint).
    pub(super) fn reconcile(&self, node: &Node, sandbox_ids: &[String], now: Instant) -> bool {
        let listed = sandbox_ids
            .iter()
            .map(|s| s.trim())
            .filter(|s| !s.is_empty());
        // Duplicates make a different digest: such a roster takes the long way.
        let digest = self.digest(listed.clone());
        let mut inner = self.inner.lock();
        let previous = match inner.last_reconcile.get_mut(&node.node_id) {
            Some(at) => Some(std::mem::replace(at, now)),
            None => inner.last_reconcile.insert(node.node_id.clone(), now),
        };
        let ttl = self.ttl;
        if digest.count > 0
            && let Some(n) = inner.by_node.get_mut(&node.node_id)
            && let Some((last, owner)) = &n.roster
            && *last == digest
            && owner.endpoint == node.endpoint
        {
            n.listed_until = now + ttl;
            return false;
        }
        let roster: HashSet<&str> = listed.collect();
        // Recorded after the previous roster was processed: this roster may
        // have been sampled before the sandbox existed.
        let too_new = |b: &Binding| {
            b.pending && previous.is_none_or(|p| b.expires.checked_sub(ttl).is_some_and(|r| r > p))
        };
        let stale: Vec<Arc<str>> = inner
            .by_node
            .get(&node.node_id)
            .map(|n| {
                n.ids
                    .iter()
                    .filter(|id| !roster.contains(&***id))
                    .cloned()
                    .collect()
            })
            .unwrap_or_default();
        let mut changed = !stale.is_empty();
        let mut kept = 0;
        for id in stale {
            match inner.by_id.get(&id) {
                Some(b) if b.node.node_id == node.node_id && too_new(b) => {
                    kept += 1;
                    continue;
                }
                Some(b) if b.node.node_id == node.node_id => {
                    inner.by_id.remove(&id);
                }
                _ => {}
            }
            inner.unlink(&node.node_id, &id);
        }
        if roster.is_empty() {
            return changed;
        }
        let shared = inner.intern(node);
        let expires = now + ttl;
        for id in &roster {
            changed |= inner.bind(id, shared.clone(), expires, false);
        }
        if let Some(n) = inner.by_node.get_mut(&node.node_id) {
            n.listed_until = expires;
            n.roster = (kept == 0 && digest.count == roster.len()).then_some((digest, shared));
        }
        changed
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
        if inner.expiry(b) <= now {
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
        self.reconcile(node, sandbox_ids, now);
        Ok(())
    }

    async fn forget_node(&self, node_id: &str) -> Result<(), StoreError> {
        let mut inner = self.inner.lock();
        inner.last_reconcile.remove(node_id);
        let ids = inner.by_node.remove(node_id).map(|n| n.ids);
        for id in ids.unwrap_or_default() {
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
                    let Some(n) = held.by_node.get(node_id) else {
                        continue;
                    };
                    // Every binding listed and the roster still alive: nothing to drop.
                    if n.roster.is_some() && n.listed_until > now {
                        continue;
                    }
                    let expired: Vec<Arc<str>> = n
                        .ids
                        .iter()
                        .filter(|id| {
                            held.by_id
                                .get(&***id)
                                .is_some_and(|b| held.expiry(b) <= now)
                        })
                        .cloned()
                        .collect();
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
    async fn the_same_roster_again_changes_nothing_but_the_expiry() {
        let store = MemoryBindingStore::new(Duration::from_secs(30));
        let t0 = Instant::now();
        let at = |s| t0 + Duration::from_secs(s);
        assert!(store.reconcile(&node("a"), &ids(&["s1", "s2"]), t0));
        // Another order, blanks, padding, a repeated id: the same roster.
        assert!(!store.reconcile(&node("a"), &ids(&["s2", " ", " s1"]), at(10)));
        assert!(!store.reconcile(&node("a"), &ids(&["s1", "s2", "s1"]), at(20)));
        assert!(store.reconcile(&node("a"), &ids(&["s1", "s3"]), at(21)));
        assert!(!store.reconcile(&node("a"), &ids(&["s3", "s1"]), at(22)));
        let moved = Node {
            endpoint: "http://10.9.9.9:1".into(),
            ..node("a")
        };
        assert!(store.reconcile(&moved, &ids(&["s1", "s3"]), at(23)));
        assert!(!store.reconcile(&moved, &ids(&["s1", "s3"]), at(24)));
        assert_eq!(store.get("s2", at(24)).await.unwrap(), None);
        assert_eq!(store.get("s3", at(53)).await.unwrap(), Some(moved));
        assert_eq!(store.get("s1", at(54)).await.unwrap(), None);
    }

    #[tokio::test]
    async fn a_record_between_two_equal_rosters_is_listed_again_by_the_second() {
        let store = MemoryBindingStore::new(Duration::from_secs(30));
        let t0 = Instant::now();
        let at = |s| t0 + Duration::from_secs(s);
        store.reconcile(&node("a"), &ids(&["x"]), t0);
        store.record("x", &node("a"), at(1)).await.unwrap();
        assert!(store.reconcile(&node("a"), &ids(&["x"]), at(20)));
        assert!(!store.reconcile(&node("a"), &ids(&["x"]), at(40)));
        // Listed at 40: alive until 70, not 31 as the record alone would say.
        assert_eq!(store.get("x", at(65)).await.unwrap(), Some(node("a")));
        // A binding moved away makes the next equal roster take the long way.
        store.record("x", &node("b"), at(66)).await.unwrap();
        assert!(store.reconcile(&node("a"), &ids(&["x"]), at(67)));
        assert_eq!(store.get("x", at(68)).await.unwrap(), Some(node("a")));
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
