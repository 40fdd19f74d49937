//! The Connect protocol (connectrpc.com) on hyper: codecs, envelopes, error
//! codes, timeouts, and the three call shapes the agent serves (unary,
//! server streaming, client streaming).
//!
//! Unary calls use `application/json` or `application/proto` bodies and map
//! errors to HTTP statuses; streaming calls use `application/connect+json` or
//! `application/connect+proto`, a sequence of envelopes (1 flag byte, 4-byte
//! big-endian length, payload) and a final end-of-stream envelope (flag
//! `0x02`) with a JSON body that carries the error, if any.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use futures::stream::{BoxStream, Stream, StreamExt};
use http::{HeaderMap, HeaderValue, Request, Response, StatusCode, header};
use http_body::{Body, Frame};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use serde::Serialize;
use serde::de::DeserializeOwned;

/// Envelope flag: the payload is compressed.
pub const FLAG_COMPRESSED: u8 = 0x01;
/// Envelope flag: end of stream (a JSON trailer message).
pub const FLAG_END_STREAM: u8 = 0x02;

/// Largest single message (unary body or envelope payload) accepted.
pub const MAX_MESSAGE_BYTES: usize = 32 * 1024 * 1024;

/// Response body type used throughout the agent.
pub type RespBody = UnsyncBoxBody<Bytes, std::io::Error>;

/// A message type both codecs can carry.
pub trait ConnectMessage:
    prost::Message + Default + Serialize + DeserializeOwned + Send + Sync + 'static
{
}
impl<T> ConnectMessage for T where
    T: prost::Message + Default + Serialize + DeserializeOwned + Send + Sync + 'static
{
}

/// Connect error codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Code {
    Canceled,
    Unknown,
    InvalidArgument,
    DeadlineExceeded,
    NotFound,
    AlreadyExists,
    PermissionDenied,
    ResourceExhausted,
    FailedPrecondition,
    Aborted,
    OutOfRange,
    Unimplemented,
    Internal,
    Unavailable,
    DataLoss,
    Unauthenticated,
}

impl Code {
    /// The code's wire name (`"not_found"`).
    pub fn as_str(self) -> &'static str {
        match self {
            Code::Canceled => "canceled",
            Code::Unknown => "unknown",
            Code::InvalidArgument => "invalid_argument",
            Code::DeadlineExceeded => "deadline_exceeded",
            Code::NotFound => "not_found",
            Code::AlreadyExists => "already_exists",
            Code::PermissionDenied => "permission_denied",
            Code::ResourceExhausted => "resource_exhausted",
            Code::FailedPrecondition => "failed_precondition",
            Code::Aborted => "aborted",
            Code::OutOfRange => "out_of_range",
            Code::Unimplemented => "unimplemented",
            Code::Internal => "internal",
            Code::Unavailable => "unavailable",
            Code::DataLoss => "data_loss",
            Code::Unauthenticated => "unauthenticated",
        }
    }

    /// Parses a wire name; unknown names give [`Code::Unknown`].
    pub fn parse(s: &str) -> Code {
        match s {
            "canceled" => Code::Canceled,
            "invalid_argument" => Code::InvalidArgument,
            "deadline_exceeded" => Code::DeadlineExceeded,
            "not_found" => Code::NotFound,
            "already_exists" => Code::AlreadyExists,
            "permission_denied" => Code::PermissionDenied,
            "resource_exhausted" => Code::ResourceExhausted,
            "failed_precondition" => Code::FailedPrecondition,
            "aborted" => Code::Aborted,
            "out_of_range" => Code::OutOfRange,
            "unimplemented" => Code::Unimplemented,
            "internal" => Code::Internal,
            "unavailable" => Code::Unavailable,
            "data_loss" => Code::DataLoss,
            "unauthenticated" => Code::Unauthenticated,
            _ => Code::Unknown,
        }
    }

    /// The HTTP status a unary error with this code is sent with.
    pub fn http_status(self) -> StatusCode {
        match self {
            Code::Canceled => StatusCode::from_u16(499).unwrap_or(StatusCode::BAD_REQUEST),
            Code::Unknown | Code::Internal | Code::DataLoss => StatusCode::INTERNAL_SERVER_ERROR,
            Code::InvalidArgument | Code::FailedPrecondition | Code::OutOfRange => {
                StatusCode::BAD_REQUEST
            }
            Code::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
            Code::NotFound => StatusCode::NOT_FOUND,
            Code::AlreadyExists | Code::Aborted => StatusCode::CONFLICT,
            Code::PermissionDenied => StatusCode::FORBIDDEN,
            Code::ResourceExhausted => StatusCode::TOO_MANY_REQUESTS,
            Code::Unimplemented => StatusCode::NOT_IMPLEMENTED,
            Code::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
            Code::Unauthenticated => StatusCode::UNAUTHORIZED,
        }
    }

    /// The code a client infers from an HTTP status without a Connect body.
    pub fn from_http_status(status: StatusCode) -> Code {
        match status.as_u16() {
            400 => Code::InvalidArgument,
            401 => Code::Unauthenticated,
            403 => Code::PermissionDenied,
            404 => Code::NotFound,
            408 => Code::DeadlineExceeded,
            409 => Code::Aborted,
            415 => Code::Internal,
            429 | 502 | 503 => Code::Unavailable,
            504 => Code::DeadlineExceeded,
            _ => Code::Unknown,
        }
    }
}

impl std::fmt::Display for Code {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A Connect error: a code and a message for the client.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{code}: {message}")]
pub struct ConnectError {
    pub code: Code,
    pub message: String,
}

impl ConnectError {
    pub fn new(code: Code, message: impl Into<String>) -> Self {
        ConnectError {
            code,
            message: message.into(),
        }
    }
    pub fn invalid_argument(message: impl Into<String>) -> Self {
        Self::new(Code::InvalidArgument, message)
    }
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(Code::NotFound, message)
    }
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(Code::Internal, message)
    }

    /// Maps an I/O error on `what` to the closest code.
    pub fn from_io(err: &std::io::Error, what: &str) -> Self {
        use std::io::ErrorKind as K;
        let code = match err.kind() {
            K::NotFound => Code::NotFound,
            K::PermissionDenied => Code::PermissionDenied,
            K::AlreadyExists => Code::AlreadyExists,
            K::InvalidInput | K::NotADirectory | K::IsADirectory | K::DirectoryNotEmpty => {
                Code::InvalidArgument
            }
            K::StorageFull | K::QuotaExceeded => Code::ResourceExhausted,
            _ => Code::Internal,
        };
        Self::new(code, format!("{what}: {err}"))
    }

    /// The JSON body of a unary error: `{"code":"...","message":"..."}`.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({"code": self.code.as_str(), "message": self.message})
    }

    /// Parses a Connect error JSON body; `None` if it is not one.
    pub fn from_json(body: &[u8]) -> Option<ConnectError> {
        let v: serde_json::Value = serde_json::from_slice(body).ok()?;
        let code = v.get("code")?.as_str()?;
        let message = v
            .get("message")
            .and_then(|m| m.as_str())
            .unwrap_or_default();
        Some(ConnectError::new(Code::parse(code), message))
    }

    /// The unary error response.
    pub fn into_unary_response(self) -> Response<RespBody> {
        let body = serde_json::to_vec(&self.to_json()).unwrap_or_default();
        let mut resp = Response::new(full(body));
        *resp.status_mut() = self.code.http_status();
        resp.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        resp
    }
}

/// The two codecs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Codec {
    Json,
    Proto,
}

/// Whether a request's content type names a unary or a streaming call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    Unary,
    Stream,
}

impl Codec {
    /// Parses a request content type (parameters such as `charset` ignored).
    pub fn from_content_type(ct: &str) -> Option<(Codec, Framing)> {
        let base = ct
            .split(';')
            .next()
            .unwrap_or("")
            .trim()
            .to_ascii_lowercase();
        match base.as_str() {
            "application/json" => Some((Codec::Json, Framing::Unary)),
            "application/proto" | "application/protobuf" => Some((Codec::Proto, Framing::Unary)),
            "application/connect+json" => Some((Codec::Json, Framing::Stream)),
            "application/connect+proto" => Some((Codec::Proto, Framing::Stream)),
            _ => None,
        }
    }

    pub fn unary_content_type(self) -> &'static str {
        match self {
            Codec::Json => "application/json",
            Codec::Proto => "application/proto",
        }
    }

    pub fn stream_content_type(self) -> &'static str {
        match self {
            Codec::Json => "application/connect+json",
            Codec::Proto => "application/connect+proto",
        }
    }

    /// Decodes one message.
    pub fn decode<M: ConnectMessage>(self, bytes: &[u8]) -> Result<M, ConnectError> {
        match self {
            Codec::Json => serde_json::from_slice(bytes).map_err(|e| {
                ConnectError::invalid_argument(format!("request is not valid JSON: {e}"))
            }),
            Codec::Proto => M::decode(bytes).map_err(|e| {
                ConnectError::invalid_argument(format!("request is not valid protobuf: {e}"))
            }),
        }
    }

    /// Encodes one message.
    pub fn encode<M: ConnectMessage>(self, msg: &M) -> Result<Bytes, ConnectError> {
        match self {
            Codec::Json => serde_json::to_vec(msg)
                .map(Bytes::from)
                .map_err(|e| ConnectError::internal(format!("encoding JSON response: {e}"))),
            Codec::Proto => Ok(Bytes::from(msg.encode_to_vec())),
        }
    }
}

/// Frames one payload as an envelope.
pub fn encode_envelope(flags: u8, payload: &[u8]) -> Bytes {
    let mut b = BytesMut::with_capacity(5 + payload.len());
    b.put_u8(flags);
    b.put_u32(payload.len() as u32);
    b.put_slice(payload);
    b.freeze()
}

/// The end-of-stream envelope: `{}` or `{"error":{...}}`.
pub fn end_stream_envelope(err: Option<&ConnectError>) -> Bytes {
    let json = match err {
        None => serde_json::json!({}),
        Some(e) => serde_json::json!({"error": e.to_json()}),
    };
    encode_envelope(
        FLAG_END_STREAM,
        &serde_json::to_vec(&json).unwrap_or_default(),
    )
}

/// One decoded envelope.
#[derive(Debug, Clone)]
pub struct Envelope {
    pub flags: u8,
    pub payload: Bytes,
}

/// Incremental envelope parser.
#[derive(Debug)]
pub struct EnvelopeDecoder {
    buf: BytesMut,
    max: usize,
}

impl EnvelopeDecoder {
    pub fn new(max: usize) -> Self {
        EnvelopeDecoder {
            buf: BytesMut::new(),
            max,
        }
    }

    pub fn push(&mut self, data: &[u8]) {
        self.buf.extend_from_slice(data);
    }

    /// The next complete envelope, if one is buffered.
    pub fn next_envelope(&mut self) -> Result<Option<Envelope>, ConnectError> {
        if self.buf.len() < 5 {
            return Ok(None);
        }
        let flags = self.buf[0];
        let len = u32::from_be_bytes([self.buf[1], self.buf[2], self.buf[3], self.buf[4]]) as usize;
        if len > self.max {
            return Err(ConnectError::new(
                Code::ResourceExhausted,
                format!(
                    "message of {len} bytes is larger than the limit of {} bytes",
                    self.max
                ),
            ));
        }
        if self.buf.len() < 5 + len {
            return Ok(None);
        }
        self.buf.advance(5);
        let payload = self.buf.split_to(len).freeze();
        Ok(Some(Envelope { flags, payload }))
    }

    /// Checks that no partial envelope is left when the body ended.
    pub fn finish(&self) -> Result<(), ConnectError> {
        if self.buf.is_empty() {
            Ok(())
        } else {
            Err(ConnectError::invalid_argument(format!(
                "body ended inside an envelope ({} bytes left over): the request was truncated",
                self.buf.len()
            )))
        }
    }
}

/// Turns a body into a stream of envelopes.
pub fn envelope_stream<B>(body: B, max: usize) -> BoxStream<'static, Result<Envelope, ConnectError>>
where
    B: Body<Data = Bytes> + Send + Unpin + 'static,
    B::Error: std::fmt::Display,
{
    struct St<B> {
        body: B,
        dec: EnvelopeDecoder,
        done: bool,
    }
    let st = St {
        body,
        dec: EnvelopeDecoder::new(max),
        done: false,
    };
    futures::stream::unfold(st, |mut st| async move {
        if st.done {
            return None;
        }
        loop {
            match st.dec.next_envelope() {
                Ok(Some(env)) => return Some((Ok(env), st)),
                Ok(None) => {}
                Err(e) => {
                    st.done = true;
                    return Some((Err(e), st));
                }
            }
            match st.body.frame().await {
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        st.dec.push(&data);
                    }
                }
                Some(Err(e)) => {
                    st.done = true;
                    return Some((
                        Err(ConnectError::new(
                            Code::Canceled,
                            format!("reading request body: {e}"),
                        )),
                        st,
                    ));
                }
                None => {
                    st.done = true;
                    return match st.dec.finish() {
                        Ok(()) => None,
                        Err(e) => Some((Err(e), st)),
                    };
                }
            }
        }
    })
    .boxed()
}

/// A `Full` body boxed into [`RespBody`].
pub fn full(data: impl Into<Bytes>) -> RespBody {
    Full::new(data.into())
        .map_err(|never: Infallible| match never {})
        .boxed_unsync()
}

/// An empty body.
pub fn empty() -> RespBody {
    full(Bytes::new())
}

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
            return Err(Box::new(match framing {
                Framing::Unary => err.into_unary_response(),
                Framing::Stream => stream_error_response(codec, err),
            }));
        }
    }
    let timeout = match parse_timeout(req.headers()) {
        Ok(t) => t,
        Err(e) => {
            return Err(Box::new(match framing {
                Framing::Unary => e.into_unary_response(),
                Framing::Stream => stream_error_response(codec, e),
            }));
        }
    };
    Ok(CallInfo {
        headers: req.headers().clone(),
        timeout,
        codec,
    })
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
    let mut resp = Response::new(full(end_stream_envelope(Some(&err))));
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static(codec.stream_content_type()),
    );
    resp
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
    let info = match check_request(&req, Framing::Unary) {
        Ok(i) => i,
        Err(r) => return *r,
    };
    let codec = info.codec;
    let timeout = info.timeout;
    let work = async move {
        let body = read_bounded(req.into_body(), MAX_MESSAGE_BYTES).await?;
        let msg: Req = codec.decode(&body)?;
        let resp = f(info, msg).await?;
        codec.encode(&resp)
    };
    let result = match timeout {
        Some(t) => match tokio::time::timeout(t, work).await {
            Ok(r) => r,
            Err(_) => Err(ConnectError::new(
                Code::DeadlineExceeded,
                "the call's Connect-Timeout-Ms deadline passed",
            )),
        },
        None => work.await,
    };
    match result {
        Ok(bytes) => {
            let mut resp = Response::new(full(bytes));
            resp.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static(codec.unary_content_type()),
            );
            resp
        }
        Err(e) => e.into_unary_response(),
    }
}

/// Output stream type of server-streaming handlers.
pub type MessageStream<T> = BoxStream<'static, Result<T, ConnectError>>;

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
    let info = match check_request(&req, Framing::Stream) {
        Ok(i) => i,
        Err(r) => return *r,
    };
    let codec = info.codec;
    let deadline = info.timeout.map(|t| tokio::time::Instant::now() + t);
    let first = async {
        let mut envs = envelope_stream(req.into_body(), MAX_MESSAGE_BYTES);
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
    let mut resp = Response::new(StreamBody::new(body).boxed_unsync());
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static(codec.stream_content_type()),
    );
    resp
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
                    return end(
                        &mut self,
                        Some(ConnectError::new(
                            Code::DeadlineExceeded,
                            "the call's Connect-Timeout-Ms deadline passed",
                        )),
                    );
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
    let info = match check_request(&req, Framing::Stream) {
        Ok(i) => i,
        Err(r) => return *r,
    };
    let codec = info.codec;
    let timeout = info.timeout;
    let msgs = envelope_stream(req.into_body(), MAX_MESSAGE_BYTES)
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
    let result = match timeout {
        Some(t) => match tokio::time::timeout(t, work).await {
            Ok(r) => r,
            Err(_) => Err(ConnectError::new(
                Code::DeadlineExceeded,
                "the call's Connect-Timeout-Ms deadline passed",
            )),
        },
        None => work.await,
    };
    let body = match result.and_then(|resp| codec.encode(&resp)) {
        Ok(b) => {
            let mut out = BytesMut::new();
            out.extend_from_slice(&encode_envelope(0, &b));
            out.extend_from_slice(&end_stream_envelope(None));
            out.freeze()
        }
        Err(e) => end_stream_envelope(Some(&e)),
    };
    let mut resp = Response::new(full(body));
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static(codec.stream_content_type()),
    );
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envelope_round_trip_and_partial_input() {
        let a = encode_envelope(0, b"hello");
        let b = end_stream_envelope(None);
        let mut all = BytesMut::new();
        all.extend_from_slice(&a);
        all.extend_from_slice(&b);
        let mut dec = EnvelopeDecoder::new(1024);
        dec.push(&all[..3]);
        assert!(dec.next_envelope().unwrap().is_none());
        dec.push(&all[3..]);
        let e1 = dec.next_envelope().unwrap().unwrap();
        assert_eq!((e1.flags, &e1.payload[..]), (0, &b"hello"[..]));
        let e2 = dec.next_envelope().unwrap().unwrap();
        assert_eq!((e2.flags, &e2.payload[..]), (FLAG_END_STREAM, &b"{}"[..]));
        assert!(dec.finish().is_ok());
    }

    #[test]
    fn oversized_envelope_is_resource_exhausted() {
        let mut dec = EnvelopeDecoder::new(4);
        dec.push(&encode_envelope(0, b"too long"));
        assert_eq!(
            dec.next_envelope().unwrap_err().code,
            Code::ResourceExhausted
        );
    }

    #[test]
    fn truncated_envelope_fails_finish() {
        let mut dec = EnvelopeDecoder::new(1024);
        dec.push(&encode_envelope(0, b"hello")[..6]);
        assert!(dec.next_envelope().unwrap().is_none());
        assert_eq!(dec.finish().unwrap_err().code, Code::InvalidArgument);
    }

    #[test]
    fn codes_map_to_connect_http_statuses() {
        assert_eq!(Code::NotFound.http_status(), 404);
        assert_eq!(Code::Unauthenticated.http_status(), 401);
        assert_eq!(Code::DeadlineExceeded.http_status(), 504);
        assert_eq!(Code::Canceled.http_status().as_u16(), 499);
        assert_eq!(Code::ResourceExhausted.http_status(), 429);
        for c in [Code::NotFound, Code::DataLoss, Code::Aborted] {
            assert_eq!(Code::parse(c.as_str()), c);
        }
    }

    #[test]
    fn content_types_select_codec_and_framing() {
        assert_eq!(
            Codec::from_content_type("application/json; charset=utf-8"),
            Some((Codec::Json, Framing::Unary))
        );
        assert_eq!(
            Codec::from_content_type("application/connect+proto"),
            Some((Codec::Proto, Framing::Stream))
        );
        assert_eq!(Codec::from_content_type("text/plain"), None);
    }

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
