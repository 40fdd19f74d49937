//! Where an operation spends its time, as the standard `Server-Timing` response header
//! (`Server-Timing: claim;dur=0.41, layer;dur=0.83, ...`, milliseconds with two
//! decimals).
//!
//! The phases of an operation are recorded into the [`Timings`] of the task that runs it
//! ([`collect`]); code deep in the path records with [`record`] or a [`Lap`], which do
//! nothing outside [`collect`] (a backend driven directly, a test). A [`Timings`] is a
//! fixed array: recording allocates nothing, and building the header is one string.
//! Phases are disjoint and in the order they ended; what lies between them is left out,
//! so their sum is at most the operation's total. What each entry means is in
//! docs/sandbox-api.md.

use std::cell::RefCell;
use std::fmt::{self, Write as _};
use std::future::Future;
use std::time::{Duration, Instant};

use http::HeaderValue;

/// The response header.
pub const SERVER_TIMING: &str = "server-timing";

/// Most entries one operation records; later ones are dropped.
pub const MAX_ENTRIES: usize = 40;

/// The recorded phases of one operation, in the order they ended.
#[derive(Clone, Copy)]
pub struct Timings {
    entries: [(&'static str, Duration); MAX_ENTRIES],
    len: usize,
}

impl Default for Timings {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for Timings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Timings({self})")
    }
}

impl Timings {
    /// No phase yet.
    pub const fn new() -> Self {
        Self {
            entries: [("", Duration::ZERO); MAX_ENTRIES],
            len: 0,
        }
    }

    /// Adds phase `name` that took `took` (dropped when full).
    pub fn push(&mut self, name: &'static str, took: Duration) {
        if let Some(slot) = self.entries.get_mut(self.len) {
            *slot = (name, took);
            self.len += 1;
        }
    }

    /// Adds the phases of `other` after these.
    pub fn extend(&mut self, other: &Timings) {
        for (name, took) in other.entries() {
            self.push(name, *took);
        }
    }

    /// The phases, in the order they ended.
    pub fn entries(&self) -> &[(&'static str, Duration)] {
        &self.entries[..self.len]
    }

    /// How long phase `name` took (the first of that name).
    pub fn get(&self, name: &str) -> Option<Duration> {
        self.entries()
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, d)| *d)
    }

    /// The sum of the phases.
    pub fn sum(&self) -> Duration {
        self.entries().iter().map(|(_, d)| *d).sum()
    }

    /// The `Server-Timing` value of these phases followed by `total` (the whole
    /// operation, e.g. `("node", elapsed)`).
    pub fn header(&self, total: (&'static str, Duration)) -> HeaderValue {
        let mut s = String::with_capacity(16 * (self.len + 1));
        let _ = write!(s, "{self}");
        if !s.is_empty() {
            s.push_str(", ");
        }
        push_entry(&mut s, total.0, total.1);
        // Names are static identifiers and numbers: always a valid value.
        HeaderValue::from_str(&s).expect("a Server-Timing value is visible ASCII")
    }
}

impl fmt::Display for Timings {
    /// The `Server-Timing` form: `name;dur=1.23, ...`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, (name, took)) in self.entries().iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{name};dur={:.2}", took.as_secs_f64() * 1e3)?;
        }
        Ok(())
    }
}

/// Appends `name;dur=<ms>` to a `Server-Timing` value being built.
pub fn push_entry(s: &mut String, name: &str, took: Duration) {
    let _ = write!(s, "{name};dur={:.2}", took.as_secs_f64() * 1e3);
}

tokio::task_local! {
    static CURRENT: RefCell<Timings>;
}

/// Runs `f`, recording the phases it records (in this task; not in tasks it spawns).
pub async fn collect<F: Future>(f: F) -> (F::Output, Timings) {
    CURRENT
        .scope(RefCell::new(Timings::new()), async move {
            let out = f.await;
            let timings = CURRENT.with(|t| *t.borrow());
            (out, timings)
        })
        .await
}

/// Records phase `name` that took `took` into the operation this task runs, if any.
pub fn record(name: &'static str, took: Duration) {
    let _ = CURRENT.try_with(|t| t.borrow_mut().push(name, took));
}

/// What this task's operation recorded so far (`None` outside [`collect`]).
pub fn snapshot() -> Option<Timings> {
    CURRENT.try_with(|t| *t.borrow()).ok()
}

/// Times consecutive phases: each [`Lap::mark`] records the time since the last one.
pub struct Lap {
    last: Instant,
}

impl Default for Lap {
    fn default() -> Self {
        Self::new()
    }
}

impl Lap {
    /// Starts the first phase now.
    pub fn new() -> Self {
        Self {
            last: Instant::now(),
        }
    }

    /// Ends phase `name` now.
    pub fn mark(&mut self, name: &'static str) {
        let now = Instant::now();
        record(name, now - self.last);
        self.last = now;
    }

    /// Ends phase `name` at `at` (between the last mark and now), e.g. when a blocking
    /// task started after waiting for a thread.
    pub fn split(&mut self, name: &'static str, at: Instant) {
        let at = at.clamp(self.last, Instant::now());
        record(name, at - self.last);
        self.last = at;
    }

    /// Starts the next phase now without recording the time since the last mark (it was
    /// recorded in finer phases elsewhere).
    pub fn skip(&mut self) {
        self.last = Instant::now();
    }
}

/// Parses a `Server-Timing` value into `(name, milliseconds)` pairs; `None` when an entry
/// has no valid non-negative `dur`.
pub fn parse(value: &str) -> Option<Vec<(String, f64)>> {
    value
        .split(',')
        .map(str::trim)
        .filter(|e| !e.is_empty())
        .map(|entry| {
            let mut parts = entry.split(';').map(str::trim);
            let name = parts.next()?.to_string();
            let dur = parts
                .find_map(|p| p.strip_prefix("dur="))?
                .parse::<f64>()
                .ok()
                .filter(|d| d.is_finite() && *d >= 0.0)?;
            Some((name, dur))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_lists_phases_in_order_then_the_total_in_milliseconds() {
        let mut t = Timings::new();
        t.push("claim", Duration::from_micros(410));
        t.push("layer", Duration::from_micros(1_834));
        let v = t.header(("node", Duration::from_micros(3_000)));
        assert_eq!(
            v.to_str().unwrap(),
            "claim;dur=0.41, layer;dur=1.83, node;dur=3.00"
        );
        assert_eq!(
            parse(v.to_str().unwrap()).unwrap(),
            [
                ("claim".to_string(), 0.41),
                ("layer".to_string(), 1.83),
                ("node".to_string(), 3.0)
            ]
        );
        assert_eq!(
            Timings::new()
                .header(("node", Duration::ZERO))
                .to_str()
                .unwrap(),
            "node;dur=0.00"
        );
    }

    #[test]
    fn a_full_timings_drops_further_phases() {
        let mut t = Timings::new();
        for _ in 0..MAX_ENTRIES + 5 {
            t.push("x", Duration::from_millis(1));
        }
        assert_eq!(t.entries().len(), MAX_ENTRIES);
    }

    #[test]
    fn parse_refuses_entries_without_a_valid_duration() {
        assert!(parse("a;dur=-1").is_none());
        assert!(parse("a;desc=x").is_none());
        assert!(parse("a;dur=NaN").is_none());
        assert_eq!(parse("a;desc=\"x\";dur=2").unwrap(), [("a".into(), 2.0)]);
    }

    #[tokio::test]
    async fn phases_recorded_inside_collect_are_returned_and_outside_ignored() {
        record("outside", Duration::from_millis(1));
        let ((), t) = collect(async {
            let mut lap = Lap::new();
            lap.mark("one");
            tokio::task::yield_now().await;
            record("two", Duration::from_millis(2));
        })
        .await;
        let names: Vec<_> = t.entries().iter().map(|(n, _)| *n).collect();
        assert_eq!(names, ["one", "two"]);
        assert_eq!(t.get("two"), Some(Duration::from_millis(2)));
        assert!(snapshot().is_none());
    }
}
