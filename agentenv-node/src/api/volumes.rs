//! `/volumes`: persistent directories on the shared storage that outlive sandboxes.
//! Records live on the shared store, so any node answers for the whole cluster.

use std::sync::Arc;

use http::{Request, StatusCode};
use hyper::body::Incoming;

use super::ApiState;
use super::body::{json_response, read_json};
use super::error::{Reject, Reply, bad_request};
use super::model::{NewVolume, VolumeAndTokenJson, VolumeJson};
use crate::dataplane::{json_error, status_only};
use crate::volume::{VolumeError, VolumeRecord, Volumes};

/// The node's volumes (503 when it serves none).
pub(super) fn volumes(state: &ApiState) -> Result<&Arc<Volumes>, Reject> {
    state.orch.volumes().ok_or_else(|| {
        json_error(
            StatusCode::SERVICE_UNAVAILABLE,
            "this node serves no volumes: it has no snapshot repository store",
        )
        .into()
    })
}

fn with_token(v: &Volumes, rec: VolumeRecord) -> VolumeAndTokenJson {
    VolumeAndTokenJson {
        token: v.token(&rec.id),
        volume: VolumeJson {
            volume_id: rec.id,
            name: rec.name,
        },
    }
}

/// `POST /volumes` `{"name"}` → 201 `VolumeAndToken`; 409 when the name is taken.
pub(super) async fn create(state: &ApiState, req: Request<Incoming>) -> Reply {
    let v = volumes(state)?;
    let body: NewVolume = read_json(req).await?;
    let Some(name) = body.name else {
        return Err(bad_request(
            "name is required: POST /volumes with {\"name\": \"my-volume\"}",
        ));
    };
    let rec = v.create(&name).await?;
    Ok(json_response(StatusCode::CREATED, &with_token(v, rec)))
}

/// `GET /volumes` → 200 `[Volume]`.
pub(super) async fn list(state: &ApiState) -> Reply {
    let v = volumes(state)?;
    let items: Vec<VolumeJson> = v
        .list()
        .await?
        .into_iter()
        .map(|r| VolumeJson {
            volume_id: r.id,
            name: r.name,
        })
        .collect();
    Ok(json_response(StatusCode::OK, &items))
}

/// `GET /volumes/{id}` → 200 `VolumeAndToken`, 404.
pub(super) async fn get(state: &ApiState, id: &str) -> Reply {
    let v = volumes(state)?;
    match v.get(id).await? {
        Some(rec) => Ok(json_response(StatusCode::OK, &with_token(v, rec))),
        None => Err(VolumeError::NotFound(id.to_string()).into()),
    }
}

/// `DELETE /volumes/{id}` → 204, 404, 409 while a sandbox mounts it.
pub(super) async fn delete(state: &ApiState, id: &str) -> Reply {
    let v = volumes(state)?;
    if v.delete(id).await? {
        Ok(status_only(StatusCode::NO_CONTENT))
    } else {
        Err(VolumeError::NotFound(id.to_string()).into())
    }
}
