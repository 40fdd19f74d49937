//! virtio-vsock driven from a mock guest (virtio-queue's driver mock) against real unix
//! sockets.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};

use super::packet::*;
use super::*;
use crate::devices::virtio::VirtioDevice;
use crate::devices::virtio::net::test_util::{
    Driver, Irq, VRING_DESC_F_NEXT, WAIT, activate_ctx, guest_memory,
};
use crate::devices::virtio::persist::SavedState;
use crate::memory::GuestMemoryMmap;

const CID: u64 = 3;
const MEM_SIZE: usize = 0x200_0000;
const RX_BUF: u32 = 4096 + HDR_LEN as u32;

struct Guest<'m> {
    rx: Driver<'m>,
    tx: Driver<'m>,
    ev: Driver<'m>,
    irq: Irq,
    rx_bufs: HashMap<u16, u64>,
    rx_seen: u16,
}

impl<'m> Guest<'m> {
    fn new(mem: &'m GuestMemoryMmap) -> Self {
        Guest {
            rx: Driver::new(mem, 0, QUEUE_SIZE, 0x10_0000),
            tx: Driver::new(mem, 0x1_0000, QUEUE_SIZE, 0x80_0000),
            ev: Driver::new(mem, 0x2_0000, QUEUE_SIZE, 0x1f0_0000),
            irq: Irq::new(),
            rx_bufs: HashMap::new(),
            rx_seen: 0,
        }
    }

    fn activate(&self, mem: &GuestMemoryMmap, dev: &mut Vsock) {
        let ctx = activate_ctx(mem, &self.irq, &[&self.rx, &self.tx, &self.ev]);
        dev.activate(ctx).unwrap();
    }

    fn post_rx(&mut self, n: usize) {
        for _ in 0..n {
            let (head, addr) = self.rx.add_writable(RX_BUF);
            self.rx_bufs.insert(head, addr);
        }
        self.rx.kick();
    }

    fn send(&mut self, hdr: Header, data: &[u8]) -> u16 {
        let h = self.tx.alloc(HDR_LEN as u32);
        self.tx.write(h, &hdr.to_bytes());
        let head = if data.is_empty() {
            self.tx.add_chain(&[(h, HDR_LEN as u32, false)])
        } else {
            let d = self.tx.alloc(data.len() as u32);
            self.tx.write(d, data);
            self.tx
                .add_chain(&[(h, HDR_LEN as u32, false), (d, data.len() as u32, false)])
        };
        self.tx.kick();
        head
    }

    fn packet(&self, op: u16, src_port: u32, dst_port: u32, len: u32) -> Header {
        Header {
            src_cid: CID,
            dst_cid: HOST_CID,
            src_port,
            dst_port,
            len,
            type_: TYPE_STREAM,
            op,
            flags: 0,
            buf_alloc: 1 << 20,
            fwd_cnt: 0,
        }
    }

    /// The next packet the device put in the receive queue (waits for it).
    fn recv(&mut self) -> (Header, Vec<u8>) {
        let want = self.rx_seen.wrapping_add(1);
        let rx = &self.rx;
        self.irq.wait_for("a packet for the guest", || {
            rx.used_idx().wrapping_sub(want) < 0x8000
        });
        let (head, len) = self.rx.used(self.rx_seen);
        self.rx_seen = want;
        let addr = self.rx_bufs[&head];
        assert!(len as usize >= HDR_LEN, "used length {len}");
        let bytes = self.rx.read(addr, len as usize);
        let hdr = Header::parse(bytes[..HDR_LEN].try_into().unwrap());
        assert_eq!(hdr.len as usize, len as usize - HDR_LEN, "{hdr:?}");
        // Give the buffer back, as a driver does.
        self.rx_bufs.remove(&head);
        let head = self.rx.add_chain(&[(addr, RX_BUF, true)]);
        self.rx_bufs.insert(head, addr);
        self.rx.kick();
        (hdr, bytes[HDR_LEN..].to_vec())
    }

    /// Receives until a packet that is not a credit update.
    fn recv_skip_credit(&mut self) -> (Header, Vec<u8>) {
        loop {
            let p = self.recv();
            if p.0.op != OP_CREDIT_UPDATE {
                return p;
            }
        }
    }

    fn wait_tx_used(&self, n: u16) {
        self.irq.wait_for(&format!("{n} used transmit chains"), || {
            self.tx.used_idx() >= n
        });
    }
}

fn tmp_socket(dir: &tempfile::TempDir) -> PathBuf {
    dir.path().join("vsock.sock")
}

fn host_connect(path: &Path, port: u32) -> UnixStream {
    let mut s = UnixStream::connect(path).unwrap();
    s.set_read_timeout(Some(WAIT)).unwrap();
    s.write_all(format!("CONNECT {port}\n").as_bytes()).unwrap();
    s
}

fn read_line(s: &mut UnixStream) -> String {
    let mut line = Vec::new();
    let mut b = [0u8; 1];
    while b[0] != b'\n' {
        assert_eq!(
            s.read(&mut b).unwrap(),
            1,
            "stream ended before a full line"
        );
        line.push(b[0]);
    }
    String::from_utf8(line).unwrap()
}

fn read_exact(s: &mut UnixStream, n: usize) -> Vec<u8> {
    let mut buf = vec![0u8; n];
    s.read_exact(&mut buf).unwrap();
    buf
}

fn accept_within(listener: &UnixListener) -> UnixStream {
    let mut pfd = libc::pollfd {
        fd: listener.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: `pfd` is one valid pollfd that lives across the call.
    let n = unsafe { libc::poll(&mut pfd, 1, WAIT.as_millis() as i32) };
    assert_eq!(n, 1, "no connection from the device within {WAIT:?}");
    let (s, _) = listener.accept().unwrap();
    s.set_read_timeout(Some(WAIT)).unwrap();
    s
}

/// Establishes a host-initiated connection to guest port `port`; returns the host
/// stream and the device's host port.
fn host_initiated(g: &mut Guest<'_>, path: &Path, port: u32, guest_buf: u32) -> (UnixStream, u32) {
    let mut host = host_connect(path, port);
    let (req, _) = g.recv();
    assert_eq!(req.op, OP_REQUEST);
    assert_eq!((req.src_cid, req.dst_cid), (HOST_CID, CID));
    assert_eq!(req.dst_port, port);
    assert!(req.src_port >= 1 << 30, "host port {}", req.src_port);
    assert_eq!(req.buf_alloc, CONN_BUF_ALLOC);
    let mut resp = g.packet(OP_RESPONSE, port, req.src_port, 0);
    resp.buf_alloc = guest_buf;
    g.send(resp, &[]);
    assert_eq!(read_line(&mut host), format!("OK {}\n", req.src_port));
    (host, req.src_port)
}

fn setup() -> (tempfile::TempDir, GuestMemoryMmap) {
    (tempfile::tempdir().unwrap(), guest_memory(MEM_SIZE))
}

#[test]
fn host_initiated_connection_relays_bytes_both_ways() {
    let (dir, mem) = setup();
    let path = tmp_socket(&dir);
    let mut dev = Vsock::new(CID, &path).unwrap();
    let mut g = Guest::new(&mem);
    g.post_rx(8);
    g.activate(&mem, &mut dev);
    let (mut host, hport) = host_initiated(&mut g, &path, 1234, 1 << 20);

    host.write_all(b"hello guest").unwrap();
    let (h, data) = g.recv_skip_credit();
    assert_eq!((h.op, h.src_port, h.dst_port), (OP_RW, hport, 1234));
    assert_eq!(data, b"hello guest");

    let rw = g.packet(OP_RW, 1234, hport, 10);
    g.send(rw, b"hello host");
    assert_eq!(read_exact(&mut host, 10), b"hello host");
    let m = dev.metrics().snapshot();
    assert_eq!((m.rx_bytes, m.tx_bytes), (11, 10));
    assert_eq!(m.conns_opened, 1);
}

#[test]
fn host_data_stays_within_the_guest_credit_until_it_grows() {
    let (dir, mem) = setup();
    let path = tmp_socket(&dir);
    let mut dev = Vsock::new(CID, &path).unwrap();
    let mut g = Guest::new(&mem);
    g.post_rx(16);
    g.activate(&mem, &mut dev);
    let (mut host, hport) = host_initiated(&mut g, &path, 77, 6000);
    let payload: Vec<u8> = (0..20_000u32).map(|i| (i % 251) as u8).collect();
    host.write_all(&payload).unwrap();

    let mut got = Vec::new();
    // 6000 bytes of credit: data up to it, then a credit request.
    loop {
        let (h, data) = g.recv();
        if h.op == OP_CREDIT_REQUEST {
            break;
        }
        assert_eq!(h.op, OP_RW);
        got.extend(data);
    }
    assert_eq!(got.len(), 6000, "exactly the credit was used");
    // The guest consumed everything: credit for 6000 more.
    let mut upd = g.packet(OP_CREDIT_UPDATE, 77, hport, 0);
    upd.buf_alloc = 6000;
    upd.fwd_cnt = 6000;
    g.send(upd, &[]);
    while got.len() < 12_000 {
        let (h, data) = g.recv();
        if h.op == OP_RW {
            got.extend(data);
        }
    }
    assert_eq!(got.len(), 12_000);
    // Then everything, once the guest opens up its window.
    let mut upd = g.packet(OP_CREDIT_UPDATE, 77, hport, 0);
    upd.buf_alloc = 1 << 20;
    upd.fwd_cnt = 12_000;
    g.send(upd, &[]);
    while got.len() < payload.len() {
        let (h, data) = g.recv();
        if h.op == OP_RW {
            got.extend(data);
        }
    }
    assert_eq!(got, payload);
}

#[test]
fn guest_data_forwarded_to_the_host_earns_credit_updates() {
    let (dir, mem) = setup();
    let path = tmp_socket(&dir);
    let mut dev = Vsock::new(CID, &path).unwrap();
    let mut g = Guest::new(&mem);
    g.post_rx(8);
    g.activate(&mem, &mut dev);
    let (mut host, hport) = host_initiated(&mut g, &path, 9, 1 << 20);
    let chunk: Vec<u8> = (0..16_384u32).map(|i| (i % 253) as u8).collect();
    for _ in 0..5 {
        let rw = g.packet(OP_RW, 9, hport, chunk.len() as u32);
        g.send(rw, &chunk);
    }
    for _ in 0..5 {
        assert_eq!(read_exact(&mut host, chunk.len()), chunk);
    }
    let (h, _) = g.recv();
    assert_eq!(h.op, OP_CREDIT_UPDATE);
    assert_eq!((h.src_port, h.dst_port), (hport, 9));
    assert!(h.fwd_cnt >= 65_536, "fwd_cnt {}", h.fwd_cnt);
    assert_eq!(h.buf_alloc, CONN_BUF_ALLOC);
}

#[test]
fn guest_that_overruns_its_credit_is_reset() {
    let (dir, mem) = setup();
    let path = tmp_socket(&dir);
    let mut dev = Vsock::new(CID, &path).unwrap();
    let mut g = Guest::new(&mem);
    g.post_rx(8);
    g.activate(&mem, &mut dev);
    // The host never reads: the device buffers up to its buf_alloc, no more.
    let (mut host, hport) = host_initiated(&mut g, &path, 10, 1 << 20);
    let chunk = vec![7u8; MAX_PKT_DATA];
    let total = CONN_BUF_ALLOC as usize * 4;
    for _ in 0..total / MAX_PKT_DATA {
        let rw = g.packet(OP_RW, 10, hport, chunk.len() as u32);
        g.send(rw, &chunk);
    }
    let (h, _) = g.recv_skip_credit();
    assert_eq!(h.op, OP_RST);
    // The host sees what fitted, then the end of the stream.
    let mut all = Vec::new();
    host.read_to_end(&mut all).unwrap();
    assert!(all.len() < total, "read {} of {total}", all.len());
    assert!(all.iter().all(|b| *b == 7));
}

#[test]
fn guest_initiated_connection_reaches_the_listener_on_uds_path_port() {
    let (dir, mem) = setup();
    let path = tmp_socket(&dir);
    let listener = UnixListener::bind(format!("{}_5000", path.display())).unwrap();
    let mut dev = Vsock::new(CID, &path).unwrap();
    let mut g = Guest::new(&mem);
    g.post_rx(8);
    g.activate(&mem, &mut dev);
    g.send(g.packet(OP_REQUEST, 1025, 5000, 0), &[]);
    let mut host = accept_within(&listener);
    let (h, _) = g.recv();
    assert_eq!(h.op, OP_RESPONSE);
    assert_eq!((h.src_port, h.dst_port, h.dst_cid), (5000, 1025, CID));

    g.send(g.packet(OP_RW, 1025, 5000, 4), b"ping");
    assert_eq!(read_exact(&mut host, 4), b"ping");
    host.write_all(b"pong").unwrap();
    let (h, data) = g.recv_skip_credit();
    assert_eq!((h.op, data.as_slice()), (OP_RW, &b"pong"[..]));
}

#[test]
fn guest_connection_to_a_port_nobody_listens_on_gets_rst() {
    let (dir, mem) = setup();
    let path = tmp_socket(&dir);
    let mut dev = Vsock::new(CID, &path).unwrap();
    let mut g = Guest::new(&mem);
    g.post_rx(8);
    g.activate(&mem, &mut dev);
    g.send(g.packet(OP_REQUEST, 1026, 6000, 0), &[]);
    let (h, _) = g.recv();
    assert_eq!(h.op, OP_RST);
    assert_eq!((h.src_port, h.dst_port), (6000, 1026));
    assert_eq!(dev.metrics().snapshot().conns_opened, 0);
}

#[test]
fn guest_shutdown_closes_the_host_stream_and_is_confirmed_with_rst() {
    let (dir, mem) = setup();
    let path = tmp_socket(&dir);
    let mut dev = Vsock::new(CID, &path).unwrap();
    let mut g = Guest::new(&mem);
    g.post_rx(8);
    g.activate(&mem, &mut dev);
    let (mut host, hport) = host_initiated(&mut g, &path, 42, 1 << 20);
    g.send(g.packet(OP_RW, 42, hport, 3), b"bye");
    let mut sd = g.packet(OP_SHUTDOWN, 42, hport, 0);
    sd.flags = SHUTDOWN_RCV | SHUTDOWN_SEND;
    g.send(sd, &[]);
    let mut all = Vec::new();
    host.read_to_end(&mut all).unwrap();
    assert_eq!(
        all, b"bye",
        "data sent before SHUTDOWN is delivered, then EOF"
    );
    let (h, _) = g.recv_skip_credit();
    assert_eq!((h.op, h.src_port, h.dst_port), (OP_RST, hport, 42));
    assert_eq!(dev.metrics().snapshot().conns_closed, 1);
}

#[test]
fn host_close_sends_shutdown_and_the_guest_rst_ends_the_connection() {
    let (dir, mem) = setup();
    let path = tmp_socket(&dir);
    let mut dev = Vsock::new(CID, &path).unwrap();
    let mut g = Guest::new(&mem);
    g.post_rx(8);
    g.activate(&mem, &mut dev);
    let (host, hport) = host_initiated(&mut g, &path, 43, 1 << 20);
    drop(host);
    let (h, _) = g.recv_skip_credit();
    assert_eq!(h.op, OP_SHUTDOWN);
    assert_eq!(h.flags, SHUTDOWN_RCV | SHUTDOWN_SEND);
    g.send(g.packet(OP_RST, 43, hport, 0), &[]);
    let m = dev.metrics();
    g.irq
        .wait_for("the connection to close", || m.snapshot().conns_closed == 1);
}

#[test]
fn guest_that_never_answers_a_request_gets_rst_and_the_host_eof() {
    let (dir, mem) = setup();
    let path = tmp_socket(&dir);
    let mut dev = Vsock::new(CID, &path).unwrap();
    let mut g = Guest::new(&mem);
    g.post_rx(8);
    g.activate(&mem, &mut dev);
    let mut host = host_connect(&path, 44);
    let (req, _) = g.recv();
    assert_eq!(req.op, OP_REQUEST);
    // No RESPONSE: after the close timeout the host stream ends without an OK line.
    let mut all = Vec::new();
    host.read_to_end(&mut all).unwrap();
    assert!(all.is_empty());
    let (h, _) = g.recv();
    assert_eq!((h.op, h.src_port, h.dst_port), (OP_RST, req.src_port, 44));
}

#[test]
fn bad_connect_line_closes_the_host_stream_without_bothering_the_guest() {
    let (dir, mem) = setup();
    let path = tmp_socket(&dir);
    let mut dev = Vsock::new(CID, &path).unwrap();
    let mut g = Guest::new(&mem);
    g.post_rx(8);
    g.activate(&mem, &mut dev);
    for line in ["HELLO 12\n", "CONNECT x\n", "CONNECT 99999999999\n"] {
        let mut s = UnixStream::connect(&path).unwrap();
        s.set_read_timeout(Some(WAIT)).unwrap();
        s.write_all(line.as_bytes()).unwrap();
        let mut all = Vec::new();
        s.read_to_end(&mut all).unwrap();
        assert!(all.is_empty(), "{line:?}");
    }
    // A line that never ends is cut off too.
    let mut s = UnixStream::connect(&path).unwrap();
    s.set_read_timeout(Some(WAIT)).unwrap();
    s.write_all(&[b'C'; 100]).unwrap();
    // Closed with unread bytes: the host sees a reset or the end of the stream.
    let mut all = Vec::new();
    match s.read_to_end(&mut all) {
        Ok(_) => assert!(all.is_empty()),
        Err(e) => assert_eq!(e.kind(), std::io::ErrorKind::ConnectionReset, "{e}"),
    }
    assert_eq!(g.rx.used_idx(), 0, "the guest saw nothing");
    // And a good one still works.
    let (_host, _) = host_initiated(&mut g, &path, 45, 1 << 20);
}

#[test]
fn garbage_from_the_guest_gets_rst_and_the_device_serves_the_next_connection() {
    let (dir, mem) = setup();
    let path = tmp_socket(&dir);
    let listener = UnixListener::bind(format!("{}_7000", path.display())).unwrap();
    let mut dev = Vsock::new(CID, &path).unwrap();
    let mut g = Guest::new(&mem);
    g.post_rx(16);
    g.activate(&mem, &mut dev);

    // Unknown op, wrong type, wrong source CID, length past the chain, RW for no
    // connection: each answered with RST to the sender's port.
    let mut bad = Vec::new();
    let mut h = g.packet(99, 2000, 7000, 0);
    bad.push(h);
    h = g.packet(OP_REQUEST, 2001, 7000, 0);
    h.type_ = 2;
    bad.push(h);
    h = g.packet(OP_REQUEST, 2002, 7000, 0);
    h.src_cid = 9;
    bad.push(h);
    h = g.packet(OP_RW, 2003, 7000, 5000);
    bad.push(h);
    h = g.packet(OP_RW, 2004, 7000, 0);
    bad.push(h);
    for h in &bad {
        g.send(*h, &[]);
    }
    for want in 2000..2005 {
        let (h, _) = g.recv();
        assert_eq!((h.op, h.dst_port), (OP_RST, want));
    }
    // A chain shorter than the header, a loop, memory that does not exist.
    let buf = g.tx.alloc(64);
    let n = g.tx.used_idx();
    g.tx.add_raw(&[(200, buf, 10, 0, 0)], 200);
    g.tx.add_raw(
        &[
            (201, buf, 44, VRING_DESC_F_NEXT, 202),
            (202, buf, 44, VRING_DESC_F_NEXT, 201),
        ],
        201,
    );
    g.tx.add_raw(&[(203, 0x4000_0000, 44, 0, 0)], 203);
    g.tx.kick();
    g.wait_tx_used(n + 3);
    for i in 0..3 {
        assert_eq!(g.tx.used(n + i).1, 0);
    }
    // Four invalid packets and three malformed chains; RW for an unknown connection is
    // a valid packet out of place (answered, not counted as an error).
    assert_eq!(dev.metrics().snapshot().tx_errors, 4 + 3);

    // Still serving.
    g.send(g.packet(OP_REQUEST, 2100, 7000, 0), &[]);
    let _host = accept_within(&listener);
    let (h, _) = g.recv();
    assert_eq!((h.op, h.dst_port), (OP_RESPONSE, 2100));
}

#[test]
fn restored_device_tells_the_guest_its_transport_was_reset() {
    let (dir, mem) = setup();
    let path = tmp_socket(&dir);
    let dev = Vsock::new(CID, &path).unwrap();
    let state = dev.save_state().unwrap();
    drop(dev);
    assert!(!path.exists(), "the socket is removed with the device");

    let mut restored = Vsock::new(CID, &path).unwrap();
    assert!(
        Vsock::new(4, dir.path().join("other.sock"))
            .unwrap()
            .restore_state(&state)
            .is_err(),
        "a different guest_cid is refused"
    );
    restored.restore_state(&state).unwrap();
    let mut g = Guest::new(&mem);
    let (head, addr) = g.ev.add_writable(8);
    g.post_rx(4);
    g.activate(&mem, &mut restored);
    g.irq
        .wait_for("the transport reset event", || g.ev.used_idx() == 1);
    assert_eq!(g.ev.used(0), (head, 4));
    assert_eq!(g.ev.read(addr, 4), 0u32.to_le_bytes());
    assert_eq!(restored.metrics().snapshot().transport_resets, 1);
    // Connections work after the reset.
    let (_host, _) = host_initiated(&mut g, &path, 46, 1 << 20);
}

#[test]
fn pause_and_resume_keep_connections() {
    let (dir, mem) = setup();
    let path = tmp_socket(&dir);
    let mut dev = Vsock::new(CID, &path).unwrap();
    let mut g = Guest::new(&mem);
    g.post_rx(8);
    g.activate(&mem, &mut dev);
    let (mut host, hport) = host_initiated(&mut g, &path, 47, 1 << 20);
    let (queues, events) = dev.deactivate().unwrap();
    host.write_all(b"while paused").unwrap();
    let ctx = crate::devices::virtio::ActivateContext {
        mem: mem.clone(),
        interrupt: g.irq.interrupt.clone(),
        queues,
        queue_events: events,
    };
    dev.activate(ctx).unwrap();
    let (h, data) = g.recv_skip_credit();
    assert_eq!((h.op, h.src_port), (OP_RW, hport));
    assert_eq!(data, b"while paused");
}

#[test]
fn config_space_holds_the_guest_cid_and_bad_settings_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let dev = Vsock::new(0x1_2345, dir.path().join("a.sock")).unwrap();
    let mut cfg = [0u8; 12];
    dev.read_config(0, &mut cfg);
    assert_eq!(&cfg[..8], &0x1_2345u64.to_le_bytes());
    assert_eq!(&cfg[8..], &[0; 4]);
    assert_eq!(dev.device_type(), 19);
    assert_eq!(dev.queue_max_sizes().len(), 3);
    assert!(matches!(
        Vsock::new(2, dir.path().join("b.sock")),
        Err(VsockError::InvalidCid(2))
    ));
    let file = dir.path().join("plain-file");
    std::fs::write(&file, b"x").unwrap();
    let err = Vsock::new(3, &file)
        .err()
        .expect("a regular file is not replaced");
    assert!(matches!(err, VsockError::PathInUse { .. }), "{err}");
}

#[test]
fn random_garbage_from_the_guest_never_stops_the_device() {
    use crate::devices::virtio::net::test_util::Rng;
    let (dir, mem) = setup();
    let path = tmp_socket(&dir);
    let listener = UnixListener::bind(format!("{}_8000", path.display())).unwrap();
    listener.set_nonblocking(true).unwrap();
    let mut dev = Vsock::new(CID, &path).unwrap();
    let mut g = Guest::new(&mem);
    g.post_rx(64);
    g.activate(&mem, &mut dev);
    let mut rng = Rng::new(0x05ee_d0fa_050c);
    let mut accepted = Vec::new();
    let mut sent = 0u16;
    for round in 0..40 {
        for _ in 0..40 {
            let op = rng.pick(&[0, 1, 1, 2, 3, 4, 5, 5, 5, 6, 7, 8, 0xffff]);
            let mut h = g.packet(op as u16, 3000 + rng.below(4) as u32, 8000, 0);
            if rng.below(10) == 0 {
                h.dst_port = rng.next() as u32;
            }
            if rng.below(20) == 0 {
                h.src_cid = rng.next();
            }
            if rng.below(20) == 0 {
                h.type_ = rng.below(4) as u16;
            }
            h.flags = rng.below(8) as u32;
            h.buf_alloc = rng.pick(&[0, 1, 4096, u32::MAX]);
            h.fwd_cnt = rng.next() as u32;
            let data_len = rng.pick(&[0usize, 1, 100, 4096]);
            h.len = match rng.below(6) {
                0 => rng.next() as u32,
                _ => data_len as u32,
            };
            let data = vec![0x5a; data_len];
            if rng.below(15) == 0 {
                // A raw chain with random descriptor fields.
                let i = 150 + rng.below(50) as u16;
                let flags = rng.below(4) as u16;
                let wild = rng.next();
                let addr = rng.pick(&[0x90_0000, wild, 0x200_0000 - 8]);
                g.tx.add_raw(
                    &[(
                        i,
                        addr,
                        rng.below(70_000) as u32,
                        flags,
                        rng.below(300) as u16,
                    )],
                    i,
                );
                g.tx.kick();
            } else {
                g.send(h, &data);
            }
            sent += 1;
        }
        g.wait_tx_used(sent);
        // Answer the host side like a live peer would: accept, and drop some.
        while let Ok((s, _)) = listener.accept() {
            if round % 2 == 0 {
                accepted.push(s);
            }
        }
        // Recycle every receive buffer the device used.
        while g.rx.used_idx() != g.rx_seen {
            g.recv();
        }
    }
    assert_eq!(dev.worker_panics(), 0);
    let m = dev.metrics().snapshot();
    assert!(m.tx_errors > 0 && m.rst_sent > 0, "{m:?}");
    // Still serving a clean connection (packets of the garbage connections winding
    // down may come first).
    drop(accepted);
    let mut host = host_connect(&path, 4242);
    let req = loop {
        let (h, _) = g.recv();
        if h.op == OP_REQUEST && h.dst_port == 4242 {
            break h;
        }
    };
    g.send(g.packet(OP_RESPONSE, 4242, req.src_port, 0), &[]);
    assert_eq!(read_line(&mut host), format!("OK {}\n", req.src_port));
    g.send(g.packet(OP_RW, 4242, req.src_port, 2), b"ok");
    assert_eq!(read_exact(&mut host, 2), b"ok");
    assert_eq!(dev.worker_panics(), 0);
}

#[test]
fn a_guest_that_sends_without_reading_cannot_grow_the_pending_queue() {
    let (dir, mem) = setup();
    let path = tmp_socket(&dir);
    let mut dev = Vsock::new(CID, &path).unwrap();
    let mut g = Guest::new(&mem);
    g.activate(&mem, &mut dev);
    // Every one of these earns an RST, and the guest posts no receive buffer.
    let total = MAX_PENDING_RX + 300;
    let mut sent = 0u16;
    for i in 0..total {
        g.send(g.packet(OP_RW, 10_000 + i as u32, 1, 0), &[]);
        sent = sent.wrapping_add(1);
        if sent % 128 == 0 {
            g.wait_tx_used(sent);
        }
    }
    g.irq
        .wait_for("every packet to be read", || g.tx.used_idx() == sent);
    let m = dev.metrics().snapshot();
    assert_eq!(m.rst_sent as usize, MAX_PENDING_RX);
    assert_eq!(m.ctrl_dropped as usize, 300);
    // What was queued is delivered in order once the guest reads.
    g.post_rx(64);
    for i in 0..MAX_PENDING_RX {
        let (h, _) = g.recv();
        assert_eq!((h.op, h.dst_port), (OP_RST, 10_000 + i as u32));
    }
}
