//! The snapshot repository: published snapshots on shared [`Storage`], readable by every
//! node that points at the same store.
//!
//! Layout (keys under the store's root; the `posix_fs` root is
//! `<AENV_SNAPSHOT_STORE>/repository`, the `oss` root is the bucket's prefix):
//!
//! ```text
//! catalog/records/<id>.json      the SnapshotRecord (written last: a snapshot exists once it is there)
//! catalog/aliases/<name>         posix_fs: the id as a JSON string
//! catalog/aliases/<name>.json    oss: the same
//! snapshots/<id>/<file>          posix_fs: the capture's files and manifest.json
//! artifacts/<id>/<file>          oss: the same
//! ```
//!
//! Publishing claims the alias first (an atomic create, so two nodes never bind one name
//! to two snapshots), uploads the files, then creates the record. Deleting removes the
//! record first (no new sandbox can start from it), then the alias, then the files.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::SystemTime;

use agentenv_core::storage::{Storage, StorageConfig, StorageError};
use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::backend::SnapshotCapture;

/// Largest catalog record or alias object read.
const MAX_RECORD: usize = 1 << 20;

/// Errors of the snapshot repository.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    #[error("invalid snapshot name {0:?}: use 1 to 128 characters from [A-Za-z0-9_-]")]
    InvalidName(String),
    #[error("the name {0:?} is reserved for the built-in template; choose another name")]
    ReservedName(String),
    #[error(
        "the name {name:?} is already bound to snapshot {id}: choose another name, or delete that snapshot first (DELETE /templates/{name})"
    )]
    AliasConflict { name: String, id: String },
    #[error("snapshot {0} not found (deleted, or never published to this node's repository)")]
    NotFound(String),
    #[error(
        "snapshot {id} was taken by the {taken} backend; this node runs the {here} backend: start it on a node with the {taken} backend"
    )]
    WrongBackend {
        id: String,
        taken: String,
        here: String,
    },
    #[error(
        "snapshot {id} in the repository is unreadable: {reason}; delete it (DELETE /templates/{id})"
    )]
    Corrupt { id: String, reason: String },
    #[error("snapshot repository: {0}")]
    Storage(#[from] StorageError),
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
}

fn io(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> SnapshotError {
    let context = context.into();
    move |source| SnapshotError::Io { context, source }
}

/// Where a snapshot came from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SnapshotSource {
    Sandbox { source_sandbox_id: String },
}

/// Resources of sandboxes started from a snapshot (unless the create overrides them).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotResources {
    pub cpu_count: u32,
    pub memory_mb: u64,
    pub disk_size_mb: u64,
}

/// What a new sandbox needs to start from the snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Committed {
    /// The backend's capture (which backend, which files).
    pub capture: SnapshotCapture,
    /// The template the sandbox ran on (the snapshot's files lie over it).
    pub template: String,
    /// The sandbox's environment.
    pub env: BTreeMap<String, String>,
    /// Size of each file, for checking downloads.
    pub sizes: BTreeMap<String, u64>,
}

/// The catalog record of a published snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotRecord {
    pub version: u32,
    pub id: String,
    pub alias: Option<String>,
    pub source: SnapshotSource,
    pub resources: SnapshotResources,
    pub created_at_ms: u64,
    pub updated_at_ms: u64,
    pub committed: Committed,
}

/// What a snapshot is taken from.
#[derive(Debug, Clone)]
pub struct SnapshotSpec {
    pub sandbox_id: String,
    pub name: Option<String>,
    pub template: String,
    pub cpu_count: u32,
    pub memory_mb: u64,
    pub env: BTreeMap<String, String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Layout {
    PosixFs,
    Oss,
}

/// Checks a snapshot name: `[A-Za-z0-9_-]{1,128}`, not `base`, not shaped like an id.
pub fn validate_name(name: &str) -> Result<(), SnapshotError> {
    let ok = !name.is_empty()
        && name.len() <= 128
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    if !ok || crate::dataplane::is_uuid(name) {
        return Err(SnapshotError::InvalidName(name.to_string()));
    }
    if name == crate::template::BASE_TEMPLATE {
        return Err(SnapshotError::ReservedName(name.to_string()));
    }
    Ok(())
}

/// A file name without directories: what a capture's files are.
fn is_plain_file_name(f: &str) -> bool {
    !f.is_empty() && f != "." && f != ".." && !f.contains('/') && !f.contains('\0')
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// The repository of one node (the store may be shared with other nodes).
#[derive(Debug)]
pub struct SnapshotRepo {
    storage: Arc<dyn Storage>,
    layout: Layout,
    cache: PathBuf,
}

impl SnapshotRepo {
    /// A repository on `storage`, laid out for `cfg`'s kind, staging files under `cache`.
    pub fn new(
        storage: Arc<dyn Storage>,
        cfg: &StorageConfig,
        cache: impl Into<PathBuf>,
    ) -> Result<Self, SnapshotError> {
        let cache = cache.into();
        std::fs::create_dir_all(cache.join("staging"))
            .map_err(io(format!("creating {}", cache.display())))?;
        // Leftovers of captures and downloads of an earlier process.
        if let Ok(entries) = std::fs::read_dir(cache.join("staging")) {
            for e in entries.flatten() {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
        Ok(Self {
            storage,
            layout: match cfg {
                StorageConfig::Fs { .. } => Layout::PosixFs,
                StorageConfig::S3(_) => Layout::Oss,
            },
            cache,
        })
    }

    /// The store, for messages.
    pub fn describe(&self) -> String {
        self.storage.describe()
    }

    /// A new empty node-local directory for a capture or a download; removed on drop.
    pub fn staging_dir(&self) -> Result<StagingDir, SnapshotError> {
        let path = self
            .cache
            .join("staging")
            .join(uuid::Uuid::now_v7().to_string());
        std::fs::create_dir(&path).map_err(io(format!("creating {}", path.display())))?;
        Ok(StagingDir(path))
    }

    fn record_key(id: &str) -> String {
        format!("catalog/records/{id}.json")
    }

    fn alias_key(&self, name: &str) -> String {
        match self.layout {
            Layout::PosixFs => format!("catalog/aliases/{name}"),
            Layout::Oss => format!("catalog/aliases/{name}.json"),
        }
    }

    fn artifact_prefix(&self, id: &str) -> String {
        match self.layout {
            Layout::PosixFs => format!("snapshots/{id}/"),
            Layout::Oss => format!("artifacts/{id}/"),
        }
    }

    /// Reads a record by id (`None` when absent).
    pub async fn record(&self, id: &str) -> Result<Option<SnapshotRecord>, SnapshotError> {
        if !crate::dataplane::is_uuid(id) {
            return Ok(None);
        }
        let Some(raw) = self.storage.read(&Self::record_key(id), MAX_RECORD).await? else {
            return Ok(None);
        };
        serde_json::from_slice(&raw)
            .map(Some)
            .map_err(|e| SnapshotError::Corrupt {
                id: id.to_string(),
                reason: e.to_string(),
            })
    }

    async fn alias_target(&self, name: &str) -> Result<Option<String>, SnapshotError> {
        let Some(raw) = self.storage.read(&self.alias_key(name), MAX_RECORD).await? else {
            return Ok(None);
        };
        Ok(serde_json::from_slice::<String>(&raw).ok())
    }

    /// The snapshot `id_or_name` names (its id or its alias), if any.
    pub async fn resolve(&self, id_or_name: &str) -> Result<Option<SnapshotRecord>, SnapshotError> {
        if crate::dataplane::is_uuid(id_or_name) {
            return self.record(&id_or_name.to_ascii_lowercase()).await;
        }
        if validate_name(id_or_name).is_err() {
            return Ok(None);
        }
        match self.alias_target(id_or_name).await? {
            Some(id) => self.record(&id).await,
            None => Ok(None),
        }
    }

    /// Claims `name` for `id`: an atomic create; a name left behind by a snapshot that
    /// no longer exists (neither record nor files) is taken over.
    async fn claim_alias(&self, name: &str, id: &str) -> Result<(), SnapshotError> {
        let key = self.alias_key(name);
        let body = Bytes::from(serde_json::to_vec(id).unwrap_or_default());
        for _ in 0..2 {
            if self.storage.create_new(&key, body.clone()).await? {
                return Ok(());
            }
            let Some(other) = self.alias_target(name).await? else {
                continue;
            };
            let live = self.record(&other).await?.is_some()
                || !self
                    .storage
                    .list(&self.artifact_prefix(&other))
                    .await?
                    .is_empty();
            if live {
                return Err(SnapshotError::AliasConflict {
                    name: name.to_string(),
                    id: other,
                });
            }
            tracing::info!(name, stale = %other, "taking over a name whose snapshot is gone");
            self.storage.delete(&key).await?;
        }
        Err(SnapshotError::AliasConflict {
            name: name.to_string(),
            id: self.alias_target(name).await?.unwrap_or_default(),
        })
    }

    /// Deletes the alias `name` if it still names `id`.
    async fn release_alias(&self, name: &str, id: &str) -> Result<(), SnapshotError> {
        if self.alias_target(name).await?.as_deref() == Some(id) {
            self.storage.delete(&self.alias_key(name)).await?;
        }
        Ok(())
    }

    /// Publishes a capture (its files in `dir`) as a new snapshot.
    pub async fn publish(
        &self,
        spec: &SnapshotSpec,
        capture: SnapshotCapture,
        dir: &Path,
    ) -> Result<SnapshotRecord, SnapshotError> {
        if let Some(n) = &spec.name {
            validate_name(n)?;
        }
        let id = uuid::Uuid::now_v7().to_string();
        if let Some(n) = &spec.name {
            self.claim_alias(n, &id).await?;
        }
        let result = self.upload(&id, spec, capture, dir).await;
        if result.is_err() {
            if let Err(e) = self.storage.delete_prefix(&self.artifact_prefix(&id)).await {
                tracing::warn!(snapshot = %id, error = %e, "removing the files of a failed publish");
            }
            if let Some(n) = &spec.name
                && let Err(e) = self.release_alias(n, &id).await
            {
                tracing::warn!(snapshot = %id, error = %e, "releasing the name of a failed publish");
            }
        }
        result
    }

    async fn upload(
        &self,
        id: &str,
        spec: &SnapshotSpec,
        capture: SnapshotCapture,
        dir: &Path,
    ) -> Result<SnapshotRecord, SnapshotError> {
        let prefix = self.artifact_prefix(id);
        let mut sizes = BTreeMap::new();
        for f in &capture.files {
            if !is_plain_file_name(f) || f == "manifest.json" {
                return Err(SnapshotError::Io {
                    context: format!("publishing the capture file {f:?}"),
                    source: std::io::Error::from(std::io::ErrorKind::InvalidInput),
                });
            }
            let n = self
                .storage
                .put_file(&format!("{prefix}{f}"), &dir.join(f))
                .await?;
            sizes.insert(f.clone(), n);
        }
        let now = now_ms();
        let disk_size_mb = sizes.values().sum::<u64>().div_ceil(1 << 20);
        let record = SnapshotRecord {
            version: 1,
            id: id.to_string(),
            alias: spec.name.clone(),
            source: SnapshotSource::Sandbox {
                source_sandbox_id: spec.sandbox_id.clone(),
            },
            resources: SnapshotResources {
                cpu_count: spec.cpu_count,
                memory_mb: spec.memory_mb,
                disk_size_mb,
            },
            created_at_ms: now,
            updated_at_ms: now,
            committed: Committed {
                capture,
                template: spec.template.clone(),
                env: spec.env.clone(),
                sizes,
            },
        };
        let json = serde_json::to_vec_pretty(&record).map_err(|e| SnapshotError::Corrupt {
            id: id.to_string(),
            reason: e.to_string(),
        })?;
        self.storage
            .put(&format!("{prefix}manifest.json"), &mut json.as_slice())
            .await?;
        // The record makes the snapshot visible: it goes last.
        self.storage
            .create_new(&Self::record_key(id), Bytes::from(json))
            .await?;
        tracing::info!(snapshot = %id, name = ?record.alias, store = %self.describe(), "snapshot published");
        Ok(record)
    }

    /// Downloads a snapshot's files into `dir`, checking their sizes.
    pub async fn download(&self, record: &SnapshotRecord, dir: &Path) -> Result<(), SnapshotError> {
        let prefix = self.artifact_prefix(&record.id);
        for f in &record.committed.capture.files {
            if !is_plain_file_name(f) {
                return Err(SnapshotError::Corrupt {
                    id: record.id.clone(),
                    reason: format!("the file name {f:?} is not a plain name"),
                });
            }
            let got = self
                .storage
                .get_file(&format!("{prefix}{f}"), &dir.join(f))
                .await
                .map_err(|e| match e {
                    StorageError::NotFound { .. } => SnapshotError::NotFound(record.id.clone()),
                    other => other.into(),
                })?;
            if let Some(&want) = record.committed.sizes.get(f)
                && want != got
            {
                return Err(SnapshotError::Corrupt {
                    id: record.id.clone(),
                    reason: format!("{f} has {got} bytes, the record says {want}"),
                });
            }
        }
        Ok(())
    }

    /// Every snapshot, newest first (ties by id).
    pub async fn list(&self) -> Result<Vec<SnapshotRecord>, SnapshotError> {
        let mut out = Vec::new();
        for key in self.storage.list("catalog/records/").await? {
            let Some(id) = key
                .strip_prefix("catalog/records/")
                .and_then(|k| k.strip_suffix(".json"))
            else {
                continue;
            };
            match self.record(id).await {
                Ok(Some(r)) => out.push(r),
                // Deleted between the list and the read.
                Ok(None) => {}
                Err(e) => {
                    tracing::warn!(snapshot = %id, error = %e, "skipping an unreadable record")
                }
            }
        }
        out.sort_by(|a, b| {
            b.created_at_ms
                .cmp(&a.created_at_ms)
                .then_with(|| a.id.cmp(&b.id))
        });
        Ok(out)
    }

    /// Deletes the snapshot `id_or_name` names; `false` when there was none.
    pub async fn delete(&self, id_or_name: &str) -> Result<bool, SnapshotError> {
        let (id, alias) = if crate::dataplane::is_uuid(id_or_name) {
            let id = id_or_name.to_ascii_lowercase();
            let alias = self.record(&id).await.ok().flatten().and_then(|r| r.alias);
            (id, alias)
        } else if validate_name(id_or_name).is_ok() {
            match self.alias_target(id_or_name).await? {
                Some(id) => (id, Some(id_or_name.to_string())),
                None => return Ok(false),
            }
        } else {
            return Ok(false);
        };
        let existed = self.storage.stat(&Self::record_key(&id)).await?.is_some();
        self.storage.delete(&Self::record_key(&id)).await?;
        if let Some(a) = &alias {
            self.release_alias(a, &id).await?;
        }
        let prefix = self.artifact_prefix(&id);
        let had_files = !self.storage.list(&prefix).await?.is_empty();
        self.storage.delete_prefix(&prefix).await?;
        if existed || had_files {
            tracing::info!(snapshot = %id, name = ?alias, "snapshot deleted");
        }
        Ok(existed || had_files || alias.is_some())
    }
}

/// A node-local directory removed (in the background) when dropped.
#[derive(Debug)]
pub struct StagingDir(PathBuf);

impl StagingDir {
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for StagingDir {
    fn drop(&mut self) {
        let p = std::mem::take(&mut self.0);
        if p.as_os_str().is_empty() {
            return;
        }
        match tokio::runtime::Handle::try_current() {
            Ok(h) => {
                h.spawn_blocking(move || {
                    let _ = std::fs::remove_dir_all(&p);
                });
            }
            Err(_) => {
                let _ = std::fs::remove_dir_all(&p);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use agentenv_core::storage::OpendalStorage;

    fn repo(root: &Path, cache: &Path) -> SnapshotRepo {
        let cfg = StorageConfig::Fs {
            root: root.to_path_buf(),
        };
        let storage = Arc::new(OpendalStorage::open(&cfg).unwrap());
        SnapshotRepo::new(storage, &cfg, cache).unwrap()
    }

    fn spec(name: Option<&str>) -> SnapshotSpec {
        SnapshotSpec {
            sandbox_id: "01936f8e-72f5-7000-8000-000000000001".into(),
            name: name.map(String::from),
            template: "base".into(),
            cpu_count: 1,
            memory_mb: 256,
            env: BTreeMap::from([("A".to_string(), "1".to_string())]),
        }
    }

    async fn capture(r: &SnapshotRepo, content: &[u8]) -> (StagingDir, SnapshotCapture) {
        let d = r.staging_dir().unwrap();
        std::fs::write(d.path().join("layer.tar"), content).unwrap();
        (
            d,
            SnapshotCapture {
                backend: "jail".into(),
                files: vec!["layer.tar".into()],
            },
        )
    }

    #[test]
    fn names_are_checked() {
        assert!(validate_name("my-app_2").is_ok());
        for bad in ["", "a b", "../x", "a/b", &"x".repeat(129)] {
            assert!(
                matches!(validate_name(bad), Err(SnapshotError::InvalidName(_))),
                "{bad:?}"
            );
        }
        assert!(matches!(
            validate_name("01936f8e-72f5-7000-8000-000000000001"),
            Err(SnapshotError::InvalidName(_))
        ));
        assert!(matches!(
            validate_name("base"),
            Err(SnapshotError::ReservedName(_))
        ));
    }

    #[tokio::test]
    async fn publish_resolve_list_and_delete_on_a_shared_directory() {
        let store = tempfile::tempdir().unwrap();
        let (c1, c2) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let a = repo(store.path(), c1.path());
        // Another node on the same store.
        let b = repo(store.path(), c2.path());

        let (dir, cap) = capture(&a, b"layer bytes").await;
        let rec = a
            .publish(&spec(Some("web")), cap, dir.path())
            .await
            .unwrap();
        assert!(
            store
                .path()
                .join(format!("catalog/records/{}.json", rec.id))
                .is_file()
        );
        assert_eq!(
            std::fs::read_to_string(store.path().join("catalog/aliases/web")).unwrap(),
            format!("\"{}\"", rec.id)
        );
        assert!(
            store
                .path()
                .join(format!("snapshots/{}/layer.tar", rec.id))
                .is_file()
        );
        assert_eq!(rec.committed.sizes["layer.tar"], 11);

        // The other node resolves it by id and by name, and downloads it.
        assert_eq!(b.resolve(&rec.id).await.unwrap().unwrap(), rec);
        assert_eq!(b.resolve("web").await.unwrap().unwrap().id, rec.id);
        assert!(b.resolve("nope").await.unwrap().is_none());
        let d = b.staging_dir().unwrap();
        b.download(&rec, d.path()).await.unwrap();
        assert_eq!(
            std::fs::read(d.path().join("layer.tar")).unwrap(),
            b"layer bytes"
        );

        // A name bound to a live snapshot is refused, and the refused publish leaves nothing.
        let (dir2, cap2) = capture(&b, b"other").await;
        let e = b
            .publish(&spec(Some("web")), cap2, dir2.path())
            .await
            .unwrap_err();
        assert!(matches!(e, SnapshotError::AliasConflict { .. }), "{e}");
        assert_eq!(b.list().await.unwrap().len(), 1);
        assert_eq!(
            std::fs::read_dir(store.path().join("snapshots"))
                .unwrap()
                .count(),
            1
        );

        // Unnamed snapshots; newest first.
        let (dir3, cap3) = capture(&b, b"third").await;
        let r3 = b.publish(&spec(None), cap3, dir3.path()).await.unwrap();
        let ids: Vec<String> = a.list().await.unwrap().into_iter().map(|r| r.id).collect();
        assert_eq!(ids, [r3.id.clone(), rec.id.clone()]);

        // Delete by name: record, alias and files go; again is a no-op.
        assert!(a.delete("web").await.unwrap());
        assert!(b.resolve(&rec.id).await.unwrap().is_none());
        assert!(b.resolve("web").await.unwrap().is_none());
        assert!(
            !store
                .path()
                .join(format!("snapshots/{}", rec.id))
                .join("layer.tar")
                .exists()
        );
        assert!(!a.delete("web").await.unwrap());
        assert!(!a.delete(&rec.id).await.unwrap());
        // The name is free again.
        let (dir4, cap4) = capture(&a, b"again").await;
        a.publish(&spec(Some("web")), cap4, dir4.path())
            .await
            .unwrap();
        // Delete by id.
        assert!(a.delete(&r3.id).await.unwrap());
        assert_eq!(b.list().await.unwrap().len(), 1);
    }

    #[tokio::test]
    async fn a_record_naming_files_outside_the_download_directory_is_refused() {
        let store = tempfile::tempdir().unwrap();
        let cache = tempfile::tempdir().unwrap();
        let r = repo(store.path(), cache.path());
        let (dir, cap) = capture(&r, b"x").await;
        let mut rec = r.publish(&spec(None), cap, dir.path()).await.unwrap();
        rec.committed.capture.files = vec!["../escape".into()];
        let d = r.staging_dir().unwrap();
        let e = r.download(&rec, d.path()).await.unwrap_err();
        assert!(matches!(e, SnapshotError::Corrupt { .. }), "{e}");
        assert!(!d.path().parent().unwrap().join("escape").exists());
    }

    #[tokio::test]
    async fn a_name_left_by_a_vanished_snapshot_is_taken_over() {
        let store = tempfile::tempdir().unwrap();
        let cache = tempfile::tempdir().unwrap();
        let r = repo(store.path(), cache.path());
        std::fs::create_dir_all(store.path().join("catalog/aliases")).unwrap();
        std::fs::write(
            store.path().join("catalog/aliases/app"),
            "\"01936f8e-72f5-7000-8000-00000000dead\"",
        )
        .unwrap();
        let (dir, cap) = capture(&r, b"x").await;
        let rec = r
            .publish(&spec(Some("app")), cap, dir.path())
            .await
            .unwrap();
        assert_eq!(r.resolve("app").await.unwrap().unwrap().id, rec.id);
    }
}
