//! File operations beneath a directory that never follow symbolic links.
//!
//! A tenant is root inside its sandbox and controls every byte of its writable layer,
//! symlinks included, while the node writes into that layer as host root (`/etc/hosts`,
//! `/etc/hostname`, `/etc/resolv.conf`, the agent's mount point, snapshot layers). A plain
//! `std::fs::write(upper.join("etc/hosts"))` follows a link the tenant planted at `etc` or
//! `etc/hosts` and writes wherever it points on the host. [`SafeDir`] is the one way the
//! node touches such a tree:
//!
//! * a directory is held as a file descriptor, opened with `O_NOFOLLOW`;
//! * a relative path is resolved from it with `openat2(2)` and
//!   `RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS`: a symlink anywhere
//!   on the way, `..`, or an absolute path fails in the kernel, with no window between a
//!   check and a use;
//! * the final component is acted on with `*at` calls that do not follow it
//!   (`AT_SYMLINK_NOFOLLOW`, `O_NOFOLLOW`, `O_CREAT | O_EXCL`, `O_PATH` then
//!   `/proc/self/fd/N`, which names exactly the inode that was opened).
//!
//! Paths given to [`SafeDir`] methods are relative, made of normal components only (`.`
//! is ignored; `..` and absolute paths are refused up front). A symlink or a
//! non-directory on the way is refused with an error that names the component.
//!
//! Needs Linux 5.6 or later (`openat2`) and `/proc` mounted (always the case on a node).
//! [`SafeDir::open`] checks the first and answers [`SafeFsError::Unsupported`] on an
//! older kernel.
//!
//! This file holds the error, [`SafeDir`] and the resolution of paths beneath it (with
//! directories, listing and status); `files` the operations on regular files (reading,
//! creating, replacing, mount points); `entries` those on entries of any type (removal,
//! owner, mode, extended attributes, nodes, links and times).

mod entries;
mod files;

use std::ffi::{OsStr, OsString};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::PermissionsExt;
use std::path::{Component, Path, PathBuf};
use std::sync::OnceLock;
use std::time::SystemTime;

use nix::errno::Errno;
use nix::fcntl::{AtFlags, OFlag, OpenHow, ResolveFlag, openat, openat2};
use nix::sys::stat::{FileStat, Mode, SFlag, fchmod, fstat, fstatat, mkdirat};
use nix::sys::time::TimeSpec;
use nix::unistd::{Gid, Uid, fchown, fchownat};

/// Deepest tree [`SafeDir::remove_all`] removes (one open descriptor per level).
const MAX_REMOVE_DEPTH: usize = 256;

/// Errors of operations beneath a [`SafeDir`]. `root` is the directory the operation
/// started from, `rel` the path beneath it.
#[derive(Debug, thiserror::Error)]
pub enum SafeFsError {
    #[error(
        "{} under {}: not a path beneath the directory (it must be relative, name an entry and contain no `..`)",
        rel.display(), root.display()
    )]
    BadPath { root: PathBuf, rel: PathBuf },
    #[error(
        "{} under {}: `{}` is a symbolic link, and the node does not write through (or follow) links in a sandbox's tree",
        rel.display(), root.display(), component.display()
    )]
    Symlink {
        root: PathBuf,
        rel: PathBuf,
        component: PathBuf,
    },
    #[error(
        "{} under {}: `{}` is not a directory",
        rel.display(), root.display(), component.display()
    )]
    NotDirectory {
        root: PathBuf,
        rel: PathBuf,
        component: PathBuf,
    },
    #[error("{} under {} is {what}, not a regular file", rel.display(), root.display())]
    NotRegular {
        root: PathBuf,
        rel: PathBuf,
        what: &'static str,
    },
    #[error(
        "hard link {} under {}: its target {} is {what}; only files inside the tree can be linked",
        rel.display(), root.display(), target.display()
    )]
    BadLinkTarget {
        root: PathBuf,
        rel: PathBuf,
        target: PathBuf,
        what: &'static str,
    },
    #[error(
        "{} under {} is nested deeper than {MAX_REMOVE_DEPTH} directories; the node does not remove it",
        rel.display(), root.display()
    )]
    TooDeep { root: PathBuf, rel: PathBuf },
    #[error(
        "this kernel has no openat2(2): the node needs Linux 5.6 or later to write into sandboxes without following their links"
    )]
    Unsupported,
    #[error("{op} {} under {}: {source}", rel.display(), root.display())]
    Io {
        op: &'static str,
        root: PathBuf,
        rel: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

impl SafeFsError {
    /// Whether this is an I/O error saying that something does not exist.
    pub fn is_not_found(&self) -> bool {
        matches!(self, Self::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound)
    }
}

type Result<T> = std::result::Result<T, SafeFsError>;

/// `e` about the whole path `rel` the caller asked for (an error of a step on the way
/// names only the part it was given).
fn about(e: SafeFsError, rel: &Path) -> SafeFsError {
    let rel = rel.to_path_buf();
    match e {
        SafeFsError::Io {
            op, root, source, ..
        } => SafeFsError::Io {
            op,
            root,
            rel,
            source,
        },
        SafeFsError::Symlink {
            root, component, ..
        } => SafeFsError::Symlink {
            root,
            rel,
            component,
        },
        SafeFsError::NotDirectory {
            root, component, ..
        } => SafeFsError::NotDirectory {
            root,
            rel,
            component,
        },
        other => other,
    }
}

/// The type bits of a stat.
fn kind(st: &FileStat) -> SFlag {
    SFlag::from_bits_truncate(st.st_mode & SFlag::S_IFMT.bits())
}

/// What a file of this type is, for messages.
fn describe(k: SFlag) -> &'static str {
    match k {
        SFlag::S_IFDIR => "a directory",
        SFlag::S_IFLNK => "a symbolic link",
        SFlag::S_IFREG => "a regular file",
        SFlag::S_IFCHR => "a character device",
        SFlag::S_IFBLK => "a block device",
        SFlag::S_IFIFO => "a FIFO",
        SFlag::S_IFSOCK => "a socket",
        _ => "of an unknown type",
    }
}

fn resolve_flags() -> ResolveFlag {
    ResolveFlag::RESOLVE_BENEATH
        | ResolveFlag::RESOLVE_NO_SYMLINKS
        | ResolveFlag::RESOLVE_NO_MAGICLINKS
}

/// The path of an open descriptor (plus `name` inside it) through `/proc/self/fd`: the
/// descriptor's link is followed to exactly the inode it holds; `name` is then looked up
/// in that directory like any last component.
fn proc_path(fd: BorrowedFd<'_>, name: Option<&OsStr>) -> PathBuf {
    let mut p = PathBuf::from(format!("/proc/self/fd/{}", fd.as_raw_fd()));
    if let Some(n) = name {
        p.push(n);
    }
    p
}

fn timespec(t: Option<SystemTime>) -> TimeSpec {
    match t {
        None => TimeSpec::UTIME_OMIT,
        Some(t) => {
            let d = t.duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default();
            TimeSpec::from_duration(d)
        }
    }
}

/// Whether this kernel has `openat2` (checked once).
fn openat2_supported(fd: BorrowedFd<'_>) -> bool {
    static SUPPORTED: OnceLock<bool> = OnceLock::new();
    *SUPPORTED.get_or_init(|| {
        let how = OpenHow::new()
            .flags(OFlag::O_PATH | OFlag::O_CLOEXEC)
            .resolve(resolve_flags());
        !matches!(openat2(fd, ".", how), Err(Errno::ENOSYS))
    })
}

/// A directory held open, under which every operation resolves paths without following
/// links (see the module docs).
#[derive(Debug)]
pub struct SafeDir {
    fd: OwnedFd,
    /// Where it is, for messages only: never used to reach it again.
    path: PathBuf,
    /// Owner given to what this directory's operations create, if set.
    owner: Option<(u32, u32)>,
}

impl AsFd for SafeDir {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

impl SafeDir {
    /// Opens the directory `path` (`O_DIRECTORY | O_NOFOLLOW`). `path` itself is the
    /// node's (a sandbox's directory, its `upper/`): only its last component is checked
    /// not to be a link.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let fd = nix::fcntl::open(
            &path,
            OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| match e {
            Errno::ELOOP | Errno::ENOTDIR => {
                let link = std::fs::symlink_metadata(&path).is_ok_and(|m| m.is_symlink());
                if link {
                    SafeFsError::Symlink {
                        root: path.clone(),
                        rel: PathBuf::new(),
                        component: path.clone(),
                    }
                } else {
                    SafeFsError::NotDirectory {
                        root: path.clone(),
                        rel: PathBuf::new(),
                        component: path.clone(),
                    }
                }
            }
            e => SafeFsError::Io {
                op: "opening",
                root: path.clone(),
                rel: PathBuf::new(),
                source: e.into(),
            },
        })?;
        if !openat2_supported(fd.as_fd()) {
            return Err(SafeFsError::Unsupported);
        }
        Ok(Self {
            fd,
            path,
            owner: None,
        })
    }

    /// Gives what this directory's operations create from now on (directories, files,
    /// nodes, links) the owner `uid:gid`: a sandbox's mapped root, so that the tenant
    /// owns what the node made for it. Directories returned by [`Self::open_dir`] and
    /// [`Self::create_dir_all`] keep the setting.
    pub fn with_owner(mut self, uid: u32, gid: u32) -> Self {
        self.owner = Some((uid, gid));
        self
    }

    /// Where this directory was when it was opened (for messages).
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn io(&self, op: &'static str, rel: &Path) -> impl FnOnce(Errno) -> SafeFsError {
        let (root, rel) = (self.path.clone(), rel.to_path_buf());
        move |e| SafeFsError::Io {
            op,
            root,
            rel,
            source: e.into(),
        }
    }

    fn io_std(&self, op: &'static str, rel: &Path) -> impl FnOnce(std::io::Error) -> SafeFsError {
        let (root, rel) = (self.path.clone(), rel.to_path_buf());
        move |source| SafeFsError::Io {
            op,
            root,
            rel,
            source,
        }
    }

    fn child(&self, fd: OwnedFd, rel: &Path) -> SafeDir {
        SafeDir {
            fd,
            path: self.path.join(rel),
            owner: self.owner,
        }
    }

    /// `rel` with `.` dropped; `..`, roots and prefixes refused.
    fn clean(&self, rel: &Path) -> Result<PathBuf> {
        let mut out = PathBuf::new();
        for c in rel.components() {
            match c {
                Component::Normal(n) => out.push(n),
                Component::CurDir => {}
                Component::ParentDir | Component::RootDir | Component::Prefix(_) => {
                    return Err(SafeFsError::BadPath {
                        root: self.path.clone(),
                        rel: rel.to_path_buf(),
                    });
                }
            }
        }
        Ok(out)
    }

    /// `rel` as (its parent, its last component); `rel` must name an entry.
    fn split(&self, rel: &Path) -> Result<(PathBuf, OsString)> {
        let clean = self.clean(rel)?;
        match (clean.parent(), clean.file_name()) {
            (Some(p), Some(n)) => Ok((p.to_path_buf(), n.to_os_string())),
            _ => Err(SafeFsError::BadPath {
                root: self.path.clone(),
                rel: rel.to_path_buf(),
            }),
        }
    }

    /// Opens the directory `rel` (clean) with `openat2`, links refused in the kernel.
    fn resolve(&self, rel: &Path) -> Result<OwnedFd> {
        let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
        if rel.as_os_str().is_empty() {
            return openat(&self.fd, ".", flags, Mode::empty()).map_err(self.io("opening", rel));
        }
        let how = OpenHow::new().flags(flags).resolve(resolve_flags());
        let mut tries = 0;
        loop {
            match openat2(&self.fd, rel, how) {
                Ok(fd) => return Ok(fd),
                Err(Errno::ENOSYS) => return Err(SafeFsError::Unsupported),
                // A rename raced with the resolution (`RESOLVE_BENEATH`): try again.
                Err(Errno::EAGAIN) if tries < 3 => tries += 1,
                Err(e @ (Errno::ELOOP | Errno::ENOTDIR | Errno::EXDEV)) => {
                    return Err(self.diagnose(rel, rel, e));
                }
                Err(e) => return Err(self.io("opening", rel)(e)),
            }
        }
    }

    /// Names the component of `dirs` (a clean path of directories, part of `rel`) that
    /// made a resolution fail with `e`: the first symlink or non-directory. Only for the
    /// message; nothing is written through what it opens.
    fn diagnose(&self, dirs: &Path, rel: &Path, e: Errno) -> SafeFsError {
        let Ok(mut cur) = self.fd.try_clone() else {
            return self.io("opening", rel)(e);
        };
        let mut prefix = PathBuf::new();
        for c in dirs.components() {
            prefix.push(c);
            let Ok(st) = fstatat(&cur, c.as_os_str(), AtFlags::AT_SYMLINK_NOFOLLOW) else {
                break;
            };
            match kind(&st) {
                SFlag::S_IFDIR => {}
                SFlag::S_IFLNK => {
                    return SafeFsError::Symlink {
                        root: self.path.clone(),
                        rel: rel.to_path_buf(),
                        component: prefix,
                    };
                }
                _ => {
                    return SafeFsError::NotDirectory {
                        root: self.path.clone(),
                        rel: rel.to_path_buf(),
                        component: prefix,
                    };
                }
            }
            match openat(
                &cur,
                c.as_os_str(),
                OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
                Mode::empty(),
            ) {
                Ok(fd) => cur = fd,
                Err(_) => break,
            }
        }
        self.io("opening", rel)(e)
    }

    /// The parent directory of `rel` (which must exist) and `rel`'s last component.
    fn parent(&self, rel: &Path) -> Result<(OwnedFd, OsString, PathBuf)> {
        let (parent, name) = self.split(rel)?;
        let fd = self.resolve(&parent).map_err(|e| about(e, rel))?;
        Ok((fd, name, self.clean(rel)?))
    }

    /// Gives a new entry `name` in `dir` the mode `mode` (exactly: no umask) and this
    /// directory's owner, if set. `name` must not be a symlink.
    fn settle_new(&self, dir: BorrowedFd<'_>, name: &OsStr, mode: u32, rel: &Path) -> Result<()> {
        if let Some((uid, gid)) = self.owner {
            fchownat(
                dir,
                name,
                Some(Uid::from_raw(uid)),
                Some(Gid::from_raw(gid)),
                AtFlags::AT_SYMLINK_NOFOLLOW,
            )
            .map_err(self.io("changing the owner of", rel))?;
        }
        chmod_entry(dir, name, mode).map_err(self.io("changing the mode of", rel))
    }

    /// The directory `rel` beneath this one; every component must be a directory, none a
    /// link.
    pub fn open_dir(&self, rel: impl AsRef<Path>) -> Result<SafeDir> {
        let rel = self.clean(rel.as_ref())?;
        let fd = self.resolve(&rel)?;
        Ok(self.child(fd, &rel))
    }

    /// Creates the directory `rel` and its missing parents (mode `mode`, exactly, and
    /// this directory's owner if set); existing ones are left as they are. Refuses, naming
    /// it, a component that is a symlink or not a directory.
    pub fn create_dir_all(&self, rel: impl AsRef<Path>, mode: u32) -> Result<SafeDir> {
        let rel = self.clean(rel.as_ref())?;
        match self.resolve(&rel) {
            Ok(fd) => return Ok(self.child(fd, &rel)),
            Err(e) if e.is_not_found() => {}
            Err(e) => return Err(e),
        }
        let mode = mode & 0o7777;
        let mut cur = self.fd.try_clone().map_err(self.io_std("opening", &rel))?;
        let mut prefix = PathBuf::new();
        for c in rel.components() {
            let name = c.as_os_str();
            prefix.push(name);
            let created = match mkdirat(&cur, name, Mode::from_bits_truncate(mode)) {
                Ok(()) => true,
                Err(Errno::EEXIST) => false,
                Err(e) => return Err(self.io("creating the directory", &prefix)(e)),
            };
            let next = match openat(
                &cur,
                name,
                OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
                Mode::empty(),
            ) {
                Ok(fd) => fd,
                Err(e @ (Errno::ELOOP | Errno::ENOTDIR)) => {
                    let link = fstatat(&cur, name, AtFlags::AT_SYMLINK_NOFOLLOW)
                        .is_ok_and(|st| kind(&st) == SFlag::S_IFLNK);
                    return Err(if link || e == Errno::ELOOP {
                        SafeFsError::Symlink {
                            root: self.path.clone(),
                            rel: rel.clone(),
                            component: prefix,
                        }
                    } else {
                        SafeFsError::NotDirectory {
                            root: self.path.clone(),
                            rel: rel.clone(),
                            component: prefix,
                        }
                    });
                }
                Err(e) => return Err(self.io("opening", &prefix)(e)),
            };
            if created {
                if let Some((uid, gid)) = self.owner {
                    fchown(&next, Some(Uid::from_raw(uid)), Some(Gid::from_raw(gid)))
                        .map_err(self.io("changing the owner of", &prefix))?;
                }
                fchmod(&next, Mode::from_bits_truncate(mode))
                    .map_err(self.io("changing the mode of", &prefix))?;
            }
            cur = next;
        }
        Ok(self.child(cur, &rel))
    }

    /// The names in this directory (without `.` and `..`), sorted.
    pub fn entries(&self) -> Result<Vec<OsString>> {
        let here = Path::new("");
        let mut names: Vec<OsString> = std::fs::read_dir(proc_path(self.fd.as_fd(), None))
            .and_then(|it| it.map(|e| e.map(|e| e.file_name())).collect())
            .map_err(self.io_std("listing", here))?;
        names.sort();
        Ok(names)
    }

    /// What `rel` is, without following it; `None` when it (or a parent) does not exist.
    pub fn stat_nofollow(&self, rel: impl AsRef<Path>) -> Result<Option<FileStat>> {
        let rel = rel.as_ref();
        let (dir, name, rel) = match self.parent(rel) {
            Ok(p) => p,
            Err(e) if e.is_not_found() => return Ok(None),
            Err(e) => return Err(e),
        };
        match fstatat(&dir, name.as_os_str(), AtFlags::AT_SYMLINK_NOFOLLOW) {
            Ok(st) => Ok(Some(st)),
            Err(Errno::ENOENT) => Ok(None),
            Err(e) => Err(self.io("reading the status of", &rel)(e)),
        }
    }

    /// The directory holding `rel` and `rel`'s name in it; `.` in this directory when
    /// `rel` is empty.
    fn entry(&self, rel: &Path) -> Result<(OwnedFd, OsString, PathBuf)> {
        if self.clean(rel)?.as_os_str().is_empty() {
            let fd = self.fd.try_clone().map_err(self.io_std("opening", rel))?;
            return Ok((fd, OsString::from("."), PathBuf::new()));
        }
        self.parent(rel)
    }
}

/// chmod of the entry `name` in `dir`, never through a link: the entry is opened with
/// `O_PATH | O_NOFOLLOW` and the inode it holds is changed through `/proc/self/fd/N`
/// (`fchmodat` has no working `AT_SYMLINK_NOFOLLOW` before Linux 6.6). A link is left
/// as it is.
fn chmod_entry(dir: BorrowedFd<'_>, name: &OsStr, mode: u32) -> nix::Result<()> {
    let fd = openat(
        dir,
        name,
        OFlag::O_PATH | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::empty(),
    )?;
    if kind(&fstat(&fd)?) == SFlag::S_IFLNK {
        return Ok(());
    }
    std::fs::set_permissions(
        proc_path(fd.as_fd(), None),
        std::fs::Permissions::from_mode(mode & 0o7777),
    )
    .map_err(|e| Errno::from_raw(e.raw_os_error().unwrap_or(libc::EIO)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::unix::fs::MetadataExt;

    /// A sandbox-like tree and a victim directory outside it.
    fn setup() -> (tempfile::TempDir, PathBuf, PathBuf) {
        let t = tempfile::tempdir().unwrap();
        let upper = t.path().join("upper");
        let victim = t.path().join("victim");
        std::fs::create_dir(&upper).unwrap();
        std::fs::create_dir(&victim).unwrap();
        std::fs::write(victim.join("keep"), b"host file").unwrap();
        std::fs::set_permissions(victim.join("keep"), std::fs::Permissions::from_mode(0o644))
            .unwrap();
        (t, upper, victim)
    }

    fn victim_unchanged(victim: &Path) {
        let names: Vec<_> = std::fs::read_dir(victim)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(
            names,
            [OsString::from("keep")],
            "the victim directory changed"
        );
        assert_eq!(std::fs::read(victim.join("keep")).unwrap(), b"host file");
        let m = std::fs::metadata(victim.join("keep")).unwrap();
        assert_eq!(m.mode() & 0o7777, 0o644);
        assert_eq!((m.uid(), m.gid()), (0, 0));
    }

    #[test]
    fn writes_go_beneath_and_replace_whatever_is_there() {
        let (_t, upper, victim) = setup();
        let root = SafeDir::open(&upper).unwrap();
        // Planted: etc/hosts a link to the victim file, etc/hostname a link to the victim
        // directory, etc/resolv.conf a directory with content.
        std::fs::create_dir(upper.join("etc")).unwrap();
        std::os::unix::fs::symlink(victim.join("keep"), upper.join("etc/hosts")).unwrap();
        std::os::unix::fs::symlink(&victim, upper.join("etc/hostname")).unwrap();
        std::fs::create_dir_all(upper.join("etc/resolv.conf/deep")).unwrap();
        std::fs::write(upper.join("etc/resolv.conf/deep/x"), b"x").unwrap();

        root.write_file("etc/hosts", b"127.0.0.1 localhost\n", 0o644)
            .unwrap();
        root.write_file("etc/hostname", b"sbx\n", 0o644).unwrap();
        root.write_file("etc/resolv.conf", b"nameserver 1.1.1.1\n", 0o644)
            .unwrap();
        for (f, want) in [
            ("hosts", &b"127.0.0.1 localhost\n"[..]),
            ("hostname", b"sbx\n"),
            ("resolv.conf", b"nameserver 1.1.1.1\n"),
        ] {
            let p = upper.join("etc").join(f);
            let m = std::fs::symlink_metadata(&p).unwrap();
            assert!(m.is_file(), "{f}");
            assert_eq!(m.mode() & 0o7777, 0o644, "{f}");
            assert_eq!(std::fs::read(&p).unwrap(), want);
        }
        // No temporary file is left behind.
        assert_eq!(std::fs::read_dir(upper.join("etc")).unwrap().count(), 3);
        // Missing parents are created; the owner applies to what is created.
        let owned = SafeDir::open(&upper).unwrap().with_owner(4242, 4343);
        owned.write_file("new/dir/file", b"x", 0o600).unwrap();
        for p in ["new", "new/dir", "new/dir/file"] {
            let m = std::fs::metadata(upper.join(p)).unwrap();
            assert_eq!((m.uid(), m.gid()), (4242, 4343), "{p}");
        }
        assert_eq!(
            std::fs::metadata(upper.join("new/dir/file"))
                .unwrap()
                .mode()
                & 0o7777,
            0o600
        );
        victim_unchanged(&victim);
    }

    #[test]
    fn a_link_on_the_way_is_refused_and_named() {
        let (_t, upper, victim) = setup();
        let root = SafeDir::open(&upper).unwrap();
        std::os::unix::fs::symlink(&victim, upper.join("etc")).unwrap();
        std::os::unix::fs::symlink("../../..", upper.join("up")).unwrap();
        std::fs::write(upper.join("file"), b"").unwrap();

        let e = root.write_file("etc/hosts", b"x", 0o644).unwrap_err();
        assert!(
            matches!(&e, SafeFsError::Symlink { component, .. } if component == Path::new("etc")),
            "{e:?}"
        );
        let msg = e.to_string();
        assert!(msg.contains("`etc` is a symbolic link"), "{msg}");
        assert!(msg.contains("does not write through"), "{msg}");
        assert!(matches!(
            root.create_dir_all("up/x", 0o755).unwrap_err(),
            SafeFsError::Symlink { .. }
        ));
        assert!(matches!(
            root.open_dir("etc").unwrap_err(),
            SafeFsError::Symlink { .. }
        ));
        assert!(matches!(
            root.ensure_empty_file("up/agent", 0o755).unwrap_err(),
            SafeFsError::Symlink { .. }
        ));
        let e = root.create_dir_all("file/sub", 0o755).unwrap_err();
        assert!(
            matches!(&e, SafeFsError::NotDirectory { component, .. } if component == Path::new("file")),
            "{e:?}"
        );
        // Through an existing directory: the kernel's resolution (openat2) refuses too.
        std::fs::create_dir(upper.join("d")).unwrap();
        std::os::unix::fs::symlink(&victim, upper.join("d/l")).unwrap();
        let e = root.stat_nofollow("d/l/keep").unwrap_err();
        assert!(
            matches!(&e, SafeFsError::Symlink { component, .. } if component == Path::new("d/l")),
            "{e:?}"
        );
        for bad in ["../x", "/etc/passwd", "a/../../x", ""] {
            assert!(
                matches!(
                    root.write_file(bad, b"x", 0o644).unwrap_err(),
                    SafeFsError::BadPath { .. }
                ),
                "{bad}"
            );
        }
        // Final-component operations act on the link itself.
        std::os::unix::fs::symlink(victim.join("keep"), upper.join("l")).unwrap();
        root.chown_nofollow("l", 1234, 1234).unwrap();
        root.chmod_nofollow("l", 0o777).unwrap();
        root.set_times("l", None, Some(SystemTime::UNIX_EPOCH))
            .unwrap();
        let m = std::fs::symlink_metadata(upper.join("l")).unwrap();
        assert_eq!((m.uid(), m.mtime()), (1234, 0));
        let e = root.open_file("l").unwrap_err();
        assert!(matches!(e, SafeFsError::NotRegular { .. }), "{e:?}");
        let e = root.hard_link_within("l", "hl").unwrap_err();
        assert!(matches!(e, SafeFsError::BadLinkTarget { .. }), "{e:?}");
        assert!(root.remove_non_dir("l").unwrap());
        assert!(!upper.join("l").exists());
        let host = std::fs::metadata(victim.join("keep")).unwrap();
        assert_ne!(host.uid(), 1234);
        assert_ne!(host.mtime(), 0);
        victim_unchanged(&victim);
    }

    #[test]
    fn a_mount_point_is_an_empty_regular_file_and_its_descriptor_is_checked() {
        let (_t, upper, victim) = setup();
        let root = SafeDir::open(&upper).unwrap();
        std::fs::create_dir(upper.join("agentenv")).unwrap();
        std::os::unix::fs::symlink(victim.join("keep"), upper.join("agentenv/agentenv-guest"))
            .unwrap();
        let fd = root
            .ensure_empty_file("agentenv/agentenv-guest", 0o755)
            .unwrap();
        let st = fstat(&fd).unwrap();
        let m = std::fs::symlink_metadata(upper.join("agentenv/agentenv-guest")).unwrap();
        assert!(m.is_file() && m.len() == 0);
        assert_eq!(st.st_ino, m.ino());
        // An existing empty file is kept.
        let again = root
            .ensure_empty_file("agentenv/agentenv-guest", 0o755)
            .unwrap();
        assert_eq!(fstat(&again).unwrap().st_ino, m.ino());
        // A directory in the way of a directory mount point: remove_non_dir leaves it.
        assert!(!root.remove_non_dir("agentenv").unwrap());
        assert!(!root.remove_non_dir("missing/x").unwrap());
        victim_unchanged(&victim);
    }

    #[test]
    fn nodes_links_xattrs_and_trees() {
        let (_t, upper, victim) = setup();
        let root = SafeDir::open(&upper).unwrap();
        root.create_dir_all("a/b", 0o750).unwrap();
        assert_eq!(
            std::fs::metadata(upper.join("a/b")).unwrap().mode() & 0o7777,
            0o750
        );
        root.mknod_at("a/fifo", SFlag::S_IFIFO, 0o666, 0).unwrap();
        let m = std::fs::symlink_metadata(upper.join("a/fifo")).unwrap();
        assert_eq!(m.mode() & 0o7777, 0o666, "exact mode, no umask");
        root.symlink_at("a/link", &victim).unwrap();
        assert_eq!(root.read_link("a/link").unwrap(), victim);
        // Attributes of a link are its own (trusted.* is allowed on links, user.* not).
        root.set_xattr_nofollow("a/link", "trusted.test", b"v")
            .unwrap();
        assert_eq!(
            root.xattrs_nofollow("a/link").unwrap(),
            [(OsString::from("trusted.test"), b"v".to_vec())]
        );
        assert!(xattr::get_deref(&victim, "trusted.test").unwrap().is_none());
        root.set_xattr_nofollow("a", "trusted.overlay.opaque", b"y")
            .unwrap();
        assert_eq!(
            xattr::get(upper.join("a"), "trusted.overlay.opaque").unwrap(),
            Some(b"y".to_vec())
        );
        {
            let mut f = root.create_file("a/b/f", 0o640).unwrap();
            f.write_all(b"data").unwrap();
        }
        assert!(root.create_file("a/b/f", 0o640).is_err(), "O_EXCL");
        root.hard_link_within("a/b/f", "a/hard").unwrap();
        assert_eq!(std::fs::metadata(upper.join("a/hard")).unwrap().nlink(), 2);
        let e = root.hard_link_within("a/b", "a/dirlink").unwrap_err();
        assert!(matches!(e, SafeFsError::BadLinkTarget { .. }), "{e:?}");
        assert_eq!(
            root.entries().unwrap(),
            [OsString::from("a")],
            "sorted names"
        );
        assert_eq!(
            std::io::read_to_string(root.open_file("a/b/f").unwrap()).unwrap(),
            "data"
        );
        assert!(matches!(
            root.open_file("a/fifo").unwrap_err(),
            SafeFsError::NotRegular { .. }
        ));
        // remove_all removes the tree, not what its links point at.
        assert!(root.remove_all("a").unwrap());
        assert!(!upper.join("a").exists());
        assert!(!root.remove_all("a").unwrap());
        victim_unchanged(&victim);
    }

    #[test]
    fn the_directory_itself_must_not_be_a_link() {
        let (t, upper, _victim) = setup();
        let l = t.path().join("l");
        std::os::unix::fs::symlink(&upper, &l).unwrap();
        let e = SafeDir::open(&l).unwrap_err();
        assert!(matches!(e, SafeFsError::Symlink { .. }), "{e:?}");
    }
}
