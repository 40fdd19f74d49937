//! What the VM's unit tests share.

use std::path::{Path, PathBuf};

/// A minimal 64-bit ELF with one loadable segment at 1 MiB.
pub(super) fn tiny_elf(dir: &Path) -> PathBuf {
    let code = [0xf4u8]; // hlt
    let mut b = vec![0u8; 0x78];
    b[..4].copy_from_slice(b"\x7fELF");
    b[4] = 2; // 64-bit
    b[5] = 1; // little endian
    b[6] = 1;
    b[16..18].copy_from_slice(&2u16.to_le_bytes()); // ET_EXEC
    b[18..20].copy_from_slice(&62u16.to_le_bytes()); // x86_64
    b[20..24].copy_from_slice(&1u32.to_le_bytes());
    b[24..32].copy_from_slice(&0x10_0000u64.to_le_bytes()); // entry
    b[32..40].copy_from_slice(&64u64.to_le_bytes()); // phoff
    b[52..54].copy_from_slice(&64u16.to_le_bytes());
    b[54..56].copy_from_slice(&56u16.to_le_bytes());
    b[56..58].copy_from_slice(&1u16.to_le_bytes());
    let ph = &mut b[64..120];
    ph[0..4].copy_from_slice(&1u32.to_le_bytes()); // PT_LOAD
    ph[4..8].copy_from_slice(&5u32.to_le_bytes());
    ph[8..16].copy_from_slice(&0x78u64.to_le_bytes()); // offset
    ph[16..24].copy_from_slice(&0x10_0000u64.to_le_bytes());
    ph[24..32].copy_from_slice(&0x10_0000u64.to_le_bytes());
    ph[32..40].copy_from_slice(&1u64.to_le_bytes());
    ph[40..48].copy_from_slice(&1u64.to_le_bytes());
    b.extend_from_slice(&code);
    let p = dir.join("vmlinux");
    std::fs::write(&p, b).unwrap();
    p
}
