//! Console sessions: sign-in with the API key, the session cookie, CSRF
//! tokens and the `Origin` check.
//!
//! Sessions live in the gateway's memory only: a token minted by one gateway
//! means nothing to another, and a restart signs everyone out. A session
//! slides (each use extends it by the TTL) up to a fixed cap after sign-in.

use std::collections::HashMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use agentenv_core::config::CONSOLE_SESSION_CAP;
use http::header::{self, HeaderMap, HeaderValue};
use http::{Method, Request, Response, StatusCode};
use parking_lot::Mutex;
use subtle::ConstantTimeEq;
use tokio::sync::watch;
use tokio::time::Instant;

use super::{Ctx, err, json};
use crate::body::{GatewayBody, empty};

/// The session cookie's name.
pub(crate) const COOKIE: &str = "agentenv_console";
/// Sessions kept at most; the oldest is dropped beyond.
const MAX_SESSIONS: usize = 10_000;
/// The largest sign-in body.
const SIGN_IN_LIMIT: usize = 4 * 1024;

pub(crate) const SIGN_IN_FIRST: &str = "sign in first";
pub(crate) const CROSS_ORIGIN: &str = "cross-origin request refused";
pub(crate) const BAD_CSRF: &str = "missing or wrong CSRF token: reload the console";

struct Session {
    csrf: String,
    signed_in: Instant,
    expires: Instant,
    /// Dropped with the session: open sockets of the session see it closed.
    _alive: watch::Sender<()>,
}

/// A valid session, as a request found it.
pub(crate) struct Valid {
    pub(crate) token: String,
    pub(crate) csrf: String,
    pub(crate) expires: Instant,
}

/// The sessions of one gateway.
pub(crate) struct Sessions {
    ttl: Duration,
    map: Mutex<HashMap<String, Session>>,
}

impl Sessions {
    pub(crate) fn new(ttl: Duration) -> Self {
        Self {
            ttl,
            map: Mutex::new(HashMap::new()),
        }
    }

    /// A new session; its token and CSRF token.
    fn create(&self) -> Valid {
        let token = random_hex();
        let csrf = random_hex();
        let now = Instant::now();
        let expires = now + self.ttl;
        let mut map = self.map.lock();
        map.retain(|_, s| s.expires > now);
        while map.len() >= MAX_SESSIONS {
            let oldest = map
                .iter()
                .min_by_key(|(_, s)| s.signed_in)
                .map(|(k, _)| k.clone());
            match oldest {
                Some(k) => map.remove(&k),
                None => break,
            };
        }
        map.insert(
            token.clone(),
            Session {
                csrf: csrf.clone(),
                signed_in: now,
                expires,
                _alive: watch::channel(()).0,
            },
        );
        Valid {
            token,
            csrf,
            expires,
        }
    }

    /// The session of `token`, extended by a use; `None` when unknown or
    /// expired (an expired one is dropped).
    pub(crate) fn touch(&self, token: &str) -> Option<Valid> {
        let now = Instant::now();
        let mut map = self.map.lock();
        let s = map.get_mut(token)?;
        if s.expires <= now {
            map.remove(token);
            return None;
        }
        s.expires = (now + self.ttl).min(s.signed_in + CONSOLE_SESSION_CAP);
        Some(Valid {
            token: token.to_string(),
            csrf: s.csrf.clone(),
            expires: s.expires,
        })
    }

    /// Whether `token` is still a live session (not extended).
    pub(crate) fn alive(&self, token: &str) -> bool {
        self.map
            .lock()
            .get(token)
            .is_some_and(|s| s.expires > Instant::now())
    }

    /// A receiver that sees its sender gone when the session ends by sign-out
    /// (or is dropped as the oldest).
    pub(crate) fn watch(&self, token: &str) -> Option<watch::Receiver<()>> {
        self.map.lock().get(token).map(|s| s._alive.subscribe())
    }

    fn remove(&self, token: &str) {
        self.map.lock().remove(token);
    }
}

/// 32 random bytes from the OS, in hex.
fn random_hex() -> String {
    let mut b = [0u8; 32];
    getrandom::fill(&mut b).expect("the OS random source failed");
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The session cookie's value, if the request carries one.
pub(crate) fn cookie_token(headers: &HeaderMap) -> Option<&str> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|kv| kv.trim().split_once('='))
        .find(|(k, _)| *k == COOKIE)
        .map(|(_, v)| v.trim())
        .filter(|v| !v.is_empty())
}

/// The request's host (`Host`, or the URI's authority under HTTP/2).
pub(crate) fn request_host<B>(req: &Request<B>) -> Option<String> {
    req.headers()
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .map(str::to_string)
        .or_else(|| req.uri().authority().map(|a| a.as_str().to_string()))
}

/// Whether the `Origin` header, when present, names this request's own
/// origin (scheme by the connection, host and port by `Host`).
/// `required`: a missing `Origin` fails too.
pub(crate) fn origin_ok<B>(req: &Request<B>, tls: bool, required: bool) -> bool {
    let mut origins = req.headers().get_all(header::ORIGIN).iter();
    let origin = match (origins.next(), origins.next()) {
        (None, _) => return !required,
        (Some(o), None) => o,
        (Some(_), Some(_)) => return false,
    };
    let Ok(origin) = origin.to_str() else {
        return false;
    };
    let scheme = if tls { "https://" } else { "http://" };
    let Some(authority) = origin.strip_prefix(scheme) else {
        return false;
    };
    let Some(host) = request_host(req) else {
        return false;
    };
    let default_port = if tls { ":443" } else { ":80" };
    let norm = |a: &str| {
        let a = a.to_ascii_lowercase();
        a.strip_suffix(default_port)
            .map(str::to_string)
            .unwrap_or(a)
    };
    !authority.is_empty() && !authority.contains('/') && norm(authority) == norm(&host)
}

/// Whether the request carries the session's CSRF token (constant time).
pub(crate) fn csrf_ok(headers: &HeaderMap, csrf: &str) -> bool {
    let mut values = headers.get_all("x-csrf-token").iter();
    let (Some(v), None) = (values.next(), values.next()) else {
        return false;
    };
    let v = v.as_bytes();
    v.len() == csrf.len() && bool::from(v.ct_eq(csrf.as_bytes()))
}

fn unix_ms(at: Instant) -> u64 {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    let left = at.saturating_duration_since(Instant::now());
    u64::try_from((now + left).as_millis()).unwrap_or(u64::MAX)
}

fn cookie(value: &str, max_age: u64, tls: bool) -> HeaderValue {
    let secure = if tls { "; Secure" } else { "" };
    HeaderValue::from_str(&format!(
        "{COOKIE}={value}; Path=/console; HttpOnly; SameSite=Strict; Max-Age={max_age}{secure}"
    ))
    .expect("a cookie of hex and ASCII is a valid header")
}

fn session_answer(ctx: &Ctx, v: &Valid) -> Response<GatewayBody> {
    let mut resp = json(
        StatusCode::OK,
        &serde_json::json!({"csrfToken": v.csrf, "expiresAtUnixMs": unix_ms(v.expires)}),
    );
    let max_age = v
        .expires
        .saturating_duration_since(Instant::now())
        .as_millis()
        .div_ceil(1000);
    let max_age = u64::try_from(max_age).unwrap_or(u64::MAX);
    resp.headers_mut()
        .insert(header::SET_COOKIE, cookie(&v.token, max_age, ctx.tls));
    resp
}

/// `/console/api/session`: sign in (POST), the current session (GET),
/// sign out (DELETE).
pub(crate) async fn route(ctx: &Ctx, req: Request<GatewayBody>) -> Response<GatewayBody> {
    let sessions = &ctx.console.sessions;
    match *req.method() {
        Method::POST => {
            if !origin_ok(&req, ctx.tls, false) {
                return err(StatusCode::FORBIDDEN, CROSS_ORIGIN);
            }
            let json_type = req
                .headers()
                .get(header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.split(';').next())
                .is_some_and(|v| v.trim().eq_ignore_ascii_case("application/json"));
            if !json_type {
                return err(
                    StatusCode::UNSUPPORTED_MEDIA_TYPE,
                    "send the API key as JSON {\"apiKey\": \"...\"} with Content-Type: application/json",
                );
            }
            let body = match super::envd::collect(req.into_body(), SIGN_IN_LIMIT).await {
                Ok(b) => b,
                Err(super::envd::Collect::TooLarge) => {
                    return err(
                        StatusCode::PAYLOAD_TOO_LARGE,
                        "the sign-in body is larger than 4 KiB",
                    );
                }
                Err(super::envd::Collect::Failed) => {
                    return err(StatusCode::BAD_REQUEST, "failed to read the request body");
                }
            };
            let key = serde_json::from_slice::<serde_json::Value>(&body)
                .ok()
                .and_then(|v| v.get("apiKey").and_then(|k| k.as_str()).map(str::to_string));
            match key {
                Some(k) if ctx.gateway.key_matches(k.as_bytes()) => {
                    session_answer(ctx, &sessions.create())
                }
                _ => err(StatusCode::UNAUTHORIZED, "invalid API key"),
            }
        }
        Method::GET | Method::HEAD => {
            match cookie_token(req.headers()).and_then(|t| sessions.touch(t)) {
                Some(v) => session_answer(ctx, &v),
                None => err(StatusCode::UNAUTHORIZED, SIGN_IN_FIRST),
            }
        }
        Method::DELETE => {
            let Some(v) = cookie_token(req.headers()).and_then(|t| sessions.touch(t)) else {
                return err(StatusCode::UNAUTHORIZED, SIGN_IN_FIRST);
            };
            if !origin_ok(&req, ctx.tls, false) {
                return err(StatusCode::FORBIDDEN, CROSS_ORIGIN);
            }
            if !csrf_ok(req.headers(), &v.csrf) {
                return err(StatusCode::FORBIDDEN, BAD_CSRF);
            }
            sessions.remove(&v.token);
            let mut resp = Response::new(empty());
            *resp.status_mut() = StatusCode::NO_CONTENT;
            resp.headers_mut().insert(
                header::SET_COOKIE,
                HeaderValue::from_static(
                    "agentenv_console=; Path=/console; Max-Age=0; HttpOnly; SameSite=Strict",
                ),
            );
            resp
        }
        _ => err(
            StatusCode::METHOD_NOT_ALLOWED,
            "use POST (sign in), GET (the session) or DELETE (sign out)",
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(origin: Option<&str>, host: &str) -> Request<()> {
        let mut b = Request::get("/console/api/x").header("host", host);
        if let Some(o) = origin {
            b = b.header("origin", o);
        }
        b.body(()).unwrap()
    }

    #[test]
    fn only_the_requests_own_origin_passes() {
        assert!(origin_ok(&req(None, "gw:8080"), false, false));
        assert!(!origin_ok(&req(None, "gw:8080"), false, true));
        assert!(origin_ok(
            &req(Some("http://gw:8080"), "gw:8080"),
            false,
            true
        ));
        assert!(origin_ok(&req(Some("http://GW"), "gw:80"), false, true));
        assert!(!origin_ok(
            &req(Some("https://gw:8080"), "gw:8080"),
            false,
            true
        ));
        assert!(!origin_ok(
            &req(Some("http://evil:8080"), "gw:8080"),
            false,
            true
        ));
        assert!(!origin_ok(&req(Some("null"), "gw:8080"), false, true));
        assert!(origin_ok(&req(Some("https://gw"), "gw:443"), true, true));
    }

    #[test]
    fn the_cookie_is_found_among_others() {
        let mut h = HeaderMap::new();
        h.insert(
            header::COOKIE,
            HeaderValue::from_static("a=b; agentenv_console=abc ; c=d"),
        );
        assert_eq!(cookie_token(&h), Some("abc"));
        h.insert(
            header::COOKIE,
            HeaderValue::from_static("agentenv_console="),
        );
        assert_eq!(cookie_token(&h), None);
    }

    #[tokio::test]
    async fn sessions_slide_and_end_at_sign_out() {
        let s = Sessions::new(Duration::from_secs(60));
        let v = s.create();
        assert_eq!(v.token.len(), 64);
        assert!(s.touch(&v.token).is_some());
        let mut w = s.watch(&v.token).unwrap();
        s.remove(&v.token);
        assert!(s.touch(&v.token).is_none());
        assert!(w.changed().await.is_err());
    }
}
