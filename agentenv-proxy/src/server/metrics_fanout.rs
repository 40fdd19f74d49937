//! `GET /sandboxes/metrics?sandbox_ids=…` across the cluster: the scheduler says which
//! node has each sandbox; each node is asked for the latest metrics of its own sandboxes
//! and the answers are merged into one `{"sandboxes": {<id>: <metric>}}`. A sandbox no
//! node has is left out (as a node leaves out one it does not have); a node that does not
//! answer is left out and named in `x-agentenv-missing-nodes`.

use std::collections::BTreeMap;
use std::net::SocketAddr;

use agentenv_core::proto::scheduler_v1 as pb;
use futures::future::join_all;
use http::header::HeaderValue;
use http::{Request, Response, StatusCode};
use tokio::time::Instant;
use tonic::Code;

use super::lists::fanout_headers;
use super::{Gateway, LIST_BODY_CAP, scheduler_error};
use crate::body::{GatewayBody, boxed, concat, empty, error_response, json_response, read_prefix};
use crate::cluster_list;
use crate::forward::upstream_uri;
use crate::routing::MISSING_NODES_HEADER;

/// Most sandboxes one request may ask about.
pub const MAX_METRICS_IDS: usize = 100;

impl Gateway {
    /// `GET /sandboxes/metrics?sandbox_ids=a,b`: the latest metrics of each sandbox, from
    /// the node that has it.
    pub(super) async fn sandbox_metrics(
        &self,
        req: Request<GatewayBody>,
        remote: SocketAddr,
        deadline: Instant,
    ) -> Response<GatewayBody> {
        let ids = match requested_ids(req.uri().query().unwrap_or("")) {
            Ok(ids) => ids,
            Err(msg) => return error_response(StatusCode::BAD_REQUEST, &msg),
        };
        let lookups = join_all(
            ids.iter()
                .map(|id| self.rpc("LookupNode", deadline, self.inner.scheduler.lookup_node(id))),
        )
        .await;
        let mut by_node: BTreeMap<String, (pb::Node, Vec<&str>)> = BTreeMap::new();
        for (id, found) in ids.iter().zip(lookups) {
            match found {
                Ok(node) => {
                    by_node
                        .entry(node.node_id.clone())
                        .or_insert_with(|| (node, Vec::new()))
                        .1
                        .push(id);
                }
                Err(status) if status.code() == Code::NotFound => {}
                Err(status) => return scheduler_error(&status),
            }
        }
        let headers = fanout_headers(&req, remote);
        let path = req.uri().path();
        let asked = join_all(by_node.values().map(|(node, ids)| {
            let headers = headers.clone();
            async move {
                let got =
                    tokio::time::timeout_at(deadline, self.node_metrics(node, path, ids, headers))
                        .await
                        .unwrap_or_else(|_| Err("no answer within the request timeout".into()));
                (node, got)
            }
        }))
        .await;
        let mut merged = serde_json::Map::new();
        let mut missing = Vec::new();
        for (node, got) in asked {
            match got {
                Ok(Answer::Metrics(m)) => merged.extend(m),
                Ok(Answer::Refused(status)) => {
                    return error_response(
                        status,
                        status.canonical_reason().unwrap_or("client error"),
                    );
                }
                Err(why) => {
                    tracing::warn!(node_id = %node.node_id, reason = %why, "sandbox metrics: node did not answer; answering without it");
                    missing.push(node.node_id.as_str());
                }
            }
        }
        let mut resp = json_response(StatusCode::OK, &serde_json::json!({ "sandboxes": merged }));
        if !missing.is_empty()
            && let Ok(v) = HeaderValue::from_str(&missing.join(","))
        {
            resp.headers_mut().insert(MISSING_NODES_HEADER, v);
        }
        resp
    }

    /// The metrics `node` has of `ids`.
    async fn node_metrics(
        &self,
        node: &pb::Node,
        path: &str,
        ids: &[&str],
        headers: http::HeaderMap,
    ) -> Result<Answer, String> {
        let query = format!("sandbox_ids={}", ids.join(","));
        let uri = upstream_uri(&node.endpoint, path, Some(&query))
            .map_err(|_| "its endpoint is not a valid URI".to_string())?;
        let mut up = Request::new(empty());
        *up.uri_mut() = uri;
        *up.headers_mut() = headers;
        let resp = self.pool.send(up).await.map_err(|e| e.to_string())?;
        let status = resp.status();
        if status.is_client_error() {
            return Ok(Answer::Refused(status));
        }
        if !status.is_success() {
            return Err(format!("it answered {status}"));
        }
        let (frames, _, rest) = read_prefix(boxed(resp.into_body()), LIST_BODY_CAP)
            .await
            .map_err(|e| format!("reading its answer failed: {e}"))?;
        if rest.is_some() {
            return Err(format!("its answer is larger than {LIST_BODY_CAP} bytes"));
        }
        let body: serde_json::Value = serde_json::from_slice(&concat(&frames))
            .map_err(|e| format!("its answer is not JSON: {e}"))?;
        let map = body
            .get("sandboxes")
            .and_then(|s| s.as_object())
            .cloned()
            .ok_or_else(|| "its answer has no sandboxes object".to_string())?;
        // Only the ids this node was asked about.
        Ok(Answer::Metrics(
            map.into_iter()
                .filter(|(k, _)| ids.contains(&k.as_str()))
                .collect(),
        ))
    }
}

/// What a node answered.
enum Answer {
    Metrics(serde_json::Map<String, serde_json::Value>),
    /// The node refused the request (4xx): the whole request fails with it.
    Refused(StatusCode),
}

/// The sandbox ids of the query: `sandbox_ids`, comma-separated (or repeated), each a
/// UUID, at most [`MAX_METRICS_IDS`], without repeats.
fn requested_ids(query: &str) -> Result<Vec<String>, String> {
    let mut ids: Vec<String> = Vec::new();
    for (_, v) in cluster_list::parse_query(query)
        .into_iter()
        .filter(|(k, _)| k == "sandbox_ids")
    {
        for id in v.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let id = id.to_ascii_lowercase();
            if !is_uuid_shaped(&id) {
                return Err(format!(
                    "invalid sandbox id {id:?} in sandbox_ids: sandbox ids are UUIDs"
                ));
            }
            if !ids.contains(&id) {
                ids.push(id);
            }
        }
    }
    if ids.is_empty() {
        return Err("sandbox_ids is required: a comma-separated list of sandbox ids".into());
    }
    if ids.len() > MAX_METRICS_IDS {
        return Err(format!(
            "sandbox_ids names {} sandboxes: ask about at most {MAX_METRICS_IDS} at once",
            ids.len()
        ));
    }
    Ok(ids)
}

fn is_uuid_shaped(id: &str) -> bool {
    id.len() == 36
        && id.bytes().enumerate().all(|(i, b)| match i {
            8 | 13 | 18 | 23 => b == b'-',
            _ => b.is_ascii_hexdigit(),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: &str = "01936f8e-72f5-7000-8000-000000000001";
    const B: &str = "01936f8e-72f5-7000-8000-000000000002";

    #[test]
    fn ids_are_comma_separated_or_repeated_uuids_without_repeats() {
        assert_eq!(
            requested_ids(&format!("sandbox_ids={A}%2C{B}")).unwrap(),
            [A, B]
        );
        assert_eq!(
            requested_ids(&format!("sandbox_ids={A}&sandbox_ids={B},{A}")).unwrap(),
            [A, B]
        );
        assert!(requested_ids("").unwrap_err().contains("required"));
        assert!(
            requested_ids("sandbox_ids=x")
                .unwrap_err()
                .contains("UUIDs")
        );
        let many: Vec<String> = (0..=MAX_METRICS_IDS)
            .map(|i| format!("01936f8e-72f5-7000-8000-{i:012}"))
            .collect();
        assert!(
            requested_ids(&format!("sandbox_ids={}", many.join(",")))
                .unwrap_err()
                .contains("at most 100")
        );
    }
}
