//! The workspace's binaries for tests: static builds (as a jail or a microVM needs them)
//! found through an environment variable or in the target directory, or built with the
//! crate's `build-static.sh`; and plain builds next to the test executables.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::SystemTime;

use crate::{target_dir, workspace_root};

/// The target triples a static build lands under (`<target>/<triple>/release/`).
fn static_triples() -> [String; 2] {
    let arch = std::env::consts::ARCH;
    [
        format!("{arch}-unknown-linux-gnu"),
        format!("{arch}-unknown-linux-musl"),
    ]
}

/// A static build of `name` that already exists: the path in the environment variable
/// `env`, else `<target>/<triple>/release/<name>`.
pub fn find_static_binary(env: &str, name: &str) -> Option<PathBuf> {
    if let Some(p) = std::env::var_os(env) {
        return Some(PathBuf::from(p));
    }
    static_triples()
        .into_iter()
        .map(|t| target_dir().join(t).join("release").join(name))
        .find(|p| p.is_file())
}

/// A build of `name` that already exists: [`find_static_binary`], else a plain
/// `cargo build` (release, then debug) in the target directory.
pub fn find_binary(env: &str, name: &str) -> Option<PathBuf> {
    find_static_binary(env, name).or_else(|| {
        ["release", "debug"]
            .into_iter()
            .map(|profile| target_dir().join(profile).join(name))
            .find(|p| p.is_file())
    })
}

/// A statically linked binary of the workspace: the path in the environment variable
/// `env` (which must be a file), else `<target>/<triple>/release/<name>`, else what
/// `script` (relative to the workspace) builds and prints.
pub fn static_binary(env: &str, name: &str, script: &str) -> Result<PathBuf, String> {
    if let Some(p) = std::env::var_os(env) {
        let p = PathBuf::from(p);
        return if p.is_file() {
            Ok(p)
        } else {
            Err(format!("{env}={} is not a file", p.display()))
        };
    }
    if let Some(p) = find_static_binary(env, name) {
        return Ok(p);
    }
    build_static(script)
}

/// Runs `script` (relative to the workspace), which builds a static binary and prints its
/// path.
pub fn build_static(script: &str) -> Result<PathBuf, String> {
    let path = workspace_root().join(script);
    let out = Command::new(&path)
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| format!("running {}: {e}", path.display()))?;
    let built = String::from_utf8_lossy(&out.stdout).trim().to_string();
    if out.status.success() && Path::new(&built).is_file() {
        Ok(PathBuf::from(built))
    } else {
        Err(format!("{script} failed"))
    }
}

/// The static guest agent: `AGENTENV_GUEST_BIN`, else the static build, else built with
/// `agentenv-guest/build-static.sh`.
pub fn static_guest_binary() -> Result<PathBuf, String> {
    static_binary(
        "AGENTENV_GUEST_BIN",
        "agentenv-guest",
        "agentenv-guest/build-static.sh",
    )
}

/// A statically linked `agentenv-vmm`, as the node's jail needs it: `AGENTENV_VMM_BIN`
/// when set (scripts/test.sh builds it), else built with `agentenv-vmm/build-static.sh`
/// (once per process, so a stale static build is never taken). Panics when neither works.
pub fn static_vmm_binary() -> PathBuf {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| match std::env::var_os("AGENTENV_VMM_BIN") {
        Some(p) => PathBuf::from(p),
        None => build_static("agentenv-vmm/build-static.sh")
            .unwrap_or_else(|e| panic!("building a static agentenv-vmm failed: {e}")),
    })
    .clone()
}

/// The directory of the running test executable's profile (`target/<profile>/`; test
/// executables live in its `deps/`).
pub fn profile_dir() -> PathBuf {
    std::env::current_exe()
        .ok()
        .as_deref()
        .and_then(Path::parent)
        .and_then(Path::parent)
        .map(Path::to_path_buf)
        .unwrap_or_else(|| target_dir().join("debug"))
}

/// Newest modification time of the files under `path` (or of `path`, a file).
fn newest(path: &Path) -> SystemTime {
    let mut t = SystemTime::UNIX_EPOCH;
    let mut stack = vec![path.to_path_buf()];
    while let Some(p) = stack.pop() {
        let Ok(md) = std::fs::metadata(&p) else {
            continue;
        };
        if md.is_dir() {
            if let Ok(entries) = std::fs::read_dir(&p) {
                stack.extend(entries.flatten().map(|e| e.path()));
            }
        } else if let Ok(m) = md.modified() {
            t = t.max(m);
        }
    }
    t
}

/// The `agentenv-vmm` binary of this profile (`target/<profile>/agentenv-vmm`), built with
/// `cargo build` first unless it is newer than the crate's sources and the lock file (a
/// workspace test build already made it). Built once per process; panics when the build
/// fails.
pub fn vmm_binary() -> PathBuf {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        let bin = profile_dir().join("agentenv-vmm");
        let root = workspace_root();
        let sources = newest(&root.join("agentenv-vmm/src"))
            .max(newest(&root.join("agentenv-vmm/Cargo.toml")))
            .max(newest(&root.join("Cargo.lock")));
        let fresh = std::fs::metadata(&bin)
            .and_then(|m| m.modified())
            .is_ok_and(|built| built >= sources);
        if !fresh {
            let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
            let status = Command::new(cargo)
                .args(["build", "-q", "-p", "agentenv-vmm", "--bin", "agentenv-vmm"])
                .current_dir(&root)
                .status()
                .expect("running cargo build for agentenv-vmm");
            assert!(status.success(), "building agentenv-vmm failed");
        }
        assert!(bin.is_file(), "{} missing", bin.display());
        bin
    })
    .clone()
}
