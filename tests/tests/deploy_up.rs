//! `agentenv up`: the one-command local cluster, run as a user runs it — the real binary
//! with real scheduler, gateway and node children — then the banner's own commands are
//! run with bash and curl, and Ctrl-C must leave no sandbox, interface, firewall chain or
//! process behind.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use agentenv_tests::{TEMPLATE_CACHE, binary, guest_binary, skip_reason};

/// Processes whose command line or environment mentions `needle`.
fn processes_mentioning(needle: &str) -> Vec<u32> {
    let mut out = Vec::new();
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return out;
    };
    for e in rd.flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        if pid == std::process::id() {
            continue;
        }
        for f in ["cmdline", "environ"] {
            if let Ok(b) = std::fs::read(e.path().join(f))
                && String::from_utf8_lossy(&b).contains(needle)
            {
                out.push(pid);
                break;
            }
        }
    }
    out
}

fn interfaces_with_prefix(prefixes: &[&str]) -> Vec<String> {
    std::fs::read_dir("/sys/class/net")
        .map(|rd| {
            rd.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| prefixes.iter().any(|p| n.starts_with(p)))
                .collect()
        })
        .unwrap_or_default()
}

/// Lines of `iptables-save` (filter and nat) naming a host chain of one of `prefixes`:
/// the chains, their rules and the jumps to them.
fn chains_of(prefixes: &[&str]) -> Vec<String> {
    let mut out = Vec::new();
    for table in ["filter", "nat"] {
        let o = Command::new("iptables-save")
            .args(["-t", table])
            .output()
            .expect("iptables-save");
        assert!(o.status.success(), "iptables-save -t {table}");
        out.extend(
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .filter(|l| {
                    prefixes
                        .iter()
                        .any(|p| l.contains(&format!("AGENTENV-{}-", p.to_ascii_uppercase())))
                })
                .map(str::to_string),
        );
    }
    out
}

/// Stops `agentenv up` (Ctrl-C, then SIGKILL after a minute) when a test
/// panics before it did, so a failed test leaves no cluster running.
struct StopOnPanic(u32);

impl Drop for StopOnPanic {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            return;
        }
        let pid = nix::unistd::Pid::from_raw(self.0 as i32);
        let running = || {
            std::fs::read_to_string(format!("/proc/{}/stat", self.0))
                .ok()
                .and_then(|s| s.rsplit_once(") ").map(|(_, r)| !r.starts_with('Z')))
                .unwrap_or(false)
        };
        if !running() {
            return;
        }
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGINT);
        let deadline = Instant::now() + Duration::from_secs(60);
        while running() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(100));
        }
        if running() {
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
        }
    }
}

/// `agentenv up --nodes 2` on a free port with the shared templates and the static guest
/// agent (the cluster binaries it starts built first).
fn up_command() -> Command {
    let agentenv = binary("agentenv").expect("agentenv binary");
    for b in ["agentenv-scheduler", "agentenv-gateway", "agentenv-node"] {
        binary(b).expect("cluster binary");
    }
    let guest = guest_binary().expect("static guest agent");
    let mut cmd = Command::new(&agentenv);
    cmd.args(["up", "--nodes", "2", "--listen", "127.0.0.1:0"])
        .arg("--template-dir")
        .arg(TEMPLATE_CACHE)
        .arg("--guest-binary")
        .arg(&guest);
    cmd
}

#[test]
fn agentenv_up_serves_sandboxes_through_the_gateway_and_ctrl_c_leaves_nothing_behind() {
    if let Some(r) = skip_reason() {
        eprintln!("SKIPPED: {r}");
        return;
    }
    let mut child = up_command()
        .args(["--pool-prefix", "10.14"])
        .env_remove("AENV_API_KEY")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start agentenv up");
    let pid = child.id();
    let _stop = StopOnPanic(pid);
    let (tx, rx) = mpsc::channel::<String>();
    let stdout = child.stdout.take().unwrap();
    std::thread::spawn(move || {
        for l in BufReader::new(stdout).lines().map_while(Result::ok) {
            eprintln!("[up] {l}");
            if tx.send(l).is_err() {
                break;
            }
        }
    });
    let mut lines = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(900);
    while !lines.iter().any(|l: &String| l.starts_with("Ctrl-C stops")) {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(l) => lines.push(l),
            Err(e) => panic!(
                "agentenv up did not print its banner ({e:?}):\n{}",
                lines.join("\n")
            ),
        }
    }
    let text = lines.join("\n");
    let field = |name: &str| -> String {
        lines
            .iter()
            .find_map(|l| l.trim().strip_prefix(name).map(|v| v.trim().to_string()))
            .unwrap_or_else(|| panic!("no {name} in the banner:\n{text}"))
    };
    let gateway = field("Gateway");
    let key = field("API key");
    let data_dir = field("state and logs:");
    assert!(gateway.starts_with("http://127.0.0.1:"), "{gateway}");
    // As a node generates its key: `e2b_` and 32 random bytes in hex.
    let hex = key
        .strip_prefix("e2b_")
        .unwrap_or_else(|| panic!("a generated key starts with e2b_: {key}"));
    assert!(
        hex.len() == 64 && hex.bytes().all(|b| b.is_ascii_hexdigit()),
        "a generated 32-byte hex key: {key}"
    );
    // The start-up check ran a real command in a real sandbox through the gateway.
    let ran = lines
        .iter()
        .find(|l| l.starts_with("first sandbox "))
        .unwrap_or_else(|| panic!("no first sandbox line:\n{text}"));
    let id = ran.split_whitespace().nth(2).unwrap();
    assert!(ran.ends_with(&format!("ran: hello from {id}")), "{ran}");
    assert!(text.contains("all 2 nodes are ready"), "{text}");

    // The banner's commands, as printed, work with bash and curl.
    let start = lines.iter().position(|l| l.starts_with("Try it")).unwrap();
    let end = lines
        .iter()
        .position(|l| l.starts_with("E2B SDKs:"))
        .unwrap();
    let mut script = String::from("set -euo pipefail\n");
    for l in &lines[start + 1..end] {
        script.push_str(l);
        script.push('\n');
    }
    // Keep one sandbox alive so Ctrl-C has something to clean up: run the banner's
    // create twice and delete only the last.
    let create_only: String = lines[start + 1..end]
        .iter()
        .filter(|l| !l.contains("DELETE"))
        .cloned()
        .collect::<Vec<_>>()
        .join("\n");
    let script = format!("{create_only}\necho \"KEPT=$ID\"\n{script}");
    let out = Command::new("bash")
        .arg("-c")
        .arg(&script)
        .output()
        .expect("run bash");
    let o = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "banner commands failed:\n{script}\n{o}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        o.contains("\"id\":\"node-a\"") && o.contains("\"id\":\"node-b\""),
        "{o}"
    );
    assert!(o.matches("Debian GNU/Linux").count() >= 2, "{o}");
    let kept = o
        .lines()
        .find_map(|l| l.strip_prefix("KEPT="))
        .expect("kept sandbox id")
        .to_string();
    // The banner's aenv line: with its exports, `aenv auth` saves them and `aenv exec`
    // runs a command in the kept sandbox through the gateway.
    let aenv = binary("aenv").expect("aenv binary");
    let home = tempfile::tempdir().unwrap();
    let aenv_cmd = |args: &[&str]| {
        Command::new(&aenv)
            .args(args)
            .env("HOME", home.path())
            .env("AENV_URL", &gateway)
            .env("AENV_API_KEY", &key)
            .stdin(Stdio::null())
            .output()
            .expect("run aenv")
    };
    let out = aenv_cmd(&["auth"]);
    assert!(
        out.status.success(),
        "aenv auth: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = aenv_cmd(&["exec", &kept, "uname", "-n"]);
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        kept,
        "aenv exec: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        !interfaces_with_prefix(&["upa", "upb"]).is_empty(),
        "a sandbox is running"
    );
    assert!(!processes_mentioning(&data_dir).is_empty());
    for chain in ["AGENTENV-UPA-FWD", "AGENTENV-UPB-FWD", "AGENTENV-UPB-NAT"] {
        assert!(
            chains_of(&["upa", "upb"])
                .iter()
                .any(|l| l.starts_with(&format!(":{chain} "))),
            "the nodes installed {chain}"
        );
    }

    // Ctrl-C.
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGINT,
    )
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        assert!(
            Instant::now() < deadline,
            "agentenv up did not stop after Ctrl-C"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let rest: Vec<String> = rx.try_iter().collect();
    let rest = rest.join("\n");
    assert!(status.success(), "exit status {status}:\n{rest}");
    assert!(rest.contains(&format!("deleted sandbox {kept}")), "{rest}");
    for n in ["gateway", "node-a", "node-b", "scheduler"] {
        assert!(rest.contains(&format!("  {n} stopped")), "{n}: {rest}");
    }
    assert!(!rest.contains("warning"), "{rest}");
    for p in ["upa", "upb"] {
        assert!(
            rest.contains(&format!("host firewall rules of {p} removed")),
            "{p}: {rest}"
        );
    }
    assert_eq!(
        interfaces_with_prefix(&["upa", "upb"]),
        Vec::<String>::new()
    );
    assert_eq!(chains_of(&["upa", "upb"]), Vec::<String>::new());
    assert_eq!(processes_mentioning(&data_dir), Vec::<u32>::new());
    assert!(!Path::new(&data_dir).exists(), "temporary state removed");
}

#[test]
fn agentenv_up_refuses_a_busy_gateway_port_and_names_the_flag() {
    let agentenv = binary("agentenv").expect("agentenv binary");
    let busy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = busy.local_addr().unwrap();
    let out = Command::new(&agentenv)
        .args([
            "up",
            "--listen",
            &addr.to_string(),
            "--api-key",
            &"k".repeat(40),
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    if nix::unistd::Uid::effective().is_root() {
        assert!(
            err.contains(&addr.to_string()) && err.contains("--listen"),
            "{err}"
        );
    } else {
        assert!(err.contains("needs root"), "{err}");
    }
}

#[test]
fn ctrl_c_during_start_up_removes_the_first_sandbox_and_every_process() {
    if let Some(r) = skip_reason() {
        eprintln!("SKIPPED: {r}");
        return;
    }
    let mut child = up_command()
        .args(["--pool-prefix", "10.16", "--iface-prefix", "uq"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start agentenv up");
    let pid = child.id();
    let _stop = StopOnPanic(pid);
    let stdout = child.stdout.take().unwrap();
    let mut lines = Vec::new();
    let mut data_dir = String::new();
    // Interrupt while the first sandbox is being created through the gateway.
    for l in BufReader::new(stdout).lines().map_while(Result::ok) {
        eprintln!("[up] {l}");
        if let Some(d) = l.strip_prefix("state and logs: ") {
            data_dir = d.to_string();
        }
        let interrupt =
            l.starts_with("starting a first sandbox") || l.starts_with("building template");
        lines.push(l);
        if interrupt {
            nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid as i32),
                nix::sys::signal::Signal::SIGINT,
            )
            .unwrap();
        }
    }
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    let text = lines.join("\n");
    assert!(!data_dir.is_empty(), "{text}");
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("starting a first sandbox")),
        "{text}"
    );
    if out.status.success() {
        // The check finished before the signal was seen: a normal stop followed.
        assert!(text.contains("Ctrl-C stops everything"), "{text}\n{err}");
    } else {
        assert!(err.contains("interrupted during start-up"), "{err}");
    }
    for n in ["gateway", "node-a", "node-b", "scheduler"] {
        assert!(text.contains(&format!("  {n} stopped")), "{n}: {text}");
    }
    assert_eq!(
        interfaces_with_prefix(&["uqa", "uqb"]),
        Vec::<String>::new()
    );
    assert_eq!(chains_of(&["uqa", "uqb"]), Vec::<String>::new());
    assert_eq!(processes_mentioning(&data_dir), Vec::<u32>::new());
    assert!(!Path::new(&data_dir).exists(), "temporary state removed");
}

/// Runs `agentenv up` with `extra` flags until its banner; returns the child, the lines
/// read so far and the channel of the lines that follow.
fn up_until_banner(extra: &[&str]) -> (std::process::Child, Vec<String>, mpsc::Receiver<String>) {
    let mut child = up_command()
        .args(extra)
        .env_remove("AENV_API_KEY")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start agentenv up");
    let (tx, rx) = mpsc::channel::<String>();
    let stdout = child.stdout.take().unwrap();
    std::thread::spawn(move || {
        for l in BufReader::new(stdout).lines().map_while(Result::ok) {
            eprintln!("[up] {l}");
            if tx.send(l).is_err() {
                break;
            }
        }
    });
    let mut lines = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(900);
    while !lines.iter().any(|l: &String| l.starts_with("Ctrl-C stops")) {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(l) => lines.push(l),
            Err(e) => panic!(
                "agentenv up did not print its banner ({e:?}):\n{}",
                lines.join("\n")
            ),
        }
    }
    (child, lines, rx)
}

/// `curl -s -o /dev/null -w %{http_code}` with `args`: the status, or curl's exit code
/// as `curl exit N` when no HTTP answer came.
fn curl_status(args: &[&str]) -> String {
    let out = Command::new("curl")
        .args([
            "-s",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
            "--max-time",
            "10",
        ])
        .args(args)
        .output()
        .expect("run curl");
    match out.status.code() {
        Some(0) => String::from_utf8_lossy(&out.stdout).into_owned(),
        other => format!("curl exit {}", other.unwrap_or(-1)),
    }
}

#[test]
fn agentenv_up_tls_serves_the_official_e2b_sdk_aenv_and_curl_over_tls_with_its_own_ca() {
    if let Some(r) = skip_reason() {
        eprintln!("SKIPPED: {r}");
        return;
    }
    let py = agentenv_tests::e2b_python().expect("E2B SDK virtual environment");
    let (mut child, lines, rx) =
        up_until_banner(&["--tls", "--pool-prefix", "10.18", "--iface-prefix", "uv"]);
    let pid = child.id();
    let _stop = StopOnPanic(pid);
    let text = lines.join("\n");
    let field = |name: &str| -> String {
        lines
            .iter()
            .find_map(|l| l.trim().strip_prefix(name).map(|v| v.trim().to_string()))
            .unwrap_or_else(|| panic!("no {name} in the banner:\n{text}"))
    };
    let gateway = field("Gateway");
    let key = field("API key");
    let ca = field("CA");
    let ca = ca.split_whitespace().next().unwrap().to_string();
    let data_dir = field("state and logs:");
    assert!(gateway.starts_with("https://127.0.0.1:"), "{gateway}");
    assert!(Path::new(&ca).is_file(), "{ca}");
    // The start-up check ran a command through the TLS gateway and mutual TLS links.
    assert!(
        lines.iter().any(|l| l.starts_with("first sandbox ")),
        "{text}"
    );

    // Nothing answers plain HTTP; nothing is trusted without the CA; a node's API also
    // wants the cluster's client certificate.
    let hostport = gateway.trim_start_matches("https://");
    assert!(
        curl_status(&[&format!("http://{hostport}/health")]).starts_with("curl exit"),
        "plain HTTP answered on the TLS gateway"
    );
    assert_eq!(
        curl_status(&[&format!("{gateway}/health")]),
        "curl exit 60",
        "an unknown CA is refused"
    );
    assert_eq!(
        curl_status(&["--cacert", &ca, &format!("{gateway}/health")]),
        "204"
    );
    let node_a = lines
        .iter()
        .find_map(|l| l.trim().strip_prefix("node-a"))
        .and_then(|l| l.split_whitespace().nth(1))
        .unwrap_or_else(|| panic!("no node-a line:\n{text}"))
        .to_string();
    let node_url = format!("https://{node_a}/health");
    assert!(
        curl_status(&["--cacert", &ca, &node_url]).starts_with("curl exit"),
        "a node answered a client without the cluster's certificate"
    );
    let tls_dir = Path::new(&data_dir).join("tls");
    let client_cert = tls_dir.join("cluster-client.pem");
    let client_key = tls_dir.join("cluster-client-key.pem");
    assert_eq!(
        curl_status(&[
            "--cacert",
            &ca,
            "--cert",
            client_cert.to_str().unwrap(),
            "--key",
            client_key.to_str().unwrap(),
            &node_url
        ]),
        "204"
    );

    // The official E2B SDK, trusting the CA through the standard variable.
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/e2b_cluster.py");
    let out = Command::new(&py)
        .arg(script)
        .env("E2B_API_URL", &gateway)
        .env("E2B_SANDBOX_URL", &gateway)
        .env("E2B_API_KEY", &key)
        .env("SSL_CERT_FILE", &ca)
        .output()
        .expect("run the SDK script");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "SDK script over TLS failed:\n{}\n{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_str(stdout.trim()).expect("JSON from the script");
    assert_eq!(v["read"], "abc");
    assert_eq!(v["after_resume"], "abc");
    assert_eq!(v["kill_a"], true);

    // The banner's commands (with its SSL_CERT_FILE export) work with bash and curl.
    let start = lines.iter().position(|l| l.starts_with("Try it")).unwrap();
    let end = lines
        .iter()
        .position(|l| l.starts_with("E2B SDKs:"))
        .unwrap();
    let script = format!(
        "set -euo pipefail\n{}\necho \"KEPT=$ID\"\n",
        lines[start + 1..end]
            .iter()
            .filter(|l| !l.contains("DELETE"))
            .cloned()
            .collect::<Vec<_>>()
            .join("\n")
    );
    let out = Command::new("bash")
        .arg("-c")
        .arg(&script)
        .output()
        .expect("run bash");
    let o = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "banner commands failed:\n{script}\n{o}"
    );
    assert!(o.contains("Debian GNU/Linux"), "{o}");
    let kept = o
        .lines()
        .find_map(|l| l.strip_prefix("KEPT="))
        .expect("kept sandbox id")
        .to_string();

    // aenv over TLS with the same variable.
    let aenv = binary("aenv").expect("aenv binary");
    let home = tempfile::tempdir().unwrap();
    let aenv_cmd = |args: &[&str], ca: Option<&str>| {
        let mut c = Command::new(&aenv);
        c.args(args)
            .env("HOME", home.path())
            .env("AENV_URL", &gateway)
            .env("AENV_API_KEY", &key)
            .env_remove("SSL_CERT_FILE")
            .stdin(Stdio::null());
        if let Some(ca) = ca {
            c.env("SSL_CERT_FILE", ca);
        }
        c.output().expect("run aenv")
    };
    let out = aenv_cmd(&["auth"], Some(&ca));
    assert!(
        out.status.success(),
        "aenv auth: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = aenv_cmd(&["exec", &kept, "uname", "-n"], Some(&ca));
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        kept,
        "aenv exec over TLS: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = aenv_cmd(&["ls"], None);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("SSL_CERT_FILE"),
        "the error names the fix: {err}"
    );

    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGINT,
    )
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        assert!(Instant::now() < deadline, "agentenv up did not stop");
        std::thread::sleep(Duration::from_millis(50));
    };
    let rest: Vec<String> = rx.try_iter().collect();
    let rest = rest.join("\n");
    assert!(status.success(), "exit status {status}:\n{rest}");
    assert!(rest.contains(&format!("deleted sandbox {kept}")), "{rest}");
    assert!(!rest.contains("warning"), "{rest}");
    assert_eq!(
        interfaces_with_prefix(&["uva", "uvb"]),
        Vec::<String>::new()
    );
    assert_eq!(processes_mentioning(&data_dir), Vec::<u32>::new());
}
