//! The upstream connection pool against a real HTTP/1.1 server on loopback
//! that counts the connections it accepted and saw closed.

mod common;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use agentenv_proxy::body::{GatewayBody, empty, full};
use agentenv_proxy::pool::{PoolConfig, UpstreamPool};
use bytes::Bytes;
use common::{eventually, stalled_body};
use http::{Request, Response};
use http_body_util::BodyExt;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio::sync::{Semaphore, broadcast};

struct Upstream {
    addr: SocketAddr,
    accepted: Arc<AtomicUsize>,
    closed: Arc<AtomicUsize>,
    /// Closes every open connection from the server side.
    kill: broadcast::Sender<()>,
    /// Permits for `/gated` requests to answer.
    gate: Arc<Semaphore>,
}

impl Upstream {
    /// `/small` answers a short body; `/stream` sends one chunk and never
    /// ends; `/gated` answers once a permit is added to `gate`.
    async fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let accepted = Arc::new(AtomicUsize::new(0));
        let closed = Arc::new(AtomicUsize::new(0));
        let (kill, _) = broadcast::channel(1);
        let gate = Arc::new(Semaphore::new(0));
        let (a, c, k, g) = (accepted.clone(), closed.clone(), kill.clone(), gate.clone());
        tokio::spawn(async move {
            loop {
                let (stream, _) = listener.accept().await.unwrap();
                a.fetch_add(1, Ordering::SeqCst);
                let mut killed = k.subscribe();
                let (c, g) = (c.clone(), g.clone());
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(move |req: Request<_>| {
                        let g = g.clone();
                        async move {
                            let body: GatewayBody = match req.uri().path() {
                                "/stream" => stalled_body(Some("first")),
                                "/gated" => {
                                    g.acquire().await.unwrap().forget();
                                    full("opened")
                                }
                                _ => full("ok"),
                            };
                            Ok::<_, Infallible>(Response::new(body))
                        }
                    });
                    let conn = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), svc);
                    tokio::select! {
                        _ = conn => {}
                        _ = killed.recv() => {}
                    }
                    c.fetch_add(1, Ordering::SeqCst);
                });
            }
        });
        Self {
            addr,
            accepted,
            closed,
            kill,
            gate,
        }
    }

    fn accepted(&self) -> usize {
        self.accepted.load(Ordering::SeqCst)
    }

    fn closed(&self) -> usize {
        self.closed.load(Ordering::SeqCst)
    }

    fn request(&self, path: &str) -> Request<GatewayBody> {
        Request::get(format!("http://{}{path}", self.addr))
            .body(empty())
            .unwrap()
    }
}

async fn read_all(pool: &UpstreamPool, req: Request<GatewayBody>) -> Bytes {
    let resp = pool.send(req).await.unwrap();
    resp.into_body().collect().await.unwrap().to_bytes()
}

#[tokio::test]
async fn a_kept_alive_connection_is_reused_after_its_body_ended() {
    let up = Upstream::start().await;
    let pool = UpstreamPool::new(PoolConfig::default());
    let authority = up.addr.to_string();
    for _ in 0..5 {
        assert_eq!(read_all(&pool, up.request("/small")).await, "ok");
        assert_eq!(pool.idle_count(&authority), 1);
    }
    assert_eq!(up.accepted(), 1, "every request went over one connection");
    assert_eq!(up.closed(), 0);
}

#[tokio::test]
async fn a_connection_whose_body_is_still_streaming_is_not_shared() {
    let up = Upstream::start().await;
    let pool = UpstreamPool::new(PoolConfig::default());
    let resp = pool.send(up.request("/stream")).await.unwrap();
    let mut body = resp.into_body();
    let first = body.frame().await.unwrap().unwrap().into_data().unwrap();
    assert_eq!(first, "first");
    assert_eq!(pool.idle_count(&up.addr.to_string()), 0);
    assert_eq!(read_all(&pool, up.request("/small")).await, "ok");
    assert_eq!(up.accepted(), 2, "the streaming connection stayed busy");
    drop(body);
}

#[tokio::test]
async fn a_connection_whose_body_was_dropped_early_is_closed_not_reused() {
    let up = Upstream::start().await;
    let pool = UpstreamPool::new(PoolConfig::default());
    let resp = pool.send(up.request("/stream")).await.unwrap();
    let mut body = resp.into_body();
    body.frame().await.unwrap().unwrap();
    drop(body);
    assert_eq!(pool.idle_count(&up.addr.to_string()), 0);
    eventually("the server sees the abandoned connection closed", || {
        up.closed() == 1
    })
    .await;
    assert_eq!(read_all(&pool, up.request("/small")).await, "ok");
    assert_eq!(up.accepted(), 2);
}

#[tokio::test]
async fn a_connection_the_server_closed_is_evicted_and_the_request_goes_on_a_new_one() {
    let up = Upstream::start().await;
    let pool = UpstreamPool::new(PoolConfig::default());
    assert_eq!(read_all(&pool, up.request("/small")).await, "ok");
    assert_eq!(pool.idle_count(&up.addr.to_string()), 1);
    up.kill.send(()).unwrap();
    eventually("the server closed its connection", || up.closed() == 1).await;
    assert_eq!(read_all(&pool, up.request("/small")).await, "ok");
    assert_eq!(up.accepted(), 2);
    assert_eq!(pool.idle_count(&up.addr.to_string()), 1);
}

#[tokio::test]
async fn idle_connections_past_the_idle_timeout_are_closed() {
    let up = Upstream::start().await;
    let pool = UpstreamPool::new(PoolConfig {
        idle_timeout: Duration::from_millis(200),
        ..PoolConfig::default()
    });
    assert_eq!(read_all(&pool, up.request("/small")).await, "ok");
    assert_eq!(pool.idle_count(&up.addr.to_string()), 1);
    eventually("the idle connection is closed", || up.closed() == 1).await;
    assert_eq!(pool.idle_count(&up.addr.to_string()), 0);
}

#[tokio::test]
async fn idle_connections_are_bounded_per_authority_and_the_rest_closed() {
    let up = Upstream::start().await;
    let pool = UpstreamPool::new(PoolConfig {
        max_idle_per_authority: 2,
        ..PoolConfig::default()
    });
    // Five requests in flight at once need five connections.
    let inflight: Vec<_> = (0..5)
        .map(|_| {
            let pool = pool.clone();
            let req = up.request("/gated");
            tokio::spawn(async move { read_all(&pool, req).await })
        })
        .collect();
    eventually("five connections are open", || up.accepted() == 5).await;
    up.gate.add_permits(5);
    for t in inflight {
        assert_eq!(t.await.unwrap(), "opened");
    }
    assert_eq!(pool.idle_count(&up.addr.to_string()), 2);
    eventually("the connections over the bound are closed", || {
        up.closed() == 3
    })
    .await;
    // The two kept ones still serve.
    assert_eq!(read_all(&pool, up.request("/small")).await, "ok");
    assert_eq!(read_all(&pool, up.request("/small")).await, "ok");
    assert_eq!(up.accepted(), 5);
}

#[tokio::test]
async fn a_refused_connection_is_an_error_naming_the_authority() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let pool = UpstreamPool::new(PoolConfig::default());
    let req = Request::get(format!("http://127.0.0.1:{port}/x"))
        .body(empty())
        .unwrap();
    let err = pool.send(req).await.unwrap_err();
    assert!(
        err.to_string().contains(&format!("127.0.0.1:{port}")),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_read_to_its_end_outside_any_runtime_returns_its_connection() {
    let up = Upstream::start().await;
    let pool = UpstreamPool::new(PoolConfig::default());
    let resp = pool.send(up.request("/small")).await.unwrap();
    let body = resp.into_body();
    // Read on a plain thread: returning the connection must not need a
    // runtime there.
    let read = std::thread::spawn(move || futures::executor::block_on(body.collect()));
    let bytes = tokio::task::spawn_blocking(move || read.join().unwrap())
        .await
        .unwrap()
        .unwrap()
        .to_bytes();
    assert_eq!(bytes, "ok");
    assert_eq!(pool.idle_count(&up.addr.to_string()), 1);
    assert_eq!(read_all(&pool, up.request("/small")).await, "ok");
    assert_eq!(up.accepted(), 1);
}
