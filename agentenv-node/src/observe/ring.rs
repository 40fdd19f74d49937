//! Resource samples of sandboxes: a bounded ring per sandbox, the CPU percent between
//! two readings, and the time ranges the API asks for.
//!
//! One [`Sample`] is 56 bytes; a ring of the default 720 samples is about 40 KiB, so a
//! thousand sandboxes' history takes about 40 MiB.

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use parking_lot::Mutex;
use tokio::time::Instant;

/// Default number of samples kept per sandbox.
pub const DEFAULT_HISTORY: usize = 720;
/// Most samples kept per sandbox.
pub const MAX_HISTORY: usize = 100_000;

/// Errors of metric queries.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RangeError {
    #[error(
        "the range is reversed: start {start} is after end {end} (both unix seconds); ask for start <= end"
    )]
    Reversed { start: u64, end: u64 },
}

/// What a sandbox used at one moment.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sample {
    /// When, ms since the epoch.
    pub ts_ms: u64,
    pub cpu_count: u32,
    /// CPU used since the previous sample, in percent of the sandbox's CPUs (0..=100).
    pub cpu_used_pct: f32,
    /// Memory used without the page cache, bytes.
    pub mem_used: u64,
    /// The memory limit, bytes.
    pub mem_total: u64,
    /// Page cache charged to the sandbox, bytes.
    pub mem_cache: u64,
    /// Bytes used on the sandbox's writable disk.
    pub disk_used: u64,
    /// The size of the sandbox's writable disk, bytes.
    pub disk_total: u64,
}

/// The CPU percent of `cpus` CPUs that `cpu` of CPU time over `wall` of wall time is,
/// within 0..=100 (no wall time: 0).
pub fn cpu_percent(cpu: Duration, wall: Duration, cpus: u32) -> f32 {
    let capacity = wall.as_secs_f64() * f64::from(cpus.max(1));
    if capacity <= 0.0 {
        return 0.0;
    }
    ((cpu.as_secs_f64() / capacity) * 100.0).clamp(0.0, 100.0) as f32
}

/// A time range in unix seconds, both ends inclusive and optional.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Range {
    pub start: Option<u64>,
    pub end: Option<u64>,
}

impl Range {
    /// The range from `start` to `end`, refused when reversed.
    pub fn new(start: Option<u64>, end: Option<u64>) -> Result<Self, RangeError> {
        if let (Some(s), Some(e)) = (start, end)
            && s > e
        {
            return Err(RangeError::Reversed { start: s, end: e });
        }
        Ok(Self { start, end })
    }

    /// Whether a sample at `ts_ms` is in the range.
    pub fn contains(&self, ts_ms: u64) -> bool {
        let s = ts_ms / 1000;
        self.start.is_none_or(|a| s >= a) && self.end.is_none_or(|b| s <= b)
    }
}

/// The samples of one sandbox, oldest first, at most `cap`.
#[derive(Debug)]
pub struct Ring {
    cap: usize,
    samples: VecDeque<Sample>,
}

impl Ring {
    /// An empty ring of at most `cap` samples; it grows as samples come (a sandbox that
    /// lives a second does not hold room for a day of them).
    pub fn new(cap: usize) -> Self {
        Self {
            cap: cap.max(1),
            samples: VecDeque::new(),
        }
    }

    /// Adds `s`, dropping the oldest sample when full.
    pub fn push(&mut self, s: Sample) {
        if self.samples.len() == self.cap {
            self.samples.pop_front();
        }
        self.samples.push_back(s);
    }

    pub fn len(&self) -> usize {
        self.samples.len()
    }

    pub fn is_empty(&self) -> bool {
        self.samples.is_empty()
    }

    /// The samples in `range`, oldest first.
    pub fn in_range(&self, range: Range) -> Vec<Sample> {
        self.samples
            .iter()
            .filter(|s| range.contains(s.ts_ms))
            .copied()
            .collect()
    }

    pub fn latest(&self) -> Option<Sample> {
        self.samples.back().copied()
    }
}

/// A sandbox's series: its ring and the reading the next CPU percent is measured from.
#[derive(Debug)]
struct Series {
    ring: Ring,
    /// (when, CPU time then) of the last reading while it ran.
    last: Option<(Instant, Duration)>,
}

/// What one reading of a running sandbox gave (see [`MetricStore::record`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reading {
    pub at: Instant,
    pub ts_ms: u64,
    pub cpu_time: Duration,
    pub cpu_count: u32,
    pub mem_used: u64,
    pub mem_total: u64,
    pub mem_cache: u64,
    pub disk_used: u64,
    pub disk_total: u64,
}

/// The series of every sandbox of a node.
#[derive(Debug)]
pub struct MetricStore {
    history: usize,
    series: Mutex<HashMap<String, Series>>,
}

impl MetricStore {
    /// A store keeping `history` samples per sandbox (clamped to 1..=[`MAX_HISTORY`]).
    pub fn new(history: usize) -> Self {
        Self {
            history: history.clamp(1, MAX_HISTORY),
            series: Mutex::new(HashMap::new()),
        }
    }

    /// Starts sandbox `id`'s measure: its series exists from now on (kept if it had one)
    /// and its next reading only starts the measure.
    pub fn start(&self, id: &str) {
        self.with_series(id, |s| s.last = None);
    }

    /// Makes sandbox `id`'s series if it has none (one that exists is left as it is).
    pub fn ensure(&self, id: &str) {
        self.with_series(id, |_| {});
    }

    /// Runs `f` on sandbox `id`'s series, made first if it has none.
    fn with_series(&self, id: &str, f: impl FnOnce(&mut Series)) {
        let mut all = self.series.lock();
        f(all.entry(id.to_string()).or_insert_with(|| Series {
            ring: Ring::new(self.history),
            last: None,
        }));
    }

    /// Whether sandbox `id` has a series.
    pub fn contains(&self, id: &str) -> bool {
        self.series.lock().contains_key(id)
    }

    /// Records reading `r` of sandbox `id`, whose series [`MetricStore::start`] made (a
    /// reading that comes after the series was removed, a sandbox deleted while it was
    /// read, is dropped). The first reading of a run (or one whose CPU time went back: a
    /// new process) only starts the measure; later ones add a sample.
    pub fn record(&self, id: &str, r: Reading) -> Option<Sample> {
        let mut all = self.series.lock();
        let s = all.get_mut(id)?;
        let prev = s.last.replace((r.at, r.cpu_time));
        let (at, cpu) = prev?;
        if r.cpu_time < cpu || r.at <= at {
            return None;
        }
        let sample = Sample {
            ts_ms: r.ts_ms,
            cpu_count: r.cpu_count,
            cpu_used_pct: cpu_percent(r.cpu_time - cpu, r.at - at, r.cpu_count),
            mem_used: r.mem_used,
            mem_total: r.mem_total,
            mem_cache: r.mem_cache,
            disk_used: r.disk_used,
            disk_total: r.disk_total,
        };
        s.ring.push(sample);
        Some(sample)
    }

    /// Sandbox `id` does not run (paused): the next reading starts a new measure.
    pub fn idle(&self, id: &str) {
        if let Some(s) = self.series.lock().get_mut(id) {
            s.last = None;
        }
    }

    /// Drops sandbox `id`'s series.
    pub fn remove(&self, id: &str) {
        self.series.lock().remove(id);
    }

    /// Drops the series of sandboxes `keep` does not name.
    pub fn retain(&self, keep: &dyn Fn(&str) -> bool) {
        self.series.lock().retain(|id, _| keep(id));
    }

    /// Sandbox `id`'s samples in `range`, oldest first.
    pub fn samples(&self, id: &str, range: Range) -> Vec<Sample> {
        self.series
            .lock()
            .get(id)
            .map(|s| s.ring.in_range(range))
            .unwrap_or_default()
    }

    /// Sandbox `id`'s latest sample.
    pub fn latest(&self, id: &str) -> Option<Sample> {
        self.series.lock().get(id).and_then(|s| s.ring.latest())
    }

    /// Samples kept per sandbox.
    pub fn history(&self) -> usize {
        self.history
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(ts_ms: u64) -> Sample {
        Sample {
            ts_ms,
            cpu_count: 1,
            cpu_used_pct: 0.0,
            mem_used: 0,
            mem_total: 0,
            mem_cache: 0,
            disk_used: 0,
            disk_total: 0,
        }
    }

    #[test]
    fn the_ring_keeps_the_newest_samples_up_to_its_cap() {
        let mut r = Ring::new(3);
        for t in 0..10 {
            r.push(sample(t));
        }
        assert_eq!(r.len(), 3);
        let ts: Vec<u64> = r
            .in_range(Range::default())
            .iter()
            .map(|s| s.ts_ms)
            .collect();
        assert_eq!(ts, [7, 8, 9]);
        assert_eq!(r.latest().unwrap().ts_ms, 9);
        assert_eq!(std::mem::size_of::<Sample>(), 56);
    }

    #[test]
    fn cpu_percent_is_cpu_time_over_wall_time_and_cpus() {
        let s = Duration::from_secs;
        assert_eq!(cpu_percent(s(1), s(1), 1), 100.0);
        assert_eq!(cpu_percent(s(1), s(1), 2), 50.0);
        assert_eq!(cpu_percent(Duration::from_millis(250), s(1), 1), 25.0);
        assert_eq!(cpu_percent(s(3), s(1), 2), 100.0, "clamped");
        assert_eq!(cpu_percent(s(1), Duration::ZERO, 1), 0.0);
        assert_eq!(cpu_percent(s(1), s(2), 0), 50.0, "0 CPUs counts as 1");
    }

    #[test]
    fn ranges_are_inclusive_seconds_and_reversed_ones_are_refused() {
        let r = Range::new(Some(10), Some(20)).unwrap();
        assert!(r.contains(10_000) && r.contains(20_999));
        assert!(!r.contains(9_999) && !r.contains(21_000));
        assert!(Range::new(Some(5), Some(5)).is_ok());
        let e = Range::new(Some(21), Some(20)).unwrap_err();
        assert!(e.to_string().contains("start 21 is after end 20"), "{e}");
        assert!(Range::new(None, Some(1)).unwrap().contains(0));
    }

    #[test]
    fn the_store_measures_cpu_between_readings_and_restarts_after_idle() {
        let store = MetricStore::new(10);
        let t0 = Instant::now();
        let reading = |secs: u64, cpu_ms: u64| Reading {
            at: t0 + Duration::from_secs(secs),
            ts_ms: secs * 1000,
            cpu_time: Duration::from_millis(cpu_ms),
            cpu_count: 2,
            mem_used: 1,
            mem_total: 2,
            mem_cache: 0,
            disk_used: 3,
            disk_total: 4,
        };
        assert!(
            store.record("a", reading(0, 0)).is_none(),
            "no series before its start"
        );
        assert!(!store.contains("a"), "a reading made no series");
        store.start("a");
        assert!(
            store.record("a", reading(0, 0)).is_none(),
            "the first starts"
        );
        let s = store.record("a", reading(1, 500)).unwrap();
        assert_eq!(s.cpu_used_pct, 25.0);
        store.idle("a");
        assert!(store.record("a", reading(10, 600)).is_none());
        assert_eq!(
            store.record("a", reading(11, 2600)).unwrap().cpu_used_pct,
            100.0
        );
        // CPU time going back is a new process: a new start, no sample.
        assert!(store.record("a", reading(12, 10)).is_none());
        assert_eq!(store.samples("a", Range::default()).len(), 2);
        store.retain(&|id| id != "a");
        assert!(store.latest("a").is_none());
        // A reading that comes after the series went (a sandbox deleted while it was
        // read) does not bring it back.
        assert!(store.record("a", reading(13, 20)).is_none());
        assert!(!store.contains("a"));
        // `ensure` makes a missing series and leaves an existing one's measure alone.
        store.ensure("b");
        assert!(store.record("b", reading(20, 0)).is_none());
        store.ensure("b");
        assert!(store.record("b", reading(21, 500)).is_some());
    }
}
