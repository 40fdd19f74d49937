//! Bad input and vanishing clients: clear 4xx/5xx or a clean close, no
//! panic, and the open-connection gauge returns to zero.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use agentenv_proxy::body::{BoxError, boxed};
use bytes::Bytes;
use common::*;
use http::{Request, Response, StatusCode};
use http_body::Frame;
use http_body_util::{BodyExt, StreamBody};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::mpsc;

fn open_connections(c: &Cluster) -> Option<f64> {
    metric_value(&c.metrics_text(), "agentenv_gateway_open_connections")
}

async fn all_closed(c: &Cluster) {
    eventually("the gateway's open connections to return to zero", || {
        open_connections(c) == Some(0.0)
    })
    .await;
}

/// Writes `raw` and reads until the gateway closes or 64 KiB arrived.
async fn raw_exchange(c: &Cluster, raw: &[u8]) -> String {
    let mut s = TcpStream::connect(c.addr).await.unwrap();
    s.write_all(raw).await.unwrap();
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => break,
            Ok(Ok(n)) => {
                out.extend_from_slice(&buf[..n]);
                if out.len() > 65536 {
                    break;
                }
            }
            Err(_) => panic!(
                "gateway neither answered nor closed: {}",
                String::from_utf8_lossy(&out)
            ),
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[tokio::test]
async fn oversized_headers_get_431_and_the_connection_is_released() {
    let c = Cluster::ready(&[], options()).await;
    let big = "a".repeat(1024 * 1024);
    let raw =
        format!("GET /nodes HTTP/1.1\r\nhost: x\r\nx-api-key: {API_KEY}\r\nx-big: {big}\r\n\r\n");
    let resp = raw_exchange(&c, raw.as_bytes()).await;
    assert!(
        resp.starts_with("HTTP/1.1 431"),
        "{}",
        &resp[..resp.len().min(200)]
    );
    let many: String = (0..500).map(|i| format!("x-h{i}: v\r\n")).collect();
    let raw = format!("GET /nodes HTTP/1.1\r\nhost: x\r\n{many}\r\n");
    let resp = raw_exchange(&c, raw.as_bytes()).await;
    assert!(
        resp.starts_with("HTTP/1.1 431"),
        "{}",
        &resp[..resp.len().min(200)]
    );
    all_closed(&c).await;
}

#[tokio::test]
async fn malformed_request_lines_get_400() {
    let c = Cluster::ready(&[], options()).await;
    for raw in [
        &b"GET /a b HTTP/1.1\r\nhost: x\r\n\r\n"[..],
        b"NOT HTTP AT ALL\r\n\r\n",
        b"GET /x HTTP/1.1\r\nhost: x\r\ncontent-length: nope\r\n\r\n",
    ] {
        let resp = raw_exchange(&c, raw).await;
        assert!(
            resp.is_empty() || resp.starts_with("HTTP/1.1 400"),
            "{resp}"
        );
    }
    let resp = raw_exchange(
        &c,
        format!("GET /sandboxes/%zz HTTP/1.1\r\nhost: x\r\nx-api-key: {API_KEY}\r\nconnection: close\r\n\r\n").as_bytes(),
    )
    .await;
    assert!(resp.starts_with("HTTP/1.1 400"), "{resp}");
    assert!(resp.contains("invalid request path"), "{resp}");
    all_closed(&c).await;
}

#[tokio::test]
async fn a_create_body_cut_short_is_not_scheduled() {
    let (node, log) = FakeNode::echo().await;
    let c = Cluster::ready(&[("node-a", &node.endpoint)], options()).await;
    for _ in 0..20 {
        let mut s = TcpStream::connect(c.addr).await.unwrap();
        let raw = format!(
            "POST /sandboxes HTTP/1.1\r\nhost: x\r\nx-api-key: {API_KEY}\r\ncontent-length: 1000\r\n\r\n{{\"templateID\":"
        );
        s.write_all(raw.as_bytes()).await.unwrap();
        drop(s);
    }
    all_closed(&c).await;
    assert_eq!(
        c.count("Schedule"),
        0,
        "nothing was placed for incomplete bodies"
    );
    assert!(log.lock().is_empty());
}

#[tokio::test]
async fn an_upload_cut_short_is_a_clean_failure_upstream_and_down() {
    let arrived = Arc::new(AtomicUsize::new(0));
    let failed = Arc::new(AtomicUsize::new(0));
    let (a, f) = (arrived.clone(), failed.clone());
    let node = FakeNode::start(move |req| {
        let (a, f) = (a.clone(), f.clone());
        async move {
            a.fetch_add(1, Ordering::SeqCst);
            // Reading fails when the gateway aborts the forwarded body.
            if req.into_body().collect().await.is_err() {
                f.fetch_add(1, Ordering::SeqCst);
            }
            Response::new(agentenv_proxy::body::empty())
        }
    })
    .await;
    let c = Cluster::with_sandbox(&node.endpoint, options()).await;
    const N: usize = 10;
    for i in 0..N {
        let mut s = TcpStream::connect(c.addr).await.unwrap();
        let raw = "POST /files HTTP/1.1\r\nhost: x\r\ne2b-sandbox-id: sbx-1\r\ne2b-sandbox-port: 49983\r\ncontent-length: 100000\r\n\r\npartial";
        s.write_all(raw.as_bytes()).await.unwrap();
        // The upload is streaming to the node; now the client vanishes.
        eventually("the node to receive the upload", || {
            arrived.load(Ordering::SeqCst) == i + 1
        })
        .await;
        drop(s);
    }
    eventually("every partial upload to fail at the node", || {
        failed.load(Ordering::SeqCst) == N
    })
    .await;
    all_closed(&c).await;
}

#[tokio::test]
async fn many_clients_vanishing_mid_stream_release_everything() {
    let active = Arc::new(AtomicUsize::new(0));
    let started = Arc::new(AtomicUsize::new(0));
    let (a, s) = (active.clone(), started.clone());
    let node = FakeNode::start(move |_req| {
        let (a, s) = (a.clone(), s.clone());
        async move {
            let (tx, mut rx) = mpsc::channel::<Result<Frame<Bytes>, BoxError>>(1);
            a.fetch_add(1, Ordering::SeqCst);
            s.fetch_add(1, Ordering::SeqCst);
            let a2 = a.clone();
            tokio::spawn(async move {
                let _ = tx.send(Ok(Frame::data(Bytes::from_static(b"tick")))).await;
                // Ends only when the receiver (the gateway's relay) is gone.
                tx.closed().await;
                a2.fetch_sub(1, Ordering::SeqCst);
            });
            let body = StreamBody::new(futures::stream::poll_fn(move |cx| rx.poll_recv(cx)));
            let mut resp = Response::new(boxed(body));
            resp.headers_mut()
                .insert("content-type", "text/event-stream".parse().unwrap());
            resp
        }
    })
    .await;
    let c = Cluster::with_sandbox(&node.endpoint, options()).await;
    const N: usize = 40;
    let mut tasks = Vec::new();
    for _ in 0..N {
        let url = c.url("/events");
        tasks.push(tokio::spawn(async move {
            let mut body = open_ok(
                Request::get(url)
                    .header("accept", "text/event-stream")
                    .e2b_route("sbx-1", "49983")
                    .empty(),
            )
            .await;
            let first = next_data(&mut body).await;
            assert_eq!(first, "tick");
            // The client goes away here, mid-stream.
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(started.load(Ordering::SeqCst), N);
    all_closed(&c).await;
    eventually("every upstream stream to be released", || {
        active.load(Ordering::SeqCst) == 0
    })
    .await;
}

#[tokio::test]
async fn many_aborted_websockets_release_their_relays() {
    use tokio_tungstenite::tungstenite::client::IntoClientRequest;
    let node = FakeNode::start(|mut req: Request<hyper::body::Incoming>| async move {
        let key = req.headers()["sec-websocket-key"].as_bytes().to_vec();
        let on_upgrade = hyper::upgrade::on(&mut req);
        tokio::spawn(async move {
            if let Ok(up) = on_upgrade.await {
                let mut io = hyper_util::rt::TokioIo::new(up);
                let mut buf = [0u8; 1024];
                while let Ok(n) = io.read(&mut buf).await {
                    if n == 0 {
                        break;
                    }
                }
            }
        });
        Response::builder()
            .status(StatusCode::SWITCHING_PROTOCOLS)
            .header("connection", "Upgrade")
            .header("upgrade", "websocket")
            .header(
                "sec-websocket-accept",
                tokio_tungstenite::tungstenite::handshake::derive_accept_key(&key),
            )
            .body(agentenv_proxy::body::empty())
            .unwrap()
    })
    .await;
    let c = Cluster::with_sandbox(&node.endpoint, options()).await;
    let mut sockets = Vec::new();
    for _ in 0..20 {
        let mut request = format!("ws://{}/ws", c.addr).into_client_request().unwrap();
        request
            .headers_mut()
            .insert("e2b-sandbox-id", "sbx-1".parse().unwrap());
        request
            .headers_mut()
            .insert("e2b-sandbox-port", "49983".parse().unwrap());
        let (ws, _) = tokio_tungstenite::connect_async(request).await.unwrap();
        sockets.push(ws);
    }
    eventually("20 relays to be counted", || {
        open_connections(&c) == Some(20.0)
    })
    .await;
    // Vanish without a close handshake.
    drop(sockets);
    all_closed(&c).await;
}

#[tokio::test]
async fn graceful_shutdown_finishes_in_flight_requests_and_stops_accepting() {
    let (release, gate) = tokio::sync::oneshot::channel::<()>();
    let gate = Arc::new(parking_lot::Mutex::new(Some(gate)));
    let node = FakeNode::start(move |_req| {
        let gate = gate.clone();
        async move {
            let g = gate.lock().take();
            if let Some(g) = g {
                let _ = g.await;
            }
            Response::new(agentenv_proxy::body::full("done"))
        }
    })
    .await;
    let mut c = Cluster::with_sandbox(&node.endpoint, options()).await;
    let url = c.url("/sandboxes/sbx-1");
    let in_flight = tokio::spawn(async move { get(&url).await });
    eventually("the request to be in flight", || {
        open_connections(&c) == Some(1.0)
    })
    .await;
    let addr = c.addr;
    let shutdown = {
        let c = &mut c;
        async move { c.shutdown().await }
    };
    let finisher = async {
        // New connections are refused once the listener is closed.
        agentenv_testkit::Wait::new("the listener to refuse connections", Duration::from_secs(5))
            .every(Duration::from_millis(5))
            .until(|| async move { TcpStream::connect(addr).await.is_err() })
            .await;
        release.send(()).unwrap();
    };
    tokio::join!(shutdown, finisher);
    let (status, _, body) = in_flight.await.unwrap();
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body, "done");
}
