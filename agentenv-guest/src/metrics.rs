//! `GET /metrics`: CPU, memory and disk use of the sandbox, as envd reports
//! them (`{ts, cpu_count, cpu_used_pct, mem_total, mem_used, mem_cache,
//! mem_total_mib, mem_used_mib, disk_used, disk_total}`).

use parking_lot::Mutex;
use serde::Serialize;

/// One snapshot.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Metrics {
    pub ts: i64,
    pub cpu_count: u32,
    pub cpu_used_pct: f64,
    pub mem_total: u64,
    pub mem_used: u64,
    pub mem_cache: u64,
    pub mem_total_mib: u64,
    pub mem_used_mib: u64,
    pub disk_used: u64,
    pub disk_total: u64,
}

/// CPU time counters from `/proc/stat`: (busy, total) jiffies.
fn cpu_times() -> Option<(u64, u64)> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let line = stat.lines().find(|l| l.starts_with("cpu "))?;
    let v: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .filter_map(|x| x.parse().ok())
        .collect();
    // user nice system idle iowait irq softirq steal (guest counted in user)
    let total: u64 = v.iter().take(8).sum();
    let idle = v.get(3).copied().unwrap_or(0) + v.get(4).copied().unwrap_or(0);
    Some((total.saturating_sub(idle), total))
}

fn meminfo() -> (u64, u64, u64) {
    let text = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let get = |key: &str| {
        text.lines()
            .find(|l| l.starts_with(key))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|n| n.parse::<u64>().ok())
            .unwrap_or(0)
            * 1024
    };
    let total = get("MemTotal:");
    let available = get("MemAvailable:");
    (total, total.saturating_sub(available), get("Cached:"))
}

fn disk() -> (u64, u64) {
    // SAFETY: statfs is plain data; zeroed is a valid value.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: the path is a NUL-terminated literal and `st` a valid out pointer.
    if unsafe { libc::statfs(c"/".as_ptr(), &mut st) } != 0 {
        return (0, 0);
    }
    let bs = st.f_frsize as u64;
    let total = st.f_blocks as u64 * bs;
    let used = (st.f_blocks as u64).saturating_sub(st.f_bfree as u64) * bs;
    (used, total)
}

/// Keeps the previous CPU sample so each call reports use since the last.
#[derive(Debug, Default)]
pub struct MetricsSampler {
    prev: Mutex<Option<(u64, u64)>>,
}

impl MetricsSampler {
    /// Takes a snapshot now.
    pub fn sample(&self) -> Metrics {
        let now = cpu_times();
        let pct = {
            let mut prev = self.prev.lock();
            let base = prev.unwrap_or((0, 0));
            let pct = match now {
                Some((busy, total)) if total > base.1 => {
                    100.0 * (busy.saturating_sub(base.0)) as f64 / (total - base.1) as f64
                }
                _ => 0.0,
            };
            if now.is_some() {
                *prev = now;
            }
            (pct * 100.0).round() / 100.0
        };
        let (mem_total, mem_used, mem_cache) = meminfo();
        let (disk_used, disk_total) = disk();
        Metrics {
            ts: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs() as i64)
                .unwrap_or(0),
            cpu_count: std::thread::available_parallelism()
                .map(|n| n.get() as u32)
                .unwrap_or(1),
            cpu_used_pct: pct,
            mem_total,
            mem_used,
            mem_cache,
            mem_total_mib: mem_total / (1024 * 1024),
            mem_used_mib: mem_used / (1024 * 1024),
            disk_used,
            disk_total,
        }
    }
}
