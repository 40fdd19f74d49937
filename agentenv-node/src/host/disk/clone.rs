//! Copies of a mounted layer: what a fork starts from.
//!
//! A running sandbox's layer is mounted, so its image is not a clean file system: ext4
//! without a journal clears its "valid" flag while mounted, and dirty pages may not have
//! reached the image yet. [`clone_mounted`] freezes the file system (`FIFREEZE`: every
//! dirty page and the metadata are written and writers wait), copies the image's data
//! extents and thaws it; [`mark_clean`] then marks the copy's superblock valid again: a
//! frozen file system is consistent on disk, so the copy is a cleanly unmounted one to
//! [`super::mount_layer`].
//! The sandbox's processes should be stopped too (its cgroup frozen) so that the copy is
//! of one moment of the sandbox rather than of whatever its writes had reached.

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::Path;

use super::{DiskError, copy_sparse, io_err, ioctl_result};

// <linux/fs.h>: _IOWR('X', 119, int) and _IOWR('X', 120, int).
const FIFREEZE: libc::Ioctl = 0xC004_5877;
const FITHAW: libc::Ioctl = 0xC004_5878;

// The ext4 superblock, at byte 1024 of the image: offsets and flags.
const SB_OFFSET: u64 = 1024;
const SB_SIZE: usize = 1024;
const SB_MAGIC: usize = 0x38;
const SB_STATE: usize = 0x3A;
const SB_FEATURE_RO_COMPAT: usize = 0x64;
const SB_CHECKSUM: usize = 0x3FC;
const EXT4_MAGIC: u16 = 0xEF53;
const EXT4_VALID_FS: u16 = 0x0001;
const EXT4_FEATURE_RO_COMPAT_METADATA_CSUM: u32 = 0x0400;

/// A file system frozen with `FIFREEZE`, thawed when dropped.
struct Frozen {
    dir: File,
}

impl Frozen {
    fn freeze(mountpoint: &Path) -> Result<Self, DiskError> {
        let dir =
            File::open(mountpoint).map_err(io_err(format!("opening {}", mountpoint.display())))?;
        // SAFETY: FIFREEZE takes no argument memory; the descriptor is open.
        ioctl_result(unsafe { libc::ioctl(dir.as_raw_fd(), FIFREEZE, 0) })
            .map_err(io_err(format!("freezing {}", mountpoint.display())))?;
        Ok(Self { dir })
    }
}

impl Drop for Frozen {
    fn drop(&mut self) {
        // SAFETY: FITHAW takes no argument memory; the descriptor is open.
        if let Err(e) = ioctl_result(unsafe { libc::ioctl(self.dir.as_raw_fd(), FITHAW, 0) }) {
            tracing::error!(error = %e, "thawing a layer's file system failed; its writers wait");
        }
    }
}

/// Copies the image `image` of the layer mounted at `mountpoint` to the new file `dest`
/// while the layer's file system is frozen (for the copy of its data only). The copy is
/// consistent but still says "mounted": [`mark_clean`] it before it is mounted (the
/// layer's processes need not wait for that).
pub fn clone_mounted(mountpoint: &Path, image: &Path, dest: &Path) -> Result<(), DiskError> {
    let _frozen = Frozen::freeze(mountpoint)?;
    copy_sparse(image, dest)
}

/// Sets the "valid" flag in the superblock of the ext4 image `image` (and its checksum,
/// where the file system keeps one). Only for an image that is consistent: a copy of a
/// frozen file system.
pub fn mark_clean(image: &Path) -> Result<(), DiskError> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .open(image)
        .map_err(io_err(format!("opening {}", image.display())))?;
    let mut sb = [0u8; SB_SIZE];
    file.read_exact_at(&mut sb, SB_OFFSET)
        .map_err(io_err(format!(
            "reading the superblock of {}",
            image.display()
        )))?;
    if u16::from_le_bytes([sb[SB_MAGIC], sb[SB_MAGIC + 1]]) != EXT4_MAGIC {
        return Err(DiskError::NotALayer {
            image: image.to_path_buf(),
        });
    }
    set_valid(&mut sb);
    file.write_all_at(&sb, SB_OFFSET)
        .and_then(|_| file.sync_data())
        .map_err(io_err(format!(
            "writing the superblock of {}",
            image.display()
        )))
}

/// Sets the valid flag of superblock `sb` and, with `metadata_csum`, its checksum: CRC32C
/// of the bytes before the checksum field, seeded with `~0` and not inverted at the end
/// (which is the complement of the standard CRC32C).
fn set_valid(sb: &mut [u8; SB_SIZE]) {
    let state = u16::from_le_bytes([sb[SB_STATE], sb[SB_STATE + 1]]) | EXT4_VALID_FS;
    sb[SB_STATE..SB_STATE + 2].copy_from_slice(&state.to_le_bytes());
    let ro_compat = u32::from_le_bytes(
        sb[SB_FEATURE_RO_COMPAT..SB_FEATURE_RO_COMPAT + 4]
            .try_into()
            .expect("four bytes"),
    );
    if ro_compat & EXT4_FEATURE_RO_COMPAT_METADATA_CSUM != 0 {
        let csum = !crc32c::crc32c(&sb[..SB_CHECKSUM]);
        sb[SB_CHECKSUM..].copy_from_slice(&csum.to_le_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A superblock as mkfs.ext4 writes it for a layer blank, when the host has mkfs.
    fn blank_superblock() -> Option<[u8; SB_SIZE]> {
        let dir = tempfile::tempdir().ok()?;
        let blank = super::super::ensure_blank(dir.path(), super::super::MIN_SIZE_MB).ok()?;
        let mut sb = [0u8; SB_SIZE];
        File::open(blank)
            .ok()?
            .read_exact_at(&mut sb, SB_OFFSET)
            .ok()?;
        Some(sb)
    }

    #[test]
    fn the_checksum_matches_what_mkfs_wrote() {
        let Some(sb) = blank_superblock() else {
            eprintln!("SKIPPED: mkfs.ext4 is not available");
            return;
        };
        let ro_compat = u32::from_le_bytes(
            sb[SB_FEATURE_RO_COMPAT..SB_FEATURE_RO_COMPAT + 4]
                .try_into()
                .unwrap(),
        );
        assert_ne!(
            ro_compat & EXT4_FEATURE_RO_COMPAT_METADATA_CSUM,
            0,
            "layers keep metadata checksums"
        );
        // mkfs leaves the file system valid: recomputing must give the same bytes.
        let mut again = sb;
        set_valid(&mut again);
        assert_eq!(again[SB_STATE] & 1, 1);
        assert_eq!(again[SB_CHECKSUM..], sb[SB_CHECKSUM..]);
        // Cleared (as a mounted file system has it), the flag and the checksum come back.
        let mut cleared = sb;
        cleared[SB_STATE] &= !1;
        set_valid(&mut cleared);
        assert_eq!(cleared, sb);
    }

    #[test]
    fn an_image_that_is_not_ext4_is_refused() {
        let f = tempfile::NamedTempFile::new().unwrap();
        f.as_file().set_len(4096).unwrap();
        assert!(matches!(
            mark_clean(f.path()),
            Err(DiskError::NotALayer { .. })
        ));
    }
}
