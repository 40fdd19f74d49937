//! The register file of the virtio-mmio transport: what a guest's read or write of each
//! register does (feature negotiation, queue setup, the device status state machine).

use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_queue::QueueT;
use vm_memory::GuestAddress;

use super::{MMIO_MAGIC, MMIO_VENDOR_ID, MMIO_VERSION, MmioTransport, NOTIFY_OFFSET, status};
use crate::sync::lock;

pub(super) const REG_MAGIC: u64 = 0x000;
pub(super) const REG_VERSION: u64 = 0x004;
pub(super) const REG_DEVICE_ID: u64 = 0x008;
pub(super) const REG_VENDOR_ID: u64 = 0x00c;
pub(super) const REG_DEVICE_FEATURES: u64 = 0x010;
pub(super) const REG_DEVICE_FEATURES_SEL: u64 = 0x014;
pub(super) const REG_DRIVER_FEATURES: u64 = 0x020;
pub(super) const REG_DRIVER_FEATURES_SEL: u64 = 0x024;
pub(super) const REG_QUEUE_SEL: u64 = 0x030;
pub(super) const REG_QUEUE_NUM_MAX: u64 = 0x034;
pub(super) const REG_QUEUE_NUM: u64 = 0x038;
pub(super) const REG_QUEUE_READY: u64 = 0x044;
pub(super) const REG_QUEUE_NOTIFY: u64 = NOTIFY_OFFSET;
pub(super) const REG_INTERRUPT_STATUS: u64 = 0x060;
pub(super) const REG_INTERRUPT_ACK: u64 = 0x064;
pub(super) const REG_STATUS: u64 = 0x070;
pub(super) const REG_QUEUE_DESC_LOW: u64 = 0x080;
pub(super) const REG_QUEUE_DESC_HIGH: u64 = 0x084;
pub(super) const REG_QUEUE_DRIVER_LOW: u64 = 0x090;
pub(super) const REG_QUEUE_DRIVER_HIGH: u64 = 0x094;
pub(super) const REG_QUEUE_DEVICE_LOW: u64 = 0x0a0;
pub(super) const REG_QUEUE_DEVICE_HIGH: u64 = 0x0a4;
pub(super) const REG_SHM_SEL: u64 = 0x0ac;
pub(super) const REG_SHM_LEN_LOW: u64 = 0x0b0;
pub(super) const REG_SHM_LEN_HIGH: u64 = 0x0b4;
pub(super) const REG_SHM_BASE_LOW: u64 = 0x0b8;
pub(super) const REG_SHM_BASE_HIGH: u64 = 0x0bc;
pub(super) const REG_CONFIG_GENERATION: u64 = 0x0fc;

impl MmioTransport {
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

    pub(super) fn read_register(&self, offset: u64) -> Option<u32> {
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

    pub(super) fn write_register(&mut self, offset: u64, value: u32) {
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
}
