//! The `jail` backend: sandboxes as process trees in Linux namespaces, without a VM.
//!
//! A sandbox is:
//! * a directory `<data>/jail/sandboxes/<id>/` with the overlay's `upper/` and `work/`,
//!   the mount point `root/`, the agent's log and `state.json` (what reconciliation needs
//!   to clean up after a crash);
//! * a network namespace with `eth0`, the peer of a host veth, addressed from the pool
//!   (see [`net`]);
//! * cgroups limiting CPU, memory (swap included) and processes (see [`cgroup`]);
//! * PID 1 = the guest agent in init mode, in new mount, PID, UTS, IPC and cgroup
//!   namespaces, on an overlay root over the read-only template, with capabilities
//!   dropped to [`spawn::KEPT_CAPABILITIES`], `no_new_privs`, and the seccomp filters of
//!   [`seccomp`].
//!
//! A sandbox's writable layer outlives it when [`JailBackend::keep`] moves `upper/` and
//! `work/` to `<data>/jail/kept/<id>.<nonce>/`; a create whose spec names that directory
//! builds its overlay on it instead of on empty directories.
//!
//! Pause freezes the cgroup; resume thaws it. Destroy kills PID 1 (the kernel kills the
//! rest of the PID namespace), deletes the veth, removes the cgroups, releases the address
//! and deletes the directory; the namespaces go away with their last process.

pub mod cgroup;
pub mod net;
pub mod netpool;
pub mod seccomp;
pub mod snapshot;
pub mod spawn;

use std::net::Ipv4Addr;
use std::os::fd::{AsFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;

use super::table::{Entry, SandboxTable, TableSandbox};
use nix::sys::signal::{Signal, kill};
use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use nix::unistd::Pid;
use serde::{Deserialize, Serialize};
use tokio::io::unix::AsyncFd;
use tokio::sync::watch;

use self::cgroup::{Hierarchy, Limits, SandboxCgroup};
use self::net::{AddressPool, HostRules, Ipv4Net, SandboxNet, Slot};
use super::{
    AGENT_PORT, BackendError, KeptState, MIN_MEMORY_MB, ReconcileReport, ResourceUsage,
    SandboxAddress, SandboxBackend, SandboxInfo, SandboxSpec, SandboxState, SnapshotCapture,
    validate_sandbox_id,
};
use crate::template::{Progress, TemplateError, TemplateStore, TemplateStoreConfig};

/// Where the agent binary appears inside every sandbox.
pub const AGENT_GUEST_PATH: &str = "/agentenv/agentenv-guest";

/// Configuration of the jail backend.
///
/// Node configuration it corresponds to: `home_path` → `data_dir`, `runtime_path` →
/// `runtime_dir`, `tools.control_plane_port` → `agent_port`,
/// `network.egress.always_denied_cidrs` → `denied_networks`; `address_pool` plays the
/// part of `network.internal.veth_cidr` (one /30 per sandbox instead of a /31 plus a
/// host interaction address, since no tap or in-namespace NAT sits between node and
/// agent).
///
/// On cgroup v2 the parent must be a cgroup the node may enable controllers in: an
/// absolute `cgroup_parent` such as `/agentenv`, or a delegated subtree.
#[derive(Clone, Debug)]
pub struct JailConfig {
    /// The node's data directory (`home_path`); sandboxes live in `<data_dir>/jail`.
    pub data_dir: PathBuf,
    /// Host-wide runtime state (address reservations, locks), shared by every node
    /// process on the host (`runtime_path`).
    pub runtime_dir: PathBuf,
    /// The template store.
    pub templates: TemplateStoreConfig,
    /// The agent binary on the host (a static `agentenv-guest`).
    pub agent_binary: PathBuf,
    /// Arguments of the agent (after its path): init mode by default.
    pub agent_args: Vec<String>,
    /// The agent's port inside the sandbox.
    pub agent_port: u16,
    /// Sandbox addresses: carved into /30 networks.
    pub address_pool: Ipv4Net,
    /// Host interface names start with this (at most 6 characters).
    pub iface_prefix: String,
    /// Networks sandboxes never reach (the host's private ranges by default).
    pub denied_networks: Vec<Ipv4Net>,
    /// Nameservers for the sandboxes' resolv.conf; `None` takes the host's.
    pub dns_servers: Option<Vec<Ipv4Addr>>,
    /// Parent of the sandbox cgroups, relative to the node's own cgroup (absolute from
    /// the hierarchy root when it starts with `/`).
    pub cgroup_parent: String,
    /// Most processes per sandbox unless the spec says otherwise.
    pub default_max_processes: u32,
    /// How long pause, resume and kill may take before they fail.
    pub op_timeout: Duration,
    /// Network namespaces kept ready for creates (see [`netpool`]); 0 turns the pool off.
    pub net_pool_size: usize,
}

/// Network namespaces a jail backend keeps ready unless configured otherwise.
pub const DEFAULT_NET_POOL_SIZE: usize = 8;

impl JailConfig {
    /// Defaults for a node with data under `data_dir`, running `agent_binary`.
    pub fn new(data_dir: impl Into<PathBuf>, agent_binary: impl Into<PathBuf>) -> Self {
        let data_dir = data_dir.into();
        Self {
            templates: TemplateStoreConfig::new(data_dir.join("templates")),
            data_dir,
            runtime_dir: PathBuf::from("/run/agentenv"),
            agent_binary: agent_binary.into(),
            agent_args: vec!["--init".into()],
            agent_port: AGENT_PORT,
            address_pool: Ipv4Net::new(Ipv4Addr::new(10, 12, 0, 0), 16)
                .expect("10.12.0.0/16 is a valid network"),
            iface_prefix: "ae".into(),
            denied_networks: Ipv4Net::default_denied(),
            dns_servers: None,
            cgroup_parent: "agentenv".into(),
            default_max_processes: 1024,
            op_timeout: Duration::from_secs(5),
            net_pool_size: DEFAULT_NET_POOL_SIZE,
        }
    }
}

/// What reconciliation needs to find a sandbox's leftovers.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct StateFile {
    id: String,
    template: String,
    pid: Option<i32>,
    host_if: String,
    slot: Ipv4Addr,
    created_at: u64,
}

struct Sandbox {
    info: Mutex<SandboxInfo>,
    pid: Pid,
    cgroup: SandboxCgroup,
    net: Mutex<Option<SandboxNet>>,
    dir: PathBuf,
    exited: watch::Receiver<Option<WaitStatus>>,
    op: tokio::sync::Mutex<()>,
}

impl TableSandbox for Sandbox {
    fn info(&self) -> &Mutex<SandboxInfo> {
        &self.info
    }

    fn cgroup(&self) -> &SandboxCgroup {
        &self.cgroup
    }
}

/// The jail backend.
pub struct JailBackend {
    cfg: JailConfig,
    templates: TemplateStore,
    hierarchy: Hierarchy,
    pool: Arc<AddressPool>,
    netpool: netpool::NetPool,
    netpool_dir: PathBuf,
    netlink: rtnetlink::Handle,
    filters: Arc<Vec<seccompiler::BpfProgram>>,
    dns: Vec<Ipv4Addr>,
    sandboxes_dir: PathBuf,
    trash_dir: PathBuf,
    kept_dir: PathBuf,
    host_cpus: u32,
    host_memory: u64,
    sandboxes: SandboxTable<Sandbox>,
}

fn setup(msg: impl std::fmt::Display) -> BackendError {
    BackendError::Setup(msg.to_string())
}

impl JailBackend {
    /// Checks the host, prepares directories, cgroup parents and host firewall rules.
    pub async fn new(cfg: JailConfig) -> Result<Self, BackendError> {
        if cfg.iface_prefix.is_empty()
            || cfg.iface_prefix.len() > 6
            || !cfg.iface_prefix.bytes().all(|b| b.is_ascii_lowercase())
        {
            return Err(setup(format!(
                "invalid iface_prefix {:?}: use 1 to 6 lowercase letters",
                cfg.iface_prefix
            )));
        }
        if !cfg.agent_binary.is_file() {
            return Err(setup(format!(
                "the agent binary {} does not exist: build it (agentenv-guest/build-static.sh) and set the jail's agent_binary",
                cfg.agent_binary.display()
            )));
        }
        let sandboxes_dir = cfg.data_dir.join("jail").join("sandboxes");
        let trash_dir = cfg.data_dir.join("jail").join("trash");
        let kept_dir = cfg.data_dir.join("jail").join("kept");
        for d in [&sandboxes_dir, &trash_dir, &kept_dir] {
            std::fs::create_dir_all(d)
                .map_err(|e| BackendError::io(format!("creating {}", d.display()), e))?;
        }
        std::fs::create_dir_all(&cfg.runtime_dir)
            .map_err(|e| BackendError::io(format!("creating {}", cfg.runtime_dir.display()), e))?;
        let hierarchy = Hierarchy::detect().map_err(setup)?;
        hierarchy
            .prepare_parent(&cfg.cgroup_parent)
            .map_err(setup)?;
        let pool = Arc::new(AddressPool::new(cfg.address_pool, &cfg.runtime_dir).map_err(setup)?);
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
        let netpool_dir = cfg.data_dir.join("jail").join("netpool");
        let netpool = netpool::NetPool::start(
            cfg.net_pool_size,
            &cfg.iface_prefix,
            netpool_dir.join(format!("{:016x}", rand::random::<u64>())),
            pool.clone(),
            netlink.clone(),
        )
        .map_err(setup)?;
        let filters = Arc::new(seccomp::sandbox_filters().map_err(setup)?);
        let host_cpus = std::thread::available_parallelism()
            .map(|n| n.get() as u32)
            .unwrap_or(1);
        let host_memory = host_memory_bytes().unwrap_or(u64::MAX);
        tracing::info!(
            cgroup = hierarchy.version(),
            pool = %cfg.address_pool,
            data = %cfg.data_dir.display(),
            "jail backend ready"
        );
        Ok(Self {
            templates: TemplateStore::new(cfg.templates.clone()),
            cfg,
            hierarchy,
            pool,
            netpool,
            netpool_dir,
            netlink,
            filters,
            dns,
            sandboxes_dir,
            trash_dir,
            kept_dir,
            host_cpus,
            host_memory,
            sandboxes: SandboxTable::new(),
        })
    }

    /// The template store sandboxes are created from.
    pub fn templates(&self) -> &TemplateStore {
        &self.templates
    }

    /// The cgroup version in use (1 or 2).
    pub fn cgroup_version(&self) -> u8 {
        self.hierarchy.version()
    }

    /// The directory of a sandbox.
    pub fn sandbox_dir(&self, id: &str) -> PathBuf {
        self.sandboxes_dir.join(id)
    }

    /// Where kept writable layers live (see [`SandboxBackend::keep`]).
    pub fn kept_dir(&self) -> &Path {
        &self.kept_dir
    }

    /// Checks that `kept` is a layer this backend kept: a directory right under
    /// [`Self::kept_dir`] holding `upper/` and `work/`.
    fn check_kept(&self, kept: &KeptState) -> Result<(), BackendError> {
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
        for d in ["upper", "work"] {
            if !kept.path.join(d).is_dir() {
                return Err(bad(&format!("{d}/ is missing")));
            }
        }
        Ok(())
    }

    /// The cgroup directories of a sandbox (present while it exists).
    pub fn cgroup_dirs(&self, id: &str) -> Vec<PathBuf> {
        self.hierarchy
            .sandbox(&self.cfg.cgroup_parent, id)
            .dirs()
            .to_vec()
    }

    /// The host interface of a running sandbox.
    pub fn host_interface(&self, id: &str) -> Option<String> {
        let sbx = self.sandboxes.ready(id).ok()?;
        let net = sbx.net.lock().unwrap_or_else(|e| e.into_inner());
        net.as_ref().map(|n| n.host_if.clone())
    }

    /// PID 1 of a sandbox, as seen from the host.
    pub fn pid(&self, id: &str) -> Option<i32> {
        self.sandboxes.ready(id).ok().map(|s| s.pid.as_raw())
    }

    /// Whether an address of the pool is reserved (by any node process on this host).
    pub fn address_reserved(&self, ip: Ipv4Addr) -> bool {
        let net = u32::from(ip) & !3;
        self.pool.is_reserved(Slot {
            network: Ipv4Addr::from(net),
        })
    }

    /// Who holds the reservation of an address of the pool (a sandbox's directory, or a
    /// namespace pool's), if anyone does.
    pub fn address_owner(&self, ip: Ipv4Addr) -> Option<PathBuf> {
        let network = Ipv4Addr::from(u32::from(ip) & !3);
        self.pool
            .reservations()
            .into_iter()
            .find(|(s, _)| s.network == network)
            .map(|(_, owner)| owner)
    }

    /// Names of host interfaces of sandboxes (of every node process on this host).
    pub async fn host_interfaces(&self) -> Vec<String> {
        net::list_links(&self.netlink, &self.cfg.iface_prefix)
            .await
            .unwrap_or_default()
    }

    /// What the pool of ready network namespaces did so far.
    pub fn net_pool_stats(&self) -> netpool::NetPoolStats {
        self.netpool.stats()
    }

    /// Where the namespace pools of this data directory keep their owner directories.
    pub fn net_pool_dir(&self) -> &Path {
        &self.netpool_dir
    }

    /// Host interfaces of the pooled network namespaces ready now.
    pub fn pooled_interfaces(&self) -> Vec<String> {
        self.netpool.interfaces()
    }

    /// Releases what the backend holds apart from its sandboxes: the pooled network
    /// namespaces and their addresses (waiting until the kernel has removed their links).
    /// Creates after this make their namespaces themselves.
    pub async fn shutdown(&self) {
        self.netpool.shutdown().await;
    }

    fn check_limits(&self, spec: &SandboxSpec) -> Result<Limits, BackendError> {
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
        let memory_bytes = spec.memory_mb.saturating_mul(1 << 20);
        if memory_bytes > self.host_memory {
            return Err(BackendError::InvalidLimits(format!(
                "memoryMB {} is more than this node's {} MiB",
                spec.memory_mb,
                self.host_memory >> 20
            )));
        }
        let max_processes = spec.max_processes.unwrap_or(self.cfg.default_max_processes);
        if max_processes == 0 {
            return Err(BackendError::InvalidLimits(
                "the process limit must be at least 1".into(),
            ));
        }
        Ok(Limits {
            cpus: spec.cpu_count,
            memory_bytes,
            max_processes,
        })
    }

    /// Creates a sandbox, building the template first if needed, with progress reported.
    pub async fn create_with_progress(
        &self,
        spec: SandboxSpec,
        progress: Progress,
    ) -> Result<SandboxInfo, BackendError> {
        validate_sandbox_id(&spec.id)?;
        let limits = self.check_limits(&spec)?;
        if let Some(kept) = &spec.kept {
            self.check_kept(kept)?;
        }
        {
            let mut map = self.sandboxes.lock();
            if map.contains_key(&spec.id) || self.sandbox_dir(&spec.id).exists() {
                return Err(BackendError::AlreadyExists(spec.id.clone()));
            }
            map.insert(spec.id.clone(), Entry::Creating);
        }
        let result = async {
            let template = self
                .templates
                .ensure(&spec.template, progress)
                .await
                .map_err(|e| match e {
                    TemplateError::NotFound(n) | TemplateError::InvalidName(n) => {
                        BackendError::UnknownTemplate(n)
                    }
                    other => BackendError::Template(other),
                })?;
            self.start(&spec, limits, &template.rootfs).await
        }
        .await;
        let mut map = self.sandboxes.lock();
        match result {
            Ok(sbx) => {
                let info = sbx.info.lock().unwrap_or_else(|e| e.into_inner()).clone();
                map.insert(spec.id.clone(), Entry::Ready(sbx));
                Ok(info)
            }
            Err(e) => {
                map.remove(&spec.id);
                Err(e)
            }
        }
    }

    async fn start(
        &self,
        spec: &SandboxSpec,
        limits: Limits,
        lower: &Path,
    ) -> Result<Arc<Sandbox>, BackendError> {
        let mut undo = Undo::new(self);
        let mut phases = Phases::new();
        let dir = self.sandbox_dir(&spec.id);
        let (upper, work, root) = (dir.join("upper"), dir.join("work"), dir.join("root"));
        undo.dir = Some(dir.clone());
        if let Some(kept) = &spec.kept {
            // The kept directory holds `upper/` and `work/`: it becomes the sandbox's.
            std::fs::rename(&kept.path, &dir).map_err(|e| {
                BackendError::io(
                    format!("moving {} to {}", kept.path.display(), dir.display()),
                    e,
                )
            })?;
            undo.kept = Some(kept.path.clone());
        }
        for d in [&upper, &work, &root] {
            std::fs::create_dir_all(d)
                .map_err(|e| BackendError::io(format!("creating {}", d.display()), e))?;
        }
        let (slot, mut pooled) = self.reserve_net(&dir).await?;
        undo.slot = Some(slot);
        if let Some(p) = &pooled {
            undo.link = Some(p.net.host_if.clone());
        }
        self.write_guest_files(&upper, &spec.id, slot)?;
        let log = std::fs::File::create(dir.join("agent.log"))
            .map_err(|e| BackendError::io("creating agent.log", e))?;

        phases.mark("files");
        let cg = self.hierarchy.sandbox(&self.cfg.cgroup_parent, &spec.id);
        cg.create(limits).map_err(setup)?;
        undo.cgroup = Some(cg.clone());
        phases.mark("cgroup");

        let host_if = slot.host_ifname(&self.cfg.iface_prefix, spec.allow_internet_access);
        let sandbox_net = match pooled.take() {
            Some(mut p) => {
                if p.net.host_if != host_if {
                    // The host rules key on the name: it says the egress policy.
                    net::rename_host_link(&self.netlink, &p.ns, &mut p.net, host_if.clone())
                        .await
                        .map_err(setup)?;
                    undo.link = Some(host_if.clone());
                }
                phases.mark("pooled-net");
                p.net
            }
            None => {
                undo.link = Some(host_if.clone());
                self.netpool.note_inline();
                let n = net::create_sandbox_net(&self.netlink, slot, host_if.clone())
                    .await
                    .map_err(setup)?;
                phases.mark("net");
                n
            }
        };

        let created_at = SystemTime::now();
        let mut state = StateFile {
            id: spec.id.clone(),
            template: spec.template.clone(),
            pid: None,
            host_if: host_if.clone(),
            slot: slot.network,
            created_at: created_at
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
        };
        write_state(&dir, &state)?;

        let mut env: Vec<(String, String)> = vec![
            (
                "PATH".into(),
                "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into(),
            ),
            ("HOME".into(), "/root".into()),
            ("HOSTNAME".into(), spec.id.clone()),
        ];
        env.retain(|(k, _)| !spec.env.contains_key(k));
        env.extend(spec.env.iter().map(|(k, v)| (k.clone(), v.clone())));

        let plan = spawn::ChildPlan::new(spawn::PlanInput {
            netns: sandbox_net.netns.as_fd(),
            cgroup_procs: cg.join_files(),
            hostname: &spec.id,
            lower,
            upper: &upper,
            work: &work,
            root: &root,
            agent_host_path: &self.cfg.agent_binary,
            agent_guest_path: AGENT_GUEST_PATH,
            agent_args: &self.cfg.agent_args,
            env,
            log: log.as_fd(),
            filters: self.filters.as_ref().clone(),
        })
        .map_err(setup)?;
        phases.mark("plan");
        let (pid, queued) = tokio::task::spawn_blocking(move || {
            let started = std::time::Instant::now();
            let r = spawn::spawn(&plan);
            drop(plan);
            (r, started)
        })
        .await
        .map_err(|e| setup(format!("spawn task: {e}")))?;
        let pid = pid.map_err(setup)?;
        drop(log);
        phases.split("queue", queued);
        phases.mark("spawn");
        undo.pid = Some(pid);
        let exited = watch_exit(pid).map_err(|e| BackendError::io("watching PID 1", e))?;
        state.pid = Some(pid.as_raw());
        write_state(&dir, &state)?;

        let info = SandboxInfo {
            id: spec.id.clone(),
            template: spec.template.clone(),
            state: SandboxState::Running,
            address: SandboxAddress {
                ip: slot.sandbox_ip(),
                agent_port: self.cfg.agent_port,
            },
            cpu_count: spec.cpu_count,
            memory_mb: spec.memory_mb,
            allow_internet_access: spec.allow_internet_access,
            created_at,
        };
        undo.disarm();
        phases.mark("watch");
        tracing::debug!(id = %spec.id, pid = pid.as_raw(), ip = %slot.sandbox_ip(), phases = %phases, "sandbox started");
        Ok(Arc::new(Sandbox {
            info: Mutex::new(info),
            pid,
            cgroup: cg,
            net: Mutex::new(Some(sandbox_net)),
            dir,
            exited,
            op: tokio::sync::Mutex::new(()),
        }))
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

    fn write_guest_files(&self, upper: &Path, id: &str, slot: Slot) -> Result<(), BackendError> {
        let etc = upper.join("etc");
        let agent_dir = upper
            .join(AGENT_GUEST_PATH.trim_start_matches('/'))
            .parent()
            .map(Path::to_path_buf);
        for d in [Some(etc.clone()), agent_dir].into_iter().flatten() {
            std::fs::create_dir_all(&d)
                .map_err(|e| BackendError::io(format!("creating {}", d.display()), e))?;
        }
        let write = |name: &str, text: String| {
            std::fs::write(etc.join(name), text)
                .map_err(|e| BackendError::io(format!("writing /etc/{name}"), e))
        };
        write("hostname", format!("{id}\n"))?;
        write(
            "hosts",
            format!(
                "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n{}\t{id}\n",
                slot.sandbox_ip()
            ),
        )?;
        let resolv: String = self
            .dns
            .iter()
            .map(|ip| format!("nameserver {ip}\n"))
            .collect();
        write("resolv.conf", resolv)?;
        let agent = upper.join(AGENT_GUEST_PATH.trim_start_matches('/'));
        std::fs::File::create(&agent)
            .map_err(|e| BackendError::io("creating the agent mount point", e))?;
        Ok(())
    }

    /// Kills a sandbox and removes all it holds, except its writable layer when `keep`
    /// names where to move it. Errors are collected; every step runs.
    async fn teardown(&self, sbx: &Sandbox, keep: Option<&Path>) -> Result<(), BackendError> {
        let timeout = self.cfg.op_timeout;
        let mut phases = Phases::new();
        let _ = kill(sbx.pid, Signal::SIGKILL);
        // Frozen processes die only once thawed.
        if sbx.cgroup.is_frozen() {
            let _ = sbx.cgroup.thaw(timeout).await;
        }
        let mut exited = sbx.exited.clone();
        let died = matches!(
            tokio::time::timeout(timeout, exited.wait_for(|s| s.is_some())).await,
            Ok(Ok(_))
        );
        phases.mark("kill");
        let mut errors = Vec::new();
        if !died || !sbx.cgroup.pids().is_empty() {
            if let Err(e) = sbx.cgroup.kill_all(timeout).await {
                errors.push(e.to_string());
            }
        }
        let net = sbx.net.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(n) = net {
            // With its processes gone, closing the namespace lets the kernel delete the
            // veth pair; it batches concurrent teardowns, which deleting each link by
            // hand would serialize. Wait for that, then free the address.
            let (host_if, slot) = (n.host_if.clone(), n.slot);
            drop(n);
            if let Err(e) = net::wait_link_gone(&self.netlink, &host_if, timeout).await {
                tracing::warn!(link = %host_if, error = %e, "veth outlived its namespace; deleting it");
                if let Err(e) = net::delete_link(&self.netlink, &host_if).await {
                    errors.push(e.to_string());
                }
            }
            phases.mark("link");
            // The cgroup goes before the address: a cgroup without a reservation is a
            // leftover (see `reconcile`).
            if let Err(e) = sbx.cgroup.remove(timeout).await {
                errors.push(e.to_string());
            }
            phases.mark("cgroup");
            self.pool.release(slot);
        } else if let Err(e) = sbx.cgroup.remove(timeout).await {
            errors.push(e.to_string());
        }
        if let Some(kept) = keep {
            if let Err(e) = keep_layer(&sbx.dir, kept) {
                errors.push(e);
            }
            phases.mark("keep");
        }
        if let Err(e) = self.remove_dir(&sbx.dir) {
            errors.push(e);
        }
        phases.mark("dir");
        tracing::debug!(dir = %sbx.dir.display(), phases = %phases, "sandbox destroyed");
        if errors.is_empty() {
            Ok(())
        } else {
            Err(setup(errors.join("; ")))
        }
    }

    /// Moves a sandbox directory into the trash (instant) and deletes it in the background;
    /// whatever a crash leaves in the trash goes at the next reconciliation.
    fn remove_dir(&self, dir: &Path) -> Result<(), String> {
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

    /// Cleans the leftovers of one sandbox directory from an earlier process.
    async fn clean_leftover(&self, id: &str, report: &mut ReconcileReport) {
        let dir = self.sandbox_dir(id);
        let state: Option<StateFile> = std::fs::read(dir.join("state.json"))
            .ok()
            .and_then(|raw| serde_json::from_slice(&raw).ok());
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
        if let Err(e) = self.remove_dir(&dir) {
            tracing::warn!(id, error = %e, "removing a leftover sandbox directory");
        }
        report.removed_sandboxes.push(id.to_string());
    }
}

/// Durations of the phases of an operation, for debug logs.
struct Phases {
    last: std::time::Instant,
    done: Vec<(&'static str, Duration)>,
}

impl Phases {
    fn new() -> Self {
        Self {
            last: std::time::Instant::now(),
            done: Vec::new(),
        }
    }

    /// Ends the phase `name` at `at` (between the last mark and now).
    fn split(&mut self, name: &'static str, at: std::time::Instant) {
        let at = at.clamp(self.last, std::time::Instant::now());
        self.done.push((name, at - self.last));
        self.last = at;
    }

    fn mark(&mut self, name: &'static str) {
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

/// Undoes a half-done create.
struct Undo<'a> {
    backend: &'a JailBackend,
    armed: bool,
    dir: Option<PathBuf>,
    /// The kept layer the sandbox directory was made from: it goes back there.
    kept: Option<PathBuf>,
    slot: Option<Slot>,
    cgroup: Option<SandboxCgroup>,
    link: Option<String>,
    pid: Option<Pid>,
}

impl<'a> Undo<'a> {
    fn new(backend: &'a JailBackend) -> Self {
        Self {
            backend,
            armed: true,
            dir: None,
            kept: None,
            slot: None,
            cgroup: None,
            link: None,
            pid: None,
        }
    }

    fn disarm(&mut self) {
        self.armed = false;
    }
}

impl Drop for Undo<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        if let Some(pid) = self.pid {
            let _ = kill(pid, Signal::SIGKILL);
            let _ = waitpid(pid, None);
        }
        if let Some(cg) = self.cgroup.take() {
            for d in cg.dirs() {
                let _ = std::fs::remove_dir(d);
            }
        }
        if let Some(link) = self.link.take() {
            // Netlink is async; `ip` does the same synchronously from a destructor.
            let _ = std::process::Command::new("ip")
                .args(["link", "del", &link])
                .stderr(std::process::Stdio::null())
                .status();
        }
        if let Some(slot) = self.slot {
            self.backend.pool.release(slot);
        }
        if let Some(dir) = &self.dir {
            if let Some(kept) = &self.kept
                && let Err(e) = keep_layer(dir, kept)
            {
                tracing::warn!(path = %kept.display(), error = %e, "returning a kept layer after a failed create");
            }
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// Moves the writable layer (`upper/`, `work/`) of the sandbox directory `dir` to `kept`
/// and syncs it to disk.
fn keep_layer(dir: &Path, kept: &Path) -> Result<(), String> {
    std::fs::create_dir(kept).map_err(|e| format!("creating {}: {e}", kept.display()))?;
    for d in ["upper", "work"] {
        std::fs::rename(dir.join(d), kept.join(d)).map_err(|e| {
            format!(
                "moving {} to {}: {e}",
                dir.join(d).display(),
                kept.display()
            )
        })?;
    }
    let sync = |p: &Path| -> std::io::Result<()> {
        let f = std::fs::File::open(p)?;
        // SAFETY: syncfs takes a descriptor `f` keeps open for the call.
        if unsafe { libc::syncfs(std::os::fd::AsRawFd::as_raw_fd(&f)) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    };
    sync(kept).map_err(|e| format!("syncing {}: {e}", kept.display()))
}

fn write_state(dir: &Path, state: &StateFile) -> Result<(), BackendError> {
    let raw = serde_json::to_vec(state)
        .map_err(|e| BackendError::io("encoding state.json", std::io::Error::other(e)))?;
    let tmp = dir.join("state.json.tmp");
    std::fs::write(&tmp, raw).map_err(|e| BackendError::io("writing state.json", e))?;
    std::fs::rename(&tmp, dir.join("state.json"))
        .map_err(|e| BackendError::io("writing state.json", e))
}

fn host_memory_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Reaps PID 1 when it exits (through a pidfd) and publishes its status.
fn watch_exit(pid: Pid) -> std::io::Result<watch::Receiver<Option<WaitStatus>>> {
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
        tracing::debug!(pid = pid.as_raw(), ?status, "sandbox PID 1 exited");
        let _ = tx.send(Some(status));
    });
    Ok(rx)
}

#[async_trait]
impl SandboxBackend for JailBackend {
    fn kind(&self) -> &'static str {
        "jail"
    }

    async fn create(&self, spec: SandboxSpec) -> Result<SandboxInfo, BackendError> {
        self.create_with_progress(spec, crate::template::log_progress())
            .await
    }

    async fn pause(&self, id: &str) -> Result<(), BackendError> {
        let sbx = self.sandboxes.ready(id)?;
        let _op = sbx.op.lock().await;
        if sbx.info.lock().unwrap_or_else(|e| e.into_inner()).state == SandboxState::Paused {
            return Ok(());
        }
        sbx.cgroup
            .freeze(self.cfg.op_timeout)
            .await
            .map_err(setup)?;
        sbx.info.lock().unwrap_or_else(|e| e.into_inner()).state = SandboxState::Paused;
        Ok(())
    }

    async fn resume(&self, id: &str) -> Result<SandboxInfo, BackendError> {
        let sbx = self.sandboxes.ready(id)?;
        let _op = sbx.op.lock().await;
        if sbx.info.lock().unwrap_or_else(|e| e.into_inner()).state == SandboxState::Paused {
            sbx.cgroup.thaw(self.cfg.op_timeout).await.map_err(setup)?;
        }
        let mut info = sbx.info.lock().unwrap_or_else(|e| e.into_inner());
        info.state = SandboxState::Running;
        Ok(info.clone())
    }

    async fn destroy(&self, id: &str) -> Result<(), BackendError> {
        let sbx = self.sandboxes.remove_ready(id)?;
        let _op = sbx.op.lock().await;
        self.teardown(&sbx, None).await
    }

    async fn keep(&self, id: &str) -> Result<KeptState, BackendError> {
        let sbx = self.sandboxes.remove_paused(id)?;
        let _op = sbx.op.lock().await;
        let nonce: u64 = rand::random();
        let path = self.kept_dir.join(format!("{id}.{nonce:016x}"));
        self.teardown(&sbx, Some(&path)).await?;
        tracing::debug!(id, path = %path.display(), "sandbox stopped, writable layer kept");
        Ok(KeptState { path })
    }

    async fn snapshot(&self, id: &str, dir: &Path) -> Result<SnapshotCapture, BackendError> {
        self.capture(id, dir).await
    }

    async fn import_snapshot(
        &self,
        capture: &SnapshotCapture,
        dir: &Path,
    ) -> Result<KeptState, BackendError> {
        self.import(capture, dir).await
    }

    async fn discard_kept(&self, kept: &KeptState) -> Result<(), BackendError> {
        if !kept.path.exists() {
            return Ok(());
        }
        self.check_kept(kept)?;
        self.remove_dir(&kept.path).map_err(setup)
    }

    async fn get(&self, id: &str) -> Result<SandboxInfo, BackendError> {
        self.sandboxes.get(id)
    }

    async fn usage(&self, id: &str) -> Result<ResourceUsage, BackendError> {
        self.sandboxes.usage(id)
    }

    async fn list(&self) -> Vec<SandboxInfo> {
        self.sandboxes.list()
    }

    async fn reconcile(&self, kept: &[KeptState]) -> Result<ReconcileReport, BackendError> {
        let mut report = ReconcileReport::default();
        let live = self.sandboxes.ids();
        let entries = std::fs::read_dir(&self.sandboxes_dir).map_err(|e| {
            BackendError::io(format!("listing {}", self.sandboxes_dir.display()), e)
        })?;
        for entry in entries.flatten() {
            let id = entry.file_name().to_string_lossy().into_owned();
            if !live.contains(&id) {
                self.clean_leftover(&id, &mut report).await;
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
        // Kept layers no record references belong to nobody.
        if let Ok(entries) = std::fs::read_dir(&self.kept_dir) {
            for entry in entries.flatten() {
                let path = entry.path();
                if kept.iter().any(|k| k.path == path) {
                    continue;
                }
                match self.remove_dir(&path) {
                    Ok(()) => report
                        .removed_other
                        .push(format!("kept layer {}", path.display())),
                    Err(e) => tracing::warn!(error = %e, "removing an unreferenced kept layer"),
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
        super::orphans::HostResources {
            pool: &self.pool,
            netlink: &self.netlink,
            hierarchy: &self.hierarchy,
            cgroup_parent: &self.cfg.cgroup_parent,
            iface_prefix: &self.cfg.iface_prefix,
            op_timeout: self.cfg.op_timeout,
        }
        .remove_orphans(&live, &mut report)
        .await;
        if !report.removed_sandboxes.is_empty() || !report.removed_other.is_empty() {
            tracing::info!(?report, "cleaned leftovers of an earlier node process");
        }
        Ok(report)
    }
}
