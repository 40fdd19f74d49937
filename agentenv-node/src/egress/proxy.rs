//! The egress proxy of one sandbox: where the namespace's rules redirect TCP 80 and 443 of
//! denied addresses when the policy allows a domain.
//!
//! The node made its listener inside the sandbox's namespace before any of the sandbox's
//! processes existed, so the tenant can never hold its port. For each connection it reads
//! the original destination (`SO_ORIGINAL_DST`), then the name the client asks for (the
//! SNI of a TLS ClientHello, the `Host` of an HTTP/1.x request; bounded, with a timeout),
//! checks it against the policy, resolves it through the sandbox's nameservers and
//! connects, from inside the namespace, only to an address the name resolves to (the
//! original destination when it is one of them): a client that sends an allowed name to
//! another address reaches the allowed name's server, never that address. Then it copies
//! both ways until either side closes, the connection idles out, or the policy stops
//! allowing the name. Anything else is closed, logged at debug with the sandbox's id.

use std::io;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use hickory_resolver::Resolver;
use hickory_resolver::proto::rr::RData;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, watch};
use tokio::task::JoinSet;
use tokio::time::Instant;

use super::netns::{CONNECT_TIMEOUT, Netns, NsRuntime};
use super::policy::EgressPolicy;
use super::sniff::{self, SniffError};

/// How long a client may take to name its server.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a proxied connection may pass no byte either way.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(600);
/// Most proxied connections of one sandbox at once; more are closed at once.
pub const MAX_CONNECTIONS: usize = 256;

/// Why the proxy closed a connection.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    #[error("not a redirected connection (no original destination)")]
    NotRedirected,
    #[error("no server name within {HANDSHAKE_TIMEOUT:?}")]
    HandshakeTimeout,
    #[error(transparent)]
    Sniff(#[from] SniffError),
    #[error("{0} is not allowed by the sandbox's allowOut")]
    NotAllowed(String),
    #[error("{0} is no longer allowed by the sandbox's allowOut")]
    NoLongerAllowed(String),
    #[error("resolving {name}: {reason}")]
    Resolve { name: String, reason: String },
    #[error("idle for {IDLE_TIMEOUT:?}")]
    Idle,
    #[error("{context}: {source}")]
    Io {
        context: &'static str,
        #[source]
        source: io::Error,
    },
}

fn io_err(context: &'static str) -> impl FnOnce(io::Error) -> ProxyError {
    move |source| ProxyError::Io { context, source }
}

/// What every connection of a sandbox's proxy shares.
pub(super) struct Shared {
    pub id: String,
    pub netns: Netns,
    /// The sandbox's nameservers (what its resolv.conf names).
    pub nameservers: Vec<Ipv4Addr>,
    pub policy: watch::Receiver<Arc<EgressPolicy>>,
    resolver: std::sync::Mutex<Option<Arc<Resolver<NsRuntime>>>>,
    slots: Arc<Semaphore>,
}

impl Shared {
    pub fn new(
        id: String,
        netns: Netns,
        nameservers: Vec<Ipv4Addr>,
        policy: watch::Receiver<Arc<EgressPolicy>>,
    ) -> Self {
        Self {
            id,
            netns,
            nameservers,
            policy,
            resolver: std::sync::Mutex::new(None),
            slots: Arc::new(Semaphore::new(MAX_CONNECTIONS)),
        }
    }

    fn resolver(&self) -> io::Result<Arc<Resolver<NsRuntime>>> {
        let mut r = self.resolver.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(r) = r.as_ref() {
            return Ok(r.clone());
        }
        let made = Arc::new(self.netns.resolver(&self.nameservers)?);
        *r = Some(made.clone());
        Ok(made)
    }

    /// The addresses `name` resolves to that a server may have (no loopback, link-local,
    /// multicast, broadcast or unspecified address).
    async fn resolve(&self, name: &str) -> Result<Vec<Ipv4Addr>, ProxyError> {
        let fail = |reason: String| ProxyError::Resolve {
            name: name.to_string(),
            reason,
        };
        if self.nameservers.is_empty() {
            return Err(fail("the sandbox has no nameserver".into()));
        }
        let resolver = self.resolver().map_err(|e| fail(e.to_string()))?;
        let lookup = resolver
            .ipv4_lookup(format!("{name}."))
            .await
            .map_err(|e| fail(e.to_string()))?;
        let addrs: Vec<Ipv4Addr> = lookup
            .answers()
            .iter()
            .filter_map(|r| match &r.data {
                RData::A(a) => Some(a.0),
                _ => None,
            })
            .filter(|ip| {
                !(ip.is_loopback()
                    || ip.is_link_local()
                    || ip.is_multicast()
                    || ip.is_broadcast()
                    || ip.is_unspecified())
            })
            .collect();
        if addrs.is_empty() {
            return Err(fail("no usable IPv4 address".into()));
        }
        Ok(addrs)
    }
}

/// Serves `listener` until `cancel` changes (or its sender goes); then ends every
/// connection and returns once they are gone (with them, every socket in the namespace).
pub(super) async fn serve(
    listener: TcpListener,
    shared: Arc<Shared>,
    mut cancel: watch::Receiver<bool>,
) {
    let mut conns = JoinSet::new();
    loop {
        tokio::select! {
            _ = cancel.changed() => break,
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    let Ok(permit) = shared.slots.clone().try_acquire_owned() else {
                        tracing::debug!(sandbox = %shared.id, %peer, "egress proxy: too many connections, closing one");
                        continue;
                    };
                    let sh = shared.clone();
                    conns.spawn(async move {
                        let _permit = permit;
                        if let Err(e) = handle(&sh, stream).await {
                            tracing::debug!(sandbox = %sh.id, %peer, error = %e, "egress proxy closed a connection");
                        }
                    });
                }
                Err(e) => {
                    tracing::warn!(sandbox = %shared.id, error = %e, "egress proxy: accept failed");
                    // A full descriptor table frees up as connections end.
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
        }
    }
    drop(listener);
    conns.shutdown().await;
}

/// The destination a redirected connection was sent to.
fn original_dst(stream: &TcpStream) -> Result<SocketAddrV4, ProxyError> {
    let sin = nix::sys::socket::getsockopt(stream, nix::sys::socket::sockopt::OriginalDst)
        .map_err(|_| ProxyError::NotRedirected)?;
    Ok(SocketAddrV4::new(
        Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)),
        u16::from_be(sin.sin_port),
    ))
}

async fn handle(sh: &Shared, mut client: TcpStream) -> Result<(), ProxyError> {
    client.set_nodelay(true).map_err(io_err("TCP_NODELAY"))?;
    let local = client.local_addr().map_err(io_err("the local address"))?;
    let orig = original_dst(&client)?;
    if SocketAddr::V4(orig) == local {
        return Err(ProxyError::NotRedirected);
    }
    let mut head = Vec::new();
    let sniffed = tokio::time::timeout(HANDSHAKE_TIMEOUT, sniff::read_name(&mut client, &mut head))
        .await
        .map_err(|_| ProxyError::HandshakeTimeout)??;
    let name = sniffed.name;
    if !sh.policy.borrow().allows_name(&name) {
        return Err(ProxyError::NotAllowed(name));
    }
    let addrs = sh.resolve(&name).await?;
    let ip = if addrs.contains(orig.ip()) {
        *orig.ip()
    } else {
        addrs[0]
    };
    let target = SocketAddr::from((ip, orig.port()));
    let mut upstream = sh
        .netns
        .connect(target, CONNECT_TIMEOUT)
        .await
        .map_err(io_err("connecting to the server"))?;
    tracing::debug!(sandbox = %sh.id, %name, asked = %orig, %target, protocol = ?sniffed.protocol, "egress proxy: connected");
    upstream
        .write_all(&head)
        .await
        .map_err(io_err("writing to the server"))?;
    splice(sh, client, upstream, &name).await
}

/// Copies both ways until either side ends, nothing passes for [`IDLE_TIMEOUT`], or a new
/// policy stops allowing `name`.
async fn splice(
    sh: &Shared,
    client: TcpStream,
    upstream: TcpStream,
    name: &str,
) -> Result<(), ProxyError> {
    let start = Instant::now();
    let last = Arc::new(AtomicU64::new(0));
    let mut a = Tracked::new(client, start, last.clone());
    let mut b = Tracked::new(upstream, start, last.clone());
    let mut policy = sh.policy.clone();
    policy.borrow_and_update();
    let copy = tokio::io::copy_bidirectional(&mut a, &mut b);
    tokio::pin!(copy);
    loop {
        let idle_at = start + Duration::from_millis(last.load(Ordering::Relaxed)) + IDLE_TIMEOUT;
        tokio::select! {
            r = &mut copy => return r.map(|_| ()).map_err(io_err("copying")),
            _ = tokio::time::sleep_until(idle_at) => {
                let now_idle = start + Duration::from_millis(last.load(Ordering::Relaxed)) + IDLE_TIMEOUT;
                if Instant::now() >= now_idle {
                    return Err(ProxyError::Idle);
                }
            }
            changed = policy.changed() => {
                if changed.is_err() {
                    return Ok(());
                }
                if !policy.borrow_and_update().allows_name(name) {
                    return Err(ProxyError::NoLongerAllowed(name.to_string()));
                }
            }
        }
    }
}

/// A stream that notes when it last read something (ms after `start`).
struct Tracked {
    inner: TcpStream,
    start: Instant,
    last: Arc<AtomicU64>,
}

impl Tracked {
    fn new(inner: TcpStream, start: Instant, last: Arc<AtomicU64>) -> Self {
        Self { inner, start, last }
    }
}

impl AsyncRead for Tracked {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        if matches!(r, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            let ms = self.start.elapsed().as_millis() as u64;
            self.last.store(ms, Ordering::Relaxed);
        }
        r
    }
}

impl AsyncWrite for Tracked {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::egress::EgressRules;

    fn allowing(names: &[&str]) -> Arc<EgressPolicy> {
        let rules = EgressRules {
            allow_out: names.iter().map(|s| s.to_string()).collect(),
            deny_out: vec!["0.0.0.0/0".into()],
            dns_servers: None,
        };
        Arc::new(EgressPolicy::new(&rules, None).unwrap())
    }

    /// A proxy's shared part over this process's own namespace, and its policy's sender.
    fn shared(names: &[&str]) -> (Shared, watch::Sender<Arc<EgressPolicy>>) {
        let ns: std::os::fd::OwnedFd = std::fs::File::open("/proc/self/ns/net").unwrap().into();
        let (tx, rx) = watch::channel(allowing(names));
        (
            Shared::new("sbx".into(), Netns::new(ns), Vec::new(), rx),
            tx,
        )
    }

    /// Two connected TCP streams on loopback.
    async fn pair() -> (TcpStream, TcpStream) {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let (c, s) = tokio::join!(TcpStream::connect(addr), l.accept());
        (c.unwrap(), s.unwrap().0)
    }

    #[tokio::test(start_paused = true)]
    async fn a_connection_passing_nothing_is_closed_after_the_idle_timeout() {
        let (sh, _tx) = shared(&["a.com"]);
        let ((mut client, proxy_in), (proxy_out, mut server)) = (pair().await, pair().await);
        let start = Instant::now();
        let run = tokio::spawn(async move { splice(&sh, proxy_in, proxy_out, "a.com").await });
        // Bytes both ways keep it open.
        tokio::time::advance(IDLE_TIMEOUT / 2).await;
        client.write_all(b"ping").await.unwrap();
        let mut buf = [0u8; 4];
        tokio::io::AsyncReadExt::read_exact(&mut server, &mut buf)
            .await
            .unwrap();
        let r = run.await.unwrap();
        assert!(matches!(r, Err(ProxyError::Idle)), "{r:?}");
        assert!(
            start.elapsed() >= IDLE_TIMEOUT + IDLE_TIMEOUT / 2,
            "{:?}",
            start.elapsed()
        );
    }

    #[tokio::test]
    async fn a_policy_that_stops_allowing_the_name_ends_the_connection() {
        let (sh, tx) = shared(&["a.com"]);
        let ((mut client, proxy_in), (proxy_out, mut server)) = (pair().await, pair().await);
        let run = tokio::spawn(async move { splice(&sh, proxy_in, proxy_out, "a.com").await });
        // Still allowed: the connection carries bytes after the change.
        tx.send_replace(allowing(&["a.com", "*.b.com"]));
        client.write_all(b"x").await.unwrap();
        let mut got = [0u8; 1];
        tokio::io::AsyncReadExt::read_exact(&mut server, &mut got)
            .await
            .unwrap();
        assert_eq!(&got, b"x");
        tx.send_replace(allowing(&["*.a.com"]));
        let r = run.await.unwrap();
        assert!(
            matches!(r, Err(ProxyError::NoLongerAllowed(ref n)) if n == "a.com"),
            "{r:?}"
        );
        let mut buf = [0u8; 1];
        let n = tokio::io::AsyncReadExt::read(&mut client, &mut buf)
            .await
            .unwrap_or(0);
        assert_eq!(n, 0, "the client's connection is closed");
    }

    #[tokio::test]
    async fn a_connection_that_was_not_redirected_is_closed() {
        let (sh, _tx) = shared(&["a.com"]);
        let (_client, proxy_in) = pair().await;
        assert!(matches!(
            handle(&sh, proxy_in).await,
            Err(ProxyError::NotRedirected)
        ));
    }
}
