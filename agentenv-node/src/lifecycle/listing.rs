//! Reading sandboxes: get, list, the counts of heartbeats and `GET /nodes`, and where
//! the data plane reaches a sandbox.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use super::{LifecycleError, Orchestrator, PauseMode, SandboxRecord, Slot, State};
use crate::reporter::{NodeSource, SandboxUsage};

/// Why the data plane cannot reach a sandbox.
#[derive(Debug, thiserror::Error)]
pub enum RouteError {
    #[error("sandbox not found")]
    NotFound,
    #[error("sandbox is not proxyable in its current state")]
    NotProxyable,
    #[error("sandbox auto-resume timed out")]
    ResumeTimedOut,
    #[error("sandbox auto-resume failed: {0}")]
    ResumeFailed(String),
}

impl Orchestrator {
    /// A copy of a sandbox's record.
    pub fn get(&self, id: &str) -> Result<SandboxRecord, LifecycleError> {
        Ok(self.slot(id)?.rec.lock().clone())
    }

    /// Copies of every record.
    pub fn list(&self) -> Vec<SandboxRecord> {
        let slots: Vec<Arc<Slot>> = self.slots.lock().values().cloned().collect();
        slots.iter().map(|s| s.rec.lock().clone()).collect()
    }

    /// Where the data plane reaches a sandbox's `port`: resumes a paused sandbox with
    /// auto-resume, waits for one that is starting.
    pub async fn route(self: &Arc<Self>, id: &str) -> Result<SandboxRecord, RouteError> {
        for _ in 0..3 {
            let slot = self.slot(id).map_err(|_| RouteError::NotFound)?;
            let rec = slot.rec.lock().clone();
            match rec.state {
                State::Running if rec.address.is_some() => return Ok(rec),
                // A sandbox paused with its files only starts afresh: never on traffic.
                State::Paused
                    if rec.options.auto_resume && rec.pause_mode != Some(PauseMode::Filesystem) =>
                {
                    if self.is_shutting_down() {
                        return Err(RouteError::NotProxyable);
                    }
                    let t =
                        Duration::from_secs(rec.timeout_secs).max(self.cfg.auto_resume_min_timeout);
                    let r = tokio::time::timeout(
                        Duration::from_secs(60),
                        self.resume(id, Some(t), PauseMode::Full),
                    )
                    .await;
                    match r {
                        Err(_) => return Err(RouteError::ResumeTimedOut),
                        Ok(Err(LifecycleError::NotFound(_))) => return Err(RouteError::NotFound),
                        Ok(Err(e)) => return Err(RouteError::ResumeFailed(e.to_string())),
                        Ok(Ok(_)) => continue,
                    }
                }
                State::Paused | State::Pausing | State::Moving => {
                    return Err(RouteError::NotProxyable);
                }
                State::Killing => return Err(RouteError::NotFound),
                _ => {
                    // Starting or resuming: wait for the operation to finish.
                    drop(slot.lock().await);
                }
            }
        }
        Err(RouteError::NotProxyable)
    }

    /// Counts and allocations for heartbeats and `GET /nodes`.
    pub fn usage(&self) -> SandboxUsage {
        let pooled = self.pool_usage();
        let mut u = SandboxUsage {
            create_successes: self.create_successes.load(Ordering::Relaxed),
            create_fails: self.create_fails.load(Ordering::Relaxed),
            pooled: pooled.pooled,
            pooled_allocated_cpu: pooled.allocated_cpu,
            pooled_allocated_memory_bytes: pooled.allocated_memory_bytes,
            pooled_by_template: self
                .pool_sizes()
                .into_iter()
                .filter(|(_, n)| *n > 0)
                .map(|(t, n)| (t, u32::try_from(n).unwrap_or(u32::MAX)))
                .collect(),
            ..Default::default()
        };
        for r in self.list() {
            match r.state {
                State::Creating | State::Resuming => u.starting += 1,
                State::Paused | State::Moving => u.paused += 1,
                _ => u.running += 1,
            }
            if matches!(r.state, State::Paused | State::Moving) {
                u.paused_allocated_cpu += r.cpu_count;
                u.paused_allocated_memory_bytes += r.memory_mb << 20;
            } else {
                u.allocated_cpu += r.cpu_count;
                u.allocated_memory_bytes += r.memory_mb << 20;
            }
        }
        u
    }
}

/// The orchestrator as the reporter's view of the node.
pub struct ReporterSource(pub Arc<Orchestrator>);

impl NodeSource for ReporterSource {
    /// Every sandbox but those being moved away: the node taking one over reports it
    /// (its binding moves there), and this node must not pull it back meanwhile.
    fn sandbox_ids(&self) -> Vec<String> {
        let slots: Vec<Arc<Slot>> = self.0.slots.lock().values().cloned().collect();
        let mut ids: Vec<String> = slots
            .iter()
            .filter(|s| s.rec.lock().state != State::Moving)
            .map(|s| s.id.clone())
            .collect();
        ids.sort();
        ids
    }

    fn sandbox_usage(&self) -> SandboxUsage {
        self.0.usage()
    }
}
