//! The warm pool of mounted layers ([`LayerPool`]): a thread of its own makes layers of
//! the default size ahead of time, and a create takes one with a `rename`.

use std::collections::VecDeque;
use std::fs::{self, File};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use nix::fcntl::{Flock, FlockArg};

use super::{
    DiskError, LAYER_DIR, LAYER_IMAGE, MountOptions, MountedLayer, check_size, create_layer_image,
    ensure_blank, errno_err, io_err, mount_layer_with, unmount_leftover,
};

/// How long the pool waits after a failed build before it tries again.
const POOL_RETRY_AFTER: Duration = Duration::from_secs(1);
/// How long after a take the pool waits before it makes the next layer, so that its I/O
/// does not slow down the rest of the create that took one (a create is under 10 ms).
/// Measured on a host file system without a journal, a refill running beside a create
/// made each of its `mkdir`s wait about a millisecond for metadata under writeback.
pub const POOL_REFILL_DELAY: Duration = Duration::from_millis(5);

/// A warm pool of mounted blank layers of one size (the node's default disk size).
///
/// Creating and mounting a layer costs about a millisecond, but it does I/O: attaching the
/// loop device syncs the fresh image to the host's disk, and on a busy disk that wait is
/// tens of milliseconds (see `examples/layer_disk_bench.rs`). The pool does that on a
/// thread of its own ahead of time. Each pooled layer sits in a directory of its own,
/// `<pool dir>/<n>/` with `layer.img` and `layer/` (mounted); [`LayerPool::take`] renames
/// that directory to become the sandbox's directory (a mount moves with a directory above
/// it), which is one `rename` and no I/O; the thread makes the next one
/// [`POOL_REFILL_DELAY`] later, after the create that took it.
///
/// The pool owns its directory (give each node process its own), locks it, and on start
/// unmounts and deletes what a previous process left there. It must be on the file system
/// of the sandbox directories.
pub struct LayerPool {
    shared: Arc<PoolShared>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

struct PoolShared {
    dir: PathBuf,
    cache_dir: PathBuf,
    size_mb: u64,
    target: usize,
    options: MountOptions,
    state: Mutex<PoolState>,
    /// A take happened (or the pool closes): refill.
    wake: Condvar,
    /// A build finished (its layer is ready, or it failed).
    finished: Condvar,
    _lock: Flock<File>,
}

struct PoolState {
    ready: VecDeque<MountedLayer>,
    closed: bool,
    /// When a layer was last taken.
    last_take: Option<Instant>,
    next: u64,
    stats: LayerPoolStats,
}

/// What a [`LayerPool`] did so far.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LayerPoolStats {
    /// Layers the pool keeps ready.
    pub target: usize,
    /// Layers ready now.
    pub ready: usize,
    /// Takes served from the pool.
    pub taken: u64,
    /// Takes that found it empty (the caller made its layer itself).
    pub empty: u64,
    /// Layers the pool made.
    pub built: u64,
    /// Builds that failed.
    pub failed: u64,
    /// The last build's error, if it failed.
    pub last_error: Option<String>,
}

impl LayerPool {
    /// Starts a pool of `target` mounted layers of `size_mb` MiB in `dir`, formatted from
    /// the blank in `cache_dir` (made now if needed, so a missing `mkfs.ext4` shows here)
    /// and mounted with `options`.
    pub fn start(
        dir: &Path,
        cache_dir: &Path,
        size_mb: u64,
        target: usize,
        options: MountOptions,
    ) -> Result<Self, DiskError> {
        check_size(size_mb)?;
        fs::create_dir_all(dir).map_err(io_err(format!("creating {}", dir.display())))?;
        let dir = fs::canonicalize(dir).map_err(io_err(format!("resolving {}", dir.display())))?;
        let handle = File::open(&dir).map_err(io_err(format!("opening {}", dir.display())))?;
        let lock = Flock::lock(handle, FlockArg::LockExclusiveNonblock).map_err(|(_, e)| {
            io_err(format!(
                "locking the layer pool {} (another node process uses it?)",
                dir.display()
            ))(e.into())
        })?;
        Self::clear(&dir)?;
        ensure_blank(cache_dir, size_mb)?;
        let shared = Arc::new(PoolShared {
            dir,
            cache_dir: cache_dir.to_path_buf(),
            size_mb,
            target,
            options,
            state: Mutex::new(PoolState {
                ready: VecDeque::new(),
                closed: false,
                last_take: None,
                next: 0,
                stats: LayerPoolStats {
                    target,
                    ..LayerPoolStats::default()
                },
            }),
            wake: Condvar::new(),
            finished: Condvar::new(),
            _lock: lock,
        });
        let worker = shared.clone();
        let thread = std::thread::Builder::new()
            .name("layer-pool".into())
            .spawn(move || worker.refill())
            .map_err(io_err("starting the layer pool's thread"))?;
        Ok(Self {
            shared,
            thread: Mutex::new(Some(thread)),
        })
    }

    /// Unmounts and deletes the pools in `pools_dir` other than `own` that no process
    /// holds (their lock is free: a node process that died left them). Returns what it
    /// removed, for a reconciliation report.
    pub fn leftovers(pools_dir: &Path, own: &Path) -> Vec<String> {
        let mut removed = Vec::new();
        let Ok(entries) = fs::read_dir(pools_dir) else {
            return removed;
        };
        for e in entries.flatten() {
            let path = e.path();
            if path == own || !path.is_dir() {
                continue;
            }
            let Ok(handle) = File::open(&path) else {
                continue;
            };
            // A live pool holds its lock: leave it.
            let Ok(_lock) = Flock::lock(handle, FlockArg::LockExclusiveNonblock) else {
                continue;
            };
            match Self::clear(&path).and_then(|()| {
                fs::remove_dir(&path).map_err(io_err(format!("removing {}", path.display())))
            }) {
                Ok(()) => removed.push(format!("layer pool {}", path.display())),
                Err(e) => {
                    tracing::warn!(pool = %path.display(), error = %e, "removing a leftover layer pool")
                }
            }
        }
        removed
    }

    /// Unmounts and deletes every entry of the pool's directory.
    fn clear(dir: &Path) -> Result<(), DiskError> {
        let entries = fs::read_dir(dir).map_err(io_err(format!("reading {}", dir.display())))?;
        for entry in entries.flatten() {
            let path = entry.path();
            unmount_leftover(&path.join(LAYER_DIR))?;
            fs::remove_dir_all(&path).map_err(io_err(format!("removing {}", path.display())))?;
        }
        Ok(())
    }

    /// The pool's directory.
    pub fn dir(&self) -> &Path {
        &self.shared.dir
    }

    /// The size of the pool's layers.
    pub fn size_mb(&self) -> u64 {
        self.shared.size_mb
    }

    /// Takes a ready layer as the new directory `dir` (which must not exist; same file
    /// system as the pool's), holding `layer.img` and `layer/` (mounted): `None` when none
    /// is ready (make one with [`create_layer_image`] and [`mount_layer_with`]). On an
    /// error the pool keeps the layer.
    pub fn take(&self, dir: &Path) -> Result<Option<MountedLayer>, DiskError> {
        let layer = {
            let mut state = lock(&self.shared.state);
            state.last_take = Some(Instant::now());
            self.shared.wake.notify_all();
            let Some(layer) = state.ready.pop_front() else {
                state.stats.empty += 1;
                return Ok(None);
            };
            layer
        };
        let Some(entry) = layer.mountpoint.parent().map(Path::to_path_buf) else {
            unreachable!("a pooled layer is mounted in an entry directory");
        };
        let moved = nix::fcntl::renameat2(
            nix::fcntl::AT_FDCWD,
            &entry,
            nix::fcntl::AT_FDCWD,
            dir,
            nix::fcntl::RenameFlags::RENAME_NOREPLACE,
        )
        .map_err(errno_err(format!(
            "moving {} to {}",
            entry.display(),
            dir.display()
        )))
        .and_then(|()| {
            fs::canonicalize(dir).map_err(io_err(format!("resolving {}", dir.display())))
        });
        match moved {
            Ok(dir) => {
                lock(&self.shared.state).stats.taken += 1;
                Ok(Some(MountedLayer {
                    mountpoint: dir.join(LAYER_DIR),
                    image: dir.join(LAYER_IMAGE),
                    ..layer
                }))
            }
            Err(e) => {
                lock(&self.shared.state).ready.push_front(layer);
                Err(e)
            }
        }
    }

    /// Waits until `count` layers (at most the pool's target) are ready, at most
    /// `timeout`: whether they are.
    pub fn wait_ready(&self, count: usize, timeout: Duration) -> bool {
        let count = count.min(self.shared.target);
        let deadline = Instant::now() + timeout;
        let mut state = lock(&self.shared.state);
        while state.ready.len() < count && !state.closed {
            let Some(left) = deadline.checked_duration_since(Instant::now()) else {
                return false;
            };
            state = self
                .shared
                .finished
                .wait_timeout(state, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        state.ready.len() >= count
    }

    /// What the pool did so far.
    pub fn stats(&self) -> LayerPoolStats {
        let state = lock(&self.shared.state);
        LayerPoolStats {
            ready: state.ready.len(),
            ..state.stats.clone()
        }
    }

    /// Stops refilling and unmounts and deletes the ready layers. Takes after this find
    /// the pool empty.
    pub fn shutdown(&self) {
        lock(&self.shared.state).closed = true;
        self.shared.wake.notify_all();
        self.shared.finished.notify_all();
        if let Some(thread) = lock(&self.thread).take() {
            let _ = thread.join();
        }
        let ready: Vec<MountedLayer> = lock(&self.shared.state).ready.drain(..).collect();
        for layer in ready {
            let entry = layer.mountpoint.parent().map(Path::to_path_buf);
            if let Err(e) = layer.discard() {
                tracing::warn!(error = %e, "unmounting a pooled layer");
                continue;
            }
            if let Some(entry) = entry {
                let _ = fs::remove_dir_all(entry);
            }
        }
    }
}

impl Drop for LayerPool {
    fn drop(&mut self) {
        self.shutdown();
    }
}

impl PoolShared {
    fn refill(&self) {
        loop {
            let n = {
                let mut state = lock(&self.state);
                while !state.closed && state.ready.len() >= self.target {
                    state = self.wake.wait(state).unwrap_or_else(|e| e.into_inner());
                }
                // Counted from the take that woke us, not extended by later ones: under a
                // steady stream of takes the pool still refills.
                if let Some(until) = state.last_take.map(|t| t + POOL_REFILL_DELAY) {
                    while !state.closed {
                        let Some(left) = until.checked_duration_since(Instant::now()) else {
                            break;
                        };
                        state = self
                            .wake
                            .wait_timeout(state, left)
                            .unwrap_or_else(|e| e.into_inner())
                            .0;
                    }
                }
                if state.closed {
                    return;
                }
                state.next += 1;
                state.next
            };
            let entry = self.dir.join(n.to_string());
            match self.build(&entry) {
                Ok(layer) => {
                    let mut state = lock(&self.state);
                    state.stats.built += 1;
                    state.stats.last_error = None;
                    if !state.closed {
                        state.ready.push_back(layer);
                        self.finished.notify_all();
                        continue;
                    }
                    drop(state);
                    let _ = layer.discard();
                    let _ = fs::remove_dir_all(&entry);
                    return;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "making a pooled layer");
                    let _ = unmount_leftover(&entry.join(LAYER_DIR));
                    let _ = fs::remove_dir_all(&entry);
                    let mut state = lock(&self.state);
                    state.stats.failed += 1;
                    state.stats.last_error = Some(e.to_string());
                    self.finished.notify_all();
                    if !state.closed {
                        let _ = self.wake.wait_timeout(state, POOL_RETRY_AFTER);
                    }
                }
            }
        }
    }

    fn build(&self, entry: &Path) -> Result<MountedLayer, DiskError> {
        fs::create_dir(entry).map_err(io_err(format!("creating {}", entry.display())))?;
        let image = entry.join(LAYER_IMAGE);
        create_layer_image(&self.cache_dir, self.size_mb, &image)?;
        let layer = mount_layer_with(&image, &entry.join(LAYER_DIR), self.options)?;
        prime(&layer.upper());
        Ok(layer)
    }
}

/// Makes the first file operations of a new layer cheap: a fresh file system reads its
/// block and inode bitmaps and an inode table block (through the loop device, from the
/// host's disk) on its first allocation, which would otherwise be the first create's.
/// Nothing is left behind.
fn prime(upper: &Path) {
    let probe = upper.join(".agentenv-prime");
    let done = fs::create_dir(&probe)
        .and_then(|()| fs::write(probe.join("f"), b"x"))
        .and_then(|()| fs::remove_file(probe.join("f")));
    let _ = fs::remove_dir(&probe);
    if let Err(e) = done {
        tracing::debug!(error = %e, "priming a pooled layer");
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}
