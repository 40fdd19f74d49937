//! The VM configuration, checked as a whole before anything is created.

use std::collections::HashSet;
use std::io::Read;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// The most vCPUs a VM may have whatever the hypervisor allows (APIC ids are one byte and
/// the MP table lists every CPU).
pub const MAX_VCPUS: u8 = 254;
/// The smallest guest.
pub const MIN_MEMORY_MIB: u64 = 16;
/// The largest guest (1 TiB).
pub const MAX_MEMORY_MIB: u64 = 1 << 20;
/// Room for the kernel command line, the VMM's own parameters included.
pub const CMDLINE_MAX: usize = 4096;
/// What the VMM keeps of [`CMDLINE_MAX`] for the parameters it appends.
pub const CMDLINE_RESERVED: usize = 1024;
/// Virtio-mmio devices get IRQs 5..=23 (the IOAPIC's pins).
pub const MAX_VIRTIO_DEVICES: usize = 19;

/// Where guest memory lives.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum MemoryBacking {
    /// Private anonymous memory.
    #[default]
    Anonymous,
    /// A file mapped shared (created or truncated to the memory size): the guest's memory is
    /// the file, e.g. for a snapshot written by another process.
    File { path: PathBuf },
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DriveConfig {
    pub id: String,
    pub path: PathBuf,
    #[serde(default)]
    pub read_only: bool,
    #[serde(default)]
    pub is_root: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetConfig {
    pub id: String,
    /// The tap device on the host (in the VMM's network namespace).
    pub tap: String,
    /// `aa:bb:cc:dd:ee:ff`, unicast.
    pub guest_mac: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VsockConfig {
    pub guest_cid: u32,
    /// The unix socket the host side listens on (Firecracker-style: `uds_path` for
    /// host-initiated connections, `uds_path_<port>` for guest-initiated ones).
    pub uds_path: PathBuf,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BalloonConfig {
    pub amount_mib: u64,
    #[serde(default)]
    pub deflate_on_oom: bool,
    /// 0 turns statistics off.
    #[serde(default)]
    pub stats_polling_interval_s: u16,
}

// The scheduler's cluster CPU template (the JSON the scheduler hands out: the intersection
// of every node's CPU config), defined in `crate::cpu_template`. CPUID registers listed
// are masked with their bitmap; `x` digits keep the host's bit.
pub use crate::cpu_template::{CpuTemplate, CpuidModifier, MsrModifier, RegisterModifier};
use crate::cpu_template::{bitmap_digits, kvm_capability, parse_hex, register_index};

/// One CPUID register mask of a template, parsed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CpuidMask {
    pub leaf: u32,
    pub subleaf: u32,
    /// 0 eax, 1 ebx, 2 ecx, 3 edx.
    pub register: u8,
    /// Bits that may stay set.
    pub keep: u32,
}

impl CpuTemplate {
    /// Parses a template from the scheduler's JSON (an empty string is no template).
    pub fn from_json(json: &str) -> Result<Option<Self>, ConfigError> {
        if json.trim().is_empty() {
            return Ok(None);
        }
        serde_json::from_str(json)
            .map(Some)
            .map_err(|e| invalid("cpu_template", format!("not a CPU template: {e}")))
    }

    /// The CPUID masks, checked.
    pub fn cpuid_masks(&self) -> Result<Vec<CpuidMask>, ConfigError> {
        let mut out = Vec::new();
        for (i, m) in self.cpuid_modifiers.iter().enumerate() {
            let field = format!("cpu_template.cpuid_modifiers[{i}]");
            let leaf = parse_hex(&m.leaf)
                .ok_or_else(|| invalid(&field, format!("leaf {:?} is not a hex number", m.leaf)))?;
            let subleaf = parse_hex(&m.subleaf).ok_or_else(|| {
                invalid(
                    &field,
                    format!("subleaf {:?} is not a hex number", m.subleaf),
                )
            })?;
            for r in &m.modifiers {
                let register = register_index(&r.register).ok_or_else(|| {
                    invalid(
                        &field,
                        format!(
                            "register {:?} is not one of eax, ebx, ecx, edx",
                            r.register.to_ascii_lowercase()
                        ),
                    )
                })?;
                let keep = parse_mask(&r.bitmap, 32).ok_or_else(|| {
                    invalid(
                        &field,
                        format!(
                            "bitmap {:?} is not up to 32 binary digits (0, 1, x), optionally prefixed with 0b",
                            r.bitmap
                        ),
                    )
                })? as u32;
                out.push(CpuidMask {
                    leaf,
                    subleaf,
                    register,
                    keep,
                });
            }
        }
        Ok(out)
    }
}

impl CpuTemplate {
    /// The MSR masks `(index, bits that may stay set)`, checked.
    pub fn msr_masks(&self) -> Result<Vec<(u32, u64)>, ConfigError> {
        let mut out = Vec::new();
        for (i, m) in self.msr_modifiers.iter().enumerate() {
            let field = format!("cpu_template.msr_modifiers[{i}]");
            let addr = parse_hex(&m.addr)
                .ok_or_else(|| invalid(&field, format!("addr {:?} is not a hex number", m.addr)))?;
            let keep = parse_mask(&m.bitmap, 64).ok_or_else(|| {
                invalid(
                    &field,
                    format!(
                        "bitmap {:?} is not up to 64 binary digits (0, 1, x), optionally prefixed with 0b",
                        m.bitmap
                    ),
                )
            })?;
            out.push((addr, keep));
        }
        Ok(out)
    }

    /// The KVM capabilities the host must have (`"N"`; `"!N"` entries ask for nothing).
    pub fn required_kvm_capabilities(&self) -> Result<Vec<u32>, ConfigError> {
        let mut out = Vec::new();
        for (i, c) in self.kvm_capabilities.iter().enumerate() {
            let (cap, required) = kvm_capability(c).ok_or_else(|| {
                invalid(
                    &format!("cpu_template.kvm_capabilities[{i}]"),
                    format!("{c:?} is not a KVM capability number (optionally prefixed with !)"),
                )
            })?;
            if required {
                out.push(cap);
            }
        }
        Ok(out)
    }
}

/// A bitmap of `0`/`1`/`x` digits to the mask of bits that may stay set (`1` and `x`).
fn parse_mask(s: &str, bits: usize) -> Option<u64> {
    let d = bitmap_digits(s, bits as u32)?;
    let mut v = 0u64;
    for c in d.chars() {
        v = (v << 1)
            | match c {
                '0' => 0,
                '1' | 'x' | 'X' => 1,
                _ => return None,
            };
    }
    // Digits not written (a short bitmap) are the high bits and are kept as they are.
    if d.len() < bits {
        v |= !0u64 << d.len() & (if bits == 64 { !0 } else { (1u64 << bits) - 1 });
    }
    Some(v)
}

/// A VM's configuration.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmConfig {
    pub vcpus: u8,
    pub memory_mib: u64,
    #[serde(default)]
    pub memory_backing: MemoryBacking,
    /// An uncompressed ELF vmlinux or a bzImage.
    pub kernel: PathBuf,
    #[serde(default)]
    pub initrd: Option<PathBuf>,
    /// The kernel command line; the VMM appends the console and its devices.
    #[serde(default)]
    pub cmdline: String,
    #[serde(default)]
    pub drives: Vec<DriveConfig>,
    #[serde(default)]
    pub net: Vec<NetConfig>,
    #[serde(default)]
    pub vsock: Option<VsockConfig>,
    #[serde(default)]
    pub balloon: Option<BalloonConfig>,
    #[serde(default)]
    pub rng: bool,
    /// Where the serial console goes (a file, appended to); `None` discards it.
    #[serde(default)]
    pub serial_output: Option<PathBuf>,
    #[serde(default)]
    pub cpu_template: Option<CpuTemplate>,
    /// Keep the dirty-page log (needed for diff snapshots).
    #[serde(default)]
    pub track_dirty_pages: bool,
    /// The vCPU watchdog's timings (see [`crate::watchdog`]).
    #[serde(default)]
    pub watchdog: WatchdogConfig,
}

/// The shortest watchdog period and timeout.
pub const MIN_WATCHDOG_MS: u64 = 10;
/// The longest watchdog period.
pub const MAX_WATCHDOG_PERIOD_MS: u64 = 60_000;
/// The longest watchdog timeout.
pub const MAX_WATCHDOG_TIMEOUT_MS: u64 = 600_000;

/// The vCPU watchdog's timings (see [`crate::watchdog`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct WatchdogConfig {
    /// A vCPU that has been inside one `KVM_RUN` for this long is kicked (and looked at)
    /// once; a busy guest is kicked about once per period.
    pub period_ms: u64,
    /// How long a kicked vCPU may take to come back from `KVM_RUN`, and how long a vCPU
    /// may stay on a hypercall instruction without progress, before the VM is stopped.
    pub timeout_ms: u64,
}

impl Default for WatchdogConfig {
    fn default() -> Self {
        Self {
            period_ms: 1000,
            timeout_ms: 2000,
        }
    }
}

impl WatchdogConfig {
    /// The period as a duration.
    pub fn period(&self) -> std::time::Duration {
        std::time::Duration::from_millis(self.period_ms)
    }

    /// The timeout as a duration.
    pub fn timeout(&self) -> std::time::Duration {
        std::time::Duration::from_millis(self.timeout_ms)
    }

    fn validate(&self) -> Result<(), ConfigError> {
        if !(MIN_WATCHDOG_MS..=MAX_WATCHDOG_PERIOD_MS).contains(&self.period_ms) {
            return Err(invalid(
                "watchdog.period_ms",
                format!(
                    "must be between {MIN_WATCHDOG_MS} and {MAX_WATCHDOG_PERIOD_MS} (default 1000)"
                ),
            ));
        }
        if !(MIN_WATCHDOG_MS..=MAX_WATCHDOG_TIMEOUT_MS).contains(&self.timeout_ms) {
            return Err(invalid(
                "watchdog.timeout_ms",
                format!(
                    "must be between {MIN_WATCHDOG_MS} and {MAX_WATCHDOG_TIMEOUT_MS} (default 2000)"
                ),
            ));
        }
        Ok(())
    }
}

/// A configuration field that cannot be used, and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error("{field}: {reason}")]
    Invalid { field: String, reason: String },
}

impl ConfigError {
    /// The field the error is about.
    pub fn field(&self) -> &str {
        match self {
            ConfigError::Invalid { field, .. } => field,
        }
    }
}

fn invalid(field: &str, reason: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        field: field.to_string(),
        reason: reason.into(),
    }
}

/// What kind of kernel image a file is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KernelFormat {
    Elf,
    BzImage,
}

/// Reads the first bytes of `path` to tell an ELF vmlinux from a bzImage.
pub fn kernel_format(path: &Path) -> Result<KernelFormat, String> {
    let mut f = std::fs::File::open(path).map_err(|e| format!("cannot open {path:?}: {e}"))?;
    let mut head = [0u8; 0x206];
    let mut n = 0;
    while n < head.len() {
        match f.read(&mut head[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) => return Err(format!("cannot read {path:?}: {e}")),
        }
    }
    if n >= 5 && head[..4] == *b"\x7fELF" {
        if head[4] != 2 {
            return Err(format!(
                "{path:?} is a 32-bit ELF; a 64-bit vmlinux is needed"
            ));
        }
        return Ok(KernelFormat::Elf);
    }
    if n >= 0x206 && head[0x202..0x206] == *b"HdrS" {
        return Ok(KernelFormat::BzImage);
    }
    Err(format!(
        "{path:?} is neither an ELF vmlinux nor a bzImage (no ELF magic, no HdrS header)"
    ))
}

fn check_file(field: &str, path: &Path) -> Result<(), ConfigError> {
    match std::fs::metadata(path) {
        Ok(m) if m.is_file() => Ok(()),
        Ok(_) => Err(invalid(field, format!("{path:?} is not a regular file"))),
        Err(e) => Err(invalid(field, format!("{path:?}: {e}"))),
    }
}

fn check_parent_dir(field: &str, path: &Path) -> Result<(), ConfigError> {
    if path.as_os_str().is_empty() {
        return Err(invalid(field, "must not be empty"));
    }
    let parent = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    if !parent.is_dir() {
        return Err(invalid(
            field,
            format!("the directory {parent:?} does not exist"),
        ));
    }
    Ok(())
}

/// Parses `aa:bb:cc:dd:ee:ff`.
pub fn parse_mac(s: &str) -> Option<[u8; 6]> {
    let mut out = [0u8; 6];
    let mut parts = s.split(':');
    for b in out.iter_mut() {
        let p = parts.next()?;
        if p.len() != 2 {
            return None;
        }
        *b = u8::from_str_radix(p, 16).ok()?;
    }
    if parts.next().is_some() {
        return None;
    }
    Some(out)
}

impl VmConfig {
    /// A configuration with the given kernel and defaults elsewhere (1 vCPU, 128 MiB).
    pub fn new(kernel: impl Into<PathBuf>) -> Self {
        Self {
            vcpus: 1,
            memory_mib: 128,
            memory_backing: MemoryBacking::Anonymous,
            kernel: kernel.into(),
            initrd: None,
            cmdline: String::new(),
            drives: Vec::new(),
            net: Vec::new(),
            vsock: None,
            balloon: None,
            rng: false,
            serial_output: None,
            cpu_template: None,
            track_dirty_pages: false,
            watchdog: WatchdogConfig::default(),
        }
    }

    /// The number of virtio devices the configuration asks for.
    pub fn virtio_device_count(&self) -> usize {
        self.drives.len()
            + self.net.len()
            + usize::from(self.vsock.is_some())
            + usize::from(self.balloon.is_some())
            + usize::from(self.rng)
    }

    /// Checks every field ([`MAX_VCPUS`] as the vCPU limit).
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.validate_with_max_vcpus(usize::from(MAX_VCPUS))
    }

    /// Checks every field, with the hypervisor's vCPU limit.
    pub fn validate_with_max_vcpus(&self, max_vcpus: usize) -> Result<(), ConfigError> {
        self.validate_inner(max_vcpus, false)
    }

    /// Checks every field a restore from a snapshot uses: the kernel, initrd and command
    /// line are in the snapshot's memory already and are not read.
    pub fn validate_for_restore(&self, max_vcpus: usize) -> Result<(), ConfigError> {
        self.validate_inner(max_vcpus, true)
    }

    fn validate_inner(&self, max_vcpus: usize, restore: bool) -> Result<(), ConfigError> {
        let max = max_vcpus.min(usize::from(MAX_VCPUS));
        if self.vcpus == 0 || usize::from(self.vcpus) > max {
            return Err(invalid("vcpus", format!("must be between 1 and {max}")));
        }
        if self.memory_mib < MIN_MEMORY_MIB {
            return Err(invalid(
                "memory_mib",
                format!("must be at least {MIN_MEMORY_MIB}"),
            ));
        }
        if self.memory_mib > MAX_MEMORY_MIB {
            return Err(invalid(
                "memory_mib",
                format!("must be at most {MAX_MEMORY_MIB}"),
            ));
        }
        // Whole MiB are always whole pages; a huge-page backing would need 2 MiB.
        if let MemoryBacking::File { path } = &self.memory_backing {
            check_parent_dir("memory_backing.path", path)?;
            if path.is_dir() {
                return Err(invalid(
                    "memory_backing.path",
                    format!("{path:?} is a directory"),
                ));
            }
        }
        if !restore {
            check_file("kernel", &self.kernel)?;
            kernel_format(&self.kernel).map_err(|e| invalid("kernel", e))?;
        }
        if let Some(initrd) = self.initrd.as_ref().filter(|_| !restore) {
            check_file("initrd", initrd)?;
            let len = std::fs::metadata(initrd).map(|m| m.len()).unwrap_or(0);
            if len == 0 {
                return Err(invalid("initrd", format!("{initrd:?} is empty")));
            }
            if len >= self.memory_mib << 20 {
                return Err(invalid(
                    "initrd",
                    format!("{initrd:?} ({len} bytes) does not fit in guest memory"),
                ));
            }
        }
        if self.cmdline.contains('\0') {
            return Err(invalid("cmdline", "must not contain a NUL byte"));
        }
        if !self.cmdline.is_ascii() {
            return Err(invalid("cmdline", "must be ASCII"));
        }
        if self.cmdline.len() > CMDLINE_MAX - CMDLINE_RESERVED {
            return Err(invalid(
                "cmdline",
                format!(
                    "is {} bytes; at most {} (the VMM appends its devices)",
                    self.cmdline.len(),
                    CMDLINE_MAX - CMDLINE_RESERVED
                ),
            ));
        }
        let mut ids = HashSet::new();
        let mut root = None;
        for (i, d) in self.drives.iter().enumerate() {
            let field = format!("drives[{i}]");
            if d.id.is_empty() || d.id.len() > 64 {
                return Err(invalid(
                    &format!("{field}.id"),
                    "must be 1 to 64 characters",
                ));
            }
            if !ids.insert(d.id.as_str()) {
                return Err(invalid(
                    &format!("{field}.id"),
                    format!("{:?} is used by another device", d.id),
                ));
            }
            check_file(&format!("{field}.path"), &d.path)?;
            if !d.read_only {
                let writable = std::fs::OpenOptions::new()
                    .read(true)
                    .write(true)
                    .open(&d.path);
                if let Err(e) = writable {
                    return Err(invalid(
                        &format!("{field}.path"),
                        format!(
                            "{:?} cannot be opened read-write ({e}); set read_only",
                            d.path
                        ),
                    ));
                }
            }
            if d.is_root {
                if let Some(other) = root.replace(d.id.as_str()) {
                    return Err(invalid(
                        &format!("{field}.is_root"),
                        format!("drive {other:?} is already the root drive"),
                    ));
                }
            }
        }
        let mut macs = HashSet::new();
        for (i, n) in self.net.iter().enumerate() {
            let field = format!("net[{i}]");
            if n.id.is_empty() || n.id.len() > 64 {
                return Err(invalid(
                    &format!("{field}.id"),
                    "must be 1 to 64 characters",
                ));
            }
            if !ids.insert(n.id.as_str()) {
                return Err(invalid(
                    &format!("{field}.id"),
                    format!("{:?} is used by another device", n.id),
                ));
            }
            if n.tap.is_empty() || n.tap.len() > 15 || n.tap.contains(['/', '\0', ' ']) {
                return Err(invalid(
                    &format!("{field}.tap"),
                    "must be a network interface name of 1 to 15 characters",
                ));
            }
            let Some(mac) = parse_mac(&n.guest_mac) else {
                return Err(invalid(
                    &format!("{field}.guest_mac"),
                    format!(
                        "{:?} is not a MAC address like 06:00:ac:10:00:02",
                        n.guest_mac
                    ),
                ));
            };
            if mac[0] & 1 != 0 {
                return Err(invalid(
                    &format!("{field}.guest_mac"),
                    format!(
                        "{:?} is a multicast address; use a unicast one",
                        n.guest_mac
                    ),
                ));
            }
            if mac == [0; 6] {
                return Err(invalid(
                    &format!("{field}.guest_mac"),
                    "must not be all zero",
                ));
            }
            if !macs.insert(mac) {
                return Err(invalid(
                    &format!("{field}.guest_mac"),
                    format!("{:?} is used by another interface", n.guest_mac),
                ));
            }
        }
        if let Some(v) = &self.vsock {
            if v.guest_cid < 3 {
                return Err(invalid(
                    "vsock.guest_cid",
                    "must be at least 3 (0-2 are reserved)",
                ));
            }
            if v.guest_cid == u32::MAX {
                return Err(invalid(
                    "vsock.guest_cid",
                    "must not be 0xffffffff (VMADDR_CID_ANY)",
                ));
            }
            check_parent_dir("vsock.uds_path", &v.uds_path)?;
            if v.uds_path.as_os_str().len() > 100 {
                return Err(invalid(
                    "vsock.uds_path",
                    "is too long for a unix socket path (at most 100 bytes, ports appended)",
                ));
            }
        }
        if let Some(b) = &self.balloon {
            if b.amount_mib > self.memory_mib {
                return Err(invalid(
                    "balloon.amount_mib",
                    format!(
                        "{} is more than the guest's memory ({} MiB)",
                        b.amount_mib, self.memory_mib
                    ),
                ));
            }
        }
        if let Some(p) = &self.serial_output {
            check_parent_dir("serial_output", p)?;
        }
        if let Some(t) = &self.cpu_template {
            t.cpuid_masks()?;
            t.msr_masks()?;
            t.required_kvm_capabilities()?;
        }
        self.watchdog.validate()?;
        if self.virtio_device_count() > MAX_VIRTIO_DEVICES {
            return Err(invalid(
                "drives",
                format!(
                    "{} virtio devices asked for; at most {MAX_VIRTIO_DEVICES}",
                    self.virtio_device_count()
                ),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn elf_kernel(dir: &Path) -> PathBuf {
        let p = dir.join("vmlinux");
        let mut b = vec![0u8; 64];
        b[..4].copy_from_slice(b"\x7fELF");
        b[4] = 2;
        std::fs::write(&p, b).unwrap();
        p
    }

    fn base() -> (tempfile::TempDir, VmConfig) {
        let dir = tempfile::tempdir().unwrap();
        let k = elf_kernel(dir.path());
        (dir, VmConfig::new(k))
    }

    fn field_of(c: &VmConfig) -> String {
        c.validate().unwrap_err().field().to_string()
    }

    #[test]
    fn a_minimal_config_is_valid() {
        let (_d, c) = base();
        c.validate().unwrap();
    }

    #[test]
    fn vcpus_out_of_range_names_vcpus() {
        let (_d, mut c) = base();
        c.vcpus = 0;
        assert_eq!(field_of(&c), "vcpus");
        c.vcpus = 3;
        let e = c.validate_with_max_vcpus(2).unwrap_err();
        assert_eq!(e.to_string(), "vcpus: must be between 1 and 2");
    }

    #[test]
    fn small_memory_names_memory_mib() {
        let (_d, mut c) = base();
        c.memory_mib = 15;
        assert_eq!(
            c.validate().unwrap_err().to_string(),
            "memory_mib: must be at least 16"
        );
    }

    #[test]
    fn kernel_must_exist_and_be_elf_or_bzimage() {
        let (d, mut c) = base();
        c.kernel = d.path().join("missing");
        assert_eq!(field_of(&c), "kernel");
        let junk = d.path().join("junk");
        std::fs::write(&junk, vec![0u8; 4096]).unwrap();
        c.kernel = junk.clone();
        assert!(c.validate().unwrap_err().to_string().contains("neither"));
        let mut bz = vec![0u8; 4096];
        bz[0x202..0x206].copy_from_slice(b"HdrS");
        std::fs::write(&junk, bz).unwrap();
        c.validate().unwrap();
        assert_eq!(kernel_format(&junk).unwrap(), KernelFormat::BzImage);
    }

    #[test]
    fn initrd_and_cmdline_are_checked() {
        let (d, mut c) = base();
        c.initrd = Some(d.path().join("nope"));
        assert_eq!(field_of(&c), "initrd");
        c.initrd = None;
        c.cmdline = "a\0b".into();
        assert_eq!(field_of(&c), "cmdline");
        c.cmdline = "x".repeat(CMDLINE_MAX);
        assert_eq!(field_of(&c), "cmdline");
    }

    #[test]
    fn drives_need_unique_ids_existing_files_and_one_root() {
        let (d, mut c) = base();
        let img = d.path().join("disk.img");
        std::fs::write(&img, vec![0u8; 512]).unwrap();
        let drive = |id: &str, root: bool| DriveConfig {
            id: id.into(),
            path: img.clone(),
            read_only: false,
            is_root: root,
        };
        c.drives = vec![drive("a", true), drive("a", false)];
        assert_eq!(field_of(&c), "drives[1].id");
        c.drives = vec![drive("a", true), drive("b", true)];
        assert_eq!(field_of(&c), "drives[1].is_root");
        c.drives = vec![drive("a", true), drive("b", false)];
        c.validate().unwrap();
        c.drives[1].path = d.path().join("gone.img");
        assert_eq!(field_of(&c), "drives[1].path");
    }

    #[test]
    fn net_mac_and_vsock_cid_and_balloon_are_checked() {
        let (d, mut c) = base();
        let net = |mac: &str| NetConfig {
            id: "eth0".into(),
            tap: "tap0".into(),
            guest_mac: mac.into(),
        };
        c.net = vec![net("06:00:ac:10:00:0")];
        assert_eq!(field_of(&c), "net[0].guest_mac");
        c.net = vec![net("01:00:ac:10:00:02")];
        assert!(c.validate().unwrap_err().to_string().contains("multicast"));
        c.net = vec![net("06:00:ac:10:00:02")];
        c.validate().unwrap();
        c.vsock = Some(VsockConfig {
            guest_cid: 2,
            uds_path: d.path().join("v.sock"),
        });
        assert_eq!(field_of(&c), "vsock.guest_cid");
        c.vsock.as_mut().unwrap().guest_cid = 3;
        c.validate().unwrap();
        c.balloon = Some(BalloonConfig {
            amount_mib: 129,
            deflate_on_oom: false,
            stats_polling_interval_s: 0,
        });
        assert_eq!(field_of(&c), "balloon.amount_mib");
    }

    #[test]
    fn cpu_template_from_scheduler_json_parses_and_bad_bitmaps_are_refused() {
        let json = r#"{"kvm_capabilities":[],"cpuid_modifiers":[{"leaf":"0x1","subleaf":"0x0","flags":0,"modifiers":[{"register":"ecx","bitmap":"0b00000000000000000000000000000001"}]}],"msr_modifiers":[]}"#;
        let t = CpuTemplate::from_json(json).unwrap().unwrap();
        let masks = t.cpuid_masks().unwrap();
        assert_eq!(
            masks,
            vec![CpuidMask {
                leaf: 1,
                subleaf: 0,
                register: 2,
                keep: 1
            }]
        );
        assert!(CpuTemplate::from_json("").unwrap().is_none());
        let with_msr = r#"{"kvm_capabilities":["171","!172"],"msr_modifiers":[{"addr":"0x10a","bitmap":"0b1111"}]}"#;
        let t2 = CpuTemplate::from_json(with_msr).unwrap().unwrap();
        // A short bitmap keeps the high bits it does not list.
        assert_eq!(t2.msr_masks().unwrap(), vec![(0x10a, u64::MAX)]);
        assert_eq!(t2.required_kvm_capabilities().unwrap(), vec![171]);
        let with_msr = r#"{"msr_modifiers":[{"addr":"0x10a","bitmap":"0b0000000000000000000000000000000000000000000000000000000000000101"}]}"#;
        let t3 = CpuTemplate::from_json(with_msr).unwrap().unwrap();
        assert_eq!(t3.msr_masks().unwrap(), vec![(0x10a, 5)]);
        let (_d, mut c) = base();
        let mut bad = t.clone();
        bad.cpuid_modifiers[0].modifiers[0].bitmap = "0b2".into();
        c.cpu_template = Some(bad);
        assert_eq!(field_of(&c), "cpu_template.cpuid_modifiers[0]");
    }

    #[test]
    fn restore_validation_does_not_need_the_kernel_but_checks_the_rest() {
        let (d, mut c) = base();
        c.kernel = d.path().join("gone");
        c.initrd = Some(d.path().join("gone too"));
        c.validate_for_restore(8).unwrap();
        assert_eq!(c.validate().unwrap_err().field(), "kernel");
        c.memory_mib = 1;
        assert_eq!(c.validate_for_restore(8).unwrap_err().field(), "memory_mib");
    }

    #[test]
    fn watchdog_timings_default_and_are_bounded() {
        let (_d, mut c) = base();
        assert_eq!(c.watchdog.period_ms, 1000);
        assert_eq!(c.watchdog.timeout_ms, 2000);
        // A configuration without the key gets the defaults; a partial one keeps the rest.
        let mut j = serde_json::to_value(&c).unwrap();
        j.as_object_mut().unwrap().remove("watchdog");
        let back: VmConfig = serde_json::from_value(j.clone()).unwrap();
        assert_eq!(back.watchdog, WatchdogConfig::default());
        j["watchdog"] = serde_json::json!({"timeout_ms": 500});
        let back: VmConfig = serde_json::from_value(j.clone()).unwrap();
        assert_eq!(back.watchdog.period_ms, 1000);
        assert_eq!(back.watchdog.timeout_ms, 500);
        c.watchdog.period_ms = 0;
        assert_eq!(field_of(&c), "watchdog.period_ms");
        c.watchdog.period_ms = 60_001;
        assert_eq!(field_of(&c), "watchdog.period_ms");
        c.watchdog.period_ms = 10;
        c.watchdog.timeout_ms = 9;
        assert_eq!(field_of(&c), "watchdog.timeout_ms");
        c.watchdog.timeout_ms = 600_000;
        c.validate().unwrap();
        // Restoring checks it too.
        c.watchdog.timeout_ms = 600_001;
        assert_eq!(
            c.validate_for_restore(8).unwrap_err().field(),
            "watchdog.timeout_ms"
        );
    }

    #[test]
    fn config_round_trips_through_json() {
        let (_d, c) = base();
        let j = serde_json::to_string(&c).unwrap();
        let back: VmConfig = serde_json::from_str(&j).unwrap();
        assert_eq!(back, c);
    }
}
