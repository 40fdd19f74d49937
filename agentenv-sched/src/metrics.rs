//! The scheduler's Prometheus metrics.

use agentenv_core::metrics::latency_histogram;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use crate::registry::StatusCounts;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RpcLabels {
    pub rpc: &'static str,
    pub status: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ScheduleLabels {
    pub strategy: String,
    pub status: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StrategyLabel {
    pub strategy: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StatusLabel {
    pub status: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReloadLabel {
    /// `ok` or `failed`.
    pub result: &'static str,
}

type HistogramFamily<L> = Family<L, Histogram, fn() -> Histogram>;

/// Every metric the scheduler exports.
#[derive(Clone)]
pub struct SchedulerMetrics {
    pub rpc_duration: HistogramFamily<RpcLabels>,
    pub schedule_duration: HistogramFamily<ScheduleLabels>,
    pub schedule_assignments: Family<StrategyLabel, Counter>,
    pub observed_nodes: Family<StatusLabel, Gauge>,
    pub config_reloads: Family<ReloadLabel, Counter>,
}

impl Default for SchedulerMetrics {
    fn default() -> Self {
        Self {
            rpc_duration: Family::new_with_constructor(latency_histogram),
            schedule_duration: Family::new_with_constructor(latency_histogram),
            schedule_assignments: Family::default(),
            observed_nodes: Family::default(),
            config_reloads: Family::default(),
        }
    }
}

impl SchedulerMetrics {
    /// Registers every metric in `registry`.
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "agentenv_scheduler_rpc_duration_seconds",
            "Scheduler gRPC handling time by method and status",
            self.rpc_duration.clone(),
        );
        registry.register(
            "agentenv_scheduler_schedule_duration_seconds",
            "Time to place a sandbox, by strategy and status",
            self.schedule_duration.clone(),
        );
        registry.register(
            "agentenv_scheduler_schedule_assignments",
            "Successful placements by strategy",
            self.schedule_assignments.clone(),
        );
        registry.register(
            "agentenv_scheduler_observed_nodes",
            "Observed runtime nodes by derived status",
            self.observed_nodes.clone(),
        );
        registry.register(
            "agentenv_scheduler_config_reloads",
            "Config reloads (SIGHUP) by result: ok, or failed (nothing changed)",
            self.config_reloads.clone(),
        );
    }

    /// Sets the observed-nodes gauge for every status.
    pub fn set_observed(&self, c: StatusCounts) {
        for (status, n) in [
            ("ready", c.ready),
            ("connecting", c.connecting),
            ("unhealthy", c.unhealthy),
            ("lingering", c.lingering),
            ("draining", c.draining),
            ("unspecified", c.unspecified),
        ] {
            self.observed_nodes
                .get_or_create(&StatusLabel { status })
                .set(n as i64);
        }
    }
}
