//! The real `agentenv-gateway` binary in front of the real scheduler binary
//! and a small runtime node served by the test, all on loopback.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use agentenv_bin::http_client::request;
use agentenv_core::proto::scheduler_v1::scheduler_client::SchedulerClient;
use agentenv_core::proto::scheduler_v1::*;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};

const SCHEDULER: &str = env!("CARGO_BIN_EXE_agentenv-scheduler");
const GATEWAY: &str = env!("CARGO_BIN_EXE_agentenv-gateway");
const KEY: &str = "e2b_0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts a daemon with LOG_FORMAT=json and returns the fields of its
/// "listening" line.
fn spawn(
    bin: &str,
    config: &std::path::Path,
    env: &[(&str, &str)],
    message: &'static str,
) -> (Proc, serde_json::Value) {
    let (p, v, _) = spawn_logging(bin, config, env, message);
    (p, v)
}

/// A runtime node that answers creates with a sandbox id and echoes other
/// requests' method and path.
async fn fake_node() -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(|req: Request<Incoming>| async move {
                    let (parts, body) = req.into_parts();
                    let _ = body.collect().await;
                    let resp = if parts.method == hyper::Method::POST
                        && parts.uri.path() == "/sandboxes"
                    {
                        Response::builder()
                            .status(201)
                            .header("x-agentenv-sandbox-id", "sbx-from-node")
                            .header("content-type", "application/json")
                            .body(Full::new(Bytes::from(r#"{"sandboxID":"sbx-from-node"}"#)))
                    } else {
                        Response::builder().body(Full::new(Bytes::from(format!(
                            "{} {}",
                            parts.method,
                            parts.uri.path()
                        ))))
                    };
                    Ok::<_, std::convert::Infallible>(resp.unwrap())
                });
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    addr
}

/// Sends one HTTP/1.1 request and returns (status, body).
async fn http(
    addr: &str,
    method: &str,
    path: &str,
    key: Option<&str>,
    body: &str,
) -> (u16, String) {
    let mut headers = vec![("host", "gw"), ("content-type", "application/json")];
    if let Some(k) = key {
        headers.push(("x-api-key", k));
    }
    let r = request(
        addr.parse::<std::net::SocketAddr>().unwrap(),
        method,
        path,
        &headers,
        body.as_bytes(),
        Duration::from_secs(30),
    )
    .await
    .unwrap();
    (r.status, r.text())
}

#[tokio::test]
async fn gateway_binary_routes_creates_and_sandbox_requests_through_the_scheduler_binary() {
    let node = fake_node().await;
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("control-plane.json");
    std::fs::write(
        &config,
        format!(
            r#"{{
  "scheduler": {{
    "grpc_listen_addr": "127.0.0.1:0",
    "metrics_listen_addr": "127.0.0.1:0",
    "nodes": [{{"id": "node-a", "endpoint": "http://{node}"}}]
  }},
  "gateway": {{
    "http_listen_addr": "127.0.0.1:0",
    "metrics_listen_addr": "127.0.0.1:0",
    "request_timeout": "10s"
  }}
}}"#
        ),
    )
    .unwrap();
    let (_sched, s) = spawn(SCHEDULER, &config, &[], "scheduler listening");
    let grpc = s["grpc_addr"].as_str().unwrap().to_string();
    // The scheduler listens on an ephemeral port: the gateway learns it
    // through the environment override of gateway.scheduler_addr.
    let (mut gw, g) = spawn(
        GATEWAY,
        &config,
        &[("AENV_API_KEY", KEY), ("GATEWAY_SCHEDULER_ADDR", &grpc)],
        "gateway listening",
    );
    let http_addr = g["http_addr"].as_str().unwrap().to_string();

    let (status, _) = http(&http_addr, "GET", "/health", None, "").await;
    assert_eq!(status, 204);
    let (status, body) = http(&http_addr, "GET", "/nodes", None, "").await;
    assert_eq!(
        (status, body.as_str()),
        (401, ""),
        "no key: 401 with an empty body"
    );

    let create = || {
        let body = r#"{"templateID":"base"}"#;
        http(&http_addr, "POST", "/sandboxes", Some(KEY), body)
    };
    // No heartbeat yet: nothing is healthy.
    let (status, body) = create().await;
    assert_eq!(status, 503, "{body}");
    let err: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(err["code"], 503);
    let m = err["message"].as_str().unwrap();
    assert!(
        m.starts_with("no nodes available: ") && m.contains("GET /nodes"),
        "{m}"
    );

    let mut sched = SchedulerClient::connect(format!("http://{grpc}"))
        .await
        .unwrap();
    sched
        .heartbeat(HeartbeatRequest {
            node_id: "node-a".into(),
            service_instance_id: "node-a-1".into(),
            snapshot: Some(NodeSnapshot {
                status: NodeStatus::Ready as i32,
                ..Default::default()
            }),
            ..Default::default()
        })
        .await
        .unwrap();
    let (status, body) = create().await;
    assert_eq!(status, 201, "{body}");
    assert!(body.contains("sbx-from-node"));
    // The gateway recorded the assignment: the sandbox is routed by id.
    let owner = sched
        .lookup_node(LookupNodeRequest {
            sandbox_id: "sbx-from-node".into(),
        })
        .await
        .unwrap()
        .into_inner()
        .node
        .unwrap();
    assert_eq!(owner.node_id, "node-a");
    let (status, body) = http(
        &http_addr,
        "POST",
        "/sandboxes/sbx-from-node/pause",
        Some(KEY),
        "",
    )
    .await;
    assert_eq!(
        (status, body.as_str()),
        (200, "POST /sandboxes/sbx-from-node/pause")
    );
    let (status, body) = http(&http_addr, "GET", "/nodes", Some(KEY), "").await;
    assert_eq!(status, 200);
    assert!(body.contains("node-a"), "{body}");

    Command::new("kill")
        .args(["-TERM", &gw.0.id().to_string()])
        .status()
        .unwrap();
    let exit = agentenv_testkit::eventually(
        "the gateway to stop on SIGTERM",
        Duration::from_secs(15),
        || std::future::ready(gw.0.try_wait().unwrap()),
    )
    .await;
    assert!(exit.success(), "{exit:?}");
}

fn refused(args: &[&str], env: &[(&str, &str)], json: &str) -> String {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("cp.json");
    std::fs::write(&config, json).unwrap();
    let mut cmd = Command::new(GATEWAY);
    cmd.args(args)
        .arg("-config")
        .arg(&config)
        .env_remove("AENV_API_KEY");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert_eq!(stderr.trim_end().lines().count(), 1, "one line: {stderr}");
    stderr
}

#[test]
fn gateway_binary_refuses_bad_config_and_missing_keys_in_one_line() {
    let e = refused(
        &[],
        &[("AENV_API_KEY", KEY)],
        r#"{"gateway":{"scheduler_addr":"http://10.0.0.10:9090"}}"#,
    );
    assert!(
        e.contains("gateway.scheduler_addr") && e.contains("10.0.0.10:9090"),
        "{e}"
    );
    let e = refused(&[], &[("AENV_API_KEY", "")], "{}");
    assert!(e.contains("AENV_API_KEY"), "{e}");
    let e = refused(&[], &[("AENV_API_KEY", "too-short")], "{}");
    assert!(e.contains("between 32 and 256"), "{e}");
}

/// A CA of the test and leaf certificates for 127.0.0.1 it signs.
struct TestCa {
    issuer: rcgen::Issuer<'static, rcgen::KeyPair>,
    pem: String,
}

impl TestCa {
    fn new() -> Self {
        use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let cert = params.self_signed(&key).unwrap();
        Self {
            pem: cert.pem(),
            issuer: Issuer::new(params, key),
        }
    }

    /// Writes a fresh leaf for 127.0.0.1 to `cert` and `key`.
    fn issue(&self, cert: &std::path::Path, key: &std::path::Path) {
        let k = rcgen::KeyPair::generate().unwrap();
        let c = rcgen::CertificateParams::new(vec!["127.0.0.1".to_string()])
            .unwrap()
            .signed_by(&k, &self.issuer)
            .unwrap();
        // Written next to the target and renamed, as a renewal tool does.
        for (path, pem) in [(cert, c.pem()), (key, k.serialize_pem())] {
            let tmp = path.with_extension("new");
            std::fs::write(&tmp, pem).unwrap();
            std::fs::rename(&tmp, path).unwrap();
        }
    }

    fn connector(&self, dir: &std::path::Path) -> tokio_rustls::TlsConnector {
        let ca = dir.join("ca.pem");
        std::fs::write(&ca, &self.pem).unwrap();
        let mut cfg =
            (*agentenv_core::tls::client_config(&ca, None, &[b"http/1.1"]).unwrap()).clone();
        // Every handshake a full one: a resumed session shows no certificate.
        cfg.resumption = rustls::client::Resumption::disabled();
        tokio_rustls::TlsConnector::from(std::sync::Arc::new(cfg))
    }
}

/// A node whose every answer is a chunked stream of `ticks` lines, one each 50 ms.
async fn streaming_node(ticks: usize) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |_req: Request<Incoming>| async move {
                    let (tx, rx) = tokio::sync::mpsc::channel::<
                        Result<hyper::body::Frame<Bytes>, std::convert::Infallible>,
                    >(1);
                    tokio::spawn(async move {
                        for i in 0..ticks {
                            let line = Bytes::from(format!("tick {i}\n"));
                            if tx.send(Ok(hyper::body::Frame::data(line))).await.is_err() {
                                return;
                            }
                            tokio::time::sleep(Duration::from_millis(50)).await;
                        }
                    });
                    let body = http_body_util::StreamBody::new(
                        tokio_stream::wrappers::ReceiverStream::new(rx),
                    );
                    Ok::<_, std::convert::Infallible>(Response::new(body))
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    addr
}

#[tokio::test]
async fn sighup_gives_new_tls_connections_the_renewed_certificate_while_an_open_stream_goes_on() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    const TICKS: usize = 40;
    let node = streaming_node(TICKS).await;
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new();
    let (cert, key) = (dir.path().join("gw.pem"), dir.path().join("gw-key.pem"));
    ca.issue(&cert, &key);
    let config = dir.path().join("control-plane.json");
    std::fs::write(
        &config,
        serde_json::json!({
            "scheduler": {
                "grpc_listen_addr": "127.0.0.1:0",
                "metrics_listen_addr": "127.0.0.1:0",
                "nodes": [{"id": "node-a", "endpoint": format!("http://{node}")}]
            },
            "gateway": {
                "http_listen_addr": "127.0.0.1:0",
                "metrics_listen_addr": "127.0.0.1:0",
                "request_timeout": "30s",
                "tls": {"cert_file": cert, "key_file": key}
            }
        })
        .to_string(),
    )
    .unwrap();
    let (_sched, s) = spawn(SCHEDULER, &config, &[], "scheduler listening");
    let grpc = s["grpc_addr"].as_str().unwrap().to_string();
    let mut sched = SchedulerClient::connect(format!("http://{grpc}"))
        .await
        .unwrap();
    sched
        .heartbeat(HeartbeatRequest {
            node_id: "node-a".into(),
            service_instance_id: "node-a-1".into(),
            snapshot: Some(NodeSnapshot {
                status: NodeStatus::Ready as i32,
                ..Default::default()
            }),
            sandbox_ids: vec!["sbx-1".into()],
            ..Default::default()
        })
        .await
        .unwrap();
    let (gw, g, logs) = spawn_logging(
        GATEWAY,
        &config,
        &[("AENV_API_KEY", KEY), ("GATEWAY_SCHEDULER_ADDR", &grpc)],
        "gateway listening",
    );
    let addr: SocketAddr = g["http_addr"].as_str().unwrap().parse().unwrap();
    let connector = ca.connector(dir.path());
    let connect = || async {
        let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        let name = rustls::pki_types::ServerName::try_from("127.0.0.1").unwrap();
        let tls = connector.connect(name, tcp).await.unwrap();
        let leaf = tls.get_ref().1.peer_certificates().unwrap()[0].to_vec();
        (tls, leaf)
    };

    // A stream through the gateway, open across the reload.
    let (mut stream, first) = connect().await;
    stream
        .write_all(
            b"GET /stream HTTP/1.1\r\nhost: gw\r\ne2b-sandbox-id: sbx-1\r\ne2b-sandbox-port: 49983\r\n\r\n",
        )
        .await
        .unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&got).contains("tick 1\n") {
        let n = stream.read(&mut buf).await.unwrap();
        assert!(
            n > 0,
            "the stream ended early: {}",
            String::from_utf8_lossy(&got)
        );
        got.extend_from_slice(&buf[..n]);
    }

    ca.issue(&cert, &key);
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(gw.0.id() as i32),
        nix::sys::signal::Signal::SIGHUP,
    )
    .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        match logs.recv_timeout(left) {
            Ok(m) if m == "reloaded the TLS certificate (SIGHUP)" => break,
            Ok(_) => {}
            Err(e) => panic!("the gateway did not log the reload: {e}"),
        }
    }
    let (_fresh, renewed) = connect().await;
    assert_ne!(
        renewed, first,
        "a new handshake presents the renewed certificate"
    );

    // The stream opened before the reload runs to its end on its connection.
    let last = format!("tick {}\n", TICKS - 1);
    while !String::from_utf8_lossy(&got).contains(&last) {
        let n = tokio::time::timeout(Duration::from_secs(10), stream.read(&mut buf))
            .await
            .expect("the open stream keeps flowing")
            .unwrap();
        assert!(
            n > 0,
            "the stream ended early: {}",
            String::from_utf8_lossy(&got)
        );
        got.extend_from_slice(&buf[..n]);
    }
    let text = String::from_utf8_lossy(&got);
    for i in 0..TICKS {
        assert!(
            text.contains(&format!("tick {i}\n")),
            "tick {i} missing: {text}"
        );
    }
}

/// Like [`spawn`], and the messages of every other log line through a channel.
fn spawn_logging(
    bin: &str,
    config: &std::path::Path,
    env: &[(&str, &str)],
    message: &'static str,
) -> (Proc, serde_json::Value, std::sync::mpsc::Receiver<String>) {
    let mut cmd = Command::new(bin);
    cmd.arg("-config")
        .arg(config)
        .env("LOG_FORMAT", "json")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().unwrap();
    let stdout = child.stdout.take().unwrap();
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let Ok(v) = serde_json::from_str::<serde_json::Value>(&line) else {
                continue;
            };
            if v["message"] == message {
                let _ = ready_tx.send(v);
            } else if let Some(m) = v["message"].as_str() {
                let _ = tx.send(m.to_string());
            }
        }
    });
    let v = ready_rx
        .recv_timeout(Duration::from_secs(30))
        .unwrap_or_else(|_| panic!("{bin} did not log {message:?}"));
    (Proc(child), v, rx)
}
