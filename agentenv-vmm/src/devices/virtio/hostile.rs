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

// ---- what the generator draws ------------------------------------------------------------

/// Where a buffer lies.
#[derive(Debug, Clone)]
pub enum AddrGen {
    /// Somewhere in regions 1 and 2.
    Data(u32),
    /// Next to one of the [`EDGES`].
    Edge(u8, i16),
    Hole(u16),
    PastEnd(u32),
    /// Within 64 KiB of the top of the address space: `addr + len` overflows.
    NearMax(u16),
    Pinned(u16),
    /// The spare page, the rings and the pinned area (device-readable only).
    Low(u16),
    Wild(u64),
}

impl AddrGen {
    pub fn resolve(&self) -> u64 {
        match *self {
            AddrGen::Data(o) => DATA.0 + u64::from(o) % (DATA.1 - DATA.0),
            AddrGen::Edge(which, d) => {
                EDGES[usize::from(which) % EDGES.len()].wrapping_add_signed(i64::from(d))
            }
            AddrGen::Hole(o) => HOLE.0 + u64::from(o) % (HOLE.1 - HOLE.0),
            AddrGen::PastEnd(o) => MEM_END + u64::from(o),
            AddrGen::NearMax(o) => u64::MAX - u64::from(o),
            AddrGen::Pinned(o) => PINNED.0 + u64::from(o) % (PINNED.1 - PINNED.0),
            AddrGen::Low(o) => u64::from(o) % INDIRECT_TABLES,
            AddrGen::Wild(a) => a,
        }
    }
}

/// One buffer of a chain.
#[derive(Debug, Clone)]
pub struct BufGen {
    pub addr: AddrGen,
    pub len: u32,
    pub write: bool,
    /// What the driver wrote there (a header, a page list), when the buffer lies where the
    /// test may write ([`content_may_go_at`]).
    pub content: Vec<u8>,
}

/// How the length of an indirect descriptor relates to the table behind it.
#[derive(Debug, Clone)]
pub enum IndLen {
    Exact,
    /// Fewer entries than the chain has.
    Short(u8),
    /// More entries: the walk reads on into other tables or off region 0.
    Long(u16),
    /// Not a multiple of 16.
    Misaligned(u8),
    Zero,
    /// 65535 entries, the most a table may have.
    MaxEntries,
    /// 65536 entries, one too many.
    TooMany,
}

impl IndLen {
    fn bytes(&self, entries: usize) -> u32 {
        let n = entries as u32;
        match *self {
            IndLen::Exact => 16 * n,
            IndLen::Short(k) => 16 * (n - u32::from(k) % n),
            IndLen::Long(k) => 16 * (n + u32::from(k)),
            IndLen::Misaligned(k) => 16 * n + 1 + u32::from(k) % 15,
            IndLen::Zero => 0,
            IndLen::MaxEntries => 16 * 65_535,
            IndLen::TooMany => 16 * 65_536,
        }
    }
}

/// How a chain's descriptors are linked.
#[derive(Debug, Clone)]
pub enum Shape {
    Plain,
    /// The last descriptor points back at one of the chain's.
    Loop(u8),
    /// The last descriptor points past the table.
    Dangling(u16),
    /// The last descriptor points at the head of an earlier chain.
    LinkTo(u8),
    /// The last descriptor keeps NEXT and points at the slot after it.
    NoEnd,
    /// The head is an indirect descriptor for a table holding the chain.
    Indirect {
        at: u8,
        len: IndLen,
        next: bool,
    },
    /// The chain starts in the queue's table and goes on in an indirect table.
    MidIndirect {
        pos: u8,
        at: u8,
        len: IndLen,
    },
    /// An indirect table that holds an indirect descriptor.
    NestedIndirect {
        at: u8,
        pos: u8,
    },
    /// An indirect descriptor whose table is not in guest memory (or runs off it at once).
    IndirectUnmapped {
        which: u8,
        entries: u8,
    },
    /// Random bits flipped in one descriptor's flags.
    FlagNoise {
        pos: u8,
        bits: u16,
    },
}

/// One chain as the driver offers it.
#[derive(Debug, Clone)]
pub struct ChainGen {
    pub bufs: Vec<BufGen>,
    pub shape: Shape,
}

/// A descriptor of the table that no chain uses.
#[derive(Debug, Clone)]
pub struct GarbageGen {
    pub addr: AddrGen,
    pub len: u32,
    pub flags: u16,
    pub next: u16,
}

/// An entry of the available ring.
#[derive(Debug, Clone)]
pub enum AvailGen {
    /// The head of chain `n` (modulo the chain count).
    Chain(u8),
    /// Any index.
    Raw(u16),
}

/// The available index the driver publishes.
#[derive(Debug, Clone)]
pub enum IdxGen {
    /// Exactly the entries written.
    Exact,
    /// Fewer.
    Fewer(u8),
    /// More than written (more than the queue holds when large enough).
    More(u16),
    Any(u16),
}

/// One queue as a hostile driver sets it up.
#[derive(Debug, Clone)]
pub struct QueueGen {
    pub size_log2: u8,
    pub chains: Vec<ChainGen>,
    pub first_desc: u16,
    pub garbage: Vec<GarbageGen>,
    pub avail: Vec<AvailGen>,
    /// Where the device's ring positions start (they wrap at 2^16).
    pub start: u16,
    pub idx: IdxGen,
    pub event_idx: bool,
    pub used_event: u16,
    pub avail_flags: u16,
    /// Ranges device-readable buffers are kept off too (moved to the start of region 1),
    /// for a device that acts on what it reads: the balloon releases the pages it is told,
    /// so its lists must not be where it releases pages or where the rings change.
    pub readable_off: Vec<(u64, u64)>,
}

// ---- strategies --------------------------------------------------------------------------

/// Any buffer address, mostly inside guest memory.
pub fn any_addr() -> BoxedStrategy<AddrGen> {
    prop_oneof![
        6 => any::<u32>().prop_map(AddrGen::Data),
        3 => (any::<u8>(), -0x1000i16..0x1000).prop_map(|(w, d)| AddrGen::Edge(w, d)),
        1 => any::<u16>().prop_map(AddrGen::Hole),
        1 => any::<u32>().prop_map(AddrGen::PastEnd),
        1 => any::<u16>().prop_map(AddrGen::NearMax),
        2 => any::<u16>().prop_map(AddrGen::Pinned),
        1 => any::<u16>().prop_map(AddrGen::Low),
        1 => any::<u64>().prop_map(AddrGen::Wild),
    ]
    .boxed()
}

/// Mostly the pinned area (where the test writes headers), sometimes anywhere.
pub fn pinned_addr() -> BoxedStrategy<AddrGen> {
    prop_oneof![3 => any::<u16>().prop_map(AddrGen::Pinned), 1 => any_addr()].boxed()
}

/// Mostly regions 1 and 2, sometimes anywhere.
pub fn data_addr() -> BoxedStrategy<AddrGen> {
    prop_oneof![4 => any::<u32>().prop_map(AddrGen::Data), 1 => any_addr()].boxed()
}

/// Any length, mostly one at a limit or a small one.
pub fn any_len() -> BoxedStrategy<u32> {
    prop_oneof![
        4 => select(EDGE_LENS.to_vec()),
        3 => 0u32..700,
        2 => (1u32..=80).prop_map(|s| s * 512),
        1 => any::<u32>(),
    ]
    .boxed()
}

/// A length that is `usual` most of the time.
pub fn len_or(usual: u32) -> BoxedStrategy<u32> {
    prop_oneof![3 => Just(usual), 1 => any_len()].boxed()
}

/// A buffer device-writable with probability `write`.
pub fn buf(
    addr: BoxedStrategy<AddrGen>,
    len: BoxedStrategy<u32>,
    write: f64,
) -> BoxedStrategy<BufGen> {
    (addr, len, prop::bool::weighted(write))
        .prop_map(|(addr, len, write)| BufGen {
            addr,
            len,
            write,
            content: Vec::new(),
        })
        .boxed()
}

fn ind_len() -> BoxedStrategy<IndLen> {
    prop_oneof![
        4 => Just(IndLen::Exact),
        1 => any::<u8>().prop_map(IndLen::Short),
        1 => (1u16..1100).prop_map(IndLen::Long),
        1 => any::<u8>().prop_map(IndLen::Misaligned),
        1 => Just(IndLen::Zero),
        1 => Just(IndLen::MaxEntries),
        1 => Just(IndLen::TooMany),
    ]
    .boxed()
}

/// Any way of linking a chain, mostly a plain one.
pub fn shape() -> BoxedStrategy<Shape> {
    prop_oneof![
        16 => Just(Shape::Plain),
        1 => any::<u8>().prop_map(Shape::Loop),
        1 => any::<u16>().prop_map(Shape::Dangling),
        1 => any::<u8>().prop_map(Shape::LinkTo),
        1 => Just(Shape::NoEnd),
        3 => (any::<u8>(), ind_len(), prop::bool::weighted(0.2))
            .prop_map(|(at, len, next)| Shape::Indirect { at, len, next }),
        1 => (any::<u8>(), any::<u8>(), ind_len())
            .prop_map(|(pos, at, len)| Shape::MidIndirect { pos, at, len }),
        1 => (any::<u8>(), any::<u8>()).prop_map(|(at, pos)| Shape::NestedIndirect { at, pos }),
        1 => (any::<u8>(), any::<u8>())
            .prop_map(|(which, entries)| Shape::IndirectUnmapped { which, entries }),
        2 => (any::<u8>(), any::<u16>()).prop_map(|(pos, bits)| Shape::FlagNoise { pos, bits }),
    ]
    .boxed()
}

/// A chain of one to five buffers, each device-writable with probability `write`.
pub fn chain(write: f64) -> BoxedStrategy<ChainGen> {
    (vec(buf(data_addr(), any_len(), write), 1..=5), shape())
        .prop_map(|(bufs, shape)| ChainGen { bufs, shape })
        .boxed()
}

/// Chains made of `bufs`, linked in any [`shape`].
pub fn chain_of(bufs: BoxedStrategy<Vec<BufGen>>) -> BoxedStrategy<ChainGen> {
    (bufs, shape())
        .prop_map(|(bufs, shape)| ChainGen { bufs, shape })
        .boxed()
}

/// Chains of `bufs`: half of them plain, a quarter linked in any [`shape`], a quarter any
/// [`chain`] at all (buffers device-writable with probability `write`).
pub fn mostly_plain(bufs: BoxedStrategy<Vec<BufGen>>, write: f64) -> BoxedStrategy<ChainGen> {
    prop_oneof![
        2 => bufs.clone().prop_map(|bufs| ChainGen { bufs, shape: Shape::Plain }),
        1 => chain_of(bufs),
        1 => chain(write),
    ]
    .boxed()
}

fn garbage() -> BoxedStrategy<GarbageGen> {
    (
        any_addr(),
        any_len(),
        prop_oneof![3 => 0u16..8, 1 => any::<u16>()],
        any::<u16>(),
    )
        .prop_map(|(addr, len, flags, next)| GarbageGen {
            addr,
            len,
            flags,
            next,
        })
        .boxed()
}

/// A queue offering chains drawn from `chain`.
pub fn queue(chain: BoxedStrategy<ChainGen>) -> BoxedStrategy<QueueGen> {
    let size_log2 = prop_oneof![1 => 0u8..=2, 2 => 3u8..=5, 1 => 6u8..=8];
    let avail = prop_oneof![
        12 => any::<u8>().prop_map(AvailGen::Chain),
        1 => any::<u16>().prop_map(AvailGen::Raw),
    ];
    let idx = prop_oneof![
        16 => Just(IdxGen::Exact),
        1 => any::<u8>().prop_map(IdxGen::Fewer),
        1 => any::<u16>().prop_map(IdxGen::More),
        1 => any::<u16>().prop_map(IdxGen::Any),
    ];
    // No more chains than fit the table, so that most survive; some overwrite others all
    // the same (the chains of small tables wrap around).
    let chains = size_log2.prop_flat_map(move |l| {
        let fit = ((1usize << l) / 2).clamp(1, 10);
        (Just(l), vec(chain.clone(), 1..=fit))
    });
    (
        (chains, any::<u16>(), vec(garbage(), 1..6)),
        (
            vec(avail, 0..16),
            prop_oneof![2 => Just(0u16), 1 => Just(u16::MAX - 2), 2 => any::<u16>()],
            idx,
            any::<bool>(),
            any::<u16>(),
            prop_oneof![3 => Just(0u16), 1 => any::<u16>()],
        ),
    )
        .prop_map(
            |(
                ((size_log2, chains), first_desc, garbage),
                (avail, start, idx, event_idx, used_event, avail_flags),
            )| QueueGen {
                size_log2,
                chains,
                first_desc,
                garbage,
                avail,
                start,
                idx,
                event_idx,
                used_event,
                avail_flags,
                readable_off: Vec::new(),
            },
        )
        .boxed()
}

// ---- building a queue in guest memory -----------------------------------------------------

#[derive(Debug, Clone, Copy, Default)]
struct RawDesc {
    addr: u64,
    len: u32,
    flags: u16,
    next: u16,
}

impl RawDesc {
    fn to_bytes(self) -> [u8; 16] {
        let mut b = [0u8; 16];
        b[0..8].copy_from_slice(&self.addr.to_le_bytes());
        b[8..12].copy_from_slice(&self.len.to_le_bytes());
        b[12..14].copy_from_slice(&self.flags.to_le_bytes());
        b[14..16].copy_from_slice(&self.next.to_le_bytes());
        b
    }

    fn parse(b: &[u8; 16]) -> Self {
        RawDesc {
            addr: u64::from_le_bytes(b[0..8].try_into().unwrap()),
            len: u32::from_le_bytes(b[8..12].try_into().unwrap()),
            flags: u16::from_le_bytes(b[12..14].try_into().unwrap()),
            next: u16::from_le_bytes(b[14..16].try_into().unwrap()),
        }
    }

    fn of(b: &BufGen) -> Self {
        RawDesc {
            addr: b.addr.resolve(),
            len: b.len,
            flags: if b.write { VRING_DESC_F_WRITE } else { 0 },
            next: 0,
        }
    }

    /// Keeps region 0 device-readable and indirect tables where the model holds (see the
    /// module documentation), and buffers off `readable_off`.
    fn sanitize(&mut self, in_indirect_area: bool, readable_off: &[(u64, u64)]) {
        if self.flags & VRING_DESC_F_INDIRECT != 0 {
            let in_tables = (INDIRECT_TABLES..REGIONS[0].1).contains(&self.addr);
            if !in_tables && mapped(self.addr) {
                self.flags &= !VRING_DESC_F_INDIRECT;
            }
        }
        if self.flags & (VRING_DESC_F_INDIRECT | VRING_DESC_F_WRITE) == VRING_DESC_F_WRITE
            && self.addr < HOLE.0
        {
            self.addr += DATA.0;
        }
        if self.flags & VRING_DESC_F_INDIRECT == 0 {
            let end = self.addr.saturating_add(u64::from(self.len));
            let touches = |&(s, e): &(u64, u64)| self.addr < e && s < end.max(self.addr + 1);
            if readable_off.iter().any(touches) {
                self.addr = DATA.0 + self.addr % 0x1_0000;
            }
        }
        if in_indirect_area {
            self.next %= INDIRECT_NEXT_LIMIT;
        }
    }
}

/// Where a queue's rings are and where the device's positions started.
#[derive(Debug, Clone, Copy)]
pub struct Layout {
    pub desc: u64,
    pub avail: u64,
    pub used: u64,
    pub size: u16,
    pub start: u16,
}

impl Layout {
    /// The used ring with the `avail_event` field after it.
    pub fn used_ring_bytes(&self) -> (u64, u64) {
        (self.used, 6 + 8 * u64::from(self.size))
    }
}

impl QueueGen {
    /// A queue of 16 entries that offers nothing.
    pub fn idle() -> Self {
        QueueGen {
            size_log2: 4,
            chains: Vec::new(),
            first_desc: 0,
            garbage: vec![GarbageGen {
                addr: AddrGen::Data(0),
                len: 0,
                flags: 0,
                next: 0,
            }],
            avail: Vec::new(),
            start: 0,
            idx: IdxGen::Exact,
            event_idx: false,
            used_event: 0,
            avail_flags: 0,
            readable_off: Vec::new(),
        }
    }

    fn size(&self) -> u16 {
        1 << (self.size_log2 % 9)
    }

    /// Writes queue number `q` into guest memory; returns the device's side of it, set up
    /// as the transport would, and its layout.
    pub fn build(&self, mem: &GuestMemoryMmap, q: usize) -> (Queue, Layout) {
        assert!(q < MAX_QUEUES);
        let size = self.size();
        let s = usize::from(size);
        let desc_addr = RINGS + q as u64 * RING_STRIDE;
        let ind_base = INDIRECT_TABLES + q as u64 * INDIRECT_STRIDE;
        let g = &self.garbage;
        let garbage = |i: usize| {
            let d = &g[i % g.len()];
            RawDesc {
                addr: d.addr.resolve(),
                len: d.len,
                flags: d.flags,
                next: d.next,
            }
        };
        let mut table: Vec<RawDesc> = (0..s).map(garbage).collect();
        let mut ind: Vec<RawDesc> = (0..INDIRECT_ENTRIES).map(|i| garbage(i * 7 + 3)).collect();

        // Places `descs` linked in the indirect area from entry `at` on; returns the table's
        // address (its `next` indices count from there).
        let place_indirect = |ind: &mut Vec<RawDesc>, at: u8, descs: &[RawDesc]| -> u64 {
            let at = usize::from(at) % (INDIRECT_ENTRIES - descs.len());
            for (k, d) in descs.iter().enumerate() {
                let mut d = *d;
                if k + 1 < descs.len() {
                    d.flags |= VRING_DESC_F_NEXT;
                    d.next = k as u16 + 1;
                }
                ind[at + k] = d;
            }
            ind_base + 16 * at as u64
        };

        let mut heads: Vec<u16> = Vec::new();
        let mut pos = usize::from(self.first_desc) % s;
        for c in &self.chains {
            let descs: Vec<RawDesc> = c.bufs.iter().map(RawDesc::of).collect();
            let n = descs.len();
            let slot = |k: usize| (pos + k) % s;
            let head = slot(0) as u16;
            let mut taken = 1;
            match &c.shape {
                Shape::Indirect { at, len, next } => {
                    let addr = place_indirect(&mut ind, *at, &descs);
                    let flags = VRING_DESC_F_INDIRECT | if *next { VRING_DESC_F_NEXT } else { 0 };
                    table[slot(0)] = RawDesc {
                        addr,
                        len: len.bytes(n),
                        flags,
                        next: slot(1) as u16,
                    };
                }
                Shape::NestedIndirect { at, pos: k } => {
                    let addr = place_indirect(&mut ind, *at, &descs);
                    let at = ((addr - ind_base) / 16) as usize;
                    let inner = &mut ind[at + usize::from(*k) % n];
                    inner.flags |= VRING_DESC_F_INDIRECT;
                    inner.addr = addr;
                    inner.len = 16 * n as u32;
                    table[slot(0)] = RawDesc {
                        addr,
                        len: 16 * n as u32,
                        flags: VRING_DESC_F_INDIRECT,
                        next: 0,
                    };
                }
                Shape::IndirectUnmapped { which, entries } => {
                    let addr = [HOLE.0 + 0x100, MEM_END, u64::MAX - 15, HOLE.0 - 8]
                        [usize::from(*which) % 4];
                    table[slot(0)] = RawDesc {
                        addr,
                        len: 16 * (1 + u32::from(*entries) % 8),
                        flags: VRING_DESC_F_INDIRECT,
                        next: 0,
                    };
                }
                Shape::MidIndirect { pos: k, at, len } => {
                    // Descriptors 0..k in the queue's table, then one indirect descriptor
                    // for a table holding the rest.
                    let k = if n > 1 {
                        1 + usize::from(*k) % (n - 1)
                    } else {
                        0
                    };
                    for (i, d) in descs[..k].iter().enumerate() {
                        table[slot(i)] = RawDesc {
                            flags: d.flags | VRING_DESC_F_NEXT,
                            next: slot(i + 1) as u16,
                            ..*d
                        };
                    }
                    let addr = place_indirect(&mut ind, *at, &descs[k..]);
                    table[slot(k)] = RawDesc {
                        addr,
                        len: len.bytes(n - k),
                        flags: VRING_DESC_F_INDIRECT,
                        next: 0,
                    };
                    taken = k + 1;
                }
                linear => {
                    for (i, d) in descs.iter().enumerate() {
                        let mut d = *d;
                        if i + 1 < n {
                            d.flags |= VRING_DESC_F_NEXT;
                            d.next = slot(i + 1) as u16;
                        }
                        table[slot(i)] = d;
                    }
                    let last = &mut table[slot(n - 1)];
                    match linear {
                        Shape::Loop(j) => {
                            last.flags |= VRING_DESC_F_NEXT;
                            last.next = slot(usize::from(*j) % n) as u16;
                        }
                        Shape::Dangling(v) => {
                            last.flags |= VRING_DESC_F_NEXT;
                            last.next = (s + usize::from(*v) % (65_536 - s)) as u16;
                        }
                        Shape::LinkTo(j) => {
                            last.flags |= VRING_DESC_F_NEXT;
                            last.next = match heads.len() {
                                0 => slot(n) as u16,
                                h => heads[usize::from(*j) % h],
                            };
                        }
                        Shape::NoEnd => {
                            last.flags |= VRING_DESC_F_NEXT;
                            last.next = slot(n) as u16;
                        }
                        Shape::FlagNoise { pos: p, bits } => {
                            table[slot(usize::from(*p) % n)].flags ^= bits;
                        }
                        _ => {}
                    }
                    taken = n;
                }
            }
            heads.push(head);
            pos = (pos + taken) % s;
        }

        for (i, d) in table.iter_mut().enumerate() {
            d.sanitize(false, &self.readable_off);
            let at = GuestAddress(desc_addr + 16 * i as u64);
            mem.write_slice(&d.to_bytes(), at).unwrap();
        }
        for (i, d) in ind.iter_mut().enumerate() {
            d.sanitize(true, &self.readable_off);
            let at = GuestAddress(ind_base + 16 * i as u64);
            mem.write_slice(&d.to_bytes(), at).unwrap();
        }

        for b in self.chains.iter().flat_map(|c| &c.bufs) {
            let addr = b.addr.resolve();
            if !b.content.is_empty() && content_may_go_at(mem, addr, b.content.len() as u64) {
                mem.write_slice(&b.content, GuestAddress(addr)).unwrap();
            }
        }

        let avail = desc_addr + AVAIL_OFF;
        let used = desc_addr + USED_OFF;
        let entries: Vec<u16> = self
            .avail
            .iter()
            .map(|e| match *e {
                AvailGen::Chain(j) if !heads.is_empty() => heads[usize::from(j) % heads.len()],
                AvailGen::Chain(j) => u16::from(j),
                AvailGen::Raw(v) => v,
            })
            .collect();
        let start = self.start;
        for (i, h) in entries.iter().enumerate() {
            let slot = start.wrapping_add(i as u16) % size;
            let at = GuestAddress(avail + 4 + 2 * u64::from(slot));
            mem.write_obj(h.to_le(), at).unwrap();
        }
        let count = entries.len() as u16;
        let idx = match self.idx {
            IdxGen::Exact => start.wrapping_add(count),
            IdxGen::Fewer(k) => start.wrapping_add(count - u16::from(k) % (count + 1)),
            IdxGen::More(k) => start.wrapping_add(count + 1 + k % 300),
            IdxGen::Any(v) => v,
        };
        mem.write_obj(self.avail_flags.to_le(), GuestAddress(avail))
            .unwrap();
        mem.write_obj(idx.to_le(), GuestAddress(avail + 2)).unwrap();
        let used_event = GuestAddress(avail + 4 + 2 * u64::from(size));
        mem.write_obj(self.used_event.to_le(), used_event).unwrap();
        mem.write_obj(0u16, GuestAddress(used)).unwrap();
        mem.write_obj(start.to_le(), GuestAddress(used + 2))
            .unwrap();

        let mut queue = Queue::new(256).unwrap();
        queue.try_set_size(size).unwrap();
        queue
            .try_set_desc_table_address(GuestAddress(desc_addr))
            .unwrap();
        queue
            .try_set_avail_ring_address(GuestAddress(avail))
            .unwrap();
        queue.try_set_used_ring_address(GuestAddress(used)).unwrap();
        queue.set_next_avail(start);
        queue.set_next_used(start);
        queue.set_event_idx(self.event_idx);
        queue.set_ready(true);
        let layout = Layout {
            desc: desc_addr,
            avail,
            used,
            size,
            start,
        };
        (queue, layout)
    }
}

// ---- the model -----------------------------------------------------------------------------

/// One descriptor of a chain as the model reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MDesc {
    pub addr: u64,
    pub len: u32,
    pub write: bool,
}

/// A chain as the model reads it.
#[derive(Debug, Clone)]
pub struct Chain {
    pub head: u16,
    pub descs: Vec<MDesc>,
    /// The walk ended at a descriptor without NEXT (not at a loop, a bad index, a bad
    /// indirect table, an unreadable descriptor or the 2^32-byte limit).
    pub terminated: bool,
}

impl Chain {
    pub fn writable_len(&self) -> u64 {
        self.descs
            .iter()
            .filter(|d| d.write)
            .map(|d| u64::from(d.len))
            .sum()
    }

    pub fn readable_len(&self) -> u64 {
        self.descs
            .iter()
            .filter(|d| !d.write)
            .map(|d| u64::from(d.len))
            .sum()
    }

    pub fn all_writable(&self) -> bool {
        self.descs.iter().all(|d| d.write)
    }

    pub fn all_readable(&self) -> bool {
        self.descs.iter().all(|d| !d.write)
    }

    /// Every buffer lies in guest memory (a zero-length one anywhere).
    pub fn buffers_in_memory(&self, mem: &GuestMemoryMmap) -> bool {
        self.descs
            .iter()
            .all(|d| in_memory(mem, d.addr, u64::from(d.len)))
    }

    /// Whether the chain is what virtio-net and virtio-vsock take on a queue of one
    /// direction: it ends, every buffer is device-writable (or every one readable) and in
    /// guest memory, and it holds at most `max` bytes.
    pub fn well_formed(&self, mem: &GuestMemoryMmap, device_writable: bool, max: u64) -> bool {
        let direction = if device_writable {
            self.all_writable()
        } else {
            self.all_readable()
        };
        self.terminated
            && direction
            && self.buffers_in_memory(mem)
            && self.readable_len() + self.writable_len() <= max
    }

    /// The ranges holding the first `n` bytes of the chain's device-writable buffers (empty
    /// buffers left out).
    pub fn writable_prefix(&self, n: u64) -> Vec<(u64, u64)> {
        let mut left = n;
        let mut out = Vec::new();
        for d in self.descs.iter().filter(|d| d.write) {
            if left == 0 {
                break;
            }
            let take = left.min(u64::from(d.len));
            if take > 0 {
                out.push((d.addr, take));
            }
            left -= take;
        }
        out
    }

    /// The chain's device-readable bytes, read from guest memory now.
    pub fn readable_bytes(&self, mem: &GuestMemoryMmap) -> Vec<u8> {
        let mut out = Vec::new();
        for d in self.descs.iter().filter(|d| !d.write) {
            let start = out.len();
            out.resize(start + d.len as usize, 0);
            mem.read_slice(&mut out[start..], GuestAddress(d.addr))
                .unwrap();
        }
        out
    }

    /// The first `n` bytes of the chain's device-writable buffers, read from guest memory.
    pub fn writable_bytes(&self, mem: &GuestMemoryMmap, n: u64) -> Vec<u8> {
        let mut out = Vec::new();
        for (addr, len) in self.writable_prefix(n) {
            let start = out.len();
            out.resize(start + len as usize, 0);
            mem.read_slice(&mut out[start..], GuestAddress(addr))
                .unwrap();
        }
        out
    }
}

/// Walks the chain at `head` as virtio-queue's iterator does, following the virtio spec:
/// at most `size` descriptors (or as many as an indirect table has), one level of
/// indirection, a table length that is a multiple of 16 and at most 65535 entries, at
/// most 2^32 - 1 bytes in all.
pub fn walk(mem: &GuestMemoryMmap, l: &Layout, head: u16) -> Chain {
    let (mut table, mut size, mut ttl, mut idx) = (l.desc, l.size, l.size, head);
    let mut indirect = false;
    let mut bytes = 0u32;
    let mut descs = Vec::new();
    let mut last_next = false;
    while ttl > 0 && idx < size {
        let Some(at) = table.checked_add(16 * u64::from(idx)) else {
            break;
        };
        let mut raw = [0u8; 16];
        if mem.read_slice(&mut raw, GuestAddress(at)).is_err() {
            break;
        }
        let d = RawDesc::parse(&raw);
        if d.flags & VRING_DESC_F_INDIRECT != 0 {
            if indirect || d.len % 16 != 0 || d.len / 16 > u32::from(u16::MAX) {
                break;
            }
            (table, size, idx, indirect) = (d.addr, (d.len / 16) as u16, 0, true);
            ttl = size;
            continue;
        }
        let Some(b) = bytes.checked_add(d.len) else {
            break;
        };
        bytes = b;
        descs.push(MDesc {
            addr: d.addr,
            len: d.len,
            write: d.flags & VRING_DESC_F_WRITE != 0,
        });
        last_next = d.flags & VRING_DESC_F_NEXT != 0;
        if last_next {
            idx = d.next;
            ttl -= 1;
        } else {
            ttl = 0;
        }
    }
    Chain {
        head,
        terminated: !descs.is_empty() && !last_next,
        descs,
    }
}

/// The chains a device may pop, in order: none when the available index is more than a
/// queue ahead of the device.
pub fn offered(mem: &GuestMemoryMmap, l: &Layout) -> Vec<Chain> {
    let idx: u16 = mem.read_obj(GuestAddress(l.avail + 2)).unwrap();
    let count = idx.wrapping_sub(l.start);
    if count > l.size {
        return Vec::new();
    }
    (0..count)
        .map(|i| {
            let slot = l.start.wrapping_add(i) % l.size;
            let head: u16 = mem
                .read_obj(GuestAddress(l.avail + 4 + 2 * u64::from(slot)))
                .unwrap();
            walk(mem, l, head)
        })
        .collect()
}

/// The entries the device put on the used ring, `(id, len)`, after checking the used index
/// moved by at most a queue and the ids are the heads of the chains offered, in the order
/// offered, leaving out heads past the table (which cannot be returned). Returns the
/// entries with the chain each one returns.
pub fn used<'c>(
    mem: &GuestMemoryMmap,
    l: &Layout,
    offered: &'c [Chain],
) -> Result<Vec<(u32, &'c Chain)>, TestCaseError> {
    let idx: u16 = mem.read_obj(GuestAddress(l.used + 2)).unwrap();
    let n = idx.wrapping_sub(l.start);
    let returnable: Vec<&Chain> = offered.iter().filter(|c| c.head < l.size).collect();
    prop_assert!(
        usize::from(n) <= returnable.len(),
        "the used index moved by {n}, but only {} chains were offered",
        returnable.len()
    );
    let mut out = Vec::new();
    for i in 0..n {
        let slot = l.start.wrapping_add(i) % l.size;
        let at = l.used + 4 + 8 * u64::from(slot);
        let id: u32 = mem.read_obj(GuestAddress(at)).unwrap();
        let len: u32 = mem.read_obj(GuestAddress(at + 4)).unwrap();
        let chain = returnable[usize::from(i)];
        prop_assert_eq!(
            id,
            u32::from(chain.head),
            "used entry {} returns another chain than the one offered",
            i
        );
        out.push((len, chain));
    }
    Ok(out)
}

/// Whether two lists of `(addr, len)` ranges share a byte.
pub fn overlap(a: &[(u64, u64)], b: &[(u64, u64)]) -> bool {
    a.iter().any(|&(x, xl)| {
        b.iter()
            .any(|&(y, yl)| x < y.saturating_add(yl) && y < x.saturating_add(xl))
    })
}

/// Whether the ranges of a list share no byte among themselves.
pub fn disjoint(a: &[(u64, u64)]) -> bool {
    (0..a.len()).all(|i| !overlap(&a[i..=i], &a[i + 1..]))
}

// ---- what the device did to guest memory ---------------------------------------------------

/// A set of guest addresses below [`MEM_END`], one bit per byte.
pub struct ByteSet(Vec<u64>);

impl Default for ByteSet {
    fn default() -> Self {
        ByteSet(vec![0; (MEM_END / 64) as usize])
    }
}

impl ByteSet {
    /// Adds `[addr, addr + len)`, clipped to guest memory's address range.
    pub fn insert(&mut self, addr: u64, len: u64) {
        let end = addr.saturating_add(len).min(MEM_END);
        let mut a = addr;
        while a < end {
            let (w, b) = ((a / 64) as usize, a % 64);
            let n = (64 - b).min(end - a);
            let mask = if n == 64 {
                u64::MAX
            } else {
                ((1u64 << n) - 1) << b
            };
            self.0[w] |= mask;
            a += n;
        }
    }

    pub fn contains(&self, addr: u64) -> bool {
        addr < MEM_END && self.0[(addr / 64) as usize] & (1 << (addr % 64)) != 0
    }

    /// The first address in `self` that is not in `other`.
    pub fn first_outside(&self, other: &ByteSet) -> Option<u64> {
        self.0
            .iter()
            .zip(&other.0)
            .enumerate()
            .find(|(_, (a, b))| *a & !*b != 0)
            .map(|(w, (a, b))| w as u64 * 64 + u64::from((a & !b).trailing_zeros()))
    }

    /// Whether any byte of the page at `page` is in the set.
    pub fn touches_page(&self, page: u64) -> bool {
        let words = PAGE_SIZE as u64 / 64;
        let first = (page / 64) as usize;
        self.0[first..first + words as usize]
            .iter()
            .any(|w| *w != 0)
    }
}

/// Guest memory as it was before the device ran.
pub struct Snapshot(Vec<Vec<u8>>);

/// What the device did to guest memory.
pub struct Changes {
    /// Bytes that differ from the snapshot.
    pub changed: ByteSet,
    /// Pages (their addresses) that differ from the snapshot.
    pub changed_pages: Vec<u64>,
    /// Pages the device marked dirty.
    pub dirty_pages: Vec<u64>,
}

fn bitmap(region: &GuestRegionMmap) -> &AtomicBitmap {
    let mapping: &MmapRegion<Option<AtomicBitmap>> = region;
    mapping.bitmap().as_ref().unwrap()
}

impl Snapshot {
    /// Copies guest memory and clears the dirty bitmaps (the test's own writes are not the
    /// device's).
    pub fn take(mem: &GuestMemoryMmap) -> Self {
        let copies = REGIONS
            .iter()
            .map(|&(start, end)| {
                let mut v = vec![0u8; (end - start) as usize];
                mem.read_slice(&mut v, GuestAddress(start)).unwrap();
                v
            })
            .collect();
        for region in mem.iter() {
            bitmap(region).reset();
        }
        Snapshot(copies)
    }

    /// The bytes as they were at `addr` (inside guest memory).
    pub fn bytes(&self, addr: u64, len: usize) -> &[u8] {
        let (i, &(start, _)) = REGIONS
            .iter()
            .enumerate()
            .find(|(_, (s, e))| (*s..*e).contains(&addr))
            .unwrap();
        let off = (addr - start) as usize;
        &self.0[i][off..off + len]
    }

    /// What changed since the snapshot.
    pub fn changes(&self, mem: &GuestMemoryMmap) -> Changes {
        let mut out = Changes {
            changed: ByteSet::default(),
            changed_pages: Vec::new(),
            dirty_pages: Vec::new(),
        };
        for (&(start, end), before) in REGIONS.iter().zip(&self.0) {
            let mut region = vec![0u8; (end - start) as usize];
            mem.read_slice(&mut region, GuestAddress(start)).unwrap();
            let mut page = start;
            while page < end {
                let off = (page - start) as usize;
                let now = &region[off..off + PAGE_SIZE];
                let was = &before[off..off + PAGE_SIZE];
                if now[..] != was[..] {
                    out.changed_pages.push(page);
                    // 64 bytes of a page are one word of the byte set.
                    let chunks = now.chunks_exact(64).zip(was.chunks_exact(64));
                    for (c, (a, b)) in chunks.enumerate().filter(|(_, (a, b))| a != b) {
                        let mask = a
                            .iter()
                            .zip(b)
                            .enumerate()
                            .filter(|(_, (x, y))| x != y)
                            .fold(0u64, |m, (i, _)| m | 1 << i);
                        out.changed.0[((page + c as u64 * 64) / 64) as usize] |= mask;
                    }
                }
                page += PAGE_SIZE as u64;
            }
        }
        for region in mem.iter() {
            let start = region.start_addr().0;
            let words = bitmap(region).get_and_reset();
            for (w, bits) in words.iter().enumerate() {
                for b in 0..64 {
                    if bits & (1 << b) != 0 {
                        out.dirty_pages
                            .push(start + (w as u64 * 64 + b) * PAGE_SIZE as u64);
                    }
                }
            }
        }
        out
    }
}

impl Changes {
    /// Checks that every byte the device changed, and every page it marked dirty, lies in
    /// `allowed`; with `dirty_tracked`, also that every page it changed is marked dirty
    /// (what a diff snapshot relies on).
    pub fn check(&self, allowed: &ByteSet, dirty_tracked: bool) -> Result<(), TestCaseError> {
        if let Some(addr) = self.changed.first_outside(allowed) {
            return Err(TestCaseError::fail(format!(
                "the device changed guest memory at {addr:#x}, outside every buffer it may write"
            )));
        }
        for &page in &self.dirty_pages {
            prop_assert!(
                allowed.touches_page(page),
                "the device marked page {page:#x} dirty, where it may write nothing"
            );
        }
        if dirty_tracked {
            for page in &self.changed_pages {
                prop_assert!(
                    self.dirty_pages.contains(page),
                    "the device changed page {page:#x} without marking it dirty"
                );
            }
        }
        Ok(())
    }
}

/// What a device may write of a queue's rings: the used ring and `avail_event`.
pub fn allow_used_ring(allowed: &mut ByteSet, l: &Layout) {
    let (addr, len) = l.used_ring_bytes();
    allowed.insert(addr, len);
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
