//! The node's HTTP surface: the E2B-compatible REST control plane and, on the same
//! listener, the data plane (see [`crate::dataplane`]).

mod model;

pub use model::*;

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::{Method, Request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use parking_lot::Mutex;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use tokio::time::Instant;

use crate::access::api_key_ok;
use crate::backend::BackendError;
use crate::dataplane::{
    self, Access, Body, Classified, Relay, check_access, full, is_uuid, json_error, status_only,
};
use crate::lifecycle::{
    Connected, LifecycleError, OnTimeout, Orchestrator, RouteError, SandboxRecord, State,
};
use crate::snapshot::{SnapshotError, SnapshotRecord};

/// Largest JSON request body of the control plane.
const MAX_JSON_BODY: usize = 1 << 20;

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
    method: String,
    route: String,
    route_source: String,
    status: String,
}

/// Everything the request handlers share.
pub struct ApiState {
    pub orch: Arc<Orchestrator>,
    pub api_key: String,
    pub identity: NodeIdentity,
    pub domains: Vec<String>,
    /// Timeouts of data-plane relays.
    pub relay_timeouts: dataplane::RelayTimeouts,
    registry: Mutex<Registry>,
    http: Family<HttpLabels, Histogram>,
    host: Mutex<Option<sysinfo::System>>,
    machine: serde_json::Value,
}

/// `machineInfo` of `GET /nodes`, from the first processor of `/proc/cpuinfo`.
fn machine_info() -> serde_json::Value {
    let text = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let field = |name: &str| {
        text.lines()
            .filter_map(|l| l.split_once(':'))
            .find(|(k, _)| k.trim() == name)
            .map(|(_, v)| v.trim().to_string())
            .unwrap_or_default()
    };
    serde_json::json!({
        "cpuFamily": field("cpu family"),
        "cpuModel": field("model"),
        "cpuModelName": field("model name"),
        "cpuArchitecture": std::env::consts::ARCH,
    })
}

impl ApiState {
    pub fn new(
        orch: Arc<Orchestrator>,
        api_key: String,
        identity: NodeIdentity,
        domains: Vec<String>,
        relay_timeouts: dataplane::RelayTimeouts,
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
            registry: Mutex::new(registry),
            http,
            host: Mutex::new(sysinfo::System::new().ok()),
            machine: machine_info(),
        })
    }

    /// The Prometheus text of the node's metrics.
    pub fn render_metrics(&self) -> String {
        agentenv_core::metrics::render(&self.registry.lock())
    }
}

/// Control-plane routes.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Route {
    Health,
    Metrics,
    Create,
    ListV1,
    ListV2,
    Get(String),
    Delete(String),
    Pause(String),
    Resume(String),
    Connect(String),
    Timeout(String),
    Refresh(String),
    Nodes,
    Node(String),
    Snapshot(String),
    Snapshots,
    SnapshotGet(String),
    TemplateDelete(String),
    TemplateAlias(String),
}

impl Route {
    fn label(&self) -> &'static str {
        match self {
            Route::Health => "/health",
            Route::Metrics => "/metrics",
            Route::Create => "/sandboxes",
            Route::ListV1 => "/sandboxes",
            Route::ListV2 => "/v2/sandboxes",
            Route::Get(_) | Route::Delete(_) => "/sandboxes/{sandbox_id}",
            Route::Pause(_) => "/sandboxes/{sandbox_id}/pause",
            Route::Resume(_) => "/sandboxes/{sandbox_id}/resume",
            Route::Connect(_) => "/sandboxes/{sandbox_id}/connect",
            Route::Timeout(_) => "/sandboxes/{sandbox_id}/timeout",
            Route::Refresh(_) => "/sandboxes/{sandbox_id}/refreshes",
            Route::Nodes => "/nodes",
            Route::Node(_) => "/nodes/{node_id}",
            Route::Snapshot(_) => "/sandboxes/{sandbox_id}/snapshots",
            Route::Snapshots => "/snapshots",
            Route::SnapshotGet(_) => "/snapshots/{snapshot_id}",
            Route::TemplateDelete(_) => "/templates/{template_id}",
            Route::TemplateAlias(_) => "/templates/aliases/{alias}",
        }
    }
}

fn match_route(method: &Method, path: &str) -> Option<Route> {
    let segs: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    let m = method.clone();
    Some(match (m, segs.as_slice()) {
        (Method::GET, ["health"]) => Route::Health,
        (Method::GET, ["metrics"]) => Route::Metrics,
        (Method::POST, ["sandboxes"]) | (Method::POST, ["v2", "sandboxes"]) => Route::Create,
        (Method::GET, ["sandboxes"]) => Route::ListV1,
        (Method::GET, ["v2", "sandboxes"]) => Route::ListV2,
        (Method::GET, ["sandboxes", id]) if !id.is_empty() => Route::Get(id.to_ascii_lowercase()),
        (Method::DELETE, ["sandboxes", id]) if !id.is_empty() => {
            Route::Delete(id.to_ascii_lowercase())
        }
        (Method::POST, ["sandboxes", id, "pause"]) => Route::Pause(id.to_ascii_lowercase()),
        (Method::POST, ["sandboxes", id, "resume"]) => Route::Resume(id.to_ascii_lowercase()),
        (Method::POST, ["sandboxes", id, "connect"])
        | (Method::POST, ["v2", "sandboxes", id, "connect"]) => {
            Route::Connect(id.to_ascii_lowercase())
        }
        (Method::POST, ["sandboxes", id, "timeout"]) => Route::Timeout(id.to_ascii_lowercase()),
        (Method::POST, ["sandboxes", id, "refreshes"]) => Route::Refresh(id.to_ascii_lowercase()),
        (Method::POST, ["sandboxes", id, "snapshots"]) => Route::Snapshot(id.to_ascii_lowercase()),
        (Method::GET, ["snapshots"]) => Route::Snapshots,
        (Method::GET, ["snapshots", id]) if !id.is_empty() => Route::SnapshotGet(id.to_string()),
        (Method::GET, ["templates", "aliases", alias]) if !alias.is_empty() => {
            Route::TemplateAlias(alias.to_string())
        }
        (Method::DELETE, ["templates", id]) if !id.is_empty() => {
            Route::TemplateDelete(id.to_string())
        }
        (Method::GET, ["nodes"]) => Route::Nodes,
        (Method::GET, ["nodes", id]) if !id.is_empty() => Route::Node(id.to_string()),
        _ => return None,
    })
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
                proxy(&state, req, target).await,
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
                let r = if key_ok {
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
    let status = format!("{}xx", resp.status().as_u16() / 100);
    state
        .http
        .get_or_create(&HttpLabels {
            method: method.to_string(),
            route: route_label,
            route_source: source.to_string(),
            status,
        })
        .observe(started.elapsed().as_secs_f64());
    Ok(resp)
}

fn gone(id: &str) -> Response<Body> {
    json_error(
        StatusCode::BAD_GATEWAY,
        format!("The sandbox {id} was not found"),
    )
}

async fn proxy(
    state: &Arc<ApiState>,
    req: Request<Incoming>,
    target: dataplane::Target,
) -> Response<Body> {
    let rec = match state.orch.route(&target.sandbox_id).await {
        Ok(r) => r,
        Err(RouteError::NotFound) => return gone(&target.sandbox_id),
        Err(RouteError::NotProxyable) => {
            return json_error(
                StatusCode::GONE,
                format!(
                    "sandbox {} is paused and auto-resume is off: connect to it (POST /sandboxes/{}/connect) first",
                    target.sandbox_id, target.sandbox_id
                ),
            );
        }
        Err(RouteError::ResumeTimedOut) => {
            return json_error(StatusCode::GATEWAY_TIMEOUT, "sandbox auto-resume timed out");
        }
        Err(e @ RouteError::ResumeFailed(_)) => {
            return json_error(StatusCode::BAD_GATEWAY, e.to_string());
        }
    };
    let keep_access_token =
        match check_access(&rec, target.port, req.headers(), state.orch.tokens()) {
            Access::Allowed { keep_access_token } => keep_access_token,
            Access::Denied => return status_only(StatusCode::UNAUTHORIZED),
        };
    let Some(addr) = rec.address else {
        return json_error(
            StatusCode::BAD_GATEWAY,
            "sandbox route is temporarily unavailable",
        );
    };
    let relay = Relay {
        upstream: addr.port(target.port),
        timeouts: state.relay_timeouts,
        target: &target,
        keep_access_token,
        api_key: &state.api_key,
    };
    match dataplane::relay(req, relay).await {
        Ok(r) => r,
        Err(dataplane::ProxyError::Connect { .. }) => {
            // A sandbox deleted while the request was in flight is gone, not closed.
            if state.orch.get(&target.sandbox_id).is_err() {
                return gone(&target.sandbox_id);
            }
            json_error(
                StatusCode::BAD_GATEWAY,
                format!(
                    "The sandbox {} is running but port {} is not open",
                    target.sandbox_id, target.port
                ),
            )
        }
        Err(e @ dataplane::ProxyError::HeaderTimeout(_)) => {
            json_error(StatusCode::GATEWAY_TIMEOUT, e.to_string())
        }
        Err(e) => json_error(StatusCode::BAD_GATEWAY, e.to_string()),
    }
}

/// Reads a small JSON body; empty means `{}`.
async fn read_json<T: serde::de::DeserializeOwned>(
    req: Request<Incoming>,
) -> Result<T, Box<Response<Body>>> {
    let limited = http_body_util::Limited::new(req.into_body(), MAX_JSON_BODY);
    let bytes = match limited.collect().await {
        Ok(b) => b.to_bytes(),
        Err(e) => {
            return Err(Box::new(json_error(
                StatusCode::BAD_REQUEST,
                format!("reading the request body (at most {MAX_JSON_BODY} bytes): {e}"),
            )));
        }
    };
    let bytes = if bytes.iter().all(u8::is_ascii_whitespace) {
        Bytes::from_static(b"{}")
    } else {
        bytes
    };
    let de = &mut serde_json::Deserializer::from_slice(&bytes);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        let msg = if path == "." || path.is_empty() {
            format!("invalid JSON body: {inner}")
        } else {
            format!("invalid JSON body at {path}: {inner}")
        };
        Box::new(json_error(StatusCode::BAD_REQUEST, msg))
    })
}

fn lifecycle_error(e: LifecycleError) -> Response<Body> {
    let status = match &e {
        LifecycleError::NotFound(_) => StatusCode::NOT_FOUND,
        LifecycleError::InvalidState { .. } => StatusCode::CONFLICT,
        LifecycleError::ShuttingDown => StatusCode::SERVICE_UNAVAILABLE,
        LifecycleError::BadRequest(_) => StatusCode::BAD_REQUEST,
        LifecycleError::Backend(b) => match b {
            BackendError::UnknownTemplate(n) => {
                return json_error(StatusCode::BAD_REQUEST, format!("template {n} not found"));
            }
            BackendError::InvalidLimits(_) | BackendError::InvalidId(_) => StatusCode::BAD_REQUEST,
            BackendError::NotFound(_) => StatusCode::NOT_FOUND,
            BackendError::AddressPoolExhausted { .. } | BackendError::IdPoolExhausted { .. } => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        },
        LifecycleError::Agent { .. } | LifecycleError::Persist(_) | LifecycleError::Internal(_) => {
            StatusCode::INTERNAL_SERVER_ERROR
        }
        LifecycleError::Snapshot(s) => snapshot_status(s),
        LifecycleError::NoSnapshotRepository => StatusCode::SERVICE_UNAVAILABLE,
    };
    json_error(status, e.to_string())
}

fn snapshot_status(e: &SnapshotError) -> StatusCode {
    match e {
        SnapshotError::InvalidName(_)
        | SnapshotError::ReservedName(_)
        | SnapshotError::AliasConflict { .. }
        | SnapshotError::WrongBackend { .. } => StatusCode::BAD_REQUEST,
        SnapshotError::NotFound(_) => StatusCode::NOT_FOUND,
        SnapshotError::Corrupt { .. }
        | SnapshotError::Forged { .. }
        | SnapshotError::Storage(_)
        | SnapshotError::Io { .. } => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

fn snapshot_json(r: &SnapshotRecord) -> SnapshotInfoJson {
    SnapshotInfoJson {
        snapshot_id: r.id.clone(),
        names: r.alias.iter().cloned().collect(),
        cpu_count: r.resources.cpu_count,
        memory_mb: r.resources.memory_mb,
        disk_size_mb: r.resources.disk_size_mb,
        created_at: crate::lifecycle::ms_rfc3339(r.created_at_ms),
        updated_at: crate::lifecycle::ms_rfc3339(r.updated_at_ms),
    }
}

fn json_response<T: serde::Serialize>(status: StatusCode, v: &T) -> Response<Body> {
    let mut r = Response::new(full(serde_json::to_vec(v).unwrap_or_default()));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}

fn check_id(id: &str) -> Result<(), Box<Response<Body>>> {
    if is_uuid(id) {
        Ok(())
    } else {
        Err(Box::new(json_error(
            StatusCode::BAD_REQUEST,
            format!("invalid sandbox id {id:?}: sandbox ids are UUIDs"),
        )))
    }
}

macro_rules! tri {
    ($e:expr) => {
        match $e {
            Ok(v) => v,
            Err(r) => return *r,
        }
    };
}

async fn control(state: &Arc<ApiState>, route: Route, req: Request<Incoming>) -> Response<Body> {
    let orch = &state.orch;
    match route {
        Route::Health | Route::Metrics => status_only(StatusCode::NO_CONTENT),
        Route::Create => {
            let body: NewSandbox = tri!(read_json(req).await);
            let creq = tri!(body.into_request());
            match orch.create(creq).await {
                Ok(rec) => {
                    let mut r = json_response(StatusCode::CREATED, &sandbox_json(state, &rec));
                    if let Ok(v) = HeaderValue::from_str(&rec.id) {
                        r.headers_mut().insert("x-agentenv-sandbox-id", v);
                    }
                    r
                }
                Err(e) => lifecycle_error(e),
            }
        }
        Route::ListV1 => {
            let items: Vec<_> = sorted(orch.list())
                .into_iter()
                .filter(|r| r.state.api_name() == "running")
                .map(|r| listed_json(&r))
                .collect();
            json_response(StatusCode::OK, &items)
        }
        Route::ListV2 => {
            let q = ListQuery::parse(req.uri().query().unwrap_or(""));
            let q = tri!(q.map_err(|m| Box::new(json_error(StatusCode::BAD_REQUEST, m))));
            let (items, next) = q.apply(sorted(orch.list()));
            let mut r = json_response(
                StatusCode::OK,
                &items.iter().map(listed_json).collect::<Vec<_>>(),
            );
            if let Some(t) = next
                && let Ok(v) = HeaderValue::from_str(&t)
            {
                r.headers_mut().insert("x-next-token", v);
            }
            r
        }
        Route::Get(id) => {
            tri!(check_id(&id));
            match orch.get(&id) {
                Ok(rec) if rec.state != State::Killing => {
                    json_response(StatusCode::OK, &detail_json(state, &rec))
                }
                Ok(_) => lifecycle_error(LifecycleError::NotFound(id)),
                Err(e) => lifecycle_error(e),
            }
        }
        Route::Delete(id) => {
            tri!(check_id(&id));
            match orch.delete(&id).await {
                Ok(()) => status_only(StatusCode::NO_CONTENT),
                Err(e) => lifecycle_error(e),
            }
        }
        Route::Pause(id) => {
            tri!(check_id(&id));
            let _: serde_json::Value = tri!(read_json(req).await);
            match orch.pause(&id).await {
                Ok(()) => status_only(StatusCode::NO_CONTENT),
                Err(e) => lifecycle_error(e),
            }
        }
        Route::Resume(id) => {
            tri!(check_id(&id));
            let body: TimeoutBody = tri!(read_json(req).await);
            match orch
                .resume(&id, body.timeout.map(Duration::from_secs))
                .await
            {
                Ok(rec) => json_response(StatusCode::CREATED, &sandbox_json(state, &rec)),
                Err(e) => lifecycle_error(e),
            }
        }
        Route::Connect(id) => {
            tri!(check_id(&id));
            let body: TimeoutBody = tri!(read_json(req).await);
            match orch
                .connect(&id, body.timeout.map(Duration::from_secs))
                .await
            {
                Ok((rec, how)) => {
                    let status = match how {
                        Connected::WasRunning => StatusCode::OK,
                        Connected::Resumed => StatusCode::CREATED,
                    };
                    json_response(status, &sandbox_json(state, &rec))
                }
                Err(e) => lifecycle_error(e),
            }
        }
        Route::Timeout(id) => {
            tri!(check_id(&id));
            let body: TimeoutBody = tri!(read_json(req).await);
            let t = body
                .timeout
                .map(Duration::from_secs)
                .unwrap_or(orch.config().default_timeout);
            match orch.set_timeout(&id, t).await {
                Ok(()) => status_only(StatusCode::NO_CONTENT),
                Err(e) => lifecycle_error(e),
            }
        }
        Route::Refresh(id) => {
            tri!(check_id(&id));
            let body: RefreshBody = tri!(read_json(req).await);
            let d = body
                .duration
                .unwrap_or(orch.config().default_timeout.as_secs());
            if d > 3600 {
                return json_error(
                    StatusCode::BAD_REQUEST,
                    "duration must be at most 3600 seconds",
                );
            }
            match orch.refresh(&id, Duration::from_secs(d)).await {
                Ok(()) => status_only(StatusCode::NO_CONTENT),
                Err(e) => lifecycle_error(e),
            }
        }
        Route::Snapshot(id) => {
            tri!(check_id(&id));
            let body: SnapshotBody = tri!(read_json(req).await);
            match orch.snapshot(&id, body.name).await {
                Ok(rec) => json_response(StatusCode::CREATED, &snapshot_json(&rec)),
                // A snapshot needs a running sandbox: anything else is a bad request.
                Err(e @ LifecycleError::InvalidState { .. }) => {
                    json_error(StatusCode::BAD_REQUEST, e.to_string())
                }
                Err(e) => lifecycle_error(e),
            }
        }
        Route::Snapshots => {
            let q = SnapshotQuery::parse(req.uri().query().unwrap_or(""));
            let q = tri!(q.map_err(|m| Box::new(json_error(StatusCode::BAD_REQUEST, m))));
            let repo = match orch.snapshot_repository() {
                Ok(r) => r.clone(),
                Err(e) => return lifecycle_error(e),
            };
            match repo.list().await {
                Ok(all) => {
                    let (items, next) = q.apply(all);
                    let mut r = json_response(
                        StatusCode::OK,
                        &items.iter().map(snapshot_json).collect::<Vec<_>>(),
                    );
                    if let Some(t) = next
                        && let Ok(v) = HeaderValue::from_str(&t)
                    {
                        r.headers_mut().insert("x-next-token", v);
                    }
                    r
                }
                Err(e) => lifecycle_error(e.into()),
            }
        }
        Route::SnapshotGet(id) => {
            let repo = match orch.snapshot_repository() {
                Ok(r) => r.clone(),
                Err(e) => return lifecycle_error(e),
            };
            match repo.resolve(&id).await {
                Ok(Some(rec)) => json_response(StatusCode::OK, &snapshot_json(&rec)),
                Ok(None) => lifecycle_error(SnapshotError::NotFound(id).into()),
                Err(e) => lifecycle_error(e.into()),
            }
        }
        Route::TemplateAlias(alias) => {
            if let Err(e) = crate::snapshot::validate_name(&alias) {
                return lifecycle_error(e.into());
            }
            let repo = match orch.snapshot_repository() {
                Ok(r) => r.clone(),
                Err(e) => return lifecycle_error(e),
            };
            match repo.resolve(&alias).await {
                Ok(Some(rec)) => json_response(
                    StatusCode::OK,
                    &serde_json::json!({"templateID": rec.id, "public": false}),
                ),
                Ok(None) => json_error(
                    StatusCode::NOT_FOUND,
                    format!("no snapshot or template named {alias}"),
                ),
                Err(e) => lifecycle_error(e.into()),
            }
        }
        Route::TemplateDelete(id) => {
            let repo = match orch.snapshot_repository() {
                Ok(r) => r.clone(),
                Err(e) => return lifecycle_error(e),
            };
            match repo.delete(&id).await {
                Ok(_) => status_only(StatusCode::NO_CONTENT),
                Err(e) => lifecycle_error(e.into()),
            }
        }
        Route::Nodes => {
            let q = query_pairs(req.uri().query().unwrap_or(""));
            if let Some(c) = q.get("clusterID")
                && c != &state.identity.cluster_id
            {
                return json_response(StatusCode::OK, &Vec::<serde_json::Value>::new());
            }
            json_response(StatusCode::OK, &vec![node_json(state, false)])
        }
        Route::Node(id) => {
            if id != state.identity.node_id {
                return json_error(StatusCode::NOT_FOUND, format!("node {id} not found"));
            }
            json_response(StatusCode::OK, &node_json(state, true))
        }
    }
}

fn sorted(mut v: Vec<SandboxRecord>) -> Vec<SandboxRecord> {
    v.retain(|r| r.state != State::Killing);
    v.sort_by(|a, b| b.created_at_ms.cmp(&a.created_at_ms).then(a.id.cmp(&b.id)));
    v
}

/// Parses `a=b&c=d` (percent-decoded).
pub fn query_pairs(q: &str) -> BTreeMap<String, String> {
    q.split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (decode(k), decode(v))
        })
        .collect()
}

fn decode(s: &str) -> String {
    let s = s.replace('+', " ");
    percent_encoding::percent_decode_str(&s)
        .decode_utf8_lossy()
        .into_owned()
}

fn sandbox_json(state: &ApiState, rec: &SandboxRecord) -> SandboxJson {
    SandboxJson {
        template_id: template_id(rec),
        sandbox_id: rec.id.clone(),
        alias: template_alias(rec),
        client_id: String::new(),
        envd_version: agentenv_guest::ENVD_VERSION.to_string(),
        envd_access_token: rec.secure.then(|| state.orch.tokens().envd_token(&rec.id)),
        traffic_access_token: (!rec.allow_public_traffic)
            .then(|| state.orch.tokens().traffic_token(&rec.id)),
        domain: state.domains.first().cloned(),
    }
}

/// `templateID` of a sandbox: the snapshot it started from, else its template.
fn template_id(rec: &SandboxRecord) -> String {
    rec.snapshot_id
        .clone()
        .unwrap_or_else(|| rec.template.clone())
}

/// `alias` of a sandbox: the snapshot's name, else the template's.
fn template_alias(rec: &SandboxRecord) -> Option<String> {
    match &rec.snapshot_id {
        Some(_) => rec.snapshot_name.clone(),
        None => Some(rec.template.clone()),
    }
}

fn end_at(rec: &SandboxRecord) -> String {
    crate::lifecycle::ms_rfc3339(rec.expires_at_ms.unwrap_or(36_500 * 86_400 * 1000))
}

fn listed_json(rec: &SandboxRecord) -> ListedSandboxJson {
    ListedSandboxJson {
        template_id: template_id(rec),
        alias: template_alias(rec),
        sandbox_id: rec.id.clone(),
        client_id: String::new(),
        started_at: crate::lifecycle::ms_rfc3339(rec.created_at_ms),
        end_at: end_at(rec),
        cpu_count: rec.cpu_count,
        memory_mb: rec.memory_mb,
        disk_size_mb: 0,
        metadata: rec.metadata.clone(),
        state: rec.state.api_name().to_string(),
        envd_version: agentenv_guest::ENVD_VERSION.to_string(),
    }
}

fn detail_json(state: &ApiState, rec: &SandboxRecord) -> SandboxDetailJson {
    SandboxDetailJson {
        listed: listed_json(rec),
        envd_access_token: rec.secure.then(|| state.orch.tokens().envd_token(&rec.id)),
        domain: state.domains.first().cloned(),
        allow_internet_access: rec.allow_internet_access,
        network: (!rec.allow_public_traffic)
            .then(|| serde_json::json!({"allowPublicTraffic": false})),
        lifecycle: LifecycleJson {
            auto_resume: rec.auto_resume,
            on_timeout: match rec.on_timeout {
                OnTimeout::Pause => "pause".into(),
                OnTimeout::Kill => "kill".into(),
            },
        },
    }
}

fn node_json(state: &ApiState, detail: bool) -> serde_json::Value {
    let u = state.orch.usage();
    let (mem_total, mem_used, cpus) = {
        let mut s = state.host.lock();
        let (total, used) = match s.as_mut() {
            Some(s) => {
                s.refresh_memory();
                (s.total_memory(), s.used_memory())
            }
            None => (0, 0),
        };
        (
            total,
            used,
            std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1),
        )
    };
    let id = &state.identity;
    let mut v = serde_json::json!({
        "id": id.node_id,
        "nodeID": id.node_id,
        "serviceInstanceID": id.service_instance_id,
        "clusterID": id.cluster_id,
        "version": id.version,
        "commit": id.commit,
        "machineInfo": state.machine,
        "status": "ready",
        "sandboxCount": u.running,
        "sandboxPausedCount": u.paused,
        "createSuccesses": u.create_successes,
        "createFails": u.create_fails,
        "backend": state.orch.backend_kind(),
        "metrics": {
            "allocatedCPU": u.allocated_cpu,
            "allocatedMemoryBytes": u.allocated_memory_bytes,
            "cpuPercent": 0,
            "cpuCount": cpus,
            "memoryUsedBytes": mem_used,
            "memoryTotalBytes": mem_total,
            "disks": [],
            "pausedAllocatedCPU": u.paused_allocated_cpu,
            "pausedAllocatedMemoryBytes": u.paused_allocated_memory_bytes,
        },
    });
    if detail {
        v["cachedBuilds"] = serde_json::json!([]);
    } else {
        v["sandboxStartingCount"] = serde_json::json!(u.starting);
    }
    v
}

/// Serves the API on `listener` until `shutdown` resolves, then stops accepting and
/// lets open connections finish (for at most `drain`).
pub async fn serve(
    state: Arc<ApiState>,
    listener: tokio::net::TcpListener,
    shutdown: impl std::future::Future<Output = ()>,
    drain: Duration,
) {
    use hyper_util::rt::{TokioExecutor, TokioIo};
    use hyper_util::server::conn::auto::Builder;
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
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
        let builder = Builder::new(TokioExecutor::new());
        let conn = builder.serve_connection_with_upgrades(TokioIo::new(stream), svc);
        let conn = graceful.watch(conn.into_owned());
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, "connection ended");
            }
        });
    }
    drop(listener);
    if tokio::time::timeout(drain, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!("open connections did not finish within {drain:?}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes_match_v1_and_v2_paths() {
        let id = "01936f8e-72f5-7000-8000-000000000001";
        assert_eq!(
            match_route(&Method::POST, "/v2/sandboxes"),
            Some(Route::Create)
        );
        assert_eq!(
            match_route(&Method::POST, "/sandboxes"),
            Some(Route::Create)
        );
        assert_eq!(
            match_route(&Method::POST, &format!("/v2/sandboxes/{id}/connect")),
            Some(Route::Connect(id.into()))
        );
        assert_eq!(
            match_route(&Method::POST, &format!("/sandboxes/{id}/connect")),
            Some(Route::Connect(id.into()))
        );
        assert_eq!(match_route(&Method::PUT, "/sandboxes"), None);
        assert_eq!(
            match_route(&Method::POST, &format!("/sandboxes/{id}/snapshots")),
            Some(Route::Snapshot(id.into()))
        );
        assert_eq!(
            match_route(&Method::GET, "/snapshots"),
            Some(Route::Snapshots)
        );
        assert_eq!(
            match_route(&Method::GET, "/snapshots/web"),
            Some(Route::SnapshotGet("web".into()))
        );
        assert_eq!(
            match_route(&Method::GET, "/templates/aliases/web"),
            Some(Route::TemplateAlias("web".into()))
        );
        assert_eq!(
            match_route(&Method::DELETE, "/templates/web"),
            Some(Route::TemplateDelete("web".into()))
        );
        assert_eq!(match_route(&Method::POST, "/process.Process/Start"), None);
    }
}
