//! Loop devices for layers: taking a free device from `/dev/loop-control`
//! (`LOOP_CTL_GET_FREE`) and attaching an image to it (`LOOP_CONFIGURE`, or on kernels
//! before 5.8 `LOOP_SET_FD` and `LOOP_SET_STATUS64`), the kernel's structures for that,
//! reading a device's flags and backing file, and detaching devices left behind.

use std::ffi::OsString;
use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

use super::{BLOCK_SIZE, DiskError, LOOP_ATTEMPTS, io_err, ioctl_result};

// <linux/loop.h>
const LOOP_SET_FD: libc::Ioctl = 0x4C00;
const LOOP_CLR_FD: libc::Ioctl = 0x4C01;
const LOOP_SET_STATUS64: libc::Ioctl = 0x4C04;
const LOOP_GET_STATUS64: libc::Ioctl = 0x4C05;
const LOOP_SET_DIRECT_IO: libc::Ioctl = 0x4C08;
const LOOP_SET_BLOCK_SIZE: libc::Ioctl = 0x4C09;
const LOOP_CONFIGURE: libc::Ioctl = 0x4C0A;
const LOOP_CTL_GET_FREE: libc::Ioctl = 0x4C82;
pub(super) const LO_FLAGS_AUTOCLEAR: u32 = 4;
pub(super) const LO_FLAGS_DIRECT_IO: u32 = 16;
const LO_NAME_SIZE: usize = 64;

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

const _: () = assert!(std::mem::size_of::<LoopInfo64>() == 232);
const _: () = assert!(std::mem::size_of::<LoopConfig>() == 304);

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

/// Attaches `image` to a free loop device with `flags`: the device (open) and its number.
pub(super) fn attach(
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
pub(super) fn loop_flags(device: &File) -> io::Result<u32> {
    let mut info = LoopInfo64::zeroed();
    // SAFETY: LOOP_GET_STATUS64 writes a `struct loop_info64` into `info`, alive and
    // exclusively borrowed for the call.
    ioctl_result(unsafe { libc::ioctl(device.as_raw_fd(), LOOP_GET_STATUS64, &mut info) })?;
    Ok(info.lo_flags)
}

/// The file a loop device is attached to, from sysfs; `None` when it is not attached.
pub(super) fn loop_backing_file(loop_index: u32) -> Option<PathBuf> {
    let raw = fs::read(format!("/sys/block/loop{loop_index}/loop/backing_file")).ok()?;
    let raw = raw.strip_suffix(b"\n").unwrap_or(&raw);
    Some(PathBuf::from(OsString::from_vec(raw.to_vec())))
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

/// The loop device's `major:minor`.
pub(super) fn loop_devno(loop_index: u32) -> Option<String> {
    let path = format!("/dev/loop{loop_index}");
    let meta = fs::metadata(path).ok()?;
    if !meta.file_type().is_block_device() {
        return None;
    }
    let rdev = meta.rdev();
    Some(format!("{}:{}", libc::major(rdev), libc::minor(rdev)))
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
