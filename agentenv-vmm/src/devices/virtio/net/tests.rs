//! virtio-net against a real tap in a network namespace of the test's own.
//!
//! Each test runs on a thread that unshares its network namespace; the tap, its address
//! and every socket live there and vanish with the thread (and the device's worker, which
//! inherits the namespace), also when an assertion fails.

use std::net::UdpSocket;
use std::time::Duration;

use super::test_util::{Driver, Irq, VRING_DESC_F_NEXT, activate_ctx, guest_memory};
use super::*;
use crate::devices::virtio::VirtioDevice;
use crate::devices::virtio::persist::SavedState;

#[path = "../../../../tests/support/netns.rs"]
mod netns;
use netns::{TAP_MAC, mac_str, packet_socket, recv_frame};

const GUEST_MAC: [u8; 6] = [0x06, 0x00, 0xac, 0x10, 0x00, 0x02];
const TAP: &str = "vtap0";
const HOST_IP: [u8; 4] = [10, 9, 0, 1];
const GUEST_IP: [u8; 4] = [10, 9, 0, 2];

const RX_BASE: u64 = 0;
const TX_BASE: u64 = 0x1_0000;
const RX_BUFS: u64 = 0x10_0000;
const TX_BUFS: u64 = 0x80_0000;
const MEM_SIZE: usize = 0x100_0000;

/// Runs `f` in a network namespace of its own holding the tap [`TAP`] (10.9.0.1/24).
fn in_netns<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    netns::in_netns(TAP, "10.9.0.1/24", f)
}

struct Rig<'m> {
    rx: Driver<'m>,
    tx: Driver<'m>,
    irq: Irq,
    net: Net,
}

impl<'m> Rig<'m> {
    fn new(mem: &'m GuestMemoryMmap, features: u64) -> Self {
        let mut net = Net::new("eth0", TAP, GUEST_MAC).unwrap();
        net.set_acked_features(features);
        netns::wait_tap_transmits(TAP);
        Rig {
            rx: Driver::new(mem, RX_BASE, QUEUE_SIZE, RX_BUFS),
            tx: Driver::new(mem, TX_BASE, QUEUE_SIZE, TX_BUFS),
            irq: Irq::new(),
            net,
        }
    }

    fn start(&mut self, mem: &GuestMemoryMmap) {
        let ctx = activate_ctx(mem, &self.irq, &[&self.rx, &self.tx]);
        self.net.activate(ctx).unwrap();
    }

    fn send(&mut self, hdr: [u8; 12], frame: &[u8]) -> u16 {
        // Header and frame in separate descriptors, as Linux sends them.
        let h = self.tx.alloc(12);
        self.tx.write(h, &hdr);
        let f = self.tx.alloc(frame.len() as u32);
        self.tx.write(f, frame);
        let head = self
            .tx
            .add_chain(&[(h, 12, false), (f, frame.len() as u32, false)]);
        self.tx.kick();
        head
    }

    fn wait_tx_used(&self, n: u16) {
        self.irq.wait_for(&format!("{n} used transmit chains"), || {
            self.tx.used_idx() >= n
        });
    }

    fn wait_rx_used(&self, n: u16) {
        self.irq.wait_for(&format!("{n} used receive chains"), || {
            self.rx.used_idx() >= n
        });
    }

    fn metrics(&self) -> NetMetricsSnapshot {
        self.net.metrics().snapshot()
    }
}

fn plain_hdr() -> [u8; 12] {
    [0; 12]
}

fn arp_request(target: [u8; 4]) -> Vec<u8> {
    netns::arp_request(GUEST_MAC, GUEST_IP, target)
}

/// Checks that `buf` (virtio-net header + frame) is the kernel's ARP reply to the guest.
fn assert_arp_reply(buf: &[u8]) {
    assert!(buf.len() >= 12 + 42, "frame too short: {}", buf.len());
    assert_eq!(&buf[10..12], &1u16.to_le_bytes(), "num_buffers must be 1");
    assert_eq!(buf[0], 0, "no checksum flag on an ARP reply");
    netns::assert_arp_reply(&buf[12..], GUEST_MAC, GUEST_IP, HOST_IP);
}

fn ip_checksum(data: &[u8]) -> u16 {
    let mut sum: u32 = 0;
    for pair in data.chunks(2) {
        let word = u16::from_be_bytes([pair[0], *pair.get(1).unwrap_or(&0)]);
        sum += u32::from(word);
    }
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// An Ethernet + IPv4 + UDP frame from the guest to the tap's address with the given UDP
/// checksum field.
fn udp_frame(dport: u16, payload: &[u8], udp_csum: u16) -> Vec<u8> {
    let mut f = Vec::new();
    f.extend_from_slice(&TAP_MAC);
    f.extend_from_slice(&GUEST_MAC);
    f.extend_from_slice(&[0x08, 0x00]);
    let total = (20 + 8 + payload.len()) as u16;
    let mut iph = vec![0x45, 0];
    iph.extend_from_slice(&total.to_be_bytes());
    iph.extend_from_slice(&[0, 1, 0x40, 0, 64, 17, 0, 0]);
    iph.extend_from_slice(&GUEST_IP);
    iph.extend_from_slice(&HOST_IP);
    let c = ip_checksum(&iph);
    iph[10..12].copy_from_slice(&c.to_be_bytes());
    f.extend_from_slice(&iph);
    f.extend_from_slice(&5555u16.to_be_bytes());
    f.extend_from_slice(&dport.to_be_bytes());
    f.extend_from_slice(&((8 + payload.len()) as u16).to_be_bytes());
    f.extend_from_slice(&udp_csum.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

#[test]
fn guest_frame_appears_on_the_tap() {
    in_netns(|| {
        let mem = guest_memory(MEM_SIZE);
        let mut rig = Rig::new(&mem, 0);
        let sock = packet_socket(TAP, 0x88b5);
        rig.start(&mem);
        let mut frame = vec![0xff; 6];
        frame.extend_from_slice(&GUEST_MAC);
        frame.extend_from_slice(&[0x88, 0xb5]);
        frame.extend((0..100u8).map(|i| i.wrapping_mul(7)));
        let head = rig.send(plain_hdr(), &frame);
        assert_eq!(recv_frame(&sock), frame);
        rig.wait_tx_used(1);
        assert_eq!(rig.tx.used(0), (head, 0));
        let m = rig.metrics();
        assert_eq!(m.tx_packets, 1);
        assert_eq!(m.tx_bytes, frame.len() as u64);
        assert_eq!(m.tx_errors, 0);
        assert!(m.interrupts >= 1);
    });
}

#[test]
fn kernel_reply_lands_in_a_receive_buffer_with_its_vnet_header() {
    in_netns(|| {
        let mem = guest_memory(MEM_SIZE);
        let mut rig = Rig::new(&mem, 0);
        let (head, addr) = rig.rx.add_writable(1526);
        rig.start(&mem);
        rig.send(plain_hdr(), &arp_request(HOST_IP));
        rig.wait_rx_used(1);
        let (id, len) = rig.rx.used(0);
        assert_eq!(id, head);
        assert_arp_reply(&rig.rx.read(addr, len as usize));
        let m = rig.metrics();
        assert_eq!(m.rx_packets, 1);
        assert_eq!(m.rx_bytes, u64::from(len) - 12);
        assert_eq!(m.rx_dropped, 0);
    });
}

#[test]
fn frames_wait_in_order_while_the_receive_ring_is_empty() {
    in_netns(|| {
        let mem = guest_memory(MEM_SIZE);
        let mut rig = Rig::new(&mem, 0);
        // Sees every frame crossing the tap, both ways (frames the kernel sends reach
        // only ETH_P_ALL sockets).
        let all = packet_socket(TAP, libc::ETH_P_ALL as u16);
        rig.start(&mem);
        // Two ARP requests: the kernel answers both while the guest has no buffer.
        rig.send(plain_hdr(), &arp_request(HOST_IP));
        rig.send(plain_hdr(), &arp_request(HOST_IP));
        let mut replies = 0;
        while replies < 2 {
            let f = recv_frame(&all);
            if f[12..14] == [0x08, 0x06] && f[20..22] == [0, 2] {
                replies += 1;
            }
        }
        rig.wait_tx_used(2);
        assert_eq!(rig.rx.used_idx(), 0);

        let (_, a1) = rig.rx.add_writable(1526);
        rig.rx.kick();
        rig.wait_rx_used(1);
        assert_arp_reply(&rig.rx.read(a1, rig.rx.used(0).1 as usize));

        // The second reply waits (in the tap or in the device) with no wake-up left to
        // come from the tap: the driver's notification alone must bring it.
        let (_, a2) = rig.rx.add_writable(1526);
        rig.rx.kick();
        rig.wait_rx_used(2);
        assert_arp_reply(&rig.rx.read(a2, rig.rx.used(1).1 as usize));
        let m = rig.metrics();
        assert_eq!((m.rx_packets, m.rx_dropped), (2, 0));
    });
}

#[test]
fn frame_larger_than_the_receive_buffer_is_dropped_and_counted() {
    in_netns(|| {
        let mem = guest_memory(MEM_SIZE);
        let mut rig = Rig::new(&mem, 0);
        let (small, _) = rig.rx.add_writable(30);
        let (big, addr) = rig.rx.add_writable(1526);
        rig.start(&mem);
        rig.send(plain_hdr(), &arp_request(HOST_IP));
        rig.wait_rx_used(1);
        assert_eq!(rig.rx.used(0), (small, 0));
        rig.send(plain_hdr(), &arp_request(HOST_IP));
        rig.wait_rx_used(2);
        let (id, len) = rig.rx.used(1);
        assert_eq!(id, big);
        assert_arp_reply(&rig.rx.read(addr, len as usize));
        let m = rig.metrics();
        assert_eq!((m.rx_packets, m.rx_dropped), (1, 1));
    });
}

#[test]
fn malformed_transmit_chains_are_returned_empty_and_the_device_keeps_running() {
    in_netns(|| {
        let mem = guest_memory(MEM_SIZE);
        let mut rig = Rig::new(&mem, 0);
        let sock = packet_socket(TAP, 0x88b5);
        rig.start(&mem);
        let buf = rig.tx.alloc(0x2_0000);
        let next = VRING_DESC_F_NEXT;
        // A loop: 10 → 11 → 10.
        rig.tx
            .add_raw(&[(10, buf, 64, next, 11), (11, buf, 64, next, 10)], 10);
        // A buffer outside guest memory.
        rig.tx.add_raw(&[(12, 0x4000_0000, 64, 0, 0)], 12);
        // Past the end of memory by one byte.
        rig.tx.add_raw(&[(13, MEM_SIZE as u64 - 63, 64, 0, 0)], 13);
        // Longer than 64 KiB plus the header.
        rig.tx
            .add_raw(&[(14, buf, MAX_CHAIN_LEN as u32 + 1, 0, 0)], 14);
        // Shorter than the virtio-net header.
        rig.tx.add_raw(&[(15, buf, 11, 0, 0)], 15);
        // A device-writable buffer in a transmit chain.
        rig.tx.add_raw(&[(16, buf, 64, 2, 0)], 16);
        // A next index past the descriptor table.
        rig.tx.add_raw(&[(17, buf, 64, next, 300)], 17);
        rig.tx.kick();
        rig.wait_tx_used(7);
        for (i, head) in [10u16, 12, 13, 14, 15, 16, 17].into_iter().enumerate() {
            assert_eq!(rig.tx.used(i as u16), (head, 0), "chain {head}");
        }
        assert_eq!(rig.metrics().tx_errors, 7);
        assert_eq!(rig.metrics().tx_packets, 0);

        // The device still sends good frames.
        let mut frame = vec![0xff; 6];
        frame.extend_from_slice(&GUEST_MAC);
        frame.extend_from_slice(&[0x88, 0xb5, 1, 2, 3]);
        frame.resize(60, 0);
        rig.send(plain_hdr(), &frame);
        assert_eq!(recv_frame(&sock), frame);
        rig.wait_tx_used(8);
        assert_eq!(rig.metrics().tx_packets, 1);
    });
}

#[test]
fn malformed_receive_chains_are_returned_empty_and_the_frame_goes_to_the_next_buffer() {
    in_netns(|| {
        let mem = guest_memory(MEM_SIZE);
        let mut rig = Rig::new(&mem, 0);
        let buf = rig.rx.alloc(4096);
        let w = 2u16; // VRING_DESC_F_WRITE
        // A loop, then a device-readable buffer, then an address outside memory.
        rig.rx.add_raw(
            &[
                (100, buf, 1526, w | VRING_DESC_F_NEXT, 101),
                (101, buf, 1526, w | VRING_DESC_F_NEXT, 100),
            ],
            100,
        );
        rig.rx.add_raw(&[(102, buf, 1526, 0, 0)], 102);
        rig.rx.add_raw(&[(103, 0x7000_0000, 1526, w, 0)], 103);
        let (good, addr) = rig.rx.add_writable(1526);
        rig.start(&mem);
        rig.send(plain_hdr(), &arp_request(HOST_IP));
        rig.wait_rx_used(4);
        assert_eq!(rig.rx.used(0), (100, 0));
        assert_eq!(rig.rx.used(1), (102, 0));
        assert_eq!(rig.rx.used(2), (103, 0));
        let (id, len) = rig.rx.used(3);
        assert_eq!(id, good);
        assert_arp_reply(&rig.rx.read(addr, len as usize));
        let m = rig.metrics();
        assert_eq!((m.rx_errors, m.rx_packets, m.rx_dropped), (3, 1, 0));
    });
}

#[test]
fn checksum_offload_header_from_the_guest_reaches_the_kernel() {
    in_netns(|| {
        let mem = guest_memory(MEM_SIZE);
        let features = (1 << VIRTIO_F_VERSION_1) | (1 << VIRTIO_NET_F_CSUM);
        let mut rig = Rig::new(&mem, features);
        let sock = UdpSocket::bind("10.9.0.1:0").unwrap();
        sock.set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let port = sock.local_addr().unwrap().port();
        rig.start(&mem);
        // A wrong checksum with no offload flag: the kernel drops the datagram.
        rig.send(plain_hdr(), &udp_frame(port, b"plain", 0x1234));
        // The same with NEEDS_CSUM (csum_start 34, csum_offset 6): the kernel takes it.
        let mut hdr = [0u8; 12];
        hdr[0] = 1;
        hdr[6..8].copy_from_slice(&34u16.to_le_bytes());
        hdr[8..10].copy_from_slice(&6u16.to_le_bytes());
        rig.send(hdr, &udp_frame(port, b"offloaded", 0x1234));
        let mut buf = [0u8; 64];
        let (n, from) = sock.recv_from(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"offloaded");
        assert_eq!(from.to_string(), "10.9.0.2:5555");
        rig.wait_tx_used(2);
        assert_eq!(rig.metrics().tx_packets, 2);
    });
}

/// Sends a UDP datagram from the namespace to the guest and returns what lands in the
/// receive buffer (header + frame).
fn kernel_udp_to_guest(features: u64) -> Vec<u8> {
    let mem = guest_memory(MEM_SIZE);
    let mut rig = Rig::new(&mem, features);
    let (_, addr) = rig.rx.add_writable(65562);
    rig.start(&mem);
    netns::ip(&[
        "neigh",
        "add",
        "10.9.0.2",
        "lladdr",
        &mac_str(&GUEST_MAC),
        "dev",
        TAP,
        "nud",
        "permanent",
    ]);
    let sock = UdpSocket::bind("10.9.0.1:4444").unwrap();
    sock.send_to(b"to the guest", "10.9.0.2:7777").unwrap();
    rig.wait_rx_used(1);
    let len = rig.rx.used(0).1 as usize;
    rig.rx.read(addr, len)
}

#[test]
fn without_guest_offloads_the_kernel_sends_complete_checksums() {
    in_netns(|| {
        let buf = kernel_udp_to_guest(1 << VIRTIO_F_VERSION_1);
        assert_eq!(buf[0], 0, "no NEEDS_CSUM without GUEST_CSUM");
        let ip_hdr = &buf[12 + 14..12 + 34];
        assert_eq!(ip_hdr[9], 17, "UDP");
        assert_eq!(&buf[buf.len() - 12..], b"to the guest");
        // The UDP checksum over the pseudo-header verifies.
        let udp = &buf[12 + 34..];
        let mut pseudo = Vec::new();
        pseudo.extend_from_slice(&ip_hdr[12..20]);
        pseudo.extend_from_slice(&[0, 17]);
        pseudo.extend_from_slice(&(udp.len() as u16).to_be_bytes());
        pseudo.extend_from_slice(udp);
        assert_ne!(&udp[6..8], &[0, 0], "a checksum is present");
        assert_eq!(ip_checksum(&pseudo), 0, "the checksum is complete");
    });
}

#[test]
fn acked_guest_checksum_offload_is_applied_to_the_tap() {
    in_netns(|| {
        let features = (1 << VIRTIO_F_VERSION_1) | (1 << VIRTIO_NET_F_GUEST_CSUM);
        let buf = kernel_udp_to_guest(features);
        assert_eq!(
            buf[0] & 1,
            1,
            "NEEDS_CSUM: the guest completes the checksum"
        );
        assert_eq!(u16::from_le_bytes([buf[6], buf[7]]), 34, "csum_start");
        assert_eq!(u16::from_le_bytes([buf[8], buf[9]]), 6, "csum_offset");
        assert_eq!(&buf[buf.len() - 12..], b"to the guest");
    });
}

#[test]
fn deactivate_hands_the_queues_back_and_activate_resumes() {
    in_netns(|| {
        let mem = guest_memory(MEM_SIZE);
        let mut rig = Rig::new(&mem, 0);
        rig.start(&mem);
        let (queues, events) = rig.net.deactivate().expect("the device was active");
        assert_eq!((queues.len(), events.len()), (2, 2));
        assert!(rig.net.deactivate().is_none());
        // Traffic queued while inactive is served after the next activation.
        let (_, addr) = rig.rx.add_writable(1526);
        rig.send(plain_hdr(), &arp_request(HOST_IP));
        let ctx = crate::devices::virtio::ActivateContext {
            mem: mem.clone(),
            interrupt: rig.irq.interrupt.clone(),
            queues,
            queue_events: events,
        };
        rig.net.activate(ctx).unwrap();
        rig.wait_rx_used(1);
        assert_arp_reply(&rig.rx.read(addr, rig.rx.used(0).1 as usize));
    });
}

#[test]
fn config_space_holds_the_mac_and_state_round_trips() {
    in_netns(|| {
        let net = Net::new("eth0", TAP, GUEST_MAC).unwrap();
        let mut cfg = [0u8; 8];
        net.read_config(0, &mut cfg);
        assert_eq!(&cfg[..6], &GUEST_MAC);
        assert_eq!(&cfg[6..], &[0, 0], "bytes past the config read as zero");
        let f = net.avail_features();
        assert_ne!(f & (1 << VIRTIO_F_VERSION_1), 0);
        assert_ne!(f & (1 << VIRTIO_NET_F_MAC), 0);
        assert_eq!(f & (1 << 15), 0, "MRG_RXBUF is not offered");
        let state = net.save_state().unwrap();
        // A single-queue tap has one reader: a second device is refused, naming the tap.
        let err = Net::new("eth1", TAP, [2, 2, 2, 2, 2, 2])
            .err()
            .expect("a second reader is refused");
        assert!(err.to_string().contains(TAP), "{err}");
        drop(net);
        let mut again = Net::new("eth0", TAP, [2, 2, 2, 2, 2, 2]).unwrap();
        again.restore_state(&state).unwrap();
        assert_eq!(again.mac(), GUEST_MAC);
        assert!(
            again
                .restore_state(&serde_json::json!({"version": 99, "mac": "x"}))
                .is_err()
        );
        assert!(again.restore(NetState { mac: "x".into() }).is_err());
    });
}

#[test]
fn mac_addresses_parse_strictly() {
    assert_eq!(parse_mac("06:00:AC:10:00:02").unwrap(), GUEST_MAC);
    for bad in [
        "",
        "06:00:ac:10:00",
        "06:00:ac:10:00:02:03",
        "6:00:ac:10:00:02",
        "zz:00:ac:10:00:02",
    ] {
        assert!(parse_mac(bad).is_err(), "{bad:?}");
    }
}

#[test]
fn random_descriptor_chains_never_stop_the_device() {
    use super::test_util::Rng;
    in_netns(|| {
        let mem = guest_memory(MEM_SIZE);
        let mut rig = Rig::new(&mem, 0);
        let sock = packet_socket(TAP, 0x88b5);
        rig.start(&mem);
        let mut rng = Rng::new(0x00ba_d0c5);
        let base = rig.tx.alloc(0x1_0000);
        for i in 0..200u16 {
            // Up to four descriptors with random addresses, lengths, flags and links.
            let head = 20 + (i % 50) * 4;
            let n = 1 + rng.below(4) as u16;
            let mut descs = Vec::new();
            for k in 0..n {
                let (off, wild) = (rng.below(0x1_0000), rng.next());
                let addr = rng.pick(&[base, base + off, wild, MEM_SIZE as u64 - 4]);
                let wild_len = rng.next() as u32;
                let len = rng.pick(&[0, 1, 11, 12, 60, 1514, 70_000, wild_len]);
                let flags = rng.below(8) as u16;
                let wild_next = rng.below(400) as u16;
                let next = rng.pick(&[head + k + 1, head, wild_next]);
                descs.push((head + k, addr, len, flags, next));
            }
            rig.tx.add_raw(&descs, head);
        }
        rig.tx.kick();
        rig.wait_tx_used(200);
        assert_eq!(rig.net.worker_panics(), 0);
        let m = rig.metrics();
        assert!(m.tx_errors > 0, "{m:?}");
        // A good frame still goes out.
        let mut frame = vec![0xff; 6];
        frame.extend_from_slice(&GUEST_MAC);
        frame.extend_from_slice(&[0x88, 0xb5, 9, 9, 9]);
        frame.resize(60, 0);
        rig.send(plain_hdr(), &frame);
        loop {
            // Random chains may have produced 0x88b5 frames of their own.
            if recv_frame(&sock) == frame {
                break;
            }
        }
    });
}

#[test]
fn a_batch_of_transmit_chains_raises_one_interrupt() {
    in_netns(|| {
        let mem = guest_memory(MEM_SIZE);
        let mut rig = Rig::new(&mem, 0);
        let sock = packet_socket(TAP, 0x88b5);
        let mut frame = vec![0xff; 6];
        frame.extend_from_slice(&GUEST_MAC);
        frame.extend_from_slice(&[0x88, 0xb5]);
        frame.resize(100, 1);
        // Fifty frames queued before the device looks: one pass, one interrupt.
        for _ in 0..50 {
            rig.send(plain_hdr(), &frame);
        }
        rig.start(&mem);
        rig.wait_tx_used(50);
        for _ in 0..50 {
            assert_eq!(recv_frame(&sock), frame);
        }
        let m = rig.metrics();
        assert_eq!(m.tx_packets, 50);
        rig.irq
            .wait_for("the interrupt", || rig.metrics().interrupts >= 1);
        assert_eq!(rig.metrics().interrupts, 1);
    });
}
