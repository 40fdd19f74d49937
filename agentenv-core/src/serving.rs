//! What every HTTP listener of the project shares about its clients: how long
//! a client may take to send a request head (which also ends idle keep-alive
//! connections), how large a head may be, and HTTP/2 keep-alive pings, so a
//! stranger cannot hold connections, memory or tasks forever.

use std::time::Duration;

use hyper_util::rt::{TokioExecutor, TokioTimer};
use hyper_util::server::conn::auto::Builder;

/// How long a client may take to send a complete request head, counted from the
/// connection's start or from the end of the previous response (so an idle
/// keep-alive connection is closed after it too).
pub const DEFAULT_HEADER_TIMEOUT: Duration = Duration::from_secs(30);

/// HTTP/1.1: the largest read buffer of a connection, which bounds a request head
/// (larger heads are answered 431); bodies stream through it.
pub const MAX_READ_BUFFER: usize = 256 * 1024;

/// HTTP/2: the largest header list a client may send.
pub const MAX_H2_HEADER_LIST: u32 = 64 * 1024;

/// HTTP/2: how often an idle connection is pinged, and how long the answer may take.
const H2_PING_INTERVAL: Duration = Duration::from_secs(30);
const H2_PING_TIMEOUT: Duration = Duration::from_secs(10);

/// A hyper server builder (HTTP/1.1 and HTTP/2) with the client limits above and
/// `header_timeout` as the head-read and keep-alive idle timeout.
pub fn server_builder(header_timeout: Duration) -> Builder<TokioExecutor> {
    let mut builder = Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(header_timeout)
        .max_buf_size(MAX_READ_BUFFER);
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_header_list_size(MAX_H2_HEADER_LIST)
        .keep_alive_interval(Some(H2_PING_INTERVAL))
        .keep_alive_timeout(H2_PING_TIMEOUT);
    builder
}
