//! The `Storage` seam against real stores: a local directory (the `fs` service, as on a
//! shared POSIX mount) and a real S3-compatible server (moto's server, from PyPI, on a
//! loopback port).

use std::net::TcpListener;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use agentenv_core::storage::{OpendalStorage, Storage, StorageConfig, StorageError};
use agentenv_testkit::moto::Moto;
use bytes::Bytes;
use sha2::{Digest, Sha256};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// `len` bytes of a fixed pattern, produced as they are read (never all in memory).
struct Pattern {
    left: u64,
    pos: u64,
}

impl AsyncRead for Pattern {
    fn poll_read(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let n = (buf.remaining() as u64).min(self.left).min(64 << 10) as usize;
        let start = self.pos;
        let chunk: Vec<u8> = (0..n as u64)
            .map(|i| ((start + i) * 31 % 251) as u8)
            .collect();
        buf.put_slice(&chunk);
        self.left -= n as u64;
        self.pos += n as u64;
        Poll::Ready(Ok(()))
    }
}

fn pattern_digest(len: u64) -> Vec<u8> {
    let mut h = Sha256::new();
    let mut i = 0u64;
    while i < len {
        let n = (len - i).min(1 << 20);
        let chunk: Vec<u8> = (i..i + n).map(|j| (j * 31 % 251) as u8).collect();
        h.update(&chunk);
        i += n;
    }
    h.finalize().to_vec()
}

/// An `AsyncWrite` that only hashes what it gets.
#[derive(Default)]
struct Hasher(Sha256, u64);

impl AsyncWrite for Hasher {
    fn poll_write(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        self.0.update(buf);
        self.1 += buf.len() as u64;
        Poll::Ready(Ok(buf.len()))
    }
    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }
    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

/// The behaviour every store must have.
async fn exercise(store: Arc<dyn Storage>) {
    store.check().await.expect("check");

    // A 20 MiB object streams up (more than two upload chunks) and down intact.
    let len = 20u64 << 20;
    let n = store
        .put("artifacts/s1/layer.tar", &mut Pattern { left: len, pos: 0 })
        .await
        .expect("put");
    assert_eq!(n, len);
    let meta = store.stat("artifacts/s1/layer.tar").await.unwrap().unwrap();
    assert_eq!(meta.size, len);
    let mut h = Hasher::default();
    assert_eq!(
        store.get("artifacts/s1/layer.tar", &mut h).await.unwrap(),
        len
    );
    assert_eq!(h.1, len);
    assert_eq!(h.0.finalize().to_vec(), pattern_digest(len));

    // Files both ways.
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src.bin");
    std::fs::write(&src, b"manifest bytes").unwrap();
    store
        .put_file("artifacts/s1/manifest.json", &src)
        .await
        .unwrap();
    let dst = dir.path().join("dst.bin");
    store
        .get_file("artifacts/s1/manifest.json", &dst)
        .await
        .unwrap();
    assert_eq!(std::fs::read(&dst).unwrap(), b"manifest bytes");
    // A large file both ways, and an absent one.
    let big = dir.path().join("big.bin");
    {
        let mut f = tokio::fs::File::create(&big).await.unwrap();
        tokio::io::copy(
            &mut Pattern {
                left: 9 << 20,
                pos: 0,
            },
            &mut f,
        )
        .await
        .unwrap();
    }
    assert_eq!(
        store.put_file("artifacts/s3/big", &big).await.unwrap(),
        9 << 20
    );
    let back = dir.path().join("back.bin");
    assert_eq!(
        store.get_file("artifacts/s3/big", &back).await.unwrap(),
        9 << 20
    );
    assert_eq!(std::fs::read(&back).unwrap(), std::fs::read(&big).unwrap());
    store.delete("artifacts/s3/big").await.unwrap();
    match store
        .get_file("artifacts/none", &dir.path().join("none"))
        .await
    {
        Err(StorageError::NotFound { .. }) => {}
        other => panic!("expected NotFound, got {other:?}"),
    }
    assert!(!dir.path().join("none").exists());
    assert_eq!(
        std::fs::read_dir(dir.path()).unwrap().count(),
        4,
        "no partial files left"
    );
    // A put replaces.
    store
        .put("artifacts/s1/manifest.json", &mut &b"v2"[..])
        .await
        .unwrap();
    assert_eq!(
        store
            .read("artifacts/s1/manifest.json", 1024)
            .await
            .unwrap()
            .unwrap(),
        b"v2"
    );

    // Listing by prefix: sorted, recursive, nothing from other prefixes.
    store.put("artifacts/s2/a", &mut &b"x"[..]).await.unwrap();
    store
        .put("catalog/records/s1.json", &mut &b"{}"[..])
        .await
        .unwrap();
    assert_eq!(
        store.list("artifacts/").await.unwrap(),
        [
            "artifacts/s1/layer.tar",
            "artifacts/s1/manifest.json",
            "artifacts/s2/a"
        ]
    );
    assert_eq!(
        store.list("artifacts/s1/").await.unwrap(),
        ["artifacts/s1/layer.tar", "artifacts/s1/manifest.json"]
    );
    assert!(store.list("nothing-here/").await.unwrap().is_empty());

    // Small reads are bounded.
    match store.read("artifacts/s1/layer.tar", 1024).await {
        Err(StorageError::TooLarge { limit: 1024, .. }) => {}
        other => panic!("expected TooLarge, got {other:?}"),
    }
    assert!(
        store
            .read("catalog/records/none.json", 10)
            .await
            .unwrap()
            .is_none()
    );

    // Absent objects.
    assert!(store.stat("artifacts/none").await.unwrap().is_none());
    let mut sink = Hasher::default();
    match store.get("artifacts/none", &mut sink).await {
        Err(StorageError::NotFound { key, .. }) => assert_eq!(key, "artifacts/none"),
        other => panic!("expected NotFound, got {other:?}"),
    }

    // Delete is idempotent; delete_prefix removes a whole artifact directory.
    store.delete("artifacts/s2/a").await.unwrap();
    store.delete("artifacts/s2/a").await.unwrap();
    assert!(store.stat("artifacts/s2/a").await.unwrap().is_none());
    store.delete_prefix("artifacts/s1/").await.unwrap();
    assert!(store.list("artifacts/").await.unwrap().is_empty());

    // create_new: the first writer wins, the content stays, and among racing writers
    // exactly one succeeds.
    assert!(
        store
            .create_new("catalog/aliases/web", Bytes::from_static(b"\"id-1\""))
            .await
            .unwrap()
    );
    assert!(
        !store
            .create_new("catalog/aliases/web", Bytes::from_static(b"\"id-2\""))
            .await
            .unwrap()
    );
    assert_eq!(
        store
            .read("catalog/aliases/web", 64)
            .await
            .unwrap()
            .unwrap(),
        b"\"id-1\""
    );
    let mut tasks = Vec::new();
    for i in 0..8 {
        let s = store.clone();
        tasks.push(tokio::spawn(async move {
            s.create_new("catalog/aliases/race", Bytes::from(format!("{i}")))
                .await
                .unwrap()
        }));
    }
    let mut won = 0;
    for t in tasks {
        if t.await.unwrap() {
            won += 1;
        }
    }
    assert_eq!(won, 1, "exactly one racing create_new wins");
    assert_eq!(
        store.list("catalog/aliases/").await.unwrap(),
        ["catalog/aliases/race", "catalog/aliases/web"]
    );

    // Bad keys are refused before anything is touched.
    assert!(matches!(
        store.put("../escape", &mut &b"x"[..]).await,
        Err(StorageError::InvalidKey(_))
    ));
    assert!(matches!(
        store.stat("/abs").await,
        Err(StorageError::InvalidKey(_))
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_local_directory_stores_streams_lists_and_creates_atomically() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("snapshot-store");
    let store: Arc<dyn Storage> =
        Arc::new(OpendalStorage::open(&StorageConfig::Fs { root: root.clone() }).unwrap());
    exercise(store.clone()).await;
    // Objects are plain files under the root: another node mounting it sees them.
    assert_eq!(
        std::fs::read(root.join("catalog/aliases/web")).unwrap(),
        b"\"id-1\""
    );
    // A second store on the same directory (another node) sees the same objects.
    let other = OpendalStorage::open(&StorageConfig::Fs { root }).unwrap();
    assert!(
        !other
            .create_new("catalog/aliases/web", Bytes::from_static(b"x"))
            .await
            .unwrap()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_directory_that_cannot_be_written_is_named_in_the_error() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("a-file");
    std::fs::write(&file, b"").unwrap();
    let e = match OpendalStorage::open(&StorageConfig::Fs {
        root: file.join("store"),
    }) {
        Ok(store) => store.check().await.unwrap_err(),
        Err(e) => e,
    };
    assert!(matches!(e, StorageError::NotWritable { .. }), "{e:?}");
    let msg = e.to_string();
    assert!(
        msg.contains("not writable") && msg.contains("a-file/store"),
        "{msg}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_s3_bucket_stores_streams_lists_and_creates_atomically() {
    let moto = tokio::task::spawn_blocking(|| Moto::start(false))
        .await
        .unwrap();
    moto.create_bucket("snapshots");
    let store: Arc<dyn Storage> = Arc::new(
        OpendalStorage::open(&StorageConfig::S3(moto.config("snapshots", "cluster-a/"))).unwrap(),
    );
    exercise(store).await;
    // The prefix keeps stores apart inside one bucket.
    let other =
        OpendalStorage::open(&StorageConfig::S3(moto.config("snapshots", "cluster-b"))).unwrap();
    assert!(other.list("catalog/").await.unwrap().is_empty());
    let same =
        OpendalStorage::open(&StorageConfig::S3(moto.config("snapshots", "cluster-a"))).unwrap();
    assert_eq!(
        same.read("catalog/aliases/web", 64).await.unwrap().unwrap(),
        b"\"id-1\""
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_errors_say_what_to_fix() {
    let moto = tokio::task::spawn_blocking(|| Moto::start(false))
        .await
        .unwrap();
    let store =
        OpendalStorage::open(&StorageConfig::S3(moto.config("no-such-bucket", ""))).unwrap();
    let e = store.check().await.unwrap_err();
    assert!(matches!(e, StorageError::BucketMissing { .. }), "{e:?}");
    assert!(
        e.to_string().contains("\"no-such-bucket\" does not exist"),
        "{e}"
    );

    let strict = tokio::task::spawn_blocking(|| Moto::start(true))
        .await
        .unwrap();
    let store = OpendalStorage::open(&StorageConfig::S3(strict.config("snapshots", ""))).unwrap();
    let e = store.check().await.unwrap_err();
    assert!(
        matches!(e, StorageError::CredentialsRefused { .. }),
        "{e:?}"
    );
    assert!(e.to_string().contains("refused the credentials"), "{e}");

    // Nothing listens on a port that was just released.
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut cfg = moto.config("snapshots", "");
    cfg.endpoint = format!("http://127.0.0.1:{port}");
    let store = OpendalStorage::open(&StorageConfig::S3(cfg)).unwrap();
    let e = store.check().await.unwrap_err();
    assert!(matches!(e, StorageError::Unreachable { .. }), "{e:?}");
    assert!(e.to_string().contains("cannot reach"), "{e}");
}
