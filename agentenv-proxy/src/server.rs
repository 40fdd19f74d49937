//! The gateway itself: authentication, dispatch, routing through the
//! scheduler, the streaming reverse proxy, RecordAssignment after creates,
//! the cluster list and node routes, and the HTTP server around them.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::pin;
use std::sync::Arc;
use std::time::Duration;

use agentenv_core::config::GatewayConfig;
use agentenv_core::metrics::grpc_status_label;
use agentenv_core::proto::scheduler_v1 as pb;
use bytes::Bytes;
use futures::future::BoxFuture;
use http::header::{self, HeaderValue};
use http::{HeaderMap, Method, Request, Response, StatusCode, Uri, Version};
use http_body::Body;
use http_body_util::BodyExt;
use hyper_util::rt::{TokioExecutor, TokioIo};
use subtle::ConstantTimeEq;
use tokio::net::TcpListener;
use tokio::time::Instant;
use tonic::{Code, Status};

use crate::body::{
    BodyDeadlineExceeded, BoxError, DeadlineBody, GatewayBody, PrefixedBody, ReplayBody, boxed,
    caused_by_client_body, client_body, concat, empty, error_response, full, json_response,
    read_prefix,
};
use crate::client::SchedulerClient;
use crate::cluster_list::{self, ListedSandbox};
use crate::forward::{
    Endpoint, Forwarded, rewrite_request_headers, rewrite_response_headers, upstream_uri,
};
use crate::hint::capture_hint;
use crate::host_route::{HostRoute, HostRouteError, HostRouter, InvalidDomain};
use crate::metrics::{GatewayMetrics, RequestLabels, RpcLabels, UpstreamLabels};
use crate::nodes::NodeView;
use crate::pool::{PoolConfig, UpstreamPool};
use crate::routing::*;

mod fast;

/// How long shutdown waits for in-flight requests.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);
/// RecordAssignment never waits longer than this.
pub const RECORD_TIMEOUT_CAP: Duration = Duration::from_secs(5);
/// Create responses are sniffed for sandbox ids up to this size when
/// `forward_response_size` is unlimited (≤ 0).
pub const SNIFF_CAP: usize = 4 * 1024 * 1024;
/// A node's list answer larger than this fails the cluster list.
pub const LIST_BODY_CAP: usize = 64 * 1024 * 1024;

/// Errors building a [`Gateway`].
#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    #[error("API key is required: set AENV_API_KEY or provide /run/secrets/api-key")]
    EmptyApiKey,
    #[error(transparent)]
    Domain(#[from] InvalidDomain),
}

/// What the gateway needs besides a scheduler.
#[derive(Debug, Clone)]
pub struct GatewayOptions {
    /// The key clients send in `X-API-Key`.
    pub api_key: String,
    /// Bounds routing plus the whole upstream exchange of ordinary requests.
    pub request_timeout: Duration,
    /// Largest create response sniffed for sandbox ids (≤ 0: the built-in cap).
    pub forward_response_size: i64,
    /// Domains for `<port>-<sandbox>.<domain>` host routing.
    pub sandbox_proxy_domains: Vec<String>,
    /// Adds `x-agentenv-node-id` to proxied responses.
    pub debug_mode: bool,
}

impl GatewayOptions {
    /// Options from the `gateway` config section.
    pub fn from_config(cfg: &GatewayConfig, api_key: impl Into<String>) -> Self {
        Self {
            api_key: api_key.into(),
            request_timeout: cfg.request_timeout,
            forward_response_size: cfg.forward_response_size,
            sandbox_proxy_domains: cfg.sandbox_proxy_domains.clone(),
            debug_mode: cfg.debug_mode,
        }
    }
}

/// The gateway as a value: mount [`Gateway::service`] in any hyper server,
/// or run [`Gateway::serve`] on a listener.
#[derive(Clone)]
pub struct Gateway {
    inner: Arc<Inner>,
    pool: UpstreamPool,
    /// Connections of the fast lane ([`Gateway::serve`]).
    raw: Arc<fast::RawPool>,
}

struct Inner {
    scheduler: Arc<dyn SchedulerClient>,
    opts: GatewayOptions,
    hosts: HostRouter,
    metrics: GatewayMetrics,
}

/// Records the request histogram when dropped: with the response status, or
/// `client_closed` when the client went away first.
struct Recorder<'a> {
    metrics: &'a GatewayMetrics,
    start: Instant,
    method: &'static str,
    route: &'static str,
    source: RouteSource,
    status: Option<u16>,
    instrument: bool,
    /// The response body is already whole in memory: its end is known
    /// when the head is.
    body_complete: bool,
}

impl Drop for Recorder<'_> {
    fn drop(&mut self) {
        if !self.instrument {
            return;
        }
        let status = self.status.map(status_label).unwrap_or("client_closed");
        self.metrics.observe_request(
            RequestLabels {
                method: self.method,
                route: self.route,
                route_source: self.source.label(),
                status,
            },
            self.start.elapsed().as_secs_f64(),
        );
    }
}

/// The request histogram sample of a request whose response body is still
/// being sent.
struct RequestDone {
    inner: Arc<Inner>,
    labels: RequestLabels,
    start: Instant,
}

impl RequestDone {
    fn record(self) {
        self.inner
            .metrics
            .observe_request(self.labels, self.start.elapsed().as_secs_f64());
    }
}

/// A response body that records its request when it ends, fails or is
/// dropped (the client went away mid-body: the status was already sent).
struct TimedBody {
    inner: GatewayBody,
    done: Option<RequestDone>,
}

impl Body for TimedBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        let polled = std::pin::Pin::new(&mut this.inner).poll_frame(cx);
        let finished = match &polled {
            std::task::Poll::Ready(None | Some(Err(_))) => true,
            std::task::Poll::Ready(Some(Ok(_))) => this.inner.is_end_stream(),
            std::task::Poll::Pending => false,
        };
        if finished && let Some(done) = this.done.take() {
            done.record();
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for TimedBody {
    fn drop(&mut self) {
        if let Some(done) = self.done.take() {
            done.record();
        }
    }
}

/// What routing looks at, however the request was read.
struct RoutingFacts<'a> {
    method: &'a Method,
    decoded: &'a str,
    host_route: &'a Result<Option<HostRoute>, HostRouteError>,
    /// The first non-blank sandbox id header.
    sandbox_id: Option<&'a str>,
    /// A target port header is present and non-blank.
    has_port: bool,
}

/// The outcome of [`Gateway::decide`].
enum Decision<'a> {
    Reject(StatusCode, &'static str),
    /// `/health` or `/metrics` answered by the gateway itself.
    Local,
    /// The `Host` names a proxy domain but is not a valid sandbox host.
    BadHost,
    ClusterList {
        v2: bool,
    },
    NodeList,
    NodeDetail(&'a str),
    /// Proxied to the sandbox's node (`id`) or a scheduled one (`None`).
    Route {
        id: Option<&'a str>,
        source: RouteSource,
    },
}

/// Where a proxied request goes and how.
struct ProxyPlan {
    node: pb::Node,
    uri: Uri,
    route: &'static str,
    /// `None` for long-lived requests (no timeout).
    deadline: Option<Instant>,
    record: bool,
    host_route: Option<HostRoute>,
}

impl Gateway {
    /// Builds a gateway that routes through `scheduler`.
    pub fn new(
        scheduler: impl SchedulerClient,
        opts: GatewayOptions,
    ) -> Result<Self, GatewayError> {
        Self::with_metrics(scheduler, opts, GatewayMetrics::new())
    }

    /// Like [`Gateway::new`], recording into `metrics`.
    pub fn with_metrics(
        scheduler: impl SchedulerClient,
        opts: GatewayOptions,
        metrics: GatewayMetrics,
    ) -> Result<Self, GatewayError> {
        if opts.api_key.is_empty() {
            return Err(GatewayError::EmptyApiKey);
        }
        let hosts = HostRouter::new(&opts.sandbox_proxy_domains)?;
        let pool = upstream_pool(opts.request_timeout);
        Ok(Self {
            inner: Arc::new(Inner {
                scheduler: Arc::new(scheduler),
                opts,
                hosts,
                metrics,
            }),
            raw: Arc::new(fast::RawPool::new(pool.config().clone())),
            pool,
        })
    }

    /// The same gateway with a connection pool of its own. A server that
    /// runs one single-threaded runtime per core gives each its own pool, so
    /// a request never waits on a connection driven by another thread.
    pub fn with_own_pool(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            pool: UpstreamPool::new(self.pool.config().clone()),
            raw: Arc::new(fast::RawPool::new(self.pool.config().clone())),
        }
    }

    /// The same gateway reaching `https://` nodes with `tls` (e.g. trusting
    /// a private CA) instead of the bundled Mozilla roots.
    pub fn with_upstream_tls(&self, tls: Arc<rustls::ClientConfig>) -> Self {
        Self {
            inner: self.inner.clone(),
            pool: UpstreamPool::new(PoolConfig {
                tls: Some(tls),
                ..self.pool.config().clone()
            }),
            raw: self.raw.clone(),
        }
    }

    /// The gateway's metrics (expose `metrics().registry()`).
    pub fn metrics(&self) -> &GatewayMetrics {
        &self.inner.metrics
    }

    /// A hyper service for one client connection from `remote`.
    pub fn service(&self, remote: SocketAddr) -> GatewayService {
        GatewayService {
            gateway: self.clone(),
            remote,
        }
    }

    /// Serves HTTP/1.1 and HTTP/2 (cleartext) on `listener` until
    /// `shutdown` resolves, then waits up to [`SHUTDOWN_GRACE`] for
    /// in-flight requests. Relayed WebSockets are not waited for.
    ///
    /// Ordinary HTTP/1.1 requests routed by sandbox id go through a fast
    /// lane that relays heads and bodies without building hyper messages;
    /// a connection's first request that does not qualify (HTTP/2,
    /// upgrades, streams, creates, lists, errors…) hands the connection to
    /// the same hyper service [`Gateway::service`] provides. Both answer
    /// alike; the fast lane only costs less CPU per request.
    pub async fn serve(&self, listener: TcpListener, shutdown: impl Future<Output = ()>) {
        // Every connection holds a receiver: the sender sees them all gone.
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        let mut shutdown = pin!(shutdown);
        loop {
            let (stream, remote) = tokio::select! {
                _ = &mut shutdown => break,
                accepted = listener.accept() => match accepted {
                    Ok(a) => a,
                    Err(e) => {
                        tracing::warn!(error = %e, "accepting a connection failed");
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        continue;
                    }
                },
            };
            if let Err(e) = stream.set_nodelay(true) {
                tracing::debug!(error = %e, "setting TCP_NODELAY failed");
            }
            let guard = self.inner.metrics.connection_guard();
            let gateway = self.clone();
            let stop = stop_rx.clone();
            tokio::spawn(async move {
                let _guard = guard;
                gateway.serve_connection(stream, remote, stop).await;
            });
        }
        drop(listener);
        drop(stop_rx);
        let _ = stop_tx.send(true);
        tokio::select! {
            _ = stop_tx.closed() => {}
            _ = tokio::time::sleep(SHUTDOWN_GRACE) => {
                tracing::warn!("shutdown grace period over; closing remaining connections");
            }
        }
    }

    /// Serves on `addr` from `threads` OS threads, each running a
    /// single-threaded runtime with its own `SO_REUSEPORT` listener and its
    /// own upstream pool, so a request is handled start to finish on one
    /// thread without cross-thread wake-ups. `shutdown` is awaited on the
    /// caller's runtime; then every thread drains as in [`Gateway::serve`].
    /// Must be called from within a tokio runtime.
    pub fn serve_threads(
        &self,
        addr: SocketAddr,
        threads: usize,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> std::io::Result<ServeHandle> {
        let threads = threads.max(1);
        let socket = |bind: SocketAddr| -> std::io::Result<tokio::net::TcpSocket> {
            let s = if bind.is_ipv4() {
                tokio::net::TcpSocket::new_v4()?
            } else {
                tokio::net::TcpSocket::new_v6()?
            };
            s.set_reuseaddr(true)?;
            s.set_reuseport(true)?;
            s.set_nodelay(true)?;
            s.bind(bind)?;
            Ok(s)
        };
        let first = socket(addr)?;
        let local_addr = first.local_addr()?;
        let mut sockets = vec![first];
        for _ in 1..threads {
            sockets.push(socket(local_addr)?);
        }
        // Listen now, so the address accepts connections when this returns;
        // each thread then drives its listener on its own runtime.
        let listeners = sockets
            .into_iter()
            .map(|s| s.listen(4096).and_then(|l| l.into_std()))
            .collect::<std::io::Result<Vec<_>>>()?;
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        tokio::spawn(async move {
            shutdown.await;
            let _ = stop_tx.send(true);
        });
        let mut handles = Vec::with_capacity(threads);
        for (i, listener) in listeners.into_iter().enumerate() {
            let gateway = self.with_own_pool();
            let mut stop = stop_rx.clone();
            let handle = std::thread::Builder::new()
                .name(format!("gateway-{i}"))
                .spawn(move || {
                    let rt = match tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                    {
                        Ok(rt) => rt,
                        Err(e) => {
                            tracing::error!(error = %e, "cannot start a gateway runtime thread");
                            return;
                        }
                    };
                    rt.block_on(async move {
                        let listener = match TcpListener::from_std(listener) {
                            Ok(l) => l,
                            Err(e) => {
                                tracing::error!(error = %e, "cannot listen");
                                return;
                            }
                        };
                        gateway
                            .serve(listener, async move {
                                let _ = stop.wait_for(|s| *s).await;
                            })
                            .await;
                    });
                })?;
            handles.push(handle);
        }
        Ok(ServeHandle {
            local_addr,
            handles,
        })
    }

    /// Handles one request from `remote`. Never fails: errors are responses.
    pub async fn handle<B>(&self, req: Request<B>, remote: SocketAddr) -> Response<GatewayBody>
    where
        B: Body<Data = Bytes> + Send + 'static,
        B::Error: Into<BoxError>,
    {
        let req = req.map(client_body);
        let mut rec = Recorder {
            metrics: &self.inner.metrics,
            start: Instant::now(),
            method: method_label(req.method()),
            route: "unmatched",
            source: RouteSource::Unknown,
            status: None,
            instrument: true,
            body_complete: false,
        };
        let resp = self.dispatch(req, remote, &mut rec).await;
        if !rec.instrument || rec.body_complete || resp.body().is_end_stream() {
            rec.status = Some(resp.status().as_u16());
            return resp;
        }
        // The request lasts until its response body has been sent.
        rec.instrument = false;
        let done = RequestDone {
            inner: self.inner.clone(),
            labels: RequestLabels {
                method: rec.method,
                route: rec.route,
                route_source: rec.source.label(),
                status: status_label(resp.status().as_u16()),
            },
            start: rec.start,
        };
        resp.map(|inner| {
            boxed(TimedBody {
                inner,
                done: Some(done),
            })
        })
    }

    fn authorized(&self, headers: &HeaderMap) -> bool {
        let mut values = headers.get_all(API_KEY_HEADER).iter();
        let (Some(v), None) = (values.next(), values.next()) else {
            return false;
        };
        let key = self.inner.opts.api_key.as_bytes();
        v.as_bytes().len() == key.len() && bool::from(v.as_bytes().ct_eq(key))
    }

    /// How a request is routed; the rules of §4.2, shared by the hyper path
    /// and the fast lane. `authorized` is asked only when the route needs it.
    fn decide<'a>(&self, f: &RoutingFacts<'a>, authorized: impl FnOnce() -> bool) -> Decision<'a> {
        let d = f.decoded;
        let local_path = d == "/health" || d == "/metrics";
        let proxy_path = is_proxy_path(d);
        let control_plane = is_control_plane(f.method, d);
        let id_header = f.sandbox_id.is_some();
        let exempt = local_path
            || proxy_path
            || matches!(f.host_route, Ok(Some(_)))
            || (!control_plane && id_header && f.has_port);
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
        if host_route.is_none() && !routing_headers && *f.method == Method::GET {
            let trimmed = trim_trailing_slashes(d);
            if trimmed == "/sandboxes" || trimmed == "/v2/sandboxes" {
                return Decision::ClusterList {
                    v2: trimmed == "/v2/sandboxes",
                };
            }
            if trimmed == "/nodes" {
                return Decision::NodeList;
            }
            if let Some(node_id) = node_id_from_path(d) {
                return Decision::NodeDetail(node_id);
            }
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

    async fn dispatch(
        &self,
        req: Request<GatewayBody>,
        remote: SocketAddr,
        rec: &mut Recorder<'_>,
    ) -> Response<GatewayBody> {
        let Some(decoded) = decode_path(req.uri().path()).map(std::borrow::Cow::into_owned) else {
            return error_response(
                StatusCode::BAD_REQUEST,
                "invalid request path: bad percent-encoding",
            );
        };
        rec.route = route_label(&decoded);
        let host = request_host(&req);
        let host_route = self
            .inner
            .hosts
            .route(host.as_ref().and_then(|h| h.to_str().ok()).unwrap_or(""));
        let headers = req.headers();
        let facts = RoutingFacts {
            method: req.method(),
            decoded: &decoded,
            host_route: &host_route,
            sandbox_id: sandbox_id_from_headers(headers),
            has_port: target_port_from_headers(headers).is_some(),
        };
        let deadline = rec.start + self.inner.opts.request_timeout;
        // Owned from here on: the request moves into the handler.
        let (sandbox_id, source) = match self.decide(&facts, || self.authorized(headers)) {
            Decision::Reject(status, message) => return error_response(status, message),
            Decision::Local => {
                rec.instrument = false;
                return if decoded == "/health" {
                    let mut resp = Response::new(empty());
                    *resp.status_mut() = StatusCode::NO_CONTENT;
                    resp
                } else {
                    error_response(StatusCode::NOT_FOUND, "404 page not found")
                };
            }
            Decision::BadHost => {
                let message = host_route.err().map(|e| e.to_string()).unwrap_or_default();
                return error_response(StatusCode::BAD_REQUEST, &message);
            }
            Decision::ClusterList { v2 } => {
                rec.source = RouteSource::Gateway;
                // Rare paths are boxed so their state does not grow
                // (and get copied with) every proxied request's future.
                return Box::pin(self.cluster_list(req, remote, v2, deadline)).await;
            }
            Decision::NodeList => {
                rec.source = RouteSource::Gateway;
                let query = req.uri().query().map(str::to_string);
                return Box::pin(self.node_list(query.as_deref(), deadline)).await;
            }
            Decision::NodeDetail(node_id) => {
                rec.source = RouteSource::Gateway;
                let node_id = node_id.to_string();
                let long_lived = is_long_lived(req.headers());
                return Box::pin(self.node_detail(req, remote, &node_id, deadline, long_lived))
                    .await;
            }
            Decision::Route { id, source } => (id.map(str::to_string), source),
        };
        let host_route = host_route.ok().flatten();
        self.handle_proxy(req, remote, decoded, sandbox_id, source, host_route, rec)
            .await
    }

    #[allow(clippy::too_many_arguments)]
    async fn handle_proxy(
        &self,
        mut req: Request<GatewayBody>,
        remote: SocketAddr,
        decoded: String,
        sandbox_id: Option<String>,
        source: RouteSource,
        host_route: Option<HostRoute>,
        rec: &mut Recorder<'_>,
    ) -> Response<GatewayBody> {
        let opts = &self.inner.opts;
        let deadline = rec.start + opts.request_timeout;
        let long_lived = is_long_lived(req.headers());
        rec.source = source;

        // Call the trait object itself, not the blanket impl for `Arc<T>`
        // (which would box one more future per call).
        let scheduler: &dyn SchedulerClient = &*self.inner.scheduler;
        let node = match sandbox_id {
            Some(id) => {
                self.rpc("LookupNode", deadline, scheduler.lookup_node(&id))
                    .await
            }
            None => {
                let hint = match create_kind(req.method(), &decoded) {
                    Some(kind) => {
                        let (mut parts, body) = req.into_parts();
                        let captured = tokio::time::timeout_at(
                            deadline,
                            Box::pin(capture_hint(kind, &mut parts.headers, body)),
                        )
                        .await;
                        match captured {
                            Ok(Ok((hint, body))) => {
                                req = Request::from_parts(parts, body);
                                Some(hint)
                            }
                            Ok(Err(e)) => {
                                tracing::debug!(error = ?e, "reading a create body failed");
                                return error_response(
                                    StatusCode::BAD_REQUEST,
                                    "failed to read request body",
                                );
                            }
                            Err(_) => {
                                return error_response(
                                    StatusCode::BAD_REQUEST,
                                    "failed to read request body",
                                );
                            }
                        }
                    }
                    None => None,
                };
                Box::pin(self.rpc("Schedule", deadline, scheduler.schedule(hint))).await
            }
        };
        let node = match node {
            Ok(n) => n,
            Err(status) => return scheduler_error(&status),
        };

        // Data-plane routes go under `/proxy` (kept once if already there).
        let under_proxy = source.is_data_plane() && !is_proxy_path(&decoded);
        let parts: &[&str] = if under_proxy {
            &["/proxy", req.uri().path()]
        } else {
            &[req.uri().path()]
        };
        let uri = match Endpoint::cached(&node.endpoint)
            .and_then(|e| e.uri(parts, req.uri().query()))
        {
            Ok(u) => u,
            Err(e) => {
                tracing::warn!(node_id = %node.node_id, error = %e, "scheduler returned an unusable endpoint");
                return error_response(StatusCode::BAD_GATEWAY, "invalid upstream endpoint");
            }
        };
        let record = records_assignment(req.method(), &decoded, source);
        let plan = ProxyPlan {
            node,
            uri,
            route: rec.route,
            deadline: (!long_lived).then_some(deadline),
            record,
            host_route,
        };
        // Boxed: the exchange's state then lives in one place instead of
        // being moved through every caller's future on the way in.
        Box::pin(self.proxy(req, remote, plan, &mut rec.body_complete)).await
    }

    async fn rpc<T>(
        &self,
        name: &'static str,
        deadline: Instant,
        call: impl Future<Output = Result<T, Status>>,
    ) -> Result<T, Status> {
        let start = Instant::now();
        let result = match tokio::time::timeout_at(deadline, call).await {
            Ok(r) => r,
            Err(_) => Err(Status::deadline_exceeded(
                "scheduler call exceeded the request timeout",
            )),
        };
        let code = result.as_ref().map_or_else(|s| s.code(), |_| Code::Ok);
        self.inner.metrics.observe_rpc(
            RpcLabels {
                rpc: name,
                status: grpc_status_label(code),
            },
            start.elapsed().as_secs_f64(),
        );
        result
    }

    /// Sets `body_complete` when the response body is already whole.
    async fn proxy(
        &self,
        mut req: Request<GatewayBody>,
        remote: SocketAddr,
        plan: ProxyPlan,
        body_complete: &mut bool,
    ) -> Response<GatewayBody> {
        let websocket = is_websocket(req.headers());
        let client_upgrade = websocket.then(|| hyper::upgrade::on(&mut req));
        let host = request_host(&req);
        let stream_input = is_stream_input(req.method(), req.uri().path());
        let (mut parts, body) = req.into_parts();
        rewrite_request_headers(
            &mut parts.headers,
            websocket,
            &Forwarded {
                client_ip: remote.ip().to_canonical(),
                host: host.as_ref(),
                method: &parts.method,
                request_uri: parts.uri.path_and_query().map_or("/", |p| p.as_str()),
            },
        );
        if let Some(r) = &plan.host_route {
            parts.headers.insert(
                SANDBOX_ID_HEADER,
                HeaderValue::from_str(&r.sandbox_id).expect("a DNS label is a valid header"),
            );
            parts
                .headers
                .insert(TARGET_PORT_HEADER, HeaderValue::from(r.port));
        }
        parts.uri = plan.uri;
        parts.version = Version::HTTP_11;
        parts.extensions = http::Extensions::new();
        let method = parts.method.clone();
        let upstream_req = Request::from_parts(parts, body);

        let start = Instant::now();
        let sent = self.pool.send(upstream_req);
        let result = match plan.deadline {
            Some(d) => match tokio::time::timeout_at(d, sent).await {
                Ok(r) => r.map_err(Some),
                Err(_) => Err(None),
            },
            None => sent.await.map_err(Some),
        };
        let upstream_metric = |status: &'static str| {
            self.inner.metrics.observe_upstream(
                UpstreamLabels {
                    route: plan.route,
                    status,
                },
                start.elapsed().as_secs_f64(),
            );
        };
        let mut resp = match result {
            Ok(r) => r,
            Err(None) => {
                upstream_metric("5xx");
                tracing::warn!(node_id = %plan.node.node_id, "upstream did not answer before the request timeout");
                return error_response(StatusCode::GATEWAY_TIMEOUT, "upstream timeout");
            }
            Err(Some(e)) if caused_by_client_body(&e) => {
                upstream_metric("4xx");
                if stream_input {
                    tracing::debug!(error = %e, "client stopped sending the request body");
                } else {
                    tracing::warn!(error = %e, "client stopped sending the request body");
                }
                return error_response(StatusCode::BAD_REQUEST, "failed to read request body");
            }
            Err(Some(e)) => {
                upstream_metric("5xx");
                tracing::warn!(node_id = %plan.node.node_id, endpoint = %plan.node.endpoint, error = ?e, "upstream request failed");
                return upstream_unavailable(&plan.node);
            }
        };
        upstream_metric(status_label(resp.status().as_u16()));

        if resp.status() == StatusCode::SWITCHING_PROTOCOLS
            && let Some(client_upgrade) = client_upgrade
        {
            let upstream_upgrade = hyper::upgrade::on(&mut resp);
            let guard = self.inner.metrics.connection_guard();
            tokio::spawn(async move {
                let _guard = guard;
                match tokio::try_join!(client_upgrade, upstream_upgrade) {
                    Ok((client, upstream)) => {
                        let mut client = TokioIo::new(client);
                        let mut upstream = TokioIo::new(upstream);
                        if let Err(e) =
                            tokio::io::copy_bidirectional(&mut client, &mut upstream).await
                        {
                            tracing::debug!(error = %e, "upgraded connection ended with an error");
                        }
                    }
                    Err(e) => tracing::debug!(error = %e, "upgrade was not completed"),
                }
            });
        }

        let (parts, body) = resp.into_parts();
        let body = match plan.deadline {
            Some(d) => {
                let mut body = DeadlineBody::new(body, d);
                // Wait for the first frame of an ordinary response, so the
                // head and a small body leave in one write instead of two.
                // Streams (no deadline) are relayed as they come.
                if body.is_end_stream() || plan.record {
                    boxed(body)
                } else {
                    match body.frame().await {
                        Some(Ok(first)) => {
                            *body_complete = body.is_end_stream();
                            boxed(PrefixedBody::new(first, body))
                        }
                        Some(Err(e)) if e.is::<BodyDeadlineExceeded>() => {
                            return error_response(StatusCode::GATEWAY_TIMEOUT, "upstream timeout");
                        }
                        Some(Err(e)) => {
                            tracing::warn!(node_id = %plan.node.node_id, error = %e, "upstream response body failed");
                            return upstream_unavailable(&plan.node);
                        }
                        None => empty(),
                    }
                }
            }
            None => boxed(body),
        };
        let mut resp = Response::from_parts(parts, body);
        if plan.record && resp.status().is_success() {
            resp = match Box::pin(self.record_created(resp, &plan.node, &method)).await {
                Ok(r) => r,
                Err(err) => return err,
            };
        }

        let switching = resp.status() == StatusCode::SWITCHING_PROTOCOLS;
        let (mut parts, body) = resp.into_parts();
        rewrite_response_headers(&mut parts.headers, switching);
        if self.inner.opts.debug_mode
            && let Ok(v) = HeaderValue::from_str(&plan.node.node_id)
        {
            parts.headers.insert(NODE_ID_HEADER, v);
        }
        Response::from_parts(parts, body)
    }

    /// RecordAssignment for a successful create or fork. The id comes from
    /// the response header, else (best-effort, bounded) from the JSON body.
    async fn record_created(
        &self,
        resp: Response<GatewayBody>,
        node: &pb::Node,
        method: &Method,
    ) -> Result<Response<GatewayBody>, Response<GatewayBody>> {
        let header_id = sandbox_id_from_headers(resp.headers()).map(str::to_string);
        if let Some(id) = header_id {
            self.record(&[id], node).await;
            return Ok(resp);
        }
        let limit = match self.inner.opts.forward_response_size {
            n if n > 0 => usize::try_from(n).unwrap_or(usize::MAX),
            _ => SNIFF_CAP,
        };
        let (mut parts, body) = resp.into_parts();
        let body = match read_prefix(body, limit).await {
            Err(e) if e.is::<BodyDeadlineExceeded>() => {
                return Err(error_response(
                    StatusCode::GATEWAY_TIMEOUT,
                    "upstream timeout",
                ));
            }
            Err(e) => {
                tracing::warn!(error = %e, "reading the create response failed");
                return Err(error_response(
                    StatusCode::BAD_GATEWAY,
                    "failed to read upstream response",
                ));
            }
            Ok((frames, _, Some(rest))) => {
                tracing::warn!(
                    %method,
                    limit,
                    "create response without a sandbox id header is larger than forward_response_size; \
                     the binding is left to the node's next heartbeat"
                );
                boxed(ReplayBody::new(frames, Some(rest)))
            }
            Ok((frames, len, None)) => {
                let bytes = concat(&frames);
                let ids = extract_sandbox_ids(&bytes);
                if ids.is_empty() {
                    tracing::warn!("create response carries no sandbox id; nothing recorded");
                }
                self.record(&ids, node).await;
                if frames.iter().any(|f| f.is_trailers()) {
                    boxed(ReplayBody::new(frames, None))
                } else {
                    parts.headers.remove(header::TRANSFER_ENCODING);
                    parts
                        .headers
                        .insert(header::CONTENT_LENGTH, HeaderValue::from(len));
                    full(bytes)
                }
            }
        };
        Ok(Response::from_parts(parts, body))
    }

    async fn record(&self, ids: &[String], node: &pb::Node) {
        let deadline = Instant::now() + record_timeout(self.inner.opts.request_timeout);
        for id in ids {
            let call = self.inner.scheduler.record_assignment(id, node.clone());
            if let Err(status) = self.rpc("RecordAssignment", deadline, call).await {
                tracing::warn!(
                    sandbox_id = %id,
                    node_id = %node.node_id,
                    code = ?status.code(),
                    message = status.message(),
                    "RecordAssignment failed; the node's next heartbeat will bind the sandbox"
                );
            }
        }
    }

    async fn node_list(&self, query: Option<&str>, deadline: Instant) -> Response<GatewayBody> {
        let cluster = query_value(query, "clusterID").unwrap_or_default();
        let call = self.inner.scheduler.list_observed_nodes(cluster.trim());
        match self.rpc("ListObservedNodes", deadline, call).await {
            Ok(nodes) => {
                let views: Vec<NodeView> = nodes.iter().map(NodeView::from).collect();
                json_response(StatusCode::OK, &views)
            }
            Err(status) => scheduler_error(&status),
        }
    }

    async fn node_detail(
        &self,
        req: Request<GatewayBody>,
        remote: SocketAddr,
        node_id: &str,
        deadline: Instant,
        long_lived: bool,
    ) -> Response<GatewayBody> {
        let cluster = query_value(req.uri().query(), "clusterID").unwrap_or_default();
        let call = self.inner.scheduler.get_node(node_id, cluster.trim());
        let observed = match self.rpc("GetNode", deadline, call).await {
            Ok(n) => n,
            Err(status) => return scheduler_error(&status),
        };
        if observed.endpoint.trim().is_empty() {
            return error_response(StatusCode::BAD_GATEWAY, "resolved node endpoint is empty");
        }
        let uri = match upstream_uri(&observed.endpoint, req.uri().path(), req.uri().query()) {
            Ok(u) => u,
            Err(_) => return error_response(StatusCode::BAD_GATEWAY, "invalid upstream endpoint"),
        };
        let plan = ProxyPlan {
            node: pb::Node {
                node_id: observed.node_id.clone(),
                endpoint: observed.endpoint.clone(),
            },
            uri,
            route: "/nodes/{node_id}",
            deadline: (!long_lived).then_some(deadline),
            record: false,
            host_route: None,
        };
        self.proxy(req, remote, plan, &mut false).await
    }

    async fn cluster_list(
        &self,
        req: Request<GatewayBody>,
        remote: SocketAddr,
        v2: bool,
        deadline: Instant,
    ) -> Response<GatewayBody> {
        let nodes = match self
            .rpc("ListNodes", deadline, self.inner.scheduler.list_nodes())
            .await
        {
            Ok(n) => n,
            Err(status) => return scheduler_error(&status),
        };
        if nodes.is_empty() {
            return error_response(StatusCode::BAD_GATEWAY, "cluster list unavailable");
        }
        let raw_query = req.uri().query().unwrap_or("").to_string();
        let pairs = cluster_list::parse_query(&raw_query);
        let upstream_query = if v2 {
            cluster_list::v2_upstream_query(&pairs)
        } else {
            raw_query.clone()
        };
        let upstream_query = (!upstream_query.is_empty()).then_some(upstream_query);
        let host = request_host(&req);
        let request_uri = req
            .uri()
            .path_and_query()
            .map(|p| p.as_str().to_string())
            .unwrap_or_else(|| "/".into());
        let mut headers = req.headers().clone();
        rewrite_request_headers(
            &mut headers,
            false,
            &Forwarded {
                client_ip: remote.ip().to_canonical(),
                host: host.as_ref(),
                method: req.method(),
                request_uri: &request_uri,
            },
        );
        headers.remove(header::CONTENT_LENGTH);
        let path = req.uri().path().to_string();
        let fetches = nodes.iter().map(|node| {
            let headers = headers.clone();
            let path = path.as_str();
            let query = upstream_query.as_deref();
            async move {
                let uri = upstream_uri(&node.endpoint, path, query).map_err(|_| None)?;
                let mut up = Request::new(empty());
                *up.uri_mut() = uri;
                *up.headers_mut() = headers;
                let resp = self.pool.send(up).await.map_err(|e| {
                    tracing::warn!(node_id = %node.node_id, error = ?e, "cluster list: node unreachable");
                    None
                })?;
                let status = resp.status();
                if !status.is_success() {
                    tracing::warn!(node_id = %node.node_id, %status, "cluster list: node answered with an error");
                    return Err(Some(status));
                }
                let (frames, _, rest) = read_prefix(boxed(resp.into_body()), LIST_BODY_CAP).await.map_err(|_| None)?;
                if rest.is_some() {
                    tracing::warn!(node_id = %node.node_id, "cluster list: node answer too large");
                    return Err(None);
                }
                serde_json::from_slice::<Vec<ListedSandbox>>(&concat(&frames)).map_err(|e| {
                    tracing::warn!(node_id = %node.node_id, error = %e, "cluster list: node answer is not a sandbox list");
                    None
                })
            }
        });
        let all = match tokio::time::timeout_at(deadline, futures::future::try_join_all(fetches))
            .await
        {
            Ok(Ok(lists)) => lists.into_iter().flatten().collect::<Vec<_>>(),
            Ok(Err(Some(status))) if status.is_client_error() => {
                return error_response(status, status.canonical_reason().unwrap_or("client error"));
            }
            Ok(Err(_)) | Err(_) => {
                return error_response(StatusCode::BAD_GATEWAY, "cluster list unavailable");
            }
        };
        let merged = cluster_list::merge(all);
        if !v2 {
            return json_response(StatusCode::OK, &merged);
        }
        let limit = match cluster_list::parse_limit(&pairs) {
            Ok(l) => l,
            Err(e) => return error_response(StatusCode::BAD_REQUEST, &e.to_string()),
        };
        let token = pairs
            .iter()
            .find(|(k, _)| k == "nextToken")
            .map(|(_, v)| v.as_str());
        let cursor = match cluster_list::parse_token(token, time::OffsetDateTime::now_utc()) {
            Ok(c) => c,
            Err(e) => return error_response(StatusCode::BAD_REQUEST, &e.to_string()),
        };
        let (page, next) = cluster_list::paginate(merged, cursor, limit);
        let mut resp = json_response(StatusCode::OK, &page);
        if let Some(next) = next
            && let Ok(v) = HeaderValue::from_str(&next)
        {
            resp.headers_mut().insert(NEXT_TOKEN_HEADER, v);
        }
        resp
    }
}

/// RecordAssignment's timeout: `request_timeout` capped at 5 s (5 s when zero).
pub fn record_timeout(request_timeout: Duration) -> Duration {
    if request_timeout.is_zero() {
        RECORD_TIMEOUT_CAP
    } else {
        request_timeout.min(RECORD_TIMEOUT_CAP)
    }
}

fn upstream_pool(request_timeout: Duration) -> UpstreamPool {
    UpstreamPool::new(PoolConfig {
        connect_timeout: request_timeout.max(Duration::from_secs(1)),
        ..PoolConfig::default()
    })
}

/// 502 for a node that did not answer, naming it.
fn upstream_unavailable(node: &pb::Node) -> Response<GatewayBody> {
    error_response(
        StatusCode::BAD_GATEWAY,
        &format!(
            "upstream unavailable: node {} at {} did not answer",
            node.node_id, node.endpoint
        ),
    )
}

/// What to check when the scheduler has no healthy node.
pub const NO_NODES_HINT: &str = "no runtime node has sent a heartbeat within scheduler.report_ttl; check GET /nodes, and that every node sets AENV_OBSERVABILITY_SCHEDULER_REPORT_ENABLED=true and AENV_OBSERVABILITY_SCHEDULER_ENDPOINT=http://<scheduler>:9090";

/// A scheduler error as an HTTP response.
pub fn scheduler_error(status: &Status) -> Response<GatewayBody> {
    match status.code() {
        Code::InvalidArgument => error_response(StatusCode::BAD_REQUEST, status.message()),
        Code::NotFound => error_response(StatusCode::NOT_FOUND, status.message()),
        Code::Unavailable if status.message() == "no nodes available" => error_response(
            StatusCode::SERVICE_UNAVAILABLE,
            &format!("no nodes available: {NO_NODES_HINT}"),
        ),
        Code::Unavailable => error_response(StatusCode::SERVICE_UNAVAILABLE, status.message()),
        _ => {
            tracing::warn!(code = ?status.code(), message = status.message(), "scheduler error");
            error_response(StatusCode::BAD_GATEWAY, "scheduler error")
        }
    }
}

/// Sandbox ids in a create or fork response body: `sandboxID`, `sandboxId`
/// or `sandbox_id` at the top level, in `data`, and in the items of
/// `sandboxes` and `data.sandboxes`. Blanks skipped, order kept, no repeats.
pub fn extract_sandbox_ids(body: &[u8]) -> Vec<String> {
    let Ok(value) = serde_json::from_slice::<serde_json::Value>(body) else {
        return Vec::new();
    };
    let mut out: Vec<String> = Vec::new();
    let mut take = |obj: &serde_json::Value| {
        for key in ["sandboxID", "sandboxId", "sandbox_id"] {
            if let Some(id) = obj.get(key).and_then(|v| v.as_str()).map(str::trim)
                && !id.is_empty()
                && !out.iter().any(|o| o == id)
            {
                out.push(id.to_string());
            }
        }
    };
    let data = value.get("data");
    take(&value);
    if let Some(d) = data {
        take(d);
    }
    for list in [
        value.get("sandboxes"),
        data.and_then(|d| d.get("sandboxes")),
    ]
    .into_iter()
    .flatten()
    {
        if let Some(items) = list.as_array() {
            items.iter().for_each(&mut take);
        }
    }
    out
}

fn request_host<B>(req: &Request<B>) -> Option<HeaderValue> {
    req.headers().get(header::HOST).cloned().or_else(|| {
        req.uri()
            .authority()
            .and_then(|a| HeaderValue::from_str(a.as_str()).ok())
    })
}

/// The decoded path (bytes that are not UTF-8 become U+FFFD; the raw path
/// is what gets forwarded), or `None` when a `%` is not followed by two hex
/// digits.
fn decode_path(raw: &str) -> Option<std::borrow::Cow<'_, str>> {
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

fn query_value(query: Option<&str>, key: &str) -> Option<String> {
    cluster_list::parse_query(query?)
        .into_iter()
        .find(|(k, _)| k == key)
        .map(|(_, v)| v)
}

/// The threads started by [`Gateway::serve_threads`].
pub struct ServeHandle {
    local_addr: SocketAddr,
    handles: Vec<std::thread::JoinHandle<()>>,
}

impl ServeHandle {
    /// The address the gateway listens on (useful after binding port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Waits until every serving thread has drained and stopped.
    pub async fn wait(self) {
        let _ = tokio::task::spawn_blocking(move || {
            for h in self.handles {
                let _ = h.join();
            }
        })
        .await;
    }
}

/// A [`Gateway`] bound to one client connection, as a hyper service.
#[derive(Clone)]
pub struct GatewayService {
    gateway: Gateway,
    remote: SocketAddr,
}

impl<B> hyper::service::Service<Request<B>> for GatewayService
where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    type Response = Response<GatewayBody>;
    type Error = Infallible;
    type Future = BoxFuture<'static, Result<Response<GatewayBody>, Infallible>>;

    fn call(&self, req: Request<B>) -> Self::Future {
        let gateway = self.gateway.clone();
        let remote = self.remote;
        Box::pin(async move { Ok(gateway.handle(req, remote).await) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn body_ids_come_from_top_level_data_and_lists_in_order() {
        assert_eq!(extract_sandbox_ids(br#"{"sandboxID":"a"}"#), ["a"]);
        assert_eq!(
            extract_sandbox_ids(br#"{"sandboxId":"a","data":{"sandbox_id":"b"}}"#),
            ["a", "b"]
        );
        assert_eq!(
            extract_sandbox_ids(br#"{"sandboxes":[{"sandboxID":"x"},{"sandboxID":" "},{"sandboxID":"y"},{"sandboxID":"x"}]}"#),
            ["x", "y"]
        );
        assert_eq!(
            extract_sandbox_ids(br#"{"data":{"sandboxes":[{"sandboxID":"z"}]}}"#),
            ["z"]
        );
        assert!(extract_sandbox_ids(b"not json").is_empty());
    }

    #[test]
    fn record_timeout_is_the_request_timeout_capped_at_five_seconds() {
        assert_eq!(
            record_timeout(Duration::from_secs(90)),
            Duration::from_secs(5)
        );
        assert_eq!(
            record_timeout(Duration::from_secs(2)),
            Duration::from_secs(2)
        );
        assert_eq!(record_timeout(Duration::ZERO), Duration::from_secs(5));
    }

    #[test]
    fn scheduler_codes_map_to_http_statuses() {
        let s = |c, m: &str| scheduler_error(&Status::new(c, m)).status();
        assert_eq!(s(Code::InvalidArgument, "x"), StatusCode::BAD_REQUEST);
        assert_eq!(
            s(Code::NotFound, "sandbox assignment not found"),
            StatusCode::NOT_FOUND
        );
        assert_eq!(
            s(Code::Unavailable, "no nodes available"),
            StatusCode::SERVICE_UNAVAILABLE
        );
        assert_eq!(s(Code::DeadlineExceeded, "x"), StatusCode::BAD_GATEWAY);
        assert_eq!(s(Code::Internal, "x"), StatusCode::BAD_GATEWAY);
        assert_eq!(s(Code::Unimplemented, "x"), StatusCode::BAD_GATEWAY);
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
