//! The snapshot format.
//!
//! A snapshot is a directory with two files:
//!
//! * `vmstate`: `b"AENVSNAP"`, the format version (u32 LE), the body length (u64 LE), the
//!   body (JSON: the CPU vendor/family/model/stepping the snapshot was taken on, and the
//!   state: every vCPU's registers, special registers, XSAVE area, XCRs, MSRs, LAPIC, MP
//!   state and pending events; the VM's PIC ×2, IOAPIC, PIT and clock; the UART's
//!   registers; each virtio device's transport and device state, themselves versioned),
//!   then the SHA-256 of
//!   everything before it. A file with another magic or version, a different CPU, a wrong
//!   length or checksum is refused before anything is restored.
//! * `memory`: guest RAM, the regions one after another (below the MMIO gap, then above
//!   4 GiB), exactly the guest's size. A **full** snapshot holds every page (pages of
//!   anonymous guest memory the process never populated are zero and stay holes of the
//!   sparse file). A **diff**
//!   snapshot writes only the pages dirtied since the previous snapshot of the same VM
//!   (KVM's dirty log of vCPU writes OR the device bitmaps of DMA writes) into a copy of the
//!   previous snapshot's memory file — in place when the target directory is the previous
//!   one — so every snapshot directory restores on its own; the page list is recorded in
//!   `vmstate` (`dirty_pages`).
//!
//! Restore maps `memory` `MAP_PRIVATE`: pages are read from the file as the guest touches
//! them, and the guest's writes never reach the file. Files are written under a temporary
//! name and renamed, so a running VM's private mapping of an older file stays intact.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use vm_memory::{Address, Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryRegion};

use crate::arch::cpuid::CpuModel;
use crate::devices::legacy::SerialSnapshot;
use crate::devices::virtio::mmio::MmioTransportState;
use crate::hypervisor::{VcpuState, VmState};
use crate::memory::{GuestMemoryMmap, PAGE_SIZE};

/// The state file of a snapshot directory.
pub const STATE_FILE: &str = "vmstate";
/// The memory file of a snapshot directory.
pub const MEMORY_FILE: &str = "memory";
/// The magic at the start of [`STATE_FILE`].
pub const MAGIC: &[u8; 8] = b"AENVSNAP";
/// The format this build writes and reads.
pub const FORMAT_VERSION: u32 = 1;

const PREFIX_LEN: usize = 8 + 4 + 8;
const DIGEST_LEN: usize = 32;

/// A full snapshot holds every page; a diff snapshot holds the pages written since the
/// previous snapshot of this VM.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SnapshotKind {
    Full,
    Diff,
}

/// Why a snapshot could not be written or used.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    #[error("{path:?}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path:?} is not an agentenv-vmm snapshot (bad magic)")]
    Magic { path: PathBuf },
    #[error(
        "{path:?} has snapshot format version {found}; this VMM reads version {FORMAT_VERSION}. Take the snapshot again with this VMM"
    )]
    Version { path: PathBuf, found: u32 },
    #[error("{path:?} is truncated or has trailing bytes ({len} bytes, expected {expected})")]
    Truncated {
        path: PathBuf,
        len: u64,
        expected: u64,
    },
    #[error("{path:?} is corrupted (checksum mismatch)")]
    Checksum { path: PathBuf },
    #[error("{path:?}: the state cannot be decoded: {reason}")]
    Decode { path: PathBuf, reason: String },
    #[error(
        "the snapshot was taken on {snapshot}, this host is {host}; restore it on a host with the same CPU"
    )]
    CpuMismatch { snapshot: String, host: String },
    #[error("the snapshot does not match the configuration: {0}")]
    Mismatch(String),
    #[error("writing guest memory to {path:?}: {reason}")]
    Memory { path: PathBuf, reason: String },
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> SnapshotError + '_ {
    move |source| SnapshotError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// One virtio device in a snapshot.
#[derive(Serialize, Deserialize)]
pub struct DeviceState {
    pub id: String,
    pub transport: MmioTransportState,
}

/// Everything but guest memory.
#[derive(Serialize, Deserialize)]
pub struct SnapshotState {
    pub memory_bytes: u64,
    pub kind: SnapshotKind,
    /// For a diff snapshot: the guest page numbers it wrote.
    pub dirty_pages: Option<Vec<u64>>,
    pub vcpus: Vec<VcpuState>,
    pub vm: VmState,
    pub devices: Vec<DeviceState>,
    /// The UART's registers.
    #[serde(default)]
    pub serial: Option<SerialSnapshot>,
}

impl std::fmt::Debug for SnapshotState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SnapshotState")
            .field("memory_bytes", &self.memory_bytes)
            .field("kind", &self.kind)
            .field("vcpus", &self.vcpus.len())
            .field("devices", &self.devices.len())
            .finish_non_exhaustive()
    }
}

#[derive(Serialize, Deserialize)]
struct Body<S> {
    cpu: CpuModel,
    state: S,
}

/// Writes [`STATE_FILE`] into `dir`; returns its size.
pub fn write_state(
    dir: &Path,
    cpu: &CpuModel,
    state: &SnapshotState,
) -> Result<u64, SnapshotError> {
    let path = dir.join(STATE_FILE);
    let body = serde_json::to_vec(&Body {
        cpu: cpu.clone(),
        state,
    })
    .map_err(|e| SnapshotError::Decode {
        path: path.clone(),
        reason: e.to_string(),
    })?;
    let mut out = Vec::with_capacity(PREFIX_LEN + body.len() + DIGEST_LEN);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    out.extend_from_slice(&(body.len() as u64).to_le_bytes());
    out.extend_from_slice(&body);
    let digest = Sha256::digest(&out);
    out.extend_from_slice(&digest);
    let tmp = dir.join(format!("{STATE_FILE}.tmp"));
    std::fs::write(&tmp, &out).map_err(io_err(&tmp))?;
    std::fs::rename(&tmp, &path).map_err(io_err(&path))?;
    Ok(out.len() as u64)
}

/// Reads and checks [`STATE_FILE`] of `dir` for a host with CPU `host`; the memory file
/// must exist with the recorded size.
pub fn read_state(dir: &Path, host: &CpuModel) -> Result<SnapshotState, SnapshotError> {
    let path = dir.join(STATE_FILE);
    let mut bytes = Vec::new();
    File::open(&path)
        .and_then(|mut f| f.read_to_end(&mut bytes))
        .map_err(io_err(&path))?;
    if bytes.len() < MAGIC.len() || &bytes[..MAGIC.len()] != MAGIC {
        return Err(SnapshotError::Magic { path });
    }
    if bytes.len() < PREFIX_LEN {
        return Err(SnapshotError::Truncated {
            path,
            len: bytes.len() as u64,
            expected: PREFIX_LEN as u64,
        });
    }
    let version = u32::from_le_bytes(bytes[8..12].try_into().expect("4 bytes"));
    if version != FORMAT_VERSION {
        return Err(SnapshotError::Version {
            path,
            found: version,
        });
    }
    let body_len = u64::from_le_bytes(bytes[12..20].try_into().expect("8 bytes"));
    let expected = (PREFIX_LEN as u64)
        .saturating_add(body_len)
        .saturating_add(DIGEST_LEN as u64);
    if bytes.len() as u64 != expected {
        return Err(SnapshotError::Truncated {
            path,
            len: bytes.len() as u64,
            expected,
        });
    }
    let split = bytes.len() - DIGEST_LEN;
    if Sha256::digest(&bytes[..split]).as_slice() != &bytes[split..] {
        return Err(SnapshotError::Checksum { path });
    }
    let body: Body<SnapshotState> =
        serde_json::from_slice(&bytes[PREFIX_LEN..split]).map_err(|e| SnapshotError::Decode {
            path: path.clone(),
            reason: e.to_string(),
        })?;
    if body.cpu != *host {
        return Err(SnapshotError::CpuMismatch {
            snapshot: body.cpu.to_string(),
            host: host.to_string(),
        });
    }
    let mem_path = dir.join(MEMORY_FILE);
    let len = std::fs::metadata(&mem_path)
        .map_err(io_err(&mem_path))?
        .len();
    if len != body.state.memory_bytes {
        return Err(SnapshotError::Truncated {
            path: mem_path,
            len,
            expected: body.state.memory_bytes,
        });
    }
    Ok(body.state)
}

fn mem_err(path: &Path) -> impl Fn(vm_memory::GuestMemoryError) -> SnapshotError + '_ {
    move |e| SnapshotError::Memory {
        path: path.to_path_buf(),
        reason: e.to_string(),
    }
}

/// Writes every page of `mem` to `path`; returns the number of pages written.
///
/// With `anonymous` (guest memory is private anonymous memory), pages the process never
/// populated (neither present nor swapped, per `/proc/self/pagemap`) are zero and are left
/// as holes of the sparse file instead of being read and written; the file still holds
/// every page. Other memory is written whole.
pub fn write_full_memory(
    mem: &GuestMemoryMmap,
    path: &Path,
    anonymous: bool,
) -> Result<u64, SnapshotError> {
    let tmp = path.with_extension("tmp");
    let mut f = File::create(&tmp).map_err(io_err(&tmp))?;
    let total: u64 = mem.iter().map(|r| r.len()).sum();
    f.set_len(total).map_err(io_err(&tmp))?;
    let page = PAGE_SIZE as u64;
    let mut written = 0u64;
    let mut file_off = 0u64;
    let pagemap = if anonymous {
        File::open("/proc/self/pagemap").ok()
    } else {
        None
    };
    for region in mem.iter() {
        let runs = match &pagemap {
            Some(pm) => populated_runs(pm, region.as_ptr() as u64, region.len())
                .map_err(io_err(Path::new("/proc/self/pagemap")))?,
            None => vec![(0, region.len() / page)],
        };
        for (first, count) in runs {
            f.seek(SeekFrom::Start(file_off + first * page))
                .map_err(io_err(&tmp))?;
            mem.write_all_volatile_to(
                region.start_addr().unchecked_add(first * page),
                &mut f,
                (count * page) as usize,
            )
            .map_err(mem_err(&tmp))?;
            written += count;
        }
        file_off += region.len();
    }
    f.flush().map_err(io_err(&tmp))?;
    drop(f);
    std::fs::rename(&tmp, path).map_err(io_err(path))?;
    Ok(written)
}

/// Runs `(first page, page count)` of the mapping at `addr..addr+len` that are present or
/// swapped out.
fn populated_runs(pagemap: &File, addr: u64, len: u64) -> std::io::Result<Vec<(u64, u64)>> {
    use std::os::unix::fs::FileExt;
    const PRESENT: u64 = 1 << 63;
    const SWAPPED: u64 = 1 << 62;
    const CHUNK: u64 = 8192;
    let page = PAGE_SIZE as u64;
    let pages = len / page;
    let mut runs: Vec<(u64, u64)> = Vec::new();
    let mut buf = vec![0u8; (CHUNK * 8) as usize];
    let mut i = 0;
    while i < pages {
        let n = CHUNK.min(pages - i);
        let bytes = &mut buf[..(n * 8) as usize];
        pagemap.read_exact_at(bytes, (addr / page + i) * 8)?;
        for (j, e) in bytes.chunks_exact(8).enumerate() {
            let e = u64::from_le_bytes(e.try_into().expect("8 bytes"));
            if e & (PRESENT | SWAPPED) != 0 {
                let p = i + j as u64;
                match runs.last_mut() {
                    Some((first, count)) if *first + *count == p => *count += 1,
                    _ => runs.push((p, 1)),
                }
            }
        }
        i += n;
    }
    Ok(runs)
}

/// Writes the `pages` (guest page numbers, ascending) of `mem` into a copy of `base` at
/// `path` (in place when they are the same file); returns the pages written.
pub fn write_diff_memory(
    mem: &GuestMemoryMmap,
    base: &Path,
    path: &Path,
    pages: &[u64],
) -> Result<Vec<u64>, SnapshotError> {
    let same = match (base.canonicalize(), path.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    };
    let target = if same {
        path.to_path_buf()
    } else {
        let tmp = path.with_extension("tmp");
        std::fs::copy(base, &tmp).map_err(io_err(base))?;
        tmp
    };
    let mut f = OpenOptions::new()
        .write(true)
        .open(&target)
        .map_err(io_err(&target))?;
    // File offset of each region: regions are stored one after another.
    let mut regions = Vec::new();
    let mut off = 0u64;
    for r in mem.iter() {
        regions.push((r.start_addr().0, r.len(), off));
        off += r.len();
    }
    let page = PAGE_SIZE as u64;
    let mut i = 0;
    while i < pages.len() {
        // Coalesce a run of consecutive pages into one write.
        let start = pages[i];
        let mut end = start + 1;
        while i + 1 < pages.len() && pages[i + 1] == end {
            end += 1;
            i += 1;
        }
        i += 1;
        let gpa = start * page;
        let Some(&(rbase, rlen, roff)) = regions.iter().find(|(b, l, _)| gpa >= *b && gpa < b + l)
        else {
            return Err(SnapshotError::Memory {
                path: path.to_path_buf(),
                reason: format!("dirty page {start:#x} is outside guest memory"),
            });
        };
        let len = ((end - start) * page).min(rbase + rlen - gpa);
        f.seek(SeekFrom::Start(roff + gpa - rbase))
            .map_err(io_err(&target))?;
        mem.write_all_volatile_to(GuestAddress(gpa), &mut f, len as usize)
            .map_err(mem_err(&target))?;
    }
    f.sync_data().ok();
    drop(f);
    if !same {
        std::fs::rename(&target, path).map_err(io_err(path))?;
    }
    Ok(pages.to_vec())
}

/// The page numbers a diff snapshot wrote, read back from its state file.
pub fn diff_pages(dir: &Path, host: &CpuModel) -> Result<Option<Vec<u64>>, SnapshotError> {
    Ok(read_state(dir, host)?.dirty_pages)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hypervisor::{ClockData, IrqChipState, PitState};
    use crate::memory::{Backing, create};

    fn model() -> CpuModel {
        CpuModel {
            vendor: "AuthenticAMD".into(),
            family: 0x19,
            model: 1,
            stepping: 1,
        }
    }

    fn state(memory_bytes: u64) -> SnapshotState {
        SnapshotState {
            memory_bytes,
            kind: SnapshotKind::Full,
            dirty_pages: None,
            vcpus: Vec::new(),
            vm: VmState {
                pic_master: IrqChipState::default(),
                pic_slave: IrqChipState {
                    chip_id: 1,
                    ..Default::default()
                },
                ioapic: IrqChipState {
                    chip_id: 2,
                    ..Default::default()
                },
                pit: PitState::default(),
                clock: ClockData {
                    clock: 12345,
                    ..Default::default()
                },
            },
            devices: Vec::new(),
            serial: None,
        }
    }

    fn snapshot_dir() -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        let mem = create(16 << 20, Backing::Anonymous, false).unwrap();
        mem.write_obj(0x55aa_u16, GuestAddress(0x2000)).unwrap();
        // Anonymous memory: only the populated page is written, the rest are holes.
        assert_eq!(
            write_full_memory(&mem, &dir.path().join(MEMORY_FILE), true).unwrap(),
            1
        );
        let whole = dir.path().join("whole");
        assert_eq!(write_full_memory(&mem, &whole, false).unwrap(), 4096);
        assert_eq!(
            std::fs::read(&whole).unwrap(),
            std::fs::read(dir.path().join(MEMORY_FILE)).unwrap()
        );
        std::fs::remove_file(whole).unwrap();
        write_state(dir.path(), &model(), &state(16 << 20)).unwrap();
        dir
    }

    #[test]
    fn state_round_trips_and_memory_file_has_the_guest_bytes() {
        let dir = snapshot_dir();
        let s = read_state(dir.path(), &model()).unwrap();
        assert_eq!(s.vm.clock.clock, 12345);
        assert_eq!(s.vm.ioapic.chip_id, 2);
        let bytes = std::fs::read(dir.path().join(MEMORY_FILE)).unwrap();
        assert_eq!(bytes.len(), 16 << 20);
        assert_eq!(&bytes[0x2000..0x2002], &0x55aa_u16.to_le_bytes());
    }

    #[test]
    fn another_format_version_is_refused_with_the_version_named() {
        let dir = snapshot_dir();
        let p = dir.path().join(STATE_FILE);
        let mut b = std::fs::read(&p).unwrap();
        b[8..12].copy_from_slice(&2u32.to_le_bytes());
        std::fs::write(&p, b).unwrap();
        let e = read_state(dir.path(), &model()).unwrap_err();
        assert!(matches!(e, SnapshotError::Version { found: 2, .. }), "{e}");
        assert!(e.to_string().contains("format version 2"));
    }

    #[test]
    fn another_cpu_model_is_refused() {
        let dir = snapshot_dir();
        let mut host = model();
        host.model = 0x11;
        let e = read_state(dir.path(), &host).unwrap_err();
        assert!(matches!(e, SnapshotError::CpuMismatch { .. }), "{e}");
        host = model();
        host.vendor = "GenuineIntel".into();
        assert!(read_state(dir.path(), &host).is_err());
    }

    #[test]
    fn corrupted_or_truncated_files_are_refused() {
        let dir = snapshot_dir();
        let p = dir.path().join(STATE_FILE);
        let good = std::fs::read(&p).unwrap();
        let mut bad = good.clone();
        let mid = bad.len() / 2;
        bad[mid] ^= 0x40;
        std::fs::write(&p, &bad).unwrap();
        assert!(matches!(
            read_state(dir.path(), &model()).unwrap_err(),
            SnapshotError::Checksum { .. }
        ));
        std::fs::write(&p, &good[..good.len() - 10]).unwrap();
        assert!(matches!(
            read_state(dir.path(), &model()).unwrap_err(),
            SnapshotError::Truncated { .. }
        ));
        std::fs::write(&p, b"garbage").unwrap();
        assert!(matches!(
            read_state(dir.path(), &model()).unwrap_err(),
            SnapshotError::Magic { .. }
        ));
        std::fs::write(&p, &good).unwrap();
        let m = dir.path().join(MEMORY_FILE);
        let f = OpenOptions::new().write(true).open(&m).unwrap();
        f.set_len(8 << 20).unwrap();
        assert!(matches!(
            read_state(dir.path(), &model()).unwrap_err(),
            SnapshotError::Truncated { .. }
        ));
    }

    #[test]
    fn diff_memory_writes_only_the_listed_pages_over_a_copy_of_the_base() {
        let dir = snapshot_dir();
        let base = dir.path().join(MEMORY_FILE);
        let mem = create(16 << 20, Backing::PrivateFile(&base), false).unwrap();
        mem.write_obj(0x1111_u32, GuestAddress(0x5000)).unwrap();
        mem.write_obj(0x2222_u32, GuestAddress(0x6000)).unwrap();
        mem.write_obj(0x3333_u32, GuestAddress(0x9000)).unwrap();
        let out = tempfile::tempdir().unwrap();
        let target = out.path().join(MEMORY_FILE);
        write_diff_memory(&mem, &base, &target, &[5, 6]).unwrap();
        let b = std::fs::read(&target).unwrap();
        assert_eq!(&b[0x2000..0x2002], &0x55aa_u16.to_le_bytes());
        assert_eq!(&b[0x5000..0x5004], &0x1111_u32.to_le_bytes());
        assert_eq!(&b[0x6000..0x6004], &0x2222_u32.to_le_bytes());
        // Not listed: not written.
        assert_eq!(&b[0x9000..0x9004], &[0, 0, 0, 0]);
        // The base is untouched.
        assert_eq!(
            &std::fs::read(&base).unwrap()[0x5000..0x5004],
            &[0, 0, 0, 0]
        );
    }
}
