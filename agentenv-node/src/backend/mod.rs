//! Sandbox backends: what the node needs from whatever runs a sandbox.
//!
//! A backend turns a [`SandboxSpec`] (template, CPU, memory, environment, network policy)
//! into a running sandbox whose guest agent (`agentenv-guest`, envd-compatible) listens on
//! [`SandboxAddress::agent`]. Two implementations share this shape:
//!
//! * `jail` ([`jail::JailBackend`]): the agent runs as PID 1 of a process tree in fresh
//!   mount, PID, network, UTS, IPC and cgroup namespaces, on an overlay root over a
//!   read-only template, limited by cgroups, with capabilities dropped and a seccomp
//!   filter. Pause freezes the cgroup.
//! * `microvm` (agentenv-vmm): the VMM runs inside the same kind of jail; the guest is
//!   reached through a tap device inside the same per-sandbox network namespace; pause
//!   writes a snapshot and stops the VMM.
//!
//! In both, the node reaches the agent and every guest port at one IPv4 address that
//! belongs to the sandbox's own network namespace, so the data plane does not care which
//! backend runs a sandbox.

pub mod agent;
pub mod jail;
pub mod microvm;

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

use crate::config::BackendKind;

/// The port the guest agent listens on inside every sandbox (envd's port).
pub const AGENT_PORT: u16 = 49983;

/// Longest sandbox id a backend accepts.
pub const MAX_SANDBOX_ID_LEN: usize = 64;

/// What to create.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxSpec {
    /// Sandbox id, chosen by the caller: `[A-Za-z0-9_-]{1,64}`.
    pub id: String,
    /// Template name (a root filesystem in the template store).
    pub template: String,
    /// Number of CPUs the sandbox may use (a CPU-time quota, not pinning). At least 1.
    pub cpu_count: u32,
    /// Memory limit in MiB (swap included). At least [`MIN_MEMORY_MB`].
    pub memory_mb: u64,
    /// Environment of the agent and so of every process it starts.
    pub env: BTreeMap<String, String>,
    /// Outbound traffic to the internet through NAT (`true`, the default) or none (the
    /// host interface is named for it and the host rules refuse all its traffic; the
    /// lifecycle leaves this on and says what is denied in `egress` instead).
    pub allow_internet_access: bool,
    /// What the sandbox may reach, enforced in its network namespace (default: all the
    /// node's floor lets through).
    #[serde(default)]
    pub egress: crate::egress::EgressPolicy,
    /// Most processes (threads included) at once; `None` uses the backend's default.
    pub max_processes: Option<u32>,
    /// Size of the sandbox's writable disk in MiB; `None` uses the backend's default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk_size_mb: Option<u64>,
    /// State kept by [`SandboxBackend::keep`] to start from instead of the bare template
    /// (jail: the writable layer; microvm: the snapshot). Create takes it over.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kept: Option<KeptState>,
    /// Volumes bound into the sandbox (jail only; see [`VolumeBind`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volumes: Vec<VolumeBind>,
}

/// A volume's directory on this host, bound read-write (`nosuid,nodev`) at `path` inside
/// the sandbox, id-mapped into the sandbox's id range: files on the volume are stored
/// with the ids the sandbox sees. `path` is absolute and normalized
/// ([`crate::volume::validate_mount_path`]); the mount point is made inside the
/// sandbox's root if missing, and a link on the way is refused, never followed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeBind {
    pub host: PathBuf,
    pub path: String,
}

/// What a backend kept of a stopped sandbox so that it can start again from it after a
/// node restart (jail: the overlay's writable layer; microvm: the snapshot). Record it
/// durably; a later [`SandboxSpec::kept`] reuses it, [`SandboxBackend::discard_kept`]
/// deletes it, and [`SandboxBackend::reconcile`] deletes every one not passed to it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeptState {
    /// Where the backend keeps it, under the node's data directory.
    pub path: PathBuf,
}

/// What [`SandboxBackend::snapshot`] wrote into a capture directory.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotCapture {
    /// The backend that can start sandboxes from it: a [`BackendKind`]'s name (`jail`,
    /// `microvm`).
    pub backend: String,
    /// The files of the capture, by name relative to the capture directory.
    pub files: Vec<String>,
}

impl SnapshotCapture {
    /// A capture of backend `kind` made of `files`.
    pub fn new(kind: BackendKind, files: Vec<String>) -> Self {
        Self {
            backend: kind.to_string(),
            files,
        }
    }

    /// The backend that took it, if it is one this node knows.
    pub fn kind(&self) -> Option<BackendKind> {
        self.backend.parse().ok()
    }
}

/// The smallest memory limit a sandbox may have, in MiB.
pub const MIN_MEMORY_MB: u64 = 16;

impl SandboxSpec {
    /// A spec with the defaults the API uses: 2 CPUs, 512 MiB, internet allowed.
    pub fn new(id: impl Into<String>, template: impl Into<String>) -> Self {
        Self {
            id: id.into(),
            template: template.into(),
            cpu_count: 2,
            memory_mb: 512,
            env: BTreeMap::new(),
            allow_internet_access: true,
            egress: crate::egress::EgressPolicy::default(),
            max_processes: None,
            disk_size_mb: None,
            kept: None,
            volumes: Vec::new(),
        }
    }
}

/// Whether a sandbox runs or is paused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SandboxState {
    Running,
    Paused,
}

/// Where the node reaches a sandbox.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxAddress {
    /// The sandbox's IPv4 address; every port the guest listens on is reached here.
    pub ip: Ipv4Addr,
    /// The port of the guest agent.
    pub agent_port: u16,
}

impl SandboxAddress {
    /// The socket address of the guest agent.
    pub fn agent(&self) -> SocketAddr {
        SocketAddr::from((self.ip, self.agent_port))
    }

    /// The socket address of any other guest port.
    pub fn port(&self, port: u16) -> SocketAddr {
        SocketAddr::from((self.ip, port))
    }
}

/// What a backend knows about one of its sandboxes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxInfo {
    pub id: String,
    pub template: String,
    pub state: SandboxState,
    pub address: SandboxAddress,
    pub cpu_count: u32,
    pub memory_mb: u64,
    pub allow_internet_access: bool,
    pub created_at: SystemTime,
}

/// Resources a sandbox uses right now.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResourceUsage {
    /// CPU time consumed since creation, all processes together.
    pub cpu_time: Duration,
    /// Memory charged to the sandbox, in bytes (page cache included).
    pub memory_bytes: u64,
    /// The memory limit, in bytes.
    pub memory_limit_bytes: u64,
    /// Processes (threads included) in the sandbox.
    pub processes: u64,
    /// Page cache charged to the sandbox, in bytes (part of `memory_bytes`).
    #[serde(default)]
    pub memory_cache_bytes: u64,
    /// The sandbox's writable disk, when the backend can tell (see [`DiskUsage`]).
    #[serde(default)]
    pub disk: Option<DiskUsage>,
}

/// Space on a sandbox's writable disk, in bytes. jail: its layer's file system (`total`
/// is the size less the file system's own metadata); microvm: its disk image (`used` is
/// what the image holds on the host, which deletes in the guest do not shrink).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DiskUsage {
    pub used_bytes: u64,
    pub total_bytes: u64,
}

/// What [`SandboxBackend::reconcile`] found and removed.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReconcileReport {
    /// Ids of leftover sandboxes that were cleaned up.
    pub removed_sandboxes: Vec<String>,
    /// Other leftovers (cgroups, links, address reservations) that were removed.
    pub removed_other: Vec<String>,
}

/// Errors of every backend. The message says what went wrong and, where it can, what to do.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error("invalid sandbox id {0:?}: use 1 to 64 characters from [A-Za-z0-9_-]")]
    InvalidId(String),
    #[error("sandbox {0} already exists")]
    AlreadyExists(String),
    #[error("sandbox {0} not found")]
    NotFound(String),
    #[error("template {0:?} not found")]
    UnknownTemplate(String),
    #[error("invalid limits: {0}")]
    InvalidLimits(String),
    /// A volume cannot be mounted where the create asked (the client's to fix).
    #[error("{0}")]
    BadVolumeMount(String),
    #[error("no free sandbox address in {pool}: destroy sandboxes or configure a larger pool")]
    AddressPoolExhausted { pool: String },
    #[error(
        "no free id range in the pool {pool}: destroy sandboxes or configure a larger AENV_JAIL_ID_POOL"
    )]
    IdPoolExhausted { pool: String },
    #[error("sandbox {id} is {state:?}, the operation needs it {needed:?}")]
    InvalidState {
        id: String,
        state: SandboxState,
        needed: SandboxState,
    },
    #[error("template: {0}")]
    Template(#[from] crate::template::TemplateError),
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{0}")]
    Setup(String),
    #[error("the {backend} backend cannot {op}: {hint}")]
    Unsupported {
        backend: BackendKind,
        op: &'static str,
        hint: &'static str,
    },
    #[error("the kept state {} cannot be used: {reason}; delete the sandbox and create it again", path.display())]
    BadKeptState { path: PathBuf, reason: String },
}

impl BackendError {
    pub(crate) fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Self::Io {
            context: context.into(),
            source,
        }
    }
}

/// Checks a sandbox id: 1 to 64 characters from `[A-Za-z0-9_-]`.
pub fn validate_sandbox_id(id: &str) -> Result<(), BackendError> {
    let ok = !id.is_empty()
        && id.len() <= MAX_SANDBOX_ID_LEN
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    if ok {
        Ok(())
    } else {
        Err(BackendError::InvalidId(id.to_string()))
    }
}

/// Runs sandboxes. Every method is safe to call concurrently, also for one sandbox.
#[async_trait]
pub trait SandboxBackend: Send + Sync {
    /// Which backend this is (named `jail`, `microvm`).
    fn kind(&self) -> BackendKind;

    /// Creates and starts a sandbox from a template. Returns once the sandbox's processes
    /// (or VM) run; the agent may still be starting (see [`agent::wait_ready`]). A failure
    /// leaves nothing behind.
    async fn create(&self, spec: SandboxSpec) -> Result<SandboxInfo, BackendError>;

    /// Stops a running sandbox in place, keeping memory and processes (jail: frozen cgroup;
    /// microvm: snapshot, VMM stopped). Pausing a paused sandbox succeeds.
    async fn pause(&self, id: &str) -> Result<(), BackendError>;

    /// Continues a paused sandbox; returns its info, whose address may differ from before
    /// the pause (a microvm may resume in another network slot). Resuming a running
    /// sandbox succeeds.
    async fn resume(&self, id: &str) -> Result<SandboxInfo, BackendError>;

    /// Stops a sandbox and removes every trace of it: processes, namespaces, cgroup, links,
    /// writable layer, address.
    async fn destroy(&self, id: &str) -> Result<(), BackendError>;

    /// Stops a sandbox at once and leaves the rest of its destroy to the backend's cleanup
    /// queue. Once this returns, every process of the sandbox has been killed (none runs
    /// again; the kernel may still be ending them) and the backend no longer knows it;
    /// what it held (layer, cgroup, namespace and veth, address, id range, directory) is
    /// given back in the background once they are gone, and handed to no other sandbox
    /// before. A backend without a queue destroys the sandbox in one go.
    async fn kill(&self, id: &str) -> Result<(), BackendError> {
        self.destroy(id).await
    }

    /// What the cleanup queue of [`SandboxBackend::kill`] did so far.
    fn cleanups(&self) -> crate::host::cleanup::CleanupStats {
        crate::host::cleanup::CleanupStats::default()
    }

    /// Waits until the cleanup queue is empty or `timeout` passed; whether it is empty.
    async fn drain_cleanups(&self, timeout: Duration) -> bool {
        let _ = timeout;
        true
    }

    /// Replaces a sandbox's egress policy (running or paused) at once: the kernel rules in
    /// its namespace and its egress proxy; established flows to what is denied now are
    /// cut at their next packet.
    async fn set_egress(
        &self,
        id: &str,
        policy: crate::egress::EgressPolicy,
    ) -> Result<(), BackendError> {
        let _ = (id, policy);
        Err(BackendError::Unsupported {
            backend: self.kind(),
            op: "change a sandbox's egress rules",
            hint: "its sandboxes keep the rules they were created with",
        })
    }

    /// The sandbox's info (state and address).
    async fn get(&self, id: &str) -> Result<SandboxInfo, BackendError>;

    /// Resources the sandbox uses now.
    async fn usage(&self, id: &str) -> Result<ResourceUsage, BackendError>;

    /// Every sandbox this backend runs, for reconciliation with the node's records.
    async fn list(&self) -> Vec<SandboxInfo>;

    /// Stops a paused sandbox and releases what it holds (processes, namespaces, cgroup,
    /// address) except its state, which moves to a durable place under the node's data
    /// directory (jail: the writable layer; microvm: the snapshot). The sandbox is gone
    /// from the backend afterwards; create it again with [`SandboxSpec::kept`].
    async fn keep(&self, id: &str) -> Result<KeptState, BackendError> {
        let _ = id;
        Err(BackendError::Unsupported {
            backend: self.kind(),
            op: "keep a sandbox's state",
            hint: "its paused sandboxes start afresh after a node restart",
        })
    }

    /// Deletes state kept by [`SandboxBackend::keep`] (absent is fine).
    async fn discard_kept(&self, kept: &KeptState) -> Result<(), BackendError> {
        let _ = kept;
        Err(BackendError::Unsupported {
            backend: self.kind(),
            op: "discard kept state",
            hint: "it never keeps any",
        })
    }

    /// Captures a running sandbox into `dir` (an empty node-local directory) so that new
    /// sandboxes can start from it, on this node or another; the sandbox keeps running.
    /// jail: the writable layer (files; processes are not captured); microvm: the VM
    /// snapshot.
    async fn snapshot(&self, id: &str, dir: &Path) -> Result<SnapshotCapture, BackendError> {
        let _ = (id, dir);
        Err(BackendError::Unsupported {
            backend: self.kind(),
            op: "snapshot a sandbox",
            hint: "use a node with the jail backend for snapshots",
        })
    }

    /// Captures the kept state `kept` (a paused sandbox's files, see
    /// [`SandboxBackend::keep`]) into `dir` as a snapshot capture, so that the sandbox can
    /// be started from it on another node; `kept` is left as it was. jail: the writable
    /// layer, owners relative to the sandbox's id range.
    async fn capture_kept(
        &self,
        kept: &KeptState,
        dir: &Path,
    ) -> Result<SnapshotCapture, BackendError> {
        let _ = (kept, dir);
        Err(BackendError::Unsupported {
            backend: self.kind(),
            op: "move a paused sandbox to another node",
            hint: "move paused sandboxes between nodes with the jail backend",
        })
    }

    /// Captures a running sandbox's state as a kept state a create starts from
    /// ([`SandboxSpec::kept`]), for a fork; the sandbox keeps running. jail: a copy of its
    /// writable layer, taken while it is frozen for a moment (processes are not copied);
    /// microvm: not yet.
    async fn fork(&self, id: &str) -> Result<KeptState, BackendError> {
        let _ = id;
        Err(BackendError::Unsupported {
            backend: self.kind(),
            op: "fork a sandbox",
            hint: "fork sandboxes on a node with the jail backend",
        })
    }

    /// `count` copies of the kept state `kept` (made by [`SandboxBackend::fork`]), one for
    /// each further fork.
    async fn copy_kept(
        &self,
        kept: &KeptState,
        count: usize,
    ) -> Result<Vec<KeptState>, BackendError> {
        let _ = (kept, count);
        Err(BackendError::Unsupported {
            backend: self.kind(),
            op: "copy a fork's state",
            hint: "fork sandboxes on a node with the jail backend",
        })
    }

    /// Turns a capture (its files downloaded into `dir`) into state a create starts from
    /// ([`SandboxSpec::kept`]); `dir` may be consumed.
    async fn import_snapshot(
        &self,
        capture: &SnapshotCapture,
        dir: &Path,
    ) -> Result<KeptState, BackendError> {
        let _ = (capture, dir);
        Err(BackendError::Unsupported {
            backend: self.kind(),
            op: "start a sandbox from a snapshot",
            hint: "start it on a node with the backend that took the snapshot",
        })
    }

    /// Finds leftovers of sandboxes from an earlier node process that did not shut down
    /// cleanly and removes them, together with kept state that is not in `kept` (what
    /// the node's records still reference). Called once at startup, before the first
    /// create.
    async fn reconcile(&self, kept: &[KeptState]) -> Result<ReconcileReport, BackendError>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sandbox_ids_are_checked() {
        assert!(validate_sandbox_id("sbx-1_A").is_ok());
        assert!(validate_sandbox_id("").is_err());
        assert!(validate_sandbox_id("../etc").is_err());
        assert!(validate_sandbox_id("a b").is_err());
        assert!(validate_sandbox_id(&"x".repeat(65)).is_err());
        assert!(validate_sandbox_id(&"x".repeat(64)).is_ok());
    }

    #[test]
    fn address_gives_agent_and_ports() {
        let a = SandboxAddress {
            ip: Ipv4Addr::new(10, 12, 0, 2),
            agent_port: AGENT_PORT,
        };
        assert_eq!(a.agent().to_string(), "10.12.0.2:49983");
        assert_eq!(a.port(8080).to_string(), "10.12.0.2:8080");
    }
}
