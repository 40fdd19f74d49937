//! The host firewall rules for sandbox interfaces: the `AGENTENV-<PREFIX>-{IN,FWD,NAT}`
//! chains and the jumps to them from INPUT, FORWARD and POSTROUTING ([`HostRules`]),
//! installed with `iptables-restore` and removed by [`uninstall_host_rules`], serialized
//! across node processes by a lock file. The NAT chain's rules are `nat`'s.

use std::fs::File;
use std::io::Write;
use std::net::Ipv4Addr;
use std::path::Path;

use nix::fcntl::{Flock, FlockArg};

use super::nat::{
    KeeperTarget, NatKeeper, NatMode, pool_rules, replace_pool_rules_locked, start_keeper,
};
use super::{Ipv4Net, NetError, io_err};

/// Host firewall configuration for sandbox interfaces.
#[derive(Clone, Debug)]
pub struct HostRules {
    pub iface_prefix: String,
    pub pool: Ipv4Net,
    pub denied: Vec<Ipv4Net>,
    /// Nameservers sandboxes may reach on port 53 even inside a denied network.
    pub dns: Vec<Ipv4Addr>,
    /// How the pool's egress is NATed.
    pub nat: NatMode,
}

/// The name of one of the host chains of an interface prefix (`IN`, `FWD` or `NAT`).
pub fn host_chain(iface_prefix: &str, which: &str) -> String {
    format!("AGENTENV-{}-{which}", iface_prefix.to_ascii_uppercase())
}

/// The chains of an interface prefix and the built-in chains that jump to them:
/// `(table, built-in chain, our chain)`.
fn host_jumps(iface_prefix: &str) -> [(&'static str, &'static str, String); 3] {
    [
        ("filter", "INPUT", host_chain(iface_prefix, "IN")),
        ("filter", "FORWARD", host_chain(iface_prefix, "FWD")),
        ("nat", "POSTROUTING", host_chain(iface_prefix, "NAT")),
    ]
}

/// Opens and locks `<runtime_dir>/iptables.lock`, which serializes changes of the host
/// rules across node processes.
pub(super) fn lock_rules(runtime_dir: &Path) -> Result<Flock<File>, NetError> {
    let lock_path = runtime_dir.join("iptables.lock");
    let file = File::options()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock_path)
        .map_err(io_err(format!("opening {}", lock_path.display())))?;
    Flock::lock(file, FlockArg::LockExclusive).map_err(|(_, e)| NetError::Io {
        context: format!("locking {}", lock_path.display()),
        source: e.into(),
    })
}

/// Host interfaces of sandboxes with this prefix (`<prefix><i|n><8 hex digits>`) in the
/// calling thread's network namespace.
pub fn prefix_interfaces(iface_prefix: &str) -> Result<Vec<String>, NetError> {
    let path = "/proc/thread-self/net/dev";
    let text = std::fs::read_to_string(path).map_err(io_err(format!("reading {path}")))?;
    Ok(text
        .lines()
        .skip(2)
        .filter_map(|l| l.split_once(':').map(|(name, _)| name.trim()))
        .filter(|name| is_prefix_interface(iface_prefix, name))
        .map(str::to_string)
        .collect())
}

fn is_prefix_interface(iface_prefix: &str, name: &str) -> bool {
    name.strip_prefix(iface_prefix)
        .and_then(|rest| rest.strip_prefix('i').or_else(|| rest.strip_prefix('n')))
        .is_some_and(|hex| hex.len() == 8 && hex.bytes().all(|b| b.is_ascii_hexdigit()))
}

/// Removes what [`HostRules::install`] added for `iface_prefix`: every jump to its chains
/// from INPUT, FORWARD and POSTROUTING, then the chains themselves. Chains and jumps that
/// are absent are fine; chains of other prefixes are not touched. Refused with
/// [`NetError::RulesInUse`] while a host interface of the prefix exists, since its
/// sandbox would lose its isolation.
///
/// Waits up to `linger` for such interfaces to go first (the kernel removes a veth after
/// its namespace closed, a moment after the sandbox is gone). Serialized with installs by
/// the lock file in `runtime_dir`. The node never calls this itself: its sandboxes may
/// outlive it; whoever ends them all (`agentenv up`, a test) does.
pub async fn uninstall_host_rules(
    iface_prefix: &str,
    runtime_dir: &Path,
    linger: std::time::Duration,
) -> Result<(), NetError> {
    let deadline = tokio::time::Instant::now() + linger;
    let mut pause = std::time::Duration::from_millis(1);
    while !prefix_interfaces(iface_prefix)?.is_empty() && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(std::time::Duration::from_millis(50));
    }
    let prefix = iface_prefix.to_string();
    let runtime_dir = runtime_dir.to_path_buf();
    tokio::task::spawn_blocking(move || uninstall_locked(&prefix, &runtime_dir))
        .await
        .map_err(|e| NetError::Firewall(format!("removing host rules: {e}")))?
}

fn uninstall_locked(iface_prefix: &str, runtime_dir: &Path) -> Result<(), NetError> {
    let _lock = lock_rules(runtime_dir)?;
    // Checked under the lock, in this (blocking) thread's namespace: the node's.
    let interfaces = prefix_interfaces(iface_prefix)?;
    if !interfaces.is_empty() {
        return Err(NetError::RulesInUse {
            prefix: iface_prefix.to_string(),
            interfaces,
        });
    }
    for (table, builtin, chain) in host_jumps(iface_prefix) {
        // `-D` removes one copy of a rule at a time.
        while iptables_ok(&["-t", table, "-C", builtin, "-j", &chain]) {
            run_with_stdin(
                "iptables",
                &["-w", "-t", table, "-D", builtin, "-j", &chain],
                "",
            )?;
        }
        if iptables_ok(&["-t", table, "-S", &chain]) {
            run_with_stdin("iptables", &["-w", "-t", table, "-F", &chain], "")?;
            run_with_stdin("iptables", &["-w", "-t", table, "-X", &chain], "")?;
        }
    }
    Ok(())
}

impl HostRules {
    fn chain(&self, which: &str) -> String {
        host_chain(&self.iface_prefix, which)
    }

    /// The `iptables-restore --noflush` input that (re)defines the node's filter chains.
    /// They do not depend on the pool, so node processes with different pools share them.
    pub fn restore_input(&self) -> String {
        let p = &self.iface_prefix;
        let (inp, fwd) = (self.chain("IN"), self.chain("FWD"));
        let mut s = String::new();
        s.push_str("*filter\n");
        s.push_str(&format!(":{inp} - [0:0]\n:{fwd} - [0:0]\n"));
        // Sandboxes reach no host listener; replies to the node's own connections pass.
        s.push_str(&format!(
            "-A {inp} -i {p}+ -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT\n"
        ));
        s.push_str(&format!("-A {inp} -i {p}+ -j REJECT\n"));
        s.push_str(&format!(
            "-A {fwd} -o {p}+ -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT\n"
        ));
        s.push_str(&format!(
            "-A {fwd} -i {p}+ -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT\n"
        ));
        for d in &self.dns {
            for proto in ["udp", "tcp"] {
                s.push_str(&format!(
                    "-A {fwd} -i {p}i+ -d {d}/32 -p {proto} --dport 53 -j ACCEPT\n"
                ));
            }
        }
        for net in &self.denied {
            s.push_str(&format!("-A {fwd} -i {p}+ -d {net} -j REJECT\n"));
        }
        // Sandboxes never reach each other, whatever their pools.
        s.push_str(&format!("-A {fwd} -i {p}+ -o {p}+ -j REJECT\n"));
        s.push_str(&format!("-A {fwd} -i {p}n+ -j REJECT\n"));
        s.push_str(&format!("-A {fwd} -i {p}i+ -j ACCEPT\n"));
        s.push_str(&format!("-A {fwd} -o {p}+ -j REJECT\n"));
        s.push_str("COMMIT\n");
        s
    }

    /// Installs the chains and the jumps to them, writes the pool's NAT rules (rules of
    /// other pools stay) and enables IPv4 forwarding. Idempotent; serialized across
    /// processes by a lock file in `runtime_dir`. Nothing removes them when the node
    /// stops (its sandboxes may outlive it): see [`uninstall_host_rules`].
    ///
    /// With [`NatMode::Snat`] the returned keeper rewrites the pool's NAT rules when the
    /// host's addresses change, as long as it lives (see [`super::nat`]).
    pub async fn install(&self, runtime_dir: &Path) -> Result<NatKeeper, NetError> {
        let dir = runtime_dir.to_path_buf();
        let input = self.restore_input();
        let jumps = host_jumps(&self.iface_prefix);
        let nat_chain = self.chain("NAT");
        tokio::task::spawn_blocking(move || -> Result<(), NetError> {
            let _lock = lock_rules(&dir)?;
            run_with_stdin("iptables-restore", &["-w", "--noflush"], &input)?;
            // The NAT chain's rules come below, pool by pool; the jump needs the chain.
            if !iptables_ok(&["-t", "nat", "-S", &nat_chain]) {
                run_with_stdin("iptables", &["-w", "-t", "nat", "-N", &nat_chain], "")?;
            }
            for (table, builtin, chain) in &jumps {
                if !iptables_ok(&["-t", table, "-C", builtin, "-j", chain]) {
                    run_with_stdin(
                        "iptables",
                        &["-w", "-t", table, "-I", builtin, "1", "-j", chain],
                        "",
                    )?;
                }
            }
            std::fs::write("/proc/sys/net/ipv4/ip_forward", "1")
                .map_err(io_err("enabling IPv4 forwarding"))?;
            Ok(())
        })
        .await
        .map_err(|e| NetError::Firewall(format!("installing host rules: {e}")))??;
        let target = KeeperTarget {
            runtime_dir: runtime_dir.to_path_buf(),
            chain: self.chain("NAT"),
            pool: self.pool,
            iface_prefix: self.iface_prefix.clone(),
        };
        match self.nat {
            NatMode::Snat => start_keeper(target).await,
            NatMode::Masquerade => {
                let rules = pool_rules(NatMode::Masquerade, self.pool, &self.iface_prefix, &[]);
                tokio::task::spawn_blocking(move || {
                    replace_pool_rules_locked(
                        &target.runtime_dir,
                        &target.chain,
                        target.pool,
                        &rules,
                        true,
                    )
                })
                .await
                .map_err(|e| NetError::Firewall(format!("installing the NAT rule: {e}")))??;
                Ok(NatKeeper::default())
            }
        }
    }
}

/// Whether an iptables query succeeds (a check or a listing).
fn iptables_ok(args: &[&str]) -> bool {
    std::process::Command::new("iptables")
        .arg("-w")
        .args(args)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

fn firewall_tool_err(tool: &str, e: std::io::Error) -> NetError {
    if e.kind() == std::io::ErrorKind::NotFound {
        NetError::Firewall(format!(
            "{tool} not found: install it with `apt-get install iptables` (listed in scripts/apt-packages.txt)"
        ))
    } else {
        NetError::Firewall(format!("running {tool}: {e}"))
    }
}

pub(super) fn run_with_stdin(tool: &str, args: &[&str], stdin: &str) -> Result<(), NetError> {
    use std::process::{Command, Stdio};
    let mut child = Command::new(tool)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| firewall_tool_err(tool, e))?;
    if let Some(mut i) = child.stdin.take() {
        i.write_all(stdin.as_bytes())
            .map_err(|e| NetError::Firewall(format!("feeding {tool}: {e}")))?;
    }
    let out = child
        .wait_with_output()
        .map_err(|e| NetError::Firewall(format!("running {tool}: {e}")))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(NetError::Firewall(format!(
            "{tool} {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_rules_reject_denied_networks_before_accepting_internet() {
        let rules = HostRules {
            iface_prefix: "ae".into(),
            pool: "10.12.0.0/16".parse().unwrap(),
            denied: Ipv4Net::default_denied(),
            dns: vec!["10.0.0.2".parse().unwrap()],
            nat: NatMode::Snat,
        };
        let text = rules.restore_input();
        let pos = |needle: &str| {
            text.find(needle)
                .unwrap_or_else(|| panic!("{needle} missing in\n{text}"))
        };
        assert!(pos("-A AGENTENV-AE-IN -i ae+ -j REJECT") > pos("ESTABLISHED,RELATED -j ACCEPT"));
        assert!(pos("-d 10.0.0.2/32 -p udp --dport 53 -j ACCEPT") < pos("-d 10.0.0.0/8 -j REJECT"));
        assert!(pos("-d 192.168.0.0/16 -j REJECT") < pos("-i aei+ -j ACCEPT"));
        assert!(pos("-i aen+ -j REJECT") < pos("-i aei+ -j ACCEPT"));
        assert!(pos("-i ae+ -o ae+ -j REJECT") < pos("-i aei+ -j ACCEPT"));
        assert!(
            !text.contains("10.12.0.0/16"),
            "filter rules do not depend on the pool"
        );
    }

    #[test]
    fn only_sandbox_interfaces_of_the_prefix_count() {
        assert!(is_prefix_interface("ta", "tai0a0c0004"));
        assert!(is_prefix_interface("ta", "tan0a0c0004"));
        assert!(!is_prefix_interface("ta", "tabi0a0c0004"), "prefix tab");
        assert!(!is_prefix_interface("ta", "tai0a0c000"));
        assert!(!is_prefix_interface("ta", "tax0a0c0004"));
        assert!(!is_prefix_interface("ta", "eth0"));
        assert_eq!(host_chain("upa", "FWD"), "AGENTENV-UPA-FWD");
    }
}
