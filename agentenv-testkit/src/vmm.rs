//! Guest programs for the VMM's tests and benchmark, assembled at test time with iced-x86
//! and wrapped in a minimal ELF64 "vmlinux", so every test boots through the real loader.
//!
//! Guests start in 64-bit long mode at [`ENTRY`] with the VMM's identity page tables
//! (4 GiB), its GDT and a stack at 0x8ff0, and end by writing a status to the debug-exit
//! port (0x501) or by the i8042 reset. Their code runs at CPL0, which PVM hosts emulate at
//! about 1 µs per instruction: keep them short.
use std::path::{Path, PathBuf};
use std::time::Duration;

use iced_x86::code_asm::*;

/// Where guest code is loaded and entered.
pub const ENTRY: u64 = 0x10_0000;
/// The debug-exit port.
pub const DONE_PORT: u16 = 0x501;
/// COM1.
pub const SERIAL: u16 = 0x3f8;

/// A loadable segment: guest-physical address and bytes.
pub struct Segment {
    /// Where it is loaded (guest-physical).
    pub addr: u64,
    /// Its contents.
    pub bytes: Vec<u8>,
}

/// Writes an ELF64 executable with the given segments, entered at `entry`.
pub fn write_elf(path: &Path, entry: u64, segments: &[Segment]) {
    write_elf_with_notes(path, entry, segments, &[]);
}

/// An ELF note `(name, type, desc)`.
pub type Note = (&'static str, u32, Vec<u8>);

/// Writes an ELF64 executable with loadable segments and one PT_NOTE segment per note.
pub fn write_elf_with_notes(path: &Path, entry: u64, segments: &[Segment], notes: &[Note]) {
    let ehsize = 64usize;
    let phsize = 56usize;
    let phnum = segments.len() + notes.len();
    let mut data_off = ehsize + phsize * phnum;
    let mut out = vec![0u8; data_off];
    out[..4].copy_from_slice(b"\x7fELF");
    out[4] = 2; // ELFCLASS64
    out[5] = 1; // little endian
    out[6] = 1; // version
    out[16..18].copy_from_slice(&2u16.to_le_bytes()); // ET_EXEC
    out[18..20].copy_from_slice(&62u16.to_le_bytes()); // EM_X86_64
    out[20..24].copy_from_slice(&1u32.to_le_bytes());
    out[24..32].copy_from_slice(&entry.to_le_bytes());
    out[32..40].copy_from_slice(&(ehsize as u64).to_le_bytes()); // phoff
    out[52..54].copy_from_slice(&(ehsize as u16).to_le_bytes());
    out[54..56].copy_from_slice(&(phsize as u16).to_le_bytes());
    out[56..58].copy_from_slice(&(phnum as u16).to_le_bytes());
    for (i, s) in segments.iter().enumerate() {
        let ph = ehsize + i * phsize;
        let p = &mut out[ph..ph + phsize];
        p[0..4].copy_from_slice(&1u32.to_le_bytes()); // PT_LOAD
        p[4..8].copy_from_slice(&7u32.to_le_bytes()); // RWX
        p[8..16].copy_from_slice(&(data_off as u64).to_le_bytes());
        p[16..24].copy_from_slice(&s.addr.to_le_bytes());
        p[24..32].copy_from_slice(&s.addr.to_le_bytes());
        p[32..40].copy_from_slice(&(s.bytes.len() as u64).to_le_bytes());
        p[40..48].copy_from_slice(&(s.bytes.len() as u64).to_le_bytes());
        p[48..56].copy_from_slice(&0x1000u64.to_le_bytes());
        data_off += s.bytes.len();
    }
    let mut note_blobs = Vec::new();
    for (i, (name, kind, desc)) in notes.iter().enumerate() {
        let mut n = Vec::new();
        let name = format!("{name}\0");
        n.extend_from_slice(&(name.len() as u32).to_le_bytes());
        n.extend_from_slice(&(desc.len() as u32).to_le_bytes());
        n.extend_from_slice(&kind.to_le_bytes());
        n.extend_from_slice(name.as_bytes());
        n.resize(n.len().next_multiple_of(4), 0);
        n.extend_from_slice(desc);
        n.resize(n.len().next_multiple_of(4), 0);
        let ph = ehsize + (segments.len() + i) * phsize;
        let p = &mut out[ph..ph + phsize];
        p[0..4].copy_from_slice(&4u32.to_le_bytes()); // PT_NOTE
        p[8..16].copy_from_slice(&(data_off as u64).to_le_bytes());
        p[32..40].copy_from_slice(&(n.len() as u64).to_le_bytes());
        p[48..56].copy_from_slice(&4u64.to_le_bytes());
        data_off += n.len();
        note_blobs.push(n);
    }
    for s in segments {
        out.extend_from_slice(&s.bytes);
    }
    for n in note_blobs {
        out.extend_from_slice(&n);
    }
    std::fs::write(path, out).unwrap();
}

/// Writes a minimal bzImage: one setup sector with the boot protocol header (version
/// 2.15, loaded high at 1 MiB) and `payload` as the protected-mode kernel. The VMM enters
/// its 64-bit entry, 0x200 bytes into the payload.
pub fn write_bzimage(path: &Path, payload: &[u8]) {
    let mut b = vec![0u8; 2 * 512];
    b[0x1f1] = 1; // setup_sects
    b[0x1fe..0x200].copy_from_slice(&0xaa55u16.to_le_bytes());
    b[0x202..0x206].copy_from_slice(b"HdrS");
    b[0x206..0x208].copy_from_slice(&0x020fu16.to_le_bytes());
    b[0x211] = 1; // LOADED_HIGH
    b[0x214..0x218].copy_from_slice(&0x10_0000u32.to_le_bytes()); // code32_start
    b.extend_from_slice(payload);
    std::fs::write(path, b).unwrap();
}

/// A 64-bit assembler.
pub fn asm64() -> CodeAssembler {
    CodeAssembler::new(64).unwrap()
}

/// Assembles `a` at [`ENTRY`] and writes it as `dir/vmlinux`.
pub fn kernel(dir: &Path, a: &mut CodeAssembler) -> PathBuf {
    kernel_with(dir, a, Vec::new())
}

/// Like [`kernel`] with extra segments.
pub fn kernel_with(dir: &Path, a: &mut CodeAssembler, mut extra: Vec<Segment>) -> PathBuf {
    let code = a.assemble(ENTRY).unwrap();
    let path = dir.join("vmlinux");
    let mut segs = vec![Segment {
        addr: ENTRY,
        bytes: code,
    }];
    segs.append(&mut extra);
    write_elf(&path, ENTRY, &segs);
    path
}

/// A guest that prints `ready` on COM1, then halts with interrupts off (the vCPU sleeps
/// in the host kernel), written as `dir/vmlinux`.
pub fn halting_guest(dir: &Path) -> PathBuf {
    let mut a = asm64();
    print(&mut a, "ready\n");
    let mut l = a.create_label();
    a.set_label(&mut l).unwrap();
    a.cli().unwrap();
    a.hlt().unwrap();
    a.jmp(l).unwrap();
    kernel(dir, &mut a)
}

/// Prints `s` on COM1 (two instructions per byte).
pub fn print(a: &mut CodeAssembler, s: &str) {
    a.mov(dx, SERIAL as u32).unwrap();
    for b in s.bytes() {
        a.mov(al, b as u32).unwrap();
        a.out(dx, al).unwrap();
    }
}

/// Ends the guest with `status` through the debug-exit port.
pub fn done(a: &mut CodeAssembler, status: u32) {
    a.mov(dx, DONE_PORT as u32).unwrap();
    a.mov(eax, status).unwrap();
    a.out(dx, eax).unwrap();
    // Never reached: the VMM ends the VM on the write.
    let mut l = a.create_label();
    a.set_label(&mut l).unwrap();
    a.jmp(l).unwrap();
}

/// Guest code that sends IOAPIC pin `pin` to `handler`: an IDT at `idt` (its descriptor at
/// `idtr`) whose gate `vector` enters `handler`, the pin routed to `vector` on APIC 0 (edge,
/// unmasked), the LAPIC software-enabled, and the legacy PIC masked, as an OS using the
/// IOAPIC does (the BSP's LINT0 takes ExtINT, and an irqfd raises the PIC line too).
pub fn route_irq(
    a: &mut CodeAssembler,
    handler: CodeLabel,
    idt: u64,
    idtr: u64,
    vector: u64,
    pin: u64,
) {
    a.lea(rax, ptr(handler)).unwrap();
    a.mov(rdi, idt + vector * 16).unwrap();
    a.mov(word_ptr(rdi), ax).unwrap();
    a.mov(word_ptr(rdi + 2), 0x08).unwrap();
    a.mov(word_ptr(rdi + 4), 0x8e00).unwrap();
    a.shr(rax, 16).unwrap();
    a.mov(word_ptr(rdi + 6), ax).unwrap();
    a.shr(rax, 16).unwrap();
    a.mov(dword_ptr(rdi + 8), eax).unwrap();
    a.mov(dword_ptr(rdi + 12), 0).unwrap();
    a.mov(rdi, idtr).unwrap();
    a.mov(word_ptr(rdi), ((vector + 1) * 16 - 1) as u32)
        .unwrap();
    a.mov(rax, idt).unwrap();
    a.mov(qword_ptr(rdi + 2), rax).unwrap();
    a.lidt(ptr(rdi)).unwrap();
    a.mov(rdi, 0xfec0_0000u64).unwrap();
    a.mov(dword_ptr(rdi), (0x10 + 2 * pin) as u32).unwrap();
    a.mov(dword_ptr(rdi + 0x10), vector as u32).unwrap();
    a.mov(dword_ptr(rdi), (0x10 + 2 * pin + 1) as u32).unwrap();
    a.mov(dword_ptr(rdi + 0x10), 0).unwrap();
    a.mov(rdi, 0xfee0_0000u64).unwrap();
    a.mov(dword_ptr(rdi + 0xf0), 0x1ff).unwrap();
    a.mov(al, 0xff).unwrap();
    a.out(0x21, al).unwrap();
    a.out(0xa1, al).unwrap();
}

/// Guest code of a virtio-mmio interrupt handler at `handler`: acknowledges the
/// `InterruptStatus` of the device at `mmio`, ORs it into the u32 at `seen`, runs `extra`
/// (`rax` and `rbx` are free), sends the LAPIC its EOI and returns.
pub fn virtio_irq_handler(
    a: &mut CodeAssembler,
    handler: &mut CodeLabel,
    mmio: u64,
    seen: u64,
    extra: impl FnOnce(&mut CodeAssembler),
) {
    a.set_label(handler).unwrap();
    a.push(rax).unwrap();
    a.push(rbx).unwrap();
    a.mov(rbx, mmio).unwrap();
    a.mov(eax, dword_ptr(rbx + 0x60)).unwrap();
    a.mov(dword_ptr(rbx + 0x64), eax).unwrap();
    a.mov(rbx, seen).unwrap();
    a.or(dword_ptr(rbx), eax).unwrap();
    extra(a);
    a.mov(rbx, 0xfee0_00b0u64).unwrap();
    a.mov(dword_ptr(rbx), 0).unwrap();
    a.pop(rbx).unwrap();
    a.pop(rax).unwrap();
    a.iretq().unwrap();
}

/// Guest code that sets the u64 at `ready` to 1 and waits until the host sets the one at
/// `go` (uses `rdi` and `rsi`).
pub fn signal_and_wait(a: &mut CodeAssembler, ready: u64, go: u64) {
    a.mov(rdi, ready).unwrap();
    a.mov(qword_ptr(rdi), 1).unwrap();
    a.mov(rsi, go).unwrap();
    let mut wait = a.create_label();
    a.set_label(&mut wait).unwrap();
    a.cmp(qword_ptr(rsi), 0).unwrap();
    a.je(wait).unwrap();
}

/// Polls `cond` (yielding the thread between checks, guests run for microseconds) until
/// it holds or `timeout` passes; whether it held.
pub fn wait_until(timeout: Duration, cond: impl FnMut() -> bool) -> bool {
    crate::Wait::new("a guest condition", timeout)
        .every(Duration::ZERO)
        .try_until_blocking(cond)
        .is_ok()
}

/// A scratch directory for snapshot files: in `/dev/shm` when there is one (guest memory
/// files are RAM-sized and RAM-backed storage is what a node uses for them), else the
/// system temporary directory.
pub fn scratch() -> tempfile::TempDir {
    let shm = std::path::Path::new("/dev/shm");
    if shm.is_dir() {
        if let Ok(d) = tempfile::Builder::new().prefix("vmm-test").tempdir_in(shm) {
            return d;
        }
    }
    tempfile::tempdir().unwrap()
}

/// Whether this host can run KVM guests at all (`/dev/kvm` present).
pub fn kvm_available() -> bool {
    if std::path::Path::new("/dev/kvm").exists() {
        true
    } else {
        println!("SKIPPED: /dev/kvm is missing; the VMM's guest tests need KVM");
        false
    }
}
