//! The agent's HTTP server: routing, access-token check, `/health`,
//! `/init`, `/envs`, and dispatch to the Connect services and `/files`.

use std::collections::BTreeMap;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use http::{Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde::Deserialize;
use tokio::net::TcpListener;

use crate::connect::RespBody;
use crate::responses::{json, json_error, status_only};
use crate::state::InitUpdate;
use crate::{fastpath, files, filesystem, process};

// The types a caller of `serve` needs, where callers have always found them.
pub use crate::state::{AgentOptions, AgentState, base_env};

/// Errors of the server module.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("binding {addr}: {source}; is another agent already listening there?")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
}

#[derive(Debug, Default, Deserialize)]
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
        InitBody::default()
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
        && let Err(e) = state.accounts().lookup(user)
    {
        return json_error(StatusCode::BAD_REQUEST, e.to_string());
    }
    state.apply_init(InitUpdate {
        env_vars: parsed.env_vars,
        access_token: parsed.access_token,
        default_user: parsed.default_user,
        default_workdir: parsed.default_workdir,
    });
    if state.may_set_clock()
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

fn handle_envs(state: &AgentState) -> Response<RespBody> {
    let mut all = base_env();
    all.extend(state.init_envs());
    json(&all)
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
        (Method::GET, "/metrics") => json(&state.sample_metrics()),
        (Method::GET, "/files") => files::download(&state, req).await,
        (Method::POST, "/files") => files::upload(&state, req).await,
        (Method::POST, "/files/compose") => files::compose(&state, req).await,
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
            let Some(io) = fastpath::intercept(stream, &state).await else {
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
                .header_read_timeout(fastpath::HEADER_TIMEOUT);
            builder.http2().max_header_list_size(256 * 1024);
            if let Err(e) = builder.serve_connection(TokioIo::new(io), svc).await {
                tracing::debug!(%peer, error = %e, "connection ended with an error");
            }
        });
    }
}

/// The listening socket named by [`crate::LISTEN_FD_ENV`], if the variable is set and
/// names a listening TCP socket; it is made close-on-exec (no process the agent starts
/// holds it) and non-blocking. A variable naming anything else is ignored with a warning.
pub fn inherited_listener() -> Option<std::net::TcpListener> {
    use std::os::fd::FromRawFd;
    let value = std::env::var(crate::LISTEN_FD_ENV).ok()?;
    let checked = value
        .trim()
        .parse::<std::os::fd::RawFd>()
        .ok()
        .filter(|fd| *fd > 2)
        .ok_or("not a descriptor number above 2")
        .and_then(|fd| {
            if sockopt(fd, libc::SO_ACCEPTCONN) != Some(1)
                || sockopt(fd, libc::SO_TYPE) != Some(libc::SOCK_STREAM)
            {
                return Err("not a listening stream socket");
            }
            // SAFETY: fcntl on a descriptor number; a bad one fails with EBADF.
            if unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) } != 0 {
                return Err("cannot be made close-on-exec");
            }
            // SAFETY: a listening stream socket nothing else in this process owns.
            let l = unsafe { std::net::TcpListener::from_raw_fd(fd) };
            l.set_nonblocking(true)
                .map_err(|_| "cannot be made non-blocking")?;
            l.local_addr().map_err(|_| "not a TCP socket")?;
            Ok(l)
        });
    match checked {
        Ok(l) => Some(l),
        Err(why) => {
            tracing::warn!(value = %value, why, "{} ignored", crate::LISTEN_FD_ENV);
            None
        }
    }
}

/// An integer socket option of `fd` at `SOL_SOCKET`, `None` if it has none.
fn sockopt(fd: std::os::fd::RawFd, opt: libc::c_int) -> Option<libc::c_int> {
    let mut v: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: an int and its length, on this stack, as the option's value.
    let r = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            opt,
            (&mut v as *mut libc::c_int).cast(),
            &mut len,
        )
    };
    (r == 0).then_some(v)
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

/// Serves `listener` (see [`inherited_listener`]) until `shutdown`.
pub async fn serve_inherited(
    listener: std::net::TcpListener,
    state: Arc<AgentState>,
    shutdown: impl Future<Output = ()>,
) -> Result<(), ServerError> {
    let addr = listener
        .local_addr()
        .unwrap_or_else(|_| SocketAddr::from(([0, 0, 0, 0], 0)));
    let listener =
        TcpListener::from_std(listener).map_err(|source| ServerError::Bind { addr, source })?;
    tracing::info!(%addr, "agent listening (inherited socket)");
    serve(listener, state, shutdown).await
}
