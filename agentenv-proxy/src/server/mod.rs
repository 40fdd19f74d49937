//! The gateway itself: authentication, dispatch, routing through the
//! scheduler, the streaming reverse proxy, RecordAssignment after creates,
//! the cluster list and node routes, and the HTTP server around them.
//!
//! Its rooms: [`serve`](Gateway::serve) and the connection loop in `serve`;
//! the routing decision both lanes share in `route`; the hyper lane's
//! dispatch and streaming proxy in `proxy`; node and cluster lists in
//! `lists`; the HTTP/1.1 fast lane in `fast`. This file holds the gateway
//! value and what every room uses: timed scheduler calls and the answers
//! to failed ones.

mod admission;
mod fast;
mod lists;
mod metrics_fanout;
mod moves;
mod proxy;
mod route;
mod serve;
mod timing;

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use agentenv_core::config::{ConsoleConfig, GatewayConfig};
use agentenv_core::metrics::grpc_status_label;
use agentenv_core::proto::scheduler_v1 as pb;
use bytes::Bytes;
use futures::future::BoxFuture;
use http::{Request, Response, StatusCode};
use http_body::Body;
use tokio::time::Instant;
use tonic::{Code, Status};

pub use self::admission::ClientLimits;
pub use self::proxy::extract_sandbox_ids;
use self::route::Router;
pub(crate) use self::route::decode_path;
pub use self::serve::ServeHandle;
use crate::body::{BoxError, GatewayBody, error_response};
use crate::client::SchedulerClient;
use crate::host_route::InvalidDomain;
use crate::metrics::{GatewayMetrics, RpcLabels};
use crate::pool::{PoolConfig, UpstreamPool};
use crate::route_cache::{self, RouteCache};

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
    /// Limits on client connections of [`Gateway::serve`].
    pub limits: ClientLimits,
    /// The web console at `/console`.
    pub console: ConsoleConfig,
    /// How long the gateway keeps a sandbox's route (which node holds it) instead of
    /// asking the scheduler for every request; zero asks every time. See
    /// [`crate::route_cache`].
    pub route_cache_ttl: Duration,
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
            limits: ClientLimits {
                header_timeout: cfg.client_header_timeout,
                max_connections: cfg.max_connections,
                max_connections_per_client: cfg.max_connections_per_client,
            },
            console: cfg.console.clone(),
            route_cache_ttl: cfg.route_cache_ttl,
        }
    }
}

/// The gateway as a value: mount [`Gateway::service`] in any hyper server,
/// or run [`Gateway::serve`] on a listener.
#[derive(Clone)]
pub struct Gateway {
    inner: Arc<Inner>,
    /// Connections to nodes, of both lanes.
    pool: UpstreamPool,
    /// Client connections of [`Gateway::serve`] speak TLS (see [`Gateway::with_tls`]).
    tls: Option<tokio_rustls::TlsAcceptor>,
}

struct Inner {
    /// Open client connections of [`Gateway::serve`].
    admission: Arc<self::admission::Admission>,
    scheduler: Arc<dyn SchedulerClient>,
    opts: GatewayOptions,
    router: Router,
    metrics: GatewayMetrics,
    console: Arc<crate::console::Console>,
    /// Routes of sandboxes, when kept ([`GatewayOptions::route_cache_ttl`]).
    routes: Option<RouteCache>,
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
        let router = Router::new(&opts)?;
        let pool = upstream_pool(opts.request_timeout);
        let console = Arc::new(crate::console::Console::new(&opts.console));
        Ok(Self {
            inner: Arc::new(Inner {
                admission: self::admission::Admission::new(opts.limits),
                scheduler: Arc::new(scheduler),
                routes: RouteCache::new(opts.route_cache_ttl, route_cache::DEFAULT_CAPACITY),
                opts,
                router,
                metrics,
                console,
            }),
            pool,
            tls: None,
        })
    }

    /// The same gateway with a connection pool of its own. A server that
    /// runs one single-threaded runtime per core gives each its own pool, so
    /// a request never waits on a connection driven by another thread.
    pub fn with_own_pool(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            pool: UpstreamPool::new(self.pool.config().clone()),
            tls: self.tls.clone(),
        }
    }

    /// The same gateway serving clients over TLS with `config` (HTTP/2 and
    /// HTTP/1.1 by ALPN). The certificate can be reloaded in place through the
    /// config's resolver (see [`agentenv_core::tls::ReloadingCert`]).
    pub fn with_tls(&self, config: Arc<rustls::ServerConfig>) -> Self {
        Self {
            inner: self.inner.clone(),
            pool: self.pool.clone(),
            tls: Some(tokio_rustls::TlsAcceptor::from(config)),
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
            tls: self.tls.clone(),
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
            tls: false,
        }
    }

    /// A hyper service for one TLS client connection from `remote` (terminated
    /// by the embedding server): nodes are told `X-Forwarded-Proto: https`.
    pub fn service_tls(&self, remote: SocketAddr) -> GatewayService {
        GatewayService {
            gateway: self.clone(),
            remote,
            tls: true,
        }
    }

    /// Runs a request the gateway makes itself (for the console) through
    /// [`Gateway::handle`], as if a client had sent it.
    pub(crate) fn internal(
        &self,
        req: Request<GatewayBody>,
        remote: SocketAddr,
    ) -> BoxFuture<'static, Response<GatewayBody>> {
        let gateway = self.clone();
        Box::pin(async move { gateway.handle(req, remote).await })
    }

    /// The key clients send in `X-API-Key`.
    pub(crate) fn api_key(&self) -> &str {
        &self.inner.opts.api_key
    }

    /// Whether `given` is the API key (in constant time).
    pub(crate) fn key_matches(&self, given: &[u8]) -> bool {
        self.inner.router.key_matches(given)
    }

    /// What the fast lane may use of this gateway.
    fn fast_lane(&self) -> fast::FastLane<'_> {
        let inner = &*self.inner;
        fast::FastLane {
            router: &inner.router,
            scheduler: &*inner.scheduler,
            routes: inner.routes.as_ref(),
            metrics: &inner.metrics,
            pool: &self.pool,
            request_timeout: inner.opts.request_timeout,
            header_timeout: inner.opts.limits.header_timeout,
            debug_mode: inner.opts.debug_mode,
        }
    }

    /// The node of sandbox `id`: a route kept from less than the cache's TTL ago, else
    /// the scheduler's answer (kept when it names a node).
    async fn lookup_route(&self, id: &str, deadline: Instant) -> Result<pb::Node, Status> {
        let routes = self.inner.routes.as_ref();
        if let Some(node) = routes.and_then(|r| r.get(id)) {
            self.inner.metrics.count_route_lookup(true);
            return Ok(node);
        }
        let node = self
            .rpc("LookupNode", deadline, self.inner.scheduler.lookup_node(id))
            .await;
        if let Some(r) = routes {
            self.inner.metrics.count_route_lookup(false);
            if let Ok(n) = &node {
                r.put(id, n);
            }
        }
        node
    }

    /// Keeps `node` as sandbox `id`'s route (it was just placed or recorded there).
    fn keep_route(&self, id: &str, node: &pb::Node) {
        if let Some(r) = &self.inner.routes {
            r.put(id, node);
        }
    }

    /// Drops sandbox `id`'s kept route.
    fn forget_route(&self, id: &str) {
        if let Some(r) = &self.inner.routes {
            r.forget(id);
        }
    }

    async fn rpc<T>(
        &self,
        name: &'static str,
        deadline: Instant,
        call: impl Future<Output = Result<T, Status>>,
    ) -> Result<T, Status> {
        timed_rpc(&self.inner.metrics, name, deadline, call).await
    }
}

/// A scheduler call bounded by `deadline`, recorded in the RPC histogram.
async fn timed_rpc<T>(
    metrics: &GatewayMetrics,
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
    observe_rpc(metrics, name, &result, start);
    result
}

/// Records the scheduler RPC `name` started at `start` and its outcome.
fn observe_rpc<T>(
    metrics: &GatewayMetrics,
    name: &'static str,
    result: &Result<T, Status>,
    start: Instant,
) {
    let code = result.as_ref().map_or_else(|s| s.code(), |_| Code::Ok);
    metrics.observe_rpc(
        RpcLabels {
            rpc: name,
            status: grpc_status_label(code),
        },
        start.elapsed().as_secs_f64(),
    );
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

/// A [`Gateway`] bound to one client connection, as a hyper service.
#[derive(Clone)]
pub struct GatewayService {
    gateway: Gateway,
    remote: SocketAddr,
    tls: bool,
}

/// A request extension: the client's connection is TLS. [`Gateway::handle`]
/// then tells nodes `X-Forwarded-Proto: https`; an embedding server that
/// terminates TLS itself inserts it (or uses [`Gateway::service_tls`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClientTls;

impl<B> hyper::service::Service<Request<B>> for GatewayService
where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    type Response = Response<GatewayBody>;
    type Error = Infallible;
    type Future = BoxFuture<'static, Result<Response<GatewayBody>, Infallible>>;

    fn call(&self, mut req: Request<B>) -> Self::Future {
        let gateway = self.gateway.clone();
        let remote = self.remote;
        if self.tls {
            req.extensions_mut().insert(ClientTls);
        }
        Box::pin(async move { Ok(gateway.handle(req, remote).await) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
