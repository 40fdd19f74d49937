//! The local terminal: raw mode (restored when the guard drops, also on panic and
//! error paths) and the window size.

use std::os::fd::BorrowedFd;

use nix::sys::termios::{self, SetArg, Termios};

/// Errors of terminal control.
#[derive(Debug, thiserror::Error)]
pub enum TermError {
    #[error("switching the terminal to raw mode: {0}")]
    Raw(nix::Error),
}

/// Raw mode on standard input while alive; the previous settings come back on drop.
pub struct RawGuard {
    saved: Termios,
}

impl RawGuard {
    /// Enters raw mode; `None` when standard input is not a terminal.
    pub fn enter() -> Result<Option<RawGuard>, TermError> {
        let fd = stdin_fd();
        let saved = match termios::tcgetattr(fd) {
            Ok(t) => t,
            Err(_) => return Ok(None),
        };
        let mut raw = saved.clone();
        termios::cfmakeraw(&mut raw);
        termios::tcsetattr(fd, SetArg::TCSADRAIN, &raw).map_err(TermError::Raw)?;
        Ok(Some(RawGuard { saved }))
    }
}

impl Drop for RawGuard {
    fn drop(&mut self) {
        let _ = termios::tcsetattr(stdin_fd(), SetArg::TCSADRAIN, &self.saved);
    }
}

fn stdin_fd() -> BorrowedFd<'static> {
    // SAFETY: fd 0 (standard input) stays open for the whole process; only its
    // terminal attributes are read or changed through this borrow.
    unsafe { BorrowedFd::borrow_raw(0) }
}

/// Columns and rows of the terminal on stdout (or stdin), if there is one.
pub fn size() -> Option<(u16, u16)> {
    for fd in [1, 0, 2] {
        let mut ws = libc::winsize {
            ws_row: 0,
            ws_col: 0,
            ws_xpixel: 0,
            ws_ypixel: 0,
        };
        // SAFETY: TIOCGWINSZ writes one `winsize` into the valid, exclusively borrowed
        // struct; a bad or non-terminal fd only makes the call fail.
        let r = unsafe { libc::ioctl(fd, libc::TIOCGWINSZ, &mut ws) };
        if r == 0 && ws.ws_col > 0 && ws.ws_row > 0 {
            return Some((ws.ws_col, ws.ws_row));
        }
    }
    None
}
