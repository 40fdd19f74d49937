//! deploy/install.sh and the systemd units: a real install into a scratch root (real
//! `groupadd`/`useradd --prefix`, real binaries, certificates made by the real
//! `agentenv certs`), checked for users, modes, certificates, secrets and configs; the
//! real scheduler, gateway and node start from what was installed and accept each other
//! over mutual TLS; without `--tls-dir` the script refuses unless `--plain-http` is
//! chosen; re-running never overwrites a secret, a certificate or a config;
//! `systemd-analyze verify` accepts the installed units without a single warning.

use std::net::SocketAddr;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use agentenv_testkit::Wait;
use agentenv_tests::{
    NODE_RUNTIME_DIR, Proc, binary, free_port, guest_binary, node_env, node_iface_prefix,
    skip_reason,
};

/// The jail resources (address pool, interfaces, cgroup) of the node started here.
const NODE_IDX: u8 = 21;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// A scratch root with copies of this host's user databases and systemd's unit library
/// (which `systemd-analyze verify --root` resolves targets from).
fn scratch_root() -> tempfile::TempDir {
    let root = tempfile::tempdir().unwrap();
    let etc = root.path().join("etc");
    std::fs::create_dir_all(&etc).unwrap();
    for f in ["passwd", "group", "shadow", "gshadow"] {
        let src = Path::new("/etc").join(f);
        if src.exists() {
            std::fs::copy(&src, etc.join(f)).unwrap();
        }
    }
    let lib = root.path().join("usr/lib/systemd");
    std::fs::create_dir_all(&lib).unwrap();
    let st = Command::new("cp")
        .args(["-a", "/usr/lib/systemd/system"])
        .arg(&lib)
        .status()
        .unwrap();
    assert!(st.success(), "copying /usr/lib/systemd/system");
    root
}

fn bin_dir() -> PathBuf {
    for b in ["agentenv-scheduler", "agentenv-gateway"] {
        binary(b).expect("binary");
    }
    binary("agentenv-node")
        .expect("binary")
        .parent()
        .unwrap()
        .to_path_buf()
}

fn install(root: &Path, extra_env: &[(&str, &str)], args: &[&str]) -> Output {
    let mut cmd = Command::new(repo().join("deploy/install.sh"));
    cmd.arg("--root")
        .arg(root)
        .arg("--bin-dir")
        .arg(bin_dir())
        .arg("--guest-binary")
        .arg(guest_binary().expect("guest agent"))
        .args(args)
        .env_remove("AENV_API_KEY")
        .env_remove("AENV_SANDBOX_ACCESS_TOKEN_HASH_SEED")
        .env_remove("AENV_CLUSTER_TOKEN");
    for (k, v) in extra_env {
        cmd.env(k, v);
    }
    cmd.output().expect("run install.sh")
}

fn check(out: &Output) -> String {
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        out.status.success(),
        "install.sh failed:\n{err}\n{}",
        String::from_utf8_lossy(&out.stdout)
    );
    err
}

fn mode(p: &Path) -> u32 {
    std::fs::metadata(p)
        .unwrap_or_else(|e| panic!("{}: {e}", p.display()))
        .permissions()
        .mode()
        & 0o7777
}

fn env_value(text: &str, key: &str) -> Option<String> {
    text.lines().find_map(|l| {
        l.strip_prefix(&format!("{key}="))
            .map(|v| v.trim_matches('"').to_string())
    })
}

fn passwd_entry(root: &Path, user: &str) -> Option<Vec<String>> {
    std::fs::read_to_string(root.join("etc/passwd"))
        .unwrap()
        .lines()
        .find(|l| l.starts_with(&format!("{user}:")))
        .map(|l| l.split(':').map(String::from).collect())
}

fn verify_units(root: &Path) -> Output {
    // The root stands for a host: the commands the units run that a host has (the
    // scheduler's `ExecReload=/bin/kill -HUP $MAINPID`) are there, as on the host.
    let kill = root.join("bin/kill");
    if !kill.exists() {
        std::fs::create_dir_all(root.join("bin")).unwrap();
        std::fs::copy("/bin/kill", &kill).expect("/bin/kill (Debian package procps)");
    }
    let units: Vec<PathBuf> = ["agentenv-scheduler", "agentenv-gateway", "aenv"]
        .iter()
        .map(|u| root.join(format!("etc/systemd/system/{u}.service")))
        .collect();
    Command::new("systemd-analyze")
        .arg("verify")
        .arg(format!("--root={}", root.display()))
        .args(&units)
        .output()
        .expect(
            "systemd-analyze not runnable: install the systemd package (scripts/apt-packages.txt)",
        )
}

/// A cluster CA made with the real `agentenv certs ca`, and a certificate for each
/// `(name, ip)` made with `agentenv certs issue`, all in `dir`.
fn make_certs(dir: &Path, hosts: &[(&str, &str)]) {
    let agentenv = binary("agentenv").expect("the agentenv binary");
    let run = |args: &[&str]| {
        let out = Command::new(&agentenv).args(args).output().unwrap();
        assert!(
            out.status.success(),
            "agentenv {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    let d = dir.to_str().unwrap();
    run(&["certs", "ca", "--dir", d]);
    for (name, ip) in hosts {
        run(&["certs", "issue", "--dir", d, "--name", name, "--ip", ip]);
    }
}

/// The certificates of a control plane at 10.0.0.10 and `node-a` at 10.0.0.21.
fn cluster_certs() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let ca = dir.path().join("ca");
    make_certs(
        &ca,
        &[
            ("scheduler", "10.0.0.10"),
            ("gateway", "10.0.0.10"),
            ("node-a", "10.0.0.21"),
        ],
    );
    dir
}

fn owner(p: &Path) -> (u32, u32) {
    let md = std::fs::metadata(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    (md.uid(), md.gid())
}

fn read(p: &Path) -> String {
    std::fs::read_to_string(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// `KEY=value` lines of an environment file (quotes removed, comments skipped).
fn env_vars(text: &str) -> Vec<(String, String)> {
    text.lines()
        .filter(|l| !l.starts_with('#') && l.contains('='))
        .map(|l| {
            let (k, v) = l.split_once('=').unwrap();
            (k.to_string(), v.trim_matches('"').to_string())
        })
        .collect()
}

/// Every absolute path that `text` names under `/etc/` (in quotes).
fn etc_paths(text: &str) -> Vec<String> {
    text.split('"')
        .filter(|w| w.starts_with("/etc/"))
        .map(String::from)
        .collect()
}

/// `text` with the installed absolute paths moved into the scratch root, so the real
/// binaries read the files the script installed there.
fn rooted(text: &str, root: &Path) -> String {
    let r = root.display();
    text.replace("\"/etc/agentenv/", &format!("\"{r}/etc/agentenv/"))
        .replace("\"/etc/aenv/", &format!("\"{r}/etc/aenv/"))
}

#[test]
fn install_with_tls_dir_installs_certificates_token_users_dirs_and_modes_and_systemd_analyze_accepts_the_units()
 {
    if let Some(r) = skip_reason() {
        eprintln!("SKIPPED: {r}");
        return;
    }
    let certs = cluster_certs();
    let ca_dir = certs.path().join("ca");
    let root = scratch_root();
    let r = root.path();
    let out = install(
        r,
        &[],
        &[
            "--role",
            "all",
            "--tls-dir",
            ca_dir.to_str().unwrap(),
            "--node-id",
            "node-a",
            "--scheduler",
            "https://10.0.0.10:9090",
        ],
    );
    check(&out);
    let summary = String::from_utf8_lossy(&out.stdout);
    // The end of the run says what to copy where.
    for what in [
        "agentenv certs issue --dir <CA dir> --name <node id> --ip <its address>",
        "never ca-key.pem",
        "--tls-dir DIR --node-id <node id> --scheduler https://",
        "AENV_CLUSTER_TOKEN=\"$(sudo cat /etc/agentenv/cluster-token)\"",
        "SSL_CERT_FILE",
        "agentenv-verify-cluster",
    ] {
        assert!(summary.contains(what), "summary lacks {what:?}:\n{summary}");
    }

    // The control-plane account: a system user with no login shell, in the scratch root
    // only.
    let u = passwd_entry(r, "agentenv-control").expect("agentenv-control created");
    assert_eq!(u[6], "/usr/sbin/nologin");
    assert!(u[2].parse::<u32>().unwrap() < 1000, "a system uid: {u:?}");
    let cgid: u32 = u[3].parse().unwrap();

    let etc_agentenv = r.join("etc/agentenv");
    assert_eq!(mode(&etc_agentenv), 0o750);
    assert_eq!(owner(&etc_agentenv), (0, cgid));
    for f in ["control-plane.json", "auth.env", "cluster-token"] {
        let p = etc_agentenv.join(f);
        assert_eq!(mode(&p), 0o640, "{f}");
        assert_eq!(owner(&p), (0, cgid), "{f}: root:agentenv-control");
    }
    assert_eq!(
        read(&etc_agentenv.join("control-plane.json")),
        read(&repo().join("deploy/control-plane.json"))
    );
    let auth = read(&etc_agentenv.join("auth.env"));
    let key = env_value(&auth, "AENV_API_KEY").expect("AENV_API_KEY in auth.env");
    agentenv_core::api_key::validate(&key, "auth.env").expect("a valid generated key");
    let token = read(&etc_agentenv.join("cluster-token"));
    let token = token.trim_end();
    agentenv_core::api_key::validate(token, "cluster-token").expect("a valid generated token");
    assert_ne!(token, key, "the cluster token is a secret of its own");

    // The control plane's certificates: public parts 0644, keys readable by the
    // services' user only, all copies of what `agentenv certs` wrote.
    let tls = etc_agentenv.join("tls");
    assert_eq!((mode(&tls), owner(&tls)), (0o750, (0, cgid)));
    for (f, m) in [
        ("ca.pem", 0o644),
        ("scheduler.pem", 0o644),
        ("scheduler-key.pem", 0o640),
        ("gateway.pem", 0o644),
        ("gateway-key.pem", 0o640),
    ] {
        let p = tls.join(f);
        assert_eq!((mode(&p), owner(&p)), (m, (0, cgid)), "{f}");
        assert_eq!(read(&p), read(&ca_dir.join(f)), "{f} is the issued file");
    }
    // Every file the control-plane config names is installed.
    let cp = read(&etc_agentenv.join("control-plane.json"));
    let named = etc_paths(&cp);
    assert!(named.len() >= 5, "{named:?}");
    for p in &named {
        assert!(
            r.join(p.trim_start_matches('/')).is_file(),
            "control-plane.json names {p}, which was not installed"
        );
    }

    // The node's side: root's alone.
    let etc_aenv = r.join("etc/aenv");
    assert_eq!((mode(&etc_aenv), owner(&etc_aenv)), (0o700, (0, 0)));
    assert_eq!(
        (mode(&etc_aenv.join("tls")), owner(&etc_aenv.join("tls"))),
        (0o700, (0, 0))
    );
    for (f, src, m) in [
        ("tls/ca.pem", "ca.pem", 0o644),
        ("tls/node.pem", "node-a.pem", 0o644),
        ("tls/node-key.pem", "node-a-key.pem", 0o600),
    ] {
        let p = etc_aenv.join(f);
        assert_eq!((mode(&p), owner(&p)), (m, (0, 0)), "{f}");
        assert_eq!(read(&p), read(&ca_dir.join(src)), "{f} is {src}");
    }
    let node_token = etc_aenv.join("cluster-token");
    assert_eq!((mode(&node_token), owner(&node_token)), (0o600, (0, 0)));
    assert_eq!(
        read(&node_token).trim_end(),
        token,
        "one token for the control plane and the node"
    );
    // The CA's key never leaves the CA's directory.
    let ca_key = read(&ca_dir.join("ca-key.pem"));
    let out = Command::new("grep")
        .args(["-rlF", ca_key.lines().nth(1).unwrap()])
        .arg(r.join("etc"))
        .output()
        .unwrap();
    assert!(
        out.stdout.is_empty(),
        "the CA key was installed: {}",
        String::from_utf8_lossy(&out.stdout)
    );

    let node_env_path = r.join("etc/default/aenv");
    assert_eq!(mode(&node_env_path), 0o600);
    let node_env = read(&node_env_path);
    assert_eq!(
        env_value(&node_env, "AENV_API_KEY").as_deref(),
        Some(key.as_str()),
        "one key for gateway and node"
    );
    let seed = env_value(&node_env, "AENV_SANDBOX_ACCESS_TOKEN_HASH_SEED").unwrap();
    assert_eq!(seed.len(), 64);
    assert!(!auth.contains(&seed), "the seed stays on the nodes");
    assert!(!node_env.contains(token), "the token stays in its file");
    for (k, v) in [
        ("API_ADDR", "0.0.0.0:8000"),
        ("AENV_NODE_ID", "node-a"),
        (
            "AENV_OBSERVABILITY_SCHEDULER_ENDPOINT",
            "https://10.0.0.10:9090",
        ),
        ("AENV_TLS_CERT_FILE", "/etc/aenv/tls/node.pem"),
        ("AENV_TLS_KEY_FILE", "/etc/aenv/tls/node-key.pem"),
        ("AENV_TLS_CLIENT_CA_FILE", "/etc/aenv/tls/ca.pem"),
        ("AENV_SCHEDULER_CA_FILE", "/etc/aenv/tls/ca.pem"),
        ("AENV_SCHEDULER_CLIENT_CERT_FILE", "/etc/aenv/tls/node.pem"),
        (
            "AENV_SCHEDULER_CLIENT_KEY_FILE",
            "/etc/aenv/tls/node-key.pem",
        ),
        ("AENV_CLUSTER_TOKEN_FILE", "/etc/aenv/cluster-token"),
    ] {
        assert_eq!(env_value(&node_env, k).as_deref(), Some(v), "{k}");
    }
    assert_eq!(env_value(&node_env, "AENV_ALLOW_PLAIN_HTTP"), None);
    // The same files as the example deploy/aenv.env names.
    let example = read(&repo().join("deploy/aenv.env"));
    for (k, _) in env_vars(&example).iter().filter(|(k, _)| {
        k.starts_with("AENV_TLS_")
            || k.starts_with("AENV_SCHEDULER_")
            || k == "AENV_CLUSTER_TOKEN_FILE"
    }) {
        assert_eq!(
            env_value(&node_env, k),
            env_value(&example, k),
            "{k}: the installed file and deploy/aenv.env differ"
        );
        let p = env_value(&node_env, k).unwrap();
        assert!(
            r.join(p.trim_start_matches('/')).is_file(),
            "{k}={p} is not installed"
        );
    }
    assert_eq!(mode(&r.join("var/lib/aenv")), 0o750);
    assert_eq!(mode(&r.join("var/lib/aenv/secrets")), 0o700);
    assert!(r.join("var/lib/aenv/bin/agentenv-guest").is_file());
    for b in [
        "agentenv-scheduler",
        "agentenv-gateway",
        "agentenv-node",
        "agentenv-verify-cluster",
    ] {
        assert_eq!(mode(&r.join("usr/local/bin").join(b)), 0o755, "{b}");
    }

    // The node's environment file loads as the node would load it.
    let cfg = agentenv_node_config(&env_vars(&node_env));
    assert!(cfg.contains("node-a"), "{cfg}");

    // systemd-analyze verify: exit 0 and not one warning.
    let out = verify_units(r);
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success() && text.trim().is_empty(),
        "systemd-analyze verify:\n{text}"
    );
    // The check can fail: without the node binary the runtime unit is rejected.
    std::fs::remove_file(r.join("usr/local/bin/agentenv-node")).unwrap();
    let out = verify_units(r);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("agentenv-node is not executable"));
}

/// `curl -s` with `args`: (HTTP status, curl's exit code); status 0 when none came.
fn curl(args: &[&str]) -> (u16, i32) {
    let out = Command::new("curl")
        .args(["-s", "-o", "/dev/null", "-m", "20", "-w", "%{http_code}"])
        .args(args)
        .output()
        .expect("curl is needed (scripts/apt-packages.txt)");
    (
        String::from_utf8_lossy(&out.stdout).parse().unwrap_or(0),
        out.status.code().unwrap_or(-1),
    )
}

/// The address a daemon's "… listening" log line reports under `field`, on loopback.
fn listening(p: &Proc, msg: &str, field: &str) -> SocketAddr {
    let v = p.wait_for(msg, Duration::from_secs(120));
    let a: SocketAddr = v[field].as_str().unwrap().parse().unwrap();
    SocketAddr::from(([127, 0, 0, 1], a.port()))
}

#[test]
fn installed_tls_configs_start_the_real_daemons_which_accept_each_other_and_refuse_clients_without_certificates()
 {
    if let Some(r) = skip_reason() {
        eprintln!("SKIPPED: {r}");
        return;
    }
    let certs = cluster_certs();
    let ca_dir = certs.path().join("ca");
    let root = scratch_root();
    let r = root.path();
    let sched_port = free_port();
    let endpoint = format!("https://127.0.0.1:{sched_port}");
    check(&install(
        r,
        &[],
        &[
            "--role",
            "all",
            "--tls-dir",
            ca_dir.to_str().unwrap(),
            "--node-id",
            "node-a",
            "--scheduler",
            &endpoint,
        ],
    ));
    // The installed control-plane.json, with its files in the scratch root. Every
    // listener binds every interface, so the start-up checks demand what the install
    // provides: TLS on each listener and the cluster token.
    let cfg = r.join("etc/agentenv/control-plane.rooted.json");
    std::fs::write(
        &cfg,
        rooted(&read(&r.join("etc/agentenv/control-plane.json")), r),
    )
    .unwrap();
    let mut cmd = Command::new(r.join("usr/local/bin/agentenv-scheduler"));
    cmd.arg("-config")
        .arg(&cfg)
        .env("LOG_FORMAT", "json")
        .env(
            "SCHEDULER_GRPC_LISTEN_ADDR",
            format!("0.0.0.0:{sched_port}"),
        )
        .env("SCHEDULER_METRICS_LISTEN_ADDR", "127.0.0.1:0");
    let scheduler = Proc::spawn("scheduler", cmd);
    scheduler.wait_for("scheduler listening", Duration::from_secs(30));

    let key = env_value(&read(&r.join("etc/agentenv/auth.env")), "AENV_API_KEY").unwrap();
    let mut cmd = Command::new(r.join("usr/local/bin/agentenv-gateway"));
    cmd.arg("-config")
        .arg(&cfg)
        .env("LOG_FORMAT", "json")
        .env("AENV_API_KEY", &key)
        .env("GATEWAY_HTTP_LISTEN_ADDR", "0.0.0.0:0")
        .env("GATEWAY_METRICS_LISTEN_ADDR", "127.0.0.1:0")
        .env("GATEWAY_SCHEDULER_ADDR", format!("127.0.0.1:{sched_port}"));
    let gateway = Proc::spawn("gateway", cmd);
    let gw = listening(&gateway, "gateway listening", "http_addr");

    // The node: the installed /etc/default/aenv as it is (TLS, heartbeats, token, key,
    // seed), on every interface; only what keeps this test apart from others on this
    // machine (data directories, address pool, interfaces, cgroup) comes from the
    // test cluster's settings.
    let home = tempfile::tempdir().unwrap();
    let node_port = free_port();
    let installed = env_vars(&rooted(&read(&r.join("etc/default/aenv")), r));
    let isolation = node_env(
        NODE_IDX,
        "node-a",
        SocketAddr::from(([0, 0, 0, 0], node_port)),
        home.path(),
        None,
    );
    let mut cmd = Command::new(r.join("usr/local/bin/agentenv-node"));
    cmd.env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default());
    for (k, v) in &installed {
        cmd.env(k, v);
    }
    for (k, v) in &isolation {
        let own = [
            "API_ADDR",
            "AENV_HOME_PATH",
            "AENV_RUNTIME_PATH",
            "AENV_TEMPLATE_PATH",
            "AENV_JAIL_ADDRESS_POOL",
            "AENV_JAIL_IFACE_PREFIX",
            "AENV_JAIL_CGROUP_PARENT",
            "AENV_LOG_FORMAT",
        ];
        if own.contains(&k.as_str()) {
            cmd.env(k, v);
        }
    }
    cmd.env(
        "AENV_GUEST_BINARY_PATH",
        r.join("var/lib/aenv/bin/agentenv-guest"),
    )
    .env("AENV_OBSERVABILITY_REPORT_INTERVAL_SECS", "1");
    let node = Proc::spawn("node-a", cmd)
        .with_host_rules(&node_iface_prefix(NODE_IDX), Path::new(NODE_RUNTIME_DIR));
    node.wait_for("node listening", Duration::from_secs(120));

    let tls = r.join("etc/agentenv/tls");
    let f = |n: &str| tls.join(n).display().to_string();
    let (ca, gw_cert, gw_key) = (f("ca.pem"), f("gateway.pem"), f("gateway-key.pem"));
    // The gateway serves TLS that the installed CA vouches for; no plain HTTP.
    let gw_url = format!("https://{gw}");
    assert_eq!(
        curl(&["--cacert", &ca, &format!("{gw_url}/health")]).0 / 100,
        2
    );
    assert_eq!(
        curl(&[&format!("{gw_url}/health")]).1,
        60,
        "untrusted without the CA"
    );
    assert_eq!(
        curl(&[&format!("http://{gw}/health")]).0,
        0,
        "no plain HTTP"
    );
    // The node's API wants a client certificate of the CA: the gateway's will do.
    let node_url = format!("https://127.0.0.1:{node_port}/health");
    assert_eq!(
        curl(&["--cacert", &ca, &node_url]).0,
        0,
        "a node answered a client without a certificate"
    );
    assert_eq!(
        curl(&[
            "--cacert", &ca, "--cert", &gw_cert, "--key", &gw_key, &node_url
        ])
        .0 / 100,
        2
    );
    // Heartbeats reach the scheduler over mutual TLS with the token, and the gateway
    // reads them over the same kind of link: node-a is ready.
    Wait::new(
        "node-a ready in the gateway's /nodes",
        Duration::from_secs(60),
    )
    .every(Duration::from_millis(250))
    .until_blocking(|| {
        let out = Command::new("curl")
            .args(["-s", "-m", "10", "--cacert", &ca, "-H"])
            .arg(format!("X-API-Key: {key}"))
            .arg(format!("{gw_url}/nodes"))
            .output()
            .ok()?;
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).ok()?;
        v.as_array()?
            .iter()
            .any(|n| n["id"] == "node-a" && n["status"] == "ready")
            .then_some(())
    });
    drop(gateway);
    drop(node);
    drop(scheduler);
}

#[test]
fn install_with_plain_http_writes_configs_that_allow_plain_traffic_which_the_daemons_accept_and_warns()
 {
    if let Some(r) = skip_reason() {
        eprintln!("SKIPPED: {r}");
        return;
    }
    let root = scratch_root();
    let r = root.path();
    let out = install(
        r,
        &[],
        &[
            "--role",
            "all",
            "--plain-http",
            "--node-id",
            "node-a",
            "--scheduler",
            "http://10.0.0.10:9090",
        ],
    );
    let err = check(&out);
    assert!(
        err.contains("warning: --plain-http") && err.contains("clear text"),
        "{err}"
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("WARNING: --plain-http"));

    let text = read(&r.join("etc/agentenv/control-plane.json"));
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    for s in ["scheduler", "gateway"] {
        assert_eq!(v[s]["allow_plain_http"], true, "{s}");
        assert_eq!(v[s]["cluster_token_file"], "/etc/agentenv/cluster-token");
        assert!(v[s].get("tls").is_none(), "{s}.tls: {text}");
    }
    assert!(v["gateway"].get("node_tls").is_none() && v["gateway"].get("scheduler_tls").is_none());
    for n in v["scheduler"]["nodes"].as_array().unwrap() {
        assert!(
            n["endpoint"].as_str().unwrap().starts_with("http://"),
            "{n}"
        );
    }
    assert!(!r.join("etc/agentenv/tls").exists() && !r.join("etc/aenv/tls").exists());
    let token = read(&r.join("etc/agentenv/cluster-token"));
    assert_eq!(read(&r.join("etc/aenv/cluster-token")), token);

    let node_env = read(&r.join("etc/default/aenv"));
    assert_eq!(
        env_value(&node_env, "AENV_ALLOW_PLAIN_HTTP").as_deref(),
        Some("true")
    );
    assert_eq!(
        env_value(&node_env, "AENV_CLUSTER_TOKEN_FILE").as_deref(),
        Some("/etc/aenv/cluster-token")
    );
    assert!(!node_env.contains("AENV_TLS_"), "{node_env}");
    agentenv_node_config(&env_vars(&node_env));

    // The scheduler and the gateway start from it on every interface.
    let cfg = r.join("etc/agentenv/control-plane.rooted.json");
    std::fs::write(&cfg, rooted(&text, r)).unwrap();
    let mut cmd = Command::new(r.join("usr/local/bin/agentenv-scheduler"));
    cmd.arg("-config")
        .arg(&cfg)
        .env("LOG_FORMAT", "json")
        .env("SCHEDULER_GRPC_LISTEN_ADDR", "0.0.0.0:0")
        .env("SCHEDULER_METRICS_LISTEN_ADDR", "127.0.0.1:0");
    let scheduler = Proc::spawn("scheduler", cmd);
    let sched = listening(&scheduler, "scheduler listening", "grpc_addr");
    let mut cmd = Command::new(r.join("usr/local/bin/agentenv-gateway"));
    cmd.arg("-config")
        .arg(&cfg)
        .env("LOG_FORMAT", "json")
        .env("AENV_API_KEY", "k".repeat(40))
        .env("GATEWAY_HTTP_LISTEN_ADDR", "0.0.0.0:0")
        .env("GATEWAY_METRICS_LISTEN_ADDR", "127.0.0.1:0")
        .env("GATEWAY_SCHEDULER_ADDR", sched.to_string());
    let gateway = Proc::spawn("gateway", cmd);
    let gw = listening(&gateway, "gateway listening", "http_addr");
    assert_eq!(curl(&[&format!("http://{gw}/health")]).0 / 100, 2);
}

#[test]
fn install_without_tls_dir_or_plain_http_refuses_and_names_both_choices() {
    if let Some(r) = skip_reason() {
        eprintln!("SKIPPED: {r}");
        return;
    }
    let root = scratch_root();
    let r = root.path();
    let refused = |extra: &[&str]| -> String {
        let mut args = vec!["--role", "all", "--node-id", "node-a"];
        args.extend(extra);
        let out = install(r, &[], &args);
        assert!(!out.status.success(), "{args:?} was accepted");
        assert!(
            !r.join("etc/agentenv").exists() && !r.join("etc/default/aenv").exists(),
            "{args:?}: nothing is installed"
        );
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let err = refused(&[]);
    assert!(
        err.contains("--tls-dir DIR")
            && err.contains("agentenv certs")
            && err.contains("--plain-http"),
        "{err}"
    );
    let certs = cluster_certs();
    let ca_dir = certs.path().join("ca");
    let d = ca_dir.to_str().unwrap();
    let err = refused(&["--tls-dir", d, "--plain-http"]);
    assert!(err.contains("exclude each other"), "{err}");
    // A heartbeat endpoint whose scheme does not fit the choice.
    let err = refused(&["--tls-dir", d, "--scheduler", "http://10.0.0.10:9090"]);
    assert!(err.contains("write https://10.0.0.10:9090"), "{err}");
    let err = refused(&["--plain-http", "--scheduler", "https://10.0.0.10:9090"]);
    assert!(err.contains("write http://10.0.0.10:9090"), "{err}");
    // A certificate the role needs is missing: the command that makes it is named.
    let err = refused(&["--tls-dir", d, "--node-id", "node-b"]);
    assert!(
        err.contains("node-b.pem is missing")
            && err.contains("agentenv certs issue --dir <CA dir> --name node-b --ip"),
        "{err}"
    );
    // A certificate of another CA is caught before anything is installed.
    let other = tempfile::tempdir().unwrap();
    make_certs(&other.path().join("ca"), &[]);
    std::fs::copy(other.path().join("ca/ca.pem"), ca_dir.join("ca.pem")).unwrap();
    let err = refused(&["--tls-dir", d]);
    assert!(
        err.contains("scheduler.pem is not signed by") && err.contains("--force"),
        "{err}"
    );
    // A cluster token that is not one.
    let out = install(
        r,
        &[("AENV_CLUSTER_TOKEN", "short")],
        &["--role", "control-plane", "--plain-http"],
    );
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("AENV_CLUSTER_TOKEN") && err.contains("32 to 256"),
        "{err}"
    );
}

/// Loads `vars` with the node binary's own parser: `AENV_BACKEND=microvm` (not part of
/// this build) makes the node stop right after its configuration loaded and validated,
/// so a configuration error shows as "invalid configuration: <KEY>..." instead.
fn agentenv_node_config(vars: &[(String, String)]) -> String {
    let mut cmd = Command::new(binary("agentenv-node").unwrap());
    cmd.env_clear();
    for (k, v) in vars {
        cmd.env(k, v);
    }
    cmd.env("AENV_BACKEND", "microvm");
    let out = cmd.output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success());
    assert!(
        !err.contains("invalid configuration") && err.contains("microvm"),
        "the installed /etc/default/aenv must load: {err}"
    );
    vars.iter().map(|(k, v)| format!("{k}={v}\n")).collect()
}

#[test]
fn reinstall_never_overwrites_secrets_certificates_configs_or_the_cluster_token() {
    if let Some(r) = skip_reason() {
        eprintln!("SKIPPED: {r}");
        return;
    }
    let certs = cluster_certs();
    let ca_dir = certs.path().join("ca");
    let root = scratch_root();
    let r = root.path();
    let d = ca_dir.to_str().unwrap();
    check(&install(
        r,
        &[],
        &["--role", "all", "--tls-dir", d, "--node-id", "node-a"],
    ));
    let files = [
        "etc/agentenv/control-plane.json",
        "etc/agentenv/auth.env",
        "etc/agentenv/cluster-token",
        "etc/agentenv/tls/ca.pem",
        "etc/agentenv/tls/gateway.pem",
        "etc/agentenv/tls/gateway-key.pem",
        "etc/agentenv/tls/scheduler.pem",
        "etc/agentenv/tls/scheduler-key.pem",
        "etc/aenv/cluster-token",
        "etc/aenv/tls/ca.pem",
        "etc/aenv/tls/node.pem",
        "etc/aenv/tls/node-key.pem",
        "etc/default/aenv",
    ];
    // The operator edits the configs.
    for f in [
        "etc/agentenv/control-plane.json",
        "etc/agentenv/auth.env",
        "etc/default/aenv",
    ] {
        let p = r.join(f);
        let mut text = read(&p);
        text.push_str("\n# edited by the operator\n");
        std::fs::write(&p, text).unwrap();
    }
    let before: Vec<String> = files.iter().map(|f| read(&r.join(f))).collect();
    // Again, with other secrets in the environment and a new CA's certificates.
    let renewed = tempfile::tempdir().unwrap();
    let renewed_ca = renewed.path().join("ca");
    make_certs(
        &renewed_ca,
        &[
            ("scheduler", "10.0.0.10"),
            ("gateway", "10.0.0.10"),
            ("node-a", "10.0.0.21"),
        ],
    );
    let other_key = "k".repeat(40);
    let other_token = "t".repeat(40);
    let err = check(&install(
        r,
        &[
            ("AENV_API_KEY", other_key.as_str()),
            ("AENV_SANDBOX_ACCESS_TOKEN_HASH_SEED", "other-seed"),
            ("AENV_CLUSTER_TOKEN", other_token.as_str()),
        ],
        &[
            "--role",
            "all",
            "--tls-dir",
            renewed_ca.to_str().unwrap(),
            "--node-id",
            "node-a",
        ],
    ));
    for (f, b) in files.iter().zip(&before) {
        assert_eq!(&read(&r.join(f)), b, "{f} was overwritten");
        assert!(
            err.contains(&format!("kept existing {}", r.join(f).display())),
            "{err}"
        );
    }
    assert!(
        err.contains("AENV_CLUSTER_TOKEN differs from the token installed"),
        "{err}"
    );
    assert!(
        err.contains(&format!(
            "{} differs from {}",
            r.join("etc/aenv/tls/node.pem").display(),
            renewed_ca.join("node-a.pem").display()
        )),
        "a renewal that was not installed is named: {err}"
    );
    // The user is not created twice.
    assert!(err.contains("system user agentenv-control exists"), "{err}");
    let n = read(&r.join("etc/passwd"))
        .lines()
        .filter(|l| l.starts_with("agentenv-control:"))
        .count();
    assert_eq!(n, 1);

    // A runtime host installed with the control plane's token gets exactly that token;
    // one installed without it is told that its own token will be refused.
    let token = read(&r.join("etc/agentenv/cluster-token"));
    let node_root = scratch_root();
    let out = install(
        node_root.path(),
        &[("AENV_CLUSTER_TOKEN", token.trim_end())],
        &["--role", "runtime", "--tls-dir", d, "--node-id", "node-a"],
    );
    check(&out);
    assert_eq!(
        read(&node_root.path().join("etc/aenv/cluster-token")),
        token
    );
    assert!(!String::from_utf8_lossy(&out.stdout).contains("WARNING"));
    let lone_root = scratch_root();
    let out = install(
        lone_root.path(),
        &[],
        &["--role", "runtime", "--tls-dir", d, "--node-id", "node-a"],
    );
    check(&out);
    let summary = String::from_utf8_lossy(&out.stdout);
    assert!(
        summary.contains("generated a cluster token of its own")
            && summary.contains("/etc/agentenv/cluster-token"),
        "{summary}"
    );
}

#[test]
fn install_rejects_a_heartbeat_endpoint_without_scheme_and_names_the_fix() {
    if let Some(r) = skip_reason() {
        eprintln!("SKIPPED: {r}");
        return;
    }
    let root = scratch_root();
    let out = install(
        root.path(),
        &[],
        &["--role", "runtime", "--scheduler", "10.0.0.10:9090"],
    );
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("https://10.0.0.10:9090")
            && err.contains("http://10.0.0.10:9090 with --plain-http"),
        "{err}"
    );
    assert!(
        !root.path().join("etc/default/aenv").exists(),
        "nothing installed"
    );
}
