//! Guest memory.

use vm_memory::bitmap::AtomicBitmap;

/// Guest memory as every part of the VMM sees it: mmap-backed regions, each with an
/// optional dirty bitmap that device emulation marks when it writes guest memory (the
/// vCPUs' own writes are tracked by KVM's dirty log). Diff snapshots combine both.
pub type GuestMemoryMmap = vm_memory::GuestMemoryMmap<Option<AtomicBitmap>>;

/// One region of [`GuestMemoryMmap`].
pub type GuestRegionMmap = vm_memory::GuestRegionMmap<Option<AtomicBitmap>>;
