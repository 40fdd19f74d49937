//! What the gateway needs from a scheduler, behind one trait: a gRPC client
//! for the daemon and a direct in-process call for embedding.

use std::sync::Arc;

use agentenv_core::cluster_auth::{SchedulerLink, SendClusterToken};
use agentenv_core::proto::scheduler_v1 as pb;
use agentenv_core::proto::scheduler_v1::scheduler_client::SchedulerClient as GrpcClient;
use agentenv_core::proto::scheduler_v1::scheduler_server::Scheduler;
use async_trait::async_trait;
use parking_lot::Mutex;
use tokio::time::{Duration, Instant};
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};
use tonic::{Request, Status};

/// Errors building a scheduler client.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error(
        "invalid scheduler address {addr:?}: {message}; use host:port without a scheme, e.g. \"127.0.0.1:9090\""
    )]
    InvalidAddress { addr: String, message: String },
}

/// The scheduler RPCs the gateway uses. Errors are gRPC statuses; the gateway
/// maps them to HTTP (UNAVAILABLE → 503, NOT_FOUND → 404, ...).
#[async_trait]
pub trait SchedulerClient: Send + Sync + 'static {
    /// Picks a node for a new sandbox.
    async fn schedule(&self, hint: Option<pb::ScheduleRequestHint>) -> Result<pb::Node, Status>;
    /// The node that owns `sandbox_id`.
    async fn lookup_node(&self, sandbox_id: &str) -> Result<pb::Node, Status>;
    /// Binds a freshly created sandbox to the node that created it.
    async fn record_assignment(&self, sandbox_id: &str, node: pb::Node) -> Result<(), Status>;
    /// Every discovered node, lingering ones included.
    async fn list_nodes(&self) -> Result<Vec<pb::Node>, Status>;
    /// Heartbeat-derived node views, filtered by cluster (blank = all).
    async fn list_observed_nodes(&self, cluster_id: &str) -> Result<Vec<pb::ObservedNode>, Status>;
    /// One node's heartbeat-derived view.
    async fn get_node(&self, node_id: &str, cluster_id: &str) -> Result<pb::ObservedNode, Status>;
    /// Drains (`true`: no new sandboxes there) or undrains a node; its view
    /// afterwards, `None` when it never sent a heartbeat.
    async fn set_draining(
        &self,
        node_id: &str,
        draining: bool,
    ) -> Result<Option<pb::ObservedNode>, Status> {
        let _ = (node_id, draining);
        Err(Status::unimplemented(
            "this scheduler client cannot drain nodes",
        ))
    }
}

#[async_trait]
impl<T: SchedulerClient + ?Sized> SchedulerClient for Arc<T> {
    async fn schedule(&self, hint: Option<pb::ScheduleRequestHint>) -> Result<pb::Node, Status> {
        (**self).schedule(hint).await
    }
    async fn lookup_node(&self, sandbox_id: &str) -> Result<pb::Node, Status> {
        (**self).lookup_node(sandbox_id).await
    }
    async fn record_assignment(&self, sandbox_id: &str, node: pb::Node) -> Result<(), Status> {
        (**self).record_assignment(sandbox_id, node).await
    }
    async fn list_nodes(&self) -> Result<Vec<pb::Node>, Status> {
        (**self).list_nodes().await
    }
    async fn list_observed_nodes(&self, cluster_id: &str) -> Result<Vec<pb::ObservedNode>, Status> {
        (**self).list_observed_nodes(cluster_id).await
    }
    async fn get_node(&self, node_id: &str, cluster_id: &str) -> Result<pb::ObservedNode, Status> {
        (**self).get_node(node_id, cluster_id).await
    }
    async fn set_draining(
        &self,
        node_id: &str,
        draining: bool,
    ) -> Result<Option<pb::ObservedNode>, Status> {
        (**self).set_draining(node_id, draining).await
    }
}

/// A scheduler connection that sends the cluster credential with every call.
type Grpc = GrpcClient<InterceptedService<Channel, SendClusterToken>>;

/// How long a lookup waits for the query-only replica before asking the
/// primary instead.
pub const REPLICA_TIMEOUT: Duration = Duration::from_secs(3);
/// While the replica is unreachable, lookups go to the primary and one of
/// them tries the replica again this often.
pub const REPLICA_RETRY: Duration = Duration::from_secs(5);

/// The scheduler over gRPC: a primary, plus an optional query-only replica
/// used for `LookupNode` alone. When the replica cannot be reached (or does
/// not answer within [`REPLICA_TIMEOUT`]), lookups fall back to the primary
/// until the replica answers again. Connections are made lazily, so a
/// scheduler that is down at start-up only fails the requests that need it.
#[derive(Clone)]
pub struct GrpcSchedulerClient {
    primary: Grpc,
    primary_addr: String,
    query: Option<Replica>,
}

/// The query-only replica and whether it was last reachable.
#[derive(Clone)]
struct Replica {
    client: Grpc,
    addr: String,
    /// `Some(last try)` while the replica is unreachable.
    down: Arc<Mutex<Option<Instant>>>,
}

impl Replica {
    /// Whether this lookup should go to the replica: always while it is up,
    /// once per [`REPLICA_RETRY`] while it is down.
    fn should_try(&self) -> bool {
        let mut down = self.down.lock();
        match *down {
            None => true,
            Some(last) if last.elapsed() >= REPLICA_RETRY => {
                *down = Some(Instant::now());
                true
            }
            Some(_) => false,
        }
    }

    fn mark_up(&self) {
        if self.down.lock().take().is_some() {
            tracing::info!(query_only_scheduler_addr = %self.addr, "query-only scheduler reachable again; lookups go to it");
        }
    }

    fn mark_down(&self, reason: &str) {
        let was_up = self.down.lock().replace(Instant::now()).is_none();
        if was_up {
            tracing::warn!(
                query_only_scheduler_addr = %self.addr,
                error = %reason,
                "query-only scheduler unreachable; lookups go to the primary scheduler until it answers again"
            );
        }
    }
}

/// Whether a replica's status says the replica itself could not be reached:
/// made here by the transport (it carries the transport's error as its source:
/// connection refused, or a connection cut during the call), or UNAVAILABLE for
/// another reason than the binding store. An answer such as NOT_FOUND is what
/// the primary would say as well.
fn replica_unreachable(status: &Status) -> bool {
    std::error::Error::source(status).is_some()
        || (status.code() == tonic::Code::Unavailable && !store_unavailable(status))
}

/// Whether a scheduler answered that its binding store is down. A replica
/// saying so hands the lookup to the primary, which answers the bindings it
/// wrote from memory.
fn store_unavailable(status: &Status) -> bool {
    status.code() == tonic::Code::Unavailable && status.message() == STORE_UNAVAILABLE
}

/// The message a scheduler sends when its binding store cannot answer.
const STORE_UNAVAILABLE: &str = "binding store unavailable";

impl GrpcSchedulerClient {
    /// `primary` and `query_only` are gRPC targets without a scheme
    /// (`host:port`); an empty `query_only` means lookups use the primary.
    /// Calls carry no cluster credential and use plain TCP (see
    /// [`Self::connect_lazy_with`]).
    pub fn connect_lazy(primary: &str, query_only: &str) -> Result<Self, ClientError> {
        Self::connect_lazy_with(primary, query_only, &SchedulerLink::default())
    }

    /// Like [`Self::connect_lazy`], over `link`: its cluster credential with
    /// every call, and TLS when it has a TLS configuration.
    pub fn connect_lazy_with(
        primary: &str,
        query_only: &str,
        link: &SchedulerLink,
    ) -> Result<Self, ClientError> {
        let auth = SendClusterToken(link.token.clone());
        let client = |channel| GrpcClient::with_interceptor(channel, auth.clone());
        let primary_addr = primary.trim().to_string();
        let primary = client(lazy_channel(primary, link)?);
        let query = match query_only.trim() {
            "" => None,
            addr => Some(Replica {
                client: client(lazy_channel(addr, link)?),
                addr: addr.to_string(),
                down: Arc::new(Mutex::new(None)),
            }),
        };
        Ok(Self {
            primary,
            primary_addr,
            query,
        })
    }
}

fn lazy_channel(addr: &str, link: &SchedulerLink) -> Result<Channel, ClientError> {
    let addr = addr.trim();
    if addr.contains("://") {
        return Err(ClientError::InvalidAddress {
            addr: addr.into(),
            message: "a scheme is not allowed".into(),
        });
    }
    let invalid = |e: &dyn std::fmt::Display| ClientError::InvalidAddress {
        addr: addr.into(),
        message: e.to_string(),
    };
    let mut endpoint =
        Endpoint::from_shared(format!("{}://{addr}", link.scheme())).map_err(|e| invalid(&e))?;
    if let Some(tls) = &link.tls {
        endpoint = endpoint.tls_config(tls.clone()).map_err(|e| invalid(&e))?;
    }
    Ok(endpoint.tcp_nodelay(true).connect_lazy())
}

/// A status made by the transport (connection refused, reset) rather than
/// sent by the scheduler says so in its message, with the address tried.
fn unreachable_scheduler(addr: &str, status: Status) -> Status {
    if status.code() == tonic::Code::Unavailable && std::error::Error::source(&status).is_some() {
        Status::unavailable(format!(
            "scheduler unreachable: {} at {addr}; check that agentenv-scheduler runs there and that gateway.scheduler_addr names it",
            status.message()
        ))
    } else {
        status
    }
}

#[async_trait]
impl SchedulerClient for GrpcSchedulerClient {
    async fn schedule(&self, hint: Option<pb::ScheduleRequestHint>) -> Result<pb::Node, Status> {
        let resp = self
            .primary
            .clone()
            .schedule(pb::ScheduleRequest { hint })
            .await
            .map_err(|s| unreachable_scheduler(&self.primary_addr, s))?;
        Ok(resp.into_inner().node.unwrap_or_default())
    }

    async fn lookup_node(&self, sandbox_id: &str) -> Result<pb::Node, Status> {
        let req = pb::LookupNodeRequest {
            sandbox_id: sandbox_id.to_string(),
        };
        if let Some(replica) = self.query.as_ref().filter(|r| r.should_try()) {
            let mut client = replica.client.clone();
            let asked = client.lookup_node(req.clone());
            match tokio::time::timeout(REPLICA_TIMEOUT, asked).await {
                Ok(Err(s)) if replica_unreachable(&s) => replica.mark_down(s.message()),
                // Redis is down: the primary may still know from the bindings it wrote.
                Ok(Err(s)) if store_unavailable(&s) => replica.mark_up(),
                Ok(answer) => {
                    replica.mark_up();
                    let resp = answer?;
                    return Ok(resp.into_inner().node.unwrap_or_default());
                }
                Err(_) => replica.mark_down(&format!("no answer within {REPLICA_TIMEOUT:?}")),
            }
        }
        let resp = self
            .primary
            .clone()
            .lookup_node(req)
            .await
            .map_err(|s| unreachable_scheduler(&self.primary_addr, s))?;
        Ok(resp.into_inner().node.unwrap_or_default())
    }

    async fn record_assignment(&self, sandbox_id: &str, node: pb::Node) -> Result<(), Status> {
        self.primary
            .clone()
            .record_assignment(pb::RecordAssignmentRequest {
                sandbox_id: sandbox_id.to_string(),
                node: Some(node),
            })
            .await
            .map_err(|s| unreachable_scheduler(&self.primary_addr, s))?;
        Ok(())
    }

    async fn list_nodes(&self) -> Result<Vec<pb::Node>, Status> {
        let resp = self
            .primary
            .clone()
            .list_nodes(pb::ListNodesRequest {})
            .await
            .map_err(|s| unreachable_scheduler(&self.primary_addr, s))?;
        Ok(resp.into_inner().nodes)
    }

    async fn list_observed_nodes(&self, cluster_id: &str) -> Result<Vec<pb::ObservedNode>, Status> {
        let resp = self
            .primary
            .clone()
            .list_observed_nodes(pb::ListObservedNodesRequest {
                cluster_id: cluster_id.to_string(),
            })
            .await
            .map_err(|s| unreachable_scheduler(&self.primary_addr, s))?;
        Ok(resp.into_inner().nodes)
    }

    async fn get_node(&self, node_id: &str, cluster_id: &str) -> Result<pb::ObservedNode, Status> {
        let resp = self
            .primary
            .clone()
            .get_node(pb::GetNodeRequest {
                node_id: node_id.to_string(),
                cluster_id: cluster_id.to_string(),
            })
            .await
            .map_err(|s| unreachable_scheduler(&self.primary_addr, s))?;
        resp.into_inner()
            .node
            .ok_or_else(|| Status::not_found("observed node not found"))
    }

    async fn set_draining(
        &self,
        node_id: &str,
        draining: bool,
    ) -> Result<Option<pb::ObservedNode>, Status> {
        let node_id = node_id.to_string();
        let mut client = self.primary.clone();
        let node = if draining {
            client
                .drain_node(pb::DrainNodeRequest { node_id })
                .await
                .map(|r| r.into_inner().node)
        } else {
            client
                .undrain_node(pb::UndrainNodeRequest { node_id })
                .await
                .map(|r| r.into_inner().node)
        };
        node.map_err(|s| unreachable_scheduler(&self.primary_addr, s))
    }
}

/// A scheduler service running in the same process, called directly through
/// its `scheduler.v1` trait: no sockets, no encoding. Any implementation of
/// the generated server trait fits.
pub struct InProcessScheduler<T> {
    service: Arc<T>,
}

impl<T> Clone for InProcessScheduler<T> {
    fn clone(&self) -> Self {
        Self {
            service: self.service.clone(),
        }
    }
}

impl<T: Scheduler> InProcessScheduler<T> {
    pub fn new(service: Arc<T>) -> Self {
        Self { service }
    }

    /// The wrapped service.
    pub fn service(&self) -> &Arc<T> {
        &self.service
    }
}

#[async_trait]
impl<T: Scheduler> SchedulerClient for InProcessScheduler<T> {
    async fn schedule(&self, hint: Option<pb::ScheduleRequestHint>) -> Result<pb::Node, Status> {
        let resp = self
            .service
            .schedule(Request::new(pb::ScheduleRequest { hint }))
            .await?;
        Ok(resp.into_inner().node.unwrap_or_default())
    }

    async fn lookup_node(&self, sandbox_id: &str) -> Result<pb::Node, Status> {
        let resp = self
            .service
            .lookup_node(Request::new(pb::LookupNodeRequest {
                sandbox_id: sandbox_id.to_string(),
            }))
            .await?;
        Ok(resp.into_inner().node.unwrap_or_default())
    }

    async fn record_assignment(&self, sandbox_id: &str, node: pb::Node) -> Result<(), Status> {
        self.service
            .record_assignment(Request::new(pb::RecordAssignmentRequest {
                sandbox_id: sandbox_id.to_string(),
                node: Some(node),
            }))
            .await?;
        Ok(())
    }

    async fn list_nodes(&self) -> Result<Vec<pb::Node>, Status> {
        let resp = self
            .service
            .list_nodes(Request::new(pb::ListNodesRequest {}))
            .await?;
        Ok(resp.into_inner().nodes)
    }

    async fn list_observed_nodes(&self, cluster_id: &str) -> Result<Vec<pb::ObservedNode>, Status> {
        let resp = self
            .service
            .list_observed_nodes(Request::new(pb::ListObservedNodesRequest {
                cluster_id: cluster_id.to_string(),
            }))
            .await?;
        Ok(resp.into_inner().nodes)
    }

    async fn get_node(&self, node_id: &str, cluster_id: &str) -> Result<pb::ObservedNode, Status> {
        let resp = self
            .service
            .get_node(Request::new(pb::GetNodeRequest {
                node_id: node_id.to_string(),
                cluster_id: cluster_id.to_string(),
            }))
            .await?;
        resp.into_inner()
            .node
            .ok_or_else(|| Status::not_found("observed node not found"))
    }

    async fn set_draining(
        &self,
        node_id: &str,
        draining: bool,
    ) -> Result<Option<pb::ObservedNode>, Status> {
        let node_id = node_id.to_string();
        if draining {
            let r = self
                .service
                .drain_node(Request::new(pb::DrainNodeRequest { node_id }))
                .await?;
            Ok(r.into_inner().node)
        } else {
            let r = self
                .service
                .undrain_node(Request::new(pb::UndrainNodeRequest { node_id }))
                .await?;
            Ok(r.into_inner().node)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_address_with_a_scheme_is_rejected_with_a_hint() {
        let err = GrpcSchedulerClient::connect_lazy("http://127.0.0.1:9090", "")
            .err()
            .unwrap();
        let msg = err.to_string();
        assert!(msg.contains("without a scheme"), "{msg}");
    }

    #[tokio::test]
    async fn a_lazy_client_to_a_closed_port_reports_unavailable() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        drop(listener);
        let client = GrpcSchedulerClient::connect_lazy(&addr.to_string(), "").unwrap();
        let err = client.list_nodes().await.unwrap_err();
        assert_eq!(err.code(), tonic::Code::Unavailable);
        assert!(
            err.message().starts_with("scheduler unreachable: "),
            "{}",
            err.message()
        );
    }
}
