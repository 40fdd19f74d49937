//! The foreign-ABI prefilter: a hand-built BPF program, installed before every other filter,
//! that lets only the native system call ABI through.
//!
//! A Linux process can enter the kernel through more than one ABI, and a filter written
//! for one of them says nothing about the others:
//!
//! * **i386** (`int 0x80` or `sysenter` from 64-bit code, when the kernel has IA32
//!   emulation): `seccomp_data.arch` is `AUDIT_ARCH_I386` and the numbers are i386's, where
//!   `5` is `open`, not `fstat`. Nothing legitimate in a sandbox makes these calls (we run no
//!   32-bit binaries), so they **kill the process** (`SECCOMP_RET_KILL_PROCESS`): a program
//!   doing it is attacking the filter, and a silent errno would let it probe. The same holds
//!   for 32-bit ARM on aarch64.
//! * **x32** (x86_64 only, kernels with `CONFIG_X86_X32_ABI`): the same
//!   `AUDIT_ARCH_X86_64`, but the number carries `__X32_SYSCALL_BIT` (`0x40000000`), so a
//!   deny-list keyed on plain numbers never matches it (`unshare | 0x40000000` is `unshare`).
//!   Every number with that bit **fails with `EPERM`** instead of killing: libc never makes
//!   such calls by accident, but an errno keeps the refusal observable (tests, and attack
//!   suites that walk the ABI) while doing nothing. On aarch64 no valid number has that bit,
//!   so the same check costs nothing and refuses nothing real.
//!
//! Seccomp runs every installed filter on every call and keeps the most severe answer; among
//! answers of the same severity (two `ERRNO`s) the **most recently installed** filter's data
//! wins. So a later filter that answers `ENOSYS` for "not in my list" would turn the
//! prefilter's `EPERM` for an x32 number into `ENOSYS`. [`with_abi_guard`] therefore prefixes
//! the same checks to every program this crate builds: each program refuses foreign ABIs on
//! its own, and the stack answers the same whatever is installed after the prefilter.
//!
//! The instructions only load `arch` and `nr` and compare them with constants, so the
//! kernel's per-syscall action cache (Linux 5.11+) still sees every allowed native call as
//! "always allow" and skips the filters for it.

use seccompiler::{BpfProgram, sock_filter};

use crate::SeccompError;

/// `AUDIT_ARCH_X86_64`: `EM_X86_64 | __AUDIT_ARCH_64BIT | __AUDIT_ARCH_LE`.
pub const AUDIT_ARCH_X86_64: u32 = 0xC000_003E;
/// `AUDIT_ARCH_AARCH64`: `EM_AARCH64 | __AUDIT_ARCH_64BIT | __AUDIT_ARCH_LE`.
pub const AUDIT_ARCH_AARCH64: u32 = 0xC000_00B7;
/// `AUDIT_ARCH_I386` (`int 0x80` on x86_64).
pub const AUDIT_ARCH_I386: u32 = 0x4000_0003;
/// `AUDIT_ARCH_ARM` (32-bit compat tasks on aarch64).
pub const AUDIT_ARCH_ARM: u32 = 0x4000_0028;

/// The architecture value of native calls on this machine.
#[cfg(target_arch = "x86_64")]
pub const NATIVE_AUDIT_ARCH: u32 = AUDIT_ARCH_X86_64;
/// The architecture value of native calls on this machine.
#[cfg(target_arch = "aarch64")]
pub const NATIVE_AUDIT_ARCH: u32 = AUDIT_ARCH_AARCH64;

/// `__X32_SYSCALL_BIT`: set in the number of every x32 system call.
pub const X32_SYSCALL_BIT: u32 = 0x4000_0000;

// Classic BPF opcodes (linux/bpf_common.h), written as the combined values.
/// `BPF_LD | BPF_W | BPF_ABS` (`0x00 | 0x00 | 0x20`): load the 32-bit word at offset `k` of
/// `seccomp_data`.
pub(crate) const LD_W_ABS: u16 = 0x20;
/// `BPF_JMP | BPF_JEQ | BPF_K` (`0x05 | 0x10 | 0x00`): jump on `A == k`.
pub(crate) const JEQ_K: u16 = 0x15;
/// `BPF_JMP | BPF_JSET | BPF_K` (`0x05 | 0x40 | 0x00`): jump on `A & k != 0`.
pub(crate) const JSET_K: u16 = 0x45;
/// `BPF_RET | BPF_K` (`0x06 | 0x00`): return `k`.
pub(crate) const RET_K: u16 = 0x06;

/// Offset of `nr` in `struct seccomp_data`.
pub(crate) const DATA_NR: u32 = 0;
/// Offset of `arch` in `struct seccomp_data`.
pub(crate) const DATA_ARCH: u32 = 4;

/// The kernel's limit on the length of one filter (`BPF_MAXINSNS`).
pub const MAX_INSTRUCTIONS: usize = 4096;

/// What the guard returns for an x32 number: `SECCOMP_RET_ERRNO | EPERM`.
pub const RET_X32: u32 = libc::SECCOMP_RET_ERRNO | libc::EPERM as u32;
/// What the guard returns for a foreign architecture.
pub const RET_FOREIGN_ARCH: u32 = libc::SECCOMP_RET_KILL_PROCESS;

const fn stmt(code: u16, k: u32) -> sock_filter {
    sock_filter {
        code,
        jt: 0,
        jf: 0,
        k,
    }
}

const fn jump(code: u16, k: u32, jt: u8, jf: u8) -> sock_filter {
    sock_filter { code, jt, jf, k }
}

/// The foreign-ABI checks, without a final verdict: falls through to the next instruction
/// for a native call.
///
/// ```text
/// 0: ld  [arch]
/// 1: jeq #NATIVE_AUDIT_ARCH, +1, +0
/// 2: ret #KILL_PROCESS
/// 3: ld  [nr]
/// 4: jset #0x40000000, +0, +1
/// 5: ret #ERRNO(EPERM)
/// ```
pub fn abi_guard() -> [sock_filter; 6] {
    [
        stmt(LD_W_ABS, DATA_ARCH),
        jump(JEQ_K, NATIVE_AUDIT_ARCH, 1, 0),
        stmt(RET_K, RET_FOREIGN_ARCH),
        stmt(LD_W_ABS, DATA_NR),
        jump(JSET_K, X32_SYSCALL_BIT, 0, 1),
        stmt(RET_K, RET_X32),
    ]
}

/// The prefilter: [`abi_guard`] followed by `ret ALLOW`. Install it before any other filter.
pub fn prefilter() -> BpfProgram {
    let mut program = abi_guard().to_vec();
    program.push(stmt(RET_K, libc::SECCOMP_RET_ALLOW));
    program
}

/// `program` with [`abi_guard`] in front of it, so that it refuses foreign ABIs the same way
/// as the prefilter whatever it answers for calls it does not list (see the module docs).
/// The program's own jumps are relative and stay valid.
pub fn with_abi_guard(program: BpfProgram) -> Result<BpfProgram, SeccompError> {
    let guard = abi_guard();
    let len = guard.len() + program.len();
    if len > MAX_INSTRUCTIONS {
        return Err(SeccompError::TooLong(len));
    }
    let mut out = Vec::with_capacity(len);
    out.extend_from_slice(&guard);
    out.extend(program);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bpf_eval::{Data, run};

    const ALLOW: u32 = libc::SECCOMP_RET_ALLOW;

    fn data(arch: u32, nr: u32) -> Data {
        Data {
            nr,
            arch,
            args: [0; 6],
        }
    }

    #[test]
    fn the_prefilter_is_the_documented_instructions() {
        let p = prefilter();
        let raw: Vec<(u16, u8, u8, u32)> = p.iter().map(|i| (i.code, i.jt, i.jf, i.k)).collect();
        assert_eq!(
            raw,
            vec![
                (0x20, 0, 0, 4),
                (0x15, 1, 0, NATIVE_AUDIT_ARCH),
                (0x06, 0, 0, 0x8000_0000),
                (0x20, 0, 0, 0),
                (0x45, 0, 1, 0x4000_0000),
                (0x06, 0, 0, 0x0005_0001),
                (0x06, 0, 0, 0x7fff_0000),
            ]
        );
    }

    #[test]
    fn native_calls_pass_the_prefilter() {
        let p = prefilter();
        for nr in [0, 1, 39, 56, 231, 435, 0x3fff_ffff] {
            assert_eq!(run(&p, &data(NATIVE_AUDIT_ARCH, nr)), ALLOW, "nr {nr}");
        }
    }

    #[test]
    fn x32_numbers_fail_with_eperm() {
        let p = prefilter();
        for nr in [0, 39, 272, 512, 0x3fff_ffff, u32::MAX] {
            let nr = nr | X32_SYSCALL_BIT;
            assert_eq!(
                run(&p, &data(NATIVE_AUDIT_ARCH, nr)),
                libc::SECCOMP_RET_ERRNO | 1,
                "nr {nr:#x}"
            );
        }
    }

    #[test]
    fn foreign_architectures_kill_the_process() {
        let p = prefilter();
        let foreign = [
            AUDIT_ARCH_I386,
            AUDIT_ARCH_ARM,
            if NATIVE_AUDIT_ARCH == AUDIT_ARCH_X86_64 {
                AUDIT_ARCH_AARCH64
            } else {
                AUDIT_ARCH_X86_64
            },
            0,
            u32::MAX,
        ];
        for arch in foreign {
            // Whatever the number, x32 bit or not.
            for nr in [0, 20, X32_SYSCALL_BIT | 20] {
                assert_eq!(
                    run(&p, &data(arch, nr)),
                    libc::SECCOMP_RET_KILL_PROCESS,
                    "arch {arch:#x} nr {nr:#x}"
                );
            }
        }
    }

    #[test]
    fn the_guard_falls_through_to_the_guarded_program() {
        let inner = vec![stmt(RET_K, libc::SECCOMP_RET_ERRNO | libc::ENOSYS as u32)];
        let p = with_abi_guard(inner).unwrap();
        assert_eq!(p.len(), 7);
        assert_eq!(
            run(&p, &data(NATIVE_AUDIT_ARCH, 39)),
            libc::SECCOMP_RET_ERRNO | libc::ENOSYS as u32
        );
        // The guard answers before the guarded program's ENOSYS.
        assert_eq!(
            run(&p, &data(NATIVE_AUDIT_ARCH, 39 | X32_SYSCALL_BIT)),
            RET_X32
        );
        assert_eq!(
            run(&p, &data(AUDIT_ARCH_I386, 20)),
            libc::SECCOMP_RET_KILL_PROCESS
        );
    }

    #[test]
    fn a_guarded_program_past_the_kernel_limit_is_refused() {
        let inner = vec![stmt(RET_K, ALLOW); MAX_INSTRUCTIONS - 6];
        assert!(with_abi_guard(inner).is_ok());
        let inner = vec![stmt(RET_K, ALLOW); MAX_INSTRUCTIONS - 5];
        assert!(matches!(
            with_abi_guard(inner),
            Err(SeccompError::TooLong(4097))
        ));
    }

    #[test]
    fn the_prefilter_keeps_native_calls_cacheable() {
        // The kernel caches "always allow" per syscall only for filters that read nothing
        // but `nr` and `arch` on the way to the verdict.
        let p = prefilter();
        assert!(crate::bpf_eval::is_const_allow(&p, NATIVE_AUDIT_ARCH, 0));
    }
}
