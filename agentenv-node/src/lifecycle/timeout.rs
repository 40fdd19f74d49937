//! Timeouts: setting and refreshing them, and pausing or killing sandboxes whose timeout
//! has passed.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::{LifecycleError, OnTimeout, Op, Orchestrator, PauseMode};

impl Orchestrator {
    /// `POST /timeout`: the sandbox expires `timeout` from now (may shorten).
    pub async fn set_timeout(
        self: &Arc<Self>,
        id: &str,
        timeout: Duration,
    ) -> Result<(), LifecycleError> {
        self.admit(Some(timeout))?;
        self.on_sandbox(id, move |_, sandbox| async move {
            let (mut r, _) = sandbox.step(Op::SetTimeout)?;
            r.timeout_secs = timeout.as_secs();
            r.set_deadline(timeout);
            Ok(())
        })
        .await
    }

    /// `POST /refreshes`: extends the timeout to `duration` from now, never shortens.
    pub async fn refresh(
        self: &Arc<Self>,
        id: &str,
        duration: Duration,
    ) -> Result<(), LifecycleError> {
        self.admit(Some(duration))?;
        self.on_sandbox(id, move |_, sandbox| async move {
            let (mut r, _) = sandbox.step(Op::Refresh)?;
            r.extend_deadline(duration);
            Ok(())
        })
        .await
    }

    /// Pauses or kills every running sandbox whose timeout has passed.
    pub fn expire_due(self: &Arc<Self>) {
        let now = Instant::now();
        let due: Vec<(String, OnTimeout, PauseMode)> = self
            .list()
            .into_iter()
            .filter(|r| r.is_due(now))
            .map(|r| {
                let mode = PauseMode::from_memory(r.options.auto_pause_memory);
                (r.id, r.options.on_timeout, mode)
            })
            .collect();
        for (id, action, mode) in due {
            let this = self.clone();
            tokio::spawn(async move {
                // Re-check under the operation lock: the timeout may have moved.
                let Ok(sandbox) = this.lock(&id).await else {
                    return;
                };
                if !sandbox.rec.lock().is_due(Instant::now()) {
                    return;
                }
                if action == OnTimeout::Pause {
                    this.log_event(&id, "timeout expired: pausing the sandbox");
                }
                let result = match action {
                    OnTimeout::Pause => this.pause_locked(&sandbox, mode).await,
                    OnTimeout::Kill => this.delete_locked(&sandbox).await,
                };
                match result {
                    Ok(()) => tracing::info!(sandbox = %id, ?action, "timeout expired"),
                    Err(e) => tracing::warn!(sandbox = %id, error = %e, "timeout action failed"),
                }
            });
        }
    }

    /// Runs [`Self::expire_due`] every `auto_evict_interval` until the node shuts down.
    pub fn start_ticker(self: &Arc<Self>) -> tokio::task::JoinHandle<()> {
        let this = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(this.cfg.auto_evict_interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                if this.is_shutting_down() {
                    return;
                }
                this.expire_due();
            }
        })
    }
}
