//! A sandbox's processes seen from the node: [`watch_exit`] reaps a child through a pidfd
//! and publishes its exit status, and [`Phases`] times the phases of an operation for
//! debug logs.

use std::os::fd::{FromRawFd, OwnedFd};
use std::time::Duration;

use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use nix::unistd::Pid;
use tokio::io::unix::AsyncFd;
use tokio::sync::watch;

/// Reaps a child when it exits (through a pidfd) and publishes its status.
pub fn watch_exit(pid: Pid) -> std::io::Result<watch::Receiver<Option<WaitStatus>>> {
    // SAFETY: pidfd_open takes a pid and flags; the returned descriptor is owned below.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid.as_raw(), 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh descriptor owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
    // SAFETY: the AsyncFd owns the descriptor, so it stays open while registered.
    let afd = unsafe { AsyncFd::register_with_interest(fd, tokio::io::Interest::READABLE) }
        .map_err(std::io::Error::from)?;
    let (tx, rx) = watch::channel(None);
    tokio::spawn(async move {
        let _ = afd.readable().await;
        let status = loop {
            match waitpid(pid, Some(WaitPidFlag::WNOHANG)) {
                Ok(WaitStatus::StillAlive) => {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
                Ok(s) => break s,
                Err(nix::errno::Errno::EINTR) => {}
                Err(_) => break WaitStatus::Exited(pid, -1),
            }
        };
        tracing::debug!(pid = pid.as_raw(), ?status, "sandbox process exited");
        let _ = tx.send(Some(status));
    });
    Ok(rx)
}
/// Durations of the phases of an operation, for debug logs.
pub struct Phases {
    last: std::time::Instant,
    done: Vec<(&'static str, Duration)>,
}

impl Default for Phases {
    fn default() -> Self {
        Self::new()
    }
}

impl Phases {
    pub fn new() -> Self {
        Self {
            last: std::time::Instant::now(),
            done: Vec::new(),
        }
    }

    /// Ends the phase `name` at `at` (between the last mark and now).
    pub fn split(&mut self, name: &'static str, at: std::time::Instant) {
        let at = at.clamp(self.last, std::time::Instant::now());
        self.done.push((name, at - self.last));
        self.last = at;
    }

    /// Ends the phase `name` now.
    pub fn mark(&mut self, name: &'static str) {
        let now = std::time::Instant::now();
        self.done.push((name, now - self.last));
        self.last = now;
    }
}

impl std::fmt::Display for Phases {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (i, (name, d)) in self.done.iter().enumerate() {
            if i > 0 {
                f.write_str(" ")?;
            }
            write!(f, "{name}={:.2}ms", d.as_secs_f64() * 1e3)?;
        }
        Ok(())
    }
}
