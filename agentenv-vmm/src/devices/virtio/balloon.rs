//! virtio-balloon: memory the guest gives back (inflate) and takes again (deflate), and the
//! guest's memory statistics.
//!
//! * Inflate queue: buffers of little-endian u32 page frame numbers (4 KiB pages). Each page
//!   inside guest memory is released on the host with `madvise(MADV_DONTNEED)` on its host
//!   mapping (contiguous pages in one call); the guest reads zeros there afterwards (private
//!   anonymous memory) and the host's resident memory drops. A frame number outside guest
//!   memory is ignored and counted.
//! * Deflate queue: acknowledged (the guest may use those pages again; they fault in fresh).
//! * Stats queue (`VIRTIO_BALLOON_F_STATS_VQ`, offered when a polling interval is set): the
//!   driver hands over a buffer of `{u16 tag, u64 value}` entries; the device parses it,
//!   keeps it, and gives it back every interval (or on [`Balloon::request_stats`]) so the
//!   driver refills it with fresh numbers.
//! * Configuration: `num_pages` (the target, set by the host through
//!   [`Balloon::set_target_mib`], which raises a configuration-change interrupt) and
//!   `actual` (written by the driver).

use std::os::unix::io::AsRawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::virtio_ids::VIRTIO_ID_BALLOON;
use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryRegion};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::eventfd::EventFd;
use vmm_sys_util::timerfd::TimerFd;

use super::persist::{Persist, StateError};
use super::queue_util::{Desc, add_used, collect_chain, notify_used};
use super::worker::{Worker, WorkerCtl, WorkerHandler, stop_worker};
use super::{
    ActivateContext, ActivateError, VirtioDevice, VirtioInterrupt, check_inactive,
    read_config_bytes,
};
use crate::memory::GuestMemoryMmap;
use crate::sync::lock;

/// Feature: the device has a statistics queue.
pub const VIRTIO_BALLOON_F_STATS_VQ: u32 = 1;
/// Feature: the guest deflates the balloon when it runs out of memory.
pub const VIRTIO_BALLOON_F_DEFLATE_ON_OOM: u32 = 2;
/// The balloon's page size (frame numbers are in these units).
pub const BALLOON_PAGE_SIZE: u64 = 4096;
const PFN_SHIFT: u32 = 12;
const PAGES_PER_MIB: u64 = (1 << 20) / BALLOON_PAGE_SIZE;
/// Entries of each queue.
pub const QUEUE_SIZE: u16 = 256;
/// Bytes of the configuration space we answer: `num_pages`, `actual`.
const CONFIG_LEN: usize = 8;
/// Size of one statistics entry: u16 tag + u64 value, packed.
const STAT_ENTRY_LEN: usize = 10;
/// A page list longer than this is refused (the Linux driver sends at most 256 frames).
const MAX_PFN_LIST_BYTES: u64 = 1 << 20;
/// A statistics buffer larger than this is read only up to here.
const MAX_STATS_BYTES: usize = 4096;

const INFLATE: usize = 0;
const DEFLATE: usize = 1;
const STATS: usize = 2;
const TOKEN_TIMER: u64 = 100;
const TOKEN_STATS_REQUEST: u64 = 101;

/// Errors of the balloon's host-side controls.
#[derive(Debug, thiserror::Error)]
pub enum BalloonError {
    #[error("balloon target {mib} MiB is too large (at most {max} MiB)")]
    TargetTooLarge { mib: u64, max: u64 },
    #[error("the balloon has no statistics: set stats_polling_interval_s above 0")]
    StatsDisabled,
    #[error("creating the balloon's statistics event failed: {0}")]
    Event(std::io::Error),
    #[error("signalling the guest failed: {0}")]
    Signal(std::io::Error),
}

/// The guest's memory statistics as last reported, with the balloon's own sizes. A field
/// the guest did not report is `None`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct BalloonStats {
    /// Target size of the balloon (pages the guest should give back).
    pub target_pages: u32,
    /// Pages the guest says it has given back.
    pub actual_pages: u32,
    pub target_mib: u32,
    pub actual_mib: u32,
    /// How many statistics buffers the guest has delivered.
    pub updates: u64,
    pub swap_in: Option<u64>,
    pub swap_out: Option<u64>,
    pub major_faults: Option<u64>,
    pub minor_faults: Option<u64>,
    pub free_memory: Option<u64>,
    pub total_memory: Option<u64>,
    pub available_memory: Option<u64>,
    pub disk_caches: Option<u64>,
    pub hugetlb_allocations: Option<u64>,
    pub hugetlb_failures: Option<u64>,
    pub oom_kills: Option<u64>,
    pub alloc_stalls: Option<u64>,
    pub async_scans: Option<u64>,
    pub direct_scans: Option<u64>,
    pub async_reclaims: Option<u64>,
    pub direct_reclaims: Option<u64>,
}

impl BalloonStats {
    /// Records one `{tag, value}` entry (virtio 1.2, 5.5.6.3); unknown tags are ignored.
    fn set(&mut self, tag: u16, value: u64) {
        let slot = match tag {
            0 => &mut self.swap_in,
            1 => &mut self.swap_out,
            2 => &mut self.major_faults,
            3 => &mut self.minor_faults,
            4 => &mut self.free_memory,
            5 => &mut self.total_memory,
            6 => &mut self.available_memory,
            7 => &mut self.disk_caches,
            8 => &mut self.hugetlb_allocations,
            9 => &mut self.hugetlb_failures,
            10 => &mut self.oom_kills,
            11 => &mut self.alloc_stalls,
            12 => &mut self.async_scans,
            13 => &mut self.direct_scans,
            14 => &mut self.async_reclaims,
            15 => &mut self.direct_reclaims,
            _ => return,
        };
        *slot = Some(value);
    }

    /// Parses a statistics buffer into a fresh set of guest fields.
    fn parse(bytes: &[u8]) -> Self {
        let mut s = Self::default();
        for entry in bytes.chunks_exact(STAT_ENTRY_LEN) {
            let tag = u16::from_le_bytes([entry[0], entry[1]]);
            let mut v = [0u8; 8];
            v.copy_from_slice(&entry[2..10]);
            s.set(tag, u64::from_le_bytes(v));
        }
        s
    }
}

/// Counters of the balloon.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct BalloonMetrics {
    /// Pages released to the host by inflation.
    pub inflated_pages: u64,
    /// Pages the guest took back by deflation.
    pub deflated_pages: u64,
    /// Frame numbers outside guest memory (ignored).
    pub invalid_pfns: u64,
    /// `madvise` calls that failed.
    pub release_failures: u64,
    /// Statistics buffers received.
    pub stats_updates: u64,
    /// Malformed chains (loop, outside guest memory, wrong direction).
    pub errors: u64,
}

#[derive(Default)]
struct Counters {
    inflated_pages: AtomicU64,
    deflated_pages: AtomicU64,
    invalid_pfns: AtomicU64,
    release_failures: AtomicU64,
    stats_updates: AtomicU64,
    errors: AtomicU64,
}

/// The guest-reported statistics, shared with the worker.
type SharedStats = Arc<Mutex<BalloonStats>>;

/// The virtio memory balloon.
pub struct Balloon {
    num_pages: u32,
    actual: u32,
    deflate_on_oom: bool,
    stats_interval: Duration,
    queue_sizes: Vec<u16>,
    acked_features: u64,
    stats: SharedStats,
    counters: Arc<Counters>,
    /// Asks the worker to hand the statistics buffer back now.
    stats_request: EventFd,
    /// The statistics buffer the device holds (across deactivation and snapshots).
    stats_head: Option<u16>,
    interrupt: Option<Arc<VirtioInterrupt>>,
    worker: Option<Worker<BalloonWorker>>,
}

impl Balloon {
    /// A balloon whose initial target is `amount_mib`. A `stats_interval_s` above 0 offers
    /// the statistics queue and asks the guest for fresh statistics at that interval.
    pub fn new(
        amount_mib: u64,
        deflate_on_oom: bool,
        stats_interval_s: u16,
    ) -> Result<Self, BalloonError> {
        let num_pages = mib_to_pages(amount_mib)?;
        let queue_sizes = if stats_interval_s > 0 {
            vec![QUEUE_SIZE; 3]
        } else {
            vec![QUEUE_SIZE; 2]
        };
        Ok(Self {
            num_pages,
            actual: 0,
            deflate_on_oom,
            stats_interval: Duration::from_secs(u64::from(stats_interval_s)),
            queue_sizes,
            acked_features: 0,
            stats: Arc::new(Mutex::new(BalloonStats::default())),
            counters: Arc::new(Counters::default()),
            stats_request: EventFd::new(libc::EFD_NONBLOCK).map_err(BalloonError::Event)?,
            stats_head: None,
            interrupt: None,
            worker: None,
        })
    }

    /// Sets the balloon's target and tells the driver (configuration-change interrupt when
    /// the device is active; an inactive driver reads it when it starts).
    pub fn set_target_mib(&mut self, mib: u64) -> Result<(), BalloonError> {
        self.num_pages = mib_to_pages(mib)?;
        if let Some(interrupt) = &self.interrupt {
            interrupt
                .signal_config_change()
                .map_err(BalloonError::Signal)?;
        }
        Ok(())
    }

    /// The target in MiB.
    pub fn target_mib(&self) -> u64 {
        u64::from(self.num_pages) / PAGES_PER_MIB
    }

    /// The latest statistics and the balloon's sizes.
    pub fn stats(&self) -> BalloonStats {
        let mut s = lock(&self.stats).clone();
        s.target_pages = self.num_pages;
        s.actual_pages = self.actual;
        s.target_mib = (u64::from(self.num_pages) / PAGES_PER_MIB) as u32;
        s.actual_mib = (u64::from(self.actual) / PAGES_PER_MIB) as u32;
        s
    }

    /// Asks the guest for fresh statistics now (besides the interval).
    pub fn request_stats(&self) -> Result<(), BalloonError> {
        if self.queue_sizes.len() <= STATS {
            return Err(BalloonError::StatsDisabled);
        }
        self.stats_request.write(1).map_err(BalloonError::Signal)
    }

    pub fn metrics(&self) -> BalloonMetrics {
        let c = &self.counters;
        BalloonMetrics {
            inflated_pages: c.inflated_pages.load(Ordering::Relaxed),
            deflated_pages: c.deflated_pages.load(Ordering::Relaxed),
            invalid_pfns: c.invalid_pfns.load(Ordering::Relaxed),
            release_failures: c.release_failures.load(Ordering::Relaxed),
            stats_updates: c.stats_updates.load(Ordering::Relaxed),
            errors: c.errors.load(Ordering::Relaxed),
        }
    }

    /// Whether the worker thread is serving the queues.
    pub fn is_running(&self) -> bool {
        self.worker.as_ref().is_some_and(|w| w.is_running())
    }

    fn stats_enabled(&self) -> bool {
        self.queue_sizes.len() > STATS
    }
}

fn mib_to_pages(mib: u64) -> Result<u32, BalloonError> {
    mib.checked_mul(PAGES_PER_MIB)
        .and_then(|p| u32::try_from(p).ok())
        .ok_or(BalloonError::TargetTooLarge {
            mib,
            max: u64::from(u32::MAX) / PAGES_PER_MIB,
        })
}

/// A run of contiguous host pages inside one guest memory region.
#[derive(Clone, Copy)]
struct HostRun {
    start: usize,
    len: usize,
    /// Guest address of the region, so a run never spans two regions.
    region: u64,
    shared_file: bool,
}

impl HostRun {
    fn extends_to(&self, page: &HostRun) -> bool {
        self.region == page.region && self.start + self.len == page.start
    }
}

struct BalloonWorker {
    queues: Vec<Queue>,
    events: Vec<EventFd>,
    mem: GuestMemoryMmap,
    interrupt: Arc<VirtioInterrupt>,
    counters: Arc<Counters>,
    stats: SharedStats,
    stats_head: Option<u16>,
    stats_enabled: bool,
    timer: Option<TimerFd>,
    stats_request: EventFd,
}

impl BalloonWorker {
    /// Pops every chain of `queue`, hands its checked, device-readable descriptors to `f`,
    /// and returns the chains (length 0).
    fn drain(&mut self, index: usize, mut f: impl FnMut(&mut Self, &[Desc])) {
        let mut used_any = false;
        loop {
            let mem = self.mem.clone();
            let Some(chain) = self.queues[index].pop_descriptor_chain(&mem) else {
                break;
            };
            let head = chain.head_index();
            match collect_chain(chain, &mem) {
                Ok(descs)
                    if descs.iter().all(|d| !d.write && d.len % 4 == 0)
                        && descs.iter().map(|d| u64::from(d.len)).sum::<u64>()
                            <= MAX_PFN_LIST_BYTES =>
                {
                    f(self, &descs)
                }
                Ok(_) => {
                    self.counters.errors.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(
                        head,
                        queue = index,
                        "virtio-balloon: page list with a device-writable buffer, a length that \
                         is not whole 4-byte frame numbers, or more than 1 MiB; ignored"
                    );
                }
                Err(e) => {
                    self.counters.errors.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(head, queue = index, "virtio-balloon: chain refused: {e}");
                }
            }
            add_used(&mut self.queues[index], &mem, head, 0);
            used_any = true;
        }
        if used_any {
            notify_used(&mut self.queues[index], &self.mem, &self.interrupt);
        }
    }

    /// Reads the frame numbers of a page list.
    fn pfns(&self, descs: &[Desc]) -> Vec<u32> {
        let mut pfns = Vec::new();
        for d in descs {
            let mut buf = vec![0u8; d.len as usize];
            if self.mem.read_slice(&mut buf, d.addr).is_err() {
                self.counters.errors.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            pfns.extend(
                buf.chunks_exact(4)
                    .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])),
            );
        }
        pfns
    }

    fn inflate(&mut self, descs: &[Desc]) {
        let pfns = self.pfns(descs);
        // Contiguous host ranges inside one region: (start, len, shared file mapping).
        let mut run: Option<HostRun> = None;
        let mut released = 0u64;
        for pfn in pfns {
            let gpa = GuestAddress(u64::from(pfn) << PFN_SHIFT);
            let Some(page) = self.host_page(gpa) else {
                self.counters.invalid_pfns.fetch_add(1, Ordering::Relaxed);
                continue;
            };
            run = match run {
                Some(r) if r.extends_to(&page) => Some(HostRun {
                    len: r.len + BALLOON_PAGE_SIZE as usize,
                    ..r
                }),
                Some(r) => {
                    released += self.release(&r);
                    Some(page)
                }
                None => Some(page),
            };
        }
        if let Some(r) = run {
            released += self.release(&r);
        }
        self.counters
            .inflated_pages
            .fetch_add(released, Ordering::Relaxed);
    }

    /// The host range of the guest page at `gpa`, if the whole page is guest memory.
    fn host_page(&self, gpa: GuestAddress) -> Option<HostRun> {
        let region = self.mem.find_region(gpa)?;
        // The whole page must lie in this one region.
        let slice = self.mem.get_slice(gpa, BALLOON_PAGE_SIZE as usize).ok()?;
        let start = slice.ptr_guard_mut().as_ptr() as usize;
        let shared_file = region.file_offset().is_some() && region.flags() & libc::MAP_SHARED != 0;
        Some(HostRun {
            start,
            len: BALLOON_PAGE_SIZE as usize,
            region: region.start_addr().0,
            shared_file,
        })
    }

    /// Drops the host pages of a run; returns the pages released. Private memory is
    /// dropped (`MADV_DONTNEED`: zero-fill, or the file's data, on the next access); a
    /// shared file mapping has its backing freed too (`MADV_REMOVE`), or the pages would
    /// stay in the page cache.
    fn release(&self, run: &HostRun) -> u64 {
        let advice = if run.shared_file {
            libc::MADV_REMOVE
        } else {
            libc::MADV_DONTNEED
        };
        // SAFETY: `run` lies inside one mapped guest memory region (each page came from
        // `get_slice` on that region and the run is contiguous); the guest gave these pages
        // up, and the advice only replaces their contents on the next access, which cannot
        // break the host's memory safety.
        let r = unsafe { libc::madvise(run.start as *mut libc::c_void, run.len, advice) };
        if r != 0 {
            self.counters
                .release_failures
                .fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                error = %std::io::Error::last_os_error(),
                len = run.len,
                "virtio-balloon: releasing inflated pages failed"
            );
            return 0;
        }
        run.len as u64 / BALLOON_PAGE_SIZE
    }

    fn deflate(&mut self, descs: &[Desc]) {
        let n = self.pfns(descs).len() as u64;
        self.counters.deflated_pages.fetch_add(n, Ordering::Relaxed);
    }

    /// The driver delivered a statistics buffer: parse it and keep it.
    fn process_stats_queue(&mut self) {
        loop {
            let mem = self.mem.clone();
            let Some(chain) = self.queues[STATS].pop_descriptor_chain(&mem) else {
                break;
            };
            let head = chain.head_index();
            // Only one buffer is ever outstanding; if the driver sent another, the older one
            // goes back first.
            if let Some(old) = self.stats_head.take() {
                add_used(&mut self.queues[STATS], &mem, old, 0);
                notify_used(&mut self.queues[STATS], &mem, &self.interrupt);
            }
            match collect_chain(chain, &mem) {
                Ok(descs) if descs.iter().all(|d| !d.write) => {
                    let mut bytes = Vec::new();
                    for d in &descs {
                        let room = MAX_STATS_BYTES - bytes.len();
                        let n = (d.len as usize).min(room);
                        let start = bytes.len();
                        bytes.resize(start + n, 0);
                        if mem.read_slice(&mut bytes[start..], d.addr).is_err() {
                            bytes.truncate(start);
                        }
                    }
                    let mut parsed = BalloonStats::parse(&bytes);
                    let mut shared = lock(&self.stats);
                    parsed.updates = shared.updates + 1;
                    *shared = parsed;
                    drop(shared);
                    self.counters.stats_updates.fetch_add(1, Ordering::Relaxed);
                    self.stats_head = Some(head);
                }
                other => {
                    self.counters.errors.fetch_add(1, Ordering::Relaxed);
                    if let Err(e) = other {
                        tracing::debug!(head, "virtio-balloon: statistics chain refused: {e}");
                    }
                    add_used(&mut self.queues[STATS], &mem, head, 0);
                    notify_used(&mut self.queues[STATS], &mem, &self.interrupt);
                }
            }
        }
    }

    /// Gives the statistics buffer back so the driver refills it.
    fn request_stats(&mut self) {
        if let Some(head) = self.stats_head.take() {
            add_used(&mut self.queues[STATS], &self.mem, head, 0);
            notify_used(&mut self.queues[STATS], &self.mem, &self.interrupt);
        }
    }

    fn process_all(&mut self) {
        self.drain(INFLATE, Self::inflate);
        self.drain(DEFLATE, Self::deflate);
        if self.stats_enabled {
            self.process_stats_queue();
        }
    }
}

impl WorkerHandler for BalloonWorker {
    fn on_start(&mut self, _ctl: &WorkerCtl) {
        self.process_all();
    }

    fn handle_event(&mut self, _ctl: &WorkerCtl, token: u64, _events: EventSet) {
        match token {
            t if t == INFLATE as u64 => {
                let _ = self.events[INFLATE].read();
                self.drain(INFLATE, Self::inflate);
            }
            t if t == DEFLATE as u64 => {
                let _ = self.events[DEFLATE].read();
                self.drain(DEFLATE, Self::deflate);
            }
            t if t == STATS as u64 => {
                let _ = self.events[STATS].read();
                self.process_stats_queue();
            }
            TOKEN_TIMER => {
                if let Some(t) = &mut self.timer {
                    let _ = t.wait();
                }
                self.request_stats();
            }
            TOKEN_STATS_REQUEST => {
                let _ = self.stats_request.read();
                self.request_stats();
            }
            _ => {}
        }
    }
}

impl VirtioDevice for Balloon {
    fn device_type(&self) -> u32 {
        VIRTIO_ID_BALLOON
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &self.queue_sizes
    }

    fn avail_features(&self) -> u64 {
        let mut f = 1u64 << VIRTIO_F_VERSION_1;
        if self.stats_enabled() {
            f |= 1 << VIRTIO_BALLOON_F_STATS_VQ;
        }
        if self.deflate_on_oom {
            f |= 1 << VIRTIO_BALLOON_F_DEFLATE_ON_OOM;
        }
        f
    }

    fn set_acked_features(&mut self, features: u64) {
        self.acked_features = features & self.avail_features();
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        let mut config = [0u8; CONFIG_LEN];
        config[0..4].copy_from_slice(&self.num_pages.to_le_bytes());
        config[4..8].copy_from_slice(&self.actual.to_le_bytes());
        read_config_bytes(&config, offset, data);
    }

    fn write_config(&mut self, offset: u64, data: &[u8]) {
        // Only `actual` (bytes 4..8) belongs to the driver.
        let mut actual = self.actual.to_le_bytes();
        for (i, b) in data.iter().enumerate() {
            match usize::try_from(offset).ok().and_then(|o| o.checked_add(i)) {
                Some(o @ 4..=7) => actual[o - 4] = *b,
                _ => tracing::debug!(
                    offset,
                    "virtio-balloon: ignored write to a read-only config byte"
                ),
            }
        }
        self.actual = u32::from_le_bytes(actual);
    }

    fn activate(&mut self, ctx: ActivateContext) -> Result<(), ActivateError> {
        check_inactive(&self.worker, "the balloon")?;
        ctx.check_queue_count(self.queue_sizes.len())?;
        let ActivateContext {
            mem,
            interrupt,
            queues,
            queue_events,
        } = ctx;
        if !queues[INFLATE].ready() || !queues[DEFLATE].ready() {
            return Err(ActivateError::Other(
                "the inflate and deflate queues must both be set up".into(),
            ));
        }
        let stats_enabled = self.acked_features & (1 << VIRTIO_BALLOON_F_STATS_VQ) != 0;
        if stats_enabled && !queues[STATS].ready() {
            return Err(ActivateError::Other(
                "VIRTIO_BALLOON_F_STATS_VQ was acknowledged but the statistics queue was not set up"
                    .into(),
            ));
        }
        let timer = if stats_enabled && !self.stats_interval.is_zero() {
            let mut t = TimerFd::new().map_err(|e| ActivateError::Backend(e.into()))?;
            t.reset(self.stats_interval, Some(self.stats_interval))
                .map_err(|e| ActivateError::Backend(e.into()))?;
            Some(t)
        } else {
            None
        };
        let stats_request = self.stats_request.try_clone()?;
        let mut sources = vec![
            (queue_events[INFLATE].as_raw_fd(), INFLATE as u64),
            (queue_events[DEFLATE].as_raw_fd(), DEFLATE as u64),
        ];
        if stats_enabled {
            sources.push((queue_events[STATS].as_raw_fd(), STATS as u64));
            sources.push((stats_request.as_raw_fd(), TOKEN_STATS_REQUEST));
        }
        if let Some(t) = &timer {
            sources.push((t.as_raw_fd(), TOKEN_TIMER));
        }
        let handler = BalloonWorker {
            queues,
            events: queue_events,
            mem,
            interrupt: interrupt.clone(),
            counters: self.counters.clone(),
            stats: self.stats.clone(),
            stats_head: if stats_enabled {
                self.stats_head.take()
            } else {
                None
            },
            stats_enabled,
            timer,
            stats_request,
        };
        let worker = Worker::spawn("virtio-balloon", handler, &sources)
            .map_err(|e| ActivateError::Other(e.to_string()))?;
        self.worker = Some(worker);
        self.interrupt = Some(interrupt);
        Ok(())
    }

    fn deactivate(&mut self) -> Option<(Vec<Queue>, Vec<EventFd>)> {
        self.interrupt = None;
        let h = stop_worker(&mut self.worker)?;
        self.stats_head = h.stats_head;
        Some((h.queues, h.events))
    }

    fn metrics(&self) -> serde_json::Value {
        serde_json::to_value(Self::metrics(self)).unwrap_or_default()
    }
}

/// The balloon's saved state: its sizes, the statistics buffer it holds and the last
/// statistics.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BalloonState {
    pub num_pages: u32,
    pub actual: u32,
    pub stats_head: Option<u16>,
    pub stats: BalloonStats,
}

impl Persist for Balloon {
    type State = BalloonState;
    const STATE_VERSION: u32 = 1;
    const NAME: &'static str = "virtio-balloon";

    fn save(&self) -> BalloonState {
        BalloonState {
            num_pages: self.num_pages,
            actual: self.actual,
            stats_head: self.stats_head,
            stats: lock(&self.stats).clone(),
        }
    }

    fn restore(&mut self, s: BalloonState) -> Result<(), StateError> {
        if s.stats_head.is_some_and(|h| h >= QUEUE_SIZE) {
            return Err(StateError::Invalid(
                "virtio-balloon state holds a statistics buffer index past the queue".into(),
            ));
        }
        self.num_pages = s.num_pages;
        self.actual = s.actual;
        self.stats_head = s.stats_head;
        *lock(&self.stats) = s.stats;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::virtio::INT_CONFIG_CHANGE;
    use crate::devices::virtio::testing::{
        BadChain, Driver, guest_memory, guest_memory_shared_file, rd, wait_for, wr,
    };

    const MEM: usize = 0x80_0000;
    const LIST: u64 = 0x10_0000;

    struct Rig<'a> {
        dev: Balloon,
        inflate: Driver<'a>,
        deflate: Driver<'a>,
        stats: Option<Driver<'a>>,
        kicks: Vec<EventFd>,
        line: Arc<EventFd>,
        interrupt: Arc<VirtioInterrupt>,
    }

    impl<'a> Rig<'a> {
        fn new(mem: &'a GuestMemoryMmap, dev: Balloon) -> Self {
            let mut dev = dev;
            let n = dev.queue_max_sizes().len();
            let inflate = Driver::new(mem, 0, 16);
            let deflate = Driver::new(mem, 0x4000, 16);
            let stats = (n == 3).then(|| Driver::new(mem, 0x8000, 16));
            dev.set_acked_features(dev.avail_features());
            let line = Arc::new(EventFd::new(libc::EFD_NONBLOCK).unwrap());
            let interrupt = Arc::new(VirtioInterrupt::new(line.clone()));
            let mut queues = vec![inflate.queue(), deflate.queue()];
            if let Some(s) = &stats {
                queues.push(s.queue());
            }
            let events: Vec<EventFd> = (0..n)
                .map(|_| EventFd::new(libc::EFD_NONBLOCK).unwrap())
                .collect();
            let kicks = events.iter().map(|e| e.try_clone().unwrap()).collect();
            dev.activate(ActivateContext {
                mem: mem.clone(),
                interrupt: interrupt.clone(),
                queues,
                queue_events: events,
            })
            .unwrap();
            Self {
                dev,
                inflate,
                deflate,
                stats,
                kicks,
                line,
                interrupt,
            }
        }
    }

    fn write_pfns(mem: &GuestMemoryMmap, at: u64, pfns: &[u32]) -> u32 {
        let bytes: Vec<u8> = pfns.iter().flat_map(|p| p.to_le_bytes()).collect();
        mem.write_slice(&bytes, GuestAddress(at)).unwrap();
        bytes.len() as u32
    }

    fn page_is(mem: &GuestMemoryMmap, addr: u64, byte: u8) -> bool {
        let mut page = vec![0u8; BALLOON_PAGE_SIZE as usize];
        mem.read_slice(&mut page, GuestAddress(addr)).unwrap();
        page.iter().all(|b| *b == byte)
    }

    fn stats_buffer(entries: &[(u16, u64)]) -> Vec<u8> {
        entries
            .iter()
            .flat_map(|(t, v)| {
                let mut e = t.to_le_bytes().to_vec();
                e.extend_from_slice(&v.to_le_bytes());
                e
            })
            .collect()
    }

    #[test]
    fn inflate_releases_the_pages_so_they_read_back_zero() {
        let mem = guest_memory(MEM);
        let mut rig = Rig::new(&mem, Balloon::new(0, false, 0).unwrap());
        let pages = [0x20_0000u64, 0x20_1000, 0x30_0000];
        for p in pages {
            mem.write_slice(&[0xab; 4096], GuestAddress(p)).unwrap();
        }
        let untouched = 0x20_2000u64;
        mem.write_slice(&[0xcd; 4096], GuestAddress(untouched))
            .unwrap();
        let mut pfns: Vec<u32> = pages.iter().map(|p| (p >> 12) as u32).collect();
        pfns.push((MEM as u64 >> 12) as u32 + 5); // outside guest memory
        let len = write_pfns(&mem, LIST, &pfns);
        rig.inflate.add(&[rd(LIST, len)]);
        rig.kicks[INFLATE].write(1).unwrap();
        assert_eq!(rig.inflate.wait_used(1).len(), 0);
        for p in pages {
            assert!(page_is(&mem, p, 0), "page {p:#x} was released");
        }
        assert!(
            page_is(&mem, untouched, 0xcd),
            "a neighbouring page is kept"
        );
        let m = rig.dev.metrics();
        assert_eq!((m.inflated_pages, m.invalid_pfns, m.errors), (3, 1, 0));
        assert_eq!(VirtioDevice::metrics(&rig.dev)["inflated_pages"], 3);
        assert_eq!(rig.line.read().unwrap(), 1, "used-buffer interrupt raised");
    }

    #[test]
    fn inflate_frees_the_backing_of_shared_file_memory() {
        use std::os::unix::fs::FileExt;
        let (mem, file) = guest_memory_shared_file(MEM);
        let mut rig = Rig::new(&mem, Balloon::new(0, false, 0).unwrap());
        let page = 0x30_0000u64;
        mem.write_slice(&[0x5a; 4096], GuestAddress(page)).unwrap();
        let mut in_file = [0u8; 16];
        file.read_exact_at(&mut in_file, page).unwrap();
        assert_eq!(in_file, [0x5a; 16], "the page lives in the file");
        let len = write_pfns(&mem, LIST, &[(page >> 12) as u32]);
        rig.inflate.add(&[rd(LIST, len)]);
        rig.kicks[INFLATE].write(1).unwrap();
        rig.inflate.wait_used(1);
        assert_eq!(rig.dev.metrics().release_failures, 0);
        assert!(page_is(&mem, page, 0), "the guest reads zeros");
        file.read_exact_at(&mut in_file, page).unwrap();
        assert_eq!(
            in_file, [0; 16],
            "the file's backing was freed, not just unmapped"
        );
    }

    #[test]
    fn deflate_acknowledges_the_pages() {
        let mem = guest_memory(MEM);
        let mut rig = Rig::new(&mem, Balloon::new(0, true, 0).unwrap());
        assert_ne!(
            rig.dev.avail_features() & (1 << VIRTIO_BALLOON_F_DEFLATE_ON_OOM),
            0
        );
        assert_eq!(
            rig.dev.avail_features() & (1 << VIRTIO_BALLOON_F_STATS_VQ),
            0
        );
        let len = write_pfns(&mem, LIST, &[0x200, 0x201]);
        rig.deflate.add(&[rd(LIST, len)]);
        rig.kicks[DEFLATE].write(1).unwrap();
        assert_eq!(rig.deflate.wait_used(1).len(), 0);
        assert_eq!(rig.dev.metrics().deflated_pages, 2);
        let (queues, events) = rig.dev.deactivate().unwrap();
        assert_eq!((queues.len(), events.len()), (2, 2));
        assert_eq!(queues[DEFLATE].next_used(), 1);
    }

    #[test]
    fn stats_buffer_is_parsed_kept_and_returned_on_request() {
        let mem = guest_memory(MEM);
        // A long interval: only explicit requests return the buffer in this test.
        let mut rig = Rig::new(&mem, Balloon::new(16, false, 3600).unwrap());
        let stats_drv = rig.stats.as_mut().unwrap();
        let buf = stats_buffer(&[(4, 1 << 30), (5, 2 << 30), (6, 3 << 20), (99, 7)]);
        mem.write_slice(&buf, GuestAddress(LIST)).unwrap();
        stats_drv.add(&[rd(LIST, buf.len() as u32)]);
        rig.kicks[STATS].write(1).unwrap();
        wait_for("the first statistics", || rig.dev.stats().updates == 1);
        let s = rig.dev.stats();
        assert_eq!(s.free_memory, Some(1 << 30));
        assert_eq!(s.total_memory, Some(2 << 30));
        assert_eq!(s.available_memory, Some(3 << 20));
        assert_eq!(s.swap_in, None, "an unreported tag stays None");
        assert_eq!((s.target_mib, s.target_pages), (16, 16 * 256));
        let stats_drv = rig.stats.as_ref().unwrap();
        assert_eq!(stats_drv.used_idx(), 0, "the device holds the buffer");

        rig.dev.request_stats().unwrap();
        let stats_drv = rig.stats.as_mut().unwrap();
        assert_eq!(
            stats_drv.wait_used(1).len(),
            0,
            "the buffer went back for a refill"
        );
        let buf = stats_buffer(&[(4, 5 << 20), (10, 2)]);
        mem.write_slice(&buf, GuestAddress(LIST)).unwrap();
        stats_drv.add(&[rd(LIST, buf.len() as u32)]);
        rig.kicks[STATS].write(1).unwrap();
        wait_for("the second statistics", || rig.dev.stats().updates == 2);
        let s = rig.dev.stats();
        assert_eq!(s.free_memory, Some(5 << 20));
        assert_eq!(s.oom_kills, Some(2));
        assert_eq!(s.total_memory, None, "each report replaces the last");
        assert_eq!(rig.dev.metrics().stats_updates, 2);
    }

    #[test]
    fn stats_buffer_is_returned_at_the_polling_interval() {
        let mem = guest_memory(MEM);
        let mut rig = Rig::new(&mem, Balloon::new(0, false, 1).unwrap());
        let buf = stats_buffer(&[(4, 1)]);
        mem.write_slice(&buf, GuestAddress(LIST)).unwrap();
        let stats_drv = rig.stats.as_mut().unwrap();
        stats_drv.add(&[rd(LIST, buf.len() as u32)]);
        rig.kicks[STATS].write(1).unwrap();
        // The 1 s timer hands the buffer back without any request.
        assert_eq!(rig.stats.as_ref().unwrap().wait_used(1).len(), 0);
        assert_eq!(rig.dev.stats().free_memory, Some(1));
    }

    #[test]
    fn held_stats_buffer_survives_deactivate_and_restore() {
        let mem = guest_memory(MEM);
        let mut rig = Rig::new(&mem, Balloon::new(8, false, 3600).unwrap());
        let buf = stats_buffer(&[(5, 42)]);
        mem.write_slice(&buf, GuestAddress(LIST)).unwrap();
        rig.stats
            .as_mut()
            .unwrap()
            .add(&[rd(LIST, buf.len() as u32)]);
        rig.kicks[STATS].write(1).unwrap();
        wait_for("statistics", || rig.dev.stats().updates == 1);
        let (queues, events) = rig.dev.deactivate().unwrap();
        let state = rig.dev.save();
        assert_eq!(state.stats_head, Some(0));

        let mut fresh = Balloon::new(0, false, 3600).unwrap();
        fresh.restore(state).unwrap();
        assert_eq!(fresh.target_mib(), 8);
        assert_eq!(fresh.stats().total_memory, Some(42));
        fresh.set_acked_features(fresh.avail_features());
        fresh
            .activate(ActivateContext {
                mem: mem.clone(),
                interrupt: rig.interrupt.clone(),
                queues,
                queue_events: events,
            })
            .unwrap();
        fresh.request_stats().unwrap();
        assert_eq!(
            rig.stats.as_ref().unwrap().wait_used(1).len(),
            0,
            "the restored device returned the held buffer"
        );
        fresh.deactivate().unwrap();
    }

    #[test]
    fn set_target_updates_the_config_and_raises_a_config_change() {
        let mem = guest_memory(MEM);
        let mut idle = Balloon::new(0, false, 0).unwrap();
        idle.set_target_mib(4).unwrap();
        let mut cfg = [0u8; 4];
        idle.read_config(0, &mut cfg);
        assert_eq!(
            u32::from_le_bytes(cfg),
            4 * 256,
            "an inactive balloon keeps the target"
        );

        let mut rig = Rig::new(&mem, Balloon::new(0, false, 0).unwrap());
        let generation = rig.interrupt.config_generation();
        rig.dev.set_target_mib(64).unwrap();
        rig.dev.read_config(0, &mut cfg);
        assert_eq!(u32::from_le_bytes(cfg), 64 * 256);
        assert_eq!(rig.line.read().unwrap(), 1, "the interrupt line fired");
        assert_ne!(rig.interrupt.status() & INT_CONFIG_CHANGE, 0);
        assert_eq!(rig.interrupt.config_generation(), generation + 1);
        assert!(matches!(
            rig.dev.set_target_mib(u64::MAX / 2),
            Err(BalloonError::TargetTooLarge { .. })
        ));
        assert_eq!(
            rig.dev.target_mib(),
            64,
            "a refused target leaves the old one"
        );
    }

    #[test]
    fn driver_writes_actual_and_cannot_write_the_target() {
        let mut dev = Balloon::new(2, false, 0).unwrap();
        dev.write_config(4, &300u32.to_le_bytes());
        dev.write_config(0, &9u32.to_le_bytes());
        let mut cfg = [0u8; 8];
        dev.read_config(0, &mut cfg);
        assert_eq!(u32::from_le_bytes(cfg[0..4].try_into().unwrap()), 512);
        assert_eq!(u32::from_le_bytes(cfg[4..8].try_into().unwrap()), 300);
        let s = dev.stats();
        assert_eq!((s.actual_pages, s.target_mib), (300, 2));
        assert!(matches!(
            dev.request_stats(),
            Err(BalloonError::StatsDisabled)
        ));
    }

    #[test]
    fn malformed_balloon_chains_are_ignored_and_the_worker_goes_on() {
        let mem = guest_memory(MEM);
        let mut rig = Rig::new(&mem, Balloon::new(0, false, 0).unwrap());
        let bad: [BadChain; 7] = [
            ("a loop", |d| {
                d.add_loop(&[rd(LIST, 4), rd(LIST + 4, 4)]);
            }),
            ("a next index past the table", |d| {
                d.add_dangling(rd(LIST, 4));
            }),
            ("a list outside guest memory", |d| {
                d.add(&[rd(MEM as u64 + 0x1000, 4)]);
            }),
            ("an oversized length", |d| {
                d.add(&[rd(LIST, u32::MAX - 3)]);
            }),
            ("an oversized list inside guest memory", |d| {
                d.add(&[rd(LIST, 2 << 20)]);
            }),
            ("too short: half a frame number", |d| {
                d.add(&[rd(LIST, 2)]);
            }),
            ("wrong direction", |d| {
                d.add(&[wr(LIST, 4)]);
            }),
        ];
        let mut used = 0;
        for (i, (what, add_bad)) in bad.iter().enumerate() {
            let target = 0x40_0000 + i as u64 * 0x1000;
            mem.write_slice(&[0xee; 4096], GuestAddress(target))
                .unwrap();
            write_pfns(&mem, LIST, &[(target >> 12) as u32]);
            add_bad(&mut rig.inflate);
            rig.kicks[INFLATE].write(1).unwrap();
            used += 1;
            assert_eq!(rig.inflate.wait_used(used).len(), 0, "{what}: returned");
            assert_eq!(rig.dev.metrics().errors, i as u64 + 1, "{what}: counted");
            assert!(page_is(&mem, target, 0xee), "{what}: nothing was released");
            assert!(rig.dev.is_running(), "{what}: the worker is alive");
            // A good list for the same page is served next.
            rig.inflate.add(&[rd(LIST, 4)]);
            rig.kicks[INFLATE].write(1).unwrap();
            used += 1;
            rig.inflate.wait_used(used);
            assert!(page_is(&mem, target, 0), "good inflate after {what}");
        }
        assert_eq!(rig.dev.metrics().inflated_pages, bad.len() as u64);
    }

    #[test]
    fn activation_needs_the_statistics_queue_when_acknowledged() {
        let mem = guest_memory(MEM);
        let mut dev = Balloon::new(0, false, 5).unwrap();
        assert_eq!(dev.queue_max_sizes().len(), 3);
        dev.set_acked_features(dev.avail_features());
        let inflate = Driver::new(&mem, 0, 16);
        let deflate = Driver::new(&mem, 0x4000, 16);
        let line = Arc::new(EventFd::new(libc::EFD_NONBLOCK).unwrap());
        let err = dev
            .activate(ActivateContext {
                mem: mem.clone(),
                interrupt: Arc::new(VirtioInterrupt::new(line)),
                queues: vec![
                    inflate.queue(),
                    deflate.queue(),
                    Queue::new(QUEUE_SIZE).unwrap(),
                ],
                queue_events: (0..3)
                    .map(|_| EventFd::new(libc::EFD_NONBLOCK).unwrap())
                    .collect(),
            })
            .err()
            .unwrap();
        assert!(err.to_string().contains("statistics queue"));
    }
}

#[cfg(test)]
mod proptests {
    //! The queues of a hostile driver against the balloon: whatever the descriptors say,
    //! the only guest memory that changes is the pages well-formed inflate lists name (and
    //! the used rings).

    use std::collections::BTreeSet;

    use proptest::collection::vec;
    use proptest::prelude::*;

    use super::*;
    use crate::devices::virtio::hostile::{self, BufGen, ByteSet, Chain, ChainGen, Snapshot};

    /// Where the pages the lists name mostly are; no list is read from there.
    const TARGETS: (u64, u64) = hostile::REGIONS[2];

    /// A page frame number: mostly a page of region 2, else one of region 1 (where lists
    /// may be), page 0, the hole, past the end of guest memory.
    fn pfn() -> BoxedStrategy<u32> {
        let page = |a: u64| (a / BALLOON_PAGE_SIZE) as u32;
        prop_oneof![
            8 => page(TARGETS.0)..page(TARGETS.1),
            1 => page(hostile::DATA.0)..page(TARGETS.0),
            1 => Just(0u32),
            1 => page(hostile::HOLE.0)..page(hostile::HOLE.1),
            1 => page(hostile::MEM_END)..=u32::MAX,
        ]
        .boxed()
    }

    /// Mostly lists of frame numbers (in the pinned area, where their content stays as
    /// written), of any length now and then.
    fn list_chain() -> BoxedStrategy<ChainGen> {
        let list = (
            vec(pfn(), 0..24),
            prop_oneof![6 => Just(None), 1 => hostile::any_len().prop_map(Some)],
            hostile::pinned_addr(),
            prop::bool::weighted(0.05),
        )
            .prop_map(|(pfns, len, addr, write)| BufGen {
                len: len.unwrap_or(4 * pfns.len() as u32),
                addr,
                write,
                content: pfns.iter().flat_map(|p| p.to_le_bytes()).collect(),
            });
        hostile::mostly_plain(vec(list, 1..=3).boxed(), 0.1)
    }

    /// Whether the worker takes the chain as a page list.
    fn page_list(mem: &GuestMemoryMmap, c: &Chain) -> bool {
        c.terminated
            && c.all_readable()
            && c.descs
                .iter()
                .all(|d| d.len % 4 == 0 && hostile::in_memory(mem, d.addr, u64::from(d.len)))
            && c.readable_len() <= MAX_PFN_LIST_BYTES
    }

    /// The frame numbers of a page list as guest memory held them before the device ran.
    fn pfns(snapshot: &Snapshot, c: &Chain) -> Vec<u32> {
        let mut out = Vec::new();
        for d in &c.descs {
            let mut at = d.addr;
            let mut left = d.len as usize;
            // A buffer may cross from region 1 into region 2.
            while left > 0 {
                let in_region = hostile::REGIONS
                    .iter()
                    .find(|(s, e)| (*s..*e).contains(&at))
                    .map(|&(_, e)| (e - at) as usize)
                    .unwrap();
                let n = left.min(in_region);
                out.extend_from_slice(snapshot.bytes(at, n));
                at += n as u64;
                left -= n;
            }
        }
        out.chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    }

    proptest! {
        #![proptest_config(hostile::config())]

        #[test]
        fn balloon_releases_only_the_pages_well_formed_inflate_lists_name_and_changes_nothing_else(
            mut inflate_q in hostile::queue(list_chain()),
            mut deflate_q in hostile::queue(list_chain()),
            mut stats_q in hostile::queue(hostile::chain(0.2)),
            stats_enabled: bool,
            seed: u64,
        ) {
            let mem = hostile::guest_memory();
            hostile::fill(&mem, seed);
            // Lists are read neither from the rings (which change) nor from the pages they
            // name (region 2).
            for q in [&mut inflate_q, &mut deflate_q, &mut stats_q] {
                q.readable_off = vec![
                    (hostile::RINGS, hostile::PINNED.0),
                    (hostile::INDIRECT_TABLES, hostile::HOLE.0),
                    TARGETS,
                ];
            }
            let (inflate, inflate_l) = inflate_q.build(&mem, INFLATE);
            let (deflate, deflate_l) = deflate_q.build(&mem, DEFLATE);
            let (stats, stats_l) = stats_q.build(&mem, STATS);
            let inflates = hostile::offered(&mem, &inflate_l);
            let deflates = hostile::offered(&mem, &deflate_l);
            let stats_offered = hostile::offered(&mem, &stats_l);
            let snapshot = Snapshot::take(&mem);
            let counters = Arc::new(Counters::default());
            let line = Arc::new(EventFd::new(libc::EFD_NONBLOCK).unwrap());
            let worker = BalloonWorker {
                queues: vec![inflate, deflate, stats],
                events: (0..3).map(|_| EventFd::new(libc::EFD_NONBLOCK).unwrap()).collect(),
                mem: mem.clone(),
                interrupt: Arc::new(VirtioInterrupt::new(line)),
                counters: counters.clone(),
                stats: Arc::new(Mutex::new(BalloonStats::default())),
                stats_head: None,
                stats_enabled,
                timer: None,
                stats_request: EventFd::new(libc::EFD_NONBLOCK).unwrap(),
            };
            hostile::bounded(move || {
                let mut worker = worker;
                worker.process_all();
            });

            // Every page list is returned, with nothing written.
            for (l, offered) in [(&inflate_l, &inflates), (&deflate_l, &deflates)] {
                let used = hostile::used(&mem, l, offered)?;
                let returnable = offered.iter().filter(|c| c.head < l.size).count();
                prop_assert_eq!(used.len(), returnable, "a page list was left on the ring");
                prop_assert!(used.iter().all(|(len, _)| *len == 0), "a page list reports written bytes");
            }
            let stats_used = hostile::used(&mem, &stats_l, &stats_offered)?;
            prop_assert!(stats_enabled || stats_used.is_empty(), "the statistics queue was served while off");
            prop_assert!(stats_used.iter().all(|(len, _)| *len == 0), "a statistics buffer reports written bytes");

            // The pages the well-formed inflate lists name may go (page 0 too: a list whose
            // own page was released before it was read names page 0); those in regions 1
            // and 2 named by lists in the pinned area, which no inflation changes, must
            // (region 0 keeps its contents when released, see `hostile::guest_memory`).
            let in_memory = |pfn: u32| hostile::in_memory(&mem, u64::from(pfn) << PFN_SHIFT, BALLOON_PAGE_SIZE);
            let mut releasable = BTreeSet::from([0u64]);
            let mut must_go = BTreeSet::new();
            let mut named = 0u64;
            for c in inflates.iter().filter(|c| page_list(&mem, c)) {
                let pinned = c.descs.iter().all(|d| {
                    d.addr >= hostile::PINNED.0 && d.addr + u64::from(d.len) <= hostile::PINNED.1
                });
                for pfn in pfns(&snapshot, c) {
                    named += 1;
                    if in_memory(pfn) {
                        let page = u64::from(pfn) << PFN_SHIFT;
                        releasable.insert(page);
                        if pinned && page >= hostile::DATA.0 {
                            must_go.insert(page);
                        }
                    }
                }
            }
            let c = |a: &AtomicU64| a.load(Ordering::Relaxed);
            prop_assert_eq!(c(&counters.inflated_pages) + c(&counters.invalid_pfns), named, "frame numbers of {:?}", inflates);
            prop_assert_eq!(c(&counters.release_failures), 0);
            let deflated: u64 = deflates
                .iter()
                .filter(|c| page_list(&mem, c))
                .map(|c| c.readable_len() / 4)
                .sum();
            prop_assert_eq!(c(&counters.deflated_pages), deflated, "frame numbers of {:?}", deflates);

            // A list in region 1 that names a page of region 1 may release a page another
            // list is read from, which then names what its new zeros make up: which pages
            // go is only known for guests that do not do that.
            let lists: Vec<(u64, u64)> = inflates
                .iter()
                .filter(|c| page_list(&mem, c))
                .flat_map(|c| c.descs.iter().map(|d| (d.addr, u64::from(d.len))))
                .collect();
            let private: Vec<(u64, u64)> = releasable
                .iter()
                .filter(|p| **p >= hostile::DATA.0)
                .map(|p| (*p, BALLOON_PAGE_SIZE))
                .collect();
            if hostile::overlap(&lists, &private) {
                return Ok(());
            }
            let mut allowed = ByteSet::default();
            for l in [&inflate_l, &deflate_l, &stats_l] {
                hostile::allow_used_ring(&mut allowed, l);
            }
            for &page in &releasable {
                allowed.insert(page, BALLOON_PAGE_SIZE);
            }
            let changes = snapshot.changes(&mem);
            // Released pages change without being marked dirty: the guest gave them up.
            changes.check(&allowed, false)?;
            let zero = |page: u64| {
                let mut b = vec![0u8; BALLOON_PAGE_SIZE as usize];
                mem.read_slice(&mut b, GuestAddress(page)).unwrap();
                b.iter().all(|x| *x == 0)
            };
            // (Released pages of region 0 keep their contents, and the used rings are there.)
            let private = changes.changed_pages.iter().filter(|p| **p >= hostile::DATA.0);
            for page in private.filter(|p| releasable.contains(p)) {
                prop_assert!(zero(*page), "page {:#x} changed but was not released", page);
            }
            for &page in &must_go {
                prop_assert!(zero(page), "page {:#x} of an inflate list was not released", page);
            }
        }
    }
}
