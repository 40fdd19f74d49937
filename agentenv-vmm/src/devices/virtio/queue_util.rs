//! Helpers the devices share for reading descriptor chains safely and completing requests.
//!
//! [`collect_chain`] walks one chain into a list of plain descriptors and checks what every
//! device needs before it touches guest memory: the chain ends (no loop, no `next` past the
//! table), and each buffer lies wholly inside guest memory. Device-specific checks (which
//! descriptors must be readable or writable, sizes) stay with the device.

use std::ops::Deref;

use virtio_queue::{DescriptorChain, Queue, QueueT};
use vm_memory::{GuestAddress, GuestMemory, GuestMemoryBackend};

use super::VirtioInterrupt;
use crate::memory::GuestMemoryMmap;

/// One buffer of a descriptor chain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Desc {
    pub addr: GuestAddress,
    pub len: u32,
    /// Device-writable (`VIRTQ_DESC_F_WRITE`).
    pub write: bool,
}

/// Why a chain was refused before any device-specific processing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ChainError {
    #[error("the descriptor chain is empty or its head descriptor cannot be read")]
    Empty,
    #[error(
        "the descriptor chain does not end: a loop, a next index past the table, or an unreadable descriptor"
    )]
    Unterminated,
    #[error("descriptor {index} ({addr:#x}, {len} bytes) is not inside guest memory")]
    OutsideMemory { index: usize, addr: u64, len: u32 },
}

/// The descriptors of a chain, or why it was refused (it does not end, or a buffer is not
/// inside guest memory).
pub fn collect_chain<M>(
    chain: DescriptorChain<M>,
    mem: &GuestMemoryMmap,
) -> Result<Vec<Desc>, ChainError>
where
    M: Deref,
    M::Target: GuestMemory,
{
    let descs = walk_chain(chain)?;
    check_in_memory(mem, &descs)?;
    Ok(descs)
}

/// The descriptors of a chain that ends; their buffers are not checked yet.
pub fn walk_chain<M>(chain: DescriptorChain<M>) -> Result<Vec<Desc>, ChainError>
where
    M: Deref,
    M::Target: GuestMemory,
{
    let mut descs = Vec::new();
    let mut open = false;
    for d in chain {
        open = d.has_next();
        descs.push(Desc {
            addr: d.addr(),
            len: d.len(),
            write: d.is_write_only(),
        });
    }
    if descs.is_empty() {
        return Err(ChainError::Empty);
    }
    // The iterator stops silently after `queue size` descriptors or at a descriptor it
    // cannot read; a chain that really ended has no NEXT flag on its last descriptor.
    if open {
        return Err(ChainError::Unterminated);
    }
    Ok(descs)
}

/// Checks that every buffer lies wholly inside guest memory.
pub fn check_in_memory(mem: &GuestMemoryMmap, descs: &[Desc]) -> Result<(), ChainError> {
    for (index, d) in descs.iter().enumerate() {
        if !in_memory(mem, d.addr, d.len) {
            return Err(ChainError::OutsideMemory {
                index,
                addr: d.addr.0,
                len: d.len,
            });
        }
    }
    Ok(())
}

/// Whether `[addr, addr + len)` is wholly inside guest memory.
pub fn in_memory(mem: &GuestMemoryMmap, addr: GuestAddress, len: u32) -> bool {
    len == 0 && mem.address_in_range(addr)
        || GuestMemoryBackend::check_range(mem, addr, len as usize)
}

/// Puts `head` on the used ring with `len` bytes written. A failure (the used ring is no
/// longer in guest memory) is logged and reported as `false`.
pub fn add_used(queue: &mut Queue, mem: &GuestMemoryMmap, head: u16, len: u32) -> bool {
    match queue.add_used(mem, head, len) {
        Ok(()) => true,
        Err(e) => {
            tracing::warn!(error = %e, head, "virtio: writing the used ring failed");
            false
        }
    }
}

/// Serves every available chain of `queue` with `serve` (which returns the bytes it wrote
/// into the chain's buffers) and puts each on the used ring. Notifications from the driver
/// are suppressed while the queue is being drained and re-enabled after it, checking once
/// more for chains that arrived in between (with `VIRTIO_RING_F_EVENT_IDX` this is what
/// keeps the driver kicking). Returns whether any chain was used.
///
/// A ring whose available index claims chains that cannot be popped (a corrupt index) ends
/// the drain instead of spinning.
pub fn drain_queue(
    queue: &mut Queue,
    mem: &GuestMemoryMmap,
    mut serve: impl FnMut(DescriptorChain<&GuestMemoryMmap>) -> u32,
) -> bool {
    let mut used_any = false;
    loop {
        if let Err(e) = queue.disable_notification(mem) {
            tracing::debug!(error = %e, "virtio: suppressing driver notifications failed");
        }
        let mut served = false;
        while let Some(chain) = queue.pop_descriptor_chain(mem) {
            let head = chain.head_index();
            let len = serve(chain);
            add_used(queue, mem, head, len);
            served = true;
        }
        used_any |= served;
        match queue.enable_notification(mem) {
            Ok(true) if served => continue,
            Ok(true) => {
                tracing::debug!(
                    "virtio: the available index is past what can be popped; waiting for the next notification"
                );
                break;
            }
            Ok(false) => break,
            Err(e) => {
                tracing::debug!(error = %e, "virtio: re-enabling driver notifications failed");
                break;
            }
        }
    }
    used_any
}

/// Raises the used-buffer interrupt if the driver wants one.
pub fn notify_used(queue: &mut Queue, mem: &GuestMemoryMmap, interrupt: &VirtioInterrupt) {
    let needed = queue.needs_notification(mem).unwrap_or(true);
    if needed {
        if let Err(e) = interrupt.signal_used_queue() {
            tracing::warn!(error = %e, "virtio: raising the used-buffer interrupt failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::virtio::testing::{Driver, guest_memory, rd, wr};
    use virtio_queue::QueueOwnedT;

    #[test]
    fn a_good_chain_is_collected_in_order() {
        let mem = guest_memory(0x10_0000);
        let mut drv = Driver::new(&mem, 0, 16);
        drv.add(&[rd(0x1_0000, 16), wr(0x2_0000, 512), wr(0x3_0000, 1)]);
        let mut q = drv.queue();
        let chain = q.iter(&mem).unwrap().next().unwrap();
        let descs = collect_chain(chain, &mem).unwrap();
        assert_eq!(descs.len(), 3);
        assert!(!descs[0].write);
        assert_eq!(descs[1].addr, GuestAddress(0x2_0000));
        assert!(descs[2].write && descs[2].len == 1);
    }

    #[test]
    fn a_looping_chain_is_refused() {
        let mem = guest_memory(0x10_0000);
        let mut drv = Driver::new(&mem, 0, 16);
        drv.add_loop(&[rd(0x1_0000, 16), wr(0x2_0000, 1)]);
        let mut q = drv.queue();
        let chain = q.iter(&mem).unwrap().next().unwrap();
        assert_eq!(collect_chain(chain, &mem), Err(ChainError::Unterminated));
    }

    #[test]
    fn a_buffer_past_guest_memory_is_refused() {
        let mem = guest_memory(0x10_0000);
        let mut drv = Driver::new(&mem, 0, 16);
        drv.add(&[rd(0x1_0000, 16), wr(0x10_0000 - 8, 512)]);
        let mut q = drv.queue();
        let chain = q.iter(&mem).unwrap().next().unwrap();
        assert!(matches!(
            collect_chain(chain, &mem),
            Err(ChainError::OutsideMemory { index: 1, .. })
        ));
    }
}
