//! Embedding the scheduler in another Rust service with a custom placement.
//!
//! `BinPackByMemory` fills the node with the most memory already allocated
//! that still has room for the new sandbox, keeping other nodes empty (for
//! scale-down). The example builds a scheduler around it, serves scheduler.v1
//! on a loopback port for the rest of the cluster, and places sandboxes by
//! calling the service directly, in process.
//!
//! Run: `cargo run -p agentenv-sched --example sched_embedded`

use agentenv_core::config::{NodeConfig, SchedulerConfig};
use agentenv_core::proto::scheduler_v1::scheduler_server::Scheduler as _;
use agentenv_core::proto::scheduler_v1::{
    HeartbeatRequest, NewColdSandboxHint, NodeSnapshot, NodeStatus, ScheduleRequestHint,
    schedule_request_hint,
};
use agentenv_sched::{Candidate, Placement, Scheduler};

const MIB: u64 = 1 << 20;

/// Best fit by memory: the fullest node that still fits the request.
struct BinPackByMemory;

impl BinPackByMemory {
    fn requested_bytes(hint: Option<&ScheduleRequestHint>) -> u64 {
        match hint.and_then(|h| h.kind.as_ref()) {
            Some(schedule_request_hint::Kind::NewColdSandbox(c)) if c.memory_mb > 0 => {
                c.memory_mb * MIB
            }
            _ => 512 * MIB,
        }
    }
}

impl Placement for BinPackByMemory {
    fn name(&self) -> &str {
        "bin_pack_memory"
    }

    fn pick(&self, candidates: &[Candidate], hint: Option<&ScheduleRequestHint>) -> Option<usize> {
        let need = Self::requested_bytes(hint);
        candidates
            .iter()
            .enumerate()
            .filter_map(|(i, c)| {
                let s = &c.snapshot;
                let free = s
                    .memory_total_bytes
                    .saturating_sub(s.allocated_memory_bytes);
                (free >= need).then_some((i, free))
            })
            .min_by_key(|&(_, free)| free)
            .map(|(i, _)| i)
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let nodes = [("node-a", 16u64), ("node-b", 16), ("node-c", 16)];
    let config = SchedulerConfig {
        nodes: nodes
            .iter()
            .enumerate()
            .map(|(i, (id, _))| NodeConfig {
                id: id.to_string(),
                endpoint: format!("http://127.0.0.1:{}", 8001 + i),
            })
            .collect(),
        ..SchedulerConfig::default()
    };
    let scheduler = Scheduler::builder(config)
        .placement(BinPackByMemory)
        .build()?;
    let service = scheduler.service();

    // The rest of the cluster (nodes, gateways) reaches it over gRPC.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    println!("scheduler.v1 served on {}", listener.local_addr()?);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(async move {
        scheduler
            .serve(listener, async {
                let _ = stopped.await;
            })
            .await
    });

    // Nodes report what they have allocated; node-b is already half full.
    let mut allocated = [0u64, 8 * 1024 * MIB, 0];
    for (round, want_mb) in [2048u64, 4096, 2048, 4096, 8192, 1024]
        .into_iter()
        .enumerate()
    {
        for (i, (id, total_gib)) in nodes.iter().enumerate() {
            service
                .heartbeat(tonic::Request::new(HeartbeatRequest {
                    node_id: id.to_string(),
                    service_instance_id: format!("{id}-1"),
                    snapshot: Some(NodeSnapshot {
                        status: NodeStatus::Ready as i32,
                        memory_total_bytes: total_gib * 1024 * MIB,
                        allocated_memory_bytes: allocated[i],
                        ..Default::default()
                    }),
                    ..Default::default()
                }))
                .await?;
        }
        let hint = ScheduleRequestHint {
            kind: Some(schedule_request_hint::Kind::NewColdSandbox(
                NewColdSandboxHint {
                    memory_mb: want_mb,
                    ..Default::default()
                },
            )),
        };
        let node = service.schedule_node(Some(&hint))?;
        let i = nodes
            .iter()
            .position(|(id, _)| *id == node.node_id)
            .unwrap();
        allocated[i] += want_mb * MIB;
        println!(
            "sandbox {round}: {want_mb:>5} MiB -> {} (allocated now: {:?} GiB)",
            node.node_id,
            allocated.map(|b| b as f64 / (1024.0 * MIB as f64))
        );
    }
    let _ = stop.send(());
    server.await??;
    Ok(())
}
