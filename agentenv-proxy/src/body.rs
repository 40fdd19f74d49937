//! Body types: one boxed body for everything the gateway sends, small
//! responses, a body that replays a buffered prefix, and a body bounded by a
//! deadline.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use agentenv_core::error::ErrorBody;
use bytes::Bytes;
use http::{HeaderValue, Response, StatusCode};
use http_body::{Body, Frame, SizeHint};
use http_body_util::{BodyExt, Empty, Full};
use tokio::time::{Instant, Sleep};

/// Boxed error of bodies in flight.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The body of every request and response the gateway sends.
pub type GatewayBody = http_body_util::combinators::UnsyncBoxBody<Bytes, BoxError>;

/// Boxes any body into a [`GatewayBody`].
pub fn boxed<B>(body: B) -> GatewayBody
where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    body.map_err(Into::into).boxed_unsync()
}

/// An empty body.
pub fn empty() -> GatewayBody {
    boxed(Empty::<Bytes>::new())
}

/// A body of `bytes`.
pub fn full(bytes: impl Into<Bytes>) -> GatewayBody {
    boxed(Full::new(bytes.into()))
}

/// A JSON error response `{"code","message"}`; 401 keeps an empty body.
pub fn error_response(status: StatusCode, message: &str) -> Response<GatewayBody> {
    if status == StatusCode::UNAUTHORIZED {
        let mut resp = Response::new(empty());
        *resp.status_mut() = status;
        return resp;
    }
    let body = ErrorBody::new(status.as_u16(), message).to_json();
    let mut resp = Response::new(full(body));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp.headers_mut().insert(
        "x-content-type-options",
        HeaderValue::from_static("nosniff"),
    );
    resp
}

/// A JSON response with a trailing newline.
pub fn json_response(status: StatusCode, value: &impl serde::Serialize) -> Response<GatewayBody> {
    match serde_json::to_vec(value) {
        Ok(mut bytes) => {
            bytes.push(b'\n');
            let mut resp = Response::new(full(bytes));
            *resp.status_mut() = status;
            resp.headers_mut().insert(
                http::header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
            resp
        }
        Err(e) => {
            tracing::error!(error = %e, "encoding a JSON response failed");
            error_response(
                StatusCode::INTERNAL_SERVER_ERROR,
                "failed to encode response",
            )
        }
    }
}

/// The client's request body failed (cut short, reset): carried through the
/// upstream client so the gateway can tell it apart from an upstream failure.
#[derive(Debug, thiserror::Error)]
#[error("reading the client's request body failed: {0}")]
pub struct ClientBodyError(#[source] pub BoxError);

/// Marks errors of the client's body as [`ClientBodyError`].
pub fn client_body<B>(body: B) -> GatewayBody
where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    body.map_err(|e| -> BoxError { Box::new(ClientBodyError(e.into())) })
        .boxed_unsync()
}

/// Whether `err` (or anything in its source chain) is a [`ClientBodyError`].
pub fn caused_by_client_body(err: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(err);
    while let Some(e) = cur {
        if e.is::<ClientBodyError>() {
            return true;
        }
        cur = e.source();
    }
    false
}

/// Replays frames that were already read, then continues with the rest of
/// the original body. Nothing is lost when a prefix was inspected (or a first
/// frame awaited).
pub struct ReplayBody<B = GatewayBody> {
    buffered: VecDeque<Frame<Bytes>>,
    buffered_len: u64,
    rest: Option<B>,
}

impl ReplayBody {
    /// `buffered`, then `rest` (if the body had more).
    pub fn new(buffered: Vec<Frame<Bytes>>, rest: Option<GatewayBody>) -> Self {
        Self::replaying(buffered, rest)
    }
}

impl<B> ReplayBody<B> {
    fn replaying(buffered: Vec<Frame<Bytes>>, rest: Option<B>) -> Self {
        let buffered_len = buffered
            .iter()
            .filter_map(|f| f.data_ref())
            .map(|d| d.len() as u64)
            .sum();
        Self {
            buffered: buffered.into(),
            buffered_len,
            rest,
        }
    }

    /// One frame already read, then the rest of the body it came from.
    pub fn prefixed(first: Frame<Bytes>, rest: B) -> Self {
        Self::replaying(vec![first], Some(rest))
    }
}

impl<B> Body for ReplayBody<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if let Some(frame) = self.buffered.pop_front() {
            if let Some(d) = frame.data_ref() {
                self.buffered_len -= d.len() as u64;
            }
            return Poll::Ready(Some(Ok(frame)));
        }
        match self.rest.as_mut() {
            Some(rest) => Pin::new(rest)
                .poll_frame(cx)
                .map(|f| f.map(|r| r.map_err(Into::into))),
            None => Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.buffered.is_empty() && self.rest.as_ref().is_none_or(|r| r.is_end_stream())
    }

    fn size_hint(&self) -> SizeHint {
        let rest = self
            .rest
            .as_ref()
            .map(|r| r.size_hint())
            .unwrap_or_else(|| SizeHint::with_exact(0));
        let mut hint = SizeHint::new();
        hint.set_lower(rest.lower() + self.buffered_len);
        if let Some(upper) = rest.upper() {
            hint.set_upper(upper + self.buffered_len);
        }
        hint
    }
}

/// The upstream did not finish the body before the request deadline.
#[derive(Debug, thiserror::Error)]
#[error("upstream body not finished before the request timeout")]
pub struct BodyDeadlineExceeded;

pin_project_lite::pin_project! {
    /// Fails the body with [`BodyDeadlineExceeded`] when `deadline` passes
    /// before it ends. The timer is armed only if the body ever waits.
    pub struct DeadlineBody<B> {
        #[pin]
        inner: B,
        deadline: Instant,
        sleep: Option<Pin<Box<Sleep>>>,
    }
}

impl<B> DeadlineBody<B> {
    pub fn new(inner: B, deadline: Instant) -> Self {
        Self {
            inner,
            deadline,
            sleep: None,
        }
    }
}

impl<B> Body for DeadlineBody<B>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.project();
        if let Poll::Ready(frame) = this.inner.poll_frame(cx) {
            return Poll::Ready(frame.map(|r| r.map_err(Into::into)));
        }
        let deadline = *this.deadline;
        let sleep = this
            .sleep
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
        match sleep.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Some(Err(Box::new(BodyDeadlineExceeded)))),
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// Reads up to `limit` bytes of `body`. Returns the frames read and, when
/// the body is longer than `limit`, the unread rest.
pub async fn read_prefix(
    mut body: GatewayBody,
    limit: usize,
) -> Result<(Vec<Frame<Bytes>>, usize, Option<GatewayBody>), BoxError> {
    let mut frames = Vec::new();
    let mut len = 0usize;
    loop {
        if len > limit {
            return Ok((frames, len, Some(body)));
        }
        match body.frame().await {
            None => return Ok((frames, len, None)),
            Some(Err(e)) => return Err(e),
            Some(Ok(frame)) => {
                if let Some(d) = frame.data_ref() {
                    len += d.len();
                }
                frames.push(frame);
            }
        }
    }
}

/// Concatenates the data of `frames`.
pub fn concat(frames: &[Frame<Bytes>]) -> Bytes {
    if let [only] = frames
        && let Some(d) = only.data_ref()
    {
        return d.clone();
    }
    let mut out = Vec::new();
    for f in frames {
        if let Some(d) = f.data_ref() {
            out.extend_from_slice(d);
        }
    }
    Bytes::from(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunks(parts: &[&'static str]) -> GatewayBody {
        let frames: Vec<Result<Frame<Bytes>, BoxError>> = parts
            .iter()
            .map(|p| Ok(Frame::data(Bytes::from_static(p.as_bytes()))))
            .collect();
        boxed(http_body_util::StreamBody::new(futures::stream::iter(
            frames,
        )))
    }

    #[tokio::test]
    async fn reading_exactly_the_limit_is_not_an_overflow() {
        let (frames, len, rest) = read_prefix(chunks(&["abc", "de"]), 5).await.unwrap();
        assert_eq!(len, 5);
        assert!(rest.is_none());
        assert_eq!(concat(&frames), "abcde");
    }

    #[tokio::test]
    async fn one_byte_over_the_limit_is_an_overflow_and_replay_keeps_everything() {
        let (frames, len, rest) = read_prefix(chunks(&["abc", "def", "gh"]), 5).await.unwrap();
        assert_eq!(len, 6);
        assert!(rest.is_some());
        let replay = ReplayBody::new(frames, rest);
        let all = replay.collect().await.unwrap().to_bytes();
        assert_eq!(all, "abcdefgh");
    }

    #[tokio::test]
    async fn error_bodies_are_json_except_401() {
        let resp = error_response(StatusCode::SERVICE_UNAVAILABLE, "no nodes available");
        assert_eq!(resp.headers()["content-type"], "application/json");
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(body, r#"{"code":503,"message":"no nodes available"}"#);
        let resp = error_response(StatusCode::UNAUTHORIZED, "ignored");
        assert!(resp.headers().get("content-type").is_none());
        assert!(
            resp.into_body()
                .collect()
                .await
                .unwrap()
                .to_bytes()
                .is_empty()
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_that_stalls_past_the_deadline_fails() {
        let (mut tx, rx) = futures::channel::mpsc::channel::<Result<Frame<Bytes>, BoxError>>(1);
        use futures::SinkExt;
        tx.send(Ok(Frame::data(Bytes::from_static(b"x"))))
            .await
            .unwrap();
        let body = DeadlineBody::new(
            http_body_util::StreamBody::new(rx),
            Instant::now() + std::time::Duration::from_secs(5),
        );
        let mut body = std::pin::pin!(body);
        let first = body.frame().await.unwrap().unwrap();
        assert_eq!(first.into_data().unwrap(), "x");
        let err = body.frame().await.unwrap().unwrap_err();
        assert!(err.is::<BodyDeadlineExceeded>());
        drop(tx);
    }
}
