//! Heartbeats from the node to the scheduler.
//!
//! The first heartbeat goes out shortly after start, then one every interval.
//! Each carries the node's full sandbox roster (paused sandboxes included),
//! host and sandbox resource usage, and, while the scheduler wants it, the
//! node's CPU config. Failures back off exponentially up to a cap; success
//! resets the period. Sandbox events are batched and sent as they come. On
//! shutdown the node unregisters, so the scheduler drops its bindings at once.

use std::collections::BTreeMap;
use std::sync::Arc;

use agentenv_core::cluster_auth::{SchedulerLink, SendClusterToken};
use agentenv_core::proto::scheduler_v1::scheduler_client::SchedulerClient as GrpcClient;
use agentenv_core::proto::scheduler_v1::{
    DiskMetric, HeartbeatRequest, MachineInfo, NodeSnapshot, NodeStatus, ReportSandboxEventRequest,
    SandboxEvent, UnregisterNodeRequest,
};
use parking_lot::Mutex;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio::time::{Duration, sleep, timeout};
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};

use crate::observe::HostSampler;

/// The scheduler connection: every call carries the cluster credential.
type SchedulerClient = GrpcClient<InterceptedService<Channel, SendClusterToken>>;

/// The scheduler's rejection of an unlisted node contains this text.
const NOT_IN_NODE_LIST: &str = "node is not in scheduler node list";

/// The reporter could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum ReporterError {
    #[error(
        "AENV_OBSERVABILITY_SCHEDULER_ENDPOINT must be a URL with a scheme, e.g. http://scheduler:9090 (got {0:?})"
    )]
    Endpoint(String),
    #[error("AENV_NODE_ID is empty: set it to this node's id in the scheduler's node list")]
    NodeId,
}

/// Who the node is and where its scheduler listens.
#[derive(Debug, Clone)]
pub struct ReporterConfig {
    /// The scheduler's gRPC address as a URL: `http://scheduler:9090`.
    pub endpoint: String,
    pub node_id: String,
    pub cluster_id: String,
    pub service_instance_id: String,
    pub version: String,
    pub commit: String,
    /// Time between heartbeats while they succeed.
    pub interval: Duration,
    /// Delay before the first heartbeat.
    pub first_delay: Duration,
    /// Upper bound of the failure backoff.
    pub max_backoff: Duration,
    /// Timeout of each RPC.
    pub rpc_timeout: Duration,
    /// The host's CPU, memory and file systems (the node's data directory's): shared
    /// with `GET /nodes`.
    pub host: Arc<HostSampler>,
    /// The cluster credential sent with every call (`AENV_CLUSTER_TOKEN_FILE`) and
    /// the TLS of `https://` endpoints.
    pub link: SchedulerLink,
}

impl ReporterConfig {
    /// Defaults of a production node: first beat after 100 ms, then every
    /// `interval`, backoff capped at 60 s, 10 s per RPC.
    pub fn new(
        endpoint: impl Into<String>,
        node_id: impl Into<String>,
        interval: Duration,
    ) -> Self {
        Self {
            endpoint: endpoint.into(),
            node_id: node_id.into(),
            cluster_id: "00000000-0000-0000-0000-000000000000".into(),
            service_instance_id: String::new(),
            version: env!("CARGO_PKG_VERSION").into(),
            commit: option_env!("AENV_GIT_COMMIT").unwrap_or("unknown").into(),
            interval,
            first_delay: Duration::from_millis(100),
            max_backoff: Duration::from_secs(60),
            rpc_timeout: Duration::from_secs(10),
            host: Arc::new(HostSampler::new(Vec::new())),
            link: SchedulerLink::default(),
        }
    }
}

/// Sandbox counts and allocations of this node.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SandboxUsage {
    pub running: u32,
    pub starting: u32,
    pub paused: u32,
    pub allocated_cpu: u32,
    pub allocated_memory_bytes: u64,
    pub paused_allocated_cpu: u32,
    pub paused_allocated_memory_bytes: u64,
    /// Started sandboxes waiting in pools for a create.
    pub pooled: u32,
    pub pooled_allocated_cpu: u32,
    pub pooled_allocated_memory_bytes: u64,
    /// Pooled sandboxes per template as a create names it (templates with none left
    /// out), for the scheduler to send creates where a pool can serve them.
    pub pooled_by_template: BTreeMap<String, u32>,
    pub create_successes: u64,
    pub create_fails: u64,
}

/// What the reporter needs from the node.
pub trait NodeSource: Send + Sync + 'static {
    /// Every sandbox the node holds, paused ones included.
    fn sandbox_ids(&self) -> Vec<String>;
    /// Counts and allocations of the node's sandboxes.
    fn sandbox_usage(&self) -> SandboxUsage;
    /// This host's CPU config (JSON), empty when the node has none.
    fn cpu_config_json(&self) -> String {
        String::new()
    }
    /// The cluster CPU template the scheduler computed.
    fn set_cluster_cpu_config(&self, _json: &str) {}
}

/// How the reporter is doing, for health endpoints and tests.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReporterStatus {
    pub successes: u64,
    pub failures: u64,
    pub consecutive_failures: u64,
    pub last_error: Option<String>,
    pub events_sent: u64,
    pub events_dropped: u64,
}

/// The failure backoff after `backoff`: doubled, capped.
pub fn next_backoff(backoff: Duration, max: Duration) -> Duration {
    backoff.saturating_mul(2).min(max)
}

/// A running reporter.
pub struct ReporterHandle {
    status: Arc<Mutex<ReporterStatus>>,
    events: mpsc::Sender<SandboxEvent>,
    stop: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
    client: SchedulerClient,
    config: ReporterConfig,
}

/// Capacity of the sandbox event queue; events beyond it are dropped.
const EVENT_QUEUE: usize = 1024;

impl ReporterHandle {
    /// Starts heartbeats and event reporting for `source`.
    pub fn start(
        config: ReporterConfig,
        source: Arc<dyn NodeSource>,
    ) -> Result<Self, ReporterError> {
        let endpoint = config.endpoint.trim().to_string();
        if !(endpoint.starts_with("http://") || endpoint.starts_with("https://")) {
            return Err(ReporterError::Endpoint(config.endpoint.clone()));
        }
        if config.node_id.trim().is_empty() {
            return Err(ReporterError::NodeId);
        }
        let mut channel = Endpoint::from_shared(endpoint.clone())
            .map_err(|_| ReporterError::Endpoint(config.endpoint.clone()))?;
        if endpoint.starts_with("https://") {
            let tls = config.link.tls.clone().unwrap_or_default();
            channel = channel
                .tls_config(tls)
                .map_err(|_| ReporterError::Endpoint(config.endpoint.clone()))?;
        }
        let channel = channel
            .tcp_nodelay(true)
            .connect_timeout(config.rpc_timeout)
            .connect_lazy();
        let client =
            GrpcClient::with_interceptor(channel, SendClusterToken(config.link.token.clone()));
        let status = Arc::new(Mutex::new(ReporterStatus::default()));
        let (stop, stop_rx) = watch::channel(false);
        let (events, events_rx) = mpsc::channel(EVENT_QUEUE);
        let heartbeats = tokio::spawn(heartbeat_loop(
            config.clone(),
            client.clone(),
            source,
            status.clone(),
            stop_rx.clone(),
        ));
        let event_task = tokio::spawn(event_loop(
            config.clone(),
            client.clone(),
            events_rx,
            status.clone(),
            stop_rx,
        ));
        Ok(Self {
            status,
            events,
            stop,
            tasks: vec![heartbeats, event_task],
            client,
            config,
        })
    }

    pub fn status(&self) -> ReporterStatus {
        self.status.lock().clone()
    }

    /// Queues a sandbox event; dropped (and counted) when the queue is full.
    pub fn report_event(&self, event: SandboxEvent) {
        if self.events.try_send(event).is_err() {
            self.status.lock().events_dropped += 1;
            tracing::warn!("sandbox event queue full; event dropped");
        }
    }

    /// Stops reporting and, if any heartbeat ever succeeded, unregisters the
    /// node (three tries).
    pub async fn shutdown(mut self) {
        let _ = self.stop.send(true);
        for t in self.tasks.drain(..) {
            let _ = t.await;
        }
        if self.status.lock().successes == 0 {
            return;
        }
        let req = UnregisterNodeRequest {
            node_id: self.config.node_id.clone(),
            service_instance_id: self.config.service_instance_id.clone(),
        };
        for (attempt, pause_ms) in [200u64, 400, 600].into_iter().enumerate() {
            match timeout(
                self.config.rpc_timeout,
                self.client.unregister_node(req.clone()),
            )
            .await
            {
                Ok(Ok(_)) => {
                    tracing::info!(node_id = %self.config.node_id, "unregistered from the scheduler");
                    return;
                }
                Ok(Err(e)) => {
                    tracing::warn!(attempt = attempt + 1, error = %e.message(), "unregister failed")
                }
                Err(_) => tracing::warn!(attempt = attempt + 1, "unregister timed out"),
            }
            sleep(Duration::from_millis(pause_ms)).await;
        }
    }
}

impl Drop for ReporterHandle {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// The host's processor as `/proc/cpuinfo` names its first one (`None`: not there).
#[derive(Debug, Clone, Default)]
pub struct CpuModel {
    /// `cpu family`.
    pub family: Option<String>,
    /// `model`.
    pub model: Option<String>,
    /// `model name`.
    pub name: Option<String>,
}

impl CpuModel {
    /// Reads `/proc/cpuinfo`.
    pub fn read() -> Self {
        Self::parse(&std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default())
    }

    fn parse(cpuinfo: &str) -> Self {
        let field = |name: &str| {
            cpuinfo
                .lines()
                .filter_map(|l| l.split_once(':'))
                .find(|(k, _)| k.trim() == name)
                .map(|(_, v)| v.trim().to_string())
        };
        Self {
            family: field("cpu family"),
            model: field("model"),
            name: field("model name"),
        }
    }
}

fn machine_info(cpu_config_json: String) -> MachineInfo {
    let cpu = CpuModel::read();
    let known = |v: Option<String>| v.unwrap_or_else(|| "unknown".into());
    MachineInfo {
        cpu_family: known(cpu.family),
        cpu_model: known(cpu.model),
        cpu_model_name: known(cpu.name),
        cpu_architecture: std::env::consts::ARCH.into(),
        cpu_config_json,
    }
}

async fn heartbeat_loop(
    config: ReporterConfig,
    mut client: SchedulerClient,
    source: Arc<dyn NodeSource>,
    status: Arc<Mutex<ReporterStatus>>,
    mut stop: watch::Receiver<bool>,
) {
    let mut delay = config.first_delay;
    let mut backoff = config.interval;
    let mut ever_succeeded = false;
    let mut cpu_config_wanted = true;
    loop {
        tokio::select! {
            _ = sleep(delay) => {}
            _ = stop.wait_for(|s| *s) => return,
        }
        let usage = source.sandbox_usage();
        let mut snapshot = NodeSnapshot {
            status: NodeStatus::Ready as i32,
            allocated_cpu: usage.allocated_cpu,
            allocated_memory_bytes: usage.allocated_memory_bytes,
            sandbox_count: usage.running,
            sandbox_starting_count: usage.starting,
            create_successes: usage.create_successes,
            create_fails: usage.create_fails,
            reported_at_unix_ms: crate::clock::now_ms() as i64,
            paused_sandbox_count: usage.paused,
            paused_allocated_cpu: usage.paused_allocated_cpu,
            paused_allocated_memory_bytes: usage.paused_allocated_memory_bytes,
            pooled_sandbox_count: usage.pooled,
            pooled_allocated_cpu: usage.pooled_allocated_cpu,
            pooled_allocated_memory_bytes: usage.pooled_allocated_memory_bytes,
            pooled_by_template: usage.pooled_by_template.into_iter().collect(),
            ..Default::default()
        };
        let host = config.host.sample();
        snapshot.cpu_percent = host.cpu_percent;
        snapshot.cpu_count = host.cpu_count;
        snapshot.memory_total_bytes = host.memory_total_bytes;
        snapshot.memory_used_bytes = host.memory_used_bytes;
        snapshot.disks = host
            .disks
            .into_iter()
            .map(|d| DiskMetric {
                mount_point: d.mount_point,
                device: d.device,
                filesystem_type: d.filesystem_type,
                used_bytes: d.used_bytes,
                total_bytes: d.total_bytes,
            })
            .collect();
        let send_cpu = !ever_succeeded || cpu_config_wanted;
        let req = HeartbeatRequest {
            node_id: config.node_id.clone(),
            cluster_id: config.cluster_id.clone(),
            service_instance_id: config.service_instance_id.clone(),
            version: config.version.clone(),
            commit: config.commit.clone(),
            machine_info: Some(machine_info(if send_cpu {
                source.cpu_config_json()
            } else {
                String::new()
            })),
            snapshot: Some(snapshot),
            sandbox_ids: source.sandbox_ids(),
            p2p_endpoint: None,
        };
        let result = timeout(config.rpc_timeout, client.heartbeat(req)).await;
        match result {
            Ok(Ok(resp)) => {
                let resp = resp.into_inner();
                if !resp.cpu_config_json.is_empty() {
                    source.set_cluster_cpu_config(&resp.cpu_config_json);
                }
                cpu_config_wanted = resp.cpu_config_wanted;
                if !ever_succeeded || status.lock().consecutive_failures > 0 {
                    tracing::info!(node_id = %config.node_id, scheduler = %config.endpoint, "heartbeats reach the scheduler");
                }
                ever_succeeded = true;
                let mut st = status.lock();
                st.successes += 1;
                st.consecutive_failures = 0;
                st.last_error = None;
                backoff = config.interval;
                delay = config.interval;
            }
            failed => {
                let mut unlisted = false;
                let message = match failed {
                    Ok(Err(s))
                        if s.code() == tonic::Code::InvalidArgument
                            && s.message().contains(NOT_IN_NODE_LIST) =>
                    {
                        let m = format!(
                            "the scheduler rejected this node: AENV_NODE_ID={:?} is not in its scheduler.nodes list; add {{\"id\": {:?}, \"endpoint\": \"http://<this host>:8000\"}} to the control-plane config and reload the scheduler (systemctl reload agentenv-scheduler, or SIGHUP), or set AENV_NODE_ID to a listed id",
                            config.node_id, config.node_id
                        );
                        // A reload may list it any moment: ask again at the
                        // heartbeat interval rather than backing off.
                        unlisted = true;
                        tracing::error!(scheduler = %config.endpoint, "{m}");
                        m
                    }
                    Ok(Err(s)) => {
                        let m = format!("heartbeat to {} failed: {}", config.endpoint, s.message());
                        tracing::warn!(retry_in = ?backoff, "{m}");
                        m
                    }
                    Err(_) => {
                        let m = format!(
                            "heartbeat to {} timed out after {:?}",
                            config.endpoint, config.rpc_timeout
                        );
                        tracing::warn!(retry_in = ?backoff, "{m}");
                        m
                    }
                    Ok(Ok(_)) => unreachable!("handled above"),
                };
                let mut st = status.lock();
                st.failures += 1;
                st.consecutive_failures += 1;
                st.last_error = Some(message);
                if unlisted {
                    delay = config.interval;
                } else {
                    delay = backoff;
                    backoff = next_backoff(backoff, config.max_backoff);
                }
            }
        }
    }
}

async fn event_loop(
    config: ReporterConfig,
    mut client: SchedulerClient,
    mut events: mpsc::Receiver<SandboxEvent>,
    status: Arc<Mutex<ReporterStatus>>,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        let first = tokio::select! {
            e = events.recv() => match e { Some(e) => e, None => return },
            _ = stop.wait_for(|s| *s) => return,
        };
        let mut batch = vec![first];
        while let Ok(e) = events.try_recv() {
            batch.push(e);
        }
        let n = batch.len() as u64;
        let req = ReportSandboxEventRequest {
            node_id: config.node_id.clone(),
            cluster_id: config.cluster_id.clone(),
            service_instance_id: config.service_instance_id.clone(),
            events: batch,
        };
        match timeout(config.rpc_timeout, client.report_sandbox_event(req)).await {
            Ok(Ok(_)) => status.lock().events_sent += n,
            other => {
                let why = match other {
                    Ok(Err(s)) => s.message().to_string(),
                    _ => "timed out".into(),
                };
                tracing::warn!(events = n, error = %why, "sandbox events not reported; dropped");
                status.lock().events_dropped += n;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_up_to_the_cap() {
        let max = Duration::from_secs(60);
        let mut b = Duration::from_secs(5);
        let mut seen = vec![b];
        for _ in 0..6 {
            b = next_backoff(b, max);
            seen.push(b);
        }
        let secs: Vec<u64> = seen.iter().map(|d| d.as_secs()).collect();
        assert_eq!(secs, [5, 10, 20, 40, 60, 60, 60]);
    }

    #[test]
    fn machine_info_reads_this_host() {
        let m = machine_info("{}".into());
        assert_eq!(m.cpu_architecture, std::env::consts::ARCH);
        assert!(!m.cpu_model_name.is_empty());
        assert_eq!(m.cpu_config_json, "{}");
    }

    #[test]
    fn cpu_model_is_the_first_processors() {
        let text = "processor\t: 0\ncpu family\t: 6\nmodel\t\t: 85\nmodel name\t: Xeon\n\nprocessor\t: 1\nmodel name\t: Other\n";
        let cpu = CpuModel::parse(text);
        assert_eq!(cpu.family.as_deref(), Some("6"));
        assert_eq!(cpu.model.as_deref(), Some("85"));
        assert_eq!(cpu.name.as_deref(), Some("Xeon"));
        assert!(CpuModel::parse("").name.is_none());
    }

    #[test]
    fn endpoints_without_a_scheme_are_refused() {
        struct Empty;
        impl NodeSource for Empty {
            fn sandbox_ids(&self) -> Vec<String> {
                Vec::new()
            }
            fn sandbox_usage(&self) -> SandboxUsage {
                SandboxUsage::default()
            }
        }
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let cfg = ReporterConfig::new("scheduler:9090", "node-a", Duration::from_secs(5));
            let e = ReporterHandle::start(cfg, Arc::new(Empty)).err().unwrap();
            assert!(e.to_string().contains("http://scheduler:9090"), "{e}");
            let cfg = ReporterConfig::new("http://scheduler:9090", " ", Duration::from_secs(5));
            assert!(matches!(
                ReporterHandle::start(cfg, Arc::new(Empty)),
                Err(ReporterError::NodeId)
            ));
        });
    }
}
