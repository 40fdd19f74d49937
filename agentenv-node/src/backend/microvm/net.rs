//! The guest's side of a sandbox network namespace: a bridge joining the namespace end of
//! the jail's veth pair (`eth0`) with a tap (`tap0`) the VMM attaches its virtio-net
//! device to. The namespace's `eth0` loses its address, so the guest itself answers at the
//! sandbox's address and the node reaches it exactly as it reaches a jail sandbox.

use std::io::Write;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};

use crate::backend::jail::net::GUEST_IF;

/// The tap device inside every sandbox namespace.
pub const TAP_IF: &str = "tap0";
/// The bridge inside every sandbox namespace.
pub const BRIDGE_IF: &str = "br0";

/// Errors setting up the namespace.
#[derive(Debug, thiserror::Error)]
pub enum TapError {
    #[error("running ip in the sandbox namespace: {0}")]
    Spawn(#[source] std::io::Error),
    #[error("setting up {TAP_IF} and {BRIDGE_IF} in the sandbox namespace failed: {0}")]
    Failed(String),
}

/// The `ip -batch` requests that turn a jail namespace into a microVM one.
pub fn batch() -> String {
    format!(
        "addr flush dev {GUEST_IF}\n\
         route flush dev {GUEST_IF}\n\
         link add {BRIDGE_IF} type bridge\n\
         tuntap add dev {TAP_IF} mode tap\n\
         link set {TAP_IF} master {BRIDGE_IF}\n\
         link set {GUEST_IF} master {BRIDGE_IF}\n\
         link set {TAP_IF} up\n\
         link set {BRIDGE_IF} up\n"
    )
}

/// Runs `ip` inside the namespace `netns` with `args`, `stdin` fed to it.
pub fn ip_in(netns: BorrowedFd<'_>, args: &[&str], stdin: &str) -> Result<String, TapError> {
    let fd = netns.as_raw_fd();
    let mut cmd = Command::new("ip");
    cmd.args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    // SAFETY: the closure runs in the forked child before exec and only calls setns, an
    // async-signal-safe system call, on a descriptor the parent keeps open.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setns(fd, libc::CLONE_NEWNET) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = cmd.spawn().map_err(TapError::Spawn)?;
    if let Some(mut input) = child.stdin.take() {
        input.write_all(stdin.as_bytes()).map_err(TapError::Spawn)?;
    }
    let out = child.wait_with_output().map_err(TapError::Spawn)?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if !out.status.success() {
        return Err(TapError::Failed(text.trim().to_string()));
    }
    Ok(text)
}

/// Creates the tap and the bridge in the namespace and moves the sandbox address off
/// `eth0` (the guest takes it).
pub fn setup_tap(netns: BorrowedFd<'_>) -> Result<(), TapError> {
    ip_in(netns, &["-batch", "-"], &batch()).map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_batch_bridges_eth0_and_the_tap_and_frees_the_address() {
        let b = batch();
        assert!(b.starts_with("addr flush dev eth0\n"));
        assert!(b.contains("tuntap add dev tap0 mode tap\n"));
        assert!(b.contains("link set eth0 master br0\n"));
        assert!(b.contains("link set tap0 master br0\n"));
        assert!(b.ends_with("link set br0 up\n"));
    }
}
