//! The control protocol of one VMM process: JSON lines over a unix socket.
//!
//! Every request is one line holding an [`Action`] (`{"action":"pause"}`,
//! `{"action":"snapshot","dir":"/x","kind":"diff"}`, …) and gets one line back:
//! `{"ok": <value>}` or `{"error": "<message>"}`. A connection may carry any number of
//! requests, one after another.
//!
//! The socket layer never touches VM state: connection threads only parse lines and pass
//! each [`Action`] to the one thread that owns the VM ([`serve`] with a [`Handler`]), which
//! answers it. A malformed line is answered by the connection thread itself and the
//! process keeps serving.
//!
//! [`VmmClient`] is the node's side: async (tokio), one connection per call, a timeout per
//! call, and errors that say which sandbox's VMM is missing or slow.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex, mpsc};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::sync::{lock, wait_timeout};

/// Longest request line the server reads; a longer one is refused.
pub const MAX_REQUEST_BYTES: usize = 64 * 1024;

/// Longest response line the client reads.
pub const MAX_RESPONSE_BYTES: usize = 1024 * 1024;

/// One request to the VMM.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "action", rename_all = "snake_case", deny_unknown_fields)]
pub enum Action {
    /// Boots the configured VM (its vCPUs start running).
    Start,
    /// Parks the vCPUs and quiesces the devices.
    Pause,
    /// Continues a paused VM.
    Resume,
    /// Writes a snapshot of the paused VM into `dir`.
    Snapshot {
        dir: PathBuf,
        #[serde(default)]
        kind: SnapshotKind,
    },
    /// Sets the balloon's target size.
    BalloonSetTarget { mib: u64 },
    /// The balloon's latest statistics.
    BalloonStats,
    /// The VM's counters.
    Metrics,
    /// Stops the VM; the process exits after answering.
    Stop,
    /// The VM's state (`created`, `running`, `paused`, `exited`).
    Status,
}

impl Action {
    /// The action's name on the wire.
    pub fn name(&self) -> &'static str {
        match self {
            Action::Start => "start",
            Action::Pause => "pause",
            Action::Resume => "resume",
            Action::Snapshot { .. } => "snapshot",
            Action::BalloonSetTarget { .. } => "balloon_set_target",
            Action::BalloonStats => "balloon_stats",
            Action::Metrics => "metrics",
            Action::Stop => "stop",
            Action::Status => "status",
        }
    }
}

/// Which snapshot to write: every page of guest memory, or only the pages written since
/// the previous snapshot (the VM must track dirty pages).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SnapshotKind {
    #[default]
    Full,
    Diff,
}

/// One response line.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum Response {
    Ok(Value),
    Error(String),
}

impl From<Result<Value, String>> for Response {
    fn from(r: Result<Value, String>) -> Self {
        match r {
            Ok(v) => Response::Ok(v),
            Err(e) => Response::Error(e),
        }
    }
}

/// What the thread that owns the VM does with each action.
pub trait Handler {
    /// Answers one action: a JSON value, or an error message for the client.
    fn handle(&mut self, action: Action) -> Result<Value, String>;
    /// Whether serving is over (the VM stopped or the guest ended).
    fn finished(&mut self) -> bool;
}

/// Errors of the server side.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error("cannot bind the API socket {}: {source}", path.display())]
    Bind {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the API socket {} is in use by a running VMM", path.display())]
    InUse { path: PathBuf },
}

/// One parsed request waiting for its answer.
pub struct Request {
    action: Action,
    reply: mpsc::SyncSender<Response>,
}

impl Request {
    pub fn action(&self) -> &Action {
        &self.action
    }
}

/// Requests handed over and not yet answered on their connection.
#[derive(Default)]
struct InFlight {
    count: Mutex<usize>,
    cv: Condvar,
}

impl InFlight {
    fn add(&self) {
        *lock(&self.count) += 1;
    }

    fn done(&self) {
        let mut c = lock(&self.count);
        *c = c.saturating_sub(1);
        self.cv.notify_all();
    }
}

/// The listening side: a unix socket whose connection threads hand actions over.
pub struct ControlServer {
    path: PathBuf,
    rx: mpsc::Receiver<Request>,
    in_flight: Arc<InFlight>,
}

impl ControlServer {
    /// Binds `path` (a stale socket file left by a dead VMM is replaced; one a live VMM
    /// answers on is not) and starts accepting connections.
    pub fn bind(path: &Path) -> Result<Self, ControlError> {
        if path.exists() {
            if UnixStream::connect(path).is_ok() {
                return Err(ControlError::InUse {
                    path: path.to_path_buf(),
                });
            }
            let _ = std::fs::remove_file(path);
        }
        let listener = UnixListener::bind(path).map_err(|source| ControlError::Bind {
            path: path.to_path_buf(),
            source,
        })?;
        let (tx, rx) = mpsc::channel::<Request>();
        let in_flight = Arc::new(InFlight::default());
        let flights = in_flight.clone();
        std::thread::Builder::new()
            .name("vmm-api".into())
            .spawn(move || accept_loop(listener, tx, flights))
            .map_err(|source| ControlError::Bind {
                path: path.to_path_buf(),
                source,
            })?;
        Ok(Self {
            path: path.to_path_buf(),
            rx,
            in_flight,
        })
    }

    /// Waits (at most `timeout`) until every answer handed to a connection was written, so
    /// the answer to `stop` reaches its client before the process exits.
    pub fn drain(&self, timeout: Duration) {
        let deadline = std::time::Instant::now() + timeout;
        let mut c = lock(&self.in_flight.count);
        while *c > 0 {
            let now = std::time::Instant::now();
            if now >= deadline {
                return;
            }
            c = wait_timeout(&self.in_flight.cv, c, deadline - now).0;
        }
    }

    /// The socket's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The next request, waiting at most `timeout`.
    pub fn next(&self, timeout: Duration) -> Option<Request> {
        self.rx.recv_timeout(timeout).ok()
    }
}

impl Drop for ControlServer {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// How often [`serve`] asks the handler whether serving is over while no request comes.
const POLL: Duration = Duration::from_millis(50);

/// How long [`serve`] waits for the last answers to be written once serving is over.
const DRAIN: Duration = Duration::from_secs(2);

/// Answers requests with `handler` until it reports [`Handler::finished`].
pub fn serve(server: &ControlServer, handler: &mut impl Handler) {
    loop {
        if handler.finished() {
            server.drain(DRAIN);
            return;
        }
        let Some(req) = server.next(POLL) else {
            continue;
        };
        let name = req.action.name();
        let resp = Response::from(handler.handle(req.action));
        if let Response::Error(e) = &resp {
            tracing::warn!(action = name, error = %e, "request failed");
        } else {
            tracing::info!(action = name, "request done");
        }
        // The client may have gone; the answer is then dropped.
        let _ = req.reply.send(resp);
    }
}

fn accept_loop(listener: UnixListener, tx: mpsc::Sender<Request>, in_flight: Arc<InFlight>) {
    for conn in listener.incoming() {
        match conn {
            Ok(stream) => {
                let tx = tx.clone();
                let in_flight = in_flight.clone();
                let spawned = std::thread::Builder::new()
                    .name("vmm-api-conn".into())
                    .spawn(move || connection(stream, tx, &in_flight));
                if let Err(e) = spawned {
                    tracing::warn!(error = %e, "cannot start a connection thread");
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "accepting an API connection");
            }
        }
    }
}

/// Reads one line of at most `max` bytes (without the newline). `Ok(None)` at the end of
/// the stream; an over-long line is consumed up to its newline and reported as `Err`.
fn read_line(r: &mut impl BufRead, max: usize) -> std::io::Result<Option<Result<String, String>>> {
    let mut buf = Vec::new();
    let n = r
        .by_ref()
        .take(max as u64 + 1)
        .read_until(b'\n', &mut buf)?;
    if n == 0 {
        return Ok(None);
    }
    if buf.last() == Some(&b'\n') {
        buf.pop();
    } else if buf.len() > max {
        // Skip the rest of the long line.
        let mut rest = Vec::new();
        r.read_until(b'\n', &mut rest)?;
        return Ok(Some(Err(format!(
            "request longer than {max} bytes: send one JSON object per line"
        ))));
    }
    Ok(Some(
        String::from_utf8(buf).map_err(|_| "request is not UTF-8".to_string()),
    ))
}

fn connection(stream: UnixStream, tx: mpsc::Sender<Request>, in_flight: &InFlight) {
    let Ok(write_half) = stream.try_clone() else {
        return;
    };
    let mut reader = BufReader::new(stream);
    let mut writer = write_half;
    loop {
        let line = match read_line(&mut reader, MAX_REQUEST_BYTES) {
            Ok(Some(l)) => l,
            Ok(None) | Err(_) => return,
        };
        let mut handed_over = false;
        let resp = match line {
            Err(e) => Response::Error(e),
            Ok(l) if l.trim().is_empty() => continue,
            Ok(l) => match serde_json::from_str::<Action>(&l) {
                Err(e) => Response::Error(format!(
                    "bad request: {e}; send one JSON object per line such as {{\"action\":\"status\"}}"
                )),
                Ok(action) => {
                    let (rtx, rrx) = mpsc::sync_channel(1);
                    in_flight.add();
                    handed_over = true;
                    if tx.send(Request { action, reply: rtx }).is_err() {
                        Response::Error("the VMM is shutting down".into())
                    } else {
                        rrx.recv()
                            .unwrap_or_else(|_| Response::Error("the VMM is shutting down".into()))
                    }
                }
            },
        };
        let mut out = match serde_json::to_vec(&resp) {
            Ok(v) => v,
            Err(e) => format!("{{\"error\":\"encoding the response: {e}\"}}").into_bytes(),
        };
        out.push(b'\n');
        let written = writer.write_all(&out);
        if handed_over {
            in_flight.done();
        }
        if written.is_err() {
            return;
        }
    }
}

/// Errors of [`VmmClient`].
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("the VMM process for sandbox {sandbox} is not running (no API socket at {})", path.display())]
    NotRunning { sandbox: String, path: PathBuf },
    #[error("the VMM of sandbox {sandbox} did not answer {action} within {after:?}")]
    Timeout {
        sandbox: String,
        action: &'static str,
        after: Duration,
    },
    #[error("talking to the VMM of sandbox {sandbox} ({action}): {source}")]
    Io {
        sandbox: String,
        action: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("the VMM of sandbox {sandbox} sent a bad response to {action}: {message}")]
    Protocol {
        sandbox: String,
        action: &'static str,
        message: String,
    },
    #[error("the VMM of sandbox {sandbox} refused {action}: {message}")]
    Refused {
        sandbox: String,
        action: &'static str,
        message: String,
    },
}

/// The default time one call may take.
pub const DEFAULT_CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// The node's side of the protocol.
#[derive(Clone, Debug)]
pub struct VmmClient {
    path: PathBuf,
    sandbox: String,
    timeout: Duration,
}

impl VmmClient {
    /// A client of the VMM of `sandbox`, listening on `path`.
    pub fn new(path: impl Into<PathBuf>, sandbox: impl Into<String>) -> Self {
        Self {
            path: path.into(),
            sandbox: sandbox.into(),
            timeout: DEFAULT_CALL_TIMEOUT,
        }
    }

    /// Sets the time one call may take.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The socket's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Sends one action and returns the `ok` value.
    pub async fn call(&self, action: &Action) -> Result<Value, ClientError> {
        self.call_with_timeout(action, self.timeout).await
    }

    /// [`VmmClient::call`] with its own timeout.
    pub async fn call_with_timeout(
        &self,
        action: &Action,
        timeout: Duration,
    ) -> Result<Value, ClientError> {
        let name = action.name();
        match tokio::time::timeout(timeout, self.exchange(action)).await {
            Ok(r) => r,
            Err(_) => Err(ClientError::Timeout {
                sandbox: self.sandbox.clone(),
                action: name,
                after: timeout,
            }),
        }
    }

    async fn exchange(&self, action: &Action) -> Result<Value, ClientError> {
        use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};
        let name = action.name();
        let io = |source| ClientError::Io {
            sandbox: self.sandbox.clone(),
            action: name,
            source,
        };
        let stream = match tokio::net::UnixStream::connect(&self.path).await {
            Ok(s) => s,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused
                ) =>
            {
                return Err(ClientError::NotRunning {
                    sandbox: self.sandbox.clone(),
                    path: self.path.clone(),
                });
            }
            Err(e) => return Err(io(e)),
        };
        let (r, mut w) = stream.into_split();
        let mut line = serde_json::to_vec(action).map_err(|e| ClientError::Protocol {
            sandbox: self.sandbox.clone(),
            action: name,
            message: e.to_string(),
        })?;
        line.push(b'\n');
        w.write_all(&line).await.map_err(io)?;
        let mut buf = Vec::new();
        let mut r = tokio::io::BufReader::new(r).take(MAX_RESPONSE_BYTES as u64);
        r.read_until(b'\n', &mut buf).await.map_err(io)?;
        if buf.last() != Some(&b'\n') {
            return Err(ClientError::Protocol {
                sandbox: self.sandbox.clone(),
                action: name,
                message: if buf.is_empty() {
                    "the connection closed without an answer (did the VMM exit?)".into()
                } else {
                    "the answer is cut short or too long".into()
                },
            });
        }
        match serde_json::from_slice::<Response>(&buf) {
            Ok(Response::Ok(v)) => Ok(v),
            Ok(Response::Error(message)) => Err(ClientError::Refused {
                sandbox: self.sandbox.clone(),
                action: name,
                message,
            }),
            Err(e) => Err(ClientError::Protocol {
                sandbox: self.sandbox.clone(),
                action: name,
                message: e.to_string(),
            }),
        }
    }

    /// Waits until the VMM answers `status`, for at most `timeout`; a missing socket is
    /// retried until then.
    pub async fn wait_ready(&self, timeout: Duration) -> Result<Value, ClientError> {
        let deadline = tokio::time::Instant::now() + timeout;
        let mut pause = Duration::from_micros(200);
        loop {
            match self.call(&Action::Status).await {
                Ok(v) => return Ok(v),
                Err(ClientError::NotRunning { .. }) if tokio::time::Instant::now() < deadline => {
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_millis(10));
                }
                Err(ClientError::NotRunning { .. }) => {
                    return Err(ClientError::Timeout {
                        sandbox: self.sandbox.clone(),
                        action: "status",
                        after: timeout,
                    });
                }
                Err(e) => return Err(e),
            }
        }
    }

    pub async fn start(&self) -> Result<Value, ClientError> {
        self.call(&Action::Start).await
    }

    pub async fn pause(&self) -> Result<Value, ClientError> {
        self.call(&Action::Pause).await
    }

    pub async fn resume(&self) -> Result<Value, ClientError> {
        self.call(&Action::Resume).await
    }

    /// Writes a snapshot (memory included: allowed `timeout`, it may be large).
    pub async fn snapshot(
        &self,
        dir: &Path,
        kind: SnapshotKind,
        timeout: Duration,
    ) -> Result<Value, ClientError> {
        self.call_with_timeout(
            &Action::Snapshot {
                dir: dir.to_path_buf(),
                kind,
            },
            timeout,
        )
        .await
    }

    pub async fn balloon_set_target(&self, mib: u64) -> Result<Value, ClientError> {
        self.call(&Action::BalloonSetTarget { mib }).await
    }

    pub async fn balloon_stats(&self) -> Result<Value, ClientError> {
        self.call(&Action::BalloonStats).await
    }

    pub async fn metrics(&self) -> Result<Value, ClientError> {
        self.call(&Action::Metrics).await
    }

    pub async fn status(&self) -> Result<Value, ClientError> {
        self.call(&Action::Status).await
    }

    pub async fn stop(&self) -> Result<Value, ClientError> {
        self.call(&Action::Stop).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn actions_have_one_json_shape() {
        let a: Action =
            serde_json::from_str(r#"{"action":"snapshot","dir":"/s","kind":"diff"}"#).unwrap();
        assert_eq!(
            a,
            Action::Snapshot {
                dir: "/s".into(),
                kind: SnapshotKind::Diff
            }
        );
        let a: Action = serde_json::from_str(r#"{"action":"snapshot","dir":"/s"}"#).unwrap();
        assert_eq!(
            a,
            Action::Snapshot {
                dir: "/s".into(),
                kind: SnapshotKind::Full
            }
        );
        assert_eq!(
            serde_json::to_string(&Action::BalloonSetTarget { mib: 64 }).unwrap(),
            r#"{"action":"balloon_set_target","mib":64}"#
        );
        assert!(serde_json::from_str::<Action>(r#"{"action":"reboot"}"#).is_err());
        assert!(serde_json::from_str::<Action>(r#"{"action":"snapshot","dri":"/s"}"#).is_err());
        assert_eq!(
            serde_json::to_string(&Response::Ok(serde_json::json!({"a":1}))).unwrap(),
            r#"{"ok":{"a":1}}"#
        );
        assert_eq!(
            serde_json::to_string(&Response::Error("no".into())).unwrap(),
            r#"{"error":"no"}"#
        );
    }

    #[test]
    fn long_lines_are_refused_and_skipped() {
        let text = format!("{}\n{{\"action\":\"status\"}}\n", "x".repeat(100));
        let mut r = BufReader::new(text.as_bytes());
        assert!(read_line(&mut r, 10).unwrap().unwrap().is_err());
        assert_eq!(
            read_line(&mut r, 100).unwrap().unwrap().unwrap(),
            r#"{"action":"status"}"#
        );
        assert!(read_line(&mut r, 100).unwrap().is_none());
    }
}
