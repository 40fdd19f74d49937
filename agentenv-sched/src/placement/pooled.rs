//! Pool-aware placement: a create a pool can serve goes to a node holding a pooled
//! sandbox of its template.
//!
//! Nodes report their pooled sandboxes per template in each heartbeat
//! (`NodeSnapshot.pooled_by_template`); the gateway says in the hint which template a
//! create names and whether a pool may serve it (`NewSandboxHint.template_id`,
//! `poolable`). [`PreferPooled`] wraps any [`Placement`]: for such a create it hands the
//! wrapped strategy only the candidates still holding a pooled sandbox of the template,
//! counting each node's last reported figure less the creates of that template it was
//! given since that heartbeat (so a burst spreads over the pooled sandboxes instead of
//! all going to the first node). With no such candidate left, or for any other create,
//! the wrapped strategy chooses among all candidates as it would alone. Capacity is
//! untouched: the candidates are the eligible ones, filtered before placement.
//!
//! The count is an estimate: a heartbeat taken while creates were on their way counts
//! sandboxes they will claim, and refills show only in the next heartbeat. The node
//! decides either way; a create finding its pool empty starts a sandbox as always.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use agentenv_core::proto::scheduler_v1::ScheduleRequestHint;
use agentenv_core::proto::scheduler_v1::schedule_request_hint::Kind;
use parking_lot::Mutex;

use super::{Candidate, Placement};

/// Creates of one node counted since its heartbeat of `reported_at`.
#[derive(Debug, Default)]
struct NodeClaims {
    /// `reported_at_unix_ms` of the heartbeat the claims are subtracted from.
    reported_at: i64,
    /// Creates sent per template (only templates that heartbeat reported).
    by_template: HashMap<String, u32>,
}

/// Wraps a [`Placement`] so that creates a pool can serve prefer nodes holding a pooled
/// sandbox of their template (see the module documentation). Its name is the wrapped
/// strategy's.
pub struct PreferPooled {
    inner: Arc<dyn Placement>,
    /// By node id. Holds nodes that were given a pooled create; pruned to the current
    /// candidates when it grows past them.
    claims: Mutex<HashMap<String, NodeClaims>>,
}

impl std::fmt::Debug for PreferPooled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PreferPooled")
            .field("inner", &self.inner.name())
            .finish_non_exhaustive()
    }
}

impl PreferPooled {
    /// Wraps `inner`.
    pub fn new(inner: impl Placement) -> Self {
        Self::wrap(Arc::new(inner))
    }

    /// Wraps a shared `inner`.
    pub fn wrap(inner: Arc<dyn Placement>) -> Self {
        Self {
            inner,
            claims: Mutex::new(HashMap::new()),
        }
    }
}

/// The template of a create a pool may serve.
fn poolable_template(hint: Option<&ScheduleRequestHint>) -> Option<&str> {
    match hint?.kind.as_ref()? {
        Kind::NewSandbox(h) if h.poolable && !h.template_id.is_empty() => Some(&h.template_id),
        _ => None,
    }
}

impl Placement for PreferPooled {
    fn name(&self) -> &str {
        self.inner.name()
    }

    fn pick(&self, candidates: &[Candidate], hint: Option<&ScheduleRequestHint>) -> Option<usize> {
        let Some(template) = poolable_template(hint) else {
            return self.inner.pick(candidates, hint);
        };
        // Most creates of a cluster without pools stop here, without a lock.
        let reported: Vec<(usize, u32)> = candidates
            .iter()
            .enumerate()
            .filter_map(|(i, c)| {
                let n = *c.snapshot.pooled_by_template.get(template)?;
                (n > 0).then_some((i, n))
            })
            .collect();
        if reported.is_empty() {
            return self.inner.pick(candidates, hint);
        }
        // Held across the wrapped pick: concurrent creates must not both count the
        // same pooled sandbox as free.
        let mut claims = self.claims.lock();
        let claimed = |c: &Candidate| {
            claims
                .get(&c.node.node_id)
                .filter(|nc| nc.reported_at == c.snapshot.reported_at_unix_ms)
                .and_then(|nc| nc.by_template.get(template).copied())
                .unwrap_or(0)
        };
        let pooled: Vec<usize> = reported
            .into_iter()
            .filter(|&(i, n)| claimed(&candidates[i]) < n)
            .map(|(i, _)| i)
            .collect();
        if pooled.is_empty() {
            drop(claims);
            return self.inner.pick(candidates, hint);
        }
        let subset: Vec<Candidate> = pooled.iter().map(|&i| candidates[i].clone()).collect();
        let Some(chosen) = self
            .inner
            .pick(&subset, hint)
            .and_then(|j| pooled.get(j).copied())
        else {
            // The strategy wants none of them: let it choose among all.
            drop(claims);
            return self.inner.pick(candidates, hint);
        };
        if claims.len() >= 2 * candidates.len() + 16 {
            let current: HashSet<&str> = candidates.iter().map(|c| &*c.node.node_id).collect();
            claims.retain(|id, _| current.contains(id.as_str()));
        }
        let c = &candidates[chosen];
        let entry = claims.entry(c.node.node_id.clone()).or_default();
        if entry.reported_at != c.snapshot.reported_at_unix_ms {
            entry.reported_at = c.snapshot.reported_at_unix_ms;
            entry.by_template.clear();
        }
        *entry.by_template.entry(template.to_string()).or_default() += 1;
        Some(chosen)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::placement::{LeastLoaded, RoundRobin};
    use crate::test_support::node;
    use agentenv_core::proto::scheduler_v1::{NewColdSandboxHint, NewSandboxHint, NodeSnapshot};

    /// Candidates `n0`, `n1`, … with these pooled counts (template, count) and the
    /// heartbeat time `at`.
    fn cands(pools: &[&[(&str, u32)]], at: i64) -> Vec<Candidate> {
        pools
            .iter()
            .enumerate()
            .map(|(i, p)| Candidate {
                node: Arc::new(node(&format!("n{i}"))),
                snapshot: Arc::new(NodeSnapshot {
                    reported_at_unix_ms: at,
                    pooled_sandbox_count: p.iter().map(|(_, n)| n).sum(),
                    pooled_by_template: p.iter().map(|(t, n)| (t.to_string(), *n)).collect(),
                    ..Default::default()
                }),
            })
            .collect()
    }

    fn hint(template: &str, poolable: bool) -> ScheduleRequestHint {
        ScheduleRequestHint {
            kind: Some(Kind::NewSandbox(NewSandboxHint {
                template_id: template.into(),
                poolable,
                ..Default::default()
            })),
        }
    }

    fn picks(p: &dyn Placement, c: &[Candidate], h: &ScheduleRequestHint, n: usize) -> Vec<usize> {
        (0..n).map(|_| p.pick(c, Some(h)).unwrap()).collect()
    }

    #[test]
    fn a_poolable_create_goes_to_the_node_holding_a_pooled_sandbox_of_its_template() {
        let c = cands(&[&[], &[("python", 4)], &[("base", 2)]], 1);
        let p = PreferPooled::new(RoundRobin::default());
        assert_eq!(picks(&p, &c, &hint("base", true), 2), [2, 2]);
        assert_eq!(picks(&p, &c, &hint("python", true), 3), [1, 1, 1]);
    }

    #[test]
    fn a_burst_spreads_over_the_pooled_sandboxes_then_falls_back_to_the_strategy() {
        // Round robin alone would give n0 four of eight.
        let c = cands(&[&[("base", 1)], &[("base", 3)], &[], &[("base", 4)]], 1);
        let p = PreferPooled::new(RoundRobin::default());
        let got = picks(&p, &c, &hint("base", true), 8);
        let count = |i| got.iter().filter(|&&g| g == i).count();
        assert_eq!(
            (count(0), count(1), count(2), count(3)),
            (1, 3, 0, 4),
            "{got:?}"
        );
        // Every pooled sandbox is spoken for: the strategy chooses among all, in turn.
        let rest = picks(&p, &c, &hint("base", true), 8);
        for i in 0..4 {
            assert_eq!(rest.iter().filter(|&&g| g == i).count(), 2, "{rest:?}");
        }
    }

    #[test]
    fn a_new_heartbeat_replaces_the_counted_claims() {
        let p = PreferPooled::new(RoundRobin::default());
        let c = cands(&[&[], &[("base", 1)]], 1);
        assert_eq!(picks(&p, &c, &hint("base", true), 1), [1]);
        // Spoken for until the node reports again: round robin over both.
        let again = picks(&p, &c, &hint("base", true), 2);
        assert!(again.contains(&0), "{again:?}");
        // The next heartbeat reports the refilled pool.
        let c = cands(&[&[], &[("base", 1)]], 2);
        assert_eq!(picks(&p, &c, &hint("base", true), 1), [1]);
    }

    #[test]
    fn other_creates_are_placed_by_the_strategy_alone() {
        let c = cands(&[&[], &[("base", 9)], &[]], 1);
        let p = PreferPooled::new(RoundRobin::default());
        let cold = ScheduleRequestHint {
            kind: Some(Kind::NewColdSandbox(NewColdSandboxHint::default())),
        };
        for h in [
            // Resources, volumes, egress or an Idempotency-Key a pool cannot serve.
            hint("base", false),
            // Another template, and a gateway that names none.
            hint("python", true),
            hint("", true),
            cold,
        ] {
            assert_eq!(picks(&p, &c, &h, 3), [0, 1, 2], "{h:?}");
        }
        assert_eq!(p.pick(&c, None), Some(0));
        assert_eq!(p.name(), "round_robin");
    }

    #[test]
    fn the_strategy_still_chooses_among_the_pooled_nodes() {
        let mut c = cands(&[&[("base", 5)], &[("base", 5)], &[]], 1);
        // n2 is the least loaded of all, n1 of those holding pooled sandboxes.
        Arc::make_mut(&mut c[0].snapshot).sandbox_count = 9;
        Arc::make_mut(&mut c[1].snapshot).sandbox_count = 4;
        let p = PreferPooled::new(LeastLoaded);
        assert_eq!(p.pick(&c, Some(&hint("base", true))), Some(1));
        assert_eq!(p.pick(&c, Some(&hint("base", false))), Some(2));
    }

    /// Refuses every set that holds more than one candidate.
    struct OnlyAlone;

    impl Placement for OnlyAlone {
        fn name(&self) -> &str {
            "only_alone"
        }
        fn pick(&self, c: &[Candidate], _: Option<&ScheduleRequestHint>) -> Option<usize> {
            (c.len() == 1).then_some(0)
        }
    }

    #[test]
    fn a_strategy_refusing_the_pooled_nodes_decides_among_all_and_nothing_is_claimed() {
        let c = cands(&[&[("base", 1)], &[("base", 1)]], 1);
        let p = PreferPooled::new(OnlyAlone);
        assert_eq!(p.pick(&c, Some(&hint("base", true))), None);
        assert!(p.claims.lock().is_empty());
    }

    #[test]
    fn claims_of_nodes_no_longer_candidates_are_pruned() {
        let p = PreferPooled::new(RoundRobin::default());
        for i in 0..100 {
            let c = vec![Candidate {
                node: Arc::new(node(&format!("gone-{i}"))),
                ..cands(&[&[("base", 1)]], 1).remove(0)
            }];
            assert_eq!(p.pick(&c, Some(&hint("base", true))), Some(0));
        }
        assert!(p.claims.lock().len() <= 18, "{}", p.claims.lock().len());
    }
}
