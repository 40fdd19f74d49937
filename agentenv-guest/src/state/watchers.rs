//! The registry of polling watchers (`CreateWatcher`, `GetWatcherEvents`,
//! `RemoveWatcher`): each keeps the events seen since the last poll.

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;

use crate::connect::ConnectError;
use crate::proto::filesystem::FilesystemEvent;

/// Largest number of events a polling watcher keeps between polls.
const MAX_PENDING_EVENTS: usize = 65_536;

/// The events a polling watcher collected since the last poll; the oldest
/// go first when more than [`MAX_PENDING_EVENTS`] wait.
#[derive(Debug, Clone, Default)]
pub(crate) struct PendingEvents(Arc<Mutex<Vec<FilesystemEvent>>>);

impl PendingEvents {
    pub(crate) fn push(&self, fe: FilesystemEvent) {
        let mut ev = self.0.lock();
        if ev.len() >= MAX_PENDING_EVENTS {
            ev.remove(0);
        }
        ev.push(fe);
    }

    fn take(&self) -> Vec<FilesystemEvent> {
        std::mem::take(&mut *self.0.lock())
    }
}

/// A polling watcher.
#[derive(Debug)]
struct PollWatcher {
    events: PendingEvents,
    task: tokio::task::JoinHandle<()>,
}

/// Registry of polling watchers.
#[derive(Debug, Default)]
pub struct Watchers {
    map: Mutex<HashMap<String, PollWatcher>>,
}

fn not_found(id: &str) -> ConnectError {
    ConnectError::not_found(format!("watcher {id:?} not found"))
}

impl Watchers {
    /// Number of active polling watchers.
    pub fn len(&self) -> usize {
        self.map.lock().len()
    }

    /// Whether no polling watcher is active.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Registers the watcher whose `task` feeds `events`.
    pub(crate) fn insert(
        &self,
        id: String,
        events: PendingEvents,
        task: tokio::task::JoinHandle<()>,
    ) {
        self.map.lock().insert(id, PollWatcher { events, task });
    }

    /// The events since the last poll.
    pub(crate) fn take_events(&self, id: &str) -> Result<Vec<FilesystemEvent>, ConnectError> {
        let map = self.map.lock();
        let w = map.get(id).ok_or_else(|| not_found(id))?;
        Ok(w.events.take())
    }

    /// Stops and forgets a watcher.
    pub(crate) fn remove(&self, id: &str) -> Result<(), ConnectError> {
        let w = self.map.lock().remove(id).ok_or_else(|| not_found(id))?;
        w.task.abort();
        Ok(())
    }
}
