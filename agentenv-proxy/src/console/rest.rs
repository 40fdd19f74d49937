//! `/console/api/rest/<path>`: the gateway's control-plane API with its key.
//!
//! The request is rebuilt as `<METHOD> /<path>?<query>` with the API key and
//! only the headers an API call needs, and run through the gateway's own
//! dispatch: routing, cluster lists, node routes and metrics are exactly
//! those of a client's call. Answers pass through unchanged but for their
//! headers (only the ones the page reads are kept).

use http::header::{self, HeaderName};
use http::{Request, Response, StatusCode};

use super::{Ctx, err};
use crate::body::{GatewayBody, boxed};
use crate::routing::IDEMPOTENCY_KEY_HEADER;

/// The largest request body passed through.
const BODY_LIMIT: usize = 16 * 1024 * 1024;
/// Answer headers kept.
const KEPT: [&str; 5] = [
    "content-type",
    "content-length",
    "x-next-token",
    "retry-after",
    "content-encoding",
];

/// Whether `decoded` (the path after `rest/`) is a control-plane path the
/// console may call: not the data plane, `/metrics`, `/health` or itself.
fn allowed(decoded: &str) -> bool {
    let segs: Vec<&str> = decoded.trim_end_matches('/').split('/').collect();
    if segs.iter().any(|s| s.is_empty() || *s == "." || *s == "..") {
        return false;
    }
    matches!(
        segs.as_slice(),
        [
            "nodes" | "sandboxes" | "templates" | "snapshots" | "volumes",
            ..
        ] | ["v2" | "v3", "sandboxes" | "templates", ..]
    )
}

pub(crate) async fn pass(
    ctx: &Ctx,
    req: Request<GatewayBody>,
    rest: &str,
) -> Response<GatewayBody> {
    let Some(decoded) = crate::server::decode_path(rest) else {
        return err(
            StatusCode::BAD_REQUEST,
            "invalid request path: bad percent-encoding",
        );
    };
    if !allowed(&decoded) {
        return err(StatusCode::NOT_FOUND, "not a console API path");
    }
    let path_and_query = match req.uri().query() {
        Some(q) => format!("/{rest}?{q}"),
        None => format!("/{rest}"),
    };
    let (parts, body) = req.into_parts();
    let mut inner = Request::new(boxed(http_body_util::Limited::new(body, BODY_LIMIT)));
    *inner.method_mut() = parts.method;
    *inner.uri_mut() = match path_and_query.parse() {
        Ok(u) => u,
        Err(_) => return err(StatusCode::BAD_REQUEST, "invalid request path"),
    };
    for name in [
        header::CONTENT_TYPE,
        header::ACCEPT,
        header::CONTENT_LENGTH,
        HeaderName::from_static(IDEMPOTENCY_KEY_HEADER),
    ] {
        if let Some(v) = parts.headers.get(&name) {
            inner.headers_mut().insert(name, v.clone());
        }
    }
    let key =
        http::HeaderValue::from_str(ctx.gateway.api_key()).expect("the API key is a valid header");
    inner
        .headers_mut()
        .insert(crate::routing::API_KEY_HEADER, key);
    let resp = ctx.gateway.internal(inner, ctx.remote).await;
    let (mut parts, body) = resp.into_parts();
    let mut headers = http::HeaderMap::new();
    for name in KEPT {
        if let Some(v) = parts.headers.get(name) {
            headers.insert(HeaderName::from_static(name), v.clone());
        }
    }
    parts.headers = headers;
    Response::from_parts(parts, body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_control_plane_paths_pass() {
        for p in [
            "nodes",
            "nodes/n1/drain",
            "sandboxes",
            "sandboxes/abc/pause",
            "v2/sandboxes",
            "v2/sandboxes/abc/logs",
            "templates",
            "snapshots",
        ] {
            assert!(allowed(p), "{p}");
        }
        for p in [
            "",
            "metrics",
            "health",
            "proxy/x",
            "files",
            "process.Process/Start",
            "console/api/session",
            "sandboxes/../health",
            "sandboxes//x",
            "v2/health",
        ] {
            assert!(!allowed(p), "{p}");
        }
    }
}
