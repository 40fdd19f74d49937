//! The control-plane JSON config shared by the scheduler and the gateway.
//!
//! Loading: built-in defaults, then the JSON file (absent keys keep their
//! defaults; unknown keys are reported as warnings), then environment
//! overrides for the running service, then validation. Every error names the
//! offending key and says what is expected.

use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use crate::logging::{LogFormat, LogLevel};

mod addr;
mod choices;
mod tls;
mod values;

use addr::require_listen_addr;
pub use addr::{is_loopback_listen_addr, resolve_listen_addr};
pub use choices::{DiscoveryMode, Strategy};
pub use tls::{TlsConnect, TlsListen};
pub use values::{BoolSyntax, parse_bool, validate_http_url};
use values::{
    de_duration, de_duration_or_zero, env_bool, env_duration, env_duration_or_zero, env_int,
    required_choice, strip_position, validate_grpc_target, validate_nodes,
};

/// Placement strategies the scheduler ships with (the spellings of [`Strategy`]).
pub const BUILTIN_STRATEGIES: [&str; 4] = ["round_robin", "random", "least_loaded", "power_of_two"];

/// Which binary is loading the config; only its section is validated and
/// only its environment variables apply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Service {
    Scheduler,
    Gateway,
}

impl fmt::Display for Service {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Service::Scheduler => "scheduler",
            Service::Gateway => "gateway",
        })
    }
}

/// A config that could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("config file {path} is not valid JSON: {message}")]
    Syntax { path: PathBuf, message: String },
    #[error("config file {path}: {key}: {message}")]
    Field {
        path: PathBuf,
        key: String,
        message: String,
    },
    #[error("invalid {var} {value:?}: {message}")]
    Env {
        var: &'static str,
        value: String,
        message: String,
    },
    #[error("{key}: {message}")]
    Invalid { key: String, message: String },
}

impl ConfigError {
    fn invalid(key: impl Into<String>, message: impl Into<String>) -> Self {
        ConfigError::Invalid {
            key: key.into(),
            message: message.into(),
        }
    }
}

/// One runtime node in the static node list.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct NodeConfig {
    #[serde(default)]
    pub id: String,
    #[serde(default)]
    pub endpoint: String,
}

/// Kubernetes discovery settings (validated here; discovery itself is not in
/// this build).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(default)]
pub struct KubernetesConfig {
    pub namespace: String,
    pub service_name: String,
    pub port: i32,
    pub scheme: String,
    pub ignore_pod_selector: String,
    pub no_schedule_pod_selector: String,
}

impl Default for KubernetesConfig {
    fn default() -> Self {
        Self {
            namespace: String::new(),
            service_name: String::new(),
            port: 0,
            scheme: "http".into(),
            ignore_pod_selector: String::new(),
            no_schedule_pod_selector: String::new(),
        }
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(default)]
pub struct DiscoveryConfig {
    pub mode: DiscoveryMode,
    pub kubernetes: KubernetesConfig,
}

/// Per-node capacity limits applied before placement. A node whose last
/// heartbeat exceeds any configured limit (strictly) is not a candidate.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(default)]
pub struct NodeResourceLimit {
    pub max_sandbox_count: Option<u32>,
    pub max_sandbox_starting_count: Option<u32>,
    pub max_cpu_used_percent: Option<u32>,
    pub max_cpu_allocated_percent: Option<u32>,
    pub max_memory_used_percent: Option<u32>,
    pub max_memory_allocated_percent: Option<u32>,
    pub max_sandbox_count_including_paused: Option<u32>,
    pub max_allocated_cpu_including_paused: Option<u32>,
    pub max_allocated_memory_bytes_including_paused: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default)]
pub struct SchedulerConfig {
    pub grpc_listen_addr: String,
    pub metrics_listen_addr: String,
    pub strategy: Strategy,
    #[serde(deserialize_with = "de_duration")]
    pub report_ttl: Duration,
    #[serde(deserialize_with = "de_duration")]
    pub binding_ttl: Duration,
    pub redis_addr: String,
    pub artifact_store_capacity: i64,
    pub artifact_lookup_node_limit: i64,
    pub nodes: Vec<NodeConfig>,
    pub discovery: DiscoveryConfig,
    pub node_resource_limit: Option<NodeResourceLimit>,
    /// A file holding the cluster credential every gRPC call must carry.
    pub cluster_token_file: String,
    /// Answer the read-only lookups (Schedule, LookupNode, ListNodes, GetNode,
    /// ListObservedNodes) without the credential.
    pub open_lookups: bool,
    /// Run without a cluster credential although the gRPC address is reachable
    /// from other hosts.
    pub insecure_no_auth: bool,
    /// TLS of the gRPC listener (`client_ca_file`: mutual TLS).
    pub tls: TlsListen,
    /// Serve plain gRPC on an address other hosts reach (another layer encrypts).
    pub allow_plain_http: bool,
    /// Place a create a pool can serve on a node whose last heartbeat reported pooled
    /// sandboxes of its template (less the creates sent there since), before the
    /// strategy chooses among them.
    pub prefer_pooled_nodes: bool,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        Self {
            grpc_listen_addr: "127.0.0.1:9090".into(),
            metrics_listen_addr: "127.0.0.1:9101".into(),
            strategy: Strategy::RoundRobin,
            report_ttl: Duration::from_secs(30),
            binding_ttl: Duration::from_secs(30),
            redis_addr: String::new(),
            artifact_store_capacity: 1_000_000,
            artifact_lookup_node_limit: 0,
            nodes: vec![NodeConfig {
                id: "local-node".into(),
                endpoint: "http://127.0.0.1:8000".into(),
            }],
            discovery: DiscoveryConfig::default(),
            node_resource_limit: None,
            cluster_token_file: String::new(),
            open_lookups: false,
            insecure_no_auth: false,
            tls: TlsListen::default(),
            allow_plain_http: false,
            prefer_pooled_nodes: true,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default)]
pub struct GatewayConfig {
    pub http_listen_addr: String,
    pub metrics_listen_addr: String,
    pub scheduler_addr: String,
    pub query_only_scheduler_addr: String,
    #[serde(deserialize_with = "de_duration")]
    pub request_timeout: Duration,
    pub forward_response_size: i64,
    pub sandbox_proxy_domains: Vec<String>,
    pub debug_mode: bool,
    /// How long a client may take to send a request head; also how long an idle
    /// keep-alive connection is kept.
    #[serde(deserialize_with = "de_duration")]
    pub client_header_timeout: Duration,
    /// Open client connections at most, in all.
    pub max_connections: usize,
    /// Open client connections at most from one client address.
    pub max_connections_per_client: usize,
    /// A file holding the cluster credential sent to the scheduler.
    pub cluster_token_file: String,
    /// TLS of the client listener (the certificate is reloaded on SIGHUP).
    pub tls: TlsListen,
    /// TLS to `https://` nodes: the CA that their certificates chain to.
    pub node_tls: TlsConnect,
    /// TLS to the scheduler.
    pub scheduler_tls: TlsConnect,
    /// Serve plain HTTP on an address other hosts reach (a TLS proxy in front).
    pub allow_plain_http: bool,
    /// The web console at `/console`.
    pub console: ConsoleConfig,
    /// How long a sandbox's route (the node holding it) is kept instead of asked of the
    /// scheduler again; `0s` asks for every request.
    #[serde(deserialize_with = "de_duration_or_zero")]
    pub route_cache_ttl: Duration,
}

/// The gateway's web console (`gateway.console`).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default)]
pub struct ConsoleConfig {
    /// Serve `/console`; off: its paths answer 404.
    pub enabled: bool,
    /// How long a console session lives unused; each use extends it, up to
    /// [`CONSOLE_SESSION_CAP`] after sign-in.
    #[serde(deserialize_with = "de_duration")]
    pub session_ttl: Duration,
}

/// The longest `gateway.route_cache_ttl`.
pub const MAX_ROUTE_CACHE_TTL: Duration = Duration::from_secs(60);

/// A console session ends this long after sign-in however often it is used.
pub const CONSOLE_SESSION_CAP: Duration = Duration::from_secs(7 * 24 * 3600);

impl Default for ConsoleConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            session_ttl: Duration::from_secs(12 * 3600),
        }
    }
}

impl Default for GatewayConfig {
    fn default() -> Self {
        Self {
            http_listen_addr: "127.0.0.1:8080".into(),
            metrics_listen_addr: "127.0.0.1:9102".into(),
            scheduler_addr: "127.0.0.1:9090".into(),
            query_only_scheduler_addr: String::new(),
            request_timeout: Duration::from_secs(30),
            forward_response_size: 4 * 1024 * 1024,
            sandbox_proxy_domains: Vec::new(),
            debug_mode: false,
            client_header_timeout: Duration::from_secs(30),
            max_connections: 16_384,
            max_connections_per_client: 1_024,
            cluster_token_file: String::new(),
            tls: TlsListen::default(),
            node_tls: TlsConnect::default(),
            scheduler_tls: TlsConnect::default(),
            allow_plain_http: false,
            console: ConsoleConfig::default(),
            route_cache_ttl: Duration::from_secs(1),
        }
    }
}

/// The whole control-plane config.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default)]
pub struct Config {
    #[serde(skip)]
    pub service: Option<Service>,
    pub log_level: LogLevel,
    pub log_format: LogFormat,
    pub scheduler: SchedulerConfig,
    pub gateway: GatewayConfig,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            service: None,
            log_level: LogLevel::Info,
            log_format: LogFormat::Auto,
            scheduler: SchedulerConfig::default(),
            gateway: GatewayConfig::default(),
        }
    }
}

/// A loaded config plus what the loader wants the operator to know (unknown
/// keys, ignored settings). Log these once logging is up.
#[derive(Debug, Clone)]
pub struct Loaded {
    pub config: Config,
    pub warnings: Vec<String>,
}

/// Options for [`Config::load`].
#[derive(Debug, Clone, Copy)]
pub struct LoadOptions {
    pub service: Service,
    /// The scheduler's `-query-only` mode: only `LookupNode`, backed by Redis.
    pub query_only: bool,
}

impl Config {
    /// Loads the config for `opts.service` from `path` (or defaults alone when
    /// `None`) and the process environment.
    pub fn load(path: Option<&Path>, opts: LoadOptions) -> Result<Loaded, ConfigError> {
        Self::load_with_env(path, opts, |k| std::env::var(k).ok())
    }

    /// Like [`Config::load`], reading environment variables through `env`.
    pub fn load_with_env(
        path: Option<&Path>,
        opts: LoadOptions,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Loaded, ConfigError> {
        let (mut config, warnings) = match path {
            Some(p) => {
                let text = std::fs::read_to_string(p).map_err(|source| ConfigError::Read {
                    path: p.to_path_buf(),
                    source,
                })?;
                Self::parse_json(&text, p)?
            }
            None => (Config::default(), Vec::new()),
        };
        config.apply_env(opts.service, &env)?;
        config.service = Some(opts.service);
        config.validate(opts)?;
        Ok(Loaded { config, warnings })
    }

    /// Decodes a JSON document over the defaults. Returns the unknown keys as
    /// warnings.
    pub fn parse_json(text: &str, path: &Path) -> Result<(Config, Vec<String>), ConfigError> {
        let mut unknown = Vec::new();
        let mut record_unknown = |p: serde_ignored::Path<'_>| unknown.push(p.to_string());
        let mut de = serde_json::Deserializer::from_str(text);
        let result: Result<Config, _> = serde_path_to_error::deserialize(
            serde_ignored::Deserializer::new(&mut de, &mut record_unknown),
        );
        let config = match result {
            Ok(c) => c,
            Err(e) => {
                let key = e.path().to_string();
                let inner = e.into_inner();
                let message = strip_position(&inner);
                return Err(if inner.is_syntax() || inner.is_eof() || key == "." {
                    ConfigError::Syntax {
                        path: path.to_path_buf(),
                        message: format!(
                            "{message} (line {}, column {})",
                            inner.line(),
                            inner.column()
                        ),
                    }
                } else {
                    ConfigError::Field {
                        path: path.to_path_buf(),
                        key,
                        message,
                    }
                });
            }
        };
        de.end().map_err(|e| ConfigError::Syntax {
            path: path.to_path_buf(),
            message: strip_position(&e),
        })?;
        let warnings = unknown
            .into_iter()
            .map(|k| format!("config file {}: unknown key {k} is ignored", path.display()))
            .collect();
        Ok((config, warnings))
    }

    fn apply_env(
        &mut self,
        service: Service,
        env: &impl Fn(&str) -> Option<String>,
    ) -> Result<(), ConfigError> {
        let get = |k: &str| {
            env(k)
                .map(|v| v.trim().to_string())
                .filter(|v| !v.is_empty())
        };
        if let Some(v) = get("LOG_LEVEL") {
            self.log_level = v.into();
        }
        if let Some(v) = get("LOG_FORMAT") {
            self.log_format = v.into();
        }
        match service {
            Service::Scheduler => {
                let s = &mut self.scheduler;
                for (var, field) in [
                    ("SCHEDULER_GRPC_LISTEN_ADDR", &mut s.grpc_listen_addr),
                    ("SCHEDULER_METRICS_LISTEN_ADDR", &mut s.metrics_listen_addr),
                    ("SCHEDULER_REDIS_ADDR", &mut s.redis_addr),
                    ("SCHEDULER_CLUSTER_TOKEN_FILE", &mut s.cluster_token_file),
                    ("SCHEDULER_TLS_CERT_FILE", &mut s.tls.cert_file),
                    ("SCHEDULER_TLS_KEY_FILE", &mut s.tls.key_file),
                ] {
                    if let Some(v) = get(var) {
                        *field = v;
                    }
                }
                if let Some(v) = get("SCHEDULER_STRATEGY") {
                    s.strategy = v.into();
                }
                if let Some(v) = get("SCHEDULER_ALLOW_PLAIN_HTTP") {
                    s.allow_plain_http = env_bool("SCHEDULER_ALLOW_PLAIN_HTTP", &v)?;
                }
                if let Some(v) = get("SCHEDULER_PREFER_POOLED_NODES") {
                    s.prefer_pooled_nodes = env_bool("SCHEDULER_PREFER_POOLED_NODES", &v)?;
                }
                if let Some(v) = get("SCHEDULER_BINDING_TTL") {
                    s.binding_ttl = env_duration("SCHEDULER_BINDING_TTL", &v)?;
                }
                if let Some(v) = get("SCHEDULER_ARTIFACT_STORE_CAPACITY") {
                    s.artifact_store_capacity = env_int("SCHEDULER_ARTIFACT_STORE_CAPACITY", &v)?;
                }
                if let Some(v) = get("SCHEDULER_ARTIFACT_LOOKUP_NODE_LIMIT") {
                    s.artifact_lookup_node_limit =
                        env_int("SCHEDULER_ARTIFACT_LOOKUP_NODE_LIMIT", &v)?;
                }
            }
            Service::Gateway => {
                let g = &mut self.gateway;
                for (var, field) in [
                    ("GATEWAY_HTTP_LISTEN_ADDR", &mut g.http_listen_addr),
                    ("GATEWAY_METRICS_LISTEN_ADDR", &mut g.metrics_listen_addr),
                    ("GATEWAY_SCHEDULER_ADDR", &mut g.scheduler_addr),
                    (
                        "GATEWAY_QUERY_ONLY_SCHEDULER_ADDR",
                        &mut g.query_only_scheduler_addr,
                    ),
                    ("GATEWAY_CLUSTER_TOKEN_FILE", &mut g.cluster_token_file),
                    ("GATEWAY_TLS_CERT_FILE", &mut g.tls.cert_file),
                    ("GATEWAY_TLS_KEY_FILE", &mut g.tls.key_file),
                ] {
                    if let Some(v) = get(var) {
                        *field = v;
                    }
                }
                if let Some(v) = get("GATEWAY_SANDBOX_PROXY_DOMAINS") {
                    g.sandbox_proxy_domains = v
                        .split(',')
                        .map(str::trim)
                        .filter(|p| !p.is_empty())
                        .map(String::from)
                        .collect();
                }
                if let Some(v) = get("GATEWAY_REQUEST_TIMEOUT") {
                    g.request_timeout = env_duration("GATEWAY_REQUEST_TIMEOUT", &v)?;
                }
                if let Some(v) = get("GATEWAY_CLIENT_HEADER_TIMEOUT") {
                    g.client_header_timeout = env_duration("GATEWAY_CLIENT_HEADER_TIMEOUT", &v)?;
                }
                if let Some(v) = get("GATEWAY_DEBUG_MODE") {
                    g.debug_mode = env_bool("GATEWAY_DEBUG_MODE", &v)?;
                }
                if let Some(v) = get("GATEWAY_ALLOW_PLAIN_HTTP") {
                    g.allow_plain_http = env_bool("GATEWAY_ALLOW_PLAIN_HTTP", &v)?;
                }
                if let Some(v) = get("GATEWAY_ROUTE_CACHE_TTL") {
                    g.route_cache_ttl = env_duration_or_zero("GATEWAY_ROUTE_CACHE_TTL", &v)?;
                }
                if let Some(v) = get("GATEWAY_CONSOLE_ENABLED") {
                    g.console.enabled = env_bool("GATEWAY_CONSOLE_ENABLED", &v)?;
                }
                if let Some(v) = get("GATEWAY_CONSOLE_SESSION_TTL") {
                    g.console.session_ttl = env_duration("GATEWAY_CONSOLE_SESSION_TTL", &v)?;
                }
            }
        }
        Ok(())
    }

    fn validate(&mut self, opts: LoadOptions) -> Result<(), ConfigError> {
        self.log_level = required_choice(
            "log_level",
            "debug, info, warn, error",
            self.log_level.as_str(),
            LogLevel::parse,
        )?;
        self.log_format = required_choice(
            "log_format",
            "auto, console, json",
            self.log_format.as_str(),
            LogFormat::parse,
        )?;
        match opts.service {
            Service::Scheduler => self.validate_scheduler(opts.query_only),
            Service::Gateway => self.validate_gateway(),
        }
    }

    fn validate_scheduler(&mut self, query_only: bool) -> Result<(), ConfigError> {
        let s = &mut self.scheduler;
        if s.metrics_listen_addr.trim().is_empty() {
            s.metrics_listen_addr = "127.0.0.1:9101".into();
        }
        require_listen_addr("scheduler.grpc_listen_addr", &s.grpc_listen_addr)?;
        require_listen_addr("scheduler.metrics_listen_addr", &s.metrics_listen_addr)?;
        s.tls.validate("scheduler.tls")?;
        addr::refuse_exposed_plain(addr::Exposed {
            key: "scheduler.grpc_listen_addr",
            addr: &s.grpc_listen_addr,
            tls: s.tls.enabled(),
            tls_key: "scheduler.tls.cert_file and key_file",
            allow_key: "scheduler.allow_plain_http",
            allow: s.allow_plain_http,
        })?;
        if !query_only {
            addr::refuse_exposed_without_credential(s)?;
        }
        if query_only {
            if s.redis_addr.trim().is_empty() {
                return Err(ConfigError::invalid(
                    "scheduler.redis_addr",
                    "query-only mode needs a Redis to read bindings from: set scheduler.redis_addr (or SCHEDULER_REDIS_ADDR)",
                ));
            }
            return Ok(());
        }
        s.strategy = Strategy::parse(s.strategy.as_str())
            .map_err(|m| ConfigError::invalid("scheduler.strategy", m))?;
        if s.artifact_store_capacity <= 0 {
            return Err(ConfigError::invalid(
                "scheduler.artifact_store_capacity",
                format!(
                    "must be greater than zero, got {}",
                    s.artifact_store_capacity
                ),
            ));
        }
        s.discovery.mode = DiscoveryMode::parse(s.discovery.mode.as_str())
            .map_err(|m| ConfigError::invalid("scheduler.discovery.mode", m))?;
        if s.discovery.kubernetes.scheme.trim().is_empty() {
            s.discovery.kubernetes.scheme = "http".into();
        }
        match s.discovery.mode {
            DiscoveryMode::Static | DiscoveryMode::Unknown(_) => validate_nodes(&s.nodes),
            DiscoveryMode::Kubernetes => {
                let k = &s.discovery.kubernetes;
                let key = |f: &str| format!("scheduler.discovery.kubernetes.{f}");
                if k.namespace.trim().is_empty() {
                    return Err(ConfigError::invalid(
                        key("namespace"),
                        "is required in kubernetes mode",
                    ));
                }
                if k.service_name.trim().is_empty() {
                    return Err(ConfigError::invalid(
                        key("service_name"),
                        "is required in kubernetes mode",
                    ));
                }
                if k.port <= 0 {
                    return Err(ConfigError::invalid(
                        key("port"),
                        "must be greater than zero in kubernetes mode",
                    ));
                }
                Ok(())
            }
        }
    }

    fn validate_gateway(&mut self) -> Result<(), ConfigError> {
        let g = &mut self.gateway;
        if g.metrics_listen_addr.trim().is_empty() {
            g.metrics_listen_addr = "127.0.0.1:9102".into();
        }
        require_listen_addr("gateway.http_listen_addr", &g.http_listen_addr)?;
        require_listen_addr("gateway.metrics_listen_addr", &g.metrics_listen_addr)?;
        g.tls.validate("gateway.tls")?;
        addr::refuse_exposed_plain(addr::Exposed {
            key: "gateway.http_listen_addr",
            addr: &g.http_listen_addr,
            tls: g.tls.enabled(),
            tls_key: "gateway.tls.cert_file and key_file",
            allow_key: "gateway.allow_plain_http",
            allow: g.allow_plain_http,
        })?;
        validate_grpc_target("gateway.scheduler_addr", &g.scheduler_addr, true)?;
        validate_grpc_target(
            "gateway.query_only_scheduler_addr",
            &g.query_only_scheduler_addr,
            false,
        )?;
        g.node_tls.validate("gateway.node_tls")?;
        g.scheduler_tls.validate("gateway.scheduler_tls")?;
        if g.client_header_timeout.is_zero() {
            return Err(ConfigError::invalid(
                "gateway.client_header_timeout",
                "must be greater than zero (such as \"30s\"): it ends idle and slow client connections",
            ));
        }
        if g.route_cache_ttl > MAX_ROUTE_CACHE_TTL {
            return Err(ConfigError::invalid(
                "gateway.route_cache_ttl",
                "must be at most 60s (such as \"1s\", or \"0s\" to ask the scheduler for every request): a longer one keeps stale routes of moved sandboxes too long",
            ));
        }
        if g.console.session_ttl.is_zero() || g.console.session_ttl > CONSOLE_SESSION_CAP {
            return Err(ConfigError::invalid(
                "gateway.console.session_ttl",
                "must be greater than zero and at most 168h (such as \"12h\"): it is how long an unused console session lives",
            ));
        }
        for (key, v) in [
            ("gateway.max_connections", g.max_connections),
            (
                "gateway.max_connections_per_client",
                g.max_connections_per_client,
            ),
        ] {
            if v == 0 {
                return Err(ConfigError::invalid(
                    key,
                    "must be greater than zero (it caps open client connections)",
                ));
            }
        }
        Ok(())
    }
}
