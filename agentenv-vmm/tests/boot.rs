//! Guest programs booted through the whole VMM: config validation, memory, the ELF loader,
//! 64-bit boot state, vCPU threads, the UART, the i8042 reset, the debug-exit port, SMP
//! with the MP table.

mod common;
mod support;

use std::time::Duration;

use agentenv_vmm::{ExitReason, Vm, VmConfig};
use common::*;
use iced_x86::code_asm::*;
use support::{smp_kernel, start_ap};

const GUEST_TIMEOUT: Duration = Duration::from_secs(30);

fn config(dir: &std::path::Path, kernel: std::path::PathBuf) -> VmConfig {
    let mut c = VmConfig::new(kernel);
    c.memory_mib = 64;
    c.serial_output = Some(dir.join("serial.log"));
    c
}

fn run(vm: &mut Vm) -> ExitReason {
    vm.start().unwrap();
    let r = vm.wait_timeout(GUEST_TIMEOUT);
    let stopped = vm.stop().unwrap();
    r.unwrap_or_else(|| panic!("the guest did not end within {GUEST_TIMEOUT:?}: {stopped:?}"))
}

#[test]
fn guest_prints_through_the_uart_into_the_serial_log() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut a = asm64();
    print(&mut a, "hello from the guest\n");
    done(&mut a, 0);
    let mut vm = Vm::new(config(dir.path(), kernel(dir.path(), &mut a))).unwrap();
    assert_eq!(run(&mut vm), ExitReason::Done(0));
    let log = std::fs::read_to_string(dir.path().join("serial.log")).unwrap();
    assert_eq!(log, "hello from the guest\n");
    assert!(vm.metrics().exits_io_out >= 22);
}

#[test]
fn guest_boots_in_long_mode_with_the_zero_page_in_rsi() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut a = asm64();
    let mut bad = a.create_label();
    // CR0.PG and EFER.LMA are on (we execute 64-bit code at all), RSI = zero page with
    // the "HdrS" header magic at 0x202 and the command line pointer at 0x228.
    a.cmp(rsi, 0x7000).unwrap();
    a.jne(bad).unwrap();
    a.cmp(dword_ptr(rsi + 0x202), 0x5372_6448).unwrap();
    a.jne(bad).unwrap();
    a.mov(edi, dword_ptr(rsi + 0x228)).unwrap();
    // The command line starts with what the configuration gave.
    a.cmp(dword_ptr(rdi), u32::from_le_bytes(*b"quie")).unwrap();
    a.jne(bad).unwrap();
    // e820: at least two entries.
    a.cmp(byte_ptr(rsi + 0x1e8), 2).unwrap();
    a.jb(bad).unwrap();
    done(&mut a, 0x600d);
    a.set_label(&mut bad).unwrap();
    done(&mut a, 0xbad);
    let mut c = config(dir.path(), kernel(dir.path(), &mut a));
    c.cmdline = "quiet".into();
    let mut vm = Vm::new(c).unwrap();
    assert!(vm.cmdline().starts_with("quiet console=ttyS0"));
    assert_eq!(run(&mut vm), ExitReason::Done(0x600d));
}

#[test]
fn i8042_reset_ends_the_vm_with_reset() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut a = asm64();
    print(&mut a, "bye\n");
    a.mov(al, 0xfe).unwrap();
    a.out(0x64, al).unwrap();
    let mut l = a.create_label();
    a.set_label(&mut l).unwrap();
    a.jmp(l).unwrap();
    let mut vm = Vm::new(config(dir.path(), kernel(dir.path(), &mut a))).unwrap();
    assert_eq!(run(&mut vm), ExitReason::Reset);
    assert_eq!(
        std::fs::read_to_string(dir.path().join("serial.log")).unwrap(),
        "bye\n"
    );
}

#[test]
fn invalid_config_creates_nothing_and_names_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = VmConfig::new(dir.path().join("no-kernel"));
    c.serial_output = Some(dir.path().join("serial.log"));
    let e = Vm::new(c).err().unwrap();
    assert!(e.to_string().contains("kernel:"), "{e}");
    assert!(!dir.path().join("serial.log").exists());
}

#[test]
fn pause_parks_a_spinning_guest_and_resume_continues_it() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut a = asm64();
    // Count in memory forever (no exits at all).
    a.mov(rdi, 0x20_0000u64).unwrap();
    let mut l = a.create_label();
    a.set_label(&mut l).unwrap();
    a.inc(qword_ptr(rdi)).unwrap();
    a.jmp(l).unwrap();
    let mut vm = Vm::new(config(dir.path(), kernel(dir.path(), &mut a))).unwrap();
    vm.start().unwrap();
    let mem = vm.guest_memory().clone();
    let count = || {
        use vm_memory::Bytes;
        mem.read_obj::<u64>(vm_memory::GuestAddress(0x20_0000))
            .unwrap()
    };
    assert!(wait_until(GUEST_TIMEOUT, || count() > 100));
    vm.pause().unwrap();
    let parked = count();
    let regs = vm.vcpu_regs(0).unwrap();
    assert!(
        (ENTRY..ENTRY + 0x20).contains(&regs.rip),
        "rip {:#x}",
        regs.rip
    );
    // Parked: the count does not move (poll a while).
    for _ in 0..1000 {
        assert_eq!(count(), parked);
        std::thread::yield_now();
    }
    vm.resume().unwrap();
    assert!(wait_until(GUEST_TIMEOUT, || count() > parked + 100));
    assert_eq!(vm.stop().unwrap(), ExitReason::Stopped);
    assert!(vm.metrics().pauses == 1);
}

/// The BSP finds the MP table, checks it lists two CPUs, wakes the AP with INIT/SIPI into
/// a real-mode trampoline at 0x3000 that prints and raises a flag, waits for the flag.
#[test]
fn smp_guest_finds_both_cpus_in_the_mp_table_and_the_ap_reports() {
    if !kvm_available() {
        return;
    }
    const FLAG: u64 = 0x3800;
    let dir = tempfile::tempdir().unwrap();

    // The AP: 16-bit real mode at CS=0x300.
    let mut ap = CodeAssembler::new(16).unwrap();
    ap.mov(dx, SERIAL as u32).unwrap();
    for b in b"AP up\n" {
        ap.mov(al, *b as u32).unwrap();
        ap.out(dx, al).unwrap();
    }
    ap.xor(ax, ax).unwrap();
    ap.mov(ds, ax).unwrap();
    ap.mov(byte_ptr(FLAG), 1).unwrap();
    ap.cli().unwrap();
    let mut spin = ap.create_label();
    ap.set_label(&mut spin).unwrap();
    ap.hlt().unwrap();
    ap.jmp(spin).unwrap();

    let mut a = asm64();
    let mut fail = a.create_label();
    let mut found = a.create_label();
    let mut scan = a.create_label();
    // Scan the EBDA for "_MP_" on 16-byte boundaries.
    a.mov(rsi, 0x9fc00u64).unwrap();
    a.set_label(&mut scan).unwrap();
    a.cmp(dword_ptr(rsi), 0x5f50_4d5f).unwrap();
    a.je(found).unwrap();
    a.add(rsi, 16).unwrap();
    a.cmp(rsi, 0xa0000).unwrap();
    a.jb(scan).unwrap();
    a.jmp(fail).unwrap();
    a.set_label(&mut found).unwrap();
    // Walk the configuration table's entries, counting enabled processors.
    a.mov(eax, dword_ptr(rsi + 4)).unwrap();
    a.cmp(dword_ptr(rax), u32::from_le_bytes(*b"PCMP")).unwrap();
    a.jne(fail).unwrap();
    a.movzx(ecx, word_ptr(rax + 34)).unwrap();
    a.lea(rbx, qword_ptr(rax + 44)).unwrap();
    a.xor(r8, r8).unwrap();
    let mut entry = a.create_label();
    let mut other = a.create_label();
    let mut next = a.create_label();
    a.set_label(&mut entry).unwrap();
    a.cmp(byte_ptr(rbx), 0).unwrap();
    a.jne(other).unwrap();
    a.inc(r8).unwrap();
    a.add(rbx, 20).unwrap();
    a.jmp(next).unwrap();
    a.set_label(&mut other).unwrap();
    a.add(rbx, 8).unwrap();
    a.set_label(&mut next).unwrap();
    a.dec(ecx).unwrap();
    a.jnz(entry).unwrap();
    a.cmp(r8, 2).unwrap();
    a.jne(fail).unwrap();
    print(&mut a, "BSP sees 2 CPUs\n");
    start_ap(&mut a);
    // Wait (bounded) for the AP's flag.
    a.mov(ecx, 3_000_000).unwrap();
    a.mov(rsi, FLAG).unwrap();
    let mut wait = a.create_label();
    let mut up = a.create_label();
    a.set_label(&mut wait).unwrap();
    a.cmp(byte_ptr(rsi), 1).unwrap();
    a.je(up).unwrap();
    a.dec(ecx).unwrap();
    a.jnz(wait).unwrap();
    done(&mut a, 3);
    a.set_label(&mut up).unwrap();
    print(&mut a, "BSP done\n");
    done(&mut a, 0);
    a.set_label(&mut fail).unwrap();
    done(&mut a, 1);

    let mut c = config(dir.path(), smp_kernel(dir.path(), &mut a, &mut ap));
    c.vcpus = 2;
    let mut vm = Vm::new(c).unwrap();
    let r = run(&mut vm);
    let log = std::fs::read_to_string(dir.path().join("serial.log")).unwrap();
    assert_eq!(r, ExitReason::Done(0), "serial: {log}");
    assert_eq!(log, "BSP sees 2 CPUs\nAP up\nBSP done\n");
}

#[test]
fn file_backed_memory_is_the_file_the_guest_writes_into() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut a = asm64();
    a.mov(rdi, 0x20_0000u64).unwrap();
    a.mov(rax, 0x1122_3344_5566_7788u64).unwrap();
    a.mov(qword_ptr(rdi), rax).unwrap();
    done(&mut a, 0);
    let mut c = config(dir.path(), kernel(dir.path(), &mut a));
    c.memory_mib = 16;
    let file = dir.path().join("guest.mem");
    c.memory_backing = agentenv_vmm::config::MemoryBacking::File { path: file.clone() };
    let mut vm = Vm::new(c).unwrap();
    assert_eq!(run(&mut vm), ExitReason::Done(0));
    let bytes = std::fs::read(&file).unwrap();
    assert_eq!(bytes.len(), 16 << 20);
    assert_eq!(
        &bytes[0x20_0000..0x20_0008],
        &0x1122_3344_5566_7788u64.to_le_bytes()
    );
}

#[test]
fn vm_handles_can_be_shared_between_threads() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Vm>();
}

/// An ELF with a PVH note is entered in 32-bit protected mode at the note's address with
/// `ebx` pointing at the PVH start info (magic, command line, memory map).
#[test]
fn elf_with_a_pvh_note_is_entered_through_pvh() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut a = CodeAssembler::new(32).unwrap();
    let mut bad = a.create_label();
    a.cmp(ebx, 0x6000).unwrap();
    a.jne(bad).unwrap();
    a.cmp(dword_ptr(ebx), 0x336e_c578).unwrap();
    a.jne(bad).unwrap();
    // cmdline_paddr (low half) and a memory map with entries.
    a.cmp(dword_ptr(ebx + 24), 0x20000).unwrap();
    a.jne(bad).unwrap();
    a.cmp(dword_ptr(ebx + 48), 2).unwrap();
    a.jb(bad).unwrap();
    a.mov(edi, dword_ptr(ebx + 24)).unwrap();
    a.cmp(dword_ptr(edi), u32::from_le_bytes(*b"pvh ")).unwrap();
    a.jne(bad).unwrap();
    a.mov(dx, DONE_PORT as u32).unwrap();
    a.mov(eax, 0x9d).unwrap();
    a.out(dx, eax).unwrap();
    a.set_label(&mut bad).unwrap();
    a.mov(dx, DONE_PORT as u32).unwrap();
    a.mov(eax, 0xbad).unwrap();
    a.out(dx, eax).unwrap();
    let code = a.assemble(ENTRY).unwrap();
    let path = dir.path().join("vmlinux-pvh");
    write_elf_with_notes(
        &path,
        ENTRY,
        &[Segment {
            addr: ENTRY,
            bytes: code,
        }],
        &[("Xen", 18, (ENTRY as u32).to_le_bytes().to_vec())],
    );
    let mut c = config(dir.path(), path);
    c.cmdline = "pvh boot".into();
    let mut vm = Vm::new(c).unwrap();
    assert_eq!(run(&mut vm), ExitReason::Done(0x9d));
}

/// A bzImage is loaded at its `code32_start` and entered at +0x200 in 64-bit mode, with
/// its setup header carried into the zero page.
#[test]
fn bzimage_is_entered_at_its_64_bit_entry_with_its_header_in_the_zero_page() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut a = asm64();
    let mut bad = a.create_label();
    a.cmp(word_ptr(rsi + 0x206), 0x020f).unwrap();
    a.jne(bad).unwrap();
    a.test(byte_ptr(rsi + 0x211), 1).unwrap();
    a.jz(bad).unwrap();
    a.cmp(byte_ptr(rsi + 0x210), 0xff).unwrap();
    a.jne(bad).unwrap();
    done(&mut a, 0xb2);
    a.set_label(&mut bad).unwrap();
    done(&mut a, 0xbad);
    let code = a.assemble(ENTRY + 0x200).unwrap();
    // The 32-bit entry at +0 is never used: fill it with HLT.
    let mut payload = vec![0xf4u8; 0x200];
    payload.extend_from_slice(&code);
    let path = dir.path().join("bzImage");
    write_bzimage(&path, &payload);
    let mut vm = Vm::new(config(dir.path(), path)).unwrap();
    assert_eq!(run(&mut vm), ExitReason::Done(0xb2));
}
