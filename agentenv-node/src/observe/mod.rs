//! What the node observes of its sandboxes and of itself: per-sandbox logs, per-sandbox
//! resource samples, and the host's own CPU, memory and disks.
//!
//! The rooms: `logbook` (a sandbox's log: JSON lines on the node's disk, bounded and
//! rotated, and the queries the API runs on it), `output` (a sandbox's untrusted output
//! turned into log entries: lines cut, escapes and control characters removed, a rate
//! budget), `ring` (resource samples kept in a bounded ring per sandbox, CPU percent,
//! time ranges), `host` (the host sampler heartbeats and `GET /nodes` share).
//!
//! The sampling task and the lifecycle events that feed these live with the lifecycle
//! (`lifecycle/observe.rs`); the jail feeds its agent's output in `backend/jail`.

pub mod host;
pub mod logbook;
pub mod output;
pub mod ring;

pub use host::{HostSample, HostSampler};
pub use logbook::{Level, LogBook, LogEntry, LogQuery, SandboxLog};
pub use ring::{MetricStore, Range, Sample};
