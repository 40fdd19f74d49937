//! The Intel MultiProcessor table: how an SMP guest finds its CPUs, the IOAPIC and the
//! interrupt routing without ACPI. Written at [`EBDA_START`].

use vm_memory::{Bytes, GuestAddress};

use super::{APIC_START, EBDA_START, IOAPIC_START};
use crate::memory::GuestMemoryMmap;

/// IOAPIC pins (and ISA IRQs routed 1:1 to them).
pub const IOAPIC_PINS: u8 = 24;

#[derive(Debug, thiserror::Error)]
pub enum MpTableError {
    #[error("{0} vCPUs do not fit in an MP table (at most 254)")]
    TooManyCpus(u8),
    #[error("writing the MP table failed: {0}")]
    Memory(#[from] vm_memory::GuestMemoryError),
}

fn checksum(b: &[u8]) -> u8 {
    b.iter().fold(0u8, |a, x| a.wrapping_add(*x)).wrapping_neg()
}

/// The MP table bytes for `cpus` CPUs placed at `base` (floating pointer first).
pub fn build(cpus: u8, base: u64) -> Result<Vec<u8>, MpTableError> {
    if cpus == 0 || cpus > 254 {
        return Err(MpTableError::TooManyCpus(cpus));
    }
    let ioapic_id = cpus;
    let mut entries: Vec<u8> = Vec::new();
    let mut count: u16 = 0;
    for id in 0..cpus {
        let mut e = [0u8; 20];
        e[0] = 0; // processor
        e[1] = id;
        e[2] = 0x14; // LAPIC version
        e[3] = 1 | if id == 0 { 2 } else { 0 }; // enabled, BSP
        e[4..8].copy_from_slice(&0x600u32.to_le_bytes()); // signature: family 6
        e[8..12].copy_from_slice(&0x201u32.to_le_bytes()); // FPU | APIC
        entries.extend_from_slice(&e);
        count += 1;
    }
    // Bus 0: ISA.
    entries.extend_from_slice(&[1, 0, b'I', b'S', b'A', b' ', b' ', b' ']);
    count += 1;
    // The IOAPIC.
    let mut e = [2u8, ioapic_id, 0x11, 1, 0, 0, 0, 0];
    e[4..8].copy_from_slice(&(IOAPIC_START as u32).to_le_bytes());
    entries.extend_from_slice(&e);
    count += 1;
    // ISA IRQ i → IOAPIC pin i (type INT, conforming polarity/trigger).
    for irq in 0..IOAPIC_PINS {
        entries.extend_from_slice(&[3, 0, 0, 0, 0, irq, ioapic_id, irq]);
        count += 1;
    }
    // LINT0: ExtINT, LINT1: NMI, on every LAPIC.
    entries.extend_from_slice(&[4, 3, 0, 0, 0, 0, 0xff, 0]);
    entries.extend_from_slice(&[4, 1, 0, 0, 0, 0, 0xff, 1]);
    count += 2;

    let table_addr = base + 16;
    let mut header = [0u8; 44];
    header[0..4].copy_from_slice(b"PCMP");
    let len = (44 + entries.len()) as u16;
    header[4..6].copy_from_slice(&len.to_le_bytes());
    header[6] = 4; // spec revision 1.4
    header[8..16].copy_from_slice(b"AGENTENV");
    header[16..28].copy_from_slice(b"MICROVM     ");
    header[34..36].copy_from_slice(&count.to_le_bytes());
    header[36..40].copy_from_slice(&(APIC_START as u32).to_le_bytes());
    let mut table = header.to_vec();
    table.extend_from_slice(&entries);
    table[7] = checksum(&table);

    let mut fp = [0u8; 16];
    fp[0..4].copy_from_slice(b"_MP_");
    fp[4..8].copy_from_slice(&(table_addr as u32).to_le_bytes());
    fp[8] = 1; // length in 16-byte units
    fp[9] = 4;
    fp[10] = checksum(&fp);

    let mut out = fp.to_vec();
    out.extend_from_slice(&table);
    Ok(out)
}

/// Writes the MP table for `cpus` CPUs at the start of the EBDA.
pub fn setup(mem: &GuestMemoryMmap, cpus: u8) -> Result<(), MpTableError> {
    let bytes = build(cpus, EBDA_START)?;
    mem.write_slice(&bytes, GuestAddress(EBDA_START))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_checksums_are_zero_and_every_cpu_is_listed() {
        let b = build(2, EBDA_START).unwrap();
        assert_eq!(&b[0..4], b"_MP_");
        assert_eq!(b[..16].iter().fold(0u8, |a, x| a.wrapping_add(*x)), 0);
        let len = u16::from_le_bytes([b[20], b[21]]) as usize;
        let table = &b[16..16 + len];
        assert_eq!(&table[0..4], b"PCMP");
        assert_eq!(table.iter().fold(0u8, |a, x| a.wrapping_add(*x)), 0);
        let cpus: Vec<u8> = table[44..]
            .chunks(20)
            .take(2)
            .filter(|e| e[0] == 0)
            .map(|e| e[1])
            .collect();
        assert_eq!(cpus, vec![0, 1]);
        assert!(matches!(build(0, 0), Err(MpTableError::TooManyCpus(0))));
    }
}
