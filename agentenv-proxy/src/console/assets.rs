//! The console's files, embedded at build time by `build.rs`: the page
//! (`index.html`, served at `/console/`) and what it loads from
//! `/console/assets/<name>` (its own scripts and style sheet, and the
//! terminal emulator from the npm packages the lockfile pins).

mod generated {
    include!(concat!(env!("OUT_DIR"), "/console_assets.rs"));
}

/// One embedded file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Asset {
    pub bytes: &'static [u8],
    pub content_type: &'static str,
    /// A strong validator: a quoted hash of `bytes`.
    pub etag: &'static str,
}

/// The file served as `/console/assets/<name>`, if there is one. Names are
/// plain file names: anything with a `/` or starting with `.` is unknown.
pub(crate) fn asset(name: &str) -> Option<Asset> {
    if name.is_empty() || name.starts_with('.') || name.contains('/') || name.contains('\\') {
        return None;
    }
    generated::FILES
        .iter()
        .find(|(n, ..)| *n == name)
        .map(|&(_, bytes, content_type, etag)| Asset {
            bytes,
            content_type,
            etag,
        })
}

/// The page itself (`/console/`).
pub(crate) fn index() -> Asset {
    asset("index.html").expect("build.rs embeds console/src/index.html")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Values of `attr="..."` in `html`.
    fn attr_values<'a>(html: &'a str, attr: &str) -> Vec<&'a str> {
        let needle = format!("{attr}=\"");
        html.match_indices(&needle)
            .filter_map(|(i, _)| {
                let rest = &html[i + needle.len()..];
                rest.find('"').map(|end| &rest[..end])
            })
            .collect()
    }

    /// Relative module specifiers (`from './x.js'`, `import('./x.js')`) in a script.
    fn relative_imports(js: &str) -> Vec<String> {
        let mut out = Vec::new();
        for quote in ['\'', '"'] {
            let needle = format!("{quote}./");
            for (i, _) in js.match_indices(&needle) {
                let rest = &js[i + 3..];
                let Some(end) = rest.find(quote) else {
                    continue;
                };
                let before = js[..i].trim_end();
                if before.ends_with("from")
                    || before.ends_with("import(")
                    || before.ends_with("import")
                {
                    out.push(rest[..end].to_string());
                }
            }
        }
        out
    }

    #[test]
    fn every_file_the_page_references_is_served() {
        let html = std::str::from_utf8(index().bytes).unwrap();
        let mut refs: Vec<String> = attr_values(html, "src")
            .into_iter()
            .chain(attr_values(html, "href"))
            .filter(|v| !v.starts_with('#'))
            .map(|v| {
                v.strip_prefix("assets/")
                    .unwrap_or_else(|| panic!("index.html references {v:?} outside assets/"))
                    .to_string()
            })
            .collect();
        assert!(
            refs.iter().any(|r| r == "app.js"),
            "index.html loads app.js"
        );
        assert!(
            refs.iter().any(|r| r == "xterm.js"),
            "index.html loads xterm.js"
        );
        // Follow the module graph from every script the page loads.
        let mut seen = std::collections::BTreeSet::new();
        while let Some(name) = refs.pop() {
            if !seen.insert(name.clone()) {
                continue;
            }
            let a = asset(&name).unwrap_or_else(|| panic!("{name} is referenced but not served"));
            assert!(!a.bytes.is_empty(), "{name} is empty");
            if name.ends_with(".js") && !matches!(name.as_str(), "xterm.js" | "addon-fit.js") {
                refs.extend(relative_imports(std::str::from_utf8(a.bytes).unwrap()));
            }
        }
        for name in ["app.js", "app.css", "xterm.js", "xterm.css", "addon-fit.js"] {
            assert!(seen.contains(name), "the page does not load {name}");
        }
    }

    #[test]
    fn assets_have_content_types_and_distinct_etags() {
        let css = asset("app.css").unwrap();
        assert_eq!(css.content_type, "text/css; charset=utf-8");
        let js = asset("xterm.js").unwrap();
        assert_eq!(js.content_type, "text/javascript; charset=utf-8");
        assert_eq!(index().content_type, "text/html; charset=utf-8");
        assert!(js.etag.starts_with('"') && js.etag.ends_with('"') && js.etag.len() == 34);
        assert_ne!(js.etag, css.etag);
        let all: std::collections::BTreeSet<_> =
            generated::FILES.iter().map(|(.., etag)| *etag).collect();
        assert_eq!(
            all.len(),
            generated::FILES.len(),
            "one ETag per distinct file"
        );
    }

    #[test]
    fn unknown_or_path_like_names_are_not_served() {
        for name in [
            "",
            "nope.js",
            "../Cargo.toml",
            "a/app.js",
            ".npmrc",
            "xterm.js.map",
        ] {
            assert!(asset(name).is_none(), "{name:?} must not be served");
        }
    }

    #[test]
    fn source_map_comments_are_stripped_from_npm_files() {
        for name in ["xterm.js", "addon-fit.js"] {
            let text = std::str::from_utf8(asset(name).unwrap().bytes).unwrap();
            assert!(
                !text.contains("//# sourceMappingURL="),
                "{name} points at a map that is not served"
            );
        }
    }
}
