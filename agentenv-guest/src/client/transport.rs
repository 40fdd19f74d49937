//! The client's connection to the agent: construction (HTTP/1.1 or h2c,
//! access token, user, extra headers), sending requests, turning failed
//! answers into [`ClientError`]s, and the two plain calls `/health` and
//! `/init`.

use std::io;

use base64::Engine as _;
use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Method, Request, StatusCode, Uri, header};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

use crate::connect::{Code, ConnectError};

/// The most bytes of an error response that are read.
const ERROR_BODY_LIMIT: usize = 64 * 1024;

/// Request body type of the client.
pub(super) type ReqBody = UnsyncBoxBody<Bytes, io::Error>;

/// A body of bytes in memory.
pub(super) fn full_body(data: impl Into<Bytes>) -> ReqBody {
    Full::new(data.into())
        .map_err(|never| match never {})
        .boxed_unsync()
}

/// An empty body.
pub(super) fn empty_body() -> ReqBody {
    full_body(Bytes::new())
}

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

/// How the client connects: plain TCP, or (feature `tls`) TCP or TLS by the
/// URL's scheme.
#[cfg(not(feature = "tls"))]
type Connector = HttpConnector;
#[cfg(feature = "tls")]
type Connector = hyper_rustls::HttpsConnector<HttpConnector>;

/// What verifies `https://` agent URLs (nothing without feature `tls`).
#[cfg(feature = "tls")]
type TlsConfig = std::sync::Arc<rustls::ClientConfig>;
#[cfg(not(feature = "tls"))]
type TlsConfig = std::convert::Infallible;

/// A client for one agent.
#[derive(Clone, Debug)]
pub struct GuestClient {
    scheme_authority: String,
    /// `host:port` of the agent.
    pub(super) authority: String,
    http: Client<Connector, ReqBody>,
    /// Sent with every call.
    pub(super) headers: HeaderMap,
}

impl GuestClient {
    /// HTTP/1.1 client for `base_url` (`http://host:port`).
    pub fn new(base_url: &str) -> Result<Self, ClientError> {
        Self::build(base_url, false, None)
    }

    /// HTTP/2 with prior knowledge (h2c): many calls over one connection.
    pub fn new_h2c(base_url: &str) -> Result<Self, ClientError> {
        Self::build(base_url, true, None)
    }

    /// HTTP/1.1 client for `base_url`, `http://` or `https://` (verified
    /// with `tls`, e.g. a TLS gateway in front of the agent).
    #[cfg(feature = "tls")]
    pub fn with_tls(base_url: &str, tls: TlsConfig) -> Result<Self, ClientError> {
        Self::build(base_url, false, Some(tls))
    }

    fn build(base_url: &str, h2: bool, tls: Option<TlsConfig>) -> Result<Self, ClientError> {
        let bad = |reason: &str| ClientError::BadUrl {
            url: base_url.to_string(),
            reason: reason.to_string(),
        };
        let uri: Uri = base_url
            .parse()
            .map_err(|e: http::uri::InvalidUri| bad(&e.to_string()))?;
        let scheme = match uri.scheme_str() {
            Some("http") => "http",
            #[cfg(feature = "tls")]
            Some("https") if tls.is_some() => "https",
            #[cfg(feature = "tls")]
            Some("https") => return Err(bad("https:// needs a TLS configuration")),
            _ => return Err(bad("only http:// is supported")),
        };
        let authority = uri.authority().ok_or_else(|| bad("no host"))?;
        let mut conn = HttpConnector::new();
        conn.set_nodelay(true);
        #[cfg(not(feature = "tls"))]
        let _ = tls;
        #[cfg(feature = "tls")]
        let conn = {
            conn.enforce_http(false);
            // A plain URL never handshakes: a config without roots serves it.
            let cfg = tls.unwrap_or_else(|| {
                std::sync::Arc::new(
                    rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(
                        rustls::crypto::ring::default_provider(),
                    ))
                    .with_safe_default_protocol_versions()
                    .expect("ring supports the default TLS versions")
                    .with_root_certificates(rustls::RootCertStore::empty())
                    .with_no_client_auth(),
                )
            });
            // hyper-rustls sets ALPN (http/1.1) itself.
            let mut cfg = (*cfg).clone();
            cfg.alpn_protocols.clear();
            hyper_rustls::HttpsConnectorBuilder::new()
                .with_tls_config(cfg)
                .https_or_http()
                .enable_http1()
                .wrap_connector(conn)
        };
        let mut b = Client::builder(TokioExecutor::new());
        if h2 {
            b.http2_only(true);
        } else {
            // Large reads for file downloads.
            b.http1_max_buf_size(1024 * 1024);
        }
        Ok(GuestClient {
            scheme_authority: format!("{scheme}://{authority}"),
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

    pub(super) fn request(
        &self,
        method: Method,
        path_and_query: &str,
        body: ReqBody,
    ) -> Request<ReqBody> {
        let mut req = Request::new(body);
        *req.method_mut() = method;
        *req.uri_mut() = format!("{}{}", self.scheme_authority, path_and_query)
            .parse()
            .unwrap_or_default();
        req.headers_mut().extend(self.headers.clone());
        req
    }

    pub(super) async fn send(
        &self,
        path: &str,
        req: Request<ReqBody>,
    ) -> Result<http::Response<Incoming>, ClientError> {
        self.http
            .request(req)
            .await
            .map_err(|source| ClientError::Transport {
                path: path.to_string(),
                source,
            })
    }

    pub(super) async fn error_from(path: &str, resp: http::Response<Incoming>) -> ClientError {
        let status = resp.status();
        // An error body is read up to a bound: the agent runs inside a sandbox
        // and is not trusted to keep it short.
        let mut body = resp.into_body();
        let mut buf = Vec::new();
        while buf.len() < ERROR_BODY_LIMIT {
            match body.frame().await {
                None => break,
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        let take = data.len().min(ERROR_BODY_LIMIT - buf.len());
                        buf.extend_from_slice(&data[..take]);
                    }
                }
                Some(Err(source)) => {
                    return ClientError::Body {
                        path: path.to_string(),
                        source,
                    };
                }
            }
        }
        Self::error_from_body(path, status, &buf)
    }

    pub(super) fn error_from_body(path: &str, status: StatusCode, body: &[u8]) -> ClientError {
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

    /// Sends a Connect call (a POST with a `content_type` body) and
    /// answers the response when its status is `200 OK`.
    pub(super) async fn post_connect(
        &self,
        path: &str,
        content_type: &'static str,
        body: ReqBody,
    ) -> Result<http::Response<Incoming>, ClientError> {
        let mut req = self.request(Method::POST, path, body);
        req.headers_mut()
            .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
        req.headers_mut()
            .insert("connect-protocol-version", HeaderValue::from_static("1"));
        let resp = self.send(path, req).await?;
        if resp.status() != StatusCode::OK {
            return Err(Self::error_from(path, resp).await);
        }
        Ok(resp)
    }

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
        let mut req = self.request(Method::POST, "/init", full_body(bytes));
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
}
