//! A paused sandbox's kept layer as a capture another node starts it from (a move).
//!
//! The kept image is mounted for as long as its files are archived, with owners stored
//! relative to the sandbox's id range (as a snapshot stores them), so the node that takes
//! the sandbox gives its files a range of its own there. The kept state stays as it was:
//! should the move fail, the sandbox resumes here.

use std::os::unix::fs::MetadataExt;
use std::path::Path;

use super::snapshot::{LAYER_FILE, archive_layer};
use super::{DISK_DIR, JailBackend, layer_mount};
use crate::backend::{BackendError, KeptState, SnapshotCapture};
use crate::config::BackendKind;
use crate::host::ids::{IDS_PER_SANDBOX, IdPoolRange};
use crate::host::{disk, setup};

impl JailBackend {
    /// Archives the writable layer kept in `kept` into `dir`.
    pub(super) async fn capture_kept_layer(
        &self,
        kept: &KeptState,
        dir: &Path,
    ) -> Result<SnapshotCapture, BackendError> {
        let (path, out) = (kept.path.clone(), dir.join(LAYER_FILE));
        let pool = self.cfg().id_pool;
        let size = tokio::task::spawn_blocking(move || -> Result<u64, String> {
            let image = path.join(DISK_DIR).join(disk::LAYER_IMAGE);
            if !image.exists() {
                // The older layout: plain directories.
                let upper = path.join(disk::UPPER_DIR);
                return archive(&upper, &out, pool);
            }
            let layer =
                disk::mount_layer(&image, &layer_mount(&path)).map_err(|e| e.to_string())?;
            let archived = archive(&layer.upper(), &out, pool);
            let unmounted = layer.unmount().map_err(|e| e.to_string());
            let size = archived?;
            unmounted?;
            Ok(size)
        })
        .await
        .map_err(|e| setup(format!("archive task: {e}")))?
        .map_err(|e| setup(format!("archiving the kept writable layer: {e}")))?;
        tracing::debug!(kept = %kept.path.display(), size, "kept layer captured");
        Ok(SnapshotCapture::new(
            BackendKind::Jail,
            vec![LAYER_FILE.into()],
        ))
    }
}

/// Archives `upper` with owners relative to the id range its root belongs to.
fn archive(upper: &Path, out: &Path, pool: IdPoolRange) -> Result<u64, String> {
    let owner = std::fs::symlink_metadata(upper)
        .map_err(|e| format!("looking at {}: {e}", upper.display()))?
        .uid();
    archive_layer(upper, out, Some(range_base(owner, pool))).map_err(|e| e.to_string())
}

/// The base of the sandbox range of the pool `pool` that `uid` lies in; 0 for an id
/// outside the pool (a layer kept before sandboxes had ranges holds host ids).
fn range_base(uid: u32, pool: IdPoolRange) -> u32 {
    match uid.checked_sub(pool.first) {
        Some(off) if off < pool.count => pool.first + off / IDS_PER_SANDBOX * IDS_PER_SANDBOX,
        _ => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_owner_anywhere_in_a_range_gives_the_range_base() {
        let pool = IdPoolRange {
            first: 1_000_000_000,
            count: 1_000_000_000,
        };
        let base = 1_000_000_000 + 3 * IDS_PER_SANDBOX;
        assert_eq!(range_base(base, pool), base);
        // A tenant that chowned its root to another id of its range.
        assert_eq!(range_base(base + 1000, pool), base);
        assert_eq!(range_base(base + IDS_PER_SANDBOX - 1, pool), base);
        assert_eq!(
            range_base(base + IDS_PER_SANDBOX, pool),
            base + IDS_PER_SANDBOX
        );
        // Host ids (an old layout) and ids past the pool stay as they are.
        assert_eq!(range_base(0, pool), 0);
        assert_eq!(range_base(999, pool), 0);
        assert_eq!(range_base(2_000_000_001, pool), 0);
    }
}
