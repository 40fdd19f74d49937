//! What the scheduler's integration tests share.

use agentenv_core::proto::scheduler_v1::{HeartbeatRequest, NodeSnapshot, NodeStatus};

/// A ready node `id`'s heartbeat listing `sandboxes`.
pub fn beat(id: &str, sandboxes: &[&str]) -> HeartbeatRequest {
    HeartbeatRequest {
        node_id: id.into(),
        cluster_id: "cluster-1".into(),
        service_instance_id: format!("{id}-instance"),
        version: "1.0.0".into(),
        snapshot: Some(NodeSnapshot {
            status: NodeStatus::Ready as i32,
            sandbox_count: sandboxes.len() as u32,
            ..Default::default()
        }),
        sandbox_ids: sandboxes.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    }
}
