//! Sandbox metrics and logs through the node's REST API with real jail sandboxes: a busy
//! sandbox's samples show its CPU, memory and disk; the many-sandboxes endpoint answers
//! the latest of each; ranges and queries are checked; the logs hold the template's
//! start command output and the node's lifecycle events, filtered by level, direction
//! and search; a tenant flooding its PID 1's output cannot grow the log past its cap;
//! a deleted sandbox's metrics and logs are gone.

mod node_common;

use std::path::Path;
use std::time::Duration;

use node_common::{Node, api, create, delete, run};
use serde_json::Value;

/// A node sampling every 200 ms, its template directory holding `base` only (so a
/// template it builds is its own and goes with the test).
async fn node(home: &Path, slot: u8, log_file_bytes: Option<u64>) -> Node {
    agentenv_testkit::node::ensure_base().await;
    let mut c = node_common::config(home, slot);
    c.template_path = agentenv_testkit::node::templates_with_base(&home.join("templates"));
    c.metrics_interval = Duration::from_millis(200);
    if let Some(b) = log_file_bytes {
        c.sandbox_log_file_bytes = b;
    }
    Node::start(c).await
}

/// `GET path`, 200, its JSON.
async fn get_json(addr: std::net::SocketAddr, path: &str) -> Value {
    let r = api(addr, "GET", path, "").await;
    assert_eq!(r.status, 200, "{path}: {}", r.text());
    r.json()
}

/// Waits until `GET path` answers JSON for which `done` holds; returns it.
async fn wait_for(addr: std::net::SocketAddr, path: &str, done: impl Fn(&Value) -> bool) -> Value {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let v = get_json(addr, path).await;
        if done(&v) {
            return v;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{path} never got there: {v}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn u(v: &Value, k: &str) -> u64 {
    v[k].as_u64()
        .unwrap_or_else(|| panic!("{k} is not a number in {v}"))
}

/// Runs `script` in sandbox `id`; panics with its output unless it exits 0.
async fn sh(addr: std::net::SocketAddr, id: &str, script: &str) -> String {
    let out = run(addr, id, None, script).await.expect("run");
    assert_eq!(
        out.end.as_ref().map(|e| e.exit_code),
        Some(0),
        "{script}: {out:?}"
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_sandbox_shows_cpu_memory_and_disk_and_ranges_are_checked() {
    require_node!();
    let home = tempfile::tempdir().unwrap();
    let node = node(home.path(), 36, None).await;
    let addr = node.addr;
    let disk_mb = 10240;
    let a = create(addr, r#"{"templateID":"base","timeout":600}"#).await;
    let b = create(addr, r#"{"templateID":"base","timeout":600}"#).await;

    // Lists and the detail show the real disk size.
    let listed = get_json(addr, "/v2/sandboxes").await;
    for s in listed.as_array().unwrap() {
        assert_eq!(u(s, "diskSizeMB"), disk_mb, "{s}");
    }
    assert_eq!(
        u(
            &get_json(addr, &format!("/sandboxes/{a}")).await,
            "diskSizeMB"
        ),
        disk_mb
    );

    let path = format!("/sandboxes/{a}/metrics");
    let first = wait_for(addr, &path, |v| !v.as_array().unwrap().is_empty()).await;
    let before = first.as_array().unwrap().last().unwrap().clone();
    let disk_before = u(&before, "diskUsed");
    let since = u(&before, "timestampUnix");

    // A second of CPU and a 64 MiB file.
    sh(
        addr,
        &a,
        "timeout 1 dd if=/dev/zero of=/dev/null bs=64k || true; \
         dd if=/dev/zero of=/root/blob bs=1M count=64 2>/dev/null && sync",
    )
    .await;
    let grown = 64 << 20;
    let after = wait_for(addr, &format!("{path}?start={since}"), |v| {
        v.as_array()
            .unwrap()
            .last()
            .is_some_and(|s| u(s, "diskUsed") >= disk_before + grown - (4 << 20))
    })
    .await;
    let samples = after.as_array().unwrap();
    let busiest = samples
        .iter()
        .map(|s| s["cpuUsedPct"].as_f64().unwrap())
        .fold(0.0, f64::max);
    assert!(busiest > 10.0, "a second of dd shows: {samples:?}");
    let last = samples.last().unwrap();
    assert_eq!(u(last, "cpuCount"), 1);
    assert!(u(last, "memUsed") > 0, "{last}");
    assert_eq!(u(last, "memTotal"), 256 << 20, "{last}");
    let used = u(last, "diskUsed") - disk_before;
    assert!(
        (grown - (4 << 20)..=grown + (16 << 20)).contains(&used),
        "the disk grew by {used} bytes for a 64 MiB file"
    );
    let total = u(last, "diskTotal");
    assert!(
        total <= disk_mb << 20 && total >= (disk_mb << 20) / 100 * 90,
        "diskTotal {total} is the disk's capacity"
    );
    for w in samples.windows(2) {
        assert!(u(&w[0], "timestampUnix") <= u(&w[1], "timestampUnix"));
    }
    assert!(
        samples
            .iter()
            .all(|s| s["timestamp"].as_str().unwrap().ends_with('Z'))
    );

    // Ranges: in the future nothing; reversed or not numbers 400, and nothing changed.
    let later = since + 3600;
    assert!(
        get_json(addr, &format!("{path}?start={later}"))
            .await
            .as_array()
            .unwrap()
            .is_empty()
    );
    let count = get_json(addr, &path).await.as_array().unwrap().len();
    for bad in [
        format!("{path}?start={later}&end={since}"),
        format!("{path}?start=yesterday"),
        format!("{path}?end=1704067200000"),
    ] {
        let r = api(addr, "GET", &bad, "").await;
        assert_eq!(r.status, 400, "{bad}: {}", r.text());
        assert_eq!(r.json()["code"], 400);
        let msg = r.json()["message"].as_str().unwrap().to_string();
        assert!(
            msg.contains("unix seconds") || msg.contains("reversed"),
            "{msg}"
        );
    }
    assert!(get_json(addr, &path).await.as_array().unwrap().len() >= count);

    // Many: the latest of each id asked, unknown ids left out.
    wait_for(addr, &format!("/sandboxes/{b}/metrics"), |v| {
        !v.as_array().unwrap().is_empty()
    })
    .await;
    let unknown = "01936f8e-72f5-7000-8000-00000000dead";
    let many = get_json(
        addr,
        &format!("/sandboxes/metrics?sandbox_ids={a}%2C{b}%2C{unknown}"),
    )
    .await;
    let m = many["sandboxes"].as_object().unwrap();
    assert_eq!(m.len(), 2, "{many}");
    for id in [&a, &b] {
        let latest = get_json(addr, &format!("/sandboxes/{id}/metrics")).await;
        let newest = latest.as_array().unwrap().last().unwrap().clone();
        assert!(u(&m[id.as_str()], "timestampUnix") <= u(&newest, "timestampUnix"));
        assert_eq!(u(&m[id.as_str()], "memTotal"), 256 << 20);
    }
    let r = api(addr, "GET", "/sandboxes/metrics", "").await;
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(r.text().contains("sandbox_ids"), "{}", r.text());

    // The node reports its CPU and its data directory's file system.
    let nodes = get_json(addr, "/nodes").await;
    let metrics = &nodes[0]["metrics"];
    assert!(metrics["cpuPercent"].is_u64(), "{metrics}");
    let disks = metrics["disks"].as_array().unwrap();
    assert!(
        disks.iter().any(|d| {
            home.path().starts_with(d["mountPoint"].as_str().unwrap())
                && u(d, "totalBytes") > 0
                && !d["filesystemType"].as_str().unwrap().is_empty()
        }),
        "{disks:?}"
    );

    // A paused sandbox gets no samples.
    let r = api(addr, "POST", &format!("/sandboxes/{b}/pause"), "").await;
    assert_eq!(r.status, 204, "{}", r.text());
    let n = get_json(addr, &format!("/sandboxes/{b}/metrics"))
        .await
        .as_array()
        .unwrap()
        .len();
    // Two more samples of `a` mean at least two sampling rounds passed.
    let seen = get_json(addr, &path).await.as_array().unwrap().len();
    wait_for(addr, &path, |v| v.as_array().unwrap().len() >= seen + 2).await;
    let m = get_json(addr, &format!("/sandboxes/{b}/metrics"))
        .await
        .as_array()
        .unwrap()
        .len();
    assert_eq!(m, n, "no samples while paused");

    // A deleted sandbox's metrics and logs are gone.
    assert_eq!(delete(addr, &a).await.status, 204);
    for p in [
        format!("/sandboxes/{a}/metrics"),
        format!("/sandboxes/{a}/logs"),
        format!("/v2/sandboxes/{a}/logs"),
    ] {
        let r = api(addr, "GET", &p, "").await;
        assert_eq!(r.status, 404, "{p}: {}", r.text());
        assert_eq!(r.json()["code"], 404);
    }
    let many = get_json(addr, &format!("/sandboxes/metrics?sandbox_ids={a}")).await;
    assert!(many["sandboxes"].as_object().unwrap().is_empty(), "{many}");
    assert!(!home.path().join("sandbox-logs").join(&a).exists());
    assert_eq!(delete(addr, &b).await.status, 204);
    node.stop().await;
}

/// Builds template `name` from `base` with `start_cmd`; waits for it.
async fn build_with_start(addr: std::net::SocketAddr, name: &str, start_cmd: &str) {
    let body = serde_json::json!({
        "fromTemplate": "base",
        "steps": [{"type": "RUN", "args": ["true"], "force": false}],
        "startCmd": start_cmd,
    });
    let status = node_common::build_template(addr, name, &body).await;
    assert_eq!(status["status"], "ready", "{status}");
}

fn messages(v: &Value) -> Vec<String> {
    v["logs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["message"].as_str().unwrap().to_string())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logs_hold_the_start_commands_output_and_filter_by_level_direction_and_search() {
    require_node!();
    let home = tempfile::tempdir().unwrap();
    let node = node(home.path(), 37, None).await;
    let addr = node.addr;
    // The last line comes once the create has returned: the output is read on.
    build_with_start(
        addr,
        "observed",
        "echo out-mark; echo err-mark >&2; while [ ! -e /tmp/go ]; do sleep 0.05; done; echo late-mark; exec sleep 3600",
    )
    .await;
    let id = create(addr, r#"{"templateID":"observed","timeout":600}"#).await;
    sh(addr, &id, "touch /tmp/go").await;
    let path = format!("/v2/sandboxes/{id}/logs");
    let all = wait_for(addr, &path, |v| {
        messages(v).iter().any(|m| m == "late-mark")
    })
    .await;
    let entries = all["logs"].as_array().unwrap();
    let find = |m: &str| {
        entries
            .iter()
            .find(|e| e["message"] == m)
            .unwrap_or_else(|| panic!("{m} in {entries:?}"))
            .clone()
    };
    let out = find("out-mark");
    assert_eq!(out["level"], "info");
    assert_eq!(out["fields"]["source"], "start-cmd");
    assert_eq!(out["fields"]["stream"], "stdout");
    let err = find("err-mark");
    assert_eq!(err["level"], "error");
    assert_eq!(err["fields"]["stream"], "stderr");
    let created = find("sandbox created");
    assert_eq!(created["fields"]["source"], "node");
    assert!(
        entries.iter().any(|e| e["fields"]["source"] == "agent"),
        "the agent's own output: {entries:?}"
    );
    for e in entries {
        for k in ["timestamp", "message", "level", "fields"] {
            assert!(!e[k].is_null(), "{k} in {e}");
        }
    }

    // Level: at or above.
    let errors = get_json(addr, &format!("{path}?level=error")).await;
    assert!(messages(&errors).contains(&"err-mark".to_string()));
    assert!(
        errors["logs"]
            .as_array()
            .unwrap()
            .iter()
            .all(|e| e["level"] == "error"),
        "{errors}"
    );
    let warn = get_json(addr, &format!("{path}?level=warn")).await;
    assert!(
        !messages(&warn).contains(&"out-mark".to_string()),
        "info is below warn: {warn}"
    );

    // Direction and cursor: forward is oldest first from the cursor, backward newest
    // first up to it.
    let ts = |v: &Value| -> Vec<u64> {
        v["logs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| agentenv_node::clock::rfc3339_ms(e["timestamp"].as_str().unwrap()).unwrap())
            .collect()
    };
    let fwd = ts(&all);
    assert!(fwd.windows(2).all(|w| w[0] <= w[1]), "{fwd:?}");
    let back = get_json(addr, &format!("{path}?direction=backward")).await;
    let bts = ts(&back);
    assert!(bts.windows(2).all(|w| w[0] >= w[1]), "{bts:?}");
    assert_eq!(bts.len(), fwd.len());
    let newest = get_json(addr, &format!("{path}?direction=backward&limit=1")).await;
    assert_eq!(ts(&newest), [*fwd.last().unwrap()]);
    let late_ts = ts(&get_json(addr, &format!("{path}?search=late-mark")).await);
    assert_eq!(late_ts.len(), 1);
    let from_late = get_json(addr, &format!("{path}?cursor={}", late_ts[0])).await;
    assert!(ts(&from_late).iter().all(|t| *t >= late_ts[0]));
    assert!(!messages(&from_late).contains(&"out-mark".to_string()));
    let upto = get_json(
        addr,
        &format!("{path}?cursor={}&direction=backward", late_ts[0] - 1),
    )
    .await;
    assert!(!messages(&upto).contains(&"late-mark".to_string()));
    assert!(messages(&upto).contains(&"out-mark".to_string()));

    // v1: lines and entries.
    let v1 = get_json(addr, &format!("/sandboxes/{id}/logs")).await;
    let lines = v1["logs"].as_array().unwrap();
    assert_eq!(lines.len(), v1["logEntries"].as_array().unwrap().len());
    assert!(
        lines
            .iter()
            .any(|l| l["line"] == "out-mark" && l["timestamp"].is_string())
    );

    // Bad queries: 400 naming the fix.
    for (q, want) in [
        ("level=loud", "use debug, info, warn or error"),
        ("direction=up", "use forward or backward"),
        ("limit=5000", "use 0 to 1000"),
        ("cursor=soon", "milliseconds"),
    ] {
        let r = api(addr, "GET", &format!("{path}?{q}"), "").await;
        assert_eq!(r.status, 400, "{q}: {}", r.text());
        assert!(r.text().contains(want), "{q}: {}", r.text());
    }

    // Pause and resume are logged.
    assert_eq!(
        api(addr, "POST", &format!("/sandboxes/{id}/pause"), "")
            .await
            .status,
        204
    );
    let r = api(addr, "POST", &format!("/sandboxes/{id}/resume"), "{}").await;
    assert_eq!(r.status, 201, "{}", r.text());
    let events: Vec<String> = get_json(addr, &path).await["logs"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["fields"]["source"] == "node")
        .map(|e| e["message"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(
        events,
        ["sandbox created", "sandbox paused", "sandbox resumed"],
        "{events:?}"
    );

    assert_eq!(delete(addr, &id).await.status, 204);
    assert_eq!(api(addr, "GET", &path, "").await.status, 404);
    assert!(!home.path().join("sandbox-logs").join(&id).exists());
    node.stop().await;
}

/// PID 1 of sandbox `id` on the host, from its state file.
fn host_pid1(home: &Path, id: &str) -> i32 {
    let state = home
        .join("jail")
        .join("sandboxes")
        .join(id)
        .join("state.json");
    let v: Value = serde_json::from_slice(&std::fs::read(&state).unwrap()).unwrap();
    v["pid"].as_i64().unwrap() as i32
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_flooding_pid1s_output_cannot_grow_the_log_past_its_cap() {
    require_node!();
    let home = tempfile::tempdir().unwrap();
    let cap = agentenv_node::observe::logbook::MIN_FILE_BYTES;
    let node = node(home.path(), 38, Some(cap)).await;
    let addr = node.addr;
    let id = create(addr, r#"{"templateID":"base","timeout":600}"#).await;

    // From inside: root tries PID 1's descriptors (the agent keeps them from the
    // sandbox's processes; if a write got through, the budget below holds it too).
    let inside = run(
        addr,
        &id,
        None,
        "head -c 2000000 /dev/zero | tr '\\0' 'A' > /proc/1/fd/1 && echo wrote || echo refused",
    )
    .await
    .expect("run");
    let inside = String::from_utf8_lossy(&inside.stdout).into_owned();

    // What a tenant holding the pipe can send: 4 MiB of long lines, escapes, invalid
    // UTF-8 and control characters, written into PID 1's stdout from the host.
    let pid = host_pid1(home.path(), &id);
    let flood = tokio::task::spawn_blocking(move || {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .open(format!("/proc/{pid}/fd/1"))
            .expect("PID 1's stdout");
        let mut chunk = Vec::new();
        chunk.extend_from_slice(b"\x1b[31mred\x1b[0m \x1b]0;title\x07 \xff\xfe\x00\x08bell\x07\n");
        chunk.extend_from_slice(&[b'L'; 300_000]);
        chunk.extend_from_slice(b"\n");
        let mut sent = 0;
        while sent < 4 << 20 {
            f.write_all(&chunk).unwrap();
            sent += chunk.len();
        }
        sent
    })
    .await
    .unwrap();
    assert!(flood >= 4 << 20);

    // The sandbox still works; once the budget refills, a line after the flood gets
    // through, after the entry counting what was dropped.
    sh(addr, &id, "true").await;
    let path = format!("/v2/sandboxes/{id}/logs");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let v = loop {
        let line = format!("/proc/{pid}/fd/1");
        tokio::task::spawn_blocking(move || {
            use std::io::Write;
            let mut f = std::fs::OpenOptions::new().write(true).open(line).unwrap();
            f.write_all(b"after-flood\n").unwrap();
        })
        .await
        .unwrap();
        let v = get_json(addr, &path).await;
        let m = messages(&v);
        if m.iter().any(|m| m.contains("of output dropped")) && m.iter().any(|m| m == "after-flood")
        {
            break v;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no line after the flood: {m:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let logs = home.path().join("sandbox-logs").join(&id);
    let on_disk: u64 = std::fs::read_dir(&logs)
        .unwrap()
        .flatten()
        .map(|e| e.metadata().unwrap().len())
        .sum();
    assert!(
        on_disk <= 2 * cap,
        "the log takes {on_disk} bytes for a cap of {cap} per file"
    );
    let entries = v["logs"].as_array().unwrap();
    for e in entries {
        let m = e["message"].as_str().unwrap();
        assert!(m.len() <= 4096, "a line of {} bytes", m.len());
        assert!(
            !m.chars().any(|c| c.is_control()),
            "control characters got through: {m:?}"
        );
    }
    assert!(
        entries
            .iter()
            .any(|e| e["message"] == "red  \u{fffd}\u{fffd}bell"),
        "escapes and controls removed, bad UTF-8 replaced: {:?}",
        messages(&v)
            .iter()
            .filter(|m| m.contains("bell"))
            .collect::<Vec<_>>()
    );
    assert_eq!(
        inside.trim(),
        "refused",
        "root inside reaches PID 1's descriptors only if it can ptrace it"
    );
    assert_eq!(delete(addr, &id).await.status, 204);
    assert!(!logs.exists());
    node.stop().await;
}
