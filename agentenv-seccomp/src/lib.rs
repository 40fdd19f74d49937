//! The seccomp policies of AgentENV, shared by the sandbox jail and the VMM.
//!
//! # The filters
//!
//! [`sandbox_filters`] returns three classic-BPF programs, to install in this order (after
//! `no_new_privs`, just before `execve`):
//!
//! 1. **The foreign-ABI prefilter** ([`prefilter()`], module [`prefilter`](mod@prefilter)):
//!    a call through a foreign architecture (i386 `int 0x80` on x86_64, 32-bit ARM on
//!    aarch64) **kills the process**; a number with the x32 bit (`0x40000000`) **fails with
//!    `EPERM`**. A filter keyed on syscall numbers is only meaningful for the ABI whose
//!    numbers it lists: the old deny-list let `unshare | 0x40000000` through. The VMM
//!    installs the same prefilter.
//! 2. **The allow-list** ([`ALLOWED`], plus `clone`, `personality`, `socket` and `ioctl` with
//!    conditions): what ordinary software needs, modelled on Docker's default profile. Any
//!    other call **fails with `ENOSYS`**, the answer of a kernel too old to have it, so libc
//!    and language runtimes take the fallback they already have (`clone3` → `clone`, and
//!    calls newer than this list → their older forms).
//! 3. **The refusals** ([`REFUSED`] and the refused forms of the conditional calls): fail with
//!    **`EPERM`**, the answer a program gets from a kernel that says "not allowed", so it
//!    reports a permission problem instead of looking for a fallback.
//!
//! Seccomp runs every installed filter and keeps the most severe answer; among equal ones
//! (`ERRNO` against `ERRNO`) the most recently installed filter's errno wins. Hence the
//! order: the refusals' `EPERM` overrides the allow-list's `ENOSYS`, and each program built
//! here starts with the prefilter's checks ([`with_abi_guard`]) so the allow-list's `ENOSYS`
//! cannot override the prefilter's `EPERM` for x32 numbers.
//!
//! Every check reads only `nr` and `arch` on the way to an unconditional `ALLOW`, so the
//! kernel's action cache (5.11+) skips the filters entirely for the hot calls (`read`,
//! `futex`, `epoll_pwait`, ...); only `clone`, `personality`, `socket` and `ioctl` run BPF.
//!
//! # What is allowed
//!
//! Files and descriptors (the `*at` family and the x86_64 legacy calls, xattrs, `splice`,
//! `sendfile`, `copy_file_range`, `fallocate`, inotify, legacy AIO), sockets of every family
//! but `AF_VSOCK` (servers bind ports; the network namespace and the node's rules decide
//! what they reach), memory (`mmap`, `mlock`, `memfd_create`, pkeys), processes (`fork`,
//! `vfork`, `clone` without namespace flags, `execve`, `wait4`, `waitid`, `pidfd_open`,
//! `pidfd_send_signal`, `prctl`, `seccomp`, landlock, scheduling, rlimits), users
//! (`setuid`, `setgid`, `setgroups`, `capset`: the kernel checks the capabilities the jail
//! kept), signals, clocks for reading and timers, System V and POSIX IPC (private IPC
//! namespace), `sethostname` (private UTS namespace), `chroot` (inside the sandbox's own
//! pivoted root), `mknod` (device nodes are made unusable by the device cgroup and `nodev`,
//! not here), ptys (`/dev/ptmx` and every `ioctl` but `TIOCSTI` and `TIOCLINUX`).
//!
//! # What is refused, and why
//!
//! See [`REFUSED`] (one reason per entry). In short: everything that reaches the host kernel
//! or host-wide state (modules, kexec, reboot, swap, clocks, accounting, quotas, I/O ports,
//! the kernel log, keyrings), namespaces and mounts (`unshare`, `setns`, `clone` with any
//! `CLONE_NEW*` flag, the whole mount family, file handles that bypass the mount namespace),
//! other processes' memory (`ptrace`, `process_vm_*`, `pidfd_getfd`, `kcmp`,
//! `process_madvise`), and large attack surfaces with no place in a sandbox (`io_uring`,
//! `bpf`, `perf_event_open`, `userfaultfd`). `personality` is allowed only for the values
//! Docker allows ([`PERSONALITY_ALLOWED`]); `socket(AF_VSOCK)` is refused because vsock is
//! not network-namespaced. `clone3` fails with `ENOSYS`: its flags live in memory a filter
//! cannot read, and libc falls back to `clone`, whose flags it can. Software that needs
//! what is refused (debuggers and `strace`, rootless container tools, io_uring-only
//! programs, `setarch -R`) does not work in a sandbox.
//!
//! To try a program against the policy: `cargo run -p agentenv-seccomp --example filtered --
//! PROGRAM [ARGS...]` (refused calls show as "Operation not permitted", unlisted ones as
//! "Function not implemented").
//!
//! # What the filter cannot promise
//!
//! * It checks numbers and integer arguments, never memory: pointer arguments (paths,
//!   `openat2`'s `how`, `sendmsg`'s control data) are the kernel's to judge, and can change
//!   between the check and the use.
//! * Every allowed call is still host kernel code run on tenant input: a bug in one (a
//!   socket family, a filesystem, `ioctl` on a device the sandbox can open) is an escape that
//!   no filter prevents. The jail narrows the surface; a microVM is the boundary.
//! * It does not bound resources (cgroups do), nor reachability (the network namespace and
//!   the node's rules do), nor what files a process sees (the overlay root, masked paths,
//!   mount namespace do), nor privileges (dropped capabilities, `no_new_privs`, and soon a
//!   user namespace do).
//! * Refusing a system call does not close other roads to the same thing: `syslog` is
//!   refused, but `/dev/kmsg` is the jail's `/dev` and device cgroup's to hide; `mount` is
//!   refused, but what `/proc` and `/sys` expose is the masking's to limit.
//! * Tenant processes may stack filters of their own (`seccomp` is allowed): those can only
//!   refuse more, or change which errno a refusal returns.

#[cfg(not(all(
    target_os = "linux",
    any(target_arch = "x86_64", target_arch = "aarch64")
)))]
compile_error!(
    "agentenv-seccomp supports Linux on x86_64 and aarch64 only: porting it means giving the \
     prefilter the architecture's AUDIT_ARCH value and foreign ABIs, and reviewing the \
     allow-list against that architecture's system call table"
);

#[cfg(test)]
mod bpf_eval;
pub mod prefilter;
mod rules;
mod sandbox;

pub use prefilter::{NATIVE_AUDIT_ARCH, X32_SYSCALL_BIT, abi_guard, prefilter, with_abi_guard};
pub use rules::{DESCRIPTOR_IO, SyscallList, TARGET_ARCH, concat, total_len, unconditional};
pub use sandbox::{
    ALLOWED, CLONE_NAMESPACE_FLAGS, CLONE_NAMESPACE_MASK, PERSONALITY_ALLOWED, REFUSED,
    REFUSED_IOCTLS, REFUSED_SOCKET_FAMILIES, sandbox_filters,
};
pub use seccompiler::BpfProgram;

/// Errors building or installing filters.
#[derive(Debug, thiserror::Error)]
pub enum SeccompError {
    #[error("building a seccomp filter: {0}")]
    Build(#[from] seccompiler::BackendError),
    #[error("a seccomp filter has {0} instructions, more than the kernel's limit of 4096")]
    TooLong(usize),
    #[error("installing a seccomp filter: {0}")]
    Install(#[from] seccompiler::Error),
}

/// Installs `filters` on the calling thread, in order (setting `no_new_privs` first, which
/// an unprivileged process needs). Threads and processes it creates afterwards inherit them.
///
/// Between `fork` and `execve` in a multi-threaded parent this is fine to call: it makes
/// two system calls per filter and allocates nothing.
pub fn install(filters: &[BpfProgram]) -> Result<(), SeccompError> {
    for f in filters {
        seccompiler::apply_filter(f)?;
    }
    Ok(())
}

/// Installs `filters` on every thread of the process, in order (threads started later
/// inherit them): for a process that already runs threads when it locks itself down, as
/// the VMM does once its VM is built.
pub fn install_all_threads(filters: &[BpfProgram]) -> Result<(), SeccompError> {
    for f in filters {
        seccompiler::apply_filter_all_threads(f)?;
    }
    Ok(())
}
