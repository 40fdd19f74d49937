//! Changes of membership while the scheduler runs: a reloaded node list,
//! nodes that left it and wait for their sandboxes to go, and drains.

use std::collections::HashMap;
use std::fmt;

use agentenv_core::proto::scheduler_v1::{Node, ObservedNode};
use tokio::time::{Duration, Instant};

use super::{Entry, State};

/// A node that left the node list but still holds sandboxes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemovedNode {
    pub node_id: String,
    /// Sandboxes (running and paused) its last heartbeat listed.
    pub sandboxes: usize,
}

/// What [`super::NodeRegistry::apply_node_list`] changed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeListChange {
    /// Ids new to the registry (placement candidates once they heartbeat).
    pub added: Vec<String>,
    /// Ids listed again after they had been removed (and were still held).
    pub restored: Vec<String>,
    /// Ids whose endpoint changed: the old observation is dropped.
    pub replaced: Vec<String>,
    /// Ids no longer listed that still hold sandboxes: not placed on, still
    /// taking heartbeats until their sandboxes are gone.
    pub lingering: Vec<RemovedNode>,
    /// Ids no longer listed and dropped at once (no sandboxes known).
    pub dropped: Vec<String>,
}

impl NodeListChange {
    /// The change from node list `before` to `after`, for registries that
    /// replace their set wholesale.
    pub fn between(before: &[Node], after: &[Node]) -> Self {
        let old: HashMap<&str, &str> = before
            .iter()
            .map(|n| (n.node_id.as_str(), n.endpoint.as_str()))
            .collect();
        let new: HashMap<&str, &str> = after
            .iter()
            .map(|n| (n.node_id.as_str(), n.endpoint.as_str()))
            .collect();
        let mut change = Self::default();
        for n in after {
            match old.get(n.node_id.as_str()) {
                None => change.added.push(n.node_id.clone()),
                Some(e) if *e != n.endpoint => change.replaced.push(n.node_id.clone()),
                Some(_) => {}
            }
        }
        for n in before {
            if !new.contains_key(n.node_id.as_str()) {
                change.dropped.push(n.node_id.clone());
            }
        }
        change.sort();
        change
    }

    /// Nothing changed.
    pub fn is_empty(&self) -> bool {
        self.added.is_empty()
            && self.restored.is_empty()
            && self.replaced.is_empty()
            && self.lingering.is_empty()
            && self.dropped.is_empty()
    }

    fn sort(&mut self) {
        self.added.sort();
        self.restored.sort();
        self.replaced.sort();
        self.lingering.sort_by(|a, b| a.node_id.cmp(&b.node_id));
        self.dropped.sort();
    }
}

/// `+node-c, -node-b (lingering until its 3 sandboxes are gone)`, or
/// `no change`.
impl fmt::Display for NodeListChange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut parts: Vec<String> = Vec::new();
        parts.extend(self.added.iter().map(|id| format!("+{id}")));
        parts.extend(
            self.restored
                .iter()
                .map(|id| format!("+{id} (listed again)")),
        );
        parts.extend(
            self.replaced
                .iter()
                .map(|id| format!("~{id} (new endpoint)")),
        );
        parts.extend(self.lingering.iter().map(|r| {
            let noun = if r.sandboxes == 1 {
                "sandbox is"
            } else {
                "sandboxes are"
            };
            format!(
                "-{} (lingering until its {} {noun} gone)",
                r.node_id, r.sandboxes
            )
        }));
        parts.extend(self.dropped.iter().map(|id| format!("-{id}")));
        if parts.is_empty() {
            f.write_str("no change")
        } else {
            f.write_str(&parts.join(", "))
        }
    }
}

/// A node after a drain or an undrain.
#[derive(Debug, Clone, PartialEq)]
pub struct DrainState {
    /// The call changed the node's drain state (false: it already was so).
    pub changed: bool,
    /// The node's observed view (its status included); `None` when it never
    /// sent a heartbeat.
    pub node: Option<ObservedNode>,
}

impl State {
    /// Removes entry `idx` and what was derived from it.
    pub(super) fn drop_entry(&mut self, idx: usize) {
        let mut entries = std::mem::take(&mut self.entries);
        let gone = entries.remove(idx);
        self.install(entries);
        self.forget_observation(&gone.node.node_id, gone.observed);
    }

    /// See [`super::NodeRegistry::apply_node_list`].
    pub(super) fn apply_node_list(&mut self, nodes: Vec<Node>) -> NodeListChange {
        let mut change = NodeListChange::default();
        let mut old: HashMap<String, Entry> = std::mem::take(&mut self.entries)
            .into_iter()
            .map(|e| (e.node.node_id.clone(), e))
            .collect();
        let mut entries = Vec::with_capacity(nodes.len());
        let mut forgotten = Vec::new();
        for node in nodes {
            let Some(mut e) = old.remove(&node.node_id) else {
                change.added.push(node.node_id.clone());
                entries.push(Entry::new(node, false));
                continue;
            };
            if e.node.endpoint != node.endpoint {
                change.replaced.push(node.node_id.clone());
                forgotten.push((node.node_id.clone(), e.observed.take()));
                entries.push(Entry {
                    draining: e.draining,
                    ..Entry::new(node, false)
                });
                continue;
            }
            if e.removed {
                change.restored.push(node.node_id.clone());
            }
            e.removed = false;
            e.lingering = false;
            entries.push(e);
        }
        for (id, mut e) in old {
            match e.observed.as_ref().map(|o| o.roster_len) {
                Some(sandboxes) if sandboxes > 0 => {
                    if !e.removed {
                        change.lingering.push(super::RemovedNode {
                            node_id: id,
                            sandboxes,
                        });
                    }
                    e.removed = true;
                    entries.push(e);
                }
                _ => {
                    change.dropped.push(id.clone());
                    forgotten.push((id, e.observed));
                }
            }
        }
        self.install(entries);
        for (id, gone) in forgotten {
            self.forget_observation(&id, gone);
        }
        change.sort();
        change
    }

    /// See [`super::NodeRegistry::prune_removed`].
    pub(super) fn prune_removed(&mut self, now: Instant, grace: Duration) -> Vec<String> {
        let mut pruned = Vec::new();
        while let Some(idx) = self.entries.iter().position(|e| {
            e.removed
                && e.observed
                    .as_ref()
                    .is_none_or(|o| now.saturating_duration_since(o.last_seen) > grace)
        }) {
            pruned.push(self.entries[idx].node.node_id.clone());
            self.drop_entry(idx);
        }
        pruned
    }
}
