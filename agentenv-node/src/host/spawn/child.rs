//! The child's side of [`spawn`](super::spawn): what runs in the cloned process, with
//! only system calls (no allocation, no locks). It runs the plan's mount steps, joins the
//! network namespace and cgroups, pivots into the root, sets limits, drops capabilities,
//! becomes the sandbox's user, installs the seccomp filters and execs the program; a
//! failure is a `(step, errno)` pair, the steps numbered here.

use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

use caps::CapSet;
use nix::errno::Errno;
use nix::mount::MntFlags;
use nix::sched::CloneFlags;
use nix::sys::stat::{Mode, SFlag};

use super::{Become, ChildPlan, Op};

/// Failure record sent through the pipe: step index and errno.
const SETUP_STEPS: &[&str] = &[
    "join the network namespace",
    "join the cgroups",
    "create the cgroup namespace",
    "set the hostname",
    "enter the root",
    "pivot_root",
    "detach the old root",
    "redirect standard streams",
    "drop capabilities",
    "set no_new_privs",
    "install the seccomp filter",
    "exec the program",
    "reset signals",
    "enter the user namespace",
    "switch to the sandbox user",
    "set resource limits",
    "make the program's listening socket",
];
const S_NETNS: u32 = 0;
const S_CGROUP: u32 = 1;
const S_CGROUPNS: u32 = 2;
const S_HOSTNAME: u32 = 3;
const S_CHDIR: u32 = 4;
const S_PIVOT: u32 = 5;
const S_UMOUNT: u32 = 6;
const S_STDIO: u32 = 7;
const S_CAPS: u32 = 8;
const S_NNP: u32 = 9;
const S_SECCOMP: u32 = 10;
const S_EXEC: u32 = 11;
const S_SIGNALS: u32 = 12;
const S_USERNS: u32 = 13;
const S_SETID: u32 = 14;
const S_RLIMIT: u32 = 15;
const S_LISTEN: u32 = 16;
/// Mount steps are numbered after the fixed ones.
const S_MOUNT_BASE: u32 = 100;

fn errno_of<T>(r: Result<T, Errno>, step: u32) -> Result<T, (u32, Errno)> {
    r.map_err(|e| (step, e))
}

/// The child's side. Only system calls; returns only on failure.
pub(super) fn child_main(plan: &ChildPlan) -> (u32, Errno) {
    match child_setup(plan) {
        Ok(never) => match never {},
        Err(e) => e,
    }
}

enum Never {}

fn child_setup(plan: &ChildPlan) -> Result<Never, (u32, Errno)> {
    use nix::sys::signal::{SigHandler, SigSet, SigmaskHow, Signal, signal, sigprocmask};
    errno_of(
        sigprocmask(SigmaskHow::SIG_SETMASK, Some(&SigSet::empty()), None),
        S_SIGNALS,
    )?;
    for sig in [
        Signal::SIGPIPE,
        Signal::SIGCHLD,
        Signal::SIGINT,
        Signal::SIGTERM,
        Signal::SIGHUP,
    ] {
        // SAFETY: SIG_DFL installs no handler.
        errno_of(unsafe { signal(sig, SigHandler::SigDfl) }, S_SIGNALS)?;
    }
    // Setup makes files with exactly the modes it asks for; the program gets the plan's.
    nix::sys::stat::umask(Mode::empty());
    // SAFETY: the descriptor belongs to the plan's owner, which outlives the child's setup.
    let netns = unsafe { BorrowedFd::borrow_raw(plan.netns) };
    errno_of(nix::sched::setns(netns, CloneFlags::CLONE_NEWNET), S_NETNS)?;
    for (i, step) in plan.steps.iter().enumerate() {
        let idx = S_MOUNT_BASE + i as u32;
        let r = match &step.op {
            Op::Mount {
                src,
                target,
                fstype,
                flags,
                data,
            } => nix::mount::mount(
                src.as_deref(),
                target.as_c_str(),
                fstype.as_deref(),
                *flags,
                data.as_deref(),
            ),
            Op::IdmapBind {
                src,
                target,
                userns,
            } => idmap_bind(src, target, *userns),
            Op::VolumeBind {
                src,
                root,
                components,
                owner,
                userns,
            } => volume_bind(src, root, components, *owner, *userns),
            Op::Mkdir { path, mode } => {
                nix::unistd::mkdir(path.as_c_str(), Mode::from_bits_truncate(*mode))
            }
            Op::Touch { path } => nix::fcntl::open(
                path.as_c_str(),
                nix::fcntl::OFlag::O_WRONLY
                    | nix::fcntl::OFlag::O_CREAT
                    | nix::fcntl::OFlag::O_EXCL
                    | nix::fcntl::OFlag::O_NOFOLLOW
                    | nix::fcntl::OFlag::O_CLOEXEC,
                Mode::empty(),
            )
            .map(drop),
            Op::Mknod { path, major, minor } => nix::sys::stat::mknod(
                path.as_c_str(),
                SFlag::S_IFCHR,
                Mode::from_bits_truncate(0o600),
                nix::sys::stat::makedev(*major, *minor),
            ),
            Op::Chown { path, uid, gid } => nix::unistd::fchownat(
                nix::fcntl::AT_FDCWD,
                path.as_c_str(),
                Some(nix::unistd::Uid::from_raw(*uid)),
                Some(nix::unistd::Gid::from_raw(*gid)),
                nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
            ),
            Op::Symlink { target, link } => {
                nix::unistd::symlinkat(target.as_c_str(), nix::fcntl::AT_FDCWD, link.as_c_str())
            }
        };
        match r {
            Ok(()) => {}
            Err(Errno::ENOENT) if step.optional => {}
            Err(e) => return Err((idx, e)),
        }
    }
    // The cgroups are joined once the root is built: from then on their device
    // allow-list applies (the setup itself may make the few device nodes a jail needs).
    for procs in &plan.cgroup_procs {
        let fd = errno_of(
            nix::fcntl::open(
                procs.as_c_str(),
                nix::fcntl::OFlag::O_WRONLY | nix::fcntl::OFlag::O_CLOEXEC,
                Mode::empty(),
            ),
            S_CGROUP,
        )?;
        errno_of(nix::unistd::write(&fd, b"0"), S_CGROUP)?;
    }
    errno_of(nix::sched::unshare(CloneFlags::CLONE_NEWCGROUP), S_CGROUPNS)?;
    errno_of(
        nix::unistd::sethostname(plan.hostname.as_c_str().to_bytes_as_os_str()),
        S_HOSTNAME,
    )?;
    errno_of(nix::unistd::chdir(plan.root.as_c_str()), S_CHDIR)?;
    errno_of(nix::unistd::pivot_root(".", "."), S_PIVOT)?;
    errno_of(nix::mount::umount2(".", MntFlags::MNT_DETACH), S_UMOUNT)?;
    errno_of(nix::unistd::chdir("/"), S_CHDIR)?;

    // stdin from /dev/null, stdout and stderr to the log; every other descriptor closes
    // on exec (but the program's listening socket, made after this).
    let null = errno_of(
        nix::fcntl::open(c"/dev/null", nix::fcntl::OFlag::O_RDONLY, Mode::empty()),
        S_STDIO,
    )?;
    // SAFETY: plain descriptor numbers; dup2 onto 0..2 replaces the standard streams.
    unsafe {
        if libc::dup2(null.as_raw_fd(), 0) < 0
            || libc::dup2(plan.log_fd, 1) < 0
            || libc::dup2(plan.log_fd, 2) < 0
        {
            return Err((S_STDIO, Errno::last()));
        }
    }
    drop(null);
    // SAFETY: close_range with CLOSE_RANGE_CLOEXEC only sets flags on descriptors >= 3.
    if unsafe {
        libc::syscall(
            libc::SYS_close_range,
            3u32,
            u32::MAX,
            libc::CLOSE_RANGE_CLOEXEC,
        )
    } < 0
    {
        return Err((S_STDIO, Errno::last()));
    }
    if let Some(l) = &plan.listen {
        listen(&l.addr, l.slot.as_raw_fd()).map_err(|e| (S_LISTEN, e))?;
    }

    for (resource, limit) in &plan.rlimits {
        // SAFETY: setrlimit reads one rlimit struct owned by the plan.
        if unsafe { libc::setrlimit(*resource, limit) } != 0 {
            return Err((S_RLIMIT, Errno::last()));
        }
    }
    // The capability bounding set shrinks while this process holds CAP_SETPCAP: in the
    // user namespace (entering one resets the set to full), or before giving up root.
    match plan.user {
        Become::UserNs(userns) => {
            // SAFETY: the descriptor belongs to the plan's owner, alive during setup.
            let fd = unsafe { BorrowedFd::borrow_raw(userns) };
            errno_of(nix::sched::setns(fd, CloneFlags::CLONE_NEWUSER), S_USERNS)?;
            // Root of the namespace: uid and gid 0 inside, no supplementary groups.
            set_ids(0, 0)?;
            drop_bounding(plan)?;
        }
        Become::Unprivileged { uid, gid } => {
            drop_bounding(plan)?;
            set_ids(uid, gid)?;
        }
    }
    caps::clear(None, CapSet::Inheritable).map_err(|_| (S_CAPS, Errno::last()))?;
    caps::clear(None, CapSet::Ambient).map_err(|_| (S_CAPS, Errno::last()))?;
    caps::set(None, CapSet::Effective, &plan.keep_caps).map_err(|_| (S_CAPS, Errno::last()))?;
    caps::set(None, CapSet::Permitted, &plan.keep_caps).map_err(|_| (S_CAPS, Errno::last()))?;
    // SAFETY: prctl(PR_SET_NO_NEW_PRIVS, 1) takes plain integers.
    if unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) } != 0 {
        return Err((S_NNP, Errno::last()));
    }
    nix::sys::stat::umask(Mode::from_bits_truncate(plan.umask as libc::mode_t));
    for f in &plan.filters {
        seccompiler::apply_filter(f).map_err(|_| (S_SECCOMP, Errno::last()))?;
    }
    match &plan.exe_fd {
        // SAFETY: an O_PATH-style descriptor of the program, an empty path with
        // AT_EMPTY_PATH, and NUL-terminated strings and NULL-terminated arrays owned by
        // the plan.
        Some(fd) => unsafe {
            libc::syscall(
                libc::SYS_execveat,
                fd.as_raw_fd(),
                c"".as_ptr(),
                plan.argv_ptrs.as_ptr(),
                plan.envp_ptrs.as_ptr(),
                libc::AT_EMPTY_PATH,
            );
        },
        // SAFETY: exe, argv and envp are NUL-terminated strings and NULL-terminated
        // arrays owned by the plan.
        None => unsafe {
            libc::execve(
                plan.exe.as_ptr(),
                plan.argv_ptrs.as_ptr(),
                plan.envp_ptrs.as_ptr(),
            );
        },
    }
    Err((S_EXEC, Errno::last()))
}

/// Makes a TCP socket in this process's network namespace, bound to `addr` and
/// listening, as descriptor `at` (replacing what was there), open across exec. Only
/// system calls: safe in the child.
fn listen(addr: &libc::sockaddr_in, at: RawFd) -> Result<(), Errno> {
    // SAFETY: plain integer arguments.
    let s = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if s < 0 {
        return Err(Errno::last());
    }
    // SAFETY: `s` is a fresh descriptor owned here.
    let s = unsafe { OwnedFd::from_raw_fd(s) };
    let one: libc::c_int = 1;
    // SAFETY: a live socket, and an int option value and a sockaddr_in of the sizes
    // passed, on this stack or in the plan.
    let ok = unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_REUSEADDR,
            (&one as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        ) == 0
            && libc::bind(
                s.as_raw_fd(),
                (addr as *const libc::sockaddr_in).cast(),
                std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
            ) == 0
            && libc::listen(s.as_raw_fd(), super::LISTEN_BACKLOG) == 0
    };
    if !ok {
        return Err(Errno::last());
    }
    // dup3 without O_CLOEXEC: the copy stays open across exec; `s` closes on drop.
    // SAFETY: two descriptor numbers; `at` is the plan's placeholder, replaced.
    if unsafe { libc::dup3(s.as_raw_fd(), at, 0) } < 0 {
        return Err(Errno::last());
    }
    Ok(())
}

/// Removes every capability but the kept ones from the bounding set.
fn drop_bounding(plan: &ChildPlan) -> Result<(), (u32, Errno)> {
    for cap in &plan.drop_caps {
        // Capabilities the running kernel does not know fail with EINVAL: nothing to drop.
        match caps::drop(None, CapSet::Bounding, *cap) {
            Ok(()) => {}
            Err(_) if Errno::last() == Errno::EINVAL => {}
            Err(_) => return Err((S_CAPS, Errno::last())),
        }
    }
    Ok(())
}

/// Drops supplementary groups and becomes `uid`/`gid` (real, effective and saved). Raw
/// system calls: this process has one thread, and libc's wrappers would try to signal
/// the parent's threads it was copied from.
fn set_ids(uid: u32, gid: u32) -> Result<(), (u32, Errno)> {
    // SAFETY: plain integer arguments; a null group list of length 0.
    let ok = unsafe {
        libc::syscall(libc::SYS_setgroups, 0usize, std::ptr::null::<libc::gid_t>()) == 0
            && libc::syscall(libc::SYS_setresgid, gid, gid, gid) == 0
            && libc::syscall(libc::SYS_setresuid, uid, uid, uid) == 0
    };
    if ok {
        Ok(())
    } else {
        Err((S_SETID, Errno::last()))
    }
}

/// The `struct mount_attr` of mount_setattr(2).
#[repr(C)]
struct MountAttr {
    attr_set: u64,
    attr_clr: u64,
    propagation: u64,
    userns_fd: u64,
}

/// A detached copy of the mount at `src` (`open_tree(OPEN_TREE_CLONE)`). Only system
/// calls: safe in the child.
pub(crate) fn open_tree_clone(src: &std::ffi::CStr) -> Result<OwnedFd, Errno> {
    // SAFETY: a NUL-terminated path and plain flags.
    let tree = unsafe {
        libc::syscall(
            libc::SYS_open_tree,
            libc::AT_FDCWD,
            src.as_ptr(),
            libc::OPEN_TREE_CLONE | libc::OPEN_TREE_CLOEXEC,
        )
    };
    if tree < 0 {
        return Err(Errno::last());
    }
    // SAFETY: `tree` is a fresh descriptor owned here.
    Ok(unsafe { OwnedFd::from_raw_fd(tree as RawFd) })
}

/// Makes the detached mount `tree` id-mapped through the user namespace `userns`, and
/// read-only, nosuid and nodev. Only system calls: safe in the child.
pub(crate) fn set_idmap(tree: &OwnedFd, userns: RawFd) -> Result<(), Errno> {
    set_idmap_attrs(tree, userns, libc::MOUNT_ATTR_RDONLY)
}

/// Makes the detached mount `tree` id-mapped through `userns`, nosuid and nodev, plus
/// the attributes `extra`. Only system calls: safe in the child.
fn set_idmap_attrs(tree: &OwnedFd, userns: RawFd, extra: u64) -> Result<(), Errno> {
    let attr = MountAttr {
        attr_set: libc::MOUNT_ATTR_IDMAP | extra | libc::MOUNT_ATTR_NOSUID | libc::MOUNT_ATTR_NODEV,
        attr_clr: 0,
        propagation: 0,
        userns_fd: userns as u64,
    };
    // SAFETY: a live descriptor, an empty path with AT_EMPTY_PATH, and a mount_attr of
    // the size passed, on this stack.
    let r = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            tree.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_EMPTY_PATH,
            &attr as *const MountAttr,
            std::mem::size_of::<MountAttr>(),
        )
    };
    if r < 0 {
        return Err(Errno::last());
    }
    Ok(())
}

/// Attaches an id-mapped, read-only, nosuid, nodev copy of the mount at `src` at `target`.
fn idmap_bind(src: &std::ffi::CStr, target: &std::ffi::CStr, userns: RawFd) -> Result<(), Errno> {
    let tree = open_tree_clone(src)?;
    set_idmap(&tree, userns)?;
    // SAFETY: a live descriptor, an empty source path with MOVE_MOUNT_F_EMPTY_PATH and a
    // NUL-terminated target path.
    let r = unsafe {
        libc::syscall(
            libc::SYS_move_mount,
            tree.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_FDCWD,
            target.as_ptr(),
            libc::MOVE_MOUNT_F_EMPTY_PATH,
        )
    };
    if r < 0 {
        return Err(Errno::last());
    }
    Ok(())
}

/// Binds a volume (see [`Op::VolumeBind`]): the mount point is reached from the root
/// one directory at a time with `openat2` (no link followed, no mount crossed, never
/// above the root), made where missing, and the id-mapped copy of `src` is moved onto
/// the descriptor that was opened, so nothing in the sandbox's tree can redirect it.
/// Only system calls: safe in the child.
fn volume_bind(
    src: &std::ffi::CStr,
    root: &std::ffi::CStr,
    components: &[std::ffi::CString],
    owner: u32,
    userns: RawFd,
) -> Result<(), Errno> {
    use nix::fcntl::{AtFlags, OFlag, OpenHow, ResolveFlag, openat2};
    // No O_NOFOLLOW: with O_PATH it would open a final link itself; RESOLVE_NO_SYMLINKS
    // refuses it (ELOOP) like any other link on the way.
    let dir = OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC;
    let how = OpenHow::new().flags(dir).resolve(
        ResolveFlag::RESOLVE_BENEATH
            | ResolveFlag::RESOLVE_NO_SYMLINKS
            | ResolveFlag::RESOLVE_NO_MAGICLINKS
            | ResolveFlag::RESOLVE_NO_XDEV,
    );
    let mut cur = nix::fcntl::open(root, dir | OFlag::O_NOFOLLOW, Mode::empty())?;
    for c in components {
        cur = match openat2(&cur, c.as_c_str(), how) {
            Ok(fd) => fd,
            Err(Errno::ENOENT) => {
                nix::sys::stat::mkdirat(&cur, c.as_c_str(), Mode::from_bits_truncate(0o755))?;
                nix::unistd::fchownat(
                    &cur,
                    c.as_c_str(),
                    Some(nix::unistd::Uid::from_raw(owner)),
                    Some(nix::unistd::Gid::from_raw(owner)),
                    AtFlags::AT_SYMLINK_NOFOLLOW,
                )?;
                openat2(&cur, c.as_c_str(), how)?
            }
            Err(e) => return Err(e),
        };
    }
    // SAFETY: a NUL-terminated path and plain flags; the last component is not followed.
    let tree = unsafe {
        libc::syscall(
            libc::SYS_open_tree,
            libc::AT_FDCWD,
            src.as_ptr(),
            libc::OPEN_TREE_CLONE | libc::OPEN_TREE_CLOEXEC | libc::AT_SYMLINK_NOFOLLOW as u32,
        )
    };
    if tree < 0 {
        return Err(Errno::last());
    }
    // SAFETY: `tree` is a fresh descriptor owned here.
    let tree = unsafe { OwnedFd::from_raw_fd(tree as RawFd) };
    set_idmap_attrs(&tree, userns, 0)?;
    // SAFETY: two live descriptors and empty paths with MOVE_MOUNT_F_EMPTY_PATH and
    // MOVE_MOUNT_T_EMPTY_PATH: the mount lands on exactly the directory opened above.
    let r = unsafe {
        libc::syscall(
            libc::SYS_move_mount,
            tree.as_raw_fd(),
            c"".as_ptr(),
            cur.as_raw_fd(),
            c"".as_ptr(),
            libc::MOVE_MOUNT_F_EMPTY_PATH | libc::MOVE_MOUNT_T_EMPTY_PATH,
        )
    };
    if r < 0 {
        return Err(Errno::last());
    }
    Ok(())
}

/// The path inside of the volume whose bind is step `idx` of `plan`, if it is one (in
/// the parent, for the message).
pub(super) fn volume_path(plan: &ChildPlan, idx: u32) -> Option<String> {
    let step = plan.steps.get(idx.checked_sub(S_MOUNT_BASE)? as usize)?;
    let Op::VolumeBind { components, .. } = &step.op else {
        return None;
    };
    Some(
        components
            .iter()
            .map(|c| format!("/{}", c.to_string_lossy()))
            .collect(),
    )
}

trait ToOsStr {
    fn to_bytes_as_os_str(&self) -> &std::ffi::OsStr;
}

impl ToOsStr for std::ffi::CStr {
    fn to_bytes_as_os_str(&self) -> &std::ffi::OsStr {
        use std::os::unix::ffi::OsStrExt;
        std::ffi::OsStr::from_bytes(self.to_bytes())
    }
}

pub(super) fn step_name(plan: &ChildPlan, idx: u32) -> &'static str {
    if idx >= S_MOUNT_BASE {
        plan.steps
            .get((idx - S_MOUNT_BASE) as usize)
            .map(|s| s.what)
            .unwrap_or("unknown step")
    } else {
        SETUP_STEPS
            .get(idx as usize)
            .copied()
            .unwrap_or("unknown step")
    }
}
