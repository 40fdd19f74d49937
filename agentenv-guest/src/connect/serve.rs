//! Serving Connect calls on hyper: request checks (method, content type,
//! compression, `Connect-Timeout-Ms`), and the three call shapes the agent
//! serves (unary, server streaming, client streaming).

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use futures::stream::{BoxStream, Stream, StreamExt};
use http::{HeaderMap, HeaderValue, Request, Response, StatusCode, header};
use http_body::{Body, Frame};
use http_body_util::{BodyExt, StreamBody};

use super::body::{RespBody, full};
use super::codec::{Codec, ConnectMessage, Framing, MAX_MESSAGE_BYTES};
use super::envelope::{
    FLAG_COMPRESSED, FLAG_END_STREAM, encode_envelope, end_stream_envelope, envelope_stream,
};
use super::error::{Code, ConnectError};

/// Parses `Connect-Timeout-Ms`.
pub fn parse_timeout(headers: &HeaderMap) -> Result<Option<Duration>, ConnectError> {
    let Some(v) = headers.get("connect-timeout-ms") else {
        return Ok(None);
    };
    let s = v.to_str().unwrap_or("");
    if s.is_empty() || s.len() > 10 || !s.bytes().all(|b| b.is_ascii_digit()) {
        return Err(ConnectError::invalid_argument(format!(
            "Connect-Timeout-Ms must be 1 to 10 digits, got {s:?}"
        )));
    }
    let ms: u64 = s
        .parse()
        .map_err(|_| ConnectError::invalid_argument("Connect-Timeout-Ms is not a number"))?;
    Ok(Some(Duration::from_millis(ms)))
}

/// What every handler learns about its call.
#[derive(Debug, Clone)]
pub struct CallInfo {
    pub headers: HeaderMap,
    pub timeout: Option<Duration>,
    pub codec: Codec,
}

/// Checks method, content type and compression; returns the call's info.
fn check_request(
    req: &Request<hyper::body::Incoming>,
    want: Framing,
) -> Result<CallInfo, Box<Response<RespBody>>> {
    if req.method() != http::Method::POST {
        let mut r = ConnectError::new(
            Code::Unimplemented,
            format!("method {} is not allowed, use POST", req.method()),
        )
        .into_unary_response();
        *r.status_mut() = StatusCode::METHOD_NOT_ALLOWED;
        r.headers_mut()
            .insert(header::ALLOW, HeaderValue::from_static("POST"));
        return Err(Box::new(r));
    }
    let ct = req
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let (codec, framing) = match Codec::from_content_type(ct) {
        Some(x) if x.1 == want => x,
        _ => {
            let accept = match want {
                Framing::Unary => "application/json, application/proto",
                Framing::Stream => "application/connect+json, application/connect+proto",
            };
            let mut r = ConnectError::new(
                Code::Unimplemented,
                format!("content type {ct:?} is not supported here; use one of {accept}"),
            )
            .into_unary_response();
            *r.status_mut() = StatusCode::UNSUPPORTED_MEDIA_TYPE;
            if let Ok(v) = HeaderValue::from_str(accept) {
                r.headers_mut().insert("accept-post", v);
            }
            return Err(Box::new(r));
        }
    };
    let enc_header = match framing {
        Framing::Unary => header::CONTENT_ENCODING.as_str(),
        Framing::Stream => "connect-content-encoding",
    };
    if let Some(enc) = req.headers().get(enc_header) {
        let e = enc.to_str().unwrap_or("?");
        if !e.eq_ignore_ascii_case("identity") {
            let err = ConnectError::new(
                Code::Unimplemented,
                format!("compression {e:?} is not supported; send identity"),
            );
            return Err(Box::new(error_response(framing, codec, err)));
        }
    }
    let timeout =
        parse_timeout(req.headers()).map_err(|e| Box::new(error_response(framing, codec, e)))?;
    Ok(CallInfo {
        headers: req.headers().clone(),
        timeout,
        codec,
    })
}

/// Checks the request (see [`check_request`]) and runs `handle` on the call's info
/// and the request body; a refused request gets its refusal.
async fn checked<Fut>(
    req: Request<hyper::body::Incoming>,
    framing: Framing,
    handle: impl FnOnce(CallInfo, hyper::body::Incoming) -> Fut,
) -> Response<RespBody>
where
    Fut: Future<Output = Response<RespBody>>,
{
    match check_request(&req, framing) {
        Ok(info) => handle(info, req.into_body()).await,
        Err(refusal) => *refusal,
    }
}

/// The answer to a call that failed before its handler ran.
fn error_response(framing: Framing, codec: Codec, err: ConnectError) -> Response<RespBody> {
    match framing {
        Framing::Unary => err.into_unary_response(),
        Framing::Stream => stream_error_response(codec, err),
    }
}

/// Runs `work`, failing with `deadline_exceeded` when the call's timeout
/// passes first.
async fn within<T>(
    timeout: Option<Duration>,
    work: impl Future<Output = Result<T, ConnectError>>,
) -> Result<T, ConnectError> {
    match timeout {
        Some(t) => tokio::time::timeout(t, work)
            .await
            .unwrap_or_else(|_| Err(deadline_exceeded())),
        None => work.await,
    }
}

fn deadline_exceeded() -> ConnectError {
    ConnectError::new(
        Code::DeadlineExceeded,
        "the call's Connect-Timeout-Ms deadline passed",
    )
}

/// A response with a body and its content type.
fn typed_response(body: RespBody, content_type: &'static str) -> Response<RespBody> {
    let mut resp = Response::new(body);
    resp.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    resp
}

/// Reads a whole (bounded) body.
async fn read_bounded<B>(body: B, max: usize) -> Result<Bytes, ConnectError>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: std::fmt::Display,
{
    let mut body = body;
    let mut buf = BytesMut::new();
    while let Some(frame) = body.frame().await {
        let frame = frame
            .map_err(|e| ConnectError::new(Code::Canceled, format!("reading request: {e}")))?;
        if let Ok(d) = frame.into_data() {
            if buf.len() + d.len() > max {
                return Err(ConnectError::new(
                    Code::ResourceExhausted,
                    format!("request is larger than the limit of {max} bytes"),
                ));
            }
            buf.extend_from_slice(&d);
        }
    }
    Ok(buf.freeze())
}

/// A streaming response that carries only an end-of-stream error.
pub fn stream_error_response(codec: Codec, err: ConnectError) -> Response<RespBody> {
    typed_response(
        full(end_stream_envelope(Some(&err))),
        codec.stream_content_type(),
    )
}

/// Serves a unary call with `f`.
pub async fn unary<Req, Resp, F, Fut>(
    req: Request<hyper::body::Incoming>,
    f: F,
) -> Response<RespBody>
where
    Req: ConnectMessage,
    Resp: ConnectMessage,
    F: FnOnce(CallInfo, Req) -> Fut,
    Fut: Future<Output = Result<Resp, ConnectError>>,
{
    checked(req, Framing::Unary, |info, body| async move {
        let codec = info.codec;
        let timeout = info.timeout;
        let work = async move {
            let body = read_bounded(body, MAX_MESSAGE_BYTES).await?;
            let msg: Req = codec.decode(&body)?;
            let resp = f(info, msg).await?;
            codec.encode(&resp)
        };
        match within(timeout, work).await {
            Ok(bytes) => typed_response(full(bytes), codec.unary_content_type()),
            Err(e) => e.into_unary_response(),
        }
    })
    .await
}

/// Output stream type of server-streaming handlers.
pub type MessageStream<T> = BoxStream<'static, Result<T, ConnectError>>;

/// A server stream: `first`, then every item of `events`, with a copy of
/// `keepalive` whenever `every` passes without a message (so proxies with
/// an idle timeout keep the call open). Ends when `events` ends.
pub fn with_keepalives<T, S>(first: T, events: S, every: Duration, keepalive: T) -> MessageStream<T>
where
    T: Clone + Send + 'static,
    S: Stream<Item = T> + Send + Unpin + 'static,
{
    let mut ticker = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let head = futures::stream::iter([Ok(first)]);
    let tail = futures::stream::unfold(
        (events, ticker, keepalive),
        |(mut events, mut ticker, keepalive)| async move {
            let item = tokio::select! {
                ev = events.next() => ev?,
                _ = ticker.tick() => keepalive.clone(),
            };
            Some((Ok(item), (events, ticker, keepalive)))
        },
    );
    head.chain(tail).boxed()
}

/// Serves a server-streaming call with `f`.
pub async fn server_stream<Req, Resp, F, Fut>(
    req: Request<hyper::body::Incoming>,
    f: F,
) -> Response<RespBody>
where
    Req: ConnectMessage,
    Resp: ConnectMessage,
    F: FnOnce(CallInfo, Req) -> Fut,
    Fut: Future<Output = Result<MessageStream<Resp>, ConnectError>>,
{
    checked(req, Framing::Stream, |info, body| async move {
        let codec = info.codec;
        let deadline = info.timeout.map(|t| tokio::time::Instant::now() + t);
        let first = async {
            let mut envs = envelope_stream(body, MAX_MESSAGE_BYTES);
            let env = match envs.next().await {
                Some(r) => r?,
                None => {
                    return Err(ConnectError::invalid_argument(
                        "the request body holds no message envelope",
                    ));
                }
            };
            if env.flags != 0 {
                return Err(ConnectError::invalid_argument(format!(
                    "request envelope has flags {:#04x}; expected a plain message (0x00)",
                    env.flags
                )));
            }
            if let Some(extra) = envs.next().await {
                extra?;
                return Err(ConnectError::invalid_argument(
                    "a server-streaming call takes exactly one request message",
                ));
            }
            codec.decode::<Req>(&env.payload)
        };
        let msg = match first.await {
            Ok(m) => m,
            Err(e) => return stream_error_response(codec, e),
        };
        let stream = match f(info, msg).await {
            Ok(s) => s,
            Err(e) => return stream_error_response(codec, e),
        };
        let body = EnvelopeBody {
            inner: stream,
            codec,
            deadline: deadline.map(|d| Box::pin(tokio::time::sleep_until(d))),
            done: false,
        };
        typed_response(
            StreamBody::new(body).boxed_unsync(),
            codec.stream_content_type(),
        )
    })
    .await
}

/// Turns a message stream into envelope frames with an end-of-stream
/// trailer, ending with `deadline_exceeded` when the deadline passes.
struct EnvelopeBody<T> {
    inner: MessageStream<T>,
    codec: Codec,
    deadline: Option<Pin<Box<tokio::time::Sleep>>>,
    done: bool,
}

impl<T: ConnectMessage> Stream for EnvelopeBody<T> {
    type Item = Result<Frame<Bytes>, std::io::Error>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if self.done {
            return Poll::Ready(None);
        }
        let item = self.inner.poll_next_unpin(cx);
        let end = |this: &mut Self, err: Option<ConnectError>| {
            this.done = true;
            Poll::Ready(Some(Ok(Frame::data(end_stream_envelope(err.as_ref())))))
        };
        match item {
            Poll::Ready(Some(Ok(msg))) => match self.codec.encode(&msg) {
                Ok(b) => Poll::Ready(Some(Ok(Frame::data(encode_envelope(0, &b))))),
                Err(e) => end(&mut self, Some(e)),
            },
            Poll::Ready(Some(Err(e))) => end(&mut self, Some(e)),
            Poll::Ready(None) => end(&mut self, None),
            Poll::Pending => {
                if let Some(d) = self.deadline.as_mut()
                    && d.as_mut().poll(cx).is_ready()
                {
                    return end(&mut self, Some(deadline_exceeded()));
                }
                Poll::Pending
            }
        }
    }
}

/// Serves a client-streaming call with `f`, which gets the decoded
/// request messages as a stream.
pub async fn client_stream<Req, Resp, F, Fut>(
    req: Request<hyper::body::Incoming>,
    f: F,
) -> Response<RespBody>
where
    Req: ConnectMessage,
    Resp: ConnectMessage,
    F: FnOnce(CallInfo, MessageStream<Req>) -> Fut,
    Fut: Future<Output = Result<Resp, ConnectError>>,
{
    checked(req, Framing::Stream, |info, body| async move {
        let codec = info.codec;
        let timeout = info.timeout;
        let msgs = envelope_stream(body, MAX_MESSAGE_BYTES)
            .map(move |env| {
                let env = env?;
                if env.flags & FLAG_COMPRESSED != 0 {
                    return Err(ConnectError::new(
                        Code::Unimplemented,
                        "compressed envelopes are not supported",
                    ));
                }
                if env.flags & FLAG_END_STREAM != 0 {
                    return Err(ConnectError::invalid_argument(
                        "clients must not send an end-of-stream envelope",
                    ));
                }
                codec.decode::<Req>(&env.payload)
            })
            .boxed();
        let work = f(info, msgs);
        let result = within(timeout, work).await;
        let body = match result.and_then(|resp| codec.encode(&resp)) {
            Ok(b) => {
                let mut out = BytesMut::new();
                out.extend_from_slice(&encode_envelope(0, &b));
                out.extend_from_slice(&end_stream_envelope(None));
                out.freeze()
            }
            Err(e) => end_stream_envelope(Some(&e)),
        };
        typed_response(full(body), codec.stream_content_type())
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeout_header_is_validated() {
        let mut h = HeaderMap::new();
        h.insert("connect-timeout-ms", HeaderValue::from_static("1500"));
        assert_eq!(
            parse_timeout(&h).unwrap(),
            Some(Duration::from_millis(1500))
        );
        h.insert("connect-timeout-ms", HeaderValue::from_static("-1"));
        assert!(parse_timeout(&h).is_err());
    }
}
