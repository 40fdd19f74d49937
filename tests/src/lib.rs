//! Helpers of the cross-process tests: the real `agentenv-scheduler`, `agentenv-gateway`
//! and `agentenv-node` binaries started on loopback with static configuration, and the
//! official E2B SDKs: Python in a virtual environment, JS installed with `npm ci`.

pub mod control_plane;

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// The API key every process of a test cluster shares.
pub const API_KEY: &str = "cluster-test-key-0123456789abcdef012345";
/// The token seed every node of a test cluster shares.
pub const SEED: &str = "cluster-test-seed";

/// The access token of sandbox `id` in a test cluster (derived from [`SEED`]).
pub fn envd_token(id: &str) -> String {
    agentenv_node::access::TokenIssuer::new(SEED).envd_token(id)
}
/// Templates shared by every test run on this machine (built once, under a lock).
pub const TEMPLATE_CACHE: &str = "/var/cache/agentenv-test/templates";

pub use agentenv_testkit::bins::static_binary;
pub use agentenv_testkit::{free_port, target_dir};

/// A binary of `agentenv-bin`, built if it is missing.
pub fn binary(name: &str) -> Result<PathBuf, String> {
    // The test executable lives in target/<profile>/deps/.
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .map(Path::to_path_buf)
        .unwrap_or_else(|| target_dir().join("debug"));
    let path = profile_dir.join(name);
    if path.is_file() {
        return Ok(path);
    }
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let release = profile_dir.file_name().is_some_and(|n| n == "release");
    let mut cmd = Command::new(cargo);
    cmd.args(["build", "-p", "agentenv-bin", "--bin", name]);
    if release {
        cmd.arg("--release");
    }
    let st = cmd
        .status()
        .map_err(|e| format!("running cargo build: {e}"))?;
    if st.success() && path.is_file() {
        Ok(path)
    } else {
        Err(format!(
            "{} is missing: build it with `cargo build -p agentenv-bin --bins`",
            path.display()
        ))
    }
}

/// The static guest agent: `AGENTENV_GUEST_BIN`, else the static build, else built with
/// `agentenv-guest/build-static.sh`.
pub fn guest_binary() -> Result<PathBuf, String> {
    agentenv_testkit::bins::static_guest_binary()
}

/// Why the cluster tests cannot run here, if they cannot.
pub fn skip_reason() -> Option<String> {
    if !nix::unistd::Uid::effective().is_root() {
        return Some("the jail backend needs root (namespaces, cgroups, veth, iptables)".into());
    }
    None
}

/// A child process that is stopped (SIGTERM, then SIGKILL after 20 s) when dropped.
pub struct Proc {
    pub name: String,
    child: Option<Child>,
    pub lines: mpsc::Receiver<serde_json::Value>,
    /// Host firewall chains (interface prefix, runtime directory) removed once it stopped.
    host_rules: Option<(String, PathBuf)>,
}

impl Proc {
    /// Starts `cmd` with stdout piped; stdout JSON lines are echoed to stderr and sent to
    /// [`Proc::lines`].
    pub fn spawn(name: &str, mut cmd: Command) -> Proc {
        cmd.stdout(Stdio::piped()).stderr(Stdio::inherit());
        let mut child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("starting {name}: {e}"));
        let stdout = child.stdout.take().expect("stdout");
        let (tx, rx) = mpsc::channel();
        let tag = name.to_string();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                eprintln!("[{tag}] {line}");
                if let Ok(v) = serde_json::from_str::<serde_json::Value>(&line) {
                    let _ = tx.send(v);
                }
            }
        });
        Proc {
            name: name.into(),
            child: Some(child),
            lines: rx,
            host_rules: None,
        }
    }

    /// Once the process (a node on this host's network) has stopped, removes the host
    /// firewall chains of its interface prefix, unless its sandboxes outlive it.
    pub fn with_host_rules(mut self, iface_prefix: &str, runtime_dir: &Path) -> Proc {
        self.host_rules = Some((iface_prefix.to_string(), runtime_dir.to_path_buf()));
        self
    }

    /// Waits for a log line whose `message` starts with one of `prefixes`.
    pub fn wait_for_prefix(&self, prefixes: &[&str], limit: Duration) -> serde_json::Value {
        let deadline = Instant::now() + limit;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(v)
                    if v["message"]
                        .as_str()
                        .is_some_and(|m| prefixes.iter().any(|p| m.starts_with(p))) =>
                {
                    return v;
                }
                Ok(_) => {}
                Err(_) => panic!(
                    "{} did not log a message starting with {prefixes:?} within {limit:?}",
                    self.name
                ),
            }
        }
    }

    /// Waits for a log line whose `message` is `msg`.
    pub fn wait_for(&self, msg: &str, limit: Duration) -> serde_json::Value {
        let deadline = Instant::now() + limit;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(v) if v["message"] == msg => return v,
                Ok(_) => {}
                Err(_) => panic!("{} did not log {msg:?} within {limit:?}", self.name),
            }
        }
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().map(|c| c.id()).unwrap_or(0)
    }

    /// SIGTERM and wait; returns the exit status. Then the host firewall chains of
    /// [`Proc::with_host_rules`] go.
    pub fn stop(&mut self) -> Option<std::process::ExitStatus> {
        let status = self.stop_child();
        if status.is_some()
            && let Some((prefix, dir)) = &self.host_rules
        {
            remove_host_rules(prefix, dir);
        }
        status
    }

    fn stop_child(&mut self) -> Option<std::process::ExitStatus> {
        let mut child = self.child.take()?;
        let pid = nix::unistd::Pid::from_raw(child.id() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            match child.try_wait() {
                Ok(Some(st)) => return Some(st),
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20))
                }
                _ => {
                    let _ = child.kill();
                    return child.wait().ok();
                }
            }
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Where test nodes keep their runtime state (`AENV_RUNTIME_PATH`), the lock of the host
/// firewall rules among it.
pub const NODE_RUNTIME_DIR: &str = "/run/aenv";

/// The host interface prefix of test node `idx` (0..=51): `c` and a letter for 0..=25,
/// `k` and a letter for 26..=51 (never a prefix of another index's).
pub fn node_iface_prefix(idx: u8) -> String {
    assert!(idx < 52, "test node index {idx} is not in 0..=51");
    match idx {
        0..=25 => format!("c{}", (b'a' + idx) as char),
        _ => format!("k{}", (b'a' + idx - 26) as char),
    }
}

/// Removes the host firewall chains of `iface_prefix` (see
/// `agentenv_node::host::net::uninstall_host_rules`), waiting a few seconds for
/// the veths of closed sandbox namespaces to go; a refusal (sandboxes still there) or a
/// failure is reported on stderr, and the chains then stay.
pub fn remove_host_rules(iface_prefix: &str, runtime_dir: &Path) {
    agentenv_testkit::host_rules::remove_blocking(iface_prefix, runtime_dir);
}

/// One node of a test cluster.
pub struct NodeProc {
    pub id: String,
    pub addr: SocketAddr,
    pub home: tempfile::TempDir,
    pub proc: Proc,
}

/// Environment of a test node with index `idx` (0..=51): its own data directory, address
/// pool, interface prefix and cgroup parent (and `AENV_NET_NAT` when the test process
/// has it).
pub fn node_env(
    idx: u8,
    id: &str,
    addr: SocketAddr,
    home: &Path,
    scheduler: Option<&str>,
) -> Vec<(String, String)> {
    let mut v = vec![
        ("API_ADDR", addr.to_string()),
        ("AENV_NODE_ID", id.to_string()),
        ("AENV_API_KEY", API_KEY.to_string()),
        ("AENV_SANDBOX_ACCESS_TOKEN_HASH_SEED", SEED.to_string()),
        ("AENV_HOME_PATH", home.display().to_string()),
        ("AENV_BACKEND", "jail".to_string()),
        (
            "AENV_GUEST_BINARY_PATH",
            guest_binary().expect("guest binary").display().to_string(),
        ),
        ("AENV_TEMPLATE_PATH", TEMPLATE_CACHE.to_string()),
        ("AENV_RUNTIME_PATH", NODE_RUNTIME_DIR.to_string()),
        ("AENV_JAIL_ADDRESS_POOL", format!("10.15.{}.0/24", idx)),
        ("AENV_JAIL_IFACE_PREFIX", node_iface_prefix(idx)),
        ("AENV_JAIL_CGROUP_PARENT", format!("agentenv-cluster-{idx}")),
        ("AENV_LOG_FORMAT", "json".to_string()),
        ("AENV_AUTO_EVICT_INTERVAL_MS", "100".to_string()),
    ];
    if let Some(s) = scheduler {
        v.push(("AENV_OBSERVABILITY_SCHEDULER_REPORT_ENABLED", "true".into()));
        v.push((
            "AENV_OBSERVABILITY_SCHEDULER_ENDPOINT",
            format!("http://{s}"),
        ));
        v.push(("AENV_OBSERVABILITY_REPORT_INTERVAL_SECS", "1".into()));
    }
    // A benchmark or soak run compares the NAT modes by setting this for the nodes.
    if let Ok(nat) = std::env::var("AENV_NET_NAT") {
        v.push(("AENV_NET_NAT", nat));
    }
    v.into_iter().map(|(k, v)| (k.to_string(), v)).collect()
}

/// Starts an `agentenv-node` process and waits until it listens.
pub fn start_node(
    idx: u8,
    id: &str,
    addr: SocketAddr,
    home: tempfile::TempDir,
    scheduler: Option<&str>,
) -> NodeProc {
    start_node_with_env(idx, id, addr, home, scheduler, &[])
}

/// [`start_node`] with more environment variables (`extra` wins over [`node_env`]).
pub fn start_node_with_env(
    idx: u8,
    id: &str,
    addr: SocketAddr,
    home: tempfile::TempDir,
    scheduler: Option<&str>,
    extra: &[(String, String)],
) -> NodeProc {
    let mut cmd = Command::new(binary("agentenv-node").expect("agentenv-node binary"));
    cmd.env_clear();
    cmd.env("PATH", std::env::var("PATH").unwrap_or_default());
    for (k, v) in node_env(idx, id, addr, home.path(), scheduler) {
        cmd.env(k, v);
    }
    for (k, v) in extra {
        cmd.env(k, v);
    }
    let proc =
        Proc::spawn(id, cmd).with_host_rules(&node_iface_prefix(idx), Path::new(NODE_RUNTIME_DIR));
    proc.wait_for("node listening", Duration::from_secs(900));
    NodeProc {
        id: id.into(),
        addr,
        home,
        proc,
    }
}

/// Scheduler, gateway and `n` nodes on loopback.
pub struct Cluster {
    pub gateway: SocketAddr,
    pub scheduler: String,
    /// The scheduler's Prometheus address.
    pub scheduler_metrics: SocketAddr,
    pub nodes: Vec<NodeProc>,
    pub gateway_proc: Proc,
    pub scheduler_proc: Proc,
    /// The snapshot store every node of the cluster shares (`AENV_SNAPSHOT_STORE`).
    pub snapshot_store: PathBuf,
    /// The scheduler's config file (see [`Cluster::reload_scheduler`]).
    pub scheduler_config: PathBuf,
    /// The config the scheduler started with.
    pub scheduler_config_json: serde_json::Value,
    /// Every node as it would be listed in `scheduler.nodes` (listed or not).
    pub node_entries: Vec<serde_json::Value>,
    _dir: tempfile::TempDir,
}

impl Cluster {
    /// Starts the scheduler (static node list), `n` nodes reporting to it, then the gateway.
    pub fn start(n: u8, first_idx: u8) -> Cluster {
        Self::start_with(n, first_idx, &|_| Vec::new())
    }

    /// [`Cluster::start`] with more environment for node `i` (0-based) from `extra`.
    pub fn start_with(
        n: u8,
        first_idx: u8,
        extra: &dyn Fn(u8) -> Vec<(String, String)>,
    ) -> Cluster {
        Self::start_listing(n, n, first_idx, extra)
    }

    /// [`Cluster::start_with`] where the scheduler's node list holds only the first
    /// `listed` of the `n` nodes; the others run and are refused until a reload lists
    /// them (see [`Cluster::reload_scheduler`]).
    pub fn start_listing(
        n: u8,
        listed: u8,
        first_idx: u8,
        extra: &dyn Fn(u8) -> Vec<(String, String)>,
    ) -> Cluster {
        let dir = tempfile::tempdir().expect("temp dir");
        let nodes: Vec<(String, SocketAddr)> = (0..n)
            .map(|i| {
                (
                    format!("node-{}", i + first_idx),
                    SocketAddr::from(([127, 0, 0, 1], free_port())),
                )
            })
            .collect();
        let mut config = control_plane::config(&nodes);
        let node_entries = config["scheduler"]["nodes"]
            .as_array()
            .expect("node list")
            .clone();
        config["scheduler"]["nodes"] =
            serde_json::json!(node_entries[..usize::from(listed.min(n))]);
        let sched_cfg = dir.path().join("scheduler.json");
        std::fs::write(&sched_cfg, config.to_string()).expect("write config");
        let mut cmd = Command::new(binary("agentenv-scheduler").expect("scheduler binary"));
        cmd.arg("-config").arg(&sched_cfg).env("LOG_FORMAT", "json");
        let scheduler_proc = Proc::spawn("scheduler", cmd);
        let v = scheduler_proc.wait_for("scheduler listening", Duration::from_secs(30));
        let scheduler = v["grpc_addr"].as_str().expect("grpc_addr").to_string();
        let scheduler_metrics: SocketAddr = v["metrics_addr"]
            .as_str()
            .expect("metrics_addr")
            .parse()
            .expect("metrics address");

        // One snapshot store for every node, as a shared mount would be.
        let snapshot_store = dir.path().join("snapshot-store");
        let shared = [(
            "AENV_SNAPSHOT_STORE".to_string(),
            snapshot_store.display().to_string(),
        )];
        let node_procs: Vec<NodeProc> = nodes
            .iter()
            .enumerate()
            .map(|(i, (id, addr))| {
                let mut env = shared.to_vec();
                env.extend(extra(i as u8));
                start_node_with_env(
                    first_idx + i as u8,
                    id,
                    *addr,
                    tempfile::tempdir().expect("node home"),
                    Some(&scheduler),
                    &env,
                )
            })
            .collect();

        wait_observed(
            &scheduler,
            &nodes
                .iter()
                .take(usize::from(listed))
                .map(|(id, _)| id.clone())
                .collect::<Vec<_>>(),
        );

        let mut gw_cfg = config.clone();
        gw_cfg["gateway"]["scheduler_addr"] = serde_json::json!(scheduler);
        let gw_path = dir.path().join("gateway.json");
        std::fs::write(&gw_path, gw_cfg.to_string()).expect("write config");
        let mut cmd = Command::new(binary("agentenv-gateway").expect("gateway binary"));
        cmd.arg("-config")
            .arg(&gw_path)
            .env("LOG_FORMAT", "json")
            .env("AENV_API_KEY", API_KEY);
        let gateway_proc = Proc::spawn("gateway", cmd);
        let v = gateway_proc.wait_for("gateway listening", Duration::from_secs(30));
        let gateway: SocketAddr = v["http_addr"]
            .as_str()
            .expect("http_addr")
            .parse()
            .expect("gateway address");
        Cluster {
            gateway,
            scheduler,
            scheduler_metrics,
            nodes: node_procs,
            gateway_proc,
            scheduler_proc,
            snapshot_store,
            scheduler_config: sched_cfg,
            scheduler_config_json: config,
            node_entries,
            _dir: dir,
        }
    }

    /// Rewrites the scheduler's config file to `text`, sends the scheduler SIGHUP and
    /// waits for its verdict: the log line of the applied node list or of the failed
    /// reload (returned).
    pub fn reload_scheduler_raw(&self, text: &str) -> serde_json::Value {
        std::fs::write(&self.scheduler_config, text).expect("write config");
        let pid = nix::unistd::Pid::from_raw(self.scheduler_proc.pid() as i32);
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGHUP).expect("SIGHUP");
        self.scheduler_proc.wait_for_prefix(
            &["node list reloaded", "config reload failed"],
            Duration::from_secs(30),
        )
    }

    /// [`Cluster::reload_scheduler_raw`] with the config the scheduler started with as
    /// `edit` leaves it.
    pub fn reload_scheduler(&self, edit: impl FnOnce(&mut serde_json::Value)) -> serde_json::Value {
        let mut config = self.scheduler_config_json.clone();
        edit(&mut config);
        self.reload_scheduler_raw(&config.to_string())
    }

    /// Creates a sandbox through the gateway with `body` (a create's JSON); its id.
    pub fn create(&self, body: &str) -> String {
        let (st, v) = api(self.gateway, "POST", "/v2/sandboxes", body);
        assert_eq!(st, 201, "create {body}: {v}");
        v["sandboxID"].as_str().expect("sandboxID").to_string()
    }

    /// A client of sandbox `id`'s agent through the gateway (with its access token).
    pub fn guest(&self, id: &str) -> agentenv_guest::client::GuestClient {
        agentenv_guest::client::GuestClient::new(&format!("http://{}", self.gateway))
            .unwrap()
            .with_header("e2b-sandbox-id", id)
            .unwrap()
            .with_header("e2b-sandbox-port", "49983")
            .unwrap()
            .with_access_token(&envd_token(id))
    }

    /// What `script` prints on stdout in sandbox `id`, through the gateway (trimmed).
    pub fn sh(&self, rt: &tokio::runtime::Runtime, id: &str, script: &str) -> String {
        let out = rt
            .block_on(self.guest(id).run("/bin/sh", &["-c", script]))
            .unwrap_or_else(|e| panic!("running {script:?} in {id}: {e}"));
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }

    /// The index of the one node that has sandbox `id` (each node asked directly).
    pub fn owner(&self, id: &str) -> usize {
        let owners: Vec<usize> = self
            .nodes
            .iter()
            .enumerate()
            .filter(|(_, n)| api(n.addr, "GET", &format!("/sandboxes/{id}"), "").0 == 200)
            .map(|(i, _)| i)
            .collect();
        assert_eq!(owners.len(), 1, "sandbox {id} on nodes {owners:?}");
        owners[0]
    }

    /// Waits until the gateway's `GET /nodes` lists `n` nodes.
    pub fn wait_nodes_listed(&self, n: usize) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while api(self.gateway, "GET", "/nodes", "")
            .1
            .as_array()
            .map(|a| a.len())
            != Some(n)
        {
            assert!(Instant::now() < deadline, "{n} nodes listed by the gateway");
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// Waits until the scheduler has a heartbeat from every node in `ids`.
pub fn wait_observed(scheduler: &str, ids: &[String]) {
    use agentenv_core::proto::scheduler_v1::ListObservedNodesRequest;
    use agentenv_core::proto::scheduler_v1::scheduler_client::SchedulerClient;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let client = SchedulerClient::connect(format!("http://{scheduler}"))
            .await
            .expect("scheduler client");
        agentenv_testkit::Wait::new(
            format_args!("the scheduler to see heartbeats from all of {ids:?}"),
            Duration::from_secs(30),
        )
        .every(Duration::from_millis(50))
        .until(|| {
            let mut client = client.clone();
            async move {
                let seen: Vec<String> = client
                    .list_observed_nodes(ListObservedNodesRequest::default())
                    .await
                    .map(|r| {
                        r.into_inner()
                            .nodes
                            .into_iter()
                            .map(|n| n.node_id)
                            .collect()
                    })
                    .unwrap_or_default();
                if ids.iter().all(|id| seen.contains(id)) {
                    Ok(())
                } else {
                    Err(format!("heartbeats from {seen:?}"))
                }
            }
        })
        .await;
    });
}

/// How long [`http`] waits for an answer.
pub const HTTP_TIMEOUT: Duration = Duration::from_secs(120);

/// A blocking HTTP/1.1 request (no keep-alive, see `agentenv_bin::http_client`); returns
/// status, lower-cased headers and body. Panics when there is no answer.
pub fn http(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> (u16, Vec<(String, String)>, String) {
    let r = agentenv_bin::http_client::blocking_request(
        addr,
        method,
        path,
        headers,
        body.as_bytes(),
        HTTP_TIMEOUT,
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let text = r.text();
    (r.status, r.headers, text)
}

/// A control-plane call with the cluster's API key; the body parsed as JSON (null if empty).
pub fn api(addr: SocketAddr, method: &str, path: &str, body: &str) -> (u16, serde_json::Value) {
    let (st, _, b) = http(
        addr,
        method,
        path,
        &[("x-api-key", API_KEY), ("content-type", "application/json")],
        body,
    );
    (
        st,
        serde_json::from_str(&b).unwrap_or(serde_json::Value::Null),
    )
}

/// The Python of a virtual environment with the official E2B SDK (`target/e2b-venv`,
/// created once).
pub fn e2b_python() -> Result<PathBuf, String> {
    let venv = target_dir().join("e2b-venv");
    let py = venv.join("bin/python");
    let has_sdk = |py: &Path| {
        Command::new(py)
            .args(["-c", "import e2b"])
            .stderr(Stdio::null())
            .status()
            .map(|s| s.success())
            .unwrap_or(false)
    };
    if py.exists() && has_sdk(&py) {
        return Ok(py);
    }
    let lock = target_dir().join("e2b-venv.lock");
    let f = std::fs::File::create(&lock).map_err(|e| e.to_string())?;
    let _guard = nix::fcntl::Flock::lock(f, nix::fcntl::FlockArg::LockExclusive)
        .map_err(|(_, e)| format!("locking {}: {e}", lock.display()))?;
    if py.exists() && has_sdk(&py) {
        return Ok(py);
    }
    let st = Command::new("python3")
        .args(["-m", "venv"])
        .arg(&venv)
        .status()
        .map_err(|e| format!("python3 not runnable: {e}"))?;
    if !st.success() {
        return Err("`python3 -m venv` failed (install python3-venv)".into());
    }
    let st = Command::new(venv.join("bin/pip"))
        .args(["install", "-q", "e2b"])
        .status()
        .map_err(|e| format!("pip not runnable: {e}"))?;
    if !st.success() || !has_sdk(&py) {
        return Err("`pip install e2b` failed (is PyPI reachable?)".into());
    }
    Ok(py)
}

/// Runs an SDK script, `program script args…`, against the gateway at `gateway`
/// (`E2B_API_URL`, `E2B_SANDBOX_URL` and `E2B_VOLUME_API_URL` set to it, `E2B_API_KEY`),
/// with `env` added, and returns the JSON object it prints; panics with its output when
/// it fails or prints something else.
pub fn run_sdk_script(
    program: &Path,
    script: &str,
    args: &[&str],
    gateway: SocketAddr,
    env: &[(&str, &str)],
) -> serde_json::Value {
    let gw = format!("http://{gateway}");
    let mut cmd = Command::new(program);
    cmd.arg(script)
        .args(args)
        .env("E2B_API_URL", &gw)
        .env("E2B_SANDBOX_URL", &gw)
        .env("E2B_VOLUME_API_URL", &gw)
        .env("E2B_API_KEY", API_KEY);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("running {script}: {e}"));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{script} failed:\n{stderr}\n{stdout}");
    serde_json::from_str(stdout.trim())
        .unwrap_or_else(|e| panic!("{script} printed no JSON ({e}):\n{stdout}\n{stderr}"))
}

/// A local template directory `dir` holding `base` (hard links into [`TEMPLATE_CACHE`],
/// built there first if needed), so a node given it (`AENV_TEMPLATE_PATH`) sees no
/// template but `base` at start. Returns `dir` as a string.
pub fn node_templates(dir: &Path) -> String {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(agentenv_testkit::node::ensure_base());
    agentenv_testkit::node::templates_with_base(dir)
        .display()
        .to_string()
}

/// How many creates on the node at `addr` fetched a template (its stage metric).
pub fn template_fetches(addr: SocketAddr) -> u64 {
    let out = Command::new("curl")
        .args(["-s", &format!("http://{addr}/metrics")])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .filter(|l| {
            l.starts_with("agentenv_sandbox_stage_duration_seconds_count")
                && l.contains("stage=\"template_fetch\"")
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

/// Where the JS SDK's `package.json`, `package-lock.json` and `.npmrc` are kept.
const E2B_JS_FIXTURE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/js");

/// A directory whose `node_modules` holds the official E2B JS SDK at the version locked in
/// `tests/fixtures/js/package-lock.json` (`target/e2b-js`, installed once with `npm ci`
/// under a file lock, again when the lockfile changes). A script finds the SDK with
/// `createRequire(<dir>/package.json)`.
pub fn e2b_js() -> Result<PathBuf, String> {
    let dir = target_dir().join("e2b-js");
    let fixture = Path::new(E2B_JS_FIXTURE);
    let lockfile = std::fs::read(fixture.join("package-lock.json"))
        .map_err(|e| format!("reading the JS lockfile: {e}"))?;
    // The lockfile a finished install was made from.
    let stamp = dir.join("installed-package-lock.json");
    let installed = || {
        dir.join("node_modules/e2b/package.json").exists()
            && std::fs::read(&stamp).is_ok_and(|s| s == lockfile)
    };
    if installed() {
        return Ok(dir);
    }
    let lock = target_dir().join("e2b-js.lock");
    let f = std::fs::File::create(&lock).map_err(|e| e.to_string())?;
    let _guard = nix::fcntl::Flock::lock(f, nix::fcntl::FlockArg::LockExclusive)
        .map_err(|(_, e)| format!("locking {}: {e}", lock.display()))?;
    if installed() {
        return Ok(dir);
    }
    let _ = std::fs::remove_file(&stamp);
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    for f in ["package.json", "package-lock.json", ".npmrc"] {
        std::fs::copy(fixture.join(f), dir.join(f))
            .map_err(|e| format!("copying {f} to {}: {e}", dir.display()))?;
    }
    let st = Command::new("npm")
        .args(["ci", "--no-audit", "--no-fund", "--loglevel=error"])
        .current_dir(&dir)
        .status()
        .map_err(|e| format!("npm not runnable (install Node.js 20 and npm): {e}"))?;
    if !st.success() || !dir.join("node_modules/e2b/package.json").exists() {
        return Err("`npm ci` of the E2B JS SDK failed (is the npm registry reachable?)".into());
    }
    std::fs::write(&stamp, &lockfile).map_err(|e| e.to_string())?;
    Ok(dir)
}
