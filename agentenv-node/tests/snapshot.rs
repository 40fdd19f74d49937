//! Snapshots through the node's REST API, with real jail sandboxes: a snapshot keeps the
//! sandbox's files (written, changed and deleted ones), the source keeps running, new
//! sandboxes start from the snapshot by id and by name, names are unique, listing pages,
//! and deleting makes the snapshot unusable with a clear message.

mod node_common;

use std::time::Duration;

use agentenv_testkit::eventually;
use node_common::{Node, api, create, create_from, delete, run, snapshot};

async fn state(addr: std::net::SocketAddr, id: &str) -> Option<String> {
    let r = api(addr, "GET", &format!("/sandboxes/{id}"), "").await;
    (r.status == 200).then(|| r.json()["state"].as_str().unwrap().to_string())
}

async fn read(addr: std::net::SocketAddr, id: &str, script: &str) -> String {
    let out = run(addr, id, None, script).await.expect("run in sandbox");
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_keeps_the_files_and_new_sandboxes_start_from_it_by_id_and_by_name() {
    require_node!();
    let home = tempfile::tempdir().unwrap();
    let node = Node::start(node_common::config(home.path(), 50)).await;
    let addr = node.addr;
    let src = create(
        addr,
        r#"{"templateID":"base","timeout":300,"envVars":{"SNAP_ENV":"from-source"}}"#,
    )
    .await;
    run(
        addr,
        &src,
        None,
        "mkdir -p /srv/app && echo hello-snapshot > /srv/app/data.txt && chmod 600 /srv/app/data.txt && rm /etc/issue",
    )
    .await
    .unwrap();

    let r = snapshot(addr, &src, r#"{"name":"snap-web"}"#).await;
    assert_eq!(r.status, 201, "{}", r.text());
    let info = r.json();
    let snap = info["snapshotID"].as_str().unwrap().to_string();
    assert_eq!(info["names"], serde_json::json!(["snap-web"]));
    assert_eq!(info["cpuCount"], 1);
    assert_eq!(info["memoryMB"], 256);
    assert!(info["createdAt"].as_str().unwrap().ends_with('Z'));
    // The repository is the node's default posix_fs store.
    let store = home.path().join("snapshot-store/repository");
    assert!(store.join(format!("catalog/records/{snap}.json")).is_file());
    assert!(store.join("catalog/aliases/snap-web").is_file());
    assert!(
        store
            .join(format!("snapshots/{snap}/layer.tar.zst"))
            .is_file()
    );

    // The source keeps running, with its files.
    assert_eq!(state(addr, &src).await.as_deref(), Some("running"));
    assert_eq!(
        read(addr, &src, "cat /srv/app/data.txt").await,
        "hello-snapshot"
    );
    run(addr, &src, None, "echo after > /srv/app/later.txt")
        .await
        .unwrap();

    // From the id: the files (and the deletion) come back, the environment too.
    let r = api(
        addr,
        "POST",
        "/v2/sandboxes",
        &format!(r#"{{"templateID":"{snap}","timeout":300}}"#),
    )
    .await;
    assert_eq!(r.status, 201, "{}", r.text());
    assert_eq!(r.json()["templateID"], snap.as_str());
    assert_eq!(r.json()["alias"], "snap-web");
    let by_id = r.json()["sandboxID"].as_str().unwrap().to_string();
    assert_eq!(
        read(addr, &by_id, "cat /srv/app/data.txt").await,
        "hello-snapshot"
    );
    assert_eq!(
        read(addr, &by_id, "stat -c %a /srv/app/data.txt").await,
        "600"
    );
    assert_eq!(
        read(
            addr,
            &by_id,
            "test -e /etc/issue && echo present || echo gone"
        )
        .await,
        "gone"
    );
    assert_eq!(
        read(
            addr,
            &by_id,
            "test -e /srv/app/later.txt && echo present || echo absent"
        )
        .await,
        "absent",
        "a file written after the snapshot is not in it"
    );
    assert_eq!(read(addr, &by_id, "echo $SNAP_ENV").await, "from-source");
    assert_eq!(read(addr, &by_id, "hostname").await, by_id);
    let d = api(addr, "GET", &format!("/sandboxes/{by_id}"), "")
        .await
        .json();
    assert_eq!(d["templateID"], snap.as_str());
    assert_eq!(d["cpuCount"], 1);

    // From the name (v1 path), with the create's environment over the snapshot's.
    let by_name = {
        let r = api(
            addr,
            "POST",
            "/sandboxes",
            r#"{"templateID":"snap-web","timeout":300,"envVars":{"SNAP_ENV":"override"}}"#,
        )
        .await;
        assert_eq!(r.status, 201, "{}", r.text());
        r.json()["sandboxID"].as_str().unwrap().to_string()
    };
    assert_eq!(
        read(addr, &by_name, "cat /srv/app/data.txt").await,
        "hello-snapshot"
    );
    assert_eq!(read(addr, &by_name, "echo $SNAP_ENV").await, "override");
    // Sandboxes from one snapshot do not share files.
    run(addr, &by_name, None, "echo mine > /srv/app/data.txt")
        .await
        .unwrap();
    assert_eq!(
        read(addr, &by_id, "cat /srv/app/data.txt").await,
        "hello-snapshot"
    );

    // A name bound to a live snapshot is refused; so are bad names and unknown sandboxes.
    let r = snapshot(addr, &src, r#"{"name":"snap-web"}"#).await;
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(
        r.json()["message"]
            .as_str()
            .unwrap()
            .contains("already bound"),
        "{}",
        r.text()
    );
    let r = snapshot(addr, &src, r#"{"name":"no spaces"}"#).await;
    assert_eq!(r.status, 400, "{}", r.text());
    let r = api(
        addr,
        "POST",
        "/sandboxes/01936f8e-72f5-7000-8000-00000000beef/snapshots",
        "",
    )
    .await;
    assert_eq!(r.status, 404, "{}", r.text());
    let r = api(
        addr,
        "GET",
        "/snapshots/01936f8e-72f5-7000-8000-00000000beef",
        "",
    )
    .await;
    assert_eq!(r.status, 404, "{}", r.text());

    // Listing, newest first, in pages.
    let r = snapshot(addr, &src, "").await;
    assert_eq!(r.status, 201, "{}", r.text());
    let unnamed = r.json()["snapshotID"].as_str().unwrap().to_string();
    assert_eq!(r.json()["names"], serde_json::json!([]));
    let r = api(addr, "GET", "/snapshots", "").await;
    assert_eq!(r.status, 200);
    let ids: Vec<String> = r
        .json()
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["snapshotID"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(ids, [unnamed.clone(), snap.clone()]);
    let r = api(addr, "GET", "/snapshots?limit=1", "").await;
    assert_eq!(r.json()[0]["snapshotID"], unnamed.as_str());
    let token = r
        .headers
        .get("x-next-token")
        .unwrap()
        .to_str()
        .unwrap()
        .to_string();
    let r = api(
        addr,
        "GET",
        &format!("/snapshots?limit=1&nextToken={token}"),
        "",
    )
    .await;
    assert_eq!(r.json()[0]["snapshotID"], snap.as_str());
    assert!(r.headers.get("x-next-token").is_none());
    let r = api(addr, "GET", "/snapshots/snap-web", "").await;
    assert_eq!(r.json()["snapshotID"], snap.as_str());
    // Filtered by the source sandbox.
    let r = api(addr, "GET", &format!("/snapshots?sandboxID={src}"), "").await;
    assert_eq!(r.json().as_array().unwrap().len(), 2);
    let r = api(addr, "GET", &format!("/snapshots?sandboxID={by_id}"), "").await;
    assert_eq!(r.json(), serde_json::json!([]));
    // Names resolve like template aliases (what `aenv template delete NAME` asks).
    let r = api(addr, "GET", "/templates/aliases/snap-web", "").await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(
        r.json(),
        serde_json::json!({"templateID": snap, "public": false})
    );
    let r = api(addr, "GET", "/templates/aliases/nothing-here", "").await;
    assert_eq!(r.status, 404, "{}", r.text());
    let r = api(addr, "GET", "/templates/aliases/bad%20name", "").await;
    assert_eq!(r.status, 400, "{}", r.text());

    // Delete by name: 204, again 204; then the id is unknown (404, saying so).
    let r = api(addr, "DELETE", "/templates/snap-web", "").await;
    assert_eq!(r.status, 204, "{}", r.text());
    let r = api(addr, "DELETE", "/templates/snap-web", "").await;
    assert_eq!(r.status, 204, "{}", r.text());
    assert!(
        !store
            .join(format!("snapshots/{snap}/layer.tar.zst"))
            .exists()
    );
    let r = create_from(addr, &snap).await;
    assert_eq!(r.status, 404, "{}", r.text());
    let msg = r.json()["message"].as_str().unwrap().to_string();
    assert!(msg.contains(&snap) && msg.contains("not found"), "{msg}");
    // The name is gone too: it is no template either.
    let r = api(
        addr,
        "POST",
        "/v2/sandboxes",
        r#"{"templateID":"snap-web"}"#,
    )
    .await;
    assert_eq!(r.status, 400, "{}", r.text());
    // Sandboxes started from it are unaffected.
    assert_eq!(
        read(addr, &by_id, "cat /srv/app/data.txt").await,
        "hello-snapshot"
    );
    let r = api(addr, "DELETE", &format!("/templates/{unnamed}"), "").await;
    assert_eq!(r.status, 204);
    let r = api(addr, "GET", "/snapshots", "").await;
    assert_eq!(r.json(), serde_json::json!([]));

    // A paused sandbox cannot be snapshotted (400), and stays paused.
    let r = api(addr, "POST", &format!("/sandboxes/{src}/pause"), "").await;
    assert_eq!(r.status, 204, "{}", r.text());
    let r = snapshot(addr, &src, "").await;
    assert_eq!(r.status, 400, "{}", r.text());
    assert_eq!(state(addr, &src).await.as_deref(), Some("paused"));

    for id in [&src, &by_id, &by_name] {
        assert_eq!(delete(addr, id).await.status, 204);
    }
    node.stop().await;
    // Nothing of the snapshots is left in the node's staging area or kept layers.
    let staging = home.path().join("snapshot-local-cache/staging");
    eventually("an empty staging area", Duration::from_secs(10), || async {
        (std::fs::read_dir(&staging).unwrap().count() == 0).then_some(())
    })
    .await;
}

/// Bad input from the shared store: a record changed after it was written is refused by
/// id and by name and is not listed; a layer that escapes (signed by a node that has the
/// seed, as a compromised node or a stolen seed could) is refused naming its entry, and
/// nothing is written outside the node's directories.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_records_and_escaping_layers_are_refused() {
    use agentenv_core::storage::OpendalStorage;
    use agentenv_node::backend::SnapshotCapture;
    use agentenv_node::snapshot::{RecordKey, SnapshotRepo, SnapshotSpec};

    require_node!();
    let home = tempfile::tempdir().unwrap();
    let cfg = node_common::config(home.path(), 55);
    let store_cfg = cfg.snapshot_repository.clone();
    let node = Node::start(cfg).await;
    let addr = node.addr;
    let store = home.path().join("snapshot-store/repository");

    // A snapshot of a real sandbox, then its record changed in the store.
    let src = create(addr, r#"{"templateID":"base","timeout":300}"#).await;
    let r = snapshot(addr, &src, r#"{"name":"tampered"}"#).await;
    assert_eq!(r.status, 201, "{}", r.text());
    let snap = r.json()["snapshotID"].as_str().unwrap().to_string();
    let path = store.join(format!("catalog/records/{snap}.json"));
    let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    v["committed"]["env"]["INJECTED"] = "1".into();
    std::fs::write(&path, serde_json::to_vec(&v).unwrap()).unwrap();
    for template in [snap.as_str(), "tampered"] {
        let r = create_from(addr, template).await;
        assert_eq!(r.status, 500, "{}", r.text());
        let msg = r.json()["message"].as_str().unwrap().to_string();
        assert!(
            msg.contains(&snap)
                && msg.contains("not written by a node sharing this node's seed")
                && msg.contains("AENV_SANDBOX_ACCESS_TOKEN_HASH_SEED"),
            "{msg}"
        );
    }
    assert_eq!(
        api(addr, "GET", "/snapshots", "").await.json(),
        serde_json::json!([])
    );

    // A layer whose `etc` is a link to a host directory, with a file through it.
    let seed = node_common::TEST_SEED.to_string();
    let cache = tempfile::tempdir().unwrap();
    let repo = SnapshotRepo::new(
        std::sync::Arc::new(OpendalStorage::open(&store_cfg).unwrap()),
        &store_cfg,
        cache.path(),
        RecordKey::from_seed(&seed),
    )
    .unwrap();
    let victim = tempfile::tempdir().unwrap();
    let dir = repo.staging_dir().unwrap();
    {
        let mut b = tar::Builder::new(std::fs::File::create(dir.path().join("layer.tar")).unwrap());
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(tar::EntryType::Symlink);
        h.set_size(0);
        h.set_mode(0o777);
        h.set_uid(0);
        h.set_gid(0);
        b.append_link(&mut h, "etc", victim.path()).unwrap();
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(tar::EntryType::Regular);
        h.set_size(6);
        h.set_mode(0o644);
        h.set_uid(0);
        h.set_gid(0);
        b.append_data(&mut h, "etc/hosts", &b"owned\n"[..]).unwrap();
        b.finish().unwrap();
    }
    let rec = repo
        .publish(
            &SnapshotSpec {
                sandbox_id: src.clone(),
                name: Some("escape".into()),
                template: "base".into(),
                cpu_count: 1,
                memory_mb: 256,
                env: Default::default(),
            },
            SnapshotCapture {
                backend: "jail".into(),
                files: vec!["layer.tar".into()],
            },
            dir.path(),
        )
        .await
        .unwrap();
    let r = api(addr, "POST", "/v2/sandboxes", r#"{"templateID":"escape"}"#).await;
    assert_eq!(r.status, 500, "{}", r.text());
    let msg = r.json()["message"].as_str().unwrap().to_string();
    assert!(
        msg.contains("\"etc/hosts\"") && msg.contains("`etc` is a symbolic link"),
        "{msg}"
    );
    assert_eq!(
        std::fs::read_dir(victim.path()).unwrap().count(),
        0,
        "a file was written through the layer's link"
    );
    // Nothing of the refused layer is kept, and the node keeps serving.
    let kept = home.path().join("jail/kept");
    eventually("no kept layer left", Duration::from_secs(10), || async {
        (std::fs::read_dir(&kept).unwrap().count() == 0).then_some(())
    })
    .await;
    assert_eq!(state(addr, &src).await.as_deref(), Some("running"));
    assert_eq!(read(addr, &src, "echo alive").await, "alive");

    let r = api(addr, "DELETE", &format!("/templates/{}", rec.id), "").await;
    assert_eq!(r.status, 204, "{}", r.text());
    assert_eq!(delete(addr, &src).await.status, 204);
    node.stop().await;
}
