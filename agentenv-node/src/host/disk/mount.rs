//! Mounting a layer: [`mount_layer`] checks that the image is a cleanly unmounted ext4
//! file system, attaches it to a loop device and mounts it; [`MountedLayer`] unmounts it
//! again (waiting until the loop device is released) or finds one mounted after a crash
//! of the node. Also the parsing of `/proc/<pid>/mountinfo` and [`holders`], which names
//! who keeps a layer busy.

use std::collections::HashSet;
use std::ffi::OsString;
use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::ffi::OsStringExt;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nix::fcntl::{Flock, FlockArg};
use nix::mount::{MntFlags, MsFlags};

use super::loopdev::{
    LO_FLAGS_AUTOCLEAR, LO_FLAGS_DIRECT_IO, attach, loop_backing_file, loop_devno, loop_flags,
};
use super::{DiskError, UPPER_DIR, WORK_DIR, errno_err, io_err};

/// File system options of a mounted layer (see the `disk` module's documentation).
const MOUNT_DATA: &str = "noinit_itable,nobarrier,errors=remount-ro";
/// How long an unmount waits for the kernel to let go of the loop device (another mount
/// namespace that still held a copy of the mount and is going away, a prober such as
/// udev that opened the device).
const RELEASE_TIMEOUT: Duration = Duration::from_secs(2);
/// Processes named at most in an error about a layer that is still in use.
const MAX_HOLDERS: usize = 8;
// The ext4 superblock (at byte 1024 of the image): offsets and values.
const SB_MAGIC: usize = 0x38;
const SB_STATE: usize = 0x3A;
const SB_FEATURE_INCOMPAT: usize = 0x60;
const EXT4_MAGIC: u16 = 0xEF53;
const EXT4_VALID_FS: u16 = 0x0001;
const EXT4_ERROR_FS: u16 = 0x0002;
const EXT4_FEATURE_INCOMPAT_RECOVER: u32 = 0x0004;

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
    pub(super) mountpoint: PathBuf,
    pub(super) image: PathBuf,
    pub(super) loop_index: u32,
    pub(super) direct_io: bool,
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

/// One line of `/proc/<pid>/mountinfo`.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct MountInfo {
    /// `major:minor` of the file system.
    devno: String,
    pub(super) mountpoint: PathBuf,
    /// Propagation: a member of a peer group (`shared:N`).
    pub(super) shared: bool,
    fstype: String,
    source: String,
    super_options: String,
}

impl MountInfo {
    pub(super) fn parse(line: &str) -> Option<Self> {
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
}
