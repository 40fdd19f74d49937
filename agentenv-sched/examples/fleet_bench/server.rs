//! The scheduler under test in a process of its own (this program re-run in
//! server mode), so its memory and CPU are its alone; and the Redis server
//! of the Redis run.

use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use agentenv_core::config::{NodeConfig, NodeResourceLimit, SchedulerConfig};
use agentenv_sched::{MemoryBindingStore, Scheduler};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{Child, ChildStdin, ChildStdout};

use crate::fleet::{endpoint, node_id};

/// The first argument that puts this program in server mode.
pub const SERVE_FLAG: &str = "--serve";

/// Which binding store a scheduler holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreKind {
    Memory,
    Redis,
}

impl StoreKind {
    pub fn name(self) -> &'static str {
        match self {
            StoreKind::Memory => "memory",
            StoreKind::Redis => "redis",
        }
    }
}

/// The scheduler's config for a fleet of `nodes`: the defaults (strategy,
/// TTLs), a resource limit so placement filters as a real fleet's would.
pub fn config(nodes: usize) -> SchedulerConfig {
    SchedulerConfig {
        nodes: (0..nodes)
            .map(|i| NodeConfig {
                id: node_id(i),
                endpoint: endpoint(i),
            })
            .collect(),
        node_resource_limit: Some(NodeResourceLimit {
            max_sandbox_count: Some(400),
            max_memory_allocated_percent: Some(90),
            ..NodeResourceLimit::default()
        }),
        ..SchedulerConfig::default()
    }
}

/// Server mode: serves a scheduler of `nodes` on a free loopback port,
/// prints `LISTEN <addr>`, answers `count` on stdin with `COUNT <bindings>`
/// (-1 when the store cannot count), and exits when stdin closes.
pub async fn serve(
    kind: StoreKind,
    nodes: usize,
    redis: Option<&str>,
) -> Result<(), Box<dyn std::error::Error>> {
    let mut config = config(nodes);
    let mut memory = None;
    let builder = match kind {
        StoreKind::Memory => {
            let m = Arc::new(MemoryBindingStore::new(config.binding_ttl));
            memory = Some(m.clone());
            Scheduler::builder(config).binding_store(m)
        }
        // As the scheduler daemon does: the store from `scheduler.redis_addr`.
        StoreKind::Redis => {
            config.redis_addr = redis.ok_or("--serve redis needs --redis <addr>")?.into();
            Scheduler::builder(config)
        }
    };
    let scheduler = builder.build_async().await?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let server =
        tokio::spawn(async move { scheduler.serve(listener, std::future::pending()).await });
    let mut out = tokio::io::stdout();
    out.write_all(format!("LISTEN {addr}\n").as_bytes()).await?;
    out.flush().await?;
    let mut lines = BufReader::new(tokio::io::stdin()).lines();
    while let Some(line) = lines.next_line().await? {
        if line.trim() == "count" {
            let n = memory.as_ref().map_or(-1, |m| m.len() as i64);
            out.write_all(format!("COUNT {n}\n").as_bytes()).await?;
            out.flush().await?;
        }
    }
    server.abort();
    Ok(())
}

/// A scheduler running in a child process.
pub struct SchedulerProc {
    child: Child,
    stdin: Option<ChildStdin>,
    stdout: Lines<BufReader<ChildStdout>>,
    pub pid: u32,
    pub addr: String,
}

impl SchedulerProc {
    pub async fn start(kind: StoreKind, nodes: usize, redis: Option<&str>) -> Result<Self, String> {
        let exe = std::env::current_exe().map_err(|e| format!("current exe: {e}"))?;
        let mut cmd = tokio::process::Command::new(exe);
        cmd.arg(SERVE_FLAG)
            .arg(kind.name())
            .args(["--nodes", &nodes.to_string()]);
        if let Some(r) = redis {
            cmd.args(["--redis", r]);
        }
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| format!("cannot start the scheduler process: {e}"))?;
        let pid = child.id().unwrap_or(0);
        let stdin = child.stdin.take();
        let mut stdout = BufReader::new(child.stdout.take().ok_or("no stdout")?).lines();
        let addr = match stdout.next_line().await {
            Ok(Some(l)) if l.starts_with("LISTEN ") => l["LISTEN ".len()..].to_string(),
            other => {
                let status = child.wait().await.ok();
                return Err(format!(
                    "the scheduler process did not start ({other:?}, exit {status:?})"
                ));
            }
        };
        Ok(Self {
            child,
            stdin,
            stdout,
            pid,
            addr,
        })
    }

    /// Bindings the memory store holds (`None` for stores that cannot count).
    pub async fn bindings(&mut self) -> Option<u64> {
        let stdin = self.stdin.as_mut()?;
        stdin.write_all(b"count\n").await.ok()?;
        stdin.flush().await.ok()?;
        let line = self.stdout.next_line().await.ok()??;
        line.strip_prefix("COUNT ")?
            .parse::<i64>()
            .ok()?
            .try_into()
            .ok()
    }

    pub async fn stop(mut self) {
        drop(self.stdin.take());
        if tokio::time::timeout(Duration::from_secs(10), self.child.wait())
            .await
            .is_err()
        {
            let _ = self.child.kill().await;
        }
    }
}

/// Memory and CPU of a process, from /proc.
#[derive(Debug, Clone, Copy, Default)]
pub struct ProcStats {
    pub rss_kib: u64,
    pub hwm_kib: u64,
    /// User + system CPU time.
    pub cpu_secs: f64,
}

pub fn proc_stats(pid: u32) -> ProcStats {
    let dir = if pid == 0 {
        "/proc/self".to_string()
    } else {
        format!("/proc/{pid}")
    };
    let status = std::fs::read_to_string(format!("{dir}/status")).unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    // utime and stime are fields 14 and 15, counted after the `(comm)` field,
    // in clock ticks of 1/100 s (USER_HZ on Linux).
    let stat = std::fs::read_to_string(format!("{dir}/stat")).unwrap_or_default();
    let ticks: u64 = stat
        .rsplit_once(')')
        .map(|(_, rest)| {
            rest.split_whitespace()
                .skip(11)
                .take(2)
                .filter_map(|v| v.parse::<u64>().ok())
                .sum()
        })
        .unwrap_or(0);
    ProcStats {
        rss_kib: field("VmRSS:"),
        hwm_kib: field("VmHWM:"),
        cpu_secs: ticks as f64 / 100.0,
    }
}

/// A `redis-server` of this run: loopback, a free port, no persistence.
pub struct RedisServer {
    child: std::process::Child,
    pub addr: String,
    _dir: tempfile::TempDir,
}

impl RedisServer {
    /// Starts one if `redis-server` is on PATH.
    pub fn start() -> Result<Self, String> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map_err(|e| format!("no free port: {e}"))?
            .port();
        let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        let child = std::process::Command::new("redis-server")
            .args(["--bind", "127.0.0.1", "--port", &port.to_string()])
            .args(["--save", "", "--appendonly", "no", "--protected-mode", "yes"])
            .arg("--dir")
            .arg(dir.path())
            .stdout(Stdio::null())
            .spawn()
            .map_err(|e| {
                format!("cannot run redis-server ({e}): install it (apt-get install -y redis-server) or pass --redis <addr>")
            })?;
        let addr = format!("127.0.0.1:{port}");
        for _ in 0..200 {
            if std::net::TcpStream::connect(&addr).is_ok() {
                return Ok(Self {
                    child,
                    addr,
                    _dir: dir,
                });
            }
            std::thread::sleep(Duration::from_millis(25));
        }
        Err(format!("redis-server did not listen on {addr}"))
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The pid of the Redis server listening on `addr` (`redis-cli INFO server`),
/// for its memory and CPU figures; `None` when it is not on this host.
pub fn redis_pid(addr: &str) -> Option<u32> {
    let out = redis_cli(addr, &["INFO", "server"])?;
    out.lines()
        .find_map(|l| l.strip_prefix("process_id:"))
        .and_then(|v| v.trim().parse().ok())
        .filter(|pid| std::path::Path::new(&format!("/proc/{pid}")).exists())
}

/// Binding keys in the Redis at `addr` (every key under the bindings prefix
/// that is not a node's index set).
pub fn redis_bindings(addr: &str) -> Option<u64> {
    let out = redis_cli(
        addr,
        &[
            "EVAL",
            "local n = 0 local c = '0' repeat local r = redis.call('SCAN', c, 'MATCH', 'agentenv:scheduler:bindings:sandbox:*', 'COUNT', 10000) c = r[1] n = n + #r[2] until c == '0' return n",
            "0",
        ],
    )?;
    out.trim().parse().ok()
}

fn redis_cli(addr: &str, args: &[&str]) -> Option<String> {
    let mut cmd = std::process::Command::new("redis-cli");
    let addr = addr.trim();
    if addr.contains("://") {
        cmd.args(["-u", addr]);
    } else {
        let (host, port) = addr.rsplit_once(':').unwrap_or((addr, "6379"));
        cmd.args(["-h", host, "-p", port]);
    }
    let out = cmd.args(args).output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}
