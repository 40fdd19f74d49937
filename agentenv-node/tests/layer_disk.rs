//! Capped writable layers on real loop devices (needs root and the `loop` module; skipped
//! with a message otherwise).

use std::fs::{self, File};
use std::io::{self, Write};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Barrier, RwLock, RwLockReadGuard};
use std::time::Duration;

use agentenv_node::host::disk::{
    self, DiskError, LayerPool, MountOptions, MountedLayer, create_layer_image, ensure_blank,
    layer_usage, mount_layer, mount_layer_with,
};
use agentenv_testkit::Wait;

/// A process in a new mount namespace holds copies of every layer mounted at that moment,
/// those of the tests running beside it too: the test that makes one runs alone.
static NAMESPACES: RwLock<()> = RwLock::new(());

fn shared() -> RwLockReadGuard<'static, ()> {
    NAMESPACES.read().unwrap_or_else(|e| e.into_inner())
}

fn loops_available() -> bool {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    if !root || !Path::new("/dev/loop-control").exists() {
        eprintln!("SKIPPED: needs root and /dev/loop-control");
        return false;
    }
    true
}

/// Where the loop device's sysfs says it is attached (`None`: detached).
fn backing_file(layer_loop: u32) -> Option<PathBuf> {
    fs::read_to_string(format!("/sys/block/loop{layer_loop}/loop/backing_file"))
        .ok()
        .map(|s| PathBuf::from(s.trim_end()))
}

/// Waits (bounded) until loop device `n` no longer holds `image`: the kernel detaches an
/// autoclear device when its last user goes, which the test cannot wait on otherwise.
fn wait_detached(n: u32, image: &Path) -> bool {
    Wait::new(
        format_args!("/dev/loop{n} to let go of {image:?}"),
        Duration::from_secs(5),
    )
    .every(Duration::from_millis(1))
    .try_until_blocking(|| backing_file(n).is_none_or(|f| f != image))
    .is_ok()
}

struct Sandbox {
    _dir: tempfile::TempDir,
    cache: PathBuf,
    root: PathBuf,
}

/// A test that fails with layers mounted would leave them (and their loop devices)
/// behind: whatever is still mounted under the directory goes with it.
impl Drop for Sandbox {
    fn drop(&mut self) {
        let Ok(base) = fs::canonicalize(self._dir.path()) else {
            return;
        };
        let text = fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        let mut mounts: Vec<&str> = text
            .lines()
            .filter_map(|l| l.split(' ').nth(4))
            .filter(|m| Path::new(m).starts_with(&base))
            .collect();
        mounts.sort_by_key(|m| std::cmp::Reverse(m.len()));
        for m in mounts {
            let _ = nix::mount::umount2(m, nix::mount::MntFlags::MNT_DETACH);
        }
    }
}

impl Sandbox {
    /// A fresh layer image of `size_mb` at the sandbox's `layer.img`.
    fn image(&self, size_mb: u64) -> PathBuf {
        let image = self.root.join(disk::LAYER_IMAGE);
        create_layer_image(&self.cache, size_mb, &image).unwrap();
        image
    }
}

/// How most tests start: `None` (skipped) without loop devices, else the shared side of
/// [`NAMESPACES`] and a fresh sandbox directory.
fn start() -> Option<(RwLockReadGuard<'static, ()>, Sandbox)> {
    if !loops_available() {
        return None;
    }
    let shared = shared();
    Some((shared, sandbox()))
}

fn sandbox() -> Sandbox {
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("cache");
    let root = dir.path().join("sandbox");
    fs::create_dir(&root).unwrap();
    Sandbox {
        cache,
        root,
        _dir: dir,
    }
}

/// Bytes allocated under `path` on the device `dev` (not descending into other mounts).
fn allocated_on(path: &Path, dev: u64) -> u64 {
    let meta = fs::symlink_metadata(path).unwrap();
    if meta.dev() != dev {
        return 0;
    }
    let mut total = meta.blocks() * 512;
    if meta.is_dir() {
        for entry in fs::read_dir(path).unwrap().flatten() {
            total += allocated_on(&entry.path(), dev);
        }
    }
    total
}

#[test]
fn a_full_layer_stops_writes_with_enospc_at_its_size() {
    const SIZE_MB: u64 = 64;
    let Some((_shared, s)) = start() else { return };
    let image = s.image(SIZE_MB);
    let meta = fs::metadata(&image).unwrap();
    assert_eq!(meta.len(), SIZE_MB << 20);
    let allocated = meta.blocks() * 512;
    assert!(
        allocated < 1 << 20,
        "a new layer image is sparse: {allocated} bytes allocated"
    );

    let layer = mount_layer(&image, &s.root.join(disk::LAYER_DIR)).unwrap();
    assert!(layer.upper().is_dir() && layer.work().is_dir());
    let before = layer_usage(layer.mountpoint()).unwrap();
    assert!(before.total_bytes <= SIZE_MB << 20);
    assert!(before.total_bytes > (SIZE_MB << 20) * 8 / 10, "{before:?}");

    let mut file = File::create(layer.upper().join("fill")).unwrap();
    let chunk = vec![0x5a_u8; 1 << 20];
    let mut written = 0u64;
    let err = loop {
        match file.write(&chunk) {
            Ok(n) => written += n as u64,
            Err(e) => break e,
        }
        assert!(
            written <= SIZE_MB << 20,
            "wrote {written} bytes into {SIZE_MB} MiB"
        );
    };
    assert_eq!(err.raw_os_error(), Some(libc::ENOSPC), "{err}");
    // Delayed allocation may also report it at fsync.
    if let Err(e) = file.sync_all() {
        assert_eq!(e.raw_os_error(), Some(libc::ENOSPC), "{e}");
    }
    drop(file);
    let after = layer_usage(layer.mountpoint()).unwrap();
    eprintln!(
        "wrote {} MiB of {} MiB before ENOSPC; usage {after:?}",
        written >> 20,
        after.total_bytes >> 20
    );
    assert!(written <= after.total_bytes, "{written} > {after:?}");
    assert!(
        written >= after.total_bytes * 9 / 10,
        "stopped early: {written} of {after:?}"
    );
    assert!(after.used_bytes >= after.total_bytes * 9 / 10, "{after:?}");

    // The host paid for the image only, never more than its size: nothing else in the
    // sandbox directory grew (the layer's own files are inside the image).
    let allocated = fs::metadata(&image).unwrap().blocks() * 512;
    assert!(allocated <= SIZE_MB << 20, "{allocated}");
    let host_dev = fs::metadata(&s.root).unwrap().dev();
    let on_host = allocated_on(&s.root, host_dev);
    eprintln!(
        "image allocated {} MiB, sandbox directory {} MiB on the host",
        allocated >> 20,
        on_host >> 20
    );
    assert!(on_host <= allocated + (64 << 10), "{on_host} > {allocated}");

    // Deleting and trimming gives the blocks back to the host.
    fs::remove_file(layer.upper().join("fill")).unwrap();
    disk::trim_layer(layer.mountpoint()).unwrap();
    let trimmed = fs::metadata(&image).unwrap().blocks() * 512;
    assert!(trimmed < 16 << 20, "still {trimmed} bytes after a trim");
    layer.unmount().unwrap();
}

#[test]
fn an_unmounted_layer_keeps_its_files_and_mounts_again() {
    let Some((_shared, s)) = start() else { return };
    let image = s.image(64);
    let layer = mount_layer(&image, &s.root.join(disk::LAYER_DIR)).unwrap();
    fs::create_dir(layer.upper().join("etc")).unwrap();
    fs::write(layer.upper().join("etc/kept"), b"still here").unwrap();
    std::os::unix::fs::symlink("kept", layer.upper().join("etc/link")).unwrap();
    let n = layer.loop_index();
    layer.unmount().unwrap();
    assert!(!s.root.join("layer/upper").exists(), "the mount is gone");

    // A kept layer moves with its sandbox directory.
    let moved = s.root.with_file_name("kept");
    fs::rename(&s.root, &moved).unwrap();
    let image = moved.join(disk::LAYER_IMAGE);
    assert!(wait_detached(n, &s.root.join(disk::LAYER_IMAGE)));
    let layer = mount_layer(&image, &moved.join(disk::LAYER_DIR)).unwrap();
    assert_eq!(
        fs::read(layer.upper().join("etc/kept")).unwrap(),
        b"still here"
    );
    assert_eq!(
        fs::read_link(layer.upper().join("etc/link")).unwrap(),
        Path::new("kept")
    );
    // Found again by its path (reconciliation after a crash of the node).
    let found = MountedLayer::find(&moved.join(disk::LAYER_DIR))
        .unwrap()
        .expect("the layer is found");
    assert_eq!(found.loop_index(), layer.loop_index());
    assert_eq!(found.image(), fs::canonicalize(&image).unwrap());
    drop(layer);
    assert_eq!(
        disk::unmount_leftover(&moved.join(disk::LAYER_DIR)).unwrap(),
        1
    );
    assert!(
        MountedLayer::find(&moved.join(disk::LAYER_DIR))
            .unwrap()
            .is_none()
    );
    assert_eq!(
        disk::unmount_leftover(&moved.join(disk::LAYER_DIR)).unwrap(),
        0
    );
}

#[test]
fn layers_get_their_own_loop_devices_released_on_unmount() {
    let Some((_shared, s)) = start() else { return };
    let mut layers = Vec::new();
    for name in ["a", "b"] {
        let dir = s.root.join(name);
        fs::create_dir(&dir).unwrap();
        let image = dir.join(disk::LAYER_IMAGE);
        create_layer_image(&s.cache, 64, &image).unwrap();
        layers.push(mount_layer(&image, &dir.join(disk::LAYER_DIR)).unwrap());
    }
    assert_ne!(layers[0].loop_index(), layers[1].loop_index());
    for layer in &layers {
        assert_eq!(
            backing_file(layer.loop_index()).as_deref(),
            Some(layer.image())
        );
        let meta = fs::metadata(layer.mountpoint()).unwrap();
        assert_ne!(meta.dev(), fs::metadata(&s.root).unwrap().dev());
        let options = mount_options(layer.mountpoint());
        for option in ["nodev", "nosuid", "noatime"] {
            assert!(options.split(',').any(|o| o == option), "{options}");
        }
    }
    for layer in layers {
        let (n, image) = (layer.loop_index(), layer.image().to_path_buf());
        layer.unmount().unwrap();
        assert!(
            wait_detached(n, &image),
            "/dev/loop{n} still holds {image:?}"
        );
    }
}

/// The per-mount options of the mount at `path` in /proc/self/mountinfo.
fn mount_options(path: &Path) -> String {
    let path = fs::canonicalize(path).unwrap();
    let text = fs::read_to_string("/proc/self/mountinfo").unwrap();
    text.lines()
        .rfind(|l| l.split(' ').nth(4) == Some(path.to_str().unwrap()))
        .and_then(|l| l.split(' ').nth(5))
        .unwrap()
        .to_string()
}

#[test]
fn a_busy_layer_names_who_holds_it_and_stays_mounted() {
    let Some((_shared, s)) = start() else { return };
    let image = s.image(64);
    let mountpoint = s.root.join(disk::LAYER_DIR);
    let layer = mount_layer(&image, &mountpoint).unwrap();
    let open = File::create(layer.upper().join("open")).unwrap();
    let e = layer.unmount().unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, DiskError::Busy { .. }), "{msg}");
    assert!(
        msg.contains(&format!("pid {}", std::process::id())) && msg.contains("upper/open"),
        "{msg}"
    );
    drop(open);
    let layer = MountedLayer::find(&mountpoint)
        .unwrap()
        .expect("still mounted");
    layer.unmount().unwrap();
}

#[test]
fn a_layer_mounted_in_another_namespace_is_reported_after_unmounting_here() {
    if !loops_available() {
        return;
    }
    let _alone = NAMESPACES.write().unwrap_or_else(|e| e.into_inner());
    let s = sandbox();
    let image = s.image(64);
    let mountpoint = s.root.join(disk::LAYER_DIR);
    let layer = mount_layer(&image, &mountpoint).unwrap();
    // A process in a mount namespace made while the layer was mounted (what a sandbox
    // is), told to stay until we close its stdin.
    let mut child = std::process::Command::new("unshare")
        .args([
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            "echo ready; read x",
        ])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut ready = String::new();
    io::BufRead::read_line(
        &mut io::BufReader::new(child.stdout.as_mut().unwrap()),
        &mut ready,
    )
    .unwrap();
    assert_eq!(ready.trim(), "ready");
    let n = layer.loop_index();
    let e = layer.unmount().unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, DiskError::StillAttached { .. }), "{msg}");
    assert!(
        msg.contains("mount namespace") && msg.contains("(sh)"),
        "{msg}"
    );
    drop(child.stdin.take());
    child.wait().unwrap();
    // Once the namespace is gone the device lets go of the image.
    assert!(wait_detached(n, &fs::canonicalize(&image).unwrap()));
}

#[test]
fn concurrent_ensure_blank_formats_once() {
    if !loops_available() {
        return;
    }
    let _shared = shared();
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("cache");
    let threads = 6;
    let barrier = Arc::new(Barrier::new(threads));
    let handles: Vec<_> = (0..threads)
        .map(|_| {
            let (cache, barrier) = (cache.clone(), barrier.clone());
            std::thread::spawn(move || {
                barrier.wait();
                let path = ensure_blank(&cache, 96).unwrap();
                fs::metadata(&path).unwrap().ino()
            })
        })
        .collect();
    let inodes: Vec<u64> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    assert!(
        inodes.iter().all(|&i| i == inodes[0]),
        "every thread got the same file: {inodes:?}"
    );
    let names: Vec<String> = fs::read_dir(&cache)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(
        names,
        ["blank-96M.img"],
        "exactly one blank, no temporaries"
    );
    // Made once: it was never replaced (its change time is older than a new call's).
    let ctime = fs::metadata(cache.join("blank-96M.img"))
        .unwrap()
        .ctime_nsec();
    ensure_blank(&cache, 96).unwrap();
    assert_eq!(
        fs::metadata(cache.join("blank-96M.img"))
            .unwrap()
            .ctime_nsec(),
        ctime
    );
}

#[test]
fn the_pre_5_8_loop_setup_works_and_stale_devices_are_detached() {
    let Some((_shared, s)) = start() else { return };
    let image = s.image(64);
    let options = MountOptions {
        direct_io: true,
        legacy_loop_setup: true,
    };
    let layer = mount_layer_with(&image, &s.root.join(disk::LAYER_DIR), options).unwrap();
    fs::write(layer.upper().join("f"), b"x").unwrap();
    // Reconciliation leaves a mounted layer's device alone.
    assert!(disk::detach_stale_loops(&s.root).unwrap().is_empty());
    let n = layer.loop_index();
    layer.unmount().unwrap();
    assert!(wait_detached(n, &fs::canonicalize(&image).unwrap()));

    // A device left attached without autoclear and without a mount (what a node dying
    // between LOOP_SET_FD and LOOP_SET_STATUS64 leaves) is detached.
    let out = std::process::Command::new("losetup")
        .args(["--find", "--show"])
        .arg(&image)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let device = String::from_utf8(out.stdout).unwrap().trim().to_string();
    let detached = disk::detach_stale_loops(&s.root).unwrap();
    assert_eq!(detached, std::slice::from_ref(&device));
    let n: u32 = device.strip_prefix("/dev/loop").unwrap().parse().unwrap();
    assert!(wait_detached(n, &fs::canonicalize(&image).unwrap()));
}

#[test]
fn mounting_a_missing_or_bad_image_fails_cleanly() {
    let Some((_shared, s)) = start() else { return };
    let e = mount_layer(&s.root.join("none.img"), &s.root.join("m")).unwrap_err();
    assert!(e.to_string().contains("none.img"), "{e}");
    // A file system the kernel refuses (a clean superblock over garbage): the mount
    // fails and the loop device lets go of the image.
    let junk = s.root.join("junk.img");
    let image = s.root.join("broken.img");
    create_layer_image(&s.cache, 64, &image).unwrap();
    {
        use std::os::unix::fs::FileExt;
        let f = fs::OpenOptions::new().write(true).open(&image).unwrap();
        // The group descriptors (block 1) destroyed.
        f.write_all_at(&[0xff; 4096], 4096).unwrap();
    }
    fs::rename(&image, &junk).unwrap();
    let e = mount_layer(&junk, &s.root.join("m")).unwrap_err();
    assert!(e.to_string().contains("mounting"), "{e}");
    let junk = fs::canonicalize(&junk).unwrap();
    Wait::new(
        format_args!("no loop device to hold {junk:?}"),
        Duration::from_secs(5),
    )
    .every(Duration::from_millis(1))
    .until_blocking(|| {
        loop_holding(&junk).map_or(Ok(()), |d| Err(format!("/dev/loop{d} holds it")))
    });
    // An existing destination is never overwritten.
    let image = s.root.join(disk::LAYER_IMAGE);
    fs::write(&image, b"kept").unwrap();
    let e = create_layer_image(&s.cache, 64, &image).unwrap_err();
    assert!(e.to_string().contains("layer.img"), "{e}");
    assert_eq!(fs::read(&image).unwrap(), b"kept");
    assert!(matches!(
        create_layer_image(&s.cache, 1, &s.root.join("tiny.img")),
        Err(DiskError::InvalidSize(_))
    ));
}

/// The loop device attached to `image`, if any.
fn loop_holding(image: &Path) -> Option<u32> {
    fs::read_dir("/sys/block").unwrap().flatten().find_map(|e| {
        let n: u32 = e.file_name().to_str()?.strip_prefix("loop")?.parse().ok()?;
        (backing_file(n)? == image).then_some(n)
    })
}

#[test]
fn an_image_mounted_now_or_left_dirty_is_refused_until_repaired() {
    let Some((_shared, s)) = start() else { return };
    let image = s.image(64);
    let layer = mount_layer(&image, &s.root.join(disk::LAYER_DIR)).unwrap();
    fs::write(layer.upper().join("data"), b"precious").unwrap();
    // A second mount of the same image (a node restarted in another mount namespace
    // while the sandbox runs on) would corrupt it.
    let e = mount_layer(&image, &s.root.join("again")).unwrap_err();
    assert!(matches!(e, DiskError::Unclean { .. }), "{e}");
    assert!(e.to_string().contains("not unmounted cleanly"), "{e}");
    layer.unmount().unwrap();

    // The host went down while it was mounted: the superblock says "not clean".
    set_valid_fs(&image, false);
    let e = mount_layer(&image, &s.root.join(disk::LAYER_DIR)).unwrap_err();
    assert!(matches!(e, DiskError::Unclean { .. }), "{e}");
    disk::repair_layer_image(&image).unwrap();
    let layer = mount_layer(&image, &s.root.join(disk::LAYER_DIR)).unwrap();
    assert_eq!(fs::read(layer.upper().join("data")).unwrap(), b"precious");
    layer.unmount().unwrap();

    // Not a file system at all.
    let junk = s.root.join("junk.img");
    File::create(&junk).unwrap().set_len(64 << 20).unwrap();
    let e = mount_layer(&junk, &s.root.join("m")).unwrap_err();
    assert!(matches!(e, DiskError::NotALayer { .. }), "{e}");
}

/// Sets or clears EXT4_VALID_FS in an image's superblock, as a kernel that went down
/// with the file system mounted leaves it (checksum updated).
fn set_valid_fs(image: &Path, valid: bool) {
    use std::os::unix::fs::FileExt;
    let f = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(image)
        .unwrap();
    let mut sb = [0u8; 1024];
    f.read_exact_at(&mut sb, 1024).unwrap();
    let mut state = u16::from_le_bytes([sb[0x3A], sb[0x3B]]);
    if valid {
        state |= 1;
    } else {
        state &= !1;
    }
    sb[0x3A..0x3C].copy_from_slice(&state.to_le_bytes());
    // metadata_csum: crc32c (Castagnoli, no final inversion) of all before s_checksum.
    let mut crc = !0u32;
    for &b in &sb[..0x3FC] {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ 0x82F6_3B78
            } else {
                crc >> 1
            };
        }
    }
    sb[0x3FC..].copy_from_slice(&crc.to_le_bytes());
    f.write_all_at(&sb, 1024).unwrap();
    f.sync_all().unwrap();
}

#[test]
fn a_pool_hands_out_mounted_layers_as_sandbox_directories() {
    let Some((_shared, s)) = start() else { return };
    let pool_dir = s.root.join("pool");
    // What a crashed node process left in the pool's directory.
    fs::create_dir_all(pool_dir.join("7")).unwrap();
    let left_image = pool_dir.join("7").join(disk::LAYER_IMAGE);
    create_layer_image(&s.cache, 64, &left_image).unwrap();
    let left = mount_layer(&left_image, &pool_dir.join("7").join(disk::LAYER_DIR)).unwrap();
    let left_loop = left.loop_index();
    let left_image = left.image().to_path_buf();
    drop(left);

    let pool = LayerPool::start(&pool_dir, &s.cache, 64, 2, MountOptions::default()).unwrap();
    assert!(
        wait_detached(left_loop, &left_image),
        "the leftover is unmounted"
    );
    assert!(!pool_dir.join("7").exists(), "and deleted");
    // One pool per directory.
    let e = LayerPool::start(&pool_dir, &s.cache, 64, 2, MountOptions::default())
        .err()
        .expect("a second pool on the same directory is refused");
    assert!(e.to_string().contains("another node process"), "{e}");

    assert!(
        pool.wait_ready(2, Duration::from_secs(20)),
        "{:?}",
        pool.stats()
    );
    let dir = s.root.join("sandboxes-a");
    let layer = pool.take(&dir).unwrap().expect("a ready layer");
    assert_eq!(
        layer.mountpoint(),
        fs::canonicalize(&dir).unwrap().join("layer")
    );
    assert_eq!(
        layer.image(),
        fs::canonicalize(&dir).unwrap().join("layer.img")
    );
    assert_eq!(
        backing_file(layer.loop_index()).as_deref(),
        Some(layer.image())
    );
    assert!(MountedLayer::find(&dir.join("layer")).unwrap().is_some());
    fs::write(layer.upper().join("f"), b"x").unwrap();
    let usage = layer_usage(layer.mountpoint()).unwrap();
    assert!(usage.total_bytes <= 64 << 20, "{usage:?}");

    // An existing destination: refused, and the pool keeps its layer.
    assert!(
        pool.wait_ready(2, Duration::from_secs(20)),
        "{:?}",
        pool.stats()
    );
    fs::create_dir(s.root.join("exists")).unwrap();
    assert!(pool.take(&s.root.join("exists")).is_err());
    // (It may have made one more meanwhile.)
    assert!(pool.stats().ready >= 2, "{:?}", pool.stats());

    let (n, image) = (layer.loop_index(), layer.image().to_path_buf());
    layer.unmount().unwrap();
    assert!(wait_detached(n, &image));
    let stats = pool.stats();
    assert_eq!((stats.taken, stats.failed), (1, 0), "{stats:?}");
    let pooled: Vec<(u32, PathBuf)> = fs::read_dir(&pool_dir)
        .unwrap()
        .flatten()
        .filter_map(|e| MountedLayer::find(&e.path().join("layer")).unwrap())
        .map(|l| (l.loop_index(), l.image().to_path_buf()))
        .collect();
    assert!(pooled.len() >= 2, "{pooled:?}");
    pool.shutdown();
    for (n, image) in pooled {
        assert!(wait_detached(n, &image));
    }
    assert_eq!(
        fs::read_dir(&pool_dir).unwrap().count(),
        0,
        "shutdown leaves nothing"
    );
    assert!(pool.take(&s.root.join("late")).unwrap().is_none());
}

#[test]
fn a_shared_mount_lets_unmounts_reach_namespaces_made_while_a_layer_was_mounted() {
    if !loops_available() {
        return;
    }
    let _alone = NAMESPACES.write().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    assert!(disk::make_shared_mount(dir.path()).unwrap());
    assert!(!disk::make_shared_mount(dir.path()).unwrap());
    let path = fs::canonicalize(dir.path()).unwrap();
    let text = fs::read_to_string("/proc/self/mountinfo").unwrap();
    let line = text
        .lines()
        .rfind(|l| l.split(' ').nth(4) == Some(path.to_str().unwrap()))
        .expect("a mount of its own");
    assert!(line.contains("shared:"), "{line}");
    let cache = path.join("cache");
    let image = path.join(disk::LAYER_IMAGE);
    create_layer_image(&cache, 64, &image).unwrap();
    let layer = mount_layer(&image, &path.join(disk::LAYER_DIR)).unwrap();
    let n = layer.loop_index();
    // A namespace made while the layer is mounted, as `ip netns exec` or a systemd unit
    // makes one (its mounts slaves of the host's), staying until its stdin closes.
    let mut child = std::process::Command::new("unshare")
        .args(["--mount", "--propagation", "slave", "cat"])
        .stdin(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    Wait::new("the namespace to have the layer", Duration::from_secs(5))
        .every(Duration::from_millis(5))
        .until_blocking(|| {
            fs::read_to_string(format!("/proc/{pid}/mountinfo"))
                .unwrap_or_default()
                .contains(disk::LAYER_DIR)
        });
    // The unmount here reaches the copy there: the file system is gone at once.
    layer.unmount().unwrap();
    assert!(wait_detached(n, &image));
    assert!(
        !fs::read_to_string(format!("/proc/{pid}/mountinfo"))
            .unwrap()
            .contains(path.join(disk::LAYER_DIR).to_str().unwrap())
    );
    drop(child.stdin.take());
    child.wait().unwrap();
    // With nothing beneath it any more, the mount goes again.
    assert!(disk::remove_shared_mount_if_unused(&path).unwrap());
    assert!(
        !fs::read_to_string("/proc/self/mountinfo")
            .unwrap()
            .lines()
            .any(|l| l.split(' ').nth(4) == Some(path.to_str().unwrap()))
    );
}

#[test]
fn an_overlay_on_a_layer_is_capped_and_holds_it() {
    let Some((_shared, s)) = start() else { return };
    let image = s.image(64);
    let layer = mount_layer(&image, &s.root.join(disk::LAYER_DIR)).unwrap();
    let lower = s.root.join("lower");
    let root = s.root.join("root");
    fs::create_dir_all(lower.join("etc")).unwrap();
    fs::write(lower.join("etc/template"), b"from the template").unwrap();
    fs::create_dir(&root).unwrap();
    let options = format!(
        "lowerdir={},upperdir={},workdir={}",
        lower.display(),
        layer.upper().display(),
        layer.work().display()
    );
    nix::mount::mount(
        Some("overlay"),
        &root,
        Some("overlay"),
        nix::mount::MsFlags::empty(),
        Some(options.as_str()),
    )
    .unwrap();
    assert_eq!(
        fs::read(root.join("etc/template")).unwrap(),
        b"from the template"
    );
    // A write through the overlay lands in the layer and stops at its size.
    let mut file = File::create(root.join("fill")).unwrap();
    let chunk = vec![1u8; 1 << 20];
    let mut written = 0u64;
    let err = loop {
        match file.write(&chunk) {
            Ok(n) => written += n as u64,
            Err(e) => break e,
        }
        assert!(written <= 64 << 20);
    };
    assert_eq!(err.raw_os_error(), Some(libc::ENOSPC), "{err}");
    drop(file);
    assert!(layer.upper().join("fill").exists());
    let template = fs::metadata(lower.join("etc/template")).unwrap();
    assert_eq!(template.len(), 17, "the lower layer is untouched");

    // The overlay keeps the layer's file system alive: unmounting says so.
    let n = layer.loop_index();
    let e = layer.unmount().unwrap_err();
    assert!(matches!(e, DiskError::StillAttached { .. }), "{e}");
    assert!(e.to_string().contains("an overlay mounted at"), "{e}");
    nix::mount::umount2(&root, nix::mount::MntFlags::empty()).unwrap();
    assert!(wait_detached(n, &fs::canonicalize(&image).unwrap()));
}

/// Writes `len` random bytes to `path` and syncs them.
fn write_random(path: &Path, len: usize) {
    let mut f = File::create(path).unwrap();
    let mut buf = vec![0u8; 1 << 20];
    let mut left = len;
    while left > 0 {
        let n = left.min(buf.len());
        for b in &mut buf[..n] {
            *b = rand::random();
        }
        f.write_all(&buf[..n]).unwrap();
        left -= n;
    }
    f.sync_all().unwrap();
}

/// A copy of a mounted layer (a fork's) is a clean file system with the layer's files as
/// they were, while the layer stays mounted and writable.
fn clone_and_check(s: &Sandbox) -> u64 {
    let image = s.image(256);
    let layer = mount_layer(&image, &s.root.join(disk::LAYER_DIR)).unwrap();
    fs::write(layer.upper().join("small"), b"before the fork").unwrap();
    write_random(&layer.upper().join("big"), 32 << 20);
    let big = fs::read(layer.upper().join("big")).unwrap();
    let dest = s.root.join("fork.img");
    let free = |p: &Path| {
        nix::sys::statvfs::statvfs(p)
            .map(|v| v.blocks_available() * v.fragment_size())
            .unwrap()
    };
    let before = free(&s.root);
    disk::clone_mounted(layer.mountpoint(), &image, &dest).unwrap();
    // Copied while mounted, the image says so: refused until marked clean.
    assert!(matches!(
        mount_layer(&dest, &s.root.join("fork")),
        Err(DiskError::Unclean { .. })
    ));
    disk::mark_clean(&dest).unwrap();
    let used = before.saturating_sub(free(&s.root));
    // The layer runs on: writable, its files unchanged.
    fs::write(layer.upper().join("small"), b"after the fork").unwrap();
    let copy = mount_layer(&dest, &s.root.join("fork")).unwrap();
    assert_eq!(
        fs::read(copy.upper().join("small")).unwrap(),
        b"before the fork"
    );
    assert!(
        fs::read(copy.upper().join("big")).unwrap() == big,
        "the copy holds the data"
    );
    copy.unmount().unwrap();
    layer.unmount().unwrap();
    used
}

#[test]
fn a_mounted_layer_is_copied_clean_with_its_files_as_they_were() {
    let Some((_shared, s)) = start() else { return };
    let used = clone_and_check(&s);
    assert!(
        used < 64 << 20,
        "the copy takes the layer's data, not its size: {used}"
    );
}

#[test]
fn a_layer_copy_is_a_reflink_where_the_file_system_has_them() {
    let Some((_shared, s)) = start() else { return };
    // An XFS file system with reflinks, on a loop device of its own, under the sandbox.
    let backing = s.root.join("xfs.img");
    File::create(&backing).unwrap().set_len(2 << 30).unwrap();
    let mkfs = std::process::Command::new("mkfs.xfs")
        .args(["-q", "-m", "reflink=1"])
        .arg(&backing)
        .status();
    let Ok(st) = mkfs else {
        eprintln!("SKIPPED: mkfs.xfs is not installed (xfsprogs, in scripts/apt-packages.txt)");
        return;
    };
    assert!(st.success(), "mkfs.xfs failed");
    let mnt = s.root.join("xfs");
    fs::create_dir(&mnt).unwrap();
    let st = std::process::Command::new("mount")
        .args(["-o", "loop"])
        .arg(&backing)
        .arg(&mnt)
        .status()
        .unwrap();
    assert!(st.success(), "mounting the XFS image");
    let inner = Sandbox {
        cache: mnt.join("cache"),
        root: mnt.join("sandbox"),
        _dir: tempfile::tempdir().unwrap(),
    };
    fs::create_dir(&inner.root).unwrap();
    let used = clone_and_check(&inner);
    let _ = nix::mount::umount2(&mnt, nix::mount::MntFlags::MNT_DETACH);
    assert!(
        used < 4 << 20,
        "a reflink copy shares the 32 MiB of data: {used} bytes taken"
    );
}
