//! Sandbox handlers: create, list, get, delete, pause, resume, connect, timeout and
//! refresh, and the sandbox's JSON shapes.

use std::time::Duration;

use http::header::HeaderValue;
use http::{Request, StatusCode};
use hyper::body::Incoming;

use super::ApiState;
use super::body::{json_response, page_response, read_json};
use super::error::{Reply, bad_request};
use super::model::{
    LifecycleJson, ListQuery, ListedSandboxJson, NewSandbox, RefreshBody, SandboxDetailJson,
    SandboxJson, TimeoutBody,
};
use crate::clock::ms_rfc3339;
use crate::dataplane::status_only;
use crate::ids::parse_sandbox_id;
use crate::lifecycle::{Connected, LifecycleError, OnTimeout, SandboxRecord, State};

/// Longest `duration` of `POST /refreshes`, in seconds.
const MAX_REFRESH_SECS: u64 = 3600;

/// `POST /sandboxes`, `POST /v2/sandboxes`.
pub(super) async fn create(state: &ApiState, req: Request<Incoming>) -> Reply {
    let body: NewSandbox = read_json(req).await?;
    let rec = state.orch.create(body.into_request()?).await?;
    let mut r = json_response(StatusCode::CREATED, &sandbox_json(state, &rec));
    if let Ok(v) = HeaderValue::from_str(&rec.id) {
        r.headers_mut().insert("x-agentenv-sandbox-id", v);
    }
    Ok(r)
}

/// `GET /sandboxes`: the running sandboxes.
pub(super) fn list_v1(state: &ApiState) -> Reply {
    let items: Vec<_> = sorted(state.orch.list())
        .into_iter()
        .filter(|r| r.state.api_name() == "running")
        .map(|r| listed_json(&r))
        .collect();
    Ok(json_response(StatusCode::OK, &items))
}

/// `GET /v2/sandboxes`: filtered by state and metadata, in pages.
pub(super) fn list_v2(state: &ApiState, req: &Request<Incoming>) -> Reply {
    let q = ListQuery::parse(req.uri().query().unwrap_or("")).map_err(bad_request)?;
    let (items, next) = q.apply(sorted(state.orch.list()));
    Ok(page_response(
        &items.iter().map(listed_json).collect::<Vec<_>>(),
        next,
    ))
}

/// `GET /sandboxes/{id}`.
pub(super) fn get(state: &ApiState, id: &str) -> Reply {
    let id = parse_sandbox_id(id)?;
    let rec = state.orch.get(&id)?;
    if rec.state == State::Killing {
        return Err(LifecycleError::NotFound(id).into());
    }
    Ok(json_response(StatusCode::OK, &detail_json(state, &rec)))
}

/// `DELETE /sandboxes/{id}`.
pub(super) async fn delete(state: &ApiState, id: &str) -> Reply {
    let id = parse_sandbox_id(id)?;
    state.orch.delete(&id).await?;
    Ok(status_only(StatusCode::NO_CONTENT))
}

/// `POST /sandboxes/{id}/pause`.
pub(super) async fn pause(state: &ApiState, id: &str, req: Request<Incoming>) -> Reply {
    let id = parse_sandbox_id(id)?;
    let _: serde_json::Value = read_json(req).await?;
    state.orch.pause(&id).await?;
    Ok(status_only(StatusCode::NO_CONTENT))
}

/// `POST /sandboxes/{id}/resume`.
pub(super) async fn resume(state: &ApiState, id: &str, req: Request<Incoming>) -> Reply {
    let id = parse_sandbox_id(id)?;
    let body: TimeoutBody = read_json(req).await?;
    let rec = state
        .orch
        .resume(&id, body.timeout.map(Duration::from_secs))
        .await?;
    Ok(json_response(
        StatusCode::CREATED,
        &sandbox_json(state, &rec),
    ))
}

/// `POST /sandboxes/{id}/connect`: 200 when it was running, 201 when it was resumed.
pub(super) async fn connect(state: &ApiState, id: &str, req: Request<Incoming>) -> Reply {
    let id = parse_sandbox_id(id)?;
    let body: TimeoutBody = read_json(req).await?;
    let (rec, how) = state
        .orch
        .connect(&id, body.timeout.map(Duration::from_secs))
        .await?;
    let status = match how {
        Connected::WasRunning => StatusCode::OK,
        Connected::Resumed => StatusCode::CREATED,
    };
    Ok(json_response(status, &sandbox_json(state, &rec)))
}

/// `POST /sandboxes/{id}/timeout`.
pub(super) async fn set_timeout(state: &ApiState, id: &str, req: Request<Incoming>) -> Reply {
    let id = parse_sandbox_id(id)?;
    let body: TimeoutBody = read_json(req).await?;
    let t = body
        .timeout
        .map(Duration::from_secs)
        .unwrap_or(state.orch.config().default_timeout);
    state.orch.set_timeout(&id, t).await?;
    Ok(status_only(StatusCode::NO_CONTENT))
}

/// `POST /sandboxes/{id}/refreshes`.
pub(super) async fn refresh(state: &ApiState, id: &str, req: Request<Incoming>) -> Reply {
    let id = parse_sandbox_id(id)?;
    let body: RefreshBody = read_json(req).await?;
    let d = body
        .duration
        .unwrap_or(state.orch.config().default_timeout.as_secs());
    if d > MAX_REFRESH_SECS {
        return Err(bad_request("duration must be at most 3600 seconds"));
    }
    state.orch.refresh(&id, Duration::from_secs(d)).await?;
    Ok(status_only(StatusCode::NO_CONTENT))
}

/// `POST /sandboxes/{id}/fork`.
pub(super) async fn fork(_state: &ApiState, _id: &str, _req: Request<Incoming>) -> Reply {
    Err(crate::dataplane::json_error(StatusCode::NOT_IMPLEMENTED, "not built yet").into())
}

/// The listed sandboxes: newest first, ties by id, none being deleted.
fn sorted(mut v: Vec<SandboxRecord>) -> Vec<SandboxRecord> {
    v.retain(|r| r.state != State::Killing);
    v.sort_by(|a, b| b.created_at_ms.cmp(&a.created_at_ms).then(a.id.cmp(&b.id)));
    v
}

fn sandbox_json(state: &ApiState, rec: &SandboxRecord) -> SandboxJson {
    SandboxJson {
        template_id: template_id(rec),
        sandbox_id: rec.id.clone(),
        alias: template_alias(rec),
        client_id: String::new(),
        envd_version: agentenv_guest::ENVD_VERSION.to_string(),
        envd_access_token: Some(state.orch.tokens().envd_token(&rec.id)),
        traffic_access_token: (!rec.options.allow_public_traffic)
            .then(|| state.orch.tokens().traffic_token(&rec.id)),
        domain: state.domains.first().cloned(),
    }
}

/// `templateID` of a sandbox: the snapshot it started from, else its template.
fn template_id(rec: &SandboxRecord) -> String {
    rec.snapshot_id
        .clone()
        .unwrap_or_else(|| rec.template.clone())
}

/// `alias` of a sandbox: the snapshot's name, else the template's.
fn template_alias(rec: &SandboxRecord) -> Option<String> {
    match &rec.snapshot_id {
        Some(_) => rec.snapshot_name.clone(),
        None => Some(rec.template.clone()),
    }
}

/// `endAt`: when the timeout fires; a paused sandbox's is a century away.
fn end_at(rec: &SandboxRecord) -> String {
    ms_rfc3339(rec.expires_at_ms.unwrap_or(36_500 * 86_400 * 1000))
}

fn listed_json(rec: &SandboxRecord) -> ListedSandboxJson {
    ListedSandboxJson {
        template_id: template_id(rec),
        alias: template_alias(rec),
        sandbox_id: rec.id.clone(),
        client_id: String::new(),
        started_at: ms_rfc3339(rec.created_at_ms),
        end_at: end_at(rec),
        cpu_count: rec.cpu_count,
        memory_mb: rec.memory_mb,
        disk_size_mb: 0,
        metadata: rec.options.metadata.clone(),
        state: rec.state.api_name().to_string(),
        envd_version: agentenv_guest::ENVD_VERSION.to_string(),
    }
}

fn detail_json(state: &ApiState, rec: &SandboxRecord) -> SandboxDetailJson {
    SandboxDetailJson {
        listed: listed_json(rec),
        envd_access_token: Some(state.orch.tokens().envd_token(&rec.id)),
        domain: state.domains.first().cloned(),
        allow_internet_access: rec.options.allow_internet_access,
        network: super::network::detail_json(rec),
        lifecycle: LifecycleJson {
            auto_resume: rec.options.auto_resume,
            on_timeout: match rec.options.on_timeout {
                OnTimeout::Pause => "pause".into(),
                OnTimeout::Kill => "kill".into(),
            },
        },
    }
}
