//! virtio devices and their MMIO transport.
//!
//! Every device implements [`VirtioDevice`] and knows nothing about the transport; the
//! virtio-mmio transport (`mmio`) owns the register file, feature negotiation and queue
//! setup, and activates the device once the driver sets DRIVER_OK. An active device
//! processes its queues on its own worker thread, woken by the queue's notification
//! [`EventFd`] (an ioeventfd registered with KVM in a VM, written directly in tests), and
//! signals the guest through [`VirtioInterrupt`].
//!
//! A malformed descriptor chain (a loop, an address outside guest memory, a length the
//! device cannot take) is an error of that request only: the device completes or skips
//! it, counts it in its metrics, logs it, and keeps running. Nothing a guest writes may
//! panic the VMM.

pub mod balloon;
pub mod block;
#[cfg(test)]
pub(crate) mod hostile;
pub mod mmio;
pub mod net;
pub mod persist;
pub mod queue_util;
pub mod rng;
pub mod single_queue;
pub mod tap;
#[cfg(test)]
pub(crate) mod testing;
pub mod vsock;
pub mod worker;

use std::fmt::Display;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use virtio_queue::Queue;
use vmm_sys_util::eventfd::EventFd;

use self::persist::SavedState;
use self::worker::{Worker, WorkerHandler};
use super::InterruptLine;
use crate::memory::GuestMemoryMmap;

/// `InterruptStatus` bit: the device used buffers in a queue.
pub const INT_USED_RING: u32 = 0x1;
/// `InterruptStatus` bit: the device configuration changed.
pub const INT_CONFIG_CHANGE: u32 = 0x2;

/// The interrupt of one virtio-mmio device: the status register the driver reads and
/// acknowledges, and the line that raises the interrupt.
pub struct VirtioInterrupt {
    status: AtomicU32,
    config_generation: AtomicU32,
    line: Arc<dyn InterruptLine>,
}

impl VirtioInterrupt {
    pub fn new(line: Arc<dyn InterruptLine>) -> Self {
        Self {
            status: AtomicU32::new(0),
            config_generation: AtomicU32::new(0),
            line,
        }
    }

    /// Tells the driver that used buffers are ready.
    pub fn signal_used_queue(&self) -> std::io::Result<()> {
        self.status.fetch_or(INT_USED_RING, Ordering::SeqCst);
        self.line.trigger()
    }

    /// Tells the driver that the device configuration changed.
    /// Bumps the `ConfigGeneration` register, so a driver that read the configuration
    /// across the change reads it again.
    pub fn signal_config_change(&self) -> std::io::Result<()> {
        self.config_generation.fetch_add(1, Ordering::SeqCst);
        self.status.fetch_or(INT_CONFIG_CHANGE, Ordering::SeqCst);
        self.line.trigger()
    }

    /// The `ConfigGeneration` register.
    pub fn config_generation(&self) -> u32 {
        self.config_generation.load(Ordering::SeqCst)
    }

    /// Sets the `ConfigGeneration` register (snapshot restore).
    pub fn set_config_generation(&self, generation: u32) {
        self.config_generation.store(generation, Ordering::SeqCst);
    }

    /// The `InterruptStatus` register.
    pub fn status(&self) -> u32 {
        self.status.load(Ordering::SeqCst)
    }

    /// `InterruptACK`: clears the acknowledged bits.
    pub fn ack(&self, bits: u32) {
        self.status.fetch_and(!bits, Ordering::SeqCst);
    }

    /// Sets the status register (snapshot restore).
    pub fn set_status(&self, bits: u32) {
        self.status.store(bits, Ordering::SeqCst);
    }
}

/// What a device gets when the driver has finished setting it up.
pub struct ActivateContext {
    pub mem: GuestMemoryMmap,
    pub interrupt: Arc<VirtioInterrupt>,
    /// The queues the driver set up, in index order, with the features already acked.
    pub queues: Vec<Queue>,
    /// One notification event per queue, same order.
    pub queue_events: Vec<EventFd>,
}

impl ActivateContext {
    /// Checks that the driver set up `want` queues, each with its notification event.
    pub fn check_queue_count(&self, want: usize) -> Result<(), ActivateError> {
        if self.queues.len() != want || self.queue_events.len() != want {
            return Err(ActivateError::QueueCount {
                got: self.queues.len(),
                want,
            });
        }
        Ok(())
    }
}

/// Refuses to activate a device whose worker still runs; `device` names it in the error
/// ("drive vda", "the balloon").
pub fn check_inactive<H: WorkerHandler>(
    worker: &Option<Worker<H>>,
    device: impl Display,
) -> Result<(), ActivateError> {
    match worker {
        Some(_) => Err(ActivateError::Other(format!("{device} is already active"))),
        None => Ok(()),
    }
}

/// Reads `data.len()` bytes at `offset` of a device's configuration space `config` into
/// `data`; bytes past its end (or at an offset that overflows) read as zero.
pub fn read_config_bytes(config: &[u8], offset: u64, data: &mut [u8]) {
    for (i, b) in data.iter_mut().enumerate() {
        *b = usize::try_from(offset)
            .ok()
            .and_then(|o| o.checked_add(i))
            .and_then(|o| config.get(o).copied())
            .unwrap_or(0);
    }
}

/// Why a device could not be activated.
#[derive(Debug, thiserror::Error)]
pub enum ActivateError {
    #[error("the driver set up {got} queues, the device needs {want}")]
    QueueCount { got: usize, want: usize },
    #[error("the device's backend failed: {0}")]
    Backend(#[from] std::io::Error),
    #[error("{0}")]
    Other(String),
}

/// A virtio device, independent of its transport. Its state goes into snapshots through
/// [`SavedState`], which a device has by implementing [`persist::Persist`].
pub trait VirtioDevice: SavedState + Send {
    /// The virtio device id (`VIRTIO_ID_BLOCK` = 2, net = 1, rng = 4, balloon = 5, vsock = 19).
    fn device_type(&self) -> u32;

    /// The maximum size of each queue; the length is the number of queues.
    fn queue_max_sizes(&self) -> &[u16];

    /// Features the device offers (`VIRTIO_F_VERSION_1` included).
    fn avail_features(&self) -> u64;

    /// Records the features the driver acknowledged (a subset of the offered ones).
    fn set_acked_features(&mut self, features: u64);

    /// Reads the device-specific configuration space; bytes past its end read as zero.
    fn read_config(&self, offset: u64, data: &mut [u8]);

    /// Writes the device-specific configuration space; writes to read-only fields are
    /// ignored.
    fn write_config(&mut self, offset: u64, data: &[u8]);

    /// Starts processing the queues (the driver set DRIVER_OK).
    fn activate(&mut self, ctx: ActivateContext) -> Result<(), ActivateError>;

    /// Stops processing and hands back the queues and their events, so that the
    /// transport can snapshot them and activate again (or reset). `None` when not active.
    fn deactivate(&mut self) -> Option<(Vec<Queue>, Vec<EventFd>)>;

    /// The device's counters for the VM's metrics (`null` for a device that keeps none).
    fn metrics(&self) -> serde_json::Value {
        serde_json::Value::Null
    }
}
