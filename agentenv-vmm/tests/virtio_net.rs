//! A guest program drives virtio-net through the virtio-mmio transport of a real VM whose
//! net device is attached to a tap in a network namespace the test created.
//!
//! The guest checks the device's identity, negotiates `VERSION_1` + `MAC`, reads the MAC
//! from the config space (and keeps it for the host to check), sets up the receive queue
//! (0) with four 1526-byte buffers and the transmit queue (1), and takes the used-buffer
//! interrupts in its own IDT handler (IOAPIC pin 5, as in `virtio_blk.rs`). Then either
//! - it sends a broadcast ARP request "who has 10.0.2.1, tell 10.0.2.15" from the MAC it
//!   read, and waits for the kernel's reply in a receive buffer; or
//! - it raises a flag and waits for a frame the host writes to the tap.
//!
//! It checks the received frame's destination (its MAC) and type itself, prints
//! `virtio-net ok` and ends through the debug-exit port; the host then reads guest memory
//! and compares the receive buffer byte for byte with what crossed the tap.
//!
//! Each test runs on a thread that unshares its network namespace; the VM (its vCPU
//! thread and the device's worker, which start from that thread) and the tap live there
//! and vanish with it, also when an assertion fails.

mod common;
mod support;

use std::time::{Duration, Instant};

use agentenv_vmm::config::NetConfig;
use agentenv_vmm::devices::virtio::net::NetMetricsSnapshot;
use agentenv_vmm::{ExitReason, Vm, VmConfig};
use common::*;
use iced_x86::code_asm::*;
use support::netns::{
    TAP_MAC, arp_request, assert_arp_reply, has_carrier, in_netns, link, mac_str, packet_socket,
    recv_frame, send_frame, wait_tap_transmits,
};
use support::setup_queue;
use vm_memory::{Bytes, GuestAddress};

const MMIO: u64 = 0xd000_0000;
const IRQ_PIN: u64 = 5;
const QUEUE_LEN: u32 = 8;

const RX_DESC: u64 = 0x50_0000;
const RX_AVAIL: u64 = 0x50_1000;
const RX_USED: u64 = 0x50_2000;
const TX_DESC: u64 = 0x51_0000;
const TX_AVAIL: u64 = 0x51_1000;
const TX_USED: u64 = 0x51_2000;
/// Receive buffer `i` is at `RX_BUF + i * RX_STRIDE`.
const RX_BUF: u64 = 0x52_0000;
const RX_STRIDE: u64 = 0x800;
const RX_BUFS: u64 = 4;
/// Header and a full-size Ethernet frame: what a driver without offloads posts.
const RX_BUF_LEN: u32 = 12 + 1514;
const TX_BUF: u64 = 0x53_0000;
/// Where the guest stores the MAC it read from the config space.
const MAC_OUT: u64 = 0x54_0000;
const IDT: u64 = 0x60_0000;
const IDTR: u64 = 0x60_1000;
const IRQ_SEEN: u64 = 0x60_2000;
const READY: u64 = 0x60_3000;
/// The receive ring's used index as the interrupt handler last saw it.
const RX_USED_AT_IRQ: u64 = 0x60_4000;
const VECTOR: u64 = 0x30;

const VNET_HDR_LEN: usize = 12;
const GUEST_MAC: [u8; 6] = [0x06, 0x00, 0xac, 0x10, 0x00, 0x0f];
/// The tap's address in the test's namespace.
const HOST_CIDR: &str = "10.0.2.1/24";
const HOST_IP: [u8; 4] = [10, 0, 2, 1];
const GUEST_IP: [u8; 4] = [10, 0, 2, 15];
/// An experimental ethertype (IEEE 802 local use) for the host-to-guest frame.
const ETHERTYPE_TEST: u16 = 0x88b5;

/// Feature bits.
const F_MAC: u32 = 1 << 5;
const F_VERSION_1_HI: u32 = 1; // bit 32

#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Send an ARP request for the tap's address and wait for the reply.
    ArpRequest,
    /// Raise [`READY`] and wait for a frame of type [`ETHERTYPE_TEST`] from the host.
    HostFrame,
}

// ---------------------------------------------------------------------------------------
// Frames.

/// The guest's ARP request with zeros where its MAC goes (the guest fills in the MAC it
/// read from the config space: Ethernet source at 6, ARP sender at 22).
fn arp_request_template() -> Vec<u8> {
    arp_request([0; 6], GUEST_IP, HOST_IP)
}

fn is_arp_reply(f: &[u8]) -> bool {
    f.len() >= 42 && f[12..14] == [0x08, 0x06] && f[20..22] == [0, 2]
}

/// A frame from the tap to the guest with a recognisable payload.
fn host_frame() -> Vec<u8> {
    let mut f = Vec::new();
    f.extend_from_slice(&GUEST_MAC);
    f.extend_from_slice(&TAP_MAC);
    f.extend_from_slice(&ETHERTYPE_TEST.to_be_bytes());
    f.extend_from_slice(b"host to guest ");
    f.extend((0..86u8).map(|i| i.wrapping_mul(13)));
    f
}

// ---------------------------------------------------------------------------------------
// The guest program.

/// A split-queue descriptor.
fn descriptor(addr: u64, len: u32, flags: u16, next: u16) -> Vec<u8> {
    let mut d = Vec::with_capacity(16);
    d.extend_from_slice(&addr.to_le_bytes());
    d.extend_from_slice(&len.to_le_bytes());
    d.extend_from_slice(&flags.to_le_bytes());
    d.extend_from_slice(&next.to_le_bytes());
    d
}

/// An available ring with `heads` in its first slots and index 0 (the guest publishes
/// them by writing the index).
fn avail_ring(heads: &[u16]) -> Vec<u8> {
    let mut r = vec![0u8; 4];
    for h in heads {
        r.extend_from_slice(&h.to_le_bytes());
    }
    r
}

/// The data the guest program finds in memory: descriptor tables, rings (unpublished) and
/// the frame to send.
fn data_segments() -> Vec<Segment> {
    const VRING_DESC_F_WRITE: u16 = 2;
    let rx_desc = (0..RX_BUFS)
        .flat_map(|i| descriptor(RX_BUF + i * RX_STRIDE, RX_BUF_LEN, VRING_DESC_F_WRITE, 0))
        .collect();
    let mut tx = vec![0u8; VNET_HDR_LEN];
    tx.extend_from_slice(&arp_request_template());
    vec![
        Segment {
            addr: RX_DESC,
            bytes: rx_desc,
        },
        Segment {
            addr: RX_AVAIL,
            bytes: avail_ring(&(0..RX_BUFS as u16).collect::<Vec<_>>()),
        },
        Segment {
            addr: TX_DESC,
            bytes: descriptor(TX_BUF, tx.len() as u32, 0, 0),
        },
        Segment {
            addr: TX_AVAIL,
            bytes: avail_ring(&[0]),
        },
        Segment {
            addr: TX_BUF,
            bytes: tx,
        },
    ]
}

/// Copies the six MAC bytes at [`MAC_OUT`] to `dst` (uses eax).
fn copy_mac(a: &mut CodeAssembler, dst: u64) {
    a.mov(rsi, MAC_OUT).unwrap();
    a.mov(rdi, dst).unwrap();
    a.mov(eax, dword_ptr(rsi)).unwrap();
    a.mov(dword_ptr(rdi), eax).unwrap();
    a.mov(ax, word_ptr(rsi + 4)).unwrap();
    a.mov(word_ptr(rdi + 4), ax).unwrap();
}

/// The guest program; failures end it with a distinct nonzero status.
fn net_guest(mode: Mode) -> CodeAssembler {
    let mut a = asm64();
    let fail: Vec<CodeLabel> = (0..16).map(|_| a.create_label()).collect();
    let mut handler = a.create_label();

    // Interrupts first, so no edge on pin 5 is lost.
    route_irq(&mut a, handler, IDT, IDTR, VECTOR, IRQ_PIN);

    // Identify the device: virtio-mmio version 2, a network card.
    a.mov(rbx, MMIO).unwrap();
    a.cmp(dword_ptr(rbx), 0x7472_6976).unwrap();
    a.jne(fail[1]).unwrap();
    a.cmp(dword_ptr(rbx + 0x4), 2).unwrap();
    a.jne(fail[2]).unwrap();
    a.cmp(dword_ptr(rbx + 0x8), 1).unwrap();
    a.jne(fail[3]).unwrap();
    // Reset, ACKNOWLEDGE, DRIVER.
    a.mov(dword_ptr(rbx + 0x70), 0).unwrap();
    a.mov(dword_ptr(rbx + 0x70), 1).unwrap();
    a.mov(dword_ptr(rbx + 0x70), 3).unwrap();
    // Features: MAC (bit 5) and VERSION_1 (bit 32) must be offered; take exactly those.
    a.mov(dword_ptr(rbx + 0x14), 0).unwrap();
    a.test(dword_ptr(rbx + 0x10), F_MAC).unwrap();
    a.jz(fail[4]).unwrap();
    a.mov(dword_ptr(rbx + 0x14), 1).unwrap();
    a.test(dword_ptr(rbx + 0x10), F_VERSION_1_HI).unwrap();
    a.jz(fail[4]).unwrap();
    a.mov(dword_ptr(rbx + 0x24), 0).unwrap();
    a.mov(dword_ptr(rbx + 0x20), F_MAC).unwrap();
    a.mov(dword_ptr(rbx + 0x24), 1).unwrap();
    a.mov(dword_ptr(rbx + 0x20), F_VERSION_1_HI).unwrap();
    a.mov(dword_ptr(rbx + 0x70), 0xb).unwrap();
    a.test(dword_ptr(rbx + 0x70), 8).unwrap();
    a.jz(fail[5]).unwrap();
    // The MAC: config space bytes 0..6.
    a.mov(rdi, MAC_OUT).unwrap();
    a.mov(eax, dword_ptr(rbx + 0x100)).unwrap();
    a.mov(dword_ptr(rdi), eax).unwrap();
    a.mov(ax, word_ptr(rbx + 0x104)).unwrap();
    a.mov(word_ptr(rdi + 4), ax).unwrap();
    // Queues: receive 0, transmit 1; DRIVER_OK.
    setup_queue(&mut a, 0, QUEUE_LEN, RX_DESC, RX_AVAIL, RX_USED, fail[6]);
    setup_queue(&mut a, 1, QUEUE_LEN, TX_DESC, TX_AVAIL, TX_USED, fail[6]);
    a.mov(dword_ptr(rbx + 0x70), 0xf).unwrap();
    a.test(dword_ptr(rbx + 0x70), 0x40).unwrap(); // DEVICE_NEEDS_RESET
    a.jnz(fail[7]).unwrap();

    // Publish the receive buffers and notify queue 0.
    a.mov(rdi, RX_AVAIL).unwrap();
    a.mov(word_ptr(rdi + 2), RX_BUFS as u32).unwrap();
    a.mov(dword_ptr(rbx + 0x50), 0).unwrap();

    match mode {
        Mode::ArpRequest => {
            // Put the MAC it read into the request, publish it, notify queue 1.
            copy_mac(&mut a, TX_BUF + VNET_HDR_LEN as u64 + 6);
            copy_mac(&mut a, TX_BUF + VNET_HDR_LEN as u64 + 22);
            a.mov(rdi, TX_AVAIL).unwrap();
            a.mov(word_ptr(rdi + 2), 1).unwrap();
            a.mov(dword_ptr(rbx + 0x50), 1).unwrap();
        }
        Mode::HostFrame => {
            a.mov(rdi, READY).unwrap();
            a.mov(dword_ptr(rdi), 1).unwrap();
        }
    }

    // Sleep until an interrupt announces a used receive buffer: the handler records the
    // receive ring's used index it saw. (Polling the used ring alone could see the buffer
    // before its interrupt arrives.) At most 16 wake-ups. `sti; hlt` is race-free: an
    // interrupt pending at `sti` is taken after the `hlt` starts.
    let mut wait = a.create_label();
    let mut got = a.create_label();
    a.mov(ecx, 16).unwrap();
    a.set_label(&mut wait).unwrap();
    a.mov(rdi, RX_USED_AT_IRQ).unwrap();
    a.cmp(word_ptr(rdi), 0).unwrap();
    a.jne(got).unwrap();
    a.sti().unwrap();
    a.hlt().unwrap();
    a.cli().unwrap();
    a.dec(ecx).unwrap();
    a.jnz(wait).unwrap();
    a.jmp(fail[8]).unwrap();
    a.set_label(&mut got).unwrap();
    // The interrupt said "used buffer".
    a.mov(rdi, IRQ_SEEN).unwrap();
    a.test(dword_ptr(rdi), 1).unwrap();
    a.jz(fail[9]).unwrap();
    // The first used element is buffer 0.
    a.mov(rdi, RX_USED).unwrap();
    a.cmp(dword_ptr(rdi + 4), 0).unwrap();
    a.jne(fail[10]).unwrap();
    // Its frame is addressed to the guest's MAC...
    a.mov(rsi, MAC_OUT).unwrap();
    a.mov(rdi, RX_BUF + VNET_HDR_LEN as u64).unwrap();
    a.mov(eax, dword_ptr(rdi)).unwrap();
    a.cmp(eax, dword_ptr(rsi)).unwrap();
    a.jne(fail[11]).unwrap();
    a.mov(ax, word_ptr(rdi + 4)).unwrap();
    a.cmp(ax, word_ptr(rsi + 4)).unwrap();
    a.jne(fail[11]).unwrap();
    match mode {
        Mode::ArpRequest => {
            // ...an ARP reply (ethertype 08 06, opcode 00 02)...
            a.cmp(word_ptr(rdi + 12), 0x0608).unwrap();
            a.jne(fail[12]).unwrap();
            a.cmp(word_ptr(rdi + 20), 0x0200).unwrap();
            a.jne(fail[12]).unwrap();
            // ...and the request went out as used transmit chain 1.
            a.mov(rdi, TX_USED).unwrap();
            a.cmp(word_ptr(rdi + 2), 1).unwrap();
            a.jne(fail[13]).unwrap();
        }
        Mode::HostFrame => {
            a.cmp(word_ptr(rdi + 12), u32::from(ETHERTYPE_TEST.swap_bytes()))
                .unwrap();
            a.jne(fail[12]).unwrap();
        }
    }
    print(&mut a, "virtio-net ok\n");
    done(&mut a, 0);

    for (code, mut l) in fail.into_iter().enumerate() {
        a.set_label(&mut l).unwrap();
        done(&mut a, code as u32);
    }

    // The interrupt handler: record and acknowledge InterruptStatus, record the receive
    // ring's used index, EOI.
    virtio_irq_handler(&mut a, &mut handler, MMIO, IRQ_SEEN, |a| {
        a.mov(rbx, RX_USED).unwrap();
        a.mov(ax, word_ptr(rbx + 2)).unwrap();
        a.mov(rbx, RX_USED_AT_IRQ).unwrap();
        a.mov(word_ptr(rbx), ax).unwrap();
    });
    a
}

// ---------------------------------------------------------------------------------------
// Host side: the VM.

fn vm_config(dir: &std::path::Path, tap: &str, mode: Mode) -> VmConfig {
    let mut a = net_guest(mode);
    let mut c = VmConfig::new(kernel_with(dir, &mut a, data_segments()));
    c.memory_mib = 32;
    c.serial_output = Some(dir.join("serial.log"));
    c.net = vec![NetConfig {
        id: "eth0".into(),
        tap: tap.into(),
        guest_mac: mac_str(&GUEST_MAC),
    }];
    c
}

/// The VM's own net device's counters, as `Vm::metrics` reports them.
fn net_counters(vm: &Vm) -> NetMetricsSnapshot {
    let m = vm.metrics();
    serde_json::from_value(m.devices["eth0"]["device"].clone())
        .unwrap_or_else(|e| panic!("the VM reports the net device's counters ({e}): {m:?}"))
}

fn read_guest(vm: &Vm, addr: u64, len: usize) -> Vec<u8> {
    let mut buf = vec![0u8; len];
    vm.guest_memory()
        .read_slice(&mut buf, GuestAddress(addr))
        .unwrap();
    buf
}

fn read_u16(vm: &Vm, addr: u64) -> u16 {
    vm.guest_memory()
        .read_obj::<u16>(GuestAddress(addr))
        .unwrap()
}

/// Used element `n` of the receive ring: (descriptor id, bytes written).
fn rx_used(vm: &Vm, n: u64) -> (u32, u32) {
    let e = read_guest(vm, RX_USED + 4 + 8 * n, 8);
    (
        u32::from_le_bytes(e[0..4].try_into().unwrap()),
        u32::from_le_bytes(e[4..8].try_into().unwrap()),
    )
}

/// Runs the guest to its end and checks that it reported success and read the configured
/// MAC from the config space.
fn expect_guest_ok(vm: &Vm, dir: &std::path::Path, started: Instant) {
    let (r, log) = run_to_end(vm, dir);
    let took = started.elapsed();
    assert_eq!(
        r,
        Some(ExitReason::Done(0)),
        "serial: {log:?}, device: {:?}",
        net_counters(vm)
    );
    assert_eq!(log, "virtio-net ok\n");
    println!("guest run: {took:?}");
    assert_eq!(read_guest(vm, MAC_OUT, 6), GUEST_MAC);
}

/// Waits for the guest to end; returns its exit and serial output.
fn run_to_end(vm: &Vm, dir: &std::path::Path) -> (Option<ExitReason>, String) {
    let r = vm.wait_timeout(Duration::from_secs(30));
    let log = std::fs::read_to_string(dir.join("serial.log")).unwrap_or_default();
    (r, log)
}

/// The device's transport saw one activation, no bad access, and every notification came
/// through the ioeventfds.
fn assert_transport_clean(vm: &Vm) {
    let m = vm.virtio_devices()[0].transport.lock().unwrap().metrics();
    assert_eq!(m.activations, 1, "{m:?}");
    assert_eq!(m.bad_accesses, 0, "{m:?}");
    assert_eq!(m.notifies, 0, "{m:?}");
}

// ---------------------------------------------------------------------------------------
// Tests.

#[test]
fn guest_arp_request_through_virtio_net_gets_the_kernels_reply() {
    if !kvm_available() {
        return;
    }
    const TAP: &str = "vnet-arp0";
    in_netns(TAP, HOST_CIDR, || {
        let dir = tempfile::tempdir().unwrap();
        assert!(
            !has_carrier(&link(TAP)),
            "nobody is attached to the tap yet"
        );
        let mut vm = Vm::new(vm_config(dir.path(), TAP, Mode::ArpRequest)).unwrap();
        // The device attached to the tap of this namespace (opening a missing name would
        // have created another tap instead).
        assert!(has_carrier(&link(TAP)), "the VM attached to {TAP}");
        assert!(
            vm.cmdline().contains("virtio_mmio.device=4K@0xd0000000:5"),
            "{}",
            vm.cmdline()
        );
        wait_tap_transmits(TAP);
        let sock = packet_socket(TAP, libc::ETH_P_ALL as u16);

        let started = Instant::now();
        vm.start().unwrap();
        expect_guest_ok(&vm, dir.path(), started);

        // On the tap: the guest's request exactly as built here, then the kernel's reply.
        let request = arp_request(GUEST_MAC, GUEST_IP, HOST_IP);
        let mut seen_request = false;
        let reply = loop {
            let f = recv_frame(&sock);
            if f == request {
                seen_request = true;
            } else if is_arp_reply(&f) {
                break f;
            }
        };
        assert!(seen_request, "the guest's ARP request crossed the tap");
        assert_arp_reply(&reply, GUEST_MAC, GUEST_IP, HOST_IP);

        // In guest memory: receive buffer 0 holds that reply behind a virtio-net header.
        assert!(read_u16(&vm, RX_USED + 2) >= 1);
        let (id, len) = rx_used(&vm, 0);
        assert_eq!(id, 0, "buffer 0 is used first");
        assert_eq!(len as usize, VNET_HDR_LEN + reply.len());
        let buf = read_guest(&vm, RX_BUF, len as usize);
        assert_eq!(&buf[..10], &[0; 10], "no offload in the header");
        assert_eq!(&buf[10..12], &1u16.to_le_bytes(), "num_buffers is 1");
        assert_eq!(&buf[VNET_HDR_LEN..], &reply[..]);
        assert_eq!(read_u16(&vm, TX_USED + 2), 1, "the request was used");

        let m = net_counters(&vm);
        assert_eq!(m.tx_packets, 1, "{m:?}");
        assert_eq!(m.tx_bytes, request.len() as u64, "{m:?}");
        assert!(m.rx_packets >= 1, "{m:?}");
        assert_eq!((m.tx_errors, m.rx_errors, m.rx_dropped), (0, 0, 0), "{m:?}");
        assert!(m.interrupts >= 1, "{m:?}");
        assert_transport_clean(&vm);
        assert_eq!(vm.stop().unwrap(), ExitReason::Done(0));
    });
}

#[test]
fn frame_written_to_the_tap_lands_in_the_guests_receive_buffer() {
    if !kvm_available() {
        return;
    }
    const TAP: &str = "vnet-rx0";
    in_netns(TAP, HOST_CIDR, || {
        let dir = tempfile::tempdir().unwrap();
        let mut vm = Vm::new(vm_config(dir.path(), TAP, Mode::HostFrame)).unwrap();
        assert!(has_carrier(&link(TAP)), "the VM attached to {TAP}");
        wait_tap_transmits(TAP);
        let sock = packet_socket(TAP, libc::ETH_P_ALL as u16);

        let started = Instant::now();
        vm.start().unwrap();
        // The guest has posted its receive buffers and is waiting.
        let ready = wait_until(Duration::from_secs(30), || {
            vm.guest_memory()
                .read_obj::<u32>(GuestAddress(READY))
                .unwrap()
                == 1
                || vm.wait_timeout(Duration::ZERO).is_some()
        });
        assert!(ready, "the guest never got ready");
        let frame = host_frame();
        send_frame(&sock, &frame);
        expect_guest_ok(&vm, dir.path(), started);
        let (id, len) = rx_used(&vm, 0);
        assert_eq!(id, 0, "buffer 0 is used first");
        assert_eq!(len as usize, VNET_HDR_LEN + frame.len());
        let buf = read_guest(&vm, RX_BUF, len as usize);
        assert_eq!(&buf[..10], &[0; 10], "no offload in the header");
        assert_eq!(&buf[10..12], &1u16.to_le_bytes(), "num_buffers is 1");
        assert_eq!(&buf[VNET_HDR_LEN..], &frame[..], "the frame arrived whole");
        let m = net_counters(&vm);
        assert!(m.rx_packets >= 1, "{m:?}");
        assert!(m.rx_bytes >= frame.len() as u64, "{m:?}");
        assert_eq!(m.tx_packets, 0, "the guest sent nothing: {m:?}");
        assert_eq!((m.rx_errors, m.rx_dropped), (0, 0), "{m:?}");
        assert_transport_clean(&vm);
        assert_eq!(vm.stop().unwrap(), ExitReason::Done(0));
    });
}
