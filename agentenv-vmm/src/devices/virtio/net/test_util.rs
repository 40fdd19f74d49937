//! Test helpers shared by the net and vsock device tests: guest memory with a dirty
//! bitmap, a driver-side queue built on virtio-queue's mock, and bounded waits on the
//! device's interrupt.

use std::num::NonZeroUsize;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use virtio_queue::Queue;
use virtio_queue::desc::RawDescriptor;
use virtio_queue::desc::split::Descriptor as SplitDescriptor;
use virtio_queue::mock::MockSplitQueue;
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

/// The driver side of one split queue.
pub struct Driver<'a> {
    mem: &'a GuestMemoryMmap,
    mock: MockSplitQueue<'a, GuestMemoryMmap>,
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
        Driver {
            mem,
            mock: MockSplitQueue::create(mem, GuestAddress(base), size),
            size,
            next_desc: 0,
            avail_idx: 0,
            next_buf: buf_base,
            notify: EventFd::new(EFD_NONBLOCK).unwrap(),
        }
    }

    /// The device-side queue, set up as a transport would after the driver's writes.
    pub fn queue(&self) -> Queue {
        self.mock.create_queue::<Queue>().unwrap()
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

    /// Writes raw descriptors at the given table indexes (no fix-ups) and publishes `head`.
    pub fn add_raw(&mut self, descs: &[(u16, u64, u32, u16, u16)], head: u16) {
        for &(index, addr, len, flags, next) in descs {
            let desc = RawDescriptor::from(SplitDescriptor::new(addr, len, flags, next));
            self.mock.desc_table().store(index, desc).unwrap();
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
            let desc = RawDescriptor::from(SplitDescriptor::new(addr, len, flags, next));
            self.mock.desc_table().store(index, desc).unwrap();
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
        self.mock
            .avail()
            .ring()
            .ref_at(usize::from(self.avail_idx % self.size))
            .unwrap()
            .store(head);
        self.avail_idx = self.avail_idx.wrapping_add(1);
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        self.mock.avail().idx().store(self.avail_idx);
    }

    /// Tells the device to look at the queue.
    pub fn kick(&self) {
        self.notify.write(1).unwrap();
    }

    /// How many chains the device has used so far.
    pub fn used_idx(&self) -> u16 {
        self.mock.used().idx().load()
    }

    /// The `n`-th used element: (head index, length written).
    pub fn used(&self, n: u16) -> (u16, u32) {
        let elem = self
            .mock
            .used()
            .ring()
            .ref_at(usize::from(n % self.size))
            .unwrap()
            .load();
        (elem.id() as u16, elem.len())
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
