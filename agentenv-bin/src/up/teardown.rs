//! Taking the cluster down: the gateway first (no new request reaches a node), every
//! sandbox of every node deleted, the nodes and the scheduler stopped, the nodes' host
//! firewall chains removed, and anything left behind reported.

use std::net::SocketAddr;
use std::time::Duration;

use agentenv_node::host::net::uninstall_host_rules;

use super::config::node_iface_prefixes;
use super::{Up, UpError};
use crate::cli::model::Sandbox;
use crate::http_client::request;

/// How long the stop waits for the kernel to remove the veths of closed sandbox
/// namespaces before it removes the host firewall rules.
const LINK_LINGER: Duration = Duration::from_secs(10);

impl Up {
    /// Deletes every sandbox on every node, then stops the gateway, the nodes and the
    /// scheduler (SIGTERM, SIGKILL after 30 s), removes the nodes' host firewall chains,
    /// and reports anything left behind.
    pub async fn stop(&mut self) {
        let say = self.out.clone();
        // The gateway first: no new request reaches a node while its sandboxes are
        // deleted. Then the nodes, then the scheduler.
        self.procs.stop_matching(|n| n == "gateway").await;
        say("stopping: deleting sandboxes");
        for (id, addr) in self.info.nodes.clone() {
            if !self.procs.has(&id) {
                continue;
            }
            match self.node_sandboxes(addr).await {
                Ok(ids) => {
                    for s in ids {
                        self.delete_sandbox(&id, addr, &s).await;
                    }
                }
                Err(e) => say(&format!("  could not list the sandboxes of {id}: {e}")),
            }
        }
        self.procs
            .stop_matching(|n| n != "gateway" && n != "scheduler")
            .await;
        self.procs.stop_matching(|n| n == "scheduler").await;
        // The nodes leave their host firewall chains in place (their sandboxes may outlive
        // them); with every node and sandbox gone they go too. A node that died or was
        // killed may have left sandboxes: their chains stay, and the warning says why.
        let run = self.info.data_dir.join("run");
        for prefix in node_iface_prefixes(&self.opts.iface_prefix, self.opts.nodes) {
            match uninstall_host_rules(&prefix, &run, LINK_LINGER).await {
                Ok(()) => say(&format!("  host firewall rules of {prefix} removed")),
                Err(e) => say(&format!("warning: {e}")),
            }
        }
        let left = leftover_interfaces(&self.opts.iface_prefix, self.opts.nodes);
        if !left.is_empty() {
            say(&format!(
                "warning: network interfaces left behind: {}",
                left.join(", ")
            ));
        }
    }

    /// Deletes sandbox `s` on node `node` (at `addr`) and says how it went.
    async fn delete_sandbox(&self, node: &str, addr: SocketAddr, s: &str) {
        let path = format!("/sandboxes/{s}");
        let r = request(
            self.info.target(addr),
            "DELETE",
            &path,
            &self.key_headers(),
            b"",
            Duration::from_secs(60),
        )
        .await;
        (self.out)(&match r {
            Ok(r) if r.status < 300 || r.status == 404 => {
                format!("  deleted sandbox {s} on {node}")
            }
            Ok(r) => format!(
                "  could not delete sandbox {s} on {node}: {} {}",
                r.status,
                r.text()
            ),
            Err(e) => format!("  could not delete sandbox {s} on {node}: {e}"),
        });
    }

    /// The IDs of the sandboxes on the node at `addr`, running and paused.
    async fn node_sandboxes(&self, addr: SocketAddr) -> Result<Vec<String>, UpError> {
        let mut ids: Vec<String> = Vec::new();
        for path in ["/sandboxes", "/v2/sandboxes?state=paused"] {
            let headers = self.key_headers();
            let r = request(
                self.info.target(addr),
                "GET",
                path,
                &headers,
                b"",
                Duration::from_secs(10),
            )
            .await?;
            for s in r.json::<Vec<Sandbox>>().unwrap_or_default() {
                if !ids.contains(&s.sandbox_id) {
                    ids.push(s.sandbox_id);
                }
            }
        }
        Ok(ids)
    }
}

/// The jail interfaces of `agentenv up` nodes still present on this host.
pub fn leftover_interfaces(iface_prefix: &str, nodes: u8) -> Vec<String> {
    let prefixes = node_iface_prefixes(iface_prefix, nodes);
    std::fs::read_dir("/sys/class/net")
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| prefixes.iter().any(|p| n.starts_with(p.as_str())))
                .collect()
        })
        .unwrap_or_default()
}
