//! The `jail` backend: sandboxes as process trees in Linux namespaces, without a VM.
//!
//! A sandbox is a slot of the [`SandboxHost`] (its directory, an id range, an address with
//! a network namespace, a cgroup with a device allow-list) plus its PID 1: the guest agent
//! in init mode, started by [`spawn`] in new mount, PID, UTS, IPC and cgroup namespaces,
//! on an overlay root, and then moved into its own user namespace where it is root
//! while being the range's base uid on the host. Its directory
//! `<data>/jail/sandboxes/<id>/` holds:
//! * `upper/` and `work/`, the overlay's writable layer, owned by the sandbox's ids;
//! * `lower/`, where the template is attached id-mapped into the sandbox's range (so the
//!   template, owned by host root on disk, is owned by root inside);
//! * `root/`, the overlay's mount point, and `state.json`.
//!
//! PID 1's stdout and stderr are a pipe the node reads into the sandbox's log
//! ([`crate::observe`]): lines cut, escapes removed, held to a rate budget, the log
//! capped on disk; the tenant can write there (as root inside it reaches the agent's
//! descriptors) but cannot grow anything of the node's.
//!
//! The root and every mount the tenant can write to are `nodev,nosuid`; /dev holds the
//! host's standard device nodes bound in ([`spawn::STANDARD_DEVICES`]), which is all the
//! device cgroup allows; capabilities are cut to [`spawn::KEPT_CAPABILITIES`] (scoped to
//! the user namespace); `no_new_privs`, the seccomp allow-list of [`agentenv_seccomp`]
//! and per-process limits
//! ([`spawn::SANDBOX_RLIMITS`]) apply to every process.
//!
//! A sandbox's writable layer outlives it when [`SandboxBackend::keep`] moves `upper/` and
//! `work/` to `<data>/jail/kept/<id>.<nonce>/`; a create whose spec names that directory
//! builds its overlay on it instead of on empty directories. The node writes into a
//! layer only through [`layer`], which never follows the tenant's links.
//!
//! Pause freezes the cgroup; resume thaws it. Destroy kills PID 1 (the kernel kills the
//! rest of the PID namespace) and gives the slot back.
//!
//! The backend's configuration ([`JailConfig`] and its defaults) is in `config`,
//! re-exported here. What the jail shares with the microvm backend is the
//! [`HostedBackend`]; [`JailRuntime`] is what is its own.
//!
//! [`SandboxBackend::keep`]: crate::backend::SandboxBackend::keep

mod config;
mod export;
mod fork;
pub mod layer;
pub mod snapshot;

use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use nix::sys::signal::{Signal, kill};
use nix::sys::wait::WaitStatus;
use nix::unistd::Pid;
use tokio::sync::watch;

use super::{BackendError, DiskUsage, KeptState, ReconcileReport, SandboxSpec, SnapshotCapture};
use crate::config::BackendKind;
use crate::host::cgroup::Limits;
use crate::host::disk::{self, LayerPool, MountOptions, MountedLayer};
use crate::host::{
    HostedBackend, HostedConfig, HostedSandbox, Runtime, SandboxHost, setup, spawn, watch_exit,
};
use crate::observe::output::{Feed, agent_level, pump_pipe};
use crate::template::Progress;
use crate::timing::{self, Lap};

pub use config::{
    DEFAULT_DISK_SIZE_MB, DEFAULT_LAYER_POOL_SIZE, DEFAULT_NET_POOL_SIZE, JailConfig,
};

/// Where the agent binary appears inside every sandbox.
pub const AGENT_GUEST_PATH: &str = "/agentenv/agentenv-guest";

/// The variable naming the descriptor of the listening socket the agent is given (it
/// serves that socket instead of binding its own; see [`spawn::Listen`]).
pub const AGENT_LISTEN_FD_ENV: &str = agentenv_guest::LISTEN_FD_ENV;

/// The directory of a sandbox (or kept layer) that holds the layer's image and mount.
const DISK_DIR: &str = "disk";

/// Where the writable layer of the sandbox directory `dir` is mounted.
pub fn layer_mount(dir: &Path) -> PathBuf {
    dir.join(DISK_DIR).join(disk::LAYER_DIR)
}

/// The jail backend: a [`HostedBackend`] whose sandboxes are run by a [`JailRuntime`].
pub type JailBackend = HostedBackend<JailRuntime>;

/// What runs jail sandboxes: the agent as PID 1 of a process tree on an overlay root
/// over a writable layer of its own.
pub struct JailRuntime {
    cfg: JailConfig,
    /// Blank layer file systems, one per size.
    blank_dir: PathBuf,
    layers: Option<Arc<LayerPool>>,
    filters: Arc<Vec<seccompiler::BpfProgram>>,
}

/// What a jail sandbox holds besides its host slot.
pub struct Pid1 {
    pid: Pid,
    /// The writable layer's file system (unmounted when the sandbox goes).
    layer: Mutex<Option<MountedLayer>>,
    exited: watch::Receiver<Option<WaitStatus>>,
}

type Sandbox = HostedSandbox<Pid1>;

impl JailBackend {
    /// Checks the host (id-mapped mounts, cgroups), prepares directories, cgroup parents,
    /// the address and id pools and the host firewall rules.
    pub async fn new(cfg: JailConfig) -> Result<Self, BackendError> {
        if !cfg.agent_binary.is_file() {
            return Err(setup(format!(
                "the agent binary {} does not exist: build it (agentenv-guest/build-static.sh) and set the jail's agent_binary",
                cfg.agent_binary.display()
            )));
        }
        std::fs::create_dir_all(&cfg.templates.root).map_err(|e| {
            BackendError::io(format!("creating {}", cfg.templates.root.display()), e)
        })?;
        let host = SandboxHost::new(cfg.host()).await?;
        // The template root is mounted id-mapped into each sandbox's range.
        crate::host::ids::check_idmapped_mounts(
            &cfg.templates.root,
            crate::host::ids::IdRange {
                base: cfg.id_pool.first,
            },
        )
        .map_err(|e| setup(format!("the jail cannot run on this host: {e}")))?;
        let filters = Arc::new(agentenv_seccomp::sandbox_filters().map_err(setup)?);
        let blank_dir = cfg.data_dir.join("jail").join("blank");
        disk::check_size(cfg.disk_size_mb).map_err(|e| setup(format!("disk_size_mb: {e}")))?;
        // Writable layers are mounted beneath: their unmounts must reach the copies a
        // mount namespace made meanwhile on this host holds.
        disk::make_shared_mount(&cfg.data_dir.join("jail")).map_err(setup)?;
        let layers = if cfg.layer_pool_size > 0 {
            let (dir, blank, mb, n) = (
                cfg.data_dir
                    .join("jail")
                    .join("layerpool")
                    .join(format!("{:016x}", rand::random::<u64>())),
                blank_dir.clone(),
                cfg.disk_size_mb,
                cfg.layer_pool_size,
            );
            let pool = tokio::task::spawn_blocking(move || {
                LayerPool::start(&dir, &blank, mb, n, MountOptions::default())
            })
            .await
            .map_err(|e| setup(format!("layer pool task: {e}")))?
            .map_err(setup)?;
            Some(Arc::new(pool))
        } else {
            // Formats the default blank now: a host without mkfs.ext4 fails at start.
            let (blank, mb) = (blank_dir.clone(), cfg.disk_size_mb);
            tokio::task::spawn_blocking(move || disk::ensure_blank(&blank, mb))
                .await
                .map_err(|e| setup(format!("blank layer task: {e}")))?
                .map_err(setup)?;
            None
        };
        tracing::info!(
            cgroup = host.hierarchy().version(),
            pool = %cfg.address_pool,
            ids = %cfg.id_pool,
            data = %cfg.data_dir.display(),
            "jail backend ready"
        );
        let runtime = JailRuntime {
            cfg,
            blank_dir,
            layers,
            filters,
        };
        Ok(Self::assemble(runtime, host))
    }

    fn cfg(&self) -> &JailConfig {
        &self.runtime.cfg
    }

    /// PID 1 of a sandbox, as seen from the host.
    pub fn pid(&self, id: &str) -> Option<i32> {
        self.sandboxes.ready(id).ok().map(|s| s.run.pid.as_raw())
    }

    /// What the pool of ready writable layers did so far (`None`: no pool).
    pub fn layer_pool_stats(&self) -> Option<disk::LayerPoolStats> {
        self.runtime.layers.as_ref().map(|p| p.stats())
    }

    /// Where a sandbox's writable layer is mounted while it exists.
    pub fn layer_mount(&self, id: &str) -> PathBuf {
        layer_mount(&self.sandbox_dir(id))
    }

    /// Releases what the backend holds apart from its sandboxes: the pooled network
    /// namespaces and their addresses (waiting until the kernel has removed their links),
    /// and the pooled writable layers, once the deleted sandboxes are cleaned up (waiting
    /// at most the operation timeout for that). Creates after this make them themselves.
    pub async fn shutdown(&self) {
        if !self.host.cleanups().drain(self.cfg().op_timeout).await {
            tracing::warn!(
                pending = self.host.cleanups().pending(),
                "deleted sandboxes still being cleaned up; the next start removes what is left"
            );
        }
        self.host.shutdown().await;
        if let Some(pool) = self.runtime.layers.clone() {
            let _ = tokio::task::spawn_blocking(move || pool.shutdown()).await;
        }
    }

    /// The size of a sandbox's writable layer, checked.
    fn disk_size(&self, spec: &SandboxSpec) -> Result<u64, BackendError> {
        disk::check_size(spec.disk_size_mb.unwrap_or(self.cfg().disk_size_mb))
            .map_err(|e| BackendError::InvalidLimits(format!("diskSizeMB: {e}")))
    }

    /// Mounts the writable layer of the sandbox directory `dir`: its kept image, else one
    /// from the pool, else a new one of `size_mb`. A kept layer of the older layout
    /// (`upper/` and `work/` as plain directories) moves onto a new image.
    fn open_layer(
        dir: &Path,
        blank: &Path,
        size_mb: u64,
        pool: Option<&LayerPool>,
    ) -> Result<MountedLayer, BackendError> {
        let disk_err = |e: disk::DiskError| setup(format!("the writable layer: {e}"));
        let disk_dir = dir.join(DISK_DIR);
        let image = disk_dir.join(disk::LAYER_IMAGE);
        if image.exists() {
            return disk::mount_layer(&image, &disk_dir.join(disk::LAYER_DIR)).map_err(disk_err);
        }
        let pooled = match pool {
            Some(p) if p.size_mb() == size_mb => p.take(&disk_dir).map_err(disk_err)?,
            _ => None,
        };
        let layer = match pooled {
            Some(l) => l,
            None => {
                std::fs::create_dir_all(&disk_dir)
                    .map_err(|e| BackendError::io(format!("creating {}", disk_dir.display()), e))?;
                disk::create_layer_image(blank, size_mb, &image).map_err(disk_err)?;
                disk::mount_layer(&image, &disk_dir.join(disk::LAYER_DIR)).map_err(disk_err)?
            }
        };
        let legacy = dir.join("upper");
        if legacy.is_dir() {
            if let Err(e) = snapshot::move_legacy_layer(dir, &layer.upper()) {
                let _ = layer.discard();
                return Err(e);
            }
        }
        Ok(layer)
    }

    fn check_limits(&self, spec: &SandboxSpec) -> Result<Limits, BackendError> {
        self.host.check_cpus_and_memory(spec)?;
        let memory_bytes = spec.memory_mb.saturating_mul(1 << 20);
        let max_processes = spec
            .max_processes
            .unwrap_or(self.cfg().default_max_processes);
        if max_processes == 0 {
            return Err(BackendError::InvalidLimits(
                "the process limit must be at least 1".into(),
            ));
        }
        self.disk_size(spec)?;
        Ok(Limits {
            cpus: spec.cpu_count,
            memory_bytes,
            max_processes,
        })
    }

    /// Starts the sandbox of `spec` on the template root `lower`.
    async fn start_on(
        &self,
        spec: &SandboxSpec,
        limits: Limits,
        lower: &Path,
    ) -> Result<Sandbox, BackendError> {
        // The claim records its own phases (dir, ids, netns, egress, cgroup).
        let mut claim = self.host.claim(spec, limits).await?;
        let mut phases = Lap::new();
        let dir = claim.dir().to_path_buf();
        let ids = claim.ids();
        // The writable layer: unmounted again if the create fails (after its processes
        // are gone, before the directory is removed).
        let layer_cell: Arc<Mutex<Option<MountedLayer>>> = Arc::new(Mutex::new(None));
        let cell = layer_cell.clone();
        claim.on_undo(move || {
            if let Some(l) = cell.lock().unwrap_or_else(|e| e.into_inner()).take()
                && let Err(e) = l.discard()
            {
                tracing::warn!(error = %e, "unmounting the layer of a failed create");
            }
        });
        let (d, blank, mb, pool) = (
            dir.clone(),
            self.runtime.blank_dir.clone(),
            self.disk_size(spec)?,
            self.runtime.layers.clone(),
        );
        let layer =
            tokio::task::spawn_blocking(move || Self::open_layer(&d, &blank, mb, pool.as_deref()))
                .await
                .map_err(|e| setup(format!("layer task: {e}")))??;
        let (upper, work) = (layer.upper(), layer.work());
        *layer_cell.lock().unwrap_or_else(|e| e.into_inner()) = Some(layer);
        phases.mark("layer");
        let (root, lower_mount) = (dir.join("root"), dir.join("lower"));
        let guest = layer::GuestFiles {
            hostname: &spec.id,
            ip: claim.slot().sandbox_ip(),
            dns: self.host.dns(),
            agent_path: AGENT_GUEST_PATH,
        };
        let (u, w) = (upper.clone(), work.clone());
        let fresh = spec.kept.is_none();
        let guest_files = guest.render();
        tokio::task::spawn_blocking(move || layer::prepare(&u, &w, ids, fresh, &guest_files))
            .await
            .map_err(|e| setup(format!("layer task: {e}")))??;
        for d in [&root, &lower_mount] {
            std::fs::create_dir_all(d)
                .map_err(|e| BackendError::io(format!("creating {}", d.display()), e))?;
        }
        phases.mark("prepare");
        // PID 1's stdout and stderr: a pipe the node reads into the sandbox's log (cut,
        // cleaned and rate-limited: every byte is the tenant's).
        let (out_read, out_write) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)
            .map_err(|e| BackendError::io("creating the agent's output pipe", e.into()))?;
        phases.mark("pipe");
        let userns = ids
            .user_namespace()
            .map_err(|e| setup(format!("the sandbox's user namespace: {e}")))?;
        phases.mark("userns");

        let slot = claim.slot();
        let mut state = crate::host::StateFile {
            id: spec.id.clone(),
            template: spec.template.clone(),
            pid: None,
            host_if: claim.host_if().to_string(),
            slot: slot.network,
            created_at: 0,
            id_base: Some(ids.base),
            cpu_count: None,
            memory_mb: None,
        };
        state.write(&dir)?;
        phases.mark("state");

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
            netns: claim.net().netns.as_fd(),
            cgroup_procs: claim.cgroup().join_files(),
            hostname: &spec.id,
            root: spawn::Root::Overlay {
                lower,
                lower_mount: &lower_mount,
                upper: &upper,
                work: &work,
                root: &root,
                base_id: ids.base,
                agent_host_path: &self.cfg().agent_binary,
                agent_guest_path: AGENT_GUEST_PATH,
                volumes: &spec.volumes,
            },
            identity: spawn::Identity::UserNs(userns.as_fd()),
            program: spawn::Program::Inside(AGENT_GUEST_PATH),
            args: &self.cfg().agent_args,
            env,
            log: out_write.as_fd(),
            filters: self.runtime.filters.as_ref().clone(),
            rlimits: spawn::SANDBOX_RLIMITS,
            umask: 0o022,
            // The agent's listener exists once the spawn returns: the node's first
            // `GET /health` waits in its backlog instead of polling for it.
            listen: self.cfg().agent_listener.then_some(spawn::Listen {
                addr: std::net::SocketAddrV4::new(
                    std::net::Ipv4Addr::UNSPECIFIED,
                    self.cfg().agent_port,
                ),
                env: AGENT_LISTEN_FD_ENV,
            }),
        })
        .map_err(setup)?;
        phases.mark("plan");
        let (pid, queued) = tokio::task::spawn_blocking(move || {
            let started = std::time::Instant::now();
            let r = spawn::spawn(&plan);
            drop(plan);
            drop(userns);
            (r, started)
        })
        .await
        .map_err(|e| setup(format!("spawn task: {e}")))?;
        let pid = pid.map_err(volume_error)?;
        drop(out_write);
        if let Some(log) = self.cfg().sandbox_logs.open(&spec.id) {
            let feed = Feed::new(log.clone(), &[("source", "agent")], agent_level);
            log.attach(tokio::spawn(pump_pipe(out_read, feed)).abort_handle());
        }
        phases.split("queue", queued);
        phases.mark("spawn");
        claim.set_pid(pid.as_raw());
        let exited = watch_exit(pid).map_err(|e| BackendError::io("watching PID 1", e))?;
        let host = claim.commit();
        state.pid = Some(pid.as_raw());
        state.created_at = host
            .created_at
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        if let Err(e) = state.write(&dir) {
            // The sandbox runs; reconciliation finds it by its directory either way.
            tracing::warn!(id = %spec.id, error = %e, "updating state.json");
        }
        phases.mark("watch");
        if let Some(t) = timing::snapshot() {
            tracing::debug!(id = %spec.id, pid = pid.as_raw(), ip = %host.ip(), ids = ids.base, phases = %t, "sandbox started");
        }
        let layer = layer_cell.lock().unwrap_or_else(|e| e.into_inner()).take();
        Ok(self.running(
            spec,
            host,
            Pid1 {
                pid,
                layer: Mutex::new(layer),
                exited,
            },
        ))
    }
}

/// Kills every process of a sandbox: its PID 1 (whose end takes its PID namespace with
/// it), then whatever is left in its cgroup (thawed first: frozen processes die only once
/// thawed). Nothing a tenant does delays this: SIGKILL cannot be caught, and the cgroup
/// is frozen while it is emptied, so nothing forks meanwhile.
async fn kill_processes(host: &SandboxHost, sbx: &Sandbox) -> Result<(), BackendError> {
    let timeout = host.config().hosted.op_timeout;
    let _ = kill(sbx.run.pid, Signal::SIGKILL);
    if sbx.host.cgroup.is_frozen() {
        let _ = sbx.host.cgroup.thaw(timeout).await;
    }
    let mut exited = sbx.run.exited.clone();
    let _ = tokio::time::timeout(timeout, exited.wait_for(|s| s.is_some())).await;
    host.stop_processes(&sbx.host).await
}

/// Kills a sandbox and gives back all it holds, except its writable layer when `keep`
/// names where to move it. Every step runs; errors are collected.
async fn teardown(
    host: &SandboxHost,
    sbx: &Sandbox,
    keep: Option<&Path>,
) -> Result<(), BackendError> {
    // The layer's file system outlives the sandbox's mount namespace only as long as a
    // process of it does.
    let mut errors = Vec::new();
    if let Err(e) = kill_processes(host, sbx).await {
        errors.push(e.to_string());
    }
    let layer = sbx
        .run
        .layer
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .take();
    if let Some(layer) = layer {
        let durable = keep.is_some();
        let r = tokio::task::spawn_blocking(move || {
            if durable {
                layer.unmount()
            } else {
                layer.discard()
            }
        })
        .await;
        match r {
            Ok(Ok(())) => {}
            Ok(Err(e)) => errors.push(format!("unmounting the writable layer: {e}")),
            Err(e) => errors.push(format!("layer task: {e}")),
        }
    }
    let keep_fn = keep.map(|kept| move |dir: &Path| layer::keep(dir, kept));
    if let Err(e) = host
        .release(
            &sbx.host,
            keep_fn.as_ref().map(|f| f as &crate::host::DirHook<'_>),
        )
        .await
    {
        errors.push(e.to_string());
    }
    tracing::debug!(dir = %sbx.host.dir.display(), "sandbox destroyed");
    if errors.is_empty() {
        Ok(())
    } else {
        Err(setup(errors.join("; ")))
    }
}

/// Unmounts the writable layer a leftover sandbox directory still has mounted.
fn unmount_leftover_layer(dir: &Path) -> Result<(), String> {
    disk::unmount_leftover(&layer_mount(dir))
        .map(|_| ())
        .map_err(|e| e.to_string())
}

/// A failed spawn as a backend error: a volume that cannot be mounted at its path names
/// the path and what to change (the client's to fix), anything else is the host's.
fn volume_error(e: spawn::SpawnError) -> BackendError {
    use nix::errno::Errno;
    let spawn::SpawnError::Volume { path, errno } = &e else {
        return setup(e);
    };
    let why = match errno {
        Errno::ELOOP => {
            "a component of the path is a symbolic link in the sandbox; mount at the path it points to"
        }
        Errno::ENOTDIR | Errno::EEXIST => {
            "a component of the path is not a directory in the sandbox; choose another path"
        }
        Errno::EXDEV => "the path crosses a mount of the sandbox; choose another path",
        Errno::EINVAL | Errno::EPERM | Errno::EOPNOTSUPP => {
            return setup(format!(
                "{e}: the file system holding the volumes does not support id-mapped mounts (ext4, xfs, btrfs and tmpfs do; NFS does not)"
            ));
        }
        _ => return setup(e),
    };
    BackendError::BadVolumeMount(format!("volume mount path {path}: {why}"))
}

#[async_trait]
impl Runtime for JailRuntime {
    const KIND: BackendKind = BackendKind::Jail;
    /// The writable layer's file system image.
    const KEPT_FILES: &'static [&'static str] = &["disk/layer.img"];
    type Run = Pid1;

    fn config(&self) -> &HostedConfig {
        &self.cfg
    }

    fn admit(b: &JailBackend, spec: &mut SandboxSpec) -> Result<Limits, BackendError> {
        let limits = b.check_limits(spec)?;
        if let Some(kept) = &spec.kept {
            Self::check_kept(b, kept)?;
        }
        Ok(limits)
    }

    async fn start(
        b: &JailBackend,
        spec: &SandboxSpec,
        limits: Limits,
        progress: Progress,
    ) -> Result<Sandbox, BackendError> {
        let started = std::time::Instant::now();
        let template = b.template(&spec.template, progress).await?;
        timing::record("template", started.elapsed());
        b.start_on(spec, limits, &template.rootfs).await
    }

    /// Freezes the cgroup.
    async fn pause(b: &JailBackend, sbx: &Sandbox) -> Result<(), BackendError> {
        sbx.host
            .cgroup
            .freeze(b.cfg().op_timeout)
            .await
            .map_err(setup)
    }

    /// Thaws the cgroup.
    async fn resume(b: &JailBackend, sbx: &Sandbox) -> Result<(), BackendError> {
        sbx.host
            .cgroup
            .thaw(b.cfg().op_timeout)
            .await
            .map_err(setup)
    }

    async fn teardown(
        b: &JailBackend,
        sbx: &Sandbox,
        keep: Option<&Path>,
    ) -> Result<(), BackendError> {
        teardown(&b.host, sbx, keep).await
    }

    const DEFERRED_CLEANUP: bool = true;

    /// Every process of the sandbox gets SIGKILL while none can fork (the cgroup frozen,
    /// or `cgroup.kill`): none runs user code again. Waiting for them to exit (the
    /// kernel tearing down their PID and mount namespaces) is the cleanup's.
    async fn kill(b: &JailBackend, sbx: &Sandbox) -> Result<(), BackendError> {
        sbx.host
            .kill_all(Some(sbx.run.pid), b.cfg().op_timeout)
            .await
    }

    async fn cleanup(host: &SandboxHost, sbx: &Sandbox) -> Result<(), BackendError> {
        teardown(host, sbx, None).await
    }

    fn clean_dir(dir: &Path) -> Result<(), String> {
        unmount_leftover_layer(dir)
    }

    async fn capture(
        b: &JailBackend,
        sbx: &Sandbox,
        dir: &Path,
    ) -> Result<SnapshotCapture, BackendError> {
        b.capture(sbx, dir).await
    }

    async fn capture_kept(
        b: &JailBackend,
        kept: &KeptState,
        dir: &Path,
    ) -> Result<SnapshotCapture, BackendError> {
        b.capture_kept_layer(kept, dir).await
    }

    async fn import(
        b: &JailBackend,
        capture: &SnapshotCapture,
        dir: &Path,
    ) -> Result<KeptState, BackendError> {
        b.import(capture, dir).await
    }

    async fn fork(b: &JailBackend, sbx: &Sandbox) -> Result<KeptState, BackendError> {
        b.fork_layer(sbx).await
    }

    async fn copy_kept(
        b: &JailBackend,
        kept: &KeptState,
        count: usize,
    ) -> Result<Vec<KeptState>, BackendError> {
        b.copy_kept_layer(kept, count).await
    }

    /// A kept layer: its image, or the plain directories of the older layout.
    fn check_kept(b: &JailBackend, kept: &KeptState) -> Result<(), BackendError> {
        if b.host.check_kept(kept, Self::KEPT_FILES).is_ok() {
            return Ok(());
        }
        b.host.check_kept(kept, &["upper", "work"])
    }

    async fn reconcile(
        b: &JailBackend,
        kept: &[KeptState],
    ) -> Result<ReconcileReport, BackendError> {
        // A layer still mounted in a leftover directory goes before the directory.
        let mut report = b
            .host
            .reconcile(&b.sandboxes.ids(), kept, Some(&unmount_leftover_layer))
            .await?;
        if let Some(pool) = &b.runtime.layers {
            let own = pool.dir().to_path_buf();
            let removed = tokio::task::spawn_blocking(move || {
                own.parent()
                    .map(|dir| LayerPool::leftovers(dir, &own))
                    .unwrap_or_default()
            })
            .await
            .unwrap_or_default();
            report.removed_other.extend(removed);
        }
        Ok(report)
    }

    /// The layer's file system: its space in use and its capacity.
    fn disk_usage(_b: &JailBackend, sbx: &Sandbox) -> Option<DiskUsage> {
        let layer = sbx.run.layer.lock().unwrap_or_else(|e| e.into_inner());
        let u = disk::layer_usage(layer.as_ref()?.mountpoint()).ok()?;
        Some(DiskUsage {
            used_bytes: u.used_bytes,
            total_bytes: u.total_bytes,
        })
    }

    /// The pooled layers and the data directory's own mount go: nothing of the backend
    /// stays mounted (a later backend on the directory makes them again).
    fn release_unused(&mut self) {
        if let Some(pool) = self.layers.take() {
            pool.shutdown();
        }
        let dir = self.cfg.data_dir.join("jail");
        if let Err(e) = disk::remove_shared_mount_if_unused(&dir) {
            tracing::warn!(dir = %dir.display(), error = %e, "unmounting the jail directory");
        }
    }
}
