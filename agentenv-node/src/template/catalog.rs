//! The template catalog: templates, their builds, names, tags, uploaded files, cached
//! layers and build logs, on the shared [`Storage`] every node of a cluster sees (the
//! snapshot repository's store). A template built on one node starts on any node.
//!
//! Layout (keys under the store's root):
//!
//! ```text
//! templates/records/<template id>.json      signed TemplateRecord
//! templates/names/<name>.json               the template id a name points to (claimed atomically)
//! templates/builds/<build id>.json          signed BuildRecord
//! templates/files/<template id>/<hash>      an uploaded COPY archive (tar or tar.gz)
//! templates/cache/<step key>.json           signed CacheEntry: the layer after a step
//! templates/layers/<sha256>.tar.zst         a layer: the build sandbox's writable layer
//! templates/logs/<build id>/<seq>.json      build log lines, in chunks
//! ```
//!
//! Records, builds and cache entries are signed like snapshot records: HMAC-SHA256 under
//! a key derived from the node's token seed with its own context, over the object's key
//! and its body, so whoever can write to the store cannot make a node start sandboxes
//! from files of their choosing, nor move a signed object under another key. A name is
//! only a pointer: it counts only when the signed record it points to carries it.
//! Layers are content-addressed and verified against the SHA-256 a signed entry names.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use agentenv_core::storage::{Storage, StorageError};
use bytes::Bytes;
use hmac::{Hmac, Mac};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use sha2::Sha256;
use subtle::ConstantTimeEq;

/// Largest record, build, cache entry or log chunk read.
const MAX_OBJECT: usize = 4 << 20;

/// Most log lines kept per build (later lines are dropped, and one line says so).
pub const MAX_LOG_LINES: usize = 20_000;

const KEY_CONTEXT: &[u8] = b"agentenv template record v1";

/// Errors of the catalog.
#[derive(Debug, thiserror::Error)]
pub enum CatalogError {
    #[error(
        "invalid template name {0:?}: use 1 to 128 characters from [a-z0-9._-] (lowercase), starting with a letter or digit"
    )]
    InvalidName(String),
    #[error("invalid tag {0:?}: use 1 to 128 characters from [A-Za-z0-9._-]")]
    InvalidTag(String),
    #[error(
        "the name {name:?} belongs to template {owner}: choose another name, or delete that template first"
    )]
    NameTaken { name: String, owner: String },
    #[error("template {0} not found")]
    NotFound(String),
    #[error("build {build} of template {template} not found")]
    BuildNotFound { template: String, build: String },
    #[error(
        "{what} is refused: {reason}, so it was not written by a node sharing this node's seed (or was changed since). Nodes sharing a store must share AENV_SANDBOX_ACCESS_TOKEN_HASH_SEED"
    )]
    Forged { what: String, reason: String },
    #[error("{what} in the store is unreadable: {reason}")]
    Corrupt { what: String, reason: String },
    #[error("template store: {0}")]
    Storage(#[from] StorageError),
}

/// Status of a build, as the E2B API names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BuildStatus {
    Waiting,
    Building,
    Ready,
    Error,
}

impl BuildStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Waiting => "waiting",
            Self::Building => "building",
            Self::Ready => "ready",
            Self::Error => "error",
        }
    }

    pub fn is_final(self) -> bool {
        matches!(self, Self::Ready | Self::Error)
    }
}

/// What a build starts from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum BaseRef {
    /// The built-in template (`base`), made on each node from Debian packages.
    Builtin { name: String },
    /// The result of another build.
    Build {
        template_id: String,
        build_id: String,
    },
    /// An OCI image, by the digest of its manifest.
    Image {
        reference: String,
        manifest_digest: String,
    },
}

/// A layer in the store.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerRef {
    /// Hex SHA-256 of the compressed archive (its key).
    pub sha256: String,
    pub size: u64,
}

/// What a sandbox needs besides its files: the state of the metadata steps.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunState {
    pub env: BTreeMap<String, String>,
    pub workdir: Option<String>,
    pub user: Option<String>,
}

/// The result of a successful build: the base, the layer over it, and how sandboxes start.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BuildResult {
    pub base: BaseRef,
    /// The files the steps changed, over the base (none when no step changed a file).
    pub layer: Option<LayerRef>,
    pub state: RunState,
    pub start_cmd: Option<String>,
    pub ready_cmd: Option<String>,
}

/// Why a build failed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BuildReason {
    pub message: String,
    /// `base`, the 1-based number of the failing step, or `finalize`.
    pub step: Option<String>,
}

/// A template.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TemplateRecord {
    pub template_id: String,
    /// Names (aliases) the template is reachable by.
    pub names: Vec<String>,
    pub public: bool,
    pub cpu_count: u32,
    pub memory_mb: u64,
    pub disk_size_mb: u64,
    pub created_at_ms: u64,
    pub updated_at_ms: u64,
    /// Tag → build id; `default` is the tag a name without one means.
    pub tags: BTreeMap<String, String>,
    /// Build ids, oldest first.
    pub builds: Vec<String>,
}

/// One build of a template.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BuildRecord {
    pub build_id: String,
    pub template_id: String,
    pub status: BuildStatus,
    pub created_at_ms: u64,
    pub updated_at_ms: u64,
    pub finished_at_ms: Option<u64>,
    pub cpu_count: u32,
    pub memory_mb: u64,
    /// Tags the build takes when it is ready.
    pub tags: Vec<String>,
    /// The node running it, and when it last said it still does.
    pub node_id: Option<String>,
    pub heartbeat_at_ms: u64,
    pub reason: Option<BuildReason>,
    pub result: Option<BuildResult>,
}

/// A cached step: the layer after it (cumulative, over the build's base) and the state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CacheEntry {
    pub key: String,
    pub layer: Option<LayerRef>,
    pub state: RunState,
}

/// An OCI image a build started from, kept in the store so that every node makes the
/// base from the store, never from the registry (which may need credentials only the
/// build had).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageRecord {
    pub reference: String,
    pub manifest_digest: String,
    /// Layers bottom first: the blob's SHA-256 (its digest), size and compression
    /// (`plain`, `gzip`, `zstd`).
    pub layers: Vec<ImageLayer>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageLayer {
    pub sha256: String,
    pub size: u64,
    pub compression: String,
}

/// One build log line, as the E2B API shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LogLine {
    /// RFC 3339.
    pub timestamp: String,
    /// `debug`, `info`, `warn` or `error`.
    pub level: String,
    pub message: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step: Option<String>,
}

/// A signed object as stored: the body as JSON text, and the MAC over key and body.
#[derive(Serialize, Deserialize)]
struct Envelope {
    body: String,
    signature: String,
}

/// Checks a template name: lowercase `[a-z0-9._-]`, 1 to 128 characters, starting with
/// a letter or digit.
pub fn validate_name(name: &str) -> Result<(), CatalogError> {
    let ok = !name.is_empty()
        && name.len() <= 128
        && name.as_bytes()[0].is_ascii_alphanumeric()
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(CatalogError::InvalidName(name.to_string()))
    }
}

/// Checks a tag: `[A-Za-z0-9._-]`, 1 to 128 characters.
pub fn validate_tag(tag: &str) -> Result<(), CatalogError> {
    let ok = !tag.is_empty()
        && tag.len() <= 128
        && tag
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(CatalogError::InvalidTag(tag.to_string()))
    }
}

/// A template id: 20 lowercase letters and digits.
pub fn new_template_id() -> String {
    use rand::Rng;
    const CHARS: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";
    let mut rng = rand::rng();
    (0..20)
        .map(|_| CHARS[rng.random_range(0..CHARS.len())] as char)
        .collect()
}

/// Whether `s` has the shape of a template id.
pub fn is_template_id(s: &str) -> bool {
    s.len() == 20
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
}

/// Whether `s` is a lowercase hex SHA-256.
pub fn is_sha256_hex(s: &str) -> bool {
    s.len() == 64
        && s.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

fn hmac(key: &[u8], parts: &[&[u8]]) -> [u8; 32] {
    let mut m = <Hmac<Sha256> as Mac>::new_from_slice(key).expect("HMAC takes any key length");
    for p in parts {
        m.update(&(p.len() as u64).to_be_bytes());
        m.update(p);
    }
    m.finalize().into_bytes().into()
}

/// The catalog of one node (the store is shared with the other nodes).
#[derive(Debug)]
pub struct TemplateCatalog {
    storage: Arc<dyn Storage>,
    key: [u8; 32],
}

impl TemplateCatalog {
    /// A catalog on `storage`, signing with the key derived from the token seed `seed`.
    pub fn new(storage: Arc<dyn Storage>, seed: &str) -> Self {
        Self {
            storage,
            key: hmac(seed.as_bytes(), &[KEY_CONTEXT]),
        }
    }

    /// The store, for messages.
    pub fn describe(&self) -> String {
        self.storage.describe()
    }

    pub fn storage(&self) -> &Arc<dyn Storage> {
        &self.storage
    }

    /// A MAC under the catalog's key over `parts` (also signs upload links).
    pub fn mac(&self, parts: &[&[u8]]) -> [u8; 32] {
        hmac(&self.key, parts)
    }

    fn record_key(id: &str) -> String {
        format!("templates/records/{id}.json")
    }

    fn name_key(name: &str) -> String {
        format!("templates/names/{name}.json")
    }

    fn build_key(id: &str) -> String {
        format!("templates/builds/{id}.json")
    }

    pub fn file_key(template_id: &str, hash: &str) -> String {
        format!("templates/files/{template_id}/{hash}")
    }

    fn cache_key(key: &str) -> String {
        format!("templates/cache/{key}.json")
    }

    fn image_key(manifest_digest: &str) -> String {
        format!(
            "templates/images/{}.json",
            manifest_digest.trim_start_matches("sha256:")
        )
    }

    pub fn blob_key(sha256: &str) -> String {
        format!("templates/blobs/{sha256}")
    }

    /// The stored image with manifest digest `digest`.
    pub async fn image(&self, digest: &str) -> Result<Option<ImageRecord>, CatalogError> {
        let hex = digest.trim_start_matches("sha256:");
        if !is_sha256_hex(hex) {
            return Ok(None);
        }
        let r: Option<ImageRecord> = self
            .get_signed(&Self::image_key(digest), || format!("image {digest}"))
            .await?;
        Ok(r.filter(|r| r.manifest_digest == digest))
    }

    pub async fn save_image(&self, r: &ImageRecord) -> Result<(), CatalogError> {
        self.put_signed(&Self::image_key(&r.manifest_digest), r)
            .await
    }

    /// Uploads an image layer blob (content-addressed by its digest) unless it is there.
    pub async fn put_blob(&self, sha256: &str, size: u64, path: &Path) -> Result<(), CatalogError> {
        let key = Self::blob_key(sha256);
        if self.storage.stat(&key).await?.map(|m| m.size) != Some(size) {
            self.storage.put_file(&key, path).await?;
        }
        Ok(())
    }

    /// Downloads an image layer blob to `path`, verifying its digest.
    pub async fn get_blob(&self, sha256: &str, path: &Path) -> Result<(), CatalogError> {
        self.get_verified(&Self::blob_key(sha256), sha256, path)
            .await
    }

    pub fn layer_key(sha256: &str) -> String {
        format!("templates/layers/{sha256}.tar.zst")
    }

    fn log_prefix(build_id: &str) -> String {
        format!("templates/logs/{build_id}/")
    }

    async fn put_signed<T: Serialize>(&self, key: &str, body: &T) -> Result<(), CatalogError> {
        let body = serde_json::to_string(body).expect("catalog objects serialize");
        let signature = hex::encode(self.mac(&[key.as_bytes(), body.as_bytes()]));
        let raw = serde_json::to_vec(&Envelope { body, signature }).expect("envelope");
        self.storage.put(key, &mut raw.as_slice()).await?;
        Ok(())
    }

    /// Reads a signed object. Records are rewritten in place (a build's status, a
    /// template's tags), and a store may hand out a mix of two versions to a read that
    /// overlaps a rewrite: a read that does not parse or verify is tried again before it
    /// counts as corrupt or forged.
    async fn get_signed<T: DeserializeOwned>(
        &self,
        key: &str,
        what: impl Fn() -> String,
    ) -> Result<Option<T>, CatalogError> {
        let mut tries = 0;
        loop {
            match self.get_signed_once(key, &what).await {
                Err(CatalogError::Corrupt { .. } | CatalogError::Forged { .. }) if tries < 3 => {
                    tries += 1;
                    tokio::time::sleep(std::time::Duration::from_millis(20 * tries)).await;
                }
                other => return other,
            }
        }
    }

    async fn get_signed_once<T: DeserializeOwned>(
        &self,
        key: &str,
        what: &impl Fn() -> String,
    ) -> Result<Option<T>, CatalogError> {
        let Some(raw) = self.storage.read(key, MAX_OBJECT).await? else {
            return Ok(None);
        };
        let env: Envelope = serde_json::from_slice(&raw).map_err(|e| CatalogError::Corrupt {
            what: what(),
            reason: e.to_string(),
        })?;
        let forged = |reason: &str| CatalogError::Forged {
            what: what(),
            reason: reason.to_string(),
        };
        let given =
            hex::decode(&env.signature).map_err(|_| forged("its signature is malformed"))?;
        let want = self.mac(&[key.as_bytes(), env.body.as_bytes()]);
        if !bool::from(want[..].ct_eq(&given)) {
            return Err(forged("its signature does not match its content"));
        }
        serde_json::from_str(&env.body)
            .map(Some)
            .map_err(|e| CatalogError::Corrupt {
                what: what(),
                reason: e.to_string(),
            })
    }

    /// The template with id `id`.
    pub async fn record(&self, id: &str) -> Result<Option<TemplateRecord>, CatalogError> {
        if !is_template_id(id) {
            return Ok(None);
        }
        self.get_signed(&Self::record_key(id), || format!("template {id}"))
            .await
    }

    /// Writes a template record (last writer wins).
    pub async fn save_record(&self, rec: &TemplateRecord) -> Result<(), CatalogError> {
        self.put_signed(&Self::record_key(&rec.template_id), rec)
            .await
    }

    /// The template `name` points to, if its record carries the name.
    pub async fn by_name(&self, name: &str) -> Result<Option<TemplateRecord>, CatalogError> {
        if validate_name(name).is_err() {
            return Ok(None);
        }
        let Some(raw) = self.storage.read(&Self::name_key(name), MAX_OBJECT).await? else {
            return Ok(None);
        };
        let Ok(id) = serde_json::from_slice::<String>(&raw) else {
            return Ok(None);
        };
        match self.record(&id).await? {
            Some(r) if r.names.iter().any(|n| n == name) => Ok(Some(r)),
            _ => Ok(None),
        }
    }

    /// The template `id_or_name` names.
    pub async fn resolve(&self, id_or_name: &str) -> Result<Option<TemplateRecord>, CatalogError> {
        if is_template_id(id_or_name)
            && let Some(r) = self.record(id_or_name).await?
        {
            return Ok(Some(r));
        }
        self.by_name(id_or_name).await
    }

    /// Claims `name` for template `id` (atomic across nodes). Save the record carrying
    /// the name first: a name whose template does not carry it (or is gone) is taken over.
    pub async fn claim_name(&self, name: &str, id: &str) -> Result<(), CatalogError> {
        validate_name(name)?;
        let key = Self::name_key(name);
        let body = Bytes::from(serde_json::to_vec(id).expect("a string serializes"));
        for _ in 0..2 {
            if self.storage.create_new(&key, body.clone()).await? {
                return Ok(());
            }
            match self.by_name(name).await {
                Ok(Some(owner)) if owner.template_id == id => return Ok(()),
                Ok(Some(owner)) => {
                    return Err(CatalogError::NameTaken {
                        name: name.to_string(),
                        owner: owner.template_id,
                    });
                }
                _ => {}
            }
            tracing::info!(name, "taking over a template name whose template is gone");
            self.storage.delete(&key).await?;
        }
        Err(CatalogError::NameTaken {
            name: name.to_string(),
            owner: "(being created)".into(),
        })
    }

    /// Releases `name` if it points to `id`.
    pub async fn release_name(&self, name: &str, id: &str) -> Result<(), CatalogError> {
        let key = Self::name_key(name);
        if let Some(raw) = self.storage.read(&key, MAX_OBJECT).await?
            && serde_json::from_slice::<String>(&raw).ok().as_deref() == Some(id)
        {
            self.storage.delete(&key).await?;
        }
        Ok(())
    }

    /// Every template whose record verifies.
    pub async fn list(&self) -> Result<Vec<TemplateRecord>, CatalogError> {
        let mut out = Vec::new();
        for key in self.storage.list("templates/records/").await? {
            let Some(id) = key
                .strip_prefix("templates/records/")
                .and_then(|k| k.strip_suffix(".json"))
            else {
                continue;
            };
            match self.record(id).await {
                Ok(Some(r)) => out.push(r),
                Ok(None) => {}
                Err(e) => tracing::warn!(template = id, error = %e, "leaving a template out"),
            }
        }
        out.sort_by_key(|r| r.created_at_ms);
        Ok(out)
    }

    /// Deletes a template: its record (no sandbox starts from it after that), names,
    /// files and builds. Layers stay: other templates' caches may share them.
    pub async fn delete(&self, rec: &TemplateRecord) -> Result<(), CatalogError> {
        self.storage
            .delete(&Self::record_key(&rec.template_id))
            .await?;
        for n in &rec.names {
            self.release_name(n, &rec.template_id).await?;
        }
        self.storage
            .delete_prefix(&format!("templates/files/{}/", rec.template_id))
            .await?;
        for b in &rec.builds {
            self.storage.delete(&Self::build_key(b)).await?;
            self.storage.delete_prefix(&Self::log_prefix(b)).await?;
        }
        Ok(())
    }

    /// A build, checked to belong to `template_id`.
    pub async fn build(
        &self,
        template_id: &str,
        build_id: &str,
    ) -> Result<Option<BuildRecord>, CatalogError> {
        if !crate::ids::is_uuid(build_id) {
            return Ok(None);
        }
        let b: Option<BuildRecord> = self
            .get_signed(&Self::build_key(build_id), || format!("build {build_id}"))
            .await?;
        Ok(b.filter(|b| b.template_id == template_id))
    }

    pub async fn save_build(&self, b: &BuildRecord) -> Result<(), CatalogError> {
        self.put_signed(&Self::build_key(&b.build_id), b).await
    }

    /// The cached state after the step with key `key`.
    pub async fn cache_entry(&self, key: &str) -> Result<Option<CacheEntry>, CatalogError> {
        let e: Option<CacheEntry> = self
            .get_signed(&Self::cache_key(key), || format!("cached layer {key}"))
            .await?;
        Ok(e.filter(|e| e.key == key))
    }

    pub async fn save_cache_entry(&self, e: &CacheEntry) -> Result<(), CatalogError> {
        self.put_signed(&Self::cache_key(&e.key), e).await
    }

    /// Whether an uploaded file archive is there.
    pub async fn has_file(&self, template_id: &str, hash: &str) -> Result<bool, CatalogError> {
        Ok(self
            .storage
            .stat(&Self::file_key(template_id, hash))
            .await?
            .is_some())
    }

    /// Uploads a layer archive (content-addressed) unless it is there already.
    pub async fn put_layer(&self, path: &Path) -> Result<LayerRef, CatalogError> {
        let p = path.to_path_buf();
        let (sha256, size) = tokio::task::spawn_blocking(move || -> std::io::Result<_> {
            use sha2::Digest;
            let mut f = std::fs::File::open(&p)?;
            let mut h = Sha256::new();
            let n = std::io::copy(&mut f, &mut h)?;
            Ok((hex::encode(h.finalize()), n))
        })
        .await
        .map_err(|e| StorageError::Io {
            op: "hashing a layer",
            store: self.describe(),
            key: path.display().to_string(),
            source: std::io::Error::other(e),
        })?
        .map_err(|source| StorageError::Io {
            op: "hashing a layer",
            store: self.describe(),
            key: path.display().to_string(),
            source,
        })?;
        let key = Self::layer_key(&sha256);
        if self.storage.stat(&key).await?.map(|m| m.size) != Some(size) {
            self.storage.put_file(&key, path).await?;
        }
        Ok(LayerRef { sha256, size })
    }

    /// Downloads a layer to `path`, verifying its SHA-256.
    pub async fn get_layer(&self, layer: &LayerRef, path: &Path) -> Result<(), CatalogError> {
        if !is_sha256_hex(&layer.sha256) {
            return Err(CatalogError::Corrupt {
                what: "a layer reference".into(),
                reason: format!("{:?} is not a SHA-256", layer.sha256),
            });
        }
        self.get_verified(&Self::layer_key(&layer.sha256), &layer.sha256, path)
            .await
    }

    /// Downloads `key` to `path` and checks that its content hashes to `sha256`.
    async fn get_verified(&self, key: &str, sha256: &str, path: &Path) -> Result<(), CatalogError> {
        if !is_sha256_hex(sha256) {
            return Err(CatalogError::Corrupt {
                what: format!("object {key}"),
                reason: format!("{sha256:?} is not a SHA-256"),
            });
        }
        self.storage.get_file(key, path).await?;
        let p = path.to_path_buf();
        let got = tokio::task::spawn_blocking(move || -> std::io::Result<String> {
            use sha2::Digest;
            let mut f = std::fs::File::open(&p)?;
            let mut h = Sha256::new();
            std::io::copy(&mut f, &mut h)?;
            Ok(hex::encode(h.finalize()))
        })
        .await
        .ok()
        .and_then(|r| r.ok())
        .unwrap_or_default();
        if got != sha256 {
            let _ = std::fs::remove_file(path);
            return Err(CatalogError::Forged {
                what: format!("layer {sha256}"),
                reason: format!("its content hashes to {got}"),
            });
        }
        Ok(())
    }

    /// Appends a chunk of log lines of a build (chunk numbers increase).
    pub async fn append_logs(
        &self,
        build_id: &str,
        seq: u64,
        lines: &[LogLine],
    ) -> Result<(), CatalogError> {
        let raw = serde_json::to_vec(lines).expect("log lines serialize");
        self.storage
            .put(
                &format!("{}{seq:08}.json", Self::log_prefix(build_id)),
                &mut raw.as_slice(),
            )
            .await?;
        Ok(())
    }

    /// Every log line of a build, in order.
    pub async fn logs(&self, build_id: &str) -> Result<Vec<LogLine>, CatalogError> {
        let mut out = Vec::new();
        for key in self.storage.list(&Self::log_prefix(build_id)).await? {
            let Some(raw) = self.storage.read(&key, MAX_OBJECT).await? else {
                continue;
            };
            if let Ok(lines) = serde_json::from_slice::<Vec<LogLine>>(&raw) {
                out.extend(lines);
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use agentenv_core::storage::{OpendalStorage, StorageConfig};

    fn catalog(dir: &Path, seed: &str) -> TemplateCatalog {
        let cfg = StorageConfig::Fs {
            root: dir.to_path_buf(),
        };
        TemplateCatalog::new(Arc::new(OpendalStorage::open(&cfg).unwrap()), seed)
    }

    fn record(id: &str, names: &[&str]) -> TemplateRecord {
        TemplateRecord {
            template_id: id.into(),
            names: names.iter().map(|n| n.to_string()).collect(),
            public: false,
            cpu_count: 2,
            memory_mb: 512,
            disk_size_mb: 1024,
            created_at_ms: 1,
            updated_at_ms: 1,
            tags: BTreeMap::new(),
            builds: vec![],
        }
    }

    #[test]
    fn names_and_tags_are_checked() {
        assert!(validate_name("my-tpl.v1_2").is_ok());
        for bad in ["", "-x", "Upper", "a/b", "a:b", &"x".repeat(129)] {
            assert!(validate_name(bad).is_err(), "{bad}");
        }
        assert!(validate_tag("v1.0-RC_1").is_ok());
        assert!(validate_tag("a:b").is_err());
        assert!(is_template_id(&new_template_id()));
    }

    #[tokio::test]
    async fn a_name_is_claimed_once_and_a_signed_record_resolves_it() {
        let dir = tempfile::tempdir().unwrap();
        let c = catalog(dir.path(), "seed");
        let a = new_template_id();
        let b = new_template_id();
        c.claim_name("web", &a).await.unwrap();
        c.save_record(&record(&a, &["web"])).await.unwrap();
        let err = c.claim_name("web", &b).await.unwrap_err();
        assert!(
            matches!(err, CatalogError::NameTaken { ref owner, .. } if *owner == a),
            "{err}"
        );
        assert_eq!(c.resolve("web").await.unwrap().unwrap().template_id, a);
        assert_eq!(c.resolve(&a).await.unwrap().unwrap().template_id, a);
        // The template drops the name: another may take it over.
        c.save_record(&record(&a, &[])).await.unwrap();
        assert!(c.resolve("web").await.unwrap().is_none());
        c.claim_name("web", &b).await.unwrap();
    }

    #[tokio::test]
    async fn records_signed_with_another_seed_or_moved_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let ours = catalog(dir.path(), "seed");
        let theirs = catalog(dir.path(), "other seed");
        let id = new_template_id();
        theirs.save_record(&record(&id, &[])).await.unwrap();
        let err = ours.record(&id).await.unwrap_err();
        assert!(matches!(err, CatalogError::Forged { .. }), "{err}");
        assert!(
            err.to_string()
                .contains("AENV_SANDBOX_ACCESS_TOKEN_HASH_SEED")
        );
        // A record signed by us, copied under another id, does not verify there.
        let id2 = new_template_id();
        ours.save_record(&record(&id, &[])).await.unwrap();
        std::fs::copy(
            dir.path().join(format!("templates/records/{id}.json")),
            dir.path().join(format!("templates/records/{id2}.json")),
        )
        .unwrap();
        assert!(matches!(
            ours.record(&id2).await,
            Err(CatalogError::Forged { .. })
        ));
        // Listing leaves out what does not verify.
        let listed: Vec<_> = ours
            .list()
            .await
            .unwrap()
            .into_iter()
            .map(|r| r.template_id)
            .collect();
        assert_eq!(listed, vec![id]);
    }

    #[tokio::test]
    async fn a_layer_changed_in_the_store_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let c = catalog(dir.path(), "seed");
        let src = dir.path().join("l.tar.zst");
        std::fs::write(&src, b"layer bytes").unwrap();
        let layer = c.put_layer(&src).await.unwrap();
        let out = dir.path().join("out");
        c.get_layer(&layer, &out).await.unwrap();
        assert_eq!(std::fs::read(&out).unwrap(), b"layer bytes");
        std::fs::write(
            dir.path().join(TemplateCatalog::layer_key(&layer.sha256)),
            b"other bytes",
        )
        .unwrap();
        let out2 = dir.path().join("out2");
        assert!(matches!(
            c.get_layer(&layer, &out2).await,
            Err(CatalogError::Forged { .. })
        ));
        assert!(!out2.exists());
    }

    #[tokio::test]
    async fn log_chunks_come_back_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let c = catalog(dir.path(), "seed");
        let line = |m: &str| LogLine {
            timestamp: "2026-01-01T00:00:00Z".into(),
            level: "info".into(),
            message: m.into(),
            step: None,
        };
        let b = uuid::Uuid::new_v4().to_string();
        c.append_logs(&b, 1, &[line("b"), line("c")]).await.unwrap();
        c.append_logs(&b, 0, &[line("a")]).await.unwrap();
        let got: Vec<_> = c
            .logs(&b)
            .await
            .unwrap()
            .into_iter()
            .map(|l| l.message)
            .collect();
        assert_eq!(got, ["a", "b", "c"]);
    }
}
