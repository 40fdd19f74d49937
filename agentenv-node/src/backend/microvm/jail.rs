//! The VMM's jail: what an `agentenv-vmm` process sees and may touch.
//!
//! The VMM is started by [`crate::host::spawn`] in the sandbox's network namespace and
//! cgroup (whose device allow-list is [`crate::host::devices::MICROVM`]), in mount and PID
//! namespaces of its own, pivoted into `<sandbox dir>/jail/`, as the sandbox's unprivileged
//! host uid and gid (the base of its id range) with no capabilities, `no_new_privs`, an
//! empty environment, and its own seccomp filter once the VM is built. The jail holds:
//!
//! ```text
//! /vm.json        the VM configuration (node-owned, read-only to the VMM)
//! /vmlinux        the guest kernel, bound read-only
//! /rootfs.ext4    the sandbox's disk (owned by the VMM's uid)
//! /dev/           kvm, net/tun, null, urandom: the only device nodes, on a tmpfs
//! /run/           owned by the VMM's uid: api.sock, vsock.sock, serial.log, snapshots
//! ```
//!
//! The node treats everything under `run/` as the VMM's (a compromised VMM controls it):
//! it moves files out of there only after checking they are regular files, and never
//! writes through a path there. The jail directory itself is node-owned, so the VMM
//! cannot replace `run/`, the disk or the configuration with links.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use crate::backend::BackendError;
use crate::host::ids::IdRange;

/// The VMM's configuration inside the jail.
pub const CONFIG: &str = "/vm.json";
/// The guest kernel inside the jail.
pub const KERNEL: &str = "/vmlinux";
/// The disk inside the jail.
pub const DISK: &str = "/rootfs.ext4";
/// The VMM's own directory inside the jail.
pub const RUN: &str = "/run";
/// The control socket inside the jail.
pub const API_SOCK: &str = "/run/api.sock";
/// The serial console's log inside the jail.
pub const SERIAL_LOG: &str = "/run/serial.log";
/// Where a paused VM's snapshot is, inside the jail.
pub const SNAPSHOT: &str = "/run/snapshot";
/// Where a pause writes its snapshot before it is published, inside the jail.
pub const SNAPSHOT_STAGING: &str = "/run/.snapshot.tmp";
/// Where a capture ([`crate::backend::SandboxBackend::snapshot`]) is written, inside the
/// jail.
pub const CAPTURE: &str = "/run/capture";

/// The device nodes of the jail's /dev: `(path under /dev, major, minor)`.
pub const DEVICES: &[(&str, u64, u64)] = &[
    ("null", 1, 3),
    ("urandom", 1, 9),
    ("kvm", 10, 232),
    ("net/tun", 10, 200),
];

/// The paths of one sandbox's jail, as the node sees them.
#[derive(Clone, Debug)]
pub struct Jail {
    root: PathBuf,
}

impl Jail {
    /// The jail of the sandbox directory `dir`.
    pub fn of(dir: &Path) -> Self {
        Self {
            root: dir.join("jail"),
        }
    }

    /// The jail's root directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// A path inside the jail (absolute there), as the node sees it.
    pub fn host_path(&self, inside: &str) -> PathBuf {
        self.root.join(inside.trim_start_matches('/'))
    }

    /// Makes the jail directories and gives the disk (already in place) and `run/` to the
    /// VMM's `ids` (a kept jail may belong to another range).
    pub fn prepare(&self, ids: IdRange) -> Result<(), BackendError> {
        let mk = |p: &Path| {
            std::fs::create_dir_all(p)
                .map_err(|e| BackendError::io(format!("creating {}", p.display()), e))
        };
        mk(&self.root)?;
        mk(&self.host_path("/dev"))?;
        let run = self.host_path(RUN);
        match std::fs::symlink_metadata(&run) {
            Ok(m) if m.is_dir() => {}
            Ok(_) => {
                return Err(BackendError::BadKeptState {
                    path: run,
                    reason: "run/ is not a directory".into(),
                });
            }
            Err(_) => mk(&run)?,
        }
        let kernel = self.host_path(KERNEL);
        if std::fs::symlink_metadata(&kernel).is_err() {
            std::fs::write(&kernel, b"")
                .map_err(|e| BackendError::io(format!("creating {}", kernel.display()), e))?;
        }
        let owner = ids.base;
        let disk = self.host_path(DISK);
        let m = std::fs::symlink_metadata(&disk)
            .map_err(|e| BackendError::io(format!("looking at {}", disk.display()), e))?;
        if !m.is_file() {
            return Err(BackendError::BadKeptState {
                path: disk,
                reason: "the disk is not a regular file".into(),
            });
        }
        std::os::unix::fs::lchown(&disk, Some(owner), Some(owner)).map_err(|e| {
            BackendError::io(format!("changing the owner of {}", disk.display()), e)
        })?;
        // run/ and what a VMM of another range left there (a kept snapshot).
        let mut stack = vec![run];
        while let Some(p) = stack.pop() {
            let m = std::fs::symlink_metadata(&p)
                .map_err(|e| BackendError::io(format!("looking at {}", p.display()), e))?;
            if m.uid() != owner || m.gid() != owner {
                std::os::unix::fs::lchown(&p, Some(owner), Some(owner)).map_err(|e| {
                    BackendError::io(format!("changing the owner of {}", p.display()), e)
                })?;
            }
            if m.is_dir() {
                for e in std::fs::read_dir(&p)
                    .map_err(|e| BackendError::io(format!("listing {}", p.display()), e))?
                {
                    stack.push(
                        e.map_err(|e| BackendError::io(format!("listing {}", p.display()), e))?
                            .path(),
                    );
                }
            }
        }
        Ok(())
    }
}

/// Moves the regular file `from` (written by the VMM) to `to`, refusing anything else a
/// compromised VMM may have put there (a link to a host file, say).
pub fn take_vmm_file(from: &Path, to: &Path) -> Result<(), BackendError> {
    let m = std::fs::symlink_metadata(from)
        .map_err(|e| BackendError::io(format!("looking at {}", from.display()), e))?;
    if !m.is_file() || m.nlink() != 1 {
        return Err(BackendError::Setup(format!(
            "{} is not a regular file of the VMM's own: refused",
            from.display()
        )));
    }
    std::fs::rename(from, to).or_else(|e| {
        if e.raw_os_error() != Some(libc::EXDEV) {
            return Err(BackendError::io(
                format!("moving {} to {}", from.display(), to.display()),
                e,
            ));
        }
        // Another file system: copy through a descriptor opened without following links.
        use std::os::unix::fs::OpenOptionsExt;
        let mut src = std::fs::File::options()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(from)
            .map_err(|e| BackendError::io(format!("opening {}", from.display()), e))?;
        let mut dst = std::fs::File::create(to)
            .map_err(|e| BackendError::io(format!("creating {}", to.display()), e))?;
        std::io::copy(&mut src, &mut dst)
            .map_err(|e| BackendError::io(format!("copying {}", from.display()), e))?;
        let _ = std::fs::remove_file(from);
        Ok(())
    })
}

/// The last lines of a log file, for error messages (never through a link).
pub fn log_tail(path: &Path) -> String {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let mut text = String::new();
    if let Ok(mut f) = std::fs::File::options()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
    {
        let _ = (&mut f).take(1 << 20).read_to_string(&mut text);
    }
    let lines: Vec<&str> = text.lines().rev().take(5).collect();
    let tail: Vec<&str> = lines.into_iter().rev().collect();
    if tail.is_empty() {
        "(empty)".into()
    } else {
        tail.join(" | ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn files_the_vmm_controls_are_taken_only_when_they_are_its_own_regular_files() {
        let t = tempfile::tempdir().unwrap();
        let victim = t.path().join("victim");
        std::fs::write(&victim, b"host secret").unwrap();
        let run = t.path().join("run");
        std::fs::create_dir(&run).unwrap();
        std::os::unix::fs::symlink(&victim, run.join("memory")).unwrap();
        std::fs::hard_link(&victim, run.join("state")).unwrap();
        std::fs::write(run.join("ok"), b"vm").unwrap();
        let out = t.path().join("out");
        std::fs::create_dir(&out).unwrap();
        assert!(take_vmm_file(&run.join("memory"), &out.join("memory")).is_err());
        assert!(take_vmm_file(&run.join("state"), &out.join("state")).is_err());
        take_vmm_file(&run.join("ok"), &out.join("ok")).unwrap();
        assert_eq!(std::fs::read(out.join("ok")).unwrap(), b"vm");
        assert!(!out.join("memory").exists() && !out.join("state").exists());
        assert_eq!(std::fs::read(&victim).unwrap(), b"host secret");
        // A log that is a link is not read.
        std::os::unix::fs::symlink(&victim, run.join("vmm.log")).unwrap();
        assert_eq!(log_tail(&run.join("vmm.log")), "(empty)");
    }
}
