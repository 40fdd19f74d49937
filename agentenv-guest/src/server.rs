//! The agent's HTTP server: routing, access-token check, `/health`,
//! `/init`, `/envs`, and dispatch to the Connect services and `/files`.

use std::collections::BTreeMap;
use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use base64::Engine as _;
use http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode, Uri, header};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use parking_lot::RwLock;
use serde::Deserialize;
use subtle::ConstantTimeEq;
use tokio::net::TcpListener;

use crate::connect::{self, Code, ConnectError, RespBody};
use crate::users::{AccountFiles, User};
use crate::{filesystem, process};

/// Errors of the server module.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("binding {addr}: {source}; is another agent already listening there?")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
}

/// Start-up options of the agent.
#[derive(Debug, Clone, Default)]
pub struct AgentOptions {
    /// User for calls that name none (until `/init` sets one). `None`: the
    /// account the agent runs as.
    pub default_user: Option<String>,
    /// Working directory for processes that name none. `None`: the user's home.
    pub default_workdir: Option<String>,
    /// Access token enforced from the start (otherwise only after `/init`).
    pub access_token: Option<String>,
    /// Let `/init` set the system clock from its `timestamp` (only inside a
    /// sandbox).
    pub set_clock: bool,
    /// Where users and groups are read from.
    pub accounts: AccountFiles,
}

/// What `/init` may change.
#[derive(Debug, Clone, Default)]
struct InitState {
    envs: BTreeMap<String, String>,
    access_token: Option<String>,
    default_user: Option<String>,
    default_workdir: Option<String>,
}

/// The agent's shared state.
#[derive(Debug)]
pub struct AgentState {
    opts: AgentOptions,
    init: RwLock<InitState>,
    /// Running processes.
    pub processes: process::ProcessTable,
    /// Polling watchers (CreateWatcher).
    pub watchers: filesystem::Watchers,
    metrics: crate::metrics::MetricsSampler,
    fast_uploads: std::sync::atomic::AtomicU64,
}

impl AgentState {
    pub fn new(opts: AgentOptions) -> Arc<Self> {
        let init = InitState {
            envs: BTreeMap::new(),
            access_token: opts.access_token.clone().filter(|t| !t.is_empty()),
            default_user: opts.default_user.clone(),
            default_workdir: opts.default_workdir.clone(),
        };
        Arc::new(AgentState {
            opts,
            init: RwLock::new(init),
            processes: process::ProcessTable::default(),
            watchers: filesystem::Watchers::default(),
            metrics: Default::default(),
            fast_uploads: Default::default(),
        })
    }

    /// Account files in use.
    pub fn accounts(&self) -> &AccountFiles {
        &self.opts.accounts
    }

    /// The default user's name.
    pub fn default_user_name(&self) -> String {
        if let Some(u) = self.init.read().default_user.clone() {
            return u;
        }
        // SAFETY: geteuid has no preconditions and cannot fail.
        let uid = unsafe { libc::geteuid() };
        self.opts
            .accounts
            .name_of_uid(uid)
            .unwrap_or_else(|| uid.to_string())
    }

    /// Resolves a user by name, or the default user for `None`/empty.
    pub fn user(&self, name: Option<&str>) -> Result<User, ConnectError> {
        let name = match name {
            Some(n) if !n.is_empty() => n.to_string(),
            _ => self.default_user_name(),
        };
        match self.opts.accounts.lookup(&name) {
            Ok(u) => Ok(u),
            // A root filesystem without an entry for the agent's own account
            // (or without /etc/passwd): the agent's identity still works.
            Err(e) => self
                .own_account(&name)
                .ok_or_else(|| ConnectError::new(Code::Unauthenticated, e.to_string())),
        }
    }

    /// The account the agent runs as, when `name` names it (by the name
    /// `root` for uid 0, or by number).
    fn own_account(&self, name: &str) -> Option<User> {
        // SAFETY: geteuid/getegid have no preconditions.
        let (uid, gid) = unsafe { (libc::geteuid(), libc::getegid()) };
        let matches = name == uid.to_string() || (uid == 0 && name == "root");
        matches.then(|| User {
            name: name.to_string(),
            uid,
            gid,
            home: std::env::var_os("HOME")
                .map(PathBuf::from)
                .unwrap_or_else(|| PathBuf::from(if uid == 0 { "/root" } else { "/" })),
            shell: "/bin/sh".into(),
            groups: vec![gid],
        })
    }

    /// The user a request acts as: `Authorization: Basic base64("<user>:")`
    /// or the default user.
    pub fn caller(&self, headers: &HeaderMap) -> Result<User, ConnectError> {
        let name = basic_auth_user(headers)?;
        self.user(name.as_deref())
    }

    /// Environment variables set by `/init`.
    pub fn init_envs(&self) -> BTreeMap<String, String> {
        self.init.read().envs.clone()
    }

    /// Default working directory (from `/init` or options).
    pub fn default_workdir(&self) -> Option<PathBuf> {
        self.init
            .read()
            .default_workdir
            .clone()
            .filter(|w| !w.is_empty())
            .map(PathBuf::from)
    }

    /// Checks `X-Access-Token` against the current token in constant time.
    fn authorized(&self, headers: &HeaderMap) -> bool {
        let guard = self.init.read();
        let Some(expected) = guard.access_token.as_deref() else {
            return true;
        };
        let Some(got) = headers.get("x-access-token") else {
            return false;
        };
        bool::from(got.as_bytes().ct_eq(expected.as_bytes()))
    }
}

impl AgentState {
    /// Checks a signed `/files` URL: `signature=v1_<b64(sha256(
    /// "<path>:<read|write>:<username>:<token>[:<expiration>]"))>` and an
    /// optional `signature_expiration` (Unix seconds) not in the past.
    fn signed_url_ok(&self, method: &Method, query: Option<&str>) -> bool {
        use sha2::Digest;
        let Some(token) = self.init.read().access_token.clone() else {
            return true;
        };
        let param = |k: &str| crate::files::query_param(query, k);
        let Some(sig) = param("signature") else {
            return false;
        };
        let op = if method == Method::GET {
            "read"
        } else {
            "write"
        };
        let path = param("path").unwrap_or_default();
        let user = param("username").unwrap_or_default();
        let mut raw = format!("{path}:{op}:{user}:{token}");
        if let Some(exp) = param("signature_expiration") {
            let Ok(exp) = exp.parse::<u64>() else {
                return false;
            };
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(u64::MAX);
            if exp < now {
                return false;
            }
            raw.push_str(&format!(":{exp}"));
        }
        let digest = sha2::Sha256::digest(raw.as_bytes());
        let want = format!(
            "v1_{}",
            base64::engine::general_purpose::STANDARD_NO_PAD.encode(digest)
        );
        bool::from(sig.as_bytes().ct_eq(want.as_bytes()))
    }
}

impl AgentState {
    /// The answer to a request without valid credentials (`X-Access-Token`,
    /// or a signed URL for `/files`), or `None` when it may pass.
    pub(crate) fn denied(
        &self,
        method: &Method,
        uri: &Uri,
        headers: &HeaderMap,
    ) -> Option<Response<RespBody>> {
        let path = uri.path();
        let signed_files_url = path == "/files" && self.signed_url_ok(method, uri.query());
        if signed_files_url || self.authorized(headers) {
            return None;
        }
        let msg = "missing or wrong X-Access-Token: send the sandbox's envd access token";
        Some(
            if path.starts_with("/process.") || path.starts_with("/filesystem.") {
                ConnectError::new(Code::Unauthenticated, msg).into_unary_response()
            } else {
                json_error(StatusCode::UNAUTHORIZED, msg)
            },
        )
    }

    /// Uploads taken by the zero-copy path so far (a raw `POST /files` as
    /// a connection's first request, its body spliced into the file).
    pub fn fast_path_uploads(&self) -> u64 {
        self.fast_uploads.load(std::sync::atomic::Ordering::Relaxed)
    }

    pub(crate) fn count_fast_upload(&self) {
        self.fast_uploads
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
}

/// The user named by a Basic `Authorization` header, if any.
fn basic_auth_user(headers: &HeaderMap) -> Result<Option<String>, ConnectError> {
    let Some(v) = headers.get(header::AUTHORIZATION) else {
        return Ok(None);
    };
    let bad = || {
        ConnectError::new(
            Code::Unauthenticated,
            "Authorization must be `Basic base64(\"<user>:\")`",
        )
    };
    let s = v.to_str().map_err(|_| bad())?;
    let Some(b64) = s
        .strip_prefix("Basic ")
        .or_else(|| s.strip_prefix("basic "))
    else {
        return Err(bad());
    };
    let raw = base64::engine::general_purpose::STANDARD
        .decode(b64.trim())
        .map_err(|_| bad())?;
    let text = String::from_utf8(raw).map_err(|_| bad())?;
    let user = text.split(':').next().unwrap_or("").to_string();
    Ok(if user.is_empty() { None } else { Some(user) })
}

/// A JSON error body `{"code": <status>, "message": "..."}` for plain routes.
pub fn json_error(status: StatusCode, message: impl Into<String>) -> Response<RespBody> {
    let body = serde_json::json!({"code": status.as_u16(), "message": message.into()});
    let mut r = Response::new(connect::full(serde_json::to_vec(&body).unwrap_or_default()));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}

fn status_only(status: StatusCode) -> Response<RespBody> {
    let mut r = Response::new(connect::empty());
    *r.status_mut() = status;
    r
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct InitBody {
    #[serde(default)]
    env_vars: Option<BTreeMap<String, String>>,
    #[serde(default)]
    access_token: Option<String>,
    #[serde(default)]
    default_user: Option<String>,
    #[serde(default)]
    default_workdir: Option<String>,
    #[serde(default)]
    timestamp: Option<String>,
}

async fn handle_init(state: &AgentState, req: Request<Incoming>) -> Response<RespBody> {
    use http_body_util::BodyExt;
    let limited = http_body_util::Limited::new(req.into_body(), 4 * 1024 * 1024);
    let body = match limited.collect().await {
        Ok(b) => b.to_bytes(),
        Err(e) => return json_error(StatusCode::BAD_REQUEST, format!("reading body: {e}")),
    };
    let parsed: InitBody = if body.iter().all(|b| b.is_ascii_whitespace()) {
        InitBody {
            env_vars: None,
            access_token: None,
            default_user: None,
            default_workdir: None,
            timestamp: None,
        }
    } else {
        match serde_json::from_slice(&body) {
            Ok(p) => p,
            Err(e) => {
                return json_error(
                    StatusCode::BAD_REQUEST,
                    format!(
                        "/init body must be JSON like {{\"envVars\":{{}},\"accessToken\":\"...\"}}: {e}"
                    ),
                );
            }
        }
    };
    if let Some(user) = parsed.default_user.as_deref().filter(|u| !u.is_empty())
        && let Err(e) = state.opts.accounts.lookup(user)
    {
        return json_error(StatusCode::BAD_REQUEST, e.to_string());
    }
    {
        let mut init = state.init.write();
        if let Some(envs) = parsed.env_vars {
            init.envs.extend(envs);
        }
        if let Some(token) = parsed.access_token {
            init.access_token = if token.is_empty() { None } else { Some(token) };
        }
        if let Some(u) = parsed.default_user.filter(|u| !u.is_empty()) {
            init.default_user = Some(u);
        }
        if let Some(w) = parsed.default_workdir.filter(|w| !w.is_empty()) {
            init.default_workdir = Some(w);
        }
    }
    if state.opts.set_clock
        && let Some(ts) = parsed.timestamp
    {
        set_clock(&ts);
    }
    tracing::info!("initialized by /init");
    status_only(StatusCode::NO_CONTENT)
}

/// Sets the system clock from an RFC 3339 timestamp when it is more than a
/// second off.
fn set_clock(ts: &str) {
    let Ok(t) = pbjson_types::Timestamp::from_str_rfc3339(ts) else {
        tracing::warn!(
            timestamp = ts,
            "/init timestamp is not RFC 3339; clock left alone"
        );
        return;
    };
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    if (now.as_secs() as i64 - t.seconds).abs() <= 1 {
        return;
    }
    let spec = libc::timespec {
        tv_sec: t.seconds as libc::time_t,
        tv_nsec: t.nanos as libc::c_long,
    };
    // SAFETY: `spec` is a valid timespec that outlives the call.
    let rc = unsafe { libc::clock_settime(libc::CLOCK_REALTIME, &spec) };
    if rc != 0 {
        tracing::warn!(error = %std::io::Error::last_os_error(), "setting the clock failed");
    }
}

trait FromRfc3339: Sized {
    fn from_str_rfc3339(s: &str) -> Result<Self, ()>;
}

impl FromRfc3339 for pbjson_types::Timestamp {
    fn from_str_rfc3339(s: &str) -> Result<Self, ()> {
        let quoted = serde_json::Value::String(s.to_string());
        serde_json::from_value(quoted).map_err(|_| ())
    }
}

/// The agent's own environment without its configuration variables
/// (`AGENTENV_GUEST_*`, which may carry the access token): the base of every
/// process's environment.
pub fn base_env() -> BTreeMap<String, String> {
    std::env::vars()
        .filter(|(k, _)| !k.starts_with("AGENTENV_GUEST_"))
        .collect()
}

fn handle_envs(state: &AgentState) -> Response<RespBody> {
    let mut all = base_env();
    all.extend(state.init_envs());
    let mut r = Response::new(connect::full(serde_json::to_vec(&all).unwrap_or_default()));
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}

/// Routes one request.
pub async fn handle(state: Arc<AgentState>, req: Request<Incoming>) -> Response<RespBody> {
    let path = req.uri().path().to_string();
    if path == "/health" {
        return match *req.method() {
            Method::GET | Method::HEAD => status_only(StatusCode::NO_CONTENT),
            _ => status_only(StatusCode::METHOD_NOT_ALLOWED),
        };
    }
    if let Some(denied) = state.denied(req.method(), req.uri(), req.headers()) {
        return denied;
    }
    match (req.method().clone(), path.as_str()) {
        (Method::POST, "/init") => handle_init(&state, req).await,
        (Method::GET, "/envs") => handle_envs(&state),
        (Method::GET, "/metrics") => {
            let m = state.metrics.sample();
            let mut r = Response::new(connect::full(serde_json::to_vec(&m).unwrap_or_default()));
            r.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
            r
        }
        (Method::GET, "/files") => crate::files::download(&state, req).await,
        (Method::POST, "/files") => crate::files::upload(&state, req).await,
        (Method::POST, "/files/compose") => crate::files::compose(&state, req).await,
        (_, "/init" | "/envs" | "/metrics" | "/files" | "/files/compose") => json_error(
            StatusCode::METHOD_NOT_ALLOWED,
            format!("{} is not allowed on {path}", req.method()),
        ),
        _ if path.starts_with("/process.Process/") => process::route(state, req).await,
        _ if path.starts_with("/filesystem.Filesystem/") => filesystem::route(state, req).await,
        _ => json_error(
            StatusCode::NOT_FOUND,
            format!("no route for {} {path}", req.method()),
        ),
    }
}

/// Serves connections from `listener` until `shutdown` completes. Each
/// connection speaks HTTP/1.1 or HTTP/2 (prior knowledge, h2c). A raw
/// upload (`POST /files` with a `Content-Length` body, not multipart, not
/// gzip) as a connection's first request has its body spliced from the
/// socket into the file, without hyper.
pub async fn serve(
    listener: TcpListener,
    state: Arc<AgentState>,
    shutdown: impl Future<Output = ()>,
) -> Result<(), ServerError> {
    tokio::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            r = listener.accept() => match r {
                Ok(x) => x,
                Err(e) => {
                    // Out of fds and similar: log, back off briefly, keep serving.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                    continue;
                }
            },
            _ = &mut shutdown => return Ok(()),
        };
        if let Err(e) = stream.set_nodelay(true) {
            tracing::debug!(error = %e, "TCP_NODELAY");
        }
        let state = state.clone();
        tokio::spawn(async move {
            // A raw upload first on the connection is served without hyper.
            let Some(io) = crate::fastpath::intercept(stream, &state).await else {
                return;
            };
            let svc = hyper::service::service_fn(move |req| {
                let state = state.clone();
                async move { Ok::<_, std::convert::Infallible>(handle(state, req).await) }
            });
            let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
            // A client that never finishes its headers is dropped after 30 s.
            builder
                .http1()
                .max_buf_size(1024 * 1024)
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(crate::fastpath::HEADER_TIMEOUT);
            builder.http2().max_header_list_size(256 * 1024);
            if let Err(e) = builder.serve_connection(TokioIo::new(io), svc).await {
                tracing::debug!(%peer, error = %e, "connection ended with an error");
            }
        });
    }
}

/// Binds `addr` and serves until `shutdown`.
pub async fn bind_and_serve(
    addr: SocketAddr,
    state: Arc<AgentState>,
    shutdown: impl Future<Output = ()>,
) -> Result<(), ServerError> {
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|source| ServerError::Bind { addr, source })?;
    tracing::info!(%addr, "agent listening");
    serve(listener, state, shutdown).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn basic_auth_user_parsing() {
        let mut h = HeaderMap::new();
        assert_eq!(basic_auth_user(&h).unwrap(), None);
        h.insert(
            header::AUTHORIZATION,
            HeaderValue::from_static("Basic dXNlcjo="),
        );
        assert_eq!(basic_auth_user(&h).unwrap().as_deref(), Some("user"));
        h.insert(header::AUTHORIZATION, HeaderValue::from_static("Bearer x"));
        assert!(basic_auth_user(&h).is_err());
    }
}
