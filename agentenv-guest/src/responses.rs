//! Plain-HTTP answers shared by the handlers (`/init`, `/envs`, `/metrics`,
//! `/files`, refusals): JSON bodies, JSON errors, status-only answers.
//! Connect answers are built in [`crate::connect`].

use http::{HeaderValue, Response, StatusCode, header};
use serde::Serialize;

use crate::connect::{self, RespBody};

/// A `200 OK` JSON body.
pub fn json(value: &impl Serialize) -> Response<RespBody> {
    let mut r = Response::new(connect::full(serde_json::to_vec(value).unwrap_or_default()));
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}

/// A JSON error body `{"code": <status>, "message": "..."}` for plain routes.
pub fn json_error(status: StatusCode, message: impl Into<String>) -> Response<RespBody> {
    let body = serde_json::json!({"code": status.as_u16(), "message": message.into()});
    let mut r = json(&body);
    *r.status_mut() = status;
    r
}

/// An answer without a body.
pub fn status_only(status: StatusCode) -> Response<RespBody> {
    let mut r = Response::new(connect::empty());
    *r.status_mut() = status;
    r
}
