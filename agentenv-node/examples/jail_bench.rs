//! Latency and footprint of the jail backend, against plain processes measured in the
//! same run.
//!
//! ```text
//! cargo run --release -p agentenv-node --example jail_bench [-- --agent PATH]
//!     [--agent-args "ARGS"] [--count N] [--templates DIR] [--pool N]
//! ```
//!
//! Prints, for `N` sandboxes (50 by default): create → agent ready and destroy latency
//! (p50/p99, 1 and 8 at a time; destroy as the node deletes: what the caller waits for,
//! and the background cleanup's own duration), pause and resume latency, and memory per
//! idle sandbox
//! (node RSS + cgroup usage). The reference for create is the same agent started as a
//! plain host process until it answers `/health`; for destroy, SIGKILL and reap of that
//! process; for pause/resume, SIGSTOP/SIGCONT of it. `--pool` sets the number of network
//! namespaces kept ready (the backend's default unless given; 0 turns the pool off); the
//! output says how many creates took a pooled one. The machine's load average is printed
//! before and after: other work on the machine shows in every number. Needs root.

use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use agentenv_node::backend::agent::wait_ready;
use agentenv_node::backend::jail::{JailBackend, JailConfig};
use agentenv_node::backend::{SandboxBackend, SandboxSpec};
use agentenv_node::host::netpool::NetPoolStats;
use agentenv_node::template::{BASE_TEMPLATE, Progress};
use anyhow::{Context, bail};
use futures::StreamExt;

const READY_TIMEOUT: Duration = Duration::from_secs(30);
const POLL: Duration = Duration::from_millis(1);

struct Args {
    agent: Option<PathBuf>,
    agent_args: Option<Vec<String>>,
    count: usize,
    templates: PathBuf,
    pool: Option<usize>,
}

fn parse_args() -> anyhow::Result<Args> {
    let mut args = Args {
        agent: std::env::var_os("AGENTENV_GUEST_BIN").map(PathBuf::from),
        agent_args: None,
        count: 50,
        templates: PathBuf::from("/var/cache/agentenv-test/templates"),
        pool: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--agent" => args.agent = Some(it.next().context("--agent needs a path")?.into()),
            "--agent-args" => {
                let v = it.next().context("--agent-args needs a value")?;
                args.agent_args = Some(v.split_whitespace().map(str::to_string).collect());
            }
            "--count" => args.count = it.next().context("--count needs a number")?.parse()?,
            "--templates" => args.templates = it.next().context("--templates needs a path")?.into(),
            "--pool" => args.pool = Some(it.next().context("--pool needs a number")?.parse()?),
            other => bail!(
                "unknown argument {other}; use --agent PATH, --agent-args \"ARGS\", --count N, --templates DIR, --pool N"
            ),
        }
    }
    if args.count < 8 {
        bail!("--count must be at least 8");
    }
    Ok(args)
}

/// The agent to run: the real one (static build, else release, else debug), else the
/// tests' fixture.
fn find_agent(explicit: Option<PathBuf>) -> (PathBuf, bool) {
    if let Some(p) = explicit {
        let real = !p.to_string_lossy().ends_with(".py");
        return (p, real);
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("target"));
    let arch = std::env::consts::ARCH;
    for p in [
        target.join(format!("{arch}-unknown-linux-gnu/release/agentenv-guest")),
        target.join(format!("{arch}-unknown-linux-musl/release/agentenv-guest")),
        target.join("release/agentenv-guest"),
        target.join("debug/agentenv-guest"),
    ] {
        if p.is_file() {
            return (p, true);
        }
    }
    (
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/test_agent.py"),
        false,
    )
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let idx = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[idx.min(sorted.len() - 1)]
}

struct Stats {
    p50: Duration,
    p99: Duration,
}

fn stats(mut v: Vec<Duration>) -> Stats {
    v.sort();
    Stats {
        p50: percentile(&v, 0.50),
        p99: percentile(&v, 0.99),
    }
}

fn ms(d: Duration) -> String {
    format!("{:7.2} ms", d.as_secs_f64() * 1e3)
}

fn verdict(value: Duration, target: Duration) -> &'static str {
    if value < target { "meets" } else { "MISSES" }
}

fn line(name: &str, s: &Stats, reference: &Stats, target: Option<Duration>) {
    let ratio = s.p50.as_secs_f64() / reference.p50.as_secs_f64().max(1e-9);
    let target = target
        .map(|t| format!("  target p50 < {} ms: {}", t.as_millis(), verdict(s.p50, t)))
        .unwrap_or_default();
    println!(
        "{name:<28} p50 {}  p99 {}   reference p50 {}  p99 {}   ratio {ratio:5.2}x{target}",
        ms(s.p50),
        ms(s.p99),
        ms(reference.p50),
        ms(reference.p99)
    );
}

/// A plain host process running the agent on a loopback port.
struct PlainAgent {
    child: std::process::Child,
    addr: SocketAddr,
}

fn free_port() -> anyhow::Result<u16> {
    Ok(TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?
        .local_addr()?
        .port())
}

async fn start_plain(agent: &Path, real: bool) -> anyhow::Result<(PlainAgent, Duration)> {
    let port = free_port()?;
    let mut cmd = std::process::Command::new(agent);
    if real {
        cmd.args(["--addr", "127.0.0.1", "--port", &port.to_string()]);
    } else {
        cmd.arg("--init").env("TEST_AGENT_PORT", port.to_string());
    }
    cmd.stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    let start = Instant::now();
    let child = cmd
        .spawn()
        .context("starting the agent as a plain process")?;
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    wait_ready(addr, READY_TIMEOUT, POLL).await?;
    Ok((PlainAgent { child, addr }, start.elapsed()))
}

fn proc_state(pid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit(')').next()?.trim_start().chars().next()
}

async fn wait_state(pid: u32, want: impl Fn(char) -> bool) {
    while !proc_state(pid).is_some_and(&want) {
        tokio::task::yield_now().await;
    }
}

fn rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
        })
        .map(|kb| kb * 1024)
        .unwrap_or(0)
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|| "unknown".into())
}

/// How many creates took a pooled namespace and a pooled writable layer since `before`.
fn pool_line(name: &str, b: &JailBackend, before: (NetPoolStats, u64, u64)) -> String {
    let now = b.net_pool_stats();
    let (layers_taken, layers_empty) = layer_counts(b);
    format!(
        "{name}: {} of {} from the namespace pool, {} of {} from the layer pool",
        now.taken - before.0.taken,
        (now.taken - before.0.taken) + (now.built_inline - before.0.built_inline),
        layers_taken - before.1,
        (layers_taken - before.1) + (layers_empty - before.2),
    )
}

/// Takes served by the layer pool and takes that found it empty.
fn layer_counts(b: &JailBackend) -> (u64, u64) {
    b.layer_pool_stats()
        .map(|s| (s.taken, s.empty))
        .unwrap_or((0, 0))
}

/// What [`pool_line`] counts from.
fn pool_mark(b: &JailBackend) -> (NetPoolStats, u64, u64) {
    let (t, e) = layer_counts(b);
    (b.net_pool_stats(), t, e)
}

fn spec(id: String) -> SandboxSpec {
    let mut s = SandboxSpec::new(id, BASE_TEMPLATE);
    s.cpu_count = 1;
    s.memory_mb = 256;
    s
}

async fn create_ready(b: &JailBackend, id: String) -> anyhow::Result<Duration> {
    let start = Instant::now();
    let info = b.create(spec(id.clone())).await?;
    if let Err(e) = wait_ready(info.address.agent(), READY_TIMEOUT, POLL).await {
        let log = std::fs::read_to_string(b.sandbox_dir(&id).join("agent.log")).unwrap_or_default();
        b.destroy(&id).await?;
        bail!("{e}\nagent log:\n{log}");
    }
    Ok(start.elapsed())
}

/// Creates `n` sandboxes `parallel` at a time; returns create→ready latencies and ids.
async fn create_many(
    b: &Arc<JailBackend>,
    prefix: &str,
    n: usize,
    parallel: usize,
) -> anyhow::Result<(Vec<Duration>, Vec<String>)> {
    let run = std::process::id();
    let ids: Vec<String> = (0..n).map(|i| format!("bench{run}-{prefix}-{i}")).collect();
    let results: Vec<anyhow::Result<Duration>> = futures::stream::iter(ids.clone())
        .map(|id| {
            let b = b.clone();
            async move { create_ready(&b, id).await }
        })
        .buffer_unordered(parallel)
        .collect()
        .await;
    let lat = results.into_iter().collect::<anyhow::Result<Vec<_>>>()?;
    Ok((lat, ids))
}

/// Deletes `ids` `parallel` at a time as the node does (processes killed, the rest left
/// to the cleanup queue); returns how long each delete kept its caller waiting and, once
/// the queue is empty, how long each background cleanup took.
async fn destroy_many(
    b: &Arc<JailBackend>,
    ids: Vec<String>,
    parallel: usize,
) -> anyhow::Result<(Vec<Duration>, Vec<Duration>)> {
    let n = ids.len();
    let results: Vec<anyhow::Result<Duration>> = futures::stream::iter(ids)
        .map(|id| {
            let b = b.clone();
            async move {
                let start = Instant::now();
                b.kill(&id).await?;
                Ok(start.elapsed())
            }
        })
        .buffer_unordered(parallel)
        .collect()
        .await;
    let answers = results.into_iter().collect::<anyhow::Result<Vec<_>>>()?;
    if !b.drain_cleanups(Duration::from_secs(60)).await {
        bail!("the cleanup queue did not drain within 60 s");
    }
    let done = b.cleanups();
    if done.failures > 0 {
        bail!("{} cleanup attempts failed", done.failures);
    }
    let cleanups = done.recent[done.recent.len().saturating_sub(n)..].to_vec();
    Ok((answers, cleanups))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = parse_args()?;
    if std::env::var_os("RUST_LOG").is_some() {
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_writer(std::io::stderr)
            .init();
    }
    if !nix::unistd::Uid::effective().is_root() {
        bail!("jail_bench needs root (namespaces, cgroups, veth, iptables)");
    }
    let (agent, real) = find_agent(args.agent.clone());
    let data = tempfile::tempdir()?;
    let mut cfg = JailConfig::new(data.path(), &agent);
    cfg.templates.root = args.templates.clone();
    cfg.cgroup_parent = "agentenv-bench".into();
    // An interface prefix of its own, whose host chains it removes at the end.
    cfg.iface_prefix = BENCH_PREFIX.into();
    if let Some(a) = &args.agent_args {
        cfg.agent_args = a.clone();
    }
    if let Some(n) = args.pool {
        cfg.net_pool_size = n;
    }
    let pool_size = cfg.net_pool_size;
    let load_before = load_average();
    let b_args = cfg.agent_args.clone();
    let runtime_dir = cfg.runtime_dir.clone();
    let b = Arc::new(JailBackend::new(cfg).await?);
    b.reconcile(&[]).await?;
    let progress: Progress = Arc::new(|l| eprintln!("[template base] {l}"));
    b.templates().ensure(BASE_TEMPLATE, progress).await?;
    let n = args.count;
    println!(
        "jail_bench: {n} sandboxes, namespace pool {pool_size}, layer pool {}, agent {} {} ({}), cgroup v{}, {} CPUs",
        b.layer_pool_stats().map(|s| s.target).unwrap_or(0),
        agent.display(),
        b_args.join(" "),
        if real {
            "agentenv-guest"
        } else {
            "test fixture"
        },
        b.cgroup_version(),
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
    );

    // References: the same agent as a plain host process.
    let mut plain_start = Vec::new();
    let mut plain_stop = Vec::new();
    let mut plain_pause = Vec::new();
    let mut plain_resume = Vec::new();
    for _ in 0..n.min(20) {
        let (mut p, took) = start_plain(&agent, real).await?;
        plain_start.push(took);
        let pid = p.child.id();
        let t = Instant::now();
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid as i32),
            nix::sys::signal::Signal::SIGSTOP,
        )?;
        wait_state(pid, |c| c == 'T').await;
        plain_pause.push(t.elapsed());
        let t = Instant::now();
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid as i32),
            nix::sys::signal::Signal::SIGCONT,
        )?;
        wait_state(pid, |c| c != 'T').await;
        plain_resume.push(t.elapsed());
        wait_ready(p.addr, READY_TIMEOUT, POLL).await?;
        let t = Instant::now();
        p.child.kill()?;
        p.child.wait()?;
        plain_stop.push(t.elapsed());
    }
    let (plain_start, plain_stop) = (stats(plain_start), stats(plain_stop));
    let (plain_pause, plain_resume) = (stats(plain_pause), stats(plain_resume));

    // Warm-up: the first sandbox pulls the template and the agent into the page cache.
    let (_, warm) = create_many(&b, "warm", 1, 1).await?;
    destroy_many(&b, warm, 1).await?;

    let rss_without = rss_bytes();
    let stats1 = pool_mark(&b);
    let (lat1, ids1) = create_many(&b, "seq", n, 1).await?;
    let pool1 = pool_line("1 at a time", &b, stats1);
    // Idle footprint, measured with all N sandboxes up.
    let rss_with = rss_bytes();
    let mut cg_total = 0u64;
    for id in &ids1 {
        cg_total += b.usage(id).await?.memory_bytes;
    }
    // Pause / resume each sandbox once.
    let mut pause = Vec::new();
    let mut resume = Vec::new();
    for id in &ids1 {
        let t = Instant::now();
        b.pause(id).await?;
        pause.push(t.elapsed());
        let t = Instant::now();
        b.resume(id).await?;
        resume.push(t.elapsed());
    }
    let del1 = destroy_many(&b, ids1, 1).await?;
    let stats8 = pool_mark(&b);
    let (lat8, ids8) = create_many(&b, "par", n, 8).await?;
    let pool8 = pool_line("8 at a time", &b, stats8);
    let del8 = destroy_many(&b, ids8, 8).await?;

    // The pools against none, 8 at a time, in alternating batches of 16 so that other
    // work on the machine weighs on both alike.
    let mut versus = None;
    if pool_size > 0 {
        let data0 = tempfile::tempdir()?;
        let mut cfg0 = JailConfig::new(data0.path(), &agent);
        cfg0.templates.root = args.templates.clone();
        cfg0.cgroup_parent = "agentenv-bench".into();
        cfg0.iface_prefix = BENCH_PREFIX.into();
        cfg0.agent_args = b_args.clone();
        cfg0.net_pool_size = 0;
        cfg0.layer_pool_size = 0;
        let b0 = Arc::new(JailBackend::new(cfg0).await?);
        let before = pool_mark(&b);
        let (mut with, mut without) = (Vec::new(), Vec::new());
        let mut round = 0;
        while with.len() < n || without.len() < n {
            for (k, backend) in [&b, &b0].into_iter().enumerate() {
                let got = if k == 0 { &mut with } else { &mut without };
                let take = 16.min(n - got.len());
                if take == 0 {
                    continue;
                }
                let (lat, ids) = create_many(backend, &format!("vs{k}r{round}"), take, 8).await?;
                destroy_many(backend, ids, 8).await?;
                got.extend(lat);
            }
            round += 1;
        }
        versus = Some((
            stats(with),
            stats(without),
            pool_line("batches", &b, before),
        ));
    }

    let create_target = Some(Duration::from_millis(10));
    let create8_target = Some(Duration::from_millis(50));
    let (pause_target, resume_target) = (
        Some(Duration::from_millis(1)),
        Some(Duration::from_millis(10)),
    );
    line(
        "create→ready, 1 at a time",
        &stats(lat1),
        &plain_start,
        create_target,
    );
    line(
        "create→ready, 8 at a time",
        &stats(lat8),
        &plain_start,
        create8_target,
    );
    if let Some((with, without, _)) = &versus {
        line("8 at a time, batches: pool", with, without, create8_target);
        println!(
            "{:<28} p50 {}  p99 {}   (the reference of the line above)",
            "8 at a time, batches: none",
            ms(without.p50),
            ms(without.p99)
        );
    }
    let destroy_target = Some(Duration::from_millis(5));
    line(
        "destroy, 1 at a time",
        &stats(del1.0),
        &plain_stop,
        destroy_target,
    );
    line(
        "destroy, 8 at a time",
        &stats(del8.0),
        &plain_stop,
        destroy_target,
    );
    line(
        "  its cleanup, 1 at a time",
        &stats(del1.1),
        &plain_stop,
        None,
    );
    line(
        "  its cleanup, 8 at a time",
        &stats(del8.1),
        &plain_stop,
        None,
    );
    line("pause (freeze)", &stats(pause), &plain_pause, pause_target);
    line(
        "resume (thaw)",
        &stats(resume),
        &plain_resume,
        resume_target,
    );
    let node_per = rss_with.saturating_sub(rss_without) / n as u64;
    let cg_per = cg_total / n as u64;
    let total = node_per + cg_per;
    println!(
        "idle memory per sandbox        node RSS {:6.1} KiB + cgroup {:6.1} KiB = {:5.2} MiB   target < 2 MiB: {}",
        node_per as f64 / 1024.0,
        cg_per as f64 / 1024.0,
        total as f64 / (1024.0 * 1024.0),
        if total < 2 << 20 { "meets" } else { "MISSES" }
    );
    println!(
        "references: plain host process of the same agent (start→ready, SIGKILL+reap, SIGSTOP, SIGCONT); for the batches, a backend without pools; destroy is what the caller waits for (every process killed, sandbox gone), its cleanup runs in the background queue"
    );
    let pool_batches = versus
        .as_ref()
        .map(|(_, _, l)| format!("; {l}"))
        .unwrap_or_default();
    println!("creates {pool1}; {pool8}{pool_batches}");
    println!(
        "load average (1, 5, 15 min): {load_before} before, {} after, on {} CPUs",
        load_average(),
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
    );
    b.shutdown().await;
    if let Err(e) = agentenv_node::host::net::uninstall_host_rules(
        BENCH_PREFIX,
        &runtime_dir,
        Duration::from_secs(5),
    )
    .await
    {
        eprintln!("host firewall rules of {BENCH_PREFIX} stay: {e}");
    }
    Ok(())
}

/// The bench's host interface prefix (not the node's default `ae`).
const BENCH_PREFIX: &str = "jb";
