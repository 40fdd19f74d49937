//! The sandbox filters on the real kernel. Each test forks a child, installs the filters in
//! it (the test process keeps its own system calls), has it try things and report back
//! through a pipe, and checks how it ended.
//!
//! Calls that must be refused are made with arguments the kernel would reject anyway
//! (invalid descriptors, flags and pointers), so a broken filter fails the test instead of
//! changing the machine.

use std::ffi::CStr;
use std::io::Read;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use agentenv_seccomp::{
    CLONE_NAMESPACE_FLAGS, REFUSED, REFUSED_IOCTLS, X32_SYSCALL_BIT, install, sandbox_filters,
};

#[derive(Debug, PartialEq, Eq)]
enum End {
    Exited(i32),
    Signaled(i32),
}

fn wait(pid: libc::pid_t) -> End {
    let mut status = 0;
    // SAFETY: waits for a child of ours; `status` is a valid out pointer.
    let r = unsafe { libc::waitpid(pid, &mut status, 0) };
    assert_eq!(r, pid, "waitpid: {}", std::io::Error::last_os_error());
    if libc::WIFSIGNALED(status) {
        End::Signaled(libc::WTERMSIG(status))
    } else {
        End::Exited(libc::WEXITSTATUS(status))
    }
}

/// Runs `body` in a forked child (its own session, so no controlling terminal), with the
/// sandbox filters installed when `filtered`. Returns how the child ended and what it
/// reported: empty when `body` returned `Ok`.
fn in_child(filtered: bool, body: impl FnOnce() -> Result<(), String>) -> (End, String) {
    let filters = sandbox_filters().unwrap();
    let mut fds = [0; 2];
    // SAFETY: `fds` has room for the two descriptors.
    assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
    // SAFETY: the child runs `body` and leaves with `_exit`; it never returns into the test
    // harness. glibc's fork resets the allocator's locks in the child, so `body` may
    // allocate.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
    if pid == 0 {
        // SAFETY: closes the child's copy of the read end.
        unsafe { libc::close(fds[0]) };
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            // SAFETY: setsid has no arguments.
            unsafe { libc::setsid() };
            if filtered {
                install(&filters).map_err(|e| e.to_string())?;
            }
            body()
        }));
        let (code, msg) = match result {
            Ok(Ok(())) => (0, String::new()),
            Ok(Err(msg)) => (1, msg),
            Err(_) => (2, "the child panicked".to_string()),
        };
        // SAFETY: writes an initialized buffer to the pipe, then ends the child without
        // running the harness's destructors.
        unsafe {
            libc::write(fds[1], msg.as_ptr().cast(), msg.len());
            libc::_exit(code);
        }
    }
    // SAFETY: the write end is ours and closed once.
    unsafe { libc::close(fds[1]) };
    // SAFETY: the read end is ours; the File owns it from here.
    let mut pipe = unsafe { std::fs::File::from_raw_fd(fds[0]) };
    let mut msg = String::new();
    pipe.read_to_string(&mut msg).unwrap();
    (wait(pid), msg)
}

/// Runs `body` under the filters and asserts it reported success.
fn under_filters(body: impl FnOnce() -> Result<(), String>) {
    let (end, msg) = in_child(true, body);
    assert_eq!(end, End::Exited(0), "{msg}");
}

fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

fn errname(e: i32) -> String {
    match e {
        libc::EPERM => "EPERM".into(),
        libc::ENOSYS => "ENOSYS".into(),
        0 => "success".into(),
        e => format!("errno {e}"),
    }
}

/// A raw system call: its return value, and errno when it failed.
fn raw(nr: i64, a: [i64; 6]) -> (i64, i32) {
    // SAFETY: every caller passes arguments the kernel validates (invalid descriptors and
    // pointers fail with an error) and none maps, frees or changes memory of this process.
    let r = unsafe { libc::syscall(nr, a[0], a[1], a[2], a[3], a[4], a[5]) };
    (r, if r == -1 { errno() } else { 0 })
}

/// Checks that a raw call fails with `want`.
fn fails_with(what: &str, nr: i64, args: [i64; 6], want: i32) -> Result<(), String> {
    match raw(nr, args) {
        (-1, e) if e == want => Ok(()),
        (r, e) => Err(format!(
            "{what} (nr {nr:#x}): wanted {}, got {r} ({})",
            errname(want),
            errname(e)
        )),
    }
}

/// Arguments the kernel rejects for `nr` (so a filter that lets the call through fails the
/// test, nothing else).
fn harmless_args(nr: i64) -> [i64; 6] {
    if nr == libc::SYS_init_module {
        // A huge length would make the kernel try to allocate it.
        [0; 6]
    } else {
        [-1; 6]
    }
}

/// Collects every failure instead of stopping at the first.
fn all(checks: impl IntoIterator<Item = Result<(), String>>) -> Result<(), String> {
    let errors: Vec<String> = checks.into_iter().filter_map(Result::err).collect();
    if errors.is_empty() {
        Ok(())
    } else {
        Err(errors.join("\n"))
    }
}

/// Maps an I/O error to a report naming what failed.
fn io(what: &'static str) -> impl Fn(std::io::Error) -> String {
    move |e| format!("{what}: {e}")
}

fn check(what: &str, ok: bool) -> Result<(), String> {
    if ok {
        Ok(())
    } else {
        Err(format!("{what}: {}", std::io::Error::last_os_error()))
    }
}

#[test]
fn every_refused_syscall_fails_with_eperm() {
    under_filters(|| {
        all(REFUSED
            .iter()
            .map(|(name, nr)| fails_with(name, *nr, harmless_args(*nr), libc::EPERM)))
    });
}

#[test]
fn x32_numbers_fail_with_eperm() {
    let x32 = i64::from(X32_SYSCALL_BIT);
    // Without the filter, an x32 getpid returns the pid (x32 kernels) or ENOSYS: the EPERM
    // below is the filter's doing.
    let (end, msg) = in_child(false, || match raw(libc::SYS_getpid | x32, [0; 6]) {
        (-1, libc::EPERM) => Err("EPERM without a filter".into()),
        _ => Ok(()),
    });
    assert_eq!(end, End::Exited(0), "{msg}");
    under_filters(|| {
        let refused = REFUSED.iter().map(|(name, nr)| {
            fails_with(
                &format!("x32 {name}"),
                nr | x32,
                harmless_args(*nr),
                libc::EPERM,
            )
        });
        let allowed = [
            ("x32 getpid", libc::SYS_getpid),
            ("x32 read", libc::SYS_read),
            ("x32 clone", libc::SYS_clone),
            ("x32 ioctl", libc::SYS_ioctl),
        ]
        .map(|(name, nr)| fails_with(name, nr | x32, [-1; 6], libc::EPERM));
        all(refused.chain(allowed))
    });
}

#[test]
fn namespaces_can_be_neither_created_nor_joined() {
    under_filters(|| {
        let mut checks = Vec::new();
        for (name, flag) in CLONE_NAMESPACE_FLAGS {
            let flags = *flag as i64 | i64::from(libc::SIGCHLD);
            let r = raw(libc::SYS_clone, [flags, 0, 0, 0, 0, 0]);
            if r.0 == 0 {
                // The filter let it through and this is the new process.
                // SAFETY: ends the stray child at once.
                unsafe { libc::_exit(0) };
            }
            if r.0 > 0 {
                wait(r.0 as libc::pid_t);
            }
            checks.push(match r {
                (-1, libc::EPERM) => Ok(()),
                (r, e) => Err(format!("clone({name}): {r} ({})", errname(e))),
            });
        }
        let newuser = i64::from(libc::CLONE_NEWUSER);
        checks.push(fails_with(
            "unshare(CLONE_NEWUSER)",
            libc::SYS_unshare,
            [newuser, 0, 0, 0, 0, 0],
            libc::EPERM,
        ));
        checks.push(fails_with(
            "setns(-1, CLONE_NEWNET)",
            libc::SYS_setns,
            [-1, i64::from(libc::CLONE_NEWNET), 0, 0, 0, 0],
            libc::EPERM,
        ));
        all(checks)
    });
}

#[test]
fn clone3_and_unlisted_syscalls_fail_with_enosys() {
    under_filters(|| {
        all([
            // A null argument: the kernel would answer EINVAL or EFAULT.
            fails_with("clone3", libc::SYS_clone3, [0; 6], libc::ENOSYS),
            // get_mempolicy(NULL, NULL, 0, NULL, 0) succeeds without the filter.
            fails_with(
                "get_mempolicy",
                libc::SYS_get_mempolicy,
                [0; 6],
                libc::ENOSYS,
            ),
            fails_with(
                "fanotify_init",
                libc::SYS_fanotify_init,
                [-1; 6],
                libc::ENOSYS,
            ),
        ])
    });
}

#[test]
fn refused_arguments_fail_with_eperm() {
    under_filters(|| {
        let mut checks = vec![
            // ADDR_NO_RANDOMIZE
            fails_with(
                "personality(ADDR_NO_RANDOMIZE)",
                libc::SYS_personality,
                [0x0040000, 0, 0, 0, 0, 0],
                libc::EPERM,
            ),
            fails_with(
                "socket(AF_VSOCK)",
                libc::SYS_socket,
                [
                    i64::from(libc::AF_VSOCK),
                    i64::from(libc::SOCK_STREAM),
                    0,
                    0,
                    0,
                    0,
                ],
                libc::EPERM,
            ),
        ];
        for (name, request) in REFUSED_IOCTLS {
            // On fd -1 the kernel would answer EBADF.
            checks.push(fails_with(
                name,
                libc::SYS_ioctl,
                [-1, *request as i64, 0, 0, 0, 0],
                libc::EPERM,
            ));
        }
        // The query form of personality is allowed.
        checks.push(
            match raw(libc::SYS_personality, [0xffff_ffff, 0, 0, 0, 0, 0]) {
                (r, 0) if r >= 0 => Ok(()),
                (r, e) => Err(format!("personality(0xffffffff): {r} ({})", errname(e))),
            },
        );
        all(checks)
    });
}

/// `int 0x80` getpid (i386 number 20).
#[cfg(target_arch = "x86_64")]
fn int80_getpid() -> i64 {
    let mut ret: i64 = 20;
    // SAFETY: the i386 system call gate: eax holds the number and gets the result. getpid
    // reads no other register; r8-r11 are declared clobbered for kernels that do not keep
    // them across this entry.
    unsafe {
        std::arch::asm!(
            "int 0x80",
            inlateout("rax") ret,
            out("r8") _,
            out("r9") _,
            out("r10") _,
            out("r11") _,
            options(nostack)
        );
    }
    ret
}

#[cfg(target_arch = "x86_64")]
#[test]
fn an_i386_syscall_kills_the_process() {
    // Without the filter: a kernel without IA32 emulation answers int 0x80 with SIGSEGV,
    // and there is nothing to test.
    let (end, msg) = in_child(false, || {
        // SAFETY: getpid has no preconditions.
        let pid = i64::from(unsafe { libc::getpid() });
        let got = int80_getpid();
        if got == pid {
            Ok(())
        } else {
            Err(format!("int 0x80 getpid returned {got}, not {pid}"))
        }
    });
    if end == End::Signaled(libc::SIGSEGV) {
        eprintln!("skipped: this kernel has no IA32 emulation (int 0x80 raises SIGSEGV)");
        return;
    }
    assert_eq!(end, End::Exited(0), "{msg}");
    let (end, msg) = in_child(true, || {
        int80_getpid();
        Err("int 0x80 returned under the filter".into())
    });
    assert_eq!(end, End::Signaled(libc::SIGSYS), "{msg}");
}

fn spawn_true() -> Result<(), String> {
    let path = c"/bin/true";
    let argv = [path.as_ptr().cast_mut(), std::ptr::null_mut()];
    let envp = [std::ptr::null_mut()];
    let mut pid = 0;
    // SAFETY: NUL-terminated path and null-terminated argv/envp that outlive the call;
    // `pid` is a valid out pointer.
    let rc = unsafe {
        libc::posix_spawn(
            &mut pid,
            path.as_ptr(),
            std::ptr::null(),
            std::ptr::null(),
            argv.as_ptr(),
            envp.as_ptr(),
        )
    };
    if rc != 0 {
        return Err(format!(
            "posix_spawn: {}",
            std::io::Error::from_raw_os_error(rc)
        ));
    }
    match wait(pid) {
        End::Exited(0) => Ok(()),
        end => Err(format!("posix_spawn'd /bin/true ended with {end:?}")),
    }
}

/// fork, then `then` in the new process, which exits with its result (0 for `Ok`).
fn in_grandchild(what: &str, then: impl FnOnce() -> bool) -> Result<(), String> {
    // SAFETY: the new process runs `then` and leaves with `_exit`.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(format!(
            "fork for {what}: {}",
            std::io::Error::last_os_error()
        ));
    }
    if pid == 0 {
        let ok = then();
        // SAFETY: ends the process without returning into the caller.
        unsafe { libc::_exit(if ok { 0 } else { 1 }) };
    }
    match wait(pid) {
        End::Exited(0) => Ok(()),
        end => Err(format!("{what}: {end:?}")),
    }
}

#[test]
fn processes_threads_signals_and_users_work() {
    under_filters(|| {
        let mut checks = Vec::new();
        // SAFETY: getpid and getppid have no preconditions.
        checks.push(check("getpid", unsafe { libc::getpid() } > 0));
        // SAFETY: as above.
        checks.push(check("getppid", unsafe { libc::getppid() } > 0));
        // fork + execve, as a shell does.
        checks.push(in_grandchild("fork + execve /bin/true", || {
            let path = c"/bin/true";
            let argv = [path.as_ptr(), std::ptr::null()];
            let envp = [std::ptr::null()];
            // SAFETY: valid NUL-terminated arrays; returns only on failure.
            unsafe { libc::execve(path.as_ptr(), argv.as_ptr(), envp.as_ptr()) };
            false
        }));
        // posix_spawn, as std::process does: glibc tries clone3, gets ENOSYS, uses clone.
        checks.push(spawn_true());
        checks.push(
            match std::process::Command::new("/bin/sh")
                .args([
                    "-c",
                    // A shell pipeline of coreutils, ending with a code of its own.
                    r#"d=$(mktemp -d) && echo hi > "$d/f" && cat "$d/f" | grep -q hi \
                       && ls -la "$d" > /dev/null && rm -r "$d" && exit 7"#,
                ])
                .status()
            {
                Ok(s) if s.code() == Some(7) => Ok(()),
                other => Err(format!("std::process::Command: {other:?}")),
            },
        );
        // Threads: pthread_create takes the same clone3 → clone fallback.
        checks.push(match std::thread::spawn(|| 6 * 7).join() {
            Ok(42) => Ok(()),
            other => Err(format!("thread: {other:?}")),
        });
        // pidfd_open / pidfd_send_signal / waitid(P_PIDFD), as the agent kills processes.
        checks.push((|| {
            // SAFETY: the new process only waits for a signal.
            let pid = unsafe { libc::fork() };
            if pid == 0 {
                loop {
                    // SAFETY: pause has no preconditions.
                    unsafe { libc::pause() };
                }
            }
            let (fd, e) = raw(libc::SYS_pidfd_open, [i64::from(pid), 0, 0, 0, 0, 0]);
            if fd < 0 {
                // SAFETY: kills our own child.
                unsafe { libc::kill(pid, libc::SIGKILL) };
                wait(pid);
                return Err(format!("pidfd_open: {}", errname(e)));
            }
            let sig = i64::from(libc::SIGKILL);
            let (r, e) = raw(libc::SYS_pidfd_send_signal, [fd, sig, 0, 0, 0, 0]);
            if r != 0 {
                return Err(format!("pidfd_send_signal: {}", errname(e)));
            }
            // SAFETY: all-zero is a valid siginfo_t.
            let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
            // SAFETY: `fd` is the pidfd opened above; `info` is a valid out pointer.
            let r =
                unsafe { libc::waitid(libc::P_PIDFD, fd as libc::id_t, &mut info, libc::WEXITED) };
            // SAFETY: closes the pidfd once.
            unsafe { libc::close(fd as i32) };
            if r != 0 || info.si_code != libc::CLD_KILLED {
                return Err(format!("waitid(P_PIDFD): {r}, si_code {}", info.si_code));
            }
            Ok(())
        })());
        // Signals: block, send to ourselves, take with sigtimedwait (as the agent's PID 1).
        checks.push((|| {
            // SAFETY: plain signal-set manipulation on valid, initialized sets.
            unsafe {
                let mut set: libc::sigset_t = std::mem::zeroed();
                libc::sigemptyset(&mut set);
                libc::sigaddset(&mut set, libc::SIGUSR1);
                if libc::sigprocmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) != 0 {
                    return Err("sigprocmask".to_string());
                }
                if libc::kill(libc::getpid(), libc::SIGUSR1) != 0 {
                    return Err("kill".to_string());
                }
                let ts = libc::timespec {
                    tv_sec: 5,
                    tv_nsec: 0,
                };
                let sig = libc::sigtimedwait(&set, std::ptr::null_mut(), &ts);
                if sig != libc::SIGUSR1 {
                    return Err(format!("sigtimedwait: {sig} ({})", errname(errno())));
                }
            }
            Ok(())
        })());
        // prctl, and the no_new_privs our install set.
        // SAFETY: PR_SET_NAME reads a NUL-terminated name of at most 16 bytes.
        let named = unsafe { libc::prctl(libc::PR_SET_NAME, c"probe".as_ptr()) } == 0;
        checks.push(check("prctl(PR_SET_NAME)", named));
        // SAFETY: PR_GET_NO_NEW_PRIVS takes no pointer.
        let nnp = unsafe { libc::prctl(libc::PR_GET_NO_NEW_PRIVS, 0, 0, 0, 0) };
        checks.push(check("prctl(PR_GET_NO_NEW_PRIVS) == 1", nnp == 1));
        // Process groups and sessions, as the agent's process service.
        checks.push(in_grandchild("setpgid", || {
            // SAFETY: plain integer arguments.
            unsafe { libc::setpgid(0, 0) == 0 }
        }));
        checks.push(in_grandchild("setsid", || {
            // SAFETY: setsid has no arguments.
            unsafe { libc::setsid() > 0 }
        }));
        // Running a command as another user, as the agent does (needs root to begin with).
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } == 0 {
            checks.push(in_grandchild("setgroups + setgid + setuid", || {
                let groups = [65534 as libc::gid_t];
                // SAFETY: `groups` outlives the call; plain integer ids otherwise.
                unsafe {
                    libc::setgroups(1, groups.as_ptr()) == 0
                        && libc::setgid(65534) == 0
                        && libc::setuid(65534) == 0
                        && libc::getuid() == 65534
                }
            }));
        }
        all(checks)
    });
}

fn temp_dir(tag: &str) -> std::path::PathBuf {
    // SAFETY: getpid has no preconditions.
    let pid = unsafe { libc::getpid() };
    let dir = std::env::temp_dir().join(format!("agentenv-seccomp-{tag}-{pid}"));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn files_and_zero_copy_transfers_work() {
    let dir = temp_dir("files");
    let d = dir.clone();
    under_filters(move || {
        let a = d.join("a");
        std::fs::write(&a, b"hello world").map_err(io("write"))?;
        std::fs::rename(&a, d.join("b")).map_err(io("rename"))?;
        std::os::unix::fs::symlink("b", d.join("s")).map_err(io("symlink"))?;
        std::fs::hard_link(d.join("b"), d.join("h")).map_err(io("link"))?;
        let via_link = std::fs::read(d.join("s")).map_err(io("read via symlink"))?;
        if via_link != b"hello world" {
            return Err("read back the wrong bytes".into());
        }
        let names = std::fs::read_dir(&d).map_err(io("read_dir"))?.count();
        if names != 3 {
            return Err(format!("read_dir saw {names} entries"));
        }
        std::fs::metadata(d.join("s")).map_err(io("stat"))?;
        std::fs::symlink_metadata(d.join("s")).map_err(io("lstat"))?;
        let b = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(d.join("b"))
            .map_err(io("open"))?;
        let fd = b.as_raw_fd();
        let mut checks = Vec::new();
        // SAFETY: fd is open; plain integer arguments.
        checks.push(check(
            "fallocate",
            unsafe { libc::fallocate(fd, 0, 0, 4096) } == 0,
        ));
        // copy_file_range into a second file.
        let c = std::fs::File::create(d.join("c")).map_err(io("create"))?;
        let n = raw(
            libc::SYS_copy_file_range,
            [i64::from(fd), 0, i64::from(c.as_raw_fd()), 0, 11, 0],
        );
        checks.push(check("copy_file_range", n.0 == 11));
        // sendfile from the file into a pipe, splice from the pipe into a third file.
        let mut p = [0; 2];
        // SAFETY: `p` has room for two descriptors.
        checks.push(check(
            "pipe2",
            unsafe { libc::pipe2(p.as_mut_ptr(), libc::O_CLOEXEC) } == 0,
        ));
        // SAFETY: both descriptors were just returned by pipe2.
        let (pr, pw) = unsafe { (OwnedFd::from_raw_fd(p[0]), OwnedFd::from_raw_fd(p[1])) };
        let mut off: libc::off_t = 0;
        // SAFETY: valid descriptors and a valid offset pointer.
        let sent = unsafe { libc::sendfile(pw.as_raw_fd(), fd, &mut off, 11) };
        checks.push(check("sendfile", sent == 11));
        let e = std::fs::File::create(d.join("e")).map_err(io("create"))?;
        // SAFETY: valid descriptors; null offsets use the file positions.
        let spliced = unsafe {
            libc::splice(
                pr.as_raw_fd(),
                std::ptr::null_mut(),
                e.as_raw_fd(),
                std::ptr::null_mut(),
                11,
                0,
            )
        };
        checks.push(check("splice", spliced == 11));
        checks.push(check(
            "spliced bytes",
            std::fs::read(d.join("e")).ok().as_deref() == Some(b"hello world".as_slice()),
        ));
        // inotify, as the agent's directory watch.
        // SAFETY: plain flags.
        let ino = unsafe { libc::inotify_init1(libc::IN_CLOEXEC | libc::IN_NONBLOCK) };
        checks.push(check("inotify_init1", ino >= 0));
        let cdir = std::ffi::CString::new(d.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: `ino` is an inotify descriptor, `cdir` a NUL-terminated path.
        let wd = unsafe { libc::inotify_add_watch(ino, cdir.as_ptr(), libc::IN_CREATE) };
        checks.push(check("inotify_add_watch", wd >= 0));
        std::fs::write(d.join("new"), b"").map_err(io("write"))?;
        let mut buf = [0u8; 512];
        // SAFETY: reads into a buffer we own.
        let got = unsafe { libc::read(ino, buf.as_mut_ptr().cast(), buf.len()) };
        checks.push(check("inotify event", got > 0));
        // xattrs: the filesystem may not support user.* (ENOTSUP), but the filter must
        // let the call reach it.
        let path = std::ffi::CString::new(d.join("b").as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: NUL-terminated path and name, a buffer we own.
        let r = unsafe {
            libc::lgetxattr(
                path.as_ptr(),
                c"user.agentenv".as_ptr(),
                buf.as_mut_ptr().cast(),
                buf.len(),
            )
        };
        let e = errno();
        checks.push(check(
            "lgetxattr reaches the filesystem",
            r >= 0 || (e != libc::ENOSYS && e != libc::EPERM),
        ));
        // memfd, as interpreters' JITs and the agent's buffers.
        // SAFETY: NUL-terminated name.
        let m = unsafe { libc::memfd_create(c"probe".as_ptr(), libc::MFD_CLOEXEC) };
        checks.push(check("memfd_create", m >= 0));
        // SAFETY: plain integer arguments.
        checks.push(check("ftruncate", unsafe { libc::ftruncate(m, 4096) } == 0));
        std::fs::remove_dir_all(&d).map_err(io("remove_dir_all"))?;
        all(checks)
    });
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn sockets_work() {
    under_filters(|| {
        use std::io::Write;
        // A server binding a port on loopback, and a client.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").map_err(io("bind"))?;
        let addr = listener.local_addr().map_err(io("getsockname"))?;
        let mut client = std::net::TcpStream::connect(addr).map_err(io("connect"))?;
        client.set_nodelay(true).map_err(io("TCP_NODELAY"))?;
        let (mut server, _) = listener.accept().map_err(io("accept"))?;
        client.write_all(b"ping").map_err(io("send"))?;
        let mut buf = [0u8; 4];
        server.read_exact(&mut buf).map_err(io("recv"))?;
        if &buf != b"ping" {
            return Err("wrong bytes over TCP".into());
        }
        let udp = std::net::UdpSocket::bind("127.0.0.1:0").map_err(io("udp bind"))?;
        udp.send_to(b"x", udp.local_addr().map_err(io("udp addr"))?)
            .map_err(io("udp send"))?;
        let (a, mut b) = std::os::unix::net::UnixStream::pair().map_err(io("socketpair"))?;
        (&a).write_all(b"u").map_err(io("unix send"))?;
        let mut one = [0u8; 1];
        b.read_exact(&mut one).map_err(io("unix recv"))?;
        a.set_nonblocking(true).map_err(io("FIONBIO"))?;
        Ok(())
    });
}

#[test]
fn ptys_work() {
    under_filters(|| {
        // SAFETY: plain flags.
        let master = unsafe { libc::posix_openpt(libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC) };
        check("posix_openpt", master >= 0)?;
        // SAFETY: `master` is a pty master.
        check("grantpt", unsafe { libc::grantpt(master) } == 0)?;
        // SAFETY: as above.
        check("unlockpt", unsafe { libc::unlockpt(master) } == 0)?;
        let mut name = [0 as libc::c_char; 64];
        // SAFETY: `name` is a buffer of the given length.
        let named = unsafe { libc::ptsname_r(master, name.as_mut_ptr(), name.len()) };
        check("ptsname_r", named == 0)?;
        let ws = libc::winsize {
            ws_row: 24,
            ws_col: 80,
            ws_xpixel: 0,
            ws_ypixel: 0,
        };
        // SAFETY: TIOCSWINSZ reads a winsize we own.
        let sized = unsafe { libc::ioctl(master, libc::TIOCSWINSZ, &ws) };
        check("TIOCSWINSZ", sized == 0)?;
        // The agent's pty child: new session, the pty as controlling terminal, output.
        let child = in_grandchild("setsid + TIOCSCTTY", || {
            // SAFETY: `name` holds the NUL-terminated slave path; plain integer arguments.
            unsafe {
                let slave = libc::open(name.as_ptr(), libc::O_RDWR);
                slave >= 0
                    && libc::setsid() > 0
                    && libc::ioctl(slave, libc::TIOCSCTTY as _, 0) == 0
                    && libc::write(slave, b"hi\n".as_ptr().cast(), 3) == 3
            }
        });
        child?;
        let mut buf = [0u8; 16];
        // SAFETY: reads into a buffer we own.
        let n = unsafe { libc::read(master, buf.as_mut_ptr().cast(), buf.len()) };
        check("read from the master", n > 0)?;
        let slave_name = CStr::from_bytes_until_nul(
            // SAFETY: c_char and u8 have the same layout.
            unsafe { std::slice::from_raw_parts(name.as_ptr().cast::<u8>(), name.len()) },
        )
        .map_err(|e| e.to_string())?;
        if !slave_name.to_bytes().starts_with(b"/dev/pts/") {
            return Err(format!("slave at {slave_name:?}"));
        }
        Ok(())
    });
}

#[test]
fn event_loops_and_clocks_work() {
    under_filters(|| {
        // SAFETY: plain syscalls on descriptors created here, with buffers we own.
        unsafe {
            let ep = libc::epoll_create1(libc::EPOLL_CLOEXEC);
            check("epoll_create1", ep >= 0)?;
            let ev = libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK);
            check("eventfd", ev >= 0)?;
            let mut event = libc::epoll_event {
                events: libc::EPOLLIN as u32,
                u64: 7,
            };
            check(
                "epoll_ctl",
                libc::epoll_ctl(ep, libc::EPOLL_CTL_ADD, ev, &mut event) == 0,
            )?;
            let one: u64 = 1;
            check(
                "eventfd write",
                libc::write(ev, (&one as *const u64).cast(), 8) == 8,
            )?;
            let mut out = [libc::epoll_event { events: 0, u64: 0 }; 4];
            check(
                "epoll_wait",
                libc::epoll_wait(ep, out.as_mut_ptr(), 4, 1000) == 1,
            )?;
            let tfd = libc::timerfd_create(libc::CLOCK_MONOTONIC, libc::TFD_CLOEXEC);
            check("timerfd_create", tfd >= 0)?;
            let mut ts: libc::timespec = std::mem::zeroed();
            check(
                "clock_gettime",
                libc::clock_gettime(libc::CLOCK_REALTIME, &mut ts) == 0,
            )?;
            let zero = libc::timespec {
                tv_sec: 0,
                tv_nsec: 1000,
            };
            check(
                "nanosleep",
                libc::nanosleep(&zero, std::ptr::null_mut()) == 0,
            )?;
            let mut buf = [0u8; 16];
            check(
                "getrandom",
                libc::getrandom(buf.as_mut_ptr().cast(), 16, 0) == 16,
            )?;
            let mut uts: libc::utsname = std::mem::zeroed();
            check("uname", libc::uname(&mut uts) == 0)?;
            let mut pfd = libc::pollfd {
                fd: ev,
                events: libc::POLLIN,
                revents: 0,
            };
            check("poll", libc::poll(&mut pfd, 1, 0) == 1)?;
        }
        check(
            "available_parallelism",
            std::thread::available_parallelism().is_ok(),
        )
    });
}
