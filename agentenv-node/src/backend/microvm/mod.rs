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
//!
//! The backend's configuration ([`MicrovmConfig`], [`unavailable_reason`]) is in `config`,
//! re-exported here; `vm` checks a spec's limits and builds the VM configuration of a
//! sandbox.
//! What the backend shares with the jail is the [`HostedBackend`]; [`MicrovmRuntime`] is
//! what is its own.
//!
//! [`SandboxBackend::snapshot`]: crate::backend::SandboxBackend::snapshot
//! [`SandboxBackend::import_snapshot`]: crate::backend::SandboxBackend::import_snapshot

mod config;
pub mod jail;
pub mod net;
mod vm;

use std::os::fd::AsFd;
use std::path::Path;
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use agentenv_vmm::control::{SnapshotKind, VmmClient};
use agentenv_vmm::snapshot::{MEMORY_FILE, STATE_FILE};
use async_trait::async_trait;

use nix::sys::signal::{Signal, kill};
use nix::sys::wait::WaitStatus;
use nix::unistd::Pid;
use tokio::sync::watch;

use self::jail::Jail;

use super::{BackendError, DiskUsage, KeptState, SandboxSpec, SnapshotCapture};
use crate::config::BackendKind;
use crate::host::cgroup::{Limits, SandboxCgroup};
use crate::host::ids::IdRange;
use crate::host::{
    HostedBackend, HostedConfig, HostedSandbox, Runtime, SandboxHost, StateFile, foreign_capture,
    setup, spawn, watch_exit, write_json,
};
use crate::template::{Progress, image};

pub use config::{DEFAULT_BOOT_ARGS, MicrovmConfig, unavailable_reason};

/// The sandbox's disk in its directory (and in captures).
const ROOTFS_FILE: &str = "rootfs.ext4";

/// The files of a capture ([`SandboxBackend::snapshot`]).
///
/// [`SandboxBackend::snapshot`]: crate::backend::SandboxBackend::snapshot
const CAPTURE_FILES: &[&str] = &[STATE_FILE, MEMORY_FILE, ROOTFS_FILE, "state.json"];

/// Longest unix socket path.
const MAX_SOCKET_PATH: usize = 107;

/// A running VMM process.
struct VmmProcess {
    pid: i32,
    exited: watch::Receiver<Option<WaitStatus>>,
}

/// The microvm backend: a [`HostedBackend`] whose sandboxes are run by a
/// [`MicrovmRuntime`].
pub type MicrovmBackend = HostedBackend<MicrovmRuntime>;

/// What runs microVM sandboxes: a jailed VMM process each.
pub struct MicrovmRuntime {
    cfg: MicrovmConfig,
}

/// What a microVM sandbox holds besides its host slot.
pub struct Vmm {
    /// The VMM process, while one runs (not while paused).
    process: Mutex<Option<VmmProcess>>,
    client: VmmClient,
}

type Sandbox = HostedSandbox<Vmm>;

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
        for (what, p) in [
            ("agent binary", &cfg.agent_binary),
            ("VMM binary", &cfg.vmm_binary),
            ("guest kernel", &cfg.kernel),
        ] {
            if !p.is_file() {
                return Err(setup(format!("the {what} {} does not exist", p.display())));
            }
        }
        std::fs::create_dir_all(&cfg.image_dir)
            .map_err(|e| BackendError::io(format!("creating {}", cfg.image_dir.display()), e))?;
        let host = SandboxHost::new(cfg.host()).await?;
        tracing::info!(
            kernel = %cfg.kernel.display(),
            vmm = %cfg.vmm_binary.display(),
            cgroup = host.hierarchy().version(),
            pool = %cfg.address_pool,
            "microvm backend ready"
        );
        Ok(Self::assemble(MicrovmRuntime { cfg }, host))
    }

    fn cfg(&self) -> &MicrovmConfig {
        &self.runtime.cfg
    }

    /// The PID of a sandbox's VMM process, while one runs.
    pub fn vmm_pid(&self, id: &str) -> Option<i32> {
        let sbx = self.sandboxes.ready(id).ok()?;
        let vmm = sbx.run.process.lock().unwrap_or_else(|e| e.into_inner());
        vmm.as_ref().map(|v| v.pid)
    }

    /// The control client of a sandbox's VMM.
    pub fn vmm_client(&self, id: &str) -> Option<VmmClient> {
        self.sandboxes.ready(id).ok().map(|s| s.run.client.clone())
    }

    /// Runs `program` with `args` inside a sandbox's network namespace; its output.
    pub fn run_in_sandbox(
        &self,
        id: &str,
        program: &str,
        args: &[&str],
    ) -> Result<String, BackendError> {
        let sbx = self.sandboxes.ready(id)?;
        sbx.host
            .with_net(|n| net::run_in(n.netns.as_fd(), program, args, "").map_err(setup))
            .ok_or_else(|| setup(format!("sandbox {id} has no network namespace")))?
    }

    /// Starts the sandbox of `spec`, booting from the template image `disk`, or restoring
    /// its kept snapshot when there is none.
    async fn start_from(
        &self,
        spec: &SandboxSpec,
        limits: Limits,
        disk: Option<&Path>,
    ) -> Result<Sandbox, BackendError> {
        let mut claim = self.host.claim(spec, limits).await?;
        let dir = claim.dir().to_path_buf();
        let ids = claim.ids();
        let jail = Jail::of(&dir);
        std::fs::create_dir_all(jail.root())
            .map_err(|e| BackendError::io(format!("creating {}", jail.root().display()), e))?;
        if let Some(disk) = disk {
            copy_sparse(disk, &jail.host_path(jail::DISK)).await?;
        }
        let j = jail.clone();
        tokio::task::spawn_blocking(move || j.prepare(ids))
            .await
            .map_err(|e| setup(format!("jail task: {e}")))??;
        let config = self.vm_config(spec)?;
        write_json(&jail.host_path(jail::CONFIG), &config)?;
        let slot = claim.slot();
        net::setup_tap(claim.net().netns.as_fd(), slot.sandbox_ip(), ids.base).map_err(setup)?;

        let mut state = StateFile {
            id: spec.id.clone(),
            template: spec.template.clone(),
            pid: None,
            host_if: claim.host_if().to_string(),
            slot: slot.network,
            created_at: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
            id_base: Some(ids.base),
            cpu_count: Some(spec.cpu_count),
            memory_mb: Some(spec.memory_mb),
        };
        state.write(&dir)?;

        let client = VmmClient::new(jail.host_path(jail::API_SOCK), spec.id.clone())
            .with_timeout(self.cfg().op_timeout);
        let restore = spec.kept.is_some();
        let vmm = self
            .spawn_vmm(
                &spec.id,
                &dir,
                ids,
                claim.net().netns.as_fd(),
                claim.cgroup(),
                restore,
                &client,
            )
            .await?;
        claim.set_pid(vmm.pid);
        state.pid = Some(vmm.pid);
        state.write(&dir)?;
        if restore {
            let _ = std::fs::remove_dir_all(jail.host_path(jail::SNAPSHOT));
        }
        let host = claim.commit();
        tracing::debug!(id = %spec.id, pid = vmm.pid, ip = %host.ip(), "microVM started");
        Ok(self.running(
            spec,
            host,
            Vmm {
                process: Mutex::new(Some(vmm)),
                client,
            },
        ))
    }

    /// Starts a jailed VMM (see [`jail`]) inside the sandbox's namespace and cgroup,
    /// booting (or restoring from the jail's snapshot when `restore`) right away, and
    /// waits until it answers.
    #[allow(clippy::too_many_arguments)]
    async fn spawn_vmm(
        &self,
        id: &str,
        dir: &Path,
        ids: IdRange,
        netns: std::os::fd::BorrowedFd<'_>,
        cg: &SandboxCgroup,
        restore: bool,
        client: &VmmClient,
    ) -> Result<VmmProcess, BackendError> {
        let jail = Jail::of(dir);
        let log = std::fs::File::options()
            .create(true)
            .append(true)
            .open(dir.join("vmm.log"))
            .map_err(|e| BackendError::io("creating vmm.log", e))?;
        let _ = std::fs::remove_file(client.path());
        let mut args: Vec<String> = [
            "--config",
            jail::CONFIG,
            "--api-sock",
            jail::API_SOCK,
            "--seccomp",
            if self.cfg().seccomp { "strict" } else { "off" },
            "--start",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        if restore {
            args.extend(["--restore".to_string(), jail::SNAPSHOT.to_string()]);
        }
        let root = jail.root().to_path_buf();
        let binds = [(self.cfg().kernel.as_path(), jail::KERNEL, false)];
        let plan = spawn::ChildPlan::new(spawn::PlanInput {
            netns,
            cgroup_procs: cg.join_files(),
            hostname: id,
            root: spawn::Root::Minimal {
                root: &root,
                devices: jail::DEVICES,
                owner: (ids.base, ids.base),
                binds: &binds,
            },
            identity: spawn::Identity::Unprivileged {
                uid: ids.base,
                gid: ids.base,
            },
            program: spawn::Program::Host(&self.cfg().vmm_binary),
            args: &args,
            // Nothing of the node's environment (keys, seeds, credentials) reaches it.
            env: Vec::new(),
            log: log.as_fd(),
            filters: Vec::new(),
            rlimits: &[],
            umask: 0o077,
            listen: None,
        })
        .map_err(setup)?;
        let pid = tokio::task::spawn_blocking(move || {
            let r = spawn::spawn(&plan);
            drop(plan);
            r
        })
        .await
        .map_err(|e| setup(format!("spawn task: {e}")))?
        .map_err(|e| setup(format!("starting {}: {e}", self.cfg().vmm_binary.display())))?;
        drop(log);
        let exited = watch_exit(pid).map_err(|e| BackendError::io("watching the VMM", e))?;
        let proc = VmmProcess {
            pid: pid.as_raw(),
            exited,
        };
        let mut exited = proc.exited.clone();
        let ready = tokio::select! {
            r = client.wait_ready(self.cfg().op_timeout) => r.map_err(|e| e.to_string()),
            _ = exited.wait_for(|s| s.is_some()) => Err("it exited".to_string()),
        };
        match ready {
            Ok(status) if status["state"] == "running" => Ok(proc),
            other => {
                let why = match other {
                    Ok(status) => format!("it reports {status}"),
                    Err(e) => e,
                };
                let _ = kill(pid, Signal::SIGKILL);
                let mut exited = proc.exited.clone();
                let _ =
                    tokio::time::timeout(self.cfg().op_timeout, exited.wait_for(|s| s.is_some()))
                        .await;
                Err(setup(format!(
                    "the VMM of {} did not start ({why}); its log: {}",
                    dir.display(),
                    jail::log_tail(&dir.join("vmm.log"))
                )))
            }
        }
    }

    /// Stops the VMM of `sbx` (asks, then kills) and waits for it to exit.
    async fn stop_vmm(&self, sbx: &Sandbox, ask: bool) -> Result<(), BackendError> {
        stop_vmm(sbx, ask, self.cfg().op_timeout).await
    }
}

/// Stops the VMM of `sbx` (asks first when `ask`, then kills) and waits up to `timeout`
/// for it to exit.
async fn stop_vmm(
    sbx: &Sandbox,
    ask: bool,
    timeout: std::time::Duration,
) -> Result<(), BackendError> {
    let proc = sbx
        .run
        .process
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .take();
    let Some(proc) = proc else {
        return Ok(());
    };
    let mut exited = proc.exited.clone();
    if ask {
        if let Err(e) = sbx.run.client.stop().await {
            tracing::warn!(error = %e, "stopping the VMM over its socket; killing it");
        }
        if tokio::time::timeout(timeout, exited.wait_for(|s| s.is_some()))
            .await
            .is_ok()
        {
            return Ok(());
        }
    }
    let _ = kill(Pid::from_raw(proc.pid), Signal::SIGKILL);
    match tokio::time::timeout(timeout, exited.wait_for(|s| s.is_some())).await {
        Ok(_) => Ok(()),
        Err(_) => Err(setup(format!(
            "the VMM (pid {}) did not exit within {timeout:?}",
            proc.pid
        ))),
    }
}

/// Stops a sandbox and gives back what it holds on `host`; `keep` names where its
/// directory goes instead of being deleted. Every step runs; errors are collected.
async fn teardown(
    host: &SandboxHost,
    sbx: &Sandbox,
    keep: Option<&Path>,
) -> Result<(), BackendError> {
    let stopped = stop_vmm(sbx, false, host.config().hosted.op_timeout).await;
    let keep_fn = keep.map(|kept| {
        move |dir: &Path| {
            let run = Jail::of(dir).host_path(jail::RUN);
            for f in ["api.sock", "vsock.sock"] {
                let _ = std::fs::remove_file(run.join(f));
            }
            std::fs::rename(dir, kept)
                .map_err(|e| format!("moving {} to {}: {e}", dir.display(), kept.display()))
        }
    });
    let released = host
        .release(
            &sbx.host,
            keep_fn.as_ref().map(|f| f as &crate::host::DirHook<'_>),
        )
        .await;
    stopped.and(released)
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

#[async_trait]
impl Runtime for MicrovmRuntime {
    const KIND: BackendKind = BackendKind::Microvm;
    /// A kept sandbox directory: its snapshot, disk and state.
    const KEPT_FILES: &'static [&'static str] =
        &["jail/run/snapshot", "jail/rootfs.ext4", "state.json"];
    type Run = Vmm;

    fn config(&self) -> &HostedConfig {
        &self.cfg
    }

    fn admit(b: &MicrovmBackend, spec: &mut SandboxSpec) -> Result<Limits, BackendError> {
        if !spec.volumes.is_empty() {
            return Err(BackendError::Unsupported {
                backend: BackendKind::Microvm,
                op: "mount volumes",
                hint: "the VMM has no shared-file-system device; use a node with the jail backend",
            });
        }
        if let Some(kept) = &spec.kept {
            Self::check_kept(b, kept)?;
            // A snapshot restores the memory size and vCPUs it was taken with.
            let st = StateFile::read(&kept.path).ok_or_else(|| BackendError::BadKeptState {
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
        let limits = b.check_limits(spec)?;
        let sock = Jail::of(&b.sandbox_dir(&spec.id)).host_path(jail::API_SOCK);
        if sock.as_os_str().len() > MAX_SOCKET_PATH {
            return Err(setup(format!(
                "the VMM socket path {} is longer than {MAX_SOCKET_PATH} bytes: use a shorter data directory",
                sock.display()
            )));
        }
        Ok(limits)
    }

    /// Boots from the template's image, built first if needed; a kept snapshot restores
    /// instead.
    async fn start(
        b: &MicrovmBackend,
        spec: &SandboxSpec,
        limits: Limits,
        progress: Progress,
    ) -> Result<Sandbox, BackendError> {
        let disk = if spec.kept.is_some() {
            None
        } else {
            let template = b.template(&spec.template, progress.clone()).await?;
            Some(
                image::ensure_image(
                    &template,
                    &b.cfg().agent_binary,
                    &b.cfg().image_dir,
                    progress,
                )
                .await
                .map_err(setup)?,
            )
        };
        b.start_from(spec, limits, disk.as_deref()).await
    }

    /// Pauses the vCPUs, writes a full snapshot and stops the VMM.
    async fn pause(b: &MicrovmBackend, sbx: &Sandbox) -> Result<(), BackendError> {
        let client = &sbx.run.client;
        client.pause().await.map_err(setup)?;
        let jail = Jail::of(&sbx.host.dir);
        let snap = jail.host_path(jail::SNAPSHOT);
        let staging = jail.host_path(jail::SNAPSHOT_STAGING);
        let _ = std::fs::remove_dir_all(&staging);
        let taken = client
            .snapshot(
                Path::new(jail::SNAPSHOT_STAGING),
                SnapshotKind::Full,
                b.cfg().snapshot_timeout,
            )
            .await;
        if let Err(e) = taken {
            // The VM keeps running: nothing is lost.
            let _ = client.resume().await;
            let _ = std::fs::remove_dir_all(&staging);
            return Err(setup(e));
        }
        let _ = std::fs::remove_dir_all(&snap);
        if let Err(e) = std::fs::rename(&staging, &snap) {
            let _ = client.resume().await;
            let _ = std::fs::remove_dir_all(&staging);
            return Err(BackendError::io(
                format!("publishing {}", snap.display()),
                e,
            ));
        }
        b.stop_vmm(sbx, true).await?;
        tracing::debug!(id = %sbx.id(), snapshot = %snap.display(), "microVM paused into a snapshot");
        Ok(())
    }

    /// Restores a new VMM from the snapshot.
    async fn resume(b: &MicrovmBackend, sbx: &Sandbox) -> Result<(), BackendError> {
        let id = sbx.id();
        // A duplicate of the namespace descriptor: the lock is not held across awaits.
        let netns = sbx
            .host
            .with_net(|n| n.netns.try_clone())
            .ok_or_else(|| setup(format!("sandbox {id} lost its network namespace")))?
            .map_err(|e| BackendError::io("duplicating the namespace descriptor", e))?;
        let vmm = b
            .spawn_vmm(
                &id,
                &sbx.host.dir,
                sbx.host.ids,
                netns.as_fd(),
                &sbx.host.cgroup,
                true,
                &sbx.run.client,
            )
            .await?;
        let pid = vmm.pid;
        *sbx.run.process.lock().unwrap_or_else(|e| e.into_inner()) = Some(vmm);
        if let Some(mut st) = StateFile::read(&sbx.host.dir) {
            st.pid = Some(pid);
            st.write(&sbx.host.dir)?;
        }
        let _ = std::fs::remove_dir_all(Jail::of(&sbx.host.dir).host_path(jail::SNAPSHOT));
        Ok(())
    }

    async fn teardown(
        b: &MicrovmBackend,
        sbx: &Sandbox,
        keep: Option<&Path>,
    ) -> Result<(), BackendError> {
        teardown(&b.host, sbx, keep).await
    }

    const DEFERRED_CLEANUP: bool = true;

    /// SIGKILL to the VMM (its vCPUs stop with it), then to whatever else is in the
    /// sandbox's cgroup: nothing of the sandbox runs again. Waiting for the VMM to exit
    /// and giving back the rest is the cleanup's.
    async fn kill(b: &MicrovmBackend, sbx: &Sandbox) -> Result<(), BackendError> {
        let pid = sbx
            .run
            .process
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .map(|p| Pid::from_raw(p.pid));
        sbx.host.kill_all(pid, b.cfg().op_timeout).await
    }

    async fn cleanup(host: &SandboxHost, sbx: &Sandbox) -> Result<(), BackendError> {
        teardown(host, sbx, None).await
    }

    /// The VM snapshot (paused for the moment of the capture), a copy of its disk and
    /// `state.json`.
    async fn capture(
        b: &MicrovmBackend,
        sbx: &Sandbox,
        dir: &Path,
    ) -> Result<SnapshotCapture, BackendError> {
        let client = &sbx.run.client;
        let jail = Jail::of(&sbx.host.dir);
        let capture = jail.host_path(jail::CAPTURE);
        let _ = std::fs::remove_dir_all(&capture);
        client.pause().await.map_err(setup)?;
        // While the vCPUs are parked the disk and the memory agree.
        let captured = async {
            client
                .snapshot(
                    Path::new(jail::CAPTURE),
                    SnapshotKind::Full,
                    b.cfg().snapshot_timeout,
                )
                .await
                .map_err(setup)?;
            for f in [STATE_FILE, MEMORY_FILE] {
                jail::take_vmm_file(&capture.join(f), &dir.join(f))?;
            }
            copy_sparse(&jail.host_path(jail::DISK), &dir.join(ROOTFS_FILE)).await?;
            let st = StateFile::read(&sbx.host.dir).ok_or_else(|| {
                setup(format!(
                    "{} is unreadable",
                    sbx.host.dir.join("state.json").display()
                ))
            })?;
            write_json(&dir.join("state.json"), &st)
        }
        .await;
        let resumed = client.resume().await.map_err(setup);
        let _ = std::fs::remove_dir_all(&capture);
        captured?;
        resumed?;
        tracing::debug!(id = %sbx.id(), dir = %dir.display(), "microVM captured");
        Ok(SnapshotCapture::new(
            BackendKind::Microvm,
            CAPTURE_FILES.iter().map(|f| f.to_string()).collect(),
        ))
    }

    async fn import(
        b: &MicrovmBackend,
        capture: &SnapshotCapture,
        dir: &Path,
    ) -> Result<KeptState, BackendError> {
        let complete = CAPTURE_FILES
            .iter()
            .all(|f| capture.files.iter().any(|c| c == f));
        if capture.kind() != Some(BackendKind::Microvm) || !complete {
            return Err(foreign_capture(capture, dir, "a microVM"));
        }
        let path = b.host.new_kept_path("snapshot");
        let jail = Jail::of(&path);
        let snap = jail.host_path(jail::SNAPSHOT);
        std::fs::create_dir_all(&snap)
            .map_err(|e| BackendError::io(format!("creating {}", snap.display()), e))?;
        let moved = async {
            for f in [STATE_FILE, MEMORY_FILE] {
                move_file(&dir.join(f), &snap.join(f)).await?;
            }
            move_file(&dir.join(ROOTFS_FILE), &jail.host_path(jail::DISK)).await?;
            move_file(&dir.join("state.json"), &path.join("state.json")).await
        }
        .await;
        if let Err(e) = moved {
            let _ = std::fs::remove_dir_all(&path);
            return Err(e);
        }
        Ok(KeptState { path })
    }

    /// The disk image: its size, and the blocks it holds on the host (an upper bound of
    /// what the guest uses: files it deletes keep their blocks until it discards them).
    fn disk_usage(_b: &MicrovmBackend, sbx: &Sandbox) -> Option<DiskUsage> {
        use std::os::unix::fs::MetadataExt;
        let disk = Jail::of(&sbx.host.dir).host_path(jail::DISK);
        let m = std::fs::symlink_metadata(disk).ok()?;
        if !m.is_file() {
            return None;
        }
        Some(DiskUsage {
            used_bytes: m.blocks().saturating_mul(512).min(m.len()),
            total_bytes: m.len(),
        })
    }
}
