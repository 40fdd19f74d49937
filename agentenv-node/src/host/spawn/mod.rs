//! Starting a sandbox's first process: `clone` into new mount, PID, UTS and IPC
//! namespaces, then, in the child (still host root), join the network namespace, build the
//! root (the jail's overlay with /proc, /sys, /dev and the agent binary, or a VMM's minimal
//! directory), join the cgroups (whose device allow-list applies from then on), enter a
//! new cgroup namespace, set the host name, pivot into the root, set resource limits,
//! shrink the capability bounding set, become the sandbox's user (root of its user
//! namespace, or an unprivileged host uid), set `no_new_privs`, the umask and the seccomp
//! filters, and exec the program.
//!
//! Every namespace but the user namespace is made while the child is host root, so they
//! belong to the host's user namespace: root inside the sandbox holds capabilities over
//! its own files and processes only, never over its mounts, network or host name.
//!
//! The child is a copy of a multi-threaded process, so it must not allocate or take locks:
//! everything it needs (paths, arguments, the filters) is prepared by the parent in a
//! [`ChildPlan`], and the child only makes system calls. A failure is reported through a
//! close-on-exec pipe as `(step, errno)`; a successful exec closes the pipe.
//!
//! The module is split by concern: this file holds the plan ([`ChildPlan`] and its
//! inputs) and the parent's side ([`spawn`]); `steps` builds the mount steps of the two
//! kinds of root; `child` is the child's side, which runs the plan.

mod child;

pub(crate) use child::{open_tree_clone, set_idmap};
mod steps;

use std::ffi::{CString, c_char};
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::path::Path;

use caps::{Capability, CapsHashSet};
use nix::errno::Errno;
use nix::mount::MsFlags;
use nix::sched::CloneFlags;
use nix::unistd::Pid;
use seccompiler::BpfProgram;

use child::{child_main, step_name};
use steps::{Steps, minimal_steps, overlay_steps};

/// Errors starting PID 1.
#[derive(Debug, thiserror::Error)]
pub enum SpawnError {
    #[error("path {0:?} contains a NUL byte")]
    Nul(String),
    #[error("clone failed: {0}")]
    Clone(Errno),
    #[error("sandbox setup failed at \"{step}\": {errno}")]
    Child { step: &'static str, errno: Errno },
    /// Binding the volume at `path` (inside) failed.
    #[error("mounting the volume at {path} failed: {errno}")]
    Volume { path: String, errno: Errno },
    #[error("volumes are bound id-mapped: the plan needs the sandbox's user namespace")]
    VolumesNeedUserNs,
    #[error(
        "{0} is dynamically linked: a jailed program sees nothing of the host, so build it statically (agentenv-vmm/build-static.sh)"
    )]
    NotStatic(String),
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
}

/// The capabilities PID 1 keeps (and every process of the sandbox at most), all of them
/// scoped to the sandbox's own user namespace: those a root user needs to manage files and
/// users inside its own root. `CAP_MKNOD` is not among them (device nodes cannot be made
/// from a user namespace anyway, and the device cgroup refuses them too).
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
    Capability::CAP_AUDIT_WRITE,
    Capability::CAP_SETFCAP,
];

/// The device nodes of a sandbox's /dev, bound from the host's (a user namespace cannot
/// make device nodes, and the sandbox's /dev is a `nodev` tmpfs it can write to; a bind
/// mount keeps the host node usable there). The device cgroup allows exactly these.
pub const STANDARD_DEVICES: [(&str, u32, u32); 6] = agentenv_guest::devices::BASIC_DEVICES;

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
    /// `open_tree(src, OPEN_TREE_CLONE)` made id-mapped through the user namespace
    /// (read-only, nosuid, nodev) and attached at `target`.
    IdmapBind {
        src: CString,
        target: CString,
        userns: RawFd,
    },
    Mkdir {
        path: CString,
        mode: u32,
    },
    /// A volume: the host directory `src` attached id-mapped (writable, nosuid, nodev)
    /// on the directory `components` beneath `root`, which is resolved without
    /// following links or crossing mounts; missing directories are made (mode 0755,
    /// owned by `owner`).
    VolumeBind {
        src: CString,
        root: CString,
        components: Vec<CString>,
        owner: u32,
        userns: RawFd,
    },
    /// An empty regular file (a mount point for a bound file).
    Touch {
        path: CString,
    },
    Mknod {
        path: CString,
        major: u64,
        minor: u64,
    },
    Chown {
        path: CString,
        uid: u32,
        gid: u32,
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

/// Who the process becomes once its root is built.
#[derive(Debug)]
enum Become {
    /// Root of the sandbox's user namespace (host uid = the range's base).
    UserNs(RawFd),
    /// A plain unprivileged host uid and gid, without any capability.
    Unprivileged { uid: u32, gid: u32 },
}

/// Everything the child needs, prepared before `clone`.
pub struct ChildPlan {
    netns: RawFd,
    cgroup_procs: Vec<CString>,
    hostname: CString,
    steps: Vec<Step>,
    root: CString,
    log_fd: RawFd,
    /// Opened (O_PATH) before the root changes when the program is outside it.
    exe_fd: Option<OwnedFd>,
    exe: CString,
    _argv: Vec<CString>,
    argv_ptrs: Vec<*const c_char>,
    _envp: Vec<CString>,
    envp_ptrs: Vec<*const c_char>,
    user: Become,
    drop_caps: Vec<Capability>,
    keep_caps: CapsHashSet,
    rlimits: Vec<(libc::__rlimit_resource_t, libc::rlimit)>,
    umask: u32,
    filters: Vec<BpfProgram>,
    listen: Option<ListenPlan>,
}

/// The listening socket the child makes for the program (see [`Listen`]).
struct ListenPlan {
    addr: libc::sockaddr_in,
    /// Holds the descriptor number the socket takes in the child (`/dev/null` until
    /// then), so that number is known before `clone` and can be named in the
    /// environment.
    slot: OwnedFd,
}

/// A TCP socket the child binds and listens on inside the sandbox's network namespace
/// before it execs the program, which finds it open (not close-on-exec) under the
/// descriptor number the environment variable `env` names. A client can connect as soon
/// as the spawn returned: its connection waits in the backlog until the program accepts,
/// so no one has to poll for the program's listener, and no process of the sandbox can
/// take the address before the program serves it.
#[derive(Clone, Copy, Debug)]
pub struct Listen<'a> {
    pub addr: std::net::SocketAddrV4,
    pub env: &'a str,
}

/// Backlog of the socket of a [`Listen`].
const LISTEN_BACKLOG: i32 = 1024;

// SAFETY: the raw pointers point into the CStrings owned by the same plan, which are
// never mutated; the plan is only read.
unsafe impl Send for ChildPlan {}

/// The root a process gets.
pub enum Root<'a> {
    /// The jail's root: an overlay of the template (mounted id-mapped into the sandbox's
    /// range at `lower_mount`, so its root-owned files are root's inside) under the
    /// sandbox's writable layer, with /proc, /sys, a `nodev` /dev holding the
    /// [`STANDARD_DEVICES`], /dev/pts, /dev/shm and the agent binary bound read-only.
    Overlay {
        lower: &'a Path,
        /// An empty directory the id-mapped template is attached to.
        lower_mount: &'a Path,
        upper: &'a Path,
        work: &'a Path,
        root: &'a Path,
        /// Host uid and gid of root inside (owner of /dev, /dev/shm and the pty group).
        base_id: u32,
        agent_host_path: &'a Path,
        /// Path of the agent inside the sandbox (absolute).
        agent_guest_path: &'a str,
        /// Volumes bound in, after everything else (paths checked by the caller).
        volumes: &'a [crate::backend::VolumeBind],
    },
    /// A minimal root: the directory `root` itself (bound onto itself), with a tmpfs
    /// `/dev` holding only `devices` (owned by `owner`) and the `binds` (host file,
    /// path inside, writable) — what a jailed VMM sees.
    Minimal {
        root: &'a Path,
        devices: &'a [(&'a str, u64, u64)],
        owner: (u32, u32),
        binds: &'a [(&'a Path, &'a str, bool)],
    },
}

/// Who the process runs as.
pub enum Identity<'a> {
    /// Root of this user namespace (the sandbox's; see [`super::ids`]).
    UserNs(BorrowedFd<'a>),
    /// An unprivileged host uid and gid, no capabilities at all.
    Unprivileged { uid: u32, gid: u32 },
}

/// The program a plan runs.
pub enum Program<'a> {
    /// A path inside the new root.
    Inside(&'a str),
    /// A host file, opened before the root changes and run from its descriptor (it must
    /// be statically linked: nothing of the host is visible after the switch).
    Host(&'a Path),
}

/// Inputs of [`ChildPlan::new`].
pub struct PlanInput<'a> {
    pub netns: BorrowedFd<'a>,
    /// Files the child writes `0` to, to join its cgroups (see
    /// [`super::cgroup::SandboxCgroup::join_files`]).
    pub cgroup_procs: Vec<std::path::PathBuf>,
    pub hostname: &'a str,
    pub root: Root<'a>,
    pub identity: Identity<'a>,
    pub program: Program<'a>,
    pub args: &'a [String],
    pub env: Vec<(String, String)>,
    pub log: BorrowedFd<'a>,
    pub filters: Vec<BpfProgram>,
    /// Resource limits set before exec (soft and hard alike).
    pub rlimits: &'a [(libc::__rlimit_resource_t, u64)],
    /// The file mode creation mask of the program.
    pub umask: u32,
    /// A listening socket made for the program, if any.
    pub listen: Option<Listen<'a>>,
}

/// The per-process limits of every sandbox process: a tenant cannot raise a hard limit
/// (that needs `CAP_SYS_RESOURCE` on the host). Processes and threads are capped by the
/// sandbox's pids cgroup, memory by its memory cgroup, files by its disk.
pub const SANDBOX_RLIMITS: &[(libc::__rlimit_resource_t, u64)] = &[
    (libc::RLIMIT_NOFILE, 65536),
    (libc::RLIMIT_MEMLOCK, 64 << 10),
    (libc::RLIMIT_MSGQUEUE, 800 << 10),
    (libc::RLIMIT_SIGPENDING, 16384),
    (libc::RLIMIT_CORE, 0),
];

fn cstr(s: impl AsRef<[u8]>) -> Result<CString, SpawnError> {
    CString::new(s.as_ref())
        .map_err(|_| SpawnError::Nul(String::from_utf8_lossy(s.as_ref()).into_owned()))
}

fn cpath(p: &Path) -> Result<CString, SpawnError> {
    cstr(p.as_os_str().as_encoded_bytes())
}

impl ChildPlan {
    pub fn new(input: PlanInput<'_>) -> Result<Self, SpawnError> {
        let root = match &input.root {
            Root::Overlay { root, .. } | Root::Minimal { root, .. } => *root,
        };
        let userns = match &input.identity {
            Identity::UserNs(fd) => Some(fd.as_raw_fd()),
            Identity::Unprivileged { .. } => None,
        };
        let mut steps = Steps(Vec::new());
        steps.mount(
            "make / private",
            None,
            cstr("/")?,
            None,
            MsFlags::MS_REC | MsFlags::MS_PRIVATE,
            None,
            false,
        )?;
        overlay_steps(&mut steps, &input.root, userns)?;
        minimal_steps(&mut steps, &input.root)?;

        let (exe, exe_fd) = match input.program {
            Program::Inside(p) => (cstr(p)?, None),
            Program::Host(p) => {
                let f = std::fs::File::open(p).map_err(|e| SpawnError::Io {
                    context: format!("opening {}", p.display()),
                    source: e,
                })?;
                if needs_interpreter(&f).map_err(|e| SpawnError::Io {
                    context: format!("reading {}", p.display()),
                    source: e,
                })? {
                    return Err(SpawnError::NotStatic(p.display().to_string()));
                }
                (cpath(p)?, Some(OwnedFd::from(f)))
            }
        };
        let mut argv = vec![exe.clone()];
        for a in input.args {
            argv.push(cstr(a)?);
        }
        let mut envp = input
            .env
            .iter()
            .map(|(k, v)| cstr(format!("{k}={v}")))
            .collect::<Result<Vec<_>, _>>()?;
        let listen = match input.listen {
            Some(l) => {
                let slot: OwnedFd = std::fs::File::open("/dev/null")
                    .map_err(|e| SpawnError::Io {
                        context: "reserving the listening socket's descriptor".into(),
                        source: e,
                    })?
                    .into();
                envp.push(cstr(format!("{}={}", l.env, slot.as_raw_fd()))?);
                Some(ListenPlan {
                    addr: sockaddr_in(l.addr),
                    slot,
                })
            }
            None => None,
        };
        let ptrs = |v: &[CString]| {
            let mut p: Vec<*const c_char> = v.iter().map(|s| s.as_ptr()).collect();
            p.push(std::ptr::null());
            p
        };
        let argv_ptrs = ptrs(&argv);
        let envp_ptrs = ptrs(&envp);
        let (user, keep): (Become, CapsHashSet) = match input.identity {
            Identity::UserNs(fd) => (
                Become::UserNs(fd.as_raw_fd()),
                KEPT_CAPABILITIES.iter().copied().collect(),
            ),
            Identity::Unprivileged { uid, gid } => {
                (Become::Unprivileged { uid, gid }, CapsHashSet::new())
            }
        };
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
            steps: steps.0,
            root: cpath(root)?,
            log_fd: input.log.as_raw_fd(),
            exe_fd,
            exe,
            _argv: argv,
            argv_ptrs,
            _envp: envp,
            envp_ptrs,
            user,
            drop_caps,
            keep_caps: keep,
            rlimits: input
                .rlimits
                .iter()
                .map(|(r, v)| {
                    // Never above the node's own hard limit: raising one needs
                    // CAP_SYS_RESOURCE, which a node may lack (lowering always works).
                    let mut cur = libc::rlimit {
                        rlim_cur: 0,
                        rlim_max: libc::RLIM_INFINITY,
                    };
                    // SAFETY: getrlimit writes one rlimit struct into `cur`.
                    if unsafe { libc::getrlimit(*r, &mut cur) } != 0 {
                        cur.rlim_max = libc::RLIM_INFINITY;
                    }
                    let v = (*v).min(cur.rlim_max);
                    (
                        *r,
                        libc::rlimit {
                            rlim_cur: v,
                            rlim_max: v,
                        },
                    )
                })
                .collect(),
            umask: input.umask,
            filters: input.filters,
            listen,
        })
    }

    /// Descriptions of the mount steps, in order (for logs and tests).
    pub fn step_names(&self) -> Vec<&'static str> {
        self.steps.iter().map(|s| s.what).collect()
    }
}

fn sockaddr_in(addr: std::net::SocketAddrV4) -> libc::sockaddr_in {
    libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: addr.port().to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from(*addr.ip()).to_be(),
        },
        sin_zero: [0; 8],
    }
}

/// Whether the ELF file `f` names a program interpreter (is dynamically linked).
pub fn needs_interpreter(f: &std::fs::File) -> std::io::Result<bool> {
    use std::os::unix::fs::FileExt;
    let mut h = [0u8; 64];
    f.read_exact_at(&mut h, 0)?;
    if &h[..4] != b"\x7fELF" || h[4] != 2 {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "not a 64-bit ELF executable",
        ));
    }
    let phoff = u64::from_le_bytes(h[0x20..0x28].try_into().unwrap_or_default());
    let phentsize = u64::from(u16::from_le_bytes([h[0x36], h[0x37]]));
    let phnum = u64::from(u16::from_le_bytes([h[0x38], h[0x39]]));
    for i in 0..phnum {
        let mut t = [0u8; 4];
        f.read_exact_at(&mut t, phoff + i * phentsize)?;
        // PT_INTERP
        if u32::from_le_bytes(t) == 3 {
            return Ok(true);
        }
    }
    Ok(false)
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
    let errno = Errno::from_raw(i32::from_ne_bytes(rec[4..].try_into().unwrap_or([0; 4])));
    if let Some(path) = child::volume_path(plan, step) {
        return Err(SpawnError::Volume { path, errno });
    }
    Err(SpawnError::Child {
        step: step_name(plan, step),
        errno,
    })
}
