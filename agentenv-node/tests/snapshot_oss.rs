//! Snapshots on the `oss` repository (an S3-compatible bucket; here moto's server from
//! PyPI on a loopback port) with real jail sandboxes, and a node that refuses to start
//! on a repository it cannot use, saying what to fix.

mod node_common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use agentenv_core::storage::{S3Config, StorageConfig};
use agentenv_node::daemon::Daemon;
use node_common::{Node, api, create, run};

fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../target"))
}

/// `moto_server` in `target/moto-venv` (created once, under an inter-process lock).
fn moto_server_binary() -> PathBuf {
    let venv = target_dir().join("moto-venv");
    let bin = venv.join("bin/moto_server");
    let works = |b: &Path| {
        b.is_file()
            && Command::new(venv.join("bin/python"))
                .args(["-c", "import moto.server"])
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
    };
    if works(&bin) {
        return bin;
    }
    std::fs::create_dir_all(target_dir()).unwrap();
    let lock = target_dir().join("moto-venv.lock");
    let f = std::fs::File::create(&lock).unwrap();
    let _guard = nix::fcntl::Flock::lock(f, nix::fcntl::FlockArg::LockExclusive)
        .unwrap_or_else(|(_, e)| panic!("locking {}: {e}", lock.display()));
    if works(&bin) {
        return bin;
    }
    let st = Command::new("python3")
        .args(["-m", "venv"])
        .arg(&venv)
        .status()
        .expect("python3 runs");
    assert!(
        st.success(),
        "`python3 -m venv` failed (install python3-venv)"
    );
    let st = Command::new(venv.join("bin/pip"))
        .args(["install", "-q", "moto[server]"])
        .status()
        .expect("pip runs");
    assert!(
        st.success() && works(&bin),
        "`pip install moto[server]` failed (is PyPI reachable?)"
    );
    bin
}

/// moto's S3 server on a free loopback port with one bucket, killed when dropped.
struct Moto {
    addr: SocketAddr,
    child: Child,
}

impl Moto {
    fn start(bucket: &str) -> Moto {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let child = Command::new(moto_server_binary())
            .args(["-H", "127.0.0.1", "-p", &port.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("starting moto_server");
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        let deadline = Instant::now() + Duration::from_secs(60);
        while TcpStream::connect(addr).is_err() {
            assert!(
                Instant::now() < deadline,
                "moto_server did not listen on {addr}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        let mut s = TcpStream::connect(addr).unwrap();
        write!(
            s,
            "PUT /{bucket} HTTP/1.1\r\nHost: {addr}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        )
        .unwrap();
        let mut resp = String::new();
        s.read_to_string(&mut resp).unwrap();
        assert!(resp.starts_with("HTTP/1.1 200"), "create bucket: {resp}");
        Moto { addr, child }
    }

    fn config(&self, bucket: &str) -> S3Config {
        S3Config {
            endpoint: format!("http://{}", self.addr),
            bucket: bucket.into(),
            prefix: "cluster-1/".into(),
            region: "us-east-1".into(),
            access_key_id: "test-access-key".into(),
            secret_access_key: "test-secret-key".into(),
            security_token: None,
            addressing_style: None,
        }
    }
}

impl Drop for Moto {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshots_publish_to_an_s3_bucket_and_sandboxes_start_from_them() {
    require_node!();
    let moto = tokio::task::spawn_blocking(|| Moto::start("aenv-snapshots"))
        .await
        .unwrap();
    let home = tempfile::tempdir().unwrap();
    let mut cfg = node_common::config(home.path(), 51);
    cfg.snapshot_repository = StorageConfig::S3(moto.config("aenv-snapshots"));
    let node = Node::start(cfg).await;
    let addr = node.addr;

    let src = create(addr, r#"{"templateID":"base","timeout":300}"#).await;
    run(addr, &src, None, "echo in-the-bucket > /root/o.txt")
        .await
        .unwrap();
    let r = api(
        addr,
        "POST",
        &format!("/sandboxes/{src}/snapshots"),
        r#"{"name":"oss-snap"}"#,
    )
    .await;
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
        assert_eq!(
            api(addr, "DELETE", &format!("/sandboxes/{id}"), "")
                .await
                .status,
            204
        );
    }
    let r = api(addr, "GET", "/snapshots", "").await;
    assert_eq!(r.json()[0]["names"][0], "oss-snap");
    let r = api(addr, "DELETE", "/templates/oss-snap", "").await;
    assert_eq!(r.status, 204);
    let r = api(
        addr,
        "POST",
        "/v2/sandboxes",
        &format!(r#"{{"templateID":"{snap}"}}"#),
    )
    .await;
    assert_eq!(r.status, 404, "{}", r.text());
    assert_eq!(
        api(addr, "DELETE", &format!("/sandboxes/{src}"), "")
            .await
            .status,
        204
    );
    node.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_does_not_start_on_a_repository_it_cannot_use() {
    require_node!();
    node_common::init_tracing();
    // A missing bucket.
    let moto = tokio::task::spawn_blocking(|| Moto::start("present"))
        .await
        .unwrap();
    let home = tempfile::tempdir().unwrap();
    let mut cfg = node_common::config(home.path(), 52);
    cfg.snapshot_repository = StorageConfig::S3(moto.config("absent-bucket"));
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
