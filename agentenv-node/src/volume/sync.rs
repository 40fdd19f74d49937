//! Volumes on an `oss` store: the files are objects under `volumes/data/<id>/`, and a
//! node serves a volume from a node-local copy, `<local>/<id>/data/`.
//!
//! The first user of a volume on a node (a sandbox mounting it, a content API call)
//! downloads the objects into a fresh copy; every sandbox of that node mounting the
//! volume shares the copy. A pause uploads what changed; the last user's release (the
//! sandbox deleted, the node shut down, the call done) uploads what changed and removes
//! the copy. What changed is found by comparing each regular file's size and
//! modification time with what the copy held after the last download or upload; files
//! that were there then and are gone now are deleted from the bucket.
//!
//! What this does not promise: no live sharing between nodes (another node sees changes
//! once they are uploaded, and only when its own copy is made afterwards); the last
//! upload of a file wins, whole files at a time; a node that stops without a release
//! (a crash) loses the changes since the last upload; only regular files and the
//! directories holding them are kept (symlinks, FIFOs, sockets, empty directories,
//! owners, modes and times are not: files come back as root's, mode 0644). The copy is
//! read and written through [`SafeDir`]: a tenant's links are never followed.

use std::collections::{BTreeMap, HashMap};
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use agentenv_core::storage::Storage;
use nix::sys::stat::SFlag;
use parking_lot::Mutex;

use super::VolumeError;
use crate::host::safefs::SafeDir;

/// Deepest directory tree of a volume that is uploaded.
const MAX_DEPTH: usize = 64;

/// Most files of one volume that are uploaded.
const MAX_FILES: usize = 100_000;

/// What a file was when the copy last matched the bucket: size and modification time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stamp {
    size: i64,
    mtime: (i64, i64),
}

/// A node's copy of one volume.
#[derive(Debug, Default)]
struct Copy {
    /// Users of the copy: while there are none, no copy is on disk.
    users: usize,
    /// The files as they matched the bucket, by path relative to the data directory.
    known: BTreeMap<String, Stamp>,
    /// The last release could not upload: the copy stays on disk until the next use
    /// uploads it.
    pending: bool,
}

/// The node-local copies of an `oss` store's volumes.
#[derive(Debug)]
pub(super) struct OssData {
    local: PathBuf,
    storage: Arc<dyn Storage>,
    copies: Mutex<HashMap<String, Arc<tokio::sync::Mutex<Copy>>>>,
}

fn prefix(id: &str) -> String {
    format!("volumes/data/{id}/")
}

fn io(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> VolumeError {
    let context = context.into();
    move |source| VolumeError::Io { context, source }
}

fn joined(e: tokio::task::JoinError) -> VolumeError {
    VolumeError::Io {
        context: "a volume sync task".into(),
        source: std::io::Error::other(e),
    }
}

impl OssData {
    /// Copies under `local` (created; leftovers of an earlier process are removed: their
    /// changes since the last upload are lost, see the module docs).
    pub fn open(local: &Path, storage: Arc<dyn Storage>) -> Result<Self, VolumeError> {
        std::fs::create_dir_all(local).map_err(io(format!("creating {}", local.display())))?;
        let root = SafeDir::open(local)?;
        for name in root.entries()? {
            tracing::warn!(volume = ?name, "removing a volume copy left by an earlier run; its changes since the last upload are lost");
            root.remove_all(&name)?;
        }
        Ok(Self {
            local: local.to_path_buf(),
            storage,
            copies: Mutex::new(HashMap::new()),
        })
    }

    fn copy(&self, id: &str) -> Arc<tokio::sync::Mutex<Copy>> {
        self.copies
            .lock()
            .entry(id.to_string())
            .or_default()
            .clone()
    }

    fn dir(&self, id: &str) -> PathBuf {
        self.local.join(id).join("data")
    }

    /// Takes a use of volume `id`'s copy (downloading it if this is the first); returns
    /// the copy's data directory.
    pub async fn acquire(&self, id: &str) -> Result<PathBuf, VolumeError> {
        let copy = self.copy(id);
        let mut c = copy.lock().await;
        if c.users == 0 {
            if c.pending {
                c.known = self.upload(id, &c.known).await?;
                c.pending = false;
            }
            c.known = self.download(id).await?;
        }
        c.users += 1;
        Ok(self.dir(id))
    }

    /// Uploads what changed in volume `id`'s copy (if there is one).
    pub async fn flush(&self, id: &str) -> Result<(), VolumeError> {
        let copy = self.copy(id);
        let mut c = copy.lock().await;
        if c.users > 0 {
            c.known = self.upload(id, &c.known).await?;
        }
        Ok(())
    }

    /// Gives back a use of volume `id`'s copy; the last one uploads what changed and
    /// removes the copy (kept when the upload fails: the next use uploads it first).
    pub async fn release(&self, id: &str) -> Result<(), VolumeError> {
        let copy = self.copy(id);
        let mut c = copy.lock().await;
        if c.users == 0 {
            return Ok(());
        }
        c.users -= 1;
        if c.users > 0 {
            return Ok(());
        }
        match self.upload(id, &c.known).await {
            Ok(_) => {
                c.known.clear();
                self.remove_local(id).await
            }
            Err(e) => {
                c.pending = true;
                Err(e)
            }
        }
    }

    /// Deletes volume `id`'s objects.
    pub async fn destroy(&self, id: &str) -> Result<(), VolumeError> {
        self.storage.delete_prefix(&prefix(id)).await?;
        Ok(())
    }

    async fn remove_local(&self, id: &str) -> Result<(), VolumeError> {
        let (local, id) = (self.local.clone(), id.to_string());
        tokio::task::spawn_blocking(move || {
            SafeDir::open(&local)?.remove_all(&id)?;
            Ok::<_, VolumeError>(())
        })
        .await
        .map_err(joined)?
    }

    /// Makes a fresh copy of volume `id` from its objects.
    async fn download(&self, id: &str) -> Result<BTreeMap<String, Stamp>, VolumeError> {
        self.remove_local(id).await?;
        let (local, vid) = (self.local.clone(), id.to_string());
        let data = tokio::task::spawn_blocking(move || {
            let root = SafeDir::open(&local)?;
            root.create_dir_all(&vid, 0o700)?;
            Ok::<_, VolumeError>(root.create_dir_all(Path::new(&vid).join("data"), 0o755)?)
        })
        .await
        .map_err(joined)??;
        let data = Arc::new(data);
        let pre = prefix(id);
        let mut known = BTreeMap::new();
        for key in self.storage.list(&pre).await? {
            let Some(rel) = key.strip_prefix(&pre).map(str::to_string) else {
                continue;
            };
            let d = data.clone();
            let r = rel.clone();
            let made = tokio::task::spawn_blocking(move || {
                if let Some(parent) = Path::new(&r).parent()
                    && !parent.as_os_str().is_empty()
                {
                    d.create_dir_all(parent, 0o755)?;
                }
                Ok::<_, VolumeError>(d.create_file(&r, 0o644)?)
            })
            .await
            .map_err(joined)?;
            let file = match made {
                Ok(f) => f,
                Err(e) => {
                    // Objects `a` and `a/b` cannot both be files: the later is left out.
                    tracing::warn!(volume = %id, path = %rel, error = %e, "a volume object does not fit the copy; left out");
                    continue;
                }
            };
            let mut f = tokio::fs::File::from_std(file);
            self.storage.get(&key, &mut f).await?;
            let f = f.into_std().await;
            let st = nix::sys::stat::fstat(f.as_fd()).map_err(|e| VolumeError::Io {
                context: format!("reading the status of {rel}"),
                source: e.into(),
            })?;
            known.insert(rel, stamp(&st));
        }
        tracing::debug!(volume = %id, files = known.len(), "volume copy made");
        Ok(known)
    }

    /// Uploads the files of volume `id`'s copy that differ from `known` and deletes the
    /// objects of files that went away; returns what the copy now matches.
    async fn upload(
        &self,
        id: &str,
        known: &BTreeMap<String, Stamp>,
    ) -> Result<BTreeMap<String, Stamp>, VolumeError> {
        let dir = self.dir(id);
        let data = tokio::task::spawn_blocking(move || Ok::<_, VolumeError>(SafeDir::open(&dir)?))
            .await
            .map_err(joined)??;
        let data = Arc::new(data);
        let d = data.clone();
        let vid = id.to_string();
        let now = tokio::task::spawn_blocking(move || scan(&d, &vid))
            .await
            .map_err(joined)??;
        let pre = prefix(id);
        let mut matched = BTreeMap::new();
        let mut sent = 0usize;
        for (rel, st) in &now {
            if known.get(rel) == Some(st) {
                matched.insert(rel.clone(), *st);
                continue;
            }
            let d = data.clone();
            let r = rel.clone();
            let opened = tokio::task::spawn_blocking(move || d.open_file(&r))
                .await
                .map_err(joined)?;
            let file = match opened {
                Ok(f) => f,
                // Removed or replaced since the scan: the next upload sees it.
                Err(e) => {
                    tracing::debug!(volume = %id, path = %rel, error = %e, "a file changed during the upload");
                    continue;
                }
            };
            let mut f = tokio::fs::File::from_std(file);
            self.storage.put(&format!("{pre}{rel}"), &mut f).await?;
            matched.insert(rel.clone(), *st);
            sent += 1;
        }
        let mut deleted = 0usize;
        for rel in known.keys() {
            if !now.contains_key(rel) {
                self.storage.delete(&format!("{pre}{rel}")).await?;
                deleted += 1;
            }
        }
        tracing::debug!(volume = %id, sent, deleted, "volume copy uploaded");
        Ok(matched)
    }
}

fn stamp(st: &nix::sys::stat::FileStat) -> Stamp {
    Stamp {
        size: st.st_size,
        mtime: (st.st_mtime, st.st_mtime_nsec),
    }
}

/// The regular files beneath `data`, by `/`-joined relative path (names that are not
/// UTF-8, links and special files are left out, as the module docs say).
fn scan(data: &SafeDir, id: &str) -> Result<BTreeMap<String, Stamp>, VolumeError> {
    let mut out = BTreeMap::new();
    let mut stack: Vec<(PathBuf, usize)> = vec![(PathBuf::new(), 0)];
    while let Some((dir, depth)) = stack.pop() {
        let here = match data.open_dir(&dir) {
            Ok(d) => d,
            // Replaced since it was listed.
            Err(_) if depth > 0 => continue,
            Err(e) => return Err(e.into()),
        };
        for name in here.entries()? {
            let Some(n) = name.to_str() else {
                tracing::warn!(volume = %id, name = ?name, "a file name that is not UTF-8 is not uploaded");
                continue;
            };
            let rel = dir.join(n);
            let Some(st) = here.stat_nofollow(n)? else {
                continue;
            };
            match SFlag::from_bits_truncate(st.st_mode & SFlag::S_IFMT.bits()) {
                SFlag::S_IFDIR if depth + 1 < MAX_DEPTH => stack.push((rel, depth + 1)),
                SFlag::S_IFDIR => {
                    tracing::warn!(volume = %id, path = %rel.display(), "deeper than {MAX_DEPTH} directories: not uploaded");
                }
                SFlag::S_IFREG => {
                    if out.len() == MAX_FILES {
                        return Err(VolumeError::TooManyFiles {
                            id: id.to_string(),
                            limit: MAX_FILES,
                        });
                    }
                    out.insert(rel.to_string_lossy().into_owned(), stamp(&st));
                }
                _ => {}
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use agentenv_core::storage::{OpendalStorage, StorageConfig};

    /// Copies of volumes whose objects are on a directory store (the sync does not care
    /// which store it is).
    fn oss(t: &Path) -> (OssData, Arc<dyn Storage>) {
        let storage: Arc<dyn Storage> = Arc::new(
            OpendalStorage::open(&StorageConfig::Fs {
                root: t.join("bucket"),
            })
            .unwrap(),
        );
        (
            OssData::open(&t.join("copies"), storage.clone()).unwrap(),
            storage,
        )
    }

    #[tokio::test]
    async fn copies_upload_what_changed_and_never_follow_a_tenants_links() {
        let t = tempfile::tempdir().unwrap();
        let (d, bucket) = oss(t.path());
        let secret = t.path().join("host-secret");
        std::fs::write(&secret, b"host").unwrap();
        let id = "vol";
        let keys = || async { bucket.list(&prefix(id)).await.unwrap() };

        let dir = d.acquire(id).await.unwrap();
        std::fs::create_dir_all(dir.join("a/b")).unwrap();
        std::fs::write(dir.join("a/b/f.txt"), b"one").unwrap();
        std::fs::write(dir.join("gone.txt"), b"x").unwrap();
        std::os::unix::fs::symlink(&secret, dir.join("link")).unwrap();
        std::os::unix::fs::symlink(t.path(), dir.join("dirlink")).unwrap();
        nix::unistd::mkfifo(
            &dir.join("fifo"),
            nix::sys::stat::Mode::from_bits_truncate(0o644),
        )
        .unwrap();
        // A second user shares the copy; a flush uploads regular files only.
        assert_eq!(d.acquire(id).await.unwrap(), dir);
        d.flush(id).await.unwrap();
        assert_eq!(
            keys().await,
            ["volumes/data/vol/a/b/f.txt", "volumes/data/vol/gone.txt"]
        );
        std::fs::write(dir.join("a/b/f.txt"), b"two!").unwrap();
        std::fs::remove_file(dir.join("gone.txt")).unwrap();
        d.release(id).await.unwrap();
        assert!(dir.exists(), "one user is left");
        d.release(id).await.unwrap();
        assert!(!dir.exists(), "the last release removes the copy");
        assert_eq!(keys().await, ["volumes/data/vol/a/b/f.txt"]);
        let mut got = Vec::new();
        bucket
            .get("volumes/data/vol/a/b/f.txt", &mut got)
            .await
            .unwrap();
        assert_eq!(got, b"two!");
        // The next copy has the bucket's files.
        let dir = d.acquire(id).await.unwrap();
        assert_eq!(std::fs::read(dir.join("a/b/f.txt")).unwrap(), b"two!");
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1);
        d.release(id).await.unwrap();
        d.destroy(id).await.unwrap();
        assert!(keys().await.is_empty());
        assert_eq!(std::fs::read(&secret).unwrap(), b"host");
        // A release without a use changes nothing.
        d.release("other").await.unwrap();
    }

    #[tokio::test]
    async fn a_copy_left_by_an_earlier_run_is_removed_at_start() {
        let t = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(t.path().join("copies/old/data/x")).unwrap();
        let (_d, _bucket) = oss(t.path());
        assert_eq!(
            std::fs::read_dir(t.path().join("copies")).unwrap().count(),
            0
        );
    }
}
