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
//!
//! # Signed records
//!
//! Whoever can write to the store must not be able to make a node start sandboxes from
//! files of their choosing. Every record carries `signature`: hex
//! HMAC-SHA256 over the record's canonical form, under a key derived from the node's
//! token seed ([`RecordKey::from_seed`]: HMAC-SHA256(seed, `"agentenv snapshot record
//! v1"`), so access tokens and record signatures never share a key). The record names
//! the SHA-256 of each of its files, so the signature covers their content too. Every
//! read verifies it (constant-time) and a record that does not verify is refused
//! ([`SnapshotError::Forged`]) and never used; listing leaves it out. Nodes that share a
//! repository must therefore share `AENV_SANDBOX_ACCESS_TOKEN_HASH_SEED`.
//!
//! The canonical form is `serde_json::to_vec` of the record with `signature` left out:
//! fields in declaration order, maps are `BTreeMap`s (sorted keys), no floats, so the
//! same record always gives the same bytes. Changing the record's fields changes the
//! form: records written by a node with other fields do not verify here, and are refused
//! rather than misread.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use agentenv_core::storage::{Storage, StorageConfig, StorageError};
use bytes::Bytes;
use hmac::{Hmac, Mac};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

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
    #[error(
        "snapshot {id} is refused: its record {reason}, so it was not written by a node sharing this node's seed (or was changed since); it is not used. Nodes sharing a snapshot repository must share AENV_SANDBOX_ACCESS_TOKEN_HASH_SEED; otherwise delete it (DELETE /templates/{id})"
    )]
    Forged { id: String, reason: String },
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
    /// SHA-256 of each file (hex), for checking downloads: the record's signature covers
    /// the files' content through it.
    #[serde(default)]
    pub digests: BTreeMap<String, String>,
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
    /// Hex HMAC-SHA256 of the record's canonical form (see the module docs); empty when
    /// missing, which never verifies.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub signature: String,
}

/// The key that signs and verifies snapshot records: HMAC-SHA256(seed, "agentenv
/// snapshot record v1"), derived from the node's token seed so that nodes sharing the
/// seed accept each other's snapshots and the access tokens (HMAC under the seed itself)
/// never share a key with the records.
#[derive(Clone)]
pub struct RecordKey([u8; 32]);

impl std::fmt::Debug for RecordKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RecordKey(..)")
    }
}

/// What the record key is derived for. Access tokens are HMACs under the seed too, of
/// sandbox ids (`[A-Za-z0-9_-]`, with a `sandbox-traffic-` prefix for traffic tokens):
/// this context, with its spaces, is none of them, so no token is ever the record key.
const RECORD_KEY_CONTEXT: &[u8] = b"agentenv snapshot record v1";

fn hmac(key: &[u8], msg: &[u8]) -> [u8; 32] {
    let mut m = <Hmac<Sha256> as Mac>::new_from_slice(key).expect("HMAC takes any key length");
    m.update(msg);
    m.finalize().into_bytes().into()
}

impl RecordKey {
    /// The record key of a node whose token seed is `seed`
    /// (`AENV_SANDBOX_ACCESS_TOKEN_HASH_SEED` or the managed seed file).
    pub fn from_seed(seed: &str) -> Self {
        Self(hmac(seed.as_bytes(), RECORD_KEY_CONTEXT))
    }

    fn mac(&self, record: &SnapshotRecord) -> [u8; 32] {
        hmac(&self.0, &canonical(record))
    }

    /// The signature of `record` (its own `signature` is ignored).
    pub fn sign(&self, record: &SnapshotRecord) -> String {
        hex::encode(self.mac(record))
    }

    /// Checks `record`'s signature; the error says what is wrong with it.
    fn verify(&self, record: &SnapshotRecord) -> Result<(), SnapshotError> {
        let forged = |reason: &str| SnapshotError::Forged {
            id: record.id.clone(),
            reason: reason.to_string(),
        };
        if record.signature.is_empty() {
            return Err(forged("carries no signature"));
        }
        let Ok(given) = hex::decode(&record.signature) else {
            return Err(forged("has a malformed signature"));
        };
        if !bool::from(self.mac(record)[..].ct_eq(&given)) {
            return Err(forged("has a signature that does not match its content"));
        }
        Ok(())
    }
}

/// The bytes a record's signature covers: the record without its signature, as compact
/// JSON (deterministic: see the module docs).
fn canonical(record: &SnapshotRecord) -> Vec<u8> {
    let unsigned = SnapshotRecord {
        signature: String::new(),
        ..record.clone()
    };
    serde_json::to_vec(&unsigned).expect("a record always serializes")
}

/// SHA-256 of the file `path`, hex.
fn file_digest(path: &Path) -> std::io::Result<String> {
    let mut f = std::fs::File::open(path)?;
    let mut h = Sha256::new();
    std::io::copy(&mut f, &mut h)?;
    Ok(hex::encode(h.finalize()))
}

async fn digest_of(path: PathBuf) -> Result<String, SnapshotError> {
    let context = format!("reading {}", path.display());
    tokio::task::spawn_blocking(move || file_digest(&path))
        .await
        .map_err(|e| SnapshotError::Io {
            context: context.clone(),
            source: std::io::Error::other(e),
        })?
        .map_err(io(context))
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
    if !ok || crate::ids::is_uuid(name) {
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

/// The repository of one node (the store may be shared with other nodes).
#[derive(Debug)]
pub struct SnapshotRepo {
    storage: Arc<dyn Storage>,
    layout: Layout,
    cache: PathBuf,
    key: RecordKey,
}

impl SnapshotRepo {
    /// A repository on `storage`, laid out for `cfg`'s kind, staging files under `cache`,
    /// signing and verifying records with `key`.
    pub fn new(
        storage: Arc<dyn Storage>,
        cfg: &StorageConfig,
        cache: impl Into<PathBuf>,
        key: RecordKey,
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
            key,
        })
    }

    /// The store, for messages.
    pub fn describe(&self) -> String {
        self.storage.describe()
    }

    /// The store itself (templates live in it too).
    pub fn storage(&self) -> &Arc<dyn Storage> {
        &self.storage
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

    /// Reads a record by id (`None` when absent), verifying its signature.
    pub async fn record(&self, id: &str) -> Result<Option<SnapshotRecord>, SnapshotError> {
        if !crate::ids::is_uuid(id) {
            return Ok(None);
        }
        let Some(raw) = self.storage.read(&Self::record_key(id), MAX_RECORD).await? else {
            return Ok(None);
        };
        let record: SnapshotRecord =
            serde_json::from_slice(&raw).map_err(|e| SnapshotError::Corrupt {
                id: id.to_string(),
                reason: e.to_string(),
            })?;
        self.key.verify(&record)?;
        // A signed record copied under another snapshot's key.
        if record.id != id {
            return Err(SnapshotError::Forged {
                id: id.to_string(),
                reason: format!("is the record of snapshot {}", record.id),
            });
        }
        Ok(Some(record))
    }

    async fn alias_target(&self, name: &str) -> Result<Option<String>, SnapshotError> {
        let Some(raw) = self.storage.read(&self.alias_key(name), MAX_RECORD).await? else {
            return Ok(None);
        };
        Ok(serde_json::from_slice::<String>(&raw).ok())
    }

    /// The snapshot `id_or_name` names (its id or its alias), if any.
    pub async fn resolve(&self, id_or_name: &str) -> Result<Option<SnapshotRecord>, SnapshotError> {
        if crate::ids::is_uuid(id_or_name) {
            return self.record(&id_or_name.to_ascii_lowercase()).await;
        }
        if validate_name(id_or_name).is_err() {
            return Ok(None);
        }
        let Some(id) = self.alias_target(id_or_name).await? else {
            return Ok(None);
        };
        match self.record(&id).await? {
            // The name must be the record's own (aliases are not signed).
            Some(r) if r.alias.as_deref() != Some(id_or_name) => Err(SnapshotError::Forged {
                id,
                reason: format!("does not carry the name {id_or_name:?} that points to it"),
            }),
            other => Ok(other),
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
            // Live while its record exists (verified or not: a name is never taken from
            // under a record).
            let live = self
                .storage
                .stat(&Self::record_key(&other))
                .await?
                .is_some()
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
        let mut digests = BTreeMap::new();
        for f in &capture.files {
            if !is_plain_file_name(f) || f == "manifest.json" {
                return Err(SnapshotError::Io {
                    context: format!("publishing the capture file {f:?}"),
                    source: std::io::Error::from(std::io::ErrorKind::InvalidInput),
                });
            }
            let path = dir.join(f);
            digests.insert(f.clone(), digest_of(path.clone()).await?);
            let n = self
                .storage
                .put_file(&format!("{prefix}{f}"), &path)
                .await?;
            sizes.insert(f.clone(), n);
        }
        let now = crate::clock::now_ms();
        let disk_size_mb = sizes.values().sum::<u64>().div_ceil(1 << 20);
        let mut record = SnapshotRecord {
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
                digests,
            },
            signature: String::new(),
        };
        record.signature = self.key.sign(&record);
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

    /// Downloads a snapshot's files into `dir`, checking the record's signature and the
    /// files' names, sizes and digests against it.
    pub async fn download(&self, record: &SnapshotRecord, dir: &Path) -> Result<(), SnapshotError> {
        self.key.verify(record)?;
        let corrupt = |reason: String| SnapshotError::Corrupt {
            id: record.id.clone(),
            reason,
        };
        let prefix = self.artifact_prefix(&record.id);
        for f in &record.committed.capture.files {
            if !is_plain_file_name(f) {
                return Err(corrupt(format!("the file name {f:?} is not a plain name")));
            }
            let (Some(&want), Some(digest)) = (
                record.committed.sizes.get(f),
                record.committed.digests.get(f),
            ) else {
                return Err(corrupt(format!(
                    "the record gives no size or digest of {f}"
                )));
            };
            let path = dir.join(f);
            let got = self
                .storage
                .get_file(&format!("{prefix}{f}"), &path)
                .await
                .map_err(|e| match e {
                    StorageError::NotFound { .. } => SnapshotError::NotFound(record.id.clone()),
                    other => other.into(),
                })?;
            if want != got {
                return Err(corrupt(format!(
                    "{f} has {got} bytes, the record says {want}"
                )));
            }
            if digest_of(path).await? != *digest {
                return Err(corrupt(format!(
                    "the content of {f} is not what the record's digest says"
                )));
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
        let (id, alias) = if crate::ids::is_uuid(id_or_name) {
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
        repo_with_seed(root, cache, "test-seed")
    }

    fn repo_with_seed(root: &Path, cache: &Path, seed: &str) -> SnapshotRepo {
        let cfg = StorageConfig::Fs {
            root: root.to_path_buf(),
        };
        let storage = Arc::new(OpendalStorage::open(&cfg).unwrap());
        SnapshotRepo::new(storage, &cfg, cache, RecordKey::from_seed(seed)).unwrap()
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
        // Even signed (by whoever holds the seed), the name is refused.
        rec.signature = r.key.sign(&rec);
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

    fn assert_forged(e: &SnapshotError, id: &str) {
        assert!(matches!(e, SnapshotError::Forged { .. }), "{e:?}");
        let msg = e.to_string();
        assert!(msg.contains(id), "{msg}");
        assert!(
            msg.contains("not written by a node sharing this node's seed"),
            "{msg}"
        );
        assert!(msg.contains("AENV_SANDBOX_ACCESS_TOKEN_HASH_SEED"), "{msg}");
    }

    #[tokio::test]
    async fn records_are_signed_and_forged_ones_are_refused() {
        let store = tempfile::tempdir().unwrap();
        let cache = tempfile::tempdir().unwrap();
        let r = repo(store.path(), cache.path());
        let (dir, cap) = capture(&r, b"layer bytes").await;
        let rec = r
            .publish(&spec(Some("web")), cap, dir.path())
            .await
            .unwrap();
        assert_eq!(rec.signature.len(), 64);
        assert_eq!(
            rec.committed.digests["layer.tar"],
            hex::encode(Sha256::digest(b"layer bytes"))
        );
        let path = store
            .path()
            .join(format!("catalog/records/{}.json", rec.id));
        let original = std::fs::read(&path).unwrap();
        let stored: serde_json::Value = serde_json::from_slice(&original).unwrap();
        assert_eq!(stored["signature"], rec.signature.as_str());

        // Each forgery: written over the record, then refused by id, by name, when
        // downloading, and left out of the list.
        let forge = |f: &dyn Fn(&mut serde_json::Value)| {
            let mut v = stored.clone();
            f(&mut v);
            std::fs::write(&path, serde_json::to_vec(&v).unwrap()).unwrap();
        };
        type Forgery<'a> = (&'a str, &'a dyn Fn(&mut serde_json::Value));
        let forgeries: [Forgery<'_>; 5] = [
            ("no signature", &|v| {
                v.as_object_mut().unwrap().remove("signature");
            }),
            ("empty signature", &|v| v["signature"] = "".into()),
            ("wrong signature", &|v| {
                v["signature"] = "00".repeat(32).into()
            }),
            ("malformed signature", &|v| v["signature"] = "zz".into()),
            ("a field changed after signing", &|v| {
                v["committed"]["template"] = "other".into()
            }),
        ];
        for (what, f) in forgeries {
            forge(f);
            let e = r.resolve(&rec.id).await.unwrap_err();
            assert_forged(&e, &rec.id);
            let e = r.resolve("web").await.unwrap_err();
            assert_forged(&e, &rec.id);
            assert!(r.list().await.unwrap().is_empty(), "{what}");
        }
        // Changed in memory after reading: download verifies too.
        let mut changed = rec.clone();
        changed.committed.env.insert("B".into(), "2".into());
        let d = r.staging_dir().unwrap();
        assert_forged(&r.download(&changed, d.path()).await.unwrap_err(), &rec.id);
        assert!(!d.path().join("layer.tar").exists());
        // Restored, the genuine record reads again.
        std::fs::write(&path, &original).unwrap();
        assert_eq!(r.resolve("web").await.unwrap().unwrap(), rec);

        // A signed record copied under another id is refused.
        let other = "01936f8e-72f5-7000-8000-0000000000aa";
        std::fs::write(
            store.path().join(format!("catalog/records/{other}.json")),
            &original,
        )
        .unwrap();
        assert_forged(&r.resolve(other).await.unwrap_err(), other);
        // A name pointed at a snapshot that does not carry it is refused.
        std::fs::write(
            store.path().join("catalog/aliases/evil"),
            format!("\"{}\"", rec.id),
        )
        .unwrap();
        assert_forged(&r.resolve("evil").await.unwrap_err(), &rec.id);
        assert!(r.delete(other).await.unwrap());
        assert_eq!(r.list().await.unwrap().len(), 1);
    }

    #[tokio::test]
    async fn a_record_signed_with_another_seed_is_refused() {
        let store = tempfile::tempdir().unwrap();
        let (c1, c2, c3) = (
            tempfile::tempdir().unwrap(),
            tempfile::tempdir().unwrap(),
            tempfile::tempdir().unwrap(),
        );
        let a = repo_with_seed(store.path(), c1.path(), "seed-a");
        let b = repo_with_seed(store.path(), c2.path(), "seed-b");
        let a2 = repo_with_seed(store.path(), c3.path(), "seed-a");
        let (dir, cap) = capture(&a, b"x").await;
        let rec = a
            .publish(&spec(Some("app")), cap, dir.path())
            .await
            .unwrap();
        assert_forged(&b.resolve(&rec.id).await.unwrap_err(), &rec.id);
        assert_forged(&b.resolve("app").await.unwrap_err(), &rec.id);
        assert!(b.list().await.unwrap().is_empty());
        let d = b.staging_dir().unwrap();
        assert_forged(&b.download(&rec, d.path()).await.unwrap_err(), &rec.id);
        // A node sharing the seed uses it.
        assert_eq!(a2.resolve("app").await.unwrap().unwrap(), rec);
        // Access tokens are HMACs under the seed of sandbox ids: the key's context is
        // none, so no token is the record key.
        assert!(
            crate::backend::validate_sandbox_id(std::str::from_utf8(RECORD_KEY_CONTEXT).unwrap())
                .is_err()
        );
    }

    #[tokio::test]
    async fn a_file_changed_in_the_store_is_refused_on_download() {
        let store = tempfile::tempdir().unwrap();
        let cache = tempfile::tempdir().unwrap();
        let r = repo(store.path(), cache.path());
        let (dir, cap) = capture(&r, b"layer bytes").await;
        let rec = r.publish(&spec(None), cap, dir.path()).await.unwrap();
        // Same size, other bytes.
        std::fs::write(
            store.path().join(format!("snapshots/{}/layer.tar", rec.id)),
            b"LAYER BYTES",
        )
        .unwrap();
        let d = r.staging_dir().unwrap();
        let e = r.download(&rec, d.path()).await.unwrap_err();
        assert!(matches!(e, SnapshotError::Corrupt { .. }), "{e}");
        assert!(e.to_string().contains("digest"), "{e}");
    }
}
