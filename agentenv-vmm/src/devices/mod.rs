//! Devices: what the vCPU exit loop dispatches port I/O and MMIO accesses to.

pub mod legacy;
pub mod virtio;

use std::io;
use std::sync::{Arc, Mutex};

use crate::sync::lock;

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

/// Why a device could not be put on a bus.
#[derive(Debug, thiserror::Error)]
pub enum BusError {
    #[error("bus range {base:#x}+{len:#x} is empty or wraps around")]
    BadRange { base: u64, len: u64 },
    #[error("bus range {base:#x}+{len:#x} overlaps the device at {other_base:#x}+{other_len:#x}")]
    Overlap {
        base: u64,
        len: u64,
        other_base: u64,
        other_len: u64,
    },
}

/// A shared device on a bus.
pub type SharedDevice = Arc<Mutex<dyn BusDevice>>;

#[derive(Clone)]
struct BusEntry {
    base: u64,
    len: u64,
    device: SharedDevice,
}

/// An address space (port I/O or MMIO) of non-overlapping device ranges. Lookups are a
/// binary search over a sorted list; dispatch allocates nothing.
#[derive(Clone, Default)]
pub struct Bus {
    entries: Vec<BusEntry>,
}

impl Bus {
    pub fn new() -> Self {
        Self::default()
    }

    /// Puts `device` at `base..base+len`; a range that overlaps another is refused.
    pub fn insert(&mut self, device: SharedDevice, base: u64, len: u64) -> Result<(), BusError> {
        if len == 0 || base.checked_add(len).is_none() {
            return Err(BusError::BadRange { base, len });
        }
        let idx = self.entries.partition_point(|e| e.base < base);
        let overlaps = |e: &BusEntry| base < e.base + e.len && e.base < base + len;
        for e in [idx.checked_sub(1), Some(idx)]
            .into_iter()
            .flatten()
            .filter_map(|i| self.entries.get(i))
        {
            if overlaps(e) {
                return Err(BusError::Overlap {
                    base,
                    len,
                    other_base: e.base,
                    other_len: e.len,
                });
            }
        }
        self.entries.insert(idx, BusEntry { base, len, device });
        Ok(())
    }

    /// The device covering `addr` and the offset of `addr` in its range.
    pub fn resolve(&self, addr: u64) -> Option<(&SharedDevice, u64)> {
        let idx = self.entries.partition_point(|e| e.base <= addr);
        let e = self.entries.get(idx.checked_sub(1)?)?;
        (addr - e.base < e.len).then_some((&e.device, addr - e.base))
    }

    /// Dispatches a read; `false` when no device covers `addr`.
    pub fn read(&self, addr: u64, data: &mut [u8]) -> bool {
        match self.resolve(addr) {
            Some((dev, off)) => {
                lock(dev).read(off, data);
                true
            }
            None => false,
        }
    }

    /// Dispatches a write; `false` when no device covers `addr`.
    pub fn write(&self, addr: u64, data: &[u8]) -> bool {
        match self.resolve(addr) {
            Some((dev, off)) => {
                lock(dev).write(off, data);
                true
            }
            None => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Echo(u8);
    impl BusDevice for Echo {
        fn read(&mut self, offset: u64, data: &mut [u8]) {
            data.fill(self.0.wrapping_add(offset as u8));
        }
        fn write(&mut self, _offset: u64, data: &[u8]) {
            self.0 = data[0];
        }
    }

    fn dev(v: u8) -> SharedDevice {
        Arc::new(Mutex::new(Echo(v)))
    }

    #[test]
    fn bus_refuses_overlapping_ranges_and_dispatches_by_offset() {
        let mut bus = Bus::new();
        bus.insert(dev(10), 0x3f8, 8).unwrap();
        bus.insert(dev(20), 0x60, 1).unwrap();
        assert!(matches!(
            bus.insert(dev(0), 0x3f0, 9),
            Err(BusError::Overlap {
                other_base: 0x3f8,
                ..
            })
        ));
        assert!(matches!(
            bus.insert(dev(0), 0x3ff, 1),
            Err(BusError::Overlap { .. })
        ));
        assert!(matches!(
            bus.insert(dev(0), 5, 0),
            Err(BusError::BadRange { .. })
        ));
        bus.insert(dev(30), 0x400, 1).unwrap();
        let mut b = [0u8; 1];
        assert!(bus.read(0x3fa, &mut b));
        assert_eq!(b[0], 12);
        assert!(bus.write(0x60, &[7]));
        assert!(bus.read(0x60, &mut b));
        assert_eq!(b[0], 7);
        assert!(!bus.read(0x3f7, &mut b));
        assert!(!bus.read(0x401, &mut b));
        assert!(bus.read(0x400, &mut b));
        assert_eq!(b[0], 30);
    }
}
