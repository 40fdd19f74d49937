//! The upstream connection pool: HTTP/1.1 keep-alive connections to runtime
//! nodes, made with `TCP_NODELAY` and kept idle per node authority.
//!
//! Idle connections live in shards, one per thread that uses the pool (a
//! thread picks its shard once), so a request takes and returns connections
//! under a lock no other thread touches; only when its own shard has none
//! does it look into the others', without waiting on their locks. Each shard keeps, per authority, a
//! stack of idle connections: the most recently used one is reused first,
//! and the oldest ones are the first to go when the stack is full or they
//! stayed idle longer than the idle timeout.
//!
//! `https://` nodes are reached over TLS (rustls) and verified against the
//! bundled Mozilla roots, or the roots of a configuration given to the pool.
//!
//! A connection goes back to the pool only once the response body it carried
//! has ended; a body dropped before its end, a failed body and an upgraded
//! connection (`101 Switching Protocols`) are never reused. A connection the
//! node closed is dropped when it is next looked at, and a request that a
//! reused connection could not even start sending is sent again on another.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
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
use parking_lot::Mutex;
use rustls::ClientConfig;
use rustls::pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio::time::Instant;
use tokio_rustls::TlsConnector;

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

/// Keep-alive HTTP/1.1 connections to upstream nodes. Cheap to clone; clones
/// share the connections.
#[derive(Clone)]
pub struct UpstreamPool {
    inner: Arc<PoolInner>,
}

struct PoolInner {
    cfg: PoolConfig,
    shards: Box<[Mutex<Shard>]>,
    reaper_started: AtomicBool,
}

/// Where connections go: the authority, and whether over TLS.
#[derive(Clone, PartialEq, Eq, Hash)]
struct Key {
    tls: bool,
    authority: Authority,
}

#[derive(Default)]
struct Shard {
    /// Keyed by node authorities from the scheduler's configuration, not by
    /// client input: a fast hash is enough.
    idle: HashMap<Key, Vec<IdleConn>, rustc_hash::FxBuildHasher>,
}

struct IdleConn {
    sender: SendRequest<GatewayBody>,
    since: Instant,
}

/// Where a thread keeps its idle connections: threads are numbered on first
/// use and take shard `number % shards`.
fn thread_number() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static NUMBER: usize = NEXT.fetch_add(1, Ordering::Relaxed);
    }
    NUMBER.with(|n| *n)
}

impl UpstreamPool {
    /// A pool with one shard per available CPU.
    pub fn new(cfg: PoolConfig) -> Self {
        let shards = std::thread::available_parallelism().map_or(1, |n| n.get());
        Self::with_shards(cfg, shards)
    }

    /// A pool with `shards` shards (at least one).
    pub fn with_shards(cfg: PoolConfig, shards: usize) -> Self {
        Self {
            inner: Arc::new(PoolInner {
                cfg,
                shards: (0..shards.max(1)).map(|_| Mutex::default()).collect(),
                reaper_started: AtomicBool::new(false),
            }),
        }
    }

    /// The pool's configuration.
    pub fn config(&self) -> &PoolConfig {
        &self.inner.cfg
    }

    /// Idle connections to `authority` (plain and TLS) across all shards,
    /// closed ones that were not looked at yet included.
    pub fn idle_count(&self, authority: &str) -> usize {
        let Ok(authority) = authority.parse::<Authority>() else {
            return 0;
        };
        self.inner
            .shards
            .iter()
            .map(|s| {
                let shard = s.lock();
                [false, true]
                    .into_iter()
                    .map(|tls| {
                        let key = Key {
                            tls,
                            authority: authority.clone(),
                        };
                        shard.idle.get(&key).map_or(0, Vec::len)
                    })
                    .sum::<usize>()
            })
            .sum()
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

        while let Some(mut sender) = self.checkout(&key) {
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

    /// The most recently used idle connection that can take a request now:
    /// from this thread's shard, else (without waiting on a lock) from
    /// another thread's.
    fn checkout(&self, key: &Key) -> Option<SendRequest<GatewayBody>> {
        let now = Instant::now();
        let shards = &self.inner.shards;
        let own = thread_number() % shards.len();
        if let Some(sender) = self.take_idle(&mut shards[own].lock(), key, now) {
            return Some(sender);
        }
        (1..shards.len())
            .map(|i| &shards[(own + i) % shards.len()])
            .find_map(|shard| self.take_idle(&mut *shard.try_lock()?, key, now))
    }

    fn take_idle(
        &self,
        shard: &mut Shard,
        key: &Key,
        now: Instant,
    ) -> Option<SendRequest<GatewayBody>> {
        let stack = shard.idle.get_mut(key)?;
        while let Some(conn) = stack.pop() {
            if now.saturating_duration_since(conn.since) >= self.inner.cfg.idle_timeout {
                // Everything below is older still.
                stack.clear();
                break;
            }
            if conn.sender.is_ready() {
                return Some(conn.sender);
            }
            // Closed by the node, or not (yet) able to take a request:
            // dropping the sender closes the connection once it is idle.
        }
        None
    }

    async fn connect(&self, key: &Key) -> Result<SendRequest<GatewayBody>, PoolError> {
        let authority = &key.authority;
        let host = authority.host();
        let host = host
            .strip_prefix('[')
            .and_then(|h| h.strip_suffix(']'))
            .unwrap_or(host);
        let port = authority
            .port_u16()
            .unwrap_or(if key.tls { 443 } else { 80 });
        let stream = match tokio::time::timeout(
            self.inner.cfg.connect_timeout,
            TcpStream::connect((host, port)),
        )
        .await
        {
            Ok(Ok(s)) => s,
            Ok(Err(source)) => {
                return Err(PoolError::Connect {
                    authority: authority.clone(),
                    source,
                });
            }
            Err(_) => return Err(PoolError::ConnectTimeout(authority.clone())),
        };
        if let Err(e) = stream.set_nodelay(true) {
            tracing::debug!(error = %e, "setting TCP_NODELAY on an upstream connection failed");
        }
        if !key.tls {
            return handshake(stream, authority).await;
        }
        let name = ServerName::try_from(host.to_string())
            .map_err(|_| PoolError::ServerName(authority.clone()))?;
        let tls = self.inner.cfg.tls.clone().unwrap_or_else(default_tls);
        let stream = match tokio::time::timeout(
            self.inner.cfg.connect_timeout,
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

    fn start_reaper(inner: &Arc<PoolInner>) {
        // A body may be dropped outside any runtime: the reaper then starts
        // with a later release.
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if inner.reaper_started.swap(true, Ordering::Relaxed) {
            return;
        }
        let period = (inner.cfg.idle_timeout / 2).max(Duration::from_millis(100));
        let weak = Arc::downgrade(inner);
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
    /// Closes idle connections that expired or that the node closed.
    fn evict_stale(&self, now: Instant) {
        for shard in self.shards.iter() {
            shard.lock().idle.retain(|_, stack| {
                stack.retain(|c| {
                    now.saturating_duration_since(c.since) < self.cfg.idle_timeout
                        && !c.sender.is_closed()
                });
                !stack.is_empty()
            });
        }
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
        if self.sender.is_closed() {
            return;
        }
        let conn = IdleConn {
            sender: self.sender,
            since: Instant::now(),
        };
        let shard = &inner.shards[thread_number() % inner.shards.len()];
        {
            let mut shard = shard.lock();
            let stack = shard.idle.entry(self.key).or_default();
            if stack.len() >= inner.cfg.max_idle_per_authority {
                // Full: the oldest idle connection makes room.
                stack.remove(0);
            }
            stack.push(conn);
        }
        if !inner.reaper_started.load(Ordering::Relaxed) {
            UpstreamPool::start_reaper(&inner);
        }
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
