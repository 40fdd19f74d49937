//! The sandbox host: what every backend needs from the host for one sandbox, in one place.
//!
//! A [`SandboxHost`] owns the host plumbing of one backend: the sandbox directories
//! (`<data>/<kind>/sandboxes/<id>/`, with `state.json`, the trash and the kept states),
//! cgroups ([`cgroup`]) with their device allow-list, network namespaces and the address
//! pool ([`net`], [`netpool`]), id ranges and user namespaces ([`ids`]), and the sweep of
//! leftovers after a crash ([`orphans`]). [`SandboxHost::claim`] takes everything one
//! sandbox needs as a [`Claim`] that gives it all back if the create fails;
//! [`SandboxHost::release`] returns it when the sandbox goes. Processes are started into a
//! slot with [`spawn`].
//!
//! Backends are thin runners on top: the jail runs the agent as PID 1 of a process tree in
//! the slot, the microvm backend runs a jailed VMM process there.
//!
//! The host layer's own files: this one holds the configuration, the state file and
//! [`SandboxHost`] with its accessors; `slot` what one sandbox holds ([`Claim`],
//! [`HostSlot`], and [`SandboxHost::claim`] and [`SandboxHost::release`]); `reconcile` the
//! removal of directories, kept states and what an earlier node process left behind;
//! `process` watching a sandbox's process ([`watch_exit`]);
//! `hosted` what both backends build on top ([`HostedConfig`], [`HostedBackend`] over a
//! [`Runtime`]).

pub mod cgroup;
pub mod cleanup;
pub mod devices;
pub mod disk;
mod hosted;
pub mod ids;
pub mod net;
pub mod netpool;
pub(crate) mod orphans;
mod process;
mod reconcile;
mod reserve;
pub mod safefs;
mod slot;
pub mod spawn;
pub(crate) mod table;

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use self::cgroup::Hierarchy;
use self::ids::IdPool;
use self::net::{AddressPool, HostRules, Slot};
use crate::backend::{BackendError, KeptState, MIN_MEMORY_MB, SandboxSpec};

pub(crate) use self::hosted::foreign_capture;
pub use self::hosted::{HostedBackend, HostedConfig, HostedSandbox, Runtime};
pub use self::process::watch_exit;
pub use self::slot::{Claim, HostSlot};

/// What a backend's host needs to know.
#[derive(Clone, Debug)]
pub struct HostConfig {
    /// The backend's name: its directories are `<data_dir>/<kind>/…`.
    pub kind: &'static str,
    /// The backend's settings: the host takes its directories, address pool, interface
    /// prefix, denied networks, nameservers, cgroup parent, id pool, and timeout for host
    /// operations (kills, cgroup and link removal).
    pub hosted: HostedConfig,
    /// Network namespaces kept ready (0: none).
    pub net_pool_size: usize,
    /// The devices sandboxes may use (their cgroup's allow-list).
    pub devices: &'static [devices::DeviceRule],
}

/// What a sandbox directory's `state.json` says: what reconciliation needs to find the
/// leftovers of a sandbox after a crash, and what a restart needs to start it again.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct StateFile {
    pub id: String,
    pub template: String,
    pub pid: Option<i32>,
    pub host_if: String,
    pub slot: Ipv4Addr,
    pub created_at: u64,
    /// The base of the sandbox's id range.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id_base: Option<u32>,
    /// The guest's vCPUs and memory (a microVM restore needs the same).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_count: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_mb: Option<u64>,
}

impl StateFile {
    /// Writes the state into `dir` (atomically).
    pub fn write(&self, dir: &Path) -> Result<(), BackendError> {
        write_json(&dir.join("state.json"), self)
    }

    /// The state of the sandbox directory `dir`, if it is readable.
    pub fn read(dir: &Path) -> Option<Self> {
        std::fs::read(dir.join("state.json"))
            .ok()
            .and_then(|raw| serde_json::from_slice(&raw).ok())
    }
}

/// Writes `value` as JSON into `path` through a temporary file.
pub fn write_json(path: &Path, value: &impl Serialize) -> Result<(), BackendError> {
    let raw = serde_json::to_vec_pretty(value)
        .map_err(|e| BackendError::io("encoding JSON", std::io::Error::other(e)))?;
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, raw)
        .map_err(|e| BackendError::io(format!("writing {}", path.display()), e))?;
    std::fs::rename(&tmp, path)
        .map_err(|e| BackendError::io(format!("writing {}", path.display()), e))
}

pub(crate) fn setup(msg: impl std::fmt::Display) -> BackendError {
    BackendError::Setup(msg.to_string())
}

/// What a backend does with a sandbox directory (or a kept state) before the host removes
/// it: unmount what it mounted there, move out what is kept.
pub type DirHook<'a> = dyn Fn(&Path) -> Result<(), String> + Sync + 'a;

/// The host side of one backend.
pub struct SandboxHost {
    cfg: HostConfig,
    hierarchy: Hierarchy,
    pool: Arc<AddressPool>,
    ids: IdPool,
    netpool: netpool::NetPool,
    netpool_dir: PathBuf,
    netlink: rtnetlink::Handle,
    dns: Vec<Ipv4Addr>,
    sandboxes_dir: PathBuf,
    trash_dir: PathBuf,
    kept_dir: PathBuf,
    host_cpus: u32,
    host_memory: u64,
    /// Deleted sandboxes being cleaned up.
    cleanups: Arc<cleanup::CleanupQueue>,
    /// Keeps the pool's SNAT rules up to date with the host's addresses.
    _nat: net::NatKeeper,
}

impl SandboxHost {
    /// Checks the configuration, prepares the directories, the cgroup parent, the address
    /// and id pools, the host firewall rules and the namespace pool.
    pub async fn new(cfg: HostConfig) -> Result<Self, BackendError> {
        if cfg.hosted.iface_prefix.is_empty()
            || cfg.hosted.iface_prefix.len() > 6
            || !cfg
                .hosted
                .iface_prefix
                .bytes()
                .all(|b| b.is_ascii_lowercase())
        {
            return Err(setup(format!(
                "invalid iface_prefix {:?}: use 1 to 6 lowercase letters",
                cfg.hosted.iface_prefix
            )));
        }
        let base = cfg.hosted.data_dir.join(cfg.kind);
        let sandboxes_dir = base.join("sandboxes");
        let trash_dir = base.join("trash");
        let kept_dir = base.join("kept");
        for d in [
            &sandboxes_dir,
            &trash_dir,
            &kept_dir,
            &cfg.hosted.runtime_dir,
        ] {
            std::fs::create_dir_all(d)
                .map_err(|e| BackendError::io(format!("creating {}", d.display()), e))?;
        }
        let hierarchy = Hierarchy::detect().map_err(setup)?;
        hierarchy
            .prepare_parent(&cfg.hosted.cgroup_parent)
            .map_err(setup)?;
        let pool = Arc::new(
            AddressPool::new(cfg.hosted.address_pool, &cfg.hosted.runtime_dir).map_err(setup)?,
        );
        let ids = IdPool::new(cfg.hosted.id_pool, &cfg.hosted.runtime_dir).map_err(setup)?;
        let dns = cfg
            .hosted
            .dns_servers
            .clone()
            .unwrap_or_else(net::host_nameservers);
        let nat = HostRules {
            iface_prefix: cfg.hosted.iface_prefix.clone(),
            pool: cfg.hosted.address_pool,
            denied: cfg.hosted.denied_networks.clone(),
            dns: dns.clone(),
            nat: cfg.hosted.nat,
        }
        .install(&cfg.hosted.runtime_dir)
        .await
        .map_err(setup)?;
        let (conn, netlink, _) = rtnetlink::new_connection()
            .map_err(|e| BackendError::io("opening a netlink socket", e))?;
        tokio::spawn(conn);
        let netpool_dir = base.join("netpool");
        let netpool = netpool::NetPool::start(
            cfg.net_pool_size,
            &cfg.hosted.iface_prefix,
            netpool_dir.join(format!("{:016x}", rand::random::<u64>())),
            pool.clone(),
            netlink.clone(),
        )
        .map_err(setup)?;
        let host_cpus = std::thread::available_parallelism()
            .map(|n| n.get() as u32)
            .unwrap_or(1);
        Ok(Self {
            cfg,
            hierarchy,
            pool,
            ids,
            netpool,
            netpool_dir,
            netlink,
            dns,
            sandboxes_dir,
            trash_dir,
            kept_dir,
            host_cpus,
            host_memory: host_memory_bytes().unwrap_or(u64::MAX),
            cleanups: cleanup::CleanupQueue::new(),
            _nat: nat,
        })
    }

    pub fn config(&self) -> &HostConfig {
        &self.cfg
    }

    /// The queue of deleted sandboxes being cleaned up.
    pub fn cleanups(&self) -> &Arc<cleanup::CleanupQueue> {
        &self.cleanups
    }

    /// The cgroup hierarchy in use.
    pub fn hierarchy(&self) -> &Hierarchy {
        &self.hierarchy
    }

    /// Nameservers of the sandboxes.
    pub fn dns(&self) -> &[Ipv4Addr] {
        &self.dns
    }

    /// A netlink handle in the host's network namespace.
    pub fn netlink(&self) -> &rtnetlink::Handle {
        &self.netlink
    }

    /// The id pool.
    pub fn ids(&self) -> &IdPool {
        &self.ids
    }

    /// CPUs of the host.
    pub fn host_cpus(&self) -> u32 {
        self.host_cpus
    }

    /// Memory of the host, in bytes.
    pub fn host_memory(&self) -> u64 {
        self.host_memory
    }

    /// Checks what every backend checks of a spec's CPUs and memory: at least one CPU
    /// and no more than the host has, at least [`MIN_MEMORY_MB`] and no more than the
    /// host has (a backend adds its own bounds).
    pub fn check_cpus_and_memory(&self, spec: &SandboxSpec) -> Result<(), BackendError> {
        if spec.cpu_count == 0 {
            return Err(BackendError::InvalidLimits(
                "cpuCount must be at least 1".into(),
            ));
        }
        if spec.cpu_count > self.host_cpus {
            return Err(BackendError::InvalidLimits(format!(
                "cpuCount {} is more than this node's {} CPUs",
                spec.cpu_count, self.host_cpus
            )));
        }
        if spec.memory_mb < MIN_MEMORY_MB {
            return Err(BackendError::InvalidLimits(format!(
                "memoryMB must be at least {MIN_MEMORY_MB}"
            )));
        }
        if spec.memory_mb.saturating_mul(1 << 20) > self.host_memory {
            return Err(BackendError::InvalidLimits(format!(
                "memoryMB {} is more than this node's {} MiB",
                spec.memory_mb,
                self.host_memory >> 20
            )));
        }
        Ok(())
    }

    /// The directory of a sandbox.
    pub fn sandbox_dir(&self, id: &str) -> PathBuf {
        self.sandboxes_dir.join(id)
    }

    /// Where kept states live.
    pub fn kept_dir(&self) -> &Path {
        &self.kept_dir
    }

    /// A new path for a kept state named after `name`.
    pub fn new_kept_path(&self, name: &str) -> PathBuf {
        let nonce: u64 = rand::random();
        self.kept_dir.join(format!("{name}.{nonce:016x}"))
    }

    /// The cgroup directories of a sandbox (present while it exists).
    pub fn cgroup_dirs(&self, id: &str) -> Vec<PathBuf> {
        self.hierarchy
            .sandbox(&self.cfg.hosted.cgroup_parent, id)
            .dirs()
            .to_vec()
    }

    /// Whether an address of the pool is reserved (by any node process on this host).
    pub fn address_reserved(&self, ip: Ipv4Addr) -> bool {
        self.pool.is_reserved(Slot {
            network: Ipv4Addr::from(u32::from(ip) & !3),
        })
    }

    /// Who holds the reservation of an address of the pool, if anyone does.
    pub fn address_owner(&self, ip: Ipv4Addr) -> Option<PathBuf> {
        let network = Ipv4Addr::from(u32::from(ip) & !3);
        self.pool
            .reservations()
            .into_iter()
            .find(|(s, _)| s.network == network)
            .map(|(_, owner)| owner)
    }

    /// Names of host interfaces of this prefix (of every node process on this host).
    pub async fn host_interfaces(&self) -> Vec<String> {
        net::list_links(&self.netlink, &self.cfg.hosted.iface_prefix)
            .await
            .unwrap_or_default()
    }

    /// The namespace pool.
    pub fn netpool(&self) -> &netpool::NetPool {
        &self.netpool
    }

    /// Where the namespace pools of this data directory keep their owner directories.
    pub fn net_pool_dir(&self) -> &Path {
        &self.netpool_dir
    }

    /// Checks that `kept` is a state this host kept: a directory right under the kept
    /// directory holding each of `required`.
    pub fn check_kept(&self, kept: &KeptState, required: &[&str]) -> Result<(), BackendError> {
        let bad = |reason: &str| BackendError::BadKeptState {
            path: kept.path.clone(),
            reason: reason.to_string(),
        };
        let under = kept.path.parent() == Some(self.kept_dir.as_path())
            && kept
                .path
                .file_name()
                .is_some_and(|n| !n.to_string_lossy().starts_with('.'));
        if !under {
            return Err(bad(&format!(
                "it is not a directory of {}",
                self.kept_dir.display()
            )));
        }
        for f in required {
            if std::fs::symlink_metadata(kept.path.join(f)).is_err() {
                return Err(bad(&format!("{f} is missing")));
            }
        }
        Ok(())
    }
    /// Releases what the host holds apart from its sandboxes: the pooled network
    /// namespaces and their addresses.
    pub async fn shutdown(&self) {
        self.netpool.shutdown().await;
    }
}

fn host_memory_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}
