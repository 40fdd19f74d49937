//! Sandbox handlers: create, list, get, delete, pause, resume, connect, timeout and
//! refresh, and the sandbox's JSON shapes.

use std::time::{Duration, Instant};

use http::header::HeaderValue;
use http::{Request, StatusCode};
use hyper::body::Incoming;

use super::ApiState;
use super::body::{json_response, page_response, parse_json, read_body, read_json};
use super::error::{Reply, bad_request, lifecycle_error_parts};
use super::idempotency::{Answer, Begin};
use super::model::{
    ForkBody, LifecycleJson, ListQuery, ListedSandboxJson, NewSandbox, PauseBody, RefreshBody,
    SandboxDetailJson, SandboxJson, TimeoutBody, VolumeMountJson,
};
use crate::clock::ms_rfc3339;
use crate::dataplane::status_only;
use crate::ids::parse_sandbox_id;
use crate::lifecycle::{
    Connected, LifecycleError, MAX_FORKS, OnTimeout, PauseMode, SandboxRecord, State,
};
use crate::timing::{SERVER_TIMING, Timings};

/// Longest `duration` of `POST /refreshes`, in seconds.
const MAX_REFRESH_SECS: u64 = 3600;

/// `POST /sandboxes`, `POST /v2/sandboxes`; with `Idempotency-Key`, a retry gets the
/// first request's sandbox. A sandbox made by this request is answered with the phases
/// of its create in `Server-Timing`.
pub(super) async fn create(state: &ApiState, req: Request<Incoming>) -> Reply {
    let mut timing = CreateTiming {
        started: Instant::now(),
        phases: Timings::new(),
        made: None,
    };
    let key = req
        .headers()
        .get(agentenv_core::idempotency::IDEMPOTENCY_KEY_HEADER)
        .map(|v| v.to_str().map(str::to_string).unwrap_or_default());
    let body = read_body(req).await?;
    timing.phases.push("request", timing.started.elapsed());
    let Some(key) = key else {
        let answer = create_answer(state, &body, None, &mut timing).await?;
        return timing.answer(created(answer));
    };
    match state.idempotency.begin(&key, &body).await {
        Err(e) => {
            let (status, code) = e.status_and_code();
            let mut r = json_response(
                status,
                &agentenv_core::error::ErrorBody::new(status.as_u16(), e.to_string())
                    .with_error_code(code),
            );
            // The SDKs retry 503s; a retry would meet the same answer.
            r.headers_mut()
                .insert("should-retry", HeaderValue::from_static("false"));
            Ok(r)
        }
        Ok(Begin::Replay(answer)) => {
            let mut r = created(answer)?;
            r.headers_mut()
                .insert("idempotent-replayed", HeaderValue::from_static("true"));
            Ok(r)
        }
        Ok(Begin::Run(claim)) => match create_answer(state, &body, Some(&key), &mut timing).await {
            Ok(answer) => {
                claim.finish(answer.clone());
                timing.answer(created(answer))
            }
            // The claim goes unfinished: the key is free for a retry.
            Err(reject) => Err(reject),
        },
    }
}

/// The phases of a create answered by this node: when the request began, and when
/// the sandbox was made (`None`: this request made none).
struct CreateTiming {
    started: Instant,
    phases: Timings,
    made: Option<Instant>,
}

impl CreateTiming {
    /// `reply` with the create's phases and its total (`node`) in `Server-Timing`, when
    /// this request made the sandbox; building the answer since is `answer`.
    fn answer(mut self, reply: Reply) -> Reply {
        let mut r = reply?;
        if let Some(made) = self.made {
            self.phases.push("answer", made.elapsed());
            let value = self.phases.header(("node", self.started.elapsed()));
            r.headers_mut().insert(SERVER_TIMING, value);
        }
        Ok(r)
    }
}

/// Creates the sandbox `body` asks for; its JSON. With an idempotency `key` the sandbox
/// gets the key's id, and when it exists already (the key's first request made it before
/// this node restarted and forgot the key), that sandbox is the answer. The create's
/// phases are added to `timing`.
async fn create_answer(
    state: &ApiState,
    body: &[u8],
    key: Option<&str>,
    timing: &mut CreateTiming,
) -> Result<Answer, super::error::Reject> {
    let started = Instant::now();
    let new: NewSandbox = parse_json(body)?;
    let mut req = new.into_request()?;
    if let Some(key) = key {
        let id = agentenv_core::idempotency::sandbox_id(key);
        if let Ok(rec) = state.orch.get(&id)
            && rec.state != State::Killing
        {
            return Ok(answer(state, &rec));
        }
        req.id = Some(id);
    }
    timing.phases.push("parse", started.elapsed());
    let (rec, phases) = state.orch.create_timed(req).await;
    timing.phases.extend(&phases);
    let rec = rec?;
    timing.made = Some(Instant::now());
    Ok(answer(state, &rec))
}

/// The 201 answer of a create of `rec`.
fn answer(state: &ApiState, rec: &SandboxRecord) -> Answer {
    Answer {
        status: StatusCode::CREATED,
        body: serde_json::to_vec(&sandbox_json(state, rec))
            .unwrap_or_default()
            .into(),
    }
}

/// The response of a create: its JSON, and the sandbox id in `x-agentenv-sandbox-id`
/// (what the gateway records without reading the body).
fn created(answer: Answer) -> Reply {
    let id = serde_json::from_slice::<serde_json::Value>(&answer.body)
        .ok()
        .and_then(|v| v.get("sandboxID")?.as_str().map(str::to_string));
    let mut r = http::Response::new(crate::dataplane::full(answer.body));
    *r.status_mut() = answer.status;
    r.headers_mut().insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    if let Some(v) = id.and_then(|id| HeaderValue::from_str(&id).ok()) {
        r.headers_mut().insert("x-agentenv-sandbox-id", v);
    }
    Ok(r)
}

/// `GET /sandboxes`: the running sandboxes (filtered by `metadata`).
pub(super) fn list_v1(state: &ApiState, req: &Request<Incoming>) -> Reply {
    let q = ListQuery::parse_v1(req.uri().query().unwrap_or("")).map_err(bad_request)?;
    let (items, _) = q.apply(sorted(state.orch.list()));
    let items: Vec<_> = items
        .iter()
        .filter(|r| r.state.api_name() == "running")
        .map(|r| listed_json(state, r))
        .collect();
    Ok(json_response(StatusCode::OK, &items))
}

/// `GET /v2/sandboxes`: filtered by state and metadata, in pages.
pub(super) fn list_v2(state: &ApiState, req: &Request<Incoming>) -> Reply {
    let q = ListQuery::parse(req.uri().query().unwrap_or("")).map_err(bad_request)?;
    let (items, next) = q.apply(sorted(state.orch.list()));
    Ok(page_response(
        &items
            .iter()
            .map(|r| listed_json(state, r))
            .collect::<Vec<_>>(),
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
    let body: PauseBody = read_json(req).await?;
    let mode = PauseMode::from_memory(body.memory.unwrap_or(true));
    state
        .orch
        .pause(&id, mode, body.require_healthy_guest.unwrap_or(false))
        .await?;
    Ok(status_only(StatusCode::NO_CONTENT))
}

/// `POST /sandboxes/{id}/resume`; its time in the node is `node` in `Server-Timing`.
pub(super) async fn resume(state: &ApiState, id: &str, req: Request<Incoming>) -> Reply {
    let started = Instant::now();
    let id = parse_sandbox_id(id)?;
    let body: TimeoutBody = read_json(req).await?;
    let rec = state
        .orch
        .resume(
            &id,
            body.timeout.map(Duration::from_secs),
            PauseMode::from_memory(body.memory.unwrap_or(true)),
        )
        .await?;
    Ok(timed(
        json_response(StatusCode::CREATED, &sandbox_json(state, &rec)),
        started,
    ))
}

/// `resp` with the time since `started` as `node` in `Server-Timing`.
fn timed(
    mut resp: http::Response<crate::dataplane::Body>,
    started: Instant,
) -> http::Response<crate::dataplane::Body> {
    let value = Timings::new().header(("node", started.elapsed()));
    resp.headers_mut().insert(SERVER_TIMING, value);
    resp
}

/// `POST /sandboxes/{id}/connect`: 200 when it was running, 201 when it was resumed; its
/// time in the node is `node` in `Server-Timing`.
pub(super) async fn connect(state: &ApiState, id: &str, req: Request<Incoming>) -> Reply {
    let started = Instant::now();
    let id = parse_sandbox_id(id)?;
    let body: TimeoutBody = read_json(req).await?;
    let (rec, how) = state
        .orch
        .connect(
            &id,
            body.timeout.map(Duration::from_secs),
            PauseMode::from_memory(body.memory.unwrap_or(true)),
        )
        .await?;
    let status = match how {
        Connected::WasRunning => StatusCode::OK,
        Connected::Resumed => StatusCode::CREATED,
    };
    Ok(timed(
        json_response(status, &sandbox_json(state, &rec)),
        started,
    ))
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

/// `POST /sandboxes/{id}/fork`: 201 with one entry per fork, `{"sandbox"}` or
/// `{"error"}`; a whole-request error when the source cannot be captured.
pub(super) async fn fork(state: &ApiState, id: &str, req: Request<Incoming>) -> Reply {
    let id = parse_sandbox_id(id)?;
    let body: ForkBody = read_json(req).await?;
    let count = match body.count {
        Some(c) if !(1..=MAX_FORKS as i64).contains(&c) => {
            return Err(bad_request(format!(
                "count must be between 1 and {MAX_FORKS}, not {c}"
            )));
        }
        Some(c) => c as usize,
        None => 1,
    };
    let outcomes = state
        .orch
        .fork(&id, count, body.timeout.map(Duration::from_secs))
        .await?;
    let items: Vec<serde_json::Value> = outcomes
        .into_iter()
        .map(|o| match o {
            Ok(rec) => serde_json::json!({ "sandbox": sandbox_json(state, &rec) }),
            Err(e) => {
                let (status, message) = lifecycle_error_parts(e);
                serde_json::json!({ "error": { "code": status.as_u16(), "message": message } })
            }
        })
        .collect();
    Ok(json_response(StatusCode::CREATED, &items))
}

/// `POST /sandboxes/{id}/export`: a paused sandbox is published for another node, which
/// takes it over with the answer (see [`crate::lifecycle::Export`]).
pub(super) async fn export(state: &ApiState, id: &str) -> Reply {
    let id = parse_sandbox_id(id)?;
    let export = state.orch.export(&id).await?;
    Ok(json_response(StatusCode::CREATED, &export))
}

/// `DELETE /sandboxes/{id}/export`: the move is off; the sandbox stays here, paused.
pub(super) async fn cancel_move(state: &ApiState, id: &str) -> Reply {
    let id = parse_sandbox_id(id)?;
    let rec = state.orch.cancel_move(&id).await?;
    Ok(json_response(StatusCode::OK, &sandbox_json(state, &rec)))
}

/// `POST /sandboxes/{id}/import`: takes over a sandbox another node exported (the body is
/// that node's answer to the export); it is paused here.
pub(super) async fn import(state: &ApiState, id: &str, req: Request<Incoming>) -> Reply {
    let id = parse_sandbox_id(id)?;
    let export: crate::lifecycle::Export = read_json(req).await?;
    if export.sandbox.id != id {
        return Err(bad_request(format!(
            "the export holds sandbox {}, not {id}: import it at /sandboxes/{}/import",
            export.sandbox.id, export.sandbox.id
        )));
    }
    let rec = state.orch.import(export).await?;
    Ok(json_response(
        StatusCode::CREATED,
        &sandbox_json(state, &rec),
    ))
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

/// `endAt`: when the timeout fires; for a paused sandbox, when it was paused (its run
/// ended then), else when it started.
fn end_at(rec: &SandboxRecord) -> String {
    ms_rfc3339(
        rec.expires_at_ms
            .or(rec.paused_at_ms)
            .unwrap_or(rec.created_at_ms),
    )
}

fn listed_json(state: &ApiState, rec: &SandboxRecord) -> ListedSandboxJson {
    ListedSandboxJson {
        template_id: template_id(rec),
        alias: template_alias(rec),
        sandbox_id: rec.id.clone(),
        client_id: String::new(),
        started_at: ms_rfc3339(rec.created_at_ms),
        end_at: end_at(rec),
        cpu_count: rec.cpu_count,
        memory_mb: rec.memory_mb,
        disk_size_mb: state.orch.disk_size_mb(rec),
        metadata: rec.options.metadata.clone(),
        state: rec.state.api_name().to_string(),
        envd_version: agentenv_guest::ENVD_VERSION.to_string(),
        volume_mounts: rec
            .options
            .volume_mounts
            .iter()
            .map(|m| VolumeMountJson {
                name: m.name.clone(),
                path: m.path.clone(),
            })
            .collect(),
    }
}

fn detail_json(state: &ApiState, rec: &SandboxRecord) -> SandboxDetailJson {
    SandboxDetailJson {
        listed: listed_json(state, rec),
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
        pause_mode: matches!(rec.state, State::Paused | State::Moving)
            .then_some(rec.pause_mode)
            .flatten()
            .map(|m| match m {
                PauseMode::Full => "full",
                PauseMode::Filesystem => "filesystem",
            }),
    }
}
