//! Where a volume's files live on a `posix_fs` store: `<root>/<id>/data/`, a directory
//! on the shared mount that every node binds into its sandboxes directly (live sharing
//! across sandboxes and nodes). The files are stored with the ids sandboxes see (0 for
//! root inside): the jail binds the directory id-mapped into each sandbox's range.

use std::path::{Path, PathBuf};

use super::VolumeError;
use crate::host::safefs::SafeDir;

/// Prefix of a deleted volume's directory while it is being removed.
const DELETED_PREFIX: &str = ".deleted-";

/// The data directories of a `posix_fs` store's volumes.
#[derive(Debug)]
pub(super) struct PosixData {
    root: PathBuf,
}

fn io(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> VolumeError {
    let context = context.into();
    move |source| VolumeError::Io { context, source }
}

impl PosixData {
    /// The data of the volumes under `root` (created, mode 0711: the node reaches the
    /// volumes, other host users do not list them).
    pub fn open(root: &Path) -> Result<Self, VolumeError> {
        std::fs::create_dir_all(root).map_err(io(format!("creating {}", root.display())))?;
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(root, std::fs::Permissions::from_mode(0o711))
            .map_err(io(format!("setting the mode of {}", root.display())))?;
        Ok(Self {
            root: root.to_path_buf(),
        })
    }

    fn root_dir(&self) -> Result<SafeDir, VolumeError> {
        SafeDir::open(&self.root).map_err(VolumeError::from)
    }

    /// Makes volume `id`'s empty data directory (owned by root inside, mode 0755).
    pub fn init(&self, id: &str) -> Result<PathBuf, VolumeError> {
        let root = self.root_dir()?;
        root.create_dir_all(id, 0o711)?;
        root.create_dir_all(Path::new(id).join("data"), 0o755)?;
        Ok(self.dir(id))
    }

    /// Volume `id`'s data directory (made again, empty, if it went missing).
    pub fn ensure(&self, id: &str) -> Result<PathBuf, VolumeError> {
        let root = self.root_dir()?;
        match root.open_dir(Path::new(id).join("data")) {
            Ok(_) => Ok(self.dir(id)),
            Err(e) if e.is_not_found() => {
                tracing::warn!(volume = %id, dir = %self.dir(id).display(), "the volume's data directory is missing: made again, empty");
                self.init(id)
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Volume `id`'s data directory, which must exist ([`VolumeError::NotFound`]
    /// otherwise: a volume deleted meanwhile is not made again).
    pub fn existing(&self, id: &str) -> Result<PathBuf, VolumeError> {
        match self.root_dir()?.open_dir(Path::new(id).join("data")) {
            Ok(_) => Ok(self.dir(id)),
            Err(e) if e.is_not_found() => Err(VolumeError::NotFound(id.to_string())),
            Err(e) => Err(e.into()),
        }
    }

    fn dir(&self, id: &str) -> PathBuf {
        self.root.join(id).join("data")
    }

    /// Removes volume `id`'s files: the directory is renamed away at once (no sandbox
    /// or node finds it any more) and removed in the background, never following a link
    /// the tenants planted. Returns the removal's task.
    pub fn destroy(&self, id: &str) -> Result<Option<tokio::task::JoinHandle<()>>, VolumeError> {
        let root = self.root_dir()?;
        let gone = format!("{DELETED_PREFIX}{id}-{:08x}", rand::random::<u32>());
        match nix::fcntl::renameat(&root, id, &root, gone.as_str()) {
            Ok(()) => {}
            Err(nix::errno::Errno::ENOENT) => return Ok(None),
            Err(e) => {
                return Err(VolumeError::Io {
                    context: format!("removing the data of volume {id}"),
                    source: e.into(),
                });
            }
        }
        Ok(Some(tokio::task::spawn_blocking(move || {
            remove_logged(&root, &gone)
        })))
    }

    /// Removes what deletes left behind (a node that stopped during one).
    pub fn sweep(&self) {
        let Ok(root) = self.root_dir() else { return };
        for name in root.entries().unwrap_or_default() {
            if let Some(n) = name.to_str()
                && n.starts_with(DELETED_PREFIX)
            {
                remove_logged(&root, n);
            }
        }
    }
}

fn remove_logged(root: &SafeDir, name: &str) {
    if let Err(e) = root.remove_all(name) {
        tracing::warn!(dir = %root.path().join(name).display(), error = %e, "removing a deleted volume's files; remove the directory by hand");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    #[tokio::test]
    async fn data_directories_are_made_and_removed_without_following_links() {
        let t = tempfile::tempdir().unwrap();
        let victim = t.path().join("victim");
        std::fs::create_dir(&victim).unwrap();
        std::fs::write(victim.join("keep"), b"host").unwrap();
        let d = PosixData::open(&t.path().join("volumes")).unwrap();
        let id = crate::ids::new_sandbox_id();
        let dir = d.init(&id).unwrap();
        let m = std::fs::metadata(&dir).unwrap();
        assert!(m.is_dir());
        assert_eq!((m.uid(), m.mode() & 0o7777), (0, 0o755));
        assert_eq!(d.ensure(&id).unwrap(), dir);
        assert_eq!(d.existing(&id).unwrap(), dir);
        // A tenant's links inside point at the host.
        std::os::unix::fs::symlink(&victim, dir.join("to-host")).unwrap();
        std::fs::create_dir(dir.join("sub")).unwrap();
        std::os::unix::fs::symlink(victim.join("keep"), dir.join("sub/file")).unwrap();
        let removal = d.destroy(&id).unwrap().unwrap();
        assert!(!t.path().join("volumes").join(&id).exists());
        removal.await.unwrap();
        let left: Vec<_> = std::fs::read_dir(t.path().join("volumes"))
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert!(left.is_empty(), "{left:?}");
        assert_eq!(std::fs::read(victim.join("keep")).unwrap(), b"host");
        // A missing data directory comes back empty.
        let id2 = crate::ids::new_sandbox_id();
        d.init(&id2).unwrap();
        std::fs::remove_dir(t.path().join("volumes").join(&id2).join("data")).unwrap();
        assert!(d.ensure(&id2).unwrap().is_dir());
        assert!(matches!(
            d.existing(&id).unwrap_err(),
            VolumeError::NotFound(_)
        ));
        assert!(d.destroy("absent").unwrap().is_none());
        // What a stopped node left behind is swept.
        std::fs::create_dir_all(t.path().join("volumes/.deleted-x/a/b")).unwrap();
        d.sweep();
        assert!(!t.path().join("volumes/.deleted-x").exists());
    }
}
