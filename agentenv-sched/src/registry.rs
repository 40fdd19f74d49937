//! The node registry: which runtime nodes exist (discovery) and what their
//! heartbeats last said (observation). Status is derived when read, never
//! stored by a timer.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use agentenv_core::config::NodeResourceLimit;
use agentenv_core::proto::scheduler_v1::{
    HeartbeatRequest, Node, NodeSnapshot, NodeStatus, ObservedNode, P2pEndpoint, P2pPeer,
    ScheduleRequestHint,
};
use parking_lot::RwLock;
use tokio::time::{Duration, Instant};

use crate::cpu_template::intersect_cpu_configs;
use crate::placement::{Candidate, Placement, passes_limits};

mod membership;
mod status;

pub use membership::{DrainState, NodeListChange, RemovedNode};
pub use status::{P2pQuery, derive_status};

/// How stale the load figures (counts, CPU, memory) of the candidates placement sees may
/// be in a fleet of more than [`LARGE_FLEET`] nodes: heartbeats that change only those
/// rebuild the candidates at most this often (a rebuild walks every node; 2,000
/// heartbeats a second would otherwise make nearly every Schedule pay for one). The
/// figures are a heartbeat interval (5 s) old anyway. Which nodes are candidates never
/// lags: the node list, drains, a node's first heartbeat, a status change and a report
/// going stale take effect at once.
pub const LOAD_REFRESH: Duration = Duration::from_secs(1);

/// Fleets up to this many nodes see every heartbeat's figures at once.
pub const LARGE_FLEET: usize = 512;

/// Why the registry refused a request.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RegistryError {
    #[error("node is not in scheduler node list")]
    UnknownNode,
    #[error("service instance mismatch")]
    InstanceMismatch,
    /// Drain or undrain of an id the registry does not hold.
    #[error(
        "node {0:?} is not in the scheduler's node list; list the nodes with `aenv node ls` (GET /nodes)"
    )]
    NotFound(String),
    /// This registry cannot do what was asked.
    #[error("{0}")]
    Unsupported(&'static str),
}

/// What a heartbeat changed, for the caller to act on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeartbeatOutcome {
    /// The node as discovery knows it (the endpoint bindings are recorded with).
    pub node: Node,
    /// The cluster CPU template, when it is due to this node.
    pub cpu_config_json: String,
    /// The scheduler holds no CPU config for this node and wants it sent.
    pub cpu_config_wanted: bool,
    /// The node had left the node list and this heartbeat's empty roster
    /// dropped it from the registry: its next heartbeat is refused.
    pub dropped: bool,
}

/// Counts of observed nodes per derived status.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StatusCounts {
    pub ready: u64,
    pub connecting: u64,
    pub unhealthy: u64,
    pub lingering: u64,
    pub draining: u64,
    pub unspecified: u64,
}

/// The discovered node set plus what heartbeats reported.
///
/// Discovery (a static list, or later Kubernetes) calls [`NodeRegistry::set`];
/// the gRPC service calls the rest. Implementations must be cheap to read
/// concurrently: [`NodeRegistry::pick`] runs on every Schedule.
pub trait NodeRegistry: Send + Sync + 'static {
    /// Replaces the discovered set. Lingering entries win over active ones
    /// with the same id. Observations of nodes no longer discovered are dropped.
    fn set(&self, active: Vec<Node>, lingering: Vec<Node>);

    /// Every discovered node, lingering ones included, sorted by id.
    fn list_nodes(&self) -> Vec<Node>;

    /// The discovered node with this id.
    fn resolve(&self, node_id: &str) -> Option<Node>;

    /// True when the id is discovered and its endpoint matches exactly.
    fn contains(&self, node: &Node) -> bool {
        self.resolve(&node.node_id)
            .is_some_and(|n| n.endpoint == node.endpoint)
    }

    /// Records a heartbeat (the caller validated the required fields).
    fn heartbeat(
        &self,
        req: &HeartbeatRequest,
        now: Instant,
        now_unix_ms: i64,
    ) -> Result<HeartbeatOutcome, RegistryError>;

    /// Forgets a node's observation. `Ok(false)` when there was none.
    fn unregister(&self, node_id: &str, service_instance_id: &str) -> Result<bool, RegistryError>;

    /// Chooses a node for a new sandbox among the healthy candidates: discovered,
    /// not lingering, with a heartbeat younger than the report TTL, and within
    /// `limit`. `None` when no candidate is left.
    fn pick(
        &self,
        now: Instant,
        limit: Option<&NodeResourceLimit>,
        placement: &dyn Placement,
        hint: Option<&ScheduleRequestHint>,
    ) -> Option<Node>;

    /// Observed nodes with derived status; a blank cluster means all.
    fn observed(&self, cluster_id: &str, now: Instant) -> Vec<ObservedNode>;

    /// One observed node, if it exists and matches the cluster filter.
    fn observed_node(&self, node_id: &str, cluster_id: &str, now: Instant) -> Option<ObservedNode>;

    /// READY nodes with a P2P endpoint that `query` selects.
    fn p2p_peers(&self, query: &P2pQuery<'_>, now: Instant) -> Vec<P2pPeer>;

    /// Observed nodes per derived status.
    fn status_counts(&self, now: Instant) -> StatusCounts;

    /// Applies a new static node list (a config reload). New ids are added
    /// (candidates once they heartbeat); an id whose endpoint changed is
    /// replaced; an id no longer listed leaves placement at once but keeps
    /// taking heartbeats (so its sandboxes stay routable) until its roster
    /// is empty, it unregisters, or [`NodeRegistry::prune_removed`] finds its
    /// heartbeats gone. The default replaces the discovered set wholesale.
    fn apply_node_list(&self, nodes: Vec<Node>) -> NodeListChange {
        let before = self.list_nodes();
        self.set(nodes.clone(), Vec::new());
        NodeListChange::between(&before, &nodes)
    }

    /// Drains (`true`) or undrains a node: a draining node gets no new
    /// sandboxes from the moment this returns and keeps serving its own.
    fn set_draining(&self, node_id: &str, draining: bool) -> Result<DrainState, RegistryError> {
        let _ = (node_id, draining);
        Err(RegistryError::Unsupported(
            "this node registry cannot drain nodes",
        ))
    }

    /// Drops the nodes that left the node list and have not sent a heartbeat
    /// for `grace` (their bindings have expired by then); returns their ids.
    fn prune_removed(&self, now: Instant, grace: Duration) -> Vec<String> {
        let _ = (now, grace);
        Vec::new()
    }
}

/// Whether an observed node belongs to `cluster` (trimmed; blank means every cluster).
fn in_cluster(o: &Observation, cluster: &str) -> bool {
    cluster.is_empty() || o.view.cluster_id == cluster
}

#[derive(Debug, Clone)]
struct Observation {
    /// The last heartbeat, without its snapshot (kept apart, shared).
    view: ObservedNode,
    snapshot: Arc<NodeSnapshot>,
    last_seen: Instant,
    p2p: Option<P2pEndpoint>,
    /// How many sandboxes (running and paused) the last roster listed.
    roster_len: usize,
}

#[derive(Debug, Clone)]
struct Entry {
    node: Arc<Node>,
    lingering: bool,
    /// Left the configured node list: no placements, heartbeats still taken
    /// until its roster is empty.
    removed: bool,
    /// Drained by an operator: no placements.
    draining: bool,
    observed: Option<Observation>,
}

impl Entry {
    fn new(node: Node, lingering: bool) -> Self {
        Self {
            node: Arc::new(node),
            lingering,
            removed: false,
            draining: false,
            observed: None,
        }
    }

    /// May get new sandboxes (heartbeat freshness aside).
    fn placeable(&self) -> bool {
        !self.lingering && !self.removed && !self.draining
    }
}

/// The candidate list of the last Schedule, reused until the registry changes,
/// the limit differs, or the first candidate's heartbeat goes stale.
struct CandidateCache {
    generation: u64,
    /// [`StaticRegistry::load_generation`] when built, and when.
    load_generation: u64,
    built: Instant,
    /// Built over more than [`LARGE_FLEET`] nodes.
    large: bool,
    limit: Option<NodeResourceLimit>,
    valid_until: Option<Instant>,
    candidates: Arc<[Candidate]>,
}

#[derive(Default)]
struct State {
    /// Discovered nodes sorted by id, each with its last observation.
    entries: Vec<Entry>,
    index: HashMap<String, usize>,
    /// Observations of nodes that are not (or no longer) discovered never
    /// exist: heartbeats from them are refused and `set` drops them.
    cpu_intersection: HashMap<String, String>,
    intersection_sent: HashSet<String>,
}

impl State {
    fn entry(&self, id: &str) -> Option<&Entry> {
        self.index.get(id).map(|&i| &self.entries[i])
    }

    /// Installs `entries` (any order) as the discovered set.
    fn install(&mut self, mut entries: Vec<Entry>) {
        entries.sort_by(|a, b| a.node.node_id.cmp(&b.node.node_id));
        self.index = entries
            .iter()
            .enumerate()
            .map(|(i, e)| (e.node.node_id.clone(), i))
            .collect();
        self.entries = entries;
    }

    /// Forgets what the registry derived from a node that is gone (or whose
    /// observation was dropped).
    fn forget_observation(&mut self, id: &str, gone: Option<Observation>) {
        self.intersection_sent.remove(id);
        if let Some(o) = gone {
            self.invalidate_cluster(&o.view.cluster_id);
        }
    }

    fn invalidate_cluster(&mut self, cluster_id: &str) {
        self.cpu_intersection.remove(cluster_id);
        for e in &self.entries {
            if let Some(o) = &e.observed
                && o.view.cluster_id == cluster_id
            {
                self.intersection_sent.remove(&e.node.node_id);
            }
        }
    }

    fn cluster_configs(&self, cluster_id: &str) -> Option<Vec<&str>> {
        let mut configs = Vec::new();
        for e in &self.entries {
            let Some(o) = &e.observed else { continue };
            if o.view.cluster_id != cluster_id {
                continue;
            }
            let cfg = cpu_config(&o.view);
            if cfg.is_empty() {
                return None;
            }
            configs.push(cfg);
        }
        (!configs.is_empty()).then_some(configs)
    }
}

fn cpu_config(view: &ObservedNode) -> &str {
    view.machine_info
        .as_ref()
        .map(|m| m.cpu_config_json.as_str())
        .unwrap_or("")
}

/// The in-memory registry behind static discovery (and, later, Kubernetes).
pub struct StaticRegistry {
    state: RwLock<State>,
    report_ttl: Duration,
    /// Bumped by every change of which nodes may be candidates (the node list, drains,
    /// a node's first heartbeat or a change of its status), under the state's write lock.
    generation: AtomicU64,
    /// Bumped by heartbeats that change only what nodes report (load, counts): the
    /// candidates are rebuilt for those at most every [`LOAD_REFRESH`].
    load_generation: AtomicU64,
    cache: RwLock<Option<CandidateCache>>,
}

impl StaticRegistry {
    /// A registry whose discovered set is `nodes`, all active.
    pub fn new(nodes: Vec<Node>, report_ttl: Duration) -> Self {
        let r = Self {
            state: RwLock::new(State::default()),
            report_ttl,
            generation: AtomicU64::new(0),
            load_generation: AtomicU64::new(0),
            cache: RwLock::new(None),
        };
        r.set(nodes, Vec::new());
        r
    }

    fn status(&self, e: &Entry, o: &Observation, now: Instant) -> NodeStatus {
        let status = derive_status(
            o.last_seen,
            o.snapshot.status,
            true,
            e.lingering || e.removed,
            self.report_ttl,
            now,
        );
        match status {
            NodeStatus::Unhealthy | NodeStatus::Lingering => status,
            _ if e.draining => NodeStatus::Draining,
            _ => status,
        }
    }

    fn view(&self, e: &Entry, o: &Observation, now: Instant) -> ObservedNode {
        let mut v = o.view.clone();
        if !e.node.endpoint.is_empty() {
            v.endpoint = e.node.endpoint.clone();
        }
        let mut snapshot = (*o.snapshot).clone();
        snapshot.status = self.status(e, o, now) as i32;
        v.snapshot = Some(snapshot);
        v
    }

    fn changed(&self) {
        self.generation.fetch_add(1, Ordering::Release);
    }

    fn load_changed(&self) {
        self.load_generation.fetch_add(1, Ordering::Release);
    }

    /// The healthy candidates within `limit`, sorted by id. Rebuilt only when
    /// the registry changed or a candidate's heartbeat went stale.
    fn candidates(&self, now: Instant, limit: Option<&NodeResourceLimit>) -> Arc<[Candidate]> {
        let generation = self.generation.load(Ordering::Acquire);
        let load_generation = self.load_generation.load(Ordering::Acquire);
        if let Some(c) = &*self.cache.read()
            && c.generation == generation
            && (c.load_generation == load_generation || (c.large && now < c.built + LOAD_REFRESH))
            && c.limit.as_ref() == limit
            && c.valid_until.is_none_or(|v| now <= v)
        {
            return c.candidates.clone();
        }
        let st = self.state.read();
        let large = st.entries.len() > LARGE_FLEET;
        // Changes bump the generations under the write lock: stable here.
        let generation = self.generation.load(Ordering::Acquire);
        let load_generation = self.load_generation.load(Ordering::Acquire);
        let mut valid_until: Option<Instant> = None;
        let list: Vec<Candidate> = st
            .entries
            .iter()
            .filter(|e| e.placeable())
            .filter_map(|e| {
                let o = e.observed.as_ref()?;
                let stale_at = o.last_seen + self.report_ttl;
                if now > stale_at || limit.is_some_and(|l| !passes_limits(l, &o.snapshot)) {
                    return None;
                }
                valid_until = Some(valid_until.map_or(stale_at, |v| v.min(stale_at)));
                Some(Candidate {
                    node: e.node.clone(),
                    snapshot: o.snapshot.clone(),
                })
            })
            .collect();
        drop(st);
        let candidates: Arc<[Candidate]> = list.into();
        *self.cache.write() = Some(CandidateCache {
            generation,
            load_generation,
            built: now,
            large,
            limit: limit.cloned(),
            valid_until,
            candidates: candidates.clone(),
        });
        candidates
    }
}

impl NodeRegistry for StaticRegistry {
    fn set(&self, active: Vec<Node>, lingering: Vec<Node>) {
        let mut st = self.state.write();
        let mut next: HashMap<String, (Node, bool)> = HashMap::new();
        for n in active {
            next.insert(n.node_id.clone(), (n, false));
        }
        for n in lingering {
            next.insert(n.node_id.clone(), (n, true));
        }
        let mut old: HashMap<String, Entry> = std::mem::take(&mut st.entries)
            .into_iter()
            .map(|e| (e.node.node_id.clone(), e))
            .collect();
        let entries: Vec<Entry> = next
            .into_iter()
            .map(|(id, (node, lingering))| {
                let previous = old.remove(&id);
                Entry {
                    draining: previous.as_ref().is_some_and(|e| e.draining),
                    observed: previous.and_then(|e| e.observed),
                    ..Entry::new(node, lingering)
                }
            })
            .collect();
        st.install(entries);
        for (id, gone) in old {
            st.forget_observation(&id, gone.observed);
        }
        self.changed();
    }

    fn list_nodes(&self) -> Vec<Node> {
        self.state
            .read()
            .entries
            .iter()
            .map(|e| (*e.node).clone())
            .collect()
    }

    fn resolve(&self, node_id: &str) -> Option<Node> {
        self.state.read().entry(node_id).map(|e| (*e.node).clone())
    }

    fn contains(&self, node: &Node) -> bool {
        self.state
            .read()
            .entry(&node.node_id)
            .is_some_and(|e| e.node.endpoint == node.endpoint)
    }

    fn heartbeat(
        &self,
        req: &HeartbeatRequest,
        now: Instant,
        now_unix_ms: i64,
    ) -> Result<HeartbeatOutcome, RegistryError> {
        let mut guard = self.state.write();
        let st = &mut *guard;
        let idx = *st
            .index
            .get(&req.node_id)
            .ok_or(RegistryError::UnknownNode)?;
        let entry = &st.entries[idx];
        let node = (*entry.node).clone();
        let previous = entry.observed.as_ref();
        let is_new = previous.is_none();
        // Whether the node may now be a candidate where it was not, or the reverse.
        let previous_status =
            previous.map(|o| (o.snapshot.status, now > o.last_seen + self.report_ttl));
        let previous_cluster = previous.map(|o| o.view.cluster_id.clone());
        let previous_cpu = previous
            .map(|o| cpu_config(&o.view).to_string())
            .unwrap_or_default();

        let machine_info = req.machine_info.clone().map(|mut m| {
            if m.cpu_config_json.is_empty() {
                m.cpu_config_json = previous_cpu.clone();
            }
            m
        });
        let cpu_changed = req
            .machine_info
            .as_ref()
            .is_some_and(|m| !m.cpu_config_json.is_empty() && m.cpu_config_json != previous_cpu);
        let mut snapshot = req.snapshot.clone().unwrap_or_default();
        if snapshot.reported_at_unix_ms == 0 {
            snapshot.reported_at_unix_ms = now_unix_ms;
        }
        if snapshot.status == NodeStatus::Unspecified as i32 {
            snapshot.status = NodeStatus::Connecting as i32;
        }
        let view = ObservedNode {
            node_id: req.node_id.clone(),
            endpoint: node.endpoint.clone(),
            cluster_id: req.cluster_id.clone(),
            service_instance_id: req.service_instance_id.clone(),
            version: req.version.clone(),
            commit: req.commit.clone(),
            machine_info,
            snapshot: None,
            last_seen_unix_ms: now_unix_ms,
        };
        let cpu_config_wanted = cpu_config(&view).is_empty();
        let cluster = view.cluster_id.clone();
        st.entries[idx].observed = Some(Observation {
            view,
            snapshot: Arc::new(snapshot),
            last_seen: now,
            p2p: req.p2p_endpoint.clone(),
            roster_len: req.sandbox_ids.len(),
        });
        let status = st.entries[idx].observed.as_ref().map(|o| o.snapshot.status);
        match previous_status {
            Some((before, false)) if Some(before) == status => self.load_changed(),
            _ => self.changed(),
        }
        if st.entries[idx].removed && req.sandbox_ids.is_empty() {
            // Its last sandbox is gone: the node leaves the registry.
            st.drop_entry(idx);
            return Ok(HeartbeatOutcome {
                node,
                cpu_config_json: String::new(),
                cpu_config_wanted: false,
                dropped: true,
            });
        }

        if let Some(prev) = previous_cluster.filter(|c| *c != cluster) {
            st.invalidate_cluster(&prev);
        }
        if is_new || cpu_changed {
            st.invalidate_cluster(&cluster);
        }
        if !st.cpu_intersection.contains_key(&cluster)
            && let Some(configs) = st.cluster_configs(&cluster)
        {
            match intersect_cpu_configs(&configs) {
                Ok(v) => {
                    st.cpu_intersection.insert(cluster.clone(), v);
                }
                Err(e) => {
                    tracing::warn!(cluster_id = %cluster, error = %e, "cannot intersect CPU configs; will retry on the next heartbeat");
                }
            }
        }
        let mut cpu_config_json = String::new();
        if let Some(v) = st.cpu_intersection.get(&cluster)
            && st.intersection_sent.insert(req.node_id.clone())
        {
            cpu_config_json = v.clone();
        }
        Ok(HeartbeatOutcome {
            node,
            cpu_config_json,
            cpu_config_wanted,
            dropped: false,
        })
    }

    fn unregister(&self, node_id: &str, service_instance_id: &str) -> Result<bool, RegistryError> {
        let mut guard = self.state.write();
        let st = &mut *guard;
        let Some(&idx) = st.index.get(node_id) else {
            return Ok(false);
        };
        let Some(o) = &st.entries[idx].observed else {
            return Ok(false);
        };
        if o.view.service_instance_id != service_instance_id {
            return Err(RegistryError::InstanceMismatch);
        }
        if st.entries[idx].removed {
            // It left the node list and now says goodbye: forget it.
            st.drop_entry(idx);
            self.changed();
            return Ok(true);
        }
        let gone = st.entries[idx].observed.take();
        st.forget_observation(node_id, gone);
        self.changed();
        Ok(true)
    }

    fn pick(
        &self,
        now: Instant,
        limit: Option<&NodeResourceLimit>,
        placement: &dyn Placement,
        hint: Option<&ScheduleRequestHint>,
    ) -> Option<Node> {
        let candidates = self.candidates(now, limit);
        if candidates.is_empty() {
            return None;
        }
        let i = placement.pick(&candidates, hint)?;
        candidates.get(i).map(|c| (*c.node).clone())
    }

    fn observed(&self, cluster_id: &str, now: Instant) -> Vec<ObservedNode> {
        let cluster = cluster_id.trim();
        let st = self.state.read();
        st.entries
            .iter()
            .filter_map(|e| {
                let o = e.observed.as_ref()?;
                in_cluster(o, cluster).then(|| self.view(e, o, now))
            })
            .collect()
    }

    fn observed_node(&self, node_id: &str, cluster_id: &str, now: Instant) -> Option<ObservedNode> {
        let cluster = cluster_id.trim();
        let st = self.state.read();
        let e = st.entry(node_id)?;
        let o = e.observed.as_ref()?;
        in_cluster(o, cluster).then(|| self.view(e, o, now))
    }

    fn p2p_peers(&self, query: &P2pQuery<'_>, now: Instant) -> Vec<P2pPeer> {
        let cluster = query.cluster_id.trim();
        let backend = query.backend.trim();
        let exclude = query.exclude_node_id.trim();
        let only = query.only;
        let st = self.state.read();
        st.entries
            .iter()
            .filter_map(|e| {
                let o = e.observed.as_ref()?;
                if !in_cluster(o, cluster)
                    || (!exclude.is_empty() && e.node.node_id == exclude)
                    || only.is_some_and(|s| !s.contains(&e.node.node_id))
                {
                    return None;
                }
                // A draining node still serves what it holds, artifacts included.
                if !matches!(
                    self.status(e, o, now),
                    NodeStatus::Ready | NodeStatus::Draining
                ) {
                    return None;
                }
                let p2p = o.p2p.as_ref()?;
                if p2p.backend.is_empty()
                    || p2p.address.is_empty()
                    || (!backend.is_empty() && p2p.backend != backend)
                {
                    return None;
                }
                Some(P2pPeer {
                    node_id: e.node.node_id.clone(),
                    endpoint: Some(p2p.clone()),
                })
            })
            .collect()
    }

    fn status_counts(&self, now: Instant) -> StatusCounts {
        let st = self.state.read();
        let mut c = StatusCounts::default();
        for e in &st.entries {
            let Some(o) = &e.observed else { continue };
            match self.status(e, o, now) {
                NodeStatus::Ready => c.ready += 1,
                NodeStatus::Connecting => c.connecting += 1,
                NodeStatus::Unhealthy => c.unhealthy += 1,
                NodeStatus::Lingering => c.lingering += 1,
                NodeStatus::Draining => c.draining += 1,
                NodeStatus::Unspecified => c.unspecified += 1,
            }
        }
        c
    }

    fn apply_node_list(&self, nodes: Vec<Node>) -> NodeListChange {
        let change = self.state.write().apply_node_list(nodes);
        self.changed();
        change
    }

    fn set_draining(&self, node_id: &str, draining: bool) -> Result<DrainState, RegistryError> {
        let mut st = self.state.write();
        let idx = *st
            .index
            .get(node_id)
            .ok_or_else(|| RegistryError::NotFound(node_id.to_string()))?;
        let was = std::mem::replace(&mut st.entries[idx].draining, draining);
        // Bumped under the write lock: the next Schedule rebuilds its candidates.
        self.changed();
        let e = &st.entries[idx];
        Ok(DrainState {
            changed: was != draining,
            node: e.observed.as_ref().map(|o| self.view(e, o, Instant::now())),
        })
    }

    fn prune_removed(&self, now: Instant, grace: Duration) -> Vec<String> {
        // Runs every few seconds: take the write lock only when there is work.
        if !self.state.read().entries.iter().any(|e| e.removed) {
            return Vec::new();
        }
        let mut st = self.state.write();
        let pruned = st.prune_removed(now, grace);
        if !pruned.is_empty() {
            self.changed();
        }
        pruned
    }
}
