//! `/volumecontent/{volumeID}/dir|path|file`: the files of a volume, for clients that
//! hold its token (`Authorization: Bearer <token>`, compared in constant time; the API
//! key is not asked). Errors are `{"code": "<string>", "message"}` as the SDKs' volume
//! client expects; a missing or wrong token is an empty 401. The file operations are
//! [`crate::volume::content`]'s, on the volume's data directory (on `oss`, this node's
//! copy, uploaded when the call is done).

use std::sync::Arc;

use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, StreamBody};
use hyper::body::{Frame, Incoming};
use serde::Deserialize;

use super::ApiState;
use super::body::{json_response, query_pairs, read_json};
use super::error::{Reject, Reply, volume_status};
use super::volumes::volumes;
use crate::dataplane::{Body, status_only};
use crate::host::safefs::SafeDir;
use crate::volume::content::{self, ContentError, Entry, VolPath};
use crate::volume::{VolumeError, Volumes};

/// Largest file one `PUT …/file` writes.
pub const MAX_FILE_UPLOAD: u64 = 1 << 30;

/// Size of the chunks a file is read in.
const READ_CHUNK: usize = 64 << 10;

/// What a content request does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ContentOp {
    /// `GET …/dir`
    List,
    /// `POST …/dir`
    MakeDir,
    /// `GET …/path`
    Stat,
    /// `PATCH …/path`
    SetMeta,
    /// `DELETE …/path`
    Remove,
    /// `GET …/file`
    Read,
    /// `PUT …/file`
    Write,
}

/// A content API error: the status and the string `code`.
fn error(status: StatusCode, message: impl Into<String>) -> Reject {
    let code = match status {
        StatusCode::BAD_REQUEST => "bad_request",
        StatusCode::NOT_FOUND => "not_found",
        StatusCode::CONFLICT => "already_exists",
        StatusCode::PAYLOAD_TOO_LARGE => "payload_too_large",
        StatusCode::SERVICE_UNAVAILABLE => "unavailable",
        _ => "internal",
    };
    json_response(
        status,
        &serde_json::json!({"code": code, "message": message.into()}),
    )
    .into()
}

impl From<ContentError> for Reject {
    fn from(e: ContentError) -> Self {
        let status = match &e {
            ContentError::BadPath(_)
            | ContentError::BadRequest(_)
            | ContentError::WrongType { .. }
            | ContentError::TooMany { .. } => StatusCode::BAD_REQUEST,
            ContentError::NotFound(_) => StatusCode::NOT_FOUND,
            ContentError::Exists(_) => StatusCode::CONFLICT,
            ContentError::Files { .. } | ContentError::Io { .. } => {
                tracing::warn!(error = %e, "volume content operation failed");
                StatusCode::INTERNAL_SERVER_ERROR
            }
        };
        error(status, e.to_string())
    }
}

fn volume_error(e: VolumeError) -> Reject {
    error(volume_status(&e), e.to_string())
}

/// The query of a content request.
struct Query {
    path: VolPath,
    depth: Option<u32>,
    uid: Option<u32>,
    gid: Option<u32>,
    mode: Option<u32>,
    force: bool,
}

fn parse_query(q: &str) -> Result<Query, Reject> {
    let pairs = query_pairs(q);
    let bad = |m: String| error(StatusCode::BAD_REQUEST, m);
    let path = pairs
        .get("path")
        .ok_or_else(|| bad("path is required: add ?path=/dir/file".into()))?;
    let num = |k: &str| -> Result<Option<u32>, Reject> {
        match pairs.get(k) {
            None => Ok(None),
            Some(v) => v
                .parse()
                .map(Some)
                .map_err(|_| bad(format!("invalid {k} {v:?}: use a decimal number"))),
        }
    };
    let force = match pairs.get("force").map(String::as_str) {
        None | Some("false") => false,
        Some("true") => true,
        Some(other) => return Err(bad(format!("invalid force {other:?}: use true or false"))),
    };
    let q = Query {
        path: VolPath::parse(path)?,
        depth: num("depth")?,
        uid: num("uid")?,
        gid: num("gid")?,
        mode: num("mode")?,
        force,
    };
    content::check_meta(q.uid, q.gid, q.mode)?;
    Ok(q)
}

/// `PATCH …/path` body.
#[derive(Debug, Default, Deserialize)]
struct MetaBody {
    uid: Option<u32>,
    gid: Option<u32>,
    mode: Option<u32>,
}

/// Whether the request carries volume `id`'s token.
fn authorized(v: &Volumes, id: &str, req: &Request<Incoming>) -> bool {
    crate::ids::is_uuid(id)
        && req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|h| h.to_str().ok())
            .and_then(|h| {
                h.strip_prefix("Bearer ")
                    .or_else(|| h.strip_prefix("bearer "))
            })
            .is_some_and(|t| v.token_ok(id, t.trim()))
}

/// Runs `f` on the volume's data directory in a blocking task.
async fn on_data<T: Send + 'static>(
    dir: Arc<SafeDir>,
    f: impl FnOnce(&SafeDir) -> Result<T, ContentError> + Send + 'static,
) -> Result<T, Reject> {
    match tokio::task::spawn_blocking(move || f(&dir)).await {
        Ok(r) => r.map_err(Reject::from),
        Err(e) => Err(error(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("volume content task: {e}"),
        )),
    }
}

fn entry_response(status: StatusCode, e: &Entry) -> Response<Body> {
    json_response(status, e)
}

/// Serves one content request for volume `id`.
pub(super) async fn handle(
    state: &ApiState,
    id: &str,
    op: ContentOp,
    req: Request<Incoming>,
) -> Reply {
    let v = volumes(state)?.clone();
    if !authorized(&v, id, &req) {
        return Ok(status_only(StatusCode::UNAUTHORIZED));
    }
    let id = id.to_ascii_lowercase();
    let q = parse_query(req.uri().query().unwrap_or(""))?;
    if v.get(&id).await.map_err(volume_error)?.is_none() {
        return Err(error(
            StatusCode::NOT_FOUND,
            format!("volume {id} not found"),
        ));
    }
    let path = v.open_data(&id).await.map_err(volume_error)?;
    let result = serve(&path, op, q, req).await;
    if let Err(e) = v.close_data(&id).await {
        tracing::error!(volume = %id, error = %e, "giving back the volume after a content call");
    }
    result
}

async fn serve(data: &std::path::Path, op: ContentOp, q: Query, req: Request<Incoming>) -> Reply {
    let data = data.to_path_buf();
    let dir = Arc::new(
        tokio::task::spawn_blocking(move || SafeDir::open(&data))
            .await
            .map_err(|e| error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?
            .map_err(|e| error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?,
    );
    let Query {
        path,
        depth,
        uid,
        gid,
        mode,
        force,
    } = q;
    match op {
        ContentOp::List => {
            let entries =
                on_data(dir, move |d| content::list(d, &path, depth.unwrap_or(1))).await?;
            Ok(json_response(StatusCode::OK, &entries))
        }
        ContentOp::MakeDir => {
            let e = on_data(dir, move |d| {
                content::make_dir(
                    d,
                    &path,
                    uid.unwrap_or(0),
                    gid.unwrap_or(0),
                    mode.unwrap_or(0o755),
                    force,
                )
            })
            .await?;
            Ok(entry_response(StatusCode::CREATED, &e))
        }
        ContentOp::Stat => {
            let e = on_data(dir, move |d| content::stat(d, &path)).await?;
            Ok(entry_response(StatusCode::OK, &e))
        }
        ContentOp::SetMeta => {
            let body: MetaBody = read_json(req).await?;
            content::check_meta(body.uid, body.gid, body.mode)?;
            let e = on_data(dir, move |d| {
                content::set_meta(d, &path, body.uid, body.gid, body.mode)
            })
            .await?;
            Ok(entry_response(StatusCode::OK, &e))
        }
        ContentOp::Remove => {
            on_data(dir, move |d| content::remove(d, &path)).await?;
            Ok(status_only(StatusCode::NO_CONTENT))
        }
        ContentOp::Read => {
            let (file, size) = on_data(dir, move |d| content::open_read(d, &path)).await?;
            Ok(file_response(tokio::fs::File::from_std(file), size))
        }
        ContentOp::Write => write(dir, path, uid, gid, mode, force, req).await,
    }
}

/// A file as a streamed 200 response of `size` bytes (what it held when it was opened:
/// a file that grows meanwhile is cut there, so the body matches its length).
fn file_response(file: tokio::fs::File, size: u64) -> Response<Body> {
    let stream = futures::stream::unfold(Some((file, size)), |state| async move {
        let (mut f, left) = state?;
        if left == 0 {
            return None;
        }
        let mut buf = vec![0u8; READ_CHUNK.min(usize::try_from(left).unwrap_or(READ_CHUNK))];
        match tokio::io::AsyncReadExt::read(&mut f, &mut buf).await {
            Ok(0) => None,
            Ok(n) => {
                buf.truncate(n);
                Some((
                    Ok(Frame::data(Bytes::from(buf))),
                    Some((f, left - n as u64)),
                ))
            }
            Err(e) => Some((Err(crate::dataplane::BoxError::from(e)), None)),
        }
    });
    let mut r = Response::new(StreamBody::new(stream).boxed_unsync());
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/octet-stream"),
    );
    h.insert(header::CONTENT_LENGTH, HeaderValue::from(size));
    r
}

/// `PUT …/file`: the body, streamed into a new file (at most [`MAX_FILE_UPLOAD`] bytes)
/// that replaces the one at the path once it is whole.
#[allow(clippy::too_many_arguments)]
async fn write(
    dir: Arc<SafeDir>,
    path: VolPath,
    uid: Option<u32>,
    gid: Option<u32>,
    mode: Option<u32>,
    force: bool,
    req: Request<Incoming>,
) -> Reply {
    let too_large = || {
        error(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("the file is larger than the allowed {MAX_FILE_UPLOAD} bytes"),
        )
    };
    if req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        .is_some_and(|len| len > MAX_FILE_UPLOAD)
    {
        return Err(too_large());
    }
    let (uid, gid, mode) = (uid.unwrap_or(0), gid.unwrap_or(0), mode.unwrap_or(0o644));
    let p = path.clone();
    let (upload, file) = on_data(dir.clone(), move |d| {
        content::begin_write(d, &p, uid, gid, force)
    })
    .await?;
    let mut f = tokio::fs::File::from_std(file);
    let received = async {
        let mut body = req.into_body();
        let mut total = 0u64;
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| {
                error(
                    StatusCode::BAD_REQUEST,
                    format!("reading the file from the request: {e}"),
                )
            })?;
            if let Ok(data) = frame.into_data() {
                total += data.len() as u64;
                if total > MAX_FILE_UPLOAD {
                    return Err(too_large());
                }
                tokio::io::AsyncWriteExt::write_all(&mut f, &data)
                    .await
                    .map_err(|e| {
                        error(
                            StatusCode::INTERNAL_SERVER_ERROR,
                            format!("writing {}: {e}", path.shown),
                        )
                    })?;
            }
        }
        tokio::io::AsyncWriteExt::flush(&mut f).await.map_err(|e| {
            error(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("writing {}: {e}", path.shown),
            )
        })?;
        Ok::<_, Reject>(())
    }
    .await;
    drop(f);
    if let Err(e) = received {
        let _ = tokio::task::spawn_blocking(move || upload.abort()).await;
        return Err(e);
    }
    let e = on_data(dir, move |d| upload.commit(d, uid, gid, mode)).await?;
    Ok(entry_response(StatusCode::CREATED, &e))
}
