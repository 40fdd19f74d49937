//! A guest program drives virtio-blk through the virtio-mmio transport of a real VM:
//! checks magic/version/device id, negotiates VERSION_1, sets up queue 0, writes sector 1,
//! reads sectors 1..2 back and compares them, and takes the used-buffer interrupt each
//! time.
//!
//! Interrupt path: the device's irqfd raises GSI 5; the guest has programmed the in-kernel
//! IOAPIC pin 5 to vector 0x30 for APIC 0, software-enabled its LAPIC and installed an IDT
//! gate, so the interrupt reaches the guest's handler, which reads and acknowledges
//! `InterruptStatus` and sends the EOI. (It masks the legacy PIC first: the irqfd raises PIC
//! line 5 as well, and the BSP's LINT0 takes ExtINT.) The guest waits with `sti; hlt` (the in-kernel
//! LAPIC wakes it) and checks that the handler saw a used-ring interrupt.

mod common;
mod support;

use std::time::Duration;

use agentenv_vmm::config::DriveConfig;
use agentenv_vmm::{ExitReason, SnapshotKind, Vm, VmConfig};
use common::*;
use iced_x86::code_asm::*;
use support::setup_queue;
use vm_memory::{Bytes, GuestAddress};

const MMIO: u64 = 0xd000_0000;
const DESC: u64 = 0x50_0000;
const AVAIL: u64 = 0x50_1000;
const USED: u64 = 0x50_2000;
const HDR: u64 = 0x50_3000;
const WDATA: u64 = 0x50_4000;
const STATUS: u64 = 0x50_5000;
const RDATA: u64 = 0x50_6000;
const IDT: u64 = 0x60_0000;
const IDTR: u64 = 0x60_1000;
const IRQ_SEEN: u64 = 0x60_2000;
const VECTOR: u64 = 0x30;
const READY: u64 = 0x60_3000;
const GO: u64 = 0x60_4000;
const PATTERN: u64 = u64::from_le_bytes(*b"agentenv");
const HOSTDATA: u64 = u64::from_le_bytes(*b"hostdata");

/// Fails the guest with `code` unless the flags say equal.
fn expect_eq(a: &mut CodeAssembler, fail: &mut [CodeLabel], code: usize) {
    a.jne(fail[code]).unwrap();
}

/// Fills descriptor `i`.
fn desc(a: &mut CodeAssembler, i: u64, addr: u64, len: u32, flags: u16, next: u16) {
    a.mov(rdi, DESC + i * 16).unwrap();
    a.mov(rax, addr).unwrap();
    a.mov(qword_ptr(rdi), rax).unwrap();
    a.mov(dword_ptr(rdi + 8), len).unwrap();
    a.mov(word_ptr(rdi + 12), flags as u32).unwrap();
    a.mov(word_ptr(rdi + 14), next as u32).unwrap();
}

/// Publishes chain 0 as avail entry `n`, notifies queue 0 and sleeps until the interrupt.
fn submit_and_wait(a: &mut CodeAssembler, n: u16, fail: &mut [CodeLabel]) {
    a.mov(rdi, IRQ_SEEN).unwrap();
    a.mov(dword_ptr(rdi), 0).unwrap();
    a.mov(rdi, AVAIL).unwrap();
    a.mov(word_ptr(rdi + 4 + 2 * n as usize), 0).unwrap();
    a.mov(word_ptr(rdi + 2), (n + 1) as u32).unwrap();
    a.mov(rbx, MMIO).unwrap();
    a.mov(dword_ptr(rbx + 0x50), 0).unwrap();
    // `sti; hlt` is race-free: an interrupt pending at `sti` is taken after the `hlt`
    // starts, and wakes it.
    a.sti().unwrap();
    a.hlt().unwrap();
    a.cli().unwrap();
    a.mov(rdi, IRQ_SEEN).unwrap();
    a.test(dword_ptr(rdi), 1).unwrap();
    a.jz(fail[9]).unwrap();
    a.mov(rdi, USED).unwrap();
    a.cmp(word_ptr(rdi + 2), (n + 1) as u32).unwrap();
    expect_eq(a, fail, 10);
    a.mov(rdi, STATUS).unwrap();
    a.cmp(byte_ptr(rdi), 0).unwrap();
    expect_eq(a, fail, 11);
}

/// With `checkpoint`, the guest raises READY after the write and waits for GO before
/// reading back (the host snapshots and restores it in between).
fn blk_guest(checkpoint: bool) -> CodeAssembler {
    let mut a = asm64();
    let mut fail: Vec<CodeLabel> = (0..16).map(|_| a.create_label()).collect();
    let mut handler = a.create_label();

    // Identify the device.
    a.mov(rbx, MMIO).unwrap();
    a.cmp(dword_ptr(rbx), 0x7472_6976).unwrap();
    expect_eq(&mut a, &mut fail, 1);
    a.cmp(dword_ptr(rbx + 0x4), 2).unwrap();
    expect_eq(&mut a, &mut fail, 2);
    a.cmp(dword_ptr(rbx + 0x8), 2).unwrap();
    expect_eq(&mut a, &mut fail, 3);
    // Reset, ACKNOWLEDGE, DRIVER.
    a.mov(dword_ptr(rbx + 0x70), 0).unwrap();
    a.mov(dword_ptr(rbx + 0x70), 1).unwrap();
    a.mov(dword_ptr(rbx + 0x70), 3).unwrap();
    // Features: VERSION_1 (bit 32) must be offered; take only it.
    a.mov(dword_ptr(rbx + 0x14), 1).unwrap();
    a.mov(eax, dword_ptr(rbx + 0x10)).unwrap();
    a.test(eax, 1).unwrap();
    a.jz(fail[4]).unwrap();
    a.mov(dword_ptr(rbx + 0x24), 1).unwrap();
    a.mov(dword_ptr(rbx + 0x20), 1).unwrap();
    a.mov(dword_ptr(rbx + 0x24), 0).unwrap();
    a.mov(dword_ptr(rbx + 0x20), 0).unwrap();
    a.mov(dword_ptr(rbx + 0x70), 0xb).unwrap();
    a.test(dword_ptr(rbx + 0x70), 8).unwrap();
    a.jz(fail[5]).unwrap();
    // Queue 0: 8 entries.
    setup_queue(&mut a, 0, 8, DESC, AVAIL, USED, fail[6]);
    a.mov(dword_ptr(rbx + 0x70), 0xf).unwrap();
    a.test(dword_ptr(rbx + 0x70), 0x40).unwrap(); // DEVICE_NEEDS_RESET
    a.jnz(fail[7]).unwrap();

    // Interrupts: IOAPIC pin 5 → VECTOR → `handler`.
    route_irq(&mut a, handler, IDT, IDTR, VECTOR, 5);

    // Request 1: write PATTERN × 64 to sector 1.
    a.mov(rdi, WDATA).unwrap();
    a.mov(rax, PATTERN).unwrap();
    a.mov(ecx, 64).unwrap();
    a.rep().stosq().unwrap();
    a.mov(rdi, HDR).unwrap();
    a.mov(dword_ptr(rdi), 1).unwrap(); // VIRTIO_BLK_T_OUT
    a.mov(dword_ptr(rdi + 4), 0).unwrap();
    a.mov(qword_ptr(rdi + 8), 1).unwrap();
    a.mov(rdi, STATUS).unwrap();
    a.mov(byte_ptr(rdi), 0xff).unwrap();
    desc(&mut a, 0, HDR, 16, 1, 1);
    desc(&mut a, 1, WDATA, 512, 1, 2);
    desc(&mut a, 2, STATUS, 1, 2, 0);
    submit_and_wait(&mut a, 0, &mut fail);

    if checkpoint {
        signal_and_wait(&mut a, READY, GO);
    }

    // Request 2: read sectors 1 and 2.
    a.mov(rdi, HDR).unwrap();
    a.mov(dword_ptr(rdi), 0).unwrap(); // VIRTIO_BLK_T_IN
    a.mov(rdi, STATUS).unwrap();
    a.mov(byte_ptr(rdi), 0xff).unwrap();
    desc(&mut a, 1, RDATA, 1024, 3, 2);
    submit_and_wait(&mut a, 1, &mut fail);
    a.mov(rsi, WDATA).unwrap();
    a.mov(rdi, RDATA).unwrap();
    a.mov(ecx, 64).unwrap();
    a.repe().cmpsq().unwrap();
    expect_eq(&mut a, &mut fail, 12);
    a.mov(rdi, RDATA + 512).unwrap();
    a.mov(rax, HOSTDATA).unwrap();
    a.cmp(qword_ptr(rdi), rax).unwrap();
    expect_eq(&mut a, &mut fail, 13);
    print(&mut a, "virtio-blk ok\n");
    done(&mut a, 0);

    for (code, l) in fail.iter_mut().enumerate() {
        a.set_label(l).unwrap();
        done(&mut a, code as u32);
    }

    // The interrupt handler: record and acknowledge InterruptStatus, EOI.
    virtio_irq_handler(&mut a, &mut handler, MMIO, IRQ_SEEN, |_| {});
    a
}

fn disk_image(dir: &std::path::Path) -> (std::path::PathBuf, Vec<u8>) {
    let image = dir.join("disk.img");
    let mut disk = vec![0u8; 8 * 512];
    disk[..8].copy_from_slice(b"sector 0");
    disk[512..520].copy_from_slice(b"oldbytes");
    for chunk in disk[1024..1536].chunks_mut(8) {
        chunk.copy_from_slice(b"hostdata");
    }
    std::fs::write(&image, &disk).unwrap();
    (image, disk)
}

fn blk_config(dir: &std::path::Path, image: &std::path::Path, checkpoint: bool) -> VmConfig {
    let mut a = blk_guest(checkpoint);
    let mut c = VmConfig::new(kernel(dir, &mut a));
    c.memory_mib = 32;
    c.serial_output = Some(dir.join("serial.log"));
    c.drives = vec![DriveConfig {
        id: "rootfs".into(),
        path: image.to_path_buf(),
        read_only: false,
        is_root: true,
    }];
    c
}

fn check_image(image: &std::path::Path, disk: &[u8]) {
    let after = std::fs::read(image).unwrap();
    assert_eq!(&after[..512], &disk[..512]);
    assert!(after[512..1024].chunks(8).all(|c| c == b"agentenv"));
    assert_eq!(&after[1024..], &disk[1024..]);
}

#[test]
fn guest_writes_and_reads_sectors_through_virtio_blk_with_interrupts() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (image, disk) = disk_image(dir.path());
    let mut vm = Vm::new(blk_config(dir.path(), &image, false)).unwrap();
    assert!(
        vm.cmdline()
            .contains("root=/dev/vda rw console=ttyS0 reboot=k panic=1 pci=off virtio_mmio.device=4K@0xd0000000:5"),
        "{}",
        vm.cmdline()
    );
    vm.start().unwrap();
    let r = vm.wait_timeout(Duration::from_secs(30));
    let transport = vm.virtio_devices()[0].transport.lock().unwrap().metrics();
    vm.stop().unwrap();
    let log = std::fs::read_to_string(dir.path().join("serial.log")).unwrap();
    assert_eq!(r, Some(ExitReason::Done(0)), "serial: {log:?}");
    assert_eq!(log, "virtio-blk ok\n");
    // Both notifications went through the queue's ioeventfd, none through the MMIO exit.
    assert_eq!(transport.notifies, 0, "{transport:?}");
    assert_eq!(transport.activations, 1);
    assert_eq!(transport.bad_accesses, 0);

    // The image holds what the guest wrote, and nothing else changed.
    check_image(&image, &disk);
}

/// The device is active with a used request when the VM is snapshotted; the restored VM
/// (a fresh process state: new transport, new device, new irqfd) re-attaches it and the
/// guest's next request completes with an interrupt, as if nothing happened.
#[test]
fn virtio_blk_keeps_working_across_snapshot_and_restore() {
    if !kvm_available() {
        return;
    }
    let dir = scratch();
    let (image, disk) = disk_image(dir.path());
    let config = blk_config(dir.path(), &image, true);
    let mut vm = Vm::new(config.clone()).unwrap();
    vm.start().unwrap();
    let ready = |vm: &Vm| {
        vm.guest_memory()
            .read_obj::<u64>(GuestAddress(READY))
            .unwrap()
            == 1
    };
    assert!(wait_until(Duration::from_secs(30), || ready(&vm)));
    vm.pause().unwrap();
    let snap = dir.path().join("snap");
    vm.snapshot(&snap, SnapshotKind::Full).unwrap();
    vm.stop().unwrap();
    drop(vm);

    let vm = Vm::restore(config, &snap).unwrap();
    vm.guest_memory().write_obj(1u64, GuestAddress(GO)).unwrap();
    vm.resume().unwrap();
    let r = vm.wait_timeout(Duration::from_secs(30));
    let log = std::fs::read_to_string(dir.path().join("serial.log")).unwrap();
    assert_eq!(r, Some(ExitReason::Done(0)), "serial: {log:?}");
    assert_eq!(log, "virtio-blk ok\n");
    check_image(&image, &disk);
}
