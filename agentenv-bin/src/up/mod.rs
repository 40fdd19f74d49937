//! `agentenv up`: a whole cluster on this machine — one scheduler, one gateway and N
//! runtime nodes, each a child process of the real binaries on loopback ports — with a
//! first sandbox run through the gateway before the cluster is announced, and a clean
//! stop (every sandbox deleted, every process stopped, the nodes' host firewall chains
//! removed) on Ctrl-C.

pub mod http;

use std::io::Write as _;
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use agentenv_node::host::net::uninstall_host_rules;
use base64::Engine as _;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::sync::mpsc;

use self::http::{HttpError, envelope, request, split_envelopes};

/// The guest agent's port, as the E2B SDK addresses it.
pub const ENVD_PORT: &str = "49983";

/// Why `agentenv up` could not start or stop the cluster. Each message says what to do.
#[derive(Debug, thiserror::Error)]
pub enum UpError {
    #[error(
        "agentenv up runs sandboxes in jails (namespaces, cgroups, veth, iptables) and needs root: run it with sudo"
    )]
    NotRoot,
    #[error("--nodes must be between 1 and 16 (got {0})")]
    NodeCount(u8),
    #[error(
        "{} not found: build the binaries with `cargo build --release -p agentenv-bin --bins` (or run scripts/up.sh), or point --bin-dir at them",
        path.display()
    )]
    MissingBinary { path: PathBuf },
    #[error(
        "the static guest agent was not found (looked at {looked}): build it with agentenv-guest/build-static.sh and pass its path with --guest-binary"
    )]
    MissingGuest { looked: String },
    #[error("the API key is invalid: {0}")]
    ApiKey(#[from] agentenv_core::api_key::ApiKeyError),
    #[error("cannot listen on {addr}: {source}; choose another address with --listen")]
    Listen {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("{what} {}: {source}", path.display())]
    Fs {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("starting {name}: {source}")]
    Spawn {
        name: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{name} exited before it was ready ({status}); its last lines:\n{tail}")]
    EarlyExit {
        name: String,
        status: String,
        tail: String,
    },
    #[error("{name} did not log {message:?} within {limit:?}; its log is {}", log.display())]
    NotReady {
        name: String,
        message: &'static str,
        limit: Duration,
        log: PathBuf,
    },
    #[error(
        "the gateway did not list {want} ready nodes within {limit:?} (last answer: {last}); check the node logs in {}",
        logs.display()
    )]
    NodesNotReady {
        want: usize,
        limit: Duration,
        last: String,
        logs: PathBuf,
    },
    #[error("--iface-prefix {0:?}: use 1 to 5 lowercase letters")]
    IfacePrefix(String),
    #[error("interrupted during start-up; everything started so far was stopped")]
    Interrupted,
    #[error("the first sandbox failed: {0}")]
    FirstSandbox(String),
    #[error(transparent)]
    Http(#[from] HttpError),
    #[error("{name} exited unexpectedly ({status}); its log is {}", log.display())]
    ChildDied {
        name: String,
        status: String,
        log: PathBuf,
    },
}

/// What `agentenv up` starts.
#[derive(Debug, Clone)]
pub struct UpOptions {
    /// Number of runtime nodes.
    pub nodes: u8,
    /// The gateway's HTTP address (port 0 picks a free one).
    pub listen: SocketAddr,
    /// Where the `agentenv-scheduler`, `agentenv-gateway` and `agentenv-node` binaries are.
    pub bin_dir: PathBuf,
    /// The static guest agent; `None` looks beside the binaries.
    pub guest_binary: Option<PathBuf>,
    /// State directory (node data, shared storage, logs); `None` makes a temporary one,
    /// removed on exit.
    pub data_dir: Option<PathBuf>,
    /// Template cache shared by the nodes (the `base` template is built here once).
    pub template_dir: PathBuf,
    /// The API key; `None` generates one.
    pub api_key: Option<String>,
    /// Run a first sandbox through the gateway before announcing the cluster.
    pub check: bool,
    /// First two octets of the sandbox address pools: node `i` gets `<prefix>.<i>.0/24`.
    pub pool_prefix: String,
    /// Host interface prefix (1–5 lowercase letters); node `i` uses `<prefix><a+i>`.
    pub iface_prefix: String,
    /// Echo every log line of the children, not only warnings, errors and progress.
    pub verbose: bool,
}

impl UpOptions {
    /// Defaults: two nodes, gateway on 127.0.0.1:8080, binaries beside the current
    /// executable.
    pub fn new(bin_dir: PathBuf) -> Self {
        Self {
            nodes: 2,
            listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            bin_dir,
            guest_binary: None,
            data_dir: None,
            template_dir: PathBuf::from("/var/cache/agentenv/templates"),
            api_key: None,
            check: true,
            pool_prefix: "10.13".into(),
            iface_prefix: "up".into(),
            verbose: false,
        }
    }
}

/// What the running cluster offers its user.
#[derive(Debug, Clone)]
pub struct ClusterInfo {
    pub gateway: SocketAddr,
    pub scheduler: SocketAddr,
    pub api_key: String,
    pub nodes: Vec<(String, SocketAddr)>,
    pub data_dir: PathBuf,
}

/// Where the user sees progress; stdout in the binary, captured in tests.
pub type Out = Arc<dyn Fn(&str) + Send + Sync>;

/// An out that prints to stdout.
pub fn stdout_out() -> Out {
    Arc::new(|line| {
        let mut o = std::io::stdout().lock();
        let _ = writeln!(o, "{line}");
        let _ = o.flush();
    })
}

struct Line {
    child: usize,
    json: Option<serde_json::Value>,
}

struct ChildProc {
    name: String,
    child: Child,
    log: PathBuf,
    tail: Arc<parking_lot::Mutex<std::collections::VecDeque<String>>>,
}

impl ChildProc {
    fn tail(&self) -> String {
        self.tail
            .lock()
            .iter()
            .cloned()
            .collect::<Vec<_>>()
            .join("\n")
    }

    fn pid(&self) -> Option<i32> {
        self.child.id().map(|p| p as i32)
    }
}

fn fs_err<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> UpError + 'a {
    move |source| UpError::Fs {
        what,
        path: path.to_path_buf(),
        source,
    }
}

/// A fresh API key: 32 random bytes in hex.
pub fn generate_api_key() -> Result<String, UpError> {
    let mut buf = [0u8; 32];
    let path = Path::new("/dev/urandom");
    let mut f = std::fs::File::open(path).map_err(fs_err("reading", path))?;
    std::io::Read::read_exact(&mut f, &mut buf).map_err(fs_err("reading", path))?;
    Ok(buf.iter().map(|b| format!("{b:02x}")).collect())
}

fn free_loopback_addr() -> Result<SocketAddr, UpError> {
    let any = SocketAddr::from(([127, 0, 0, 1], 0));
    TcpListener::bind(any)
        .and_then(|l| l.local_addr())
        .map_err(|source| UpError::Listen { addr: any, source })
}

/// The static guest agent: the given path, else `AENV_GUEST_BINARY_PATH`, else the
/// static build next to the binaries' target directory, else `agentenv-guest` beside them.
pub fn find_guest(opts: &UpOptions) -> Result<PathBuf, UpError> {
    let mut looked = Vec::new();
    let mut candidates = Vec::new();
    if let Some(p) = &opts.guest_binary {
        candidates.push(p.clone());
    } else {
        if let Some(p) = std::env::var_os("AENV_GUEST_BINARY_PATH") {
            candidates.push(PathBuf::from(p));
        }
        if let Some(target) = opts.bin_dir.parent() {
            for t in ["x86_64-unknown-linux-gnu", "x86_64-unknown-linux-musl"] {
                candidates.push(target.join(t).join("release/agentenv-guest"));
            }
        }
        candidates.push(opts.bin_dir.join("agentenv-guest"));
    }
    for c in candidates {
        if c.is_file() {
            return Ok(c);
        }
        looked.push(c.display().to_string());
    }
    Err(UpError::MissingGuest {
        looked: looked.join(", "),
    })
}

/// The running cluster.
pub struct Up {
    opts: UpOptions,
    out: Out,
    info: ClusterInfo,
    children: Vec<ChildProc>,
    lines: mpsc::UnboundedReceiver<Line>,
    tx: mpsc::UnboundedSender<Line>,
    _temp: Option<tempfile::TempDir>,
}

impl Up {
    /// Starts scheduler, nodes and gateway, waits until the gateway lists every node as
    /// ready and (with `check`) a first sandbox ran a command. On error, whatever was
    /// started is stopped again.
    pub async fn start(
        opts: UpOptions,
        out: Out,
        interrupt: impl std::future::Future<Output = ()>,
    ) -> Result<Up, UpError> {
        // SAFETY: geteuid has no preconditions and cannot fail.
        if unsafe { libc::geteuid() } != 0 {
            return Err(UpError::NotRoot);
        }
        if !(1..=16).contains(&opts.nodes) {
            return Err(UpError::NodeCount(opts.nodes));
        }
        let p = &opts.iface_prefix;
        if p.is_empty() || p.len() > 5 || !p.bytes().all(|b| b.is_ascii_lowercase()) {
            return Err(UpError::IfacePrefix(p.clone()));
        }
        for b in ["agentenv-scheduler", "agentenv-gateway", "agentenv-node"] {
            let path = opts.bin_dir.join(b);
            if !path.is_file() {
                return Err(UpError::MissingBinary { path });
            }
        }
        let guest = find_guest(&opts)?;
        let api_key = match &opts.api_key {
            Some(k) => k.clone(),
            None => generate_api_key()?,
        };
        agentenv_core::api_key::validate(&api_key, "--api-key")?;
        // The gateway's port is checked first: it is the one a user chose.
        let gw_listen = {
            let l = TcpListener::bind(opts.listen).map_err(|source| UpError::Listen {
                addr: opts.listen,
                source,
            })?;
            l.local_addr().map_err(|source| UpError::Listen {
                addr: opts.listen,
                source,
            })?
        };
        let (temp, data_dir) = match &opts.data_dir {
            Some(d) => {
                std::fs::create_dir_all(d).map_err(fs_err("creating", d))?;
                (None, d.clone())
            }
            None => {
                let t = tempfile::Builder::new()
                    .prefix("agentenv-up-")
                    .tempdir()
                    .map_err(fs_err(
                        "creating a temporary directory in",
                        &std::env::temp_dir(),
                    ))?;
                let p = t.path().to_path_buf();
                (Some(t), p)
            }
        };
        // `snapshot-store`: the storage every node shares (snapshots taken on one node
        // start on any other).
        for sub in ["logs", "run", "snapshot-store"] {
            let p = data_dir.join(sub);
            std::fs::create_dir_all(&p).map_err(fs_err("creating", &p))?;
        }
        std::fs::create_dir_all(&opts.template_dir)
            .map_err(fs_err("creating", &opts.template_dir))?;

        let nodes: Vec<(String, SocketAddr)> = (0..opts.nodes)
            .map(|i| {
                Ok((
                    format!("node-{}", (b'a' + i) as char),
                    free_loopback_addr()?,
                ))
            })
            .collect::<Result<_, UpError>>()?;
        let config = serde_json::json!({
            "log_level": "info",
            "log_format": "json",
            "scheduler": {
                "grpc_listen_addr": "127.0.0.1:0",
                "metrics_listen_addr": "127.0.0.1:0",
                "strategy": "round_robin",
                "report_ttl": "10s",
                "binding_ttl": "24h",
                "nodes": nodes.iter().map(|(id, a)| serde_json::json!({"id": id, "endpoint": format!("http://{a}")})).collect::<Vec<_>>(),
            },
            "gateway": {
                "http_listen_addr": gw_listen.to_string(),
                "metrics_listen_addr": "127.0.0.1:0",
                "scheduler_addr": "127.0.0.1:9090",
                "request_timeout": "600s",
            }
        });
        let cfg_path = data_dir.join("control-plane.json");
        std::fs::write(
            &cfg_path,
            serde_json::to_vec_pretty(&config).unwrap_or_default(),
        )
        .map_err(fs_err("writing", &cfg_path))?;

        let (tx, lines) = mpsc::unbounded_channel();
        let mut up = Up {
            info: ClusterInfo {
                gateway: gw_listen,
                scheduler: SocketAddr::from(([127, 0, 0, 1], 0)),
                api_key: api_key.clone(),
                nodes: nodes.clone(),
                data_dir: data_dir.clone(),
            },
            opts,
            out,
            children: Vec::new(),
            lines,
            tx,
            _temp: temp,
        };
        // Interrupted half-way, the sandboxes and processes started so far are removed
        // the same way as on a normal stop.
        let booted = tokio::select! {
            r = up.boot(&cfg_path, &guest) => r,
            () = interrupt => Err(UpError::Interrupted),
        };
        match booted {
            Ok(()) => Ok(up),
            Err(e) => {
                up.stop().await;
                Err(e)
            }
        }
    }

    async fn boot(&mut self, cfg_path: &Path, guest: &Path) -> Result<(), UpError> {
        let say = self.out.clone();
        let data = self.info.data_dir.clone();
        say(&format!("state and logs: {}", data.display()));

        let mut cmd = Command::new(self.opts.bin_dir.join("agentenv-scheduler"));
        cmd.arg("-config").arg(cfg_path);
        let s = self.spawn("scheduler", cmd)?;
        let v = self
            .wait_logged(s, "scheduler listening", Duration::from_secs(30))
            .await?;
        let grpc = v["grpc_addr"].as_str().unwrap_or_default().to_string();
        self.info.scheduler = grpc.parse().unwrap_or(self.info.scheduler);
        say(&format!("scheduler  grpc {grpc}"));

        for (i, (id, addr)) in self.info.nodes.clone().into_iter().enumerate() {
            let home = data.join(id.as_str());
            std::fs::create_dir_all(&home).map_err(fs_err("creating", &home))?;
            let mut cmd = Command::new(self.opts.bin_dir.join("agentenv-node"));
            cmd.env_clear();
            for k in ["PATH", "HOME", "TMPDIR"] {
                if let Some(v) = std::env::var_os(k) {
                    cmd.env(k, v);
                }
            }
            let pool = format!("{}.{}.0/24", self.opts.pool_prefix, i);
            let letter = (b'a' + i as u8) as char;
            cmd.env("API_ADDR", addr.to_string())
                .env("AENV_NODE_ID", &id)
                .env("AENV_API_KEY", &self.info.api_key)
                .env(
                    "AENV_SANDBOX_ACCESS_TOKEN_HASH_SEED",
                    format!("seed-{}", self.info.api_key),
                )
                .env("AENV_HOME_PATH", &home)
                .env("AENV_RUNTIME_PATH", data.join("run"))
                .env("AENV_BACKEND", "jail")
                .env("AENV_GUEST_BINARY_PATH", guest)
                .env("AENV_TEMPLATE_PATH", &self.opts.template_dir)
                .env("AENV_SNAPSHOT_STORE", data.join("snapshot-store"))
                .env("AENV_JAIL_ADDRESS_POOL", &pool)
                .env(
                    "AENV_JAIL_IFACE_PREFIX",
                    format!("{}{letter}", self.opts.iface_prefix),
                )
                .env("AENV_JAIL_CGROUP_PARENT", format!("agentenv-up-{letter}"))
                .env("AENV_OBSERVABILITY_SCHEDULER_REPORT_ENABLED", "true")
                .env(
                    "AENV_OBSERVABILITY_SCHEDULER_ENDPOINT",
                    format!("http://{grpc}"),
                )
                .env("AENV_OBSERVABILITY_REPORT_INTERVAL_SECS", "1")
                .env("AENV_LOG_FORMAT", "json");
            let n = self.spawn(&id, cmd)?;
            self.wait_logged(n, "node listening", Duration::from_secs(120))
                .await?;
            say(&format!(
                "{id}     api  {addr}  sandboxes in {pool}  data {}",
                home.display()
            ));
        }

        let mut cmd = Command::new(self.opts.bin_dir.join("agentenv-gateway"));
        cmd.arg("-config")
            .arg(cfg_path)
            .env("AENV_API_KEY", &self.info.api_key)
            .env("GATEWAY_SCHEDULER_ADDR", &grpc);
        let g = self.spawn("gateway", cmd)?;
        let v = self
            .wait_logged(g, "gateway listening", Duration::from_secs(30))
            .await?;
        if let Some(a) = v["http_addr"].as_str().and_then(|a| a.parse().ok()) {
            self.info.gateway = a;
        }
        say(&format!("gateway    http {}", self.info.gateway));

        self.wait_nodes_ready(Duration::from_secs(60)).await?;
        say(&format!("all {} nodes are ready", self.info.nodes.len()));
        if self.opts.check {
            self.first_sandbox().await?;
        }
        Ok(())
    }

    fn spawn(&mut self, name: &str, mut cmd: Command) -> Result<usize, UpError> {
        let idx = self.children.len();
        let log = self.info.data_dir.join("logs").join(format!("{name}.log"));
        let mut file = std::fs::File::create(&log).map_err(fs_err("creating", &log))?;
        cmd.env("LOG_FORMAT", "json")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            // Own process group: Ctrl-C reaches `agentenv up` alone, which deletes the
            // sandboxes before it stops the nodes.
            .process_group(0);
        // SAFETY: the closure runs in the forked child before exec and calls only
        // async-signal-safe functions (prctl, getppid).
        unsafe {
            cmd.pre_exec(|| {
                // Stop with the parent even when it is killed outright.
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if libc::getppid() == 1 {
                    return Err(std::io::Error::other("parent already exited"));
                }
                Ok(())
            });
        }
        let mut child = cmd.spawn().map_err(|source| UpError::Spawn {
            name: name.into(),
            source,
        })?;
        let tail = Arc::new(parking_lot::Mutex::new(std::collections::VecDeque::new()));
        let (ltx, mut lrx) = mpsc::unbounded_channel::<String>();
        if let Some(o) = child.stdout.take() {
            let ltx = ltx.clone();
            tokio::spawn(async move {
                let mut r = BufReader::new(o).lines();
                while let Ok(Some(l)) = r.next_line().await {
                    let _ = ltx.send(l);
                }
            });
        }
        if let Some(e) = child.stderr.take() {
            let ltx = ltx.clone();
            tokio::spawn(async move {
                let mut r = BufReader::new(e).lines();
                while let Ok(Some(l)) = r.next_line().await {
                    let _ = ltx.send(l);
                }
            });
        }
        drop(ltx);
        let tx = self.tx.clone();
        let out = self.out.clone();
        let verbose = self.opts.verbose;
        let tag = name.to_string();
        let tail2 = tail.clone();
        tokio::spawn(async move {
            let mut progress = Progress::default();
            while let Some(l) = lrx.recv().await {
                let _ = writeln!(file, "{l}");
                {
                    let mut t = tail2.lock();
                    if t.len() == 20 {
                        t.pop_front();
                    }
                    t.push_back(l.clone());
                }
                let json = serde_json::from_str::<serde_json::Value>(&l).ok();
                if let Some(show) = shown_line(json.as_ref(), &l, verbose)
                    && (verbose || !progress.repeats(&show))
                {
                    out(&format!("  [{tag}] {show}"));
                }
                let _ = tx.send(Line { child: idx, json });
            }
        });
        self.children.push(ChildProc {
            name: name.into(),
            child,
            log,
            tail,
        });
        Ok(idx)
    }

    async fn wait_logged(
        &mut self,
        idx: usize,
        message: &'static str,
        limit: Duration,
    ) -> Result<serde_json::Value, UpError> {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            tokio::select! {
                l = self.lines.recv() => {
                    if let Some(Line { child, json: Some(v) }) = l
                        && child == idx
                        && v["message"] == message
                    {
                        return Ok(v);
                    }
                }
                st = self.children[idx].child.wait() => {
                    // Let the reader tasks drain the last lines first.
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    let c = &self.children[idx];
                    return Err(UpError::EarlyExit {
                        name: c.name.clone(),
                        status: st.map(|s| s.to_string()).unwrap_or_else(|e| e.to_string()),
                        tail: c.tail(),
                    });
                }
                _ = tokio::time::sleep_until(deadline) => {
                    let c = &self.children[idx];
                    return Err(UpError::NotReady {
                        name: c.name.clone(),
                        message,
                        limit,
                        log: c.log.clone(),
                    });
                }
            }
        }
    }

    fn key_headers(&self) -> Vec<(&str, &str)> {
        vec![
            ("x-api-key", self.info.api_key.as_str()),
            ("content-type", "application/json"),
        ]
    }

    async fn wait_nodes_ready(&mut self, limit: Duration) -> Result<(), UpError> {
        let deadline = tokio::time::Instant::now() + limit;
        let want = self.info.nodes.len();
        let mut last;
        loop {
            match request(
                self.info.gateway,
                "GET",
                "/nodes",
                &self.key_headers(),
                b"",
                Duration::from_secs(5),
            )
            .await
            {
                Ok(r) => {
                    let v = r.json();
                    let ready = v
                        .as_array()
                        .map(|a| a.iter().filter(|n| n["status"] == "ready").count())
                        .unwrap_or(0);
                    if r.status == 200 && ready == want {
                        return Ok(());
                    }
                    last = format!("{} {}", r.status, r.text());
                }
                Err(e) => last = e.to_string(),
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(UpError::NodesNotReady {
                    want,
                    limit,
                    last,
                    logs: self.info.data_dir.join("logs"),
                });
            }
            self.drain_lines();
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    fn drain_lines(&mut self) {
        while self.lines.try_recv().is_ok() {}
    }

    /// Creates a sandbox from `base` through the gateway, runs a command in it and deletes
    /// it. The first run builds the `base` template (its progress is shown).
    async fn first_sandbox(&mut self) -> Result<(), UpError> {
        let say = self.out.clone();
        let base_built = self
            .opts
            .template_dir
            .join("base")
            .join("template.json")
            .is_file();
        if base_built {
            say("starting a first sandbox from template base");
        } else {
            say(&format!(
                "building template base in {} (debootstrap, about 2 minutes; cached for the next runs)",
                self.opts.template_dir.display()
            ));
        }
        let gw = self.info.gateway;
        // The log reader tasks keep showing build progress while the create runs.
        let r = request(
            gw,
            "POST",
            "/sandboxes",
            &self.key_headers(),
            br#"{"templateID":"base","timeout":120}"#,
            Duration::from_secs(900),
        )
        .await?;
        self.drain_lines();
        if r.status != 201 && r.status != 200 {
            return Err(UpError::FirstSandbox(format!(
                "POST /sandboxes answered {}: {}",
                r.status,
                r.text()
            )));
        }
        let v = r.json();
        let id = v["sandboxID"].as_str().unwrap_or_default().to_string();
        let token = v["envdAccessToken"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let result = run_command(gw, &id, &token, "echo hello from $(hostname)").await;
        let del = request(
            gw,
            "DELETE",
            &format!("/sandboxes/{id}"),
            &self.key_headers(),
            b"",
            Duration::from_secs(60),
        )
        .await?;
        let output = result?;
        if del.status >= 300 {
            return Err(UpError::FirstSandbox(format!(
                "DELETE /sandboxes/{id} answered {}: {}",
                del.status,
                del.text()
            )));
        }
        say(&format!("first sandbox {id} ran: {}", output.trim_end()));
        Ok(())
    }

    /// The cluster's addresses and key.
    pub fn info(&self) -> &ClusterInfo {
        &self.info
    }

    /// The banner: gateway URL, key and first commands.
    pub fn banner(&self) -> String {
        let gw = format!("http://{}", self.info.gateway);
        let key = &self.info.api_key;
        format!(
            "\nAgentENV is up: {n} nodes behind one gateway.\n\n  Gateway   {gw}\n  API key   {key}\n  Logs      {logs}\n\nTry it (another terminal):\n\n  export AENV_URL={gw} AENV_API_KEY={key}\n  curl -s -H \"X-API-Key: $AENV_API_KEY\" $AENV_URL/nodes\n  ID=$(curl -s -X POST -H \"X-API-Key: $AENV_API_KEY\" -H 'content-type: application/json' \\\n       -d '{{\"templateID\":\"base\"}}' $AENV_URL/sandboxes | python3 -c 'import json,sys; print(json.load(sys.stdin)[\"sandboxID\"])')\n  curl -s -H \"E2b-Sandbox-Id: $ID\" -H \"E2b-Sandbox-Port: {port}\" \"$AENV_URL/files?path=/etc/os-release\"\n  curl -s -X DELETE -H \"X-API-Key: $AENV_API_KEY\" $AENV_URL/sandboxes/$ID\n\nE2B SDKs: E2B_API_URL={gw} E2B_SANDBOX_URL={gw} E2B_API_KEY={key}\naenv CLI: with the exports above, `aenv auth` saves them; then `aenv start base`\n\nCtrl-C stops everything (sandboxes included).",
            n = self.info.nodes.len(),
            logs = self.info.data_dir.join("logs").display(),
            port = ENVD_PORT,
        )
    }

    /// Runs until `shutdown` resolves (or a child dies), then stops everything.
    pub async fn serve(
        mut self,
        shutdown: impl std::future::Future<Output = ()>,
    ) -> Result<(), UpError> {
        tokio::pin!(shutdown);
        let died = loop {
            tokio::select! {
                _ = &mut shutdown => break None,
                l = self.lines.recv() => { if l.is_none() { break None; } }
                d = wait_any(&mut self.children) => break Some(d),
            }
        };
        self.stop().await;
        match died {
            Some((name, status, log)) => Err(UpError::ChildDied { name, status, log }),
            None => Ok(()),
        }
    }

    /// Deletes every sandbox on every node, then stops the gateway, the nodes and the
    /// scheduler (SIGTERM, SIGKILL after 30 s), removes the nodes' host firewall chains,
    /// and reports anything left behind.
    pub async fn stop(&mut self) {
        let say = self.out.clone();
        // The gateway first: no new request reaches a node while its sandboxes are
        // deleted. Then the nodes, then the scheduler.
        self.stop_children(|n| n == "gateway").await;
        say("stopping: deleting sandboxes");
        for (id, addr) in self.info.nodes.clone() {
            let running = self.children.iter().any(|c| c.name == id);
            if !running {
                continue;
            }
            match self.node_sandboxes(addr).await {
                Ok(ids) => {
                    for s in ids {
                        match request(
                            addr,
                            "DELETE",
                            &format!("/sandboxes/{s}"),
                            &self.key_headers(),
                            b"",
                            Duration::from_secs(60),
                        )
                        .await
                        {
                            Ok(r) if r.status < 300 || r.status == 404 => {
                                say(&format!("  deleted sandbox {s} on {id}"))
                            }
                            Ok(r) => say(&format!(
                                "  could not delete sandbox {s} on {id}: {} {}",
                                r.status,
                                r.text()
                            )),
                            Err(e) => say(&format!("  could not delete sandbox {s} on {id}: {e}")),
                        }
                    }
                }
                Err(e) => say(&format!("  could not list the sandboxes of {id}: {e}")),
            }
        }
        self.stop_children(|n| n != "gateway" && n != "scheduler")
            .await;
        self.stop_children(|n| n == "scheduler").await;
        // The nodes leave their host firewall chains in place (their sandboxes may outlive
        // them); with every node and sandbox gone they go too. A node that died or was
        // killed may have left sandboxes: their chains stay, and the warning says why.
        let run = self.info.data_dir.join("run");
        for prefix in node_iface_prefixes(&self.opts.iface_prefix, self.opts.nodes) {
            match uninstall_host_rules(&prefix, &run, LINK_LINGER).await {
                Ok(()) => say(&format!("  host firewall rules of {prefix} removed")),
                Err(e) => say(&format!("warning: {e}")),
            }
        }
        let left = leftover_interfaces(&self.opts.iface_prefix, self.opts.nodes);
        if !left.is_empty() {
            say(&format!(
                "warning: network interfaces left behind: {}",
                left.join(", ")
            ));
        }
    }

    /// SIGTERM to the children whose name matches, then waits (SIGKILL after 30 s).
    async fn stop_children(&mut self, which: impl Fn(&str) -> bool) {
        let say = self.out.clone();
        for c in self.children.iter_mut().filter(|c| which(&c.name)) {
            if let Some(pid) = c.pid() {
                // SAFETY: kill with a pid of our own child and a valid signal number.
                unsafe { libc::kill(pid, libc::SIGTERM) };
                match tokio::time::timeout(Duration::from_secs(30), c.child.wait()).await {
                    Ok(_) => say(&format!("  {} stopped", c.name)),
                    Err(_) => {
                        let _ = c.child.kill().await;
                        say(&format!("  {} killed (no exit within 30 s)", c.name));
                    }
                }
            }
        }
    }

    async fn node_sandboxes(&self, addr: SocketAddr) -> Result<Vec<String>, UpError> {
        let mut ids = Vec::new();
        for path in ["/sandboxes", "/v2/sandboxes?state=paused"] {
            let r = request(
                addr,
                "GET",
                path,
                &self.key_headers(),
                b"",
                Duration::from_secs(10),
            )
            .await?;
            if let Some(a) = r.json().as_array() {
                for s in a {
                    if let Some(id) = s["sandboxID"].as_str()
                        && !ids.iter().any(|x| x == id)
                    {
                        ids.push(id.to_string());
                    }
                }
            }
        }
        Ok(ids)
    }
}

async fn wait_any(children: &mut [ChildProc]) -> (String, String, PathBuf) {
    let waits = children.iter_mut().map(|c| {
        Box::pin(async move {
            let st = c.child.wait().await;
            (
                c.name.clone(),
                st.map(|s| s.to_string()).unwrap_or_else(|e| e.to_string()),
                c.log.clone(),
            )
        })
    });
    let v: Vec<_> = waits.collect();
    if v.is_empty() {
        return std::future::pending().await;
    }
    futures::future::select_all(v).await.0
}

/// How long the stop waits for the kernel to remove the veths of closed sandbox
/// namespaces before it removes the host firewall rules.
const LINK_LINGER: Duration = Duration::from_secs(10);

/// The interface prefixes of the nodes: `<iface_prefix><a+i>`.
pub fn node_iface_prefixes(iface_prefix: &str, nodes: u8) -> Vec<String> {
    (0..nodes)
        .map(|i| format!("{iface_prefix}{}", (b'a' + i) as char))
        .collect()
}

/// The jail interfaces of `agentenv up` nodes still present on this host.
pub fn leftover_interfaces(iface_prefix: &str, nodes: u8) -> Vec<String> {
    let prefixes = node_iface_prefixes(iface_prefix, nodes);
    std::fs::read_dir("/sys/class/net")
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| prefixes.iter().any(|p| n.starts_with(p.as_str())))
                .collect()
        })
        .unwrap_or_default()
}

/// Condenses debootstrap's per-package lines (`I: Retrieving x`, `I: Validating x`, ...):
/// within a stretch of such lines only the first of each kind is shown, so a template
/// build shows a dozen lines, not hundreds.
#[derive(Default)]
struct Progress {
    seen: std::collections::HashSet<String>,
}

impl Progress {
    /// Whether `line` is one more per-package line of a kind already shown.
    fn repeats(&mut self, line: &str) -> bool {
        let verb = line
            .strip_prefix("I: ")
            .and_then(|rest| rest.split_whitespace().next())
            .unwrap_or_default();
        let per_package = matches!(
            verb,
            "Retrieving" | "Validating" | "Extracting" | "Unpacking" | "Configuring" | "Installing"
        );
        if !per_package {
            self.seen.clear();
            return false;
        }
        !self.seen.insert(verb.to_string())
    }
}

/// Which child log lines the user sees: warnings, errors, template build progress, and
/// anything that is not a JSON log line (a fatal error printed on stderr).
fn shown_line(json: Option<&serde_json::Value>, raw: &str, verbose: bool) -> Option<String> {
    let Some(v) = json else {
        return (!raw.trim().is_empty()).then(|| raw.to_string());
    };
    let msg = v["message"].as_str().unwrap_or_default();
    let level = v["level"].as_str().unwrap_or_default();
    let target = v["target"].as_str().unwrap_or_default();
    if verbose {
        return Some(format!("{level} {msg}"));
    }
    if target.ends_with("::template") {
        return Some(msg.to_string());
    }
    matches!(level, "WARN" | "ERROR" | "warn" | "error").then(|| format!("{level} {msg}"))
}

/// Runs `sh -c script` in a sandbox through the gateway (Connect server streaming, JSON
/// codec) and returns its stdout.
pub async fn run_command(
    gw: SocketAddr,
    id: &str,
    token: &str,
    script: &str,
) -> Result<String, UpError> {
    let msg = serde_json::json!({"process": {"cmd": "/bin/sh", "args": ["-c", script]}});
    let body = envelope(msg.to_string().as_bytes());
    let mut headers = vec![
        ("content-type", "application/connect+json"),
        ("connect-protocol-version", "1"),
        ("e2b-sandbox-id", id),
        ("e2b-sandbox-port", ENVD_PORT),
    ];
    if !token.is_empty() {
        headers.push(("x-access-token", token));
    }
    let r = request(
        gw,
        "POST",
        "/process.Process/Start",
        &headers,
        &body,
        Duration::from_secs(60),
    )
    .await?;
    if r.status != 200 {
        return Err(UpError::FirstSandbox(format!(
            "process.Process/Start answered {}: {}",
            r.status,
            r.text()
        )));
    }
    let parts = split_envelopes(&r.body)
        .ok_or_else(|| UpError::FirstSandbox("truncated process stream".into()))?;
    let mut stdout = Vec::new();
    let mut exit = None;
    for (flags, payload) in parts {
        let v: serde_json::Value = serde_json::from_slice(&payload).unwrap_or_default();
        if flags & 2 != 0 {
            if !v["error"].is_null() {
                return Err(UpError::FirstSandbox(format!(
                    "process stream error: {}",
                    v["error"]
                )));
            }
            continue;
        }
        let ev = &v["event"];
        if let Some(d) = ev["data"]["stdout"].as_str()
            && let Ok(b) = base64::engine::general_purpose::STANDARD.decode(d)
        {
            stdout.extend(b);
        }
        if !ev["end"].is_null() {
            exit = Some(ev["end"]["exitCode"].as_i64().unwrap_or(0));
        }
    }
    match exit {
        Some(0) => Ok(String::from_utf8_lossy(&stdout).into_owned()),
        other => Err(UpError::FirstSandbox(format!(
            "the command ended with {other:?}; output: {}",
            String::from_utf8_lossy(&stdout)
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn template_progress_shows_the_first_line_of_each_debootstrap_stage() {
        let mut p = Progress::default();
        let shown: Vec<&str> = [
            "building template base: debootstrap --variant=minbase bookworm",
            "I: Retrieving InRelease",
            "I: Checking Release signature",
            "I: Retrieving adduser 3.134",
            "I: Validating adduser 3.134",
            "I: Retrieving apt 2.6.1",
            "I: Validating apt 2.6.1",
            "I: Extracting bash",
            "I: Extracting dash",
            "I: Base system installed successfully.",
        ]
        .into_iter()
        .filter(|l| !p.repeats(l))
        .collect();
        assert_eq!(
            shown,
            [
                "building template base: debootstrap --variant=minbase bookworm",
                "I: Retrieving InRelease",
                "I: Checking Release signature",
                "I: Retrieving adduser 3.134",
                "I: Validating adduser 3.134",
                "I: Extracting bash",
                "I: Base system installed successfully.",
            ]
        );
    }
}
