//! The template catalog as the E2B API shows it: list, get, update and delete templates,
//! resolve names (also `base` and snapshots' names), and tags.

use std::collections::BTreeMap;

use http::{Request, StatusCode};
use hyper::body::Incoming;
use serde::Deserialize;

use super::ApiState;
use super::body::{json_response, read_json};
use super::error::{Reply, bad_request};
use super::templates::{decode, not_found, now_ms, template_of, templates};
use crate::clock::ms_rfc3339;
use crate::dataplane::status_only;
use crate::lifecycle::{DEFAULT_TAG, Templates};
use crate::template::BASE_TEMPLATE;
use crate::template::catalog::{BuildRecord, TemplateRecord, validate_name, validate_tag};
use crate::template::steps::split_reference;

fn template_json(rec: &TemplateRecord, latest: Option<&BuildRecord>) -> serde_json::Value {
    let (status, build_id) = match latest {
        Some(b) => (
            Templates::effective_status(b).0.as_str(),
            b.build_id.clone(),
        ),
        None => ("waiting", String::new()),
    };
    let ready = rec.tags.get(DEFAULT_TAG).cloned();
    serde_json::json!({
        "templateID": rec.template_id,
        "buildID": ready.unwrap_or(build_id),
        "cpuCount": rec.cpu_count,
        "memoryMB": rec.memory_mb,
        "diskSizeMB": rec.disk_size_mb,
        "public": rec.public,
        "aliases": rec.names,
        "names": rec.names,
        "createdAt": ms_rfc3339(rec.created_at_ms),
        "updatedAt": ms_rfc3339(rec.updated_at_ms),
        "createdBy": null,
        "lastSpawnedAt": null,
        "spawnCount": 0,
        "buildCount": rec.builds.len(),
        "envdVersion": agentenv_guest::ENVD_VERSION,
        "buildStatus": status,
    })
}

fn build_json(b: &BuildRecord) -> serde_json::Value {
    let (status, reason) = Templates::effective_status(b);
    let mut v = serde_json::json!({
        "buildID": b.build_id,
        "status": status.as_str(),
        "createdAt": ms_rfc3339(b.created_at_ms),
        "updatedAt": ms_rfc3339(b.updated_at_ms),
        "cpuCount": b.cpu_count,
        "memoryMB": b.memory_mb,
        "envdVersion": agentenv_guest::ENVD_VERSION,
    });
    if let Some(f) = b.finished_at_ms {
        v["finishedAt"] = ms_rfc3339(f).into();
    }
    if let Some(r) = reason {
        v["reason"] = serde_json::json!({"message": r.message, "step": r.step});
    }
    v
}

async fn latest_build(t: &Templates, rec: &TemplateRecord) -> Option<BuildRecord> {
    let id = rec.builds.last()?;
    t.catalog.build(&rec.template_id, id).await.ok().flatten()
}

/// `GET /templates`, `GET /v2/templates`, `GET /default-templates` (`base` only there).
pub(super) async fn list(state: &ApiState, defaults: bool) -> Reply {
    if defaults {
        return Ok(json_response(
            StatusCode::OK,
            &serde_json::json!([base_json(state)]),
        ));
    }
    let t = templates(state)?;
    let mut out = Vec::new();
    for rec in t.catalog.list().await? {
        let latest = latest_build(t, &rec).await;
        out.push(template_json(&rec, latest.as_ref()));
    }
    Ok(json_response(StatusCode::OK, &out))
}

fn base_json(state: &ApiState) -> serde_json::Value {
    serde_json::json!({
        "templateID": BASE_TEMPLATE,
        "buildID": BASE_TEMPLATE,
        "cpuCount": state.orch.config().default_cpu_count,
        "memoryMB": state.orch.config().default_memory_mb,
        "diskSizeMB": 0,
        "public": true,
        "aliases": [BASE_TEMPLATE],
        "names": [BASE_TEMPLATE],
        "createdAt": ms_rfc3339(0),
        "updatedAt": ms_rfc3339(0),
        "createdBy": null,
        "lastSpawnedAt": null,
        "spawnCount": 0,
        "buildCount": 1,
        "envdVersion": agentenv_guest::ENVD_VERSION,
        "buildStatus": "ready",
        "isDefault": true,
    })
}

/// `GET /templates/{id}`: the template and its builds.
pub(super) async fn get(state: &ApiState, tid: &str) -> Reply {
    if decode(tid) == BASE_TEMPLATE {
        let mut v = base_json(state);
        v["builds"] = serde_json::json!([]);
        return Ok(json_response(StatusCode::OK, &v));
    }
    let t = templates(state)?;
    let rec = template_of(t, tid).await?;
    let mut builds = Vec::new();
    for id in rec.builds.iter().rev() {
        if let Some(b) = t.catalog.build(&rec.template_id, id).await? {
            builds.push(b);
        }
    }
    let mut v = template_json(&rec, builds.first());
    v["builds"] = builds.iter().map(build_json).collect::<Vec<_>>().into();
    let tags: BTreeMap<&String, &String> = rec.tags.iter().collect();
    v["tags"] = serde_json::to_value(tags).unwrap_or_default();
    Ok(json_response(StatusCode::OK, &v))
}

#[derive(Deserialize)]
struct Patch {
    #[serde(default)]
    public: Option<bool>,
}

/// `PATCH /templates/{id}` and `/v2/templates/{id}`: the public flag.
pub(super) async fn patch(state: &ApiState, tid: &str, req: Request<Incoming>, v2: bool) -> Reply {
    let t = templates(state)?;
    let mut rec = template_of(t, tid).await?;
    let body: Patch = read_json(req).await?;
    if let Some(p) = body.public {
        rec.public = p;
        rec.updated_at_ms = now_ms();
        t.catalog.save_record(&rec).await?;
    }
    if v2 {
        Ok(json_response(
            StatusCode::OK,
            &serde_json::json!({"names": rec.names}),
        ))
    } else {
        Ok(status_only(StatusCode::OK))
    }
}

/// `DELETE /templates/{id or name}`: the template (or a snapshot of that id or name).
pub(super) async fn delete(state: &ApiState, tid: &str) -> Reply {
    let r = decode(tid);
    if r == BASE_TEMPLATE {
        return Err(bad_request("the built-in template base cannot be deleted"));
    }
    if let Ok(t) = templates(state) {
        let (name, _) = split_reference(&r);
        if let Some(rec) = t.catalog.resolve(name).await? {
            t.catalog.delete(&rec).await?;
            return Ok(status_only(StatusCode::NO_CONTENT));
        }
    }
    // Deleting what is gone already is done (snapshots' deletes are idempotent).
    state.orch.snapshot_repository()?.delete(&r).await?;
    Ok(status_only(StatusCode::NO_CONTENT))
}

/// `GET /templates/aliases/{alias}`: the template (or snapshot) of that name.
pub(super) async fn alias(state: &ApiState, alias: &str) -> Reply {
    let a = decode(alias);
    let (name, _) = split_reference(&a);
    // The built-in template's name is reserved for other templates, not unknown.
    if name == BASE_TEMPLATE {
        return Ok(json_response(
            StatusCode::OK,
            &serde_json::json!({"templateID": BASE_TEMPLATE, "public": true}),
        ));
    }
    if validate_name(name).is_err() && crate::snapshot::validate_name(name).is_err() {
        return Err(bad_request(format!(
            "{a:?} is not a template name: use letters, digits, '.', '_' and '-'"
        )));
    }
    // A template whose builds all failed (or run still) is not there yet.
    if let Ok(t) = templates(state)
        && let Some(rec) = t.catalog.by_name(name).await?
        && !rec.tags.is_empty()
    {
        return Ok(json_response(
            StatusCode::OK,
            &serde_json::json!({"templateID": rec.template_id, "public": rec.public}),
        ));
    }
    if let Ok(repo) = state.orch.snapshot_repository()
        && crate::snapshot::validate_name(name).is_ok()
        && let Some(rec) = repo.resolve(name).await?
    {
        return Ok(json_response(
            StatusCode::OK,
            &serde_json::json!({"templateID": rec.id, "public": false}),
        ));
    }
    Err(not_found(format!("template {a} not found")))
}

#[derive(Deserialize)]
struct AssignTags {
    target: String,
    tags: Vec<String>,
}

#[derive(Deserialize)]
struct RemoveTags {
    name: String,
    tags: Vec<String>,
}

/// `POST /templates/tags`: `tags` point to the build `target` (`name:tag`) names.
pub(super) async fn assign_tags(state: &ApiState, req: Request<Incoming>) -> Reply {
    let t = templates(state)?;
    let body: AssignTags = read_json(req).await?;
    for tag in &body.tags {
        validate_tag(tag)?;
    }
    let Some((mut rec, b)) = state.orch.resolve_build(t, &body.target).await? else {
        return Err(not_found(format!(
            "{} names no ready build of a template",
            body.target
        )));
    };
    for tag in &body.tags {
        rec.tags.insert(tag.clone(), b.build_id.clone());
    }
    rec.updated_at_ms = now_ms();
    t.catalog.save_record(&rec).await?;
    Ok(json_response(
        StatusCode::CREATED,
        &serde_json::json!({"buildID": b.build_id, "tags": body.tags}),
    ))
}

/// `DELETE /templates/tags`.
pub(super) async fn remove_tags(state: &ApiState, req: Request<Incoming>) -> Reply {
    let t = templates(state)?;
    let body: RemoveTags = read_json(req).await?;
    let (name, _) = split_reference(&body.name);
    let Some(mut rec) = t.catalog.resolve(name).await? else {
        return Err(not_found(format!("template {} not found", body.name)));
    };
    for tag in &body.tags {
        rec.tags.remove(tag);
    }
    rec.updated_at_ms = now_ms();
    t.catalog.save_record(&rec).await?;
    Ok(status_only(StatusCode::NO_CONTENT))
}

/// `GET /templates/{id}/tags`.
pub(super) async fn tags(state: &ApiState, tid: &str) -> Reply {
    let t = templates(state)?;
    let rec = template_of(t, tid).await?;
    let mut out = Vec::new();
    for (tag, bid) in &rec.tags {
        let created = match t.catalog.build(&rec.template_id, bid).await? {
            Some(b) => b.finished_at_ms.unwrap_or(b.created_at_ms),
            None => rec.updated_at_ms,
        };
        out.push(serde_json::json!({"tag": tag, "buildID": bid, "createdAt": ms_rfc3339(created)}));
    }
    Ok(json_response(StatusCode::OK, &out))
}
