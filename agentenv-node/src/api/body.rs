//! Request and response bodies of the control plane: small JSON bodies in, JSON out,
//! query strings.

use std::collections::BTreeMap;

use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::Incoming;

use super::error::{Reject, bad_request};
use crate::dataplane::{Body, full};

/// Largest JSON request body of the control plane.
const MAX_JSON_BODY: usize = 1 << 20;

/// Reads a small JSON body; empty means `{}`.
pub(super) async fn read_json<T: serde::de::DeserializeOwned>(
    req: Request<Incoming>,
) -> Result<T, Reject> {
    parse_json(&read_body(req).await?)
}

/// Reads a small request body (at most [`MAX_JSON_BODY`] bytes); empty means `{}`.
pub(super) async fn read_body(req: Request<Incoming>) -> Result<Bytes, Reject> {
    let limited = http_body_util::Limited::new(req.into_body(), MAX_JSON_BODY);
    let bytes = match limited.collect().await {
        Ok(b) => b.to_bytes(),
        Err(e) => {
            return Err(bad_request(format!(
                "reading the request body (at most {MAX_JSON_BODY} bytes): {e}"
            )));
        }
    };
    Ok(if bytes.iter().all(u8::is_ascii_whitespace) {
        Bytes::from_static(b"{}")
    } else {
        bytes
    })
}

/// Parses a JSON body; the error names where it went wrong.
pub(super) fn parse_json<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Result<T, Reject> {
    let de = &mut serde_json::Deserializer::from_slice(bytes);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if path == "." || path.is_empty() {
            bad_request(format!("invalid JSON body: {inner}"))
        } else {
            bad_request(format!("invalid JSON body at {path}: {inner}"))
        }
    })
}

/// `v` as a JSON response.
pub(super) fn json_response<T: serde::Serialize>(status: StatusCode, v: &T) -> Response<Body> {
    let mut r = Response::new(full(serde_json::to_vec(v).unwrap_or_default()));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}

/// One page of a list (200), with `x-next-token` when more items follow.
pub(super) fn page_response<T: serde::Serialize>(
    items: &[T],
    next: Option<String>,
) -> Response<Body> {
    let mut r = json_response(StatusCode::OK, &items);
    if let Some(t) = next
        && let Ok(v) = HeaderValue::from_str(&t)
    {
        r.headers_mut().insert("x-next-token", v);
    }
    r
}

/// Parses `a=b&c=d` (percent-decoded).
pub fn query_pairs(q: &str) -> BTreeMap<String, String> {
    q.split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (decode(k), decode(v))
        })
        .collect()
}

fn decode(s: &str) -> String {
    let s = s.replace('+', " ");
    percent_encoding::percent_decode_str(&s)
        .decode_utf8_lossy()
        .into_owned()
}
