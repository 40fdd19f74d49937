//! Verified blobs by digest: `<dir>/sha256/<hex>`, written under `<dir>/tmp/` and renamed
//! into place only once their size and digest were checked.

use std::path::{Path, PathBuf};

use super::OciError;

/// A directory of blobs keyed by their sha256 digest.
#[derive(Debug, Clone)]
pub struct LayerCache {
    dir: PathBuf,
}

fn cache_err(path: &Path) -> impl FnOnce(std::io::Error) -> OciError + '_ {
    move |source| OciError::Cache {
        path: path.to_path_buf(),
        source,
    }
}

impl LayerCache {
    /// A cache in `dir` (created on first use).
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self { dir: dir.into() }
    }

    /// The cache's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Where the blob `digest` (`sha256:<hex>`, already validated) is kept.
    pub fn path_of(&self, digest: &str) -> PathBuf {
        let hex = digest.strip_prefix("sha256:").unwrap_or(digest);
        self.dir.join("sha256").join(hex)
    }

    /// The blob's path when it is cached with the expected size.
    pub fn lookup(&self, digest: &str, size: u64) -> Option<PathBuf> {
        let p = self.path_of(digest);
        match std::fs::symlink_metadata(&p) {
            Ok(m) if m.is_file() && m.len() == size => Some(p),
            _ => None,
        }
    }

    /// A new temporary file for a blob being fetched.
    pub(crate) async fn temp_file(&self) -> Result<(tokio::fs::File, PathBuf), OciError> {
        let tmp = self.dir.join("tmp");
        tokio::fs::create_dir_all(&tmp)
            .await
            .map_err(cache_err(&tmp))?;
        tokio::fs::create_dir_all(self.dir.join("sha256"))
            .await
            .map_err(cache_err(&self.dir))?;
        let path = tmp.join(format!("{:016x}.partial", rand::random::<u64>()));
        let f = tokio::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&path)
            .await
            .map_err(cache_err(&path))?;
        Ok((f, path))
    }

    /// Moves a verified temporary file into place as `digest`.
    pub(crate) async fn commit(&self, tmp: &Path, digest: &str) -> Result<PathBuf, OciError> {
        let dest = self.path_of(digest);
        tokio::fs::rename(tmp, &dest)
            .await
            .map_err(cache_err(&dest))?;
        Ok(dest)
    }
}
