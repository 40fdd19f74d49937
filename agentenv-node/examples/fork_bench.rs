//! Forks of a sandbox with 100 MB written, against a create from `base` measured in the
//! same run.
//!
//! ```text
//! cargo run --release -p agentenv-node --example fork_bench [-- --rounds N] [--mb M]
//!     [--templates DIR]
//! ```
//!
//! A node in this process (jail backend), twice: with its data directory on the file
//! system of the temporary directory (ext4 here: layer copies read and write the data)
//! and on an XFS file system with reflinks that the bench makes on a loop device (a copy
//! shares the data). On each, a source sandbox writes M MiB (default 100) of random data;
//! each round forks it once, then into 8, and times from the fork request until every
//! fork has answered a command (`true`) through the node's data plane, and the capture
//! (the node's `fork`/`capture` stage: the source frozen while its layer is copied, the
//! copy marked clean). The reference
//! is a create from `base` until its first command answers, on the same node. Prints
//! p50/p99 and the ratios to the reference. Needs root, `mkfs.xfs` (xfsprogs), the
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

const API_KEY: &str = "fork-bench-key-0123456789abcdef0123456789";
const SEED: &str = "fork-bench-seed";

async fn call(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: &str,
) -> anyhow::Result<(u16, bytes::Bytes)> {
    let stream = tokio::net::TcpStream::connect(addr).await?;
    stream.set_nodelay(true)?;
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
    Ok((status, resp.into_body().collect().await?.to_bytes()))
}

async fn json(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: &str,
) -> anyhow::Result<serde_json::Value> {
    let (st, b) = call(addr, method, path, body).await?;
    if !(200..300).contains(&st) {
        bail!("{method} {path}: {st} {}", String::from_utf8_lossy(&b));
    }
    Ok(serde_json::from_slice(&b)?)
}

/// Runs `script` in sandbox `id` through the node's data plane; fails unless it exits 0.
async fn sh(addr: SocketAddr, id: &str, script: &str) -> anyhow::Result<()> {
    let token = agentenv_node::access::TokenIssuer::new(SEED).envd_token(id);
    let out = agentenv_guest::client::GuestClient::new(&format!("http://{addr}"))?
        .with_header("e2b-sandbox-id", id)?
        .with_header("e2b-sandbox-port", "49983")?
        .with_access_token(&token)
        .run("/bin/sh", &["-c", script])
        .await?;
    match out.end.map(|e| e.exit_code) {
        Some(0) => Ok(()),
        other => bail!("{script}: exit {other:?}"),
    }
}

/// The fork capture stage's total seconds and count so far, from the node's metrics.
async fn capture_seconds(addr: SocketAddr) -> anyhow::Result<(f64, f64)> {
    let (_, body) = call(addr, "GET", "/metrics", "").await?;
    let text = String::from_utf8_lossy(&body);
    let value = |suffix: &str| {
        text.lines()
            .filter(|l| {
                l.starts_with(&format!(
                    "agentenv_sandbox_stage_duration_seconds_{suffix}{{"
                )) && l.contains("operation=\"fork\"")
                    && l.contains("stage=\"capture\"")
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>()
    };
    Ok((value("sum"), value("count")))
}

async fn start_node(home: &Path, templates: &Path, slot: u8) -> anyhow::Result<Daemon> {
    let guest = agentenv_testkit::bins::static_guest_binary().map_err(anyhow::Error::msg)?;
    let env: std::collections::HashMap<&str, String> = [
        ("API_ADDR", "127.0.0.1:0".to_string()),
        ("AENV_NODE_ID", format!("fork-bench-{slot}")),
        ("AENV_API_KEY", API_KEY.to_string()),
        ("AENV_SANDBOX_ACCESS_TOKEN_HASH_SEED", SEED.to_string()),
        ("AENV_HOME_PATH", home.display().to_string()),
        ("AENV_BACKEND", "jail".to_string()),
        ("AENV_GUEST_BINARY_PATH", guest.display().to_string()),
        ("AENV_TEMPLATE_PATH", templates.display().to_string()),
        ("AENV_RUNTIME_PATH", "/run/agentenv-bench".to_string()),
        ("AENV_JAIL_ADDRESS_POOL", format!("10.16.{}.0/24", 8 + slot)),
        (
            "AENV_JAIL_IFACE_PREFIX",
            format!("fb{}", (b'a' + slot) as char),
        ),
        (
            "AENV_JAIL_CGROUP_PARENT",
            format!("agentenv-forkbench-{slot}"),
        ),
    ]
    .into_iter()
    .collect();
    let mut cfg = NodeConfig::load(None, &|k| env.get(k).cloned()).context("node config")?;
    cfg.default_cpu_count = 1;
    cfg.default_memory_mb = 512;
    Ok(Daemon::start(cfg).await?)
}

/// A create from `base` until its first command answers.
async fn create_and_run(addr: SocketAddr) -> anyhow::Result<Duration> {
    let started = Instant::now();
    let v = json(
        addr,
        "POST",
        "/v2/sandboxes",
        r#"{"templateID":"base","timeout":120}"#,
    )
    .await?;
    let id = v["sandboxID"].as_str().context("sandboxID")?.to_string();
    sh(addr, &id, "true").await?;
    let took = started.elapsed();
    call(addr, "DELETE", &format!("/sandboxes/{id}"), "").await?;
    Ok(took)
}

/// Forks `source` into `count` and waits until every fork answers a command; returns
/// that time and how long the source was frozen.
async fn fork(
    addr: SocketAddr,
    source: &str,
    count: usize,
) -> anyhow::Result<(Duration, Duration)> {
    let (sum0, _) = capture_seconds(addr).await?;
    let started = Instant::now();
    let v = json(
        addr,
        "POST",
        &format!("/sandboxes/{source}/fork"),
        &format!(r#"{{"count":{count},"timeout":120}}"#),
    )
    .await?;
    let ids: Vec<String> = v
        .as_array()
        .context("a list of forks")?
        .iter()
        .map(|e| {
            e["sandbox"]["sandboxID"]
                .as_str()
                .map(str::to_string)
                .with_context(|| format!("a fork failed: {e}"))
        })
        .collect::<anyhow::Result<_>>()?;
    futures::future::try_join_all(ids.iter().map(|id| sh(addr, id, "true"))).await?;
    let took = started.elapsed();
    let (sum1, _) = capture_seconds(addr).await?;
    for id in &ids {
        call(addr, "DELETE", &format!("/sandboxes/{id}"), "").await?;
    }
    Ok((took, Duration::from_secs_f64((sum1 - sum0).max(0.0))))
}

fn pct(v: &mut [Duration], p: f64) -> Duration {
    v.sort();
    v[(((v.len() - 1) as f64) * p).round() as usize]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn row(name: &str, v: &mut [Duration], reference: Duration) {
    let (p50, p99) = (pct(v, 0.5), pct(v, 0.99));
    println!(
        "{name:<46} p50 {:8.1} ms   p99 {:8.1} ms   {:5.2}x the reference",
        ms(p50),
        ms(p99),
        p50.as_secs_f64() / reference.as_secs_f64().max(1e-9)
    );
}

/// An XFS file system with reflinks on a loop device, mounted at `dir/mnt`.
fn mount_xfs(dir: &Path) -> anyhow::Result<PathBuf> {
    std::fs::create_dir_all(dir)?;
    let backing = dir.join("xfs.img");
    std::fs::File::create(&backing)?.set_len(64 << 30)?;
    let st = std::process::Command::new("mkfs.xfs")
        .args(["-q", "-m", "reflink=1"])
        .arg(&backing)
        .status()
        .context("mkfs.xfs (install xfsprogs)")?;
    if !st.success() {
        bail!("mkfs.xfs failed");
    }
    let mnt = dir.join("mnt");
    std::fs::create_dir_all(&mnt)?;
    let st = std::process::Command::new("mount")
        .args(["-o", "loop"])
        .arg(&backing)
        .arg(&mnt)
        .status()?;
    if !st.success() {
        bail!("mounting the XFS image failed");
    }
    Ok(mnt)
}

/// One node's rounds: the reference and the forks.
async fn bench_on(
    label: &str,
    home: &Path,
    templates: &Path,
    slot: u8,
    rounds: usize,
    mb: u64,
) -> anyhow::Result<()> {
    let node = start_node(home, templates, slot).await?;
    let addr = node.local_addr();
    let (stop, rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(node.run(async move {
        let _ = rx.await;
    }));
    let v = json(
        addr,
        "POST",
        "/v2/sandboxes",
        r#"{"templateID":"base","timeout":3600}"#,
    )
    .await?;
    let source = v["sandboxID"].as_str().context("sandboxID")?.to_string();
    sh(
        addr,
        &source,
        &format!("head -c {} /dev/urandom > /root/data && sync", mb << 20),
    )
    .await?;
    create_and_run(addr).await?; // warm-up
    fork(addr, &source, 1).await?;
    let (mut base, mut one, mut eight, mut frozen1, mut frozen8) =
        (vec![], vec![], vec![], vec![], vec![]);
    for _ in 0..rounds {
        base.push(create_and_run(addr).await?);
        let (t, f) = fork(addr, &source, 1).await?;
        one.push(t);
        frozen1.push(f);
        let (t, f) = fork(addr, &source, 8).await?;
        eight.push(t);
        frozen8.push(f);
    }
    let reference = pct(&mut base, 0.5);
    println!("\ndata directory on {label}:");
    println!(
        "{:<46} p50 {:8.1} ms   p99 {:8.1} ms",
        "reference: create from base → first command",
        ms(reference),
        ms(pct(&mut base, 0.99))
    );
    row("fork count 1 → the fork answers", &mut one, reference);
    row("fork count 8 → all 8 forks answer", &mut eight, reference);
    row(
        "  capture: source frozen, layer copied (1)",
        &mut frozen1,
        reference,
    );
    row(
        "  capture: source frozen, layer copied (8)",
        &mut frozen8,
        reference,
    );
    call(addr, "DELETE", &format!("/sandboxes/{source}"), "").await?;
    let _ = stop.send(());
    let _ = task.await;
    Ok(())
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let (mut rounds, mut mb) = (10usize, 100u64);
    let mut templates = PathBuf::from("/var/cache/agentenv-test/templates");
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--rounds" => rounds = it.next().context("--rounds needs a number")?.parse()?,
            "--mb" => mb = it.next().context("--mb needs a number")?.parse()?,
            "--templates" => templates = it.next().context("--templates needs a path")?.into(),
            other => bail!("unknown argument {other}"),
        }
    }
    agentenv_node::template::TemplateStore::new(agentenv_node::template::TemplateStoreConfig::new(
        &templates,
    ))
    .ensure("base", agentenv_node::template::log_progress())
    .await?;
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!(
        "fork_bench: {rounds} rounds, {mb} MiB written in the source, load average before: {}",
        load.trim()
    );
    let dir = tempfile::tempdir()?;
    let fs_type = std::process::Command::new("findmnt")
        .args(["-n", "-o", "FSTYPE", "-T"])
        .arg(dir.path())
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    bench_on(
        &format!("{fs_type} (the temporary directory's file system)"),
        &dir.path().join("home"),
        &templates,
        0,
        rounds,
        mb,
    )
    .await?;
    let xfs = mount_xfs(&dir.path().join("xfs"))?;
    let result = bench_on(
        "XFS with reflinks",
        &xfs.join("home"),
        &templates,
        1,
        rounds,
        mb,
    )
    .await;
    let _ = nix::mount::umount2(&xfs, nix::mount::MntFlags::MNT_DETACH);
    result?;
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!("\nload average after: {}", load.trim());
    Ok(())
}
