//! Pulling OCI images from a real registry (Debian's `docker-registry`), with images built
//! here as OCI layouts and pushed with `skopeo`.
//!
//! Needs `docker-registry`, `skopeo` and `apache2-utils` (htpasswd), all listed in
//! scripts/apt-packages.txt.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use agentenv_node::template::oci::{
    LayerCache, LayerMediaType, OciError, PullOptions, RegistryAuth, pull,
};
use sha2::{Digest, Sha256};

const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
const OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";
const OCI_CONFIG: &str = "application/vnd.oci.image.config.v1+json";
const LAYER_GZIP: &str = "application/vnd.oci.image.layer.v1.tar+gzip";

fn need(tool: &str, package: &str) -> PathBuf {
    for dir in ["/usr/bin", "/usr/sbin", "/usr/local/bin"] {
        let p = Path::new(dir).join(tool);
        if p.exists() {
            return p;
        }
    }
    panic!(
        "{tool} is missing: install the Debian package {package} (apt-get install -y {package}; it is listed in scripts/apt-packages.txt)"
    );
}

fn sha256(data: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(data)))
}

/// A `docker-registry serve` on a free loopback port, killed when dropped.
struct TestRegistry {
    child: Child,
    addr: SocketAddr,
    storage: PathBuf,
    _dir: tempfile::TempDir,
}

impl Drop for TestRegistry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

impl TestRegistry {
    fn start(htpasswd: Option<(&str, &str)>) -> Self {
        let bin = need("docker-registry", "docker-registry");
        let dir = tempfile::tempdir().unwrap();
        let storage = dir.path().join("storage");
        std::fs::create_dir(&storage).unwrap();
        let port = free_port();
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        let mut cfg = format!(
            "version: 0.1\nlog:\n  level: error\n  accesslog:\n    disabled: true\nstorage:\n  filesystem:\n    rootdirectory: {}\nhttp:\n  addr: {addr}\n",
            storage.display()
        );
        if let Some((user, pass)) = htpasswd {
            let tool = need("htpasswd", "apache2-utils");
            let out = Command::new(tool)
                .args(["-Bbn", user, pass])
                .output()
                .unwrap();
            assert!(out.status.success(), "htpasswd failed: {out:?}");
            let file = dir.path().join("htpasswd");
            std::fs::write(&file, &out.stdout).unwrap();
            cfg.push_str(&format!(
                "auth:\n  htpasswd:\n    realm: test\n    path: {}\n",
                file.display()
            ));
        }
        let cfg_path = dir.path().join("config.yml");
        std::fs::write(&cfg_path, cfg).unwrap();
        let child = Command::new(bin)
            .arg("serve")
            .arg(&cfg_path)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut reg = Self {
            child,
            addr,
            storage,
            _dir: dir,
        };
        reg.wait_ready();
        reg
    }

    /// Polls `/v2/` until the registry answers with an HTTP status line.
    fn wait_ready(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                panic!("docker-registry exited before answering: {status}");
            }
            if let Ok(mut s) = TcpStream::connect_timeout(&self.addr, Duration::from_millis(200)) {
                let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
                let req = format!(
                    "GET /v2/ HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n\r\n",
                    self.addr
                );
                let mut buf = [0u8; 12];
                if s.write_all(req.as_bytes()).is_ok()
                    && s.read_exact(&mut buf).is_ok()
                    && buf.starts_with(b"HTTP/1.1 ")
                {
                    return;
                }
            }
            assert!(
                Instant::now() < deadline,
                "docker-registry did not answer on {} within 10 s",
                self.addr
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn reference(&self, repo_tag: &str) -> String {
        format!("{}/{repo_tag}", self.addr)
    }

    /// The file holding blob `digest` in the registry's storage.
    fn blob_file(&self, digest: &str) -> PathBuf {
        let hex = digest.strip_prefix("sha256:").unwrap();
        self.storage
            .join("docker/registry/v2/blobs/sha256")
            .join(&hex[..2])
            .join(hex)
            .join("data")
    }
}

/// An OCI image layout being written.
struct Layout {
    dir: PathBuf,
}

/// A descriptor as JSON, plus the digest.
struct Desc {
    json: serde_json::Value,
    digest: String,
}

impl Layout {
    fn new(dir: PathBuf) -> Self {
        std::fs::create_dir_all(dir.join("blobs/sha256")).unwrap();
        std::fs::write(dir.join("oci-layout"), r#"{"imageLayoutVersion":"1.0.0"}"#).unwrap();
        Self { dir }
    }

    fn blob(&self, data: &[u8], media_type: &str) -> Desc {
        let digest = sha256(data);
        let hex = digest.strip_prefix("sha256:").unwrap();
        std::fs::write(self.dir.join("blobs/sha256").join(hex), data).unwrap();
        Desc {
            json: serde_json::json!({"mediaType": media_type, "digest": digest, "size": data.len()}),
            digest,
        }
    }

    /// A gzip layer from an uncompressed tar: (descriptor, diff id).
    fn layer(&self, tar: &[u8]) -> (Desc, String) {
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        gz.write_all(tar).unwrap();
        (self.blob(&gz.finish().unwrap(), LAYER_GZIP), sha256(tar))
    }

    /// An image manifest of `layers` with a config: the manifest's descriptor.
    fn image(&self, arch: &str, layers: &[&[u8]]) -> Desc {
        let (descs, diff_ids): (Vec<_>, Vec<_>) = layers.iter().map(|l| self.layer(l)).unzip();
        let config = serde_json::json!({
            "architecture": arch,
            "os": "linux",
            "config": {
                "Env": ["PATH=/usr/bin:/bin", "GREETING=hello"],
                "WorkingDir": "/app",
                "User": "1000:1000",
                "Entrypoint": ["/bin/tool"],
                "Cmd": ["--help"],
            },
            "rootfs": {"type": "layers", "diff_ids": diff_ids},
        });
        let config = self.blob(&serde_json::to_vec(&config).unwrap(), OCI_CONFIG);
        let mut json = serde_json::json!({
            "schemaVersion": 2,
            "mediaType": OCI_MANIFEST,
            "config": config.json,
            "layers": descs.into_iter().map(|d| d.json).collect::<Vec<_>>(),
        });
        let m = self.blob(&serde_json::to_vec(&json).unwrap(), OCI_MANIFEST);
        json = m.json;
        json["platform"] = serde_json::json!({"architecture": arch, "os": "linux"});
        Desc {
            json,
            digest: m.digest,
        }
    }

    /// `index.json` naming `desc` as `tag`.
    fn tag(&self, desc: &Desc, tag: &str) {
        let mut entry = desc.json.clone();
        entry["annotations"] = serde_json::json!({"org.opencontainers.image.ref.name": tag});
        let index = serde_json::json!({"schemaVersion": 2, "manifests": [entry]});
        std::fs::write(
            self.dir.join("index.json"),
            serde_json::to_vec(&index).unwrap(),
        )
        .unwrap();
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

fn tar_of_dir(dir: &Path) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    b.follow_symlinks(false);
    b.mode(tar::HeaderMode::Complete);
    b.append_dir_all(".", dir).unwrap();
    b.into_inner().unwrap()
}

fn file_entry(b: &mut tar::Builder<Vec<u8>>, path: &str, data: &[u8]) {
    let mut h = tar::Header::new_gnu();
    h.set_entry_type(tar::EntryType::Regular);
    h.set_mode(0o644);
    h.set_size(data.len() as u64);
    h.set_mtime(1_700_000_000);
    h.set_uid(0);
    h.set_gid(0);
    b.append_data(&mut h, path, data).unwrap();
}

/// The second layer: an OCI whiteout, an opaque directory, a replaced file.
fn second_layer() -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    file_entry(&mut b, ".wh.gone.txt", b"");
    file_entry(&mut b, "opq/.wh..wh..opq", b"");
    file_entry(&mut b, "opq/upper", b"upper");
    file_entry(&mut b, "etc/hello", b"hello from layer 2\n");
    b.into_inner().unwrap()
}

fn arch_layer(arch: &str) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    file_entry(&mut b, "arch", arch.as_bytes());
    b.into_inner().unwrap()
}

fn skopeo(args: &[&str]) {
    let bin = need("skopeo", "skopeo");
    let out = Command::new(bin)
        .arg("--insecure-policy")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "skopeo {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Pushes the layout at `layout` (tag `tag`) to `dest` (`host:port/repo:tag`).
fn push(layout: &Path, tag: &str, dest: &str, extra: &[&str]) {
    let src = format!("oci:{}:{tag}", layout.display());
    let dst = format!("docker://{dest}");
    let mut args = vec!["copy", "--dest-tls-verify=false"];
    args.extend_from_slice(extra);
    args.push(&src);
    args.push(&dst);
    skopeo(&args);
}

/// Builds the two-layer test image in `dir` and pushes it to `dest` (`host:port/repo:tag`).
fn push_test_image(dir: &Path, dest: &str, extra: &[&str]) {
    let rootfs = dir.join("rootfs");
    make_rootfs(&rootfs);
    let layout = Layout::new(dir.join("layout"));
    let l1 = tar_of_dir(&rootfs);
    let l2 = second_layer();
    let m = layout.image("amd64", &[&l1, &l2]);
    layout.tag(&m, "v1");
    push(&layout.dir, "v1", dest, extra);
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
    let arm = layout.image("arm64", &[&arch_layer("arm64")]);
    let amd = layout.image("amd64", &[&arch_layer("amd64")]);
    let index = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": OCI_INDEX,
        "manifests": [arm.json, amd.json],
    });
    let index = layout.blob(&serde_json::to_vec(&index).unwrap(), OCI_INDEX);
    layout.tag(&index, "multi");
    let dest = reg.reference("test/multi:multi");
    push(&layout.dir, "multi", &dest, &["--all"]);

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
    assert!(msg.contains(&reg.addr.to_string()), "{msg}");
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
