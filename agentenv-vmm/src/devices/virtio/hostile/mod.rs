//! Hostile drivers for the devices' property tests.
//!
//! The guest kernel is untrusted: whatever it writes in a descriptor table or a ring is
//! input. A [`QueueGen`] is one such queue: descriptor chains whose buffers lie anywhere
//! (inside guest memory, across the seam of two regions, in a hole, past the end, where
//! `addr + len` overflows), with any lengths and flags; chains that loop, point past the
//! table, run into each other or never end; indirect tables that are short, misaligned,
//! nested, too large or off guest memory; an available ring whose entries name any index
//! and whose index may be anything, also more than a queue ahead; rings at any position of
//! their 16-bit counters, with or without `EVENT_IDX`.
//!
//! [`walk`] reads a chain the way the virtio spec (and virtio-queue) does, independently of
//! the devices, so a test knows which buffers each offered chain names, and [`Snapshot`]
//! reports afterwards every byte of guest memory a device changed and every page it marked
//! dirty, to compare with what the descriptors allowed.
//!
//! Guest memory (three regions, one hole):
//!
//! | range                 | what                                                    |
//! |-----------------------|---------------------------------------------------------|
//! | 0x0_0000..0x0_1000    | a spare page (page frame 0)                             |
//! | 0x0_1000..0x0_9000    | the rings of up to [`MAX_QUEUES`] queues, 0x2000 each     |
//! | 0x0_9000..0x1_0000    | pinned: headers and page lists the test writes          |
//! | 0x1_0000..0x1_4000    | indirect tables, 0x1000 per queue; region 0 ends here   |
//! | 0x1_4000..0x2_0000    | hole                                                    |
//! | 0x2_0000..0x10_0000   | region 1: data                                          |
//! | 0x10_0000..0x18_0000  | region 2, adjacent to region 1: data; memory ends here |
//!
//! Region 0 is only ever device-readable: the generator moves a device-writable buffer that
//! would start there up into region 1, lets an indirect descriptor point only into the
//! indirect tables (or at no memory), and keeps `next` indices inside indirect tables small
//! enough never to reach region 1. So nothing a device writes can change a descriptor or
//! an available ring under the model, and the model stays exact while the device runs.
//! (Region 0 is shared memory, so that a balloon told to release the pages of the rings
//! leaves them as they were; see [`guest_memory`].)
//!
//! Each device's tests (`proptests` beside the device) build the queues, run the device's
//! own queue-processing code on a thread of its own ([`bounded`], so a loop fails the test
//! instead of hanging it) and compare what it did with the model: the used ring, the bytes
//! changed, the pages marked dirty.

mod changes;
mod generate;
mod model;

pub use changes::*;
pub use generate::*;
pub use model::*;

use std::num::NonZeroUsize;
use std::sync::mpsc;
use std::time::Duration;

use proptest::collection::vec;
use proptest::prelude::*;
use proptest::sample::select;
use proptest::strategy::BoxedStrategy;
use proptest::test_runner::TestCaseError;
use virtio_queue::{Queue, QueueT};
use vm_memory::bitmap::AtomicBitmap;
use vm_memory::mmap::{MmapRegion, MmapRegionBuilder};
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryRegion};

use crate::memory::{GuestMemoryMmap, GuestRegionMmap, PAGE_SIZE};

/// The regions of guest memory, `(start, end)`.
pub const REGIONS: [(u64, u64); 3] = [(0, 0x1_4000), (0x2_0000, 0x10_0000), (0x10_0000, MEM_END)];
/// Where guest memory ends.
pub const MEM_END: u64 = 0x18_0000;
/// The hole between region 0 and region 1.
pub const HOLE: (u64, u64) = (0x1_4000, 0x2_0000);
/// The queues one guest may have.
pub const MAX_QUEUES: usize = 4;
/// Where the rings start (page 1).
pub const RINGS: u64 = 0x1000;
const RING_STRIDE: u64 = 0x2000;
const AVAIL_OFF: u64 = 0x1000;
const USED_OFF: u64 = 0x1400;
/// Headers and lists the test writes for device-readable buffers; never device-writable.
pub const PINNED: (u64, u64) = (0x9000, 0x1_0000);
/// Where the indirect tables start; they end with region 0.
pub const INDIRECT_TABLES: u64 = 0x1_0000;
const INDIRECT_STRIDE: u64 = 0x1000;
/// Entries of the indirect-table area of one queue.
const INDIRECT_ENTRIES: usize = 256;
/// `next` indices inside the indirect tables stay below this: from anywhere in the area,
/// 1024 entries end inside the hole, before region 1.
const INDIRECT_NEXT_LIMIT: u16 = 1024;
/// Where device-writable buffers may lie.
pub const DATA: (u64, u64) = (0x2_0000, MEM_END);
/// The edges buffers are put across: region 0's end, the hole's end, the seam of regions
/// 1 and 2, the end of memory.
const EDGES: [u64; 4] = [HOLE.0, HOLE.1, REGIONS[2].0, MEM_END];

pub const VRING_DESC_F_NEXT: u16 = 1;
pub const VRING_DESC_F_WRITE: u16 = 2;
pub const VRING_DESC_F_INDIRECT: u16 = 4;

/// Lengths at or next to the limits some device cares about (headers of 12, 16, 44 bytes,
/// sectors, the 64 KiB frame and packet limits, the 2^32 chain limit).
#[rustfmt::skip]
pub const EDGE_LENS: [u32; 27] = [
    0, 1, 2, 3, 4, 11, 12, 13, 16, 17, 43, 44, 45, 100, 511, 512, 513, 1024, 4096, 0x1_0000,
    65_562, 65_563, 0x10_0000, 0x7fff_ffff, 0xffff_fe00, 0xffff_fff0, u32::MAX,
];

// ---- guest memory ----------------------------------------------------------------------

/// Fresh guest memory laid out as the module documentation says, with a dirty bitmap per
/// region in the VMM's page size.
pub fn guest_memory() -> GuestMemoryMmap {
    let regions = REGIONS
        .iter()
        .map(|&(start, end)| {
            let size = (end - start) as usize;
            let bitmap = AtomicBitmap::new(size, NonZeroUsize::new(PAGE_SIZE).unwrap());
            // Region 0 (the rings and tables) is shared anonymous memory: a page the
            // balloon releases there (`MADV_DONTNEED`) keeps its contents, so a guest that
            // gives up the pages of its own rings does not pull them from under the model.
            // Regions 1 and 2 are private, as the VMM's memory is: released pages read zero.
            let sharing = if start == 0 {
                libc::MAP_SHARED
            } else {
                libc::MAP_PRIVATE
            };
            let region = MmapRegionBuilder::new_with_bitmap(size, Some(bitmap))
                .with_mmap_prot(libc::PROT_READ | libc::PROT_WRITE)
                .with_mmap_flags(libc::MAP_ANONYMOUS | sharing | libc::MAP_NORESERVE)
                .build()
                .unwrap();
            GuestRegionMmap::new(region, GuestAddress(start)).unwrap()
        })
        .collect();
    GuestMemoryMmap::from_regions(regions).unwrap()
}

/// Fills guest memory with a pattern that depends on `seed`, so that a device write is
/// very unlikely to leave a byte as it was.
pub fn fill(mem: &GuestMemoryMmap, seed: u64) {
    // One pseudo-random page, rotated by a different amount for every page (cheap enough
    // for unoptimized test builds, and no two nearby pages alike).
    let mut x = seed | 1;
    let mut pattern = vec![0u8; 2 * PAGE_SIZE];
    for chunk in pattern[..PAGE_SIZE].chunks_exact_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        chunk.copy_from_slice(&x.to_le_bytes());
    }
    pattern.copy_within(..PAGE_SIZE, PAGE_SIZE);
    for &(start, end) in &REGIONS {
        let mut bytes = Vec::with_capacity((end - start) as usize);
        for page in (start..end).step_by(PAGE_SIZE) {
            let shift = ((page / PAGE_SIZE as u64).wrapping_mul(0x9e37_79b9) as usize) % PAGE_SIZE;
            bytes.extend_from_slice(&pattern[shift..shift + PAGE_SIZE]);
        }
        mem.write_slice(&bytes, GuestAddress(start)).unwrap();
    }
}

/// Whether `[addr, addr + len)` is guest memory (across adjacent regions too); an empty
/// range is, wherever it is (as for vm-memory's `check_range`, which the devices use).
pub fn in_memory(mem: &GuestMemoryMmap, addr: u64, len: u64) -> bool {
    match usize::try_from(len) {
        Ok(0) => true,
        Ok(len) => {
            addr.checked_add(len as u64).is_some()
                && GuestMemoryBackend::check_range(mem, GuestAddress(addr), len)
        }
        Err(_) => false,
    }
}

/// Whether the test may write `[addr, addr + len)` as content of a device-readable buffer
/// (a header, a page list) without changing a ring or a table.
pub fn content_may_go_at(mem: &GuestMemoryMmap, addr: u64, len: u64) -> bool {
    let end = addr.saturating_add(len);
    in_memory(mem, addr, len) && (addr >= DATA.0 || (addr >= PINNED.0 && end <= PINNED.1))
}

fn mapped(addr: u64) -> bool {
    REGIONS.iter().any(|&(s, e)| (s..e).contains(&addr))
}

// ---- running the device ------------------------------------------------------------------

/// The property tests' configuration: 256 cases, a second or two per device in an
/// unoptimized build; `PROPTEST_CASES=n` runs `n` instead (a longer soak).
pub fn config() -> ProptestConfig {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(256);
    ProptestConfig {
        cases,
        ..ProptestConfig::default()
    }
}

/// Runs `f` on a thread of its own and fails if it does not return within 30 s (a device
/// spinning on a descriptor loop or a bogus available index); a panic in `f` is the
/// test's panic.
pub fn bounded<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    let thread = std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(Duration::from_secs(30)) {
        Ok(v) => v,
        Err(mpsc::RecvTimeoutError::Disconnected) => match thread.join() {
            Err(panic) => std::panic::resume_unwind(panic),
            Ok(()) => unreachable!("the thread sends its result before it ends"),
        },
        Err(mpsc::RecvTimeoutError::Timeout) => {
            panic!("the device did not finish within 30 s: it is looping on the queue")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plain(bufs: &[(AddrGen, u32, bool)]) -> ChainGen {
        ChainGen {
            bufs: bufs
                .iter()
                .map(|(addr, len, write)| BufGen {
                    addr: addr.clone(),
                    len: *len,
                    write: *write,
                    content: Vec::new(),
                })
                .collect(),
            shape: Shape::Plain,
        }
    }

    fn one_queue(chains: Vec<ChainGen>, size_log2: u8) -> QueueGen {
        let n = chains.len() as u8;
        QueueGen {
            size_log2,
            chains,
            first_desc: 0,
            garbage: vec![GarbageGen {
                addr: AddrGen::Data(0),
                len: 0,
                flags: 0,
                next: 0,
            }],
            avail: (0..n).map(AvailGen::Chain).collect(),
            start: u16::MAX,
            idx: IdxGen::Exact,
            event_idx: false,
            used_event: 0,
            avail_flags: 0,
            readable_off: Vec::new(),
        }
    }

    #[test]
    fn the_model_reads_plain_indirect_and_broken_chains_like_virtio_queue() {
        use crate::devices::virtio::queue_util::walk_chain;
        let mem = guest_memory();
        fill(&mem, 1);
        let bufs = [
            (AddrGen::Pinned(0), 16, false),
            (AddrGen::Data(0x100), 512, true),
            (AddrGen::Data(0x1000), 1, true),
        ];
        let mut chains = vec![plain(&bufs)];
        for shape in [
            Shape::Loop(0),
            Shape::Dangling(3),
            Shape::Indirect {
                at: 5,
                len: IndLen::Exact,
                next: false,
            },
            Shape::Indirect {
                at: 5,
                len: IndLen::Misaligned(3),
                next: false,
            },
            Shape::NestedIndirect { at: 40, pos: 1 },
            Shape::MidIndirect {
                pos: 0,
                at: 80,
                len: IndLen::Exact,
            },
            Shape::IndirectUnmapped {
                which: 3,
                entries: 2,
            },
            // Runs on into the garbage after it, which ends.
            Shape::NoEnd,
        ] {
            chains.push(ChainGen {
                shape,
                ..plain(&bufs)
            });
        }
        let queue_gen = one_queue(chains, 6);
        let (mut queue, layout) = queue_gen.build(&mem, 1);
        let model = offered(&mem, &layout);
        let terminated: Vec<bool> = model.iter().map(|c| c.terminated).collect();
        assert_eq!(
            terminated,
            [true, false, false, true, false, false, true, false, true]
        );
        assert_eq!(model[0].descs.len(), 3);
        assert_eq!(
            model[1].descs.len(),
            64,
            "a loop stops after a queue's worth"
        );
        assert_eq!(model[3].descs, model[0].descs, "the indirect chain");
        assert_eq!(model[6].descs, model[0].descs, "the chain going indirect");
        assert_eq!(model[8].descs.len(), 4, "the chain without an end");
        // virtio-queue agrees on every chain.
        for c in &model {
            let chain = queue.pop_descriptor_chain(&mem).unwrap();
            assert_eq!(chain.head_index(), c.head);
            match walk_chain(chain) {
                Ok(d) => {
                    assert!(c.terminated);
                    let got: Vec<MDesc> = d
                        .iter()
                        .map(|d| MDesc {
                            addr: d.addr.0,
                            len: d.len,
                            write: d.write,
                        })
                        .collect();
                    assert_eq!(got, c.descs);
                }
                Err(_) => assert!(!c.terminated, "{c:?}"),
            }
        }
        assert!(queue.pop_descriptor_chain(&mem).is_none());
    }

    proptest! {
        #![proptest_config(config())]

        /// The device tests trust the model; here it is held against virtio-queue itself.
        #[test]
        fn the_model_walks_any_hostile_chain_exactly_as_virtio_queue_does(
            q in queue(chain(0.5)),
            seed: u64,
        ) {
            let mem = guest_memory();
            fill(&mem, seed);
            let (mut queue, layout) = q.build(&mem, 2);
            let model = offered(&mem, &layout);
            for c in &model {
                let chain = queue.pop_descriptor_chain(&mem);
                prop_assert!(chain.is_some(), "virtio-queue offers fewer chains than the model");
                let chain = chain.unwrap();
                prop_assert_eq!(chain.head_index(), c.head);
                let mut last_next = false;
                let got: Vec<MDesc> = chain
                    .map(|d| {
                        last_next = d.has_next();
                        MDesc { addr: d.addr().0, len: d.len(), write: d.is_write_only() }
                    })
                    .collect();
                prop_assert_eq!(&got, &c.descs);
                prop_assert_eq!(!got.is_empty() && !last_next, c.terminated);
            }
            prop_assert!(queue.pop_descriptor_chain(&mem).is_none(), "virtio-queue offers more chains than the model");
        }
    }

    #[test]
    fn writable_buffers_never_land_in_region_zero() {
        let mut d = RawDesc {
            addr: RINGS + 8,
            len: 64,
            flags: VRING_DESC_F_WRITE,
            next: 0,
        };
        d.sanitize(false, &[]);
        assert!(d.addr >= DATA.0);
        let mut ind = RawDesc {
            addr: DATA.0 + 0x40,
            len: 32,
            flags: VRING_DESC_F_INDIRECT,
            next: 5000,
        };
        ind.sanitize(true, &[]);
        assert_eq!(ind.flags & VRING_DESC_F_INDIRECT, 0);
        assert!(ind.next < INDIRECT_NEXT_LIMIT);
    }

    #[test]
    fn byte_sets_find_what_lies_outside() {
        let mut a = ByteSet::default();
        let mut b = ByteSet::default();
        a.insert(100, 200);
        b.insert(0, 250);
        assert_eq!(a.first_outside(&b), Some(250));
        b.insert(250, 50);
        assert_eq!(a.first_outside(&b), None);
        a.insert(MEM_END - 1, u64::MAX);
        assert!(a.contains(MEM_END - 1) && !a.contains(MEM_END));
        assert!(a.touches_page(0) && !a.touches_page(0x1000));
    }
}
