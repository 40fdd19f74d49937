//! Blob storage that every node of a cluster can read: snapshot artifacts and catalog
//! records. One implementation, [`OpendalStorage`], on Apache OpenDAL with two services:
//!
//! * `fs`: a directory, normally a shared POSIX mount (NFS, CephFS, a bind mount on one
//!   host). Objects are files under the root; a `put` writes a temporary file and renames
//!   it into place, so readers never see half an object.
//! * `s3`: any S3-compatible object store (AWS S3, Alibaba OSS, MinIO, ...), under an
//!   optional key prefix.
//!
//! Keys are relative, `/`-separated paths (`catalog/records/<id>.json`). Bodies stream in
//! both directions: [`Storage::put`] reads from an `AsyncRead` and [`Storage::get`] writes
//! to an `AsyncWrite`, chunk by chunk (multipart uploads on S3), never holding a whole
//! object in memory. [`Storage::create_new`] creates a small object only when the key is
//! free, atomically (a hard link on `fs`, `If-None-Match: *` on S3), which is what
//! catalog records and aliases need to be unique across nodes.

use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use futures::TryStreamExt;
use opendal::layers::RetryLayer;
use opendal::{ErrorKind, Operator};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// Size of the chunks a `put` uploads (S3 multipart parts) and a `get` reads.
pub const CHUNK_SIZE: usize = 8 << 20;

/// Errors of a [`Storage`]. Each says what to fix where it can.
#[derive(Debug, thiserror::Error)]
pub enum StorageError {
    #[error("object {key} not found in {store}")]
    NotFound { store: String, key: String },
    #[error(
        "invalid storage key {0:?}: use a relative path of non-empty segments without '.' or '..'"
    )]
    InvalidKey(String),
    #[error("object {key} in {store} is larger than the {limit} bytes expected")]
    TooLarge {
        store: String,
        key: String,
        limit: usize,
    },
    #[error(
        "the storage directory {} is not writable ({source}): create it and give the node's user write access, or point the setting at a writable (shared) directory",
        path.display()
    )]
    NotWritable {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "the bucket {bucket:?} does not exist at {endpoint}: create it, or fix the bucket/endpoint setting ({detail})"
    )]
    BucketMissing {
        bucket: String,
        endpoint: String,
        detail: String,
    },
    #[error(
        "{endpoint} refused the credentials for bucket {bucket:?}: check the access key id, secret and session token, and that they may read and write the bucket ({detail})"
    )]
    CredentialsRefused {
        bucket: String,
        endpoint: String,
        detail: String,
    },
    #[error(
        "cannot reach the object store at {endpoint}: check the endpoint setting and the network ({detail})"
    )]
    Unreachable { endpoint: String, detail: String },
    #[error("invalid storage configuration: {0}")]
    Config(String),
    #[error("{op} {key} in {store}: {source}")]
    Backend {
        op: &'static str,
        store: String,
        key: String,
        #[source]
        source: Box<opendal::Error>,
    },
    #[error("{op} {key} in {store}: {source}")]
    Io {
        op: &'static str,
        store: String,
        key: String,
        #[source]
        source: std::io::Error,
    },
}

/// What [`Storage::stat`] knows about an object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectMeta {
    pub key: String,
    pub size: u64,
}

/// Blob storage shared by the nodes of a cluster.
#[async_trait]
pub trait Storage: Send + Sync + fmt::Debug {
    /// A short description for messages: `posix_fs /mnt/aenv-snapshots`, `s3 bucket/prefix`.
    fn describe(&self) -> String;

    /// Checks that the store is usable (directory writable; bucket present, credentials
    /// accepted); the error says what to fix. Run once at startup.
    async fn check(&self) -> Result<(), StorageError>;

    /// Writes `key` from `src` until its end, replacing any object there; returns the
    /// bytes written. The object appears whole or not at all.
    async fn put(
        &self,
        key: &str,
        src: &mut (dyn AsyncRead + Unpin + Send),
    ) -> Result<u64, StorageError>;

    /// Streams `key` into `dst`; returns the bytes read.
    async fn get(
        &self,
        key: &str,
        dst: &mut (dyn AsyncWrite + Unpin + Send),
    ) -> Result<u64, StorageError>;

    /// The object's size, `None` when it does not exist.
    async fn stat(&self, key: &str) -> Result<Option<ObjectMeta>, StorageError>;

    /// Keys of every object under `prefix` (recursively), sorted.
    async fn list(&self, prefix: &str) -> Result<Vec<String>, StorageError>;

    /// Deletes `key`; an absent object is fine.
    async fn delete(&self, key: &str) -> Result<(), StorageError>;

    /// Creates `key` with `data` only if no object has that key: `true` when created,
    /// `false` when one existed (left untouched). Atomic across nodes.
    async fn create_new(&self, key: &str, data: Bytes) -> Result<bool, StorageError>;

    /// Uploads the file at `path` to `key`.
    async fn put_file(&self, key: &str, path: &Path) -> Result<u64, StorageError> {
        let mut f = tokio::fs::File::open(path)
            .await
            .map_err(|source| StorageError::Io {
                op: "opening the upload source",
                store: self.describe(),
                key: path.display().to_string(),
                source,
            })?;
        self.put(key, &mut f).await
    }

    /// Downloads `key` to a new file at `path` (written beside it, then renamed).
    async fn get_file(&self, key: &str, path: &Path) -> Result<u64, StorageError> {
        let io = |op: &'static str| {
            let store = self.describe();
            let key = path.display().to_string();
            move |source| StorageError::Io {
                op,
                store,
                key,
                source,
            }
        };
        let tmp = path.with_extension(format!("part-{:016x}", rand_u64()));
        let mut f = tokio::fs::File::create(&tmp)
            .await
            .map_err(io("creating the download target"))?;
        let r = async {
            let n = self.get(key, &mut f).await?;
            f.sync_all().await.map_err(io("syncing the download"))?;
            tokio::fs::rename(&tmp, path)
                .await
                .map_err(io("renaming the download"))?;
            Ok(n)
        }
        .await;
        if r.is_err() {
            let _ = tokio::fs::remove_file(&tmp).await;
        }
        r
    }

    /// Reads a small object whole: `None` when absent, an error above `limit` bytes.
    async fn read(&self, key: &str, limit: usize) -> Result<Option<Vec<u8>>, StorageError> {
        let mut w = LimitedVec {
            buf: Vec::new(),
            limit,
        };
        match self.get(key, &mut w).await {
            Ok(_) => Ok(Some(w.buf)),
            Err(StorageError::NotFound { .. }) => Ok(None),
            Err(StorageError::Io { source, .. })
                if source.kind() == std::io::ErrorKind::FileTooLarge =>
            {
                Err(StorageError::TooLarge {
                    store: self.describe(),
                    key: key.to_string(),
                    limit,
                })
            }
            Err(e) => Err(e),
        }
    }

    /// Deletes every object under `prefix`.
    async fn delete_prefix(&self, prefix: &str) -> Result<(), StorageError> {
        for key in self.list(prefix).await? {
            self.delete(&key).await?;
        }
        Ok(())
    }
}

fn rand_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    h.finish()
}

/// An `AsyncWrite` into a `Vec` that fails past `limit` bytes.
struct LimitedVec {
    buf: Vec<u8>,
    limit: usize,
}

impl AsyncWrite for LimitedVec {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        _cx: &mut std::task::Context<'_>,
        data: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        if self.buf.len() + data.len() > self.limit {
            return std::task::Poll::Ready(Err(std::io::Error::from(
                std::io::ErrorKind::FileTooLarge,
            )));
        }
        self.buf.extend_from_slice(data);
        std::task::Poll::Ready(Ok(data.len()))
    }

    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::task::Poll::Ready(Ok(()))
    }
}

/// Checks a storage key: relative, `/`-separated, no empty, `.` or `..` segments.
pub fn validate_key(key: &str) -> Result<(), StorageError> {
    let ok = !key.is_empty()
        && !key.starts_with('/')
        && !key.ends_with('/')
        && !key.contains('\0')
        && key
            .split('/')
            .all(|s| !s.is_empty() && s != "." && s != "..");
    if ok {
        Ok(())
    } else {
        Err(StorageError::InvalidKey(key.to_string()))
    }
}

/// Checks a list prefix: empty, or a key followed by `/`.
fn validate_prefix(prefix: &str) -> Result<(), StorageError> {
    if prefix.is_empty() {
        return Ok(());
    }
    match prefix.strip_suffix('/') {
        Some(p) => validate_key(p),
        None => Err(StorageError::InvalidKey(prefix.to_string())),
    }
}

/// S3 bucket addressing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AddressingStyle {
    /// `https://<bucket>.<endpoint host>/<key>`
    Virtual,
    /// `https://<endpoint host>/<bucket>/<key>`
    Path,
}

/// Settings of an S3-compatible store.
#[derive(Clone, PartialEq, Eq)]
pub struct S3Config {
    /// `http://` or `https://` URL of the service.
    pub endpoint: String,
    pub bucket: String,
    /// Key prefix inside the bucket (may be empty).
    pub prefix: String,
    pub region: String,
    pub access_key_id: String,
    pub secret_access_key: String,
    pub security_token: Option<String>,
    /// `None` picks virtual-host style for Alibaba OSS endpoints, path style otherwise.
    pub addressing_style: Option<AddressingStyle>,
}

impl fmt::Debug for S3Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("S3Config")
            .field("endpoint", &self.endpoint)
            .field("bucket", &self.bucket)
            .field("prefix", &self.prefix)
            .field("region", &self.region)
            .field("access_key_id", &self.access_key_id)
            .field("secret_access_key", &"<redacted>")
            .field(
                "security_token",
                &self.security_token.as_ref().map(|_| "<redacted>"),
            )
            .field("addressing_style", &self.addressing_style)
            .finish()
    }
}

impl S3Config {
    fn virtual_host(&self) -> bool {
        match self.addressing_style {
            Some(AddressingStyle::Virtual) => true,
            Some(AddressingStyle::Path) => false,
            None => self.endpoint.contains("aliyuncs.com"),
        }
    }
}

/// Which store to open.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StorageConfig {
    /// A directory (a shared POSIX mount for several nodes).
    Fs { root: PathBuf },
    /// An S3-compatible bucket.
    S3(S3Config),
}

/// The [`Storage`] on OpenDAL.
pub struct OpendalStorage {
    op: Operator,
    kind: Kind,
}

#[derive(Debug)]
enum Kind {
    Fs { root: PathBuf },
    S3 { bucket: String, endpoint: String },
}

impl fmt::Debug for OpendalStorage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OpendalStorage")
            .field("kind", &self.kind)
            .finish()
    }
}

/// Name of the directory under an `fs` root where uploads are written before the rename.
pub const FS_UPLOAD_DIR: &str = ".uploads";

impl OpendalStorage {
    /// Opens the store `cfg` names (an `fs` root is created; see [`Storage::check`]).
    pub fn open(cfg: &StorageConfig) -> Result<Self, StorageError> {
        let retry = RetryLayer::new()
            .with_max_times(3)
            .with_min_delay(Duration::from_millis(50))
            .with_max_delay(Duration::from_secs(1));
        match cfg {
            StorageConfig::Fs { root } => {
                if !root.is_absolute() {
                    return Err(StorageError::Config(format!(
                        "the storage directory {} must be an absolute path",
                        root.display()
                    )));
                }
                let root_s = root.to_str().ok_or_else(|| {
                    StorageError::Config(format!(
                        "the storage directory {} is not valid UTF-8",
                        root.display()
                    ))
                })?;
                let upload = root.join(FS_UPLOAD_DIR);
                let builder = opendal::services::Fs::default()
                    .root(root_s)
                    .atomic_write_dir(&upload.to_string_lossy());
                // Building the fs service creates the root directory.
                let op = Operator::new(builder)
                    .map_err(|e| StorageError::NotWritable {
                        path: root.clone(),
                        source: std::io::Error::other(e.to_string()),
                    })?
                    .layer(retry)
                    .finish();
                Ok(Self {
                    op,
                    kind: Kind::Fs { root: root.clone() },
                })
            }
            StorageConfig::S3(c) => {
                if !(c.endpoint.starts_with("http://") || c.endpoint.starts_with("https://")) {
                    return Err(StorageError::Config(format!(
                        "the endpoint {:?} needs a scheme, e.g. https://oss-cn-hangzhou.aliyuncs.com",
                        c.endpoint
                    )));
                }
                if c.bucket.trim().is_empty() {
                    return Err(StorageError::Config("the bucket is not set".into()));
                }
                if c.region.trim().is_empty() {
                    return Err(StorageError::Config(
                        "the region is not set (S3-compatible stores need one; use the provider's region name, or \"auto\")".into(),
                    ));
                }
                if c.access_key_id.is_empty() || c.secret_access_key.is_empty() {
                    return Err(StorageError::Config(
                        "the access key id and secret must both be set".into(),
                    ));
                }
                let prefix = c.prefix.trim_matches('/');
                if !prefix.is_empty() {
                    validate_key(prefix)?;
                }
                let mut b = opendal::services::S3::default()
                    .endpoint(&c.endpoint)
                    .bucket(&c.bucket)
                    .region(&c.region)
                    .root(&format!("/{prefix}"))
                    .access_key_id(&c.access_key_id)
                    .secret_access_key(&c.secret_access_key)
                    .disable_config_load()
                    .disable_ec2_metadata();
                if let Some(t) = &c.security_token {
                    b = b.session_token(t);
                }
                if c.virtual_host() {
                    b = b.enable_virtual_host_style();
                }
                let op = Operator::new(b)
                    .map_err(|e| StorageError::Config(e.to_string()))?
                    .layer(retry)
                    .finish();
                Ok(Self {
                    op,
                    kind: Kind::S3 {
                        bucket: c.bucket.clone(),
                        endpoint: c.endpoint.clone(),
                    },
                })
            }
        }
    }

    /// Maps an OpenDAL error to what a user can act on.
    fn err(&self, op: &'static str, key: &str, e: opendal::Error) -> StorageError {
        let detail = e.to_string();
        match (&self.kind, e.kind()) {
            (_, ErrorKind::NotFound) => StorageError::NotFound {
                store: self.describe(),
                key: key.to_string(),
            },
            (Kind::S3 { bucket, endpoint }, _) if detail.contains("NoSuchBucket") => {
                StorageError::BucketMissing {
                    bucket: bucket.clone(),
                    endpoint: endpoint.clone(),
                    detail,
                }
            }
            (Kind::S3 { bucket, endpoint }, ErrorKind::PermissionDenied) => {
                StorageError::CredentialsRefused {
                    bucket: bucket.clone(),
                    endpoint: endpoint.clone(),
                    detail,
                }
            }
            (Kind::S3 { endpoint, .. }, ErrorKind::Unexpected)
                if detail.contains("send http request")
                    || detail.contains("error sending request")
                    || detail.contains("connect") =>
            {
                StorageError::Unreachable {
                    endpoint: endpoint.clone(),
                    detail,
                }
            }
            (Kind::Fs { root }, ErrorKind::PermissionDenied) => StorageError::NotWritable {
                path: root.clone(),
                source: std::io::Error::new(std::io::ErrorKind::PermissionDenied, detail),
            },
            _ => StorageError::Backend {
                op,
                store: self.describe(),
                key: key.to_string(),
                source: Box::new(e),
            },
        }
    }

    fn io_err(&self, op: &'static str, key: &str, source: std::io::Error) -> StorageError {
        StorageError::Io {
            op,
            store: self.describe(),
            key: key.to_string(),
            source,
        }
    }
}

/// Creates `target` with `data` unless it exists: a temporary file beside it, synced,
/// then hard-linked (which fails if the name is taken, atomically, also on NFS).
fn fs_create_new(target: &Path, data: &[u8]) -> std::io::Result<bool> {
    use std::io::Write;
    let dir = target
        .parent()
        .ok_or_else(|| std::io::Error::other("a key has a parent directory"))?;
    std::fs::create_dir_all(dir)?;
    let name = target
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = dir.join(format!(".{name}.{:016x}.new", rand_u64()));
    let result = (|| {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)?;
        f.write_all(data)?;
        f.sync_all()?;
        match std::fs::hard_link(&tmp, target) {
            Ok(()) => {
                if let Ok(d) = std::fs::File::open(dir) {
                    let _ = d.sync_all();
                }
                Ok(true)
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(false),
            Err(e) => Err(e),
        }
    })();
    let _ = std::fs::remove_file(&tmp);
    result
}

#[async_trait]
impl Storage for OpendalStorage {
    fn describe(&self) -> String {
        match &self.kind {
            Kind::Fs { root } => format!("posix_fs {}", root.display()),
            Kind::S3 { bucket, endpoint } => {
                let root = self.op.info().root();
                format!("s3 {bucket}{} at {endpoint}", root.trim_end_matches('/'))
            }
        }
    }

    async fn check(&self) -> Result<(), StorageError> {
        match &self.kind {
            Kind::Fs { root } => {
                let not_writable = |source| StorageError::NotWritable {
                    path: root.clone(),
                    source,
                };
                tokio::fs::create_dir_all(root.join(FS_UPLOAD_DIR))
                    .await
                    .map_err(not_writable)?;
                let probe = root.join(format!(".probe-{:016x}", rand_u64()));
                let p = probe.clone();
                tokio::task::spawn_blocking(move || fs_create_new(&p, b"probe"))
                    .await
                    .map_err(|e| not_writable(std::io::Error::other(e)))?
                    .map_err(not_writable)?;
                tokio::fs::remove_file(&probe).await.map_err(not_writable)?;
                Ok(())
            }
            Kind::S3 { .. } => {
                self.op
                    .list_with("")
                    .limit(1)
                    .await
                    .map_err(|e| self.err("listing", "/", e))?;
                Ok(())
            }
        }
    }

    async fn put(
        &self,
        key: &str,
        src: &mut (dyn AsyncRead + Unpin + Send),
    ) -> Result<u64, StorageError> {
        validate_key(key)?;
        let mut w = self
            .op
            .writer_with(key)
            .chunk(CHUNK_SIZE)
            .await
            .map_err(|e| self.err("writing", key, e))?;
        let mut total = 0u64;
        let result = async {
            loop {
                let mut buf = bytes::BytesMut::with_capacity(1 << 20);
                // Fill up to 1 MiB (or the end) before handing a buffer over.
                while buf.len() < buf.capacity() {
                    let n = src
                        .read_buf(&mut buf)
                        .await
                        .map_err(|e| self.io_err("reading the upload source for", key, e))?;
                    if n == 0 {
                        break;
                    }
                }
                if buf.is_empty() {
                    break;
                }
                total += buf.len() as u64;
                w.write(buf.freeze())
                    .await
                    .map_err(|e| self.err("writing", key, e))?;
            }
            w.close().await.map_err(|e| self.err("writing", key, e))?;
            Ok(total)
        }
        .await;
        if result.is_err()
            && let Err(e) = w.abort().await
        {
            tracing::debug!(key, error = %e, "aborting an upload");
        }
        result
    }

    async fn get(
        &self,
        key: &str,
        dst: &mut (dyn AsyncWrite + Unpin + Send),
    ) -> Result<u64, StorageError> {
        validate_key(key)?;
        let reader = self
            .op
            .reader_with(key)
            .chunk(CHUNK_SIZE)
            .await
            .map_err(|e| self.err("reading", key, e))?;
        let mut stream = reader
            .into_bytes_stream(..)
            .await
            .map_err(|e| self.err("reading", key, e))?;
        let mut total = 0u64;
        while let Some(chunk) = stream.try_next().await.map_err(|e| {
            // The stream wraps OpenDAL errors in io::Error.
            match e.get_ref().and_then(|r| r.downcast_ref::<opendal::Error>()) {
                Some(oe) if oe.kind() == ErrorKind::NotFound => StorageError::NotFound {
                    store: self.describe(),
                    key: key.to_string(),
                },
                _ => self.io_err("reading", key, e),
            }
        })? {
            dst.write_all(&chunk)
                .await
                .map_err(|e| self.io_err("writing the download of", key, e))?;
            total += chunk.len() as u64;
        }
        dst.flush()
            .await
            .map_err(|e| self.io_err("writing the download of", key, e))?;
        Ok(total)
    }

    async fn stat(&self, key: &str) -> Result<Option<ObjectMeta>, StorageError> {
        validate_key(key)?;
        match self.op.stat(key).await {
            Ok(m) if m.is_file() => Ok(Some(ObjectMeta {
                key: key.to_string(),
                size: m.content_length(),
            })),
            Ok(_) => Ok(None),
            Err(e) if e.kind() == ErrorKind::NotFound => Ok(None),
            Err(e) => Err(self.err("stat", key, e)),
        }
    }

    async fn list(&self, prefix: &str) -> Result<Vec<String>, StorageError> {
        validate_prefix(prefix)?;
        let entries = match self.op.list_with(prefix).recursive(true).await {
            Ok(e) => e,
            Err(e) if e.kind() == ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(self.err("listing", prefix, e)),
        };
        let mut keys: Vec<String> = entries
            .into_iter()
            .filter(|e| !e.path().ends_with('/'))
            .map(|e| e.path().trim_start_matches('/').to_string())
            .filter(|k| {
                // Uploads in flight and create_new's temporary files are not objects.
                !k.starts_with(FS_UPLOAD_DIR)
                    && !k
                        .rsplit('/')
                        .next()
                        .is_some_and(|n| n.starts_with('.') && n.ends_with(".new"))
            })
            .collect();
        keys.sort();
        Ok(keys)
    }

    async fn delete(&self, key: &str) -> Result<(), StorageError> {
        validate_key(key)?;
        match self.op.delete(key).await {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == ErrorKind::NotFound => Ok(()),
            Err(e) => Err(self.err("deleting", key, e)),
        }
    }

    /// On `fs` a file is copied by the kernel (`copy_file_range`) into the upload
    /// directory, synced and renamed into place; on S3 it streams as [`Storage::put`].
    async fn put_file(&self, key: &str, path: &Path) -> Result<u64, StorageError> {
        validate_key(key)?;
        let Kind::Fs { root } = &self.kind else {
            let mut f = tokio::fs::File::open(path)
                .await
                .map_err(|e| self.io_err("opening the upload source for", key, e))?;
            return self.put(key, &mut f).await;
        };
        let tmp = root
            .join(FS_UPLOAD_DIR)
            .join(format!("{:016x}.put", rand_u64()));
        let target = root.join(key);
        let r = async {
            tokio::fs::create_dir_all(root.join(FS_UPLOAD_DIR)).await?;
            let n = tokio::fs::copy(path, &tmp).await?;
            tokio::fs::File::open(&tmp).await?.sync_all().await?;
            if let Some(parent) = target.parent() {
                tokio::fs::create_dir_all(parent).await?;
            }
            tokio::fs::rename(&tmp, &target).await?;
            Ok::<u64, std::io::Error>(n)
        }
        .await;
        if r.is_err() {
            let _ = tokio::fs::remove_file(&tmp).await;
        }
        r.map_err(|e| self.io_err("uploading", key, e))
    }

    /// On `fs` the object is copied by the kernel to a file beside `path`, synced and
    /// renamed; on S3 it streams as [`Storage::get`].
    async fn get_file(&self, key: &str, path: &Path) -> Result<u64, StorageError> {
        validate_key(key)?;
        let tmp = path.with_extension(format!("part-{:016x}", rand_u64()));
        let r = match &self.kind {
            Kind::Fs { root } => {
                let src = root.join(key);
                async {
                    let n = tokio::fs::copy(&src, &tmp).await?;
                    tokio::fs::File::open(&tmp).await?.sync_all().await?;
                    tokio::fs::rename(&tmp, path).await?;
                    Ok::<u64, std::io::Error>(n)
                }
                .await
                .map_err(|e| match e.kind() {
                    std::io::ErrorKind::NotFound if !src.is_file() => StorageError::NotFound {
                        store: self.describe(),
                        key: key.to_string(),
                    },
                    _ => self.io_err("downloading", key, e),
                })
            }
            Kind::S3 { .. } => {
                async {
                    let mut f = tokio::fs::File::create(&tmp)
                        .await
                        .map_err(|e| self.io_err("creating the download target of", key, e))?;
                    let n = self.get(key, &mut f).await?;
                    f.sync_all()
                        .await
                        .map_err(|e| self.io_err("syncing the download of", key, e))?;
                    tokio::fs::rename(&tmp, path)
                        .await
                        .map_err(|e| self.io_err("renaming the download of", key, e))?;
                    Ok(n)
                }
                .await
            }
        };
        if r.is_err() {
            let _ = tokio::fs::remove_file(&tmp).await;
        }
        r
    }

    async fn create_new(&self, key: &str, data: Bytes) -> Result<bool, StorageError> {
        validate_key(key)?;
        match &self.kind {
            Kind::Fs { root } => {
                let target = root.join(key);
                tokio::task::spawn_blocking(move || fs_create_new(&target, &data))
                    .await
                    .map_err(|e| self.io_err("creating", key, std::io::Error::other(e)))?
                    .map_err(|e| self.io_err("creating", key, e))
            }
            Kind::S3 { .. } => match self.op.write_with(key, data).if_not_exists(true).await {
                Ok(_) => Ok(true),
                Err(e) if e.kind() == ErrorKind::ConditionNotMatch => Ok(false),
                Err(e) => Err(self.err("creating", key, e)),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_relative_paths_without_dot_segments() {
        for ok in ["a", "catalog/records/x.json", "snapshots/id/layer.tar"] {
            assert!(validate_key(ok).is_ok(), "{ok}");
        }
        for bad in ["", "/a", "a/", "a//b", "../x", "a/./b", "a/../b", "a\0b"] {
            assert!(validate_key(bad).is_err(), "{bad:?}");
        }
        assert!(validate_prefix("").is_ok());
        assert!(validate_prefix("catalog/").is_ok());
        assert!(validate_prefix("catalog").is_err());
    }

    #[test]
    fn s3_config_rejects_what_cannot_work_and_redacts_secrets() {
        let base = S3Config {
            endpoint: "http://127.0.0.1:9".into(),
            bucket: "b".into(),
            prefix: "p/".into(),
            region: "us-east-1".into(),
            access_key_id: "ak".into(),
            secret_access_key: "very-secret".into(),
            security_token: Some("tok-secret".into()),
            addressing_style: None,
        };
        let dbg = format!("{base:?}");
        assert!(
            !dbg.contains("very-secret") && !dbg.contains("tok-secret"),
            "{dbg}"
        );
        assert!(OpendalStorage::open(&StorageConfig::S3(base.clone())).is_ok());
        let mut c = base.clone();
        c.endpoint = "127.0.0.1:9".into();
        let e = OpendalStorage::open(&StorageConfig::S3(c)).unwrap_err();
        assert!(e.to_string().contains("scheme"), "{e}");
        let mut c = base.clone();
        c.region = String::new();
        let e = OpendalStorage::open(&StorageConfig::S3(c)).unwrap_err();
        assert!(e.to_string().contains("region"), "{e}");
        let mut c = base;
        c.secret_access_key = String::new();
        let e = OpendalStorage::open(&StorageConfig::S3(c)).unwrap_err();
        assert!(e.to_string().contains("secret"), "{e}");
        let e = OpendalStorage::open(&StorageConfig::Fs {
            root: "relative".into(),
        })
        .unwrap_err();
        assert!(e.to_string().contains("absolute"), "{e}");
    }

    #[test]
    fn oss_endpoints_default_to_virtual_host_addressing() {
        let mut c = S3Config {
            endpoint: "https://oss-cn-hangzhou.aliyuncs.com".into(),
            bucket: "b".into(),
            prefix: String::new(),
            region: "cn-hangzhou".into(),
            access_key_id: "a".into(),
            secret_access_key: "s".into(),
            security_token: None,
            addressing_style: None,
        };
        assert!(c.virtual_host());
        c.endpoint = "http://127.0.0.1:9000".into();
        assert!(!c.virtual_host());
        c.addressing_style = Some(AddressingStyle::Virtual);
        assert!(c.virtual_host());
    }
}
