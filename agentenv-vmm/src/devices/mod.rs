//! Devices: what the vCPU exit loop dispatches port I/O and MMIO accesses to.

pub mod virtio;

use std::io;

/// A device on the port I/O bus or the MMIO bus. `offset` is relative to the start of
/// the range the device was inserted at. A device never panics on a bad access: it
/// ignores a write it cannot take and answers a read it cannot serve with zeros
/// (all-ones for port I/O where real hardware floats the bus).
pub trait BusDevice: Send {
    fn read(&mut self, offset: u64, data: &mut [u8]);
    fn write(&mut self, offset: u64, data: &[u8]);
}

/// A way to raise one interrupt line of the guest (an irqfd registered with KVM in a
/// VM, a counter in tests).
pub trait InterruptLine: Send + Sync {
    fn trigger(&self) -> io::Result<()>;
}

impl InterruptLine for vmm_sys_util::eventfd::EventFd {
    fn trigger(&self) -> io::Result<()> {
        self.write(1)
    }
}
