//! Sandbox → node bindings with a TTL.
//!
//! A binding is created or refreshed by RecordAssignment and by every
//! heartbeat whose roster lists the sandbox; it is removed when its owner's
//! roster omits it, when the owner unregisters, and when it expires. Recording
//! or reconciling an id under another node moves it there.
//!
//! A node samples its roster before sending it, so a heartbeat can arrive just
//! after the RecordAssignment of a sandbox the roster was sampled too early to
//! list. A binding recorded by RecordAssignment after the node's previous
//! heartbeat was processed is therefore kept when that node's next roster
//! omits it; the heartbeat after that decides.
//!
//! Two stores: [`MemoryBindingStore`] (one scheduler, bindings lost on
//! restart) and [`RedisBindingStore`] (shared by a primary and its query-only
//! replicas, surviving restarts, in the key layout other AgentENV schedulers
//! use). A primary on Redis uses [`MirroredRedisStore`]: Redis plus a copy in
//! memory of what it wrote, which answers its lookups.

mod memory;
mod mirrored;
mod redis;

use agentenv_core::proto::scheduler_v1::Node;
use async_trait::async_trait;
use tokio::time::Instant;

pub use self::memory::MemoryBindingStore;
pub use self::mirrored::MirroredRedisStore;
pub use self::redis::{
    BINDINGS_PREFIX, NODE_SET_TTL, OP_TIMEOUT, PENDING_PREFIX, RedisBindingStore,
};

/// The binding store could not answer (e.g. Redis is down or too slow).
#[derive(Debug, thiserror::Error)]
#[error("binding store unavailable: {0}")]
pub struct StoreError(pub String);

/// Where bindings live. A store that can fail logs when its failures start
/// and end; the service answers each failed call with UNAVAILABLE
/// `binding store unavailable` and logs it at debug level only.
#[async_trait]
pub trait BindingStore: Send + Sync + 'static {
    /// The node bound to `sandbox_id`, if the binding exists and has not expired.
    async fn get(&self, sandbox_id: &str, now: Instant) -> Result<Option<Node>, StoreError>;

    /// Binds `sandbox_id` to `node` (moving it from any other node).
    async fn record(&self, sandbox_id: &str, node: &Node, now: Instant) -> Result<(), StoreError>;

    /// Makes `sandbox_ids` the complete set of sandboxes bound to `node`
    /// (a heartbeat's roster).
    async fn reconcile_node(
        &self,
        node: &Node,
        sandbox_ids: &[String],
        now: Instant,
    ) -> Result<(), StoreError>;

    /// Drops every binding owned by the node (it unregistered).
    async fn forget_node(&self, node_id: &str) -> Result<(), StoreError>;

    /// Drops expired bindings. Stores that expire on their own do nothing.
    async fn sweep_expired(&self, _now: Instant) -> Result<usize, StoreError> {
        Ok(0)
    }
}
