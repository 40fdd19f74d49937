//! Prometheus metrics of lifecycle operations: `agentenv_sandbox_stage_duration_seconds`
//! `{operation,stage,status}` and `agentenv_sandbox_stage_inflight{operation,stage}`, and
//! the backend's cleanup queue of deleted sandboxes: `agentenv_sandbox_cleanups_pending`
//! and `agentenv_sandbox_cleanup_failures_total`; the pools: `agentenv_pool_sandboxes` and
//! `agentenv_pool_events_total{event}`; the node's own heap in use:
//! `agentenv_node_heap_in_use_bytes` (glibc only).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use tokio::time::Instant;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StageLabels {
    operation: &'static str,
    stage: &'static str,
    status: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct InflightLabels {
    operation: &'static str,
    stage: &'static str,
}

/// Stage timings of create, pause and resume.
#[derive(Clone)]
pub struct LifecycleMetrics {
    durations: Family<StageLabels, Histogram>,
    inflight: Family<InflightLabels, Gauge>,
    cleanups_pending: Gauge,
    cleanup_failures: Counter,
    pooled: Gauge,
    pool_events: Family<PoolLabels, Counter>,
    heap_in_use: Gauge,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PoolLabels {
    event: &'static str,
}

impl Default for LifecycleMetrics {
    fn default() -> Self {
        Self {
            durations: Family::new_with_constructor(
                agentenv_core::metrics::latency_histogram as fn() -> Histogram,
            ),
            inflight: Family::default(),
            cleanups_pending: Gauge::default(),
            cleanup_failures: Counter::default(),
            pooled: Gauge::default(),
            pool_events: Family::default(),
            heap_in_use: Gauge::default(),
        }
    }
}

impl LifecycleMetrics {
    /// Adds the families to `registry`.
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "agentenv_sandbox_stage_duration_seconds",
            "Duration of sandbox lifecycle stages",
            self.durations.clone(),
        );
        registry.register(
            "agentenv_sandbox_stage_inflight",
            "Sandbox lifecycle stages in progress",
            self.inflight.clone(),
        );
        registry.register(
            "agentenv_sandbox_cleanups_pending",
            "Deleted sandboxes whose resources are still being given back",
            self.cleanups_pending.clone(),
        );
        registry.register(
            "agentenv_sandbox_cleanup_failures",
            "Failed attempts to clean up a deleted sandbox (each one is retried)",
            self.cleanup_failures.clone(),
        );
        #[cfg(target_env = "gnu")]
        registry.register(
            "agentenv_node_heap_in_use_bytes",
            "Bytes the node's memory allocator has handed out and not got back (glibc mallinfo2, read at each scrape)",
            self.heap_in_use.clone(),
        );
        registry.register(
            "agentenv_pool_sandboxes",
            "Started sandboxes waiting in pools for a create",
            self.pooled.clone(),
        );
        registry.register(
            "agentenv_pool_events",
            "Pool events: creates served by a pool (claim), creates a pool could not serve (miss), pooled sandboxes destroyed for a rebuilt template (drain) or under memory pressure (shrink)",
            self.pool_events.clone(),
        );
    }

    /// Reads how many bytes the node's allocator has handed out and not got back (a leak
    /// makes it grow steadily; unlike resident memory it does not keep a burst's
    /// high-water mark). glibc only: `mallinfo2`, all arenas, small chunks in use plus
    /// chunks mapped on their own.
    #[cfg(target_env = "gnu")]
    pub fn set_heap_in_use(&self) {
        // SAFETY: mallinfo2 takes no arguments and returns a plain struct.
        let m = unsafe { libc::mallinfo2() };
        let bytes = m.uordblks.saturating_add(m.hblkhd);
        self.heap_in_use
            .set(i64::try_from(bytes).unwrap_or(i64::MAX));
    }

    /// Shows what the pools hold and did so far.
    pub fn set_pools(&self, u: &super::PoolUsage) {
        self.pooled.set(i64::from(u.pooled));
        for (event, n) in [
            ("claim", u.claims),
            ("miss", u.misses),
            ("drain", u.drained),
            ("shrink", u.shrunk),
        ] {
            let c = self.pool_events.get_or_create(&PoolLabels { event });
            let seen = c.get();
            if n > seen {
                c.inc_by(n - seen);
            }
        }
    }

    /// Shows what the cleanup queue did so far.
    pub fn set_cleanups(&self, stats: &crate::host::cleanup::CleanupStats) {
        self.cleanups_pending
            .set(i64::try_from(stats.pending).unwrap_or(i64::MAX));
        let seen = self.cleanup_failures.get();
        if stats.failures > seen {
            self.cleanup_failures.inc_by(stats.failures - seen);
        }
    }

    /// Starts timing `stage` of `operation`.
    pub fn start(&self, operation: &'static str, stage: &'static str) -> StageTimer {
        self.inflight
            .get_or_create(&InflightLabels { operation, stage })
            .inc();
        StageTimer {
            metrics: self.clone(),
            operation,
            stage,
            started: Instant::now(),
            done: false,
        }
    }
}

/// A running stage; dropping it unfinished counts as an error.
pub struct StageTimer {
    metrics: LifecycleMetrics,
    operation: &'static str,
    stage: &'static str,
    started: Instant,
    done: bool,
}

impl StageTimer {
    /// Records the stage as finished, successfully or not.
    pub fn finish(mut self, ok: bool) {
        self.record(ok);
    }

    fn record(&mut self, ok: bool) {
        if self.done {
            return;
        }
        self.done = true;
        let (operation, stage) = (self.operation, self.stage);
        self.metrics
            .inflight
            .get_or_create(&InflightLabels { operation, stage })
            .dec();
        self.metrics
            .durations
            .get_or_create(&StageLabels {
                operation,
                stage,
                status: if ok { "success" } else { "error" },
            })
            .observe(self.started.elapsed().as_secs_f64());
    }
}

impl Drop for StageTimer {
    fn drop(&mut self) {
        self.record(false);
    }
}
