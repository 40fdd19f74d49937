//! Lifecycle of sandboxes through the node's REST API: TTL expiry (pause or kill),
//! connect/resume, auto-resume on data-plane traffic, serialized concurrent operations,
//! and paused sandboxes that survive a node restart with their files.

mod node_common;

use std::time::Duration;

use agentenv_testkit::eventually;
use node_common::{Node, api, create, delete, request, run};

async fn state(addr: std::net::SocketAddr, id: &str) -> Option<String> {
    let r = api(addr, "GET", &format!("/sandboxes/{id}"), "").await;
    (r.status == 200).then(|| r.json()["state"].as_str().unwrap().to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timeout_pauses_by_default_and_kills_when_auto_pause_is_false() {
    require_node!();
    let home = tempfile::tempdir().unwrap();
    let node = Node::start(node_common::config(home.path(), 10)).await;
    let addr = node.addr;
    let pausing = create(addr, r#"{"templateID":"base","timeout":1}"#).await;
    let killing = create(
        addr,
        r#"{"templateID":"base","timeout":1,"autoPause":false}"#,
    )
    .await;
    let keep = create(addr, r#"{"templateID":"base","timeout":300}"#).await;
    eventually("the paused state", Duration::from_secs(10), || async {
        (state(addr, &pausing).await.as_deref() == Some("paused")).then_some(())
    })
    .await;
    eventually("the kill", Duration::from_secs(10), || async {
        state(addr, &killing).await.is_none().then_some(())
    })
    .await;
    assert_eq!(state(addr, &keep).await.as_deref(), Some("running"));
    let d = api(addr, "GET", &format!("/sandboxes/{pausing}"), "")
        .await
        .json();
    assert_eq!(d["lifecycle"]["onTimeout"], "pause");

    // POST /timeout may shorten: 1 s from now, then paused.
    let r = api(
        addr,
        "POST",
        &format!("/sandboxes/{keep}/timeout"),
        r#"{"timeout":1}"#,
    )
    .await;
    assert_eq!(r.status, 204, "{}", r.text());
    eventually("the paused state", Duration::from_secs(10), || async {
        (state(addr, &keep).await.as_deref() == Some("paused")).then_some(())
    })
    .await;
    // A paused sandbox has no timeout to set.
    let r = api(
        addr,
        "POST",
        &format!("/sandboxes/{keep}/timeout"),
        r#"{"timeout":9}"#,
    )
    .await;
    assert_eq!(r.status, 409, "{}", r.text());
    node.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_extends_a_running_sandbox_and_resumes_a_paused_one() {
    require_node!();
    let home = tempfile::tempdir().unwrap();
    let node = Node::start(node_common::config(home.path(), 11)).await;
    let addr = node.addr;
    let id = create(addr, r#"{"templateID":"base","timeout":300}"#).await;
    run(addr, &id, None, "echo kept > /tmp/k").await.unwrap();

    let r = api(addr, "POST", &format!("/v2/sandboxes/{id}/connect"), "").await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["sandboxID"], id.as_str());

    let p = api(addr, "POST", &format!("/sandboxes/{id}/pause"), "{}").await;
    assert_eq!(p.status, 204, "{}", p.text());
    // Pausing a paused sandbox succeeds.
    let p = api(addr, "POST", &format!("/sandboxes/{id}/pause"), "{}").await;
    assert_eq!(p.status, 204);

    let r = api(
        addr,
        "POST",
        &format!("/sandboxes/{id}/connect"),
        r#"{"timeout":60}"#,
    )
    .await;
    assert_eq!(r.status, 201, "{}", r.text());
    let out = run(addr, &id, None, "cat /tmp/k").await.unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "kept\n");

    // Deprecated /resume on a running sandbox only sets its timeout.
    let r = api(addr, "POST", &format!("/sandboxes/{id}/resume"), "{}").await;
    assert_eq!(r.status, 201, "{}", r.text());
    let r = api(
        addr,
        "POST",
        &format!("/sandboxes/{id}/refreshes"),
        r#"{"duration":30}"#,
    )
    .await;
    assert_eq!(r.status, 204, "{}", r.text());
    let r = api(
        addr,
        "POST",
        &format!("/sandboxes/{id}/refreshes"),
        r#"{"duration":7200}"#,
    )
    .await;
    assert_eq!(r.status, 400);
    node.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paused_sandbox_resumes_on_traffic_only_with_auto_resume() {
    require_node!();
    let home = tempfile::tempdir().unwrap();
    let node = Node::start(node_common::config(home.path(), 12)).await;
    let addr = node.addr;
    let auto = create(
        addr,
        r#"{"templateID":"base","autoResume":{"enabled":true}}"#,
    )
    .await;
    let manual = create(addr, r#"{"templateID":"base"}"#).await;
    for id in [&auto, &manual] {
        let p = api(addr, "POST", &format!("/sandboxes/{id}/pause"), "").await;
        assert_eq!(p.status, 204);
    }
    let out = run(addr, &auto, None, "echo woke").await.unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "woke\n");
    assert_eq!(state(addr, &auto).await.as_deref(), Some("running"));

    let r = request(
        addr,
        "GET",
        "/proxy/health",
        &[("e2b-sandbox-id", &manual)],
        "",
    )
    .await;
    assert_eq!(r.status, 410, "{}", r.text());
    assert!(r.json()["message"].as_str().unwrap().contains("connect"));
    assert_eq!(state(addr, &manual).await.as_deref(), Some("paused"));
    node.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_operations_on_one_sandbox_are_serialized() {
    require_node!();
    let home = tempfile::tempdir().unwrap();
    let node = Node::start(node_common::config(home.path(), 13)).await;
    let addr = node.addr;
    let id = create(addr, r#"{"templateID":"base"}"#).await;
    let mut tasks = Vec::new();
    for i in 0..8 {
        let id = id.clone();
        tasks.push(tokio::spawn(async move {
            let path = if i % 2 == 0 {
                format!("/sandboxes/{id}/pause")
            } else {
                format!("/sandboxes/{id}/connect")
            };
            api(addr, "POST", &path, "{}").await.status
        }));
    }
    for t in tasks {
        let st = t.await.unwrap();
        assert!([200, 201, 204].contains(&st), "status {st}");
    }
    // Whatever order they ran in, the sandbox is in a stable state and works when running.
    let s = state(addr, &id).await.unwrap();
    if s == "paused" {
        let r = api(addr, "POST", &format!("/sandboxes/{id}/connect"), "{}").await;
        assert_eq!(r.status, 201);
    }
    let out = run(addr, &id, None, "echo ok").await.unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "ok\n");
    // Delete racing a pause: one outcome, no leftovers.
    let (pause_path, delete_path) = (format!("/sandboxes/{id}/pause"), format!("/sandboxes/{id}"));
    let (a, b) = tokio::join!(
        api(addr, "POST", &pause_path, "{}"),
        api(addr, "DELETE", &delete_path, "")
    );
    assert_eq!(b.status, 204, "{}", b.text());
    assert!([204, 404].contains(&a.status), "{}", a.status);
    assert!(state(addr, &id).await.is_none());
    assert!(node.orch.list().is_empty());
    node.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paused_sandboxes_survive_a_node_restart() {
    require_node!();
    let home = tempfile::tempdir().unwrap();
    let node = Node::start(node_common::config(home.path(), 14)).await;
    let addr = node.addr;
    let paused = create(
        addr,
        r#"{"templateID":"base","metadata":{"k":"v"},"secure":true}"#,
    )
    .await;
    let running = create(addr, r#"{"templateID":"base"}"#).await;
    let dropped = create(addr, r#"{"templateID":"base"}"#).await;
    // Files written before the restart: in a new file, over a template file, and a
    // template file deleted.
    let out = run(
        addr,
        &running,
        None,
        "echo kept-across-restart > /root/note && echo changed > /etc/motd && rm /etc/issue && sync",
    )
    .await
    .unwrap();
    assert_eq!(out.end.as_ref().map(|e| e.exit_code), Some(0), "{out:?}");
    let p = api(addr, "POST", &format!("/sandboxes/{paused}/pause"), "").await;
    assert_eq!(p.status, 204);
    let record = home
        .path()
        .join("persisted-sandboxes")
        .join(format!("{paused}.json"));
    assert!(record.is_file(), "the paused record is on disk");
    // Graceful shutdown pauses the running one too.
    node.stop().await;
    assert!(
        home.path()
            .join("persisted-sandboxes")
            .join(format!("{running}.json"))
            .is_file()
    );

    let node = Node::start(node_common::config(home.path(), 14)).await;
    let addr = node.addr;
    let list = api(addr, "GET", "/v2/sandboxes?state=paused", "")
        .await
        .json();
    let mut ids: Vec<&str> = list
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["sandboxID"].as_str().unwrap())
        .collect();
    ids.sort();
    let mut expected = vec![paused.as_str(), running.as_str(), dropped.as_str()];
    expected.sort();
    assert_eq!(ids, expected);
    let d = api(addr, "GET", &format!("/sandboxes/{paused}"), "")
        .await
        .json();
    assert_eq!(d["metadata"]["k"], "v");

    let r = api(
        addr,
        "POST",
        &format!("/v2/sandboxes/{paused}/connect"),
        "{}",
    )
    .await;
    assert_eq!(r.status, 201, "{}", r.text());
    let token = r.json()["envdAccessToken"].as_str().unwrap().to_string();
    let out = run(addr, &paused, Some(&token), "hostname").await.unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), format!("{paused}\n"));
    assert!(!record.exists(), "a resumed sandbox has no paused record");
    let r = api(
        addr,
        "POST",
        &format!("/v2/sandboxes/{running}/connect"),
        "{}",
    )
    .await;
    assert_eq!(r.status, 201, "{}", r.text());
    let out = run(
        addr,
        &running,
        None,
        "cat /root/note /etc/motd; test -e /etc/issue && echo issue-back || echo issue-gone",
    )
    .await
    .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "kept-across-restart\nchanged\nissue-gone\n",
        "the sandbox's files survive the restart: {out:?}"
    );
    let kept_dir = home.path().join("jail").join("kept");
    assert_eq!(std::fs::read_dir(&kept_dir).unwrap().count(), 1);
    // Deleting a restored paused sandbox deletes its kept layer.
    let r = delete(addr, &dropped).await;
    assert_eq!(r.status, 204);
    let kept: Vec<_> = std::fs::read_dir(&kept_dir).unwrap().collect();
    assert!(
        kept.is_empty(),
        "resumed sandboxes own their layers, deleted ones have none: {kept:?}"
    );
    let r = delete(addr, &running).await;
    assert_eq!(r.status, 204);
    assert!(
        !home
            .path()
            .join("persisted-sandboxes")
            .join(format!("{running}.json"))
            .exists()
    );
    node.stop().await;
}

/// A test node whose token seed is the managed one (generated under its home).
fn managed_seed_config(home: &std::path::Path) -> agentenv_node::config::NodeConfig {
    let mut c = node_common::config(home, 15);
    c.token_seed = None;
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_refuses_a_new_seed_when_paused_sandboxes_exist() {
    require_node!();
    let home = tempfile::tempdir().unwrap();
    let node = Node::start(managed_seed_config(home.path())).await;
    let id = create(node.addr, r#"{"templateID":"base"}"#).await;
    node.stop().await;
    let seed = home.path().join("secrets/sandbox-access-token-hash-seed");
    assert!(seed.is_file(), "the managed seed was created");
    let kept = std::fs::read(&seed).unwrap();
    std::fs::remove_file(&seed).unwrap();
    let e = match agentenv_node::daemon::Daemon::start(managed_seed_config(home.path())).await {
        Ok(_) => panic!("start must fail without the seed"),
        Err(e) => e.to_string(),
    };
    assert!(e.contains("AENV_SANDBOX_ACCESS_TOKEN_HASH_SEED"), "{e}");
    // With the seed back, the sandbox and its token come back too.
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(&seed, &kept).unwrap();
    std::fs::set_permissions(&seed, std::fs::Permissions::from_mode(0o600)).unwrap();
    let node = Node::start(managed_seed_config(home.path())).await;
    let r = api(node.addr, "POST", &format!("/sandboxes/{id}/connect"), "{}").await;
    assert_eq!(r.status, 201, "{}", r.text());
    assert_eq!(
        r.json()["envdAccessToken"].as_str().unwrap(),
        node.orch.tokens().envd_token(&id)
    );
    node.stop().await;
}
