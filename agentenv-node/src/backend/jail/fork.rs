//! Forks of jail sandboxes: copies of the writable layer that new sandboxes start from.
//!
//! The sandbox is frozen (its cgroup, then its layer's file system) for as long as one
//! copy of its layer image takes, then runs on; every further copy is made from that
//! first one. Each copy is a kept state (`<kept>/fork.<nonce>/disk/layer.img`), which a
//! create takes over like the layer of a sandbox kept at a node restart: its files
//! move into the new sandbox's id range there. Processes are not copied: a fork starts
//! its own process tree on the files.

use std::path::{Path, PathBuf};

use super::{DISK_DIR, JailBackend, JailRuntime, Sandbox, layer_mount};
use crate::backend::{BackendError, KeptState};
use crate::host::{Runtime, disk, setup};

impl JailBackend {
    /// `count` kept states with the writable layer of `sbx` as it is now.
    pub(super) async fn fork_layers(
        &self,
        sbx: &Sandbox,
        count: usize,
    ) -> Result<Vec<KeptState>, BackendError> {
        let paths: Vec<PathBuf> = (0..count)
            .map(|_| self.host.new_kept_path("fork"))
            .collect();
        let result = self.copy_layers(sbx, &paths).await;
        if let Err(e) = result {
            for p in paths.iter().filter(|p| p.exists()) {
                if let Err(why) = self.host.remove_dir(p) {
                    tracing::warn!(path = %p.display(), error = %why, "removing a fork's layer");
                }
            }
            return Err(e);
        }
        tracing::debug!(id = %sbx.id(), count, "writable layer copied for forks");
        Ok(paths.into_iter().map(|path| KeptState { path }).collect())
    }

    /// Copies the layer of `sbx` into the first of `paths` with the sandbox frozen, then
    /// that copy into the others.
    async fn copy_layers(&self, sbx: &Sandbox, paths: &[PathBuf]) -> Result<(), BackendError> {
        let (dir, first) = (sbx.host.dir.clone(), paths[0].clone());
        JailRuntime::pause(self, sbx).await?;
        let copied = tokio::task::spawn_blocking(move || {
            disk::clone_mounted(&layer_mount(&dir), &image(&dir), &kept_image(&first)?)
                .map_err(copy_err)
        })
        .await
        .map_err(|e| setup(format!("fork task: {e}")));
        let thawed = JailRuntime::resume(self, sbx).await;
        copied??;
        thawed?;
        let rest = paths.to_vec();
        tokio::task::spawn_blocking(move || {
            let src = image(&rest[0]);
            rest[1..]
                .iter()
                .try_for_each(|p| disk::copy_sparse(&src, &kept_image(p)?).map_err(copy_err))
        })
        .await
        .map_err(|e| setup(format!("fork task: {e}")))?
    }
}

/// The layer image of a sandbox (or kept) directory.
fn image(dir: &Path) -> PathBuf {
    dir.join(DISK_DIR).join(disk::LAYER_IMAGE)
}

/// Where the image of the kept directory `dest` goes (its directories made).
fn kept_image(dest: &Path) -> Result<PathBuf, BackendError> {
    let disk_dir = dest.join(DISK_DIR);
    std::fs::create_dir_all(&disk_dir)
        .map_err(|e| BackendError::io(format!("creating {}", disk_dir.display()), e))?;
    Ok(disk_dir.join(disk::LAYER_IMAGE))
}

fn copy_err(e: disk::DiskError) -> BackendError {
    setup(format!("copying the writable layer: {e}"))
}
