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

use std::collections::HashMap;
use std::sync::Arc;

use agentenv_core::proto::scheduler_v1::schedule_request_hint::Kind;
use agentenv_core::proto::scheduler_v1::{NodeSnapshot, ScheduleRequestHint};
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

/// The candidates still holding pooled sandboxes of one template, as the wrapped
/// strategy is shown them (in the candidates' order).
#[derive(Default)]
struct Pooled {
    subset: Vec<Candidate>,
    /// `subset[j]` is `candidates[index[j]]`.
    index: Vec<usize>,
}

/// What one candidate list holds in pools, built once per list (the registry hands out
/// the same list until a heartbeat or a membership change replaces it).
struct View {
    /// Which list: see [`ListId`].
    list: ListId,
    by_template: HashMap<String, Pooled>,
}

/// A candidate list's address and length, and its first and last candidates' heartbeats
/// (held, so their addresses are not reused while the view lives). Every pick also
/// checks the chosen candidate against the list it was given, so a new list that looks
/// the same costs at most a fallback to the strategy, never an ineligible node.
struct ListId {
    at: usize,
    len: usize,
    ends: Option<(Arc<NodeSnapshot>, Arc<NodeSnapshot>)>,
}

impl ListId {
    fn of(candidates: &[Candidate]) -> Self {
        Self {
            at: candidates.as_ptr() as usize,
            len: candidates.len(),
            ends: candidates
                .first()
                .zip(candidates.last())
                .map(|(a, b)| (a.snapshot.clone(), b.snapshot.clone())),
        }
    }

    fn is(&self, candidates: &[Candidate]) -> bool {
        self.at == candidates.as_ptr() as usize
            && self.len == candidates.len()
            && match (&self.ends, candidates.first().zip(candidates.last())) {
                (Some((a, b)), Some((first, last))) => {
                    Arc::ptr_eq(a, &first.snapshot) && Arc::ptr_eq(b, &last.snapshot)
                }
                (None, None) => true,
                _ => false,
            }
    }
}

#[derive(Default)]
struct State {
    view: Option<View>,
    /// By node id: creates sent since its heartbeat the current list holds.
    claims: HashMap<String, NodeClaims>,
}

impl State {
    fn claimed(&self, c: &Candidate, template: &str) -> u32 {
        self.claims
            .get(&c.node.node_id)
            .filter(|nc| nc.reported_at == c.snapshot.reported_at_unix_ms)
            .and_then(|nc| nc.by_template.get(template).copied())
            .unwrap_or(0)
    }

    /// Builds the view of `candidates`, keeping the claims of their heartbeats only.
    fn rebuild(&mut self, candidates: &[Candidate]) {
        let mut old = std::mem::take(&mut self.claims);
        for c in candidates {
            if let Some(nc) = old.remove(&c.node.node_id)
                && nc.reported_at == c.snapshot.reported_at_unix_ms
            {
                self.claims.insert(c.node.node_id.clone(), nc);
            }
        }
        let mut by_template: HashMap<String, Pooled> = HashMap::new();
        for (i, c) in candidates.iter().enumerate() {
            for (t, &n) in &c.snapshot.pooled_by_template {
                if n > self.claimed(c, t) {
                    let p = by_template.entry(t.clone()).or_default();
                    p.subset.push(c.clone());
                    p.index.push(i);
                }
            }
        }
        self.view = Some(View {
            list: ListId::of(candidates),
            by_template,
        });
    }
}

/// Wraps a [`Placement`] so that creates a pool can serve prefer nodes holding a pooled
/// sandbox of their template (see the module documentation). Its name is the wrapped
/// strategy's.
///
/// A Schedule costs a map lookup more than the wrapped strategy's pick; what each node
/// pools is gathered once per candidate list (per heartbeat in small fleets, at most
/// once a second in large ones).
pub struct PreferPooled {
    inner: Arc<dyn Placement>,
    state: Mutex<State>,
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
            state: Mutex::new(State::default()),
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

/// What a pick among the pooled candidates came to.
enum Outcome {
    Chosen(usize),
    /// None left, or the strategy wants none of them: it chooses among all.
    Fallback,
    /// The view is of another list.
    Stale,
}

impl PreferPooled {
    fn pick_pooled(
        &self,
        st: &mut State,
        candidates: &[Candidate],
        template: &str,
        hint: Option<&ScheduleRequestHint>,
    ) -> Outcome {
        let Some(view) = st.view.as_mut() else {
            return Outcome::Stale;
        };
        let Some(p) = view.by_template.get_mut(template) else {
            return Outcome::Fallback;
        };
        if p.subset.is_empty() {
            return Outcome::Fallback;
        }
        let Some(j) = self
            .inner
            .pick(&p.subset, hint)
            .filter(|&j| j < p.index.len())
        else {
            return Outcome::Fallback;
        };
        let i = p.index[j];
        let c = &p.subset[j];
        // The view holds its candidates' Arcs: the same pointers mean the same heartbeat
        // of the same node, eligible in this list.
        let same = candidates.get(i).is_some_and(|now| {
            Arc::ptr_eq(&now.node, &c.node) && Arc::ptr_eq(&now.snapshot, &c.snapshot)
        });
        if !same {
            return Outcome::Stale;
        }
        let reported = c
            .snapshot
            .pooled_by_template
            .get(template)
            .copied()
            .unwrap_or(0);
        let entry = st.claims.entry(c.node.node_id.clone()).or_default();
        if entry.reported_at != c.snapshot.reported_at_unix_ms {
            entry.reported_at = c.snapshot.reported_at_unix_ms;
            entry.by_template.clear();
        }
        let n = entry.by_template.entry(template.to_string()).or_default();
        *n += 1;
        if *n >= reported {
            p.subset.remove(j);
            p.index.remove(j);
        }
        Outcome::Chosen(i)
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
        // Held across the wrapped pick: concurrent creates must not both count the
        // same pooled sandbox as free.
        let mut st = self.state.lock();
        for _ in 0..2 {
            if st.view.as_ref().is_none_or(|v| !v.list.is(candidates)) {
                st.rebuild(candidates);
            }
            match self.pick_pooled(&mut st, candidates, template, hint) {
                Outcome::Chosen(i) => return Some(i),
                Outcome::Fallback => break,
                Outcome::Stale => st.view = None,
            }
        }
        drop(st);
        self.inner.pick(candidates, hint)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::placement::{LeastLoaded, RoundRobin};
    use crate::test_support::node;
    use agentenv_core::proto::scheduler_v1::{NewColdSandboxHint, NewSandboxHint};

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
        assert!(p.state.lock().claims.is_empty());
    }

    #[test]
    fn claims_of_nodes_no_longer_candidates_are_pruned() {
        let p = PreferPooled::new(RoundRobin::default());
        // Every list stays alive, as the registry's lists may while a pick runs.
        let mut lists = Vec::new();
        for i in 0..100 {
            let c = vec![Candidate {
                node: Arc::new(node(&format!("gone-{i}"))),
                ..cands(&[&[("base", 1)]], 1).remove(0)
            }];
            assert_eq!(p.pick(&c, Some(&hint("base", true))), Some(0));
            assert_eq!(p.state.lock().claims.len(), 1);
            lists.push(c);
        }
    }

    #[test]
    fn a_list_other_than_the_view_s_is_never_answered_from_the_view() {
        let p = PreferPooled::new(RoundRobin::default());
        let first = cands(&[&[], &[("base", 5)]], 1);
        assert_eq!(p.pick(&first, Some(&hint("base", true))), Some(1));
        // A new list (a heartbeat) where n1 is gone and n0 pools instead, picked
        // through the old view's key on purpose: the pick checks its choice.
        let second = cands(&[&[("base", 5)]], 2);
        {
            let mut st = p.state.lock();
            let v = st.view.as_mut().unwrap();
            v.list.at = second.as_ptr() as usize;
            v.list.len = second.len();
            v.list.ends = Some((second[0].snapshot.clone(), second[0].snapshot.clone()));
        }
        assert_eq!(p.pick(&second, Some(&hint("base", true))), Some(0));
    }

    #[test]
    fn templates_a_client_makes_up_leave_no_state_behind() {
        // The template comes from the client's create body: a client naming a new one
        // every time must not grow what the scheduler keeps.
        let p = PreferPooled::new(RoundRobin::default());
        let c = cands(&[&[("base", 2)], &[]], 1);
        for i in 0..10_000 {
            let long = format!("{i}-{}", "x".repeat(1000));
            assert!(p.pick(&c, Some(&hint(&long, true))).is_some());
        }
        let st = p.state.lock();
        assert!(st.claims.is_empty());
        let v = st.view.as_ref().unwrap();
        assert_eq!(v.by_template.keys().collect::<Vec<_>>(), ["base"]);
    }
}
