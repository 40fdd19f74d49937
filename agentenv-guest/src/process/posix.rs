//! Starting a plain process with `posix_spawn(3)`.
//!
//! `std::process::Command` forks in this agent: the agent is linked
//! statically, and std only takes glibc's `posix_spawn` when it can look the
//! C library's version up at run time, which a static binary cannot. A fork
//! copies the agent's page tables and makes its pages copy-on-write until
//! the child execs; glibc's `posix_spawn` clones with `CLONE_VM |
//! CLONE_VFORK` instead, so starting a command costs the same whatever the
//! agent's size (on this kind of host ~0.2 ms less per command at the
//! agent's 4–5 MiB).
//!
//! Only what `posix_spawn` does exactly as the fork path would comes here:
//! pipes or `/dev/null` for the standard streams, no terminal and no change
//! of user, a program that exists (a bare name is looked up in the child's
//! `PATH` here, as `execvp` does). Everything else goes through std as
//! before. A file exec refuses as not a binary (`ENOEXEC`: no interpreter
//! line) is an error here, as with envd, not run with `/bin/sh`. The child gets a process group of its own, an empty signal mask
//! and `SIGPIPE` back at its default (std does the same); the agent waits
//! for it through a pidfd.

use std::ffi::{CString, NulError};
use std::io;
use std::mem::MaybeUninit;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::ExitStatus;
use std::ptr;
use std::sync::OnceLock;

use tokio::io::Interest;
use tokio::io::unix::AsyncFd;

/// Whether this kernel has `pidfd_open(2)` (Linux 5.3); without it every
/// process goes through std.
pub(super) fn available() -> bool {
    static PIDFD: OnceLock<bool> = OnceLock::new();
    *PIDFD.get_or_init(|| {
        // SAFETY: getpid has no preconditions.
        let me = unsafe { libc::getpid() };
        pidfd_open(me as u32).is_ok()
    })
}

/// The file `posix_spawn` should run for `cmd`: `cmd` itself when it names
/// a path (absolute, or relative to the working directory), else the first
/// executable regular file called `cmd` in the directories of `path` (the
/// child's `PATH`), as `execvp` would find it. `None` when there is none:
/// std then reports the error exactly as before.
pub(super) fn program(cmd: &str, path: Option<&str>) -> Option<String> {
    if cmd.contains('/') {
        return Some(cmd.to_string());
    }
    if cmd.is_empty() {
        return None;
    }
    use std::os::unix::fs::PermissionsExt;
    path?
        .split(':')
        .map(|dir| if dir.is_empty() { "." } else { dir })
        .map(|dir| format!("{}/{cmd}", dir.trim_end_matches('/')))
        .find(|cand| {
            std::fs::metadata(cand)
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
}

fn pidfd_open(pid: u32) -> io::Result<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new fd or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the kernel just returned this fd to us alone.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0; 2];
    // SAFETY: pipe2 writes two fds into the array.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: both fds are new and ours.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

fn nul(e: NulError) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidInput,
        format!("nul byte found in provided data: {e}"),
    )
}

/// A C error number (as the posix_spawn functions return) as a result.
fn check(rc: libc::c_int) -> io::Result<()> {
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::from_raw_os_error(rc))
    }
}

/// `posix_spawn_file_actions_t`, destroyed on drop.
struct FileActions(libc::posix_spawn_file_actions_t);

impl FileActions {
    fn new() -> io::Result<Self> {
        let mut fa = MaybeUninit::<libc::posix_spawn_file_actions_t>::uninit();
        // SAFETY: init initialises the object it is given.
        check(unsafe { libc::posix_spawn_file_actions_init(fa.as_mut_ptr()) })?;
        // SAFETY: initialised just above.
        Ok(Self(unsafe { fa.assume_init() }))
    }

    fn dup2(&mut self, fd: &OwnedFd, to: libc::c_int) -> io::Result<()> {
        // SAFETY: the object is initialised; the fd stays open until the spawn.
        check(unsafe { libc::posix_spawn_file_actions_adddup2(&mut self.0, fd.as_raw_fd(), to) })
    }

    fn chdir(&mut self, dir: &CString) -> io::Result<()> {
        // SAFETY: the object is initialised; glibc copies the path.
        check(unsafe { libc::posix_spawn_file_actions_addchdir_np(&mut self.0, dir.as_ptr()) })
    }
}

impl Drop for FileActions {
    fn drop(&mut self) {
        // SAFETY: initialised in `new`, destroyed once.
        unsafe { libc::posix_spawn_file_actions_destroy(&mut self.0) };
    }
}

/// `posix_spawnattr_t`, destroyed on drop.
struct Attr(libc::posix_spawnattr_t);

impl Attr {
    /// A process group of its own, no blocked signal, `SIGPIPE` at its
    /// default (the agent ignores it).
    fn new() -> io::Result<Self> {
        let mut at = MaybeUninit::<libc::posix_spawnattr_t>::uninit();
        // SAFETY: init initialises the object it is given.
        check(unsafe { libc::posix_spawnattr_init(at.as_mut_ptr()) })?;
        // SAFETY: initialised just above.
        let mut attr = Self(unsafe { at.assume_init() });
        // SAFETY: sigset_t is plain data; sigemptyset/sigaddset fill it.
        unsafe {
            let mut empty = MaybeUninit::<libc::sigset_t>::uninit();
            libc::sigemptyset(empty.as_mut_ptr());
            let empty = empty.assume_init();
            let mut pipe = empty;
            libc::sigaddset(&mut pipe, libc::SIGPIPE);
            check(libc::posix_spawnattr_setsigmask(&mut attr.0, &empty))?;
            check(libc::posix_spawnattr_setsigdefault(&mut attr.0, &pipe))?;
            check(libc::posix_spawnattr_setpgroup(&mut attr.0, 0))?;
            let flags = libc::POSIX_SPAWN_SETPGROUP
                | libc::POSIX_SPAWN_SETSIGMASK
                | libc::POSIX_SPAWN_SETSIGDEF;
            check(libc::posix_spawnattr_setflags(
                &mut attr.0,
                flags as libc::c_short,
            ))?;
        }
        Ok(attr)
    }
}

impl Drop for Attr {
    fn drop(&mut self) {
        // SAFETY: initialised in `new`, destroyed once.
        unsafe { libc::posix_spawnattr_destroy(&mut self.0) };
    }
}

/// A process started here: its pid, its exit, and the agent's ends of its
/// pipes.
pub(super) struct Spawned {
    pub pid: u32,
    pub exit: PidfdExit,
    pub stdin: Option<OwnedFd>,
    pub stdout: OwnedFd,
    pub stderr: OwnedFd,
}

/// Starts the file `file` (see [`program`]) with `argv0` and `args`,
/// exactly the environment `env`, in `cwd`; stdin is a pipe when `stdin`,
/// else `/dev/null`; stdout and stderr are pipes. Errors are the ones exec
/// gives (not found, permission denied, not a binary…).
pub(super) fn spawn(
    file: &str,
    argv0: &str,
    args: &[String],
    env: &[(String, String)],
    cwd: &Path,
    stdin: bool,
) -> io::Result<Spawned> {
    let prog = CString::new(file).map_err(nul)?;
    let argv_owned = std::iter::once(CString::new(argv0))
        .chain(args.iter().map(|a| CString::new(a.as_str())))
        .collect::<Result<Vec<_>, _>>()
        .map_err(nul)?;
    let envp_owned = env
        .iter()
        .map(|(k, v)| CString::new(format!("{k}={v}")))
        .collect::<Result<Vec<_>, _>>()
        .map_err(nul)?;
    let dir = CString::new(cwd.as_os_str().as_bytes()).map_err(nul)?;
    let ptrs = |v: &[CString]| {
        v.iter()
            .map(|s| s.as_ptr() as *mut libc::c_char)
            .chain(std::iter::once(ptr::null_mut()))
            .collect::<Vec<_>>()
    };
    let argv = ptrs(&argv_owned);
    let envp = ptrs(&envp_owned);

    let (in_child, in_agent) = if stdin {
        let (r, w) = pipe()?;
        (r, Some(w))
    } else {
        let null = std::fs::File::open("/dev/null")?;
        (OwnedFd::from(null), None)
    };
    let (out_agent, out_child) = pipe()?;
    let (err_agent, err_child) = pipe()?;

    let mut fa = FileActions::new()?;
    fa.dup2(&in_child, 0)?;
    fa.dup2(&out_child, 1)?;
    fa.dup2(&err_child, 2)?;
    fa.chdir(&dir)?;
    let attr = Attr::new()?;

    let mut pid: libc::pid_t = 0;
    // SAFETY: every pointer is valid until the call returns (the strings are
    // owned above, argv and envp end in null); glibc reports the child's
    // exec failure as the return value.
    check(unsafe {
        libc::posix_spawn(
            &mut pid,
            prog.as_ptr(),
            &fa.0,
            &attr.0,
            argv.as_ptr(),
            envp.as_ptr(),
        )
    })?;
    let pid = pid as u32;
    // The child is ours until reaped, so the pid cannot be reused before
    // the pidfd is open.
    let exit = match pidfd_open(pid).and_then(|fd| PidfdExit::new(pid, fd)) {
        Ok(e) => e,
        Err(e) => {
            // SAFETY: the child is ours and not reaped.
            unsafe {
                libc::kill(pid as libc::pid_t, libc::SIGKILL);
                libc::waitpid(pid as libc::pid_t, ptr::null_mut(), 0);
            }
            return Err(e);
        }
    };
    Ok(Spawned {
        pid,
        exit,
        stdin: in_agent,
        stdout: out_agent,
        stderr: err_agent,
    })
}

/// A child's exit, awaited through its pidfd (readable once it exited).
pub(super) struct PidfdExit {
    pid: u32,
    fd: AsyncFd<OwnedFd>,
    status: Option<ExitStatus>,
}

impl PidfdExit {
    fn new(pid: u32, fd: OwnedFd) -> io::Result<Self> {
        // SAFETY: the OwnedFd is moved into the AsyncFd, which owns it
        // (and so keeps it open and the same) for its whole life.
        let fd = unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) }
            .map_err(io::Error::from)?;
        Ok(Self {
            pid,
            fd,
            status: None,
        })
    }

    /// Waits for the child to end and reaps it. Cancel-safe; after the
    /// first answer, the same status again.
    pub async fn wait(&mut self) -> io::Result<ExitStatus> {
        if let Some(st) = self.status {
            return Ok(st);
        }
        loop {
            let mut guard = self.fd.readable().await?;
            let mut raw = 0;
            // SAFETY: waitpid on our own child, WNOHANG.
            let r = unsafe { libc::waitpid(self.pid as libc::pid_t, &mut raw, libc::WNOHANG) };
            if r < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
            if r == 0 {
                guard.clear_ready();
                continue;
            }
            let st = ExitStatus::from_raw(raw);
            self.status = Some(st);
            return Ok(st);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    #[test]
    fn program_takes_paths_as_given_and_finds_bare_names_like_execvp() {
        assert_eq!(program("/bin/sh", None).as_deref(), Some("/bin/sh"));
        assert_eq!(program("./x", Some("/bin")).as_deref(), Some("./x"));
        assert_eq!(program("sh", None), None, "no PATH: std reports it");
        assert_eq!(program("", Some("/bin")), None);

        let dir = tempfile::tempdir().unwrap();
        let d = |n: &str| dir.path().join(n);
        for n in ["dir", "plain", "exec"] {
            std::fs::create_dir_all(d(n)).unwrap();
        }
        std::fs::create_dir_all(d("dir/tool")).unwrap();
        std::fs::write(d("plain/tool"), "").unwrap();
        std::fs::write(d("exec/tool"), "").unwrap();
        std::fs::set_permissions(d("exec/tool"), std::fs::Permissions::from_mode(0o700)).unwrap();
        let path = format!(
            "/nonexistent:{}:{}:{}/",
            d("dir").display(),
            d("plain").display(),
            d("exec").display()
        );
        let found = program("tool", Some(&path)).unwrap();
        assert_eq!(found, format!("{}/tool", d("exec").display()));
        assert_eq!(program("other", Some(&path)), None);
    }

    #[tokio::test]
    async fn spawn_runs_a_program_and_reaps_it_through_its_pidfd() {
        if !available() {
            eprintln!("SKIPPED: no pidfd_open on this kernel");
            return;
        }
        let env = [("PATH".to_string(), "/usr/bin:/bin".to_string())];
        let args = [
            "-c".to_string(),
            "read x; echo \"$x $0\"; exit 3".to_string(),
        ];
        let mut s = spawn("/bin/sh", "sh", &args, &env, Path::new("/"), true).unwrap();
        let stdin = std::fs::File::from(s.stdin.take().unwrap());
        std::io::Write::write_all(&mut &stdin, b"hello\n").unwrap();
        drop(stdin);
        let st = s.exit.wait().await.unwrap();
        assert_eq!(st.code(), Some(3));
        assert_eq!(s.exit.wait().await.unwrap().code(), Some(3), "asked again");
        let mut out = String::new();
        std::io::Read::read_to_string(&mut std::fs::File::from(s.stdout), &mut out).unwrap();
        assert_eq!(out, "hello sh\n");
        // Reaped: no such child any more.
        // SAFETY: waitpid with WNOHANG on a pid that was our child.
        let r = unsafe { libc::waitpid(s.pid as i32, ptr::null_mut(), libc::WNOHANG) };
        assert_eq!(r, -1);
    }
}
