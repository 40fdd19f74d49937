//! `GET /sandboxes/{id}/logs` and `GET /v2/sandboxes/{id}/logs`: a sandbox's logs (its
//! agent's output, its template's start command, the node's lifecycle events), from the
//! node's log book (see [`crate::observe`]).

use http::{Request, StatusCode};
use hyper::body::Incoming;
use serde::Serialize;

use super::ApiState;
use super::body::{json_response, query_pairs};
use super::error::{Reply, bad_request};
use crate::clock::ms_rfc3339;
use crate::ids::parse_sandbox_id;
use crate::observe::{Level, LogEntry, LogQuery};

/// Entries a request gets unless it asks for fewer (the SDKs' default), and the most.
pub(super) const MAX_LIMIT: usize = 1000;
/// Longest `search` string, in bytes.
pub(super) const MAX_SEARCH: usize = 256;

/// The `SandboxLogEntry` model.
#[derive(Debug, Serialize)]
struct LogEntryJson<'a> {
    timestamp: String,
    message: &'a str,
    level: &'static str,
    fields: &'a std::collections::BTreeMap<String, String>,
}

/// The `SandboxLog` model (v1).
#[derive(Debug, Serialize)]
struct LogLineJson<'a> {
    timestamp: String,
    line: &'a str,
}

fn entry_json(e: &LogEntry) -> LogEntryJson<'_> {
    LogEntryJson {
        timestamp: ms_rfc3339(e.ts),
        message: &e.message,
        level: e.level.as_str(),
        fields: &e.fields,
    }
}

/// The query of a logs request: v1 takes `start` (ms) and `limit`; v2 `cursor` (ms),
/// `limit`, `direction` (`forward`|`backward`), `level` (the lowest returned) and
/// `search` (a case-sensitive substring). Errors are messages for a 400.
pub(super) fn parse_query(query: &str, v2: bool) -> Result<LogQuery, String> {
    let pairs = query_pairs(query);
    let get = |k: &str| pairs.get(k).map(|v| v.trim()).filter(|v| !v.is_empty());
    let shown = |v: &str| v.chars().take(40).collect::<String>();
    let mut q = LogQuery {
        limit: MAX_LIMIT,
        ..LogQuery::default()
    };
    if let Some(v) = get("limit") {
        q.limit = v
            .parse::<usize>()
            .ok()
            .filter(|n| *n <= MAX_LIMIT)
            .ok_or_else(|| format!("invalid limit {:?}: use 0 to {MAX_LIMIT}", shown(v)))?;
    }
    let cursor_key = if v2 { "cursor" } else { "start" };
    if let Some(v) = get(cursor_key) {
        q.cursor_ms = Some(v.parse::<u64>().map_err(|_| {
            format!(
                "invalid {cursor_key} {:?}: use a time in milliseconds since the epoch, e.g. {cursor_key}=1704067200000",
                shown(v)
            )
        })?);
    }
    if !v2 {
        return Ok(q);
    }
    if let Some(v) = get("direction") {
        q.backward = match v {
            "forward" => false,
            "backward" => true,
            other => {
                return Err(format!(
                    "invalid direction {:?}: use forward or backward",
                    shown(other)
                ));
            }
        };
    }
    if let Some(v) = get("level") {
        q.min_level = v.parse::<Level>().map_err(|_| {
            format!(
                "invalid level {:?}: use debug, info, warn or error",
                shown(v)
            )
        })?;
    }
    if let Some(v) = pairs.get("search").filter(|v| !v.is_empty()) {
        if v.len() > MAX_SEARCH {
            return Err(format!(
                "search is {} bytes: use at most {MAX_SEARCH}",
                v.len()
            ));
        }
        q.search = Some(v.clone());
    }
    Ok(q)
}

/// `GET /sandboxes/{id}/logs` (`v2`: `/v2/sandboxes/{id}/logs`).
pub(super) async fn get(state: &ApiState, id: &str, req: &Request<Incoming>, v2: bool) -> Reply {
    let id = parse_sandbox_id(id)?;
    let q = parse_query(req.uri().query().unwrap_or(""), v2).map_err(bad_request)?;
    let entries = state.orch.sandbox_logs(&id, q).await?;
    let logs: Vec<LogEntryJson<'_>> = entries.iter().map(entry_json).collect();
    let body = if v2 {
        serde_json::json!({ "logs": logs })
    } else {
        let lines: Vec<LogLineJson<'_>> = entries
            .iter()
            .map(|e| LogLineJson {
                timestamp: ms_rfc3339(e.ts),
                line: &e.message,
            })
            .collect();
        serde_json::json!({ "logs": lines, "logEntries": logs })
    };
    Ok(json_response(StatusCode::OK, &body))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn v2_queries_parse_with_the_sdks_defaults() {
        let q = parse_query("", true).unwrap();
        assert_eq!(q.limit, 1000);
        assert!(!q.backward && q.cursor_ms.is_none() && q.search.is_none());
        assert_eq!(q.min_level, Level::Debug);
        let q = parse_query(
            "cursor=1704067200000&limit=5&direction=backward&level=warn&search=a%20b",
            true,
        )
        .unwrap();
        assert_eq!(q.cursor_ms, Some(1_704_067_200_000));
        assert_eq!((q.limit, q.backward, q.min_level), (5, true, Level::Warn));
        assert_eq!(q.search.as_deref(), Some("a b"));
    }

    #[test]
    fn bad_level_direction_limit_and_cursor_are_named() {
        for (query, want) in [
            (
                "level=loud",
                "invalid level \"loud\": use debug, info, warn or error",
            ),
            (
                "direction=up",
                "invalid direction \"up\": use forward or backward",
            ),
            ("limit=1001", "invalid limit \"1001\": use 0 to 1000"),
            ("limit=-1", "invalid limit"),
            ("cursor=yesterday", "invalid cursor \"yesterday\""),
        ] {
            let e = parse_query(query, true).unwrap_err();
            assert!(e.contains(want), "{query}: {e}");
        }
        let long = format!("search={}", "s".repeat(MAX_SEARCH + 1));
        assert!(
            parse_query(&long, true)
                .unwrap_err()
                .contains("at most 256")
        );
    }

    #[test]
    fn v1_takes_start_and_limit_only() {
        let q = parse_query("start=5&limit=7&level=error&direction=backward", false).unwrap();
        assert_eq!((q.cursor_ms, q.limit), (Some(5), 7));
        assert_eq!(q.min_level, Level::Debug);
        assert!(!q.backward);
        assert!(
            parse_query("start=x", false)
                .unwrap_err()
                .contains("invalid start")
        );
    }
}
