//! Signals to started processes, and the text envd reports for a wait
//! status (`exit status 3`, `signal: killed`).

use std::io;
use std::os::unix::process::ExitStatusExt as _;
use std::process::ExitStatus;

/// Signals a started process and everything in its process group (every
/// process starts as the leader of its own group or session), so a shell's
/// children go too; falls back to the process alone.
pub(crate) fn signal_group(pid: u32, sig: libc::c_int) -> io::Result<()> {
    let pid = pid as libc::pid_t;
    // SAFETY: kill has no memory-safety preconditions.
    if unsafe { libc::kill(-pid, sig) } == 0 {
        return Ok(());
    }
    // SAFETY: as above.
    if unsafe { libc::kill(pid, sig) } == 0 {
        return Ok(());
    }
    Err(io::Error::last_os_error())
}

/// Go-style text for a wait status, as envd reports it.
pub fn exit_status_text(status: &ExitStatus) -> (i32, bool, String) {
    if let Some(code) = status.code() {
        return (code, true, format!("exit status {code}"));
    }
    let sig = status.signal().unwrap_or(0);
    let name = match sig {
        1 => "hangup",
        2 => "interrupt",
        3 => "quit",
        4 => "illegal instruction",
        5 => "trace/breakpoint trap",
        6 => "aborted",
        7 => "bus error",
        8 => "floating point exception",
        9 => "killed",
        10 => "user defined signal 1",
        11 => "segmentation fault",
        12 => "user defined signal 2",
        13 => "broken pipe",
        14 => "alarm clock",
        15 => "terminated",
        16 => "stack fault",
        17 => "child exited",
        18 => "continued",
        19 => "stopped (signal)",
        20 => "stopped",
        21 => "stopped (tty input)",
        22 => "stopped (tty output)",
        23 => "urgent I/O condition",
        24 => "CPU time limit exceeded",
        25 => "file size limit exceeded",
        26 => "virtual timer expired",
        27 => "profiling timer expired",
        28 => "window changed",
        29 => "I/O possible",
        30 => "power failure",
        31 => "bad system call",
        _ => "",
    };
    let mut text = if name.is_empty() {
        format!("signal: signal {sig}")
    } else {
        format!("signal: {name}")
    };
    if status.core_dumped() {
        text.push_str(" (core dumped)");
    }
    (-1, false, text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_status_text_matches_envd() {
        let st = ExitStatus::from_raw(3 << 8);
        assert_eq!(exit_status_text(&st), (3, true, "exit status 3".into()));
        let st = ExitStatus::from_raw(libc::SIGKILL);
        assert_eq!(exit_status_text(&st), (-1, false, "signal: killed".into()));
        let st = ExitStatus::from_raw(libc::SIGTERM);
        assert_eq!(exit_status_text(&st).2, "signal: terminated");
    }
}
