//! What open console pages cost the gateway: memory, and proxied traffic with
//! and without them, in one run.
//!
//! Starts a stand-in node (an HTTP server answering the data-plane request wrk
//! sends, and node sandbox lists whose expiry times change every second, so
//! every page gets an update every second), a scheduler in this process with
//! two nodes on it, and the gateway with its console. Each round drives the
//! gateway with wrk (64 connections) with no page open, then opens the pages
//! in a child process (each page: a sign-in, the page and the assets it names, and the
//! live-updates WebSocket, reading everything it is sent), waits until every
//! page has its first snapshot and a few updates more, reads this process's
//! RSS (the gateway, the stand-in node and the scheduler; only the gateway
//! serves pages), and drives the gateway again with the pages open.
//!
//! `cargo run --release -p agentenv-proxy --example console_bench [-- --pages N]
//! [--seconds S] [--rounds R]` (defaults 100 pages, 5 s per wrk run, 3 rounds);
//! needs the Debian package `wrk`.

use std::convert::Infallible;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use agentenv_core::config::{NodeConfig, SchedulerConfig};
use agentenv_core::proto::scheduler_v1 as pb;
use agentenv_core::proto::scheduler_v1::scheduler_server::Scheduler as _;
use agentenv_proxy::{Gateway, GatewayOptions, InProcessScheduler};
use bytes::Bytes;
use futures::StreamExt;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;

#[path = "bench_support/mod.rs"]
mod bench_support;
use bench_support::{Run, load_average, median, median_run, threads_cpu_seconds, which, wrk};

const BODY: &[u8] =
    br#"{"sandboxID":"sbx-bench","state":"running","envdVersion":"0.2.0","ok":true}"#;
const API_KEY: &str = "bench_0123456789abcdef0123456789abcdef";
/// Sandboxes each stand-in node lists.
const LISTED: usize = 25;
const NODES: [&str; 2] = ["node-a", "node-b"];

struct Opts {
    pages: usize,
    secs: u64,
    rounds: usize,
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("--page-client") {
        let addr: SocketAddr = args[1].parse().expect("gateway address");
        let pages: usize = args[2].parse().expect("page count");
        page_client(addr, pages);
        return;
    }
    let mut opts = Opts {
        pages: 100,
        secs: 5,
        rounds: 3,
    };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut value = |name: &str| -> usize {
            it.next()
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("{name} needs a number"))
        };
        match a.as_str() {
            "--pages" => opts.pages = value("--pages"),
            "--seconds" => opts.secs = value("--seconds") as u64,
            "--rounds" => opts.rounds = value("--rounds").max(1),
            "-h" | "--help" => {
                println!(
                    "console_bench [--pages N (100)] [--seconds S (5)] [--rounds R (3)]: gateway RSS and proxied throughput with and without N open console pages"
                );
                return;
            }
            other => panic!("unknown argument {other} (see --help)"),
        }
    }
    if which("wrk").is_none() {
        eprintln!(
            "bench: `wrk` is not installed; install the Debian package `wrk` (see scripts/apt-packages.txt)"
        );
        std::process::exit(2);
    }
    let runtime = || {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("tokio runtime")
    };
    let upstream_rt = runtime();
    let rt = runtime();
    let upstream = upstream_rt.block_on(start_node());
    let gateway = rt.block_on(start_gateway(upstream));
    let url = format!("http://{gateway}/hello");
    println!(
        "gateway {gateway}, stand-in nodes at {upstream} ({} nodes x {LISTED} sandboxes, expiry changing every second); {} page(s); {}s per wrk run at 64 connections; load average {}\n",
        NODES.len(),
        opts.pages,
        opts.secs,
        load_average()
    );
    wrk(&url, 64, 1);
    let (mut without, mut with, mut ratios, mut rss_costs) = (vec![], vec![], vec![], vec![]);
    for round in 1..=opts.rounds {
        let alone = measured(&url, opts.secs);
        print_run(round, "no pages", &alone);
        let before = rss_kib();
        let pages = Pages::open(gateway, opts.pages);
        // A few updates more after every page has its first snapshot.
        std::thread::sleep(Duration::from_secs(3));
        let after = rss_kib();
        let received = pages.received();
        let loaded = measured(&url, opts.secs);
        let during = pages.received() - received;
        print_run(round, &format!("{} pages", opts.pages), &loaded);
        println!(
            "         pages: RSS {:.1} -> {:.1} MiB ({:+.1} MiB); {during} updates delivered to the pages during the run",
            before as f64 / 1024.0,
            after as f64 / 1024.0,
            (after as f64 - before as f64) / 1024.0
        );
        pages.close();
        rss_costs.push((after as f64 - before as f64) / 1024.0);
        ratios.push(loaded.rps / alone.rps);
        without.push(alone);
        with.push(loaded);
    }
    let (a, b) = (median_run(&without), median_run(&with));
    let spread = {
        let rps: Vec<f64> = without.iter().map(|r| r.rps).collect();
        let hi = rps.iter().cloned().fold(f64::MIN, f64::max);
        let lo = rps.iter().cloned().fold(f64::MAX, f64::min);
        (hi - lo) / median(rps.clone())
    };
    let ratio = median(ratios);
    let cost = rss_costs.first().copied().unwrap_or(f64::NAN);
    println!("\nmedians of {} round(s):", opts.rounds);
    for (name, r) in [("no pages", a), ("with pages", b)] {
        println!(
            "  {name:<11} {:>9.0} req/s   p50 {:>7.1} µs   p99 {:>7.1} µs   gateway CPU/request {:>5.1} µs",
            r.rps, r.p50_us, r.p99_us, r.cpu_us
        );
    }
    println!(
        "  throughput with/without pages = {ratio:.3} (median of per-round ratios); run-to-run spread without pages = {:.1}%",
        spread * 100.0
    );
    println!(
        "  gateway memory for {} pages: {cost:+.1} MiB in the first round (rounds: {})",
        opts.pages,
        rss_costs
            .iter()
            .map(|c| format!("{c:+.1}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    println!("\ntargets:");
    let pass = |ok: bool| if ok { "PASS" } else { "MISS" };
    println!(
        "  {} {} open pages cost the gateway < 50 MB: {cost:+.1} MiB",
        pass(cost < 50.0 * 1e6 / 1_048_576.0),
        opts.pages
    );
    println!(
        "  {} proxied traffic not measurably slower with the pages open: {:.1}% change against a {:.1}% spread between runs without them",
        pass(1.0 - ratio <= spread.max(0.02)),
        (ratio - 1.0) * 100.0,
        spread * 100.0
    );
    println!("load average at the end: {}", load_average());
}

fn print_run(round: usize, what: &str, r: &Run) {
    println!(
        "round {round}  {what:<10} {:>9.0} req/s   p50 {:>7.1} µs   p99 {:>7.1} µs   gateway CPU/request {:>5.1} µs   load {}",
        r.rps,
        r.p50_us,
        r.p99_us,
        r.cpu_us,
        load_average()
    );
}

/// A wrk run at 64 connections with the gateway threads' CPU per request.
fn measured(url: &str, secs: u64) -> Run {
    let before = threads_cpu_seconds("gateway-");
    let mut r = wrk(url, 64, secs);
    r.cpu_us = (threads_cpu_seconds("gateway-") - before) * 1e6 / (r.rps * secs as f64);
    r
}

/// This process's resident memory in KiB.
fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.split_whitespace().next()?.parse().ok())
        })
        .unwrap_or(0)
}

/// The open pages: a child process of this example in `--page-client` mode.
struct Pages {
    child: std::process::Child,
    received: Arc<AtomicU64>,
}

impl Pages {
    /// Opens `n` pages on `gateway` and waits until each has its first snapshot.
    fn open(gateway: SocketAddr, n: usize) -> Pages {
        let mut child = Command::new(std::env::current_exe().expect("own path"))
            .args(["--page-client", &gateway.to_string(), &n.to_string()])
            .stdout(Stdio::piped())
            .spawn()
            .expect("start the page client");
        let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
        match lines.next() {
            Some(Ok(l)) if l == "ready" => {}
            other => panic!("the page client did not get ready: {other:?}"),
        }
        let received = Arc::new(AtomicU64::new(0));
        let counter = received.clone();
        std::thread::spawn(move || {
            for line in lines.map_while(Result::ok) {
                if let Some(n) = line.strip_prefix("received ").and_then(|n| n.parse().ok()) {
                    counter.store(n, Ordering::Relaxed);
                }
            }
        });
        Pages { child, received }
    }

    /// Updates the pages have received so far (reported once a second).
    fn received(&self) -> u64 {
        self.received.load(Ordering::Relaxed)
    }

    fn close(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `--page-client ADDR N`: N console pages, as a browser opens them.
fn page_client(addr: SocketAddr, pages: usize) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async move {
        let received = Arc::new(AtomicU64::new(0));
        let (ready_tx, mut ready_rx) = tokio::sync::mpsc::channel::<()>(pages.max(1));
        for _ in 0..pages {
            let cookie = open_page(addr).await;
            let mut req = format!("ws://{addr}/console/api/events")
                .into_client_request()
                .expect("request");
            req.headers_mut()
                .insert("cookie", cookie.parse().expect("cookie"));
            req.headers_mut()
                .insert("origin", format!("http://{addr}").parse().expect("origin"));
            let (ws, _) = tokio_tungstenite::connect_async(req)
                .await
                .expect("open the events socket");
            let (received, ready) = (received.clone(), ready_tx.clone());
            tokio::spawn(async move {
                let (_tx, mut rx) = ws.split();
                let mut first = true;
                while let Some(Ok(m)) = rx.next().await {
                    if m.is_text() {
                        received.fetch_add(1, Ordering::Relaxed);
                        if std::mem::take(&mut first) {
                            let _ = ready.send(()).await;
                        }
                    }
                }
            });
        }
        for _ in 0..pages {
            ready_rx.recv().await.expect("a page's first snapshot");
        }
        println!("ready");
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        loop {
            tick.tick().await;
            println!("received {}", received.load(Ordering::Relaxed));
        }
    });
}

/// Signs in, fetches the page and its assets; the session cookie.
async fn open_page(addr: SocketAddr) -> String {
    let stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .expect("handshake");
    tokio::spawn(conn);
    let origin = format!("http://{addr}");
    let req = hyper::Request::post("/console/api/session")
        .header("host", addr.to_string())
        .header("origin", &origin)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(format!(
            r#"{{"apiKey":"{API_KEY}"}}"#
        ))))
        .expect("request");
    let resp = send.send_request(req).await.expect("sign in");
    assert_eq!(resp.status(), 200, "sign-in");
    let cookie = resp
        .headers()
        .get("set-cookie")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .expect("a session cookie")
        .to_string();
    resp.into_body().collect().await.expect("sign-in body");
    let mut get = |path: String| {
        let req = hyper::Request::get(path)
            .header("host", addr.to_string())
            .header("cookie", &cookie)
            .body(Full::new(Bytes::new()))
            .expect("request");
        send.send_request(req)
    };
    let index = get("/console/".into()).await.expect("the page");
    let html = index.into_body().collect().await.expect("page").to_bytes();
    let html = String::from_utf8_lossy(&html).into_owned();
    for asset in html
        .split('"')
        .filter(|s| s.starts_with("/console/assets/") || s.starts_with("assets/"))
    {
        let path = if asset.starts_with('/') {
            asset.to_string()
        } else {
            format!("/console/{asset}")
        };
        let resp = get(path).await.expect("an asset");
        resp.into_body().collect().await.expect("asset body");
    }
    cookie
}

/// The stand-in node: a sandbox list whose expiry times move every second,
/// and a fixed answer to the data-plane request.
async fn start_node() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind the stand-in node");
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let _ = stream.set_nodelay(true);
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(|req: hyper::Request<_>| async move {
                    let path = req.uri().path();
                    let body = if path.starts_with("/v2/sandboxes") || path == "/sandboxes" {
                        Bytes::from(sandbox_list())
                    } else {
                        Bytes::from_static(BODY)
                    };
                    let mut resp = hyper::Response::new(Full::new(body));
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

/// `LISTED` running sandboxes, each expiring five minutes from this second.
fn sandbox_list() -> String {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let stamp = |s: u64| {
        time::OffsetDateTime::from_unix_timestamp(s as i64)
            .expect("a time")
            .format(&time::format_description::well_known::Rfc3339)
            .expect("RFC 3339")
    };
    let items: Vec<String> = (0..LISTED)
        .map(|i| {
            format!(
                r#"{{"sandboxID":"sbx-{i:04}-{}","templateID":"base","alias":"base","clientID":"","state":"running","cpuCount":2,"memoryMB":512,"diskSizeMB":1024,"envdVersion":"0.2.0","startedAt":"{}","endAt":"{}","metadata":{{"team":"bench"}}}}"#,
                std::process::id(),
                stamp(now - 60),
                stamp(now + 300)
            )
        })
        .collect();
    format!("[{}]", items.join(","))
}

/// The scheduler (two nodes on the stand-in) and the gateway with its console.
async fn start_gateway(upstream: SocketAddr) -> SocketAddr {
    let config = SchedulerConfig {
        nodes: NODES
            .iter()
            .map(|id| NodeConfig {
                id: (*id).into(),
                endpoint: format!("http://{upstream}"),
            })
            .collect(),
        ..SchedulerConfig::default()
    };
    let scheduler = agentenv_sched::Scheduler::builder(config)
        .build()
        .expect("scheduler");
    let service = scheduler.service();
    let heartbeat = |node: &str| {
        tonic::Request::new(pb::HeartbeatRequest {
            node_id: node.into(),
            service_instance_id: format!("{node}-bench"),
            snapshot: Some(pb::NodeSnapshot {
                status: pb::NodeStatus::Ready as i32,
                ..Default::default()
            }),
            sandbox_ids: if node == NODES[0] {
                vec!["sbx-bench".into()]
            } else {
                vec![]
            },
            ..Default::default()
        })
    };
    for node in NODES {
        service.heartbeat(heartbeat(node)).await.expect("heartbeat");
    }
    let hb = service.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(5));
        loop {
            tick.tick().await;
            for node in NODES {
                let _ = hb.heartbeat(heartbeat(node)).await;
            }
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
            route_cache_ttl: std::time::Duration::ZERO,
        },
    )
    .expect("gateway");
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    let handle = gateway
        .serve_threads(
            "127.0.0.1:0".parse().unwrap(),
            threads,
            std::future::pending(),
        )
        .expect("serve gateway");
    let addr = handle.local_addr();
    std::mem::forget(handle);
    let started = Instant::now();
    while tokio::net::TcpStream::connect(addr).await.is_err() {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the gateway listens"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    addr
}
