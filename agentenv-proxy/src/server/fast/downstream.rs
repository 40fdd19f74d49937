//! The client side of the fast lane: reading requests off a client
//! connection, each one end to end (lookup, exchange with the node, the
//! response relayed), the gateway's own answers, and the handover of the
//! connection to hyper.

use std::future::Future;
use std::io::{self, IoSlice};
use std::net::SocketAddr;
use std::pin::{Pin, pin};
use std::task::{Context, Poll};

use bytes::{Buf, Bytes, BytesMut};
use http::{Method, Response, StatusCode};
use http_body_util::BodyExt;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::sync::watch;
use tokio::time::{Instant, Sleep, sleep_until};

use super::framing::{Framing, read_more, relay_body};
use super::head::{Analysis, Expect, IdSpan, MAX_HEAD, Plan, analyze, own_answer_head};
use super::upstream::{ExchangeError, exchange, request_line};
use super::{Client, ClientIo, FastLane, Peer};
use crate::body::{GatewayBody, error_response};
use crate::forward::{Endpoint, format_ip};
use crate::metrics::{RequestLabels, UpstreamLabels};
use crate::routing::{method_label, status_label};
use crate::server::{scheduler_error, upstream_unavailable};

/// How the fast lane left a connection.
enum Lane {
    /// Closed (or to be closed): nothing more to do.
    Closed,
    /// A request that the fast lane does not take: hyper serves the rest.
    Handover,
}

impl FastLane<'_> {
    /// Serves a client connection while its requests qualify; ends early,
    /// between requests, once `stop` is set. `None`: the connection is
    /// done with; else hyper serves the rest of it, starting with the bytes
    /// already read.
    /// `tls`: the connection is a TLS one (`X-Forwarded-Proto: https`).
    pub(in crate::server) async fn serve<S: ClientIo>(
        &self,
        stream: S,
        remote: SocketAddr,
        tls: bool,
        stop: &mut watch::Receiver<bool>,
    ) -> Option<Rewound<S>> {
        let mut client = Client {
            stream,
            buf: BytesMut::with_capacity(8 * 1024),
            out: Vec::with_capacity(1024),
            target: String::with_capacity(128),
            line: Vec::with_capacity(160),
            peer: Peer {
                xff: format_ip(remote.ip().to_canonical()),
                tls,
            },
        };
        match self.requests(&mut client, stop).await {
            Lane::Closed => None,
            Lane::Handover => Some(Rewound {
                prefix: client.buf.freeze(),
                inner: client.stream,
            }),
        }
    }

    /// Reads requests and relays each one, until the connection ends or a
    /// request is not the fast lane's.
    async fn requests<S: ClientIo>(
        &self,
        c: &mut Client<S>,
        stop: &mut watch::Receiver<bool>,
    ) -> Lane {
        // Two timers for the life of the connection, moved on with each
        // request: the head's and the request's. Their deadlines only move
        // later, so moving them is a compare-and-swap, not a new timer.
        let mut ended = Instant::now();
        let mut head_timer = pin!(sleep_until(ended + self.header_timeout));
        let mut request_timer = pin!(sleep_until(ended + self.request_timeout));
        loop {
            // An idle or slow client is dropped once its head is not complete in
            // time (hyper's lane does the same with its header read timeout),
            // counted from the connection's start or the previous response's end.
            head_timer.as_mut().reset(ended + self.header_timeout);
            let plan = loop {
                if !c.buf.is_empty() {
                    match analyze(self.router, &c.buf, &mut c.out, &c.peer) {
                        Analysis::Ready(plan) => break plan,
                        Analysis::Handover => return Lane::Handover,
                        Analysis::Partial if c.buf.len() >= MAX_HEAD => return Lane::Handover,
                        Analysis::Partial => {}
                    }
                } else {
                    let stopping = *stop.borrow();
                    if stopping {
                        return Lane::Closed;
                    }
                }
                tokio::select! {
                    biased;
                    r = read_more(&mut c.stream, &mut c.buf) => match r {
                        Ok(0) | Err(_) => return Lane::Closed,
                        Ok(_) => {}
                    },
                    _ = stop.changed(), if c.buf.is_empty() => return Lane::Closed,
                    () = head_timer.as_mut() => return Lane::Closed,
                }
            };
            match self.relay(c, plan, &mut request_timer).await {
                Next::Request(end) => ended = end,
                Next::Lane(lane) => return lane,
            }
        }
    }

    /// One request of the fast lane, from routing to the end of the
    /// response.
    async fn relay<S: ClientIo>(
        &self,
        c: &mut Client<S>,
        plan: Plan,
        timer: &mut Pin<&mut Sleep>,
    ) -> Next {
        // The request timeout bounds the lookup and the whole exchange.
        let start = Instant::now();
        timer.as_mut().reset(start + self.request_timeout);
        let id = match &plan.id {
            IdSpan::Buf(r) => std::str::from_utf8(&c.buf[r.clone()]).unwrap_or_default(),
            IdSpan::Owned(s) => s.as_str(),
        };
        let node = match self.lookup_node(id, timer.as_mut()).await {
            Ok(n) => n,
            Err(status) => {
                return self
                    .answer(c, &plan, start, scheduler_error(&status), None)
                    .await;
            }
        };
        // The id outlives the request head's bytes, for forgetting a stale route.
        let routed_id = self.routes.map(|_| id.to_owned());
        let endpoint = match Endpoint::cached(&node.endpoint) {
            Ok(e) if e.is_plain_http() => e,
            // TLS nodes and bad endpoints are hyper's (its answers included).
            _ => return Next::Lane(Lane::Handover),
        };
        let path = std::str::from_utf8(&c.buf[plan.path.clone()]).unwrap_or("/");
        let query = plan
            .query
            .as_ref()
            .map(|q| std::str::from_utf8(&c.buf[q.clone()]).unwrap_or(""));
        if plan.under_proxy {
            endpoint.target_into(&mut c.target, &["/proxy", path], query);
        } else {
            endpoint.target_into(&mut c.target, &[path], query);
        }
        request_line(&mut c.line, &plan.method, &c.target);
        c.out.extend_from_slice(b"\r\n");
        c.buf.advance(plan.head_len);
        let in_buf = usize::try_from(plan.content_length)
            .unwrap_or(usize::MAX)
            .min(c.buf.len());
        c.out.extend_from_slice(&c.buf[..in_buf]);
        c.buf.advance(in_buf);
        let body_left = plan.content_length - in_buf as u64;

        let authority = endpoint.authority();
        let expect = Expect {
            head_request: plan.method == Method::HEAD,
            client_close: plan.close,
            debug_node: self.debug_mode.then_some(node.node_id.as_str()),
        };
        let sent = Instant::now();
        let exchanged = within(
            timer.as_mut(),
            exchange(self.pool, c, authority, body_left, &expect, sent),
        )
        .await;
        let upstream_metric = |status: &'static str| {
            self.metrics.observe_upstream(
                UpstreamLabels {
                    route: plan.route,
                    status,
                },
                sent.elapsed().as_secs_f64(),
            );
        };
        let (mut up, head) = match exchanged {
            Ok(Ok(x)) => x,
            Ok(Err(ExchangeError::ClientGone)) => {
                self.observe_request(&plan, "client_closed", start, Instant::now());
                return Next::Lane(Lane::Closed);
            }
            Ok(Err(ExchangeError::ClientBody)) => {
                upstream_metric("4xx");
                tracing::warn!("client stopped sending the request body");
                let resp = error_response(StatusCode::BAD_REQUEST, "failed to read request body");
                return self.answer(c, &plan, start, resp, Some(true)).await;
            }
            Ok(Err(ExchangeError::Upstream(e))) => {
                upstream_metric("5xx");
                self.forget_route(routed_id.as_deref());
                tracing::warn!(node_id = %node.node_id, endpoint = %node.endpoint, error = %e, "upstream request failed");
                let unread = body_left > 0;
                return self
                    .answer(c, &plan, start, upstream_unavailable(&node), Some(unread))
                    .await;
            }
            Err(_) => {
                upstream_metric("5xx");
                self.forget_route(routed_id.as_deref());
                tracing::warn!(node_id = %node.node_id, "upstream did not answer before the request timeout");
                let resp = error_response(StatusCode::GATEWAY_TIMEOUT, "upstream timeout");
                return self.answer(c, &plan, start, resp, Some(true)).await;
            }
        };
        upstream_metric(status_label(head.status));
        if head.status >= 500 || (plan.method == Method::DELETE && !plan.source.is_data_plane()) {
            // The node lost the sandbox, or it (or part of it) was deleted.
            self.forget_route(routed_id.as_deref());
        }

        let close = plan.close || head.framing == Framing::Close;
        let relayed = within(
            timer.as_mut(),
            relay_body(&mut c.stream, &mut c.out, &mut up, head.framing),
        )
        .await;
        let end = Instant::now();
        self.observe_request(&plan, status_label(head.status), start, end);
        match relayed {
            Ok(Ok(())) => {
                if !head.upstream_close && head.framing != Framing::Close && up.buf.is_empty() {
                    self.pool.release_raw(authority, up, end);
                }
                if close {
                    let _ = c.stream.shutdown().await;
                    Next::Lane(Lane::Closed)
                } else {
                    Next::Request(end)
                }
            }
            // The client or the node went away mid-body, or the deadline
            // passed: the status is sent, so the connection just ends.
            Ok(Err(_)) | Err(_) => Next::Lane(Lane::Closed),
        }
    }

    /// The request histogram sample of a fast-lane request.
    fn observe_request(&self, plan: &Plan, status: &'static str, start: Instant, end: Instant) {
        self.metrics.observe_request(
            RequestLabels {
                method: method_label(&plan.method),
                route: plan.route,
                route_source: plan.source.label(),
                status,
            },
            end.saturating_duration_since(start).as_secs_f64(),
        );
    }

    /// Answers a request with a response of the gateway's own (an error),
    /// then keeps the connection if the request body was all read
    /// (`unread_body`: `None` = only the head was consumed so far).
    async fn answer<S: ClientIo>(
        &self,
        c: &mut Client<S>,
        plan: &Plan,
        start: Instant,
        resp: Response<GatewayBody>,
        unread_body: Option<bool>,
    ) -> Next {
        let status = resp.status().as_u16();
        let close = match unread_body {
            None => {
                // Skip the request: its head and the body, if all here.
                let whole = plan.head_len as u64 + plan.content_length;
                if (c.buf.len() as u64) < whole {
                    true
                } else {
                    c.buf.advance(whole as usize);
                    plan.close
                }
            }
            Some(unread) => unread || plan.close,
        };
        let (parts, body) = resp.into_parts();
        let body = body
            .collect()
            .await
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        own_answer_head(&mut c.out, &parts, body.len(), close);
        c.out.extend_from_slice(&body);
        let written = match c.stream.write_all(&c.out).await {
            Ok(()) => c.stream.flush().await,
            Err(e) => Err(e),
        };
        let end = Instant::now();
        self.observe_request(plan, status_label(status), start, end);
        if written.is_err() || close {
            let _ = c.stream.shutdown().await;
            return Next::Lane(Lane::Closed);
        }
        Next::Request(end)
    }
}

/// What follows a request of the fast lane.
enum Next {
    /// The next request, on a connection whose last response ended then.
    Request(Instant),
    Lane(Lane),
}

/// `fut`, unless `timer` elapses first (as `tokio::time::timeout`, with a
/// timer that is reused).
pub(super) async fn within<F: Future>(timer: Pin<&mut Sleep>, fut: F) -> Result<F::Output, ()> {
    tokio::select! {
        biased;
        r = fut => Ok(r),
        () = timer => Err(()),
    }
}

/// A client connection handed to hyper: the bytes the fast lane already
/// read come first.
pub(in crate::server) struct Rewound<S> {
    prefix: Bytes,
    inner: S,
}

impl<S: AsyncRead + Unpin> AsyncRead for Rewound<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if !self.prefix.is_empty() {
            let n = self.prefix.len().min(buf.remaining());
            buf.put_slice(&self.prefix[..n]);
            self.prefix.advance(n);
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Rewound<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}
