//! The host side of the muxer: connections from host processes on the unix socket (their
//! `CONNECT <port>` line), and writing guest data out to host streams.

use std::io::{self, Read};
use std::os::fd::AsRawFd;
use std::time::Instant;

use vmm_sys_util::epoll::EventSet;

use super::{
    CLOSE_TIMEOUT, CREDIT_UPDATE_THRESHOLD, Conn, FIRST_LOCAL_PORT, Key, MAX_CONNECT_LINE,
    PendingHost, State, VsockCore,
};
use crate::devices::virtio::vsock::packet::{OP_CREDIT_UPDATE, OP_REQUEST};
use crate::devices::virtio::worker::WorkerCtl;

impl VsockCore {
    pub(super) fn accept_host_connections(&mut self, ctl: &WorkerCtl) {
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

    pub(super) fn on_stream_event(&mut self, ctl: &WorkerCtl, token: u64, events: EventSet) {
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

    pub(super) fn flush_conn(&mut self, ctl: &WorkerCtl, key: Key) {
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
}
