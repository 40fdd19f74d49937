//! Regular files beneath a [`SafeDir`]: opening one for reading, creating one, writing
//! one in place of whatever is at its path (through a temporary name and a rename), and
//! the empty file a mount point needs.

use std::ffi::{OsStr, OsString};
use std::fs::File;
use std::io::Write;
use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;

use nix::fcntl::{AtFlags, OFlag, openat, renameat};
use nix::sys::stat::{Mode, SFlag, fchmod, fstat, fstatat};
use nix::unistd::{Gid, Uid, UnlinkatFlags, fchown, unlinkat};

use super::{Result, SafeDir, SafeFsError, about, describe, kind, proc_path};

impl SafeDir {
    /// Opens the regular file `rel` for reading. Anything else (a link, a device, a
    /// FIFO) is refused before it is opened for reading, so opening has no side effect.
    pub fn open_file(&self, rel: impl AsRef<Path>) -> Result<File> {
        let (dir, name, rel) = self.parent(rel.as_ref())?;
        let handle = openat(
            &dir,
            name.as_os_str(),
            OFlag::O_PATH | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .map_err(self.io("opening", &rel))?;
        let st = fstat(&handle).map_err(self.io("reading the status of", &rel))?;
        if kind(&st) != SFlag::S_IFREG {
            return Err(SafeFsError::NotRegular {
                root: self.path.clone(),
                rel,
                what: describe(kind(&st)),
            });
        }
        // Reopens exactly the inode checked above.
        std::fs::File::open(proc_path(handle.as_fd(), None)).map_err(self.io_std("opening", &rel))
    }

    /// Creates the regular file `rel` (its directory must exist) for writing, with mode
    /// `mode` and this directory's owner if set. Fails when anything is there already
    /// (`O_CREAT | O_EXCL`, which never follows a link).
    pub fn create_file(&self, rel: impl AsRef<Path>, mode: u32) -> Result<File> {
        let (dir, name, rel) = self.parent(rel.as_ref())?;
        let fd = openat(
            &dir,
            name.as_os_str(),
            OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
            Mode::from_bits_truncate(0o600),
        )
        .map_err(self.io("creating", &rel))?;
        if let Some((uid, gid)) = self.owner {
            fchown(&fd, Some(Uid::from_raw(uid)), Some(Gid::from_raw(gid)))
                .map_err(self.io("changing the owner of", &rel))?;
        }
        fchmod(&fd, Mode::from_bits_truncate(mode & 0o7777))
            .map_err(self.io("changing the mode of", &rel))?;
        Ok(File::from(fd))
    }

    /// Writes `data` to the regular file `rel` (mode `mode`, this directory's owner if
    /// set), creating missing parent directories (0755). Whatever is at `rel` — a link,
    /// a device, a directory tree — is replaced, never followed. The file is written
    /// under a temporary name and renamed into place, so a reader sees the old file or
    /// the whole new one (no fsync: this is about readers, not crashes).
    pub fn write_file(&self, rel: impl AsRef<Path>, data: &[u8], mode: u32) -> Result<()> {
        let rel = rel.as_ref();
        let (parent, name) = self.split(rel)?;
        let dir = self
            .create_dir_all(&parent, 0o755)
            .map_err(|e| about(e, rel))?;
        dir.replace(&name, mode, |f| f.write_all(data))
            .map_err(|e| about(e, rel))
    }

    /// Makes `rel` an empty regular file (a mount point for a file) and returns an
    /// `O_PATH` descriptor of it, checked to be a regular file: mount onto
    /// `/proc/self/fd/N` of it and the mount lands on that inode, whatever the tenant
    /// does to the path meanwhile. A non-empty file, a link or anything else at `rel` is
    /// replaced; missing parents are created (0755).
    pub fn ensure_empty_file(&self, rel: impl AsRef<Path>, mode: u32) -> Result<OwnedFd> {
        let (parent, name) = self.split(rel.as_ref())?;
        let rel = self.clean(rel.as_ref())?;
        let dir = self
            .create_dir_all(&parent, 0o755)
            .map_err(|e| about(e, &rel))?;
        let fine = fstatat(&dir.fd, name.as_os_str(), AtFlags::AT_SYMLINK_NOFOLLOW)
            .is_ok_and(|st| kind(&st) == SFlag::S_IFREG && st.st_size == 0);
        if !fine {
            dir.replace(&name, mode, |_| Ok(()))
                .map_err(|e| about(e, &rel))?;
        }
        let fd = openat(
            &dir.fd,
            name.as_os_str(),
            OFlag::O_PATH | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .map_err(self.io("opening", &rel))?;
        let st = fstat(&fd).map_err(self.io("reading the status of", &rel))?;
        if kind(&st) != SFlag::S_IFREG {
            return Err(SafeFsError::NotRegular {
                root: self.path.clone(),
                rel,
                what: describe(kind(&st)),
            });
        }
        Ok(fd)
    }

    /// Writes a new file with `fill` under a temporary name in this directory and renames
    /// it over `name`.
    fn replace(
        &self,
        name: &OsStr,
        mode: u32,
        fill: impl FnOnce(&mut File) -> std::io::Result<()>,
    ) -> Result<()> {
        let rel = Path::new(name);
        let tmp = OsString::from(format!(".aenv-tmp-{:016x}", rand::random::<u64>()));
        let mut f = self.create_file(&tmp, mode)?;
        let done = fill(&mut f)
            .map_err(self.io_std("writing", rel))
            .and_then(|()| {
                // rename(2) replaces anything but a directory: one in the way goes first.
                let st = fstatat(&self.fd, name, AtFlags::AT_SYMLINK_NOFOLLOW);
                if st.is_ok_and(|st| kind(&st) == SFlag::S_IFDIR) {
                    self.remove_all(rel)?;
                }
                renameat(&self.fd, tmp.as_os_str(), &self.fd, name)
                    .map_err(self.io("renaming a new file to", rel))
            });
        if done.is_err() {
            let _ = unlinkat(&self.fd, tmp.as_os_str(), UnlinkatFlags::NoRemoveDir);
        }
        done
    }
}
