//! Network: TCP connections to the host's services, the metadata address and other
//! sandboxes must fail.

use std::net::{IpAddr, Ipv4Addr, SocketAddr, SocketAddrV6, TcpStream};

use crate::{Attempt, Config, Outcome};

/// The cloud metadata service, always tried.
const METADATA: &str = "169.254.169.254:80";

pub fn attempts(cfg: &Config) -> Vec<Attempt> {
    let mut targets: Vec<(String, &'static str)> = Vec::new();
    for t in &cfg.host_ports {
        targets.push((t.clone(), "a host service"));
    }
    if !cfg.host_ports.iter().any(|t| t == METADATA) {
        targets.push((METADATA.to_string(), "the metadata service"));
    }
    for p in &cfg.peers {
        targets.push((p.clone(), "another sandbox"));
    }
    targets
        .into_iter()
        .map(|(t, what)| {
            let name = format!("connect:{t}");
            Attempt::new(name, move |cfg| connect(&t, what, cfg))
        })
        .collect()
}

/// The default gateway (the host side of the sandbox's link), from /proc/net/route.
fn gateway() -> Option<Ipv4Addr> {
    let text = std::fs::read_to_string("/proc/net/route").ok()?;
    text.lines().skip(1).find_map(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        if f.get(1) != Some(&"00000000") {
            return None;
        }
        let g = u32::from_str_radix(f.get(2)?, 16).ok()?;
        Some(Ipv4Addr::from(g.to_le_bytes()))
    })
}

/// `ip:port`, `gateway:port`, `[v6]:port` or `[v6%iface]:port`.
fn resolve(t: &str) -> Result<SocketAddr, String> {
    if let Some(port) = t.strip_prefix("gateway:") {
        let port: u16 = port.parse().map_err(|_| format!("bad port in {t:?}"))?;
        let gw = gateway().ok_or("no default route in the sandbox")?;
        return Ok(SocketAddr::new(IpAddr::V4(gw), port));
    }
    if let Some(rest) = t.strip_prefix('[')
        && let Some((inner, port)) = rest.split_once("]:")
        && let Some((ip, iface)) = inner.split_once('%')
    {
        let ip: std::net::Ipv6Addr = ip.parse().map_err(|_| format!("bad address {t:?}"))?;
        let port: u16 = port.parse().map_err(|_| format!("bad port in {t:?}"))?;
        let name = crate::sys::cstr(iface);
        // SAFETY: `name` is a NUL-terminated interface name that outlives the call.
        let idx = unsafe { libc::if_nametoindex(name.as_ptr()) };
        if idx == 0 {
            return Err(format!("no interface {iface} in the sandbox"));
        }
        return Ok(SocketAddr::V6(SocketAddrV6::new(ip, port, 0, idx)));
    }
    t.parse().map_err(|_| format!("bad target {t:?}"))
}

fn connect(t: &str, what: &str, cfg: &Config) -> Outcome {
    let addr = match resolve(t) {
        Ok(a) => a,
        Err(e) => return Outcome::inconclusive(format!("{t}: {e}")),
    };
    match TcpStream::connect_timeout(&addr, cfg.connect_timeout) {
        Ok(_) => Outcome::escaped(format!("connected to {what} at {addr}")),
        Err(e) if e.kind() == std::io::ErrorKind::TimedOut => Outcome::contained(format!(
            "{what} at {addr}: no answer within {:?} (dropped)",
            cfg.connect_timeout
        )),
        Err(e) if e.raw_os_error() == Some(libc::EADDRNOTAVAIL) && addr.is_ipv6() => {
            match ipv6_state(addr) {
                V6State::NoAddress(dev) => Outcome::contained(format!(
                    "{what} at {addr}: {dev} has no IPv6 address, so there is no IPv6 path"
                )),
                V6State::Tentative(dev) => Outcome::inconclusive(format!(
                    "{what} at {addr}: {e}, but only because {dev}'s IPv6 address is still tentative"
                )),
                V6State::Usable(dev) => {
                    Outcome::contained(format!("{what} at {addr} (from {dev}): {e}"))
                }
            }
        }
        Err(e) => Outcome::contained(format!("{what} at {addr}: {e}")),
    }
}

enum V6State {
    NoAddress(String),
    Tentative(String),
    Usable(String),
}

/// The link-local IPv6 state of the interface a scoped address goes out of.
fn ipv6_state(addr: SocketAddr) -> V6State {
    /// IFA_F_TENTATIVE.
    const TENTATIVE: u32 = 0x40;
    let idx = match addr {
        SocketAddr::V6(a) => a.scope_id(),
        SocketAddr::V4(_) => 0,
    };
    let text = std::fs::read_to_string("/proc/net/if_inet6").unwrap_or_default();
    let mut dev = format!("interface {idx}");
    let mut found = None;
    for l in text.lines() {
        let f: Vec<&str> = l.split_whitespace().collect();
        let (Some(i), Some(flags), Some(name)) = (f.get(1), f.get(4), f.get(5)) else {
            continue;
        };
        if u32::from_str_radix(i, 16).ok() != Some(idx) {
            continue;
        }
        dev = name.to_string();
        let tentative = u32::from_str_radix(flags, 16).is_ok_and(|x| x & TENTATIVE != 0);
        found = Some(found.unwrap_or(false) || !tentative);
    }
    match found {
        None => V6State::NoAddress(dev),
        Some(false) => V6State::Tentative(dev),
        Some(true) => V6State::Usable(dev),
    }
}
