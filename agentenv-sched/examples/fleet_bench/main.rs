//! Fleet benchmark: 10,000 static nodes with 100 sandboxes each (1,000,000
//! bindings) heartbeat into one scheduler over gRPC on loopback at the node's
//! default interval (5 s, so 2,000 heartbeats/s), each with its full roster
//! and a node snapshot, while the gateway's traffic runs on top: LookupNode
//! (many concurrent), Schedule + RecordAssignment (creates, whose sandboxes
//! join their node's roster while the oldest ones are deleted: roster churn).
//!
//! For each binding store (in-memory, then Redis) a fresh scheduler runs in a
//! process of its own (this program re-run in server mode), so its RSS and CPU
//! are its alone. A warm-up loads every binding (heartbeats as fast as they
//! go), then the measured phase runs at the real rate. The gateway's calls
//! run on a runtime thread of their own (a gateway is a process apart from
//! the nodes). The reference is a do-nothing gRPC call (the health check) on
//! the same connections during the same phase. One table prints both stores side by side, with the
//! issue's targets marked PASS or MISS.
//!
//! Run: `cargo run --release -p agentenv-sched --example fleet_bench [-- --help]`

mod fleet;
mod report;
mod server;

use std::sync::Arc;
use std::time::{Duration, Instant};

use fleet::{Fleet, Traffic};
use report::Figures;
use server::{RedisServer, SchedulerProc, StoreKind, proc_stats};
use tonic::transport::Channel;

const USAGE: &str = "\
usage: fleet_bench [options]
  --nodes N               runtime nodes (10000)
  --sandboxes-per-node N  sandboxes each node lists (100)
  --seconds N             length of the measured phase per store (30: it
                          includes one expired-binding sweep of the scheduler)
  --interval-secs N       heartbeat interval of every node (5, the node default)
  --creates-per-sec N     Schedule + RecordAssignment per second (200)
  --lookups-per-sec N     LookupNode per second, many in flight (5000)
  --connections N         connections the nodes heartbeat over (0 = one per node)
  --store memory|redis|both   which binding stores to measure (both)
  --redis ADDR            the Redis to use (host:port or redis:// URL); without it a
                          redis-server on PATH is started on a free loopback port.
                          The run writes agentenv:scheduler:bindings:* keys there.
  --quick                 a smoke run: 200 nodes x 20 sandboxes, 1 s interval, 3 s";

/// Connections the gateway's calls share (a few gateways).
const GATEWAY_CONNECTIONS: usize = 4;
/// Heartbeats in flight during the warm-up.
const WARMUP_CONCURRENCY: usize = 64;
/// Bindings looked up after the warm-up to check they were all loaded.
const CHECK_SAMPLES: usize = 1000;

#[derive(Debug, Clone)]
pub struct Opts {
    pub nodes: usize,
    pub per_node: usize,
    pub seconds: u64,
    pub interval: Duration,
    pub creates_per_sec: u64,
    pub lookups_per_sec: u64,
    pub connections: usize,
    pub stores: Vec<StoreKind>,
    pub redis: Option<String>,
}

fn parse_opts(args: &[String]) -> Result<Opts, String> {
    let mut o = Opts {
        nodes: 10_000,
        per_node: 100,
        seconds: 30,
        interval: Duration::from_secs(5),
        creates_per_sec: 200,
        lookups_per_sec: 5000,
        connections: 0,
        stores: vec![StoreKind::Memory, StoreKind::Redis],
        redis: None,
    };
    if args.iter().any(|a| a == "--quick") {
        o.nodes = 200;
        o.per_node = 20;
        o.seconds = 3;
        o.interval = Duration::from_secs(1);
        o.creates_per_sec = 50;
        o.lookups_per_sec = 500;
    }
    let mut i = 0;
    while i < args.len() {
        let flag = args[i].as_str();
        if flag == "--quick" {
            i += 1;
            continue;
        }
        if flag == "--help" || flag == "-h" {
            return Err(String::new());
        }
        let value = args
            .get(i + 1)
            .ok_or_else(|| format!("{flag} needs a value"))?;
        let num = || -> Result<u64, String> {
            value
                .parse()
                .map_err(|_| format!("{flag}: {value:?} is not a whole number"))
        };
        match flag {
            "--nodes" => o.nodes = num()? as usize,
            "--sandboxes-per-node" => o.per_node = num()? as usize,
            "--seconds" => o.seconds = num()?,
            "--interval-secs" => o.interval = Duration::from_secs(num()?),
            "--creates-per-sec" => o.creates_per_sec = num()?,
            "--lookups-per-sec" => o.lookups_per_sec = num()?,
            "--connections" => o.connections = num()? as usize,
            "--redis" => o.redis = Some(value.clone()),
            "--store" => {
                o.stores = match value.as_str() {
                    "memory" => vec![StoreKind::Memory],
                    "redis" => vec![StoreKind::Redis],
                    "both" => vec![StoreKind::Memory, StoreKind::Redis],
                    v => return Err(format!("--store: {v:?} is not memory, redis or both")),
                }
            }
            _ => return Err(format!("unknown option {flag}")),
        }
        i += 2;
    }
    if o.nodes == 0 || o.nodes > 99_999 {
        return Err("--nodes: give 1 to 99999".into());
    }
    if o.interval.is_zero() || o.seconds == 0 {
        return Err("--interval-secs and --seconds must be at least 1".into());
    }
    Ok(o)
}

/// The runtime of the gateway's calls: one thread of its own.
fn gateway_rt() -> &'static tokio::runtime::Runtime {
    static RT: std::sync::OnceLock<tokio::runtime::Runtime> = std::sync::OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("gateway")
            .enable_all()
            .build()
            .expect("gateway runtime")
    })
}

async fn connect(addr: &str, count: usize) -> Result<Vec<Channel>, String> {
    use futures::StreamExt;
    let endpoint = Channel::from_shared(format!("http://{addr}"))
        .map_err(|e| e.to_string())?
        .tcp_nodelay(true);
    futures::stream::iter(0..count)
        .map(|_| {
            let e = endpoint.clone();
            async move { e.connect().await }
        })
        .buffer_unordered(64)
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("cannot connect to the scheduler at {addr}: {e}"))
}

/// One store's run: a fresh scheduler process, warm-up, measured phase.
async fn run_store(
    kind: StoreKind,
    o: &Opts,
    redis: Option<(&str, Option<u32>)>,
) -> Result<Figures, String> {
    let mut f = Figures::default();
    let mut sched = SchedulerProc::start(kind, o.nodes, redis.map(|r| r.0)).await?;
    let connections = if o.connections == 0 {
        o.nodes
    } else {
        o.connections.min(o.nodes)
    };
    let node_channels = connect(&sched.addr, connections).await?;
    // The gateway's calls run on a runtime of their own, as a gateway is a process apart
    // from the 10,000 nodes: its latencies are not those of the nodes' run queue.
    let gateway = {
        let addr = sched.addr.clone();
        gateway_rt()
            .spawn(async move { connect(&addr, GATEWAY_CONNECTIONS).await })
            .await
            .map_err(|e| e.to_string())??
    };
    let fleet = Arc::new(Fleet::new(o.nodes, o.per_node));

    let t = Instant::now();
    let (refused, first) = fleet::load_all(&fleet, &node_channels, WARMUP_CONCURRENCY).await;
    f.warmup_secs = t.elapsed().as_secs_f64();
    if refused > 0 {
        return Err(format!(
            "{refused} warm-up heartbeats refused, e.g. {}",
            first.unwrap_or_default()
        ));
    }
    f.warmup_found = fleet::check_bindings(&fleet, &gateway, CHECK_SAMPLES).await;
    f.warmup_checked = CHECK_SAMPLES;
    f.warmup_bindings = count(&mut sched, kind, redis).await;
    f.rss_after_warmup_kib = proc_stats(sched.pid).rss_kib;

    let redis_pid = redis.and_then(|r| r.1);
    let before = (
        proc_stats(sched.pid),
        redis_pid.map(proc_stats),
        proc_stats(0),
    );
    let traffic = Traffic {
        interval: o.interval,
        creates_per_sec: o.creates_per_sec,
        lookups_per_sec: o.lookups_per_sec,
    };
    let t = Instant::now();
    let rec = fleet::measure(
        &fleet,
        &node_channels,
        &gateway,
        gateway_rt().handle(),
        traffic,
        Duration::from_secs(o.seconds),
    )
    .await;
    f.measured_secs = t.elapsed().as_secs_f64();
    let after = (
        proc_stats(sched.pid),
        redis_pid.map(proc_stats),
        proc_stats(0),
    );
    f.sched = after.0;
    f.sched_cpu = after.0.cpu_secs - before.0.cpu_secs;
    if let (Some(b), Some(a)) = (before.1, after.1) {
        f.redis = Some(a);
        f.redis_cpu = a.cpu_secs - b.cpu_secs;
    }
    f.load_cpu = after.2.cpu_secs - before.2.cpu_secs;
    f.load_avg = std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .split_whitespace()
        .next()
        .unwrap_or("?")
        .to_string();
    f.bindings = count(&mut sched, kind, redis).await;
    f.recorded = Some(rec);
    sched.stop().await;
    Ok(f)
}

async fn count(
    sched: &mut SchedulerProc,
    kind: StoreKind,
    redis: Option<(&str, Option<u32>)>,
) -> Option<u64> {
    match (kind, redis) {
        (StoreKind::Redis, Some((addr, _))) => server::redis_bindings(addr),
        _ => sched.bindings().await,
    }
}

async fn bench(o: Opts) {
    let offered = o.nodes as f64 / o.interval.as_secs_f64();
    println!(
        "fleet bench: {} nodes x {} sandboxes ({} bindings), a heartbeat every {} s per node ({offered:.0}/s offered) over {} connections,\n\
         gateway: {} creates/s (Schedule + RecordAssignment) and {} LookupNode/s over {GATEWAY_CONNECTIONS} connections; {} s measured per store.\n\
         Each scheduler runs in its own process, the gateway's calls on a thread of their own; scheduler, Redis and this load generator share the machine's {} cores.\n",
        o.nodes,
        o.per_node,
        o.nodes * o.per_node,
        o.interval.as_secs(),
        if o.connections == 0 {
            o.nodes
        } else {
            o.connections.min(o.nodes)
        },
        o.creates_per_sec,
        o.lookups_per_sec,
        o.seconds,
        std::thread::available_parallelism().map_or(0, |n| n.get()),
    );
    let mut results: Vec<(StoreKind, Result<Figures, String>)> = Vec::new();
    let mut own_redis = None;
    for &kind in &o.stores {
        let redis_addr = match kind {
            StoreKind::Memory => None,
            StoreKind::Redis => match &o.redis {
                Some(a) => Some(Ok(a.clone())),
                None => Some(RedisServer::start().map(|r| {
                    let addr = r.addr.clone();
                    own_redis = Some(r);
                    addr
                })),
            },
        };
        let result = match &redis_addr {
            Some(Err(e)) => Err(e.clone()),
            Some(Ok(addr)) => {
                let pid = own_redis
                    .as_ref()
                    .map(|r| r.pid())
                    .or_else(|| server::redis_pid(addr));
                run_store(kind, &o, Some((addr.as_str(), pid))).await
            }
            None => run_store(kind, &o, None).await,
        };
        if let Err(e) = &result {
            eprintln!("{} store: {e}", kind.name());
        }
        results.push((kind, result));
    }
    report::print(&o, &results);
    drop(own_redis);
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some(server::SERVE_FLAG) {
        let kind = match args.get(1).map(String::as_str) {
            Some("redis") => StoreKind::Redis,
            _ => StoreKind::Memory,
        };
        let value = |flag: &str| {
            args.iter()
                .position(|a| a == flag)
                .and_then(|i| args.get(i + 1))
                .cloned()
        };
        let nodes = value("--nodes").and_then(|v| v.parse().ok()).unwrap_or(1);
        let redis = value("--redis");
        let rt = tokio::runtime::Runtime::new().expect("tokio runtime");
        if let Err(e) = rt.block_on(server::serve(kind, nodes, redis.as_deref())) {
            eprintln!("fleet_bench scheduler: {e}");
            std::process::exit(1);
        }
        return;
    }
    let o = match parse_opts(&args) {
        Ok(o) => o,
        Err(e) => {
            if !e.is_empty() {
                eprintln!("fleet_bench: {e}");
            }
            eprintln!("{USAGE}");
            std::process::exit(2);
        }
    };
    let rt = tokio::runtime::Runtime::new().expect("tokio runtime");
    rt.block_on(bench(o));
}
