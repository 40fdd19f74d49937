//! Node configuration: an optional TOML file, overridden by environment variables as the
//! deployment writes them into `/etc/default/aenv`.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use agentenv_core::storage::StorageConfig;

mod file;
mod pool;
mod values;

use file::{FileConfig, backend_key, oss_config};
use values::{env_in, env_u64, expand_home, hostname, parse_bool, pool_size};

/// Errors while loading the configuration. Each names the key and the fix.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("reading config file {}: {source}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("config file {}: {message}", path.display())]
    Toml { path: PathBuf, message: String },
    #[error("{key}={value:?} is invalid: {fix}")]
    Invalid {
        key: &'static str,
        value: String,
        fix: String,
    },
}

fn invalid(key: &'static str, value: impl Into<String>, fix: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        key,
        value: value.into(),
        fix: fix.into(),
    }
}

/// Which backend runs sandboxes (`AENV_BACKEND`); a running node's backend is `Jail` or
/// `Microvm`. Written and parsed as `auto`, `jail`, `microvm`, the names
/// [`SandboxBackend::kind`] gives and snapshots record.
///
/// [`SandboxBackend::kind`]: crate::backend::SandboxBackend::kind
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendKind {
    /// `microvm` on hardware KVM with a guest kernel and the VMM present, else `jail`.
    Auto,
    Jail,
    Microvm,
}

impl BackendKind {
    pub fn as_str(self) -> &'static str {
        match self {
            BackendKind::Auto => "auto",
            BackendKind::Jail => "jail",
            BackendKind::Microvm => "microvm",
        }
    }
}

impl std::fmt::Display for BackendKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A name that is no backend.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown sandbox backend {0:?}: use auto, jail or microvm")]
pub struct UnknownBackend(pub String);

impl std::str::FromStr for BackendKind {
    type Err = UnknownBackend;

    /// The exact name (`jail`, not `Jail`).
    fn from_str(s: &str) -> Result<Self, UnknownBackend> {
        match s {
            "auto" => Ok(BackendKind::Auto),
            "jail" => Ok(BackendKind::Jail),
            "microvm" => Ok(BackendKind::Microvm),
            _ => Err(UnknownBackend(s.to_string())),
        }
    }
}

/// Compares with the name: `kind == "jail"`.
impl PartialEq<&str> for BackendKind {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

/// The node's configuration.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    /// Where the REST API and the data plane listen (`API_ADDR`).
    pub api_addr: SocketAddr,
    pub node_id: String,
    pub cluster_id: String,
    pub service_instance_id: String,
    /// `AENV_API_KEY`; `None` reads or generates the managed key.
    pub api_key: Option<String>,
    /// The secret file read when `AENV_API_KEY` is unset.
    pub api_key_file: PathBuf,
    /// `AENV_SANDBOX_ACCESS_TOKEN_HASH_SEED`; `None` reads or generates the managed seed.
    pub token_seed: Option<String>,
    pub report_enabled: bool,
    pub scheduler_endpoint: Option<String>,
    /// The cluster credential's file (`AENV_CLUSTER_TOKEN_FILE`), sent to the scheduler.
    pub cluster_token_file: Option<PathBuf>,
    /// TLS to an `https://` scheduler endpoint (`AENV_SCHEDULER_CA_FILE`, and
    /// `AENV_SCHEDULER_CLIENT_CERT_FILE` / `_KEY_FILE` for mutual TLS).
    pub scheduler_tls: agentenv_core::config::TlsConnect,
    /// TLS of the API listener (`AENV_TLS_CERT_FILE`, `AENV_TLS_KEY_FILE`, and
    /// `AENV_TLS_CLIENT_CA_FILE` to require client certificates).
    pub tls: agentenv_core::config::TlsListen,
    pub report_interval: Duration,
    /// Data directory (`AENV_HOME_PATH`).
    pub home: PathBuf,
    /// Host-wide runtime directory shared by node processes (`AENV_RUNTIME_PATH`).
    pub runtime_path: PathBuf,
    pub backend: BackendKind,
    /// The static guest agent binary (`AENV_GUEST_BINARY_PATH`).
    pub guest_binary: PathBuf,
    /// Run the agent in init mode (`--init`: PID 1 duties such as reaping orphans) as the
    /// sandbox's first process (`AENV_GUEST_INIT_MODE`, default on); off runs it as a
    /// plain server.
    pub guest_init_mode: bool,
    /// The jail makes the agent's listening socket and hands it over
    /// (`AENV_GUEST_INHERIT_LISTENER`, default on; see
    /// [`agentenv_guest::LISTEN_FD_ENV`]); off for an agent that binds its own.
    pub guest_inherit_listener: bool,
    /// The guest kernel of microVM sandboxes (`AENV_GUEST_KERNEL_PATH`), default
    /// `<home>/guest/vmlinux` (built by agentenv-vmm/guest/build-kernel.sh).
    pub guest_kernel: PathBuf,
    /// The VMM binary of microVM sandboxes (`AENV_VMM_BINARY_PATH`), default
    /// `<home>/bin/agentenv-vmm`.
    pub vmm_binary: PathBuf,
    /// Template store root (`AENV_TEMPLATE_PATH`), default `<home>/templates`.
    pub template_path: PathBuf,
    /// Jail sandbox address pool (`AENV_JAIL_ADDRESS_POOL`), e.g. `10.12.0.0/16`.
    pub jail_address_pool: String,
    /// Jail host interface prefix (`AENV_JAIL_IFACE_PREFIX`), 1–6 lowercase letters.
    pub jail_iface_prefix: String,
    /// Jail cgroup parent (`AENV_JAIL_CGROUP_PARENT`).
    pub jail_cgroup_parent: String,
    /// Network namespaces the jail keeps ready for creates (`AENV_JAIL_NET_POOL_SIZE`,
    /// `[jail].net_pool_size`); 0 turns the pool off.
    pub jail_net_pool_size: usize,
    /// Host ids sandboxes run as, 65,536 per sandbox (`AENV_JAIL_ID_POOL`,
    /// `[jail].id_pool`, `<first id>:<number of ids>`).
    pub jail_id_pool: crate::host::ids::IdPoolRange,
    /// A sandbox's writable disk unless its create names a size, in MiB
    /// (`AENV_JAIL_DISK_SIZE_MB`, `[jail].disk_size_mb`).
    pub jail_disk_size_mb: u64,
    /// Writable layers of the default size kept ready (`AENV_JAIL_LAYER_POOL_SIZE`,
    /// `[jail].layer_pool_size`); 0 turns the pool off.
    pub jail_layer_pool_size: usize,
    /// Nameservers of the sandboxes, what their resolv.conf names and what the egress
    /// proxy resolves allowed names through (`AENV_JAIL_DNS_SERVERS`, comma list,
    /// `[jail].dns_servers`); unset: the host's.
    pub jail_dns_servers: Option<Vec<std::net::Ipv4Addr>>,
    /// How sandbox egress is NATed (`AENV_NET_NAT`, `[jail].nat`): `snat` (default, the
    /// node keeps one rule per host interface with its address) or `masquerade`.
    pub net_nat: crate::host::net::NatMode,
    /// Sandbox proxy domains (`AENV_SANDBOX_PROXY_DOMAINS`, comma list).
    pub proxy_domains: Vec<String>,
    /// `[sandbox_proxy].upload_idle_timeout_ms` (30 s).
    pub proxy_upload_idle_timeout: Duration,
    /// `[sandbox_proxy].response_header_timeout_ms` (30 s after the request body ends).
    pub proxy_response_header_timeout: Duration,
    pub default_timeout: Duration,
    pub auto_evict_interval: Duration,
    /// Time between two resource samples of a running sandbox
    /// (`AENV_METRICS_INTERVAL_MS`, 100 ms to 1 h).
    pub metrics_interval: Duration,
    /// Resource samples kept per sandbox (`AENV_METRICS_HISTORY`).
    pub metrics_history: usize,
    /// Cap of one sandbox log file, in bytes; a sandbox keeps two
    /// (`AENV_SANDBOX_LOG_FILE_BYTES`).
    pub sandbox_log_file_bytes: u64,
    pub auto_resume_min_timeout: Duration,
    pub default_cpu_count: u32,
    pub default_memory_mb: u64,
    /// How long a new sandbox's agent may take to answer `/health`.
    pub agent_ready_timeout: Duration,
    /// Where snapshots are published (`[snapshot].repository_backend`): the `posix_fs`
    /// repository `<AENV_SNAPSHOT_STORE>/repository`, or an `oss` (S3-compatible) bucket.
    pub snapshot_repository: StorageConfig,
    /// Node-local staging of snapshot captures and downloads
    /// (`AENV_SNAPSHOT_LOCAL_CACHE_PATH`, default `<home>/snapshot-local-cache`).
    pub snapshot_local_cache: PathBuf,
    /// Template builds this node runs at once (`AENV_TEMPLATE_BUILD_CONCURRENCY`,
    /// `[template].build_concurrency`, 2); more wait as `waiting`.
    pub template_build_concurrency: usize,
    /// Longest one build step may run (`AENV_TEMPLATE_STEP_TIMEOUT_SECS`,
    /// `[template].step_timeout_secs`, 1800).
    pub template_step_timeout: Duration,
    /// Longest a template's ready command may take to succeed, in a build and at each
    /// create (`AENV_TEMPLATE_READY_TIMEOUT_SECS`, `[template].ready_timeout_secs`, 120).
    pub template_ready_timeout: Duration,
    /// Registry of image names that name none (`AENV_OCI_DEFAULT_REGISTRY`,
    /// `[template].default_registry`); unset: the host's
    /// `/etc/containers/registries.conf` `unqualified-search-registries`.
    pub oci_default_registry: Option<String>,
    /// Registries reached over plain HTTP (`AENV_OCI_INSECURE_REGISTRIES`, comma list,
    /// `[template].insecure_registries`), e.g. a registry on loopback.
    pub oci_insecure_registries: Vec<String>,
    /// Pools of started sandboxes (`[pool]`, `AENV_POOL_*`): which templates, how many.
    pub pool: crate::lifecycle::PoolSettings,
}

impl NodeConfig {
    /// Where volumes' files are: on `posix_fs`, `<AENV_SNAPSHOT_STORE>/volumes` (on the
    /// shared mount, beside the repository); on `oss`, this node's copies,
    /// `<home>/volumes`.
    pub fn volume_path(&self) -> PathBuf {
        match &self.snapshot_repository {
            StorageConfig::Fs { root } => root
                .parent()
                .map(|store| store.join("volumes"))
                .unwrap_or_else(|| self.home.join("volumes")),
            StorageConfig::S3(_) => self.home.join("volumes"),
        }
    }

    /// Loads the config from the process environment and, when given (or named by
    /// `AENV_CONFIG_PATH`), a TOML file.
    pub fn from_env(config_path: Option<&Path>) -> Result<Self, ConfigError> {
        Self::load(config_path, &|k| std::env::var(k).ok())
    }

    /// Loads the config from `env` (a lookup of environment variables) and the TOML file.
    pub fn load(
        config_path: Option<&Path>,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Self, ConfigError> {
        let path = config_path
            .map(Path::to_path_buf)
            .or_else(|| env("AENV_CONFIG_PATH").map(PathBuf::from));
        let (file, base) = match &path {
            Some(p) => {
                let text = std::fs::read_to_string(p).map_err(|source| ConfigError::Read {
                    path: p.clone(),
                    source,
                })?;
                let f: FileConfig = toml::from_str(&text).map_err(|e| ConfigError::Toml {
                    path: p.clone(),
                    message: e.to_string(),
                })?;
                (
                    f,
                    p.parent()
                        .map(Path::to_path_buf)
                        .unwrap_or_else(|| PathBuf::from(".")),
                )
            }
            None => (FileConfig::default(), PathBuf::from(".")),
        };
        let backend_file = backend_key(file.backend, path.as_deref().unwrap_or(Path::new("")))?;
        let rel = |p: PathBuf| if p.is_relative() { base.join(p) } else { p };
        let env = |k: &str| env(k).filter(|v| !v.is_empty());

        let api_addr_s = env("API_ADDR")
            .or(file.api_addr)
            .unwrap_or_else(|| "127.0.0.1:8000".into());
        let api_addr: SocketAddr = api_addr_s.parse().map_err(|_| {
            invalid(
                "API_ADDR",
                &api_addr_s,
                "use an IP address and port, e.g. 0.0.0.0:8000",
            )
        })?;
        let tls = agentenv_core::config::TlsListen {
            cert_file: env("AENV_TLS_CERT_FILE").unwrap_or_default(),
            key_file: env("AENV_TLS_KEY_FILE").unwrap_or_default(),
            client_ca_file: env("AENV_TLS_CLIENT_CA_FILE").unwrap_or_default(),
        };
        let allow_plain_http = match env("AENV_ALLOW_PLAIN_HTTP") {
            Some(v) => parse_bool("AENV_ALLOW_PLAIN_HTTP", &v)?,
            None => false,
        };
        // Plain HTTP is for loopback: elsewhere API keys and sandbox tokens would
        // cross the network in clear text.
        if !tls.enabled() && !allow_plain_http && !api_addr.ip().is_loopback() {
            return Err(invalid(
                "API_ADDR",
                &api_addr_s,
                "is reachable from other hosts but the node serves without TLS, so keys and tokens would cross the network in clear text: set AENV_TLS_CERT_FILE and AENV_TLS_KEY_FILE (docs/configuration.md), listen on 127.0.0.1, or set AENV_ALLOW_PLAIN_HTTP=true when another layer (a VPN, a private network) encrypts",
            ));
        }
        let home = env("AENV_HOME_PATH")
            .map(PathBuf::from)
            .or(file.home_path.map(&rel))
            .unwrap_or_else(|| PathBuf::from("/var/lib/aenv"));
        let runtime_path = env("AENV_RUNTIME_PATH")
            .map(PathBuf::from)
            .or(file.runtime_path.map(&rel))
            .unwrap_or_else(|| PathBuf::from("/run/aenv"));
        let backend_s = env("AENV_BACKEND")
            .or(backend_file.name)
            .unwrap_or_else(|| "auto".into());
        let backend: BackendKind = backend_s
            .trim()
            .to_ascii_lowercase()
            .parse()
            .map_err(|_| invalid("AENV_BACKEND", &backend_s, "use auto, jail or microvm"))?;
        let guest_binary = env("AENV_GUEST_BINARY_PATH")
            .map(PathBuf::from)
            .or(file.guest_binary_path.map(&rel))
            .unwrap_or_else(|| home.join("bin").join("agentenv-guest"));
        let guest_init_mode = match env("AENV_GUEST_INIT_MODE") {
            Some(v) => parse_bool("AENV_GUEST_INIT_MODE", &v)?,
            None => file.guest_init_mode.unwrap_or(true),
        };
        let guest_inherit_listener = match env("AENV_GUEST_INHERIT_LISTENER") {
            Some(v) => parse_bool("AENV_GUEST_INHERIT_LISTENER", &v)?,
            None => file.guest_inherit_listener.unwrap_or(true),
        };
        let guest_kernel = env("AENV_GUEST_KERNEL_PATH")
            .map(PathBuf::from)
            .or(file.guest_kernel_path.map(&rel))
            .unwrap_or_else(|| home.join("guest").join("vmlinux"));
        let vmm_binary = env("AENV_VMM_BINARY_PATH")
            .map(PathBuf::from)
            .or(file.vmm_binary_path.map(&rel))
            .unwrap_or_else(|| home.join("bin").join("agentenv-vmm"));
        let template_path = env("AENV_TEMPLATE_PATH")
            .map(PathBuf::from)
            .or(file.template_path.map(&rel))
            .unwrap_or_else(|| home.join("templates"));
        let node_id = env("AENV_NODE_ID")
            .or(file.node_identity.node_id)
            .unwrap_or_else(hostname);
        let cluster_id = env("AENV_CLUSTER_ID")
            .or(file.node_identity.cluster_id)
            .unwrap_or_else(|| "00000000-0000-0000-0000-000000000000".into());
        let service_instance_id = env("AENV_SERVICE_INSTANCE_ID")
            .or(file.node_identity.service_instance_id)
            .unwrap_or_else(|| uuid::Uuid::now_v7().to_string());
        let report_enabled = match env("AENV_OBSERVABILITY_SCHEDULER_REPORT_ENABLED") {
            Some(v) => parse_bool("AENV_OBSERVABILITY_SCHEDULER_REPORT_ENABLED", &v)?,
            None => file.observability.scheduler_report.enabled.unwrap_or(false),
        };
        let scheduler_endpoint = env("AENV_OBSERVABILITY_SCHEDULER_ENDPOINT")
            .or(file.cluster.scheduler_endpoint)
            .map(|s| s.trim().to_string());
        if let Some(ep) = &scheduler_endpoint
            && !(ep.starts_with("http://") || ep.starts_with("https://"))
        {
            return Err(invalid(
                "AENV_OBSERVABILITY_SCHEDULER_ENDPOINT",
                ep,
                "write it as a URL with a scheme, e.g. http://10.0.0.5:9090",
            ));
        }
        if report_enabled && scheduler_endpoint.is_none() {
            return Err(invalid(
                "AENV_OBSERVABILITY_SCHEDULER_REPORT_ENABLED",
                "true",
                "heartbeats need AENV_OBSERVABILITY_SCHEDULER_ENDPOINT (e.g. http://10.0.0.5:9090); set it or disable reporting",
            ));
        }
        let interval_secs = env_u64(&env, "AENV_OBSERVABILITY_REPORT_INTERVAL_SECS")?.unwrap_or(
            file.observability
                .scheduler_report
                .interval_secs
                .unwrap_or(5),
        );
        if interval_secs == 0 {
            return Err(invalid(
                "AENV_OBSERVABILITY_REPORT_INTERVAL_SECS",
                "0",
                "use at least 1 second",
            ));
        }
        let proxy_upload_idle_timeout =
            Duration::from_millis(file.sandbox_proxy.upload_idle_timeout_ms.unwrap_or(30_000));
        let proxy_response_header_timeout = Duration::from_millis(
            file.sandbox_proxy
                .response_header_timeout_ms
                .unwrap_or(30_000),
        );
        if proxy_upload_idle_timeout.is_zero() || proxy_response_header_timeout.is_zero() {
            return Err(invalid("sandbox_proxy timeouts", "0", "use at least 1 ms"));
        }
        let proxy_domains = env("AENV_SANDBOX_PROXY_DOMAINS")
            .map(|s| s.split(',').map(str::to_string).collect::<Vec<_>>())
            .or(file.sandbox_proxy.domains)
            .unwrap_or_default()
            .into_iter()
            .map(|d| d.trim().trim_end_matches('.').to_ascii_lowercase())
            .filter(|d| !d.is_empty())
            .collect();
        let o = file.orchestrator;
        let evict_ms = env_u64(&env, "AENV_AUTO_EVICT_INTERVAL_MS")?
            .unwrap_or(o.auto_evict_interval_ms.unwrap_or(1000));
        if evict_ms == 0 {
            return Err(invalid(
                "orchestrator.auto_evict_interval_ms",
                "0",
                "use at least 1",
            ));
        }
        use crate::observe::{logbook as lb, ring};
        let metrics_ms = env_in(&env, "AENV_METRICS_INTERVAL_MS", 5000, 100..=3_600_000)?;
        let metrics_history = env_in(
            &env,
            "AENV_METRICS_HISTORY",
            ring::DEFAULT_HISTORY as u64,
            1..=ring::MAX_HISTORY as u64,
        )?;
        let log_bytes = env_in(
            &env,
            "AENV_SANDBOX_LOG_FILE_BYTES",
            lb::DEFAULT_FILE_BYTES,
            lb::MIN_FILE_BYTES..=lb::MAX_FILE_BYTES,
        )?;
        let jail_net_pool_size = pool_size(
            "jail.net_pool_size",
            env_u64(&env, "AENV_JAIL_NET_POOL_SIZE")?.unwrap_or(
                file.jail
                    .net_pool_size
                    .unwrap_or(crate::backend::jail::DEFAULT_NET_POOL_SIZE as u64),
            ),
        )?;
        let jail_id_pool = match env("AENV_JAIL_ID_POOL").or(file.jail.id_pool.clone()) {
            Some(v) => v.parse().map_err(|e: crate::host::ids::IdError| {
                invalid("jail.id_pool", v.clone(), e.to_string())
            })?,
            None => crate::host::ids::IdPoolRange::default(),
        };
        let jail_disk_size_mb = env_u64(&env, "AENV_JAIL_DISK_SIZE_MB")?.unwrap_or(
            file.jail
                .disk_size_mb
                .unwrap_or(crate::backend::jail::DEFAULT_DISK_SIZE_MB),
        );
        crate::host::disk::check_size(jail_disk_size_mb).map_err(|e| {
            invalid(
                "jail.disk_size_mb",
                jail_disk_size_mb.to_string(),
                e.to_string(),
            )
        })?;
        let jail_layer_pool_size = pool_size(
            "jail.layer_pool_size",
            env_u64(&env, "AENV_JAIL_LAYER_POOL_SIZE")?.unwrap_or(
                file.jail
                    .layer_pool_size
                    .unwrap_or(crate::backend::jail::DEFAULT_LAYER_POOL_SIZE as u64),
            ),
        )?;
        let jail_dns_servers = match env("AENV_JAIL_DNS_SERVERS")
            .filter(|v| !v.trim().is_empty())
            .map(|v| v.split(',').map(|s| s.trim().to_string()).collect())
            .or(file.jail.dns_servers.clone())
        {
            Some(list) => Some(
                crate::host::net::parse_nameservers(&list)
                    .map_err(|(v, fix)| invalid("jail.dns_servers", v, fix))?,
            ),
            None => None,
        };
        let net_nat = match env("AENV_NET_NAT")
            .filter(|v| !v.trim().is_empty())
            .or(file.jail.nat.clone())
        {
            Some(v) => v
                .parse()
                .map_err(|fix: String| invalid("jail.nat", v.clone(), fix))?,
            None => crate::host::net::NatMode::default(),
        };
        let pool = pool::settings(&env, &file.pool)?;
        let template_build_concurrency = env_u64(&env, "AENV_TEMPLATE_BUILD_CONCURRENCY")?
            .or(file.template.build_concurrency)
            .unwrap_or(2);
        if template_build_concurrency == 0 || template_build_concurrency > 64 {
            return Err(invalid(
                "template.build_concurrency",
                template_build_concurrency.to_string(),
                "use 1 to 64",
            ));
        }
        let template_step_timeout = env_u64(&env, "AENV_TEMPLATE_STEP_TIMEOUT_SECS")?
            .or(file.template.step_timeout_secs)
            .unwrap_or(1800);
        let template_ready_timeout = env_u64(&env, "AENV_TEMPLATE_READY_TIMEOUT_SECS")?
            .or(file.template.ready_timeout_secs)
            .unwrap_or(120);
        for (key, v) in [
            ("template.step_timeout_secs", template_step_timeout),
            ("template.ready_timeout_secs", template_ready_timeout),
        ] {
            if v == 0 {
                return Err(invalid(key, "0", "use at least 1 second"));
            }
        }
        let oci_insecure_registries: Vec<String> = match env("AENV_OCI_INSECURE_REGISTRIES") {
            Some(v) => v
                .split(',')
                .map(|s| s.trim().to_string())
                .filter(|s| !s.is_empty())
                .collect(),
            None => file
                .template
                .insecure_registries
                .clone()
                .unwrap_or_default(),
        };
        let oci_default_registry = env("AENV_OCI_DEFAULT_REGISTRY")
            .or(file.template.default_registry.clone())
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty());
        let default_cpu_count = file.machine.vcpu_count.unwrap_or(2);
        let default_memory_mb = file.machine.mem_size_mib.unwrap_or(512);
        if default_cpu_count == 0 {
            return Err(invalid("machine.vcpu_count", "0", "use at least 1"));
        }
        let snapshot_local_cache = env("AENV_SNAPSHOT_LOCAL_CACHE_PATH")
            .map(PathBuf::from)
            .or(file.snapshot.local_cache_path)
            .map(|p| expand_home(p, &home, &base))
            .unwrap_or_else(|| home.join("snapshot-local-cache"));
        let repo_s = env("AENV_SNAPSHOT_REPOSITORY_BACKEND")
            .or(file.snapshot.repository_backend)
            .unwrap_or_else(|| "posix_fs".into());
        let snapshot_repository = match repo_s.trim() {
            "posix_fs" => {
                let store = env("AENV_SNAPSHOT_STORE")
                    .map(PathBuf::from)
                    .or(backend_file.posix_fs.snapshot_store)
                    .map(|p| expand_home(p, &home, &base))
                    .unwrap_or_else(|| home.join("snapshot-store"));
                StorageConfig::Fs {
                    root: store.join("repository"),
                }
            }
            "oss" => StorageConfig::S3(oss_config(backend_file.oss, &env)?),
            other => {
                return Err(invalid(
                    "AENV_SNAPSHOT_REPOSITORY_BACKEND",
                    other,
                    "use posix_fs (a directory, shared by the nodes) or oss (an S3-compatible bucket)",
                ));
            }
        };
        Ok(Self {
            api_addr,
            node_id,
            cluster_id,
            service_instance_id,
            api_key: env("AENV_API_KEY"),
            api_key_file: PathBuf::from(agentenv_core::api_key::DEFAULT_SECRET_PATH),
            token_seed: env("AENV_SANDBOX_ACCESS_TOKEN_HASH_SEED")
                .or(file.sandbox.access_token_hash_seed),
            report_enabled,
            scheduler_endpoint,
            cluster_token_file: env("AENV_CLUSTER_TOKEN_FILE")
                .map(PathBuf::from)
                .or(file.cluster.cluster_token_file)
                .filter(|p| !p.as_os_str().is_empty()),
            scheduler_tls: agentenv_core::config::TlsConnect {
                ca_file: env("AENV_SCHEDULER_CA_FILE").unwrap_or_default(),
                cert_file: env("AENV_SCHEDULER_CLIENT_CERT_FILE").unwrap_or_default(),
                key_file: env("AENV_SCHEDULER_CLIENT_KEY_FILE").unwrap_or_default(),
            },
            tls,
            report_interval: Duration::from_secs(interval_secs),
            home,
            runtime_path,
            backend,
            guest_binary,
            guest_init_mode,
            guest_inherit_listener,
            guest_kernel,
            vmm_binary,
            template_path,
            jail_address_pool: env("AENV_JAIL_ADDRESS_POOL")
                .or(file.jail.address_pool)
                .unwrap_or_else(|| "10.12.0.0/16".into()),
            jail_iface_prefix: env("AENV_JAIL_IFACE_PREFIX")
                .or(file.jail.iface_prefix)
                .unwrap_or_else(|| "ae".into()),
            jail_cgroup_parent: env("AENV_JAIL_CGROUP_PARENT")
                .or(file.jail.cgroup_parent)
                .unwrap_or_else(|| "agentenv".into()),
            jail_net_pool_size,
            jail_id_pool,
            jail_disk_size_mb,
            jail_layer_pool_size,
            jail_dns_servers,
            net_nat,
            proxy_domains,
            proxy_upload_idle_timeout,
            proxy_response_header_timeout,
            default_timeout: Duration::from_secs(o.default_sandbox_timeout_secs.unwrap_or(15)),
            auto_evict_interval: Duration::from_millis(evict_ms),
            metrics_interval: Duration::from_millis(metrics_ms),
            metrics_history: metrics_history as usize,
            sandbox_log_file_bytes: log_bytes,
            auto_resume_min_timeout: Duration::from_secs(
                o.auto_resume_min_sandbox_timeout_secs.unwrap_or(300),
            ),
            default_cpu_count,
            default_memory_mb,
            agent_ready_timeout: Duration::from_secs(o.agent_ready_timeout_secs.unwrap_or(30)),
            snapshot_repository,
            snapshot_local_cache,
            template_build_concurrency: template_build_concurrency as usize,
            template_step_timeout: Duration::from_secs(template_step_timeout),
            template_ready_timeout: Duration::from_secs(template_ready_timeout),
            oci_default_registry,
            oci_insecure_registries,
            pool,
        })
    }
}

#[cfg(test)]
mod tests;
