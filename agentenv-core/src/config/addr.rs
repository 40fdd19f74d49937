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

/// A listener and what keeps its traffic private.
pub(super) struct Exposed<'a> {
    /// The config key of the address.
    pub key: &'a str,
    pub addr: &'a str,
    /// TLS is configured for it.
    pub tls: bool,
    /// The keys that configure TLS, for the message.
    pub tls_key: &'a str,
    /// The key that allows plain traffic anyway, and its value.
    pub allow_key: &'a str,
    pub allow: bool,
}

/// Refuses a plain (non-TLS) listener that other hosts reach: API keys, sandbox
/// tokens and cluster credentials would cross the network in clear text. Plain
/// traffic is for loopback, or where the operator says another layer encrypts.
pub(super) fn refuse_exposed_plain(e: Exposed<'_>) -> Result<(), ConfigError> {
    if e.tls || e.allow || is_loopback_listen_addr(e.addr) {
        return Ok(());
    }
    Err(ConfigError::invalid(
        e.key,
        format!(
            "{:?} is reachable from other hosts but serves without TLS, so keys and tokens would cross the network in clear text: set {} (docs/configuration.md, TLS), listen on 127.0.0.1, or set {} to true when another layer (a TLS proxy, a VPN) encrypts",
            e.addr, e.tls_key, e.allow_key
        ),
    ))
}

/// Refuses a scheduler that other hosts reach without a cluster credential:
/// anyone who reaches it could send heartbeats and bindings.
pub(super) fn refuse_exposed_without_credential(
    s: &super::SchedulerConfig,
) -> Result<(), ConfigError> {
    if !s.cluster_token_file.trim().is_empty()
        || s.insecure_no_auth
        || is_loopback_listen_addr(&s.grpc_listen_addr)
    {
        return Ok(());
    }
    Err(ConfigError::invalid(
        "scheduler.cluster_token_file",
        format!(
            "is required when scheduler.grpc_listen_addr ({:?}) is reachable from other hosts: without it anyone who reaches the scheduler can send heartbeats and bindings; give the same file to gateway.cluster_token_file and the nodes' AENV_CLUSTER_TOKEN_FILE, listen on 127.0.0.1, or set scheduler.insecure_no_auth to true (not recommended)",
            s.grpc_listen_addr
        ),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn exposed(addr: &str, tls: bool, allow: bool) -> Result<(), ConfigError> {
        refuse_exposed_plain(Exposed {
            key: "gateway.http_listen_addr",
            addr,
            tls,
            tls_key: "gateway.tls.cert_file and key_file",
            allow_key: "gateway.allow_plain_http",
            allow,
        })
    }

    #[test]
    fn plain_listeners_are_refused_off_loopback_unless_tls_or_allowed() {
        for addr in [":8080", "0.0.0.0:8080", "10.0.0.10:8080", "[::]:8080"] {
            let e = exposed(addr, false, false).unwrap_err().to_string();
            assert!(
                e.contains("gateway.http_listen_addr")
                    && e.contains("gateway.tls.cert_file")
                    && e.contains("gateway.allow_plain_http"),
                "{e}"
            );
            exposed(addr, true, false).unwrap();
            exposed(addr, false, true).unwrap();
        }
        for addr in [
            "127.0.0.1:8080",
            "localhost:8080",
            "[::1]:8080",
            "127.0.0.2:1",
        ] {
            exposed(addr, false, false).unwrap();
        }
    }
}
