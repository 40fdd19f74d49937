//! What the guest receives: control packets first, then data read from host streams,
//! within each connection's credit, into the guest's receive buffers.

use std::io::{self, Read};
use std::num::Wrapping;
use std::time::Instant;

use virtio_queue::{Queue, QueueOwnedT, QueueT};

use super::{CLOSE_TIMEOUT, Key, MAX_PKT_DATA, RxItem, State, VsockCore};
use crate::devices::virtio::net::chain::{CheckedChain, Direction, check_chain, return_unused};
use crate::devices::virtio::vsock::RX_QUEUE;
use crate::devices::virtio::vsock::packet::*;
use crate::devices::virtio::worker::WorkerCtl;
use crate::memory::GuestMemoryMmap;

impl VsockCore {
    /// Fills guest receive buffers: control packets first, then data from readable
    /// streams, round-robin, within each connection's credit.
    pub(super) fn process_rx(&mut self, ctl: &WorkerCtl) {
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
            deliver(&mut self.queues[RX_QUEUE], &self.mem, &checked, hdr, data);
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
                let queue = &mut self.queues[RX_QUEUE];
                deliver(queue, &self.mem, &checked, &hdr, &self.scratch[..n]);
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
}

/// Writes one packet (`hdr`, then `data`) into a checked receive chain and puts the chain
/// on the used ring (with length 0 when guest memory refused the copy).
fn deliver(
    queue: &mut Queue,
    mem: &GuestMemoryMmap,
    chain: &CheckedChain,
    hdr: &Header,
    data: &[u8],
) {
    let ok = chain.write_at(mem, 0, &hdr.to_bytes()).is_ok()
        && chain.write_at(mem, HDR_LEN, data).is_ok();
    let len = if ok { (HDR_LEN + data.len()) as u32 } else { 0 };
    if let Err(e) = queue.add_used(mem, chain.head, len) {
        tracing::warn!(error = %e, "vsock: cannot update the used ring");
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
