//! The node side of a fast-lane request: a connection from the pool (or
//! a new one), the request head and body written to it, the response head
//! read back; a pooled connection that turns out closed is replaced once.

use std::io::{self, IoSlice};

use bytes::{Buf, BytesMut};
use http::Method;
use http::uri::Authority;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;

use super::framing::{CHUNK, Framing, make_room, read_more};
use super::head::{Expect, MAX_HEAD, RespHead, parse_response_head};
use super::{Client, ClientIo};
use crate::pool::{RawConn, UpstreamPool};

/// Why an exchange with the node failed.
pub(super) enum ExchangeError {
    /// The node could not be reached or broke the exchange.
    Upstream(io::Error),
    /// The client stopped sending the request body.
    ClientBody,
    /// The client closed its connection while waiting for the answer.
    ClientGone,
}

/// Sends the request (the line and head in `c`, then `body_left` body
/// bytes from the client) to `authority` and reads the response head into
/// `c.out`. A pooled connection that turns out closed is replaced once,
/// when the whole request is still at hand.
pub(super) async fn exchange<S: ClientIo>(
    pool: &UpstreamPool,
    c: &mut Client<S>,
    authority: &Authority,
    body_left: u64,
    expect: &Expect<'_>,
    now: Instant,
) -> Result<(RawConn, RespHead), ExchangeError> {
    let mut retried = false;
    loop {
        let (mut up, pooled) = match pool.checkout_raw(authority, now) {
            Some(up) if !retried => (up, true),
            _ => (
                pool.connect_raw(authority)
                    .await
                    .map_err(ExchangeError::Upstream)?,
                false,
            ),
        };
        let retry_ok = pooled && body_left == 0;
        if let Err(e) = write_two(&mut up.stream, &c.line, &c.out).await {
            if retry_ok {
                retried = true;
                continue;
            }
            return Err(ExchangeError::Upstream(e));
        }
        if body_left > 0 {
            copy_body(&mut c.stream, &mut up.stream, body_left).await?;
        }
        // Like hyper, notice a client that leaves while the node thinks.
        let Client {
            stream, buf, out, ..
        } = &mut *c;
        let answered = tokio::select! {
            biased;
            r = read_answer(&mut up, out, expect) => r,
            () = client_gone(stream, buf) => return Err(ExchangeError::ClientGone),
        };
        match answered {
            Ok(head) => return Ok((up, head)),
            Err(e) if retry_ok && e.kind() == io::ErrorKind::UnexpectedEof && up.buf.is_empty() => {
                retried = true;
            }
            Err(e) => return Err(ExchangeError::Upstream(e)),
        }
    }
}

/// The request line for `target`, sent in front of the header block.
pub(super) fn request_line(line: &mut Vec<u8>, method: &Method, target: &str) {
    line.clear();
    line.extend_from_slice(method.as_str().as_bytes());
    line.push(b' ');
    line.extend_from_slice(target.as_bytes());
    line.extend_from_slice(b" HTTP/1.1\r\n");
}

/// Copies `n` request body bytes from the client to the node.
async fn copy_body(
    client: &mut (impl AsyncRead + Unpin),
    up: &mut TcpStream,
    mut n: u64,
) -> Result<(), ExchangeError> {
    let mut buf = vec![0u8; CHUNK.min(usize::try_from(n).unwrap_or(CHUNK))];
    while n > 0 {
        let want = buf.len().min(usize::try_from(n).unwrap_or(usize::MAX));
        let got = match client.read(&mut buf[..want]).await {
            Ok(0) | Err(_) => return Err(ExchangeError::ClientBody),
            Ok(got) => got,
        };
        up.write_all(&buf[..got])
            .await
            .map_err(ExchangeError::Upstream)?;
        n -= got as u64;
    }
    Ok(())
}

/// The response head and, like the hyper path, the first body bytes: a
/// node that stalls before its body still gets a 504.
async fn read_answer(
    up: &mut RawConn,
    out: &mut Vec<u8>,
    expect: &Expect<'_>,
) -> io::Result<RespHead> {
    let head = read_response_head(up, out, expect).await?;
    if head.framing != Framing::Empty
        && up.buf.is_empty()
        && read_more(&mut up.stream, &mut up.buf).await? == 0
        && head.framing != Framing::Close
    {
        // Not UnexpectedEof: the node did answer, so this is no stale
        // pooled connection to retry on.
        return Err(io::Error::other(
            "the node closed the connection before the body",
        ));
    }
    Ok(head)
}

/// Resolves when the client closes its connection; bytes it sends
/// meanwhile (a pipelined request) are kept in `buf`, up to [`MAX_HEAD`]:
/// past that the client is no longer read until the answer is relayed (the
/// request timeout still bounds the wait), so a client cannot make the
/// gateway buffer without end.
async fn client_gone(stream: &mut (impl AsyncRead + Unpin), buf: &mut BytesMut) {
    loop {
        if buf.len() >= MAX_HEAD {
            return std::future::pending().await;
        }
        make_room(buf);
        // Cancel-safe: bytes read before the answer wins stay in `buf` (a TLS
        // stream keeps what it decrypted in its own buffer).
        match stream.read_buf(buf).await {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
    }
}

/// Reads the node's response head (skipping 1xx answers) and writes its
/// rewritten form into `out`.
async fn read_response_head(
    up: &mut RawConn,
    out: &mut Vec<u8>,
    expect: &Expect<'_>,
) -> io::Result<RespHead> {
    loop {
        let parsed = parse_response_head(&up.buf, out, expect)?;
        match parsed {
            Some((len, None)) => {
                // An informational answer: skip it.
                up.buf.advance(len);
                continue;
            }
            Some((len, Some(head))) => {
                up.buf.advance(len);
                return Ok(head);
            }
            None if up.buf.len() >= MAX_HEAD => {
                return Err(io::Error::other("response head too large"));
            }
            None => {}
        }
        if read_more(&mut up.stream, &mut up.buf).await? == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
    }
}

/// Writes `a` then `b` with as few `writev` calls as the socket allows.
async fn write_two(stream: &mut TcpStream, mut a: &[u8], mut b: &[u8]) -> io::Result<()> {
    while !a.is_empty() || !b.is_empty() {
        let n = stream
            .write_vectored(&[IoSlice::new(a), IoSlice::new(b)])
            .await?;
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        let from_a = n.min(a.len());
        a = &a[from_a..];
        b = &b[n - from_a..];
    }
    Ok(())
}
