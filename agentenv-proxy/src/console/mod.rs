//! The web console under `/console`: the page and its assets, sign-in with
//! the API key, a REST pass-through to the gateway's own API, a sandbox's
//! files, live updates and a terminal over WebSockets.
//!
//! The gateway answers `/console` paths itself, before API-key routing,
//! unless the `Host` names a sandbox. Its rooms: this file (dispatch and the
//! headers of every answer), `session` (sessions, cookie, CSRF, `Origin`),
//! `rest` (the pass-through, run through the gateway's own dispatch),
//! `envd` (calls to a sandbox's agent through the gateway), `files`,
//! `events` (one poller per gateway, broadcast to every page) and
//! `terminal` (a WebSocket bridged to a PTY process in the sandbox).

mod assets;
mod envd;
mod events;
mod files;
mod rest;
mod session;
mod socket;
mod terminal;

use std::net::SocketAddr;
use std::sync::Arc;

use agentenv_core::config::ConsoleConfig;
use futures::future::BoxFuture;
use http::header::{self, HeaderValue};
use http::{Method, Request, Response, StatusCode};

use crate::body::{GatewayBody, empty, full};
use crate::server::{ClientTls, Gateway};

/// The console's state in a gateway.
pub(crate) struct Console {
    enabled: bool,
    sessions: session::Sessions,
    events: events::Hub,
}

impl Console {
    pub(crate) fn new(cfg: &ConsoleConfig) -> Self {
        Self {
            enabled: cfg.enabled,
            sessions: session::Sessions::new(cfg.session_ttl),
            events: events::Hub::default(),
        }
    }
}

/// One console request's surroundings.
pub(crate) struct Ctx {
    gateway: Gateway,
    console: Arc<Console>,
    remote: SocketAddr,
    /// The browser reaches the gateway over TLS (its own, or a proxy's).
    tls: bool,
}

/// `/console` or a path under it.
pub(crate) fn is_console_path(decoded: &str) -> bool {
    decoded == "/console" || decoded.starts_with("/console/")
}

const CSP: &str = "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'";

/// Answers a console request (the `Host` names no sandbox).
pub(crate) fn handle(
    gateway: Gateway,
    console: Arc<Console>,
    req: Request<GatewayBody>,
    remote: SocketAddr,
) -> BoxFuture<'static, Response<GatewayBody>> {
    Box::pin(async move {
        // Behind a TLS proxy (`gateway.allow_plain_http`), the proxy's
        // `X-Forwarded-Proto: https` says what the browser sees. A page cannot
        // set it on a cross-site request or a WebSocket handshake.
        let forwarded_https = req
            .headers()
            .get("x-forwarded-proto")
            .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"https"));
        let tls = req.extensions().get::<ClientTls>().is_some() || forwarded_https;
        let ctx = Ctx {
            gateway,
            console,
            remote,
            tls,
        };
        let api = req.uri().path().starts_with("/console/api/");
        let mut resp = if ctx.console.enabled {
            route(&ctx, req).await
        } else {
            err(
                StatusCode::NOT_FOUND,
                "the console is turned off (gateway.console.enabled)",
            )
        };
        let h = resp.headers_mut();
        h.insert("content-security-policy", HeaderValue::from_static(CSP));
        h.insert(
            "x-content-type-options",
            HeaderValue::from_static("nosniff"),
        );
        h.insert("referrer-policy", HeaderValue::from_static("no-referrer"));
        h.insert("x-frame-options", HeaderValue::from_static("DENY"));
        if api || !h.contains_key(header::CACHE_CONTROL) {
            h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
        }
        resp
    })
}

async fn route(ctx: &Ctx, req: Request<GatewayBody>) -> Response<GatewayBody> {
    let path = req.uri().path().to_string();
    let read = matches!(*req.method(), Method::GET | Method::HEAD);
    match path.as_str() {
        "/console" => {
            let mut resp = Response::new(empty());
            *resp.status_mut() = StatusCode::PERMANENT_REDIRECT;
            resp.headers_mut()
                .insert(header::LOCATION, HeaderValue::from_static("/console/"));
            return resp;
        }
        "/console/" if read => return asset_answer(&req, assets::index()),
        "/console/api/session" => return session::route(ctx, req).await,
        _ => {}
    }
    if let Some(name) = path.strip_prefix("/console/assets/") {
        return match assets::asset(name) {
            Some(a) if read => asset_answer(&req, a),
            Some(_) => err(StatusCode::METHOD_NOT_ALLOWED, "assets are read with GET"),
            None => err(StatusCode::NOT_FOUND, "no such console asset"),
        };
    }
    let Some(api) = path.strip_prefix("/console/api/") else {
        return err(StatusCode::NOT_FOUND, "not a console path");
    };
    // Every API call: a session, then the origin, then (to change state) the CSRF token.
    let sessions = &ctx.console.sessions;
    let Some(valid) = session::cookie_token(req.headers()).and_then(|t| sessions.touch(t)) else {
        return err(StatusCode::UNAUTHORIZED, session::SIGN_IN_FIRST);
    };
    let websocket = crate::routing::is_websocket(req.headers());
    if !session::origin_ok(&req, ctx.tls, websocket) {
        return err(StatusCode::FORBIDDEN, session::CROSS_ORIGIN);
    }
    if !read && !session::csrf_ok(req.headers(), &valid.csrf) {
        return err(StatusCode::FORBIDDEN, session::BAD_CSRF);
    }
    if let Some(rest) = api.strip_prefix("rest/") {
        let rest = rest.to_string();
        return rest::pass(ctx, req, &rest).await;
    }
    if api == "events" {
        return events::open(ctx, req, &valid.token);
    }
    let segs: Vec<&str> = api.split('/').collect();
    // What a read needs of the request, without its body (held across awaits).
    let mut head = Request::new(());
    *head.uri_mut() = req.uri().clone();
    *head.headers_mut() = req.headers().clone();
    match segs.as_slice() {
        ["sandboxes", id, what] => {
            let Some(id) = sandbox_id(id) else {
                return err(StatusCode::BAD_REQUEST, "invalid sandbox id");
            };
            match *what {
                "dir" if read => files::dir(ctx, &head, &id).await,
                "file" if read => files::download(ctx, &head, &id).await,
                "file" if *req.method() == Method::POST => files::upload(ctx, req, &id).await,
                "terminal" => terminal::open(ctx, req, &id, &valid.token).await,
                "dir" | "file" => err(StatusCode::METHOD_NOT_ALLOWED, "method not allowed"),
                _ => err(StatusCode::NOT_FOUND, "not a console API path"),
            }
        }
        _ => err(StatusCode::NOT_FOUND, "not a console API path"),
    }
}

/// `asset` as an answer to `req`: 304 when `If-None-Match` names its tag.
fn asset_answer<B>(req: &Request<B>, asset: assets::Asset) -> Response<GatewayBody> {
    let fresh = req
        .headers()
        .get_all(header::IF_NONE_MATCH)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|t| t.trim() == asset.etag || t.trim() == "*");
    let mut resp = if fresh {
        let mut r = Response::new(empty());
        *r.status_mut() = StatusCode::NOT_MODIFIED;
        r
    } else if req.method() == http::Method::HEAD {
        Response::new(empty())
    } else {
        Response::new(full(asset.bytes))
    };
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static(asset.content_type),
    );
    h.insert(header::ETAG, HeaderValue::from_static(asset.etag));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    resp
}

/// A sandbox id from a path segment: letters, digits, `-`, `_`, `.`.
fn sandbox_id(seg: &str) -> Option<String> {
    let ok = !seg.is_empty()
        && seg.len() <= 128
        && seg != "."
        && seg != ".."
        && seg
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.');
    ok.then(|| seg.to_string())
}

/// An answer in place of what a call would return (boxed: it is large).
pub(crate) type Refusal = Box<Response<GatewayBody>>;

/// A JSON error `{"code", "message"}`.
pub(crate) fn err(status: StatusCode, message: &str) -> Response<GatewayBody> {
    json(
        status,
        &serde_json::json!({"code": status.as_u16(), "message": message}),
    )
}

/// A JSON answer.
pub(crate) fn json(status: StatusCode, value: &serde_json::Value) -> Response<GatewayBody> {
    let mut resp = Response::new(full(value.to_string()));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp
}

/// A query parameter, percent-decoded.
pub(crate) fn query_param(query: Option<&str>, name: &str) -> Option<String> {
    query?
        .split('&')
        .filter_map(|kv| kv.split_once('=').or(Some((kv, ""))))
        .find(|(k, _)| *k == name)
        .map(|(_, v)| {
            let v = v.replace('+', " ");
            percent_encoding::percent_decode_str(&v)
                .decode_utf8_lossy()
                .into_owned()
        })
}
