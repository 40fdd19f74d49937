//! `GET /files` (download) and `POST /files` (upload: multipart field
//! `file`, or the raw body; optionally gzip-encoded), streamed both ways.
//! A raw upload that is the first request of its connection is served by
//! the agent's zero-copy path (`fastpath.rs`) with the same pieces
//! (`UploadHead`, `RawUpload`, `upload_response`).

use std::io;
use std::path::{Path, PathBuf};

use bytes::Bytes;
use futures::{Stream, StreamExt, TryStreamExt};
use http::{HeaderMap, HeaderValue, Request, Response, StatusCode, header};
use http_body::Frame;
use http_body_util::{BodyExt, BodyStream, StreamBody};
use hyper::body::Incoming;
use tokio::io::AsyncRead;
use tokio_util::io::{ReaderStream, StreamReader};

use crate::connect::RespBody;
use crate::fileio::{WriteError, read_stream, unique_u64, write_stream};
use crate::filesystem::{chown_to, make_dirs};
use crate::paths::resolve;
use crate::query::query_param;
use crate::responses::{json, json_error};
use crate::state::AgentState;
use crate::users::User;

/// Read size for downloads.
const DOWNLOAD_CHUNK: usize = 256 * 1024;

/// Errors of the `/files` handlers.
#[derive(Debug, thiserror::Error)]
pub enum FilesError {
    #[error("query parameter `path` is required (or a multipart filename)")]
    MissingPath,
    #[error("{0}")]
    BadUser(String),
    #[error("{0} is a directory; download files one by one")]
    IsDirectory(String),
    #[error("{path}: {source}")]
    Io { path: String, source: io::Error },
    #[error("reading the upload: {0}")]
    Body(String),
    #[error("multipart upload: {0}; send a `file` part per file")]
    Multipart(String),
}

impl FilesError {
    fn status(&self) -> StatusCode {
        match self {
            FilesError::MissingPath | FilesError::IsDirectory(_) | FilesError::Multipart(_) => {
                StatusCode::BAD_REQUEST
            }
            FilesError::BadUser(_) => StatusCode::UNAUTHORIZED,
            FilesError::Body(_) => StatusCode::BAD_REQUEST,
            FilesError::Io { source, .. } => match source.kind() {
                io::ErrorKind::NotFound => StatusCode::NOT_FOUND,
                io::ErrorKind::PermissionDenied => StatusCode::FORBIDDEN,
                io::ErrorKind::StorageFull | io::ErrorKind::QuotaExceeded => {
                    StatusCode::INSUFFICIENT_STORAGE
                }
                io::ErrorKind::IsADirectory | io::ErrorKind::NotADirectory => {
                    StatusCode::BAD_REQUEST
                }
                io::ErrorKind::InvalidData | io::ErrorKind::UnexpectedEof => {
                    StatusCode::BAD_REQUEST
                }
                _ => StatusCode::INTERNAL_SERVER_ERROR,
            },
        }
    }

    fn into_response(self) -> Response<RespBody> {
        json_error(self.status(), self.to_string())
    }
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> FilesError + '_ {
    move |source| FilesError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// A fresh hidden name beside `path` for the file that replaces it once
/// complete: `.<name>.<what>-<16 hex digits>`.
fn temp_sibling(path: &Path, what: &str) -> PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    path.with_file_name(format!(".{name}.{what}-{:016x}", unique_u64()))
}

/// `{"path", "name", "type": "file"}`: how the answers to uploads and
/// compose describe a file written.
fn written_file(path: &Path) -> serde_json::Value {
    serde_json::json!({
        "path": path.display().to_string(),
        "name": path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default(),
        "type": "file",
    })
}

fn user_for(
    state: &AgentState,
    query: Option<&str>,
    headers: &HeaderMap,
) -> Result<User, FilesError> {
    match query_param(query, "username").filter(|u| !u.is_empty()) {
        Some(u) => state.user(Some(&u)),
        None => state.caller(headers),
    }
    .map_err(|e| FilesError::BadUser(e.message))
}

fn accepts_gzip(headers: &HeaderMap) -> bool {
    headers
        .get_all(header::ACCEPT_ENCODING)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|e| {
            let mut parts = e.trim().split(';');
            let name = parts.next().unwrap_or("").trim();
            let q0 = parts.any(|p| {
                p.trim()
                    .strip_prefix("q=")
                    .and_then(|q| q.trim().parse::<f32>().ok())
                    == Some(0.0)
            });
            name.eq_ignore_ascii_case("gzip") && !q0
        })
}

fn reader_body<R: AsyncRead + Send + 'static>(r: R) -> RespBody {
    StreamBody::new(ReaderStream::with_capacity(r, DOWNLOAD_CHUNK).map_ok(Frame::data))
        .boxed_unsync()
}

/// `GET /files?path=&username=`.
pub async fn download(state: &AgentState, req: Request<Incoming>) -> Response<RespBody> {
    match download_inner(state, req).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn download_inner(
    state: &AgentState,
    req: Request<Incoming>,
) -> Result<Response<RespBody>, FilesError> {
    let query = req.uri().query();
    let user = user_for(state, query, req.headers())?;
    let raw = query_param(query, "path")
        .filter(|p| !p.is_empty())
        .ok_or(FilesError::MissingPath)?;
    let path = resolve(&raw, &user.home);
    let md = tokio::fs::metadata(&path).await.map_err(io_err(&path))?;
    if md.is_dir() {
        return Err(FilesError::IsDirectory(path.display().to_string()));
    }
    let file = std::fs::File::open(&path).map_err(io_err(&path))?;
    let gzip = accepts_gzip(req.headers());
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().replace('"', "_"))
        .unwrap_or_default();
    let mut resp = if gzip {
        let enc = async_compression::tokio::bufread::GzipEncoder::new(StreamReader::new(
            read_stream(file),
        ));
        let mut r = Response::new(reader_body(enc));
        r.headers_mut()
            .insert(header::CONTENT_ENCODING, HeaderValue::from_static("gzip"));
        r
    } else {
        let body = StreamBody::new(read_stream(file).map_ok(Frame::data));
        let mut r = Response::new(body.boxed_unsync());
        // Pseudo files (/proc, /sys) report size 0 but have content: those
        // go chunked.
        if md.is_file() && md.len() > 0 {
            r.headers_mut()
                .insert(header::CONTENT_LENGTH, HeaderValue::from(md.len()));
        }
        r
    };
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/octet-stream"),
    );
    h.insert(header::VARY, HeaderValue::from_static("Accept-Encoding"));
    if let Ok(v) = HeaderValue::from_str(&format!("attachment; filename=\"{name}\"")) {
        h.insert(header::CONTENT_DISPOSITION, v);
    }
    Ok(resp)
}

/// The `X-Metadata-<key>: <value>` headers of an upload.
fn upload_metadata(headers: &HeaderMap) -> Vec<(String, String)> {
    headers
        .iter()
        .filter_map(|(k, v)| {
            let key = k.as_str().strip_prefix("x-metadata-")?;
            Some((key.to_string(), v.to_str().ok()?.to_string()))
        })
        .collect()
}

fn set_metadata(path: &Path, meta: &[(String, String)]) {
    use std::os::unix::ffi::OsStrExt;
    let Ok(cpath) = std::ffi::CString::new(path.as_os_str().as_bytes()) else {
        return;
    };
    for (k, v) in meta {
        let Ok(name) = std::ffi::CString::new(format!("user.e2b.{k}")) else {
            continue;
        };
        // SAFETY: both strings are NUL-terminated and `v` is valid for
        // `v.len()` bytes.
        let rc = unsafe {
            libc::lsetxattr(cpath.as_ptr(), name.as_ptr(), v.as_ptr().cast(), v.len(), 0)
        };
        if rc != 0 {
            tracing::debug!(path = %path.display(), error = %io::Error::last_os_error(), "setxattr");
        }
    }
}

/// A file being uploaded. The data goes to a temporary file beside `path`
/// that replaces `path` only on [`TempUpload::commit`], so a cut-off upload
/// never clobbers an existing file; dropped uncommitted, the temporary file
/// is removed.
struct TempUpload {
    path: PathBuf,
    tmp: PathBuf,
    existing: Option<std::fs::Metadata>,
    committed: bool,
}

impl TempUpload {
    /// Creates the parents of `path` (owned by `user`) and the temporary
    /// file. A known `size` is reserved up front: the file system allocates
    /// it in one go instead of write by write, and a disk too small for it
    /// fails before any byte is sent.
    fn create(
        path: &Path,
        user: &User,
        size: Option<u64>,
    ) -> Result<(TempUpload, std::fs::File), FilesError> {
        if let Some(parent) = path.parent() {
            make_dirs(parent, user).map_err(io_err(parent))?;
        }
        let existing = std::fs::metadata(path).ok();
        if existing.as_ref().is_some_and(|m| m.is_dir()) {
            return Err(FilesError::IsDirectory(path.display().to_string()));
        }
        let tmp = temp_sibling(path, "upload");
        let file = std::fs::File::create(&tmp).map_err(io_err(&tmp))?;
        let upload = TempUpload {
            path: path.to_path_buf(),
            tmp,
            existing,
            committed: false,
        };
        if let Some(len) = size.filter(|&n| n > 0)
            && let Ok(len) = libc::off_t::try_from(len)
        {
            use std::os::fd::AsRawFd;
            // SAFETY: `file` is open for writing for the duration of the call.
            let rc = unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, len) };
            if rc != 0 {
                let e = io::Error::last_os_error();
                // File systems without fallocate just grow as written.
                if e.raw_os_error() != Some(libc::EOPNOTSUPP) {
                    return Err(upload.write_error(e));
                }
            }
        }
        Ok((upload, file))
    }

    /// The error for a failed write of the temporary file.
    fn write_error(&self, e: io::Error) -> FilesError {
        io_err(&self.tmp)(e)
    }

    /// Writes `body` into `file` (the temporary file) on a blocking thread.
    async fn write<S, E>(&self, file: std::fs::File, body: S) -> Result<(), FilesError>
    where
        S: Stream<Item = Result<Bytes, E>> + Unpin,
        E: std::fmt::Display + std::fmt::Debug,
    {
        match write_stream(file, body).await {
            Ok(_) => Ok(()),
            Err(WriteError::Io(e)) => Err(self.write_error(e)),
            Err(WriteError::Source(e)) => Err(FilesError::Body(e.to_string())),
        }
    }

    /// Puts the complete file in place, with an existing file's permissions,
    /// owned by `user`.
    fn commit(mut self, user: &User) -> Result<(), FilesError> {
        if let Some(md) = &self.existing {
            use std::os::unix::fs::PermissionsExt;
            let _ = std::fs::set_permissions(
                &self.tmp,
                std::fs::Permissions::from_mode(md.permissions().mode()),
            );
        }
        std::fs::rename(&self.tmp, &self.path).map_err(io_err(&self.path))?;
        self.committed = true;
        chown_to(&self.path, user);
        Ok(())
    }
}

impl Drop for TempUpload {
    fn drop(&mut self) {
        if !self.committed {
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}

fn incoming_stream(body: Incoming) -> impl Stream<Item = Result<Bytes, hyper::Error>> + Unpin {
    BodyStream::new(body)
        .try_filter_map(|f| async move { Ok(f.into_data().ok()) })
        .boxed()
}

/// The multipart boundary of an upload, if it is multipart.
pub(crate) fn multipart_boundary(headers: &HeaderMap) -> Option<String> {
    let ct = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    multer::parse_boundary(ct).ok()
}

/// Whether an upload's body is gzip-encoded.
pub(crate) fn is_gzip(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_ENCODING)
        .and_then(|v| v.to_str().ok())
        .map(|v| v.trim().eq_ignore_ascii_case("gzip"))
        .unwrap_or(false)
}

/// What an upload takes from its request head, before any body byte.
pub(crate) struct UploadHead {
    user: User,
    target: Option<String>,
    meta: Vec<(String, String)>,
}

impl UploadHead {
    /// The user (`username` query parameter or Basic auth), the `path`
    /// parameter and the `X-Metadata-*` headers.
    pub(crate) fn parse(
        state: &AgentState,
        query: Option<&str>,
        headers: &HeaderMap,
    ) -> Result<UploadHead, FilesError> {
        Ok(UploadHead {
            user: user_for(state, query, headers)?,
            target: query_param(query, "path").filter(|p| !p.is_empty()),
            meta: upload_metadata(headers),
        })
    }
}

/// An upload of a raw (not multipart) body under way: the body goes into
/// the file [`RawUpload::begin`] returns, then [`RawUpload::finish`] puts
/// it in place. Dropped before that, it leaves nothing behind.
pub(crate) struct RawUpload {
    head: UploadHead,
    temp: TempUpload,
}

impl RawUpload {
    /// Resolves the target path and creates its temporary file, `size`
    /// bytes reserved when known.
    pub(crate) fn begin(
        head: UploadHead,
        size: Option<u64>,
    ) -> Result<(RawUpload, std::fs::File), FilesError> {
        let raw = head.target.as_deref().ok_or(FilesError::MissingPath)?;
        let path = resolve(raw, &head.user.home);
        let (temp, file) = TempUpload::create(&path, &head.user, size)?;
        Ok((RawUpload { head, temp }, file))
    }

    /// The error for a failed write of the file.
    pub(crate) fn write_error(&self, e: io::Error) -> FilesError {
        self.temp.write_error(e)
    }

    /// Puts the complete file in place, owner and metadata set.
    pub(crate) fn finish(self) -> Result<Vec<PathBuf>, FilesError> {
        let path = self.temp.path.clone();
        self.temp.commit(&self.head.user)?;
        set_metadata(&path, &self.head.meta);
        Ok(vec![path])
    }
}

/// The answer to an upload: a JSON list of the files written, or the error.
pub(crate) fn upload_response(result: Result<Vec<PathBuf>, FilesError>) -> Response<RespBody> {
    match result {
        Ok(written) => {
            let list: Vec<_> = written.iter().map(|p| written_file(p)).collect();
            json(&list)
        }
        Err(e) => e.into_response(),
    }
}

/// `POST /files?path=&username=`.
pub async fn upload(state: &AgentState, req: Request<Incoming>) -> Response<RespBody> {
    upload_response(upload_inner(state, req).await)
}

async fn upload_inner(
    state: &AgentState,
    req: Request<Incoming>,
) -> Result<Vec<PathBuf>, FilesError> {
    let (parts, body) = req.into_parts();
    let head = UploadHead::parse(state, parts.uri.query(), &parts.headers)?;
    let body = incoming_stream(body);

    if let Some(boundary) = multipart_boundary(&parts.headers) {
        let mut mp = multer::Multipart::new(body, boundary);
        let mut written = Vec::new();
        loop {
            let field = match mp.next_field().await {
                Ok(Some(f)) => f,
                Ok(None) => break,
                Err(e) => return Err(FilesError::Multipart(e.to_string())),
            };
            if field.name() != Some("file") {
                continue;
            }
            let raw = match (&head.target, field.file_name()) {
                (Some(t), _) => t.clone(),
                (None, Some(f)) if !f.is_empty() => f.to_string(),
                _ => return Err(FilesError::MissingPath),
            };
            let path = resolve(&raw, &head.user.home);
            let (temp, file) = TempUpload::create(&path, &head.user, None)?;
            temp.write(file, field).await?;
            temp.commit(&head.user)?;
            set_metadata(&path, &head.meta);
            written.push(path);
        }
        if written.is_empty() {
            return Err(FilesError::Multipart("no part named `file`".into()));
        }
        return Ok(written);
    }

    if is_gzip(&parts.headers) {
        let (upload, file) = RawUpload::begin(head, None)?;
        let reader = StreamReader::new(body.map_err(io::Error::other));
        let dec = async_compression::tokio::bufread::GzipDecoder::new(reader);
        let stream = ReaderStream::with_capacity(dec, DOWNLOAD_CHUNK);
        upload.temp.write(file, stream).await?;
        upload.finish()
    } else {
        let declared = parts
            .headers
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        let (upload, file) = RawUpload::begin(head, declared)?;
        upload.temp.write(file, body).await?;
        upload.finish()
    }
}

#[derive(Debug, serde::Deserialize)]
struct ComposeBody {
    source_paths: Vec<String>,
    destination: String,
    #[serde(default)]
    username: Option<String>,
}

/// `POST /files/compose`: concatenates `source_paths` (in order, with
/// in-kernel copies) into `destination`, then deletes the sources.
pub async fn compose(state: &AgentState, req: Request<Incoming>) -> Response<RespBody> {
    match compose_inner(state, req).await {
        Ok(path) => json(&written_file(&path)),
        Err(e) => e.into_response(),
    }
}

async fn compose_inner(state: &AgentState, req: Request<Incoming>) -> Result<PathBuf, FilesError> {
    let query = req.uri().query().map(str::to_string);
    let headers = req.headers().clone();
    let body = http_body_util::Limited::new(req.into_body(), 4 * 1024 * 1024)
        .collect()
        .await
        .map_err(|e| FilesError::Body(e.to_string()))?
        .to_bytes();
    let parsed: ComposeBody = serde_json::from_slice(&body).map_err(|e| {
        FilesError::Body(format!(
            "body must be JSON {{\"source_paths\":[...],\"destination\":\"...\"}}: {e}"
        ))
    })?;
    let user = match parsed.username.as_deref().filter(|u| !u.is_empty()) {
        Some(u) => state
            .user(Some(u))
            .map_err(|e| FilesError::BadUser(e.message))?,
        None => user_for(state, query.as_deref(), &headers)?,
    };
    if parsed.source_paths.is_empty() {
        return Err(FilesError::Body("source_paths must not be empty".into()));
    }
    let sources: Vec<PathBuf> = parsed
        .source_paths
        .iter()
        .map(|p| resolve(p, &user.home))
        .collect();
    let dest = resolve(&parsed.destination, &user.home);
    tokio::task::spawn_blocking(move || -> Result<PathBuf, FilesError> {
        for s in &sources {
            let md = std::fs::metadata(s).map_err(io_err(s))?;
            if md.is_dir() {
                return Err(FilesError::IsDirectory(s.display().to_string()));
            }
        }
        if let Some(parent) = dest.parent() {
            make_dirs(parent, &user).map_err(io_err(parent))?;
        }
        let tmp = temp_sibling(&dest, "compose");
        let result = (|| {
            let mut out = std::fs::File::create(&tmp).map_err(io_err(&tmp))?;
            for s in &sources {
                let mut f = std::fs::File::open(s).map_err(io_err(s))?;
                // std uses copy_file_range here: no copy through user space.
                std::io::copy(&mut f, &mut out).map_err(io_err(&tmp))?;
            }
            std::fs::rename(&tmp, &dest).map_err(io_err(&dest))
        })();
        if let Err(e) = result {
            let _ = std::fs::remove_file(&tmp);
            return Err(e);
        }
        chown_to(&dest, &user);
        for s in &sources {
            if s != &dest {
                let _ = std::fs::remove_file(s);
            }
        }
        Ok(dest)
    })
    .await
    .map_err(|e| FilesError::Body(format!("compose task failed: {e}")))?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gzip_acceptance() {
        let mut h = HeaderMap::new();
        assert!(!accepts_gzip(&h));
        h.insert(
            header::ACCEPT_ENCODING,
            HeaderValue::from_static("br, gzip"),
        );
        assert!(accepts_gzip(&h));
        h.insert(
            header::ACCEPT_ENCODING,
            HeaderValue::from_static("gzip;q=0"),
        );
        assert!(!accepts_gzip(&h));
    }
}
