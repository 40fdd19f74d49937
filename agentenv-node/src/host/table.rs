//! The sandbox table every backend keeps: ids reserved by creates in flight, and the
//! sandboxes that are ready, with the lookups the `SandboxBackend` methods share.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use super::cgroup::SandboxCgroup;
use crate::backend::{BackendError, ResourceUsage, SandboxInfo, SandboxState};

/// One id of the table.
pub(crate) enum Entry<S> {
    /// A create holds the id; the sandbox is not usable yet.
    Creating,
    Ready(Arc<S>),
}

/// What the table needs of a backend's sandbox.
pub(crate) trait TableSandbox {
    fn info(&self) -> &Mutex<SandboxInfo>;
    fn cgroup(&self) -> &SandboxCgroup;
}

/// The sandboxes of one backend, by id.
pub(crate) struct SandboxTable<S>(Mutex<HashMap<String, Entry<S>>>);

impl<S: TableSandbox> SandboxTable<S> {
    pub(crate) fn new() -> Self {
        Self(Mutex::new(HashMap::new()))
    }

    /// The table itself (a panic elsewhere while it was held does not make it unusable).
    pub(crate) fn lock(&self) -> MutexGuard<'_, HashMap<String, Entry<S>>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Holds `id` for a create in flight (`dir_exists`: the sandbox's directory is
    /// already there, which makes the id taken too).
    pub(crate) fn begin(&self, id: &str, dir_exists: bool) -> Result<(), BackendError> {
        let mut map = self.lock();
        if map.contains_key(id) || dir_exists {
            return Err(BackendError::AlreadyExists(id.to_string()));
        }
        map.insert(id.to_string(), Entry::Creating);
        Ok(())
    }

    /// Ends the create of `id` begun with [`Self::begin`]: the sandbox is ready, or the
    /// id is free again.
    pub(crate) fn finish(
        &self,
        id: &str,
        result: Result<Arc<S>, BackendError>,
    ) -> Result<SandboxInfo, BackendError> {
        let mut map = self.lock();
        match result {
            Ok(sbx) => {
                let info = info_of(sbx.as_ref());
                map.insert(id.to_string(), Entry::Ready(sbx));
                Ok(info)
            }
            Err(e) => {
                map.remove(id);
                Err(e)
            }
        }
    }

    /// The ready sandbox `id`.
    pub(crate) fn ready(&self, id: &str) -> Result<Arc<S>, BackendError> {
        match self.lock().get(id) {
            Some(Entry::Ready(s)) => Ok(s.clone()),
            _ => Err(BackendError::NotFound(id.to_string())),
        }
    }

    /// Removes the ready sandbox `id` (destroy).
    pub(crate) fn remove_ready(&self, id: &str) -> Result<Arc<S>, BackendError> {
        let mut map = self.lock();
        if !matches!(map.get(id), Some(Entry::Ready(_))) {
            return Err(BackendError::NotFound(id.to_string()));
        }
        match map.remove(id) {
            Some(Entry::Ready(s)) => Ok(s),
            _ => Err(BackendError::NotFound(id.to_string())),
        }
    }

    /// Removes the sandbox `id` if it is paused (keep).
    pub(crate) fn remove_paused(&self, id: &str) -> Result<Arc<S>, BackendError> {
        let mut map = self.lock();
        let state = match map.get(id) {
            Some(Entry::Ready(s)) => info_of(s.as_ref()).state,
            _ => return Err(BackendError::NotFound(id.to_string())),
        };
        if state != SandboxState::Paused {
            return Err(BackendError::InvalidState {
                id: id.to_string(),
                state,
                needed: SandboxState::Paused,
            });
        }
        match map.remove(id) {
            Some(Entry::Ready(s)) => Ok(s),
            _ => Err(BackendError::NotFound(id.to_string())),
        }
    }

    /// The info of the ready sandbox `id`.
    pub(crate) fn get(&self, id: &str) -> Result<SandboxInfo, BackendError> {
        Ok(info_of(self.ready(id)?.as_ref()))
    }

    /// What the ready sandbox `id` uses now (its cgroup's counters).
    pub(crate) fn usage(&self, id: &str) -> Result<ResourceUsage, BackendError> {
        let u = self
            .ready(id)?
            .cgroup()
            .usage()
            .map_err(|e| BackendError::Setup(e.to_string()))?;
        Ok(ResourceUsage {
            cpu_time: Duration::from_nanos(u.cpu_ns),
            memory_bytes: u.memory_bytes,
            memory_limit_bytes: u.memory_limit_bytes,
            processes: u.processes,
            memory_cache_bytes: u.cache_bytes.min(u.memory_bytes),
            disk: None,
        })
    }

    /// The infos of every ready sandbox, by id.
    pub(crate) fn list(&self) -> Vec<SandboxInfo> {
        let mut out: Vec<SandboxInfo> = self
            .lock()
            .values()
            .filter_map(|e| match e {
                Entry::Ready(s) => Some(info_of(s.as_ref())),
                Entry::Creating => None,
            })
            .collect();
        out.sort_by(|a, b| a.id.cmp(&b.id));
        out
    }

    /// Every id in the table, creates in flight included.
    pub(crate) fn ids(&self) -> Vec<String> {
        self.lock().keys().cloned().collect()
    }
}

fn info_of<S: TableSandbox>(s: &S) -> SandboxInfo {
    s.info().lock().unwrap_or_else(|e| e.into_inner()).clone()
}
