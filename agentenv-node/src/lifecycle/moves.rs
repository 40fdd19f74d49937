//! Moving a paused sandbox to another node through the snapshot repository.
//!
//! The node that has it exports it: the sandbox's memory goes (it starts afresh on its
//! files, as after a pause without memory), its kept files are published as a snapshot,
//! and it turns `moving`: not resumed here, left out of this node's heartbeat roster so
//! that its binding can follow it. The node that takes it over imports it: the snapshot
//! becomes its kept state there, under the same id, paused. Then the first node deletes
//! its copy (or, when the import failed, the move is cancelled and it stays here).
//!
//! What the new node trusts comes from the signed snapshot record (the files, template,
//! environment and resources); the rest of the exported record (metadata, timeouts,
//! lifecycle settings, egress rules, volume mounts) is checked as a create checks it.

use std::sync::Arc;
use std::time::SystemTime;

use serde::{Deserialize, Serialize};

use super::{LifecycleError, Op, Orchestrator, PauseMode, SandboxRecord, Slot, State};
use crate::clock::ms_since_epoch;
use crate::snapshot::{SnapshotError, SnapshotSpec};

/// What a node gives another that takes one of its paused sandboxes over.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Export {
    /// The snapshot holding the sandbox's files.
    #[serde(rename = "snapshotID")]
    pub snapshot_id: String,
    /// The sandbox's record.
    pub sandbox: SandboxRecord,
}

impl Orchestrator {
    /// Publishes paused sandbox `id` for another node and marks it moving (see the
    /// module docs). A sandbox moving already is published again (a retried move).
    pub async fn export(self: &Arc<Self>, id: &str) -> Result<Export, LifecycleError> {
        self.admit(None)?;
        let repo = self.snapshot_repository()?.clone();
        self.on_sandbox(id, move |this, sandbox| async move {
            let before = {
                let r = sandbox.rec.lock();
                r.state
            };
            if before != State::Moving {
                drop(sandbox.step(Op::Move)?);
            }
            let result = async {
                let rec = this.files_only(&sandbox).await?;
                let kept = rec.kept.clone().ok_or_else(|| {
                    LifecycleError::Internal(format!(
                        "sandbox {} has no kept files to move",
                        rec.id
                    ))
                })?;
                let dir = repo.staging_dir()?;
                let capture = this.backend.capture_kept(&kept, dir.path()).await?;
                let spec = SnapshotSpec {
                    sandbox_id: rec.id.clone(),
                    name: None,
                    template: rec.template.clone(),
                    cpu_count: rec.cpu_count,
                    memory_mb: rec.memory_mb,
                    env: rec.options.env_vars.clone(),
                };
                let published = repo.publish(&spec, capture, dir.path()).await?;
                Ok(Export {
                    snapshot_id: published.id,
                    sandbox: rec,
                })
            }
            .await;
            if result.is_err() {
                sandbox.undo(before);
            } else {
                tracing::info!(sandbox = %sandbox.id, "sandbox exported for a move");
                this.log_event(&sandbox.id, "sandbox exported to move to another node");
            }
            result
        })
        .await
    }

    /// The move of sandbox `id` did not happen: it stays here, paused.
    pub async fn cancel_move(self: &Arc<Self>, id: &str) -> Result<SandboxRecord, LifecycleError> {
        self.on_sandbox(id, move |_this, sandbox| async move {
            drop(sandbox.step(Op::CancelMove)?);
            tracing::info!(sandbox = %sandbox.id, "move cancelled; the sandbox stays here");
            Ok(sandbox.rec.lock().clone())
        })
        .await
    }

    /// Takes over a sandbox another node exported: it is paused here, with the files of
    /// the export's snapshot, and starts afresh on them when resumed.
    pub async fn import(self: &Arc<Self>, export: Export) -> Result<SandboxRecord, LifecycleError> {
        self.admit(None)?;
        let id = export.sandbox.id.clone();
        crate::backend::validate_sandbox_id(&id)
            .map_err(|e| LifecycleError::BadRequest(format!("sandbox: {e}")))?;
        if self.is_present(&id) {
            return Err(LifecycleError::Conflict(format!(
                "sandbox {id} is on this node already: move it to another node"
            )));
        }
        let snap = self
            .snapshot_repository()?
            .resolve(&export.snapshot_id)
            .await?
            .ok_or_else(|| SnapshotError::NotFound(export.snapshot_id.clone()))?;
        let crate::snapshot::SnapshotSource::Sandbox { source_sandbox_id } = &snap.source;
        if *source_sandbox_id != id {
            return Err(LifecycleError::BadRequest(format!(
                "snapshot {} holds sandbox {source_sandbox_id}, not {id}: export the sandbox again",
                snap.id
            )));
        }
        let mut rec = export.sandbox;
        rec.options.network = rec
            .options
            .network
            .checked()
            .map_err(|e| LifecycleError::BadRequest(format!("network: {e}")))?;
        crate::volume::validate_mounts(
            rec.options
                .volume_mounts
                .iter()
                .map(|m| (m.name.as_str(), m.path.as_str())),
        )
        .map_err(|m| LifecycleError::BadRequest(format!("volumeMounts: {m}")))?;
        self.check_volumes(&rec.options.volume_mounts).await?;
        // What the signed record says, never what the caller sent.
        rec.template = snap.committed.template.clone();
        rec.options.env_vars = snap.committed.env.clone();
        rec.cpu_count = snap.resources.cpu_count;
        rec.memory_mb = snap.resources.memory_mb;
        rec.state = State::Paused;
        rec.restored = true;
        rec.deadline = None;
        rec.expires_at_ms = None;
        rec.address = None;
        rec.pause_mode = Some(PauseMode::Filesystem);
        rec.paused_at_ms = rec
            .paused_at_ms
            .or_else(|| Some(ms_since_epoch(SystemTime::now())));
        rec.kept = Some(self.import_snapshot(&snap).await?);
        let slot = Slot::new(rec.clone());
        let inserted = {
            let mut slots = self.slots.lock();
            let free = !slots.contains_key(&id);
            if free {
                slots.insert(id.clone(), slot);
            }
            free
        };
        if !inserted {
            self.discard_imported(rec.kept.as_ref()).await;
            return Err(LifecycleError::Conflict(format!(
                "sandbox {id} is on this node already: move it to another node"
            )));
        }
        if let Err(e) = self.store.save(&rec) {
            self.slots.lock().remove(&id);
            self.discard_imported(rec.kept.as_ref()).await;
            return Err(e.into());
        }
        self.log_event(&id, "sandbox moved here from another node");
        tracing::info!(sandbox = %id, snapshot = %snap.id, "sandbox imported from another node");
        Ok(rec)
    }

    /// Drops the memory of paused sandbox `slot` if it still has it (its files are kept);
    /// returns its record.
    async fn files_only(&self, slot: &Slot) -> Result<SandboxRecord, LifecycleError> {
        if !slot.rec.lock().restored {
            self.keep_files(slot).await?;
            slot.rec.lock().pause_mode = Some(PauseMode::Filesystem);
        }
        Ok(slot.rec.lock().clone())
    }
}
