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

pub mod cgroup;
pub mod devices;
pub mod disk;
pub mod ids;
pub mod net;
pub mod netpool;
pub(crate) mod orphans;
mod reserve;
pub mod safefs;
pub mod spawn;
pub(crate) mod table;

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use std::os::fd::{FromRawFd, OwnedFd};

use nix::sys::signal::{Signal, kill};
use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use nix::unistd::Pid;
use serde::{Deserialize, Serialize};
use tokio::io::unix::AsyncFd;
use tokio::sync::watch;

use self::cgroup::{Hierarchy, Limits, SandboxCgroup};
use self::ids::{IdPool, IdPoolRange, IdRange};
use self::net::{AddressPool, HostRules, Ipv4Net, SandboxNet, Slot};
use crate::backend::{BackendError, KeptState, ReconcileReport, SandboxSpec, validate_sandbox_id};

/// What a backend's host needs to know.
#[derive(Clone, Debug)]
pub struct HostConfig {
    /// The backend's name: its directories are `<data_dir>/<kind>/…`.
    pub kind: &'static str,
    /// The node's data directory.
    pub data_dir: PathBuf,
    /// Host-wide runtime state (address and id reservations, locks), shared by every node
    /// process on the host.
    pub runtime_dir: PathBuf,
    /// Sandbox addresses: carved into /30 networks.
    pub address_pool: Ipv4Net,
    /// Host interface names start with this (1 to 6 lowercase letters).
    pub iface_prefix: String,
    /// Networks sandboxes never reach.
    pub denied_networks: Vec<Ipv4Net>,
    /// Nameservers sandboxes use; `None` takes the host's.
    pub dns_servers: Option<Vec<Ipv4Addr>>,
    /// Parent of the sandbox cgroups (see [`cgroup`]).
    pub cgroup_parent: String,
    /// How long host operations (kills, cgroup and link removal) may take.
    pub op_timeout: Duration,
    /// Network namespaces kept ready (0: none).
    pub net_pool_size: usize,
    /// The ids sandboxes are given.
    pub id_pool: IdPoolRange,
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

/// What one sandbox holds on the host while it exists.
#[derive(Debug)]
pub struct HostSlot {
    /// The sandbox's directory.
    pub dir: PathBuf,
    pub cgroup: SandboxCgroup,
    pub ids: IdRange,
    /// The network namespace (taken when the sandbox goes).
    pub net: Mutex<Option<SandboxNet>>,
    pub slot: Slot,
    pub host_if: String,
    pub created_at: SystemTime,
}

impl HostSlot {
    /// The sandbox's address.
    pub fn ip(&self) -> Ipv4Addr {
        self.slot.sandbox_ip()
    }

    /// Runs `f` on the network namespace, if the sandbox still has it.
    pub fn with_net<T>(&self, f: impl FnOnce(&SandboxNet) -> T) -> Option<T> {
        let net = self.net.lock().unwrap_or_else(|e| e.into_inner());
        net.as_ref().map(f)
    }

    /// The state file of the slot for `spec`.
    pub fn state(&self, spec: &SandboxSpec) -> StateFile {
        StateFile {
            id: spec.id.clone(),
            template: spec.template.clone(),
            pid: None,
            host_if: self.host_if.clone(),
            slot: self.slot.network,
            created_at: self
                .created_at
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
            id_base: Some(self.ids.base),
            cpu_count: None,
            memory_mb: None,
        }
    }
}

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
}

impl SandboxHost {
    /// Checks the configuration, prepares the directories, the cgroup parent, the address
    /// and id pools, the host firewall rules and the namespace pool.
    pub async fn new(cfg: HostConfig) -> Result<Self, BackendError> {
        if cfg.iface_prefix.is_empty()
            || cfg.iface_prefix.len() > 6
            || !cfg.iface_prefix.bytes().all(|b| b.is_ascii_lowercase())
        {
            return Err(setup(format!(
                "invalid iface_prefix {:?}: use 1 to 6 lowercase letters",
                cfg.iface_prefix
            )));
        }
        let base = cfg.data_dir.join(cfg.kind);
        let sandboxes_dir = base.join("sandboxes");
        let trash_dir = base.join("trash");
        let kept_dir = base.join("kept");
        for d in [&sandboxes_dir, &trash_dir, &kept_dir, &cfg.runtime_dir] {
            std::fs::create_dir_all(d)
                .map_err(|e| BackendError::io(format!("creating {}", d.display()), e))?;
        }
        let hierarchy = Hierarchy::detect().map_err(setup)?;
        hierarchy
            .prepare_parent(&cfg.cgroup_parent)
            .map_err(setup)?;
        let pool = Arc::new(AddressPool::new(cfg.address_pool, &cfg.runtime_dir).map_err(setup)?);
        let ids = IdPool::new(cfg.id_pool, &cfg.runtime_dir).map_err(setup)?;
        let dns = cfg
            .dns_servers
            .clone()
            .unwrap_or_else(net::host_nameservers);
        HostRules {
            iface_prefix: cfg.iface_prefix.clone(),
            pool: cfg.address_pool,
            denied: cfg.denied_networks.clone(),
            dns: dns.clone(),
        }
        .install(&cfg.runtime_dir)
        .await
        .map_err(setup)?;
        let (conn, netlink, _) = rtnetlink::new_connection()
            .map_err(|e| BackendError::io("opening a netlink socket", e))?;
        tokio::spawn(conn);
        let netpool_dir = base.join("netpool");
        let netpool = netpool::NetPool::start(
            cfg.net_pool_size,
            &cfg.iface_prefix,
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
        })
    }

    pub fn config(&self) -> &HostConfig {
        &self.cfg
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
            .sandbox(&self.cfg.cgroup_parent, id)
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
        net::list_links(&self.netlink, &self.cfg.iface_prefix)
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

    /// Takes what sandbox `id` needs on the host: its directory (the kept state's, when
    /// given), an id range, an address with a network namespace (ready from the pool when
    /// it has one), a cgroup with `limits` and the host's device allow-list. Dropping
    /// the claim before [`Claim::commit`] gives everything back.
    pub async fn claim(
        &self,
        id: &str,
        kept: Option<&KeptState>,
        internet: bool,
        limits: Limits,
    ) -> Result<Claim<'_>, BackendError> {
        let dir = self.sandbox_dir(id);
        let mut claim = Claim {
            host: self,
            armed: true,
            dir: dir.clone(),
            kept: None,
            ids: None,
            slot: None,
            link: None,
            cgroup: None,
            net: None,
            pid: None,
            undo_hooks: Vec::new(),
        };
        match kept {
            Some(kept) => {
                std::fs::rename(&kept.path, &dir).map_err(|e| {
                    BackendError::io(
                        format!("moving {} to {}", kept.path.display(), dir.display()),
                        e,
                    )
                })?;
                claim.kept = Some(kept.path.clone());
            }
            None => std::fs::create_dir_all(&dir)
                .map_err(|e| BackendError::io(format!("creating {}", dir.display()), e))?,
        }
        claim.ids = Some(self.ids.reserve(&dir).map_err(|e| match e {
            ids::IdError::Exhausted(_) => BackendError::IdPoolExhausted {
                pool: self.ids.range().to_string(),
            },
            other => setup(other),
        })?);

        let (slot, pooled) = self.reserve_net(&dir).await?;
        claim.slot = Some(slot);
        let host_if = slot.host_ifname(&self.cfg.iface_prefix, internet);
        let sandbox_net = match pooled {
            Some(mut p) => {
                claim.link = Some(p.net.host_if.clone());
                if p.net.host_if != host_if {
                    // The host rules key on the name: it says the egress policy.
                    net::rename_host_link(&self.netlink, &p.ns, &mut p.net, host_if.clone())
                        .await
                        .map_err(setup)?;
                    claim.link = Some(host_if.clone());
                }
                p.net
            }
            None => {
                // The slot is ours now: a link already named after it is a leftover of a
                // process that died without cleaning up.
                for internet in [true, false] {
                    let name = slot.host_ifname(&self.cfg.iface_prefix, internet);
                    if let Ok(true) = net::delete_link(&self.netlink, &name).await {
                        tracing::warn!(link = %name, "deleted a leftover link of a reused address");
                    }
                }
                claim.link = Some(host_if.clone());
                self.netpool.note_inline();
                net::create_sandbox_net(&self.netlink, slot, host_if.clone())
                    .await
                    .map_err(setup)?
            }
        };
        claim.net = Some(sandbox_net);

        let cg = self.hierarchy.sandbox(&self.cfg.cgroup_parent, id);
        cg.create(limits).map_err(setup)?;
        claim.cgroup = Some(cg);
        // Before any process joins: nothing of the sandbox ever sees another device.
        claim
            .cgroup()
            .restrict_devices(self.cfg.devices)
            .map_err(setup)?;
        Ok(claim)
    }

    /// The address of a new sandbox whose directory is `dir`, with a ready network
    /// namespace when the pool has one (its reservation then names `dir`).
    async fn reserve_net(
        &self,
        dir: &Path,
    ) -> Result<(Slot, Option<netpool::PooledNet>), BackendError> {
        let p = match self.netpool.take() {
            Some(p) => p,
            None => match self.pool.reserve(dir) {
                Ok(slot) => return Ok((slot, None)),
                // The pool may hold the last free addresses in namespaces being made.
                Err(net::NetError::Exhausted(pool)) => self
                    .netpool
                    .take_in_flight(self.cfg.op_timeout)
                    .await
                    .ok_or_else(|| BackendError::AddressPoolExhausted {
                        pool: pool.to_string(),
                    })?,
                Err(other) => return Err(setup(other)),
            },
        };
        let slot = p.net.slot;
        if let Err(e) = self.pool.transfer(slot, dir) {
            drop(p);
            self.pool.release(slot);
            return Err(setup(e));
        }
        Ok((slot, Some(p)))
    }

    /// Kills whatever is left in a sandbox's cgroup (thawing it first) and waits until
    /// it is empty.
    pub async fn stop_processes(&self, slot: &HostSlot) -> Result<(), BackendError> {
        let timeout = self.cfg.op_timeout;
        if slot.cgroup.is_frozen() {
            let _ = slot.cgroup.thaw(timeout).await;
        }
        if !slot.cgroup.pids().is_empty() {
            slot.cgroup.kill_all(timeout).await.map_err(setup)?;
        }
        Ok(())
    }

    /// Gives back what a sandbox held: kills what is left in its cgroup (the backend has
    /// stopped its own process), lets its network namespace go and waits for the kernel to
    /// delete its veth pair, removes the cgroup, returns its address and id range, and
    /// removes its directory, after `finish` has run on it (to unmount what the backend
    /// mounted there, or to move what is to be kept out of it). Every step runs; errors
    /// are collected.
    pub async fn release(
        &self,
        slot: &HostSlot,
        finish: Option<&DirHook<'_>>,
    ) -> Result<(), BackendError> {
        let timeout = self.cfg.op_timeout;
        let mut errors = Vec::new();
        if let Err(e) = self.stop_processes(slot).await {
            errors.push(e.to_string());
        }
        let net = slot.net.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(n) = net {
            // With its processes gone, closing the namespace lets the kernel delete the
            // veth pair; it batches concurrent teardowns, which deleting each link by
            // hand would serialize. Wait for that, then free the address.
            let (host_if, addr) = (n.host_if.clone(), n.slot);
            drop(n);
            if let Err(e) = net::wait_link_gone(&self.netlink, &host_if, timeout).await {
                tracing::warn!(link = %host_if, error = %e, "veth outlived its namespace; deleting it");
                if let Err(e) = net::delete_link(&self.netlink, &host_if).await {
                    errors.push(e.to_string());
                }
            }
            // The cgroup goes before the address: a cgroup without a reservation is a
            // leftover (see `reconcile`).
            if let Err(e) = slot.cgroup.remove(timeout).await {
                errors.push(e.to_string());
            }
            self.pool.release(addr);
        } else if let Err(e) = slot.cgroup.remove(timeout).await {
            errors.push(e.to_string());
        }
        self.ids.release(slot.ids);
        if let Some(finish) = finish
            && let Err(e) = finish(&slot.dir)
        {
            errors.push(e);
        }
        if let Err(e) = self.remove_dir(&slot.dir) {
            errors.push(e);
        }
        if errors.is_empty() {
            Ok(())
        } else {
            Err(setup(errors.join("; ")))
        }
    }

    /// Moves a directory into the trash (instant) and deletes it in the background;
    /// whatever a crash leaves in the trash goes at the next reconciliation.
    pub fn remove_dir(&self, dir: &Path) -> Result<(), String> {
        let nonce: u64 = rand::random();
        let name = dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let trash = self.trash_dir.join(format!("{name}.{nonce:016x}"));
        match std::fs::rename(dir, &trash) {
            Ok(()) => {
                tokio::task::spawn_blocking(move || {
                    if let Err(e) = std::fs::remove_dir_all(&trash) {
                        tracing::warn!(path = %trash.display(), error = %e, "emptying the trash");
                    }
                });
                Ok(())
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(_) => std::fs::remove_dir_all(dir)
                .or_else(|e| {
                    if e.kind() == std::io::ErrorKind::NotFound {
                        Ok(())
                    } else {
                        Err(e)
                    }
                })
                .map_err(|e| format!("removing {}: {e}", dir.display())),
        }
    }

    /// Deletes a kept state (absent is fine).
    pub fn discard_kept(&self, kept: &KeptState, required: &[&str]) -> Result<(), BackendError> {
        if !kept.path.exists() {
            return Ok(());
        }
        self.check_kept(kept, required)?;
        self.remove_dir(&kept.path).map_err(setup)
    }

    /// Cleans the leftovers of one sandbox directory of an earlier process: its cgroup
    /// (processes killed), links, address and id reservations, and the directory.
    async fn clean_leftover(
        &self,
        id: &str,
        report: &mut ReconcileReport,
        before_removal: Option<&DirHook<'_>>,
    ) {
        let dir = self.sandbox_dir(id);
        let state = StateFile::read(&dir);
        if validate_sandbox_id(id).is_ok() {
            let cg = self.hierarchy.sandbox(&self.cfg.cgroup_parent, id);
            if cg.exists() {
                if let Err(e) = cg.kill_all(self.cfg.op_timeout).await {
                    tracing::warn!(id, error = %e, "killing a leftover sandbox");
                }
                if let Err(e) = cg.remove(self.cfg.op_timeout).await {
                    tracing::warn!(id, error = %e, "removing a leftover cgroup");
                }
            }
        }
        let mut slots: Vec<Slot> = self
            .pool
            .reservations()
            .into_iter()
            .filter(|(_, owner)| owner == &dir)
            .map(|(s, _)| s)
            .collect();
        if let Some(st) = &state {
            slots.push(Slot { network: st.slot });
        }
        for slot in slots {
            for internet in [true, false] {
                let name = slot.host_ifname(&self.cfg.iface_prefix, internet);
                if let Ok(true) = net::delete_link(&self.netlink, &name).await {
                    report.removed_other.push(format!("link {name}"));
                }
            }
            if self
                .pool
                .reservations()
                .iter()
                .any(|(s, o)| *s == slot && o == &dir)
            {
                self.pool.release(slot);
                report
                    .removed_other
                    .push(format!("address {}", slot.sandbox_ip()));
            }
        }
        for (range, owner) in self.ids.reservations() {
            if owner == dir {
                self.ids.release(range);
                report
                    .removed_other
                    .push(format!("id range {}", range.base));
            }
        }
        if let Some(hook) = before_removal
            && let Err(e) = hook(&dir)
        {
            tracing::warn!(id, error = %e, "cleaning a leftover sandbox directory");
        }
        if let Err(e) = self.remove_dir(&dir) {
            tracing::warn!(id, error = %e, "removing a leftover sandbox directory");
        }
        report.removed_sandboxes.push(id.to_string());
    }

    /// Removes the leftovers of an earlier node process: sandbox directories of sandboxes
    /// not in `live`, the trash, kept states not in `kept`, namespace pools of earlier
    /// instances, and host resources nobody owns (addresses, id ranges, cgroups, links).
    /// `before_removal` runs on each sandbox directory and kept state before it goes.
    pub async fn reconcile(
        &self,
        live: &[String],
        kept: &[KeptState],
        before_removal: Option<&DirHook<'_>>,
    ) -> Result<ReconcileReport, BackendError> {
        let mut report = ReconcileReport::default();
        let entries = std::fs::read_dir(&self.sandboxes_dir).map_err(|e| {
            BackendError::io(format!("listing {}", self.sandboxes_dir.display()), e)
        })?;
        for entry in entries.flatten() {
            let id = entry.file_name().to_string_lossy().into_owned();
            if !live.contains(&id) {
                self.clean_leftover(&id, &mut report, before_removal).await;
            }
        }
        // Sandbox directories a crash left in the trash.
        if let Ok(entries) = std::fs::read_dir(&self.trash_dir) {
            for entry in entries.flatten() {
                if std::fs::remove_dir_all(entry.path()).is_ok() {
                    report
                        .removed_other
                        .push(format!("trash {}", entry.path().display()));
                }
            }
        }
        // Kept states no record references belong to nobody.
        if let Ok(entries) = std::fs::read_dir(&self.kept_dir) {
            for entry in entries.flatten() {
                let path = entry.path();
                if kept.iter().any(|k| k.path == path) {
                    continue;
                }
                if let Some(hook) = before_removal
                    && let Err(e) = hook(&path)
                {
                    tracing::warn!(error = %e, "cleaning an unreferenced kept state");
                }
                match self.remove_dir(&path) {
                    Ok(()) => report
                        .removed_other
                        .push(format!("kept state {}", path.display())),
                    Err(e) => tracing::warn!(error = %e, "removing an unreferenced kept state"),
                }
            }
        }
        // Namespace pools of earlier instances.
        report.removed_other.extend(
            netpool::leftovers(
                &self.netpool_dir,
                self.netpool.owner(),
                &self.pool,
                &self.netlink,
                &self.cfg.iface_prefix,
            )
            .await,
        );
        orphans::HostResources {
            pool: &self.pool,
            ids: &self.ids,
            netlink: &self.netlink,
            hierarchy: &self.hierarchy,
            cgroup_parent: &self.cfg.cgroup_parent,
            iface_prefix: &self.cfg.iface_prefix,
            op_timeout: self.cfg.op_timeout,
        }
        .remove_orphans(live, &mut report)
        .await;
        if !report.removed_sandboxes.is_empty() || !report.removed_other.is_empty() {
            tracing::info!(?report, "cleaned leftovers of an earlier node process");
        }
        Ok(report)
    }

    /// Releases what the host holds apart from its sandboxes: the pooled network
    /// namespaces and their addresses.
    pub async fn shutdown(&self) {
        self.netpool.shutdown().await;
    }
}

/// Everything a sandbox being created holds on the host; given back on drop unless
/// committed.
pub struct Claim<'a> {
    host: &'a SandboxHost,
    armed: bool,
    dir: PathBuf,
    /// The kept state the directory was made from: it goes back there.
    kept: Option<PathBuf>,
    ids: Option<IdRange>,
    slot: Option<Slot>,
    link: Option<String>,
    cgroup: Option<SandboxCgroup>,
    net: Option<SandboxNet>,
    pid: Option<Pid>,
    /// Run on undo once the processes are gone, before the directory is removed.
    undo_hooks: Vec<Box<dyn FnOnce() + Send>>,
}

impl Claim<'_> {
    /// Runs `hook` if the create fails, after the slot's processes are gone and before
    /// its directory is removed (to unmount what the backend mounted there).
    pub fn on_undo(&mut self, hook: impl FnOnce() + Send + 'static) {
        self.undo_hooks.push(Box::new(hook));
    }

    /// The sandbox's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The sandbox's id range.
    pub fn ids(&self) -> IdRange {
        self.ids.expect("a claim has its ids")
    }

    /// The sandbox's address slot.
    pub fn slot(&self) -> Slot {
        self.slot.expect("a claim has its slot")
    }

    /// The host interface.
    pub fn host_if(&self) -> &str {
        self.link.as_deref().unwrap_or_default()
    }

    /// The cgroup.
    pub fn cgroup(&self) -> &SandboxCgroup {
        self.cgroup.as_ref().expect("a claim has its cgroup")
    }

    /// The network namespace.
    pub fn net(&self) -> &SandboxNet {
        self.net.as_ref().expect("a claim has its namespace")
    }

    /// A process started in the slot: killed (and reaped) if the create fails.
    pub fn set_pid(&mut self, pid: i32) {
        self.pid = Some(Pid::from_raw(pid));
    }

    /// The create succeeded: the sandbox holds it all now.
    pub fn commit(mut self) -> HostSlot {
        self.armed = false;
        HostSlot {
            dir: self.dir.clone(),
            cgroup: self.cgroup.take().expect("a claim has its cgroup"),
            ids: self.ids.expect("a claim has its ids"),
            net: Mutex::new(self.net.take()),
            slot: self.slot.expect("a claim has its slot"),
            host_if: self.link.take().unwrap_or_default(),
            created_at: SystemTime::now(),
        }
    }
}

impl Drop for Claim<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        if let Some(pid) = self.pid {
            let _ = kill(pid, Signal::SIGKILL);
            let _ = nix::sys::wait::waitpid(pid, None);
        }
        if let Some(cg) = self.cgroup.take() {
            for p in cg.pids() {
                let _ = kill(Pid::from_raw(p), Signal::SIGKILL);
            }
            // The directories can go once the processes are gone; a leftover is removed
            // by the next reconciliation.
            for _ in 0..100 {
                if cg.pids().is_empty() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            for d in cg.dirs() {
                let _ = std::fs::remove_dir(d);
            }
        }
        for hook in self.undo_hooks.drain(..).rev() {
            hook();
        }
        drop(self.net.take());
        if let Some(link) = self.link.take() {
            // Netlink is async; `ip` does the same synchronously from a destructor.
            let _ = std::process::Command::new("ip")
                .args(["link", "del", &link])
                .stderr(std::process::Stdio::null())
                .status();
        }
        if let Some(slot) = self.slot {
            self.host.pool.release(slot);
        }
        if let Some(ids) = self.ids {
            self.host.ids.release(ids);
        }
        if let Some(kept) = &self.kept {
            if let Err(e) = std::fs::rename(&self.dir, kept) {
                tracing::warn!(path = %kept.display(), error = %e, "returning a kept state after a failed create");
            }
        } else {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// Reaps a child when it exits (through a pidfd) and publishes its status.
pub fn watch_exit(pid: Pid) -> std::io::Result<watch::Receiver<Option<WaitStatus>>> {
    // SAFETY: pidfd_open takes a pid and flags; the returned descriptor is owned below.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid.as_raw(), 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh descriptor owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
    // SAFETY: the AsyncFd owns the descriptor, so it stays open while registered.
    let afd = unsafe { AsyncFd::register_with_interest(fd, tokio::io::Interest::READABLE) }
        .map_err(std::io::Error::from)?;
    let (tx, rx) = watch::channel(None);
    tokio::spawn(async move {
        let _ = afd.readable().await;
        let status = loop {
            match waitpid(pid, Some(WaitPidFlag::WNOHANG)) {
                Ok(WaitStatus::StillAlive) => {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
                Ok(s) => break s,
                Err(nix::errno::Errno::EINTR) => {}
                Err(_) => break WaitStatus::Exited(pid, -1),
            }
        };
        tracing::debug!(pid = pid.as_raw(), ?status, "sandbox process exited");
        let _ = tx.send(Some(status));
    });
    Ok(rx)
}

fn host_memory_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Durations of the phases of an operation, for debug logs.
pub struct Phases {
    last: std::time::Instant,
    done: Vec<(&'static str, Duration)>,
}

impl Default for Phases {
    fn default() -> Self {
        Self::new()
    }
}

impl Phases {
    pub fn new() -> Self {
        Self {
            last: std::time::Instant::now(),
            done: Vec::new(),
        }
    }

    /// Ends the phase `name` at `at` (between the last mark and now).
    pub fn split(&mut self, name: &'static str, at: std::time::Instant) {
        let at = at.clamp(self.last, std::time::Instant::now());
        self.done.push((name, at - self.last));
        self.last = at;
    }

    /// Ends the phase `name` now.
    pub fn mark(&mut self, name: &'static str) {
        let now = std::time::Instant::now();
        self.done.push((name, now - self.last));
        self.last = now;
    }
}

impl std::fmt::Display for Phases {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (i, (name, d)) in self.done.iter().enumerate() {
            if i > 0 {
                f.write_str(" ")?;
            }
            write!(f, "{name}={:.2}ms", d.as_secs_f64() * 1e3)?;
        }
        Ok(())
    }
}
