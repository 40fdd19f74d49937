//! The host side of virtio-vsock: guest stream connections relayed to unix sockets.
//!
//! Runs on the device's worker thread. It owns the three queues, the listening socket at
//! `uds_path`, the host streams still sending their `CONNECT <port>` line, and the
//! established connections, keyed by (host port, guest port).
//!
//! Rooms: the connection state and the worker's shared steps are here; the host side
//! (`host`), what the guest transmits (`tx`) and what it receives (`rx`) each have a file.

mod host;
#[cfg(test)]
mod proptests;
mod rx;
mod tx;

use std::collections::{HashMap, VecDeque};
use std::io::{self, Write};
use std::num::Wrapping;
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use virtio_queue::{Queue, QueueT};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::eventfd::EventFd;
use vmm_sys_util::timerfd::TimerFd;

use super::packet::*;
use super::{EVENT_QUEUE, RX_QUEUE, TX_QUEUE, VsockMetrics};
use crate::devices::virtio::VirtioInterrupt;
use crate::devices::virtio::net::chain::{Direction, check_chain, return_unused};
use crate::devices::virtio::worker::{WorkerCtl, WorkerHandler};
use crate::memory::GuestMemoryMmap;

/// Receive buffer space we announce per connection (`buf_alloc`): how many bytes the
/// guest may send before we forward them to the host stream. Also the most a connection
/// buffers when the host reads slowly.
pub const CONN_BUF_ALLOC: u32 = 256 * 1024;
/// We tell the guest about freed space once this much was forwarded since the last time.
const CREDIT_UPDATE_THRESHOLD: u32 = CONN_BUF_ALLOC / 4;
/// The largest payload of one packet, both ways.
pub const MAX_PKT_DATA: usize = 64 * 1024;
/// How long the guest has to answer a REQUEST, or to send its RST after we shut down.
pub const CLOSE_TIMEOUT: Duration = Duration::from_secs(2);
/// At most this many connections (established or pending) at once.
pub const MAX_CONNECTIONS: usize = 1024;
/// At most this many control packets wait for guest receive buffers; past it, new
/// connections are refused and further control packets dropped (counted), so a guest
/// that never reads cannot grow memory.
pub const MAX_PENDING_RX: usize = 4096;
/// The longest `CONNECT <port>\n` line we read.
const MAX_CONNECT_LINE: usize = 32;
/// Host ports of host-initiated connections start here.
const FIRST_LOCAL_PORT: u32 = 1 << 30;

pub(super) const TOKEN_RX: u64 = 0;
pub(super) const TOKEN_TX: u64 = 1;
pub(super) const TOKEN_EVENT: u64 = 2;
const TOKEN_LISTENER: u64 = 3;
const TOKEN_TIMER: u64 = 4;
const FIRST_STREAM_TOKEN: u64 = 16;

/// (host port, guest port).
type Key = (u32, u32);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Host-initiated: REQUEST sent, waiting for the guest's RESPONSE.
    LocalInit,
    Established,
    /// The host stream ended: SHUTDOWN sent, waiting for the guest's RST.
    LocalClosed,
}

struct Conn {
    stream: UnixStream,
    token: u64,
    state: State,
    /// The stream may have data (edge seen, no `WouldBlock` since).
    readable: bool,
    /// Guest's receive space and what it has consumed of ours.
    peer_buf_alloc: u32,
    peer_fwd_cnt: Wrapping<u32>,
    /// Bytes sent to the guest.
    rx_cnt: Wrapping<u32>,
    /// Bytes from the guest written to the host stream.
    fwd_cnt: Wrapping<u32>,
    last_fwd_cnt_sent: Wrapping<u32>,
    /// Guest data not yet taken by the host stream (at most `CONN_BUF_ALLOC`).
    tx_buf: VecDeque<u8>,
    credit_requested: bool,
    /// The guest will receive no more / send no more.
    guest_shut_rcv: bool,
    guest_shut_send: bool,
    /// Close (and RST the guest) once `tx_buf` is flushed.
    close_after_flush: bool,
    deadline: Option<Instant>,
}

impl Conn {
    fn new(stream: UnixStream, token: u64, state: State) -> Self {
        Conn {
            stream,
            token,
            state,
            readable: false,
            peer_buf_alloc: 0,
            peer_fwd_cnt: Wrapping(0),
            rx_cnt: Wrapping(0),
            fwd_cnt: Wrapping(0),
            last_fwd_cnt_sent: Wrapping(0),
            tx_buf: VecDeque::new(),
            credit_requested: false,
            guest_shut_rcv: false,
            guest_shut_send: false,
            close_after_flush: false,
            deadline: None,
        }
    }

    /// Bytes the guest can still take.
    fn peer_credit(&self) -> u32 {
        let in_flight = (self.rx_cnt - self.peer_fwd_cnt).0;
        self.peer_buf_alloc.saturating_sub(in_flight)
    }

    fn wants_to_send_data(&self) -> bool {
        self.state == State::Established && self.readable && !self.guest_shut_rcv
    }

    /// Writes as much of `tx_buf` to the stream as it takes.
    fn flush(&mut self) -> io::Result<()> {
        while !self.tx_buf.is_empty() {
            let (front, _) = self.tx_buf.as_slices();
            match self.stream.write(front) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => {
                    self.tx_buf.drain(..n);
                    self.fwd_cnt += Wrapping(n as u32);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}

/// A host stream that has not finished its `CONNECT <port>\n` line.
struct PendingHost {
    stream: UnixStream,
    line: Vec<u8>,
}

/// A packet waiting for a guest receive buffer.
#[derive(Debug, Clone, Copy)]
enum RxItem {
    /// A control packet of a live connection (credit fields filled in when sent).
    Ctrl { key: Key, op: u16, flags: u32 },
    /// A packet not tied to a live connection (RST of an unknown or killed one).
    Raw(Header),
}

/// What the muxer keeps between activations (pause/resume keeps connections).
pub(super) struct MuxerState {
    pub listener: UnixListener,
    pub uds_path: PathBuf,
    conns: HashMap<Key, Conn>,
    pending_host: HashMap<u64, PendingHost>,
    tokens: HashMap<u64, Key>,
    rx_items: VecDeque<RxItem>,
    next_token: u64,
    next_local_port: u32,
    /// A TRANSPORT_RESET event waits for an event-queue buffer.
    pub reset_pending: bool,
}

impl MuxerState {
    pub fn new(listener: UnixListener, uds_path: PathBuf) -> Self {
        MuxerState {
            listener,
            uds_path,
            conns: HashMap::new(),
            pending_host: HashMap::new(),
            tokens: HashMap::new(),
            rx_items: VecDeque::new(),
            next_token: FIRST_STREAM_TOKEN,
            next_local_port: FIRST_LOCAL_PORT,
            reset_pending: false,
        }
    }

    /// Drops every connection (their host streams see EOF).
    pub fn clear_connections(&mut self) {
        self.conns.clear();
        self.pending_host.clear();
        self.tokens.clear();
        self.rx_items.clear();
    }
}

/// The worker-thread side of the device.
pub(super) struct VsockCore {
    pub mem: GuestMemoryMmap,
    pub interrupt: Arc<VirtioInterrupt>,
    pub queues: Vec<Queue>,
    pub queue_events: Vec<EventFd>,
    pub guest_cid: u64,
    pub metrics: Arc<VsockMetrics>,
    pub state: MuxerState,
    pub timer: TimerFd,
    scratch: Vec<u8>,
}

impl VsockCore {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        mem: GuestMemoryMmap,
        interrupt: Arc<VirtioInterrupt>,
        queues: Vec<Queue>,
        queue_events: Vec<EventFd>,
        guest_cid: u64,
        metrics: Arc<VsockMetrics>,
        state: MuxerState,
        timer: TimerFd,
    ) -> Self {
        VsockCore {
            mem,
            interrupt,
            queues,
            queue_events,
            guest_cid,
            metrics,
            state,
            timer,
            scratch: vec![0u8; MAX_PKT_DATA],
        }
    }

    fn header(&self, key: Key, op: u16, flags: u32, len: u32) -> Header {
        let fwd_cnt = self.state.conns.get(&key).map_or(0, |c| c.fwd_cnt.0);
        Header {
            src_cid: HOST_CID,
            dst_cid: self.guest_cid,
            src_port: key.0,
            dst_port: key.1,
            len,
            type_: TYPE_STREAM,
            op,
            flags,
            buf_alloc: CONN_BUF_ALLOC,
            fwd_cnt,
        }
    }

    /// Queues a control packet of a live connection. A credit packet already waiting
    /// is not queued twice, and past `MAX_PENDING_RX` waiting packets nothing is queued
    /// (counted): a guest that sends without reading cannot grow the device's memory.
    fn push_ctrl(&mut self, key: Key, op: u16, flags: u32) {
        if matches!(op, OP_CREDIT_UPDATE | OP_CREDIT_REQUEST)
            && self
                .state
                .rx_items
                .iter()
                .any(|i| matches!(i, RxItem::Ctrl { key: k, op: o, .. } if *k == key && *o == op))
        {
            return;
        }
        if self.state.rx_items.len() >= MAX_PENDING_RX {
            self.metrics.inc(&self.metrics.ctrl_dropped);
            return;
        }
        self.state
            .rx_items
            .push_back(RxItem::Ctrl { key, op, flags });
    }

    fn push_rst(&mut self, key: Key) {
        if self.state.rx_items.len() >= MAX_PENDING_RX {
            self.metrics.inc(&self.metrics.ctrl_dropped);
            return;
        }
        let h = self.header(key, OP_RST, 0, 0);
        self.state.rx_items.push_back(RxItem::Raw(h));
        self.metrics.inc(&self.metrics.rst_sent);
    }

    /// Removes a connection; its host stream is closed. With `rst`, the guest is told.
    fn kill(&mut self, ctl: &WorkerCtl, key: Key, rst: bool) {
        if let Some(conn) = self.state.conns.remove(&key) {
            let _ = ctl.remove(conn.stream.as_raw_fd());
            self.state.tokens.remove(&conn.token);
            self.metrics.inc(&self.metrics.conns_closed);
            tracing::debug!(
                host_port = key.0,
                guest_port = key.1,
                rst,
                "vsock: connection closed"
            );
        }
        if rst {
            self.push_rst(key);
        }
    }

    fn new_token(&mut self) -> u64 {
        let t = self.state.next_token;
        self.state.next_token += 1;
        t
    }

    fn watch_stream(&self, ctl: &WorkerCtl, stream: &UnixStream, token: u64) -> bool {
        let events =
            EventSet::IN | EventSet::OUT | EventSet::READ_HANG_UP | EventSet::EDGE_TRIGGERED;
        match ctl.add(stream.as_raw_fd(), token, events) {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(error = %e, "vsock: cannot watch a host stream");
                false
            }
        }
    }

    fn room_for_more(&self) -> bool {
        self.state.conns.len() + self.state.pending_host.len() < MAX_CONNECTIONS
            && self.state.rx_items.len() < MAX_PENDING_RX
    }

    // ---- event queue, timers, interrupts ----------------------------------------------

    /// Sends VIRTIO_VSOCK_EVENT_TRANSPORT_RESET if one is pending and the guest has a
    /// buffer for it.
    fn process_event_queue(&mut self) {
        if !self.state.reset_pending {
            return;
        }
        let mut used = false;
        while let Some(chain) = self.queues[EVENT_QUEUE].pop_descriptor_chain(&self.mem) {
            used = true;
            match check_chain(chain, &self.mem, Direction::WriteOnly, 4096) {
                Ok(c) if c.writable_len() >= 4 => {
                    // Event id 0: VIRTIO_VSOCK_EVENT_TRANSPORT_RESET.
                    let len = if c.write_at(&self.mem, 0, &0u32.to_le_bytes()).is_ok() {
                        4
                    } else {
                        0
                    };
                    if let Err(e) = self.queues[EVENT_QUEUE].add_used(&self.mem, c.head, len) {
                        tracing::warn!(error = %e, "vsock: cannot update the used ring");
                    }
                    self.state.reset_pending = false;
                    self.metrics.inc(&self.metrics.transport_resets);
                    break;
                }
                Ok(c) => {
                    self.metrics.inc(&self.metrics.rx_errors);
                    return_unused(&mut self.queues[EVENT_QUEUE], &self.mem, c.head);
                }
                Err((head, _)) => {
                    self.metrics.inc(&self.metrics.rx_errors);
                    return_unused(&mut self.queues[EVENT_QUEUE], &self.mem, head);
                }
            }
        }
        if used {
            self.notify(EVENT_QUEUE);
        }
    }

    fn expire(&mut self, ctl: &WorkerCtl) {
        let now = Instant::now();
        let expired: Vec<Key> = self
            .state
            .conns
            .iter()
            .filter(|(_, c)| c.deadline.is_some_and(|d| d <= now))
            .map(|(k, _)| *k)
            .collect();
        for key in expired {
            tracing::debug!(
                host_port = key.0,
                guest_port = key.1,
                "vsock: the guest did not answer in time"
            );
            self.kill(ctl, key, true);
        }
        self.arm_timer();
    }

    fn arm_timer(&mut self) {
        let next = self.state.conns.values().filter_map(|c| c.deadline).min();
        let result = match next {
            Some(d) => {
                let left = d
                    .saturating_duration_since(Instant::now())
                    .max(Duration::from_millis(1));
                self.timer.reset(left, None)
            }
            None => self.timer.clear(),
        };
        if let Err(e) = result {
            tracing::warn!(error = %e, "vsock: cannot arm the connection timer");
        }
    }

    fn notify(&mut self, queue: usize) {
        let needed = self.queues[queue]
            .needs_notification(&self.mem)
            .unwrap_or(true);
        if needed {
            self.metrics.inc(&self.metrics.interrupts);
            if let Err(e) = self.interrupt.signal_used_queue() {
                tracing::warn!(error = %e, "vsock: cannot raise the interrupt");
            }
        }
    }

    fn run_all(&mut self, ctl: &WorkerCtl) {
        self.process_tx(ctl);
        self.process_rx(ctl);
    }
}

impl WorkerHandler for VsockCore {
    fn on_start(&mut self, ctl: &WorkerCtl) {
        if let Err(e) = ctl.add(
            self.state.listener.as_raw_fd(),
            TOKEN_LISTENER,
            EventSet::IN,
        ) {
            tracing::error!(error = %e, "vsock: cannot watch the host socket");
        }
        if let Err(e) = ctl.add(self.timer.as_raw_fd(), TOKEN_TIMER, EventSet::IN) {
            tracing::error!(error = %e, "vsock: cannot watch the connection timer");
        }
        // Streams kept across a pause are watched again (the epoll is new).
        let tokens: Vec<(u64, i32)> = self
            .state
            .conns
            .values()
            .map(|c| (c.token, c.stream.as_raw_fd()))
            .chain(
                self.state
                    .pending_host
                    .iter()
                    .map(|(t, p)| (*t, p.stream.as_raw_fd())),
            )
            .collect();
        let events =
            EventSet::IN | EventSet::OUT | EventSet::READ_HANG_UP | EventSet::EDGE_TRIGGERED;
        for (token, fd) in tokens {
            let _ = ctl.add(fd, token, events);
        }
        for conn in self.state.conns.values_mut() {
            conn.readable = true;
        }
        self.process_event_queue();
        self.accept_host_connections(ctl);
        self.arm_timer();
        self.run_all(ctl);
    }

    fn handle_event(&mut self, ctl: &WorkerCtl, token: u64, events: EventSet) {
        match token {
            TOKEN_RX => {
                let _ = self.queue_events[RX_QUEUE].read();
            }
            TOKEN_TX => {
                let _ = self.queue_events[TX_QUEUE].read();
            }
            TOKEN_EVENT => {
                let _ = self.queue_events[EVENT_QUEUE].read();
                self.process_event_queue();
            }
            TOKEN_LISTENER => self.accept_host_connections(ctl),
            TOKEN_TIMER => {
                let _ = self.timer.wait();
                self.expire(ctl);
            }
            t => self.on_stream_event(ctl, t, events),
        }
        self.run_all(ctl);
    }
}
