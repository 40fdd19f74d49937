//! A sandbox's files: list a directory (`filesystem.Filesystem/ListDir`),
//! download and upload a file (the agent's `/files`), through the gateway
//! as data-plane requests.

use http::header::{self, HeaderValue};
use http::{Method, Request, Response, StatusCode};
use percent_encoding::{NON_ALPHANUMERIC, utf8_percent_encode};

use super::envd::{Agent, CallError, read_all};
use super::{Ctx, Refusal, err, json, query_param};
use crate::body::{GatewayBody, boxed, empty};

/// The largest upload.
const UPLOAD_LIMIT: u64 = 100 * 1024 * 1024;

/// The `path` query parameter, absolute.
fn abs_path<B>(req: &Request<B>) -> Result<String, Refusal> {
    match query_param(req.uri().query(), "path") {
        Some(p) if p.starts_with('/') && !p.contains('\0') => Ok(p),
        Some(_) => Err(Box::new(err(
            StatusCode::BAD_REQUEST,
            "path must be absolute (start with /)",
        ))),
        None => Err(Box::new(err(
            StatusCode::BAD_REQUEST,
            "path is required: ?path=/absolute/path",
        ))),
    }
}

fn call_error(e: CallError, path: &str) -> Response<GatewayBody> {
    match e.status {
        StatusCode::NOT_FOUND => err(
            StatusCode::NOT_FOUND,
            &format!("no such file or directory: {path}"),
        ),
        s if s.is_client_error() => err(s, &e.message),
        _ => err(
            StatusCode::BAD_GATEWAY,
            &format!("the sandbox's agent failed: {}", e.message),
        ),
    }
}

/// Milliseconds since the epoch of an RFC 3339 time.
fn unix_ms(t: &str) -> Option<i64> {
    let t = time::OffsetDateTime::parse(t, &time::format_description::well_known::Rfc3339).ok()?;
    i64::try_from(t.unix_timestamp_nanos() / 1_000_000).ok()
}

/// An agent's `EntryInfo` as the page reads it.
fn entry(e: &serde_json::Value) -> serde_json::Value {
    let kind = if e["isSymlink"] == true || e["type"] == "FILE_TYPE_SYMLINK" {
        "symlink"
    } else if e["type"] == "FILE_TYPE_DIRECTORY" {
        "dir"
    } else {
        "file"
    };
    let size = match &e["size"] {
        serde_json::Value::String(s) => s.parse::<i64>().unwrap_or(0),
        v => v.as_i64().unwrap_or(0),
    };
    serde_json::json!({
        "name": e["name"].as_str().unwrap_or_default(),
        "path": e["path"].as_str().unwrap_or_default(),
        "type": kind,
        "size": size,
        "modifiedUnixMs": e["modifiedTime"].as_str().and_then(unix_ms),
    })
}

/// The absolute `path` a read names and the agent of sandbox `id`.
async fn target<B>(ctx: &Ctx, req: &Request<B>, id: &str) -> Result<(String, Agent), Refusal> {
    let path = abs_path(req)?;
    Ok((path, Agent::find(&ctx.gateway, ctx.remote, id).await?))
}

/// `GET dir?path=`: the directory's entries, directories first, then by name.
pub(crate) async fn dir<B>(ctx: &Ctx, req: &Request<B>, id: &str) -> Response<GatewayBody> {
    let (path, agent) = match target(ctx, req, id).await {
        Ok(t) => t,
        Err(r) => return *r,
    };
    let answer = match agent
        .unary(
            "/filesystem.Filesystem/ListDir",
            &serde_json::json!({"path": path, "depth": 1}),
        )
        .await
    {
        Ok(v) => v,
        Err(e) => return call_error(e, &path),
    };
    let mut entries: Vec<serde_json::Value> = answer["entries"]
        .as_array()
        .map(|a| a.iter().map(entry).collect())
        .unwrap_or_default();
    entries.sort_by(|a, b| {
        let rank = |e: &serde_json::Value| u8::from(e["type"] != "dir");
        rank(a)
            .cmp(&rank(b))
            .then_with(|| a["name"].as_str().cmp(&b["name"].as_str()))
    });
    json(
        StatusCode::OK,
        &serde_json::json!({"path": path, "entries": entries}),
    )
}

fn files_path(path: &str) -> String {
    format!(
        "/files?path={}",
        utf8_percent_encode(path, NON_ALPHANUMERIC)
    )
}

/// `Content-Disposition: attachment` naming the file's base name.
fn disposition(path: &str) -> HeaderValue {
    let base = path
        .rsplit('/')
        .next()
        .filter(|b| !b.is_empty())
        .unwrap_or("download");
    let ascii: String = base
        .chars()
        .map(|c| match c {
            '"' | '\\' => '_',
            c if c.is_ascii_graphic() || c == ' ' => c,
            _ => '_',
        })
        .collect();
    let utf8 = utf8_percent_encode(base, NON_ALPHANUMERIC);
    HeaderValue::from_str(&format!(
        "attachment; filename=\"{ascii}\"; filename*=UTF-8''{utf8}"
    ))
    .unwrap_or_else(|_| HeaderValue::from_static("attachment"))
}

/// `GET file?path=`: the file's bytes, as a download.
pub(crate) async fn download<B>(ctx: &Ctx, req: &Request<B>, id: &str) -> Response<GatewayBody> {
    let (path, agent) = match target(ctx, req, id).await {
        Ok(t) => t,
        Err(r) => return *r,
    };
    let resp = agent
        .send(agent.request(Method::GET, &files_path(&path), None, empty()))
        .await;
    let status = resp.status();
    if !status.is_success() {
        let body = read_all(resp.into_body()).await.unwrap_or_default();
        return call_error(
            CallError {
                status,
                message: message_text(&body),
            },
            &path,
        );
    }
    let (parts, body) = resp.into_parts();
    let mut out = Response::new(body);
    let h = out.headers_mut();
    if let Some(len) = parts.headers.get(header::CONTENT_LENGTH) {
        h.insert(header::CONTENT_LENGTH, len.clone());
    }
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/octet-stream"),
    );
    h.insert(header::CONTENT_DISPOSITION, disposition(&path));
    out
}

fn message_text(body: &[u8]) -> String {
    serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v["message"].as_str().map(str::to_string))
        .unwrap_or_else(|| String::from_utf8_lossy(&body[..body.len().min(300)]).into_owned())
}

/// `POST file?path=` with the raw bytes: written as the sandbox's default
/// user, parent directories made.
pub(crate) async fn upload(
    ctx: &Ctx,
    req: Request<GatewayBody>,
    id: &str,
) -> Response<GatewayBody> {
    let path = match abs_path(&req) {
        Ok(p) => p,
        Err(r) => return *r,
    };
    if path.ends_with('/') {
        return err(
            StatusCode::BAD_REQUEST,
            "path must name a file, not a directory",
        );
    }
    let len = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let Some(len) = len else {
        return err(
            StatusCode::LENGTH_REQUIRED,
            "send the file with a Content-Length",
        );
    };
    if len > UPLOAD_LIMIT {
        return err(
            StatusCode::PAYLOAD_TOO_LARGE,
            "the file is larger than 100 MiB: copy it into the sandbox another way",
        );
    }
    let agent = match Agent::find(&ctx.gateway, ctx.remote, id).await {
        Ok(a) => a,
        Err(r) => return *r,
    };
    let body = boxed(http_body_util::Limited::new(
        req.into_body(),
        UPLOAD_LIMIT as usize,
    ));
    let mut up = agent.request(
        Method::POST,
        &files_path(&path),
        Some("application/octet-stream"),
        body,
    );
    up.headers_mut()
        .insert(header::CONTENT_LENGTH, HeaderValue::from(len));
    let resp = agent.send(up).await;
    let status = resp.status();
    let body = read_all(resp.into_body()).await.unwrap_or_default();
    if !status.is_success() {
        return call_error(
            CallError {
                status,
                message: message_text(&body),
            },
            &path,
        );
    }
    let mut out = Response::new(empty());
    *out.status_mut() = StatusCode::NO_CONTENT;
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn download_names_are_quoted_and_escaped() {
        assert_eq!(
            disposition("/a/b \"c\".txt"),
            "attachment; filename=\"b _c_.txt\"; filename*=UTF-8''b%20%22c%22%2Etxt"
        );
        assert_eq!(
            disposition("/x/é"),
            "attachment; filename=\"_\"; filename*=UTF-8''%C3%A9"
        );
    }

    #[test]
    fn entries_take_the_pages_shape() {
        let e = entry(&serde_json::json!({
            "name": "d", "path": "/d", "type": "FILE_TYPE_DIRECTORY", "size": "4096",
            "modifiedTime": "2026-01-01T00:00:00Z"
        }));
        assert_eq!(e["type"], "dir");
        assert_eq!(e["size"], 4096);
        assert_eq!(e["modifiedUnixMs"], 1_767_225_600_000_i64);
    }
}
