//! The heartbeat reporter against a real scheduler served on loopback.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use agentenv_core::config::{NodeConfig, SchedulerConfig};
use agentenv_core::proto::scheduler_v1::scheduler_client::SchedulerClient;
use agentenv_core::proto::scheduler_v1::*;
use agentenv_node::reporter::{NodeSource, ReporterConfig, ReporterHandle, SandboxUsage};
use agentenv_sched::Scheduler;
use agentenv_testkit::eventually;
use parking_lot::Mutex;
use tokio::net::TcpListener;
use tokio::sync::oneshot;

struct RunningScheduler {
    addr: std::net::SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
    metrics: agentenv_core::metrics::SharedRegistry,
}

impl RunningScheduler {
    async fn stop(mut self) {
        let _ = self.stop.take().unwrap().send(());
        let _ = self.task.await;
    }
}

async fn start_scheduler(listener: TcpListener) -> RunningScheduler {
    let config = SchedulerConfig {
        nodes: ["node-a", "node-b"]
            .iter()
            .map(|id| NodeConfig {
                id: id.to_string(),
                endpoint: format!("http://{id}.test:8000"),
            })
            .collect(),
        ..SchedulerConfig::default()
    };
    let scheduler = Scheduler::builder(config).build().unwrap();
    let metrics = scheduler.metrics_registry();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        scheduler
            .serve(listener, async {
                let _ = stopped.await;
            })
            .await
            .unwrap();
    });
    RunningScheduler {
        addr,
        stop: Some(stop),
        task,
        metrics,
    }
}

#[derive(Default)]
struct FakeNode {
    roster: Mutex<Vec<String>>,
    cpu_config: String,
    cluster_configs: AtomicUsize,
}

impl NodeSource for FakeNode {
    fn sandbox_ids(&self) -> Vec<String> {
        self.roster.lock().clone()
    }
    fn sandbox_usage(&self) -> SandboxUsage {
        SandboxUsage {
            running: self.roster.lock().len() as u32,
            ..Default::default()
        }
    }
    fn cpu_config_json(&self) -> String {
        self.cpu_config.clone()
    }
    fn set_cluster_cpu_config(&self, _json: &str) {
        self.cluster_configs.fetch_add(1, Ordering::SeqCst);
    }
}

fn reporter_config(addr: std::net::SocketAddr, node: &str) -> ReporterConfig {
    let mut c = ReporterConfig::new(format!("http://{addr}"), node, Duration::from_millis(100));
    c.service_instance_id = format!("{node}-instance");
    c.first_delay = Duration::from_millis(10);
    c.max_backoff = Duration::from_millis(400);
    c.rpc_timeout = Duration::from_secs(2);
    c
}

/// How long a test waits for the reporter or the scheduler to get somewhere.
const WAIT: Duration = Duration::from_secs(10);

async fn client(addr: std::net::SocketAddr) -> SchedulerClient<tonic::transport::Channel> {
    SchedulerClient::connect(format!("http://{addr}"))
        .await
        .unwrap()
}

async fn owner(addr: std::net::SocketAddr, sandbox: &str) -> Option<String> {
    client(addr)
        .await
        .lookup_node(LookupNodeRequest {
            sandbox_id: sandbox.into(),
        })
        .await
        .ok()
        .and_then(|r| r.into_inner().node)
        .map(|n| n.node_id)
}

#[tokio::test]
async fn heartbeats_carry_the_roster_so_the_scheduler_routes_to_the_node() {
    let sched = start_scheduler(TcpListener::bind("127.0.0.1:0").await.unwrap()).await;
    let node = Arc::new(FakeNode::default());
    *node.roster.lock() = vec!["sbx-1".into(), "sbx-2".into()];
    let data = tempfile::tempdir().unwrap();
    let mut config = reporter_config(sched.addr, "node-a");
    config.host = Arc::new(agentenv_node::observe::HostSampler::new(vec![
        data.path().to_path_buf(),
    ]));
    let reporter = ReporterHandle::start(config, node.clone()).unwrap();
    let addr = sched.addr;
    eventually("sbx-1 bound to node-a", WAIT, || async move {
        owner(addr, "sbx-1").await.as_deref() == Some("node-a")
    })
    .await;
    let observed = client(addr)
        .await
        .get_node(GetNodeRequest {
            node_id: "node-a".into(),
            cluster_id: String::new(),
        })
        .await
        .unwrap()
        .into_inner()
        .node
        .unwrap();
    let snap = observed.snapshot.unwrap();
    assert_eq!(snap.status, NodeStatus::Ready as i32);
    assert_eq!(snap.sandbox_count, 2);
    assert!(
        snap.cpu_count > 0 && snap.memory_total_bytes > 0,
        "host metrics sampled"
    );
    assert_eq!(snap.disks.len(), 1, "the data directory's file system");
    let disk = &snap.disks[0];
    assert!(
        disk.total_bytes > 0 && disk.total_bytes >= disk.used_bytes,
        "{disk:?}"
    );
    assert!(
        data.path().starts_with(&disk.mount_point) && !disk.filesystem_type.is_empty(),
        "{disk:?}"
    );
    assert_eq!(observed.service_instance_id, "node-a-instance");

    // A sandbox deleted on the node disappears with the next roster.
    node.roster.lock().retain(|s| s != "sbx-1");
    eventually("sbx-1 unbound", WAIT, || async move {
        owner(addr, "sbx-1").await.is_none()
    })
    .await;
    assert_eq!(owner(addr, "sbx-2").await.as_deref(), Some("node-a"));
    assert!(reporter.status().successes >= 2);
    assert_eq!(reporter.status().consecutive_failures, 0);

    // Shutting down unregisters: the bindings go at once.
    reporter.shutdown().await;
    assert_eq!(owner(addr, "sbx-2").await, None);
    sched.stop().await;
}

#[tokio::test]
async fn an_unlisted_node_id_is_reported_with_the_fix() {
    let sched = start_scheduler(TcpListener::bind("127.0.0.1:0").await.unwrap()).await;
    let reporter = ReporterHandle::start(
        reporter_config(sched.addr, "node-z"),
        Arc::new(FakeNode::default()),
    )
    .unwrap();
    let status = || reporter.status();
    eventually("a rejected heartbeat", WAIT, || async {
        status().failures >= 2
    })
    .await;
    let err = status().last_error.unwrap();
    assert!(err.contains("AENV_NODE_ID=\"node-z\""), "{err}");
    assert!(err.contains("scheduler.nodes"), "{err}");
    assert!(err.contains("reload the scheduler"), "{err}");
    assert_eq!(status().successes, 0);
    reporter.shutdown().await;
    sched.stop().await;
}

#[tokio::test]
async fn an_unreachable_scheduler_is_retried_until_it_comes_up() {
    // Reserve a port, then free it: nothing listens there yet.
    let port = TcpListener::bind("127.0.0.1:0")
        .await
        .unwrap()
        .local_addr()
        .unwrap();
    let reporter = ReporterHandle::start(
        reporter_config(port, "node-a"),
        Arc::new(FakeNode::default()),
    )
    .unwrap();
    eventually("failed heartbeats", WAIT, || async {
        reporter.status().consecutive_failures >= 2
    })
    .await;
    assert!(
        reporter
            .status()
            .last_error
            .unwrap()
            .contains(&port.to_string())
    );
    let sched = start_scheduler(TcpListener::bind(port).await.unwrap()).await;
    eventually("a heartbeat after the scheduler started", WAIT, || async {
        reporter.status().successes >= 1
    })
    .await;
    assert_eq!(reporter.status().consecutive_failures, 0);
    reporter.shutdown().await;
    sched.stop().await;
}

fn cpu_config() -> String {
    r#"{"kvm_capabilities":[],"cpuid_modifiers":[{"leaf":"0x1","subleaf":"0x0","flags":0,"modifiers":[{"register":"ecx","bitmap":"0b00000000000000000000000000000101"}]}],"msr_modifiers":[]}"#.into()
}

#[tokio::test]
async fn a_restarted_scheduler_gets_the_cpu_config_again() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let sched = start_scheduler(listener).await;
    let node = Arc::new(FakeNode {
        cpu_config: cpu_config(),
        ..Default::default()
    });
    let reporter = ReporterHandle::start(reporter_config(addr, "node-a"), node.clone()).unwrap();
    let n = node.clone();
    eventually("the first cluster CPU template", WAIT, || {
        let n = n.clone();
        async move { n.cluster_configs.load(Ordering::SeqCst) == 1 }
    })
    .await;
    sched.stop().await;
    let sched = start_scheduler(TcpListener::bind(addr).await.unwrap()).await;
    let n = node.clone();
    eventually(
        "the template again from the restarted scheduler",
        WAIT,
        || {
            let n = n.clone();
            async move { n.cluster_configs.load(Ordering::SeqCst) == 2 }
        },
    )
    .await;
    reporter.shutdown().await;
    sched.stop().await;
}

#[tokio::test]
async fn sandbox_events_are_batched_to_the_scheduler() {
    let sched = start_scheduler(TcpListener::bind("127.0.0.1:0").await.unwrap()).await;
    let reporter = ReporterHandle::start(
        reporter_config(sched.addr, "node-a"),
        Arc::new(FakeNode::default()),
    )
    .unwrap();
    for i in 0..5 {
        reporter.report_event(SandboxEvent {
            sandbox_id: format!("sbx-{i}"),
            event_type: SandboxEventType::Create as i32,
            requested_cpu: 2,
            requested_memory_bytes: 512 << 20,
            requested_disk_bytes: 0,
        });
    }
    eventually("five events sent", WAIT, || async {
        reporter.status().events_sent == 5
    })
    .await;
    let text = agentenv_core::metrics::render(&sched.metrics.lock());
    assert!(
        text.contains(
            r#"agentenv_scheduler_rpc_duration_seconds_count{rpc="ReportSandboxEvent",status="ok"}"#
        ),
        "{text}"
    );
    reporter.shutdown().await;
    sched.stop().await;
}
