//! virtio-vsock, host side over unix sockets (the Firecracker convention).
//!
//! The guest has context id `guest_cid` (config space: a little-endian u64); the host is
//! CID 2. Three queues: receive (0), transmit (1), event (2). Only stream sockets.
//!
//! * **Host → guest**: a host process connects to the unix socket `uds_path` and writes
//!   `CONNECT <port>\n`. The device sends a REQUEST to guest port `<port>` from a fresh
//!   host port (from 2^30 up). When the guest answers RESPONSE the device writes
//!   `OK <host port>\n` on the host stream, then relays bytes both ways. An RST from the
//!   guest, or no answer within 2 s, closes the host stream.
//! * **Guest → host**: a REQUEST to host port P connects to the unix socket
//!   `<uds_path>_<P>`; RESPONSE when someone listens there, RST when nobody does.
//! * **Flow control**: every packet carries `buf_alloc` (256 KiB per connection) and
//!   `fwd_cnt` (bytes handed to the host stream); data the host stream does not take at
//!   once waits in a per-connection buffer that the guest's credit bounds, so a guest
//!   that sends past its credit is reset. Data goes to the guest only within the credit
//!   the guest announced; without credit the device sends CREDIT_REQUEST.
//! * **Closing**: SHUTDOWN from the guest with both flags delivers what is buffered,
//!   closes the host stream and confirms with RST; with SEND alone the host stream is
//!   shut for writing. When the host stream ends, the guest gets SHUTDOWN and 2 s to RST.
//! * **Bad input**: a packet with a wrong type, CID, length or op, or for a connection
//!   that does not exist, is answered with RST and counted; malformed chains are
//!   returned with length 0 and counted. Nothing a guest sends panics the VMM.
//! * **Snapshots**: connections are not part of a snapshot. A restored device starts
//!   with none and sends VIRTIO_VSOCK_EVENT_TRANSPORT_RESET on the event queue, so the
//!   guest drops its sockets; host processes reconnect. Pausing and resuming the same
//!   VM (deactivate, activate) keeps the connections.

mod muxer;
pub mod packet;

use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Serialize};
use virtio_queue::Queue;
use vmm_sys_util::eventfd::EventFd;
use vmm_sys_util::timerfd::TimerFd;

pub use self::muxer::{
    CLOSE_TIMEOUT, CONN_BUF_ALLOC, MAX_CONNECTIONS, MAX_PENDING_RX, MAX_PKT_DATA,
};
use self::muxer::{MuxerState, TOKEN_EVENT, TOKEN_RX, TOKEN_TX, VsockCore};
use super::persist::{Persist, StateError};
use super::worker::{Worker, stop_worker};
use super::{ActivateContext, ActivateError, VirtioDevice, check_inactive, read_config_bytes};

/// virtio device id of a socket device.
pub const VIRTIO_ID_VSOCK: u32 = 19;
const VIRTIO_F_VERSION_1: u32 = 32;
/// Size of each queue.
pub const QUEUE_SIZE: u16 = 256;
pub const RX_QUEUE: usize = 0;
pub const TX_QUEUE: usize = 1;
pub const EVENT_QUEUE: usize = 2;

/// Why a vsock device could not be created.
#[derive(Debug, thiserror::Error)]
pub enum VsockError {
    #[error(
        "vsock guest_cid {0} is invalid: use a value of at least 3 (0-2 are reserved) below 2^32"
    )]
    InvalidCid(u64),
    #[error("vsock uds_path {path:?} exists and is not a socket: remove it or choose another path")]
    PathInUse { path: PathBuf },
    #[error(
        "vsock uds_path {path:?} cannot be prepared (is the directory there and writable?): {source}"
    )]
    Path {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("vsock cannot listen on {path:?}: {source}")]
    Bind {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

/// Live counters of the vsock device.
#[derive(Debug, Default)]
pub struct VsockMetrics {
    rx_packets: AtomicU64,
    rx_bytes: AtomicU64,
    rx_errors: AtomicU64,
    tx_packets: AtomicU64,
    tx_bytes: AtomicU64,
    tx_errors: AtomicU64,
    conns_opened: AtomicU64,
    conns_closed: AtomicU64,
    rst_sent: AtomicU64,
    ctrl_dropped: AtomicU64,
    transport_resets: AtomicU64,
    interrupts: AtomicU64,
}

/// A copy of the counters. Bytes count stream payload.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct VsockMetricsSnapshot {
    /// Packets placed in guest receive buffers.
    pub rx_packets: u64,
    pub rx_bytes: u64,
    /// Malformed or too-small receive chains.
    pub rx_errors: u64,
    /// Valid packets the guest sent.
    pub tx_packets: u64,
    pub tx_bytes: u64,
    /// Malformed chains and invalid packets from the guest.
    pub tx_errors: u64,
    pub conns_opened: u64,
    pub conns_closed: u64,
    pub rst_sent: u64,
    /// Control packets not queued because `MAX_PENDING_RX` were already waiting.
    pub ctrl_dropped: u64,
    pub transport_resets: u64,
    pub interrupts: u64,
}

impl VsockMetrics {
    fn inc(&self, c: &AtomicU64) {
        c.fetch_add(1, Ordering::Relaxed);
    }

    fn add(&self, c: &AtomicU64, n: u64) {
        c.fetch_add(n, Ordering::Relaxed);
    }

    /// Reads every counter.
    pub fn snapshot(&self) -> VsockMetricsSnapshot {
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        VsockMetricsSnapshot {
            rx_packets: g(&self.rx_packets),
            rx_bytes: g(&self.rx_bytes),
            rx_errors: g(&self.rx_errors),
            tx_packets: g(&self.tx_packets),
            tx_bytes: g(&self.tx_bytes),
            tx_errors: g(&self.tx_errors),
            conns_opened: g(&self.conns_opened),
            conns_closed: g(&self.conns_closed),
            rst_sent: g(&self.rst_sent),
            ctrl_dropped: g(&self.ctrl_dropped),
            transport_resets: g(&self.transport_resets),
            interrupts: g(&self.interrupts),
        }
    }
}

/// The device state kept in snapshots (connections are not kept: see the module
/// documentation).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VsockState {
    pub guest_cid: u64,
}

/// The virtio-vsock device.
pub struct Vsock {
    guest_cid: u64,
    uds_path: PathBuf,
    metrics: Arc<VsockMetrics>,
    state: Option<MuxerState>,
    worker: Option<Worker<VsockCore>>,
}

impl Vsock {
    /// A device for a guest with context id `guest_cid`, listening for host connections
    /// on the unix socket `uds_path` (a stale socket there is replaced; the socket is
    /// removed when the device is dropped).
    pub fn new(guest_cid: u64, uds_path: impl AsRef<Path>) -> Result<Vsock, VsockError> {
        if guest_cid < 3 || guest_cid >= u64::from(u32::MAX) {
            return Err(VsockError::InvalidCid(guest_cid));
        }
        let path = uds_path.as_ref().to_path_buf();
        match std::fs::symlink_metadata(&path) {
            Ok(m) if m.file_type().is_socket() => {
                std::fs::remove_file(&path).map_err(|source| VsockError::Path {
                    path: path.clone(),
                    source,
                })?;
            }
            Ok(_) => return Err(VsockError::PathInUse { path }),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(source) => return Err(VsockError::Path { path, source }),
        }
        let listener = UnixListener::bind(&path).map_err(|source| VsockError::Bind {
            path: path.clone(),
            source,
        })?;
        listener
            .set_nonblocking(true)
            .map_err(|source| VsockError::Bind {
                path: path.clone(),
                source,
            })?;
        Ok(Vsock {
            guest_cid,
            uds_path: path.clone(),
            metrics: Arc::new(VsockMetrics::default()),
            state: Some(MuxerState::new(listener, path)),
            worker: None,
        })
    }

    pub fn guest_cid(&self) -> u64 {
        self.guest_cid
    }

    pub fn uds_path(&self) -> &Path {
        &self.uds_path
    }

    /// The live counters (shared with the worker; read them any time).
    pub fn metrics(&self) -> Arc<VsockMetrics> {
        self.metrics.clone()
    }

    /// How many times the worker caught a panic while handling an event (each one is a
    /// bug; the device went on serving).
    pub fn worker_panics(&self) -> u64 {
        self.worker.as_ref().map_or(0, |w| w.handler_panics())
    }
}

impl VirtioDevice for Vsock {
    fn metrics(&self) -> serde_json::Value {
        serde_json::to_value(self.metrics.snapshot()).unwrap_or_default()
    }

    fn device_type(&self) -> u32 {
        VIRTIO_ID_VSOCK
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &[QUEUE_SIZE, QUEUE_SIZE, QUEUE_SIZE]
    }

    fn avail_features(&self) -> u64 {
        1u64 << VIRTIO_F_VERSION_1
    }

    fn set_acked_features(&mut self, _features: u64) {}

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        let cfg = self.guest_cid.to_le_bytes();
        read_config_bytes(&cfg, offset, data);
    }

    fn write_config(&mut self, offset: u64, data: &[u8]) {
        tracing::debug!(
            offset,
            len = data.len(),
            "vsock: write to the read-only config space ignored"
        );
    }

    fn activate(&mut self, ctx: ActivateContext) -> Result<(), ActivateError> {
        check_inactive(&self.worker, "the vsock device")?;
        ctx.check_queue_count(3)?;
        let timer = TimerFd::new()
            .map_err(|e| ActivateError::Backend(io::Error::from_raw_os_error(e.errno())))?;
        let state = self
            .state
            .take()
            .ok_or_else(|| ActivateError::Other("the vsock device lost its host socket".into()))?;
        let sources = [
            (ctx.queue_events[RX_QUEUE].as_raw_fd(), TOKEN_RX),
            (ctx.queue_events[TX_QUEUE].as_raw_fd(), TOKEN_TX),
            (ctx.queue_events[EVENT_QUEUE].as_raw_fd(), TOKEN_EVENT),
        ];
        let core = VsockCore::new(
            ctx.mem,
            ctx.interrupt,
            ctx.queues,
            ctx.queue_events,
            self.guest_cid,
            self.metrics.clone(),
            state,
            timer,
        );
        match Worker::spawn("vsock", core, &sources) {
            Ok(w) => {
                self.worker = Some(w);
                Ok(())
            }
            Err(e) => Err(ActivateError::Other(format!("vsock: {e}"))),
        }
    }

    fn deactivate(&mut self) -> Option<(Vec<Queue>, Vec<EventFd>)> {
        let core = stop_worker(&mut self.worker)?;
        self.state = Some(core.state);
        Some((core.queues, core.queue_events))
    }
}

impl Persist for Vsock {
    type State = VsockState;
    const STATE_VERSION: u32 = 1;
    const NAME: &'static str = "vsock";

    fn save(&self) -> VsockState {
        VsockState {
            guest_cid: self.guest_cid,
        }
    }

    fn restore(&mut self, saved: VsockState) -> Result<(), StateError> {
        if saved.guest_cid != self.guest_cid {
            return Err(StateError::Invalid(format!(
                "vsock: the snapshot's guest_cid is {}, the configuration says {}: they must match",
                saved.guest_cid, self.guest_cid
            )));
        }
        let Some(muxer) = self.state.as_mut() else {
            return Err(StateError::Invalid(
                "vsock: restore_state called on an active device".into(),
            ));
        };
        // Connections do not survive a snapshot: the guest is told to drop its sockets.
        muxer.clear_connections();
        muxer.reset_pending = true;
        Ok(())
    }
}

impl Drop for Vsock {
    fn drop(&mut self) {
        let _ = self.deactivate();
        let _ = std::fs::remove_file(&self.uds_path);
    }
}

#[cfg(test)]
mod tests;
