//! The gateway's own TLS listener: clients trusting a private CA are served
//! over TLS, a renewed certificate is picked up by `reload` for new
//! handshakes while an open connection keeps working, and a broken renewal
//! leaves the old certificate in use; HTTP/1.1 over TLS takes the fast lane
//! and HTTP/2 (by ALPN) hyper, and nodes are told `X-Forwarded-Proto: https`.

mod common;

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;

use agentenv_core::tls::{ReloadingCert, server_config};
use agentenv_proxy::Gateway;
use bytes::Bytes;
use common::*;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::TokioIo;
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};
use rustls::RootCertStore;
use rustls::pki_types::{CertificateDer, ServerName};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsConnector;

struct Ca {
    issuer: Issuer<'static, KeyPair>,
    der: CertificateDer<'static>,
}

impl Ca {
    fn new() -> Self {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(DnType::CommonName, "listener test CA");
        let cert = params.self_signed(&key).unwrap();
        Self {
            issuer: Issuer::new(params, key),
            der: cert.der().clone(),
        }
    }

    /// Writes a leaf for 127.0.0.1 named `cn` into `dir`/cert.pem and key.pem.
    fn issue(&self, dir: &Path, cn: &str) {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(vec!["127.0.0.1".to_string()]).unwrap();
        params.distinguished_name.push(DnType::CommonName, cn);
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        std::fs::write(dir.join("cert.pem"), cert.pem()).unwrap();
        std::fs::write(dir.join("key.pem"), key.serialize_pem()).unwrap();
    }

    fn connector(&self) -> TlsConnector {
        TlsConnector::from(self.client_config())
    }

    fn client_config(&self) -> Arc<rustls::ClientConfig> {
        let mut roots = RootCertStore::empty();
        roots.add(self.der.clone()).unwrap();
        let cfg = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
        // Every handshake is a full one: a resumed session shows no certificate.
        let mut cfg = cfg;
        cfg.resumption = rustls::client::Resumption::disabled();
        Arc::new(cfg)
    }
}

/// An HTTP/1.1 connection over TLS, and the certificate the server showed.
async fn connect(
    connector: &TlsConnector,
    addr: SocketAddr,
) -> (
    hyper::client::conn::http1::SendRequest<Empty<Bytes>>,
    Vec<u8>,
) {
    let tcp = TcpStream::connect(addr).await.unwrap();
    let name = ServerName::try_from("127.0.0.1").unwrap();
    let tls = connector.connect(name, tcp).await.unwrap();
    let leaf = tls.get_ref().1.peer_certificates().unwrap()[0].to_vec();
    let (send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
        .await
        .unwrap();
    tokio::spawn(conn);
    (send, leaf)
}

async fn health(send: &mut hyper::client::conn::http1::SendRequest<Empty<Bytes>>) -> StatusCode {
    let req = Request::get("/health")
        .header("host", "127.0.0.1")
        .body(Empty::new())
        .unwrap();
    let resp = send.send_request(req).await.unwrap();
    let status = resp.status();
    resp.into_body().collect().await.unwrap();
    status
}

#[tokio::test]
async fn the_listener_serves_tls_and_reload_takes_a_renewed_certificate_for_new_connections() {
    let ca = Ca::new();
    let dir = tempfile::tempdir().unwrap();
    ca.issue(dir.path(), "first");
    let cert =
        ReloadingCert::load(&dir.path().join("cert.pem"), &dir.path().join("key.pem")).unwrap();
    let tls = server_config(cert.clone(), None, &[b"http/1.1"]).unwrap();
    let c = Cluster::ready(&[("node-a", "http://127.0.0.1:1")], options()).await;
    let gateway: Gateway = c.gateway.with_tls(tls);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { gateway.serve(listener, std::future::pending()).await });

    let connector = ca.connector();
    let (mut open, first) = connect(&connector, addr).await;
    assert_eq!(health(&mut open).await, StatusCode::NO_CONTENT);

    // Plain HTTP on the TLS port gets no HTTP answer.
    let status = tokio::time::timeout(std::time::Duration::from_secs(5), send_raw(addr))
        .await
        .unwrap();
    assert!(status.is_none(), "plain HTTP was answered: {status:?}");

    // A renewal that is not a key pair leaves the old certificate in use.
    std::fs::write(dir.path().join("key.pem"), "not a key").unwrap();
    assert!(cert.reload().is_err());
    let (_, still) = connect(&connector, addr).await;
    assert_eq!(still, first);

    ca.issue(dir.path(), "renewed");
    cert.reload().unwrap();
    let (mut fresh, renewed) = connect(&connector, addr).await;
    assert_ne!(
        renewed, first,
        "a new handshake presents the renewed certificate"
    );
    assert_eq!(health(&mut fresh).await, StatusCode::NO_CONTENT);
    // The connection opened before the reload keeps working.
    assert_eq!(health(&mut open).await, StatusCode::NO_CONTENT);
}

/// Sends a plain HTTP request and returns the status line, if any came.
async fn send_raw(addr: SocketAddr) -> Option<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = TcpStream::connect(addr).await.unwrap();
    let _ = s
        .write_all(b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n")
        .await;
    let mut buf = Vec::new();
    let _ = s.read_to_end(&mut buf).await;
    let text = String::from_utf8_lossy(&buf);
    text.starts_with("HTTP/")
        .then(|| text.lines().next().unwrap_or("").to_string())
}

/// Reads one response with a `Content-Length` body off `s` (after `buf`).
async fn read_response<S: tokio::io::AsyncRead + Unpin>(s: &mut S, buf: &mut Vec<u8>) -> String {
    use tokio::io::AsyncReadExt;
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
            let len: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .map_or(0, |v| v.trim().parse().unwrap());
            if buf.len() >= end + 4 + len {
                let whole: Vec<u8> = buf.drain(..end + 4 + len).collect();
                return String::from_utf8_lossy(&whole).into_owned();
            }
        }
        let mut b = [0u8; 4096];
        let n = tokio::time::timeout(std::time::Duration::from_secs(10), s.read(&mut b))
            .await
            .expect("an answer within 10 s")
            .unwrap();
        assert!(n > 0, "the gateway closed the connection");
        buf.extend_from_slice(&b[..n]);
    }
}

#[tokio::test]
async fn tls_http1_requests_take_the_fast_lane_and_nodes_are_told_https() {
    use tokio::io::AsyncWriteExt;
    // The node names the X-Forwarded-Proto it was sent, in a header whose
    // case only the fast lane keeps (hyper lower-cases names).
    let node = RawNode::start(|head| {
        let proto = head
            .lines()
            .find_map(|l| {
                l.to_ascii_lowercase()
                    .strip_prefix("x-forwarded-proto:")
                    .map(|v| v.trim().to_string())
            })
            .unwrap_or_default();
        let resp = format!(
            "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nX-Node-Case: kept\r\n\r\n{proto}",
            proto.len()
        );
        (resp.into_bytes(), false)
    })
    .await;
    let ca = Ca::new();
    let dir = tempfile::tempdir().unwrap();
    ca.issue(dir.path(), "fast");
    let cert =
        ReloadingCert::load(&dir.path().join("cert.pem"), &dir.path().join("key.pem")).unwrap();
    let tls = server_config(cert, None, &[b"h2", b"http/1.1"]).unwrap();
    let c = Cluster::with_sandbox(&node.endpoint, options()).await;
    let gateway: Gateway = c.gateway.with_tls(tls);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { gateway.serve(listener, std::future::pending()).await });

    // HTTP/1.1 by ALPN: three keep-alive requests, the last two pipelined.
    let mut connector_cfg = (*ca.client_config()).clone();
    connector_cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    let tcp = TcpStream::connect(addr).await.unwrap();
    let mut tls = TlsConnector::from(Arc::new(connector_cfg))
        .connect(ServerName::try_from("127.0.0.1").unwrap(), tcp)
        .await
        .unwrap();
    let req = b"GET /x HTTP/1.1\r\nhost: gw.test\r\ne2b-sandbox-id: sbx-1\r\ne2b-sandbox-port: 49983\r\n\r\n";
    let mut buf = Vec::new();
    tls.write_all(req).await.unwrap();
    let mut answers = vec![read_response(&mut tls, &mut buf).await];
    tls.write_all(&[&req[..], &req[..]].concat()).await.unwrap();
    answers.push(read_response(&mut tls, &mut buf).await);
    answers.push(read_response(&mut tls, &mut buf).await);
    for a in &answers {
        assert!(a.starts_with("HTTP/1.1 200"), "{a}");
        assert!(
            a.contains("X-Node-Case: kept"),
            "not relayed byte for byte: {a}"
        );
        assert!(
            a.ends_with("\r\n\r\nhttps"),
            "the node was not told https: {a}"
        );
    }
    assert_eq!(node.accepted.load(std::sync::atomic::Ordering::SeqCst), 1);

    // HTTP/2 by ALPN goes to hyper, and the node hears https there too.
    let mut h2_cfg = (*ca.client_config()).clone();
    h2_cfg.alpn_protocols = vec![b"h2".to_vec()];
    let tcp = TcpStream::connect(addr).await.unwrap();
    let tls = TlsConnector::from(Arc::new(h2_cfg))
        .connect(ServerName::try_from("127.0.0.1").unwrap(), tcp)
        .await
        .unwrap();
    assert_eq!(tls.get_ref().1.alpn_protocol(), Some(&b"h2"[..]));
    let (mut send, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        TokioIo::new(tls),
    )
    .await
    .unwrap();
    tokio::spawn(conn);
    let req = Request::get("https://gw.test/x")
        .header("e2b-sandbox-id", "sbx-1")
        .header("e2b-sandbox-port", "49983")
        .body(Empty::<Bytes>::new())
        .unwrap();
    let resp = send.send_request(req).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(&body[..], b"https");
}
