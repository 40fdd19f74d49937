//! Removing what the host no longer needs: a sandbox directory (through the trash), a
//! kept state, and at start the leftovers of an earlier node process
//! ([`SandboxHost::reconcile`]).

use std::path::Path;

use super::net::Slot;
use super::{DirHook, SandboxHost, StateFile, net, netpool, orphans, setup};
use crate::backend::{BackendError, KeptState, ReconcileReport, validate_sandbox_id};

impl SandboxHost {
    /// Moves a directory into the trash (instant) and deletes it in the background;
    /// whatever a crash leaves in the trash goes at the next reconciliation.
    pub fn remove_dir(&self, dir: &Path) -> Result<(), String> {
        let nonce: u64 = rand::random();
        let name = dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let trash = self.trash_dir.join(format!("{name}.{nonce:016x}"));
        match std::fs::rename(dir, &trash) {
            Ok(()) => {
                tokio::task::spawn_blocking(move || {
                    if let Err(e) = std::fs::remove_dir_all(&trash) {
                        tracing::warn!(path = %trash.display(), error = %e, "emptying the trash");
                    }
                });
                Ok(())
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(_) => std::fs::remove_dir_all(dir)
                .or_else(|e| {
                    if e.kind() == std::io::ErrorKind::NotFound {
                        Ok(())
                    } else {
                        Err(e)
                    }
                })
                .map_err(|e| format!("removing {}: {e}", dir.display())),
        }
    }

    /// Deletes a kept state (absent is fine).
    pub fn discard_kept(&self, kept: &KeptState, required: &[&str]) -> Result<(), BackendError> {
        if !kept.path.exists() {
            return Ok(());
        }
        self.check_kept(kept, required)?;
        self.remove_dir(&kept.path).map_err(setup)
    }

    /// Cleans what is left of deleted sandbox `id` after a failed cleanup, as the
    /// start-up reconciliation cleans a leftover directory (`before_removal` runs on the
    /// directory before it goes); an error when its directory or cgroup is still there.
    pub async fn clean_deleted(
        &self,
        id: &str,
        before_removal: Option<&DirHook<'_>>,
    ) -> Result<(), String> {
        let mut report = ReconcileReport::default();
        self.clean_leftover(id, &mut report, before_removal).await;
        let dir = self.sandbox_dir(id);
        let cg = self.hierarchy.sandbox(&self.cfg.hosted.cgroup_parent, id);
        match (dir.exists(), cg.exists()) {
            (false, false) => Ok(()),
            (d, c) => Err(format!(
                "still there after cleaning:{}{}",
                if d { " its directory" } else { "" },
                if c { " its cgroup" } else { "" }
            )),
        }
    }

    /// Cleans the leftovers of one sandbox directory of an earlier process: its cgroup
    /// (processes killed), links, address and id reservations, and the directory.
    async fn clean_leftover(
        &self,
        id: &str,
        report: &mut ReconcileReport,
        before_removal: Option<&DirHook<'_>>,
    ) {
        let dir = self.sandbox_dir(id);
        let state = StateFile::read(&dir);
        if validate_sandbox_id(id).is_ok() {
            let cg = self.hierarchy.sandbox(&self.cfg.hosted.cgroup_parent, id);
            if cg.exists() {
                if let Err(e) = cg.kill_all(self.cfg.hosted.op_timeout).await {
                    tracing::warn!(id, error = %e, "killing a leftover sandbox");
                }
                if let Err(e) = cg.remove(self.cfg.hosted.op_timeout).await {
                    tracing::warn!(id, error = %e, "removing a leftover cgroup");
                }
            }
        }
        let mut slots: Vec<Slot> = self
            .pool
            .reservations()
            .into_iter()
            .filter(|(_, owner)| owner == &dir)
            .map(|(s, _)| s)
            .collect();
        if let Some(st) = &state {
            slots.push(Slot { network: st.slot });
        }
        for slot in slots {
            for internet in [true, false] {
                let name = slot.host_ifname(&self.cfg.hosted.iface_prefix, internet);
                if let Ok(true) = net::delete_link(&self.netlink, &name).await {
                    report.removed_other.push(format!("link {name}"));
                }
            }
            if self
                .pool
                .reservations()
                .iter()
                .any(|(s, o)| *s == slot && o == &dir)
            {
                self.pool.release(slot);
                report
                    .removed_other
                    .push(format!("address {}", slot.sandbox_ip()));
            }
        }
        for (range, owner) in self.ids.reservations() {
            if owner == dir {
                self.ids.release(range);
                report
                    .removed_other
                    .push(format!("id range {}", range.base));
            }
        }
        if let Some(hook) = before_removal
            && let Err(e) = hook(&dir)
        {
            tracing::warn!(id, error = %e, "cleaning a leftover sandbox directory");
        }
        if let Err(e) = self.remove_dir(&dir) {
            tracing::warn!(id, error = %e, "removing a leftover sandbox directory");
        }
        report.removed_sandboxes.push(id.to_string());
    }

    /// Removes the leftovers of an earlier node process: sandbox directories of sandboxes
    /// not in `live`, the trash, kept states not in `kept`, namespace pools of earlier
    /// instances, and host resources nobody owns (addresses, id ranges, cgroups, links).
    /// `before_removal` runs on each sandbox directory and kept state before it goes.
    pub async fn reconcile(
        &self,
        live: &[String],
        kept: &[KeptState],
        before_removal: Option<&DirHook<'_>>,
    ) -> Result<ReconcileReport, BackendError> {
        let mut report = ReconcileReport::default();
        let entries = std::fs::read_dir(&self.sandboxes_dir).map_err(|e| {
            BackendError::io(format!("listing {}", self.sandboxes_dir.display()), e)
        })?;
        for entry in entries.flatten() {
            let id = entry.file_name().to_string_lossy().into_owned();
            if !live.contains(&id) {
                self.clean_leftover(&id, &mut report, before_removal).await;
            }
        }
        // Sandbox directories a crash left in the trash.
        if let Ok(entries) = std::fs::read_dir(&self.trash_dir) {
            for entry in entries.flatten() {
                if std::fs::remove_dir_all(entry.path()).is_ok() {
                    report
                        .removed_other
                        .push(format!("trash {}", entry.path().display()));
                }
            }
        }
        // Kept states no record references belong to nobody.
        if let Ok(entries) = std::fs::read_dir(&self.kept_dir) {
            for entry in entries.flatten() {
                let path = entry.path();
                if kept.iter().any(|k| k.path == path) {
                    continue;
                }
                if let Some(hook) = before_removal
                    && let Err(e) = hook(&path)
                {
                    tracing::warn!(error = %e, "cleaning an unreferenced kept state");
                }
                match self.remove_dir(&path) {
                    Ok(()) => report
                        .removed_other
                        .push(format!("kept state {}", path.display())),
                    Err(e) => tracing::warn!(error = %e, "removing an unreferenced kept state"),
                }
            }
        }
        // Namespace pools of earlier instances.
        report.removed_other.extend(
            netpool::leftovers(
                &self.netpool_dir,
                self.netpool.owner(),
                &self.pool,
                &self.netlink,
                &self.cfg.hosted.iface_prefix,
            )
            .await,
        );
        orphans::HostResources {
            pool: &self.pool,
            ids: &self.ids,
            netlink: &self.netlink,
            hierarchy: &self.hierarchy,
            cgroup_parent: &self.cfg.hosted.cgroup_parent,
            iface_prefix: &self.cfg.hosted.iface_prefix,
            op_timeout: self.cfg.hosted.op_timeout,
        }
        .remove_orphans(live, &mut report)
        .await;
        if !report.removed_sandboxes.is_empty() || !report.removed_other.is_empty() {
            tracing::info!(?report, "cleaned leftovers of an earlier node process");
        }
        Ok(report)
    }
}
