//! The HTTP/1.1 fast lane of `Gateway::serve`, on the wire: keep-alive and
//! pipelining, every response framing, request bodies, HEAD, 1xx answers,
//! stale pooled node connections, `Connection: close`, and the hand-over
//! of a connection to hyper for requests the fast lane does not take.

mod common;

use std::sync::atomic::Ordering;
use std::time::Duration;

use common::*;
use http::Response;
use http_body_util::BodyExt;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const ROUTED: &str = "e2b-sandbox-id: sbx-1\r\ne2b-sandbox-port: 49983\r\n";

/// One response as a client reads it.
#[derive(Debug)]
struct Answer {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Answer {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).expect("a JSON body")
    }
}

/// A raw HTTP/1.1 connection that reads whole responses (length, chunked
/// or close-delimited bodies).
struct Conn {
    s: TcpStream,
    buf: Vec<u8>,
}

impl Conn {
    async fn open(c: &Cluster) -> Self {
        Self {
            s: TcpStream::connect(c.addr).await.unwrap(),
            buf: Vec::new(),
        }
    }

    async fn send(&mut self, raw: &[u8]) {
        self.s.write_all(raw).await.unwrap();
    }

    /// Reads more bytes; false at EOF.
    async fn fill(&mut self) -> bool {
        let mut b = [0u8; 16384];
        let n = tokio::time::timeout(Duration::from_secs(10), self.s.read(&mut b))
            .await
            .expect("the gateway answers within 10 s")
            .unwrap_or(0);
        self.buf.extend_from_slice(&b[..n]);
        n > 0
    }

    async fn read(&mut self, head_request: bool) -> Answer {
        let (status, headers, len) = loop {
            let mut hs = [httparse::EMPTY_HEADER; 64];
            let mut r = httparse::Response::new(&mut hs);
            if let httparse::Status::Complete(n) = r.parse(&self.buf).unwrap() {
                let headers: Vec<(String, String)> = r
                    .headers
                    .iter()
                    .map(|h| {
                        (
                            h.name.to_string(),
                            String::from_utf8_lossy(h.value).into_owned(),
                        )
                    })
                    .collect();
                break (r.code.unwrap(), headers, n);
            }
            assert!(
                self.fill().await,
                "connection closed before a response head"
            );
        };
        self.buf.drain(..len);
        let mut a = Answer {
            status,
            headers,
            body: Vec::new(),
        };
        if head_request || status == 204 || status == 304 {
            return a;
        }
        if a.header("transfer-encoding").is_some() {
            loop {
                let line_end = loop {
                    if let Some(i) = self.buf.windows(2).position(|w| w == b"\r\n") {
                        break i;
                    }
                    assert!(self.fill().await, "closed inside a chunk size");
                };
                let line = String::from_utf8_lossy(&self.buf[..line_end]).into_owned();
                let size = usize::from_str_radix(line.split(';').next().unwrap().trim(), 16)
                    .expect("a chunk size");
                self.buf.drain(..line_end + 2);
                if size == 0 {
                    // Trailer lines, then the final CRLF.
                    loop {
                        while !self.buf.windows(2).any(|w| w == b"\r\n") {
                            assert!(self.fill().await, "closed inside the trailer");
                        }
                        let i = self.buf.windows(2).position(|w| w == b"\r\n").unwrap();
                        self.buf.drain(..i + 2);
                        if i == 0 {
                            return a;
                        }
                    }
                }
                while self.buf.len() < size + 2 {
                    assert!(self.fill().await, "closed inside a chunk");
                }
                a.body.extend_from_slice(&self.buf[..size]);
                self.buf.drain(..size + 2);
            }
        }
        if let Some(n) = a.header("content-length") {
            let n: usize = n.parse().unwrap();
            while self.buf.len() < n {
                assert!(self.fill().await, "closed inside the body");
            }
            a.body = self.buf.drain(..n).collect();
            return a;
        }
        while self.fill().await {}
        a.body = std::mem::take(&mut self.buf);
        a
    }

    /// True when the gateway closes the connection (no more bytes).
    async fn closed(&mut self) -> bool {
        !self.fill().await && self.buf.is_empty()
    }
}

fn get(path: &str, extra: &str) -> Vec<u8> {
    format!("GET {path} HTTP/1.1\r\nhost: gw.test\r\n{ROUTED}{extra}\r\n").into_bytes()
}

async fn cluster_with(endpoint: &str) -> Cluster {
    let c = Cluster::ready(&[("node-a", endpoint)], options()).await;
    c.heartbeat("node-a", &["sbx-1"]).await;
    c
}

#[tokio::test]
async fn pipelined_requests_on_one_connection_are_answered_in_order() {
    let (node, log) = FakeNode::echo().await;
    let c = cluster_with(&node.endpoint).await;
    let mut conn = Conn::open(&c).await;
    let mut both = get("/one", "");
    both.extend(get("/two?x=1", ""));
    conn.send(&both).await;
    let first = conn.read(false).await;
    let second = conn.read(false).await;
    assert_eq!(first.status, 200);
    assert_eq!(first.json()["uri"], "/proxy/one");
    assert_eq!(second.json()["uri"], "/proxy/two?x=1");
    assert_eq!(second.header("x-agentenv-node-id"), Some("node-a"));
    // The same connection serves a third request after the pipeline.
    conn.send(&get("/three", "")).await;
    assert_eq!(conn.read(false).await.json()["uri"], "/proxy/three");
    assert_eq!(log.lock().len(), 3);
}

#[tokio::test]
async fn forwarding_headers_are_replaced_and_hop_by_hop_ones_dropped() {
    let (node, log) = FakeNode::echo().await;
    let c = cluster_with(&node.endpoint).await;
    let mut conn = Conn::open(&c).await;
    conn.send(&get(
        "/h",
        "x-forwarded-for: 6.6.6.6\r\nx-forwarded-proto: https\r\nforwarded: for=6.6.6.6\r\n\
         connection: keep-alive, x-private\r\nx-private: secret\r\nkeep-alive: timeout=5\r\n\
         x-kept: yes\r\n",
    ))
    .await;
    assert_eq!(conn.read(false).await.status, 200);
    let seen = log.lock()[0].clone();
    let h = |n: &str| {
        seen.headers
            .get_all(n)
            .iter()
            .map(|v| v.to_str().unwrap().to_string())
            .collect::<Vec<_>>()
    };
    assert_eq!(h("x-forwarded-for"), ["127.0.0.1"]);
    assert_eq!(h("x-forwarded-proto"), ["http"]);
    assert_eq!(h("x-forwarded-host"), ["gw.test"]);
    assert_eq!(h("x-forwarded-method"), ["GET"]);
    assert_eq!(h("x-forwarded-uri"), ["/h"]);
    assert_eq!(h("host"), ["gw.test"]);
    assert_eq!(h("x-kept"), ["yes"]);
    for gone in ["forwarded", "connection", "x-private", "keep-alive"] {
        assert!(h(gone).is_empty(), "{gone} must not reach the node");
    }
}

#[tokio::test]
async fn chunked_node_responses_are_relayed_whole_on_a_reused_node_connection() {
    let node = RawNode::start(|_| {
        (
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\nX-Node-Case: kept\r\n\r\n\
              5;ext=1\r\nhello\r\n1\r\n \r\n6\r\nworld!\r\n0\r\nx-trailer: t\r\n\r\n"
                .to_vec(),
            false,
        )
    })
    .await;
    let c = cluster_with(&node.endpoint).await;
    let mut conn = Conn::open(&c).await;
    for _ in 0..3 {
        conn.send(&get("/chunks", "")).await;
        let a = conn.read(false).await;
        assert_eq!(a.status, 200);
        assert_eq!(a.header("transfer-encoding"), Some("chunked"));
        assert_eq!(a.body, b"hello world!");
        // Relayed byte for byte (hyper would have lower-cased the name).
        assert!(
            a.headers
                .iter()
                .any(|(n, v)| n == "X-Node-Case" && v == "kept")
        );
    }
    assert_eq!(
        node.accepted.load(Ordering::SeqCst),
        1,
        "the node connection is reused after each chunked body"
    );
}

#[tokio::test]
async fn a_response_without_length_is_relayed_until_the_node_closes() {
    let node = RawNode::start(|_| {
        (
            b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\nuntil the end".to_vec(),
            true,
        )
    })
    .await;
    let c = cluster_with(&node.endpoint).await;
    let mut conn = Conn::open(&c).await;
    conn.send(&get("/stream", "")).await;
    let a = conn.read(false).await;
    assert_eq!(a.status, 200);
    assert_eq!(a.header("connection"), Some("close"));
    assert_eq!(a.body, b"until the end");
}

#[tokio::test]
async fn large_request_bodies_are_forwarded_intact_and_the_connection_goes_on() {
    let node = FakeNode::start(|req| async move {
        let body = req.into_body().collect().await.unwrap().to_bytes();
        let sum: u64 = body.iter().map(|&b| u64::from(b)).sum();
        Response::new(agentenv_proxy::body::full(format!("{} {sum}", body.len())))
    })
    .await;
    let c = cluster_with(&node.endpoint).await;
    let body: Vec<u8> = (0..3_000_017u32).map(|i| (i * 7 % 251) as u8).collect();
    let sum: u64 = body.iter().map(|&b| u64::from(b)).sum();
    let mut conn = Conn::open(&c).await;
    let mut req = format!(
        "POST /upload HTTP/1.1\r\nhost: gw.test\r\n{ROUTED}content-length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    req.extend_from_slice(&body);
    conn.send(&req).await;
    let a = conn.read(false).await;
    assert_eq!(a.status, 200);
    assert_eq!(
        String::from_utf8(a.body).unwrap(),
        format!("{} {sum}", body.len())
    );
    conn.send(&get("/after", "")).await;
    assert_eq!(conn.read(false).await.body, b"0 0");
}

#[tokio::test]
async fn a_connection_moves_to_hyper_for_a_chunked_request_and_keeps_working() {
    let (node, log) = FakeNode::echo().await;
    let c = cluster_with(&node.endpoint).await;
    let mut conn = Conn::open(&c).await;
    conn.send(&get("/first", "")).await;
    assert_eq!(conn.read(false).await.json()["uri"], "/proxy/first");
    // Chunked request bodies are not the fast lane's: hyper takes over.
    conn.send(
        format!(
            "POST /second HTTP/1.1\r\nhost: gw.test\r\n{ROUTED}transfer-encoding: chunked\r\n\r\n\
             3\r\nabc\r\n0\r\n\r\n"
        )
        .as_bytes(),
    )
    .await;
    let second = conn.read(false).await;
    assert_eq!(second.json()["uri"], "/proxy/second");
    assert_eq!(second.json()["body"], "abc");
    conn.send(&get("/third", "")).await;
    assert_eq!(conn.read(false).await.json()["uri"], "/proxy/third");
    assert_eq!(log.lock().len(), 3);
}

#[tokio::test]
async fn head_requests_get_the_headers_without_a_body() {
    let node = RawNode::start(|head| {
        let body_len = if head.starts_with("HEAD") { 0 } else { 5 };
        let mut r = b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n".to_vec();
        r.extend_from_slice(&b"12345"[..body_len]);
        (r, false)
    })
    .await;
    let c = cluster_with(&node.endpoint).await;
    let mut conn = Conn::open(&c).await;
    conn.send(format!("HEAD /file HTTP/1.1\r\nhost: gw.test\r\n{ROUTED}\r\n").as_bytes())
        .await;
    let head = conn.read(true).await;
    assert_eq!(head.status, 200);
    assert_eq!(head.header("content-length"), Some("5"));
    conn.send(&get("/file", "")).await;
    assert_eq!(conn.read(false).await.body, b"12345");
}

#[tokio::test]
async fn a_pooled_node_connection_that_was_closed_is_replaced() {
    // The node closes every connection after one answer, as a node whose
    // keep-alive timeout passed would.
    let node = RawNode::start(|_| {
        (
            b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok".to_vec(),
            true,
        )
    })
    .await;
    let c = cluster_with(&node.endpoint).await;
    let mut conn = Conn::open(&c).await;
    for _ in 0..3 {
        conn.send(&get("/again", "")).await;
        let a = conn.read(false).await;
        assert_eq!(a.status, 200);
        assert_eq!(a.body, b"ok");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(node.accepted.load(Ordering::SeqCst), 3);
}

#[tokio::test]
async fn connection_close_from_the_client_closes_after_the_response() {
    let (node, _) = FakeNode::echo().await;
    let c = cluster_with(&node.endpoint).await;
    let mut conn = Conn::open(&c).await;
    conn.send(&get("/bye", "connection: close\r\n")).await;
    let a = conn.read(false).await;
    assert_eq!(a.status, 200);
    assert_eq!(a.header("connection"), Some("close"));
    assert!(conn.closed().await);
}

#[tokio::test]
async fn informational_answers_from_the_node_are_skipped() {
    let node = RawNode::start(|_| {
        (
            b"HTTP/1.1 103 Early Hints\r\nlink: </a.css>\r\n\r\n\
              HTTP/1.1 201 Created\r\ncontent-length: 4\r\n\r\ndone"
                .to_vec(),
            false,
        )
    })
    .await;
    let c = cluster_with(&node.endpoint).await;
    let mut conn = Conn::open(&c).await;
    conn.send(&get("/hints", "")).await;
    let a = conn.read(false).await;
    assert_eq!(a.status, 201);
    assert_eq!(a.body, b"done");
}

#[tokio::test]
async fn http_1_0_requests_are_answered() {
    let (node, _) = FakeNode::echo().await;
    let c = cluster_with(&node.endpoint).await;
    let mut conn = Conn::open(&c).await;
    conn.send(format!("GET /old HTTP/1.0\r\nhost: gw.test\r\n{ROUTED}\r\n").as_bytes())
        .await;
    let a = conn.read(false).await;
    assert_eq!(a.status, 200);
    assert_eq!(a.json()["uri"], "/proxy/old");
}

#[tokio::test]
async fn an_unknown_sandbox_gets_404_and_the_connection_goes_on() {
    let (node, _) = FakeNode::echo().await;
    let c = cluster_with(&node.endpoint).await;
    let mut conn = Conn::open(&c).await;
    conn.send(
        b"POST /x HTTP/1.1\r\nhost: gw.test\r\ne2b-sandbox-id: sbx-gone\r\ne2b-sandbox-port: 1\r\n\
          content-length: 3\r\n\r\nabc",
    )
    .await;
    let a = conn.read(false).await;
    assert_eq!(a.status, 404);
    assert_eq!(a.header("content-type"), Some("application/json"));
    assert!(a.header("date").is_some());
    conn.send(&get("/next", "")).await;
    assert_eq!(conn.read(false).await.json()["uri"], "/proxy/next");
}

#[tokio::test]
async fn a_node_that_dies_mid_body_ends_the_client_connection() {
    let node = RawNode::start(|_| {
        (
            b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly part".to_vec(),
            true,
        )
    })
    .await;
    let c = cluster_with(&node.endpoint).await;
    let mut conn = Conn::open(&c).await;
    conn.send(&get("/cut", "")).await;
    // The head and the first bytes arrive; then the connection ends.
    while conn.fill().await {}
    let text = String::from_utf8_lossy(&conn.buf).into_owned();
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    assert!(text.ends_with("only part"), "{text}");
    let open = || metric_value(&c.metrics_text(), "agentenv_gateway_open_connections");
    eventually("the client connection to be closed", || open() == Some(0.0)).await;
}

#[tokio::test]
async fn clients_that_vanish_mid_request_leave_no_connection_behind() {
    let node = FakeNode::start(|_req| async {
        tokio::time::sleep(Duration::from_millis(200)).await;
        Response::new(agentenv_proxy::body::full("late"))
    })
    .await;
    let c = cluster_with(&node.endpoint).await;
    let mut conns = Vec::new();
    for i in 0..40 {
        let mut conn = Conn::open(&c).await;
        // Half vanish after the head, half in the middle of a body.
        if i % 2 == 0 {
            conn.send(&get("/slow", "")).await;
        } else {
            conn.send(
                format!("POST /slow HTTP/1.1\r\n{ROUTED}content-length: 1000\r\n\r\npartial")
                    .as_bytes(),
            )
            .await;
        }
        conns.push(conn);
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    drop(conns);
    let open = || metric_value(&c.metrics_text(), "agentenv_gateway_open_connections");
    eventually("every client connection to be closed", || {
        open() == Some(0.0)
    })
    .await;
    // The gateway still serves.
    let mut conn = Conn::open(&c).await;
    conn.send(&get("/slow", "")).await;
    assert_eq!(conn.read(false).await.body, b"late");
}
