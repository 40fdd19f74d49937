//! `GET /console/api/events`: live nodes and sandboxes over a WebSocket.
//!
//! One poller per gateway builds a snapshot every second (`GET /nodes`,
//! `GET /v2/sandboxes` page by page, each on its own, through the gateway's
//! own dispatch) while at least one page listens, and publishes it in a
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
/// How long one read of the nodes may take.
const NODES_WITHIN: Duration = Duration::from_secs(5);
/// How long one read of every sandbox may take.
const SANDBOXES_WITHIN: Duration = Duration::from_secs(10);
const NODES_LATE: &str =
    "the scheduler did not list the nodes within 5 s: check it (docs/troubleshooting.md)";
const SANDBOXES_LATE: &str = "the sandbox list took longer than 10 s: a node may be hung; its status in the nodes view says which (docs/troubleshooting.md)";

/// The messages of one snapshot, serialized; `None` until known. Each list
/// has its own error, replaced by the list when it is read again.
#[derive(Default, Clone, PartialEq, Eq)]
pub(crate) struct Snapshot {
    nodes: Option<Arc<str>>,
    sandboxes: Option<Arc<str>>,
    nodes_error: Option<Arc<str>>,
    sandboxes_error: Option<Arc<str>>,
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

/// Refreshes the snapshot while anyone listens: the nodes and the sandboxes
/// each on their own, so a hung node (which holds a sandbox list up to the
/// request timeout) does not hold up the nodes view, and each read gives up
/// after [`NODES_WITHIN`] or [`SANDBOXES_WITHIN`] with an error for its list.
async fn poll(console: Arc<Console>, gateway: Gateway, tx: watch::Sender<Arc<Snapshot>>) {
    let remote = SocketAddr::from(([127, 0, 0, 1], 0));
    let publish = |update: &dyn Fn(&mut Snapshot)| {
        tx.send_if_modified(|cur| {
            let mut next = Snapshot::clone(cur);
            update(&mut next);
            if **cur == next {
                return false;
            }
            *cur = Arc::new(next);
            true
        });
    };
    // Whether the poller should stop (no page listens); clears the hub's slot once.
    let done = || {
        let mut slot = console.events.tx.lock();
        if tx.receiver_count() == 0 {
            *slot = None;
            return true;
        }
        false
    };
    let nodes = async {
        loop {
            let read = tokio::time::timeout(NODES_WITHIN, nodes_part(&gateway, remote)).await;
            let read = read.unwrap_or_else(|_| Err(error("nodes", NODES_LATE)));
            publish(&|s| match &read {
                Ok(m) => (s.nodes, s.nodes_error) = (Some(m.0.clone()), m.1.clone()),
                Err(e) => s.nodes_error = Some(e.clone()),
            });
            tokio::time::sleep(EVERY).await;
            if done() {
                return;
            }
        }
    };
    let sandboxes = async {
        loop {
            let read =
                tokio::time::timeout(SANDBOXES_WITHIN, sandboxes_part(&gateway, remote)).await;
            let read = read.unwrap_or_else(|_| Err(error("sandboxes", SANDBOXES_LATE)));
            publish(&|s| match &read {
                Ok(m) => (s.sandboxes, s.sandboxes_error) = (Some(m.clone()), None),
                Err(e) => s.sandboxes_error = Some(e.clone()),
            });
            tokio::time::sleep(EVERY).await;
            if done() {
                return;
            }
        }
    };
    tokio::select! {
        () = nodes => {}
        () = sandboxes => {}
    }
}

/// An error message for the page about one list.
fn error(list: &str, message: &str) -> Arc<str> {
    serde_json::json!({"type": "error", "list": list, "message": message})
        .to_string()
        .into()
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

/// The nodes message, and the error that goes with an empty list.
async fn nodes_part(
    gateway: &Gateway,
    remote: SocketAddr,
) -> Result<(Arc<str>, Option<Arc<str>>), Arc<str>> {
    let (items, _) = list(gateway, remote, "/nodes")
        .await
        .map_err(|e| error("nodes", &e))?;
    let empty = items.is_empty().then(|| error("nodes", NO_NODES));
    Ok((message("nodes", items, None), empty))
}

/// The sandboxes message: every page of the cluster list, at most [`MAX_SANDBOXES`].
async fn sandboxes_part(gateway: &Gateway, remote: SocketAddr) -> Result<Arc<str>, Arc<str>> {
    let mut items = Vec::new();
    let mut next: Option<String> = None;
    loop {
        let path = match &next {
            Some(t) => format!(
                "/v2/sandboxes?limit=100&nextToken={}",
                percent_encoding::utf8_percent_encode(t, percent_encoding::NON_ALPHANUMERIC)
            ),
            None => "/v2/sandboxes?limit=100".to_string(),
        };
        let (page, token) = list(gateway, remote, &path)
            .await
            .map_err(|e| error("sandboxes", &e))?;
        items.extend(page);
        if items.len() >= MAX_SANDBOXES {
            let truncated = items.len() > MAX_SANDBOXES || token.is_some();
            items.truncate(MAX_SANDBOXES);
            return Ok(message("sandboxes", items, Some(truncated)));
        }
        match token {
            Some(t) if next.as_deref() != Some(t.as_str()) => next = Some(t),
            _ => return Ok(message("sandboxes", items, Some(false))),
        }
    }
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
            // Per list: its data when it changed (which clears its error on the
            // page), then its error when that changed.
            for (now, before) in [
                (&snap.nodes, &mut sent.nodes),
                (&snap.nodes_error, &mut sent.nodes_error),
                (&snap.sandboxes, &mut sent.sandboxes),
                (&snap.sandboxes_error, &mut sent.sandboxes_error),
            ] {
                if now != before
                    && let Some(m) = now
                {
                    out.push(m.clone());
                }
                before.clone_from(now);
            }
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
