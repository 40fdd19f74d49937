//! The seccomp filter of the VMM process, installed once the VM is built: an allow-list of
//! what the API, vCPU and device threads need; any other system call kills the process.
//!
//! The shared foreign-ABI prefilter of [`agentenv_seccomp`] goes first, as in every sandbox
//! process: an i386 (`int 0x80`) call kills the process, an x32 number (bit `0x40000000`) is
//! refused. Here the allow-list then kills on the x32 number too (it lists native numbers
//! only), so for the VMM both end the process.
//!
//! Allowed: KVM and tap/socket ioctls (by ioctl type: KVM `0xAE`, tun/terminal `'T'`,
//! socket `0x89`), eventfd, epoll, poll, timers, file I/O on descriptors and opening files
//! (snapshots are written into a directory the node chose), memory mapping, futexes and
//! thread creation (`clone` only with `CLONE_THREAD` and without any `CLONE_NEW*` flag;
//! `clone3` fails with `ENOSYS` so libc falls back to `clone`), unix socket operations for
//! the API and vsock sockets, signals to itself, and exit. Never allowed: `execve`, new
//! processes, namespaces, mounts, ptrace, module loading, BPF and everything else not
//! listed.

use std::collections::BTreeMap;

use agentenv_seccomp::{DESCRIPTOR_IO, SyscallList, TARGET_ARCH, concat, total_len, unconditional};
use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule,
};

/// Errors building the filter.
#[derive(Debug, thiserror::Error)]
pub enum SeccompError {
    #[error("building the VMM seccomp filter: {0}")]
    Build(#[from] seccompiler::BackendError),
    #[error("compiling the VMM seccomp filter: {0}")]
    Compile(#[from] seccompiler::Error),
}

/// System calls allowed without conditions: reading and writing descriptors
/// ([`DESCRIPTOR_IO`], as in every policy), then what the VMM needs beyond that.
pub const ALLOWED_SYSCALLS: &[(&str, i64)] = &concat::<{ total_len(ALLOWED_PARTS) }>(ALLOWED_PARTS);

const ALLOWED_PARTS: &[SyscallList] = &[DESCRIPTOR_IO, ALLOWED_BEYOND_DESCRIPTOR_IO];

const ALLOWED_BEYOND_DESCRIPTOR_IO: SyscallList = &[
    // files and descriptors
    ("openat", libc::SYS_openat),
    ("open", libc::SYS_open),
    ("close", libc::SYS_close),
    ("fstat", libc::SYS_fstat),
    ("newfstatat", libc::SYS_newfstatat),
    ("statx", libc::SYS_statx),
    ("stat", libc::SYS_stat),
    ("lstat", libc::SYS_lstat),
    ("fsync", libc::SYS_fsync),
    ("fdatasync", libc::SYS_fdatasync),
    ("ftruncate", libc::SYS_ftruncate),
    ("fallocate", libc::SYS_fallocate),
    ("mkdir", libc::SYS_mkdir),
    ("mkdirat", libc::SYS_mkdirat),
    ("rename", libc::SYS_rename),
    ("renameat", libc::SYS_renameat),
    ("renameat2", libc::SYS_renameat2),
    ("unlink", libc::SYS_unlink),
    ("unlinkat", libc::SYS_unlinkat),
    ("getdents64", libc::SYS_getdents64),
    ("getcwd", libc::SYS_getcwd),
    ("readlink", libc::SYS_readlink),
    ("readlinkat", libc::SYS_readlinkat),
    ("fcntl", libc::SYS_fcntl),
    ("dup", libc::SYS_dup),
    ("dup2", libc::SYS_dup2),
    ("dup3", libc::SYS_dup3),
    ("pipe2", libc::SYS_pipe2),
    ("copy_file_range", libc::SYS_copy_file_range),
    ("sendfile", libc::SYS_sendfile),
    // events, polling and timers
    ("eventfd2", libc::SYS_eventfd2),
    ("epoll_create1", libc::SYS_epoll_create1),
    ("epoll_ctl", libc::SYS_epoll_ctl),
    ("epoll_wait", libc::SYS_epoll_wait),
    ("epoll_pwait", libc::SYS_epoll_pwait),
    ("epoll_pwait2", libc::SYS_epoll_pwait2),
    ("poll", libc::SYS_poll),
    ("ppoll", libc::SYS_ppoll),
    ("select", libc::SYS_select),
    ("pselect6", libc::SYS_pselect6),
    ("timerfd_create", libc::SYS_timerfd_create),
    ("timerfd_settime", libc::SYS_timerfd_settime),
    ("timerfd_gettime", libc::SYS_timerfd_gettime),
    ("clock_gettime", libc::SYS_clock_gettime),
    ("clock_nanosleep", libc::SYS_clock_nanosleep),
    ("nanosleep", libc::SYS_nanosleep),
    ("gettimeofday", libc::SYS_gettimeofday),
    // memory
    ("mmap", libc::SYS_mmap),
    ("munmap", libc::SYS_munmap),
    ("mremap", libc::SYS_mremap),
    ("mprotect", libc::SYS_mprotect),
    ("madvise", libc::SYS_madvise),
    ("brk", libc::SYS_brk),
    ("msync", libc::SYS_msync),
    ("memfd_create", libc::SYS_memfd_create),
    // threads and signals
    ("futex", libc::SYS_futex),
    ("set_robust_list", libc::SYS_set_robust_list),
    ("rseq", libc::SYS_rseq),
    ("sched_yield", libc::SYS_sched_yield),
    ("sched_getaffinity", libc::SYS_sched_getaffinity),
    ("getpid", libc::SYS_getpid),
    ("gettid", libc::SYS_gettid),
    ("getuid", libc::SYS_getuid),
    ("geteuid", libc::SYS_geteuid),
    ("getrandom", libc::SYS_getrandom),
    ("prctl", libc::SYS_prctl),
    ("rt_sigaction", libc::SYS_rt_sigaction),
    ("rt_sigprocmask", libc::SYS_rt_sigprocmask),
    ("rt_sigreturn", libc::SYS_rt_sigreturn),
    ("sigaltstack", libc::SYS_sigaltstack),
    ("tgkill", libc::SYS_tgkill),
    ("tkill", libc::SYS_tkill),
    ("clone3", libc::SYS_clone3),
    ("exit", libc::SYS_exit),
    ("exit_group", libc::SYS_exit_group),
    ("getrusage", libc::SYS_getrusage),
    // sockets: the API socket and the vsock unix sockets
    ("socket", libc::SYS_socket),
    ("bind", libc::SYS_bind),
    ("listen", libc::SYS_listen),
    ("accept4", libc::SYS_accept4),
    ("accept", libc::SYS_accept),
    ("connect", libc::SYS_connect),
    ("shutdown", libc::SYS_shutdown),
    ("sendto", libc::SYS_sendto),
    ("recvfrom", libc::SYS_recvfrom),
    ("sendmsg", libc::SYS_sendmsg),
    ("recvmsg", libc::SYS_recvmsg),
    ("getsockopt", libc::SYS_getsockopt),
    ("setsockopt", libc::SYS_setsockopt),
    ("getsockname", libc::SYS_getsockname),
    ("getpeername", libc::SYS_getpeername),
    ("socketpair", libc::SYS_socketpair),
];

/// ioctl types (bits 8–15 of the request) the VMM uses: KVM, tun and terminal (`'T'`, which
/// also holds `FIONBIO` and `FIOCLEX`), and socket interface requests.
pub const ALLOWED_IOCTL_TYPES: &[(&str, u64)] =
    &[("KVM", 0xAE), ("tun/terminal", 0x54), ("socket", 0x89)];

/// The filters to install, in this order (every one applies: a denial wins).
///
/// `mismatch` is what happens to a call outside the allow-list: `KillProcess` in
/// production (`--seccomp strict`). The VMM installs them on all its threads with
/// [`agentenv_seccomp::install_all_threads`].
pub fn vmm_filters(mismatch: SeccompAction) -> Result<Vec<BpfProgram>, SeccompError> {
    let mut rules = unconditional(ALLOWED_SYSCALLS);
    // clone: threads only, and never into a new namespace.
    let thread = libc::CLONE_THREAD as u64;
    rules.insert(
        libc::SYS_clone,
        vec![SeccompRule::new(vec![SeccompCondition::new(
            0,
            SeccompCmpArgLen::Qword,
            SeccompCmpOp::MaskedEq(thread | agentenv_seccomp::CLONE_NAMESPACE_MASK),
            thread,
        )?])?],
    );
    let ioctl_rules = ALLOWED_IOCTL_TYPES
        .iter()
        .map(|(_, ty)| {
            SeccompRule::new(vec![SeccompCondition::new(
                1,
                SeccompCmpArgLen::Dword,
                SeccompCmpOp::MaskedEq(0xff00),
                ty << 8,
            )?])
        })
        .collect::<Result<Vec<_>, _>>()?;
    rules.insert(libc::SYS_ioctl, ioctl_rules);
    let allow = SeccompFilter::new(rules, mismatch, SeccompAction::Allow, TARGET_ARCH)?;
    let clone3 = SeccompFilter::new(
        BTreeMap::from([(libc::SYS_clone3, Vec::new())]),
        SeccompAction::Allow,
        SeccompAction::Errno(libc::ENOSYS as u32),
        TARGET_ARCH,
    )?;
    // The foreign-ABI prefilter goes first, the allow-list last: once it is installed,
    // `seccomp` itself is forbidden.
    Ok(vec![
        agentenv_seccomp::prefilter(),
        clone3.try_into()?,
        allow.try_into()?,
    ])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shared_prefilter_is_installed_first() {
        let filters = vmm_filters(SeccompAction::KillProcess).unwrap();
        assert_eq!(filters.len(), 3);
        assert_eq!(filters[0], agentenv_seccomp::prefilter());
    }

    /// The VMM allows nothing the sandbox policy refuses: every refusal there (namespaces,
    /// mounts, ptrace, keyrings, io_uring, bpf, ...) is something the VMM never needs either.
    /// No exception so far; one would have to be listed here with its reason.
    #[test]
    fn the_vmm_allows_nothing_the_sandbox_policy_refuses() {
        const NEEDED_BY_THE_VMM: &[&str] = &[];
        for (name, nr) in ALLOWED_SYSCALLS {
            if NEEDED_BY_THE_VMM.contains(name) {
                continue;
            }
            assert!(
                !agentenv_seccomp::REFUSED.iter().any(|(_, r)| r == nr),
                "the VMM allows {name}, which agentenv_seccomp::REFUSED refuses"
            );
        }
        // Nor the conditionally allowed ones: clone (threads, no namespace flag) and ioctl
        // (by type) are checked by their own rules; personality and socket(AF_VSOCK) are
        // not allowed at all.
        for nr in [libc::SYS_clone, libc::SYS_ioctl, libc::SYS_personality] {
            assert!(!ALLOWED_SYSCALLS.iter().any(|(_, n)| *n == nr));
        }
    }

    #[test]
    fn allow_list_has_no_duplicates() {
        let mut nrs: Vec<i64> = ALLOWED_SYSCALLS.iter().map(|(_, n)| *n).collect();
        nrs.sort();
        let len = nrs.len();
        nrs.dedup();
        assert_eq!(nrs.len(), len);
        for forbidden in [
            libc::SYS_execve,
            libc::SYS_execveat,
            libc::SYS_fork,
            libc::SYS_vfork,
            libc::SYS_mount,
            libc::SYS_ptrace,
            libc::SYS_setns,
            libc::SYS_unshare,
            libc::SYS_bpf,
            libc::SYS_init_module,
        ] {
            assert!(!nrs.contains(&forbidden), "{forbidden} must not be allowed");
        }
    }

    /// Runs `body` in a forked child under the strict filter; returns how the child ended.
    fn in_filtered_child(body: fn() -> i32) -> nix_like::Status {
        let filters = vmm_filters(SeccompAction::KillProcess).unwrap();
        // SAFETY: the child only applies the prepared filters, makes raw syscalls and exits
        // with _exit; it never returns into the test harness.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            for f in &filters {
                if seccompiler::apply_filter(f).is_err() {
                    // SAFETY: _exit ends the child without running destructors.
                    unsafe { libc::_exit(90) };
                }
            }
            let code = body();
            // SAFETY: as above.
            unsafe { libc::_exit(code) };
        }
        let mut status = 0;
        // SAFETY: waits for the child forked above; `status` is a valid out pointer.
        let r = unsafe { libc::waitpid(pid, &mut status, 0) };
        assert_eq!(r, pid);
        if libc::WIFSIGNALED(status) {
            nix_like::Status::Signaled(libc::WTERMSIG(status))
        } else {
            nix_like::Status::Exited(libc::WEXITSTATUS(status))
        }
    }

    mod nix_like {
        #[derive(Debug, PartialEq, Eq)]
        pub enum Status {
            Exited(i32),
            Signaled(i32),
        }
    }

    #[test]
    fn a_forbidden_syscall_kills_the_vmm_process() {
        let status = in_filtered_child(|| {
            // SAFETY: unshare with a namespace flag takes a plain integer; the filter kills
            // the process before the kernel sees it.
            unsafe { libc::unshare(libc::CLONE_NEWUTS) };
            7
        });
        assert_eq!(status, nix_like::Status::Signaled(libc::SIGSYS));
        let status = in_filtered_child(|| {
            let path = c"/bin/true";
            let argv = [path.as_ptr(), std::ptr::null()];
            let envp = [std::ptr::null()];
            // SAFETY: execve with valid NUL-terminated arrays; killed by the filter.
            unsafe { libc::execve(path.as_ptr(), argv.as_ptr(), envp.as_ptr()) };
            7
        });
        assert_eq!(status, nix_like::Status::Signaled(libc::SIGSYS));
    }

    #[test]
    fn foreign_abis_and_namespaced_threads_kill_the_vmm_process() {
        // An x32 getpid: refused by the prefilter, killed by the allow-list.
        let status = in_filtered_child(|| {
            let x32 = i64::from(agentenv_seccomp::X32_SYSCALL_BIT);
            // SAFETY: getpid takes no arguments; the filter ends the process first.
            unsafe { libc::syscall(libc::SYS_getpid | x32) };
            7
        });
        assert_eq!(status, nix_like::Status::Signaled(libc::SIGSYS));
        // A "thread" into a new network namespace. Without the filter the kernel would
        // answer EINVAL (CLONE_THREAD needs CLONE_SIGHAND), and the child would exit 7.
        let status = in_filtered_child(|| {
            let flags = libc::c_long::from(libc::CLONE_THREAD | libc::CLONE_NEWNET);
            // SAFETY: clone with flags the filter refuses; no stack or pointers are passed.
            unsafe { libc::syscall(libc::SYS_clone, flags, 0, 0, 0, 0) };
            7
        });
        assert_eq!(status, nix_like::Status::Signaled(libc::SIGSYS));
    }

    #[test]
    fn allowed_syscalls_keep_working_under_the_filter() {
        let status = in_filtered_child(|| {
            // SAFETY: plain syscalls with valid arguments.
            unsafe {
                let efd = libc::eventfd(0, libc::EFD_CLOEXEC);
                if efd < 0 {
                    return 1;
                }
                let one: u64 = 1;
                if libc::write(efd, (&one as *const u64).cast(), 8) != 8 {
                    return 2;
                }
                let ep = libc::epoll_create1(libc::EPOLL_CLOEXEC);
                if ep < 0 {
                    return 3;
                }
                let mut fds = [0; 2];
                if libc::socketpair(libc::AF_UNIX, libc::SOCK_STREAM, 0, fds.as_mut_ptr()) != 0 {
                    return 4;
                }
                // FIONBIO is a 'T' ioctl.
                let mut on: libc::c_int = 1;
                if libc::ioctl(fds[0], libc::FIONBIO, &mut on) != 0 {
                    return 5;
                }
                // A forbidden ioctl type would kill; an allowed syscall that fails is fine.
                if libc::getpid() <= 0 {
                    return 6;
                }
                0
            }
        });
        assert_eq!(status, nix_like::Status::Exited(0));
    }
}
