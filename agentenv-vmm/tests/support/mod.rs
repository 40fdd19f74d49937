//! Helpers shared by the VMM's integration tests beyond the guest-program basics: the
//! smallest guest, starting a second vCPU, a driver's queue setup, and ([`netns`]) a
//! network namespace with a tap for the virtio-net tests.
//!
//! The guest helpers build on the guest-program basics (`asm64`, `done`, `kernel`,
//! `kernel_with`, `Segment`) that every test crate imports at its root; a test crate
//! declares `mod support;` after importing them.
#![allow(dead_code)]

pub mod netns;

use std::path::{Path, PathBuf};

use iced_x86::code_asm::*;

use super::*;

/// The smallest guest: it ends at once with status 0. Returns the kernel written to `dir`.
pub fn ending_kernel(dir: &Path) -> PathBuf {
    let mut a = asm64();
    done(&mut a, 0);
    kernel(dir, &mut a)
}

/// Where the second vCPU starts after [`start_ap`]: a real-mode trampoline (SIPI vector
/// 0x03), which [`smp_kernel`] loads.
pub const AP_TRAMPOLINE: u64 = 0x3000;

/// Software-enables the BSP's LAPIC, then sends INIT and a SIPI (vector 0x03, so
/// [`AP_TRAMPOLINE`]) to APIC id 1. Uses `rdi`.
pub fn start_ap(a: &mut CodeAssembler) {
    a.mov(rdi, 0xfee0_0000u64).unwrap();
    a.mov(dword_ptr(rdi + 0xf0), 0x1ff).unwrap();
    a.mov(dword_ptr(rdi + 0x310), 1 << 24).unwrap();
    a.mov(dword_ptr(rdi + 0x300), 0x4500).unwrap();
    a.mov(dword_ptr(rdi + 0x310), 1 << 24).unwrap();
    a.mov(dword_ptr(rdi + 0x300), 0x4603).unwrap();
}

/// A kernel for a two-vCPU VM: `bsp` as the kernel, and the 16-bit program `ap` at
/// [`AP_TRAMPOLINE`], where [`start_ap`] sends the second vCPU.
pub fn smp_kernel(dir: &Path, bsp: &mut CodeAssembler, ap: &mut CodeAssembler) -> PathBuf {
    let ap_code = ap.assemble(AP_TRAMPOLINE).unwrap();
    kernel_with(
        dir,
        bsp,
        vec![Segment {
            addr: AP_TRAMPOLINE,
            bytes: ap_code,
        }],
    )
}

/// Sets up virtio-mmio queue `q` of the device at `rbx` with `len` entries and the given
/// ring addresses (below 4 GiB); jumps to `fail` when the device offers fewer entries.
pub fn setup_queue(
    a: &mut CodeAssembler,
    q: u32,
    len: u32,
    desc: u64,
    avail: u64,
    used: u64,
    fail: CodeLabel,
) {
    a.mov(dword_ptr(rbx + 0x30), q).unwrap();
    a.cmp(dword_ptr(rbx + 0x34), len).unwrap();
    a.jb(fail).unwrap();
    a.mov(dword_ptr(rbx + 0x38), len).unwrap();
    a.mov(dword_ptr(rbx + 0x80), desc as u32).unwrap();
    a.mov(dword_ptr(rbx + 0x84), 0).unwrap();
    a.mov(dword_ptr(rbx + 0x90), avail as u32).unwrap();
    a.mov(dword_ptr(rbx + 0x94), 0).unwrap();
    a.mov(dword_ptr(rbx + 0xa0), used as u32).unwrap();
    a.mov(dword_ptr(rbx + 0xa4), 0).unwrap();
    a.mov(dword_ptr(rbx + 0x44), 1).unwrap();
}
