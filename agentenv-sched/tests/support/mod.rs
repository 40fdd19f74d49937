//! What the scheduler's integration tests share.

#![allow(dead_code)]

use agentenv_core::config::{NodeConfig, SchedulerConfig};
use agentenv_core::proto::scheduler_v1::{HeartbeatRequest, Node, NodeSnapshot, NodeStatus};

/// Node `id` at `http://<id>:8000`.
pub fn node(id: &str) -> Node {
    Node {
        node_id: id.into(),
        endpoint: format!("http://{id}:8000"),
    }
}

/// A scheduler config listing nodes `ids` (see [`node`]), defaults otherwise.
pub fn config(ids: &[&str]) -> SchedulerConfig {
    SchedulerConfig {
        nodes: ids
            .iter()
            .map(|id| NodeConfig {
                id: id.to_string(),
                endpoint: node(id).endpoint,
            })
            .collect(),
        ..SchedulerConfig::default()
    }
}

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
