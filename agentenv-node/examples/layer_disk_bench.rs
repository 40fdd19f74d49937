//! What a capped writable layer costs a sandbox create, against the plain directories it
//! replaces, measured in the same run.
//!
//! ```text
//! layer_disk_bench [iterations (200)] [size MiB (1024)] [directory (a temporary one)]
//! ```
//!
//! Phase 1, each iteration interleaved: the reference (`mkdir` of a sandbox directory with
//! `upper/` and `work/`, what a create does today), then a layer made inline with direct
//! I/O and one without: `create_layer_image` (a sparse copy of the cached blank),
//! `mount_layer` (loop device + ext4 mount) and `MountedLayer::discard` (unmount).
//!
//! Phase 2, a `LayerPool` of 2: each iteration waits until the pool is full, takes a layer
//! (what a create would do instead of the above), then runs the reference right away,
//! while the pool refills in the background, to show what the refill costs the rest of a
//! create; then unmounts the layer.
//!
//! Prints p50/p99 of each step and the ratios to the reference, the one-off cost of
//! formatting a blank, and a write of 128 MiB + fsync through each kind of layer
//! (throughput, and how much the host's page cache grew: the second copy of the data that
//! direct I/O avoids). Needs root and the `loop` module.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use agentenv_node::host::disk::{
    self, LayerPool, MountOptions, create_layer_image, ensure_blank, make_shared_mount,
    mount_layer_with,
};

struct Samples {
    name: &'static str,
    values: Vec<Duration>,
}

impl Samples {
    fn new(name: &'static str) -> Self {
        Self {
            name,
            values: Vec::new(),
        }
    }

    fn percentile(&self, p: f64) -> Duration {
        let mut v = self.values.clone();
        v.sort();
        let i = ((p * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1;
        v[i]
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn time<T>(f: impl FnOnce() -> T) -> (T, Duration) {
    let start = Instant::now();
    let out = f();
    (out, start.elapsed())
}

/// What a create does today: the sandbox directory with the overlay's two directories.
fn reference(dir: &Path) -> Duration {
    let (_, d) = time(|| {
        fs::create_dir(dir).unwrap();
        fs::create_dir(dir.join("upper")).unwrap();
        fs::create_dir(dir.join("work")).unwrap();
    });
    fs::remove_dir_all(dir).unwrap();
    d
}

fn header() {
    println!(
        "{:<44} {:>9} {:>9} {:>10} {:>10}",
        "step", "p50 ms", "p99 ms", "p50 ratio", "p99 ratio"
    );
}

fn row(s: &Samples, reference: &Samples) {
    let (p50, p99) = (s.percentile(0.5), s.percentile(0.99));
    let (r50, r99) = (reference.percentile(0.5), reference.percentile(0.99));
    println!(
        "  {:<42} {:>9.3} {:>9.3} {:>9.1}× {:>9.1}×",
        s.name,
        ms(p50),
        ms(p99),
        p50.as_secs_f64() / r50.as_secs_f64(),
        p99.as_secs_f64() / r99.as_secs_f64()
    );
}

fn main() {
    let mut args = std::env::args().skip(1);
    let iterations: usize = args.next().map_or(200, |a| a.parse().expect("iterations"));
    let size_mb: u64 = args
        .next()
        .map_or(1024, |a| a.parse().expect("size in MiB"));
    let tmp;
    let base: PathBuf = match args.next() {
        Some(dir) => PathBuf::from(dir),
        None => {
            tmp = tempfile::tempdir().expect("temporary directory");
            tmp.path().to_path_buf()
        }
    };
    // A shared mount of its own, as a node's sandbox directories are.
    let own_mount = make_shared_mount(&base).expect("making the directory a shared mount");
    let cache = base.join("cache");
    let (_, mkfs) = time(|| ensure_blank(&cache, size_mb).expect("formatting the blank"));
    let blank_meta = fs::metadata(disk::blank_path(&cache, size_mb)).unwrap();
    println!(
        "layer_disk_bench: {iterations} iterations, {size_mb} MiB layers in {}",
        base.display()
    );
    println!(
        "blank: formatted once in {:.1} ms; {} KiB allocated of {} MiB",
        ms(mkfs),
        std::os::unix::fs::MetadataExt::blocks(&blank_meta) / 2,
        size_mb
    );

    // Phase 1: layers made inline.
    let modes = [
        ("direct I/O", MountOptions::default()),
        (
            "buffered",
            MountOptions {
                direct_io: false,
                ..MountOptions::default()
            },
        ),
    ];
    let mut reference1 = Samples::new("reference: mkdir dir, upper/, work/");
    let mut steps: Vec<[Samples; 5]> = modes
        .iter()
        .map(|_| {
            [
                Samples::new("create_layer_image"),
                Samples::new("mount_layer"),
                Samples::new("create + mount (on a create's path)"),
                Samples::new("discard (unmount)"),
                Samples::new("create + mount + discard"),
            ]
        })
        .collect();
    let mut dio_active = [false; 2];
    for i in 0..iterations {
        reference1
            .values
            .push(reference(&base.join(format!("ref-{i}"))));
        for (m, (_, options)) in modes.iter().enumerate() {
            let dir = base.join(format!("sb-{m}-{i}"));
            fs::create_dir(&dir).unwrap();
            let image = dir.join(disk::LAYER_IMAGE);
            let (_, create) = time(|| create_layer_image(&cache, size_mb, &image).unwrap());
            let (layer, mount) =
                time(|| mount_layer_with(&image, &dir.join(disk::LAYER_DIR), *options).unwrap());
            dio_active[m] = layer.direct_io();
            let (_, unmount) = time(|| layer.discard().unwrap());
            let s = &mut steps[m];
            s[0].values.push(create);
            s[1].values.push(mount);
            s[2].values.push(create + mount);
            s[3].values.push(unmount);
            s[4].values.push(create + mount + unmount);
            fs::remove_dir_all(&dir).unwrap();
        }
    }

    // Phase 2: layers from a pool.
    let pool = LayerPool::start(
        &base.join("pool"),
        &cache,
        size_mb,
        2,
        MountOptions::default(),
    )
    .expect("starting the layer pool");
    let mut reference2 = Samples::new("reference, right after a take (pool refills)");
    let mut take = Samples::new("take (one rename)");
    let mut discard = Samples::new("discard (unmount)");
    for i in 0..iterations {
        pool.wait_ready(2, Duration::from_secs(10));
        let dir = base.join(format!("sb-pool-{i}"));
        let (layer, d) = time(|| pool.take(&dir).unwrap());
        reference2
            .values
            .push(reference(&base.join(format!("ref2-{i}"))));
        if let Some(layer) = layer {
            take.values.push(d);
            let (_, d) = time(|| layer.discard().unwrap());
            discard.values.push(d);
        }
        fs::remove_dir_all(&dir).unwrap();
    }
    let pool_stats = pool.stats();
    pool.shutdown();

    println!();
    header();
    println!("phase 1, inline:");
    row(&reference1, &reference1);
    for (m, (mode, _)) in modes.iter().enumerate() {
        let active = if dio_active[m] { "on" } else { "off" };
        println!("layer, {mode} (direct I/O {active}):");
        for s in &steps[m] {
            row(s, &reference1);
        }
        let extra = steps[m][2]
            .percentile(0.5)
            .saturating_sub(reference1.percentile(0.5));
        println!("  added to a create, p50: {:.3} ms", ms(extra));
    }
    println!(
        "phase 2, a pool of 2 (direct I/O; {} takes served, {} found it empty):",
        pool_stats.taken, pool_stats.empty
    );
    row(&reference2, &reference1);
    if !take.values.is_empty() {
        row(&take, &reference1);
        row(&discard, &reference1);
        println!(
            "  added to a create, p50: {:.3} ms (take) + {:.3} ms (slower reference)",
            ms(take.percentile(0.5)),
            ms(reference2
                .percentile(0.5)
                .saturating_sub(reference1.percentile(0.5)))
        );
    }

    println!();
    println!("write 128 MiB + fsync into a layer (3 runs each):");
    for (mode, options) in &modes {
        let dir = base.join(format!("write-{}", options.direct_io));
        fs::create_dir(&dir).unwrap();
        let image = dir.join(disk::LAYER_IMAGE);
        create_layer_image(&cache, size_mb.max(256), &image).unwrap();
        let layer = mount_layer_with(&image, &dir.join(disk::LAYER_DIR), *options).unwrap();
        let chunk = vec![0xa5u8; 1 << 20];
        let mut rates = Vec::new();
        let mut cache_growth = Vec::new();
        for run in 0..3 {
            let path = layer.upper().join(format!("f{run}"));
            // The layer's own file system caches the 128 MiB; growth beyond that is the
            // image's second copy.
            let before = cached_kib();
            let (_, d) = time(|| {
                let mut f = fs::File::create(&path).unwrap();
                for _ in 0..128 {
                    f.write_all(&chunk).unwrap();
                }
                f.sync_all().unwrap();
            });
            cache_growth.push(cached_kib().saturating_sub(before) / 1024);
            rates.push(128.0 / d.as_secs_f64());
            fs::remove_file(&path).unwrap();
        }
        println!(
            "  {mode:<11} {:>7.0} {:>7.0} {:>7.0} MiB/s; host page cache +{:?} MiB",
            rates[0], rates[1], rates[2], cache_growth
        );
        layer.discard().unwrap();
        fs::remove_dir_all(&dir).unwrap();
    }
    if own_mount {
        nix::mount::umount2(&base, nix::mount::MntFlags::MNT_DETACH).expect("unmounting");
    }
}

/// `Cached:` of /proc/meminfo, KiB.
fn cached_kib() -> u64 {
    let text = fs::read_to_string("/proc/meminfo").unwrap_or_default();
    text.lines()
        .find_map(|l| l.strip_prefix("Cached:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}
