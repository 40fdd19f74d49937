//! Moving a paused sandbox between two nodes that share a snapshot repository, through
//! the nodes' REST API, with real jail sandboxes: export on one, import on the other,
//! the files and settings follow, the sandbox keeps its id, and what the importing node
//! trusts comes from the signed snapshot record.

mod node_common;

use std::path::Path;

use agentenv_core::storage::StorageConfig;
use agentenv_node::config::NodeConfig;
use node_common::{Node, api, create, delete, sh_ok};

fn config_on(home: &Path, slot: u8, store: &Path) -> NodeConfig {
    let mut c = node_common::config(home, slot);
    c.snapshot_repository = StorageConfig::Fs {
        root: store.join("repository"),
    };
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_sandbox_moves_to_another_node_with_its_files_and_settings() {
    require_node!();
    let store = tempfile::tempdir().unwrap();
    let (home_a, home_b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let a = Node::start(config_on(home_a.path(), 60, store.path())).await;
    let b = Node::start(config_on(home_b.path(), 61, store.path())).await;
    let id = create(
        a.addr,
        r#"{"templateID":"base","timeout":300,"metadata":{"team":"blue"},"envVars":{"FROM":"a"},"autoPause":true}"#,
    )
    .await;
    sh_ok(
        a.addr,
        &id,
        "mkdir -p /srv && echo moved-data > /srv/data.txt && chown 1000:1000 /srv/data.txt && ln -s /etc/passwd /srv/link",
    )
    .await;

    // Running: refused, the sandbox untouched.
    let r = api(a.addr, "POST", &format!("/sandboxes/{id}/export"), "").await;
    assert_eq!(r.status, 409, "{}", r.text());
    assert!(r.text().contains("needs it paused"), "{}", r.text());
    assert_eq!(sh_ok(a.addr, &id, "cat /srv/data.txt").await, "moved-data");

    let r = api(a.addr, "POST", &format!("/sandboxes/{id}/pause"), "").await;
    assert_eq!(r.status, 204, "{}", r.text());
    let r = api(a.addr, "POST", &format!("/sandboxes/{id}/export"), "").await;
    assert_eq!(r.status, 201, "{}", r.text());
    let export = r.json();
    let snapshot = export["snapshotID"].as_str().unwrap().to_string();
    assert_eq!(export["sandbox"]["id"], id.as_str());

    // While it moves, the first node neither resumes it nor reports it in its roster.
    let r = api(a.addr, "POST", &format!("/sandboxes/{id}/resume"), "").await;
    assert_eq!(r.status, 409, "{}", r.text());
    use agentenv_node::reporter::NodeSource;
    let roster = agentenv_node::lifecycle::ReporterSource(a.orch.clone()).sandbox_ids();
    assert!(!roster.contains(&id), "{roster:?}");
    let r = api(a.addr, "GET", &format!("/sandboxes/{id}"), "").await;
    assert_eq!(r.json()["state"], "paused");

    // An export under another id is refused; so is a tampered template or environment:
    // the signed snapshot record wins.
    let mut tampered = export.clone();
    tampered["sandbox"]["template"] = "not-base".into();
    tampered["sandbox"]["envVars"] = serde_json::json!({"FROM": "tampered"});
    let other = "00000000-0000-4000-8000-000000000001";
    let r = api(
        b.addr,
        "POST",
        &format!("/sandboxes/{other}/import"),
        &tampered.to_string(),
    )
    .await;
    assert_eq!(r.status, 400, "{}", r.text());
    let mut wrong_snapshot = tampered.clone();
    wrong_snapshot["sandbox"]["id"] = other.into();
    let r = api(
        b.addr,
        "POST",
        &format!("/sandboxes/{other}/import"),
        &wrong_snapshot.to_string(),
    )
    .await;
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(r.text().contains("not"), "{}", r.text());

    let r = api(
        b.addr,
        "POST",
        &format!("/sandboxes/{id}/import"),
        &tampered.to_string(),
    )
    .await;
    assert_eq!(r.status, 201, "{}", r.text());
    assert_eq!(r.json()["sandboxID"], id.as_str());
    let d = api(b.addr, "GET", &format!("/sandboxes/{id}"), "")
        .await
        .json();
    assert_eq!(d["state"], "paused", "{d}");
    assert_eq!(d["pauseMode"], "filesystem", "{d}");
    assert_eq!(d["templateID"], "base");
    assert_eq!(d["metadata"]["team"], "blue");
    // Twice: it is there already.
    let r = api(
        b.addr,
        "POST",
        &format!("/sandboxes/{id}/import"),
        &export.to_string(),
    )
    .await;
    assert_eq!(r.status, 409, "{}", r.text());

    // The first node lets it go; the second resumes it on its files.
    assert_eq!(delete(a.addr, &id).await.status, 204);
    let r = api(b.addr, "POST", &format!("/sandboxes/{id}/resume"), "").await;
    assert_eq!(r.status, 201, "{}", r.text());
    assert_eq!(sh_ok(b.addr, &id, "cat /srv/data.txt").await, "moved-data");
    assert_eq!(sh_ok(b.addr, &id, "stat -c %u /srv/data.txt").await, "1000");
    assert_eq!(
        sh_ok(b.addr, &id, "readlink /srv/link").await,
        "/etc/passwd"
    );
    assert_eq!(sh_ok(b.addr, &id, "echo $FROM").await, "a");
    assert_eq!(sh_ok(b.addr, &id, "cat /etc/hostname").await, id);
    let roster = agentenv_node::lifecycle::ReporterSource(b.orch.clone()).sandbox_ids();
    assert!(roster.contains(&id), "{roster:?}");

    // The snapshot that carried it can go now.
    let r = api(b.addr, "DELETE", &format!("/templates/{snapshot}"), "").await;
    assert!(r.status == 204 || r.status == 200, "{}", r.text());
    assert_eq!(delete(b.addr, &id).await.status, 204);
    a.stop().await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_move_leaves_the_sandbox_where_it_was() {
    require_node!();
    let store = tempfile::tempdir().unwrap();
    let home = tempfile::tempdir().unwrap();
    let a = Node::start(config_on(home.path(), 62, store.path())).await;
    let id = create(a.addr, r#"{"templateID":"base","timeout":300}"#).await;
    sh_ok(a.addr, &id, "echo stays > /root/f").await;
    let r = api(a.addr, "POST", &format!("/sandboxes/{id}/pause"), "").await;
    assert_eq!(r.status, 204, "{}", r.text());
    let r = api(a.addr, "POST", &format!("/sandboxes/{id}/export"), "").await;
    assert_eq!(r.status, 201, "{}", r.text());
    // Cancelling twice: the second finds nothing moving.
    let r = api(a.addr, "DELETE", &format!("/sandboxes/{id}/export"), "").await;
    assert_eq!(r.status, 200, "{}", r.text());
    let r = api(a.addr, "DELETE", &format!("/sandboxes/{id}/export"), "").await;
    assert_eq!(r.status, 409, "{}", r.text());
    use agentenv_node::reporter::NodeSource;
    let roster = agentenv_node::lifecycle::ReporterSource(a.orch.clone()).sandbox_ids();
    assert!(roster.contains(&id), "{roster:?}");
    let r = api(a.addr, "POST", &format!("/sandboxes/{id}/resume"), "").await;
    assert_eq!(r.status, 201, "{}", r.text());
    assert_eq!(sh_ok(a.addr, &id, "cat /root/f").await, "stays");
    assert_eq!(delete(a.addr, &id).await.status, 204);
    a.stop().await;
}
