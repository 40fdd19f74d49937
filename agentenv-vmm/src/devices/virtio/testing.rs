#![allow(dead_code)]
//! Test helpers for virtio devices: guest memory with a dirty bitmap, a driver side built on
//! virtio-queue's `MockSplitQueue`, and bounded waits on the used ring.

use std::num::NonZeroUsize;
use std::time::{Duration, Instant};

use virtio_bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
use virtio_queue::Queue;
use virtio_queue::desc::RawDescriptor;
use virtio_queue::desc::split::{Descriptor as SplitDescriptor, VirtqUsedElem};
use virtio_queue::mock::MockSplitQueue;
use vm_memory::bitmap::AtomicBitmap;
use vm_memory::mmap::MmapRegionBuilder;
use vm_memory::{GuestAddress, GuestMemoryRegion};

use crate::memory::{GuestMemoryMmap, GuestRegionMmap};

pub const PAGE: usize = 4096;

/// Anonymous guest memory of `size` bytes at guest address 0, with a dirty bitmap.
pub fn guest_memory(size: usize) -> GuestMemoryMmap {
    let bitmap = AtomicBitmap::new(size, NonZeroUsize::new(PAGE).unwrap());
    let region = MmapRegionBuilder::new_with_bitmap(size, Some(bitmap))
        .build()
        .unwrap();
    let region = GuestRegionMmap::new(region, GuestAddress(0)).unwrap();
    GuestMemoryMmap::from_regions(vec![region]).unwrap()
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

/// The driver side of one split queue.
pub struct Driver<'a> {
    pub mock: MockSplitQueue<'a, GuestMemoryMmap>,
    next_desc: u16,
    size: u16,
}

impl<'a> Driver<'a> {
    /// A queue of `size` entries whose rings start at `base`.
    pub fn new(mem: &'a GuestMemoryMmap, base: u64, size: u16) -> Self {
        Self {
            mock: MockSplitQueue::create(mem, GuestAddress(base), size),
            next_desc: 0,
            size,
        }
    }

    /// The device-side queue, configured and ready.
    pub fn queue(&self) -> Queue {
        self.mock.create_queue::<Queue>().unwrap()
    }

    fn take(&mut self, n: u16) -> u16 {
        if self.next_desc + n > self.size {
            self.next_desc = 0;
        }
        let first = self.next_desc;
        self.next_desc += n;
        first
    }

    /// Offers a well-formed chain; returns its head index.
    pub fn add(&mut self, descs: &[D]) -> u16 {
        let first = self.take(descs.len() as u16);
        let raw: Vec<RawDescriptor> = descs
            .iter()
            .enumerate()
            .map(|(i, d)| {
                let last = i + 1 == descs.len();
                let mut flags = if d.write { VRING_DESC_F_WRITE } else { 0 } as u16;
                if !last {
                    flags |= VRING_DESC_F_NEXT as u16;
                }
                let next = if last { 0 } else { first + i as u16 + 1 };
                RawDescriptor::from(SplitDescriptor::new(d.addr, d.len, flags, next))
            })
            .collect();
        self.mock.add_desc_chains(&raw, first).unwrap();
        first
    }

    /// Offers a chain whose last descriptor points back to its first (a loop).
    pub fn add_loop(&mut self, descs: &[D]) -> u16 {
        let first = self.take(descs.len() as u16);
        let raw: Vec<RawDescriptor> = descs
            .iter()
            .enumerate()
            .map(|(i, d)| {
                let last = i + 1 == descs.len();
                let mut flags = VRING_DESC_F_NEXT as u16;
                if d.write {
                    flags |= VRING_DESC_F_WRITE as u16;
                }
                let next = if last { first } else { first + i as u16 + 1 };
                RawDescriptor::from(SplitDescriptor::new(d.addr, d.len, flags, next))
            })
            .collect();
        // `add_desc_chains` adds an avail entry per descriptor whose predecessor has no NEXT
        // flag: here only the head.
        self.mock.add_desc_chains(&raw, first).unwrap();
        first
    }

    /// The used ring index.
    pub fn used_idx(&self) -> u16 {
        self.mock.used().idx().load()
    }

    /// Used ring entry `i`.
    pub fn used(&self, i: u16) -> VirtqUsedElem {
        self.mock
            .used()
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
