//! A connection some of whose bytes were read already, handed on so that
//! the next reader sees them first.
//!
//! A server that peeks at a connection's first bytes to pick a path (the
//! agent's zero-copy upload path, a proxy's fast lane) and then hands the
//! connection to hyper wraps it in a [`Rewind`] with the bytes it read:
//! reads return those bytes first, then whatever the connection brings;
//! writes go straight to the connection.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> std::io::Result<()> {
//! use agentenv_guest::rewind::Rewind;
//! use tokio::io::{AsyncReadExt, AsyncWriteExt};
//!
//! let (mut peer, conn) = tokio::io::duplex(64);
//! peer.write_all(b" world").await?;
//! drop(peer);
//! let mut io = Rewind::new(conn, bytes::Bytes::from_static(b"hello"));
//! let mut all = String::new();
//! io.read_to_string(&mut all).await?;
//! assert_eq!(all, "hello world");
//! # Ok(()) }
//! ```

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Buf, Bytes};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

/// `io` with `pending` bytes to be read before anything from `io` itself.
#[derive(Debug)]
pub struct Rewind<T = TcpStream> {
    pending: Bytes,
    io: T,
}

impl<T> Rewind<T> {
    /// Reads return `pending` first, then what `io` reads.
    pub fn new(io: T, pending: Bytes) -> Rewind<T> {
        Rewind { pending, io }
    }

    /// The connection and the bytes not read yet.
    pub fn into_parts(self) -> (T, Bytes) {
        (self.io, self.pending)
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Rewind<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if self.pending.is_empty() {
            return Pin::new(&mut self.io).poll_read(cx, buf);
        }
        let n = self.pending.len().min(buf.remaining());
        buf.put_slice(&self.pending[..n]);
        if n == self.pending.len() {
            // Lets the read buffer go.
            self.pending = Bytes::new();
        } else {
            self.pending.advance(n);
        }
        Poll::Ready(Ok(()))
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Rewind<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test]
    async fn pending_bytes_come_first_in_small_reads_and_writes_pass_through() {
        let (mut peer, conn) = tokio::io::duplex(64);
        let mut io = Rewind::new(conn, Bytes::from_static(b"abcde"));
        let mut two = [0u8; 2];
        io.read_exact(&mut two).await.unwrap();
        assert_eq!(&two, b"ab");
        peer.write_all(b"fg").await.unwrap();
        let mut rest = [0u8; 5];
        io.read_exact(&mut rest).await.unwrap();
        assert_eq!(&rest, b"cdefg");
        io.write_all(b"back").await.unwrap();
        let mut got = [0u8; 4];
        peer.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"back");
        let (_, left) = io.into_parts();
        assert!(left.is_empty());
    }
}
