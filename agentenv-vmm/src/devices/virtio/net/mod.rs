//! virtio-net over a tap device.
//!
//! Two queues, receive (0) and transmit (1); no control queue. Every frame carries the
//! 12-byte `virtio_net_hdr_v1`, which the tap speaks too (`IFF_VNET_HDR`, header size 12),
//! so the header passes through unchanged in both directions and the kernel does the
//! checksum and segmentation work the header asks for.
//!
//! Features offered: `VERSION_1`, `MAC` (the configured address in the config space),
//! `CSUM` + `HOST_TSO4` + `HOST_TSO6` (the guest may send frames with a partial checksum
//! and TCP segments up to 64 KiB: the tap accepts both through the header), and
//! `GUEST_CSUM` + `GUEST_TSO4` + `GUEST_TSO6` (the kernel may hand the guest such frames;
//! the tap is told with `TUNSETOFFLOAD` exactly what the driver acknowledged, nothing
//! else). `MRG_RXBUF` is not offered: a received frame goes into one descriptor chain,
//! so a driver that takes `GUEST_TSO*` posts 64 KiB receive buffers (Linux does, its
//! "big packets" mode) and one that does not gets frames of at most the MTU.
//!
//! Transmit: each chain (header + frame, device-readable only, at most
//! [`MAX_CHAIN_LEN`] bytes) is gathered and written to the tap as one frame. Receive: a
//! frame is read from the tap only when it can be placed; when the guest has no buffer
//! the frame waits (never dropped) and the tap is not read again until the driver adds
//! buffers. A frame larger than the chain it would go into is dropped and counted, and the
//! chain goes back to the driver with length 0. One interrupt per batch of used buffers.
//!
//! Malformed chains (loops, addresses outside guest memory, over [`MAX_CHAIN_LEN`],
//! shorter than the header, wrong direction) are counted as errors and returned with
//! length 0; the device keeps running.

pub mod chain;
#[cfg(test)]
pub(crate) mod test_util;

use std::io::{self, IoSlice};
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Serialize};
use virtio_queue::{Queue, QueueOwnedT, QueueT};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::eventfd::EventFd;

use self::chain::{Direction, check_chain, return_unused};
use super::persist::{Persist, StateError};
use super::tap::{Tap, TapError, VNET_HDR_LEN};
use super::worker::{Worker, WorkerCtl, WorkerHandler, stop_worker};
use super::{
    ActivateContext, ActivateError, VirtioDevice, VirtioInterrupt, check_inactive,
    read_config_bytes,
};
use crate::memory::GuestMemoryMmap;

/// virtio device id of a network card.
pub const VIRTIO_ID_NET: u32 = 1;

/// Feature bits (virtio 1.2, 5.1.3).
pub const VIRTIO_NET_F_CSUM: u32 = 0;
pub const VIRTIO_NET_F_GUEST_CSUM: u32 = 1;
pub const VIRTIO_NET_F_MAC: u32 = 5;
pub const VIRTIO_NET_F_GUEST_TSO4: u32 = 7;
pub const VIRTIO_NET_F_GUEST_TSO6: u32 = 8;
pub const VIRTIO_NET_F_HOST_TSO4: u32 = 11;
pub const VIRTIO_NET_F_HOST_TSO6: u32 = 12;
pub const VIRTIO_F_VERSION_1: u32 = 32;

/// Size of each queue.
pub const QUEUE_SIZE: u16 = 256;
/// Index of the receive queue.
pub const RX_QUEUE: usize = 0;
/// Index of the transmit queue.
pub const TX_QUEUE: usize = 1;

/// The largest chain the device takes, header included: the 65562 bytes of the virtio
/// spec's receive-buffer rule (a 64 KiB IP packet, Ethernet and VLAN headers, the
/// virtio-net header). A transmit chain above it is malformed.
pub const MAX_CHAIN_LEN: usize = 65562;

/// Why a net device could not be created.
#[derive(Debug, thiserror::Error)]
pub enum NetError {
    #[error("net device {id:?}: {source}")]
    Tap {
        id: String,
        #[source]
        source: TapError,
    },
    #[error(
        "MAC address {0:?} is invalid: write six hex bytes separated by colons, like 06:00:ac:10:00:02"
    )]
    InvalidMac(String),
}

/// Parses `aa:bb:cc:dd:ee:ff`.
pub fn parse_mac(s: &str) -> Result<[u8; 6], NetError> {
    let mut mac = [0u8; 6];
    let mut parts = s.split(':');
    for byte in &mut mac {
        let part = parts.next().ok_or_else(|| NetError::InvalidMac(s.into()))?;
        if part.len() != 2 {
            return Err(NetError::InvalidMac(s.into()));
        }
        *byte = u8::from_str_radix(part, 16).map_err(|_| NetError::InvalidMac(s.into()))?;
    }
    if parts.next().is_some() {
        return Err(NetError::InvalidMac(s.into()));
    }
    Ok(mac)
}

fn format_mac(mac: &[u8; 6]) -> String {
    mac.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

/// Live counters of one net device.
#[derive(Debug, Default)]
pub struct NetMetrics {
    rx_packets: AtomicU64,
    rx_bytes: AtomicU64,
    rx_dropped: AtomicU64,
    rx_errors: AtomicU64,
    tx_packets: AtomicU64,
    tx_bytes: AtomicU64,
    tx_dropped: AtomicU64,
    tx_errors: AtomicU64,
    interrupts: AtomicU64,
}

/// A copy of the counters. Bytes count frames without the virtio-net header.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetMetricsSnapshot {
    /// Frames placed in guest receive buffers.
    pub rx_packets: u64,
    pub rx_bytes: u64,
    /// Frames from the tap that did not fit the guest's buffer.
    pub rx_dropped: u64,
    /// Malformed receive chains, tap read errors.
    pub rx_errors: u64,
    /// Frames written to the tap.
    pub tx_packets: u64,
    pub tx_bytes: u64,
    /// Frames the tap refused (interface down, bad header).
    pub tx_dropped: u64,
    /// Malformed transmit chains.
    pub tx_errors: u64,
    /// Interrupts raised.
    pub interrupts: u64,
}

impl NetMetrics {
    fn inc(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    /// Reads every counter.
    pub fn snapshot(&self) -> NetMetricsSnapshot {
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        NetMetricsSnapshot {
            rx_packets: g(&self.rx_packets),
            rx_bytes: g(&self.rx_bytes),
            rx_dropped: g(&self.rx_dropped),
            rx_errors: g(&self.rx_errors),
            tx_packets: g(&self.tx_packets),
            tx_bytes: g(&self.tx_bytes),
            tx_dropped: g(&self.tx_dropped),
            tx_errors: g(&self.tx_errors),
            interrupts: g(&self.interrupts),
        }
    }
}

/// The device state kept in snapshots.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetState {
    /// The guest's MAC address, `aa:bb:cc:dd:ee:ff`.
    pub mac: String,
}

/// A frame read from the tap and not yet placed in a guest buffer.
struct RxFrame {
    buf: Box<[u8]>,
    pending: Option<usize>,
}

impl RxFrame {
    fn new() -> Self {
        RxFrame {
            buf: vec![0u8; MAX_CHAIN_LEN].into_boxed_slice(),
            pending: None,
        }
    }
}

/// The queues and buffers the worker thread owns while the device is active.
struct NetCore {
    mem: GuestMemoryMmap,
    interrupt: Arc<VirtioInterrupt>,
    rx: Queue,
    tx: Queue,
    tap: Arc<Tap>,
    metrics: Arc<NetMetrics>,
    queue_events: Vec<EventFd>,
    rx_frame: RxFrame,
    tx_buf: Vec<u8>,
    /// The tap's queue was full: transmit waits for it to drain.
    tx_blocked: bool,
}

impl NetCore {
    /// Sends every available transmit chain. Returns whether a chain was used, and
    /// whether the tap's queue was full (the rest waits for it to drain).
    fn process_tx(&mut self) -> (bool, bool) {
        let mut used = false;
        while let Some(chain) = self.tx.pop_descriptor_chain(&self.mem) {
            let checked =
                match check_chain(chain, &self.mem, Direction::ReadOnly, MAX_CHAIN_LEN as u64) {
                    Ok(c) => c,
                    Err((head, e)) => {
                        tracing::warn!(error = %e, head, "virtio-net: malformed transmit chain");
                        NetMetrics::inc(&self.metrics.tx_errors, 1);
                        return_unused(&mut self.tx, &self.mem, head);
                        used = true;
                        continue;
                    }
                };
            let head = checked.head;
            let len = checked.readable_len();
            if len < VNET_HDR_LEN {
                tracing::warn!(
                    len,
                    head,
                    "virtio-net: transmit chain shorter than the virtio-net header"
                );
                NetMetrics::inc(&self.metrics.tx_errors, 1);
                return_unused(&mut self.tx, &self.mem, head);
                used = true;
                continue;
            }
            self.tx_buf.resize(len, 0);
            if let Err(e) = checked.read_at(&self.mem, 0, &mut self.tx_buf) {
                tracing::warn!(error = %e, head, "virtio-net: cannot read a transmit chain");
                NetMetrics::inc(&self.metrics.tx_errors, 1);
                return_unused(&mut self.tx, &self.mem, head);
                used = true;
                continue;
            }
            match self.tap.write_frame(&[IoSlice::new(&self.tx_buf)]) {
                Ok(_) => {
                    NetMetrics::inc(&self.metrics.tx_packets, 1);
                    NetMetrics::inc(&self.metrics.tx_bytes, (len - VNET_HDR_LEN) as u64);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    // The tap's queue is full: this chain goes first once it drains.
                    self.tx.go_to_previous_position();
                    return (used, true);
                }
                Err(e) => {
                    tracing::debug!(error = %e, "virtio-net: the tap refused a frame");
                    NetMetrics::inc(&self.metrics.tx_dropped, 1);
                }
            }
            return_unused(&mut self.tx, &self.mem, head);
            used = true;
        }
        (used, false)
    }

    /// Moves frames from the tap into guest receive buffers until the tap is empty or
    /// the guest has no buffer left (the frame then waits). Returns whether a chain was
    /// used.
    fn process_rx(&mut self) -> bool {
        let mut used = false;
        loop {
            let len = match self.rx_frame.pending {
                Some(len) => len,
                None => match self.tap.read_frame(&mut self.rx_frame.buf) {
                    Ok(n) if n < VNET_HDR_LEN => {
                        // A tap always prepends the header; a shorter read means the
                        // descriptor is not what we opened.
                        tracing::warn!(n, "virtio-net: short read from the tap");
                        NetMetrics::inc(&self.metrics.rx_errors, 1);
                        break;
                    }
                    Ok(n) => n,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e) => {
                        tracing::warn!(error = %e, "virtio-net: cannot read from the tap");
                        NetMetrics::inc(&self.metrics.rx_errors, 1);
                        break;
                    }
                },
            };
            self.rx_frame.pending = Some(len);
            let Some(chain) = self.rx.pop_descriptor_chain(&self.mem) else {
                // No buffer: the frame waits for the driver to add some.
                break;
            };
            let checked =
                match check_chain(chain, &self.mem, Direction::WriteOnly, u64::from(u32::MAX)) {
                    Ok(c) => c,
                    Err((head, e)) => {
                        tracing::warn!(error = %e, head, "virtio-net: malformed receive chain");
                        NetMetrics::inc(&self.metrics.rx_errors, 1);
                        return_unused(&mut self.rx, &self.mem, head);
                        used = true;
                        continue;
                    }
                };
            if checked.writable_len() < len {
                tracing::debug!(
                    frame = len,
                    buffer = checked.writable_len(),
                    "virtio-net: received frame larger than the guest's buffer, dropped"
                );
                NetMetrics::inc(&self.metrics.rx_dropped, 1);
                self.rx_frame.pending = None;
                // The driver gets the buffer back empty, so a ring of too-small buffers
                // cannot stall reception.
                return_unused(&mut self.rx, &self.mem, checked.head);
                used = true;
                continue;
            }
            // Without MRG_RXBUF every frame fills exactly one chain.
            self.rx_frame.buf[10..12].copy_from_slice(&1u16.to_le_bytes());
            self.rx_frame.pending = None;
            match checked.write_at(&self.mem, 0, &self.rx_frame.buf[..len]) {
                Ok(_) => {
                    if let Err(e) = self.rx.add_used(&self.mem, checked.head, len as u32) {
                        tracing::warn!(error = %e, "virtio-net: cannot update the used ring");
                    }
                    NetMetrics::inc(&self.metrics.rx_packets, 1);
                    NetMetrics::inc(&self.metrics.rx_bytes, (len - VNET_HDR_LEN) as u64);
                }
                Err(e) => {
                    tracing::warn!(error = %e, "virtio-net: cannot write a receive chain");
                    NetMetrics::inc(&self.metrics.rx_errors, 1);
                    return_unused(&mut self.rx, &self.mem, checked.head);
                }
            }
            used = true;
        }
        used
    }

    fn notify(&mut self, queue: usize) {
        let q = if queue == RX_QUEUE {
            &mut self.rx
        } else {
            &mut self.tx
        };
        let needed = q.needs_notification(&self.mem).unwrap_or(true);
        if needed {
            NetMetrics::inc(&self.metrics.interrupts, 1);
            if let Err(e) = self.interrupt.signal_used_queue() {
                tracing::warn!(error = %e, "virtio-net: cannot raise the interrupt");
            }
        }
    }

    fn run_tx(&mut self) -> bool {
        let (used, blocked) = self.process_tx();
        if used {
            self.notify(TX_QUEUE);
        }
        blocked
    }

    fn run_rx(&mut self) {
        if self.process_rx() {
            self.notify(RX_QUEUE);
        }
    }
}

const TOKEN_RX: u64 = 0;
const TOKEN_TX: u64 = 1;
const TOKEN_TAP: u64 = 2;

impl WorkerHandler for NetCore {
    fn on_start(&mut self, ctl: &WorkerCtl) {
        // Edge-triggered: a frame that waits for a guest buffer does not wake the thread
        // again and again; the driver's next notification resumes reading.
        if let Err(e) = ctl.add(
            self.tap.as_raw_fd(),
            TOKEN_TAP,
            EventSet::IN | EventSet::OUT | EventSet::EDGE_TRIGGERED,
        ) {
            tracing::error!(error = %e, "virtio-net: cannot watch the tap");
        }
        self.tx_blocked = self.run_tx();
        self.run_rx();
    }

    fn handle_event(&mut self, _ctl: &WorkerCtl, token: u64, events: EventSet) {
        match token {
            TOKEN_RX => {
                let _ = self.queue_events[RX_QUEUE].read();
                self.run_rx();
            }
            TOKEN_TX => {
                let _ = self.queue_events[TX_QUEUE].read();
                if !self.tx_blocked {
                    self.tx_blocked = self.run_tx();
                }
            }
            TOKEN_TAP => {
                if events.contains(EventSet::IN) {
                    self.run_rx();
                }
                if events.contains(EventSet::OUT) && self.tx_blocked {
                    self.tx_blocked = self.run_tx();
                }
            }
            _ => {}
        }
    }
}

/// A virtio-net device attached to a tap.
pub struct Net {
    id: String,
    mac: [u8; 6],
    tap: Arc<Tap>,
    acked_features: u64,
    metrics: Arc<NetMetrics>,
    rx_frame: Option<RxFrame>,
    worker: Option<Worker<NetCore>>,
}

impl Net {
    /// Opens the tap `tap_name` (it must exist in the current network namespace, or is
    /// created for the life of the device) for a guest NIC with address `mac`.
    pub fn new(id: impl Into<String>, tap_name: &str, mac: [u8; 6]) -> Result<Net, NetError> {
        let id = id.into();
        let tap = Tap::open(tap_name).map_err(|source| NetError::Tap {
            id: id.clone(),
            source,
        })?;
        Ok(Net {
            id,
            mac,
            tap: Arc::new(tap),
            acked_features: 0,
            metrics: Arc::new(NetMetrics::default()),
            rx_frame: Some(RxFrame::new()),
            worker: None,
        })
    }

    /// The device id from the configuration.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The guest's MAC address.
    pub fn mac(&self) -> [u8; 6] {
        self.mac
    }

    /// The tap's interface name.
    pub fn tap_name(&self) -> &str {
        self.tap.name()
    }

    /// The live counters (shared with the worker; read them any time).
    pub fn metrics(&self) -> Arc<NetMetrics> {
        self.metrics.clone()
    }

    /// How many times the worker caught a panic while handling an event (each one is a
    /// bug; the device went on serving).
    pub fn worker_panics(&self) -> u64 {
        self.worker.as_ref().map_or(0, |w| w.handler_panics())
    }

    fn tap_offload_flags(&self) -> u32 {
        let acked = |bit: u32| self.acked_features & (1u64 << bit) != 0;
        let mut flags = 0;
        if acked(VIRTIO_NET_F_GUEST_CSUM) {
            flags |= libc::TUN_F_CSUM;
            if acked(VIRTIO_NET_F_GUEST_TSO4) {
                flags |= libc::TUN_F_TSO4;
            }
            if acked(VIRTIO_NET_F_GUEST_TSO6) {
                flags |= libc::TUN_F_TSO6;
            }
        }
        flags
    }
}

impl VirtioDevice for Net {
    fn metrics(&self) -> serde_json::Value {
        serde_json::to_value(self.metrics.snapshot()).unwrap_or_default()
    }

    fn device_type(&self) -> u32 {
        VIRTIO_ID_NET
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &[QUEUE_SIZE, QUEUE_SIZE]
    }

    fn avail_features(&self) -> u64 {
        [
            VIRTIO_F_VERSION_1,
            VIRTIO_NET_F_MAC,
            VIRTIO_NET_F_CSUM,
            VIRTIO_NET_F_HOST_TSO4,
            VIRTIO_NET_F_HOST_TSO6,
            VIRTIO_NET_F_GUEST_CSUM,
            VIRTIO_NET_F_GUEST_TSO4,
            VIRTIO_NET_F_GUEST_TSO6,
        ]
        .iter()
        .fold(0u64, |acc, bit| acc | (1u64 << bit))
    }

    fn set_acked_features(&mut self, features: u64) {
        self.acked_features = features & self.avail_features();
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        read_config_bytes(&self.mac, offset, data);
    }

    fn write_config(&mut self, offset: u64, data: &[u8]) {
        // With VERSION_1 the MAC is read-only for the driver.
        tracing::debug!(
            offset,
            len = data.len(),
            "virtio-net: write to the read-only config space ignored"
        );
    }

    fn activate(&mut self, ctx: ActivateContext) -> Result<(), ActivateError> {
        check_inactive(&self.worker, format_args!("net device {:?}", self.id))?;
        ctx.check_queue_count(2)?;
        self.tap
            .set_offload(self.tap_offload_flags())
            .map_err(|e| ActivateError::Other(e.to_string()))?;
        let mut queues = ctx.queues.into_iter();
        let (Some(rx), Some(tx)) = (queues.next(), queues.next()) else {
            return Err(ActivateError::QueueCount { got: 0, want: 2 });
        };
        let sources = [
            (ctx.queue_events[RX_QUEUE].as_raw_fd(), TOKEN_RX),
            (ctx.queue_events[TX_QUEUE].as_raw_fd(), TOKEN_TX),
        ];
        let core = NetCore {
            mem: ctx.mem,
            interrupt: ctx.interrupt,
            rx,
            tx,
            tap: self.tap.clone(),
            metrics: self.metrics.clone(),
            queue_events: ctx.queue_events,
            rx_frame: self.rx_frame.take().unwrap_or_else(RxFrame::new),
            tx_buf: Vec::with_capacity(MAX_CHAIN_LEN),
            tx_blocked: false,
        };
        let worker = Worker::spawn(&format!("net-{}", self.id), core, &sources)
            .map_err(|e| ActivateError::Other(format!("net device {:?}: {e}", self.id)))?;
        self.worker = Some(worker);
        Ok(())
    }

    fn deactivate(&mut self) -> Option<(Vec<Queue>, Vec<EventFd>)> {
        let core = stop_worker(&mut self.worker)?;
        self.rx_frame = Some(core.rx_frame);
        Some((vec![core.rx, core.tx], core.queue_events))
    }
}

impl Persist for Net {
    type State = NetState;
    const STATE_VERSION: u32 = 1;
    const NAME: &'static str = "virtio-net";

    fn save(&self) -> NetState {
        NetState {
            mac: format_mac(&self.mac),
        }
    }

    fn restore(&mut self, state: NetState) -> Result<(), StateError> {
        // The guest driver already knows the MAC it read before the snapshot.
        self.mac = parse_mac(&state.mac).map_err(|e| StateError::Invalid(e.to_string()))?;
        Ok(())
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        let _ = self.deactivate();
    }
}

#[cfg(test)]
mod proptests;
#[cfg(test)]
mod tests;
