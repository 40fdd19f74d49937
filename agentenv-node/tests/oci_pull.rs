//! Pulling OCI images from a real registry (Debian's `docker-registry`), with images built
//! here as OCI layouts and pushed with `skopeo`.
//!
//! Needs `docker-registry`, `skopeo` and `apache2-utils` (htpasswd), all listed in
//! scripts/apt-packages.txt.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use agentenv_node::template::oci::{
    LayerCache, LayerMediaType, OciError, PullOptions, RegistryAuth, pull,
};
use agentenv_testkit::free_port;
use agentenv_testkit::registry::{
    ImageConfig, Layout, TestRegistry, push, sha256_digest as sha256, tar_of_dir, tar_of_files,
};

/// The config of the test image: every runtime field set.
fn test_config(arch: &str) -> ImageConfig {
    ImageConfig {
        architecture: arch.into(),
        env: vec!["PATH=/usr/bin:/bin".into(), "GREETING=hello".into()],
        working_dir: Some("/app".into()),
        user: Some("1000:1000".into()),
        entrypoint: vec!["/bin/tool".into()],
        cmd: vec!["--help".into()],
    }
}

/// The rootfs of the first layer, on disk: files, a symlink, a setuid file, nested dirs.
fn make_rootfs(dir: &Path) {
    std::fs::create_dir_all(dir.join("etc")).unwrap();
    std::fs::create_dir_all(dir.join("bin")).unwrap();
    std::fs::create_dir_all(dir.join("a/b/c")).unwrap();
    std::fs::create_dir_all(dir.join("opq/sub")).unwrap();
    std::fs::write(dir.join("etc/hello"), b"hello from layer 1\n").unwrap();
    std::fs::write(dir.join("bin/tool"), b"#!/bin/sh\necho tool\n").unwrap();
    std::fs::set_permissions(
        dir.join("bin/tool"),
        std::fs::Permissions::from_mode(0o4755),
    )
    .unwrap();
    std::os::unix::fs::chown(dir.join("etc/hello"), Some(1234), Some(4321)).unwrap();
    std::os::unix::fs::symlink("etc/hello", dir.join("link")).unwrap();
    std::fs::write(dir.join("a/b/c/deep.txt"), b"deep").unwrap();
    std::fs::write(dir.join("gone.txt"), b"to be whited out").unwrap();
    std::fs::write(dir.join("opq/lower"), b"lower").unwrap();
    std::fs::write(dir.join("opq/sub/lower2"), b"lower").unwrap();
}

/// The second layer: an OCI whiteout, an opaque directory, a replaced file.
fn second_layer() -> Vec<u8> {
    tar_of_files(&[
        (".wh.gone.txt", b""),
        ("opq/.wh..wh..opq", b""),
        ("opq/upper", b"upper"),
        ("etc/hello", b"hello from layer 2\n"),
    ])
}

fn arch_layer(arch: &str) -> Vec<u8> {
    tar_of_files(&[("arch", arch.as_bytes())])
}

/// Builds the two-layer test image in `dir` and pushes it to `dest` (`host:port/repo:tag`).
fn push_test_image(dir: &Path, dest: &str, extra: &[&str]) {
    let rootfs = dir.join("rootfs");
    make_rootfs(&rootfs);
    let layout = Layout::new(dir.join("layout"));
    let l1 = tar_of_dir(&rootfs);
    let l2 = second_layer();
    let m = layout.image(&test_config("amd64"), &[&l1, &l2]);
    layout.tag(&m, "v1");
    push(layout.dir(), "v1", dest, extra);
}

struct Lines(Arc<Mutex<Vec<String>>>);

fn progress() -> (Lines, agentenv_node::template::oci::Progress) {
    let lines = Arc::new(Mutex::new(Vec::new()));
    let l = lines.clone();
    (
        Lines(lines),
        Arc::new(move |s: &str| l.lock().unwrap().push(s.to_string())),
    )
}

/// Options that read no host configuration.
fn opts(dir: &Path) -> PullOptions {
    PullOptions {
        registries_conf: dir.join("no-registries.conf"),
        request_timeout: Duration::from_secs(5),
        ..Default::default()
    }
}

fn check_unpacked(root: &Path) {
    assert_eq!(
        std::fs::read(root.join("etc/hello")).unwrap(),
        b"hello from layer 2\n"
    );
    let tool = std::fs::symlink_metadata(root.join("bin/tool")).unwrap();
    assert_eq!(tool.mode() & 0o7777, 0o4755, "setuid bit kept");
    assert_eq!(
        std::fs::read_link(root.join("link")).unwrap(),
        Path::new("etc/hello")
    );
    assert_eq!(std::fs::read(root.join("a/b/c/deep.txt")).unwrap(), b"deep");
    assert!(!root.join("gone.txt").exists(), "whiteout applied");
    assert!(!root.join(".wh.gone.txt").exists());
    let mut opq: Vec<_> = std::fs::read_dir(root.join("opq"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    opq.sort();
    assert_eq!(
        opq,
        ["upper"],
        "opaque directory emptied of the lower layer"
    );
}

#[tokio::test]
async fn oci_pull_gzip_layers_whiteouts_and_cache() {
    let reg = TestRegistry::start(None);
    let dir = tempfile::tempdir().unwrap();
    let dest = reg.reference("test/img:v1");
    push_test_image(dir.path(), &dest, &[]);

    let cache = LayerCache::new(dir.path().join("cache"));
    let (lines, p) = progress();
    let img = pull(&dest, &opts(dir.path()), &cache, p).await.unwrap();
    assert_eq!(img.layers.len(), 2);
    assert!(
        img.layers
            .iter()
            .all(|l| l.media_type == LayerMediaType::Gzip)
    );
    assert_eq!(img.report.layers_fetched, 2);
    assert_eq!(img.report.layers_cached, 0);
    assert!(img.report.bytes_fetched > 0);
    assert_eq!(
        img.reference.digest.as_deref(),
        Some(img.manifest_digest.as_str())
    );
    assert_eq!(img.reference.repository, "test/img");
    for l in &img.layers {
        let hex = l.digest.strip_prefix("sha256:").unwrap();
        assert_eq!(l.path, dir.path().join("cache/sha256").join(hex));
        assert_eq!(sha256(&std::fs::read(&l.path).unwrap()), l.digest);
    }
    let c = &img.config;
    assert_eq!(c.env, ["PATH=/usr/bin:/bin", "GREETING=hello"]);
    assert_eq!(c.working_dir.as_deref(), Some("/app"));
    assert_eq!(c.user.as_deref(), Some("1000:1000"));
    assert_eq!(c.entrypoint, ["/bin/tool"]);
    assert_eq!(c.cmd, ["--help"]);
    {
        let lines = lines.0.lock().unwrap();
        assert!(
            lines
                .iter()
                .any(|l| l.starts_with("pulling layer 2/2 sha256:")),
            "{lines:?}"
        );
    }

    let root = dir.path().join("rootfs-out");
    let stats = img.unpack_into(&root).unwrap();
    assert_eq!(stats[1].whiteouts, 1);
    assert_eq!(stats[1].opaque_dirs, 1);
    check_unpacked(&root);
    let hello = std::fs::metadata(root.join("a/b/c/deep.txt")).unwrap();
    assert_eq!(hello.uid(), 0);
    // Unpacking again into the same (now full) directory is refused.
    assert!(matches!(
        img.unpack_into(&root),
        Err(OciError::Rootfs { .. })
    ));

    // Second pull: nothing downloaded.
    let (lines, p) = progress();
    let again = pull(&dest, &opts(dir.path()), &cache, p).await.unwrap();
    assert_eq!(again.report.layers_fetched, 0);
    assert_eq!(again.report.layers_cached, 2);
    assert_eq!(again.report.bytes_fetched, 0);
    assert_eq!(again.manifest_digest, img.manifest_digest);
    assert!(
        lines
            .0
            .lock()
            .unwrap()
            .iter()
            .any(|l| l.ends_with("cached")),
        "{:?}",
        lines.0.lock().unwrap()
    );
    // By digest too.
    let pinned = format!("{}@{}", reg.reference("test/img"), img.manifest_digest);
    let by_digest = pull(&pinned, &opts(dir.path()), &cache, progress().1)
        .await
        .unwrap();
    assert_eq!(by_digest.layers, img.layers);
}

#[tokio::test]
async fn oci_pull_zstd_layers() {
    let reg = TestRegistry::start(None);
    let dir = tempfile::tempdir().unwrap();
    let dest = reg.reference("test/zimg:v1");
    push_test_image(
        dir.path(),
        &dest,
        &["--dest-compress", "--dest-compress-format", "zstd"],
    );
    let cache = LayerCache::new(dir.path().join("cache"));
    let img = pull(&dest, &opts(dir.path()), &cache, progress().1)
        .await
        .unwrap();
    assert!(
        img.layers
            .iter()
            .all(|l| l.media_type == LayerMediaType::Zstd),
        "{:?}",
        img.layers
    );
    let root = dir.path().join("rootfs-out");
    img.unpack_into(&root).unwrap();
    check_unpacked(&root);
}

#[tokio::test]
async fn oci_pull_picks_linux_amd64_from_an_index() {
    let reg = TestRegistry::start(None);
    let dir = tempfile::tempdir().unwrap();
    let layout = Layout::new(dir.path().join("layout"));
    let arm = layout.image(&test_config("arm64"), &[&arch_layer("arm64")]);
    let amd = layout.image(&test_config("amd64"), &[&arch_layer("amd64")]);
    let index = layout.index(&[&arm, &amd]);
    layout.tag(&index, "multi");
    let dest = reg.reference("test/multi:multi");
    push(layout.dir(), "multi", &dest, &["--all"]);

    let cache = LayerCache::new(dir.path().join("cache"));
    let img = pull(&dest, &opts(dir.path()), &cache, progress().1)
        .await
        .unwrap();
    assert_eq!(img.manifest_digest, amd.digest);
    assert!(img.index_digest.is_some());
    assert_eq!(img.config.architecture, "amd64");
    let root = dir.path().join("rootfs-out");
    img.unpack_into(&root).unwrap();
    assert_eq!(std::fs::read(root.join("arch")).unwrap(), b"amd64");
}

#[tokio::test]
async fn oci_pull_with_basic_auth() {
    let reg = TestRegistry::start(Some(("user", "pass")));
    let dir = tempfile::tempdir().unwrap();
    let dest = reg.reference("test/private:v1");
    push_test_image(dir.path(), &dest, &["--dest-creds", "user:pass"]);
    let cache = LayerCache::new(dir.path().join("cache"));

    let mut o = opts(dir.path());
    o.auth = Some(RegistryAuth {
        username: "user".into(),
        password: "wrong-password".into(),
    });
    let e = pull(&dest, &o, &cache, progress().1).await.unwrap_err();
    assert!(matches!(e, OciError::Auth { .. }), "{e:?}");
    let msg = e.to_string();
    assert!(msg.contains(&reg.addr().to_string()), "{msg}");
    assert!(msg.contains("check the username and password"), "{msg}");
    assert!(!msg.contains("wrong-password"), "{msg}");

    let e = pull(&dest, &opts(dir.path()), &cache, progress().1)
        .await
        .unwrap_err();
    assert!(matches!(e, OciError::Auth { .. }), "{e:?}");
    assert!(e.to_string().contains("credentials"), "{e}");

    o.auth = Some(RegistryAuth {
        username: "user".into(),
        password: "pass".into(),
    });
    let img = pull(&dest, &o, &cache, progress().1).await.unwrap();
    assert_eq!(img.report.layers_fetched, 2);
    img.unpack_into(&dir.path().join("rootfs-out")).unwrap();
    check_unpacked(&dir.path().join("rootfs-out"));
}

#[tokio::test]
async fn oci_pull_from_an_unreachable_registry_names_it() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let reference = format!("127.0.0.1:{port}/test/img:v1");
    let cache = LayerCache::new(dir.path().join("cache"));
    let e = pull(&reference, &opts(dir.path()), &cache, progress().1)
        .await
        .unwrap_err();
    assert!(matches!(e, OciError::Unreachable { .. }), "{e:?}");
    let msg = e.to_string();
    assert!(msg.contains(&format!("registry 127.0.0.1:{port}")), "{msg}");
}

#[tokio::test]
async fn oci_pull_of_an_unknown_tag_is_not_found() {
    let reg = TestRegistry::start(None);
    let dir = tempfile::tempdir().unwrap();
    push_test_image(dir.path(), &reg.reference("test/img:v1"), &[]);
    let cache = LayerCache::new(dir.path().join("cache"));
    for missing in ["test/img:nope", "test/nothing:v1"] {
        let e = pull(
            &reg.reference(missing),
            &opts(dir.path()),
            &cache,
            progress().1,
        )
        .await
        .unwrap_err();
        assert!(matches!(e, OciError::NotFound { .. }), "{missing}: {e:?}");
        assert!(e.to_string().contains("not found"), "{e}");
    }
}

#[tokio::test]
async fn oci_pull_refuses_a_blob_that_does_not_match_its_digest() {
    let reg = TestRegistry::start(None);
    let dir = tempfile::tempdir().unwrap();
    let dest = reg.reference("test/img:v1");
    push_test_image(dir.path(), &dest, &[]);
    // Find the layers as pushed, through a first pull into a throwaway cache.
    let scratch = LayerCache::new(dir.path().join("scratch"));
    let img = pull(&dest, &opts(dir.path()), &scratch, progress().1)
        .await
        .unwrap();
    let victim = &img.layers[1].digest;
    let file = reg.blob_file(victim);
    let mut data = std::fs::read(&file).unwrap();
    let mid = data.len() / 2;
    data[mid] ^= 0xff;
    std::fs::write(&file, &data).unwrap();

    let cache = LayerCache::new(dir.path().join("cache"));
    let e = pull(&dest, &opts(dir.path()), &cache, progress().1)
        .await
        .unwrap_err();
    assert!(matches!(e, OciError::DigestMismatch { .. }), "{e:?}");
    let msg = e.to_string();
    assert!(msg.contains(victim.as_str()), "{msg}");
    assert!(msg.contains("nothing of it was cached"), "{msg}");
    let hex = victim.strip_prefix("sha256:").unwrap();
    assert!(!dir.path().join("cache/sha256").join(hex).exists());
    let tmp: Vec<_> = std::fs::read_dir(dir.path().join("cache/tmp"))
        .unwrap()
        .collect();
    assert!(tmp.is_empty(), "temporary files left: {tmp:?}");
}
