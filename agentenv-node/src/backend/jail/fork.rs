//! Forks of jail sandboxes: copies of the writable layer that new sandboxes start from.
//!
//! The sandbox is frozen (its cgroup, then its layer's file system) for as long as one
//! copy of its layer image takes, then runs on; every further copy is made from that
//! first one, at rest. Each copy is a kept state (`<kept>/fork.<nonce>/disk/layer.img`),
//! which a create takes over like the layer of a sandbox kept at a node restart: its
//! files move into the new sandbox's id range there. Processes are not copied: a fork
//! starts its own process tree on the files.
//!
//! A copy is a reflink where the data directory's file system has them (XFS, btrfs):
//! then it costs the same whatever the layer holds. Elsewhere (ext4) the image's data is
//! read and written, at the disk's speed.

use std::path::{Path, PathBuf};

use super::{DISK_DIR, JailBackend, JailRuntime, Sandbox, layer_mount};
use crate::backend::{BackendError, KeptState};
use crate::host::{Runtime, disk, setup};

impl JailBackend {
    /// A kept state with the writable layer of `sbx` as it is now; the sandbox is frozen
    /// while it is copied (its copy is marked clean once it runs on).
    pub(super) async fn fork_layer(&self, sbx: &Sandbox) -> Result<KeptState, BackendError> {
        let path = self.host.new_kept_path("fork");
        let (dir, dest) = (sbx.host.dir.clone(), path.clone());
        JailRuntime::pause(self, sbx).await?;
        let copied = tokio::task::spawn_blocking(move || {
            disk::clone_mounted(&layer_mount(&dir), &image(&dir), &kept_image(&dest)?)
                .map_err(copy_err)
        })
        .await
        .map_err(|e| setup(format!("fork task: {e}")))
        .and_then(|r| r);
        let thawed = JailRuntime::resume(self, sbx).await;
        let image = kept_image(&path);
        let marked = match (copied, thawed, image) {
            (Ok(()), Ok(()), Ok(image)) => {
                tokio::task::spawn_blocking(move || disk::mark_clean(&image).map_err(copy_err))
                    .await
                    .map_err(|e| setup(format!("fork task: {e}")))
                    .and_then(|r| r)
            }
            (Err(e), _, _) | (_, Err(e), _) | (_, _, Err(e)) => Err(e),
        };
        if let Err(e) = marked {
            self.remove_kept(&path);
            return Err(e);
        }
        tracing::debug!(id = %sbx.id(), path = %path.display(), "writable layer copied for a fork");
        Ok(KeptState { path })
    }

    /// `count` copies of the kept layer `kept`.
    pub(super) async fn copy_kept_layer(
        &self,
        kept: &KeptState,
        count: usize,
    ) -> Result<Vec<KeptState>, BackendError> {
        JailRuntime::check_kept(self, kept)?;
        let paths: Vec<PathBuf> = (0..count)
            .map(|_| self.host.new_kept_path("fork"))
            .collect();
        let (src, dests) = (image(&kept.path), paths.clone());
        let copied = tokio::task::spawn_blocking(move || {
            dests
                .iter()
                .try_for_each(|p| disk::copy_sparse(&src, &kept_image(p)?).map_err(copy_err))
        })
        .await
        .map_err(|e| setup(format!("fork task: {e}")))
        .and_then(|r| r);
        if let Err(e) = copied {
            paths.iter().for_each(|p| self.remove_kept(p));
            return Err(e);
        }
        Ok(paths.into_iter().map(|path| KeptState { path }).collect())
    }

    /// Removes a kept directory made here (absent is fine), logging a failure.
    fn remove_kept(&self, path: &Path) {
        if path.exists()
            && let Err(why) = self.host.remove_dir(path)
        {
            tracing::warn!(path = %path.display(), error = %why, "removing a fork's layer");
        }
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
