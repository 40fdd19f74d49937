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

use std::ffi::{CString, c_char};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
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

/// The device nodes of a sandbox's /dev, bound from the host's (a user namespace cannot
/// make device nodes, and the sandbox's /dev is a `nodev` tmpfs it can write to; a bind
/// mount keeps the host node usable there). The device cgroup allows exactly these.
pub const STANDARD_DEVICES: &[&str] = &["null", "zero", "full", "random", "urandom", "tty"];

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
}

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

/// The mount steps of a plan, collected in order.
struct Steps(Vec<Step>);

impl Steps {
    #[allow(clippy::too_many_arguments)]
    fn mount(
        &mut self,
        what: &'static str,
        src: Option<CString>,
        target: CString,
        fstype: Option<&str>,
        flags: MsFlags,
        data: Option<String>,
        optional: bool,
    ) -> Result<(), SpawnError> {
        self.0.push(Step {
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
    }

    fn op(&mut self, what: &'static str, op: Op) {
        self.0.push(Step {
            what,
            op,
            optional: false,
        });
    }

    /// Binds the host file `src` onto the new file `target` with `flags` added.
    fn bind_file(
        &mut self,
        what: &'static str,
        src: CString,
        target: CString,
        flags: MsFlags,
    ) -> Result<(), SpawnError> {
        self.op(
            "create a mount point",
            Op::Touch {
                path: target.clone(),
            },
        );
        self.mount(
            what,
            Some(src),
            target.clone(),
            None,
            MsFlags::MS_BIND,
            None,
            false,
        )?;
        self.mount(
            what,
            None,
            target,
            None,
            MsFlags::MS_BIND | MsFlags::MS_REMOUNT | flags,
            None,
            false,
        )
    }
}

const NOSUID_NODEV_NOEXEC: MsFlags = MsFlags::MS_NOSUID
    .union(MsFlags::MS_NODEV)
    .union(MsFlags::MS_NOEXEC);

fn overlay_steps(
    steps: &mut Steps,
    input: &Root<'_>,
    userns: Option<RawFd>,
) -> Result<(), SpawnError> {
    let Root::Overlay {
        lower,
        lower_mount,
        upper,
        work,
        root,
        base_id,
        agent_host_path,
        agent_guest_path,
    } = input
    else {
        return Ok(());
    };
    let at = |rel: &str| cpath(&root.join(rel));
    let lower_dir = match userns {
        Some(userns) => {
            steps.op(
                "mount the template id-mapped",
                Op::IdmapBind {
                    src: cpath(lower)?,
                    target: cpath(lower_mount)?,
                    userns,
                },
            );
            *lower_mount
        }
        None => *lower,
    };
    let overlay_opts = format!(
        "lowerdir={},upperdir={},workdir={}",
        lower_dir.display(),
        upper.display(),
        work.display()
    );
    steps.mount(
        "mount the overlay root",
        Some(cstr("overlay")?),
        cpath(root)?,
        Some("overlay"),
        MsFlags::MS_NODEV | MsFlags::MS_NOSUID,
        Some(overlay_opts),
        false,
    )?;
    steps.mount(
        "mount /proc",
        Some(cstr("proc")?),
        at("proc")?,
        Some("proc"),
        NOSUID_NODEV_NOEXEC,
        None,
        false,
    )?;
    steps.mount(
        "mount /sys",
        Some(cstr("sysfs")?),
        at("sys")?,
        Some("sysfs"),
        NOSUID_NODEV_NOEXEC | MsFlags::MS_RDONLY,
        None,
        false,
    )?;
    steps.mount(
        "mount /dev",
        Some(cstr("tmpfs")?),
        at("dev")?,
        Some("tmpfs"),
        NOSUID_NODEV_NOEXEC,
        Some(format!("mode=755,size=65536k,uid={base_id},gid={base_id}")),
        false,
    )?;
    for name in STANDARD_DEVICES {
        steps.bind_file(
            "bind a device node",
            cstr(format!("/dev/{name}"))?,
            at(&format!("dev/{name}"))?,
            MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC,
        )?;
    }
    for dir in ["dev/pts", "dev/shm"] {
        steps.op(
            "create a /dev directory",
            Op::Mkdir {
                path: at(dir)?,
                mode: 0o755,
            },
        );
    }
    for (target, link) in [
        ("pts/ptmx", "dev/ptmx"),
        ("/proc/self/fd", "dev/fd"),
        ("/proc/self/fd/0", "dev/stdin"),
        ("/proc/self/fd/1", "dev/stdout"),
        ("/proc/self/fd/2", "dev/stderr"),
    ] {
        steps.op(
            "create a /dev link",
            Op::Symlink {
                target: cstr(target)?,
                link: at(link)?,
            },
        );
    }
    for link in [
        "dev/ptmx",
        "dev/fd",
        "dev/stdin",
        "dev/stdout",
        "dev/stderr",
    ] {
        steps.op(
            "own a /dev link",
            Op::Chown {
                path: at(link)?,
                uid: *base_id,
                gid: *base_id,
            },
        );
    }
    // Ptys belong to the sandbox's tty group (gid 5 inside).
    steps.mount(
        "mount /dev/pts",
        Some(cstr("devpts")?),
        at("dev/pts")?,
        Some("devpts"),
        MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC,
        Some(format!(
            "newinstance,ptmxmode=0666,mode=0620,gid={}",
            base_id + 5
        )),
        false,
    )?;
    steps.mount(
        "mount /dev/shm",
        Some(cstr("shm")?),
        at("dev/shm")?,
        Some("tmpfs"),
        NOSUID_NODEV_NOEXEC,
        Some(format!("mode=1777,size=65536k,uid={base_id},gid={base_id}")),
        false,
    )?;
    let agent_target = at(agent_guest_path.trim_start_matches('/'))?;
    steps.mount(
        "bind the agent binary",
        Some(cpath(agent_host_path)?),
        agent_target.clone(),
        None,
        MsFlags::MS_BIND,
        None,
        false,
    )?;
    steps.mount(
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
            steps.mount(
                "mask a /proc directory",
                Some(cstr("tmpfs")?),
                target,
                Some("tmpfs"),
                MsFlags::MS_RDONLY | NOSUID_NODEV_NOEXEC,
                Some("size=0".into()),
                true,
            )?;
        } else {
            steps.mount(
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
        steps.mount(
            "bind a read-only /proc path",
            Some(target.clone()),
            target.clone(),
            None,
            MsFlags::MS_BIND | MsFlags::MS_REC,
            None,
            true,
        )?;
        steps.mount(
            "make a /proc path read-only",
            None,
            target,
            None,
            MsFlags::MS_BIND | MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY | NOSUID_NODEV_NOEXEC,
            None,
            true,
        )?;
    }
    Ok(())
}

fn minimal_steps(steps: &mut Steps, input: &Root<'_>) -> Result<(), SpawnError> {
    let Root::Minimal {
        root,
        devices,
        owner,
        binds,
    } = input
    else {
        return Ok(());
    };
    let at = |rel: &str| cpath(&root.join(rel.trim_start_matches('/')));
    // pivot_root needs the new root to be a mount point.
    steps.mount(
        "bind the jail directory onto itself",
        Some(cpath(root)?),
        cpath(root)?,
        None,
        MsFlags::MS_BIND,
        None,
        false,
    )?;
    steps.mount(
        "restrict the jail directory",
        None,
        cpath(root)?,
        None,
        MsFlags::MS_BIND | MsFlags::MS_REMOUNT | MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        None,
        false,
    )?;
    steps.mount(
        "mount the jail's /dev",
        Some(cstr("tmpfs")?),
        at("dev")?,
        Some("tmpfs"),
        MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC,
        Some("mode=755,size=64k".into()),
        false,
    )?;
    for (name, major, minor) in devices.iter() {
        let path = at(&format!("dev/{name}"))?;
        if let Some(parent) = Path::new(name).parent()
            && !parent.as_os_str().is_empty()
        {
            steps.op(
                "create a /dev directory",
                Op::Mkdir {
                    path: at(&format!("dev/{}", parent.display()))?,
                    mode: 0o755,
                },
            );
        }
        steps.op(
            "create a device node",
            Op::Mknod {
                path: path.clone(),
                major: *major,
                minor: *minor,
            },
        );
        steps.op(
            "own a device node",
            Op::Chown {
                path,
                uid: owner.0,
                gid: owner.1,
            },
        );
    }
    for (src, target, writable) in binds.iter() {
        let mut flags = MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC;
        if !writable {
            flags |= MsFlags::MS_RDONLY;
        }
        steps.mount(
            "bind a file into the jail",
            Some(cpath(src)?),
            at(target)?,
            None,
            MsFlags::MS_BIND,
            None,
            false,
        )?;
        steps.mount(
            "restrict a file bound into the jail",
            None,
            at(target)?,
            None,
            MsFlags::MS_BIND | MsFlags::MS_REMOUNT | flags,
            None,
            false,
        )?;
    }
    Ok(())
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
        })
    }

    /// Descriptions of the mount steps, in order (for logs and tests).
    pub fn step_names(&self) -> Vec<&'static str> {
        self.steps.iter().map(|s| s.what).collect()
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

/// Attaches an id-mapped, read-only, nosuid, nodev copy of the mount at `src` at `target`.
fn idmap_bind(src: &std::ffi::CStr, target: &std::ffi::CStr, userns: RawFd) -> Result<(), Errno> {
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
    let tree = unsafe { OwnedFd::from_raw_fd(tree as RawFd) };
    let attr = MountAttr {
        attr_set: libc::MOUNT_ATTR_IDMAP
            | libc::MOUNT_ATTR_RDONLY
            | libc::MOUNT_ATTR_NOSUID
            | libc::MOUNT_ATTR_NODEV,
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
