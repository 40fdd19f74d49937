//! Request classification: routing headers, sandbox ids in paths, the
//! control-plane table, long-lived requests, metric route labels.

use http::header::AsHeaderName;
use http::{HeaderMap, HeaderName, Method};

pub const SANDBOX_ID_HEADER: &str = "x-agentenv-sandbox-id";
pub const E2B_SANDBOX_ID_HEADER: &str = "e2b-sandbox-id";
pub const TARGET_PORT_HEADER: &str = "x-agentenv-target-port";
pub const E2B_SANDBOX_PORT_HEADER: &str = "e2b-sandbox-port";
pub const NODE_ID_HEADER: &str = "x-agentenv-node-id";
pub const API_KEY_HEADER: &str = "x-api-key";
pub const NEXT_TOKEN_HEADER: &str = "x-next-token";
pub use agentenv_core::idempotency::IDEMPOTENCY_KEY_HEADER;
/// On a cluster list: the ids of the nodes that did not answer, comma-separated.
pub const MISSING_NODES_HEADER: &str = "x-agentenv-missing-nodes";

// The same names, parsed once: a lookup by `HeaderName` skips parsing.
static SANDBOX_ID: HeaderName = HeaderName::from_static(SANDBOX_ID_HEADER);
static E2B_SANDBOX_ID: HeaderName = HeaderName::from_static(E2B_SANDBOX_ID_HEADER);
static TARGET_PORT: HeaderName = HeaderName::from_static(TARGET_PORT_HEADER);
static E2B_SANDBOX_PORT: HeaderName = HeaderName::from_static(E2B_SANDBOX_PORT_HEADER);
static CONNECT_PROTOCOL_VERSION: HeaderName = HeaderName::from_static("connect-protocol-version");

/// Where the sandbox id (or the node) of a proxied request came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RouteSource {
    /// `<port>-<id>.<proxy domain>`.
    Host,
    /// `/sandboxes/{id}/…`.
    Path,
    /// `x-agentenv-sandbox-id` / `e2b-sandbox-id`.
    Header,
    /// No sandbox: a node picked by `Schedule`.
    Schedule,
    /// Answered by the gateway itself (lists, node detail).
    Gateway,
    /// Not routed (rejected before routing).
    Unknown,
}

impl RouteSource {
    pub fn label(self) -> &'static str {
        match self {
            Self::Host => "host",
            Self::Path => "path",
            Self::Header => "header",
            Self::Schedule => "schedule",
            Self::Gateway => "gateway",
            Self::Unknown => "unknown",
        }
    }

    /// Data-plane routes (for a sandbox's ports, checked by the node against
    /// the sandbox's tokens) are forwarded under `/proxy`, without the API key.
    pub fn is_data_plane(self) -> bool {
        matches!(self, Self::Host | Self::Header)
    }
}

/// The first non-blank value of `name`, trimmed.
pub fn header_str(headers: &HeaderMap, name: impl AsHeaderName) -> Option<&str> {
    headers
        .get_all(name)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .map(str::trim)
        .find(|v| !v.is_empty())
}

/// The sandbox id from `x-agentenv-sandbox-id`, else `e2b-sandbox-id`.
pub fn sandbox_id_from_headers(headers: &HeaderMap) -> Option<&str> {
    header_str(headers, &SANDBOX_ID).or_else(|| header_str(headers, &E2B_SANDBOX_ID))
}

/// The target port from `x-agentenv-target-port`, else `e2b-sandbox-port`.
pub fn target_port_from_headers(headers: &HeaderMap) -> Option<&str> {
    header_str(headers, &TARGET_PORT).or_else(|| header_str(headers, &E2B_SANDBOX_PORT))
}

/// Any of the four routing headers is non-blank.
pub fn has_routing_headers(headers: &HeaderMap) -> bool {
    sandbox_id_from_headers(headers).is_some() || target_port_from_headers(headers).is_some()
}

/// `/proxy` or `/proxy/…`.
pub fn is_proxy_path(path: &str) -> bool {
    path == "/proxy" || path.starts_with("/proxy/")
}

/// `path` without trailing slashes (`/` stays `/`).
pub fn trim_trailing_slashes(path: &str) -> &str {
    let t = path.trim_end_matches('/');
    if t.is_empty() { "/" } else { t }
}

/// Up to the first five `/`-separated segments of a path, without
/// allocating: every pattern matched against them is at most four segments
/// long or ends in `..`, so a longer path still matches and mismatches
/// exactly as with all its segments.
struct Segments<'a> {
    buf: [&'a str; 5],
    len: usize,
}

impl<'a> Segments<'a> {
    fn as_slice(&self) -> &[&'a str] {
        &self.buf[..self.len]
    }
}

fn segments(path: &str) -> Segments<'_> {
    let mut buf = [""; 5];
    let mut len = 0;
    for seg in path.trim_matches('/').split('/') {
        if len == buf.len() {
            break;
        }
        buf[len] = seg;
        len += 1;
    }
    Segments { buf, len }
}

/// The sandbox id of `/sandboxes/{id}[/…]` (and `/v2/sandboxes/{id}[/…]`).
pub fn path_sandbox_id(path: &str) -> Option<&str> {
    let segs = segments(path);
    let segs = match segs.as_slice() {
        ["v2", rest @ ..] => rest,
        all => all,
    };
    match segs {
        ["sandboxes", id, ..] if !id.is_empty() => Some(id),
        _ => None,
    }
}

/// `PUT /templates/{id}/files/{hash}`: the upload of a template build's files, to the
/// link the API gave. The SDKs send no API key there; the link carries a signature the
/// node checks, so the gateway lets it through without the key.
pub fn is_template_upload(method: &Method, path: &str) -> bool {
    *method == Method::PUT
        && matches!(segments(path).as_slice(), ["templates", id, "files", hash] if !id.is_empty() && !hash.is_empty())
}

/// `/volumecontent/{volume_id}/…`: a volume's files, reached with the volume's own token
/// (`Authorization: Bearer`, which the node checks) instead of the API key, as the SDKs'
/// volume clients send them. Volumes live on the shared store: any node serves them.
pub fn is_volume_content(path: &str) -> bool {
    matches!(segments(path).as_slice(), ["volumecontent", id, _, ..] if !id.is_empty())
}

/// A sandbox control-plane request: forwarded by path id without `/proxy`,
/// and never exempt from the API key.
pub fn is_control_plane(method: &Method, path: &str) -> bool {
    let segs = segments(path);
    match segs.as_slice() {
        ["sandboxes", id] if !id.is_empty() => *method == Method::GET || *method == Method::DELETE,
        ["sandboxes", id, action] if !id.is_empty() => match *action {
            "pause" | "resume" | "fork" | "connect" | "timeout" | "refreshes" | "snapshots" => {
                *method == Method::POST
            }
            "network" => *method == Method::PUT,
            "metrics" | "logs" => *method == Method::GET,
            "custom-extension-params" => *method == Method::GET || *method == Method::PATCH,
            _ => false,
        },
        ["v2", "sandboxes", id, "connect"] if !id.is_empty() => *method == Method::POST,
        ["v2", "sandboxes", id, "logs"] if !id.is_empty() => *method == Method::GET,
        _ => false,
    }
}

/// What kind of sandbox a create request makes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CreateKind {
    /// `POST /sandboxes`, `POST /v2/sandboxes`.
    Sandbox,
    /// `POST /sandboxes-cold`.
    Cold,
}

/// The create kind of `POST /sandboxes`, `/v2/sandboxes` or `/sandboxes-cold`.
pub fn create_kind(method: &Method, path: &str) -> Option<CreateKind> {
    if *method != Method::POST {
        return None;
    }
    match trim_trailing_slashes(path) {
        "/sandboxes" | "/v2/sandboxes" => Some(CreateKind::Sandbox),
        "/sandboxes-cold" => Some(CreateKind::Cold),
        _ => None,
    }
}

/// Whether a successful response must be followed by `RecordAssignment`:
/// a scheduled create, or a path-routed fork.
pub fn records_assignment(method: &Method, path: &str, source: RouteSource) -> bool {
    if *method != Method::POST {
        return false;
    }
    match source {
        RouteSource::Schedule => create_kind(method, path).is_some(),
        RouteSource::Path => {
            matches!(segments(path).as_slice(), ["sandboxes", id, "fork"] if !id.is_empty())
        }
        _ => false,
    }
}

/// The node id of `POST /nodes/{id}/move`.
pub fn node_move_from_path(path: &str) -> Option<&str> {
    match segments(path).as_slice() {
        ["nodes", id, "move"] if !id.is_empty() => Some(id),
        _ => None,
    }
}

/// The node id of `/nodes/{id}[/]`.
pub fn node_id_from_path(path: &str) -> Option<&str> {
    match segments(path).as_slice() {
        ["nodes", id] if !id.is_empty() => Some(id),
        _ => None,
    }
}

/// The node id of `/nodes/{id}/drain[/]`.
pub fn node_drain_from_path(path: &str) -> Option<&str> {
    match segments(path).as_slice() {
        ["nodes", id, "drain"] if !id.is_empty() => Some(id),
        _ => None,
    }
}

/// A WebSocket upgrade: `Upgrade: websocket` and a `Connection` token `upgrade`.
pub fn is_websocket(headers: &HeaderMap) -> bool {
    let upgrade = headers.get_all(http::header::UPGRADE).iter().any(|v| {
        v.to_str()
            .is_ok_and(|s| s.trim().eq_ignore_ascii_case("websocket"))
    });
    upgrade && has_token(headers, http::header::CONNECTION, "upgrade")
}

/// A streaming request: gRPC, gRPC-web, Connect streams, SSE, or `Te: trailers`.
pub fn is_streaming(headers: &HeaderMap) -> bool {
    let content_type = headers
        .get(http::header::CONTENT_TYPE)
        .map(|v| v.as_bytes().trim_ascii())
        .unwrap_or_default();
    let starts_with = |prefix: &[u8]| {
        content_type
            .get(..prefix.len())
            .is_some_and(|p| p.eq_ignore_ascii_case(prefix))
    };
    starts_with(b"application/grpc")
        || starts_with(b"application/connect+")
        || header_str(headers, &CONNECT_PROTOCOL_VERSION).is_some()
        || headers.get_all(http::header::ACCEPT).iter().any(|v| {
            v.to_str()
                .is_ok_and(|s| s.trim().eq_ignore_ascii_case("text/event-stream"))
        })
        || has_token(headers, http::header::TE, "trailers")
}

/// Long-lived requests run without `request_timeout`.
pub fn is_long_lived(headers: &HeaderMap) -> bool {
    is_websocket(headers) || is_streaming(headers)
}

/// `POST /process.Process/StreamInput`: a client closing it is routine.
pub fn is_stream_input(method: &Method, path: &str) -> bool {
    *method == Method::POST && path == "/process.Process/StreamInput"
}

/// Whether a comma-separated header contains `token` (case-insensitive).
pub fn has_token(headers: &HeaderMap, name: impl AsHeaderName, token: &str) -> bool {
    headers.get_all(name).iter().any(|v| {
        v.to_str()
            .is_ok_and(|s| s.split(',').any(|t| t.trim().eq_ignore_ascii_case(token)))
    })
}

/// The `route` metric label of a (decoded, original) path.
pub fn route_label(path: &str) -> &'static str {
    let p = trim_trailing_slashes(path);
    match p {
        "/sandboxes" => return "/sandboxes",
        "/sandboxes-cold" => return "/sandboxes-cold",
        "/v2/sandboxes" => return "/v2/sandboxes",
        "/nodes" => return "/nodes",
        _ => {}
    }
    match segments(p).as_slice() {
        ["sandboxes", id] if !id.is_empty() => "/sandboxes/{sandbox_id}",
        ["sandboxes", id, action] if !id.is_empty() => match *action {
            "snapshots" => "/sandboxes/{sandbox_id}/snapshots",
            "custom-extension-params" => "/sandboxes/{sandbox_id}/custom-extension-params",
            "pause" => "/sandboxes/{sandbox_id}/pause",
            "resume" => "/sandboxes/{sandbox_id}/resume",
            "fork" => "/sandboxes/{sandbox_id}/fork",
            _ => "unmatched",
        },
        ["nodes", id] if !id.is_empty() => "/nodes/{node_id}",
        ["nodes", id, "drain"] if !id.is_empty() => "/nodes/{node_id}/drain",
        ["proxy", ..] => "/proxy/*",
        _ => "unmatched",
    }
}

pub use agentenv_core::metrics::{method_label, status_label};

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(
                http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
                HeaderValue::from_str(v).unwrap(),
            );
        }
        h
    }

    #[test]
    fn sandbox_id_header_prefers_agentenv_then_e2b() {
        assert_eq!(
            sandbox_id_from_headers(&headers(&[
                ("x-agentenv-sandbox-id", "a"),
                ("e2b-sandbox-id", "b")
            ])),
            Some("a")
        );
        assert_eq!(
            sandbox_id_from_headers(&headers(&[
                ("x-agentenv-sandbox-id", "  "),
                ("E2B-Sandbox-Id", "b")
            ])),
            Some("b")
        );
        assert_eq!(sandbox_id_from_headers(&headers(&[])), None);
    }

    #[test]
    fn routing_header_detection_needs_a_sandbox_or_port_header() {
        assert!(has_routing_headers(&headers(&[(
            "x-agentenv-sandbox-id",
            "a"
        )])));
        assert!(has_routing_headers(&headers(&[(
            "e2b-sandbox-port",
            "49983"
        )])));
        assert!(!has_routing_headers(&headers(&[("x-other", "1")])));
    }

    #[test]
    fn path_ids_come_from_sandbox_detail_paths_only() {
        assert_eq!(path_sandbox_id("/sandboxes/sbx-123"), Some("sbx-123"));
        assert_eq!(path_sandbox_id("/sandboxes/sbx-123/pause"), Some("sbx-123"));
        assert_eq!(
            path_sandbox_id("/sandboxes/sbx-123/timeout"),
            Some("sbx-123")
        );
        assert_eq!(
            path_sandbox_id("/v2/sandboxes/sbx-123/connect"),
            Some("sbx-123")
        );
        for p in [
            "/sandboxes",
            "/sandboxes-cold",
            "/v2/sandboxes",
            "/templates/abc",
            "/sandboxes//pause",
        ] {
            assert_eq!(path_sandbox_id(p), None, "{p}");
        }
    }

    #[test]
    fn only_template_file_uploads_pass_without_the_key() {
        assert!(is_template_upload(
            &Method::PUT,
            "/templates/abc/files/0123"
        ));
        assert!(!is_template_upload(
            &Method::GET,
            "/templates/abc/files/0123"
        ));
        assert!(!is_template_upload(&Method::PUT, "/templates/abc/files"));
        assert!(!is_template_upload(
            &Method::PUT,
            "/templates/abc/files/x/y"
        ));
        assert!(!is_template_upload(&Method::PUT, "/sandboxes/abc/files/x"));
    }

    #[test]
    fn control_plane_table_matches_methods_and_actions() {
        let cp = |m: Method, p: &str| is_control_plane(&m, p);
        assert!(cp(Method::GET, "/sandboxes/x"));
        assert!(cp(Method::DELETE, "/sandboxes/x"));
        assert!(cp(Method::POST, "/sandboxes/x/pause"));
        assert!(cp(Method::POST, "/sandboxes/x/fork"));
        assert!(cp(Method::POST, "/sandboxes/x/connect"));
        assert!(cp(Method::POST, "/v2/sandboxes/x/connect"));
        assert!(cp(Method::PUT, "/sandboxes/x/network"));
        assert!(cp(Method::GET, "/sandboxes/x/custom-extension-params"));
        assert!(cp(Method::PATCH, "/sandboxes/x/custom-extension-params"));
        assert!(!cp(Method::POST, "/sandboxes/x/network"));
        assert!(!cp(Method::POST, "/sandboxes/x/custom-extension-params"));
        assert!(!cp(Method::GET, "/sandboxes/x/files"));
        assert!(!cp(Method::GET, "/sandboxes"));
    }

    #[test]
    fn node_ids_come_from_exactly_two_segments() {
        assert_eq!(node_id_from_path("/nodes/node-a"), Some("node-a"));
        assert_eq!(node_id_from_path("/nodes/node-a/"), Some("node-a"));
        assert_eq!(node_id_from_path("/nodes"), None);
        assert_eq!(node_id_from_path("/nodes/node-a/extra"), None);
    }

    #[test]
    fn record_assignment_runs_for_scheduled_creates_and_path_routed_forks() {
        use RouteSource::*;
        let r = |m: Method, p: &str, s| records_assignment(&m, p, s);
        assert!(r(Method::POST, "/sandboxes", Schedule));
        assert!(r(Method::POST, "/sandboxes/", Schedule));
        assert!(r(Method::POST, "/sandboxes-cold", Schedule));
        assert!(r(Method::POST, "/sandboxes-cold/", Schedule));
        assert!(r(Method::POST, "/v2/sandboxes", Schedule));
        assert!(r(Method::POST, "/sandboxes/sbx/fork", Path));
        assert!(!r(Method::POST, "/sandboxes/sbx/fork", Header));
        assert!(!r(Method::POST, "/sandboxes/sbx/fork", Host));
        assert!(!r(Method::GET, "/sandboxes", Schedule));
        assert!(!r(Method::GET, "/sandboxes-cold", Schedule));
        assert!(!r(Method::POST, "/sandboxes/sbx/pause", Path));
        assert!(!r(Method::POST, "/templates", Schedule));
    }

    #[test]
    fn streaming_detection_covers_grpc_connect_sse_and_trailers() {
        for h in [
            headers(&[("content-type", "application/grpc")]),
            headers(&[("content-type", "application/grpc-web+proto")]),
            headers(&[("content-type", "application/connect+proto")]),
            headers(&[("connect-protocol-version", "1")]),
            headers(&[("accept", "Text/Event-Stream")]),
            headers(&[("te", "gzip, trailers")]),
        ] {
            assert!(is_streaming(&h), "{h:?}");
        }
        assert!(!is_streaming(&headers(&[(
            "content-type",
            "application/json"
        )])));
    }

    #[test]
    fn websocket_detection_needs_upgrade_and_connection_token() {
        assert!(is_websocket(&headers(&[
            ("upgrade", "WebSocket"),
            ("connection", "keep-alive, Upgrade")
        ])));
        assert!(!is_websocket(&headers(&[("upgrade", "websocket")])));
        assert!(!is_websocket(&headers(&[("connection", "upgrade")])));
    }

    #[test]
    fn stream_input_is_only_the_process_stream_input_post() {
        assert!(is_stream_input(
            &Method::POST,
            "/process.Process/StreamInput"
        ));
        assert!(!is_stream_input(
            &Method::GET,
            "/process.Process/StreamInput"
        ));
        assert!(!is_stream_input(&Method::POST, "/process.Process/Start"));
    }

    #[test]
    fn route_labels_name_known_routes_and_collapse_the_rest() {
        assert_eq!(route_label("/nodes/n1/drain"), "/nodes/{node_id}/drain");
        assert_eq!(route_label("/v2/sandboxes"), "/v2/sandboxes");
        assert_eq!(route_label("/sandboxes/"), "/sandboxes");
        assert_eq!(
            route_label("/sandboxes/x/pause"),
            "/sandboxes/{sandbox_id}/pause"
        );
        assert_eq!(
            route_label("/sandboxes/x/resume"),
            "/sandboxes/{sandbox_id}/resume"
        );
        assert_eq!(
            route_label("/sandboxes/x/fork"),
            "/sandboxes/{sandbox_id}/fork"
        );
        assert_eq!(
            route_label("/sandboxes/x/custom-extension-params"),
            "/sandboxes/{sandbox_id}/custom-extension-params"
        );
        assert_eq!(route_label("/sandboxes/x"), "/sandboxes/{sandbox_id}");
        assert_eq!(route_label("/nodes/a"), "/nodes/{node_id}");
        assert_eq!(route_label("/proxy/a/b"), "/proxy/*");
        assert_eq!(route_label("/"), "unmatched");
        assert_eq!(route_label("/sandboxes/x/connect"), "unmatched");
        assert_eq!(route_label("/sandboxes/x/timeout"), "unmatched");
        assert_eq!(status_label(101), "1xx");
        assert_eq!(status_label(204), "2xx");
        assert_eq!(status_label(404), "4xx");
        assert_eq!(status_label(503), "5xx");
        assert_eq!(status_label(999), "other");
        assert_eq!(method_label(&Method::CONNECT), "OTHER");
    }
    #[test]
    fn paths_longer_than_five_segments_match_like_shorter_ones() {
        assert_eq!(path_sandbox_id("/sandboxes/a/b/c/d/e/f"), Some("a"));
        assert_eq!(path_sandbox_id("/v2/sandboxes/a/b/c/d/e/f"), Some("a"));
        assert!(!is_control_plane(&Method::POST, "/sandboxes/a/pause/x/y/z"));
        assert!(!is_control_plane(
            &Method::POST,
            "/v2/sandboxes/a/connect/x"
        ));
        assert_eq!(route_label("/proxy/a/b/c/d/e/f/g"), "/proxy/*");
        assert_eq!(route_label("/sandboxes/a/pause/b/c/d/e"), "unmatched");
        assert_eq!(node_id_from_path("/nodes/n/a/b/c/d"), None);
    }
}
