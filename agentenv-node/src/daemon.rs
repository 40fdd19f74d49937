//! The node daemon: builds the backend, the lifecycle engine, the API and the heartbeat
//! reporter from a [`NodeConfig`], serves, and shuts down gracefully.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;

use crate::access::{self, KeyOrigin, TokenIssuer};
use crate::api::{self, ApiState, NodeIdentity};
use crate::backend::jail::{JailBackend, JailConfig};
use crate::backend::microvm::{self, MicrovmBackend, MicrovmConfig};
use crate::backend::{BackendError, KeptState, SandboxBackend};
use crate::config::{BackendKind, NodeConfig};
use crate::host::HostedConfig;
use crate::host::net::Ipv4Net;
use crate::lifecycle::{
    LifecycleConfig, LifecycleError, Orchestrator, PausedStore, ReporterSource,
};
use crate::reporter::{ReporterConfig, ReporterHandle};

/// Why the daemon could not start.
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    #[error("credentials: {0}")]
    Access(#[from] access::AccessError),
    #[error("backend: {0}")]
    Backend(#[from] BackendError),
    #[error(
        "AENV_BACKEND=microvm cannot run on this host: {0}; or use AENV_BACKEND=jail (or auto)"
    )]
    MicrovmUnavailable(String),
    #[error("invalid AENV_JAIL_ADDRESS_POOL {0:?}: use a CIDR such as 10.12.0.0/16")]
    AddressPool(String),
    #[error("paused-sandbox store: {0}")]
    Lifecycle(#[from] LifecycleError),
    #[error("cannot listen on API_ADDR {addr}: {source}")]
    Listen {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "the token seed file {} is missing but paused sandboxes need it (their access tokens derive from it): restore the file or set AENV_SANDBOX_ACCESS_TOKEN_HASH_SEED",
        .0.display()
    )]
    SeedMissing(std::path::PathBuf),
    #[error("AENV_TLS_CERT_FILE / AENV_TLS_KEY_FILE / AENV_TLS_CLIENT_CA_FILE: {0}")]
    Tls(String),
    #[error("AENV_CLUSTER_TOKEN_FILE / AENV_SCHEDULER_CA_FILE: {0}")]
    ClusterToken(String),
    #[error("heartbeat reporter: {0}")]
    Reporter(#[from] crate::reporter::ReporterError),
    #[error("{0}")]
    Snapshots(#[from] crate::snapshot::SnapshotError),
}

/// A started node.
pub struct Daemon {
    state: Arc<ApiState>,
    listener: TcpListener,
    local_addr: SocketAddr,
    reporter: Option<ReporterHandle>,
    event_task: Option<tokio::task::JoinHandle<ReporterHandle>>,
    ticker: tokio::task::JoinHandle<()>,
    /// Samples the sandboxes' resource usage.
    sampler: tokio::task::JoinHandle<()>,
    /// TLS of the API listener (`AENV_TLS_CERT_FILE`…).
    tls: Option<Arc<rustls::ServerConfig>>,
}

/// Builds the jail backend of `cfg`; reconciliation keeps the layers in `kept` (what the
/// paused-sandbox records reference).
pub async fn jail_backend(
    cfg: &NodeConfig,
    kept: &[KeptState],
) -> Result<JailBackend, DaemonError> {
    let mut j = JailConfig::new(&cfg.home, &cfg.guest_binary);
    hosted_settings(&mut j, cfg)?;
    if !cfg.guest_init_mode {
        j.agent_args = Vec::new();
    }
    j.agent_listener = cfg.guest_inherit_listener;
    j.net_pool_size = cfg.jail_net_pool_size;
    j.disk_size_mb = cfg.jail_disk_size_mb;
    j.layer_pool_size = cfg.jail_layer_pool_size;
    reconciled(JailBackend::new(j).await?, kept).await
}

/// Builds the microvm backend of `cfg` (it shares the jail's address pool, interface
/// prefix and cgroup parent settings); reconciliation keeps the snapshots in `kept`.
pub async fn microvm_backend(
    cfg: &NodeConfig,
    kept: &[KeptState],
) -> Result<MicrovmBackend, DaemonError> {
    if let Some(reason) = microvm::unavailable_reason(&cfg.guest_kernel, &cfg.vmm_binary) {
        return Err(DaemonError::MicrovmUnavailable(reason));
    }
    let mut m = MicrovmConfig::new(
        &cfg.home,
        &cfg.guest_binary,
        &cfg.vmm_binary,
        &cfg.guest_kernel,
    );
    hosted_settings(&mut m, cfg)?;
    reconciled(MicrovmBackend::new(m).await?, kept).await
}

/// Sets what both backends take from the node configuration: the runtime directory, the
/// template store, and the jail's address pool (`AENV_JAIL_ADDRESS_POOL`), interface
/// prefix, cgroup parent, id pool, sandbox nameservers and NAT mode.
fn hosted_settings(h: &mut HostedConfig, cfg: &NodeConfig) -> Result<(), DaemonError> {
    h.runtime_dir = cfg.runtime_path.clone();
    h.templates.root = cfg.template_path.clone();
    h.address_pool = cfg
        .jail_address_pool
        .parse::<Ipv4Net>()
        .map_err(|_| DaemonError::AddressPool(cfg.jail_address_pool.clone()))?;
    h.iface_prefix = cfg.jail_iface_prefix.clone();
    h.cgroup_parent = cfg.jail_cgroup_parent.clone();
    h.id_pool = cfg.jail_id_pool;
    h.sandbox_logs = Arc::new(crate::observe::LogBook::new(
        cfg.home.join("sandbox-logs"),
        cfg.sandbox_log_file_bytes,
    ));
    h.dns_servers = cfg.jail_dns_servers.clone();
    h.nat = cfg.net_nat;
    Ok(())
}

/// `backend` after removing what an earlier run left behind (except the state in `kept`).
async fn reconciled<B: SandboxBackend>(b: B, kept: &[KeptState]) -> Result<B, DaemonError> {
    let report = b.reconcile(kept).await?;
    if !report.removed_sandboxes.is_empty() {
        tracing::info!(removed = ?report.removed_sandboxes, "removed sandboxes of an earlier run");
    }
    Ok(b)
}

/// The backend `AENV_BACKEND=auto` picks on this host, and why.
pub fn auto_backend(cfg: &NodeConfig) -> (BackendKind, String) {
    match microvm::unavailable_reason(&cfg.guest_kernel, &cfg.vmm_binary) {
        None => (
            BackendKind::Microvm,
            format!(
                "hardware KVM, the guest kernel {} and the VMM {} are present",
                cfg.guest_kernel.display(),
                cfg.vmm_binary.display()
            ),
        ),
        Some(reason) => (
            BackendKind::Jail,
            format!("microVMs cannot run here: {reason}"),
        ),
    }
}

/// Opens the snapshot repository of `cfg` and checks that it is usable (a writable
/// directory; a bucket that exists and accepts the credentials). Records are signed and
/// verified with the key derived from the token seed `seed`.
pub async fn snapshot_repository(
    cfg: &NodeConfig,
    seed: &str,
) -> Result<Arc<crate::snapshot::SnapshotRepo>, DaemonError> {
    use agentenv_core::storage::{OpendalStorage, Storage};
    let storage = OpendalStorage::open(&cfg.snapshot_repository)
        .map_err(crate::snapshot::SnapshotError::from)?;
    storage
        .check()
        .await
        .map_err(crate::snapshot::SnapshotError::from)?;
    let describe = storage.describe();
    let repo = crate::snapshot::SnapshotRepo::new(
        Arc::new(storage),
        &cfg.snapshot_repository,
        &cfg.snapshot_local_cache,
        crate::snapshot::RecordKey::from_seed(seed),
    )?;
    tracing::info!(store = %describe, "snapshot repository ready");
    Ok(Arc::new(repo))
}

impl Daemon {
    /// Resolves credentials, starts the backend and binds `API_ADDR`.
    pub async fn start(cfg: NodeConfig) -> Result<Self, DaemonError> {
        let (api_key, origin) =
            access::resolve_api_key(cfg.api_key.clone(), &cfg.api_key_file, &cfg.home)?;
        match origin {
            KeyOrigin::Generated => tracing::info!(
                path = %cfg.home.join("secrets").join(access::API_KEY_FILE).display(),
                "generated a new API key"
            ),
            o => tracing::info!(origin = ?o, "API key loaded"),
        }
        let store = PausedStore::open(cfg.home.join("persisted-sandboxes"))
            .map_err(LifecycleError::from)?;
        let seed_file = cfg.home.join("secrets").join(access::SEED_FILE);
        if cfg.token_seed.is_none() && !seed_file.exists() {
            // A new seed would lock clients out of every restored sandbox: each
            // agent requires the token derived from the seed.
            let needs_seed = !store.load_all().map_err(LifecycleError::from)?.is_empty();
            if needs_seed {
                return Err(DaemonError::SeedMissing(seed_file));
            }
        }
        let seed = access::resolve_seed(cfg.token_seed.clone(), &cfg.home)?;
        // Before the backend: a repository that cannot work stops the start with
        // nothing set up.
        let snapshots = snapshot_repository(&cfg, &seed).await?;
        let kept: Vec<KeptState> = store
            .load_all()
            .map_err(LifecycleError::from)?
            .into_iter()
            .filter_map(|r| r.kept)
            .collect();
        let kind = match cfg.backend {
            BackendKind::Auto => {
                let (kind, why) = auto_backend(&cfg);
                tracing::info!(backend = kind.as_str(), reason = %why, "AENV_BACKEND=auto: using the {kind} backend: {why}");
                kind
            }
            other => other,
        };
        let (backend, sandbox_logs): (Arc<dyn SandboxBackend>, _) = match kind {
            BackendKind::Microvm => {
                let b = microvm_backend(&cfg, &kept).await?;
                let logs = b.sandbox_logs().clone();
                (Arc::new(b), logs)
            }
            BackendKind::Jail | BackendKind::Auto => {
                let b = jail_backend(&cfg, &kept).await?;
                let logs = b.sandbox_logs().clone();
                (Arc::new(b), logs)
            }
        };
        // Logs of sandboxes no record names are what an earlier run left behind.
        let known: std::collections::HashSet<String> = store
            .load_all()
            .map_err(LifecycleError::from)?
            .into_iter()
            .map(|r| r.id)
            .collect();
        let removed = sandbox_logs.retain(&|id| known.contains(id));
        if !removed.is_empty() {
            tracing::info!(
                removed = removed.len(),
                "removed sandbox logs of an earlier run"
            );
        }
        let lc = LifecycleConfig {
            default_timeout: cfg.default_timeout,
            auto_evict_interval: cfg.auto_evict_interval,
            auto_resume_min_timeout: cfg.auto_resume_min_timeout,
            default_cpu_count: cfg.default_cpu_count,
            default_memory_mb: cfg.default_memory_mb,
            agent_ready_timeout: cfg.agent_ready_timeout,
            metrics_interval: cfg.metrics_interval,
            metrics_history: cfg.metrics_history,
            default_disk_size_mb: (kind != BackendKind::Microvm).then_some(cfg.jail_disk_size_mb),
            pool: cfg.pool.clone(),
            ..LifecycleConfig::default()
        };
        let orch = Orchestrator::new(backend, lc, TokenIssuer::new(&seed), store)?;
        orch.set_sandbox_logs(sandbox_logs);
        let catalog = Arc::new(crate::template::catalog::TemplateCatalog::new(
            snapshots.storage().clone(),
            &seed,
        ));
        let mut bs = crate::lifecycle::BuildSettings::new(&cfg.node_id, &cfg.home);
        bs.max_concurrent = cfg.template_build_concurrency;
        bs.step_timeout = cfg.template_step_timeout;
        bs.ready_timeout = cfg.template_ready_timeout;
        bs.default_registry = cfg.oci_default_registry.clone();
        bs.insecure_registries = cfg.oci_insecure_registries.clone();
        orch.set_templates(Arc::new(crate::lifecycle::Templates::new(
            catalog,
            crate::template::TemplateStore::new(crate::template::TemplateStoreConfig::new(
                &cfg.template_path,
            )),
            bs,
        )?));
        let volume_path = cfg.volume_path();
        let volumes = crate::volume::Volumes::open(
            snapshots.storage().clone(),
            &cfg.snapshot_repository,
            &volume_path,
            crate::volume::VolumeKey::from_seed(&seed),
            &cfg.node_id,
        )
        .map_err(LifecycleError::from)?;
        orch.set_volumes(Arc::new(volumes));
        if kind != BackendKind::Microvm
            && let Err(e) = crate::host::ids::check_idmapped_mounts(
                &volume_path,
                crate::host::ids::IdRange {
                    base: cfg.jail_id_pool.first,
                },
            )
        {
            tracing::warn!(dir = %volume_path.display(), error = %e, "sandboxes on this node cannot mount volumes: creates with volumeMounts will fail");
        }
        match orch.reconcile_volumes().await {
            Ok(0) => {}
            Ok(n) => tracing::info!(
                removed = n,
                "removed volume leases of sandboxes this node no longer has"
            ),
            Err(e) => tracing::warn!(error = %e, "checking this node's volume leases"),
        }
        orch.set_snapshot_repository(snapshots);
        let identity = NodeIdentity {
            node_id: cfg.node_id.clone(),
            cluster_id: cfg.cluster_id.clone(),
            service_instance_id: cfg.service_instance_id.clone(),
            version: env!("CARGO_PKG_VERSION").into(),
            commit: option_env!("AENV_GIT_COMMIT").unwrap_or("unknown").into(),
        };
        // One host sampler for heartbeats and `GET /nodes`; the data directory's file
        // system is among its disks.
        let host = Arc::new(crate::observe::HostSampler::new(vec![cfg.home.clone()]));
        let state = ApiState::new(
            orch.clone(),
            api_key,
            identity,
            cfg.proxy_domains.clone(),
            crate::dataplane::RelayTimeouts {
                upload_idle: cfg.proxy_upload_idle_timeout,
                response_headers: cfg.proxy_response_header_timeout,
            },
            host.clone(),
        );
        state
            .tls
            .store(cfg.tls.enabled(), std::sync::atomic::Ordering::Relaxed);
        let listener =
            TcpListener::bind(cfg.api_addr)
                .await
                .map_err(|source| DaemonError::Listen {
                    addr: cfg.api_addr,
                    source,
                })?;
        let local_addr = listener
            .local_addr()
            .map_err(|source| DaemonError::Listen {
                addr: cfg.api_addr,
                source,
            })?;
        let (reporter, event_task) = match (&cfg.scheduler_endpoint, cfg.report_enabled) {
            (Some(ep), true) => {
                let mut rc =
                    ReporterConfig::new(ep.clone(), cfg.node_id.clone(), cfg.report_interval);
                rc.cluster_id = cfg.cluster_id.clone();
                rc.service_instance_id = cfg.service_instance_id.clone();
                rc.host = host.clone();
                rc.link = agentenv_core::cluster_auth::SchedulerLink::from_config(
                    &cfg.cluster_token_file
                        .as_deref()
                        .map(|p| p.display().to_string())
                        .unwrap_or_default(),
                    &cfg.scheduler_tls,
                )
                .map_err(|e| DaemonError::ClusterToken(e.to_string()))?;
                let handle = ReporterHandle::start(rc, Arc::new(ReporterSource(orch.clone())))?;
                let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
                orch.set_event_sink(tx);
                let task = tokio::spawn(async move {
                    while let Some(ev) = rx.recv().await {
                        handle.report_event(ev);
                    }
                    handle
                });
                tracing::info!(endpoint = %ep, interval = ?cfg.report_interval, "scheduler heartbeats on");
                (None, Some(task))
            }
            _ => {
                tracing::info!(
                    "scheduler heartbeats off (set AENV_OBSERVABILITY_SCHEDULER_REPORT_ENABLED=true and AENV_OBSERVABILITY_SCHEDULER_ENDPOINT=http://host:port)"
                );
                (None, None)
            }
        };
        let ticker = orch.start_ticker();
        let sampler = orch.start_sampler();
        // Stops by itself at shutdown.
        let _pools = orch.start_pools();
        let tls = if cfg.tls.enabled() {
            let cert = agentenv_core::tls::ReloadingCert::load(
                std::path::Path::new(cfg.tls.cert_file.trim()),
                std::path::Path::new(cfg.tls.key_file.trim()),
            )
            .map_err(|e| DaemonError::Tls(e.to_string()))?;
            let client_ca = Some(cfg.tls.client_ca_file.trim())
                .filter(|p| !p.is_empty())
                .map(std::path::Path::new);
            Some(
                agentenv_core::tls::server_config(cert, client_ca, &[b"h2", b"http/1.1"])
                    .map_err(|e| DaemonError::Tls(e.to_string()))?,
            )
        } else {
            None
        };
        Ok(Self {
            state,
            listener,
            local_addr,
            reporter,
            event_task,
            ticker,
            sampler,
            tls,
        })
    }

    /// The address the API listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// The platform API key in use.
    pub fn api_key(&self) -> &str {
        &self.state.api_key
    }

    /// The lifecycle engine.
    pub fn orchestrator(&self) -> Arc<Orchestrator> {
        self.state.orch.clone()
    }

    /// Serves until `shutdown` resolves, then: stops accepting, unregisters from the
    /// scheduler, pauses every running sandbox (recorded for the next start).
    pub async fn run(self, shutdown: impl std::future::Future<Output = ()>) {
        let orch = self.state.orch.clone();
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let state = self.state.clone();
        let server = tokio::spawn(api::serve(
            state,
            self.listener,
            self.tls.map(tokio_rustls::TlsAcceptor::from),
            async move {
                let _ = stop_rx.await;
            },
            Duration::from_secs(5),
        ));
        shutdown.await;
        tracing::info!("shutting down");
        // New lifecycle requests on open connections get 503 while sandboxes are paused.
        orch.begin_shutdown();
        let _ = stop_tx.send(());
        self.ticker.abort();
        self.sampler.abort();
        let (_, ()) = tokio::join!(server, orch.shutdown());
        let reporter = match self.event_task {
            Some(t) => t.await.ok(),
            None => self.reporter,
        };
        if let Some(r) = reporter {
            r.shutdown().await;
        }
        tracing::info!("node stopped");
    }
}
