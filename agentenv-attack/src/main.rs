//! `sandbox-attack`: escape attempts, run as root inside a sandbox by the attack suite
//! (`tests/tests/attack_suite.rs`).
//!
//! ```text
//! sandbox-attack all|list|<name>[,<name>…]|<prefix>* [options]
//!   --host-ports ip:port,…   host services that must be unreachable; `gateway:<port>`
//!                            is the sandbox's default gateway, `[fe80::1%eth0]:port` works
//!   --peer ip:port,…         other sandboxes' agents (unreachable)
//!   --block-dev MAJ:MIN      the host's root disk (mknod of a block node of it)
//!   --host-comm a,b          command names of host processes (never visible here)
//!   --host-ns user:[…],mnt:[…],…   the host's namespaces (`readlink /proc/<pid>/ns/*`)
//!   --disk-cap-mb N          the sandbox's disk cap (default 1024), --disk-slack-mb N (64)
//!   --memory-mb N            the sandbox's memory limit (default 512)
//!   --fork-max N             forks counted as "no cap" (default 5000)
//!   --connect-timeout-ms N   TCP connect timeout (default 1000)
//!   --hold                   inotify-exhaust holds what it took until stdin closes
//! ```
//!
//! Every attempt runs in a forked child (its own process group) so that one that
//! succeeds, crashes or is killed cannot disturb the others. One JSON line per attempt:
//! `{"attempt": "...", "contained": true|false, "detail": "what happened"}`, then
//! `{"summary": {"attempts": N, "contained": N, "escaped": N}}`. `contained` means the
//! attempt failed the way it should; an attempt that could not be tried counts as
//! contained only when the isolation itself stopped it, and the detail says so. The
//! program never writes to a device, never changes a host setting to a new value, and
//! undoes what a successful attempt created.

mod devices;
mod isolation;
mod kernelfs;
mod limits;
mod mounts;
mod network;
mod sys;
mod syscalls;

use std::io::Write;
use std::time::{Duration, Instant};

/// What the harness tells the attacker about the host.
#[derive(Debug, Clone)]
pub struct Config {
    pub host_ports: Vec<String>,
    pub peers: Vec<String>,
    pub block_dev: Option<(u32, u32)>,
    pub host_comms: Vec<String>,
    pub host_ns: Vec<(String, String)>,
    pub disk_cap_mb: u64,
    pub disk_slack_mb: u64,
    pub memory_mb: u64,
    pub fork_max: u64,
    pub connect_timeout: Duration,
    pub hold: bool,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            host_ports: Vec::new(),
            peers: Vec::new(),
            block_dev: None,
            host_comms: Vec::new(),
            host_ns: Vec::new(),
            disk_cap_mb: 1024,
            disk_slack_mb: 64,
            memory_mb: 512,
            fork_max: 5000,
            connect_timeout: Duration::from_millis(1000),
            hold: false,
        }
    }
}

/// The result of one attempt.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub contained: bool,
    pub detail: String,
}

impl Outcome {
    pub fn contained(detail: impl Into<String>) -> Self {
        Self {
            contained: true,
            detail: detail.into(),
        }
    }

    pub fn escaped(detail: impl Into<String>) -> Self {
        Self {
            contained: false,
            detail: detail.into(),
        }
    }

    /// Neither proven contained nor an escape: counted as not contained, so that it is
    /// looked at.
    pub fn inconclusive(detail: impl Into<String>) -> Self {
        Self {
            contained: false,
            detail: format!("inconclusive: {}", detail.into()),
        }
    }
}

type RunFn = Box<dyn Fn(&Config) -> Outcome>;
type SignalFn = fn(i32) -> Option<Outcome>;

/// One escape attempt.
pub struct Attempt {
    pub name: String,
    pub timeout: Duration,
    pub run: RunFn,
    /// How a child killed by a signal counts (default: inconclusive).
    pub on_signal: Option<SignalFn>,
    /// Run in the parent after the child ended (removes what the attempt created).
    pub cleanup: Option<Box<dyn Fn()>>,
}

impl Attempt {
    pub fn new(name: impl Into<String>, run: impl Fn(&Config) -> Outcome + 'static) -> Self {
        Self {
            name: name.into(),
            timeout: Duration::from_secs(15),
            run: Box::new(run),
            on_signal: None,
            cleanup: None,
        }
    }

    pub fn timeout(mut self, t: Duration) -> Self {
        self.timeout = t;
        self
    }

    pub fn on_signal(mut self, f: SignalFn) -> Self {
        self.on_signal = Some(f);
        self
    }

    pub fn cleanup(mut self, f: impl Fn() + 'static) -> Self {
        self.cleanup = Some(Box::new(f));
        self
    }
}

/// A child killed by SIGSYS was killed by the seccomp filter.
pub fn sigsys_is_contained(sig: i32) -> Option<Outcome> {
    (sig == libc::SIGSYS).then(|| Outcome::contained("killed by SIGSYS (the seccomp filter)"))
}

/// Every attempt, in the order they run. The resource attempts come late (they leave
/// the sandbox busy for a moment) and the attempts that unmount come last (a success
/// would change what later attempts see).
fn registry(cfg: &Config) -> Vec<Attempt> {
    let mut v = Vec::new();
    v.extend(isolation::attempts(cfg));
    v.extend(devices::attempts(cfg));
    v.extend(syscalls::attempts(cfg));
    v.extend(kernelfs::attempts(cfg));
    v.extend(network::attempts(cfg));
    v.extend(mounts::attempts(cfg));
    v.extend(limits::attempts(cfg));
    v.extend(mounts::unmount_attempts(cfg));
    v
}

fn usage() -> ! {
    eprintln!(
        "usage: sandbox-attack all|list|<name>[,<name>…]|<prefix>* [--host-ports ip:port,…] [--peer ip:port,…] \
         [--block-dev MAJ:MIN] [--host-comm a,b] [--host-ns user:[…],…] [--disk-cap-mb N] [--disk-slack-mb N] \
         [--memory-mb N] [--fork-max N] [--connect-timeout-ms N] [--hold]"
    );
    std::process::exit(2);
}

fn list_arg(v: &str) -> Vec<String> {
    v.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(String::from)
        .collect()
}

fn parse_args() -> (String, Config) {
    let mut args = std::env::args().skip(1);
    let Some(what) = args.next() else { usage() };
    if what == "-h" || what == "--help" {
        usage();
    }
    let mut cfg = Config::default();
    while let Some(a) = args.next() {
        let (key, inline) = match a.split_once('=') {
            Some((k, v)) => (k.to_string(), Some(v.to_string())),
            None => (a.clone(), None),
        };
        if key == "--hold" {
            cfg.hold = true;
            continue;
        }
        let Some(val) = inline.or_else(|| args.next()) else {
            eprintln!("sandbox-attack: {key} needs a value");
            usage()
        };
        let num = |v: &str| -> u64 {
            v.parse().unwrap_or_else(|_| {
                eprintln!("sandbox-attack: {key} wants a number, not {v:?}");
                usage()
            })
        };
        match key.as_str() {
            "--host-ports" => cfg.host_ports.extend(list_arg(&val)),
            "--peer" => cfg.peers.extend(list_arg(&val)),
            "--block-dev" => {
                let parsed = val
                    .split_once(':')
                    .and_then(|(a, b)| Some((a.parse().ok()?, b.parse().ok()?)));
                match parsed {
                    Some(d) => cfg.block_dev = Some(d),
                    None => {
                        eprintln!("sandbox-attack: --block-dev wants MAJOR:MINOR, not {val:?}");
                        usage()
                    }
                }
            }
            "--host-comm" => cfg.host_comms.extend(list_arg(&val)),
            "--host-ns" => {
                for item in list_arg(&val) {
                    let Some((kind, _)) = item.split_once(':') else {
                        eprintln!(
                            "sandbox-attack: --host-ns items look like user:[4026531837], not {item:?}"
                        );
                        usage()
                    };
                    cfg.host_ns.push((kind.to_string(), item.clone()));
                }
            }
            "--disk-cap-mb" => cfg.disk_cap_mb = num(&val),
            "--disk-slack-mb" => cfg.disk_slack_mb = num(&val),
            "--memory-mb" => cfg.memory_mb = num(&val),
            "--fork-max" => cfg.fork_max = num(&val),
            "--connect-timeout-ms" => cfg.connect_timeout = Duration::from_millis(num(&val)),
            _ => {
                eprintln!("sandbox-attack: unknown option {key}");
                usage()
            }
        }
    }
    (what, cfg)
}

fn selected(what: &str, name: &str) -> bool {
    what == "all"
        || what.split(',').any(|w| match w.strip_suffix('*') {
            Some(prefix) => name.starts_with(prefix),
            None => w == name,
        })
}

/// Runs `a` in a forked child and collects its outcome.
fn run_attempt(a: &Attempt, cfg: &Config) -> Outcome {
    let _ = std::io::stdout().flush();
    let mut fds = [0i32; 2];
    // SAFETY: `fds` has room for the two descriptors pipe2 returns.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } < 0 {
        return Outcome::inconclusive(format!("pipe: {}", sys::ename(sys::errno())));
    }
    let (rd, wr) = (sys::Fd(fds[0]), sys::Fd(fds[1]));
    let child = sys::fork_child(|| {
        // SAFETY: setpgid on this process only.
        unsafe { libc::setpgid(0, 0) };
        let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| (a.run)(cfg)))
            .unwrap_or_else(|_| Outcome::inconclusive("the attempt panicked"));
        let line = serde_json::json!({"contained": out.contained, "detail": out.detail});
        let _ = sys::write(&wr, line.to_string().as_bytes());
        0
    });
    let pid = match child {
        Ok(pid) => pid,
        Err(e) => {
            return Outcome::inconclusive(format!("fork for the attempt: {}", sys::ename(e)));
        }
    };
    drop(wr);
    let deadline = Instant::now() + a.timeout;
    let mut buf = Vec::new();
    let mut timed_out = false;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            timed_out = true;
            break;
        }
        let mut pfd = libc::pollfd {
            fd: rd.0,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: `pfd` is one valid pollfd for the call.
        let r = unsafe { libc::poll(&mut pfd, 1, left.as_millis().min(i32::MAX as u128) as i32) };
        if r < 0 {
            if sys::errno() == libc::EINTR {
                continue;
            }
            break;
        }
        if r == 0 {
            continue;
        }
        let mut chunk = [0u8; 4096];
        // SAFETY: `chunk` has room for the bytes read.
        let n = unsafe { libc::read(rd.0, chunk.as_mut_ptr().cast(), chunk.len()) };
        if n <= 0 {
            break;
        }
        buf.extend_from_slice(&chunk[..n as usize]);
    }
    if timed_out {
        // SAFETY: signals to the attempt's own process group and to the child.
        unsafe {
            libc::kill(-pid, libc::SIGKILL);
            libc::kill(pid, libc::SIGKILL);
        }
    }
    let ended = sys::wait(pid);
    // Whatever else the attempt left in its group goes too.
    // SAFETY: a signal to the attempt's process group (gone already, or its leftovers).
    unsafe { libc::kill(-pid, libc::SIGKILL) };
    sys::reap_all();
    if let Some(c) = &a.cleanup {
        c();
    }
    if let Ok(v) = serde_json::from_slice::<serde_json::Value>(&buf) {
        return Outcome {
            contained: v["contained"].as_bool().unwrap_or(false),
            detail: v["detail"].as_str().unwrap_or_default().to_string(),
        };
    }
    if timed_out {
        return Outcome::inconclusive(format!("no result within {:?}", a.timeout));
    }
    match ended {
        Some(sys::Ended::Signaled(sig)) => a.on_signal.and_then(|f| f(sig)).unwrap_or_else(|| {
            Outcome::inconclusive(format!("the attempt was killed by {}", sys::signame(sig)))
        }),
        other => Outcome::inconclusive(format!("the attempt ended without a result: {other:?}")),
    }
}

fn main() {
    let (what, cfg) = parse_args();
    // Orphans of attempts (fork bombs) are reparented here and reaped after each one.
    // SAFETY: prctl on this process only.
    unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
    let all = registry(&cfg);
    if what == "list" {
        for a in &all {
            println!("{}", a.name);
        }
        return;
    }
    let chosen: Vec<&Attempt> = all.iter().filter(|a| selected(&what, &a.name)).collect();
    if chosen.is_empty() {
        eprintln!("sandbox-attack: no attempt matches {what:?} (see `sandbox-attack list`)");
        std::process::exit(2);
    }
    let (mut n, mut contained) = (0u64, 0u64);
    for a in chosen {
        let out = run_attempt(a, &cfg);
        n += 1;
        contained += u64::from(out.contained);
        let line = serde_json::json!({
            "attempt": a.name,
            "contained": out.contained,
            "detail": out.detail,
        });
        println!("{line}");
        let _ = std::io::stdout().flush();
    }
    println!(
        "{}",
        serde_json::json!({"summary": {"attempts": n, "contained": contained, "escaped": n - contained}})
    );
}
