//! What the jail and microvm backends share on top of the [`SandboxHost`]: their common
//! settings ([`HostedConfig`]), a sandbox's common part ([`HostedSandbox`]), and the
//! backend itself ([`HostedBackend`]), generic over the one thing that differs: the
//! [`Runtime`] that runs a sandbox in its slot (the agent as PID 1 of a process tree, or
//! a jailed VMM).
//!
//! [`HostedBackend`] keeps the template store, the host and the sandbox table, answers
//! the lookups, and implements [`SandboxBackend`]: each operation takes the sandbox's
//! operation lock, checks the state it needs and leaves the backend's own work to the
//! runtime.

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;

use super::cgroup::Limits;
use super::cleanup::CleanupStats;
use super::devices::DeviceRule;
use super::ids::IdPoolRange;
use super::net::Ipv4Net;
use super::table::{SandboxTable, TableSandbox};
use super::{DirHook, HostConfig, HostSlot, SandboxHost, netpool, setup};
use crate::backend::{
    AGENT_PORT, BackendError, DiskUsage, KeptState, ReconcileReport, ResourceUsage, SandboxAddress,
    SandboxBackend, SandboxInfo, SandboxSpec, SandboxState, SnapshotCapture, validate_sandbox_id,
};
use crate::config::BackendKind;
use crate::host::cgroup::SandboxCgroup;
use crate::template::{Progress, Template, TemplateError, TemplateStore, TemplateStoreConfig};

/// The settings both backends have; their configurations dereference to it
/// (`cfg.address_pool`).
#[derive(Clone, Debug)]
pub struct HostedConfig {
    /// The node's data directory (`home_path`); a backend's sandboxes live in
    /// `<data_dir>/<backend>`.
    pub data_dir: PathBuf,
    /// Host-wide runtime state (address and id reservations, locks), shared by every
    /// node process on the host (`runtime_path`).
    pub runtime_dir: PathBuf,
    /// The template store.
    pub templates: TemplateStoreConfig,
    /// The agent binary on the host (a static `agentenv-guest`): the jail's PID 1, and
    /// init of microVM template images.
    pub agent_binary: PathBuf,
    /// The agent's port inside the sandbox.
    pub agent_port: u16,
    /// Sandbox addresses: carved into /30 networks.
    pub address_pool: Ipv4Net,
    /// Host interface names start with this (at most 6 characters).
    pub iface_prefix: String,
    /// Networks sandboxes never reach (the host's private ranges by default).
    pub denied_networks: Vec<Ipv4Net>,
    /// Nameservers of the sandboxes (their resolv.conf, what a guest is told); `None`
    /// takes the host's.
    pub dns_servers: Option<Vec<Ipv4Addr>>,
    /// How sandbox egress is NATed on the host (`AENV_NET_NAT`).
    pub nat: super::net::NatMode,
    /// Parent of the sandbox cgroups, relative to the node's own cgroup (absolute from
    /// the hierarchy root when it starts with `/`).
    pub cgroup_parent: String,
    /// How long an operation on a sandbox (pause, resume, kill, a VMM's answer) may take
    /// before it fails.
    pub op_timeout: Duration,
    /// Host ids sandboxes are given, 65,536 each (`AENV_JAIL_ID_POOL`).
    pub id_pool: IdPoolRange,
    /// Where sandboxes' logs go (the jail's agent output among them); the node shares
    /// it with its lifecycle.
    pub sandbox_logs: std::sync::Arc<crate::observe::LogBook>,
}

impl HostedConfig {
    /// Defaults for a node with data under `data_dir`, running `agent_binary` (a backend
    /// changes the interface prefix, cgroup parent and timeout it wants).
    pub fn new(data_dir: impl Into<PathBuf>, agent_binary: impl Into<PathBuf>) -> Self {
        let data_dir = data_dir.into();
        let sandbox_logs = std::sync::Arc::new(crate::observe::LogBook::new(
            data_dir.join("sandbox-logs"),
            crate::observe::logbook::DEFAULT_FILE_BYTES,
        ));
        Self {
            templates: TemplateStoreConfig::new(data_dir.join("templates")),
            data_dir,
            runtime_dir: PathBuf::from("/run/agentenv"),
            agent_binary: agent_binary.into(),
            agent_port: AGENT_PORT,
            address_pool: Ipv4Net::new(Ipv4Addr::new(10, 12, 0, 0), 16)
                .expect("10.12.0.0/16 is a valid network"),
            iface_prefix: "ae".into(),
            denied_networks: Ipv4Net::default_denied(),
            dns_servers: None,
            nat: super::net::NatMode::Snat,
            cgroup_parent: "agentenv".into(),
            op_timeout: Duration::from_secs(5),
            id_pool: IdPoolRange::default(),
            sandbox_logs,
        }
    }

    /// The host layer's configuration of backend `kind`, keeping `net_pool_size`
    /// namespaces ready and allowing its sandboxes `devices`.
    pub(crate) fn host(
        &self,
        kind: BackendKind,
        net_pool_size: usize,
        devices: &'static [DeviceRule],
    ) -> HostConfig {
        HostConfig {
            kind: kind.as_str(),
            hosted: self.clone(),
            net_pool_size,
            devices,
        }
    }
}

/// One sandbox of a [`HostedBackend`]: what every backend keeps of it, and the runtime's
/// own part `run` (the jail's PID 1, the microVM's VMM).
pub struct HostedSandbox<T> {
    pub(crate) info: Mutex<SandboxInfo>,
    pub(crate) host: HostSlot,
    /// Held for a whole operation on the sandbox.
    pub(crate) op: tokio::sync::Mutex<()>,
    pub(crate) run: T,
}

impl<T> HostedSandbox<T> {
    /// The sandbox of `spec`, running now in `host`, its agent listening on `agent_port`.
    pub(crate) fn running(spec: &SandboxSpec, host: HostSlot, agent_port: u16, run: T) -> Self {
        let info = SandboxInfo {
            id: spec.id.clone(),
            template: spec.template.clone(),
            state: SandboxState::Running,
            address: SandboxAddress {
                ip: host.ip(),
                agent_port,
            },
            cpu_count: spec.cpu_count,
            memory_mb: spec.memory_mb,
            allow_internet_access: spec.allow_internet_access,
            created_at: host.created_at,
        };
        Self {
            info: Mutex::new(info),
            host,
            op: tokio::sync::Mutex::new(()),
            run,
        }
    }

    fn info_lock(&self) -> std::sync::MutexGuard<'_, SandboxInfo> {
        self.info.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Its id.
    pub(crate) fn id(&self) -> String {
        self.info_lock().id.clone()
    }

    /// Whether it runs or is paused.
    pub(crate) fn state(&self) -> SandboxState {
        self.info_lock().state
    }

    /// Refuses an operation that needs the sandbox running when it is paused.
    fn check_running(&self) -> Result<(), BackendError> {
        let info = self.info_lock();
        if info.state == SandboxState::Running {
            return Ok(());
        }
        Err(BackendError::InvalidState {
            id: info.id.clone(),
            state: info.state,
            needed: SandboxState::Running,
        })
    }

    /// Records that it runs or is paused now; its info.
    fn set_state(&self, state: SandboxState) -> SandboxInfo {
        let mut info = self.info_lock();
        info.state = state;
        info.clone()
    }
}

impl<T> TableSandbox for HostedSandbox<T> {
    fn info(&self) -> &Mutex<SandboxInfo> {
        &self.info
    }

    fn cgroup(&self) -> &SandboxCgroup {
        &self.host.cgroup
    }
}

/// What runs a sandbox in its host slot: the part of a backend that is its own. The
/// [`HostedBackend`] calls it with the sandbox's operation lock held and the state the
/// operation needs checked.
#[async_trait]
pub trait Runtime: Send + Sync + Sized + 'static {
    /// Which backend this is.
    const KIND: BackendKind;
    /// What a kept state of this backend holds (paths relative to its directory).
    const KEPT_FILES: &'static [&'static str];
    /// What a sandbox holds besides its host slot.
    type Run: Send + Sync + 'static;

    /// The settings every hosted backend has.
    fn config(&self) -> &HostedConfig;

    /// Checks `spec` before its id is taken (completing it from its kept state where the
    /// runtime must); the limits of the sandbox's cgroup.
    fn admit(b: &HostedBackend<Self>, spec: &mut SandboxSpec) -> Result<Limits, BackendError>;

    /// Starts the sandbox of `spec`, building what it starts from first.
    async fn start(
        b: &HostedBackend<Self>,
        spec: &SandboxSpec,
        limits: Limits,
        progress: Progress,
    ) -> Result<HostedSandbox<Self::Run>, BackendError>;

    /// Pauses a running sandbox.
    async fn pause(
        b: &HostedBackend<Self>,
        sbx: &HostedSandbox<Self::Run>,
    ) -> Result<(), BackendError>;

    /// Resumes a paused sandbox.
    async fn resume(
        b: &HostedBackend<Self>,
        sbx: &HostedSandbox<Self::Run>,
    ) -> Result<(), BackendError>;

    /// Whether a delete is split in two: [`Runtime::kill`] before it answers, and
    /// [`Runtime::cleanup`] in the backend's cleanup queue. Otherwise a delete is one
    /// [`Runtime::teardown`].
    const DEFERRED_CLEANUP: bool = false;

    /// Kills every process of the sandbox, so that none runs again (they may still be
    /// exiting): the part of a deferred delete done before it answers.
    async fn kill(
        b: &HostedBackend<Self>,
        sbx: &HostedSandbox<Self::Run>,
    ) -> Result<(), BackendError> {
        let _ = (b, sbx);
        Ok(())
    }

    /// The rest of a deferred delete, run by the cleanup queue once [`Runtime::kill`]
    /// answered: gives back all the sandbox holds on `host`. Every step runs; errors are
    /// collected.
    async fn cleanup(
        host: &SandboxHost,
        sbx: &HostedSandbox<Self::Run>,
    ) -> Result<(), BackendError> {
        let _ = (host, sbx);
        Ok(())
    }

    /// Runs on a leftover sandbox directory (of a failed cleanup or an earlier node
    /// process) before it is removed: the jail unmounts its layer there.
    fn clean_dir(dir: &Path) -> Result<(), String> {
        let _ = dir;
        Ok(())
    }

    /// Stops a sandbox and gives back all it holds; `keep` names where its state goes
    /// instead of being deleted. Every step runs; errors are collected.
    async fn teardown(
        b: &HostedBackend<Self>,
        sbx: &HostedSandbox<Self::Run>,
        keep: Option<&Path>,
    ) -> Result<(), BackendError>;

    /// Captures a running sandbox into `dir` (see [`SandboxBackend::snapshot`]).
    async fn capture(
        b: &HostedBackend<Self>,
        sbx: &HostedSandbox<Self::Run>,
        dir: &Path,
    ) -> Result<SnapshotCapture, BackendError>;

    /// The kept state of a fork of a running sandbox (see [`SandboxBackend::fork`]).
    async fn fork(
        b: &HostedBackend<Self>,
        sbx: &HostedSandbox<Self::Run>,
    ) -> Result<KeptState, BackendError> {
        let _ = (b, sbx);
        Err(unsupported_fork(Self::KIND))
    }

    /// Copies of a fork's kept state (see [`SandboxBackend::copy_kept`]).
    async fn copy_kept(
        b: &HostedBackend<Self>,
        kept: &KeptState,
        count: usize,
    ) -> Result<Vec<KeptState>, BackendError> {
        let _ = (b, kept, count);
        Err(unsupported_fork(Self::KIND))
    }

    /// Captures kept state for another node (see [`SandboxBackend::capture_kept`]).
    async fn capture_kept(
        b: &HostedBackend<Self>,
        kept: &KeptState,
        dir: &Path,
    ) -> Result<SnapshotCapture, BackendError> {
        let _ = (b, kept, dir);
        Err(BackendError::Unsupported {
            backend: Self::KIND,
            op: "move a paused sandbox to another node",
            hint: "move paused sandboxes between nodes with the jail backend",
        })
    }

    /// Turns a capture into kept state (see [`SandboxBackend::import_snapshot`]).
    async fn import(
        b: &HostedBackend<Self>,
        capture: &SnapshotCapture,
        dir: &Path,
    ) -> Result<KeptState, BackendError>;

    /// Checks that `kept` is a state this backend kept.
    fn check_kept(b: &HostedBackend<Self>, kept: &KeptState) -> Result<(), BackendError> {
        b.host.check_kept(kept, Self::KEPT_FILES)
    }

    /// Removes what an earlier node process left behind (see
    /// [`SandboxBackend::reconcile`]).
    async fn reconcile(
        b: &HostedBackend<Self>,
        kept: &[KeptState],
    ) -> Result<ReconcileReport, BackendError> {
        b.host.reconcile(&b.sandboxes.ids(), kept, None).await
    }

    /// Releases what the runtime holds for sandboxes to come, once the backend goes with
    /// no sandbox left.
    fn release_unused(&mut self) {}

    /// The sandbox's writable disk, when the runtime can tell (it may block briefly).
    fn disk_usage(_b: &HostedBackend<Self>, _sbx: &HostedSandbox<Self::Run>) -> Option<DiskUsage> {
        None
    }
}

/// A backend whose sandboxes are slots of a [`SandboxHost`], run by the runtime `R`.
pub struct HostedBackend<R: Runtime> {
    pub(crate) runtime: R,
    pub(crate) templates: TemplateStore,
    pub(crate) host: Arc<SandboxHost>,
    pub(crate) sandboxes: SandboxTable<HostedSandbox<R::Run>>,
}

/// What a runtime that cannot fork answers.
fn unsupported_fork(backend: BackendKind) -> BackendError {
    BackendError::Unsupported {
        backend,
        op: "fork a sandbox",
        hint: "fork sandboxes on a node with the jail backend",
    }
}

/// A capture another backend (or another layout) took: refused with what it is.
pub(crate) fn foreign_capture(capture: &SnapshotCapture, dir: &Path, wanted: &str) -> BackendError {
    BackendError::BadKeptState {
        path: dir.to_path_buf(),
        reason: format!(
            "it was taken by the {} backend, not by {wanted} (files {:?})",
            capture.backend, capture.files
        ),
    }
}

impl<R: Runtime> HostedBackend<R> {
    /// The backend of `runtime` on `host`, with no sandbox yet.
    pub(crate) fn assemble(runtime: R, host: SandboxHost) -> Self {
        Self {
            templates: TemplateStore::new(runtime.config().templates.clone()),
            runtime,
            host: Arc::new(host),
            sandboxes: SandboxTable::new(),
        }
    }

    /// The template store sandboxes are created from.
    pub fn templates(&self) -> &TemplateStore {
        &self.templates
    }

    /// The host side of the backend.
    pub fn host(&self) -> &SandboxHost {
        &self.host
    }

    /// Where the backend's sandboxes' logs go.
    pub fn sandbox_logs(&self) -> &std::sync::Arc<crate::observe::LogBook> {
        &self.runtime.config().sandbox_logs
    }

    /// The cgroup version in use (1 or 2).
    pub fn cgroup_version(&self) -> u8 {
        self.host.hierarchy().version()
    }

    /// The directory of a sandbox.
    pub fn sandbox_dir(&self, id: &str) -> PathBuf {
        self.host.sandbox_dir(id)
    }

    /// Where kept states live (see [`SandboxBackend::keep`]).
    pub fn kept_dir(&self) -> &Path {
        self.host.kept_dir()
    }

    /// The cgroup directories of a sandbox (present while it exists).
    pub fn cgroup_dirs(&self, id: &str) -> Vec<PathBuf> {
        self.host.cgroup_dirs(id)
    }

    /// The host interface of a sandbox.
    pub fn host_interface(&self, id: &str) -> Option<String> {
        let sbx = self.sandboxes.ready(id).ok()?;
        sbx.host.with_net(|n| n.host_if.clone())
    }

    /// The egress policy in force for a sandbox.
    pub fn egress_policy(&self, id: &str) -> Option<std::sync::Arc<crate::egress::EgressPolicy>> {
        self.sandboxes
            .ready(id)
            .ok()
            .map(|s| s.host.egress.policy())
    }

    /// The base of a sandbox's id range (the jail's root inside, the VMM's user).
    pub fn id_base(&self, id: &str) -> Option<u32> {
        self.sandboxes.ready(id).ok().map(|s| s.host.ids.base)
    }

    /// Whether an address of the pool is reserved (by any node process on this host).
    pub fn address_reserved(&self, ip: Ipv4Addr) -> bool {
        self.host.address_reserved(ip)
    }

    /// Who holds the reservation of an address of the pool (a sandbox's directory, or a
    /// namespace pool's), if anyone does.
    pub fn address_owner(&self, ip: Ipv4Addr) -> Option<PathBuf> {
        self.host.address_owner(ip)
    }

    /// Names of host interfaces of sandboxes (of every node process on this host).
    pub async fn host_interfaces(&self) -> Vec<String> {
        self.host.host_interfaces().await
    }

    /// What the pool of ready network namespaces did so far.
    pub fn net_pool_stats(&self) -> netpool::NetPoolStats {
        self.host.netpool().stats()
    }

    /// Where the namespace pools of this data directory keep their owner directories.
    pub fn net_pool_dir(&self) -> &Path {
        self.host.net_pool_dir()
    }

    /// Host interfaces of the pooled network namespaces ready now.
    pub fn pooled_interfaces(&self) -> Vec<String> {
        self.host.netpool().interfaces()
    }

    /// Creates a sandbox, building what it starts from first, with progress reported.
    pub async fn create_with_progress(
        &self,
        mut spec: SandboxSpec,
        progress: Progress,
    ) -> Result<SandboxInfo, BackendError> {
        let started = std::time::Instant::now();
        validate_sandbox_id(&spec.id)?;
        let limits = R::admit(self, &mut spec)?;
        self.sandboxes
            .begin(&spec.id, self.sandbox_dir(&spec.id).exists())?;
        crate::timing::record("admit", started.elapsed());
        let result = R::start(self, &spec, limits, progress)
            .await
            .map(std::sync::Arc::new);
        if result.is_err() && spec.kept.is_none() {
            // A sandbox that never ran leaves no log (one resumed from kept state keeps
            // its history).
            self.runtime.config().sandbox_logs.remove(&spec.id);
        }
        self.sandboxes.finish(&spec.id, result)
    }

    /// The template `name`, built first if needed.
    pub(crate) async fn template(
        &self,
        name: &str,
        progress: Progress,
    ) -> Result<Template, BackendError> {
        self.templates
            .ensure(name, progress)
            .await
            .map_err(|e| match e {
                TemplateError::NotFound(n) | TemplateError::InvalidName(n) => {
                    BackendError::UnknownTemplate(n)
                }
                other => BackendError::Template(other),
            })
    }

    /// The sandbox of `spec`, running now in `host`.
    pub(crate) fn running(
        &self,
        spec: &SandboxSpec,
        host: HostSlot,
        run: R::Run,
    ) -> HostedSandbox<R::Run> {
        HostedSandbox::running(spec, host, self.runtime.config().agent_port, run)
    }
}

impl<R: Runtime> Drop for HostedBackend<R> {
    /// With no sandbox left (and none being cleaned up), the runtime lets go of what it
    /// kept ready.
    fn drop(&mut self) {
        let pending = self.host.cleanups().pending();
        if pending > 0 {
            tracing::warn!(
                pending,
                "the backend goes with deleted sandboxes still being cleaned up; the next start's reconciliation removes what is left"
            );
        } else if self.sandboxes.ids().is_empty() {
            self.runtime.release_unused();
        }
    }
}

#[async_trait]
impl<R: Runtime> SandboxBackend for HostedBackend<R> {
    fn kind(&self) -> BackendKind {
        R::KIND
    }

    async fn create(&self, spec: SandboxSpec) -> Result<SandboxInfo, BackendError> {
        self.create_with_progress(spec, crate::template::log_progress())
            .await
    }

    async fn pause(&self, id: &str) -> Result<(), BackendError> {
        let sbx = self.sandboxes.ready(id)?;
        let _op = sbx.op.lock().await;
        if sbx.state() == SandboxState::Paused {
            return Ok(());
        }
        R::pause(self, &sbx).await?;
        sbx.set_state(SandboxState::Paused);
        Ok(())
    }

    async fn resume(&self, id: &str) -> Result<SandboxInfo, BackendError> {
        let sbx = self.sandboxes.ready(id)?;
        let _op = sbx.op.lock().await;
        if sbx.state() == SandboxState::Paused {
            R::resume(self, &sbx).await?;
        }
        Ok(sbx.set_state(SandboxState::Running))
    }

    async fn destroy(&self, id: &str) -> Result<(), BackendError> {
        let sbx = self.sandboxes.remove_ready(id)?;
        let _op = sbx.op.lock().await;
        let r = R::teardown(self, &sbx, None).await;
        self.runtime.config().sandbox_logs.remove(id);
        r
    }

    async fn kill(&self, id: &str) -> Result<(), BackendError> {
        if !R::DEFERRED_CLEANUP {
            return self.destroy(id).await;
        }
        let sbx = self.sandboxes.remove_ready(id)?;
        let op = sbx.op.lock().await;
        let killed = R::kill(self, &sbx).await;
        drop(op);
        self.runtime.config().sandbox_logs.remove(id);
        let (host, again, name) = (self.host.clone(), self.host.clone(), id.to_string());
        let first = async move {
            let _op = sbx.op.lock().await;
            R::cleanup(&host, &sbx).await.map_err(|e| e.to_string())
        };
        let retry = move || {
            let (host, id) = (again.clone(), name.clone());
            async move {
                let hook: &DirHook<'_> = &R::clean_dir;
                host.clean_deleted(&id, Some(hook)).await
            }
        };
        self.host.cleanups().push(id.to_string(), first, retry);
        killed
    }

    fn cleanups(&self) -> CleanupStats {
        self.host.cleanups().stats()
    }

    async fn drain_cleanups(&self, timeout: Duration) -> bool {
        self.host.cleanups().drain(timeout).await
    }

    async fn keep(&self, id: &str) -> Result<KeptState, BackendError> {
        let sbx = self.sandboxes.remove_paused(id)?;
        let _op = sbx.op.lock().await;
        let path = self.host.new_kept_path(id);
        R::teardown(self, &sbx, Some(&path)).await?;
        tracing::debug!(id, path = %path.display(), "sandbox stopped, its state kept");
        Ok(KeptState { path })
    }

    async fn snapshot(&self, id: &str, dir: &Path) -> Result<SnapshotCapture, BackendError> {
        let sbx = self.sandboxes.ready(id)?;
        let _op = sbx.op.lock().await;
        sbx.check_running()?;
        R::capture(self, &sbx, dir).await
    }

    async fn capture_kept(
        &self,
        kept: &KeptState,
        dir: &Path,
    ) -> Result<SnapshotCapture, BackendError> {
        R::check_kept(self, kept)?;
        R::capture_kept(self, kept, dir).await
    }

    async fn import_snapshot(
        &self,
        capture: &SnapshotCapture,
        dir: &Path,
    ) -> Result<KeptState, BackendError> {
        R::import(self, capture, dir).await
    }

    async fn fork(&self, id: &str) -> Result<KeptState, BackendError> {
        let sbx = self.sandboxes.ready(id)?;
        let _op = sbx.op.lock().await;
        sbx.check_running()?;
        R::fork(self, &sbx).await
    }

    async fn copy_kept(
        &self,
        kept: &KeptState,
        count: usize,
    ) -> Result<Vec<KeptState>, BackendError> {
        R::copy_kept(self, kept, count).await
    }

    async fn discard_kept(&self, kept: &KeptState) -> Result<(), BackendError> {
        if !kept.path.exists() {
            return Ok(());
        }
        R::check_kept(self, kept)?;
        self.host.remove_dir(&kept.path).map_err(setup)
    }

    async fn set_egress(
        &self,
        id: &str,
        policy: crate::egress::EgressPolicy,
    ) -> Result<(), BackendError> {
        let sbx = self.sandboxes.ready(id)?;
        let _op = sbx.op.lock().await;
        sbx.host.egress.update(policy).await.map_err(setup)
    }

    async fn get(&self, id: &str) -> Result<SandboxInfo, BackendError> {
        self.sandboxes.get(id)
    }

    async fn usage(&self, id: &str) -> Result<ResourceUsage, BackendError> {
        let sbx = self.sandboxes.ready(id)?;
        let mut u = self.sandboxes.usage(id)?;
        u.disk = R::disk_usage(self, &sbx);
        Ok(u)
    }

    async fn list(&self) -> Vec<SandboxInfo> {
        self.sandboxes.list()
    }

    async fn reconcile(&self, kept: &[KeptState]) -> Result<ReconcileReport, BackendError> {
        R::reconcile(self, kept).await
    }
}
