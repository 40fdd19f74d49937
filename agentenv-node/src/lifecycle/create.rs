//! A sandbox's start and end: create (from a template or a snapshot), starting the
//! backend sandbox and its agent, and delete.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, SystemTime};

use agentenv_core::proto::scheduler_v1::SandboxEventType;

use super::{
    CreateRequest, LifecycleError, Op, Orchestrator, SandboxRecord, Slot, StartSpec, State,
};
use crate::backend::agent::wait_ready;
use crate::backend::{BackendError, KeptState, SandboxAddress};
use crate::clock::{ms_since_epoch, time_rfc3339};
use crate::timing::{self, Lap, Timings};

/// How long the agent may take to answer `POST /init`.
const AGENT_INIT_TIMEOUT: Duration = Duration::from_secs(10);

impl Orchestrator {
    /// Creates a sandbox and returns once its agent is ready and initialized.
    pub async fn create(
        self: &Arc<Self>,
        req: CreateRequest,
    ) -> Result<SandboxRecord, LifecycleError> {
        self.create_timed(req).await.0
    }

    /// [`Orchestrator::create`], with the phases the create went through (see
    /// [`crate::timing`]; none when it was refused before it started).
    pub async fn create_timed(
        self: &Arc<Self>,
        req: CreateRequest,
    ) -> (Result<SandboxRecord, LifecycleError>, Timings) {
        let timeout = req.timeout.unwrap_or(self.cfg.default_timeout);
        if let Err(e) = self.admit(Some(timeout)) {
            return (Err(e), Timings::new());
        }
        let this = self.clone();
        let timed = self
            .detached(async move { Ok(timing::collect(this.create_inner(req, timeout)).await) })
            .await;
        match timed {
            Ok((r, t)) => (r, t),
            Err(e) => (Err(e), Timings::new()),
        }
    }

    async fn create_inner(
        self: Arc<Self>,
        req: CreateRequest,
        timeout: Duration,
    ) -> Result<SandboxRecord, LifecycleError> {
        let mut req = req;
        let reference = req.template.clone();
        let mut phases = Lap::new();
        self.check_volumes(&req.options.volume_mounts).await?;
        phases.mark("volumes");
        let custom = self.resolve_custom_template(&req.template).await?;
        let from = match &custom {
            Some(_) => None,
            None => self.resolve_snapshot(&req.template).await?,
        };
        phases.mark("resolve");
        let mut kept = None;
        let (mut snapshot_id, mut snapshot_name, mut start) = (None, None, None);
        if let Some(snap) = &from {
            kept = Some(self.import_snapshot(snap).await?);
            phases.mark("import");
            req.template = snap.committed.template.clone();
            let mut env = snap.committed.env.clone();
            env.extend(std::mem::take(&mut req.options.env_vars));
            req.options.env_vars = env;
            req.cpu_count = req.cpu_count.or(Some(snap.resources.cpu_count));
            req.memory_mb = req.memory_mb.or(Some(snap.resources.memory_mb));
            snapshot_id = Some(snap.id.clone());
            snapshot_name = snap.alias.clone();
        }
        if let Some(c) = custom {
            req.template = c.local;
            let mut env = c.state.env.clone();
            env.extend(std::mem::take(&mut req.options.env_vars));
            req.options.env_vars = env;
            snapshot_id = Some(c.template_id);
            snapshot_name = c.name;
            start = Some(StartSpec {
                state: c.state,
                start_cmd: c.start_cmd,
                ready_cmd: c.ready_cmd,
            })
            .filter(StartSpec::runs_anything);
        }
        // A started sandbox of the same kind, if a pool holds one: claimed, it only needs
        // its agent initialized.
        let pooled = if start.is_none() && kept.is_none() {
            self.pool_key(&req, &req.template)
                .and_then(|key| self.pool_take(&reference, &key))
        } else {
            None
        };
        if pooled.is_some() {
            phases.mark("claim");
        }
        let (id, address) = match pooled {
            Some((p, addr)) => (p.id, Some(addr)),
            None => (
                req.id.take().unwrap_or_else(crate::ids::new_sandbox_id),
                None,
            ),
        };
        let rec = SandboxRecord {
            id,
            template: req.template,
            state: State::Creating,
            created_at_ms: ms_since_epoch(SystemTime::now()),
            timeout_secs: timeout.as_secs(),
            options: req.options,
            cpu_count: req.cpu_count.unwrap_or(self.cfg.default_cpu_count),
            memory_mb: req.memory_mb.unwrap_or(self.cfg.default_memory_mb),
            disk_size_mb: req.disk_size_mb,
            expires_at_ms: None,
            deadline: None,
            address: None,
            restored: false,
            kept,
            snapshot_id,
            snapshot_name,
            start,
            pause_mode: None,
            paused_at_ms: None,
        };
        let Some(addr) = address else {
            return self.launch(rec, timeout, "create_warm").await;
        };
        let mut cold = rec.clone();
        match self
            .launch_at(rec, timeout, "create_pooled", Some(addr))
            .await
        {
            Err(LifecycleError::Agent { id, reason }) => {
                // The pooled sandbox's agent failed (it was destroyed): start one.
                tracing::warn!(sandbox = %id, %reason, "a claimed pooled sandbox failed; starting another");
                cold.id = crate::ids::new_sandbox_id();
                self.launch(cold, timeout, "create_warm").await
            }
            r => r,
        }
    }

    /// Starts the sandbox `rec` (state creating; from its kept state, if any) and its
    /// template's start command, and gives it its timeout. A failure leaves nothing behind
    /// but the kept state, which goes too. `stage` names the timings.
    pub(super) async fn launch(
        &self,
        rec: SandboxRecord,
        timeout: Duration,
        stage: &'static str,
    ) -> Result<SandboxRecord, LifecycleError> {
        self.launch_at(rec, timeout, stage, None).await
    }

    /// [`Orchestrator::launch`]; with `pooled`, the backend sandbox runs already (a pooled
    /// one, at that address) and only its agent is initialized.
    async fn launch_at(
        &self,
        rec: SandboxRecord,
        timeout: Duration,
        stage: &'static str,
        pooled: Option<SandboxAddress>,
    ) -> Result<SandboxRecord, LifecycleError> {
        let id = rec.id.clone();
        let kept = rec.kept.clone();
        let sandbox = Slot::new(rec.clone()).lock().await;
        let taken = {
            let mut slots = self.slots.lock();
            let taken = slots.contains_key(&id);
            if !taken {
                slots.insert(id.clone(), sandbox.slot.clone());
            }
            taken
        };
        if taken {
            self.discard_imported(kept.as_ref()).await;
            return Err(LifecycleError::Conflict(format!(
                "sandbox {id} exists already"
            )));
        }
        let total = self.metrics.start(stage, "total");
        if self.is_shutting_down() {
            // Shutdown has (or will have) taken its list of sandboxes: do not start one.
            self.slots.lock().remove(&id);
            self.discard_imported(kept.as_ref()).await;
            if pooled.is_some() {
                self.release(&id, "releasing a claimed pooled sandbox at shutdown")
                    .await;
            }
            return Err(LifecycleError::ShuttingDown);
        }
        let mut started = match pooled {
            Some(addr) => self.init_claimed(&rec, addr).await,
            None => self.start_backend(&mut rec.clone(), false).await,
        };
        let mut phases = Lap::new();
        if let (Ok(addr), Some(start)) = (&started, &rec.start) {
            let stage = self.metrics.start(stage, "start_cmd");
            let ready = self.run_start_command(&rec, *addr, start).await;
            stage.finish(ready.is_ok());
            phases.mark("start_cmd");
            if let Err(reason) = ready {
                self.release(&id, "cleanup after a failed start command")
                    .await;
                started = Err(LifecycleError::Agent {
                    id: id.clone(),
                    reason: format!("the template's start command: {reason}"),
                });
            }
        }
        total.finish(started.is_ok());
        if started.is_err() {
            // A layer the backend did not take over (or gave back) goes.
            self.discard_imported(kept.as_ref()).await;
        }
        match started {
            Ok(addr) => {
                let out = {
                    let mut r = sandbox.done();
                    // The backend sandbox owns the imported state now.
                    r.kept = None;
                    r.address = Some(addr);
                    r.set_deadline(timeout);
                    r.clone()
                };
                self.create_successes.fetch_add(1, Ordering::Relaxed);
                self.event(&out, SandboxEventType::Create);
                self.log_event(&id, "sandbox created");
                self.observe_started(&id).await;
                phases.mark("finish");
                tracing::info!(sandbox = %id, template = %out.template, "sandbox created");
                Ok(out)
            }
            Err(e) => {
                self.slots.lock().remove(&id);
                self.forget_observed(&id);
                self.forget_volumes(&id, &rec.options.volume_mounts).await;
                self.create_fails.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(sandbox = %id, error = %e, "create failed");
                Err(e)
            }
        }
    }

    /// Runs the template's start command in sandbox `rec` (at `addr`) and waits until its
    /// ready command succeeds.
    pub(super) async fn run_start_command(
        &self,
        rec: &SandboxRecord,
        addr: SandboxAddress,
        start: &StartSpec,
    ) -> Result<(), String> {
        let mut state = start.state.clone();
        state.env = rec.options.env_vars.clone();
        let ready_timeout = self
            .templates
            .get()
            .map(|t| t.settings.ready_timeout)
            .unwrap_or(Duration::from_secs(120));
        self.start_and_wait_ready_at(
            &rec.id,
            addr,
            &state,
            start.start_cmd.as_deref(),
            start.ready_cmd.as_deref(),
            ready_timeout,
        )
        .await
    }

    /// Creates the backend sandbox for `rec`, waits for its agent and initializes it.
    /// On failure nothing is left behind but, with `rekeep`, the kept state `rec` started
    /// from (kept again, with `rec` and its paused record updated).
    pub(super) async fn start_backend(
        &self,
        rec: &mut SandboxRecord,
        rekeep: bool,
    ) -> Result<SandboxAddress, LifecycleError> {
        let mut phases = Lap::new();
        let mut spec = rec.spec();
        spec.volumes = self.bind_volumes(rec).await?;
        phases.mark("bind");
        let stage = self.metrics.start("create_warm", "backend_start");
        let info = self.backend.create(spec).await;
        stage.finish(info.is_ok());
        // The backend recorded its own phases.
        phases.skip();
        let addr = match info {
            Ok(info) => info.address,
            Err(e) => {
                self.unbind_volumes(&rec.id).await;
                return Err(e.into());
            }
        };
        let stage = self.metrics.start("create_warm", "agent_ready");
        let ready = async {
            wait_ready(
                addr.agent(),
                self.cfg.agent_ready_timeout,
                Duration::from_millis(2),
            )
            .await
            .map_err(|e| e.to_string())?;
            phases.mark("agent_ready");
            let r = self.init_agent(rec, addr).await;
            phases.mark("init");
            r
        }
        .await;
        stage.finish(ready.is_ok());
        if let Err(reason) = ready {
            if rec.kept.is_some() && rekeep {
                // The kept state was taken over by the backend sandbox: keep it again.
                self.keep_again(rec).await;
            } else if let Err(e) = self.backend.destroy(&rec.id).await {
                tracing::warn!(sandbox = %rec.id, error = %e, "cleanup after a failed start");
            }
            self.unbind_volumes(&rec.id).await;
            return Err(LifecycleError::Agent {
                id: rec.id.clone(),
                reason,
            });
        }
        Ok(addr)
    }

    /// Initializes the agent of claimed pooled sandbox `rec` (at `addr`); on failure the
    /// sandbox is destroyed.
    async fn init_claimed(
        &self,
        rec: &SandboxRecord,
        addr: SandboxAddress,
    ) -> Result<SandboxAddress, LifecycleError> {
        let mut phases = Lap::new();
        let stage = self.metrics.start("create_pooled", "init");
        let r = self.init_agent(rec, addr).await;
        stage.finish(r.is_ok());
        phases.mark("init");
        match r {
            Ok(()) => Ok(addr),
            Err(reason) => {
                self.release(&rec.id, "cleanup after a failed claim").await;
                Err(LifecycleError::Agent {
                    id: rec.id.clone(),
                    reason,
                })
            }
        }
    }

    /// A sandbox started afresh from its kept files did not come up: its files are kept
    /// again and the record (on disk too) names them; it stays paused.
    pub(super) async fn keep_again(&self, rec: &mut SandboxRecord) {
        rec.kept = match self.keep_backend(&rec.id).await {
            Ok(kept) => Some(kept),
            Err(e) => {
                tracing::warn!(sandbox = %rec.id, error = %e, "keeping the state after a failed start; the sandbox's files are lost");
                None
            }
        };
        let mut paused = rec.clone();
        paused.state = State::Paused;
        if let Err(e) = self.store.save(&paused) {
            tracing::warn!(sandbox = %rec.id, error = %e, "recording the kept state");
        }
    }

    /// Pauses a backend sandbox and has the backend keep its state; on failure the
    /// sandbox is destroyed.
    async fn keep_backend(&self, id: &str) -> Result<KeptState, BackendError> {
        let kept = match self.backend.pause(id).await {
            Ok(()) => self.backend.keep(id).await,
            Err(e) => Err(e),
        };
        if kept.is_err() {
            self.release(id, "releasing the sandbox").await;
        }
        kept
    }

    /// Destroys backend sandbox `id` (one already gone is fine), logging a failure.
    pub(super) async fn release(&self, id: &str, what: &str) {
        match self.backend.destroy(id).await {
            Ok(()) | Err(BackendError::NotFound(_)) => {}
            Err(e) => tracing::warn!(sandbox = %id, error = %e, "{what}"),
        }
        self.unbind_volumes(id).await;
    }

    async fn init_agent(&self, rec: &SandboxRecord, addr: SandboxAddress) -> Result<(), String> {
        self.init_agent_for(&rec.id, &rec.options.env_vars, addr)
            .await
    }

    /// Gives sandbox `id`'s agent its token and environment (`POST /init`).
    pub(super) async fn init_agent_for(
        &self,
        id: &str,
        env: &std::collections::BTreeMap<String, String>,
        addr: SandboxAddress,
    ) -> Result<(), String> {
        let mut client =
            agentenv_guest::client::GuestClient::new(&format!("http://{}", addr.agent()))
                .map_err(|e| e.to_string())?;
        // Every agent requires its token: the create body's `secure` is not asked.
        let token = self.tokens.envd_token(id);
        client = client.with_access_token(&token);
        let ts = time_rfc3339(SystemTime::now());
        let body = serde_json::json!({
            "envVars": env,
            "accessToken": token,
            "timestamp": ts,
        });
        match tokio::time::timeout(AGENT_INIT_TIMEOUT, client.init(&body)).await {
            Ok(r) => r.map_err(|e| format!("POST /init: {e}")),
            Err(_) => Err(format!(
                "POST /init: the agent did not answer within {AGENT_INIT_TIMEOUT:?}"
            )),
        }
    }

    /// Kills a sandbox and removes every trace of it. Answers once every process of the
    /// sandbox has been killed (none runs again) and it is gone from the node's lists (its
    /// capacity is free from then on); the backend waits for the processes to exit and
    /// gives back what it held (layer, cgroup, namespace, address, directory) in its
    /// cleanup queue.
    pub async fn delete(self: &Arc<Self>, id: &str) -> Result<(), LifecycleError> {
        self.admit(None)?;
        self.on_sandbox(id, |this, sandbox| async move {
            this.delete_locked(&sandbox).await
        })
        .await
    }

    pub(super) async fn delete_locked(&self, slot: &Slot) -> Result<(), LifecycleError> {
        if !self.is_present(&slot.id) {
            return Err(LifecycleError::NotFound(slot.id.clone()));
        }
        let (rec, before) = {
            let (r, before) = slot.step(Op::Kill)?;
            (r.clone(), before)
        };
        let mut result = match self.backend.kill(&rec.id).await {
            Ok(()) => Ok(()),
            Err(BackendError::NotFound(_)) => Ok(()),
            Err(e) => Err(e),
        };
        if let (Ok(()), Some(kept)) = (&result, &rec.kept) {
            result = self.backend.discard_kept(kept).await;
        }
        match result {
            Ok(()) => {
                self.forget_volumes(&rec.id, &rec.options.volume_mounts)
                    .await;
                self.forget_paused(&rec.id);
                self.slots.lock().remove(&rec.id);
                self.forget_observed(&rec.id);
                self.event(&rec, SandboxEventType::Delete);
                tracing::info!(sandbox = %rec.id, "sandbox deleted");
                Ok(())
            }
            Err(e) => {
                slot.undo(before);
                Err(e.into())
            }
        }
    }

    /// Removes sandbox `id`'s paused record (none is fine), logging a failure.
    pub(super) fn forget_paused(&self, id: &str) {
        if let Err(e) = self.store.remove(id) {
            tracing::warn!(sandbox = %id, error = %e, "removing the paused record");
        }
    }
}
