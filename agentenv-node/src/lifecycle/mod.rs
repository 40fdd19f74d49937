//! The sandbox lifecycle: a state machine per sandbox on top of a [`SandboxBackend`].
//!
//! Every operation on one sandbox holds that sandbox's operation lock, so concurrent
//! requests are serialized and a second pause (or resume) simply finds the work done.
//! Which operation may move a sandbox to which state is one table, [`next`]. State
//! changes are made under the record lock, so readers (list, get, the data plane) always
//! see a consistent state. Operations run in detached tasks: a client that disconnects
//! never leaves a half-done step behind.
//!
//! Paused sandboxes are recorded on disk (one JSON file each, written with fsync); at
//! start the records come back as paused sandboxes. At shutdown the backend keeps each
//! paused sandbox's state (jail: its writable layer) and the record names it, so a
//! restored sandbox resumes from it; a backend that cannot keep processes across a node
//! restart (the jail) starts them afresh, on the sandbox's own files.
//!
//! The rooms: `state` (the table), `record` (what is known of a sandbox), `create`
//! (create, delete and starting a backend sandbox), `pause` (pause, resume, connect,
//! shutdown), `timeout` (timeouts and their expiry), `snapshot` (snapshots, and
//! creates from them), `fork` (forks of a running sandbox), `listing` (get, list, usage,
//! the data plane's route), `network` (replacing a sandbox's egress rules), `observe`
//! (resource samples and sandbox logs), `volumes` (a sandbox's volumes through its life),
//! `moves` (a paused sandbox handed to another node), `pool` (started sandboxes waiting
//! for a create).

mod build;
mod create;
mod fork;
mod listing;
mod metrics;
mod moves;
mod network;
mod observe;
mod pause;
mod persist;
mod pool;
mod record;
mod snapshot;
mod state;
mod timeout;
mod volumes;

pub use build::{BUILD_STALE_AFTER, BuildFailure, BuildSettings, DEFAULT_TAG, Templates};
pub use fork::{ForkOutcome, MAX_FORKS};
pub use listing::{ReporterSource, RouteError};
pub use metrics::{LifecycleMetrics, StageTimer};
pub use moves::Export;
pub use persist::{PausedStore, PersistError};
pub use pool::{PoolSettings, PoolUsage};
pub use record::{
    CreateRequest, EgressRules, OnTimeout, PauseMode, SandboxOptions, SandboxRecord, StartSpec,
    VolumeMount,
};
pub use state::{Op, State, TransitionError, next};

use std::collections::HashMap;
use std::ops::Deref;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use agentenv_core::proto::scheduler_v1::{SandboxEvent, SandboxEventType};
use parking_lot::{Mutex, MutexGuard};
use tokio::sync::mpsc;

use crate::access::TokenIssuer;
use crate::backend::{BackendError, SandboxBackend};
use crate::config::BackendKind;
use crate::snapshot::{SnapshotError, SnapshotRepo};

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
    #[error("{0}")]
    Conflict(String),
    /// Not now; the request may succeed later (503).
    #[error("{0}")]
    Unavailable(String),
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
    #[error(transparent)]
    Catalog(#[from] crate::template::catalog::CatalogError),
    #[error(transparent)]
    Volume(#[from] crate::volume::VolumeError),
    #[error(
        "this node has no snapshot repository: configure AENV_SNAPSHOT_STORE (a directory shared by the nodes) or the oss repository"
    )]
    NoSnapshotRepository,
}

impl TransitionError {
    /// The error of refusing this on sandbox `id`: a sandbox being deleted is not found.
    pub fn for_sandbox(self, id: &str) -> LifecycleError {
        match self {
            TransitionError::Gone => LifecycleError::NotFound(id.to_string()),
            TransitionError::Invalid { state, op } => LifecycleError::InvalidState {
                id: id.to_string(),
                state,
                op: op.name(),
                needed: op.needs(),
            },
        }
    }
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
    /// Time between two resource samples of a running sandbox.
    pub metrics_interval: Duration,
    /// Resource samples kept per sandbox.
    pub metrics_history: usize,
    /// A sandbox's writable disk (MiB) when its create names none (`None`: unknown).
    pub default_disk_size_mb: Option<u64>,
    /// Pools of started sandboxes (none by default).
    pub pool: PoolSettings,
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
            metrics_interval: Duration::from_secs(5),
            metrics_history: crate::observe::ring::DEFAULT_HISTORY,
            default_disk_size_mb: None,
            pool: PoolSettings::default(),
        }
    }
}

/// Whether a connect resumed the sandbox (201) or found it running (200).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Connected {
    WasRunning,
    Resumed,
}

/// One sandbox: its operation lock (held for a whole operation) and its record (held
/// for moments, to read or change it).
struct Slot {
    id: String,
    op: Arc<tokio::sync::Mutex<()>>,
    rec: Mutex<SandboxRecord>,
}

/// A sandbox's slot with its operation lock held.
struct Locked {
    slot: Arc<Slot>,
    _op: tokio::sync::OwnedMutexGuard<()>,
}

impl Deref for Locked {
    type Target = Slot;

    fn deref(&self) -> &Slot {
        &self.slot
    }
}

impl Slot {
    fn new(rec: SandboxRecord) -> Arc<Self> {
        Arc::new(Self {
            id: rec.id.clone(),
            op: Arc::new(tokio::sync::Mutex::new(())),
            rec: Mutex::new(rec),
        })
    }

    /// Waits for the operation lock.
    async fn lock(self: Arc<Self>) -> Locked {
        let op = self.op.clone().lock_owned().await;
        Locked {
            slot: self,
            _op: op,
        }
    }

    /// Moves the record by `op` (see [`next`]); returns it, still locked, and the state
    /// it left.
    fn step(&self, op: Op) -> Result<(MutexGuard<'_, SandboxRecord>, State), LifecycleError> {
        let mut r = self.rec.lock();
        let before = r.state;
        r.state = next(before, op).map_err(|e| e.for_sandbox(&self.id))?;
        Ok((r, before))
    }

    /// The step in progress succeeded ([`Op::Done`]); returns the record, still locked.
    fn done(&self) -> MutexGuard<'_, SandboxRecord> {
        let mut r = self.rec.lock();
        match next(r.state, Op::Done) {
            Ok(s) => r.state = s,
            Err(e) => tracing::error!(sandbox = %self.id, error = %e, "no step in progress"),
        }
        r
    }

    /// The step in progress failed: the sandbox is back in the state it started from.
    fn undo(&self, before: State) {
        self.rec.lock().state = before;
    }
}

/// The lifecycle engine of one node.
pub struct Orchestrator {
    backend: Arc<dyn SandboxBackend>,
    kind: BackendKind,
    cfg: LifecycleConfig,
    tokens: TokenIssuer,
    store: PausedStore,
    slots: Mutex<HashMap<String, Arc<Slot>>>,
    shutting_down: AtomicBool,
    events: Mutex<Option<mpsc::UnboundedSender<SandboxEvent>>>,
    snapshots: OnceLock<Arc<SnapshotRepo>>,
    templates: OnceLock<Arc<Templates>>,
    volumes: OnceLock<Arc<crate::volume::Volumes>>,
    create_successes: AtomicU64,
    create_fails: AtomicU64,
    metrics: LifecycleMetrics,
    /// Resource samples of the sandboxes.
    samples: crate::observe::MetricStore,
    /// Where sandbox logs go.
    logs: OnceLock<Arc<crate::observe::LogBook>>,
    /// Started sandboxes waiting for a create.
    pools: pool::Pools,
}

impl Orchestrator {
    /// An engine over `backend`, with paused sandboxes restored from `store`.
    pub fn new(
        backend: Arc<dyn SandboxBackend>,
        cfg: LifecycleConfig,
        tokens: TokenIssuer,
        store: PausedStore,
    ) -> Result<Arc<Self>, LifecycleError> {
        let kind = backend.kind();
        let mut slots = HashMap::new();
        for mut rec in store.load_all()? {
            rec.state = next(rec.state, Op::Restore).map_err(|e| e.for_sandbox(&rec.id))?;
            rec.restored = true;
            rec.deadline = None;
            rec.expires_at_ms = None;
            tracing::info!(sandbox = %rec.id, "restored paused sandbox");
            slots.insert(rec.id.clone(), Slot::new(rec));
        }
        let samples = crate::observe::MetricStore::new(cfg.metrics_history);
        let pools = pool::Pools::new(cfg.pool.clone());
        Ok(Arc::new(Self {
            backend,
            kind,
            cfg,
            tokens,
            store,
            slots: Mutex::new(slots),
            shutting_down: AtomicBool::new(false),
            events: Mutex::new(None),
            snapshots: OnceLock::new(),
            templates: OnceLock::new(),
            volumes: OnceLock::new(),
            create_successes: AtomicU64::new(0),
            create_fails: AtomicU64::new(0),
            metrics: LifecycleMetrics::default(),
            samples,
            logs: OnceLock::new(),
            pools,
        }))
    }

    /// Stage timings, for the node's `/metrics`.
    pub fn metrics(&self) -> &LifecycleMetrics {
        &self.metrics
    }

    /// What the backend's cleanup queue of deleted sandboxes did so far.
    pub fn cleanups(&self) -> crate::host::cleanup::CleanupStats {
        self.backend.cleanups()
    }

    /// Waits until the backend has cleaned up every deleted sandbox, or `timeout`
    /// passed; whether it has.
    pub async fn drain_cleanups(&self, timeout: Duration) -> bool {
        self.backend.drain_cleanups(timeout).await
    }

    /// The token issuer of this node.
    pub fn tokens(&self) -> &TokenIssuer {
        &self.tokens
    }

    /// The backend that runs this node's sandboxes.
    pub fn backend_kind(&self) -> BackendKind {
        self.kind
    }

    pub fn config(&self) -> &LifecycleConfig {
        &self.cfg
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
                requested_disk_bytes: self.disk_size_mb(rec) << 20,
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

    /// Whether the node takes an operation (with `timeout`, when it sets one).
    fn admit(&self, timeout: Option<Duration>) -> Result<(), LifecycleError> {
        if self.is_shutting_down() {
            return Err(LifecycleError::ShuttingDown);
        }
        match timeout {
            Some(t) if t > self.cfg.max_timeout => Err(LifecycleError::BadRequest(format!(
                "timeout {} s is more than the allowed {} s",
                t.as_secs(),
                self.cfg.max_timeout.as_secs()
            ))),
            _ => Ok(()),
        }
    }

    fn slot(&self, id: &str) -> Result<Arc<Slot>, LifecycleError> {
        self.slots
            .lock()
            .get(id)
            .cloned()
            .ok_or_else(|| LifecycleError::NotFound(id.to_string()))
    }

    /// Whether sandbox `id` still has its slot (a delete or a failed create removes it
    /// while others wait for its lock).
    fn is_present(&self, id: &str) -> bool {
        self.slots.lock().contains_key(id)
    }

    /// Finds sandbox `id` and takes its operation lock.
    async fn lock(&self, id: &str) -> Result<Locked, LifecycleError> {
        Ok(self.slot(id)?.lock().await)
    }

    /// Runs `f` on sandbox `id` with its operation lock held, in a detached task.
    async fn on_sandbox<T, F, Fut>(self: &Arc<Self>, id: &str, f: F) -> Result<T, LifecycleError>
    where
        T: Send + 'static,
        F: FnOnce(Arc<Self>, Locked) -> Fut + Send + 'static,
        Fut: Future<Output = Result<T, LifecycleError>> + Send + 'static,
    {
        let this = self.clone();
        let id = id.to_string();
        self.detached(async move {
            let sandbox = this.lock(&id).await?;
            f(this, sandbox).await
        })
        .await
    }

    /// Runs `f` in a detached task, so a dropped caller does not abort it.
    async fn detached<T, F>(&self, f: F) -> Result<T, LifecycleError>
    where
        T: Send + 'static,
        F: Future<Output = Result<T, LifecycleError>> + Send + 'static,
    {
        match tokio::spawn(f).await {
            Ok(r) => r,
            Err(e) => Err(LifecycleError::Internal(format!(
                "lifecycle task failed: {e}"
            ))),
        }
    }
}
