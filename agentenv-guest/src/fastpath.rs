//! The zero-copy path for raw uploads. hyper reads every request body into
//! user space; for the one large body the agent takes (an HTTP/1.1
//! `POST /files` with a `Content-Length`, neither chunked, multipart nor
//! gzip) that copy is most of the cost. So the agent reads a connection's
//! first request head itself: when it is such an upload, the body goes from
//! the socket through a pipe into the file with `splice(2)`
//! ([`crate::splice`]) on a blocking thread, with the same checks, files
//! and answers as hyper's handler ([`crate::files`]). Everything else (any
//! other first request, HTTP/2, and whatever follows such an upload on the
//! connection) is served by hyper, the bytes already read replayed first
//! ([`crate::rewind`]).

use std::io;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::{HeaderMap, HeaderName, HeaderValue, Method, Response, Uri, header};
use http_body_util::BodyExt;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::connect::RespBody;
use crate::files::{RawUpload, UploadHead, is_gzip, multipart_boundary, upload_response};
use crate::rewind::Rewind;
use crate::splice::ReceiveError;
use crate::state::AgentState;

/// A client must send a request head within this time (here for the first
/// request, in hyper for the others).
pub const HEADER_TIMEOUT: Duration = Duration::from_secs(30);
/// Largest request head read here; a larger one goes to hyper.
const MAX_HEAD: usize = 64 * 1024;
/// First read size (hyper's too): a head, and maybe the start of a body.
const FIRST_READ: usize = 8 * 1024;
/// How long the body of a refused upload is read and dropped before the
/// connection closes, so the client reads the answer instead of a reset.
const LINGER: Duration = Duration::from_secs(2);

/// A raw upload's request head.
struct Upload {
    uri: Uri,
    headers: HeaderMap,
    len: u64,
    expect_continue: bool,
    close: bool,
}

/// Serves the connection's first request if it is a raw upload. Returns
/// the connection for hyper, with the bytes read but not used, or `None`
/// when the connection is done.
pub(crate) async fn intercept(mut stream: TcpStream, state: &AgentState) -> Option<Rewind> {
    let mut buf = BytesMut::with_capacity(FIRST_READ);
    let head = tokio::time::timeout(HEADER_TIMEOUT, read_head(&mut stream, &mut buf)).await;
    let (upload, head_len) = match head {
        Ok(Ok(Some(u))) => u,
        Ok(Ok(None)) => return Some(Rewind::new(stream, buf.freeze())),
        Ok(Err(e)) => {
            tracing::debug!(error = %e, "reading the first request head");
            return None;
        }
        Err(_) => {
            tracing::debug!("no request head within {HEADER_TIMEOUT:?}");
            return None;
        }
    };
    let rest = buf.freeze().slice(head_len..);
    serve_upload(stream, state, upload, rest).await
}

/// Reads until the first request head is complete and is a raw upload
/// (`Some`), or is clearly something else, too large, malformed, or cut
/// off (`None`: hyper's business).
async fn read_head(
    stream: &mut TcpStream,
    buf: &mut BytesMut,
) -> io::Result<Option<(Upload, usize)>> {
    loop {
        if buf.len() == buf.capacity() {
            buf.reserve(buf.len());
        }
        if stream.read_buf(buf).await? == 0 {
            return Ok(None);
        }
        match may_be_upload(buf) {
            Some(false) => return Ok(None),
            None => continue,
            Some(true) => {}
        }
        let mut headers = [httparse::EMPTY_HEADER; 64];
        let mut req = httparse::Request::new(&mut headers);
        match req.parse(buf) {
            Ok(httparse::Status::Complete(len)) => return Ok(raw_upload(&req).map(|u| (u, len))),
            Ok(httparse::Status::Partial) if buf.len() < MAX_HEAD => {}
            _ => return Ok(None),
        }
    }
}

/// Whether `buf` starts like a `POST /files` request; `None` while it is
/// too short to tell.
fn may_be_upload(buf: &[u8]) -> Option<bool> {
    const LINE: &[u8] = b"POST /files";
    let n = buf.len().min(LINE.len());
    if buf[..n] != LINE[..n] {
        return Some(false);
    }
    buf.get(LINE.len()).map(|&c| c == b' ' || c == b'?')
}

fn has_token(headers: &HeaderMap, name: HeaderName, token: &str) -> bool {
    headers
        .get_all(name)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|t| t.trim().eq_ignore_ascii_case(token))
}

/// The head as a raw upload, or `None` if it is not one (or anything about
/// it is unusual: hyper decides then).
fn raw_upload(req: &httparse::Request<'_, '_>) -> Option<Upload> {
    if req.method != Some("POST") || req.version != Some(1) {
        return None;
    }
    let uri: Uri = req.path?.parse().ok()?;
    if uri.path() != "/files" {
        return None;
    }
    let mut headers = HeaderMap::with_capacity(req.headers.len());
    for h in req.headers.iter() {
        headers.append(
            HeaderName::from_bytes(h.name.as_bytes()).ok()?,
            HeaderValue::from_bytes(h.value).ok()?,
        );
    }
    if headers.contains_key(header::TRANSFER_ENCODING)
        || is_gzip(&headers)
        || multipart_boundary(&headers).is_some()
    {
        return None;
    }
    let mut lengths = headers.get_all(header::CONTENT_LENGTH).iter();
    let len = lengths.next()?.to_str().ok()?;
    if lengths.next().is_some() || len.is_empty() || !len.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let len = len.parse().ok()?;
    let expect_continue = match headers.get(header::EXPECT) {
        None => false,
        Some(v) if v.as_bytes().eq_ignore_ascii_case(b"100-continue") => true,
        Some(_) => return None,
    };
    let close = has_token(&headers, header::CONNECTION, "close");
    Some(Upload {
        uri,
        headers,
        len,
        expect_continue,
        close,
    })
}

/// Serves one raw upload whose body starts with `rest` (bytes read with the
/// head, maybe beyond the body too).
async fn serve_upload(
    mut stream: TcpStream,
    state: &AgentState,
    up: Upload,
    rest: Bytes,
) -> Option<Rewind> {
    let in_buf = (rest.len() as u64).min(up.len) as usize;
    let unread = up.len - in_buf as u64;
    if let Some(denied) = state.denied(&Method::POST, &up.uri, &up.headers) {
        return refuse(stream, denied, unread).await;
    }
    let begun = UploadHead::parse(state, up.uri.query(), &up.headers)
        .and_then(|head| RawUpload::begin(head, Some(up.len)));
    let (upload, file) = match begun {
        Ok(b) => b,
        Err(e) => return refuse(stream, upload_response(Err(e)), unread).await,
    };
    state.count_fast_upload();
    if up.expect_continue
        && (in_buf as u64) < up.len
        && stream
            .write_all(b"HTTP/1.1 100 Continue\r\n\r\n")
            .await
            .is_err()
    {
        return None;
    }
    let (mut stream, received) = match receive(stream, up.len, rest.slice(..in_buf), file).await {
        Ok(r) => r,
        Err(e) => {
            tracing::warn!(error = %e, "moving the connection for an upload");
            return None;
        }
    };
    let result = match received {
        Ok(()) => upload.finish(),
        Err(ReceiveError::Peer(e)) => {
            // `upload` is dropped: its temporary file goes with it.
            tracing::debug!(error = %e, "upload cut off");
            return None;
        }
        Err(ReceiveError::Local(e)) => {
            // Some of the body is still unread, at most `unread` bytes.
            let resp = upload_response(Err(upload.write_error(e)));
            return refuse(stream, resp, unread).await;
        }
    };
    let keep_alive = !up.close;
    if write_response(&mut stream, upload_response(result), keep_alive)
        .await
        .is_err()
        || !keep_alive
    {
        let _ = stream.shutdown().await;
        return None;
    }
    Some(Rewind::new(stream, rest.slice(in_buf..)))
}

/// Moves the body (`len` bytes, `first` of them already read) into `file`
/// on a blocking thread, the socket switched to blocking mode meanwhile;
/// gives the connection back.
async fn receive(
    stream: TcpStream,
    len: u64,
    first: Bytes,
    mut file: std::fs::File,
) -> io::Result<(TcpStream, Result<(), ReceiveError>)> {
    let blocking = stream.into_std()?;
    blocking.set_nonblocking(false)?;
    let (blocking, received) = tokio::task::spawn_blocking(move || {
        let r = crate::splice::receive_exact(&blocking, len, &first, &mut file, &mut |_| {});
        (blocking, r)
    })
    .await
    .map_err(io::Error::other)?;
    blocking.set_nonblocking(true)?;
    Ok((TcpStream::from_std(blocking)?, received))
}

/// Answers a refused upload and closes the connection. Up to `unread`
/// bytes of body the client may still be sending are read and dropped
/// first (for a while at most): closing with unread data would reset the
/// connection, and the client might lose the answer.
async fn refuse(mut stream: TcpStream, resp: Response<RespBody>, unread: u64) -> Option<Rewind> {
    if write_response(&mut stream, resp, false).await.is_ok() && stream.shutdown().await.is_ok() {
        let mut sink = vec![0u8; 64 * 1024];
        let drain = async {
            let mut left = unread;
            while left > 0 {
                match stream.read(&mut sink).await {
                    Ok(n) if n > 0 => left = left.saturating_sub(n as u64),
                    _ => break,
                }
            }
        };
        let _ = tokio::time::timeout(LINGER, drain).await;
    }
    None
}

/// Writes `resp` as HTTP/1.1 (its body is a small one in memory).
async fn write_response(
    stream: &mut TcpStream,
    resp: Response<RespBody>,
    keep_alive: bool,
) -> io::Result<()> {
    let (parts, body) = resp.into_parts();
    let body = body.collect().await?.to_bytes();
    let mut out = Vec::with_capacity(256 + body.len());
    out.extend_from_slice(format!("HTTP/1.1 {}\r\n", parts.status).as_bytes());
    for (name, value) in &parts.headers {
        out.extend_from_slice(name.as_str().as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    let date = httpdate::fmt_http_date(std::time::SystemTime::now());
    out.extend_from_slice(format!("content-length: {}\r\ndate: {date}\r\n", body.len()).as_bytes());
    if !keep_alive {
        out.extend_from_slice(b"connection: close\r\n");
    }
    out.extend_from_slice(b"\r\n");
    out.extend_from_slice(&body);
    stream.write_all(&out).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_post_files_request_lines_may_be_uploads() {
        assert_eq!(may_be_upload(b"PO"), None);
        assert_eq!(may_be_upload(b"POST /files"), None);
        assert_eq!(may_be_upload(b"POST /files?path=x"), Some(true));
        assert_eq!(may_be_upload(b"POST /files HTTP/1.1"), Some(true));
        assert_eq!(may_be_upload(b"POST /files/compose"), Some(false));
        assert_eq!(
            may_be_upload(b"POST /filesystem.Filesystem/Stat"),
            Some(false)
        );
        assert_eq!(may_be_upload(b"GET /files"), Some(false));
        assert_eq!(may_be_upload(b"PRI * HTTP/2.0"), Some(false));
    }

    fn parse(head: &str) -> Option<Upload> {
        let mut headers = [httparse::EMPTY_HEADER; 64];
        let mut req = httparse::Request::new(&mut headers);
        assert!(req.parse(head.as_bytes()).unwrap().is_complete());
        raw_upload(&req)
    }

    #[test]
    fn raw_uploads_are_told_from_other_uploads() {
        let up = parse(
            "POST /files?path=/a HTTP/1.1\r\nContent-Length: 12\r\nExpect: 100-Continue\r\nConnection: keep-alive, Close\r\n\r\n",
        )
        .unwrap();
        assert_eq!(
            (up.len, up.expect_continue, up.close, up.uri.query()),
            (12, true, true, Some("path=/a"))
        );
        let up = parse("POST /files?path=/a HTTP/1.1\r\nContent-Length: 0\r\n\r\n").unwrap();
        assert_eq!((up.len, up.expect_continue, up.close), (0, false, false));
        for not_raw in [
            "POST /files?path=/a HTTP/1.0\r\nContent-Length: 1\r\n\r\n",
            "POST /files?path=/a HTTP/1.1\r\n\r\n",
            "POST /files?path=/a HTTP/1.1\r\nContent-Length: +1\r\n\r\n",
            "POST /files?path=/a HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 1\r\n\r\n",
            "POST /files?path=/a HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n",
            "POST /files?path=/a HTTP/1.1\r\nContent-Length: 1\r\nContent-Encoding: gzip\r\n\r\n",
            "POST /files?path=/a HTTP/1.1\r\nContent-Length: 1\r\nContent-Type: multipart/form-data; boundary=x\r\n\r\n",
            "POST /files?path=/a HTTP/1.1\r\nContent-Length: 1\r\nExpect: something\r\n\r\n",
            "POST /files/compose HTTP/1.1\r\nContent-Length: 1\r\n\r\n",
        ] {
            assert!(parse(not_raw).is_none(), "{not_raw}");
        }
    }
}
