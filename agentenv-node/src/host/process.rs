//! A sandbox's processes seen from the node: [`watch_exit`] reaps a child through a pidfd
//! and publishes its exit status.

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
