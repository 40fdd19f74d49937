//! The template API as the E2B SDKs call it: create a template and a build
//! (`POST /v3/templates`), upload links for COPY files and the upload itself, start a
//! build, its status and logs, list, get, update, delete, names, tags.
//!
//! Everything lives in the shared catalog, so any node answers any of these (the
//! gateway sends them to any node); the build itself runs on the node that got
//! `POST /v2/templates/{id}/builds/{build}`. The SDKs percent-encode path segments
//! (`name:tag` → `name%3Atag`): segments are decoded here. Listing, reading, updating
//! and deleting templates, names and tags are in `template_catalog`.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use http::{Request, StatusCode, header};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use serde::Deserialize;
use subtle::ConstantTimeEq;

use super::ApiState;
use super::body::{json_response, query_pairs, read_json};
use super::error::{Reply, bad_request};
use crate::clock::ms_since_epoch;
use crate::dataplane::{json_error, status_only};
use crate::lifecycle::{DEFAULT_TAG, LifecycleError, Templates};
use crate::template::BASE_TEMPLATE;
use crate::template::catalog::{
    BuildRecord, BuildStatus, TemplateCatalog, TemplateRecord, is_sha256_hex, is_template_id,
    new_template_id, validate_name, validate_tag,
};
use crate::template::steps::{BuildRequestJson, BuildSpec, split_reference};

/// How long an upload link works.
const UPLOAD_LINK_TTL: Duration = Duration::from_secs(3600);
/// Largest uploaded file archive.
pub const MAX_UPLOAD: u64 = 8 << 30;
/// Most log entries one status answer carries.
const MAX_LOG_PAGE: usize = 1000;

pub(super) fn templates(state: &ApiState) -> Result<&Arc<Templates>, super::error::Reject> {
    Ok(state.orch.templates()?)
}

pub(super) fn decode(seg: &str) -> String {
    percent_encoding::percent_decode_str(seg)
        .decode_utf8_lossy()
        .into_owned()
}

pub(super) fn now_ms() -> u64 {
    ms_since_epoch(SystemTime::now())
}

pub(super) fn not_found(what: impl Into<String>) -> super::error::Reject {
    json_error(StatusCode::NOT_FOUND, what).into()
}

/// The template a path segment names (id, name, or `name:tag`: the tag is ignored here).
pub(super) async fn template_of(
    t: &Templates,
    seg: &str,
) -> Result<TemplateRecord, super::error::Reject> {
    let r = decode(seg);
    let (name, _) = split_reference(&r);
    match t.catalog.resolve(name).await? {
        Some(rec) => Ok(rec),
        None => Err(not_found(format!("template {r} not found"))),
    }
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct NewTemplate {
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    alias: Option<String>,
    #[serde(default)]
    tags: Vec<String>,
    #[serde(default)]
    cpu_count: Option<u32>,
    #[serde(default, rename = "memoryMB")]
    memory_mb: Option<u64>,
    #[serde(default, rename = "diskSizeMB")]
    disk_size_mb: Option<u64>,
}

/// `POST /v3/templates` (and `/v2/templates`): a template (new, or the one the name
/// names) and a new build of it, waiting for its steps.
pub(super) async fn create(state: &ApiState, req: Request<Incoming>) -> Reply {
    let t = templates(state)?;
    let body: NewTemplate = read_json(req).await?;
    let Some(full) = body.name.or(body.alias).filter(|n| !n.trim().is_empty()) else {
        return Err(bad_request(
            "name is required, e.g. \"my-template\" or \"my-template:v1\"",
        ));
    };
    let (name, tag) = split_reference(full.trim());
    let name = name.to_string();
    validate_name(&name)?;
    if name == BASE_TEMPLATE {
        return Err(bad_request(
            "the name \"base\" is the built-in template's: choose another name (a build may start from base with fromTemplate)",
        ));
    }
    let mut tags: Vec<String> = body.tags;
    if let Some(tag) = tag {
        tags.push(tag.to_string());
    }
    for tag in &tags {
        validate_tag(tag)?;
    }
    tags.sort();
    tags.dedup();
    let cpu = body
        .cpu_count
        .unwrap_or(state.orch.config().default_cpu_count);
    let mem = body
        .memory_mb
        .unwrap_or(state.orch.config().default_memory_mb);
    if cpu == 0 || cpu > 64 {
        return Err(bad_request(format!("cpuCount {cpu} is outside 1..=64")));
    }
    if mem < crate::backend::MIN_MEMORY_MB {
        return Err(bad_request(format!(
            "memoryMB {mem} is below the least of {} MiB",
            crate::backend::MIN_MEMORY_MB
        )));
    }
    // A snapshot's name is a template name too.
    if let Ok(repo) = state.orch.snapshot_repository()
        && crate::snapshot::validate_name(&name).is_ok()
        && let Some(snap) = repo.resolve(&name).await?
    {
        return Err(json_error(
            StatusCode::CONFLICT,
            format!(
                "the name {name:?} belongs to snapshot {}: choose another name, or delete that snapshot first",
                snap.id
            ),
        )
        .into());
    }
    let now = now_ms();
    let mut rec = match t.catalog.by_name(&name).await? {
        Some(rec) => rec,
        None => {
            let rec = TemplateRecord {
                template_id: new_template_id(),
                names: vec![name.clone()],
                public: false,
                cpu_count: cpu,
                memory_mb: mem,
                disk_size_mb: body.disk_size_mb.unwrap_or(0),
                created_at_ms: now,
                updated_at_ms: now,
                tags: BTreeMap::new(),
                builds: Vec::new(),
            };
            // The record first: a name whose record does not carry it is free.
            t.catalog.save_record(&rec).await?;
            if let Err(e) = t.catalog.claim_name(&name, &rec.template_id).await {
                let _ = t
                    .catalog
                    .delete(&TemplateRecord {
                        names: vec![],
                        ..rec.clone()
                    })
                    .await;
                return Err(e.into());
            }
            rec
        }
    };
    let build = BuildRecord {
        build_id: uuid::Uuid::new_v4().to_string(),
        template_id: rec.template_id.clone(),
        status: BuildStatus::Waiting,
        created_at_ms: now,
        updated_at_ms: now,
        finished_at_ms: None,
        cpu_count: cpu,
        memory_mb: mem,
        tags: tags.clone(),
        node_id: None,
        heartbeat_at_ms: now,
        reason: None,
        result: None,
    };
    t.catalog.save_build(&build).await?;
    rec.builds.push(build.build_id.clone());
    rec.cpu_count = cpu;
    rec.memory_mb = mem;
    rec.updated_at_ms = now;
    t.catalog.save_record(&rec).await?;
    let shown_tags = if tags.is_empty() {
        vec![DEFAULT_TAG.to_string()]
    } else {
        tags
    };
    Ok(json_response(
        StatusCode::ACCEPTED,
        &serde_json::json!({
            "templateID": rec.template_id,
            "buildID": build.build_id,
            "public": rec.public,
            "names": rec.names,
            "aliases": rec.names,
            "tags": shown_tags,
        }),
    ))
}

/// The signature of an upload link.
fn upload_signature(c: &TemplateCatalog, tid: &str, hash: &str, expires: u64) -> String {
    hex::encode(c.mac(&[
        b"upload",
        tid.as_bytes(),
        hash.as_bytes(),
        expires.to_string().as_bytes(),
    ]))
}

/// The scheme and host clients reached this node (or the gateway in front) by.
fn public_base(state: &ApiState, req: &Request<Incoming>) -> Option<String> {
    let h = req.headers();
    let host = h
        .get("x-forwarded-host")
        .or_else(|| h.get(header::HOST))
        .and_then(|v| v.to_str().ok())
        .map(|v| v.split(',').next().unwrap_or(v).trim().to_string())
        .or_else(|| req.uri().authority().map(|a| a.to_string()))?;
    if host.is_empty() || host.contains(['/', ' ', '@']) {
        return None;
    }
    let proto = h
        .get("x-forwarded-proto")
        .and_then(|v| v.to_str().ok())
        .map(|v| v.trim().to_ascii_lowercase())
        .filter(|p| p == "http" || p == "https")
        .unwrap_or_else(|| {
            if state.tls.load(std::sync::atomic::Ordering::Relaxed) {
                "https".into()
            } else {
                "http".into()
            }
        });
    Some(format!("{proto}://{host}"))
}

/// `GET /templates/{id}/files/{hash}`: whether the files are there, and a signed upload
/// link when they are not.
pub(super) async fn file_link(
    state: &ApiState,
    tid: &str,
    hash: &str,
    req: &Request<Incoming>,
) -> Reply {
    let t = templates(state)?;
    let rec = template_of(t, tid).await?;
    let hash = decode(hash);
    if !is_sha256_hex(&hash) {
        return Err(bad_request(format!(
            "{hash:?} is not a files hash (64 lowercase hex digits)"
        )));
    }
    if t.catalog.has_file(&rec.template_id, &hash).await? {
        return Ok(json_response(
            StatusCode::CREATED,
            &serde_json::json!({"present": true}),
        ));
    }
    let Some(base) = public_base(state, req) else {
        return Err(bad_request(
            "the request names no Host: an upload link needs the address clients reach the API by",
        ));
    };
    let expires = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
        + UPLOAD_LINK_TTL.as_secs();
    let sig = upload_signature(&t.catalog, &rec.template_id, &hash, expires);
    Ok(json_response(
        StatusCode::CREATED,
        &serde_json::json!({
            "present": false,
            "url": format!("{base}/templates/{}/files/{hash}?expires={expires}&signature={sig}", rec.template_id),
        }),
    ))
}

/// `PUT /templates/{id}/files/{hash}?expires=…&signature=…`: the upload, authorized by
/// the link's signature (no API key: the SDKs send none there).
pub(super) async fn upload(
    state: &ApiState,
    tid: &str,
    hash: &str,
    req: Request<Incoming>,
) -> Reply {
    let t = templates(state)?;
    let tid = decode(tid);
    let hash = decode(hash);
    let q = query_pairs(req.uri().query().unwrap_or(""));
    let expires: u64 = q.get("expires").and_then(|e| e.parse().ok()).unwrap_or(0);
    let given = q
        .get("signature")
        .and_then(|s| hex::decode(s).ok())
        .unwrap_or_default();
    let want = hex::decode(upload_signature(&t.catalog, &tid, &hash, expires)).unwrap_or_default();
    let now = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(u64::MAX);
    if !is_template_id(&tid) || !is_sha256_hex(&hash) || !bool::from(want.ct_eq(&given)) {
        return Err(json_error(
            StatusCode::FORBIDDEN,
            "this upload link is not valid: ask GET /templates/{id}/files/{hash} for a new one",
        )
        .into());
    }
    if expires < now {
        return Err(json_error(
            StatusCode::FORBIDDEN,
            "this upload link has expired: ask GET /templates/{id}/files/{hash} for a new one",
        )
        .into());
    }
    if let Some(len) = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        && len > MAX_UPLOAD
    {
        return Err(json_error(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("the upload is larger than the allowed {MAX_UPLOAD} bytes"),
        )
        .into());
    }
    // Into a local file first (bounded), then into the store whole.
    let dir = t
        .settings
        .staging
        .join(format!("upload-{}", uuid::Uuid::now_v7()));
    std::fs::create_dir_all(&dir)
        .map_err(|e| LifecycleError::Internal(format!("creating {}: {e}", dir.display())))?;
    let result = async {
        let path = dir.join("files");
        let mut f = tokio::fs::File::create(&path)
            .await
            .map_err(|e| LifecycleError::Internal(format!("creating {}: {e}", path.display())))?;
        let mut body = req.into_body();
        let mut total = 0u64;
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| bad_request(format!("reading the upload: {e}")))?;
            if let Ok(data) = frame.into_data() {
                total += data.len() as u64;
                if total > MAX_UPLOAD {
                    return Err(json_error(
                        StatusCode::PAYLOAD_TOO_LARGE,
                        format!("the upload is larger than the allowed {MAX_UPLOAD} bytes"),
                    )
                    .into());
                }
                tokio::io::AsyncWriteExt::write_all(&mut f, &data)
                    .await
                    .map_err(|e| LifecycleError::Internal(format!("writing the upload: {e}")))?;
            }
        }
        tokio::io::AsyncWriteExt::flush(&mut f)
            .await
            .map_err(|e| LifecycleError::Internal(format!("writing the upload: {e}")))?;
        drop(f);
        t.catalog
            .storage()
            .put_file(&TemplateCatalog::file_key(&tid, &hash), &path)
            .await
            .map_err(|e| LifecycleError::Internal(format!("storing the upload: {e}")))?;
        Ok::<_, super::error::Reject>(())
    }
    .await;
    let _ = std::fs::remove_dir_all(&dir);
    result?;
    Ok(status_only(StatusCode::OK))
}

/// `POST /v2/templates/{id}/builds/{build}` (and `/templates/{id}/builds/{build}`): the
/// steps; the build starts on this node.
pub(super) async fn start_build(
    state: &ApiState,
    tid: &str,
    bid: &str,
    req: Request<Incoming>,
) -> Reply {
    let t = templates(state)?;
    let rec = template_of(t, tid).await?;
    let bid = decode(bid);
    let body: BuildRequestJson = read_json(req).await?;
    let spec = BuildSpec::parse(body).map_err(|e| bad_request(e.0))?;
    let Some(build) = t.catalog.build(&rec.template_id, &bid).await? else {
        return Err(not_found(format!(
            "build {bid} of template {} not found: create it with POST /v3/templates",
            rec.template_id
        )));
    };
    if build.status != BuildStatus::Waiting || build.node_id.is_some() {
        return Err(json_error(
            StatusCode::CONFLICT,
            format!(
                "build {bid} was started already (it is {}): create a new build with POST /v3/templates",
                build.status.as_str()
            ),
        )
        .into());
    }
    // One build of a template at a time, across the cluster.
    for other in rec.builds.iter().filter(|b| **b != bid) {
        if let Some(b) = t.catalog.build(&rec.template_id, other).await? {
            let (status, _) = Templates::effective_status(&b);
            if !status.is_final() && b.node_id.is_some() {
                return Err(json_error(
                    StatusCode::CONFLICT,
                    format!(
                        "template {} is being built (build {}, on node {}): wait for it to finish",
                        rec.template_id,
                        b.build_id,
                        b.node_id.as_deref().unwrap_or("?")
                    ),
                )
                .into());
            }
        }
    }
    state.orch.start_build(&rec, build, spec)?;
    Ok(status_only(StatusCode::ACCEPTED))
}

/// The template and build that path segments name (404 naming what is missing).
async fn build_of<'a>(
    state: &'a ApiState,
    tid: &str,
    bid: &str,
) -> Result<(&'a Arc<Templates>, TemplateRecord, BuildRecord), super::error::Reject> {
    let t = templates(state)?;
    let rec = template_of(t, tid).await?;
    let bid = decode(bid);
    match t.catalog.build(&rec.template_id, &bid).await? {
        Some(b) => Ok((t, rec, b)),
        None => Err(not_found(format!(
            "build {bid} of template {} not found",
            rec.template_id
        ))),
    }
}

fn level_rank(l: &str) -> u8 {
    match l {
        "debug" => 0,
        "info" => 1,
        "warn" => 2,
        _ => 3,
    }
}

/// `GET /templates/{id}/builds/{build}/status?logsOffset=&limit=&level=`.
pub(super) async fn build_status(
    state: &ApiState,
    tid: &str,
    bid: &str,
    req: &Request<Incoming>,
) -> Reply {
    let (t, rec, b) = build_of(state, tid, bid).await?;
    let bid = b.build_id.clone();
    let q = query_pairs(req.uri().query().unwrap_or(""));
    let offset: usize = q
        .get("logsOffset")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let limit: usize = q
        .get("limit")
        .and_then(|v| v.parse().ok())
        .unwrap_or(100)
        .clamp(1, MAX_LOG_PAGE);
    let min_level = q.get("level").map(|l| level_rank(l)).unwrap_or(0);
    let (status, reason) = Templates::effective_status(&b);
    let logs = t.catalog.logs(&bid).await?;
    let entries: Vec<_> = logs
        .iter()
        .filter(|l| level_rank(&l.level) >= min_level)
        .skip(offset)
        .take(limit)
        .collect();
    let mut out = serde_json::json!({
        "templateID": rec.template_id,
        "buildID": bid,
        "status": status.as_str(),
        "logs": [],
        "logEntries": entries,
    });
    if let Some(r) = reason {
        let mut reason = serde_json::json!({"message": r.message});
        if let Some(step) = r.step {
            reason["step"] = step.into();
        }
        reason["logEntries"] = serde_json::to_value(
            logs.iter()
                .filter(|l| l.level == "error")
                .cloned()
                .collect::<Vec<_>>(),
        )
        .unwrap_or_default();
        out["reason"] = reason;
    }
    Ok(json_response(StatusCode::OK, &out))
}

/// `GET /templates/{id}/builds/{build}/logs?cursor=&limit=&direction=&level=`.
pub(super) async fn build_logs(
    state: &ApiState,
    tid: &str,
    bid: &str,
    req: &Request<Incoming>,
) -> Reply {
    let (t, _, b) = build_of(state, tid, bid).await?;
    let bid = b.build_id.clone();
    let q = query_pairs(req.uri().query().unwrap_or(""));
    let limit: usize = q
        .get("limit")
        .and_then(|v| v.parse().ok())
        .unwrap_or(100)
        .clamp(1, MAX_LOG_PAGE);
    let min_level = q.get("level").map(|l| level_rank(l)).unwrap_or(0);
    let cursor: Option<i64> = q.get("cursor").and_then(|v| v.parse().ok());
    let backward = q.get("direction").map(String::as_str) == Some("backward");
    let mut logs: Vec<_> = t
        .catalog
        .logs(&bid)
        .await?
        .into_iter()
        .filter(|l| level_rank(&l.level) >= min_level)
        .filter(|l| {
            let Some(c) = cursor else { return true };
            let ms = time::OffsetDateTime::parse(
                &l.timestamp,
                &time::format_description::well_known::Rfc3339,
            )
            .map(|t| (t.unix_timestamp_nanos() / 1_000_000) as i64)
            .unwrap_or(0);
            if backward { ms <= c } else { ms >= c }
        })
        .collect();
    if backward {
        logs.reverse();
    }
    logs.truncate(limit);
    Ok(json_response(
        StatusCode::OK,
        &serde_json::json!({"logs": logs}),
    ))
}
