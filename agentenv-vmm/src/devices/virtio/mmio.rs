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

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use serde::{Deserialize, Serialize};
use virtio_bindings::virtio_config::{
    VIRTIO_CONFIG_S_ACKNOWLEDGE, VIRTIO_CONFIG_S_DRIVER, VIRTIO_CONFIG_S_DRIVER_OK,
    VIRTIO_CONFIG_S_FAILED, VIRTIO_CONFIG_S_FEATURES_OK, VIRTIO_CONFIG_S_NEEDS_RESET,
    VIRTIO_F_VERSION_1,
};
use virtio_bindings::virtio_ring::VIRTIO_RING_F_EVENT_IDX;
use virtio_queue::{Queue, QueueState, QueueT};
use vm_memory::GuestAddress;
use vmm_sys_util::eventfd::EventFd;

use super::{ActivateContext, VirtioDevice, VirtioInterrupt};
use crate::devices::{BusDevice, InterruptLine};
use crate::memory::GuestMemoryMmap;

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
/// Version of [`MmioTransportState`] this build writes and reads.
pub const MMIO_STATE_VERSION: u32 = 1;

const REG_MAGIC: u64 = 0x000;
const REG_VERSION: u64 = 0x004;
const REG_DEVICE_ID: u64 = 0x008;
const REG_VENDOR_ID: u64 = 0x00c;
const REG_DEVICE_FEATURES: u64 = 0x010;
const REG_DEVICE_FEATURES_SEL: u64 = 0x014;
const REG_DRIVER_FEATURES: u64 = 0x020;
const REG_DRIVER_FEATURES_SEL: u64 = 0x024;
const REG_QUEUE_SEL: u64 = 0x030;
const REG_QUEUE_NUM_MAX: u64 = 0x034;
const REG_QUEUE_NUM: u64 = 0x038;
const REG_QUEUE_READY: u64 = 0x044;
const REG_QUEUE_NOTIFY: u64 = NOTIFY_OFFSET;
const REG_INTERRUPT_STATUS: u64 = 0x060;
const REG_INTERRUPT_ACK: u64 = 0x064;
const REG_STATUS: u64 = 0x070;
const REG_QUEUE_DESC_LOW: u64 = 0x080;
const REG_QUEUE_DESC_HIGH: u64 = 0x084;
const REG_QUEUE_DRIVER_LOW: u64 = 0x090;
const REG_QUEUE_DRIVER_HIGH: u64 = 0x094;
const REG_QUEUE_DEVICE_LOW: u64 = 0x0a0;
const REG_QUEUE_DEVICE_HIGH: u64 = 0x0a4;
const REG_SHM_SEL: u64 = 0x0ac;
const REG_SHM_LEN_LOW: u64 = 0x0b0;
const REG_SHM_LEN_HIGH: u64 = 0x0b4;
const REG_SHM_BASE_LOW: u64 = 0x0b8;
const REG_SHM_BASE_HIGH: u64 = 0x0bc;
const REG_CONFIG_GENERATION: u64 = 0x0fc;

/// Device status bits (virtio 1.x, 2.1).
pub mod status {
    use super::*;
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
    DeviceState(String),
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

/// A queue's configuration as saved in a snapshot (mirror of virtio-queue's `QueueState`).
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct SavedQueue {
    pub max_size: u16,
    pub size: u16,
    pub ready: bool,
    pub desc_table: u64,
    pub avail_ring: u64,
    pub used_ring: u64,
    pub next_avail: u16,
    pub next_used: u16,
    pub event_idx_enabled: bool,
}

impl From<QueueState> for SavedQueue {
    fn from(s: QueueState) -> Self {
        Self {
            max_size: s.max_size,
            size: s.size,
            ready: s.ready,
            desc_table: s.desc_table,
            avail_ring: s.avail_ring,
            used_ring: s.used_ring,
            next_avail: s.next_avail,
            next_used: s.next_used,
            event_idx_enabled: s.event_idx_enabled,
        }
    }
}

impl From<SavedQueue> for QueueState {
    fn from(s: SavedQueue) -> Self {
        QueueState {
            max_size: s.max_size,
            next_avail: s.next_avail,
            next_used: s.next_used,
            event_idx_enabled: s.event_idx_enabled,
            size: s.size,
            ready: s.ready,
            desc_table: s.desc_table,
            avail_ring: s.avail_ring,
            used_ring: s.used_ring,
        }
    }
}

/// The transport's part of a snapshot, with the device's own state inside.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct MmioTransportState {
    pub version: u32,
    pub device_type: u32,
    pub status: u32,
    pub device_features_sel: u32,
    pub driver_features_sel: u32,
    pub acked_features: u64,
    pub queue_sel: u32,
    pub interrupt_status: u32,
    pub config_generation: u32,
    /// Whether the device was running (DRIVER_OK and activated).
    pub activated: bool,
    pub queues: Vec<SavedQueue>,
    /// Staged ring addresses of every queue (desc, driver, device), as the driver wrote them.
    pub queue_addrs: Vec<[u64; 3]>,
    pub device: serde_json::Value,
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

fn lock<'a>(
    device: &'a Mutex<dyn VirtioDevice + 'static>,
) -> MutexGuard<'a, dyn VirtioDevice + 'static> {
    device.lock().unwrap_or_else(|e| e.into_inner())
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

    fn selected_queue(&self) -> Option<usize> {
        let i = self.queue_sel as usize;
        (i < self.queues.len()).then_some(i)
    }

    /// Queue registers are writable once FEATURES_OK is set and until DRIVER_OK, and only
    /// while the selected queue is not ready (except `QueueReady` itself).
    fn queue_writable(&self) -> bool {
        self.status & status::FEATURES_OK != 0
            && self.status & (status::DRIVER_OK | status::FAILED | status::DEVICE_NEEDS_RESET) == 0
    }

    fn read_register(&self, offset: u64) -> Option<u32> {
        Some(match offset {
            REG_MAGIC => MMIO_MAGIC,
            REG_VERSION => MMIO_VERSION,
            REG_DEVICE_ID => self.device_type,
            REG_VENDOR_ID => MMIO_VENDOR_ID,
            REG_DEVICE_FEATURES => match self.device_features_sel {
                0 => self.avail_features as u32,
                1 => (self.avail_features >> 32) as u32,
                _ => 0,
            },
            REG_QUEUE_NUM_MAX => self
                .selected_queue()
                .map(|i| u32::from(self.queues[i].max_size()))
                .unwrap_or(0),
            REG_QUEUE_READY => self
                .selected_queue()
                .map(|i| u32::from(self.queues[i].ready()))
                .unwrap_or(0),
            REG_INTERRUPT_STATUS => self.interrupt.status(),
            REG_STATUS => self.status,
            REG_CONFIG_GENERATION => self.interrupt.config_generation(),
            // No shared memory regions: a length of all ones means "none" (virtio 1.2, 4.2.2).
            REG_SHM_LEN_LOW | REG_SHM_LEN_HIGH | REG_SHM_BASE_LOW | REG_SHM_BASE_HIGH => u32::MAX,
            _ => return None,
        })
    }

    fn write_register(&mut self, offset: u64, value: u32) {
        match offset {
            REG_DEVICE_FEATURES_SEL => self.device_features_sel = value,
            REG_DRIVER_FEATURES_SEL => self.driver_features_sel = value,
            REG_DRIVER_FEATURES => {
                if self.status & status::DRIVER == 0
                    || self.status & (status::FEATURES_OK | status::FAILED) != 0
                {
                    return self.bad(
                        "DriverFeatures outside feature negotiation",
                        offset,
                        Some(value.into()),
                    );
                }
                match self.driver_features_sel {
                    0 => {
                        self.acked_features =
                            (self.acked_features & !0xffff_ffff) | u64::from(value)
                    }
                    1 => {
                        self.acked_features =
                            (self.acked_features & 0xffff_ffff) | (u64::from(value) << 32)
                    }
                    _ if value == 0 => {}
                    _ => self.bad(
                        "DriverFeatures page past 1 with bits set",
                        offset,
                        Some(value.into()),
                    ),
                }
            }
            REG_QUEUE_SEL => self.queue_sel = value,
            REG_QUEUE_NUM => self.with_config_queue(offset, value, |t, i| {
                let size = u16::try_from(value).ok();
                matches!(size.map(|s| t.queues[i].try_set_size(s)), Some(Ok(())))
            }),
            REG_QUEUE_READY => self.write_queue_ready(offset, value),
            REG_QUEUE_DESC_LOW => self.set_queue_addr(offset, value, 0, false),
            REG_QUEUE_DESC_HIGH => self.set_queue_addr(offset, value, 0, true),
            REG_QUEUE_DRIVER_LOW => self.set_queue_addr(offset, value, 1, false),
            REG_QUEUE_DRIVER_HIGH => self.set_queue_addr(offset, value, 1, true),
            REG_QUEUE_DEVICE_LOW => self.set_queue_addr(offset, value, 2, false),
            REG_QUEUE_DEVICE_HIGH => self.set_queue_addr(offset, value, 2, true),
            REG_QUEUE_NOTIFY => {
                self.metrics.notifies += 1;
                match self.queue_events.get(value as usize) {
                    Some(evt) => {
                        if let Err(e) = evt.write(1) {
                            tracing::warn!(error = %e, queue = value, "virtio-mmio: signalling a queue event failed");
                        }
                    }
                    None => self.bad(
                        "QueueNotify for a queue that does not exist",
                        offset,
                        Some(value.into()),
                    ),
                }
            }
            REG_INTERRUPT_ACK => self.interrupt.ack(value),
            REG_STATUS => self.write_status(value),
            REG_SHM_SEL => {}
            _ => self.bad(
                "write to an unknown or read-only register",
                offset,
                Some(value.into()),
            ),
        }
    }

    /// Runs `f` on the selected queue when queue registers are writable and the queue is not
    /// ready yet; `f` returns whether the value was valid.
    fn with_config_queue(
        &mut self,
        offset: u64,
        value: u32,
        f: impl FnOnce(&mut Self, usize) -> bool,
    ) {
        if !self.queue_writable() {
            return self.bad(
                "queue register outside queue setup",
                offset,
                Some(value.into()),
            );
        }
        let Some(i) = self.selected_queue() else {
            return self.bad(
                "queue register with QueueSel past the last queue",
                offset,
                Some(value.into()),
            );
        };
        if self.queues[i].ready() {
            return self.bad(
                "queue register of a queue already ready",
                offset,
                Some(value.into()),
            );
        }
        if !f(self, i) {
            self.bad("invalid queue register value", offset, Some(value.into()));
        }
    }

    fn set_queue_addr(&mut self, offset: u64, value: u32, which: usize, high: bool) {
        self.with_config_queue(offset, value, |t, i| {
            let a = &mut t.queue_addrs[i][which];
            *a = if high {
                (*a & 0xffff_ffff) | (u64::from(value) << 32)
            } else {
                (*a & !0xffff_ffff) | u64::from(value)
            };
            true
        });
    }

    fn write_queue_ready(&mut self, offset: u64, value: u32) {
        if !self.queue_writable() {
            return self.bad("QueueReady outside queue setup", offset, Some(value.into()));
        }
        let Some(i) = self.selected_queue() else {
            return self.bad(
                "QueueReady with QueueSel past the last queue",
                offset,
                Some(value.into()),
            );
        };
        match value {
            0 => self.queues[i].set_ready(false),
            1 => {
                let [desc, avail, used] = self.queue_addrs[i];
                let q = &mut self.queues[i];
                let aligned = q.try_set_desc_table_address(GuestAddress(desc)).is_ok()
                    && q.try_set_avail_ring_address(GuestAddress(avail)).is_ok()
                    && q.try_set_used_ring_address(GuestAddress(used)).is_ok();
                q.set_ready(true);
                if !aligned || !q.is_valid(&self.mem) {
                    q.set_ready(false);
                    self.bad(
                        "QueueReady for a queue whose rings are misaligned or outside guest memory",
                        offset,
                        Some(value.into()),
                    );
                }
            }
            _ => self.bad(
                "QueueReady value other than 0 or 1",
                offset,
                Some(value.into()),
            ),
        }
    }

    fn write_status(&mut self, value: u32) {
        if value == 0 {
            self.reset();
            return;
        }
        let old = self.status;
        // Bits are only ever added, one step at a time, until a reset.
        if value & old != old {
            return self.bad(
                "Status write clearing bits without a reset",
                REG_STATUS,
                Some(value.into()),
            );
        }
        let added = value & !old;
        if added & status::FAILED != 0 {
            self.status |= status::FAILED;
            return;
        }
        let known = status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK | status::DRIVER_OK;
        if added & !known != 0 {
            return self.bad(
                "Status write setting a device-only or unknown bit",
                REG_STATUS,
                Some(value.into()),
            );
        }
        if added & status::DRIVER != 0 && value & status::ACKNOWLEDGE == 0 {
            return self.bad("DRIVER without ACKNOWLEDGE", REG_STATUS, Some(value.into()));
        }
        if added & status::FEATURES_OK != 0 {
            if value & status::DRIVER == 0 {
                return self.bad("FEATURES_OK without DRIVER", REG_STATUS, Some(value.into()));
            }
            let unoffered = self.acked_features & !self.avail_features;
            if unoffered != 0 {
                // The driver reads Status back and finds FEATURES_OK unset.
                return self.bad(
                    "FEATURES_OK with features the device did not offer",
                    REG_STATUS,
                    Some(unoffered),
                );
            }
            if self.acked_features & (1 << VIRTIO_F_VERSION_1) == 0 {
                return self.bad(
                    "FEATURES_OK without VIRTIO_F_VERSION_1 (legacy drivers are not supported)",
                    REG_STATUS,
                    Some(self.acked_features),
                );
            }
            lock(&self.device).set_acked_features(self.acked_features);
        }
        if added & status::DRIVER_OK != 0 {
            if value & status::FEATURES_OK == 0 {
                return self.bad(
                    "DRIVER_OK without FEATURES_OK",
                    REG_STATUS,
                    Some(value.into()),
                );
            }
            self.status = value;
            self.activate();
            return;
        }
        self.status = value;
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

    /// The transport's and the device's state. An active device is stopped for the moment
    /// of the copy (so its queue positions are exact) and started again.
    pub fn save_state(&mut self) -> Result<MmioTransportState, MmioError> {
        let was_active = self.activated;
        self.quiesce();
        let state = MmioTransportState {
            version: MMIO_STATE_VERSION,
            device_type: self.device_type,
            status: self.status,
            device_features_sel: self.device_features_sel,
            driver_features_sel: self.driver_features_sel,
            acked_features: self.acked_features,
            queue_sel: self.queue_sel,
            interrupt_status: self.interrupt.status(),
            config_generation: self.interrupt.config_generation(),
            activated: was_active || self.quiesced,
            queues: self.queues.iter().map(|q| q.state().into()).collect(),
            queue_addrs: self.queue_addrs.clone(),
            device: lock(&self.device).save_state(),
        };
        if was_active {
            self.resume()?;
        }
        Ok(state)
    }

    /// Restores a state saved by [`MmioTransport::save_state`] into this (fresh) transport and
    /// starts the device again when it was running.
    pub fn restore_state(&mut self, state: &MmioTransportState) -> Result<(), MmioError> {
        if state.version != MMIO_STATE_VERSION {
            return Err(MmioError::StateVersion {
                found: state.version,
            });
        }
        if state.device_type != self.device_type {
            return Err(MmioError::StateDeviceType {
                found: state.device_type,
                expected: self.device_type,
            });
        }
        if state.queues.len() != self.queues.len() || state.queue_addrs.len() != self.queues.len() {
            return Err(MmioError::StateQueueCount {
                found: state.queues.len(),
                expected: self.queues.len(),
            });
        }
        if state.activated
            && state.status & (status::FEATURES_OK | status::DRIVER_OK)
                != (status::FEATURES_OK | status::DRIVER_OK)
        {
            return Err(MmioError::StateInconsistent {
                status: state.status,
            });
        }
        if state.acked_features & !self.avail_features != 0 {
            return Err(MmioError::StateFeatures {
                acked: state.acked_features,
                offered: self.avail_features,
            });
        }
        let mut queues = Vec::with_capacity(state.queues.len());
        for (index, (saved, current)) in state.queues.iter().zip(&self.queues).enumerate() {
            if saved.max_size != current.max_size() {
                return Err(MmioError::StateQueue {
                    index,
                    reason: format!(
                        "maximum size {} differs from the device's {}",
                        saved.max_size,
                        current.max_size()
                    ),
                });
            }
            let q =
                Queue::try_from(QueueState::from(*saved)).map_err(|e| MmioError::StateQueue {
                    index,
                    reason: e.to_string(),
                })?;
            if q.ready() && !q.is_valid(&self.mem) {
                return Err(MmioError::StateQueue {
                    index,
                    reason: "its rings are outside guest memory".into(),
                });
            }
            queues.push(q);
        }
        self.deactivate_device();
        lock(&self.device)
            .restore_state(&state.device)
            .map_err(MmioError::DeviceState)?;
        self.queues = queues;
        self.queue_addrs = state.queue_addrs.clone();
        self.status = state.status;
        self.device_features_sel = state.device_features_sel;
        self.driver_features_sel = state.driver_features_sel;
        self.acked_features = state.acked_features;
        self.queue_sel = state.queue_sel;
        self.interrupt.set_status(state.interrupt_status);
        self.interrupt
            .set_config_generation(state.config_generation);
        self.quiesced = false;
        if state.status & status::FEATURES_OK != 0 {
            lock(&self.device).set_acked_features(state.acked_features);
        }
        if state.activated {
            self.activate();
            if !self.activated {
                return Err(MmioError::Activate(
                    "the device refused to start with the restored state".into(),
                ));
            }
        }
        Ok(())
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
mod tests {
    use super::*;
    use crate::devices::virtio::ActivateError;

    const QUEUE_MAX: u16 = 16;
    const MEM_SIZE: usize = 0x10_0000;

    /// A device that records what the transport does to it.
    #[derive(Default)]
    struct Recorder {
        acked: u64,
        activations: u32,
        active: Option<(Vec<Queue>, Vec<EventFd>)>,
        fail_activate: bool,
        config: [u8; 8],
        restored: Option<serde_json::Value>,
    }

    const OFFERED: u64 = (1 << VIRTIO_F_VERSION_1) | (1 << 3);

    impl VirtioDevice for Recorder {
        fn device_type(&self) -> u32 {
            4
        }
        fn queue_max_sizes(&self) -> &[u16] {
            &[QUEUE_MAX, QUEUE_MAX]
        }
        fn avail_features(&self) -> u64 {
            OFFERED
        }
        fn set_acked_features(&mut self, features: u64) {
            self.acked = features;
        }
        fn read_config(&self, offset: u64, data: &mut [u8]) {
            for (i, b) in data.iter_mut().enumerate() {
                *b = self.config.get(offset as usize + i).copied().unwrap_or(0);
            }
        }
        fn write_config(&mut self, offset: u64, data: &[u8]) {
            for (i, b) in data.iter().enumerate() {
                if let Some(c) = self.config.get_mut(offset as usize + i) {
                    *c = *b;
                }
            }
        }
        fn activate(&mut self, ctx: ActivateContext) -> Result<(), ActivateError> {
            if self.fail_activate {
                return Err(ActivateError::Other("refused by the test".into()));
            }
            self.activations += 1;
            self.active = Some((ctx.queues, ctx.queue_events));
            Ok(())
        }
        fn deactivate(&mut self) -> Option<(Vec<Queue>, Vec<EventFd>)> {
            self.active.take()
        }
        fn save_state(&self) -> serde_json::Value {
            serde_json::json!({ "config": self.config.to_vec() })
        }
        fn restore_state(&mut self, state: &serde_json::Value) -> Result<(), String> {
            self.restored = Some(state.clone());
            Ok(())
        }
    }

    fn mem() -> GuestMemoryMmap {
        crate::devices::virtio::testing::guest_memory(MEM_SIZE)
    }

    fn transport_with(dev: Recorder) -> (MmioTransport, Arc<Mutex<Recorder>>, Arc<EventFd>) {
        let dev = Arc::new(Mutex::new(dev));
        let line = Arc::new(EventFd::new(libc::EFD_NONBLOCK).unwrap());
        let t = MmioTransport::new(mem(), dev.clone(), line.clone()).unwrap();
        (t, dev, line)
    }

    fn r(t: &mut MmioTransport, off: u64) -> u32 {
        let mut b = [0u8; 4];
        t.read(off, &mut b);
        u32::from_le_bytes(b)
    }

    fn w(t: &mut MmioTransport, off: u64, v: u32) {
        t.write(off, &v.to_le_bytes());
    }

    fn negotiate(t: &mut MmioTransport, features: u64) {
        w(t, REG_STATUS, status::ACKNOWLEDGE);
        w(t, REG_STATUS, status::ACKNOWLEDGE | status::DRIVER);
        w(t, REG_DRIVER_FEATURES_SEL, 0);
        w(t, REG_DRIVER_FEATURES, features as u32);
        w(t, REG_DRIVER_FEATURES_SEL, 1);
        w(t, REG_DRIVER_FEATURES, (features >> 32) as u32);
        w(
            t,
            REG_STATUS,
            status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK,
        );
    }

    fn setup_queue(t: &mut MmioTransport, index: u32, base: u64) {
        w(t, REG_QUEUE_SEL, index);
        w(t, REG_QUEUE_NUM, u32::from(QUEUE_MAX));
        w(t, REG_QUEUE_DESC_LOW, base as u32);
        w(t, REG_QUEUE_DESC_HIGH, (base >> 32) as u32);
        w(t, REG_QUEUE_DRIVER_LOW, (base + 0x1000) as u32);
        w(t, REG_QUEUE_DRIVER_HIGH, 0);
        w(t, REG_QUEUE_DEVICE_LOW, (base + 0x2000) as u32);
        w(t, REG_QUEUE_DEVICE_HIGH, 0);
        w(t, REG_QUEUE_READY, 1);
    }

    const ALL_OK: u32 =
        status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK | status::DRIVER_OK;

    fn bring_up(t: &mut MmioTransport) {
        negotiate(t, OFFERED);
        setup_queue(t, 0, 0x1_0000);
        setup_queue(t, 1, 0x2_0000);
        w(t, REG_STATUS, ALL_OK);
    }

    #[test]
    fn identification_registers_describe_a_version_2_device() {
        let (mut t, _, _) = transport_with(Recorder::default());
        assert_eq!(r(&mut t, REG_MAGIC), 0x7472_6976);
        assert_eq!(r(&mut t, REG_VERSION), 2);
        assert_eq!(r(&mut t, REG_DEVICE_ID), 4);
        assert_eq!(r(&mut t, REG_VENDOR_ID), MMIO_VENDOR_ID);
        w(&mut t, REG_DEVICE_FEATURES_SEL, 0);
        assert_eq!(r(&mut t, REG_DEVICE_FEATURES), OFFERED as u32);
        w(&mut t, REG_DEVICE_FEATURES_SEL, 1);
        assert_eq!(r(&mut t, REG_DEVICE_FEATURES), (OFFERED >> 32) as u32);
        w(&mut t, REG_DEVICE_FEATURES_SEL, 2);
        assert_eq!(r(&mut t, REG_DEVICE_FEATURES), 0);
        w(&mut t, REG_QUEUE_SEL, 1);
        assert_eq!(r(&mut t, REG_QUEUE_NUM_MAX), u32::from(QUEUE_MAX));
        w(&mut t, REG_QUEUE_SEL, 2);
        assert_eq!(
            r(&mut t, REG_QUEUE_NUM_MAX),
            0,
            "a queue past the last one has size 0"
        );
        assert_eq!(t.metrics().bad_accesses, 0);
    }

    #[test]
    fn feature_negotiation_acks_offered_features() {
        let (mut t, dev, _) = transport_with(Recorder::default());
        negotiate(&mut t, OFFERED);
        assert_ne!(r(&mut t, REG_STATUS) & status::FEATURES_OK, 0);
        assert_eq!(dev.lock().unwrap().acked, OFFERED);
        assert_eq!(t.acked_features(), OFFERED);
    }

    #[test]
    fn features_ok_is_refused_when_the_driver_acks_unoffered_features() {
        let (mut t, dev, _) = transport_with(Recorder::default());
        negotiate(&mut t, OFFERED | (1 << 7));
        assert_eq!(r(&mut t, REG_STATUS) & status::FEATURES_OK, 0);
        assert_eq!(
            dev.lock().unwrap().acked,
            0,
            "the device never saw the bad ack"
        );
        assert!(t.metrics().bad_accesses >= 1);
        // Nor may it activate.
        w(&mut t, REG_STATUS, ALL_OK);
        assert!(!t.is_activated());
    }

    #[test]
    fn features_ok_is_refused_without_version_1() {
        let (mut t, _, _) = transport_with(Recorder::default());
        negotiate(&mut t, 1 << 3);
        assert_eq!(r(&mut t, REG_STATUS) & status::FEATURES_OK, 0);
    }

    #[test]
    fn queue_size_must_be_a_power_of_two_not_above_the_maximum() {
        let (mut t, _, _) = transport_with(Recorder::default());
        negotiate(&mut t, OFFERED);
        w(&mut t, REG_QUEUE_SEL, 0);
        let before = t.metrics().bad_accesses;
        w(&mut t, REG_QUEUE_NUM, 12);
        w(&mut t, REG_QUEUE_NUM, 32);
        w(&mut t, REG_QUEUE_NUM, 0);
        assert_eq!(t.metrics().bad_accesses, before + 3);
        w(&mut t, REG_QUEUE_NUM, 8);
        assert_eq!(t.metrics().bad_accesses, before + 3);
        assert_eq!(t.queues[0].size(), 8);
    }

    #[test]
    fn queue_ready_is_refused_for_rings_outside_guest_memory_or_misaligned() {
        let (mut t, _, _) = transport_with(Recorder::default());
        negotiate(&mut t, OFFERED);
        // Descriptor table past the end of memory.
        setup_queue(&mut t, 0, MEM_SIZE as u64 - 0x100);
        assert_eq!(r(&mut t, REG_QUEUE_READY), 0);
        // Descriptor table misaligned.
        setup_queue(&mut t, 1, 0x1_0008);
        assert_eq!(r(&mut t, REG_QUEUE_READY), 0);
        // A good one is taken.
        setup_queue(&mut t, 1, 0x2_0000);
        assert_eq!(r(&mut t, REG_QUEUE_READY), 1);
        assert!(t.metrics().bad_accesses >= 2);
    }

    #[test]
    fn queue_registers_are_ignored_before_features_ok() {
        let (mut t, _, _) = transport_with(Recorder::default());
        w(&mut t, REG_STATUS, status::ACKNOWLEDGE | status::DRIVER);
        w(&mut t, REG_QUEUE_SEL, 0);
        w(&mut t, REG_QUEUE_NUM, 4);
        assert_eq!(t.queues[0].size(), QUEUE_MAX);
        assert_eq!(t.metrics().bad_accesses, 1);
    }

    #[test]
    fn driver_ok_activates_the_device_with_the_configured_queues() {
        let (mut t, dev, _) = transport_with(Recorder::default());
        bring_up(&mut t);
        assert!(t.is_activated());
        assert_eq!(r(&mut t, REG_STATUS), ALL_OK);
        let d = dev.lock().unwrap();
        assert_eq!(d.activations, 1);
        let (queues, events) = d.active.as_ref().unwrap();
        assert_eq!(queues.len(), 2);
        assert_eq!(events.len(), 2);
        assert!(queues[0].ready());
        assert_eq!(queues[1].desc_table(), 0x2_0000);
        assert_eq!(queues[1].avail_ring(), 0x2_1000);
        assert_eq!(queues[1].used_ring(), 0x2_2000);
        // Queue registers are frozen once DRIVER_OK is set.
        drop(d);
        w(&mut t, REG_QUEUE_SEL, 0);
        w(&mut t, REG_QUEUE_READY, 0);
        assert_eq!(r(&mut t, REG_QUEUE_READY), 1);
    }

    #[test]
    fn queue_notify_write_signals_the_queue_event() {
        let (mut t, dev, _) = transport_with(Recorder::default());
        bring_up(&mut t);
        w(&mut t, REG_QUEUE_NOTIFY, 1);
        let d = dev.lock().unwrap();
        let (_, events) = d.active.as_ref().unwrap();
        assert_eq!(
            events[1].read().unwrap(),
            1,
            "the device's clone sees the notification"
        );
        assert!(events[0].read().is_err(), "queue 0 was not notified");
        drop(d);
        w(&mut t, REG_QUEUE_NOTIFY, 9);
        assert_eq!(t.metrics().bad_accesses, 1);
    }

    #[test]
    fn writing_zero_to_status_resets_the_device_and_its_queues() {
        let (mut t, dev, line) = transport_with(Recorder::default());
        bring_up(&mut t);
        t.interrupt().signal_used_queue().unwrap();
        assert_eq!(line.read().unwrap(), 1);
        w(&mut t, REG_STATUS, 0);
        assert!(!t.is_activated());
        assert!(
            dev.lock().unwrap().active.is_none(),
            "device was deactivated"
        );
        assert_eq!(r(&mut t, REG_STATUS), 0);
        assert_eq!(r(&mut t, REG_INTERRUPT_STATUS), 0);
        w(&mut t, REG_QUEUE_SEL, 0);
        assert_eq!(r(&mut t, REG_QUEUE_READY), 0);
        assert_eq!(t.acked_features(), 0);
        // The driver can bring it up again.
        bring_up(&mut t);
        assert_eq!(dev.lock().unwrap().activations, 2);
        assert_eq!(t.metrics().resets, 1);
    }

    #[test]
    fn failed_activation_sets_device_needs_reset_and_raises_config_change() {
        let (mut t, _, line) = transport_with(Recorder {
            fail_activate: true,
            ..Default::default()
        });
        bring_up(&mut t);
        assert!(!t.is_activated());
        assert_ne!(r(&mut t, REG_STATUS) & status::DEVICE_NEEDS_RESET, 0);
        assert_eq!(r(&mut t, REG_INTERRUPT_STATUS), INT_CONFIG_CHANGE_BIT);
        assert_eq!(line.read().unwrap(), 1);
        assert_eq!(t.metrics().activate_failures, 1);
        w(&mut t, REG_INTERRUPT_ACK, INT_CONFIG_CHANGE_BIT);
        assert_eq!(r(&mut t, REG_INTERRUPT_STATUS), 0);
    }

    const INT_CONFIG_CHANGE_BIT: u32 = super::super::INT_CONFIG_CHANGE;

    #[test]
    fn bad_accesses_read_zero_and_are_counted() {
        let (mut t, _, _) = transport_with(Recorder::default());
        let mut two = [0xffu8; 2];
        t.read(REG_MAGIC, &mut two);
        assert_eq!(two, [0, 0]);
        assert_eq!(r(&mut t, 0x0f0), 0, "unknown offset");
        assert_eq!(r(&mut t, REG_QUEUE_DESC_LOW), 0, "write-only register");
        t.write(REG_STATUS, &[1]);
        assert_eq!(r(&mut t, REG_STATUS), 0, "a 1-byte status write is ignored");
        let mut past = [0xffu8; 4];
        t.read(MMIO_LEN + 4, &mut past);
        assert_eq!(past, [0; 4]);
        w(&mut t, REG_MAGIC, 5);
        assert_eq!(t.metrics().bad_accesses, 6);
        // Status can only grow until a reset.
        w(&mut t, REG_STATUS, status::ACKNOWLEDGE | status::DRIVER);
        w(&mut t, REG_STATUS, status::ACKNOWLEDGE);
        assert_eq!(r(&mut t, REG_STATUS), status::ACKNOWLEDGE | status::DRIVER);
        // A device-only bit cannot be set by the driver.
        w(
            &mut t,
            REG_STATUS,
            status::ACKNOWLEDGE | status::DRIVER | status::DEVICE_NEEDS_RESET,
        );
        assert_eq!(r(&mut t, REG_STATUS), status::ACKNOWLEDGE | status::DRIVER);
    }

    #[test]
    fn config_space_is_passed_to_the_device_at_any_width() {
        let (mut t, dev, _) = transport_with(Recorder::default());
        t.write(CONFIG_OFFSET + 2, &[0xab, 0xcd]);
        assert_eq!(dev.lock().unwrap().config[2..4], [0xab, 0xcd]);
        let mut b = [0u8; 1];
        t.read(CONFIG_OFFSET + 3, &mut b);
        assert_eq!(b, [0xcd]);
        let mut b8 = [0xffu8; 8];
        t.read(CONFIG_OFFSET + 4, &mut b8);
        assert_eq!(b8, [0; 8], "bytes past the config space read as zero");
    }

    #[test]
    fn config_generation_changes_with_a_config_change() {
        let (mut t, _, _) = transport_with(Recorder::default());
        let g = r(&mut t, REG_CONFIG_GENERATION);
        t.interrupt().signal_config_change().unwrap();
        assert_eq!(r(&mut t, REG_CONFIG_GENERATION), g.wrapping_add(1));
    }

    #[test]
    fn save_and_restore_reactivate_a_running_device_with_its_ring_positions() {
        let (mut t, dev, _) = transport_with(Recorder::default());
        bring_up(&mut t);
        // The device advanced queue 0 while running.
        {
            let mut d = dev.lock().unwrap();
            let (queues, _) = d.active.as_mut().unwrap();
            queues[0].set_next_avail(5);
            queues[0].set_next_used(4);
        }
        t.interrupt().signal_used_queue().unwrap();
        let state = t.save_state().unwrap();
        assert!(t.is_activated(), "saving leaves the device running");
        assert_eq!(dev.lock().unwrap().activations, 2);
        assert_eq!(state.queues[0].next_avail, 5);
        assert_eq!(state.queues[0].next_used, 4);
        assert!(state.activated);

        let json = serde_json::to_string(&state).unwrap();
        let state: MmioTransportState = serde_json::from_str(&json).unwrap();

        let (mut t2, dev2, _) = transport_with(Recorder::default());
        t2.restore_state(&state).unwrap();
        assert!(t2.is_activated());
        assert_eq!(r(&mut t2, REG_STATUS), ALL_OK);
        assert_eq!(r(&mut t2, REG_INTERRUPT_STATUS), 1);
        let d2 = dev2.lock().unwrap();
        assert_eq!(d2.acked, OFFERED);
        assert!(d2.restored.is_some());
        let (queues, _) = d2.active.as_ref().unwrap();
        assert_eq!(queues[0].next_avail(), 5);
        assert_eq!(queues[0].next_used(), 4);
        assert_eq!(queues[1].desc_table(), 0x2_0000);
    }

    #[test]
    fn restore_refuses_another_version_device_or_queue_layout() {
        let (mut t, _, _) = transport_with(Recorder::default());
        bring_up(&mut t);
        let good = t.save_state().unwrap();
        let (mut t2, _, _) = transport_with(Recorder::default());
        let mut s = good.clone();
        s.version = 99;
        assert!(matches!(
            t2.restore_state(&s),
            Err(MmioError::StateVersion { found: 99 })
        ));
        let mut s = good.clone();
        s.device_type = 2;
        assert!(matches!(
            t2.restore_state(&s),
            Err(MmioError::StateDeviceType { .. })
        ));
        let mut s = good.clone();
        s.queues.pop();
        assert!(matches!(
            t2.restore_state(&s),
            Err(MmioError::StateQueueCount { .. })
        ));
        let mut s = good.clone();
        s.queues[0].desc_table = MEM_SIZE as u64;
        assert!(matches!(
            t2.restore_state(&s),
            Err(MmioError::StateQueue { index: 0, .. })
        ));
        let mut s = good.clone();
        s.status = status::ACKNOWLEDGE;
        assert!(matches!(
            t2.restore_state(&s),
            Err(MmioError::StateInconsistent { .. })
        ));
        let mut s = good;
        s.acked_features |= 1 << 9;
        assert!(matches!(
            t2.restore_state(&s),
            Err(MmioError::StateFeatures { .. })
        ));
        assert!(!t2.is_activated());
    }

    #[test]
    fn quiesce_and_resume_keep_the_queues() {
        let (mut t, dev, _) = transport_with(Recorder::default());
        bring_up(&mut t);
        dev.lock().unwrap().active.as_mut().unwrap().0[1].set_next_avail(3);
        t.quiesce();
        assert!(!t.is_activated());
        assert!(dev.lock().unwrap().active.is_none());
        t.resume().unwrap();
        assert!(t.is_activated());
        assert_eq!(
            dev.lock().unwrap().active.as_ref().unwrap().0[1].next_avail(),
            3
        );
    }

    #[test]
    fn cmdline_arg_names_the_window_and_irq() {
        assert_eq!(
            cmdline_arg(0xd000_0000, 5),
            "virtio_mmio.device=4K@0xd0000000:5"
        );
    }

    /// Counts panics on device worker threads (the worker catches them, so a test would not
    /// otherwise see one).
    fn count_worker_panics() -> Arc<std::sync::atomic::AtomicU64> {
        static COUNT: std::sync::OnceLock<Arc<std::sync::atomic::AtomicU64>> =
            std::sync::OnceLock::new();
        COUNT
            .get_or_init(|| {
                let count = Arc::new(std::sync::atomic::AtomicU64::new(0));
                let c = count.clone();
                let prev = std::panic::take_hook();
                std::panic::set_hook(Box::new(move |info| {
                    if std::thread::current()
                        .name()
                        .is_some_and(|n| n.starts_with("virtio-"))
                    {
                        c.fetch_add(1, Ordering::SeqCst);
                    }
                    prev(info)
                }));
                count
            })
            .clone()
    }

    #[test]
    fn random_guest_register_traffic_and_garbage_rings_never_panic() {
        use crate::devices::virtio::block::Block;
        use std::io::Write;
        use vm_memory::Bytes;
        let panics = count_worker_panics();
        let mut img = tempfile::NamedTempFile::new().unwrap();
        img.write_all(&vec![7u8; 64 * 512]).unwrap();
        let mem = crate::devices::virtio::testing::guest_memory(MEM_SIZE);
        // Guest memory full of garbage, so whatever rings the driver points at hold nonsense.
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let garbage: Vec<u8> = (0..MEM_SIZE).map(|_| next() as u8).collect();
        mem.write_slice(&garbage, GuestAddress(0)).unwrap();
        let dev = Arc::new(Mutex::new(Block::new("fuzz", img.path(), false).unwrap()));
        let line = Arc::new(EventFd::new(libc::EFD_NONBLOCK).unwrap());
        let mut t = MmioTransport::new(mem.clone(), dev.clone(), line).unwrap();
        let offsets = [
            REG_STATUS,
            REG_DRIVER_FEATURES,
            REG_DRIVER_FEATURES_SEL,
            REG_QUEUE_SEL,
            REG_QUEUE_NUM,
            REG_QUEUE_READY,
            REG_QUEUE_NOTIFY,
            REG_QUEUE_DESC_LOW,
            REG_QUEUE_DRIVER_LOW,
            REG_QUEUE_DEVICE_LOW,
            REG_QUEUE_DESC_HIGH,
            REG_INTERRUPT_ACK,
        ];
        let mut activations = 0;
        for i in 0..20_000u32 {
            let r = next();
            let width = [1usize, 2, 4, 4, 4, 8][(r % 6) as usize];
            let offset = if r & 0x100 != 0 {
                offsets[((r >> 16) % offsets.len() as u64) as usize]
            } else {
                (r >> 24) % 0x1100
            };
            // Values biased towards what makes progress: small numbers, status steps,
            // addresses inside guest memory.
            let value = match (r >> 40) % 4 {
                0 => (r >> 44) as u32 % 16,
                1 => [1, 3, 11, 15, 0][((r >> 44) % 5) as usize],
                2 => ((r >> 44) as u32 % MEM_SIZE as u32) & !0xf,
                _ => (r >> 32) as u32,
            };
            let bytes = u64::from(value).to_le_bytes();
            if r & 0x200 != 0 {
                let mut buf = [0u8; 8];
                t.read(offset, &mut buf[..width]);
            } else {
                t.write(offset, &bytes[..width]);
            }
            if t.is_activated() {
                activations += 1;
            }
            if i % 1000 == 0 {
                // Sometimes also a well-formed bring-up over random chains.
                t.write(REG_STATUS, &0u32.to_le_bytes());
                bring_up_over_random_chains(&mut t, &mut next);
            }
        }
        assert!(
            activations > 0,
            "the traffic did activate the device at times"
        );
        let m = dev.lock().unwrap().metrics();
        assert!(
            m.errors > 0,
            "the random chains were processed and refused: {m:?}"
        );
        // The transport still answers, and a proper driver still gets service.
        assert_eq!(r(&mut t, REG_MAGIC), MMIO_MAGIC);
        w(&mut t, REG_STATUS, 0);
        let mut drv = crate::devices::virtio::testing::Driver::new(&mem, 0x8_0000, 16);
        let features = dev.lock().unwrap().avail_features();
        crate::devices::virtio::testing::mmio_bring_up(&mut t, features, &[&drv]);
        assert!(t.is_activated());
        mem.write_obj(0u32, GuestAddress(0x1_0000)).unwrap(); // VIRTIO_BLK_T_IN
        mem.write_obj(0u32, GuestAddress(0x1_0004)).unwrap();
        mem.write_obj(3u64, GuestAddress(0x1_0008)).unwrap();
        use crate::devices::virtio::testing::{rd, wr};
        drv.add(&[rd(0x1_0000, 16), wr(0x2_0000, 512), wr(0x3_0000, 1)]);
        w(&mut t, REG_QUEUE_NOTIFY, 0);
        assert_eq!(drv.wait_used(1).len(), 513);
        assert_eq!(mem.read_obj::<u8>(GuestAddress(0x3_0000)).unwrap(), 0);
        assert_eq!(
            panics.load(Ordering::SeqCst),
            0,
            "no device worker panicked"
        );
    }

    /// Fills queue 0's rings at 0x1_0000 with random chains (random addresses, lengths,
    /// flags and next indices; a valid available index) and brings the transport up.
    fn bring_up_over_random_chains(t: &mut MmioTransport, next: &mut impl FnMut() -> u64) {
        use vm_memory::Bytes;
        let mem = t.mem.clone();
        for i in 0..u64::from(QUEUE_MAX) {
            let r = next();
            let addr = if r & 1 == 0 {
                (r >> 8) % MEM_SIZE as u64
            } else {
                r >> 4
            };
            let len = match (r >> 60) % 4 {
                0 => 1,
                1 => 16,
                2 => 512,
                _ => (r >> 20) as u32,
            };
            let flags = (r >> 36) as u16 & 0x7; // NEXT, WRITE, INDIRECT
            let next_idx = (r >> 40) as u16 % (QUEUE_MAX + 2);
            let desc = 0x1_0000 + i * 16;
            mem.write_obj(addr, GuestAddress(desc)).unwrap();
            mem.write_obj(len, GuestAddress(desc + 8)).unwrap();
            mem.write_obj(flags, GuestAddress(desc + 12)).unwrap();
            mem.write_obj(next_idx, GuestAddress(desc + 14)).unwrap();
            mem.write_obj(
                (next() % u64::from(QUEUE_MAX + 1)) as u16,
                GuestAddress(0x1_1004 + i * 2),
            )
            .unwrap();
        }
        mem.write_obj(0u16, GuestAddress(0x1_1000)).unwrap();
        mem.write_obj(
            (next() % u64::from(QUEUE_MAX) + 1) as u16,
            GuestAddress(0x1_1002),
        )
        .unwrap();
        let features = t.avail_features;
        negotiate(t, features);
        setup_queue(t, 0, 0x1_0000);
        w(t, REG_STATUS, ALL_OK);
    }
}
