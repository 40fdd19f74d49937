//! Entries of any type beneath a [`SafeDir`], never followed: removal (of one entry or a
//! whole tree), owner, mode, extended attributes, device nodes and FIFOs, symlinks, hard
//! links and times.

use std::ffi::{OsStr, OsString};
use std::os::fd::{AsFd, BorrowedFd};
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use nix::errno::Errno;
use nix::fcntl::{AtFlags, OFlag, openat, readlinkat};
use nix::sys::stat::{Mode, SFlag, UtimensatFlags, fchmod, fstatat, futimens, mknodat, utimensat};
use nix::unistd::{Gid, Uid, UnlinkatFlags, fchown, fchownat, linkat, symlinkat, unlinkat};

use super::{
    MAX_REMOVE_DEPTH, Result, SafeDir, SafeFsError, chmod_entry, describe, kind, proc_path,
    timespec,
};

impl SafeDir {
    /// Removes `rel` unless it is a directory (a link to one is removed: it is not a
    /// directory). `Ok(true)` when something was removed, `Ok(false)` when `rel` (or its
    /// parent) does not exist or is a directory.
    pub fn remove_non_dir(&self, rel: impl AsRef<Path>) -> Result<bool> {
        let (dir, name, rel) = match self.parent(rel.as_ref()) {
            Ok(p) => p,
            Err(e) if e.is_not_found() => return Ok(false),
            Err(e) => return Err(e),
        };
        match fstatat(&dir, name.as_os_str(), AtFlags::AT_SYMLINK_NOFOLLOW) {
            Err(Errno::ENOENT) => Ok(false),
            Err(e) => Err(self.io("reading the status of", &rel)(e)),
            Ok(st) if kind(&st) == SFlag::S_IFDIR => Ok(false),
            Ok(_) => match unlinkat(&dir, name.as_os_str(), UnlinkatFlags::NoRemoveDir) {
                Ok(()) => Ok(true),
                Err(Errno::ENOENT) => Ok(false),
                Err(e) => Err(self.io("removing", &rel)(e)),
            },
        }
    }

    /// Removes `rel` and, when it is a directory, everything beneath it, never following
    /// a link. `Ok(false)` when there was nothing.
    pub fn remove_all(&self, rel: impl AsRef<Path>) -> Result<bool> {
        let (dir, name, rel) = match self.parent(rel.as_ref()) {
            Ok(p) => p,
            Err(e) if e.is_not_found() => return Ok(false),
            Err(e) => return Err(e),
        };
        self.remove_tree(dir.as_fd(), &name, &rel, 0)
    }

    fn remove_tree(
        &self,
        parent: BorrowedFd<'_>,
        name: &OsStr,
        rel: &Path,
        depth: usize,
    ) -> Result<bool> {
        let dir = match openat(
            parent,
            name,
            OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
            Mode::empty(),
        ) {
            Ok(fd) => fd,
            Err(Errno::ENOENT) => return Ok(false),
            // Not a directory (a link to one included): unlinked, not followed.
            Err(Errno::ENOTDIR | Errno::ELOOP) => {
                return match unlinkat(parent, name, UnlinkatFlags::NoRemoveDir) {
                    Ok(()) => Ok(true),
                    Err(Errno::ENOENT) => Ok(false),
                    Err(e) => Err(self.io("removing", rel)(e)),
                };
            }
            Err(e) => return Err(self.io("opening", rel)(e)),
        };
        if depth >= MAX_REMOVE_DEPTH {
            return Err(SafeFsError::TooDeep {
                root: self.path.clone(),
                rel: rel.to_path_buf(),
            });
        }
        let names: Vec<OsString> = std::fs::read_dir(proc_path(dir.as_fd(), None))
            .and_then(|it| it.map(|e| e.map(|e| e.file_name())).collect())
            .map_err(self.io_std("listing", rel))?;
        for n in names {
            self.remove_tree(dir.as_fd(), &n, &rel.join(&n), depth + 1)?;
        }
        match unlinkat(parent, name, UnlinkatFlags::RemoveDir) {
            Ok(()) => Ok(true),
            Err(Errno::ENOENT) => Ok(false),
            Err(e) => Err(self.io("removing the directory", rel)(e)),
        }
    }

    /// Changes the owner of `rel` itself (a link's own owner, never its target's). An
    /// empty `rel` is this directory.
    pub fn chown_nofollow(&self, rel: impl AsRef<Path>, uid: u32, gid: u32) -> Result<()> {
        let (u, g) = (Some(Uid::from_raw(uid)), Some(Gid::from_raw(gid)));
        let rel = rel.as_ref();
        if self.clean(rel)?.as_os_str().is_empty() {
            return fchown(&self.fd, u, g).map_err(self.io("changing the owner of", rel));
        }
        let (dir, name, rel) = self.parent(rel)?;
        fchownat(&dir, name.as_os_str(), u, g, AtFlags::AT_SYMLINK_NOFOLLOW)
            .map_err(self.io("changing the owner of", &rel))
    }

    /// Changes the mode of `rel` (exactly `mode & 0o7777`). A link is left alone: Linux
    /// keeps no mode of its own for links, and its target is never touched. An empty
    /// `rel` is this directory.
    pub fn chmod_nofollow(&self, rel: impl AsRef<Path>, mode: u32) -> Result<()> {
        let rel = rel.as_ref();
        if self.clean(rel)?.as_os_str().is_empty() {
            return fchmod(&self.fd, Mode::from_bits_truncate(mode & 0o7777))
                .map_err(self.io("changing the mode of", rel));
        }
        let (dir, name, rel) = self.parent(rel)?;
        chmod_entry(dir.as_fd(), &name, mode).map_err(self.io("changing the mode of", &rel))
    }

    /// Sets the extended attribute `key` of `rel` itself (a link's own, never its
    /// target's). An empty `rel` is this directory.
    pub fn set_xattr_nofollow(
        &self,
        rel: impl AsRef<Path>,
        key: impl AsRef<OsStr>,
        value: &[u8],
    ) -> Result<()> {
        let (dir, name, rel) = self.entry(rel.as_ref())?;
        // lsetxattr: `/proc/self/fd/N` (the directory) is followed, `name` is not.
        xattr::set(proc_path(dir.as_fd(), Some(&name)), key, value)
            .map_err(self.io_std("setting an extended attribute of", &rel))
    }

    /// The extended attributes of `rel` itself (a link's own, never its target's). An
    /// empty `rel` is this directory.
    pub fn xattrs_nofollow(&self, rel: impl AsRef<Path>) -> Result<Vec<(OsString, Vec<u8>)>> {
        let (dir, name, rel) = self.entry(rel.as_ref())?;
        let path = proc_path(dir.as_fd(), Some(&name));
        let mut out = Vec::new();
        let names = xattr::list(&path).map_err(self.io_std("listing the attributes of", &rel))?;
        for key in names {
            if let Some(v) =
                xattr::get(&path, &key).map_err(self.io_std("reading an attribute of", &rel))?
            {
                out.push((key, v));
            }
        }
        Ok(out)
    }

    /// Creates the node `rel` (a FIFO, a device: `kind` is `S_IFIFO`, `S_IFCHR`, ...)
    /// with mode `mode` (exactly) and this directory's owner if set. The directory of
    /// `rel` must exist; an existing entry is an error. Which devices are acceptable is
    /// the caller's decision.
    pub fn mknod_at(&self, rel: impl AsRef<Path>, kind: SFlag, mode: u32, dev: u64) -> Result<()> {
        let (dir, name, rel) = self.parent(rel.as_ref())?;
        mknodat(
            &dir,
            name.as_os_str(),
            kind,
            Mode::from_bits_truncate(mode & 0o7777),
            dev,
        )
        .map_err(self.io("creating the node", &rel))?;
        self.settle_new(dir.as_fd(), &name, mode, &rel)
    }

    /// Creates the symlink `rel` pointing at `target` (stored as given: the node never
    /// follows it), owned by this directory's owner if set. The directory of `rel` must
    /// exist; an existing entry is an error.
    pub fn symlink_at(&self, rel: impl AsRef<Path>, target: impl AsRef<Path>) -> Result<()> {
        let (dir, name, rel) = self.parent(rel.as_ref())?;
        symlinkat(target.as_ref(), &dir, name.as_os_str())
            .map_err(self.io("creating the symlink", &rel))?;
        if let Some((uid, gid)) = self.owner {
            fchownat(
                &dir,
                name.as_os_str(),
                Some(Uid::from_raw(uid)),
                Some(Gid::from_raw(gid)),
                AtFlags::AT_SYMLINK_NOFOLLOW,
            )
            .map_err(self.io("changing the owner of", &rel))?;
        }
        Ok(())
    }

    /// The target of the symlink `rel`.
    pub fn read_link(&self, rel: impl AsRef<Path>) -> Result<PathBuf> {
        let (dir, name, rel) = self.parent(rel.as_ref())?;
        readlinkat(&dir, name.as_os_str())
            .map(PathBuf::from)
            .map_err(self.io("reading the symlink", &rel))
    }

    /// Hard-links `existing` to `new`, both beneath this directory, neither followed.
    /// `existing` must be a file (not a directory, not a symlink); `new`'s directory must
    /// exist and `new` must not.
    pub fn hard_link_within(
        &self,
        existing: impl AsRef<Path>,
        new: impl AsRef<Path>,
    ) -> Result<()> {
        let (new_dir, new_name, new_rel) = self.parent(new.as_ref())?;
        let (old_dir, old_name, old_rel) = self.parent(existing.as_ref())?;
        let st = fstatat(&old_dir, old_name.as_os_str(), AtFlags::AT_SYMLINK_NOFOLLOW)
            .map_err(self.io("reading the status of", &old_rel))?;
        if matches!(kind(&st), SFlag::S_IFLNK | SFlag::S_IFDIR) {
            return Err(SafeFsError::BadLinkTarget {
                root: self.path.clone(),
                rel: new_rel,
                target: old_rel,
                what: describe(kind(&st)),
            });
        }
        // No AT_SYMLINK_FOLLOW: had `existing` become a link meanwhile, the link itself
        // would be linked, not what it points at.
        linkat(
            &old_dir,
            old_name.as_os_str(),
            &new_dir,
            new_name.as_os_str(),
            AtFlags::empty(),
        )
        .map_err(self.io("creating the hard link", &new_rel))
    }

    /// Sets the access and modification times of `rel` itself (`None` leaves one as
    /// it is). An empty `rel` is this directory.
    pub fn set_times(
        &self,
        rel: impl AsRef<Path>,
        atime: Option<SystemTime>,
        mtime: Option<SystemTime>,
    ) -> Result<()> {
        let rel = rel.as_ref();
        let (a, m) = (timespec(atime), timespec(mtime));
        if self.clean(rel)?.as_os_str().is_empty() {
            return futimens(&self.fd, &a, &m).map_err(self.io("setting the times of", rel));
        }
        let (dir, name, rel) = self.parent(rel)?;
        utimensat(
            &dir,
            name.as_os_str(),
            &a,
            &m,
            UtimensatFlags::NoFollowSymlink,
        )
        .map_err(self.io("setting the times of", &rel))
    }
}
