//! Streaming file I/O on a blocking thread: large sequential reads and
//! writes without a thread hop per chunk (what tokio's `File` would do).

use std::io::{self, Read, Write};

use bytes::Bytes;
use futures::{Stream, StreamExt};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

/// Size of each read.
pub const CHUNK: usize = 1024 * 1024;
/// Chunks in flight between the file thread and the network.
const DEPTH: usize = 4;

/// Errors of streamed writes.
#[derive(Debug, thiserror::Error)]
pub enum WriteError<E: std::fmt::Display + std::fmt::Debug> {
    #[error("writing the file: {0}")]
    Io(io::Error),
    #[error("reading the data: {0}")]
    Source(E),
}

/// A read buffer that goes back to its pool when the last `Bytes` view of
/// it is dropped, so sequential reads reuse warm memory instead of
/// allocating (and page-faulting) a fresh megabyte per chunk.
struct Pooled {
    buf: Vec<u8>,
    len: usize,
    pool: std::sync::Arc<parking_lot::Mutex<Vec<Vec<u8>>>>,
}

impl AsRef<[u8]> for Pooled {
    fn as_ref(&self) -> &[u8] {
        &self.buf[..self.len]
    }
}

impl Drop for Pooled {
    fn drop(&mut self) {
        let buf = std::mem::take(&mut self.buf);
        let mut pool = self.pool.lock();
        if pool.len() < DEPTH + 2 {
            pool.push(buf);
        }
    }
}

/// Reads until `buf` is full or the file ends; returns the bytes read.
fn fill(file: &mut std::fs::File, buf: &mut [u8]) -> io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match file.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

/// The contents of `file` as a stream of chunks read on a blocking thread.
pub fn read_stream(file: std::fs::File) -> impl Stream<Item = io::Result<Bytes>> + Send + 'static {
    let (tx, rx) = mpsc::channel(DEPTH);
    let pool = std::sync::Arc::new(parking_lot::Mutex::new(Vec::<Vec<u8>>::new()));
    tokio::task::spawn_blocking(move || {
        let mut file = file;
        loop {
            // Buffers are zeroed once, when first made, then reused.
            let mut buf = pool.lock().pop().unwrap_or_else(|| vec![0u8; CHUNK]);
            match fill(&mut file, &mut buf) {
                Ok(0) => break,
                Ok(len) => {
                    let chunk = Bytes::from_owner(Pooled {
                        buf,
                        len,
                        pool: pool.clone(),
                    });
                    if tx.blocking_send(Ok(chunk)).is_err() {
                        break;
                    }
                }
                Err(e) => {
                    let _ = tx.blocking_send(Err(e));
                    break;
                }
            }
        }
    });
    ReceiverStream::new(rx)
}

/// Writes every chunk of `data` to `file` on a blocking thread; returns the
/// byte count.
pub async fn write_stream<S, E>(file: std::fs::File, mut data: S) -> Result<u64, WriteError<E>>
where
    S: Stream<Item = Result<Bytes, E>> + Unpin,
    E: std::fmt::Display + std::fmt::Debug,
{
    let (tx, mut rx) = mpsc::channel::<Bytes>(DEPTH);
    let writer = tokio::task::spawn_blocking(move || -> io::Result<u64> {
        let mut file = file;
        let mut n = 0u64;
        while let Some(b) = rx.blocking_recv() {
            file.write_all(&b)?;
            n += b.len() as u64;
        }
        file.flush()?;
        Ok(n)
    });
    let mut source_err = None;
    while let Some(chunk) = data.next().await {
        match chunk {
            Ok(b) => {
                if tx.send(b).await.is_err() {
                    break; // the writer failed; its error is returned below
                }
            }
            Err(e) => {
                source_err = Some(e);
                break;
            }
        }
    }
    drop(tx);
    let written = writer
        .await
        .map_err(|e| WriteError::Io(io::Error::other(e)))?
        .map_err(WriteError::Io)?;
    match source_err {
        Some(e) => Err(WriteError::Source(e)),
        None => Ok(written),
    }
}

/// A 64-bit value unique within this process and unpredictable across
/// processes, for temporary names and ids. Never fails (no /dev/urandom
/// needed: std seeds its hasher keys with the getrandom system call).
pub fn unique_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    h.write_u32(std::process::id());
    h.finish()
}
