//! Snapshot and template handlers: take a snapshot, list and get snapshots, resolve a
//! template alias, delete a template (a snapshot).

use http::{Request, StatusCode};
use hyper::body::Incoming;

use super::ApiState;
use super::body::{json_response, page_response, read_json};
use super::error::{Reply, bad_request};
use super::model::{SnapshotBody, SnapshotInfoJson, SnapshotQuery};
use crate::clock::ms_rfc3339;
use crate::ids::parse_sandbox_id;
use crate::lifecycle::LifecycleError;
use crate::snapshot::{SnapshotError, SnapshotRecord};

/// `POST /sandboxes/{id}/snapshots`.
pub(super) async fn take(state: &ApiState, id: &str, req: Request<Incoming>) -> Reply {
    let id = parse_sandbox_id(id)?;
    let body: SnapshotBody = read_json(req).await?;
    match state.orch.snapshot(&id, body.name).await {
        Ok(rec) => Ok(json_response(StatusCode::CREATED, &snapshot_json(&rec))),
        // A snapshot needs a running sandbox: anything else is a bad request.
        Err(e @ LifecycleError::InvalidState { .. }) => Err(bad_request(e.to_string())),
        Err(e) => Err(e.into()),
    }
}

/// `GET /snapshots`.
pub(super) async fn list(state: &ApiState, req: &Request<Incoming>) -> Reply {
    let q = SnapshotQuery::parse(req.uri().query().unwrap_or("")).map_err(bad_request)?;
    let all = state.orch.snapshot_repository()?.list().await?;
    let (items, next) = q.apply(all);
    Ok(page_response(
        &items.iter().map(snapshot_json).collect::<Vec<_>>(),
        next,
    ))
}

/// `GET /snapshots/{id or name}`.
pub(super) async fn get(state: &ApiState, id: String) -> Reply {
    let repo = state.orch.snapshot_repository()?;
    match repo.resolve(&id).await? {
        Some(rec) => Ok(json_response(StatusCode::OK, &snapshot_json(&rec))),
        None => Err(SnapshotError::NotFound(id).into()),
    }
}

fn snapshot_json(r: &SnapshotRecord) -> SnapshotInfoJson {
    SnapshotInfoJson {
        snapshot_id: r.id.clone(),
        names: r.alias.iter().cloned().collect(),
        cpu_count: r.resources.cpu_count,
        memory_mb: r.resources.memory_mb,
        disk_size_mb: r.resources.disk_size_mb,
        created_at: ms_rfc3339(r.created_at_ms),
        updated_at: ms_rfc3339(r.updated_at_ms),
    }
}
