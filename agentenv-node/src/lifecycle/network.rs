//! `PUT /network`: replacing a sandbox's egress rules, running or paused.

use std::sync::Arc;

use super::{LifecycleError, Op, Orchestrator, State, next};
use crate::egress::{EgressPolicy, EgressRules};

impl Orchestrator {
    /// Replaces sandbox `id`'s egress rules and internet access at once (what the caller
    /// leaves out is cleared). A running sandbox gets them in its namespace now; a paused
    /// one too while its backend sandbox exists, and its record on disk keeps them for a
    /// resume after a node restart. On failure nothing changes.
    pub async fn update_network(
        self: &Arc<Self>,
        id: &str,
        rules: EgressRules,
        allow_internet_access: Option<bool>,
    ) -> Result<(), LifecycleError> {
        self.admit(None)?;
        let bad = |e: crate::egress::PolicyError| LifecycleError::BadRequest(e.to_string());
        let rules = rules.checked().map_err(bad)?;
        let policy = EgressPolicy::new(&rules, allow_internet_access).map_err(bad)?;
        self.on_sandbox(id, move |this, sandbox| async move {
            if !this.is_present(&sandbox.id) {
                return Err(LifecycleError::NotFound(sandbox.id.clone()));
            }
            let (state, restored, old) = {
                let r = sandbox.rec.lock();
                next(r.state, Op::SetNetwork).map_err(|e| e.for_sandbox(&sandbox.id))?;
                (r.state, r.restored, r.clone())
            };
            if !restored {
                this.backend.set_egress(&sandbox.id, policy).await?;
            }
            let rec = {
                let mut r = sandbox.rec.lock();
                r.options.network = rules;
                r.options.allow_internet_access = allow_internet_access;
                r.clone()
            };
            if state == State::Paused
                && let Err(e) = this.store.save(&rec)
            {
                {
                    let mut r = sandbox.rec.lock();
                    r.options.network = old.options.network.clone();
                    r.options.allow_internet_access = old.options.allow_internet_access;
                }
                if !restored
                    && let Err(e) = this
                        .backend
                        .set_egress(&sandbox.id, old.egress_policy())
                        .await
                {
                    tracing::warn!(sandbox = %sandbox.id, error = %e, "restoring the egress rules after a failed save");
                }
                return Err(e.into());
            }
            tracing::info!(sandbox = %sandbox.id, "egress rules replaced");
            Ok(())
        })
        .await
    }
}
