//! `GET /console/api/sandboxes/{id}/terminal`: a WebSocket bridged to a PTY
//! process in the sandbox.
//!
//! Without `pid` a login shell is started (`process.Process/Start`); with
//! `pid` the socket re-attaches to that process (`process.Process/Connect`),
//! so a shell outlives a dropped socket. Output events become binary
//! messages; binary messages from the page are keystrokes
//! (`process.Process/SendInput`), text messages resizes
//! (`process.Process/Update`). Closing the socket leaves the shell running.

use std::sync::Arc;

use base64::Engine;
use base64::engine::general_purpose::STANDARD as B64;
use futures::{SinkExt, StreamExt};
use http::{Request, Response, StatusCode};
use tokio::sync::mpsc;
use tokio_tungstenite::tungstenite::Message;

use super::envd::{Agent, Envelopes};
use super::{Console, Ctx, err, query_param, socket};
use crate::body::GatewayBody;

/// What the page sends, in order.
enum Input {
    Keys(Vec<u8>),
    Resize(u32, u32),
}

/// A `cols`/`rows` value: 1..=1000.
fn dimension(query: Option<&str>, name: &str, default: u32) -> Result<u32, String> {
    match query_param(query, name) {
        None => Ok(default),
        Some(v) => match v.parse::<u32>() {
            Ok(n) if (1..=1000).contains(&n) => Ok(n),
            _ => Err(format!("{name} must be a whole number from 1 to 1000")),
        },
    }
}

/// Opens the terminal socket of a signed-in page.
pub(crate) async fn open(
    ctx: &Ctx,
    mut req: Request<GatewayBody>,
    id: &str,
    token: &str,
) -> Response<GatewayBody> {
    let query = req.uri().query();
    let (cols, rows) = match (dimension(query, "cols", 80), dimension(query, "rows", 24)) {
        (Ok(c), Ok(r)) => (c, r),
        (Err(e), _) | (_, Err(e)) => return err(StatusCode::BAD_REQUEST, &e),
    };
    let pid = match query_param(query, "pid") {
        None => None,
        Some(p) => match p.parse::<u32>() {
            Ok(p) if p > 0 => Some(p),
            _ => return err(StatusCode::BAD_REQUEST, "pid must be a process id"),
        },
    };
    if !crate::routing::is_websocket(req.headers()) {
        return err(
            StatusCode::BAD_REQUEST,
            "this path is a WebSocket: open it with an upgrade",
        );
    }
    let agent = match Agent::find(&ctx.gateway, ctx.remote, id).await {
        Ok(a) => a,
        Err(r) => return *r,
    };
    let (resp, on_upgrade) = match socket::accept(&mut req) {
        Ok(r) => r,
        Err(r) => return *r,
    };
    let console = ctx.console.clone();
    let token = token.to_string();
    tokio::spawn(async move {
        if let Some(ws) = socket::upgraded(on_upgrade).await {
            bridge(ws, agent, console, token, cols, rows, pid).await;
        }
    });
    resp
}

fn text(v: serde_json::Value) -> Message {
    Message::text(v.to_string())
}

/// The first event of a process stream: its pid.
async fn started(out: &mut Envelopes) -> Result<u32, String> {
    loop {
        match out.next().await? {
            Some(m) => {
                if let Some(pid) = m["event"]["start"]["pid"].as_u64() {
                    return u32::try_from(pid).map_err(|_| "the agent sent a bad pid".to_string());
                }
            }
            None => return Err("the process stream ended before the process started".into()),
        }
    }
}

/// Starts a login shell with a PTY: `/bin/bash -l`, else `/bin/sh -l`.
async fn start_shell(agent: &Agent, cols: u32, rows: u32) -> Result<(u32, Envelopes), String> {
    let mut last = String::new();
    for cmd in ["/bin/bash", "/bin/sh"] {
        let msg = serde_json::json!({
            "process": {"cmd": cmd, "args": ["-l"], "envs": {"TERM": "xterm-256color"}},
            "pty": {"size": {"cols": cols, "rows": rows}},
            "stdin": true,
        });
        match agent.stream("/process.Process/Start", &msg).await {
            Ok(mut out) => match started(&mut out).await {
                Ok(pid) => return Ok((pid, out)),
                Err(e) => last = e,
            },
            Err(e) => last = e.to_string(),
        }
    }
    Err(format!("starting a shell failed: {last}"))
}

/// Re-attaches to process `pid`.
async fn attach(agent: &Agent, pid: u32) -> Result<(u32, Envelopes), String> {
    let msg = serde_json::json!({"process": {"pid": pid}});
    let mut out = agent
        .stream("/process.Process/Connect", &msg)
        .await
        .map_err(|e| format!("re-attaching to process {pid} failed: {e}"))?;
    started(&mut out)
        .await
        .map_err(|e| format!("re-attaching to process {pid} failed: {e}"))?;
    Ok((pid, out))
}

/// Keystrokes sent in one call at most.
const INPUT_BATCH: usize = 64 * 1024;

/// Forwards the page's input in order, one call at a time; keystrokes that
/// queued up while a call was out go together in the next.
async fn forward_input(agent: Agent, pid: u32, mut rx: mpsc::Receiver<Input>) {
    let mut pending: Option<Input> = None;
    loop {
        let input = match pending.take() {
            Some(i) => i,
            None => match rx.recv().await {
                Some(i) => i,
                None => return,
            },
        };
        let input = match input {
            Input::Keys(mut keys) => {
                while keys.len() < INPUT_BATCH {
                    match rx.try_recv() {
                        Ok(Input::Keys(more)) => keys.extend_from_slice(&more),
                        Ok(other) => {
                            pending = Some(other);
                            break;
                        }
                        Err(_) => break,
                    }
                }
                Input::Keys(keys)
            }
            other => other,
        };
        let (procedure, msg) = match input {
            Input::Keys(b) => (
                "/process.Process/SendInput",
                serde_json::json!({"process": {"pid": pid}, "input": {"pty": B64.encode(b)}}),
            ),
            Input::Resize(cols, rows) => (
                "/process.Process/Update",
                serde_json::json!({"process": {"pid": pid}, "pty": {"size": {"cols": cols, "rows": rows}}}),
            ),
        };
        if let Err(e) = agent.unary(procedure, &msg).await {
            tracing::debug!(pid, error = %e, "terminal input was not delivered");
        }
    }
}

/// A resize message from the page, if it is one.
fn resize(t: &str) -> Option<Input> {
    let v: serde_json::Value = serde_json::from_str(t).ok()?;
    if v["type"] != "resize" {
        return None;
    }
    let dim = |k: &str| {
        v[k].as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .filter(|n| (1..=1000).contains(n))
    };
    Some(Input::Resize(dim("cols")?, dim("rows")?))
}

async fn bridge(
    ws: socket::Socket,
    agent: Agent,
    console: Arc<Console>,
    token: String,
    cols: u32,
    rows: u32,
    pid: Option<u32>,
) {
    let (mut sink, mut source) = ws.split();
    let reattached = pid.is_some();
    let opened = match pid {
        None => start_shell(&agent, cols, rows).await,
        Some(pid) => attach(&agent, pid).await,
    };
    let (pid, mut out) = match opened {
        Ok(o) => o,
        Err(message) => {
            let _ = sink
                .send(text(
                    serde_json::json!({"type": "error", "message": message}),
                ))
                .await;
            socket::close(&mut sink, 1011, "terminal failed").await;
            return;
        }
    };
    if sink
        .send(text(serde_json::json!({"type": "started", "pid": pid})))
        .await
        .is_err()
    {
        return;
    }
    let (tx, rx) = mpsc::channel(64);
    if reattached {
        // The page that re-attaches may have another size.
        let _ = tx.try_send(Input::Resize(cols, rows));
    }
    let input = tokio::spawn(forward_input(agent, pid, rx));
    let ended = socket::session_ended(console, token);
    tokio::pin!(ended);
    loop {
        tokio::select! {
            event = out.next() => match event {
                Ok(Some(m)) => {
                    let e = &m["event"];
                    let data = &e["data"];
                    if let Some(b64) = data["pty"].as_str().or(data["stdout"].as_str()).or(data["stderr"].as_str()) {
                        let Ok(bytes) = B64.decode(b64) else { continue };
                        if sink.send(Message::binary(bytes)).await.is_err() {
                            break;
                        }
                    } else if e.get("end").is_some() {
                        let code = e["end"]["exitCode"].as_i64().unwrap_or(0);
                        let _ = sink.send(text(serde_json::json!({"type": "exit", "code": code}))).await;
                        socket::close(&mut sink, 1000, "the shell ended").await;
                        break;
                    }
                }
                Ok(None) => {
                    let _ = sink.send(text(serde_json::json!({"type": "error", "message": "the shell's output stream ended: the sandbox may have been paused or killed"}))).await;
                    socket::close(&mut sink, 1011, "terminal failed").await;
                    break;
                }
                Err(e) => {
                    let _ = sink.send(text(serde_json::json!({"type": "error", "message": format!("the terminal lost the shell: {e} (the sandbox may have been paused or killed)")}))).await;
                    socket::close(&mut sink, 1011, "terminal failed").await;
                    break;
                }
            },
            msg = source.next() => match msg {
                Some(Ok(Message::Binary(b))) => {
                    if tx.send(Input::Keys(b.to_vec())).await.is_err() {
                        break;
                    }
                }
                Some(Ok(Message::Text(t))) => {
                    if let Some(r) = resize(t.as_str())
                        && tx.send(r).await.is_err()
                    {
                        break;
                    }
                }
                Some(Ok(Message::Close(_)) | Err(_)) | None => break,
                Some(Ok(_)) => {}
            },
            () = &mut ended => {
                socket::close(&mut sink, 4001, "signed out").await;
                break;
            }
        }
    }
    // Input already queued is still delivered; the shell keeps running.
    drop(tx);
    let _ = input.await;
}
