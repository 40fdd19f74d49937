//! A node stand-in that lists sandboxes and snapshots exactly as agentenv-node
//! does (`agentenv-node/src/api/model.rs`: `page`, `paginate`, `encode_token`;
//! `api/sandboxes.rs`: `list_v1`, `list_v2`; `api/snapshots.rs`: `list`):
//! newest first then by id, `limit` 0..100 (100 without one, 400 beyond),
//! `nextToken` = URL-safe base64 of `<RFC 3339 UTC, ms>__<id>`, and
//! `x-next-token` only when more items follow.

use std::collections::BTreeMap;
use std::sync::Arc;

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE;
use http::{Response, StatusCode};
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;

use super::{FakeNode, Log, Seen};
use agentenv_proxy::body::{GatewayBody, full};

/// One record of the stand-in: a sandbox or a snapshot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    pub id: String,
    pub created_ms: u64,
    /// `running` or `paused`.
    pub state: &'static str,
}

/// The node's `ms_rfc3339`.
pub fn ms_rfc3339(ms: u64) -> String {
    OffsetDateTime::from_unix_timestamp_nanos(i128::from(ms) * 1_000_000)
        .unwrap()
        .format(&Rfc3339)
        .unwrap()
}

/// The node's `encode_token`.
pub fn encode_token(created_ms: u64, id: &str) -> String {
    URL_SAFE.encode(format!("{}__{id}", ms_rfc3339(created_ms)))
}

fn decode_token(t: &str) -> Option<(u64, String)> {
    let raw = URL_SAFE.decode(t).ok()?;
    let s = String::from_utf8(raw).ok()?;
    let (ts, id) = s.split_once("__")?;
    let dt = OffsetDateTime::parse(ts, &Rfc3339).ok()?;
    Some((
        (dt.unix_timestamp_nanos() / 1_000_000) as u64,
        id.to_string(),
    ))
}

/// The node's `query_pairs`.
fn query_pairs(q: &str) -> BTreeMap<String, String> {
    let decode = |s: &str| {
        percent_encoding::percent_decode_str(&s.replace('+', " "))
            .decode_utf8_lossy()
            .into_owned()
    };
    q.split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (decode(k), decode(v))
        })
        .collect()
}

/// The node's `page`: `limit` and the cursor of `nextToken`.
fn page_params(pairs: &BTreeMap<String, String>) -> Result<(usize, Option<(u64, String)>), String> {
    let limit = match pairs.get("limit") {
        Some(l) => {
            let n: usize = l
                .parse()
                .map_err(|_| format!("invalid limit {l:?}: use 0..100"))?;
            if n > 100 {
                return Err(format!("invalid limit {n}: use 0..100"));
            }
            n
        }
        None => 100,
    };
    let after = match pairs.get("nextToken").filter(|t| !t.is_empty()) {
        Some(t) => Some(decode_token(t).ok_or_else(|| format!("invalid nextToken {t:?}"))?),
        None => None,
    };
    Ok((limit, after))
}

/// The node's `paginate` over records sorted newest first, then by id.
fn paginate(
    sorted: impl Iterator<Item = Record>,
    after: Option<&(u64, String)>,
    limit: usize,
) -> (Vec<Record>, Option<String>) {
    let mut page: Vec<Record> = sorted
        .filter(|r| match after {
            None => true,
            Some((ms, id)) => r.created_ms < *ms || (r.created_ms == *ms && r.id > *id),
        })
        .collect();
    let more = page.len() > limit;
    page.truncate(limit);
    let next = if more {
        page.last().map(|r| encode_token(r.created_ms, &r.id))
    } else {
        None
    };
    (page, next)
}

fn sandbox_json(r: &Record) -> serde_json::Value {
    serde_json::json!({
        "templateID": "base", "alias": "base", "sandboxID": r.id, "clientID": "",
        "startedAt": ms_rfc3339(r.created_ms), "endAt": ms_rfc3339(r.created_ms + 300_000),
        "cpuCount": 1, "memoryMB": 512, "diskSizeMB": 0, "metadata": {},
        "state": r.state, "envdVersion": "0.2.0",
    })
}

fn snapshot_json(r: &Record) -> serde_json::Value {
    serde_json::json!({
        "snapshotID": r.id, "names": [], "cpuCount": 1, "memoryMB": 512, "diskSizeMB": 0,
        "createdAt": ms_rfc3339(r.created_ms), "updatedAt": ms_rfc3339(r.created_ms),
    })
}

fn json_reply(status: StatusCode, body: String, next: Option<String>) -> Response<GatewayBody> {
    let mut resp = Response::new(full(body));
    *resp.status_mut() = status;
    resp.headers_mut()
        .insert("content-type", "application/json".parse().unwrap());
    if let Some(t) = next {
        resp.headers_mut()
            .insert("x-next-token", t.parse().unwrap());
    }
    resp
}

fn bad_request(message: String) -> Response<GatewayBody> {
    let body = serde_json::json!({"code": 400, "message": message}).to_string();
    json_reply(StatusCode::BAD_REQUEST, body, None)
}

/// Answers one request as the node's list routes do.
fn answer(sandboxes: &[Record], snapshots: &[Record], seen: &Seen) -> Response<GatewayBody> {
    let (path, query) = seen.uri.split_once('?').unwrap_or((&seen.uri, ""));
    let pairs = query_pairs(query);
    match path {
        "/sandboxes" => {
            let items: Vec<_> = sandboxes
                .iter()
                .filter(|r| r.state == "running")
                .map(sandbox_json)
                .collect();
            json_reply(
                StatusCode::OK,
                serde_json::Value::from(items).to_string(),
                None,
            )
        }
        "/v2/sandboxes" | "/snapshots" => {
            let (limit, after) = match page_params(&pairs) {
                Ok(p) => p,
                Err(m) => return bad_request(m),
            };
            let (records, render): (&[Record], fn(&Record) -> serde_json::Value) =
                if path == "/snapshots" {
                    (snapshots, snapshot_json)
                } else {
                    (sandboxes, sandbox_json)
                };
            let state = pairs.get("state").cloned();
            let matching = records
                .iter()
                .filter(|r| {
                    state
                        .as_deref()
                        .is_none_or(|s| s.split(',').any(|s| s == r.state))
                })
                .cloned();
            let (page, next) = paginate(matching, after.as_ref(), limit);
            let items: Vec<_> = page.iter().map(render).collect();
            json_reply(
                StatusCode::OK,
                serde_json::Value::from(items).to_string(),
                next,
            )
        }
        _ => json_reply(StatusCode::NOT_FOUND, "{}".into(), None),
    }
}

/// Sorts as the node does: newest first, then by id.
pub fn sorted(mut records: Vec<Record>) -> Vec<Record> {
    records.sort_by(|a, b| b.created_ms.cmp(&a.created_ms).then(a.id.cmp(&b.id)));
    records
}

/// A node holding `sandboxes` and `snapshots`, logging every request.
pub async fn paging_node(sandboxes: Vec<Record>, snapshots: Vec<Record>) -> (FakeNode, Log) {
    let sandboxes = Arc::new(sorted(sandboxes));
    let snapshots = Arc::new(sorted(snapshots));
    FakeNode::logging(move |seen| answer(&sandboxes, &snapshots, seen)).await
}
