//! Pseudo-terminals for processes started with a terminal: opening a pair,
//! non-blocking reads and writes of the master driven by tokio, resizing.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use tokio::io::unix::AsyncFd;

/// A pseudo-terminal master, non-blocking, driven by tokio.
#[derive(Debug)]
pub struct PtyMaster {
    fd: AsyncFd<OwnedFd>,
}

/// Opens a pseudo-terminal pair: (master, slave).
pub(crate) fn open_pty(cols: u16, rows: u16) -> io::Result<(PtyMaster, OwnedFd)> {
    // SAFETY: posix_openpt takes flags only and returns a new fd or -1.
    let m = unsafe { libc::posix_openpt(libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC) };
    if m < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `m` is a freshly opened fd that nothing else owns.
    let master = unsafe { OwnedFd::from_raw_fd(m) };
    // SAFETY: grantpt/unlockpt only act on the fd, which is valid.
    if unsafe { libc::grantpt(m) } != 0 || unsafe { libc::unlockpt(m) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let mut name = [0 as libc::c_char; 128];
    // SAFETY: the buffer is valid for `name.len()` bytes and ptsname_r
    // NUL-terminates within it.
    if unsafe { libc::ptsname_r(m, name.as_mut_ptr(), name.len()) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `name` is NUL-terminated (ptsname_r succeeded).
    let s = unsafe {
        libc::open(
            name.as_ptr(),
            libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC,
        )
    };
    if s < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `s` is a freshly opened fd that nothing else owns.
    let slave = unsafe { OwnedFd::from_raw_fd(s) };
    set_winsize(m, cols, rows)?;
    // SAFETY: fcntl on a valid fd with standard flags.
    unsafe {
        let fl = libc::fcntl(m, libc::F_GETFL);
        libc::fcntl(m, libc::F_SETFL, fl | libc::O_NONBLOCK);
    }
    // SAFETY: `master` is an OwnedFd: it stays open and refers to the same
    // file description until the AsyncFd (its owner) is dropped.
    let fd = unsafe { AsyncFd::register(master) }.map_err(io::Error::from)?;
    Ok((PtyMaster { fd }, slave))
}

/// The byte count of a `read`/`write` result, or the error it signals.
fn byte_count(n: isize) -> io::Result<usize> {
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

fn set_winsize(fd: i32, cols: u16, rows: u16) -> io::Result<()> {
    let ws = libc::winsize {
        ws_row: rows,
        ws_col: cols,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: TIOCSWINSZ reads a winsize struct that lives across the call.
    if unsafe { libc::ioctl(fd, libc::TIOCSWINSZ, &ws) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

impl PtyMaster {
    /// Reads output; `Ok(0)` once the terminal is closed (EIO).
    pub(crate) async fn read(&self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            let mut guard = self.fd.readable().await?;
            let r = guard.try_io(|fd| {
                // SAFETY: `buf` is valid for writes of `buf.len()` bytes.
                byte_count(unsafe {
                    libc::read(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len())
                })
            });
            match r {
                Ok(Ok(n)) => return Ok(n),
                Ok(Err(e)) if e.raw_os_error() == Some(libc::EIO) => return Ok(0),
                Ok(Err(e)) if e.kind() == io::ErrorKind::Interrupted => continue,
                Ok(Err(e)) => return Err(e),
                Err(_would_block) => continue,
            }
        }
    }

    /// Writes all of `data` to the terminal.
    pub(crate) async fn write_all(&self, mut data: &[u8]) -> io::Result<()> {
        while !data.is_empty() {
            let mut guard = self.fd.writable().await?;
            let r = guard.try_io(|fd| {
                // SAFETY: `data` is valid for reads of `data.len()` bytes.
                byte_count(unsafe { libc::write(fd.as_raw_fd(), data.as_ptr().cast(), data.len()) })
            });
            match r {
                Ok(Ok(n)) => data = &data[n..],
                Ok(Err(e)) if e.kind() == io::ErrorKind::Interrupted => {}
                Ok(Err(e)) => return Err(e),
                Err(_would_block) => {}
            }
        }
        Ok(())
    }

    /// Sets the terminal size.
    pub(crate) fn resize(&self, cols: u16, rows: u16) -> io::Result<()> {
        set_winsize(self.fd.get_ref().as_raw_fd(), cols, rows)
    }
}
