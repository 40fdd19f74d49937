//! Boot-time vCPU state: registers, segments, page tables, FPU, MSRs and the LAPIC.

use kvm_bindings::{kvm_fpu, kvm_msr_entry, kvm_regs, kvm_segment, kvm_sregs};
use vm_memory::{Bytes, GuestAddress};

use super::*;
use crate::hypervisor::{HypervisorError, HypervisorVcpu};
use crate::memory::GuestMemoryMmap;

/// Why a vCPU could not be set up for boot.
#[derive(Debug, thiserror::Error)]
pub enum RegsError {
    #[error("writing the boot {what} to guest memory failed: {source}")]
    Memory {
        what: &'static str,
        source: vm_memory::GuestMemoryError,
    },
    #[error(transparent)]
    Hypervisor(#[from] HypervisorError),
    #[error("the hypervisor set {set} of {want} boot MSRs")]
    Msrs { set: usize, want: usize },
}

/// How the vCPU enters the kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EntryMode {
    /// 64-bit long mode with identity paging; `rsi` = zero page (Linux boot protocol).
    Long64,
    /// 32-bit protected mode without paging; `rbx` = PVH start info.
    Pvh,
}

const X86_CR0_PE: u64 = 0x1;
const X86_CR0_ET: u64 = 0x10;
const X86_CR0_PG: u64 = 0x8000_0000;
const X86_CR4_PAE: u64 = 0x20;
const EFER_LME: u64 = 0x100;
pub(crate) const EFER_LMA: u64 = 0x400;

/// A GDT entry from flags, base and limit.
pub const fn gdt_entry(flags: u16, base: u32, limit: u32) -> u64 {
    ((base as u64 & 0xff00_0000) << (56 - 24))
        | ((flags as u64 & 0x0000_f0ff) << 40)
        | ((limit as u64 & 0x000f_0000) << (48 - 16))
        | ((base as u64 & 0x00ff_ffff) << 16)
        | (limit as u64 & 0x0000_ffff)
}

/// The KVM segment a GDT entry describes.
pub fn segment_from_gdt(entry: u64, index: u8) -> kvm_segment {
    let base = ((entry >> 16) & 0x00ff_ffff) | ((entry >> 32) & 0xff00_0000);
    let g = ((entry >> 55) & 1) as u8;
    let mut limit = ((entry & 0xffff) | ((entry >> 32) & 0x000f_0000)) as u32;
    if g == 1 {
        limit = (limit << 12) | 0xfff;
    }
    let present = ((entry >> 47) & 1) as u8;
    kvm_segment {
        base,
        limit,
        selector: u16::from(index) * 8,
        type_: ((entry >> 40) & 0xf) as u8,
        present,
        dpl: ((entry >> 45) & 3) as u8,
        db: ((entry >> 54) & 1) as u8,
        s: ((entry >> 44) & 1) as u8,
        l: ((entry >> 53) & 1) as u8,
        g,
        avl: ((entry >> 52) & 1) as u8,
        padding: 0,
        unusable: u8::from(present == 0),
    }
}

/// The boot GDT: null, code, data, TSS (selectors 0x08, 0x10, 0x18).
pub fn boot_gdt(mode: EntryMode) -> [u64; 4] {
    let code = match mode {
        EntryMode::Long64 => gdt_entry(0xa09b, 0, 0xfffff),
        EntryMode::Pvh => gdt_entry(0xc09b, 0, 0xffff_ffff),
    };
    [
        0,
        code,
        gdt_entry(0xc093, 0, 0xfffff),
        gdt_entry(0x808b, 0, 0xfffff),
    ]
}

fn mem_err(what: &'static str) -> impl FnOnce(vm_memory::GuestMemoryError) -> RegsError {
    move |source| RegsError::Memory { what, source }
}

fn words_to_bytes(words: &[u64]) -> Vec<u8> {
    words.iter().flat_map(|w| w.to_le_bytes()).collect()
}

/// Writes the GDT, the IDT and (for 64-bit entry) the identity page tables covering 4 GiB.
pub fn write_boot_tables(mem: &GuestMemoryMmap, mode: EntryMode) -> Result<(), RegsError> {
    for (i, e) in boot_gdt(mode).iter().enumerate() {
        mem.write_obj(*e, GuestAddress(BOOT_GDT_START + i as u64 * 8))
            .map_err(mem_err("GDT"))?;
    }
    mem.write_obj(0u64, GuestAddress(BOOT_IDT_START))
        .map_err(mem_err("IDT"))?;
    if mode == EntryMode::Long64 {
        mem.write_obj(PDPTE_START | 0x3, GuestAddress(PML4_START))
            .map_err(mem_err("page tables"))?;
        let mut pdpt = [0u64; 512];
        for (i, e) in pdpt.iter_mut().take(PDE_COUNT as usize).enumerate() {
            *e = (PDE_START + i as u64 * 0x1000) | 0x3;
        }
        mem.write_slice(&words_to_bytes(&pdpt), GuestAddress(PDPTE_START))
            .map_err(mem_err("page tables"))?;
        for d in 0..PDE_COUNT {
            let mut pd = [0u64; 512];
            for (j, e) in pd.iter_mut().enumerate() {
                *e = ((d * 512 + j as u64) << 21) | 0x83;
            }
            mem.write_slice(&words_to_bytes(&pd), GuestAddress(PDE_START + d * 0x1000))
                .map_err(mem_err("page tables"))?;
        }
    }
    Ok(())
}

/// The special registers for entry.
pub fn boot_sregs(mut sregs: kvm_sregs, mode: EntryMode) -> kvm_sregs {
    let gdt = boot_gdt(mode);
    let code = segment_from_gdt(gdt[1], 1);
    let data = segment_from_gdt(gdt[2], 2);
    let tss = segment_from_gdt(gdt[3], 3);
    sregs.gdt.base = BOOT_GDT_START;
    sregs.gdt.limit = (std::mem::size_of_val(&gdt) - 1) as u16;
    sregs.idt.base = BOOT_IDT_START;
    sregs.idt.limit = 7;
    sregs.cs = code;
    sregs.ds = data;
    sregs.es = data;
    sregs.fs = data;
    sregs.gs = data;
    sregs.ss = data;
    sregs.tr = tss;
    match mode {
        EntryMode::Long64 => {
            sregs.cr0 |= X86_CR0_PE | X86_CR0_ET | X86_CR0_PG;
            sregs.cr3 = PML4_START;
            sregs.cr4 |= X86_CR4_PAE;
            sregs.efer |= EFER_LME | EFER_LMA;
        }
        EntryMode::Pvh => {
            sregs.cr0 = X86_CR0_PE | X86_CR0_ET;
            sregs.cr3 = 0;
            sregs.cr4 = 0;
            sregs.efer = 0;
        }
    }
    sregs
}

/// The general registers for entry at `entry`.
pub fn boot_regs(entry: u64, mode: EntryMode) -> kvm_regs {
    let mut regs = kvm_regs {
        rflags: 0x2,
        rip: entry,
        ..Default::default()
    };
    match mode {
        EntryMode::Long64 => {
            regs.rsp = BOOT_STACK_POINTER;
            regs.rbp = BOOT_STACK_POINTER;
            regs.rsi = ZERO_PAGE_START;
        }
        EntryMode::Pvh => regs.rbx = PVH_INFO_START,
    }
    regs
}

/// The MSRs every vCPU boots with (as Firecracker sets them).
pub fn boot_msrs() -> Vec<kvm_msr_entry> {
    const MSR_IA32_SYSENTER_CS: u32 = 0x174;
    const MSR_IA32_SYSENTER_ESP: u32 = 0x175;
    const MSR_IA32_SYSENTER_EIP: u32 = 0x176;
    const MSR_STAR: u32 = 0xc000_0081;
    const MSR_LSTAR: u32 = 0xc000_0082;
    const MSR_CSTAR: u32 = 0xc000_0083;
    const MSR_SYSCALL_MASK: u32 = 0xc000_0084;
    const MSR_KERNEL_GS_BASE: u32 = 0xc000_0102;
    const MSR_IA32_TSC: u32 = 0x10;
    const MSR_IA32_MISC_ENABLE: u32 = 0x1a0;
    const MSR_MTRR_DEF_TYPE: u32 = 0x2ff;
    let e = |index, data| kvm_msr_entry {
        index,
        data,
        ..Default::default()
    };
    vec![
        e(MSR_IA32_SYSENTER_CS, 0),
        e(MSR_IA32_SYSENTER_ESP, 0),
        e(MSR_IA32_SYSENTER_EIP, 0),
        e(MSR_STAR, 0),
        e(MSR_CSTAR, 0),
        e(MSR_KERNEL_GS_BASE, 0),
        e(MSR_SYSCALL_MASK, 0),
        e(MSR_LSTAR, 0),
        e(MSR_IA32_TSC, 0),
        // Fast string operations.
        e(MSR_IA32_MISC_ENABLE, 1),
        // MTRRs on, write-back by default.
        e(MSR_MTRR_DEF_TYPE, (1 << 11) | 6),
    ]
}

/// The FPU state at boot.
pub fn boot_fpu() -> kvm_fpu {
    kvm_fpu {
        fcw: 0x37f,
        mxcsr: 0x1f80,
        ..Default::default()
    }
}

const APIC_LVT0: usize = 0x350;
const APIC_LVT1: usize = 0x360;
const APIC_MODE_NMI: u32 = 0x4;
const APIC_MODE_EXTINT: u32 = 0x7;

fn lapic_reg(regs: &[std::os::raw::c_char; 1024], off: usize) -> u32 {
    let b: [u8; 4] = std::array::from_fn(|i| regs[off + i] as u8);
    u32::from_le_bytes(b)
}

fn set_lapic_reg(regs: &mut [std::os::raw::c_char; 1024], off: usize, v: u32) {
    for (i, b) in v.to_le_bytes().iter().enumerate() {
        regs[off + i] = *b as std::os::raw::c_char;
    }
}

/// Sets LINT0 to ExtINT (the PIC) and LINT1 to NMI, as a BIOS leaves them.
pub fn setup_lapic(vcpu: &dyn HypervisorVcpu) -> Result<(), RegsError> {
    let mut lapic = vcpu.get_lapic()?;
    let lvt0 = lapic_reg(&lapic.regs, APIC_LVT0);
    set_lapic_reg(
        &mut lapic.regs,
        APIC_LVT0,
        (lvt0 & !0x700) | (APIC_MODE_EXTINT << 8),
    );
    let lvt1 = lapic_reg(&lapic.regs, APIC_LVT1);
    set_lapic_reg(
        &mut lapic.regs,
        APIC_LVT1,
        (lvt1 & !0x700) | (APIC_MODE_NMI << 8),
    );
    vcpu.set_lapic(&lapic)?;
    Ok(())
}

/// Sets up one vCPU for boot: MSRs, FPU, LAPIC, and for the boot processor the registers
/// entering the kernel (the others wait for INIT/SIPI in the in-kernel LAPIC).
pub fn setup_vcpu(vcpu: &dyn HypervisorVcpu, entry: u64, mode: EntryMode) -> Result<(), RegsError> {
    let msrs = boot_msrs();
    let set = vcpu.set_msrs(&msrs)?;
    if set != msrs.len() {
        return Err(RegsError::Msrs {
            set,
            want: msrs.len(),
        });
    }
    vcpu.set_fpu(&boot_fpu())?;
    setup_lapic(vcpu)?;
    if vcpu.id() == 0 {
        vcpu.set_regs(&boot_regs(entry, mode))?;
        let sregs = vcpu.get_sregs()?;
        vcpu.set_sregs(&boot_sregs(sregs, mode))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gdt_entries_decode_to_the_segments_linux_expects() {
        let code = segment_from_gdt(gdt_entry(0xa09b, 0, 0xfffff), 1);
        assert_eq!(
            (
                code.selector,
                code.type_,
                code.l,
                code.db,
                code.present,
                code.s
            ),
            (8, 0xb, 1, 0, 1, 1)
        );
        assert_eq!(code.limit, 0xffff_ffff);
        let data = segment_from_gdt(gdt_entry(0xc093, 0, 0xfffff), 2);
        assert_eq!(
            (data.selector, data.type_, data.db, data.l),
            (0x10, 3, 1, 0)
        );
        let null = segment_from_gdt(0, 0);
        assert_eq!(null.unusable, 1);
    }

    #[test]
    fn long_mode_sregs_enable_paging_and_pae() {
        let s = boot_sregs(kvm_sregs::default(), EntryMode::Long64);
        assert_eq!(s.cr3, PML4_START);
        assert_ne!(s.cr0 & X86_CR0_PG, 0);
        assert_ne!(s.cr4 & X86_CR4_PAE, 0);
        assert_eq!(s.efer & (EFER_LME | EFER_LMA), EFER_LME | EFER_LMA);
        let p = boot_sregs(kvm_sregs::default(), EntryMode::Pvh);
        assert_eq!(p.cr0 & X86_CR0_PG, 0);
        assert_eq!(p.cs.db, 1);
    }
}
