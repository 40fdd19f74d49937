//! VMM benchmark: one run prints, with p50/p99 over repeats and a reference measured in the
//! same run,
//!
//! * VM create → first guest instruction (the guest's first instruction writes the
//!   debug-exit port), against bare kvm-ioctls (VM + memslot + vCPU + KVM_RUN to the same
//!   port write, no irqchip, no devices);
//! * pause of a running guest, against one port-I/O exit round trip of a bare vCPU;
//! * snapshot of 128 MiB and 1 GiB guests, full and diff, against copying a file of the
//!   same size (`std::fs::copy`, i.e. `copy_file_range`) on the same file system;
//! * restore → first guest instruction, against cold create → first instruction;
//! * VMM memory overhead: process RSS growth minus the guest memory the guest touched.
//!
//! Snapshot files go to `$AGENTENV_BENCH_DIR`, else `/dev/shm`, else the temp directory.
//! Run: `cargo run --release -p agentenv-vmm --example vmm_bench`.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use agentenv_testkit::vmm::*;
use agentenv_vmm::{ExitReason, SnapshotKind, Vm, VmConfig};
use iced_x86::code_asm::*;
use kvm_bindings::kvm_userspace_memory_region;
use kvm_ioctls::{Kvm, VcpuExit, VcpuFd, VmFd};
use vm_memory::{Address, Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryRegion};

const TIMEOUT: Duration = Duration::from_secs(60);
const COUNTER: u64 = 0x20_0000;
const FLAG: u64 = 0x20_1000;
const DIRTY_BASE: u64 = 0x40_0000;
const DIRTY_PAGES: u32 = 64;

struct Stats {
    samples: Vec<Duration>,
}

impl Stats {
    fn new() -> Self {
        Self {
            samples: Vec::new(),
        }
    }
    fn push(&mut self, d: Duration) {
        self.samples.push(d);
    }
    fn pct(&self, p: f64) -> Duration {
        let mut s = self.samples.clone();
        s.sort();
        let idx = ((p * s.len() as f64).ceil() as usize).clamp(1, s.len()) - 1;
        s[idx]
    }
    fn p50(&self) -> Duration {
        self.pct(0.50)
    }
    fn p99(&self) -> Duration {
        self.pct(0.99)
    }
}

fn fmt(d: Duration) -> String {
    let us = d.as_secs_f64() * 1e6;
    if us < 1000.0 {
        format!("{us:.1} µs")
    } else {
        format!("{:.2} ms", us / 1000.0)
    }
}

fn row(name: &str, ours: &Stats, reference_name: &str, reference: &Stats) {
    let ratio = ours.p50().as_secs_f64() / reference.p50().as_secs_f64().max(1e-9);
    println!(
        "{name:<44} p50 {:>10}  p99 {:>10}  | {reference_name:<34} p50 {:>10}  p99 {:>10}  | ×{ratio:.2}",
        fmt(ours.p50()),
        fmt(ours.p99()),
        fmt(reference.p50()),
        fmt(reference.p99()),
    );
}

fn bench_dir() -> (Option<tempfile::TempDir>, PathBuf) {
    if let Ok(d) = std::env::var("AGENTENV_BENCH_DIR") {
        return (None, PathBuf::from(d));
    }
    let t = scratch();
    let p = t.path().to_path_buf();
    (Some(t), p)
}

/// The guest whose first instruction ends it.
fn first_instruction_guest(dir: &Path, mib: u64) -> VmConfig {
    let mut a = asm64();
    done(&mut a, 0);
    let mut c = VmConfig::new(kernel(dir, &mut a));
    c.memory_mib = mib;
    c
}

/// Counts at COUNTER until FLAG is set, then ends.
fn counting_guest(dir: &Path, mib: u64) -> VmConfig {
    let mut a = asm64();
    a.mov(rdi, COUNTER).unwrap();
    a.mov(rsi, FLAG).unwrap();
    let mut l = a.create_label();
    a.set_label(&mut l).unwrap();
    a.inc(qword_ptr(rdi)).unwrap();
    a.cmp(qword_ptr(rsi), 0).unwrap();
    a.je(l).unwrap();
    done(&mut a, 0);
    let mut c = VmConfig::new(kernel(dir, &mut a));
    c.memory_mib = mib;
    c.track_dirty_pages = true;
    c
}

/// Rewrites DIRTY_PAGES pages over and over, counting rounds at COUNTER.
fn dirtying_guest(dir: &Path, mib: u64) -> VmConfig {
    let mut a = asm64();
    a.mov(rsi, COUNTER).unwrap();
    let mut outer = a.create_label();
    let mut inner = a.create_label();
    a.set_label(&mut outer).unwrap();
    a.mov(rdi, DIRTY_BASE).unwrap();
    a.mov(ecx, DIRTY_PAGES).unwrap();
    a.set_label(&mut inner).unwrap();
    a.mov(qword_ptr(rdi), rcx).unwrap();
    a.add(rdi, 0x1000).unwrap();
    a.dec(ecx).unwrap();
    a.jnz(inner).unwrap();
    a.inc(qword_ptr(rsi)).unwrap();
    a.jmp(outer).unwrap();
    let mut c = VmConfig::new(kernel(dir, &mut a));
    c.memory_mib = mib;
    c.track_dirty_pages = true;
    c
}

fn read_u64(vm: &Vm, addr: u64) -> u64 {
    vm.guest_memory().read_obj(GuestAddress(addr)).unwrap()
}

/// A bare real-mode vCPU of `vm` about to run `code` at 0x1000 of `size` bytes of fresh
/// private anonymous memory (mapped with `extra_flags` too). Unmap the returned mapping
/// once the VM is dropped.
fn bare_vcpu(
    vm: &VmFd,
    size: usize,
    extra_flags: libc::c_int,
    code: &[u8],
) -> (VcpuFd, *mut libc::c_void) {
    // SAFETY: a fresh private anonymous mapping, unmapped by the caller after the VM is
    // gone.
    let mem = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            size,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | extra_flags,
            -1,
            0,
        )
    };
    assert_ne!(mem, libc::MAP_FAILED);
    assert!(0x1000 + code.len() <= size);
    // SAFETY: the mapping is `size` bytes and the code fits at 0x1000 (checked above).
    unsafe {
        std::ptr::copy_nonoverlapping(code.as_ptr(), (mem as *mut u8).add(0x1000), code.len())
    };
    let region = kvm_userspace_memory_region {
        slot: 0,
        flags: 0,
        guest_phys_addr: 0,
        memory_size: size as u64,
        userspace_addr: mem as u64,
    };
    // SAFETY: the mapping outlives the VM (the caller unmaps it after dropping `vm`).
    unsafe { vm.set_user_memory_region(region).unwrap() };
    let vcpu = vm.create_vcpu(0).unwrap();
    let mut sregs = vcpu.get_sregs().unwrap();
    sregs.cs.base = 0;
    sregs.cs.selector = 0;
    vcpu.set_sregs(&sregs).unwrap();
    let mut regs = vcpu.get_regs().unwrap();
    regs.rip = 0x1000;
    regs.rflags = 2;
    vcpu.set_regs(&regs).unwrap();
    (vcpu, mem)
}

/// Bare kvm-ioctls: VM, anonymous memory, memslot, vCPU in real mode, KVM_RUN until the
/// guest's `out dx, al` to 0x501.
fn bare_first_exit(mib: u64) -> Duration {
    let t0 = Instant::now();
    let kvm = Kvm::new().unwrap();
    let vm = kvm.create_vm().unwrap();
    let size = (mib << 20) as usize;
    // mov dx, 0x501; out dx, al; hlt
    let code = [0xba, 0x01, 0x05, 0xee, 0xf4];
    let (mut vcpu, mem) = bare_vcpu(&vm, size, libc::MAP_NORESERVE, &code);
    match vcpu.run().unwrap() {
        VcpuExit::IoOut(0x501, _) => {}
        other => panic!("unexpected exit {other:?}"),
    }
    let d = t0.elapsed();
    drop(vcpu);
    drop(vm);
    // SAFETY: the VM that used the mapping is gone.
    unsafe { libc::munmap(mem, size) };
    d
}

/// One port-I/O exit round trip of a bare vCPU (real mode `out` in a loop).
fn bare_exit_round_trips(n: usize) -> Stats {
    let kvm = Kvm::new().unwrap();
    let vm = kvm.create_vm().unwrap();
    let size = 1 << 20;
    // l: mov dx, 0x80; out dx, al; jmp l
    let code = [0xba, 0x80, 0x00, 0xee, 0xeb, 0xfa];
    let (mut vcpu, mem) = bare_vcpu(&vm, size, 0, &code);
    let mut s = Stats::new();
    for _ in 0..n {
        let t = Instant::now();
        match vcpu.run().unwrap() {
            VcpuExit::IoOut(0x80, _) => {}
            other => panic!("unexpected exit {other:?}"),
        }
        s.push(t.elapsed());
    }
    drop(vcpu);
    drop(vm);
    // SAFETY: the VM that used the mapping is gone.
    unsafe { libc::munmap(mem, size) };
    s
}

fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: u64 = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    pages * 4096
}

/// Bytes of guest memory resident in this process.
fn guest_resident(vm: &Vm) -> u64 {
    let mut total = 0;
    for r in vm.guest_memory().iter() {
        let len = r.len() as usize;
        let pages = len / 4096;
        let mut vec = vec![0u8; pages];
        // SAFETY: the region is a live mapping of `len` bytes; `vec` has one byte per page.
        let rc = unsafe { libc::mincore(r.as_ptr() as *mut libc::c_void, len, vec.as_mut_ptr()) };
        assert_eq!(rc, 0);
        total += vec.iter().filter(|b| **b & 1 != 0).count() as u64 * 4096;
    }
    total
}

fn copy_reference(src: &Path, dst: &Path, repeats: usize) -> Stats {
    let mut s = Stats::new();
    for _ in 0..repeats {
        let _ = std::fs::remove_file(dst);
        let t = Instant::now();
        std::fs::copy(src, dst).unwrap();
        s.push(t.elapsed());
    }
    let _ = std::fs::remove_file(dst);
    s
}

fn main() {
    if !Path::new("/dev/kvm").exists() {
        println!("cannot run: /dev/kvm is missing");
        return;
    }
    let pvm = Path::new("/sys/module/kvm_pvm").exists();
    let (_keep, out) = bench_dir();
    std::fs::create_dir_all(&out).unwrap();
    let src = tempfile::tempdir().unwrap();
    println!(
        "agentenv-vmm benchmark ({} cores, /dev/kvm served by {}; snapshot files in {})",
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1),
        if pvm { "kvm_pvm" } else { "KVM" },
        out.display()
    );
    println!();

    // Memory overhead, first: later VMs would reuse what earlier ones allocated.
    for mib in [128u64, 1024] {
        let cfg = counting_guest(src.path(), mib);
        let before = rss_bytes();
        let mut vm = Vm::new(cfg).unwrap();
        vm.start().unwrap();
        assert!(wait_until(TIMEOUT, || read_u64(&vm, COUNTER) > 1000));
        vm.pause().unwrap();
        let grown = rss_bytes().saturating_sub(before);
        let touched = guest_resident(&vm);
        println!(
            "VMM memory overhead ({mib} MiB guest): RSS +{:.2} MiB, guest memory touched {:.2} MiB, overhead {:.2} MiB",
            grown as f64 / 1048576.0,
            touched as f64 / 1048576.0,
            grown.saturating_sub(touched) as f64 / 1048576.0
        );
        vm.stop().unwrap();
    }
    println!();

    // Create → first instruction.
    let repeats = 30;
    let mut ours = Stats::new();
    let mut bare = Stats::new();
    let cold_cfg = first_instruction_guest(src.path(), 128);
    for _ in 0..3 {
        // Warm-up (page cache, lazy kernel state).
        bare_first_exit(128);
        let mut vm = Vm::new(cold_cfg.clone()).unwrap();
        vm.start().unwrap();
        vm.wait_timeout(TIMEOUT).unwrap();
        vm.stop().unwrap();
    }
    for _ in 0..repeats {
        bare.push(bare_first_exit(128));
        let t = Instant::now();
        let mut vm = Vm::new(cold_cfg.clone()).unwrap();
        vm.start().unwrap();
        let r = vm.wait_timeout(TIMEOUT);
        ours.push(t.elapsed());
        assert_eq!(r, Some(ExitReason::Done(0)));
        vm.stop().unwrap();
    }
    row(
        "VM create → first instruction (128 MiB)",
        &ours,
        "bare KVM VM+memslot+vCPU+run",
        &bare,
    );
    let create = ours;

    // Pause.
    let exits = bare_exit_round_trips(2000);
    {
        let cfg = counting_guest(src.path(), 128);
        let mut vm = Vm::new(cfg).unwrap();
        vm.start().unwrap();
        let mut s = Stats::new();
        for _ in 0..100 {
            let before = read_u64(&vm, COUNTER);
            assert!(wait_until(TIMEOUT, || read_u64(&vm, COUNTER) > before));
            let t = Instant::now();
            vm.pause().unwrap();
            s.push(t.elapsed());
            vm.resume().unwrap();
        }
        vm.stop().unwrap();
        row(
            "pause (running guest, 1 vCPU)",
            &s,
            "one port-I/O exit round trip",
            &exits,
        );
    }

    // Snapshots and restore, per size.
    for (mib, repeats) in [(128u64, 10usize), (1024, 3)] {
        let dir = out.join(format!("snap-{mib}"));
        let cfg = counting_guest(src.path(), mib);
        let mut vm = Vm::new(cfg.clone()).unwrap();
        vm.start().unwrap();
        assert!(wait_until(TIMEOUT, || read_u64(&vm, COUNTER) > 0));
        vm.pause().unwrap();
        // Only the pages the guest touched are populated: the rest stay holes.
        let mut sparse = Stats::new();
        for _ in 0..repeats {
            let t = Instant::now();
            vm.snapshot(&dir, SnapshotKind::Full).unwrap();
            sparse.push(t.elapsed());
        }
        // Every page populated (written from the host, as by a guest that used all its
        // memory), except the first 4 MiB with the guest's code, tables and counters.
        let chunk = vec![0x5au8; 1 << 20];
        for r in vm.guest_memory().iter() {
            let mut off = if r.start_addr().0 == 0 { 4 << 20 } else { 0 };
            while off < r.len() {
                vm.guest_memory()
                    .write_slice(&chunk, r.start_addr().unchecked_add(off))
                    .unwrap();
                off += chunk.len() as u64;
            }
        }
        let mem_file = dir.join(agentenv_vmm::snapshot::MEMORY_FILE);
        let mut full = Stats::new();
        for _ in 0..repeats {
            // Like the copy reference, write into a directory without an old memory file
            // (freeing the old file's pages is not part of either measurement).
            let _ = std::fs::remove_file(&mem_file);
            let t = Instant::now();
            vm.snapshot(&dir, SnapshotKind::Full).unwrap();
            full.push(t.elapsed());
        }
        vm.stop().unwrap();
        drop(vm);
        let copy = copy_reference(&mem_file, &out.join("copy"), repeats);
        row(
            &format!("snapshot full ({mib} MiB, all pages in use)"),
            &full,
            &format!("copy of the {mib} MiB memory file"),
            &copy,
        );
        row(
            &format!("snapshot full ({mib} MiB, guest touched few)"),
            &sparse,
            &format!("copy of the {mib} MiB memory file"),
            &copy,
        );

        // Diff: a guest that keeps rewriting DIRTY_PAGES pages.
        let ddir = out.join(format!("diff-{mib}"));
        let dcfg = dirtying_guest(src.path(), mib);
        let mut vm = Vm::new(dcfg).unwrap();
        vm.start().unwrap();
        assert!(wait_until(TIMEOUT, || read_u64(&vm, COUNTER) > 0));
        vm.pause().unwrap();
        vm.snapshot(&ddir, SnapshotKind::Full).unwrap();
        let mut diff = Stats::new();
        let mut pages = 0;
        for _ in 0..repeats.max(5) {
            vm.resume().unwrap();
            let before = read_u64(&vm, COUNTER);
            assert!(wait_until(TIMEOUT, || read_u64(&vm, COUNTER) > before + 1));
            vm.pause().unwrap();
            let t = Instant::now();
            let info = vm.snapshot(&ddir, SnapshotKind::Diff).unwrap();
            diff.push(t.elapsed());
            pages = info.pages_written;
        }
        vm.stop().unwrap();
        drop(vm);
        row(
            &format!("snapshot diff ({mib} MiB, {pages} dirty pages)"),
            &diff,
            &format!("copy of the {mib} MiB memory file"),
            &copy,
        );
        let _ = std::fs::remove_dir_all(&ddir);

        // Restore → first instruction: the restored guest leaves its loop at once.
        let mut restore = Stats::new();
        for _ in 0..repeats {
            let t = Instant::now();
            let mut vm = Vm::restore(cfg.clone(), &dir).unwrap();
            vm.guest_memory()
                .write_obj(1u64, GuestAddress(FLAG))
                .unwrap();
            vm.resume().unwrap();
            let r = vm.wait_timeout(TIMEOUT);
            restore.push(t.elapsed());
            assert_eq!(r, Some(ExitReason::Done(0)));
            vm.stop().unwrap();
        }
        row(
            &format!("restore → first instruction ({mib} MiB)"),
            &restore,
            "cold create → first instruction",
            &create,
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    println!();
    if pvm {
        println!(
            "boot → agent ready, restore → agent ready: not measured here (/dev/kvm is kvm_pvm: guest kernel mode is emulated and no Linux guest reaches userspace)"
        );
    } else {
        println!(
            "boot → agent ready, restore → agent ready: not measured by this program (needs the guest kernel and root image; see the Linux boot test)"
        );
    }
}
