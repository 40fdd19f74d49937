//! The host's CPU, memory and disks, as heartbeats and `GET /nodes` report them. One
//! sampler serves both: CPU usage is measured between two refreshes, and a refresh
//! sooner than [`MIN_REFRESH`] after the last one answers the last figures.

use std::path::{Path, PathBuf};
use std::time::Duration;

use parking_lot::Mutex;
use tokio::time::Instant;

/// Refreshes closer than this give the figures of the last one.
pub const MIN_REFRESH: Duration = Duration::from_millis(500);

/// A file system's usage.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DiskSample {
    /// Where the file system is mounted (the mount holding the configured path).
    pub mount_point: String,
    /// Its source (`/dev/sda1`, `overlay`…).
    pub device: String,
    pub filesystem_type: String,
    pub used_bytes: u64,
    pub total_bytes: u64,
}

/// The host at one moment.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HostSample {
    /// CPU used across all CPUs since the refresh before, 0..=100.
    pub cpu_percent: u32,
    pub cpu_count: u32,
    pub memory_total_bytes: u64,
    pub memory_used_bytes: u64,
    pub disks: Vec<DiskSample>,
}

struct Inner {
    system: Option<sysinfo::System>,
    refreshed: Option<Instant>,
    last: HostSample,
}

/// Samples the host; share one per node.
pub struct HostSampler {
    disk_paths: Vec<PathBuf>,
    inner: Mutex<Inner>,
}

impl std::fmt::Debug for HostSampler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostSampler")
            .field("disk_paths", &self.disk_paths)
            .finish_non_exhaustive()
    }
}

impl HostSampler {
    /// A sampler reporting the file systems holding `disk_paths` (one entry per file
    /// system).
    pub fn new(disk_paths: Vec<PathBuf>) -> Self {
        let system = match sysinfo::System::new() {
            Ok(mut s) => {
                s.refresh_cpu_usage();
                s.refresh_memory();
                Some(s)
            }
            Err(e) => {
                tracing::warn!(error = %e, "host metrics unavailable; CPU and memory usage read as zero");
                None
            }
        };
        Self {
            disk_paths,
            inner: Mutex::new(Inner {
                system,
                refreshed: None,
                last: HostSample::default(),
            }),
        }
    }

    /// The host now (or at the last refresh, if it was less than [`MIN_REFRESH`] ago).
    pub fn sample(&self) -> HostSample {
        let mut inner = self.inner.lock();
        let now = Instant::now();
        if inner
            .refreshed
            .is_some_and(|t| now.saturating_duration_since(t) < MIN_REFRESH)
        {
            return inner.last.clone();
        }
        let mut s = HostSample::default();
        if let Some(system) = inner.system.as_mut() {
            system.refresh_cpu_usage();
            system.refresh_memory();
            s.cpu_percent = system.global_cpu_usage().round().clamp(0.0, 100.0) as u32;
            s.cpu_count = system.cpus().len() as u32;
            s.memory_total_bytes = system.total_memory();
            s.memory_used_bytes = system.used_memory();
        }
        if s.cpu_count == 0 {
            s.cpu_count = std::thread::available_parallelism()
                .map(|n| n.get() as u32)
                .unwrap_or(1);
        }
        let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        for p in &self.disk_paths {
            if let Some(d) = disk_sample(p, &mountinfo)
                && !s.disks.iter().any(|x| x.mount_point == d.mount_point)
            {
                s.disks.push(d);
            }
        }
        inner.refreshed = Some(now);
        inner.last = s.clone();
        s
    }
}

/// The usage of the file system holding `path`, named after its mount in `mountinfo`.
fn disk_sample(path: &Path, mountinfo: &str) -> Option<DiskSample> {
    use std::os::unix::fs::MetadataExt;
    let st = nix::sys::statvfs::statvfs(path).ok()?;
    let frsize = st.fragment_size() as u64;
    let total = st.blocks() as u64 * frsize;
    let free = st.blocks_free() as u64 * frsize;
    let dev = std::fs::metadata(path).ok()?.dev();
    let canonical = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    let mount = mount_of(mountinfo, &canonical, dev);
    let (mount_point, device, fs) = match mount {
        Some(m) => (m.mount_point, m.source, m.fs_type),
        None => (path.display().to_string(), String::new(), String::new()),
    };
    Some(DiskSample {
        mount_point,
        device,
        filesystem_type: fs,
        used_bytes: total.saturating_sub(free),
        total_bytes: total,
    })
}

/// One line of `/proc/self/mountinfo`.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Mount {
    dev: (u64, u64),
    mount_point: String,
    fs_type: String,
    source: String,
}

fn parse_mountinfo_line(line: &str) -> Option<Mount> {
    let (left, right) = line.split_once(" - ")?;
    let l: Vec<&str> = left.split(' ').collect();
    let r: Vec<&str> = right.split(' ').collect();
    let (maj, min) = l.get(2)?.split_once(':')?;
    Some(Mount {
        dev: (maj.parse().ok()?, min.parse().ok()?),
        mount_point: unescape(l.get(4)?),
        fs_type: r.first()?.to_string(),
        source: unescape(r.get(1).unwrap_or(&"")),
    })
}

/// Undoes mountinfo's octal escapes (`\040` for a space).
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            let v = (b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0');
            out.push(v);
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The mount of device `dev` whose mount point is the longest prefix of `path`.
fn mount_of(mountinfo: &str, path: &Path, dev: u64) -> Option<Mount> {
    let want = (nix::sys::stat::major(dev), nix::sys::stat::minor(dev));
    mountinfo
        .lines()
        .filter_map(parse_mountinfo_line)
        .filter(|m| m.dev == want && path.starts_with(&m.mount_point))
        .max_by_key(|m| m.mount_point.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    const MOUNTINFO: &str = "\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
30 22 0:26 / /sys/fs/cgroup ro - tmpfs tmpfs ro
41 22 8:17 / /var/lib/aenv rw - xfs /dev/sdb1 rw
42 22 8:17 /x /mnt/with\\040space rw - xfs /dev/sdb1 rw
";

    #[test]
    fn the_mount_of_a_path_is_the_longest_prefix_on_its_device() {
        let dev = |maj: u64, min: u64| nix::sys::stat::makedev(maj, min);
        let m = mount_of(MOUNTINFO, Path::new("/var/lib/aenv/sandboxes"), dev(8, 17)).unwrap();
        assert_eq!(m.mount_point, "/var/lib/aenv");
        assert_eq!(
            (m.fs_type.as_str(), m.source.as_str()),
            ("xfs", "/dev/sdb1")
        );
        let root = mount_of(MOUNTINFO, Path::new("/var/lib/other"), dev(8, 1)).unwrap();
        assert_eq!(root.mount_point, "/");
        let spaced = mount_of(MOUNTINFO, Path::new("/mnt/with space/a"), dev(8, 17)).unwrap();
        assert_eq!(spaced.mount_point, "/mnt/with space");
        assert!(mount_of(MOUNTINFO, Path::new("/var"), dev(9, 9)).is_none());
    }

    #[test]
    fn the_sampler_reports_this_hosts_memory_cpus_and_disk() {
        let dir = tempfile::tempdir().unwrap();
        let s = HostSampler::new(vec![dir.path().to_path_buf(), dir.path().join(".")]);
        let a = s.sample();
        assert!(a.cpu_count >= 1);
        assert!(a.memory_total_bytes > 0 && a.memory_used_bytes > 0);
        assert_eq!(a.disks.len(), 1, "one entry per file system: {:?}", a.disks);
        assert!(a.disks[0].total_bytes >= a.disks[0].used_bytes);
        assert!(a.disks[0].total_bytes > 0);
        assert!(!a.disks[0].filesystem_type.is_empty(), "{:?}", a.disks);
        // Within MIN_REFRESH the same figures come back.
        assert_eq!(s.sample(), a);
    }
}
