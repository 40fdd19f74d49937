//! Benchmark of the node through the gateway, on a real cluster on loopback (scheduler,
//! gateway, two `agentenv-node` processes with the jail backend):
//!
//! * create → first command completes (`POST /v2/sandboxes`, then `process.Process/Start`
//!   of `true` through the data plane), p50/p99 over 50, at concurrency 1 and 8;
//! * exec round trip of `true` on a warm sandbox;
//! * sandboxes per second sustained (create + first command + delete, concurrency 8).
//!
//! Each is compared with the same operation sent to the node directly (no gateway hop),
//! measured in the same run; the exec round trip also with a host `fork+exec` of `true`.
//!
//! Then the same with the official E2B Python SDK (`node_bench_sdk.py`, in the SDK's
//! virtual environment): warm `commands.run("true")` through the gateway and straight to
//! the node, beside Python's own `subprocess.run(["true"])` and the command the SDK
//! really sends (`/bin/bash -l -c true`) run on the host in the template's root, in the
//! same process; and SDK create -> first command at concurrency 1 and 8.
//!
//! `NODE_BENCH_INDEX` picks the test cluster index (default 8), so two runs on one
//! machine do not share addresses.
//!
//! Then the same creates (and the SDK's) on a second cluster whose nodes keep pools of started `base`
//! sandboxes (`AENV_POOL_TEMPLATES`), beside the creates without pools, with the
//! breakdown of a pooled create.
//!
//! First, where a create → first command spends its time: the `Server-Timing` entries
//! of the create's answer (the node's phases, the gateway's) beside the client's own
//! clock, p50, p99 and mean per phase over [`BREAKDOWN`] runs at concurrency 1. The
//! means of the parts add up to the mean of the whole; a row in parentheses is what no
//! phase holds.
//!
//! `cargo build --release -p agentenv-bin --bins && cargo run --release -p agentenv-tests --example node_bench`

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use agentenv_guest::client::GuestClient;
use agentenv_tests::{API_KEY, Cluster};

const CREATES: usize = 50;
const EXECS: usize = 500;
/// Warm execs per series with the Python SDK.
const SDK_EXECS: usize = 300;
/// Creates per concurrency with the Python SDK.
const SDK_CREATES: usize = 50;
/// Runs of the breakdown.
const BREAKDOWN: usize = 100;
/// Started sandboxes per node in the run with pools.
const POOL: u64 = 8;

fn pct(v: &mut [Duration], p: f64) -> Duration {
    v.sort();
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    v[i.min(v.len() - 1)]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

async fn post(addr: SocketAddr, path: &str, body: &str) -> (u16, serde_json::Value) {
    let body = body.to_string();
    let path = path.to_string();
    tokio::task::spawn_blocking(move || agentenv_tests::api(addr, "POST", &path, &body))
        .await
        .expect("request task")
}

async fn delete(addr: SocketAddr, id: &str) {
    let path = format!("/sandboxes/{id}");
    let st = tokio::task::spawn_blocking(move || agentenv_tests::api(addr, "DELETE", &path, "").0)
        .await
        .expect("request task");
    assert_eq!(st, 204, "delete {id}");
}

fn client(addr: SocketAddr, id: &str) -> GuestClient {
    GuestClient::new(&format!("http://{addr}"))
        .expect("client")
        .with_header("e2b-sandbox-id", id)
        .expect("header")
        .with_header("e2b-sandbox-port", "49983")
        .expect("header")
        .with_access_token(&agentenv_tests::envd_token(id))
}

/// Create, run `true`, return the time to the command's end; the sandbox is deleted after.
async fn create_and_run(addr: SocketAddr) -> Duration {
    let t0 = Instant::now();
    let (st, v) = post(
        addr,
        "/v2/sandboxes",
        r#"{"templateID":"base","timeout":120}"#,
    )
    .await;
    assert_eq!(st, 201, "create: {v}");
    let id = v["sandboxID"].as_str().expect("sandboxID").to_string();
    let out = client(addr, &id)
        .run("true", &[])
        .await
        .expect("first command");
    let took = t0.elapsed();
    assert_eq!(out.end.as_ref().map(|e| e.exit_code), Some(0));
    delete(addr, &id).await;
    took
}

/// `n` create-and-run at `concurrency`; returns the latencies and the wall time.
async fn creates(addr: SocketAddr, n: usize, concurrency: usize) -> (Vec<Duration>, Duration) {
    let sem = Arc::new(tokio::sync::Semaphore::new(concurrency));
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..n {
        let sem = sem.clone();
        tasks.push(tokio::spawn(async move {
            let _p = sem.acquire_owned().await.expect("semaphore");
            create_and_run(addr).await
        }));
    }
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.expect("task"));
    }
    (out, t0.elapsed())
}

async fn execs(addr: SocketAddr, id: &str) -> Vec<Duration> {
    execs_of(addr, id, "true", &[]).await
}

/// [`EXECS`] runs of `cmd args` on a warm sandbox (after 20 to warm up).
async fn execs_of(addr: SocketAddr, id: &str, cmd: &str, args: &[&str]) -> Vec<Duration> {
    let c = client(addr, id);
    for _ in 0..20 {
        c.run(cmd, args).await.expect("warm-up");
    }
    let mut v = Vec::with_capacity(EXECS);
    for _ in 0..EXECS {
        let t0 = Instant::now();
        let out = c.run(cmd, args).await.expect("exec");
        v.push(t0.elapsed());
        assert_eq!(out.end.as_ref().map(|e| e.exit_code), Some(0));
    }
    v
}

fn row(name: &str, mut ours: Vec<Duration>, mut reference: Vec<Duration>, ref_name: &str) {
    let (p50, p99) = (pct(&mut ours, 0.5), pct(&mut ours, 0.99));
    let (r50, r99) = (pct(&mut reference, 0.5), pct(&mut reference, 0.99));
    println!(
        "{name:<44} p50 {:>8.2} ms  p99 {:>8.2} ms | {ref_name:<22} p50 {:>8.2} ms  p99 {:>8.2} ms | ratio p50 {:.2}x",
        ms(p50),
        ms(p99),
        ms(r50),
        ms(r99),
        p50.as_secs_f64() / r50.as_secs_f64().max(1e-9)
    );
}

/// One create → first command through the gateway: the client's clock and the
/// create answer's `Server-Timing` entries (milliseconds).
struct Sample {
    create: f64,
    command: f64,
    end_to_end: f64,
    entries: Vec<(String, f64)>,
}

impl Sample {
    fn get(&self, name: &str) -> f64 {
        self.entries
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, d)| *d)
            .unwrap_or_else(|| panic!("no `{name}` in the Server-Timing of a create"))
    }

    /// The node's phases (the entries before its total, `node`).
    fn node_phases(&self) -> &[(String, f64)] {
        let at = self.entries.iter().position(|(n, _)| n == "node");
        &self.entries[..at.expect("a `node` entry")]
    }

    /// The gateway's phases (between `node` and `gateway`).
    fn gateway_phases(&self) -> &[(String, f64)] {
        let at = self.node_phases().len() + 1;
        &self.entries[at..self.entries.len() - 1]
    }
}

async fn breakdown_sample(gw: SocketAddr) -> Sample {
    let t0 = Instant::now();
    let (st, headers, body) = tokio::task::spawn_blocking(move || {
        agentenv_tests::http(
            gw,
            "POST",
            "/v2/sandboxes",
            &[("x-api-key", API_KEY), ("content-type", "application/json")],
            r#"{"templateID":"base","timeout":120}"#,
        )
    })
    .await
    .expect("request task");
    let create = t0.elapsed();
    assert_eq!(st, 201, "create: {body}");
    let id = serde_json::from_str::<serde_json::Value>(&body).expect("JSON")["sandboxID"]
        .as_str()
        .expect("sandboxID")
        .to_string();
    let t1 = Instant::now();
    let out = client(gw, &id)
        .run("true", &[])
        .await
        .expect("first command");
    let command = t1.elapsed();
    let end_to_end = t0.elapsed();
    assert_eq!(out.end.as_ref().map(|e| e.exit_code), Some(0));
    let value = headers
        .iter()
        .find(|(k, _)| k == "server-timing")
        .map(|(_, v)| v.as_str())
        .expect("Server-Timing on a create through the gateway");
    let entries = agentenv_node::timing::parse(value).expect("valid Server-Timing");
    delete(gw, &id).await;
    Sample {
        create: ms(create),
        command: ms(command),
        end_to_end: ms(end_to_end),
        entries,
    }
}

/// What the node's phases are called in the table.
fn node_phase_label(name: &str) -> String {
    let what = match name {
        "request" => "reading the create body",
        "parse" => "parsing it",
        "volumes" => "checking volume mounts",
        "resolve" => "resolving template / snapshot",
        "bind" => "binding volumes",
        "admit" => "checking limits, taking the id",
        "template" => "template ready (cached)",
        "dir" => "sandbox directory",
        "ids" => "id range reserved",
        "netns" => "network namespace + address",
        "egress" => "egress rules + proxy",
        "cgroup" => "cgroup + device rules",
        "layer" => "writable layer (ext4 image) mounted",
        "prepare" => "guest files in the layer",
        "pipe" => "agent output pipe",
        "userns" => "user namespace + id mapping",
        "state" => "state.json written",
        "plan" => "spawn plan",
        "queue" => "waiting for a blocking thread",
        "spawn" => "clone, overlay root, exec of the agent",
        "watch" => "pidfd watch, commit",
        "agent_ready" => "agent ready (first GET /health answered)",
        "claim" => "a pooled sandbox claimed",
        "init" => "POST /init",
        "start_cmd" => "template start command",
        "finish" => "record, events, observer",
        "answer" => "answer JSON",
        _ => "",
    };
    format!("{name:<12} {what}")
}

/// Prints where a create → first command spends its time.
fn print_breakdown(samples: &[Sample]) {
    struct Row {
        label: String,
        depth: usize,
        values: Vec<f64>,
    }
    let mut rows: Vec<Row> = Vec::new();
    let mut row = |label: &str, depth: usize, f: &dyn Fn(&Sample) -> f64| {
        rows.push(Row {
            label: label.to_string(),
            depth,
            values: samples.iter().map(f).collect(),
        })
    };
    let first = &samples[0];
    row("end to end (client clock)", 0, &|s| s.end_to_end);
    row("create call: POST /v2/sandboxes (client clock)", 1, &|s| {
        s.create
    });
    row("(client <-> gateway: connect, HTTP, loopback)", 2, &|s| {
        s.create - s.get("gateway")
    });
    row("gateway (total in the gateway)", 2, &|s| s.get("gateway"));
    for (name, _) in first.gateway_phases() {
        let name = name.clone();
        let label = match name.as_str() {
            "route" => "route        path, API key, routing decision",
            "hint" => "hint         reading the create body for placement",
            "schedule" => "schedule     Schedule RPC to the scheduler",
            "upstream" => "upstream     the node call (request sent -> answer head)",
            "record" => "record       RecordAssignment RPC (the client waits for it)",
            "lookup" => "lookup       LookupNode RPC",
            "bind" => "bind         RecordAssignment before the create (idempotency key)",
            other => other,
        };
        let label = label.to_string();
        let upstream = name == "upstream";
        row(&label, 3, &move |s| s.get(&name));
        if upstream {
            row("(gateway <-> node: HTTP, loopback)", 4, &|s| {
                s.get("upstream") - s.get("node")
            });
            row("node (total in the node's create handler)", 4, &|s| {
                s.get("node")
            });
            for (phase, _) in first.node_phases() {
                let phase = phase.clone();
                row(&node_phase_label(&phase), 5, &move |s| s.get(&phase));
            }
            row("(node: in no phase)", 5, &|s| {
                s.get("node") - s.node_phases().iter().map(|(_, d)| d).sum::<f64>()
            });
        }
    }
    row("(gateway: in no phase)", 3, &|s| {
        s.get("gateway") - s.gateway_phases().iter().map(|(_, d)| d).sum::<f64>()
    });
    row(
        "first command: process.Process/Start `true` (client clock)",
        1,
        &|s| s.command,
    );
    row("(between the two calls)", 1, &|s| {
        s.end_to_end - s.create - s.command
    });

    let mean_total = samples.iter().map(|s| s.end_to_end).sum::<f64>() / samples.len() as f64;
    println!(
        "breakdown of create -> first command through the gateway, concurrency 1, {} runs (ms; the means add up, p50 and p99 do not):",
        samples.len()
    );
    println!(
        "  {:<70} {:>8} {:>8} {:>8} {:>6}",
        "phase", "p50", "p99", "mean", "share"
    );
    for r in rows {
        let mean = r.values.iter().sum::<f64>() / r.values.len() as f64;
        let mut v = r.values.clone();
        v.sort_by(|a, b| a.total_cmp(b));
        let p = |q: f64| v[(((v.len() - 1) as f64) * q).round() as usize];
        let label = format!("{}{}", "  ".repeat(r.depth), r.label);
        println!(
            "  {label:<70} {:>8.2} {:>8.2} {:>8.2} {:>5.1}%",
            p(0.5),
            p(0.99),
            mean,
            100.0 * mean / mean_total
        );
    }
    println!(
        "  (rows in parentheses are what no phase holds; with them each row's children add up to it, in the mean)"
    );
}

/// Milliseconds as durations, from the SDK script's JSON list `key`.
fn ms_list(v: &serde_json::Value, key: &str) -> Vec<Duration> {
    v[key]
        .as_array()
        .unwrap_or_else(|| panic!("no `{key}` in the SDK script's output"))
        .iter()
        .map(|x| Duration::from_secs_f64(x.as_f64().expect("milliseconds") / 1000.0))
        .collect()
}

/// Runs `node_bench_sdk.py` with `execs` warm execs per series and [`SDK_CREATES`]
/// creates per concurrency against the cluster of `gw` and `nodes`; its JSON, or why not.
fn sdk_script(
    gw: SocketAddr,
    nodes: &[SocketAddr],
    execs: usize,
) -> Result<serde_json::Value, String> {
    let py = agentenv_tests::e2b_python()?;
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/node_bench_sdk.py");
    let root = format!("{}/base/rootfs", agentenv_tests::TEMPLATE_CACHE);
    let node_urls = nodes
        .iter()
        .map(|a| format!("http://{a}"))
        .collect::<Vec<_>>()
        .join(",");
    let (execs, creates) = (execs.to_string(), SDK_CREATES.to_string());
    Ok(agentenv_tests::run_sdk_script(
        &py,
        script,
        &[execs.as_str(), creates.as_str(), root.as_str()],
        gw,
        &[("NODE_URLS", node_urls.as_str())],
    ))
}

/// The rows measured with the official Python SDK (see the module documentation); the
/// SDK's creates at concurrency 1 and 8, for the run with pools.
fn sdk_rows(gw: SocketAddr, nodes: &[SocketAddr]) -> Option<(Vec<Duration>, Vec<Duration>)> {
    let v = match sdk_script(gw, nodes, SDK_EXECS) {
        Ok(v) => v,
        Err(e) => {
            println!("Python SDK rows skipped: {e}");
            return None;
        }
    };
    println!(
        "official Python SDK: {SDK_EXECS} warm `commands.run(\"true\")` per row (the SDK sends `/bin/bash -l -c true`), {SDK_CREATES} creates per row"
    );
    let gw_exec = ms_list(&v, "exec_gateway");
    row(
        "SDK exec `true` (warm, through the gateway)",
        gw_exec.clone(),
        ms_list(&v, "exec_node"),
        "SDK, node direct",
    );
    row(
        "SDK exec `true` (warm, through the gateway)",
        gw_exec.clone(),
        ms_list(&v, "subprocess_true"),
        "subprocess.run(true)",
    );
    row(
        "SDK exec `true` (warm, through the gateway)",
        gw_exec.clone(),
        ms_list(&v, "subprocess_bash_l"),
        "host chroot + bash -l -c true",
    );
    row(
        "SDK exec `true` (warm, through the gateway)",
        gw_exec,
        ms_list(&v, "root_bash_l"),
        "bash -l -c true from bash in the root",
    );
    let c1 = ms_list(&v, "create_c1");
    row(
        "SDK create -> first command, concurrency 1",
        c1.clone(),
        c1,
        "(same)",
    );
    let c8 = ms_list(&v, "create_c8");
    row(
        "SDK create -> first command, concurrency 8",
        c8.clone(),
        c8,
        "(same)",
    );
    println!(
        "SDK sandboxes/s (create + first command + kill, concurrency 8): {:.1}/s",
        SDK_CREATES as f64 / (v["create_c8_wall"].as_f64().unwrap_or(f64::NAN) / 1000.0)
    );
    Some((ms_list(&v, "create_c1"), ms_list(&v, "create_c8")))
}

/// The SDK's creates on the cluster with pools, beside `cold` (the same without pools).
fn sdk_pooled_rows(gw: SocketAddr, nodes: &[SocketAddr], cold: (Vec<Duration>, Vec<Duration>)) {
    let Ok(v) = sdk_script(gw, nodes, 0) else {
        return;
    };
    row(
        "SDK pooled create -> first cmd, conc. 1",
        ms_list(&v, "create_c1"),
        cold.0,
        "SDK without pools",
    );
    row(
        "SDK pooled create -> first cmd, conc. 8",
        ms_list(&v, "create_c8"),
        cold.1,
        "SDK without pools",
    );
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".into())
}

fn main() {
    if let Some(r) = agentenv_tests::skip_reason() {
        eprintln!("node_bench cannot run here: {r}");
        std::process::exit(2);
    }
    let index = std::env::var("NODE_BENCH_INDEX")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(8);
    let cluster = Cluster::start(2, index);
    let gw = cluster.gateway;
    let node = cluster.nodes[0].addr;
    let node_addrs: Vec<SocketAddr> = cluster.nodes.iter().map(|n| n.addr).collect();
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let cold = rt.block_on(async move {
        // Wait until both nodes heartbeat, so the gateway can place on both.
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let n = tokio::task::spawn_blocking(move || agentenv_tests::api(gw, "GET", "/nodes", "").1)
                .await
                .expect("nodes");
            if n.as_array().map(|a| a.len()) == Some(2) {
                break;
            }
            assert!(Instant::now() < deadline, "nodes did not register: {n}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        // Warm-up (template cache, page cache, connection setup).
        creates(gw, 4, 2).await;

        println!("load average before the runs: {}", load_average());
        let mut samples = Vec::with_capacity(BREAKDOWN);
        for _ in 0..BREAKDOWN {
            samples.push(breakdown_sample(gw).await);
        }
        print_breakdown(&samples);

        println!("node_bench: {CREATES} creates per row, {EXECS} execs; reference = same call sent to a node directly");
        let (g1, _) = creates(gw, CREATES, 1).await;
        let (n1, _) = creates(node, CREATES, 1).await;
        row("create -> first command, concurrency 1", g1.clone(), n1, "one node direct");
        let (g8, g8_wall) = creates(gw, CREATES, 8).await;
        let (n8, n8_wall) = creates(node, CREATES, 8).await;
        row("create -> first command, concurrency 8", g8.clone(), n8, "one node direct");

        let (st, v) = post(gw, "/v2/sandboxes", r#"{"templateID":"base","timeout":600}"#).await;
        assert_eq!(st, 201, "{v}");
        let warm = v["sandboxID"].as_str().expect("id").to_string();
        let through_gw = execs(gw, &warm).await;
        // The owner of the warm sandbox, for the direct reference.
        let mut owner = node;
        for a in node_addrs.clone() {
            let path = format!("/sandboxes/{warm}");
            let st = tokio::task::spawn_blocking(move || agentenv_tests::api(a, "GET", &path, "").0)
                .await
                .expect("get");
            if st == 200 {
                owner = a;
            }
        }
        let direct = execs(owner, &warm).await;
        row("exec `true` round trip (warm sandbox)", through_gw.clone(), direct, "node direct");
        let mut host = Vec::new();
        for _ in 0..200 {
            let t0 = Instant::now();
            std::process::Command::new("true").status().expect("true");
            host.push(t0.elapsed());
        }
        row("exec `true` round trip (warm sandbox)", through_gw.clone(), host, "host fork+exec");
        // What the SDK's `commands.run("true")` sends: a login shell running `true`.
        let login = execs_of(gw, &warm, "/bin/bash", &["-l", "-c", "true"]).await;
        row("exec `/bin/bash -l -c true` (warm sandbox)", login, through_gw, "exec `true`");
        delete(gw, &warm).await;

        println!(
            "sandboxes/s sustained (create + first command + delete, concurrency 8): gateway over two nodes {:.1}/s, one node direct {:.1}/s",
            CREATES as f64 / g8_wall.as_secs_f64(),
            CREATES as f64 / n8_wall.as_secs_f64()
        );
        println!("load average before the SDK rows: {}", load_average());
        let sdk = tokio::task::spawn_blocking(move || sdk_rows(gw, &node_addrs))
            .await
            .expect("SDK rows");
        println!("load average after the runs: {}", load_average());
        ((g1, g8), sdk)
    });
    drop(cluster);
    pooled(cold.0, cold.1, index + 2);
    let _ = API_KEY;
}

/// The same creates on a cluster whose nodes keep pools of started `base` sandboxes,
/// beside `cold` (creates at concurrency 1 and 8 without pools, from the same run).
fn pooled(
    cold: (Vec<Duration>, Vec<Duration>),
    sdk_cold: Option<(Vec<Duration>, Vec<Duration>)>,
    index: u8,
) {
    let cluster = Cluster::start_with(2, index, &|_| {
        vec![
            ("AENV_POOL_TEMPLATES".to_string(), format!("base={POOL}")),
            ("AENV_POOL_MAX_PER_TEMPLATE".to_string(), format!("{POOL}")),
        ]
    });
    let gw = cluster.gateway;
    let node_addrs: Vec<SocketAddr> = cluster.nodes.iter().map(|n| n.addr).collect();
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async move {
        wait_pools(gw, POOL).await;
        println!();
        println!("with pools ({POOL} started `base` sandboxes per node, refilled in the background); load average {}", load_average());
        let mut samples = Vec::with_capacity(BREAKDOWN);
        for _ in 0..BREAKDOWN {
            samples.push(breakdown_sample(gw).await);
        }
        // A create that found its node's pool empty started a sandbox: its phases are the
        // other table's.
        samples.retain(|s| s.entries.iter().any(|(n, _)| n == "claim"));
        println!("{} of {BREAKDOWN} creates were served by a pool", samples.len());
        if !samples.is_empty() {
            print_breakdown(&samples);
        }
        wait_pools(gw, POOL).await;
        let (p1, _) = creates(gw, CREATES, 1).await;
        row("pooled create -> first command, conc. 1", p1, cold.0, "without pools");
        // Eight at a time take eight sandboxes at once: each round starts with full pools.
        let mut p8 = Vec::new();
        for _ in 0..CREATES / 8 {
            wait_pools(gw, POOL).await;
            p8.extend(creates(gw, 8, 8).await.0);
        }
        row("pooled create -> first command, conc. 8", p8, cold.1, "without pools");
        if let Some(sdk_cold) = sdk_cold {
            wait_pools(gw, POOL).await;
            tokio::task::spawn_blocking(move || sdk_pooled_rows(gw, &node_addrs, sdk_cold))
                .await
                .expect("SDK rows");
        }
        println!("targets: create -> first command p50 < 10 ms (< 25 ms at 8 at a time); exec round trip p50 < 2 ms");
        println!("load average after the runs: {}", load_average());
    });
    drop(cluster);
}

/// Waits until every node's pool holds `n` sandboxes.
async fn wait_pools(gw: SocketAddr, n: u64) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let v = tokio::task::spawn_blocking(move || agentenv_tests::api(gw, "GET", "/nodes", "").1)
            .await
            .expect("nodes");
        let full = v.as_array().is_some_and(|a| {
            a.len() == 2
                && a.iter()
                    .all(|x| x["sandboxPooledCount"].as_u64() >= Some(n))
        });
        if full {
            return;
        }
        assert!(Instant::now() < deadline, "pools did not fill: {v}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
