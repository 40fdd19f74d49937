//! Every troubleshooting case of docs/troubleshooting.md and every bad deployment input,
//! reproduced with the real binaries on loopback: each fails (or reports) loudly, and the
//! message the operator sees names the fix.

use std::net::SocketAddr;
use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use agentenv_tests::{
    API_KEY, NODE_RUNTIME_DIR, Proc, api, binary, free_port, http, node_env, node_iface_prefix,
    skip_reason,
};

/// Waits for a JSON log line whose `message` contains `needle`.
fn wait_message(p: &Proc, needle: &str, limit: Duration) -> serde_json::Value {
    let deadline = Instant::now() + limit;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match p.lines.recv_timeout(left) {
            Ok(v) if v["message"].as_str().is_some_and(|m| m.contains(needle)) => return v,
            Ok(_) => {}
            Err(_) => panic!("{} did not log {needle:?} within {limit:?}", p.name),
        }
    }
}

fn control_plane(
    dir: &Path,
    nodes: &[(&str, SocketAddr)],
    gateway_scheduler: &str,
) -> std::path::PathBuf {
    let list: Vec<_> = nodes
        .iter()
        .map(|(id, a)| serde_json::json!({"id": id, "endpoint": format!("http://{a}")}))
        .collect();
    let cfg = serde_json::json!({
        "log_level": "info",
        "log_format": "json",
        "scheduler": {
            "grpc_listen_addr": "127.0.0.1:0",
            "metrics_listen_addr": "127.0.0.1:0",
            "report_ttl": "3s",
            "nodes": list,
        },
        "gateway": {
            "http_listen_addr": "127.0.0.1:0",
            "metrics_listen_addr": "127.0.0.1:0",
            "scheduler_addr": gateway_scheduler,
        }
    });
    let p = dir.join(format!("cp-{}.json", free_port()));
    std::fs::write(&p, cfg.to_string()).unwrap();
    p
}

fn start_scheduler(cfg: &Path) -> (Proc, String) {
    let mut cmd = Command::new(binary("agentenv-scheduler").unwrap());
    cmd.arg("-config").arg(cfg).env("LOG_FORMAT", "json");
    let p = Proc::spawn("scheduler", cmd);
    let v = p.wait_for("scheduler listening", Duration::from_secs(30));
    let addr = v["grpc_addr"].as_str().unwrap().to_string();
    (p, addr)
}

fn start_gateway(cfg: &Path, scheduler: &str) -> (Proc, SocketAddr) {
    let mut cmd = Command::new(binary("agentenv-gateway").unwrap());
    cmd.arg("-config")
        .arg(cfg)
        .env("LOG_FORMAT", "json")
        .env("AENV_API_KEY", API_KEY)
        .env("GATEWAY_SCHEDULER_ADDR", scheduler);
    let p = Proc::spawn("gateway", cmd);
    let v = p.wait_for("gateway listening", Duration::from_secs(30));
    let addr = v["http_addr"].as_str().unwrap().parse().unwrap();
    (p, addr)
}

/// A node process with the test cluster's environment plus `overrides`.
fn spawn_node(
    idx: u8,
    id: &str,
    addr: SocketAddr,
    home: &Path,
    scheduler: Option<&str>,
    overrides: &[(&str, &str)],
) -> Proc {
    let mut cmd = Command::new(binary("agentenv-node").unwrap());
    cmd.env_clear();
    cmd.env("PATH", std::env::var("PATH").unwrap_or_default());
    for (k, v) in node_env(idx, id, addr, home, scheduler) {
        cmd.env(k, v);
    }
    for (k, v) in overrides {
        cmd.env(k, v);
    }
    Proc::spawn(id, cmd).with_host_rules(&node_iface_prefix(idx), Path::new(NODE_RUNTIME_DIR))
}

fn nodes_view(gw: SocketAddr) -> serde_json::Value {
    let (st, v) = api(gw, "GET", "/nodes", "");
    assert_eq!(st, 200, "{v}");
    v
}

fn ready_ids(v: &serde_json::Value) -> Vec<String> {
    v.as_array()
        .map(|a| {
            a.iter()
                .filter(|n| n["status"] == "ready")
                .filter_map(|n| n["id"].as_str().map(String::from))
                .collect()
        })
        .unwrap_or_default()
}

fn failed(out: &Output) -> String {
    assert!(!out.status.success(), "expected a refusal to start");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn healthy_node_with_heartbeats_off_is_not_ready_its_log_names_both_variables_and_the_gateway_says_no_nodes_available()
 {
    if let Some(r) = skip_reason() {
        eprintln!("SKIPPED: {r}");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let node_addr = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let cfg = control_plane(dir.path(), &[("node-t1", node_addr)], "127.0.0.1:9");
    let (_s, sched) = start_scheduler(&cfg);
    let home = tempfile::tempdir().unwrap();
    let node = spawn_node(12, "node-t1", node_addr, home.path(), None, &[]);
    let v = wait_message(&node, "scheduler heartbeats off", Duration::from_secs(60));
    let m = v["message"].as_str().unwrap();
    assert!(
        m.contains("AENV_OBSERVABILITY_SCHEDULER_REPORT_ENABLED=true")
            && m.contains("AENV_OBSERVABILITY_SCHEDULER_ENDPOINT=http://"),
        "{m}"
    );
    node.wait_for("node listening", Duration::from_secs(60));
    // Healthy...
    let (st, _, _) = http(node_addr, "GET", "/health", &[], "");
    assert!((200..300).contains(&st), "{st}");
    // ...but never ready through the gateway, and creates find no node.
    let (_g, gw) = start_gateway(&cfg, &sched);
    let v = nodes_view(gw);
    assert!(ready_ids(&v).is_empty(), "{v}");
    let (st, body) = api(gw, "POST", "/sandboxes", r#"{"templateID":"base"}"#);
    assert_eq!(st, 503, "{body}");
    let m = body["message"].as_str().unwrap_or_default();
    assert!(
        m.starts_with("no nodes available: ")
            && m.contains("AENV_OBSERVABILITY_SCHEDULER_REPORT_ENABLED"),
        "the 503 names the heartbeat settings: {body}"
    );
    // deploy/verify-cluster.sh: the node is healthy and takes the key, but is not ready,
    // and the hint names the variables.
    let (ok, out) = verify_cluster(&cfg, gw);
    assert!(!ok, "{out}");
    assert!(
        out.contains("ok    node-t1: accepts the shared API key"),
        "{out}"
    );
    assert!(
        out.contains("FAIL  node-t1: ")
            && out.contains("AENV_OBSERVABILITY_SCHEDULER_REPORT_ENABLED=\"true\""),
        "{out}"
    );
}

/// Runs deploy/verify-cluster.sh with the test key: (passed, stdout).
fn verify_cluster(cfg: &Path, gw: SocketAddr) -> (bool, String) {
    let out =
        Command::new(Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/verify-cluster.sh"))
            .arg("--config")
            .arg(cfg)
            .args(["--gateway", &format!("http://{gw}")])
            .env("AENV_API_KEY", API_KEY)
            .output()
            .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

#[test]
fn heartbeat_from_an_id_missing_from_the_static_list_is_rejected_and_the_node_log_says_what_to_change()
 {
    if let Some(r) = skip_reason() {
        eprintln!("SKIPPED: {r}");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let node_addr = SocketAddr::from(([127, 0, 0, 1], free_port()));
    // The list says node-a; the host says node-x.
    let cfg = control_plane(dir.path(), &[("node-a", node_addr)], "127.0.0.1:9");
    let (_s, sched) = start_scheduler(&cfg);
    let home = tempfile::tempdir().unwrap();
    let node = spawn_node(13, "node-x", node_addr, home.path(), Some(&sched), &[]);
    let v = wait_message(
        &node,
        "the scheduler rejected this node",
        Duration::from_secs(60),
    );
    let m = v["message"].as_str().unwrap();
    assert!(
        m.contains("AENV_NODE_ID=\"node-x\" is not in its scheduler.nodes list"),
        "{m}"
    );
    assert!(
        m.contains("reload the scheduler") && m.contains("set AENV_NODE_ID to a listed id"),
        "{m}"
    );
    assert_eq!(v["level"], "ERROR");
    let (_g, gw) = start_gateway(&cfg, &sched);
    let v = nodes_view(gw);
    assert!(
        !v.to_string().contains("node-x"),
        "an unlisted id never registers: {v}"
    );
    assert!(ready_ids(&v).is_empty(), "{v}");
}

#[test]
fn node_that_cannot_reach_the_scheduler_logs_the_endpoint_it_tried() {
    if let Some(r) = skip_reason() {
        eprintln!("SKIPPED: {r}");
        return;
    }
    let closed = format!("127.0.0.1:{}", free_port());
    let node_addr = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let home = tempfile::tempdir().unwrap();
    let node = spawn_node(14, "node-t3", node_addr, home.path(), Some(&closed), &[]);
    let v = wait_message(
        &node,
        &format!("heartbeat to http://{closed} "),
        Duration::from_secs(60),
    );
    assert_eq!(v["level"], "WARN", "{v}");
    // The node keeps serving meanwhile.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let ok = std::net::TcpStream::connect(node_addr).is_ok()
            && (200..300).contains(&http(node_addr, "GET", "/health", &[], "").0);
        if ok {
            break;
        }
        assert!(Instant::now() < deadline, "the node serves /health");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn heartbeat_endpoint_without_http_scheme_stops_the_node_with_the_corrected_form() {
    let out = Command::new(binary("agentenv-node").unwrap())
        .env_clear()
        .env("AENV_OBSERVABILITY_SCHEDULER_REPORT_ENABLED", "true")
        .env("AENV_OBSERVABILITY_SCHEDULER_ENDPOINT", "10.0.0.10:9090")
        .env("AENV_API_KEY", API_KEY)
        .output()
        .unwrap();
    let err = failed(&out);
    assert!(
        err.contains("AENV_OBSERVABILITY_SCHEDULER_ENDPOINT"),
        "{err}"
    );
    assert!(err.contains("http://"), "{err}");
}

#[test]
fn gateway_scheduler_addr_with_a_scheme_is_refused_with_the_plain_host_port_to_write() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = control_plane(
        dir.path(),
        &[("node-a", "127.0.0.1:8000".parse().unwrap())],
        "http://10.0.0.10:9090",
    );
    let out = Command::new(binary("agentenv-gateway").unwrap())
        .arg("-config")
        .arg(&cfg)
        .env("AENV_API_KEY", API_KEY)
        .output()
        .unwrap();
    let err = failed(&out);
    assert!(err.contains("gateway.scheduler_addr"), "{err}");
    assert!(err.contains("write \"10.0.0.10:9090\""), "{err}");
}

#[test]
fn gateway_that_cannot_reach_the_scheduler_answers_503_naming_the_scheduler() {
    let dir = tempfile::tempdir().unwrap();
    let closed = format!("127.0.0.1:{}", free_port());
    let cfg = control_plane(
        dir.path(),
        &[("node-a", "127.0.0.1:8000".parse().unwrap())],
        &closed,
    );
    let (_g, gw) = start_gateway(&cfg, &closed);
    let (st, body) = api(gw, "POST", "/sandboxes", r#"{"templateID":"base"}"#);
    assert_eq!(st, 503, "{body}");
    let m = body["message"].as_str().unwrap_or_default();
    assert!(
        m.starts_with("scheduler unreachable") && m.contains("gateway.scheduler_addr"),
        "the 503 says the scheduler is the problem and where it was looked for: {body}"
    );
    // Health is answered by the gateway alone, so a load balancer keeps it.
    let (st, _, _) = http(gw, "GET", "/health", &[], "");
    assert!((200..300).contains(&st), "{st}");
}

#[test]
fn duplicate_node_id_stops_the_scheduler_naming_the_id_and_the_fix() {
    let dir = tempfile::tempdir().unwrap();
    let a: SocketAddr = "10.0.0.21:8000".parse().unwrap();
    let b: SocketAddr = "10.0.0.22:8000".parse().unwrap();
    let cfg = control_plane(
        dir.path(),
        &[("node-a", a), ("node-a", b)],
        "127.0.0.1:9090",
    );
    let out = Command::new(binary("agentenv-scheduler").unwrap())
        .arg("-config")
        .arg(&cfg)
        .output()
        .unwrap();
    let err = failed(&out);
    assert!(err.contains("scheduler.nodes[1].id"), "{err}");
    assert!(err.contains("duplicate node id \"node-a\""), "{err}");
    assert!(err.contains("every node needs its own id"), "{err}");
}

#[test]
fn gateway_without_an_api_key_refuses_to_start_and_names_both_places_to_put_it() {
    if Path::new(agentenv_core::api_key::DEFAULT_SECRET_PATH).exists() {
        eprintln!(
            "SKIPPED: {} exists on this host, so a gateway without AENV_API_KEY has a key",
            agentenv_core::api_key::DEFAULT_SECRET_PATH
        );
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let cfg = control_plane(
        dir.path(),
        &[("node-a", "127.0.0.1:8000".parse().unwrap())],
        "127.0.0.1:9090",
    );
    let out = Command::new(binary("agentenv-gateway").unwrap())
        .arg("-config")
        .arg(&cfg)
        .env_remove("AENV_API_KEY")
        .output()
        .unwrap();
    let err = failed(&out);
    assert!(
        err.contains("AENV_API_KEY must be set or /run/secrets/api-key must exist"),
        "{err}"
    );
    // And an empty key does not fall back to the file: it is refused as invalid.
    let out = Command::new(binary("agentenv-gateway").unwrap())
        .arg("-config")
        .arg(&cfg)
        .env("AENV_API_KEY", "short")
        .output()
        .unwrap();
    let err = failed(&out);
    assert!(err.contains("between 32 and 256"), "{err}");
}

#[test]
fn node_with_another_api_key_rejects_what_the_gateway_forwards_while_the_right_node_serves() {
    if let Some(r) = skip_reason() {
        eprintln!("SKIPPED: {r}");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let a = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let b = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let cfg = control_plane(dir.path(), &[("node-ka", a), ("node-kb", b)], "127.0.0.1:9");
    let (_s, sched) = start_scheduler(&cfg);
    let (ha, hb) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let na = spawn_node(15, "node-ka", a, ha.path(), Some(&sched), &[]);
    let other = "another-key-0123456789abcdef0123456789";
    let nb = spawn_node(
        16,
        "node-kb",
        b,
        hb.path(),
        Some(&sched),
        &[("AENV_API_KEY", other)],
    );
    na.wait_for("node listening", Duration::from_secs(60));
    nb.wait_for("node listening", Duration::from_secs(60));
    let (_g, gw) = start_gateway(&cfg, &sched);
    let deadline = Instant::now() + Duration::from_secs(30);
    while ready_ids(&nodes_view(gw)).len() < 2 {
        assert!(Instant::now() < deadline, "both nodes ready");
        std::thread::sleep(Duration::from_millis(100));
    }
    // The same request, forwarded with the gateway's key, to each node.
    let (sa, _) = api(a, "GET", "/sandboxes", "");
    let (sb, _) = api(b, "GET", "/sandboxes", "");
    assert_eq!((sa, sb), (200, 401), "node-kb does not share the key");
    // Through the gateway: the cluster list reaches both nodes; node-kb's refusal must
    // not pass silently as an empty list.
    let (st, _, body) = http(gw, "GET", "/v2/sandboxes", &[("x-api-key", API_KEY)], "");
    // Today the gateway passes node-kb's 401 through, so a client with the right key
    // sees 401 for the whole list: loud, though it does not yet name the node.
    assert_eq!(st, 401, "a mismatched node is not hidden: {body}");
    // deploy/verify-cluster.sh names the node and the fix.
    let (ok, out) = verify_cluster(&cfg, gw);
    assert!(!ok, "{out}");
    assert!(
        out.contains("ok    node-ka: accepts the shared API key"),
        "{out}"
    );
    assert!(
        out.contains("FAIL  node-kb: rejects the API key the gateway uses: set AENV_API_KEY in that host's /etc/default/aenv"),
        "{out}"
    );
}
