//! `https://` nodes: a TLS upstream on loopback with a certificate from a
//! private CA the test makes, reached by the pool and through the gateway.

mod common;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use agentenv_proxy::body::{GatewayBody, empty, full};
use agentenv_proxy::pool::{PoolConfig, PoolError, UpstreamPool, tls_config};
use common::*;
use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper_util::rt::TokioIo;
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};
use rustls::RootCertStore;
use rustls::pki_types::{PrivateKeyDer, PrivatePkcs8KeyDer};
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;

/// A TLS node answering `secure <path>`, and a client configuration that
/// trusts the CA that signed its certificate.
struct TlsNode {
    addr: SocketAddr,
    accepted: Arc<AtomicUsize>,
    trusting: Arc<rustls::ClientConfig>,
}

impl TlsNode {
    async fn start() -> Self {
        let ca_key = KeyPair::generate().unwrap();
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params
            .distinguished_name
            .push(DnType::CommonName, "gateway test CA");
        let ca_cert = ca_params.self_signed(&ca_key).unwrap();
        let issuer = Issuer::new(ca_params, ca_key);
        let leaf_key = KeyPair::generate().unwrap();
        let leaf = CertificateParams::new(vec!["127.0.0.1".to_string(), "localhost".to_string()])
            .unwrap()
            .signed_by(&leaf_key, &issuer)
            .unwrap();
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let server = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(
                vec![leaf.der().clone()],
                PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(leaf_key.serialize_der())),
            )
            .unwrap();
        let acceptor = TlsAcceptor::from(Arc::new(server));
        let mut roots = RootCertStore::empty();
        roots.add(ca_cert.der().clone()).unwrap();

        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let accepted = Arc::new(AtomicUsize::new(0));
        let count = accepted.clone();
        tokio::spawn(async move {
            loop {
                let (tcp, _) = listener.accept().await.unwrap();
                count.fetch_add(1, Ordering::SeqCst);
                let acceptor = acceptor.clone();
                tokio::spawn(async move {
                    let Ok(tls) = acceptor.accept(tcp).await else {
                        return;
                    };
                    let svc = hyper::service::service_fn(|req: Request<_>| async move {
                        let body: GatewayBody = full(format!("secure {}", req.uri().path()));
                        Ok::<_, Infallible>(Response::new(body))
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(tls), svc)
                        .await;
                });
            }
        });
        Self {
            addr,
            accepted,
            trusting: tls_config(roots),
        }
    }

    fn url(&self, path: &str) -> String {
        format!("https://{}{path}", self.addr)
    }
}

#[tokio::test]
async fn an_https_node_is_reached_over_tls_and_its_connection_reused() {
    let node = TlsNode::start().await;
    let pool = UpstreamPool::new(PoolConfig {
        tls: Some(node.trusting.clone()),
        ..PoolConfig::default()
    });
    for path in ["/a", "/b"] {
        let req = Request::get(node.url(path)).body(empty()).unwrap();
        let resp = pool.send(req).await.unwrap();
        assert_eq!(resp.status(), StatusCode::OK);
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(body, format!("secure {path}"));
    }
    assert_eq!(node.accepted.load(Ordering::SeqCst), 1);
    assert_eq!(pool.idle_count(&node.addr.to_string()), 1);
}

#[tokio::test]
async fn an_https_node_whose_certificate_is_not_trusted_fails_the_handshake() {
    let node = TlsNode::start().await;
    // The default configuration trusts only the public roots.
    let pool = UpstreamPool::new(PoolConfig::default());
    let req = Request::get(node.url("/a")).body(empty()).unwrap();
    let err = pool.send(req).await.unwrap_err();
    assert!(matches!(err, PoolError::Tls { .. }), "{err:?}");
    assert!(err.to_string().contains(&node.addr.to_string()), "{err}");
}

#[tokio::test]
async fn the_gateway_proxies_to_an_https_node_it_trusts_and_502s_one_it_does_not() {
    let node = TlsNode::start().await;
    let endpoint = format!("https://{}", node.addr);
    let c = Cluster::ready(&[("node-tls", &endpoint)], options()).await;
    c.heartbeat("node-tls", &["sbx-tls"]).await;
    let get = |addr: SocketAddr| {
        Request::get(format!("http://{addr}/files"))
            .e2b_route("sbx-tls", "49983")
            .body(http_body_util::Full::default())
            .unwrap()
    };

    // The cluster's own gateway uses the public roots: the node's private
    // CA is not among them.
    let (status, _, body) = send(get(c.addr)).await;
    assert_eq!(status, StatusCode::BAD_GATEWAY);
    assert!(
        message(&body).starts_with("upstream unavailable: node node-tls at https://"),
        "{}",
        message(&body)
    );

    let trusting = c.gateway.with_upstream_tls(node.trusting.clone());
    let (addr, _stop, _task) = serve_gateway(trusting).await;
    let (status, _, body) = send(get(addr)).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body, "secure /proxy/files");
}
