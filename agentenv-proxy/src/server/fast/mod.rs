//! The HTTP/1.1 fast lane of [`Gateway::serve`](super::Gateway::serve).
//!
//! hyper turns every message into a `Request` or `Response` (a `HeaderMap`
//! of owned names and values) and serializes it again on the other side;
//! for an ordinary proxied request that is most of the gateway's work. Here
//! the request head is parsed in place (httparse), routed by the same
//! [`Router::decide`] as the hyper path, and written to the node byte for
//! byte with the hop-by-hop and forwarding headers rewritten; the response
//! head is rewritten the same way and the bodies are relayed by their
//! framing (`Content-Length`, chunked, or until the node closes).
//!
//! A request qualifies when it is HTTP/1.1 in origin form, has no body or a
//! `Content-Length` one, is not an upgrade, a stream (gRPC, Connect
//! streams, SSE, `Te`), an `Expect`, a create, fork or list, and goes by
//! its sandbox id to a plain `http://` node. The first request that does
//! not qualify hands the connection, with the bytes already read, to hyper
//! for the rest of its life; so do HTTP/2 connections and malformed heads.
//!
//! Its rooms, as Pingora splits its HTTP/1 code: `downstream` (the client
//! connection: reading requests, one request end to end, the gateway's own
//! answers, the handover to hyper), `upstream` (the node connection:
//! writing the request, reading the answer, the stale-connection retry),
//! `head` (parsing and rewriting request and response heads), `framing`
//! (relaying bodies by their framing, the chunk scanner). What it uses of
//! the gateway is [`FastLane`]; node connections come from the pool both
//! lanes share.

mod downstream;
mod framing;
mod head;
mod upstream;

use std::pin::Pin;
use std::time::Duration;

use agentenv_core::proto::scheduler_v1 as pb;
use bytes::BytesMut;
use http::HeaderValue;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::time::{Instant, Sleep};
use tonic::Status;

use crate::client::SchedulerClient;
use crate::metrics::GatewayMetrics;
use crate::pool::UpstreamPool;
use crate::route_cache::RouteCache;
use crate::server::observe_rpc;
use crate::server::route::Router;

/// What the fast lane uses of the gateway, borrowed for one client
/// connection.
pub(super) struct FastLane<'g> {
    /// Host routes, the API key and the routing decision.
    pub(super) router: &'g Router,
    /// Where sandboxes are looked up.
    pub(super) scheduler: &'g dyn SchedulerClient,
    /// Kept sandbox routes, when the gateway keeps them.
    pub(super) routes: Option<&'g RouteCache>,
    pub(super) metrics: &'g GatewayMetrics,
    /// Node connections (the pool both lanes share).
    pub(super) pool: &'g UpstreamPool,
    /// Bounds the lookup and the whole exchange with the node.
    pub(super) request_timeout: Duration,
    /// How long a client may take to send a request head (from the connection's
    /// start or the end of the previous response).
    pub(super) header_timeout: Duration,
    /// Adds `x-agentenv-node-id` to responses.
    pub(super) debug_mode: bool,
}

impl FastLane<'_> {
    /// The node that holds sandbox `id`, before `timer` (the request's)
    /// elapses.
    async fn lookup_node(&self, id: &str, timer: Pin<&mut Sleep>) -> Result<pb::Node, Status> {
        if let Some(node) = self.routes.and_then(|r| r.get(id)) {
            self.metrics.count_route_lookup(true);
            return Ok(node);
        }
        let start = Instant::now();
        let result = match downstream::within(timer, self.scheduler.lookup_node(id)).await {
            Ok(r) => r,
            Err(()) => Err(Status::deadline_exceeded(
                "scheduler call exceeded the request timeout",
            )),
        };
        observe_rpc(self.metrics, "LookupNode", &result, start);
        if let Some(r) = self.routes {
            self.metrics.count_route_lookup(false);
            if let Ok(n) = &result {
                r.put(id, n);
            }
        }
        result
    }

    /// Drops sandbox `id`'s kept route (its node lost it or could not be reached, or
    /// it was deleted).
    fn forget_route(&self, id: Option<&str>) {
        if let (Some(r), Some(id)) = (self.routes, id) {
            r.forget(id);
        }
    }
}

/// What a client connection of the fast lane can be: a TCP stream, or a TLS
/// stream over one (the gateway's TLS listener).
pub(in crate::server) trait ClientIo:
    AsyncRead + AsyncWrite + Unpin + Send + 'static
{
}

impl<T: AsyncRead + AsyncWrite + Unpin + Send + 'static> ClientIo for T {}

/// A client connection and the buffers reused by its requests.
struct Client<S> {
    stream: S,
    /// Bytes read and not yet consumed.
    buf: BytesMut,
    /// The head being written (upstream request, then client response).
    out: Vec<u8>,
    /// The upstream request target and line.
    target: String,
    line: Vec<u8>,
    /// `X-Forwarded-For` and `X-Forwarded-Proto` of this connection.
    peer: Peer,
}

/// What the upstream is told of the client connection.
pub(super) struct Peer {
    /// `X-Forwarded-For`: the client's address.
    pub(super) xff: HeaderValue,
    /// The connection is TLS: `X-Forwarded-Proto: https`.
    pub(super) tls: bool,
}

impl Peer {
    /// `X-Forwarded-Proto`.
    pub(super) fn proto(&self) -> &'static [u8] {
        if self.tls { b"https" } else { b"http" }
    }
}
