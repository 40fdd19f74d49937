//! Forks: a running sandbox captured once (frozen for a moment; its id, state and
//! timeout untouched) and new sandboxes started from what was captured, each with the
//! source's files, template, resources and options, and a fresh process tree (the
//! template's start command runs in each).

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use super::{LifecycleError, Op, Orchestrator, SandboxRecord, State};
use crate::backend::KeptState;
use crate::clock::ms_since_epoch;

/// Most forks one request may ask for.
pub const MAX_FORKS: usize = 20;

/// The outcome of one fork: its sandbox or why it did not start.
pub type ForkOutcome = Result<SandboxRecord, LifecycleError>;

impl Orchestrator {
    /// Forks running sandbox `id` into `count` new sandboxes (1..=[`MAX_FORKS`]) with
    /// `timeout` (default: the node's). The request fails as a whole (nothing started)
    /// when the source cannot be captured; afterwards each fork succeeds or fails on its
    /// own.
    pub async fn fork(
        self: &Arc<Self>,
        id: &str,
        count: usize,
        timeout: Option<Duration>,
    ) -> Result<Vec<ForkOutcome>, LifecycleError> {
        let timeout = timeout.unwrap_or(self.cfg.default_timeout);
        self.admit(Some(timeout))?;
        if !(1..=MAX_FORKS).contains(&count) {
            return Err(LifecycleError::BadRequest(format!(
                "count must be between 1 and {MAX_FORKS}, not {count}"
            )));
        }
        let this = self.clone();
        let id = id.to_string();
        self.detached(async move {
            let (source, first) = this.capture_for_fork(&id).await?;
            // The source runs on (and may be paused or deleted) while the copies are made.
            let timer = this.metrics.start("fork", "copy");
            let more = this.backend.copy_kept(&first, count - 1).await;
            timer.finish(more.is_ok());
            let more = match more {
                Ok(m) => m,
                Err(e) => {
                    this.discard_imported(Some(&first)).await;
                    return Err(e.into());
                }
            };
            let launches = std::iter::once(first).chain(more).map(|k| {
                let this = this.clone();
                let rec = fork_record(&source, k, timeout);
                async move { this.launch(rec, timeout, "fork").await }
            });
            Ok(futures::future::join_all(launches).await)
        })
        .await
    }

    /// Captures sandbox `id` for a fork under its operation lock (the source frozen for
    /// as long as the backend needs); returns its record and the kept state.
    async fn capture_for_fork(
        &self,
        id: &str,
    ) -> Result<(SandboxRecord, KeptState), LifecycleError> {
        let sandbox = self.lock(id).await?;
        if !self.is_present(id) {
            return Err(LifecycleError::NotFound(id.to_string()));
        }
        let (rec, before) = {
            let (r, before) = sandbox.step(Op::Fork)?;
            (r.clone(), before)
        };
        let timer = self.metrics.start("fork", "capture");
        let captured = self.backend.fork(id).await;
        timer.finish(captured.is_ok());
        match &captured {
            Ok(_) => drop(sandbox.done()),
            Err(_) => sandbox.undo(before),
        }
        Ok((rec, captured?))
    }
}

/// The record of a fork of `source` that starts from `kept`.
fn fork_record(source: &SandboxRecord, kept: KeptState, timeout: Duration) -> SandboxRecord {
    SandboxRecord {
        id: crate::ids::new_sandbox_id(),
        template: source.template.clone(),
        state: State::Creating,
        created_at_ms: ms_since_epoch(SystemTime::now()),
        timeout_secs: timeout.as_secs(),
        options: source.options.clone(),
        cpu_count: source.cpu_count,
        memory_mb: source.memory_mb,
        disk_size_mb: source.disk_size_mb,
        expires_at_ms: None,
        deadline: None,
        address: None,
        restored: false,
        kept: Some(kept),
        snapshot_id: source.snapshot_id.clone(),
        snapshot_name: source.snapshot_name.clone(),
        start: source.start.clone(),
        pause_mode: None,
        paused_at_ms: None,
    }
}
