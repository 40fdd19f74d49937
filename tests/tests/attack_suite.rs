//! The attack suite (issue #14): hostile code, root inside real `jail` sandboxes created
//! through the node's REST API as the E2B SDK creates them, tries to get out, and the
//! host side plants symlinks where the node writes and feeds the node forged snapshots.
//! Every attempt must fail (be *contained*) and the node must keep serving.
//!
//! 1. A real `agentenv-node` process (jail backend, listening on all addresses so that
//!    its port is a real target from inside) and sandboxes A and B (`POST /v2/sandboxes`
//!    with `memoryMB` and `diskSizeMB`).
//! 2. The static attacker (`agentenv-attack`'s `sandbox-attack`) is uploaded into both
//!    through the agent's `/files` API and run as root through the process API: A runs
//!    every attempt against the host's addresses and ports (the node's, a stand-in
//!    scheduler's, the sandbox's gateway, 169.254.169.254) and B; B runs the network
//!    attempts against A. One JSON line per attempt.
//! 3. A exhausts inotify instances and watches and holds them while the test creates an
//!    inotify instance and a watch on the host.
//! 4. Symlinks planted from inside sandboxes at every path the node writes
//!    (`/etc/hosts`, `/etc/hostname`, `/etc/resolv.conf`, `/etc` itself, the agent's
//!    directory and binary), pointing at victim files of this test (absolute and `../`
//!    links) and at the host's `/`; then snapshot → a sandbox from it, and pause → node
//!    restart → resume. No victim may change (content, mtime, owner, mode, links) and
//!    nothing may appear outside the sandbox directories.
//! 5. Snapshots put into the repository by hand: forged records, and escaping layers
//!    (`../` and absolute entries, a symlink then a file through it, hard links to a
//!    host file, block and character devices), both under forged records and swapped
//!    under a genuine record (same size). A sandbox from them must fail with a message
//!    and leave nothing behind.
//! 6. Afterwards the other sandbox still runs commands (before and after the restart),
//!    and the host's inotify limits, kernel settings and `/dev` are as before.
//!
//! It prints a table `attempt | contained | detail` and `attempts N, contained N,
//! escaped N`, and fails listing every escape. Run it as root with
//! `cargo test -p agentenv-tests --test attack_suite -- --nocapture`; the attacker is
//! `AGENTENV_ATTACK_BIN`, else the static build in the target directory, else built with
//! `agentenv-attack/build-static.sh`.

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::CString;
use std::io::Write;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV6, TcpListener, TcpStream};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use agentenv_guest::client::GuestClient;
use agentenv_guest::proto::process as pr;
use agentenv_tests::{
    NODE_RUNTIME_DIR, Proc, api, binary, free_port, node_env, node_iface_prefix, skip_reason,
};
use futures::StreamExt;
use serde_json::{Value, json};

/// The test node's index: its address pool (10.15.24.0/24), interface prefix and cgroup
/// parent are its own (other tests use 0–20).
const IDX: u8 = 24;
const NODE_ID: &str = "node-attack";
const MEMORY_MB: u64 = 256;
/// The disk cap asked for at create (`diskSizeMB`) and what a fill may overshoot it by.
const DISK_CAP_MB: u64 = 256;
const DISK_SLACK_MB: u64 = 64;
const AGENT_PORT: u16 = 49983;
/// Where the attacker is uploaded inside a sandbox.
const ATTACKER: &str = "/root/sandbox-attack";
/// What a node that followed a planted `/etc -> /` (or `/agentenv -> /`) link creates
/// on the host.
const HOST_ROOT_TARGETS: &[&str] = &["/hosts", "/hostname", "/resolv.conf", "/agentenv"];
/// Victim files and directories of the test (under its temporary directory).
const VICTIM_FILES: &[&str] = &[
    "victim-hosts",
    "victim-hostname",
    "victim-resolv.conf",
    "victim-agentbin",
    "victim-hardlink",
];
const VICTIM_DIRS: &[&str] = &["victim-etcdir", "victim-agentdir", "victim-layerdir"];
/// The victims' mtime: 2001-09-09, so a rewrite within the same second still shows.
const VICTIM_MTIME: u64 = 1_000_000_000;

// ------------------------------------------------------------------ the report

struct Row {
    attempt: String,
    contained: bool,
    detail: String,
}

#[derive(Default)]
struct Report {
    rows: Vec<Row>,
    printed: bool,
}

impl Report {
    fn add(&mut self, attempt: impl Into<String>, contained: bool, detail: impl Into<String>) {
        let row = Row {
            attempt: attempt.into(),
            contained,
            detail: detail.into(),
        };
        eprintln!(
            "[attack] {} {}: {}",
            if contained { "contained" } else { "ESCAPED" },
            row.attempt,
            row.detail
        );
        self.rows.push(row);
    }

    fn escapes(&self) -> Vec<String> {
        self.rows
            .iter()
            .filter(|r| !r.contained)
            .map(|r| format!("{}: {}", r.attempt, r.detail))
            .collect()
    }

    fn print(&mut self) {
        self.printed = true;
        let mut out = String::new();
        out.push_str("\n| attempt | contained | detail |\n|---|---|---|\n");
        for r in &self.rows {
            out.push_str(&format!(
                "| {} | {} | {} |\n",
                r.attempt,
                if r.contained { "yes" } else { "NO" },
                r.detail.replace('|', "/").replace('\n', " ")
            ));
        }
        let n = self.rows.len();
        let c = self.rows.iter().filter(|r| r.contained).count();
        out.push_str(&format!(
            "\nattempts {n}, contained {c}, escaped {}\n",
            n - c
        ));
        println!("{out}");
        let _ = std::io::stdout().flush();
    }
}

impl Drop for Report {
    /// A step that panicked still shows what ran before it.
    fn drop(&mut self) {
        if !self.printed && !self.rows.is_empty() {
            self.print();
        }
    }
}

// ------------------------------------------------------------------ binaries

/// The static attacker: `AGENTENV_ATTACK_BIN`, else the static build in the target
/// directory, else built with `agentenv-attack/build-static.sh`.
fn attack_binary() -> Result<PathBuf, String> {
    agentenv_tests::static_binary(
        "AGENTENV_ATTACK_BIN",
        "sandbox-attack",
        "agentenv-attack/build-static.sh",
    )
}

// ------------------------------------------------------------------ the node

fn start_node(home: &Path, store: &Path, port: u16) -> Proc {
    let mut cmd = Command::new(binary("agentenv-node").expect("agentenv-node binary"));
    cmd.env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default());
    // All addresses: the node's port is then reachable from a sandbox unless the host
    // rules stop it (production nodes listen on every address too).
    let listen = SocketAddr::from(([0, 0, 0, 0], port));
    for (k, v) in node_env(IDX, NODE_ID, listen, home, None) {
        cmd.env(k, v);
    }
    cmd.env("AENV_SNAPSHOT_STORE", store);
    // Plain HTTP on every address (the attacker talks to the API in clear): what is
    // tested is that a sandbox cannot reach the port at all, whatever it speaks.
    cmd.env("AENV_ALLOW_PLAIN_HTTP", "true");
    let p = Proc::spawn(NODE_ID, cmd)
        .with_host_rules(&node_iface_prefix(IDX), Path::new(NODE_RUNTIME_DIR));
    p.wait_for("node listening", Duration::from_secs(900));
    p
}

#[derive(Clone, Debug)]
struct Sbx {
    label: String,
    id: String,
    token: Option<String>,
}

fn create_body(template: &str, label: &str) -> String {
    json!({
        "templateID": template,
        "timeout": 1800,
        "secure": true,
        "cpuCount": 1,
        "memoryMB": MEMORY_MB,
        "diskSizeMB": DISK_CAP_MB,
        "metadata": {"attack-suite": label},
    })
    .to_string()
}

fn create(node: SocketAddr, label: &str) -> Sbx {
    let (st, v) = api(node, "POST", "/v2/sandboxes", &create_body("base", label));
    assert_eq!(st, 201, "creating sandbox {label}: {v}");
    Sbx {
        label: label.into(),
        id: v["sandboxID"].as_str().expect("sandboxID").to_string(),
        token: v["envdAccessToken"].as_str().map(String::from),
    }
}

fn guest(node: SocketAddr, s: &Sbx) -> GuestClient {
    let mut c = GuestClient::new(&format!("http://{node}"))
        .expect("client")
        .with_header("e2b-sandbox-id", &s.id)
        .expect("header")
        .with_header("e2b-sandbox-port", &AGENT_PORT.to_string())
        .expect("header")
        .with_user("root");
    if let Some(t) = &s.token {
        c = c.with_access_token(t);
    }
    c
}

struct Ran {
    code: i32,
    stdout: String,
    stderr: String,
}

/// How long one command in a sandbox may take (the attacker's whole run included).
const RUN_LIMIT: Duration = Duration::from_secs(240);

/// Runs `cmd args…` as root in `s` through the node's data plane.
fn run(
    rt: &tokio::runtime::Runtime,
    node: SocketAddr,
    s: &Sbx,
    cmd: &str,
    args: &[&str],
) -> Result<Ran, String> {
    let client = guest(node, s);
    // The timer needs the runtime: it is made inside it.
    rt.block_on(async { tokio::time::timeout(RUN_LIMIT, client.run(cmd, args)).await })
        .map_err(|_| format!("{cmd} did not end within {RUN_LIMIT:?}"))?
        .map(|o| Ran {
            code: o.end.map(|e| e.exit_code).unwrap_or(-1),
            stdout: String::from_utf8_lossy(&o.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&o.stderr).into_owned(),
        })
        .map_err(|e| e.to_string())
}

fn sh(
    rt: &tokio::runtime::Runtime,
    node: SocketAddr,
    s: &Sbx,
    script: &str,
) -> Result<Ran, String> {
    run(rt, node, s, "/bin/sh", &["-c", script])
}

/// Whether a sandbox still runs a command, for the report.
fn answers(rt: &tokio::runtime::Runtime, node: SocketAddr, s: &Sbx) -> Result<(), String> {
    match sh(rt, node, s, "echo alive") {
        Ok(r) if r.code == 0 && r.stdout.trim() == "alive" => Ok(()),
        Ok(r) => Err(format!("exit {}: {:?} {:?}", r.code, r.stdout, r.stderr)),
        Err(e) => Err(e),
    }
}

/// What a sandbox says about its network: its address, its gateway (the host side of
/// its link) and the host's interface index of that link.
#[derive(Debug, Default)]
struct NetFacts {
    ip: Option<Ipv4Addr>,
    gateway: Option<Ipv4Addr>,
    peer_ifindex: Option<u32>,
}

fn net_facts(rt: &tokio::runtime::Runtime, node: SocketAddr, s: &Sbx) -> NetFacts {
    let r = sh(
        rt,
        node,
        s,
        "cat /proc/net/route; echo ---; cat /sys/class/net/eth0/iflink; echo ---; \
         hostname -I 2>/dev/null; echo ---; cat /etc/hosts",
    )
    .unwrap_or_else(|e| panic!("asking sandbox {} about its network: {e}", s.label));
    let parts: Vec<&str> = r.stdout.split("---\n").collect();
    let mut f = NetFacts::default();
    if let Some(route) = parts.first() {
        f.gateway = route.lines().skip(1).find_map(|l| {
            let c: Vec<&str> = l.split_whitespace().collect();
            (c.get(1) == Some(&"00000000"))
                .then(|| u32::from_str_radix(c.get(2)?, 16).ok())
                .flatten()
                .map(|g| Ipv4Addr::from(g.to_le_bytes()))
        });
    }
    f.peer_ifindex = parts.get(1).and_then(|s| s.trim().parse().ok());
    f.ip = parts
        .get(2)
        .and_then(|s| s.split_whitespace().find_map(|a| a.parse().ok()))
        .or_else(|| {
            parts.get(3).and_then(|h| {
                h.lines()
                    .find(|l| l.contains(&s.id))
                    .and_then(|l| l.split_whitespace().next()?.parse().ok())
            })
        });
    f
}

// ------------------------------------------------------------------ host facts

/// `user:[…],mnt:[…],…` of a process.
fn namespaces(pid: u32) -> String {
    ["user", "mnt", "pid", "net", "uts", "ipc", "cgroup"]
        .iter()
        .filter_map(|k| {
            std::fs::read_link(format!("/proc/{pid}/ns/{k}"))
                .ok()
                .map(|l| l.to_string_lossy().into_owned())
        })
        .collect::<Vec<_>>()
        .join(",")
}

fn comm(pid: &str) -> Option<String> {
    std::fs::read_to_string(format!("/proc/{pid}/comm"))
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
}

/// The host's IPv4 addresses with their interfaces.
fn host_ipv4() -> Vec<(String, Ipv4Addr)> {
    let out = Command::new("ip")
        .args(["-4", "-o", "addr", "show"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default();
    out.lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let ifname = f.get(1)?.trim_end_matches(':').to_string();
            let ip = f.get(3)?.split('/').next()?.parse().ok()?;
            Some((ifname, ip))
        })
        .collect()
}

/// The link-local IPv6 address of the host interface with index `ifindex`, once it is
/// usable (duplicate address detection done), waiting up to 5 s for that.
fn host_link_local(ifindex: u32) -> Option<Ipv6Addr> {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match link_local_now(ifindex) {
            Some((addr, false)) => return Some(addr),
            Some((_, true)) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(50))
            }
            _ => return None,
        }
    }
}

/// The link-local address of interface `ifindex` and whether it is still tentative.
fn link_local_now(ifindex: u32) -> Option<(Ipv6Addr, bool)> {
    /// IFA_F_TENTATIVE.
    const TENTATIVE: u32 = 0x40;
    let text = std::fs::read_to_string("/proc/net/if_inet6").ok()?;
    text.lines().find_map(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        let idx = u32::from_str_radix(f.get(1)?, 16).ok()?;
        if idx != ifindex || *f.get(3)? != "20" {
            return None;
        }
        let flags = u32::from_str_radix(f.get(4)?, 16).ok()?;
        let hex = f.first()?;
        let bytes: Vec<u8> = (0..16)
            .map(|i| u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap_or(0))
            .collect();
        let arr: [u8; 16] = bytes.try_into().ok()?;
        Some((Ipv6Addr::from(arr), flags & TENTATIVE != 0))
    })
}

/// The local ends of the test's own connections (not a sandbox's, at the stand-in
/// scheduler).
static OWN_CONNECTIONS: Mutex<Vec<SocketAddr>> = Mutex::new(Vec::new());

/// `a` with an IPv4-mapped IPv6 address written as IPv4.
fn canonical(a: SocketAddr) -> SocketAddr {
    match a {
        SocketAddr::V6(v) => match v.ip().to_ipv4_mapped() {
            Some(ip) => SocketAddr::new(IpAddr::V4(ip), v.port()),
            None => SocketAddr::V6(SocketAddrV6::new(*v.ip(), v.port(), 0, 0)),
        },
        v4 => v4,
    }
}

fn reachable_from_host(addr: SocketAddr) -> bool {
    match TcpStream::connect_timeout(&addr, Duration::from_secs(1)) {
        Ok(s) => {
            if let Ok(local) = s.local_addr() {
                OWN_CONNECTIONS
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push(canonical(local));
            }
            true
        }
        Err(_) => false,
    }
}

/// Host settings a sandbox must not change.
fn host_settings() -> BTreeMap<String, String> {
    [
        "/proc/sys/fs/inotify/max_user_instances",
        "/proc/sys/fs/inotify/max_user_watches",
        "/proc/sys/fs/inotify/max_queued_events",
        "/proc/sys/kernel/core_pattern",
        "/proc/sys/kernel/hostname",
        "/proc/sys/kernel/modprobe",
        "/sys/kernel/mm/transparent_hugepage/enabled",
    ]
    .iter()
    .filter_map(|p| {
        std::fs::read_to_string(p)
            .ok()
            .map(|v| (p.to_string(), v.trim().to_string()))
    })
    .collect()
}

/// `ls /dev`: names, kinds and device numbers of its entries.
fn dev_listing() -> BTreeSet<String> {
    std::fs::read_dir("/dev")
        .map(|rd| {
            rd.flatten()
                .map(|e| {
                    let name = e.file_name().to_string_lossy().into_owned();
                    match std::fs::symlink_metadata(e.path()) {
                        Ok(m) if m.rdev() != 0 => format!(
                            "{name} {:o} {}:{}",
                            m.mode() & 0o170000,
                            libc::major(m.rdev()),
                            libc::minor(m.rdev())
                        ),
                        Ok(m) => format!("{name} {:o}", m.mode() & 0o170000),
                        Err(_) => name,
                    }
                })
                .collect()
        })
        .unwrap_or_default()
}

/// An inotify instance and a watch on the host, as root.
fn host_inotify(watch: &Path) -> Result<(), String> {
    // SAFETY: inotify_init1 takes flags only.
    let fd = unsafe { libc::inotify_init1(libc::IN_CLOEXEC) };
    if fd < 0 {
        return Err(format!(
            "inotify_init1 on the host failed: {}",
            std::io::Error::last_os_error()
        ));
    }
    let c = CString::new(watch.as_os_str().as_bytes()).unwrap_or_default();
    // SAFETY: `c` is a NUL-terminated path that outlives the call; `fd` is ours.
    let wd = unsafe { libc::inotify_add_watch(fd, c.as_ptr(), libc::IN_MODIFY) };
    let r = if wd < 0 {
        Err(format!(
            "inotify_add_watch on the host failed: {}",
            std::io::Error::last_os_error()
        ))
    } else {
        Ok(())
    };
    // SAFETY: `fd` is ours and closed once.
    unsafe { libc::close(fd) };
    r
}

/// Whether this host itself can open a node of the block device `dev` (it may not, when
/// the machine runs in a sandbox of its own with a device cgroup).
fn host_opens_block_device(dev: (u32, u32)) -> Result<(), String> {
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let node = dir.path().join("disk");
    let c = CString::new(node.as_os_str().as_bytes()).unwrap_or_default();
    // SAFETY: `c` is a NUL-terminated path that outlives the call.
    let r = unsafe {
        libc::mknod(
            c.as_ptr(),
            libc::S_IFBLK | 0o600,
            libc::makedev(dev.0, dev.1),
        )
    };
    if r < 0 {
        return Err(format!("mknod: {}", std::io::Error::last_os_error()));
    }
    std::fs::File::open(&node)
        .map(|_| ())
        .map_err(|e| format!("open: {e}"))
}

/// A stand-in for the scheduler's port on every host address; remembers who connected.
struct FakeScheduler {
    port: u16,
    peers: Arc<Mutex<Vec<SocketAddr>>>,
}

impl FakeScheduler {
    fn start() -> FakeScheduler {
        // [::] takes IPv4 too (bindv6only=0); without IPv6, 0.0.0.0.
        let l = TcpListener::bind("[::]:0")
            .or_else(|_| TcpListener::bind("0.0.0.0:0"))
            .expect("binding the stand-in scheduler port");
        let port = l.local_addr().expect("address").port();
        let peers = Arc::new(Mutex::new(Vec::new()));
        let p2 = peers.clone();
        std::thread::spawn(move || {
            loop {
                if let Ok((_, a)) = l.accept() {
                    p2.lock().unwrap_or_else(|e| e.into_inner()).push(a);
                }
            }
        });
        FakeScheduler { port, peers }
    }

    /// Connections that came from a sandbox: from the pool's addresses or a link-local
    /// one, and not the test's own checks.
    fn sandbox_peers(&self, pool: [u8; 3]) -> Vec<SocketAddr> {
        let own = OWN_CONNECTIONS
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        self.peers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter(|a| !own.contains(&canonical(**a)))
            .filter(|a| match a.ip() {
                IpAddr::V4(v) => v.octets()[..3] == pool,
                IpAddr::V6(v) => match v.to_ipv4_mapped() {
                    Some(v4) => v4.octets()[..3] == pool,
                    None => (v.segments()[0] & 0xffc0) == 0xfe80,
                },
            })
            .copied()
            .collect()
    }
}

// ------------------------------------------------------------------ victims

#[derive(Debug, Clone, PartialEq, Eq)]
struct Meta {
    kind: u32,
    len: u64,
    mode: u32,
    uid: u32,
    gid: u32,
    mtime: (i64, i64),
    nlink: u64,
    content: Vec<u8>,
    link: Option<PathBuf>,
}

fn meta(p: &Path) -> Option<Meta> {
    let m = std::fs::symlink_metadata(p).ok()?;
    let content = if m.is_file() && m.len() <= 1 << 16 {
        std::fs::read(p).unwrap_or_default()
    } else {
        Vec::new()
    };
    Some(Meta {
        kind: m.mode() & 0o170000,
        len: m.len(),
        mode: m.mode() & 0o7777,
        uid: m.uid(),
        gid: m.gid(),
        mtime: (m.mtime(), m.mtime_nsec()),
        nlink: m.nlink(),
        content,
        link: std::fs::read_link(p).ok(),
    })
}

fn tree(dir: &Path) -> BTreeMap<PathBuf, Meta> {
    let mut out = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in rd.flatten() {
            let p = e.path();
            if let Some(m) = meta(&p) {
                if m.kind == 0o040000 {
                    stack.push(p.clone());
                }
                out.insert(p, m);
            }
        }
    }
    out
}

/// Files of the test that a node must never touch, and the host's `/` entries a node
/// following `/etc -> /` would create.
struct Victims {
    dir: PathBuf,
    baseline: BTreeMap<PathBuf, Meta>,
    root_existing: BTreeSet<String>,
}

impl Victims {
    fn new(dir: &Path) -> Victims {
        let root_existing = HOST_ROOT_TARGETS
            .iter()
            .filter(|p| std::fs::symlink_metadata(p).is_ok())
            .map(|p| p.to_string())
            .collect();
        let mut v = Victims {
            dir: dir.to_path_buf(),
            baseline: BTreeMap::new(),
            root_existing,
        };
        v.make();
        v.baseline = tree(dir);
        v
    }

    fn make(&self) {
        let t = SystemTime::UNIX_EPOCH + Duration::from_secs(VICTIM_MTIME);
        for f in VICTIM_FILES {
            let p = self.dir.join(f);
            std::fs::write(&p, format!("{f}: a host file no node may write\n")).expect("victim");
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).expect("mode");
            std::fs::File::options()
                .write(true)
                .open(&p)
                .and_then(|f| f.set_modified(t))
                .expect("mtime");
        }
        for d in VICTIM_DIRS {
            let p = self.dir.join(d);
            std::fs::create_dir_all(&p).expect("victim dir");
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).expect("mode");
            std::fs::File::open(&p)
                .and_then(|f| f.set_modified(t))
                .expect("mtime");
        }
    }

    /// What changed since the baseline: victims and the host's `/`.
    fn changes(&self) -> Vec<String> {
        let now = tree(&self.dir);
        let mut out = Vec::new();
        for (p, m) in &now {
            match self.baseline.get(p) {
                None => out.push(format!("{} was created on the host", p.display())),
                Some(b) if b != m => {
                    let mut what = Vec::new();
                    if b.content != m.content || b.len != m.len {
                        what.push("content");
                    }
                    if b.mtime != m.mtime {
                        what.push("mtime");
                    }
                    if (b.uid, b.gid) != (m.uid, m.gid) {
                        what.push("owner");
                    }
                    if b.mode != m.mode || b.kind != m.kind {
                        what.push("mode");
                    }
                    if b.nlink != m.nlink {
                        what.push("link count");
                    }
                    if b.link != m.link {
                        what.push("link target");
                    }
                    out.push(format!("{} changed ({})", p.display(), what.join(", ")));
                }
                Some(_) => {}
            }
        }
        for p in self.baseline.keys() {
            if !now.contains_key(p) {
                out.push(format!("{} was removed from the host", p.display()));
            }
        }
        for p in HOST_ROOT_TARGETS {
            if !self.root_existing.contains(*p) && std::fs::symlink_metadata(p).is_ok() {
                out.push(format!("{p} was created in the host's root"));
            }
        }
        out
    }

    /// Back to the baseline, and what escapes created in the host's `/` removed.
    fn restore(&self) {
        self.remove_root_leftovers();
        if let Ok(rd) = std::fs::read_dir(&self.dir) {
            for e in rd.flatten() {
                let p = e.path();
                if std::fs::symlink_metadata(&p).is_ok_and(|m| m.is_dir()) {
                    let _ = std::fs::remove_dir_all(&p);
                } else {
                    let _ = std::fs::remove_file(&p);
                }
            }
        }
        self.make();
        // The mtimes and modes are the baseline's; inode numbers are not compared.
    }

    fn remove_root_leftovers(&self) {
        for p in HOST_ROOT_TARGETS {
            if self.root_existing.contains(*p) {
                continue;
            }
            match std::fs::symlink_metadata(p) {
                Ok(m) if m.is_dir() => {
                    let _ = std::fs::remove_dir_all(p);
                }
                Ok(_) => {
                    let _ = std::fs::remove_file(p);
                }
                Err(_) => {}
            }
        }
    }

    /// Records the state after `attempt` as a row and restores the baseline.
    fn check(&self, report: &mut Report, attempt: &str, what_happened: &str) {
        let changes = self.changes();
        if changes.is_empty() {
            report.add(
                attempt,
                true,
                format!(
                    "no host file changed, nothing created outside the sandbox; {what_happened}"
                ),
            );
        } else {
            report.add(
                attempt,
                false,
                format!("{}; {what_happened}", changes.join("; ")),
            );
        }
        self.restore();
    }
}

impl Drop for Victims {
    fn drop(&mut self) {
        self.remove_root_leftovers();
    }
}

// ------------------------------------------------------------------ snapshot forgery

/// A ustar header block.
fn tar_header(
    name: &[u8],
    kind: u8,
    size: u64,
    link: &[u8],
    dev: (u32, u32),
    mode: u32,
) -> [u8; 512] {
    fn octal(field: &mut [u8], v: u64) {
        let s = format!("{:0w$o}\0", v, w = field.len() - 1);
        field.copy_from_slice(s.as_bytes());
    }
    let mut h = [0u8; 512];
    h[..name.len().min(100)].copy_from_slice(&name[..name.len().min(100)]);
    octal(&mut h[100..108], u64::from(mode));
    octal(&mut h[108..116], 0);
    octal(&mut h[116..124], 0);
    octal(&mut h[124..136], size);
    octal(&mut h[136..148], VICTIM_MTIME);
    h[156] = kind;
    h[157..157 + link.len().min(100)].copy_from_slice(&link[..link.len().min(100)]);
    h[257..263].copy_from_slice(b"ustar\0");
    h[263..265].copy_from_slice(b"00");
    octal(&mut h[329..337], u64::from(dev.0));
    octal(&mut h[337..345], u64::from(dev.1));
    h[148..156].copy_from_slice(b"        ");
    let sum: u64 = h.iter().map(|&b| u64::from(b)).sum();
    let s = format!("{sum:06o}\0 ");
    h[148..156].copy_from_slice(s.as_bytes());
    h
}

/// A tar entry: name, type flag, data, link target, device numbers.
type TarEntry = (Vec<u8>, u8, Vec<u8>, Vec<u8>, (u32, u32));

/// A tar archive of `entries`.
fn tar(entries: &[TarEntry]) -> Vec<u8> {
    let mut out = Vec::new();
    for (name, kind, data, link, dev) in entries {
        let mode = if *kind == b'5' { 0o755 } else { 0o644 };
        out.extend_from_slice(&tar_header(
            name,
            *kind,
            data.len() as u64,
            link,
            *dev,
            mode,
        ));
        out.extend_from_slice(data);
        let pad = (512 - data.len() % 512) % 512;
        out.extend(std::iter::repeat_n(0u8, pad));
    }
    out.extend(std::iter::repeat_n(0u8, 1024));
    out
}

/// The escaping layers, each a tar: (name, archive, what escaping looks like).
fn evil_layers(victims: &Path) -> Vec<(&'static str, Vec<u8>)> {
    let v = victims.display().to_string();
    let vrel = v.trim_start_matches('/').to_string();
    let up = "../".repeat(16);
    let reg = |name: String, data: &str| {
        (
            name.into_bytes(),
            b'0',
            data.as_bytes().to_vec(),
            Vec::new(),
            (0, 0),
        )
    };
    let link = |name: &str, kind: u8, target: String| {
        (
            name.as_bytes().to_vec(),
            kind,
            Vec::new(),
            target.into_bytes(),
            (0, 0),
        )
    };
    let dir = |name: &str| {
        (
            name.as_bytes().to_vec(),
            b'5',
            Vec::new(),
            Vec::new(),
            (0, 0),
        )
    };
    vec![
        (
            "layer-dotdot",
            tar(&[reg(format!("{up}{vrel}/escape-dotdot"), "escaped\n")]),
        ),
        (
            "layer-absolute",
            tar(&[reg(format!("{v}/escape-absolute"), "escaped\n")]),
        ),
        (
            "layer-symlink-then-file",
            tar(&[
                link("escape-link", b'2', format!("{v}/victim-layerdir")),
                reg("escape-link/escape-through-link".into(), "escaped\n"),
            ]),
        ),
        (
            "layer-relative-symlink-then-file",
            tar(&[
                link("escape-link", b'2', format!("{up}{vrel}/victim-layerdir")),
                reg("escape-link/escape-through-link".into(), "escaped\n"),
            ]),
        ),
        (
            "layer-hardlink-absolute",
            tar(&[link(
                "escape-hardlink",
                b'1',
                format!("{v}/victim-hardlink"),
            )]),
        ),
        (
            "layer-hardlink-relative",
            tar(&[link(
                "escape-hardlink",
                b'1',
                format!("{up}{vrel}/victim-hardlink"),
            )]),
        ),
        (
            "layer-links-at-node-paths",
            tar(&[
                dir("etc/"),
                link("etc/hosts", b'2', format!("{v}/victim-hosts")),
                link("etc/hostname", b'2', format!("{up}{vrel}/victim-hostname")),
                link("etc/resolv.conf", b'2', format!("{v}/victim-resolv.conf")),
                dir("agentenv/"),
                link(
                    "agentenv/agentenv-guest",
                    b'2',
                    format!("{v}/victim-agentbin"),
                ),
            ]),
        ),
        (
            "layer-block-device",
            tar(&[(
                b"dev-hostdisk".to_vec(),
                b'4',
                Vec::new(),
                Vec::new(),
                root_disk(),
            )]),
        ),
        (
            "layer-char-device",
            tar(&[(b"dev-kvm".to_vec(), b'3', Vec::new(), Vec::new(), (10, 232))]),
        ),
    ]
}

/// The host's root disk as `(major, minor)`.
fn root_disk() -> (u32, u32) {
    let dev = std::fs::metadata("/").map(|m| m.dev()).unwrap_or(0);
    (libc::major(dev), libc::minor(dev))
}

/// `data` as a zstd frame of raw blocks, then a skippable frame padding it to exactly
/// `size` bytes (`None` if it does not fit).
fn zstd_padded(data: &[u8], size: usize) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    out.extend_from_slice(&0xFD2F_B528u32.to_le_bytes());
    // No content size, not single-segment: a window descriptor follows (2^17 bytes).
    out.push(0x00);
    out.push(7 << 3);
    let chunks: Vec<&[u8]> = data.chunks(64 * 1024).collect();
    for (i, c) in chunks.iter().enumerate() {
        let last = u32::from(i + 1 == chunks.len());
        let hdr = last | ((c.len() as u32) << 3);
        out.extend_from_slice(&hdr.to_le_bytes()[..3]);
        out.extend_from_slice(c);
    }
    let pad = size.checked_sub(out.len())?;
    if pad == 0 {
        return Some(out);
    }
    if pad < 8 {
        return None;
    }
    out.extend_from_slice(&0x184D_2A50u32.to_le_bytes());
    out.extend_from_slice(&((pad - 8) as u32).to_le_bytes());
    out.extend(std::iter::repeat_n(0u8, pad - 8));
    Some(out)
}

/// A random UUID (v4 layout).
fn uuid() -> String {
    let mut b = [0u8; 16];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut b))
        .expect("random bytes");
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let h: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &h[..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..]
    )
}

/// Entries of a directory (names), empty when it does not exist.
fn names(dir: &Path) -> BTreeSet<String> {
    std::fs::read_dir(dir)
        .map(|rd| {
            rd.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

fn sandbox_count(node: SocketAddr) -> usize {
    api(node, "GET", "/v2/sandboxes", "")
        .1
        .as_array()
        .map(Vec::len)
        .unwrap_or(0)
}

/// Creates a sandbox from `template` (a forged or tampered snapshot) and judges it:
/// contained when the create fails with a message and nothing changed on the host, no
/// sandbox and no kept layer was left behind.
fn judge_forged_start(
    s: &mut Suite,
    kept_dir: &Path,
    attempt: &str,
    template: &str,
    probe: Option<&str>,
) {
    let node = s.node;
    let kept_before = names(kept_dir);
    let count_before = sandbox_count(node);
    let (st, v) = api(
        node,
        "POST",
        "/v2/sandboxes",
        &create_body(template, attempt),
    );
    let message = v["message"].as_str().unwrap_or_default().to_string();
    let mut notes = Vec::new();
    let mut started = None;
    if st == 201 {
        let x = Sbx {
            label: attempt.into(),
            id: v["sandboxID"].as_str().unwrap_or_default().to_string(),
            token: v["envdAccessToken"].as_str().map(String::from),
        };
        if let Some(cmd) = probe {
            match s.sh(&x, cmd) {
                Ok(r) => notes.push(format!(
                    "inside: {}",
                    format!("{} {}", r.stdout.trim(), r.stderr.trim()).trim()
                )),
                Err(e) => notes.push(format!("inside: {e}")),
            }
        }
        let _ = api(node, "DELETE", &format!("/sandboxes/{}", x.id), "");
        started = Some(x.id);
    }
    let changes = s.victims.changes();
    let kept_after = names(kept_dir);
    let count_after = sandbox_count(node);
    let leftovers: Vec<&String> = kept_after.difference(&kept_before).collect();
    s.victims.restore();
    let mut problems = changes;
    if let Some(id) = &started {
        problems.push(format!("a sandbox ({id}) started from it"));
    }
    if !leftovers.is_empty() {
        problems.push(format!("kept layers left behind: {leftovers:?}"));
    }
    if started.is_none() && count_after != count_before {
        problems.push(format!(
            "the node lists {count_after} sandboxes, {count_before} before"
        ));
    }
    if st != 201 && message.trim().is_empty() {
        problems.push(format!("refused with HTTP {st} but no message"));
    }
    let detail = format!(
        "HTTP {st}{}{}",
        if message.is_empty() {
            String::new()
        } else {
            format!(": {message}")
        },
        if notes.is_empty() {
            String::new()
        } else {
            format!("; {}", notes.join("; "))
        }
    );
    if problems.is_empty() {
        if st == 404 && message.contains("not found") && message.contains(template) {
            s.report.add(
                attempt,
                false,
                format!(
                    "inconclusive: the node did not find the planted snapshot (has the repository layout changed? update the suite); {detail}"
                ),
            );
        } else {
            s.report.add(
                attempt,
                true,
                format!("refused, nothing left behind; {detail}"),
            );
        }
    } else {
        s.report
            .add(attempt, false, format!("{}; {detail}", problems.join("; ")));
    }
}

// ------------------------------------------------------------------ symlink scenarios

/// (name, planting script): links at every path the node writes into a sandbox's tree.
fn scenarios(victims: &Path) -> Vec<(&'static str, String)> {
    let v = victims.display().to_string();
    let vrel = v.trim_start_matches('/');
    let up = "../".repeat(16);
    vec![
        (
            "etc-files",
            format!(
                "rm -f /etc/hosts && ln -s {v}/victim-hosts /etc/hosts && echo planted /etc/hosts; \
                 rm -f /etc/hostname && ln -s {up}{vrel}/victim-hostname /etc/hostname && echo planted /etc/hostname; \
                 rm -f /etc/resolv.conf && ln -s {v}/victim-resolv.conf /etc/resolv.conf && echo planted /etc/resolv.conf"
            ),
        ),
        (
            "etc-to-host-root",
            "mv /etc /etc.moved && ln -s / /etc && echo planted /etc".to_string(),
        ),
        (
            "etc-dir-relative",
            format!(
                "mv /etc /etc.moved && ln -s {up}{vrel}/victim-etcdir /etc && echo planted /etc"
            ),
        ),
        (
            "agent-dir",
            format!(
                "mv /agentenv /agentenv.moved && ln -s {v}/victim-agentdir /agentenv && echo planted /agentenv"
            ),
        ),
        (
            "agent-binary",
            format!(
                "mv /agentenv /agentenv.moved && mkdir /agentenv && ln -s {v}/victim-agentbin /agentenv/agentenv-guest && echo planted /agentenv/agentenv-guest"
            ),
        ),
    ]
}

/// Errors that mean the sandbox itself refused the planting.
fn refused_by_isolation(stderr: &str) -> bool {
    [
        "Device or resource busy",
        "Read-only file system",
        "Operation not permitted",
        "Permission denied",
    ]
    .iter()
    .any(|m| stderr.contains(m))
}

// ------------------------------------------------------------------ the test

/// What the steps of the suite share.
struct Suite {
    rt: tokio::runtime::Runtime,
    /// The node's API on loopback (it listens on every address, port `port`).
    node: SocketAddr,
    port: u16,
    report: Report,
    victims: Victims,
}

impl Suite {
    fn run(&self, s: &Sbx, cmd: &str, args: &[&str]) -> Result<Ran, String> {
        run(&self.rt, self.node, s, cmd, args)
    }

    fn sh(&self, s: &Sbx, script: &str) -> Result<Ran, String> {
        sh(&self.rt, self.node, s, script)
    }

    /// A row saying whether `s` still runs a command.
    fn still_answers(&mut self, attempt: &str, s: &Sbx, context: &str) {
        match answers(&self.rt, self.node, s) {
            Ok(()) => self.report.add(
                attempt,
                true,
                format!("{context}: a command ran in {}", s.label),
            ),
            Err(e) => self.report.add(
                attempt,
                false,
                format!("{context}: {} no longer runs commands: {e}", s.label),
            ),
        }
    }
}

#[test]
fn hostile_root_in_jail_sandboxes_is_contained() {
    if let Some(r) = skip_reason() {
        eprintln!("SKIPPED: {r}");
        return;
    }
    let attack_bin = attack_binary().unwrap_or_else(|e| panic!("the attacker binary: {e}"));

    let settings_before = host_settings();
    let dev_before = dev_listing();
    let vdir = tempfile::Builder::new()
        .prefix("attack-victims-")
        .tempdir_in("/tmp")
        .expect("victims dir");
    let scheduler = FakeScheduler::start();
    let home = tempfile::tempdir().expect("node home");
    let store = home.path().join("snapshot-store");
    let port = free_port();
    let mut node_proc = start_node(home.path(), &store, port);
    let node_pid = node_proc.pid();
    let mut suite = Suite {
        rt: tokio::runtime::Runtime::new().expect("runtime"),
        node: SocketAddr::from(([127, 0, 0, 1], port)),
        port,
        report: Report::default(),
        victims: Victims::new(vdir.path()),
    };
    let s = &mut suite;

    let a = create(s.node, "A");
    let b = create(s.node, "B");
    for x in [&a, &b] {
        s.rt.block_on(guest(s.node, x).upload_file(&attack_bin, ATTACKER))
            .unwrap_or_else(|e| panic!("uploading the attacker into {}: {e}", x.label));
        let r = s
            .run(x, "/bin/chmod", &["755", ATTACKER])
            .unwrap_or_else(|e| panic!("chmod in {}: {e}", x.label));
        assert_eq!(r.code, 0, "chmod in {}: {}", x.label, r.stderr);
    }
    let fa = net_facts(&s.rt, s.node, &a);
    let fb = net_facts(&s.rt, s.node, &b);
    let a_ip = fa.ip.expect("sandbox A's address");
    let b_ip = fb.ip.expect("sandbox B's address");
    for ip in [a_ip, b_ip] {
        assert!(
            reachable_from_host(SocketAddr::new(IpAddr::V4(ip), AGENT_PORT)),
            "the host cannot reach the agent at {ip}:{AGENT_PORT}: the sandbox-to-sandbox attempts would prove nothing"
        );
    }
    let targets = host_targets(s.port, scheduler.port, &fa, &fb);
    let metadata_note = if reachable_from_host(SocketAddr::from(([169, 254, 169, 254], 80))) {
        ""
    } else {
        " (the host cannot reach 169.254.169.254:80 either: that row proves nothing here)"
    };
    let host_args = host_args(node_pid);

    // 1. Every attempt in A; 2. B's network attempts against A.
    attacks_in_a(s, &a, b_ip, &targets, &host_args, metadata_note);
    s.still_answers(
        "host/sandbox-A-answers-after-its-bombs",
        &a,
        "after the fork, memory and disk bombs",
    );
    let mut args_b = vec![
        "connect:*".to_string(),
        "--peer".into(),
        format!("{a_ip}:{AGENT_PORT}"),
        "--host-ports".into(),
        format!("gateway:{port},gateway:{}", scheduler.port),
    ];
    args_b.extend(host_args.iter().cloned());
    let argv_b: Vec<&str> = args_b.iter().map(String::as_str).collect();
    let out_b = s.run(&b, ATTACKER, &argv_b);
    let expected_b = vec![
        format!("connect:{a_ip}:{AGENT_PORT}"),
        format!("connect:gateway:{port}"),
        format!("connect:gateway:{}", scheduler.port),
        "connect:169.254.169.254:80".to_string(),
    ];
    collect(&mut s.report, "B", out_b, &expected_b, metadata_note);

    // 3. inotify exhaustion in A, held while the host makes an instance and a watch.
    let watch = s.victims.dir.join("victim-hosts");
    inotify_while_held(&mut s.report, &s.rt, s.node, &a, &watch);

    // 4. Symlinks where the node writes: snapshot → start, then pause (for the restart);
    // 5. forged and tampered snapshots.
    let planted = symlinks_then_snapshot_start(s);
    forged_snapshots(s, &store.join("repository"), &home.path().join("jail/kept"));
    s.still_answers(
        "host/node-serves-B-after-the-attacks",
        &b,
        "after the attacks",
    );

    // 6. Node restart: paused sandboxes come back from their kept layers.
    let status = node_proc.stop();
    eprintln!("[attack] node stopped: {status:?}");
    let mut node_proc = start_node(home.path(), &store, port);
    for (name, x, note) in &planted {
        let (st, v) = api(s.node, "POST", &format!("/sandboxes/{}/resume", x.id), "{}");
        let what = format!(
            "{note}; resume after the restart: HTTP {st} {}",
            v["message"].as_str().unwrap_or("")
        );
        s.victims
            .check(&mut s.report, &format!("host/restart-resume:{name}"), &what);
    }
    let (st, _) = api(s.node, "POST", &format!("/sandboxes/{}/resume", b.id), "{}");
    s.still_answers(
        "host/node-serves-B-after-the-restart",
        &b,
        &format!("after the node restarted and B resumed (HTTP {st})"),
    );

    // 7. The host afterwards.
    host_afterwards(&mut s.report, &settings_before, &dev_before, &scheduler);

    for id in [&a.id, &b.id]
        .into_iter()
        .chain(planted.iter().map(|(_, x, _)| &x.id))
    {
        let _ = api(s.node, "DELETE", &format!("/sandboxes/{id}"), "");
    }
    node_proc.stop();
    suite.victims.remove_root_leftovers();
    suite.report.print();
    let escapes = suite.report.escapes();
    assert!(
        escapes.is_empty(),
        "{} of {} attempts escaped:\n{}",
        escapes.len(),
        suite.report.rows.len(),
        escapes.join("\n")
    );
}

/// The attacker's options about the host, the same for every run.
fn host_args(node_pid: u32) -> Vec<String> {
    let mut comms = vec!["agentenv-node".to_string()];
    comms.extend(comm(&node_pid.to_string()));
    comms.extend(comm("self"));
    comms.extend(comm("1").filter(|c| c != "agentenv-guest"));
    comms.sort();
    comms.dedup();
    let (major, minor) = root_disk();
    vec![
        "--block-dev".into(),
        format!("{major}:{minor}"),
        "--host-comm".into(),
        comms.join(","),
        "--host-ns".into(),
        namespaces(node_pid),
        "--disk-cap-mb".into(),
        DISK_CAP_MB.to_string(),
        "--disk-slack-mb".into(),
        DISK_SLACK_MB.to_string(),
        "--memory-mb".into(),
        MEMORY_MB.to_string(),
        "--connect-timeout-ms".into(),
        "700".into(),
    ]
}

/// The node's port and the stand-in scheduler's on every host address a sandbox could
/// route to: loopback (the sandbox's own, as it should be), the host's other addresses,
/// A's gateway, B's gateway and the link-local address of the host side of A's link.
/// Only targets the host itself reaches count (a closed port would prove nothing).
fn host_targets(node_port: u16, scheduler_port: u16, fa: &NetFacts, fb: &NetFacts) -> Vec<String> {
    let prefix = node_iface_prefix(IDX);
    let ll = fa
        .peer_ifindex
        .and_then(|i| host_link_local(i).map(|a| (i, a)));
    let mut candidates: Vec<(String, Option<SocketAddr>)> = Vec::new();
    for p in [node_port, scheduler_port] {
        candidates.push((
            format!("127.0.0.1:{p}"),
            Some(SocketAddr::from(([127, 0, 0, 1], p))),
        ));
        for (ifname, ip) in host_ipv4() {
            if ifname != "lo" && !ifname.starts_with(&prefix) {
                candidates.push((
                    format!("{ip}:{p}"),
                    Some(SocketAddr::new(IpAddr::V4(ip), p)),
                ));
            }
        }
        candidates.push((
            format!("gateway:{p}"),
            fa.gateway.map(|g| SocketAddr::new(IpAddr::V4(g), p)),
        ));
        if let Some(g) = fb.gateway {
            candidates.push((format!("{g}:{p}"), Some(SocketAddr::new(IpAddr::V4(g), p))));
        }
        if let Some((idx, addr)) = ll {
            candidates.push((
                format!("[{addr}%eth0]:{p}"),
                Some(SocketAddr::V6(SocketAddrV6::new(addr, p, 0, idx))),
            ));
        }
    }
    let (mut targets, mut skipped) = (Vec::new(), Vec::new());
    for (t, addr) in candidates {
        if addr.is_some_and(reachable_from_host) {
            targets.push(t);
        } else {
            skipped.push(t);
        }
    }
    eprintln!(
        "[attack] targets {targets:?}; not reachable from the host either, so not tried: {skipped:?}"
    );
    targets
}

/// Every attempt of the attacker in A (inotify apart: it runs while the host checks).
fn attacks_in_a(
    s: &mut Suite,
    a: &Sbx,
    b_ip: Ipv4Addr,
    targets: &[String],
    host_args: &[String],
    metadata_note: &str,
) {
    // `list` with the same options: some attempts exist per option (the host disk's
    // mknod attempts need --block-dev); the network ones are named by their targets.
    let mut list_args = vec!["list".to_string()];
    list_args.extend(host_args.iter().cloned());
    let list_argv: Vec<&str> = list_args.iter().map(String::as_str).collect();
    let list = s.run(a, ATTACKER, &list_argv).expect("sandbox-attack list");
    let names: Vec<String> = list
        .stdout
        .lines()
        .map(str::to_string)
        .filter(|n| !n.is_empty() && n != "inotify-exhaust" && !n.starts_with("connect:"))
        .collect();
    assert!(names.len() > 50, "sandbox-attack list: {}", list.stdout);
    let mut args = vec![format!("{},connect:*", names.join(","))];
    if !targets.is_empty() {
        args.push("--host-ports".into());
        args.push(targets.join(","));
    }
    args.push("--peer".into());
    args.push(format!("{b_ip}:{AGENT_PORT}"));
    args.extend(host_args.iter().cloned());
    let argv: Vec<&str> = args.iter().map(String::as_str).collect();
    let started = Instant::now();
    let out = s.run(a, ATTACKER, &argv);
    eprintln!(
        "[attack] sandbox A ran its attempts in {:?}",
        started.elapsed()
    );
    let mut expected = names;
    expected.extend(targets.iter().map(|t| format!("connect:{t}")));
    expected.push("connect:169.254.169.254:80".into());
    expected.push(format!("connect:{b_ip}:{AGENT_PORT}"));
    collect(&mut s.report, "A", out, &expected, metadata_note);
    // A node the jail let the tenant make but whose open this machine's own device
    // cgroup refused proves nothing about the jail.
    let (major, minor) = root_disk();
    if let Err(e) = host_opens_block_device((major, minor)) {
        for r in s.report.rows.iter_mut().filter(|r| {
            r.attempt.starts_with("A/mknod-hostdisk:")
                && r.contained
                && r.detail
                    .contains("succeeded but opening the node was refused")
        }) {
            r.contained = false;
            r.detail = format!(
                "inconclusive: {}; but this host cannot open {major}:{minor} either ({e}): only this machine's own device cgroup stopped it, the jail's device policy is untested",
                r.detail
            );
        }
    }
}

/// A sandbox whose tree holds planted links, paused for the restart, with what was
/// planted.
type Planted = (&'static str, Sbx, String);

/// Plants the links of every scenario in a sandbox of its own, snapshots it and starts
/// a sandbox from the snapshot, then pauses it (it is resumed after the node restarts).
fn symlinks_then_snapshot_start(s: &mut Suite) -> Vec<Planted> {
    let mut planted = Vec::new();
    for (name, script) in scenarios(&s.victims.dir) {
        if name == "etc-to-host-root" && !s.victims.root_existing.is_empty() {
            for flow in ["snapshot-start", "restart-resume"] {
                s.report.add(
                    format!("host/{flow}:{name}"),
                    false,
                    format!(
                        "inconclusive: not tried, {:?} exist in this host's / and could not be told apart",
                        s.victims.root_existing
                    ),
                );
            }
            continue;
        }
        let x = create(s.node, &format!("symlinks-{name}"));
        let plant = s.sh(&x, &script);
        let plant_note = match &plant {
            Ok(r) => format!(
                "planted: [{}]{}",
                r.stdout
                    .lines()
                    .filter_map(|l| l.strip_prefix("planted "))
                    .collect::<Vec<_>>()
                    .join(", "),
                if r.stderr.trim().is_empty() {
                    String::new()
                } else {
                    format!(", errors: {}", r.stderr.trim())
                }
            ),
            Err(e) => format!("planting failed: {e}"),
        };
        if plant
            .as_ref()
            .map_or(true, |r| !r.stdout.contains("planted"))
        {
            let by_isolation = plant
                .as_ref()
                .is_ok_and(|r| refused_by_isolation(&r.stderr));
            for flow in ["snapshot-start", "restart-resume"] {
                s.report.add(
                    format!("host/{flow}:{name}"),
                    by_isolation,
                    if by_isolation {
                        format!("the sandbox refused the links: {plant_note}")
                    } else {
                        format!("inconclusive: {plant_note}")
                    },
                );
            }
            let _ = api(s.node, "DELETE", &format!("/sandboxes/{}", x.id), "");
            continue;
        }
        // (a) A snapshot, then a sandbox from it.
        let (st, v) = api(
            s.node,
            "POST",
            &format!("/sandboxes/{}/snapshots", x.id),
            "{}",
        );
        let message = v["message"].as_str().unwrap_or("").to_string();
        let attempt = format!("host/snapshot-start:{name}");
        if st == 201 {
            let snap = v["snapshotID"].as_str().unwrap_or_default().to_string();
            let (st2, v2) = api(
                s.node,
                "POST",
                "/v2/sandboxes",
                &create_body(&snap, "from-snapshot"),
            );
            if st2 == 201
                && let Some(id) = v2["sandboxID"].as_str()
            {
                let _ = api(s.node, "DELETE", &format!("/sandboxes/{id}"), "");
            }
            let _ = api(s.node, "DELETE", &format!("/templates/{snap}"), "");
            let what = format!(
                "{plant_note}; snapshot {snap}; the sandbox from it: HTTP {st2} {}",
                v2["message"].as_str().unwrap_or("")
            );
            s.victims.check(&mut s.report, &attempt, &what);
        } else if ["link", "outside", "escap"]
            .iter()
            .any(|w| message.contains(w))
        {
            // Refusing to snapshot a tree whose links leave it is containment too.
            let what = format!("{plant_note}; the snapshot was refused: HTTP {st} {message}");
            s.victims.check(&mut s.report, &attempt, &what);
        } else {
            let changes = s.victims.changes();
            s.victims.restore();
            s.report.add(
                attempt,
                false,
                format!(
                    "inconclusive: {plant_note}; the snapshot failed: HTTP {st} {message}{}",
                    if changes.is_empty() {
                        String::new()
                    } else {
                        format!("; {}", changes.join("; "))
                    }
                ),
            );
        }
        // (b) Paused now; resumed after the node restarts.
        let (st, v) = api(s.node, "POST", &format!("/sandboxes/{}/pause", x.id), "");
        let note = format!(
            "{plant_note}; pause: HTTP {st} {}",
            v["message"].as_str().unwrap_or("")
        );
        s.victims
            .check(&mut s.report, &format!("host/pause:{name}"), "paused");
        planted.push((name, x, note));
    }
    planted
}

/// Rows about the host after everything: inotify limits, kernel settings, `/dev`, and
/// whether a sandbox's connection reached the stand-in scheduler.
fn host_afterwards(
    report: &mut Report,
    settings_before: &BTreeMap<String, String>,
    dev_before: &BTreeSet<String>,
    scheduler: &FakeScheduler,
) {
    let settings_after = host_settings();
    let inotify = |m: &BTreeMap<String, String>| {
        m.iter()
            .filter(|(k, _)| k.contains("/inotify/"))
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
    };
    let (ib, ia) = (inotify(settings_before), inotify(&settings_after));
    report.add(
        "host/inotify-limits-unchanged",
        ib == ia,
        format!("before {ib:?}, after {ia:?}"),
    );
    let changed: Vec<String> = settings_before
        .iter()
        .filter(|(k, v)| settings_after.get(*k) != Some(v))
        .map(|(k, v)| format!("{k}: {v:?} → {:?}", settings_after.get(k)))
        .collect();
    report.add(
        "host/kernel-settings-unchanged",
        changed.is_empty(),
        if changed.is_empty() {
            format!("{} settings as before", settings_before.len())
        } else {
            changed.join("; ")
        },
    );
    let dev_after = dev_listing();
    let added: Vec<&String> = dev_after.difference(dev_before).collect();
    let removed: Vec<&String> = dev_before.difference(&dev_after).collect();
    report.add(
        "host/dev-unchanged",
        added.is_empty() && removed.is_empty(),
        if added.is_empty() && removed.is_empty() {
            format!("{} entries in /dev as before", dev_after.len())
        } else {
            format!("added {added:?}, removed {removed:?}")
        },
    );
    // node_env's address pool of this node: 10.15.<IDX>.0/24.
    let seen = scheduler.sandbox_peers([10, 15, IDX]);
    report.add(
        "host/stand-in-scheduler-saw-no-sandbox",
        seen.is_empty(),
        if seen.is_empty() {
            format!(
                "no connection from a sandbox reached port {}",
                scheduler.port
            )
        } else {
            format!("connections from sandboxes: {seen:?}")
        },
    );
}

/// Parses the attacker's lines into rows; an expected attempt without a line (the
/// attacker died, was killed or stopped early) is a row that is not contained.
fn collect(
    report: &mut Report,
    who: &str,
    out: Result<Ran, String>,
    expected: &[String],
    metadata_note: &str,
) {
    let out = match out {
        Ok(o) => o,
        Err(e) => {
            report.add(
                format!("{who}/attacker"),
                false,
                format!("running the attacker failed: {e}"),
            );
            return;
        }
    };
    let mut seen = BTreeSet::new();
    let mut summary = None;
    for line in out.stdout.lines() {
        let Ok(v) = serde_json::from_str::<Value>(line) else {
            continue;
        };
        if let Some(name) = v["attempt"].as_str() {
            let mut detail = v["detail"].as_str().unwrap_or_default().to_string();
            if name.contains("169.254.169.254") {
                detail.push_str(metadata_note);
            }
            report.add(
                format!("{who}/{name}"),
                v["contained"].as_bool().unwrap_or(false),
                detail,
            );
            seen.insert(name.to_string());
        } else if v.get("summary").is_some() {
            summary = Some(v);
        }
    }
    let tail: String = out
        .stderr
        .chars()
        .rev()
        .take(400)
        .collect::<Vec<_>>()
        .into_iter()
        .rev()
        .collect();
    for e in expected {
        if !seen.contains(e) {
            report.add(
                format!("{who}/{e}"),
                false,
                format!(
                    "no result: the attacker ended first (exit {}; stderr …{tail})",
                    out.code
                ),
            );
        }
    }
    if summary.is_none() {
        report.add(
            format!("{who}/attacker-finished"),
            false,
            format!(
                "the attacker did not finish (exit {}; stderr …{tail})",
                out.code
            ),
        );
    }
}

/// Runs `inotify-exhaust --hold` in `s`; while it holds what it took, the host creates
/// an inotify instance and a watch.
fn inotify_while_held(
    report: &mut Report,
    rt: &tokio::runtime::Runtime,
    node: SocketAddr,
    s: &Sbx,
    watch: &Path,
) {
    let client = guest(node, s);
    let req = pr::StartRequest {
        process: Some(pr::ProcessConfig {
            cmd: ATTACKER.into(),
            args: vec!["inotify-exhaust".into(), "--hold".into()],
            ..Default::default()
        }),
        stdin: Some(true),
        ..Default::default()
    };
    // The attacker's stdout, and how the host fared while it held.
    type Held = (String, Option<Result<(), String>>);
    let result: Result<Held, String> = rt.block_on(async {
        use pr::process_event::Event;
        use pr::process_event::data_event::Output;
        let mut stream = client.start(&req).await.map_err(|e| e.to_string())?;
        let (mut pid, mut stdout, mut host) = (None, String::new(), None);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(150);
        loop {
            let next = tokio::time::timeout_at(deadline, stream.next())
                .await
                .map_err(|_| "no end within 150 s".to_string())?;
            let Some(item) = next else { break };
            match item.map_err(|e| e.to_string())?.event.and_then(|e| e.event) {
                Some(Event::Start(st)) => pid = Some(st.pid),
                Some(Event::Data(d)) => {
                    if let Some(Output::Stdout(b)) = d.output {
                        stdout.push_str(&String::from_utf8_lossy(&b));
                    }
                }
                Some(Event::End(_)) => break,
                _ => {}
            }
            if host.is_none() && stdout.contains("\"holding\"") {
                host = Some(host_inotify(watch));
                if let Some(p) = pid {
                    let sel = pr::ProcessSelector {
                        selector: Some(pr::process_selector::Selector::Pid(p)),
                    };
                    client.close_stdin(sel).await.map_err(|e| e.to_string())?;
                }
            }
        }
        Ok((stdout, host))
    });
    match result {
        Err(e) => report.add(
            "A/inotify-exhaust",
            false,
            format!("running it failed: {e}"),
        ),
        Ok((stdout, host)) => {
            let mut found = false;
            for line in stdout.lines() {
                let Ok(v) = serde_json::from_str::<Value>(line) else {
                    continue;
                };
                if let Some(h) = v.get("holding") {
                    eprintln!("[attack] inotify held in A: {v} ({h})");
                } else if let Some(name) = v["attempt"].as_str() {
                    found = true;
                    report.add(
                        format!("A/{name}"),
                        v["contained"].as_bool().unwrap_or(false),
                        v["detail"].as_str().unwrap_or_default(),
                    );
                }
            }
            if !found {
                report.add("A/inotify-exhaust", false, format!("no result: {stdout:?}"));
            }
            match host {
                Some(Ok(())) => report.add(
                    "host/inotify-usable-while-a-tenant-exhausts-its-own",
                    true,
                    "while A held every inotify instance and watch it could get, the host made an instance and a watch",
                ),
                Some(Err(e)) => report.add("host/inotify-usable-while-a-tenant-exhausts-its-own", false, format!("while A held its inotify instances and watches: {e}")),
                None => report.add("host/inotify-usable-while-a-tenant-exhausts-its-own", false, "inconclusive: the attacker never said it was holding"),
            }
        }
    }
}

/// Snapshots put into the repository by hand (see the module doc).
fn forged_snapshots(s: &mut Suite, repo: &Path, kept_dir: &Path) {
    let node = s.node;
    // A genuine snapshot to copy the record of, and one per tampered layer (each large
    // enough that an escaping layer fits in its layer file's size).
    let c = create(node, "genuine");
    if let Err(e) = s.sh(&c, "head -c 131072 /dev/urandom > /root/pad.bin") {
        s.report.add(
            "host/forged-snapshots",
            false,
            format!("inconclusive: preparing the genuine sandbox: {e}"),
        );
        return;
    }
    let layers = evil_layers(&s.victims.dir);
    let mut genuine = Vec::new();
    for _ in 0..=layers.len() {
        let (st, v) = api(
            node,
            "POST",
            &format!("/sandboxes/{}/snapshots", c.id),
            "{}",
        );
        if st != 201 {
            s.report.add(
                "host/forged-snapshots",
                false,
                format!("inconclusive: snapshotting a clean sandbox failed: HTTP {st} {v}"),
            );
            return;
        }
        genuine.push(v["snapshotID"].as_str().unwrap_or_default().to_string());
    }
    let _ = api(node, "DELETE", &format!("/sandboxes/{}", c.id), "");
    let record_path = |id: &str| repo.join("catalog/records").join(format!("{id}.json"));
    let files_dir = |id: &str| repo.join("snapshots").join(id);
    let Some(template_record) = std::fs::read(record_path(&genuine[0]))
        .ok()
        .and_then(|b| serde_json::from_slice::<Value>(&b).ok())
    else {
        s.report.add(
            "host/forged-snapshots",
            false,
            format!(
                "inconclusive: no record at {} (has the repository layout changed? update the suite)",
                record_path(&genuine[0]).display()
            ),
        );
        return;
    };

    // Forged records: a record this test wrote, with a harmless layer, with each
    // escaping layer, with a template path and a file name that leave the repository.
    let forge = |layer: &[u8], edit: &dyn Fn(&mut Value)| -> Result<String, String> {
        let id = uuid();
        let mut rec = template_record.clone();
        rec["id"] = json!(id);
        rec["alias"] = Value::Null;
        let committed = rec
            .get_mut("committed")
            .ok_or("the record has no `committed`")?;
        committed["capture"]["files"] = json!(["layer.tar"]);
        committed["sizes"] = json!({"layer.tar": layer.len()});
        edit(&mut rec);
        let dir = files_dir(&id);
        std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
        std::fs::write(dir.join("layer.tar"), layer).map_err(|e| e.to_string())?;
        let raw = serde_json::to_vec_pretty(&rec).map_err(|e| e.to_string())?;
        std::fs::write(dir.join("manifest.json"), &raw).map_err(|e| e.to_string())?;
        std::fs::write(record_path(&id), &raw).map_err(|e| e.to_string())?;
        Ok(id)
    };
    let benign = tar(&[(
        b"root/forged.txt".to_vec(),
        b'0',
        b"forged\n".to_vec(),
        Vec::new(),
        (0, 0),
    )]);
    let mut forged: Vec<(String, Result<String, String>, Option<&str>)> = vec![
        (
            "host/forged-record:harmless-layer".into(),
            forge(&benign, &|_| {}),
            None,
        ),
        (
            "host/forged-record:template-path-traversal".into(),
            forge(&benign, &|r| {
                r["committed"]["template"] = json!("../../../../../../tmp")
            }),
            None,
        ),
        (
            "host/forged-record:file-name-traversal".into(),
            forge(&benign, &|r| {
                r["committed"]["capture"]["files"] = json!(["../../../../../../etc/hostname"]);
                r["committed"]["sizes"] = json!({});
            }),
            None,
        ),
    ];
    let probe_of = |name: &str| match name {
        "layer-block-device" => Some("head -c 2048 /dev-hostdisk | wc -c"),
        "layer-char-device" => Some("ls -l /dev-kvm; head -c 1 /dev-kvm | wc -c"),
        "layer-hardlink-absolute" | "layer-hardlink-relative" => {
            Some("stat -c '%h links' /escape-hardlink")
        }
        _ => None,
    };
    for (name, layer) in &layers {
        forged.push((
            format!("host/forged-record:{name}"),
            forge(layer, &|_| {}),
            probe_of(name),
        ));
    }
    for (attempt, id, probe) in forged {
        match id {
            Ok(id) => {
                judge_forged_start(s, kept_dir, &attempt, &id, probe);
                let _ = std::fs::remove_file(record_path(&id));
                let _ = std::fs::remove_dir_all(files_dir(&id));
            }
            Err(e) => s.report.add(
                attempt,
                false,
                format!("inconclusive: forging the record failed: {e}"),
            ),
        }
    }

    // Genuine records whose layer file was swapped for an escaping one of the same size.
    for ((name, layer), id) in layers.iter().zip(genuine.iter().skip(1)) {
        let attempt = format!("host/swapped-layer:{name}");
        let files: Vec<PathBuf> = std::fs::read_dir(files_dir(id))
            .map(|rd| {
                rd.flatten()
                    .map(|e| e.path())
                    .filter(|p| {
                        p.file_name()
                            .is_some_and(|n| n.to_string_lossy().starts_with("layer"))
                    })
                    .collect()
            })
            .unwrap_or_default();
        let mut swapped = Vec::new();
        let mut failed = None;
        for f in &files {
            let size = std::fs::metadata(f).map(|m| m.len() as usize).unwrap_or(0);
            let name = f
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            let data = if name.ends_with(".zst") {
                zstd_padded(layer, size)
            } else if name.ends_with(".tar") && layer.len() <= size {
                let mut d = layer.clone();
                d.resize(size, 0);
                Some(d)
            } else {
                None
            };
            match data {
                Some(d) => match std::fs::write(f, d) {
                    Ok(()) => swapped.push(name),
                    Err(e) => failed = Some(format!("writing {}: {e}", f.display())),
                },
                None => failed = Some(format!("{name} ({size} bytes) cannot hold the layer")),
            }
        }
        if swapped.is_empty() || failed.is_some() {
            s.report.add(
                attempt,
                false,
                format!(
                    "inconclusive: could not swap the layer of {id} ({}; files {files:?})",
                    failed.unwrap_or_else(|| "no layer file found".into())
                ),
            );
            continue;
        }
        judge_forged_start(s, kept_dir, &attempt, id, probe_of(name));
        let _ = api(node, "DELETE", &format!("/templates/{id}"), "");
    }
    let _ = api(node, "DELETE", &format!("/templates/{}", genuine[0]), "");
}
