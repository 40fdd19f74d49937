//! Operator changes to the node set while the scheduler runs: a reloaded
//! config (new node list) and drains.

use agentenv_core::config::SchedulerConfig;
use agentenv_core::proto::scheduler_v1::{Node, ObservedNode};
use tokio::time::{Duration, Instant};
use tonic::Status;

use crate::metrics::ReloadLabel;
use crate::registry::{NodeListChange, RegistryError};
use crate::service::SchedulerService;

/// Longest node id a drain call accepts.
const MAX_NODE_ID_LEN: usize = 256;

/// The `scheduler.*` keys whose change needs a restart: everything but `nodes`.
pub fn keys_needing_restart(running: &SchedulerConfig, new: &SchedulerConfig) -> Vec<&'static str> {
    let mut keys = Vec::new();
    let mut check = |key, changed: bool| {
        if changed {
            keys.push(key);
        }
    };
    check(
        "scheduler.grpc_listen_addr",
        running.grpc_listen_addr != new.grpc_listen_addr,
    );
    check(
        "scheduler.metrics_listen_addr",
        running.metrics_listen_addr != new.metrics_listen_addr,
    );
    check("scheduler.strategy", running.strategy != new.strategy);
    check("scheduler.report_ttl", running.report_ttl != new.report_ttl);
    check(
        "scheduler.binding_ttl",
        running.binding_ttl != new.binding_ttl,
    );
    check("scheduler.redis_addr", running.redis_addr != new.redis_addr);
    check(
        "scheduler.artifact_store_capacity",
        running.artifact_store_capacity != new.artifact_store_capacity,
    );
    check(
        "scheduler.artifact_lookup_node_limit",
        running.artifact_lookup_node_limit != new.artifact_lookup_node_limit,
    );
    check("scheduler.discovery", running.discovery != new.discovery);
    check(
        "scheduler.node_resource_limit",
        running.node_resource_limit != new.node_resource_limit,
    );
    check(
        "scheduler.cluster_token_file",
        running.cluster_token_file != new.cluster_token_file,
    );
    check(
        "scheduler.open_lookups",
        running.open_lookups != new.open_lookups,
    );
    check(
        "scheduler.insecure_no_auth",
        running.insecure_no_auth != new.insecure_no_auth,
    );
    check("scheduler.tls", running.tls != new.tls);
    check(
        "scheduler.allow_plain_http",
        running.allow_plain_http != new.allow_plain_http,
    );
    check(
        "scheduler.prefer_pooled_nodes",
        running.prefer_pooled_nodes != new.prefer_pooled_nodes,
    );
    keys
}

/// The nodes of a config, as the registry holds them.
pub fn config_nodes(config: &SchedulerConfig) -> Vec<Node> {
    config
        .nodes
        .iter()
        .map(|n| Node {
            node_id: n.id.clone(),
            endpoint: n.endpoint.clone(),
        })
        .collect()
}

impl SchedulerService {
    /// Applies the node list of a reloaded (and validated) config. Other
    /// changed keys are logged as needing a restart. `None` in query-only
    /// mode, which holds no node list.
    pub fn reload_config(
        &self,
        running: &SchedulerConfig,
        new: &SchedulerConfig,
    ) -> Option<NodeListChange> {
        let restart = keys_needing_restart(running, new);
        if !restart.is_empty() {
            tracing::warn!(
                keys = %restart.join(", "),
                "config reload: these keys changed but only take effect after a restart of the scheduler; the running values stay"
            );
        }
        self.count_reload("ok");
        let Some(registry) = self.registry() else {
            tracing::info!(
                "config reloaded; a query-only scheduler holds no node list, so nothing changed"
            );
            return None;
        };
        let change = registry.apply_node_list(config_nodes(new));
        self.refresh_node_gauge();
        tracing::info!(
            added = change.added.len(),
            removed = change.lingering.len() + change.dropped.len(),
            replaced = change.replaced.len(),
            "node list reloaded: {change}"
        );
        Some(change)
    }

    /// Counts and logs a reload that changed nothing because the config
    /// could not be loaded.
    pub fn reload_failed(&self, reason: &dyn std::fmt::Display) {
        self.count_reload("failed");
        tracing::error!(
            reason = %reason,
            "config reload failed; nothing changed, the scheduler keeps its running config"
        );
    }

    /// Drops the nodes that left the node list and whose heartbeats stopped
    /// longer than `grace` ago.
    pub fn prune_removed_nodes(&self, grace: Duration) {
        let Some(registry) = self.registry() else {
            return;
        };
        let pruned = registry.prune_removed(Instant::now(), grace);
        if !pruned.is_empty() {
            tracing::info!(
                nodes = %pruned.join(", "),
                "nodes removed from the node list sent no heartbeat for {grace:?}; they have left the registry"
            );
            self.refresh_node_gauge();
        }
    }

    /// Drains or undrains `node_id` (the DrainNode and UndrainNode RPCs
    /// without gRPC around them); the node's view afterwards.
    pub fn set_draining(
        &self,
        rpc: &str,
        node_id: &str,
        draining: bool,
    ) -> Result<Option<ObservedNode>, Status> {
        let registry = self.registry_or_unimplemented(rpc)?;
        let id = node_id.trim();
        if id.is_empty() {
            return Err(Status::invalid_argument(
                "node_id is required: name the node to drain (see `aenv node ls`)",
            ));
        }
        if id.len() > MAX_NODE_ID_LEN {
            return Err(Status::invalid_argument(format!(
                "node_id is longer than {MAX_NODE_ID_LEN} bytes; node ids are the ids of scheduler.nodes"
            )));
        }
        let state = registry.set_draining(id, draining).map_err(|e| match e {
            RegistryError::NotFound(_) => Status::not_found(e.to_string()),
            RegistryError::Unsupported(m) => Status::unimplemented(m),
            other => Status::internal(other.to_string()),
        })?;
        if state.changed {
            let (running, paused) = state
                .node
                .as_ref()
                .and_then(|n| n.snapshot.as_ref())
                .map_or((0, 0), |s| (s.sandbox_count, s.paused_sandbox_count));
            if draining {
                tracing::info!(
                    node_id = %id,
                    running,
                    paused,
                    "node draining: no new sandboxes are placed there; its sandboxes keep running"
                );
            } else {
                tracing::info!(node_id = %id, "node undrained: it takes new sandboxes again");
            }
            self.refresh_node_gauge();
        }
        Ok(state.node)
    }

    /// Sets the observed-nodes gauge from the registry now.
    pub(crate) fn refresh_node_gauge(&self) {
        if let Some(r) = self.registry() {
            self.metrics().set_observed(r.status_counts(Instant::now()));
        }
    }

    fn count_reload(&self, result: &'static str) {
        self.metrics()
            .config_reloads
            .get_or_create(&ReloadLabel { result })
            .inc();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_changed_keys_other_than_nodes_need_a_restart() {
        let running = SchedulerConfig::default();
        let mut new = running.clone();
        new.nodes.clear();
        assert!(keys_needing_restart(&running, &new).is_empty());
        new.strategy = "least_loaded".into();
        new.report_ttl = Duration::from_secs(5);
        assert_eq!(
            keys_needing_restart(&running, &new),
            ["scheduler.strategy", "scheduler.report_ttl"]
        );
    }
}
