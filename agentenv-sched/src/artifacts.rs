//! The P2P artifact index: which nodes hold a copy of an artifact, keyed by
//! (cluster, backend, key), kept in memory with an LRU bound on distinct keys.

use std::collections::{HashMap, HashSet};
use std::num::NonZeroUsize;

use lru::LruCache;

/// An artifact's identity.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ArtifactKey {
    pub cluster_id: String,
    pub backend: String,
    pub key: String,
}

/// Providers per artifact, bounded by the number of distinct artifacts.
pub struct ArtifactStore {
    providers: LruCache<ArtifactKey, HashSet<String>>,
    by_node: HashMap<String, HashSet<ArtifactKey>>,
    lookup_limit: usize,
}

impl ArtifactStore {
    /// `capacity` distinct keys at most; `lookup_limit` ≤ 0 means no limit.
    pub fn new(capacity: NonZeroUsize, lookup_limit: i64) -> Self {
        Self {
            providers: LruCache::new(capacity),
            by_node: HashMap::new(),
            lookup_limit: usize::try_from(lookup_limit).unwrap_or(0),
        }
    }

    /// Adds `node_id` as a provider of `key`, refreshing the key's recency.
    pub fn record(&mut self, key: ArtifactKey, node_id: &str) {
        if let Some(set) = self.providers.get_mut(&key) {
            set.insert(node_id.to_string());
        } else {
            let mut set = HashSet::new();
            set.insert(node_id.to_string());
            if let Some((evicted, nodes)) = self.providers.push(key.clone(), set)
                && evicted != key
            {
                for n in nodes {
                    self.unlink(&n, &evicted);
                }
            }
        }
        self.by_node
            .entry(node_id.to_string())
            .or_default()
            .insert(key);
    }

    /// Removes one provider; the key goes when it has none left.
    pub fn forget(&mut self, key: &ArtifactKey, node_id: &str) {
        if let Some(set) = self.providers.peek_mut(key) {
            set.remove(node_id);
            if set.is_empty() {
                self.providers.pop(key);
            }
        }
        self.unlink(node_id, key);
    }

    /// Removes a node from every artifact.
    pub fn forget_node(&mut self, node_id: &str) {
        for key in self.by_node.remove(node_id).unwrap_or_default() {
            if let Some(set) = self.providers.peek_mut(&key) {
                set.remove(node_id);
                if set.is_empty() {
                    self.providers.pop(&key);
                }
            }
        }
    }

    /// Providers of `key` (at most the lookup limit), refreshing its recency.
    pub fn lookup(&mut self, key: &ArtifactKey) -> Vec<String> {
        let limit = self.lookup_limit;
        self.providers
            .get(key)
            .map(|set| {
                let it = set.iter().cloned();
                if limit > 0 {
                    it.take(limit).collect()
                } else {
                    it.collect()
                }
            })
            .unwrap_or_default()
    }

    /// Number of distinct keys held.
    pub fn len(&self) -> usize {
        self.providers.len()
    }

    pub fn is_empty(&self) -> bool {
        self.providers.is_empty()
    }

    fn unlink(&mut self, node_id: &str, key: &ArtifactKey) {
        if let Some(keys) = self.by_node.get_mut(node_id) {
            keys.remove(key);
            if keys.is_empty() {
                self.by_node.remove(node_id);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(k: &str) -> ArtifactKey {
        ArtifactKey {
            cluster_id: "c".into(),
            backend: "b".into(),
            key: k.into(),
        }
    }

    fn store(cap: usize, limit: i64) -> ArtifactStore {
        ArtifactStore::new(NonZeroUsize::new(cap).unwrap(), limit)
    }

    fn sorted(mut v: Vec<String>) -> Vec<String> {
        v.sort();
        v
    }

    #[test]
    fn record_forget_and_forget_node() {
        let mut s = store(10, 0);
        s.record(key("k1"), "a");
        s.record(key("k1"), "b");
        s.record(key("k2"), "a");
        assert_eq!(sorted(s.lookup(&key("k1"))), ["a", "b"]);
        s.forget(&key("k1"), "a");
        assert_eq!(s.lookup(&key("k1")), ["b"]);
        s.forget_node("a");
        assert!(s.lookup(&key("k2")).is_empty());
        assert_eq!(s.len(), 1, "k2 lost its only provider");
    }

    #[test]
    fn capacity_counts_keys_not_providers_and_lru_evicts_whole_key() {
        let mut s = store(2, 0);
        s.record(key("k1"), "a");
        s.record(key("k1"), "b");
        s.record(key("k1"), "c");
        s.record(key("k2"), "a");
        assert_eq!(s.len(), 2);
        s.lookup(&key("k1")); // k1 is now the most recent
        s.record(key("k3"), "a");
        assert_eq!(s.len(), 2);
        assert!(
            s.lookup(&key("k2")).is_empty(),
            "k2 was least recently used"
        );
        assert_eq!(s.lookup(&key("k1")).len(), 3);
        assert!(
            !s.by_node["a"].contains(&key("k2")),
            "reverse index cleaned"
        );
    }

    #[test]
    fn record_refreshes_recency() {
        let mut s = store(2, 0);
        s.record(key("k1"), "a");
        s.record(key("k2"), "a");
        s.record(key("k1"), "b");
        s.record(key("k3"), "a");
        assert!(!s.lookup(&key("k1")).is_empty());
        assert!(s.lookup(&key("k2")).is_empty());
    }

    #[test]
    fn forget_frees_capacity() {
        let mut s = store(2, 0);
        s.record(key("k1"), "a");
        s.record(key("k2"), "a");
        s.forget(&key("k1"), "a");
        s.record(key("k3"), "a");
        assert_eq!(s.lookup(&key("k2")), ["a"]);
        assert_eq!(s.lookup(&key("k3")), ["a"]);
        s.forget_node("a");
        assert!(s.is_empty());
    }

    #[test]
    fn lookup_limit_caps_the_count_and_non_positive_means_all() {
        let mut s = store(10, 2);
        for n in ["a", "b", "c"] {
            s.record(key("k"), n);
        }
        assert_eq!(s.lookup(&key("k")).len(), 2);
        for limit in [0, -1] {
            let mut s = store(10, limit);
            for n in ["a", "b", "c"] {
                s.record(key("k"), n);
            }
            assert_eq!(s.lookup(&key("k")).len(), 3);
        }
    }
}
