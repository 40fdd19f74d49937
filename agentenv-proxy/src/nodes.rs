//! The JSON shape of `GET /nodes`.

use agentenv_core::proto::scheduler_v1 as pb;
use serde::Serialize;

#[derive(Debug, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct MachineInfo {
    pub cpu_family: String,
    pub cpu_model: String,
    pub cpu_model_name: String,
    pub cpu_architecture: String,
}

#[derive(Debug, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Disk {
    pub mount_point: String,
    pub device: String,
    pub filesystem_type: String,
    pub used_bytes: u64,
    pub total_bytes: u64,
}

#[derive(Debug, Serialize, PartialEq)]
pub struct Metrics {
    #[serde(rename = "allocatedCPU")]
    pub allocated_cpu: u32,
    #[serde(rename = "allocatedMemoryBytes")]
    pub allocated_memory_bytes: u64,
    #[serde(rename = "cpuPercent")]
    pub cpu_percent: u32,
    #[serde(rename = "cpuCount")]
    pub cpu_count: u32,
    #[serde(rename = "memoryUsedBytes")]
    pub memory_used_bytes: u64,
    #[serde(rename = "memoryTotalBytes")]
    pub memory_total_bytes: u64,
    pub disks: Vec<Disk>,
    #[serde(rename = "pausedAllocatedCPU")]
    pub paused_allocated_cpu: u32,
    #[serde(rename = "pausedAllocatedMemoryBytes")]
    pub paused_allocated_memory_bytes: u64,
    #[serde(rename = "pooledAllocatedCPU")]
    pub pooled_allocated_cpu: u32,
    #[serde(rename = "pooledAllocatedMemoryBytes")]
    pub pooled_allocated_memory_bytes: u64,
}

/// One node of `GET /nodes`.
#[derive(Debug, Serialize, PartialEq)]
pub struct NodeView {
    pub version: String,
    pub commit: String,
    pub id: String,
    #[serde(rename = "serviceInstanceID")]
    pub service_instance_id: String,
    #[serde(rename = "clusterID")]
    pub cluster_id: String,
    #[serde(rename = "machineInfo")]
    pub machine_info: MachineInfo,
    pub status: &'static str,
    #[serde(rename = "sandboxCount")]
    pub sandbox_count: u32,
    pub metrics: Metrics,
    #[serde(rename = "createSuccesses")]
    pub create_successes: u64,
    #[serde(rename = "createFails")]
    pub create_fails: u64,
    #[serde(rename = "sandboxStartingCount")]
    pub sandbox_starting_count: u32,
    #[serde(rename = "sandboxPausedCount")]
    pub sandbox_paused_count: u32,
    /// Started sandboxes the node keeps ready for creates (not in `sandboxCount`).
    #[serde(rename = "sandboxPooledCount")]
    pub sandbox_pooled_count: u32,
    /// The pooled sandboxes per template (as a create names it); templates with none
    /// are left out.
    #[serde(rename = "sandboxPooledByTemplate")]
    pub sandbox_pooled_by_template: std::collections::BTreeMap<String, u32>,
    /// When the scheduler took the node's last heartbeat (Unix milliseconds).
    #[serde(rename = "lastHeartbeatUnixMs")]
    pub last_heartbeat_unix_ms: i64,
}

/// `ready`, `connecting`, `unhealthy`, `draining`; anything else
/// (lingering included) is `unspecified`.
pub fn status_name(status: i32) -> &'static str {
    match pb::NodeStatus::try_from(status) {
        Ok(pb::NodeStatus::Ready) => "ready",
        Ok(pb::NodeStatus::Connecting) => "connecting",
        Ok(pb::NodeStatus::Unhealthy) => "unhealthy",
        Ok(pb::NodeStatus::Draining) => "draining",
        _ => "unspecified",
    }
}

impl From<&pb::ObservedNode> for NodeView {
    fn from(n: &pb::ObservedNode) -> Self {
        let mi = n.machine_info.clone().unwrap_or_default();
        let s = n.snapshot.clone().unwrap_or_default();
        Self {
            version: n.version.clone(),
            commit: n.commit.clone(),
            id: n.node_id.clone(),
            service_instance_id: n.service_instance_id.clone(),
            cluster_id: n.cluster_id.clone(),
            machine_info: MachineInfo {
                cpu_family: mi.cpu_family,
                cpu_model: mi.cpu_model,
                cpu_model_name: mi.cpu_model_name,
                cpu_architecture: mi.cpu_architecture,
            },
            status: status_name(s.status),
            sandbox_count: s.sandbox_count,
            metrics: Metrics {
                allocated_cpu: s.allocated_cpu,
                allocated_memory_bytes: s.allocated_memory_bytes,
                cpu_percent: s.cpu_percent,
                cpu_count: s.cpu_count,
                memory_used_bytes: s.memory_used_bytes,
                memory_total_bytes: s.memory_total_bytes,
                disks: s
                    .disks
                    .into_iter()
                    .map(|d| Disk {
                        mount_point: d.mount_point,
                        device: d.device,
                        filesystem_type: d.filesystem_type,
                        used_bytes: d.used_bytes,
                        total_bytes: d.total_bytes,
                    })
                    .collect(),
                paused_allocated_cpu: s.paused_allocated_cpu,
                paused_allocated_memory_bytes: s.paused_allocated_memory_bytes,
                pooled_allocated_cpu: s.pooled_allocated_cpu,
                pooled_allocated_memory_bytes: s.pooled_allocated_memory_bytes,
            },
            create_successes: s.create_successes,
            create_fails: s.create_fails,
            sandbox_starting_count: s.sandbox_starting_count,
            sandbox_paused_count: s.paused_sandbox_count,
            sandbox_pooled_count: s.pooled_sandbox_count,
            sandbox_pooled_by_template: s.pooled_by_template.into_iter().collect(),
            last_heartbeat_unix_ms: n.last_seen_unix_ms,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lingering_is_reported_as_unspecified_and_draining_by_name() {
        assert_eq!(status_name(pb::NodeStatus::Ready as i32), "ready");
        assert_eq!(status_name(pb::NodeStatus::Connecting as i32), "connecting");
        assert_eq!(status_name(pb::NodeStatus::Unhealthy as i32), "unhealthy");
        assert_eq!(status_name(pb::NodeStatus::Lingering as i32), "unspecified");
        assert_eq!(status_name(pb::NodeStatus::Draining as i32), "draining");
        assert_eq!(status_name(99), "unspecified");
    }

    #[test]
    fn a_node_view_has_the_documented_keys() {
        let n = pb::ObservedNode {
            node_id: "node-a".into(),
            snapshot: Some(pb::NodeSnapshot {
                status: pb::NodeStatus::Ready as i32,
                sandbox_count: 2,
                ..Default::default()
            }),
            ..Default::default()
        };
        let v = serde_json::to_value(NodeView::from(&n)).unwrap();
        assert_eq!(v["id"], "node-a");
        assert_eq!(v["status"], "ready");
        assert_eq!(v["sandboxCount"], 2);
        for k in [
            "version",
            "commit",
            "serviceInstanceID",
            "clusterID",
            "machineInfo",
            "metrics",
            "createSuccesses",
            "createFails",
            "sandboxStartingCount",
            "sandboxPausedCount",
            "sandboxPooledCount",
            "sandboxPooledByTemplate",
            "lastHeartbeatUnixMs",
        ] {
            assert!(v.get(k).is_some(), "{k}");
        }
        assert!(v["metrics"]["disks"].is_array());
        assert!(v["machineInfo"].get("cpuModelName").is_some());
    }
}
