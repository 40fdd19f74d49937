//! Shared by the microvm backend tests: the workspace's `agentenv-vmm` binary.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::SystemTime;

/// Newest modification time of the files under `dir`.
fn newest(dir: &Path) -> SystemTime {
    let mut t = SystemTime::UNIX_EPOCH;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            let Ok(md) = e.metadata() else { continue };
            if md.is_dir() {
                stack.push(e.path());
            } else if let Ok(m) = md.modified() {
                t = t.max(m);
            }
        }
    }
    t
}

/// The `agentenv-vmm` binary next to the test binaries (`target/<profile>/`), built with
/// `cargo build` first unless it is newer than the crate's sources and the lock file
/// (a workspace test build already made it).
pub fn vmm_binary() -> PathBuf {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        // Test binaries live in target/<profile>/deps/.
        let exe = std::env::current_exe().unwrap();
        let bin = exe
            .parent()
            .and_then(Path::parent)
            .unwrap()
            .join("agentenv-vmm");
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let sources = newest(&root.join("agentenv-vmm/src"))
            .max(newest(&root.join("agentenv-vmm/Cargo.toml")))
            .max(
                std::fs::metadata(root.join("Cargo.lock"))
                    .and_then(|m| m.modified())
                    .unwrap_or(SystemTime::UNIX_EPOCH),
            );
        let fresh = std::fs::metadata(&bin)
            .and_then(|m| m.modified())
            .is_ok_and(|built| built >= sources);
        if !fresh {
            let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
            let status = std::process::Command::new(cargo)
                .args(["build", "-q", "-p", "agentenv-vmm", "--bin", "agentenv-vmm"])
                .current_dir(env!("CARGO_MANIFEST_DIR"))
                .status()
                .expect("running cargo build for agentenv-vmm");
            assert!(status.success(), "building agentenv-vmm failed");
        }
        assert!(bin.is_file(), "{} missing", bin.display());
        bin
    })
    .clone()
}

/// A statically linked `agentenv-vmm`, as the node's jail needs it: `AGENTENV_VMM_BIN`
/// when set (scripts/test.sh builds it), else built with agentenv-vmm/build-static.sh.
pub fn static_vmm_binary() -> PathBuf {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        if let Some(p) = std::env::var_os("AGENTENV_VMM_BIN") {
            return PathBuf::from(p);
        }
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../agentenv-vmm/build-static.sh");
        let out = std::process::Command::new(&script)
            .stderr(std::process::Stdio::inherit())
            .output()
            .expect("running agentenv-vmm/build-static.sh");
        assert!(
            out.status.success(),
            "building a static agentenv-vmm failed"
        );
        PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
    })
    .clone()
}
