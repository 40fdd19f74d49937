//! deploy/install.sh and the systemd units: a real install into a scratch root (real
//! `groupadd`/`useradd --prefix`, real binaries), checked for users, modes, secrets and
//! configs; re-running never overwrites a secret or a config; `systemd-analyze verify`
//! accepts the installed units without a single warning.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use agentenv_tests::{binary, guest_binary, skip_reason};

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
        .env_remove("AENV_SANDBOX_ACCESS_TOKEN_HASH_SEED");
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

#[test]
fn install_creates_users_dirs_modes_and_shared_secrets_and_systemd_analyze_accepts_the_units() {
    if let Some(r) = skip_reason() {
        eprintln!("SKIPPED: {r}");
        return;
    }
    let root = scratch_root();
    let r = root.path();
    check(&install(
        r,
        &[],
        &[
            "--role",
            "all",
            "--node-id",
            "node-a",
            "--scheduler",
            "http://10.0.0.10:9090",
        ],
    ));

    // The control-plane account: a system user with no login shell, in the scratch root
    // only.
    let u = passwd_entry(r, "agentenv-control").expect("agentenv-control created");
    assert_eq!(u[6], "/usr/sbin/nologin");
    assert!(u[2].parse::<u32>().unwrap() < 1000, "a system uid: {u:?}");
    let cgid: u32 = u[3].parse().unwrap();

    let etc_agentenv = r.join("etc/agentenv");
    assert_eq!(mode(&etc_agentenv), 0o750);
    let md = std::fs::metadata(&etc_agentenv).unwrap();
    assert_eq!((md.uid(), md.gid()), (0, cgid));
    for f in ["control-plane.json", "auth.env"] {
        let p = etc_agentenv.join(f);
        assert_eq!(mode(&p), 0o640, "{f}");
        let md = std::fs::metadata(&p).unwrap();
        assert_eq!(
            (md.uid(), md.gid()),
            (0, cgid),
            "{f}: root:agentenv-control"
        );
    }
    assert_eq!(
        std::fs::read_to_string(etc_agentenv.join("control-plane.json")).unwrap(),
        std::fs::read_to_string(repo().join("deploy/control-plane.json")).unwrap()
    );
    let auth = std::fs::read_to_string(etc_agentenv.join("auth.env")).unwrap();
    let key = env_value(&auth, "AENV_API_KEY").expect("AENV_API_KEY in auth.env");
    agentenv_core::api_key::validate(&key, "auth.env").expect("a valid generated key");

    let node_env_path = r.join("etc/default/aenv");
    assert_eq!(mode(&node_env_path), 0o600);
    let node_env = std::fs::read_to_string(&node_env_path).unwrap();
    assert_eq!(
        env_value(&node_env, "AENV_API_KEY").as_deref(),
        Some(key.as_str()),
        "one key for gateway and node"
    );
    let seed = env_value(&node_env, "AENV_SANDBOX_ACCESS_TOKEN_HASH_SEED").unwrap();
    assert_eq!(seed.len(), 64);
    assert!(!auth.contains(&seed), "the seed stays on the nodes");
    assert_eq!(
        env_value(&node_env, "AENV_NODE_ID").as_deref(),
        Some("node-a")
    );
    assert_eq!(
        env_value(&node_env, "AENV_OBSERVABILITY_SCHEDULER_ENDPOINT").as_deref(),
        Some("http://10.0.0.10:9090")
    );
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
    let vars: Vec<(String, String)> = node_env
        .lines()
        .filter(|l| !l.starts_with('#') && l.contains('='))
        .map(|l| {
            let (k, v) = l.split_once('=').unwrap();
            (k.to_string(), v.trim_matches('"').to_string())
        })
        .collect();
    let cfg = agentenv_node_config(&vars);
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
fn reinstall_never_overwrites_secrets_or_configs() {
    if let Some(r) = skip_reason() {
        eprintln!("SKIPPED: {r}");
        return;
    }
    let root = scratch_root();
    let r = root.path();
    check(&install(r, &[], &["--role", "all", "--node-id", "node-b"]));
    let files = [
        "etc/agentenv/control-plane.json",
        "etc/agentenv/auth.env",
        "etc/default/aenv",
    ];
    // The operator edits every file.
    for f in files {
        let p = r.join(f);
        let mut text = std::fs::read_to_string(&p).unwrap();
        text.push_str("\n# edited by the operator\n");
        std::fs::write(&p, text).unwrap();
    }
    let before: Vec<String> = files
        .iter()
        .map(|f| std::fs::read_to_string(r.join(f)).unwrap())
        .collect();
    let other_key = "k".repeat(40);
    let err = check(&install(
        r,
        &[
            ("AENV_API_KEY", other_key.as_str()),
            ("AENV_SANDBOX_ACCESS_TOKEN_HASH_SEED", "other-seed"),
        ],
        &["--role", "all", "--node-id", "node-c"],
    ));
    for (f, b) in files.iter().zip(&before) {
        assert_eq!(
            &std::fs::read_to_string(r.join(f)).unwrap(),
            b,
            "{f} was overwritten"
        );
        assert!(
            err.contains(&format!("kept existing {}", r.join(f).display())),
            "{err}"
        );
    }
    // The user is not created twice.
    assert!(err.contains("system user agentenv-control exists"), "{err}");
    let n = std::fs::read_to_string(r.join("etc/passwd"))
        .unwrap()
        .lines()
        .filter(|l| l.starts_with("agentenv-control:"))
        .count();
    assert_eq!(n, 1);
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
    assert!(err.contains("http://10.0.0.10:9090"), "{err}");
    assert!(
        !root.path().join("etc/default/aenv").exists(),
        "nothing installed"
    );
}
