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
//! `cargo build --release -p agentenv-bin --bins && cargo run --release -p agentenv-tests --example node_bench`

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use agentenv_guest::client::GuestClient;
use agentenv_tests::{API_KEY, Cluster};

const CREATES: usize = 50;
const EXECS: usize = 500;

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
    let c = client(addr, id);
    for _ in 0..20 {
        c.run("true", &[]).await.expect("warm-up");
    }
    let mut v = Vec::with_capacity(EXECS);
    for _ in 0..EXECS {
        let t0 = Instant::now();
        let out = c.run("true", &[]).await.expect("exec");
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

fn main() {
    if let Some(r) = agentenv_tests::skip_reason() {
        eprintln!("node_bench cannot run here: {r}");
        std::process::exit(2);
    }
    let cluster = Cluster::start(2, 8);
    let gw = cluster.gateway;
    let node = cluster.nodes[0].addr;
    let node_addrs: Vec<SocketAddr> = cluster.nodes.iter().map(|n| n.addr).collect();
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async move {
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

        println!("node_bench: {CREATES} creates per row, {EXECS} execs; reference = same call sent to a node directly");
        let (g1, _) = creates(gw, CREATES, 1).await;
        let (n1, _) = creates(node, CREATES, 1).await;
        row("create -> first command, concurrency 1", g1, n1, "one node direct");
        let (g8, g8_wall) = creates(gw, CREATES, 8).await;
        let (n8, n8_wall) = creates(node, CREATES, 8).await;
        row("create -> first command, concurrency 8", g8, n8, "one node direct");

        let (st, v) = post(gw, "/v2/sandboxes", r#"{"templateID":"base","timeout":600}"#).await;
        assert_eq!(st, 201, "{v}");
        let warm = v["sandboxID"].as_str().expect("id").to_string();
        let through_gw = execs(gw, &warm).await;
        // The owner of the warm sandbox, for the direct reference.
        let mut owner = node;
        for a in node_addrs {
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
        row("exec `true` round trip (warm sandbox)", through_gw, host, "host fork+exec");
        delete(gw, &warm).await;

        println!(
            "sandboxes/s sustained (create + first command + delete, concurrency 8): gateway over two nodes {:.1}/s, one node direct {:.1}/s",
            CREATES as f64 / g8_wall.as_secs_f64(),
            CREATES as f64 / n8_wall.as_secs_f64()
        );
        println!("targets: create -> first command p50 < 100 ms; exec round trip p50 < 5 ms");
    });
    drop(cluster);
    let _ = API_KEY;
}
