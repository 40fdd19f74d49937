//! `POST /nodes/{node_id}/move`: the paused sandboxes of a node move to other nodes
//! through the shared snapshot repository, one at a time, with progress streamed back as
//! one JSON object per line.
//!
//! For each sandbox: the node that has it exports it (its files published, the sandbox
//! marked moving there), a ready node takes it over (import), the scheduler records the
//! new owner, the old node deletes its copy, and the snapshot that carried it is deleted.
//! When the import fails the move is cancelled and the sandbox stays where it was,
//! paused. Running sandboxes are not moved: pause them first (or let their timeouts
//! pause them).
//!
//! Lines: `{"event":"start","nodeID":…,"sandboxes":[…]}`, then per sandbox
//! `{"event":"moved","sandboxID":…,"to":…,"ms":…}` or
//! `{"event":"failed","sandboxID":…,"message":…}`, and last
//! `{"event":"done","moved":n,"failed":m}` (or `{"event":"error","message":…}` when
//! nothing could be moved at all).

use std::net::SocketAddr;
use std::time::Duration;

use agentenv_core::proto::scheduler_v1 as pb;
use bytes::Bytes;
use futures::StreamExt;
use http::header::{CONTENT_LENGTH, CONTENT_TYPE, HeaderValue};
use http::{HeaderMap, Method, Request, Response, StatusCode};
use http_body_util::BodyExt;
use serde::Deserialize;
use tokio::time::Instant;

use super::lists::fanout_headers;
use super::{Gateway, scheduler_error};
use crate::body::{GatewayBody, boxed, empty, error_response, full};
use crate::forward::upstream_uri;

/// Largest answer of a node this reads (an export, a list page).
const ANSWER_CAP: usize = 4 << 20;
/// How long one step of one sandbox's move may take (an export of a large layer).
const STEP_TIMEOUT: Duration = Duration::from_secs(600);
/// Most sandboxes one request moves.
const MAX_MOVE: usize = 10_000;

/// `POST /nodes/{node_id}/move` body (all optional).
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct MoveBody {
    /// Only these sandboxes (default: every paused sandbox of the node).
    #[serde(rename = "sandboxIDs")]
    sandbox_ids: Option<Vec<String>>,
    /// Only to this node (default: the least loaded ready node).
    #[serde(rename = "targetNodeID")]
    target_node_id: Option<String>,
}

impl Gateway {
    /// Moves the paused sandboxes of `node_id` (see the module docs).
    pub(super) async fn move_node(
        &self,
        req: Request<GatewayBody>,
        remote: SocketAddr,
        node_id: &str,
        deadline: Instant,
    ) -> Response<GatewayBody> {
        let headers = fanout_headers(&req, remote);
        let body = match tokio::time::timeout_at(deadline, req.into_body().collect()).await {
            Ok(Ok(b)) => b.to_bytes(),
            Ok(Err(_)) => {
                return error_response(StatusCode::BAD_REQUEST, "reading the body failed");
            }
            Err(_) => {
                return error_response(
                    StatusCode::REQUEST_TIMEOUT,
                    "the body did not arrive in time",
                );
            }
        };
        if body.len() > ANSWER_CAP {
            return error_response(StatusCode::PAYLOAD_TOO_LARGE, "the body is too large");
        }
        let opts: MoveBody = if body.iter().all(u8::is_ascii_whitespace) {
            MoveBody::default()
        } else {
            match serde_json::from_slice(&body) {
                Ok(b) => b,
                Err(e) => {
                    return error_response(
                        StatusCode::BAD_REQUEST,
                        &format!(
                            "body: {e}; send {{}} or {{\"sandboxIDs\":[…],\"targetNodeID\":\"…\"}}"
                        ),
                    );
                }
            }
        };
        if let Some(bad) = opts
            .sandbox_ids
            .iter()
            .flatten()
            .find(|id| !is_sandbox_id(id))
        {
            return error_response(
                StatusCode::BAD_REQUEST,
                &format!(
                    "sandboxIDs: {bad:?} is not a sandbox ID (letters, digits and '-', at most 64)"
                ),
            );
        }
        let nodes = match self
            .rpc(
                "ListObservedNodes",
                deadline,
                self.inner.scheduler.list_observed_nodes(""),
            )
            .await
        {
            Ok(n) => n,
            Err(status) => return scheduler_error(&status),
        };
        let Some(source) = nodes.iter().find(|n| n.node_id == node_id).cloned() else {
            return error_response(
                StatusCode::NOT_FOUND,
                &format!("node {node_id} is not reporting to the scheduler: check `aenv node ls`"),
            );
        };
        let mut targets: Vec<pb::ObservedNode> = nodes
            .into_iter()
            .filter(|n| n.node_id != node_id && is_ready(n))
            .filter(|n| opts.target_node_id.as_ref().is_none_or(|t| *t == n.node_id))
            .collect();
        if targets.is_empty() {
            let msg = match &opts.target_node_id {
                Some(t) => format!("node {t} is not a ready node other than {node_id}"),
                None => format!(
                    "no ready node other than {node_id} can take its sandboxes: add or undrain a node"
                ),
            };
            return error_response(StatusCode::CONFLICT, &msg);
        }
        targets.sort_by_key(load);
        let (tx, rx) = futures::channel::mpsc::unbounded::<Bytes>();
        let this = self.clone();
        tokio::spawn(async move {
            let mover = Mover {
                gw: &this,
                headers,
                source,
                targets,
                tx,
            };
            mover.run(opts.sandbox_ids).await;
        });
        let stream = rx.map(|b| Ok::<_, crate::body::BoxError>(hyper::body::Frame::data(b)));
        let mut resp = Response::new(boxed(http_body_util::StreamBody::new(stream)));
        resp.headers_mut().insert(
            CONTENT_TYPE,
            HeaderValue::from_static("application/x-ndjson"),
        );
        resp
    }
}

/// Whether `id` can be a sandbox ID: it goes into node paths, so nothing else passes.
fn is_sandbox_id(id: &str) -> bool {
    let id = id.trim();
    !id.is_empty() && id.len() <= 64 && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
}

/// A node the scheduler sees ready (and not draining).
fn is_ready(n: &pb::ObservedNode) -> bool {
    n.snapshot
        .as_ref()
        .is_some_and(|s| s.status == pb::NodeStatus::Ready as i32)
}

/// How busy a node is: its running and paused sandboxes.
fn load(n: &pb::ObservedNode) -> u64 {
    n.snapshot.as_ref().map_or(u64::MAX, |s| {
        u64::from(s.sandbox_count) + u64::from(s.paused_sandbox_count)
    })
}

/// One move request at work.
struct Mover<'a> {
    gw: &'a Gateway,
    headers: HeaderMap,
    source: pb::ObservedNode,
    /// Ready nodes, least loaded first.
    targets: Vec<pb::ObservedNode>,
    tx: futures::channel::mpsc::UnboundedSender<Bytes>,
}

/// A step of a move that did not work, said as the line reports it.
type StepError = String;

impl Mover<'_> {
    fn say(&self, v: serde_json::Value) {
        let mut line = v.to_string().into_bytes();
        line.push(b'\n');
        let _ = self.tx.unbounded_send(Bytes::from(line));
    }

    async fn run(self, only: Option<Vec<String>>) {
        let ids = match only {
            Some(ids) => ids
                .into_iter()
                .map(|s| s.trim().to_ascii_lowercase())
                .collect(),
            None => match self.paused_sandboxes().await {
                Ok(ids) => ids,
                Err(e) => {
                    self.say(serde_json::json!({"event": "error", "message": e}));
                    return;
                }
            },
        };
        let ids: Vec<String> = ids.into_iter().take(MAX_MOVE).collect();
        self.say(serde_json::json!({
            "event": "start",
            "nodeID": self.source.node_id,
            "sandboxes": ids,
        }));
        let (mut moved, mut failed) = (0u64, 0u64);
        for (i, id) in ids.iter().enumerate() {
            let started = std::time::Instant::now();
            let target = self.targets[i % self.targets.len()].clone();
            match self.move_one(id, &target).await {
                Ok(()) => {
                    moved += 1;
                    self.say(serde_json::json!({
                        "event": "moved",
                        "sandboxID": id,
                        "to": target.node_id,
                        "ms": started.elapsed().as_millis() as u64,
                    }));
                }
                Err(message) => {
                    failed += 1;
                    tracing::warn!(sandbox = %id, from = %self.source.node_id, to = %target.node_id, %message, "moving a sandbox failed");
                    self.say(serde_json::json!({
                        "event": "failed",
                        "sandboxID": id,
                        "message": message,
                    }));
                }
            }
        }
        self.say(serde_json::json!({"event": "done", "moved": moved, "failed": failed}));
    }

    /// The ids of the source node's paused sandboxes, every page.
    async fn paused_sandboxes(&self) -> Result<Vec<String>, StepError> {
        let mut ids = Vec::new();
        let mut token: Option<String> = None;
        loop {
            let mut query = "state=paused&limit=100".to_string();
            if let Some(t) = &token {
                query.push_str("&nextToken=");
                query.push_str(
                    &percent_encoding::utf8_percent_encode(t, percent_encoding::NON_ALPHANUMERIC)
                        .to_string(),
                );
            }
            let (status, headers, body) = self
                .call(
                    &self.source.endpoint,
                    Method::GET,
                    "/v2/sandboxes",
                    Some(&query),
                    None,
                )
                .await?;
            if status != StatusCode::OK {
                return Err(format!(
                    "listing the paused sandboxes of {}: {}",
                    self.source.node_id,
                    node_message(status, &body)
                ));
            }
            let page: Vec<serde_json::Value> = serde_json::from_slice(&body).map_err(|e| {
                format!(
                    "listing the paused sandboxes of {}: {e}",
                    self.source.node_id
                )
            })?;
            ids.extend(
                page.iter()
                    .filter_map(|s| s["sandboxID"].as_str())
                    .map(str::to_string),
            );
            token = headers
                .get("x-next-token")
                .and_then(|v| v.to_str().ok())
                .filter(|t| !t.is_empty())
                .map(str::to_string);
            if token.is_none() || ids.len() >= MAX_MOVE {
                return Ok(ids);
            }
        }
    }

    /// Moves sandbox `id` to `target`.
    async fn move_one(&self, id: &str, target: &pb::ObservedNode) -> Result<(), StepError> {
        let src = &self.source.endpoint;
        let (status, _, export) = self
            .call(
                src,
                Method::POST,
                &format!("/sandboxes/{id}/export"),
                None,
                Some(Bytes::new()),
            )
            .await?;
        if status != StatusCode::CREATED {
            return Err(format!(
                "exporting it from {}: {}",
                self.source.node_id,
                node_message(status, &export)
            ));
        }
        let snapshot = serde_json::from_slice::<serde_json::Value>(&export)
            .ok()
            .and_then(|v| v["snapshotID"].as_str().map(str::to_string))
            .ok_or_else(|| {
                format!(
                    "exporting it from {}: the answer names no snapshot",
                    self.source.node_id
                )
            })?;
        let imported = self
            .call(
                &target.endpoint,
                Method::POST,
                &format!("/sandboxes/{id}/import"),
                None,
                Some(export),
            )
            .await;
        let import_err = match imported {
            Ok((StatusCode::CREATED, _, _)) => None,
            Ok((status, _, body)) => Some(node_message(status, &body)),
            Err(e) => Some(e),
        };
        if let Some(why) = import_err {
            let cancelled = self
                .call(
                    src,
                    Method::DELETE,
                    &format!("/sandboxes/{id}/export"),
                    None,
                    None,
                )
                .await;
            let stays = match cancelled {
                Ok((StatusCode::OK, _, _)) => {
                    format!("it stays on {}, paused", self.source.node_id)
                }
                _ => format!(
                    "cancel the move with DELETE /sandboxes/{id}/export on {}",
                    self.source.node_id
                ),
            };
            self.delete_snapshot(&target.endpoint, &snapshot).await;
            return Err(format!(
                "{} did not take it ({why}); {stays}",
                target.node_id
            ));
        }
        let node = pb::Node {
            node_id: target.node_id.clone(),
            endpoint: target.endpoint.clone(),
        };
        self.record(id, &node).await;
        let (status, _, body) = self
            .call(src, Method::DELETE, &format!("/sandboxes/{id}"), None, None)
            .await?;
        if status != StatusCode::NO_CONTENT && status != StatusCode::NOT_FOUND {
            return Err(format!(
                "it runs on {} now, but {} did not delete its copy ({}): delete it there",
                target.node_id,
                self.source.node_id,
                node_message(status, &body)
            ));
        }
        // A heartbeat of the old node between the two may have taken the binding back.
        self.record(id, &node).await;
        self.delete_snapshot(&target.endpoint, &snapshot).await;
        Ok(())
    }

    async fn record(&self, id: &str, node: &pb::Node) {
        let deadline = Instant::now() + self.gw.inner.opts.request_timeout;
        self.gw.keep_route(id, node);
        let call = self.gw.inner.scheduler.record_assignment(id, node.clone());
        if let Err(status) = self.gw.rpc("RecordAssignment", deadline, call).await {
            tracing::warn!(sandbox = %id, node = %node.node_id, error = %status.message(), "recording a moved sandbox failed; the node's next heartbeat records it");
        }
    }

    async fn delete_snapshot(&self, endpoint: &str, snapshot: &str) {
        match self
            .call(
                endpoint,
                Method::DELETE,
                &format!("/templates/{snapshot}"),
                None,
                None,
            )
            .await
        {
            Ok((s, _, _)) if s.is_success() || s == StatusCode::NOT_FOUND => {}
            Ok((s, _, body)) => {
                tracing::warn!(snapshot, reason = %node_message(s, &body), "deleting a move's snapshot failed")
            }
            Err(e) => tracing::warn!(snapshot, reason = %e, "deleting a move's snapshot failed"),
        }
    }

    /// One request to a node; its status, headers and (bounded) body.
    async fn call(
        &self,
        endpoint: &str,
        method: Method,
        path: &str,
        query: Option<&str>,
        body: Option<Bytes>,
    ) -> Result<(StatusCode, HeaderMap, Bytes), StepError> {
        let uri = upstream_uri(endpoint, path, query)
            .map_err(|_| format!("the node endpoint {endpoint} is not a valid URI"))?;
        let mut req = Request::new(match &body {
            Some(b) => full(b.clone()),
            None => empty(),
        });
        *req.method_mut() = method;
        *req.uri_mut() = uri;
        *req.headers_mut() = self.headers.clone();
        if let Some(b) = &body {
            req.headers_mut()
                .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
            req.headers_mut()
                .insert(CONTENT_LENGTH, HeaderValue::from(b.len()));
        }
        let answer = async {
            let resp = self.gw.pool.send(req).await.map_err(|e| e.to_string())?;
            let (parts, body) = resp.into_parts();
            let limited = http_body_util::Limited::new(body, ANSWER_CAP);
            let bytes = limited
                .collect()
                .await
                .map_err(|e| format!("reading the answer: {e}"))?
                .to_bytes();
            Ok::<_, String>((parts.status, parts.headers, bytes))
        };
        tokio::time::timeout(STEP_TIMEOUT, answer)
            .await
            .map_err(|_| {
                format!(
                    "{endpoint} did not answer within {} s",
                    STEP_TIMEOUT.as_secs()
                )
            })?
            .map_err(|e| format!("{endpoint}: {e}"))
    }
}

/// A node's error answer as a sentence: its JSON `message`, else the status.
fn node_message(status: StatusCode, body: &[u8]) -> String {
    serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v["message"].as_str().map(str::to_string))
        .map(|m| format!("{} {m}", status.as_u16()))
        .unwrap_or_else(|| status.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_plain_ids_reach_node_paths() {
        assert!(is_sandbox_id("0b1e5c3a-1f2d-4c5b-9a8e-7d6c5b4a3f21"));
        assert!(is_sandbox_id(" abc-1 "));
        for bad in [
            "",
            "x/../../templates/t",
            "a?b=c",
            "a#b",
            "a%2Fb",
            "a b",
            &"a".repeat(65),
        ] {
            assert!(!is_sandbox_id(bad), "{bad:?}");
        }
    }
}
