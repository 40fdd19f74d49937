//! `GET /sandboxes/{id}/logs` and `GET /v2/sandboxes/{id}/logs`: a sandbox's logs.

use http::{Request, StatusCode};
use hyper::body::Incoming;

use super::ApiState;
use super::error::Reply;
use crate::dataplane::json_error;

/// `GET /sandboxes/{id}/logs` (`v2`: `/v2/sandboxes/{id}/logs`).
pub(super) async fn get(
    _state: &ApiState,
    _id: &str,
    _req: &Request<Incoming>,
    _v2: bool,
) -> Reply {
    Err(json_error(StatusCode::NOT_IMPLEMENTED, "not built yet").into())
}
