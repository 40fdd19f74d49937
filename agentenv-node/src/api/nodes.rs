//! `GET /nodes` and `GET /nodes/{id}`: this node, its sandbox counts and its host.

use http::{Request, StatusCode};
use hyper::body::Incoming;

use super::ApiState;
use super::body::{json_response, query_pairs};
use super::error::Reply;
use crate::dataplane::json_error;
use crate::reporter::CpuModel;

/// `GET /nodes`: this node, unless `clusterID` names another cluster.
pub(super) fn list(state: &ApiState, req: &Request<Incoming>) -> Reply {
    let q = query_pairs(req.uri().query().unwrap_or(""));
    if let Some(c) = q.get("clusterID")
        && c != &state.identity.cluster_id
    {
        return Ok(json_response(
            StatusCode::OK,
            &Vec::<serde_json::Value>::new(),
        ));
    }
    Ok(json_response(
        StatusCode::OK,
        &vec![node_json(state, false)],
    ))
}

/// `GET /nodes/{id}`.
pub(super) fn get(state: &ApiState, id: &str) -> Reply {
    if id != state.identity.node_id {
        return Err(json_error(StatusCode::NOT_FOUND, format!("node {id} not found")).into());
    }
    Ok(json_response(StatusCode::OK, &node_json(state, true)))
}

/// `machineInfo` of `GET /nodes`, from the first processor of `/proc/cpuinfo`.
pub(super) fn machine_info() -> serde_json::Value {
    let cpu = CpuModel::read();
    serde_json::json!({
        "cpuFamily": cpu.family.unwrap_or_default(),
        "cpuModel": cpu.model.unwrap_or_default(),
        "cpuModelName": cpu.name.unwrap_or_default(),
        "cpuArchitecture": std::env::consts::ARCH,
    })
}

fn node_json(state: &ApiState, detail: bool) -> serde_json::Value {
    let u = state.orch.usage();
    let host = state.host.sample();
    let disks: Vec<serde_json::Value> = host
        .disks
        .iter()
        .map(|d| {
            serde_json::json!({
                "mountPoint": d.mount_point,
                "device": d.device,
                "filesystemType": d.filesystem_type,
                "usedBytes": d.used_bytes,
                "totalBytes": d.total_bytes,
            })
        })
        .collect();
    let id = &state.identity;
    let mut v = serde_json::json!({
        "id": id.node_id,
        "nodeID": id.node_id,
        "serviceInstanceID": id.service_instance_id,
        "clusterID": id.cluster_id,
        "version": id.version,
        "commit": id.commit,
        "machineInfo": state.machine,
        "status": "ready",
        "sandboxCount": u.running,
        "sandboxPausedCount": u.paused,
        "sandboxPooledCount": u.pooled,
        "sandboxPooledByTemplate": u.pooled_by_template,
        "createSuccesses": u.create_successes,
        "createFails": u.create_fails,
        "backend": state.orch.backend_kind().as_str(),
        "metrics": {
            "allocatedCPU": u.allocated_cpu,
            "allocatedMemoryBytes": u.allocated_memory_bytes,
            "cpuPercent": host.cpu_percent,
            "cpuCount": host.cpu_count,
            "memoryUsedBytes": host.memory_used_bytes,
            "memoryTotalBytes": host.memory_total_bytes,
            "disks": disks,
            "pausedAllocatedCPU": u.paused_allocated_cpu,
            "pausedAllocatedMemoryBytes": u.paused_allocated_memory_bytes,
            "pooledAllocatedCPU": u.pooled_allocated_cpu,
            "pooledAllocatedMemoryBytes": u.pooled_allocated_memory_bytes,
        },
    });
    if detail {
        v["cachedBuilds"] = serde_json::json!([]);
    } else {
        v["sandboxStartingCount"] = serde_json::json!(u.starting);
    }
    v
}
