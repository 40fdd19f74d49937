//! virtio-blk over a raw image file.
//!
//! Requests: IN (read), OUT (write), FLUSH (`fdatasync`) and GET_ID (the drive id as serial,
//! 20 bytes). Reads and writes are positional (`pread`/`pwrite`) straight between the file
//! and guest memory through vm-memory, which marks the pages the device wrote in the dirty
//! bitmap. A read-only drive offers `VIRTIO_BLK_F_RO` and fails writes with IOERR.
//!
//! Every chain is checked before any I/O: it must end and lie in guest memory; the first
//! descriptor is the 16-byte request header (device-readable), the last one the status byte
//! (device-writable), and the data buffers in between have the direction of the request; the
//! data length is a multiple of 512 and the sector range lies inside the disk. A request
//! that fails a check gets `VIRTIO_BLK_S_IOERR` (or `UNSUPP` for an unknown type) when its
//! status byte can be written; otherwise the chain is returned with length 0. Either way it
//! is counted in [`BlockMetrics::errors`] and the worker goes on with the next request.

use std::fs::{File, OpenOptions};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Serialize};
use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_F_FLUSH, VIRTIO_BLK_F_RO, VIRTIO_BLK_F_SEG_MAX, VIRTIO_BLK_ID_BYTES,
    VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_OK, VIRTIO_BLK_S_UNSUPP, VIRTIO_BLK_T_FLUSH,
    VIRTIO_BLK_T_GET_ID, VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT,
};
use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::virtio_ids::VIRTIO_ID_BLOCK;
use virtio_bindings::virtio_ring::VIRTIO_RING_F_EVENT_IDX;
use virtio_queue::{DescriptorChain, Queue};
use vm_memory::bitmap::BitmapSlice;
use vm_memory::{
    Bytes, GuestAddress, ReadVolatile, VolatileMemoryError, VolatileSlice, WriteVolatile,
};
use vmm_sys_util::eventfd::EventFd;

use super::persist::{Persist, StateError};
use super::queue_util::{Desc, check_in_memory, in_memory, walk_chain};
use super::single_queue::{RequestWorker, ServeRequest};
use super::worker::{Worker, stop_worker};
use super::{ActivateContext, ActivateError, VirtioDevice, check_inactive, read_config_bytes};
use crate::memory::GuestMemoryMmap;

/// Bytes per sector, the unit of the request header and of `capacity`.
pub const SECTOR_SIZE: u64 = 512;
/// Entries of the request queue.
pub const QUEUE_SIZE: u16 = 256;
/// Size of the request header (type, reserved, sector).
const HEADER_LEN: u32 = 16;
/// Bytes of the configuration space we answer (`capacity`, `size_max`, `seg_max`); the rest
/// reads as zero.
const CONFIG_LEN: usize = 16;
/// Data buffers one request may have (`seg_max`): the queue size less header and status.
pub const SEG_MAX: u32 = QUEUE_SIZE as u32 - 2;

/// Errors opening a drive.
#[derive(Debug, thiserror::Error)]
pub enum BlockError {
    #[error("opening the drive image {path} failed: {source}; check that it exists and is readable{rw}", rw = if *read_only { "" } else { " and writable (or set read_only)" })]
    Open {
        path: PathBuf,
        read_only: bool,
        source: std::io::Error,
    },
    #[error("reading the size of the drive image {path} failed: {source}")]
    Metadata {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the drive image {path} is {len} bytes, smaller than one 512-byte sector")]
    TooSmall { path: PathBuf, len: u64 },
}

/// Counters of one drive.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct BlockMetrics {
    pub reads: u64,
    pub writes: u64,
    pub read_bytes: u64,
    pub write_bytes: u64,
    pub flushes: u64,
    pub get_ids: u64,
    /// Requests that failed (malformed, out of range, refused write, I/O error, unknown type).
    pub errors: u64,
}

#[derive(Default)]
struct Counters {
    reads: AtomicU64,
    writes: AtomicU64,
    read_bytes: AtomicU64,
    write_bytes: AtomicU64,
    flushes: AtomicU64,
    get_ids: AtomicU64,
    errors: AtomicU64,
}

/// A virtio block device backed by a raw image.
pub struct Block {
    id: String,
    path: PathBuf,
    file: Arc<File>,
    read_only: bool,
    capacity: u64,
    acked_features: u64,
    counters: Arc<Counters>,
    worker: Option<Worker<RequestWorker<BlockRequests>>>,
}

impl Block {
    /// Opens `path` as drive `id` (the id is the serial GET_ID answers, cut to 20 bytes).
    /// The capacity is the file size in whole sectors.
    pub fn new(id: &str, path: &Path, read_only: bool) -> Result<Self, BlockError> {
        let file = OpenOptions::new()
            .read(true)
            .write(!read_only)
            .open(path)
            .map_err(|source| BlockError::Open {
                path: path.to_path_buf(),
                read_only,
                source,
            })?;
        let len = file
            .metadata()
            .map_err(|source| BlockError::Metadata {
                path: path.to_path_buf(),
                source,
            })?
            .len();
        if len < SECTOR_SIZE {
            return Err(BlockError::TooSmall {
                path: path.to_path_buf(),
                len,
            });
        }
        Ok(Self {
            id: id.to_string(),
            path: path.to_path_buf(),
            file: Arc::new(file),
            read_only,
            capacity: len / SECTOR_SIZE,
            acked_features: 0,
            counters: Arc::new(Counters::default()),
            worker: None,
        })
    }

    /// The drive id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Capacity in 512-byte sectors.
    pub fn capacity_sectors(&self) -> u64 {
        self.capacity
    }

    pub fn is_read_only(&self) -> bool {
        self.read_only
    }

    /// Whether the worker thread is serving requests.
    pub fn is_running(&self) -> bool {
        self.worker.as_ref().is_some_and(|w| w.is_running())
    }

    pub fn metrics(&self) -> BlockMetrics {
        let c = &self.counters;
        BlockMetrics {
            reads: c.reads.load(Ordering::Relaxed),
            writes: c.writes.load(Ordering::Relaxed),
            read_bytes: c.read_bytes.load(Ordering::Relaxed),
            write_bytes: c.write_bytes.load(Ordering::Relaxed),
            flushes: c.flushes.load(Ordering::Relaxed),
            get_ids: c.get_ids.load(Ordering::Relaxed),
            errors: c.errors.load(Ordering::Relaxed),
        }
    }

    fn serial(&self) -> [u8; VIRTIO_BLK_ID_BYTES as usize] {
        let mut s = [0u8; VIRTIO_BLK_ID_BYTES as usize];
        let id = self.id.as_bytes();
        let n = id.len().min(s.len());
        s[..n].copy_from_slice(&id[..n]);
        s
    }
}

/// A file seen through `pread`/`pwrite` at a moving offset, for vm-memory's volatile copies.
struct PositionedFile<'a> {
    file: &'a File,
    offset: u64,
}

impl PositionedFile<'_> {
    /// Runs one `pread`/`pwrite` (`io`, given the descriptor and the offset) and moves the
    /// offset past the bytes it moved.
    fn transfer(
        &mut self,
        io: impl FnOnce(libc::c_int, libc::off_t) -> libc::ssize_t,
    ) -> Result<usize, VolatileMemoryError> {
        let n = io(self.file.as_raw_fd(), self.offset as libc::off_t);
        if n < 0 {
            return Err(VolatileMemoryError::IOError(std::io::Error::last_os_error()));
        }
        self.offset += n as u64;
        Ok(n as usize)
    }
}

impl ReadVolatile for PositionedFile<'_> {
    fn read_volatile<B: BitmapSlice>(
        &mut self,
        buf: &mut VolatileSlice<B>,
    ) -> Result<usize, VolatileMemoryError> {
        let (guard, len) = (buf.ptr_guard_mut(), buf.len());
        // SAFETY: the file descriptor is open for the lifetime of `self.file`; `guard` points
        // at `len` bytes of mapped guest memory that stay valid while the guard lives.
        let read =
            self.transfer(|fd, off| unsafe { libc::pread(fd, guard.as_ptr().cast(), len, off) });
        // After a failure, a partial write into guest memory cannot be ruled out.
        buf.bitmap().mark_dirty(0, *read.as_ref().unwrap_or(&len));
        read
    }
}

impl WriteVolatile for PositionedFile<'_> {
    fn write_volatile<B: BitmapSlice>(
        &mut self,
        buf: &VolatileSlice<B>,
    ) -> Result<usize, VolatileMemoryError> {
        let (guard, len) = (buf.ptr_guard(), buf.len());
        // SAFETY: as above; the kernel only reads `len` bytes from `guard`.
        self.transfer(|fd, off| unsafe { libc::pwrite(fd, guard.as_ptr().cast(), len, off) })
    }
}

/// What the worker needs to serve requests.
struct BlockRequests {
    file: Arc<File>,
    read_only: bool,
    capacity: u64,
    serial: [u8; VIRTIO_BLK_ID_BYTES as usize],
    counters: Arc<Counters>,
}

/// Why one request failed; the status it gets.
struct Failure {
    status: u8,
    why: String,
}

fn ioerr(why: impl Into<String>) -> Failure {
    Failure {
        status: VIRTIO_BLK_S_IOERR as u8,
        why: why.into(),
    }
}

impl ServeRequest for BlockRequests {
    fn serve(&mut self, chain: DescriptorChain<&GuestMemoryMmap>, mem: &GuestMemoryMmap) -> u32 {
        self.handle(chain, mem)
    }
}

impl BlockRequests {
    /// Serves one request and returns the bytes written into device-writable buffers.
    fn handle(&self, chain: DescriptorChain<&GuestMemoryMmap>, mem: &GuestMemoryMmap) -> u32 {
        let counters = &self.counters;
        let head = chain.head_index();
        let descs = match walk_chain(chain) {
            Ok(d) => d,
            Err(e) => {
                counters.errors.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(head, "virtio-blk: request skipped: {e}");
                return 0;
            }
        };
        // The status descriptor: last, device-writable, at least one byte in guest memory.
        let status = match descs.last() {
            Some(d) if d.write && d.len >= 1 && in_memory(mem, d.addr, 1) => *d,
            _ => {
                counters.errors.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(
                    head,
                    "virtio-blk: request without a writable status byte; skipped"
                );
                return 0;
            }
        };
        let (status_byte, data_len) = match self.execute(&descs, mem) {
            Ok(written) => (VIRTIO_BLK_S_OK as u8, written),
            Err(f) => {
                counters.errors.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(
                    head,
                    status = f.status,
                    "virtio-blk: request failed: {}",
                    f.why
                );
                (f.status, 0)
            }
        };
        if let Err(e) = mem.write_obj(status_byte, status.addr) {
            tracing::warn!(head, error = %e, "virtio-blk: writing the status byte failed");
            return data_len;
        }
        data_len + 1
    }

    /// Checks and performs one request; returns the data bytes written to the guest.
    fn execute(&self, descs: &[Desc], mem: &GuestMemoryMmap) -> Result<u32, Failure> {
        let (file, read_only, capacity) = (&*self.file, self.read_only, self.capacity);
        let (serial, counters) = (&self.serial[..], &*self.counters);
        if descs.len() < 2 {
            return Err(ioerr(
                "the chain has no request header before the status byte",
            ));
        }
        check_in_memory(mem, descs).map_err(|e| ioerr(e.to_string()))?;
        let header = descs[0];
        if header.write || header.len < HEADER_LEN {
            return Err(ioerr(
                "the request header is not a device-readable 16-byte buffer",
            ));
        }
        let req_type: u32 = mem
            .read_obj(header.addr)
            .map_err(|e| ioerr(format!("reading the header failed: {e}")))?;
        let sector: u64 = mem
            .read_obj(GuestAddress(header.addr.0 + 8))
            .map_err(|e| ioerr(format!("reading the header failed: {e}")))?;
        let req_type = u32::from_le(req_type);
        let sector = u64::from_le(sector);
        let data = &descs[1..descs.len() - 1];
        let total: u64 = data.iter().map(|d| u64::from(d.len)).sum();

        match req_type {
            VIRTIO_BLK_T_IN | VIRTIO_BLK_T_OUT => {
                let is_read = req_type == VIRTIO_BLK_T_IN;
                if data.iter().any(|d| d.write != is_read) {
                    return Err(ioerr(if is_read {
                        "a read request has a device-readable data buffer"
                    } else {
                        "a write request has a device-writable data buffer"
                    }));
                }
                if !is_read && read_only {
                    return Err(ioerr("the drive is read-only"));
                }
                if total % SECTOR_SIZE != 0 {
                    return Err(ioerr(format!(
                        "the data length {total} is not a multiple of {SECTOR_SIZE}"
                    )));
                }
                let end = sector.checked_add(total / SECTOR_SIZE);
                if end.is_none_or(|end| end > capacity) {
                    return Err(ioerr(format!(
                        "sectors {sector}+{} are past the end of the disk ({capacity} sectors)",
                        total / SECTOR_SIZE
                    )));
                }
                let mut pf = PositionedFile {
                    file,
                    offset: sector * SECTOR_SIZE,
                };
                for d in data {
                    let r = if is_read {
                        mem.read_exact_volatile_from(d.addr, &mut pf, d.len as usize)
                    } else {
                        mem.write_all_volatile_to(d.addr, &mut pf, d.len as usize)
                    };
                    r.map_err(|e| ioerr(format!("I/O on the image failed: {e}")))?;
                }
                if is_read {
                    counters.reads.fetch_add(1, Ordering::Relaxed);
                    counters.read_bytes.fetch_add(total, Ordering::Relaxed);
                    // `total` fits: every buffer is inside guest memory and the chain is
                    // at most 2^32 bytes (the chain iterator stops there).
                    Ok(u32::try_from(total).unwrap_or(u32::MAX))
                } else {
                    counters.writes.fetch_add(1, Ordering::Relaxed);
                    counters.write_bytes.fetch_add(total, Ordering::Relaxed);
                    Ok(0)
                }
            }
            VIRTIO_BLK_T_FLUSH => {
                if !read_only {
                    file.sync_data()
                        .map_err(|e| ioerr(format!("fdatasync failed: {e}")))?;
                }
                counters.flushes.fetch_add(1, Ordering::Relaxed);
                Ok(0)
            }
            VIRTIO_BLK_T_GET_ID => {
                let [d] = data else {
                    return Err(ioerr("GET_ID needs exactly one data buffer"));
                };
                if !d.write {
                    return Err(ioerr("the GET_ID buffer is not device-writable"));
                }
                let n = (d.len as usize).min(serial.len());
                mem.write_slice(&serial[..n], d.addr)
                    .map_err(|e| ioerr(format!("writing the serial failed: {e}")))?;
                counters.get_ids.fetch_add(1, Ordering::Relaxed);
                Ok(n as u32)
            }
            other => Err(Failure {
                status: VIRTIO_BLK_S_UNSUPP as u8,
                why: format!("request type {other} is not supported"),
            }),
        }
    }
}

impl VirtioDevice for Block {
    fn device_type(&self) -> u32 {
        VIRTIO_ID_BLOCK
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &[QUEUE_SIZE]
    }

    fn avail_features(&self) -> u64 {
        let mut f = (1u64 << VIRTIO_F_VERSION_1)
            | (1u64 << VIRTIO_BLK_F_FLUSH)
            | (1u64 << VIRTIO_BLK_F_SEG_MAX)
            | (1u64 << VIRTIO_RING_F_EVENT_IDX);
        if self.read_only {
            f |= 1u64 << VIRTIO_BLK_F_RO;
        }
        f
    }

    fn set_acked_features(&mut self, features: u64) {
        self.acked_features = features & self.avail_features();
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        let mut config = [0u8; CONFIG_LEN];
        config[0..8].copy_from_slice(&self.capacity.to_le_bytes());
        // size_max (bytes 8..12) is not offered and stays 0.
        config[12..16].copy_from_slice(&SEG_MAX.to_le_bytes());
        read_config_bytes(&config, offset, data);
    }

    fn write_config(&mut self, offset: u64, data: &[u8]) {
        tracing::debug!(
            offset,
            len = data.len(),
            "virtio-blk: ignored write to the read-only configuration"
        );
    }

    fn activate(&mut self, ctx: ActivateContext) -> Result<(), ActivateError> {
        check_inactive(&self.worker, format_args!("drive {}", self.id))?;
        let queue = ctx.into_single_queue()?;
        let requests = BlockRequests {
            file: self.file.clone(),
            read_only: self.read_only,
            capacity: self.capacity,
            serial: self.serial(),
            counters: self.counters.clone(),
        };
        // Thread names are limited to 15 bytes by the kernel; std truncates silently.
        let name = format!("virtio-blk-{}", self.id);
        self.worker = Some(RequestWorker::spawn(&name, queue, requests)?);
        Ok(())
    }

    fn deactivate(&mut self) -> Option<(Vec<Queue>, Vec<EventFd>)> {
        stop_worker(&mut self.worker).map(RequestWorker::into_queues)
    }

    fn metrics(&self) -> serde_json::Value {
        serde_json::to_value(Self::metrics(self)).unwrap_or_default()
    }
}

/// A drive's saved state: what it was, so a restore over another image is refused.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockState {
    pub id: String,
    pub path: PathBuf,
    pub read_only: bool,
    /// In sectors.
    pub capacity: u64,
}

impl Persist for Block {
    type State = BlockState;
    const STATE_VERSION: u32 = 1;
    const NAME: &'static str = "virtio-blk";

    fn save(&self) -> BlockState {
        BlockState {
            id: self.id.clone(),
            path: self.path.clone(),
            read_only: self.read_only,
            capacity: self.capacity,
        }
    }

    fn restore(&mut self, state: BlockState) -> Result<(), StateError> {
        if state.capacity != self.capacity {
            return Err(StateError::Invalid(format!(
                "drive {}: the snapshot saw {} sectors, the image now has {}; restore with the same image",
                self.id, state.capacity, self.capacity
            )));
        }
        if state.read_only != self.read_only {
            return Err(StateError::Invalid(format!(
                "drive {}: the snapshot's read_only was {}, the drive is now {}",
                self.id, state.read_only, self.read_only
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::virtio::VirtioInterrupt;
    use crate::devices::virtio::testing::{
        BadChain, Driver, guest_memory, is_dirty, rd, wait_for, wr,
    };
    use std::io::Write;
    use std::os::unix::fs::FileExt;
    use virtio_queue::QueueT;

    const MEM: usize = 0x40_0000;
    const SECTORS: u64 = 64;
    const HDR: u64 = 0x10_0000;
    const DATA: u64 = 0x11_0000;
    const STATUS: u64 = 0x12_0000;

    /// A raw image whose byte `i` of sector `s` is `(s * 7 + i) as u8`.
    fn image() -> tempfile::NamedTempFile {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        let mut buf = Vec::new();
        for s in 0..SECTORS {
            for i in 0..SECTOR_SIZE {
                buf.push((s * 7 + i) as u8);
            }
        }
        f.write_all(&buf).unwrap();
        f.flush().unwrap();
        f
    }

    fn sector_pattern(s: u64) -> Vec<u8> {
        (0..SECTOR_SIZE).map(|i| (s * 7 + i) as u8).collect()
    }

    /// A drive over a fresh [`image`], active on one 32-entry queue at guest address 0.
    struct Rig<'a> {
        img: tempfile::NamedTempFile,
        dev: Block,
        drv: Driver<'a>,
        notify: EventFd,
        line: Arc<EventFd>,
        used: u16,
    }

    impl<'a> Rig<'a> {
        fn new(mem: &'a GuestMemoryMmap, read_only: bool) -> Self {
            Self::with_queue(mem, read_only, |_| {})
        }

        /// As [`Rig::new`], with `tune` applied to the device's queue before activation.
        fn with_queue(
            mem: &'a GuestMemoryMmap,
            read_only: bool,
            tune: impl FnOnce(&mut Queue),
        ) -> Self {
            let img = image();
            let dev = Block::new("rootfs", img.path(), read_only).unwrap();
            let drv = Driver::new(mem, 0, 32);
            let mut queue = drv.queue();
            tune(&mut queue);
            let evt = EventFd::new(libc::EFD_NONBLOCK).unwrap();
            let mut rig = Self {
                img,
                dev,
                drv,
                notify: evt.try_clone().unwrap(),
                line: Arc::new(EventFd::new(libc::EFD_NONBLOCK).unwrap()),
                used: 0,
            };
            rig.activate(mem, queue, evt);
            rig
        }

        /// Activates the device on `queue`, notified through `evt`.
        fn activate(&mut self, mem: &GuestMemoryMmap, queue: Queue, evt: EventFd) {
            self.dev
                .activate(ActivateContext {
                    mem: mem.clone(),
                    interrupt: Arc::new(VirtioInterrupt::new(self.line.clone())),
                    queues: vec![queue],
                    queue_events: vec![evt],
                })
                .unwrap();
        }

        /// Offers a chain, notifies, waits for it; returns the used length.
        fn submit(
            &mut self,
            mem: &GuestMemoryMmap,
            descs: &[crate::devices::virtio::testing::D],
        ) -> u32 {
            mem.write_obj(0xffu8, GuestAddress(STATUS)).unwrap();
            self.drv.add(descs);
            self.kick()
        }

        fn kick(&mut self) -> u32 {
            self.notify.write(1).unwrap();
            self.used += 1;
            self.drv.wait_used(self.used).len()
        }
    }

    fn header(mem: &GuestMemoryMmap, req: u32, sector: u64) {
        mem.write_obj(req.to_le(), GuestAddress(HDR)).unwrap();
        mem.write_obj(0u32, GuestAddress(HDR + 4)).unwrap();
        mem.write_obj(sector.to_le(), GuestAddress(HDR + 8))
            .unwrap();
    }

    fn status(mem: &GuestMemoryMmap) -> u8 {
        mem.read_obj(GuestAddress(STATUS)).unwrap()
    }

    fn read_req(rig: &mut Rig, mem: &GuestMemoryMmap, sector: u64, sectors: u32) -> (u32, u8) {
        header(mem, VIRTIO_BLK_T_IN, sector);
        let r = rig.submit(mem, &[rd(HDR, 16), wr(DATA, sectors * 512), wr(STATUS, 1)]);
        (r, status(mem))
    }

    #[test]
    fn blk_reads_sectors_from_the_image_and_marks_the_pages_dirty() {
        let mem = guest_memory(MEM);
        let mut rig = Rig::new(&mem, true);
        // Two data buffers: sector 3, then sectors 4..6.
        header(&mem, VIRTIO_BLK_T_IN, 3);
        let len = rig.submit(
            &mem,
            &[
                rd(HDR, 16),
                wr(DATA, 512),
                wr(DATA + 0x1000, 1024),
                wr(STATUS, 1),
            ],
        );
        assert_eq!(len, 1536 + 1);
        assert_eq!(status(&mem), VIRTIO_BLK_S_OK as u8);
        let mut got = vec![0u8; 512];
        mem.read_slice(&mut got, GuestAddress(DATA)).unwrap();
        assert_eq!(got, sector_pattern(3));
        let mut got = vec![0u8; 1024];
        mem.read_slice(&mut got, GuestAddress(DATA + 0x1000))
            .unwrap();
        assert_eq!(got[..512], sector_pattern(4)[..]);
        assert_eq!(got[512..], sector_pattern(5)[..]);
        assert!(is_dirty(&mem, DATA) && is_dirty(&mem, DATA + 0x1000));
        assert!(is_dirty(&mem, STATUS));
        assert_eq!(rig.line.read().unwrap(), 1, "used-buffer interrupt raised");
        let m = rig.dev.metrics();
        assert_eq!((m.reads, m.read_bytes, m.errors), (1, 1536, 0));
        let as_json = VirtioDevice::metrics(&rig.dev);
        assert_eq!(
            as_json["read_bytes"], 1536,
            "the trait's metrics are the same counters"
        );
    }

    #[test]
    fn blk_writes_reach_the_image_and_flush_succeeds() {
        let mem = guest_memory(MEM);
        let mut rig = Rig::new(&mem, false);
        assert_eq!(rig.dev.avail_features() & (1 << VIRTIO_BLK_F_RO), 0);
        let payload: Vec<u8> = (0..1024u32).map(|i| (i * 13 % 251) as u8).collect();
        mem.write_slice(&payload, GuestAddress(DATA)).unwrap();
        header(&mem, VIRTIO_BLK_T_OUT, 10);
        let len = rig.submit(&mem, &[rd(HDR, 16), rd(DATA, 1024), wr(STATUS, 1)]);
        assert_eq!(len, 1);
        assert_eq!(status(&mem), VIRTIO_BLK_S_OK as u8);
        let mut on_disk = vec![0u8; 1024];
        rig.img
            .as_file()
            .read_exact_at(&mut on_disk, 10 * 512)
            .unwrap();
        assert_eq!(on_disk, payload);
        // Neighbours untouched.
        let mut s9 = vec![0u8; 512];
        rig.img.as_file().read_exact_at(&mut s9, 9 * 512).unwrap();
        assert_eq!(s9, sector_pattern(9));

        header(&mem, VIRTIO_BLK_T_FLUSH, 0);
        let len = rig.submit(&mem, &[rd(HDR, 16), wr(STATUS, 1)]);
        assert_eq!(len, 1);
        assert_eq!(status(&mem), VIRTIO_BLK_S_OK as u8);

        // Read back through the device.
        let (len, st) = read_req(&mut rig, &mem, 10, 2);
        assert_eq!((len, st), (1025, VIRTIO_BLK_S_OK as u8));
        let mut back = vec![0u8; 1024];
        mem.read_slice(&mut back, GuestAddress(DATA)).unwrap();
        assert_eq!(back, payload);
        let m = rig.dev.metrics();
        assert_eq!(
            (m.writes, m.write_bytes, m.flushes, m.reads),
            (1, 1024, 1, 1)
        );
    }

    #[test]
    fn blk_get_id_returns_the_drive_id() {
        let mem = guest_memory(MEM);
        let mut rig = Rig::new(&mem, true);
        mem.write_slice(&[0xaa; 20], GuestAddress(DATA)).unwrap();
        header(&mem, VIRTIO_BLK_T_GET_ID, 0);
        let len = rig.submit(&mem, &[rd(HDR, 16), wr(DATA, 20), wr(STATUS, 1)]);
        assert_eq!(len, 21);
        assert_eq!(status(&mem), VIRTIO_BLK_S_OK as u8);
        let mut id = [0u8; 20];
        mem.read_slice(&mut id, GuestAddress(DATA)).unwrap();
        assert_eq!(&id[..6], b"rootfs");
        assert_eq!(id[6..], [0u8; 14], "the serial is zero padded");
        assert_eq!(rig.dev.metrics().get_ids, 1);
    }

    #[test]
    fn blk_read_only_drive_offers_ro_and_refuses_writes() {
        let mem = guest_memory(MEM);
        let mut rig = Rig::new(&mem, true);
        assert_ne!(rig.dev.avail_features() & (1 << VIRTIO_BLK_F_RO), 0);
        mem.write_slice(&[0x55; 512], GuestAddress(DATA)).unwrap();
        header(&mem, VIRTIO_BLK_T_OUT, 0);
        let len = rig.submit(&mem, &[rd(HDR, 16), rd(DATA, 512), wr(STATUS, 1)]);
        assert_eq!(len, 1);
        assert_eq!(status(&mem), VIRTIO_BLK_S_IOERR as u8);
        let mut s0 = vec![0u8; 512];
        rig.img.as_file().read_exact_at(&mut s0, 0).unwrap();
        assert_eq!(s0, sector_pattern(0), "the image is unchanged");
        assert_eq!(rig.dev.metrics().errors, 1);
        assert_eq!(rig.dev.metrics().writes, 0);
    }

    #[test]
    fn blk_refuses_ranges_past_the_capacity_and_partial_sectors() {
        let mem = guest_memory(MEM);
        let mut rig = Rig::new(&mem, false);
        // Last sector: fine.
        assert_eq!(
            read_req(&mut rig, &mem, SECTORS - 1, 1).1,
            VIRTIO_BLK_S_OK as u8
        );
        // One past the end.
        assert_eq!(
            read_req(&mut rig, &mem, SECTORS - 1, 2).1,
            VIRTIO_BLK_S_IOERR as u8
        );
        assert_eq!(
            read_req(&mut rig, &mem, u64::MAX, 1).1,
            VIRTIO_BLK_S_IOERR as u8
        );
        // Not a multiple of 512.
        header(&mem, VIRTIO_BLK_T_IN, 0);
        rig.submit(&mem, &[rd(HDR, 16), wr(DATA, 100), wr(STATUS, 1)]);
        assert_eq!(status(&mem), VIRTIO_BLK_S_IOERR as u8);
        // An unknown request type.
        header(&mem, 0x77, 0);
        rig.submit(&mem, &[rd(HDR, 16), wr(STATUS, 1)]);
        assert_eq!(status(&mem), VIRTIO_BLK_S_UNSUPP as u8);
        assert_eq!(rig.dev.metrics().errors, 4);
        assert_eq!(rig.dev.metrics().reads, 1);
    }

    #[test]
    fn malformed_blk_chains_fail_alone_and_the_worker_serves_the_next_request() {
        let mem = guest_memory(MEM);
        let mut rig = Rig::new(&mem, false);
        // (what, chain, expected used len, expected status if written)
        let bad: [(BadChain, u32, Option<u32>); 9] = [
            (
                ("a loop", |d| {
                    d.add_loop(&[rd(HDR, 16), wr(DATA, 512), wr(STATUS, 1)]);
                }),
                0,
                None,
            ),
            (
                ("a next index past the table", |d| {
                    d.add_dangling(rd(HDR, 16));
                }),
                0,
                None,
            ),
            (
                ("a data buffer outside guest memory", |d| {
                    d.add(&[rd(HDR, 16), wr(MEM as u64 + 0x1000, 512), wr(STATUS, 1)]);
                }),
                1,
                Some(VIRTIO_BLK_S_IOERR),
            ),
            (
                ("an oversized data length", |d| {
                    d.add(&[rd(HDR, 16), wr(DATA, u32::MAX - 511), wr(STATUS, 1)]);
                }),
                1,
                Some(VIRTIO_BLK_S_IOERR),
            ),
            (
                ("too short: status only", |d| {
                    d.add(&[wr(STATUS, 1)]);
                }),
                1,
                Some(VIRTIO_BLK_S_IOERR),
            ),
            (
                ("too short: header smaller than 16 bytes", |d| {
                    d.add(&[rd(HDR, 8), wr(DATA, 512), wr(STATUS, 1)]);
                }),
                1,
                Some(VIRTIO_BLK_S_IOERR),
            ),
            (
                ("wrong direction: read into a device-readable buffer", |d| {
                    d.add(&[rd(HDR, 16), rd(DATA, 512), wr(STATUS, 1)]);
                }),
                1,
                Some(VIRTIO_BLK_S_IOERR),
            ),
            (
                ("wrong direction: read-only status", |d| {
                    d.add(&[rd(HDR, 16), wr(DATA, 512), rd(STATUS, 1)]);
                }),
                0,
                None,
            ),
            (
                ("status outside guest memory", |d| {
                    d.add(&[rd(HDR, 16), wr(DATA, 512), wr(MEM as u64, 1)]);
                }),
                0,
                None,
            ),
        ];
        for (i, ((what, add_bad), want_len, want_status)) in bad.iter().enumerate() {
            header(&mem, VIRTIO_BLK_T_IN, 2);
            mem.write_obj(0xffu8, GuestAddress(STATUS)).unwrap();
            add_bad(&mut rig.drv);
            let len = rig.kick();
            assert_eq!(len, *want_len, "{what}: used length");
            match want_status {
                Some(s) => assert_eq!(u32::from(status(&mem)), *s, "{what}: status"),
                None => assert_eq!(status(&mem), 0xff, "{what}: no status written"),
            }
            assert_eq!(rig.dev.metrics().errors, i as u64 + 1, "{what}: counted");
            assert!(rig.dev.is_running(), "{what}: the worker is alive");
            let (len, st) = read_req(&mut rig, &mem, 7, 1);
            assert_eq!(
                (len, st),
                (513, VIRTIO_BLK_S_OK as u8),
                "good read after {what}"
            );
            let mut got = vec![0u8; 512];
            mem.read_slice(&mut got, GuestAddress(DATA)).unwrap();
            assert_eq!(got, sector_pattern(7));
        }
        assert_eq!(rig.dev.metrics().reads, bad.len() as u64);
    }

    #[test]
    fn blk_config_space_holds_the_capacity() {
        let img = image();
        let dev = Block::new("d", img.path(), true).unwrap();
        let mut cap = [0u8; 8];
        dev.read_config(0, &mut cap);
        assert_eq!(u64::from_le_bytes(cap), SECTORS);
        let mut hi = [0xffu8; 4];
        dev.read_config(4, &mut hi);
        assert_eq!(hi, [0; 4]);
        let mut seg_max = [0u8; 4];
        dev.read_config(12, &mut seg_max);
        assert_eq!(u32::from_le_bytes(seg_max), SEG_MAX);
        assert_ne!(dev.avail_features() & (1 << VIRTIO_BLK_F_SEG_MAX), 0);
        let mut past = [0xffu8; 4];
        dev.read_config(20, &mut past);
        assert_eq!(past, [0; 4]);
        dev.read_config(u64::MAX, &mut past);
        assert_eq!(past, [0; 4]);
    }

    #[test]
    fn blk_deactivate_hands_back_the_queue_and_pending_requests_are_served_on_activate() {
        let mem = guest_memory(MEM);
        let mut rig = Rig::new(&mem, true);
        read_req(&mut rig, &mem, 1, 1);
        let (mut queues, mut events) = rig.dev.deactivate().unwrap();
        assert!(!rig.dev.is_running());
        assert_eq!(queues[0].next_avail(), 1);
        assert_eq!(queues[0].next_used(), 1);
        // A request the guest queued while the device was stopped (as across a snapshot).
        header(&mem, VIRTIO_BLK_T_IN, 2);
        rig.drv.add(&[rd(HDR, 16), wr(DATA, 512), wr(STATUS, 1)]);
        rig.activate(&mem, queues.remove(0), events.remove(0));
        assert_eq!(rig.drv.wait_used(2).len(), 513);
        let mut got = vec![0u8; 512];
        mem.read_slice(&mut got, GuestAddress(DATA)).unwrap();
        assert_eq!(got, sector_pattern(2));
        rig.dev.deactivate().unwrap();
    }

    #[test]
    fn blk_open_errors_say_what_is_wrong() {
        let err = Block::new("d", Path::new("/nonexistent/disk.img"), true)
            .err()
            .unwrap();
        assert!(matches!(err, BlockError::Open { .. }));
        assert!(err.to_string().contains("/nonexistent/disk.img"));
        let small = tempfile::NamedTempFile::new().unwrap();
        small.as_file().write_all_at(&[1; 100], 0).unwrap();
        let err = Block::new("d", small.path(), true).err().unwrap();
        assert!(matches!(err, BlockError::TooSmall { len: 100, .. }));
    }

    #[test]
    fn blk_restore_refuses_another_image_size() {
        let img = image();
        let dev = Block::new("d", img.path(), false).unwrap();
        let mut state = dev.save();
        let mut dev2 = Block::new("d", img.path(), false).unwrap();
        dev2.restore(state.clone()).unwrap();
        state.capacity = SECTORS + 1;
        let e = dev2.restore(state).unwrap_err();
        assert!(e.to_string().contains("same image"), "{e}");
    }

    #[test]
    fn blk_behind_the_transport_keeps_its_ring_positions_across_save_and_restore() {
        use crate::devices::BusDevice;
        use crate::devices::virtio::mmio::{MmioTransport, MmioTransportState};
        use crate::devices::virtio::testing::mmio_bring_up;
        use std::sync::Mutex;

        let img = image();
        let mem = guest_memory(MEM);
        let mut drv = Driver::new(&mem, 0x20_0000, 32);
        let line = Arc::new(EventFd::new(libc::EFD_NONBLOCK).unwrap());
        let dev = Arc::new(Mutex::new(Block::new("vda", img.path(), false).unwrap()));
        let mut t = MmioTransport::new(mem.clone(), dev.clone(), line.clone()).unwrap();
        let features = dev.lock().unwrap().avail_features();
        mmio_bring_up(&mut t, features, &[&drv]);
        assert!(t.is_activated());

        header(&mem, VIRTIO_BLK_T_IN, 1);
        drv.add(&[rd(HDR, 16), wr(DATA, 512), wr(STATUS, 1)]);
        t.write(0x50, &0u32.to_le_bytes());
        assert_eq!(drv.wait_used(1).len(), 513);

        let state = t.save_state().unwrap();
        let state: MmioTransportState =
            serde_json::from_str(&serde_json::to_string(&state).unwrap()).unwrap();
        assert_eq!(state.queues[0].next_avail, 1);
        drop(t);
        assert!(
            !dev.lock().unwrap().is_running(),
            "dropping the transport stops the worker"
        );

        // A fresh device and transport over the same memory and image.
        let dev2 = Arc::new(Mutex::new(Block::new("vda", img.path(), false).unwrap()));
        let mut t2 = MmioTransport::new(mem.clone(), dev2.clone(), line).unwrap();
        t2.restore_state(&state).unwrap();
        assert!(t2.is_activated());
        header(&mem, VIRTIO_BLK_T_IN, 2);
        let head = drv.add(&[rd(HDR, 16), wr(DATA, 512), wr(STATUS, 1)]);
        t2.write(0x50, &0u32.to_le_bytes());
        let used = drv.wait_used(2);
        assert_eq!((used.id(), used.len()), (u32::from(head), 513));
        let mut got = vec![0u8; 512];
        mem.read_slice(&mut got, GuestAddress(DATA)).unwrap();
        assert_eq!(
            got,
            sector_pattern(2),
            "the restored device served the new request only"
        );
        assert_eq!(dev2.lock().unwrap().metrics().reads, 1);
    }

    #[test]
    fn blk_with_event_idx_interrupts_only_when_the_driver_asks() {
        let mem = guest_memory(MEM);
        let mut rig = Rig::with_queue(&mem, true, |q| q.set_event_idx(true));
        let (_, avail, used) = rig.drv.addrs();
        let used_event = GuestAddress(avail + 4 + 2 * 32);
        let avail_event = GuestAddress(used + 4 + 8 * 32);
        assert_ne!(rig.dev.avail_features() & (1 << VIRTIO_RING_F_EVENT_IDX), 0);
        let line = rig.line.clone();
        let submit = |rig: &mut Rig, n: u16, want_irq_after: u16| {
            mem.write_obj(want_irq_after, used_event).unwrap();
            header(&mem, VIRTIO_BLK_T_IN, u64::from(n));
            rig.submit(&mem, &[rd(HDR, 16), wr(DATA, 512), wr(STATUS, 1)]);
        };
        // used_event 0: the driver wants an interrupt once used passes 0.
        submit(&mut rig, 1, 0);
        wait_for("the first interrupt", || line.read().is_ok());
        // The device asks to be kicked for the next chain after what it consumed.
        assert_eq!(mem.read_obj::<u16>(avail_event).unwrap(), 1);
        // used_event 10: no interrupt for the second request.
        submit(&mut rig, 2, 10);
        // used_event 2: an interrupt for the third. Had the second raised one, the line's
        // counter would now read 2.
        submit(&mut rig, 3, 2);
        let mut count = 0;
        wait_for("the third interrupt", || {
            count = line.read().unwrap_or(0);
            count > 0
        });
        assert_eq!(count, 1, "the second request raised no interrupt");
        assert_eq!(mem.read_obj::<u16>(avail_event).unwrap(), 3);
        rig.dev.deactivate().unwrap();
    }
}

#[cfg(test)]
mod proptests {
    //! The request queue of a hostile driver against the block device.

    use std::io::Write;

    use proptest::collection::vec;
    use proptest::prelude::*;

    use super::*;
    use crate::devices::virtio::VirtioInterrupt;
    use crate::devices::virtio::hostile::{self, BufGen, ByteSet, ChainGen, Snapshot};
    use crate::devices::virtio::queue_util::{drain_queue, notify_used};

    const SECTORS: u64 = 64;

    /// A request header: type, reserved, sector.
    fn header_bytes(req: u32, sector: u64) -> Vec<u8> {
        let mut h = req.to_le_bytes().to_vec();
        h.extend_from_slice(&[0; 4]);
        h.extend_from_slice(&sector.to_le_bytes());
        h
    }

    /// Mostly requests shaped like one: a readable header of a known type, data buffers
    /// mostly in the direction the type wants, a writable status byte.
    fn request() -> BoxedStrategy<ChainGen> {
        let req_type = prop_oneof![
            4 => Just(VIRTIO_BLK_T_IN),
            3 => Just(VIRTIO_BLK_T_OUT),
            1 => Just(VIRTIO_BLK_T_FLUSH),
            1 => Just(VIRTIO_BLK_T_GET_ID),
            1 => any::<u32>(),
        ];
        let sector = prop_oneof![
            8 => 0..SECTORS / 2,
            2 => SECTORS / 2..SECTORS,
            1 => Just(SECTORS - 1),
            1 => Just(SECTORS),
            1 => Just(u64::MAX),
            1 => any::<u64>(),
        ];
        let request =
            (req_type, sector).prop_flat_map(|(req, sector)| {
                let header_len = prop_oneof![6 => Just(HEADER_LEN), 1 => hostile::any_len()];
                let header = hostile::buf(hostile::pinned_addr(), header_len.boxed(), 0.05)
                    .prop_map(move |b| BufGen {
                        content: header_bytes(req, sector),
                        ..b
                    });
                let write = match req {
                    VIRTIO_BLK_T_OUT => 0.1,
                    _ => 0.9,
                };
                let data_len = prop_oneof![
                    6 => (1u32..=8).prop_map(|s| s * SECTOR_SIZE as u32),
                    1 => Just(VIRTIO_BLK_ID_BYTES),
                    1 => hostile::any_len(),
                ];
                let data = hostile::buf(hostile::data_addr(), data_len.boxed(), write);
                let status = hostile::buf(hostile::data_addr(), hostile::len_or(1), 0.95);
                (header, vec(data, 0..3), status).prop_map(|(h, data, s)| {
                    let mut bufs = vec![h];
                    bufs.extend(data);
                    bufs.push(s);
                    bufs
                })
            });
        hostile::mostly_plain(request.boxed(), 0.5)
    }

    fn image() -> tempfile::NamedTempFile {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        let bytes: Vec<u8> = (0..SECTORS * SECTOR_SIZE)
            .map(|i| (i * 7 % 251) as u8)
            .collect();
        f.write_all(&bytes).unwrap();
        f
    }

    proptest! {
        #![proptest_config(hostile::config())]

        #[test]
        fn block_requests_from_any_queue_never_panic_or_touch_memory_outside_the_descriptors(
            q in hostile::queue(request()),
            read_only: bool,
            seed: u64,
        ) {
            let mem = hostile::guest_memory();
            hostile::fill(&mem, seed);
            let (queue, layout) = q.build(&mem, 0);
            let offered = hostile::offered(&mem, &layout);
            let img = image();
            let image_before = std::fs::read(img.path()).unwrap();
            let file = OpenOptions::new().read(true).write(!read_only).open(img.path()).unwrap();
            let requests = BlockRequests {
                file: Arc::new(file),
                read_only,
                capacity: SECTORS,
                serial: *b"hostile-guest-drive\0",
                counters: Arc::new(Counters::default()),
            };
            let counters = requests.counters.clone();
            let snapshot = Snapshot::take(&mem);

            let m = mem.clone();
            let line = Arc::new(EventFd::new(libc::EFD_NONBLOCK).unwrap());
            let interrupt = VirtioInterrupt::new(line);
            hostile::bounded(move || {
                let mut queue = queue;
                drain_queue(&mut queue, &m, |chain| requests.handle(chain, &m));
                notify_used(&mut queue, &m, &interrupt);
            });

            // Every request is completed: the ones with a writable status byte in guest
            // memory report the status byte and the data they were given, the others
            // nothing; a failed request writes its status byte only.
            let used = hostile::used(&mem, &layout, &offered)?;
            let returnable = offered.iter().filter(|c| c.head < layout.size).count();
            prop_assert_eq!(used.len(), returnable, "a request was left on the ring");
            let mut allowed = ByteSet::default();
            hostile::allow_used_ring(&mut allowed, &layout);
            for (len, chain) in &used {
                let status = chain
                    .descs
                    .last()
                    .filter(|d| d.write && d.len >= 1 && hostile::in_memory(&mem, d.addr, 1));
                let Some(status) = status.filter(|_| chain.terminated) else {
                    prop_assert_eq!(*len, 0, "a chain without a status byte reports bytes: {:?}", chain);
                    continue;
                };
                prop_assert!(*len >= 1, "the status byte was not reported: {:?}", chain);
                prop_assert!(
                    u64::from(*len) <= chain.writable_len(),
                    "used length {} exceeds the {} device-writable bytes of {:?}",
                    len, chain.writable_len(), chain
                );
                for (addr, n) in chain.writable_prefix(u64::from(*len) - 1) {
                    allowed.insert(addr, n);
                }
                allowed.insert(status.addr, 1);
            }
            snapshot.changes(&mem).check(&allowed, true)?;

            let c = |a: &AtomicU64| a.load(Ordering::Relaxed);
            let m = &counters;
            let accounted = c(&m.reads) + c(&m.writes) + c(&m.flushes) + c(&m.get_ids) + c(&m.errors);
            prop_assert_eq!(accounted, offered.len() as u64, "every request is counted once");
            let image_after = std::fs::read(img.path()).unwrap();
            prop_assert_eq!(image_after.len(), image_before.len(), "the image changed size");
            if read_only {
                prop_assert!(image_after == image_before, "a read-only image was written");
            }
        }
    }
}
