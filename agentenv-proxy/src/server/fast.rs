//! The HTTP/1.1 fast lane of [`Gateway::serve`].
//!
//! hyper turns every message into a `Request` or `Response` (a `HeaderMap`
//! of owned names and values) and serializes it again on the other side;
//! for an ordinary proxied request that is most of the gateway's work. Here
//! the request head is parsed in place (httparse), routed by the same
//! [`Gateway::decide`] as the hyper path, and written to the node byte for
//! byte with the hop-by-hop and forwarding headers rewritten; the response
//! head is rewritten the same way and the bodies are relayed by their
//! framing (`Content-Length`, chunked, or until the node closes).
//!
//! A request qualifies when it is HTTP/1.1 in origin form, has no body or a
//! `Content-Length` one, is not an upgrade, a stream (gRPC, Connect
//! streams, SSE, `Te`), an `Expect`, a create, fork or list, and goes by
//! its sandbox id to a plain `http://` node. The first request that does
//! not qualify hands the connection, with the bytes already read, to hyper
//! for the rest of its life; so do HTTP/2 connections and malformed heads.

use std::io::{self, IoSlice};
use std::ops::Range;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Buf, Bytes, BytesMut};
use http::uri::Authority;
use rustc_hash::FxHashMap;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::watch;

use super::*;

/// A head larger than this is left to hyper (which answers 431).
const MAX_HEAD: usize = 64 * 1024;
/// As many header lines as hyper accepts.
const MAX_HEADERS: usize = 100;
/// Read size for bodies.
const CHUNK: usize = 16 * 1024;

/// How the fast lane left a connection.
enum Lane {
    /// Closed (or to be closed): nothing more to do.
    Closed,
    /// A request that the fast lane does not take: hyper serves the rest.
    Handover,
}

/// A client connection and the buffers reused by its requests.
struct Client {
    stream: TcpStream,
    /// Bytes read and not yet consumed.
    buf: BytesMut,
    /// The head being written (upstream request, then client response).
    out: Vec<u8>,
    /// The upstream request target and line.
    target: String,
    line: Vec<u8>,
    /// `X-Forwarded-For` of this connection.
    xff: HeaderValue,
}

/// A connection to a node.
struct Upstream {
    stream: TcpStream,
    buf: BytesMut,
}

/// Idle connections to nodes, per authority (`host:port`).
pub(crate) struct RawPool {
    idle: parking_lot::Mutex<Idle>,
    cfg: PoolConfig,
}

#[derive(Default)]
struct Idle {
    by_authority: FxHashMap<String, Vec<(Upstream, Instant)>>,
    /// When connections past `idle_timeout` were last closed.
    swept: Option<Instant>,
}

impl RawPool {
    pub(crate) fn new(cfg: PoolConfig) -> Self {
        Self {
            idle: parking_lot::Mutex::default(),
            cfg,
        }
    }

    /// Idle connections kept, over all authorities.
    #[cfg(test)]
    fn idle_count(&self) -> usize {
        self.idle.lock().by_authority.values().map(Vec::len).sum()
    }

    /// The most recently used idle connection that has not timed out.
    fn checkout(&self, authority: &str, now: Instant) -> Option<Upstream> {
        let mut idle = self.idle.lock();
        let stack = idle.by_authority.get_mut(authority)?;
        while let Some((up, since)) = stack.pop() {
            if now.saturating_duration_since(since) < self.cfg.idle_timeout {
                return Some(up);
            }
        }
        None
    }

    fn release(&self, authority: &str, up: Upstream, now: Instant) {
        let mut idle = self.idle.lock();
        // Now and then, close what timed out everywhere (nodes that are
        // gone are never checked out again).
        let timeout = self.cfg.idle_timeout;
        if idle
            .swept
            .is_none_or(|t| now.saturating_duration_since(t) >= timeout / 2)
        {
            idle.swept = Some(now);
            idle.by_authority.retain(|_, stack| {
                stack.retain(|(_, since)| now.saturating_duration_since(*since) < timeout);
                !stack.is_empty()
            });
        }
        if let Some(stack) = idle.by_authority.get_mut(authority) {
            if stack.len() >= self.cfg.max_idle_per_authority {
                stack.remove(0);
            }
            stack.push((up, now));
        } else {
            idle.by_authority
                .insert(authority.to_string(), vec![(up, now)]);
        }
    }

    async fn connect(&self, authority: &Authority) -> io::Result<Upstream> {
        let addr = match authority.port_u16() {
            Some(_) => authority.as_str().to_string(),
            None => format!("{}:80", authority.as_str()),
        };
        let stream = tokio::time::timeout(self.cfg.connect_timeout, TcpStream::connect(addr))
            .await
            .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "connect timed out"))??;
        stream.set_nodelay(true)?;
        Ok(Upstream {
            stream,
            buf: BytesMut::with_capacity(8 * 1024),
        })
    }
}

/// Where the sandbox id of a request is.
enum IdSpan {
    Buf(Range<usize>),
    Owned(String),
}

/// A request the fast lane takes, with its upstream header block already
/// in `Client::out`.
struct Plan {
    head_len: usize,
    method: Method,
    route: &'static str,
    path: Range<usize>,
    query: Option<Range<usize>>,
    id: IdSpan,
    source: RouteSource,
    /// Data-plane routes go under `/proxy` (kept once if already there).
    under_proxy: bool,
    content_length: u64,
    /// The client sent `Connection: close`.
    close: bool,
}

enum Analysis {
    Ready(Plan),
    Partial,
    Handover,
}

/// What the fast lane needs from the request headers.
#[derive(Default)]
struct Facts<'b> {
    host: Option<&'b [u8]>,
    content_length: Option<u64>,
    sandbox_id: Option<&'b str>,
    e2b_sandbox_id: Option<&'b str>,
    has_port: bool,
    api_keys: usize,
    api_key: &'b [u8],
    close: bool,
    /// Header names listed in `Connection` (besides close/keep-alive).
    dropped: [&'b str; 8],
    n_dropped: usize,
}

/// The value as `HeaderValue::to_str` sees it: visible ASCII and tabs only.
fn text(v: &[u8]) -> Option<&str> {
    v.iter()
        .all(|&b| b == b'\t' || (32..127).contains(&b))
        .then(|| std::str::from_utf8(v).ok())
        .flatten()
}

/// The first non-blank value wins, as `routing::header_str` does.
fn first_nonblank<'b>(slot: &mut Option<&'b str>, v: &'b [u8]) {
    if slot.is_none()
        && let Some(t) = text(v).map(str::trim)
        && !t.is_empty()
    {
        *slot = Some(t);
    }
}

/// A request target of plain URI characters (a subset of what hyper
/// accepts; anything else goes to hyper, which decides).
fn plain_target(t: &str) -> bool {
    t.starts_with('/')
        && t.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-._~!$&'()*+,;=:@/%?".contains(&b))
}

/// The header names the fast lane looks at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Hdr {
    Other,
    Host,
    ContentLength,
    TransferEncoding,
    Upgrade,
    Expect,
    Te,
    Trailer,
    Connection,
    KeepAlive,
    ProxyConnection,
    ProxyAuthenticate,
    ProxyAuthorization,
    ContentType,
    ConnectProtocolVersion,
    Accept,
    ApiKey,
    SandboxId,
    E2bSandboxId,
    TargetPort,
    E2bSandboxPort,
    Forwarded,
    XForwardedHost,
    XForwardedProto,
    XForwardedFor,
    XForwardedMethod,
    XForwardedUri,
    Date,
    NodeId,
}

/// A header name, compared once (by length first) against the names above.
fn classify(name: &str) -> Hdr {
    use Hdr::*;
    let candidates: &[(&str, Hdr)] = match name.len() {
        2 => &[("te", Te)],
        4 => &[("host", Host), ("date", Date)],
        6 => &[("expect", Expect), ("accept", Accept)],
        7 => &[("upgrade", Upgrade), ("trailer", Trailer)],
        9 => &[(API_KEY_HEADER, ApiKey), ("forwarded", Forwarded)],
        10 => &[("connection", Connection), ("keep-alive", KeepAlive)],
        12 => &[("content-type", ContentType)],
        14 => &[
            ("content-length", ContentLength),
            (E2B_SANDBOX_ID_HEADER, E2bSandboxId),
        ],
        15 => &[
            ("x-forwarded-for", XForwardedFor),
            ("x-forwarded-uri", XForwardedUri),
        ],
        16 => &[
            (E2B_SANDBOX_PORT_HEADER, E2bSandboxPort),
            ("proxy-connection", ProxyConnection),
            ("x-forwarded-host", XForwardedHost),
        ],
        17 => &[
            ("transfer-encoding", TransferEncoding),
            ("x-forwarded-proto", XForwardedProto),
        ],
        18 => &[
            ("proxy-authenticate", ProxyAuthenticate),
            ("x-forwarded-method", XForwardedMethod),
            (NODE_ID_HEADER, NodeId),
        ],
        19 => &[("proxy-authorization", ProxyAuthorization)],
        21 => &[(SANDBOX_ID_HEADER, SandboxId)],
        22 => &[(TARGET_PORT_HEADER, TargetPort)],
        24 => &[("connect-protocol-version", ConnectProtocolVersion)],
        _ => return Other,
    };
    candidates
        .iter()
        .find(|(n, _)| n.eq_ignore_ascii_case(name))
        .map_or(Other, |&(_, h)| h)
}

/// Hop-by-hop headers: never relayed in either direction (`Trailer` is
/// kept on responses, as in the hyper path).
fn hop_by_hop(h: Hdr) -> bool {
    use Hdr::*;
    matches!(
        h,
        Connection
            | KeepAlive
            | ProxyConnection
            | ProxyAuthenticate
            | ProxyAuthorization
            | Te
            | TransferEncoding
            | Upgrade
    )
}

/// Request headers that never go upstream as the client sent them.
fn dropped_upstream(h: Hdr, host_routed: bool) -> bool {
    use Hdr::*;
    hop_by_hop(h)
        || matches!(
            h,
            Trailer
                | Forwarded
                | XForwardedHost
                | XForwardedProto
                | XForwardedFor
                | XForwardedMethod
                | XForwardedUri
                | Host
        )
        || (host_routed && matches!(h, SandboxId | TargetPort))
}

fn push_header(out: &mut Vec<u8>, name: &[u8], value: &[u8]) {
    out.extend_from_slice(name);
    out.extend_from_slice(b": ");
    out.extend_from_slice(value);
    out.extend_from_slice(b"\r\n");
}

/// Offsets of `s` within `buf`, when it is a slice of it.
fn span_in(buf: &[u8], s: &str) -> Option<Range<usize>> {
    let start = (s.as_ptr() as usize).checked_sub(buf.as_ptr() as usize)?;
    (start + s.len() <= buf.len()).then_some(start..start + s.len())
}

/// How a response body ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Framing {
    Empty,
    Length(u64),
    Chunked,
    /// Until the node closes the connection.
    Close,
}

/// A response head, rewritten for the client into `Client::out`.
struct RespHead {
    status: u16,
    framing: Framing,
    /// The node will close its side (`Connection: close`).
    upstream_close: bool,
}

/// What a response head is read for.
struct Expect<'a> {
    head_request: bool,
    /// The client asked to close after this response.
    client_close: bool,
    /// `x-agentenv-node-id` for the response (debug mode).
    debug_node: Option<&'a str>,
}

/// Why an exchange with the node failed.
enum ExchangeError {
    /// The node could not be reached or broke the exchange.
    Upstream(io::Error),
    /// The client stopped sending the request body.
    ClientBody,
    /// The client closed its connection while waiting for the answer.
    ClientGone,
}

impl Gateway {
    /// Serves one client connection: the fast lane while its requests
    /// qualify, then hyper. Ends early, between requests, once `stop` is
    /// set.
    pub(super) async fn serve_connection(
        &self,
        stream: TcpStream,
        remote: SocketAddr,
        mut stop: watch::Receiver<bool>,
    ) {
        let mut client = Client {
            stream,
            buf: BytesMut::with_capacity(8 * 1024),
            out: Vec::with_capacity(1024),
            target: String::with_capacity(128),
            line: Vec::with_capacity(160),
            xff: crate::forward::format_ip(remote.ip().to_canonical()),
        };
        if let Lane::Closed = self.fast_lane(&mut client, &mut stop).await {
            return;
        }
        let io = Rewound {
            prefix: client.buf.freeze(),
            inner: client.stream,
        };
        let builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
        let conn = builder.serve_connection_with_upgrades(TokioIo::new(io), self.service(remote));
        let mut conn = pin!(conn);
        let stopping = async {
            let _ = stop.wait_for(|s| *s).await;
        };
        let result = tokio::select! {
            r = conn.as_mut() => r,
            () = stopping => {
                conn.as_mut().graceful_shutdown();
                conn.await
            }
        };
        if let Err(e) = result {
            tracing::debug!(error = %e, %remote, "client connection ended with an error");
        }
    }

    async fn fast_lane(&self, c: &mut Client, stop: &mut watch::Receiver<bool>) -> Lane {
        loop {
            let plan = loop {
                if !c.buf.is_empty() {
                    match self.analyze(&c.buf, &mut c.out, &c.xff) {
                        Analysis::Ready(plan) => break plan,
                        Analysis::Handover => return Lane::Handover,
                        Analysis::Partial if c.buf.len() >= MAX_HEAD => return Lane::Handover,
                        Analysis::Partial => {}
                    }
                } else {
                    let stopping = *stop.borrow();
                    if stopping {
                        return Lane::Closed;
                    }
                }
                tokio::select! {
                    biased;
                    r = read_more(&mut c.stream, &mut c.buf) => match r {
                        Ok(0) | Err(_) => return Lane::Closed,
                        Ok(_) => {}
                    },
                    _ = stop.changed(), if c.buf.is_empty() => return Lane::Closed,
                }
            };
            match self.relay(c, plan).await {
                Some(Lane::Handover) => return Lane::Handover,
                Some(Lane::Closed) => return Lane::Closed,
                None => {}
            }
        }
    }

    /// Parses the head at the start of `buf` and decides whether the fast
    /// lane takes it; if so, writes its upstream header block into `out`.
    fn analyze(&self, buf: &[u8], out: &mut Vec<u8>, xff: &HeaderValue) -> Analysis {
        // Left uninitialized: httparse writes what it parses.
        let mut headers = [const { std::mem::MaybeUninit::uninit() }; MAX_HEADERS];
        let mut req = httparse::Request::new(&mut []);
        let head_len = match req.parse_with_uninit_headers(buf, &mut headers) {
            Ok(httparse::Status::Complete(n)) => n,
            Ok(httparse::Status::Partial) => return Analysis::Partial,
            Err(_) => return Analysis::Handover,
        };
        let (Some(1), Some(method), Some(target)) = (req.version, req.method, req.path) else {
            return Analysis::Handover;
        };
        if !plain_target(target) {
            return Analysis::Handover;
        }
        let Ok(method) = Method::from_bytes(method.as_bytes()) else {
            return Analysis::Handover;
        };
        if method == Method::CONNECT {
            return Analysis::Handover;
        }
        let mut f = Facts::default();
        let mut kinds = [Hdr::Other; MAX_HEADERS];
        for (h, kind) in req.headers.iter().zip(kinds.iter_mut()) {
            let value = h.value;
            *kind = classify(h.name);
            match *kind {
                Hdr::Host => {
                    f.host.get_or_insert(value);
                }
                Hdr::ContentLength => {
                    let n = text(value).and_then(|v| v.trim().parse::<u64>().ok());
                    match (n, f.content_length) {
                        (Some(n), None) => f.content_length = Some(n),
                        _ => return Analysis::Handover,
                    }
                }
                Hdr::TransferEncoding | Hdr::Upgrade | Hdr::Expect | Hdr::Te => {
                    return Analysis::Handover;
                }
                Hdr::Connection => {
                    let Some(v) = text(value) else {
                        return Analysis::Handover;
                    };
                    for token in v.split(',').map(str::trim).filter(|t| !t.is_empty()) {
                        if token.eq_ignore_ascii_case("close") {
                            f.close = true;
                        } else if token.eq_ignore_ascii_case("upgrade") || f.n_dropped == 8 {
                            return Analysis::Handover;
                        } else if !token.eq_ignore_ascii_case("keep-alive") {
                            f.dropped[f.n_dropped] = token;
                            f.n_dropped += 1;
                        }
                    }
                }
                Hdr::ContentType => {
                    let ct = value.trim_ascii();
                    let starts =
                        |p: &[u8]| ct.get(..p.len()).is_some_and(|x| x.eq_ignore_ascii_case(p));
                    if starts(b"application/grpc") || starts(b"application/connect+") {
                        return Analysis::Handover;
                    }
                }
                Hdr::ConnectProtocolVersion
                    if text(value).is_some_and(|t| !t.trim().is_empty()) =>
                {
                    return Analysis::Handover;
                }
                Hdr::Accept
                    if text(value)
                        .is_some_and(|t| t.trim().eq_ignore_ascii_case("text/event-stream")) =>
                {
                    return Analysis::Handover;
                }
                Hdr::ApiKey => {
                    f.api_keys += 1;
                    f.api_key = value;
                }
                Hdr::SandboxId => first_nonblank(&mut f.sandbox_id, value),
                Hdr::E2bSandboxId => first_nonblank(&mut f.e2b_sandbox_id, value),
                Hdr::TargetPort | Hdr::E2bSandboxPort => {
                    f.has_port |= text(value).is_some_and(|t| !t.trim().is_empty());
                }
                _ => {}
            }
        }
        let (path, query) = match target.split_once('?') {
            Some((p, q)) => (p, Some(q)),
            None => (target, None),
        };
        let Some(decoded) = decode_path(path) else {
            return Analysis::Handover;
        };
        let host_route = self.inner.hosts.route(f.host.and_then(text).unwrap_or(""));
        let facts = RoutingFacts {
            method: &method,
            decoded: &decoded,
            host_route: &host_route,
            sandbox_id: f.sandbox_id.or(f.e2b_sandbox_id),
            has_port: f.has_port,
        };
        let key = self.inner.opts.api_key.as_bytes();
        let authorized =
            || f.api_keys == 1 && f.api_key.len() == key.len() && bool::from(f.api_key.ct_eq(key));
        let (id, source) = match self.decide(&facts, authorized) {
            Decision::Route {
                id: Some(id),
                source,
            } if !records_assignment(&method, &decoded, source) => (id, source),
            _ => return Analysis::Handover,
        };
        let id = match span_in(buf, id) {
            Some(r) => IdSpan::Buf(r),
            None => IdSpan::Owned(id.to_string()),
        };
        let host_routed = source == RouteSource::Host;
        out.clear();
        for (h, &kind) in req.headers.iter().zip(kinds.iter()) {
            if dropped_upstream(kind, host_routed)
                || f.n_dropped > 0
                    && f.dropped[..f.n_dropped]
                        .iter()
                        .any(|d| d.eq_ignore_ascii_case(h.name))
            {
                continue;
            }
            push_header(out, h.name.as_bytes(), h.value);
        }
        if let Some(host) = f.host {
            push_header(out, b"host", host);
            push_header(out, b"x-forwarded-host", host);
        }
        push_header(out, b"x-forwarded-for", xff.as_bytes());
        push_header(out, b"x-forwarded-proto", b"http");
        push_header(out, b"x-forwarded-method", method.as_str().as_bytes());
        push_header(out, b"x-forwarded-uri", target.as_bytes());
        if let Ok(Some(r)) = &host_route {
            push_header(out, SANDBOX_ID_HEADER.as_bytes(), r.sandbox_id.as_bytes());
            push_header(
                out,
                TARGET_PORT_HEADER.as_bytes(),
                r.port.to_string().as_bytes(),
            );
        }
        Analysis::Ready(Plan {
            head_len,
            route: route_label(&decoded),
            method,
            path: span_in(buf, path).expect("the path is part of the head"),
            query: query.and_then(|q| span_in(buf, q)),
            id,
            source,
            under_proxy: source.is_data_plane() && !is_proxy_path(&decoded),
            content_length: f.content_length.unwrap_or(0),
            close: f.close,
        })
    }

    /// One request of the fast lane, from routing to the end of the
    /// response. `None`: the connection goes on with the next request.
    async fn relay(&self, c: &mut Client, plan: Plan) -> Option<Lane> {
        let start = Instant::now();
        let deadline = start + self.inner.opts.request_timeout;
        let id = match &plan.id {
            IdSpan::Buf(r) => std::str::from_utf8(&c.buf[r.clone()]).unwrap_or_default(),
            IdSpan::Owned(s) => s.as_str(),
        };
        let scheduler: &dyn SchedulerClient = &*self.inner.scheduler;
        let node = match self
            .rpc("LookupNode", deadline, scheduler.lookup_node(id))
            .await
        {
            Ok(n) => n,
            Err(status) => {
                return self
                    .answer(c, &plan, start, scheduler_error(&status), None)
                    .await;
            }
        };
        let endpoint = match Endpoint::cached(&node.endpoint) {
            Ok(e) if e.is_plain_http() => e,
            // TLS nodes and bad endpoints are hyper's (its answers included).
            _ => return Some(Lane::Handover),
        };
        let path = std::str::from_utf8(&c.buf[plan.path.clone()]).unwrap_or("/");
        let query = plan
            .query
            .as_ref()
            .map(|q| std::str::from_utf8(&c.buf[q.clone()]).unwrap_or(""));
        if plan.under_proxy {
            endpoint.target_into(&mut c.target, &["/proxy", path], query);
        } else {
            endpoint.target_into(&mut c.target, &[path], query);
        }
        // The request line, sent in front of the header block.
        c.line.clear();
        c.line.extend_from_slice(plan.method.as_str().as_bytes());
        c.line.push(b' ');
        c.line.extend_from_slice(c.target.as_bytes());
        c.line.extend_from_slice(b" HTTP/1.1\r\n");
        c.out.extend_from_slice(b"\r\n");
        c.buf.advance(plan.head_len);
        let in_buf = usize::try_from(plan.content_length)
            .unwrap_or(usize::MAX)
            .min(c.buf.len());
        c.out.extend_from_slice(&c.buf[..in_buf]);
        c.buf.advance(in_buf);
        let body_left = plan.content_length - in_buf as u64;

        let authority = endpoint.authority();
        let debug_node = self.inner.opts.debug_mode.then_some(node.node_id.as_str());
        let sent = Instant::now();
        let exchanged = tokio::time::timeout_at(
            deadline,
            self.exchange(c, authority, body_left, &plan, debug_node, sent),
        )
        .await;
        let upstream_metric = |status: &'static str| {
            self.inner.metrics.observe_upstream(
                UpstreamLabels {
                    route: plan.route,
                    status,
                },
                sent.elapsed().as_secs_f64(),
            );
        };
        let (mut up, head) = match exchanged {
            Ok(Ok(x)) => x,
            Ok(Err(ExchangeError::ClientGone)) => {
                self.observe_request(&plan, "client_closed", start, Instant::now());
                return Some(Lane::Closed);
            }
            Ok(Err(ExchangeError::ClientBody)) => {
                upstream_metric("4xx");
                tracing::warn!("client stopped sending the request body");
                let resp = error_response(StatusCode::BAD_REQUEST, "failed to read request body");
                return self.answer(c, &plan, start, resp, Some(true)).await;
            }
            Ok(Err(ExchangeError::Upstream(e))) => {
                upstream_metric("5xx");
                tracing::warn!(node_id = %node.node_id, endpoint = %node.endpoint, error = %e, "upstream request failed");
                let unread = body_left > 0;
                return self
                    .answer(c, &plan, start, upstream_unavailable(&node), Some(unread))
                    .await;
            }
            Err(_) => {
                upstream_metric("5xx");
                tracing::warn!(node_id = %node.node_id, "upstream did not answer before the request timeout");
                let resp = error_response(StatusCode::GATEWAY_TIMEOUT, "upstream timeout");
                return self.answer(c, &plan, start, resp, Some(true)).await;
            }
        };
        upstream_metric(status_label(head.status));

        let close = plan.close || head.framing == Framing::Close;
        let relayed = tokio::time::timeout_at(deadline, relay_body(c, &mut up, head.framing)).await;
        let end = Instant::now();
        self.observe_request(&plan, status_label(head.status), start, end);
        match relayed {
            Ok(Ok(())) => {
                if !head.upstream_close && head.framing != Framing::Close && up.buf.is_empty() {
                    self.raw.release(authority.as_str(), up, end);
                }
                if close {
                    let _ = c.stream.shutdown().await;
                    Some(Lane::Closed)
                } else {
                    None
                }
            }
            // The client or the node went away mid-body, or the deadline
            // passed: the status is sent, so the connection just ends.
            Ok(Err(_)) | Err(_) => Some(Lane::Closed),
        }
    }

    /// Sends the request (head and body) and reads the response head. A
    /// pooled connection that turns out closed is replaced once, when the
    /// whole request is still at hand.
    async fn exchange(
        &self,
        c: &mut Client,
        authority: &Authority,
        body_left: u64,
        plan: &Plan,
        debug_node: Option<&str>,
        now: Instant,
    ) -> Result<(Upstream, RespHead), ExchangeError> {
        let expect = Expect {
            head_request: plan.method == Method::HEAD,
            client_close: plan.close,
            debug_node,
        };
        let mut retried = false;
        loop {
            let (mut up, pooled) = match self.raw.checkout(authority.as_str(), now) {
                Some(up) if !retried => (up, true),
                _ => (
                    self.raw
                        .connect(authority)
                        .await
                        .map_err(ExchangeError::Upstream)?,
                    false,
                ),
            };
            let retry_ok = pooled && body_left == 0;
            if let Err(e) = write_two(&mut up.stream, &c.line, &c.out).await {
                if retry_ok {
                    retried = true;
                    continue;
                }
                return Err(ExchangeError::Upstream(e));
            }
            if body_left > 0 {
                copy_body(&mut c.stream, &mut up.stream, body_left).await?;
            }
            // Like hyper, notice a client that leaves while the node thinks.
            let Client {
                stream, buf, out, ..
            } = &mut *c;
            let answered = tokio::select! {
                biased;
                r = read_answer(&mut up, out, &expect) => r,
                () = client_gone(stream, buf) => return Err(ExchangeError::ClientGone),
            };
            match answered {
                Ok(head) => return Ok((up, head)),
                Err(e)
                    if retry_ok
                        && e.kind() == io::ErrorKind::UnexpectedEof
                        && up.buf.is_empty() =>
                {
                    retried = true;
                }
                Err(e) => return Err(ExchangeError::Upstream(e)),
            }
        }
    }

    /// The request histogram sample of a fast-lane request.
    fn observe_request(&self, plan: &Plan, status: &'static str, start: Instant, end: Instant) {
        self.inner.metrics.observe_request(
            RequestLabels {
                method: method_label(&plan.method),
                route: plan.route,
                route_source: plan.source.label(),
                status,
            },
            end.saturating_duration_since(start).as_secs_f64(),
        );
    }

    /// Answers a request with a response of the gateway's own (an error),
    /// then keeps the connection if the request body was all read
    /// (`unread_body`: `None` = only the head was consumed so far).
    async fn answer(
        &self,
        c: &mut Client,
        plan: &Plan,
        start: Instant,
        resp: Response<GatewayBody>,
        unread_body: Option<bool>,
    ) -> Option<Lane> {
        let status = resp.status().as_u16();
        let close = match unread_body {
            None => {
                // Skip the request: its head and the body, if all here.
                let whole = plan.head_len as u64 + plan.content_length;
                if (c.buf.len() as u64) < whole {
                    true
                } else {
                    c.buf.advance(whole as usize);
                    plan.close
                }
            }
            Some(unread) => unread || plan.close,
        };
        let (parts, body) = resp.into_parts();
        let body = body
            .collect()
            .await
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        c.out.clear();
        c.out.extend_from_slice(b"HTTP/1.1 ");
        c.out.extend_from_slice(parts.status.as_str().as_bytes());
        c.out.push(b' ');
        c.out
            .extend_from_slice(parts.status.canonical_reason().unwrap_or("").as_bytes());
        c.out.extend_from_slice(b"\r\n");
        for (name, value) in &parts.headers {
            push_header(&mut c.out, name.as_str().as_bytes(), value.as_bytes());
        }
        push_header(
            &mut c.out,
            b"content-length",
            body.len().to_string().as_bytes(),
        );
        push_header(&mut c.out, b"date", &http_date());
        if close {
            push_header(&mut c.out, b"connection", b"close");
        }
        c.out.extend_from_slice(b"\r\n");
        c.out.extend_from_slice(&body);
        let written = c.stream.write_all(&c.out).await;
        self.observe_request(plan, status_label(status), start, Instant::now());
        if written.is_err() || close {
            let _ = c.stream.shutdown().await;
            return Some(Lane::Closed);
        }
        None
    }
}

/// Copies `n` request body bytes from the client to the node.
async fn copy_body(
    client: &mut TcpStream,
    up: &mut TcpStream,
    mut n: u64,
) -> Result<(), ExchangeError> {
    let mut buf = vec![0u8; CHUNK.min(usize::try_from(n).unwrap_or(CHUNK))];
    while n > 0 {
        let want = buf.len().min(usize::try_from(n).unwrap_or(usize::MAX));
        let got = match client.read(&mut buf[..want]).await {
            Ok(0) | Err(_) => return Err(ExchangeError::ClientBody),
            Ok(got) => got,
        };
        up.write_all(&buf[..got])
            .await
            .map_err(ExchangeError::Upstream)?;
        n -= got as u64;
    }
    Ok(())
}

/// The response head and, like the hyper path, the first body bytes: a
/// node that stalls before its body still gets a 504.
async fn read_answer(
    up: &mut Upstream,
    out: &mut Vec<u8>,
    expect: &Expect<'_>,
) -> io::Result<RespHead> {
    let head = read_response_head(up, out, expect).await?;
    if head.framing != Framing::Empty
        && up.buf.is_empty()
        && read_more(&mut up.stream, &mut up.buf).await? == 0
        && head.framing != Framing::Close
    {
        // Not UnexpectedEof: the node did answer, so this is no stale
        // pooled connection to retry on.
        return Err(io::Error::other(
            "the node closed the connection before the body",
        ));
    }
    Ok(head)
}

/// Resolves when the client closes its connection; bytes it sends
/// meanwhile (a pipelined request) are kept in `buf`.
async fn client_gone(stream: &TcpStream, buf: &mut BytesMut) {
    loop {
        if stream.readable().await.is_err() {
            return;
        }
        if buf.capacity() - buf.len() < 1024 {
            buf.reserve(CHUNK);
        }
        match stream.try_read_buf(buf) {
            Ok(0) => return,
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(_) => return,
        }
    }
}

/// Reads the node's response head (skipping 1xx answers) and writes its
/// rewritten form into `out`.
async fn read_response_head(
    up: &mut Upstream,
    out: &mut Vec<u8>,
    expect: &Expect<'_>,
) -> io::Result<RespHead> {
    loop {
        let parsed = parse_response_head(&up.buf, out, expect)?;
        match parsed {
            Some((len, None)) => {
                // An informational answer: skip it.
                up.buf.advance(len);
                continue;
            }
            Some((len, Some(head))) => {
                up.buf.advance(len);
                return Ok(head);
            }
            None if up.buf.len() >= MAX_HEAD => {
                return Err(io::Error::other("response head too large"));
            }
            None => {}
        }
        if read_more(&mut up.stream, &mut up.buf).await? == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
    }
}

/// `Some((head length, None))` for a 1xx answer, `Some((len, Some(head)))`
/// for the final one, `None` when incomplete.
fn parse_response_head(
    buf: &[u8],
    out: &mut Vec<u8>,
    expect: &Expect<'_>,
) -> io::Result<Option<(usize, Option<RespHead>)>> {
    let debug_node = expect.debug_node;
    let mut headers = [const { std::mem::MaybeUninit::uninit() }; MAX_HEADERS];
    let mut resp = httparse::Response::new(&mut []);
    let len = match httparse::ParserConfig::default().parse_response_with_uninit_headers(
        &mut resp,
        buf,
        &mut headers,
    ) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(e) => return Err(io::Error::other(format!("bad response head: {e}"))),
    };
    let status = resp.code.unwrap_or(0);
    if status == 101 {
        return Err(io::Error::other("unexpected 101 Switching Protocols"));
    }
    if (100..200).contains(&status) {
        return Ok(Some((len, None)));
    }
    let mut length = None;
    let mut chunked = None;
    let mut upstream_close = false;
    let mut has_date = false;
    let mut dropped: [&str; 8] = [""; 8];
    let mut n_dropped = 0;
    let mut kinds = [Hdr::Other; MAX_HEADERS];
    for (h, kind) in resp.headers.iter().zip(kinds.iter_mut()) {
        *kind = classify(h.name);
        match *kind {
            Hdr::ContentLength => {
                let n = text(h.value).and_then(|v| v.trim().parse::<u64>().ok());
                match (n, length) {
                    (Some(n), None) => length = Some(n),
                    (Some(n), Some(m)) if n == m => {}
                    _ => return Err(io::Error::other("bad Content-Length")),
                }
            }
            Hdr::TransferEncoding => {
                let last = text(h.value)
                    .and_then(|v| v.rsplit(',').next())
                    .map(str::trim)
                    .unwrap_or("");
                chunked = Some(last.eq_ignore_ascii_case("chunked"));
            }
            Hdr::Connection => {
                for token in text(h.value).unwrap_or("").split(',').map(str::trim) {
                    if token.eq_ignore_ascii_case("close") {
                        upstream_close = true;
                    } else if !token.is_empty() && n_dropped < dropped.len() {
                        dropped[n_dropped] = token;
                        n_dropped += 1;
                    }
                }
            }
            Hdr::Date => has_date = true,
            _ => {}
        }
    }
    let framing = if expect.head_request || status == 204 || status == 304 {
        Framing::Empty
    } else {
        match (chunked, length) {
            (Some(true), _) => Framing::Chunked,
            (Some(false), _) => Framing::Close,
            (None, Some(0)) => Framing::Empty,
            (None, Some(n)) => Framing::Length(n),
            (None, None) => Framing::Close,
        }
    };
    out.clear();
    out.extend_from_slice(b"HTTP/1.1 ");
    // httparse checked: three digits.
    out.extend_from_slice(&[
        b'0' + (status / 100 % 10) as u8,
        b'0' + (status / 10 % 10) as u8,
        b'0' + (status % 10) as u8,
    ]);
    out.push(b' ');
    out.extend_from_slice(resp.reason.unwrap_or("").as_bytes());
    out.extend_from_slice(b"\r\n");
    for (h, &kind) in resp.headers.iter().zip(kinds.iter()) {
        if hop_by_hop(kind)
            || (kind == Hdr::NodeId && debug_node.is_some())
            || (kind == Hdr::ContentLength && framing == Framing::Chunked)
            || (n_dropped > 0
                && dropped[..n_dropped]
                    .iter()
                    .any(|d| d.eq_ignore_ascii_case(h.name)))
        {
            continue;
        }
        push_header(out, h.name.as_bytes(), h.value);
    }
    if framing == Framing::Chunked {
        push_header(out, b"transfer-encoding", b"chunked");
    }
    if !has_date {
        push_header(out, b"date", &http_date());
    }
    if let Some(node) = debug_node {
        push_header(out, NODE_ID_HEADER.as_bytes(), node.as_bytes());
    }
    if expect.client_close || framing == Framing::Close {
        push_header(out, b"connection", b"close");
    }
    out.extend_from_slice(b"\r\n");
    Ok(Some((
        len,
        Some(RespHead {
            status,
            framing,
            upstream_close,
        }),
    )))
}

/// Reads into `buf`, growing it first when it is nearly full.
async fn read_more(stream: &mut TcpStream, buf: &mut BytesMut) -> io::Result<usize> {
    if buf.capacity() - buf.len() < 1024 {
        buf.reserve(CHUNK);
    }
    stream.read_buf(buf).await
}

/// Writes `a` then `b` with as few `writev` calls as the socket allows.
async fn write_two(stream: &mut TcpStream, mut a: &[u8], mut b: &[u8]) -> io::Result<()> {
    while !a.is_empty() || !b.is_empty() {
        let n = stream
            .write_vectored(&[IoSlice::new(a), IoSlice::new(b)])
            .await?;
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        let from_a = n.min(a.len());
        a = &a[from_a..];
        b = &b[n - from_a..];
    }
    Ok(())
}

/// Sends the response head in `c.out` and relays the body by its framing.
async fn relay_body(c: &mut Client, up: &mut Upstream, framing: Framing) -> io::Result<()> {
    match framing {
        Framing::Empty => c.stream.write_all(&c.out).await,
        Framing::Length(n) => {
            let take = usize::try_from(n).unwrap_or(usize::MAX).min(up.buf.len());
            c.out.extend_from_slice(&up.buf[..take]);
            up.buf.advance(take);
            c.stream.write_all(&c.out).await?;
            let mut left = n - take as u64;
            while left > 0 {
                if read_more(&mut up.stream, &mut up.buf).await? == 0 {
                    return Err(io::ErrorKind::UnexpectedEof.into());
                }
                let take = usize::try_from(left)
                    .unwrap_or(usize::MAX)
                    .min(up.buf.len());
                c.stream.write_all(&up.buf[..take]).await?;
                up.buf.advance(take);
                left -= take as u64;
            }
            Ok(())
        }
        Framing::Chunked => {
            let mut scan = ChunkScanner::default();
            let used = scan.feed(&up.buf)?;
            c.out.extend_from_slice(&up.buf[..used]);
            up.buf.advance(used);
            c.stream.write_all(&c.out).await?;
            while !scan.done() {
                if read_more(&mut up.stream, &mut up.buf).await? == 0 {
                    return Err(io::ErrorKind::UnexpectedEof.into());
                }
                let used = scan.feed(&up.buf)?;
                c.stream.write_all(&up.buf[..used]).await?;
                up.buf.advance(used);
            }
            Ok(())
        }
        Framing::Close => {
            c.out.extend_from_slice(&up.buf);
            up.buf.clear();
            c.stream.write_all(&c.out).await?;
            while read_more(&mut up.stream, &mut up.buf).await? > 0 {
                c.stream.write_all(&up.buf).await?;
                up.buf.clear();
            }
            Ok(())
        }
    }
}

/// Follows a chunked body as it passes through, to find its end.
#[derive(Debug, Default)]
struct ChunkScanner {
    state: Chunk,
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
enum Chunk {
    /// Hex digits of a chunk size (`any`: at least one seen).
    #[default]
    Size,
    SizeDigits(u64),
    /// A chunk extension, up to the CR.
    Extension(u64),
    SizeLf(u64),
    Data(u64),
    DataCr,
    DataLf,
    /// The start of a trailer line (or of the final CRLF).
    TrailerStart,
    TrailerLine,
    FinalLf,
    Done,
}

impl ChunkScanner {
    fn done(&self) -> bool {
        self.state == Chunk::Done
    }

    /// How many bytes of `buf` belong to the body (all of them, unless
    /// the body ends inside `buf`).
    fn feed(&mut self, buf: &[u8]) -> io::Result<usize> {
        let bad = || io::Error::other("malformed chunked body from the node");
        let mut i = 0;
        while i < buf.len() && self.state != Chunk::Done {
            let b = buf[i];
            self.state = match self.state {
                Chunk::Size => match (b as char).to_digit(16) {
                    Some(d) => Chunk::SizeDigits(u64::from(d)),
                    None => return Err(bad()),
                },
                Chunk::SizeDigits(n) => match (b as char).to_digit(16) {
                    Some(d) => Chunk::SizeDigits(
                        n.checked_mul(16)
                            .and_then(|n| n.checked_add(u64::from(d)))
                            .ok_or_else(bad)?,
                    ),
                    None if b == b'\r' => Chunk::SizeLf(n),
                    None if b == b';' || b == b' ' || b == b'\t' => Chunk::Extension(n),
                    None => return Err(bad()),
                },
                Chunk::Extension(n) if b == b'\r' => Chunk::SizeLf(n),
                Chunk::Extension(n) => Chunk::Extension(n),
                Chunk::SizeLf(0) if b == b'\n' => Chunk::TrailerStart,
                Chunk::SizeLf(n) if b == b'\n' => Chunk::Data(n),
                Chunk::Data(n) => {
                    let take = usize::try_from(n).unwrap_or(usize::MAX).min(buf.len() - i);
                    i += take;
                    let left = n - take as u64;
                    self.state = if left == 0 {
                        Chunk::DataCr
                    } else {
                        Chunk::Data(left)
                    };
                    continue;
                }
                Chunk::DataCr if b == b'\r' => Chunk::DataLf,
                Chunk::DataLf if b == b'\n' => Chunk::Size,
                Chunk::TrailerStart if b == b'\r' => Chunk::FinalLf,
                Chunk::TrailerStart | Chunk::TrailerLine if b == b'\n' => Chunk::TrailerStart,
                Chunk::TrailerStart | Chunk::TrailerLine => Chunk::TrailerLine,
                Chunk::FinalLf if b == b'\n' => Chunk::Done,
                _ => return Err(bad()),
            };
            i += 1;
        }
        Ok(i)
    }
}

/// The current time as an HTTP date, formatted once a second per thread.
fn http_date() -> [u8; 29] {
    thread_local! {
        static CACHED: std::cell::Cell<(u64, [u8; 29])> = const { std::cell::Cell::new((0, [0; 29])) };
    }
    let now = std::time::SystemTime::now();
    let secs = now
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    CACHED.with(|c| {
        let (at, date) = c.get();
        if at == secs && date[0] != 0 {
            return date;
        }
        let mut out = [0u8; 29];
        let s = httpdate::fmt_http_date(now);
        let n = s.len().min(29);
        out[..n].copy_from_slice(&s.as_bytes()[..n]);
        c.set((secs, out));
        out
    })
}

/// A client connection handed to hyper: the bytes the fast lane already
/// read come first.
struct Rewound {
    prefix: Bytes,
    inner: TcpStream,
}

impl AsyncRead for Rewound {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if !self.prefix.is_empty() {
            let n = self.prefix.len().min(buf.remaining());
            buf.put_slice(&self.prefix[..n]);
            self.prefix.advance(n);
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for Rewound {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BODY: &[u8] = b"5;ext=1\r\nhello\r\n1\r\n \r\n6\r\nworld!\r\n0\r\nx-t: 1\r\n\r\n";

    #[test]
    fn the_chunk_scanner_finds_the_end_wherever_the_reads_split() {
        let mut wire = BODY.to_vec();
        wire.extend_from_slice(b"HTTP/1.1 200 OK\r\n"); // the next response
        for split in 0..=wire.len() {
            let mut scan = ChunkScanner::default();
            let first = scan.feed(&wire[..split]).unwrap();
            let second = scan.feed(&wire[first..]).unwrap();
            assert!(scan.done(), "split at {split}");
            assert_eq!(first + second, BODY.len(), "split at {split}");
        }
    }

    #[test]
    fn the_chunk_scanner_rejects_malformed_bodies() {
        for bad in [
            &b"zz\r\n"[..],
            b"3\r\nabcX\r\n",
            b"3\nabc",
            b"fffffffffffffffff1\r\n",
        ] {
            assert!(ChunkScanner::default().feed(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn response_heads_are_rewritten_for_the_client() {
        let raw =
            b"HTTP/1.1 200 Fine\r\nConnection: x-hop, close\r\nx-hop: 1\r\nkeep-alive: t=1\r\n\
                    content-length: 3\r\nx-agentenv-node-id: spoofed\r\nX-Kept: y\r\n\r\nabc";
        let mut out = Vec::new();
        let expect = Expect {
            head_request: false,
            client_close: false,
            debug_node: Some("node-a"),
        };
        let (len, head) = parse_response_head(raw, &mut out, &expect)
            .unwrap()
            .unwrap();
        let head = head.unwrap();
        assert_eq!(len, raw.len() - 3);
        assert_eq!(head.status, 200);
        assert_eq!(head.framing, Framing::Length(3));
        assert!(head.upstream_close);
        let text = String::from_utf8(out).unwrap();
        assert!(text.starts_with("HTTP/1.1 200 Fine\r\n"), "{text}");
        assert!(text.contains("content-length: 3\r\n"), "{text}");
        assert!(text.contains("X-Kept: y\r\n"), "{text}");
        assert!(text.contains("x-agentenv-node-id: node-a\r\n"), "{text}");
        assert!(text.contains("\r\ndate: "), "{text}");
        for gone in ["x-hop", "keep-alive", "Connection", "spoofed"] {
            assert!(!text.contains(gone), "{gone} in {text}");
        }
        assert!(text.ends_with("\r\n\r\n"));
    }

    #[test]
    fn response_framing_follows_the_head() {
        let framing = |raw: &[u8], head_request: bool| {
            let expect = Expect {
                head_request,
                client_close: false,
                debug_node: None,
            };
            let mut out = Vec::new();
            parse_response_head(raw, &mut out, &expect)
                .unwrap()
                .unwrap()
                .1
                .unwrap()
                .framing
        };
        let chunked =
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip, chunked\r\ncontent-length: 9\r\n\r\n";
        assert_eq!(framing(chunked, false), Framing::Chunked);
        let gzip_only = b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip\r\n\r\n";
        assert_eq!(framing(gzip_only, false), Framing::Close);
        assert_eq!(framing(b"HTTP/1.1 200 OK\r\n\r\n", false), Framing::Close);
        assert_eq!(
            framing(b"HTTP/1.1 204 No Content\r\n\r\n", false),
            Framing::Empty
        );
        let sized = b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n";
        assert_eq!(framing(sized, true), Framing::Empty);
        assert_eq!(framing(sized, false), Framing::Length(5));
        let mut out = Vec::new();
        let expect = Expect {
            head_request: false,
            client_close: false,
            debug_node: None,
        };
        let conflicting = b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\ncontent-length: 6\r\n\r\n";
        assert!(parse_response_head(conflicting, &mut out, &expect).is_err());
        let early = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\n";
        assert!(matches!(
            parse_response_head(early, &mut out, &expect),
            Ok(Some((25, None)))
        ));
    }

    #[test]
    fn only_plain_origin_form_targets_take_the_fast_lane() {
        assert!(plain_target("/a/b-c_d.e~f?x=1&y=%20"));
        assert!(!plain_target("http://host/a"));
        assert!(!plain_target("*"));
        assert!(!plain_target("/a#frag"));
        assert!(!plain_target("/a b"));
        assert!(!plain_target("/a\"quoted\""));
    }

    #[test]
    fn header_names_are_classified_whatever_their_case() {
        assert_eq!(classify("Host"), Hdr::Host);
        assert_eq!(classify("CONTENT-LENGTH"), Hdr::ContentLength);
        assert_eq!(classify(SANDBOX_ID_HEADER), Hdr::SandboxId);
        assert_eq!(classify(E2B_SANDBOX_ID_HEADER), Hdr::E2bSandboxId);
        assert_eq!(classify(TARGET_PORT_HEADER), Hdr::TargetPort);
        assert_eq!(classify(E2B_SANDBOX_PORT_HEADER), Hdr::E2bSandboxPort);
        assert_eq!(classify(API_KEY_HEADER), Hdr::ApiKey);
        assert_eq!(classify(NODE_ID_HEADER), Hdr::NodeId);
        assert_eq!(classify("X-Forwarded-Uri"), Hdr::XForwardedUri);
        assert_eq!(classify("x-forwarded-hosts"), Hdr::Other);
        assert_eq!(classify("content-lengtx"), Hdr::Other);
        assert!(hop_by_hop(classify("Keep-Alive")));
        assert!(!hop_by_hop(classify("trailer")));
        assert!(dropped_upstream(classify("trailer"), false));
        assert!(!dropped_upstream(classify(SANDBOX_ID_HEADER), false));
        assert!(dropped_upstream(classify(SANDBOX_ID_HEADER), true));
    }

    #[tokio::test]
    async fn idle_node_connections_past_the_timeout_are_closed() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let accept = tokio::spawn(async move {
            let mut held = Vec::new();
            for _ in 0..2 {
                held.push(listener.accept().await.unwrap());
            }
            held
        });
        let pool = RawPool::new(PoolConfig {
            idle_timeout: Duration::from_millis(100),
            ..PoolConfig::default()
        });
        let conn = || async {
            Upstream {
                stream: TcpStream::connect(addr).await.unwrap(),
                buf: BytesMut::new(),
            }
        };
        let t0 = Instant::now();
        pool.release("gone:80", conn().await, t0);
        assert_eq!(pool.idle_count(), 1);
        // Past the timeout, a release for another node closes it.
        let later = t0 + Duration::from_millis(150);
        pool.release("live:80", conn().await, later);
        assert_eq!(pool.idle_count(), 1);
        assert!(pool.checkout("gone:80", later).is_none());
        assert!(pool.checkout("live:80", later).is_some());
        drop(accept.await.unwrap());
    }

    #[test]
    fn hop_by_hop_headers_are_the_hyper_paths() {
        for name in crate::forward::HOP_BY_HOP
            .iter()
            .chain([&http::header::UPGRADE])
        {
            let h = classify(name.as_str());
            if *name == http::header::TRAILER {
                // Kept on responses (for HTTP/1.1 trailers), dropped upstream.
                assert!(!hop_by_hop(h) && dropped_upstream(h, false));
            } else {
                assert!(hop_by_hop(h), "{name} is hop-by-hop in the hyper path");
            }
        }
    }

    #[test]
    fn http_dates_are_rfc_7231() {
        let d = http_date();
        let s = std::str::from_utf8(&d).unwrap();
        assert!(s.ends_with(" GMT"), "{s}");
        assert!(httpdate::parse_http_date(s).is_ok(), "{s}");
    }
}
