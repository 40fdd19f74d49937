//! Checked views of descriptor chains, shared by virtio-net and virtio-vsock.
//!
//! A chain is walked once, up front: every descriptor must lie inside guest memory, the
//! chain must end (no loop, no `next` past the table), device-readable descriptors come
//! before device-writable ones, and the total length stays under the device's limit.
//! A chain that breaks any rule is reported as a [`ChainError`] and handed back to the
//! driver with length 0; the device never touches memory it did not check.

use virtio_queue::{DescriptorChain, Queue, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend};

use crate::memory::GuestMemoryMmap;

/// Why a descriptor chain was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ChainError {
    #[error("the descriptor chain is empty or its first descriptor cannot be read")]
    Empty,
    #[error(
        "the descriptor chain does not end (a loop, or a next index past the descriptor table)"
    )]
    Unterminated,
    #[error("descriptor at {addr:#x} with length {len} lies outside guest memory")]
    OutOfRange { addr: u64, len: u32 },
    #[error("the descriptor chain holds {len} bytes, more than the {max} this queue takes")]
    TooLong { len: u64, max: u64 },
    #[error("a device-readable descriptor follows a device-writable one")]
    ReadableAfterWritable,
    #[error("the chain has {what} descriptors, which this queue does not take")]
    WrongDirection { what: &'static str },
}

/// One checked guest buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    pub addr: GuestAddress,
    pub len: u32,
}

/// A descriptor chain whose buffers were all checked.
#[derive(Debug, Default)]
pub struct CheckedChain {
    pub head: u16,
    pub readable: Vec<Segment>,
    pub writable: Vec<Segment>,
}

impl CheckedChain {
    /// Total bytes the device may read.
    pub fn readable_len(&self) -> usize {
        self.readable.iter().map(|s| s.len as usize).sum()
    }

    /// Total bytes the device may write.
    pub fn writable_len(&self) -> usize {
        self.writable.iter().map(|s| s.len as usize).sum()
    }

    /// Copies up to `buf.len()` readable bytes, starting `offset` bytes into the chain.
    /// Returns how many were copied.
    pub fn read_at(
        &self,
        mem: &GuestMemoryMmap,
        mut offset: usize,
        buf: &mut [u8],
    ) -> Result<usize, vm_memory::GuestMemoryError> {
        let mut done = 0;
        for seg in &self.readable {
            let len = seg.len as usize;
            if offset >= len {
                offset -= len;
                continue;
            }
            let n = (len - offset).min(buf.len() - done);
            mem.read_slice(
                &mut buf[done..done + n],
                seg.addr.unchecked_add_usize(offset),
            )?;
            done += n;
            offset = 0;
            if done == buf.len() {
                break;
            }
        }
        Ok(done)
    }

    /// Copies `data` into the writable buffers, starting `offset` bytes into them.
    /// Returns how many bytes fitted.
    pub fn write_at(
        &self,
        mem: &GuestMemoryMmap,
        mut offset: usize,
        data: &[u8],
    ) -> Result<usize, vm_memory::GuestMemoryError> {
        let mut done = 0;
        for seg in &self.writable {
            let len = seg.len as usize;
            if offset >= len {
                offset -= len;
                continue;
            }
            let n = (len - offset).min(data.len() - done);
            mem.write_slice(&data[done..done + n], seg.addr.unchecked_add_usize(offset))?;
            done += n;
            offset = 0;
            if done == data.len() {
                break;
            }
        }
        Ok(done)
    }
}

trait AddUsize {
    fn unchecked_add_usize(self, n: usize) -> GuestAddress;
}

impl AddUsize for GuestAddress {
    fn unchecked_add_usize(self, n: usize) -> GuestAddress {
        // Segments were checked to lie inside guest memory, so this cannot overflow.
        GuestAddress(self.0 + n as u64)
    }
}

/// Which descriptors a queue takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// Only device-readable descriptors (a transmit queue).
    ReadOnly,
    /// Only device-writable descriptors (a receive queue).
    WriteOnly,
    /// Readable ones, then writable ones.
    Any,
}

/// Walks `chain` and checks every descriptor. `max_len` bounds the sum of all lengths.
pub fn check_chain(
    chain: DescriptorChain<&GuestMemoryMmap>,
    mem: &GuestMemoryMmap,
    direction: Direction,
    max_len: u64,
) -> Result<CheckedChain, (u16, ChainError)> {
    let head = chain.head_index();
    let fail = |e| Err((head, e));
    let mut out = CheckedChain {
        head,
        ..Default::default()
    };
    let mut total: u64 = 0;
    let mut last_has_next = false;
    let mut count = 0usize;
    for desc in chain {
        count += 1;
        last_has_next = desc.has_next();
        let len = desc.len();
        let addr = desc.addr();
        let in_range = len == 0
            || (addr.0.checked_add(u64::from(len)).is_some()
                && GuestMemoryBackend::check_range(mem, addr, len as usize));
        if !in_range {
            return fail(ChainError::OutOfRange { addr: addr.0, len });
        }
        total += u64::from(len);
        if total > max_len {
            return fail(ChainError::TooLong {
                len: total,
                max: max_len,
            });
        }
        if desc.is_write_only() {
            if direction == Direction::ReadOnly {
                return fail(ChainError::WrongDirection {
                    what: "device-writable",
                });
            }
            out.writable.push(Segment { addr, len });
        } else {
            if direction == Direction::WriteOnly {
                return fail(ChainError::WrongDirection {
                    what: "device-readable",
                });
            }
            if !out.writable.is_empty() {
                return fail(ChainError::ReadableAfterWritable);
            }
            out.readable.push(Segment { addr, len });
        }
    }
    if count == 0 {
        return fail(ChainError::Empty);
    }
    // The chain iterator stops silently after `queue size` descriptors or at a `next`
    // index it cannot follow; either way the last descriptor it gave still says "next".
    if last_has_next {
        return fail(ChainError::Unterminated);
    }
    Ok(out)
}

/// Puts a refused chain back in the used ring with length 0.
pub fn return_unused(queue: &mut Queue, mem: &GuestMemoryMmap, head: u16) {
    if let Err(e) = queue.add_used(mem, head, 0) {
        tracing::warn!(error = %e, head, "cannot return a descriptor chain to the used ring");
    }
}
