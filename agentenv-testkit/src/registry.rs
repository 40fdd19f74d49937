//! A real OCI registry for tests: Debian's `docker-registry` on a free loopback port with
//! its own storage directory (and optional htpasswd basic auth), images written here as
//! OCI image layouts and pushed to it with `skopeo`.
//!
//! Needs `docker-registry`, `skopeo` and `apache2-utils` (htpasswd), all listed in
//! scripts/apt-packages.txt; [`need`] panics with the package to install when one is
//! missing.
//!
//! ```no_run
//! use agentenv_testkit::registry::{ImageConfig, TestRegistry, push, write_image};
//! # let rootfs = std::path::Path::new("/tmp/rootfs");
//! # let dir = std::path::Path::new("/tmp/layout");
//! let reg = TestRegistry::start(Some(("user", "pass")));
//! let layout = write_image(rootfs, dir, "v1", &ImageConfig::default());
//! push(layout.dir(), "v1", &reg.reference("tiny/img:v1"), &["--dest-creds", "user:pass"]);
//! ```

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};

use crate::free_port;

/// Media type of an OCI image manifest.
pub const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
/// Media type of an OCI image index.
pub const OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";
/// Media type of an OCI image config.
pub const OCI_CONFIG: &str = "application/vnd.oci.image.config.v1+json";
/// Media type of a gzip-compressed OCI layer.
pub const LAYER_GZIP: &str = "application/vnd.oci.image.layer.v1.tar+gzip";

/// The path of `tool` (in /usr/bin, /usr/sbin or /usr/local/bin); panics naming the Debian
/// `package` to install when it is missing.
pub fn need(tool: &str, package: &str) -> PathBuf {
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

/// The OCI digest (`sha256:<hex>`) of `data`.
pub fn sha256_digest(data: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(data)))
}

/// A `docker-registry serve` on a free loopback port with a temporary storage directory,
/// killed when dropped.
pub struct TestRegistry {
    child: Child,
    addr: SocketAddr,
    storage: PathBuf,
    dir: tempfile::TempDir,
}

impl Drop for TestRegistry {
    fn drop(&mut self) {
        self.stop();
    }
}

impl TestRegistry {
    /// Starts a registry, with basic auth for the one `(user, password)` of `htpasswd`
    /// when given, and waits until it answers on `/v2/`.
    pub fn start(htpasswd: Option<(&str, &str)>) -> Self {
        let bin = need("docker-registry", "docker-registry");
        let dir = tempfile::tempdir().expect("temporary directory");
        let storage = dir.path().join("storage");
        std::fs::create_dir(&storage).expect("registry storage directory");
        let addr = SocketAddr::from(([127, 0, 0, 1], free_port()));
        let mut cfg = format!(
            "version: 0.1\nlog:\n  level: error\n  accesslog:\n    disabled: true\nstorage:\n  filesystem:\n    rootdirectory: {}\nhttp:\n  addr: {addr}\n",
            storage.display()
        );
        if let Some((user, pass)) = htpasswd {
            let tool = need("htpasswd", "apache2-utils");
            let out = Command::new(tool)
                .args(["-Bbn", user, pass])
                .output()
                .expect("running htpasswd");
            assert!(out.status.success(), "htpasswd failed: {out:?}");
            let file = dir.path().join("htpasswd");
            std::fs::write(&file, &out.stdout).expect("writing htpasswd");
            cfg.push_str(&format!(
                "auth:\n  htpasswd:\n    realm: test\n    path: {}\n",
                file.display()
            ));
        }
        let cfg_path = dir.path().join("config.yml");
        std::fs::write(&cfg_path, cfg).expect("writing the registry config");
        let log = std::fs::File::create(dir.path().join("registry.log")).expect("registry log");
        let child = Command::new(bin)
            .arg("serve")
            .arg(&cfg_path)
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("registry log"))
            .stderr(log)
            .spawn()
            .expect("starting docker-registry");
        let mut reg = Self {
            child,
            addr,
            storage,
            dir,
        };
        reg.wait_ready();
        reg
    }

    /// What the registry wrote to stdout and stderr so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("registry.log")).unwrap_or_default()
    }

    /// Polls `/v2/` until the registry answers with an HTTP status line.
    fn wait_ready(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(status) = self.child.try_wait().expect("docker-registry status") {
                panic!(
                    "docker-registry exited before answering: {status}\n{}",
                    self.log()
                );
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
                "docker-registry did not answer on {} within 10 s\n{}",
                self.addr,
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Kills the registry (dropping it does too); its address then refuses connections.
    pub fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// The registry's address (`127.0.0.1:<port>`).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `<addr>/<repo_tag>`, e.g. `127.0.0.1:5000/test/img:v1`.
    pub fn reference(&self, repo_tag: &str) -> String {
        format!("{}/{repo_tag}", self.addr)
    }

    /// The file holding blob `digest` in the registry's storage.
    pub fn blob_file(&self, digest: &str) -> PathBuf {
        let hex = digest.strip_prefix("sha256:").expect("a sha256 digest");
        self.storage
            .join("docker/registry/v2/blobs/sha256")
            .join(&hex[..2])
            .join(hex)
            .join("data")
    }
}

/// The runtime part of an image's config, and its platform.
#[derive(Debug, Clone)]
pub struct ImageConfig {
    /// `GOARCH` spelling: `amd64`, `arm64`.
    pub architecture: String,
    /// `KEY=value` entries.
    pub env: Vec<String>,
    pub working_dir: Option<String>,
    /// `user[:group]`.
    pub user: Option<String>,
    pub entrypoint: Vec<String>,
    pub cmd: Vec<String>,
}

impl Default for ImageConfig {
    /// linux/amd64 with `PATH=/usr/bin:/bin` and nothing else set.
    fn default() -> Self {
        Self {
            architecture: "amd64".into(),
            env: vec!["PATH=/usr/bin:/bin".into()],
            working_dir: None,
            user: None,
            entrypoint: Vec::new(),
            cmd: Vec::new(),
        }
    }
}

impl ImageConfig {
    /// The config blob's JSON, with `diff_ids` as its layers.
    fn to_json(&self, diff_ids: &[String]) -> serde_json::Value {
        let mut config = serde_json::json!({"Env": self.env});
        if let Some(w) = &self.working_dir {
            config["WorkingDir"] = w.as_str().into();
        }
        if let Some(u) = &self.user {
            config["User"] = u.as_str().into();
        }
        if !self.entrypoint.is_empty() {
            config["Entrypoint"] = serde_json::json!(self.entrypoint);
        }
        if !self.cmd.is_empty() {
            config["Cmd"] = serde_json::json!(self.cmd);
        }
        serde_json::json!({
            "architecture": self.architecture,
            "os": "linux",
            "config": config,
            "rootfs": {"type": "layers", "diff_ids": diff_ids},
        })
    }
}

/// A blob's descriptor as JSON (`mediaType`, `digest`, `size`, and `platform` for an
/// image manifest), plus its digest.
#[derive(Debug, Clone)]
pub struct Descriptor {
    pub json: serde_json::Value,
    pub digest: String,
}

/// An OCI image layout being written.
pub struct Layout {
    dir: PathBuf,
}

impl Layout {
    /// An empty layout in `dir` (created).
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        let dir = dir.into();
        std::fs::create_dir_all(dir.join("blobs/sha256")).expect("creating the layout");
        std::fs::write(dir.join("oci-layout"), r#"{"imageLayoutVersion":"1.0.0"}"#)
            .expect("writing oci-layout");
        Self { dir }
    }

    /// The layout's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Stores `data` as a blob of `media_type`.
    pub fn blob(&self, data: &[u8], media_type: &str) -> Descriptor {
        let digest = sha256_digest(data);
        let hex = digest.strip_prefix("sha256:").unwrap_or(&digest);
        std::fs::write(self.dir.join("blobs/sha256").join(hex), data).expect("writing a blob");
        Descriptor {
            json: serde_json::json!({"mediaType": media_type, "digest": digest, "size": data.len()}),
            digest,
        }
    }

    /// A gzip layer from an uncompressed tar: its descriptor and diff id.
    pub fn gzip_layer(&self, tar: &[u8]) -> (Descriptor, String) {
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        gz.write_all(tar).expect("compressing a layer");
        let gz = gz.finish().expect("compressing a layer");
        (self.blob(&gz, LAYER_GZIP), sha256_digest(tar))
    }

    /// An image manifest of gzip `layers` (uncompressed tars, lowest first) with
    /// `config`: the manifest's descriptor, with its platform.
    pub fn image(&self, config: &ImageConfig, layers: &[&[u8]]) -> Descriptor {
        let (descs, diff_ids): (Vec<_>, Vec<_>) = layers.iter().map(|l| self.gzip_layer(l)).unzip();
        let config_json = serde_json::to_vec(&config.to_json(&diff_ids)).expect("config JSON");
        let config_desc = self.blob(&config_json, OCI_CONFIG);
        let manifest = serde_json::json!({
            "schemaVersion": 2,
            "mediaType": OCI_MANIFEST,
            "config": config_desc.json,
            "layers": descs.into_iter().map(|d| d.json).collect::<Vec<_>>(),
        });
        let mut m = self.blob(
            &serde_json::to_vec(&manifest).expect("manifest JSON"),
            OCI_MANIFEST,
        );
        m.json["platform"] =
            serde_json::json!({"architecture": config.architecture, "os": "linux"});
        m
    }

    /// An image index of `manifests`.
    pub fn index(&self, manifests: &[&Descriptor]) -> Descriptor {
        let index = serde_json::json!({
            "schemaVersion": 2,
            "mediaType": OCI_INDEX,
            "manifests": manifests.iter().map(|d| d.json.clone()).collect::<Vec<_>>(),
        });
        self.blob(&serde_json::to_vec(&index).expect("index JSON"), OCI_INDEX)
    }

    /// Writes `index.json` naming `desc` as `tag` (replacing earlier tags).
    pub fn tag(&self, desc: &Descriptor, tag: &str) {
        let mut entry = desc.json.clone();
        entry["annotations"] = serde_json::json!({"org.opencontainers.image.ref.name": tag});
        let index = serde_json::json!({"schemaVersion": 2, "manifests": [entry]});
        std::fs::write(
            self.dir.join("index.json"),
            serde_json::to_vec(&index).expect("index JSON"),
        )
        .expect("writing index.json");
    }
}

/// A tar of everything under `dir` (paths relative to it, symlinks kept, modes and
/// owners as on disk).
pub fn tar_of_dir(dir: &Path) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    b.follow_symlinks(false);
    b.mode(tar::HeaderMode::Complete);
    b.append_dir_all(".", dir)
        .expect("archiving the root filesystem");
    b.into_inner().expect("archiving the root filesystem")
}

/// A tar of regular files (mode 0644, owner root), in order: `(path, contents)`.
pub fn tar_of_files(files: &[(&str, &[u8])]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for (path, data) in files {
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(tar::EntryType::Regular);
        h.set_mode(0o644);
        h.set_size(data.len() as u64);
        h.set_mtime(1_700_000_000);
        h.set_uid(0);
        h.set_gid(0);
        b.append_data(&mut h, path, *data)
            .expect("archiving a file");
    }
    b.into_inner().expect("archiving files")
}

/// Writes a single-layer gzip image of the root filesystem at `rootfs` with `config`
/// into a new OCI layout at `layout_dir`, tagged `tag`.
pub fn write_image(rootfs: &Path, layout_dir: &Path, tag: &str, config: &ImageConfig) -> Layout {
    let layout = Layout::new(layout_dir);
    let m = layout.image(config, &[&tar_of_dir(rootfs)]);
    layout.tag(&m, tag);
    layout
}

/// Runs `skopeo --insecure-policy <args>`; panics with its stderr when it fails.
pub fn skopeo(args: &[&str]) {
    let bin = need("skopeo", "skopeo");
    let out = Command::new(bin)
        .arg("--insecure-policy")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("running skopeo");
    assert!(
        out.status.success(),
        "skopeo {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Pushes tag `tag` of the layout at `layout` to `dest` (`host:port/repo:tag`) over plain
/// HTTP; `extra` are more `skopeo copy` flags (`--dest-creds user:pass`, `--all`, ...).
pub fn push(layout: &Path, tag: &str, dest: &str, extra: &[&str]) {
    let src = format!("oci:{}:{tag}", layout.display());
    let dst = format!("docker://{dest}");
    let mut args = vec!["copy", "--dest-tls-verify=false"];
    args.extend_from_slice(extra);
    args.push(&src);
    args.push(&dst);
    skopeo(&args);
}
