//! The guest's side of a sandbox network namespace.
//!
//! The namespace is the jail's (see [`create_sandbox_net`]): `eth0` holds the sandbox's
//! address, the peer of a host veth. A tap (`tap0`, [`TAP_IP`]/30) links the namespace to
//! the guest, whose own address is always [`GUEST_IP`]: the namespace forwards and
//! translates, DNAT of the sandbox address arriving on `eth0` to the guest, SNAT of the
//! guest's traffic leaving by `eth0` to the sandbox address. The node reaches the agent at
//! the sandbox address exactly as with the jail (the data plane is unchanged), and since
//! the guest's address is the same in every sandbox, a snapshot restores into any address
//! slot: a paused sandbox kept across a node restart, or a capture started as new
//! sandboxes next to the one it was taken from.
//!
//! [`create_sandbox_net`]: crate::host::net::create_sandbox_net

use std::io::Write;
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};

use crate::host::net::GUEST_IF;

/// The tap device inside every sandbox namespace.
pub const TAP_IF: &str = "tap0";
/// The namespace's end of the tap: the guest's gateway.
pub const TAP_IP: Ipv4Addr = Ipv4Addr::new(169, 254, 0, 22);
/// The guest's address in every sandbox.
pub const GUEST_IP: Ipv4Addr = Ipv4Addr::new(169, 254, 0, 21);
/// The guest's MAC address in every sandbox (locally administered).
pub const GUEST_MAC: &str = "06:00:a9:fe:00:15";

/// Errors setting up the namespace.
#[derive(Debug, thiserror::Error)]
pub enum TapError {
    #[error("running {program} in the sandbox namespace: {source}")]
    Spawn {
        program: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{program} in the sandbox namespace failed: {output}")]
    Failed { program: String, output: String },
}

/// The `ip -batch` requests that add the tap, owned by the VMM's host uid and gid (an
/// unprivileged process may attach to a tap it owns).
pub fn tap_batch(owner: u32) -> String {
    format!(
        "tuntap add dev {TAP_IF} mode tap user {owner} group {owner}\n\
         addr add {TAP_IP}/30 dev {TAP_IF}\n\
         link set {TAP_IF} up\n"
    )
}

/// The `iptables-restore` input of the namespace's address translation.
pub fn nat_rules(sandbox_ip: Ipv4Addr) -> String {
    format!(
        "*nat\n\
         :PREROUTING ACCEPT [0:0]\n\
         :INPUT ACCEPT [0:0]\n\
         :OUTPUT ACCEPT [0:0]\n\
         :POSTROUTING ACCEPT [0:0]\n\
         -A PREROUTING -i {GUEST_IF} -d {sandbox_ip}/32 -j DNAT --to-destination {GUEST_IP}\n\
         -A POSTROUTING -s {GUEST_IP}/32 -o {GUEST_IF} -j SNAT --to-source {sandbox_ip}\n\
         COMMIT\n"
    )
}

/// Runs `program` with `args` inside the namespace `netns`, `stdin` fed to it; returns
/// its output.
pub fn run_in(
    netns: BorrowedFd<'_>,
    program: &str,
    args: &[&str],
    stdin: &str,
) -> Result<String, TapError> {
    let fd = netns.as_raw_fd();
    let spawn_err = |source| TapError::Spawn {
        program: program.to_string(),
        source,
    };
    let mut cmd = Command::new(program);
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
    let mut child = cmd.spawn().map_err(spawn_err)?;
    if let Some(mut input) = child.stdin.take() {
        input.write_all(stdin.as_bytes()).map_err(spawn_err)?;
    }
    let out = child.wait_with_output().map_err(spawn_err)?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if !out.status.success() {
        return Err(TapError::Failed {
            program: program.to_string(),
            output: text.trim().to_string(),
        });
    }
    Ok(text)
}

/// Adds the tap, turns on forwarding and installs the address translation between the
/// sandbox address and the guest.
pub fn setup_tap(netns: BorrowedFd<'_>, sandbox_ip: Ipv4Addr, owner: u32) -> Result<(), TapError> {
    run_in(netns, "ip", &["-batch", "-"], &tap_batch(owner))?;
    // /proc/sys/net shows the namespace of the process that opens it.
    run_in(
        netns,
        "sh",
        &["-c", "echo 1 > /proc/sys/net/ipv4/ip_forward"],
        "",
    )?;
    // Added to what the namespace holds: the egress policy's chains are there already.
    run_in(
        netns,
        "iptables-restore",
        &["-w", "--noflush"],
        &nat_rules(sandbox_ip),
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tap_is_the_guests_gateway_in_one_30() {
        let b = tap_batch(1_000_000_000);
        assert!(b.contains("tuntap add dev tap0 mode tap user 1000000000 group 1000000000\n"));
        assert!(b.contains("addr add 169.254.0.22/30 dev tap0\n"));
        assert_eq!(u32::from(GUEST_IP) & !3, u32::from(TAP_IP) & !3);
    }

    #[test]
    fn nat_maps_the_sandbox_address_to_the_guest_both_ways() {
        let r = nat_rules(Ipv4Addr::new(10, 12, 0, 6));
        assert!(r.contains(
            "-A PREROUTING -i eth0 -d 10.12.0.6/32 -j DNAT --to-destination 169.254.0.21\n"
        ));
        assert!(
            r.contains("-A POSTROUTING -s 169.254.0.21/32 -o eth0 -j SNAT --to-source 10.12.0.6\n")
        );
        assert!(r.starts_with("*nat\n") && r.ends_with("COMMIT\n"));
    }
}
