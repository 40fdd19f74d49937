//! The seccomp filter of every sandbox process: everything is allowed except what a
//! sandbox must never do, which fails with `EPERM`.
//!
//! Denied: loading and removing kernel modules, kexec, reboot, mounting and the new mount
//! API (sandboxes never mount: their root is prepared before the agent starts), swap,
//! the kernel keyrings, ptrace and cross-process memory access, BPF and perf events,
//! setting the clocks, process accounting, quotas, I/O port access, joining or creating
//! namespaces (`setns`, `unshare`, and `clone` with any `CLONE_NEW*` flag), file handles
//! (`open_by_handle_at` escapes a mount namespace), `userfaultfd`, `syslog`.
//! `clone3` fails with `ENOSYS` (its flags live in memory a filter cannot read), so libc
//! falls back to `clone`, which the filter can check.

use std::collections::BTreeMap;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule, TargetArch,
};

/// Errors building the filter.
#[derive(Debug, thiserror::Error)]
pub enum SeccompError {
    #[error("seccomp filters are not supported on {0}")]
    UnsupportedArch(&'static str),
    #[error("building the seccomp filter: {0}")]
    Build(#[from] seccompiler::BackendError),
    #[error("compiling the seccomp filter: {0}")]
    Compile(#[from] seccompiler::Error),
}

/// System calls that fail with `EPERM` in every sandbox.
pub const DENIED_SYSCALLS: &[(&str, i64)] = &[
    ("init_module", libc::SYS_init_module),
    ("finit_module", libc::SYS_finit_module),
    ("delete_module", libc::SYS_delete_module),
    ("kexec_load", libc::SYS_kexec_load),
    ("kexec_file_load", libc::SYS_kexec_file_load),
    ("reboot", libc::SYS_reboot),
    ("mount", libc::SYS_mount),
    ("umount2", libc::SYS_umount2),
    ("pivot_root", libc::SYS_pivot_root),
    ("move_mount", libc::SYS_move_mount),
    ("open_tree", libc::SYS_open_tree),
    ("fsopen", libc::SYS_fsopen),
    ("fsconfig", libc::SYS_fsconfig),
    ("fsmount", libc::SYS_fsmount),
    ("fspick", libc::SYS_fspick),
    ("mount_setattr", libc::SYS_mount_setattr),
    ("swapon", libc::SYS_swapon),
    ("swapoff", libc::SYS_swapoff),
    ("add_key", libc::SYS_add_key),
    ("request_key", libc::SYS_request_key),
    ("keyctl", libc::SYS_keyctl),
    ("ptrace", libc::SYS_ptrace),
    ("process_vm_readv", libc::SYS_process_vm_readv),
    ("process_vm_writev", libc::SYS_process_vm_writev),
    ("bpf", libc::SYS_bpf),
    ("perf_event_open", libc::SYS_perf_event_open),
    ("settimeofday", libc::SYS_settimeofday),
    ("clock_settime", libc::SYS_clock_settime),
    ("clock_adjtime", libc::SYS_clock_adjtime),
    ("acct", libc::SYS_acct),
    ("quotactl", libc::SYS_quotactl),
    ("setns", libc::SYS_setns),
    ("unshare", libc::SYS_unshare),
    ("open_by_handle_at", libc::SYS_open_by_handle_at),
    ("name_to_handle_at", libc::SYS_name_to_handle_at),
    ("userfaultfd", libc::SYS_userfaultfd),
    ("syslog", libc::SYS_syslog),
    #[cfg(target_arch = "x86_64")]
    ("iopl", libc::SYS_iopl),
    #[cfg(target_arch = "x86_64")]
    ("ioperm", libc::SYS_ioperm),
];

/// Namespace flags `clone` may not carry.
const CLONE_NS_FLAGS: &[libc::c_int] = &[
    libc::CLONE_NEWNS,
    libc::CLONE_NEWUTS,
    libc::CLONE_NEWIPC,
    libc::CLONE_NEWUSER,
    libc::CLONE_NEWPID,
    libc::CLONE_NEWNET,
    libc::CLONE_NEWCGROUP,
];

fn target_arch() -> Result<TargetArch, SeccompError> {
    std::env::consts::ARCH
        .try_into()
        .map_err(|_| SeccompError::UnsupportedArch(std::env::consts::ARCH))
}

/// The filters to install, in order (both apply).
pub fn sandbox_filters() -> Result<Vec<BpfProgram>, SeccompError> {
    let arch = target_arch()?;
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> = DENIED_SYSCALLS
        .iter()
        .map(|(_, nr)| (*nr, Vec::new()))
        .collect();
    let clone_rules = CLONE_NS_FLAGS
        .iter()
        .map(|flag| {
            // The flags are clone's first argument on every supported architecture.
            SeccompRule::new(vec![SeccompCondition::new(
                0,
                SeccompCmpArgLen::Qword,
                SeccompCmpOp::MaskedEq(*flag as u64),
                *flag as u64,
            )?])
        })
        .collect::<Result<Vec<_>, _>>()?;
    rules.insert(libc::SYS_clone, clone_rules);
    let deny = SeccompFilter::new(
        rules,
        SeccompAction::Allow,
        SeccompAction::Errno(libc::EPERM as u32),
        arch,
    )?;
    let clone3 = SeccompFilter::new(
        BTreeMap::from([(libc::SYS_clone3, Vec::new())]),
        SeccompAction::Allow,
        SeccompAction::Errno(libc::ENOSYS as u32),
        arch,
    )?;
    Ok(vec![deny.try_into()?, clone3.try_into()?])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filters_compile_for_this_machine() {
        let f = sandbox_filters().unwrap();
        assert_eq!(f.len(), 2);
        assert!(f.iter().all(|p| !p.is_empty()));
    }

    #[test]
    fn denied_list_has_no_duplicates() {
        let mut nrs: Vec<i64> = DENIED_SYSCALLS.iter().map(|(_, n)| *n).collect();
        nrs.sort();
        let len = nrs.len();
        nrs.dedup();
        assert_eq!(nrs.len(), len);
    }

    #[test]
    fn filter_denies_a_listed_syscall_in_a_child_process() {
        // Apply in a forked child so the test process keeps its own syscalls.
        let filters = sandbox_filters().unwrap();
        // SAFETY: the child only makes raw syscalls and exits; it never returns into the
        // test harness.
        match unsafe { nix::unistd::fork() }.unwrap() {
            nix::unistd::ForkResult::Child => {
                let mut code = 0;
                for f in &filters {
                    if seccompiler::apply_filter(f).is_err() {
                        code = 10;
                    }
                }
                // SAFETY: keyctl(KEYCTL_GET_KEYRING_ID, KEY_SPEC_SESSION_KEYRING, 0) takes
                // plain integers.
                let r = unsafe { libc::syscall(libc::SYS_keyctl, 0, -3, 0) };
                let errno = std::io::Error::last_os_error().raw_os_error().unwrap_or(0);
                if code == 0 && !(r == -1 && errno == libc::EPERM) {
                    code = 11;
                }
                // SAFETY: unshare with a namespace flag; denied by the filter.
                let r = unsafe { libc::unshare(libc::CLONE_NEWUTS) };
                let errno = std::io::Error::last_os_error().raw_os_error().unwrap_or(0);
                if code == 0 && !(r == -1 && errno == libc::EPERM) {
                    code = 12;
                }
                // SAFETY: getpid has no arguments and is allowed.
                if code == 0 && unsafe { libc::getpid() } <= 0 {
                    code = 13;
                }
                // SAFETY: _exit ends the child without running the parent's destructors.
                unsafe { libc::_exit(code) };
            }
            nix::unistd::ForkResult::Parent { child } => {
                let status = nix::sys::wait::waitpid(child, None).unwrap();
                assert_eq!(status, nix::sys::wait::WaitStatus::Exited(child, 0));
            }
        }
    }
}
