//! Per-sandbox networking: a network namespace with a veth pair to the host, addresses from
//! a pool of /30 networks, and host firewall rules that give sandboxes NAT'd egress (or
//! none) while keeping the host and other sandboxes out of reach.
//!
//! Slot of a /30 network `N`: `N+1` is the host end (`<prefix><i|n><hex N>`, the sandbox's
//! gateway), `N+2` is `eth0` inside the namespace (the sandbox's address). The interface
//! letter encodes the egress policy (`i`: internet through NAT, `n`: none), so the host
//! rules are a fixed set that does not change per sandbox.
//!
//! Reservations are files `<runtime>/slots/<N>` created with `O_EXCL`, so several node
//! processes on one host (tests, for one) share the address space without collisions.
//!
//! The host firewall rules (the chains of an interface prefix, installing and removing
//! them) are in `rules`, the source NAT of sandbox egress (SNAT rules kept up to date
//! with the host's addresses, or MASQUERADE) in `nat`; both re-exported here.

mod nat;
mod rules;

use std::fmt;
use std::fs::File;
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::str::FromStr;

use super::reserve::{IndexName, Reservations, ReserveError};
use futures::TryStreamExt;
pub use nat::{NatKeeper, NatMode, Uplink, is_sandbox_interface, uplinks};
use rtnetlink::packet_route::link::{InfoData, InfoVeth, LinkAttribute, State};
use rtnetlink::{Handle, LinkMessageBuilder, LinkUnspec, LinkVeth, RouteMessageBuilder};
pub use rules::{HostRules, host_chain, prefix_interfaces, uninstall_host_rules};

/// Errors of the network layer.
#[derive(Debug, thiserror::Error)]
pub enum NetError {
    #[error("invalid IPv4 network {0:?}: write it as a.b.c.d/len")]
    InvalidCidr(String),
    #[error("address pool {0} is too small: it needs room for at least one /30")]
    PoolTooSmall(Ipv4Net),
    #[error("no free sandbox address in {0}: destroy sandboxes or configure a larger pool")]
    Exhausted(Ipv4Net),
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
    #[error("netlink: {context}: {source}")]
    Netlink {
        context: String,
        #[source]
        source: rtnetlink::Error,
    },
    #[error("{0}")]
    Firewall(String),
    #[error(
        "not removing the host firewall rules of interface prefix {prefix:?}: its interfaces {} still exist, and their sandboxes would reach the host and each other without them; destroy those sandboxes first",
        interfaces.join(", ")
    )]
    RulesInUse {
        prefix: String,
        interfaces: Vec<String>,
    },
}

fn io_err(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> NetError {
    let context = context.into();
    move |source| NetError::Io { context, source }
}

fn nl_err(context: impl Into<String>) -> impl FnOnce(rtnetlink::Error) -> NetError {
    let context = context.into();
    move |source| NetError::Netlink { context, source }
}

/// An IPv4 network `a.b.c.d/len` (host bits cleared).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Ipv4Net {
    addr: Ipv4Addr,
    len: u8,
}

impl Ipv4Net {
    pub fn new(addr: Ipv4Addr, len: u8) -> Option<Self> {
        if len > 32 {
            return None;
        }
        let mask = Self::mask_of(len);
        Some(Self {
            addr: Ipv4Addr::from(u32::from(addr) & mask),
            len,
        })
    }

    fn mask_of(len: u8) -> u32 {
        if len == 0 { 0 } else { u32::MAX << (32 - len) }
    }

    pub fn addr(&self) -> Ipv4Addr {
        self.addr
    }

    pub fn prefix_len(&self) -> u8 {
        self.len
    }

    pub fn contains(&self, ip: Ipv4Addr) -> bool {
        u32::from(ip) & Self::mask_of(self.len) == u32::from(self.addr)
    }

    /// The networks the node keeps sandboxes away from by default: private ranges,
    /// carrier-grade NAT, loopback, link-local.
    pub fn default_denied() -> Vec<Ipv4Net> {
        [
            "10.0.0.0/8",
            "172.16.0.0/12",
            "192.168.0.0/16",
            "100.64.0.0/10",
            "127.0.0.0/8",
            "169.254.0.0/16",
        ]
        .iter()
        .filter_map(|s| s.parse().ok())
        .collect()
    }
}

impl fmt::Display for Ipv4Net {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.len)
    }
}

impl FromStr for Ipv4Net {
    type Err = NetError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || NetError::InvalidCidr(s.to_string());
        let (a, l) = s.split_once('/').ok_or_else(bad)?;
        let addr: Ipv4Addr = a.parse().map_err(|_| bad())?;
        let len: u8 = l.parse().map_err(|_| bad())?;
        Self::new(addr, len).ok_or_else(bad)
    }
}

/// One /30 network of the pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Slot {
    pub network: Ipv4Addr,
}

impl Slot {
    /// The host end of the veth pair: the sandbox's gateway.
    pub fn host_ip(&self) -> Ipv4Addr {
        Ipv4Addr::from(u32::from(self.network) + 1)
    }

    /// The sandbox's address.
    pub fn sandbox_ip(&self) -> Ipv4Addr {
        Ipv4Addr::from(u32::from(self.network) + 2)
    }

    /// The host-side interface name; its letter after the prefix encodes the egress policy.
    pub fn host_ifname(&self, prefix: &str, internet: bool) -> String {
        format!(
            "{prefix}{}{:08x}",
            if internet { 'i' } else { 'n' },
            u32::from(self.network)
        )
    }
}

/// A pool of /30 networks with host-wide reservations (files `<runtime>/slots/<network>`).
#[derive(Debug)]
pub struct AddressPool {
    net: Ipv4Net,
    reservations: Reservations<SlotNames>,
}

/// Reservation file names of a pool: the slot's network address.
#[derive(Debug)]
struct SlotNames {
    base: u32,
}

impl IndexName for SlotNames {
    fn name(&self, idx: u32) -> String {
        Ipv4Addr::from(self.base + idx * 4).to_string()
    }

    fn parse(&self, name: &str) -> Option<u32> {
        let ip: Ipv4Addr = name.parse().ok()?;
        let off = u32::from(ip).checked_sub(self.base)?;
        (off % 4 == 0).then_some(off / 4)
    }
}

impl AddressPool {
    pub fn new(net: Ipv4Net, runtime_dir: &Path) -> Result<Self, NetError> {
        if net.prefix_len() > 30 {
            return Err(NetError::PoolTooSmall(net));
        }
        let dir = runtime_dir.join("slots");
        let count = 1u32 << (30 - net.prefix_len());
        let reservations = Reservations::new(
            dir.clone(),
            count,
            SlotNames {
                base: u32::from(net.addr()),
            },
        )
        .map_err(io_err(format!("creating {}", dir.display())))?;
        Ok(Self { net, reservations })
    }

    pub fn net(&self) -> Ipv4Net {
        self.net
    }

    pub fn slots(&self) -> u32 {
        1u32 << (30 - self.net.prefix_len())
    }

    fn index(&self, slot: Slot) -> u32 {
        (u32::from(slot.network).wrapping_sub(u32::from(self.net.addr()))) / 4
    }

    fn slot(&self, idx: u32) -> Slot {
        Slot {
            network: Ipv4Addr::from(u32::from(self.net.addr()) + idx * 4),
        }
    }

    /// Whether `slot` is one of this pool's.
    pub fn owns(&self, slot: Slot) -> bool {
        self.net.contains(slot.network) && u32::from(slot.network) % 4 == 0
    }

    /// Reserves a free slot for `owner` (written into the reservation).
    pub fn reserve(&self, owner: &Path) -> Result<Slot, NetError> {
        match self.reservations.reserve(owner) {
            Ok(idx) => Ok(self.slot(idx)),
            Err(ReserveError::Exhausted) => Err(NetError::Exhausted(self.net)),
            Err(ReserveError::Io(context, source)) => Err(NetError::Io { context, source }),
        }
    }

    /// Returns a slot to the pool.
    pub fn release(&self, slot: Slot) {
        if self.owns(slot) {
            self.reservations.release(self.index(slot));
        }
    }

    /// Hands a reservation over to `owner` (rewritten in place, atomically).
    pub fn transfer(&self, slot: Slot, owner: &Path) -> Result<(), NetError> {
        self.reservations
            .transfer(self.index(slot), owner)
            .map_err(io_err(format!(
                "handing over the reservation of {}",
                slot.network
            )))
    }

    /// Whether `slot` is reserved on this host, by a sandbox of this pool or of another
    /// node process's pool.
    pub fn is_reserved(&self, slot: Slot) -> bool {
        self.reservations.name_reserved(&slot.network.to_string())
    }

    /// Every address reservation on the host, of this pool and of the pools of other
    /// node processes sharing the runtime directory: `(slot, owner path)`. (What belongs
    /// to a sandbox is judged host-wide: a cgroup whose sandbox holds an address of
    /// another pool is not a leftover.)
    pub fn reservations(&self) -> Vec<(Slot, PathBuf)> {
        self.reservations
            .list_names()
            .into_iter()
            .filter_map(|(name, owner)| {
                let network: Ipv4Addr = name.parse().ok()?;
                Some((Slot { network }, owner))
            })
            .collect()
    }
}
/// The network of one sandbox: its namespace (held open by `netns`) and host interface.
#[derive(Debug)]
pub struct SandboxNet {
    pub netns: OwnedFd,
    pub host_if: String,
    pub slot: Slot,
    /// The egress proxy's listener, made in the namespace when it was (on
    /// [`EGRESS_PROXY_PORT`], before any process of a sandbox could take the port);
    /// taken by whoever serves it.
    pub proxy_listener: Option<std::net::TcpListener>,
}

/// The port the node's egress proxy holds in every sandbox namespace (see
/// [`crate::egress`]): the namespace's rules redirect web traffic of denied addresses here.
pub const EGRESS_PROXY_PORT: u16 = 1;

/// The interface name inside the sandbox.
pub const GUEST_IF: &str = "eth0";

/// A netlink connection inside a sandbox's network namespace; its task ends on drop.
#[derive(Debug)]
pub struct NsNetlink {
    handle: Handle,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for NsNetlink {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Creates a network namespace, a veth pair into it and the addresses and routes on both
/// ends. On failure nothing is left (the namespace goes away with its last reference).
pub async fn create_sandbox_net(
    host: &Handle,
    slot: Slot,
    host_if: String,
) -> Result<SandboxNet, NetError> {
    create_sandbox_net_with_netlink(host, slot, host_if)
        .await
        .map(|(net, _)| net)
}

/// [`create_sandbox_net`], also returning the netlink connection inside the namespace
/// (what [`rename_host_link`] needs).
pub async fn create_sandbox_net_with_netlink(
    host: &Handle,
    slot: Slot,
    host_if: String,
) -> Result<(SandboxNet, NsNetlink), NetError> {
    let rt = tokio::runtime::Handle::current();
    // A fresh thread enters a new network namespace and opens a netlink socket there;
    // the namespace lives on through the returned descriptor and the socket.
    let (netns, listener, (conn, ns_handle)) =
        std::thread::spawn(move || -> Result<_, NetError> {
            nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET)
                .map_err(|e| io_err("creating a network namespace")(e.into()))?;
            let fd: OwnedFd = File::open("/proc/thread-self/ns/net")
                .map_err(io_err("opening the new network namespace"))?
                .into();
            // Sandboxes speak IPv4 only (NAT, pool addresses); without IPv6 the new links
            // skip link-local addresses, duplicate address detection and solicitations.
            // /proc/sys/net shows the namespace of the thread that reads it.
            for conf in ["all", "default"] {
                let path = format!("/proc/sys/net/ipv6/conf/{conf}/disable_ipv6");
                if let Err(e) = std::fs::write(&path, "1") {
                    if e.kind() != std::io::ErrorKind::NotFound {
                        return Err(io_err(format!("writing {path}"))(e));
                    }
                }
            }
            // Sandbox root lives in a user namespace that does not own this network
            // namespace, so it has no CAP_NET_BIND_SERVICE or CAP_NET_RAW here: let every
            // user bind low ports and open ICMP echo sockets (ping), as containers do.
            for (path, value) in [
                ("/proc/sys/net/ipv4/ip_unprivileged_port_start", "0"),
                ("/proc/sys/net/ipv4/ping_group_range", "0 2147483647"),
            ] {
                std::fs::write(path, value).map_err(io_err(format!("writing {path}")))?;
            }
            // The egress proxy's port is the node's before the sandbox exists.
            let listener = std::net::TcpListener::bind((Ipv4Addr::UNSPECIFIED, EGRESS_PROXY_PORT))
                .and_then(|l| l.set_nonblocking(true).map(|()| l))
                .map_err(io_err(
                    "binding the egress proxy's port in the sandbox namespace",
                ))?;
            let _guard = rt.enter();
            let (conn, handle, _) = rtnetlink::new_connection()
                .map_err(io_err("netlink socket in the sandbox namespace"))?;
            Ok((fd, listener, (conn, handle)))
        })
        .join()
        .map_err(|_| NetError::Firewall("network namespace thread panicked".into()))??;
    let ns = NsNetlink {
        handle: ns_handle,
        task: tokio::spawn(conn),
    };
    let result = configure(host, &ns.handle, &netns, slot, &host_if).await;
    match result {
        Ok(()) => Ok((
            SandboxNet {
                netns,
                host_if,
                slot,
                proxy_listener: Some(listener),
            },
            ns,
        )),
        Err(e) => {
            let _ = delete_link(host, &host_if).await;
            Err(e)
        }
    }
}

async fn link_index(handle: &Handle, name: &str) -> Result<Option<u32>, NetError> {
    let mut links = handle.link().get().match_name(name.to_string()).execute();
    match links.try_next().await {
        Ok(Some(msg)) => Ok(Some(msg.header.index)),
        Ok(None) => Ok(None),
        Err(rtnetlink::Error::NetlinkError(e)) if e.raw_code() == -libc::ENODEV => Ok(None),
        Err(e) => Err(nl_err(format!("looking up {name}"))(e)),
    }
}

async fn configure(
    host: &Handle,
    ns: &Handle,
    netns: &OwnedFd,
    slot: Slot,
    host_if: &str,
) -> Result<(), NetError> {
    // The peer is created directly inside the sandbox namespace, named eth0.
    let peer = LinkMessageBuilder::<LinkUnspec>::new()
        .name(GUEST_IF.to_string())
        .setns_by_fd(netns.as_raw_fd())
        .build();
    let veth = LinkVeth::new(host_if, GUEST_IF)
        .set_info_data(InfoData::Veth(InfoVeth::Peer(peer)))
        .build();
    host.link()
        .add(veth)
        .execute()
        .await
        .map_err(nl_err(format!("creating veth {host_if}")))?;
    let hidx = link_index(host, host_if)
        .await?
        .ok_or_else(|| NetError::Firewall(format!("veth {host_if} vanished")))?;
    without_ipv6(host_if)?;
    host.address()
        .add(hidx, slot.host_ip().into(), 30)
        .execute()
        .await
        .map_err(nl_err(format!("addressing {host_if}")))?;
    host.link()
        .set(LinkUnspec::new_with_index(hidx).up().build())
        .execute()
        .await
        .map_err(nl_err(format!("bringing {host_if} up")))?;

    let gidx = link_index(ns, GUEST_IF)
        .await?
        .ok_or_else(|| NetError::Firewall("eth0 missing in the sandbox namespace".into()))?;
    ns.address()
        .add(gidx, slot.sandbox_ip().into(), 30)
        .execute()
        .await
        .map_err(nl_err("addressing eth0"))?;
    ns.link()
        .set(LinkUnspec::new_with_index(gidx).up().build())
        .execute()
        .await
        .map_err(nl_err("bringing eth0 up"))?;
    if let Some(lo) = link_index(ns, "lo").await? {
        ns.link()
            .set(LinkUnspec::new_with_index(lo).up().build())
            .execute()
            .await
            .map_err(nl_err("bringing lo up"))?;
    }
    // Packets sent before the kernel has activated a new link's queue are dropped, and a
    // dropped ARP request is retried only after a second; wait until both ends are up.
    wait_oper_up(host, hidx, host_if).await?;
    wait_oper_up(ns, gidx, GUEST_IF).await?;
    let route = RouteMessageBuilder::<Ipv4Addr>::new()
        .gateway(slot.host_ip())
        .output_interface(gidx)
        .build();
    ns.route()
        .add(route)
        .execute()
        .await
        .map_err(nl_err("adding the default route"))?;
    Ok(())
}

/// Turns IPv6 off on a new host link before it goes up (sandboxes speak IPv4 only), so it
/// gets no link-local address: the removal of one is a conntrack table walk of the
/// kernel's masquerade notifier (see `nat`), at every delete. The link's sysctl directory
/// is the host's: the calling thread is in the host's network namespace.
fn without_ipv6(host_if: &str) -> Result<(), NetError> {
    let path = format!("/proc/sys/net/ipv6/conf/{host_if}/disable_ipv6");
    match std::fs::write(&path, "1") {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(io_err(path)(e)),
        // No IPv6 on the host at all: nothing to turn off.
        _ => Ok(()),
    }
}

/// Renames the host end of a sandbox's veth pair to `name`, while it is up where the
/// kernel allows that (Linux 6.2 and later); else down, then rename and up in one request,
/// and waits until both ends are operational again. Addresses and routes stay.
///
/// A link that goes down makes the kernel's masquerade notifier walk the whole conntrack
/// table (see `nat`), so the live rename saves one walk per pooled create.
pub async fn rename_host_link(
    host: &Handle,
    ns: &NsNetlink,
    net: &mut SandboxNet,
    name: String,
) -> Result<(), NetError> {
    let old = net.host_if.clone();
    let hidx = link_index(host, &old)
        .await?
        .ok_or_else(|| NetError::Firewall(format!("veth {old} vanished")))?;
    match host
        .link()
        .set(LinkUnspec::new_with_index(hidx).name(name.clone()).build())
        .execute()
        .await
    {
        Ok(()) => {
            net.host_if = name;
            return Ok(());
        }
        Err(rtnetlink::Error::NetlinkError(e)) if e.raw_code() == -libc::EBUSY => {}
        Err(e) => return Err(nl_err(format!("renaming {old} to {name}"))(e)),
    }
    host.link()
        .set(LinkUnspec::new_with_index(hidx).down().build())
        .execute()
        .await
        .map_err(nl_err(format!("taking {old} down")))?;
    // The kernel applies the name before the flags.
    host.link()
        .set(
            LinkUnspec::new_with_index(hidx)
                .name(name.clone())
                .up()
                .build(),
        )
        .execute()
        .await
        .map_err(nl_err(format!("renaming {old} to {name}")))?;
    net.host_if = name;
    wait_oper_up(host, hidx, &net.host_if).await?;
    let gidx = link_index(&ns.handle, GUEST_IF)
        .await?
        .ok_or_else(|| NetError::Firewall("eth0 missing in the sandbox namespace".into()))?;
    wait_oper_up(&ns.handle, gidx, GUEST_IF).await
}

/// How long a new link may take to become operational.
const OPER_UP_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);

async fn wait_oper_up(handle: &Handle, index: u32, name: &str) -> Result<(), NetError> {
    let deadline = tokio::time::Instant::now() + OPER_UP_TIMEOUT;
    let mut pause = std::time::Duration::from_micros(50);
    loop {
        let mut links = handle.link().get().match_index(index).execute();
        if let Some(msg) = links
            .try_next()
            .await
            .map_err(nl_err(format!("reading the state of {name}")))?
        {
            if msg
                .attributes
                .iter()
                .any(|a| matches!(a, LinkAttribute::OperState(State::Up)))
            {
                return Ok(());
            }
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(NetError::Firewall(format!(
                "{name} did not become operational within {OPER_UP_TIMEOUT:?}"
            )));
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(std::time::Duration::from_millis(2));
    }
}

/// Deletes a host link by name (its veth peer goes with it); absent is fine.
pub async fn delete_link(host: &Handle, name: &str) -> Result<bool, NetError> {
    match link_index(host, name).await? {
        Some(idx) => match host.link().del(idx).execute().await {
            Ok(()) => Ok(true),
            Err(rtnetlink::Error::NetlinkError(e)) if e.raw_code() == -libc::ENODEV => Ok(false),
            Err(e) => Err(nl_err(format!("deleting {name}"))(e)),
        },
        None => Ok(false),
    }
}

/// Waits until a host link no longer exists.
pub async fn wait_link_gone(
    host: &Handle,
    name: &str,
    timeout: std::time::Duration,
) -> Result<(), NetError> {
    let deadline = tokio::time::Instant::now() + timeout;
    let mut pause = std::time::Duration::from_micros(500);
    loop {
        if link_index(host, name).await?.is_none() {
            return Ok(());
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(NetError::Firewall(format!(
                "link {name} still exists after {timeout:?}"
            )));
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(std::time::Duration::from_millis(5));
    }
}

/// Names of host links starting with `prefix` followed by `i` or `n`.
pub async fn list_links(host: &Handle, prefix: &str) -> Result<Vec<String>, NetError> {
    let mut out = Vec::new();
    let mut links = host.link().get().execute();
    while let Some(msg) = links.try_next().await.map_err(nl_err("listing links"))? {
        for attr in &msg.attributes {
            if let LinkAttribute::IfName(name) = attr {
                if let Some(rest) = name.strip_prefix(prefix) {
                    if rest.starts_with('i') || rest.starts_with('n') {
                        out.push(name.clone());
                    }
                }
            }
        }
    }
    Ok(out)
}

/// The slot a host interface name encodes.
pub fn slot_of_ifname(prefix: &str, name: &str) -> Option<Slot> {
    let rest = name.strip_prefix(prefix)?;
    let hex = rest.strip_prefix('i').or_else(|| rest.strip_prefix('n'))?;
    let n = u32::from_str_radix(hex, 16).ok()?;
    Some(Slot {
        network: Ipv4Addr::from(n),
    })
}

/// Nameservers from a resolv.conf text, loopback ones skipped.
pub fn nameservers(resolv_conf: &str) -> Vec<Ipv4Addr> {
    resolv_conf
        .lines()
        .filter_map(|l| l.trim().strip_prefix("nameserver"))
        .filter_map(|v| v.trim().parse::<Ipv4Addr>().ok())
        .filter(|ip| !ip.is_loopback())
        .collect()
}

/// Sandbox nameservers given by the operator: IPv4 addresses a sandbox can reach (not
/// loopback: a sandbox's loopback is its own); else the entry refused and the fix.
pub fn parse_nameservers(list: &[String]) -> Result<Vec<Ipv4Addr>, (String, &'static str)> {
    let fix = "use IPv4 addresses of nameservers the sandboxes can reach, e.g. 8.8.8.8,1.1.1.1";
    if list.is_empty() {
        return Err(("[]".into(), fix));
    }
    list.iter()
        .map(|s| match s.trim().parse::<Ipv4Addr>() {
            Ok(ip) if !ip.is_loopback() && !ip.is_unspecified() => Ok(ip),
            _ => Err((s.clone(), fix)),
        })
        .collect()
}

/// The host's nameservers (systemd-resolved's upstream file first).
pub fn host_nameservers() -> Vec<Ipv4Addr> {
    for f in ["/run/systemd/resolve/resolv.conf", "/etc/resolv.conf"] {
        if let Ok(text) = std::fs::read_to_string(f) {
            let ns = nameservers(&text);
            if !ns.is_empty() {
                return ns;
            }
        }
    }
    Vec::new()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cidrs_parse_and_normalize() {
        let n: Ipv4Net = "10.12.3.4/16".parse().unwrap();
        assert_eq!(n.to_string(), "10.12.0.0/16");
        assert!(n.contains("10.12.255.1".parse().unwrap()));
        assert!(!n.contains("10.13.0.1".parse().unwrap()));
        assert!("10.0.0.0".parse::<Ipv4Net>().is_err());
        assert!("10.0.0.0/33".parse::<Ipv4Net>().is_err());
        assert!("x/8".parse::<Ipv4Net>().is_err());
    }

    #[test]
    fn slots_give_addresses_and_names() {
        let s = Slot {
            network: "10.12.0.4".parse().unwrap(),
        };
        assert_eq!(s.host_ip().to_string(), "10.12.0.5");
        assert_eq!(s.sandbox_ip().to_string(), "10.12.0.6");
        let name = s.host_ifname("ae", true);
        assert_eq!(name, "aei0a0c0004");
        assert!(name.len() <= 15);
        assert_eq!(slot_of_ifname("ae", &name), Some(s));
        assert_eq!(slot_of_ifname("ae", &s.host_ifname("ae", false)), Some(s));
        assert_eq!(slot_of_ifname("ae", "eth0"), None);
    }

    #[test]
    fn pool_reserves_distinct_slots_until_exhausted_and_reuses_released_ones() {
        let dir = tempfile::tempdir().unwrap();
        let pool = AddressPool::new("10.13.0.0/29".parse().unwrap(), dir.path()).unwrap();
        assert_eq!(pool.slots(), 2);
        let a = pool.reserve(Path::new("/owner/a")).unwrap();
        let b = pool.reserve(Path::new("/owner/b")).unwrap();
        assert_ne!(a, b);
        assert!(matches!(
            pool.reserve(Path::new("/c")),
            Err(NetError::Exhausted(_))
        ));
        let mut owners: Vec<_> = pool.reservations().into_iter().map(|(_, o)| o).collect();
        owners.sort();
        assert_eq!(
            owners,
            vec![PathBuf::from("/owner/a"), PathBuf::from("/owner/b")]
        );
        pool.release(a);
        assert!(!pool.is_reserved(a));
        assert_eq!(pool.reserve(Path::new("/d")).unwrap(), a);
    }

    #[test]
    fn a_pool_smaller_than_a_slot_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        assert!(AddressPool::new("10.13.0.0/31".parse().unwrap(), dir.path()).is_err());
    }
    #[test]
    fn nameservers_skip_loopback() {
        let t = "# x\nnameserver 127.0.0.53\nnameserver 10.1.2.3\nnameserver ::1\noptions edns0\n";
        assert_eq!(
            nameservers(t),
            vec!["10.1.2.3".parse::<Ipv4Addr>().unwrap()]
        );
    }
}
