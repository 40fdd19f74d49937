//! The cluster CPU template: the intersection of every node's CPU config, so
//! that a snapshot taken on one node of a cluster restores on any other. The JSON
//! itself is [`agentenv_core::cpu_template`]'s, which the VMM reads too.

use std::collections::BTreeSet;

use agentenv_core::cpu_template::{
    CpuTemplate as CpuConfig, CpuidModifier, MsrModifier, RegisterModifier, bitmap_digits,
};

/// Why CPU configs could not be intersected.
#[derive(Debug, thiserror::Error)]
pub enum CpuTemplateError {
    #[error("invalid CPU config JSON: {0}")]
    Json(#[from] serde_json::Error),
    #[error("invalid hex number {0:?}")]
    Hex(String),
    #[error("invalid bitmap {0:?}: expected up to {1} binary digits, optionally prefixed with 0b")]
    Bitmap(String, u32),
}

/// CPUID leaves KVM does not let a template change.
const READ_ONLY_LEAVES: [u32; 2] = [0xb, 0x1f];

/// A node's CPU config. Leaves are told apart by their flags too, so every CPUID modifier
/// must have them.
fn parse_config(json: &str) -> Result<CpuConfig, CpuTemplateError> {
    let config: CpuConfig = serde_json::from_str(json)?;
    if config.cpuid_modifiers.iter().any(|m| m.flags.is_none()) {
        return Err(<serde_json::Error as serde::de::Error>::missing_field("flags").into());
    }
    Ok(config)
}

fn parse_hex(s: &str) -> Result<u32, CpuTemplateError> {
    agentenv_core::cpu_template::parse_hex(s).ok_or_else(|| CpuTemplateError::Hex(s.to_string()))
}

fn parse_bitmap(s: &str, bits: u32) -> Result<u64, CpuTemplateError> {
    let bad = || CpuTemplateError::Bitmap(s.to_string(), bits);
    let digits = bitmap_digits(s, bits).ok_or_else(bad)?;
    u64::from_str_radix(digits, 2).map_err(|_| bad())
}

type CpuidKey = (u32, u32, Option<i64>);

fn cpuid_key(m: &CpuidModifier) -> Result<CpuidKey, CpuTemplateError> {
    Ok((parse_hex(&m.leaf)?, parse_hex(&m.subleaf)?, m.flags))
}

/// Intersects CPU configs: capabilities present everywhere; CPUID registers
/// and MSRs present everywhere with their bitmaps ANDed; read-only leaves
/// dropped. Leaf order, leaf spelling and flags follow the first config.
/// Empty input gives an empty string.
pub fn intersect_cpu_configs(configs: &[&str]) -> Result<String, CpuTemplateError> {
    let Some((first, rest)) = configs.split_first() else {
        return Ok(String::new());
    };
    let first = parse_config(first)?;
    let rest: Vec<CpuConfig> = rest
        .iter()
        .map(|c| parse_config(c))
        .collect::<Result<_, _>>()?;

    let mut caps: BTreeSet<String> = first.kvm_capabilities.iter().cloned().collect();
    for c in &rest {
        let other: BTreeSet<&String> = c.kvm_capabilities.iter().collect();
        caps.retain(|k| other.contains(k));
    }

    let mut cpuid_out = Vec::new();
    for leaf in &first.cpuid_modifiers {
        let key = cpuid_key(leaf)?;
        if READ_ONLY_LEAVES.contains(&key.0) {
            continue;
        }
        let mut matches = Vec::with_capacity(rest.len());
        for c in &rest {
            let mut found = None;
            for m in &c.cpuid_modifiers {
                if cpuid_key(m)? == key {
                    found = Some(m);
                    break;
                }
            }
            matches.push(found);
        }
        if matches.iter().any(Option::is_none) {
            continue;
        }
        let mut regs = Vec::new();
        'reg: for reg in &leaf.modifiers {
            let mut value = parse_bitmap(&reg.bitmap, 32)?;
            for m in matches.iter().flatten() {
                match m.modifiers.iter().find(|r| r.register == reg.register) {
                    Some(r) => value &= parse_bitmap(&r.bitmap, 32)?,
                    None => continue 'reg,
                }
            }
            regs.push(RegisterModifier {
                register: reg.register.clone(),
                bitmap: format!("0b{value:032b}"),
            });
        }
        if !regs.is_empty() {
            cpuid_out.push(CpuidModifier {
                leaf: leaf.leaf.clone(),
                subleaf: leaf.subleaf.clone(),
                flags: leaf.flags,
                modifiers: regs,
            });
        }
    }

    let mut msr_out = Vec::new();
    'msr: for msr in &first.msr_modifiers {
        let addr = parse_hex(&msr.addr)?;
        let mut value = parse_bitmap(&msr.bitmap, 64)?;
        for c in &rest {
            let mut found = false;
            for m in &c.msr_modifiers {
                if parse_hex(&m.addr)? == addr {
                    value &= parse_bitmap(&m.bitmap, 64)?;
                    found = true;
                    break;
                }
            }
            if !found {
                continue 'msr;
            }
        }
        msr_out.push(MsrModifier {
            addr: msr.addr.clone(),
            bitmap: format!("0b{value:064b}"),
        });
    }

    Ok(serde_json::to_string(&CpuConfig {
        kvm_capabilities: caps.into_iter().collect(),
        cpuid_modifiers: cpuid_out,
        msr_modifiers: msr_out,
    })?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b32(v: u32) -> String {
        format!("0b{v:032b}")
    }

    fn b64(v: u64) -> String {
        format!("0b{v:064b}")
    }

    #[test]
    fn empty_input_gives_empty_string() {
        assert_eq!(intersect_cpu_configs(&[]).unwrap(), "");
    }

    #[test]
    fn single_config_drops_read_only_leaves_and_is_otherwise_identical() {
        let cfg = format!(
            r#"{{"kvm_capabilities":["1","7"],"cpuid_modifiers":[{{"leaf":"0x1","subleaf":"0x0","flags":0,"modifiers":[{{"register":"ecx","bitmap":"{}"}}]}},{{"leaf":"0xb","subleaf":"0x0","flags":1,"modifiers":[{{"register":"eax","bitmap":"{}"}}]}},{{"leaf":"0x1f","subleaf":"0x0","flags":1,"modifiers":[{{"register":"eax","bitmap":"{}"}}]}}],"msr_modifiers":[{{"addr":"0x10a","bitmap":"{}"}}]}}"#,
            b32(0xF0F0),
            b32(1),
            b32(1),
            b64(0xFF)
        );
        let want = format!(
            r#"{{"kvm_capabilities":["1","7"],"cpuid_modifiers":[{{"leaf":"0x1","subleaf":"0x0","flags":0,"modifiers":[{{"register":"ecx","bitmap":"{}"}}]}}],"msr_modifiers":[{{"addr":"0x10a","bitmap":"{}"}}]}}"#,
            b32(0xF0F0),
            b64(0xFF)
        );
        assert_eq!(intersect_cpu_configs(&[&cfg]).unwrap(), want);
    }

    #[test]
    fn cpuid_and_msr_bitmaps_are_anded_and_extras_dropped() {
        let a = format!(
            r#"{{"kvm_capabilities":["3","1","2"],"cpuid_modifiers":[{{"leaf":"0x01","subleaf":"0x0","flags":0,"modifiers":[{{"register":"ecx","bitmap":"{}"}},{{"register":"edx","bitmap":"{}"}}]}},{{"leaf":"0x7","subleaf":"0x0","flags":1,"modifiers":[{{"register":"ebx","bitmap":"{}"}}]}}],"msr_modifiers":[{{"addr":"0x10a","bitmap":"{}"}},{{"addr":"0x48","bitmap":"{}"}}]}}"#,
            b32(0b1110),
            b32(0xFF),
            b32(1),
            b64(0b1100),
            b64(1)
        );
        // Hex spelled differently (0x1 vs 0x01); no leaf 0x7; no edx; no MSR 0x48.
        let b = format!(
            r#"{{"kvm_capabilities":["2","3","9"],"cpuid_modifiers":[{{"leaf":"0x1","subleaf":"0x00","flags":0,"modifiers":[{{"register":"ecx","bitmap":"{}"}}]}}],"msr_modifiers":[{{"addr":"0x10A","bitmap":"1010"}}]}}"#,
            b32(0b0111)
        );
        let out: serde_json::Value =
            serde_json::from_str(&intersect_cpu_configs(&[&a, &b]).unwrap()).unwrap();
        assert_eq!(out["kvm_capabilities"], serde_json::json!(["2", "3"]));
        let cpuid = out["cpuid_modifiers"].as_array().unwrap();
        assert_eq!(cpuid.len(), 1);
        assert_eq!(cpuid[0]["leaf"], "0x01", "first config's spelling is kept");
        assert_eq!(cpuid[0]["modifiers"].as_array().unwrap().len(), 1);
        assert_eq!(cpuid[0]["modifiers"][0]["bitmap"], b32(0b0110));
        let msr = out["msr_modifiers"].as_array().unwrap();
        assert_eq!(msr.len(), 1);
        assert_eq!(msr[0]["bitmap"], b64(0b1000));
    }

    #[test]
    fn three_way_and() {
        let mk = |v: u32| {
            format!(
                r#"{{"cpuid_modifiers":[{{"leaf":"0x1","subleaf":"0x0","flags":0,"modifiers":[{{"register":"ecx","bitmap":"{}"}}]}}]}}"#,
                b32(v)
            )
        };
        let (a, b, c) = (mk(0b1111), mk(0b0111), mk(0b1011));
        let out: serde_json::Value =
            serde_json::from_str(&intersect_cpu_configs(&[&a, &b, &c]).unwrap()).unwrap();
        assert_eq!(
            out["cpuid_modifiers"][0]["modifiers"][0]["bitmap"],
            b32(0b0011)
        );
    }

    #[test]
    fn identical_configs_pass_through_and_empty_arrays_stay_arrays() {
        let cfg = format!(
            r#"{{"kvm_capabilities":[],"cpuid_modifiers":[{{"leaf":"0x1","subleaf":"0x0","flags":0,"modifiers":[{{"register":"ecx","bitmap":"{}"}}]}}],"msr_modifiers":[]}}"#,
            b32(5)
        );
        assert_eq!(intersect_cpu_configs(&[&cfg, &cfg]).unwrap(), cfg);
        assert_eq!(
            intersect_cpu_configs(&["{}"]).unwrap(),
            r#"{"kvm_capabilities":[],"cpuid_modifiers":[],"msr_modifiers":[]}"#
        );
    }

    #[test]
    fn invalid_json_hex_or_bitmaps_are_errors() {
        assert!(matches!(
            intersect_cpu_configs(&["{"]),
            Err(CpuTemplateError::Json(_))
        ));
        let bad_hex =
            r#"{"cpuid_modifiers":[{"leaf":"0xZZ","subleaf":"0","flags":0,"modifiers":[]}]}"#;
        assert!(matches!(
            intersect_cpu_configs(&[bad_hex]),
            Err(CpuTemplateError::Hex(_))
        ));
        let no_flags = r#"{"cpuid_modifiers":[{"leaf":"0x1","subleaf":"0","modifiers":[]}]}"#;
        assert!(matches!(
            intersect_cpu_configs(&["{}", no_flags]),
            Err(CpuTemplateError::Json(_))
        ));
        let bad_bits = r#"{"msr_modifiers":[{"addr":"0x1","bitmap":"0b102"}]}"#;
        assert!(matches!(
            intersect_cpu_configs(&[bad_bits]),
            Err(CpuTemplateError::Bitmap(..))
        ));
    }
}
