//! x86_64 machine setup: the guest-physical layout, CPUID, MSRs, registers, page tables,
//! the LAPIC, boot parameters and the MP table.

pub mod cpuid;
pub mod mptable;
pub mod regs;

/// Where the boot GDT lives.
pub const BOOT_GDT_START: u64 = 0x500;
/// Where the boot IDT lives (one empty entry).
pub const BOOT_IDT_START: u64 = 0x520;
/// PVH start info.
pub const PVH_INFO_START: u64 = 0x6000;
/// PVH memory map (after the start info).
pub const PVH_MEMMAP_START: u64 = 0x6100;
/// The Linux zero page (`boot_params`).
pub const ZERO_PAGE_START: u64 = 0x7000;
/// The boot stack grows down from here.
pub const BOOT_STACK_POINTER: u64 = 0x8ff0;
/// Identity page tables: PML4, one PDPT, four page directories (4 GiB in 2 MiB pages).
pub const PML4_START: u64 = 0x9000;
pub const PDPTE_START: u64 = 0xa000;
pub const PDE_START: u64 = 0xb000;
pub const PDE_COUNT: u64 = 4;
/// The kernel command line.
pub const CMDLINE_START: u64 = 0x20000;
/// The extended BIOS data area: the MP table starts here.
pub const EBDA_START: u64 = 0x9fc00;
/// Where high memory (and the kernel) starts.
pub const HIMEM_START: u64 = 0x10_0000;
/// The 32-bit MMIO gap below 4 GiB: no RAM from here to 4 GiB.
pub const MMIO_GAP_START: u64 = 0xc000_0000;
pub const MMIO_GAP_END: u64 = 1 << 32;
/// Virtio-mmio devices: one 4 KiB slot each from here.
pub const VIRTIO_MMIO_START: u64 = 0xd000_0000;
pub const VIRTIO_MMIO_SLOT: u64 = 0x1000;
/// The first IRQ given to a virtio-mmio device.
pub const VIRTIO_IRQ_BASE: u32 = 5;
/// The IOAPIC and the LAPIC (in-kernel).
pub const IOAPIC_START: u64 = 0xfec0_0000;
pub const APIC_START: u64 = 0xfee0_0000;
/// KVM's TSS (three pages), just below the BIOS ROM area.
pub const KVM_TSS_ADDRESS: u64 = 0xfffb_d000;

/// The RAM ranges of a guest of `size` bytes: below the MMIO gap, the rest above 4 GiB.
pub fn ram_ranges(size: u64) -> Vec<(u64, u64)> {
    if size <= MMIO_GAP_START {
        vec![(0, size)]
    } else {
        vec![(0, MMIO_GAP_START), (MMIO_GAP_END, size - MMIO_GAP_START)]
    }
}

/// The e820 map: (address, size, type) with type 1 = RAM, 2 = reserved.
pub fn e820_map(size: u64) -> Vec<(u64, u64, u32)> {
    let mut out = vec![
        (0, EBDA_START, 1),
        (EBDA_START, HIMEM_START - EBDA_START, 2),
    ];
    for (base, len) in ram_ranges(size) {
        let start = base.max(HIMEM_START);
        let end = base + len;
        if end > start {
            out.push((start, end - start, 1));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn large_guests_leave_the_32_bit_mmio_gap_free() {
        assert_eq!(ram_ranges(128 << 20), vec![(0, 128 << 20)]);
        let r = ram_ranges(4 << 30);
        assert_eq!(
            r,
            vec![(0, MMIO_GAP_START), (1 << 32, (4 << 30) - MMIO_GAP_START)]
        );
        let e = e820_map(4 << 30);
        assert_eq!(e[0], (0, EBDA_START, 1));
        assert_eq!(e[2], (HIMEM_START, MMIO_GAP_START - HIMEM_START, 1));
        assert_eq!(e[3].0, 1 << 32);
        const { assert!(VIRTIO_MMIO_START >= MMIO_GAP_START && IOAPIC_START < MMIO_GAP_END) };
    }
}
