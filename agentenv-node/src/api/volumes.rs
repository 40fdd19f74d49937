//! `/volumes`: persistent directories on the shared storage that outlive sandboxes.

use http::{Request, StatusCode};
use hyper::body::Incoming;

use super::ApiState;
use super::error::Reply;
use crate::dataplane::json_error;

/// `POST /volumes`.
pub(super) async fn create(_state: &ApiState, _req: Request<Incoming>) -> Reply {
    Err(json_error(StatusCode::NOT_IMPLEMENTED, "not built yet").into())
}

/// `GET /volumes`.
pub(super) async fn list(_state: &ApiState) -> Reply {
    Err(json_error(StatusCode::NOT_IMPLEMENTED, "not built yet").into())
}

/// `GET /volumes/{id}`.
pub(super) async fn get(_state: &ApiState, _id: &str) -> Reply {
    Err(json_error(StatusCode::NOT_IMPLEMENTED, "not built yet").into())
}

/// `DELETE /volumes/{id}`.
pub(super) async fn delete(_state: &ApiState, _id: &str) -> Reply {
    Err(json_error(StatusCode::NOT_IMPLEMENTED, "not built yet").into())
}
