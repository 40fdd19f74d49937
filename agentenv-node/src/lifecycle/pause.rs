//! Pause, resume and connect, and the shutdown that pauses every sandbox and has the
//! backend keep what it can for the next start.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use agentenv_core::proto::scheduler_v1::SandboxEventType;

use super::{
    Connected, LifecycleError, Op, Orchestrator, PauseMode, SandboxRecord, Slot, State, next,
};
use crate::backend::agent::wait_ready;
use crate::clock::ms_since_epoch;

/// How long a shutdown waits for the cleanups of deleted sandboxes.
const SHUTDOWN_CLEANUP_WAIT: Duration = Duration::from_secs(10);

/// How long a pause with `requireHealthyGuest` waits for the agent to answer.
const AGENT_CHECK_TIMEOUT: Duration = Duration::from_secs(2);

impl Orchestrator {
    /// Pauses a running sandbox, keeping what `mode` says: everything, or its files only
    /// (it starts afresh on them when resumed). A paused one: nothing to do, unless its
    /// memory is to go now. With `require_healthy_guest`, a sandbox whose agent does not
    /// answer is not paused (503).
    pub async fn pause(
        self: &Arc<Self>,
        id: &str,
        mode: PauseMode,
        require_healthy_guest: bool,
    ) -> Result<(), LifecycleError> {
        self.admit(None)?;
        self.on_sandbox(id, move |this, sandbox| async move {
            if require_healthy_guest {
                this.check_agent(&sandbox).await?;
            }
            this.pause_locked(&sandbox, mode).await
        })
        .await
    }

    /// Refuses (503) when the agent of the running sandbox `slot` does not answer.
    async fn check_agent(&self, slot: &Slot) -> Result<(), LifecycleError> {
        let Some(addr) = slot.rec.lock().address else {
            return Ok(());
        };
        wait_ready(addr.agent(), AGENT_CHECK_TIMEOUT, Duration::from_millis(20))
            .await
            .map_err(|e| {
                LifecycleError::Unavailable(format!(
                    "the sandbox's agent does not answer ({e}); it keeps running: retry, or pause without requireHealthyGuest"
                ))
            })
    }

    pub(super) async fn pause_locked(
        &self,
        slot: &Slot,
        mode: PauseMode,
    ) -> Result<(), LifecycleError> {
        let (rec, before) = {
            let (r, before) = slot.step(Op::Pause)?;
            (r.clone(), before)
        };
        if rec.state == State::Paused {
            // Paused already: its memory goes now if only its files are to be kept.
            if mode == PauseMode::Filesystem && !rec.restored {
                self.keep_files(slot).await?;
            }
            return Ok(());
        }
        if !self.is_present(&rec.id) {
            return Err(LifecycleError::NotFound(rec.id));
        }
        let timer = self.metrics.start("pause", "total");
        let result = async {
            self.backend.pause(&rec.id).await?;
            self.flush_volumes(&rec.id).await;
            let mut paused = rec.clone();
            paused.state = State::Paused;
            paused.expires_at_ms = None;
            paused.pause_mode = Some(mode);
            paused.paused_at_ms = Some(ms_since_epoch(SystemTime::now()));
            if let Err(e) = self.store.save(&paused) {
                let _ = self.backend.resume(&rec.id).await;
                return Err(LifecycleError::from(e));
            }
            Ok(paused)
        }
        .await;
        timer.finish(result.is_ok());
        let paused = match result {
            Ok(p) => p,
            Err(e) => {
                slot.undo(before);
                return Err(e);
            }
        };
        let out = {
            let mut r = slot.done();
            r.deadline = None;
            r.expires_at_ms = None;
            r.pause_mode = paused.pause_mode;
            r.paused_at_ms = paused.paused_at_ms;
            r.clone()
        };
        self.event(&out, SandboxEventType::Pause);
        self.log_event(&out.id, "sandbox paused");
        tracing::info!(sandbox = %out.id, ?mode, "sandbox paused");
        if mode == PauseMode::Filesystem {
            self.keep_files(slot).await?;
        }
        Ok(())
    }

    /// Ends the processes of paused sandbox `slot` (its memory goes) and has the backend
    /// keep its files (jail: the writable layer): a resume starts it afresh on them. The
    /// record (on disk too) says so. Fails when the files could not be kept: the sandbox
    /// then starts from its template when resumed.
    pub(super) async fn keep_files(&self, slot: &Slot) -> Result<(), LifecycleError> {
        let id = slot.id.clone();
        let kept = self.backend.keep(&id).await;
        match &kept {
            // No backend sandbox is left: its volumes are given back.
            Ok(_) => self.unbind_volumes(&id).await,
            Err(_) => {
                self.release(&id, "releasing a sandbox whose files could not be kept")
                    .await
            }
        }
        let rec = {
            let mut r = slot.rec.lock();
            r.restored = true;
            if let Ok(k) = &kept {
                r.kept = Some(k.clone());
            }
            r.clone()
        };
        let saved = self.store.save(&rec);
        match (kept, saved) {
            (Ok(_), Ok(())) => Ok(()),
            (Err(e), _) => Err(LifecycleError::Internal(format!(
                "sandbox {id} is paused but its files could not be kept ({e}); a resume starts it from its template"
            ))),
            (Ok(_), Err(e)) => {
                tracing::warn!(sandbox = %id, error = %e, "recording the kept files");
                Ok(())
            }
        }
    }

    /// Resumes a paused sandbox with `timeout` (default: the node's); `memory: false`
    /// (`PauseMode::Filesystem`) starts it afresh on its files whatever its pause kept.
    /// A running one only gets its timeout set.
    pub async fn resume(
        self: &Arc<Self>,
        id: &str,
        timeout: Option<Duration>,
        mode: PauseMode,
    ) -> Result<SandboxRecord, LifecycleError> {
        Ok(self.wake(id, timeout, Op::Resume, mode).await?.0)
    }

    /// `connect`: extends a running sandbox's timeout (never shortens), resumes a paused
    /// one (as [`Self::resume`] with `mode`).
    pub async fn connect(
        self: &Arc<Self>,
        id: &str,
        timeout: Option<Duration>,
        mode: PauseMode,
    ) -> Result<(SandboxRecord, Connected), LifecycleError> {
        self.wake(id, timeout, Op::Connect, mode).await
    }

    /// Resume or connect (`op`): resumes a paused sandbox; a running one gets its timeout
    /// set (resume) or extended (connect).
    async fn wake(
        self: &Arc<Self>,
        id: &str,
        timeout: Option<Duration>,
        op: Op,
        mode: PauseMode,
    ) -> Result<(SandboxRecord, Connected), LifecycleError> {
        let t = timeout.unwrap_or(self.cfg.default_timeout);
        self.admit(Some(t))?;
        self.on_sandbox(id, move |this, sandbox| async move {
            let (rec, before) = {
                let (mut r, before) = sandbox.step(op)?;
                if r.state == State::Running {
                    match op {
                        Op::Connect => r.extend_deadline(t),
                        _ => r.set_deadline(t),
                    }
                    return Ok((r.clone(), Connected::WasRunning));
                }
                (r.clone(), before)
            };
            let rec = if mode == PauseMode::Filesystem && !rec.restored {
                // Its memory goes first: it starts afresh on its files.
                if let Err(e) = this.keep_files(&sandbox).await {
                    tracing::warn!(sandbox = %rec.id, error = %e, "dropping the memory of a paused sandbox");
                }
                sandbox.rec.lock().clone()
            } else {
                rec
            };
            let rec = this.resume_locked(&sandbox, rec, before, t).await?;
            Ok((rec, Connected::Resumed))
        })
        .await
    }

    /// Resumes the sandbox of `slot`, moved to resuming (its record `rec`) from `before`;
    /// a sandbox whose processes are gone (paused with its files only, restored after a
    /// node restart) starts afresh from what was kept, with its template's start command.
    async fn resume_locked(
        &self,
        slot: &Slot,
        mut rec: SandboxRecord,
        before: State,
        timeout: Duration,
    ) -> Result<SandboxRecord, LifecycleError> {
        let timer = self.metrics.start("resume", "total");
        let result = if rec.restored {
            let mut started = self.start_backend(&mut rec, true).await;
            slot.rec.lock().kept = rec.kept.clone();
            if let (Ok(addr), Some(start)) = (&started, &rec.start)
                && let Err(reason) = self.run_start_command(&rec, *addr, start).await
            {
                started = self.rekeep_after_failed_start(&mut rec, reason).await;
                slot.rec.lock().kept = rec.kept.clone();
            }
            started
        } else {
            match self.backend.resume(&rec.id).await {
                Ok(info) => Ok(info.address),
                Err(e) => Err(e.into()),
            }
        };
        timer.finish(result.is_ok());
        let addr = match result {
            Ok(addr) => addr,
            Err(e) => {
                slot.undo(before);
                return Err(e);
            }
        };
        self.forget_paused(&rec.id);
        let out = {
            let mut r = slot.done();
            r.restored = false;
            // The backend sandbox owns what was kept now.
            r.kept = None;
            r.address = Some(addr);
            r.pause_mode = None;
            r.paused_at_ms = None;
            r.set_deadline(timeout);
            r.clone()
        };
        self.event(&out, SandboxEventType::Resume);
        self.log_event(&out.id, "sandbox resumed");
        self.observe_started(&out.id).await;
        tracing::info!(sandbox = %out.id, "sandbox resumed");
        Ok(out)
    }

    /// The start command of a sandbox started afresh failed: its files are kept again
    /// (as when its agent does not come up) and the resume fails with `reason`.
    async fn rekeep_after_failed_start(
        &self,
        rec: &mut SandboxRecord,
        reason: String,
    ) -> Result<crate::backend::SandboxAddress, LifecycleError> {
        self.keep_again(rec).await;
        Err(LifecycleError::Agent {
            id: rec.id.clone(),
            reason: format!("the template's start command: {reason}"),
        })
    }

    /// Graceful shutdown: refuses new operations, pauses every running sandbox (recorded
    /// on disk), then has the backend keep each one's files and releases it. Paused
    /// sandboxes come back on the next start, afresh on their files.
    pub async fn shutdown(self: &Arc<Self>) {
        self.begin_shutdown();
        let slots: Vec<Arc<Slot>> = self.slots.lock().values().cloned().collect();
        for slot in slots {
            let sandbox = slot.lock().await;
            let id = sandbox.id.clone();
            if sandbox.rec.lock().restored || !self.is_present(&id) {
                continue;
            }
            let before = sandbox.rec.lock().pause_mode;
            if let Err(e) = self.pause_locked(&sandbox, PauseMode::Full).await {
                tracing::warn!(sandbox = %id, error = %e, "pause at shutdown failed; the sandbox is lost");
            }
            if next(sandbox.rec.lock().state, Op::Keep).is_ok() {
                if let Err(e) = self.keep_files(&sandbox).await {
                    tracing::warn!(sandbox = %id, error = %e, "keeping the sandbox's files at shutdown");
                }
                // What its own pause kept (if it was paused) is what users asked for.
                if let Some(mode) = before {
                    sandbox.rec.lock().pause_mode = Some(mode);
                }
            } else {
                self.release(&id, "releasing the sandbox at shutdown").await;
            }
        }
        *self.events.lock() = None;
        self.close_pools().await;
        // Deleted sandboxes still being cleaned up: what is not done in time is a leftover
        // the next start's reconciliation removes.
        if !self.backend.drain_cleanups(SHUTDOWN_CLEANUP_WAIT).await {
            tracing::warn!(
                pending = self.backend.cleanups().pending,
                "deleted sandboxes still being cleaned up at shutdown; the next start removes what is left"
            );
        }
        tracing::info!("lifecycle stopped; paused sandboxes are recorded");
    }
}
