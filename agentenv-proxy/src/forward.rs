//! Upstream URL and header rewriting for proxied requests.

use std::net::IpAddr;

use std::cell::RefCell;
use std::collections::HashMap;

use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::uri::{Authority, PathAndQuery, Scheme};
use http::{Method, Uri};

/// A node endpoint that is not an absolute `http://` or `https://` URL.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid upstream endpoint {0:?}")]
pub struct InvalidEndpoint(pub String);

/// Joins `endpoint`'s base path and `path` (both escaped, kept byte for
/// byte) with exactly one `/` at the seam, and appends the raw `query`. Any
/// query on the endpoint is dropped.
pub fn upstream_uri(
    endpoint: &str,
    path: &str,
    query: Option<&str>,
) -> Result<Uri, InvalidEndpoint> {
    Endpoint::parse(endpoint)?.uri(&[path], query)
}

/// A node endpoint, parsed: scheme, authority and base path. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Endpoint(std::sync::Arc<EndpointParts>);

#[derive(Debug)]
struct EndpointParts {
    raw: String,
    scheme: Scheme,
    authority: Authority,
    base_path: String,
}

impl Endpoint {
    /// An absolute `http://` or `https://` URL with a host; any query is
    /// dropped.
    pub fn parse(endpoint: &str) -> Result<Self, InvalidEndpoint> {
        let invalid = || InvalidEndpoint(endpoint.to_string());
        let base: Uri = endpoint.trim().parse().map_err(|_| invalid())?;
        let scheme = base.scheme().ok_or_else(invalid)?.clone();
        if scheme != Scheme::HTTP && scheme != Scheme::HTTPS {
            return Err(invalid());
        }
        let authority = base.authority().ok_or_else(invalid)?.clone();
        if authority.host().is_empty() {
            return Err(invalid());
        }
        Ok(Self(std::sync::Arc::new(EndpointParts {
            raw: endpoint.to_string(),
            scheme,
            authority,
            base_path: base.path().to_string(),
        })))
    }

    /// The endpoint's base path joined with each of `parts` (exactly one
    /// `/` at every seam, escapes kept byte for byte), then `query`.
    pub fn uri(&self, parts: &[&str], query: Option<&str>) -> Result<Uri, InvalidEndpoint> {
        let e = &*self.0;
        let mut s = String::new();
        self.target_into(&mut s, parts, query);
        let invalid = || InvalidEndpoint(e.raw.clone());
        let path_and_query =
            PathAndQuery::from_maybe_shared(bytes::Bytes::from(s)).map_err(|_| invalid())?;
        Uri::builder()
            .scheme(e.scheme.clone())
            .authority(e.authority.clone())
            .path_and_query(path_and_query)
            .build()
            .map_err(|_| invalid())
    }

    /// Sets `s` to the request target [`Endpoint::uri`] would have: the
    /// base path joined with each of `parts`, then `query`.
    pub fn target_into(&self, s: &mut String, parts: &[&str], query: Option<&str>) {
        let e = &*self.0;
        s.clear();
        s.reserve(
            e.base_path.len()
                + parts.iter().map(|p| p.len() + 1).sum::<usize>()
                + query.map_or(0, |q| q.len() + 1),
        );
        s.push_str(&e.base_path);
        for part in parts {
            match (s.ends_with('/'), part.starts_with('/')) {
                (true, true) => s.push_str(&part[1..]),
                (false, false) => {
                    s.push('/');
                    s.push_str(part);
                }
                _ => s.push_str(part),
            }
        }
        if let Some(q) = query {
            s.push('?');
            s.push_str(q);
        }
    }

    /// A plain `http://` endpoint (no TLS).
    pub fn is_plain_http(&self) -> bool {
        self.0.scheme == Scheme::HTTP
    }

    /// The endpoint's `host[:port]`.
    pub fn authority(&self) -> &Authority {
        &self.0.authority
    }

    /// `endpoint`, parsed once per thread and then reused.
    pub fn cached(endpoint: &str) -> Result<Self, InvalidEndpoint> {
        /// Endpoints are the few nodes of a cluster; this bounds a cache
        /// that an ever-changing node list would otherwise grow.
        const MAX_CACHED: usize = 1024;
        thread_local! {
            static CACHE: RefCell<HashMap<String, Endpoint>> = RefCell::default();
        }
        CACHE.with(|cache| {
            if let Some(e) = cache.borrow().get(endpoint) {
                return Ok(e.clone());
            }
            let parsed = Self::parse(endpoint)?;
            let mut cache = cache.borrow_mut();
            if cache.len() >= MAX_CACHED {
                cache.clear();
            }
            cache.insert(endpoint.to_string(), parsed.clone());
            Ok(parsed)
        })
    }
}

/// `a` + `b` with exactly one `/` between them.
pub fn join_path(a: &str, b: &str) -> String {
    let a_slash = a.ends_with('/');
    let b_slash = b.starts_with('/');
    match (a_slash, b_slash) {
        (true, true) => format!("{a}{}", &b[1..]),
        (false, false) => format!("{a}/{b}"),
        _ => format!("{a}{b}"),
    }
}

/// The target path upstream: data-plane routes go under `/proxy` (a path
/// that already is `/proxy/…` is kept as is), the rest unchanged.
pub fn target_path(raw_path: &str, data_plane: bool, already_proxy: bool) -> String {
    if data_plane && !already_proxy {
        join_path("/proxy", raw_path)
    } else {
        raw_path.to_string()
    }
}

/// Hop-by-hop headers besides `Upgrade` (the fast lane keeps the same set).
pub(crate) const HOP_BY_HOP: [HeaderName; 8] = [
    header::CONNECTION,
    HeaderName::from_static("proxy-connection"),
    HeaderName::from_static("keep-alive"),
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
];

static X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");
static X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
static X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
static X_FORWARDED_METHOD: HeaderName = HeaderName::from_static("x-forwarded-method");
static X_FORWARDED_URI: HeaderName = HeaderName::from_static("x-forwarded-uri");

fn is_hop_by_hop(name: &HeaderName) -> bool {
    *name == header::UPGRADE || HOP_BY_HOP.contains(name)
}

fn strip_hop_by_hop(headers: &mut HeaderMap, keep_trailer: bool) {
    // Most messages carry none: one pass over the names instead of a
    // lookup per hop-by-hop name.
    if !headers.keys().any(is_hop_by_hop) {
        return;
    }
    let trailer = keep_trailer.then(|| {
        headers
            .get_all(header::TRAILER)
            .iter()
            .cloned()
            .collect::<Vec<_>>()
    });
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|s| s.split(','))
        .filter_map(|t| HeaderName::from_bytes(t.trim().as_bytes()).ok())
        .collect();
    for name in named {
        headers.remove(name);
    }
    for name in &HOP_BY_HOP {
        headers.remove(name);
    }
    headers.remove(header::UPGRADE);
    // A response keeps its trailer announcement so trailers reach HTTP/1.1 clients.
    for v in trailer.into_iter().flatten() {
        headers.append(header::TRAILER, v);
    }
}

/// What the gateway knows about the inbound request for `X-Forwarded-*`.
pub struct Forwarded<'a> {
    pub client_ip: IpAddr,
    pub host: Option<&'a HeaderValue>,
    pub method: &'a Method,
    /// The inbound request URI (escaped path and query).
    pub request_uri: &'a str,
    /// The client's connection is TLS (`X-Forwarded-Proto: https`).
    pub tls: bool,
}

/// Rewrites inbound request headers for the upstream: hop-by-hop headers go
/// (`Te: trailers` stays; `Connection`/`Upgrade` stay for an upgrade), the
/// client's forwarding headers are replaced, Host is kept.
pub fn rewrite_request_headers(headers: &mut HeaderMap, upgrade: bool, fwd: &Forwarded<'_>) {
    let te_trailers = crate::routing::has_token(headers, header::TE, "trailers");
    let upgrade_value = upgrade
        .then(|| headers.get(header::UPGRADE).cloned())
        .flatten();
    strip_hop_by_hop(headers, false);
    if te_trailers {
        headers.insert(header::TE, HeaderValue::from_static("trailers"));
    }
    if upgrade && let Some(v) = upgrade_value {
        headers.insert(header::CONNECTION, HeaderValue::from_static("Upgrade"));
        headers.insert(header::UPGRADE, v);
    }
    if headers
        .keys()
        .any(|k| *k == header::FORWARDED || *k == X_FORWARDED_HOST || *k == X_FORWARDED_PROTO)
    {
        headers.remove(header::FORWARDED);
        headers.remove(&X_FORWARDED_HOST);
        headers.remove(&X_FORWARDED_PROTO);
    }
    if let Some(host) = fwd.host {
        headers.insert(header::HOST, host.clone());
        headers.insert(X_FORWARDED_HOST.clone(), host.clone());
    }
    headers.insert(X_FORWARDED_FOR.clone(), ip_header_value(fwd.client_ip));
    let proto = if fwd.tls { "https" } else { "http" };
    headers.insert(X_FORWARDED_PROTO.clone(), HeaderValue::from_static(proto));
    headers.insert(X_FORWARDED_METHOD.clone(), method_header_value(fwd.method));
    if let Ok(v) = HeaderValue::from_str(fwd.request_uri) {
        headers.insert(X_FORWARDED_URI.clone(), v);
    }
}

/// An IP address as a header value. The last one made on this thread is
/// reused: a client connection sends many requests from one address.
fn ip_header_value(ip: IpAddr) -> HeaderValue {
    thread_local! {
        static LAST: RefCell<Option<(IpAddr, HeaderValue)>> = const { RefCell::new(None) };
    }
    LAST.with(|last| {
        let mut last = last.borrow_mut();
        match &*last {
            Some((cached, v)) if *cached == ip => v.clone(),
            _ => {
                let v = format_ip(ip);
                *last = Some((ip, v.clone()));
                v
            }
        }
    })
}

pub(crate) fn format_ip(ip: IpAddr) -> HeaderValue {
    use std::io::Write;
    let mut buf = [0u8; 48];
    let mut cursor = std::io::Cursor::new(&mut buf[..]);
    // An IPv6 address is at most 45 characters.
    let _ = write!(cursor, "{ip}");
    let len = cursor.position() as usize;
    HeaderValue::from_bytes(&buf[..len]).expect("an IP is a valid header value")
}

fn method_header_value(method: &Method) -> HeaderValue {
    match *method {
        Method::GET => HeaderValue::from_static("GET"),
        Method::POST => HeaderValue::from_static("POST"),
        Method::PUT => HeaderValue::from_static("PUT"),
        Method::DELETE => HeaderValue::from_static("DELETE"),
        Method::PATCH => HeaderValue::from_static("PATCH"),
        Method::HEAD => HeaderValue::from_static("HEAD"),
        Method::OPTIONS => HeaderValue::from_static("OPTIONS"),
        _ => HeaderValue::from_str(method.as_str()).unwrap_or(HeaderValue::from_static("OTHER")),
    }
}

/// Strips hop-by-hop headers from an upstream response (a 101 keeps
/// `Connection` and `Upgrade`; `Trailer` is kept).
pub fn rewrite_response_headers(headers: &mut HeaderMap, switching_protocols: bool) {
    if switching_protocols {
        let upgrade = headers.get(header::UPGRADE).cloned();
        strip_hop_by_hop(headers, true);
        headers.insert(header::CONNECTION, HeaderValue::from_static("Upgrade"));
        if let Some(v) = upgrade {
            headers.insert(header::UPGRADE, v);
        }
    } else {
        strip_hop_by_hop(headers, true);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn data_plane_paths_go_under_proxy_and_others_stay() {
        assert_eq!(target_path("/health", true, false), "/proxy/health");
        assert_eq!(target_path("/", true, false), "/proxy/");
        assert_eq!(target_path("/proxy/x", true, true), "/proxy/x");
        assert_eq!(
            target_path("/sandboxes/a/pause", false, false),
            "/sandboxes/a/pause"
        );
    }

    #[test]
    fn escaped_paths_are_kept_and_joined_under_a_base_path() {
        let u = upstream_uri(
            "http://u:8000/base",
            "/proxy/a%2Fb/%2525/c%20d",
            Some("x=%2F&y"),
        )
        .unwrap();
        assert_eq!(
            u.to_string(),
            "http://u:8000/base/proxy/a%2Fb/%2525/c%20d?x=%2F&y"
        );
        let u = upstream_uri("http://u:8000/base/", "/x", None).unwrap();
        assert_eq!(u.path(), "/base/x");
        let u = upstream_uri("http://u:8000?drop=1", "/x", None).unwrap();
        assert_eq!(u.to_string(), "http://u:8000/x");
    }

    #[test]
    fn endpoints_without_scheme_or_host_are_invalid() {
        for e in ["", "u:8000", "ftp://u", "/just/a/path", "http://"] {
            assert!(upstream_uri(e, "/x", None).is_err(), "{e}");
        }
    }

    #[test]
    fn request_headers_are_rewritten_for_the_upstream() {
        let mut h: HeaderMap = [
            ("host", "gw.example:8080"),
            ("connection", "keep-alive, x-drop-me"),
            ("x-drop-me", "1"),
            ("keep-alive", "timeout=5"),
            ("te", "trailers"),
            ("x-forwarded-for", "1.2.3.4, 5.6.7.8"),
            ("forwarded", "for=1.2.3.4"),
            ("x-api-key", "k"),
        ]
        .into_iter()
        .map(|(k, v)| (HeaderName::from_static(k), HeaderValue::from_static(v)))
        .collect();
        let host = h.get("host").cloned();
        rewrite_request_headers(
            &mut h,
            false,
            &Forwarded {
                client_ip: "127.0.0.9".parse().unwrap(),
                host: host.as_ref(),
                method: &Method::POST,
                request_uri: "/a%2Fb?q=1",
                tls: false,
            },
        );
        assert_eq!(h["host"], "gw.example:8080");
        assert_eq!(h["x-forwarded-host"], "gw.example:8080");
        assert_eq!(h["x-forwarded-for"], "127.0.0.9");
        assert_eq!(h["x-forwarded-proto"], "http");
        assert_eq!(h["x-forwarded-method"], "POST");
        assert_eq!(h["x-forwarded-uri"], "/a%2Fb?q=1");
        assert_eq!(h["te"], "trailers");
        assert_eq!(h["x-api-key"], "k");
        for gone in ["connection", "x-drop-me", "keep-alive", "forwarded"] {
            assert!(h.get(gone).is_none(), "{gone}");
        }
    }

    #[test]
    fn upgrades_keep_connection_and_upgrade() {
        let mut h = HeaderMap::new();
        h.insert(
            "connection",
            HeaderValue::from_static("keep-alive, Upgrade"),
        );
        h.insert("upgrade", HeaderValue::from_static("websocket"));
        rewrite_request_headers(
            &mut h,
            true,
            &Forwarded {
                client_ip: "::1".parse().unwrap(),
                host: None,
                method: &Method::GET,
                request_uri: "/socket",
                tls: false,
            },
        );
        assert_eq!(h["connection"], "Upgrade");
        assert_eq!(h["upgrade"], "websocket");
        assert_eq!(h["x-forwarded-for"], "::1");
    }
}
