//! Sockets made inside a sandbox's network namespace, and a DNS resolver whose queries
//! leave from there.
//!
//! A socket keeps the namespace it was made in: the node makes one on a short-lived
//! thread that enters the namespace first ([`Netns::run`]), then drives it from the
//! runtime like any other. What leaves by such a socket meets the same routes, host rules
//! and address translation as the sandbox's own traffic.

use std::future::Future;
use std::io;
use std::net::{Ipv4Addr, SocketAddr};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use hickory_resolver::Resolver;
use hickory_resolver::config::{NameServerConfig, ResolverConfig, ResolverOpts};
use hickory_resolver::net::runtime::iocompat::AsyncIoTokioAsStd;
use hickory_resolver::net::runtime::{RuntimeProvider, TokioHandle, TokioTime};
use tokio::net::{TcpSocket, TcpStream, UdpSocket};

/// How long a connection (to a server, to a nameserver over TCP) may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// A sandbox's network namespace (a descriptor of it, shared).
#[derive(Clone, Debug)]
pub struct Netns(Arc<OwnedFd>);

impl Netns {
    pub fn new(fd: OwnedFd) -> Self {
        Self(Arc::new(fd))
    }

    pub fn fd(&self) -> BorrowedFd<'_> {
        self.0.as_fd()
    }

    /// Runs `f` on a new thread that entered the namespace (the thread ends with it).
    pub async fn run<T, F>(&self, f: F) -> io::Result<T>
    where
        T: Send + 'static,
        F: FnOnce() -> io::Result<T> + Send + 'static,
    {
        let ns = self.0.clone();
        let (tx, rx) = tokio::sync::oneshot::channel();
        std::thread::Builder::new()
            .name("egress-netns".into())
            .spawn(move || {
                let r = nix::sched::setns(ns.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET)
                    .map_err(io::Error::from)
                    .and_then(|()| f());
                let _ = tx.send(r);
            })?;
        rx.await
            .map_err(|_| io::Error::other("the namespace thread ended without an answer"))?
    }

    /// A TCP connection to `addr` from inside the namespace, with `TCP_NODELAY`.
    pub async fn connect(&self, addr: SocketAddr, timeout: Duration) -> io::Result<TcpStream> {
        let socket = self
            .run(move || match addr {
                SocketAddr::V4(_) => TcpSocket::new_v4(),
                SocketAddr::V6(_) => TcpSocket::new_v6(),
            })
            .await?;
        socket.set_nodelay(true)?;
        match tokio::time::timeout(timeout, socket.connect(addr)).await {
            Ok(r) => r,
            Err(_) => Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("connecting to {addr} took longer than {timeout:?}"),
            )),
        }
    }

    /// A resolver asking `nameservers` (port 53, UDP then TCP) from inside the namespace.
    pub fn resolver(&self, nameservers: &[Ipv4Addr]) -> io::Result<Resolver<NsRuntime>> {
        let servers = nameservers
            .iter()
            .map(|ip| NameServerConfig::udp_and_tcp((*ip).into()))
            .collect();
        let config = ResolverConfig::from_parts(None, Vec::new(), servers);
        let mut opts = ResolverOpts::default();
        opts.timeout = Duration::from_secs(3);
        opts.attempts = 2;
        let runtime = NsRuntime {
            netns: self.clone(),
            handle: TokioHandle::default(),
        };
        Resolver::builder_with_config(config, runtime)
            .with_options(opts)
            .build()
            .map_err(|e| io::Error::other(e.to_string()))
    }
}

/// The resolver's runtime: Tokio, with every socket made inside the namespace.
#[derive(Clone)]
pub struct NsRuntime {
    netns: Netns,
    handle: TokioHandle,
}

impl RuntimeProvider for NsRuntime {
    type Handle = TokioHandle;
    type Timer = TokioTime;
    type Udp = UdpSocket;
    type Tcp = AsyncIoTokioAsStd<TcpStream>;

    fn create_handle(&self) -> Self::Handle {
        self.handle.clone()
    }

    fn connect_tcp(
        &self,
        server_addr: SocketAddr,
        bind_addr: Option<SocketAddr>,
        timeout: Option<Duration>,
    ) -> Pin<Box<dyn Send + Future<Output = io::Result<Self::Tcp>>>> {
        let ns = self.netns.clone();
        Box::pin(async move {
            if bind_addr.is_some() {
                return Err(io::Error::other(
                    "binding a nameserver connection is not supported",
                ));
            }
            let stream = ns
                .connect(server_addr, timeout.unwrap_or(CONNECT_TIMEOUT))
                .await?;
            Ok(AsyncIoTokioAsStd(stream))
        })
    }

    fn bind_udp(
        &self,
        local_addr: SocketAddr,
        _server_addr: SocketAddr,
    ) -> Pin<Box<dyn Send + Future<Output = io::Result<Self::Udp>>>> {
        let ns = self.netns.clone();
        Box::pin(async move {
            let socket = ns
                .run(move || {
                    let s = std::net::UdpSocket::bind(local_addr)?;
                    s.set_nonblocking(true)?;
                    Ok(s)
                })
                .await?;
            UdpSocket::from_std(socket)
        })
    }
}
