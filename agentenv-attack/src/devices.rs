//! Devices: creating nodes of host devices (`mknod`) and using them; opening host
//! devices that already exist in the sandbox's `/dev`; every node under `/dev` outside
//! the standard set.

use crate::sys::{self, Fd};
use crate::{Attempt, Config, Outcome};

/// `KVM_GET_API_VERSION` (`_IO(0xAE, 0x00)`).
const KVM_GET_API_VERSION: libc::c_ulong = 0xAE00;

/// The nodes a sandbox may use: null, zero, full, random, urandom, tty, console, ptmx,
/// and the pseudo-terminals (major 136–143).
fn allowed(kind: u32, major: u32, minor: u32) -> bool {
    kind == libc::S_IFCHR
        && (matches!((major, minor), (1, 3) | (1, 5) | (1, 7) | (1, 8) | (1, 9))
            || matches!((major, minor), (5, 0) | (5, 1) | (5, 2))
            || (136..=143).contains(&major))
}

#[derive(Clone, Copy)]
enum Dev {
    Kvm,
    Mem,
    HostDisk(u32, u32),
}

impl Dev {
    fn label(self) -> &'static str {
        match self {
            Dev::Kvm => "kvm",
            Dev::Mem => "mem",
            Dev::HostDisk(..) => "hostdisk",
        }
    }

    fn node(self) -> (libc::mode_t, u32, u32) {
        match self {
            Dev::Kvm => (libc::S_IFCHR, 10, 232),
            Dev::Mem => (libc::S_IFCHR, 1, 1),
            Dev::HostDisk(a, b) => (libc::S_IFBLK, a, b),
        }
    }
}

/// Directories to create nodes in: the usual ones and every writable mount.
fn node_dirs() -> Vec<String> {
    let mut dirs: Vec<String> = ["/tmp", "/dev", "/", "/dev/shm", "/root"]
        .into_iter()
        .map(String::from)
        .collect();
    for (point, fstype, opts) in sys::mounts() {
        let skip = matches!(
            fstype.as_str(),
            "proc" | "sysfs" | "devpts" | "cgroup" | "cgroup2" | "mqueue" | "securityfs"
        ) || opts.split(',').any(|o| o == "ro");
        let is_dir = std::fs::metadata(&point).is_ok_and(|m| m.is_dir());
        if !skip && is_dir && !dirs.contains(&point) {
            dirs.push(point);
        }
    }
    dirs
}

pub fn attempts(cfg: &Config) -> Vec<Attempt> {
    let mut v = Vec::new();
    v.push(Attempt::new("dev-scan", |_| dev_scan()));
    for p in [
        "/dev/kvm",
        "/dev/mem",
        "/dev/kmem",
        "/dev/port",
        "/dev/kmsg",
        "/dev/vda",
        "/dev/sda",
        "/dev/xvda",
        "/dev/nvme0n1",
        "/dev/net/tun",
        "/dev/fuse",
        "/dev/loop-control",
    ] {
        v.push(Attempt::new(format!("dev-open:{p}"), move |_| {
            open_host_dev(p)
        }));
    }
    let mut devs = vec![Dev::Kvm, Dev::Mem];
    match cfg.block_dev {
        Some((a, b)) => devs.push(Dev::HostDisk(a, b)),
        None => v.push(Attempt::new("mknod-hostdisk", |_| {
            Outcome::inconclusive("the harness did not pass --block-dev MAJ:MIN of the host disk")
        })),
    }
    for dir in node_dirs() {
        for d in &devs {
            let d = *d;
            let path = format!("{}/.attack-{}-node", dir.trim_end_matches('/'), d.label());
            let p2 = path.clone();
            v.push(
                Attempt::new(format!("mknod-{}:{dir}", d.label()), move |_| {
                    mknod_and_use(d, &path)
                })
                .cleanup(move || {
                    let _ = std::fs::remove_file(&p2);
                }),
            );
        }
    }
    v
}

/// What using an opened device node gave.
fn use_device(d: Dev, fd: &Fd) -> String {
    match d {
        Dev::Kvm => {
            // SAFETY: KVM_GET_API_VERSION takes no argument; on another device it fails.
            let r = unsafe { libc::ioctl(fd.0, KVM_GET_API_VERSION as _, 0) };
            if r < 0 {
                format!("KVM_GET_API_VERSION failed: {}", sys::ename(sys::errno()))
            } else {
                format!("KVM_GET_API_VERSION answered {r}: the host's KVM is usable")
            }
        }
        Dev::Mem => match sys::pread(fd, 16, 0) {
            Ok(b) => format!("read {} bytes of physical memory", b.len()),
            Err(e) => format!("reading failed: {}", sys::ename(e)),
        },
        Dev::HostDisk(..) => match sys::pread(fd, 2048, 0) {
            Ok(b) => {
                let ext = b.len() >= 1082 && b[1080] == 0x53 && b[1081] == 0xEF;
                format!(
                    "read {} bytes of the host disk{}",
                    b.len(),
                    if ext { " (an ext2/3/4 superblock)" } else { "" }
                )
            }
            Err(e) => format!("reading failed: {}", sys::ename(e)),
        },
    }
}

fn mknod_and_use(d: Dev, path: &str) -> Outcome {
    let (kind, major, minor) = d.node();
    let _ = std::fs::remove_file(path);
    let c = sys::cstr(path);
    // SAFETY: `c` is a NUL-terminated path that outlives the call.
    let r = unsafe { libc::mknod(c.as_ptr(), kind | 0o600, libc::makedev(major, minor)) };
    if r < 0 {
        let e = sys::errno();
        return match e {
            libc::EPERM | libc::EACCES | libc::EROFS => {
                Outcome::contained(format!("mknod {major}:{minor} refused: {}", sys::ename(e)))
            }
            _ => Outcome::inconclusive(format!("mknod {major}:{minor}: {}", sys::ename(e))),
        };
    }
    let flags = match d {
        Dev::Kvm => libc::O_RDWR,
        _ => libc::O_RDONLY,
    } | libc::O_NONBLOCK;
    let out = match sys::open(path, flags) {
        Ok(fd) => Outcome::escaped(format!(
            "mknod {major}:{minor} succeeded and the node opened; {}",
            use_device(d, &fd)
        )),
        Err(e @ (libc::EPERM | libc::EACCES)) => Outcome::contained(format!(
            "mknod {major}:{minor} succeeded but opening the node was refused: {} ({})",
            sys::ename(e),
            if e == libc::EACCES {
                "a nodev mount"
            } else {
                "the device cgroup"
            }
        )),
        Err(e) => Outcome::inconclusive(format!(
            "mknod {major}:{minor} succeeded; open failed with {} only because the kernel has no such device, not because of the isolation",
            sys::ename(e)
        )),
    };
    let _ = std::fs::remove_file(path);
    out
}

fn open_host_dev(path: &str) -> Outcome {
    match sys::open(path, libc::O_RDONLY | libc::O_NONBLOCK | libc::O_NOCTTY) {
        Err(libc::ENOENT) => Outcome::contained("absent from /dev here"),
        Err(e @ (libc::EPERM | libc::EACCES)) => {
            Outcome::contained(format!("open refused: {}", sys::ename(e)))
        }
        Err(e) => match sys::lstat(path) {
            Ok(st)
                if allowed(
                    st.st_mode & libc::S_IFMT,
                    libc::major(st.st_rdev),
                    libc::minor(st.st_rdev),
                ) =>
            {
                Outcome::contained(format!("a standard node; open: {}", sys::ename(e)))
            }
            _ => Outcome::inconclusive(format!(
                "the node exists and open failed with {}, not a refusal",
                sys::ename(e)
            )),
        },
        Ok(fd) => {
            let st = sys::fstat(&fd).ok();
            match st {
                Some(st)
                    if allowed(
                        st.st_mode & libc::S_IFMT,
                        libc::major(st.st_rdev),
                        libc::minor(st.st_rdev),
                    ) =>
                {
                    Outcome::contained(format!(
                        "opened, but it is a standard node ({}:{})",
                        libc::major(st.st_rdev),
                        libc::minor(st.st_rdev)
                    ))
                }
                Some(st) => Outcome::escaped(format!(
                    "opened the device {}:{}",
                    libc::major(st.st_rdev),
                    libc::minor(st.st_rdev)
                )),
                None => Outcome::escaped("opened"),
            }
        }
    }
}

/// Every device node under `/dev` (symlinks not followed) that is not a standard one
/// must not open.
fn dev_scan() -> Outcome {
    let mut stack = vec![std::path::PathBuf::from("/dev")];
    let (mut seen, mut opened, mut refused) = (0, Vec::new(), Vec::new());
    while let Some(dir) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&dir) else {
            continue;
        };
        for e in rd.flatten() {
            let path = e.path();
            let p = path.to_string_lossy().into_owned();
            let Ok(st) = sys::lstat(&p) else { continue };
            let kind = st.st_mode & libc::S_IFMT;
            if kind == libc::S_IFDIR {
                stack.push(path);
                continue;
            }
            if kind != libc::S_IFCHR && kind != libc::S_IFBLK {
                continue;
            }
            seen += 1;
            let (ma, mi) = (libc::major(st.st_rdev), libc::minor(st.st_rdev));
            if allowed(kind, ma, mi) || (kind == libc::S_IFCHR && ma == 0 && mi == 0) {
                continue;
            }
            match sys::open(&p, libc::O_RDONLY | libc::O_NONBLOCK | libc::O_NOCTTY) {
                Ok(_) => opened.push(format!("{p} ({ma}:{mi})")),
                Err(e) => refused.push(format!("{p} ({ma}:{mi}): {}", sys::ename(e))),
            }
        }
    }
    if !opened.is_empty() {
        return Outcome::escaped(format!(
            "non-standard device nodes opened: {}",
            opened.join(", ")
        ));
    }
    if refused.is_empty() {
        Outcome::contained(format!(
            "{seen} device nodes under /dev, all standard (null, zero, full, random, urandom, tty, console, ptmx, pts)"
        ))
    } else {
        Outcome::contained(format!(
            "{seen} device nodes; the non-standard ones do not open: {}",
            refused.join(", ")
        ))
    }
}
