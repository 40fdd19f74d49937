//! A sandbox's volumes through its life: checked at create, bound (leased, and on `oss`
//! copied to this node) before its backend sandbox starts, uploaded at pause (`oss`),
//! given back when the backend sandbox goes, and their leases dropped when the sandbox
//! is deleted. The record keeps the mounts, so a resumed or restored sandbox (and a
//! fork, which copies the record's options) mounts the same volumes again.

use std::sync::Arc;

use super::{LifecycleError, Orchestrator, SandboxRecord, VolumeMount};
use crate::config::BackendKind;
use crate::volume::Volumes;

impl Orchestrator {
    /// Serves volumes from `volumes` (set once, at startup).
    pub fn set_volumes(&self, volumes: Arc<Volumes>) {
        let _ = self.volumes.set(volumes);
    }

    /// The node's volumes, if configured.
    pub fn volumes(&self) -> Option<&Arc<Volumes>> {
        self.volumes.get()
    }

    /// Checks a create's `mounts` before anything is made: this node can mount volumes
    /// and every volume exists (400 naming the volume otherwise).
    pub(super) async fn check_volumes(&self, mounts: &[VolumeMount]) -> Result<(), LifecycleError> {
        if mounts.is_empty() {
            return Ok(());
        }
        if let Some(why) = volumes_unsupported(self.kind) {
            return Err(LifecycleError::BadRequest(why.into()));
        }
        let Some(v) = self.volumes.get() else {
            return Err(LifecycleError::BadRequest(
                "this node serves no volumes: create the sandbox without volumeMounts".into(),
            ));
        };
        v.check(mounts).await.map_err(volume_error)
    }

    /// Binds `rec`'s volumes for its backend sandbox (none: nothing).
    pub(super) async fn bind_volumes(
        &self,
        rec: &SandboxRecord,
    ) -> Result<Vec<crate::backend::VolumeBind>, LifecycleError> {
        let mounts = &rec.options.volume_mounts;
        if mounts.is_empty() {
            return Ok(Vec::new());
        }
        let Some(v) = self.volumes.get() else {
            return Err(LifecycleError::BadRequest(format!(
                "sandbox {} mounts volumes, and this node serves none",
                rec.id
            )));
        };
        v.bind(&rec.id, mounts).await.map_err(volume_error)
    }

    /// Sandbox `id`'s backend sandbox is gone: its volumes are given back.
    pub(super) async fn unbind_volumes(&self, id: &str) {
        if let Some(v) = self.volumes.get() {
            v.unbind(id).await;
        }
    }

    /// Sandbox `id` was paused: on `oss`, its volumes' changes are uploaded.
    pub(super) async fn flush_volumes(&self, id: &str) {
        if let Some(v) = self.volumes.get() {
            v.flush(id).await;
        }
    }

    /// Sandbox `id` is gone for good: its volumes are given back and their leases go.
    pub(super) async fn forget_volumes(&self, id: &str, mounts: &[VolumeMount]) {
        if let Some(v) = self.volumes.get()
            && !mounts.is_empty()
        {
            v.forget(id, mounts).await;
        }
    }

    /// Removes leases this node left behind for sandboxes it no longer has (run once
    /// at start, after the paused sandboxes were restored).
    pub async fn reconcile_volumes(&self) -> Result<usize, LifecycleError> {
        let Some(v) = self.volumes.get() else {
            return Ok(0);
        };
        let ids = self.slots.lock().keys().cloned().collect();
        v.reconcile(&ids).await.map_err(volume_error)
    }
}

/// Why the backend `kind` cannot mount volumes, if it cannot (the create's 400).
fn volumes_unsupported(kind: BackendKind) -> Option<&'static str> {
    match kind {
        BackendKind::Microvm => Some(
            "volumeMounts need the jail backend: the microvm backend has no shared-file-system device to mount a volume with; create the sandbox on a node with AENV_BACKEND=jail, or without volumeMounts",
        ),
        BackendKind::Jail | BackendKind::Auto => None,
    }
}

/// A volume error as a lifecycle error: what the client named wrong is a 400.
fn volume_error(e: crate::volume::VolumeError) -> LifecycleError {
    use crate::volume::VolumeError as V;
    match e {
        V::UnknownName(_) | V::InvalidName(_) => LifecycleError::BadRequest(e.to_string()),
        other => LifecycleError::Volume(other),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_jail_mounts_volumes_and_the_refusal_says_why() {
        let why = volumes_unsupported(BackendKind::Microvm).unwrap();
        assert!(
            why.contains("jail backend") && why.contains("shared-file-system device"),
            "{why}"
        );
        assert!(volumes_unsupported(BackendKind::Jail).is_none());
    }

    #[test]
    fn a_volume_the_client_named_wrong_is_a_bad_request() {
        use crate::volume::VolumeError as V;
        let e = volume_error(V::UnknownName("data".into()));
        assert!(
            matches!(&e, LifecycleError::BadRequest(m) if m.contains("volume \"data\" not found")),
            "{e}"
        );
        assert!(matches!(
            volume_error(V::NotFound("x".into())),
            LifecycleError::Volume(_)
        ));
    }
}
