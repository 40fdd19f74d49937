//! Mounts and namespaces: mount (old and new API), remounting read-only kernel
//! interfaces writable, unmounting masks, pivot_root, new user and mount namespaces
//! (unshare, clone, clone3), setns, and the classic chroot breakout.

use crate::sys::{self, Fd, SysResult};
use crate::{Attempt, Config, Outcome, sigsys_is_contained};

const MNT_DIR: &str = "/tmp/.attack-mnt";

/// `FSOPEN_CLOEXEC`, `OPEN_TREE_CLONE`.
const FSOPEN_CLOEXEC: libc::c_long = 1;
const OPEN_TREE_CLONE: libc::c_long = 1;

fn mount(
    src: Option<&str>,
    target: &str,
    fstype: Option<&str>,
    flags: libc::c_ulong,
    data: Option<&str>,
) -> Result<(), i32> {
    let (s, t, f, d) = (
        src.map(sys::cstr),
        sys::cstr(target),
        fstype.map(sys::cstr),
        data.map(sys::cstr),
    );
    let p = |c: &Option<std::ffi::CString>| c.as_ref().map_or(std::ptr::null(), |c| c.as_ptr());
    // SAFETY: every pointer is null or a NUL-terminated string that outlives the call.
    let r = unsafe { libc::mount(p(&s), t.as_ptr(), p(&f), flags, p(&d).cast()) };
    if r < 0 { Err(sys::errno()) } else { Ok(()) }
}

fn umount(target: &str) -> Result<(), i32> {
    let t = sys::cstr(target);
    // SAFETY: `t` is a NUL-terminated path that outlives the call.
    let r = unsafe { libc::umount2(t.as_ptr(), libc::MNT_DETACH) };
    if r < 0 { Err(sys::errno()) } else { Ok(()) }
}

/// EPERM/EACCES/ENOSYS (and ENOSPC for new user namespaces) are refusals.
fn refused(what: &str, e: i32) -> Outcome {
    match e {
        libc::EPERM | libc::EACCES | libc::ENOSYS | libc::ENOSPC => {
            Outcome::contained(format!("{what} refused: {}", sys::ename(e)))
        }
        _ => Outcome::inconclusive(format!("{what}: {}", sys::ename(e))),
    }
}

fn mnt_dir() -> String {
    let _ = std::fs::create_dir_all(MNT_DIR);
    MNT_DIR.to_string()
}

fn try_mount(
    what: &str,
    src: Option<&str>,
    fstype: Option<&str>,
    flags: libc::c_ulong,
    data: Option<&str>,
) -> Outcome {
    let dir = mnt_dir();
    match mount(src, &dir, fstype, flags, data) {
        Ok(()) => {
            let _ = umount(&dir);
            Outcome::escaped(format!("{what} succeeded (unmounted again)"))
        }
        Err(e) => refused(what, e),
    }
}

pub fn attempts(_cfg: &Config) -> Vec<Attempt> {
    let cleanup = || {
        let _ = umount(MNT_DIR);
        let _ = std::fs::remove_dir(MNT_DIR);
    };
    vec![
        Attempt::new("mount-tmpfs", |_| {
            try_mount("mount tmpfs", Some("tmpfs"), Some("tmpfs"), 0, None)
        })
        .on_signal(sigsys_is_contained)
        .cleanup(cleanup),
        Attempt::new("mount-proc", |_| {
            try_mount("mount proc", Some("proc"), Some("proc"), 0, None)
        })
        .on_signal(sigsys_is_contained)
        .cleanup(cleanup),
        Attempt::new("mount-bind-root", |_| {
            try_mount(
                "bind mount of /",
                Some("/"),
                None,
                libc::MS_BIND | libc::MS_REC,
                None,
            )
        })
        .on_signal(sigsys_is_contained)
        .cleanup(cleanup),
        Attempt::new("mount-cgroup", |_| {
            try_mount(
                "mount cgroup (v1 memory, release_agent)",
                Some("cgroup"),
                Some("cgroup"),
                0,
                Some("memory"),
            )
        })
        .on_signal(sigsys_is_contained)
        .cleanup(cleanup),
        Attempt::new("remount-proc-sys-rw", |_| remount_rw("/proc/sys"))
            .on_signal(sigsys_is_contained),
        Attempt::new("remount-sys-rw", |_| remount_rw("/sys")).on_signal(sigsys_is_contained),
        Attempt::new("pivot-root", |_| pivot_root()).on_signal(sigsys_is_contained),
        Attempt::new("fsopen", |_| {
            let fs = sys::cstr("tmpfs");
            fd_result(
                "fsopen(\"tmpfs\")",
                sys::raw_syscall(
                    libc::SYS_fsopen,
                    [fs.as_ptr() as libc::c_long, FSOPEN_CLOEXEC, 0, 0, 0, 0],
                ),
            )
        })
        .on_signal(sigsys_is_contained),
        Attempt::new("open-tree-clone", |_| {
            let root = sys::cstr("/");
            fd_result(
                "open_tree(\"/\", OPEN_TREE_CLONE|AT_RECURSIVE)",
                sys::raw_syscall(
                    libc::SYS_open_tree,
                    [
                        libc::AT_FDCWD as libc::c_long,
                        root.as_ptr() as libc::c_long,
                        OPEN_TREE_CLONE | libc::AT_RECURSIVE as libc::c_long,
                        0,
                        0,
                        0,
                    ],
                ),
            )
        })
        .on_signal(sigsys_is_contained),
        Attempt::new("unshare-newns", |_| {
            // SAFETY: unshare takes no pointers; it affects this child only.
            if unsafe { libc::unshare(libc::CLONE_NEWNS) } == 0 {
                Outcome::escaped("unshare(CLONE_NEWNS) succeeded")
            } else {
                refused("unshare(CLONE_NEWNS)", sys::errno())
            }
        })
        .on_signal(sigsys_is_contained),
        Attempt::new("unshare-other-ns", |_| unshare_others()).on_signal(sigsys_is_contained),
        Attempt::new("setns-mnt", |_| {
            setns("/proc/self/ns/mnt", libc::CLONE_NEWNS)
        })
        .on_signal(sigsys_is_contained),
        Attempt::new("setns-net", |_| {
            setns("/proc/self/ns/net", libc::CLONE_NEWNET)
        })
        .on_signal(sigsys_is_contained),
        Attempt::new("clone-newuser", |_| clone_newuser()).on_signal(sigsys_is_contained),
        Attempt::new("clone3-newuser", |_| clone3_newuser()).on_signal(sigsys_is_contained),
        Attempt::new("userns-then-mount", |_| userns_then_mount())
            .on_signal(sigsys_is_contained)
            .cleanup(cleanup),
        Attempt::new("chroot-breakout", |_| chroot_breakout())
            .on_signal(sigsys_is_contained)
            .cleanup(|| {
                let _ = std::fs::remove_dir("/tmp/.attack-chroot");
            }),
    ]
}

/// Attempts that, if they succeed, change what later attempts see: run last.
pub fn unmount_attempts(_cfg: &Config) -> Vec<Attempt> {
    vec![
        Attempt::new("umount-proc-kcore-mask", |_| {
            unmount_mask("/proc/kcore", || {
                let _ = mount(Some("/dev/null"), "/proc/kcore", None, libc::MS_BIND, None);
            })
        })
        .on_signal(sigsys_is_contained),
        Attempt::new("umount-proc-sys-ro", |_| {
            unmount_mask("/proc/sys", || {
                let _ = mount(
                    Some("/proc/sys"),
                    "/proc/sys",
                    None,
                    libc::MS_BIND | libc::MS_REC,
                    None,
                );
                let _ = mount(
                    None,
                    "/proc/sys",
                    None,
                    libc::MS_BIND
                        | libc::MS_REMOUNT
                        | libc::MS_RDONLY
                        | libc::MS_NOSUID
                        | libc::MS_NODEV
                        | libc::MS_NOEXEC,
                    None,
                );
            })
        })
        .on_signal(sigsys_is_contained),
    ]
}

fn fd_result(what: &str, r: SysResult) -> Outcome {
    match r {
        Ok(fd) => {
            drop(Fd(fd as i32));
            Outcome::escaped(format!("{what} returned a descriptor"))
        }
        Err(e) => refused(what, e),
    }
}

fn remount_rw(path: &str) -> Outcome {
    // The topmost mount on `path` decides.
    let top = sys::mounts().into_iter().rev().find(|(p, _, _)| p == path);
    let mounted_ro = top
        .as_ref()
        .is_some_and(|(_, _, o)| o.split(',').any(|x| x == "ro"));
    if !mounted_ro {
        return Outcome::contained(format!(
            "nothing to remount: {path} is not a read-only mount here (writes to it are the write-* attempts)"
        ));
    }
    let flags =
        libc::MS_REMOUNT | libc::MS_BIND | libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC;
    match mount(None, path, None, flags, None) {
        Ok(()) => {
            let _ = mount(None, path, None, flags | libc::MS_RDONLY, None);
            Outcome::escaped(format!(
                "remounted {path} read-write (made read-only again)"
            ))
        }
        Err(e) => refused(&format!("remounting {path} read-write"), e),
    }
}

fn unmount_mask(path: &str, restore: impl Fn()) -> Outcome {
    let masked = sys::mounts().iter().any(|(p, _, _)| p == path);
    if !masked {
        return Outcome::contained(format!(
            "nothing is mounted on {path} to remove (what it shows is tried by the read-/write- attempts)"
        ));
    }
    match umount(path) {
        Ok(()) => {
            restore();
            Outcome::escaped(format!(
                "unmounted what covers {path} (the host's view underneath is exposed; covered again)"
            ))
        }
        Err(e) => refused(&format!("umount2 {path}"), e),
    }
}

fn pivot_root() -> Outcome {
    let new = "/tmp/.attack-pivot";
    let old = "/tmp/.attack-pivot/old";
    let _ = std::fs::create_dir_all(old);
    let (n, o) = (sys::cstr(new), sys::cstr(old));
    let r = sys::raw_syscall(
        libc::SYS_pivot_root,
        [
            n.as_ptr() as libc::c_long,
            o.as_ptr() as libc::c_long,
            0,
            0,
            0,
            0,
        ],
    );
    let _ = std::fs::remove_dir(old);
    let _ = std::fs::remove_dir(new);
    match r {
        Ok(_) => Outcome::escaped("pivot_root succeeded"),
        Err(e @ (libc::EPERM | libc::EACCES | libc::ENOSYS)) => refused("pivot_root", e),
        // The kernel checks CAP_SYS_ADMIN before the arguments: any other error means
        // the call got past the filter and the capability check.
        Err(e) => Outcome::escaped(format!(
            "pivot_root got past the filter and the capability check ({})",
            sys::ename(e)
        )),
    }
}

fn unshare_others() -> Outcome {
    let mut ok = Vec::new();
    let mut no = Vec::new();
    for (name, flag) in [
        ("CLONE_NEWNET", libc::CLONE_NEWNET),
        ("CLONE_NEWPID", libc::CLONE_NEWPID),
        ("CLONE_NEWUTS", libc::CLONE_NEWUTS),
        ("CLONE_NEWIPC", libc::CLONE_NEWIPC),
        ("CLONE_NEWCGROUP", libc::CLONE_NEWCGROUP),
        ("CLONE_NEWTIME", 0x80),
    ] {
        // SAFETY: unshare takes no pointers; it affects this child only.
        if unsafe { libc::unshare(flag) } == 0 {
            ok.push(name);
        } else {
            let e = sys::errno();
            if !matches!(e, libc::EPERM | libc::ENOSYS | libc::EACCES) {
                return Outcome::inconclusive(format!("unshare({name}): {}", sys::ename(e)));
            }
            no.push(format!("{name}: {}", sys::ename(e)));
        }
    }
    if ok.is_empty() {
        Outcome::contained(format!("refused: {}", no.join(", ")))
    } else {
        Outcome::escaped(format!("unshare succeeded for {}", ok.join(", ")))
    }
}

/// Joining a namespace needs CAP_SYS_ADMIN over it, even the caller's own: refused
/// means the capability or the call is gone.
fn setns(path: &str, kind: i32) -> Outcome {
    let fd = match sys::open(path, libc::O_RDONLY) {
        Ok(fd) => fd,
        Err(e) => return refused(&format!("open {path}"), e),
    };
    // SAFETY: setns takes a descriptor `fd` keeps open; it affects this child only.
    if unsafe { libc::setns(fd.0, kind) } == 0 {
        return Outcome::escaped(format!("setns({path}) succeeded"));
    }
    refused(&format!("setns({path})"), sys::errno())
}

fn clone_newuser() -> Outcome {
    let flags = (libc::CLONE_NEWUSER | libc::SIGCHLD) as libc::c_long;
    // A fork-like clone: no new stack, no shared memory.
    match sys::raw_syscall(libc::SYS_clone, [flags, 0, 0, 0, 0, 0]) {
        Ok(0) => {
            // SAFETY: the clone child leaves at once.
            unsafe { libc::_exit(0) }
        }
        Ok(pid) => {
            let _ = sys::wait(pid as i32);
            Outcome::escaped("clone(CLONE_NEWUSER) made a process in a new user namespace")
        }
        Err(e) => refused("clone(CLONE_NEWUSER)", e),
    }
}

fn clone3_newuser() -> Outcome {
    // struct clone_args: flags, pidfd, child_tid, parent_tid, exit_signal, stack,
    // stack_size, tls, set_tid, set_tid_size, cgroup.
    let mut args = [0u64; 11];
    args[0] = libc::CLONE_NEWUSER as u64;
    args[4] = libc::SIGCHLD as u64;
    match sys::raw_syscall(
        libc::SYS_clone3,
        [args.as_mut_ptr() as libc::c_long, 88, 0, 0, 0, 0],
    ) {
        Ok(0) => {
            // SAFETY: the clone child leaves at once.
            unsafe { libc::_exit(0) }
        }
        Ok(pid) => {
            let _ = sys::wait(pid as i32);
            Outcome::escaped("clone3(CLONE_NEWUSER) made a process in a new user namespace")
        }
        Err(e) => refused("clone3(CLONE_NEWUSER)", e),
    }
}

fn userns_then_mount() -> Outcome {
    // SAFETY: unshare takes no pointers; it affects this child only.
    if unsafe { libc::unshare(libc::CLONE_NEWUSER) } != 0 {
        return refused("unshare(CLONE_NEWUSER)", sys::errno());
    }
    // SAFETY: as above.
    if unsafe { libc::unshare(libc::CLONE_NEWNS) } != 0 {
        return Outcome::escaped(format!(
            "entered a new user namespace; unshare(CLONE_NEWNS) in it failed: {}",
            sys::ename(sys::errno())
        ));
    }
    let dir = mnt_dir();
    match mount(Some("tmpfs"), &dir, Some("tmpfs"), 0, None) {
        Ok(()) => Outcome::escaped(
            "entered a new user namespace, then a mount namespace, and mounted a tmpfs there",
        ),
        Err(e) => Outcome::escaped(format!(
            "entered new user and mount namespaces; mount failed: {}",
            sys::ename(e)
        )),
    }
}

fn root_id() -> Option<(u64, u64)> {
    sys::lstat("/").ok().map(|s| (s.st_dev, s.st_ino))
}

fn chroot_breakout() -> Outcome {
    let Some(before) = root_id() else {
        return Outcome::inconclusive("cannot stat /");
    };
    let jail = "/tmp/.attack-chroot";
    let _ = std::fs::create_dir_all(jail);
    let j = sys::cstr(jail);
    // SAFETY: `j` is a NUL-terminated path that outlives the call.
    if unsafe { libc::chroot(j.as_ptr()) } != 0 {
        return refused("chroot", sys::errno());
    }
    // The working directory is outside the new root: walk up from it.
    let up = sys::cstr("..");
    for _ in 0..64 {
        // SAFETY: `up` is a NUL-terminated path that outlives the call.
        unsafe { libc::chdir(up.as_ptr()) };
    }
    let dot = sys::cstr(".");
    // SAFETY: `dot` is a NUL-terminated path that outlives the call.
    if unsafe { libc::chroot(dot.as_ptr()) } != 0 {
        return refused("chroot(\".\") after climbing", sys::errno());
    }
    match root_id() {
        Some(after) if after == before => Outcome::contained(
            "chroot + chdir(\"..\") climbs back to the sandbox's own root and no further",
        ),
        Some(after) => {
            let entries: Vec<String> = std::fs::read_dir("/")
                .map(|rd| {
                    rd.flatten()
                        .take(12)
                        .map(|e| e.file_name().to_string_lossy().into_owned())
                        .collect()
                })
                .unwrap_or_default();
            Outcome::escaped(format!(
                "climbed above the sandbox root to {after:?} (was {before:?}): {}",
                entries.join(" ")
            ))
        }
        None => Outcome::inconclusive("cannot stat / after the breakout"),
    }
}
