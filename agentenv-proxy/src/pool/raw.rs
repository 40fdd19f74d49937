//! The fast lane's connections in the pool: a plain TCP stream to an
//! `http://` node and the bytes read from it, written and read by the
//! gateway's own HTTP/1.1 code instead of hyper's.

use std::io;

use bytes::BytesMut;
use http::uri::Authority;
use tokio::net::TcpStream;
use tokio::time::Instant;

use super::idle::Reusable;
use super::{UpstreamPool, dial};

/// A connection to a node, for the fast lane.
pub(crate) struct RawConn {
    pub(crate) stream: TcpStream,
    /// Bytes read from the node and not yet consumed.
    pub(crate) buf: BytesMut,
}

impl Reusable for RawConn {
    /// Whether the node closed it shows only when it is used: a request
    /// that finds it closed before any answer is sent again on a new one.
    fn is_ready(&self) -> bool {
        true
    }

    fn is_closed(&self) -> bool {
        false
    }
}

impl UpstreamPool {
    /// The most recently used idle fast-lane connection to `authority` that
    /// has not timed out at `now`.
    pub(crate) fn checkout_raw(&self, authority: &Authority, now: Instant) -> Option<RawConn> {
        self.inner.raw.checkout(authority, now)
    }

    /// Keeps a fast-lane connection whose exchange ended cleanly at `now`.
    pub(crate) fn release_raw(&self, authority: &Authority, conn: RawConn, now: Instant) {
        self.inner.raw.release(authority, conn, now);
        self.inner.start_reaper();
    }

    /// A new fast-lane connection to the `http://` node at `authority`.
    pub(crate) async fn connect_raw(&self, authority: &Authority) -> io::Result<RawConn> {
        let stream = dial(authority, false, self.inner.cfg.connect_timeout)
            .await
            .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "connect timed out"))??;
        Ok(RawConn {
            stream,
            buf: BytesMut::with_capacity(8 * 1024),
        })
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::pool::PoolConfig;

    #[tokio::test]
    async fn idle_node_connections_past_the_timeout_are_closed() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let accept = tokio::spawn(async move {
            let mut held = Vec::new();
            for _ in 0..2 {
                held.push(listener.accept().await.unwrap());
            }
            held
        });
        let pool = UpstreamPool::new(PoolConfig {
            idle_timeout: Duration::from_millis(100),
            ..PoolConfig::default()
        });
        let node: Authority = addr.to_string().parse().unwrap();
        let (gone, live) = (Authority::from_static("gone:80"), node.clone());
        let t0 = Instant::now();
        pool.release_raw(&gone, pool.connect_raw(&node).await.unwrap(), t0);
        assert_eq!(pool.idle_count("gone:80"), 1);
        // Past the timeout, a sweep closes it (nodes that are gone are
        // never checked out again).
        let later = t0 + Duration::from_millis(150);
        pool.release_raw(&live, pool.connect_raw(&node).await.unwrap(), later);
        pool.inner.evict_stale(later);
        assert_eq!(pool.idle_count("gone:80"), 0);
        assert!(pool.checkout_raw(&gone, later).is_none());
        assert!(pool.checkout_raw(&live, later).is_some());
        drop(accept.await.unwrap());
    }
}
