//! System calls a sandbox must never make, each natively and through its x32 number
//! (`nr | 0x40000000`), plus i386 calls through `int 0x80`.
//!
//! The arguments are chosen so that a call the filter lets through either succeeds
//! (and is undone: the child exits, closing what it opened) or makes the kernel answer
//! with an error other than `EPERM`/`ENOSYS` (a null pointer → `EFAULT`, fd -1 →
//! `EBADF`, an unknown command → `EINVAL`, …). So `EPERM`/`ENOSYS` (or SIGSYS) is a
//! refusal, and anything else shows the call reached the kernel: an escape of the
//! filter, even where the kernel then refused for lack of a capability. Where the
//! kernel itself checks a capability before any argument (kexec, modules) `EPERM`
//! cannot tell the filter from the missing capability; the detail says so. No call
//! here can change the host: pointers are null, descriptors invalid, magic numbers
//! wrong.

use crate::sys::{self, SysResult, X32_SYSCALL_BIT};
use crate::{Attempt, Config, Outcome, sigsys_is_contained};

/// `UFFD_USER_MODE_ONLY`: userfaultfd without privileges (so an unfiltered call works).
const UFFD_USER_MODE_ONLY: libc::c_long = 1;
/// `KEYCTL_GET_KEYRING_ID`, `KEY_SPEC_THREAD_KEYRING`.
const KEYCTL_GET_KEYRING_ID: libc::c_long = 0;
const KEY_SPEC_THREAD_KEYRING: libc::c_long = -1;
/// The x32 number of kexec_load (its x32 entry is not the common one).
const X32_KEXEC_LOAD: libc::c_long = 528;
/// `SYSLOG_ACTION_SIZE_BUFFER`.
const SYSLOG_ACTION_SIZE_BUFFER: libc::c_long = 10;

/// A probe: system call name, native number, x32 number (without the bit), arguments
/// (a null `params` marker is replaced by a buffer), and what `EPERM` may also mean.
struct Probe {
    name: &'static str,
    nr: libc::c_long,
    x32: libc::c_long,
    args: [libc::c_long; 6],
    /// io_uring_setup needs a zeroed `struct io_uring_params` (120 bytes) as arg 1.
    params_buf: bool,
    /// Why EPERM cannot tell the filter from the kernel's own capability check.
    eperm_note: Option<&'static str>,
    /// Errnos besides EPERM/ENOSYS that mean "refused" (ENOSPC: no user namespaces left).
    also_refusal: &'static [i32],
}

const fn probe(name: &'static str, nr: libc::c_long, args: [libc::c_long; 6]) -> Probe {
    Probe {
        name,
        nr,
        x32: nr,
        args,
        params_buf: false,
        eperm_note: None,
        also_refusal: &[],
    }
}

fn probes() -> Vec<Probe> {
    let cap = |mut p: Probe, note| {
        p.eperm_note = Some(note);
        p
    };
    let mut setup = probe(
        "io_uring_setup",
        libc::SYS_io_uring_setup,
        [1, 0, 0, 0, 0, 0],
    );
    setup.params_buf = true;
    let mut kexec = probe("kexec_load", libc::SYS_kexec_load, [0, 0, 0, 0, 0, 0]);
    kexec.x32 = X32_KEXEC_LOAD;
    let mut userns = probe(
        "unshare-newuser",
        libc::SYS_unshare,
        [libc::CLONE_NEWUSER as libc::c_long, 0, 0, 0, 0, 0],
    );
    userns.also_refusal = &[libc::ENOSPC];
    vec![
        setup,
        probe(
            "io_uring_enter",
            libc::SYS_io_uring_enter,
            [-1, 0, 0, 0, 0, 0],
        ),
        probe(
            "io_uring_register",
            libc::SYS_io_uring_register,
            [-1, 0, 0, 0, 0, 0],
        ),
        probe("bpf", libc::SYS_bpf, [1000, 0, 0, 0, 0, 0]),
        probe(
            "userfaultfd",
            libc::SYS_userfaultfd,
            [
                libc::O_CLOEXEC as libc::c_long | UFFD_USER_MODE_ONLY,
                0,
                0,
                0,
                0,
                0,
            ],
        ),
        probe(
            "perf_event_open",
            libc::SYS_perf_event_open,
            [0, 0, -1, -1, 0, 0],
        ),
        probe(
            "keyctl",
            libc::SYS_keyctl,
            [KEYCTL_GET_KEYRING_ID, KEY_SPEC_THREAD_KEYRING, 0, 0, 0, 0],
        ),
        probe("add_key", libc::SYS_add_key, [0, 0, 0, 0, 0, 0]),
        probe("request_key", libc::SYS_request_key, [0, 0, 0, 0, 0, 0]),
        cap(kexec, "the kernel checks CAP_SYS_BOOT first"),
        cap(
            probe(
                "kexec_file_load",
                libc::SYS_kexec_file_load,
                [-1, -1, 0, 0, 0, 0],
            ),
            "the kernel checks CAP_SYS_BOOT first",
        ),
        cap(
            probe("init_module", libc::SYS_init_module, [0, 0, 0, 0, 0, 0]),
            "the kernel checks CAP_SYS_MODULE first",
        ),
        cap(
            probe("finit_module", libc::SYS_finit_module, [-1, 0, 0, 0, 0, 0]),
            "the kernel checks CAP_SYS_MODULE first",
        ),
        cap(
            probe("delete_module", libc::SYS_delete_module, [0, 0, 0, 0, 0, 0]),
            "the kernel checks CAP_SYS_MODULE first",
        ),
        cap(
            probe(
                "open_by_handle_at",
                libc::SYS_open_by_handle_at,
                [libc::AT_FDCWD as libc::c_long, 0, 0, 0, 0, 0],
            ),
            "the kernel may check CAP_DAC_READ_SEARCH before reading the handle",
        ),
        userns,
        // Wrong magic numbers: even a call that gets through reboots nothing.
        cap(
            probe("reboot", libc::SYS_reboot, [0xdead, 0xbeef, 0, 0, 0, 0]),
            "the kernel checks CAP_SYS_BOOT first",
        ),
        cap(
            probe("iopl", libc::SYS_iopl, [3, 0, 0, 0, 0, 0]),
            "the kernel checks CAP_SYS_RAWIO",
        ),
        cap(
            probe("ioperm", libc::SYS_ioperm, [0x80, 1, 1, 0, 0, 0]),
            "the kernel checks CAP_SYS_RAWIO",
        ),
        cap(
            probe("swapon", libc::SYS_swapon, [0, 0, 0, 0, 0, 0]),
            "the kernel checks CAP_SYS_ADMIN first",
        ),
        cap(
            probe(
                "syslog",
                libc::SYS_syslog,
                [SYSLOG_ACTION_SIZE_BUFFER, 0, 0, 0, 0, 0],
            ),
            "the kernel checks CAP_SYSLOG when dmesg_restrict is set",
        ),
    ]
}

/// Makes the probe's call. A descriptor it opens is closed when the attempt's process
/// exits.
fn call(p: &Probe, x32: bool) -> SysResult {
    let mut args = p.args;
    // io_uring_setup's `struct io_uring_params`, alive until the call returned.
    let mut params = [0u8; 120];
    if p.params_buf {
        args[1] = params.as_mut_ptr() as libc::c_long;
    }
    let nr = if x32 { p.x32 | X32_SYSCALL_BIT } else { p.nr };
    sys::raw_syscall(nr, args)
}

fn classify(p: &Probe, x32: bool, r: SysResult) -> Outcome {
    let abi = if x32 {
        format!("x32 number {:#x}", p.x32 | X32_SYSCALL_BIT)
    } else {
        format!("number {}", p.nr)
    };
    match r {
        Ok(v) => Outcome::escaped(format!("{} ({abi}) returned {v}: the call ran", p.name)),
        Err(e) if e == libc::ENOSYS => Outcome::contained(format!(
            "{} ({abi}) refused: ENOSYS{}",
            p.name,
            if x32 {
                " (the filter, or a kernel without x32)"
            } else {
                ""
            }
        )),
        Err(e) if e == libc::EPERM => Outcome::contained(format!(
            "{} ({abi}) refused: EPERM{}",
            p.name,
            match p.eperm_note {
                Some(n) if !n.is_empty() => format!(" (filter or capabilities: {n})"),
                _ => String::new(),
            }
        )),
        Err(e) if p.also_refusal.contains(&e) => {
            Outcome::contained(format!("{} ({abi}) refused: {}", p.name, sys::ename(e)))
        }
        Err(e) => Outcome::escaped(format!(
            "{} ({abi}): the kernel answered {}: the call got past the seccomp filter",
            p.name,
            sys::ename(e)
        )),
    }
}

fn int80_signal(sig: i32) -> Option<Outcome> {
    match sig {
        libc::SIGSYS => Some(Outcome::contained(
            "killed by SIGSYS: the filter refuses the i386 ABI",
        )),
        libc::SIGSEGV => Some(Outcome::contained(
            "killed by SIGSEGV: this kernel does not accept int 0x80 (no IA32 emulation)",
        )),
        _ => None,
    }
}

pub fn attempts(_cfg: &Config) -> Vec<Attempt> {
    let mut v = Vec::new();
    for (i, p) in probes().iter().enumerate() {
        for x32 in [false, true] {
            let name = format!("syscall-{}{}", p.name, if x32 { "-x32" } else { "" });
            v.push(
                Attempt::new(name, move |_| {
                    let all = probes();
                    let p = &all[i];
                    classify(p, x32, call(p, x32))
                })
                .on_signal(sigsys_is_contained),
            );
        }
    }
    // i386 system calls from this 64-bit process: getpid (20), unshare (310).
    v.push(
        Attempt::new("int80-getpid", |_| {
            let r = sys::int80(20, 0, 0, 0);
            if r < 0 {
                Outcome::contained(format!("i386 getpid refused: {}", sys::ename(-r)))
            } else {
                Outcome::escaped(format!(
                    "i386 getpid through int 0x80 answered {r}: the i386 ABI is open"
                ))
            }
        })
        .on_signal(int80_signal),
    );
    v.push(
        Attempt::new("int80-unshare-newuser", |_| {
            let r = sys::int80(310, libc::CLONE_NEWUSER as u32, 0, 0);
            match -r {
                0 => Outcome::escaped("i386 unshare(CLONE_NEWUSER) through int 0x80 succeeded"),
                e if r < 0 && matches!(e, libc::EPERM | libc::ENOSYS | libc::ENOSPC) => {
                    Outcome::contained(format!("i386 unshare refused: {}", sys::ename(e)))
                }
                e => Outcome::escaped(format!(
                    "i386 unshare through int 0x80: the kernel answered {}",
                    sys::ename(e)
                )),
            }
        })
        .on_signal(int80_signal),
    );
    v
}
