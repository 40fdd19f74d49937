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
//!
//! The module is laid out by concern: the [`Storage`] trait and its types here, key
//! checks in `key`, the POSIX directory backend in `posix`, the S3 settings and backend
//! in `s3`, and [`OpendalStorage`], which runs either on OpenDAL, in `backend`.

use std::fmt;
use std::path::{Path, PathBuf};

use async_trait::async_trait;
use bytes::Bytes;
use tokio::io::{AsyncRead, AsyncWrite};

mod backend;
mod key;
mod posix;
mod s3;

pub use backend::{OpendalStorage, StorageConfig};
pub use key::validate_key;
pub use posix::FS_UPLOAD_DIR;
pub use s3::{AddressingStyle, S3Config};

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
