//! Throughput and latency of the gateway against nginx, in one run.
//!
//! Starts a small upstream HTTP server, the gateway in front of it (routing
//! by `e2b-sandbox-id`, answered by an in-process scheduler), and nginx as a
//! plain keep-alive reverse proxy in front of the same upstream. Drives all
//! three with wrk (64 connections, then 1 connection for the added latency)
//! and prints requests/s, p50/p99 and the ratios.
//!
//! A fourth target is a reference: a bare hyper proxy (hyper's HTTP/1.1
//! server and client, one pooled upstream connection per client
//! connection, no routing, auth, header rewriting or metrics) on the same
//! kind of threads. It shows how much of the gateway's cost is the HTTP
//! engine and how much is the gateway's own work.
//!
//! The machine may be shared: the targets are measured in turn,
//! `BENCH_ROUNDS` times (default 3), and the summary gives the median of
//! each figure and the median of the per-round gateway/nginx ratios (each
//! ratio compares runs made seconds apart). The load average is printed.
//!
//! Then the same over TLS: the gateway's own TLS listener (rustls) against
//! nginx terminating TLS (OpenSSL), both with a certificate of a CA made for
//! the run, both relaying to the same plain upstream, at 64 connections
//! (keep-alive: one handshake per connection, then requests). `BENCH_TLS=0`
//! skips that pass.
//!
//! Last, syscalls per request at 64 connections for nginx, the gateway and
//! the bare proxy (and over TLS, nginx and the gateway): `perf stat` on the
//! syscall tracepoints (Debian `linux-perf`), else `strace -c`, attached to
//! the proxy's threads or worker processes for a window while wrk drives
//! it, divided by the requests the upstream served in that window; the
//! most frequent calls by name and the total. `BENCH_SYSCALLS=0` skips it,
//! `BENCH_SYSCALLS=strace` counts with strace (which slows the proxy down).
//!
//! `cargo run --release -p agentenv-proxy --example gateway_bench [-- SECONDS]`
//! needs the Debian packages `nginx` and `wrk` (and `linux-perf` or
//! `strace` for the syscall counts).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use agentenv_core::config::{NodeConfig, SchedulerConfig};
use agentenv_core::proto::scheduler_v1 as pb;
use agentenv_core::proto::scheduler_v1::scheduler_server::Scheduler as _;
use agentenv_proxy::{Gateway, GatewayOptions, InProcessScheduler};
use bytes::Bytes;
use http_body_util::Full;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

#[path = "bench_support/mod.rs"]
mod bench_support;
use bench_support::{
    Run, clock_ticks, load_average, median, median_run, stat_times, threads_cpu_seconds, which, wrk,
};
#[path = "bench_support/syscalls.rs"]
mod syscalls;
use syscalls::{Attach, threads_named};

const BODY: &[u8] =
    br#"{"sandboxID":"sbx-bench","state":"running","envdVersion":"0.2.0","ok":true}"#;
const API_KEY: &str = "bench_0123456789abcdef0123456789abcdef";

/// Requests the upstream has answered so far.
static SERVED: AtomicU64 = AtomicU64::new(0);
/// The upstream's path that answers with [`SERVED`].
const SERVED_PATH: &str = "/served-count";

fn main() {
    let secs: u64 = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(5);
    for tool in ["nginx", "wrk"] {
        if which(tool).is_none() {
            eprintln!(
                "bench: `{tool}` is not installed; install the Debian package `{tool}` (see scripts/apt-packages.txt)"
            );
            std::process::exit(2);
        }
    }
    // The upstream and the gateway run on runtimes of their own, so the
    // gateway gets its own threads just as nginx gets its own processes.
    let runtime = || {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("tokio runtime")
    };
    let upstream_rt = runtime();
    let rt = runtime();
    let upstream = upstream_rt.block_on(start_upstream());
    let tmp = tempfile::tempdir().expect("temp dir");
    let certs = Certs::write(tmp.path());
    let gateway = rt.block_on(start_gateway(upstream, None));
    let gateway_tls = rt.block_on(start_gateway(upstream, Some(&certs)));
    let bare = start_bare_proxy(upstream);
    let (mut nginx, nginx_addr, nginx_tls) = start_nginx(tmp.path(), upstream, &certs);
    rt.block_on(wait_listening(nginx_addr));
    rt.block_on(wait_listening(nginx_tls));

    // BENCH_PROFILE=gateway|nginx|direct drives only that target at 64
    // connections (to attach perf to it).
    if let Ok(which) = std::env::var("BENCH_PROFILE") {
        let (addr, pid) = match which.as_str() {
            "nginx" => (nginx_addr, nginx.id()),
            "bare" => (bare, std::process::id()),
            "direct" => (upstream, std::process::id()),
            _ => (gateway, std::process::id()),
        };
        println!(
            "profiling {which} at {addr} (pid {pid}); load {}",
            load_average()
        );
        wrk(&url(addr, false), 64, 1);
        let r = wrk(&url(addr, false), 64, secs);
        println!(
            "{which} {:.0} req/s p50 {:.1} µs p99 {:.1} µs",
            r.rps, r.p50_us, r.p99_us
        );
        stop(&mut nginx);
        return;
    }
    let targets = [
        ("direct", upstream),
        ("nginx", nginx_addr),
        ("gateway", gateway),
        ("bare", bare),
    ];
    println!(
        "upstream {upstream}, nginx {nginx_addr}, gateway {gateway}; {secs}s per run; load average {}\n",
        load_average()
    );
    let mut results = Vec::new();
    let rounds: usize = std::env::var("BENCH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3)
        .max(1);
    for conns in [64usize, 1] {
        // Warm up pools and caches.
        for (_, addr) in targets {
            wrk(&url(addr, false), conns, 1);
        }
        let mut runs: Vec<Vec<Run>> = vec![Vec::new(); targets.len()];
        for round in 1..=rounds {
            for (i, (name, addr)) in targets.into_iter().enumerate() {
                let nginx_pid = nginx.id();
                let cpu = move || match name {
                    "nginx" => nginx_cpu_seconds(nginx_pid),
                    "gateway" => threads_cpu_seconds("gateway-"),
                    "bare" => threads_cpu_seconds("bare-"),
                    _ => f64::NAN,
                };
                let before = cpu();
                let mut r = wrk(&url(addr, false), conns, secs);
                r.cpu_us = (cpu() - before) * 1e6 / (r.rps * secs as f64);
                println!(
                    "{conns:>3} conns  round {round}  {name:<8} {:>10.0} req/s   p50 {:>8.1} µs   p99 {:>8.1} µs   proxy CPU/request {:>6.1} µs   load {}",
                    r.rps,
                    r.p50_us,
                    r.p99_us,
                    r.cpu_us,
                    load_average()
                );
                runs[i].push(r);
            }
        }
        let ratios: Vec<f64> = runs[2]
            .iter()
            .zip(&runs[1])
            .map(|(g, n)| g.rps / n.rps)
            .collect();
        let row: Vec<Run> = runs.iter().map(|r| median_run(r)).collect();
        results.push((conns, row, median(ratios)));
        println!();
    }
    println!("medians of {rounds} round(s):");
    for (conns, row, paired) in &results {
        let (direct, nginx_r, gw, bare_r) = (row[0], row[1], row[2], row[3]);
        println!("{conns} connection(s):");
        for (name, r) in [
            ("direct", direct),
            ("nginx", nginx_r),
            ("gateway", gw),
            ("bare", bare_r),
        ] {
            println!(
                "  {name:<8} {:>10.0} req/s   p50 {:>8.1} µs   p99 {:>8.1} µs",
                r.rps, r.p50_us, r.p99_us
            );
        }
        println!(
            "  throughput gateway/nginx = {:.2} (median of per-round ratios {:.2})   gateway/direct = {:.2}   nginx/direct = {:.2}",
            gw.rps / nginx_r.rps,
            paired,
            gw.rps / direct.rps,
            nginx_r.rps / direct.rps
        );
        println!(
            "  added p50 over direct: gateway {:+.1} µs, nginx {:+.1} µs;  added p99: gateway {:+.1} µs, nginx {:+.1} µs",
            gw.p50_us - direct.p50_us,
            nginx_r.p50_us - direct.p50_us,
            gw.p99_us - direct.p99_us,
            nginx_r.p99_us - direct.p99_us
        );
        println!(
            "  proxy CPU per request: gateway {:.1} µs, nginx {:.1} µs (gateway/nginx = {:.2})",
            gw.cpu_us,
            nginx_r.cpu_us,
            gw.cpu_us / nginx_r.cpu_us
        );
        println!(
            "  reference: bare hyper proxy {:.0} req/s (bare/nginx = {:.2}), {:.1} µs CPU per request",
            bare_r.rps,
            bare_r.rps / nginx_r.rps,
            bare_r.cpu_us
        );
    }
    if std::env::var("BENCH_SYSCALLS").as_deref() != Ok("0") {
        syscall_pass(
            upstream,
            &[
                (
                    "nginx",
                    nginx_addr,
                    Attach::Processes(nginx_workers(nginx.id())),
                ),
                (
                    "gateway",
                    gateway,
                    Attach::Threads(threads_named("gateway-")),
                ),
                ("bare", bare, Attach::Threads(threads_named("bare-"))),
            ],
            false,
            secs,
        );
    }
    if std::env::var("BENCH_TLS").as_deref() != Ok("0") {
        tls_pass(nginx.id(), nginx_tls, gateway_tls, rounds, secs);
        if std::env::var("BENCH_SYSCALLS").as_deref() != Ok("0") {
            syscall_pass(
                upstream,
                &[
                    (
                        "nginx",
                        nginx_tls,
                        Attach::Processes(nginx_workers(nginx.id())),
                    ),
                    (
                        "gateway",
                        gateway_tls,
                        Attach::Threads(threads_named("gateway-")),
                    ),
                ],
                true,
                secs,
            );
        }
    }
    println!("load average at the end: {}", load_average());
    stop(&mut nginx);
}

/// The TLS pass: nginx terminating TLS against the gateway's TLS listener at
/// 64 connections, `rounds` rounds in turn; prints each round and the
/// medians with the throughput and CPU ratios.
fn tls_pass(nginx_pid: u32, nginx: SocketAddr, gateway: SocketAddr, rounds: usize, secs: u64) {
    let conns = 64;
    println!("\nover TLS ({conns} connections, one handshake per connection):");
    let targets = [("nginx", nginx), ("gateway", gateway)];
    for (_, addr) in targets {
        wrk(&url(addr, true), conns, 1);
    }
    let mut runs: Vec<Vec<Run>> = vec![Vec::new(); targets.len()];
    for round in 1..=rounds {
        for (i, (name, addr)) in targets.into_iter().enumerate() {
            let cpu = move || match name {
                "nginx" => nginx_cpu_seconds(nginx_pid),
                _ => threads_cpu_seconds("gateway-"),
            };
            let before = cpu();
            let mut r = wrk(&url(addr, true), conns, secs);
            r.cpu_us = (cpu() - before) * 1e6 / (r.rps * secs as f64);
            println!(
                "tls {conns:>3} conns  round {round}  {name:<8} {:>10.0} req/s   p50 {:>8.1} µs   p99 {:>8.1} µs   proxy CPU/request {:>6.1} µs   load {}",
                r.rps,
                r.p50_us,
                r.p99_us,
                r.cpu_us,
                load_average()
            );
            runs[i].push(r);
        }
    }
    let paired = median(
        runs[1]
            .iter()
            .zip(&runs[0])
            .map(|(g, n)| g.rps / n.rps)
            .collect(),
    );
    let (n, g) = (median_run(&runs[0]), median_run(&runs[1]));
    println!("medians of {rounds} round(s) over TLS:");
    for (name, r) in [("nginx", n), ("gateway", g)] {
        println!(
            "  {name:<8} {:>10.0} req/s   p50 {:>8.1} µs   p99 {:>8.1} µs",
            r.rps, r.p50_us, r.p99_us
        );
    }
    println!(
        "  throughput gateway/nginx over TLS = {:.2} (median of per-round ratios {:.2})",
        g.rps / n.rps,
        paired
    );
    println!(
        "  proxy CPU per request over TLS: gateway {:.1} µs, nginx {:.1} µs (gateway/nginx = {:.2})",
        g.cpu_us,
        n.cpu_us,
        g.cpu_us / n.cpu_us
    );
}

/// Syscalls per request of each proxy at 64 connections: wrk drives one
/// target at a time while perf (or strace) counts the calls of the proxy's
/// threads or worker processes for `secs` seconds.
fn syscall_pass(
    upstream: SocketAddr,
    targets: &[(&str, SocketAddr, Attach)],
    tls: bool,
    secs: u64,
) {
    let over = if tls { " over TLS" } else { "" };
    let served_url = &format!("http://{upstream}{SERVED_PATH}");
    println!("\nsyscalls per request{over}, 64 connections, {secs}s windows:");
    let mut totals = Vec::new();
    for (name, addr, attach) in targets {
        // A load that outlasts the count (the counting tool takes a moment
        // to attach), stopped once it is done.
        let mut load = Command::new("wrk")
            .args(["-t", "2", "-c", "64", "-d", &format!("{}s", secs + 60)])
            .args([
                "-H",
                "e2b-sandbox-id: sbx-bench",
                "-H",
                "e2b-sandbox-port: 49983",
            ])
            .arg(url(*addr, tls))
            .stdout(Stdio::null())
            .spawn()
            .expect("run wrk");
        std::thread::sleep(Duration::from_secs(1));
        let counted =
            syscalls::measure(attach, secs, served_url, || SERVED.load(Ordering::Relaxed));
        let _ = load.kill();
        let _ = load.wait();
        match counted {
            Some(c) => {
                println!(
                    "  {name:<8} {}   ({}, {:.0} req/s while counted)",
                    c.line(8),
                    c.tool,
                    c.rps
                );
                totals.push((*name, c.total));
            }
            None => println!(
                "  {name:<8} not counted: neither perf's syscall tracepoints nor strace work here"
            ),
        }
    }
    let of = |n: &str| totals.iter().find(|(t, _)| *t == n).map(|(_, v)| *v);
    if let (Some(g), Some(n)) = (of("gateway"), of("nginx")) {
        println!("  syscalls per request gateway/nginx{over} = {:.2}", g / n);
    }
}

/// The nginx worker processes (children of the master).
fn nginx_workers(master: u32) -> Vec<u32> {
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let pid: u32 = e.file_name().to_str()?.parse().ok()?;
            let (ppid, _) = stat_times(&e.path().join("stat"))?;
            (ppid == master).then_some(pid)
        })
        .collect()
}

/// A CA made for the run and a certificate for 127.0.0.1 it signed, as PEM
/// files in a directory (nginx reads files; the gateway too).
struct Certs {
    cert: std::path::PathBuf,
    key: std::path::PathBuf,
}

impl Certs {
    fn write(dir: &Path) -> Self {
        use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};
        let ca_key = KeyPair::generate().expect("CA key");
        let mut ca = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.distinguished_name
            .push(DnType::CommonName, "gateway bench CA");
        let issuer = Issuer::new(ca, ca_key);
        let key = KeyPair::generate().expect("key");
        let leaf = CertificateParams::new(vec!["127.0.0.1".to_string()])
            .expect("leaf params")
            .signed_by(&key, &issuer)
            .expect("sign the leaf");
        let certs = Self {
            cert: dir.join("bench-cert.pem"),
            key: dir.join("bench-key.pem"),
        };
        std::fs::write(&certs.cert, leaf.pem()).expect("write the certificate");
        std::fs::write(&certs.key, key.serialize_pem()).expect("write the key");
        certs
    }
}

/// The URL wrk drives at `addr`.
fn url(addr: SocketAddr, tls: bool) -> String {
    let scheme = if tls { "https" } else { "http" };
    format!("{scheme}://{addr}/hello")
}

/// CPU seconds used so far by the nginx master and its workers.
fn nginx_cpu_seconds(master: u32) -> f64 {
    let mut ticks = 0;
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        if let Some((ppid, t)) = stat_times(&entry.path().join("stat"))
            && (pid == master || ppid == master)
        {
            ticks += t;
        }
    }
    ticks as f64 / clock_ticks()
}

async fn start_upstream() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind upstream");
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let _ = stream.set_nodelay(true);
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(|req| async move {
                    if req.uri().path() == SERVED_PATH {
                        let n = SERVED.load(Ordering::Relaxed).to_string();
                        return Ok(hyper::Response::new(Full::new(Bytes::from(n))));
                    }
                    SERVED.fetch_add(1, Ordering::Relaxed);
                    let mut resp = hyper::Response::new(Full::new(Bytes::from_static(BODY)));
                    resp.headers_mut()
                        .insert("content-type", "application/json".parse().unwrap());
                    Ok::<_, Infallible>(resp)
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    addr
}

/// The reference proxy: per thread, a single-threaded runtime with its own
/// `SO_REUSEPORT` listener (as the gateway serves), hyper's HTTP/1.1 server,
/// and a stack of idle hyper HTTP/1.1 client connections to `upstream`.
fn start_bare_proxy(upstream: SocketAddr) -> SocketAddr {
    use hyper::body::Incoming;
    use hyper::client::conn::http1::SendRequest;
    use std::cell::RefCell;
    use std::rc::Rc;

    let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    let first = std::net::TcpListener::bind("127.0.0.1:0").expect("bind bare proxy");
    let addr = first.local_addr().unwrap();
    for i in 0..threads {
        let listener = first.try_clone().expect("listener");
        std::thread::Builder::new()
            .name(format!("bare-{i}"))
            .spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("runtime");
                let local = tokio::task::LocalSet::new();
                local.block_on(&rt, async move {
                    listener.set_nonblocking(true).unwrap();
                    let listener = TcpListener::from_std(listener).unwrap();
                    let idle: Rc<RefCell<Vec<SendRequest<Incoming>>>> = Rc::default();
                    loop {
                        let Ok((stream, _)) = listener.accept().await else {
                            continue;
                        };
                        let _ = stream.set_nodelay(true);
                        let idle = idle.clone();
                        tokio::task::spawn_local(async move {
                            let svc = hyper::service::service_fn(move |req| {
                                let idle = idle.clone();
                                async move {
                                    let pooled = idle.borrow_mut().pop();
                                    // A pooled connection may still be sending
                                    // its last response body: wait for it.
                                    let ready = match pooled {
                                        Some(mut s) => s.ready().await.is_ok().then_some(s),
                                        None => None,
                                    };
                                    let mut sender = match ready {
                                        Some(s) => s,
                                        None => {
                                            let s = tokio::net::TcpStream::connect(upstream)
                                                .await
                                                .expect("connect upstream");
                                            let _ = s.set_nodelay(true);
                                            let (sender, conn) =
                                                hyper::client::conn::http1::handshake(
                                                    TokioIo::new(s),
                                                )
                                                .await
                                                .expect("handshake");
                                            tokio::task::spawn_local(conn);
                                            sender
                                        }
                                    };
                                    let resp = sender.send_request(req).await;
                                    idle.borrow_mut().push(sender);
                                    resp
                                }
                            });
                            let _ = hyper::server::conn::http1::Builder::new()
                                .serve_connection(TokioIo::new(stream), svc)
                                .await;
                        });
                    }
                });
            })
            .expect("bare proxy thread");
    }
    addr
}

/// The gateway in front of `upstream`; with `tls`, serving TLS with that
/// certificate (HTTP/1.1 and HTTP/2 by ALPN, as the daemon offers).
async fn start_gateway(upstream: SocketAddr, tls: Option<&Certs>) -> SocketAddr {
    let config = SchedulerConfig {
        nodes: vec![NodeConfig {
            id: "node-bench".into(),
            endpoint: format!("http://{upstream}"),
        }],
        ..SchedulerConfig::default()
    };
    let scheduler = agentenv_sched::Scheduler::builder(config)
        .build()
        .expect("scheduler");
    let service = scheduler.service();
    let heartbeat = || {
        tonic::Request::new(pb::HeartbeatRequest {
            node_id: "node-bench".into(),
            service_instance_id: "bench".into(),
            snapshot: Some(pb::NodeSnapshot {
                status: pb::NodeStatus::Ready as i32,
                ..Default::default()
            }),
            sandbox_ids: vec!["sbx-bench".into()],
            ..Default::default()
        })
    };
    service.heartbeat(heartbeat()).await.expect("heartbeat");
    // Bindings are refreshed by heartbeats; keep one going for long runs.
    let hb = service.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(5));
        loop {
            tick.tick().await;
            let _ = hb.heartbeat(heartbeat()).await;
        }
    });
    let gateway = Gateway::new(
        InProcessScheduler::new(Arc::new(service)),
        GatewayOptions {
            api_key: API_KEY.into(),
            request_timeout: Duration::from_secs(30),
            forward_response_size: 4 << 20,
            sandbox_proxy_domains: Vec::new(),
            debug_mode: false,
            limits: Default::default(),
            console: Default::default(),
            // As the daemon runs by default.
            route_cache_ttl: agentenv_core::config::GatewayConfig::default().route_cache_ttl,
        },
    )
    .expect("gateway");
    let gateway = match tls {
        Some(c) => {
            let cert = agentenv_core::tls::ReloadingCert::load(&c.cert, &c.key).expect("load cert");
            let cfg = agentenv_core::tls::server_config(cert, None, &[b"h2", b"http/1.1"])
                .expect("TLS config");
            gateway.with_tls(cfg)
        }
        None => gateway,
    };
    // One single-threaded runtime per core, like nginx's worker processes;
    // BENCH_THREADS=0 serves from one multi-threaded runtime instead.
    let threads = std::env::var("BENCH_THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(2, |n| n.get()));
    if threads == 0 {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind gateway");
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { gateway.serve(listener, std::future::pending()).await });
        return addr;
    }
    let handle = gateway
        .serve_threads(
            "127.0.0.1:0".parse().unwrap(),
            threads,
            std::future::pending(),
        )
        .expect("serve gateway");
    handle.local_addr()
}

/// nginx as a keep-alive reverse proxy to `upstream`, on a plain port and a
/// TLS port (`certs`); returns both addresses.
fn start_nginx(dir: &Path, upstream: SocketAddr, certs: &Certs) -> (Child, SocketAddr, SocketAddr) {
    let port = agentenv_testkit::free_port();
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let tls_port = agentenv_testkit::free_port();
    let tls_addr: SocketAddr = format!("127.0.0.1:{tls_port}").parse().unwrap();
    let (cert, key) = (certs.cert.display(), certs.key.display());
    let is_root = Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false);
    let d = dir.display();
    let conf = format!(
        r#"{user}
worker_processes auto;
daemon off;
pid {d}/nginx.pid;
error_log {d}/error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    # As the gateway: no limit on requests per client connection (nginx's
    # default of 1000 would make wrk reconnect, and over TLS handshake again).
    keepalive_requests 1000000;
    client_body_temp_path {d}/client_body;
    proxy_temp_path {d}/proxy;
    fastcgi_temp_path {d}/fastcgi;
    uwsgi_temp_path {d}/uwsgi;
    scgi_temp_path {d}/scgi;
    upstream backend {{
        server {upstream};
        keepalive 128;
    }}
    server {{
        listen {addr};
        location / {{
            proxy_pass http://backend;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_set_header Host $http_host;
        }}
    }}
    server {{
        listen {tls_addr} ssl;
        ssl_certificate {cert};
        ssl_certificate_key {key};
        location / {{
            proxy_pass http://backend;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_set_header Host $http_host;
        }}
    }}
}}
"#,
        user = if is_root { "user root;" } else { "" },
    );
    let path = dir.join("nginx.conf");
    std::fs::write(&path, conf).expect("write nginx.conf");
    let child = Command::new("nginx")
        .arg("-p")
        .arg(dir)
        .arg("-c")
        .arg(&path)
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start nginx");
    (child, addr, tls_addr)
}

async fn wait_listening(addr: SocketAddr) {
    agentenv_testkit::eventually(
        format_args!("nginx to listen on {addr}"),
        Duration::from_secs(10),
        || tokio::net::TcpStream::connect(addr),
    )
    .await;
}

fn stop(child: &mut Child) {
    // SIGQUIT: nginx's graceful stop, which also ends its workers.
    let _ = Command::new("kill")
        .arg("-QUIT")
        .arg(child.id().to_string())
        .status();
    let _ = child.wait();
}
