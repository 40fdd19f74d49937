//! The Debian mirror the host's apt uses, read from `/etc/apt/sources.list` (one-line
//! format) and `/etc/apt/sources.list.d/*.{list,sources}` (deb822 format).

use std::path::Path;

/// Why no mirror was found.
#[derive(Debug, thiserror::Error)]
pub enum MirrorError {
    #[error("no `deb` source for suite {suite} or a plain Debian suite in {dir}")]
    NotFound { dir: String, suite: String },
}

/// One `deb` source: a URI and its suites.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Source {
    pub uri: String,
    pub suites: Vec<String>,
}

/// `deb [options] uri suite components...` lines; `deb-src` and comments are skipped.
pub fn parse_one_line_sources(text: &str) -> Vec<Source> {
    let mut out = Vec::new();
    for line in text.lines() {
        let line = line.split('#').next().unwrap_or("").trim();
        let mut words = line.split_whitespace().peekable();
        if words.next() != Some("deb") {
            continue;
        }
        // Options: `[arch=amd64 signed-by=...]`, possibly spread over several words.
        if words.peek().is_some_and(|w| w.starts_with('[')) {
            for w in words.by_ref() {
                if w.ends_with(']') {
                    break;
                }
            }
        }
        if let (Some(uri), Some(suite)) = (words.next(), words.next()) {
            out.push(Source {
                uri: uri.to_string(),
                suites: vec![suite.to_string()],
            });
        }
    }
    out
}

/// deb822 stanzas (`Types:`, `URIs:`, `Suites:`; `Enabled: no` skipped).
pub fn parse_deb822_sources(text: &str) -> Vec<Source> {
    let mut out = Vec::new();
    for stanza in text.split("\n\n") {
        let mut types = Vec::new();
        let mut uris = Vec::new();
        let mut suites = Vec::new();
        let mut enabled = true;
        for line in stanza.lines() {
            if line.starts_with('#') || line.starts_with(' ') || line.starts_with('\t') {
                continue;
            }
            let Some((key, value)) = line.split_once(':') else {
                continue;
            };
            let words = || {
                value
                    .split_whitespace()
                    .map(str::to_string)
                    .collect::<Vec<_>>()
            };
            match key.trim().to_ascii_lowercase().as_str() {
                "types" => types = words(),
                "uris" => uris = words(),
                "suites" => suites = words(),
                "enabled" => enabled = !value.trim().eq_ignore_ascii_case("no"),
                _ => {}
            }
        }
        if enabled && types.iter().any(|t| t == "deb") {
            for uri in uris {
                out.push(Source {
                    uri,
                    suites: suites.clone(),
                });
            }
        }
    }
    out
}

/// Picks a mirror: the first source carrying `suite` itself, else the first carrying a
/// plain suite (no `-security`/`-updates` style suffix), from http(s) URIs only.
pub fn pick_mirror(sources: &[Source], suite: &str) -> Option<String> {
    let usable = |s: &&Source| s.uri.starts_with("http://") || s.uri.starts_with("https://");
    sources
        .iter()
        .filter(usable)
        .find(|s| s.suites.iter().any(|x| x == suite))
        .or_else(|| {
            sources.iter().filter(usable).find(|s| {
                s.suites
                    .iter()
                    .any(|x| !x.contains('-') && !x.contains('/'))
            })
        })
        .map(|s| s.uri.trim_end_matches('/').to_string())
}

/// The mirror of the host's apt configuration under `apt_dir` (normally `/etc/apt`).
pub fn find_host_mirror(apt_dir: &Path, suite: &str) -> Result<String, MirrorError> {
    let mut sources = Vec::new();
    if let Ok(text) = std::fs::read_to_string(apt_dir.join("sources.list")) {
        sources.extend(parse_one_line_sources(&text));
    }
    let mut files: Vec<_> = std::fs::read_dir(apt_dir.join("sources.list.d"))
        .map(|d| d.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    files.sort();
    for f in files {
        let Ok(text) = std::fs::read_to_string(&f) else {
            continue;
        };
        match f.extension().and_then(|e| e.to_str()) {
            Some("sources") => sources.extend(parse_deb822_sources(&text)),
            Some("list") => sources.extend(parse_one_line_sources(&text)),
            _ => {}
        }
    }
    pick_mirror(&sources, suite).ok_or_else(|| MirrorError::NotFound {
        dir: apt_dir.display().to_string(),
        suite: suite.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_line_sources_skip_comments_sources_and_options() {
        let text = "# deb http://old.example/debian bookworm main\n\
                    deb-src http://src.example/debian bookworm main\n\
                    deb [arch=amd64 signed-by=/k.gpg] http://a.example/debian/ bookworm main\n\
                    deb http://a.example/debian-security bookworm-security main\n";
        let s = parse_one_line_sources(text);
        assert_eq!(s.len(), 2);
        assert_eq!(s[0].uri, "http://a.example/debian/");
        assert_eq!(s[0].suites, vec!["bookworm"]);
        assert_eq!(
            pick_mirror(&s, "bookworm").unwrap(),
            "http://a.example/debian"
        );
    }

    #[test]
    fn deb822_sources_pick_the_suite_not_security() {
        let text = "Types: deb\nURIs: http://sec.example/debian-security\nSuites: bookworm-security\nComponents: main\n\n\
                    Types: deb deb-src\n# a comment\nURIs: http://m.example/debian\nSuites: bookworm bookworm-updates\nComponents: main\n\n\
                    Enabled: no\nTypes: deb\nURIs: http://off.example/debian\nSuites: bookworm\n";
        let s = parse_deb822_sources(text);
        assert_eq!(s.len(), 2);
        assert_eq!(
            pick_mirror(&s, "bookworm").unwrap(),
            "http://m.example/debian"
        );
    }

    #[test]
    fn another_release_still_gives_its_mirror() {
        let s = parse_deb822_sources(
            "Types: deb\nURIs: https://m.example/debian\nSuites: trixie trixie-updates\n",
        );
        assert_eq!(
            pick_mirror(&s, "bookworm").unwrap(),
            "https://m.example/debian"
        );
    }

    #[test]
    fn host_mirror_reads_both_formats_and_reports_absence() {
        let dir = tempfile::tempdir().unwrap();
        assert!(find_host_mirror(dir.path(), "bookworm").is_err());
        std::fs::create_dir(dir.path().join("sources.list.d")).unwrap();
        std::fs::write(
            dir.path().join("sources.list.d/debian.sources"),
            "Types: deb\nURIs: http://m.example/debian\nSuites: bookworm\n",
        )
        .unwrap();
        std::fs::write(
            dir.path().join("sources.list.d/other.list.disabled"),
            "deb http://x.example/debian bookworm main\n",
        )
        .unwrap();
        assert_eq!(
            find_host_mirror(dir.path(), "bookworm").unwrap(),
            "http://m.example/debian"
        );
    }
}
