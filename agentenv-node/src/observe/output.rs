//! A sandbox's output turned into log entries. Every byte is the tenant's: lines are cut
//! at [`MAX_LINE`] bytes, terminal escape sequences, control and bidirectional-override
//! characters are removed, invalid UTF-8 is replaced, and what is stored is held to a
//! rate budget (a token bucket of [`RATE_BYTES`] per second, [`BURST_BYTES`] at once).
//! Output past the budget is read and dropped, counted in one entry once the budget
//! allows again; while it is dropping, a reader pauses between reads, so a flood costs
//! the node at most [`READ_CHUNK`] bytes per [`DRAIN_PAUSE`] and otherwise fills the
//! pipe and blocks the writer.

use std::collections::BTreeMap;
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::logbook::{Level, LogEntry, SandboxLog};

/// Longest line stored, in bytes of output; a longer one is stored in pieces.
pub const MAX_LINE: usize = 4096;
/// Bytes of output per second a source may store.
pub const RATE_BYTES: u64 = 32 * 1024;
/// Bytes of output a source may store at once, after a quiet time.
pub const BURST_BYTES: u64 = 256 * 1024;
/// What one entry costs beyond its message (its time, level and fields on disk).
const ENTRY_COST: u64 = 96;
/// Bytes read from a pipe at once.
pub const READ_CHUNK: usize = 64 * 1024;
/// Pause between reads while output is being dropped.
pub const DRAIN_PAUSE: Duration = Duration::from_millis(50);

/// `raw` as a line fit for the log: escape sequences and control characters removed
/// (a tab becomes a space), invalid UTF-8 replaced, trailing white space trimmed.
pub fn clean(raw: &[u8]) -> String {
    let tabs: Vec<u8> = raw
        .iter()
        .map(|&b| if b == b'\t' { b' ' } else { b })
        .collect();
    let stripped = strip_ansi_escapes::strip(tabs);
    String::from_utf8_lossy(&stripped)
        .chars()
        .filter(|c| {
            !(c.is_control()
                || matches!(c, '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}'))
        })
        .collect::<String>()
        .trim_end()
        .to_string()
}

/// Splits a byte stream into lines of at most `max` bytes (newline excluded).
#[derive(Debug)]
pub struct LineSplitter {
    partial: Vec<u8>,
    max: usize,
}

impl LineSplitter {
    pub fn new(max: usize) -> Self {
        Self {
            partial: Vec::new(),
            max: max.max(1),
        }
    }

    /// Adds `bytes`; complete lines (and pieces of `max` bytes) go to `out`.
    pub fn push(&mut self, mut bytes: &[u8], out: &mut Vec<Vec<u8>>) {
        while !bytes.is_empty() {
            match bytes.iter().position(|&b| b == b'\n') {
                Some(pos) if self.partial.len() + pos <= self.max => {
                    self.partial.extend_from_slice(&bytes[..pos]);
                    out.push(std::mem::take(&mut self.partial));
                    bytes = &bytes[pos + 1..];
                }
                _ => {
                    let room = self.max - self.partial.len();
                    let take = room.min(bytes.len());
                    self.partial.extend_from_slice(&bytes[..take]);
                    bytes = &bytes[take..];
                    if self.partial.len() == self.max {
                        out.push(std::mem::take(&mut self.partial));
                    }
                }
            }
        }
    }

    /// What is left after the stream ended.
    pub fn finish(&mut self, out: &mut Vec<Vec<u8>>) {
        if !self.partial.is_empty() {
            out.push(std::mem::take(&mut self.partial));
        }
    }
}

/// A token bucket of bytes.
#[derive(Debug)]
pub struct Budget {
    rate: f64,
    burst: f64,
    tokens: f64,
    last: Instant,
}

impl Budget {
    /// `rate` bytes per second, at most `burst` at once; full at `now`.
    pub fn new(rate: u64, burst: u64, now: Instant) -> Self {
        Self {
            rate: rate as f64,
            burst: burst as f64,
            tokens: burst as f64,
            last: now,
        }
    }

    /// Takes `n` bytes at `now` if the bucket holds them.
    pub fn take(&mut self, n: u64, now: Instant) -> bool {
        let dt = now.saturating_duration_since(self.last).as_secs_f64();
        self.last = now;
        self.tokens = (self.tokens + dt * self.rate).min(self.burst);
        if self.tokens >= n as f64 {
            self.tokens -= n as f64;
            true
        } else {
            false
        }
    }
}

/// The level of a line of the agent's own log (`… WARN target: …`); other lines are
/// `info`.
pub fn agent_level(line: &str) -> Level {
    let head: String = line.chars().take(64).collect();
    if head.contains(" ERROR ") {
        Level::Error
    } else if head.contains(" WARN ") {
        Level::Warn
    } else if head.contains(" DEBUG ") || head.contains(" TRACE ") {
        Level::Debug
    } else {
        Level::Info
    }
}

/// One source of output feeding a sandbox's log: its lines, budget and fields.
pub struct Feed {
    log: Arc<SandboxLog>,
    fields: BTreeMap<String, String>,
    level: fn(&str) -> Level,
    lines: LineSplitter,
    budget: Budget,
    dropped_lines: u64,
    dropped_bytes: u64,
}

impl Feed {
    /// A feed into `log` whose entries carry `fields` and get `level` from their line.
    pub fn new(log: Arc<SandboxLog>, fields: &[(&str, &str)], level: fn(&str) -> Level) -> Self {
        Self {
            log,
            fields: fields
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            level,
            lines: LineSplitter::new(MAX_LINE),
            budget: Budget::new(RATE_BYTES, BURST_BYTES, Instant::now()),
            dropped_lines: 0,
            dropped_bytes: 0,
        }
    }

    /// The log it feeds.
    pub fn log(&self) -> &Arc<SandboxLog> {
        &self.log
    }

    /// Takes `bytes` of output at `now`; returns whether some of it was dropped.
    pub fn push(&mut self, bytes: &[u8], now: Instant) -> bool {
        let mut raw = Vec::new();
        self.lines.push(bytes, &mut raw);
        self.store(raw, now)
    }

    /// The stream ended: stores what is left.
    pub fn finish(&mut self) {
        let mut raw = Vec::new();
        self.lines.finish(&mut raw);
        self.store(raw, Instant::now());
        if self.dropped_lines > 0 {
            let e = self.dropped_entry();
            self.append(&[e]);
        }
    }

    fn store(&mut self, raw: Vec<Vec<u8>>, now: Instant) -> bool {
        let mut entries = Vec::new();
        let mut dropped = false;
        for line in raw {
            let text = clean(&line);
            if text.is_empty() {
                continue;
            }
            if self.budget.take(text.len() as u64 + ENTRY_COST, now) {
                if self.dropped_lines > 0 {
                    entries.push(self.dropped_entry());
                }
                let level = (self.level)(&text);
                entries.push(self.entry(level, text));
            } else {
                self.dropped_lines += 1;
                self.dropped_bytes += line.len() as u64;
                dropped = true;
            }
        }
        self.append(&entries);
        dropped
    }

    fn entry(&self, level: Level, message: String) -> LogEntry {
        let mut e = LogEntry::now(level, message, &[]);
        e.fields = self.fields.clone();
        e
    }

    fn dropped_entry(&mut self) -> LogEntry {
        let msg = format!(
            "[{} lines ({} bytes) of output dropped: more than {} bytes per second]",
            self.dropped_lines, self.dropped_bytes, RATE_BYTES
        );
        self.dropped_lines = 0;
        self.dropped_bytes = 0;
        self.entry(Level::Warn, msg)
    }

    fn append(&self, entries: &[LogEntry]) {
        if let Err(e) = self.log.append(entries) {
            tracing::warn!(error = %e, "writing a sandbox log");
        }
    }
}

/// Copies what is written into the pipe `read` (its read end) into `feed` until every
/// writer has closed it.
pub async fn pump_pipe(read: OwnedFd, mut feed: Feed) {
    use tokio::io::AsyncReadExt;
    let mut rx = match tokio::net::unix::pipe::Receiver::from_owned_fd(read) {
        Ok(rx) => rx,
        Err(e) => {
            tracing::warn!(error = %e, "reading a sandbox's output");
            return;
        }
    };
    let mut buf = vec![0u8; READ_CHUNK];
    loop {
        match rx.read(&mut buf).await {
            Ok(0) => break,
            Ok(n) => {
                if feed.push(&buf[..n], Instant::now()) {
                    tokio::time::sleep(DRAIN_PAUSE).await;
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => {
                tracing::debug!(error = %e, "a sandbox's output ended");
                break;
            }
        }
    }
    feed.finish();
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::observe::logbook::{LogBook, LogQuery};

    #[test]
    fn cleaning_removes_escapes_controls_and_bad_utf8() {
        assert_eq!(clean(b"\x1b[31mred\x1b[0m text\r"), "red text");
        assert_eq!(clean(b"a\x00b\x07c\x7fd"), "abcd");
        assert_eq!(clean(b"bad \xff\xfe utf8"), "bad \u{fffd}\u{fffd} utf8");
        assert_eq!(clean(b"\x1b]0;title\x07after"), "after");
        assert_eq!(clean("x\u{202e}y\u{0085}z".as_bytes()), "xyz");
        assert_eq!(clean(b"tab\there"), "tab here");
        assert_eq!(
            clean(b"\x1b[31mred\x1b[0m \x1b]0;title\x07 \xff\xfe\x00\x08bell\x07"),
            "red  \u{fffd}\u{fffd}bell"
        );
    }

    #[test]
    fn lines_are_split_and_long_ones_cut_into_pieces() {
        let mut s = LineSplitter::new(4);
        let mut out = Vec::new();
        s.push(b"ab\ncdefgh", &mut out);
        s.push(b"ij\n\nk", &mut out);
        s.finish(&mut out);
        let got: Vec<&[u8]> = out.iter().map(Vec::as_slice).collect();
        assert_eq!(got, [&b"ab"[..], b"cdef", b"ghij", b"", b"k"]);
    }

    #[test]
    fn the_budget_refills_at_its_rate_up_to_its_burst() {
        let t0 = Instant::now();
        let mut b = Budget::new(100, 1000, t0);
        assert!(b.take(1000, t0));
        assert!(!b.take(1, t0));
        assert!(b.take(50, t0 + Duration::from_millis(500)));
        assert!(!b.take(60, t0 + Duration::from_millis(500)));
        // Never more than the burst, however long the pause.
        assert!(!b.take(1001, t0 + Duration::from_secs(3600)));
        assert!(b.take(1000, t0 + Duration::from_secs(3600)));
    }

    #[test]
    fn agent_levels_come_from_its_log_format() {
        assert_eq!(
            agent_level("2024-01-01T00:00:00Z  WARN agentenv_guest: slow"),
            Level::Warn
        );
        assert_eq!(agent_level("2024-01-01T00:00:00Z ERROR x: y"), Level::Error);
        assert_eq!(agent_level("plain output"), Level::Info);
    }

    #[tokio::test]
    async fn a_flood_is_held_to_the_budget_and_the_drop_is_logged() {
        let dir = tempfile::tempdir().unwrap();
        let book = LogBook::new(dir.path(), 64 << 20);
        let log = book.open("sbx").unwrap();
        let mut feed = Feed::new(log.clone(), &[("source", "agent")], agent_level);
        let line = [b'z'; 1000];
        let mut flood = Vec::new();
        for _ in 0..4096 {
            flood.extend_from_slice(&line);
            flood.push(b'\n');
        }
        let now = Instant::now();
        assert!(feed.push(&flood, now), "4 MiB at once is past the budget");
        feed.finish();
        let entries = log
            .read(&LogQuery {
                limit: usize::MAX,
                ..Default::default()
            })
            .unwrap();
        let stored: u64 = entries.iter().map(|e| e.message.len() as u64).sum();
        assert!(stored <= BURST_BYTES, "{stored} bytes stored");
        let last = entries.last().unwrap();
        assert!(
            last.message.contains("of output dropped") && last.level == Level::Warn,
            "{last:?}"
        );
        assert_eq!(entries[0].fields["source"], "agent");
    }
}
