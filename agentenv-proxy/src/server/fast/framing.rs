//! Body framing: relaying a response body by how it ends
//! (`Content-Length`, chunked, or until the node closes), and the chunk
//! scanner that finds the end of a chunked body as it passes through.

use std::io;

use bytes::{Buf, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::pool::RawConn;

/// Read size for bodies.
pub(super) const CHUNK: usize = 16 * 1024;

/// How a response body ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Framing {
    Empty,
    Length(u64),
    Chunked,
    /// Until the node closes the connection.
    Close,
}

/// Reads into `buf`, growing it first when it is nearly full.
pub(super) async fn read_more(
    stream: &mut (impl AsyncRead + Unpin),
    buf: &mut BytesMut,
) -> io::Result<usize> {
    make_room(buf);
    stream.read_buf(buf).await
}

/// Grows `buf` by a read's worth when it is nearly full.
#[inline]
pub(super) fn make_room(buf: &mut BytesMut) {
    if buf.capacity() - buf.len() < 1024 {
        buf.reserve(CHUNK);
    }
}

/// Sends the response `head` to the client and relays the body that
/// follows it from `up` by its framing. Each write is flushed (a no-op on
/// TCP; a TLS stream may hold back a record otherwise).
pub(super) async fn relay_body(
    client: &mut (impl AsyncWrite + Unpin),
    head: &mut Vec<u8>,
    up: &mut RawConn,
    framing: Framing,
) -> io::Result<()> {
    let mut end = match framing {
        Framing::Empty => {
            client.write_all(head).await?;
            return client.flush().await;
        }
        Framing::Length(n) => BodyEnd::Length(n),
        Framing::Chunked => BodyEnd::Chunked(ChunkScanner::default()),
        Framing::Close => BodyEnd::Close,
    };
    // What was read with the head leaves in the same write.
    let used = end.feed(&up.buf)?;
    head.extend_from_slice(&up.buf[..used]);
    up.buf.advance(used);
    client.write_all(head).await?;
    client.flush().await?;
    while !end.done() {
        if read_more(&mut up.stream, &mut up.buf).await? == 0 {
            return match end {
                BodyEnd::Close => Ok(()),
                _ => Err(io::ErrorKind::UnexpectedEof.into()),
            };
        }
        let used = end.feed(&up.buf)?;
        client.write_all(&up.buf[..used]).await?;
        client.flush().await?;
        up.buf.advance(used);
    }
    Ok(())
}

/// Where a body being relayed ends.
enum BodyEnd {
    /// This many bytes are left.
    Length(u64),
    Chunked(ChunkScanner),
    /// When the node closes the connection.
    Close,
}

impl BodyEnd {
    /// How many bytes of `buf` belong to the body.
    fn feed(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Self::Length(left) => {
                let take = usize::try_from(*left).unwrap_or(usize::MAX).min(buf.len());
                *left -= take as u64;
                Ok(take)
            }
            Self::Chunked(scan) => scan.feed(buf),
            Self::Close => Ok(buf.len()),
        }
    }

    fn done(&self) -> bool {
        match self {
            Self::Length(left) => *left == 0,
            Self::Chunked(scan) => scan.done(),
            Self::Close => false,
        }
    }
}

/// Follows a chunked body as it passes through, to find its end.
#[derive(Debug, Default)]
struct ChunkScanner {
    state: Chunk,
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
enum Chunk {
    /// Hex digits of a chunk size (`any`: at least one seen).
    #[default]
    Size,
    SizeDigits(u64),
    /// A chunk extension, up to the CR.
    Extension(u64),
    SizeLf(u64),
    Data(u64),
    DataCr,
    DataLf,
    /// The start of a trailer line (or of the final CRLF).
    TrailerStart,
    TrailerLine,
    FinalLf,
    Done,
}

impl ChunkScanner {
    fn done(&self) -> bool {
        self.state == Chunk::Done
    }

    /// How many bytes of `buf` belong to the body (all of them, unless
    /// the body ends inside `buf`).
    fn feed(&mut self, buf: &[u8]) -> io::Result<usize> {
        let bad = || io::Error::other("malformed chunked body from the node");
        let mut i = 0;
        while i < buf.len() && self.state != Chunk::Done {
            let b = buf[i];
            self.state = match self.state {
                Chunk::Size => match (b as char).to_digit(16) {
                    Some(d) => Chunk::SizeDigits(u64::from(d)),
                    None => return Err(bad()),
                },
                Chunk::SizeDigits(n) => match (b as char).to_digit(16) {
                    Some(d) => Chunk::SizeDigits(
                        n.checked_mul(16)
                            .and_then(|n| n.checked_add(u64::from(d)))
                            .ok_or_else(bad)?,
                    ),
                    None if b == b'\r' => Chunk::SizeLf(n),
                    None if b == b';' || b == b' ' || b == b'\t' => Chunk::Extension(n),
                    None => return Err(bad()),
                },
                Chunk::Extension(n) if b == b'\r' => Chunk::SizeLf(n),
                Chunk::Extension(n) => Chunk::Extension(n),
                Chunk::SizeLf(0) if b == b'\n' => Chunk::TrailerStart,
                Chunk::SizeLf(n) if b == b'\n' => Chunk::Data(n),
                Chunk::Data(n) => {
                    let take = usize::try_from(n).unwrap_or(usize::MAX).min(buf.len() - i);
                    i += take;
                    let left = n - take as u64;
                    self.state = if left == 0 {
                        Chunk::DataCr
                    } else {
                        Chunk::Data(left)
                    };
                    continue;
                }
                Chunk::DataCr if b == b'\r' => Chunk::DataLf,
                Chunk::DataLf if b == b'\n' => Chunk::Size,
                Chunk::TrailerStart if b == b'\r' => Chunk::FinalLf,
                Chunk::TrailerStart | Chunk::TrailerLine if b == b'\n' => Chunk::TrailerStart,
                Chunk::TrailerStart | Chunk::TrailerLine => Chunk::TrailerLine,
                Chunk::FinalLf if b == b'\n' => Chunk::Done,
                _ => return Err(bad()),
            };
            i += 1;
        }
        Ok(i)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BODY: &[u8] = b"5;ext=1\r\nhello\r\n1\r\n \r\n6\r\nworld!\r\n0\r\nx-t: 1\r\n\r\n";

    #[test]
    fn the_chunk_scanner_finds_the_end_wherever_the_reads_split() {
        let mut wire = BODY.to_vec();
        wire.extend_from_slice(b"HTTP/1.1 200 OK\r\n"); // the next response
        for split in 0..=wire.len() {
            let mut scan = ChunkScanner::default();
            let first = scan.feed(&wire[..split]).unwrap();
            let second = scan.feed(&wire[first..]).unwrap();
            assert!(scan.done(), "split at {split}");
            assert_eq!(first + second, BODY.len(), "split at {split}");
        }
    }

    #[test]
    fn the_chunk_scanner_rejects_malformed_bodies() {
        for bad in [
            &b"zz\r\n"[..],
            b"3\r\nabcX\r\n",
            b"3\nabc",
            b"fffffffffffffffff1\r\n",
        ] {
            assert!(ChunkScanner::default().feed(bad).is_err(), "{bad:?}");
        }
    }

    mod props {
        use proptest::prelude::*;

        use super::*;

        /// A chunked encoding of `chunks` with optional extensions and trailers.
        fn encode(chunks: &[Vec<u8>], ext: bool, trailer: bool) -> Vec<u8> {
            let mut out = Vec::new();
            for c in chunks.iter().filter(|c| !c.is_empty()) {
                out.extend_from_slice(format!("{:x}", c.len()).as_bytes());
                if ext {
                    out.extend_from_slice(b";e=1");
                }
                out.extend_from_slice(b"\r\n");
                out.extend_from_slice(c);
                out.extend_from_slice(b"\r\n");
            }
            out.extend_from_slice(b"0\r\n");
            if trailer {
                out.extend_from_slice(b"x-t: 1\r\n");
            }
            out.extend_from_slice(b"\r\n");
            out
        }

        proptest! {
            #[test]
            fn the_chunk_scanner_never_panics_and_never_claims_more_than_it_got(
                parts in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..64), 0..8)
            ) {
                let mut scan = ChunkScanner::default();
                for p in &parts {
                    match scan.feed(p) {
                        Ok(n) => prop_assert!(n <= p.len()),
                        Err(_) => break,
                    }
                    if scan.done() {
                        break;
                    }
                }
            }

            #[test]
            fn a_valid_chunked_body_ends_exactly_where_it_ends_however_it_is_split(
                chunks in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..40), 0..6),
                ext: bool,
                trailer: bool,
                cuts in proptest::collection::vec(any::<prop::sample::Index>(), 0..4),
            ) {
                let body = encode(&chunks, ext, trailer);
                let mut wire = body.clone();
                wire.extend_from_slice(b"HTTP/1.1 200 OK\r\n");
                let mut points: Vec<usize> = cuts.iter().map(|c| c.index(wire.len() + 1)).collect();
                points.sort_unstable();
                points.push(wire.len());
                let mut scan = ChunkScanner::default();
                let (mut at, mut used) = (0, 0);
                for p in points {
                    if scan.done() || p < at {
                        continue;
                    }
                    used += scan.feed(&wire[at..p]).unwrap();
                    at = p;
                }
                prop_assert!(scan.done());
                prop_assert_eq!(used, body.len());
            }
        }
    }
}
