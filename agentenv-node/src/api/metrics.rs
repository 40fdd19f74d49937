//! `GET /sandboxes/{id}/metrics` and `GET /sandboxes/metrics`: what sandboxes use, from
//! the node's samples (see [`crate::observe`]).

use std::collections::BTreeMap;

use http::{Request, StatusCode};
use hyper::body::Incoming;
use serde::Serialize;

use super::ApiState;
use super::body::{json_response, query_pairs};
use super::error::{Reply, bad_request};
use crate::clock::ms_rfc3339;
use crate::ids::parse_sandbox_id;
use crate::observe::{Range, Sample};

/// Most ids one `GET /sandboxes/metrics` may name.
pub(super) const MAX_IDS: usize = 100;

/// A time above this is taken for milliseconds, not the seconds the API wants.
const MAX_UNIX_SECONDS: u64 = 100_000_000_000;

/// The `SandboxMetric` model.
#[derive(Debug, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
struct SandboxMetricJson {
    timestamp: String,
    timestamp_unix: u64,
    cpu_count: u32,
    cpu_used_pct: f64,
    mem_used: u64,
    mem_total: u64,
    mem_cache: u64,
    disk_used: u64,
    disk_total: u64,
}

impl From<&Sample> for SandboxMetricJson {
    fn from(s: &Sample) -> Self {
        Self {
            timestamp: ms_rfc3339(s.ts_ms),
            timestamp_unix: s.ts_ms / 1000,
            cpu_count: s.cpu_count,
            cpu_used_pct: (f64::from(s.cpu_used_pct) * 100.0).round() / 100.0,
            mem_used: s.mem_used,
            mem_total: s.mem_total,
            mem_cache: s.mem_cache,
            disk_used: s.disk_used,
            disk_total: s.disk_total,
        }
    }
}

/// `start` and `end` of a metrics query (unix seconds, inclusive); errors are messages
/// for a 400.
pub(super) fn parse_range(query: &str) -> Result<Range, String> {
    let pairs = query_pairs(query);
    let secs = |k: &str| -> Result<Option<u64>, String> {
        let Some(v) = pairs.get(k).map(|v| v.trim()).filter(|v| !v.is_empty()) else {
            return Ok(None);
        };
        let shown: String = v.chars().take(40).collect();
        let n: u64 = v
            .parse()
            .map_err(|_| format!("invalid {k} {shown:?}: use unix seconds, e.g. {k}=1704067200"))?;
        if n >= MAX_UNIX_SECONDS {
            return Err(format!(
                "invalid {k} {n}: it looks like milliseconds; use unix seconds, e.g. {k}=1704067200"
            ));
        }
        Ok(Some(n))
    };
    Range::new(secs("start")?, secs("end")?).map_err(|e| e.to_string())
}

/// `sandbox_ids` of `GET /sandboxes/metrics`: comma-separated sandbox ids, 1 to
/// [`MAX_IDS`]; errors are messages for a 400.
pub(super) fn parse_ids(query: &str) -> Result<Vec<String>, String> {
    let pairs = query_pairs(query);
    let Some(list) = pairs.get("sandbox_ids") else {
        return Err("sandbox_ids is required: a comma-separated list of sandbox ids".into());
    };
    let mut ids = Vec::new();
    for raw in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        if ids.len() == MAX_IDS {
            return Err(format!(
                "sandbox_ids names more than {MAX_IDS} sandboxes: ask in several requests"
            ));
        }
        let id = parse_sandbox_id(raw).map_err(|e| format!("sandbox_ids: {e}"))?;
        if !ids.contains(&id) {
            ids.push(id);
        }
    }
    if ids.is_empty() {
        return Err("sandbox_ids is empty: name at least one sandbox id".into());
    }
    Ok(ids)
}

/// `GET /sandboxes/{id}/metrics?start=&end=`: the samples in the range, oldest first.
pub(super) async fn sandbox(state: &ApiState, id: &str, req: &Request<Incoming>) -> Reply {
    let id = parse_sandbox_id(id)?;
    let range = parse_range(req.uri().query().unwrap_or("")).map_err(bad_request)?;
    let samples = state.orch.sandbox_metrics(&id, range)?;
    let out: Vec<SandboxMetricJson> = samples.iter().map(SandboxMetricJson::from).collect();
    Ok(json_response(StatusCode::OK, &out))
}

/// `GET /sandboxes/metrics?sandbox_ids=…`: the latest sample of each named sandbox that
/// has one (unknown ids are left out).
pub(super) async fn many(state: &ApiState, req: &Request<Incoming>) -> Reply {
    let ids = parse_ids(req.uri().query().unwrap_or("")).map_err(bad_request)?;
    let sandboxes: BTreeMap<String, SandboxMetricJson> = state
        .orch
        .latest_metrics(&ids)
        .iter()
        .map(|(id, s)| (id.clone(), SandboxMetricJson::from(s)))
        .collect();
    Ok(json_response(
        StatusCode::OK,
        &serde_json::json!({ "sandboxes": sandboxes }),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: &str = "01936f8e-72f5-7000-8000-000000000001";
    const B: &str = "01936f8e-72f5-7000-8000-000000000002";

    #[test]
    fn ranges_parse_and_bad_ones_are_named() {
        assert_eq!(parse_range("").unwrap(), Range::default());
        let r = parse_range("start=1704067200&end=1704153600").unwrap();
        assert_eq!((r.start, r.end), (Some(1_704_067_200), Some(1_704_153_600)));
        let e = parse_range("start=20&end=10").unwrap_err();
        assert!(e.contains("reversed") && e.contains("start 20"), "{e}");
        let e = parse_range("start=abc").unwrap_err();
        assert!(
            e.contains("invalid start \"abc\"") && e.contains("unix seconds"),
            "{e}"
        );
        let e = parse_range("end=-5").unwrap_err();
        assert!(e.contains("invalid end"), "{e}");
        let e = parse_range("start=1704067200000").unwrap_err();
        assert!(e.contains("milliseconds"), "{e}");
    }

    #[test]
    fn sandbox_ids_are_a_checked_comma_list() {
        let q = format!("sandbox_ids={A}%2C{}", B.to_uppercase());
        assert_eq!(parse_ids(&q).unwrap(), [A, B]);
        assert_eq!(parse_ids(&format!("sandbox_ids={A},{A}")).unwrap(), [A]);
        assert!(parse_ids("").unwrap_err().contains("required"));
        assert!(parse_ids("sandbox_ids=").unwrap_err().contains("empty"));
        assert!(parse_ids("sandbox_ids=nope").unwrap_err().contains("nope"));
        let many: Vec<String> = (0..=MAX_IDS)
            .map(|i| format!("01936f8e-72f5-7000-8000-{i:012}"))
            .collect();
        let e = parse_ids(&format!("sandbox_ids={}", many.join(","))).unwrap_err();
        assert!(e.contains("more than 100"), "{e}");
    }

    #[test]
    fn a_sample_has_every_key_the_sdks_require() {
        let s = Sample {
            ts_ms: 1_704_067_200_123,
            cpu_count: 2,
            cpu_used_pct: 12.3456,
            mem_used: 1,
            mem_total: 2,
            mem_cache: 3,
            disk_used: 4,
            disk_total: 5,
        };
        let v = serde_json::to_value(SandboxMetricJson::from(&s)).unwrap();
        for k in [
            "timestamp",
            "timestampUnix",
            "cpuCount",
            "cpuUsedPct",
            "memUsed",
            "memTotal",
            "memCache",
            "diskUsed",
            "diskTotal",
        ] {
            assert!(!v[k].is_null(), "{k} in {v}");
        }
        assert_eq!(v["timestampUnix"], 1_704_067_200);
        assert_eq!(v["cpuUsedPct"], 12.35);
        assert_eq!(v["timestamp"], "2024-01-01T00:00:00.123Z");
    }
}
