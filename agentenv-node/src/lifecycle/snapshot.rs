//! Snapshots: publishing a running sandbox to the repository, and the snapshot a create
//! starts from.

use std::sync::Arc;

use super::{LifecycleError, Op, Orchestrator};
use crate::backend::KeptState;
use crate::snapshot::{SnapshotError, SnapshotRecord, SnapshotRepo, SnapshotSpec};

impl Orchestrator {
    /// Publishes snapshots to `repo` and starts sandboxes from its snapshots (set once,
    /// at startup).
    pub fn set_snapshot_repository(&self, repo: Arc<SnapshotRepo>) {
        let _ = self.snapshots.set(repo);
    }

    /// The snapshot repository, if configured.
    pub fn snapshot_repository(&self) -> Result<&Arc<SnapshotRepo>, LifecycleError> {
        self.snapshots
            .get()
            .ok_or(LifecycleError::NoSnapshotRepository)
    }

    /// Snapshots a running sandbox and publishes it to the repository (optionally under
    /// `name`); the sandbox keeps running.
    pub async fn snapshot(
        self: &Arc<Self>,
        id: &str,
        name: Option<String>,
    ) -> Result<SnapshotRecord, LifecycleError> {
        self.admit(None)?;
        let repo = self.snapshot_repository()?.clone();
        if let Some(n) = &name {
            crate::snapshot::validate_name(n)?;
        }
        let this = self.clone();
        let id = id.to_string();
        self.detached(async move {
            let slot = this.slot(&id)?;
            let timer = this.metrics.start("snapshot", "total");
            let dir = repo.staging_dir()?;
            let (capture, rec) = {
                let sandbox = slot.lock().await;
                let (rec, before) = {
                    let (r, before) = sandbox.step(Op::Snapshot)?;
                    (r.clone(), before)
                };
                let captured = this.backend.snapshot(&id, dir.path()).await;
                // The sandbox runs on whatever the capture did.
                match &captured {
                    Ok(_) => drop(sandbox.done()),
                    Err(_) => sandbox.undo(before),
                }
                (captured?, rec)
            };
            let spec = SnapshotSpec {
                sandbox_id: rec.id.clone(),
                name,
                template: rec.template.clone(),
                cpu_count: rec.cpu_count,
                memory_mb: rec.memory_mb,
                env: rec.options.env_vars.clone(),
            };
            let published = repo.publish(&spec, capture, dir.path()).await;
            timer.finish(published.is_ok());
            Ok(published?)
        })
        .await
    }

    /// The snapshot `template` names (id or name), when a repository is configured and
    /// it is not the built-in template. An id that names no snapshot is an error (404);
    /// a name that names none is a template name.
    pub(super) async fn resolve_snapshot(
        &self,
        template: &str,
    ) -> Result<Option<SnapshotRecord>, LifecycleError> {
        let Some(repo) = self.snapshots.get() else {
            return Ok(None);
        };
        if template == crate::template::BASE_TEMPLATE {
            return Ok(None);
        }
        match repo.resolve(template).await? {
            Some(r) => Ok(Some(r)),
            None if crate::ids::is_uuid(template) => {
                Err(SnapshotError::NotFound(template.to_string()).into())
            }
            None => Ok(None),
        }
    }

    /// Downloads a snapshot and has the backend turn it into state a create starts from.
    pub(super) async fn import_snapshot(
        &self,
        snap: &SnapshotRecord,
    ) -> Result<KeptState, LifecycleError> {
        let repo = self.snapshot_repository()?;
        let capture = &snap.committed.capture;
        if capture.kind() != Some(self.kind) {
            return Err(SnapshotError::WrongBackend {
                id: snap.id.clone(),
                taken: capture.backend.clone(),
                here: self.kind.to_string(),
            }
            .into());
        }
        let timer = self.metrics.start("create_warm", "snapshot_import");
        let result = async {
            let dir = repo.staging_dir()?;
            repo.download(snap, dir.path()).await?;
            Ok(self
                .backend
                .import_snapshot(&snap.committed.capture, dir.path())
                .await?)
        }
        .await;
        timer.finish(result.is_ok());
        result
    }

    /// Removes state imported for a create that did not start.
    pub(super) async fn discard_imported(&self, kept: Option<&KeptState>) {
        if let Some(k) = kept
            && let Err(e) = self.backend.discard_kept(k).await
        {
            tracing::warn!(path = %k.path.display(), error = %e, "removing an imported snapshot layer");
        }
    }
}
