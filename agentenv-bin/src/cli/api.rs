//! The control-plane REST client (`X-API-Key`, JSON) and the data-plane client for one
//! sandbox's agent, routed through the same base URL by headers.

use std::time::Duration;

use agentenv_guest::client::GuestClient;
use bytes::Bytes;
use http::{Method, Request, StatusCode, header};
use http_body_util::{BodyExt, Full};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::credentials::Credentials;
use super::model::{ListedSandbox, NewSandbox, Refresh, Sandbox, SandboxDetail, Timeout};
use crate::http_client::{connector, error_chain};

/// The port of the in-sandbox agent.
pub const AGENT_PORT: u16 = 49983;
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
const REQUEST_TIMEOUT: Duration = Duration::from_secs(120);

/// Errors of control-plane calls.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error(
        "invalid server URL {url:?}: {reason}; run `aenv auth` with e.g. http://127.0.0.1:8000"
    )]
    BadUrl { url: String, reason: String },
    #[error(
        "cannot set up TLS for {url}: {reason} (the server's CA comes from SSL_CERT_FILE, else the system's bundle)"
    )]
    Tls { url: String, reason: String },
    #[error(
        "authentication failed (HTTP 401 Unauthorized){}; run `aenv auth` to update your API key",
        .0.as_deref().map(|m| format!(": {m}")).unwrap_or_default()
    )]
    Unauthorized(Option<String>),
    #[error(
        "cannot reach the server at {url}: {reason}; is it running? (change the URL with `aenv auth`)"
    )]
    Unreachable { url: String, reason: String },
    #[error(
        "the server at {url} is not trusted: {reason}; set SSL_CERT_FILE to the CA file that signed its certificate (`agentenv up --tls` prints it)"
    )]
    Untrusted { url: String, reason: String },
    #[error("the server at {url} did not answer within {secs} s")]
    Timeout { url: String, secs: u64 },
    #[error("the sandbox ID is empty; list sandboxes with `aenv ls`")]
    EmptyId,
    #[error("sandbox {0} not found; list sandboxes with `aenv ls`")]
    SandboxNotFound(String),
    #[error("the server does not support {what} ({method} {path} answered 404: {message})")]
    Unsupported {
        what: String,
        method: String,
        path: String,
        message: String,
    },
    #[error("HTTP {status}: {message}")]
    Status { status: u16, message: String },
    #[error("bad response from {path}: {reason}")]
    BadResponse { path: String, reason: String },
}

/// A control-plane response: status, headers, body.
struct Reply {
    status: StatusCode,
    headers: http::HeaderMap,
    body: Bytes,
}

impl Reply {
    /// The body as `T`; an empty body reads as JSON `null`.
    fn json<T: DeserializeOwned>(&self, path: &str) -> Result<T, ApiError> {
        let body: &[u8] = if self.body.is_empty() {
            b"null"
        } else {
            &self.body
        };
        serde_json::from_slice(body).map_err(|e| ApiError::BadResponse {
            path: path.to_string(),
            reason: e.to_string(),
        })
    }

    /// The `x-next-token` header of a list page, when there are more pages.
    fn next_token(&self) -> Option<String> {
        self.headers
            .get("x-next-token")
            .and_then(|v| v.to_str().ok())
            .filter(|v| !v.is_empty())
            .map(str::to_string)
    }
}

/// A streamed request body.
type UploadBody = http_body_util::combinators::BoxBody<Bytes, std::io::Error>;

/// Largest chunk of an upload read at once.
const UPLOAD_CHUNK: usize = 256 * 1024;

/// A request body as JSON.
fn encode(body: &impl Serialize) -> Vec<u8> {
    serde_json::to_vec(body).unwrap_or_default()
}

/// The client of one server (gateway or node).
#[derive(Clone)]
pub struct Api {
    base: String,
    key: String,
    http: Client<HttpsConnector<HttpConnector>, Full<Bytes>>,
    /// For uploads to signed links (streamed bodies, no API key).
    upload: Client<HttpsConnector<HttpConnector>, UploadBody>,
    /// For `https://` servers: the system's CAs (or `SSL_CERT_FILE`).
    tls: Option<std::sync::Arc<rustls::ClientConfig>>,
}

impl Api {
    /// A client for `creds.url` with `creds.api_key`.
    pub fn new(creds: &Credentials) -> Result<Api, ApiError> {
        let base = creds.url.trim().trim_end_matches('/').to_string();
        let uri: http::Uri = base
            .parse()
            .map_err(|e: http::uri::InvalidUri| ApiError::BadUrl {
                url: base.clone(),
                reason: e.to_string(),
            })?;
        let https = match uri.scheme_str() {
            Some("http") => false,
            Some("https") => true,
            _ => {
                return Err(ApiError::BadUrl {
                    url: base,
                    reason: "use an http:// or https:// URL".into(),
                });
            }
        };
        if uri.authority().is_none() {
            return Err(ApiError::BadUrl {
                url: base,
                reason: "the URL names no host".into(),
            });
        }
        // The system's CAs are read only for an https:// server.
        let tls = if https {
            Some(
                agentenv_core::tls::system_client_config(&[b"http/1.1"]).map_err(|e| {
                    ApiError::Tls {
                        url: base.clone(),
                        reason: e.to_string(),
                    }
                })?,
            )
        } else {
            None
        };
        let cfg = match &tls {
            Some(c) => (**c).clone(),
            None => rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(
                rustls::crypto::ring::default_provider(),
            ))
            .with_safe_default_protocol_versions()
            .map_err(|e| ApiError::Tls {
                url: base.clone(),
                reason: e.to_string(),
            })?
            .with_root_certificates(rustls::RootCertStore::empty())
            .with_no_client_auth(),
        };
        // hyper-rustls sets ALPN (http/1.1) itself.
        let mut cfg = cfg;
        cfg.alpn_protocols.clear();
        let mut conn = connector(Some(CONNECT_TIMEOUT));
        conn.enforce_http(false);
        let conn = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(cfg)
            .https_or_http()
            .enable_http1()
            .wrap_connector(conn);
        let http = Client::builder(TokioExecutor::new()).build(conn.clone());
        let upload = Client::builder(TokioExecutor::new()).build(conn);
        Ok(Api {
            base,
            key: creds.api_key.clone(),
            http,
            upload,
            tls,
        })
    }

    /// The base URL.
    pub fn base(&self) -> &str {
        &self.base
    }

    async fn call(
        &self,
        method: Method,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> Result<Reply, ApiError> {
        let url = format!("{}{}", self.base, path);
        let mut b = Request::builder()
            .method(method)
            .uri(&url)
            .header("x-api-key", &self.key)
            .header(
                header::USER_AGENT,
                concat!("aenv/", env!("CARGO_PKG_VERSION")),
            );
        let bytes = match body {
            Some(v) => {
                b = b.header(header::CONTENT_TYPE, "application/json");
                Bytes::from(v)
            }
            None => Bytes::new(),
        };
        let req = b.body(Full::new(bytes)).map_err(|e| ApiError::BadUrl {
            url: url.clone(),
            reason: e.to_string(),
        })?;
        let fut = async {
            let resp = self.http.request(req).await.map_err(|e| {
                let reason = error_chain(&e);
                if reason.contains("invalid peer certificate") {
                    ApiError::Untrusted {
                        url: url.clone(),
                        reason,
                    }
                } else {
                    ApiError::Unreachable {
                        url: url.clone(),
                        reason,
                    }
                }
            })?;
            let (parts, body) = resp.into_parts();
            let body = body
                .collect()
                .await
                .map_err(|e| ApiError::Unreachable {
                    url: url.clone(),
                    reason: format!("reading the response: {e}"),
                })?
                .to_bytes();
            Ok(Reply {
                status: parts.status,
                headers: parts.headers,
                body,
            })
        };
        match tokio::time::timeout(REQUEST_TIMEOUT, fut).await {
            Ok(r) => r,
            Err(_) => Err(ApiError::Timeout {
                url,
                secs: REQUEST_TIMEOUT.as_secs(),
            }),
        }
    }

    /// A call that must succeed; a 404 on a sandbox path means the sandbox is gone.
    async fn ok(
        &self,
        method: Method,
        path: &str,
        body: Option<Vec<u8>>,
        sandbox: Option<&str>,
    ) -> Result<Reply, ApiError> {
        if sandbox.is_some_and(|id| id.trim().is_empty()) {
            return Err(ApiError::EmptyId);
        }
        let r = self.call(method.clone(), path, body).await?;
        if r.status.is_success() {
            return Ok(r);
        }
        let message = error_message(&r.body);
        Err(match r.status {
            StatusCode::UNAUTHORIZED => {
                ApiError::Unauthorized(Some(message).filter(|m| !m.is_empty()))
            }
            StatusCode::NOT_FOUND if message.starts_with("route not found") => {
                ApiError::Unsupported {
                    what: describe(path).into(),
                    method: method.to_string(),
                    path: path.to_string(),
                    message,
                }
            }
            StatusCode::NOT_FOUND if sandbox.is_some() => {
                ApiError::SandboxNotFound(sandbox.unwrap_or_default().to_string())
            }
            s => ApiError::Status {
                status: s.as_u16(),
                message,
            },
        })
    }

    /// `method path` with a JSON `body` whose answer is a stream of JSON lines: each line
    /// is handed to `on_line` as it arrives (no overall timeout: the server reports
    /// progress; `idle` bounds the wait for the next line). A refusal is an error with the
    /// server's message.
    pub async fn stream_lines(
        &self,
        method: Method,
        path: &str,
        body: &impl Serialize,
        idle: Duration,
        mut on_line: impl FnMut(&[u8]),
    ) -> Result<(), ApiError> {
        let url = format!("{}{}", self.base, path);
        let req = Request::builder()
            .method(method.clone())
            .uri(&url)
            .header("x-api-key", &self.key)
            .header(header::CONTENT_TYPE, "application/json")
            .header(
                header::USER_AGENT,
                concat!("aenv/", env!("CARGO_PKG_VERSION")),
            )
            .body(Full::new(Bytes::from(encode(body))))
            .map_err(|e| ApiError::BadUrl {
                url: url.clone(),
                reason: e.to_string(),
            })?;
        let unreachable = |reason: String| ApiError::Unreachable {
            url: url.clone(),
            reason,
        };
        let resp = tokio::time::timeout(REQUEST_TIMEOUT, self.http.request(req))
            .await
            .map_err(|_| ApiError::Timeout {
                url: url.clone(),
                secs: REQUEST_TIMEOUT.as_secs(),
            })?
            .map_err(|e| unreachable(error_chain(&e)))?;
        let (parts, mut body) = resp.into_parts();
        if !parts.status.is_success() {
            let bytes = body
                .collect()
                .await
                .map_err(|e| unreachable(format!("reading the response: {e}")))?
                .to_bytes();
            let message = error_message(&bytes);
            return Err(match parts.status {
                StatusCode::UNAUTHORIZED => {
                    ApiError::Unauthorized(Some(message).filter(|m| !m.is_empty()))
                }
                s => ApiError::Status {
                    status: s.as_u16(),
                    message,
                },
            });
        }
        let mut pending: Vec<u8> = Vec::new();
        loop {
            let frame = tokio::time::timeout(idle, body.frame())
                .await
                .map_err(|_| ApiError::Timeout {
                    url: url.clone(),
                    secs: idle.as_secs(),
                })?;
            let Some(frame) = frame else { break };
            let frame = frame.map_err(|e| unreachable(format!("reading the response: {e}")))?;
            let Ok(data) = frame.into_data() else {
                continue;
            };
            pending.extend_from_slice(&data);
            while let Some(i) = pending.iter().position(|b| *b == b'\n') {
                let line: Vec<u8> = pending.drain(..=i).collect();
                on_line(line[..i].trim_ascii());
            }
        }
        if !pending.trim_ascii().is_empty() {
            on_line(pending.trim_ascii());
        }
        Ok(())
    }

    /// Checks the URL and key with an authenticated call (`GET /v2/sandboxes?limit=1`).
    pub async fn verify(&self) -> Result<(), ApiError> {
        self.ok(Method::GET, "/v2/sandboxes?limit=1", None, None)
            .await
            .map(|_| ())
    }

    /// `PUT` of the file at `path` (`len` bytes) to the absolute `url` (a signed upload
    /// link: no API key), streamed with `Content-Length`; same TLS trust as the API.
    pub async fn put_file(
        &self,
        url: &str,
        path: &std::path::Path,
        len: u64,
    ) -> Result<(), ApiError> {
        let file = tokio::fs::File::open(path)
            .await
            .map_err(|e| ApiError::Unreachable {
                url: url.to_string(),
                reason: format!("opening {}: {e}", path.display()),
            })?;
        let stream = futures::stream::unfold(file, |mut f| async move {
            use tokio::io::AsyncReadExt;
            let mut buf = vec![0u8; UPLOAD_CHUNK];
            match f.read(&mut buf).await {
                Ok(0) => None,
                Ok(n) => {
                    buf.truncate(n);
                    Some((Ok(hyper::body::Frame::data(Bytes::from(buf))), f))
                }
                Err(e) => Some((Err(e), f)),
            }
        });
        let body = BodyExt::boxed(http_body_util::StreamBody::new(stream));
        let req = Request::builder()
            .method(Method::PUT)
            .uri(url)
            .header(header::CONTENT_LENGTH, len)
            .header(
                header::USER_AGENT,
                concat!("aenv/", env!("CARGO_PKG_VERSION")),
            )
            .body(body)
            .map_err(|e| ApiError::BadUrl {
                url: url.to_string(),
                reason: e.to_string(),
            })?;
        let resp = self.upload.request(req).await.map_err(|e| {
            let reason = error_chain(&e);
            if reason.contains("invalid peer certificate") {
                ApiError::Untrusted {
                    url: url.to_string(),
                    reason,
                }
            } else {
                ApiError::Unreachable {
                    url: url.to_string(),
                    reason,
                }
            }
        })?;
        let status = resp.status();
        let body = tokio::time::timeout(REQUEST_TIMEOUT, resp.into_body().collect())
            .await
            .ok()
            .and_then(Result::ok)
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        if status.is_success() {
            return Ok(());
        }
        Err(ApiError::Status {
            status: status.as_u16(),
            message: format!("uploading the files: {}", error_message(&body)),
        })
    }

    /// A call whose answer is `T` as JSON (an empty answer reads as `null`).
    pub async fn send<T: DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        body: Option<&impl Serialize>,
    ) -> Result<T, ApiError> {
        self.ok(method, path, body.map(encode), None)
            .await?
            .json(path)
    }

    /// `GET path` answered by `T` as JSON.
    pub async fn get_json<T: DeserializeOwned>(&self, path: &str) -> Result<T, ApiError> {
        self.send(Method::GET, path, None::<&()>).await
    }

    /// Every item of a list at `path?query`, following `x-next-token` across pages.
    pub async fn all_pages<T: DeserializeOwned>(
        &self,
        path: &str,
        query: &[(String, String)],
    ) -> Result<Vec<T>, ApiError> {
        let mut out = Vec::new();
        let mut token: Option<String> = None;
        loop {
            let mut q = query.to_vec();
            if let Some(t) = token {
                q.push(("nextToken".into(), t));
            }
            let page_path = format!("{path}?{}", encode_query(&q));
            let r = self.ok(Method::GET, &page_path, None, None).await?;
            out.extend(r.json::<Vec<T>>(&page_path)?);
            token = r.next_token();
            if token.is_none() {
                return Ok(out);
            }
        }
    }

    /// Every sandbox matching `query`, `page_size` a request.
    pub async fn list_all(
        &self,
        query: &[(String, String)],
        page_size: u32,
    ) -> Result<Vec<ListedSandbox>, ApiError> {
        let mut q = query.to_vec();
        q.push(("limit".into(), page_size.to_string()));
        self.all_pages("/v2/sandboxes", &q).await
    }

    /// A call on sandbox `id` at `/sandboxes/{id}{rest}`; the answer and the path.
    async fn on_sandbox(
        &self,
        method: Method,
        id: &str,
        rest: &str,
        body: Option<Vec<u8>>,
    ) -> Result<(Reply, String), ApiError> {
        let path = format!("/sandboxes/{}{rest}", seg(id));
        let r = self.ok(method, &path, body, Some(id)).await?;
        Ok((r, path))
    }

    /// `GET /sandboxes/{id}`.
    pub async fn get(&self, id: &str) -> Result<SandboxDetail, ApiError> {
        let (r, path) = self.on_sandbox(Method::GET, id, "", None).await?;
        r.json(&path)
    }

    /// `GET /sandboxes/{id}`, `None` when it does not exist.
    pub async fn get_opt(&self, id: &str) -> Result<Option<SandboxDetail>, ApiError> {
        match self.get(id).await {
            Ok(d) => Ok(Some(d)),
            Err(ApiError::SandboxNotFound(_)) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// `POST /sandboxes`, or `POST /sandboxes-cold` for `body.image`.
    pub async fn create(&self, body: &NewSandbox) -> Result<Sandbox, ApiError> {
        let path = if body.image.is_some() {
            "/sandboxes-cold"
        } else {
            "/sandboxes"
        };
        self.send(Method::POST, path, Some(body)).await
    }

    /// `POST /sandboxes/{id}/connect` (resumes a paused sandbox).
    pub async fn connect(&self, id: &str, timeout: u64) -> Result<Sandbox, ApiError> {
        let body = encode(&Timeout { timeout });
        let (r, path) = self
            .on_sandbox(Method::POST, id, "/connect", Some(body))
            .await?;
        r.json(&path)
    }

    /// `POST /sandboxes/{id}/pause`.
    pub async fn pause(&self, id: &str) -> Result<(), ApiError> {
        self.on_sandbox(Method::POST, id, "/pause", None)
            .await
            .map(drop)
    }

    /// `POST /sandboxes/{id}/timeout`.
    pub async fn set_timeout(&self, id: &str, secs: u64) -> Result<(), ApiError> {
        let body = encode(&Timeout { timeout: secs });
        self.on_sandbox(Method::POST, id, "/timeout", Some(body))
            .await
            .map(drop)
    }

    /// `POST /sandboxes/{id}/refreshes`.
    pub async fn refresh(&self, id: &str, secs: u64) -> Result<(), ApiError> {
        let body = encode(&Refresh { duration: secs });
        self.on_sandbox(Method::POST, id, "/refreshes", Some(body))
            .await
            .map(drop)
    }

    /// `DELETE /sandboxes/{id}`.
    pub async fn delete(&self, id: &str) -> Result<(), ApiError> {
        self.on_sandbox(Method::DELETE, id, "", None)
            .await
            .map(drop)
    }

    /// A data-plane client for the agent of sandbox `id`, through the same base URL.
    pub fn agent(&self, id: &str, token: Option<&str>) -> Result<GuestClient, ApiError> {
        let bad = |e: agentenv_guest::client::ClientError| ApiError::BadUrl {
            url: self.base.clone(),
            reason: e.to_string(),
        };
        let c = match &self.tls {
            Some(tls) => GuestClient::with_tls(&self.base, tls.clone()),
            None => GuestClient::new(&self.base),
        };
        let mut c = c
            .map_err(bad)?
            .with_header("x-agentenv-sandbox-id", id)
            .map_err(bad)?
            .with_header("x-agentenv-target-port", &AGENT_PORT.to_string())
            .map_err(bad)?
            .with_header("user-agent", concat!("aenv/", env!("CARGO_PKG_VERSION")))
            .map_err(bad)?;
        if let Some(t) = token {
            c = c.with_access_token(t);
        }
        Ok(c)
    }
}

/// What a call is about, for the message of a route the server does not have.
fn describe(path: &str) -> &'static str {
    let p = path.split('?').next().unwrap_or(path);
    if p.contains("snapshots") {
        "snapshots"
    } else if p.contains("templates") {
        "templates"
    } else if p.starts_with("/nodes/") && p.ends_with("/drain") {
        "draining nodes"
    } else {
        "this call"
    }
}

/// The message of an error body: JSON `.message`, else the trimmed text.
pub fn error_message(body: &[u8]) -> String {
    if let Ok(v) = serde_json::from_slice::<serde_json::Value>(body)
        && let Some(m) = v.get("message").and_then(|m| m.as_str())
    {
        return m.to_string();
    }
    String::from_utf8_lossy(body)
        .trim()
        .chars()
        .take(512)
        .collect()
}

/// Percent-encodes one path segment.
pub fn seg(s: &str) -> String {
    escape(s, b"-_.~")
}

fn escape(s: &str, keep: &[u8]) -> String {
    let mut out = String::new();
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || keep.contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Encodes query pairs.
pub fn encode_query(q: &[(String, String)]) -> String {
    q.iter()
        .map(|(k, v)| format!("{}={}", escape(k, b"-_.~"), escape(v, b"-_.~")))
        .collect::<Vec<_>>()
        .join("&")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_401_message_says_to_run_auth() {
        assert_eq!(
            ApiError::Unauthorized(None).to_string(),
            "authentication failed (HTTP 401 Unauthorized); run `aenv auth` to update your API key"
        );
        assert_eq!(
            ApiError::Unauthorized(Some("bad key".into())).to_string(),
            "authentication failed (HTTP 401 Unauthorized): bad key; run `aenv auth` to update your API key"
        );
    }

    #[test]
    fn error_bodies_render_json_message_or_trimmed_text() {
        assert_eq!(error_message(br#"{"code":404,"message":"nope"}"#), "nope");
        assert_eq!(error_message(b"  plain\n"), "plain");
        assert_eq!(error_message(b""), "");
    }

    #[test]
    fn queries_are_percent_encoded() {
        let q = vec![("metadata".to_string(), "a=b&c=d".to_string())];
        assert_eq!(encode_query(&q), "metadata=a%3Db%26c%3Dd");
    }
}
