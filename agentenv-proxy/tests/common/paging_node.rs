//! A node stand-in that lists sandboxes and snapshots exactly as agentenv-node
//! does (`agentenv-node/src/api/model.rs`: `ListQuery::parse`, `parse_v1`
//! and `apply`, `metadata_filter`, `page`, `paginate`, `encode_token`;
//! `api/sandboxes.rs`: `list_v1`, `list_v2`; `api/snapshots.rs`: `list`):
//! newest first then by id (`/v2/sandboxes?order=asc`: oldest first, then
//! by id), filtered by `state`, `metadata`, `template` and `startedAfter`,
//! `limit` 0..100 (100 without one, 400 beyond), `nextToken` = URL-safe
//! base64 of `<RFC 3339 UTC, ms>__<id>`, and `x-next-token` only when more
//! items follow.

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
    /// The template the sandbox started from.
    pub template: &'static str,
    pub metadata: BTreeMap<String, String>,
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

/// The node's `rfc3339_ms`.
fn rfc3339_ms(s: &str) -> Option<u64> {
    let dt = OffsetDateTime::parse(s, &Rfc3339).ok()?;
    Some((dt.unix_timestamp_nanos() / 1_000_000) as u64)
}

fn decode_token(t: &str) -> Option<(u64, String)> {
    let raw = URL_SAFE.decode(t).ok()?;
    let s = String::from_utf8(raw).ok()?;
    let (ts, id) = s.split_once("__")?;
    Some((rfc3339_ms(ts)?, id.to_string()))
}

fn decode(s: &str) -> String {
    percent_encoding::percent_decode_str(&s.replace('+', " "))
        .decode_utf8_lossy()
        .into_owned()
}

/// The node's `query_pairs` (of repeated keys the last counts).
pub fn query_pairs(q: &str) -> BTreeMap<String, String> {
    q.split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (decode(k), decode(v))
        })
        .collect()
}

/// The node's `metadata_filter`: the `metadata` value (decoded once, with the
/// query) is `key=value` pairs joined by `&`, percent-encoded once more as a
/// whole, each key and value percent-encoded.
pub fn metadata_filter(
    pairs: &BTreeMap<String, String>,
) -> Result<BTreeMap<String, String>, String> {
    let mut out = BTreeMap::new();
    let Some(m) = pairs.get("metadata").filter(|m| !m.is_empty()) else {
        return Ok(out);
    };
    for pair in decode(m).split('&').filter(|p| !p.is_empty()) {
        let parts: Vec<&str> = pair.split('=').collect();
        let [k, v] = parts.as_slice() else {
            return Err(format!(
                "invalid metadata filter {pair:?}: use key=value pairs joined by '&', each key and value percent-encoded"
            ));
        };
        out.insert(decode(k), decode(v));
    }
    Ok(out)
}

/// The node's `ListQuery`.
#[derive(Debug, Default)]
struct ListQuery {
    state: Option<String>,
    metadata: BTreeMap<String, String>,
    template: Option<String>,
    started_after: Option<u64>,
    ascending: bool,
    limit: usize,
    after: Option<(u64, String)>,
}

impl ListQuery {
    /// The node's `ListQuery::parse`.
    fn parse(pairs: &BTreeMap<String, String>) -> Result<Self, String> {
        let mut out = ListQuery {
            limit: 100,
            ..Default::default()
        };
        if let Some(s) = pairs.get("state") {
            let states: Vec<&str> = s
                .split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .collect();
            for st in &states {
                if *st != "running" && *st != "paused" {
                    return Err(format!("invalid state {st:?}: use running, paused or both"));
                }
            }
            if states.len() == 1 {
                out.state = Some(states[0].to_string());
            }
        }
        out.metadata = metadata_filter(pairs)?;
        out.template = pairs.get("template").filter(|t| !t.is_empty()).cloned();
        if let Some(t) = pairs.get("startedAfter").filter(|t| !t.is_empty()) {
            out.started_after = Some(rfc3339_ms(t).ok_or_else(|| {
                format!(
                    "invalid startedAfter {t:?}: use an RFC 3339 time, e.g. 2024-01-01T00:00:00Z"
                )
            })?);
        }
        out.ascending = match pairs.get("order").map(String::as_str) {
            None | Some("") | Some("desc") => false,
            Some("asc") => true,
            Some(o) => return Err(format!("invalid order {o:?}: use asc or desc")),
        };
        (out.limit, out.after) = page_params(pairs)?;
        Ok(out)
    }

    /// The node's `ListQuery::parse_v1`.
    fn parse_v1(pairs: &BTreeMap<String, String>) -> Result<Self, String> {
        Ok(ListQuery {
            metadata: metadata_filter(pairs)?,
            limit: usize::MAX,
            ..Default::default()
        })
    }

    /// The node's `ListQuery::apply` over records sorted newest first.
    fn apply(&self, sorted: &[Record]) -> (Vec<Record>, Option<String>) {
        let mut matching: Vec<Record> = sorted
            .iter()
            .filter(|r| self.state.as_deref().is_none_or(|s| r.state == s))
            .filter(|r| {
                self.metadata
                    .iter()
                    .all(|(k, v)| r.metadata.get(k) == Some(v))
            })
            .filter(|r| self.template.as_deref().is_none_or(|t| r.template == t))
            .filter(|r| self.started_after.is_none_or(|ms| r.created_ms > ms))
            .cloned()
            .collect();
        if self.ascending {
            matching = sorted_asc(matching);
        }
        paginate(
            matching.into_iter(),
            self.after.as_ref(),
            self.limit,
            self.ascending,
        )
    }
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

/// The node's `paginate` over records sorted newest first (oldest first
/// with `ascending`), then by id.
fn paginate(
    sorted: impl Iterator<Item = Record>,
    after: Option<&(u64, String)>,
    limit: usize,
    ascending: bool,
) -> (Vec<Record>, Option<String>) {
    let mut page: Vec<Record> = sorted
        .filter(|r| match after {
            None => true,
            Some((ms, id)) => {
                let past = if ascending {
                    r.created_ms > *ms
                } else {
                    r.created_ms < *ms
                };
                past || (r.created_ms == *ms && r.id > *id)
            }
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
        "templateID": r.template, "alias": r.template, "sandboxID": r.id, "clientID": "",
        "startedAt": ms_rfc3339(r.created_ms), "endAt": ms_rfc3339(r.created_ms + 300_000),
        "cpuCount": 1, "memoryMB": 512, "diskSizeMB": 0, "metadata": r.metadata,
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
            let q = match ListQuery::parse_v1(&pairs) {
                Ok(q) => q,
                Err(m) => return bad_request(m),
            };
            let (all, _) = q.apply(sandboxes);
            let items: Vec<_> = all
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
        "/v2/sandboxes" => {
            let q = match ListQuery::parse(&pairs) {
                Ok(q) => q,
                Err(m) => return bad_request(m),
            };
            let (page, next) = q.apply(sandboxes);
            let items: Vec<_> = page.iter().map(sandbox_json).collect();
            json_reply(
                StatusCode::OK,
                serde_json::Value::from(items).to_string(),
                next,
            )
        }
        "/snapshots" => {
            let (limit, after) = match page_params(&pairs) {
                Ok(p) => p,
                Err(m) => return bad_request(m),
            };
            let (page, next) = paginate(snapshots.iter().cloned(), after.as_ref(), limit, false);
            let items: Vec<_> = page.iter().map(snapshot_json).collect();
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

/// Sorts as the node does for `order=asc`: oldest first, then by id.
pub fn sorted_asc(mut records: Vec<Record>) -> Vec<Record> {
    records.sort_by(|a, b| a.created_ms.cmp(&b.created_ms).then(a.id.cmp(&b.id)));
    records
}

/// A node holding `sandboxes` and `snapshots`, logging every request.
pub async fn paging_node(sandboxes: Vec<Record>, snapshots: Vec<Record>) -> (FakeNode, Log) {
    let sandboxes = Arc::new(sorted(sandboxes));
    let snapshots = Arc::new(sorted(snapshots));
    FakeNode::logging(move |seen| answer(&sandboxes, &snapshots, seen)).await
}
