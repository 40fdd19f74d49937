//! The sandbox lifecycle: a state machine per sandbox on top of a [`SandboxBackend`].
//!
//! Every operation on one sandbox holds that sandbox's operation lock, so concurrent
//! requests are serialized and a second pause (or resume) simply finds the work done.
//! State changes are compare-and-set under the record lock, so readers (list, get, the
//! data plane) always see a consistent state. Operations run in detached tasks: a client
//! that disconnects never leaves a half-done step behind.
//!
//! Paused sandboxes are recorded on disk (one JSON file each, written with fsync); at
//! start the records come back as paused sandboxes. At shutdown the backend keeps each
//! paused sandbox's state (jail: its writable layer) and the record names it, so a
//! restored sandbox resumes from it; a backend that cannot keep processes across a node
//! restart (the jail) starts them afresh, on the sandbox's own files.

mod metrics;
mod persist;

pub use metrics::{LifecycleMetrics, StageTimer};
pub use persist::{PausedStore, PersistError};

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use agentenv_core::proto::scheduler_v1::{SandboxEvent, SandboxEventType};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::access::TokenIssuer;
use crate::backend::agent::wait_ready;
use crate::backend::{BackendError, KeptState, SandboxAddress, SandboxBackend, SandboxSpec};
use crate::reporter::{NodeSource, SandboxUsage};
use crate::snapshot::{SnapshotError, SnapshotRecord, SnapshotRepo, SnapshotSpec};

/// Internal states of a sandbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum State {
    Creating,
    Resuming,
    Running,
    /// Captured for a snapshot (jail: frozen while its layer is archived).
    Snapshotting,
    Pausing,
    Paused,
    Killing,
}

impl State {
    /// The state the API shows: `running` or `paused`.
    pub fn api_name(self) -> &'static str {
        match self {
            State::Pausing | State::Paused | State::Snapshotting => "paused",
            _ => "running",
        }
    }
}

/// What happens when a sandbox's timeout expires.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnTimeout {
    Pause,
    Kill,
}

/// Lifecycle errors; the API maps each to a status.
#[derive(Debug, thiserror::Error)]
pub enum LifecycleError {
    #[error("sandbox {0} not found")]
    NotFound(String),
    #[error("sandbox {id} is {state:?}; {op} needs it {needed}")]
    InvalidState {
        id: String,
        state: State,
        op: &'static str,
        needed: &'static str,
    },
    #[error("the node is shutting down; retry on another node")]
    ShuttingDown,
    #[error("{0}")]
    BadRequest(String),
    #[error("internal error: {0}")]
    Internal(String),
    #[error(transparent)]
    Backend(#[from] BackendError),
    #[error("sandbox {id}: the guest agent did not start: {reason}")]
    Agent { id: String, reason: String },
    #[error(transparent)]
    Persist(#[from] PersistError),
    #[error(transparent)]
    Snapshot(#[from] SnapshotError),
    #[error(
        "this node has no snapshot repository: configure AENV_SNAPSHOT_STORE (a directory shared by the nodes) or the oss repository"
    )]
    NoSnapshotRepository,
}

/// What a create asks for (already validated for shape by the API).
#[derive(Debug, Clone)]
pub struct CreateRequest {
    pub template: String,
    pub timeout: Option<Duration>,
    pub on_timeout: OnTimeout,
    pub auto_resume: bool,
    pub secure: bool,
    pub allow_internet_access: Option<bool>,
    pub allow_public_traffic: bool,
    pub metadata: BTreeMap<String, String>,
    pub env_vars: BTreeMap<String, String>,
    pub cpu_count: Option<u32>,
    pub memory_mb: Option<u64>,
    pub disk_size_mb: Option<u64>,
}

impl CreateRequest {
    /// A request with the API's defaults for `template`.
    pub fn new(template: impl Into<String>) -> Self {
        Self {
            template: template.into(),
            timeout: None,
            on_timeout: OnTimeout::Pause,
            auto_resume: false,
            secure: false,
            allow_internet_access: None,
            allow_public_traffic: true,
            metadata: BTreeMap::new(),
            env_vars: BTreeMap::new(),
            cpu_count: None,
            memory_mb: None,
            disk_size_mb: None,
        }
    }
}

fn ms_since_epoch(t: SystemTime) -> u64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Everything the node knows about one sandbox.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SandboxRecord {
    pub id: String,
    pub template: String,
    pub state: State,
    /// Creation time, ms since the epoch.
    pub created_at_ms: u64,
    /// The sandbox's timeout (what `timeout` asked for).
    pub timeout_secs: u64,
    pub on_timeout: OnTimeout,
    pub auto_resume: bool,
    pub secure: bool,
    pub allow_internet_access: Option<bool>,
    pub allow_public_traffic: bool,
    pub metadata: BTreeMap<String, String>,
    pub env_vars: BTreeMap<String, String>,
    pub cpu_count: u32,
    pub memory_mb: u64,
    /// The writable disk's size in MiB, when the create named one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk_size_mb: Option<u64>,
    /// When the timeout fires (wall clock, ms since the epoch); `None` while paused.
    pub expires_at_ms: Option<u64>,
    /// The timer behind `expires_at_ms`.
    #[serde(skip)]
    pub deadline: Option<Instant>,
    /// Where the agent listens while the sandbox runs.
    #[serde(skip)]
    pub address: Option<SandboxAddress>,
    /// Restored from disk after a node restart: no backend sandbox exists yet.
    #[serde(skip)]
    pub restored: bool,
    /// What the backend kept of the stopped sandbox (see [`SandboxBackend::keep`]); a
    /// restored sandbox starts from it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kept: Option<KeptState>,
    /// The snapshot the sandbox started from (its `templateID`), if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot_id: Option<String>,
    /// The name of that snapshot, if it had one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot_name: Option<String>,
}

impl SandboxRecord {
    fn set_deadline(&mut self, timeout: Duration) {
        self.deadline = Some(Instant::now() + timeout);
        self.expires_at_ms = Some(ms_since_epoch(SystemTime::now() + timeout));
    }

    fn spec(&self) -> SandboxSpec {
        let mut spec = SandboxSpec::new(&self.id, &self.template);
        spec.cpu_count = self.cpu_count;
        spec.memory_mb = self.memory_mb;
        spec.disk_size_mb = self.disk_size_mb;
        spec.env = self.env_vars.clone();
        spec.allow_internet_access = self.allow_internet_access.unwrap_or(true);
        spec.kept = self.kept.clone();
        spec
    }
}

struct Slot {
    op: Arc<tokio::sync::Mutex<()>>,
    rec: Mutex<SandboxRecord>,
}

/// Settings of the lifecycle engine.
#[derive(Debug, Clone)]
pub struct LifecycleConfig {
    pub default_timeout: Duration,
    pub auto_evict_interval: Duration,
    pub auto_resume_min_timeout: Duration,
    pub default_cpu_count: u32,
    pub default_memory_mb: u64,
    pub agent_ready_timeout: Duration,
    /// Longest `timeout` a create or `/timeout` may ask for.
    pub max_timeout: Duration,
}

impl Default for LifecycleConfig {
    fn default() -> Self {
        Self {
            default_timeout: Duration::from_secs(15),
            auto_evict_interval: Duration::from_secs(1),
            auto_resume_min_timeout: Duration::from_secs(300),
            default_cpu_count: 2,
            default_memory_mb: 512,
            agent_ready_timeout: Duration::from_secs(30),
            max_timeout: Duration::from_secs(86_400),
        }
    }
}

/// The lifecycle engine of one node.
pub struct Orchestrator {
    backend: Arc<dyn SandboxBackend>,
    cfg: LifecycleConfig,
    tokens: TokenIssuer,
    store: PausedStore,
    slots: Mutex<HashMap<String, Arc<Slot>>>,
    shutting_down: AtomicBool,
    events: Mutex<Option<mpsc::UnboundedSender<SandboxEvent>>>,
    snapshots: std::sync::OnceLock<Arc<SnapshotRepo>>,
    create_successes: AtomicU64,
    create_fails: AtomicU64,
    metrics: LifecycleMetrics,
}

/// Whether a connect resumed the sandbox (201) or found it running (200).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Connected {
    WasRunning,
    Resumed,
}

impl Orchestrator {
    /// An engine over `backend`, with paused sandboxes restored from `store`.
    pub fn new(
        backend: Arc<dyn SandboxBackend>,
        cfg: LifecycleConfig,
        tokens: TokenIssuer,
        store: PausedStore,
    ) -> Result<Arc<Self>, LifecycleError> {
        let mut slots = HashMap::new();
        for mut rec in store.load_all()? {
            rec.state = State::Paused;
            rec.restored = true;
            rec.deadline = None;
            rec.expires_at_ms = None;
            tracing::info!(sandbox = %rec.id, "restored paused sandbox");
            slots.insert(
                rec.id.clone(),
                Arc::new(Slot {
                    op: Arc::new(tokio::sync::Mutex::new(())),
                    rec: Mutex::new(rec),
                }),
            );
        }
        Ok(Arc::new(Self {
            backend,
            cfg,
            tokens,
            store,
            slots: Mutex::new(slots),
            shutting_down: AtomicBool::new(false),
            events: Mutex::new(None),
            snapshots: std::sync::OnceLock::new(),
            create_successes: AtomicU64::new(0),
            create_fails: AtomicU64::new(0),
            metrics: LifecycleMetrics::default(),
        }))
    }

    /// Stage timings, for the node's `/metrics`.
    pub fn metrics(&self) -> &LifecycleMetrics {
        &self.metrics
    }

    /// The token issuer of this node.
    pub fn tokens(&self) -> &TokenIssuer {
        &self.tokens
    }

    /// The backend's name.
    pub fn backend_kind(&self) -> &'static str {
        self.backend.kind()
    }

    pub fn config(&self) -> &LifecycleConfig {
        &self.cfg
    }

    /// Publishes snapshots to `repo` and starts sandboxes from its snapshots (set once,
    /// at startup).
    pub fn set_snapshot_repository(&self, repo: Arc<SnapshotRepo>) {
        let _ = self.snapshots.set(repo);
    }

    /// The snapshot repository, if configured.
    pub fn snapshot_repository(&self) -> Result<&Arc<SnapshotRepo>, LifecycleError> {
        self.snapshots
            .get()
            .ok_or(LifecycleError::NoSnapshotRepository)
    }

    /// Sends sandbox events (create, delete, pause, resume) to `tx` from now on.
    pub fn set_event_sink(&self, tx: mpsc::UnboundedSender<SandboxEvent>) {
        *self.events.lock() = Some(tx);
    }

    fn event(&self, rec: &SandboxRecord, kind: SandboxEventType) {
        if let Some(tx) = self.events.lock().as_ref() {
            let _ = tx.send(SandboxEvent {
                sandbox_id: rec.id.clone(),
                event_type: kind as i32,
                requested_cpu: rec.cpu_count,
                requested_memory_bytes: rec.memory_mb << 20,
                requested_disk_bytes: 0,
            });
        }
    }

    /// Refuses new lifecycle operations from now on (503).
    pub fn begin_shutdown(&self) {
        self.shutting_down.store(true, Ordering::SeqCst);
    }

    pub fn is_shutting_down(&self) -> bool {
        self.shutting_down.load(Ordering::SeqCst)
    }

    fn check_running(&self) -> Result<(), LifecycleError> {
        if self.is_shutting_down() {
            Err(LifecycleError::ShuttingDown)
        } else {
            Ok(())
        }
    }

    fn slot(&self, id: &str) -> Result<Arc<Slot>, LifecycleError> {
        self.slots
            .lock()
            .get(id)
            .cloned()
            .ok_or_else(|| LifecycleError::NotFound(id.to_string()))
    }

    /// A copy of a sandbox's record.
    pub fn get(&self, id: &str) -> Result<SandboxRecord, LifecycleError> {
        Ok(self.slot(id)?.rec.lock().clone())
    }

    /// Copies of every record.
    pub fn list(&self) -> Vec<SandboxRecord> {
        let slots: Vec<Arc<Slot>> = self.slots.lock().values().cloned().collect();
        slots.iter().map(|s| s.rec.lock().clone()).collect()
    }

    /// Runs `f` in a detached task, so a dropped caller does not abort it.
    async fn detached<T, F>(self: &Arc<Self>, f: F) -> Result<T, LifecycleError>
    where
        T: Send + 'static,
        F: std::future::Future<Output = Result<T, LifecycleError>> + Send + 'static,
    {
        match tokio::spawn(f).await {
            Ok(r) => r,
            Err(e) => Err(LifecycleError::Internal(format!(
                "lifecycle task failed: {e}"
            ))),
        }
    }

    fn check_timeout(&self, t: Duration) -> Result<(), LifecycleError> {
        if t > self.cfg.max_timeout {
            return Err(LifecycleError::BadRequest(format!(
                "timeout {} s is more than the allowed {} s",
                t.as_secs(),
                self.cfg.max_timeout.as_secs()
            )));
        }
        Ok(())
    }

    /// Creates a sandbox and returns once its agent is ready and initialized.
    pub async fn create(
        self: &Arc<Self>,
        req: CreateRequest,
    ) -> Result<SandboxRecord, LifecycleError> {
        self.check_running()?;
        let timeout = req.timeout.unwrap_or(self.cfg.default_timeout);
        self.check_timeout(timeout)?;
        let this = self.clone();
        self.detached(async move { this.create_inner(req, timeout).await })
            .await
    }

    async fn create_inner(
        self: Arc<Self>,
        req: CreateRequest,
        timeout: Duration,
    ) -> Result<SandboxRecord, LifecycleError> {
        let id = uuid::Uuid::now_v7().to_string();
        let from = self.resolve_snapshot(&req.template).await?;
        let mut req = req;
        let mut kept = None;
        let (mut snapshot_id, mut snapshot_name) = (None, None);
        if let Some(snap) = &from {
            kept = Some(self.import_snapshot(snap).await?);
            req.template = snap.committed.template.clone();
            let mut env = snap.committed.env.clone();
            env.extend(std::mem::take(&mut req.env_vars));
            req.env_vars = env;
            req.cpu_count = req.cpu_count.or(Some(snap.resources.cpu_count));
            req.memory_mb = req.memory_mb.or(Some(snap.resources.memory_mb));
            snapshot_id = Some(snap.id.clone());
            snapshot_name = snap.alias.clone();
        }
        let rec = SandboxRecord {
            id: id.clone(),
            template: req.template,
            state: State::Creating,
            created_at_ms: ms_since_epoch(SystemTime::now()),
            timeout_secs: timeout.as_secs(),
            on_timeout: req.on_timeout,
            auto_resume: req.auto_resume,
            secure: req.secure,
            allow_internet_access: req.allow_internet_access,
            allow_public_traffic: req.allow_public_traffic,
            metadata: req.metadata,
            env_vars: req.env_vars,
            cpu_count: req.cpu_count.unwrap_or(self.cfg.default_cpu_count),
            memory_mb: req.memory_mb.unwrap_or(self.cfg.default_memory_mb),
            disk_size_mb: req.disk_size_mb,
            expires_at_ms: None,
            deadline: None,
            address: None,
            restored: false,
            kept: kept.clone(),
            snapshot_id,
            snapshot_name,
        };
        let slot = Arc::new(Slot {
            op: Arc::new(tokio::sync::Mutex::new(())),
            rec: Mutex::new(rec.clone()),
        });
        let _op = slot.op.clone().lock_owned().await;
        let total = self.metrics.start("create_warm", "total");
        self.slots.lock().insert(id.clone(), slot.clone());
        if self.is_shutting_down() {
            // Shutdown has (or will have) taken its list of sandboxes: do not start one.
            self.slots.lock().remove(&id);
            self.discard_imported(kept.as_ref()).await;
            return Err(LifecycleError::ShuttingDown);
        }
        let started = self.start_backend(&mut rec.clone(), false).await;
        total.finish(started.is_ok());
        if started.is_err() {
            // A layer the backend did not take over (or gave back) goes.
            self.discard_imported(kept.as_ref()).await;
        }
        match started {
            Ok(addr) => {
                let mut r = slot.rec.lock();
                // The backend sandbox owns the imported state now.
                r.kept = None;
                r.address = Some(addr);
                r.state = State::Running;
                r.set_deadline(timeout);
                let out = r.clone();
                drop(r);
                self.create_successes.fetch_add(1, Ordering::Relaxed);
                self.event(&out, SandboxEventType::Create);
                tracing::info!(sandbox = %id, template = %out.template, "sandbox created");
                Ok(out)
            }
            Err(e) => {
                self.slots.lock().remove(&id);
                self.create_fails.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(sandbox = %id, error = %e, "create failed");
                Err(e)
            }
        }
    }

    /// Creates the backend sandbox for `rec`, waits for its agent and initializes it.
    /// On failure nothing is left behind but, with `rekeep`, the kept state `rec` started
    /// from (kept again, with `rec` and its paused record updated).
    async fn start_backend(
        &self,
        rec: &mut SandboxRecord,
        rekeep: bool,
    ) -> Result<SandboxAddress, LifecycleError> {
        let stage = self.metrics.start("create_warm", "backend_start");
        let info = self.backend.create(rec.spec()).await;
        stage.finish(info.is_ok());
        let addr = info?.address;
        let stage = self.metrics.start("create_warm", "agent_ready");
        let ready = async {
            wait_ready(
                addr.agent(),
                self.cfg.agent_ready_timeout,
                Duration::from_millis(2),
            )
            .await
            .map_err(|e| e.to_string())?;
            self.init_agent(rec, addr).await
        }
        .await;
        stage.finish(ready.is_ok());
        if let Err(reason) = ready {
            if rec.kept.is_some() && rekeep {
                // The kept state was taken over by the backend sandbox: keep it again.
                rec.kept = match self.keep_backend(&rec.id).await {
                    Ok(kept) => Some(kept),
                    Err(e) => {
                        tracing::warn!(sandbox = %rec.id, error = %e, "keeping the state after a failed start; the sandbox's files are lost");
                        None
                    }
                };
                let mut paused = rec.clone();
                paused.state = State::Paused;
                if let Err(e) = self.store.save(&paused) {
                    tracing::warn!(sandbox = %rec.id, error = %e, "recording the kept state");
                }
            } else if let Err(e) = self.backend.destroy(&rec.id).await {
                tracing::warn!(sandbox = %rec.id, error = %e, "cleanup after a failed start");
            }
            return Err(LifecycleError::Agent {
                id: rec.id.clone(),
                reason,
            });
        }
        Ok(addr)
    }

    /// Pauses a backend sandbox and has the backend keep its state; on failure the
    /// sandbox is destroyed.
    async fn keep_backend(&self, id: &str) -> Result<KeptState, BackendError> {
        let kept = match self.backend.pause(id).await {
            Ok(()) => self.backend.keep(id).await,
            Err(e) => Err(e),
        };
        if kept.is_err() {
            match self.backend.destroy(id).await {
                Ok(()) | Err(BackendError::NotFound(_)) => {}
                Err(e) => tracing::warn!(sandbox = %id, error = %e, "releasing the sandbox"),
            }
        }
        kept
    }

    async fn init_agent(&self, rec: &SandboxRecord, addr: SandboxAddress) -> Result<(), String> {
        let mut client =
            agentenv_guest::client::GuestClient::new(&format!("http://{}", addr.agent()))
                .map_err(|e| e.to_string())?;
        let token = rec.secure.then(|| self.tokens.envd_token(&rec.id));
        if let Some(t) = &token {
            client = client.with_access_token(t);
        }
        let ts = time_rfc3339(SystemTime::now());
        let body = serde_json::json!({
            "envVars": rec.env_vars,
            "accessToken": token.unwrap_or_default(),
            "timestamp": ts,
        });
        client
            .init(&body)
            .await
            .map_err(|e| format!("POST /init: {e}"))
    }

    /// The snapshot `template` names (id or name), when a repository is configured and
    /// it is not the built-in template. An id that names no snapshot is an error (404);
    /// a name that names none is a template name.
    async fn resolve_snapshot(
        &self,
        template: &str,
    ) -> Result<Option<SnapshotRecord>, LifecycleError> {
        let Some(repo) = self.snapshots.get() else {
            return Ok(None);
        };
        if template == crate::template::BASE_TEMPLATE {
            return Ok(None);
        }
        match repo.resolve(template).await? {
            Some(r) => Ok(Some(r)),
            None if crate::dataplane::is_uuid(template) => {
                Err(SnapshotError::NotFound(template.to_string()).into())
            }
            None => Ok(None),
        }
    }

    /// Downloads a snapshot and has the backend turn it into state a create starts from.
    async fn import_snapshot(&self, snap: &SnapshotRecord) -> Result<KeptState, LifecycleError> {
        let repo = self.snapshot_repository()?;
        let here = self.backend.kind();
        if snap.committed.capture.backend != here {
            return Err(SnapshotError::WrongBackend {
                id: snap.id.clone(),
                taken: snap.committed.capture.backend.clone(),
                here: here.to_string(),
            }
            .into());
        }
        let timer = self.metrics.start("create_warm", "snapshot_import");
        let result = async {
            let dir = repo.staging_dir()?;
            repo.download(snap, dir.path()).await?;
            Ok(self
                .backend
                .import_snapshot(&snap.committed.capture, dir.path())
                .await?)
        }
        .await;
        timer.finish(result.is_ok());
        result
    }

    async fn discard_imported(&self, kept: Option<&KeptState>) {
        if let Some(k) = kept
            && let Err(e) = self.backend.discard_kept(k).await
        {
            tracing::warn!(path = %k.path.display(), error = %e, "removing an imported snapshot layer");
        }
    }

    /// Snapshots a running sandbox and publishes it to the repository (optionally under
    /// `name`); the sandbox keeps running.
    pub async fn snapshot(
        self: &Arc<Self>,
        id: &str,
        name: Option<String>,
    ) -> Result<SnapshotRecord, LifecycleError> {
        self.check_running()?;
        let repo = self.snapshot_repository()?.clone();
        if let Some(n) = &name {
            crate::snapshot::validate_name(n)?;
        }
        let this = self.clone();
        let id = id.to_string();
        self.detached(async move {
            let slot = this.slot(&id)?;
            let timer = this.metrics.start("snapshot", "total");
            let dir = repo.staging_dir()?;
            let (capture, rec) = {
                let _op = slot.op.clone().lock_owned().await;
                let rec = {
                    let mut r = slot.rec.lock();
                    match r.state {
                        State::Running => {}
                        State::Killing => return Err(LifecycleError::NotFound(id)),
                        s => {
                            return Err(LifecycleError::InvalidState {
                                id,
                                state: s,
                                op: "snapshot",
                                needed: "running",
                            });
                        }
                    }
                    r.state = State::Snapshotting;
                    r.clone()
                };
                let captured = this.backend.snapshot(&id, dir.path()).await;
                // The sandbox runs on whatever the capture did.
                slot.rec.lock().state = State::Running;
                (captured?, rec)
            };
            let spec = SnapshotSpec {
                sandbox_id: rec.id.clone(),
                name,
                template: rec.template.clone(),
                cpu_count: rec.cpu_count,
                memory_mb: rec.memory_mb,
                env: rec.env_vars.clone(),
            };
            let published = repo.publish(&spec, capture, dir.path()).await;
            timer.finish(published.is_ok());
            Ok(published?)
        })
        .await
    }

    /// Pauses a running sandbox (a paused one: nothing to do).
    pub async fn pause(self: &Arc<Self>, id: &str) -> Result<(), LifecycleError> {
        self.check_running()?;
        let this = self.clone();
        let id = id.to_string();
        self.detached(async move { this.pause_inner(&id).await })
            .await
    }

    async fn pause_inner(self: Arc<Self>, id: &str) -> Result<(), LifecycleError> {
        let slot = self.slot(id)?;
        let _op = slot.op.clone().lock_owned().await;
        self.pause_locked(&slot).await
    }

    async fn pause_locked(&self, slot: &Slot) -> Result<(), LifecycleError> {
        let rec = {
            let mut r = slot.rec.lock();
            match r.state {
                State::Paused => return Ok(()),
                State::Running => {}
                State::Killing => return Err(LifecycleError::NotFound(r.id.clone())),
                s => {
                    return Err(LifecycleError::InvalidState {
                        id: r.id.clone(),
                        state: s,
                        op: "pause",
                        needed: "running",
                    });
                }
            }
            r.state = State::Pausing;
            r.clone()
        };
        if !self.slots.lock().contains_key(&rec.id) {
            return Err(LifecycleError::NotFound(rec.id));
        }
        let timer = self.metrics.start("pause", "total");
        let result = async {
            self.backend.pause(&rec.id).await?;
            let mut paused = rec.clone();
            paused.state = State::Paused;
            paused.expires_at_ms = None;
            if let Err(e) = self.store.save(&paused) {
                let _ = self.backend.resume(&rec.id).await;
                return Err(LifecycleError::from(e));
            }
            Ok(())
        }
        .await;
        timer.finish(result.is_ok());
        let mut r = slot.rec.lock();
        match result {
            Ok(()) => {
                r.state = State::Paused;
                r.deadline = None;
                r.expires_at_ms = None;
                let out = r.clone();
                drop(r);
                self.event(&out, SandboxEventType::Pause);
                tracing::info!(sandbox = %out.id, "sandbox paused");
                Ok(())
            }
            Err(e) => {
                r.state = State::Running;
                Err(e)
            }
        }
    }

    /// Resumes a paused sandbox with `timeout` (default: the node's). A running one only
    /// gets its timeout set.
    pub async fn resume(
        self: &Arc<Self>,
        id: &str,
        timeout: Option<Duration>,
    ) -> Result<SandboxRecord, LifecycleError> {
        self.check_running()?;
        let t = timeout.unwrap_or(self.cfg.default_timeout);
        self.check_timeout(t)?;
        let this = self.clone();
        let id = id.to_string();
        self.detached(async move {
            let slot = this.slot(&id)?;
            let _op = slot.op.clone().lock_owned().await;
            let state = slot.rec.lock().state;
            match state {
                State::Running => {
                    let mut r = slot.rec.lock();
                    r.set_deadline(t);
                    Ok(r.clone())
                }
                State::Paused => this.resume_locked(&slot, t).await,
                State::Killing => Err(LifecycleError::NotFound(id)),
                s => Err(LifecycleError::InvalidState {
                    id,
                    state: s,
                    op: "resume",
                    needed: "paused",
                }),
            }
        })
        .await
    }

    /// `connect`: extends a running sandbox's timeout (never shortens), resumes a paused one.
    pub async fn connect(
        self: &Arc<Self>,
        id: &str,
        timeout: Option<Duration>,
    ) -> Result<(SandboxRecord, Connected), LifecycleError> {
        self.check_running()?;
        let t = timeout.unwrap_or(self.cfg.default_timeout);
        self.check_timeout(t)?;
        let this = self.clone();
        let id = id.to_string();
        self.detached(async move {
            let slot = this.slot(&id)?;
            let _op = slot.op.clone().lock_owned().await;
            let state = slot.rec.lock().state;
            match state {
                State::Running => {
                    let mut r = slot.rec.lock();
                    let new = Instant::now() + t;
                    if r.deadline.is_none_or(|d| d < new) {
                        r.set_deadline(t);
                    }
                    Ok((r.clone(), Connected::WasRunning))
                }
                State::Paused => Ok((this.resume_locked(&slot, t).await?, Connected::Resumed)),
                State::Killing => Err(LifecycleError::NotFound(id)),
                s => Err(LifecycleError::InvalidState {
                    id,
                    state: s,
                    op: "connect",
                    needed: "running or paused",
                }),
            }
        })
        .await
    }

    async fn resume_locked(
        &self,
        slot: &Slot,
        timeout: Duration,
    ) -> Result<SandboxRecord, LifecycleError> {
        let mut rec = {
            let mut r = slot.rec.lock();
            r.state = State::Resuming;
            r.clone()
        };
        let timer = self.metrics.start("resume", "total");
        let result = if rec.restored {
            let started = self.start_backend(&mut rec, true).await;
            slot.rec.lock().kept = rec.kept.clone();
            started
        } else {
            match self.backend.resume(&rec.id).await {
                Ok(info) => Ok(info.address),
                Err(e) => Err(e.into()),
            }
        };
        timer.finish(result.is_ok());
        let mut r = slot.rec.lock();
        match result {
            Ok(addr) => {
                if let Err(e) = self.store.remove(&rec.id) {
                    tracing::warn!(sandbox = %rec.id, error = %e, "removing the paused record");
                }
                r.state = State::Running;
                r.restored = false;
                // The backend sandbox owns what was kept now.
                r.kept = None;
                r.address = Some(addr);
                r.set_deadline(timeout);
                let out = r.clone();
                drop(r);
                self.event(&out, SandboxEventType::Resume);
                tracing::info!(sandbox = %out.id, "sandbox resumed");
                Ok(out)
            }
            Err(e) => {
                r.state = State::Paused;
                Err(e)
            }
        }
    }

    /// Kills a sandbox and removes every trace of it.
    pub async fn delete(self: &Arc<Self>, id: &str) -> Result<(), LifecycleError> {
        self.check_running()?;
        let this = self.clone();
        let id = id.to_string();
        self.detached(async move {
            let slot = this.slot(&id)?;
            let _op = slot.op.clone().lock_owned().await;
            this.delete_locked(&slot).await
        })
        .await
    }

    async fn delete_locked(&self, slot: &Slot) -> Result<(), LifecycleError> {
        let (rec, previous) = {
            let mut r = slot.rec.lock();
            let prev = r.state;
            if !self.slots.lock().contains_key(&r.id) {
                return Err(LifecycleError::NotFound(r.id.clone()));
            }
            r.state = State::Killing;
            (r.clone(), prev)
        };
        let mut result = match self.backend.destroy(&rec.id).await {
            Ok(()) => Ok(()),
            Err(BackendError::NotFound(_)) => Ok(()),
            Err(e) => Err(e),
        };
        if let (Ok(()), Some(kept)) = (&result, &rec.kept) {
            result = self.backend.discard_kept(kept).await;
        }
        match result {
            Ok(()) => {
                if let Err(e) = self.store.remove(&rec.id) {
                    tracing::warn!(sandbox = %rec.id, error = %e, "removing the paused record");
                }
                self.slots.lock().remove(&rec.id);
                self.event(&rec, SandboxEventType::Delete);
                tracing::info!(sandbox = %rec.id, "sandbox deleted");
                Ok(())
            }
            Err(e) => {
                slot.rec.lock().state = previous;
                Err(e.into())
            }
        }
    }

    /// `POST /timeout`: the sandbox expires `timeout` from now (may shorten).
    pub async fn set_timeout(
        self: &Arc<Self>,
        id: &str,
        timeout: Duration,
    ) -> Result<(), LifecycleError> {
        self.check_running()?;
        self.check_timeout(timeout)?;
        let slot = self.slot(id)?;
        let _op = slot.op.lock().await;
        let mut r = slot.rec.lock();
        match r.state {
            State::Running => {
                r.timeout_secs = timeout.as_secs();
                r.set_deadline(timeout);
                Ok(())
            }
            State::Killing => Err(LifecycleError::NotFound(id.to_string())),
            s => Err(LifecycleError::InvalidState {
                id: id.to_string(),
                state: s,
                op: "setting the timeout",
                needed: "running",
            }),
        }
    }

    /// `POST /refreshes`: extends the timeout to `duration` from now, never shortens.
    pub async fn refresh(
        self: &Arc<Self>,
        id: &str,
        duration: Duration,
    ) -> Result<(), LifecycleError> {
        self.check_running()?;
        self.check_timeout(duration)?;
        let slot = self.slot(id)?;
        let _op = slot.op.lock().await;
        let mut r = slot.rec.lock();
        match r.state {
            State::Running => {
                let new = Instant::now() + duration;
                if r.deadline.is_none_or(|d| d < new) {
                    r.set_deadline(duration);
                }
                Ok(())
            }
            State::Killing => Err(LifecycleError::NotFound(id.to_string())),
            s => Err(LifecycleError::InvalidState {
                id: id.to_string(),
                state: s,
                op: "refresh",
                needed: "running",
            }),
        }
    }

    /// Where the data plane reaches a sandbox's `port`: resumes a paused sandbox with
    /// auto-resume, waits for one that is starting.
    pub async fn route(self: &Arc<Self>, id: &str) -> Result<SandboxRecord, RouteError> {
        for _ in 0..3 {
            let slot = self.slot(id).map_err(|_| RouteError::NotFound)?;
            let rec = slot.rec.lock().clone();
            match rec.state {
                State::Running if rec.address.is_some() => return Ok(rec),
                State::Paused if rec.auto_resume => {
                    if self.is_shutting_down() {
                        return Err(RouteError::NotProxyable);
                    }
                    let t =
                        Duration::from_secs(rec.timeout_secs).max(self.cfg.auto_resume_min_timeout);
                    let r = tokio::time::timeout(Duration::from_secs(60), self.resume(id, Some(t)))
                        .await;
                    match r {
                        Err(_) => return Err(RouteError::ResumeTimedOut),
                        Ok(Err(LifecycleError::NotFound(_))) => return Err(RouteError::NotFound),
                        Ok(Err(e)) => return Err(RouteError::ResumeFailed(e.to_string())),
                        Ok(Ok(_)) => continue,
                    }
                }
                State::Paused | State::Pausing => return Err(RouteError::NotProxyable),
                State::Killing => return Err(RouteError::NotFound),
                _ => {
                    // Starting or resuming: wait for the operation to finish.
                    let _op = slot.op.lock().await;
                }
            }
        }
        Err(RouteError::NotProxyable)
    }

    /// Pauses or kills every running sandbox whose timeout has passed.
    pub fn expire_due(self: &Arc<Self>) {
        let now = Instant::now();
        let due: Vec<(String, OnTimeout)> = self
            .list()
            .into_iter()
            .filter(|r| r.state == State::Running && r.deadline.is_some_and(|d| d <= now))
            .map(|r| (r.id, r.on_timeout))
            .collect();
        for (id, action) in due {
            let this = self.clone();
            tokio::spawn(async move {
                // Re-check under the operation lock: the timeout may have moved.
                let Ok(slot) = this.slot(&id) else { return };
                let _op = slot.op.clone().lock_owned().await;
                {
                    let r = slot.rec.lock();
                    if r.state != State::Running || r.deadline.is_none_or(|d| d > Instant::now()) {
                        return;
                    }
                }
                let result = match action {
                    OnTimeout::Pause => this.pause_locked(&slot).await,
                    OnTimeout::Kill => this.delete_locked(&slot).await,
                };
                match result {
                    Ok(()) => tracing::info!(sandbox = %id, ?action, "timeout expired"),
                    Err(e) => tracing::warn!(sandbox = %id, error = %e, "timeout action failed"),
                }
            });
        }
    }

    /// Runs [`Self::expire_due`] every `auto_evict_interval` until the node shuts down.
    pub fn start_ticker(self: &Arc<Self>) -> tokio::task::JoinHandle<()> {
        let this = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(this.cfg.auto_evict_interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                if this.is_shutting_down() {
                    return;
                }
                this.expire_due();
            }
        })
    }

    /// Graceful shutdown: refuses new operations, pauses every running sandbox (recorded
    /// on disk), then releases every backend sandbox. Paused sandboxes come back on the
    /// next start.
    pub async fn shutdown(self: &Arc<Self>) {
        self.begin_shutdown();
        let slots: Vec<Arc<Slot>> = self.slots.lock().values().cloned().collect();
        for slot in slots {
            let _op = slot.op.clone().lock_owned().await;
            let (id, state, released) = {
                let r = slot.rec.lock();
                (r.id.clone(), r.state, r.restored)
            };
            if released || !self.slots.lock().contains_key(&id) {
                continue;
            }
            if state == State::Running
                && let Err(e) = self.pause_locked(&slot).await
            {
                tracing::warn!(sandbox = %id, error = %e, "pause at shutdown failed; the sandbox is lost");
            }
            let paused = slot.rec.lock().state == State::Paused;
            let kept = if paused {
                match self.backend.keep(&id).await {
                    Ok(k) => Some(k),
                    Err(e) => {
                        tracing::warn!(sandbox = %id, error = %e, "keeping the sandbox's state at shutdown failed; it resumes from its template");
                        None
                    }
                }
            } else {
                None
            };
            if kept.is_none() {
                match self.backend.destroy(&id).await {
                    Ok(()) | Err(BackendError::NotFound(_)) => {}
                    Err(e) => {
                        tracing::warn!(sandbox = %id, error = %e, "releasing the sandbox at shutdown")
                    }
                }
            }
            // No backend sandbox is left: a later resume starts it afresh, from what
            // was kept.
            let rec = {
                let mut r = slot.rec.lock();
                r.restored = true;
                if kept.is_some() {
                    r.kept = kept;
                }
                r.clone()
            };
            if rec.kept.is_some() {
                if let Err(e) = self.store.save(&rec) {
                    tracing::warn!(sandbox = %id, error = %e, "recording the kept state at shutdown");
                }
            }
        }
        *self.events.lock() = None;
        tracing::info!("lifecycle stopped; paused sandboxes are recorded");
    }

    /// Counts and allocations for heartbeats and `GET /nodes`.
    pub fn usage(&self) -> SandboxUsage {
        let mut u = SandboxUsage {
            create_successes: self.create_successes.load(Ordering::Relaxed),
            create_fails: self.create_fails.load(Ordering::Relaxed),
            ..Default::default()
        };
        for r in self.list() {
            match r.state {
                State::Creating | State::Resuming => u.starting += 1,
                State::Paused => u.paused += 1,
                _ => u.running += 1,
            }
            if r.state == State::Paused {
                u.paused_allocated_cpu += r.cpu_count;
                u.paused_allocated_memory_bytes += r.memory_mb << 20;
            } else {
                u.allocated_cpu += r.cpu_count;
                u.allocated_memory_bytes += r.memory_mb << 20;
            }
        }
        u
    }
}

/// Why the data plane cannot reach a sandbox.
#[derive(Debug, thiserror::Error)]
pub enum RouteError {
    #[error("sandbox not found")]
    NotFound,
    #[error("sandbox is not proxyable in its current state")]
    NotProxyable,
    #[error("sandbox auto-resume timed out")]
    ResumeTimedOut,
    #[error("sandbox auto-resume failed: {0}")]
    ResumeFailed(String),
}

/// The orchestrator as the reporter's view of the node.
pub struct ReporterSource(pub Arc<Orchestrator>);

impl NodeSource for ReporterSource {
    fn sandbox_ids(&self) -> Vec<String> {
        let mut ids: Vec<String> = self.0.slots.lock().keys().cloned().collect();
        ids.sort();
        ids
    }

    fn sandbox_usage(&self) -> SandboxUsage {
        self.0.usage()
    }
}

/// RFC 3339 UTC with nanoseconds.
pub fn time_rfc3339(t: SystemTime) -> String {
    let d = t.duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default();
    let dt = time::OffsetDateTime::from_unix_timestamp_nanos(d.as_nanos() as i128)
        .unwrap_or(time::OffsetDateTime::UNIX_EPOCH);
    dt.format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_default()
}

/// RFC 3339 of ms since the epoch.
pub fn ms_rfc3339(ms: u64) -> String {
    time_rfc3339(SystemTime::UNIX_EPOCH + Duration::from_millis(ms))
}
