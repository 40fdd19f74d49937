//! A classic-BPF interpreter for seccomp programs, for tests: runs a program (or a stack of
//! them, with the kernel's precedence rule) on a synthetic `seccomp_data`, so the policy is
//! checked instruction by instruction without installing anything.
//!
//! It knows the instructions seccompiler and the prefilter emit and panics on any other, on
//! a jump out of the program and on running off its end (the kernel's verifier refuses
//! such programs).

use seccompiler::sock_filter;

/// `struct seccomp_data` (the instruction pointer is always 0).
#[derive(Clone, Copy, Debug)]
pub struct Data {
    pub nr: u32,
    pub arch: u32,
    pub args: [u64; 6],
}

impl Data {
    pub fn native(nr: i64, args: [u64; 6]) -> Self {
        Self {
            nr: nr as u32,
            arch: crate::NATIVE_AUDIT_ARCH,
            args,
        }
    }
}

fn load(d: &Data, offset: u32) -> u32 {
    match offset {
        0 => d.nr,
        4 => d.arch,
        8 | 12 => 0,
        16..=63 if offset % 4 == 0 => {
            let arg = d.args[((offset - 16) / 8) as usize];
            // Little-endian: the low word comes first.
            if (offset - 16) % 8 == 0 {
                arg as u32
            } else {
                (arg >> 32) as u32
            }
        }
        _ => panic!("load from offset {offset} of seccomp_data"),
    }
}

/// Runs one program; `const_only` makes a load other than `nr`/`arch` return `None`.
fn exec(p: &[sock_filter], d: &Data, const_only: bool) -> Option<u32> {
    let mut a: u32 = 0;
    let mut pc = 0usize;
    loop {
        let i = p
            .get(pc)
            .unwrap_or_else(|| panic!("ran off the program at {pc}"));
        let k = i.k;
        let mut next = pc + 1;
        match i.code {
            // BPF_LD | BPF_W | BPF_ABS
            0x20 => {
                if const_only && k != 0 && k != 4 {
                    return None;
                }
                a = load(d, k);
            }
            // BPF_ALU | BPF_AND | BPF_K
            0x54 => a &= k,
            // BPF_JMP | BPF_JA
            0x05 => next += k as usize,
            // BPF_JMP | BPF_JEQ / JGT / JGE / JSET | BPF_K
            0x15 | 0x25 | 0x35 | 0x45 => {
                let taken = match i.code {
                    0x15 => a == k,
                    0x25 => a > k,
                    0x35 => a >= k,
                    _ => a & k != 0,
                };
                next += usize::from(if taken { i.jt } else { i.jf });
            }
            // BPF_RET | BPF_K
            0x06 => return Some(k),
            code => panic!("unexpected BPF opcode {code:#x} at {pc}"),
        }
        assert!(next < p.len(), "jump past the end from {pc}");
        pc = next;
    }
}

/// The value one program returns for `d`.
pub fn run(p: &[sock_filter], d: &Data) -> u32 {
    exec(p, d, false).expect("a full run always returns")
}

/// Whether the kernel's action cache would record `nr` as "always allowed" by this program:
/// the verdict for the native call is `ALLOW` and the path to it reads only `nr` and `arch`
/// (kernel/seccomp.c, `seccomp_is_const_allow`).
pub fn is_const_allow(p: &[sock_filter], arch: u32, nr: u32) -> bool {
    let d = Data {
        nr,
        arch,
        args: [0; 6],
    };
    exec(p, &d, true) == Some(libc::SECCOMP_RET_ALLOW)
}

/// The kernel's answer for a stack of filters listed in install order: every filter runs,
/// the most severe action wins, and among equally severe ones the most recently installed
/// (kernel/seccomp.c, `seccomp_run_filters`).
pub fn run_stack(filters: &[Vec<sock_filter>], d: &Data) -> u32 {
    fn action_only(ret: u32) -> i32 {
        (ret & 0xffff_0000) as i32
    }
    let mut ret = libc::SECCOMP_RET_ALLOW;
    for f in filters.iter().rev() {
        let cur = run(f, d);
        if action_only(cur) < action_only(ret) {
            ret = cur;
        }
    }
    ret
}
