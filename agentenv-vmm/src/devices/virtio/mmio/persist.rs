//! The transport's part of a snapshot: its registers, each queue's configuration and
//! position, and the device's own state (see [`crate::devices::virtio::persist`]).

use serde::{Deserialize, Serialize};
use virtio_queue::{Queue, QueueState, QueueT};

use super::{MmioError, MmioTransport, status};
use crate::sync::lock;

/// Version of [`MmioTransportState`] this build writes and reads.
pub const MMIO_STATE_VERSION: u32 = 1;

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
    /// The device's own state: its typed state with its `"version"`, as
    /// [`SavedState`](crate::devices::virtio::persist::SavedState) wrote it.
    pub device: serde_json::Value,
}

impl MmioTransport {
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
            device: lock(&self.device)
                .save_state()
                .map_err(MmioError::SaveDeviceState)?,
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

#[cfg(test)]
mod tests {
    use super::super::registers::{REG_INTERRUPT_STATUS, REG_STATUS};
    use super::super::tests::{ALL_OK, MEM_SIZE, OFFERED, Recorder, bring_up, r, transport_with};
    use super::*;

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
}
