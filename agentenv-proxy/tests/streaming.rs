//! Long-lived requests: WebSocket relay, Connect and SSE streams flushed
//! frame by frame without the request timeout, trailers over HTTP/1.1 and h2.

mod common;

use std::sync::Arc;
use std::time::Duration;

use agentenv_proxy::GatewayOptions;
use agentenv_proxy::body::{BoxError, GatewayBody, boxed};
use bytes::Bytes;
use common::*;
use futures::{SinkExt, StreamExt};
use http::{HeaderMap, Request, Response, StatusCode};
use http_body::Frame;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper_util::rt::TokioIo;
use parking_lot::Mutex;
use tokio::sync::{mpsc, oneshot};
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::protocol::Role;
use tokio_tungstenite::tungstenite::{Message, handshake::derive_accept_key};

/// A node that accepts WebSocket upgrades and echoes every message.
async fn websocket_echo_node() -> (FakeNode, Log) {
    let log: Log = Arc::default();
    let l = log.clone();
    let node = FakeNode::start(move |mut req: Request<hyper::body::Incoming>| {
        let l = l.clone();
        async move {
            let key = req.headers()["sec-websocket-key"].as_bytes().to_vec();
            let on_upgrade = hyper::upgrade::on(&mut req);
            l.lock().push(Seen {
                method: req.method().to_string(),
                uri: req.uri().to_string(),
                headers: req.headers().clone(),
                body: Bytes::new(),
            });
            tokio::spawn(async move {
                let upgraded = on_upgrade.await.unwrap();
                let mut ws = tokio_tungstenite::WebSocketStream::from_raw_socket(
                    TokioIo::new(upgraded),
                    Role::Server,
                    None,
                )
                .await;
                while let Some(Ok(msg)) = ws.next().await {
                    if msg.is_text() || msg.is_binary() {
                        ws.send(msg).await.unwrap();
                    } else if msg.is_close() {
                        break;
                    }
                }
            });
            Response::builder()
                .status(StatusCode::SWITCHING_PROTOCOLS)
                .header("connection", "Upgrade")
                .header("upgrade", "websocket")
                .header("sec-websocket-accept", derive_accept_key(&key))
                .body(agentenv_proxy::body::empty())
                .unwrap()
        }
    })
    .await;
    (node, log)
}

#[tokio::test]
async fn websocket_is_relayed_both_ways_under_proxy() {
    let (node, log) = websocket_echo_node().await;
    let c = Cluster::ready(&[("node-a", &node.endpoint)], options()).await;
    c.heartbeat("node-a", &["sbx-ws"]).await;
    let mut request = format!("ws://{}/socket?token=abc", c.addr)
        .into_client_request()
        .unwrap();
    request
        .headers_mut()
        .insert("e2b-sandbox-id", "sbx-ws".parse().unwrap());
    request
        .headers_mut()
        .insert("e2b-sandbox-port", "49983".parse().unwrap());
    // tungstenite verifies Sec-WebSocket-Accept against its own key.
    let (mut ws, resp) = tokio_tungstenite::connect_async(request).await.unwrap();
    assert_eq!(resp.status(), StatusCode::SWITCHING_PROTOCOLS);
    for i in 0..5 {
        let text = format!("hello {i}");
        ws.send(Message::text(text.clone())).await.unwrap();
        let back = ws.next().await.unwrap().unwrap();
        assert_eq!(back.into_text().unwrap().as_str(), text);
    }
    ws.send(Message::binary(vec![0u8, 1, 2, 255]))
        .await
        .unwrap();
    assert_eq!(
        ws.next().await.unwrap().unwrap().into_data().as_ref(),
        [0u8, 1, 2, 255]
    );
    ws.close(None).await.unwrap();

    let seen = log.lock()[0].clone();
    assert_eq!(seen.uri, "/proxy/socket?token=abc");
    assert_eq!(seen.headers["host"], c.addr.to_string());
    assert_eq!(seen.headers["upgrade"], "websocket");
    assert!(
        seen.headers["connection"]
            .to_str()
            .unwrap()
            .eq_ignore_ascii_case("upgrade")
    );
    assert_eq!(seen.headers["x-forwarded-uri"], "/socket?token=abc");
    assert_eq!(seen.headers["x-forwarded-for"], "127.0.0.1");

    // The relay holds a connection slot until both sides close.
    drop(ws);
    eventually("open connections back to zero", || {
        metric_value(&c.metrics_text(), "agentenv_gateway_open_connections") == Some(0.0)
    })
    .await;
}

type Gate = Arc<Mutex<Option<oneshot::Receiver<()>>>>;

/// A node that answers with one frame, waits for the gate, then sends a
/// second frame and optional trailers.
async fn gated_stream_node(
    content_type: &'static str,
    trailers: bool,
) -> (FakeNode, oneshot::Sender<()>, Log) {
    let (open, gate) = oneshot::channel::<()>();
    let gate: Gate = Arc::new(Mutex::new(Some(gate)));
    let log: Log = Arc::default();
    let l = log.clone();
    let node = FakeNode::start(move |req| {
        let gate = gate.clone();
        let l = l.clone();
        async move {
            let seen = read_seen(req).await;
            l.lock().push(seen);
            let (tx, rx) = mpsc::channel::<Result<Frame<Bytes>, BoxError>>(4);
            let gate = gate.lock().take();
            tokio::spawn(async move {
                tx.send(Ok(Frame::data(Bytes::from_static(b"frame-1"))))
                    .await
                    .unwrap();
                if let Some(gate) = gate {
                    let _ = gate.await;
                }
                tx.send(Ok(Frame::data(Bytes::from_static(b"frame-2"))))
                    .await
                    .unwrap();
                if trailers {
                    let mut t = HeaderMap::new();
                    t.insert("grpc-status", "0".parse().unwrap());
                    tx.send(Ok(Frame::trailers(t))).await.unwrap();
                }
            });
            let body: GatewayBody = boxed(StreamBody::new(tokio_stream_from(rx)));
            let mut resp = Response::new(body);
            resp.headers_mut()
                .insert("content-type", content_type.parse().unwrap());
            if trailers {
                resp.headers_mut()
                    .insert("trailer", "grpc-status".parse().unwrap());
            }
            resp
        }
    })
    .await;
    (node, open, log)
}

fn tokio_stream_from<T: Send + 'static>(
    mut rx: mpsc::Receiver<T>,
) -> impl futures::Stream<Item = T> + Send {
    futures::stream::poll_fn(move |cx| rx.poll_recv(cx))
}

#[tokio::test]
async fn connect_server_stream_is_relayed_frame_by_frame_past_the_request_timeout() {
    let (node, open, log) = gated_stream_node("application/connect+json", false).await;
    let opts = GatewayOptions {
        request_timeout: Duration::from_millis(200),
        ..options()
    };
    let c = Cluster::ready(&[("node-a", &node.endpoint)], opts).await;
    c.heartbeat("node-a", &["sbx-s"]).await;
    let mut body = open_ok(
        Request::post(c.url("/process.Process/Start"))
            .header("content-type", "application/connect+json")
            .header("connect-protocol-version", "1")
            .e2b_route("sbx-s", "49983")
            .body(Full::from("{}"))
            .unwrap(),
    )
    .await;
    // The first frame arrives while the node is still holding the stream open.
    let first = next_data(&mut body).await;
    assert_eq!(first, "frame-1");
    // Outlive the request timeout on purpose: streams are not bounded by it.
    tokio::time::sleep(Duration::from_millis(600)).await;
    open.send(()).unwrap();
    let rest = body.collect().await.unwrap().to_bytes();
    assert_eq!(rest, "frame-2");
    assert_eq!(log.lock()[0].uri, "/proxy/process.Process/Start");
}

#[tokio::test]
async fn server_sent_events_are_flushed_per_event() {
    let (node, open, _) = gated_stream_node("text/event-stream", false).await;
    let c = Cluster::ready(&[("node-a", &node.endpoint)], options()).await;
    c.heartbeat("node-a", &["sbx-s"]).await;
    let resp = client()
        .request(
            Request::get(c.url("/events"))
                .header("accept", "text/event-stream")
                .e2b_route("sbx-s", "49983")
                .empty(),
        )
        .await
        .unwrap();
    let mut body = resp.into_body();
    assert_eq!(next_data(&mut body).await, "frame-1");
    open.send(()).unwrap();
    assert_eq!(body.collect().await.unwrap().to_bytes(), "frame-2");
}

#[tokio::test]
async fn trailers_reach_http1_and_h2_clients() {
    for h2 in [false, true] {
        let (node, open, log) = gated_stream_node("application/grpc", true).await;
        let c = Cluster::ready(&[("node-a", &node.endpoint)], options()).await;
        c.heartbeat("node-a", &["sbx-g"]).await;
        open.send(()).unwrap();
        let client =
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .http2_only(h2)
                .build_http::<Full<Bytes>>();
        let resp = client
            .request(
                Request::post(c.url("/grpc.Service/Method"))
                    .header("content-type", "application/grpc")
                    .header("te", "trailers")
                    .agentenv_route("sbx-g", "50051")
                    .body(Full::from("req"))
                    .unwrap(),
            )
            .await
            .unwrap();
        assert_eq!(resp.status(), StatusCode::OK, "h2={h2}");
        let collected = resp.into_body().collect().await.unwrap();
        let trailers = collected.trailers().cloned().expect("trailers");
        assert_eq!(trailers["grpc-status"], "0", "h2={h2}");
        assert_eq!(collected.to_bytes(), "frame-1frame-2");
        let seen = log.lock()[0].clone();
        assert_eq!(seen.headers["te"], "trailers");
        assert_eq!(seen.body, "req");
    }
}

#[tokio::test]
async fn the_request_is_timed_until_its_response_body_ends() {
    let (node, open, _log) = gated_stream_node("text/plain", false).await;
    let c = Cluster::ready(&[("node-a", &node.endpoint)], options()).await;
    c.heartbeat("node-a", &["sbx-t"]).await;
    let series = r#"agentenv_gateway_http_request_duration_seconds_count{method="GET",route="unmatched",route_source="header",status="2xx"}"#;
    let mut body = open_ok(
        Request::get(c.url("/files"))
            .e2b_route("sbx-t", "49983")
            .empty(),
    )
    .await;
    let first = next_data(&mut body).await;
    assert_eq!(first, "frame-1");
    // Head and first frame sent, body still open: not recorded yet.
    assert_eq!(metric_value(&c.metrics_text(), series), None);
    open.send(()).unwrap();
    let rest = body.collect().await.unwrap().to_bytes();
    assert_eq!(rest, "frame-2");
    eventually("the request is recorded once its body ended", || {
        metric_value(&c.metrics_text(), series) == Some(1.0)
    })
    .await;
}
