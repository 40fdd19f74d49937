//! The gateway's entries of the `Server-Timing` response header: where a control-plane
//! request spent its time in the gateway (`schedule`, `upstream`, `record`, ...), and
//! its total there (`gateway`), added after the node's own entries. Measured with
//! [`std::time::Instant`] into a fixed array; the header is the one string built.
//! What each entry means is in docs/sandbox-api.md.

use std::fmt::Write as _;
use std::time::{Duration, Instant};

use http::{HeaderMap, HeaderValue};

/// The response header.
pub const SERVER_TIMING: &str = "server-timing";

/// Most phases the gateway records for one request.
const MAX_PHASES: usize = 8;

/// The gateway's phases of one request, in the order they ended.
pub(super) struct Phases {
    start: Instant,
    last: Instant,
    done: [(&'static str, Duration); MAX_PHASES],
    len: usize,
}

impl Phases {
    /// Phases of a request the gateway began at `start`; the first runs from now.
    pub(super) fn new(start: Instant) -> Self {
        Self {
            start,
            last: Instant::now(),
            done: [("", Duration::ZERO); MAX_PHASES],
            len: 0,
        }
    }

    /// Ends phase `name` now.
    pub(super) fn mark(&mut self, name: &'static str) {
        let now = Instant::now();
        if let Some(slot) = self.done.get_mut(self.len) {
            *slot = (name, now - self.last);
            self.len += 1;
        }
        self.last = now;
    }

    /// Starts the next phase now; the time since the last mark stays in no entry.
    pub(super) fn skip(&mut self) {
        self.last = Instant::now();
    }

    /// Whether phase `name` was recorded.
    pub(super) fn has(&self, name: &str) -> bool {
        self.done[..self.len].iter().any(|(n, _)| *n == name)
    }

    /// Appends the phases and the total (`gateway`, since the request began) to the
    /// node's `Server-Timing` in `headers` (set when the node sent none).
    pub(super) fn apply(&self, headers: &mut HeaderMap) {
        let node = headers
            .get(SERVER_TIMING)
            .and_then(|v| v.to_str().ok())
            .filter(|v| !v.trim().is_empty());
        let mut s = String::with_capacity(node.map_or(0, str::len) + 16 * (self.len + 1));
        if let Some(node) = node {
            s.push_str(node);
        }
        let total = [("gateway", self.start.elapsed())];
        for (name, took) in self.done[..self.len].iter().chain(&total) {
            if !s.is_empty() {
                s.push_str(", ");
            }
            let _ = write!(s, "{name};dur={:.2}", took.as_secs_f64() * 1e3);
        }
        if let Ok(v) = HeaderValue::from_str(&s) {
            headers.insert(SERVER_TIMING, v);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gateway_entries_follow_the_nodes_and_end_with_the_total() {
        let mut p = Phases::new(Instant::now());
        p.mark("schedule");
        p.skip();
        p.mark("upstream");
        let mut h = HeaderMap::new();
        h.insert(
            SERVER_TIMING,
            HeaderValue::from_static("spawn;dur=1.00, node;dur=2.00"),
        );
        p.apply(&mut h);
        let v = h[SERVER_TIMING].to_str().unwrap();
        let names: Vec<&str> = v
            .split(", ")
            .map(|e| e.split(';').next().unwrap())
            .collect();
        assert_eq!(names, ["spawn", "node", "schedule", "upstream", "gateway"]);
        assert!(v.starts_with("spawn;dur=1.00, node;dur=2.00, schedule;dur="));

        let mut h = HeaderMap::new();
        p.apply(&mut h);
        assert!(
            h[SERVER_TIMING]
                .to_str()
                .unwrap()
                .starts_with("schedule;dur=")
        );
        assert!(p.has("upstream") && !p.has("record"));
    }
}
