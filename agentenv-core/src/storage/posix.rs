//! The POSIX backend: a directory, normally a shared mount (NFS, CephFS, a bind mount on
//! one host). Uploads are written under [`FS_UPLOAD_DIR`] and renamed into place;
//! `create_new` writes a temporary file beside the target and hard-links it.

use std::path::Path;

use opendal::Operator;
use opendal::layers::RetryLayer;

use super::{StorageError, rand_u64};

/// Name of the directory under an `fs` root where uploads are written before the rename.
pub const FS_UPLOAD_DIR: &str = ".uploads";

/// The OpenDAL operator on the directory `root` (which it creates).
pub(super) fn operator(root: &Path, retry: RetryLayer) -> Result<Operator, StorageError> {
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
    Ok(Operator::new(builder)
        .map_err(|e| StorageError::NotWritable {
            path: root.to_path_buf(),
            source: std::io::Error::other(e.to_string()),
        })?
        .layer(retry)
        .finish())
}

/// Whether a listed key is a backend's temporary file rather than an object: uploads
/// in flight and `create_new`'s temporary files.
pub(super) fn is_temporary(key: &str) -> bool {
    key.starts_with(FS_UPLOAD_DIR)
        || key
            .rsplit('/')
            .next()
            .is_some_and(|n| n.starts_with('.') && n.ends_with(".new"))
}

/// Creates `target` with `data` unless it exists: a temporary file beside it, synced,
/// then hard-linked (which fails if the name is taken, atomically, also on NFS).
pub(super) fn create_new(target: &Path, data: &[u8]) -> std::io::Result<bool> {
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

/// Uploads the file at `path` to `key` under `root`: copied by the kernel
/// (`copy_file_range`) into the upload directory, synced, renamed into place.
pub(super) async fn put_file(root: &Path, key: &str, path: &Path) -> std::io::Result<u64> {
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
        Ok(n)
    }
    .await;
    if r.is_err() {
        let _ = tokio::fs::remove_file(&tmp).await;
    }
    r
}

/// Copies the object file `src` to `tmp` (by the kernel), syncs it and renames it to
/// `path`. The caller removes `tmp` on failure.
pub(super) async fn get_file(src: &Path, tmp: &Path, path: &Path) -> std::io::Result<u64> {
    let n = tokio::fs::copy(src, tmp).await?;
    tokio::fs::File::open(tmp).await?.sync_all().await?;
    tokio::fs::rename(tmp, path).await?;
    Ok(n)
}
