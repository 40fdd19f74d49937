//! Snapshots on the `oss` repository (an S3-compatible bucket; here moto's server from
//! PyPI on a loopback port) with real jail sandboxes, and a node that refuses to start
//! on a repository it cannot use, saying what to fix.

mod node_common;

use agentenv_core::storage::StorageConfig;
use agentenv_node::daemon::Daemon;
use agentenv_testkit::moto::Moto;
use node_common::{Node, api, create, create_from, delete, run, snapshot};

/// moto with one bucket, as the node's repository (under a prefix).
fn moto_with_bucket(bucket: &str) -> Moto {
    let m = Moto::start(false);
    m.create_bucket(bucket);
    m
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshots_publish_to_an_s3_bucket_and_sandboxes_start_from_them() {
    require_node!();
    let moto = tokio::task::spawn_blocking(|| moto_with_bucket("aenv-snapshots"))
        .await
        .unwrap();
    let home = tempfile::tempdir().unwrap();
    let mut cfg = node_common::config(home.path(), 51);
    cfg.snapshot_repository = StorageConfig::S3(moto.config("aenv-snapshots", "cluster-1/"));
    let node = Node::start(cfg).await;
    let addr = node.addr;

    let src = create(addr, r#"{"templateID":"base","timeout":300}"#).await;
    run(addr, &src, None, "echo in-the-bucket > /root/o.txt")
        .await
        .unwrap();
    let r = snapshot(addr, &src, r#"{"name":"oss-snap"}"#).await;
    assert_eq!(r.status, 201, "{}", r.text());
    let snap = r.json()["snapshotID"].as_str().unwrap().to_string();
    // Nothing of it is on the node's disk: the repository is the bucket.
    assert!(!home.path().join("snapshot-store").exists());

    for template in [snap.as_str(), "oss-snap"] {
        let id = create(
            addr,
            &format!(r#"{{"templateID":"{template}","timeout":300}}"#),
        )
        .await;
        let out = run(addr, &id, None, "cat /root/o.txt").await.unwrap();
        assert_eq!(String::from_utf8_lossy(&out.stdout), "in-the-bucket\n");
        assert_eq!(delete(addr, &id).await.status, 204);
    }
    let r = api(addr, "GET", "/snapshots", "").await;
    assert_eq!(r.json()[0]["names"][0], "oss-snap");
    let r = api(addr, "DELETE", "/templates/oss-snap", "").await;
    assert_eq!(r.status, 204);
    let r = create_from(addr, &snap).await;
    assert_eq!(r.status, 404, "{}", r.text());
    assert_eq!(delete(addr, &src).await.status, 204);
    node.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_does_not_start_on_a_repository_it_cannot_use() {
    require_node!();
    node_common::init_tracing();
    // A missing bucket.
    let moto = tokio::task::spawn_blocking(|| moto_with_bucket("present"))
        .await
        .unwrap();
    let home = tempfile::tempdir().unwrap();
    let mut cfg = node_common::config(home.path(), 52);
    cfg.snapshot_repository = StorageConfig::S3(moto.config("absent-bucket", "cluster-1/"));
    let e = Daemon::start(cfg).await.err().expect("start fails");
    let msg = e.to_string();
    assert!(
        msg.contains("\"absent-bucket\" does not exist") && msg.contains("create it"),
        "{msg}"
    );
    // A store directory that cannot be created.
    let file = home.path().join("a-file");
    std::fs::write(&file, b"").unwrap();
    let mut cfg = node_common::config(home.path(), 52);
    cfg.snapshot_repository = StorageConfig::Fs {
        root: file.join("repository"),
    };
    let e = Daemon::start(cfg).await.err().expect("start fails");
    let msg = e.to_string();
    assert!(
        msg.contains("not writable") && msg.contains("a-file/repository"),
        "{msg}"
    );
}
