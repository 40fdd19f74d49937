//! Small system-call helpers shared by the attempts: errno names, paths as C strings,
//! raw and foreign-ABI system calls, reading and writing small files.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

/// The x32 ABI bit: `nr | X32_SYSCALL_BIT` is the x32 number of a common system call.
pub const X32_SYSCALL_BIT: libc::c_long = 0x4000_0000;

/// The calling thread's `errno`.
pub fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

/// `EPERM`, `ENOENT`, … for an errno value.
pub fn ename(e: i32) -> String {
    format!("{:?}", nix::errno::Errno::from_raw(e))
}

/// A path as a C string (paths of this program never hold NUL bytes).
pub fn cpath(p: impl AsRef<Path>) -> CString {
    CString::new(p.as_ref().as_os_str().as_bytes()).unwrap_or_default()
}

/// A string as a C string.
pub fn cstr(s: &str) -> CString {
    CString::new(s).unwrap_or_default()
}

/// Result of a raw system call: the return value, or the errno.
pub type SysResult = Result<libc::c_long, i32>;

/// `syscall(nr, a…)` with six arguments.
pub fn raw_syscall(nr: libc::c_long, args: [libc::c_long; 6]) -> SysResult {
    // SAFETY: the callers pass numbers and arguments whose pointers are null or point to
    // memory that lives across the call; a refused or failing call only sets errno.
    let r = unsafe { libc::syscall(nr, args[0], args[1], args[2], args[3], args[4], args[5]) };
    if r < 0 { Err(errno()) } else { Ok(r) }
}

/// An i386 system call through `int 0x80` (32-bit arguments).
#[cfg(target_arch = "x86_64")]
pub fn int80(nr: u32, a: u32, b: u32, c: u32) -> i32 {
    let ret: u32;
    // SAFETY: `int 0x80` enters the kernel's i386 entry point; rbx (reserved by the
    // compiler) is saved and restored around it, the registers the kernel clears on a
    // compat return (r8–r15) are declared clobbered, and no memory is passed.
    unsafe {
        core::arch::asm!(
            "push rbx",
            "mov ebx, {a:e}",
            "int 0x80",
            "pop rbx",
            a = in(reg) a,
            inlateout("eax") nr => ret,
            in("ecx") b,
            in("edx") c,
            out("r8") _,
            out("r9") _,
            out("r10") _,
            out("r11") _,
            out("r12") _,
            out("r13") _,
            out("r14") _,
            out("r15") _,
        );
    }
    ret as i32
}

/// An owned file descriptor from a raw return value.
pub struct Fd(pub i32);

impl Drop for Fd {
    fn drop(&mut self) {
        if self.0 >= 0 {
            // SAFETY: the descriptor is owned by this value and closed once.
            unsafe { libc::close(self.0) };
        }
    }
}

/// `open(path, flags)`.
pub fn open(path: &str, flags: i32) -> Result<Fd, i32> {
    let c = cstr(path);
    // SAFETY: `c` is a NUL-terminated path that outlives the call.
    let fd = unsafe { libc::open(c.as_ptr(), flags | libc::O_CLOEXEC, 0o600) };
    if fd < 0 { Err(errno()) } else { Ok(Fd(fd)) }
}

/// `fstat(fd)`.
pub fn fstat(fd: &Fd) -> Result<libc::stat, i32> {
    // SAFETY: an all-zero `stat` is a valid value of this plain C struct.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `st` is a valid, writable `stat` for the kernel to fill.
    let r = unsafe { libc::fstat(fd.0, &mut st) };
    if r < 0 { Err(errno()) } else { Ok(st) }
}

/// `lstat(path)`.
pub fn lstat(path: &str) -> Result<libc::stat, i32> {
    let c = cstr(path);
    // SAFETY: an all-zero `stat` is a valid value of this plain C struct.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is NUL-terminated and `st` is writable; both outlive the call.
    let r = unsafe { libc::lstat(c.as_ptr(), &mut st) };
    if r < 0 { Err(errno()) } else { Ok(st) }
}

/// `pread(fd, n bytes at off)`.
pub fn pread(fd: &Fd, n: usize, off: i64) -> Result<Vec<u8>, i32> {
    let mut buf = vec![0u8; n];
    // SAFETY: `buf` has room for `n` bytes and lives across the call.
    let r = unsafe { libc::pread(fd.0, buf.as_mut_ptr().cast(), n, off) };
    if r < 0 {
        return Err(errno());
    }
    buf.truncate(r as usize);
    Ok(buf)
}

/// `write(fd, data)`: the byte count written.
pub fn write(fd: &Fd, data: &[u8]) -> Result<usize, i32> {
    // SAFETY: `data` is valid for `data.len()` bytes across the call.
    let r = unsafe { libc::write(fd.0, data.as_ptr().cast(), data.len()) };
    if r < 0 { Err(errno()) } else { Ok(r as usize) }
}

/// Whether `st` is the character device `major:minor`.
pub fn is_chr(st: &libc::stat, major: u32, minor: u32) -> bool {
    st.st_mode & libc::S_IFMT == libc::S_IFCHR
        && libc::major(st.st_rdev) == major
        && libc::minor(st.st_rdev) == minor
}

/// The mounts of this process: (mount point, filesystem type, mount options).
pub fn mounts() -> Vec<(String, String, String)> {
    let text = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    text.lines()
        .filter_map(|l| {
            let (pre, post) = l.split_once(" - ")?;
            let f: Vec<&str> = pre.split(' ').collect();
            let fstype = post.split(' ').next()?;
            Some((
                unescape(f.get(4)?),
                fstype.to_string(),
                f.get(5)?.to_string(),
            ))
        })
        .collect()
}

/// Undoes mountinfo's octal escapes (`\040` for a space).
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 4 <= b.len()
            && let Some(v) = std::str::from_utf8(&b[i + 1..i + 4])
                .ok()
                .and_then(|o| u8::from_str_radix(o, 8).ok())
        {
            out.push(v);
            i += 4;
            continue;
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// `readlink(path)` as a string.
pub fn readlink(path: &str) -> Option<String> {
    std::fs::read_link(path)
        .ok()
        .map(|p| p.to_string_lossy().into_owned())
}

/// Forks; the child runs `f` and exits with its return value. Returns the child's pid.
pub fn fork_child(f: impl FnOnce() -> i32) -> Result<libc::pid_t, i32> {
    // SAFETY: this program is single-threaded, so the child may run arbitrary code.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(errno());
    }
    if pid == 0 {
        let code = f();
        // SAFETY: leaving the child without running the parent's exit handlers.
        unsafe { libc::_exit(code) };
    }
    Ok(pid)
}

/// How a child ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    Exited(i32),
    Signaled(i32),
}

/// `waitpid(pid)`, retried on EINTR.
pub fn wait(pid: libc::pid_t) -> Option<Ended> {
    let mut status = 0;
    loop {
        // SAFETY: `status` is writable for the kernel to fill.
        let r = unsafe { libc::waitpid(pid, &mut status, 0) };
        if r == pid {
            break;
        }
        if r < 0 && errno() != libc::EINTR {
            return None;
        }
    }
    if libc::WIFSIGNALED(status) {
        Some(Ended::Signaled(libc::WTERMSIG(status)))
    } else {
        Some(Ended::Exited(libc::WEXITSTATUS(status)))
    }
}

/// Reaps every exited child (orphans this process adopted as a subreaper included).
pub fn reap_all() {
    loop {
        let mut status = 0;
        // SAFETY: `status` is writable for the kernel to fill.
        let r = unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG) };
        if r <= 0 {
            break;
        }
    }
}

/// A signal's name.
pub fn signame(sig: i32) -> String {
    match nix::sys::signal::Signal::try_from(sig) {
        Ok(s) => s.as_str().to_string(),
        Err(_) => format!("signal {sig}"),
    }
}
