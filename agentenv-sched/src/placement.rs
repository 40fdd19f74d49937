//! Placement: which healthy node gets a new sandbox.
//!
//! The registry hands a [`Placement`] the eligible candidates (discovered, not
//! lingering, fresh heartbeat, within the resource limits), sorted by node id;
//! the placement returns the index of its choice. Built-ins: `round_robin`,
//! `random`, `least_loaded` and `power_of_two`. Embedding code may pass its own.
//! [`PreferPooled`] wraps any of them so that a create a pool can serve goes to a node
//! holding a pooled sandbox of its template (`scheduler.prefer_pooled_nodes`, on by
//! default for the built-ins).

mod pooled;

pub use pooled::PreferPooled;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use agentenv_core::config::{NodeResourceLimit, Strategy};
use agentenv_core::proto::scheduler_v1::{Node, NodeSnapshot, ScheduleRequestHint};
use rand::Rng;

/// One eligible node, with the snapshot of its last heartbeat.
#[derive(Debug, Clone)]
pub struct Candidate {
    pub node: Arc<Node>,
    pub snapshot: Arc<NodeSnapshot>,
}

impl Candidate {
    /// Running plus starting sandboxes, as last reported.
    pub fn sandbox_load(&self) -> u64 {
        u64::from(self.snapshot.sandbox_count) + u64::from(self.snapshot.sandbox_starting_count)
    }

    /// Fraction of the node's memory allocated to running sandboxes (0 when unknown).
    pub fn memory_allocated_ratio(&self) -> f64 {
        let s = &self.snapshot;
        if s.memory_total_bytes == 0 {
            0.0
        } else {
            s.allocated_memory_bytes as f64 / s.memory_total_bytes as f64
        }
    }
}

/// Chooses one node among candidates.
pub trait Placement: Send + Sync + 'static {
    /// The strategy's name, used as a metrics label.
    fn name(&self) -> &str;

    /// Returns the index of the chosen candidate. `candidates` is never empty.
    /// `None` means "none of these": the Schedule RPC then answers UNAVAILABLE.
    fn pick(&self, candidates: &[Candidate], hint: Option<&ScheduleRequestHint>) -> Option<usize>;
}

/// Builds the built-in placement of a configured strategy (`None` for an
/// unknown one). Its [`Placement::name`] is the strategy's config spelling.
pub fn builtin(strategy: &Strategy) -> Option<Box<dyn Placement>> {
    match strategy {
        Strategy::RoundRobin => Some(Box::new(RoundRobin::default())),
        Strategy::Random => Some(Box::new(Random)),
        Strategy::LeastLoaded => Some(Box::new(LeastLoaded)),
        Strategy::PowerOfTwo => Some(Box::new(PowerOfTwo)),
        Strategy::Unknown(_) => None,
    }
}

/// Takes candidates in turn: a, b, c, a, …
#[derive(Debug, Default)]
pub struct RoundRobin {
    counter: AtomicU64,
}

impl Placement for RoundRobin {
    fn name(&self) -> &str {
        "round_robin"
    }

    fn pick(&self, candidates: &[Candidate], _: Option<&ScheduleRequestHint>) -> Option<usize> {
        let n = self.counter.fetch_add(1, Ordering::Relaxed);
        Some((n % candidates.len() as u64) as usize)
    }
}

/// A uniformly random candidate.
#[derive(Debug, Default)]
pub struct Random;

impl Placement for Random {
    fn name(&self) -> &str {
        "random"
    }

    fn pick(&self, candidates: &[Candidate], _: Option<&ScheduleRequestHint>) -> Option<usize> {
        (!candidates.is_empty()).then(|| rand::rng().random_range(0..candidates.len()))
    }
}

/// The candidate with the fewest running + starting sandboxes; ties go to the
/// one with less memory allocated, then to the lowest id.
#[derive(Debug, Default)]
pub struct LeastLoaded;

fn less_loaded(a: &Candidate, b: &Candidate) -> bool {
    (a.sandbox_load(), a.memory_allocated_ratio()) < (b.sandbox_load(), b.memory_allocated_ratio())
}

impl Placement for LeastLoaded {
    fn name(&self) -> &str {
        "least_loaded"
    }

    fn pick(&self, candidates: &[Candidate], _: Option<&ScheduleRequestHint>) -> Option<usize> {
        let mut best = 0;
        for (i, c) in candidates.iter().enumerate().skip(1) {
            if less_loaded(c, &candidates[best]) {
                best = i;
            }
        }
        (!candidates.is_empty()).then_some(best)
    }
}

/// Samples two distinct candidates at random and takes the less loaded one:
/// nearly the balance of least-loaded without every scheduler herding onto
/// the same node between heartbeats.
#[derive(Debug, Default)]
pub struct PowerOfTwo;

impl Placement for PowerOfTwo {
    fn name(&self) -> &str {
        "power_of_two"
    }

    fn pick(&self, candidates: &[Candidate], _: Option<&ScheduleRequestHint>) -> Option<usize> {
        let n = candidates.len();
        match n {
            0 => None,
            1 => Some(0),
            _ => {
                let mut rng = rand::rng();
                let a = rng.random_range(0..n);
                let mut b = rng.random_range(0..n - 1);
                if b >= a {
                    b += 1;
                }
                Some(if less_loaded(&candidates[b], &candidates[a]) {
                    b
                } else {
                    a
                })
            }
        }
    }
}

/// True when a snapshot is within every configured limit. Limits are
/// exceeded only strictly: a value equal to its limit passes.
pub fn passes_limits(limit: &NodeResourceLimit, s: &NodeSnapshot) -> bool {
    let over = |value: u64, max: Option<u32>| max.is_some_and(|m| value > u64::from(m));
    let pct = |part: u64, total: u64| (total > 0).then(|| part.saturating_mul(100) / total);
    let over_pct =
        |part: u64, total: u64, max: Option<u32>| pct(part, total).is_some_and(|p| over(p, max));
    !(over(s.sandbox_count.into(), limit.max_sandbox_count)
        || over(
            s.sandbox_starting_count.into(),
            limit.max_sandbox_starting_count,
        )
        || over(s.cpu_percent.into(), limit.max_cpu_used_percent)
        || over_pct(
            s.allocated_cpu.into(),
            s.cpu_count.into(),
            limit.max_cpu_allocated_percent,
        )
        || over_pct(
            s.memory_used_bytes,
            s.memory_total_bytes,
            limit.max_memory_used_percent,
        )
        || over_pct(
            s.allocated_memory_bytes,
            s.memory_total_bytes,
            limit.max_memory_allocated_percent,
        )
        || over(
            u64::from(s.sandbox_count) + u64::from(s.paused_sandbox_count),
            limit.max_sandbox_count_including_paused,
        )
        // Pooled sandboxes hold their resources like paused ones do; a create claiming
        // one adds nothing, so they count in the allocations only, not in the counts.
        || over(
            u64::from(s.allocated_cpu)
                + u64::from(s.paused_allocated_cpu)
                + u64::from(s.pooled_allocated_cpu),
            limit.max_allocated_cpu_including_paused,
        )
        || limit
            .max_allocated_memory_bytes_including_paused
            .is_some_and(|m| {
                s.allocated_memory_bytes
                    .saturating_add(s.paused_allocated_memory_bytes)
                    .saturating_add(s.pooled_allocated_memory_bytes)
                    > m
            }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::node;

    fn snap(count: u32) -> NodeSnapshot {
        NodeSnapshot {
            sandbox_count: count,
            ..Default::default()
        }
    }

    fn cands(loads: &[u32]) -> Vec<Candidate> {
        loads
            .iter()
            .enumerate()
            .map(|(i, &l)| Candidate {
                node: Arc::new(node(&format!("n{i}"))),
                snapshot: Arc::new(snap(l)),
            })
            .collect()
    }

    #[test]
    fn round_robin_cycles_a_b_c_a() {
        let c = cands(&[0, 0, 0]);
        let rr = RoundRobin::default();
        let picks: Vec<_> = (0..4).map(|_| rr.pick(&c, None).unwrap()).collect();
        assert_eq!(picks, [0, 1, 2, 0]);
    }

    #[test]
    fn random_with_no_candidates_picks_nothing() {
        assert_eq!(Random.pick(&[], None), None);
        assert_eq!(PowerOfTwo.pick(&[], None), None);
        assert_eq!(LeastLoaded.pick(&[], None), None);
    }

    #[test]
    fn random_covers_every_candidate() {
        let c = cands(&[0, 0, 0]);
        let mut seen = [false; 3];
        for _ in 0..300 {
            seen[Random.pick(&c, None).unwrap()] = true;
        }
        assert_eq!(seen, [true; 3]);
    }

    #[test]
    fn least_loaded_takes_fewest_sandboxes_then_lowest_id() {
        assert_eq!(LeastLoaded.pick(&cands(&[5, 2, 2]), None), Some(1));
    }

    #[test]
    fn power_of_two_never_picks_the_most_loaded_of_two() {
        let c = cands(&[9, 1]);
        for _ in 0..50 {
            assert_eq!(PowerOfTwo.pick(&c, None), Some(1));
        }
    }

    #[test]
    fn power_of_two_never_picks_the_single_most_loaded_node() {
        // Two distinct samples can never both be the loaded node.
        let mut loads = vec![1; 10];
        loads[0] = 100;
        let c = cands(&loads);
        for _ in 0..500 {
            assert_ne!(PowerOfTwo.pick(&c, None), Some(0));
        }
    }

    #[test]
    fn builtins_are_found_by_name() {
        for name in agentenv_core::config::BUILTIN_STRATEGIES {
            assert_eq!(builtin(&Strategy::from(name)).unwrap().name(), name);
        }
        assert!(builtin(&Strategy::from("nope")).is_none());
    }

    fn limit() -> NodeResourceLimit {
        NodeResourceLimit::default()
    }

    #[test]
    fn filter_without_limits_keeps_everything() {
        assert!(passes_limits(&limit(), &snap(1_000_000)));
    }

    #[test]
    fn each_limit_drops_strictly_over_and_keeps_equal() {
        type Case = (fn(&mut NodeResourceLimit), fn(&mut NodeSnapshot, u32));
        let cases: Vec<Case> = vec![
            (
                |l| l.max_sandbox_count = Some(10),
                |s, v| s.sandbox_count = v,
            ),
            (
                |l| l.max_sandbox_starting_count = Some(10),
                |s, v| s.sandbox_starting_count = v,
            ),
            (
                |l| l.max_cpu_used_percent = Some(10),
                |s, v| s.cpu_percent = v,
            ),
            (
                |l| l.max_cpu_allocated_percent = Some(10),
                |s, v| {
                    s.cpu_count = 100;
                    s.allocated_cpu = v;
                },
            ),
            (
                |l| l.max_memory_used_percent = Some(10),
                |s, v| {
                    s.memory_total_bytes = 100;
                    s.memory_used_bytes = v.into();
                },
            ),
            (
                |l| l.max_memory_allocated_percent = Some(10),
                |s, v| {
                    s.memory_total_bytes = 100;
                    s.allocated_memory_bytes = v.into();
                },
            ),
        ];
        for (i, (set_limit, set_value)) in cases.into_iter().enumerate() {
            let mut l = limit();
            set_limit(&mut l);
            let mut at = NodeSnapshot::default();
            set_value(&mut at, 10);
            assert!(passes_limits(&l, &at), "case {i}: equal value must pass");
            let mut over = NodeSnapshot::default();
            set_value(&mut over, 11);
            assert!(
                !passes_limits(&l, &over),
                "case {i}: value over the limit must be dropped"
            );
        }
    }

    #[test]
    fn cpu_allocated_percent_is_skipped_without_cpu_count_and_may_exceed_100() {
        let l = NodeResourceLimit {
            max_cpu_allocated_percent: Some(150),
            ..limit()
        };
        let s = NodeSnapshot {
            allocated_cpu: 1000,
            cpu_count: 0,
            ..Default::default()
        };
        assert!(passes_limits(&l, &s));
        let s = NodeSnapshot {
            allocated_cpu: 6,
            cpu_count: 4,
            ..Default::default()
        };
        assert!(passes_limits(&l, &s), "6/4 = 150% is at the limit");
        let s = NodeSnapshot {
            allocated_cpu: 7,
            cpu_count: 4,
            ..Default::default()
        };
        assert!(!passes_limits(&l, &s));
    }

    #[test]
    fn including_paused_limits_count_paused_and_pooled_allocations() {
        let l = NodeResourceLimit {
            max_sandbox_count: Some(10),
            max_sandbox_count_including_paused: Some(10),
            max_allocated_cpu_including_paused: Some(8),
            max_allocated_memory_bytes_including_paused: Some(1 << 30),
            ..limit()
        };
        let base = NodeSnapshot {
            sandbox_count: 5,
            ..Default::default()
        };
        assert!(passes_limits(&l, &base));
        let paused = NodeSnapshot {
            paused_sandbox_count: 6,
            ..base.clone()
        };
        assert!(!passes_limits(&l, &paused));
        let cpu = NodeSnapshot {
            allocated_cpu: 4,
            paused_allocated_cpu: 5,
            ..base.clone()
        };
        assert!(!passes_limits(&l, &cpu));
        let mem = NodeSnapshot {
            allocated_memory_bytes: 1 << 29,
            paused_allocated_memory_bytes: (1 << 29) + 1,
            ..base.clone()
        };
        assert!(!passes_limits(&l, &mem));
        // Pooled sandboxes hold their allocations too, but are no sandboxes of anyone's.
        let pooled = NodeSnapshot {
            allocated_memory_bytes: 1 << 29,
            pooled_sandbox_count: 20,
            pooled_allocated_memory_bytes: (1 << 29) + 1,
            ..base.clone()
        };
        assert!(!passes_limits(&l, &pooled));
        let pooled_cpu = NodeSnapshot {
            allocated_cpu: 4,
            pooled_allocated_cpu: 5,
            ..base.clone()
        };
        assert!(!passes_limits(&l, &pooled_cpu));
        let few = NodeSnapshot {
            pooled_sandbox_count: 20,
            ..base
        };
        assert!(passes_limits(&l, &few));
    }

    #[test]
    fn limits_combine() {
        let l = NodeResourceLimit {
            max_sandbox_count: Some(10),
            max_cpu_used_percent: Some(50),
            ..limit()
        };
        let s = NodeSnapshot {
            sandbox_count: 5,
            cpu_percent: 51,
            ..Default::default()
        };
        assert!(!passes_limits(&l, &s));
    }
}
