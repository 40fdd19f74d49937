//! What readers of the registry ask for: the derived status of a node, and
//! which P2P peers a query selects.

use std::collections::HashSet;

use agentenv_core::proto::scheduler_v1::NodeStatus;
use tokio::time::{Duration, Instant};

/// Derives a node's status from discovery and heartbeat age.
pub fn derive_status(
    last_seen: Instant,
    reported: i32,
    discovered: bool,
    lingering: bool,
    report_ttl: Duration,
    now: Instant,
) -> NodeStatus {
    if now.saturating_duration_since(last_seen) > report_ttl {
        NodeStatus::Unhealthy
    } else if !discovered {
        NodeStatus::Connecting
    } else if lingering {
        NodeStatus::Lingering
    } else {
        match NodeStatus::try_from(reported).unwrap_or(NodeStatus::Unspecified) {
            NodeStatus::Unspecified => NodeStatus::Connecting,
            s => s,
        }
    }
}

/// Which P2P peers [`super::NodeRegistry::p2p_peers`] returns. Blank strings select
/// everything (after trimming).
#[derive(Debug, Clone, Copy, Default)]
pub struct P2pQuery<'a> {
    /// Only nodes of this cluster.
    pub cluster_id: &'a str,
    /// Only endpoints for this backend.
    pub backend: &'a str,
    /// Not this node.
    pub exclude_node_id: &'a str,
    /// Only these nodes, when set.
    pub only: Option<&'a HashSet<String>>,
}

impl<'a> P2pQuery<'a> {
    /// Peers of `cluster_id` for `backend`, except `exclude_node_id`.
    pub fn new(cluster_id: &'a str, backend: &'a str, exclude_node_id: &'a str) -> Self {
        Self {
            cluster_id,
            backend,
            exclude_node_id,
            only: None,
        }
    }

    /// Restricts the peers to `nodes`.
    pub fn only(self, nodes: &'a HashSet<String>) -> Self {
        Self {
            only: Some(nodes),
            ..self
        }
    }
}
