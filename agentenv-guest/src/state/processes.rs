//! The table of running processes: what the agent keeps of each (its
//! config, its input, its terminal, who listens to its events).

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;
use tokio::net::unix::pipe;
use tokio::sync::mpsc;

use crate::connect::ConnectError;
use crate::proto::process::{
    ProcessConfig, ProcessEvent, ProcessInfo, ProcessSelector, process_selector,
};
use crate::pty::PtyMaster;
use crate::signal::signal_group;

/// Where input for a process goes.
#[derive(Debug)]
pub(crate) enum Input {
    Pipe(pipe::Sender),
    Pty(Arc<PtyMaster>),
}

/// One running process.
#[derive(Debug)]
pub struct Proc {
    pub(crate) pid: u32,
    pub(crate) tag: Option<String>,
    pub(crate) config: ProcessConfig,
    /// `None` once stdin is closed (or was never open).
    pub(crate) input: tokio::sync::Mutex<Option<Input>>,
    pub(crate) pty: Option<Arc<PtyMaster>>,
    subscribers: Mutex<Vec<mpsc::Sender<ProcessEvent>>>,
}

impl Proc {
    pub(crate) fn new(
        pid: u32,
        tag: Option<String>,
        config: ProcessConfig,
        input: Option<Input>,
        pty: Option<Arc<PtyMaster>>,
    ) -> Proc {
        Proc {
            pid,
            tag,
            config,
            input: tokio::sync::Mutex::new(input),
            pty,
            subscribers: Mutex::new(Vec::new()),
        }
    }

    /// A new listener for the process's events.
    pub(crate) fn subscribe(&self) -> mpsc::Receiver<ProcessEvent> {
        let (tx, rx) = mpsc::channel(64);
        self.subscribers.lock().push(tx);
        rx
    }

    /// Sends `ev` to every listener, dropping those that are gone.
    pub(crate) async fn emit(&self, ev: ProcessEvent) {
        let subs: Vec<_> = self.subscribers.lock().clone();
        let mut dead = Vec::new();
        for s in &subs {
            if s.send(ev.clone()).await.is_err() {
                dead.push(s.clone());
            }
        }
        if !dead.is_empty() {
            self.subscribers
                .lock()
                .retain(|s| !dead.iter().any(|d| d.same_channel(s)));
        }
    }

    /// Ends every listener's stream.
    pub(crate) fn unsubscribe_all(&self) {
        self.subscribers.lock().clear();
    }
}

/// The table of running processes.
#[derive(Debug, Default)]
pub struct ProcessTable {
    procs: Mutex<HashMap<u32, Arc<Proc>>>,
}

impl ProcessTable {
    /// The process a selector (pid or tag) names.
    pub(crate) fn find(&self, sel: Option<&ProcessSelector>) -> Result<Arc<Proc>, ConnectError> {
        let sel = sel.and_then(|s| s.selector.as_ref()).ok_or_else(|| {
            ConnectError::invalid_argument("a process selector (pid or tag) is required")
        })?;
        let procs = self.procs.lock();
        let found = match sel {
            process_selector::Selector::Pid(pid) => procs.get(pid).cloned(),
            process_selector::Selector::Tag(tag) => procs
                .values()
                .find(|p| p.tag.as_deref() == Some(tag.as_str()))
                .cloned(),
        };
        found.ok_or_else(|| {
            let what = match sel {
                process_selector::Selector::Pid(pid) => format!("pid {pid}"),
                process_selector::Selector::Tag(t) => format!("tag {t:?}"),
            };
            ConnectError::not_found(format!("process with {what} not found (not running)"))
        })
    }

    pub(crate) fn insert(&self, proc: Arc<Proc>) {
        self.procs.lock().insert(proc.pid, proc);
    }

    pub(crate) fn remove(&self, pid: u32) {
        self.procs.lock().remove(&pid);
    }

    pub(crate) fn contains(&self, pid: u32) -> bool {
        self.procs.lock().contains_key(&pid)
    }

    /// Every running process, by pid.
    pub(crate) fn infos(&self) -> Vec<ProcessInfo> {
        let procs = self.procs.lock();
        let mut processes: Vec<ProcessInfo> = procs
            .values()
            .map(|p| ProcessInfo {
                config: Some(p.config.clone()),
                pid: p.pid,
                tag: p.tag.clone(),
            })
            .collect();
        processes.sort_by_key(|p| p.pid);
        processes
    }

    /// Number of running processes.
    pub fn len(&self) -> usize {
        self.procs.lock().len()
    }

    /// Whether no process is running.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Sends SIGKILL to every process (agent shutdown).
    pub fn kill_all(&self) {
        for pid in self.procs.lock().keys() {
            let _ = signal_group(*pid, libc::SIGKILL);
        }
    }
}
