//! Pools of pre-started sandboxes: for each configured template the node keeps a few
//! sandboxes started (namespaces, cgroup, layer, agent up and answering), so a create
//! only claims one and personalises it (`/init` with the create's environment and the
//! sandbox's own token; its timeout, metadata and options on record) instead of starting
//! one.
//!
//! * A pooled sandbox is nobody's until claimed: it is not in the node's lists, routes or
//!   heartbeat roster, and its agent has no token yet. A claim takes it out of the pool
//!   for good; a deleted sandbox never returns to a pool. Its id (and so its hostname) is
//!   the one it was started with, a fresh id no client has seen.
//! * A create naming a pooled template by another of its names (its id, an alias) is
//!   served by that template's pool: a pool belongs to what its name resolves to.
//! * Only creates a pooled sandbox is the same as serve from the pool: a template without
//!   a start command, the node's default CPU and memory, no volumes, no disk size, the
//!   default egress, no id of the caller's choosing (an `Idempotency-Key`'s). Others
//!   start a sandbox as always.
//! * Each pool holds at least its configured size and, when creates came faster, as many
//!   as the creates of the last `demand_window`, up to `max_per_template`. It is refilled
//!   in the background, `refill_concurrency` starts at a time, and while it holds at
//!   least half its target not within [`REFILL_QUIET`] of a claim (the claimed sandbox's
//!   first calls need the CPU a start would take).
//! * A pool belongs to the build its template resolved to: when the template is rebuilt
//!   (it resolves to another build), the old build's pooled sandboxes are destroyed and
//!   the pool refills from the new one; a claim never takes one of an older build.
//! * Under memory pressure (the host's available memory below `memory_reserve_mb`)
//!   pooled sandboxes go first, one per tick, and nothing is refilled until memory is
//!   back; running sandboxes are not touched.
//! * Pooled sandboxes hold real resources: heartbeats and `GET /nodes` report them apart
//!   (`pooledSandboxCount`, `pooledAllocatedCPU`, `pooledAllocatedMemoryBytes`).

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime};

use parking_lot::Mutex;
use tokio::sync::{Notify, Semaphore};

use super::{CreateRequest, LifecycleError, Orchestrator, SandboxOptions, SandboxRecord, State};
use crate::backend::SandboxAddress;
use crate::backend::agent::wait_ready;
use crate::clock::ms_since_epoch;

/// How often the pools are looked after when nothing wakes them.
const TICK: Duration = Duration::from_millis(250);
/// How often each configured template is resolved again (a rebuild is seen within it).
const RESOLVE_EVERY: Duration = Duration::from_secs(1);
/// Pause of a template's refills after a failed start.
const FAILURE_BACKOFF: Duration = Duration::from_secs(5);
/// Refills wait this long after the last claim while the pool holds half its size: a
/// claimed sandbox's first calls come right after its create, and a start beside them
/// (clone, mounts, a new agent) would take the CPU they need.
const REFILL_QUIET: Duration = Duration::from_millis(50);

/// What the pools hold and how they grow.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolSettings {
    /// The templates kept warm (as a create names them) and the least each pool holds.
    pub templates: BTreeMap<String, usize>,
    /// The most one pool holds, however fast creates come.
    pub max_per_template: usize,
    /// Creates counted for a pool's demand.
    pub demand_window: Duration,
    /// Host memory kept available (MiB): below it pooled sandboxes are destroyed and none
    /// is started. `None`: a tenth of the host's memory.
    pub memory_reserve_mb: Option<u64>,
    /// Pooled sandboxes started at once.
    pub refill_concurrency: usize,
}

impl Default for PoolSettings {
    /// No pools.
    fn default() -> Self {
        Self {
            templates: BTreeMap::new(),
            max_per_template: 16,
            demand_window: Duration::from_secs(2),
            memory_reserve_mb: None,
            refill_concurrency: 2,
        }
    }
}

impl PoolSettings {
    /// Whether any template is pooled.
    pub fn enabled(&self) -> bool {
        self.templates.values().any(|n| *n > 0)
    }

    /// Parses `name=size,name=size` (`AENV_POOL_TEMPLATES`).
    pub fn parse_templates(v: &str) -> Result<BTreeMap<String, usize>, String> {
        let mut out = BTreeMap::new();
        for part in v.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (name, n) = part
                .split_once('=')
                .ok_or_else(|| format!("{part:?}: use name=size, e.g. base=2"))?;
            let name = name.trim();
            if name.is_empty() {
                return Err(format!("{part:?}: the template name is empty"));
            }
            let n: usize = n
                .trim()
                .parse()
                .map_err(|_| format!("{part:?}: the size is not a whole number"))?;
            out.insert(name.to_string(), n);
        }
        Ok(out)
    }
}

/// What a pooled sandbox was started as; a create is served by a pool of the same key.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(super) struct PoolKey {
    /// The template's local name (a custom template's build).
    local: String,
    cpu_count: u32,
    memory_mb: u64,
}

/// A started, unclaimed sandbox.
struct Pooled {
    rec: SandboxRecord,
    address: SandboxAddress,
}

/// What a configured template resolves to now.
#[derive(Clone)]
struct Source {
    key: PoolKey,
    /// The record a pooled sandbox of it starts from (id and times set per sandbox).
    base: SandboxRecord,
}

#[derive(Default)]
struct PoolState {
    /// Started sandboxes by key, oldest first.
    ready: HashMap<PoolKey, VecDeque<Pooled>>,
    /// Starts in progress by key.
    starting: HashMap<PoolKey, usize>,
    /// Creates per configured template, within the demand window.
    demand: HashMap<String, VecDeque<Instant>>,
    /// What each configured template resolved to last, and when.
    sources: HashMap<String, (Option<Source>, Instant)>,
    /// Templates whose refills wait after a failure, until then.
    backoff: HashMap<String, Instant>,
    /// When a create last claimed a pooled sandbox.
    last_claim: Option<Instant>,
}

/// Counts of the pools, for heartbeats, `GET /nodes` and `/metrics`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolUsage {
    pub pooled: u32,
    pub allocated_cpu: u32,
    pub allocated_memory_bytes: u64,
    /// Pooled sandboxes being started.
    pub starting: u32,
    pub claims: u64,
    pub misses: u64,
    /// Destroyed because their template was rebuilt.
    pub drained: u64,
    /// Destroyed under memory pressure.
    pub shrunk: u64,
}

/// The pools of one node.
pub(super) struct Pools {
    settings: PoolSettings,
    state: Mutex<PoolState>,
    wake: Notify,
    starts: Semaphore,
    closed: AtomicBool,
    claims: AtomicU64,
    misses: AtomicU64,
    drained: AtomicU64,
    shrunk: AtomicU64,
}

impl Pools {
    pub(super) fn new(settings: PoolSettings) -> Self {
        let starts = Semaphore::new(settings.refill_concurrency.max(1));
        Self {
            settings,
            state: Mutex::new(PoolState::default()),
            wake: Notify::new(),
            starts,
            closed: AtomicBool::new(false),
            claims: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            drained: AtomicU64::new(0),
            shrunk: AtomicU64::new(0),
        }
    }

    pub(super) fn usage(&self) -> PoolUsage {
        let st = self.state.lock();
        let mut u = PoolUsage {
            claims: self.claims.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            drained: self.drained.load(Ordering::Relaxed),
            shrunk: self.shrunk.load(Ordering::Relaxed),
            starting: st.starting.values().sum::<usize>() as u32,
            ..Default::default()
        };
        for p in st.ready.values().flatten() {
            u.pooled += 1;
            u.allocated_cpu += p.rec.cpu_count;
            u.allocated_memory_bytes += p.rec.memory_mb << 20;
        }
        u
    }

    /// Pooled sandboxes of each configured template (as a create names it).
    pub(super) fn sizes(&self) -> BTreeMap<String, usize> {
        let st = self.state.lock();
        self.settings
            .templates
            .keys()
            .map(|t| {
                let n = st
                    .sources
                    .get(t)
                    .and_then(|(s, _)| s.as_ref())
                    .and_then(|s| st.ready.get(&s.key))
                    .map_or(0, VecDeque::len);
                (t.clone(), n)
            })
            .collect()
    }

    /// How many sandboxes template `reference`'s pool should hold now.
    fn target(&self, st: &mut PoolState, reference: &str, now: Instant) -> usize {
        let least = self.settings.templates.get(reference).copied().unwrap_or(0);
        let window = self.settings.demand_window;
        let recent = st.demand.get_mut(reference).map_or(0, |d| {
            while d.front().is_some_and(|t| now.duration_since(*t) > window) {
                d.pop_front();
            }
            d.len()
        });
        least
            .max(recent)
            .min(self.settings.max_per_template.max(least))
    }

    /// Takes the oldest pooled sandbox of `key` for a create of `reference`: the pool of
    /// `reference` when it is configured, else of the configured template that resolves
    /// to the same build (a create naming the template by its id or another of its
    /// names).
    fn take(&self, reference: &str, key: &PoolKey) -> Option<Pooled> {
        let mut st = self.state.lock();
        let pool = if self.settings.templates.contains_key(reference) {
            reference.to_string()
        } else {
            st.sources
                .iter()
                .find(|(_, (s, _))| s.as_ref().is_some_and(|s| &s.key == key))
                .map(|(name, _)| name.clone())?
        };
        st.demand.entry(pool).or_default().push_back(Instant::now());
        let got = st.ready.get_mut(key).and_then(VecDeque::pop_front);
        if got.is_some() {
            st.last_claim = Some(Instant::now());
        }
        drop(st);
        if got.is_some() {
            self.claims.fetch_add(1, Ordering::Relaxed);
        } else {
            self.misses.fetch_add(1, Ordering::Relaxed);
        }
        self.wake.notify_one();
        got
    }
}

/// The host's available memory in MiB (`MemAvailable`) and its total, from `meminfo`.
pub(super) fn parse_meminfo(meminfo: &str) -> Option<(u64, u64)> {
    let field = |name: &str| {
        meminfo.lines().find_map(|l| {
            let rest = l.strip_prefix(name)?.strip_prefix(':')?;
            rest.split_whitespace().next()?.parse::<u64>().ok()
        })
    };
    Some((field("MemAvailable")? / 1024, field("MemTotal")? / 1024))
}

fn host_memory() -> Option<(u64, u64)> {
    parse_meminfo(&std::fs::read_to_string("/proc/meminfo").ok()?)
}

impl Orchestrator {
    /// What the pools hold, for heartbeats, `GET /nodes` and `/metrics`.
    pub fn pool_usage(&self) -> PoolUsage {
        self.pools.usage()
    }

    /// Pooled sandboxes of each configured template.
    pub fn pool_sizes(&self) -> BTreeMap<String, usize> {
        self.pools.sizes()
    }

    /// Every pooled sandbox's id and where the node reaches it.
    pub fn pooled(&self) -> Vec<(String, SandboxAddress)> {
        let st = self.pools.state.lock();
        st.ready
            .values()
            .flatten()
            .map(|p| (p.rec.id.clone(), p.address))
            .collect()
    }

    /// The key of a create, when a pool could serve it: `template` is what it resolved to.
    pub(super) fn pool_key(&self, req: &CreateRequest, template: &str) -> Option<PoolKey> {
        let o = &req.options;
        let default_egress = o.network.is_empty() && o.allow_internet_access != Some(false);
        let plain = req.id.is_none()
            && req.disk_size_mb.is_none()
            && o.volume_mounts.is_empty()
            && default_egress
            && req
                .cpu_count
                .is_none_or(|c| c == self.cfg.default_cpu_count)
            && req
                .memory_mb
                .is_none_or(|m| m == self.cfg.default_memory_mb);
        plain.then(|| PoolKey {
            local: template.to_string(),
            cpu_count: self.cfg.default_cpu_count,
            memory_mb: self.cfg.default_memory_mb,
        })
    }

    /// Claims a pooled sandbox of `key` for a create of template `reference`, if one is
    /// ready: its record (id, template, resources) and address.
    pub(super) fn pool_take(
        &self,
        reference: &str,
        key: &PoolKey,
    ) -> Option<(SandboxRecord, SandboxAddress)> {
        self.pools.take(reference, key).map(|p| (p.rec, p.address))
    }

    /// Starts the pools' keeper (nothing when no template is pooled); it stops at
    /// shutdown.
    pub fn start_pools(self: &Arc<Self>) -> Option<tokio::task::JoinHandle<()>> {
        if !self.pools.settings.enabled() {
            return None;
        }
        tracing::info!(templates = ?self.pools.settings.templates, "keeping pools of started sandboxes");
        let this = self.clone();
        Some(tokio::spawn(async move {
            while !this.is_shutting_down() {
                match this.tend_pools().await {
                    // Refills wait for a quiet moment: no wake-up before it.
                    Some(quiet) => tokio::time::sleep(quiet).await,
                    None => {
                        let _ = tokio::time::timeout(TICK, this.pools.wake.notified()).await;
                    }
                }
            }
        }))
    }

    /// One round: resolves the templates again when due, destroys what is stale or too
    /// much for the memory left, and starts what is missing. Returns how long to wait
    /// when refills were put off because a claim just happened.
    async fn tend_pools(self: &Arc<Self>) -> Option<Duration> {
        let now = Instant::now();
        let templates: Vec<String> = self.pools.settings.templates.keys().cloned().collect();
        for t in &templates {
            let due = self
                .pools
                .state
                .lock()
                .sources
                .get(t)
                .is_none_or(|(_, at)| now.duration_since(*at) >= RESOLVE_EVERY);
            if due {
                let source = match self.pool_source(t).await {
                    Ok(s) => s,
                    Err(e) => {
                        tracing::warn!(template = %t, error = %e, "resolving a pooled template");
                        None
                    }
                };
                self.pools
                    .state
                    .lock()
                    .sources
                    .insert(t.clone(), (source, now));
            }
        }
        self.drain_stale().await;
        if self.memory_pressed() {
            self.shrink_one().await;
            return None;
        }
        let since_claim = self
            .pools
            .state
            .lock()
            .last_claim
            .map(|t| now.saturating_duration_since(t));
        let quiet = since_claim.is_none_or(|d| d >= REFILL_QUIET);
        let mut put_off = false;
        for t in templates {
            put_off |= !self.refill(&t, now, quiet);
        }
        put_off.then(|| REFILL_QUIET.saturating_sub(since_claim.unwrap_or_default()))
    }

    /// What template `reference` resolves to, when its sandboxes can be pooled.
    async fn pool_source(&self, reference: &str) -> Result<Option<Source>, LifecycleError> {
        let mut rec = self.blank_record(reference);
        match self.resolve_custom_template(reference).await? {
            Some(c) => {
                if c.start_cmd.is_some() || c.ready_cmd.is_some() {
                    return Ok(None);
                }
                rec.template = c.local;
                rec.options.env_vars = c.state.env.clone();
                rec.snapshot_id = Some(c.template_id);
                rec.snapshot_name = c.name;
            }
            None => {
                if self.resolve_snapshot(reference).await?.is_some() {
                    return Ok(None);
                }
            }
        }
        let key = PoolKey {
            local: rec.template.clone(),
            cpu_count: rec.cpu_count,
            memory_mb: rec.memory_mb,
        };
        Ok(Some(Source { key, base: rec }))
    }

    /// A record of a default create of `template`.
    fn blank_record(&self, template: &str) -> SandboxRecord {
        SandboxRecord {
            id: String::new(),
            template: template.to_string(),
            state: State::Creating,
            created_at_ms: 0,
            timeout_secs: self.cfg.default_timeout.as_secs(),
            options: SandboxOptions::default(),
            cpu_count: self.cfg.default_cpu_count,
            memory_mb: self.cfg.default_memory_mb,
            disk_size_mb: None,
            expires_at_ms: None,
            deadline: None,
            address: None,
            restored: false,
            kept: None,
            snapshot_id: None,
            snapshot_name: None,
            start: None,
            pause_mode: None,
            paused_at_ms: None,
        }
    }

    /// Destroys pooled sandboxes no configured template resolves to any more (a rebuilt
    /// template's older build, a template no longer poolable).
    async fn drain_stale(&self) {
        let stale: Vec<Pooled> = {
            let mut st = self.pools.state.lock();
            let current: Vec<PoolKey> = st
                .sources
                .values()
                .filter_map(|(s, _)| s.as_ref().map(|s| s.key.clone()))
                .collect();
            let old: Vec<PoolKey> = st
                .ready
                .keys()
                .filter(|k| !current.contains(k))
                .cloned()
                .collect();
            old.iter()
                .filter_map(|k| st.ready.remove(k))
                .flatten()
                .collect()
        };
        for p in stale {
            self.pools.drained.fetch_add(1, Ordering::Relaxed);
            tracing::info!(sandbox = %p.rec.id, template = %p.rec.template, "destroying a pooled sandbox of an older build");
            self.discard_pooled(&p.rec.id).await;
        }
    }

    /// Whether the host's available memory is below the reserve.
    fn memory_pressed(&self) -> bool {
        let Some((available, total)) = host_memory() else {
            return false;
        };
        let reserve = self.pools.settings.memory_reserve_mb.unwrap_or(total / 10);
        available < reserve
    }

    /// Destroys the pooled sandbox of the largest pool (memory pressure).
    async fn shrink_one(&self) {
        let victim = {
            let mut st = self.pools.state.lock();
            let key = st
                .ready
                .iter()
                .filter(|(_, q)| !q.is_empty())
                .max_by_key(|(_, q)| q.len())
                .map(|(k, _)| k.clone());
            key.and_then(|k| st.ready.get_mut(&k).and_then(VecDeque::pop_back))
        };
        if let Some(p) = victim {
            self.pools.shrunk.fetch_add(1, Ordering::Relaxed);
            tracing::info!(sandbox = %p.rec.id, template = %p.rec.template, "memory pressure: destroying a pooled sandbox");
            self.discard_pooled(&p.rec.id).await;
        }
    }

    /// Starts what template `reference`'s pool lacks, as far as the start slots allow;
    /// unless `quiet`, only when the pool holds less than half its target. Whether it
    /// was not put off.
    fn refill(self: &Arc<Self>, reference: &str, now: Instant, quiet: bool) -> bool {
        let mut st = self.pools.state.lock();
        if st.backoff.get(reference).is_some_and(|until| now < *until) {
            return true;
        }
        let Some(source) = st.sources.get(reference).and_then(|(s, _)| s.clone()) else {
            return true;
        };
        let target = self.pools.target(&mut st, reference, now);
        let ready = st.ready.get(&source.key).map_or(0, VecDeque::len);
        let have = ready + st.starting.get(&source.key).copied().unwrap_or(0);
        if have >= target {
            return true;
        }
        if !quiet && ready * 2 >= target {
            return false;
        }
        for _ in have..target {
            let Ok(permit) = self.pools.starts.try_acquire() else {
                return true;
            };
            permit.forget();
            *st.starting.entry(source.key.clone()).or_default() += 1;
            let (this, source, reference) = (self.clone(), source.clone(), reference.to_string());
            tokio::spawn(async move {
                let started = this.start_pooled(&source).await;
                this.pools.starts.add_permits(1);
                if let Some(extra) = this.settle_pooled(&reference, &source.key, started) {
                    this.discard_pooled(&extra).await;
                }
                this.pools.wake.notify_one();
            });
        }
        true
    }

    /// Puts a pooled sandbox that started into its pool; returns its id when it is not
    /// wanted any more (its template resolves to another build now, or the pools are
    /// closed).
    fn settle_pooled(
        &self,
        reference: &str,
        key: &PoolKey,
        started: Result<Pooled, LifecycleError>,
    ) -> Option<String> {
        let mut st = self.pools.state.lock();
        if let Some(n) = st.starting.get_mut(key) {
            *n = n.saturating_sub(1);
        }
        match started {
            Ok(p) => {
                let current = st
                    .sources
                    .get(reference)
                    .and_then(|(s, _)| s.as_ref())
                    .is_some_and(|s| &s.key == key);
                if current && !self.pools.closed.load(Ordering::SeqCst) {
                    st.ready.entry(key.clone()).or_default().push_back(p);
                    None
                } else {
                    Some(p.rec.id)
                }
            }
            Err(e) => {
                st.backoff
                    .insert(reference.to_string(), Instant::now() + FAILURE_BACKOFF);
                tracing::warn!(template = %reference, error = %e, "starting a pooled sandbox failed; retrying in {FAILURE_BACKOFF:?}");
                None
            }
        }
    }

    /// Starts one sandbox of `source` and waits for its agent; it is not initialized.
    async fn start_pooled(&self, source: &Source) -> Result<Pooled, LifecycleError> {
        if self.is_shutting_down() {
            return Err(LifecycleError::ShuttingDown);
        }
        let mut rec = source.base.clone();
        rec.id = crate::ids::new_sandbox_id();
        rec.created_at_ms = ms_since_epoch(SystemTime::now());
        let info = self.backend.create(rec.spec()).await?;
        let address = info.address;
        let ready = wait_ready(
            address.agent(),
            self.cfg.agent_ready_timeout,
            Duration::from_millis(2),
        )
        .await;
        if let Err(e) = ready {
            self.discard_pooled(&rec.id).await;
            return Err(LifecycleError::Agent {
                id: rec.id,
                reason: e.to_string(),
            });
        }
        Ok(Pooled { rec, address })
    }

    /// Destroys an unclaimed pooled sandbox and its log.
    async fn discard_pooled(&self, id: &str) {
        self.release(id, "destroying a pooled sandbox").await;
        self.forget_observed(id);
    }

    /// Destroys every pooled sandbox (at shutdown); none is started from now on.
    pub(super) async fn close_pools(&self) {
        self.pools.closed.store(true, Ordering::SeqCst);
        let all: Vec<Pooled> = {
            let mut st = self.pools.state.lock();
            st.ready.drain().flat_map(|(_, q)| q).collect()
        };
        for p in all {
            self.discard_pooled(&p.rec.id).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meminfo_gives_available_and_total_memory_in_mib() {
        let m = "MemTotal:       24576000 kB\nMemFree:  100 kB\nMemAvailable:   20480000 kB\n";
        assert_eq!(parse_meminfo(m), Some((20000, 24000)));
        assert_eq!(parse_meminfo("MemTotal: 1 kB\n"), None);
    }

    #[test]
    fn pool_templates_parse_as_name_size_pairs_and_refuse_nonsense() {
        let t = PoolSettings::parse_templates("base=2, python = 4,").unwrap();
        assert_eq!(t.get("base"), Some(&2));
        assert_eq!(t.get("python"), Some(&4));
        assert!(PoolSettings::parse_templates("base").is_err());
        assert!(PoolSettings::parse_templates("=2").is_err());
        assert!(PoolSettings::parse_templates("base=two").is_err());
    }

    #[test]
    fn a_pools_target_follows_demand_between_its_least_and_most() {
        let mut templates = BTreeMap::new();
        templates.insert("base".to_string(), 2);
        let pools = Pools::new(PoolSettings {
            templates,
            max_per_template: 5,
            demand_window: Duration::from_secs(2),
            ..Default::default()
        });
        let now = Instant::now();
        let mut st = PoolState::default();
        assert_eq!(pools.target(&mut st, "base", now), 2);
        assert_eq!(pools.target(&mut st, "other", now), 0);
        st.demand
            .insert("base".into(), (0..4).map(|_| now).collect::<VecDeque<_>>());
        assert_eq!(pools.target(&mut st, "base", now), 4);
        st.demand
            .insert("base".into(), (0..40).map(|_| now).collect::<VecDeque<_>>());
        assert_eq!(pools.target(&mut st, "base", now), 5);
        // Creates older than the window no longer count.
        assert_eq!(
            pools.target(&mut st, "base", now + Duration::from_secs(3)),
            2
        );
    }
}
