//! The vCPU watchdog on guest programs: a guest stuck on a `VMMCALL` at CPL0 (which the
//! development machines' `kvm_pvm` never completes: `KVM_RUN` spins in the host) is
//! stopped with an error naming it, through the library and through the `agentenv-vmm`
//! process; a guest that computes without exits for many watchdog periods is kicked but
//! keeps running; pause and resume work with the watchdog on.
//!
//! On a host whose KVM completes the hypercall (real KVM answers an unknown one with
//! `-KVM_ENOSYS`), the `VMMCALL` guest goes on and ends by itself, and the tests check
//! that instead.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use agentenv_vmm::config::WatchdogConfig;
use agentenv_vmm::{ExitReason, Vm, VmConfig};
use common::*;
use iced_x86::code_asm::*;
use vm_memory::{Bytes, GuestAddress};

/// Bounds only meant to catch a hang.
const HANG: Duration = Duration::from_secs(60);

/// Where the counting guest counts, and the flag that ends it.
const COUNTER: u64 = 0x20_0000;
const STOP_FLAG: u64 = 0x20_0008;

/// Whether `/dev/kvm` is served by kvm_pvm (which never completes a VMMCALL at CPL0).
fn host_is_kvm_pvm() -> bool {
    Path::new("/sys/module/kvm_pvm").exists()
}

fn config(dir: &Path, kernel: PathBuf, period_ms: u64, timeout_ms: u64) -> VmConfig {
    let mut c = VmConfig::new(kernel);
    c.memory_mib = 32;
    c.serial_output = Some(dir.join("serial.log"));
    c.watchdog = WatchdogConfig {
        period_ms,
        timeout_ms,
    };
    c
}

fn serial(dir: &Path) -> String {
    std::fs::read_to_string(dir.join("serial.log")).unwrap_or_default()
}

/// Prints `A`, then `VMMCALL` (at CPL0; `rip` 0x10000a), then prints `B` and ends with 0.
fn vmmcall_guest(dir: &Path) -> PathBuf {
    let mut a = asm64();
    print(&mut a, "A\n");
    a.db(&[0x0f, 0x01, 0xd9]).unwrap();
    print(&mut a, "B\n");
    done(&mut a, 0);
    kernel(dir, &mut a)
}

const VMMCALL_RIP: u64 = ENTRY + 0xa;

/// The watchdog's message for [`vmmcall_guest`] with a 1 s timeout. The instruction it
/// names is the one in guest memory: kvm_pvm patches the guest's `VMMCALL` into the
/// `VMCALL` it calls native (KVM's hypercall patching) before spinning on it.
fn assert_stuck_message(msg: &str) {
    let expected = |insn: &str| {
        format!(
            "vCPU 0 is stuck on a hypercall instruction ({insn}) at rip {VMMCALL_RIP:#x}: no progress for 1s (the host's KVM does not complete hypercalls from guest kernel mode, e.g. a VMMCALL under kvm_pvm); the VM was stopped"
        )
    };
    assert!(
        msg == expected("VMMCALL") || msg == expected("VMCALL"),
        "{msg}"
    );
}

/// Counts at [`COUNTER`] without any exit until the test sets [`STOP_FLAG`], then ends
/// with 0.
fn counting_guest(dir: &Path) -> PathBuf {
    let mut a = asm64();
    a.mov(rdi, COUNTER).unwrap();
    let mut l = a.create_label();
    a.set_label(&mut l).unwrap();
    a.inc(qword_ptr(rdi)).unwrap();
    a.cmp(qword_ptr(rdi + 8), 0).unwrap();
    a.je(l).unwrap();
    done(&mut a, 0);
    kernel(dir, &mut a)
}

fn read_u64(vm: &Vm, addr: u64) -> u64 {
    vm.guest_memory().read_obj(GuestAddress(addr)).unwrap()
}

#[test]
fn a_guest_stuck_on_vmmcall_is_stopped_with_an_error_naming_it() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut vm = Vm::new(config(dir.path(), vmmcall_guest(dir.path()), 100, 1000)).unwrap();
    vm.start().unwrap();
    let reason = vm
        .wait_timeout(HANG)
        .unwrap_or_else(|| panic!("the VM still runs after {HANG:?}: {}", serial(dir.path())));
    if !host_is_kvm_pvm() {
        println!("this host's KVM completes the VMMCALL: the guest goes on");
        assert_eq!(reason, ExitReason::Done(0));
        assert_eq!(serial(dir.path()), "A\nB\n");
        return;
    }
    let ExitReason::Error(msg) = &reason else {
        panic!("{reason:?}");
    };
    assert_stuck_message(msg);
    assert_eq!(serial(dir.path()), "A\n");
    // The VM is over: pause is refused, stop returns the watchdog's reason at once.
    assert!(vm.pause().is_err());
    let t = Instant::now();
    assert_eq!(vm.stop().unwrap(), reason);
    assert!(t.elapsed() < HANG);
    assert_eq!(vm.metrics().exits_io_out, 2, "no exit after the VMMCALL");
}

#[test]
fn a_guest_computing_without_exits_for_many_periods_is_kicked_and_keeps_running() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    // A short period (many kicks), a long timeout (a loaded CI machine is no reason to
    // stop a healthy guest).
    let mut vm = Vm::new(config(dir.path(), counting_guest(dir.path()), 20, 10_000)).unwrap();
    vm.start().unwrap();
    // Each watchdog kick shows as one interrupted exit; the guest makes no other.
    let deadline = Instant::now() + HANG;
    while vm.metrics().exits_interrupted < 10 {
        assert!(Instant::now() < deadline, "the watchdog does not kick");
        assert_eq!(vm.wait_timeout(Duration::from_millis(10)), None);
    }
    let m = vm.metrics();
    assert_eq!((m.exits_io_out, m.exits_mmio_write), (0, 0));
    // Still counting after the kicks.
    let before = read_u64(&vm, COUNTER);
    assert!(wait_until(HANG, || read_u64(&vm, COUNTER) > before + 100));
    assert_eq!(vm.wait_timeout(Duration::ZERO), None);
    vm.guest_memory()
        .write_obj(1u64, GuestAddress(STOP_FLAG))
        .unwrap();
    assert_eq!(vm.wait_timeout(HANG), Some(ExitReason::Done(0)));
    assert_eq!(vm.stop().unwrap(), ExitReason::Done(0));
}

#[test]
fn pause_and_resume_work_with_the_watchdog_on() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut vm = Vm::new(config(dir.path(), counting_guest(dir.path()), 20, 5000)).unwrap();
    vm.start().unwrap();
    let deadline = Instant::now() + HANG;
    while vm.metrics().exits_interrupted < 3 {
        assert!(Instant::now() < deadline, "the watchdog does not kick");
        assert_eq!(vm.wait_timeout(Duration::from_millis(10)), None);
    }
    vm.pause().unwrap();
    let parked = read_u64(&vm, COUNTER);
    let kicks = vm.metrics().exits_interrupted;
    // Parked for many periods: the watchdog neither kicks nor stops it.
    assert_eq!(vm.wait_timeout(Duration::from_millis(1000)), None);
    assert_eq!(vm.metrics().exits_interrupted, kicks);
    assert_eq!(read_u64(&vm, COUNTER), parked);
    let regs = vm.vcpu_regs(0).unwrap();
    assert!(
        (ENTRY..ENTRY + 0x20).contains(&regs.rip),
        "rip {:#x}",
        regs.rip
    );
    vm.resume().unwrap();
    assert!(wait_until(HANG, || read_u64(&vm, COUNTER) > parked + 100));
    let deadline = Instant::now() + HANG;
    while vm.metrics().exits_interrupted < kicks + 3 {
        assert!(Instant::now() < deadline, "the watchdog stopped kicking");
        assert_eq!(vm.wait_timeout(Duration::from_millis(10)), None);
    }
    vm.guest_memory()
        .write_obj(1u64, GuestAddress(STOP_FLAG))
        .unwrap();
    assert_eq!(vm.wait_timeout(HANG), Some(ExitReason::Done(0)));
    assert_eq!(vm.stop().unwrap(), ExitReason::Done(0));
    assert_eq!(vm.metrics().pauses, 1);
}

#[test]
fn the_vmm_process_reports_a_stuck_guest_and_exits_non_zero() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let c = config(dir.path(), vmmcall_guest(dir.path()), 100, 1000);
    let vm_json = dir.path().join("vm.json");
    std::fs::write(&vm_json, serde_json::to_vec(&c).unwrap()).unwrap();
    let log = dir.path().join("vmm.log");
    let sock = dir.path().join("api.sock");
    let mut child = Command::new(env!("CARGO_BIN_EXE_agentenv-vmm"))
        .arg("--config")
        .arg(&vm_json)
        .arg("--api-sock")
        .arg(&sock)
        .args(["--start", "--log-file"])
        .arg(&log)
        .stdin(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + HANG;
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the VMM did not exit within {HANG:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
    let log = std::fs::read_to_string(&log).unwrap();
    if !host_is_kvm_pvm() {
        println!("this host's KVM completes the VMMCALL: the guest goes on");
        assert!(status.success(), "{status}: {stderr}");
        return;
    }
    assert_eq!(status.code(), Some(2), "{stderr}");
    let msg = stderr
        .trim_end()
        .strip_prefix("agentenv-vmm: the guest failed: ")
        .unwrap_or_else(|| panic!("{stderr}"));
    assert_stuck_message(msg);
    assert!(
        log.lines()
            .any(|l| l.contains("ERROR") && l.contains("the guest failed") && l.contains(msg)),
        "{log}"
    );
    assert!(!sock.exists(), "the socket is removed on exit");
}
