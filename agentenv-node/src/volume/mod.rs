//! Volumes: persistent directories on the shared storage that outlive sandboxes, mounted
//! read-write into any number of sandboxes at once, on any node of the cluster.
//!
//! A volume is a signed record on the snapshot repository's store (id, name, creation
//! time; see `store`) plus its files:
//!
//! * `posix_fs`: a directory on the shared mount, `<AENV_SNAPSHOT_STORE>/volumes/<id>/data`
//!   (`data`), bound into every sandbox that mounts the volume: every sandbox on every
//!   node sees the others' writes at once, as on any shared file system.
//! * `oss`: objects under `volumes/data/<id>/` in the bucket, served from a node-local
//!   copy that is made on the first mount and uploaded on pause, delete and shutdown
//!   (`sync`, which says what that does not promise).
//!
//! Files are stored with the ids sandboxes see (root inside is uid 0 on the volume): the
//! jail binds the directory id-mapped into each sandbox's id range, so every sandbox
//! sees the same owners. A volume's token (for the content API) is derived from the
//! node's seed and the volume's id (`record`); the content API's file operations are in
//! `content`.
//!
//! The rooms: `record` (records, names, mount paths, signing, tokens), `store` (records,
//! names and leases on the store), `data` (`posix_fs` directories), `sync` (`oss`
//! copies), `content` (the file operations of the content API).

pub mod content;
mod data;
mod record;
mod store;
mod sync;

pub use record::{
    MAX_MOUNTS, MAX_NAME_LEN, VolumeKey, VolumeRecord, validate_mount_path, validate_mounts,
    validate_name,
};
pub use store::Holder;

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use agentenv_core::storage::{Storage, StorageConfig, StorageError};
use parking_lot::Mutex;

use crate::backend::VolumeBind;
use crate::host::safefs::SafeFsError;
use crate::lifecycle::VolumeMount;
use data::PosixData;
use store::VolumeStore;
use sync::OssData;

/// Errors of volumes; the API maps each to a status.
#[derive(Debug, thiserror::Error)]
pub enum VolumeError {
    #[error("invalid volume name {0:?}: use 1 to 63 characters from [A-Za-z0-9_-]")]
    InvalidName(String),
    #[error(
        "the volume name {name:?} is taken by volume {id}: choose another name, or delete that volume first (DELETE /volumes/{id})"
    )]
    NameTaken { name: String, id: String },
    #[error("volume {0} not found")]
    NotFound(String),
    #[error(
        "volume {0:?} not found: create it first (POST /volumes with {{\"name\": \"{0}\"}}) or fix the name in volumeMounts"
    )]
    UnknownName(String),
    #[error(
        "volume {name} ({id}) is mounted by sandbox {sandbox} on node {node}{}: delete the sandboxes that mount it first",
        if *others > 0 { format!(" and {others} more") } else { String::new() }
    )]
    InUse {
        id: String,
        name: String,
        sandbox: String,
        node: String,
        others: usize,
    },
    #[error(
        "volume {id} holds more than {limit} files: the oss store does not sync it; remove files"
    )]
    TooManyFiles { id: String, limit: usize },
    #[error(
        "{what} is refused: {reason}, so it was not written by a node sharing this node's seed (or was changed since). Nodes sharing a store must share AENV_SANDBOX_ACCESS_TOKEN_HASH_SEED"
    )]
    Forged { what: String, reason: String },
    #[error("{what} in the store is unreadable: {reason}")]
    Corrupt { what: String, reason: String },
    #[error("volume store: {0}")]
    Storage(#[from] StorageError),
    #[error("volume files: {0}")]
    Files(#[from] SafeFsError),
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
}

/// Where the volumes' files are.
#[derive(Debug)]
enum Data {
    Posix(PosixData),
    Oss(OssData),
}

/// The volumes of one node: the records on the shared store, the files, and which of
/// this node's sandboxes use which.
#[derive(Debug)]
pub struct Volumes {
    store: VolumeStore,
    data: Data,
    node_id: String,
    /// Sandboxes of this node with their volumes in use (bound, not yet unbound).
    bound: Mutex<HashMap<String, Vec<String>>>,
}

impl Volumes {
    /// The volumes of the store `cfg` (opened as `storage`): on `posix_fs` the files are
    /// under `data_root` on the shared mount; on `oss` it holds this node's copies.
    pub fn open(
        storage: Arc<dyn Storage>,
        cfg: &StorageConfig,
        data_root: &Path,
        key: VolumeKey,
        node_id: &str,
    ) -> Result<Self, VolumeError> {
        let data = match cfg {
            StorageConfig::Fs { .. } => {
                let d = PosixData::open(data_root)?;
                d.sweep();
                Data::Posix(d)
            }
            StorageConfig::S3(_) => Data::Oss(OssData::open(data_root, storage.clone())?),
        };
        Ok(Self {
            store: VolumeStore::new(storage, key),
            data,
            node_id: node_id.to_string(),
            bound: Mutex::new(HashMap::new()),
        })
    }

    /// `posix_fs` or `oss`.
    pub fn kind(&self) -> &'static str {
        match self.data {
            Data::Posix(_) => "posix_fs",
            Data::Oss(_) => "oss",
        }
    }

    /// Creates volume `name` with no files.
    pub async fn create(&self, name: &str) -> Result<VolumeRecord, VolumeError> {
        let rec = self.store.create(name).await?;
        if let Data::Posix(d) = &self.data
            && let Err(e) = d.init(&rec.id)
        {
            if let Err(r) = self.store.remove(&rec.id).await {
                tracing::warn!(volume = %rec.id, error = %r, "removing a volume whose directory could not be made");
            }
            return Err(e);
        }
        tracing::info!(volume = %rec.id, name = %rec.name, "volume created");
        Ok(rec)
    }

    /// Every volume, oldest first.
    pub async fn list(&self) -> Result<Vec<VolumeRecord>, VolumeError> {
        self.store.list().await
    }

    /// Volume `id`, if it exists.
    pub async fn get(&self, id: &str) -> Result<Option<VolumeRecord>, VolumeError> {
        self.store.get(id).await
    }

    /// Volume `id`'s access token (see [`VolumeKey::token`]).
    pub fn token(&self, id: &str) -> String {
        self.store.key().token(&id.to_ascii_lowercase())
    }

    /// Whether `given` is volume `id`'s token (constant-time).
    pub fn token_ok(&self, id: &str, given: &str) -> bool {
        self.store.key().token_ok(&id.to_ascii_lowercase(), given)
    }

    /// Deletes volume `id` and its files; `false` when there was none.
    /// [`VolumeError::InUse`] when a sandbox (on any node) mounts it.
    pub async fn delete(&self, id: &str) -> Result<bool, VolumeError> {
        let Some(rec) = self.store.remove(id).await? else {
            return Ok(false);
        };
        let removed = match &self.data {
            Data::Posix(d) => d.destroy(&rec.id).map(drop),
            Data::Oss(d) => d.destroy(&rec.id).await,
        };
        if let Err(e) = removed {
            tracing::warn!(volume = %rec.id, error = %e, "the volume is deleted, its files are left behind");
        }
        tracing::info!(volume = %rec.id, name = %rec.name, "volume deleted");
        Ok(true)
    }

    /// Checks that every volume `mounts` names exists.
    pub async fn check(&self, mounts: &[VolumeMount]) -> Result<(), VolumeError> {
        for m in mounts {
            if self.store.by_name(&m.name).await?.is_none() {
                return Err(VolumeError::UnknownName(m.name.clone()));
            }
        }
        Ok(())
    }

    /// Makes the volumes `mounts` names ready for sandbox `sandbox` of this node: leases
    /// them (see `store`) and returns their directories on this host. Undo with
    /// [`Self::unbind`]; [`Self::forget`] drops the leases.
    pub async fn bind(
        &self,
        sandbox: &str,
        mounts: &[VolumeMount],
    ) -> Result<Vec<VolumeBind>, VolumeError> {
        let mut binds = Vec::new();
        for m in mounts {
            let r = async {
                let rec = self
                    .store
                    .by_name(&m.name)
                    .await?
                    .ok_or_else(|| VolumeError::UnknownName(m.name.clone()))?;
                self.store.lease(&rec, sandbox, &self.node_id).await?;
                let host = match &self.data {
                    Data::Posix(d) => d.ensure(&rec.id)?,
                    Data::Oss(d) => d.acquire(&rec.id).await?,
                };
                self.bound
                    .lock()
                    .entry(sandbox.to_string())
                    .or_default()
                    .push(rec.id.clone());
                Ok::<_, VolumeError>(host)
            }
            .await;
            match r {
                Ok(host) => binds.push(VolumeBind {
                    host,
                    path: m.path.clone(),
                }),
                Err(e) => {
                    self.unbind(sandbox).await;
                    return Err(e);
                }
            }
        }
        Ok(binds)
    }

    /// Sandbox `sandbox` no longer runs on this node: its volumes' copies are given back
    /// (on `oss`, the last user uploads them). Its leases stay. Failures are logged.
    pub async fn unbind(&self, sandbox: &str) {
        let ids = self.bound.lock().remove(sandbox).unwrap_or_default();
        if let Data::Oss(d) = &self.data {
            for id in ids {
                if let Err(e) = d.release(&id).await {
                    tracing::error!(volume = %id, sandbox, error = %e, "uploading the volume's changes failed; the node keeps its copy and uploads it on the next use");
                }
            }
        }
    }

    /// Sandbox `sandbox` was paused: on `oss`, its volumes' changes are uploaded.
    /// Failures are logged.
    pub async fn flush(&self, sandbox: &str) {
        let ids = self.bound.lock().get(sandbox).cloned().unwrap_or_default();
        if let Data::Oss(d) = &self.data {
            for id in ids {
                if let Err(e) = d.flush(&id).await {
                    tracing::warn!(volume = %id, sandbox, error = %e, "uploading the volume's changes at pause");
                }
            }
        }
    }

    /// Sandbox `sandbox` is gone for good: its leases on the volumes `mounts` names go
    /// (after [`Self::unbind`]). Failures are logged.
    pub async fn forget(&self, sandbox: &str, mounts: &[VolumeMount]) {
        self.unbind(sandbox).await;
        for m in mounts {
            let r = async {
                if let Some(rec) = self.store.by_name(&m.name).await? {
                    self.store.unlease(&rec.id, sandbox).await?;
                }
                Ok::<_, VolumeError>(())
            }
            .await;
            if let Err(e) = r {
                tracing::warn!(volume = %m.name, sandbox, error = %e, "removing the sandbox's lease on the volume");
            }
        }
    }

    /// Removes this node's leases of sandboxes that are not in `sandboxes` (the node's
    /// records at start: a node that stopped without deleting them leaves them behind).
    pub async fn reconcile(&self, sandboxes: &HashSet<String>) -> Result<usize, VolumeError> {
        let mut removed = 0;
        for h in self.store.all_holders().await? {
            if h.node == self.node_id && !sandboxes.contains(&h.sandbox_id) {
                self.store.unlease(&h.volume_id, &h.sandbox_id).await?;
                removed += 1;
            }
        }
        Ok(removed)
    }

    /// The data directory of volume `id` on this host, for the content API; give it
    /// back with [`Self::close_data`].
    pub async fn open_data(&self, id: &str) -> Result<PathBuf, VolumeError> {
        match &self.data {
            Data::Posix(d) => d.existing(id),
            Data::Oss(d) => d.acquire(id).await,
        }
    }

    /// Gives back what [`Self::open_data`] took (on `oss`, the last user uploads the
    /// changes).
    pub async fn close_data(&self, id: &str) -> Result<(), VolumeError> {
        match &self.data {
            Data::Posix(_) => Ok(()),
            Data::Oss(d) => d.release(id).await,
        }
    }
}
