//! `PUT /sandboxes/{id}/network`: a running sandbox's egress rules, replaced at once.

use http::{Request, StatusCode};
use hyper::body::Incoming;

use super::ApiState;
use super::error::Reply;
use crate::dataplane::json_error;

/// `PUT /sandboxes/{id}/network`.
pub(super) async fn update(_state: &ApiState, _id: &str, _req: Request<Incoming>) -> Reply {
    Err(json_error(StatusCode::NOT_IMPLEMENTED, "not built yet").into())
}
