//! Forks, pauses that keep files only, and idempotent creates through the node's REST API,
//! with real jail sandboxes.

mod node_common;

use std::time::Duration;

use agentenv_testkit::eventually;
use node_common::{Node, api, create, request, sh_ok};

async fn detail(addr: std::net::SocketAddr, id: &str) -> serde_json::Value {
    let r = api(addr, "GET", &format!("/sandboxes/{id}"), "").await;
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forks_start_with_the_source_files_and_the_source_runs_on_unchanged() {
    require_node!();
    let home = tempfile::tempdir().unwrap();
    let node = Node::start(node_common::config(home.path(), 56)).await;
    let addr = node.addr;
    let source = create(
        addr,
        r#"{"templateID":"base","timeout":300,"metadata":{"team":"a"},"envVars":{"FROM":"source"}}"#,
    )
    .await;
    sh_ok(
        addr,
        &source,
        "echo one > /root/a.txt && head -c 8388608 /dev/urandom > /root/big && sha256sum /root/big | cut -c1-64 > /root/big.sum; (sleep 300 >/dev/null 2>&1 &)",
    )
    .await;
    let sum = sh_ok(addr, &source, "cat /root/big.sum").await;
    let before = detail(addr, &source).await;

    let r = api(
        addr,
        "POST",
        &format!("/sandboxes/{source}/fork"),
        r#"{"count":2,"timeout":120}"#,
    )
    .await;
    assert_eq!(r.status, 201, "{}", r.text());
    let forks: Vec<String> = r
        .json()
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            assert!(e.get("error").is_none(), "{e}");
            e["sandbox"]["sandboxID"].as_str().unwrap().to_string()
        })
        .collect();
    assert_eq!(forks.len(), 2);
    assert_ne!(forks[0], forks[1]);
    for f in &forks {
        assert_ne!(f, &source);
        assert_eq!(sh_ok(addr, f, "cat /root/a.txt").await, "one");
        assert_eq!(
            sh_ok(addr, f, "sha256sum /root/big | cut -c1-64").await,
            sum
        );
        // Files as root inside, in the fork's own id range; a fresh process tree.
        assert_eq!(sh_ok(addr, f, "stat -c %u /root/a.txt").await, "0");
        assert_eq!(sh_ok(addr, f, "pgrep -x sleep | wc -l").await, "0");
        assert_eq!(sh_ok(addr, f, "cat /etc/hostname").await, *f);
        assert_eq!(sh_ok(addr, f, "echo $FROM").await, "source");
        let d = detail(addr, f).await;
        assert_eq!(d["state"], "running");
        assert_eq!(d["metadata"]["team"], "a");
        assert_eq!(d["templateID"], before["templateID"]);
    }
    // Forks are their own: writes stay in each.
    sh_ok(addr, &forks[0], "echo fork0 > /root/a.txt").await;
    assert_eq!(sh_ok(addr, &forks[1], "cat /root/a.txt").await, "one");
    assert_eq!(sh_ok(addr, &source, "cat /root/a.txt").await, "one");
    // The source runs on, its processes and timeout untouched.
    let after = detail(addr, &source).await;
    assert_eq!(after["state"], "running");
    assert_eq!(after["endAt"], before["endAt"]);
    assert_eq!(sh_ok(addr, &source, "pgrep -x sleep | wc -l").await, "1");
    sh_ok(addr, &source, "echo two >> /root/a.txt").await;

    // A paused sandbox is not forked; nothing else changes.
    let r = api(addr, "POST", &format!("/sandboxes/{source}/pause"), "").await;
    assert_eq!(r.status, 204, "{}", r.text());
    let r = api(addr, "POST", &format!("/sandboxes/{source}/fork"), "{}").await;
    assert_eq!(r.status, 409, "{}", r.text());
    assert!(r.text().contains("fork needs it running"), "{}", r.text());
    for (body, needle) in [
        (r#"{"count":0}"#, "count must be between 1 and 20"),
        (r#"{"count":21}"#, "count must be between 1 and 20"),
        (r#"{"count":"two"}"#, "count"),
    ] {
        let r = api(addr, "POST", &format!("/sandboxes/{}/fork", forks[0]), body).await;
        assert_eq!(r.status, 400, "{body}: {}", r.text());
        assert!(r.text().contains(needle), "{body}: {}", r.text());
    }
    let listed = api(addr, "GET", "/v2/sandboxes", "").await.json();
    assert_eq!(listed.as_array().unwrap().len(), 3, "{listed}");
    node.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn links_the_source_planted_never_make_the_node_write_outside_a_forks_layer() {
    require_node!();
    let home = tempfile::tempdir().unwrap();
    let node = Node::start(node_common::config(home.path(), 59)).await;
    let addr = node.addr;
    // A host file the links point at, through paths that lead out of the layer when the
    // node follows them on the host.
    let victim = home.path().join("victim");
    std::fs::write(&victim, b"host file").unwrap();
    let victim_s = victim.display().to_string();
    let source = create(addr, r#"{"templateID":"base","timeout":300}"#).await;
    sh_ok(
        addr,
        &source,
        &format!(
            "rm -f /etc/hostname /etc/hosts && ln -s {victim_s} /etc/hostname && ln -s /proc/1/root{victim_s} /etc/hosts && ln -sfn / /etc/resolv.conf"
        ),
    )
    .await;
    let r = api(addr, "POST", &format!("/sandboxes/{source}/fork"), "{}").await;
    assert_eq!(r.status, 201, "{}", r.text());
    let fork = r.json()[0]["sandbox"]["sandboxID"]
        .as_str()
        .unwrap_or_else(|| panic!("{}", r.text()))
        .to_string();
    assert_eq!(std::fs::read(&victim).unwrap(), b"host file");
    // The node replaced the links with its own files, inside the fork.
    assert_eq!(sh_ok(addr, &fork, "cat /etc/hostname").await, fork);
    assert_eq!(
        sh_ok(
            addr,
            &fork,
            "test -L /etc/hostname || test -L /etc/hosts && echo link || echo file"
        )
        .await,
        "file"
    );
    assert!(sh_ok(addr, &fork, "cat /etc/hosts").await.contains(&fork));
    node.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pause_without_memory_keeps_the_files_and_the_sandbox_starts_afresh() {
    require_node!();
    let home = tempfile::tempdir().unwrap();
    let node = Node::start(node_common::config(home.path(), 57)).await;
    let addr = node.addr;
    let id = create(addr, r#"{"templateID":"base","timeout":300}"#).await;
    sh_ok(
        addr,
        &id,
        "echo kept > /root/f; (sleep 300 >/dev/null 2>&1 &)",
    )
    .await;
    let r = api(
        addr,
        "POST",
        &format!("/sandboxes/{id}/pause"),
        r#"{"memory":false}"#,
    )
    .await;
    assert_eq!(r.status, 204, "{}", r.text());
    let d = detail(addr, &id).await;
    assert_eq!(d["state"], "paused");
    assert_eq!(d["pauseMode"], "filesystem");
    // Paused at its end: `endAt` is the moment of the pause, not a century away.
    let end = d["endAt"].as_str().unwrap();
    assert!(end.starts_with("20"), "{end}");
    assert!(end < "2100", "{end}");
    let r = api(
        addr,
        "POST",
        &format!("/v2/sandboxes/{id}/connect"),
        r#"{"timeout":60}"#,
    )
    .await;
    assert_eq!(r.status, 201, "{}", r.text());
    assert_eq!(sh_ok(addr, &id, "cat /root/f").await, "kept");
    assert_eq!(sh_ok(addr, &id, "pgrep -x sleep | wc -l").await, "0");
    assert!(detail(addr, &id).await.get("pauseMode").is_none());

    // A full pause keeps the processes; a resume with `memory: false` drops them.
    sh_ok(addr, &id, "(sleep 300 >/dev/null 2>&1 &)").await;
    let r = api(addr, "POST", &format!("/sandboxes/{id}/pause"), "{}").await;
    assert_eq!(r.status, 204, "{}", r.text());
    assert_eq!(detail(addr, &id).await["pauseMode"], "full");
    let r = api(
        addr,
        "POST",
        &format!("/sandboxes/{id}/resume"),
        r#"{"memory":false}"#,
    )
    .await;
    assert_eq!(r.status, 201, "{}", r.text());
    assert_eq!(sh_ok(addr, &id, "pgrep -x sleep | wc -l").await, "0");
    assert_eq!(sh_ok(addr, &id, "cat /root/f").await, "kept");

    // On timeout with autoPauseMemory false: a filesystem pause, never resumed by traffic.
    let fs = create(
        addr,
        r#"{"templateID":"base","timeout":1,"autoPauseMemory":false,"autoResume":{"enabled":false}}"#,
    )
    .await;
    eventually("the filesystem pause", Duration::from_secs(15), || async {
        let d = detail(addr, &fs).await;
        (d["state"] == "paused" && d["pauseMode"] == "filesystem").then_some(())
    })
    .await;
    node.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_create_retried_with_its_idempotency_key_gets_the_same_sandbox() {
    require_node!();
    let home = tempfile::tempdir().unwrap();
    let node = Node::start(node_common::config(home.path(), 58)).await;
    let addr = node.addr;
    let body = r#"{"templateID":"base","timeout":300,"metadata":{"n":"1"}}"#;
    let with_key = |key: &'static str, body: &'static str| async move {
        request(
            addr,
            "POST",
            "/v2/sandboxes",
            &[
                ("x-api-key", node_common::API_KEY),
                ("content-type", "application/json"),
                ("idempotency-key", key),
            ],
            body,
        )
        .await
    };
    // Two at once and one after: one sandbox.
    let (a, b) = tokio::join!(with_key("key-1", body), with_key("key-1", body));
    let c = with_key(
        "key-1",
        r#"{ "metadata": {"n":"1"}, "timeout":300, "templateID":"base" }"#,
    )
    .await;
    for r in [&a, &b, &c] {
        assert_eq!(r.status, 201, "{}", r.text());
    }
    let id = a.json()["sandboxID"].as_str().unwrap().to_string();
    assert_eq!(b.json()["sandboxID"], id.as_str());
    assert_eq!(c.json()["sandboxID"], id.as_str());
    assert_eq!(id, agentenv_core::idempotency::sandbox_id("key-1"));
    assert_eq!(c.headers.get("idempotent-replayed").unwrap(), "true");
    let listed = api(addr, "GET", "/v2/sandboxes", "").await.json();
    assert_eq!(listed.as_array().unwrap().len(), 1, "{listed}");

    // The same key with another request: refused, nothing made.
    let r = with_key("key-1", r#"{"templateID":"base","timeout":30}"#).await;
    assert_eq!(r.status, 409, "{}", r.text());
    assert_eq!(r.json()["error_code"], "idempotency_request_mismatch");
    // A failed create frees its key: the retry runs.
    let r = with_key("key-2", r#"{"templateID":"no-such-template"}"#).await;
    assert_eq!(r.status, 400, "{}", r.text());
    let r = with_key("key-2", r#"{"templateID":"no-such-template"}"#).await;
    assert_eq!(r.status, 400, "{}", r.text());
    let r = with_key("bad key", body).await;
    assert_eq!(r.status, 400, "{}", r.text());
    let listed = api(addr, "GET", "/v2/sandboxes", "").await.json();
    assert_eq!(listed.as_array().unwrap().len(), 1, "{listed}");
    node.stop().await;
}
