//! File transfers that keep the client's copies out of user space: an upload
//! goes from the local page cache to the socket with `sendfile(2)`, a
//! download from the socket through a pipe into the local file with
//! `splice(2)` ([`crate::splice`]). Each transfer is one HTTP/1.1 exchange
//! on a connection of its own (`Connection: close`), run on a blocking
//! thread; heads are parsed with `httparse`. Everything that is not a plain
//! `Content-Length` body (chunked answers, error bodies) is read normally.
//!
//! `sendfile` cannot ask for `MSG_NOSIGNAL`: like every Rust program by
//! default, the process must ignore `SIGPIPE` (a peer closing mid-upload is
//! then an `EPIPE` error, not a signal).

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::fd::AsRawFd;

use http::{HeaderMap, Method, StatusCode};

use crate::splice::{ReceiveError, STEP, receive_exact};

/// Largest response head accepted.
const MAX_HEAD: usize = 64 * 1024;
/// Largest non-file body (an error message, the upload's JSON answer) kept.
const MAX_SMALL_BODY: usize = 1024 * 1024;

/// The head of the agent's answer.
#[derive(Debug)]
pub struct Head {
    pub status: StatusCode,
    content_length: Option<u64>,
    chunked: bool,
}

/// Shuts the connection down when dropped, so a blocked transfer ends when
/// the future that waits for it is dropped.
struct Abort(Option<TcpStream>);

impl Drop for Abort {
    fn drop(&mut self) {
        if let Some(s) = self.0.take() {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

/// Runs `f` with a fresh connection to `authority` on a blocking thread;
/// dropping the returned future aborts the exchange.
pub async fn exchange<T, F>(authority: &str, f: F) -> io::Result<T>
where
    T: Send + 'static,
    F: FnOnce(&mut TcpStream) -> io::Result<T> + Send + 'static,
{
    let authority = authority.to_string();
    let (tx, rx) = tokio::sync::oneshot::channel::<TcpStream>();
    let task = tokio::task::spawn_blocking(move || -> io::Result<T> {
        let mut stream = TcpStream::connect(&authority)?;
        stream.set_nodelay(true)?;
        if tx.send(stream.try_clone()?).is_err() {
            return Err(io::Error::new(
                io::ErrorKind::Interrupted,
                "transfer cancelled",
            ));
        }
        f(&mut stream)
    });
    // Held until the exchange ends; dropped early, it shuts the socket down.
    let mut abort = Abort(None);
    if let Ok(s) = rx.await {
        abort.0 = Some(s);
    }
    let result = task.await.map_err(io::Error::other)?;
    abort.0 = None;
    result
}

/// Writes a request head; `content_length` is sent when given.
pub fn write_head(
    stream: &mut TcpStream,
    method: &Method,
    path_and_query: &str,
    authority: &str,
    headers: &HeaderMap,
    content_length: Option<u64>,
) -> io::Result<()> {
    let mut head = Vec::with_capacity(512);
    write!(
        head,
        "{method} {path_and_query} HTTP/1.1\r\nHost: {authority}\r\n"
    )?;
    for (name, value) in headers {
        head.extend_from_slice(name.as_str().as_bytes());
        head.extend_from_slice(b": ");
        head.extend_from_slice(value.as_bytes());
        head.extend_from_slice(b"\r\n");
    }
    if let Some(n) = content_length {
        write!(head, "Content-Length: {n}\r\n")?;
    }
    head.extend_from_slice(b"Connection: close\r\n\r\n");
    stream.write_all(&head)
}

fn bad(msg: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.into())
}

/// Reads the response head; returns it and the bytes read past it.
pub fn read_head(stream: &mut TcpStream) -> io::Result<(Head, Vec<u8>)> {
    let mut buf = Vec::with_capacity(4096);
    let mut chunk = [0u8; 4096];
    loop {
        let n = stream.read(&mut chunk)?;
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "the agent closed the connection before answering",
            ));
        }
        buf.extend_from_slice(&chunk[..n]);
        let mut headers = [httparse::EMPTY_HEADER; 64];
        let mut resp = httparse::Response::new(&mut headers);
        match resp.parse(&buf) {
            Ok(httparse::Status::Complete(len)) => {
                let status = resp
                    .code
                    .and_then(|c| StatusCode::from_u16(c).ok())
                    .ok_or_else(|| bad("response without a valid status"))?;
                let mut head = Head {
                    status,
                    content_length: None,
                    chunked: false,
                };
                for h in resp.headers.iter() {
                    if h.name.eq_ignore_ascii_case("content-length") {
                        let v = std::str::from_utf8(h.value)
                            .ok()
                            .and_then(|v| v.trim().parse().ok())
                            .ok_or_else(|| bad("invalid Content-Length"))?;
                        head.content_length = Some(v);
                    } else if h.name.eq_ignore_ascii_case("transfer-encoding") {
                        head.chunked = h
                            .value
                            .split(|&b| b == b',')
                            .any(|t| t.trim_ascii().eq_ignore_ascii_case(b"chunked"));
                    }
                }
                let rest = buf.split_off(len);
                return Ok((head, rest));
            }
            Ok(httparse::Status::Partial) if buf.len() < MAX_HEAD => {}
            Ok(httparse::Status::Partial) => return Err(bad("response head too large")),
            Err(e) => return Err(bad(format!("malformed response head: {e}"))),
        }
    }
}

/// Reads a whole body, at most `limit` bytes of it kept, and hands each
/// piece to `sink`. Handles `Content-Length`, chunked, and close-delimited.
fn read_body(
    stream: &mut TcpStream,
    head: &Head,
    mut pending: Vec<u8>,
    sink: &mut dyn FnMut(&[u8]) -> io::Result<()>,
) -> io::Result<u64> {
    let mut chunk = vec![0u8; 64 * 1024];
    let mut fill = |pending: &mut Vec<u8>| -> io::Result<bool> {
        let n = stream.read(&mut chunk)?;
        pending.extend_from_slice(&chunk[..n]);
        Ok(n > 0)
    };
    let mut total = 0u64;
    if head.chunked {
        loop {
            let (start, size) = loop {
                match httparse::parse_chunk_size(&pending) {
                    Ok(httparse::Status::Complete((start, size))) => break (start, size),
                    Ok(httparse::Status::Partial) => {
                        if !fill(&mut pending)? {
                            return Err(io::ErrorKind::UnexpectedEof.into());
                        }
                    }
                    Err(_) => return Err(bad("malformed chunked body")),
                }
            };
            if size == 0 {
                return Ok(total);
            }
            let end = start as u64 + size + 2;
            let end = usize::try_from(end).map_err(|_| bad("chunk too large"))?;
            while pending.len() < end.min(start + STEP) {
                if !fill(&mut pending)? {
                    return Err(io::ErrorKind::UnexpectedEof.into());
                }
            }
            if pending.len() >= end {
                sink(&pending[start..end - 2])?;
                total += size;
                pending.drain(..end);
            } else {
                // A large chunk: pass on what is here, then the rest as it comes.
                let avail = ((pending.len() - start) as u64).min(size) as usize;
                sink(&pending[start..start + avail])?;
                total += avail as u64;
                let mut left = size - avail as u64;
                pending.drain(..start + avail);
                while left > 0 {
                    if pending.is_empty() && !fill(&mut pending)? {
                        return Err(io::ErrorKind::UnexpectedEof.into());
                    }
                    let take = (pending.len() as u64).min(left) as usize;
                    sink(&pending[..take])?;
                    total += take as u64;
                    left -= take as u64;
                    pending.drain(..take);
                }
                while pending.len() < 2 {
                    if !fill(&mut pending)? {
                        return Err(io::ErrorKind::UnexpectedEof.into());
                    }
                }
                pending.drain(..2);
            }
        }
    }
    match head.content_length {
        Some(len) => {
            let mut left = len;
            loop {
                let take = (pending.len() as u64).min(left) as usize;
                if take > 0 {
                    sink(&pending[..take])?;
                    left -= take as u64;
                    total += take as u64;
                }
                pending.clear();
                if left == 0 {
                    return Ok(total);
                }
                if !fill(&mut pending)? {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        format!("the agent closed the connection after {total} of {len} bytes"),
                    ));
                }
            }
        }
        None => loop {
            if !pending.is_empty() {
                sink(&pending)?;
                total += pending.len() as u64;
                pending.clear();
            }
            if !fill(&mut pending)? {
                return Ok(total);
            }
        },
    }
}

/// A small body (an answer or an error message), bounded by [`MAX_SMALL_BODY`].
pub fn read_small_body(stream: &mut TcpStream, head: &Head, rest: Vec<u8>) -> io::Result<Vec<u8>> {
    let mut out = Vec::new();
    read_body(stream, head, rest, &mut |b| {
        let room = MAX_SMALL_BODY.saturating_sub(out.len());
        out.extend_from_slice(&b[..b.len().min(room)]);
        Ok(())
    })?;
    Ok(out)
}

/// Sends `len` bytes of `file` from its start with `sendfile(2)`; returns
/// the bytes sent, fewer than `len` only when the file ended early.
/// `progress` hears of every piece sent.
pub fn send_file(
    stream: &TcpStream,
    file: &std::fs::File,
    len: u64,
    progress: &mut dyn FnMut(u64),
) -> io::Result<u64> {
    let mut offset: libc::off_t = 0;
    let mut left = len;
    while left > 0 {
        let step = left.min(STEP as u64) as usize;
        // SAFETY: both descriptors are open for the duration of the call and
        // `offset` is a valid, exclusively borrowed off_t.
        let n = unsafe { libc::sendfile(stream.as_raw_fd(), file.as_raw_fd(), &mut offset, step) };
        match n {
            n if n > 0 => {
                left -= n as u64;
                progress(n as u64);
            }
            0 => return Ok(len - left),
            _ => {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
        }
    }
    Ok(len)
}

/// Writes a response body into `file`: a `Content-Length` body is spliced
/// from the socket through a pipe ([`crate::splice::receive_exact`]); other
/// framings are read and written. Returns the bytes written. `progress`
/// hears of every piece written.
pub fn receive_file(
    stream: &mut TcpStream,
    head: &Head,
    rest: Vec<u8>,
    file: &mut std::fs::File,
    progress: &mut dyn FnMut(u64),
) -> Result<u64, ReceiveError> {
    if let Some(len) = head.content_length.filter(|_| !head.chunked) {
        return receive_exact(stream, len, &rest, file, progress).map(|()| len);
    }
    // A failed write is remembered here, so it is told from a failed read.
    let mut local: Option<io::Error> = None;
    let r = read_body(stream, head, rest, &mut |b| {
        file.write_all(b).inspect_err(|e| {
            local = Some(io::Error::new(e.kind(), e.to_string()));
        })?;
        progress(b.len() as u64);
        Ok(())
    });
    r.map_err(|e| match local.take() {
        Some(l) => ReceiveError::Local(l),
        None => ReceiveError::Peer(e),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    /// A one-shot server that answers `response` after reading the request head.
    fn serve_once(response: Vec<u8>) -> std::net::SocketAddr {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let mut buf = Vec::new();
            let mut b = [0u8; 1024];
            while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
                let n = s.read(&mut b).unwrap();
                buf.extend_from_slice(&b[..n]);
            }
            s.write_all(&response).unwrap();
        });
        addr
    }

    fn get(addr: std::net::SocketAddr) -> (TcpStream, Head, Vec<u8>) {
        let mut s = TcpStream::connect(addr).unwrap();
        write_head(
            &mut s,
            &Method::GET,
            "/x",
            &addr.to_string(),
            &HeaderMap::new(),
            None,
        )
        .unwrap();
        let (h, rest) = read_head(&mut s).unwrap();
        (s, h, rest)
    }

    #[test]
    fn chunked_bodies_are_decoded_across_reads() {
        let mut resp = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n".to_vec();
        let big = vec![b'z'; 200_000];
        resp.extend_from_slice(b"5\r\nhello\r\n");
        resp.extend_from_slice(format!("{:x}\r\n", big.len()).as_bytes());
        resp.extend_from_slice(&big);
        resp.extend_from_slice(b"\r\n0\r\n\r\n");
        let (mut s, h, rest) = get(serve_once(resp));
        assert!(h.chunked);
        let mut got = Vec::new();
        let n = read_body(&mut s, &h, rest, &mut |b| {
            got.extend_from_slice(b);
            Ok(())
        })
        .unwrap();
        assert_eq!(n, 200_005);
        assert_eq!(&got[..5], b"hello");
        assert!(got[5..].iter().all(|&b| b == b'z'));
    }

    #[test]
    fn a_short_content_length_body_is_an_error_naming_the_counts() {
        let resp = b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc".to_vec();
        let (mut s, h, rest) = get(serve_once(resp));
        let dir = tempfile::tempdir().unwrap();
        let mut f = std::fs::File::create(dir.path().join("f")).unwrap();
        let err = match receive_file(&mut s, &h, rest, &mut f, &mut |_| {}) {
            Err(ReceiveError::Peer(e)) => e,
            other => panic!("expected an agent error, got {other:?}"),
        };
        assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof);
        assert!(err.to_string().contains("after 3 of 10 bytes"), "{err}");
    }

    #[test]
    fn files_that_cannot_be_spliced_into_are_written_by_copy() {
        let body = vec![b'q'; 3 << 20];
        let mut resp =
            format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n", body.len()).into_bytes();
        resp.extend_from_slice(&body);
        let (mut s, h, rest) = get(serve_once(resp));
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("appended");
        std::fs::write(&path, b"head:").unwrap();
        // splice(2) refuses files opened with O_APPEND.
        let mut f = std::fs::File::options().append(true).open(&path).unwrap();
        let mut seen = 0u64;
        let n = receive_file(&mut s, &h, rest, &mut f, &mut |k| seen += k).unwrap();
        assert_eq!((n, seen), (body.len() as u64, body.len() as u64));
        let got = std::fs::read(&path).unwrap();
        assert_eq!(&got[..5], b"head:");
        assert!(got[5..] == body[..]);
    }

    #[test]
    fn malformed_heads_are_invalid_data() {
        let a = serve_once(b"NOT HTTP\r\n\r\n".to_vec());
        let mut s = TcpStream::connect(a).unwrap();
        write_head(&mut s, &Method::GET, "/", "h", &HeaderMap::new(), None).unwrap();
        let err = read_head(&mut s).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
    }
}
