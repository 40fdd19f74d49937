//! A Connect client for the agent with the binary protobuf codec, for the
//! runtime node and the `aenv` CLI: processes (start, stream output, input,
//! signals, resize), filesystem calls, and streamed file upload/download.
//!
//! ```no_run
//! # async fn demo() -> Result<(), agentenv_guest::client::ClientError> {
//! use agentenv_guest::client::GuestClient;
//! let client = GuestClient::new("http://127.0.0.1:49983")?.with_access_token("token");
//! let out = client.run("/bin/echo", &["hi"]).await?;
//! assert_eq!(out.stdout, b"hi\n");
//! # Ok(()) }
//! ```

use std::io;
use std::path::Path;
use std::pin::Pin;
use std::task::{Context, Poll};

use base64::Engine as _;
use bytes::{Bytes, BytesMut};
use futures::stream::BoxStream;
use futures::{Stream, StreamExt, TryStreamExt};
use http::{HeaderMap, HeaderName, HeaderValue, Method, Request, StatusCode, Uri, header};
use http_body::Frame;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, BodyStream, Full, StreamBody};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tokio::sync::mpsc;

use crate::connect::{
    Code, Codec, ConnectError, ConnectMessage, Envelope, FLAG_END_STREAM, MAX_MESSAGE_BYTES,
    encode_envelope, envelope_stream,
};
use crate::proto::filesystem as fs;
use crate::proto::process as pr;

type ReqBody = UnsyncBoxBody<Bytes, io::Error>;

/// Errors of the client.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("invalid agent URL {url:?}: {reason}; use e.g. http://10.11.0.2:49983")]
    BadUrl { url: String, reason: String },
    #[error("invalid header {0:?}")]
    BadHeader(String),
    #[error("{path}: could not reach the agent: {source}")]
    Transport {
        path: String,
        source: hyper_util::client::legacy::Error,
    },
    #[error("{path}: {source}")]
    Rpc { path: String, source: ConnectError },
    #[error("{path}: HTTP {status}: {body}")]
    Http {
        path: String,
        status: StatusCode,
        body: String,
    },
    #[error("{path}: bad response: {reason}")]
    Protocol { path: String, reason: String },
    #[error("{path}: reading the response body: {source}")]
    Body { path: String, source: hyper::Error },
    #[error("{path}: file transfer with the agent failed: {source}")]
    Transfer { path: String, source: io::Error },
    #[error("{path}: {source}")]
    Io { path: String, source: io::Error },
}

impl ClientError {
    /// The Connect code, when the agent answered with one.
    pub fn code(&self) -> Option<Code> {
        match self {
            ClientError::Rpc { source, .. } => Some(source.code),
            ClientError::Http { status, .. } => Some(Code::from_http_status(*status)),
            _ => None,
        }
    }
}

/// Where a download goes.
enum Dest {
    /// Created once the agent answered with success.
    Path(std::path::PathBuf),
    File(std::fs::File),
}

/// A client for one agent.
#[derive(Clone, Debug)]
pub struct GuestClient {
    scheme_authority: String,
    authority: String,
    http: Client<HttpConnector, ReqBody>,
    headers: HeaderMap,
}

impl GuestClient {
    /// HTTP/1.1 client for `base_url` (`http://host:port`).
    pub fn new(base_url: &str) -> Result<Self, ClientError> {
        Self::build(base_url, false)
    }

    /// HTTP/2 with prior knowledge (h2c): many calls over one connection.
    pub fn new_h2c(base_url: &str) -> Result<Self, ClientError> {
        Self::build(base_url, true)
    }

    fn build(base_url: &str, h2: bool) -> Result<Self, ClientError> {
        let bad = |reason: &str| ClientError::BadUrl {
            url: base_url.to_string(),
            reason: reason.to_string(),
        };
        let uri: Uri = base_url
            .parse()
            .map_err(|e: http::uri::InvalidUri| bad(&e.to_string()))?;
        if uri.scheme_str() != Some("http") {
            return Err(bad("only http:// is supported"));
        }
        let authority = uri.authority().ok_or_else(|| bad("no host"))?;
        let mut conn = HttpConnector::new();
        conn.set_nodelay(true);
        let mut b = Client::builder(TokioExecutor::new());
        if h2 {
            b.http2_only(true);
        } else {
            // Large reads for file downloads.
            b.http1_max_buf_size(1024 * 1024);
        }
        Ok(GuestClient {
            scheme_authority: format!("http://{authority}"),
            authority: authority.to_string(),
            http: b.build(conn),
            headers: HeaderMap::new(),
        })
    }

    /// Sends `X-Access-Token` with every call.
    pub fn with_access_token(mut self, token: &str) -> Self {
        if let Ok(v) = HeaderValue::from_str(token) {
            self.headers.insert("x-access-token", v);
        }
        self
    }

    /// Acts as `user` (Basic authorization, as the E2B SDKs send it).
    pub fn with_user(mut self, user: &str) -> Self {
        let b64 = base64::engine::general_purpose::STANDARD.encode(format!("{user}:"));
        if let Ok(v) = HeaderValue::from_str(&format!("Basic {b64}")) {
            self.headers.insert(header::AUTHORIZATION, v);
        }
        self
    }

    /// Adds a header to every call (e.g. routing headers through a proxy).
    pub fn with_header(mut self, name: &str, value: &str) -> Result<Self, ClientError> {
        let n = HeaderName::from_bytes(name.as_bytes())
            .map_err(|_| ClientError::BadHeader(name.to_string()))?;
        let v =
            HeaderValue::from_str(value).map_err(|_| ClientError::BadHeader(name.to_string()))?;
        self.headers.insert(n, v);
        Ok(self)
    }

    fn request(&self, method: Method, path_and_query: &str, body: ReqBody) -> Request<ReqBody> {
        let mut req = Request::new(body);
        *req.method_mut() = method;
        *req.uri_mut() = format!("{}{}", self.scheme_authority, path_and_query)
            .parse()
            .unwrap_or_default();
        req.headers_mut().extend(self.headers.clone());
        req
    }

    async fn send(
        &self,
        path: &str,
        req: Request<ReqBody>,
    ) -> Result<http::Response<hyper::body::Incoming>, ClientError> {
        self.http
            .request(req)
            .await
            .map_err(|source| ClientError::Transport {
                path: path.to_string(),
                source,
            })
    }

    async fn error_from(path: &str, resp: http::Response<hyper::body::Incoming>) -> ClientError {
        let status = resp.status();
        let body = match resp.into_body().collect().await {
            Ok(b) => b.to_bytes(),
            Err(source) => {
                return ClientError::Body {
                    path: path.to_string(),
                    source,
                };
            }
        };
        Self::error_from_body(path, status, &body)
    }

    fn error_from_body(path: &str, status: StatusCode, body: &[u8]) -> ClientError {
        match ConnectError::from_json(body) {
            Some(source) => ClientError::Rpc {
                path: path.to_string(),
                source,
            },
            None => ClientError::Http {
                path: path.to_string(),
                status,
                body: String::from_utf8_lossy(body).chars().take(512).collect(),
            },
        }
    }

    /// One unary call, e.g. `unary("/process.Process/List", &ListRequest{})`.
    pub async fn unary<Req: ConnectMessage, Resp: ConnectMessage>(
        &self,
        path: &str,
        msg: &Req,
    ) -> Result<Resp, ClientError> {
        let body = Full::new(Bytes::from(msg.encode_to_vec()))
            .map_err(|never| match never {})
            .boxed_unsync();
        let mut req = self.request(Method::POST, path, body);
        req.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/proto"),
        );
        req.headers_mut()
            .insert("connect-protocol-version", HeaderValue::from_static("1"));
        let resp = self.send(path, req).await?;
        if resp.status() != StatusCode::OK {
            return Err(Self::error_from(path, resp).await);
        }
        let body = resp
            .into_body()
            .collect()
            .await
            .map_err(|source| ClientError::Body {
                path: path.to_string(),
                source,
            })?
            .to_bytes();
        Codec::Proto
            .decode(&body)
            .map_err(|e| ClientError::Protocol {
                path: path.to_string(),
                reason: e.message,
            })
    }

    async fn open_stream(
        &self,
        path: &str,
        body: ReqBody,
    ) -> Result<BoxStream<'static, Result<Envelope, ConnectError>>, ClientError> {
        let mut req = self.request(Method::POST, path, body);
        req.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/connect+proto"),
        );
        req.headers_mut()
            .insert("connect-protocol-version", HeaderValue::from_static("1"));
        let resp = self.send(path, req).await?;
        if resp.status() != StatusCode::OK {
            return Err(Self::error_from(path, resp).await);
        }
        Ok(envelope_stream(resp.into_body(), MAX_MESSAGE_BYTES))
    }

    /// A server-streaming call.
    pub async fn server_stream<Req: ConnectMessage, Resp: ConnectMessage>(
        &self,
        path: &str,
        msg: &Req,
    ) -> Result<ResponseStream<Resp>, ClientError> {
        let env = encode_envelope(0, &msg.encode_to_vec());
        let body = Full::new(env)
            .map_err(|never| match never {})
            .boxed_unsync();
        let inner = self.open_stream(path, body).await?;
        Ok(ResponseStream {
            inner,
            path: path.to_string(),
            done: false,
            _t: std::marker::PhantomData,
        })
    }

    /// A client-streaming call: sends every message of `msgs`, then reads
    /// the single response.
    pub async fn client_stream<Req, Resp, S>(
        &self,
        path: &str,
        msgs: S,
    ) -> Result<Resp, ClientError>
    where
        Req: ConnectMessage,
        Resp: ConnectMessage,
        S: Stream<Item = Req> + Send + 'static,
    {
        let frames =
            msgs.map(|m| Ok::<_, io::Error>(Frame::data(encode_envelope(0, &m.encode_to_vec()))));
        let body = StreamBody::new(frames).boxed_unsync();
        let inner = self.open_stream(path, body).await?;
        let mut rs: ResponseStream<Resp> = ResponseStream {
            inner,
            path: path.to_string(),
            done: false,
            _t: std::marker::PhantomData,
        };
        let first = rs.next().await.ok_or_else(|| ClientError::Protocol {
            path: path.to_string(),
            reason: "the response stream ended without a message".into(),
        })??;
        // Drain the end-of-stream envelope (and any error in it).
        while let Some(r) = rs.next().await {
            r?;
        }
        Ok(first)
    }

    // ------------------------------------------------------------ HTTP API

    /// `GET /health`: true on 204.
    pub async fn health(&self) -> Result<bool, ClientError> {
        let req = self.request(Method::GET, "/health", empty_body());
        let resp = self.send("/health", req).await?;
        Ok(resp.status() == StatusCode::NO_CONTENT)
    }

    /// `POST /init` with a JSON body such as
    /// `{"envVars":{...},"accessToken":"...","defaultUser":"user"}`.
    pub async fn init(&self, body: &serde_json::Value) -> Result<(), ClientError> {
        let bytes = serde_json::to_vec(body).unwrap_or_default();
        let mut req = self.request(
            Method::POST,
            "/init",
            Full::new(Bytes::from(bytes))
                .map_err(|never| match never {})
                .boxed_unsync(),
        );
        req.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        let resp = self.send("/init", req).await?;
        if !resp.status().is_success() {
            return Err(Self::error_from("/init", resp).await);
        }
        Ok(())
    }

    /// Uploads a byte stream to `remote_path` (`application/octet-stream`).
    pub async fn upload<S>(&self, remote_path: &str, data: S) -> Result<(), ClientError>
    where
        S: Stream<Item = io::Result<Bytes>> + Send + 'static,
    {
        let body = StreamBody::new(data.map_ok(Frame::data)).boxed_unsync();
        self.upload_body(remote_path, body).await
    }

    async fn upload_body(&self, remote_path: &str, body: ReqBody) -> Result<(), ClientError> {
        let pq = format!("/files?path={}", encode_query(remote_path));
        let mut req = self.request(Method::POST, &pq, body);
        req.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/octet-stream"),
        );
        let resp = self.send("/files", req).await?;
        if !resp.status().is_success() {
            return Err(Self::error_from("/files", resp).await);
        }
        let _ = resp.into_body().collect().await;
        Ok(())
    }

    /// Uploads a local file. A regular file goes from the page cache to the
    /// socket with `sendfile(2)` on a connection of its own; anything else
    /// (a pipe, a device) is streamed.
    pub async fn upload_file(&self, local: &Path, remote_path: &str) -> Result<(), ClientError> {
        self.upload_file_with_progress(local, remote_path, |_| {})
            .await
    }

    /// [`GuestClient::upload_file`], telling `progress` of every piece sent
    /// (in bytes).
    pub async fn upload_file_with_progress(
        &self,
        local: &Path,
        remote_path: &str,
        mut progress: impl FnMut(u64) + Send + 'static,
    ) -> Result<(), ClientError> {
        let local_err = |source| ClientError::Io {
            path: local.display().to_string(),
            source,
        };
        let file = std::fs::File::open(local).map_err(local_err)?;
        let md = file.metadata().map_err(local_err)?;
        if !md.is_file() {
            let stream = crate::fileio::read_stream(file).inspect(move |r| {
                if let Ok(b) = r {
                    progress(b.len() as u64);
                }
            });
            return self.upload(remote_path, stream).await;
        }
        let pq = format!("/files?path={}", encode_query(remote_path));
        let mut headers = self.headers.clone();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/octet-stream"),
        );
        let authority = self.authority.clone();
        let len = md.len();
        let answer = crate::rawfile::exchange(&self.authority, move |stream| {
            crate::rawfile::write_head(
                stream,
                &Method::POST,
                &pq,
                &authority,
                &headers,
                Some(len),
            )?;
            let sent = crate::rawfile::send_file(stream, &file, len, &mut progress);
            if let Ok(n) = sent
                && n < len
            {
                // The agent waits for bytes that will not come: give up.
                return Ok(Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!("the file shrank during the upload ({n} of {len} bytes sent)"),
                )));
            }
            // The agent may answer (and close) before taking the whole body,
            // e.g. when it refuses the upload: its answer says why.
            match (crate::rawfile::read_head(stream), sent) {
                (Ok((head, rest)), _) => {
                    let body = crate::rawfile::read_small_body(stream, &head, rest)?;
                    Ok(Ok((head.status, body)))
                }
                (Err(_), Err(e)) | (Err(e), Ok(_)) => Err(e),
            }
        })
        .await;
        match answer {
            Ok(Ok((status, _))) if status.is_success() => Ok(()),
            Ok(Ok((status, body))) => Err(Self::error_from_body("/files", status, &body)),
            Ok(Err(e)) => Err(local_err(e)),
            Err(source) => Err(ClientError::Transfer {
                path: "/files".into(),
                source,
            }),
        }
    }

    /// Downloads `remote_path` as a byte stream.
    pub async fn download(
        &self,
        remote_path: &str,
    ) -> Result<BoxStream<'static, Result<Bytes, ClientError>>, ClientError> {
        let pq = format!("/files?path={}", encode_query(remote_path));
        let req = self.request(Method::GET, &pq, empty_body());
        let resp = self.send("/files", req).await?;
        if resp.status() != StatusCode::OK {
            return Err(Self::error_from("/files", resp).await);
        }
        Ok(BodyStream::new(resp.into_body())
            .try_filter_map(|f| async move { Ok(f.into_data().ok()) })
            .map_err(|source| ClientError::Body {
                path: "/files".into(),
                source,
            })
            .boxed())
    }

    /// Downloads `remote_path` into a local file; returns the byte count.
    /// The body is spliced from the socket into the file (`splice(2)`), on a
    /// connection of its own. The file is created (or truncated) only once
    /// the agent answered with success.
    pub async fn download_to_file(
        &self,
        remote_path: &str,
        local: &Path,
    ) -> Result<u64, ClientError> {
        self.download_raw(remote_path, Dest::Path(local.to_path_buf()), |_| {})
            .await
    }

    /// Downloads `remote_path` into `file` (written from its current
    /// position), telling `progress` of every piece written; returns the
    /// byte count.
    pub async fn download_into(
        &self,
        remote_path: &str,
        file: std::fs::File,
        progress: impl FnMut(u64) + Send + 'static,
    ) -> Result<u64, ClientError> {
        self.download_raw(remote_path, Dest::File(file), progress)
            .await
    }

    async fn download_raw(
        &self,
        remote_path: &str,
        dest: Dest,
        mut progress: impl FnMut(u64) + Send + 'static,
    ) -> Result<u64, ClientError> {
        let pq = format!("/files?path={}", encode_query(remote_path));
        let headers = self.headers.clone();
        let authority = self.authority.clone();
        let local = match &dest {
            Dest::Path(p) => p.display().to_string(),
            Dest::File(_) => "the local file".to_string(),
        };
        let answer = crate::rawfile::exchange(&self.authority, move |stream| {
            crate::rawfile::write_head(stream, &Method::GET, &pq, &authority, &headers, None)?;
            let (head, rest) = crate::rawfile::read_head(stream)?;
            if head.status != StatusCode::OK {
                let body = crate::rawfile::read_small_body(stream, &head, rest)?;
                return Ok(Err((head.status, body)));
            }
            let mut file = match dest {
                Dest::File(f) => f,
                Dest::Path(p) => match std::fs::File::create(&p) {
                    Ok(f) => f,
                    Err(e) => return Ok(Ok(Err(e))),
                },
            };
            match crate::rawfile::receive_file(stream, &head, rest, &mut file, &mut progress) {
                Ok(n) => Ok(Ok(Ok(n))),
                Err(crate::splice::ReceiveError::Local(e)) => Ok(Ok(Err(e))),
                Err(crate::splice::ReceiveError::Peer(e)) => Err(e),
            }
        })
        .await;
        match answer {
            Ok(Ok(Ok(n))) => Ok(n),
            Ok(Ok(Err(source))) => Err(ClientError::Io {
                path: local,
                source,
            }),
            Ok(Err((status, body))) => Err(Self::error_from_body("/files", status, &body)),
            Err(source) => Err(ClientError::Transfer {
                path: "/files".into(),
                source,
            }),
        }
    }

    // ------------------------------------------------------------ process

    /// `Process/Start`.
    pub async fn start(
        &self,
        req: &pr::StartRequest,
    ) -> Result<ResponseStream<pr::StartResponse>, ClientError> {
        self.server_stream("/process.Process/Start", req).await
    }

    /// Runs `cmd args…` without stdin and collects its output.
    pub async fn run(&self, cmd: &str, args: &[&str]) -> Result<ProcessOutput, ClientError> {
        let req = pr::StartRequest {
            process: Some(pr::ProcessConfig {
                cmd: cmd.to_string(),
                args: args.iter().map(|a| a.to_string()).collect(),
                ..Default::default()
            }),
            stdin: Some(false),
            ..Default::default()
        };
        let stream = self.start(&req).await?;
        collect_output(stream.map(|r| r.map(|m| m.event))).await
    }

    /// `Process/Connect`.
    pub async fn connect(
        &self,
        process: pr::ProcessSelector,
    ) -> Result<ResponseStream<pr::ConnectResponse>, ClientError> {
        self.server_stream(
            "/process.Process/Connect",
            &pr::ConnectRequest {
                process: Some(process),
            },
        )
        .await
    }

    /// `Process/List`.
    pub async fn list(&self) -> Result<Vec<pr::ProcessInfo>, ClientError> {
        let r: pr::ListResponse = self
            .unary("/process.Process/List", &pr::ListRequest {})
            .await?;
        Ok(r.processes)
    }

    /// `Process/SendInput` (stdin bytes, or terminal bytes when `pty`).
    pub async fn send_input(
        &self,
        process: pr::ProcessSelector,
        data: Vec<u8>,
        pty: bool,
    ) -> Result<(), ClientError> {
        let input = if pty {
            pr::process_input::Input::Pty(data)
        } else {
            pr::process_input::Input::Stdin(data)
        };
        let _: pr::SendInputResponse = self
            .unary(
                "/process.Process/SendInput",
                &pr::SendInputRequest {
                    process: Some(process),
                    input: Some(pr::ProcessInput { input: Some(input) }),
                },
            )
            .await?;
        Ok(())
    }

    /// Opens a `Process/StreamInput` for `process`; returns a sender and
    /// the task that finishes the call once the sender is dropped.
    pub fn stream_input(
        &self,
        process: pr::ProcessSelector,
        pty: bool,
    ) -> (
        InputSender,
        tokio::task::JoinHandle<Result<(), ClientError>>,
    ) {
        let (tx, rx) = mpsc::channel::<Option<Vec<u8>>>(16);
        let start = pr::StreamInputRequest {
            event: Some(pr::stream_input_request::Event::Start(
                pr::stream_input_request::StartEvent {
                    process: Some(process),
                },
            )),
        };
        let data = tokio_stream::wrappers::ReceiverStream::new(rx).map(move |d| {
            let Some(d) = d else {
                return pr::StreamInputRequest {
                    event: Some(pr::stream_input_request::Event::Keepalive(
                        pr::stream_input_request::KeepAlive {},
                    )),
                };
            };
            let input = if pty {
                pr::process_input::Input::Pty(d)
            } else {
                pr::process_input::Input::Stdin(d)
            };
            pr::StreamInputRequest {
                event: Some(pr::stream_input_request::Event::Data(
                    pr::stream_input_request::DataEvent {
                        input: Some(pr::ProcessInput { input: Some(input) }),
                    },
                )),
            }
        });
        let msgs = futures::stream::iter([start]).chain(data);
        let this = self.clone();
        let task = tokio::spawn(async move {
            let _: pr::StreamInputResponse = this
                .client_stream("/process.Process/StreamInput", msgs)
                .await?;
            Ok(())
        });
        (InputSender { tx }, task)
    }

    /// `Process/SendSignal`.
    pub async fn send_signal(
        &self,
        process: pr::ProcessSelector,
        signal: pr::Signal,
    ) -> Result<(), ClientError> {
        let _: pr::SendSignalResponse = self
            .unary(
                "/process.Process/SendSignal",
                &pr::SendSignalRequest {
                    process: Some(process),
                    signal: signal as i32,
                },
            )
            .await?;
        Ok(())
    }

    /// `Process/CloseStdin`.
    pub async fn close_stdin(&self, process: pr::ProcessSelector) -> Result<(), ClientError> {
        let _: pr::CloseStdinResponse = self
            .unary(
                "/process.Process/CloseStdin",
                &pr::CloseStdinRequest {
                    process: Some(process),
                },
            )
            .await?;
        Ok(())
    }

    /// `Process/Update` with a new terminal size.
    pub async fn resize_pty(
        &self,
        process: pr::ProcessSelector,
        cols: u32,
        rows: u32,
    ) -> Result<(), ClientError> {
        let _: pr::UpdateResponse = self
            .unary(
                "/process.Process/Update",
                &pr::UpdateRequest {
                    process: Some(process),
                    pty: Some(pr::Pty {
                        size: Some(pr::pty::Size { cols, rows }),
                    }),
                },
            )
            .await?;
        Ok(())
    }

    // ------------------------------------------------------------ filesystem

    /// `Filesystem/Stat`.
    pub async fn stat(&self, path: &str) -> Result<fs::EntryInfo, ClientError> {
        let r: fs::StatResponse = self
            .unary(
                "/filesystem.Filesystem/Stat",
                &fs::StatRequest { path: path.into() },
            )
            .await?;
        r.entry.ok_or_else(|| ClientError::Protocol {
            path: "/filesystem.Filesystem/Stat".into(),
            reason: "no entry in the response".into(),
        })
    }

    /// `Filesystem/ListDir`.
    pub async fn list_dir(
        &self,
        path: &str,
        depth: u32,
    ) -> Result<Vec<fs::EntryInfo>, ClientError> {
        let r: fs::ListDirResponse = self
            .unary(
                "/filesystem.Filesystem/ListDir",
                &fs::ListDirRequest {
                    path: path.into(),
                    depth,
                },
            )
            .await?;
        Ok(r.entries)
    }

    /// `Filesystem/MakeDir`.
    pub async fn make_dir(&self, path: &str) -> Result<(), ClientError> {
        let _: fs::MakeDirResponse = self
            .unary(
                "/filesystem.Filesystem/MakeDir",
                &fs::MakeDirRequest { path: path.into() },
            )
            .await?;
        Ok(())
    }

    /// `Filesystem/Remove`.
    pub async fn remove(&self, path: &str) -> Result<(), ClientError> {
        let _: fs::RemoveResponse = self
            .unary(
                "/filesystem.Filesystem/Remove",
                &fs::RemoveRequest { path: path.into() },
            )
            .await?;
        Ok(())
    }
}

/// Sends input into an open `StreamInput` call.
#[derive(Debug, Clone)]
pub struct InputSender {
    tx: mpsc::Sender<Option<Vec<u8>>>,
}

impl InputSender {
    /// Queues bytes; false when the call has ended.
    pub async fn send(&self, data: Vec<u8>) -> bool {
        self.tx.send(Some(data)).await.is_ok()
    }

    /// Sends a keepalive message, which keeps proxies with an idle timeout
    /// from closing a quiet input stream; false when the call has ended.
    pub async fn keepalive(&self) -> bool {
        self.tx.send(None).await.is_ok()
    }
}

/// Output of [`GuestClient::run`].
#[derive(Debug, Clone, Default)]
pub struct ProcessOutput {
    pub pid: u32,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    pub pty: Vec<u8>,
    pub end: Option<pr::process_event::EndEvent>,
}

/// Collects a process event stream into its output and end event.
pub async fn collect_output<S>(mut events: S) -> Result<ProcessOutput, ClientError>
where
    S: Stream<Item = Result<Option<pr::ProcessEvent>, ClientError>> + Unpin,
{
    use pr::process_event::Event;
    use pr::process_event::data_event::Output;
    let mut out = ProcessOutput::default();
    while let Some(ev) = events.next().await {
        match ev?.and_then(|e| e.event) {
            Some(Event::Start(s)) => out.pid = s.pid,
            Some(Event::Data(d)) => match d.output {
                Some(Output::Stdout(b)) => out.stdout.extend_from_slice(&b),
                Some(Output::Stderr(b)) => out.stderr.extend_from_slice(&b),
                Some(Output::Pty(b)) => out.pty.extend_from_slice(&b),
                None => {}
            },
            Some(Event::End(e)) => out.end = Some(e),
            Some(Event::Keepalive(_)) | None => {}
        }
    }
    Ok(out)
}

/// Decoded messages of a streaming response; an error in the end-of-stream
/// envelope is yielded as the last item.
pub struct ResponseStream<T> {
    inner: BoxStream<'static, Result<Envelope, ConnectError>>,
    path: String,
    done: bool,
    _t: std::marker::PhantomData<fn() -> T>,
}

impl<T: ConnectMessage> Stream for ResponseStream<T> {
    type Item = Result<T, ClientError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if self.done {
            return Poll::Ready(None);
        }
        let path = self.path.clone();
        let proto = |reason: String| ClientError::Protocol {
            path: path.clone(),
            reason,
        };
        match self.inner.poll_next_unpin(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(None) => {
                self.done = true;
                Poll::Ready(Some(Err(proto(
                    "the stream ended without an end-of-stream envelope".into(),
                ))))
            }
            Poll::Ready(Some(Err(e))) => {
                self.done = true;
                Poll::Ready(Some(Err(ClientError::Rpc { path, source: e })))
            }
            Poll::Ready(Some(Ok(env))) => {
                if env.flags & FLAG_END_STREAM != 0 {
                    self.done = true;
                    return match parse_end_stream(&env.payload) {
                        Ok(None) => Poll::Ready(None),
                        Ok(Some(e)) => Poll::Ready(Some(Err(ClientError::Rpc { path, source: e }))),
                        Err(r) => Poll::Ready(Some(Err(proto(r)))),
                    };
                }
                Poll::Ready(Some(
                    Codec::Proto
                        .decode::<T>(&env.payload)
                        .map_err(|e| proto(e.message)),
                ))
            }
        }
    }
}

fn parse_end_stream(payload: &[u8]) -> Result<Option<ConnectError>, String> {
    if payload.is_empty() {
        return Ok(None);
    }
    let v: serde_json::Value =
        serde_json::from_slice(payload).map_err(|e| format!("end-of-stream is not JSON: {e}"))?;
    match v.get("error") {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(e) => {
            let code = e.get("code").and_then(|c| c.as_str()).unwrap_or("unknown");
            let message = e.get("message").and_then(|m| m.as_str()).unwrap_or("");
            Ok(Some(ConnectError::new(Code::parse(code), message)))
        }
    }
}

fn empty_body() -> ReqBody {
    Full::new(Bytes::new())
        .map_err(|never| match never {})
        .boxed_unsync()
}

/// Percent-encodes a query value.
fn encode_query(s: &str) -> String {
    let mut out = BytesMut::new();
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.~/".contains(&b) {
            out.extend_from_slice(&[b]);
        } else {
            out.extend_from_slice(format!("%{b:02X}").as_bytes());
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}
