//! What the node observes of its sandboxes: a resource sample of every running sandbox
//! every `metrics_interval` (CPU from the cgroup's CPU time between two readings, memory
//! and page cache from the cgroup, disk from the writable layer), kept in a bounded ring
//! each; and their logs: lifecycle events written here, the agent's output fed by the
//! backend, the template's start command fed by `build/sandbox.rs`. A paused sandbox gets
//! no samples; a deleted one's samples and log go with it.

use std::collections::HashSet;
use std::sync::Arc;

use tokio::time::Instant;

use super::{LifecycleError, Orchestrator, SandboxRecord, State};
use crate::observe::ring::Reading;
use crate::observe::{Level, LogBook, LogEntry, LogQuery, Range, Sample};

impl Orchestrator {
    /// Where sandbox logs go (shared with the backend, which feeds the agent's output).
    pub fn set_sandbox_logs(&self, logs: Arc<LogBook>) {
        if self.logs.set(logs).is_err() {
            tracing::warn!("the sandbox log book was set twice; the first stays");
        }
    }

    /// The sandbox log book, once set.
    pub fn sandbox_log_book(&self) -> Option<&Arc<LogBook>> {
        self.logs.get()
    }

    /// Logs a lifecycle event of sandbox `id` (an `info` entry, `source: node`).
    pub(super) fn log_event(&self, id: &str, message: &str) {
        if let Some(logs) = self.logs.get() {
            logs.push(id, Level::Info, message, &[("source", "node")]);
        }
    }

    /// Forgets sandbox `id`'s samples and deletes its log.
    pub(super) fn forget_observed(&self, id: &str) {
        self.samples.remove(id);
        if let Some(logs) = self.logs.get() {
            logs.remove(id);
        }
    }

    /// The size of sandbox `rec`'s writable disk in MiB: its create's, else the
    /// backend's default (0: unknown).
    pub fn disk_size_mb(&self, rec: &SandboxRecord) -> u64 {
        rec.disk_size_mb
            .or(self.cfg.default_disk_size_mb)
            .unwrap_or(0)
    }

    /// Sandbox `id` (re)started running: its CPU is measured from now, so its first
    /// sample comes at the next sampling round.
    pub(super) async fn observe_started(&self, id: &str) {
        if let Ok(rec) = self.get(id) {
            self.samples.start(id);
            self.sample_one(&rec).await;
        }
    }

    /// Samples every running sandbox once.
    pub async fn sample_all(&self) {
        let records = self.list();
        let present: HashSet<&str> = records.iter().map(|r| r.id.as_str()).collect();
        self.samples.retain(&|id| present.contains(id));
        // Series exist before any reading is awaited: a sandbox deleted meanwhile loses
        // its series, and its late reading is dropped instead of making a new one.
        for rec in records.iter().filter(|r| r.state == State::Running) {
            self.samples.ensure(&rec.id);
        }
        for rec in &records {
            if rec.state != State::Running || rec.address.is_none() {
                self.samples.idle(&rec.id);
                continue;
            }
            self.sample_one(rec).await;
        }
    }

    /// Reads what sandbox `rec` uses now into its series.
    async fn sample_one(&self, rec: &SandboxRecord) {
        let u = match self.backend.usage(&rec.id).await {
            Ok(u) => u,
            Err(e) => {
                tracing::debug!(sandbox = %rec.id, error = %e, "no usage reading");
                self.samples.idle(&rec.id);
                return;
            }
        };
        let (disk_used, disk_total) = match u.disk {
            Some(d) => (d.used_bytes, d.total_bytes),
            None => (0, self.disk_size_mb(rec) << 20),
        };
        self.samples.record(
            &rec.id,
            Reading {
                at: Instant::now(),
                ts_ms: crate::clock::now_ms(),
                cpu_time: u.cpu_time,
                cpu_count: rec.cpu_count,
                mem_used: u.memory_bytes.saturating_sub(u.memory_cache_bytes),
                mem_total: rec.memory_mb << 20,
                mem_cache: u.memory_cache_bytes,
                disk_used,
                disk_total,
            },
        );
    }

    /// Runs [`Self::sample_all`] every `metrics_interval` until the node shuts down.
    pub fn start_sampler(self: &Arc<Self>) -> tokio::task::JoinHandle<()> {
        let this = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(this.cfg.metrics_interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                if this.is_shutting_down() {
                    return;
                }
                this.sample_all().await;
            }
        })
    }

    /// Sandbox `id`'s samples in `range`, oldest first.
    pub fn sandbox_metrics(&self, id: &str, range: Range) -> Result<Vec<Sample>, LifecycleError> {
        self.visible(id)?;
        Ok(self.samples.samples(id, range))
    }

    /// The latest sample of each sandbox of `ids` that has one.
    pub fn latest_metrics(&self, ids: &[String]) -> Vec<(String, Sample)> {
        ids.iter()
            .filter(|id| self.visible(id).is_ok())
            .filter_map(|id| self.samples.latest(id).map(|s| (id.clone(), s)))
            .collect()
    }

    /// The entries of sandbox `id`'s log that `q` asks for.
    pub async fn sandbox_logs(
        &self,
        id: &str,
        q: LogQuery,
    ) -> Result<Vec<LogEntry>, LifecycleError> {
        self.visible(id)?;
        let Some(logs) = self.logs.get().cloned() else {
            return Ok(Vec::new());
        };
        let id = id.to_string();
        tokio::task::spawn_blocking(move || logs.read(&id, &q))
            .await
            .map_err(|e| LifecycleError::Internal(format!("log task: {e}")))?
            .map_err(|e| LifecycleError::Internal(e.to_string()))
    }

    /// Sandbox `id` as the API shows it: present and not being deleted.
    fn visible(&self, id: &str) -> Result<(), LifecycleError> {
        match self.get(id)?.state {
            State::Killing => Err(LifecycleError::NotFound(id.to_string())),
            _ => Ok(()),
        }
    }
}
