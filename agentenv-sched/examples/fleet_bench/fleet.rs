//! The simulated fleet: every node's roster and heartbeat, and the gateway's
//! traffic (creates, lookups) with the reference calls beside it.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use agentenv_core::proto::scheduler_v1::scheduler_client::SchedulerClient;
use agentenv_core::proto::scheduler_v1::*;
use hdrhistogram::Histogram;
use parking_lot::Mutex;
use rand::Rng;
use tokio::sync::Semaphore;
use tonic::transport::Channel;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_client::HealthClient;

/// Calls of one open-loop driver in flight at most; beyond that a call is
/// counted as dropped (the load generator could not keep up).
const MAX_IN_FLIGHT: usize = 4096;
/// Paused sandboxes per node (listed in the roster, not running).
const PAUSED: usize = 4;

pub fn node_id(i: usize) -> String {
    format!("node-{i:05}")
}

pub fn endpoint(i: usize) -> String {
    format!(
        "http://10.{}.{}.{}:8000",
        64 + i / 65536,
        (i / 256) % 256,
        i % 256
    )
}

fn node_index(node_id: &str) -> Option<usize> {
    node_id.strip_prefix("node-")?.parse().ok()
}

/// A random sandbox id in the form nodes give them (a UUID v4).
pub fn sandbox_id() -> String {
    let v: u128 = rand::random();
    let v = (v & !(0xf << 76) | (0x4 << 76)) & !(0x3 << 62) | (0x2 << 62);
    let h = format!("{v:032x}");
    format!(
        "{}-{}-{}-{}-{}",
        &h[..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..]
    )
}

/// One simulated node: its roster (oldest first) and counters.
struct SimNode {
    roster: VecDeque<String>,
    created: u64,
}

/// Every simulated node, shared by the heartbeat loops and the gateway traffic.
pub struct Fleet {
    nodes: Vec<Mutex<SimNode>>,
    per_node: usize,
}

impl Fleet {
    pub fn new(nodes: usize, per_node: usize) -> Self {
        Self {
            nodes: (0..nodes)
                .map(|_| {
                    Mutex::new(SimNode {
                        roster: (0..per_node).map(|_| sandbox_id()).collect(),
                        created: per_node as u64,
                    })
                })
                .collect(),
            per_node,
        }
    }

    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// Node `i`'s heartbeat as a runtime node sends it: its full roster
    /// (paused sandboxes included) and a snapshot of its host. Sandboxes
    /// beyond the node's size were deleted since the last beat (churn).
    pub fn heartbeat(&self, i: usize) -> HeartbeatRequest {
        let (ids, created) = {
            let mut n = self.nodes[i].lock();
            while n.roster.len() > self.per_node {
                n.roster.pop_front();
            }
            (n.roster.iter().cloned().collect::<Vec<_>>(), n.created)
        };
        let total = ids.len();
        let paused = PAUSED.min(total);
        let running = total - paused;
        let mut rng = rand::rng();
        HeartbeatRequest {
            node_id: node_id(i),
            cluster_id: "00000000-0000-0000-0000-000000000000".into(),
            service_instance_id: format!("0192f0c4-{i:04x}-7000-8000-000000000001"),
            version: "0.1.0".into(),
            commit: "4f1c2d9".into(),
            machine_info: Some(MachineInfo {
                cpu_family: "6".into(),
                cpu_model: "143".into(),
                cpu_model_name: "Intel(R) Xeon(R) Platinum 8480+".into(),
                cpu_architecture: "x86_64".into(),
                cpu_config_json: String::new(),
            }),
            snapshot: Some(NodeSnapshot {
                status: NodeStatus::Ready as i32,
                allocated_cpu: 2 * running as u32,
                allocated_memory_bytes: (running as u64) << 30,
                cpu_percent: rng.random_range(20..70),
                cpu_count: 224,
                memory_used_bytes: (running as u64) * (700 << 20),
                memory_total_bytes: 2048 << 30,
                disks: vec![
                    DiskMetric {
                        mount_point: "/".into(),
                        device: "/dev/nvme0n1p2".into(),
                        filesystem_type: "ext4".into(),
                        used_bytes: 61 << 30,
                        total_bytes: 447 << 30,
                    },
                    DiskMetric {
                        mount_point: "/var/lib/agentenv".into(),
                        device: "/dev/md0".into(),
                        filesystem_type: "xfs".into(),
                        used_bytes: (total as u64) * (3 << 30),
                        total_bytes: 14 << 40,
                    },
                ],
                sandbox_count: running as u32,
                sandbox_starting_count: rng.random_range(0..3),
                create_successes: created,
                create_fails: created / 500,
                reported_at_unix_ms: std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_millis() as i64),
                paused_sandbox_count: paused as u32,
                paused_allocated_cpu: 2 * paused as u32,
                paused_allocated_memory_bytes: (paused as u64) << 30,
                pooled_sandbox_count: 2,
                pooled_allocated_cpu: 2,
                pooled_allocated_memory_bytes: 1 << 30,
                pooled_by_template: HashMap::from([("base".into(), 2)]),
            }),
            sandbox_ids: ids,
            p2p_endpoint: Some(P2pEndpoint {
                backend: "http".into(),
                address: format!("{}:9400", &endpoint(i)[7..endpoint(i).len() - 5]),
            }),
        }
    }

    /// A sandbox the gateway just created on `node_id`: listed from its next heartbeat.
    fn created(&self, node_id: &str, id: String) {
        if let Some(n) = node_index(node_id).and_then(|i| self.nodes.get(i)) {
            let mut n = n.lock();
            n.roster.push_back(id);
            n.created += 1;
        }
    }

    /// A random live sandbox id, as a client would address.
    fn any_sandbox(&self) -> Option<String> {
        let mut rng = rand::rng();
        let n = self.nodes[rng.random_range(0..self.nodes.len())].lock();
        let skip = n.roster.len().saturating_sub(self.per_node);
        let live = n.roster.len() - skip;
        (live > 0).then(|| n.roster[skip + rng.random_range(0..live)].clone())
    }
}

/// Latencies (µs) and counts of one kind of call.
pub struct Series {
    pub hist: Histogram<u64>,
    pub ok: u64,
    pub errors: u64,
    pub not_found: u64,
    pub dropped: u64,
    pub last_error: Option<String>,
}

impl Default for Series {
    fn default() -> Self {
        Self {
            hist: Histogram::new_with_bounds(1, 120_000_000, 3).expect("histogram bounds"),
            ok: 0,
            errors: 0,
            not_found: 0,
            dropped: 0,
            last_error: None,
        }
    }
}

impl Series {
    fn done(&mut self, started: Instant, result: Result<(), tonic::Status>) {
        match result {
            Ok(()) => {
                self.ok += 1;
                let _ = self
                    .hist
                    .record((started.elapsed().as_micros() as u64).max(1));
            }
            Err(s) if s.code() == tonic::Code::NotFound => self.not_found += 1,
            Err(s) => {
                self.errors += 1;
                self.last_error = Some(format!("{:?}: {}", s.code(), s.message()));
            }
        }
    }

    /// The latency at `q` in milliseconds.
    pub fn ms(&self, q: f64) -> f64 {
        self.hist.value_at_quantile(q) as f64 / 1000.0
    }
}

type Shared = Arc<Mutex<Series>>;

/// What the measured phase recorded.
#[derive(Default)]
pub struct Recorded {
    pub heartbeat: Shared,
    pub schedule: Shared,
    pub record: Shared,
    pub lookup: Shared,
    pub health: Shared,
}

/// Rates of the gateway's traffic during the measured phase.
#[derive(Clone, Copy)]
pub struct Traffic {
    pub interval: Duration,
    pub creates_per_sec: u64,
    pub lookups_per_sec: u64,
}

/// Sends one heartbeat per node, `concurrency` at a time, as fast as they go.
/// Returns the heartbeats refused and the first refusal.
pub async fn load_all(
    fleet: &Arc<Fleet>,
    node_channels: &[Channel],
    concurrency: usize,
) -> (u64, Option<String>) {
    use futures::StreamExt;
    let failures = futures::stream::iter(0..fleet.len())
        .map(|i| {
            let mut client = SchedulerClient::new(node_channels[i % node_channels.len()].clone());
            let req = fleet.heartbeat(i);
            async move { client.heartbeat(req).await.err() }
        })
        .buffer_unordered(concurrency)
        .filter_map(|e| async move { e })
        .collect::<Vec<_>>()
        .await;
    let first = failures
        .first()
        .map(|s| format!("{:?}: {}", s.code(), s.message()));
    (failures.len() as u64, first)
}

/// LookupNode for `samples` random roster ids; returns how many were found.
pub async fn check_bindings(fleet: &Fleet, gateway: &[Channel], samples: usize) -> usize {
    let mut client = SchedulerClient::new(gateway[0].clone());
    let mut found = 0;
    for _ in 0..samples {
        let Some(id) = fleet.any_sandbox() else {
            continue;
        };
        if client
            .lookup_node(LookupNodeRequest { sandbox_id: id })
            .await
            .is_ok()
        {
            found += 1;
        }
    }
    found
}

/// Runs the measured phase for `duration`: every node heartbeats at its
/// interval (the first beats spread evenly over one interval, as nodes that
/// started at different times), while the gateway creates and looks up.
pub async fn measure(
    fleet: &Arc<Fleet>,
    node_channels: &[Channel],
    gateway: &[Channel],
    gateway_rt: &tokio::runtime::Handle,
    traffic: Traffic,
    duration: Duration,
) -> Recorded {
    let rec = Recorded::default();
    let stop = Arc::new(AtomicBool::new(false));
    let start = tokio::time::Instant::now();
    let mut tasks = Vec::new();
    let n = fleet.len();
    for i in 0..n {
        let offset = traffic.interval.mul_f64(i as f64 / n as f64);
        let mut client = SchedulerClient::new(node_channels[i % node_channels.len()].clone());
        let (fleet, stop, series) = (fleet.clone(), stop.clone(), rec.heartbeat.clone());
        tasks.push(tokio::spawn(async move {
            let mut tick = tokio::time::interval_at(start + offset, traffic.interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                let req = fleet.heartbeat(i);
                let t = Instant::now();
                let r = client.heartbeat(req).await.map(|_| ());
                series.lock().done(t, r);
            }
        }));
    }
    let creates = {
        let (fleet, gateway, schedule, record) = (
            fleet.clone(),
            gateway.to_vec(),
            rec.schedule.clone(),
            rec.record.clone(),
        );
        open_loop(
            gateway_rt,
            traffic.creates_per_sec,
            stop.clone(),
            schedule.clone(),
            move |k| {
                let mut client = SchedulerClient::new(gateway[k % gateway.len()].clone());
                let (fleet, schedule, record) = (fleet.clone(), schedule.clone(), record.clone());
                async move {
                    let hint = ScheduleRequestHint {
                        kind: Some(schedule_request_hint::Kind::NewSandbox(NewSandboxHint {
                            metadata: HashMap::from([("template".into(), "base".into())]),
                            template_id: "base".into(),
                            poolable: true,
                        })),
                    };
                    let t = Instant::now();
                    let node = match client.schedule(ScheduleRequest { hint: Some(hint) }).await {
                        Ok(r) => {
                            schedule.lock().done(t, Ok(()));
                            r.into_inner().node.unwrap_or_default()
                        }
                        Err(s) => return schedule.lock().done(t, Err(s)),
                    };
                    let id = sandbox_id();
                    let t = Instant::now();
                    let r = client
                        .record_assignment(RecordAssignmentRequest {
                            sandbox_id: id.clone(),
                            node: Some(node.clone()),
                        })
                        .await
                        .map(|_| ());
                    let ok = r.is_ok();
                    record.lock().done(t, r);
                    if ok {
                        fleet.created(&node.node_id, id);
                    }
                }
            },
        )
    };
    let lookups = {
        let (fleet, gateway, series) = (fleet.clone(), gateway.to_vec(), rec.lookup.clone());
        open_loop(
            gateway_rt,
            traffic.lookups_per_sec,
            stop.clone(),
            series.clone(),
            move |k| {
                let mut client = SchedulerClient::new(gateway[k % gateway.len()].clone());
                let (id, series) = (fleet.any_sandbox(), series.clone());
                async move {
                    let Some(id) = id else { return };
                    let t = Instant::now();
                    let r = client
                        .lookup_node(LookupNodeRequest { sandbox_id: id })
                        .await
                        .map(|_| ());
                    series.lock().done(t, r);
                }
            },
        )
    };
    // The reference: a do-nothing call on the same connections, at the create rate.
    let health = {
        let (gateway, series) = (gateway.to_vec(), rec.health.clone());
        open_loop(
            gateway_rt,
            traffic.creates_per_sec,
            stop.clone(),
            series.clone(),
            move |k| {
                let mut client = HealthClient::new(gateway[k % gateway.len()].clone());
                let series = series.clone();
                async move {
                    let t = Instant::now();
                    let r = client
                        .check(HealthCheckRequest {
                            service: String::new(),
                        })
                        .await
                        .map(|_| ());
                    series.lock().done(t, r);
                }
            },
        )
    };
    tokio::time::sleep(duration).await;
    stop.store(true, Ordering::Relaxed);
    for t in [creates, lookups, health] {
        let _ = t.await;
    }
    for t in tasks {
        t.abort();
    }
    rec
}

/// Starts `make(k)` `per_sec` times a second (k counts up) without waiting
/// for earlier calls, until `stop`; waits for the calls in flight. Runs on `rt`
/// (the gateway's runtime, apart from the nodes' heartbeats, as a gateway is
/// apart from the nodes).
fn open_loop<F, Fut>(
    rt: &tokio::runtime::Handle,
    per_sec: u64,
    stop: Arc<AtomicBool>,
    series: Shared,
    make: F,
) -> tokio::task::JoinHandle<()>
where
    F: Fn(usize) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    rt.spawn(async move {
        if per_sec == 0 {
            return;
        }
        let permits = Arc::new(Semaphore::new(MAX_IN_FLIGHT));
        let started = Instant::now();
        let sent = AtomicU64::new(0);
        let mut tick = tokio::time::interval(Duration::from_millis(1));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        while !stop.load(Ordering::Relaxed) {
            tick.tick().await;
            let due = (started.elapsed().as_secs_f64() * per_sec as f64) as u64;
            while sent.load(Ordering::Relaxed) < due {
                let k = sent.fetch_add(1, Ordering::Relaxed) as usize;
                match permits.clone().try_acquire_owned() {
                    Ok(permit) => {
                        let call = make(k);
                        tokio::spawn(async move {
                            call.await;
                            drop(permit);
                        });
                    }
                    Err(_) => series.lock().dropped += 1,
                }
            }
        }
        let _ = permits.acquire_many(MAX_IN_FLIGHT as u32).await;
    })
}
