//! What the guest transmits: packets on the transmit queue, checked and dispatched to
//! their connection (or answered with RST), and connections the guest opens to host ports.

use std::io::Write;
use std::num::Wrapping;
use std::os::unix::net::UnixStream;

use virtio_queue::QueueT;

use super::{CONN_BUF_ALLOC, Conn, Key, MAX_PKT_DATA, State, VsockCore};
use crate::devices::virtio::net::chain::{Direction, check_chain, return_unused};
use crate::devices::virtio::vsock::TX_QUEUE;
use crate::devices::virtio::vsock::packet::*;
use crate::devices::virtio::worker::WorkerCtl;

impl VsockCore {
    pub(super) fn process_tx(&mut self, ctl: &WorkerCtl) {
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
}
