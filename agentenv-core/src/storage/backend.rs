//! [`OpendalStorage`]: the [`Storage`] on Apache OpenDAL, over the POSIX directory or
//! the S3 backend, with OpenDAL's errors mapped to what a user can act on.

use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use futures::TryStreamExt;
use opendal::layers::RetryLayer;
use opendal::{ErrorKind, Operator};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::key::{validate_key, validate_prefix};
use super::posix::{self, FS_UPLOAD_DIR};
use super::s3::{self, S3Config};
use super::{CHUNK_SIZE, ObjectMeta, Storage, StorageError, rand_u64};

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

impl OpendalStorage {
    /// Opens the store `cfg` names (an `fs` root is created; see [`Storage::check`]).
    pub fn open(cfg: &StorageConfig) -> Result<Self, StorageError> {
        let retry = RetryLayer::new()
            .with_max_times(3)
            .with_min_delay(Duration::from_millis(50))
            .with_max_delay(Duration::from_secs(1));
        Ok(match cfg {
            StorageConfig::Fs { root } => Self {
                op: posix::operator(root, retry)?,
                kind: Kind::Fs { root: root.clone() },
            },
            StorageConfig::S3(c) => Self {
                op: s3::operator(c, retry)?,
                kind: Kind::S3 {
                    bucket: c.bucket.clone(),
                    endpoint: c.endpoint.clone(),
                },
            },
        })
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
                tokio::task::spawn_blocking(move || posix::create_new(&p, b"probe"))
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
            .filter(|k| !posix::is_temporary(k))
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
        posix::put_file(root, key, path)
            .await
            .map_err(|e| self.io_err("uploading", key, e))
    }

    /// On `fs` the object is copied by the kernel to a file beside `path`, synced and
    /// renamed; on S3 it streams as [`Storage::get`].
    async fn get_file(&self, key: &str, path: &Path) -> Result<u64, StorageError> {
        validate_key(key)?;
        let tmp = path.with_extension(format!("part-{:016x}", rand_u64()));
        let r = match &self.kind {
            Kind::Fs { root } => {
                let src = root.join(key);
                posix::get_file(&src, &tmp, path)
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
                tokio::task::spawn_blocking(move || posix::create_new(&target, &data))
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
