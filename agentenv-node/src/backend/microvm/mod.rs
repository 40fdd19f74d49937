//! The `microvm` backend: every sandbox is a KVM microVM run by its own `agentenv-vmm`
//! process.
//!
//! A sandbox is:
//! * a directory `<data>/microvm/sandboxes/<id>/` holding `vm.json` (the VMM's
//!   configuration), `rootfs.ext4` (the sandbox's own copy of the template's disk image:
//!   read-write root, copied sparsely, so sandboxes never share a writable disk),
//!   `api.sock` (the VMM's control socket), `vmm.log`, `serial.log`, `vsock.sock`,
//!   `snapshot/` once paused, and `state.json` (what reconciliation needs);
//! * a network namespace made by the jail's [`create_sandbox_net`] (a veth pair to the
//!   host, a /30 of the address pool, the host NAT and firewall rules) plus a tap to the
//!   guest, whose own address is the same in every sandbox; the namespace translates the
//!   sandbox address to it (see [`net`]), so the data plane is the jail's and a snapshot
//!   restores into any address;
//! * a cgroup limiting CPU (the spec's CPUs), memory (the guest's memory plus
//!   [`MicrovmConfig::vmm_overhead_mib`]) and threads;
//! * the VMM process, started inside that namespace and cgroup in a session of its own,
//!   with its seccomp filter (`--seccomp strict`), booting the guest kernel with the
//!   image's agent as init (`init=`, see [`image::init_cmdline`]) and the guest's address
//!   on the kernel command line (`ip=`).
//!
//! Pause = pause the vCPUs, write a full snapshot into `snapshot/`, stop the VMM (the
//! namespace, address and cgroup stay). Resume = a new VMM restored from `snapshot/`.
//! Keep moves the directory of a paused sandbox to `<data>/microvm/kept/<id>.<nonce>/`
//! (its snapshot and disk) and releases everything else; a create naming it restores from
//! it (with the kept memory size and vCPUs, which a snapshot cannot change).
//!
//! [`SandboxBackend::snapshot`] captures a running sandbox (paused for the moment of the
//! capture): the VM snapshot, a copy of its disk and `state.json`.
//! [`SandboxBackend::import_snapshot`] turns a capture into kept state, so creates from a
//! template snapshot restore it instead of booting, as often as wanted and next to the
//! sandbox it was taken from.

pub mod net;

use std::ffi::CString;
use std::net::Ipv4Addr;
use std::os::fd::{AsFd, AsRawFd};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use agentenv_vmm::control::{SnapshotKind, VmmClient};
use agentenv_vmm::snapshot::{MEMORY_FILE, STATE_FILE};
use async_trait::async_trait;

use super::table::{Entry, SandboxTable, TableSandbox};
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use super::jail::cgroup::{Hierarchy, Limits, SandboxCgroup};
use super::jail::net::{self as jnet, AddressPool, HostRules, Ipv4Net, SandboxNet, Slot};
use super::{
    AGENT_PORT, BackendError, KeptState, MIN_MEMORY_MB, ReconcileReport, ResourceUsage,
    SandboxAddress, SandboxBackend, SandboxInfo, SandboxSpec, SandboxState, SnapshotCapture,
    validate_sandbox_id,
};
use crate::template::image;
use crate::template::{Progress, TemplateError, TemplateStore, TemplateStoreConfig};

/// The kernel arguments every guest gets before the backend's own.
/// (The VMM adds the serial console and the virtio-mmio devices itself.)
pub const DEFAULT_BOOT_ARGS: &str = "reboot=k panic=1 pci=off";

/// The sandbox's disk in its directory (and in captures).
const ROOTFS_FILE: &str = "rootfs.ext4";

/// The files of a capture ([`SandboxBackend::snapshot`]).
const CAPTURE_FILES: &[&str] = &[STATE_FILE, MEMORY_FILE, ROOTFS_FILE, "state.json"];

/// Longest unix socket path.
const MAX_SOCKET_PATH: usize = 107;

/// Configuration of the microvm backend.
#[derive(Clone, Debug)]
pub struct MicrovmConfig {
    /// The node's data directory; sandboxes live in `<data_dir>/microvm`.
    pub data_dir: PathBuf,
    /// Host-wide runtime state (address reservations), shared with the jail backend.
    pub runtime_dir: PathBuf,
    /// The template store.
    pub templates: TemplateStoreConfig,
    /// The agent binary installed into template images as init.
    pub agent_binary: PathBuf,
    /// The `agentenv-vmm` binary.
    pub vmm_binary: PathBuf,
    /// The guest kernel (an uncompressed vmlinux or a bzImage).
    pub kernel: PathBuf,
    /// Kernel arguments before the backend's (`root=`, `ip=`, `init=`).
    pub boot_args: String,
    /// Where template disk images are cached.
    pub image_dir: PathBuf,
    /// The agent's port inside the guest.
    pub agent_port: u16,
    /// Sandbox addresses: carved into /30 networks (shared with the jail backend).
    pub address_pool: Ipv4Net,
    /// Host interface names start with this (at most 6 characters).
    pub iface_prefix: String,
    /// Networks sandboxes never reach.
    pub denied_networks: Vec<Ipv4Net>,
    /// Nameservers the guest is told about; `None` takes the host's.
    pub dns_servers: Option<Vec<Ipv4Addr>>,
    /// Parent of the sandbox cgroups.
    pub cgroup_parent: String,
    /// Memory the VMM process itself may use beyond the guest's, in MiB.
    pub vmm_overhead_mib: u64,
    /// Most threads of one VMM process.
    pub vmm_max_threads: u32,
    /// Install the VMM's seccomp filter (`--seccomp strict`).
    pub seccomp: bool,
    /// Attach the root disk and network device to the VM (a guest program without
    /// drivers may run without them).
    pub attach_devices: bool,
    /// How long a VMM may take to answer, start or stop.
    pub op_timeout: Duration,
    /// How long a snapshot may take.
    pub snapshot_timeout: Duration,
}

impl MicrovmConfig {
    /// Defaults for a node with data under `data_dir`.
    pub fn new(
        data_dir: impl Into<PathBuf>,
        agent_binary: impl Into<PathBuf>,
        vmm_binary: impl Into<PathBuf>,
        kernel: impl Into<PathBuf>,
    ) -> Self {
        let data_dir = data_dir.into();
        Self {
            templates: TemplateStoreConfig::new(data_dir.join("templates")),
            image_dir: data_dir.join("microvm").join("images"),
            data_dir,
            runtime_dir: PathBuf::from("/run/agentenv"),
            agent_binary: agent_binary.into(),
            vmm_binary: vmm_binary.into(),
            kernel: kernel.into(),
            boot_args: DEFAULT_BOOT_ARGS.into(),
            agent_port: AGENT_PORT,
            address_pool: Ipv4Net::new(Ipv4Addr::new(10, 12, 0, 0), 16)
                .expect("10.12.0.0/16 is a valid network"),
            iface_prefix: "av".into(),
            denied_networks: Ipv4Net::default_denied(),
            dns_servers: None,
            cgroup_parent: "agentenv-vm".into(),
            vmm_overhead_mib: 64,
            vmm_max_threads: 256,
            seccomp: true,
            attach_devices: true,
            op_timeout: Duration::from_secs(10),
            snapshot_timeout: Duration::from_secs(120),
        }
    }
}

/// Why this host cannot run microVM sandboxes, if it cannot: no `/dev/kvm`, KVM served
/// by `kvm_pvm` (no Linux guest reaches userspace there), no guest kernel or no VMM
/// binary. The message says what is missing and how to fix it.
pub fn unavailable_reason(kernel: &Path, vmm_binary: &Path) -> Option<String> {
    unavailable_reason_at(
        Path::new("/dev/kvm"),
        Path::new("/sys/module/kvm_pvm"),
        kernel,
        vmm_binary,
    )
}

fn unavailable_reason_at(
    dev_kvm: &Path,
    pvm_module: &Path,
    kernel: &Path,
    vmm_binary: &Path,
) -> Option<String> {
    if !dev_kvm.exists() {
        return Some(format!(
            "{} is missing: this host has no KVM (enable virtualization or load kvm_intel/kvm_amd)",
            dev_kvm.display()
        ));
    }
    if pvm_module.exists() {
        return Some(format!(
            "{} is served by kvm_pvm ({} exists): guest kernel code is emulated there and no Linux guest reaches userspace; run microVMs on a host with hardware KVM",
            dev_kvm.display(),
            pvm_module.display()
        ));
    }
    if !kernel.is_file() {
        return Some(format!(
            "no guest kernel at {}: build it with agentenv-vmm/guest/build-kernel.sh and set AENV_GUEST_KERNEL_PATH to its vmlinux",
            kernel.display()
        ));
    }
    if !vmm_binary.is_file() {
        return Some(format!(
            "no agentenv-vmm binary at {}: install it (deploy/install.sh) or set AENV_VMM_BINARY_PATH",
            vmm_binary.display()
        ));
    }
    None
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
    /// The guest's vCPUs and memory (a restore needs the same).
    #[serde(default)]
    cpu_count: Option<u32>,
    #[serde(default)]
    memory_mb: Option<u64>,
}

/// A running VMM process.
struct VmmProcess {
    pid: i32,
    exited: watch::Receiver<Option<std::process::ExitStatus>>,
}

struct Sandbox {
    info: Mutex<SandboxInfo>,
    dir: PathBuf,
    cgroup: SandboxCgroup,
    net: Mutex<Option<SandboxNet>>,
    vmm: Mutex<Option<VmmProcess>>,
    client: VmmClient,
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

fn setup(msg: impl std::fmt::Display) -> BackendError {
    BackendError::Setup(msg.to_string())
}

/// The microvm backend.
pub struct MicrovmBackend {
    cfg: MicrovmConfig,
    templates: TemplateStore,
    hierarchy: Hierarchy,
    pool: AddressPool,
    netlink: rtnetlink::Handle,
    dns: Vec<Ipv4Addr>,
    sandboxes_dir: PathBuf,
    kept_dir: PathBuf,
    host_cpus: u32,
    sandboxes: SandboxTable<Sandbox>,
}

impl MicrovmBackend {
    /// Checks the host (KVM, kernel, VMM binary), prepares directories, the cgroup parent
    /// and the host firewall rules.
    pub async fn new(cfg: MicrovmConfig) -> Result<Self, BackendError> {
        if let Some(reason) = unavailable_reason(&cfg.kernel, &cfg.vmm_binary) {
            return Err(setup(format!(
                "the microvm backend cannot run here: {reason}"
            )));
        }
        Self::new_unchecked(cfg).await
    }

    /// [`MicrovmBackend::new`] without the check that Linux guests can run (KVM under
    /// `kvm_pvm` still runs guest programs: tests drive the backend with those).
    pub async fn new_unchecked(cfg: MicrovmConfig) -> Result<Self, BackendError> {
        if cfg.iface_prefix.is_empty()
            || cfg.iface_prefix.len() > 6
            || !cfg.iface_prefix.bytes().all(|b| b.is_ascii_lowercase())
        {
            return Err(setup(format!(
                "invalid iface_prefix {:?}: use 1 to 6 lowercase letters",
                cfg.iface_prefix
            )));
        }
        for (what, p) in [
            ("agent binary", &cfg.agent_binary),
            ("VMM binary", &cfg.vmm_binary),
            ("guest kernel", &cfg.kernel),
        ] {
            if !p.is_file() {
                return Err(setup(format!("the {what} {} does not exist", p.display())));
            }
        }
        let sandboxes_dir = cfg.data_dir.join("microvm").join("sandboxes");
        let kept_dir = cfg.data_dir.join("microvm").join("kept");
        for d in [&sandboxes_dir, &kept_dir, &cfg.image_dir, &cfg.runtime_dir] {
            std::fs::create_dir_all(d)
                .map_err(|e| BackendError::io(format!("creating {}", d.display()), e))?;
        }
        let hierarchy = Hierarchy::detect().map_err(setup)?;
        hierarchy
            .prepare_parent(&cfg.cgroup_parent)
            .map_err(setup)?;
        let pool = AddressPool::new(cfg.address_pool, &cfg.runtime_dir).map_err(setup)?;
        let dns = cfg
            .dns_servers
            .clone()
            .unwrap_or_else(jnet::host_nameservers);
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
        let host_cpus = std::thread::available_parallelism()
            .map(|n| n.get() as u32)
            .unwrap_or(1);
        tracing::info!(
            kernel = %cfg.kernel.display(),
            vmm = %cfg.vmm_binary.display(),
            cgroup = hierarchy.version(),
            pool = %cfg.address_pool,
            "microvm backend ready"
        );
        Ok(Self {
            templates: TemplateStore::new(cfg.templates.clone()),
            cfg,
            hierarchy,
            pool,
            netlink,
            dns,
            sandboxes_dir,
            kept_dir,
            host_cpus,
            sandboxes: SandboxTable::new(),
        })
    }

    /// The template store.
    pub fn templates(&self) -> &TemplateStore {
        &self.templates
    }

    /// The directory of a sandbox.
    pub fn sandbox_dir(&self, id: &str) -> PathBuf {
        self.sandboxes_dir.join(id)
    }

    /// Where kept snapshots live.
    pub fn kept_dir(&self) -> &Path {
        &self.kept_dir
    }

    /// The PID of a sandbox's VMM process, while one runs.
    pub fn vmm_pid(&self, id: &str) -> Option<i32> {
        let sbx = self.sandboxes.ready(id).ok()?;
        let vmm = sbx.vmm.lock().unwrap_or_else(|e| e.into_inner());
        vmm.as_ref().map(|v| v.pid)
    }

    /// The control client of a sandbox's VMM.
    pub fn vmm_client(&self, id: &str) -> Option<VmmClient> {
        self.sandboxes.ready(id).ok().map(|s| s.client.clone())
    }

    /// The cgroup directories of a sandbox.
    pub fn cgroup_dirs(&self, id: &str) -> Vec<PathBuf> {
        self.hierarchy
            .sandbox(&self.cfg.cgroup_parent, id)
            .dirs()
            .to_vec()
    }

    /// The host interface of a sandbox.
    pub fn host_interface(&self, id: &str) -> Option<String> {
        let sbx = self.sandboxes.ready(id).ok()?;
        let net = sbx.net.lock().unwrap_or_else(|e| e.into_inner());
        net.as_ref().map(|n| n.host_if.clone())
    }

    /// Runs `program` with `args` inside a sandbox's network namespace; its output.
    pub fn run_in_sandbox(
        &self,
        id: &str,
        program: &str,
        args: &[&str],
    ) -> Result<String, BackendError> {
        let sbx = self.sandboxes.ready(id)?;
        let net = sbx.net.lock().unwrap_or_else(|e| e.into_inner());
        let n = net
            .as_ref()
            .ok_or_else(|| setup(format!("sandbox {id} has no network namespace")))?;
        net::run_in(n.netns.as_fd(), program, args, "").map_err(setup)
    }

    /// Whether an address of the pool is reserved (by any node process on this host).
    pub fn address_reserved(&self, ip: Ipv4Addr) -> bool {
        self.pool.is_reserved(Slot {
            network: Ipv4Addr::from(u32::from(ip) & !3),
        })
    }

    /// Names of host interfaces of microVM sandboxes.
    pub async fn host_interfaces(&self) -> Vec<String> {
        jnet::list_links(&self.netlink, &self.cfg.iface_prefix)
            .await
            .unwrap_or_default()
    }

    fn check_limits(&self, spec: &SandboxSpec) -> Result<Limits, BackendError> {
        if spec.cpu_count == 0 || spec.cpu_count > u32::from(agentenv_vmm::config::MAX_VCPUS) {
            return Err(BackendError::InvalidLimits(format!(
                "cpuCount must be between 1 and {}",
                agentenv_vmm::config::MAX_VCPUS
            )));
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
        Ok(Limits {
            cpus: spec.cpu_count,
            memory_bytes: (spec.memory_mb + self.cfg.vmm_overhead_mib).saturating_mul(1 << 20),
            max_processes: self.cfg.vmm_max_threads,
        })
    }

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
        for f in ["snapshot", ROOTFS_FILE, "state.json"] {
            if !kept.path.join(f).exists() {
                return Err(bad(&format!("{f} is missing")));
            }
        }
        Ok(())
    }

    /// The VM configuration of a sandbox.
    fn vm_config(
        &self,
        spec: &SandboxSpec,
        dir: &Path,
    ) -> Result<agentenv_vmm::VmConfig, BackendError> {
        let dns = self.dns.first().map(|d| d.to_string()).unwrap_or_default();
        let mut cmdline = format!(
            "{} ip={}::{}:255.255.255.252:{}:eth0:off:{dns}",
            self.cfg.boot_args,
            net::GUEST_IP,
            net::TAP_IP,
            // The kernel sets its host name from here (ids are valid host names).
            spec.id,
        );
        if self.cfg.attach_devices {
            cmdline.push_str(" root=/dev/vda rw rootwait");
        }
        // The kernel hands unknown `KEY=VALUE` arguments to init as its environment; a
        // value the command line cannot carry is left to /init, which sets env again.
        for (k, v) in &spec.env {
            let plain = |s: &str| {
                !s.is_empty()
                    && s.bytes()
                        .all(|b| b.is_ascii_graphic() && b != b'"' && b != b'\'' && b != b'=')
            };
            if plain(k) && !k.contains('.') && (v.is_empty() || plain(v)) {
                cmdline.push_str(&format!(" {k}={v}"));
            }
        }
        cmdline.push(' ');
        cmdline.push_str(&image::init_cmdline());
        let mut drives = Vec::new();
        let mut nets = Vec::new();
        if self.cfg.attach_devices {
            drives.push(agentenv_vmm::config::DriveConfig {
                id: "rootfs".into(),
                path: dir.join(ROOTFS_FILE),
                read_only: false,
                is_root: true,
            });
            nets.push(agentenv_vmm::config::NetConfig {
                id: "eth0".into(),
                tap: net::TAP_IF.into(),
                guest_mac: net::GUEST_MAC.into(),
            });
        }
        let cfg: agentenv_vmm::VmConfig = serde_json::from_value(serde_json::json!({
            "vcpus": spec.cpu_count,
            "memory_mib": spec.memory_mb,
            "kernel": self.cfg.kernel,
            "cmdline": cmdline,
            "drives": drives,
            "net": nets,
            "serial_output": dir.join("serial.log"),
            // A balloon the node can inflate to take memory back (empty at start; the
            // guest gets pages back when it runs short), and entropy for the guest.
            "balloon": if self.cfg.attach_devices {
                serde_json::json!({
                    "amount_mib": 0,
                    "deflate_on_oom": true,
                    "stats_polling_interval_s": 5,
                })
            } else {
                serde_json::Value::Null
            },
            "rng": self.cfg.attach_devices,
        }))
        .map_err(|e| setup(format!("building the VM configuration: {e}")))?;
        cfg.validate()
            .map_err(|e| BackendError::InvalidLimits(e.to_string()))?;
        Ok(cfg)
    }

    /// Creates a sandbox, building the template and its image first if needed.
    pub async fn create_with_progress(
        &self,
        mut spec: SandboxSpec,
        progress: Progress,
    ) -> Result<SandboxInfo, BackendError> {
        validate_sandbox_id(&spec.id)?;
        if let Some(kept) = &spec.kept {
            self.check_kept(kept)?;
            // A snapshot restores the memory size and vCPUs it was taken with.
            let st = read_state(&kept.path).ok_or_else(|| BackendError::BadKeptState {
                path: kept.path.clone(),
                reason: "state.json is unreadable".into(),
            })?;
            if let Some(c) = st.cpu_count {
                spec.cpu_count = c;
            }
            if let Some(m) = st.memory_mb {
                spec.memory_mb = m;
            }
        }
        let limits = self.check_limits(&spec)?;
        let sock = self.sandbox_dir(&spec.id).join("api.sock");
        if sock.as_os_str().len() > MAX_SOCKET_PATH {
            return Err(setup(format!(
                "the VMM socket path {} is longer than {MAX_SOCKET_PATH} bytes: use a shorter data directory",
                sock.display()
            )));
        }
        {
            let mut map = self.sandboxes.lock();
            if map.contains_key(&spec.id) || self.sandbox_dir(&spec.id).exists() {
                return Err(BackendError::AlreadyExists(spec.id.clone()));
            }
            map.insert(spec.id.clone(), Entry::Creating);
        }
        let result = async {
            let disk = if spec.kept.is_some() {
                None
            } else {
                let template = self
                    .templates
                    .ensure(&spec.template, progress.clone())
                    .await
                    .map_err(|e| match e {
                        TemplateError::NotFound(n) | TemplateError::InvalidName(n) => {
                            BackendError::UnknownTemplate(n)
                        }
                        other => BackendError::Template(other),
                    })?;
                Some(
                    image::ensure_image(
                        &template,
                        &self.cfg.agent_binary,
                        &self.cfg.image_dir,
                        progress,
                    )
                    .await
                    .map_err(setup)?,
                )
            };
            self.start(&spec, limits, disk.as_deref()).await
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
        disk: Option<&Path>,
    ) -> Result<Arc<Sandbox>, BackendError> {
        let mut undo = Undo::new(self);
        let dir = self.sandbox_dir(&spec.id);
        undo.dir = Some(dir.clone());
        if let Some(kept) = &spec.kept {
            std::fs::rename(&kept.path, &dir).map_err(|e| {
                BackendError::io(
                    format!("moving {} to {}", kept.path.display(), dir.display()),
                    e,
                )
            })?;
            undo.kept = Some(kept.path.clone());
        } else {
            std::fs::create_dir_all(&dir)
                .map_err(|e| BackendError::io(format!("creating {}", dir.display()), e))?;
            if let Some(disk) = disk {
                copy_sparse(disk, &dir.join(ROOTFS_FILE)).await?;
            }
        }
        let slot = self.pool.reserve(&dir).map_err(|e| match e {
            jnet::NetError::Exhausted(p) => BackendError::AddressPoolExhausted {
                pool: p.to_string(),
            },
            other => setup(other),
        })?;
        undo.slot = Some(slot);
        let config = self.vm_config(spec, &dir)?;
        write_json(&dir.join("vm.json"), &config)?;

        let cg = self.hierarchy.sandbox(&self.cfg.cgroup_parent, &spec.id);
        cg.create(limits).map_err(setup)?;
        undo.cgroup = Some(cg.clone());

        let host_if = slot.host_ifname(&self.cfg.iface_prefix, spec.allow_internet_access);
        // The slot is ours now: a link already named after it is a leftover of a process
        // that died without cleaning up.
        for internet in [true, false] {
            let name = slot.host_ifname(&self.cfg.iface_prefix, internet);
            if let Ok(true) = jnet::delete_link(&self.netlink, &name).await {
                tracing::warn!(link = %name, "deleted a leftover link of a reused address");
            }
        }
        undo.link = Some(host_if.clone());
        let sandbox_net = jnet::create_sandbox_net(&self.netlink, slot, host_if.clone())
            .await
            .map_err(setup)?;
        net::setup_tap(sandbox_net.netns.as_fd(), slot.sandbox_ip()).map_err(setup)?;

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
            cpu_count: Some(spec.cpu_count),
            memory_mb: Some(spec.memory_mb),
        };
        write_json(&dir.join("state.json"), &state)?;

        let client =
            VmmClient::new(dir.join("api.sock"), spec.id.clone()).with_timeout(self.cfg.op_timeout);
        let restore = spec.kept.as_ref().map(|_| dir.join("snapshot"));
        let vmm = self
            .spawn_vmm(&dir, &sandbox_net.netns, &cg, restore.as_deref(), &client)
            .await;
        let vmm = vmm?;
        undo.pid = Some(vmm.pid);
        state.pid = Some(vmm.pid);
        write_json(&dir.join("state.json"), &state)?;
        if restore.is_some() {
            let _ = std::fs::remove_dir_all(dir.join("snapshot"));
        }
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
        tracing::debug!(id = %spec.id, pid = vmm.pid, ip = %slot.sandbox_ip(), "microVM started");
        Ok(Arc::new(Sandbox {
            info: Mutex::new(info),
            dir,
            cgroup: cg,
            net: Mutex::new(Some(sandbox_net)),
            vmm: Mutex::new(Some(vmm)),
            client,
            op: tokio::sync::Mutex::new(()),
        }))
    }

    /// Starts a VMM inside the sandbox's namespace and cgroup, booting (or restoring from
    /// `restore`) right away, and waits until it answers.
    async fn spawn_vmm(
        &self,
        dir: &Path,
        netns: &std::os::fd::OwnedFd,
        cg: &SandboxCgroup,
        restore: Option<&Path>,
        client: &VmmClient,
    ) -> Result<VmmProcess, BackendError> {
        let log = std::fs::File::options()
            .create(true)
            .append(true)
            .open(dir.join("vmm.log"))
            .map_err(|e| BackendError::io("creating vmm.log", e))?;
        let _ = std::fs::remove_file(client.path());
        let mut cmd = tokio::process::Command::new(&self.cfg.vmm_binary);
        cmd.arg("--config")
            .arg(dir.join("vm.json"))
            .arg("--api-sock")
            .arg(client.path())
            .arg("--log-file")
            .arg(dir.join("vmm.log"))
            .arg("--seccomp")
            .arg(if self.cfg.seccomp { "strict" } else { "off" })
            .arg("--start")
            .current_dir(dir)
            .stdin(std::process::Stdio::null())
            .stdout(
                log.try_clone()
                    .map_err(|e| BackendError::io("opening vmm.log", e))?,
            )
            .stderr(log)
            .kill_on_drop(false);
        if let Some(r) = restore {
            cmd.arg("--restore").arg(r);
        }
        let netns = netns.as_raw_fd();
        let procs: Vec<CString> = cg
            .procs_files()
            .iter()
            .map(|p| CString::new(p.as_os_str().as_encoded_bytes()))
            .collect::<Result<_, _>>()
            .map_err(|e| setup(format!("cgroup path: {e}")))?;
        // SAFETY: the closure runs in the forked child before exec. It only makes
        // async-signal-safe system calls (setns, open, write, close, setsid, getpid) on
        // memory prepared before the fork (the C strings), formatting the pid into a
        // stack buffer without allocating.
        unsafe {
            cmd.pre_exec(move || {
                if libc::setns(netns, libc::CLONE_NEWNET) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                let mut buf = [0u8; 24];
                let text = format_pid(libc::getpid(), &mut buf);
                for p in &procs {
                    let fd = libc::open(p.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
                    if fd < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    let n = libc::write(fd, text.as_ptr().cast(), text.len());
                    let err = std::io::Error::last_os_error();
                    libc::close(fd);
                    if n < 0 {
                        return Err(err);
                    }
                }
                if libc::setsid() < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let mut child = cmd
            .spawn()
            .map_err(|e| setup(format!("starting {}: {e}", self.cfg.vmm_binary.display())))?;
        let pid = child
            .id()
            .map(|p| p as i32)
            .ok_or_else(|| setup("the VMM exited at once"))?;
        let (tx, rx) = watch::channel(None);
        tokio::spawn(async move {
            let status = child.wait().await.ok();
            tracing::debug!(pid, ?status, "VMM exited");
            let _ = tx.send(status.or_else(|| {
                use std::os::unix::process::ExitStatusExt;
                Some(std::process::ExitStatus::from_raw(-1))
            }));
        });
        let proc = VmmProcess { pid, exited: rx };
        let mut exited = proc.exited.clone();
        let ready = tokio::select! {
            r = client.wait_ready(self.cfg.op_timeout) => r.map_err(|e| e.to_string()),
            _ = exited.wait_for(|s| s.is_some()) => Err("it exited".to_string()),
        };
        match ready {
            Ok(status) if status["state"] == "running" => Ok(proc),
            other => {
                let why = match other {
                    Ok(status) => format!("it reports {status}"),
                    Err(e) => e,
                };
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGKILL,
                );
                let mut exited = proc.exited.clone();
                let _ = tokio::time::timeout(self.cfg.op_timeout, exited.wait_for(|s| s.is_some()))
                    .await;
                Err(setup(format!(
                    "the VMM of {} did not start ({why}); its log: {}",
                    dir.display(),
                    log_tail(&dir.join("vmm.log"))
                )))
            }
        }
    }

    /// Stops the VMM of `sbx` (asks, then kills) and waits for it to exit.
    async fn stop_vmm(&self, sbx: &Sandbox, ask: bool) -> Result<(), BackendError> {
        let proc = sbx.vmm.lock().unwrap_or_else(|e| e.into_inner()).take();
        let Some(proc) = proc else {
            return Ok(());
        };
        let mut exited = proc.exited.clone();
        if ask {
            if let Err(e) = sbx.client.stop().await {
                tracing::warn!(error = %e, "stopping the VMM over its socket; killing it");
            }
            if tokio::time::timeout(self.cfg.op_timeout, exited.wait_for(|s| s.is_some()))
                .await
                .is_ok()
            {
                return Ok(());
            }
        }
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(proc.pid),
            nix::sys::signal::Signal::SIGKILL,
        );
        match tokio::time::timeout(self.cfg.op_timeout, exited.wait_for(|s| s.is_some())).await {
            Ok(_) => Ok(()),
            Err(_) => Err(setup(format!(
                "the VMM (pid {}) did not exit within {:?}",
                proc.pid, self.cfg.op_timeout
            ))),
        }
    }

    /// Stops a sandbox and removes what it holds; `keep` names where its directory goes
    /// instead of being deleted. Every step runs; errors are collected.
    async fn teardown(&self, sbx: &Sandbox, keep: Option<&Path>) -> Result<(), BackendError> {
        let timeout = self.cfg.op_timeout;
        let mut errors = Vec::new();
        if let Err(e) = self.stop_vmm(sbx, false).await {
            errors.push(e.to_string());
        }
        if !sbx.cgroup.pids().is_empty()
            && let Err(e) = sbx.cgroup.kill_all(timeout).await
        {
            errors.push(e.to_string());
        }
        let net = sbx.net.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(n) = net {
            let (host_if, slot) = (n.host_if.clone(), n.slot);
            // The tap and bridge live in the namespace: they go with it, and the veth
            // pair with them.
            drop(n);
            if let Err(e) = jnet::wait_link_gone(&self.netlink, &host_if, timeout).await {
                tracing::warn!(link = %host_if, error = %e, "veth outlived its namespace; deleting it");
                if let Err(e) = jnet::delete_link(&self.netlink, &host_if).await {
                    errors.push(e.to_string());
                }
            }
            if let Err(e) = sbx.cgroup.remove(timeout).await {
                errors.push(e.to_string());
            }
            self.pool.release(slot);
        } else if let Err(e) = sbx.cgroup.remove(timeout).await {
            errors.push(e.to_string());
        }
        match keep {
            Some(kept) => {
                for f in ["api.sock", "vsock.sock"] {
                    let _ = std::fs::remove_file(sbx.dir.join(f));
                }
                if let Err(e) = std::fs::rename(&sbx.dir, kept) {
                    errors.push(format!(
                        "moving {} to {}: {e}",
                        sbx.dir.display(),
                        kept.display()
                    ));
                }
            }
            None => {
                if let Err(e) = remove_dir(&sbx.dir) {
                    errors.push(e);
                }
            }
        }
        if errors.is_empty() {
            Ok(())
        } else {
            Err(setup(errors.join("; ")))
        }
    }

    async fn clean_leftover(&self, id: &str, report: &mut ReconcileReport) {
        let dir = self.sandbox_dir(id);
        let state = read_state(&dir);
        if validate_sandbox_id(id).is_ok() {
            let cg = self.hierarchy.sandbox(&self.cfg.cgroup_parent, id);
            if cg.exists() {
                if let Err(e) = cg.kill_all(self.cfg.op_timeout).await {
                    tracing::warn!(id, error = %e, "killing a leftover VMM");
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
                if let Ok(true) = jnet::delete_link(&self.netlink, &name).await {
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
        if let Err(e) = remove_dir(&dir) {
            tracing::warn!(id, error = %e, "removing a leftover sandbox directory");
        }
        report.removed_sandboxes.push(id.to_string());
    }
}

/// `pid` as decimal text in `buf`, without allocating.
fn format_pid(pid: libc::pid_t, buf: &mut [u8; 24]) -> &[u8] {
    let mut n = pid.unsigned_abs();
    let mut i = buf.len();
    loop {
        i -= 1;
        buf[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    &buf[i..]
}

/// Moves a file, copying (sparsely) when it is on another filesystem.
async fn move_file(from: &Path, to: &Path) -> Result<(), BackendError> {
    match std::fs::rename(from, to) {
        Ok(()) => Ok(()),
        Err(e) if e.raw_os_error() == Some(libc::EXDEV) => {
            copy_sparse(from, to).await?;
            let _ = std::fs::remove_file(from);
            Ok(())
        }
        Err(e) => Err(BackendError::io(
            format!("moving {} to {}", from.display(), to.display()),
            e,
        )),
    }
}

/// Copies a disk image keeping holes (and sharing blocks where the filesystem can).
async fn copy_sparse(from: &Path, to: &Path) -> Result<(), BackendError> {
    let out = tokio::process::Command::new("cp")
        .arg("--sparse=always")
        .arg("--reflink=auto")
        .arg(from)
        .arg(to)
        .output()
        .await
        .map_err(|e| BackendError::io("running cp", e))?;
    if !out.status.success() {
        return Err(setup(format!(
            "copying {} to {}: {}",
            from.display(),
            to.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(())
}

fn write_json(path: &Path, value: &impl Serialize) -> Result<(), BackendError> {
    let raw = serde_json::to_vec_pretty(value)
        .map_err(|e| BackendError::io("encoding JSON", std::io::Error::other(e)))?;
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, raw)
        .map_err(|e| BackendError::io(format!("writing {}", path.display()), e))?;
    std::fs::rename(&tmp, path)
        .map_err(|e| BackendError::io(format!("writing {}", path.display()), e))
}

fn read_state(dir: &Path) -> Option<StateFile> {
    std::fs::read(dir.join("state.json"))
        .ok()
        .and_then(|raw| serde_json::from_slice(&raw).ok())
}

fn remove_dir(dir: &Path) -> Result<(), String> {
    match std::fs::remove_dir_all(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(format!("removing {}: {e}", dir.display())),
    }
}

/// The last lines of a log file, for error messages.
fn log_tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().rev().take(5).collect();
    let tail: Vec<&str> = lines.into_iter().rev().collect();
    if tail.is_empty() {
        "(empty)".into()
    } else {
        tail.join(" | ")
    }
}

struct Undo<'a> {
    backend: &'a MicrovmBackend,
    armed: bool,
    dir: Option<PathBuf>,
    kept: Option<PathBuf>,
    slot: Option<Slot>,
    cgroup: Option<SandboxCgroup>,
    link: Option<String>,
    pid: Option<i32>,
}

impl<'a> Undo<'a> {
    fn new(backend: &'a MicrovmBackend) -> Self {
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
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
        if let Some(cg) = self.cgroup.take() {
            for p in cg.pids() {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(p),
                    nix::sys::signal::Signal::SIGKILL,
                );
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
        if let Some(link) = self.link.take() {
            let _ = std::process::Command::new("ip")
                .args(["link", "del", &link])
                .stderr(std::process::Stdio::null())
                .status();
        }
        if let Some(slot) = self.slot {
            self.backend.pool.release(slot);
        }
        if let Some(dir) = &self.dir {
            if let Some(kept) = &self.kept {
                if let Err(e) = std::fs::rename(dir, kept) {
                    tracing::warn!(path = %kept.display(), error = %e, "returning a kept snapshot after a failed create");
                }
            } else {
                let _ = std::fs::remove_dir_all(dir);
            }
        }
    }
}

#[async_trait]
impl SandboxBackend for MicrovmBackend {
    fn kind(&self) -> &'static str {
        "microvm"
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
        sbx.client.pause().await.map_err(setup)?;
        let snap = sbx.dir.join("snapshot");
        let staging = sbx.dir.join(".snapshot.tmp");
        let _ = std::fs::remove_dir_all(&staging);
        let taken = sbx
            .client
            .snapshot(&staging, SnapshotKind::Full, self.cfg.snapshot_timeout)
            .await;
        if let Err(e) = taken {
            // The VM keeps running: nothing is lost.
            let _ = sbx.client.resume().await;
            let _ = std::fs::remove_dir_all(&staging);
            return Err(setup(e));
        }
        let _ = std::fs::remove_dir_all(&snap);
        if let Err(e) = std::fs::rename(&staging, &snap) {
            let _ = sbx.client.resume().await;
            let _ = std::fs::remove_dir_all(&staging);
            return Err(BackendError::io(
                format!("publishing {}", snap.display()),
                e,
            ));
        }
        self.stop_vmm(&sbx, true).await?;
        sbx.info.lock().unwrap_or_else(|e| e.into_inner()).state = SandboxState::Paused;
        tracing::debug!(id, snapshot = %snap.display(), "microVM paused into a snapshot");
        Ok(())
    }

    async fn resume(&self, id: &str) -> Result<SandboxInfo, BackendError> {
        let sbx = self.sandboxes.ready(id)?;
        let _op = sbx.op.lock().await;
        if sbx.info.lock().unwrap_or_else(|e| e.into_inner()).state == SandboxState::Paused {
            let snap = sbx.dir.join("snapshot");
            // A duplicate of the namespace descriptor: the lock is not held across awaits.
            let netns = {
                let net = sbx.net.lock().unwrap_or_else(|e| e.into_inner());
                let n = net
                    .as_ref()
                    .ok_or_else(|| setup(format!("sandbox {id} lost its network namespace")))?;
                n.netns
                    .try_clone()
                    .map_err(|e| BackendError::io("duplicating the namespace descriptor", e))?
            };
            let vmm = self
                .spawn_vmm(&sbx.dir, &netns, &sbx.cgroup, Some(&snap), &sbx.client)
                .await?;
            let pid = vmm.pid;
            *sbx.vmm.lock().unwrap_or_else(|e| e.into_inner()) = Some(vmm);
            if let Some(mut st) = read_state(&sbx.dir) {
                st.pid = Some(pid);
                write_json(&sbx.dir.join("state.json"), &st)?;
            }
            let _ = std::fs::remove_dir_all(&snap);
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
        Ok(KeptState { path })
    }

    async fn snapshot(&self, id: &str, dir: &Path) -> Result<SnapshotCapture, BackendError> {
        let sbx = self.sandboxes.ready(id)?;
        let _op = sbx.op.lock().await;
        let state = sbx.info.lock().unwrap_or_else(|e| e.into_inner()).state;
        if state != SandboxState::Running {
            return Err(BackendError::InvalidState {
                id: id.to_string(),
                state,
                needed: SandboxState::Running,
            });
        }
        sbx.client.pause().await.map_err(setup)?;
        // While the vCPUs are parked the disk and the memory agree.
        let captured = async {
            sbx.client
                .snapshot(dir, SnapshotKind::Full, self.cfg.snapshot_timeout)
                .await
                .map_err(setup)?;
            copy_sparse(&sbx.dir.join(ROOTFS_FILE), &dir.join(ROOTFS_FILE)).await?;
            let st = read_state(&sbx.dir).ok_or_else(|| {
                setup(format!(
                    "{} is unreadable",
                    sbx.dir.join("state.json").display()
                ))
            })?;
            write_json(&dir.join("state.json"), &st)
        }
        .await;
        let resumed = sbx.client.resume().await.map_err(setup);
        captured?;
        resumed?;
        tracing::debug!(id, dir = %dir.display(), "microVM captured");
        Ok(SnapshotCapture {
            backend: "microvm".into(),
            files: CAPTURE_FILES.iter().map(|f| f.to_string()).collect(),
        })
    }

    async fn import_snapshot(
        &self,
        capture: &SnapshotCapture,
        dir: &Path,
    ) -> Result<KeptState, BackendError> {
        let missing: Vec<&&str> = CAPTURE_FILES
            .iter()
            .filter(|f| !capture.files.iter().any(|c| c == **f))
            .collect();
        if capture.backend != "microvm" || !missing.is_empty() {
            return Err(BackendError::BadKeptState {
                path: dir.to_path_buf(),
                reason: format!(
                    "it was taken by the {} backend, not by a microVM (files {:?})",
                    capture.backend, capture.files
                ),
            });
        }
        let nonce: u64 = rand::random();
        let path = self.kept_dir.join(format!("snapshot.{nonce:016x}"));
        let snap = path.join("snapshot");
        std::fs::create_dir_all(&snap)
            .map_err(|e| BackendError::io(format!("creating {}", snap.display()), e))?;
        let moved = async {
            for f in [STATE_FILE, MEMORY_FILE] {
                move_file(&dir.join(f), &snap.join(f)).await?;
            }
            for f in [ROOTFS_FILE, "state.json"] {
                move_file(&dir.join(f), &path.join(f)).await?;
            }
            Ok::<(), BackendError>(())
        }
        .await;
        if let Err(e) = moved {
            let _ = std::fs::remove_dir_all(&path);
            return Err(e);
        }
        Ok(KeptState { path })
    }

    async fn discard_kept(&self, kept: &KeptState) -> Result<(), BackendError> {
        if !kept.path.exists() {
            return Ok(());
        }
        self.check_kept(kept)?;
        remove_dir(&kept.path).map_err(setup)
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
        if let Ok(entries) = std::fs::read_dir(&self.kept_dir) {
            for entry in entries.flatten() {
                let path = entry.path();
                if kept.iter().any(|k| k.path == path) {
                    continue;
                }
                match remove_dir(&path) {
                    Ok(()) => report
                        .removed_other
                        .push(format!("kept snapshot {}", path.display())),
                    Err(e) => tracing::warn!(error = %e, "removing an unreferenced kept snapshot"),
                }
            }
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pids_are_formatted_without_allocating() {
        let mut buf = [0u8; 24];
        assert_eq!(format_pid(0, &mut buf), b"0");
        assert_eq!(format_pid(4194304, &mut buf), b"4194304");
    }

    #[test]
    fn availability_names_what_is_missing() {
        let dir = tempfile::tempdir().unwrap();
        let present = dir.path().join("present");
        std::fs::write(&present, b"x").unwrap();
        let absent = dir.path().join("absent");
        let r = unavailable_reason_at(&absent, &absent, &present, &present).unwrap();
        assert!(r.contains("has no KVM"), "{r}");
        let r = unavailable_reason_at(&present, &present, &present, &present).unwrap();
        assert!(r.contains("kvm_pvm"), "{r}");
        let r = unavailable_reason_at(&present, &absent, &absent, &present).unwrap();
        assert!(r.contains("AENV_GUEST_KERNEL_PATH"), "{r}");
        let r = unavailable_reason_at(&present, &absent, &present, &absent).unwrap();
        assert!(r.contains("AENV_VMM_BINARY_PATH"), "{r}");
        assert_eq!(
            unavailable_reason_at(&present, &absent, &present, &present),
            None
        );
    }
}
