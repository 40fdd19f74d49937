//! CPUID for each vCPU: the hypervisor's supported table, normalized per vCPU (APIC ids,
//! topology, the hypervisor bit), and masked by the cluster CPU template when one is given.

use crate::config::CpuidMask;
use crate::hypervisor::CpuIdEntry;

/// The CPU vendor, family, model and stepping a CPUID table describes.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct CpuModel {
    pub vendor: String,
    pub family: u32,
    pub model: u32,
    pub stepping: u32,
}

impl std::fmt::Display for CpuModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} family {:#x} model {:#x} stepping {}",
            self.vendor, self.family, self.model, self.stepping
        )
    }
}

fn find(entries: &[CpuIdEntry], function: u32, index: u32) -> Option<&CpuIdEntry> {
    entries
        .iter()
        .find(|e| e.function == function && e.index == index)
}

/// The vendor/family/model of a CPUID table (leaf 0 and 1).
pub fn cpu_model(entries: &[CpuIdEntry]) -> CpuModel {
    let mut vendor = String::new();
    if let Some(l0) = find(entries, 0, 0) {
        let mut b = Vec::with_capacity(12);
        for r in [l0.ebx, l0.edx, l0.ecx] {
            b.extend_from_slice(&r.to_le_bytes());
        }
        vendor = String::from_utf8_lossy(&b).into_owned();
    }
    let eax = find(entries, 1, 0).map(|e| e.eax).unwrap_or(0);
    let base_family = (eax >> 8) & 0xf;
    let base_model = (eax >> 4) & 0xf;
    let family = if base_family == 0xf {
        base_family + ((eax >> 20) & 0xff)
    } else {
        base_family
    };
    let model = if base_family == 0x6 || base_family == 0xf {
        (((eax >> 16) & 0xf) << 4) | base_model
    } else {
        base_model
    };
    CpuModel {
        vendor,
        family,
        model,
        stepping: eax & 0xf,
    }
}

const LEAF1_ECX_HYPERVISOR: u32 = 1 << 31;
const LEAF1_EDX_HTT: u32 = 1 << 28;

/// The CPUID table for vCPU `id` of a `count`-vCPU VM.
pub fn vcpu_cpuid(
    supported: &[CpuIdEntry],
    id: u8,
    count: u8,
    template: &[CpuidMask],
) -> Vec<CpuIdEntry> {
    let amd = cpu_model(supported).vendor == "AuthenticAMD";
    // Bits needed to number `count` cores.
    let core_bits = u32::from(count).next_power_of_two().trailing_zeros();
    let mut out = Vec::with_capacity(supported.len());
    for e in supported {
        let mut e = *e;
        match e.function {
            0x1 => {
                // APIC id, logical processor count, CLFLUSH line size (8 * 8 bytes).
                e.ebx = (u32::from(id) << 24) | (u32::from(count) << 16) | (8 << 8);
                e.ecx |= LEAF1_ECX_HYPERVISOR;
                if count > 1 {
                    e.edx |= LEAF1_EDX_HTT;
                } else {
                    e.edx &= !LEAF1_EDX_HTT;
                }
            }
            0x4 => {
                // Intel deterministic cache parameters: cores per package - 1 in 31:26,
                // and the cache is private to one (single-threaded) core.
                e.eax &= !(0xfc00_0000 | 0x03ff_c000);
                e.eax |= (u32::from(count) - 1) << 26;
            }
            0xb | 0x1f => {
                // Extended topology: one thread per core, `count` cores per package.
                e.edx = u32::from(id);
                match e.index {
                    0 => {
                        e.eax = 0;
                        e.ebx = 1;
                        e.ecx = 1 << 8;
                    }
                    1 => {
                        e.eax = core_bits;
                        e.ebx = u32::from(count);
                        e.ecx = (2 << 8) | 1;
                    }
                    i => {
                        e.eax = 0;
                        e.ebx = 0;
                        e.ecx = i;
                    }
                }
            }
            0x8000_0008 if amd => {
                // Number of cores - 1 and the APIC id size.
                e.ecx = (e.ecx & !0xf0ff) | (core_bits << 12) | (u32::from(count) - 1);
            }
            0x8000_001e if amd => {
                e.eax = u32::from(id);
                e.ebx = u32::from(id) & 0xff;
                e.ecx = 0;
            }
            _ => {}
        }
        for m in template {
            if m.leaf == e.function && (m.subleaf == e.index || e.flags & 1 == 0) {
                match m.register {
                    0 => e.eax &= m.keep,
                    1 => e.ebx &= m.keep,
                    2 => e.ecx &= m.keep,
                    _ => e.edx &= m.keep,
                }
            }
        }
        out.push(e);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table() -> Vec<CpuIdEntry> {
        vec![
            CpuIdEntry {
                function: 0,
                eax: 0x10,
                ebx: u32::from_le_bytes(*b"Genu"),
                edx: u32::from_le_bytes(*b"ineI"),
                ecx: u32::from_le_bytes(*b"ntel"),
                ..Default::default()
            },
            CpuIdEntry {
                function: 1,
                eax: 0x000906ea,
                ebx: 0xff00_0000,
                ecx: 0x7ffa_3203,
                edx: 0xbfeb_fbff,
                ..Default::default()
            },
            CpuIdEntry {
                function: 0xb,
                index: 1,
                flags: 1,
                ..Default::default()
            },
        ]
    }

    #[test]
    fn model_is_read_from_leaf_0_and_1() {
        let m = cpu_model(&table());
        assert_eq!(m.vendor, "GenuineIntel");
        assert_eq!((m.family, m.model, m.stepping), (6, 0x9e, 0xa));
    }

    #[test]
    fn each_vcpu_gets_its_apic_id_topology_and_the_hypervisor_bit() {
        let t = vcpu_cpuid(&table(), 1, 2, &[]);
        let l1 = t.iter().find(|e| e.function == 1).unwrap();
        assert_eq!(l1.ebx >> 24, 1);
        assert_eq!((l1.ebx >> 16) & 0xff, 2);
        assert_ne!(l1.ecx & LEAF1_ECX_HYPERVISOR, 0);
        assert_ne!(l1.edx & LEAF1_EDX_HTT, 0);
        let lb = t.iter().find(|e| e.function == 0xb).unwrap();
        assert_eq!((lb.edx, lb.ebx, lb.eax), (1, 2, 1));
    }

    #[test]
    fn the_cpu_template_masks_features() {
        let mask = CpuidMask {
            leaf: 1,
            subleaf: 0,
            register: 2,
            keep: !(1 << 5),
        };
        let t = vcpu_cpuid(&table(), 0, 1, &[mask]);
        let l1 = t.iter().find(|e| e.function == 1).unwrap();
        assert_eq!(l1.ecx & (1 << 5), 0);
        assert_ne!(l1.ecx & 1, 0);
        assert_eq!(l1.edx & LEAF1_EDX_HTT, 0);
    }
}
