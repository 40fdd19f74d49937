//! The one HTTP/1.1 client of `agentenv up` and the cross-process tests: a request to an
//! address on this machine ([`Target`]: plain HTTP, or TLS verified with a given
//! configuration), its whole answer read within a time limit. It is hyper-util's client,
//! as the CLI's REST client ([`crate::cli::api`]) uses, with pooling off: each request has
//! a connection of its own and asks for it to be closed (`Connection: close`).
//!
//! [`request`] is async; [`blocking_request`] serves synchronous callers (tests), also
//! from inside an async runtime, by running the request on a runtime of its own.

use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, header};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::{Connect, HttpConnector};
use hyper_util::rt::TokioExecutor;

/// Where a request goes: an address on this machine, over plain HTTP or over TLS
/// verified with a client configuration (the server's certificate must name the
/// address's IP).
#[derive(Clone)]
pub struct Target {
    pub addr: SocketAddr,
    tls: Option<Arc<rustls::ClientConfig>>,
}

impl Target {
    /// `addr` over TLS, verified with `tls`.
    pub fn tls(addr: SocketAddr, tls: Arc<rustls::ClientConfig>) -> Self {
        Self {
            addr,
            tls: Some(tls),
        }
    }

    /// The same target at another address (e.g. a node of the same cluster).
    pub fn at(&self, addr: SocketAddr) -> Self {
        Self {
            addr,
            tls: self.tls.clone(),
        }
    }

    /// The TLS configuration, when the target speaks TLS.
    pub fn tls_config(&self) -> Option<&Arc<rustls::ClientConfig>> {
        self.tls.as_ref()
    }

    /// `http://addr` or `https://addr`.
    pub fn url(&self) -> String {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        format!("{scheme}://{}", self.addr)
    }
}

impl From<SocketAddr> for Target {
    fn from(addr: SocketAddr) -> Self {
        Self { addr, tls: None }
    }
}

impl std::fmt::Debug for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.url())
    }
}

/// Errors of one HTTP exchange.
#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    #[error("cannot connect to {addr}: {reason}")]
    Connect { addr: SocketAddr, reason: String },
    #[error("{method} {path} on {addr}: {reason}")]
    Exchange {
        method: String,
        path: String,
        addr: SocketAddr,
        reason: String,
    },
    #[error("{method} {path} on {addr}: no answer within {timeout:?}")]
    Timeout {
        method: String,
        path: String,
        addr: SocketAddr,
        timeout: Duration,
    },
}

/// A response: status, lower-cased headers and the whole body.
#[derive(Debug, Clone)]
pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Response {
    /// The body as `T` (`None` when it is not that JSON).
    pub fn json<T: serde::de::DeserializeOwned>(&self) -> Option<T> {
        serde_json::from_slice(&self.body).ok()
    }

    /// The body as text (invalid UTF-8 replaced).
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// A connector with `TCP_NODELAY` and, when given, a limit on connecting.
pub fn connector(connect_timeout: Option<Duration>) -> HttpConnector {
    let mut conn = HttpConnector::new();
    conn.set_nodelay(true);
    conn.set_connect_timeout(connect_timeout);
    conn
}

/// An error and its causes on one line (`a: b: c`), each cause once.
pub fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        let m = c.to_string();
        if !s.contains(&m) {
            s.push_str(": ");
            s.push_str(&m);
        }
        cur = c.source();
    }
    s
}

/// Sends one request to `target` and reads the whole response, all within `timeout`.
/// `headers` are sent as given (a `Host` header names the address).
pub async fn request(
    target: impl Into<Target>,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
    timeout: Duration,
) -> Result<Response, HttpError> {
    let target = target.into();
    let addr = target.addr;
    let exchange_err = |reason: String| HttpError::Exchange {
        method: method.into(),
        path: path.into(),
        addr,
        reason,
    };
    let method_v = Method::from_bytes(method.as_bytes())
        .map_err(|e| exchange_err(format!("bad method: {e}")))?;
    let mut req = Request::builder()
        .method(method_v)
        .uri(format!("{}{path}", target.url()))
        .header(header::CONNECTION, "close");
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let req = req
        .body(Full::new(Bytes::copy_from_slice(body)))
        .map_err(|e| exchange_err(format!("bad request: {e}")))?;
    let exchange = async {
        let resp = match &target.tls {
            None => send(connector(None), req).await,
            Some(tls) => {
                let mut http = connector(None);
                http.enforce_http(false);
                // hyper-rustls sets ALPN (http/1.1) itself.
                let mut cfg = (**tls).clone();
                cfg.alpn_protocols.clear();
                let https = hyper_rustls::HttpsConnectorBuilder::new()
                    .with_tls_config(cfg)
                    .https_only()
                    .enable_http1()
                    .wrap_connector(http);
                send(https, req).await
            }
        };
        let resp = resp.map_err(|e| {
            if e.is_connect() {
                HttpError::Connect {
                    addr,
                    reason: error_chain(&e),
                }
            } else {
                exchange_err(error_chain(&e))
            }
        })?;
        let (parts, body) = resp.into_parts();
        let body = body
            .collect()
            .await
            .map_err(|e| exchange_err(format!("reading the response: {}", error_chain(&e))))?
            .to_bytes();
        let headers = parts
            .headers
            .iter()
            .map(|(k, v)| {
                (
                    k.as_str().to_string(),
                    String::from_utf8_lossy(v.as_bytes()).trim().to_string(),
                )
            })
            .collect();
        Ok(Response {
            status: parts.status.as_u16(),
            headers,
            body: body.to_vec(),
        })
    };
    tokio::time::timeout(timeout, exchange)
        .await
        .map_err(|_| HttpError::Timeout {
            method: method.into(),
            path: path.into(),
            addr,
            timeout,
        })?
}

/// Sends `req` on a connection of its own made by `conn`.
async fn send<C>(
    conn: C,
    req: Request<Full<Bytes>>,
) -> Result<http::Response<hyper::body::Incoming>, hyper_util::client::legacy::Error>
where
    C: Connect + Clone + Send + Sync + 'static,
{
    let client: Client<C, Full<Bytes>> = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(0)
        .build(conn);
    client.request(req).await
}

/// [`request`] for synchronous callers: the request runs on a runtime thread of this
/// module while the caller blocks, so it may be called inside an async runtime too.
pub fn blocking_request(
    target: impl Into<Target>,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
    timeout: Duration,
) -> Result<Response, HttpError> {
    static RUNTIME: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    let rt = RUNTIME.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("http-client")
            .enable_all()
            .build()
            .expect("starting the HTTP client's runtime")
    });
    let target = target.into();
    let (method, path, body) = (method.to_string(), path.to_string(), body.to_vec());
    let headers: Vec<(String, String)> = headers
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    rt.spawn(async move {
        let headers: Vec<(&str, &str)> = headers
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        let _ = tx.send(request(target, &method, &path, &headers, &body, timeout).await);
    });
    rx.recv()
        .expect("the HTTP client's runtime answers every request")
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A one-shot server that answers `raw` and returns what it was sent.
    async fn serve_once(raw: &'static [u8]) -> (SocketAddr, tokio::task::JoinHandle<String>) {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let task = tokio::spawn(async move {
            let (mut s, _) = l.accept().await.unwrap();
            let mut got = Vec::new();
            let mut buf = [0u8; 4096];
            while !got.windows(4).any(|w| w == b"\r\n\r\n") {
                let n = s.read(&mut buf).await.unwrap();
                got.extend_from_slice(&buf[..n]);
            }
            s.write_all(raw).await.unwrap();
            String::from_utf8_lossy(&got).into_owned()
        });
        (addr, task)
    }

    #[tokio::test]
    async fn chunked_answers_are_joined_and_the_connection_is_closed() {
        let (addr, sent) = serve_once(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nX-A: b\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n",
        )
        .await;
        let r = request(
            addr,
            "GET",
            "/x?y=1",
            &[("x-api-key", "k")],
            b"",
            Duration::from_secs(5),
        )
        .await
        .unwrap();
        assert_eq!((r.status, r.text().as_str()), (200, "abcde"));
        assert!(r.headers.contains(&("x-a".into(), "b".into())));
        let sent = sent.await.unwrap().to_ascii_lowercase();
        assert!(sent.starts_with("get /x?y=1 http/1.1\r\n"), "{sent}");
        for h in [
            "connection: close",
            "x-api-key: k",
            &format!("host: {addr}"),
        ] {
            assert!(sent.contains(h), "{h} missing in {sent}");
        }
    }

    #[test]
    fn blocking_requests_work_inside_a_runtime_and_time_out() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let (addr, _task) = serve_once(b"HTTP/1.1 204 No Content\r\n\r\n").await;
            // The server task runs on this runtime: let it accept while we block.
            let r = tokio::task::spawn_blocking(move || {
                blocking_request(addr, "DELETE", "/s", &[], b"", Duration::from_secs(5))
            });
            assert_eq!(r.await.unwrap().unwrap().status, 204);
            let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = silent.local_addr().unwrap();
            let e = blocking_request(addr, "GET", "/", &[], b"", Duration::from_millis(200));
            assert!(matches!(e, Err(HttpError::Timeout { .. })), "{e:?}");
            drop(silent);
            let e = blocking_request(addr, "GET", "/", &[], b"", Duration::from_secs(5));
            assert!(matches!(e, Err(HttpError::Connect { .. })), "{e:?}");
        });
    }
}
