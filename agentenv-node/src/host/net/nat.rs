//! Source NAT of sandbox egress in the node's `AGENTENV-<PREFIX>-NAT` chain.
//!
//! [`NatMode::Snat`] (the default) gives every host interface that can carry sandbox
//! egress (an [`Uplink`]: not loopback, no sandbox interface of any node, with a global
//! IPv4 address) one rule `-s <pool> -o <iface> -j SNAT --to-source <its primary IPv4>`,
//! and a [`NatKeeper`] task keeps those rules up to date: it listens to the host's IPv4
//! address notifications and re-reads the addresses every [`RECHECK`] (renames send
//! none). Traffic leaving an interface without an IPv4 address is not NATed (its answers
//! could not come back anyway). [`NatMode::Masquerade`] is one `MASQUERADE` rule per
//! pool, as before; the kernel's masquerade target then tracks the addresses itself, at
//! the price of its device notifier (see the README, "Where a sustained cycle's CPU
//! goes").
//!
//! Several node processes with different pools share one chain per prefix: each
//! replaces only the rules of its own pool (`-s <pool>`), atomically with
//! `iptables-restore --noflush`, under the host rules' lock file. Addresses are read in
//! the host's network namespace only: nothing a sandbox does in its own namespace
//! changes these rules.

use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use futures::{StreamExt, TryStreamExt};
use rtnetlink::packet_core::NetlinkPayload;
use rtnetlink::packet_route::address::{
    AddressAttribute, AddressHeaderFlags, AddressMessage, AddressScope,
};
use rtnetlink::packet_route::{AddressFamily, RouteNetlinkMessage};

use super::rules::{lock_rules, run_with_stdin};
use super::{Ipv4Net, NetError, nl_err};

/// How often the keeper re-reads the host's addresses besides reacting to notifications.
pub const RECHECK: Duration = Duration::from_secs(2);

/// How sandbox egress is NATed (`AENV_NET_NAT`, `[jail].nat`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum NatMode {
    /// `SNAT --to-source` of each uplink's address, kept up to date by the node.
    #[default]
    Snat,
    /// The kernel's `MASQUERADE` target.
    Masquerade,
}

impl NatMode {
    pub fn as_str(self) -> &'static str {
        match self {
            NatMode::Snat => "snat",
            NatMode::Masquerade => "masquerade",
        }
    }
}

impl FromStr for NatMode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim() {
            "snat" => Ok(NatMode::Snat),
            "masquerade" => Ok(NatMode::Masquerade),
            other => Err(format!(
                "unknown NAT mode {other:?}: use snat (the default) or masquerade"
            )),
        }
    }
}

/// A host interface that can carry sandbox egress, and the address it leaves with.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Uplink {
    pub name: String,
    pub addr: Ipv4Addr,
}

/// Whether `name` is the host end of a sandbox of any node on the host
/// (`<1 to 6 lowercase letters><i|n><8 hex digits>`): such interfaces come and go with
/// every sandbox and never carry egress.
pub fn is_sandbox_interface(name: &str) -> bool {
    let b = name.as_bytes();
    let Some(hex_at) = b.len().checked_sub(8) else {
        return false;
    };
    let (head, hex) = b.split_at(hex_at);
    let Some((letter, prefix)) = head.split_last() else {
        return false;
    };
    (*letter == b'i' || *letter == b'n')
        && (1..=6).contains(&prefix.len())
        && prefix.iter().all(u8::is_ascii_lowercase)
        && hex.iter().all(u8::is_ascii_hexdigit)
}

/// The interface an IPv4 address message names (its label is the interface's name, or
/// `<name>:<alias>`), if the address can carry egress: global scope, primary, not on
/// loopback or a sandbox interface. Else `None`.
fn egress_address(msg: &AddressMessage) -> Option<Uplink> {
    if msg.header.family != AddressFamily::Inet
        || msg.header.scope != AddressScope::Universe
        || msg.header.flags.contains(AddressHeaderFlags::Secondary)
    {
        return None;
    }
    let mut label = None;
    let mut local = None;
    let mut address = None;
    for attr in &msg.attributes {
        match attr {
            AddressAttribute::Label(l) => label = Some(l.as_str()),
            AddressAttribute::Local(IpAddr::V4(a)) => local = Some(*a),
            AddressAttribute::Address(IpAddr::V4(a)) => address = Some(*a),
            _ => {}
        }
    }
    let name = label?.split(':').next()?.to_string();
    let addr = local.or(address)?;
    if name == "lo" || is_sandbox_interface(&name) || addr.is_loopback() {
        return None;
    }
    Some(Uplink { name, addr })
}

/// The uplinks of the host (the namespace `handle` speaks to): one per interface, its
/// first primary global IPv4 address, sorted by name.
pub async fn uplinks(handle: &rtnetlink::Handle) -> Result<Vec<Uplink>, NetError> {
    let mut req = handle.address().get();
    req.message_mut().header.family = AddressFamily::Inet;
    let mut stream = req.execute();
    let mut out: Vec<Uplink> = Vec::new();
    while let Some(msg) = stream
        .try_next()
        .await
        .map_err(nl_err("listing the host's IPv4 addresses"))?
    {
        if let Some(u) = egress_address(&msg) {
            if !out.iter().any(|o| o.name == u.name) {
                out.push(u);
            }
        }
    }
    out.sort();
    Ok(out)
}

/// The NAT rules of `pool` (arguments after `-A <chain>`).
pub fn pool_rules(mode: NatMode, pool: Ipv4Net, iface_prefix: &str, ups: &[Uplink]) -> Vec<String> {
    match mode {
        NatMode::Masquerade => vec![format!("-s {pool} ! -o {iface_prefix}+ -j MASQUERADE")],
        NatMode::Snat => ups
            .iter()
            .map(|u| format!("-s {pool} -o {} -j SNAT --to-source {}", u.name, u.addr))
            .collect(),
    }
}

/// Whether a line of `iptables -S` is a rule of `pool` (`-s <pool>`).
fn is_pool_rule(line: &str, pool: &str) -> bool {
    let mut words = line.split_whitespace();
    while let Some(w) = words.next() {
        if w == "-s" {
            return words.next() == Some(pool);
        }
    }
    false
}

/// The `iptables-restore --noflush` input that replaces the rules of `pool` in `chain`
/// (listed by `iptables -S`: `current`) by `rules` and keeps every other rule.
pub fn replace_input(chain: &str, current: &str, pool: Ipv4Net, rules: &[String]) -> String {
    let pool = pool.to_string();
    let mut s = format!("*nat\n:{chain} - [0:0]\n");
    let append = format!("-A {chain} ");
    for line in current.lines() {
        if line.starts_with(&append) && !is_pool_rule(line, &pool) {
            s.push_str(line);
            s.push('\n');
        }
    }
    for r in rules {
        s.push_str(&format!("{append}{r}\n"));
    }
    s.push_str("COMMIT\n");
    s
}

/// Replaces the rules of `pool` in the NAT chain `chain` by `rules`, under the lock in
/// `runtime_dir`. With `create` false an absent chain (removed meanwhile by
/// [`super::uninstall_host_rules`]) stays absent.
pub(super) fn replace_pool_rules_locked(
    runtime_dir: &Path,
    chain: &str,
    pool: Ipv4Net,
    rules: &[String],
    create: bool,
) -> Result<(), NetError> {
    let _lock = lock_rules(runtime_dir)?;
    let listed = std::process::Command::new("iptables")
        .args(["-w", "-t", "nat", "-S", chain])
        .stderr(std::process::Stdio::null())
        .output()
        .map_err(|e| NetError::Firewall(format!("running iptables: {e}")))?;
    let current = if listed.status.success() {
        String::from_utf8_lossy(&listed.stdout).into_owned()
    } else if create {
        String::new()
    } else {
        return Ok(());
    };
    let input = replace_input(chain, &current, pool, rules);
    run_with_stdin("iptables-restore", &["-w", "--noflush"], &input)
}

/// Keeps a pool's SNAT rules up to date while it lives; aborts its task on drop.
#[derive(Debug, Default)]
pub struct NatKeeper {
    task: Option<tokio::task::JoinHandle<()>>,
}

impl Drop for NatKeeper {
    fn drop(&mut self) {
        if let Some(t) = self.task.take() {
            t.abort();
        }
    }
}

/// What a keeper needs to rewrite its pool's rules.
#[derive(Clone, Debug)]
pub(super) struct KeeperTarget {
    pub runtime_dir: PathBuf,
    pub chain: String,
    pub pool: Ipv4Net,
    pub iface_prefix: String,
}

impl KeeperTarget {
    async fn apply(&self, ups: &[Uplink], create: bool) -> Result<(), NetError> {
        let rules = pool_rules(NatMode::Snat, self.pool, &self.iface_prefix, ups);
        let (dir, chain, pool) = (self.runtime_dir.clone(), self.chain.clone(), self.pool);
        tokio::task::spawn_blocking(move || {
            replace_pool_rules_locked(&dir, &chain, pool, &rules, create)
        })
        .await
        .map_err(|e| NetError::Firewall(format!("writing the NAT rules: {e}")))?
    }
}

/// Logs what changed between two uplink sets (and, once, that there is none).
fn log_change(pool: Ipv4Net, old: Option<&[Uplink]>, new: &[Uplink]) {
    if new.is_empty() {
        tracing::warn!(
            %pool,
            "no host interface has a global IPv4 address: sandbox internet traffic is not NATed (and gets no answer) until one has"
        );
        return;
    }
    for u in new {
        if old.is_none_or(|o| !o.contains(u)) {
            tracing::info!(%pool, interface = %u.name, address = %u.addr, "sandbox egress through this interface leaves with this address (SNAT)");
        }
    }
    for u in old.unwrap_or_default() {
        if !new.iter().any(|n| n.name == u.name) {
            tracing::info!(%pool, interface = %u.name, "interface without an IPv4 address now: sandbox traffic leaving through it is not NATed");
        }
    }
}

/// Writes the SNAT rules of the target's pool once (creating the chain) and starts the
/// task that keeps them up to date.
pub(super) async fn start_keeper(target: KeeperTarget) -> Result<NatKeeper, NetError> {
    let (conn, handle, events) =
        rtnetlink::new_multicast_connection(&[rtnetlink::MulticastGroup::Ipv4Ifaddr]).map_err(
            |e| NetError::Io {
                context: "opening a netlink socket for address notifications".into(),
                source: e,
            },
        )?;
    // The connection ends with the keeper, or here if the first write fails.
    let conn = AbortOnDrop(tokio::spawn(conn));
    let first = uplinks(&handle).await?;
    target.apply(&first, true).await?;
    log_change(target.pool, None, &first);
    // Should the socket end, the periodic re-check goes on alone.
    let mut events = events.chain(futures::stream::pending());
    let task = tokio::spawn(async move {
        let _conn = conn;
        let mut last = first;
        let mut tick = tokio::time::interval(RECHECK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                Some((msg, _)) = events.next() => {
                    if !concerns_uplinks(&msg.payload) {
                        continue;
                    }
                }
                _ = tick.tick() => {}
            }
            let now = match uplinks(&handle).await {
                Ok(u) => u,
                Err(e) => {
                    tracing::warn!(error = %e, "reading the host's addresses for the NAT rules");
                    continue;
                }
            };
            if now == last {
                continue;
            }
            match target.apply(&now, false).await {
                Ok(()) => {
                    log_change(target.pool, Some(&last), &now);
                    last = now;
                }
                Err(e) => tracing::warn!(error = %e, "updating the NAT rules; retrying"),
            }
        }
    });
    Ok(NatKeeper { task: Some(task) })
}

/// Whether an address notification may change the uplinks: IPv4 addresses of
/// interfaces other than sandboxes' (whose addresses come and go with every sandbox).
fn concerns_uplinks(payload: &NetlinkPayload<RouteNetlinkMessage>) -> bool {
    match payload {
        NetlinkPayload::InnerMessage(
            RouteNetlinkMessage::NewAddress(m) | RouteNetlinkMessage::DelAddress(m),
        ) => !m.attributes.iter().any(|a| {
            matches!(a, AddressAttribute::Label(l)
                if is_sandbox_interface(l.split(':').next().unwrap_or(l)))
        }),
        // An overrun or anything unexpected: look again.
        _ => true,
    }
}

struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sandbox_interfaces_of_any_prefix_are_recognized() {
        assert!(is_sandbox_interface("aei0a0c0004"));
        assert!(is_sandbox_interface("upbn0a0d0010"));
        assert!(is_sandbox_interface("abcdefi0a0c0004"));
        assert!(!is_sandbox_interface("abcdefgi0a0c0004"), "prefix too long");
        assert!(!is_sandbox_interface("i0a0c0004"), "no prefix");
        assert!(!is_sandbox_interface("eth0"));
        assert!(!is_sandbox_interface("xeg32"));
        assert!(!is_sandbox_interface("aex0a0c0004"));
        assert!(!is_sandbox_interface("aei0a0c000g"));
    }

    #[test]
    fn nat_modes_parse() {
        assert_eq!("snat".parse::<NatMode>(), Ok(NatMode::Snat));
        assert_eq!(" masquerade ".parse::<NatMode>(), Ok(NatMode::Masquerade));
        assert!("MASQ".parse::<NatMode>().unwrap_err().contains("snat"));
        assert_eq!(NatMode::default(), NatMode::Snat);
    }

    #[test]
    fn pool_rules_snat_each_uplink_to_its_address() {
        let pool: Ipv4Net = "10.12.0.0/16".parse().unwrap();
        let ups = [
            Uplink {
                name: "eth0".into(),
                addr: "192.0.2.2".parse().unwrap(),
            },
            Uplink {
                name: "wg1".into(),
                addr: "198.51.100.7".parse().unwrap(),
            },
        ];
        assert_eq!(
            pool_rules(NatMode::Snat, pool, "ae", &ups),
            vec![
                "-s 10.12.0.0/16 -o eth0 -j SNAT --to-source 192.0.2.2",
                "-s 10.12.0.0/16 -o wg1 -j SNAT --to-source 198.51.100.7",
            ]
        );
        assert_eq!(
            pool_rules(NatMode::Masquerade, pool, "ae", &ups),
            vec!["-s 10.12.0.0/16 ! -o ae+ -j MASQUERADE"]
        );
        assert!(pool_rules(NatMode::Snat, pool, "ae", &[]).is_empty());
    }

    #[test]
    fn replacing_a_pools_rules_keeps_the_other_pools_rules() {
        let current = "-N AGENTENV-AE-NAT\n\
            -A AGENTENV-AE-NAT -s 10.12.0.0/16 ! -o ae+ -j MASQUERADE\n\
            -A AGENTENV-AE-NAT -s 10.13.0.0/16 -o eth0 -j SNAT --to-source 192.0.2.2\n\
            -A AGENTENV-AE-NAT -s 10.12.0.0/24 -o eth0 -j SNAT --to-source 192.0.2.2\n";
        let rules = vec!["-s 10.12.0.0/16 -o eth0 -j SNAT --to-source 192.0.2.9".to_string()];
        let input = replace_input(
            "AGENTENV-AE-NAT",
            current,
            "10.12.0.0/16".parse().unwrap(),
            &rules,
        );
        assert_eq!(
            input,
            "*nat\n:AGENTENV-AE-NAT - [0:0]\n\
             -A AGENTENV-AE-NAT -s 10.13.0.0/16 -o eth0 -j SNAT --to-source 192.0.2.2\n\
             -A AGENTENV-AE-NAT -s 10.12.0.0/24 -o eth0 -j SNAT --to-source 192.0.2.2\n\
             -A AGENTENV-AE-NAT -s 10.12.0.0/16 -o eth0 -j SNAT --to-source 192.0.2.9\n\
             COMMIT\n"
        );
    }

    fn addr_msg(label: &str, addr: &str, scope: AddressScope, secondary: bool) -> AddressMessage {
        let mut m = AddressMessage::default();
        m.header.family = AddressFamily::Inet;
        m.header.scope = scope;
        if secondary {
            m.header.flags = AddressHeaderFlags::Secondary;
        }
        let ip: Ipv4Addr = addr.parse().unwrap();
        m.attributes = vec![
            AddressAttribute::Address(ip.into()),
            AddressAttribute::Local(ip.into()),
            AddressAttribute::Label(label.into()),
        ];
        m
    }

    #[test]
    fn only_primary_global_addresses_of_non_sandbox_interfaces_carry_egress() {
        let u = egress_address(&addr_msg(
            "eth0:1",
            "192.0.2.5",
            AddressScope::Universe,
            false,
        ));
        assert_eq!(
            u,
            Some(Uplink {
                name: "eth0".into(),
                addr: "192.0.2.5".parse().unwrap()
            })
        );
        for m in [
            addr_msg("eth0", "192.0.2.6", AddressScope::Universe, true),
            addr_msg("lo", "127.0.0.1", AddressScope::Host, false),
            addr_msg("lo", "203.0.113.1", AddressScope::Universe, false),
            addr_msg("eth1", "169.254.1.1", AddressScope::Link, false),
            addr_msg("aei0a0c0004", "10.12.0.5", AddressScope::Universe, false),
        ] {
            assert_eq!(egress_address(&m), None, "{m:?}");
        }
        let ev =
            |m: AddressMessage| NetlinkPayload::InnerMessage(RouteNetlinkMessage::NewAddress(m));
        assert!(!concerns_uplinks(&ev(addr_msg(
            "aei0a0c0004",
            "10.12.0.5",
            AddressScope::Universe,
            false
        ))));
        assert!(concerns_uplinks(&ev(addr_msg(
            "eth0",
            "192.0.2.5",
            AddressScope::Universe,
            false
        ))));
    }
}
