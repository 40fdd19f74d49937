//! The console's page and assets, embedded in the binary.

/// An embedded file.
pub(crate) struct Asset {
    pub bytes: &'static [u8],
    pub content_type: &'static str,
    pub etag: &'static str,
}

const INDEX: &str = "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>AgentENV console</title></head>\n<body><p>The AgentENV console.</p></body></html>\n";

/// The page (`/console/`).
pub(crate) fn index() -> Asset {
    Asset {
        bytes: INDEX.as_bytes(),
        content_type: "text/html; charset=utf-8",
        etag: "\"index-0\"",
    }
}

/// The asset `name` under `/console/assets/`.
pub(crate) fn asset(name: &str) -> Option<Asset> {
    let _ = name;
    None
}
