//! Test helpers shared by the net and vsock device tests: guest memory with a dirty
//! bitmap, a driver-side split queue, and bounded waits on the device's interrupt.

use std::num::NonZeroUsize;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use virtio_queue::{Queue, QueueT};
use vm_memory::bitmap::AtomicBitmap;
use vm_memory::mmap::MmapRegionBuilder;
use vm_memory::{Bytes, GuestAddress};
use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};

use crate::devices::virtio::VirtioInterrupt;
use crate::memory::{GuestMemoryMmap, GuestRegionMmap};

pub const VRING_DESC_F_NEXT: u16 = 1;
pub const VRING_DESC_F_WRITE: u16 = 2;

/// How long a test waits for the device before failing.
pub const WAIT: Duration = Duration::from_secs(10);

/// `size` bytes of guest memory at address 0, with a dirty bitmap like the VMM's.
pub fn guest_memory(size: usize) -> GuestMemoryMmap {
    let bitmap = AtomicBitmap::new(size, NonZeroUsize::new(4096).unwrap());
    let region = MmapRegionBuilder::new_with_bitmap(size, Some(bitmap))
        .with_mmap_prot(libc::PROT_READ | libc::PROT_WRITE)
        .with_mmap_flags(libc::MAP_ANONYMOUS | libc::MAP_NORESERVE | libc::MAP_PRIVATE)
        .build()
        .unwrap();
    let region = GuestRegionMmap::new(region, GuestAddress(0)).unwrap();
    GuestMemoryMmap::from_regions(vec![region]).unwrap()
}

/// The device's interrupt line, observable by the test.
pub struct Irq {
    pub evt: EventFd,
    pub interrupt: Arc<VirtioInterrupt>,
}

impl Irq {
    pub fn new() -> Self {
        let evt = EventFd::new(EFD_NONBLOCK).unwrap();
        let interrupt = Arc::new(VirtioInterrupt::new(Arc::new(evt.try_clone().unwrap())));
        Irq { evt, interrupt }
    }

    /// Waits until `cond` holds, re-checking it after every interrupt (and every 20 ms,
    /// for conditions the device reaches without an interrupt); fails after [`WAIT`].
    pub fn wait_for(&self, what: &str, mut cond: impl FnMut() -> bool) {
        let deadline = Instant::now() + WAIT;
        loop {
            if cond() {
                return;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            assert!(!left.is_zero(), "timed out waiting for {what}");
            let mut pfd = libc::pollfd {
                fd: self.evt.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: `pfd` is one valid pollfd that lives across the call.
            unsafe { libc::poll(&mut pfd, 1, left.as_millis().min(20) as i32) };
            let _ = self.evt.read();
        }
    }
}

/// The driver side of one split queue, laid out as virtio 1.x says (descriptor table,
/// then the available ring, then the used ring 4-byte aligned).
///
/// Not `virtio_queue::mock::MockSplitQueue`: in virtio-queue 0.18 its `SplitQueueRing::end`
/// adds the ring's element count instead of its byte length, so the used ring it lays out
/// overlaps the second half of the available ring and a driver that posts more than
/// half a queue of buffers overwrites the used index.
pub struct Driver<'a> {
    mem: &'a GuestMemoryMmap,
    desc: u64,
    avail: u64,
    used: u64,
    size: u16,
    next_desc: u16,
    avail_idx: u16,
    /// Where [`Driver::alloc`] hands out buffers next.
    next_buf: u64,
    pub notify: EventFd,
}

impl<'a> Driver<'a> {
    /// A queue of `size` entries whose rings start at `base`, with data buffers handed out
    /// from `buf_base` on.
    pub fn new(mem: &'a GuestMemoryMmap, base: u64, size: u16, buf_base: u64) -> Self {
        let desc = base;
        let avail = desc + 16 * u64::from(size);
        let used = (avail + 4 + 2 * u64::from(size) + 2).next_multiple_of(4);
        let end = used + 4 + 8 * u64::from(size) + 2;
        mem.write_slice(&vec![0u8; (end - base) as usize], GuestAddress(base))
            .unwrap();
        Driver {
            mem,
            desc,
            avail,
            used,
            size,
            next_desc: 0,
            avail_idx: 0,
            next_buf: buf_base,
            notify: EventFd::new(EFD_NONBLOCK).unwrap(),
        }
    }

    /// The device-side queue, set up as a transport would after the driver's writes.
    pub fn queue(&self) -> Queue {
        let mut q = Queue::new(self.size).unwrap();
        q.set_size(self.size);
        let split = |a: u64| (Some(a as u32), Some((a >> 32) as u32));
        let (lo, hi) = split(self.desc);
        q.set_desc_table_address(lo, hi);
        let (lo, hi) = split(self.avail);
        q.set_avail_ring_address(lo, hi);
        let (lo, hi) = split(self.used);
        q.set_used_ring_address(lo, hi);
        q.set_ready(true);
        assert!(q.is_valid(self.mem), "the test queue layout is invalid");
        q
    }

    pub fn event(&self) -> EventFd {
        self.notify.try_clone().unwrap()
    }

    /// Hands out `len` bytes of guest memory for a buffer.
    pub fn alloc(&mut self, len: u32) -> u64 {
        let addr = self.next_buf;
        self.next_buf += u64::from(len).next_multiple_of(64);
        addr
    }

    fn store_desc(&self, index: u16, addr: u64, len: u32, flags: u16, next: u16) {
        let mut d = [0u8; 16];
        d[0..8].copy_from_slice(&addr.to_le_bytes());
        d[8..12].copy_from_slice(&len.to_le_bytes());
        d[12..14].copy_from_slice(&flags.to_le_bytes());
        d[14..16].copy_from_slice(&next.to_le_bytes());
        let at = self.desc + 16 * u64::from(index % self.size);
        self.mem.write_slice(&d, GuestAddress(at)).unwrap();
    }

    /// Writes raw descriptors at the given table indexes (no fix-ups) and publishes `head`.
    pub fn add_raw(&mut self, descs: &[(u16, u64, u32, u16, u16)], head: u16) {
        for &(index, addr, len, flags, next) in descs {
            self.store_desc(index, addr, len, flags, next);
        }
        self.publish(head);
    }

    /// Adds a well-formed chain of `(addr, len, device_writable)` buffers and publishes it;
    /// returns its head index.
    pub fn add_chain(&mut self, bufs: &[(u64, u32, bool)]) -> u16 {
        let head = self.next_desc;
        let n = bufs.len() as u16;
        for (i, &(addr, len, writable)) in bufs.iter().enumerate() {
            let index = (head + i as u16) % self.size;
            let next = (index + 1) % self.size;
            let mut flags = if writable { VRING_DESC_F_WRITE } else { 0 };
            if (i as u16) + 1 < n {
                flags |= VRING_DESC_F_NEXT;
            }
            self.store_desc(index, addr, len, flags, next);
        }
        self.next_desc = (head + n) % self.size;
        self.publish(head);
        head
    }

    /// Adds a chain of one writable buffer of `len` bytes; returns (head, address).
    pub fn add_writable(&mut self, len: u32) -> (u16, u64) {
        let addr = self.alloc(len);
        self.mem
            .write_slice(&vec![0xee; len as usize], GuestAddress(addr))
            .unwrap();
        (self.add_chain(&[(addr, len, true)]), addr)
    }

    fn publish(&mut self, head: u16) {
        let slot = self.avail + 4 + 2 * u64::from(self.avail_idx % self.size);
        self.mem
            .write_slice(&head.to_le_bytes(), GuestAddress(slot))
            .unwrap();
        self.avail_idx = self.avail_idx.wrapping_add(1);
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        self.mem
            .write_slice(&self.avail_idx.to_le_bytes(), GuestAddress(self.avail + 2))
            .unwrap();
    }

    /// Tells the device to look at the queue.
    pub fn kick(&self) {
        self.notify.write(1).unwrap();
    }

    /// How many chains the device has used so far.
    pub fn used_idx(&self) -> u16 {
        let mut b = [0u8; 2];
        self.mem
            .read_slice(&mut b, GuestAddress(self.used + 2))
            .unwrap();
        u16::from_le_bytes(b)
    }

    /// The `n`-th used element: (head index, length written).
    pub fn used(&self, n: u16) -> (u16, u32) {
        let at = self.used + 4 + 8 * u64::from(n % self.size);
        let mut b = [0u8; 8];
        self.mem.read_slice(&mut b, GuestAddress(at)).unwrap();
        (
            u32::from_le_bytes(b[0..4].try_into().unwrap()) as u16,
            u32::from_le_bytes(b[4..8].try_into().unwrap()),
        )
    }

    pub fn read(&self, addr: u64, len: usize) -> Vec<u8> {
        let mut buf = vec![0u8; len];
        self.mem.read_slice(&mut buf, GuestAddress(addr)).unwrap();
        buf
    }

    pub fn write(&self, addr: u64, data: &[u8]) {
        self.mem.write_slice(data, GuestAddress(addr)).unwrap();
    }
}

/// The activation context for a device driven by `drivers`.
pub fn activate_ctx(
    mem: &GuestMemoryMmap,
    irq: &Irq,
    drivers: &[&Driver<'_>],
) -> crate::devices::virtio::ActivateContext {
    crate::devices::virtio::ActivateContext {
        mem: mem.clone(),
        interrupt: irq.interrupt.clone(),
        queues: drivers.iter().map(|d| d.queue()).collect(),
        queue_events: drivers.iter().map(|d| d.event()).collect(),
    }
}

/// A small deterministic generator for the garbage tests (xorshift64*), so a failure
/// reproduces from its seed.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed.max(1))
    }

    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// A value in `0..n`.
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    pub fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.below(items.len() as u64) as usize]
    }
}
