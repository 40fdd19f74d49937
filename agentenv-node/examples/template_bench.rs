//! Template builds and first starts, against a create from `base` measured in the same run.
//!
//! ```text
//! cargo run --release -p agentenv-node --example template_bench [-- --rounds N]
//!     [--templates DIR]
//! ```
//!
//! Two nodes in this process share one store (as nodes share a mount) and each has its
//! own template directory holding only `base`. Each round builds, on node A, a template
//! of one `RUN` step from `base` that no round ran before (cold: a build sandbox, the
//! step, the layer captured and stored), then the same build again (cached: every step
//! from the layer cache); then node B, which has not seen the template, creates a sandbox
//! from it (the layer fetched from the store and applied over a copy of `base`), and
//! creates a second one (the template local now). The reference is a create from
//! `base` on node B. Prints p50/p90 and the ratios to the reference. Needs root, the
//! static guest agent (`AGENTENV_GUEST_BIN` or its static build) and `base` in the
//! templates directory (built there on first use).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use agentenv_node::config::NodeConfig;
use agentenv_node::daemon::Daemon;
use anyhow::{Context, bail};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;

const API_KEY: &str = "template-bench-key-0123456789abcdef0123";

async fn call(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: &str,
) -> anyhow::Result<(u16, serde_json::Value)> {
    let stream = tokio::net::TcpStream::connect(addr).await?;
    let (mut tx, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(conn);
    let req = hyper::Request::builder()
        .method(method)
        .uri(path)
        .header("host", addr.to_string())
        .header("x-api-key", API_KEY)
        .header("content-type", "application/json")
        .body(Full::new(bytes::Bytes::from(body.to_string())))?;
    let resp = tx.send_request(req).await?;
    let status = resp.status().as_u16();
    let body = resp.into_body().collect().await?.to_bytes();
    Ok((
        status,
        serde_json::from_slice(&body).unwrap_or(serde_json::Value::Null),
    ))
}

async fn start_node(slot: u8, home: &Path, base: &Path, store: &Path) -> anyhow::Result<Daemon> {
    let tpl = home.join("templates");
    std::fs::create_dir_all(&tpl)?;
    let st = std::process::Command::new("cp")
        .arg("-al")
        .arg(base)
        .arg(tpl.join("base"))
        .status()?;
    if !st.success() {
        bail!("cp -al {} failed", base.display());
    }
    let guest = agentenv_testkit::bins::static_guest_binary().map_err(anyhow::Error::msg)?;
    let env: std::collections::HashMap<&str, String> = [
        ("API_ADDR", "127.0.0.1:0".to_string()),
        ("AENV_NODE_ID", format!("bench-{slot}")),
        ("AENV_API_KEY", API_KEY.to_string()),
        (
            "AENV_SANDBOX_ACCESS_TOKEN_HASH_SEED",
            "template-bench-seed".to_string(),
        ),
        ("AENV_HOME_PATH", home.display().to_string()),
        ("AENV_BACKEND", "jail".to_string()),
        ("AENV_GUEST_BINARY_PATH", guest.display().to_string()),
        ("AENV_TEMPLATE_PATH", tpl.display().to_string()),
        ("AENV_RUNTIME_PATH", "/run/agentenv-bench".to_string()),
        ("AENV_SNAPSHOT_STORE", store.display().to_string()),
        ("AENV_JAIL_ADDRESS_POOL", format!("10.16.{slot}.0/24")),
        (
            "AENV_JAIL_IFACE_PREFIX",
            format!("tb{}", (b'a' + slot) as char),
        ),
        ("AENV_JAIL_CGROUP_PARENT", format!("agentenv-tbench-{slot}")),
    ]
    .into_iter()
    .collect();
    let mut cfg = NodeConfig::load(None, &|k| env.get(k).cloned()).context("node config")?;
    cfg.default_cpu_count = 1;
    cfg.default_memory_mb = 256;
    Ok(Daemon::start(cfg).await?)
}

async fn build(addr: SocketAddr, name: &str, cmd: &str) -> anyhow::Result<Duration> {
    let (st, v) = call(
        addr,
        "POST",
        "/v3/templates",
        &format!(r#"{{"name":"{name}","cpuCount":1,"memoryMB":256}}"#),
    )
    .await?;
    if st != 202 {
        bail!("POST /v3/templates: {st} {v}");
    }
    let (tid, bid) = (
        v["templateID"].as_str().unwrap_or_default().to_string(),
        v["buildID"].as_str().unwrap_or_default().to_string(),
    );
    let body = serde_json::json!({"fromTemplate": "base", "steps": [{"type": "RUN", "args": [cmd], "force": false}]});
    let started = Instant::now();
    let (st, v) = call(
        addr,
        "POST",
        &format!("/v2/templates/{tid}/builds/{bid}"),
        &body.to_string(),
    )
    .await?;
    if st != 202 {
        bail!("starting the build: {st} {v}");
    }
    loop {
        let (_, v) = call(
            addr,
            "GET",
            &format!("/templates/{tid}/builds/{bid}/status?logsOffset=100000"),
            "",
        )
        .await?;
        match v["status"].as_str() {
            Some("ready") => return Ok(started.elapsed()),
            Some("error") => bail!("build failed: {}", v["reason"]),
            _ => tokio::time::sleep(Duration::from_millis(2)).await,
        }
    }
}

async fn create(addr: SocketAddr, template: &str) -> anyhow::Result<Duration> {
    let started = Instant::now();
    let (st, v) = call(
        addr,
        "POST",
        "/v2/sandboxes",
        &format!(r#"{{"templateID":"{template}","timeout":60}}"#),
    )
    .await?;
    let took = started.elapsed();
    if st != 201 {
        bail!("create from {template}: {st} {v}");
    }
    let id = v["sandboxID"].as_str().unwrap_or_default();
    call(addr, "DELETE", &format!("/sandboxes/{id}"), "").await?;
    Ok(took)
}

fn pct(v: &mut [Duration], p: f64) -> Duration {
    v.sort();
    v[(((v.len() - 1) as f64) * p).round() as usize]
}

fn row(name: &str, v: &mut [Duration], reference: Duration) {
    let p50 = pct(v, 0.5);
    let p90 = pct(v, 0.9);
    println!(
        "{name:<52} p50 {:8.1} ms   p90 {:8.1} ms   {:6.1}x create from base",
        p50.as_secs_f64() * 1e3,
        p90.as_secs_f64() * 1e3,
        p50.as_secs_f64() / reference.as_secs_f64().max(1e-9)
    );
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let mut rounds = 5usize;
    let mut templates = PathBuf::from("/var/cache/agentenv-test/templates");
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--rounds" => rounds = it.next().context("--rounds needs a number")?.parse()?,
            "--templates" => templates = it.next().context("--templates needs a path")?.into(),
            other => bail!("unknown argument {other}"),
        }
    }
    let store = agentenv_node::template::TemplateStore::new(
        agentenv_node::template::TemplateStoreConfig::new(&templates),
    );
    store
        .ensure("base", agentenv_node::template::log_progress())
        .await?;
    let dir = tempfile::tempdir()?;
    let shared = dir.path().join("store");
    let a = start_node(0, &dir.path().join("a"), &templates.join("base"), &shared).await?;
    let b = start_node(1, &dir.path().join("b"), &templates.join("base"), &shared).await?;
    let (aa, ba) = (a.local_addr(), b.local_addr());
    let (stop_a, rx_a) = tokio::sync::oneshot::channel::<()>();
    let (stop_b, rx_b) = tokio::sync::oneshot::channel::<()>();
    let ta = tokio::spawn(a.run(async move {
        let _ = rx_a.await;
    }));
    let tb = tokio::spawn(b.run(async move {
        let _ = rx_b.await;
    }));
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!(
        "template_bench: {rounds} rounds, load average before: {}",
        load.trim()
    );
    create(ba, "base").await?; // warm-up
    let (mut cold, mut cached, mut first, mut seen, mut base) =
        (vec![], vec![], vec![], vec![], vec![]);
    let nonce: u64 = rand::random();
    for r in 0..rounds {
        let name = format!("bench-{nonce:x}-{r}");
        let cmd = format!("echo round-{nonce}-{r} > /etc/bench-round && mkdir -p /opt/bench");
        cold.push(build(aa, &name, &cmd).await?);
        cached.push(build(aa, &name, &cmd).await?);
        first.push(create(ba, &name).await?);
        seen.push(create(ba, &name).await?);
        base.push(create(ba, "base").await?);
    }
    let reference = pct(&mut base, 0.5);
    println!(
        "{:<52} p50 {:8.1} ms   p90 {:8.1} ms",
        "create from base (reference)",
        reference.as_secs_f64() * 1e3,
        pct(&mut base, 0.9).as_secs_f64() * 1e3
    );
    row("build: one RUN from base, cold", &mut cold, reference);
    row("build: the same, every step cached", &mut cached, reference);
    row(
        "first create on a node that has not seen it",
        &mut first,
        reference,
    );
    row("create on a node that has it", &mut seen, reference);
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!("load average after: {}", load.trim());
    let _ = stop_a.send(());
    let _ = stop_b.send(());
    let _ = ta.await;
    let _ = tb.await;
    Ok(())
}
