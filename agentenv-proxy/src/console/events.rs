//! `GET /console/api/events`: live nodes and sandboxes over a WebSocket.
//!
//! One poller per gateway builds a snapshot every second (`GET /nodes`,
//! `GET /v2/sandboxes` page by page, through the gateway's own dispatch)
//! while at least one page listens, and publishes it in a
//! `tokio::sync::watch`: every page gets the latest snapshot, never a
//! backlog. Pages get a message only for the parts that changed.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use futures::{SinkExt, StreamExt};
use http::{Method, Request, Response, StatusCode};
use parking_lot::Mutex;
use tokio::sync::watch;
use tokio_tungstenite::tungstenite::Message;

use super::envd::{api, read_all};
use super::{Console, Ctx, socket};
use crate::body::{GatewayBody, empty};
use crate::server::Gateway;

/// How often the poller refreshes.
const EVERY: Duration = Duration::from_secs(1);
/// How often a page is pinged.
const PING_EVERY: Duration = Duration::from_secs(20);
/// Sandboxes listed at most.
const MAX_SANDBOXES: usize = 2_000;
/// What a page is told when no node reports.
const NO_NODES: &str = "no nodes are reporting: check the scheduler (docs/troubleshooting.md)";

/// The messages of one snapshot, serialized; `None` until known.
#[derive(Default, PartialEq, Eq)]
pub(crate) struct Snapshot {
    nodes: Option<Arc<str>>,
    sandboxes: Option<Arc<str>>,
    error: Option<Arc<str>>,
}

/// The poller's channel, while one runs.
#[derive(Default)]
pub(crate) struct Hub {
    tx: Mutex<Option<watch::Sender<Arc<Snapshot>>>>,
}

impl Hub {
    /// The latest snapshots; starts the poller when none runs.
    fn subscribe(console: &Arc<Console>, gateway: &Gateway) -> watch::Receiver<Arc<Snapshot>> {
        let mut slot = console.events.tx.lock();
        if let Some(tx) = slot.as_ref() {
            return tx.subscribe();
        }
        let (tx, rx) = watch::channel(Arc::new(Snapshot::default()));
        *slot = Some(tx.clone());
        tokio::spawn(poll(console.clone(), gateway.clone(), tx));
        rx
    }
}

/// Refreshes the snapshot while anyone listens.
async fn poll(console: Arc<Console>, gateway: Gateway, tx: watch::Sender<Arc<Snapshot>>) {
    let remote = SocketAddr::from(([127, 0, 0, 1], 0));
    loop {
        let snap = build(&gateway, remote).await;
        tx.send_if_modified(|cur| {
            if **cur == snap {
                return false;
            }
            *cur = Arc::new(snap);
            true
        });
        tokio::time::sleep(EVERY).await;
        let mut slot = console.events.tx.lock();
        if tx.receiver_count() == 0 {
            *slot = None;
            return;
        }
    }
}

/// A JSON array the gateway answered for `path`, or what went wrong.
async fn list(
    gateway: &Gateway,
    remote: SocketAddr,
    path: &str,
) -> Result<(Vec<serde_json::Value>, Option<String>), String> {
    let resp = api(gateway, remote, Method::GET, path, None, empty()).await;
    let status = resp.status();
    let next = resp
        .headers()
        .get(crate::routing::NEXT_TOKEN_HEADER)
        .and_then(|v| v.to_str().ok())
        .filter(|t| !t.is_empty())
        .map(str::to_string);
    let body = read_all(resp.into_body()).await.unwrap_or_default();
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    if !status.is_success() {
        let message = v["message"].as_str().unwrap_or("no answer");
        if status == StatusCode::SERVICE_UNAVAILABLE && message.starts_with("no nodes available") {
            return Err(NO_NODES.into());
        }
        return Err(format!(
            "the gateway cannot list {path}: {message} ({})",
            status.as_u16()
        ));
    }
    match v {
        serde_json::Value::Array(items) => Ok((items, next)),
        _ => Err(format!("the gateway's answer to {path} is not a list")),
    }
}

fn message(kind: &str, items: Vec<serde_json::Value>, truncated: Option<bool>) -> Arc<str> {
    let mut m = serde_json::json!({"type": kind, "items": items});
    if let Some(t) = truncated {
        m["truncated"] = t.into();
    }
    m.to_string().into()
}

async fn build(gateway: &Gateway, remote: SocketAddr) -> Snapshot {
    let mut snap = Snapshot::default();
    let mut errors = Vec::new();
    match list(gateway, remote, "/nodes").await {
        Ok((items, _)) => {
            if items.is_empty() {
                errors.push(NO_NODES.to_string());
            }
            snap.nodes = Some(message("nodes", items, None));
        }
        Err(e) => errors.push(e),
    }
    let mut items = Vec::new();
    let mut next: Option<String> = None;
    let mut truncated = false;
    let sandboxes = loop {
        let path = match &next {
            Some(t) => format!(
                "/v2/sandboxes?limit=100&nextToken={}",
                percent_encoding::utf8_percent_encode(t, percent_encoding::NON_ALPHANUMERIC)
            ),
            None => "/v2/sandboxes?limit=100".to_string(),
        };
        match list(gateway, remote, &path).await {
            Ok((page, token)) => {
                items.extend(page);
                if items.len() >= MAX_SANDBOXES {
                    truncated = items.len() > MAX_SANDBOXES || token.is_some();
                    items.truncate(MAX_SANDBOXES);
                    break Ok(());
                }
                match token {
                    Some(t) if next.as_deref() != Some(t.as_str()) => next = Some(t),
                    _ => break Ok(()),
                }
            }
            Err(e) => break Err(e),
        }
    };
    match sandboxes {
        Ok(()) => snap.sandboxes = Some(message("sandboxes", items, Some(truncated))),
        Err(e) if !errors.contains(&e) => errors.push(e),
        Err(_) => {}
    }
    if !errors.is_empty() {
        let m = serde_json::json!({"type": "error", "message": errors.join("; ")});
        snap.error = Some(m.to_string().into());
    }
    snap
}

/// Opens the events socket of a signed-in page.
pub(crate) fn open(ctx: &Ctx, mut req: Request<GatewayBody>, token: &str) -> Response<GatewayBody> {
    let (resp, on_upgrade) = match socket::accept(&mut req) {
        Ok(r) => r,
        Err(r) => return *r,
    };
    let console = ctx.console.clone();
    let gateway = ctx.gateway.clone();
    let token = token.to_string();
    tokio::spawn(async move {
        if let Some(ws) = socket::upgraded(on_upgrade).await {
            serve(ws, console, gateway, token).await;
        }
    });
    resp
}

async fn serve(ws: socket::Socket, console: Arc<Console>, gateway: Gateway, token: String) {
    let (mut sink, mut source) = ws.split();
    let mut rx = Hub::subscribe(&console, &gateway);
    let ended = socket::session_ended(console.clone(), token);
    tokio::pin!(ended);
    let mut ping = tokio::time::interval_at(tokio::time::Instant::now() + PING_EVERY, PING_EVERY);
    let mut sent = Snapshot::default();
    loop {
        {
            let snap = rx.borrow_and_update().clone();
            let mut out = Vec::new();
            // An error first, then the data that is known (which replaces it).
            if snap.error != sent.error
                && let Some(e) = &snap.error
            {
                out.push(e.clone());
            }
            for (now, before) in [
                (&snap.nodes, &mut sent.nodes),
                (&snap.sandboxes, &mut sent.sandboxes),
            ] {
                if now != before
                    && let Some(m) = now
                {
                    out.push(m.clone());
                }
                before.clone_from(now);
            }
            sent.error.clone_from(&snap.error);
            for m in out {
                if sink.send(Message::text(m.to_string())).await.is_err() {
                    return;
                }
            }
        }
        tokio::select! {
            changed = rx.changed() => if changed.is_err() { return },
            msg = source.next() => match msg {
                Some(Ok(Message::Close(_)) | Err(_)) | None => return,
                // The page sends nothing of meaning.
                Some(Ok(_)) => {}
            },
            _ = ping.tick() => {
                if sink.send(Message::Ping(Vec::new().into())).await.is_err() {
                    return;
                }
            }
            () = &mut ended => {
                socket::close(&mut sink, 4001, "signed out").await;
                return;
            }
        }
    }
}
