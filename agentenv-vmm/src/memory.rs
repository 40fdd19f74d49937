//! Guest memory: anonymous, or backed by a file (shared, so another process sees it; or
//! private, so a snapshot's memory file is only read as pages fault in), laid out around
//! the 32-bit MMIO gap, with an optional dirty bitmap per region.

use std::fs::{File, OpenOptions};
use std::num::NonZeroUsize;
use std::path::{Path, PathBuf};

use vm_memory::bitmap::AtomicBitmap;
use vm_memory::mmap::MmapRegionBuilder;
use vm_memory::{FileOffset, GuestAddress, GuestMemoryBackend, GuestMemoryRegion};

use crate::arch::ram_ranges;

/// Guest memory as every part of the VMM sees it: mmap-backed regions, each with an
/// optional dirty bitmap that device emulation marks when it writes guest memory (the
/// vCPUs' own writes are tracked by KVM's dirty log). Diff snapshots combine both.
pub type GuestMemoryMmap = vm_memory::GuestMemoryMmap<Option<AtomicBitmap>>;

/// One region of [`GuestMemoryMmap`].
pub type GuestRegionMmap = vm_memory::GuestRegionMmap<Option<AtomicBitmap>>;

/// The page size dirty tracking works in.
pub const PAGE_SIZE: usize = 4096;

/// Why guest memory could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum MemoryError {
    #[error("cannot open the memory file {path:?}: {source}")]
    File {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the memory file {path:?} has {len} bytes, the guest needs {want}")]
    FileSize { path: PathBuf, len: u64, want: u64 },
    #[error("mapping {size} bytes of guest memory failed: {source}")]
    Mmap {
        size: u64,
        source: vm_memory::mmap::MmapRegionError,
    },
    #[error("guest memory regions overlap or are empty")]
    Layout,
}

/// How memory is mapped.
pub enum Backing<'a> {
    /// Private anonymous pages.
    Anonymous,
    /// A file created (or truncated) to the guest size and mapped shared.
    SharedFile(&'a Path),
    /// An existing file of exactly the guest size mapped private: pages are read from it
    /// as the guest touches them, and the guest's writes stay in this process.
    PrivateFile(&'a Path),
}

/// Creates the guest memory of `size` bytes.
pub fn create(
    size: u64,
    backing: Backing<'_>,
    track_dirty: bool,
) -> Result<GuestMemoryMmap, MemoryError> {
    let file = match backing {
        Backing::Anonymous => None,
        Backing::SharedFile(path) => {
            let f = OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(true)
                .open(path)
                .map_err(|source| MemoryError::File {
                    path: path.into(),
                    source,
                })?;
            f.set_len(size).map_err(|source| MemoryError::File {
                path: path.into(),
                source,
            })?;
            Some((f, libc::MAP_SHARED))
        }
        Backing::PrivateFile(path) => {
            let f = File::open(path).map_err(|source| MemoryError::File {
                path: path.into(),
                source,
            })?;
            let len = f
                .metadata()
                .map_err(|source| MemoryError::File {
                    path: path.into(),
                    source,
                })?
                .len();
            if len != size {
                return Err(MemoryError::FileSize {
                    path: path.into(),
                    len,
                    want: size,
                });
            }
            Some((f, libc::MAP_PRIVATE))
        }
    };
    let file = file.map(|(f, flags)| (std::sync::Arc::new(f), flags));
    let mut regions = Vec::new();
    let mut file_offset = 0u64;
    for (base, len) in ram_ranges(size) {
        let bitmap = track_dirty.then(|| {
            AtomicBitmap::new(
                len as usize,
                NonZeroUsize::new(PAGE_SIZE).expect("non-zero"),
            )
        });
        let mut builder = MmapRegionBuilder::new_with_bitmap(len as usize, bitmap)
            .with_mmap_prot(libc::PROT_READ | libc::PROT_WRITE);
        builder = match &file {
            None => builder
                .with_mmap_flags(libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE),
            Some((f, flags)) => builder
                .with_mmap_flags(*flags | libc::MAP_NORESERVE)
                .with_file_offset(FileOffset::from_arc(f.clone(), file_offset)),
        };
        let region = builder
            .build()
            .map_err(|source| MemoryError::Mmap { size: len, source })?;
        regions.push(GuestRegionMmap::new(region, GuestAddress(base)).ok_or(MemoryError::Layout)?);
        file_offset += len;
    }
    GuestMemoryMmap::from_regions(regions).map_err(|_| MemoryError::Layout)
}

/// Total bytes of guest RAM.
pub fn total_size(mem: &GuestMemoryMmap) -> u64 {
    mem.iter().map(|r| r.len()).sum()
}

/// Clears every region's device dirty bitmap.
pub fn reset_dirty_bitmaps(mem: &GuestMemoryMmap) {
    for r in mem.iter() {
        if let Some(b) = r.get_mmap().bitmap() {
            b.reset();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::Bytes;

    #[test]
    fn shared_file_memory_is_the_file_and_private_file_memory_is_not_written_back() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("mem");
        let m = create(16 << 20, Backing::SharedFile(&p), true).unwrap();
        m.write_obj(0xabcdu32, GuestAddress(0x5000)).unwrap();
        let bytes = std::fs::read(&p).unwrap();
        assert_eq!(bytes.len(), 16 << 20);
        assert_eq!(&bytes[0x5000..0x5004], &0xabcdu32.to_le_bytes());
        // The device bitmap saw the write.
        let r = m.find_region(GuestAddress(0)).unwrap();
        let mmap = r.get_mmap();
        let bitmap = mmap.bitmap().as_ref().unwrap();
        assert!(bitmap.is_addr_set(0x5000));
        assert!(!bitmap.is_addr_set(0x6000));
        drop(m);

        let m = create(16 << 20, Backing::PrivateFile(&p), false).unwrap();
        assert_eq!(m.read_obj::<u32>(GuestAddress(0x5000)).unwrap(), 0xabcd);
        m.write_obj(1u32, GuestAddress(0x5000)).unwrap();
        drop(m);
        assert_eq!(
            &std::fs::read(&p).unwrap()[0x5000..0x5004],
            &0xabcdu32.to_le_bytes()
        );
        assert!(matches!(
            create(32 << 20, Backing::PrivateFile(&p), false),
            Err(MemoryError::FileSize { .. })
        ));
    }

    #[test]
    fn anonymous_memory_without_tracking_has_no_bitmap() {
        let m = create(16 << 20, Backing::Anonymous, false).unwrap();
        assert!(m.iter().all(|r| r.bitmap().is_none()));
        assert_eq!(total_size(&m), 16 << 20);
    }
}
