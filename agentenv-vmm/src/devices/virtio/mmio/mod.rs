//! The virtio-mmio transport, version 2 ("modern") register layout.
//!
//! One [`MmioTransport`] per device occupies [`MMIO_LEN`] bytes of the MMIO bus. It owns the
//! register file, feature negotiation, queue configuration and the device status state
//! machine; the device itself ([`VirtioDevice`]) only sees the acknowledged features, its
//! configuration space, and an [`ActivateContext`] once the driver sets DRIVER_OK.
//!
//! Queue notifications: the VM registers each of [`MmioTransport::queue_events`] as an
//! ioeventfd at `base + NOTIFY_OFFSET` with `datamatch = queue index`, so a guest write never
//! leaves the kernel. Without that registration the write reaches [`BusDevice::write`] and
//! the transport signals the same event itself.
//!
//! A guest access the transport cannot take (a width other than 4 bytes on a register, an
//! unknown offset, a write in the wrong device state, an invalid queue size or address) is
//! ignored (a read answers zero), logged at debug level and counted in
//! [`MmioMetrics::bad_accesses`]. Nothing here panics on guest input.
//!
//! Rooms: the register file (`registers`), the transport's part of a snapshot
//! ([`persist`]); the device's life (activation, reset, quiesce) is here.

pub mod persist;
mod registers;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};
use virtio_bindings::virtio_ring::VIRTIO_RING_F_EVENT_IDX;
use virtio_queue::{Queue, QueueT};
use vmm_sys_util::eventfd::EventFd;

pub use self::persist::{MMIO_STATE_VERSION, MmioTransportState, SavedQueue};
use super::persist::StateError;
use super::{ActivateContext, VirtioDevice, VirtioInterrupt};
use crate::devices::{BusDevice, InterruptLine};
use crate::memory::GuestMemoryMmap;
use crate::sync::lock;

/// `MagicValue`: "virt" in little endian.
pub const MMIO_MAGIC: u32 = 0x7472_6976;
/// `Version` of the register layout implemented here.
pub const MMIO_VERSION: u32 = 2;
/// `VendorID` reported to the driver.
pub const MMIO_VENDOR_ID: u32 = 0;
/// Size of one device's MMIO window.
pub const MMIO_LEN: u64 = 0x1000;
/// Offset of `QueueNotify`, where the VM registers the ioeventfds.
pub const NOTIFY_OFFSET: u64 = 0x50;
/// Offset of the device-specific configuration space.
pub const CONFIG_OFFSET: u64 = 0x100;

/// Device status bits (virtio 1.x, 2.1).
pub mod status {
    use virtio_bindings::virtio_config::{
        VIRTIO_CONFIG_S_ACKNOWLEDGE, VIRTIO_CONFIG_S_DRIVER, VIRTIO_CONFIG_S_DRIVER_OK,
        VIRTIO_CONFIG_S_FAILED, VIRTIO_CONFIG_S_FEATURES_OK, VIRTIO_CONFIG_S_NEEDS_RESET,
    };
    pub const ACKNOWLEDGE: u32 = VIRTIO_CONFIG_S_ACKNOWLEDGE;
    pub const DRIVER: u32 = VIRTIO_CONFIG_S_DRIVER;
    pub const DRIVER_OK: u32 = VIRTIO_CONFIG_S_DRIVER_OK;
    pub const FEATURES_OK: u32 = VIRTIO_CONFIG_S_FEATURES_OK;
    pub const DEVICE_NEEDS_RESET: u32 = VIRTIO_CONFIG_S_NEEDS_RESET;
    pub const FAILED: u32 = VIRTIO_CONFIG_S_FAILED;
}

/// The kernel command-line argument that announces a virtio-mmio device at `base` with
/// interrupt `irq` (needs `CONFIG_VIRTIO_MMIO_CMDLINE_DEVICES` in the guest kernel).
pub fn cmdline_arg(base: u64, irq: u32) -> String {
    format!("virtio_mmio.device=4K@0x{base:x}:{irq}")
}

/// Errors of the transport.
#[derive(Debug, thiserror::Error)]
pub enum MmioError {
    #[error(
        "the device declares queue {index} with maximum size {size}; it must be a power of two from 1 to 32768"
    )]
    QueueMaxSize { index: usize, size: u16 },
    #[error("creating a queue notification event failed: {0}")]
    EventFd(std::io::Error),
    #[error(
        "snapshot state version {found} is not supported (this build reads version {MMIO_STATE_VERSION}); take the snapshot again with this build"
    )]
    StateVersion { found: u32 },
    #[error(
        "snapshot state is for device type {found}, this transport holds device type {expected}"
    )]
    StateDeviceType { found: u32, expected: u32 },
    #[error("snapshot state has {found} queues, the device has {expected}")]
    StateQueueCount { found: usize, expected: usize },
    #[error("snapshot state of queue {index} is invalid: {reason}")]
    StateQueue { index: usize, reason: String },
    #[error(
        "snapshot state acknowledges features {acked:#x} the device does not offer ({offered:#x})"
    )]
    StateFeatures { acked: u64, offered: u64 },
    #[error(
        "snapshot state says the device was running but its status {status:#x} lacks FEATURES_OK or DRIVER_OK"
    )]
    StateInconsistent { status: u32 },
    #[error("restoring the device state failed: {0}")]
    DeviceState(StateError),
    #[error("saving the device state failed: {0}")]
    SaveDeviceState(StateError),
    #[error("re-activating the device failed: {0}")]
    Activate(String),
}

/// Counters of one transport (serializable for the VM's metrics).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct MmioMetrics {
    /// Guest accesses that were ignored: wrong width, unknown offset, wrong state, invalid
    /// queue size or address, unoffered features.
    pub bad_accesses: u64,
    /// Times the device was activated (DRIVER_OK, restore, resume).
    pub activations: u64,
    /// Activations the device refused (the transport then set DEVICE_NEEDS_RESET).
    pub activate_failures: u64,
    /// Device resets written by the driver.
    pub resets: u64,
    /// `QueueNotify` writes that reached the transport (not taken by an ioeventfd).
    pub notifies: u64,
}

/// The virtio-mmio transport of one device.
pub struct MmioTransport {
    mem: GuestMemoryMmap,
    device: Arc<Mutex<dyn VirtioDevice>>,
    device_type: u32,
    avail_features: u64,
    interrupt: Arc<VirtioInterrupt>,
    /// The queue configuration; while the device is active its worker owns the live queues
    /// and these are the configuration they were activated with.
    queues: Vec<Queue>,
    /// Ring addresses as written by the driver: [desc, driver (avail), device (used)].
    queue_addrs: Vec<[u64; 3]>,
    queue_events: Vec<EventFd>,
    status: u32,
    device_features_sel: u32,
    driver_features_sel: u32,
    acked_features: u64,
    queue_sel: u32,
    /// The device's worker is running.
    activated: bool,
    /// The device was stopped by [`MmioTransport::quiesce`] and is restarted by `resume`.
    quiesced: bool,
    bad_accesses: AtomicU64,
    metrics: MmioMetrics,
}

impl MmioTransport {
    /// A transport for `device`, raising its interrupt through `line` (the irqfd of the
    /// device's GSI in a VM). Keep a clone of `device` to reach device-specific controls
    /// (e.g. the balloon target).
    pub fn new(
        mem: GuestMemoryMmap,
        device: Arc<Mutex<dyn VirtioDevice>>,
        line: Arc<dyn InterruptLine>,
    ) -> Result<Self, MmioError> {
        let (device_type, avail_features, max_sizes) = {
            let d = lock(&device);
            (
                d.device_type(),
                d.avail_features(),
                d.queue_max_sizes().to_vec(),
            )
        };
        let mut queues = Vec::with_capacity(max_sizes.len());
        let mut queue_events = Vec::with_capacity(max_sizes.len());
        for (index, &size) in max_sizes.iter().enumerate() {
            queues.push(Queue::new(size).map_err(|_| MmioError::QueueMaxSize { index, size })?);
            queue_events.push(EventFd::new(libc::EFD_NONBLOCK).map_err(MmioError::EventFd)?);
        }
        Ok(Self {
            mem,
            device,
            device_type,
            avail_features,
            interrupt: Arc::new(VirtioInterrupt::new(line)),
            queue_addrs: vec![[0; 3]; queues.len()],
            queues,
            queue_events,
            status: 0,
            device_features_sel: 0,
            driver_features_sel: 0,
            acked_features: 0,
            queue_sel: 0,
            activated: false,
            quiesced: false,
            bad_accesses: AtomicU64::new(0),
            metrics: MmioMetrics::default(),
        })
    }

    /// The per-queue notification events, in queue order: register each as an ioeventfd at
    /// `base + NOTIFY_OFFSET` (4 bytes) with `datamatch = index`.
    pub fn queue_events(&self) -> &[EventFd] {
        &self.queue_events
    }

    /// The device's interrupt (status register + line).
    pub fn interrupt(&self) -> Arc<VirtioInterrupt> {
        self.interrupt.clone()
    }

    /// The device behind this transport.
    pub fn device(&self) -> Arc<Mutex<dyn VirtioDevice>> {
        self.device.clone()
    }

    /// The virtio device id.
    pub fn device_type(&self) -> u32 {
        self.device_type
    }

    /// The `Status` register.
    pub fn status(&self) -> u32 {
        self.status
    }

    /// The features the driver acknowledged (valid once FEATURES_OK is set).
    pub fn acked_features(&self) -> u64 {
        self.acked_features
    }

    /// Whether the device's worker is running.
    pub fn is_activated(&self) -> bool {
        self.activated
    }

    /// The transport's counters.
    pub fn metrics(&self) -> MmioMetrics {
        let mut m = self.metrics.clone();
        m.bad_accesses = self.bad_accesses.load(Ordering::Relaxed);
        m
    }

    fn bad(&self, what: &str, offset: u64, value: Option<u64>) {
        self.bad_accesses.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(
            device_type = self.device_type,
            offset,
            value,
            "virtio-mmio: ignored guest access: {what}"
        );
    }

    /// Activates the device with (copies of) the configured queues.
    fn activate(&mut self) {
        let event_idx = self.acked_features & (1 << VIRTIO_RING_F_EVENT_IDX) != 0;
        let mut queues = Vec::with_capacity(self.queues.len());
        let mut events = Vec::with_capacity(self.queues.len());
        for (q, evt) in self.queues.iter_mut().zip(&self.queue_events) {
            q.set_event_idx(event_idx);
            // Cannot fail: the state comes from a valid queue.
            match Queue::try_from(q.state()) {
                Ok(copy) => queues.push(copy),
                Err(e) => return self.activation_failed(format!("copying a queue failed: {e}")),
            }
            match evt.try_clone() {
                Ok(e) => events.push(e),
                Err(e) => {
                    return self
                        .activation_failed(format!("duplicating a queue event failed: {e}"));
                }
            }
        }
        let ctx = ActivateContext {
            mem: self.mem.clone(),
            interrupt: self.interrupt.clone(),
            queues,
            queue_events: events,
        };
        let result = lock(&self.device).activate(ctx);
        match result {
            Ok(()) => {
                self.activated = true;
                self.metrics.activations += 1;
            }
            Err(e) => self.activation_failed(e.to_string()),
        }
    }

    fn activation_failed(&mut self, why: String) {
        tracing::warn!(device_type = self.device_type, error = %why, "virtio-mmio: device activation failed; DEVICE_NEEDS_RESET");
        self.metrics.activate_failures += 1;
        self.status |= status::DEVICE_NEEDS_RESET;
        if let Err(e) = self.interrupt.signal_config_change() {
            tracing::warn!(error = %e, "virtio-mmio: raising the config-change interrupt failed");
        }
    }

    /// Stops the device's worker and takes the live queues back.
    fn deactivate_device(&mut self) {
        if !self.activated {
            return;
        }
        self.activated = false;
        if let Some((queues, _events)) = lock(&self.device).deactivate() {
            if queues.len() == self.queues.len() {
                self.queues = queues;
            } else {
                tracing::warn!(
                    device_type = self.device_type,
                    got = queues.len(),
                    want = self.queues.len(),
                    "virtio-mmio: device handed back a different number of queues"
                );
            }
        }
    }

    /// The driver wrote 0 to Status: stop the device and forget all driver state.
    fn reset(&mut self) {
        self.deactivate_device();
        self.quiesced = false;
        self.metrics.resets += 1;
        for q in &mut self.queues {
            q.reset();
        }
        self.queue_addrs.iter_mut().for_each(|a| *a = [0; 3]);
        for evt in &self.queue_events {
            // Drop notifications that were pending; the counter may be zero (EAGAIN).
            let _ = evt.read();
        }
        self.status = 0;
        self.device_features_sel = 0;
        self.driver_features_sel = 0;
        self.acked_features = 0;
        self.queue_sel = 0;
        self.interrupt.set_status(0);
    }

    /// Stops the device's worker (VM pause, before a snapshot); the queues stay as they were.
    pub fn quiesce(&mut self) {
        if self.activated {
            self.deactivate_device();
            self.quiesced = true;
        }
    }

    /// Restarts a device stopped by [`MmioTransport::quiesce`].
    pub fn resume(&mut self) -> Result<(), MmioError> {
        if !self.quiesced {
            return Ok(());
        }
        self.quiesced = false;
        self.activate();
        if self.activated {
            Ok(())
        } else {
            Err(MmioError::Activate(
                "the device refused to start again; the guest sees DEVICE_NEEDS_RESET".into(),
            ))
        }
    }
}

impl BusDevice for MmioTransport {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        if offset >= CONFIG_OFFSET {
            if offset >= MMIO_LEN {
                data.fill(0);
                return self.bad("read past the window", offset, None);
            }
            lock(&self.device).read_config(offset - CONFIG_OFFSET, data);
            return;
        }
        let value = if data.len() != 4 {
            self.bad(
                "register read with a width other than 4",
                offset,
                Some(data.len() as u64),
            );
            None
        } else {
            let v = self.read_register(offset);
            if v.is_none() {
                self.bad("read of an unknown or write-only register", offset, None);
            }
            v
        };
        match value {
            Some(v) => data.copy_from_slice(&v.to_le_bytes()),
            None => data.fill(0),
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if offset >= CONFIG_OFFSET {
            if offset >= MMIO_LEN {
                return self.bad("write past the window", offset, None);
            }
            if self.status & status::FAILED != 0 {
                return self.bad("config write after FAILED", offset, None);
            }
            lock(&self.device).write_config(offset - CONFIG_OFFSET, data);
            return;
        }
        let Ok(bytes) = <[u8; 4]>::try_from(data) else {
            return self.bad(
                "register write with a width other than 4",
                offset,
                Some(data.len() as u64),
            );
        };
        self.write_register(offset, u32::from_le_bytes(bytes));
    }
}

impl Drop for MmioTransport {
    fn drop(&mut self) {
        self.deactivate_device();
    }
}

#[cfg(test)]
mod tests;
