//! Shared helpers of the jail integration tests: a backend on a fresh data directory with
//! the shared `base` template, a client for the test agent, and checks for leftovers.

#![allow(dead_code)]

use std::net::{Ipv4Addr, SocketAddr};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use agentenv_node::backend::agent::wait_ready;
use agentenv_node::backend::jail::{JailBackend, JailConfig};
use agentenv_node::backend::{SandboxBackend, SandboxInfo, SandboxSpec};
use agentenv_node::template::{BASE_TEMPLATE, Progress};
pub use agentenv_testkit::host_rules as rules_common;
pub use agentenv_testkit::node::{TEMPLATE_CACHE, init_tracing};
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

/// Parent of the test sandboxes' cgroups, apart from a node's.
pub const TEST_CGROUP_PARENT: &str = "agentenv-test";

/// Why the jail tests cannot run here, if they cannot.
pub fn skip_reason() -> Option<String> {
    if let Some(why) = agentenv_testkit::node::unless_root(
        "the jail needs root (namespaces, cgroups, veth, iptables)",
    ) {
        return Some(why);
    }
    if !Path::new("/proc/self/ns/net").exists() {
        return Some("no namespace support in /proc".into());
    }
    None
}

/// Skips the calling test (with the reason on stderr) when the jail cannot run here.
#[macro_export]
macro_rules! require_jail {
    () => {
        if let Some(reason) = common::skip_reason() {
            eprintln!("SKIPPED: {reason}");
            return;
        }
    };
}

pub fn test_agent() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/test_agent.py")
}

/// The interface prefix of this test process's backends.
pub fn iface_prefix() -> String {
    rules_common::process_prefix('j')
}

/// A config on a fresh data directory with the shared template cache and the test agent.
/// Its interface prefix is this test process's own (backends of one test share it, for
/// a restarted backend finds its sandboxes by it); its host chains go when the process
/// exits.
pub fn config(data: &Path) -> JailConfig {
    let mut cfg = JailConfig::new(data, test_agent());
    cfg.templates.root = PathBuf::from(TEMPLATE_CACHE);
    cfg.cgroup_parent = TEST_CGROUP_PARENT.into();
    cfg.iface_prefix = iface_prefix();
    rules_common::remove_at_exit(&cfg.iface_prefix, &cfg.runtime_dir);
    cfg
}

pub fn progress() -> Progress {
    Arc::new(|line| eprintln!("[template base] {line}"))
}

/// A backend on a fresh data directory, with `base` built (or taken from the cache).
pub async fn backend() -> (JailBackend, tempfile::TempDir) {
    backend_with(|_| {}).await
}

pub async fn backend_with(f: impl FnOnce(&mut JailConfig)) -> (JailBackend, tempfile::TempDir) {
    init_tracing();
    let data = tempfile::tempdir().expect("temp dir");
    let mut cfg = config(data.path());
    f(&mut cfg);
    let b = JailBackend::new(cfg).await.expect("jail backend");
    b.templates()
        .ensure(BASE_TEMPLATE, progress())
        .await
        .expect("template base");
    (b, data)
}

pub fn spec(id: &str) -> SandboxSpec {
    let mut s = SandboxSpec::new(id, BASE_TEMPLATE);
    s.cpu_count = 1;
    s.memory_mb = 256;
    s
}

/// A unique sandbox id for this test process.
pub fn id(name: &str) -> String {
    format!("{name}-{}-{:04x}", std::process::id(), rand_u16())
}

fn rand_u16() -> u16 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    static N: std::sync::atomic::AtomicU16 = std::sync::atomic::AtomicU16::new(0);
    (t as u16) ^ N.fetch_add(7919, std::sync::atomic::Ordering::Relaxed)
}

/// What sandbox `id`'s agent wrote (its log's messages, one a line).
pub fn agent_log(b: &JailBackend, id: &str) -> String {
    let q = agentenv_node::observe::LogQuery {
        limit: usize::MAX,
        ..Default::default()
    };
    b.sandbox_logs()
        .read(id, &q)
        .unwrap_or_default()
        .iter()
        .map(|e| e.message.as_str())
        .collect::<Vec<_>>()
        .join("\n")
}

/// Creates a sandbox and waits until its agent answers.
pub async fn create_ready(b: &JailBackend, spec: SandboxSpec) -> SandboxInfo {
    let id = spec.id.clone();
    let info = b.create(spec).await.expect("create");
    if let Err(e) = wait_ready(
        info.address.agent(),
        Duration::from_secs(20),
        Duration::from_millis(2),
    )
    .await
    {
        let log = agent_log(b, &id);
        panic!("{e}\nagent log:\n{log}");
    }
    info
}

/// Result of a command run by the test agent.
#[derive(Debug)]
pub struct Exec {
    pub exit: i64,
    pub stdout: String,
    pub stderr: String,
}

async fn post_json(addr: SocketAddr, path: &str, body: serde_json::Value) -> serde_json::Value {
    let stream = TcpStream::connect(addr)
        .await
        .expect("connect to the agent");
    stream.set_nodelay(true).expect("nodelay");
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .expect("handshake");
    tokio::spawn(conn);
    let req = hyper::Request::post(path)
        .header(hyper::header::HOST, addr.to_string())
        .header(hyper::header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .expect("request");
    let resp = sender.send_request(req).await.expect("response");
    let status = resp.status();
    let bytes = resp.into_body().collect().await.expect("body").to_bytes();
    assert!(
        status.is_success(),
        "{path}: {status} {}",
        String::from_utf8_lossy(&bytes)
    );
    serde_json::from_slice(&bytes).expect("json")
}

/// Runs a command in the sandbox through the test agent.
pub async fn exec(info: &SandboxInfo, cmd: &[&str]) -> Exec {
    let v = post_json(
        info.address.agent(),
        "/exec",
        serde_json::json!({ "cmd": cmd, "timeout": 60 }),
    )
    .await;
    Exec {
        exit: v["exit"].as_i64().unwrap_or(i64::MIN),
        stdout: v["stdout"].as_str().unwrap_or_default().to_string(),
        stderr: v["stderr"].as_str().unwrap_or_default().to_string(),
    }
}

pub async fn sh(info: &SandboxInfo, script: &str) -> Exec {
    exec(info, &["/bin/sh", "-c", script]).await
}

/// Starts a background command in the sandbox.
pub async fn spawn_bg(info: &SandboxInfo, script: &str) {
    post_json(
        info.address.agent(),
        "/spawn",
        serde_json::json!({ "cmd": ["/bin/sh", "-c", script] }),
    )
    .await;
}

/// From inside the sandbox: "connected" or "blocked <why>" for a TCP connect.
pub async fn try_connect(info: &SandboxInfo, ip: Ipv4Addr, port: u16) -> String {
    let code = "import socket,sys\ns=socket.socket()\ns.settimeout(1.5)\ntry:\n    s.connect((sys.argv[1], int(sys.argv[2])))\n    print('connected', s.recv(64).decode(errors='replace'))\nexcept Exception as e:\n    print('blocked', type(e).__name__)\n";
    let ip = ip.to_string();
    let port = port.to_string();
    exec(info, &["python3", "-c", code, &ip, &port])
        .await
        .stdout
        .trim()
        .to_string()
}

/// Whether a [`try_connect`] result is a refused, unreachable or timed-out connection
/// (not some other failure of the probe itself).
pub fn is_blocked(result: &str) -> bool {
    [
        "blocked ConnectionRefusedError",
        "blocked TimeoutError",
        "blocked timeout",
        "blocked OSError",
        "blocked PermissionError",
    ]
    .contains(&result)
}

/// Everything a sandbox holds on the host.
#[derive(Debug, Clone)]
pub struct Traces {
    pub id: String,
    pub pid: i32,
    pub namespaces: Vec<(String, u64)>,
    pub cgroup_dirs: Vec<PathBuf>,
    pub host_if: String,
    /// The host interface's index: names and addresses are reused at once by sandboxes of
    /// tests running in parallel, interface indexes are not.
    pub host_ifindex: u32,
    pub ip: Ipv4Addr,
    pub gateway: Ipv4Addr,
    pub dir: PathBuf,
    /// The base of the sandbox's id range (root inside is this host uid).
    pub id_base: u32,
    /// Where its writable layer is mounted.
    pub layer: PathBuf,
}

pub fn traces(b: &JailBackend, info: &SandboxInfo) -> Traces {
    let pid = b.pid(&info.id).expect("pid");
    let namespaces = ["net", "pid", "mnt", "uts", "ipc", "cgroup", "user"]
        .iter()
        .map(|ns| {
            let ino = std::fs::metadata(format!("/proc/{pid}/ns/{ns}"))
                .expect("ns")
                .ino();
            (ns.to_string(), ino)
        })
        .collect();
    let host_if = b.host_interface(&info.id).expect("host interface");
    let host_ifindex = std::fs::read_to_string(format!("/sys/class/net/{host_if}/ifindex"))
        .expect("the host interface's index")
        .trim()
        .parse()
        .expect("an interface index");
    let t = Traces {
        id: info.id.clone(),
        pid,
        namespaces,
        cgroup_dirs: b.cgroup_dirs(&info.id),
        host_if,
        host_ifindex,
        ip: info.address.ip,
        gateway: Ipv4Addr::from(u32::from(info.address.ip) - 1),
        dir: b.sandbox_dir(&info.id),
        id_base: b.id_base(&info.id).expect("an id range"),
        layer: b.layer_mount(&info.id),
    };
    assert!(
        t.cgroup_dirs.iter().all(|d| d.is_dir()),
        "cgroups exist while running"
    );
    assert!(t.dir.is_dir());
    assert!(
        is_mounted(&t.layer),
        "the writable layer is mounted while running"
    );
    t
}

/// Whether something is mounted at `path` in the host's mount namespace.
pub fn is_mounted(path: &Path) -> bool {
    let text = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let want = path.to_string_lossy();
    text.lines()
        .any(|l| l.split(' ').nth(4) == Some(want.as_ref()))
}

/// Namespace inodes of every process on the host, by kind.
pub fn host_namespaces() -> std::collections::HashSet<(String, u64)> {
    let mut out = std::collections::HashSet::new();
    if let Ok(entries) = std::fs::read_dir("/proc") {
        for e in entries.flatten() {
            let name = e.file_name();
            if !name.to_string_lossy().bytes().all(|b| b.is_ascii_digit()) {
                continue;
            }
            for ns in ["net", "pid", "mnt", "uts", "ipc", "cgroup", "user"] {
                if let Ok(m) = std::fs::metadata(e.path().join("ns").join(ns)) {
                    out.insert((ns.to_string(), m.ino()));
                }
            }
        }
    }
    out
}

/// The processes whose namespace of kind `n.0` has inode `n.1`.
pub fn namespace_holders(n: &(String, u64)) -> Vec<u32> {
    let mut out = Vec::new();
    if let Ok(entries) = std::fs::read_dir("/proc") {
        for e in entries.flatten() {
            let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
                continue;
            };
            if std::fs::metadata(e.path().join("ns").join(&n.0)).is_ok_and(|m| m.ino() == n.1) {
                out.push(pid);
            }
        }
    }
    out
}

pub fn host_links() -> String {
    let out = std::process::Command::new("ip")
        .args(["-o", "link", "show"])
        .output()
        .expect("ip link");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

pub fn host_addresses() -> String {
    let out = std::process::Command::new("ip")
        .args(["-4", "-o", "addr", "show"])
        .output()
        .expect("ip addr");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Asserts that nothing of the sandbox is left: process, namespaces, cgroups, link,
/// address (on the host and in the pool), directory.
pub fn assert_gone(b: &JailBackend, t: &Traces) {
    assert!(
        !Path::new(&format!("/proc/{}", t.pid)).exists(),
        "{}: PID 1 still exists",
        t.id
    );
    // Namespace inode numbers are reused at once, possibly by a sandbox of a
    // test running in parallel: a namespace counts as left behind only when
    // a process holding it still belongs to this sandbox's cgroup.
    for n in &t.namespaces {
        let ours: Vec<u32> = namespace_holders(n)
            .into_iter()
            .filter(|pid| {
                std::fs::read_to_string(format!("/proc/{pid}/cgroup"))
                    .is_ok_and(|c| c.contains(&t.id))
            })
            .collect();
        assert!(
            ours.is_empty(),
            "{}: namespace {n:?} still in use by {ours:?}",
            t.id
        );
    }
    for d in &t.cgroup_dirs {
        assert!(!d.exists(), "{}: cgroup {} still exists", t.id, d.display());
    }
    // The same name may already belong to a parallel test's sandbox that got the same
    // address: only this sandbox's interface (by index) counts.
    let links = host_links();
    assert!(
        !links
            .lines()
            .any(|l| l.starts_with(&format!("{}: {}", t.host_ifindex, t.host_if))),
        "{}: link {} (index {}) still exists",
        t.id,
        t.host_if,
        t.host_ifindex
    );
    let addrs = host_addresses();
    assert!(
        !addrs
            .lines()
            .any(|l| l.starts_with(&format!("{}: ", t.host_ifindex))
                && l.contains(&format!("inet {}/", t.gateway))),
        "{}: address {} still on the host",
        t.id,
        t.gateway
    );
    let owner = b.address_owner(t.ip);
    assert!(
        owner.as_ref().is_none_or(|o| !o.starts_with(&t.dir)),
        "{}: address {} still reserved by it ({owner:?})",
        t.id,
        t.ip
    );
    assert!(
        !t.dir.exists(),
        "{}: directory {} still exists",
        t.id,
        t.dir.display()
    );
    assert!(
        !is_mounted(&t.layer),
        "{}: its writable layer is still mounted",
        t.id
    );
    let ranges = b.host().ids().reservations();
    assert!(
        !ranges.iter().any(|(_, owner)| owner == &t.dir),
        "{}: id range {} still reserved by it",
        t.id,
        t.id_base
    );
}
