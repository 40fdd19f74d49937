//! The CPU template JSON: what a node reports as its CPU config, what the scheduler hands
//! out as the cluster template (the intersection of every node's config), and what the VMM
//! applies to its vCPUs.
//!
//! This file is the one definition of that JSON and of how its fields read. agentenv-core
//! exports it for the scheduler; the VMM compiles the same file as a module of its own
//! (`#[path]`), because it is built as a small static binary that does not depend on
//! agentenv-core (tokio, tonic, opendal, ...). Hence it uses nothing but `serde` and `std`,
//! and each crate adds what it does with a template (the scheduler intersects templates,
//! the VMM turns one into masks) on its side.
//!
//! ```json
//! {"kvm_capabilities": ["7", "!9"],
//!  "cpuid_modifiers": [{"leaf": "0x1", "subleaf": "0x0", "flags": 0,
//!                       "modifiers": [{"register": "ecx", "bitmap": "0b...32 digits"}]}],
//!  "msr_modifiers": [{"addr": "0x10a", "bitmap": "0b...64 digits"}]}
//! ```

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A CPU template: KVM capabilities, CPUID register masks and MSR masks. Every list may be
/// left out.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CpuTemplate {
    /// KVM capability numbers (`"N"`), or `"!N"` for one the template does not need.
    #[serde(default)]
    pub kvm_capabilities: Vec<String>,
    #[serde(default)]
    pub cpuid_modifiers: Vec<CpuidModifier>,
    #[serde(default)]
    pub msr_modifiers: Vec<MsrModifier>,
}

/// The register masks of one CPUID leaf and subleaf.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CpuidModifier {
    /// The leaf, a hex number ([`parse_hex`]).
    pub leaf: String,
    /// The subleaf, a hex number ([`parse_hex`]).
    pub subleaf: String,
    /// KVM's flags of the CPUID entry. The VMM takes a modifier without them (`None`,
    /// written back as 0); the scheduler, which tells leaves apart by them, does not.
    #[serde(
        default,
        deserialize_with = "flags_present",
        serialize_with = "flags_or_zero"
    )]
    pub flags: Option<i64>,
    #[serde(default)]
    pub modifiers: Vec<RegisterModifier>,
}

/// The mask of one CPUID output register.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegisterModifier {
    /// `eax`, `ebx`, `ecx` or `edx` ([`register_index`]).
    pub register: String,
    /// Up to 32 binary digits ([`bitmap_digits`]).
    pub bitmap: String,
}

/// The mask of one MSR.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MsrModifier {
    /// The MSR's index, a hex number ([`parse_hex`]).
    pub addr: String,
    /// Up to 64 binary digits ([`bitmap_digits`]).
    pub bitmap: String,
}

/// `flags`, when given, is a number (`null` is refused, as for any required number).
fn flags_present<'de, D: Deserializer<'de>>(d: D) -> Result<Option<i64>, D::Error> {
    i64::deserialize(d).map(Some)
}

fn flags_or_zero<S: Serializer>(flags: &Option<i64>, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_i64(flags.unwrap_or(0))
}

/// A hex number with or without `0x` (`0X`), surrounding blanks ignored.
pub fn parse_hex(s: &str) -> Option<u32> {
    let t = s.trim();
    let digits = t
        .strip_prefix("0x")
        .or_else(|| t.strip_prefix("0X"))
        .unwrap_or(t);
    u32::from_str_radix(digits, 16).ok()
}

/// The digits of a bitmap of at most `bits` digits, optionally prefixed with `0b`
/// (surrounding blanks ignored); `None` when there are none or too many. What a digit may
/// be is the reader's to check: `0` and `1` for the scheduler, also `x` for the VMM.
pub fn bitmap_digits(s: &str, bits: u32) -> Option<&str> {
    let t = s.trim();
    let digits = t.strip_prefix("0b").unwrap_or(t);
    (!digits.is_empty() && digits.len() <= bits as usize).then_some(digits)
}

/// A register name (any case) as its index: 0 `eax`, 1 `ebx`, 2 `ecx`, 3 `edx`.
pub fn register_index(name: &str) -> Option<u8> {
    match name.to_ascii_lowercase().as_str() {
        "eax" => Some(0),
        "ebx" => Some(1),
        "ecx" => Some(2),
        "edx" => Some(3),
        _ => None,
    }
}

/// A `kvm_capabilities` entry: the capability number, and whether the host must have it
/// (`"N"`) or not (`"!N"`, which asks for nothing).
pub fn kvm_capability(entry: &str) -> Option<(u32, bool)> {
    let t = entry.trim();
    match t.strip_prefix('!') {
        Some(digits) => digits.parse().ok().map(|cap| (cap, false)),
        None => t.parse().ok().map(|cap| (cap, true)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_may_be_left_out_but_not_null_and_are_written_as_zero_when_absent() {
        let t: CpuTemplate =
            serde_json::from_str(r#"{"cpuid_modifiers":[{"leaf":"0x1","subleaf":"0"}]}"#).unwrap();
        assert_eq!(t.cpuid_modifiers[0].flags, None);
        assert_eq!(
            serde_json::to_string(&t).unwrap(),
            r#"{"kvm_capabilities":[],"cpuid_modifiers":[{"leaf":"0x1","subleaf":"0","flags":0,"modifiers":[]}],"msr_modifiers":[]}"#
        );
        let null = r#"{"cpuid_modifiers":[{"leaf":"0x1","subleaf":"0","flags":null}]}"#;
        assert!(serde_json::from_str::<CpuTemplate>(null).is_err());
        let one = r#"{"cpuid_modifiers":[{"leaf":"0x1","subleaf":"0","flags":1}]}"#;
        let t: CpuTemplate = serde_json::from_str(one).unwrap();
        assert_eq!(t.cpuid_modifiers[0].flags, Some(1));
    }

    #[test]
    fn numbers_bitmaps_registers_and_capabilities_read_as_documented() {
        assert_eq!(parse_hex(" 0x1F "), Some(0x1f));
        assert_eq!(parse_hex("0X10a"), Some(0x10a));
        assert_eq!(parse_hex("zz"), None);
        assert_eq!(bitmap_digits(" 0b101 ", 32), Some("101"));
        assert_eq!(bitmap_digits("0b", 32), None);
        assert_eq!(bitmap_digits(&"1".repeat(33), 32), None);
        assert_eq!(register_index("ECX"), Some(2));
        assert_eq!(register_index("rax"), None);
        assert_eq!(kvm_capability(" 7 "), Some((7, true)));
        assert_eq!(kvm_capability("!9"), Some((9, false)));
        assert_eq!(kvm_capability("x"), None);
    }
}
