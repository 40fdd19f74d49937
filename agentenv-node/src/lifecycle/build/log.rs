//! A build's log lines, kept in memory and written to the store in chunks.

use super::*;

/// Collects a build's log lines and writes them to the catalog in chunks.
pub(in crate::lifecycle) struct BuildLog {
    pub(super) catalog: Arc<TemplateCatalog>,
    pub(super) build_id: String,
    pub(super) pending: Mutex<Vec<LogLine>>,
    pub(super) seq: tokio::sync::Mutex<u64>,
    pub(super) total: Mutex<usize>,
}

impl BuildLog {
    pub(in crate::lifecycle) fn line(
        &self,
        level: &str,
        step: Option<&str>,
        message: impl Into<String>,
    ) {
        let mut total = self.total.lock();
        *total += 1;
        if *total > crate::template::catalog::MAX_LOG_LINES {
            return;
        }
        let mut message: String = message.into();
        if message.len() > MAX_LINE {
            let mut cut = MAX_LINE;
            while !message.is_char_boundary(cut) {
                cut -= 1;
            }
            message.truncate(cut);
            message.push_str(" [line cut]");
        }
        if *total == crate::template::catalog::MAX_LOG_LINES {
            message = "[more log lines were dropped]".into();
        }
        self.pending.lock().push(LogLine {
            timestamp: time_rfc3339(SystemTime::now()),
            level: level.to_string(),
            message,
            step: step.map(str::to_string),
        });
    }

    pub(in crate::lifecycle) fn info(&self, step: Option<&str>, message: impl Into<String>) {
        self.line("info", step, message)
    }

    pub(in crate::lifecycle) async fn flush(&self) {
        let mut seq = self.seq.lock().await;
        let lines = std::mem::take(&mut *self.pending.lock());
        if lines.is_empty() {
            return;
        }
        match self.catalog.append_logs(&self.build_id, *seq, &lines).await {
            Ok(()) => *seq += 1,
            Err(e) => {
                tracing::warn!(build = %self.build_id, error = %e, "writing build logs");
                // Keep them for the next flush.
                let mut p = self.pending.lock();
                let later = std::mem::take(&mut *p);
                *p = lines;
                p.extend(later);
            }
        }
    }
}
