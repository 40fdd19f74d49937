//! The routing decision both lanes share: host routes, the API key, and the
//! rules that send a request to the gateway itself, a list, a node, or a
//! sandbox (§4.2). The hyper lane and the fast lane read requests their own
//! way and ask [`Router::decide`] the same question.

use std::borrow::Cow;

use http::{HeaderMap, Method, StatusCode};
use subtle::ConstantTimeEq;

use super::{GatewayError, GatewayOptions};
use crate::host_route::{HostRoute, HostRouteError, HostRouter};
use crate::routing::{
    API_KEY_HEADER, RouteSource, is_control_plane, is_proxy_path, node_drain_from_path,
    node_id_from_path, node_move_from_path, path_sandbox_id, trim_trailing_slashes,
};

/// What routing looks at, however the request was read.
pub(super) struct RoutingFacts<'a> {
    pub(super) method: &'a Method,
    pub(super) decoded: &'a str,
    pub(super) host_route: &'a Result<Option<HostRoute>, HostRouteError>,
    /// The first non-blank sandbox id header.
    pub(super) sandbox_id: Option<&'a str>,
    /// A target port header is present and non-blank.
    pub(super) has_port: bool,
}

/// The outcome of [`Router::decide`].
pub(super) enum Decision<'a> {
    Reject(StatusCode, &'static str),
    /// `/health` or `/metrics` answered by the gateway itself.
    Local,
    /// The `Host` names a proxy domain but is not a valid sandbox host.
    BadHost,
    ClusterList {
        v2: bool,
    },
    /// `GET /sandboxes/metrics?sandbox_ids=…`: each sandbox's node asked for its own.
    SandboxMetrics,
    NodeList,
    NodeDetail(&'a str),
    /// `POST` (`drain: true`) or `DELETE /nodes/{id}/drain`: asked of the scheduler.
    NodeDrain {
        node_id: &'a str,
        drain: bool,
    },
    /// `POST /nodes/{id}/move`: the node's paused sandboxes move to other nodes.
    NodeMove(&'a str),
    /// Proxied to the sandbox's node (`id`) or a scheduled one (`None`).
    Route {
        id: Option<&'a str>,
        source: RouteSource,
    },
}

/// The host routes and the API key of a gateway.
pub(super) struct Router {
    hosts: HostRouter,
    api_key: Box<[u8]>,
}

impl Router {
    pub(super) fn new(opts: &GatewayOptions) -> Result<Self, GatewayError> {
        if opts.api_key.is_empty() {
            return Err(GatewayError::EmptyApiKey);
        }
        Ok(Self {
            hosts: HostRouter::new(&opts.sandbox_proxy_domains)?,
            api_key: opts.api_key.as_bytes().into(),
        })
    }

    /// The sandbox a request's `Host` names, if it is under a proxy domain.
    pub(super) fn host_route(&self, host: &str) -> Result<Option<HostRoute>, HostRouteError> {
        self.hosts.route(host)
    }

    /// Whether `given` is the API key (in constant time).
    #[inline]
    pub(super) fn key_matches(&self, given: &[u8]) -> bool {
        given.len() == self.api_key.len() && bool::from(given.ct_eq(&self.api_key))
    }

    /// Exactly one `X-API-Key`, and it is the key.
    pub(super) fn authorized(&self, headers: &HeaderMap) -> bool {
        let mut values = headers.get_all(API_KEY_HEADER).iter();
        let (Some(v), None) = (values.next(), values.next()) else {
            return false;
        };
        self.key_matches(v.as_bytes())
    }

    /// How a request is routed; the rules of §4.2, shared by the hyper path
    /// and the fast lane. `authorized` is asked only when the route needs it.
    pub(super) fn decide<'a>(
        &self,
        f: &RoutingFacts<'a>,
        authorized: impl FnOnce() -> bool,
    ) -> Decision<'a> {
        let d = f.decoded;
        let local_path = d == "/health" || d == "/metrics";
        let proxy_path = is_proxy_path(d);
        let control_plane = is_control_plane(f.method, d);
        let id_header = f.sandbox_id.is_some();
        let exempt = local_path
            || proxy_path
            || matches!(f.host_route, Ok(Some(_)))
            || (!control_plane && id_header && f.has_port)
            || (!id_header && !f.has_port && crate::routing::is_template_upload(f.method, d))
            || (!id_header && !f.has_port && crate::routing::is_volume_content(d));
        if !exempt && !authorized() {
            return Decision::Reject(StatusCode::UNAUTHORIZED, "");
        }
        if proxy_path {
            if !id_header {
                return Decision::Reject(StatusCode::BAD_REQUEST, "sandbox id header required");
            }
            if !f.has_port {
                return Decision::Reject(StatusCode::BAD_REQUEST, "target port header required");
            }
        }
        let routing_headers = id_header || f.has_port;
        if local_path && matches!(f.host_route, Ok(None)) {
            if !routing_headers {
                return Decision::Local;
            }
            if !id_header {
                return Decision::Reject(StatusCode::BAD_REQUEST, "sandbox id header required");
            }
        }
        let host_route = match f.host_route {
            Ok(r) => r.as_ref(),
            Err(_) => return Decision::BadHost,
        };
        if host_route.is_none()
            && !routing_headers
            && *f.method == Method::POST
            && let Some(node_id) = node_move_from_path(d)
        {
            return Decision::NodeMove(node_id);
        }
        if host_route.is_none() && !routing_headers && *f.method == Method::GET {
            let trimmed = trim_trailing_slashes(d);
            if trimmed == "/sandboxes" || trimmed == "/v2/sandboxes" {
                return Decision::ClusterList {
                    v2: trimmed == "/v2/sandboxes",
                };
            }
            if trimmed == "/sandboxes/metrics" {
                return Decision::SandboxMetrics;
            }
            if trimmed == "/nodes" {
                return Decision::NodeList;
            }
            if let Some(node_id) = node_id_from_path(d) {
                return Decision::NodeDetail(node_id);
            }
        }
        if host_route.is_none()
            && !routing_headers
            && (*f.method == Method::POST || *f.method == Method::DELETE)
            && let Some(node_id) = node_drain_from_path(d)
        {
            return Decision::NodeDrain {
                node_id,
                drain: *f.method == Method::POST,
            };
        }
        let (id, source) = if let Some(r) = host_route {
            if routing_headers {
                tracing::debug!(sandbox_id = %r.sandbox_id, "host route overrides routing headers");
            }
            (Some(r.sandbox_id.as_str()), RouteSource::Host)
        } else if control_plane {
            (path_sandbox_id(d), RouteSource::Path)
        } else if let Some(id) = f.sandbox_id {
            (Some(id), RouteSource::Header)
        } else if let Some(id) = path_sandbox_id(d) {
            (Some(id), RouteSource::Path)
        } else {
            (None, RouteSource::Schedule)
        };
        Decision::Route { id, source }
    }
}

/// The decoded path (bytes that are not UTF-8 become U+FFFD; the raw path
/// is what gets forwarded), or `None` when a `%` is not followed by two hex
/// digits.
pub(crate) fn decode_path(raw: &str) -> Option<Cow<'_, str>> {
    let b = raw.as_bytes();
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            if i + 2 >= b.len() {
                return None;
            }
            if !(b[i + 1].is_ascii_hexdigit() && b[i + 2].is_ascii_hexdigit()) {
                return None;
            }
            i += 3;
        } else {
            i += 1;
        }
    }
    Some(percent_encoding::percent_decode_str(raw).decode_utf8_lossy())
}

#[cfg(test)]
mod tests {
    use http::HeaderValue;

    use super::*;

    const KEY: &str = "key-0123456789";

    fn router(domains: &[&str]) -> Router {
        Router::new(&GatewayOptions {
            api_key: KEY.into(),
            request_timeout: std::time::Duration::from_secs(1),
            forward_response_size: 0,
            sandbox_proxy_domains: domains.iter().map(|d| d.to_string()).collect(),
            debug_mode: false,
            limits: Default::default(),
            console: Default::default(),
            route_cache_ttl: std::time::Duration::ZERO,
        })
        .unwrap()
    }

    /// The decision for `method path` with the given routing headers, and
    /// whether the API key was asked for.
    fn decide(
        method: Method,
        path: &str,
        sandbox_id: Option<&str>,
        has_port: bool,
    ) -> (String, bool) {
        let host_route = Ok(None);
        let facts = RoutingFacts {
            method: &method,
            decoded: path,
            host_route: &host_route,
            sandbox_id,
            has_port,
        };
        let mut asked = false;
        let decision = match router(&[]).decide(&facts, || {
            asked = true;
            true
        }) {
            Decision::Reject(status, message) => format!("reject {status} {message}"),
            Decision::Local => "local".into(),
            Decision::BadHost => "bad host".into(),
            Decision::ClusterList { v2 } => format!("cluster list v2={v2}"),
            Decision::SandboxMetrics => "sandbox metrics".into(),
            Decision::NodeList => "node list".into(),
            Decision::NodeDetail(id) => format!("node {id}"),
            Decision::NodeDrain { node_id, drain } => format!("drain {node_id} {drain}"),
            Decision::NodeMove(id) => format!("node move {id}"),
            Decision::Route { id, source } => format!("route {id:?} {}", source.label()),
        };
        (decision, asked)
    }

    #[test]
    fn requests_are_routed_by_the_rules_both_lanes_share() {
        assert_eq!(
            decide(Method::GET, "/health", None, false),
            ("local".into(), false)
        );
        assert_eq!(
            decide(Method::GET, "/v2/sandboxes/", None, false),
            ("cluster list v2=true".into(), true)
        );
        assert_eq!(
            decide(Method::GET, "/nodes/n1", None, false),
            ("node n1".into(), true)
        );
        assert_eq!(
            decide(Method::POST, "/nodes/n1/drain", None, false),
            ("drain n1 true".into(), true)
        );
        assert_eq!(
            decide(Method::DELETE, "/nodes/n1/drain/", None, false),
            ("drain n1 false".into(), true)
        );
        // Only POST and DELETE drain; a GET goes on to the node as before.
        assert_eq!(
            decide(Method::GET, "/nodes/n1/drain", None, false),
            ("route None schedule".into(), true)
        );
        assert_eq!(
            decide(Method::POST, "/nodes/n1/move", None, false),
            ("node move n1".into(), true)
        );
        // Only POST moves; a GET of it is not the node's detail either.
        assert_eq!(
            decide(Method::GET, "/nodes/n1/move", None, false).0,
            "route None schedule"
        );
        assert_eq!(
            decide(Method::GET, "/sandboxes/metrics", None, false),
            ("sandbox metrics".into(), true)
        );
        // A volume's files: its token, not the key, and any node.
        assert_eq!(
            decide(Method::PUT, "/volumecontent/v1/file", None, false),
            ("route None schedule".into(), false)
        );
        assert_eq!(
            decide(Method::GET, "/volumes", None, false),
            ("route None schedule".into(), true)
        );
        assert_eq!(
            decide(Method::GET, "/v2/sandboxes/sbx-1/logs", None, false),
            ("route Some(\"sbx-1\") path".into(), true)
        );
        assert_eq!(
            decide(Method::POST, "/sandboxes/sbx-1/pause", Some("other"), true),
            ("route Some(\"sbx-1\") path".into(), true)
        );
        // A data-plane request with both routing headers needs no key.
        assert_eq!(
            decide(Method::GET, "/files", Some("sbx-1"), true),
            ("route Some(\"sbx-1\") header".into(), false)
        );
        assert_eq!(
            decide(Method::POST, "/sandboxes", None, false),
            ("route None schedule".into(), true)
        );
        assert_eq!(
            decide(Method::GET, "/proxy/x", Some("sbx-1"), false),
            (
                "reject 400 Bad Request target port header required".into(),
                false
            )
        );
    }

    #[test]
    fn only_one_api_key_header_with_the_key_is_authorized() {
        let r = router(&[]);
        let mut headers = HeaderMap::new();
        assert!(!r.authorized(&headers));
        headers.insert(API_KEY_HEADER, HeaderValue::from_static(KEY));
        assert!(r.authorized(&headers));
        headers.append(API_KEY_HEADER, HeaderValue::from_static(KEY));
        assert!(!r.authorized(&headers));
        assert!(!r.key_matches(b"key-012345678"));
    }

    #[test]
    fn an_empty_key_or_a_bad_domain_is_refused() {
        let opts = |key: &str, domain: &str| GatewayOptions {
            api_key: key.into(),
            request_timeout: std::time::Duration::from_secs(1),
            forward_response_size: 0,
            sandbox_proxy_domains: vec![domain.into()],
            debug_mode: false,
            limits: Default::default(),
            console: Default::default(),
            route_cache_ttl: std::time::Duration::ZERO,
        };
        assert!(matches!(
            Router::new(&opts("", "example.com")),
            Err(GatewayError::EmptyApiKey)
        ));
        assert!(matches!(
            Router::new(&opts(KEY, "not a domain")),
            Err(GatewayError::Domain(_))
        ));
        assert!(
            router(&["sandbox.example.com"])
                .host_route("49983-sbx-1.sandbox.example.com")
                .unwrap()
                .is_some()
        );
    }

    #[test]
    fn paths_with_broken_escapes_are_rejected() {
        assert_eq!(decode_path("/a%2Fb").as_deref(), Some("/a/b"));
        assert_eq!(decode_path("/a%20b").as_deref(), Some("/a b"));
        assert_eq!(decode_path("/a%zz"), None);
        assert_eq!(decode_path("/a%2"), None);
        assert_eq!(decode_path("/a%"), None);
        assert_eq!(decode_path("/a%ff").as_deref(), Some("/a\u{FFFD}"));
    }
}
