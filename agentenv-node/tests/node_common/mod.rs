//! Helpers of the node daemon tests: an in-process node on loopback with the jail backend,
//! the shared `base` template and the real guest agent, and a small HTTP client.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::time::Duration;

use agentenv_node::config::NodeConfig;
use agentenv_node::daemon::Daemon;
pub use agentenv_testkit::host_rules as rules_common;
pub use agentenv_testkit::node::{TEMPLATE_CACHE, init_tracing};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

pub const API_KEY: &str = "test-api-key-0123456789abcdef0123456789";

/// Why these tests cannot run here, if they cannot.
pub fn skip_reason() -> Option<String> {
    if let Some(why) = agentenv_testkit::node::unless_root(
        "the jail backend needs root (namespaces, cgroups, veth, iptables)",
    ) {
        return Some(why);
    }
    if guest_binary().is_none() {
        return Some(
            "no agentenv-guest binary: run agentenv-guest/build-static.sh and set AGENTENV_GUEST_BIN"
                .into(),
        );
    }
    None
}

#[macro_export]
macro_rules! require_node {
    () => {
        if let Some(reason) = node_common::skip_reason() {
            eprintln!("SKIPPED: {reason}");
            return;
        }
    };
}

/// The agent binary: `AGENTENV_GUEST_BIN`, else the static build in the target directory.
pub fn guest_binary() -> Option<PathBuf> {
    agentenv_testkit::bins::find_static_binary("AGENTENV_GUEST_BIN", "agentenv-guest")
}

/// A config for a node on loopback with data under `home`; `slot` (0..128) keeps the
/// address pools and interface names of concurrent test nodes apart.
/// The token seed of every test node: tests derive a sandbox's access token from it.
pub const TEST_SEED: &str = "node-test-seed";

/// The access token of sandbox `id` on a test node.
pub fn envd_token(id: &str) -> String {
    agentenv_node::access::TokenIssuer::new(TEST_SEED).envd_token(id)
}

pub fn config(home: &Path, slot: u8) -> NodeConfig {
    let mut env = std::collections::HashMap::new();
    env.insert("API_ADDR", "127.0.0.1:0".to_string());
    env.insert("AENV_NODE_ID", format!("test-node-{slot}"));
    env.insert("AENV_API_KEY", API_KEY.to_string());
    env.insert("AENV_SANDBOX_ACCESS_TOKEN_HASH_SEED", TEST_SEED.to_string());
    env.insert("AENV_HOME_PATH", home.display().to_string());
    env.insert("AENV_BACKEND", "jail".to_string());
    env.insert(
        "AENV_GUEST_BINARY_PATH",
        guest_binary().unwrap().display().to_string(),
    );
    env.insert("AENV_TEMPLATE_PATH", TEMPLATE_CACHE.to_string());
    env.insert("AENV_RUNTIME_PATH", "/run/agentenv".to_string());
    env.insert("AENV_JAIL_ADDRESS_POOL", address_pool(slot));
    env.insert("AENV_JAIL_IFACE_PREFIX", iface_prefix(slot));
    env.insert(
        "AENV_JAIL_CGROUP_PARENT",
        format!("agentenv-nodetest-{slot}"),
    );
    env.insert("AENV_AUTO_EVICT_INTERVAL_MS", "50".to_string());
    let mut c = NodeConfig::load(None, &|k| env.get(k).cloned()).expect("config");
    // The slot's prefix is this test's: its host chains go when the process exits, if
    // [`Node::stop`] has not removed them before.
    rules_common::remove_at_exit(&c.jail_iface_prefix, &c.runtime_path);
    c.default_cpu_count = 1;
    c.default_memory_mb = 256;
    c.default_timeout = Duration::from_secs(300);
    c
}

/// The sandbox addresses of a test node: a /26 of its own (slots 0..64 in 10.14.0.0/16,
/// the next ones in 10.18.0.0/16).
pub fn address_pool(slot: u8) -> String {
    let (net, n) = if slot < 64 {
        (14, slot)
    } else {
        (18, slot - 64)
    };
    format!("10.{net}.{}.0/26", u16::from(n) * 4)
}

/// `t` + two letters from `slot`.
pub fn iface_prefix(slot: u8) -> String {
    let a = (b'a' + slot / 26) as char;
    let b = (b'a' + slot % 26) as char;
    format!("t{a}{b}")
}

/// Makes sure the `base` template exists in the shared cache (built once).
pub async fn ensure_base() {
    agentenv_testkit::node::ensure_base().await;
}

/// A node serving in this process until the returned sender fires.
pub struct Node {
    pub addr: std::net::SocketAddr,
    pub orch: std::sync::Arc<agentenv_node::lifecycle::Orchestrator>,
    iface_prefix: String,
    runtime_dir: PathBuf,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl Node {
    pub async fn start(cfg: NodeConfig) -> Node {
        init_tracing();
        ensure_base().await;
        let (iface_prefix, runtime_dir) = (cfg.jail_iface_prefix.clone(), cfg.runtime_path.clone());
        rules_common::remove_at_exit(&iface_prefix, &runtime_dir);
        let d = Daemon::start(cfg).await.expect("daemon start");
        let addr = d.local_addr();
        let orch = d.orchestrator();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(d.run(async move {
            let _ = rx.await;
        }));
        Node {
            addr,
            orch,
            iface_prefix,
            runtime_dir,
            stop: Some(tx),
            task: Some(task),
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Graceful shutdown; returns when the node has stopped and, unless sandboxes of its
    /// outlive it, its host firewall chains are gone.
    pub async fn stop(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.task.take() {
            let _ = t.await;
        }
        rules_common::remove(&self.iface_prefix, &self.runtime_dir).await;
    }
}

/// A response: status, headers, body.
#[derive(Debug)]
pub struct Resp {
    pub status: u16,
    pub headers: http::HeaderMap,
    pub body: Bytes,
}

impl Resp {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", String::from_utf8_lossy(&self.body)))
    }
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// One HTTP/1.1 request on a fresh connection.
pub async fn request(
    addr: std::net::SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: impl Into<Bytes>,
) -> Resp {
    let stream = TcpStream::connect(addr).await.expect("connect");
    stream.set_nodelay(true).unwrap();
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .expect("handshake");
    tokio::spawn(conn);
    let mut b = hyper::Request::builder().method(method).uri(path);
    if !headers.iter().any(|(k, _)| k.eq_ignore_ascii_case("host")) {
        b = b.header("host", addr.to_string());
    }
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    let req = b.body(Full::new(body.into())).unwrap();
    let resp = sender.send_request(req).await.expect("response");
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let body = resp.into_body().collect().await.expect("body").to_bytes();
    Resp {
        status,
        headers,
        body,
    }
}

/// A control-plane call with the API key.
pub async fn api(addr: std::net::SocketAddr, method: &str, path: &str, body: &str) -> Resp {
    request(
        addr,
        method,
        path,
        &[("x-api-key", API_KEY), ("content-type", "application/json")],
        body.to_string(),
    )
    .await
}

/// Takes a snapshot of sandbox `id` (`POST /sandboxes/{id}/snapshots` with `body`).
pub async fn snapshot(addr: std::net::SocketAddr, id: &str, body: &str) -> Resp {
    api(addr, "POST", &format!("/sandboxes/{id}/snapshots"), body).await
}

/// `POST /v2/sandboxes` from template (or snapshot) `template`, nothing else set.
pub async fn create_from(addr: std::net::SocketAddr, template: &str) -> Resp {
    let body = format!(r#"{{"templateID":"{template}"}}"#);
    api(addr, "POST", "/v2/sandboxes", &body).await
}

/// `DELETE /sandboxes/{id}`.
pub async fn delete(addr: std::net::SocketAddr, id: &str) -> Resp {
    api(addr, "DELETE", &format!("/sandboxes/{id}"), "").await
}

/// Creates a sandbox with `body` and returns its id.
pub async fn create(addr: std::net::SocketAddr, body: &str) -> String {
    let r = api(addr, "POST", "/v2/sandboxes", body).await;
    assert_eq!(r.status, 201, "{}", r.text());
    let id = r.json()["sandboxID"].as_str().unwrap().to_string();
    assert_eq!(
        r.headers
            .get("x-agentenv-sandbox-id")
            .unwrap()
            .to_str()
            .unwrap(),
        id
    );
    id
}

/// A client of sandbox `id`'s agent through the node's data plane, with the sandbox's
/// access token.
pub fn guest_client(addr: std::net::SocketAddr, id: &str) -> agentenv_guest::client::GuestClient {
    agentenv_guest::client::GuestClient::new(&format!("http://{addr}"))
        .unwrap()
        .with_header("e2b-sandbox-id", id)
        .unwrap()
        .with_access_token(&envd_token(id))
}

/// What `script` prints on stdout in sandbox `id` (trimmed); panics when it fails.
pub async fn sh_ok(addr: std::net::SocketAddr, id: &str, script: &str) -> String {
    let out = run(addr, id, None, script)
        .await
        .unwrap_or_else(|e| panic!("{script}: {e}"));
    assert_eq!(
        out.end.as_ref().map(|e| e.exit_code),
        Some(0),
        "{script}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// Runs a shell command in a sandbox through the node's data plane, with `token`
/// (default: the sandbox's own).
pub async fn run(
    addr: std::net::SocketAddr,
    id: &str,
    token: Option<&str>,
    script: &str,
) -> Result<agentenv_guest::client::ProcessOutput, agentenv_guest::client::ClientError> {
    let mut c = guest_client(addr, id)
        .with_header("e2b-sandbox-port", "49983")
        .unwrap();
    if let Some(t) = token {
        c = c.with_access_token(t);
    }
    c.run("/bin/sh", &["-c", script]).await
}

/// Builds template `name` (`POST /v3/templates`, then the build with `body`) and waits
/// for the build to end; returns its last status (`"status"` is `ready` or `error`).
pub async fn build_template(
    addr: std::net::SocketAddr,
    name: &str,
    body: &serde_json::Value,
) -> serde_json::Value {
    let r = api(
        addr,
        "POST",
        "/v3/templates",
        &format!(r#"{{"name":"{name}","cpuCount":1,"memoryMB":256}}"#),
    )
    .await;
    assert_eq!(r.status, 202, "{}", r.text());
    let v = r.json();
    let (tid, bid) = (
        v["templateID"].as_str().unwrap().to_string(),
        v["buildID"].as_str().unwrap().to_string(),
    );
    let r = api(
        addr,
        "POST",
        &format!("/v2/templates/{tid}/builds/{bid}"),
        &body.to_string(),
    )
    .await;
    assert_eq!(r.status, 202, "{}", r.text());
    wait_build(addr, &tid, &bid).await
}

/// Waits until build `bid` of template `tid` ends; returns its last status with its logs
/// (`"status"` is `ready` or `error`).
pub async fn wait_build(addr: std::net::SocketAddr, tid: &str, bid: &str) -> serde_json::Value {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(180);
    loop {
        let r = api(
            addr,
            "GET",
            &format!("/templates/{tid}/builds/{bid}/status?logsOffset=0&limit=1000"),
            "",
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.text());
        let v = r.json();
        if v["status"] == "ready" || v["status"] == "error" {
            return v;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the build did not end: {v}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
