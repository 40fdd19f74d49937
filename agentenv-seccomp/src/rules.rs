//! Building blocks shared by the policies of this crate and the VMM's own filter: the
//! target architecture, the system calls every policy allows, lists made of parts, and the
//! rule map of a list.

use std::collections::BTreeMap;

use seccompiler::{SeccompRule, TargetArch};

/// The architecture the filters are built for (the crate refuses to build for others).
#[cfg(target_arch = "x86_64")]
pub const TARGET_ARCH: TargetArch = TargetArch::x86_64;
/// The architecture the filters are built for (the crate refuses to build for others).
#[cfg(target_arch = "aarch64")]
pub const TARGET_ARCH: TargetArch = TargetArch::aarch64;

/// A list of system calls by name and number.
pub type SyscallList = &'static [(&'static str, i64)];

/// Reading and writing the descriptors a process holds: allowed by every policy here (the
/// sandbox's [`ALLOWED`](crate::ALLOWED) and the VMM's allow-list both start with it).
pub const DESCRIPTOR_IO: SyscallList = &[
    ("read", libc::SYS_read),
    ("write", libc::SYS_write),
    ("readv", libc::SYS_readv),
    ("writev", libc::SYS_writev),
    ("pread64", libc::SYS_pread64),
    ("pwrite64", libc::SYS_pwrite64),
    ("preadv", libc::SYS_preadv),
    ("pwritev", libc::SYS_pwritev),
    ("preadv2", libc::SYS_preadv2),
    ("pwritev2", libc::SYS_pwritev2),
    ("lseek", libc::SYS_lseek),
];

/// How many entries `parts` hold together: the length to give [`concat`].
pub const fn total_len(parts: &[SyscallList]) -> usize {
    let mut n = 0;
    let mut i = 0;
    while i < parts.len() {
        n += parts[i].len();
        i += 1;
    }
    n
}

/// `parts` one after the other, in order, as one list of `N` entries (`N` is
/// [`total_len`]`(parts)`; any other value fails to compile when used in a constant):
///
/// ```
/// use agentenv_seccomp::{DESCRIPTOR_IO, SyscallList, concat, total_len};
/// const PARTS: &[SyscallList] = &[DESCRIPTOR_IO, &[("close", libc::SYS_close)]];
/// const LIST: SyscallList = &concat::<{ total_len(PARTS) }>(PARTS);
/// assert_eq!(LIST.len(), DESCRIPTOR_IO.len() + 1);
/// ```
pub const fn concat<const N: usize>(parts: &[SyscallList]) -> [(&'static str, i64); N] {
    let mut out = [("", 0); N];
    let mut k = 0;
    let mut i = 0;
    while i < parts.len() {
        let mut j = 0;
        while j < parts[i].len() {
            out[k] = parts[i][j];
            k += 1;
            j += 1;
        }
        i += 1;
    }
    assert!(k == N, "concat: N is not the total length of the parts");
    out
}

/// The rule map in which every call of `list` matches whatever its arguments (the start
/// of an allow-list or a refusal list, before the conditional calls are added).
pub fn unconditional(list: &[(&str, i64)]) -> BTreeMap<i64, Vec<SeccompRule>> {
    list.iter().map(|(_, nr)| (*nr, Vec::new())).collect()
}
