//! Tables (on a terminal) and JSON (when piped) for the list commands, and spinners and
//! progress bars that only appear on a terminal.

use std::io::{IsTerminal, Write};

use indicatif::{ProgressBar, ProgressStyle};

use super::model::{Listed, ListedSandbox, SnapshotInfo, TemplateInfo};

/// How a list is printed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Table,
    Json,
}

/// Renders rows as a box-drawn table; missing cells are `-`.
pub fn table(headers: &[&str], rows: &[Vec<String>]) -> String {
    let n = headers.len();
    let mut w: Vec<usize> = headers.iter().map(|h| h.chars().count()).collect();
    for r in rows {
        for (i, c) in r.iter().enumerate().take(n) {
            w[i] = w[i].max(c.chars().count());
        }
    }
    let line = |l: &str, m: &str, r: &str| {
        let parts: Vec<String> = w.iter().map(|x| "─".repeat(x + 2)).collect();
        format!("{l}{}{r}\n", parts.join(m))
    };
    let row = |cells: &[String]| {
        let parts: Vec<String> = (0..n)
            .map(|i| {
                let c = cells.get(i).map(String::as_str).unwrap_or("-");
                format!(" {c}{} ", " ".repeat(w[i] - c.chars().count()))
            })
            .collect();
        format!("│{}│\n", parts.join("│"))
    };
    let mut out = line("┌", "┬", "┐");
    out.push_str(&row(&headers
        .iter()
        .map(|h| h.to_string())
        .collect::<Vec<_>>()));
    out.push_str(&line("├", "┼", "┤"));
    for r in rows {
        out.push_str(&row(r));
    }
    out.push_str(&line("└", "┴", "┘"));
    out
}

fn opt<T: ToString>(v: &Option<T>) -> String {
    v.as_ref()
        .map(|x| x.to_string())
        .unwrap_or_else(|| "-".into())
}

/// Pretty JSON on stdout, object keys sorted.
pub(crate) fn write_json(v: &impl serde::Serialize) -> std::io::Result<()> {
    let v = serde_json::to_value(v).map_err(std::io::Error::other)?;
    let mut s = serde_json::to_string_pretty(&v).map_err(std::io::Error::other)?;
    s.push('\n');
    write_stdout(&s)
}

pub(crate) fn write_stdout(s: &str) -> std::io::Result<()> {
    let mut o = std::io::stdout().lock();
    match o.write_all(s.as_bytes()).and_then(|_| o.flush()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        r => r,
    }
}

/// `aenv ls`.
pub fn sandboxes(items: &[ListedSandbox], f: Format) -> std::io::Result<()> {
    if f == Format::Json {
        return write_json(&items);
    }
    let rows: Vec<Vec<String>> = items
        .iter()
        .map(|s| {
            vec![
                s.sandbox_id.clone(),
                opt(&s.alias.clone().or(s.template_id.clone())),
                opt(&s.state),
                opt(&s.cpu_count),
                opt(&s.memory_mb),
                opt(&s.disk_size_mb),
                opt(&s.started_at),
            ]
        })
        .collect();
    write_stdout(&table(
        &[
            "SANDBOX ID",
            "TEMPLATE",
            "STATE",
            "CPU",
            "MEM (MiB)",
            "DISK (MiB)",
            "STARTED",
        ],
        &rows,
    ))
}

/// The items as the server sent them.
fn raw<T>(items: &[Listed<T>]) -> Vec<&serde_json::Value> {
    items.iter().map(|l| &l.raw).collect()
}

/// `aenv template ls`.
pub fn templates(items: &[Listed<TemplateInfo>], f: Format) -> std::io::Result<()> {
    if f == Format::Json {
        return write_json(&raw(items));
    }
    let rows: Vec<Vec<String>> = items
        .iter()
        .map(|Listed { item: t, .. }| {
            let names = if t.names.is_empty() {
                &t.aliases
            } else {
                &t.names
            };
            vec![
                if names.is_empty() {
                    "-".into()
                } else {
                    names.join(",")
                },
                opt(&t.template_id),
                opt(&t.build_status),
                opt(&t.cpu_count),
                opt(&t.memory_mb),
                opt(&t.created_at),
            ]
        })
        .collect();
    write_stdout(&table(
        &[
            "NAME",
            "TEMPLATE ID",
            "STATUS",
            "CPU",
            "MEM (MiB)",
            "CREATED",
        ],
        &rows,
    ))
}

/// `aenv snapshot ls`.
pub fn snapshots(items: &[Listed<SnapshotInfo>], f: Format) -> std::io::Result<()> {
    if f == Format::Json {
        return write_json(&raw(items));
    }
    let rows: Vec<Vec<String>> = items
        .iter()
        .map(|Listed { item: t, .. }| {
            vec![opt(&t.snapshot_id), t.names.join(","), opt(&t.image_ref)]
        })
        .collect();
    write_stdout(&table(&["SNAPSHOT ID", "NAMES", "IMAGE REF"], &rows))
}

/// A spinner on stderr, only when stderr is a terminal.
pub fn spinner(msg: &str) -> Option<ProgressBar> {
    if !std::io::stderr().is_terminal() {
        return None;
    }
    let b = ProgressBar::new_spinner();
    b.set_message(msg.to_string());
    b.enable_steady_tick(std::time::Duration::from_millis(100));
    Some(b)
}

/// A byte progress bar on stderr (hidden unless stderr is a terminal and `total` > 0).
pub fn transfer_bar(prefix: &str, total: u64) -> ProgressBar {
    if total == 0 || !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let b = ProgressBar::new(total);
    if let Ok(st) = ProgressStyle::with_template(
        "{prefix} [{bar:36}] {bytes}/{total_bytes} {bytes_per_sec} ETA {eta}",
    ) {
        b.set_style(st.progress_chars("=> "));
    }
    b.set_prefix(prefix.to_string());
    b
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_pad_cells_and_show_missing_values_as_dash() {
        let t = table(&["A", "LONGER"], &[vec!["xyz".into()]]);
        assert_eq!(
            t,
            "┌─────┬────────┐\n│ A   │ LONGER │\n├─────┼────────┤\n│ xyz │ -      │\n└─────┴────────┘\n"
        );
    }
}
