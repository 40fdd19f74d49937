//! What the generator draws: buffers, chains, tables and rings of a hostile driver, and
//! how a queue is written into guest memory.

use super::*;

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
pub(super) struct RawDesc {
    pub(super) addr: u64,
    pub(super) len: u32,
    pub(super) flags: u16,
    pub(super) next: u16,
}

impl RawDesc {
    pub(super) fn to_bytes(self) -> [u8; 16] {
        let mut b = [0u8; 16];
        b[0..8].copy_from_slice(&self.addr.to_le_bytes());
        b[8..12].copy_from_slice(&self.len.to_le_bytes());
        b[12..14].copy_from_slice(&self.flags.to_le_bytes());
        b[14..16].copy_from_slice(&self.next.to_le_bytes());
        b
    }

    pub(super) fn parse(b: &[u8; 16]) -> Self {
        RawDesc {
            addr: u64::from_le_bytes(b[0..8].try_into().unwrap()),
            len: u32::from_le_bytes(b[8..12].try_into().unwrap()),
            flags: u16::from_le_bytes(b[12..14].try_into().unwrap()),
            next: u16::from_le_bytes(b[14..16].try_into().unwrap()),
        }
    }

    pub(super) fn of(b: &BufGen) -> Self {
        RawDesc {
            addr: b.addr.resolve(),
            len: b.len,
            flags: if b.write { VRING_DESC_F_WRITE } else { 0 },
            next: 0,
        }
    }

    /// Keeps region 0 device-readable and indirect tables where the model holds (see the
    /// module documentation), and buffers off `readable_off`.
    pub(super) fn sanitize(&mut self, in_indirect_area: bool, readable_off: &[(u64, u64)]) {
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
