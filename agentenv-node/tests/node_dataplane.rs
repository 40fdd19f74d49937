//! The data plane relays without buffering: a Connect server stream delivers output
//! while the process still runs, an upgraded connection (WebSocket-style) is bridged both
//! ways, and host-routed requests (`<port>-<id>.<domain>`) reach guest ports.

mod node_common;

use std::time::Duration;

use agentenv_guest::proto::process as pr;
use futures::StreamExt;
use node_common::{Node, create, guest_client, request, run};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn process_output_streams_before_the_process_ends() {
    require_node!();
    let home = tempfile::tempdir().unwrap();
    let node = Node::start(node_common::config(home.path(), 40)).await;
    let addr = node.addr;
    let id = create(addr, r#"{"templateID":"base"}"#).await;
    let c = guest_client(addr, &id);
    // The process prints, then waits for a file that only a second command creates.
    let req = pr::StartRequest {
        process: Some(pr::ProcessConfig {
            cmd: "/bin/sh".into(),
            args: vec![
                "-c".into(),
                "echo first; while [ ! -f /tmp/go ]; do sleep 0.02; done; echo second".into(),
            ],
            ..Default::default()
        }),
        stdin: Some(false),
        ..Default::default()
    };
    let mut stream = c.start(&req).await.unwrap();
    let mut seen = String::new();
    while !seen.contains("first") {
        let ev = tokio::time::timeout(Duration::from_secs(20), stream.next())
            .await
            .expect("output while the process runs")
            .expect("event")
            .unwrap();
        if let Some(pr::process_event::Event::Data(d)) = ev.event.and_then(|e| e.event)
            && let Some(pr::process_event::data_event::Output::Stdout(b)) = d.output
        {
            seen.push_str(&String::from_utf8_lossy(&b));
        }
    }
    assert!(!seen.contains("second"));
    run(addr, &id, None, "touch /tmp/go").await.unwrap();
    let mut ended = false;
    while let Some(ev) = stream.next().await {
        match ev.unwrap().event.and_then(|e| e.event) {
            Some(pr::process_event::Event::Data(d)) => {
                if let Some(pr::process_event::data_event::Output::Stdout(b)) = d.output {
                    seen.push_str(&String::from_utf8_lossy(&b));
                }
            }
            Some(pr::process_event::Event::End(e)) => {
                assert_eq!(e.exit_code, 0);
                ended = true;
                break;
            }
            _ => {}
        }
    }
    assert!(ended);
    assert_eq!(seen, "first\nsecond\n");
    node.stop().await;
}

const UPGRADE_ECHO: &str = r#"
import socket
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 9000))
s.listen(1)
open("/tmp/listening", "w").close()
c, _ = s.accept()
buf = b""
while b"\r\n\r\n" not in buf:
    buf += c.recv(4096)
head = buf.split(b"\r\n\r\n")[0].decode()
proto = [l.split(":", 1)[1].strip() for l in head.split("\r\n") if l.lower().startswith("x-forwarded-proto")]
c.sendall(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nX-Seen-Proto: " + proto[0].encode() + b"\r\n\r\n")
while True:
    d = c.recv(4096)
    if not d:
        break
    c.sendall(d.upper())
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upgraded_connections_are_bridged_both_ways() {
    require_node!();
    let home = tempfile::tempdir().unwrap();
    let node = Node::start(node_common::config(home.path(), 41)).await;
    let addr = node.addr;
    let id = create(addr, r#"{"templateID":"base"}"#).await;
    let script = format!(
        "cat > /tmp/echo.py <<'EOF'\n{UPGRADE_ECHO}\nEOF\n(python3 /tmp/echo.py >/tmp/echo.log 2>&1 &); while [ ! -f /tmp/listening ]; do sleep 0.02; done"
    );
    run(addr, &id, None, &script).await.unwrap();

    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.set_nodelay(true).unwrap();
    let req = format!(
        "GET /proxy/ws HTTP/1.1\r\nHost: {addr}\r\nConnection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\ne2b-sandbox-id: {id}\r\ne2b-sandbox-port: 9000\r\n\r\n"
    );
    s.write_all(req.as_bytes()).await.unwrap();
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        s.read_exact(&mut byte).await.unwrap();
        head.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&head).to_ascii_lowercase();
    assert!(head.starts_with("http/1.1 101"), "{head}");
    assert!(head.contains("x-seen-proto: ws"), "{head}");
    for msg in ["hello", "streamed both ways"] {
        s.write_all(msg.as_bytes()).await.unwrap();
        let mut back = vec![0u8; msg.len()];
        tokio::time::timeout(Duration::from_secs(10), s.read_exact(&mut back))
            .await
            .expect("echo")
            .unwrap();
        assert_eq!(String::from_utf8_lossy(&back), msg.to_uppercase());
    }
    node.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_routes_reach_guest_ports() {
    require_node!();
    let home = tempfile::tempdir().unwrap();
    let mut cfg = node_common::config(home.path(), 42);
    cfg.proxy_domains = vec!["sbx.test".into()];
    let node = Node::start(cfg).await;
    let addr = node.addr;
    let r = node_common::api(addr, "POST", "/v2/sandboxes", r#"{"templateID":"base"}"#).await;
    assert_eq!(r.json()["domain"], "sbx.test");
    let id = r.json()["sandboxID"].as_str().unwrap().to_string();
    // Even /health and /sandboxes go to the sandbox under its host.
    let host = format!("49983-{id}.sbx.test");
    let token = node_common::envd_token(&id);
    let h = request(
        addr,
        "GET",
        "/health",
        &[("host", &host), ("x-access-token", &token)],
        "",
    )
    .await;
    assert_eq!(h.status, 204);
    let f = request(
        addr,
        "GET",
        "/files?path=/etc/hostname",
        &[("host", &host), ("x-access-token", &token)],
        "",
    )
    .await;
    assert_eq!((f.status, f.text().trim()), (200, id.as_str()));
    // A malformed label under the domain: 401 without the key, 400 with it.
    let bad = request(addr, "GET", "/", &[("host", "nope.sbx.test")], "").await;
    assert_eq!(bad.status, 401);
    let bad = request(
        addr,
        "GET",
        "/",
        &[
            ("host", "nope.sbx.test"),
            ("x-api-key", node_common::API_KEY),
        ],
        "",
    )
    .await;
    assert_eq!(bad.status, 400);
    node.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_files_stream_both_ways_through_the_data_plane() {
    use sha2::{Digest, Sha256};
    require_node!();
    let home = tempfile::tempdir().unwrap();
    let node = Node::start(node_common::config(home.path(), 43)).await;
    let addr = node.addr;
    let id = create(addr, r#"{"templateID":"base"}"#).await;
    let c = guest_client(addr, &id);
    const CHUNKS: usize = 64;
    let chunk = |i: usize| bytes::Bytes::from(vec![(i * 7 % 251) as u8; 1 << 20]);
    let mut want = Sha256::new();
    for i in 0..CHUNKS {
        want.update(chunk(i));
    }
    let want = format!("{:x}", want.finalize());
    let stream = futures::stream::iter((0..CHUNKS).map(move |i| Ok::<_, std::io::Error>(chunk(i))));
    c.upload("/var/tmp/big", stream).await.unwrap();
    let out = run(addr, &id, None, "sha256sum /var/tmp/big | cut -d' ' -f1")
        .await
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), want);
    let mut down = c.download("/var/tmp/big").await.unwrap();
    let mut got = Sha256::new();
    let mut n = 0usize;
    while let Some(b) = down.next().await {
        let b = b.unwrap();
        n += b.len();
        got.update(&b);
    }
    assert_eq!(n, CHUNKS << 20);
    assert_eq!(format!("{:x}", got.finalize()), want);
    node.stop().await;
}

const SILENT_SERVER: &str = r#"
import socket, threading
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 9001))
s.listen(8)
open("/tmp/silent", "w").close()
held = []
while True:
    c, _ = s.accept()
    held.append(c)
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_sandboxes_and_stalled_uploads_time_out() {
    require_node!();
    let home = tempfile::tempdir().unwrap();
    let mut cfg = node_common::config(home.path(), 44);
    cfg.proxy_response_header_timeout = Duration::from_millis(300);
    cfg.proxy_upload_idle_timeout = Duration::from_millis(300);
    let node = Node::start(cfg).await;
    let addr = node.addr;
    let id = create(addr, r#"{"templateID":"base"}"#).await;
    let script = format!(
        "cat > /tmp/silent.py <<'EOF'\n{SILENT_SERVER}\nEOF\n(python3 /tmp/silent.py >/dev/null 2>&1 &); while [ ! -f /tmp/silent ]; do sleep 0.02; done"
    );
    run(addr, &id, None, &script).await.unwrap();
    let h = [
        ("e2b-sandbox-id", id.as_str()),
        ("e2b-sandbox-port", "9001"),
    ];
    let r = tokio::time::timeout(
        Duration::from_secs(20),
        request(addr, "GET", "/proxy/slow", &h, ""),
    )
    .await
    .expect("the node answers");
    assert_eq!(r.status, 504, "{}", r.text());
    assert!(
        r.json()["message"]
            .as_str()
            .unwrap()
            .contains("no response headers")
    );

    // A client that stops sending its body mid-way: the relay gives up.
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "POST /proxy/upload HTTP/1.1\r\nHost: {addr}\r\ne2b-sandbox-id: {id}\r\ne2b-sandbox-port: 9001\r\nContent-Length: 1000\r\n\r\npartial"
    );
    s.write_all(head.as_bytes()).await.unwrap();
    let mut buf = vec![0u8; 1024];
    let n = tokio::time::timeout(Duration::from_secs(20), s.read(&mut buf))
        .await
        .expect("the node answers a stalled upload")
        .unwrap();
    let text = String::from_utf8_lossy(&buf[..n]);
    assert!(text.starts_with("HTTP/1.1 502"), "{text}");
    node.stop().await;
}
