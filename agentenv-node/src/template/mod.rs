//! Templates as root filesystems, kept under the node's data directory.
//!
//! Layout under the store's root:
//!
//! ```text
//! <root>/<name>/template.json    metadata, written before the template is published
//! <root>/<name>/rootfs/          the read-only root filesystem sandboxes stack on
//! <root>/.<name>.lock            held while a template is built (flock)
//! <root>/.build-<name>-<nonce>/  a build in progress; renamed to <name> when complete
//! ```
//!
//! A template directory appears only by an atomic rename of a finished build, so a failed
//! or interrupted build never leaves a half-built template behind.
//!
//! The template `base` is built on first use from Debian packages with `debootstrap`
//! (`--variant=minbase bookworm` plus [`BASE_PACKAGES`]). The Debian mirror is the
//! configured one, else the one the host's apt uses. Its login scripts are rewritten to
//! start no process of their own ([`login`]): the SDKs run every command in a login shell.

pub mod apply;
pub mod catalog;
pub mod image;
pub mod login;
mod mirror;
pub mod oci;
pub mod steps;

pub use mirror::{MirrorError, find_host_mirror, parse_deb822_sources, parse_one_line_sources};

use std::ffi::OsString;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use nix::fcntl::{Flock, FlockArg};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, BufReader};

/// The template built from Debian packages on first use.
pub const BASE_TEMPLATE: &str = "base";
/// The Debian suite of `base`.
pub const BASE_SUITE: &str = "bookworm";
/// Packages added to debootstrap's minbase variant for `base`.
pub const BASE_PACKAGES: &[&str] = &[
    "bash",
    "coreutils",
    "python3",
    "ca-certificates",
    "procps",
    "iproute2",
];
/// Environment variable that overrides the Debian mirror used to build `base`.
pub const MIRROR_ENV: &str = "AENV_DEBIAN_MIRROR";

/// Errors of the template store.
#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    #[error(
        "invalid template name {0:?}: use 1 to 64 characters from [A-Za-z0-9_.-], not starting with '.'"
    )]
    InvalidName(String),
    #[error("template {0:?} not found (only {BASE_TEMPLATE:?} is built on demand)")]
    NotFound(String),
    #[error(
        "debootstrap not found ({0}): install it with `apt-get install debootstrap` (it is listed in scripts/apt-packages.txt)"
    )]
    DebootstrapMissing(String),
    #[error(
        "no Debian mirror: set {MIRROR_ENV} or the node config's template mirror, or add a Debian source to /etc/apt ({0})"
    )]
    NoMirror(#[source] MirrorError),
    #[error(
        "building template {name:?} failed: debootstrap exited with {status}; last output:\n{tail}"
    )]
    BuildFailed {
        name: String,
        status: String,
        tail: String,
    },
    #[error("building template {name:?} took longer than {timeout:?}")]
    BuildTimedOut { name: String, timeout: Duration },
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
}

fn io_err(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> TemplateError {
    let context = context.into();
    move |source| TemplateError::Io { context, source }
}

/// Configuration of a [`TemplateStore`].
#[derive(Clone, Debug)]
pub struct TemplateStoreConfig {
    /// Directory holding the templates (`<home>/templates` on a node).
    pub root: PathBuf,
    /// The debootstrap program: a path, or a name looked up in `PATH`.
    pub debootstrap: PathBuf,
    /// Debian mirror URL; `None` takes [`MIRROR_ENV`], else the host's apt sources.
    pub mirror: Option<String>,
    /// Where the host's apt configuration lives (`/etc/apt`).
    pub apt_dir: PathBuf,
    /// Longest a build of `base` may take.
    pub build_timeout: Duration,
}

impl TemplateStoreConfig {
    /// Defaults for a store at `root`.
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self {
            root: root.into(),
            debootstrap: PathBuf::from("debootstrap"),
            mirror: None,
            apt_dir: PathBuf::from("/etc/apt"),
            build_timeout: Duration::from_secs(20 * 60),
        }
    }
}

/// Metadata written next to a template's root filesystem.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TemplateMeta {
    pub name: String,
    /// Seconds since the Unix epoch.
    pub built_at: u64,
    /// How it was made.
    pub source: String,
}

/// A published template.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Template {
    pub name: String,
    /// The read-only root filesystem.
    pub rootfs: PathBuf,
    pub meta: TemplateMeta,
}

/// Progress of a template build: one line at a time.
pub type Progress = Arc<dyn Fn(&str) + Send + Sync>;

/// A progress callback that only logs.
pub fn log_progress() -> Progress {
    Arc::new(|line| tracing::info!(target: "agentenv_node::template", "{line}"))
}

/// Root filesystems sandboxes are created from.
#[derive(Clone, Debug)]
pub struct TemplateStore {
    cfg: TemplateStoreConfig,
}

/// Checks a template name: 1 to 64 characters from `[A-Za-z0-9_.-]`, not starting with `.`.
pub fn validate_template_name(name: &str) -> Result<(), TemplateError> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.');
    if ok {
        Ok(())
    } else {
        Err(TemplateError::InvalidName(name.to_string()))
    }
}

impl TemplateStore {
    pub fn new(cfg: TemplateStoreConfig) -> Self {
        Self { cfg }
    }

    pub fn config(&self) -> &TemplateStoreConfig {
        &self.cfg
    }

    /// The directory of a template (present only once published).
    pub fn template_dir(&self, name: &str) -> PathBuf {
        self.cfg.root.join(name)
    }

    /// A published template, without building anything.
    pub fn get(&self, name: &str) -> Result<Template, TemplateError> {
        validate_template_name(name)?;
        let dir = self.template_dir(name);
        let meta_path = dir.join("template.json");
        let raw = match std::fs::read(&meta_path) {
            Ok(raw) => raw,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(TemplateError::NotFound(name.to_string()));
            }
            Err(e) => return Err(io_err(format!("reading {}", meta_path.display()))(e)),
        };
        let meta: TemplateMeta = serde_json::from_slice(&raw).map_err(|e| TemplateError::Io {
            context: format!("parsing {}", meta_path.display()),
            source: std::io::Error::other(e),
        })?;
        Ok(Template {
            name: name.to_string(),
            rootfs: dir.join("rootfs"),
            meta,
        })
    }

    /// Names of the published templates.
    pub fn list(&self) -> Result<Vec<String>, TemplateError> {
        let mut names = Vec::new();
        let entries = match std::fs::read_dir(&self.cfg.root) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(names),
            Err(e) => return Err(io_err(format!("listing {}", self.cfg.root.display()))(e)),
        };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if validate_template_name(&name).is_ok() && self.get(&name).is_ok() {
                names.push(name);
            }
        }
        names.sort();
        Ok(names)
    }

    /// The template, built first if it is `base` and not built yet. Concurrent callers
    /// (in this process or others sharing the store) wait for one build.
    pub async fn ensure(&self, name: &str, progress: Progress) -> Result<Template, TemplateError> {
        match self.get(name) {
            Ok(t) => return Ok(t),
            Err(TemplateError::NotFound(_)) if name == BASE_TEMPLATE => {}
            Err(e) => return Err(e),
        }
        let lock = self.build_lock(name).await?;
        // Someone else may have built it while we waited for the lock.
        if let Ok(t) = self.get(name) {
            drop(lock);
            return Ok(t);
        }
        self.remove_stale_builds(name);
        let result = self.build_base(name, progress).await;
        drop(lock);
        result
    }

    /// Template `name`, made by `make` (given the new root filesystem directory) unless
    /// it is there. Like [`TemplateStore::ensure`], concurrent callers wait for one
    /// build, and the template appears whole or not at all.
    pub async fn ensure_derived<F, Fut>(
        &self,
        name: &str,
        source: &str,
        progress: Progress,
        make: F,
    ) -> Result<Template, TemplateError>
    where
        F: FnOnce(PathBuf) -> Fut,
        Fut: std::future::Future<Output = Result<(), String>>,
    {
        validate_template_name(name)?;
        if let Ok(t) = self.get(name) {
            return Ok(t);
        }
        let lock = self.build_lock(name).await?;
        if let Ok(t) = self.get(name) {
            drop(lock);
            return Ok(t);
        }
        self.remove_stale_builds(name);
        let nonce: u64 = rand::random();
        let build_dir = self.cfg.root.join(format!(".build-{name}-{nonce:016x}"));
        let rootfs = build_dir.join("rootfs");
        std::fs::create_dir_all(&rootfs)
            .map_err(io_err(format!("creating {}", rootfs.display())))?;
        progress(&format!(
            "preparing template {name} on this node from {source}"
        ));
        let made = make(rootfs)
            .await
            .map_err(|reason| TemplateError::BuildFailed {
                name: name.to_string(),
                status: "failed".into(),
                tail: reason,
            });
        let result = made.and_then(|()| self.publish(&build_dir, name, source));
        if let Err(e) = result {
            if let Err(rm) = std::fs::remove_dir_all(&build_dir) {
                tracing::warn!(path = %build_dir.display(), error = %rm, "removing a failed template");
            }
            drop(lock);
            return Err(e);
        }
        drop(lock);
        progress(&format!("template {name} is ready on this node"));
        self.get(name)
    }

    /// Takes the build lock of template `name` (waiting for another builder, in this
    /// process or another sharing the store).
    async fn build_lock(&self, name: &str) -> Result<Flock<File>, TemplateError> {
        std::fs::create_dir_all(&self.cfg.root)
            .map_err(io_err(format!("creating {}", self.cfg.root.display())))?;
        let lock_path = self.cfg.root.join(format!(".{name}.lock"));
        tokio::task::spawn_blocking(move || lock_file(&lock_path))
            .await
            .map_err(|e| TemplateError::Io {
                context: "waiting for the template build lock".into(),
                source: std::io::Error::other(e),
            })?
    }

    /// Writes `template.json` into the finished `build_dir` and renames it to template
    /// `name` (the template appears whole). Call with the lock.
    fn publish(&self, build_dir: &Path, name: &str, source: &str) -> Result<(), TemplateError> {
        let meta = TemplateMeta {
            name: name.to_string(),
            built_at: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
            source: source.to_string(),
        };
        let raw = serde_json::to_vec_pretty(&meta).map_err(|e| TemplateError::Io {
            context: "encoding template.json".into(),
            source: std::io::Error::other(e),
        })?;
        std::fs::write(build_dir.join("template.json"), raw)
            .map_err(io_err("writing template.json"))?;
        std::fs::rename(build_dir, self.template_dir(name)).map_err(io_err(format!(
            "publishing template {name} into {}",
            self.template_dir(name).display()
        )))
    }

    /// Removes build directories of `name` left by interrupted builds. Call with the lock.
    fn remove_stale_builds(&self, name: &str) {
        let prefix = format!(".build-{name}-");
        if let Ok(entries) = std::fs::read_dir(&self.cfg.root) {
            for entry in entries.flatten() {
                if entry.file_name().to_string_lossy().starts_with(&prefix) {
                    tracing::warn!(path = %entry.path().display(), "removing an interrupted template build");
                    let _ = std::fs::remove_dir_all(entry.path());
                }
            }
        }
    }

    fn mirror(&self) -> Result<String, TemplateError> {
        if let Some(m) = &self.cfg.mirror {
            return Ok(m.clone());
        }
        if let Some(m) = std::env::var_os(MIRROR_ENV).filter(|m| !m.is_empty()) {
            return Ok(m.to_string_lossy().into_owned());
        }
        find_host_mirror(&self.cfg.apt_dir, BASE_SUITE).map_err(TemplateError::NoMirror)
    }

    async fn build_base(&self, name: &str, progress: Progress) -> Result<Template, TemplateError> {
        let debootstrap = resolve_program(&self.cfg.debootstrap).ok_or_else(|| {
            TemplateError::DebootstrapMissing(self.cfg.debootstrap.display().to_string())
        })?;
        let mirror = self.mirror()?;
        let nonce: u64 = rand::random();
        let build_dir = self.cfg.root.join(format!(".build-{name}-{nonce:016x}"));
        let rootfs = build_dir.join("rootfs");
        std::fs::create_dir_all(&rootfs)
            .map_err(io_err(format!("creating {}", rootfs.display())))?;
        progress(&format!(
            "building template {name}: debootstrap --variant=minbase {BASE_SUITE} from {mirror}"
        ));
        let result = tokio::time::timeout(
            self.cfg.build_timeout,
            self.run_debootstrap(name, &debootstrap, &mirror, &rootfs, &progress),
        )
        .await
        .unwrap_or_else(|_| {
            Err(TemplateError::BuildTimedOut {
                name: name.to_string(),
                timeout: self.cfg.build_timeout,
            })
        })
        .and_then(|()| finish_rootfs(&rootfs))
        .and_then(|()| {
            let source = format!(
                "debootstrap --variant=minbase {BASE_SUITE} +{}",
                BASE_PACKAGES.join(",")
            );
            self.publish(&build_dir, name, &source)
        });
        if let Err(e) = result {
            progress(&format!("building template {name} failed: {e}"));
            if let Err(rm) = std::fs::remove_dir_all(&build_dir) {
                tracing::warn!(path = %build_dir.display(), error = %rm, "removing a failed template build");
            }
            return Err(e);
        }
        progress(&format!("template {name} is ready"));
        self.get(name)
    }

    async fn run_debootstrap(
        &self,
        name: &str,
        debootstrap: &Path,
        mirror: &str,
        rootfs: &Path,
        progress: &Progress,
    ) -> Result<(), TemplateError> {
        let mut cmd = tokio::process::Command::new(debootstrap);
        cmd.arg("--variant=minbase")
            .arg(format!("--include={}", BASE_PACKAGES.join(",")))
            .arg(BASE_SUITE)
            .arg(rootfs)
            .arg(mirror)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        let mut child = cmd
            .spawn()
            .map_err(io_err(format!("starting {}", debootstrap.display())))?;
        let stdout = child.stdout.take().map(|s| BufReader::new(s).lines());
        let stderr = child.stderr.take().map(|s| BufReader::new(s).lines());
        let tail = Arc::new(output_tail::Tail::new(20));
        let out = pump_lines(stdout, &tail, progress);
        let err = pump_lines(stderr, &tail, progress);
        let ((), (), status) = tokio::join!(out, err, child.wait());
        let status = status.map_err(io_err("waiting for debootstrap"))?;
        if status.success() {
            Ok(())
        } else {
            Err(TemplateError::BuildFailed {
                name: name.to_string(),
                status: status.to_string(),
                tail: tail.joined(),
            })
        }
    }
}

async fn pump_lines<R: tokio::io::AsyncRead + Unpin>(
    lines: Option<tokio::io::Lines<BufReader<R>>>,
    tail: &output_tail::Tail,
    progress: &Progress,
) {
    if let Some(mut lines) = lines {
        while let Ok(Some(line)) = lines.next_line().await {
            progress(&line);
            tail.push(line);
        }
    }
}

/// Last lines of a child's output, for error messages.
mod output_tail {
    use std::collections::VecDeque;
    use std::sync::Mutex;

    pub struct Tail {
        max: usize,
        lines: Mutex<VecDeque<String>>,
    }

    impl Tail {
        pub fn new(max: usize) -> Self {
            Self {
                max,
                lines: Mutex::new(VecDeque::new()),
            }
        }

        pub fn push(&self, line: String) {
            let mut lines = self.lines.lock().unwrap_or_else(|e| e.into_inner());
            if lines.len() == self.max {
                lines.pop_front();
            }
            lines.push_back(line);
        }

        pub fn joined(&self) -> String {
            let lines = self.lines.lock().unwrap_or_else(|e| e.into_inner());
            lines.iter().cloned().collect::<Vec<_>>().join("\n")
        }
    }
}

/// Trims a freshly bootstrapped root filesystem and adds what sandboxes need.
fn finish_rootfs(rootfs: &Path) -> Result<(), TemplateError> {
    for dir in ["var/cache/apt/archives", "var/lib/apt/lists"] {
        let dir = rootfs.join(dir);
        if let Ok(entries) = std::fs::read_dir(&dir) {
            for entry in entries.flatten() {
                let p = entry.path();
                if p.is_file() {
                    let _ = std::fs::remove_file(p);
                }
            }
        }
    }
    std::fs::create_dir_all(rootfs.join("agentenv")).map_err(io_err("creating /agentenv"))?;
    login::lighten_login_scripts(rootfs).map_err(io_err("rewriting the login scripts"))?;
    Ok(())
}

fn lock_file(path: &Path) -> Result<Flock<File>, TemplateError> {
    let file = File::options()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .map_err(io_err(format!("opening {}", path.display())))?;
    Flock::lock(file, FlockArg::LockExclusive).map_err(|(_, errno)| TemplateError::Io {
        context: format!("locking {}", path.display()),
        source: std::io::Error::from(errno),
    })
}

/// A program path as given, or looked up in `PATH` (plus the sbin directories, where
/// debootstrap lives and which a non-login root shell may lack).
pub fn resolve_program(program: &Path) -> Option<PathBuf> {
    if program.components().count() > 1 {
        return is_executable(program).then(|| program.to_path_buf());
    }
    let mut dirs: Vec<PathBuf> = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect())
        .unwrap_or_default();
    for extra in ["/usr/local/sbin", "/usr/sbin", "/sbin"] {
        dirs.push(PathBuf::from(extra));
    }
    dirs.into_iter()
        .map(|d| d.join(OsString::from(program.as_os_str())))
        .find(|p| is_executable(p))
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(path)
        .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        .unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn template_names_are_checked() {
        assert!(validate_template_name("base").is_ok());
        assert!(validate_template_name("my-tpl_1.0").is_ok());
        assert!(validate_template_name("").is_err());
        assert!(validate_template_name(".hidden").is_err());
        assert!(validate_template_name("a/b").is_err());
        assert!(validate_template_name("..").is_err());
    }

    #[test]
    fn unknown_template_is_not_found() {
        let dir = tempfile::tempdir().unwrap();
        let store = TemplateStore::new(TemplateStoreConfig::new(dir.path()));
        assert!(matches!(store.get("nope"), Err(TemplateError::NotFound(_))));
        assert!(store.list().unwrap().is_empty());
    }

    #[tokio::test]
    async fn ensure_does_not_build_templates_other_than_base() {
        let dir = tempfile::tempdir().unwrap();
        let store = TemplateStore::new(TemplateStoreConfig::new(dir.path()));
        let err = store.ensure("custom", log_progress()).await.unwrap_err();
        assert!(
            matches!(err, TemplateError::NotFound(ref n) if n == "custom"),
            "{err}"
        );
    }

    /// Asserts that `dir` holds nothing but lock files.
    fn assert_nothing_left(dir: &Path) {
        let left: Vec<_> = std::fs::read_dir(dir)
            .unwrap()
            .flatten()
            .map(|e| e.file_name())
            .filter(|n| !n.to_string_lossy().ends_with(".lock"))
            .collect();
        assert!(left.is_empty(), "left behind: {left:?}");
    }

    #[tokio::test]
    async fn missing_debootstrap_is_a_clear_error_and_leaves_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = TemplateStoreConfig::new(dir.path().join("templates"));
        cfg.debootstrap = dir.path().join("no-such-debootstrap");
        cfg.mirror = Some("http://mirror.invalid/debian".into());
        let store = TemplateStore::new(cfg);
        let err = store
            .ensure(BASE_TEMPLATE, log_progress())
            .await
            .unwrap_err();
        assert!(matches!(err, TemplateError::DebootstrapMissing(_)), "{err}");
        assert!(
            err.to_string().contains("apt-get install debootstrap"),
            "{err}"
        );
        assert_nothing_left(&dir.path().join("templates"));
    }

    #[tokio::test]
    async fn failed_build_leaves_no_half_built_template() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        // A debootstrap that writes part of a root filesystem, then fails.
        let fake = dir.path().join("fake-debootstrap");
        std::fs::write(
            &fake,
            "#!/bin/sh\nfor a; do t=\"$p\"; p=\"$a\"; done\nmkdir -p \"$t/etc\" && echo partial > \"$t/etc/os-release\"\necho 'I: Retrieving InRelease'\necho 'E: Failed getting release file' >&2\nexit 1\n",
        )
        .unwrap();
        std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
        let mut cfg = TemplateStoreConfig::new(dir.path().join("templates"));
        cfg.debootstrap = fake;
        cfg.mirror = Some("http://mirror.invalid/debian".into());
        let store = TemplateStore::new(cfg);
        let lines = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
        let seen = lines.clone();
        let progress: Progress = Arc::new(move |l| seen.lock().unwrap().push(l.to_string()));
        let err = store.ensure(BASE_TEMPLATE, progress).await.unwrap_err();
        match &err {
            TemplateError::BuildFailed { tail, .. } => {
                assert!(tail.contains("Failed getting release file"), "{tail}")
            }
            other => panic!("unexpected error: {other}"),
        }
        let lines = lines.lock().unwrap();
        assert!(
            lines.iter().any(|l| l.contains("I: Retrieving InRelease")),
            "{lines:?}"
        );
        assert_nothing_left(&dir.path().join("templates"));
        assert!(matches!(
            store.get(BASE_TEMPLATE),
            Err(TemplateError::NotFound(_))
        ));
    }
}
