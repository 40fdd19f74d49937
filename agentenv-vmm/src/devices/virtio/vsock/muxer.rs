//! The host side of virtio-vsock: guest stream connections relayed to unix sockets.
//!
//! Runs on the device's worker thread. It owns the three queues, the listening socket at
//! `uds_path`, the host streams still sending their `CONNECT <port>` line, and the
//! established connections, keyed by (host port, guest port).

use std::collections::{HashMap, VecDeque};
use std::io::{self, Read, Write};
use std::num::Wrapping;
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use virtio_queue::{Queue, QueueOwnedT, QueueT};
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

    // ---- host side -------------------------------------------------------------------

    fn accept_host_connections(&mut self, ctl: &WorkerCtl) {
        loop {
            match self.state.listener.accept() {
                Ok((stream, _)) => {
                    if !self.room_for_more() {
                        tracing::warn!("vsock: too many connections, a host connection is refused");
                        continue;
                    }
                    if stream.set_nonblocking(true).is_err() {
                        continue;
                    }
                    let token = self.new_token();
                    if self.watch_stream(ctl, &stream, token) {
                        self.state.pending_host.insert(
                            token,
                            PendingHost {
                                stream,
                                line: Vec::new(),
                            },
                        );
                        // Bytes may already be there; the edge came before we watched.
                        self.read_connect_line(ctl, token);
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    tracing::warn!(error = %e, "vsock: accept on the host socket failed");
                    return;
                }
            }
        }
    }

    /// Reads the `CONNECT <port>\n` line one byte at a time (so no byte of the stream
    /// that follows it is taken early) and starts the connection when it is complete.
    fn read_connect_line(&mut self, ctl: &WorkerCtl, token: u64) {
        let Some(pending) = self.state.pending_host.get_mut(&token) else {
            return;
        };
        let mut byte = [0u8; 1];
        let outcome = loop {
            match pending.stream.read(&mut byte) {
                Ok(0) => break Err("the host closed before finishing its CONNECT line"),
                Ok(_) if byte[0] == b'\n' => break Ok(()),
                Ok(_) if pending.line.len() >= MAX_CONNECT_LINE => {
                    break Err("CONNECT line too long");
                }
                Ok(_) => pending.line.push(byte[0]),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => break Err("reading the CONNECT line failed"),
            }
        };
        let Some(pending) = self.state.pending_host.remove(&token) else {
            return;
        };
        let port = outcome.and_then(|()| {
            std::str::from_utf8(&pending.line)
                .ok()
                .and_then(|l| l.trim_end_matches('\r').strip_prefix("CONNECT "))
                .and_then(|p| p.trim().parse::<u32>().ok())
                .ok_or("expected `CONNECT <port>`")
        });
        let guest_port = match port {
            Ok(p) => p,
            Err(why) => {
                tracing::debug!(why, "vsock: host connection refused");
                let _ = ctl.remove(pending.stream.as_raw_fd());
                return;
            }
        };
        let local_port = self.allocate_local_port(guest_port);
        let key = (local_port, guest_port);
        let mut conn = Conn::new(pending.stream, token, State::LocalInit);
        conn.deadline = Some(Instant::now() + CLOSE_TIMEOUT);
        self.state.conns.insert(key, conn);
        self.state.tokens.insert(token, key);
        self.metrics.inc(&self.metrics.conns_opened);
        self.push_ctrl(key, OP_REQUEST, 0);
        self.arm_timer();
    }

    fn allocate_local_port(&mut self, guest_port: u32) -> u32 {
        loop {
            let p = self.state.next_local_port;
            self.state.next_local_port = if p == u32::MAX {
                FIRST_LOCAL_PORT
            } else {
                p + 1
            };
            if !self.state.conns.contains_key(&(p, guest_port)) {
                return p;
            }
        }
    }

    fn on_stream_event(&mut self, ctl: &WorkerCtl, token: u64, events: EventSet) {
        if self.state.pending_host.contains_key(&token) {
            self.read_connect_line(ctl, token);
            return;
        }
        let Some(&key) = self.state.tokens.get(&token) else {
            return;
        };
        if events.intersects(EventSet::IN | EventSet::READ_HANG_UP | EventSet::HANG_UP) {
            if let Some(conn) = self.state.conns.get_mut(&key) {
                conn.readable = true;
            }
        }
        if events.contains(EventSet::OUT) {
            self.flush_conn(ctl, key);
        }
    }

    fn flush_conn(&mut self, ctl: &WorkerCtl, key: Key) {
        let Some(conn) = self.state.conns.get_mut(&key) else {
            return;
        };
        if let Err(e) = conn.flush() {
            tracing::debug!(error = %e, "vsock: writing to a host stream failed");
            self.kill(ctl, key, true);
            return;
        }
        if conn.tx_buf.is_empty() {
            if conn.close_after_flush {
                self.kill(ctl, key, true);
                return;
            }
            if conn.guest_shut_send {
                let _ = conn.stream.shutdown(std::net::Shutdown::Write);
            }
        }
        if (conn.fwd_cnt - conn.last_fwd_cnt_sent).0 >= CREDIT_UPDATE_THRESHOLD {
            conn.last_fwd_cnt_sent = conn.fwd_cnt;
            self.push_ctrl(key, OP_CREDIT_UPDATE, 0);
        }
    }

    // ---- guest transmit ------------------------------------------------------------------

    fn process_tx(&mut self, ctl: &WorkerCtl) {
        let mut used = false;
        while let Some(chain) = self.queues[TX_QUEUE].pop_descriptor_chain(&self.mem) {
            used = true;
            let checked = match check_chain(
                chain,
                &self.mem,
                Direction::Any,
                (HDR_LEN + MAX_PKT_DATA) as u64,
            ) {
                Ok(c) => c,
                Err((head, e)) => {
                    tracing::warn!(error = %e, head, "vsock: malformed transmit chain");
                    self.metrics.inc(&self.metrics.tx_errors);
                    return_unused(&mut self.queues[TX_QUEUE], &self.mem, head);
                    continue;
                }
            };
            let head = checked.head;
            let mut hdr_bytes = [0u8; HDR_LEN];
            let got = checked
                .read_at(&self.mem, 0, &mut hdr_bytes)
                .unwrap_or_default();
            if got < HDR_LEN {
                tracing::warn!(
                    len = got,
                    "vsock: transmit chain shorter than the packet header"
                );
                self.metrics.inc(&self.metrics.tx_errors);
                return_unused(&mut self.queues[TX_QUEUE], &self.mem, head);
                continue;
            }
            let hdr = Header::parse(&hdr_bytes);
            let data_len = (hdr.len as usize).min(MAX_PKT_DATA);
            let avail = checked.readable_len() - HDR_LEN;
            let valid = hdr.type_ == TYPE_STREAM
                && hdr.src_cid == self.guest_cid
                && hdr.dst_cid == HOST_CID
                && (hdr.len as usize) <= MAX_PKT_DATA
                && (hdr.len as usize) <= avail
                && (OP_REQUEST..=OP_CREDIT_REQUEST).contains(&hdr.op);
            if !valid {
                tracing::debug!(
                    ?hdr,
                    "vsock: invalid packet from the guest, answered with RST"
                );
                self.metrics.inc(&self.metrics.tx_errors);
                if hdr.op != OP_RST {
                    self.push_rst((hdr.dst_port, hdr.src_port));
                }
                return_unused(&mut self.queues[TX_QUEUE], &self.mem, head);
                continue;
            }
            self.metrics.inc(&self.metrics.tx_packets);
            let mut data = std::mem::take(&mut self.scratch);
            let n = if hdr.op == OP_RW && data_len > 0 {
                checked
                    .read_at(&self.mem, HDR_LEN, &mut data[..data_len])
                    .unwrap_or(0)
            } else {
                0
            };
            self.handle_guest_packet(ctl, &hdr, &data[..n]);
            self.scratch = data;
            return_unused(&mut self.queues[TX_QUEUE], &self.mem, head);
        }
        if used {
            self.notify(TX_QUEUE);
        }
    }

    fn handle_guest_packet(&mut self, ctl: &WorkerCtl, hdr: &Header, data: &[u8]) {
        let key = (hdr.dst_port, hdr.src_port);
        if hdr.op == OP_REQUEST {
            self.guest_connect(ctl, key, hdr);
            return;
        }
        let Some(conn) = self.state.conns.get_mut(&key) else {
            if hdr.op != OP_RST {
                self.push_rst(key);
            }
            return;
        };
        conn.peer_buf_alloc = hdr.buf_alloc;
        conn.peer_fwd_cnt = Wrapping(hdr.fwd_cnt);
        if conn.peer_credit() > 0 {
            conn.credit_requested = false;
        }
        enum Next {
            Nothing,
            Kill(bool),
            Flush,
            CreditUpdate,
        }
        let next = match (hdr.op, conn.state) {
            (OP_RST, _) => Next::Kill(false),
            (OP_RESPONSE, State::LocalInit) => {
                conn.state = State::Established;
                conn.deadline = None;
                // The stream may already hold bytes the host sent after its line.
                conn.readable = true;
                let reply = format!("OK {}\n", key.0);
                if conn.stream.write_all(reply.as_bytes()).is_err() {
                    Next::Kill(true)
                } else {
                    Next::Nothing
                }
            }
            (OP_RW, State::Established) if !conn.guest_shut_send => {
                if conn.tx_buf.len() + data.len() > CONN_BUF_ALLOC as usize {
                    tracing::debug!("vsock: the guest overran its credit, connection reset");
                    Next::Kill(true)
                } else {
                    conn.tx_buf.extend(data);
                    self.metrics.add(&self.metrics.tx_bytes, data.len() as u64);
                    Next::Flush
                }
            }
            (OP_CREDIT_UPDATE, _) => Next::Nothing,
            (OP_CREDIT_REQUEST, State::Established | State::LocalClosed) => {
                conn.last_fwd_cnt_sent = conn.fwd_cnt;
                Next::CreditUpdate
            }
            (OP_SHUTDOWN, _) => {
                conn.guest_shut_rcv |= hdr.flags & SHUTDOWN_RCV != 0;
                conn.guest_shut_send |= hdr.flags & SHUTDOWN_SEND != 0;
                if conn.guest_shut_rcv && conn.guest_shut_send {
                    // The guest is done both ways: deliver what it sent, then close and
                    // confirm with RST.
                    conn.close_after_flush = true;
                }
                Next::Flush
            }
            _ => {
                tracing::debug!(op = hdr.op, "vsock: packet out of place, connection reset");
                Next::Kill(true)
            }
        };
        match next {
            Next::Nothing => {}
            Next::Kill(rst) => self.kill(ctl, key, rst),
            Next::Flush => self.flush_conn(ctl, key),
            Next::CreditUpdate => self.push_ctrl(key, OP_CREDIT_UPDATE, 0),
        }
    }

    fn guest_connect(&mut self, ctl: &WorkerCtl, key: Key, hdr: &Header) {
        if self.state.conns.contains_key(&key) || !self.room_for_more() {
            self.push_rst(key);
            return;
        }
        let mut path = self.state.uds_path.clone().into_os_string();
        path.push(format!("_{}", key.0));
        let stream = match UnixStream::connect(&path) {
            Ok(s) => s,
            Err(e) => {
                tracing::debug!(path = ?path, error = %e, "vsock: nobody listens for the guest's connection");
                self.push_rst(key);
                return;
            }
        };
        if stream.set_nonblocking(true).is_err() {
            self.push_rst(key);
            return;
        }
        let token = self.new_token();
        if !self.watch_stream(ctl, &stream, token) {
            self.push_rst(key);
            return;
        }
        let mut conn = Conn::new(stream, token, State::Established);
        conn.peer_buf_alloc = hdr.buf_alloc;
        conn.peer_fwd_cnt = Wrapping(hdr.fwd_cnt);
        self.state.conns.insert(key, conn);
        self.state.tokens.insert(token, key);
        self.metrics.inc(&self.metrics.conns_opened);
        self.push_ctrl(key, OP_RESPONSE, 0);
    }

    // ---- guest receive -------------------------------------------------------------------

    /// Fills guest receive buffers: control packets first, then data from readable
    /// streams, round-robin, within each connection's credit.
    fn process_rx(&mut self, ctl: &WorkerCtl) {
        let mut used = false;
        loop {
            let progressed = if let Some(item) = self.state.rx_items.pop_front() {
                let hdr = match item {
                    RxItem::Raw(h) => Some(h),
                    RxItem::Ctrl { key, op, flags } => self
                        .state
                        .conns
                        .contains_key(&key)
                        .then(|| self.header(key, op, flags, 0)),
                };
                match hdr {
                    None => true,
                    Some(h) => {
                        if self.send_to_guest(&h, &[]) {
                            used = true;
                            true
                        } else {
                            self.state.rx_items.push_front(item);
                            break;
                        }
                    }
                }
            } else {
                match self.send_some_data(ctl) {
                    DataOutcome::Sent => {
                        used = true;
                        true
                    }
                    DataOutcome::Progress => true,
                    DataOutcome::Idle | DataOutcome::NoBuffer => false,
                }
            };
            if !progressed {
                break;
            }
        }
        if used {
            self.notify(RX_QUEUE);
        }
    }

    /// Writes one packet into the next receive chain. False when the guest has none.
    fn send_to_guest(&mut self, hdr: &Header, data: &[u8]) -> bool {
        loop {
            let Some(chain) = self.queues[RX_QUEUE].pop_descriptor_chain(&self.mem) else {
                return false;
            };
            let checked =
                match check_chain(chain, &self.mem, Direction::WriteOnly, u64::from(u32::MAX)) {
                    Ok(c) if c.writable_len() >= HDR_LEN + data.len() => c,
                    Ok(c) => {
                        tracing::warn!(len = c.writable_len(), "vsock: receive buffer too small");
                        self.metrics.inc(&self.metrics.rx_errors);
                        return_unused(&mut self.queues[RX_QUEUE], &self.mem, c.head);
                        continue;
                    }
                    Err((head, e)) => {
                        tracing::warn!(error = %e, head, "vsock: malformed receive chain");
                        self.metrics.inc(&self.metrics.rx_errors);
                        return_unused(&mut self.queues[RX_QUEUE], &self.mem, head);
                        continue;
                    }
                };
            let ok = checked.write_at(&self.mem, 0, &hdr.to_bytes()).is_ok()
                && checked.write_at(&self.mem, HDR_LEN, data).is_ok();
            let len = if ok { (HDR_LEN + data.len()) as u32 } else { 0 };
            if let Err(e) = self.queues[RX_QUEUE].add_used(&self.mem, checked.head, len) {
                tracing::warn!(error = %e, "vsock: cannot update the used ring");
            }
            self.metrics.inc(&self.metrics.rx_packets);
            return true;
        }
    }

    fn send_some_data(&mut self, ctl: &WorkerCtl) -> DataOutcome {
        let candidates: Vec<Key> = self
            .state
            .conns
            .iter()
            .filter(|(_, c)| c.wants_to_send_data())
            .map(|(k, _)| *k)
            .collect();
        let mut progress = false;
        for key in candidates {
            match self.send_conn_data(ctl, key) {
                DataOutcome::Sent => return DataOutcome::Sent,
                DataOutcome::NoBuffer => return DataOutcome::NoBuffer,
                DataOutcome::Progress => progress = true,
                DataOutcome::Idle => {}
            }
        }
        if progress {
            DataOutcome::Progress
        } else {
            DataOutcome::Idle
        }
    }

    /// Moves one packet of data from the host stream of `key` to the guest.
    fn send_conn_data(&mut self, ctl: &WorkerCtl, key: Key) -> DataOutcome {
        let Some(conn) = self.state.conns.get(&key) else {
            return DataOutcome::Idle;
        };
        let credit = conn.peer_credit() as usize;
        if credit == 0 {
            if conn.credit_requested {
                return DataOutcome::Idle;
            }
            if let Some(c) = self.state.conns.get_mut(&key) {
                c.credit_requested = true;
            }
            self.push_ctrl(key, OP_CREDIT_REQUEST, 0);
            return DataOutcome::Progress;
        }
        // Take a buffer first, so no byte is read from the host that has nowhere to go.
        let Some(chain) = self.queues[RX_QUEUE].pop_descriptor_chain(&self.mem) else {
            return DataOutcome::NoBuffer;
        };
        let checked = match check_chain(chain, &self.mem, Direction::WriteOnly, u64::from(u32::MAX))
        {
            Ok(c) if c.writable_len() > HDR_LEN => c,
            Ok(c) => {
                self.metrics.inc(&self.metrics.rx_errors);
                return_unused(&mut self.queues[RX_QUEUE], &self.mem, c.head);
                return DataOutcome::Progress;
            }
            Err((head, e)) => {
                tracing::warn!(error = %e, head, "vsock: malformed receive chain");
                self.metrics.inc(&self.metrics.rx_errors);
                return_unused(&mut self.queues[RX_QUEUE], &self.mem, head);
                return DataOutcome::Progress;
            }
        };
        let max = (checked.writable_len() - HDR_LEN)
            .min(credit)
            .min(MAX_PKT_DATA);
        let Some(conn) = self.state.conns.get_mut(&key) else {
            self.queues[RX_QUEUE].go_to_previous_position();
            return DataOutcome::Idle;
        };
        let read = loop {
            match conn.stream.read(&mut self.scratch[..max]) {
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                r => break r,
            }
        };
        match read {
            Ok(0) => {
                // The host closed its side: tell the guest, give it time to RST.
                self.queues[RX_QUEUE].go_to_previous_position();
                conn.readable = false;
                conn.state = State::LocalClosed;
                conn.deadline = Some(Instant::now() + CLOSE_TIMEOUT);
                self.push_ctrl(key, OP_SHUTDOWN, SHUTDOWN_RCV | SHUTDOWN_SEND);
                self.arm_timer();
                DataOutcome::Progress
            }
            Ok(n) => {
                conn.rx_cnt += Wrapping(n as u32);
                conn.last_fwd_cnt_sent = conn.fwd_cnt;
                let hdr = self.header(key, OP_RW, 0, n as u32);
                let ok = checked.write_at(&self.mem, 0, &hdr.to_bytes()).is_ok()
                    && checked
                        .write_at(&self.mem, HDR_LEN, &self.scratch[..n])
                        .is_ok();
                let len = if ok { (HDR_LEN + n) as u32 } else { 0 };
                if let Err(e) = self.queues[RX_QUEUE].add_used(&self.mem, checked.head, len) {
                    tracing::warn!(error = %e, "vsock: cannot update the used ring");
                }
                self.metrics.inc(&self.metrics.rx_packets);
                self.metrics.add(&self.metrics.rx_bytes, n as u64);
                DataOutcome::Sent
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                self.queues[RX_QUEUE].go_to_previous_position();
                conn.readable = false;
                DataOutcome::Progress
            }
            Err(e) => {
                tracing::debug!(error = %e, "vsock: reading a host stream failed");
                self.queues[RX_QUEUE].go_to_previous_position();
                self.kill(ctl, key, true);
                DataOutcome::Progress
            }
        }
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

enum DataOutcome {
    /// A data packet went to the guest.
    Sent,
    /// Something changed (a stream drained, a credit request queued, an EOF seen).
    Progress,
    /// No connection has data to send.
    Idle,
    /// Data is waiting but the guest has no receive buffer.
    NoBuffer,
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
