//! Keep-alive HTTP/1.1 connections from the node to sandboxes, so a warm data-plane
//! request (a command's `Process/Start`, a file read) skips the TCP connect, the agent's
//! accept and the handshake.
//!
//! Connections are kept per sandbox and address: the pool key (the request URI's
//! authority) names the sandbox id as well as its address and port, so a connection made
//! for one sandbox is never used for another, even one that got the same address later.
//! An idle connection goes after [`IDLE_TIMEOUT`] (below the agent's own 30 s limit on a
//! connection that sends nothing), when the sandbox closed it (its agent or program
//! stopped), and at most [`MAX_IDLE_PER_SANDBOX`] are kept per sandbox and port. A
//! request the pool could not even start writing on a reused connection is sent again on
//! another.
//!
//! Upgrades (WebSocket) and uploads (`POST /files…`, which the agent serves fastest as
//! a connection's first request) keep taking a connection of their own.

use std::future::Future;
use std::io;
use std::net::{Ipv4Addr, SocketAddr};
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use http::Uri;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpStream;

use super::{CONNECT_TIMEOUT, Upload};

/// How long an idle connection is kept.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(20);
/// Idle connections kept per sandbox and port.
pub const MAX_IDLE_PER_SANDBOX: usize = 4;

/// The node's pool of connections to sandboxes.
#[derive(Clone, Debug)]
pub struct SandboxPool {
    client: Client<Connector, Upload>,
}

impl Default for SandboxPool {
    fn default() -> Self {
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(IDLE_TIMEOUT)
            .pool_max_idle_per_host(MAX_IDLE_PER_SANDBOX)
            .pool_timer(hyper_util::rt::TokioTimer::new())
            .timer(hyper_util::rt::TokioTimer::new())
            .set_host(false)
            .build(Connector);
        Self { client }
    }
}

impl SandboxPool {
    /// Sends `req` (its URI made by [`uri`]) on a kept connection, or a new one.
    pub(super) fn request(
        &self,
        req: http::Request<Upload>,
    ) -> hyper_util::client::legacy::ResponseFuture {
        self.client.request(req)
    }
}

/// The URI of `path_and_query` on `upstream` of sandbox `sandbox_id`: its authority is
/// the pool key, `<a>-<b>-<c>-<d>.<sandbox id>.sandbox:<port>`, which [`Connector`]
/// turns back into the address.
pub(super) fn uri(upstream: SocketAddr, sandbox_id: &str, path_and_query: &str) -> Option<Uri> {
    let SocketAddr::V4(v4) = upstream else {
        return None;
    };
    let [a, b, c, d] = v4.ip().octets();
    // Sandbox ids are UUIDs (hex digits and hyphens): a valid host label.
    if sandbox_id.is_empty()
        || !sandbox_id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-')
    {
        return None;
    }
    let path = if path_and_query.starts_with('/') {
        path_and_query
    } else {
        "/"
    };
    format!(
        "http://{a}-{b}-{c}-{d}.{sandbox_id}.sandbox:{}{path}",
        v4.port()
    )
    .parse()
    .ok()
}

/// The sandbox address a URI made by [`uri`] names.
fn upstream_of(uri: &Uri) -> Option<SocketAddr> {
    let host = uri.host()?;
    let ip: Ipv4Addr = host.split('.').next()?.replace('-', ".").parse().ok()?;
    Some(SocketAddr::from((ip, uri.port_u16()?)))
}

/// Makes the pool's connections: TCP to the address in the URI, with `TCP_NODELAY`,
/// within [`CONNECT_TIMEOUT`].
#[derive(Clone, Copy, Debug)]
pub struct Connector;

impl tower::Service<Uri> for Connector {
    type Response = TokioIo<TcpStream>;
    type Error = io::Error;
    type Future = Pin<Box<dyn Future<Output = io::Result<TokioIo<TcpStream>>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        Box::pin(async move {
            let addr = upstream_of(&uri).ok_or_else(|| {
                io::Error::new(io::ErrorKind::InvalidInput, format!("no sandbox in {uri}"))
            })?;
            let stream = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(addr))
                .await
                .map_err(|_| {
                    io::Error::new(
                        io::ErrorKind::TimedOut,
                        format!("timed out after {CONNECT_TIMEOUT:?}"),
                    )
                })??;
            let _ = stream.set_nodelay(true);
            Ok(TokioIo::new(stream))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pool_key_names_the_sandbox_and_gives_back_its_address() {
        let id = "01936f8e-72f5-7000-8000-000000000001";
        let addr: SocketAddr = "10.12.3.4:49983".parse().unwrap();
        let u = uri(addr, id, "/process.Process/Start?x=1").unwrap();
        assert_eq!(
            u.to_string(),
            format!("http://10-12-3-4.{id}.sandbox:49983/process.Process/Start?x=1")
        );
        assert_eq!(upstream_of(&u), Some(addr));
        // Another sandbox on the same address has another key.
        let other = uri(addr, "01936f8e-72f5-7000-8000-000000000002", "/").unwrap();
        assert_ne!(u.authority(), other.authority());
        // Nothing but an id's characters gets into the authority.
        assert!(uri(addr, "a.b", "/").is_none());
        assert!(uri(addr, "a@b", "/").is_none());
        assert!(uri("[::1]:80".parse().unwrap(), id, "/").is_none());
    }
}
