//! The sandbox policy: the lists, and the filters built from them.

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule,
};

use crate::SeccompError;
use crate::prefilter::{prefilter, with_abi_guard};
use crate::rules::{DESCRIPTOR_IO, SyscallList, TARGET_ARCH, concat, total_len, unconditional};

/// System calls a sandbox may make with any arguments: what shells, coreutils, package
/// managers, interpreters, compilers, servers and the guest agent need.
///
/// Not listed here but allowed with conditions: `clone` ([`CLONE_NAMESPACE_FLAGS`]),
/// `personality` ([`PERSONALITY_ALLOWED`]), `socket` ([`REFUSED_SOCKET_FAMILIES`]) and
/// `ioctl` ([`REFUSED_IOCTLS`]).
pub const ALLOWED: &[(&str, i64)] = &concat::<{ total_len(ALLOWED_PARTS) }>(ALLOWED_PARTS);

/// [`ALLOWED`]: reading and writing descriptors ([`DESCRIPTOR_IO`]), then the rest.
const ALLOWED_PARTS: &[SyscallList] = &[DESCRIPTOR_IO, ALLOWED_BEYOND_DESCRIPTOR_IO];

const ALLOWED_BEYOND_DESCRIPTOR_IO: SyscallList = &[
    // --- moving data between descriptors
    ("sendfile", libc::SYS_sendfile),
    ("splice", libc::SYS_splice),
    ("tee", libc::SYS_tee),
    ("vmsplice", libc::SYS_vmsplice),
    ("copy_file_range", libc::SYS_copy_file_range),
    // --- descriptors
    ("close", libc::SYS_close),
    ("close_range", libc::SYS_close_range),
    ("dup", libc::SYS_dup),
    #[cfg(target_arch = "x86_64")]
    ("dup2", libc::SYS_dup2),
    ("dup3", libc::SYS_dup3),
    ("fcntl", libc::SYS_fcntl),
    ("flock", libc::SYS_flock),
    #[cfg(target_arch = "x86_64")]
    ("pipe", libc::SYS_pipe),
    ("pipe2", libc::SYS_pipe2),
    // --- opening, naming and inspecting files
    #[cfg(target_arch = "x86_64")]
    ("open", libc::SYS_open),
    ("openat", libc::SYS_openat),
    ("openat2", libc::SYS_openat2),
    #[cfg(target_arch = "x86_64")]
    ("creat", libc::SYS_creat),
    #[cfg(target_arch = "x86_64")]
    ("stat", libc::SYS_stat),
    #[cfg(target_arch = "x86_64")]
    ("lstat", libc::SYS_lstat),
    ("fstat", libc::SYS_fstat),
    ("newfstatat", libc::SYS_newfstatat),
    ("statx", libc::SYS_statx),
    ("statfs", libc::SYS_statfs),
    ("fstatfs", libc::SYS_fstatfs),
    #[cfg(target_arch = "x86_64")]
    ("access", libc::SYS_access),
    ("faccessat", libc::SYS_faccessat),
    ("faccessat2", libc::SYS_faccessat2),
    #[cfg(target_arch = "x86_64")]
    ("readlink", libc::SYS_readlink),
    ("readlinkat", libc::SYS_readlinkat),
    #[cfg(target_arch = "x86_64")]
    ("getdents", libc::SYS_getdents),
    ("getdents64", libc::SYS_getdents64),
    ("getcwd", libc::SYS_getcwd),
    ("chdir", libc::SYS_chdir),
    ("fchdir", libc::SYS_fchdir),
    // Only ever inside the sandbox's own pivoted root; the kept CAP_SYS_CHROOT is what
    // package tools (dpkg --root, build chroots) use it for.
    ("chroot", libc::SYS_chroot),
    #[cfg(target_arch = "x86_64")]
    ("mkdir", libc::SYS_mkdir),
    ("mkdirat", libc::SYS_mkdirat),
    #[cfg(target_arch = "x86_64")]
    ("rmdir", libc::SYS_rmdir),
    #[cfg(target_arch = "x86_64")]
    ("rename", libc::SYS_rename),
    #[cfg(target_arch = "x86_64")]
    ("renameat", libc::SYS_renameat),
    ("renameat2", libc::SYS_renameat2),
    #[cfg(target_arch = "x86_64")]
    ("link", libc::SYS_link),
    ("linkat", libc::SYS_linkat),
    #[cfg(target_arch = "x86_64")]
    ("symlink", libc::SYS_symlink),
    ("symlinkat", libc::SYS_symlinkat),
    #[cfg(target_arch = "x86_64")]
    ("unlink", libc::SYS_unlink),
    ("unlinkat", libc::SYS_unlinkat),
    // Device nodes are made useless by the device cgroup and nodev mounts, not here.
    #[cfg(target_arch = "x86_64")]
    ("mknod", libc::SYS_mknod),
    ("mknodat", libc::SYS_mknodat),
    ("truncate", libc::SYS_truncate),
    ("ftruncate", libc::SYS_ftruncate),
    ("fallocate", libc::SYS_fallocate),
    ("fadvise64", libc::SYS_fadvise64),
    ("readahead", libc::SYS_readahead),
    ("fsync", libc::SYS_fsync),
    ("fdatasync", libc::SYS_fdatasync),
    ("sync", libc::SYS_sync),
    ("syncfs", libc::SYS_syncfs),
    #[cfg(target_arch = "x86_64")]
    ("sync_file_range", libc::SYS_sync_file_range),
    // asm-generic/unistd.h `__NR_sync_file_range` (the libc crate lacks it on aarch64).
    #[cfg(target_arch = "aarch64")]
    ("sync_file_range", 84),
    ("umask", libc::SYS_umask),
    #[cfg(target_arch = "x86_64")]
    ("chmod", libc::SYS_chmod),
    ("fchmod", libc::SYS_fchmod),
    ("fchmodat", libc::SYS_fchmodat),
    #[cfg(target_arch = "x86_64")]
    ("fchmodat2", libc::SYS_fchmodat2),
    #[cfg(target_arch = "x86_64")]
    ("chown", libc::SYS_chown),
    ("fchown", libc::SYS_fchown),
    #[cfg(target_arch = "x86_64")]
    ("lchown", libc::SYS_lchown),
    ("fchownat", libc::SYS_fchownat),
    #[cfg(target_arch = "x86_64")]
    ("utime", libc::SYS_utime),
    #[cfg(target_arch = "x86_64")]
    ("utimes", libc::SYS_utimes),
    #[cfg(target_arch = "x86_64")]
    ("futimesat", libc::SYS_futimesat),
    ("utimensat", libc::SYS_utimensat),
    ("setxattr", libc::SYS_setxattr),
    ("lsetxattr", libc::SYS_lsetxattr),
    ("fsetxattr", libc::SYS_fsetxattr),
    ("getxattr", libc::SYS_getxattr),
    ("lgetxattr", libc::SYS_lgetxattr),
    ("fgetxattr", libc::SYS_fgetxattr),
    ("listxattr", libc::SYS_listxattr),
    ("llistxattr", libc::SYS_llistxattr),
    ("flistxattr", libc::SYS_flistxattr),
    ("removexattr", libc::SYS_removexattr),
    ("lremovexattr", libc::SYS_lremovexattr),
    ("fremovexattr", libc::SYS_fremovexattr),
    // --- waiting for events
    #[cfg(target_arch = "x86_64")]
    ("poll", libc::SYS_poll),
    ("ppoll", libc::SYS_ppoll),
    #[cfg(target_arch = "x86_64")]
    ("select", libc::SYS_select),
    ("pselect6", libc::SYS_pselect6),
    #[cfg(target_arch = "x86_64")]
    ("epoll_create", libc::SYS_epoll_create),
    ("epoll_create1", libc::SYS_epoll_create1),
    ("epoll_ctl", libc::SYS_epoll_ctl),
    #[cfg(target_arch = "x86_64")]
    ("epoll_wait", libc::SYS_epoll_wait),
    ("epoll_pwait", libc::SYS_epoll_pwait),
    ("epoll_pwait2", libc::SYS_epoll_pwait2),
    #[cfg(target_arch = "x86_64")]
    ("eventfd", libc::SYS_eventfd),
    ("eventfd2", libc::SYS_eventfd2),
    #[cfg(target_arch = "x86_64")]
    ("signalfd", libc::SYS_signalfd),
    ("signalfd4", libc::SYS_signalfd4),
    ("timerfd_create", libc::SYS_timerfd_create),
    ("timerfd_settime", libc::SYS_timerfd_settime),
    ("timerfd_gettime", libc::SYS_timerfd_gettime),
    #[cfg(target_arch = "x86_64")]
    ("inotify_init", libc::SYS_inotify_init),
    ("inotify_init1", libc::SYS_inotify_init1),
    ("inotify_add_watch", libc::SYS_inotify_add_watch),
    ("inotify_rm_watch", libc::SYS_inotify_rm_watch),
    // Without fanotify_init (not listed: it needs CAP_SYS_ADMIN) there is no fanotify
    // descriptor to mark; listed as Docker does.
    ("fanotify_mark", libc::SYS_fanotify_mark),
    // Legacy AIO (libaio: databases, qemu-img).
    ("io_setup", libc::SYS_io_setup),
    ("io_destroy", libc::SYS_io_destroy),
    ("io_submit", libc::SYS_io_submit),
    ("io_cancel", libc::SYS_io_cancel),
    ("io_getevents", libc::SYS_io_getevents),
    // --- sockets (`socket` itself is conditional)
    ("socketpair", libc::SYS_socketpair),
    ("bind", libc::SYS_bind),
    ("listen", libc::SYS_listen),
    ("accept", libc::SYS_accept),
    ("accept4", libc::SYS_accept4),
    ("connect", libc::SYS_connect),
    ("shutdown", libc::SYS_shutdown),
    ("getsockname", libc::SYS_getsockname),
    ("getpeername", libc::SYS_getpeername),
    ("getsockopt", libc::SYS_getsockopt),
    ("setsockopt", libc::SYS_setsockopt),
    ("sendto", libc::SYS_sendto),
    ("recvfrom", libc::SYS_recvfrom),
    ("sendmsg", libc::SYS_sendmsg),
    ("recvmsg", libc::SYS_recvmsg),
    ("sendmmsg", libc::SYS_sendmmsg),
    ("recvmmsg", libc::SYS_recvmmsg),
    // --- memory
    ("brk", libc::SYS_brk),
    ("mmap", libc::SYS_mmap),
    ("munmap", libc::SYS_munmap),
    ("mremap", libc::SYS_mremap),
    ("mprotect", libc::SYS_mprotect),
    ("madvise", libc::SYS_madvise),
    ("mincore", libc::SYS_mincore),
    ("msync", libc::SYS_msync),
    ("mlock", libc::SYS_mlock),
    ("mlock2", libc::SYS_mlock2),
    ("munlock", libc::SYS_munlock),
    ("mlockall", libc::SYS_mlockall),
    ("munlockall", libc::SYS_munlockall),
    ("remap_file_pages", libc::SYS_remap_file_pages),
    ("memfd_create", libc::SYS_memfd_create),
    ("memfd_secret", libc::SYS_memfd_secret),
    ("membarrier", libc::SYS_membarrier),
    ("mseal", libc::SYS_mseal),
    ("pkey_alloc", libc::SYS_pkey_alloc),
    ("pkey_free", libc::SYS_pkey_free),
    ("pkey_mprotect", libc::SYS_pkey_mprotect),
    // --- processes and threads (`clone` is conditional; `clone3` is left out on purpose)
    #[cfg(target_arch = "x86_64")]
    ("fork", libc::SYS_fork),
    #[cfg(target_arch = "x86_64")]
    ("vfork", libc::SYS_vfork),
    ("execve", libc::SYS_execve),
    ("execveat", libc::SYS_execveat),
    ("exit", libc::SYS_exit),
    ("exit_group", libc::SYS_exit_group),
    ("wait4", libc::SYS_wait4),
    ("waitid", libc::SYS_waitid),
    ("set_tid_address", libc::SYS_set_tid_address),
    ("set_robust_list", libc::SYS_set_robust_list),
    ("get_robust_list", libc::SYS_get_robust_list),
    ("rseq", libc::SYS_rseq),
    ("futex", libc::SYS_futex),
    ("futex_waitv", libc::SYS_futex_waitv),
    #[cfg(target_arch = "x86_64")]
    ("arch_prctl", libc::SYS_arch_prctl),
    #[cfg(target_arch = "x86_64")]
    ("set_thread_area", libc::SYS_set_thread_area),
    #[cfg(target_arch = "x86_64")]
    ("get_thread_area", libc::SYS_get_thread_area),
    ("prctl", libc::SYS_prctl),
    // Lets a program filter itself further (Chromium, systemd units, our own installer
    // between filters): stacked filters can only refuse more.
    ("seccomp", libc::SYS_seccomp),
    ("landlock_create_ruleset", libc::SYS_landlock_create_ruleset),
    ("landlock_add_rule", libc::SYS_landlock_add_rule),
    ("landlock_restrict_self", libc::SYS_landlock_restrict_self),
    ("pidfd_open", libc::SYS_pidfd_open),
    ("pidfd_send_signal", libc::SYS_pidfd_send_signal),
    ("process_mrelease", libc::SYS_process_mrelease),
    ("getpid", libc::SYS_getpid),
    ("getppid", libc::SYS_getppid),
    ("gettid", libc::SYS_gettid),
    ("getpgid", libc::SYS_getpgid),
    #[cfg(target_arch = "x86_64")]
    ("getpgrp", libc::SYS_getpgrp),
    ("setpgid", libc::SYS_setpgid),
    ("getsid", libc::SYS_getsid),
    ("setsid", libc::SYS_setsid),
    ("getpriority", libc::SYS_getpriority),
    ("setpriority", libc::SYS_setpriority),
    ("ioprio_get", libc::SYS_ioprio_get),
    ("ioprio_set", libc::SYS_ioprio_set),
    #[cfg(target_arch = "x86_64")]
    ("getrlimit", libc::SYS_getrlimit),
    #[cfg(target_arch = "x86_64")]
    ("setrlimit", libc::SYS_setrlimit),
    // asm-generic/unistd.h `__NR_getrlimit`, `__NR_setrlimit` (not in the libc crate on
    // aarch64).
    #[cfg(target_arch = "aarch64")]
    ("getrlimit", 163),
    #[cfg(target_arch = "aarch64")]
    ("setrlimit", 164),
    ("prlimit64", libc::SYS_prlimit64),
    ("getrusage", libc::SYS_getrusage),
    ("times", libc::SYS_times),
    ("sched_yield", libc::SYS_sched_yield),
    ("sched_getaffinity", libc::SYS_sched_getaffinity),
    ("sched_setaffinity", libc::SYS_sched_setaffinity),
    ("sched_getparam", libc::SYS_sched_getparam),
    ("sched_setparam", libc::SYS_sched_setparam),
    ("sched_getscheduler", libc::SYS_sched_getscheduler),
    ("sched_setscheduler", libc::SYS_sched_setscheduler),
    ("sched_getattr", libc::SYS_sched_getattr),
    ("sched_setattr", libc::SYS_sched_setattr),
    ("sched_get_priority_max", libc::SYS_sched_get_priority_max),
    ("sched_get_priority_min", libc::SYS_sched_get_priority_min),
    ("sched_rr_get_interval", libc::SYS_sched_rr_get_interval),
    ("getcpu", libc::SYS_getcpu),
    // --- users and capabilities (the kernel checks the kept capabilities)
    ("getuid", libc::SYS_getuid),
    ("geteuid", libc::SYS_geteuid),
    ("getgid", libc::SYS_getgid),
    ("getegid", libc::SYS_getegid),
    ("getresuid", libc::SYS_getresuid),
    ("getresgid", libc::SYS_getresgid),
    ("getgroups", libc::SYS_getgroups),
    ("setuid", libc::SYS_setuid),
    ("setgid", libc::SYS_setgid),
    ("setreuid", libc::SYS_setreuid),
    ("setregid", libc::SYS_setregid),
    ("setresuid", libc::SYS_setresuid),
    ("setresgid", libc::SYS_setresgid),
    ("setfsuid", libc::SYS_setfsuid),
    ("setfsgid", libc::SYS_setfsgid),
    ("setgroups", libc::SYS_setgroups),
    ("capget", libc::SYS_capget),
    ("capset", libc::SYS_capset),
    // --- signals
    ("kill", libc::SYS_kill),
    ("tkill", libc::SYS_tkill),
    ("tgkill", libc::SYS_tgkill),
    ("rt_sigaction", libc::SYS_rt_sigaction),
    ("rt_sigprocmask", libc::SYS_rt_sigprocmask),
    ("rt_sigreturn", libc::SYS_rt_sigreturn),
    ("rt_sigpending", libc::SYS_rt_sigpending),
    ("rt_sigsuspend", libc::SYS_rt_sigsuspend),
    ("rt_sigtimedwait", libc::SYS_rt_sigtimedwait),
    ("rt_sigqueueinfo", libc::SYS_rt_sigqueueinfo),
    ("rt_tgsigqueueinfo", libc::SYS_rt_tgsigqueueinfo),
    ("sigaltstack", libc::SYS_sigaltstack),
    ("restart_syscall", libc::SYS_restart_syscall),
    #[cfg(target_arch = "x86_64")]
    ("pause", libc::SYS_pause),
    // --- time (reading it, sleeping, timers; setting the clock is refused)
    ("clock_gettime", libc::SYS_clock_gettime),
    ("clock_getres", libc::SYS_clock_getres),
    ("clock_nanosleep", libc::SYS_clock_nanosleep),
    ("gettimeofday", libc::SYS_gettimeofday),
    #[cfg(target_arch = "x86_64")]
    ("time", libc::SYS_time),
    ("nanosleep", libc::SYS_nanosleep),
    #[cfg(target_arch = "x86_64")]
    ("alarm", libc::SYS_alarm),
    ("getitimer", libc::SYS_getitimer),
    ("setitimer", libc::SYS_setitimer),
    ("timer_create", libc::SYS_timer_create),
    ("timer_settime", libc::SYS_timer_settime),
    ("timer_gettime", libc::SYS_timer_gettime),
    ("timer_getoverrun", libc::SYS_timer_getoverrun),
    ("timer_delete", libc::SYS_timer_delete),
    // --- System V and POSIX IPC (the IPC namespace is the sandbox's own)
    ("shmget", libc::SYS_shmget),
    ("shmat", libc::SYS_shmat),
    ("shmdt", libc::SYS_shmdt),
    ("shmctl", libc::SYS_shmctl),
    ("semget", libc::SYS_semget),
    ("semop", libc::SYS_semop),
    ("semtimedop", libc::SYS_semtimedop),
    ("semctl", libc::SYS_semctl),
    ("msgget", libc::SYS_msgget),
    ("msgsnd", libc::SYS_msgsnd),
    ("msgrcv", libc::SYS_msgrcv),
    ("msgctl", libc::SYS_msgctl),
    ("mq_open", libc::SYS_mq_open),
    ("mq_unlink", libc::SYS_mq_unlink),
    ("mq_timedsend", libc::SYS_mq_timedsend),
    ("mq_timedreceive", libc::SYS_mq_timedreceive),
    ("mq_notify", libc::SYS_mq_notify),
    ("mq_getsetattr", libc::SYS_mq_getsetattr),
    // --- the system (the UTS namespace is the sandbox's own)
    ("uname", libc::SYS_uname),
    ("sysinfo", libc::SYS_sysinfo),
    ("sethostname", libc::SYS_sethostname),
    ("setdomainname", libc::SYS_setdomainname),
    ("getrandom", libc::SYS_getrandom),
];

/// System calls that fail with `EPERM` whatever their arguments: each one reaches past the
/// sandbox (the host kernel, other namespaces, other processes, host-wide state) or is a
/// large kernel attack surface no ordinary program needs.
pub const REFUSED: &[(&str, i64)] = &[
    // io_uring: its own syscall-like interface the filter cannot see into, and a long CVE list.
    ("io_uring_setup", libc::SYS_io_uring_setup),
    // io_uring: submits work on a ring set up elsewhere.
    ("io_uring_enter", libc::SYS_io_uring_enter),
    // io_uring: registers buffers and files with a ring.
    ("io_uring_register", libc::SYS_io_uring_register),
    // Loads programs into the host kernel's verifier and JIT.
    ("bpf", libc::SYS_bpf),
    // Lets a process stall kernel copies at will: the classic race-widening exploit tool.
    ("userfaultfd", libc::SYS_userfaultfd),
    // Host-wide performance counters, kernel addresses, and a long CVE list.
    ("perf_event_open", libc::SYS_perf_event_open),
    // The kernel keyrings are not namespaced: keys of the host and other tenants.
    ("keyctl", libc::SYS_keyctl),
    // Same keyrings: creates keys in them.
    ("add_key", libc::SYS_add_key),
    // Same keyrings: can call out to the host's /sbin/request-key.
    ("request_key", libc::SYS_request_key),
    // New namespaces of any kind: a new user namespace hands out every capability in it.
    ("unshare", libc::SYS_unshare),
    // Joins other namespaces, the host's among them if a descriptor leaks.
    ("setns", libc::SYS_setns),
    // Replaces the host kernel.
    ("kexec_load", libc::SYS_kexec_load),
    // Replaces the host kernel, from a file.
    ("kexec_file_load", libc::SYS_kexec_file_load),
    // Loads code into the host kernel.
    ("init_module", libc::SYS_init_module),
    // Loads code into the host kernel, from a file.
    ("finit_module", libc::SYS_finit_module),
    // Unloads host kernel modules.
    ("delete_module", libc::SYS_delete_module),
    // Opens any file of a filesystem by handle, bypassing the mount namespace (shocker).
    ("open_by_handle_at", libc::SYS_open_by_handle_at),
    // The other half of open_by_handle_at: makes the handles.
    ("name_to_handle_at", libc::SYS_name_to_handle_at),
    // Mounting: the sandbox's root is prepared before it starts; it never mounts.
    ("mount", libc::SYS_mount),
    // Unmounting would uncover what masked paths hide.
    ("umount2", libc::SYS_umount2),
    // Changes the root of the mount namespace.
    ("pivot_root", libc::SYS_pivot_root),
    // New mount API: moves mounts.
    ("move_mount", libc::SYS_move_mount),
    // New mount API: clones mount trees.
    ("open_tree", libc::SYS_open_tree),
    // New mount API: creates filesystem contexts (a superblock parser fed by the tenant).
    ("fsopen", libc::SYS_fsopen),
    // New mount API: configures filesystem contexts.
    ("fsconfig", libc::SYS_fsconfig),
    // New mount API: creates mounts.
    ("fsmount", libc::SYS_fsmount),
    // New mount API: reconfigures existing mounts.
    ("fspick", libc::SYS_fspick),
    // Changes mount attributes (read-only, idmaps, propagation).
    ("mount_setattr", libc::SYS_mount_setattr),
    // Host swap configuration.
    ("swapon", libc::SYS_swapon),
    // Host swap configuration.
    ("swapoff", libc::SYS_swapoff),
    // Reboots the host (or sets Ctrl-Alt-Del behaviour).
    ("reboot", libc::SYS_reboot),
    // Reads and writes other processes' memory and registers, and rewrites their syscalls.
    ("ptrace", libc::SYS_ptrace),
    // Reads another process's memory.
    ("process_vm_readv", libc::SYS_process_vm_readv),
    // Writes another process's memory.
    ("process_vm_writev", libc::SYS_process_vm_writev),
    // Copies another process's descriptors (ptrace access).
    ("pidfd_getfd", libc::SYS_pidfd_getfd),
    // Advises on another process's memory (ptrace access).
    ("process_madvise", libc::SYS_process_madvise),
    // Compares other processes' kernel objects (ptrace access; leaks kernel pointers' order).
    ("kcmp", libc::SYS_kcmp),
    // The host clock is not namespaced.
    ("settimeofday", libc::SYS_settimeofday),
    // The host clock is not namespaced.
    ("clock_settime", libc::SYS_clock_settime),
    // Tunes the host clock.
    ("clock_adjtime", libc::SYS_clock_adjtime),
    // Tunes the host clock (clock_adjtime on CLOCK_REALTIME).
    ("adjtimex", libc::SYS_adjtimex),
    // Host-wide process accounting to a file.
    ("acct", libc::SYS_acct),
    // Disk quotas of host filesystems.
    ("quotactl", libc::SYS_quotactl),
    // Disk quotas, by descriptor.
    ("quotactl_fd", libc::SYS_quotactl_fd),
    // The host kernel log: kernel addresses, other tenants' traces.
    ("syslog", libc::SYS_syslog),
    // Raw I/O port access to host hardware.
    #[cfg(target_arch = "x86_64")]
    ("iopl", libc::SYS_iopl),
    // Raw I/O port access to host hardware.
    #[cfg(target_arch = "x86_64")]
    ("ioperm", libc::SYS_ioperm),
    // Profiling interface of the host kernel (removed from new kernels).
    ("lookup_dcookie", libc::SYS_lookup_dcookie),
    // Hangs up the controlling terminal.
    ("vhangup", libc::SYS_vhangup),
    // The kernel NFS server's control (removed; never for a sandbox).
    ("nfsservctl", libc::SYS_nfsservctl),
    // Loads a.out libraries: an old, unmaintained loader.
    #[cfg(target_arch = "x86_64")]
    ("uselib", libc::SYS_uselib),
];

/// The `CLONE_NEW*` flags: a `clone` carrying any of them fails with `EPERM` (other `clone`
/// calls are allowed). On `clone` the bit of `CLONE_NEWTIME` (`0x80`) lies in the exit-signal
/// byte, where any value with it set is an invalid signal the kernel refuses anyway, so
/// checking it refuses nothing legitimate.
pub const CLONE_NAMESPACE_FLAGS: &[(&str, u64)] = &[
    ("CLONE_NEWNS", libc::CLONE_NEWNS as u64),
    ("CLONE_NEWUTS", libc::CLONE_NEWUTS as u64),
    ("CLONE_NEWIPC", libc::CLONE_NEWIPC as u64),
    ("CLONE_NEWUSER", libc::CLONE_NEWUSER as u64),
    ("CLONE_NEWPID", libc::CLONE_NEWPID as u64),
    ("CLONE_NEWNET", libc::CLONE_NEWNET as u64),
    ("CLONE_NEWCGROUP", libc::CLONE_NEWCGROUP as u64),
    ("CLONE_NEWTIME", libc::CLONE_NEWTIME as u64),
];

/// All of [`CLONE_NAMESPACE_FLAGS`] in one mask.
pub const CLONE_NAMESPACE_MASK: u64 = {
    let mut mask = 0;
    let mut i = 0;
    while i < CLONE_NAMESPACE_FLAGS.len() {
        mask |= CLONE_NAMESPACE_FLAGS[i].1;
        i += 1;
    }
    mask
};

/// The `personality` arguments allowed, as in Docker's profile: `PER_LINUX` (0),
/// `PER_LINUX32` (8), `UNAME26` (0x20000), `PER_LINUX32 | UNAME26` (0x20008) and `0xffffffff`
/// (query). Any other value (`ADDR_NO_RANDOMIZE`, `READ_IMPLIES_EXEC`, ...) weakens the
/// process's own hardening and fails with `EPERM`.
pub const PERSONALITY_ALLOWED: &[u64] = &[0x0, 0x8, 0x2_0000, 0x2_0008, 0xffff_ffff];

/// Socket families `socket` refuses with `EPERM`: `AF_VSOCK` is not network-namespaced, so
/// on a host that is itself a VM it reaches the hypervisor's services around every network
/// rule (Docker refuses it too).
pub const REFUSED_SOCKET_FAMILIES: &[(&str, u64)] = &[("AF_VSOCK", libc::AF_VSOCK as u64)];

/// `ioctl` requests refused with `EPERM`: `TIOCSTI` pushes input into a terminal (keystroke
/// injection into whoever shares it), `TIOCLINUX` reaches the virtual console (selection
/// paste, kernel messages). Every other request is allowed: descriptors, not the filter,
/// bound what an ioctl reaches.
pub const REFUSED_IOCTLS: &[(&str, u64)] =
    &[("TIOCSTI", libc::TIOCSTI), ("TIOCLINUX", libc::TIOCLINUX)];

fn dword(arg: u8, op: SeccompCmpOp, value: u64) -> Result<SeccompCondition, SeccompError> {
    // Every argument checked here is an `int` or `unsigned int` for the kernel (clone uses
    // the low 32 bits of its flags), so only the low word counts.
    Ok(SeccompCondition::new(
        arg,
        SeccompCmpArgLen::Dword,
        op,
        value,
    )?)
}

fn rule(conditions: Vec<SeccompCondition>) -> Result<SeccompRule, SeccompError> {
    Ok(SeccompRule::new(conditions)?)
}

/// The allow-list: what [`ALLOWED`] lists and the allowed forms of the conditional calls
/// pass; everything else fails with `ENOSYS`.
fn allow_filter() -> Result<BpfProgram, SeccompError> {
    let mut rules = unconditional(ALLOWED);
    // clone without any namespace flag.
    rules.insert(
        libc::SYS_clone,
        vec![rule(vec![dword(
            0,
            SeccompCmpOp::MaskedEq(CLONE_NAMESPACE_MASK),
            0,
        )?])?],
    );
    rules.insert(
        libc::SYS_personality,
        PERSONALITY_ALLOWED
            .iter()
            .map(|v| rule(vec![dword(0, SeccompCmpOp::Eq, *v)?]))
            .collect::<Result<_, _>>()?,
    );
    rules.insert(
        libc::SYS_socket,
        vec![rule(
            REFUSED_SOCKET_FAMILIES
                .iter()
                .map(|(_, f)| dword(0, SeccompCmpOp::Ne, *f))
                .collect::<Result<_, _>>()?,
        )?],
    );
    rules.insert(
        libc::SYS_ioctl,
        vec![rule(
            REFUSED_IOCTLS
                .iter()
                .map(|(_, r)| dword(1, SeccompCmpOp::Ne, *r))
                .collect::<Result<_, _>>()?,
        )?],
    );
    let filter = SeccompFilter::new(
        rules,
        SeccompAction::Errno(libc::ENOSYS as u32),
        SeccompAction::Allow,
        TARGET_ARCH,
    )?;
    with_abi_guard(filter.try_into()?)
}

/// The refusals: [`REFUSED`] and the refused forms of the conditional calls fail with
/// `EPERM`; everything else passes (for the allow-list installed before it to decide).
fn refuse_filter() -> Result<BpfProgram, SeccompError> {
    let mut rules = unconditional(REFUSED);
    rules.insert(
        libc::SYS_clone,
        CLONE_NAMESPACE_FLAGS
            .iter()
            .map(|(_, flag)| rule(vec![dword(0, SeccompCmpOp::MaskedEq(*flag), *flag)?]))
            .collect::<Result<_, _>>()?,
    );
    rules.insert(
        libc::SYS_personality,
        vec![rule(
            PERSONALITY_ALLOWED
                .iter()
                .map(|v| dword(0, SeccompCmpOp::Ne, *v))
                .collect::<Result<_, _>>()?,
        )?],
    );
    rules.insert(
        libc::SYS_socket,
        REFUSED_SOCKET_FAMILIES
            .iter()
            .map(|(_, f)| rule(vec![dword(0, SeccompCmpOp::Eq, *f)?]))
            .collect::<Result<_, _>>()?,
    );
    rules.insert(
        libc::SYS_ioctl,
        REFUSED_IOCTLS
            .iter()
            .map(|(_, r)| rule(vec![dword(1, SeccompCmpOp::Eq, *r)?]))
            .collect::<Result<_, _>>()?,
    );
    let filter = SeccompFilter::new(
        rules,
        SeccompAction::Allow,
        SeccompAction::Errno(libc::EPERM as u32),
        TARGET_ARCH,
    )?;
    with_abi_guard(filter.try_into()?)
}

/// The filters of every sandbox process, in install order: the foreign-ABI
/// [`prefilter`](crate::prefilter()), the allow-list (anything unlisted: `ENOSYS`), then the
/// refusals (`EPERM`). Seccomp answers with the most recently installed filter among equally
/// severe answers, so the refusals' `EPERM` wins over the allow-list's `ENOSYS`.
pub fn sandbox_filters() -> Result<Vec<BpfProgram>, SeccompError> {
    Ok(vec![prefilter(), allow_filter()?, refuse_filter()?])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bpf_eval::{Data, is_const_allow, run, run_stack};
    use crate::prefilter::{AUDIT_ARCH_I386, NATIVE_AUDIT_ARCH, X32_SYSCALL_BIT};

    const ALLOW: u32 = libc::SECCOMP_RET_ALLOW;
    const EPERM: u32 = libc::SECCOMP_RET_ERRNO | libc::EPERM as u32;
    const ENOSYS: u32 = libc::SECCOMP_RET_ERRNO | libc::ENOSYS as u32;
    const KILL: u32 = libc::SECCOMP_RET_KILL_PROCESS;

    fn verdict(nr: i64, args: [u64; 6]) -> u32 {
        run_stack(&sandbox_filters().unwrap(), &Data::native(nr, args))
    }

    /// The numbers with a rule of their own (not in either list).
    const CONDITIONAL: &[i64] = &[
        libc::SYS_clone,
        libc::SYS_personality,
        libc::SYS_socket,
        libc::SYS_ioctl,
    ];

    #[test]
    fn filters_compile_within_the_kernel_limit() {
        let filters = sandbox_filters().unwrap();
        assert_eq!(filters.len(), 3);
        assert_eq!(filters[0], prefilter());
        for f in &filters {
            assert!(!f.is_empty());
            assert!(f.len() <= crate::prefilter::MAX_INSTRUCTIONS, "{}", f.len());
        }
    }

    fn assert_unique(what: &str, nrs: impl IntoIterator<Item = i64>) {
        let mut seen = std::collections::BTreeSet::new();
        for nr in nrs {
            assert!(seen.insert(nr), "{what}: {nr} is listed twice");
        }
    }

    #[test]
    fn no_duplicates_and_no_overlap_in_the_lists() {
        assert_unique("ALLOWED", ALLOWED.iter().map(|(_, n)| *n));
        assert_unique("REFUSED", REFUSED.iter().map(|(_, n)| *n));
        // A number is in at most one of: ALLOWED, REFUSED, the conditional ones, clone3.
        assert_unique(
            "all lists",
            ALLOWED
                .iter()
                .chain(REFUSED)
                .map(|(_, n)| *n)
                .chain(CONDITIONAL.iter().copied())
                .chain([libc::SYS_clone3]),
        );
        let mut names = std::collections::BTreeSet::new();
        for (name, _) in ALLOWED.iter().chain(REFUSED) {
            assert!(names.insert(*name), "{name} is listed twice");
        }
        assert_unique(
            "CLONE_NAMESPACE_FLAGS",
            CLONE_NAMESPACE_FLAGS.iter().map(|(_, f)| *f as i64),
        );
        assert_unique(
            "PERSONALITY_ALLOWED",
            PERSONALITY_ALLOWED.iter().map(|v| *v as i64),
        );
        assert_eq!(
            CLONE_NAMESPACE_MASK.count_ones() as usize,
            CLONE_NAMESPACE_FLAGS.len()
        );
    }

    #[test]
    fn the_brief_s_refusals_are_all_listed() {
        let must: &[&str] = &[
            "io_uring_setup",
            "io_uring_enter",
            "io_uring_register",
            "bpf",
            "userfaultfd",
            "perf_event_open",
            "keyctl",
            "add_key",
            "request_key",
            "unshare",
            "setns",
            "kexec_load",
            "kexec_file_load",
            "init_module",
            "finit_module",
            "delete_module",
            "open_by_handle_at",
            "name_to_handle_at",
            "mount",
            "umount2",
            "pivot_root",
            "move_mount",
            "open_tree",
            "fsopen",
            "fsconfig",
            "fsmount",
            "fspick",
            "mount_setattr",
            "swapon",
            "swapoff",
            "reboot",
            "ptrace",
            "process_vm_readv",
            "process_vm_writev",
            "settimeofday",
            "clock_settime",
            "clock_adjtime",
            "acct",
            "quotactl",
            "syslog",
            #[cfg(target_arch = "x86_64")]
            "iopl",
            #[cfg(target_arch = "x86_64")]
            "ioperm",
            "lookup_dcookie",
            "vhangup",
            "nfsservctl",
            #[cfg(target_arch = "x86_64")]
            "uselib",
        ];
        for name in must {
            assert!(REFUSED.iter().any(|(n, _)| n == name), "{name} not refused");
        }
    }

    /// What the guest agent (tokio, hyper, std::process, its own libc calls) needs.
    #[test]
    fn the_guest_agent_s_syscalls_are_allowed() {
        let needs: &[i64] = &[
            libc::SYS_read,
            libc::SYS_write,
            libc::SYS_openat,
            libc::SYS_close,
            libc::SYS_statx,
            libc::SYS_newfstatat,
            libc::SYS_fstat,
            libc::SYS_lseek,
            libc::SYS_getdents64,
            libc::SYS_mkdirat,
            libc::SYS_unlinkat,
            libc::SYS_renameat2,
            libc::SYS_symlinkat,
            libc::SYS_linkat,
            libc::SYS_readlinkat,
            libc::SYS_fchown,
            libc::SYS_fchownat,
            libc::SYS_fchmod,
            libc::SYS_fchmodat,
            libc::SYS_utimensat,
            libc::SYS_ftruncate,
            libc::SYS_fsync,
            libc::SYS_statfs,
            libc::SYS_lgetxattr,
            libc::SYS_llistxattr,
            libc::SYS_lsetxattr,
            libc::SYS_mknodat,
            libc::SYS_mmap,
            libc::SYS_munmap,
            libc::SYS_mprotect,
            libc::SYS_madvise,
            libc::SYS_brk,
            libc::SYS_futex,
            libc::SYS_epoll_create1,
            libc::SYS_epoll_ctl,
            libc::SYS_epoll_pwait,
            libc::SYS_eventfd2,
            libc::SYS_socketpair,
            libc::SYS_bind,
            libc::SYS_listen,
            libc::SYS_accept4,
            libc::SYS_connect,
            libc::SYS_setsockopt,
            libc::SYS_getsockopt,
            libc::SYS_getsockname,
            libc::SYS_getpeername,
            libc::SYS_sendto,
            libc::SYS_recvfrom,
            libc::SYS_sendmsg,
            libc::SYS_recvmsg,
            libc::SYS_shutdown,
            libc::SYS_pipe2,
            libc::SYS_dup3,
            libc::SYS_fcntl,
            libc::SYS_execve,
            libc::SYS_wait4,
            libc::SYS_waitid,
            libc::SYS_kill,
            libc::SYS_tgkill,
            libc::SYS_pidfd_open,
            libc::SYS_pidfd_send_signal,
            libc::SYS_splice,
            libc::SYS_sendfile,
            libc::SYS_copy_file_range,
            libc::SYS_fallocate,
            libc::SYS_inotify_init1,
            libc::SYS_inotify_add_watch,
            libc::SYS_inotify_rm_watch,
            libc::SYS_prctl,
            libc::SYS_setuid,
            libc::SYS_setgid,
            libc::SYS_setgroups,
            libc::SYS_setsid,
            libc::SYS_setpgid,
            libc::SYS_getrandom,
            libc::SYS_sched_getaffinity,
            libc::SYS_sched_yield,
            libc::SYS_rt_sigaction,
            libc::SYS_rt_sigprocmask,
            libc::SYS_rt_sigreturn,
            libc::SYS_rt_sigtimedwait,
            libc::SYS_sigaltstack,
            libc::SYS_prlimit64,
            libc::SYS_clock_gettime,
            libc::SYS_clock_nanosleep,
            libc::SYS_nanosleep,
            libc::SYS_set_robust_list,
            libc::SYS_set_tid_address,
            libc::SYS_rseq,
            libc::SYS_exit,
            libc::SYS_exit_group,
            libc::SYS_getpid,
            libc::SYS_gettid,
            libc::SYS_geteuid,
            libc::SYS_getegid,
            libc::SYS_uname,
            libc::SYS_ppoll,
            libc::SYS_close_range,
            #[cfg(target_arch = "x86_64")]
            libc::SYS_poll,
            #[cfg(target_arch = "x86_64")]
            libc::SYS_open,
            #[cfg(target_arch = "x86_64")]
            libc::SYS_dup2,
        ];
        for nr in needs {
            assert_eq!(verdict(*nr, [0; 6]), ALLOW, "syscall {nr}");
        }
        // The conditional ones, in the forms the agent uses.
        let fork = libc::SIGCHLD as u64;
        let thread = (libc::CLONE_VM
            | libc::CLONE_FS
            | libc::CLONE_FILES
            | libc::CLONE_SIGHAND
            | libc::CLONE_THREAD
            | libc::CLONE_SYSVSEM
            | libc::CLONE_SETTLS
            | libc::CLONE_PARENT_SETTID
            | libc::CLONE_CHILD_CLEARTID) as u64;
        let spawn = (libc::CLONE_VM | libc::CLONE_VFORK) as u64 | fork;
        for flags in [fork, thread, spawn] {
            assert_eq!(
                verdict(libc::SYS_clone, [flags, 0, 0, 0, 0, 0]),
                ALLOW,
                "clone {flags:#x}"
            );
        }
        for (domain, request) in [
            (libc::AF_INET, libc::FIONBIO),
            (libc::AF_INET6, libc::TIOCSCTTY),
            (libc::AF_UNIX, libc::TIOCSWINSZ),
            (libc::AF_NETLINK, libc::TIOCGPTN),
        ] {
            assert_eq!(
                verdict(libc::SYS_socket, [domain as u64, 1, 0, 0, 0, 0]),
                ALLOW
            );
            assert_eq!(verdict(libc::SYS_ioctl, [0, request, 0, 0, 0, 0]), ALLOW);
        }
    }

    #[test]
    fn every_allowed_syscall_is_allowed_and_cacheable() {
        let filters = sandbox_filters().unwrap();
        for (name, nr) in ALLOWED {
            let d = Data::native(*nr, [u64::MAX; 6]);
            assert_eq!(run_stack(&filters, &d), ALLOW, "{name}");
            for f in &filters {
                assert!(
                    is_const_allow(f, NATIVE_AUDIT_ARCH, *nr as u32),
                    "{name} would not be cached as always allowed"
                );
            }
        }
    }

    #[test]
    fn every_refused_syscall_fails_with_eperm_and_x32_numbers_too() {
        for (name, nr) in REFUSED {
            assert_eq!(verdict(*nr, [0; 6]), EPERM, "{name}");
            assert_eq!(
                verdict(*nr | i64::from(X32_SYSCALL_BIT), [0; 6]),
                EPERM,
                "x32 {name}"
            );
        }
        for (name, nr) in ALLOWED {
            assert_eq!(
                verdict(*nr | i64::from(X32_SYSCALL_BIT), [0; 6]),
                EPERM,
                "x32 {name}"
            );
        }
    }

    #[test]
    fn i386_calls_kill_the_process() {
        let filters = sandbox_filters().unwrap();
        for nr in [1, 20, 120, 310, 0x4000_0000] {
            let d = Data {
                nr,
                arch: AUDIT_ARCH_I386,
                args: [0; 6],
            };
            assert_eq!(run_stack(&filters, &d), KILL, "nr {nr}");
        }
    }

    #[test]
    fn clone_with_a_namespace_flag_is_refused() {
        for (name, flag) in CLONE_NAMESPACE_FLAGS {
            let flags = flag | libc::SIGCHLD as u64;
            assert_eq!(
                verdict(libc::SYS_clone, [flags, 0, 0, 0, 0, 0]),
                EPERM,
                "{name}"
            );
            // Whatever else is set, the high word included.
            let flags = flags | 0xffff_ffff_0000_0000 | libc::CLONE_VM as u64;
            assert_eq!(
                verdict(libc::SYS_clone, [flags, 0, 0, 0, 0, 0]),
                EPERM,
                "{name}"
            );
        }
        // High bits the kernel ignores do not turn a fork into a refusal.
        assert_eq!(
            verdict(libc::SYS_clone, [0xffff_ffff_0000_0011, 0, 0, 0, 0, 0]),
            ALLOW
        );
        assert_eq!(verdict(libc::SYS_clone3, [0; 6]), ENOSYS);
    }

    #[test]
    fn personality_allows_only_the_harmless_values() {
        for v in PERSONALITY_ALLOWED {
            assert_eq!(verdict(libc::SYS_personality, [*v, 0, 0, 0, 0, 0]), ALLOW);
        }
        for v in [0x0040000u64, 0x0400000, 0x1, 0x0800_0000, 0xfffe] {
            assert_eq!(
                verdict(libc::SYS_personality, [v, 0, 0, 0, 0, 0]),
                EPERM,
                "{v:#x}"
            );
        }
    }

    #[test]
    fn vsock_sockets_and_terminal_injection_are_refused() {
        assert_eq!(
            verdict(libc::SYS_socket, [libc::AF_VSOCK as u64, 1, 0, 0, 0, 0]),
            EPERM
        );
        for (name, request) in REFUSED_IOCTLS {
            assert_eq!(
                verdict(libc::SYS_ioctl, [0, *request, 0, 0, 0, 0]),
                EPERM,
                "{name}"
            );
        }
    }

    #[test]
    fn everything_unlisted_fails_with_enosys() {
        let listed: std::collections::BTreeSet<i64> = ALLOWED
            .iter()
            .chain(REFUSED)
            .map(|(_, n)| *n)
            .chain(CONDITIONAL.iter().copied())
            .collect();
        let mut unlisted = 0;
        for nr in (0..1024).chain([0x3fff_ffff]) {
            if listed.contains(&nr) {
                continue;
            }
            assert_eq!(verdict(nr, [0; 6]), ENOSYS, "syscall {nr}");
            unlisted += 1;
        }
        assert!(unlisted > 600);
        // Some that exist and are left out on purpose.
        for nr in [
            libc::SYS_clone3,
            libc::SYS_get_mempolicy,
            libc::SYS_mbind,
            libc::SYS_fanotify_init,
            libc::SYS_migrate_pages,
            #[cfg(target_arch = "x86_64")]
            libc::SYS_modify_ldt,
        ] {
            assert_eq!(verdict(nr, [0; 6]), ENOSYS, "syscall {nr}");
        }
    }

    #[test]
    fn each_filter_refuses_foreign_abis_on_its_own() {
        for f in sandbox_filters().unwrap() {
            let x32 = Data::native(libc::SYS_getpid | i64::from(X32_SYSCALL_BIT), [0; 6]);
            assert_eq!(run(&f, &x32), EPERM);
            let i386 = Data {
                nr: 20,
                arch: AUDIT_ARCH_I386,
                args: [0; 6],
            };
            assert_eq!(run(&f, &i386), KILL);
        }
    }
}
