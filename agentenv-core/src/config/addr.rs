//! Listen addresses of the control plane: Go-style `host:port` / `:port`, resolved
//! and checked, and which of them bind loopback only.

use std::net::{SocketAddr, ToSocketAddrs};

use super::ConfigError;

pub(super) fn require_listen_addr(key: &str, value: &str) -> Result<(), ConfigError> {
    if value.trim().is_empty() {
        return Err(ConfigError::invalid(key, "is required, e.g. \":9090\""));
    }
    resolve_listen_addr(value)
        .map(|_| ())
        .map_err(|m| ConfigError::invalid(key, m))
}

/// Resolves a Go-style listen address (`":9090"`, `"127.0.0.1:9090"`,
/// `"localhost:9090"`, `"[::1]:9090"`) into a socket address. A missing host
/// means every interface.
pub fn resolve_listen_addr(value: &str) -> Result<SocketAddr, String> {
    let v = value.trim();
    let Some((host, port)) = v.rsplit_once(':') else {
        return Err(format!("{v:?} must be host:port or :port, e.g. \":9090\""));
    };
    let port: u16 = port.parse().map_err(|_| {
        format!("{v:?} has an invalid port; expected host:port or :port, e.g. \":9090\"")
    })?;
    if host.is_empty() {
        return Ok(SocketAddr::from(([0, 0, 0, 0], port)));
    }
    let host = host.trim_start_matches('[').trim_end_matches(']');
    (host, port)
        .to_socket_addrs()
        .map_err(|e| format!("cannot resolve {v:?}: {e}"))?
        .next()
        .ok_or_else(|| format!("{v:?} resolves to no address"))
}

/// Whether a listen address (`host:port`, `:port`) binds a loopback address only.
pub fn is_loopback_listen_addr(addr: &str) -> bool {
    let host = addr.trim().rsplit_once(':').map_or("", |(h, _)| h);
    let host = host.trim_start_matches('[').trim_end_matches(']');
    host.eq_ignore_ascii_case("localhost")
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}
