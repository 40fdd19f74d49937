//! `GET /sandboxes/{id}/metrics` and `GET /sandboxes/metrics`: what sandboxes use.

use http::{Request, StatusCode};
use hyper::body::Incoming;

use super::ApiState;
use super::error::Reply;
use crate::dataplane::json_error;

/// `GET /sandboxes/{id}/metrics?start=&end=`.
pub(super) async fn sandbox(_state: &ApiState, _id: &str, _req: &Request<Incoming>) -> Reply {
    Err(json_error(StatusCode::NOT_IMPLEMENTED, "not built yet").into())
}

/// `GET /sandboxes/metrics?sandbox_ids=…`.
pub(super) async fn many(_state: &ApiState, _req: &Request<Incoming>) -> Reply {
    Err(json_error(StatusCode::NOT_IMPLEMENTED, "not built yet").into())
}
