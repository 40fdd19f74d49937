//! Scheduler benchmark: 1,000 static nodes heartbeating (100 sandbox ids each,
//! 200 heartbeats/s in total) while clients drive Schedule, RecordAssignment
//! and LookupNode over gRPC on loopback as fast as they go.
//!
//! The reference, measured in the same run on the same transport, is a
//! do-nothing gRPC call (the health check): the ratio says how much of the
//! transport's ceiling the scheduler's own work costs.
//!
//! Run: `cargo run --release -p agentenv-sched --example sched_bench [-- --seconds 5 --concurrency 64]`

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use agentenv_core::config::{NodeConfig, SchedulerConfig};
use agentenv_core::proto::scheduler_v1::scheduler_client::SchedulerClient;
use agentenv_core::proto::scheduler_v1::*;
use agentenv_sched::Scheduler;
use hdrhistogram::Histogram;
use tonic::transport::Channel;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_client::HealthClient;

const NODES: usize = 1000;
const IDS_PER_NODE: usize = 100;
const HEARTBEATS_PER_SEC: u64 = 200;
const CHANNELS: usize = 4;

struct Opts {
    seconds: u64,
    concurrency: usize,
}

fn opts() -> Opts {
    let mut o = Opts {
        seconds: 3,
        concurrency: 64,
    };
    let args: Vec<String> = std::env::args().collect();
    let mut i = 1;
    while i < args.len() {
        let v = args.get(i + 1).and_then(|v| v.parse().ok());
        match (args[i].as_str(), v) {
            ("--seconds", Some(v)) => o.seconds = v,
            ("--concurrency", Some(v)) => o.concurrency = v as usize,
            _ => {
                eprintln!("usage: bench [--seconds N] [--concurrency N]");
                std::process::exit(2);
            }
        }
        i += 2;
    }
    o
}

fn endpoint(i: usize) -> String {
    format!("http://10.1.{}.{}:8000", i / 250, i % 250 + 1)
}

fn node_id(i: usize) -> String {
    format!("node-{i:04}")
}

fn rss_kib(field: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

fn heartbeat(i: usize, round: u64) -> HeartbeatRequest {
    HeartbeatRequest {
        node_id: node_id(i),
        cluster_id: "bench".into(),
        service_instance_id: format!("{}-1", node_id(i)),
        version: "bench".into(),
        snapshot: Some(NodeSnapshot {
            status: NodeStatus::Ready as i32,
            sandbox_count: IDS_PER_NODE as u32,
            cpu_count: 64,
            memory_total_bytes: 256 << 30,
            ..Default::default()
        }),
        // The roster rotates slowly so reconciles add and drop bindings.
        sandbox_ids: (0..IDS_PER_NODE)
            .map(|k| format!("{:08x}-0000-4000-8000-{:012x}", i, round * 7 + k as u64))
            .collect(),
        ..Default::default()
    }
}

struct Stats {
    schedule: Histogram<u64>,
    all: Histogram<u64>,
    schedules: u64,
    rpcs: u64,
}

impl Stats {
    fn new() -> Self {
        Self {
            schedule: Histogram::new(3).unwrap(),
            all: Histogram::new(3).unwrap(),
            schedules: 0,
            rpcs: 0,
        }
    }
    fn merge(&mut self, o: &Stats) {
        self.schedule.add(&o.schedule).unwrap();
        self.all.add(&o.all).unwrap();
        self.schedules += o.schedules;
        self.rpcs += o.rpcs;
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Mode {
    Noop,
    ScheduleOnly,
    Mixed,
}

async fn drive(
    channels: &[Channel],
    mode: Mode,
    concurrency: usize,
    o: &Opts,
) -> (Stats, Duration) {
    let stop = Arc::new(AtomicBool::new(false));
    let seq = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for w in 0..concurrency {
        let ch = channels[w % channels.len()].clone();
        let stop = stop.clone();
        let seq = seq.clone();
        tasks.push(tokio::spawn(async move {
            let mut sched = SchedulerClient::new(ch.clone());
            let mut health = HealthClient::new(ch);
            let mut st = Stats::new();
            while !stop.load(Ordering::Relaxed) {
                let t = Instant::now();
                match mode {
                    Mode::Noop => {
                        health
                            .check(HealthCheckRequest {
                                service: String::new(),
                            })
                            .await
                            .unwrap();
                        st.all.record(t.elapsed().as_micros() as u64).unwrap();
                        st.rpcs += 1;
                    }
                    Mode::ScheduleOnly | Mode::Mixed => {
                        let node = sched
                            .schedule(ScheduleRequest::default())
                            .await
                            .unwrap()
                            .into_inner()
                            .node;
                        let us = t.elapsed().as_micros() as u64;
                        st.schedule.record(us).unwrap();
                        st.all.record(us).unwrap();
                        st.schedules += 1;
                        st.rpcs += 1;
                        if mode == Mode::Mixed {
                            let id = format!("sbx-{}", seq.fetch_add(1, Ordering::Relaxed));
                            let t = Instant::now();
                            sched
                                .record_assignment(RecordAssignmentRequest {
                                    sandbox_id: id.clone(),
                                    node,
                                })
                                .await
                                .unwrap();
                            st.all.record(t.elapsed().as_micros() as u64).unwrap();
                            let t = Instant::now();
                            sched
                                .lookup_node(LookupNodeRequest { sandbox_id: id })
                                .await
                                .expect("a just-recorded binding is found");
                            st.all.record(t.elapsed().as_micros() as u64).unwrap();
                            st.rpcs += 2;
                        }
                    }
                }
            }
            st
        }));
    }
    let started = Instant::now();
    tokio::time::sleep(Duration::from_secs(o.seconds)).await;
    stop.store(true, Ordering::Relaxed);
    let mut total = Stats::new();
    for t in tasks {
        total.merge(&t.await.unwrap());
    }
    (total, started.elapsed())
}

fn ms(us: u64) -> f64 {
    us as f64 / 1000.0
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let o = opts();
    let rss_start = rss_kib("VmRSS:");
    let config = SchedulerConfig {
        nodes: (0..NODES)
            .map(|i| NodeConfig {
                id: node_id(i),
                endpoint: endpoint(i),
            })
            .collect(),
        strategy: "round_robin".into(),
        report_ttl: Duration::from_secs(30),
        binding_ttl: Duration::from_secs(300),
        ..SchedulerConfig::default()
    };
    let scheduler = Scheduler::builder(config).build()?;
    let service = scheduler.service();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move { scheduler.serve(listener, std::future::pending()).await });

    let mut channels = Vec::new();
    for _ in 0..CHANNELS {
        channels.push(
            Channel::from_shared(format!("http://{addr}"))?
                .tcp_nodelay(true)
                .connect()
                .await?,
        );
    }

    // Every node reports once so all are READY, then 200 heartbeats/s.
    let mut hb = SchedulerClient::new(channels[0].clone());
    for i in 0..NODES {
        hb.heartbeat(heartbeat(i, 0)).await?;
    }
    let beats = Arc::new(AtomicU64::new(0));
    let beat_lat = Arc::new(parking_lot::Mutex::new(Histogram::<u64>::new(3)?));
    {
        let beats = beats.clone();
        let beat_lat = beat_lat.clone();
        let ch = channels[1].clone();
        tokio::spawn(async move {
            let mut client = SchedulerClient::new(ch);
            let mut tick =
                tokio::time::interval(Duration::from_micros(1_000_000 / HEARTBEATS_PER_SEC));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut n = 0u64;
            loop {
                tick.tick().await;
                let i = (n % NODES as u64) as usize;
                let round = n / NODES as u64 + 1;
                let t = Instant::now();
                if client.heartbeat(heartbeat(i, round)).await.is_ok() {
                    beats.fetch_add(1, Ordering::Relaxed);
                    let _ = beat_lat.lock().record(t.elapsed().as_micros() as u64);
                }
                n += 1;
            }
        });
    }

    println!(
        "scheduler bench: {NODES} nodes x {IDS_PER_NODE} sandbox ids, {HEARTBEATS_PER_SEC} heartbeats/s target, \
         {} concurrent callers on {CHANNELS} HTTP/2 connections, {} s per phase, 2 worker threads shared by client and server\n",
        o.concurrency, o.seconds
    );
    println!(
        "{:<34} {:>5} {:>10} {:>12} {:>9} {:>9} {:>12}",
        "phase", "conc", "RPC/s", "Schedule/s", "p50 ms", "p99 ms", "heartbeats/s"
    );
    let mut results = Vec::new();
    let c = o.concurrency;
    let mut phases = vec![
        ("reference: gRPC health check", Mode::Noop, c),
        ("Schedule only", Mode::ScheduleOnly, c),
        ("Schedule+RecordAssignment+Lookup", Mode::Mixed, c),
    ];
    for low in [8, 16, 32] {
        if low < c {
            phases.push(("reference: gRPC health check", Mode::Noop, low));
            phases.push(("Schedule only", Mode::ScheduleOnly, low));
        }
    }
    for (name, mode, concurrency) in phases {
        let b0 = beats.load(Ordering::Relaxed);
        let (st, took) = drive(&channels, mode, concurrency, &o).await;
        let secs = took.as_secs_f64();
        let hb_rate = (beats.load(Ordering::Relaxed) - b0) as f64 / secs;
        let h = if mode == Mode::Noop {
            &st.all
        } else {
            &st.schedule
        };
        println!(
            "{:<34} {:>5} {:>10.0} {:>12.0} {:>9.3} {:>9.3} {:>12.0}",
            name,
            concurrency,
            st.rpcs as f64 / secs,
            st.schedules as f64 / secs,
            ms(h.value_at_quantile(0.5)),
            ms(h.value_at_quantile(0.99)),
            hb_rate
        );
        results.push((st.rpcs as f64 / secs, st.schedules as f64 / secs));
    }
    let (noop_rate, _) = results[0];
    println!(
        "\nat {c} callers: Schedule-only rate / do-nothing RPC rate: {:.2}; mixed RPC rate / do-nothing: {:.2}",
        results[1].0 / noop_rate,
        results[2].0 / noop_rate
    );
    let (beat_p50, beat_p99) = {
        let bl = beat_lat.lock();
        (bl.value_at_quantile(0.5), bl.value_at_quantile(0.99))
    };
    println!(
        "heartbeat (100 ids) latency: p50 {:.3} ms, p99 {:.3} ms",
        ms(beat_p50),
        ms(beat_p99)
    );

    // Memory: one million live bindings, reported through heartbeat rosters
    // (1,000 nodes x 1,000 sandboxes), held by the same scheduler.
    let rss_before = rss_kib("VmRSS:");
    let store = service.binding_store().clone();
    let now = tokio::time::Instant::now();
    let t = Instant::now();
    for i in 0..NODES {
        let ids: Vec<String> = (0..1000)
            .map(|k| format!("{:08x}-1111-4000-8000-{:012x}", i, k))
            .collect();
        let node = Node {
            node_id: node_id(i),
            endpoint: endpoint(i),
        };
        store.reconcile_node(&node, &ids, now).await?;
    }
    let load_time = t.elapsed();
    let rss_after = rss_kib("VmRSS:");
    println!(
        "\n1,000,000 live bindings: loaded in {:.2} s; RSS {} MiB before, {} MiB after ({} MiB for the bindings); process start RSS {} MiB",
        load_time.as_secs_f64(),
        rss_before / 1024,
        rss_after / 1024,
        rss_after.saturating_sub(rss_before) / 1024,
        rss_start / 1024
    );
    println!("peak RSS (VmHWM): {} MiB", rss_kib("VmHWM:") / 1024);
    Ok(())
}
