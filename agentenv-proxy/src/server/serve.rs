//! Serving: listeners, one task per client connection (the fast lane, then
//! hyper), per-thread serving, and shutdown with a grace period.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::pin;
use std::time::Duration;

use hyper_util::rt::TokioIo;
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::sync::watch;

use super::{Gateway, SHUTDOWN_GRACE};

impl Gateway {
    /// Serves HTTP/1.1 and HTTP/2 (cleartext) on `listener` until
    /// `shutdown` resolves, then waits up to [`SHUTDOWN_GRACE`] for
    /// in-flight requests. Relayed WebSockets are not waited for.
    ///
    /// Ordinary HTTP/1.1 requests routed by sandbox id go through a fast
    /// lane that relays heads and bodies without building hyper messages;
    /// a connection's first request that does not qualify (HTTP/2,
    /// upgrades, streams, creates, lists, errors…) hands the connection to
    /// the same hyper service [`Gateway::service`] provides. Both answer
    /// alike; the fast lane only costs less CPU per request.
    pub async fn serve(&self, listener: TcpListener, shutdown: impl Future<Output = ()>) {
        // Every connection holds a receiver: the sender sees them all gone.
        let (stop_tx, stop_rx) = watch::channel(false);
        let mut shutdown = pin!(shutdown);
        loop {
            let (stream, remote) = tokio::select! {
                _ = &mut shutdown => break,
                accepted = listener.accept() => match accepted {
                    Ok(a) => a,
                    Err(e) => {
                        tracing::warn!(error = %e, "accepting a connection failed");
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        continue;
                    }
                },
            };
            if let Err(e) = stream.set_nodelay(true) {
                tracing::debug!(error = %e, "setting TCP_NODELAY failed");
            }
            let admitted = match self.inner.admission.admit(remote.ip()) {
                Ok(a) => a,
                Err(why) => {
                    tracing::debug!(%remote, ?why, "connection refused: at the connection limit");
                    tokio::spawn(super::admission::refuse(stream, why));
                    continue;
                }
            };
            let guard = self.inner.metrics.connection_guard();
            let gateway = self.clone();
            let stop = stop_rx.clone();
            tokio::spawn(async move {
                let _guard = guard;
                let _admitted = admitted;
                gateway.serve_connection(stream, remote, stop).await;
            });
        }
        drop(listener);
        drop(stop_rx);
        let _ = stop_tx.send(true);
        tokio::select! {
            _ = stop_tx.closed() => {}
            _ = tokio::time::sleep(SHUTDOWN_GRACE) => {
                tracing::warn!("shutdown grace period over; closing remaining connections");
            }
        }
    }

    /// Serves on `addr` from `threads` OS threads, each running a
    /// single-threaded runtime with its own `SO_REUSEPORT` listener and its
    /// own upstream pool, so a request is handled start to finish on one
    /// thread without cross-thread wake-ups. `shutdown` is awaited on the
    /// caller's runtime; then every thread drains as in [`Gateway::serve`].
    /// Must be called from within a tokio runtime.
    pub fn serve_threads(
        &self,
        addr: SocketAddr,
        threads: usize,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> std::io::Result<ServeHandle> {
        let threads = threads.max(1);
        let first = reuseport_socket(addr)?;
        let local_addr = first.local_addr()?;
        let mut sockets = vec![first];
        for _ in 1..threads {
            sockets.push(reuseport_socket(local_addr)?);
        }
        // Listen now, so the address accepts connections when this returns;
        // each thread then drives its listener on its own runtime.
        let listeners = sockets
            .into_iter()
            .map(|s| s.listen(4096).and_then(|l| l.into_std()))
            .collect::<std::io::Result<Vec<_>>>()?;
        let (stop_tx, stop_rx) = watch::channel(false);
        tokio::spawn(async move {
            shutdown.await;
            let _ = stop_tx.send(true);
        });
        let mut handles = Vec::with_capacity(threads);
        for (i, listener) in listeners.into_iter().enumerate() {
            let gateway = self.with_own_pool();
            let mut stop = stop_rx.clone();
            let handle = std::thread::Builder::new()
                .name(format!("gateway-{i}"))
                .spawn(move || {
                    let rt = match tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                    {
                        Ok(rt) => rt,
                        Err(e) => {
                            tracing::error!(error = %e, "cannot start a gateway runtime thread");
                            return;
                        }
                    };
                    rt.block_on(async move {
                        let listener = match TcpListener::from_std(listener) {
                            Ok(l) => l,
                            Err(e) => {
                                tracing::error!(error = %e, "cannot listen");
                                return;
                            }
                        };
                        gateway
                            .serve(listener, async move {
                                let _ = stop.wait_for(|s| *s).await;
                            })
                            .await;
                    });
                })?;
            handles.push(handle);
        }
        Ok(ServeHandle {
            local_addr,
            handles,
        })
    }

    /// Serves one client connection: the fast lane while its requests
    /// qualify, then hyper. Ends early, between requests, once `stop` is
    /// set. A TLS connection takes the same path once its handshake is done,
    /// unless it chose HTTP/2 by ALPN (hyper's from the start).
    async fn serve_connection(
        &self,
        stream: TcpStream,
        remote: SocketAddr,
        mut stop: watch::Receiver<bool>,
    ) {
        let header_timeout = self.inner.opts.limits.header_timeout;
        let Some(acceptor) = &self.tls else {
            let Some(io) = self
                .fast_lane()
                .serve(stream, remote, false, &mut stop)
                .await
            else {
                return;
            };
            self.serve_hyper(TokioIo::new(io), remote, false, stop)
                .await;
            return;
        };
        // The handshake counts against the header timeout.
        let tls = match tokio::time::timeout(header_timeout, acceptor.accept(stream)).await {
            Ok(Ok(tls)) => tls,
            Ok(Err(e)) => {
                tracing::debug!(error = %e, %remote, "TLS handshake failed");
                return;
            }
            Err(_) => {
                tracing::debug!(%remote, "TLS handshake timed out");
                return;
            }
        };
        if tls.get_ref().1.alpn_protocol() == Some(b"h2") {
            self.serve_hyper(TokioIo::new(tls), remote, true, stop)
                .await;
            return;
        }
        let Some(io) = self.fast_lane().serve(tls, remote, true, &mut stop).await else {
            return;
        };
        self.serve_hyper(TokioIo::new(io), remote, true, stop).await;
    }

    /// Serves the rest of a client connection with hyper (`tls`: the
    /// connection is a TLS one).
    async fn serve_hyper<I>(
        &self,
        io: I,
        remote: SocketAddr,
        tls: bool,
        mut stop: watch::Receiver<bool>,
    ) where
        I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
    {
        // The header timeout also bounds how long a connection (HTTP/2 included) is
        // kept without a request in flight.
        let idle = self.inner.opts.limits.header_timeout;
        let builder = agentenv_core::serving::server_builder(idle);
        let service = if tls {
            self.service_tls(remote)
        } else {
            self.service(remote)
        };
        let stopping = async move {
            let _ = stop.wait_for(|s| *s).await;
        };
        let result =
            agentenv_core::serving::serve_connection(&builder, io, service, idle, stopping).await;
        if let Err(e) = result {
            tracing::debug!(error = %e, %remote, "client connection ended with an error");
        }
    }
}

/// A TCP socket bound to `bind` with `SO_REUSEADDR`, `SO_REUSEPORT` and
/// `TCP_NODELAY`.
fn reuseport_socket(bind: SocketAddr) -> std::io::Result<TcpSocket> {
    let s = if bind.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    s.set_reuseaddr(true)?;
    s.set_reuseport(true)?;
    s.set_nodelay(true)?;
    s.bind(bind)?;
    Ok(s)
}

/// The threads started by [`Gateway::serve_threads`].
pub struct ServeHandle {
    local_addr: SocketAddr,
    handles: Vec<std::thread::JoinHandle<()>>,
}

impl ServeHandle {
    /// The address the gateway listens on (useful after binding port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Waits until every serving thread has drained and stopped.
    pub async fn wait(self) {
        let _ = tokio::task::spawn_blocking(move || {
            for h in self.handles {
                let _ = h.join();
            }
        })
        .await;
    }
}
