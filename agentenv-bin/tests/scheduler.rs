//! The real `agentenv-scheduler` binary, started with a config file and
//! driven over gRPC on loopback.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use agentenv_core::proto::scheduler_v1::scheduler_client::SchedulerClient;
use agentenv_core::proto::scheduler_v1::*;
use tonic::Code;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

const BIN: &str = env!("CARGO_BIN_EXE_agentenv-scheduler");

struct Daemon {
    child: Child,
    grpc: String,
    metrics: String,
    _dir: tempfile::TempDir,
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn write_config(dir: &tempfile::TempDir, json: &str) -> std::path::PathBuf {
    let path = dir.path().join("control-plane.json");
    std::fs::write(&path, json).unwrap();
    path
}

/// Starts the daemon and waits for its "listening" log line.
fn start(json: &str) -> Daemon {
    let dir = tempfile::tempdir().unwrap();
    let path = write_config(&dir, json);
    let mut child = Command::new(BIN)
        .arg("-config")
        .arg(&path)
        .env("LOG_FORMAT", "json")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if let Ok(v) = serde_json::from_str::<serde_json::Value>(&line)
                && v["message"] == "scheduler listening"
            {
                let _ = tx.send((
                    v["grpc_addr"].as_str().unwrap().to_string(),
                    v["metrics_addr"].as_str().unwrap().to_string(),
                ));
            }
        }
    });
    let (grpc, metrics) = rx
        .recv_timeout(Duration::from_secs(30))
        .expect("scheduler did not report its listening addresses");
    Daemon {
        child,
        grpc,
        metrics,
        _dir: dir,
    }
}

const CONFIG: &str = r#"{
  "log_level": "info",
  "scheduler": {
    "grpc_listen_addr": "127.0.0.1:0",
    "metrics_listen_addr": "127.0.0.1:0",
    "strategy": "round_robin",
    "report_ttl": "30s",
    "binding_ttl": "30s",
    "nodes": [
      {"id": "node-a", "endpoint": "http://127.0.0.1:18001"},
      {"id": "node-b", "endpoint": "http://127.0.0.1:18002"}
    ]
  }
}"#;

fn beat(id: &str, sandboxes: &[&str]) -> HeartbeatRequest {
    HeartbeatRequest {
        node_id: id.into(),
        service_instance_id: format!("{id}-1"),
        snapshot: Some(NodeSnapshot {
            status: NodeStatus::Ready as i32,
            ..Default::default()
        }),
        sandbox_ids: sandboxes.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    }
}

#[tokio::test]
async fn binary_serves_scheduler_health_and_metrics_then_stops_on_sigterm() {
    let mut d = start(CONFIG);
    let url = format!("http://{}", d.grpc);
    let mut client = SchedulerClient::connect(url.clone()).await.unwrap();

    let e = client
        .schedule(ScheduleRequest::default())
        .await
        .unwrap_err();
    assert_eq!(
        (e.code(), e.message()),
        (Code::Unavailable, "no nodes available")
    );

    client.heartbeat(beat("node-a", &["sbx-1"])).await.unwrap();
    client.heartbeat(beat("node-b", &[])).await.unwrap();
    let mut placed = Vec::new();
    for _ in 0..4 {
        let r = client.schedule(ScheduleRequest::default()).await.unwrap();
        placed.push(r.into_inner().node.unwrap().node_id);
    }
    placed.sort();
    assert_eq!(placed, ["node-a", "node-a", "node-b", "node-b"]);

    let found = client
        .lookup_node(LookupNodeRequest {
            sandbox_id: "sbx-1".into(),
        })
        .await
        .unwrap()
        .into_inner()
        .node
        .unwrap();
    assert_eq!(found.endpoint, "http://127.0.0.1:18001");
    client
        .record_assignment(RecordAssignmentRequest {
            sandbox_id: "sbx-2".into(),
            node: Some(Node {
                node_id: "node-b".into(),
                endpoint: "http://127.0.0.1:18002".into(),
            }),
        })
        .await
        .unwrap();
    let found = client
        .lookup_node(LookupNodeRequest {
            sandbox_id: "sbx-2".into(),
        })
        .await
        .unwrap();
    assert_eq!(found.into_inner().node.unwrap().node_id, "node-b");

    let e = client.heartbeat(beat("node-z", &[])).await.unwrap_err();
    assert_eq!(
        (e.code(), e.message()),
        (Code::InvalidArgument, "node is not in scheduler node list")
    );
    let e = client
        .lookup_node(LookupNodeRequest {
            sandbox_id: String::new(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);

    let channel = tonic::transport::Channel::from_shared(url)
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut health = HealthClient::new(channel);
    for service in ["", "scheduler.v1.Scheduler"] {
        let r = health
            .check(HealthCheckRequest {
                service: service.into(),
            })
            .await
            .unwrap();
        assert_eq!(
            r.into_inner().status,
            ServingStatus::Serving as i32,
            "{service:?}"
        );
    }

    let metrics = http_get(&d.metrics, "/metrics").await;
    assert!(
        metrics.contains(
            r#"agentenv_scheduler_rpc_duration_seconds_count{rpc="Schedule",status="ok"} 4"#
        ),
        "{metrics}"
    );
    assert!(
        metrics.contains(r#"agentenv_scheduler_observed_nodes{status="ready"}"#),
        "{metrics}"
    );

    let status = Command::new("kill")
        .args(["-TERM", &d.child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let exit = agentenv_testkit::eventually(
        "the scheduler to stop after SIGTERM",
        Duration::from_secs(15),
        || std::future::ready(d.child.try_wait().unwrap()),
    )
    .await;
    assert!(exit.success(), "graceful stop exits 0, got {exit:?}");
}

async fn http_get(addr: &str, path: &str) -> String {
    let addr: std::net::SocketAddr = addr.parse().unwrap();
    let r =
        agentenv_bin::http_client::request(addr, "GET", path, &[], b"", Duration::from_secs(30));
    r.await.unwrap().text()
}

/// Runs the binary on a config that must be refused; returns its stderr.
fn refused(json: &str) -> String {
    let dir = tempfile::tempdir().unwrap();
    let path = write_config(&dir, json);
    let out = Command::new(BIN)
        .arg("-config")
        .arg(&path)
        .output()
        .unwrap();
    assert!(!out.status.success(), "bad config accepted: {json}");
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert_eq!(stderr.trim_end().lines().count(), 1, "one line: {stderr}");
    stderr
}

#[test]
fn bad_configs_exit_non_zero_with_one_line_naming_the_key() {
    let cases = [
        (r#"{"scheduler":{"report_ttl":30}}"#, "scheduler.report_ttl"),
        (
            r#"{"scheduler":{"strategy":"fastest"}}"#,
            "scheduler.strategy",
        ),
        (r#"{"scheduler":{"nodes":[]}}"#, "scheduler.nodes"),
        (
            r#"{"scheduler":{"nodes":[{"id":"a","endpoint":"http://x:1"},{"id":"a","endpoint":"http://y:1"}]}}"#,
            "scheduler.nodes[1].id",
        ),
        (
            r#"{"scheduler":{"nodes":[{"id":"a","endpoint":"10.0.0.21:8000"}]}}"#,
            "scheduler.nodes[0].endpoint",
        ),
        (r#"{"scheduler": "#, "not valid JSON"),
    ];
    for (json, key) in cases {
        let stderr = refused(json);
        assert!(
            stderr.starts_with("agentenv-scheduler: load config failed: "),
            "{stderr}"
        );
        assert!(stderr.contains(key), "{key} not named in: {stderr}");
    }
}

#[test]
fn an_address_in_use_is_a_clear_error() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let stderr = refused(&format!(
        r#"{{"scheduler":{{"grpc_listen_addr":"127.0.0.1:{port}","metrics_listen_addr":"127.0.0.1:0"}}}}"#
    ));
    assert!(
        stderr.contains("cannot listen on scheduler.grpc_listen_addr"),
        "{stderr}"
    );
}

/// The daemon's config file, rewritten to `json`, then SIGHUP.
fn reload(d: &Daemon, json: &str) {
    std::fs::write(d._dir.path().join("control-plane.json"), json).unwrap();
    let status = Command::new("kill")
        .args(["-HUP", &d.child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
}

/// The value of the reload counter with `result` (0 before the first).
async fn reloads(d: &Daemon, result: &str) -> u64 {
    let text = http_get(&d.metrics, "/metrics").await;
    let prefix = format!("agentenv_scheduler_config_reloads_total{{result=\"{result}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(prefix.as_str()))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

#[tokio::test]
async fn sighup_applies_the_node_list_and_a_file_that_does_not_load_changes_nothing() {
    let d = start(CONFIG);
    let mut client = SchedulerClient::connect(format!("http://{}", d.grpc))
        .await
        .unwrap();
    client.heartbeat(beat("node-a", &[])).await.unwrap();
    client.heartbeat(beat("node-b", &["sbx-1"])).await.unwrap();
    assert!(client.heartbeat(beat("node-c", &[])).await.is_err());

    // node-c added, node-b removed while it holds sbx-1.
    let next = CONFIG.replace(
        r#"{"id": "node-b", "endpoint": "http://127.0.0.1:18002"}"#,
        r#"{"id": "node-c", "endpoint": "http://127.0.0.1:18003"}"#,
    );
    reload(&d, &next);
    let d_ref = &d;
    agentenv_testkit::eventually("the reload to apply", Duration::from_secs(15), || async {
        reloads(d_ref, "ok").await == 1
    })
    .await;
    client.heartbeat(beat("node-c", &[])).await.unwrap();
    let mut placed = std::collections::BTreeSet::new();
    for _ in 0..4 {
        let r = client.schedule(ScheduleRequest::default()).await.unwrap();
        placed.insert(r.into_inner().node.unwrap().node_id);
    }
    assert_eq!(placed, ["node-a".to_string(), "node-c".to_string()].into());
    // node-b still reports sbx-1, which stays bound to it.
    client.heartbeat(beat("node-b", &["sbx-1"])).await.unwrap();
    let owner = client
        .lookup_node(LookupNodeRequest {
            sandbox_id: "sbx-1".into(),
        })
        .await
        .unwrap();
    assert_eq!(owner.into_inner().node.unwrap().node_id, "node-b");

    // A file that does not load, and one that does not validate: nothing changes.
    for bad in [
        "{\"scheduler\": ",
        r#"{"scheduler":{"nodes":[{"id":"a","endpoint":"10.0.0.21:8000"}]}}"#,
    ] {
        let before = reloads(&d, "failed").await;
        reload(&d, bad);
        agentenv_testkit::eventually("the reload to fail", Duration::from_secs(15), || async {
            reloads(d_ref, "failed").await == before + 1
        })
        .await;
        client.heartbeat(beat("node-c", &[])).await.unwrap();
        client.heartbeat(beat("node-b", &["sbx-1"])).await.unwrap();
    }
    assert_eq!(reloads(&d, "ok").await, 1);

    // node-b's last sandbox is gone: it leaves.
    client.heartbeat(beat("node-b", &[])).await.unwrap();
    let e = client.heartbeat(beat("node-b", &[])).await.unwrap_err();
    assert_eq!(e.message(), "node is not in scheduler node list");
}
