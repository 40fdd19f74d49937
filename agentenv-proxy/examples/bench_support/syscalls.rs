//! System calls per request of a proxy under load: counted for a window of
//! a few seconds by `perf stat` on the kernel's syscall tracepoints (or, if
//! those are not available, by `strace -c`), attached to the proxy's threads
//! or processes only, and divided by the requests the upstream served in the
//! same window (every proxied request reaches it exactly once).

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Instant;

/// Syscalls a proxy may make per request; the rest are counted in the total
/// (`raw_syscalls:sys_enter`) and shown as "other".
const NAMED: &[&str] = &[
    "read",
    "write",
    "readv",
    "writev",
    "recvfrom",
    "sendto",
    "recvmsg",
    "sendmsg",
    "epoll_wait",
    "epoll_pwait",
    "epoll_pwait2",
    "epoll_ctl",
    "futex",
    "accept4",
    "close",
    "sched_yield",
    "clock_gettime",
    "ioctl",
    "setsockopt",
    "getsockopt",
    "mmap",
    "munmap",
    "madvise",
    "brk",
    "mprotect",
    "io_uring_enter",
    "splice",
    "getrandom",
];

/// What the counts are attached to.
#[derive(Clone, Debug)]
pub enum Attach {
    /// These threads (of this process).
    Threads(Vec<u32>),
    /// These processes, all their threads.
    Processes(Vec<u32>),
}

/// System calls per request, by name (most frequent first) and in total.
#[derive(Clone, Debug)]
pub struct PerRequest {
    pub total: f64,
    pub by_name: Vec<(String, f64)>,
    /// Requests per second in the window (under the counting tool).
    pub rps: f64,
    /// "perf" or "strace".
    pub tool: &'static str,
}

impl PerRequest {
    /// One line: the total, then the `top` most frequent calls.
    pub fn line(&self, top: usize) -> String {
        let mut s = format!("{:.2} total:", self.total);
        for (name, n) in self.by_name.iter().take(top) {
            s.push_str(&format!(" {name} {n:.2}"));
        }
        s
    }
}

fn tracefs() -> Option<&'static str> {
    ["/sys/kernel/tracing", "/sys/kernel/debug/tracing"]
        .into_iter()
        .find(|d| Path::new(&format!("{d}/events/raw_syscalls/sys_enter")).exists())
}

/// Counts the syscalls of `attach` for `secs` seconds while a load runs
/// (the caller keeps one going for longer than that), with `served()` the
/// upstream's running count of requests. `None` when neither perf nor
/// strace can count here.
pub fn measure(attach: &Attach, secs: u64, served: impl Fn() -> u64) -> Option<PerRequest> {
    let (before, t0) = (served(), Instant::now());
    let counted = match tracefs() {
        Some(fs) => perf(fs, attach, secs),
        None => None,
    }
    .or_else(|| strace(attach, secs))?;
    let rps = (served() - before) as f64 / t0.elapsed().as_secs_f64();
    let (tool, total_rate, rates) = counted;
    let mut by_name: Vec<(String, f64)> = rates
        .into_iter()
        .filter(|(_, r)| *r > 0.0)
        .map(|(n, r)| (n, r / rps))
        .collect();
    let named: f64 = by_name.iter().map(|(_, n)| n).sum();
    let total = total_rate / rps;
    if total - named > 0.005 {
        by_name.push(("other".into(), total - named));
    }
    by_name.sort_by(|a, b| b.1.total_cmp(&a.1));
    Some(PerRequest {
        total,
        by_name,
        rps,
        tool,
    })
}

/// Total syscalls and each named one, per second, from perf's tracepoints.
type Rates = (&'static str, f64, Vec<(String, f64)>);

fn perf(fs: &str, attach: &Attach, secs: u64) -> Option<Rates> {
    let mut events = vec!["raw_syscalls:sys_enter".to_string()];
    events.extend(
        NAMED
            .iter()
            .filter(|n| Path::new(&format!("{fs}/events/syscalls/sys_enter_{n}")).exists())
            .map(|n| format!("syscalls:sys_enter_{n}")),
    );
    let (flag, ids) = match attach {
        Attach::Threads(t) => ("-t", t),
        Attach::Processes(p) => ("-p", p),
    };
    let ids: Vec<String> = ids.iter().map(u32::to_string).collect();
    let out = Command::new("perf")
        .args(["stat", "--no-big-num", "-x", ",", "-e", &events.join(",")])
        .args([flag, &ids.join(",")])
        .args(["--timeout", &(secs * 1000).to_string()])
        .stdout(Stdio::null())
        .output()
        .ok()?;
    // value,unit,event,... over the `--timeout` window (a per-thread
    // event's "enabled" time only runs while its thread does, so it is
    // not the window).
    let text = String::from_utf8_lossy(&out.stderr);
    let mut total = None;
    let mut rates = Vec::new();
    for line in text.lines() {
        let f: Vec<&str> = line.split(',').collect();
        let (Some(value), Some(event)) = (f.first(), f.get(2)) else {
            continue;
        };
        let Ok(value) = value.parse::<f64>() else {
            continue;
        };
        let rate = value / secs as f64;
        match event.strip_prefix("syscalls:sys_enter_") {
            Some(name) => rates.push((name.to_string(), rate)),
            None if *event == "raw_syscalls:sys_enter" => total = Some(rate),
            None => {}
        }
    }
    Some(("perf", total?, rates))
}

fn strace(attach: &Attach, secs: u64) -> Option<Rates> {
    let dir = tempfile::tempdir().ok()?;
    let file = dir.path().join("strace.txt");
    let mut cmd = Command::new("timeout");
    cmd.args(["-s", "INT", &secs.to_string(), "strace", "-c", "-q", "-o"])
        .arg(&file);
    match attach {
        Attach::Threads(ids) => ids.iter().for_each(|t| {
            cmd.args(["-p", &t.to_string()]);
        }),
        Attach::Processes(ids) => {
            cmd.arg("-f");
            ids.iter().for_each(|p| {
                cmd.args(["-p", &p.to_string()]);
            });
        }
    }
    let t0 = Instant::now();
    cmd.stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .ok()?;
    let wall = t0.elapsed().as_secs_f64();
    // % time, seconds, usecs/call, calls, [errors,] syscall
    let text = std::fs::read_to_string(&file).ok()?;
    let mut total = None;
    let mut rates = Vec::new();
    for line in text.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        let (Some(name), Some(calls)) = (f.last(), f.get(3)) else {
            continue;
        };
        let Ok(calls) = calls.parse::<f64>() else {
            continue;
        };
        if *name == "total" {
            total = Some(calls / wall);
        } else {
            rates.push((name.to_string(), calls / wall));
        }
    }
    Some(("strace", total?, rates))
}

/// The ids of this process's threads named `prefix…`.
pub fn threads_named(prefix: &str) -> Vec<u32> {
    std::fs::read_dir("/proc/self/task")
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| {
            std::fs::read_to_string(e.path().join("comm")).is_ok_and(|c| c.starts_with(prefix))
        })
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .collect()
}
