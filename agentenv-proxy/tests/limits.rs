//! Client limits of the gateway's listener: idle and slow connections are
//! closed after the header timeout while ordinary requests keep being
//! answered, and connections over the per-client cap are answered 503.

mod common;

use std::time::{Duration, Instant};

use agentenv_proxy::{ClientLimits, GatewayOptions};
use common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Lets this process hold `n` descriptors (both ends of every test connection).
fn raise_nofile(n: u64) {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit write and read the struct passed by pointer.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim), 0);
        lim.rlim_cur = n.min(lim.rlim_max);
        assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &lim), 0);
    }
}

fn limited(limits: ClientLimits) -> GatewayOptions {
    GatewayOptions {
        limits,
        ..options()
    }
}

async fn health_ms(addr: std::net::SocketAddr) -> f64 {
    let started = Instant::now();
    let (status, _, _) = get(&format!("http://{addr}/health")).await;
    assert_eq!(status, http::StatusCode::NO_CONTENT);
    started.elapsed().as_secs_f64() * 1000.0
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_thousand_idle_connections_are_closed_by_the_header_timeout_while_requests_are_served()
{
    const IDLE: usize = 5_000;
    raise_nofile(4 * IDLE as u64);
    let c = Cluster::ready(
        &[("node-a", "http://127.0.0.1:1")],
        limited(ClientLimits {
            header_timeout: Duration::from_secs(2),
            max_connections: 3 * IDLE,
            max_connections_per_client: 3 * IDLE,
        }),
    )
    .await;
    let mut idle = Vec::with_capacity(IDLE);
    for i in 0..IDLE {
        let mut s = TcpStream::connect(c.addr).await.unwrap();
        // Half never send a byte, half stop in the middle of a head.
        if i % 2 == 1 {
            s.write_all(b"GET /health HTTP/1.1\r\nhost: x\r\n")
                .await
                .unwrap();
        }
        idle.push(s);
    }
    // Ordinary requests are answered while the idle connections are held.
    let mut ms: Vec<f64> = Vec::new();
    for _ in 0..21 {
        ms.push(health_ms(c.addr).await);
    }
    ms.sort_by(f64::total_cmp);
    let median = ms[ms.len() / 2];
    println!(
        "with {IDLE} idle connections: /health median {median:.2} ms, max {:.2} ms",
        ms[ms.len() - 1]
    );
    assert!(median < 100.0, "median {median} ms");
    // Every idle connection is closed by the gateway (EOF or reset), none answered.
    let deadline = Instant::now() + Duration::from_secs(30);
    for mut s in idle {
        let left = deadline.saturating_duration_since(Instant::now());
        let mut buf = [0u8; 64];
        let r = tokio::time::timeout(left, s.read(&mut buf))
            .await
            .expect("an idle connection stayed open past the header timeout");
        if let Ok(n) = r {
            assert_eq!(n, 0, "an incomplete head was answered");
        }
    }
    // The gateway still serves.
    health_ms(c.addr).await;
}

#[tokio::test]
async fn connections_over_the_per_client_cap_get_a_503_that_names_the_setting() {
    let c = Cluster::ready(
        &[("node-a", "http://127.0.0.1:1")],
        limited(ClientLimits {
            header_timeout: Duration::from_secs(30),
            max_connections: 1_000,
            max_connections_per_client: 3,
        }),
    )
    .await;
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(TcpStream::connect(c.addr).await.unwrap());
    }
    // Let the gateway admit them before the fourth arrives.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut extra = TcpStream::connect(c.addr).await.unwrap();
    let mut text = String::new();
    tokio::time::timeout(Duration::from_secs(5), extra.read_to_string(&mut text))
        .await
        .unwrap()
        .unwrap();
    assert!(text.starts_with("HTTP/1.1 503"), "{text}");
    assert!(text.contains("max_connections_per_client"), "{text}");
    // Closing one frees a place.
    drop(held.pop());
    let mut ok = None;
    for _ in 0..50 {
        tokio::time::sleep(Duration::from_millis(20)).await;
        let (status, _, _) = get(&format!("http://{}/health", c.addr)).await;
        if status == http::StatusCode::NO_CONTENT {
            ok = Some(status);
            break;
        }
    }
    assert!(
        ok.is_some(),
        "a freed place was not given to a new connection"
    );
}

/// An HTTP/2 (prior knowledge) connection to the gateway; resolves `closed` when the
/// gateway ends it.
async fn h2_connect(
    addr: std::net::SocketAddr,
) -> (
    hyper::client::conn::http2::SendRequest<http_body_util::Empty<bytes::Bytes>>,
    tokio::task::JoinHandle<()>,
) {
    let tcp = TcpStream::connect(addr).await.unwrap();
    let (send, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(tcp),
    )
    .await
    .unwrap();
    let closed = tokio::spawn(async move {
        let _ = conn.await;
    });
    (send, closed)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_http2_connections_are_closed_but_a_long_stream_is_not_cut() {
    use http_body_util::BodyExt;
    // A node whose answer streams a chunk every 200 ms for 3 s: longer than the idle
    // limit of 1 s.
    let node = FakeNode::start(|_req| async {
        let chunks = futures::stream::unfold(0u32, |i| async move {
            if i == 15 {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
            let frame = http_body::Frame::data(bytes::Bytes::from(format!("{i};")));
            Some((Ok::<_, agentenv_proxy::body::BoxError>(frame), i + 1))
        });
        http::Response::new(agentenv_proxy::body::boxed(
            http_body_util::StreamBody::new(chunks),
        ))
    })
    .await;
    let c = Cluster::with_sandbox(
        &node.endpoint,
        limited(ClientLimits {
            header_timeout: Duration::from_secs(1),
            ..ClientLimits::default()
        }),
    )
    .await;
    let request = || {
        http::Request::get(format!("http://{}/stream", c.addr))
            .header("e2b-sandbox-id", "sbx-1")
            .header("e2b-sandbox-port", "49983")
            .body(http_body_util::Empty::new())
            .unwrap()
    };

    // A stream of 3 s on a connection with a 1 s idle limit arrives whole.
    let (mut send, closed) = h2_connect(c.addr).await;
    let started = Instant::now();
    let resp = send.send_request(request()).await.unwrap();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    let want: String = (0..15).map(|i| format!("{i};")).collect();
    assert_eq!(String::from_utf8_lossy(&body), want);
    assert!(started.elapsed() >= Duration::from_millis(2_800));
    // Then, with nothing in flight, the gateway ends the connection.
    tokio::time::timeout(Duration::from_secs(10), closed)
        .await
        .expect("the idle HTTP/2 connection is closed")
        .unwrap();
    assert!(send.send_request(request()).await.is_err());

    // A connection that never sends a request is closed too.
    let (_send, closed) = h2_connect(c.addr).await;
    let idle_since = Instant::now();
    tokio::time::timeout(Duration::from_secs(10), closed)
        .await
        .expect("the idle HTTP/2 connection is closed")
        .unwrap();
    assert!(idle_since.elapsed() >= Duration::from_millis(900));
}
