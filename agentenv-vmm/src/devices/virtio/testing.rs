#![allow(dead_code)]
//! Test helpers for virtio devices: guest memory with a dirty bitmap, a driver side built on
//! virtio-queue's `MockSplitQueue`, and bounded waits on the used ring.

use std::num::NonZeroUsize;
use std::time::{Duration, Instant};

use virtio_bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
use virtio_queue::desc::RawDescriptor;
use virtio_queue::desc::split::{Descriptor as SplitDescriptor, VirtqUsedElem};
use virtio_queue::mock::{AvailRing, DescriptorTable, UsedRing};
use virtio_queue::{Queue, QueueT};
use vm_memory::bitmap::AtomicBitmap;
use vm_memory::mmap::MmapRegionBuilder;
use vm_memory::{GuestAddress, GuestMemoryRegion};

use crate::memory::{GuestMemoryMmap, GuestRegionMmap};

pub const PAGE: usize = 4096;

/// Anonymous guest memory of `size` bytes at guest address 0, with a dirty bitmap.
pub fn guest_memory(size: usize) -> GuestMemoryMmap {
    let bitmap = AtomicBitmap::new(size, NonZeroUsize::new(PAGE).unwrap());
    let region = MmapRegionBuilder::new_with_bitmap(size, Some(bitmap))
        .with_mmap_prot(libc::PROT_READ | libc::PROT_WRITE)
        .with_mmap_flags(libc::MAP_ANONYMOUS | libc::MAP_PRIVATE | libc::MAP_NORESERVE)
        .build()
        .unwrap();
    let region = GuestRegionMmap::new(region, GuestAddress(0)).unwrap();
    GuestMemoryMmap::from_regions(vec![region]).unwrap()
}

/// Guest memory of `size` bytes at guest address 0 mapped shared from a memfd (like a VM
/// whose memory is a shared file for snapshots); the memfd is returned too.
pub fn guest_memory_shared_file(size: usize) -> (GuestMemoryMmap, std::fs::File) {
    use std::os::fd::FromRawFd;
    use vm_memory::FileOffset;
    // SAFETY: the name is a valid NUL-terminated string; the returned descriptor is checked
    // and then owned by the `File`.
    let fd = unsafe { libc::memfd_create(c"guest-mem-test".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
    // SAFETY: `fd` is a fresh descriptor nobody else owns.
    let file = unsafe { std::fs::File::from_raw_fd(fd) };
    file.set_len(size as u64).unwrap();
    let bitmap = AtomicBitmap::new(size, NonZeroUsize::new(PAGE).unwrap());
    let region = MmapRegionBuilder::new_with_bitmap(size, Some(bitmap))
        .with_file_offset(FileOffset::new(file.try_clone().unwrap(), 0))
        .with_mmap_prot(libc::PROT_READ | libc::PROT_WRITE)
        .with_mmap_flags(libc::MAP_SHARED)
        .build()
        .unwrap();
    let region = GuestRegionMmap::new(region, GuestAddress(0)).unwrap();
    (GuestMemoryMmap::from_regions(vec![region]).unwrap(), file)
}

/// Whether the device marked the page holding `addr` dirty.
pub fn is_dirty(mem: &GuestMemoryMmap, addr: u64) -> bool {
    use vm_memory::GuestMemoryBackend;
    use vm_memory::bitmap::Bitmap;
    let (region, offset) = mem.to_region_addr(GuestAddress(addr)).unwrap();
    region.bitmap().dirty_at(offset.0 as usize)
}

/// One descriptor as the test driver writes it: address, length, device-writable.
#[derive(Clone, Copy, Debug)]
pub struct D {
    pub addr: u64,
    pub len: u32,
    pub write: bool,
}

pub fn rd(addr: u64, len: u32) -> D {
    D {
        addr,
        len,
        write: false,
    }
}

pub fn wr(addr: u64, len: u32) -> D {
    D {
        addr,
        len,
        write: true,
    }
}

/// The driver side of one split queue, built from virtio-queue's mock rings. (The mock's own
/// `MockSplitQueue::create` lays the used ring over the tail of the available ring for
/// queues of 8 entries or more, so the layout is computed here.)
pub struct Driver<'a> {
    desc: DescriptorTable<'a, GuestMemoryMmap>,
    avail: AvailRing<'a, GuestMemoryMmap>,
    used: UsedRing<'a, GuestMemoryMmap>,
    desc_addr: u64,
    avail_addr: u64,
    used_addr: u64,
    next_desc: u16,
    pub size: u16,
}

impl<'a> Driver<'a> {
    /// A queue of `size` entries whose rings start at `base` (page aligned; the rings take
    /// `16 * size + 0x2000` bytes).
    pub fn new(mem: &'a GuestMemoryMmap, base: u64, size: u16) -> Self {
        let desc_addr = base;
        let avail_addr = base + 16 * u64::from(size);
        let used_addr = (avail_addr + 6 + 2 * u64::from(size) + 0xfff) & !0xfff;
        Self {
            desc: DescriptorTable::new(mem, GuestAddress(desc_addr), size),
            avail: AvailRing::new(mem, GuestAddress(avail_addr), size),
            used: UsedRing::new(mem, GuestAddress(used_addr), size),
            desc_addr,
            avail_addr,
            used_addr,
            next_desc: 0,
            size,
        }
    }

    /// The device-side queue, configured and ready.
    pub fn queue(&self) -> Queue {
        let mut q = Queue::new(self.size).unwrap();
        q.try_set_size(self.size).unwrap();
        q.try_set_desc_table_address(GuestAddress(self.desc_addr))
            .unwrap();
        q.try_set_avail_ring_address(GuestAddress(self.avail_addr))
            .unwrap();
        q.try_set_used_ring_address(GuestAddress(self.used_addr))
            .unwrap();
        q.set_ready(true);
        q
    }

    /// (descriptor table, available ring, used ring) addresses.
    pub fn addrs(&self) -> (u64, u64, u64) {
        (self.desc_addr, self.avail_addr, self.used_addr)
    }

    fn take(&mut self, n: u16) -> u16 {
        if self.next_desc + n > self.size {
            self.next_desc = 0;
        }
        let first = self.next_desc;
        self.next_desc += n;
        first
    }

    fn publish(&mut self, head: u16) {
        let idx = self.avail.idx().load();
        self.avail
            .ring()
            .ref_at(usize::from(idx % self.size))
            .unwrap()
            .store(head);
        self.avail.idx().store(idx.wrapping_add(1));
    }

    fn write_chain(&mut self, descs: &[D], looped: bool) -> u16 {
        let first = self.take(descs.len() as u16);
        for (i, d) in descs.iter().enumerate() {
            let last = i + 1 == descs.len();
            let mut flags = if d.write { VRING_DESC_F_WRITE } else { 0 } as u16;
            if !last || looped {
                flags |= VRING_DESC_F_NEXT as u16;
            }
            let next = match (last, looped) {
                (true, true) => first,
                (true, false) => 0,
                _ => first + i as u16 + 1,
            };
            self.desc
                .store(
                    first + i as u16,
                    RawDescriptor::from(SplitDescriptor::new(d.addr, d.len, flags, next)),
                )
                .unwrap();
        }
        self.publish(first);
        first
    }

    /// Offers a well-formed chain; returns its head index.
    pub fn add(&mut self, descs: &[D]) -> u16 {
        self.write_chain(descs, false)
    }

    /// Offers a chain whose last descriptor points back to its first (a loop).
    pub fn add_loop(&mut self, descs: &[D]) -> u16 {
        self.write_chain(descs, true)
    }

    /// Offers a chain whose head has NEXT set with a next index past the table.
    pub fn add_dangling(&mut self, d: D) -> u16 {
        let first = self.take(1);
        let flags = VRING_DESC_F_NEXT as u16
            | if d.write {
                VRING_DESC_F_WRITE as u16
            } else {
                0
            };
        self.desc
            .store(
                first,
                RawDescriptor::from(SplitDescriptor::new(d.addr, d.len, flags, self.size + 3)),
            )
            .unwrap();
        self.publish(first);
        first
    }

    /// The used ring index.
    pub fn used_idx(&self) -> u16 {
        self.used.idx().load()
    }

    /// Used ring entry `i`.
    pub fn used(&self, i: u16) -> VirtqUsedElem {
        self.used
            .ring()
            .ref_at(usize::from(i % self.size))
            .unwrap()
            .load()
    }

    /// Waits (bounded) until the used index reaches `n`, then returns entry `n - 1`.
    pub fn wait_used(&self, n: u16) -> VirtqUsedElem {
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.used_idx() < n {
            assert!(
                Instant::now() < deadline,
                "used index stayed at {} (waiting for {n})",
                self.used_idx()
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        self.used(n - 1)
    }
}

/// Drives a transport through the virtio 1.x initialization: negotiates `features` and sets
/// up one queue per driver, then sets DRIVER_OK.
pub fn mmio_bring_up(
    t: &mut crate::devices::virtio::mmio::MmioTransport,
    features: u64,
    queues: &[&Driver],
) {
    use crate::devices::BusDevice;
    use crate::devices::virtio::mmio::status::*;
    let mut w = |off: u64, v: u32| t.write(off, &v.to_le_bytes());
    w(0x70, ACKNOWLEDGE);
    w(0x70, ACKNOWLEDGE | DRIVER);
    w(0x24, 0);
    w(0x20, features as u32);
    w(0x24, 1);
    w(0x20, (features >> 32) as u32);
    w(0x70, ACKNOWLEDGE | DRIVER | FEATURES_OK);
    for (i, d) in queues.iter().enumerate() {
        let (desc, avail, used) = d.addrs();
        w(0x30, i as u32);
        w(0x38, u32::from(d.size));
        w(0x80, desc as u32);
        w(0x84, (desc >> 32) as u32);
        w(0x90, avail as u32);
        w(0x94, (avail >> 32) as u32);
        w(0xa0, used as u32);
        w(0xa4, (used >> 32) as u32);
        w(0x44, 1);
    }
    w(0x70, ACKNOWLEDGE | DRIVER | FEATURES_OK | DRIVER_OK);
}

/// A named way of offering one malformed request.
pub type BadChain = (&'static str, fn(&mut Driver));

/// Polls `cond` until it holds or 10 s pass.
pub fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Guest memory size helper for region checks.
pub fn mem_end(mem: &GuestMemoryMmap) -> u64 {
    use vm_memory::GuestMemoryBackend;
    mem.iter()
        .map(|r| r.start_addr().0 + r.len())
        .max()
        .unwrap_or(0)
}
