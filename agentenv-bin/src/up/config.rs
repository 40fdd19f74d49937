//! What `agentenv up` decides before it starts anything: the options checked, the API
//! key, the addresses, the state directory, the control-plane config file the scheduler
//! and the gateway read, and the environment of each node.

use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};

use serde::Serialize;
use tokio::process::Command;

use super::{UpError, UpOptions};
use crate::pki::{Identity, Pki, Request, Role};

/// Maps an I/O error on `path` to [`UpError::Fs`] saying what was being done.
pub(crate) fn fs_err<'a>(
    what: &'static str,
    path: &'a Path,
) -> impl FnOnce(std::io::Error) -> UpError + 'a {
    move |source| UpError::Fs {
        what,
        path: path.to_path_buf(),
        source,
    }
}

/// Refuses what cannot work before anything starts: not root, a node count out of
/// range, a bad interface prefix, a missing binary.
pub(crate) fn check(opts: &UpOptions) -> Result<(), UpError> {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        return Err(UpError::NotRoot);
    }
    if !(1..=16).contains(&opts.nodes) {
        return Err(UpError::NodeCount(opts.nodes));
    }
    let p = &opts.iface_prefix;
    if p.is_empty() || p.len() > 5 || !p.bytes().all(|b| b.is_ascii_lowercase()) {
        return Err(UpError::IfacePrefix(p.clone()));
    }
    for b in ["agentenv-scheduler", "agentenv-gateway", "agentenv-node"] {
        let path = opts.bin_dir.join(b);
        if !path.is_file() {
            return Err(UpError::MissingBinary { path });
        }
    }
    Ok(())
}

/// A fresh API key as the nodes generate theirs: `e2b_` and 32 random bytes (from
/// `rand`'s thread-local CSPRNG, seeded by the OS) in hex.
pub fn generate_api_key() -> String {
    format!("e2b_{}", random_hex())
}

/// 32 random bytes in hex.
fn random_hex() -> String {
    let buf: [u8; 32] = rand::random();
    buf.iter().map(|b| format!("{b:02x}")).collect()
}

/// The API key of the options, else a fresh one; checked either way.
pub(crate) fn api_key(opts: &UpOptions) -> Result<String, UpError> {
    let key = match &opts.api_key {
        Some(k) => k.clone(),
        None => generate_api_key(),
    };
    agentenv_core::api_key::validate(&key, "--api-key")?;
    Ok(key)
}

/// Binds `addr` and lets it go again: the address is free (port 0 becomes a free port).
pub(crate) fn free_addr(addr: SocketAddr) -> Result<SocketAddr, UpError> {
    TcpListener::bind(addr)
        .and_then(|l| l.local_addr())
        .map_err(|source| UpError::Listen { addr, source })
}

/// The nodes' names (`node-a`, `node-b`, …) and free loopback API addresses.
pub(crate) fn node_addrs(nodes: u8) -> Result<Vec<(String, SocketAddr)>, UpError> {
    (0..nodes)
        .map(|i| {
            let addr = free_addr(SocketAddr::from(([127, 0, 0, 1], 0)))?;
            Ok((format!("node-{}", node_letter(i)), addr))
        })
        .collect()
}

/// The letter of node `i` (`a` for the first).
pub(crate) fn node_letter(i: u8) -> char {
    (b'a' + i) as char
}

/// The interface prefix of node `i`: `<iface_prefix><a+i>`.
pub(crate) fn node_iface_prefix(iface_prefix: &str, i: u8) -> String {
    format!("{iface_prefix}{}", node_letter(i))
}

/// The interface prefixes of the nodes: `<iface_prefix><a+i>`.
pub fn node_iface_prefixes(iface_prefix: &str, nodes: u8) -> Vec<String> {
    (0..nodes)
        .map(|i| node_iface_prefix(iface_prefix, i))
        .collect()
}

/// The cgroup parent of node `i`: `agentenv-<iface_prefix><a+i>`. It is unique per
/// cluster (clusters on one host need distinct interface prefixes anyway), because a
/// node's reconcile treats every cgroup under its parent as one of its own sandboxes:
/// two clusters sharing a parent would kill each other's sandboxes.
pub(crate) fn node_cgroup_parent(iface_prefix: &str, i: u8) -> String {
    format!("agentenv-{}", node_iface_prefix(iface_prefix, i))
}

/// The static guest agent: the given path, else `AENV_GUEST_BINARY_PATH`, else the
/// static build next to the binaries' target directory, else `agentenv-guest` beside them.
pub fn find_guest(opts: &UpOptions) -> Result<PathBuf, UpError> {
    let mut looked = Vec::new();
    let mut candidates = Vec::new();
    if let Some(p) = &opts.guest_binary {
        candidates.push(p.clone());
    } else {
        if let Some(p) = std::env::var_os("AENV_GUEST_BINARY_PATH") {
            candidates.push(PathBuf::from(p));
        }
        if let Some(target) = opts.bin_dir.parent() {
            for t in ["x86_64-unknown-linux-gnu", "x86_64-unknown-linux-musl"] {
                candidates.push(target.join(t).join("release/agentenv-guest"));
            }
        }
        candidates.push(opts.bin_dir.join("agentenv-guest"));
    }
    for c in candidates {
        if c.is_file() {
            return Ok(c);
        }
        looked.push(c.display().to_string());
    }
    Err(UpError::MissingGuest {
        looked: looked.join(", "),
    })
}

/// The state directory: the given one, else a temporary one (removed when the returned
/// guard drops), with its `logs`, `run` and `snapshot-store`; and the template cache.
pub(crate) fn state_dir(opts: &UpOptions) -> Result<(Option<tempfile::TempDir>, PathBuf), UpError> {
    let (temp, data_dir) = match &opts.data_dir {
        Some(d) => {
            std::fs::create_dir_all(d).map_err(fs_err("creating", d))?;
            (None, d.clone())
        }
        None => {
            let t = tempfile::Builder::new()
                .prefix("agentenv-up-")
                .tempdir()
                .map_err(fs_err(
                    "creating a temporary directory in",
                    &std::env::temp_dir(),
                ))?;
            let p = t.path().to_path_buf();
            (Some(t), p)
        }
    };
    // `snapshot-store`: the storage every node shares (snapshots taken on one node
    // start on any other).
    for sub in ["logs", "run", "snapshot-store"] {
        let p = data_dir.join(sub);
        std::fs::create_dir_all(&p).map_err(fs_err("creating", &p))?;
    }
    std::fs::create_dir_all(&opts.template_dir).map_err(fs_err("creating", &opts.template_dir))?;
    Ok((temp, data_dir))
}

/// The control-plane config file of the scheduler and the gateway (the keys of
/// `agentenv_core::config`).
#[derive(Debug, Serialize)]
struct ControlPlane {
    log_level: &'static str,
    log_format: &'static str,
    scheduler: SchedulerConfig,
    gateway: GatewayConfig,
}

#[derive(Debug, Serialize)]
struct SchedulerConfig {
    grpc_listen_addr: &'static str,
    metrics_listen_addr: &'static str,
    strategy: &'static str,
    report_ttl: &'static str,
    binding_ttl: &'static str,
    nodes: Vec<NodeEntry>,
    cluster_token_file: PathBuf,
    #[serde(skip_serializing_if = "Option::is_none")]
    tls: Option<TlsListen>,
}

/// A TLS listener section (`scheduler.tls`, `gateway.tls`).
#[derive(Debug, Serialize)]
struct TlsListen {
    cert_file: PathBuf,
    key_file: PathBuf,
    #[serde(skip_serializing_if = "Option::is_none")]
    client_ca_file: Option<PathBuf>,
}

/// A TLS client section (`gateway.node_tls`, `gateway.scheduler_tls`).
#[derive(Debug, Serialize)]
struct TlsConnect {
    ca_file: PathBuf,
    cert_file: PathBuf,
    key_file: PathBuf,
}

#[derive(Debug, Serialize)]
struct NodeEntry {
    id: String,
    endpoint: String,
}

#[derive(Debug, Serialize)]
struct GatewayConfig {
    http_listen_addr: String,
    metrics_listen_addr: &'static str,
    scheduler_addr: &'static str,
    request_timeout: &'static str,
    cluster_token_file: PathBuf,
    #[serde(skip_serializing_if = "Option::is_none")]
    tls: Option<TlsListen>,
    #[serde(skip_serializing_if = "Option::is_none")]
    node_tls: Option<TlsConnect>,
    #[serde(skip_serializing_if = "Option::is_none")]
    scheduler_tls: Option<TlsConnect>,
}

/// The certificates of a `--tls` cluster: the CA, a server certificate per process,
/// and the client certificate the processes present to each other.
pub(crate) struct ClusterCerts {
    pub ca: PathBuf,
    pub client: Identity,
    pub gateway: Identity,
    pub scheduler: Identity,
    /// Per node, in the order of the node list.
    pub nodes: Vec<Identity>,
    /// Trusts the CA and presents the client certificate.
    pub client_config: std::sync::Arc<rustls::ClientConfig>,
}

impl ClusterCerts {
    /// Makes the CA (its key kept in memory) and every certificate under
    /// `<data_dir>/tls`; the gateway's is also valid for the address it listens on.
    pub fn issue(
        data_dir: &Path,
        nodes: &[(String, SocketAddr)],
        gateway: SocketAddr,
    ) -> Result<Self, UpError> {
        let pki = Pki::ephemeral(&data_dir.join("tls"))?;
        let client = pki.issue(&Request {
            role: Role::Client,
            ..Request::peer("cluster-client", &[])
        })?;
        let client_config = agentenv_core::tls::client_config(
            &pki.ca,
            Some((&client.cert, &client.key)),
            &[b"http/1.1"],
        )
        .map_err(|e| UpError::Tls(e.to_string()))?;
        Ok(Self {
            gateway: pki.issue(&Request::peer("gateway", &[gateway.ip()]))?,
            scheduler: pki.issue(&Request::peer("scheduler", &[]))?,
            nodes: nodes
                .iter()
                .map(|(id, _)| pki.issue(&Request::peer(id, &[])))
                .collect::<Result<_, _>>()?,
            client_config,
            ca: pki.ca.clone(),
            client,
        })
    }

    /// A client section trusting the CA with the client certificate (mutual TLS).
    fn connect(&self) -> TlsConnect {
        TlsConnect {
            ca_file: self.ca.clone(),
            cert_file: self.client.cert.clone(),
            key_file: self.client.key.clone(),
        }
    }
}

/// Writes a fresh cluster credential to `<data_dir>/secrets/cluster-token` (mode
/// 0600), which the scheduler checks and the gateway and nodes send; returns its path.
pub(crate) fn write_cluster_token(data_dir: &Path) -> Result<PathBuf, UpError> {
    use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
    let dir = data_dir.join("secrets");
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&dir)
        .map_err(fs_err("creating", &dir))?;
    let path = dir.join("cluster-token");
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&path)
        .map_err(fs_err("writing", &path))?;
    std::io::Write::write_all(&mut f, random_hex().as_bytes()).map_err(fs_err("writing", &path))?;
    Ok(path)
}

/// Writes `<data_dir>/control-plane.json`: the scheduler with the static node list, the
/// gateway on `gateway`, everything else on free loopback ports, the cluster credential
/// in `cluster_token`, and with `certs` TLS on every listener and link (mutual TLS
/// from the gateway to the scheduler and the nodes); returns its path.
pub(crate) fn write_control_plane(
    data_dir: &Path,
    nodes: &[(String, SocketAddr)],
    gateway: SocketAddr,
    cluster_token: &Path,
    certs: Option<&ClusterCerts>,
) -> Result<PathBuf, UpError> {
    let scheme = if certs.is_some() { "https" } else { "http" };
    let config = ControlPlane {
        log_level: "info",
        log_format: "json",
        scheduler: SchedulerConfig {
            grpc_listen_addr: "127.0.0.1:0",
            metrics_listen_addr: "127.0.0.1:0",
            strategy: "round_robin",
            report_ttl: "10s",
            binding_ttl: "24h",
            nodes: nodes
                .iter()
                .map(|(id, a)| NodeEntry {
                    id: id.clone(),
                    endpoint: format!("{scheme}://{a}"),
                })
                .collect(),
            cluster_token_file: cluster_token.to_path_buf(),
            tls: certs.map(|c| TlsListen {
                cert_file: c.scheduler.cert.clone(),
                key_file: c.scheduler.key.clone(),
                client_ca_file: Some(c.ca.clone()),
            }),
        },
        gateway: GatewayConfig {
            http_listen_addr: gateway.to_string(),
            metrics_listen_addr: "127.0.0.1:0",
            // The scheduler's port is known once it runs: GATEWAY_SCHEDULER_ADDR.
            scheduler_addr: "127.0.0.1:9090",
            request_timeout: "600s",
            cluster_token_file: cluster_token.to_path_buf(),
            // Clients of the gateway (SDKs, curl) need no certificate of their own.
            tls: certs.map(|c| TlsListen {
                cert_file: c.gateway.cert.clone(),
                key_file: c.gateway.key.clone(),
                client_ca_file: None,
            }),
            node_tls: certs.map(ClusterCerts::connect),
            scheduler_tls: certs.map(ClusterCerts::connect),
        },
    };
    let path = data_dir.join("control-plane.json");
    std::fs::write(
        &path,
        serde_json::to_vec_pretty(&config).unwrap_or_default(),
    )
    .map_err(fs_err("writing", &path))?;
    Ok(path)
}

/// What node `i` (`id`, API on `addr`, data in `home`) is started with.
pub(crate) struct NodeSetup<'a> {
    pub index: u8,
    pub id: &'a str,
    pub addr: SocketAddr,
    pub home: &'a Path,
    pub api_key: &'a str,
    pub guest: &'a Path,
    pub data_dir: &'a Path,
    pub scheduler_grpc: &'a str,
    /// The cluster credential's file.
    pub cluster_token: &'a Path,
    /// With `--tls`: the cluster's certificates.
    pub certs: Option<&'a ClusterCerts>,
}

impl NodeSetup<'_> {
    /// The node's address pool: `<pool_prefix>.<i>.0/24`.
    pub fn pool(&self, opts: &UpOptions) -> String {
        format!("{}.{}.0/24", opts.pool_prefix, self.index)
    }

    /// `agentenv-node` with a clean environment (PATH, HOME and TMPDIR kept) and its
    /// configuration: the jail backend, its own pool, interfaces and cgroup parent (both
    /// derived from the cluster's interface prefix, see [`node_cgroup_parent`]), the
    /// shared templates and snapshot store, heartbeats to the scheduler every second.
    pub fn command(&self, opts: &UpOptions) -> Command {
        let mut cmd = Command::new(opts.bin_dir.join("agentenv-node"));
        cmd.env_clear();
        for k in ["PATH", "HOME", "TMPDIR"] {
            if let Some(v) = std::env::var_os(k) {
                cmd.env(k, v);
            }
        }
        cmd.env("API_ADDR", self.addr.to_string())
            .env("AENV_NODE_ID", self.id)
            .env("AENV_API_KEY", self.api_key)
            .env(
                "AENV_SANDBOX_ACCESS_TOKEN_HASH_SEED",
                format!("seed-{}", self.api_key),
            )
            .env("AENV_HOME_PATH", self.home)
            .env("AENV_RUNTIME_PATH", self.data_dir.join("run"))
            .env("AENV_BACKEND", "jail")
            .env("AENV_GUEST_BINARY_PATH", self.guest)
            .env("AENV_TEMPLATE_PATH", &opts.template_dir)
            .env("AENV_SNAPSHOT_STORE", self.data_dir.join("snapshot-store"))
            .env("AENV_JAIL_ADDRESS_POOL", self.pool(opts))
            // Two started `base` sandboxes wait for creates (more while creates come fast).
            .env("AENV_POOL_TEMPLATES", "base=2")
            .env(
                "AENV_JAIL_IFACE_PREFIX",
                node_iface_prefix(&opts.iface_prefix, self.index),
            )
            .env(
                "AENV_JAIL_CGROUP_PARENT",
                node_cgroup_parent(&opts.iface_prefix, self.index),
            )
            .env("AENV_OBSERVABILITY_SCHEDULER_REPORT_ENABLED", "true")
            .env(
                "AENV_OBSERVABILITY_SCHEDULER_ENDPOINT",
                format!(
                    "{}://{}",
                    if self.certs.is_some() {
                        "https"
                    } else {
                        "http"
                    },
                    self.scheduler_grpc
                ),
            )
            .env("AENV_CLUSTER_TOKEN_FILE", self.cluster_token)
            .env("AENV_OBSERVABILITY_REPORT_INTERVAL_SECS", "1")
            .env("AENV_LOG_FORMAT", "json");
        if let Some(c) = self.certs {
            let own = &c.nodes[usize::from(self.index)];
            // The API over TLS, clients (the gateway, agentenv up) with the cluster's
            // client certificate only; the scheduler reached over mutual TLS.
            cmd.env("AENV_TLS_CERT_FILE", &own.cert)
                .env("AENV_TLS_KEY_FILE", &own.key)
                .env("AENV_TLS_CLIENT_CA_FILE", &c.ca)
                .env("AENV_SCHEDULER_CA_FILE", &c.ca)
                .env("AENV_SCHEDULER_CLIENT_CERT_FILE", &c.client.cert)
                .env("AENV_SCHEDULER_CLIENT_KEY_FILE", &c.client.key);
        }
        cmd
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_control_plane_file_lists_every_node_and_the_gateway_address() {
        let dir = tempfile::tempdir().unwrap();
        let nodes = vec![
            ("node-a".to_string(), "127.0.0.1:7001".parse().unwrap()),
            ("node-b".to_string(), "127.0.0.1:7002".parse().unwrap()),
        ];
        let token = write_cluster_token(dir.path()).unwrap();
        let path = write_control_plane(
            dir.path(),
            &nodes,
            "127.0.0.1:8080".parse().unwrap(),
            &token,
            None,
        )
        .unwrap();
        let v: serde_json::Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
        assert_eq!(
            v["scheduler"]["nodes"][1]["endpoint"],
            "http://127.0.0.1:7002"
        );
        assert_eq!(v["scheduler"]["strategy"], "round_robin");
        assert_eq!(v["gateway"]["http_listen_addr"], "127.0.0.1:8080");
        assert_eq!(v["log_format"], "json");
        // Scheduler and gateway share one credential, readable by root alone.
        let token_path = token.to_str().unwrap();
        assert_eq!(v["scheduler"]["cluster_token_file"], token_path);
        assert_eq!(v["gateway"]["cluster_token_file"], token_path);
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&token).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        let text = std::fs::read_to_string(&token).unwrap();
        agentenv_core::api_key::validate(&text, "the token file").unwrap();
    }

    #[test]
    fn with_tls_every_listener_and_link_names_its_certificate_and_the_ca() {
        let dir = tempfile::tempdir().unwrap();
        let nodes = vec![
            ("node-a".to_string(), "127.0.0.1:7001".parse().unwrap()),
            ("node-b".to_string(), "127.0.0.1:7002".parse().unwrap()),
        ];
        let gateway = "127.0.0.1:8443".parse().unwrap();
        let certs = ClusterCerts::issue(dir.path(), &nodes, gateway).unwrap();
        let token = write_cluster_token(dir.path()).unwrap();
        let path = write_control_plane(dir.path(), &nodes, gateway, &token, Some(&certs)).unwrap();
        let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        let p = |x: &Path| serde_json::Value::from(x.to_str().unwrap());
        assert_eq!(
            v["scheduler"]["nodes"][0]["endpoint"],
            "https://127.0.0.1:7001"
        );
        assert_eq!(v["scheduler"]["tls"]["cert_file"], p(&certs.scheduler.cert));
        assert_eq!(v["scheduler"]["tls"]["client_ca_file"], p(&certs.ca));
        assert_eq!(v["gateway"]["tls"]["cert_file"], p(&certs.gateway.cert));
        assert!(v["gateway"]["tls"].get("client_ca_file").is_none());
        for link in ["node_tls", "scheduler_tls"] {
            assert_eq!(v["gateway"][link]["ca_file"], p(&certs.ca));
            assert_eq!(v["gateway"][link]["cert_file"], p(&certs.client.cert));
        }
        // The file is what the scheduler and the gateway accept.
        for service in [
            agentenv_core::config::Service::Scheduler,
            agentenv_core::config::Service::Gateway,
        ] {
            let loaded = agentenv_core::config::Config::load_with_env(
                Some(&path),
                agentenv_core::config::LoadOptions {
                    service,
                    query_only: false,
                },
                |_| None,
            )
            .unwrap();
            assert_eq!(loaded.warnings, Vec::<String>::new());
        }
        let setup = NodeSetup {
            index: 1,
            id: "node-b",
            addr: "127.0.0.1:7002".parse().unwrap(),
            home: Path::new("/tmp/home"),
            api_key: "k",
            guest: Path::new("/tmp/guest"),
            data_dir: Path::new("/tmp/data"),
            scheduler_grpc: "127.0.0.1:9090",
            cluster_token: &token,
            certs: Some(&certs),
        };
        let cmd = setup.command(&UpOptions::new(PathBuf::from("/nonexistent")));
        let env = |k: &str| {
            cmd.as_std()
                .get_envs()
                .find(|(key, _)| *key == k)
                .and_then(|(_, v)| v)
                .map(|v| PathBuf::from(v.to_os_string()))
                .unwrap_or_else(|| panic!("{k} not set"))
        };
        assert_eq!(env("AENV_TLS_CERT_FILE"), certs.nodes[1].cert);
        assert_eq!(env("AENV_TLS_CLIENT_CA_FILE"), certs.ca);
        assert_eq!(env("AENV_SCHEDULER_CA_FILE"), certs.ca);
        assert_eq!(env("AENV_SCHEDULER_CLIENT_KEY_FILE"), certs.client.key);
        assert_eq!(
            env("AENV_OBSERVABILITY_SCHEDULER_ENDPOINT"),
            PathBuf::from("https://127.0.0.1:9090")
        );
    }

    #[test]
    fn nodes_are_lettered() {
        assert_eq!(node_iface_prefixes("up", 3), ["upa", "upb", "upc"]);
    }

    #[test]
    fn cgroup_parents_are_unique_per_cluster_and_node() {
        assert_eq!(node_cgroup_parent("up", 0), "agentenv-upa");
        assert_eq!(node_cgroup_parent("up", 1), "agentenv-upb");
        assert_ne!(node_cgroup_parent("up", 0), node_cgroup_parent("xy", 0));
    }

    #[test]
    fn node_command_gets_the_clusters_own_cgroup_parent_and_interfaces() {
        let opts = UpOptions {
            iface_prefix: "qz".into(),
            ..UpOptions::new(PathBuf::from("/nonexistent"))
        };
        let setup = NodeSetup {
            index: 1,
            id: "node-b",
            addr: "127.0.0.1:7002".parse().unwrap(),
            home: Path::new("/tmp/home"),
            api_key: "k",
            guest: Path::new("/tmp/guest"),
            data_dir: Path::new("/tmp/data"),
            scheduler_grpc: "127.0.0.1:9090",
            cluster_token: Path::new("/tmp/data/secrets/cluster-token"),
            certs: None,
        };
        let cmd = setup.command(&opts);
        let env = |k: &str| {
            cmd.as_std()
                .get_envs()
                .find(|(key, _)| *key == k)
                .and_then(|(_, v)| v)
                .map(|v| v.to_string_lossy().into_owned())
        };
        assert_eq!(
            env("AENV_JAIL_CGROUP_PARENT").as_deref(),
            Some("agentenv-qzb")
        );
        assert_eq!(env("AENV_JAIL_IFACE_PREFIX").as_deref(), Some("qzb"));
    }
}
