//! Starting a sandbox's PID 1: `clone` into new mount, PID, UTS and IPC namespaces, then,
//! in the child, join the network namespace and the cgroups, enter a new cgroup
//! namespace, build the root (overlay, /proc, /sys, /dev, the agent binary), pivot into
//! it, drop capabilities, set `no_new_privs`, install the seccomp filters and exec the
//! agent.
//!
//! The child is a copy of a multi-threaded process, so it must not allocate or take locks:
//! everything it needs (paths, arguments, the filters) is prepared by the parent in a
//! [`ChildPlan`], and the child only makes system calls. A failure is reported through a
//! close-on-exec pipe as `(step, errno)`; a successful exec closes the pipe.

use std::ffi::{CString, c_char};
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::path::Path;

use caps::{CapSet, Capability, CapsHashSet};
use nix::errno::Errno;
use nix::mount::{MntFlags, MsFlags};
use nix::sched::CloneFlags;
use nix::sys::stat::{Mode, SFlag};
use nix::unistd::Pid;
use seccompiler::BpfProgram;

/// Errors starting PID 1.
#[derive(Debug, thiserror::Error)]
pub enum SpawnError {
    #[error("path {0:?} contains a NUL byte")]
    Nul(String),
    #[error("clone failed: {0}")]
    Clone(Errno),
    #[error("sandbox setup failed at \"{step}\": {errno}")]
    Child { step: &'static str, errno: Errno },
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
}

/// The capabilities PID 1 keeps (and every process of the sandbox at most): those a
/// root user needs to manage files and users inside its own root, nothing that reaches
/// the kernel or other namespaces.
pub const KEPT_CAPABILITIES: &[Capability] = &[
    Capability::CAP_CHOWN,
    Capability::CAP_DAC_OVERRIDE,
    Capability::CAP_FOWNER,
    Capability::CAP_FSETID,
    Capability::CAP_KILL,
    Capability::CAP_SETGID,
    Capability::CAP_SETUID,
    Capability::CAP_SETPCAP,
    Capability::CAP_NET_BIND_SERVICE,
    Capability::CAP_SYS_CHROOT,
    Capability::CAP_MKNOD,
    Capability::CAP_AUDIT_WRITE,
    Capability::CAP_SETFCAP,
];

/// Paths under /proc that are hidden (a file gets /dev/null mounted over it, a directory
/// an empty read-only tmpfs).
const MASKED_PATHS: &[&str] = &[
    "proc/kcore",
    "proc/keys",
    "proc/timer_list",
    "proc/sched_debug",
    "proc/latency_stats",
    "proc/acpi",
    "proc/scsi",
    "proc/asound",
];

/// Paths under /proc made read-only (host-wide kernel settings live there).
const READONLY_PATHS: &[&str] = &[
    "proc/sys",
    "proc/sysrq-trigger",
    "proc/bus",
    "proc/fs",
    "proc/irq",
];

/// One system call of the child's setup.
#[derive(Debug)]
enum Op {
    Mount {
        src: Option<CString>,
        target: CString,
        fstype: Option<CString>,
        flags: MsFlags,
        data: Option<CString>,
    },
    Mkdir {
        path: CString,
        mode: u32,
    },
    Mknod {
        path: CString,
        major: u64,
        minor: u64,
    },
    Symlink {
        target: CString,
        link: CString,
    },
}

#[derive(Debug)]
struct Step {
    what: &'static str,
    op: Op,
    /// A missing path (`ENOENT`) skips the step instead of failing.
    optional: bool,
}

/// Everything the child needs, prepared before `clone`.
pub struct ChildPlan {
    netns: RawFd,
    cgroup_procs: Vec<CString>,
    hostname: CString,
    steps: Vec<Step>,
    root: CString,
    log_fd: RawFd,
    exe: CString,
    _argv: Vec<CString>,
    argv_ptrs: Vec<*const c_char>,
    _envp: Vec<CString>,
    envp_ptrs: Vec<*const c_char>,
    drop_caps: Vec<Capability>,
    keep_caps: CapsHashSet,
    filters: Vec<BpfProgram>,
}

// SAFETY: the raw pointers point into the CStrings owned by the same plan, which are
// never mutated; the plan is only read.
unsafe impl Send for ChildPlan {}

/// Inputs of [`ChildPlan::new`].
pub struct PlanInput<'a> {
    pub netns: BorrowedFd<'a>,
    /// Files the child writes `0` to, to join its cgroups (see
    /// [`super::cgroup::SandboxCgroup::join_files`]).
    pub cgroup_procs: Vec<std::path::PathBuf>,
    pub hostname: &'a str,
    pub lower: &'a Path,
    pub upper: &'a Path,
    pub work: &'a Path,
    pub root: &'a Path,
    pub agent_host_path: &'a Path,
    /// Path of the agent inside the sandbox (absolute).
    pub agent_guest_path: &'a str,
    pub agent_args: &'a [String],
    pub env: Vec<(String, String)>,
    pub log: BorrowedFd<'a>,
    pub filters: Vec<BpfProgram>,
}

fn cstr(s: impl AsRef<[u8]>) -> Result<CString, SpawnError> {
    CString::new(s.as_ref())
        .map_err(|_| SpawnError::Nul(String::from_utf8_lossy(s.as_ref()).into_owned()))
}

fn cpath(p: &Path) -> Result<CString, SpawnError> {
    cstr(p.as_os_str().as_encoded_bytes())
}

impl ChildPlan {
    pub fn new(input: PlanInput<'_>) -> Result<Self, SpawnError> {
        let root = input.root;
        let at = |rel: &str| cpath(&root.join(rel));
        let mut steps = Vec::new();
        let mut mount = |what,
                         src: Option<&str>,
                         target: CString,
                         fstype: Option<&str>,
                         flags,
                         data: Option<String>,
                         optional|
         -> Result<(), SpawnError> {
            steps.push(Step {
                what,
                op: Op::Mount {
                    src: src.map(cstr).transpose()?,
                    target,
                    fstype: fstype.map(cstr).transpose()?,
                    flags,
                    data: data.map(cstr).transpose()?,
                },
                optional,
            });
            Ok(())
        };
        let nosuid_nodev_noexec = MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC;
        mount(
            "make / private",
            None,
            cstr("/")?,
            None,
            MsFlags::MS_REC | MsFlags::MS_PRIVATE,
            None,
            false,
        )?;
        let overlay_opts = format!(
            "lowerdir={},upperdir={},workdir={}",
            input.lower.display(),
            input.upper.display(),
            input.work.display()
        );
        mount(
            "mount the overlay root",
            Some("overlay"),
            cpath(root)?,
            Some("overlay"),
            MsFlags::empty(),
            Some(overlay_opts),
            false,
        )?;
        mount(
            "mount /proc",
            Some("proc"),
            at("proc")?,
            Some("proc"),
            nosuid_nodev_noexec,
            None,
            false,
        )?;
        mount(
            "mount /sys",
            Some("sysfs"),
            at("sys")?,
            Some("sysfs"),
            nosuid_nodev_noexec | MsFlags::MS_RDONLY,
            None,
            false,
        )?;
        mount(
            "mount /dev",
            Some("tmpfs"),
            at("dev")?,
            Some("tmpfs"),
            MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC,
            Some("mode=755,size=65536k".into()),
            false,
        )?;
        for (name, major, minor) in [
            ("null", 1, 3),
            ("zero", 1, 5),
            ("full", 1, 7),
            ("random", 1, 8),
            ("urandom", 1, 9),
            ("tty", 5, 0),
        ] {
            steps.push(Step {
                what: "create a device node",
                op: Op::Mknod {
                    path: at(&format!("dev/{name}"))?,
                    major,
                    minor,
                },
                optional: false,
            });
        }
        for dir in ["dev/pts", "dev/shm"] {
            steps.push(Step {
                what: "create a /dev directory",
                op: Op::Mkdir {
                    path: at(dir)?,
                    mode: 0o755,
                },
                optional: false,
            });
        }
        for (target, link) in [
            ("pts/ptmx", "dev/ptmx"),
            ("/proc/self/fd", "dev/fd"),
            ("/proc/self/fd/0", "dev/stdin"),
            ("/proc/self/fd/1", "dev/stdout"),
            ("/proc/self/fd/2", "dev/stderr"),
        ] {
            steps.push(Step {
                what: "create a /dev link",
                op: Op::Symlink {
                    target: cstr(target)?,
                    link: at(link)?,
                },
                optional: false,
            });
        }
        let mut mount = |what,
                         src: Option<CString>,
                         target: CString,
                         fstype: Option<&str>,
                         flags,
                         data: Option<&str>,
                         optional|
         -> Result<(), SpawnError> {
            steps.push(Step {
                what,
                op: Op::Mount {
                    src,
                    target,
                    fstype: fstype.map(cstr).transpose()?,
                    flags,
                    data: data.map(cstr).transpose()?,
                },
                optional,
            });
            Ok(())
        };
        mount(
            "mount /dev/pts",
            Some(cstr("devpts")?),
            at("dev/pts")?,
            Some("devpts"),
            MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC,
            Some("newinstance,ptmxmode=0666,mode=0620,gid=5"),
            false,
        )?;
        mount(
            "mount /dev/shm",
            Some(cstr("shm")?),
            at("dev/shm")?,
            Some("tmpfs"),
            nosuid_nodev_noexec,
            Some("mode=1777,size=65536k"),
            false,
        )?;
        let agent_target = at(input.agent_guest_path.trim_start_matches('/'))?;
        mount(
            "bind the agent binary",
            Some(cpath(input.agent_host_path)?),
            agent_target.clone(),
            None,
            MsFlags::MS_BIND,
            None,
            false,
        )?;
        mount(
            "make the agent binary read-only",
            None,
            agent_target,
            None,
            MsFlags::MS_BIND
                | MsFlags::MS_REMOUNT
                | MsFlags::MS_RDONLY
                | MsFlags::MS_NOSUID
                | MsFlags::MS_NODEV,
            None,
            false,
        )?;
        for p in MASKED_PATHS {
            let target = at(p)?;
            let is_dir = Path::new("/").join(p).is_dir();
            if is_dir {
                mount(
                    "mask a /proc directory",
                    Some(cstr("tmpfs")?),
                    target,
                    Some("tmpfs"),
                    MsFlags::MS_RDONLY | nosuid_nodev_noexec,
                    Some("size=0"),
                    true,
                )?;
            } else {
                mount(
                    "mask a /proc file",
                    Some(at("dev/null")?),
                    target,
                    None,
                    MsFlags::MS_BIND,
                    None,
                    true,
                )?;
            }
        }
        for p in READONLY_PATHS {
            let target = at(p)?;
            mount(
                "bind a read-only /proc path",
                Some(target.clone()),
                target.clone(),
                None,
                MsFlags::MS_BIND | MsFlags::MS_REC,
                None,
                true,
            )?;
            mount(
                "make a /proc path read-only",
                None,
                target,
                None,
                MsFlags::MS_BIND | MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY | nosuid_nodev_noexec,
                None,
                true,
            )?;
        }

        let exe = cstr(input.agent_guest_path)?;
        let mut argv = vec![exe.clone()];
        for a in input.agent_args {
            argv.push(cstr(a)?);
        }
        let envp = input
            .env
            .iter()
            .map(|(k, v)| cstr(format!("{k}={v}")))
            .collect::<Result<Vec<_>, _>>()?;
        let ptrs = |v: &[CString]| {
            let mut p: Vec<*const c_char> = v.iter().map(|s| s.as_ptr()).collect();
            p.push(std::ptr::null());
            p
        };
        let argv_ptrs = ptrs(&argv);
        let envp_ptrs = ptrs(&envp);
        let keep: CapsHashSet = KEPT_CAPABILITIES.iter().copied().collect();
        let drop_caps = caps::all()
            .into_iter()
            .filter(|c| !keep.contains(c))
            .collect();
        Ok(Self {
            netns: input.netns.as_raw_fd(),
            cgroup_procs: input
                .cgroup_procs
                .iter()
                .map(|p| cpath(p))
                .collect::<Result<_, _>>()?,
            hostname: cstr(input.hostname)?,
            steps,
            root: cpath(root)?,
            log_fd: input.log.as_raw_fd(),
            exe,
            _argv: argv,
            argv_ptrs,
            _envp: envp,
            envp_ptrs,
            drop_caps,
            keep_caps: keep,
            filters: input.filters,
        })
    }

    /// Descriptions of the mount steps, in order (for logs and tests).
    pub fn step_names(&self) -> Vec<&'static str> {
        self.steps.iter().map(|s| s.what).collect()
    }
}

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
    "exec the agent",
    "reset signals",
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
/// Mount steps are numbered after the fixed ones.
const S_MOUNT_BASE: u32 = 100;

fn errno_of<T>(r: Result<T, Errno>, step: u32) -> Result<T, (u32, Errno)> {
    r.map_err(|e| (step, e))
}

/// The child's side. Only system calls; returns only on failure.
fn child_main(plan: &ChildPlan) -> (u32, Errno) {
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
    nix::sys::stat::umask(Mode::empty());
    // SAFETY: the descriptor belongs to the plan's owner, which outlives the child's setup.
    let netns = unsafe { BorrowedFd::borrow_raw(plan.netns) };
    errno_of(nix::sched::setns(netns, CloneFlags::CLONE_NEWNET), S_NETNS)?;
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
            Op::Mkdir { path, mode } => {
                nix::unistd::mkdir(path.as_c_str(), Mode::from_bits_truncate(*mode))
            }
            Op::Mknod { path, major, minor } => nix::sys::stat::mknod(
                path.as_c_str(),
                SFlag::S_IFCHR,
                Mode::from_bits_truncate(0o666),
                nix::sys::stat::makedev(*major, *minor),
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
    errno_of(nix::unistd::chdir(plan.root.as_c_str()), S_CHDIR)?;
    errno_of(nix::unistd::pivot_root(".", "."), S_PIVOT)?;
    errno_of(nix::mount::umount2(".", MntFlags::MNT_DETACH), S_UMOUNT)?;
    errno_of(nix::unistd::chdir("/"), S_CHDIR)?;

    // stdin from /dev/null, stdout and stderr to the log; every other descriptor closes
    // on exec.
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

    for cap in &plan.drop_caps {
        // Capabilities the running kernel does not know fail with EINVAL: nothing to drop.
        match caps::drop(None, CapSet::Bounding, *cap) {
            Ok(()) => {}
            Err(_) if Errno::last() == Errno::EINVAL => {}
            Err(_) => return Err((S_CAPS, Errno::last())),
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
    for f in &plan.filters {
        seccompiler::apply_filter(f).map_err(|_| (S_SECCOMP, Errno::last()))?;
    }
    // SAFETY: exe, argv and envp are NUL-terminated strings and NULL-terminated arrays
    // owned by the plan.
    unsafe {
        libc::execve(
            plan.exe.as_ptr(),
            plan.argv_ptrs.as_ptr(),
            plan.envp_ptrs.as_ptr(),
        );
    }
    Err((S_EXEC, Errno::last()))
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

fn step_name(plan: &ChildPlan, idx: u32) -> &'static str {
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

/// Starts PID 1 as described by `plan`. Blocks until the agent was exec'd (or failed).
pub fn spawn(plan: &ChildPlan) -> Result<Pid, SpawnError> {
    let (err_r, err_w): (OwnedFd, OwnedFd) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)
        .map_err(|e| SpawnError::Io {
            context: "creating the setup pipe".into(),
            source: e.into(),
        })?;
    let err_w_raw = err_w.as_raw_fd();
    let mut stack = vec![0u8; 256 * 1024];
    let flags = CloneFlags::CLONE_NEWNS
        | CloneFlags::CLONE_NEWPID
        | CloneFlags::CLONE_NEWUTS
        | CloneFlags::CLONE_NEWIPC;
    let cb = Box::new(move || -> isize {
        let (step, errno) = child_main(plan);
        let mut rec = [0u8; 8];
        rec[..4].copy_from_slice(&step.to_ne_bytes());
        rec[4..].copy_from_slice(&(errno as i32).to_ne_bytes());
        // SAFETY: writes 8 bytes from a stack buffer to the pipe, then exits without
        // running any of the parent's destructors.
        unsafe {
            libc::write(err_w_raw, rec.as_ptr().cast(), rec.len());
            libc::_exit(127);
        }
    });
    // SAFETY: the child runs `cb` on its own stack in a copy of this process; it only makes
    // system calls (no allocation, no locks) and ends in execve or _exit.
    let pid = unsafe { nix::sched::clone(cb, &mut stack, flags, Some(libc::SIGCHLD)) }
        .map_err(SpawnError::Clone)?;
    drop(err_w);
    let mut rec = [0u8; 8];
    let mut got = 0;
    while got < rec.len() {
        match nix::unistd::read(&err_r, &mut rec[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(Errno::EINTR) => continue,
            Err(e) => {
                return Err(SpawnError::Io {
                    context: "reading the setup pipe".into(),
                    source: e.into(),
                });
            }
        }
    }
    if got == 0 {
        return Ok(pid);
    }
    // Setup failed: reap the child and report.
    let _ = nix::sys::wait::waitpid(pid, None);
    let step = u32::from_ne_bytes(rec[..4].try_into().unwrap_or([0; 4]));
    let errno = i32::from_ne_bytes(rec[4..].try_into().unwrap_or([0; 4]));
    Err(SpawnError::Child {
        step: step_name(plan, step),
        errno: Errno::from_raw(errno),
    })
}
