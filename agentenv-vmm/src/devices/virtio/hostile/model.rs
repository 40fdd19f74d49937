//! The model: a chain read the way the virtio spec (and virtio-queue) reads it, the chains
//! a device may pop, and what it must put on the used ring.

use super::*;

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
