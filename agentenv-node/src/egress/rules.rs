//! The kernel side of an egress policy: `iptables-restore` input for a sandbox's own
//! network namespace, applied atomically by running `iptables-restore` inside it.
//!
//! Two chains named [`CHAIN`], one in `filter` and one in `nat`, hold the policy; the
//! built-in chains jump to them (added once, [`Mode::Install`]), and a change redefines
//! both chains in one `iptables-restore --noflush` ([`Mode::Replace`]), which flushes and
//! refills them as one transaction per table. Nothing else in the namespace is touched
//! (a microVM's address translation lives in `nat` too).
//!
//! * `filter OUTPUT` (the jail's processes) and `filter FORWARD` out of `eth0` (a microVM
//!   guest's packets, arriving from its tap) go through the chain, after loopback,
//!   connections redirected to the proxy and the node's own sockets (uid 0 on the host: the tenant's ids are mapped to an unprivileged
//!   range and can never be 0 there) are let through. The chain accepts replies of
//!   connections made *to* the sandbox (the data plane), allowed networks and, when a
//!   domain is allowed, the nameservers; it rejects denied networks (TCP with a reset, the
//!   rest with an ICMP error, so clients fail at once) and accepts the rest. Outbound
//!   packets are checked each, not only a connection's first: a destination that becomes
//!   denied is cut at its next packet.
//! * `nat OUTPUT` and `nat PREROUTING` from anything but `eth0` redirect TCP 80 and 443 to
//!   denied (and not allowed) addresses to the node's egress proxy in the namespace when
//!   the policy allows a domain; the node's own sockets are exempt.
//! * `filter INPUT` refuses the proxy's port from `eth0`: it serves the sandbox only.

use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::process::Stdio;

use tokio::io::AsyncWriteExt;

use super::EgressError;
use super::policy::EgressPolicy;
use crate::host::net::GUEST_IF;

/// The chain of the policy, in `filter` and in `nat`.
pub const CHAIN: &str = "AGENTENV-EGRESS";

/// Whether to add the built-in chains' jumps (the first application in a namespace) or
/// only redefine the policy's chains.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Install,
    Replace,
}

/// The `iptables-restore --noflush` input of `policy` for a namespace whose egress proxy
/// listens on `proxy_port`, with `dns` the nameservers the sandbox may reach (see
/// [`EgressPolicy::reachable_dns`]).
pub fn render(policy: &EgressPolicy, dns: &[Ipv4Addr], proxy_port: u16, mode: Mode) -> String {
    let mut s = String::new();
    let mut line = |l: String| {
        s.push_str(&l);
        s.push('\n');
    };
    line("*filter".into());
    line(format!(":{CHAIN} - [0:0]"));
    if mode == Mode::Install {
        line(format!(
            "-A INPUT -i {GUEST_IF} -p tcp --dport {proxy_port} -j REJECT --reject-with tcp-reset"
        ));
        line("-A OUTPUT -o lo -j ACCEPT".into());
        // A connection redirected to the proxy keeps the interface it was routed to first
        // (`-o` is fixed for the whole hook), so it is known by its new destination.
        line(format!(
            "-A OUTPUT -d 127.0.0.1/32 -p tcp --dport {proxy_port} -j ACCEPT"
        ));
        line("-A OUTPUT -m owner --uid-owner 0 -j ACCEPT".into());
        line(format!("-A OUTPUT -j {CHAIN}"));
        line(format!("-A FORWARD -o {GUEST_IF} -j {CHAIN}"));
    }
    line(format!(
        "-A {CHAIN} -m conntrack --ctstate ESTABLISHED,RELATED --ctdir REPLY -j ACCEPT"
    ));
    for net in &policy.allow_nets {
        line(format!("-A {CHAIN} -d {net} -j ACCEPT"));
    }
    for d in dns {
        line(format!("-A {CHAIN} -d {d}/32 -j ACCEPT"));
    }
    for net in &policy.deny_nets {
        line(format!(
            "-A {CHAIN} -d {net} -p tcp -j REJECT --reject-with tcp-reset"
        ));
        line(format!(
            "-A {CHAIN} -d {net} -j REJECT --reject-with icmp-admin-prohibited"
        ));
    }
    line("COMMIT".into());
    line("*nat".into());
    line(format!(":{CHAIN} - [0:0]"));
    if mode == Mode::Install {
        line("-A OUTPUT -m owner --uid-owner 0 -j RETURN".into());
        line(format!("-A OUTPUT -j {CHAIN}"));
        line(format!("-A PREROUTING ! -i {GUEST_IF} -j {CHAIN}"));
    }
    if policy.has_domains() {
        for net in &policy.allow_nets {
            line(format!("-A {CHAIN} -d {net} -j RETURN"));
        }
        for d in dns {
            line(format!("-A {CHAIN} -d {d}/32 -j RETURN"));
        }
        for net in &policy.deny_nets {
            for port in [80, 443] {
                line(format!(
                    "-A {CHAIN} -d {net} -p tcp --dport {port} -j REDIRECT --to-ports {proxy_port}"
                ));
            }
        }
    }
    line("COMMIT".into());
    s
}

/// Runs `iptables-restore --noflush` with `input` inside the network namespace `netns`.
pub async fn apply(netns: BorrowedFd<'_>, input: &str) -> Result<(), EgressError> {
    let fd = netns.as_raw_fd();
    let mut cmd = tokio::process::Command::new("iptables-restore");
    cmd.args(["-w", "--noflush"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    // SAFETY: the closure runs in the forked child before exec and only calls setns, an
    // async-signal-safe system call, on a descriptor the caller keeps open until the
    // child has been spawned.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setns(fd, libc::CLONE_NEWNET) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = cmd.spawn().map_err(|e| {
        if e.kind() == std::io::ErrorKind::NotFound {
            EgressError::Rules(
                "iptables-restore not found: install it with `apt-get install iptables` (listed in scripts/apt-packages.txt)".into(),
            )
        } else {
            EgressError::Rules(format!("running iptables-restore in the sandbox namespace: {e}"))
        }
    })?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin
            .write_all(input.as_bytes())
            .await
            .map_err(|e| EgressError::Rules(format!("feeding iptables-restore: {e}")))?;
    }
    let out = child
        .wait_with_output()
        .await
        .map_err(|e| EgressError::Rules(format!("running iptables-restore: {e}")))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(EgressError::Rules(format!(
            "iptables-restore in the sandbox namespace failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::egress::policy::EgressRules;

    fn policy(allow: &[&str], deny: &[&str]) -> EgressPolicy {
        EgressPolicy::new(
            &EgressRules {
                allow_out: allow.iter().map(|s| s.to_string()).collect(),
                deny_out: deny.iter().map(|s| s.to_string()).collect(),
                dns_servers: None,
            },
            None,
        )
        .unwrap()
    }

    fn pos(text: &str, needle: &str) -> usize {
        text.find(needle)
            .unwrap_or_else(|| panic!("{needle:?} missing in\n{text}"))
    }

    #[test]
    fn allowed_networks_and_nameservers_come_before_denied_ones() {
        let p = policy(&["198.18.0.7", "example.com"], &["0.0.0.0/0"]);
        let dns = ["198.18.0.53".parse().unwrap()];
        let t = render(&p, &dns, 1, Mode::Replace);
        let deny = pos(
            &t,
            "-A AGENTENV-EGRESS -d 0.0.0.0/0 -p tcp -j REJECT --reject-with tcp-reset",
        );
        assert!(pos(&t, "--ctdir REPLY -j ACCEPT") < deny);
        assert!(pos(&t, "-A AGENTENV-EGRESS -d 198.18.0.7/32 -j ACCEPT") < deny);
        assert!(pos(&t, "-A AGENTENV-EGRESS -d 198.18.0.53/32 -j ACCEPT") < deny);
        assert!(
            deny < pos(
                &t,
                "-d 0.0.0.0/0 -j REJECT --reject-with icmp-admin-prohibited"
            )
        );
        // Replacing never adds jumps again.
        assert!(
            !t.contains("-A OUTPUT") && !t.contains("-A FORWARD") && !t.contains("-A PREROUTING")
        );
    }

    #[test]
    fn web_ports_of_denied_addresses_go_to_the_proxy_only_with_a_domain_allowed() {
        let dns = ["198.18.0.53".parse().unwrap()];
        let with = render(
            &policy(&["10.9.0.0/16", "*.a.com"], &["0.0.0.0/0"]),
            &dns,
            1,
            Mode::Replace,
        );
        let nat = &with[pos(&with, "*nat")..];
        let redirect = pos(
            nat,
            "-d 0.0.0.0/0 -p tcp --dport 443 -j REDIRECT --to-ports 1",
        );
        assert!(
            pos(
                nat,
                "-d 0.0.0.0/0 -p tcp --dport 80 -j REDIRECT --to-ports 1"
            ) < redirect
        );
        assert!(pos(nat, "-d 10.9.0.0/16 -j RETURN") < redirect);
        assert!(pos(nat, "-d 198.18.0.53/32 -j RETURN") < redirect);
        let without = render(
            &policy(&["10.9.0.0/16"], &["0.0.0.0/0"]),
            &[],
            1,
            Mode::Replace,
        );
        assert!(!without.contains("REDIRECT"), "{without}");
        assert!(without.contains("-A AGENTENV-EGRESS -d 0.0.0.0/0 -p tcp -j REJECT"));
    }

    #[test]
    fn install_adds_the_jumps_with_the_nodes_own_sockets_and_loopback_first() {
        let t = render(&policy(&["a.com"], &["0.0.0.0/0"]), &[], 1, Mode::Install);
        let filter = &t[..pos(&t, "*nat")];
        let jump = pos(filter, "-A OUTPUT -j AGENTENV-EGRESS");
        assert!(pos(filter, "-A OUTPUT -o lo -j ACCEPT") < jump);
        assert!(
            pos(
                filter,
                "-A OUTPUT -d 127.0.0.1/32 -p tcp --dport 1 -j ACCEPT"
            ) < jump
        );
        assert!(pos(filter, "-A OUTPUT -m owner --uid-owner 0 -j ACCEPT") < jump);
        assert!(filter.contains("-A FORWARD -o eth0 -j AGENTENV-EGRESS"));
        assert!(filter.contains("-A INPUT -i eth0 -p tcp --dport 1 -j REJECT"));
        let nat = &t[pos(&t, "*nat")..];
        assert!(
            pos(nat, "-A OUTPUT -m owner --uid-owner 0 -j RETURN")
                < pos(nat, "-A OUTPUT -j AGENTENV-EGRESS")
        );
        assert!(nat.contains("-A PREROUTING ! -i eth0 -j AGENTENV-EGRESS"));
        assert_eq!(t.matches("COMMIT\n").count(), 2);
        assert!(t.starts_with("*filter\n:AGENTENV-EGRESS - [0:0]\n"));
    }

    #[test]
    fn an_empty_policy_accepts_everything() {
        let t = render(&EgressPolicy::default(), &[], 1, Mode::Replace);
        assert!(!t.contains("REJECT") && !t.contains("REDIRECT"), "{t}");
    }
}
