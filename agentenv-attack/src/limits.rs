//! Resources a tenant can exhaust: processes (fork bomb), memory, the writable layer's
//! disk, inotify instances and watches. Each stops at a bound of its own (a multiple of
//! the sandbox's limit) so that a missing cap shows as an escape without taking the
//! host down; what an attempt created goes away with its process or its cleanup.

use std::io::Write;
use std::time::Duration;

use crate::sys::{self, Fd};
use crate::{Attempt, Config, Outcome};

const FILL_NAME: &str = ".attack-fill";
const MIB: u64 = 1 << 20;

pub fn attempts(_cfg: &Config) -> Vec<Attempt> {
    let mut v = vec![
        Attempt::new("fork-bomb", fork_bomb).timeout(Duration::from_secs(90)),
        Attempt::new("memory-bomb", memory_bomb).timeout(Duration::from_secs(90)),
    ];
    let mut dirs = vec!["/root"];
    // /tmp counts separately when it is a filesystem of its own.
    let dev = |p: &str| sys::lstat(p).ok().map(|s| s.st_dev);
    if dev("/tmp").is_some() && dev("/tmp") != dev("/root") {
        dirs.push("/tmp");
    }
    for dir in dirs {
        let file = format!("{dir}/{FILL_NAME}");
        let f2 = file.clone();
        v.push(
            Attempt::new(format!("disk-fill:{dir}"), move |cfg| disk_fill(&file, cfg))
                .timeout(Duration::from_secs(300))
                .cleanup(move || {
                    let _ = std::fs::remove_file(&f2);
                }),
        );
    }
    v.push(Attempt::new("inotify-exhaust", inotify_exhaust).timeout(Duration::from_secs(120)));
    v
}

fn fork_bomb(cfg: &Config) -> Outcome {
    let mut pids = Vec::new();
    let mut err = None;
    while (pids.len() as u64) < cfg.fork_max {
        match sys::fork_child(|| {
            loop {
                // SAFETY: pause takes no arguments; the child waits for its SIGKILL.
                unsafe { libc::pause() };
            }
        }) {
            Ok(pid) => pids.push(pid),
            Err(e) => {
                err = Some(e);
                break;
            }
        }
    }
    let n = pids.len();
    for p in &pids {
        // SAFETY: a signal to a child of this process.
        unsafe { libc::kill(*p, libc::SIGKILL) };
    }
    for p in &pids {
        let _ = sys::wait(*p);
    }
    match err {
        Some(e @ (libc::EAGAIN | libc::ENOMEM)) => Outcome::contained(format!(
            "fork failed with {} after {n} processes ({})",
            sys::ename(e),
            if e == libc::EAGAIN {
                "the pids limit"
            } else {
                "the memory limit"
            }
        )),
        Some(e) => Outcome::inconclusive(format!("fork failed with {} after {n}", sys::ename(e))),
        None => Outcome::escaped(format!(
            "forked {n} processes (--fork-max) without reaching a limit"
        )),
    }
}

fn memory_bomb(cfg: &Config) -> Outcome {
    let mut fds = [0i32; 2];
    // SAFETY: `fds` has room for the two descriptors pipe2 returns.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } < 0 {
        return Outcome::inconclusive(format!("pipe: {}", sys::ename(sys::errno())));
    }
    let (rd, wr) = (Fd(fds[0]), Fd(fds[1]));
    let target = cfg.memory_mb.saturating_mul(2).max(64) * MIB;
    let chunk = 16 * MIB;
    let child = sys::fork_child(|| {
        // The bomb is the process the OOM killer should pick.
        let _ = std::fs::write("/proc/self/oom_score_adj", "1000");
        let mut total = 0u64;
        while total < target {
            // SAFETY: an anonymous private mapping; no existing memory is touched.
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    chunk as usize,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            };
            if p == libc::MAP_FAILED {
                return 3;
            }
            let p = p.cast::<u8>();
            let mut off = 0;
            while off < chunk as usize {
                // SAFETY: `off` is inside the `chunk`-byte mapping made above.
                unsafe { p.add(off).write_volatile(1) };
                off += 4096;
            }
            total += chunk;
            let _ = sys::write(&wr, &(total / MIB).to_ne_bytes());
        }
        0
    });
    let pid = match child {
        Ok(p) => p,
        Err(e) => return Outcome::inconclusive(format!("fork: {}", sys::ename(e))),
    };
    drop(wr);
    let mut last = 0u64;
    loop {
        let mut b = [0u8; 8];
        // SAFETY: `b` has room for the 8 bytes read.
        let n = unsafe { libc::read(rd.0, b.as_mut_ptr().cast(), 8) };
        if n == 8 {
            last = u64::from_ne_bytes(b);
        } else if n < 0 && sys::errno() == libc::EINTR {
            continue;
        } else {
            break;
        }
    }
    let limit = cfg.memory_mb;
    match sys::wait(pid) {
        Some(sys::Ended::Signaled(libc::SIGKILL)) => Outcome::contained(format!(
            "the bomb was OOM-killed after touching {last} MiB (limit {limit} MiB); the attacker survived"
        )),
        Some(sys::Ended::Exited(3)) => {
            Outcome::contained(format!("mmap refused after {last} MiB (limit {limit} MiB)"))
        }
        Some(sys::Ended::Exited(0)) => Outcome::escaped(format!(
            "allocated and touched {last} MiB, past the limit of {limit} MiB, without being stopped"
        )),
        other => Outcome::inconclusive(format!("the bomb ended with {other:?} after {last} MiB")),
    }
}

fn disk_fill(file: &str, cfg: &Config) -> Outcome {
    let limit = (cfg.disk_cap_mb + cfg.disk_slack_mb) * MIB;
    let fd = match sys::open(file, libc::O_WRONLY | libc::O_CREAT | libc::O_TRUNC) {
        Ok(fd) => fd,
        Err(e) => return Outcome::inconclusive(format!("creating {file}: {}", sys::ename(e))),
    };
    // Incompressible-looking data (a filesystem must not store it sparsely or squeezed).
    let mut buf = vec![0u8; MIB as usize];
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    for b in buf.iter_mut() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8;
    }
    let mut written = 0u64;
    let stop = |e: i32, written: u64| -> Outcome {
        let _ = std::fs::remove_file(file);
        match e {
            libc::ENOSPC | libc::EDQUOT => Outcome::contained(format!(
                "writing stopped with {} after {} MiB (cap {} MiB)",
                sys::ename(e),
                written / MIB,
                cfg.disk_cap_mb
            )),
            _ => Outcome::inconclusive(format!(
                "writing failed with {} after {} MiB",
                sys::ename(e),
                written / MIB
            )),
        }
    };
    while written < limit {
        let mut off = 0;
        while off < buf.len() {
            match sys::write(&fd, &buf[off..]) {
                Ok(n) => off += n,
                Err(libc::EINTR) => {}
                Err(e) => return stop(e, written + off as u64),
            }
        }
        written += buf.len() as u64;
        // Make delayed allocation show its errors now rather than after the loop.
        if written % (64 * MIB) == 0 {
            // SAFETY: fdatasync on a descriptor `fd` owns.
            if unsafe { libc::fdatasync(fd.0) } < 0 {
                return stop(sys::errno(), written);
            }
        }
    }
    // SAFETY: fdatasync on a descriptor `fd` owns.
    if unsafe { libc::fdatasync(fd.0) } < 0 {
        return stop(sys::errno(), written);
    }
    let _ = std::fs::remove_file(file);
    Outcome::escaped(format!(
        "wrote {} MiB, past the cap of {} MiB plus {} MiB slack, without ENOSPC (deleted again)",
        written / MIB,
        cfg.disk_cap_mb,
        cfg.disk_slack_mb
    ))
}

/// Up to `max` regular files and directories under `root` (distinct inodes to watch).
fn watch_candidates(root: &str, max: usize) -> Vec<std::ffi::CString> {
    let mut out = Vec::new();
    let mut stack = vec![std::path::PathBuf::from(root)];
    while let Some(d) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in rd.flatten() {
            if out.len() >= max {
                return out;
            }
            let Ok(ft) = e.file_type() else { continue };
            if ft.is_symlink() {
                continue;
            }
            out.push(sys::cpath(e.path()));
            if ft.is_dir() {
                stack.push(e.path());
            }
        }
    }
    out
}

fn inotify_exhaust(cfg: &Config) -> Outcome {
    // Descriptors are not what this measures: raise their limit to the hard one.
    // SAFETY: an all-zero rlimit is a valid value of this plain C struct.
    let mut rl: libc::rlimit = unsafe { std::mem::zeroed() };
    // SAFETY: `rl` is writable for getrlimit and read by setrlimit.
    unsafe {
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut rl);
        rl.rlim_cur = rl.rlim_max;
        libc::setrlimit(libc::RLIMIT_NOFILE, &rl);
    }
    let nofile = rl.rlim_cur;
    const MAX_INSTANCES: usize = 100_000;
    const MAX_WATCHES: u64 = 2_000_000;
    let mut inst = Vec::new();
    let inst_err = loop {
        if inst.len() >= MAX_INSTANCES {
            break None;
        }
        // SAFETY: inotify_init1 takes flags only.
        let fd = unsafe { libc::inotify_init1(libc::IN_CLOEXEC) };
        if fd < 0 {
            break Some(sys::errno());
        }
        inst.push(Fd(fd));
    };
    let candidates = watch_candidates("/usr", 4096);
    let mut watches = 0u64;
    let mut watch_err = None;
    'outer: for fd in &inst {
        for c in &candidates {
            if watches >= MAX_WATCHES {
                break 'outer;
            }
            // SAFETY: `c` is a NUL-terminated path that outlives the call.
            let wd = unsafe { libc::inotify_add_watch(fd.0, c.as_ptr(), libc::IN_MODIFY) };
            if wd < 0 {
                let e = sys::errno();
                if e == libc::ENOSPC {
                    watch_err = Some(e);
                    break 'outer;
                }
                continue;
            }
            watches += 1;
        }
    }
    if cfg.hold {
        let line = serde_json::json!({
            "holding": "inotify-exhaust",
            "instances": inst.len(),
            "watches": watches,
        });
        let mut out = std::io::stdout();
        let _ = writeln!(out, "{line}");
        let _ = out.flush();
        // Until the harness closes stdin (at most a minute).
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        let mut b = [0u8; 256];
        while std::time::Instant::now() < deadline {
            let mut pfd = libc::pollfd {
                fd: 0,
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd.
            let r = unsafe { libc::poll(&mut pfd, 1, 1000) };
            if r > 0 {
                // SAFETY: `b` has room for the bytes read.
                let n = unsafe { libc::read(0, b.as_mut_ptr().cast(), b.len()) };
                if n <= 0 {
                    break;
                }
            }
        }
    }
    let n = inst.len();
    drop(inst);
    let instances = match inst_err {
        None => {
            return Outcome::escaped(format!("{n} inotify instances without reaching a limit"));
        }
        Some(libc::EMFILE) if (n as u64) + 16 < nofile => {
            format!("{n} inotify instances, then EMFILE (the per-user instance limit)")
        }
        Some(e) => {
            return Outcome::inconclusive(format!(
                "{n} inotify instances, then {} (descriptor limit {nofile}), not the inotify limit",
                sys::ename(e)
            ));
        }
    };
    match watch_err {
        Some(_) => Outcome::contained(format!(
            "{instances}; {watches} watches, then ENOSPC (the per-user watch limit)"
        )),
        None if watches >= MAX_WATCHES => Outcome::escaped(format!(
            "{instances}; {watches} watches without reaching a limit"
        )),
        None => Outcome::contained(format!(
            "{instances}; {watches} watches ({} files × {n} instances) without reaching the watch limit",
            candidates.len()
        )),
    }
}
