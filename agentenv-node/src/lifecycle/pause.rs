//! Pause, resume and connect, and the shutdown that pauses every sandbox and has the
//! backend keep what it can for the next start.

use std::sync::Arc;
use std::time::Duration;

use agentenv_core::proto::scheduler_v1::SandboxEventType;

use super::{Connected, LifecycleError, Op, Orchestrator, SandboxRecord, Slot, State, next};

impl Orchestrator {
    /// Pauses a running sandbox (a paused one: nothing to do).
    pub async fn pause(self: &Arc<Self>, id: &str) -> Result<(), LifecycleError> {
        self.admit(None)?;
        self.on_sandbox(id, |this, sandbox| async move {
            this.pause_locked(&sandbox).await
        })
        .await
    }

    pub(super) async fn pause_locked(&self, slot: &Slot) -> Result<(), LifecycleError> {
        let (rec, before) = {
            let (r, before) = slot.step(Op::Pause)?;
            if r.state == State::Paused {
                return Ok(());
            }
            (r.clone(), before)
        };
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
            if let Err(e) = self.store.save(&paused) {
                let _ = self.backend.resume(&rec.id).await;
                return Err(LifecycleError::from(e));
            }
            Ok(())
        }
        .await;
        timer.finish(result.is_ok());
        if let Err(e) = result {
            slot.undo(before);
            return Err(e);
        }
        let mut r = slot.done();
        r.deadline = None;
        r.expires_at_ms = None;
        let out = r.clone();
        drop(r);
        self.event(&out, SandboxEventType::Pause);
        tracing::info!(sandbox = %out.id, "sandbox paused");
        Ok(())
    }

    /// Resumes a paused sandbox with `timeout` (default: the node's). A running one only
    /// gets its timeout set.
    pub async fn resume(
        self: &Arc<Self>,
        id: &str,
        timeout: Option<Duration>,
    ) -> Result<SandboxRecord, LifecycleError> {
        Ok(self.wake(id, timeout, Op::Resume).await?.0)
    }

    /// `connect`: extends a running sandbox's timeout (never shortens), resumes a paused one.
    pub async fn connect(
        self: &Arc<Self>,
        id: &str,
        timeout: Option<Duration>,
    ) -> Result<(SandboxRecord, Connected), LifecycleError> {
        self.wake(id, timeout, Op::Connect).await
    }

    /// Resume or connect (`op`): resumes a paused sandbox; a running one gets its timeout
    /// set (resume) or extended (connect).
    async fn wake(
        self: &Arc<Self>,
        id: &str,
        timeout: Option<Duration>,
        op: Op,
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
            let rec = this.resume_locked(&sandbox, rec, before, t).await?;
            Ok((rec, Connected::Resumed))
        })
        .await
    }

    /// Resumes the sandbox of `slot`, moved to resuming (its record `rec`) from `before`;
    /// a sandbox restored after a node restart starts afresh from what was kept.
    async fn resume_locked(
        &self,
        slot: &Slot,
        mut rec: SandboxRecord,
        before: State,
        timeout: Duration,
    ) -> Result<SandboxRecord, LifecycleError> {
        let timer = self.metrics.start("resume", "total");
        let result = if rec.restored {
            let started = self.start_backend(&mut rec, true).await;
            slot.rec.lock().kept = rec.kept.clone();
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
        let mut r = slot.done();
        r.restored = false;
        // The backend sandbox owns what was kept now.
        r.kept = None;
        r.address = Some(addr);
        r.set_deadline(timeout);
        let out = r.clone();
        drop(r);
        self.event(&out, SandboxEventType::Resume);
        tracing::info!(sandbox = %out.id, "sandbox resumed");
        Ok(out)
    }

    /// Graceful shutdown: refuses new operations, pauses every running sandbox (recorded
    /// on disk), then releases every backend sandbox. Paused sandboxes come back on the
    /// next start.
    pub async fn shutdown(self: &Arc<Self>) {
        self.begin_shutdown();
        let slots: Vec<Arc<Slot>> = self.slots.lock().values().cloned().collect();
        for slot in slots {
            let sandbox = slot.lock().await;
            let id = sandbox.id.clone();
            if sandbox.rec.lock().restored || !self.is_present(&id) {
                continue;
            }
            if let Err(e) = self.pause_locked(&sandbox).await {
                tracing::warn!(sandbox = %id, error = %e, "pause at shutdown failed; the sandbox is lost");
            }
            let paused = next(sandbox.rec.lock().state, Op::Keep).is_ok();
            let kept = if paused {
                match self.backend.keep(&id).await {
                    Ok(k) => Some(k),
                    Err(e) => {
                        tracing::warn!(sandbox = %id, error = %e, "keeping the sandbox's state at shutdown failed; it resumes from its template");
                        None
                    }
                }
            } else {
                None
            };
            if kept.is_none() {
                self.release(&id, "releasing the sandbox at shutdown").await;
            }
            self.unbind_volumes(&id).await;
            // No backend sandbox is left: a later resume starts it afresh, from what
            // was kept.
            let rec = {
                let mut r = sandbox.rec.lock();
                r.restored = true;
                if kept.is_some() {
                    r.kept = kept;
                }
                r.clone()
            };
            if rec.kept.is_some()
                && let Err(e) = self.store.save(&rec)
            {
                tracing::warn!(sandbox = %id, error = %e, "recording the kept state at shutdown");
            }
        }
        *self.events.lock() = None;
        tracing::info!("lifecycle stopped; paused sandboxes are recorded");
    }
}
