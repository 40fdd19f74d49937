//! Gateway metrics (`agentenv_gateway_*`).

use std::sync::Arc;

use agentenv_core::metrics::{SharedRegistry, latency_histogram};
use parking_lot::Mutex;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    pub method: &'static str,
    pub route: &'static str,
    pub route_source: &'static str,
    pub status: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct UpstreamLabels {
    pub route: &'static str,
    pub status: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RpcLabels {
    pub rpc: &'static str,
    pub status: &'static str,
}

/// The gateway's metric families.
#[derive(Clone)]
pub struct GatewayMetrics {
    pub requests: Family<RequestLabels, Histogram>,
    pub upstream: Family<UpstreamLabels, Histogram>,
    pub scheduler_rpc: Family<RpcLabels, Histogram>,
    /// Inbound connections (and relayed upgrades) currently open.
    pub open_connections: Gauge,
    registry: SharedRegistry,
}

impl GatewayMetrics {
    pub fn new() -> Self {
        let requests = Family::<RequestLabels, Histogram>::new_with_constructor(
            latency_histogram as fn() -> Histogram,
        );
        let upstream = Family::<UpstreamLabels, Histogram>::new_with_constructor(
            latency_histogram as fn() -> Histogram,
        );
        let scheduler_rpc = Family::<RpcLabels, Histogram>::new_with_constructor(
            latency_histogram as fn() -> Histogram,
        );
        let open_connections = Gauge::default();
        let mut reg = Registry::default();
        reg.register(
            "agentenv_gateway_http_request_duration_seconds",
            "Gateway HTTP request latency",
            requests.clone(),
        );
        reg.register(
            "agentenv_gateway_upstream_proxy_duration_seconds",
            "Latency of proxied requests until the upstream answered",
            upstream.clone(),
        );
        reg.register(
            "agentenv_gateway_scheduler_rpc_duration_seconds",
            "Latency of scheduler RPCs made by the gateway",
            scheduler_rpc.clone(),
        );
        reg.register(
            "agentenv_gateway_open_connections",
            "Client connections currently open, relayed upgrades included",
            open_connections.clone(),
        );
        Self {
            requests,
            upstream,
            scheduler_rpc,
            open_connections,
            registry: Arc::new(Mutex::new(reg)),
        }
    }

    /// The registry to expose (e.g. with `agentenv_core::metrics::serve`).
    pub fn registry(&self) -> SharedRegistry {
        self.registry.clone()
    }

    /// Counts one open connection until the guard is dropped.
    pub fn connection_guard(&self) -> ConnectionGuard {
        self.open_connections.inc();
        ConnectionGuard(self.open_connections.clone())
    }
}

impl Default for GatewayMetrics {
    fn default() -> Self {
        Self::new()
    }
}

/// Decrements the open-connection gauge on drop.
pub struct ConnectionGuard(Gauge);

impl Drop for ConnectionGuard {
    fn drop(&mut self) {
        self.0.dec();
    }
}
