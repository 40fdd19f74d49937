//! The device allow-list of a sandbox cgroup.
//!
//! A tenant is root in its sandbox; without a device cgroup it could `mknod` a node for
//! any host device (a disk, `/dev/mem`, `/dev/kvm`) and open it. The rules here say which
//! devices a sandbox may use at all; everything else is denied whatever the node's mode
//! bits or capabilities say.
//!
//! * cgroup v1: the `devices` controller. [`v1_lines`] gives the lines written to
//!   `devices.allow` after `a` went to `devices.deny` (see
//!   [`SandboxCgroup::restrict_devices`](super::cgroup::SandboxCgroup::restrict_devices)).
//! * cgroup v2 has no devices controller: the kernel runs `BPF_PROG_TYPE_CGROUP_DEVICE`
//!   programs attached to the cgroup instead. [`attach_bpf`] assembles one from the rules
//!   (a compare-and-jump block per rule, then "deny"), loads it with `bpf(2)` and attaches
//!   it to the cgroup directory with `BPF_PROG_ATTACH`.
//!
//! Why `BPF_PROG_ATTACH` and not a `bpf_link`: a program attached that way belongs to the
//! cgroup until the cgroup is removed; the node keeps no descriptor per sandbox, and a node
//! restart (or crash) leaves every running sandbox filtered. A link detaches the program
//! when its last descriptor closes, so a crashed node would leave its sandboxes open unless
//! every link were pinned in bpffs and cleaned up by hand. The attach uses no flag
//! (exclusive mode): no cgroup below the sandbox's may attach a program of its own, an
//! ancestor's `BPF_F_ALLOW_MULTI` programs still run too (every program must allow), and
//! attaching again replaces ours, so a second `restrict_devices` replaces the list as on
//! v1.
//!
//! One program per rule set is loaded per node process and shared by every sandbox
//! cgroup it is attached to (the cgroups hold references; the node keeps one descriptor
//! per rule set). Before Linux 5.11 a program's memory is charged to the `RLIMIT_MEMLOCK`
//! of the loading user, so one program per sandbox could run a node out of it.
//!
//! The license string is `Apache-2.0`: the kernel wants a GPL-compatible license only
//! from programs that call GPL-only helpers, and these programs call no helper at all.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::Arc;

/// Errors of the device allow-list.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    #[error("invalid device rule {rule}: {reason}")]
    InvalidRule { rule: String, reason: &'static str },
    #[error("opening the cgroup directory {dir}: {source}")]
    OpenCgroup {
        dir: String,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "loading the cgroup device BPF program (BPF_PROG_TYPE_CGROUP_DEVICE) failed: {source}{hint}{log}"
    )]
    Load {
        #[source]
        source: std::io::Error,
        /// What the errno usually means here (starts with "; " when present).
        hint: String,
        /// The verifier's log (starts with "; verifier: " when present).
        log: String,
    },
    #[error("attaching the device BPF program to cgroup {dir} failed: {source}{hint}")]
    Attach {
        dir: String,
        #[source]
        source: std::io::Error,
        hint: String,
    },
}

/// Which kind of device node a rule is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DeviceKind {
    Char,
    Block,
    /// Both character and block devices.
    Any,
}

/// What a process may do with a device: open it for reading, for writing, or create a
/// node for it (`mknod`). The bits are those of the kernel's `BPF_DEVCG_ACC_*`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Access(u8);

impl Access {
    pub const MKNOD: Access = Access(1);
    pub const READ: Access = Access(2);
    pub const WRITE: Access = Access(4);
    pub const RW: Access = Access(2 | 4);
    pub const ALL: Access = Access(1 | 2 | 4);
    pub const NONE: Access = Access(0);

    pub const fn union(self, other: Access) -> Access {
        Access(self.0 | other.0)
    }

    /// Whether every right in `other` is in `self`.
    pub const fn contains(self, other: Access) -> bool {
        self.0 & other.0 == other.0
    }

    pub const fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// The `BPF_DEVCG_ACC_*` bits.
    pub const fn bits(self) -> u8 {
        self.0
    }

    /// The v1 spelling: a subset of `rwm`, in that order.
    pub fn letters(self) -> String {
        let mut s = String::with_capacity(3);
        for (a, c) in [
            (Access::READ, 'r'),
            (Access::WRITE, 'w'),
            (Access::MKNOD, 'm'),
        ] {
            if self.contains(a) {
                s.push(c);
            }
        }
        s
    }
}

/// Largest major number the kernel has (`dev_t` is 12 bits of major, 20 of minor).
pub const MAX_MAJOR: u32 = (1 << 12) - 1;
/// Largest minor number the kernel has.
pub const MAX_MINOR: u32 = (1 << 20) - 1;

/// One allowed device (or range of devices): `major`/`minor` `None` is the wildcard `*`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DeviceRule {
    pub kind: DeviceKind,
    pub major: Option<u32>,
    pub minor: Option<u32>,
    pub access: Access,
}

impl DeviceRule {
    pub const fn new(
        kind: DeviceKind,
        major: Option<u32>,
        minor: Option<u32>,
        access: Access,
    ) -> Self {
        DeviceRule {
            kind,
            major,
            minor,
            access,
        }
    }

    /// A character device `major:minor` opened for reading and writing, never created.
    pub const fn char_rw(major: u32, minor: u32) -> Self {
        Self::new(DeviceKind::Char, Some(major), Some(minor), Access::RW)
    }

    /// Whether this rule lets a process do `access` on a device of `kind` (`Char` or
    /// `Block`) numbered `major:minor`: the kind and numbers match and every requested
    /// right is granted by this one rule (as the kernel checks on v1, and as the BPF
    /// program checks on v2).
    pub fn allows(&self, kind: DeviceKind, major: u32, minor: u32, access: Access) -> bool {
        (self.kind == DeviceKind::Any || self.kind == kind)
            && self.major.is_none_or(|m| m == major)
            && self.minor.is_none_or(|m| m == minor)
            && self.access.contains(access)
    }

    /// Checks the rule can be written for both v1 and BPF: some access, numbers the
    /// kernel can have.
    pub fn validate(&self) -> Result<(), DeviceError> {
        let bad = |reason| {
            Err(DeviceError::InvalidRule {
                rule: format!("\"{self}\""),
                reason,
            })
        };
        if self.access.is_empty() {
            return bad("it grants no access (use at least one of read, write, mknod)");
        }
        if self.major.is_some_and(|m| m > MAX_MAJOR) {
            return bad("major above 4095, which no device has");
        }
        if self.minor.is_some_and(|m| m > MAX_MINOR) {
            return bad("minor above 1048575, which no device has");
        }
        Ok(())
    }
}

/// What every jail sandbox may use: `/dev/null`, `zero`, `full`, `random`, `urandom`,
/// `tty`, `ptmx` and the pty slaves `136:*`, read and write, never `mknod`.
pub const STANDARD: &[DeviceRule] = &STANDARD_RULES;

/// What a microVM's VMM may use: [`STANDARD`] plus `/dev/kvm` (10:232) and
/// `/dev/net/tun` (10:200), read and write.
pub const MICROVM: &[DeviceRule] = &MICROVM_RULES;

const STANDARD_RULES: [DeviceRule; 8] = standard_rules();

/// The basic devices of every sandbox (`agentenv_guest::devices::BASIC_DEVICES`, the
/// nodes its `/dev` holds), ptmx, and the pty slaves of every devpts instance.
const fn standard_rules() -> [DeviceRule; 8] {
    let basic = agentenv_guest::devices::BASIC_DEVICES;
    let mut out = [DeviceRule::new(DeviceKind::Any, None, None, Access::NONE); 8];
    let mut i = 0;
    while i < basic.len() {
        out[i] = DeviceRule::char_rw(basic[i].1, basic[i].2);
        i += 1;
    }
    out[6] = DeviceRule::char_rw(5, 2); // ptmx
    out[7] = DeviceRule::new(DeviceKind::Char, Some(136), None, Access::RW); // /dev/pts/N
    out
}

const MICROVM_RULES: [DeviceRule; 10] = concat(
    STANDARD_RULES,
    [
        DeviceRule::char_rw(10, 232), // kvm
        DeviceRule::char_rw(10, 200), // net/tun
    ],
);

const fn concat<const N: usize, const M: usize, const T: usize>(
    a: [DeviceRule; N],
    b: [DeviceRule; M],
) -> [DeviceRule; T] {
    assert!(N + M == T);
    let mut out = [DeviceRule::new(DeviceKind::Any, None, None, Access::NONE); T];
    let mut i = 0;
    while i < N {
        out[i] = a[i];
        i += 1;
    }
    while i < T {
        out[i] = b[i - N];
        i += 1;
    }
    out
}

/// The v1 spelling, `a` for any kind: `c 1:3 rw`, `c 136:* rw`.
impl std::fmt::Display for DeviceRule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self.kind {
            DeviceKind::Char => 'c',
            DeviceKind::Block => 'b',
            DeviceKind::Any => 'a',
        };
        let num = |n: Option<u32>| n.map_or_else(|| "*".to_string(), |n| n.to_string());
        write!(
            f,
            "{kind} {}:{} {}",
            num(self.major),
            num(self.minor),
            self.access.letters()
        )
    }
}

/// Checks every rule ([`DeviceRule::validate`]).
pub fn validate(rules: &[DeviceRule]) -> Result<(), DeviceError> {
    rules.iter().try_for_each(DeviceRule::validate)
}

/// The cgroup v1 `devices.allow` lines for `rules`, one write each, such as `c 1:3 rw`
/// or `c 136:* rw`. v1 has no exception for "any kind", so such a rule becomes a `b` and
/// a `c` line.
pub fn v1_lines(rules: &[DeviceRule]) -> Vec<String> {
    let num = |n: Option<u32>| n.map_or_else(|| "*".to_string(), |n| n.to_string());
    let mut lines = Vec::new();
    for r in rules {
        let kinds: &[char] = match r.kind {
            DeviceKind::Char => &['c'],
            DeviceKind::Block => &['b'],
            DeviceKind::Any => &['b', 'c'],
        };
        for k in kinds {
            lines.push(format!(
                "{k} {}:{} {}",
                num(r.major),
                num(r.minor),
                r.access.letters()
            ));
        }
    }
    lines
}

// ---------------------------------------------------------------------------------------
// The BPF program.

/// One eBPF instruction (`struct bpf_insn`): opcode, `dst_reg` in the low nibble and
/// `src_reg` in the high nibble of `regs`, offset, immediate.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Insn {
    code: u8,
    regs: u8,
    off: i16,
    imm: i32,
}

// Opcodes: class | operation | source.
const BPF_LDX_MEM_W: u8 = 0x61; // dst = *(u32 *)(src + off)
const BPF_ALU32_AND_K: u8 = 0x54; // dst = (u32)dst & imm
const BPF_ALU32_RSH_K: u8 = 0x74; // dst = (u32)dst >> imm
const BPF_ALU32_MOV_X: u8 = 0xbc; // dst = (u32)src
const BPF_ALU64_MOV_K: u8 = 0xb7; // dst = (s64)imm
const BPF_JNE_K: u8 = 0x55; // if dst != (s64)imm goto pc + 1 + off
const BPF_JNE_X: u8 = 0x5d; // if dst != src goto pc + 1 + off
const BPF_EXIT: u8 = 0x95; // return r0

// Registers. On entry r1 points to `struct bpf_cgroup_dev_ctx { u32 access_type; u32
// major; u32 minor; }`, where access_type is `(BPF_DEVCG_ACC_* << 16) | BPF_DEVCG_DEV_*`.
const R0: u8 = 0;
const R1: u8 = 1;
/// The device type of the request (`BPF_DEVCG_DEV_*`).
const R_TYPE: u8 = 2;
/// The rights requested (`BPF_DEVCG_ACC_*`).
const R_ACCESS: u8 = 3;
const R_MAJOR: u8 = 4;
const R_MINOR: u8 = 5;

const BPF_DEVCG_DEV_BLOCK: i32 = 1;
const BPF_DEVCG_DEV_CHAR: i32 = 2;

const fn insn(code: u8, dst: u8, src: u8, off: i16, imm: i32) -> Insn {
    Insn {
        code,
        regs: (src << 4) | dst,
        off,
        imm,
    }
}

/// The program for `rules` (which [`validate`] accepted): load the request into
/// registers, then per rule a block that jumps to the next block on the first mismatch
/// and returns 1 (allow) otherwise; after the last block return 0 (deny). Conditions a
/// rule does not have (kind `Any`, a `*` number, all of `rwm`) emit nothing; a rule with
/// none at all allows everything, and the code after it would be unreachable (which the
/// verifier refuses), so it ends the program.
fn program(rules: &[DeviceRule]) -> Vec<Insn> {
    let mut p = vec![
        insn(BPF_LDX_MEM_W, R_TYPE, R1, 0, 0),
        insn(BPF_ALU32_AND_K, R_TYPE, 0, 0, 0xffff),
        insn(BPF_LDX_MEM_W, R_ACCESS, R1, 0, 0),
        insn(BPF_ALU32_RSH_K, R_ACCESS, 0, 0, 16),
        insn(BPF_LDX_MEM_W, R_MAJOR, R1, 4, 0),
        insn(BPF_LDX_MEM_W, R_MINOR, R1, 8, 0),
    ];
    for r in rules {
        // Jumps carry offset 0 until the block's length is known.
        let mut block = Vec::new();
        match r.kind {
            DeviceKind::Char => block.push(insn(BPF_JNE_K, R_TYPE, 0, 0, BPF_DEVCG_DEV_CHAR)),
            DeviceKind::Block => block.push(insn(BPF_JNE_K, R_TYPE, 0, 0, BPF_DEVCG_DEV_BLOCK)),
            DeviceKind::Any => {}
        }
        if !r.access.contains(Access::ALL) {
            // Every requested right must be granted: (requested & granted) == requested.
            // r1 (the context) is not needed any more.
            block.push(insn(BPF_ALU32_MOV_X, R1, R_ACCESS, 0, 0));
            block.push(insn(BPF_ALU32_AND_K, R1, 0, 0, i32::from(r.access.bits())));
            block.push(insn(BPF_JNE_X, R1, R_ACCESS, 0, 0));
        }
        // validate() keeps the numbers below 2^20, so the sign-extended immediate equals
        // the zero-extended 32-bit load.
        if let Some(major) = r.major {
            block.push(insn(BPF_JNE_K, R_MAJOR, 0, 0, major as i32));
        }
        if let Some(minor) = r.minor {
            block.push(insn(BPF_JNE_K, R_MINOR, 0, 0, minor as i32));
        }
        let unconditional = block.is_empty();
        block.push(insn(BPF_ALU64_MOV_K, R0, 0, 0, 1));
        block.push(insn(BPF_EXIT, 0, 0, 0, 0));
        let len = block.len();
        for (i, ins) in block.iter_mut().enumerate() {
            if ins.code == BPF_JNE_K || ins.code == BPF_JNE_X {
                // To the first instruction after the block.
                ins.off = (len - i - 1) as i16;
            }
        }
        p.extend(block);
        if unconditional {
            return p;
        }
    }
    p.push(insn(BPF_ALU64_MOV_K, R0, 0, 0, 0));
    p.push(insn(BPF_EXIT, 0, 0, 0, 0));
    p
}

// ---------------------------------------------------------------------------------------
// bpf(2). libc has the syscall number but not `union bpf_attr`; these are the leading
// fields of the members we use (the kernel zero-fills the rest of a shorter attr).

const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_PROG_ATTACH: libc::c_long = 8;
const BPF_PROG_TYPE_CGROUP_DEVICE: u32 = 15;
const BPF_CGROUP_DEVICE: u32 = 6;
const LICENSE: &std::ffi::CStr = c"Apache-2.0";
/// Shown by `bpftool prog` (at most 15 characters).
const PROG_NAME: [u8; 16] = *b"aenv_devices\0\0\0\0";
const LOG_SIZE: usize = 64 * 1024;

/// `union bpf_attr` for `BPF_PROG_LOAD`, up to `prog_name` (Linux 4.15, the release that
/// added cgroup device programs).
#[repr(C)]
#[derive(Default)]
struct ProgLoadAttr {
    prog_type: u32,
    insn_cnt: u32,
    insns: u64,
    license: u64,
    log_level: u32,
    log_size: u32,
    log_buf: u64,
    kern_version: u32,
    prog_flags: u32,
    prog_name: [u8; 16],
}

/// `union bpf_attr` for `BPF_PROG_ATTACH`, without `replace_bpf_fd` (unused).
#[repr(C)]
struct ProgAttachAttr {
    target_fd: u32,
    attach_bpf_fd: u32,
    attach_type: u32,
    attach_flags: u32,
}

/// Calls bpf(2) with `attr`; returns what the call returned (a descriptor for loads).
fn bpf<T>(cmd: libc::c_long, attr: &mut T) -> std::io::Result<libc::c_long> {
    // SAFETY: `attr` is a live, initialised `#[repr(C)]` prefix of `union bpf_attr` for
    // `cmd`, passed with its exact size; every pointer inside it points to memory the
    // caller keeps alive for the duration of the call.
    let r = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            attr as *mut T,
            std::mem::size_of::<T>() as libc::c_long,
        )
    };
    if r < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

fn load(rules: &[DeviceRule]) -> Result<OwnedFd, DeviceError> {
    load_insns(&program(rules))
}

fn load_insns(insns: &[Insn]) -> Result<OwnedFd, DeviceError> {
    let mut log = vec![0u8; LOG_SIZE];
    let mut attr = ProgLoadAttr {
        prog_type: BPF_PROG_TYPE_CGROUP_DEVICE,
        insn_cnt: insns.len() as u32,
        insns: insns.as_ptr() as u64,
        license: LICENSE.as_ptr() as u64,
        prog_name: PROG_NAME,
        ..Default::default()
    };
    let first = match bpf(BPF_PROG_LOAD, &mut attr) {
        Ok(fd) => {
            // SAFETY: a successful BPF_PROG_LOAD returns a new descriptor that nothing
            // else owns.
            return Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) });
        }
        Err(e) => e,
    };
    // Once more with the verifier's log, to say why.
    attr.log_level = 1;
    attr.log_size = LOG_SIZE as u32;
    attr.log_buf = log.as_mut_ptr() as u64;
    let (source, log) = match bpf(BPF_PROG_LOAD, &mut attr) {
        Ok(fd) => {
            // SAFETY: as above; the retry succeeded (a transient failure), the descriptor
            // is ours.
            return Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) });
        }
        // The first error is the one to report (the retry may add ENOSPC for a log that
        // did not fit); the log explains it.
        Err(_) => {
            let end = log.iter().position(|&b| b == 0).unwrap_or(log.len());
            let text = String::from_utf8_lossy(&log[..end]).trim().to_string();
            // The interesting part of a long log is its end.
            let tail: Vec<&str> = text.lines().rev().take(12).collect();
            let tail: Vec<&str> = tail.into_iter().rev().collect();
            (first, tail.join(" | "))
        }
    };
    let hint = match source.raw_os_error() {
        Some(libc::EPERM) => {
            "; loading needs CAP_SYS_ADMIN (or CAP_BPF and CAP_NET_ADMIN), and before Linux 5.11 room under RLIMIT_MEMLOCK"
        }
        Some(libc::EINVAL) if log.is_empty() => {
            "; this kernel does not know cgroup device programs (it needs Linux 4.15 or later with CONFIG_CGROUP_BPF=y)"
        }
        Some(libc::ENOSYS) => "; this kernel has no bpf(2) (CONFIG_BPF_SYSCALL is off)",
        _ => "",
    };
    Err(DeviceError::Load {
        source,
        hint: hint.to_string(),
        log: if log.is_empty() {
            String::new()
        } else {
            format!("; verifier: {log}")
        },
    })
}

/// Programs this process loaded, one per rule set, shared by every cgroup they are
/// attached to.
static PROGRAMS: parking_lot::Mutex<Vec<(Vec<DeviceRule>, Arc<OwnedFd>)>> =
    parking_lot::Mutex::new(Vec::new());

/// The loaded program for `rules`, loading it on first use.
fn program_fd(rules: &[DeviceRule]) -> Result<Arc<OwnedFd>, DeviceError> {
    let mut programs = PROGRAMS.lock();
    if let Some((_, fd)) = programs.iter().find(|(r, _)| r == rules) {
        return Ok(fd.clone());
    }
    let fd = Arc::new(load(rules)?);
    programs.push((rules.to_vec(), fd.clone()));
    Ok(fd)
}

/// Checks that this kernel loads cgroup device programs (by loading the [`STANDARD`]
/// one, which later sandboxes then share).
pub fn check_bpf_support() -> Result<(), DeviceError> {
    program_fd(STANDARD).map(drop)
}

/// Restricts the cgroup v2 directory `dir` to `rules`: attaches the program for them
/// (replacing a device program attached to `dir` before). The program stays attached
/// until the cgroup is removed.
pub fn attach_bpf(dir: &Path, rules: &[DeviceRule]) -> Result<(), DeviceError> {
    validate(rules)?;
    let cgroup = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_CLOEXEC)
        .open(dir)
        .map_err(|source| DeviceError::OpenCgroup {
            dir: dir.display().to_string(),
            source,
        })?;
    let prog = program_fd(rules)?;
    let mut attr = ProgAttachAttr {
        target_fd: cgroup.as_raw_fd() as u32,
        attach_bpf_fd: prog.as_raw_fd() as u32,
        attach_type: BPF_CGROUP_DEVICE,
        // Exclusive: see the module documentation.
        attach_flags: 0,
    };
    bpf(BPF_PROG_ATTACH, &mut attr).map_err(|source| {
        let hint = match source.raw_os_error() {
            Some(libc::EPERM) => {
                "; either the node lacks CAP_NET_ADMIN, or an ancestor cgroup holds a device program attached without BPF_F_ALLOW_MULTI or BPF_F_ALLOW_OVERRIDE, which forbids programs below it"
            }
            Some(libc::EBADF) | Some(libc::EINVAL) => {
                "; the directory must be a cgroup v2 directory (a v1 cgroup cannot hold BPF programs)"
            }
            _ => "",
        };
        DeviceError::Attach {
            dir: dir.display().to_string(),
            source,
            hint: hint.to_string(),
        }
    })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn v1_lines_of_the_standard_and_microvm_sets() {
        assert_eq!(
            v1_lines(STANDARD),
            [
                "c 1:3 rw",
                "c 1:5 rw",
                "c 1:7 rw",
                "c 1:8 rw",
                "c 1:9 rw",
                "c 5:0 rw",
                "c 5:2 rw",
                "c 136:* rw",
            ]
        );
        let microvm = v1_lines(MICROVM);
        assert_eq!(microvm[..8], v1_lines(STANDARD)[..]);
        assert_eq!(microvm[8..], ["c 10:232 rw", "c 10:200 rw"]);
    }

    #[test]
    fn no_standard_rule_grants_mknod_or_a_block_device() {
        for r in MICROVM {
            assert!(!r.access.contains(Access::MKNOD), "{r:?}");
            assert_eq!(r.kind, DeviceKind::Char, "{r:?}");
            r.validate().unwrap();
        }
    }

    #[test]
    fn v1_lines_spell_any_kind_wildcards_and_access() {
        let rules = [
            DeviceRule::new(DeviceKind::Any, None, None, Access::MKNOD),
            DeviceRule::new(DeviceKind::Block, Some(8), None, Access::READ),
            DeviceRule::new(DeviceKind::Char, None, Some(7), Access::ALL),
        ];
        assert_eq!(
            v1_lines(&rules),
            ["b *:* m", "c *:* m", "b 8:* r", "c *:7 rwm"]
        );
    }

    #[test]
    fn invalid_rules_are_refused_with_a_reason() {
        let none = DeviceRule::new(DeviceKind::Char, Some(1), Some(3), Access::NONE);
        assert!(
            none.validate()
                .unwrap_err()
                .to_string()
                .contains("grants no access")
        );
        let big = DeviceRule::new(DeviceKind::Char, Some(4096), None, Access::RW);
        assert!(
            big.validate()
                .unwrap_err()
                .to_string()
                .starts_with("invalid device rule \"c 4096:* rw\": major")
        );
        assert!(validate(&[big]).unwrap_err().to_string().contains("major"));
        let big = DeviceRule::new(DeviceKind::Char, Some(1), Some(1 << 20), Access::RW);
        assert!(validate(&[big]).unwrap_err().to_string().contains("minor"));
        let edge = DeviceRule::new(
            DeviceKind::Block,
            Some(MAX_MAJOR),
            Some(MAX_MINOR),
            Access::RW,
        );
        edge.validate().unwrap();
    }

    #[test]
    fn one_rule_becomes_the_expected_compare_and_jump_block() {
        let p = program(&[DeviceRule::char_rw(1, 3)]);
        let expected = [
            // Prelude: type, access, major, minor.
            insn(BPF_LDX_MEM_W, 2, 1, 0, 0),
            insn(BPF_ALU32_AND_K, 2, 0, 0, 0xffff),
            insn(BPF_LDX_MEM_W, 3, 1, 0, 0),
            insn(BPF_ALU32_RSH_K, 3, 0, 0, 16),
            insn(BPF_LDX_MEM_W, 4, 1, 4, 0),
            insn(BPF_LDX_MEM_W, 5, 1, 8, 0),
            // The rule: every jump lands on the default deny (index 14).
            insn(BPF_JNE_K, 2, 0, 7, BPF_DEVCG_DEV_CHAR),
            insn(BPF_ALU32_MOV_X, 1, 3, 0, 0),
            insn(BPF_ALU32_AND_K, 1, 0, 0, 2 | 4),
            insn(BPF_JNE_X, 1, 3, 4, 0),
            insn(BPF_JNE_K, 4, 0, 3, 1),
            insn(BPF_JNE_K, 5, 0, 2, 3),
            insn(BPF_ALU64_MOV_K, 0, 0, 0, 1),
            insn(BPF_EXIT, 0, 0, 0, 0),
            // Default: deny.
            insn(BPF_ALU64_MOV_K, 0, 0, 0, 0),
            insn(BPF_EXIT, 0, 0, 0, 0),
        ];
        assert_eq!(p, expected);
        // The encoding is `struct bpf_insn`: 8 bytes, dst in the low nibble.
        assert_eq!(std::mem::size_of::<Insn>(), 8);
        assert_eq!(insn(BPF_JNE_X, 1, 3, 4, 0).regs, 0x31);
    }

    #[test]
    fn instruction_counts_and_jump_targets() {
        // 6 prelude + 7 full rules of 8 + the 136:* rule of 7 + 2 deny.
        assert_eq!(program(STANDARD).len(), 6 + 7 * 8 + 7 + 2);
        assert_eq!(program(MICROVM).len(), program(STANDARD).len() + 2 * 8);
        assert_eq!(program(&[]).len(), 8);
        for rules in [STANDARD, MICROVM] {
            let p = program(rules);
            for (i, ins) in p.iter().enumerate() {
                if ins.code == BPF_JNE_K || ins.code == BPF_JNE_X {
                    assert!(ins.off > 0, "backward or null jump at {i}");
                    let target = i + 1 + ins.off as usize;
                    assert!(target < p.len(), "jump at {i} leaves the program");
                    // Every jump goes to the start of a block: a type or access check of
                    // the next rule, or the final deny.
                    let t = &p[target];
                    assert!(
                        (t.code == BPF_JNE_K && t.regs & 0xf == R_TYPE)
                            || t.code == BPF_ALU32_MOV_X
                            || (t.code == BPF_ALU64_MOV_K && t.imm == 0),
                        "jump at {i} to {target}: {t:?}"
                    );
                }
            }
            assert_eq!(p[p.len() - 2], insn(BPF_ALU64_MOV_K, R0, 0, 0, 0));
            assert_eq!(p[p.len() - 1].code, BPF_EXIT);
        }
    }

    #[test]
    fn a_rule_without_conditions_ends_the_program() {
        let all = DeviceRule::new(DeviceKind::Any, None, None, Access::ALL);
        let p = program(&[DeviceRule::char_rw(1, 3), all, DeviceRule::char_rw(1, 5)]);
        // The 1:3 block, then the unconditional allow; nothing unreachable after it.
        assert_eq!(p.len(), 6 + 8 + 2);
        assert_eq!(p[p.len() - 2], insn(BPF_ALU64_MOV_K, R0, 0, 0, 1));
        assert_eq!(run(&p, DeviceKind::Block, 8, 0, Access::ALL), 1);
    }

    /// Runs `p` on a request: an interpreter of the instructions [`program`] emits.
    fn run(p: &[Insn], kind: DeviceKind, major: u32, minor: u32, access: Access) -> u64 {
        let dev_type = match kind {
            DeviceKind::Block => BPF_DEVCG_DEV_BLOCK as u32,
            DeviceKind::Char => BPF_DEVCG_DEV_CHAR as u32,
            DeviceKind::Any => panic!("a request is for a char or a block device"),
        };
        let ctx = [(u32::from(access.bits()) << 16) | dev_type, major, minor];
        let mut regs = [0u64; 11];
        let mut set = [false; 11];
        set[1] = true; // r1 = ctx
        let mut ctx_in_r1 = true;
        let mut pc = 0usize;
        for _ in 0..=p.len() {
            let ins = p[pc];
            let (dst, src) = ((ins.regs & 0xf) as usize, (ins.regs >> 4) as usize);
            let mut next = pc + 1;
            match ins.code {
                BPF_LDX_MEM_W => {
                    assert!(src == 1 && ctx_in_r1, "load from a non-context register");
                    assert!(ins.off % 4 == 0 && (0..12).contains(&ins.off));
                    regs[dst] = u64::from(ctx[ins.off as usize / 4]);
                }
                BPF_ALU32_AND_K => {
                    assert!(set[dst]);
                    regs[dst] = u64::from(regs[dst] as u32 & ins.imm as u32);
                }
                BPF_ALU32_RSH_K => {
                    assert!(set[dst]);
                    regs[dst] = u64::from((regs[dst] as u32) >> ins.imm);
                }
                BPF_ALU32_MOV_X => {
                    assert!(set[src]);
                    regs[dst] = u64::from(regs[src] as u32);
                }
                BPF_ALU64_MOV_K => regs[dst] = ins.imm as i64 as u64,
                BPF_JNE_K => {
                    assert!(set[dst]);
                    if regs[dst] != ins.imm as i64 as u64 {
                        next = pc + 1 + ins.off as usize;
                    }
                }
                BPF_JNE_X => {
                    assert!(set[dst] && set[src]);
                    if regs[dst] != regs[src] {
                        next = pc + 1 + ins.off as usize;
                    }
                }
                BPF_EXIT => {
                    assert!(set[0], "exit without a return value");
                    return regs[0];
                }
                other => panic!("unexpected opcode {other:#x} at {pc}"),
            }
            if ins.code != BPF_JNE_K && ins.code != BPF_JNE_X {
                set[dst] = true;
                if dst == 1 {
                    ctx_in_r1 = false;
                }
            }
            assert!(next > pc, "backward jump at {pc}");
            pc = next;
            assert!(pc < p.len(), "fell off the end");
        }
        panic!("no exit");
    }

    #[test]
    fn the_program_decides_like_the_rules() {
        let extra = [
            DeviceRule::new(DeviceKind::Any, Some(7), None, Access::READ),
            DeviceRule::new(DeviceKind::Block, None, Some(0), Access::MKNOD),
            DeviceRule::new(DeviceKind::Char, Some(4), Some(64), Access::ALL),
        ];
        let mut mixed = MICROVM.to_vec();
        mixed.extend(extra);
        let accesses = [
            Access::READ,
            Access::WRITE,
            Access::RW,
            Access::MKNOD,
            Access::READ.union(Access::MKNOD),
            Access::ALL,
        ];
        let mut checked = 0;
        for rules in [STANDARD, MICROVM, &mixed[..], &[]] {
            let p = program(rules);
            for kind in [DeviceKind::Char, DeviceKind::Block] {
                for major in [0, 1, 4, 5, 7, 8, 10, 136, 254, MAX_MAJOR] {
                    for minor in [0, 1, 2, 3, 5, 7, 8, 9, 64, 200, 232, 4242, MAX_MINOR] {
                        for access in accesses {
                            let want = rules.iter().any(|r| r.allows(kind, major, minor, access));
                            let got = run(&p, kind, major, minor, access);
                            assert_eq!(
                                got,
                                u64::from(want),
                                "{kind:?} {major}:{minor} {access:?} with {rules:?}"
                            );
                            checked += 1;
                        }
                    }
                }
            }
        }
        assert!(checked > 4000);
        // The decisions that matter, spelled out.
        let p = program(STANDARD);
        assert_eq!(run(&p, DeviceKind::Char, 1, 3, Access::RW), 1);
        assert_eq!(run(&p, DeviceKind::Char, 136, 4242, Access::RW), 1);
        assert_eq!(run(&p, DeviceKind::Char, 1, 3, Access::MKNOD), 0);
        assert_eq!(run(&p, DeviceKind::Char, 1, 3, Access::ALL), 0);
        assert_eq!(run(&p, DeviceKind::Block, 1, 3, Access::READ), 0);
        assert_eq!(run(&p, DeviceKind::Char, 1, 1, Access::READ), 0); // /dev/mem
        assert_eq!(run(&p, DeviceKind::Char, 10, 232, Access::RW), 0); // /dev/kvm
        assert_eq!(run(&p, DeviceKind::Block, 254, 0, Access::READ), 0);
        let p = program(MICROVM);
        assert_eq!(run(&p, DeviceKind::Char, 10, 232, Access::RW), 1);
        assert_eq!(run(&p, DeviceKind::Char, 10, 200, Access::RW), 1);
        assert_eq!(run(&p, DeviceKind::Char, 10, 232, Access::MKNOD), 0);
    }

    #[test]
    fn the_kernel_accepts_both_programs_and_explains_a_refusal() {
        if !nix::unistd::Uid::effective().is_root() {
            eprintln!("skipped: loading BPF programs needs root");
            return;
        }
        for rules in [STANDARD, MICROVM] {
            load(rules).unwrap();
        }
        // Exit without a return value: the verifier refuses, and the error carries its log.
        let err = load_insns(&[insn(BPF_EXIT, 0, 0, 0, 0)]).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("Permission denied") || msg.contains("Invalid argument"),
            "{msg}"
        );
        assert!(msg.contains("; verifier: ") && msg.contains("R0"), "{msg}");
        eprintln!("{msg}");
    }

    #[test]
    fn attr_layouts_match_the_kernel() {
        // offsetof(union bpf_attr, prog_name) == 48 and the attach prefix is 16 bytes.
        assert_eq!(std::mem::size_of::<ProgLoadAttr>(), 64);
        assert_eq!(std::mem::align_of::<ProgLoadAttr>(), 8);
        assert_eq!(std::mem::size_of::<ProgAttachAttr>(), 16);
    }
}
