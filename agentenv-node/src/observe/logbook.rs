//! A sandbox's log: entries (time, level, message, string fields) as JSON lines in
//! `<dir>/<sandbox id>/current.jsonl` on the node's disk. When the current file would
//! pass its cap it becomes `previous.jsonl` (replacing the one before), so a sandbox's
//! log never takes more than two caps of disk. The log goes with its sandbox
//! ([`LogBook::remove`]); feeders attached to it (tasks copying a sandbox's output) are
//! stopped then, and whatever they still hold is dropped.
//!
//! Only the node writes these files (the tenant's bytes reach them through
//! [`super::output`], cleaned and rate-limited); the directory is the node's, never
//! inside a sandbox.

use std::collections::{BTreeMap, HashMap};
use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

/// The file entries are appended to.
pub const CURRENT: &str = "current.jsonl";
/// The file before the last rotation.
pub const PREVIOUS: &str = "previous.jsonl";
/// Default cap of one log file (two per sandbox).
pub const DEFAULT_FILE_BYTES: u64 = 512 * 1024;
/// Smallest cap of one log file: a few of the longest entries fit.
pub const MIN_FILE_BYTES: u64 = 64 * 1024;
/// Largest cap of one log file.
pub const MAX_FILE_BYTES: u64 = 64 << 20;
/// Longest message an entry keeps, in bytes (longer ones are cut).
pub const MAX_MESSAGE: usize = 4096;

/// Log errors.
#[derive(Debug, thiserror::Error)]
pub enum LogError {
    #[error("invalid level {0:?}: use debug, info, warn or error")]
    Level(String),
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
}

fn io(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> LogError {
    let context = context.into();
    move |source| LogError::Io { context, source }
}

/// How serious an entry is; a query asks for a level and above.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Level {
    Debug,
    Info,
    Warn,
    Error,
}

impl Level {
    /// The API's name of the level.
    pub fn as_str(self) -> &'static str {
        match self {
            Level::Debug => "debug",
            Level::Info => "info",
            Level::Warn => "warn",
            Level::Error => "error",
        }
    }
}

impl std::str::FromStr for Level {
    type Err = LogError;

    fn from_str(s: &str) -> Result<Self, LogError> {
        match s {
            "debug" => Ok(Level::Debug),
            "info" => Ok(Level::Info),
            "warn" => Ok(Level::Warn),
            "error" => Ok(Level::Error),
            other => Err(LogError::Level(other.chars().take(32).collect())),
        }
    }
}

/// One entry of a sandbox's log.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LogEntry {
    /// When it was logged, ms since the epoch.
    pub ts: u64,
    pub level: Level,
    pub message: String,
    /// Where it came from (`source`: `agent`, `start-cmd`, `node`; `stream`…).
    #[serde(default)]
    pub fields: BTreeMap<String, String>,
}

impl LogEntry {
    /// An entry logged now; a message longer than [`MAX_MESSAGE`] is cut.
    pub fn now(level: Level, message: impl Into<String>, fields: &[(&str, &str)]) -> Self {
        Self::at(crate::clock::now_ms(), level, message, fields)
    }

    /// An entry logged at `ts` (ms since the epoch).
    pub fn at(ts: u64, level: Level, message: impl Into<String>, fields: &[(&str, &str)]) -> Self {
        let mut message: String = message.into();
        if message.len() > MAX_MESSAGE {
            let mut cut = MAX_MESSAGE;
            while !message.is_char_boundary(cut) {
                cut -= 1;
            }
            message.truncate(cut);
        }
        Self {
            ts,
            level,
            message,
            fields: fields
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        }
    }
}

/// What a read of a log asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogQuery {
    /// Forward: entries at or after it; backward: at or before it (ms since the epoch).
    pub cursor_ms: Option<u64>,
    /// Newest first from the cursor (default: oldest first).
    pub backward: bool,
    /// The lowest level returned.
    pub min_level: Level,
    /// Only entries whose message contains this (case-sensitive).
    pub search: Option<String>,
    /// At most this many entries.
    pub limit: usize,
}

impl Default for LogQuery {
    fn default() -> Self {
        Self {
            cursor_ms: None,
            backward: false,
            min_level: Level::Debug,
            search: None,
            limit: 1000,
        }
    }
}

impl LogQuery {
    fn matches(&self, e: &LogEntry) -> bool {
        let in_range = match (self.cursor_ms, self.backward) {
            (None, _) => true,
            (Some(c), false) => e.ts >= c,
            (Some(c), true) => e.ts <= c,
        };
        in_range
            && e.level >= self.min_level
            && self.search.as_deref().is_none_or(|s| e.message.contains(s))
    }

    /// The page of `entries` (in file order) this query returns.
    fn page(&self, mut entries: Vec<LogEntry>) -> Vec<LogEntry> {
        // Appends are in time order unless the clock stepped back; the sort is stable.
        entries.sort_by_key(|e| e.ts);
        if self.backward {
            entries.reverse();
        }
        entries.truncate(self.limit);
        entries
    }
}

/// The log of one sandbox.
pub struct SandboxLog {
    dir: PathBuf,
    file_bytes: u64,
    state: Mutex<FileState>,
    feeders: Mutex<Vec<tokio::task::AbortHandle>>,
}

#[derive(Default)]
struct FileState {
    /// Bytes in the current file (`None`: not looked at yet).
    size: Option<u64>,
    /// The log was removed: appends are dropped.
    closed: bool,
}

impl SandboxLog {
    fn new(dir: PathBuf, file_bytes: u64) -> Self {
        Self {
            dir,
            file_bytes,
            state: Mutex::new(FileState::default()),
            feeders: Mutex::new(Vec::new()),
        }
    }

    /// Appends `entries`, rotating the current file when it would pass its cap. A
    /// removed log drops them.
    pub fn append(&self, entries: &[LogEntry]) -> Result<(), LogError> {
        if entries.is_empty() {
            return Ok(());
        }
        let mut st = self.state.lock();
        if st.closed {
            return Ok(());
        }
        let r = self.append_locked(&mut st, entries);
        if r.is_err() {
            st.size = None;
        }
        r
    }

    fn append_locked(&self, st: &mut FileState, entries: &[LogEntry]) -> Result<(), LogError> {
        std::fs::create_dir_all(&self.dir).map_err(io(format!(
            "creating the log directory {}",
            self.dir.display()
        )))?;
        let current = self.dir.join(CURRENT);
        let mut size = match st.size {
            Some(s) => s,
            None => std::fs::metadata(&current).map(|m| m.len()).unwrap_or(0),
        };
        let mut buf = Vec::new();
        for e in entries {
            let mut line = serde_json::to_vec(e).unwrap_or_default();
            line.push(b'\n');
            let pending = size + buf.len() as u64;
            if pending + line.len() as u64 > self.file_bytes && pending > 0 {
                write_append(&current, &buf)?;
                buf.clear();
                std::fs::rename(&current, self.dir.join(PREVIOUS))
                    .map_err(io(format!("rotating {}", current.display())))?;
                size = 0;
            }
            buf.extend_from_slice(&line);
        }
        write_append(&current, &buf)?;
        st.size = Some(size + buf.len() as u64);
        Ok(())
    }

    /// Appends one entry logged now; a failure is logged, not returned.
    pub fn push(&self, level: Level, message: impl Into<String>, fields: &[(&str, &str)]) {
        if let Err(e) = self.append(&[LogEntry::now(level, message, fields)]) {
            tracing::warn!(error = %e, "writing a sandbox log");
        }
    }

    /// Stops `task` when the log is removed (at once if it is already).
    pub fn attach(&self, task: tokio::task::AbortHandle) {
        let closed = self.state.lock().closed;
        if closed {
            task.abort();
            return;
        }
        let mut f = self.feeders.lock();
        f.retain(|t| !t.is_finished());
        f.push(task);
    }

    /// The entries `q` asks for.
    pub fn read(&self, q: &LogQuery) -> Result<Vec<LogEntry>, LogError> {
        // Held so that no rotation happens between the two files.
        let st = self.state.lock();
        let mut out = Vec::new();
        if !st.closed {
            for name in [PREVIOUS, CURRENT] {
                read_entries(&self.dir.join(name), &mut |e| {
                    if q.matches(&e) {
                        out.push(e);
                    }
                })?;
            }
        }
        drop(st);
        Ok(q.page(out))
    }

    /// Bytes the log takes on disk (both files).
    pub fn disk_bytes(&self) -> u64 {
        let _st = self.state.lock();
        [CURRENT, PREVIOUS]
            .iter()
            .filter_map(|n| std::fs::metadata(self.dir.join(n)).ok())
            .map(|m| m.len())
            .sum()
    }

    /// Drops later appends, stops the feeders and deletes the files.
    fn close(&self) {
        let mut st = self.state.lock();
        st.closed = true;
        for t in self.feeders.lock().drain(..) {
            t.abort();
        }
        match std::fs::remove_dir_all(&self.dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                tracing::warn!(dir = %self.dir.display(), error = %e, "removing a sandbox log")
            }
        }
    }
}

fn write_append(path: &Path, bytes: &[u8]) -> Result<(), LogError> {
    if bytes.is_empty() {
        return Ok(());
    }
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(io(format!("opening {}", path.display())))?;
    f.write_all(bytes)
        .map_err(io(format!("writing {}", path.display())))
}

/// Calls `f` with every entry of the file at `path` (absent: none). A line that is not
/// an entry (one cut by a crash) is skipped.
fn read_entries(path: &Path, f: &mut dyn FnMut(LogEntry)) -> Result<(), LogError> {
    let file = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(io(format!("opening {}", path.display()))(e)),
    };
    for line in std::io::BufReader::new(file).split(b'\n') {
        let line = line.map_err(io(format!("reading {}", path.display())))?;
        if let Ok(e) = serde_json::from_slice::<LogEntry>(&line) {
            f(e);
        }
    }
    Ok(())
}

/// The logs of a node's sandboxes, one directory each under one directory.
pub struct LogBook {
    dir: PathBuf,
    file_bytes: u64,
    logs: Mutex<HashMap<String, Arc<SandboxLog>>>,
}

impl std::fmt::Debug for LogBook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LogBook")
            .field("dir", &self.dir)
            .field("file_bytes", &self.file_bytes)
            .finish_non_exhaustive()
    }
}

impl LogBook {
    /// The logs under `dir`, each file capped at `file_bytes` (clamped to
    /// [`MIN_FILE_BYTES`]..=[`MAX_FILE_BYTES`]).
    pub fn new(dir: impl Into<PathBuf>, file_bytes: u64) -> Self {
        Self {
            dir: dir.into(),
            file_bytes: file_bytes.clamp(MIN_FILE_BYTES, MAX_FILE_BYTES),
            logs: Mutex::new(HashMap::new()),
        }
    }

    /// Where the logs are.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The cap of one log file.
    pub fn file_bytes(&self) -> u64 {
        self.file_bytes
    }

    /// The log of sandbox `id` (`None`: not a sandbox id a backend accepts).
    pub fn open(&self, id: &str) -> Option<Arc<SandboxLog>> {
        crate::backend::validate_sandbox_id(id).ok()?;
        let mut logs = self.logs.lock();
        Some(
            logs.entry(id.to_string())
                .or_insert_with(|| Arc::new(SandboxLog::new(self.dir.join(id), self.file_bytes)))
                .clone(),
        )
    }

    /// Appends one entry logged now to sandbox `id`'s log.
    pub fn push(
        &self,
        id: &str,
        level: Level,
        message: impl Into<String>,
        fields: &[(&str, &str)],
    ) {
        if let Some(log) = self.open(id) {
            log.push(level, message, fields);
        }
    }

    /// The entries of sandbox `id`'s log that `q` asks for.
    pub fn read(&self, id: &str, q: &LogQuery) -> Result<Vec<LogEntry>, LogError> {
        match self.open(id) {
            Some(log) => log.read(q),
            None => Ok(Vec::new()),
        }
    }

    /// Deletes sandbox `id`'s log and stops what feeds it.
    pub fn remove(&self, id: &str) {
        if crate::backend::validate_sandbox_id(id).is_err() {
            return;
        }
        let log = self.logs.lock().remove(id);
        match log {
            Some(log) => log.close(),
            None => SandboxLog::new(self.dir.join(id), self.file_bytes).close(),
        }
    }

    /// Deletes the logs of sandboxes `keep` does not name (those an earlier node process
    /// left behind); returns their ids.
    pub fn retain(&self, keep: &dyn Fn(&str) -> bool) -> Vec<String> {
        let Ok(rd) = std::fs::read_dir(&self.dir) else {
            return Vec::new();
        };
        let mut removed = Vec::new();
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if !keep(&name) && e.file_type().is_ok_and(|t| t.is_dir()) {
                self.remove(&name);
                removed.push(name);
            }
        }
        removed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(ts: u64, level: Level, msg: &str) -> LogEntry {
        LogEntry::at(ts, level, msg, &[("source", "test")])
    }

    #[test]
    fn rotation_keeps_the_log_within_two_caps_and_the_newest_entries() {
        let dir = tempfile::tempdir().unwrap();
        let book = LogBook::new(dir.path(), MIN_FILE_BYTES);
        let log = book.open("sbx-1").unwrap();
        let msg = "x".repeat(1000);
        for i in 0..1000u64 {
            log.append(&[entry(i, Level::Info, &format!("{i} {msg}"))])
                .unwrap();
        }
        let bytes = log.disk_bytes();
        assert!(bytes <= 2 * MIN_FILE_BYTES, "{bytes} bytes on disk");
        assert!(bytes > MIN_FILE_BYTES, "the previous file is kept: {bytes}");
        let cur = std::fs::metadata(dir.path().join("sbx-1").join(CURRENT))
            .unwrap()
            .len();
        assert!(cur <= MIN_FILE_BYTES, "{cur}");
        let all = log
            .read(&LogQuery {
                limit: usize::MAX,
                ..Default::default()
            })
            .unwrap();
        assert_eq!(all.last().unwrap().ts, 999, "the newest entry is kept");
        assert!(all.first().unwrap().ts > 0, "the oldest ones went");
        // Consecutive: nothing lost inside what is kept.
        for w in all.windows(2) {
            assert_eq!(w[1].ts, w[0].ts + 1);
        }
    }

    #[test]
    fn one_batch_larger_than_the_cap_rotates_inside_the_batch() {
        let dir = tempfile::tempdir().unwrap();
        let book = LogBook::new(dir.path(), MIN_FILE_BYTES);
        let log = book.open("sbx-1").unwrap();
        let batch: Vec<LogEntry> = (0..300)
            .map(|i| entry(i, Level::Info, &"y".repeat(1000)))
            .collect();
        log.append(&batch).unwrap();
        assert!(log.disk_bytes() <= 2 * MIN_FILE_BYTES);
    }

    #[test]
    fn queries_filter_by_level_search_and_cursor_in_both_directions() {
        let dir = tempfile::tempdir().unwrap();
        let book = LogBook::new(dir.path(), DEFAULT_FILE_BYTES);
        let log = book.open("sbx-1").unwrap();
        log.append(&[
            entry(10, Level::Debug, "boot"),
            entry(20, Level::Info, "hello world"),
            entry(30, Level::Warn, "disk low"),
            entry(40, Level::Error, "crash world"),
        ])
        .unwrap();
        let ts = |q: LogQuery| -> Vec<u64> { log.read(&q).unwrap().iter().map(|e| e.ts).collect() };
        assert_eq!(ts(LogQuery::default()), [10, 20, 30, 40]);
        assert_eq!(
            ts(LogQuery {
                min_level: Level::Warn,
                ..Default::default()
            }),
            [30, 40]
        );
        assert_eq!(
            ts(LogQuery {
                search: Some("world".into()),
                ..Default::default()
            }),
            [20, 40]
        );
        assert_eq!(
            ts(LogQuery {
                search: Some("World".into()),
                ..Default::default()
            }),
            Vec::<u64>::new(),
            "search is case-sensitive"
        );
        assert_eq!(
            ts(LogQuery {
                cursor_ms: Some(20),
                limit: 2,
                ..Default::default()
            }),
            [20, 30]
        );
        assert_eq!(
            ts(LogQuery {
                cursor_ms: Some(30),
                backward: true,
                ..Default::default()
            }),
            [30, 20, 10]
        );
        assert_eq!(
            ts(LogQuery {
                backward: true,
                limit: 1,
                ..Default::default()
            }),
            [40]
        );
    }

    #[test]
    fn a_removed_log_is_gone_and_takes_no_more_appends() {
        let dir = tempfile::tempdir().unwrap();
        let book = LogBook::new(dir.path(), DEFAULT_FILE_BYTES);
        let log = book.open("sbx-1").unwrap();
        log.push(Level::Info, "before", &[]);
        assert!(dir.path().join("sbx-1").exists());
        book.remove("sbx-1");
        assert!(!dir.path().join("sbx-1").exists());
        // A feeder still holding the old log writes nothing.
        log.push(Level::Info, "after", &[]);
        assert!(!dir.path().join("sbx-1").exists());
        assert!(book.read("sbx-1", &LogQuery::default()).unwrap().is_empty());
        assert!(book.open("../etc").is_none(), "ids are path components");
    }

    #[test]
    fn retain_removes_the_logs_of_unknown_sandboxes() {
        let dir = tempfile::tempdir().unwrap();
        let book = LogBook::new(dir.path(), DEFAULT_FILE_BYTES);
        book.push("keep", Level::Info, "a", &[]);
        book.push("gone", Level::Info, "b", &[]);
        let removed = book.retain(&|id| id == "keep");
        assert_eq!(removed, ["gone"]);
        assert!(dir.path().join("keep").exists());
        assert!(!dir.path().join("gone").exists());
    }

    #[test]
    fn long_messages_are_cut_at_a_character_boundary() {
        let e = LogEntry::now(Level::Info, "é".repeat(MAX_MESSAGE), &[]);
        assert!(e.message.len() <= MAX_MESSAGE);
        assert!(e.message.chars().all(|c| c == 'é'));
        assert!("loud".parse::<Level>().is_err());
        assert_eq!("warn".parse::<Level>().unwrap(), Level::Warn);
        assert!(Level::Error > Level::Warn && Level::Info > Level::Debug);
    }
}
