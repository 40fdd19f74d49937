//! A `Content-Length` body from a socket into a file without a copy through
//! user space: `splice(2)` from the socket into a pipe, then from the pipe
//! into the file. The client's downloads ([`crate::rawfile`]) and the
//! agent's uploads ([`crate::fastpath`]) both receive files this way. Both
//! run it on a blocking thread with a blocking socket.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// Bytes moved per `splice` call (and the pipe's size).
pub const STEP: usize = 1024 * 1024;

/// Why receiving a body into a file stopped.
#[derive(Debug)]
pub enum ReceiveError {
    /// Reading from the peer failed, or it closed the connection early.
    Peer(io::Error),
    /// Writing the file failed.
    Local(io::Error),
}

fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0i32; 2];
    // SAFETY: `fds` has room for the two descriptors pipe2 writes.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: pipe2 succeeded, so both descriptors are open and ours.
    let (r, w) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    // A larger pipe moves more per call; the default size works too.
    // SAFETY: F_SETPIPE_SZ takes an int argument; `w` is an open pipe.
    unsafe { libc::fcntl(w.as_raw_fd(), libc::F_SETPIPE_SZ, STEP as libc::c_int) };
    Ok((r, w))
}

fn splice(from: i32, to: i32, len: usize) -> io::Result<usize> {
    loop {
        // SAFETY: plain descriptors, no offsets (both ends use their own position).
        let n = unsafe {
            libc::splice(
                from,
                std::ptr::null_mut(),
                to,
                std::ptr::null_mut(),
                len,
                libc::SPLICE_F_MOVE | libc::SPLICE_F_MORE,
            )
        };
        if n >= 0 {
            return Ok(n as usize);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

fn cut_short(done: u64, len: u64) -> ReceiveError {
    ReceiveError::Peer(io::Error::new(
        io::ErrorKind::UnexpectedEof,
        format!("the connection was closed after {done} of {len} bytes"),
    ))
}

/// Writes a body of exactly `len` bytes into `file` (from its current
/// position): first the part of `rest` (bytes already read from `stream`)
/// that belongs to it, then the remainder, spliced from `stream` through a
/// pipe. Where the kernel refuses to splice (`EINVAL`: a socket or a file
/// that does not support it, such as one opened with `O_APPEND`) the
/// remainder is copied. Reads nothing past the body. `progress` hears of
/// every piece written.
pub fn receive_exact(
    stream: &TcpStream,
    len: u64,
    rest: &[u8],
    file: &mut std::fs::File,
    progress: &mut dyn FnMut(u64),
) -> Result<(), ReceiveError> {
    let first = (rest.len() as u64).min(len) as usize;
    file.write_all(&rest[..first])
        .map_err(ReceiveError::Local)?;
    progress(first as u64);
    let mut done = first as u64;
    let Ok((pr, pw)) = pipe() else {
        return copy_exact(stream, len, done, file, progress);
    };
    while done < len {
        let want = (len - done).min(STEP as u64) as usize;
        let n = match splice(stream.as_raw_fd(), pw.as_raw_fd(), want) {
            Ok(0) => return Err(cut_short(done, len)),
            Ok(n) => n,
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                return copy_exact(stream, len, done, file, progress);
            }
            Err(e) => return Err(ReceiveError::Peer(e)),
        };
        let mut left = n;
        while left > 0 {
            match splice(pr.as_raw_fd(), file.as_raw_fd(), left) {
                Ok(0) => {
                    return Err(ReceiveError::Local(io::Error::new(
                        io::ErrorKind::WriteZero,
                        "the file took no more bytes",
                    )));
                }
                Ok(m) => left -= m,
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                    // Move what the pipe holds by copy, then copy on.
                    let mut buf = vec![0u8; left];
                    let mut pipe_end = std::fs::File::from(pr);
                    pipe_end.read_exact(&mut buf).map_err(ReceiveError::Local)?;
                    file.write_all(&buf).map_err(ReceiveError::Local)?;
                    done += n as u64;
                    progress(n as u64);
                    return copy_exact(stream, len, done, file, progress);
                }
                Err(e) => return Err(ReceiveError::Local(e)),
            }
        }
        done += n as u64;
        progress(n as u64);
    }
    Ok(())
}

/// The rest of [`receive_exact`] by read and write, `done` of `len` bytes
/// already written.
fn copy_exact(
    mut stream: &TcpStream,
    len: u64,
    mut done: u64,
    file: &mut std::fs::File,
    progress: &mut dyn FnMut(u64),
) -> Result<(), ReceiveError> {
    let mut buf = vec![0u8; 64 * 1024];
    while done < len {
        let want = (len - done).min(buf.len() as u64) as usize;
        let n = match stream.read(&mut buf[..want]) {
            Ok(0) => return Err(cut_short(done, len)),
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(ReceiveError::Peer(e)),
        };
        file.write_all(&buf[..n]).map_err(ReceiveError::Local)?;
        done += n as u64;
        progress(n as u64);
    }
    Ok(())
}
