//! The `scheduler.v1.Scheduler` gRPC service.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::SystemTime;

use agentenv_core::config::NodeResourceLimit;
use agentenv_core::metrics::grpc_status_label;
use agentenv_core::proto::scheduler_v1::scheduler_server::Scheduler as SchedulerRpc;
use agentenv_core::proto::scheduler_v1::*;
use parking_lot::Mutex;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::histogram::Histogram;
use tokio::time::Instant;
use tonic::{Request, Response, Status};

use crate::artifacts::{ArtifactKey, ArtifactStore};
use crate::bindings::BindingStore;
use crate::metrics::{RpcLabels, ScheduleLabels, SchedulerMetrics, StrategyLabel};
use crate::placement::Placement;
use crate::registry::{NodeRegistry, P2pQuery, RegistryError};

const NOT_IN_NODE_LIST: &str = "node is not in scheduler node list";
const STORE_UNAVAILABLE: &str = "binding store unavailable";

/// The scheduler's gRPC service. Cheap to clone; every clone shares state.
#[derive(Clone)]
pub struct SchedulerService {
    inner: Arc<Inner>,
}

pub(crate) struct Inner {
    /// `None` in query-only mode, where only `LookupNode` is served.
    pub(crate) registry: Option<Arc<dyn NodeRegistry>>,
    pub(crate) store: Arc<dyn BindingStore>,
    pub(crate) placement: Arc<dyn Placement>,
    pub(crate) artifacts: Mutex<ArtifactStore>,
    pub(crate) limit: Option<NodeResourceLimit>,
    pub(crate) metrics: SchedulerMetrics,
    pub(crate) schedule_handles: ScheduleHandles,
}

/// The Schedule metrics of this service's strategy, resolved once.
pub(crate) struct ScheduleHandles {
    ok: Histogram,
    unavailable: Histogram,
    assignments: Counter,
}

impl ScheduleHandles {
    pub(crate) fn new(metrics: &SchedulerMetrics, strategy: &str) -> Self {
        let duration = |status| {
            metrics
                .schedule_duration
                .get_or_create(&ScheduleLabels {
                    strategy: strategy.to_string(),
                    status,
                })
                .clone()
        };
        Self {
            ok: duration("ok"),
            unavailable: duration("unavailable"),
            assignments: metrics
                .schedule_assignments
                .get_or_create(&StrategyLabel {
                    strategy: strategy.to_string(),
                })
                .clone(),
        }
    }
}

fn unix_ms() -> i64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// A store failure for the caller. The store logs when failures start and
/// stop; each one is logged here at debug level only.
fn store_unavailable(e: impl std::fmt::Display) -> Status {
    tracing::debug!(error = %e, "binding store failed");
    Status::unavailable(STORE_UNAVAILABLE)
}

impl SchedulerService {
    pub(crate) fn new(inner: Inner) -> Self {
        Self {
            inner: Arc::new(inner),
        }
    }

    /// The node registry (absent in query-only mode).
    pub fn registry(&self) -> Option<&Arc<dyn NodeRegistry>> {
        self.inner.registry.as_ref()
    }

    /// The binding store.
    pub fn binding_store(&self) -> &Arc<dyn BindingStore> {
        &self.inner.store
    }

    pub(crate) fn metrics(&self) -> &SchedulerMetrics {
        &self.inner.metrics
    }

    fn registry_or_unimplemented(&self, rpc: &str) -> Result<&Arc<dyn NodeRegistry>, Status> {
        self.inner.registry.as_ref().ok_or_else(|| {
            Status::unimplemented(format!(
                "{rpc} is not served by a query-only scheduler; send it to the primary"
            ))
        })
    }

    fn record<T>(
        &self,
        rpc: &'static str,
        started: std::time::Instant,
        result: Result<T, Status>,
    ) -> Result<Response<T>, Status> {
        let code = result
            .as_ref()
            .map_or_else(|s| s.code(), |_| tonic::Code::Ok);
        self.inner
            .metrics
            .rpc_duration
            .get_or_create(&RpcLabels {
                rpc,
                status: grpc_status_label(code),
            })
            .observe(started.elapsed().as_secs_f64());
        result.map(Response::new)
    }

    /// Places a new sandbox (the Schedule RPC without gRPC around it).
    pub fn schedule_node(&self, hint: Option<&ScheduleRequestHint>) -> Result<Node, Status> {
        let registry = self.registry_or_unimplemented("Schedule")?;
        let started = std::time::Instant::now();
        let picked = registry.pick(
            Instant::now(),
            self.inner.limit.as_ref(),
            &*self.inner.placement,
            hint,
        );
        let h = &self.inner.schedule_handles;
        let elapsed = started.elapsed().as_secs_f64();
        match picked {
            Some(node) => {
                h.ok.observe(elapsed);
                h.assignments.inc();
                Ok(node)
            }
            None => {
                h.unavailable.observe(elapsed);
                Err(Status::unavailable("no nodes available"))
            }
        }
    }

    async fn lookup(&self, req: LookupNodeRequest) -> Result<LookupNodeResponse, Status> {
        let id = req.sandbox_id.trim();
        if id.is_empty() {
            return Err(Status::invalid_argument("sandbox_id is required"));
        }
        match self.inner.store.get(id, Instant::now()).await {
            Ok(Some(node)) => Ok(LookupNodeResponse { node: Some(node) }),
            Ok(None) => Err(Status::not_found("sandbox assignment not found")),
            Err(e) => Err(store_unavailable(e)),
        }
    }

    async fn record_assignment_inner(
        &self,
        req: RecordAssignmentRequest,
    ) -> Result<RecordAssignmentResponse, Status> {
        let registry = self.registry_or_unimplemented("RecordAssignment")?;
        let id = req.sandbox_id.trim();
        if id.is_empty() {
            return Err(Status::invalid_argument("sandbox_id is required"));
        }
        let node = req.node.unwrap_or_default();
        if node.node_id.trim().is_empty() || node.endpoint.trim().is_empty() {
            return Err(Status::invalid_argument(
                "node_id and endpoint are required",
            ));
        }
        if !registry.contains(&node) {
            return Err(Status::invalid_argument(NOT_IN_NODE_LIST));
        }
        self.inner
            .store
            .record(id, &node, Instant::now())
            .await
            .map_err(store_unavailable)?;
        Ok(RecordAssignmentResponse {})
    }

    async fn heartbeat_inner(&self, req: HeartbeatRequest) -> Result<HeartbeatResponse, Status> {
        let registry = self.registry_or_unimplemented("Heartbeat")?;
        if req.node_id.trim().is_empty() || req.service_instance_id.trim().is_empty() {
            return Err(Status::invalid_argument(
                "node_id and service_instance_id are required",
            ));
        }
        let now = Instant::now();
        let outcome = registry
            .heartbeat(&req, now, unix_ms())
            .map_err(|e| match e {
                RegistryError::UnknownNode => Status::invalid_argument(NOT_IN_NODE_LIST),
                other => {
                    tracing::error!(error = %other, "node registry heartbeat failed");
                    Status::internal("node registry heartbeat failed")
                }
            })?;
        self.inner
            .store
            .reconcile_node(&outcome.node, &req.sandbox_ids, now)
            .await
            .map_err(store_unavailable)?;
        Ok(HeartbeatResponse {
            cpu_config_json: outcome.cpu_config_json,
            cpu_config_wanted: outcome.cpu_config_wanted,
        })
    }

    async fn unregister_inner(
        &self,
        req: UnregisterNodeRequest,
    ) -> Result<UnregisterNodeResponse, Status> {
        let registry = self.registry_or_unimplemented("UnregisterNode")?;
        let node_id = req.node_id.trim();
        let instance = req.service_instance_id.trim();
        if node_id.is_empty() || instance.is_empty() {
            return Err(Status::invalid_argument(
                "node_id and service_instance_id are required",
            ));
        }
        registry
            .unregister(node_id, instance)
            .map_err(|_| Status::failed_precondition("service instance mismatch"))?;
        self.inner
            .store
            .forget_node(node_id)
            .await
            .map_err(store_unavailable)?;
        self.inner.artifacts.lock().forget_node(node_id);
        Ok(UnregisterNodeResponse {})
    }
}

fn artifact_key(cluster: &str, backend: &str, key: &str) -> ArtifactKey {
    ArtifactKey {
        cluster_id: cluster.trim().to_string(),
        backend: backend.trim().to_string(),
        key: key.trim().to_string(),
    }
}

fn all_present(fields: &[&str]) -> bool {
    fields.iter().all(|f| !f.trim().is_empty())
}

#[tonic::async_trait]
impl SchedulerRpc for SchedulerService {
    async fn schedule(
        &self,
        request: Request<ScheduleRequest>,
    ) -> Result<Response<ScheduleResponse>, Status> {
        let started = std::time::Instant::now();
        let req = request.into_inner();
        let result = self
            .schedule_node(req.hint.as_ref())
            .map(|node| ScheduleResponse { node: Some(node) });
        self.record("Schedule", started, result)
    }

    async fn list_nodes(
        &self,
        _: Request<ListNodesRequest>,
    ) -> Result<Response<ListNodesResponse>, Status> {
        let started = std::time::Instant::now();
        let result = self
            .registry_or_unimplemented("ListNodes")
            .map(|r| ListNodesResponse {
                nodes: r.list_nodes(),
            });
        self.record("ListNodes", started, result)
    }

    async fn lookup_node(
        &self,
        request: Request<LookupNodeRequest>,
    ) -> Result<Response<LookupNodeResponse>, Status> {
        let started = std::time::Instant::now();
        let result = self.lookup(request.into_inner()).await;
        self.record("LookupNode", started, result)
    }

    async fn record_assignment(
        &self,
        request: Request<RecordAssignmentRequest>,
    ) -> Result<Response<RecordAssignmentResponse>, Status> {
        let started = std::time::Instant::now();
        let result = self.record_assignment_inner(request.into_inner()).await;
        self.record("RecordAssignment", started, result)
    }

    async fn heartbeat(
        &self,
        request: Request<HeartbeatRequest>,
    ) -> Result<Response<HeartbeatResponse>, Status> {
        let started = std::time::Instant::now();
        let result = self.heartbeat_inner(request.into_inner()).await;
        self.record("Heartbeat", started, result)
    }

    async fn report_sandbox_event(
        &self,
        request: Request<ReportSandboxEventRequest>,
    ) -> Result<Response<ReportSandboxEventResponse>, Status> {
        let started = std::time::Instant::now();
        let result = self
            .registry_or_unimplemented("ReportSandboxEvent")
            .map(|_| {
                let req = request.into_inner();
                tracing::debug!(node_id = %req.node_id, events = req.events.len(), "sandbox events");
                ReportSandboxEventResponse {}
            });
        self.record("ReportSandboxEvent", started, result)
    }

    async fn list_observed_nodes(
        &self,
        request: Request<ListObservedNodesRequest>,
    ) -> Result<Response<ListObservedNodesResponse>, Status> {
        let started = std::time::Instant::now();
        let result = self
            .registry_or_unimplemented("ListObservedNodes")
            .map(|r| ListObservedNodesResponse {
                nodes: r.observed(&request.get_ref().cluster_id, Instant::now()),
            });
        self.record("ListObservedNodes", started, result)
    }

    async fn get_node(
        &self,
        request: Request<GetNodeRequest>,
    ) -> Result<Response<GetNodeResponse>, Status> {
        let started = std::time::Instant::now();
        let req = request.into_inner();
        let result = self.registry_or_unimplemented("GetNode").and_then(|r| {
            let id = req.node_id.trim();
            if id.is_empty() {
                return Err(Status::invalid_argument("node_id is required"));
            }
            r.observed_node(id, &req.cluster_id, Instant::now())
                .map(|n| GetNodeResponse { node: Some(n) })
                .ok_or_else(|| Status::not_found("observed node not found"))
        });
        self.record("GetNode", started, result)
    }

    async fn unregister_node(
        &self,
        request: Request<UnregisterNodeRequest>,
    ) -> Result<Response<UnregisterNodeResponse>, Status> {
        let started = std::time::Instant::now();
        let result = self.unregister_inner(request.into_inner()).await;
        self.record("UnregisterNode", started, result)
    }

    async fn list_p2p_peers(
        &self,
        request: Request<ListP2pPeersRequest>,
    ) -> Result<Response<ListP2pPeersResponse>, Status> {
        let registry = self.registry_or_unimplemented("ListP2pPeers")?;
        let req = request.into_inner();
        let query = P2pQuery::new(&req.cluster_id, &req.backend, &req.exclude_node_id);
        let peers = registry.p2p_peers(&query, Instant::now());
        Ok(Response::new(ListP2pPeersResponse { peers }))
    }

    async fn record_p2p_artifact(
        &self,
        request: Request<RecordP2pArtifactRequest>,
    ) -> Result<Response<RecordP2pArtifactResponse>, Status> {
        let registry = self.registry_or_unimplemented("RecordP2pArtifact")?;
        let req = request.into_inner();
        if !all_present(&[&req.cluster_id, &req.backend, &req.key, &req.node_id]) {
            return Err(Status::invalid_argument(
                "cluster_id, backend, key, and node_id are required",
            ));
        }
        let node_id = req.node_id.trim();
        if registry.resolve(node_id).is_none() {
            return Err(Status::invalid_argument(NOT_IN_NODE_LIST));
        }
        self.inner.artifacts.lock().record(
            artifact_key(&req.cluster_id, &req.backend, &req.key),
            node_id,
        );
        Ok(Response::new(RecordP2pArtifactResponse {}))
    }

    async fn forget_p2p_artifact(
        &self,
        request: Request<ForgetP2pArtifactRequest>,
    ) -> Result<Response<ForgetP2pArtifactResponse>, Status> {
        self.registry_or_unimplemented("ForgetP2pArtifact")?;
        let req = request.into_inner();
        if !all_present(&[&req.cluster_id, &req.backend, &req.key, &req.node_id]) {
            return Err(Status::invalid_argument(
                "cluster_id, backend, key, and node_id are required",
            ));
        }
        self.inner.artifacts.lock().forget(
            &artifact_key(&req.cluster_id, &req.backend, &req.key),
            req.node_id.trim(),
        );
        Ok(Response::new(ForgetP2pArtifactResponse {}))
    }

    async fn lookup_p2p_artifact(
        &self,
        request: Request<LookupP2pArtifactRequest>,
    ) -> Result<Response<LookupP2pArtifactResponse>, Status> {
        let registry = self.registry_or_unimplemented("LookupP2pArtifact")?;
        let req = request.into_inner();
        if !all_present(&[&req.cluster_id, &req.backend, &req.key]) {
            return Err(Status::invalid_argument(
                "cluster_id, backend, and key are required",
            ));
        }
        let providers: HashSet<String> = self
            .inner
            .artifacts
            .lock()
            .lookup(&artifact_key(&req.cluster_id, &req.backend, &req.key))
            .into_iter()
            .collect();
        let query =
            P2pQuery::new(&req.cluster_id, &req.backend, &req.exclude_node_id).only(&providers);
        let peers = registry.p2p_peers(&query, Instant::now());
        Ok(Response::new(LookupP2pArtifactResponse { peers }))
    }
}
