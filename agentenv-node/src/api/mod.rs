//! The node's HTTP surface: the E2B-compatible REST control plane and, on the same
//! listener, the data plane (see [`crate::dataplane`]).
//!
//! The rooms: `route` (which request is which operation), `sandboxes`, `network`
//! (egress rules), `metrics`, `logs`, `volumes`, `volume_content` (a volume's files,
//! with its token), `snapshots`, `templates` (builds and
//! uploads), `template_catalog` (templates, names, tags) and `nodes` (the handlers), `proxy` (data-plane requests), `error` (errors as
//! responses), `body` (JSON in and out, query strings), `model` (the JSON shapes).

mod body;
mod error;
mod idempotency;
mod logs;
mod metrics;
mod model;
mod network;
mod nodes;
mod proxy;
mod route;
mod sandboxes;
mod snapshots;
mod template_catalog;
mod templates;
mod volume_content;
mod volumes;

pub use body::query_pairs;
pub use model::*;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http::header::{self, HeaderValue};
use http::{Request, Response, StatusCode};
use hyper::body::Incoming;
use parking_lot::Mutex;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use tokio::time::Instant;

use self::route::{Route, match_route};
use crate::access::api_key_ok;
use crate::dataplane::{self, Body, Classified, full, json_error, status_only};
use crate::lifecycle::Orchestrator;

/// How long a client may take to send a request head (also the keep-alive idle
/// timeout) or finish a TLS handshake.
const HEADER_TIMEOUT: Duration = agentenv_core::serving::DEFAULT_HEADER_TIMEOUT;

/// Who this node is, for `GET /nodes` and the `domain` of sandboxes.
#[derive(Debug, Clone)]
pub struct NodeIdentity {
    pub node_id: String,
    pub cluster_id: String,
    pub service_instance_id: String,
    pub version: String,
    pub commit: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct HttpLabels {
    /// From a fixed set ([`agentenv_core::metrics::method_label`]).
    method: &'static str,
    route: String,
    route_source: String,
    status: &'static str,
}

/// Everything the request handlers share.
pub struct ApiState {
    pub orch: Arc<Orchestrator>,
    pub api_key: String,
    pub identity: NodeIdentity,
    pub domains: Vec<String>,
    /// Timeouts of data-plane relays.
    pub relay_timeouts: dataplane::RelayTimeouts,
    /// Kept connections of data-plane relays to sandboxes.
    pub sandbox_pool: dataplane::SandboxPool,
    registry: Mutex<Registry>,
    http: Family<HttpLabels, Histogram>,
    /// The host's CPU, memory and disks (the sampler heartbeats use too).
    host: Arc<crate::observe::HostSampler>,
    machine: serde_json::Value,
    /// The listener serves TLS (links the node hands out say `https`).
    pub tls: std::sync::atomic::AtomicBool,
    /// `Idempotency-Key`s of creates.
    idempotency: idempotency::Idempotency,
}

impl ApiState {
    pub fn new(
        orch: Arc<Orchestrator>,
        api_key: String,
        identity: NodeIdentity,
        domains: Vec<String>,
        relay_timeouts: dataplane::RelayTimeouts,
        host: Arc<crate::observe::HostSampler>,
    ) -> Arc<Self> {
        let http = Family::<HttpLabels, Histogram>::new_with_constructor(
            agentenv_core::metrics::latency_histogram as fn() -> Histogram,
        );
        let mut registry = Registry::default();
        registry.register(
            "agentenv_http_request_duration_seconds",
            "HTTP request duration",
            http.clone(),
        );
        orch.metrics().register(&mut registry);
        Arc::new(Self {
            orch,
            api_key,
            identity,
            domains,
            relay_timeouts,
            sandbox_pool: dataplane::SandboxPool::default(),
            registry: Mutex::new(registry),
            http,
            host,
            machine: nodes::machine_info(),
            tls: std::sync::atomic::AtomicBool::new(false),
            idempotency: idempotency::Idempotency::default(),
        })
    }

    /// The Prometheus text of the node's metrics.
    pub fn render_metrics(&self) -> String {
        self.orch.metrics().set_cleanups(&self.orch.cleanups());
        self.orch.metrics().set_pools(&self.orch.pool_usage());
        #[cfg(target_env = "gnu")]
        self.orch.metrics().set_heap_in_use();
        agentenv_core::metrics::render(&self.registry.lock())
    }
}

/// Handles one request (never fails: errors become responses).
pub async fn handle(
    state: Arc<ApiState>,
    req: Request<Incoming>,
) -> Result<Response<Body>, Infallible> {
    let started = Instant::now();
    let method = req.method().clone();
    let route = match_route(&method, req.uri().path());
    let classified = dataplane::classify(&req, &state.domains, route.is_some());
    let key_ok = api_key_ok(req.headers(), &state.api_key);
    let (resp, route_label, source) = match classified {
        Classified::Proxy(target) => {
            let source = target.source.label();
            (
                proxy::proxy(&state, req, target).await,
                "/proxy/*".to_string(),
                source,
            )
        }
        Classified::BadHost(msg) => {
            let r = if key_ok {
                json_error(StatusCode::BAD_REQUEST, msg)
            } else {
                status_only(StatusCode::UNAUTHORIZED)
            };
            (r, "/proxy/*".into(), "proxy_host")
        }
        Classified::BadHeaders(msg) => (
            json_error(StatusCode::BAD_REQUEST, msg),
            "/proxy/*".into(),
            "proxy_prefix",
        ),
        Classified::ControlPlane => match route {
            Some(Route::Health) => (
                status_only(StatusCode::NO_CONTENT),
                "/health".into(),
                "control_plane",
            ),
            Some(Route::Metrics) => {
                let mut r = Response::new(full(state.render_metrics()));
                r.headers_mut().insert(
                    header::CONTENT_TYPE,
                    HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
                );
                return Ok(r);
            }
            Some(route) => {
                let label = route.label().to_string();
                // An upload link carries its own signature (the SDKs send no key); the
                // volume content API takes the volume's token instead of the key.
                let signed = matches!(route, Route::TemplateUpload(..) | Route::VolumeContent(..));
                let r = if key_ok || signed {
                    control(&state, route, req).await
                } else {
                    status_only(StatusCode::UNAUTHORIZED)
                };
                (r, label, "control_plane")
            }
            None => {
                let r = if key_ok {
                    json_error(
                        StatusCode::NOT_FOUND,
                        format!("route not found: {} {}", method, req.uri().path()),
                    )
                } else {
                    status_only(StatusCode::UNAUTHORIZED)
                };
                (r, "unmatched".into(), "control_plane")
            }
        },
    };
    let status = agentenv_core::metrics::status_label(resp.status().as_u16());
    state
        .http
        .get_or_create(&HttpLabels {
            method: agentenv_core::metrics::method_label(&method),
            route: route_label,
            route_source: source.to_string(),
            status,
        })
        .observe(started.elapsed().as_secs_f64());
    Ok(resp)
}

/// Runs the handler of a control-plane route (the API key is checked).
async fn control(state: &ApiState, route: Route, req: Request<Incoming>) -> Response<Body> {
    let reply = match route {
        Route::Health | Route::Metrics => Ok(status_only(StatusCode::NO_CONTENT)),
        Route::Create => sandboxes::create(state, req).await,
        Route::ListV1 => sandboxes::list_v1(state, &req),
        Route::ListV2 => sandboxes::list_v2(state, &req),
        Route::Get(id) => sandboxes::get(state, &id),
        Route::Delete(id) => sandboxes::delete(state, &id).await,
        Route::Pause(id) => sandboxes::pause(state, &id, req).await,
        Route::Resume(id) => sandboxes::resume(state, &id, req).await,
        Route::Connect(id) => sandboxes::connect(state, &id, req).await,
        Route::Timeout(id) => sandboxes::set_timeout(state, &id, req).await,
        Route::Refresh(id) => sandboxes::refresh(state, &id, req).await,
        Route::Fork(id) => sandboxes::fork(state, &id, req).await,
        Route::Network(id) => network::update(state, &id, req).await,
        Route::Export(id, true) => sandboxes::export(state, &id).await,
        Route::Export(id, false) => sandboxes::cancel_move(state, &id).await,
        Route::Import(id) => sandboxes::import(state, &id, req).await,
        Route::SandboxMetrics(id) => metrics::sandbox(state, &id, &req).await,
        Route::MetricsMany => metrics::many(state, &req).await,
        Route::Logs(id, v2) => logs::get(state, &id, &req, v2).await,
        Route::VolumeCreate => volumes::create(state, req).await,
        Route::VolumeList => volumes::list(state).await,
        Route::VolumeGet(id) => volumes::get(state, &id).await,
        Route::VolumeDelete(id) => volumes::delete(state, &id).await,
        Route::VolumeContent(id, op) => volume_content::handle(state, &id, op, req).await,
        Route::Snapshot(id) => snapshots::take(state, &id, req).await,
        Route::Snapshots => snapshots::list(state, &req).await,
        Route::SnapshotGet(id) => snapshots::get(state, id).await,
        Route::TemplateAlias(alias) => template_catalog::alias(state, &alias).await,
        Route::TemplateDelete(id) => template_catalog::delete(state, &id).await,
        Route::TemplateCreate => templates::create(state, req).await,
        Route::TemplateList | Route::TemplateListV2 => template_catalog::list(state, false).await,
        Route::DefaultTemplates => template_catalog::list(state, true).await,
        Route::TemplateGet(id) => template_catalog::get(state, &id).await,
        Route::TemplatePatch(id, v2) => template_catalog::patch(state, &id, req, v2).await,
        Route::TemplateFile(id, hash) => templates::file_link(state, &id, &hash, &req).await,
        Route::TemplateUpload(id, hash) => templates::upload(state, &id, &hash, req).await,
        Route::BuildStart(id, b) => templates::start_build(state, &id, &b, req).await,
        Route::BuildStatus(id, b) => templates::build_status(state, &id, &b, &req).await,
        Route::BuildLogs(id, b) => templates::build_logs(state, &id, &b, &req).await,
        Route::TagsAssign => template_catalog::assign_tags(state, req).await,
        Route::TagsRemove => template_catalog::remove_tags(state, req).await,
        Route::Tags(id) => template_catalog::tags(state, &id).await,
        Route::Nodes => nodes::list(state, &req),
        Route::Node(id) => nodes::get(state, &id),
    };
    reply.unwrap_or_else(|reject| reject.into_response())
}

/// Serves the API on `listener` until `shutdown` resolves, then stops accepting and
/// lets open connections finish (for at most `drain`). A connection without a request
/// in flight for the header timeout is closed (HTTP/1.1 and HTTP/2).
pub async fn serve(
    state: Arc<ApiState>,
    listener: tokio::net::TcpListener,
    tls: Option<tokio_rustls::TlsAcceptor>,
    shutdown: impl std::future::Future<Output = ()>,
    drain: Duration,
) {
    use hyper_util::rt::TokioIo;
    // Every connection task holds a receiver; once they are all gone, drained.
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    tokio::pin!(shutdown);
    loop {
        let (stream, _peer): (tokio::net::TcpStream, SocketAddr) = tokio::select! {
            r = listener.accept() => match r {
                Ok(x) => x,
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = &mut shutdown => break,
        };
        let _ = stream.set_nodelay(true);
        let st = state.clone();
        let svc = hyper::service::service_fn(move |req| handle(st.clone(), req));
        let tls = tls.clone();
        let mut stop = stop_rx.clone();
        tokio::spawn(async move {
            let builder = agentenv_core::serving::server_builder(HEADER_TIMEOUT);
            let stopping = async move {
                let _ = stop.wait_for(|s| *s).await;
            };
            let served = match tls {
                None => {
                    agentenv_core::serving::serve_connection(
                        &builder,
                        TokioIo::new(stream),
                        svc,
                        HEADER_TIMEOUT,
                        stopping,
                    )
                    .await
                }
                Some(acceptor) => {
                    // The handshake runs on the connection's own task, bounded like a head.
                    let tls =
                        match tokio::time::timeout(HEADER_TIMEOUT, acceptor.accept(stream)).await {
                            Ok(Ok(tls)) => tls,
                            Ok(Err(e)) => {
                                tracing::debug!(error = %e, "TLS handshake failed");
                                return;
                            }
                            Err(_) => return,
                        };
                    agentenv_core::serving::serve_connection(
                        &builder,
                        TokioIo::new(tls),
                        svc,
                        HEADER_TIMEOUT,
                        stopping,
                    )
                    .await
                }
            };
            if let Err(e) = served {
                tracing::debug!(error = %e, "connection ended");
            }
        });
    }
    drop(listener);
    drop(stop_rx);
    let _ = stop_tx.send(true);
    if tokio::time::timeout(drain, stop_tx.closed()).await.is_err() {
        tracing::warn!("open connections did not finish within {drain:?}");
    }
}
