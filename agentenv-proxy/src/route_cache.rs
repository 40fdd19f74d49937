//! The gateway's memory of which node holds which sandbox, so the requests of a busy
//! sandbox do not each ask the scheduler (`LookupNode`).
//!
//! A route is remembered for `ttl` after the gateway learnt it: from a lookup, or from
//! the create, resume or move that placed the sandbox through this gateway (which also
//! records it at the scheduler). It is forgotten at once when a delete of the sandbox
//! passes through this gateway, and when its node answers a request for it with a
//! server error or cannot be reached (a sandbox another gateway moved, a node that
//! went away): the next request asks the scheduler again. What another gateway or the
//! scheduler changed is seen within `ttl`. Lookups the scheduler answers with an error
//! (not found included) are never remembered. At most `capacity` routes are kept,
//! the least recently used going first.

use std::num::NonZeroUsize;
use std::time::Duration;

use agentenv_core::proto::scheduler_v1 as pb;
use lru::LruCache;
use parking_lot::Mutex;
use tokio::time::Instant;

/// Routes kept at most by default (a few MiB at the largest).
pub const DEFAULT_CAPACITY: usize = 65_536;

/// Remembered routes (see the module documentation).
pub struct RouteCache {
    ttl: Duration,
    routes: Mutex<LruCache<Box<str>, (pb::Node, Instant)>>,
}

impl RouteCache {
    /// Routes kept for `ttl`, at most `capacity` of them; `None` when `ttl` is zero
    /// (every request asks the scheduler).
    pub fn new(ttl: Duration, capacity: usize) -> Option<Self> {
        if ttl.is_zero() {
            return None;
        }
        let capacity = NonZeroUsize::new(capacity).unwrap_or(NonZeroUsize::MIN);
        Some(Self {
            ttl,
            routes: Mutex::new(LruCache::new(capacity)),
        })
    }

    /// The node of `sandbox_id`, when learnt less than `ttl` ago.
    pub fn get(&self, sandbox_id: &str) -> Option<pb::Node> {
        let mut routes = self.routes.lock();
        match routes.get(sandbox_id) {
            Some((node, at)) if at.elapsed() < self.ttl => Some(node.clone()),
            Some(_) => {
                routes.pop(sandbox_id);
                None
            }
            None => None,
        }
    }

    /// Remembers that `node` holds `sandbox_id`, from now.
    pub fn put(&self, sandbox_id: &str, node: &pb::Node) {
        self.routes
            .lock()
            .put(sandbox_id.into(), (node.clone(), Instant::now()));
    }

    /// Forgets `sandbox_id`'s route.
    pub fn forget(&self, sandbox_id: &str) {
        self.routes.lock().pop(sandbox_id);
    }

    /// Routes held (expired ones included until they are asked for or pushed out).
    pub fn len(&self) -> usize {
        self.routes.lock().len()
    }

    /// Whether no route is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(id: &str) -> pb::Node {
        pb::Node {
            node_id: id.into(),
            endpoint: format!("http://{id}.example:5007"),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_route_is_kept_for_its_ttl_then_asked_again() {
        let cache = RouteCache::new(Duration::from_secs(1), 16).unwrap();
        assert!(cache.get("sbx-a").is_none());
        cache.put("sbx-a", &node("n1"));
        assert_eq!(cache.get("sbx-a").unwrap().node_id, "n1");
        tokio::time::advance(Duration::from_millis(999)).await;
        assert_eq!(cache.get("sbx-a").unwrap().node_id, "n1");
        tokio::time::advance(Duration::from_millis(1)).await;
        assert!(cache.get("sbx-a").is_none());
        assert!(
            cache.is_empty(),
            "an expired route is dropped when asked for"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_newer_route_replaces_the_old_one_and_restarts_its_ttl() {
        let cache = RouteCache::new(Duration::from_secs(1), 16).unwrap();
        cache.put("sbx-a", &node("n1"));
        tokio::time::advance(Duration::from_millis(900)).await;
        cache.put("sbx-a", &node("n2"));
        tokio::time::advance(Duration::from_millis(900)).await;
        assert_eq!(cache.get("sbx-a").unwrap().node_id, "n2");
    }

    #[test]
    fn forget_drops_a_route_and_capacity_bounds_the_routes() {
        let cache = RouteCache::new(Duration::from_secs(60), 2).unwrap();
        cache.put("a", &node("n1"));
        cache.put("b", &node("n1"));
        cache.forget("a");
        assert!(cache.get("a").is_none());
        cache.put("c", &node("n2"));
        cache.put("d", &node("n2"));
        assert_eq!(cache.len(), 2);
        assert!(
            cache.get("b").is_none(),
            "the least recently used went first"
        );
        assert_eq!(cache.get("d").unwrap().node_id, "n2");
    }

    #[test]
    fn a_zero_ttl_turns_the_cache_off() {
        assert!(RouteCache::new(Duration::ZERO, 16).is_none());
    }
}
