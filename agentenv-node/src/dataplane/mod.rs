//! The data plane: requests for a sandbox's agent or any guest port, recognised by the
//! `/proxy` prefix, by routing headers, or by a `<port>-<id>.<domain>` host, checked
//! against the sandbox's access rules and relayed to the sandbox without buffering.
//! WebSocket (and any other) upgrades are bridged byte for byte.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Request, Response, StatusCode, Version};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

use crate::access::TokenIssuer;
use crate::backend::AGENT_PORT;
use crate::ids::{is_uuid, parse_sandbox_id};
use crate::lifecycle::SandboxRecord;

mod pool;
pub use pool::{IDLE_TIMEOUT, SandboxPool};

/// The body type of every response the node sends.
pub type Body = http_body_util::combinators::UnsyncBoxBody<Bytes, BoxError>;
/// Errors of streamed bodies.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// How long connecting to a sandbox may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Errors of relaying one request.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    #[error("connecting to {addr}: {reason}")]
    Connect { addr: SocketAddr, reason: String },
    #[error("relaying to the sandbox: {0}")]
    Upstream(#[from] hyper::Error),
    /// A relay on a kept connection failed (the message holds the causes).
    #[error("relaying to the sandbox: {0}")]
    Pooled(String),
    #[error("building the upstream request: {0}")]
    Request(#[from] http::Error),
    #[error("the sandbox sent no response headers within {0:?} after the request body ended")]
    HeaderTimeout(Duration),
}

/// Timeouts of a relay.
#[derive(Debug, Clone, Copy)]
pub struct RelayTimeouts {
    /// How long the client may pause while sending the request body.
    pub upload_idle: Duration,
    /// How long the sandbox may take to send response headers once the body has ended.
    pub response_headers: Duration,
}

impl Default for RelayTimeouts {
    fn default() -> Self {
        Self {
            upload_idle: Duration::from_secs(30),
            response_headers: Duration::from_secs(30),
        }
    }
}

/// A request body that reports its end and fails when the client stalls.
struct Upload {
    inner: Incoming,
    idle: Duration,
    timer: std::pin::Pin<Box<tokio::time::Sleep>>,
    done: Option<tokio::sync::oneshot::Sender<()>>,
}

#[derive(Debug, thiserror::Error)]
#[error("the client sent no request data for {0:?}")]
struct UploadIdle(Duration);

impl hyper::body::Body for Upload {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, BoxError>>> {
        use std::task::Poll;
        let this = &mut *self;
        match std::pin::Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(f))) => {
                let deadline = tokio::time::Instant::now() + this.idle;
                this.timer.as_mut().reset(deadline);
                if this.inner.is_end_stream()
                    && let Some(d) = this.done.take()
                {
                    // The client (hyper) may not poll a body that says it has ended.
                    let _ = d.send(());
                }
                Poll::Ready(Some(Ok(f)))
            }
            Poll::Ready(other) => {
                if let Some(d) = this.done.take() {
                    let _ = d.send(());
                }
                Poll::Ready(other.map(|r| r.map_err(|e| Box::new(e) as BoxError)))
            }
            Poll::Pending => match this.timer.as_mut().poll(cx) {
                Poll::Ready(()) => {
                    this.done.take();
                    Poll::Ready(Some(Err(Box::new(UploadIdle(this.idle)))))
                }
                Poll::Pending => Poll::Pending,
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.inner.size_hint()
    }
}

/// Where a data-plane request goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    pub sandbox_id: String,
    pub port: u16,
    /// Path and query sent to the sandbox.
    pub path_and_query: String,
    pub source: RouteSource,
}

/// How the route was found (a metrics label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RouteSource {
    Host,
    Header,
    Prefix,
}

impl RouteSource {
    pub fn label(self) -> &'static str {
        match self {
            RouteSource::Host => "proxy_host",
            RouteSource::Header => "proxy_header",
            RouteSource::Prefix => "proxy_prefix",
        }
    }
}

/// The result of looking at a request's host and headers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Classified {
    /// Not a data-plane request.
    ControlPlane,
    /// A data-plane request with a valid route.
    Proxy(Target),
    /// A host under a sandbox domain that is not `<port>-<uuid>.<domain>`.
    BadHost(String),
    /// `/proxy…` without usable routing headers.
    BadHeaders(String),
}

fn header_str<'a>(h: &'a HeaderMap, name: &str) -> Option<&'a str> {
    h.get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .filter(|s| !s.is_empty())
}

/// The routing headers' sandbox id (AgentENV names win over E2B names).
pub fn header_sandbox_id(h: &HeaderMap) -> Option<&str> {
    header_str(h, "x-agentenv-sandbox-id").or_else(|| header_str(h, "e2b-sandbox-id"))
}

fn header_port(h: &HeaderMap) -> Option<&str> {
    header_str(h, "x-agentenv-target-port").or_else(|| header_str(h, "e2b-sandbox-port"))
}

fn parse_port(s: &str) -> Option<u16> {
    s.parse::<u16>().ok().filter(|p| *p > 0)
}

fn from_headers(h: &HeaderMap, path_and_query: String, source: RouteSource) -> Classified {
    let Some(id) = header_sandbox_id(h) else {
        return Classified::BadHeaders(
            "missing sandbox routing header: send x-agentenv-sandbox-id (or e2b-sandbox-id)".into(),
        );
    };
    let sandbox_id = match parse_sandbox_id(id) {
        Ok(id) => id,
        Err(e) => return Classified::BadHeaders(e.to_string()),
    };
    let port = match header_port(h) {
        None => AGENT_PORT,
        Some(p) => match parse_port(p) {
            Some(p) => p,
            None => {
                return Classified::BadHeaders(format!("invalid sandbox port {p:?}: use 1..65535"));
            }
        },
    };
    Classified::Proxy(Target {
        sandbox_id,
        port,
        path_and_query,
        source,
    })
}

/// Classifies a request. `route_matched` says whether a control-plane route matched.
pub fn classify<B>(req: &Request<B>, domains: &[String], route_matched: bool) -> Classified {
    let pq = req
        .uri()
        .path_and_query()
        .map(|p| p.as_str().to_string())
        .unwrap_or_else(|| "/".into());
    if let Some(host) = request_host(req) {
        let host = host.trim_end_matches('.').to_ascii_lowercase();
        let host = host.rsplit_once(':').map_or(host.as_str(), |(h, p)| {
            if p.bytes().all(|b| b.is_ascii_digit()) {
                h
            } else {
                host.as_str()
            }
        });
        for d in domains {
            if let Some(label) = host
                .strip_suffix(d.as_str())
                .and_then(|l| l.strip_suffix('.'))
            {
                let parsed = label.split_once('-').and_then(|(port, id)| {
                    let port = parse_port(port)?;
                    (is_uuid(id) && !label.contains('.')).then(|| (port, id.to_string()))
                });
                return match parsed {
                    Some((port, id)) => Classified::Proxy(Target {
                        sandbox_id: id,
                        port,
                        path_and_query: pq,
                        source: RouteSource::Host,
                    }),
                    None => Classified::BadHost(format!(
                        "invalid sandbox host {host:?}: use <port>-<sandbox id>.{d}"
                    )),
                };
            }
        }
    }
    let path = req.uri().path();
    if path == "/proxy" || path.starts_with("/proxy/") {
        let rest = &pq["/proxy".len()..];
        let rest = if rest.is_empty() || rest.starts_with('?') {
            format!("/{rest}")
        } else {
            rest.to_string()
        };
        return from_headers(req.headers(), rest, RouteSource::Prefix);
    }
    if !route_matched && header_sandbox_id(req.headers()).is_some() {
        return from_headers(req.headers(), pq, RouteSource::Header);
    }
    Classified::ControlPlane
}

fn request_host<B>(req: &Request<B>) -> Option<String> {
    req.headers()
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
        .or_else(|| req.uri().host().map(str::to_string))
}

/// What the access check decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Allowed; keep `X-Access-Token` (it was validated for an agent request).
    Allowed { keep_access_token: bool },
    /// No valid credential.
    Denied,
    /// An agent call only the node itself may make (`/init`).
    NodeOnly,
}

/// Agent paths the data plane never relays: the node initialises the agent itself
/// (access token, environment, clock), so a client calling them could lock the owner
/// out. The agent matches paths exactly as sent, so an exact comparison suffices.
pub const NODE_ONLY_AGENT_PATHS: [&str; 1] = ["/init"];

/// Whether `path_and_query` names a node-only agent call.
pub fn is_node_only(path_and_query: &str) -> bool {
    let path = path_and_query
        .split_once('?')
        .map_or(path_and_query, |(p, _)| p);
    NODE_ONLY_AGENT_PATHS.contains(&path)
}

/// Whether the request is a signed `/files` URL (a `signature` query parameter): the
/// agent checks the signature against the sandbox's token itself.
fn is_signed_files_url(path_and_query: &str) -> bool {
    let Some((path, query)) = path_and_query.split_once('?') else {
        return false;
    };
    path == "/files"
        && query
            .split('&')
            .any(|kv| kv.split_once('=').map_or(kv, |(k, _)| k) == "signature")
}

/// The data-plane access rules. The agent port of every sandbox needs its envd token
/// (exactly one `X-Access-Token`), whatever the create asked for; a signed `/files` URL
/// without a token goes on to the agent, which checks the signature; node-only agent
/// calls are refused. Another port of a sandbox without public traffic needs its
/// traffic token. The API key never grants access.
pub fn check_access(
    rec: &SandboxRecord,
    target: &Target,
    h: &HeaderMap,
    tokens: &TokenIssuer,
) -> Access {
    if target.port == AGENT_PORT {
        if is_node_only(&target.path_and_query) {
            return Access::NodeOnly;
        }
        let mut vals = h.get_all("x-access-token").iter();
        match (vals.next(), vals.next()) {
            (Some(v), None) if tokens.verify_envd(&rec.id, v.as_bytes()) => Access::Allowed {
                keep_access_token: true,
            },
            (None, None) if is_signed_files_url(&target.path_and_query) => Access::Allowed {
                keep_access_token: false,
            },
            _ => Access::Denied,
        }
    } else if rec.options.allow_public_traffic {
        Access::Allowed {
            keep_access_token: false,
        }
    } else {
        let mut vals = h.get_all("e2b-traffic-access-token").iter();
        match (vals.next(), vals.next()) {
            (Some(v), None) if tokens.verify_traffic(&rec.id, v.as_bytes()) => Access::Allowed {
                keep_access_token: false,
            },
            _ => Access::Denied,
        }
    }
}

const HOP_BY_HOP: [&str; 8] = [
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

fn strip_hop_by_hop(h: &mut HeaderMap) {
    let named: Vec<HeaderName> = h
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|n| HeaderName::from_bytes(n.trim().as_bytes()).ok())
        .collect();
    for n in named {
        h.remove(n);
    }
    for n in HOP_BY_HOP {
        h.remove(n);
    }
}

fn is_upgrade<B>(req: &Request<B>) -> bool {
    req.headers().contains_key(header::UPGRADE)
        && req
            .headers()
            .get_all(header::CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .any(|v| {
                v.split(',')
                    .any(|t| t.trim().eq_ignore_ascii_case("upgrade"))
            })
}

/// Options of one relay.
pub struct Relay<'a> {
    pub upstream: SocketAddr,
    pub timeouts: RelayTimeouts,
    pub target: &'a Target,
    pub keep_access_token: bool,
    pub api_key: &'a str,
    /// Kept connections to sandboxes (see [`SandboxPool`]).
    pub pool: &'a SandboxPool,
}

/// Whether a request takes a kept connection: not an upgrade, and not an upload (which
/// the agent serves fastest as a connection's first request).
fn pooled<B>(req: &Request<B>, upgrade: bool, path_and_query: &str) -> bool {
    let upload = req.method() == http::Method::POST && path_and_query.starts_with("/files");
    !(upgrade || upload)
}

/// Relays `req` to the sandbox and returns its response, bodies streaming both ways.
pub async fn relay(mut req: Request<Incoming>, r: Relay<'_>) -> Result<Response<Body>, ProxyError> {
    let upgrade = is_upgrade(&req);
    let use_pool = pooled(&req, upgrade, &r.target.path_and_query);
    let client_upgrade = upgrade.then(|| hyper::upgrade::on(&mut req));
    let (parts, body) = req.into_parts();
    let original_host = parts.headers.get(header::HOST).cloned().or_else(|| {
        parts
            .uri
            .authority()
            .and_then(|a| HeaderValue::from_str(a.as_str()).ok())
    });
    let upgrade_value = parts.headers.get(header::UPGRADE).cloned();
    let mut headers = parts.headers;
    strip_hop_by_hop(&mut headers);
    for n in [
        "x-agentenv-sandbox-id",
        "e2b-sandbox-id",
        "x-agentenv-target-port",
        "e2b-sandbox-port",
        "e2b-traffic-access-token",
    ] {
        headers.remove(n);
    }
    if !r.keep_access_token {
        headers.remove("x-access-token");
    }
    let drop_key = {
        let mut vals = headers.get_all("x-api-key").iter();
        vals.any(|v| v.as_bytes() == r.api_key.as_bytes())
    };
    if drop_key {
        headers.remove("x-api-key");
    }
    headers.remove(header::HOST);
    if let Ok(v) = HeaderValue::from_str(&r.upstream.to_string()) {
        headers.insert(header::HOST, v);
    }
    if let Some(h) = original_host {
        headers.insert("x-forwarded-host", h);
    }
    headers.insert(
        "x-forwarded-proto",
        HeaderValue::from_static(if upgrade { "ws" } else { "http" }),
    );
    if let Ok(v) = HeaderValue::from_str(parts.method.as_str()) {
        headers.insert("x-forwarded-method", v);
    }
    if let Ok(v) = HeaderValue::from_str(&r.target.path_and_query) {
        headers.insert("x-forwarded-uri", v);
    }
    if let Some(u) = &upgrade_value {
        headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        headers.insert(header::UPGRADE, u.clone());
    }
    let up = Request::builder()
        .method(parts.method)
        .uri(r.target.path_and_query.as_str())
        .version(Version::HTTP_11)
        .body(())?;
    let (body_done, body_ended) = tokio::sync::oneshot::channel();
    let body_done = if hyper::body::Body::is_end_stream(&body) {
        // Nothing to send: the header clock starts now.
        let _ = body_done.send(());
        None
    } else {
        Some(body_done)
    };
    let body = Upload {
        inner: body,
        idle: r.timeouts.upload_idle,
        timer: Box::pin(tokio::time::sleep(r.timeouts.upload_idle)),
        done: body_done,
    };
    let mut up = up.map(|()| body);
    *up.headers_mut() = headers;

    let header_limit = r.timeouts.response_headers;
    let header_timeout = async {
        // Only once the whole body is sent does the header clock start.
        if body_ended.await.is_err() {
            std::future::pending::<()>().await;
        }
        tokio::time::sleep(header_limit).await;
    };
    let kept = if use_pool {
        pool::uri(r.upstream, &r.target.sandbox_id, &r.target.path_and_query)
    } else {
        None
    };
    let mut resp = if let Some(uri) = kept {
        *up.uri_mut() = uri;
        tokio::select! {
            resp = r.pool.request(up) => resp.map_err(|e| {
                let mut causes = Vec::new();
                let mut cause = std::error::Error::source(&e);
                while let Some(c) = cause {
                    causes.push(c.to_string());
                    cause = c.source();
                }
                let reason = if causes.is_empty() { e.to_string() } else { causes.join(": ") };
                if e.is_connect() {
                    ProxyError::Connect { addr: r.upstream, reason }
                } else {
                    ProxyError::Pooled(reason)
                }
            })?,
            () = header_timeout => return Err(ProxyError::HeaderTimeout(header_limit)),
        }
    } else {
        let stream =
            match tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(r.upstream)).await {
                Ok(Ok(s)) => s,
                Ok(Err(e)) => {
                    return Err(ProxyError::Connect {
                        addr: r.upstream,
                        reason: e.to_string(),
                    });
                }
                Err(_) => {
                    return Err(ProxyError::Connect {
                        addr: r.upstream,
                        reason: format!("timed out after {CONNECT_TIMEOUT:?}"),
                    });
                }
            };
        let _ = stream.set_nodelay(true);
        let (mut sender, conn) = hyper::client::conn::http1::Builder::new()
            .handshake(TokioIo::new(stream))
            .await?;
        tokio::spawn(async move {
            if let Err(e) = conn.with_upgrades().await {
                tracing::debug!(error = %e, "upstream connection ended");
            }
        });
        tokio::select! {
            resp = sender.send_request(up) => resp?,
            () = header_timeout => return Err(ProxyError::HeaderTimeout(header_limit)),
        }
    };
    if resp.status() == StatusCode::SWITCHING_PROTOCOLS
        && let Some(client_upgrade) = client_upgrade
    {
        let upstream_upgrade = hyper::upgrade::on(&mut resp);
        tokio::spawn(async move {
            match tokio::try_join!(client_upgrade, upstream_upgrade) {
                Ok((client, upstream)) => {
                    let mut client = TokioIo::new(client);
                    let mut upstream = TokioIo::new(upstream);
                    let _ = tokio::io::copy_bidirectional(&mut client, &mut upstream).await;
                }
                Err(e) => tracing::debug!(error = %e, "upgrade failed"),
            }
        });
        let (parts, _) = resp.into_parts();
        let mut out = Response::from_parts(parts, empty());
        *out.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
        return Ok(out);
    }
    let (mut parts, body) = resp.into_parts();
    strip_hop_by_hop(&mut parts.headers);
    Ok(Response::from_parts(
        parts,
        body.map_err(|e| Box::new(e) as BoxError).boxed_unsync(),
    ))
}

/// An empty body.
pub fn empty() -> Body {
    http_body_util::Empty::new()
        .map_err(|never| match never {})
        .boxed_unsync()
}

/// A complete body.
pub fn full(b: impl Into<Bytes>) -> Body {
    http_body_util::Full::new(b.into())
        .map_err(|never| match never {})
        .boxed_unsync()
}

/// A JSON error `{"code","message"}` with `status`.
pub fn json_error(status: StatusCode, message: impl Into<String>) -> Response<Body> {
    let body = agentenv_core::error::ErrorBody::new(status.as_u16(), message).to_json();
    let mut r = Response::new(full(body));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}

/// A bare status with an empty body (401).
pub fn status_only(status: StatusCode) -> Response<Body> {
    let mut r = Response::new(empty());
    *r.status_mut() = status;
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn init_is_node_only_as_the_agent_matches_it() {
        assert!(is_node_only("/init"));
        assert!(is_node_only("/init?x=1"));
        // The agent routes exact paths: these never reach its /init handler.
        assert!(!is_node_only("/init/"));
        assert!(!is_node_only("//init"));
        assert!(!is_node_only("/files"));
    }

    #[test]
    fn only_files_urls_with_a_signature_pass_without_a_token() {
        assert!(is_signed_files_url("/files?path=/a&signature=v1_x"));
        assert!(is_signed_files_url("/files?signature=v1_x"));
        assert!(!is_signed_files_url("/files?path=/a"));
        assert!(!is_signed_files_url("/files?xsignature=1"));
        assert!(!is_signed_files_url("/envs?signature=v1_x"));
        assert!(!is_signed_files_url(
            "/process.Process/Start?signature=v1_x"
        ));
        assert!(!is_signed_files_url("/files"));
    }

    const ID: &str = "01936f8e-72f5-7000-8000-000000000001";

    fn req(uri: &str, headers: &[(&str, &str)]) -> Request<()> {
        let mut b = Request::builder().uri(uri);
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        b.body(()).unwrap()
    }

    #[test]
    fn proxy_prefix_strips_proxy_and_reads_headers() {
        let c = classify(
            &req(
                "/proxy/files?path=/a",
                &[("e2b-sandbox-id", ID), ("e2b-sandbox-port", "8080")],
            ),
            &[],
            false,
        );
        assert_eq!(
            c,
            Classified::Proxy(Target {
                sandbox_id: ID.into(),
                port: 8080,
                path_and_query: "/files?path=/a".into(),
                source: RouteSource::Prefix
            })
        );
        let c = classify(&req("/proxy", &[("x-agentenv-sandbox-id", ID)]), &[], false);
        assert!(
            matches!(c, Classified::Proxy(t) if t.path_and_query == "/" && t.port == AGENT_PORT)
        );
        assert!(matches!(
            classify(&req("/proxy/x", &[]), &[], false),
            Classified::BadHeaders(_)
        ));
        assert!(matches!(
            classify(&req("/proxy/x", &[("e2b-sandbox-id", "nope")]), &[], false),
            Classified::BadHeaders(_)
        ));
    }

    #[test]
    fn agentenv_headers_win_and_matched_routes_stay_control_plane() {
        let c = classify(
            &req(
                "/process.Process/Start",
                &[
                    ("e2b-sandbox-id", "01936f8e-72f5-7000-8000-000000000009"),
                    ("x-agentenv-sandbox-id", ID),
                    ("x-agentenv-target-port", "3000"),
                    ("e2b-sandbox-port", "49983"),
                ],
            ),
            &[],
            false,
        );
        assert!(matches!(c, Classified::Proxy(t) if t.sandbox_id == ID && t.port == 3000));
        assert_eq!(
            classify(&req("/sandboxes", &[("e2b-sandbox-id", ID)]), &[], true),
            Classified::ControlPlane
        );
    }

    #[test]
    fn host_routes_parse_port_and_id() {
        let d = vec!["sbx.example.com".to_string()];
        let c = classify(
            &req(
                "/health",
                &[("host", &format!("49983-{ID}.sbx.example.com:443"))],
            ),
            &d,
            true,
        );
        assert!(
            matches!(c, Classified::Proxy(t) if t.port == 49983 && t.path_and_query == "/health")
        );
        assert!(matches!(
            classify(&req("/", &[("host", "x-y.sbx.example.com")]), &d, true),
            Classified::BadHost(_)
        ));
        assert_eq!(
            classify(&req("/", &[("host", "sbx.example.com")]), &d, true),
            Classified::ControlPlane
        );
    }
}
