//! `agentenv up`: a whole cluster on this machine — one scheduler, one gateway and N
//! runtime nodes, each a child process of the real binaries on loopback ports — with a
//! first sandbox run through the gateway before the cluster is announced, and a clean
//! stop (every sandbox deleted, every process stopped, the nodes' host firewall chains
//! removed) on Ctrl-C.
//!
//! The rooms: [`config`] decides and writes what the processes start with,
//! [`supervise`] runs and stops them and reads their logs, [`boot`] brings the cluster
//! up (and runs the first sandbox), [`teardown`] takes it down, [`output`] is what the
//! user sees. HTTP calls go through [`crate::http_client`].

mod boot;
pub mod config;
pub mod output;
mod supervise;
mod teardown;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use crate::http_client::{HttpError, Target};

pub use config::{find_guest, generate_api_key, node_iface_prefixes};
pub use output::{Out, stdout_out};
pub use teardown::leftover_interfaces;

/// The guest agent's port, as the E2B SDK addresses it.
pub const ENVD_PORT: &str = "49983";

/// Why `agentenv up` could not start or stop the cluster. Each message says what to do.
#[derive(Debug, thiserror::Error)]
pub enum UpError {
    #[error(
        "agentenv up runs sandboxes in jails (namespaces, cgroups, veth, iptables) and needs root: run it with sudo"
    )]
    NotRoot,
    #[error("--nodes must be between 1 and 16 (got {0})")]
    NodeCount(u8),
    #[error(
        "{} not found: build the binaries with `cargo build --release -p agentenv-bin --bins` (or run scripts/up.sh), or point --bin-dir at them",
        path.display()
    )]
    MissingBinary { path: PathBuf },
    #[error(
        "the static guest agent was not found (looked at {looked}): build it with agentenv-guest/build-static.sh and pass its path with --guest-binary"
    )]
    MissingGuest { looked: String },
    /// Says which key (flag or variable) and what a valid one is.
    #[error(transparent)]
    ApiKey(#[from] agentenv_core::api_key::ApiKeyError),
    #[error("cannot listen on {addr}: {source}; choose another address with --listen")]
    Listen {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("{what} {}: {source}", path.display())]
    Fs {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("starting {name}: {source}")]
    Spawn {
        name: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{name} exited before it was ready ({status}); its last lines:\n{tail}")]
    EarlyExit {
        name: String,
        status: String,
        tail: String,
    },
    #[error("{name} did not log {message:?} within {limit:?}; its log is {}", log.display())]
    NotReady {
        name: String,
        message: &'static str,
        limit: Duration,
        log: PathBuf,
    },
    #[error(
        "the gateway did not list {want} ready nodes within {limit:?} (last answer: {last}); check the node logs in {}",
        logs.display()
    )]
    NodesNotReady {
        want: usize,
        limit: Duration,
        last: String,
        logs: PathBuf,
    },
    #[error("--iface-prefix {0:?}: use 1 to 5 lowercase letters")]
    IfacePrefix(String),
    #[error("interrupted during start-up; everything started so far was stopped")]
    Interrupted,
    #[error("the first sandbox failed: {0}")]
    FirstSandbox(String),
    #[error(transparent)]
    Http(#[from] HttpError),
    #[error("--tls: {0}")]
    Tls(String),
    #[error("--tls: {0}")]
    Pki(#[from] crate::pki::PkiError),
    #[error("{name} exited unexpectedly ({status}); its log is {}", log.display())]
    ChildDied {
        name: String,
        status: String,
        log: PathBuf,
    },
}

/// What `agentenv up` starts.
#[derive(Debug, Clone)]
pub struct UpOptions {
    /// Number of runtime nodes.
    pub nodes: u8,
    /// The gateway's HTTP address (port 0 picks a free one).
    pub listen: SocketAddr,
    /// Where the `agentenv-scheduler`, `agentenv-gateway` and `agentenv-node` binaries are.
    pub bin_dir: PathBuf,
    /// The static guest agent; `None` looks beside the binaries.
    pub guest_binary: Option<PathBuf>,
    /// State directory (node data, shared storage, logs); `None` makes a temporary one,
    /// removed on exit.
    pub data_dir: Option<PathBuf>,
    /// Template cache shared by the nodes (the `base` template is built here once).
    pub template_dir: PathBuf,
    /// The API key; `None` generates one.
    pub api_key: Option<String>,
    /// Run a first sandbox through the gateway before announcing the cluster.
    pub check: bool,
    /// First two octets of the sandbox address pools: node `i` gets `<prefix>.<i>.0/24`.
    pub pool_prefix: String,
    /// Host interface prefix (1–5 lowercase letters); node `i` uses `<prefix><a+i>` for
    /// its interfaces and `agentenv-<prefix><a+i>` as its cgroup parent, so clusters
    /// with distinct prefixes on one host keep apart.
    pub iface_prefix: String,
    /// Echo every log line of the children, not only warnings, errors and progress.
    pub verbose: bool,
    /// Run every listener and link over TLS with a CA made for the cluster (see
    /// [`crate::pki`]): the gateway, the scheduler, the nodes' API, and mutual TLS from the
    /// gateway and nodes to the scheduler and from the gateway to the nodes.
    pub tls: bool,
}

impl UpOptions {
    /// Defaults: two nodes, gateway on 127.0.0.1:8080, binaries beside the current
    /// executable.
    pub fn new(bin_dir: PathBuf) -> Self {
        Self {
            nodes: 2,
            listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            bin_dir,
            guest_binary: None,
            data_dir: None,
            template_dir: PathBuf::from("/var/cache/agentenv/templates"),
            api_key: None,
            check: true,
            pool_prefix: "10.13".into(),
            iface_prefix: "up".into(),
            verbose: false,
            tls: false,
        }
    }
}

/// What the running cluster offers its user.
#[derive(Debug, Clone)]
pub struct ClusterInfo {
    pub gateway: SocketAddr,
    pub scheduler: SocketAddr,
    pub api_key: String,
    pub nodes: Vec<(String, SocketAddr)>,
    pub data_dir: PathBuf,
    /// With `--tls`: the cluster's CA file (what clients trust, e.g. as
    /// `SSL_CERT_FILE`) and the configuration `agentenv up` reaches the cluster with.
    pub tls: Option<ClusterTls>,
}

/// How the cluster's TLS is reached.
#[derive(Debug, Clone)]
pub struct ClusterTls {
    /// The CA every certificate of the cluster chains to.
    pub ca: PathBuf,
    /// Trusts the CA and presents the cluster's client certificate.
    pub client: std::sync::Arc<rustls::ClientConfig>,
}

impl ClusterInfo {
    /// The gateway as a request target (TLS with `--tls`).
    pub fn gateway_target(&self) -> Target {
        self.target(self.gateway)
    }

    /// `addr` of this cluster (a node's API) as a request target.
    pub fn target(&self, addr: SocketAddr) -> Target {
        match &self.tls {
            Some(t) => Target::tls(addr, t.client.clone()),
            None => addr.into(),
        }
    }

    /// The gateway's URL: `http://…` or, with `--tls`, `https://…`.
    pub fn gateway_url(&self) -> String {
        self.gateway_target().url()
    }
}

/// The running cluster.
pub struct Up {
    opts: UpOptions,
    out: Out,
    info: ClusterInfo,
    /// With `--tls`: the certificates of every process.
    certs: Option<config::ClusterCerts>,
    procs: supervise::Supervisor,
    _temp: Option<tempfile::TempDir>,
}

impl Up {
    /// Starts scheduler, nodes and gateway, waits until the gateway lists every node as
    /// ready and (with `check`) a first sandbox ran a command. On error, whatever was
    /// started is stopped again.
    pub async fn start(
        opts: UpOptions,
        out: Out,
        interrupt: impl std::future::Future<Output = ()>,
    ) -> Result<Up, UpError> {
        config::check(&opts)?;
        let guest = find_guest(&opts)?;
        let api_key = config::api_key(&opts)?;
        // The gateway's port is checked first: it is the one a user chose.
        let gateway = config::free_addr(opts.listen)?;
        let (temp, data_dir) = config::state_dir(&opts)?;
        let nodes = config::node_addrs(opts.nodes)?;
        let cluster_token = config::write_cluster_token(&data_dir)?;
        let certs = if opts.tls {
            Some(config::ClusterCerts::issue(&data_dir, &nodes, gateway)?)
        } else {
            None
        };
        let cfg_path = config::write_control_plane(
            &data_dir,
            &nodes,
            gateway,
            &cluster_token,
            certs.as_ref(),
        )?;
        let tls = certs.as_ref().map(|c| ClusterTls {
            ca: c.ca.clone(),
            client: c.client_config.clone(),
        });
        let mut up = Up {
            info: ClusterInfo {
                gateway,
                scheduler: SocketAddr::from(([127, 0, 0, 1], 0)),
                api_key,
                nodes,
                data_dir: data_dir.clone(),
                tls,
            },
            certs,
            procs: supervise::Supervisor::new(out.clone(), opts.verbose, data_dir.join("logs")),
            opts,
            out,
            _temp: temp,
        };
        // Interrupted half-way, the sandboxes and processes started so far are removed
        // the same way as on a normal stop.
        let booted = tokio::select! {
            r = up.boot(&cfg_path, &guest) => r,
            () = interrupt => Err(UpError::Interrupted),
        };
        match booted {
            Ok(()) => Ok(up),
            Err(e) => {
                up.stop().await;
                Err(e)
            }
        }
    }

    /// The cluster's addresses and key.
    pub fn info(&self) -> &ClusterInfo {
        &self.info
    }

    /// The banner: gateway URL, key and first commands.
    pub fn banner(&self) -> String {
        output::banner(&self.info)
    }

    /// Runs until `shutdown` resolves (or a child dies), then stops everything.
    pub async fn serve(
        mut self,
        shutdown: impl std::future::Future<Output = ()>,
    ) -> Result<(), UpError> {
        let died = self.procs.watch(shutdown).await;
        self.stop().await;
        match died {
            Some((name, status, log)) => Err(UpError::ChildDied { name, status, log }),
            None => Ok(()),
        }
    }

    /// The headers of a control-plane call with the cluster's key.
    fn key_headers(&self) -> [(&str, &str); 2] {
        [
            ("x-api-key", self.info.api_key.as_str()),
            ("content-type", "application/json"),
        ]
    }
}
