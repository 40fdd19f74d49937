//! System calls per request of a proxy under load: counted for a window of
//! a few seconds by `perf stat` on the kernel's syscall tracepoints (or, if
//! those are not available, by `strace -c`), attached to the proxy's threads
//! or processes only, and divided by the requests the upstream served in the
//! same window (every proxied request reaches it exactly once; perf's
//! workload reads the upstream's count when the window opens and closes).

use std::path::Path;
use std::process::{Command, Stdio};

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
    /// Requests per second in the window (while counted).
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
/// (the caller keeps one going for longer than that). `served_url` answers
/// with the upstream's running count of requests (read by perf's workload
/// at the start and the end of its window, so both counts cover the same
/// time); `served()` is that count, for strace (`BENCH_SYSCALLS=strace`
/// uses strace even where perf works). `None` when neither can count here.
pub fn measure(
    attach: &Attach,
    secs: u64,
    served_url: &str,
    served: impl Fn() -> u64,
) -> Option<PerRequest> {
    let perf_ok = std::env::var("BENCH_SYSCALLS").as_deref() != Ok("strace");
    let counted = match tracefs().filter(|_| perf_ok) {
        Some(fs) => perf(fs, attach, secs, served_url),
        None => None,
    }
    .or_else(|| strace(attach, secs, served))?;
    let requests = counted.requests.max(1) as f64;
    let mut by_name: Vec<(String, f64)> = counted
        .by_name
        .into_iter()
        .filter(|(_, n)| *n > 0.0)
        .map(|(name, n)| (name, n / requests))
        .collect();
    let named: f64 = by_name.iter().map(|(_, n)| n).sum();
    let total = counted.total / requests;
    if total - named > 0.005 {
        by_name.push(("other".into(), total - named));
    }
    by_name.sort_by(|a, b| b.1.total_cmp(&a.1));
    Some(PerRequest {
        total,
        by_name,
        rps: requests / secs as f64,
        tool: counted.tool,
    })
}

/// Syscalls counted in a window, and the requests served in it.
struct Counted {
    tool: &'static str,
    total: f64,
    by_name: Vec<(String, f64)>,
    requests: u64,
}

fn perf(fs: &str, attach: &Attach, secs: u64, served_url: &str) -> Option<Counted> {
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
    // The counters run exactly while the workload does: it reads the
    // upstream's count first and last.
    let workload = format!("curl -s {served_url}; echo; sleep {secs}; curl -s {served_url}; echo");
    let out = Command::new("perf")
        .args(["stat", "--no-big-num", "-x", ",", "-e", &events.join(",")])
        .args([flag, &ids.join(",")])
        .args(["--", "sh", "-c", &workload])
        .output()
        .ok()?;
    let marks: Vec<u64> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect();
    let [first, last] = marks[..] else {
        return None;
    };
    // value,unit,event,...
    let text = String::from_utf8_lossy(&out.stderr);
    let mut total = None;
    let mut by_name = Vec::new();
    for line in text.lines() {
        let f: Vec<&str> = line.split(',').collect();
        let (Some(value), Some(event)) = (f.first(), f.get(2)) else {
            continue;
        };
        let Ok(value) = value.parse::<f64>() else {
            continue;
        };
        match event.strip_prefix("syscalls:sys_enter_") {
            Some(name) => by_name.push((name.to_string(), value)),
            None if *event == "raw_syscalls:sys_enter" => total = Some(value),
            None => {}
        }
    }
    Some(Counted {
        tool: "perf",
        total: total?,
        by_name,
        requests: last.saturating_sub(first),
    })
}

fn strace(attach: &Attach, secs: u64, served: impl Fn() -> u64) -> Option<Counted> {
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
    let before = served();
    cmd.stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .ok()?;
    let requests = served().saturating_sub(before);
    // % time, seconds, usecs/call, calls, [errors,] syscall
    let text = std::fs::read_to_string(&file).ok()?;
    let mut total = None;
    let mut by_name = Vec::new();
    for line in text.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        let (Some(name), Some(calls)) = (f.last(), f.get(3)) else {
            continue;
        };
        let Ok(calls) = calls.parse::<f64>() else {
            continue;
        };
        if *name == "total" {
            total = Some(calls);
        } else {
            by_name.push((name.to_string(), calls));
        }
    }
    Some(Counted {
        tool: "strace",
        total: total?,
        by_name,
        requests,
    })
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
