//! What the sandbox can see of and do to its neighbours and the host: processes,
//! namespaces, the seccomp filter, ptrace of PID 1, raw sockets, its own network
//! configuration, its hostname.

use crate::sys::{self, Fd};
use crate::{Attempt, Config, Outcome};

pub fn attempts(_cfg: &Config) -> Vec<Attempt> {
    vec![
        Attempt::new("host-processes-invisible", host_processes_invisible),
        Attempt::new("namespaces-distinct", namespaces_distinct),
        Attempt::new("seccomp-filter-on", |_| seccomp_on()),
        Attempt::new("ptrace-pid1", |_| ptrace_pid1()),
        Attempt::new("proc-pid1-mem-write", |_| pid1_mem()),
        Attempt::new("process-vm-readv-pid1", |_| vm_readv_pid1()),
        Attempt::new("raw-socket-inet", |_| {
            raw_socket(libc::AF_INET, libc::SOCK_RAW, libc::IPPROTO_RAW)
        }),
        Attempt::new("raw-socket-packet", |_| {
            raw_socket(
                libc::AF_PACKET,
                libc::SOCK_RAW,
                i32::from((libc::ETH_P_ALL as u16).to_be()),
            )
        }),
        Attempt::new("net-admin-mtu", |_| net_admin_mtu()),
        Attempt::new("net-admin-addr", |_| net_admin_addr()),
        Attempt::new("net-admin-route", |_| net_admin_route()),
        Attempt::new("sethostname", sethostname),
    ]
}

/// Command names of every visible process.
fn processes() -> Vec<(i32, String)> {
    let mut out = Vec::new();
    if let Ok(rd) = std::fs::read_dir("/proc") {
        for e in rd.flatten() {
            let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
                continue;
            };
            let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
            out.push((pid, comm.trim().to_string()));
        }
    }
    out.sort();
    out
}

fn host_processes_invisible(cfg: &Config) -> Outcome {
    let procs = processes();
    if procs.is_empty() {
        return Outcome::inconclusive("/proc lists no process");
    }
    // Kernel threads live in the host's PID namespace only.
    let kernel_thread =
        |c: &str| c == "kthreadd" || c.starts_with("kworker/") || c.starts_with("ksoftirqd/");
    let seen: Vec<String> = procs
        .iter()
        .filter(|(_, c)| kernel_thread(c) || cfg.host_comms.iter().any(|h| !h.is_empty() && c == h))
        .map(|(p, c)| format!("{p} {c}"))
        .collect();
    let pid1 = procs
        .iter()
        .find(|(p, _)| *p == 1)
        .map(|(_, c)| c.clone())
        .unwrap_or_default();
    if !seen.is_empty() {
        return Outcome::escaped(format!("host processes visible: {}", seen.join(", ")));
    }
    if pid1 != "agentenv-guest" {
        return Outcome::escaped(format!(
            "PID 1 is {pid1:?}, not the agent: not the sandbox's own PID namespace"
        ));
    }
    if cfg.host_comms.is_empty() {
        return Outcome::inconclusive(format!(
            "PID 1 is the agent and no kernel thread is visible ({} processes), but the harness named no host process to look for",
            procs.len()
        ));
    }
    Outcome::contained(format!(
        "{} processes, PID 1 is the agent, none of {:?} nor any kernel thread visible",
        procs.len(),
        cfg.host_comms
    ))
}

fn namespaces_distinct(cfg: &Config) -> Outcome {
    if cfg.host_ns.is_empty() {
        return Outcome::inconclusive("the harness did not pass --host-ns");
    }
    let mut shared = Vec::new();
    let mut distinct = Vec::new();
    for (kind, host) in &cfg.host_ns {
        match sys::readlink(&format!("/proc/self/ns/{kind}")) {
            Some(mine) if &mine == host => shared.push(kind.clone()),
            Some(_) => distinct.push(kind.clone()),
            None => {}
        }
    }
    if shared.is_empty() {
        Outcome::contained(format!(
            "own namespaces: {} (none shared with the host)",
            distinct.join(", ")
        ))
    } else {
        Outcome::escaped(format!(
            "namespaces shared with the host: {} (own: {})",
            shared.join(", "),
            distinct.join(", ")
        ))
    }
}

fn seccomp_on() -> Outcome {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |k: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(k))
            .map(|v| v.trim().to_string())
            .unwrap_or_default()
    };
    let (mode, nnp, filters) = (
        field("Seccomp:"),
        field("NoNewPrivs:"),
        field("Seccomp_filters:"),
    );
    if mode == "2" && nnp == "1" {
        Outcome::contained(format!(
            "Seccomp: 2 (filter, {filters} filters), NoNewPrivs: 1"
        ))
    } else {
        Outcome::escaped(format!(
            "Seccomp: {mode:?}, NoNewPrivs: {nnp:?}: processes run without a seccomp filter"
        ))
    }
}

fn ptrace_pid1() -> Outcome {
    // SAFETY: PTRACE_ATTACH takes no pointers.
    let r = unsafe {
        libc::ptrace(
            libc::PTRACE_ATTACH,
            1,
            std::ptr::null_mut::<libc::c_void>(),
            std::ptr::null_mut::<libc::c_void>(),
        )
    };
    if r == 0 {
        let _ = sys::wait(1);
        // SAFETY: PTRACE_DETACH takes no pointers.
        unsafe {
            libc::ptrace(
                libc::PTRACE_DETACH,
                1,
                std::ptr::null_mut::<libc::c_void>(),
                std::ptr::null_mut::<libc::c_void>(),
            )
        };
        return Outcome::escaped("attached to PID 1 with ptrace (detached again)");
    }
    refusal("ptrace(PTRACE_ATTACH, 1)", sys::errno())
}

fn pid1_mem() -> Outcome {
    match sys::open("/proc/1/mem", libc::O_RDWR) {
        Ok(_) => Outcome::escaped("opened /proc/1/mem for writing"),
        Err(e) => refusal("open /proc/1/mem read-write", e),
    }
}

fn vm_readv_pid1() -> Outcome {
    let mut buf = [0u8; 8];
    let local = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // Some address of PID 1: the start of its first mapping.
    let maps = std::fs::read_to_string("/proc/1/maps").unwrap_or_default();
    let addr = maps
        .lines()
        .next()
        .and_then(|l| l.split('-').next())
        .and_then(|a| usize::from_str_radix(a, 16).ok())
        .unwrap_or(0x400000);
    let remote = libc::iovec {
        iov_base: addr as *mut libc::c_void,
        iov_len: buf.len(),
    };
    // SAFETY: one local iovec pointing at `buf`; the remote one is only read by the
    // kernel in PID 1's address space.
    let r = unsafe { libc::process_vm_readv(1, &local, 1, &remote, 1, 0) };
    if r >= 0 {
        return Outcome::escaped(format!("read {r} bytes of PID 1's memory"));
    }
    refusal("process_vm_readv(1)", sys::errno())
}

/// A refusal errno is containment; anything else is inconclusive.
fn refusal(what: &str, e: i32) -> Outcome {
    match e {
        libc::EPERM | libc::EACCES | libc::ENOSYS => {
            Outcome::contained(format!("{what} refused: {}", sys::ename(e)))
        }
        _ => Outcome::inconclusive(format!("{what}: {}", sys::ename(e))),
    }
}

fn raw_socket(domain: i32, ty: i32, proto: i32) -> Outcome {
    // SAFETY: socket takes no pointers.
    let fd = unsafe { libc::socket(domain, ty | libc::SOCK_CLOEXEC, proto) };
    if fd >= 0 {
        drop(Fd(fd));
        return Outcome::escaped("a raw socket opened (packets with any source address)");
    }
    match sys::errno() {
        e @ (libc::EPERM | libc::EACCES | libc::ENOSYS | libc::EAFNOSUPPORT) => {
            Outcome::contained(format!("socket refused: {}", sys::ename(e)))
        }
        e => Outcome::inconclusive(format!("socket: {}", sys::ename(e))),
    }
}

fn ifreq(name: &str) -> libc::ifreq {
    // SAFETY: an all-zero ifreq is a valid value of this plain C struct.
    let mut r: libc::ifreq = unsafe { std::mem::zeroed() };
    for (d, s) in r.ifr_name.iter_mut().zip(name.bytes()) {
        *d = s as libc::c_char;
    }
    r
}

fn inet_socket() -> Result<Fd, i32> {
    // SAFETY: socket takes no pointers.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        Err(sys::errno())
    } else {
        Ok(Fd(fd))
    }
}

/// The sandbox's interface: the first one that is not `lo`.
fn iface() -> String {
    std::fs::read_dir("/sys/class/net")
        .ok()
        .and_then(|rd| {
            rd.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .find(|n| n != "lo")
        })
        .unwrap_or_else(|| "eth0".into())
}

fn net_admin_mtu() -> Outcome {
    let s = match inet_socket() {
        Ok(s) => s,
        Err(e) => return Outcome::inconclusive(format!("socket: {}", sys::ename(e))),
    };
    let dev = iface();
    let mut r = ifreq(&dev);
    // SAFETY: `r` is a valid ifreq for SIOCGIFMTU to fill.
    if unsafe { libc::ioctl(s.0, libc::SIOCGIFMTU as _, &mut r) } < 0 {
        return Outcome::inconclusive(format!("SIOCGIFMTU {dev}: {}", sys::ename(sys::errno())));
    }
    // The same MTU again: a success changes nothing but proves CAP_NET_ADMIN.
    // SAFETY: `r` holds the interface name and its current MTU.
    if unsafe { libc::ioctl(s.0, libc::SIOCSIFMTU as _, &mut r) } == 0 {
        return Outcome::escaped(format!(
            "set the MTU of {dev} (to its current value): CAP_NET_ADMIN is held"
        ));
    }
    refusal(&format!("SIOCSIFMTU {dev}"), sys::errno())
}

fn sockaddr_in(ip: [u8; 4]) -> libc::sockaddr {
    let sin = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: 0,
        sin_addr: libc::in_addr {
            s_addr: u32::from_ne_bytes(ip),
        },
        sin_zero: [0; 8],
    };
    // SAFETY: sockaddr_in and sockaddr have the same size; this is the C cast.
    unsafe { std::mem::transmute::<libc::sockaddr_in, libc::sockaddr>(sin) }
}

fn net_admin_addr() -> Outcome {
    let s = match inet_socket() {
        Ok(s) => s,
        Err(e) => return Outcome::inconclusive(format!("socket: {}", sys::ename(e))),
    };
    // A secondary address (a legacy alias) from TEST-NET-2: it does not disturb eth0.
    let alias = format!("{}:9", iface());
    let mut r = ifreq(&alias);
    r.ifr_ifru.ifru_addr = sockaddr_in([198, 51, 100, 77]);
    // SAFETY: `r` holds the alias name and an AF_INET address.
    if unsafe { libc::ioctl(s.0, libc::SIOCSIFADDR as _, &mut r) } == 0 {
        let mut down = ifreq(&alias);
        // SAFETY: `down` holds the alias name; flags 0 take the alias down (removes it).
        unsafe {
            down.ifr_ifru.ifru_flags = 0;
            libc::ioctl(s.0, libc::SIOCSIFFLAGS as _, &mut down);
        }
        return Outcome::escaped(format!(
            "added the address 198.51.100.77 to {alias} (removed again): the sandbox can change its addresses"
        ));
    }
    refusal(&format!("SIOCSIFADDR {alias}"), sys::errno())
}

fn net_admin_route() -> Outcome {
    let s = match inet_socket() {
        Ok(s) => s,
        Err(e) => return Outcome::inconclusive(format!("socket: {}", sys::ename(e))),
    };
    let dev = sys::cstr(&iface());
    // SAFETY: an all-zero rtentry is a valid value of this plain C struct.
    let mut rt: libc::rtentry = unsafe { std::mem::zeroed() };
    rt.rt_dst = sockaddr_in([203, 0, 113, 0]);
    rt.rt_genmask = sockaddr_in([255, 255, 255, 0]);
    rt.rt_flags = libc::RTF_UP;
    rt.rt_dev = dev.as_ptr() as *mut libc::c_char;
    // SAFETY: `rt` is a filled rtentry whose device name (`dev`) outlives the call.
    if unsafe { libc::ioctl(s.0, libc::SIOCADDRT as _, &mut rt) } == 0 {
        // SAFETY: the same entry, to delete the route again.
        unsafe { libc::ioctl(s.0, libc::SIOCDELRT as _, &mut rt) };
        return Outcome::escaped(
            "added a route to 203.0.113.0/24 (removed again): the sandbox can change its routes",
        );
    }
    refusal("SIOCADDRT", sys::errno())
}

fn sethostname(cfg: &Config) -> Outcome {
    let current = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let name = current.trim();
    if name.is_empty() {
        return Outcome::inconclusive("cannot read the current hostname");
    }
    // The current name again: even in the host's UTS namespace nothing would change.
    // SAFETY: `name` is valid for `name.len()` bytes across the call.
    let r = unsafe { libc::sethostname(name.as_ptr().cast(), name.len()) };
    if r < 0 {
        return refusal("sethostname", sys::errno());
    }
    let mine = sys::readlink("/proc/self/ns/uts");
    let host = cfg
        .host_ns
        .iter()
        .find(|(k, _)| k == "uts")
        .map(|(_, v)| v.clone());
    match (mine, host) {
        (Some(m), Some(h)) if m != h => Outcome::contained(format!(
            "sethostname is allowed, but in the sandbox's own UTS namespace ({m}, the host's is {h})"
        )),
        (Some(m), Some(_)) => Outcome::escaped(format!(
            "sethostname succeeded in the host's UTS namespace ({m})"
        )),
        _ => Outcome::inconclusive(
            "sethostname succeeded and the harness did not pass the host's UTS namespace",
        ),
    }
}
