//! JSON shapes of the REST API (camelCase on the wire) and list queries.

use std::collections::BTreeMap;
use std::time::Duration;

use base64::Engine;
use http::StatusCode;
use serde::{Deserialize, Serialize};

use crate::clock::{ms_rfc3339, rfc3339_ms};
use crate::dataplane::{Body, json_error};
use crate::lifecycle::{CreateRequest, OnTimeout, SandboxRecord, VolumeMount};
use crate::snapshot::{SnapshotRecord, SnapshotSource};

/// `POST /sandboxes` and `POST /v2/sandboxes`. Unknown fields are ignored.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NewSandbox {
    #[serde(rename = "templateID")]
    pub template_id: Option<String>,
    pub timeout: Option<u64>,
    pub auto_pause: Option<bool>,
    /// `false`: a timeout's pause keeps the files only (the sandbox starts afresh on
    /// resume), as `POST /pause` with `memory: false`.
    pub auto_pause_memory: Option<bool>,
    pub auto_resume: Option<AutoResume>,
    /// Accepted and ignored: every sandbox's agent requires its access token.
    pub secure: Option<bool>,
    #[serde(rename = "allow_internet_access")]
    pub allow_internet_access: Option<bool>,
    pub network: Option<Network>,
    pub metadata: Option<BTreeMap<String, String>>,
    pub env_vars: Option<BTreeMap<String, String>>,
    pub cpu_count: Option<u32>,
    #[serde(rename = "memoryMB")]
    pub memory_mb: Option<u64>,
    /// The size of the sandbox's writable disk (an extension; E2B sets it per template).
    #[serde(rename = "diskSizeMB")]
    pub disk_size_mb: Option<u64>,
    /// Volumes mounted into the sandbox.
    pub volume_mounts: Option<Vec<VolumeMountJson>>,
}

/// `{name, path}` of `volumeMounts`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeMountJson {
    pub name: String,
    pub path: String,
}

#[derive(Debug, Default, Deserialize)]
pub struct AutoResume {
    #[serde(default)]
    pub enabled: bool,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Network {
    pub allow_public_traffic: Option<bool>,
    /// CIDRs, IPs and domain names (`*.` wildcards) the sandbox may reach; they win
    /// over `deny_out`.
    pub allow_out: Option<Vec<String>>,
    /// CIDRs and IPs the sandbox may not reach.
    pub deny_out: Option<Vec<String>>,
    /// Nameservers reachable when `allow_out` names a domain.
    pub dns_servers: Option<Vec<String>>,
    /// Not served here: refused rather than ignored.
    pub egress_proxy: Option<serde_json::Value>,
    /// Not served here: refused rather than ignored.
    pub rules: Option<serde_json::Value>,
    /// Not served here: refused rather than ignored.
    pub mask_request_host: Option<String>,
    /// Not served here: refused rather than ignored.
    pub https_ports: Option<Vec<u16>>,
}

impl NewSandbox {
    /// Checks the fields the type system cannot and builds the lifecycle request.
    pub fn into_request(self) -> Result<CreateRequest, Box<http::Response<Body>>> {
        let bad = |m: String| Box::new(json_error(StatusCode::BAD_REQUEST, m));
        let template = match self.template_id.as_deref().map(str::trim) {
            Some(t) if !t.is_empty() => t.to_string(),
            _ => return Err(bad("templateID is required, e.g. \"base\"".into())),
        };
        if let Some(c) = self.cpu_count
            && c == 0
        {
            return Err(bad("cpuCount must be at least 1".into()));
        }
        let mut r = CreateRequest::new(template);
        r.timeout = self.timeout.map(Duration::from_secs);
        r.options.on_timeout = if self.auto_pause == Some(false) {
            OnTimeout::Kill
        } else {
            OnTimeout::Pause
        };
        r.options.auto_resume = self.auto_resume.is_some_and(|a| a.enabled);
        r.options.auto_pause_memory = self.auto_pause_memory.unwrap_or(true);
        if r.options.auto_resume && !r.options.auto_pause_memory {
            return Err(bad(
                "autoResume cannot be combined with autoPauseMemory: false: a sandbox paused with its files only starts afresh and is resumed explicitly (connect or resume)"
                    .into(),
            ));
        }
        r.options.allow_internet_access = self.allow_internet_access;
        if let Some(n) = &self.network {
            super::network::refuse_unsupported(
                n.egress_proxy.as_ref(),
                n.rules.as_ref(),
                n.mask_request_host.as_deref(),
                n.https_ports.as_deref(),
            )
            .map_err(bad)?;
            r.options.network = crate::egress::EgressRules {
                allow_out: n.allow_out.clone().unwrap_or_default(),
                deny_out: n.deny_out.clone().unwrap_or_default(),
                dns_servers: n.dns_servers.clone(),
            }
            .checked()
            .map_err(|e| bad(e.to_string()))?;
        }
        r.options.allow_public_traffic = self
            .network
            .and_then(|n| n.allow_public_traffic)
            .unwrap_or(true);
        r.options.metadata = self.metadata.unwrap_or_default();
        r.options.env_vars = self.env_vars.unwrap_or_default();
        r.cpu_count = self.cpu_count;
        r.memory_mb = self.memory_mb;
        r.disk_size_mb = self.disk_size_mb;
        let mounts = self.volume_mounts.unwrap_or_default();
        crate::volume::validate_mounts(mounts.iter().map(|m| (m.name.as_str(), m.path.as_str())))
            .map_err(|m| bad(format!("volumeMounts: {m}")))?;
        r.options.volume_mounts = mounts
            .into_iter()
            .map(|m| VolumeMount {
                name: m.name,
                path: m.path,
            })
            .collect();
        Ok(r)
    }
}

/// `POST /volumes`.
#[derive(Debug, Default, Deserialize)]
pub struct NewVolume {
    pub name: Option<String>,
}

/// The `Volume` model (`GET /volumes` items).
#[derive(Debug, Serialize)]
pub struct VolumeJson {
    #[serde(rename = "volumeID")]
    pub volume_id: String,
    pub name: String,
}

/// The `VolumeAndToken` model.
#[derive(Debug, Serialize)]
pub struct VolumeAndTokenJson {
    #[serde(flatten)]
    pub volume: VolumeJson,
    pub token: String,
}

/// `POST /sandboxes/{id}/snapshots`.
#[derive(Debug, Default, Deserialize)]
pub struct SnapshotBody {
    pub name: Option<String>,
}

/// The `SnapshotInfo` model.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SnapshotInfoJson {
    #[serde(rename = "snapshotID")]
    pub snapshot_id: String,
    pub names: Vec<String>,
    pub cpu_count: u32,
    #[serde(rename = "memoryMB")]
    pub memory_mb: u64,
    #[serde(rename = "diskSizeMB")]
    pub disk_size_mb: u64,
    pub created_at: String,
    pub updated_at: String,
}

/// `GET /snapshots` query: `sandboxID` (snapshots of that sandbox), `limit`,
/// `nextToken` (newest first, as `/v2/sandboxes`).
#[derive(Debug, Default)]
pub struct SnapshotQuery {
    pub sandbox_id: Option<String>,
    pub limit: usize,
    pub after: Option<(u64, String)>,
}

impl SnapshotQuery {
    /// Parses the query string; errors are messages for a 400.
    pub fn parse(q: &str) -> Result<Self, String> {
        let pairs = super::query_pairs(q);
        let mut out = SnapshotQuery {
            sandbox_id: pairs
                .get("sandboxID")
                .filter(|s| !s.is_empty())
                .map(|s| s.to_ascii_lowercase()),
            limit: 100,
            after: None,
        };
        (out.limit, out.after) = page(&pairs, out.limit)?;
        Ok(out)
    }

    /// Pages `items` (sorted newest first, ties by id); returns the page and the next
    /// token when more items exist.
    pub fn apply(&self, items: Vec<SnapshotRecord>) -> (Vec<SnapshotRecord>, Option<String>) {
        let matching = items.into_iter().filter(|r| {
            self.sandbox_id.as_deref().is_none_or(|want| {
                let SnapshotSource::Sandbox { source_sandbox_id } = &r.source;
                source_sandbox_id == want
            })
        });
        paginate(matching, self.after.as_ref(), self.limit, false)
    }
}

/// Bodies with an optional `timeout` (connect, resume, timeout); connect and resume
/// also take `memory` (`false`: start afresh on the sandbox's files).
#[derive(Debug, Default, Deserialize)]
pub struct TimeoutBody {
    pub timeout: Option<u64>,
    pub memory: Option<bool>,
}

/// `POST /sandboxes/{id}/pause`.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PauseBody {
    /// `false`: keep the files only (the sandbox starts afresh on resume).
    pub memory: Option<bool>,
    /// Refuse (503) while the sandbox's agent does not answer.
    pub require_healthy_guest: Option<bool>,
}

/// `POST /sandboxes/{id}/fork`: how many forks (1 by default) and their timeout.
#[derive(Debug, Default, Deserialize)]
pub struct ForkBody {
    pub timeout: Option<u64>,
    pub count: Option<i64>,
}

/// `POST /refreshes`.
#[derive(Debug, Default, Deserialize)]
pub struct RefreshBody {
    pub duration: Option<u64>,
}

/// The `Sandbox` model.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SandboxJson {
    #[serde(rename = "templateID")]
    pub template_id: String,
    #[serde(rename = "sandboxID")]
    pub sandbox_id: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub alias: Option<String>,
    #[serde(rename = "clientID")]
    pub client_id: String,
    pub envd_version: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub envd_access_token: Option<String>,
    pub traffic_access_token: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub domain: Option<String>,
}

/// The `ListedSandbox` model.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ListedSandboxJson {
    #[serde(rename = "templateID")]
    pub template_id: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub alias: Option<String>,
    #[serde(rename = "sandboxID")]
    pub sandbox_id: String,
    #[serde(rename = "clientID")]
    pub client_id: String,
    pub started_at: String,
    pub end_at: String,
    pub cpu_count: u32,
    #[serde(rename = "memoryMB")]
    pub memory_mb: u64,
    #[serde(rename = "diskSizeMB")]
    pub disk_size_mb: u64,
    pub metadata: BTreeMap<String, String>,
    pub state: String,
    pub envd_version: String,
    /// The volumes the sandbox mounts (`[{name, path}]`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub volume_mounts: Vec<VolumeMountJson>,
}

/// `lifecycle` of `SandboxDetail`.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct LifecycleJson {
    pub auto_resume: bool,
    pub on_timeout: String,
}

/// The `SandboxDetail` model.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SandboxDetailJson {
    #[serde(flatten)]
    pub listed: ListedSandboxJson,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub envd_access_token: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub domain: Option<String>,
    pub allow_internet_access: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub network: Option<serde_json::Value>,
    pub lifecycle: LifecycleJson,
    /// What the latest pause kept (`full` or `filesystem`), while paused.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pause_mode: Option<&'static str>,
}

/// `GET /v2/sandboxes` query: `state`, `metadata`, `template`, `startedAfter`, `order`,
/// `limit`, `nextToken` (and `GET /sandboxes`: `metadata`).
#[derive(Debug, Default)]
pub struct ListQuery {
    pub state: Option<String>,
    pub metadata: BTreeMap<String, String>,
    /// The template's id or name (or the snapshot's) the sandboxes started from.
    pub template: Option<String>,
    /// Only sandboxes started after this (ms since the epoch).
    pub started_after: Option<u64>,
    /// Oldest first (`order=asc`) instead of newest first.
    pub ascending: bool,
    pub limit: usize,
    /// (created ms, id) of the last item of the previous page.
    pub after: Option<(u64, String)>,
}

/// Encodes a page cursor.
pub fn encode_token(created_ms: u64, id: &str) -> String {
    let s = format!("{}__{id}", ms_rfc3339(created_ms));
    base64::engine::general_purpose::URL_SAFE.encode(s)
}

/// What lists are sorted and paged by: creation time (newest first), then id.
trait Listed {
    fn cursor(&self) -> (u64, &str);
}

impl Listed for SandboxRecord {
    fn cursor(&self) -> (u64, &str) {
        (self.created_at_ms, &self.id)
    }
}

impl Listed for SnapshotRecord {
    fn cursor(&self) -> (u64, &str) {
        (self.created_at_ms, &self.id)
    }
}

/// The page of `items` (sorted newest first, or oldest first with `ascending`; ties by
/// id) after the cursor `after`: at most `limit` items, and the next token when more
/// follow.
fn paginate<T: Listed>(
    items: impl Iterator<Item = T>,
    after: Option<&(u64, String)>,
    limit: usize,
    ascending: bool,
) -> (Vec<T>, Option<String>) {
    let mut page: Vec<T> = items
        .filter(|r| match after {
            None => true,
            Some((ms, id)) => {
                let (created, rid) = r.cursor();
                let past = if ascending {
                    created > *ms
                } else {
                    created < *ms
                };
                past || (created == *ms && rid > id.as_str())
            }
        })
        .collect();
    let more = page.len() > limit;
    page.truncate(limit);
    let next = if more {
        page.last().map(|r| {
            let (created, id) = r.cursor();
            encode_token(created, id)
        })
    } else {
        None
    };
    (page, next)
}

/// The `limit` (0..100, else `default`) and `nextToken` of a list query.
fn page(
    pairs: &std::collections::BTreeMap<String, String>,
    default: usize,
) -> Result<(usize, Option<(u64, String)>), String> {
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
        None => default,
    };
    let after = match pairs.get("nextToken").filter(|t| !t.is_empty()) {
        Some(t) => Some(decode_token(t).ok_or_else(|| format!("invalid nextToken {t:?}"))?),
        None => None,
    };
    Ok((limit, after))
}

fn decode_token(t: &str) -> Option<(u64, String)> {
    let raw = base64::engine::general_purpose::URL_SAFE.decode(t).ok()?;
    let s = String::from_utf8(raw).ok()?;
    let (ts, id) = s.split_once("__")?;
    Some((rfc3339_ms(ts)?, id.to_string()))
}

impl ListQuery {
    /// Parses the query string; errors are messages for a 400.
    pub fn parse(q: &str) -> Result<Self, String> {
        let pairs = super::query_pairs(q);
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
        out.metadata = metadata_filter(&pairs)?;
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
        (out.limit, out.after) = page(&pairs, out.limit)?;
        Ok(out)
    }

    /// Parses the query of `GET /sandboxes` (only `metadata` filters it).
    pub fn parse_v1(q: &str) -> Result<Self, String> {
        let pairs = super::query_pairs(q);
        Ok(ListQuery {
            metadata: metadata_filter(&pairs)?,
            limit: usize::MAX,
            ..Default::default()
        })
    }

    /// Filters and pages `items` (sorted newest first, ties by id); returns the page and
    /// the next token when more items exist.
    pub fn apply(&self, items: Vec<SandboxRecord>) -> (Vec<SandboxRecord>, Option<String>) {
        let mut matching: Vec<SandboxRecord> = items
            .into_iter()
            .filter(|r| {
                self.state
                    .as_deref()
                    .is_none_or(|s| r.state.api_name() == s)
            })
            .filter(|r| {
                self.metadata
                    .iter()
                    .all(|(k, v)| r.options.metadata.get(k) == Some(v))
            })
            .filter(|r| self.template.as_deref().is_none_or(|t| started_from(r, t)))
            .filter(|r| self.started_after.is_none_or(|ms| r.created_at_ms > ms))
            .collect();
        if self.ascending {
            matching.sort_by(|a, b| a.created_at_ms.cmp(&b.created_at_ms).then(a.id.cmp(&b.id)));
        }
        paginate(
            matching.into_iter(),
            self.after.as_ref(),
            self.limit,
            self.ascending,
        )
    }
}

/// Whether sandbox `r` started from the template (or snapshot) `t`, by id or name.
fn started_from(r: &SandboxRecord, t: &str) -> bool {
    r.template == t || r.snapshot_id.as_deref() == Some(t) || r.snapshot_name.as_deref() == Some(t)
}

/// The `metadata` filter of a list query, as the E2B SDKs encode it: `key=value` pairs
/// joined by `&`, each key and value percent-encoded, the whole percent-encoded again
/// as the parameter's value (here: already decoded once).
fn metadata_filter(pairs: &BTreeMap<String, String>) -> Result<BTreeMap<String, String>, String> {
    let mut out = BTreeMap::new();
    let Some(m) = pairs.get("metadata").filter(|m| !m.is_empty()) else {
        return Ok(out);
    };
    let whole = percent_encoding::percent_decode_str(&m.replace('+', " "))
        .decode_utf8_lossy()
        .into_owned();
    for pair in whole.split('&').filter(|p| !p.is_empty()) {
        let parts: Vec<&str> = pair.split('=').collect();
        let [k, v] = parts.as_slice() else {
            return Err(format!(
                "invalid metadata filter {pair:?}: use key=value pairs joined by '&', each key and value percent-encoded"
            ));
        };
        let dec = |s: &str| {
            percent_encoding::percent_decode_str(&s.replace('+', " "))
                .decode_utf8_lossy()
                .into_owned()
        };
        out.insert(dec(k), dec(v));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn create_body_ignores_unknown_fields_and_checks_types() {
        let b: NewSandbox = serde_json::from_str(
            r#"{"templateID":"base","autoPauseMemory":true,"iam":{},"volumeMounts":[],"timeout":5,"autoPause":false,"autoResume":{"enabled":true},"network":{"allowPublicTraffic":false}}"#,
        )
        .unwrap();
        let r = b.into_request().unwrap();
        assert_eq!(r.template, "base");
        assert_eq!(r.options.on_timeout, OnTimeout::Kill);
        assert!(r.options.auto_resume && !r.options.allow_public_traffic);
        assert!(
            serde_json::from_str::<NewSandbox>(r#"{"templateID":"base","timeout":"x"}"#).is_err()
        );
        assert!(
            serde_json::from_str::<NewSandbox>(r#"{"templateID":"base","timeout":-1}"#).is_err()
        );
        let missing: NewSandbox = serde_json::from_str("{}").unwrap();
        assert!(missing.into_request().is_err());
    }

    #[tokio::test]
    async fn volume_mounts_are_checked_for_shape_and_kept() {
        let b: NewSandbox = serde_json::from_str(
            r#"{"templateID":"base","volumeMounts":[{"name":"data","path":"/mnt/v"},{"name":"data","path":"/srv"}]}"#,
        )
        .unwrap();
        let r = b.into_request().unwrap();
        assert_eq!(
            r.options.volume_mounts,
            vec![
                VolumeMount {
                    name: "data".into(),
                    path: "/mnt/v".into()
                },
                VolumeMount {
                    name: "data".into(),
                    path: "/srv".into()
                }
            ]
        );
        for (mounts, why) in [
            (r#"[{"name":"data","path":"mnt"}]"#, "absolute"),
            (r#"[{"name":"data","path":"/proc/x"}]"#, "/proc"),
            (r#"[{"name":"data","path":"/mnt/../etc"}]"#, "normalized"),
            (r#"[{"name":"a b","path":"/mnt"}]"#, "invalid volume name"),
            (
                r#"[{"name":"a","path":"/mnt"},{"name":"b","path":"/mnt"}]"#,
                "given twice",
            ),
        ] {
            let b: NewSandbox = serde_json::from_str(&format!(
                r#"{{"templateID":"base","volumeMounts":{mounts}}}"#
            ))
            .unwrap();
            let resp = b.into_request().unwrap_err();
            assert_eq!(resp.status(), StatusCode::BAD_REQUEST);
            let body = http_body_util::BodyExt::collect(resp.into_body())
                .await
                .unwrap()
                .to_bytes();
            let msg = String::from_utf8_lossy(&body);
            assert!(msg.contains("volumeMounts: ") && msg.contains(why), "{msg}");
        }
    }

    #[test]
    fn create_checks_and_normalizes_egress_rules_and_refuses_what_is_not_served() {
        let ok: NewSandbox = serde_json::from_str(
            r#"{"templateID":"base","allow_internet_access":false,"network":{"allowOut":["Example.com","8.8.8.8"],"denyOut":["10.1.0.0/8"],"dnsServers":["1.1.1.1"],"egressProxy":null}}"#,
        )
        .unwrap();
        let r = ok.into_request().unwrap();
        assert_eq!(r.options.network.allow_out, ["example.com", "8.8.8.8"]);
        assert_eq!(r.options.network.deny_out, ["10.0.0.0/8"]);
        assert_eq!(r.options.allow_internet_access, Some(false));
        for (network, want) in [
            (r#"{"allowOut":["10.0.0.0/33"]}"#, "network.allowOut[0]"),
            (r#"{"denyOut":["example.com"]}"#, "network.denyOut[0]"),
            (r#"{"egressProxy":{"address":"p:1080"}}"#, "egressProxy"),
            (r#"{"rules":{"a.com":[{}]}}"#, "network.rules"),
            (r#"{"httpsPorts":[3000]}"#, "httpsPorts"),
        ] {
            let b: NewSandbox =
                serde_json::from_str(&format!(r#"{{"templateID":"base","network":{network}}}"#))
                    .unwrap();
            let resp = b.into_request().unwrap_err();
            assert_eq!(resp.status(), StatusCode::BAD_REQUEST, "{network}");
            let body =
                futures::executor::block_on(http_body_util::BodyExt::collect(resp.into_body()))
                    .unwrap()
                    .to_bytes();
            let text = String::from_utf8_lossy(&body);
            assert!(text.contains(want), "{network}: {text}");
        }
    }

    #[test]
    fn list_tokens_round_trip_and_page() {
        let t = encode_token(1_700_000_000_123, "abc");
        assert_eq!(decode_token(&t), Some((1_700_000_000_123, "abc".into())));
        assert!(ListQuery::parse("nextToken=@@").is_err());
        assert!(ListQuery::parse("limit=101").is_err());
        assert!(ListQuery::parse("state=weird").is_err());
        let q = ListQuery::parse("state=running,paused&metadata=a%3D1%26b%3D2&limit=5").unwrap();
        assert_eq!(q.state, None);
        assert_eq!(q.metadata.len(), 2);
        assert!(ListQuery::parse("order=sideways").is_err());
        assert!(ListQuery::parse("startedAfter=yesterday").is_err());
        assert!(ListQuery::parse("metadata=a%3D1%3D2").is_err());
        let q = ListQuery::parse(
            "order=asc&template=web&startedAfter=2024-01-01T00%3A00%3A00%2B00%3A00",
        )
        .unwrap();
        assert!(q.ascending);
        assert_eq!(q.template.as_deref(), Some("web"));
        assert_eq!(q.started_after, Some(1_704_067_200_000));
    }

    #[test]
    fn metadata_filters_decode_as_the_sdks_encode_them() {
        // `{"a b": "c&d=e", "x": "y"}` as both SDKs send it.
        let q = ListQuery::parse("metadata=a%252520b%3Dc%252526d%25253De%26x%3Dy").unwrap();
        assert_eq!(q.metadata.get("a b").map(String::as_str), Some("c&d=e"));
        assert_eq!(q.metadata.get("x").map(String::as_str), Some("y"));
        assert_eq!(q.metadata.len(), 2);
        let v1 = ListQuery::parse_v1("metadata=k%3Dv").unwrap();
        assert_eq!(v1.metadata.get("k").map(String::as_str), Some("v"));
    }
}
