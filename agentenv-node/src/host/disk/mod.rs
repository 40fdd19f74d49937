//! Capped writable layers: a sandbox's overlay `upper/` and `work/` on an ext4 file system
//! of its own, so a tenant that fills its disk gets `ENOSPC` inside instead of filling the
//! node's.
//!
//! A layer is an image file, `<sandbox dir>/layer.img`, sparse, of the sandbox's disk size,
//! attached to a loop device and mounted `nodev,nosuid,noatime` at `<sandbox dir>/layer/`,
//! which holds `upper/` and `work/`. It is mounted in the node's mount namespace, so a
//! sandbox's mount namespace (made afterwards) sees it. The image is what a stopped
//! sandbox keeps: unmounted, it is a clean file system that moves with the sandbox
//! directory and is mounted again on resume.
//!
//! * **Blank images.** Formatting costs a process and 5–40 ms, so each size is formatted
//!   once into a cache, `<cache dir>/blank-<size>M.img` ([`ensure_blank`]), under an
//!   exclusive `flock` of the cache directory and through a temporary name and a rename,
//!   so node processes and threads racing for the same size make one blank. A new layer
//!   is a copy of the blank ([`create_layer_image`]): a reflink where the file system has
//!   them, else only the blank's data extents (`SEEK_DATA`/`SEEK_HOLE` and
//!   `copy_file_range`), 100–250 KiB for sizes of 64 MiB to 10 GiB.
//! * **The format**: `mkfs.ext4 -b 4096 -m 0 -i 8192 -O ^has_journal,^resize_inode
//!   -E discard,lazy_itable_init=1 -d <upper/ and work/>`. No blocks reserved for root
//!   (the tenant is root inside); one inode per 8 KiB (a tree of small files such as
//!   `node_modules` runs out of space before inodes); no resize inode (its reserved
//!   descriptor blocks were most of a blank's data: 4 MiB at 10 GiB); inode tables
//!   neither written nor zeroed in the background (the image is sparse, so they read as
//!   zeros: mke2fs marks them zeroed, and the mount says `noinit_itable` too).
//! * **No journal, no barriers** (`nobarrier`), checksums kept (`metadata_csum`), and
//!   `errors=remount-ro` (a layer whose writes fail, say because the host's disk filled up
//!   under sparse images, turns read-only instead of losing writes quietly). A
//!   journal only protects against a crash of the host if the file system's flushes
//!   reach the host's disk, and those flushes (one `fsync` of the image each: when
//!   mounting, at every journal commit, at unmount) made a create cost 10–30 ms here
//!   instead of 1. The line is drawn instead at the layer's state:
//!   - a *running* layer promises nothing across a crash of the host (its sandbox dies
//!     with the host anyway), and a tenant's `fsync` stops at the host's page cache (it
//!     cannot make the node's disk flush either);
//!   - a *kept* layer is durable: [`MountedLayer::unmount`] unmounts (the superblock is
//!     marked clean) and then `fdatasync`s the image;
//!   - an image that was not unmounted cleanly (ext4 without a journal clears its "valid"
//!     flag while mounted) is refused by [`mount_layer`] with [`DiskError::Unclean`], never
//!     mounted silently: after a crash of the host that is a layer that was running
//!     ([`repair_layer_image`] runs `e2fsck`, or the caller discards it), and at any time
//!     it is an image mounted elsewhere right now, which a second mount would corrupt.
//! * **Loop devices** are set up with ioctls: `LOOP_CTL_GET_FREE`, then `LOOP_CONFIGURE`
//!   (Linux 5.8; before it `LOOP_SET_FD` and `LOOP_SET_STATUS64`), with
//!   `LO_FLAGS_AUTOCLEAR`, so the device lets go of the image when the file system is
//!   unmounted (or when a node process dies between attaching and mounting), and by
//!   default `LO_FLAGS_DIRECT_IO` (the layer's data is cached once, by the layer's file
//!   system and charged to the sandbox, not a second time as pages of the image; it costs
//!   about 0.2 ms more per mount). Another process may take the same free device first:
//!   that attempt fails with `EBUSY` and the next free device is tried.
//! * **Unmounting** is not lazy, and returns once no file system holds the loop device
//!   any more, so the image can be moved or deleted. A layer still mounted elsewhere (a
//!   sandbox's mount namespace still alive, an open file) is an error that names the
//!   processes involved. After a crash of the node, [`MountedLayer::find`] and
//!   [`unmount_leftover`] find a layer mounted at a path, and [`detach_stale_loops`]
//!   releases loop devices left attached without a mount.
//! * **A pool** ([`LayerPool`]) keeps layers of the default size mounted ahead of time, so
//!   that a create takes one with a `rename` instead of doing I/O on its path.
//!
//! Everything here blocks (a mkfs, a few ioctls and a mount); async callers use
//! `spawn_blocking`. Needs root (`CAP_SYS_ADMIN`) and the `loop` module.
//!
//! The module is split by concern: this file holds the constants, the error, sizes, the
//! cache of blank images, copying an image, a mounted layer's usage and trimming, and the
//! shared mount the layers live under; `loopdev` the loop devices (`/dev/loop-control`
//! and the loop ioctls); `mount` mounting and unmounting a layer, reading
//! `/proc/<pid>/mountinfo` and naming who holds a layer; `pool` the warm [`LayerPool`].

mod clone;
mod loopdev;
mod mount;
mod pool;

use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use nix::fcntl::{Flock, FlockArg};
use nix::mount::{MntFlags, MsFlags};

pub use clone::{clone_mounted, mark_clean};
pub use loopdev::detach_stale_loops;
use mount::MountInfo;
pub use mount::{MountOptions, MountedLayer, mount_layer, mount_layer_with, unmount_leftover};
pub use pool::{LayerPool, LayerPoolStats, POOL_REFILL_DELAY};

/// Smallest layer: ext4 works from a few MiB, but below 64 MiB its metadata is a large
/// share of the space and nothing useful fits anyway.
pub const MIN_SIZE_MB: u64 = 64;
/// Largest layer (1 TiB). A blank of this size still has 12 MiB of metadata to copy for
/// every layer; anything bigger is a mistake rather than a sandbox.
pub const MAX_SIZE_MB: u64 = 1 << 20;
/// The layer image's name in a sandbox directory.
pub const LAYER_IMAGE: &str = "layer.img";
/// The directory a layer is mounted on in a sandbox directory.
pub const LAYER_DIR: &str = "layer";
/// The overlay's upper directory inside a layer.
pub const UPPER_DIR: &str = "upper";
/// The overlay's work directory inside a layer.
pub const WORK_DIR: &str = "work";
/// The program that formats blanks (looked up in `PATH`, then the sbin directories).
pub const MKFS_PROGRAM: &str = "mkfs.ext4";
/// The program that checks and repairs an image ([`repair_layer_image`]).
pub const FSCK_PROGRAM: &str = "e2fsck";

/// Block size of the file system and of the loop device.
const BLOCK_SIZE: u32 = 4096;
/// Bytes per inode.
const INODE_RATIO: u32 = 8192;
/// Attempts at taking a free loop device that other processes keep taking first.
const LOOP_ATTEMPTS: usize = 64;
/// Where a missing `mkfs.ext4` is looked for beyond `PATH` (a service's `PATH` often
/// lacks the sbin directories).
const SBIN_DIRS: [&str; 3] = ["/usr/sbin", "/sbin", "/usr/local/sbin"];
// <linux/fs.h>: _IOWR('X', 121, struct fstrim_range)
const FITRIM: libc::Ioctl = 0xC018_5879;

/// `struct fstrim_range`.
#[repr(C)]
struct FstrimRange {
    start: u64,
    len: u64,
    minlen: u64,
}

const _: () = assert!(std::mem::size_of::<FstrimRange>() == 24);

/// What can go wrong with a layer.
#[derive(Debug, thiserror::Error)]
pub enum DiskError {
    /// A size out of range (the caller's input: an invalid-limits error).
    #[error("disk size: {0}")]
    InvalidSize(String),
    /// The cache of blank images cannot be used.
    #[error("blank image cache {}: {source}", path.display())]
    CacheDir {
        /// The cache directory.
        path: PathBuf,
        /// What failed.
        source: io::Error,
    },
    /// `mkfs.ext4` or `e2fsck` is not installed.
    #[error(
        "{program} not found (looked in PATH and {}): install e2fsprogs",
        SBIN_DIRS.join(", ")
    )]
    ToolMissing {
        /// The program looked for.
        program: String,
    },
    /// `mkfs.ext4` or `e2fsck` failed.
    #[error("{} failed on {} ({status}): {stderr}", program.display(), image.display())]
    ToolFailed {
        /// The program run.
        program: PathBuf,
        /// The image it was formatting.
        image: PathBuf,
        /// Its exit status.
        status: std::process::ExitStatus,
        /// What it said.
        stderr: String,
    },
    /// Not an ext4 image.
    #[error("{} is not a layer image (no ext4 file system in it)", image.display())]
    NotALayer {
        /// The image.
        image: PathBuf,
    },
    /// The image's file system was not unmounted cleanly.
    #[error(
        "layer image {} was not unmounted cleanly: it is mounted now (another sandbox, or a \
         node process that went away while its sandbox runs on), or the host went down \
         while it was mounted and its last writes may be lost (repair_layer_image checks \
         and repairs it)",
        image.display()
    )]
    Unclean {
        /// The image.
        image: PathBuf,
    },
    /// The host has no loop devices.
    #[error(
        "loop devices are unavailable ({detail}): load the loop module (`modprobe loop`) \
         and make its devices visible to the node (/dev/loop-control, /dev/loopN)"
    )]
    NoLoopDevices {
        /// What was missing.
        detail: String,
    },
    /// Every free loop device was taken by another process first.
    #[error("no free loop device after {LOOP_ATTEMPTS} attempts (others kept taking them)")]
    LoopExhausted,
    /// Unmounting was refused because something uses the layer.
    #[error("layer {} is busy: {holders}", mountpoint.display())]
    Busy {
        /// The layer's mount point.
        mountpoint: PathBuf,
        /// Who holds it.
        holders: String,
    },
    /// Unmounted here, but its file system lives on elsewhere.
    #[error(
        "layer {} is unmounted, but {device} still holds {} open after {timeout:?}: \
         it is mounted elsewhere ({holders})",
        mountpoint.display(),
        image.display()
    )]
    StillAttached {
        /// The layer's mount point.
        mountpoint: PathBuf,
        /// The loop device.
        device: String,
        /// The image.
        image: PathBuf,
        /// How long it waited.
        timeout: Duration,
        /// Who holds it.
        holders: String,
    },
    /// A system call failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The error.
        source: io::Error,
    },
}

fn io_err(context: impl Into<String>) -> impl FnOnce(io::Error) -> DiskError {
    let context = context.into();
    move |source| DiskError::Io { context, source }
}

fn errno_err(context: impl Into<String>) -> impl FnOnce(nix::Error) -> DiskError {
    let context = context.into();
    move |e| DiskError::Io {
        context,
        source: io::Error::from(e),
    }
}

fn ioctl_result(rc: libc::c_int) -> io::Result<()> {
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// Checks a layer size in MiB.
pub fn check_size(size_mb: u64) -> Result<u64, DiskError> {
    if size_mb < MIN_SIZE_MB {
        return Err(DiskError::InvalidSize(format!(
            "{size_mb} MiB is less than the minimum of {MIN_SIZE_MB} MiB"
        )));
    }
    if size_mb > MAX_SIZE_MB {
        return Err(DiskError::InvalidSize(format!(
            "{size_mb} MiB is more than the maximum of {MAX_SIZE_MB} MiB (1 TiB)"
        )));
    }
    Ok(size_mb)
}

/// The blank image of a size in a cache directory (whether it exists or not).
pub fn blank_path(cache_dir: &Path, size_mb: u64) -> PathBuf {
    cache_dir.join(format!("blank-{size_mb}M.img"))
}

fn blank_is_ready(path: &Path, size_mb: u64) -> bool {
    fs::metadata(path).is_ok_and(|m| m.is_file() && m.len() == size_mb << 20)
}

/// The blank formatted image of `size_mb` MiB in `cache_dir`, formatted with
/// [`MKFS_PROGRAM`] if it is not there yet. See [`ensure_blank_with`].
pub fn ensure_blank(cache_dir: &Path, size_mb: u64) -> Result<PathBuf, DiskError> {
    ensure_blank_with(cache_dir, size_mb, Path::new(MKFS_PROGRAM))
}

/// The blank formatted image of `size_mb` MiB in `cache_dir`, formatted with `mkfs` (a
/// path, or a name looked up in `PATH` and the sbin directories) if it is not there yet.
///
/// The cache directory is created if needed. Its `flock` serializes formatting across
/// threads and processes: one of them formats (into a temporary name, synced, then
/// renamed), the others wait and find it made. A size larger than the file system that
/// holds the cache is refused.
pub fn ensure_blank_with(
    cache_dir: &Path,
    size_mb: u64,
    mkfs: &Path,
) -> Result<PathBuf, DiskError> {
    check_size(size_mb)?;
    let path = blank_path(cache_dir, size_mb);
    if blank_is_ready(&path, size_mb) {
        return Ok(path);
    }
    let cache_err = |source| DiskError::CacheDir {
        path: cache_dir.to_path_buf(),
        source,
    };
    fs::create_dir_all(cache_dir).map_err(cache_err)?;
    let dir = File::open(cache_dir).map_err(cache_err)?;
    if !dir.metadata().map_err(cache_err)?.is_dir() {
        return Err(cache_err(io::Error::from_raw_os_error(libc::ENOTDIR)));
    }
    let _lock = Flock::lock(dir, FlockArg::LockExclusive)
        .map_err(|(_, e)| cache_err(io::Error::from(e)))?;
    if blank_is_ready(&path, size_mb) {
        return Ok(path);
    }
    let st = nix::sys::statvfs::statvfs(cache_dir).map_err(|e| cache_err(e.into()))?;
    let host_mb = (st.blocks() as u64).saturating_mul(st.fragment_size() as u64) >> 20;
    if size_mb > host_mb {
        return Err(DiskError::InvalidSize(format!(
            "{size_mb} MiB is more than the {host_mb} MiB of the file system holding {}",
            cache_dir.display()
        )));
    }
    let program = find_program(mkfs)?;
    remove_stale_temporaries(cache_dir);

    let tmp = cache_dir.join(format!(".blank-{size_mb}M.img.{}.tmp", std::process::id()));
    let root = cache_dir.join(format!(".blank-root.{}.tmp", std::process::id()));
    let made = format_blank(&program, &tmp, &root, size_mb).and_then(|()| {
        fs::rename(&tmp, &path).map_err(io_err(format!(
            "renaming {} to {}",
            tmp.display(),
            path.display()
        )))?;
        // The rename is durable before any layer is copied from the blank.
        File::open(cache_dir)
            .and_then(|d| d.sync_all())
            .map_err(cache_err)
    });
    let _ = fs::remove_dir_all(&root);
    if made.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    made.map(|()| path)
}

/// Formats `tmp` as a blank of `size_mb` MiB holding empty `upper/` and `work/` (copied
/// from a directory `root` made for it).
fn format_blank(program: &Path, tmp: &Path, root: &Path, size_mb: u64) -> Result<(), DiskError> {
    let _ = fs::remove_dir_all(root);
    for dir in [
        root.to_path_buf(),
        root.join(UPPER_DIR),
        root.join(WORK_DIR),
    ] {
        fs::create_dir(&dir).map_err(io_err(format!("creating {}", dir.display())))?;
        fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .map_err(io_err(format!("setting the mode of {}", dir.display())))?;
    }
    let file = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(tmp)
        .map_err(io_err(format!("creating {}", tmp.display())))?;
    file.set_len(size_mb << 20)
        .map_err(io_err(format!("sizing {}", tmp.display())))?;
    let out = Command::new(program)
        .args(["-q", "-F", "-t", "ext4"])
        .args(["-b", &BLOCK_SIZE.to_string()])
        .args(["-m", "0"])
        .args(["-i", &INODE_RATIO.to_string()])
        .args(["-O", "^has_journal,^resize_inode"])
        .args(["-E", "discard,lazy_itable_init=1"])
        .arg("-d")
        .arg(root)
        .arg(tmp)
        .env("LC_ALL", "C")
        .output()
        .map_err(io_err(format!("running {}", program.display())))?;
    if !out.status.success() {
        return Err(DiskError::ToolFailed {
            program: program.to_path_buf(),
            image: tmp.to_path_buf(),
            status: out.status,
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    file.sync_all()
        .map_err(io_err(format!("syncing {}", tmp.display())))
}

/// Removes what a process that died while formatting left (called under the lock, so no
/// other process is formatting).
fn remove_stale_temporaries(cache_dir: &Path) {
    let Ok(entries) = fs::read_dir(cache_dir) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if name.starts_with(".blank-") && name.ends_with(".tmp") {
            let path = entry.path();
            let _ = fs::remove_dir_all(&path).or_else(|_| fs::remove_file(&path));
        }
    }
}

fn find_program(program: &Path) -> Result<PathBuf, DiskError> {
    let is_executable =
        |p: &Path| fs::metadata(p).is_ok_and(|m| m.is_file() && m.mode() & 0o111 != 0);
    let missing = || DiskError::ToolMissing {
        program: program.display().to_string(),
    };
    if program.components().count() > 1 {
        return if is_executable(program) {
            Ok(program.to_path_buf())
        } else {
            Err(missing())
        };
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(SBIN_DIRS.iter().map(PathBuf::from))
        .map(|dir| dir.join(program))
        .find(|p| is_executable(p))
        .ok_or_else(missing)
}

/// Creates the layer image `dest` (which must not exist) of `size_mb` MiB: a copy of the
/// cached blank ([`ensure_blank`]), sparse, reflinked where the file system can.
pub fn create_layer_image(cache_dir: &Path, size_mb: u64, dest: &Path) -> Result<(), DiskError> {
    let blank = ensure_blank(cache_dir, size_mb)?;
    copy_sparse(&blank, dest)
}

/// Checks and repairs the file system of a layer image that was not unmounted cleanly
/// ([`DiskError::Unclean`]: the host went down while it was mounted), with `e2fsck -f -y`.
/// Only for an image that nothing has mounted: never for one a live sandbox still uses.
pub fn repair_layer_image(image: &Path) -> Result<(), DiskError> {
    let program = find_program(Path::new(FSCK_PROGRAM))?;
    let out = Command::new(&program)
        .args(["-f", "-y"])
        .arg(image)
        .env("LC_ALL", "C")
        .output()
        .map_err(io_err(format!("running {}", program.display())))?;
    // 0: clean; 1: errors corrected; 2: corrected, "reboot" (meaningless for an image).
    match out.status.code() {
        Some(0..=2) => Ok(()),
        _ => Err(DiskError::ToolFailed {
            program,
            image: image.to_path_buf(),
            status: out.status,
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        }),
    }
}

/// Copies `src` to a new file `dest` keeping its holes: a reflink (`FICLONE`) if the file
/// system supports it, else each data extent with `copy_file_range` (or `read`/`write`
/// where that is refused). `dest` is removed again if the copy fails.
pub fn copy_sparse(src: &Path, dest: &Path) -> Result<(), DiskError> {
    let from = File::open(src).map_err(io_err(format!("opening {}", src.display())))?;
    let to = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(dest)
        .map_err(io_err(format!("creating {}", dest.display())))?;
    let copied = copy_extents(&from, &to).map_err(io_err(format!(
        "copying {} to {}",
        src.display(),
        dest.display()
    )));
    if copied.is_err() {
        drop(to);
        let _ = fs::remove_file(dest);
    }
    copied
}

fn copy_extents(from: &File, to: &File) -> io::Result<()> {
    // SAFETY: FICLONE takes the source descriptor as its argument; both descriptors are
    // open for the duration of the call.
    let rc = unsafe { libc::ioctl(to.as_raw_fd(), libc::FICLONE, from.as_raw_fd()) };
    if rc == 0 {
        return Ok(());
    }
    let len = from.metadata()?.len();
    to.set_len(len)?;
    let mut offset = 0u64;
    let mut use_cfr = true;
    while offset < len {
        let Some(start) = seek(from, offset, libc::SEEK_DATA)? else {
            break;
        };
        let end = seek(from, start, libc::SEEK_HOLE)?.unwrap_or(len).min(len);
        copy_range(from, to, start, end, &mut use_cfr)?;
        offset = end;
    }
    Ok(())
}

/// `lseek(fd, offset, whence)`; `None` past the last data (`ENXIO`).
fn seek(file: &File, offset: u64, whence: libc::c_int) -> io::Result<Option<u64>> {
    // SAFETY: lseek on an open descriptor; no memory is passed.
    let rc = unsafe { libc::lseek(file.as_raw_fd(), offset as libc::off_t, whence) };
    if rc < 0 {
        let e = io::Error::last_os_error();
        return if e.raw_os_error() == Some(libc::ENXIO) {
            Ok(None)
        } else {
            Err(e)
        };
    }
    Ok(Some(rc as u64))
}

fn copy_range(from: &File, to: &File, start: u64, end: u64, use_cfr: &mut bool) -> io::Result<()> {
    let mut pos = start;
    while pos < end {
        let want = (end - pos).min(1 << 30) as usize;
        if *use_cfr {
            let mut off_in = pos as libc::loff_t;
            let mut off_out = pos as libc::loff_t;
            // SAFETY: both descriptors are open; the offsets are valid locals the kernel
            // updates.
            let n = unsafe {
                libc::copy_file_range(
                    from.as_raw_fd(),
                    &mut off_in,
                    to.as_raw_fd(),
                    &mut off_out,
                    want,
                    0,
                )
            };
            if n > 0 {
                pos += n as u64;
                continue;
            }
            if n < 0 {
                let e = io::Error::last_os_error();
                match e.raw_os_error() {
                    Some(libc::EINTR) => continue,
                    Some(libc::ENOSYS | libc::EXDEV | libc::EINVAL | libc::EOPNOTSUPP) => {}
                    _ => return Err(e),
                }
            }
            // Refused, or nothing copied where the extents say there is data: read and
            // write from here on.
            *use_cfr = false;
        }
        let mut buf = vec![0u8; want.min(1 << 20)];
        let n = std::os::unix::fs::FileExt::read_at(from, &mut buf, pos)?;
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "source shorter than its extents",
            ));
        }
        std::os::unix::fs::FileExt::write_all_at(to, &buf[..n], pos)?;
        pos += n as u64;
    }
    Ok(())
}

/// Makes `dir` a mount point of its own with shared propagation (a bind mount of itself,
/// unless it is a mount point already), once per node start. Layers are mounted beneath
/// it; a mount namespace made on the host while they are mounted (`ip netns exec`, a
/// systemd unit with `PrivateTmp=`) gets copies of them, and with shared propagation its
/// copies are slaves that the node's unmounts reach, so they never keep a destroyed or
/// kept layer's file system alive. Returns whether anything changed.
pub fn make_shared_mount(dir: &Path) -> Result<bool, DiskError> {
    let dir = fs::canonicalize(dir).map_err(io_err(format!("resolving {}", dir.display())))?;
    let text = fs::read_to_string("/proc/self/mountinfo")
        .map_err(io_err("reading /proc/self/mountinfo"))?;
    let top = text
        .lines()
        .filter_map(MountInfo::parse)
        .rfind(|m| m.mountpoint == dir);
    if top.as_ref().is_some_and(|m| m.shared) {
        return Ok(false);
    }
    if top.is_none() {
        nix::mount::mount(
            Some(&dir),
            &dir,
            None::<&str>,
            MsFlags::MS_BIND,
            None::<&str>,
        )
        .map_err(errno_err(format!(
            "bind-mounting {} on itself",
            dir.display()
        )))?;
    }
    nix::mount::mount(
        None::<&str>,
        &dir,
        None::<&str>,
        MsFlags::MS_SHARED,
        None::<&str>,
    )
    .map_err(errno_err(format!("making {} shared", dir.display())))?;
    Ok(true)
}

/// Unmounts the mount [`make_shared_mount`] made at `dir` when nothing is mounted beneath
/// it any more (the node's data directory going away, as in tests): whether it did.
pub fn remove_shared_mount_if_unused(dir: &Path) -> Result<bool, DiskError> {
    let Ok(dir) = fs::canonicalize(dir) else {
        return Ok(false);
    };
    let text = fs::read_to_string("/proc/self/mountinfo")
        .map_err(io_err("reading /proc/self/mountinfo"))?;
    let mounts: Vec<MountInfo> = text.lines().filter_map(MountInfo::parse).collect();
    if !mounts.iter().any(|m| m.mountpoint == dir)
        || mounts
            .iter()
            .any(|m| m.mountpoint != dir && m.mountpoint.starts_with(&dir))
    {
        return Ok(false);
    }
    match nix::mount::umount2(&dir, MntFlags::UMOUNT_NOFOLLOW) {
        Ok(()) => Ok(true),
        Err(nix::Error::EINVAL) => Ok(false),
        // Only the directory's own files are in use (a trash being emptied): with no
        // layer beneath, the mount can go lazily.
        Err(nix::Error::EBUSY) => {
            nix::mount::umount2(&dir, MntFlags::UMOUNT_NOFOLLOW | MntFlags::MNT_DETACH)
                .map(|()| true)
                .map_err(errno_err(format!("unmounting {}", dir.display())))
        }
        Err(e) => Err(errno_err(format!("unmounting {}", dir.display()))(e)),
    }
}

/// Space and inodes of a mounted layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerUsage {
    /// Bytes in use.
    pub used_bytes: u64,
    /// Bytes the tenant can have in all (the size less the file system's own metadata).
    pub total_bytes: u64,
    /// Inodes in use.
    pub used_inodes: u64,
    /// Inodes in all.
    pub total_inodes: u64,
}

/// Space and inodes used in the layer mounted at `mountpoint` (`statvfs`).
pub fn layer_usage(mountpoint: &Path) -> Result<LayerUsage, DiskError> {
    let st = nix::sys::statvfs::statvfs(mountpoint)
        .map_err(errno_err(format!("statvfs of {}", mountpoint.display())))?;
    let frsize = st.fragment_size() as u64;
    let blocks = st.blocks() as u64;
    let free = st.blocks_free() as u64;
    let files = st.files() as u64;
    Ok(LayerUsage {
        used_bytes: blocks.saturating_sub(free) * frsize,
        total_bytes: blocks * frsize,
        used_inodes: files.saturating_sub(st.files_free() as u64),
        total_inodes: files,
    })
}

/// Gives the blocks of deleted files in the layer mounted at `mountpoint` back to the
/// host (`FITRIM`: the loop device punches holes in the image). Returns the bytes trimmed
/// (as the kernel counts them: all free space it went over). For a layer about to be kept,
/// or now and then: a layer is never more than its size on the host's disk, but without
/// this it stays as large as it ever was.
pub fn trim_layer(mountpoint: &Path) -> Result<u64, DiskError> {
    let dir =
        File::open(mountpoint).map_err(io_err(format!("opening {}", mountpoint.display())))?;
    // Blocks freed in the running journal transaction are not free for trimming yet.
    // SAFETY: syncfs on an open descriptor; no memory is passed.
    ioctl_result(unsafe { libc::syncfs(dir.as_raw_fd()) })
        .map_err(io_err(format!("syncing {}", mountpoint.display())))?;
    let mut range = FstrimRange {
        start: 0,
        len: u64::MAX,
        minlen: 0,
    };
    // SAFETY: FITRIM reads and writes a `struct fstrim_range`, alive and exclusively
    // borrowed for the call.
    ioctl_result(unsafe { libc::ioctl(dir.as_raw_fd(), FITRIM, &mut range) })
        .map_err(io_err(format!("trimming {}", mountpoint.display())))?;
    Ok(range.len)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_out_of_range_are_refused() {
        assert!(matches!(check_size(0), Err(DiskError::InvalidSize(_))));
        assert!(matches!(
            check_size(MIN_SIZE_MB - 1),
            Err(DiskError::InvalidSize(_))
        ));
        assert_eq!(check_size(MIN_SIZE_MB).unwrap(), MIN_SIZE_MB);
        assert_eq!(check_size(MAX_SIZE_MB).unwrap(), MAX_SIZE_MB);
        let e = check_size(MAX_SIZE_MB + 1).unwrap_err().to_string();
        assert!(e.contains("maximum"), "{e}");
        let e = check_size(u64::MAX).unwrap_err().to_string();
        assert!(e.contains("maximum"), "{e}");
    }

    #[test]
    fn sparse_copy_keeps_holes_and_data() {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("src");
        let f = File::create(&src).unwrap();
        f.set_len(64 << 20).unwrap();
        std::os::unix::fs::FileExt::write_all_at(&f, b"head", 0).unwrap();
        std::os::unix::fs::FileExt::write_all_at(&f, &[7u8; 10000], 40 << 20).unwrap();
        std::os::unix::fs::FileExt::write_all_at(&f, b"tail", (64 << 20) - 4).unwrap();
        f.sync_all().unwrap();
        let dest = dir.path().join("dest");
        copy_sparse(&src, &dest).unwrap();
        let a = fs::read(&src).unwrap();
        let b = fs::read(&dest).unwrap();
        assert!(a == b, "the copy differs");
        let blocks = fs::metadata(&dest).unwrap().blocks();
        assert!(
            blocks * 512 < 1 << 20,
            "the copy is not sparse: {blocks} blocks"
        );
        // Never over an existing file.
        let e = copy_sparse(&src, &dest).unwrap_err();
        assert!(
            matches!(e, DiskError::Io { ref source, .. } if source.kind() == io::ErrorKind::AlreadyExists),
            "{e}"
        );
        // A missing source leaves no destination behind.
        let e = copy_sparse(&dir.path().join("none"), &dir.path().join("d2")).unwrap_err();
        assert!(e.to_string().contains("none"), "{e}");
        assert!(!dir.path().join("d2").exists());
    }

    #[test]
    fn the_read_write_fallback_copies_a_range() {
        let dir = tempfile::tempdir().unwrap();
        let (src, dest) = (dir.path().join("src"), dir.path().join("dest"));
        let data: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
        fs::write(&src, &data).unwrap();
        let from = File::open(&src).unwrap();
        let to = File::create(&dest).unwrap();
        to.set_len(data.len() as u64).unwrap();
        let mut use_cfr = false;
        copy_range(&from, &to, 4096, data.len() as u64, &mut use_cfr).unwrap();
        let copied = fs::read(&dest).unwrap();
        assert!(copied[..4096].iter().all(|&b| b == 0));
        assert!(copied[4096..] == data[4096..]);
        // A range past the end of the source is an error, not a loop.
        let e = copy_range(&from, &to, 0, data.len() as u64 + 10, &mut use_cfr).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);
        let mut use_cfr = true;
        let e = copy_range(&from, &to, 0, data.len() as u64 + 10, &mut use_cfr).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);
    }

    #[test]
    fn missing_mkfs_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let e = ensure_blank_with(dir.path(), 64, Path::new("mkfs.nonexistent")).unwrap_err();
        let msg = e.to_string();
        assert!(matches!(e, DiskError::ToolMissing { .. }), "{msg}");
        assert!(
            msg.contains("mkfs.nonexistent") && msg.contains("e2fsprogs"),
            "{msg}"
        );
        let e = ensure_blank_with(dir.path(), 64, Path::new("/nowhere/mkfs.ext4")).unwrap_err();
        assert!(matches!(e, DiskError::ToolMissing { .. }), "{e}");
        // Nothing half-made is left.
        let left: Vec<_> = fs::read_dir(dir.path())
            .unwrap()
            .flatten()
            .map(|e| e.file_name())
            .collect();
        assert!(left.is_empty(), "{left:?}");
    }

    #[test]
    fn failing_mkfs_reports_its_output() {
        let dir = tempfile::tempdir().unwrap();
        // `false` exits 1 without a word; the error still names the program and status.
        let e = ensure_blank_with(dir.path(), 64, Path::new("false")).unwrap_err();
        let msg = e.to_string();
        assert!(matches!(e, DiskError::ToolFailed { .. }), "{msg}");
        assert!(
            msg.contains("false") && msg.contains("exit status: 1"),
            "{msg}"
        );
        let left: Vec<_> = fs::read_dir(dir.path())
            .unwrap()
            .flatten()
            .map(|e| e.file_name())
            .collect();
        assert!(left.is_empty(), "temporaries left: {left:?}");
    }

    #[test]
    fn bad_cache_dirs_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("file");
        fs::write(&file, b"").unwrap();
        let e = ensure_blank(&file, 64).unwrap_err();
        let msg = e.to_string();
        assert!(matches!(e, DiskError::CacheDir { .. }), "{msg}");
        assert!(
            msg.contains("blank image cache") && msg.contains("file"),
            "{msg}"
        );
        let e = ensure_blank(&file.join("sub"), 64).unwrap_err();
        assert!(matches!(e, DiskError::CacheDir { .. }), "{e}");
        // Too large for the disk under the cache.
        let e = ensure_blank(dir.path(), MAX_SIZE_MB).unwrap_err();
        let msg = e.to_string();
        if fs_size_mb(dir.path()) < MAX_SIZE_MB {
            assert!(
                matches!(e, DiskError::InvalidSize(_)) && msg.contains("file system holding"),
                "{msg}"
            );
        }
    }

    fn fs_size_mb(path: &Path) -> u64 {
        let st = nix::sys::statvfs::statvfs(path).unwrap();
        (st.blocks() as u64 * st.fragment_size() as u64) >> 20
    }
}
