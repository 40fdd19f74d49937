//! Snapshot and restore of running guest programs: a counting guest continues from its
//! saved count in a fresh VM; a diff snapshot holds only the pages the guest dirtied;
//! snapshots from another format version, CPU or with a corrupted state are refused.

mod common;
mod support;

use std::path::Path;
use std::time::Duration;

use agentenv_vmm::snapshot::{self, MEMORY_FILE, STATE_FILE};
use agentenv_vmm::{ExitReason, SnapshotKind, Vm, VmConfig};
use common::*;
use support::{smp_kernel, start_ap};
use vm_memory::{Bytes, GuestAddress};

const TIMEOUT: Duration = Duration::from_secs(30);
const COUNTER: u64 = 0x20_0000;
const TARGET: u64 = 200_000;

fn read_u64(vm: &Vm, addr: u64) -> u64 {
    vm.guest_memory()
        .read_obj::<u64>(GuestAddress(addr))
        .unwrap()
}

/// Counts `[COUNTER]` up to `TARGET` at CPL0, then ends with status 0.
fn counting_guest(dir: &Path) -> VmConfig {
    let mut a = asm64();
    let mut l = a.create_label();
    a.mov(rdi, COUNTER).unwrap();
    a.set_label(&mut l).unwrap();
    a.inc(qword_ptr(rdi)).unwrap();
    a.cmp(qword_ptr(rdi), TARGET as i32).unwrap();
    a.jb(l).unwrap();
    print(&mut a, "counted\n");
    done(&mut a, 0);
    let mut c = VmConfig::new(kernel(dir, &mut a));
    c.memory_mib = 32;
    c.serial_output = Some(dir.join("serial.log"));
    c
}

use iced_x86::code_asm::*;

#[test]
fn counting_guest_snapshotted_while_running_continues_in_a_fresh_vm() {
    if !kvm_available() {
        return;
    }
    let dir = scratch();
    let snap = dir.path().join("snap");
    let config = counting_guest(dir.path());

    let mut vm = Vm::new(config.clone()).unwrap();
    vm.start().unwrap();
    assert!(wait_until(TIMEOUT, || read_u64(&vm, COUNTER) >= 1000));
    vm.pause().unwrap();
    let saved = read_u64(&vm, COUNTER);
    assert!(saved < TARGET, "the guest finished before the snapshot");
    let rip = vm.vcpu_regs(0).unwrap().rip;
    let info = vm.snapshot(&snap, SnapshotKind::Full).unwrap();
    assert_eq!(info.memory_bytes, 32 << 20);
    // Every page is in the file; pages the guest never touched are holes.
    assert!(info.pages_written > 0 && info.pages_written < (32 << 20) / 4096);
    assert_eq!(
        std::fs::metadata(snap.join(MEMORY_FILE)).unwrap().len(),
        32 << 20
    );
    assert_eq!(vm.stop().unwrap(), ExitReason::Stopped);
    drop(vm);

    // A restore reads no kernel: the guest is in the snapshot's memory.
    std::fs::remove_file(&config.kernel).unwrap();
    let vm = Vm::restore(config, &snap).unwrap();
    // Restored exactly where it was, paused.
    assert_eq!(read_u64(&vm, COUNTER), saved);
    assert_eq!(vm.vcpu_regs(0).unwrap().rip, rip);
    vm.resume().unwrap();
    assert!(wait_until(TIMEOUT, || read_u64(&vm, COUNTER) > saved + 100));
    assert_eq!(vm.wait_timeout(TIMEOUT), Some(ExitReason::Done(0)));
    assert_eq!(read_u64(&vm, COUNTER), TARGET);
    let log = std::fs::read_to_string(dir.path().join("serial.log")).unwrap();
    assert_eq!(log, "counted\n");
    // The memory file was mapped privately: the guest's writes did not reach it.
    let file = std::fs::read(snap.join(MEMORY_FILE)).unwrap();
    let at = COUNTER as usize;
    assert_eq!(
        u64::from_le_bytes(file[at..at + 8].try_into().unwrap()),
        saved
    );
}

const READY: u64 = 0x30_0000;
const GO: u64 = 0x30_1000;
const READY2: u64 = 0x30_2000;
const PAGES: u64 = 0x40_0000;
const N_PAGES: u64 = 8;

/// Raises READY, waits for GO, writes `N_PAGES` pages at `PAGES`, raises READY2, spins.
fn dirtying_guest(dir: &Path) -> VmConfig {
    let mut a = asm64();
    signal_and_wait(&mut a, READY, GO);
    a.mov(rdi, PAGES).unwrap();
    a.mov(ecx, N_PAGES as u32).unwrap();
    let mut l = a.create_label();
    a.set_label(&mut l).unwrap();
    a.mov(qword_ptr(rdi), rdi).unwrap();
    a.add(rdi, 0x1000).unwrap();
    a.dec(ecx).unwrap();
    a.jnz(l).unwrap();
    a.mov(rdi, READY2).unwrap();
    a.mov(qword_ptr(rdi), 1).unwrap();
    let mut spin = a.create_label();
    a.set_label(&mut spin).unwrap();
    a.pause().unwrap();
    a.jmp(spin).unwrap();
    let mut c = VmConfig::new(kernel(dir, &mut a));
    c.memory_mib = 32;
    c.track_dirty_pages = true;
    c
}

#[test]
fn diff_snapshot_holds_only_the_pages_the_guest_dirtied() {
    if !kvm_available() {
        return;
    }
    let dir = scratch();
    let full = dir.path().join("full");
    let diff = dir.path().join("diff");
    let config = dirtying_guest(dir.path());
    let mut vm = Vm::new(config.clone()).unwrap();
    // Without a previous snapshot there is nothing to diff against.
    let e = vm.snapshot(&diff, SnapshotKind::Diff).unwrap_err();
    assert!(e.to_string().contains("take a full one first"), "{e}");

    vm.start().unwrap();
    assert!(wait_until(TIMEOUT, || read_u64(&vm, READY) == 1));
    vm.pause().unwrap();
    vm.snapshot(&full, SnapshotKind::Full).unwrap();
    // The host raises GO (a device-style write: tracked in the memory bitmap).
    vm.guest_memory().write_obj(1u64, GuestAddress(GO)).unwrap();
    vm.resume().unwrap();
    assert!(wait_until(TIMEOUT, || read_u64(&vm, READY2) == 1));
    vm.pause().unwrap();
    let info = vm.snapshot(&diff, SnapshotKind::Diff).unwrap();
    vm.stop().unwrap();

    let state = std::fs::read(diff.join(STATE_FILE)).unwrap();
    assert!(!state.is_empty());
    use agentenv_vmm::hypervisor::Hypervisor;
    let host = agentenv_vmm::arch::cpuid::cpu_model(
        &agentenv_vmm::hypervisor::kvm::KvmHypervisor::new()
            .unwrap()
            .supported_cpuid()
            .unwrap(),
    );
    let pages = snapshot::diff_pages(&diff, &host).unwrap().unwrap();
    assert_eq!(info.pages_written, pages.len() as u64);
    let mut must: Vec<u64> = (0..N_PAGES).map(|i| PAGES / 4096 + i).collect();
    must.push(GO / 4096);
    must.push(READY2 / 4096);
    for p in &must {
        assert!(pages.contains(p), "page {p:#x} missing from {pages:x?}");
    }
    // Besides those, only what the CPU itself wrote may appear: the boot page tables
    // (accessed/dirty bits, 0x9000..0xf000) and the stack page (0x8000).
    let allowed = |p: &u64| must.contains(p) || (0x8..0xf).contains(p);
    assert!(pages.iter().all(allowed), "unexpected pages in {pages:x?}");
    assert!(
        !pages.contains(&(READY / 4096)),
        "READY was written before the full snapshot"
    );

    // The diff directory restores on its own: base pages plus the dirtied ones.
    let mem = std::fs::read(diff.join(MEMORY_FILE)).unwrap();
    for i in 0..N_PAGES {
        let at = (PAGES + i * 0x1000) as usize;
        assert_eq!(
            u64::from_le_bytes(mem[at..at + 8].try_into().unwrap()),
            PAGES + i * 0x1000
        );
    }
    let at = READY as usize;
    assert_eq!(u64::from_le_bytes(mem[at..at + 8].try_into().unwrap()), 1);
    let vm = Vm::restore(config, &diff).unwrap();
    assert_eq!(read_u64(&vm, READY2), 1);
    assert_eq!(read_u64(&vm, PAGES + 0x7000), PAGES + 0x7000);

    // A restored VM diffs against the snapshot it came from: one page written by the
    // host, nothing run, so the next diff holds exactly that page over a copy of `diff`.
    const MARK: u64 = 0x70_0000;
    vm.guest_memory()
        .write_obj(0xfeed_u64, GuestAddress(MARK))
        .unwrap();
    let diff2 = dir.path().join("diff2");
    let info = vm.snapshot(&diff2, SnapshotKind::Diff).unwrap();
    assert_eq!(info.pages_written, 1);
    assert_eq!(
        snapshot::diff_pages(&diff2, &host).unwrap().unwrap(),
        vec![MARK / 4096]
    );
    let mem2 = std::fs::read(diff2.join(MEMORY_FILE)).unwrap();
    let at = MARK as usize;
    assert_eq!(
        u64::from_le_bytes(mem2[at..at + 8].try_into().unwrap()),
        0xfeed
    );
    let at = (PAGES + 0x7000) as usize;
    assert_eq!(
        u64::from_le_bytes(mem2[at..at + 8].try_into().unwrap()),
        PAGES + 0x7000
    );
    // The source snapshot is untouched.
    let mem = std::fs::read(diff.join(MEMORY_FILE)).unwrap();
    let at = MARK as usize;
    assert_eq!(&mem[at..at + 8], &[0; 8]);
}

fn snapshot_of_a_running_guest(dir: &Path) -> (VmConfig, std::path::PathBuf) {
    let snap = dir.join("snap");
    let config = counting_guest(dir);
    let mut vm = Vm::new(config.clone()).unwrap();
    vm.start().unwrap();
    assert!(wait_until(TIMEOUT, || read_u64(&vm, COUNTER) >= 10));
    vm.pause().unwrap();
    vm.snapshot(&snap, SnapshotKind::Full).unwrap();
    vm.stop().unwrap();
    (config, snap)
}

#[test]
fn restore_refuses_other_versions_other_cpus_and_corrupted_state() {
    if !kvm_available() {
        return;
    }
    let dir = scratch();
    let (config, snap) = snapshot_of_a_running_guest(dir.path());
    let state_path = snap.join(STATE_FILE);
    let good = std::fs::read(&state_path).unwrap();
    let err = |config: &VmConfig| {
        Vm::restore(config.clone(), &snap)
            .err()
            .unwrap()
            .to_string()
    };

    // Another format version.
    let mut b = good.clone();
    b[8..12].copy_from_slice(&(snapshot::FORMAT_VERSION + 1).to_le_bytes());
    std::fs::write(&state_path, &b).unwrap();
    let e = err(&config);
    assert!(e.contains("format version"), "{e}");

    // Another CPU model: rewrite the body's CPU and re-seal the checksum, as a snapshot
    // taken on another host would be.
    let body_len = u64::from_le_bytes(good[12..20].try_into().unwrap()) as usize;
    let body: serde_json::Value = serde_json::from_slice(&good[20..20 + body_len]).unwrap();
    let mut other = body.clone();
    other["cpu"]["model"] = serde_json::json!(other["cpu"]["model"].as_u64().unwrap() ^ 0x1);
    let other = serde_json::to_vec(&other).unwrap();
    let mut b = good[..12].to_vec();
    b.extend_from_slice(&(other.len() as u64).to_le_bytes());
    b.extend_from_slice(&other);
    use sha2::Digest;
    let d = sha2::Sha256::digest(&b);
    b.extend_from_slice(&d);
    std::fs::write(&state_path, &b).unwrap();
    let e = err(&config);
    assert!(e.contains("restore it on a host with the same CPU"), "{e}");

    // A flipped byte.
    let mut b = good.clone();
    let mid = 20 + body_len / 2;
    b[mid] ^= 0x20;
    std::fs::write(&state_path, &b).unwrap();
    let e = err(&config);
    assert!(e.contains("corrupted"), "{e}");

    // Truncated state, truncated memory.
    std::fs::write(&state_path, &good[..good.len() / 2]).unwrap();
    assert!(err(&config).contains("truncated"));
    std::fs::write(&state_path, &good).unwrap();
    let m = std::fs::OpenOptions::new()
        .write(true)
        .open(snap.join(MEMORY_FILE))
        .unwrap();
    m.set_len(16 << 20).unwrap();
    assert!(err(&config).contains("truncated"));
    m.set_len(32 << 20).unwrap();

    // A configuration that does not match the snapshot.
    let mut bigger = config.clone();
    bigger.memory_mib = 64;
    assert!(err(&bigger).contains("does not match"));

    // And the untouched snapshot still restores.
    Vm::restore(config, &snap).unwrap();
}

/// Two vCPUs both running when snapshotted (the AP in real mode after INIT/SIPI, the BSP in
/// long mode) both continue in the restored VM: per-vCPU registers, segments and MP state
/// are restored for each.
#[test]
fn smp_guest_with_both_vcpus_counting_continues_after_restore() {
    if !kvm_available() {
        return;
    }
    const AP_COUNT: u64 = 0x3800;
    const BSP_COUNT: u64 = 0x20_0000;
    let dir = scratch();

    let mut ap = CodeAssembler::new(16).unwrap();
    ap.xor(ax, ax).unwrap();
    ap.mov(ds, ax).unwrap();
    let mut l = ap.create_label();
    ap.set_label(&mut l).unwrap();
    ap.inc(dword_ptr(AP_COUNT)).unwrap();
    ap.jmp(l).unwrap();

    let mut a = asm64();
    start_ap(&mut a);
    a.mov(rdi, BSP_COUNT).unwrap();
    let mut l = a.create_label();
    a.set_label(&mut l).unwrap();
    a.inc(qword_ptr(rdi)).unwrap();
    a.jmp(l).unwrap();
    let mut config = VmConfig::new(smp_kernel(dir.path(), &mut a, &mut ap));
    config.vcpus = 2;
    config.memory_mib = 32;

    let counts = |vm: &Vm| {
        let ap = vm
            .guest_memory()
            .read_obj::<u32>(GuestAddress(AP_COUNT))
            .unwrap();
        (read_u64(vm, BSP_COUNT), u64::from(ap))
    };
    let mut vm = Vm::new(config.clone()).unwrap();
    vm.start().unwrap();
    assert!(wait_until(TIMEOUT, || {
        let (b, a) = counts(&vm);
        b > 100 && a > 100
    }));
    vm.pause().unwrap();
    let saved = counts(&vm);
    let snap = dir.path().join("snap");
    vm.snapshot(&snap, SnapshotKind::Full).unwrap();
    vm.stop().unwrap();
    drop(vm);

    let vm = Vm::restore(config, &snap).unwrap();
    assert_eq!(counts(&vm), saved);
    vm.resume().unwrap();
    assert!(
        wait_until(TIMEOUT, || {
            let (b, a) = counts(&vm);
            b > saved.0 + 100 && a > saved.1 + 100
        }),
        "saved {saved:?}, now {:?}",
        counts(&vm)
    );
}
