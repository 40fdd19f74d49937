//! What the device did to guest memory: the bytes it changed and the pages it marked
//! dirty, against what the descriptors allowed.

use super::*;

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
