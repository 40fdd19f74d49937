//! The AgentENV scheduler as a library.
//!
//! It holds the runtime nodes (a static list from the config), takes their
//! heartbeats, tracks which node owns which sandbox, and places new sandboxes
//! with a pluggable [`Placement`]. Serve it as the `scheduler.v1` gRPC API, or
//! embed it and call [`SchedulerService`] directly:
//!
//! ```no_run
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! use agentenv_core::config::{NodeConfig, SchedulerConfig};
//! use agentenv_sched::Scheduler;
//!
//! let config = SchedulerConfig {
//!     nodes: vec![NodeConfig { id: "node-a".into(), endpoint: "http://10.0.0.21:8000".into() }],
//!     ..SchedulerConfig::default()
//! };
//! let scheduler = Scheduler::builder(config).build()?;
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:9090").await?;
//! scheduler.serve(listener, std::future::pending()).await?;
//! # Ok(()) }
//! ```
//!
//! With `redis_addr` set, bindings live in Redis ([`RedisBindingStore`]),
//! shared with query-only replicas and kept across restarts; build with
//! [`SchedulerBuilder::build_async`], which connects first. The primary also
//! keeps what it writes in memory and answers lookups from there
//! ([`MirroredRedisStore`]).

#![forbid(unsafe_code)]

pub mod artifacts;
pub mod auth;
pub mod bindings;
pub mod cpu_template;
pub mod metrics;
pub mod node_admin;
pub mod placement;
pub mod registry;
pub mod service;
#[cfg(test)]
mod test_support;

use std::future::Future;
use std::num::NonZeroUsize;
use std::sync::Arc;

use agentenv_core::cluster_auth::ClusterToken;
use agentenv_core::config::{DiscoveryMode, SchedulerConfig};
use agentenv_core::metrics::SharedRegistry;
use agentenv_core::proto::scheduler_v1::Node;
use agentenv_core::proto::scheduler_v1::scheduler_server::SchedulerServer;
use parking_lot::Mutex;
use tokio::net::TcpListener;
use tokio::time::{Duration, Instant, MissedTickBehavior};
use tokio_stream::StreamExt;
use tokio_stream::wrappers::TcpListenerStream;
use tonic_health::ServingStatus;
use tonic_health::pb::health_server::HealthServer;
use tonic_health::server::{HealthReporter, HealthService};

pub use bindings::{
    BindingStore, MemoryBindingStore, MirroredRedisStore, RedisBindingStore, StoreError,
};
pub use placement::{Candidate, Placement, PreferPooled};
pub use registry::{NodeListChange, NodeRegistry, P2pQuery, StaticRegistry};
pub use service::SchedulerService;

/// How often the observed-nodes gauge is refreshed.
const GAUGE_REFRESH: Duration = Duration::from_secs(15);

/// The scheduler could not be assembled from its config.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    #[error(
        "scheduler.strategy: unknown strategy {0:?}: use one of round_robin, random, least_loaded, power_of_two, or pass a Placement to the builder"
    )]
    UnknownStrategy(String),
    #[error(
        "scheduler.discovery.mode: kubernetes discovery is not available in this build; use \"static\" with a scheduler.nodes list"
    )]
    KubernetesUnsupported,
    #[error(
        "scheduler.redis_addr: {0}; check that redis-server runs there and that redis_addr names it (host:port, redis://[:password@]host:port/db or rediss://...), or leave redis_addr empty to keep bindings in memory"
    )]
    Redis(String),
    #[error(
        "scheduler.redis_addr: the Redis binding store connects asynchronously; build with SchedulerBuilder::build_async, or pass a store with binding_store"
    )]
    RedisNeedsAsync,
    #[error("scheduler.artifact_store_capacity: must be greater than zero")]
    ArtifactCapacity,
    #[error("scheduler.{0}")]
    ClusterToken(#[from] agentenv_core::cluster_auth::ClusterTokenError),
    #[error("scheduler.tls: {0}")]
    Tls(String),
}

/// Assembles a [`Scheduler`]; every part has a default from the config.
pub struct SchedulerBuilder {
    config: SchedulerConfig,
    auth: Option<auth::ClusterAuth>,
    query_only: bool,
    placement: Option<Arc<dyn Placement>>,
    store: Option<Arc<dyn BindingStore>>,
    registry: Option<Arc<dyn NodeRegistry>>,
}

impl SchedulerBuilder {
    /// Serve only `LookupNode` (for replicas reading a shared binding store).
    pub fn query_only(mut self, yes: bool) -> Self {
        self.query_only = yes;
        self
    }

    /// Use this placement instead of the configured built-in strategy. It is used as
    /// given: wrap it in [`placement::PreferPooled`] to prefer nodes with pooled
    /// sandboxes as the built-ins do.
    pub fn placement(mut self, placement: impl Placement) -> Self {
        self.placement = Some(Arc::new(placement));
        self
    }

    /// Use this binding store instead of the one the config names (in
    /// memory, or Redis with `redis_addr`).
    pub fn binding_store(mut self, store: Arc<dyn BindingStore>) -> Self {
        self.store = Some(store);
        self
    }

    /// Check calls against this credential instead of the config's
    /// `cluster_token_file` and `open_lookups`.
    pub fn cluster_auth(mut self, auth: auth::ClusterAuth) -> Self {
        self.auth = Some(auth);
        self
    }

    /// Use this node registry instead of the static list of the config.
    pub fn registry(mut self, registry: Arc<dyn NodeRegistry>) -> Self {
        self.registry = Some(registry);
        self
    }

    /// Builds the scheduler, connecting to Redis first when
    /// `scheduler.redis_addr` is set and no store was passed: the Redis must
    /// answer a PING within 2 s. A primary mirrors its writes in memory
    /// ([`MirroredRedisStore`]); a query-only replica reads Redis.
    pub async fn build_async(mut self) -> Result<Scheduler, BuildError> {
        if self.store.is_none() && !self.config.redis_addr.trim().is_empty() {
            let store =
                RedisBindingStore::connect(&self.config.redis_addr, self.config.binding_ttl)
                    .await
                    .map_err(|e| BuildError::Redis(e.0))?;
            self.store = Some(if self.query_only {
                Arc::new(store)
            } else {
                Arc::new(MirroredRedisStore::new(store, self.config.binding_ttl))
            });
        }
        self.build()
    }

    /// Builds the scheduler with the in-memory binding store, or the store
    /// passed with [`Self::binding_store`]. A `scheduler.redis_addr` needs
    /// [`Self::build_async`].
    pub fn build(self) -> Result<Scheduler, BuildError> {
        let c = &self.config;
        let placement: Arc<dyn Placement> = match self.placement {
            Some(p) => p,
            None => {
                let builtin: Arc<dyn Placement> = placement::builtin(&c.strategy)
                    .map(Arc::from)
                    .ok_or_else(|| BuildError::UnknownStrategy(c.strategy.to_string()))?;
                if c.prefer_pooled_nodes {
                    Arc::new(placement::PreferPooled::wrap(builtin))
                } else {
                    builtin
                }
            }
        };
        let store: Arc<dyn BindingStore> = match self.store {
            Some(s) => s,
            None if !c.redis_addr.trim().is_empty() => return Err(BuildError::RedisNeedsAsync),
            None => Arc::new(MemoryBindingStore::new(c.binding_ttl)),
        };
        let registry: Option<Arc<dyn NodeRegistry>> = if self.query_only {
            None
        } else {
            Some(match self.registry {
                Some(r) => r,
                None if c.discovery.mode == DiscoveryMode::Kubernetes => {
                    return Err(BuildError::KubernetesUnsupported);
                }
                None => Arc::new(StaticRegistry::new(
                    c.nodes
                        .iter()
                        .map(|n| Node {
                            node_id: n.id.clone(),
                            endpoint: n.endpoint.clone(),
                        })
                        .collect(),
                    c.report_ttl,
                )),
            })
        };
        let capacity = usize::try_from(c.artifact_store_capacity)
            .ok()
            .and_then(NonZeroUsize::new)
            .ok_or(BuildError::ArtifactCapacity)?;
        let placement_name = placement.name().to_string();
        let metrics = metrics::SchedulerMetrics::default();
        let mut prom = prometheus_client::registry::Registry::default();
        metrics.register(&mut prom);
        let service = SchedulerService::new(service::Inner {
            registry,
            store,
            placement,
            artifacts: Mutex::new(artifacts::ArtifactStore::new(
                capacity,
                c.artifact_lookup_node_limit,
            )),
            limit: c.node_resource_limit.clone(),
            schedule_handles: service::ScheduleHandles::new(&metrics, placement_name.as_str()),
            metrics,
        });
        let health = HealthReporter::new();
        let auth = match self.auth {
            Some(a) => a,
            None => auth::ClusterAuth {
                token: ClusterToken::from_optional_file(&c.cluster_token_file)?,
                open_lookups: c.open_lookups,
            },
        };
        let tls = if c.tls.enabled() {
            let read = |path: &str| {
                std::fs::read(path.trim()).map_err(|e| BuildError::Tls(format!("{path}: {e}")))
            };
            let mut tls = tonic::transport::ServerTlsConfig::new().identity(
                tonic::transport::Identity::from_pem(
                    read(&c.tls.cert_file)?,
                    read(&c.tls.key_file)?,
                ),
            );
            if !c.tls.client_ca_file.trim().is_empty() {
                tls = tls.client_ca_root(tonic::transport::Certificate::from_pem(read(
                    &c.tls.client_ca_file,
                )?));
            }
            Some(tls)
        } else {
            None
        };
        Ok(Scheduler {
            service,
            auth,
            tls,
            metrics_registry: Arc::new(Mutex::new(prom)),
            health,
            binding_ttl: c.binding_ttl,
            report_ttl: c.report_ttl,
        })
    }
}

/// A scheduler ready to serve.
pub struct Scheduler {
    service: SchedulerService,
    auth: auth::ClusterAuth,
    /// TLS of the gRPC listener (`scheduler.tls`).
    tls: Option<tonic::transport::ServerTlsConfig>,
    metrics_registry: SharedRegistry,
    health: HealthReporter,
    binding_ttl: Duration,
    report_ttl: Duration,
}

type Server = SchedulerServer<SchedulerService>;

impl Scheduler {
    pub fn builder(config: SchedulerConfig) -> SchedulerBuilder {
        SchedulerBuilder {
            config,
            auth: None,
            query_only: false,
            placement: None,
            store: None,
            registry: None,
        }
    }

    /// The service, for in-process calls or mounting in another tonic server.
    pub fn service(&self) -> SchedulerService {
        self.service.clone()
    }

    /// The Prometheus registry holding the scheduler's metrics.
    pub fn metrics_registry(&self) -> SharedRegistry {
        self.metrics_registry.clone()
    }

    /// The gRPC health reporter (SERVING while [`Scheduler::serve`] runs).
    pub fn health(&self) -> HealthReporter {
        self.health.clone()
    }

    /// Serves `scheduler.v1.Scheduler` and `grpc.health.v1.Health` on
    /// `listener` until `shutdown` resolves; then health turns NOT_SERVING
    /// and in-flight calls drain. Also runs the periodic maintenance (gauge
    /// refresh, expired-binding sweep) while serving.
    pub async fn serve(
        &self,
        listener: TcpListener,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), tonic::transport::Error> {
        self.health.set_serving::<Server>().await;
        self.health
            .set_service_status("", ServingStatus::Serving)
            .await;
        let maintenance = tokio::spawn(self.maintenance());
        let incoming = TcpListenerStream::new(listener).map(|s| {
            if let Ok(s) = &s {
                let _ = s.set_nodelay(true);
            }
            s
        });
        let health = self.health.clone();
        let mut server = tonic::transport::Server::builder();
        if let Some(tls) = &self.tls {
            server = server.tls_config(tls.clone())?;
        }
        let result = server
            .add_service(HealthServer::new(HealthService::from_health_reporter(
                self.health.clone(),
            )))
            .add_service(auth::Authenticated::new(
                SchedulerServer::new(self.service.clone()),
                self.auth.clone(),
            ))
            .serve_with_incoming_shutdown(incoming, async move {
                shutdown.await;
                health.set_not_serving::<Server>().await;
                health
                    .set_service_status("", ServingStatus::NotServing)
                    .await;
            })
            .await;
        maintenance.abort();
        result
    }

    /// Refreshes the observed-nodes gauge and drops nodes that left the node
    /// list and went silent every 15 s, and sweeps expired bindings every
    /// binding TTL, forever.
    pub fn maintenance(&self) -> impl Future<Output = ()> + Send + 'static {
        let service = self.service.clone();
        let sweep_every = self.binding_ttl.max(Duration::from_secs(1));
        // By then a silent node's bindings have expired and it counts as unhealthy.
        let removed_grace = self.binding_ttl.max(self.report_ttl);
        async move {
            let mut gauge = tokio::time::interval(GAUGE_REFRESH);
            let mut sweep = tokio::time::interval(sweep_every);
            gauge.set_missed_tick_behavior(MissedTickBehavior::Delay);
            sweep.set_missed_tick_behavior(MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = gauge.tick() => {
                        service.prune_removed_nodes(removed_grace);
                        if let Some(r) = service.registry() {
                            service.metrics().set_observed(r.status_counts(Instant::now()));
                        }
                    }
                    _ = sweep.tick() => {
                        match service.binding_store().sweep_expired(Instant::now()).await {
                            Ok(0) => {}
                            Ok(n) => tracing::debug!(swept = n, "expired bindings removed"),
                            Err(e) => tracing::warn!(error = %e, "binding sweep failed"),
                        }
                    }
                }
            }
        }
    }
}
