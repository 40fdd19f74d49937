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

use std::collections::{HashSet, VecDeque};
use std::ffi::OsString;
use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use nix::fcntl::{Flock, FlockArg};
use nix::mount::{MntFlags, MsFlags};

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
/// File system options of a mounted layer (see the module's documentation).
const MOUNT_DATA: &str = "noinit_itable,nobarrier,errors=remount-ro";
/// Bytes per inode.
const INODE_RATIO: u32 = 8192;
/// Attempts at taking a free loop device that other processes keep taking first.
const LOOP_ATTEMPTS: usize = 64;
/// How long an unmount waits for the kernel to let go of the loop device (another mount
/// namespace that still held a copy of the mount and is going away, a prober such as
/// udev that opened the device).
const RELEASE_TIMEOUT: Duration = Duration::from_secs(2);
/// Where a missing `mkfs.ext4` is looked for beyond `PATH` (a service's `PATH` often
/// lacks the sbin directories).
const SBIN_DIRS: [&str; 3] = ["/usr/sbin", "/sbin", "/usr/local/sbin"];
/// Processes named at most in an error about a layer that is still in use.
const MAX_HOLDERS: usize = 8;

// <linux/loop.h>
const LOOP_SET_FD: libc::Ioctl = 0x4C00;
const LOOP_CLR_FD: libc::Ioctl = 0x4C01;
const LOOP_SET_STATUS64: libc::Ioctl = 0x4C04;
const LOOP_GET_STATUS64: libc::Ioctl = 0x4C05;
const LOOP_SET_DIRECT_IO: libc::Ioctl = 0x4C08;
const LOOP_SET_BLOCK_SIZE: libc::Ioctl = 0x4C09;
const LOOP_CONFIGURE: libc::Ioctl = 0x4C0A;
const LOOP_CTL_GET_FREE: libc::Ioctl = 0x4C82;
const LO_FLAGS_AUTOCLEAR: u32 = 4;
const LO_FLAGS_DIRECT_IO: u32 = 16;
const LO_NAME_SIZE: usize = 64;
// The ext4 superblock (at byte 1024 of the image): offsets and values.
const SB_MAGIC: usize = 0x38;
const SB_STATE: usize = 0x3A;
const SB_FEATURE_INCOMPAT: usize = 0x60;
const EXT4_MAGIC: u16 = 0xEF53;
const EXT4_VALID_FS: u16 = 0x0001;
const EXT4_ERROR_FS: u16 = 0x0002;
const EXT4_FEATURE_INCOMPAT_RECOVER: u32 = 0x0004;
// <linux/fs.h>: _IOWR('X', 121, struct fstrim_range)
const FITRIM: libc::Ioctl = 0xC018_5879;

/// `struct loop_info64`.
#[repr(C)]
#[derive(Clone, Copy)]
struct LoopInfo64 {
    lo_device: u64,
    lo_inode: u64,
    lo_rdevice: u64,
    lo_offset: u64,
    lo_sizelimit: u64,
    lo_number: u32,
    lo_encrypt_type: u32,
    lo_encrypt_key_size: u32,
    lo_flags: u32,
    lo_file_name: [u8; LO_NAME_SIZE],
    lo_crypt_name: [u8; LO_NAME_SIZE],
    lo_encrypt_key: [u8; 32],
    lo_init: [u64; 2],
}

/// `struct loop_config`.
#[repr(C)]
struct LoopConfig {
    fd: u32,
    block_size: u32,
    info: LoopInfo64,
    reserved: [u64; 8],
}

/// `struct fstrim_range`.
#[repr(C)]
struct FstrimRange {
    start: u64,
    len: u64,
    minlen: u64,
}

const _: () = assert!(std::mem::size_of::<LoopInfo64>() == 232);
const _: () = assert!(std::mem::size_of::<LoopConfig>() == 304);
const _: () = assert!(std::mem::size_of::<FstrimRange>() == 24);

impl LoopInfo64 {
    fn zeroed() -> Self {
        Self {
            lo_device: 0,
            lo_inode: 0,
            lo_rdevice: 0,
            lo_offset: 0,
            lo_sizelimit: 0,
            lo_number: 0,
            lo_encrypt_type: 0,
            lo_encrypt_key_size: 0,
            lo_flags: 0,
            lo_file_name: [0; LO_NAME_SIZE],
            lo_crypt_name: [0; LO_NAME_SIZE],
            lo_encrypt_key: [0; 32],
            lo_init: [0; 2],
        }
    }

    /// Flags, and the image's name for tools such as `losetup` (truncated; the kernel
    /// knows the file itself).
    fn for_image(image: &Path, flags: u32) -> Self {
        let mut info = Self::zeroed();
        info.lo_flags = flags;
        let name = image.as_os_str().as_bytes();
        let n = name.len().min(LO_NAME_SIZE - 1);
        info.lo_file_name[..n].copy_from_slice(&name[..n]);
        info
    }
}

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

/// How a layer is mounted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MountOptions {
    /// Let the loop device read and write the image with direct I/O (`LO_FLAGS_DIRECT_IO`):
    /// the layer's pages are cached once (by the layer's file system, charged to the
    /// sandbox) instead of twice. The kernel falls back to buffered I/O where the image's
    /// file system cannot; [`MountedLayer::direct_io`] says what it did.
    pub direct_io: bool,
    /// Use `LOOP_SET_FD` + `LOOP_SET_STATUS64` even where `LOOP_CONFIGURE` exists (the
    /// path of kernels before 5.8; for tests).
    #[doc(hidden)]
    pub legacy_loop_setup: bool,
}

impl Default for MountOptions {
    fn default() -> Self {
        Self {
            direct_io: true,
            legacy_loop_setup: false,
        }
    }
}

/// A layer mounted by [`mount_layer`] (or found by [`MountedLayer::find`]).
///
/// Dropping it leaves the layer mounted: the mount belongs to the sandbox, not to this
/// value; [`MountedLayer::unmount`] ends it.
#[derive(Debug)]
pub struct MountedLayer {
    mountpoint: PathBuf,
    image: PathBuf,
    loop_index: u32,
    direct_io: bool,
}

/// Mounts the layer image `image` at `mountpoint` (created if missing) with the default
/// [`MountOptions`]. See [`mount_layer_with`].
pub fn mount_layer(image: &Path, mountpoint: &Path) -> Result<MountedLayer, DiskError> {
    mount_layer_with(image, mountpoint, MountOptions::default())
}

/// Mounts the layer image `image` at `mountpoint` (created if missing): attaches it to a
/// free loop device (autoclear) and mounts that `ext4` with `nodev,nosuid,noatime`.
/// `upper/` and `work/` are created if the image lacks them.
///
/// The image must be one this node made (from a blank, or kept by a sandbox): the
/// kernel's ext4 is not hardened against crafted images.
pub fn mount_layer_with(
    image: &Path,
    mountpoint: &Path,
    options: MountOptions,
) -> Result<MountedLayer, DiskError> {
    let image_file = OpenOptions::new()
        .read(true)
        .write(true)
        .open(image)
        .map_err(io_err(format!("opening {}", image.display())))?;
    let image =
        fs::canonicalize(image).map_err(io_err(format!("resolving {}", image.display())))?;
    // Two mounts of the image at once would both find it clean: the second waits for
    // nothing and is refused (the first one's mount marks the superblock in use).
    let image_file =
        Flock::lock(image_file, FlockArg::LockExclusiveNonblock).map_err(|(_, e)| match e {
            nix::Error::EWOULDBLOCK => DiskError::Unclean {
                image: image.clone(),
            },
            e => io_err(format!("locking {}", image.display()))(e.into()),
        })?;
    check_clean(&image_file, &image)?;
    match fs::create_dir(mountpoint) {
        Err(e) if e.kind() != io::ErrorKind::AlreadyExists => {
            return Err(io_err(format!("creating {}", mountpoint.display()))(e));
        }
        _ => {}
    }
    let mountpoint = fs::canonicalize(mountpoint)
        .map_err(io_err(format!("resolving {}", mountpoint.display())))?;
    let mut flags = LO_FLAGS_AUTOCLEAR;
    if options.direct_io {
        flags |= LO_FLAGS_DIRECT_IO;
    }
    let (device, loop_index) = attach(&image_file, &image, flags, options.legacy_loop_setup)?;
    let direct_io =
        options.direct_io && loop_flags(&device).is_ok_and(|f| f & LO_FLAGS_DIRECT_IO != 0);
    let source = format!("/dev/loop{loop_index}");
    nix::mount::mount(
        Some(source.as_str()),
        &mountpoint,
        Some("ext4"),
        MsFlags::MS_NODEV | MsFlags::MS_NOSUID | MsFlags::MS_NOATIME,
        Some(MOUNT_DATA),
    )
    .map_err(errno_err(format!(
        "mounting {} ({}) at {}",
        image.display(),
        source,
        mountpoint.display()
    )))?;
    // The mount holds the device now: closing ours leaves the mount as its last user,
    // so unmounting detaches it (autoclear).
    drop(device);
    drop(image_file);
    let layer = MountedLayer {
        mountpoint,
        image,
        loop_index,
        direct_io,
    };
    for dir in [layer.upper(), layer.work()] {
        match fs::create_dir(&dir) {
            Err(e) if e.kind() != io::ErrorKind::AlreadyExists => {
                let err = io_err(format!("creating {}", dir.display()))(e);
                let _ = layer.unmount();
                return Err(err);
            }
            _ => {}
        }
    }
    Ok(layer)
}

/// Refuses an image that is not a cleanly unmounted ext4 file system: mounted now
/// (elsewhere: another loop device on the same image would corrupt it), or left mounted
/// when the host went down (its last writes may be lost).
fn check_clean(file: &File, image: &Path) -> Result<(), DiskError> {
    let mut sb = [0u8; 1024];
    std::os::unix::fs::FileExt::read_exact_at(file, &mut sb, 1024).map_err(io_err(format!(
        "reading the superblock of {}",
        image.display()
    )))?;
    let le16 = |at: usize| u16::from_le_bytes([sb[at], sb[at + 1]]);
    let le32 = |at: usize| u32::from_le_bytes([sb[at], sb[at + 1], sb[at + 2], sb[at + 3]]);
    if le16(SB_MAGIC) != EXT4_MAGIC {
        return Err(DiskError::NotALayer {
            image: image.to_path_buf(),
        });
    }
    let state = le16(SB_STATE);
    if state & EXT4_VALID_FS == 0
        || state & EXT4_ERROR_FS != 0
        || le32(SB_FEATURE_INCOMPAT) & EXT4_FEATURE_INCOMPAT_RECOVER != 0
    {
        return Err(DiskError::Unclean {
            image: image.to_path_buf(),
        });
    }
    Ok(())
}

/// Attaches `image` to a free loop device with `flags`: the device (open) and its number.
fn attach(
    image_file: &File,
    image: &Path,
    flags: u32,
    legacy: bool,
) -> Result<(File, u32), DiskError> {
    let control = OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/loop-control")
        .map_err(|e| DiskError::NoLoopDevices {
            detail: format!("/dev/loop-control: {e}"),
        })?;
    for _ in 0..LOOP_ATTEMPTS {
        // SAFETY: LOOP_CTL_GET_FREE takes no argument and returns a device number.
        let n = unsafe { libc::ioctl(control.as_raw_fd(), LOOP_CTL_GET_FREE) };
        if n < 0 {
            return Err(io_err("finding a free loop device (LOOP_CTL_GET_FREE)")(
                io::Error::last_os_error(),
            ));
        }
        let path = format!("/dev/loop{n}");
        let device = match OpenOptions::new().read(true).write(true).open(&path) {
            Ok(device) => device,
            // Removed by another process in between.
            Err(e) if e.raw_os_error() == Some(libc::ENXIO) => continue,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Err(DiskError::NoLoopDevices {
                    detail: format!("{path}: {e} (no devtmpfs on /dev?)"),
                });
            }
            Err(e) => return Err(io_err(format!("opening {path}"))(e)),
        };
        let configured = if legacy {
            configure_legacy(&device, image_file, image, flags)
        } else {
            match configure(&device, image_file, image, flags) {
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                    configure_legacy(&device, image_file, image, flags)
                }
                other => other,
            }
        };
        match configured {
            Ok(()) => return Ok((device, n as u32)),
            // Taken by another process since LOOP_CTL_GET_FREE.
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) => continue,
            Err(e) => {
                return Err(io_err(format!("attaching {} to {path}", image.display()))(
                    e,
                ));
            }
        }
    }
    Err(DiskError::LoopExhausted)
}

fn ioctl_result(rc: libc::c_int) -> io::Result<()> {
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// `LOOP_CONFIGURE` (Linux 5.8): file, block size and flags at once.
fn configure(device: &File, image_file: &File, image: &Path, flags: u32) -> io::Result<()> {
    let config = LoopConfig {
        fd: image_file.as_raw_fd() as u32,
        block_size: BLOCK_SIZE,
        info: LoopInfo64::for_image(image, flags),
        reserved: [0; 8],
    };
    // SAFETY: LOOP_CONFIGURE reads a `struct loop_config`, which `config` is (layout
    // asserted above), alive for the call.
    ioctl_result(unsafe { libc::ioctl(device.as_raw_fd(), LOOP_CONFIGURE, &config) })
}

/// The same in steps, for kernels before 5.8. Undone if a step after attaching fails.
fn configure_legacy(device: &File, image_file: &File, image: &Path, flags: u32) -> io::Result<()> {
    let fd = device.as_raw_fd();
    // SAFETY: LOOP_SET_FD takes the backing file's descriptor, open for the call.
    ioctl_result(unsafe { libc::ioctl(fd, LOOP_SET_FD, image_file.as_raw_fd()) })?;
    let rest = (|| {
        // SAFETY: LOOP_SET_BLOCK_SIZE takes the block size by value.
        match ioctl_result(unsafe {
            libc::ioctl(fd, LOOP_SET_BLOCK_SIZE, BLOCK_SIZE as libc::c_ulong)
        }) {
            // Before 4.14: 512-byte sectors, which ext4 with 4 KiB blocks works on.
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {}
            other => other?,
        }
        let info = LoopInfo64::for_image(image, flags & !LO_FLAGS_DIRECT_IO);
        // SAFETY: LOOP_SET_STATUS64 reads a `struct loop_info64`, alive for the call.
        ioctl_result(unsafe { libc::ioctl(fd, LOOP_SET_STATUS64, &info) })?;
        if flags & LO_FLAGS_DIRECT_IO != 0 {
            // SAFETY: LOOP_SET_DIRECT_IO takes 0 or 1 by value. Refused where the backing
            // file cannot do direct I/O: buffered I/O then, as LOOP_CONFIGURE does.
            let _ = unsafe { libc::ioctl(fd, LOOP_SET_DIRECT_IO, 1 as libc::c_ulong) };
        }
        Ok(())
    })();
    if rest.is_err() {
        // SAFETY: LOOP_CLR_FD takes no argument.
        let _ = unsafe { libc::ioctl(fd, LOOP_CLR_FD) };
    }
    rest
}

/// The flags of an attached loop device.
fn loop_flags(device: &File) -> io::Result<u32> {
    let mut info = LoopInfo64::zeroed();
    // SAFETY: LOOP_GET_STATUS64 writes a `struct loop_info64` into `info`, alive and
    // exclusively borrowed for the call.
    ioctl_result(unsafe { libc::ioctl(device.as_raw_fd(), LOOP_GET_STATUS64, &mut info) })?;
    Ok(info.lo_flags)
}

/// The file a loop device is attached to, from sysfs; `None` when it is not attached.
fn loop_backing_file(loop_index: u32) -> Option<PathBuf> {
    let raw = fs::read(format!("/sys/block/loop{loop_index}/loop/backing_file")).ok()?;
    let raw = raw.strip_suffix(b"\n").unwrap_or(&raw);
    Some(PathBuf::from(OsString::from_vec(raw.to_vec())))
}

impl MountedLayer {
    /// Where the layer is mounted.
    pub fn mountpoint(&self) -> &Path {
        &self.mountpoint
    }

    /// The overlay's upper directory.
    pub fn upper(&self) -> PathBuf {
        self.mountpoint.join(UPPER_DIR)
    }

    /// The overlay's work directory.
    pub fn work(&self) -> PathBuf {
        self.mountpoint.join(WORK_DIR)
    }

    /// The image file (as resolved when mounted).
    pub fn image(&self) -> &Path {
        &self.image
    }

    /// The loop device's number (`/dev/loopN`).
    pub fn loop_index(&self) -> u32 {
        self.loop_index
    }

    /// The loop device.
    pub fn device(&self) -> PathBuf {
        PathBuf::from(format!("/dev/loop{}", self.loop_index))
    }

    /// Whether the loop device does direct I/O on the image.
    pub fn direct_io(&self) -> bool {
        self.direct_io
    }

    /// The layer mounted at `mountpoint` in this mount namespace, if one is (the top
    /// mount there, when a loop device's `ext4`): what reconciliation after a crash of the
    /// node uses to unmount or adopt a sandbox's layer.
    pub fn find(mountpoint: &Path) -> Result<Option<Self>, DiskError> {
        let Ok(mountpoint) = fs::canonicalize(mountpoint) else {
            return Ok(None);
        };
        let text = fs::read_to_string("/proc/self/mountinfo")
            .map_err(io_err("reading /proc/self/mountinfo"))?;
        let Some(entry) = text
            .lines()
            .filter_map(MountInfo::parse)
            .rfind(|m| m.mountpoint == mountpoint)
        else {
            return Ok(None);
        };
        let Some(loop_index) = entry
            .source
            .strip_prefix("/dev/loop")
            .and_then(|n| n.parse::<u32>().ok())
            .filter(|_| entry.fstype == "ext4")
        else {
            return Ok(None);
        };
        let image = loop_backing_file(loop_index).unwrap_or_default();
        let direct_io = fs::read_to_string(format!("/sys/block/loop{loop_index}/loop/dio"))
            .is_ok_and(|s| s.trim() == "1");
        Ok(Some(Self {
            mountpoint,
            image,
            loop_index,
            direct_io,
        }))
    }

    /// Unmounts the layer (not lazily), waits until no file system holds its loop device
    /// any more, and makes the image durable (`fdatasync`): the image is then a clean file
    /// system that survives a crash of the host and may be moved, kept and mounted again.
    /// The loop device detaches itself.
    ///
    /// Fails with [`DiskError::Busy`] (nothing changed) when a process here uses the mount,
    /// and with [`DiskError::StillAttached`] when the file system stays mounted in another
    /// mount namespace (a sandbox's, still alive): kill the sandbox's processes first.
    /// The image must still be where it was when mounted (or taken from a pool): move it
    /// after unmounting. An image deleted meanwhile is not synced.
    pub fn unmount(self) -> Result<(), DiskError> {
        let image = self.image.clone();
        self.unmount_inner()?;
        match File::open(&image).and_then(|f| f.sync_data()) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            other => other.map_err(io_err(format!("syncing {}", image.display()))),
        }
    }

    /// Unmounts a layer whose image is deleted next, without waiting: the loop device
    /// detaches itself once nothing holds the file system any more (a process of the
    /// host using it, or a mount namespace made while it was mounted that unmounts are
    /// not propagated to). Never fails for a busy layer: it is detached lazily then.
    pub fn discard(self) -> Result<(), DiskError> {
        match nix::mount::umount2(&self.mountpoint, MntFlags::UMOUNT_NOFOLLOW) {
            Ok(()) | Err(nix::Error::EINVAL) | Err(nix::Error::ENOENT) => Ok(()),
            Err(nix::Error::EBUSY) => nix::mount::umount2(
                &self.mountpoint,
                MntFlags::UMOUNT_NOFOLLOW | MntFlags::MNT_DETACH,
            )
            .map_err(errno_err(format!(
                "detaching {}",
                self.mountpoint.display()
            ))),
            Err(e) => Err(errno_err(format!(
                "unmounting {}",
                self.mountpoint.display()
            ))(e)),
        }
    }

    fn unmount_inner(self) -> Result<(), DiskError> {
        match nix::mount::umount2(&self.mountpoint, MntFlags::UMOUNT_NOFOLLOW) {
            Ok(()) => {}
            // Not mounted any more (unmounted by someone else): only the wait remains.
            Err(nix::Error::EINVAL) => {}
            Err(nix::Error::EBUSY) => {
                return Err(DiskError::Busy {
                    holders: holders(&self.mountpoint, Some(self.loop_index)),
                    mountpoint: self.mountpoint,
                });
            }
            Err(e) => {
                return Err(errno_err(format!(
                    "unmounting {}",
                    self.mountpoint.display()
                ))(e));
            }
        }
        let start = Instant::now();
        let mut pause = Duration::from_micros(50);
        loop {
            if self.released()? {
                return Ok(());
            }
            if start.elapsed() >= RELEASE_TIMEOUT {
                return Err(DiskError::StillAttached {
                    holders: holders(&self.mountpoint, Some(self.loop_index)),
                    device: format!("/dev/loop{}", self.loop_index),
                    mountpoint: self.mountpoint,
                    image: self.image,
                    timeout: RELEASE_TIMEOUT,
                });
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(20));
        }
    }

    /// Whether no file system holds the loop device on the image any more.
    fn released(&self) -> Result<bool, DiskError> {
        match loop_backing_file(self.loop_index) {
            None => return Ok(true),
            // Detached, and attached again by someone else.
            Some(file) if file != self.image => return Ok(true),
            Some(_) => {}
        }
        // Still attached to our image (a prober such as udev may have it open; the
        // detaching may not have run yet). A mounted file system claims its device
        // exclusively until it is gone: an exclusive open fails while it lives.
        let path = format!("/dev/loop{}", self.loop_index);
        match OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_EXCL)
            .open(&path)
        {
            // Closing it detaches the device if ours was the last open (autoclear).
            Ok(_) => Ok(true),
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) => Ok(false),
            Err(e) if e.raw_os_error() == Some(libc::ENXIO) => Ok(true),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(true),
            Err(e) => Err(io_err(format!("opening {path}"))(e)),
        }
    }
}

/// Unmounts whatever layers are mounted at `mountpoint` (reconciliation after a crash of
/// the node): how many there were.
pub fn unmount_leftover(mountpoint: &Path) -> Result<usize, DiskError> {
    let mut count = 0;
    while let Some(layer) = MountedLayer::find(mountpoint)? {
        layer.unmount()?;
        count += 1;
        if count > 16 {
            return Err(DiskError::Io {
                context: format!("unmounting layers at {}", mountpoint.display()),
                source: io::Error::other("more than 16 mounts stacked there"),
            });
        }
    }
    Ok(count)
}

/// Detaches loop devices attached to images under `dir` that nothing uses (what a node
/// process that died while attaching on a kernel before 5.8 can leave behind; with
/// `LOOP_CONFIGURE` autoclear covers that). A device still mounted is only marked to
/// detach itself when unmounted. Returns the devices that were detached.
pub fn detach_stale_loops(dir: &Path) -> Result<Vec<String>, DiskError> {
    let Ok(dir) = fs::canonicalize(dir) else {
        return Ok(Vec::new());
    };
    let entries = match fs::read_dir("/sys/block") {
        Ok(entries) => entries,
        Err(e) => return Err(io_err("reading /sys/block")(e)),
    };
    let mut detached = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(index) = name
            .to_str()
            .and_then(|n| n.strip_prefix("loop"))
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let Some(file) = loop_backing_file(index) else {
            continue;
        };
        if !file.starts_with(&dir) {
            continue;
        }
        let path = format!("/dev/loop{index}");
        let Ok(device) = OpenOptions::new().read(true).write(true).open(&path) else {
            continue;
        };
        // SAFETY: LOOP_CLR_FD takes no argument. On a device others have open (mounted)
        // the kernel only sets autoclear.
        let rc = unsafe { libc::ioctl(device.as_raw_fd(), LOOP_CLR_FD) };
        drop(device);
        if rc == 0 && loop_backing_file(index).is_none_or(|f| f != file) {
            detached.push(path);
        }
    }
    Ok(detached)
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
        Err(nix::Error::EINVAL) | Err(nix::Error::EBUSY) => Ok(false),
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

/// How long the pool waits after a failed build before it tries again.
const POOL_RETRY_AFTER: Duration = Duration::from_secs(1);
/// How long after a take the pool waits before it makes the next layer, so that its I/O
/// does not slow down the rest of the create that took one (a create is under 10 ms).
/// Measured on a host file system without a journal, a refill running beside a create
/// made each of its `mkdir`s wait about a millisecond for metadata under writeback.
pub const POOL_REFILL_DELAY: Duration = Duration::from_millis(20);

/// A warm pool of mounted blank layers of one size (the node's default disk size).
///
/// Creating and mounting a layer costs about a millisecond, but it does I/O: attaching the
/// loop device syncs the fresh image to the host's disk, and on a busy disk that wait is
/// tens of milliseconds (see `examples/layer_disk_bench.rs`). The pool does that on a
/// thread of its own ahead of time. Each pooled layer sits in a directory of its own,
/// `<pool dir>/<n>/` with `layer.img` and `layer/` (mounted); [`LayerPool::take`] renames
/// that directory to become the sandbox's directory (a mount moves with a directory above
/// it), which is one `rename` and no I/O; the thread makes the next one
/// [`POOL_REFILL_DELAY`] later, after the create that took it.
///
/// The pool owns its directory (give each node process its own), locks it, and on start
/// unmounts and deletes what a previous process left there. It must be on the file system
/// of the sandbox directories.
pub struct LayerPool {
    shared: Arc<PoolShared>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

struct PoolShared {
    dir: PathBuf,
    cache_dir: PathBuf,
    size_mb: u64,
    target: usize,
    options: MountOptions,
    state: Mutex<PoolState>,
    /// A take happened (or the pool closes): refill.
    wake: Condvar,
    /// A build finished (its layer is ready, or it failed).
    finished: Condvar,
    _lock: Flock<File>,
}

struct PoolState {
    ready: VecDeque<MountedLayer>,
    closed: bool,
    /// When a layer was last taken.
    last_take: Option<Instant>,
    next: u64,
    stats: LayerPoolStats,
}

/// What a [`LayerPool`] did so far.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LayerPoolStats {
    /// Layers the pool keeps ready.
    pub target: usize,
    /// Layers ready now.
    pub ready: usize,
    /// Takes served from the pool.
    pub taken: u64,
    /// Takes that found it empty (the caller made its layer itself).
    pub empty: u64,
    /// Layers the pool made.
    pub built: u64,
    /// Builds that failed.
    pub failed: u64,
    /// The last build's error, if it failed.
    pub last_error: Option<String>,
}

impl LayerPool {
    /// Starts a pool of `target` mounted layers of `size_mb` MiB in `dir`, formatted from
    /// the blank in `cache_dir` (made now if needed, so a missing `mkfs.ext4` shows here)
    /// and mounted with `options`.
    pub fn start(
        dir: &Path,
        cache_dir: &Path,
        size_mb: u64,
        target: usize,
        options: MountOptions,
    ) -> Result<Self, DiskError> {
        check_size(size_mb)?;
        fs::create_dir_all(dir).map_err(io_err(format!("creating {}", dir.display())))?;
        let dir = fs::canonicalize(dir).map_err(io_err(format!("resolving {}", dir.display())))?;
        let handle = File::open(&dir).map_err(io_err(format!("opening {}", dir.display())))?;
        let lock = Flock::lock(handle, FlockArg::LockExclusiveNonblock).map_err(|(_, e)| {
            io_err(format!(
                "locking the layer pool {} (another node process uses it?)",
                dir.display()
            ))(e.into())
        })?;
        Self::clear(&dir)?;
        ensure_blank(cache_dir, size_mb)?;
        let shared = Arc::new(PoolShared {
            dir,
            cache_dir: cache_dir.to_path_buf(),
            size_mb,
            target,
            options,
            state: Mutex::new(PoolState {
                ready: VecDeque::new(),
                closed: false,
                last_take: None,
                next: 0,
                stats: LayerPoolStats {
                    target,
                    ..LayerPoolStats::default()
                },
            }),
            wake: Condvar::new(),
            finished: Condvar::new(),
            _lock: lock,
        });
        let worker = shared.clone();
        let thread = std::thread::Builder::new()
            .name("layer-pool".into())
            .spawn(move || worker.refill())
            .map_err(io_err("starting the layer pool's thread"))?;
        Ok(Self {
            shared,
            thread: Mutex::new(Some(thread)),
        })
    }

    /// Unmounts and deletes the pools in `pools_dir` other than `own` that no process
    /// holds (their lock is free: a node process that died left them). Returns what it
    /// removed, for a reconciliation report.
    pub fn leftovers(pools_dir: &Path, own: &Path) -> Vec<String> {
        let mut removed = Vec::new();
        let Ok(entries) = fs::read_dir(pools_dir) else {
            return removed;
        };
        for e in entries.flatten() {
            let path = e.path();
            if path == own || !path.is_dir() {
                continue;
            }
            let Ok(handle) = File::open(&path) else {
                continue;
            };
            // A live pool holds its lock: leave it.
            let Ok(_lock) = Flock::lock(handle, FlockArg::LockExclusiveNonblock) else {
                continue;
            };
            match Self::clear(&path).and_then(|()| {
                fs::remove_dir(&path).map_err(io_err(format!("removing {}", path.display())))
            }) {
                Ok(()) => removed.push(format!("layer pool {}", path.display())),
                Err(e) => {
                    tracing::warn!(pool = %path.display(), error = %e, "removing a leftover layer pool")
                }
            }
        }
        removed
    }

    /// Unmounts and deletes every entry of the pool's directory.
    fn clear(dir: &Path) -> Result<(), DiskError> {
        let entries = fs::read_dir(dir).map_err(io_err(format!("reading {}", dir.display())))?;
        for entry in entries.flatten() {
            let path = entry.path();
            unmount_leftover(&path.join(LAYER_DIR))?;
            fs::remove_dir_all(&path).map_err(io_err(format!("removing {}", path.display())))?;
        }
        Ok(())
    }

    /// The pool's directory.
    pub fn dir(&self) -> &Path {
        &self.shared.dir
    }

    /// The size of the pool's layers.
    pub fn size_mb(&self) -> u64 {
        self.shared.size_mb
    }

    /// Takes a ready layer as the new directory `dir` (which must not exist; same file
    /// system as the pool's), holding `layer.img` and `layer/` (mounted): `None` when none
    /// is ready (make one with [`create_layer_image`] and [`mount_layer_with`]). On an
    /// error the pool keeps the layer.
    pub fn take(&self, dir: &Path) -> Result<Option<MountedLayer>, DiskError> {
        let layer = {
            let mut state = lock(&self.shared.state);
            state.last_take = Some(Instant::now());
            self.shared.wake.notify_all();
            let Some(layer) = state.ready.pop_front() else {
                state.stats.empty += 1;
                return Ok(None);
            };
            layer
        };
        let Some(entry) = layer.mountpoint.parent().map(Path::to_path_buf) else {
            unreachable!("a pooled layer is mounted in an entry directory");
        };
        let moved = nix::fcntl::renameat2(
            nix::fcntl::AT_FDCWD,
            &entry,
            nix::fcntl::AT_FDCWD,
            dir,
            nix::fcntl::RenameFlags::RENAME_NOREPLACE,
        )
        .map_err(errno_err(format!(
            "moving {} to {}",
            entry.display(),
            dir.display()
        )))
        .and_then(|()| {
            fs::canonicalize(dir).map_err(io_err(format!("resolving {}", dir.display())))
        });
        match moved {
            Ok(dir) => {
                lock(&self.shared.state).stats.taken += 1;
                Ok(Some(MountedLayer {
                    mountpoint: dir.join(LAYER_DIR),
                    image: dir.join(LAYER_IMAGE),
                    ..layer
                }))
            }
            Err(e) => {
                lock(&self.shared.state).ready.push_front(layer);
                Err(e)
            }
        }
    }

    /// Waits until `count` layers (at most the pool's target) are ready, at most
    /// `timeout`: whether they are.
    pub fn wait_ready(&self, count: usize, timeout: Duration) -> bool {
        let count = count.min(self.shared.target);
        let deadline = Instant::now() + timeout;
        let mut state = lock(&self.shared.state);
        while state.ready.len() < count && !state.closed {
            let Some(left) = deadline.checked_duration_since(Instant::now()) else {
                return false;
            };
            state = self
                .shared
                .finished
                .wait_timeout(state, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        state.ready.len() >= count
    }

    /// What the pool did so far.
    pub fn stats(&self) -> LayerPoolStats {
        let state = lock(&self.shared.state);
        LayerPoolStats {
            ready: state.ready.len(),
            ..state.stats.clone()
        }
    }

    /// Stops refilling and unmounts and deletes the ready layers. Takes after this find
    /// the pool empty.
    pub fn shutdown(&self) {
        lock(&self.shared.state).closed = true;
        self.shared.wake.notify_all();
        self.shared.finished.notify_all();
        if let Some(thread) = lock(&self.thread).take() {
            let _ = thread.join();
        }
        let ready: Vec<MountedLayer> = lock(&self.shared.state).ready.drain(..).collect();
        for layer in ready {
            let entry = layer.mountpoint.parent().map(Path::to_path_buf);
            if let Err(e) = layer.discard() {
                tracing::warn!(error = %e, "unmounting a pooled layer");
                continue;
            }
            if let Some(entry) = entry {
                let _ = fs::remove_dir_all(entry);
            }
        }
    }
}

impl Drop for LayerPool {
    fn drop(&mut self) {
        self.shutdown();
    }
}

impl PoolShared {
    fn refill(&self) {
        loop {
            let n = {
                let mut state = lock(&self.state);
                while !state.closed && state.ready.len() >= self.target {
                    state = self.wake.wait(state).unwrap_or_else(|e| e.into_inner());
                }
                // Counted from the take that woke us, not extended by later ones: under a
                // steady stream of takes the pool still refills.
                if let Some(until) = state.last_take.map(|t| t + POOL_REFILL_DELAY) {
                    while !state.closed {
                        let Some(left) = until.checked_duration_since(Instant::now()) else {
                            break;
                        };
                        state = self
                            .wake
                            .wait_timeout(state, left)
                            .unwrap_or_else(|e| e.into_inner())
                            .0;
                    }
                }
                if state.closed {
                    return;
                }
                state.next += 1;
                state.next
            };
            let entry = self.dir.join(n.to_string());
            match self.build(&entry) {
                Ok(layer) => {
                    let mut state = lock(&self.state);
                    state.stats.built += 1;
                    state.stats.last_error = None;
                    if !state.closed {
                        state.ready.push_back(layer);
                        self.finished.notify_all();
                        continue;
                    }
                    drop(state);
                    let _ = layer.discard();
                    let _ = fs::remove_dir_all(&entry);
                    return;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "making a pooled layer");
                    let _ = unmount_leftover(&entry.join(LAYER_DIR));
                    let _ = fs::remove_dir_all(&entry);
                    let mut state = lock(&self.state);
                    state.stats.failed += 1;
                    state.stats.last_error = Some(e.to_string());
                    self.finished.notify_all();
                    if !state.closed {
                        let _ = self.wake.wait_timeout(state, POOL_RETRY_AFTER);
                    }
                }
            }
        }
    }

    fn build(&self, entry: &Path) -> Result<MountedLayer, DiskError> {
        fs::create_dir(entry).map_err(io_err(format!("creating {}", entry.display())))?;
        let image = entry.join(LAYER_IMAGE);
        create_layer_image(&self.cache_dir, self.size_mb, &image)?;
        mount_layer_with(&image, &entry.join(LAYER_DIR), self.options)
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

/// One line of `/proc/<pid>/mountinfo`.
#[derive(Debug, PartialEq, Eq)]
struct MountInfo {
    /// `major:minor` of the file system.
    devno: String,
    mountpoint: PathBuf,
    /// Propagation: a member of a peer group (`shared:N`).
    shared: bool,
    fstype: String,
    source: String,
    super_options: String,
}

impl MountInfo {
    fn parse(line: &str) -> Option<Self> {
        let (left, right) = line.split_once(" - ")?;
        let mut left = left.split(' ');
        let devno = left.nth(2)?.to_string();
        let mountpoint = PathBuf::from(OsString::from_vec(unescape(left.nth(1)?)));
        // Per-mount options, then the optional fields.
        let shared = left.skip(1).any(|field| field.starts_with("shared:"));
        let mut right = right.split(' ');
        let fstype = right.next()?.to_string();
        let source = String::from_utf8_lossy(&unescape(right.next()?)).into_owned();
        let super_options = right.next().unwrap_or("").to_string();
        Some(Self {
            devno,
            mountpoint,
            shared,
            fstype,
            source,
            super_options,
        })
    }
}

/// Undoes the kernel's octal escapes (`\040` for a space) in a mountinfo field.
fn unescape(field: &str) -> Vec<u8> {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\'
            && i + 3 < bytes.len()
            && bytes[i + 1..i + 4]
                .iter()
                .all(|b| (b'0'..=b'7').contains(b))
        {
            let v = (bytes[i + 1] - b'0') as u32 * 64
                + (bytes[i + 2] - b'0') as u32 * 8
                + (bytes[i + 3] - b'0') as u32;
            out.push(v as u8);
            i += 4;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    out
}

/// The loop device's `major:minor`.
fn loop_devno(loop_index: u32) -> Option<String> {
    let path = format!("/dev/loop{loop_index}");
    let meta = fs::metadata(path).ok()?;
    if !meta.file_type().is_block_device() {
        return None;
    }
    let rdev = meta.rdev();
    Some(format!("{}:{}", libc::major(rdev), libc::minor(rdev)))
}

/// Who keeps a layer in use, for error messages: overlays here on its `upper/`,
/// processes with a file, working directory or root under `mountpoint`, and mount
/// namespaces other than ours in which the layer's file system is mounted (or an overlay
/// on its `upper/`).
fn holders(mountpoint: &Path, loop_index: Option<u32>) -> String {
    let devno = loop_index.and_then(loop_devno);
    let upper_option = format!("upperdir={}/", mountpoint.display());
    let own_ns = fs::read_link("/proc/self/ns/mnt").ok();
    let mut seen_ns = HashSet::new();
    // Overlays here on the layer's upper directory.
    let mut found: Vec<String> = fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .filter_map(MountInfo::parse)
        .filter(|m| m.super_options.contains(&upper_option))
        .map(|m| format!("an overlay mounted at {} uses it", m.mountpoint.display()))
        .collect();
    let Ok(procs) = fs::read_dir("/proc") else {
        return "processes unknown: /proc unreadable".into();
    };
    for entry in procs.flatten() {
        if found.len() >= MAX_HOLDERS {
            found.push("…".to_string());
            break;
        }
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        let proc_dir = entry.path();
        let comm = fs::read_to_string(proc_dir.join("comm")).unwrap_or_default();
        let comm = comm.trim();
        let ns = fs::read_link(proc_dir.join("ns/mnt")).ok();
        if ns.is_some() && ns != own_ns {
            if let Some(ns) = ns.filter(|ns| seen_ns.insert(ns.clone())) {
                let mounted = fs::read_to_string(proc_dir.join("mountinfo"))
                    .unwrap_or_default()
                    .lines()
                    .filter_map(MountInfo::parse)
                    .any(|m| {
                        devno.as_deref() == Some(m.devno.as_str())
                            || m.super_options.contains(&upper_option)
                    });
                if mounted {
                    found.push(format!(
                        "pid {pid} ({comm}) in mount namespace {}",
                        ns.display()
                    ));
                }
            }
            continue;
        }
        let mut links = vec![proc_dir.join("cwd"), proc_dir.join("root")];
        if let Ok(fds) = fs::read_dir(proc_dir.join("fd")) {
            links.extend(fds.flatten().map(|fd| fd.path()));
        }
        if let Some(path) = links
            .iter()
            .filter_map(|l| fs::read_link(l).ok())
            .find(|target| target.starts_with(mountpoint))
        {
            found.push(format!("pid {pid} ({comm}) has {} open", path.display()));
        }
    }
    if found.is_empty() {
        "no process found holding it".into()
    } else {
        found.join("; ")
    }
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
    fn mountinfo_lines_parse_with_escapes() {
        let line = "36 35 7:3 / /data/sand\\040box/layer rw,nosuid,nodev,noatime shared:1 - ext4 /dev/loop3 rw";
        let m = MountInfo::parse(line).unwrap();
        assert_eq!(m.devno, "7:3");
        assert_eq!(m.mountpoint, Path::new("/data/sand box/layer"));
        assert_eq!(m.fstype, "ext4");
        assert_eq!(m.source, "/dev/loop3");
        assert_eq!(m.super_options, "rw");
        assert!(m.shared);
        let overlay = "50 40 0:60 / / rw - overlay overlay rw,lowerdir=/t,upperdir=/s/layer/upper,workdir=/s/layer/work";
        let m = MountInfo::parse(overlay).unwrap();
        assert!(m.super_options.contains("upperdir=/s/layer/"));
        assert!(!m.shared);
        assert_eq!(unescape("a\\134b\\011"), b"a\\b\t");
        assert_eq!(unescape("trailing\\04"), b"trailing\\04");
        assert!(MountInfo::parse("garbage").is_none());
    }

    #[test]
    fn loop_structs_have_the_kernel_layout() {
        let info = LoopInfo64::for_image(Path::new(&"x".repeat(100)), LO_FLAGS_AUTOCLEAR);
        assert_eq!(info.lo_flags, LO_FLAGS_AUTOCLEAR);
        assert_eq!(
            info.lo_file_name[LO_NAME_SIZE - 1],
            0,
            "the name stays terminated"
        );
        assert_eq!(info.lo_file_name[LO_NAME_SIZE - 2], b'x');
        assert_eq!(std::mem::offset_of!(LoopInfo64, lo_flags), 52);
        assert_eq!(std::mem::offset_of!(LoopInfo64, lo_file_name), 56);
        assert_eq!(std::mem::offset_of!(LoopConfig, info), 8);
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
