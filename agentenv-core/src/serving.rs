//! What every HTTP listener of the project shares about its clients: how long
//! a client may take to send a request head (which also ends idle keep-alive
//! connections), how large a head may be, and HTTP/2 keep-alive pings, so a
//! stranger cannot hold connections, memory or tasks forever.

use std::time::Duration;

use hyper_util::rt::{TokioExecutor, TokioTimer};
use hyper_util::server::conn::auto::Builder;

/// How long a client may take to send a complete request head, counted from the
/// connection's start or from the end of the previous response (so an idle
/// keep-alive connection is closed after it too).
pub const DEFAULT_HEADER_TIMEOUT: Duration = Duration::from_secs(30);

/// HTTP/1.1: the largest read buffer of a connection, which bounds a request head
/// (larger heads are answered 431); bodies stream through it.
pub const MAX_READ_BUFFER: usize = 256 * 1024;

/// HTTP/2: the largest header list a client may send.
pub const MAX_H2_HEADER_LIST: u32 = 64 * 1024;

/// HTTP/2: how often an idle connection is pinged, and how long the answer may take.
const H2_PING_INTERVAL: Duration = Duration::from_secs(30);
const H2_PING_TIMEOUT: Duration = Duration::from_secs(10);

/// A hyper server builder (HTTP/1.1 and HTTP/2) with the client limits above and
/// `header_timeout` as the head-read and keep-alive idle timeout.
pub fn server_builder(header_timeout: Duration) -> Builder<TokioExecutor> {
    let mut builder = Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(header_timeout)
        .max_buf_size(MAX_READ_BUFFER);
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_header_list_size(MAX_H2_HEADER_LIST)
        .keep_alive_interval(Some(H2_PING_INTERVAL))
        .keep_alive_timeout(H2_PING_TIMEOUT);
    builder
}

/// How long an HTTP/2 connection may stay without a request in flight before it is
/// closed (gracefully: the client is told with GOAWAY). HTTP/1.1 connections end
/// by the header timeout already.
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(120);

/// Requests in flight on one connection, from the call until the response body is
/// done (or dropped), so that a connection is idle only when nothing is served.
#[derive(Clone, Default)]
pub struct Activity(std::sync::Arc<ActivityInner>);

#[derive(Default)]
struct ActivityInner {
    in_flight: std::sync::atomic::AtomicUsize,
    changed: tokio::sync::Notify,
}

/// One request in flight (see [`Activity`]).
pub struct InFlight(std::sync::Arc<ActivityInner>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0
            .in_flight
            .fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
        self.0.changed.notify_waiters();
    }
}

impl Activity {
    /// Counts a request until the returned guard drops.
    pub fn begin(&self) -> InFlight {
        self.0
            .in_flight
            .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        self.0.changed.notify_waiters();
        InFlight(self.0.clone())
    }

    /// Resolves once no request has been in flight for `idle` without a break.
    pub async fn idle_for(&self, idle: Duration) {
        loop {
            let changed = self.0.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if self.0.in_flight.load(std::sync::atomic::Ordering::Acquire) == 0 {
                tokio::select! {
                    () = tokio::time::sleep(idle) => return,
                    () = changed => {}
                }
            } else {
                changed.await;
            }
        }
    }

    /// `service` with every request counted here until its response body ends.
    pub fn track<S>(&self, service: S) -> Tracked<S> {
        Tracked {
            inner: service,
            activity: self.clone(),
        }
    }
}

/// A service whose requests an [`Activity`] counts.
#[derive(Clone)]
pub struct Tracked<S> {
    inner: S,
    activity: Activity,
}

impl<S, Req, B> hyper::service::Service<Req> for Tracked<S>
where
    S: hyper::service::Service<Req, Response = hyper::Response<B>>,
    S::Future: Send + 'static,
{
    type Response = hyper::Response<TrackedBody<B>>;
    type Error = S::Error;
    type Future = std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<Self::Response, S::Error>> + Send>,
    >;

    fn call(&self, req: Req) -> Self::Future {
        let guard = self.activity.begin();
        let fut = self.inner.call(req);
        Box::pin(async move {
            let resp = fut.await?;
            Ok(resp.map(|inner| TrackedBody {
                inner,
                _guard: guard,
            }))
        })
    }
}

pin_project_lite::pin_project! {
    /// A response body that keeps its request counted until it ends or drops.
    pub struct TrackedBody<B> {
        #[pin]
        inner: B,
        _guard: InFlight,
    }
}

impl<B: hyper::body::Body> hyper::body::Body for TrackedBody<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Self::Data>, Self::Error>>> {
        self.project().inner.poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.inner.size_hint()
    }
}

/// Serves one connection with `builder` (upgrades allowed) until it ends; once
/// `stop` resolves, or no request has been in flight for `idle`, it is shut down
/// gracefully (requests in flight finish; HTTP/2 clients get GOAWAY).
pub async fn serve_connection<I, S, B>(
    builder: &Builder<TokioExecutor>,
    io: I,
    service: S,
    idle: Duration,
    stop: impl std::future::Future<Output = ()>,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>>
where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
    S: hyper::service::Service<
            hyper::Request<hyper::body::Incoming>,
            Response = hyper::Response<B>,
        > + Send
        + 'static,
    S::Future: Send + 'static,
    S::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    B: hyper::body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let activity = Activity::default();
    let conn = builder.serve_connection_with_upgrades(io, activity.track(service));
    tokio::pin!(conn);
    tokio::pin!(stop);
    tokio::select! {
        r = conn.as_mut() => r,
        () = &mut stop => {
            conn.as_mut().graceful_shutdown();
            conn.await
        }
        () = activity.idle_for(idle) => {
            conn.as_mut().graceful_shutdown();
            conn.await
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_connection_is_idle_only_after_its_last_request_and_the_whole_wait() {
        let a = Activity::default();
        let idle = Duration::from_secs(10);
        let waiting = {
            let a = a.clone();
            tokio::spawn(async move { a.idle_for(idle).await })
        };
        tokio::time::sleep(Duration::from_secs(6)).await;
        let req = a.begin();
        // In flight far past the idle time: not idle.
        tokio::time::sleep(Duration::from_secs(60)).await;
        assert!(!waiting.is_finished());
        drop(req);
        // The wait starts again from the end of the request.
        tokio::time::sleep(Duration::from_secs(9)).await;
        assert!(!waiting.is_finished());
        tokio::time::sleep(Duration::from_secs(2)).await;
        waiting.await.unwrap();
    }
}
