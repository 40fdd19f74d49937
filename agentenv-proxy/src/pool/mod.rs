//! The upstream connection pool of both lanes: keep-alive HTTP/1.1
//! connections to runtime nodes, made with `TCP_NODELAY` and kept idle per
//! node authority.
//!
//! The hyper lane ([`UpstreamPool::send`]) keeps hyper connection handles;
//! the gateway's fast lane keeps raw connections (a TCP stream and its read
//! buffer, `RawConn`). Both live in the same kind of idle stacks (`idle`:
//! per-thread shards, most recently used first), bounded alike,
//! closed alike after the idle timeout by one sweeping task per pool.
//!
//! `https://` nodes are reached over TLS (rustls) and verified against the
//! bundled Mozilla roots, or the roots of a configuration given to the pool.
//!
//! A connection goes back to the pool only once the response body it carried
//! has ended; a body dropped before its end, a failed body and an upgraded
//! connection (`101 Switching Protocols`) are never reused. A connection the
//! node closed is dropped when it is next looked at, and a request that a
//! reused connection could not even start sending is sent again on another.

mod idle;
mod raw;

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::uri::{Authority, Scheme};
use http::{HeaderValue, Request, Response, StatusCode, Uri, header};
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use hyper::client::conn::http1::{self, SendRequest};
use hyper_util::rt::TokioIo;
use rustls::ClientConfig;
use rustls::pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio::time::Instant;
use tokio_rustls::TlsConnector;

use self::idle::{IdleSet, Reusable};
pub(crate) use self::raw::RawConn;
use crate::body::GatewayBody;

/// How the pool keeps connections.
#[derive(Debug, Clone)]
pub struct PoolConfig {
    /// Bounds making a new TCP connection.
    pub connect_timeout: Duration,
    /// An idle connection unused for this long is closed.
    pub idle_timeout: Duration,
    /// Idle connections kept per authority in each shard; more are closed.
    pub max_idle_per_authority: usize,
    /// TLS for `https://` nodes; `None` verifies them against the bundled
    /// Mozilla roots ([`tls_config`] with `webpki_roots`).
    pub tls: Option<Arc<ClientConfig>>,
}

/// A TLS client configuration (HTTP/1.1 over ALPN) that trusts `roots`.
pub fn tls_config(roots: rustls::RootCertStore) -> Arc<ClientConfig> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut cfg = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("the ring provider supports the default TLS versions")
        .with_root_certificates(roots)
        .with_no_client_auth();
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Arc::new(cfg)
}

fn default_tls() -> Arc<ClientConfig> {
    static DEFAULT: OnceLock<Arc<ClientConfig>> = OnceLock::new();
    DEFAULT
        .get_or_init(|| {
            tls_config(rustls::RootCertStore {
                roots: webpki_roots::TLS_SERVER_ROOTS.to_vec(),
            })
        })
        .clone()
}

impl Default for PoolConfig {
    fn default() -> Self {
        Self {
            connect_timeout: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(90),
            max_idle_per_authority: 128,
            tls: None,
        }
    }
}

/// Why a request could not be exchanged with a node.
#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    #[error("upstream URI {0} is not an absolute http:// or https:// URI")]
    UnsupportedUri(Uri),
    #[error("{0} is not a valid TLS server name")]
    ServerName(Authority),
    #[error("TLS handshake with {authority} failed: {source}")]
    Tls {
        authority: Authority,
        #[source]
        source: std::io::Error,
    },
    #[error("connecting to {authority} failed: {source}")]
    Connect {
        authority: Authority,
        #[source]
        source: std::io::Error,
    },
    #[error("connecting to {0} timed out")]
    ConnectTimeout(Authority),
    #[error("HTTP/1.1 handshake with {authority} failed: {source}")]
    Handshake {
        authority: Authority,
        #[source]
        source: hyper::Error,
    },
    #[error("exchange with {authority} failed: {source}")]
    Exchange {
        authority: Authority,
        #[source]
        source: hyper::Error,
    },
}

/// Keep-alive HTTP/1.1 connections to upstream nodes, for both lanes.
/// Cheap to clone; clones share the connections.
#[derive(Clone)]
pub struct UpstreamPool {
    inner: Arc<PoolInner>,
}

struct PoolInner {
    cfg: PoolConfig,
    /// The hyper lane's connections to `http://` nodes.
    plain: IdleSet<SendRequest<GatewayBody>>,
    /// The hyper lane's connections to `https://` nodes.
    tls: IdleSet<SendRequest<GatewayBody>>,
    /// The fast lane's connections (`http://` nodes only).
    raw: IdleSet<RawConn>,
    reaper_started: AtomicBool,
}

/// Where a hyper-lane connection goes: the authority, and whether over TLS.
struct Key {
    tls: bool,
    authority: Authority,
}

impl Reusable for SendRequest<GatewayBody> {
    fn is_ready(&self) -> bool {
        SendRequest::is_ready(self)
    }

    fn is_closed(&self) -> bool {
        SendRequest::is_closed(self)
    }
}

impl UpstreamPool {
    /// A pool with one shard per available CPU.
    pub fn new(cfg: PoolConfig) -> Self {
        let shards = std::thread::available_parallelism().map_or(1, |n| n.get());
        Self::with_shards(cfg, shards)
    }

    /// A pool with `shards` shards (at least one).
    pub fn with_shards(cfg: PoolConfig, shards: usize) -> Self {
        let (timeout, max) = (cfg.idle_timeout, cfg.max_idle_per_authority);
        Self {
            inner: Arc::new(PoolInner {
                plain: IdleSet::new(shards, timeout, max),
                tls: IdleSet::new(shards, timeout, max),
                raw: IdleSet::new(shards, timeout, max),
                cfg,
                reaper_started: AtomicBool::new(false),
            }),
        }
    }

    /// The pool's configuration.
    pub fn config(&self) -> &PoolConfig {
        &self.inner.cfg
    }

    /// Idle connections to `authority` (plain and TLS, of both lanes)
    /// across all shards, closed ones that were not looked at yet included.
    pub fn idle_count(&self, authority: &str) -> usize {
        let Ok(authority) = authority.parse::<Authority>() else {
            return 0;
        };
        let inner = &self.inner;
        inner.plain.count(&authority) + inner.tls.count(&authority) + inner.raw.count(&authority)
    }

    /// Sends `req` (an absolute `http://` URI) to its authority over a pooled
    /// connection, or a new one. The request goes out in origin form; a
    /// request without `Host` gets the authority's.
    pub async fn send(
        &self,
        mut req: Request<GatewayBody>,
    ) -> Result<Response<PooledBody>, PoolError> {
        let uri = std::mem::take(req.uri_mut());
        let mut parts = uri.into_parts();
        let key = match (&parts.scheme, parts.authority.take()) {
            (Some(s), Some(authority)) if *s == Scheme::HTTP || *s == Scheme::HTTPS => Key {
                tls: *s == Scheme::HTTPS,
                authority,
            },
            (_, authority) => {
                parts.authority = authority;
                let uri = Uri::from_parts(parts).unwrap_or_default();
                return Err(PoolError::UnsupportedUri(uri));
            }
        };
        parts.scheme = None;
        if parts.path_and_query.is_none() {
            parts.path_and_query = Some(http::uri::PathAndQuery::from_static("/"));
        }
        *req.uri_mut() = Uri::from_parts(parts).expect("a path alone is an origin-form URI");
        if !req.headers().contains_key(header::HOST)
            && let Ok(v) = HeaderValue::from_str(key.authority.as_str())
        {
            req.headers_mut().insert(header::HOST, v);
        }

        while let Some(mut sender) = self
            .inner
            .http(key.tls)
            .checkout(&key.authority, Instant::now())
        {
            match sender.try_send_request(req).await {
                Ok(resp) => return Ok(self.wrap(resp, sender, key)),
                Err(mut e) => match e.take_message() {
                    // The connection closed before the request went out:
                    // nothing was sent, so another connection may take it.
                    Some(back) => {
                        tracing::debug!(authority = %key.authority, error = %e.error(), "pooled connection was closed; retrying on another");
                        req = back;
                    }
                    None => {
                        return Err(PoolError::Exchange {
                            authority: key.authority,
                            source: e.into_error(),
                        });
                    }
                },
            }
        }
        // Connecting is the rare path: boxed, so its state does not weigh on
        // every request's future.
        let mut sender = Box::pin(self.connect(&key)).await?;
        match sender.send_request(req).await {
            Ok(resp) => Ok(self.wrap(resp, sender, key)),
            Err(source) => Err(PoolError::Exchange {
                authority: key.authority,
                source,
            }),
        }
    }

    async fn connect(&self, key: &Key) -> Result<SendRequest<GatewayBody>, PoolError> {
        let authority = &key.authority;
        let timeout = self.inner.cfg.connect_timeout;
        let stream = match dial(authority, key.tls, timeout).await {
            Ok(Ok(s)) => s,
            Ok(Err(source)) => {
                return Err(PoolError::Connect {
                    authority: authority.clone(),
                    source,
                });
            }
            Err(_) => return Err(PoolError::ConnectTimeout(authority.clone())),
        };
        if !key.tls {
            return handshake(stream, authority).await;
        }
        let name = ServerName::try_from(host(authority).to_string())
            .map_err(|_| PoolError::ServerName(authority.clone()))?;
        let tls = self.inner.cfg.tls.clone().unwrap_or_else(default_tls);
        let stream = match tokio::time::timeout(
            timeout,
            TlsConnector::from(tls).connect(name, stream),
        )
        .await
        {
            Ok(Ok(s)) => s,
            Ok(Err(source)) => {
                return Err(PoolError::Tls {
                    authority: authority.clone(),
                    source,
                });
            }
            Err(_) => return Err(PoolError::ConnectTimeout(authority.clone())),
        };
        handshake(stream, authority).await
    }

    fn wrap(
        &self,
        resp: Response<Incoming>,
        sender: SendRequest<GatewayBody>,
        key: Key,
    ) -> Response<PooledBody> {
        // An upgraded connection belongs to the upgrade from now on.
        let reusable = resp.status() != StatusCode::SWITCHING_PROTOCOLS;
        let mut slot = reusable.then(|| Slot {
            pool: Arc::downgrade(&self.inner),
            key,
            sender,
        });
        if resp.body().is_end_stream()
            && let Some(slot) = slot.take()
        {
            slot.release();
        }
        resp.map(|inner| PooledBody { inner, slot })
    }
}

/// The host of `authority`, without the brackets of an IPv6 address.
fn host(authority: &Authority) -> &str {
    let host = authority.host();
    host.strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host)
}

/// A TCP connection to `authority` (port 80, or 443 for TLS, when it names
/// none) with `TCP_NODELAY`; `Err` when `timeout` passed first.
async fn dial(
    authority: &Authority,
    tls: bool,
    timeout: Duration,
) -> Result<std::io::Result<TcpStream>, tokio::time::error::Elapsed> {
    let port = authority.port_u16().unwrap_or(if tls { 443 } else { 80 });
    let connected =
        tokio::time::timeout(timeout, TcpStream::connect((host(authority), port))).await;
    if let Ok(Ok(stream)) = &connected
        && let Err(e) = stream.set_nodelay(true)
    {
        tracing::debug!(error = %e, "setting TCP_NODELAY on an upstream connection failed");
    }
    connected
}

/// HTTP/1.1 over `io`; the connection is driven by a task of its own.
async fn handshake<T>(io: T, authority: &Authority) -> Result<SendRequest<GatewayBody>, PoolError>
where
    T: AsyncRead + AsyncWrite + Send + Unpin + 'static,
{
    let (sender, conn) = http1::Builder::new()
        .handshake(TokioIo::new(io))
        .await
        .map_err(|source| PoolError::Handshake {
            authority: authority.clone(),
            source,
        })?;
    let authority = authority.clone();
    tokio::spawn(async move {
        if let Err(e) = conn.with_upgrades().await {
            tracing::debug!(%authority, error = %e, "upstream connection ended with an error");
        }
    });
    Ok(sender)
}

impl PoolInner {
    /// The hyper lane's idle connections, plain or TLS.
    fn http(&self, tls: bool) -> &IdleSet<SendRequest<GatewayBody>> {
        if tls { &self.tls } else { &self.plain }
    }

    /// Closes idle connections, of both lanes, that expired or that the
    /// node closed.
    fn evict_stale(&self, now: Instant) {
        self.plain.evict_stale(now);
        self.tls.evict_stale(now);
        self.raw.evict_stale(now);
    }

    /// Starts the task that closes expired idle connections, once there
    /// are idle connections to close.
    fn start_reaper(self: &Arc<Self>) {
        if self.reaper_started.load(Ordering::Relaxed) {
            return;
        }
        // A body may be dropped outside any runtime: the reaper then starts
        // with a later release.
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if self.reaper_started.swap(true, Ordering::Relaxed) {
            return;
        }
        let period = (self.cfg.idle_timeout / 2).max(Duration::from_millis(100));
        let weak = Arc::downgrade(self);
        runtime.spawn(async move {
            let mut tick = tokio::time::interval(period);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let Some(inner) = weak.upgrade() else { return };
                inner.evict_stale(Instant::now());
            }
        });
    }
}

/// A connection on loan to one response body.
struct Slot {
    pool: Weak<PoolInner>,
    key: Key,
    sender: SendRequest<GatewayBody>,
}

impl Slot {
    fn release(self) {
        let Some(inner) = self.pool.upgrade() else {
            return;
        };
        let idle = inner.http(self.key.tls);
        idle.release(&self.key.authority, self.sender, Instant::now());
        inner.start_reaper();
    }
}

/// A response body from the pool: when it ends, its connection goes back to
/// the pool; dropped before its end, the connection is closed.
pub struct PooledBody {
    inner: Incoming,
    slot: Option<Slot>,
}

impl Body for PooledBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = &mut *self;
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(None) => {
                if let Some(slot) = this.slot.take() {
                    slot.release();
                }
            }
            Poll::Ready(Some(Ok(_))) if this.inner.is_end_stream() => {
                if let Some(slot) = this.slot.take() {
                    slot.release();
                }
            }
            Poll::Ready(Some(Err(_))) => this.slot = None,
            _ => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl std::fmt::Debug for PooledBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PooledBody")
            .field("returns_connection", &self.slot.is_some())
            .finish_non_exhaustive()
    }
}

impl Drop for PooledBody {
    fn drop(&mut self) {
        if let Some(slot) = self.slot.take()
            && self.inner.is_end_stream()
        {
            slot.release();
        }
    }
}
