//! Gateway metrics (`agentenv_gateway_*`).

use std::cell::RefCell;
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use agentenv_core::metrics::{SharedRegistry, latency_histogram};
use parking_lot::Mutex;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
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

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RouteCacheLabels {
    pub result: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct NodeLabels {
    pub node_id: String,
}

/// The gateway's metric families.
#[derive(Clone)]
pub struct GatewayMetrics {
    pub requests: Family<RequestLabels, Histogram>,
    pub upstream: Family<UpstreamLabels, Histogram>,
    pub scheduler_rpc: Family<RpcLabels, Histogram>,
    /// Inbound connections (and relayed upgrades) currently open.
    pub open_connections: Gauge,
    /// Cluster lists answered without a node, by the node left out.
    pub cluster_list_missing_nodes: Family<NodeLabels, Counter>,
    /// Sandbox routes found among the kept ones (`hit`) or asked of the scheduler.
    pub route_cache: Family<RouteCacheLabels, Counter>,
    /// The `hit` and `miss` counters of `route_cache`.
    route_hits: Counter,
    route_misses: Counter,
    registry: SharedRegistry,
    /// Tells this value's cached histogram handles from other values'.
    id: u64,
}

/// Which family a cached handle belongs to.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
enum Kind {
    Request,
    Upstream,
    Rpc,
}

/// A cached handle's key: the metrics value, the family, and the labels as
/// (address, length) of their static strings. Equal labels at different
/// addresses only make two entries for the same series.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
struct HandleKey {
    id: u64,
    kind: Kind,
    labels: [(usize, usize); 4],
}

fn label_key(s: &'static str) -> (usize, usize) {
    (s.as_ptr() as usize, s.len())
}

/// A multiply-rotate hash over a few machine words: the keys are
/// addresses, not input from clients.
#[derive(Default)]
struct WordHasher(u64);

impl Hasher for WordHasher {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(0x517c_c1b7_2722_0a95);
    }
    fn write_usize(&mut self, n: usize) {
        self.write_u64(n as u64);
    }
    fn write_u8(&mut self, n: u8) {
        self.write_u64(u64::from(n));
    }
    fn finish(&self) -> u64 {
        self.0
    }
}

thread_local! {
    /// Per-thread histogram handles, so recording a request takes neither
    /// the family's lock nor a hash of its label strings.
    static HANDLES: RefCell<HashMap<HandleKey, Histogram, BuildHasherDefault<WordHasher>>> =
        RefCell::default();
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
        let cluster_list_missing_nodes = Family::<NodeLabels, Counter>::default();
        let route_cache = Family::<RouteCacheLabels, Counter>::default();
        let route_hits = route_cache
            .get_or_create(&RouteCacheLabels { result: "hit" })
            .clone();
        let route_misses = route_cache
            .get_or_create(&RouteCacheLabels { result: "miss" })
            .clone();
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
        reg.register(
            "agentenv_gateway_cluster_list_missing_nodes",
            "Cluster sandbox lists answered without a node that did not answer, by node",
            cluster_list_missing_nodes.clone(),
        );
        reg.register(
            "agentenv_gateway_route_cache_lookups",
            "Sandbox routes found among the routes the gateway keeps (hit) or asked of the scheduler (miss)",
            route_cache.clone(),
        );
        Self {
            requests,
            upstream,
            scheduler_rpc,
            open_connections,
            cluster_list_missing_nodes,
            route_cache,
            route_hits,
            route_misses,
            registry: Arc::new(Mutex::new(reg)),
            id: {
                static NEXT: AtomicU64 = AtomicU64::new(0);
                NEXT.fetch_add(1, Ordering::Relaxed)
            },
        }
    }

    fn observe_cached(&self, key: HandleKey, create: impl FnOnce() -> Histogram, secs: f64) {
        HANDLES.with(|handles| {
            let mut handles = handles.borrow_mut();
            handles.entry(key).or_insert_with(create).observe(secs);
        });
    }

    /// Records one request's duration.
    pub fn observe_request(&self, labels: RequestLabels, secs: f64) {
        let key = HandleKey {
            id: self.id,
            kind: Kind::Request,
            labels: [
                label_key(labels.method),
                label_key(labels.route),
                label_key(labels.route_source),
                label_key(labels.status),
            ],
        };
        self.observe_cached(key, || self.requests.get_or_create(&labels).clone(), secs);
    }

    /// Records one proxied exchange until the upstream answered.
    pub fn observe_upstream(&self, labels: UpstreamLabels, secs: f64) {
        let key = HandleKey {
            id: self.id,
            kind: Kind::Upstream,
            labels: [
                label_key(labels.route),
                label_key(labels.status),
                (0, 0),
                (0, 0),
            ],
        };
        self.observe_cached(key, || self.upstream.get_or_create(&labels).clone(), secs);
    }

    /// Records one scheduler RPC.
    pub fn observe_rpc(&self, labels: RpcLabels, secs: f64) {
        let key = HandleKey {
            id: self.id,
            kind: Kind::Rpc,
            labels: [
                label_key(labels.rpc),
                label_key(labels.status),
                (0, 0),
                (0, 0),
            ],
        };
        self.observe_cached(
            key,
            || self.scheduler_rpc.get_or_create(&labels).clone(),
            secs,
        );
    }

    /// The registry to expose (e.g. with `agentenv_core::metrics::serve`).
    pub fn registry(&self) -> SharedRegistry {
        self.registry.clone()
    }

    /// Counts one sandbox route found among the kept ones (`hit`) or not.
    pub fn count_route_lookup(&self, hit: bool) {
        if hit {
            self.route_hits.inc();
        } else {
            self.route_misses.inc();
        }
    }

    /// Counts one cluster list answered without `node_id`.
    pub fn count_missing_node(&self, node_id: &str) {
        self.cluster_list_missing_nodes
            .get_or_create(&NodeLabels {
                node_id: node_id.to_string(),
            })
            .inc();
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
