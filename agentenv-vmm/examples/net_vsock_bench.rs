//! Throughput of the virtio-net and virtio-vsock devices, each against a reference
//! measured in the same run:
//!
//! * net transmit: frames a driver puts on the transmit queue, through the device, into a
//!   tap, against the same frames written straight to another tap (the kernel's share
//!   of the cost, the floor for any VMM);
//! * vsock host → guest: bytes a host process writes on a connection, through the device,
//!   into guest receive buffers, against the same bytes over a plain unix socket pair.
//!
//! The driver side is a minimal split-ring driver in guest memory (no VM). Needs root
//! (it makes its own network namespace). Run:
//! `cargo run --release -p agentenv-vmm --example net_vsock_bench`

use std::io::{Read, Write};
use std::num::NonZeroUsize;
use std::os::unix::net::UnixStream;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use agentenv_testkit::Wait;
use agentenv_vmm::devices::virtio::net::Net;
use agentenv_vmm::devices::virtio::tap::Tap;
use agentenv_vmm::devices::virtio::vsock::Vsock;
use agentenv_vmm::devices::virtio::vsock::packet::*;
use agentenv_vmm::devices::virtio::{ActivateContext, VirtioDevice, VirtioInterrupt};
use agentenv_vmm::memory::{GuestMemoryMmap, GuestRegionMmap};
use virtio_queue::{Queue, QueueT};
use vm_memory::bitmap::AtomicBitmap;
use vm_memory::mmap::MmapRegionBuilder;
use vm_memory::{Bytes, GuestAddress};
use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};

const MEM: usize = 64 << 20;

fn memory() -> GuestMemoryMmap {
    let bitmap = AtomicBitmap::new(MEM, NonZeroUsize::new(4096).unwrap());
    let region = MmapRegionBuilder::new_with_bitmap(MEM, Some(bitmap))
        .with_mmap_prot(libc::PROT_READ | libc::PROT_WRITE)
        .with_mmap_flags(libc::MAP_ANONYMOUS | libc::MAP_PRIVATE | libc::MAP_NORESERVE)
        .build()
        .unwrap();
    GuestMemoryMmap::from_regions(vec![GuestRegionMmap::new(region, GuestAddress(0)).unwrap()])
        .unwrap()
}

/// The driver side of one split queue (descriptor i always points at buffer i).
struct Ring<'m> {
    mem: &'m GuestMemoryMmap,
    desc: u64,
    avail: u64,
    used: u64,
    size: u16,
    avail_idx: u16,
    evt: EventFd,
}

impl<'m> Ring<'m> {
    fn new(mem: &'m GuestMemoryMmap, base: u64, size: u16) -> Self {
        let desc = base;
        let avail = desc + 16 * u64::from(size);
        let used = (avail + 6 + 2 * u64::from(size)).next_multiple_of(4);
        Ring {
            mem,
            desc,
            avail,
            used,
            size,
            avail_idx: 0,
            evt: EventFd::new(EFD_NONBLOCK).unwrap(),
        }
    }

    fn queue(&self) -> Queue {
        let mut q = Queue::new(self.size).unwrap();
        q.set_size(self.size);
        q.set_desc_table_address(Some(self.desc as u32), Some((self.desc >> 32) as u32));
        q.set_avail_ring_address(Some(self.avail as u32), Some((self.avail >> 32) as u32));
        q.set_used_ring_address(Some(self.used as u32), Some((self.used >> 32) as u32));
        q.set_ready(true);
        q
    }

    fn set_desc(&self, i: u16, addr: u64, len: u32, flags: u16) {
        let mut d = [0u8; 16];
        d[0..8].copy_from_slice(&addr.to_le_bytes());
        d[8..12].copy_from_slice(&len.to_le_bytes());
        d[12..14].copy_from_slice(&flags.to_le_bytes());
        self.mem
            .write_slice(&d, GuestAddress(self.desc + 16 * u64::from(i)))
            .unwrap();
    }

    fn publish(&mut self, head: u16) {
        let slot = self.avail + 4 + 2 * u64::from(self.avail_idx % self.size);
        self.mem.write_obj(head, GuestAddress(slot)).unwrap();
        self.avail_idx = self.avail_idx.wrapping_add(1);
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        self.mem
            .write_obj(self.avail_idx, GuestAddress(self.avail + 2))
            .unwrap();
    }

    fn used_idx(&self) -> u16 {
        self.mem.read_obj(GuestAddress(self.used + 2)).unwrap()
    }

    fn used(&self, n: u16) -> (u16, u32) {
        let at = self.used + 4 + 8 * u64::from(n % self.size);
        let id: u32 = self.mem.read_obj(GuestAddress(at)).unwrap();
        let len: u32 = self.mem.read_obj(GuestAddress(at + 4)).unwrap();
        (id as u16, len)
    }

    fn kick(&self) {
        self.evt.write(1).unwrap();
    }
}

fn ctx(mem: &GuestMemoryMmap, rings: &[&Ring<'_>]) -> ActivateContext {
    let line = Arc::new(EventFd::new(EFD_NONBLOCK).unwrap());
    ActivateContext {
        mem: mem.clone(),
        interrupt: Arc::new(VirtioInterrupt::new(line)),
        queues: rings.iter().map(|r| r.queue()).collect(),
        queue_events: rings.iter().map(|r| r.evt.try_clone().unwrap()).collect(),
    }
}

fn ip(args: &[&str]) {
    let ok = Command::new("ip").args(args).status().unwrap().success();
    assert!(ok, "ip {args:?} failed");
}

fn frame() -> Vec<u8> {
    // virtio-net header, then a broadcast frame of an unused ethertype the kernel drops.
    let mut f = vec![0u8; 12];
    f.extend_from_slice(&[0xff; 6]);
    f.extend_from_slice(&[0x06, 0, 0, 0, 0, 2]);
    f.extend_from_slice(&[0x88, 0xb5]);
    f.resize(12 + 1514, 0x5a);
    f
}

fn bench_net_tx(frames: u32) -> (f64, f64) {
    // SAFETY: unshare only changes this thread's namespace membership.
    let ret = unsafe { libc::unshare(libc::CLONE_NEWNET) };
    assert_eq!(ret, 0, "unshare(CLONE_NEWNET) failed: run as root");
    for (tap, _) in [("bench0", 0), ("ref0", 1)] {
        ip(&["tuntap", "add", "dev", tap, "mode", "tap"]);
        ip(&["link", "set", "dev", tap, "up"]);
    }
    let f = frame();

    // Reference: straight into a tap.
    let reference = Tap::open("ref0").unwrap();
    let start = Instant::now();
    for _ in 0..frames {
        while reference.write_frame(&[std::io::IoSlice::new(&f)]).is_err() {}
    }
    let direct = start.elapsed().as_secs_f64();

    // Through the device.
    let mem = memory();
    let rx = Ring::new(&mem, 0, 256);
    let mut tx = Ring::new(&mem, 0x1_0000, 256);
    for i in 0..256u16 {
        let addr = 0x10_0000 + u64::from(i) * 0x1000;
        mem.write_slice(&f, GuestAddress(addr)).unwrap();
        tx.set_desc(i, addr, f.len() as u32, 0);
    }
    let mut net = Net::new("bench", "bench0", [6, 0, 0, 0, 0, 2]).unwrap();
    net.activate(ctx(&mem, &[&rx, &tx])).unwrap();
    let start = Instant::now();
    let mut posted = 0u32;
    while tx.used_idx() != frames as u16 || posted < frames {
        let in_flight = tx.avail_idx.wrapping_sub(tx.used_idx());
        if posted < frames && in_flight < 256 {
            let n = u32::from(256 - in_flight).min(frames - posted) as u16;
            for _ in 0..n {
                let head = tx.avail_idx % 256;
                tx.publish(head);
            }
            posted += u32::from(n);
            tx.kick();
        } else {
            std::thread::yield_now();
        }
    }
    let device = start.elapsed().as_secs_f64();
    let m = net.metrics().snapshot();
    assert_eq!(m.tx_packets, u64::from(frames));
    (direct, device)
}

fn bench_vsock_host_to_guest(total: usize) -> (f64, f64) {
    let chunk = vec![0x33u8; 64 * 1024];
    // Reference: a unix socket pair, a reader thread draining it.
    let (mut a, mut b) = UnixStream::pair().unwrap();
    let reader = std::thread::spawn(move || {
        let mut buf = vec![0u8; 64 * 1024];
        let mut got = 0;
        while got < total {
            got += b.read(&mut buf).unwrap();
        }
    });
    let start = Instant::now();
    let mut sent = 0;
    while sent < total {
        a.write_all(&chunk).unwrap();
        sent += chunk.len();
    }
    reader.join().unwrap();
    let direct = start.elapsed().as_secs_f64();

    // Through the device, to a guest that reads as fast as it can.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("v.sock");
    let mem = memory();
    let mut rx = Ring::new(&mem, 0, 256);
    let mut tx = Ring::new(&mem, 0x1_0000, 256);
    let ev = Ring::new(&mem, 0x2_0000, 256);
    let buf_len = (HDR_LEN + 64 * 1024) as u32;
    let rx_addr = |i: u16| 0x10_0000 + u64::from(i) * 0x1_1000;
    for i in 0..256u16 {
        rx.set_desc(i, rx_addr(i), buf_len, 2);
        rx.publish(i);
    }
    let mut dev = Vsock::new(3, &path).unwrap();
    dev.activate(ctx(&mem, &[&rx, &tx, &ev])).unwrap();
    let mut host = UnixStream::connect(&path).unwrap();
    host.write_all(b"CONNECT 5000\n").unwrap();
    let mut seen = 0u16;
    let wait_used = |seen: u16, rx: &Ring<'_>| {
        Wait::new("a packet from the device", Duration::from_secs(10))
            .every(Duration::ZERO)
            .until_blocking(|| rx.used_idx() != seen);
    };
    wait_used(seen, &rx);
    let (head, _) = rx.used(seen);
    let mut raw = [0u8; HDR_LEN];
    mem.read_slice(&mut raw, GuestAddress(rx_addr(head)))
        .unwrap();
    let req = Header::parse(&raw);
    seen += 1;
    rx.publish(head);
    rx.kick();
    let send = |tx: &mut Ring<'_>, slot: u16, h: Header| {
        let addr = 0x300_0000 + u64::from(slot) * 64;
        mem.write_slice(&h.to_bytes(), GuestAddress(addr)).unwrap();
        tx.set_desc(slot, addr, HDR_LEN as u32, 0);
        tx.publish(slot);
        tx.kick();
    };
    let mut hdr = Header {
        src_cid: 3,
        dst_cid: HOST_CID,
        src_port: 5000,
        dst_port: req.src_port,
        type_: TYPE_STREAM,
        op: OP_RESPONSE,
        buf_alloc: 4 << 20,
        ..Default::default()
    };
    let mut tx_slot = 0u16;
    send(&mut tx, tx_slot, hdr);
    tx_slot += 1;
    let mut ok = [0u8; 16];
    let n = host.read(&mut ok).unwrap();
    assert!(ok[..n].starts_with(b"OK "));

    let writer = std::thread::spawn(move || {
        let start = Instant::now();
        let mut sent = 0;
        while sent < total {
            host.write_all(&chunk).unwrap();
            sent += chunk.len();
        }
        (start, host)
    });
    let mut got = 0usize;
    let mut credited = 0usize;
    while got < total {
        wait_used(seen, &rx);
        while rx.used_idx() != seen {
            let (head, len) = rx.used(seen);
            got += len as usize - HDR_LEN;
            seen = seen.wrapping_add(1);
            rx.publish(head);
        }
        rx.kick();
        if got - credited >= 1 << 20 {
            hdr.op = OP_CREDIT_UPDATE;
            hdr.fwd_cnt = got as u32;
            send(&mut tx, tx_slot % 256, hdr);
            tx_slot = tx_slot.wrapping_add(1);
            credited = got;
        }
    }
    let (start, _host) = writer.join().unwrap();
    let device = start.elapsed().as_secs_f64();
    assert_eq!(got, total);
    (direct, device)
}

fn main() {
    let frames = 200_000u32;
    let (direct, device) = std::thread::spawn(move || bench_net_tx(frames))
        .join()
        .unwrap();
    println!("virtio-net transmit, {frames} frames of 1514 bytes:");
    println!(
        "  straight to a tap   {:>10.0} frames/s",
        f64::from(frames) / direct
    );
    println!(
        "  through the device  {:>10.0} frames/s  ({:.2}x the direct rate)",
        f64::from(frames) / device,
        direct / device
    );
    let total = 512 << 20;
    let (direct, device) = bench_vsock_host_to_guest(total);
    let mib = (total >> 20) as f64;
    println!("virtio-vsock host -> guest, {} MiB:", total >> 20);
    println!("  unix socket pair    {:>10.0} MiB/s", mib / direct);
    println!(
        "  through the device  {:>10.0} MiB/s  ({:.2}x the socket pair)",
        mib / device,
        direct / device
    );
}
