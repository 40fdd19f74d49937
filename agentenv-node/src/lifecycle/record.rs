//! What the node knows about one sandbox, and what a create asks for.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use super::state::{Op, State, next};
use crate::backend::{KeptState, SandboxAddress, SandboxSpec};
use crate::clock::ms_since_epoch;
use crate::egress::EgressPolicy;

/// What a pause kept of a sandbox: everything (`full`: memory and processes, the jail's
/// frozen cgroup) or its files only (`filesystem`: it starts afresh on resume).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PauseMode {
    Full,
    Filesystem,
}

impl PauseMode {
    /// `memory` of a pause or resume request: `false` asks for the files only.
    pub fn from_memory(memory: bool) -> Self {
        if memory { Self::Full } else { Self::Filesystem }
    }
}

/// How a sandbox of a custom template starts: the template's start and ready commands
/// and what they run with. Every fresh process tree of the sandbox (a create, a fork, a
/// resume from its files) runs them.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StartSpec {
    pub state: crate::template::catalog::RunState,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_cmd: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready_cmd: Option<String>,
}

impl StartSpec {
    /// Whether there is anything to run.
    pub fn runs_anything(&self) -> bool {
        self.start_cmd.is_some() || self.ready_cmd.is_some()
    }
}

/// What happens when a sandbox's timeout expires.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnTimeout {
    Pause,
    Kill,
}

/// What a create sets of a sandbox beyond its template, timeout and resources, and its
/// record keeps.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SandboxOptions {
    pub on_timeout: OnTimeout,
    pub auto_resume: bool,
    pub allow_internet_access: Option<bool>,
    pub allow_public_traffic: bool,
    pub metadata: BTreeMap<String, String>,
    pub env_vars: BTreeMap<String, String>,
    /// Whether a pause on timeout keeps memory and processes (`autoPauseMemory`); without,
    /// it keeps the files only.
    #[serde(default = "yes")]
    pub auto_pause_memory: bool,
    /// Egress rules, as the API took them (checked).
    #[serde(default, skip_serializing_if = "EgressRules::is_empty")]
    pub network: EgressRules,
    /// Volumes mounted into the sandbox.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volume_mounts: Vec<VolumeMount>,
}

fn yes() -> bool {
    true
}

pub use crate::egress::EgressRules;

/// A volume mounted into a sandbox: its name and the absolute path inside.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeMount {
    pub name: String,
    pub path: String,
}

impl Default for SandboxOptions {
    /// The API's defaults: pause on timeout, no auto-resume, public traffic allowed.
    fn default() -> Self {
        Self {
            on_timeout: OnTimeout::Pause,
            auto_resume: false,
            allow_internet_access: None,
            allow_public_traffic: true,
            metadata: BTreeMap::new(),
            env_vars: BTreeMap::new(),
            auto_pause_memory: true,
            network: EgressRules::default(),
            volume_mounts: Vec::new(),
        }
    }
}

/// What a create asks for (already validated for shape by the API).
#[derive(Debug, Clone)]
pub struct CreateRequest {
    /// The sandbox's id, when the caller chose it (an idempotent create's, see
    /// [`agentenv_core::idempotency`]); a new one otherwise.
    pub id: Option<String>,
    pub template: String,
    pub timeout: Option<Duration>,
    pub options: SandboxOptions,
    pub cpu_count: Option<u32>,
    pub memory_mb: Option<u64>,
    pub disk_size_mb: Option<u64>,
}

impl CreateRequest {
    /// A request with the API's defaults for `template`.
    pub fn new(template: impl Into<String>) -> Self {
        Self {
            id: None,
            template: template.into(),
            timeout: None,
            options: SandboxOptions::default(),
            cpu_count: None,
            memory_mb: None,
            disk_size_mb: None,
        }
    }
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
    #[serde(flatten)]
    pub options: SandboxOptions,
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
    ///
    /// [`SandboxBackend::keep`]: crate::backend::SandboxBackend::keep
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kept: Option<KeptState>,
    /// The snapshot the sandbox started from (its `templateID`), if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot_id: Option<String>,
    /// The name of that snapshot, if it had one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot_name: Option<String>,
    /// The start and ready commands of its custom template, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start: Option<StartSpec>,
    /// What its latest pause kept, while it is paused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pause_mode: Option<PauseMode>,
    /// When it was paused (ms since the epoch), while it is paused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub paused_at_ms: Option<u64>,
}

impl SandboxRecord {
    /// The sandbox expires `timeout` from now.
    pub(super) fn set_deadline(&mut self, timeout: Duration) {
        self.deadline = Some(Instant::now() + timeout);
        self.expires_at_ms = Some(ms_since_epoch(SystemTime::now() + timeout));
    }

    /// The sandbox expires `timeout` from now unless it expires later already.
    pub(super) fn extend_deadline(&mut self, timeout: Duration) {
        let new = Instant::now() + timeout;
        if self.deadline.is_none_or(|d| d < new) {
            self.set_deadline(timeout);
        }
    }

    /// Whether the sandbox's timeout has passed at `now` and may act on it.
    pub(super) fn is_due(&self, now: Instant) -> bool {
        next(self.state, Op::Expire).is_ok() && self.deadline.is_some_and(|d| d <= now)
    }

    /// What the backend needs to start the sandbox.
    pub(super) fn spec(&self) -> SandboxSpec {
        let mut spec = SandboxSpec::new(&self.id, &self.template);
        spec.cpu_count = self.cpu_count;
        spec.memory_mb = self.memory_mb;
        spec.disk_size_mb = self.disk_size_mb;
        spec.env = self.options.env_vars.clone();
        // Internet access is part of the policy (a deny of 0.0.0.0/0 that allowOut can
        // open), enforced in the sandbox's namespace, not by the host interface's name.
        spec.allow_internet_access = true;
        spec.egress = self.egress_policy();
        spec.kept = self.kept.clone();
        spec
    }

    /// The egress policy of the sandbox's rules and internet access. Rules on record were
    /// checked when they were taken; should they not parse, the sandbox gets no egress.
    pub fn egress_policy(&self) -> EgressPolicy {
        EgressPolicy::new(&self.options.network, self.options.allow_internet_access)
            .unwrap_or_else(|e| {
                tracing::error!(sandbox = %self.id, error = %e, "egress rules on record do not parse; denying all egress");
                EgressPolicy::new(&EgressRules::default(), Some(false))
                    .expect("the empty rules parse")
            })
    }
}
