//! The node's writes into a sandbox's writable layer, which never follow the tenant's
//! links.
//!
//! A layer may come from the tenant: a kept layer (a sandbox paused before a node restart)
//! or a snapshot holds whatever its sandbox's root wrote, symlinks included. Before a
//! sandbox starts on it, the node writes `/etc/hostname`, `/etc/hosts`, `/etc/resolv.conf`
//! and the agent's mount point, and needs `/proc`, `/sys` and `/dev` to be plain
//! directories (the mounts go there). Every such write goes through
//! [`SafeDir`](crate::host::safefs::SafeDir), which resolves paths beneath the layer without
//! following any link: a symlink, a device or any other non-directory where the node needs
//! a directory is removed (the template's directory shows through again), and one where it
//! writes a file is replaced by a regular file. No process of the sandbox runs meanwhile.

use std::net::Ipv4Addr;
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use crate::backend::BackendError;
use crate::host::ids::{IDS_PER_SANDBOX, IdRange};
use crate::host::safefs::{SafeDir, SafeFsError};

/// The top-level directories the sandbox's mounts go onto.
const MOUNT_POINTS: &[&str] = &["proc", "sys", "dev"];

/// The files the node writes into a sandbox's `/etc`.
pub struct GuestFiles<'a> {
    pub hostname: &'a str,
    pub ip: Ipv4Addr,
    pub dns: &'a [Ipv4Addr],
    /// Where the agent binary is bound (absolute, two components: `/dir/file`).
    pub agent_path: &'a str,
}

/// [`GuestFiles`] as contents: `(name in /etc, bytes)`, and the agent's path.
pub struct Rendered {
    etc: Vec<(&'static str, Vec<u8>)>,
    agent_dir: String,
    agent_file: String,
}

impl GuestFiles<'_> {
    pub fn render(&self) -> Rendered {
        let resolv: String = self
            .dns
            .iter()
            .map(|ip| format!("nameserver {ip}\n"))
            .collect();
        let (dir, file) = self
            .agent_path
            .trim_start_matches('/')
            .split_once('/')
            .unwrap_or(("agentenv", "agentenv-guest"));
        Rendered {
            etc: vec![
                ("hostname", format!("{}\n", self.hostname).into_bytes()),
                (
                    "hosts",
                    format!(
                        "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n{}\t{}\n",
                        self.ip, self.hostname
                    )
                    .into_bytes(),
                ),
                ("resolv.conf", resolv.into_bytes()),
            ],
            agent_dir: dir.to_string(),
            agent_file: file.to_string(),
        }
    }
}

fn layer_err(e: SafeFsError) -> BackendError {
    BackendError::Setup(format!("preparing the writable layer: {e}"))
}

/// Prepares the writable layer `upper` (with `work`) of a sandbox with ids `ids` before its
/// PID 1 starts: owners, the mount points, the guest files. `fresh`: the layer was just
/// made (empty), else it was kept or imported and is the tenant's.
pub fn prepare(
    upper: &Path,
    work: &Path,
    ids: IdRange,
    fresh: bool,
    files: &Rendered,
) -> Result<(), BackendError> {
    for d in [upper, work] {
        match std::fs::symlink_metadata(d) {
            Ok(m) if m.is_dir() => {}
            Ok(_) => {
                return Err(BackendError::BadKeptState {
                    path: d.to_path_buf(),
                    reason: "it is not a directory".into(),
                });
            }
            Err(_) => std::fs::create_dir_all(d)
                .map_err(|e| BackendError::io(format!("creating {}", d.display()), e))?,
        }
    }
    let owner = ids.base;
    if fresh {
        std::os::unix::fs::lchown(upper, Some(owner), Some(owner))
            .map_err(|e| BackendError::io("changing the owner of the writable layer", e))?;
    } else {
        let uid = std::fs::symlink_metadata(upper)
            .map_err(|e| BackendError::io("looking at the layer", e))?
            .uid();
        if uid != owner {
            // A layer of another id range (kept before the sandbox had a range of its
            // own, or imported): its files move into this range.
            shift_ids(upper, uid, owner)?;
        }
    }
    let root = SafeDir::open(upper)
        .map_err(layer_err)?
        .with_owner(owner, owner);
    // Mount points must be directories (or absent, so the template's show); the
    // directories the node writes into must not be links.
    for name in MOUNT_POINTS
        .iter()
        .copied()
        .chain(["etc", files.agent_dir.as_str()])
    {
        if root.remove_non_dir(name).map_err(layer_err)? {
            tracing::warn!(
                name,
                "removed a non-directory the sandbox left where the node needs a directory"
            );
        }
    }
    for (name, bytes) in &files.etc {
        root.write_file(Path::new("etc").join(name), bytes, 0o644)
            .map_err(layer_err)?;
    }
    root.ensure_empty_file(Path::new(&files.agent_dir).join(&files.agent_file), 0o755)
        .map_err(layer_err)?;
    Ok(())
}

/// Moves every file of the layer `upper` from the id range starting at `from` (or, for a
/// layer made before ranges existed, from the host's own ids) into the range at `to`.
/// Ids outside the old range become the new range's `nobody` (65534).
fn shift_ids(upper: &Path, from: u32, to: u32) -> Result<(), BackendError> {
    let from_base = if from < IDS_PER_SANDBOX { 0 } else { from };
    tracing::info!(
        layer = %upper.display(),
        from = from_base,
        to,
        "moving a kept layer into the sandbox's id range"
    );
    let shift = |id: u32| -> u32 {
        match id.checked_sub(from_base) {
            Some(off) if off < IDS_PER_SANDBOX => to + off,
            _ => to + 65534,
        }
    };
    let mut stack = vec![upper.to_path_buf()];
    while let Some(p) = stack.pop() {
        let m = std::fs::symlink_metadata(&p)
            .map_err(|e| BackendError::io(format!("looking at {}", p.display()), e))?;
        std::os::unix::fs::lchown(&p, Some(shift(m.uid())), Some(shift(m.gid())))
            .map_err(|e| BackendError::io(format!("changing the owner of {}", p.display()), e))?;
        if m.is_dir() {
            for e in std::fs::read_dir(&p)
                .map_err(|e| BackendError::io(format!("listing {}", p.display()), e))?
            {
                let e = e.map_err(|e| BackendError::io(format!("listing {}", p.display()), e))?;
                stack.push(e.path());
            }
        }
    }
    Ok(())
}

/// Moves the writable layer of the sandbox directory `dir` (its unmounted, synced image
/// in `disk/`) to `kept` and makes the move durable.
pub fn keep(dir: &Path, kept: &Path) -> Result<(), String> {
    std::fs::create_dir(kept).map_err(|e| format!("creating {}: {e}", kept.display()))?;
    std::fs::rename(dir.join("disk"), kept.join("disk")).map_err(|e| {
        format!(
            "moving {} to {}: {e}",
            dir.join("disk").display(),
            kept.display()
        )
    })?;
    for d in [kept, kept.parent().unwrap_or(kept)] {
        let f = std::fs::File::open(d).map_err(|e| format!("opening {}: {e}", d.display()))?;
        // SAFETY: fsync takes a descriptor `f` keeps open for the call.
        if unsafe { libc::fsync(f.as_raw_fd()) } != 0 {
            return Err(format!(
                "syncing {}: {}",
                d.display(),
                std::io::Error::last_os_error()
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn files() -> Rendered {
        GuestFiles {
            hostname: "sbx",
            ip: Ipv4Addr::new(10, 1, 0, 2),
            dns: &[Ipv4Addr::new(10, 0, 0, 53)],
            agent_path: "/agentenv/agentenv-guest",
        }
        .render()
    }

    #[test]
    fn planted_links_are_replaced_and_nothing_outside_the_layer_changes() {
        if !nix::unistd::Uid::effective().is_root() {
            eprintln!("SKIPPED: changing owners needs root");
            return;
        }
        let t = tempfile::tempdir().unwrap();
        let victim = t.path().join("victim");
        std::fs::create_dir(&victim).unwrap();
        std::fs::write(victim.join("hosts"), b"host file").unwrap();
        let upper = t.path().join("upper");
        let work = t.path().join("work");
        std::fs::create_dir_all(upper.join("etc")).unwrap();
        std::fs::create_dir_all(&work).unwrap();
        // The tenant's layer: links at every path the node writes.
        for name in ["hostname", "hosts", "resolv.conf"] {
            std::os::unix::fs::symlink(victim.join("hosts"), upper.join("etc").join(name)).unwrap();
        }
        std::os::unix::fs::symlink(&victim, upper.join("agentenv")).unwrap();
        std::os::unix::fs::symlink("/", upper.join("proc")).unwrap();
        std::fs::write(upper.join("dev"), b"not a dir").unwrap();
        let base = 1_500_000_000;
        std::os::unix::fs::lchown(&upper, Some(base), Some(base)).unwrap();
        prepare(&upper, &work, IdRange { base }, false, &files()).unwrap();

        assert_eq!(std::fs::read(victim.join("hosts")).unwrap(), b"host file");
        assert_eq!(std::fs::read_dir(&victim).unwrap().count(), 1);
        let hosts = std::fs::symlink_metadata(upper.join("etc/hosts")).unwrap();
        assert!(hosts.is_file());
        assert_eq!((hosts.uid(), hosts.gid()), (base, base));
        assert!(
            std::fs::read_to_string(upper.join("etc/hosts"))
                .unwrap()
                .contains("10.1.0.2\tsbx")
        );
        assert!(
            std::fs::symlink_metadata(upper.join("agentenv"))
                .unwrap()
                .is_dir()
        );
        assert!(upper.join("agentenv/agentenv-guest").is_file());
        assert!(std::fs::symlink_metadata(upper.join("proc")).is_err());
        assert!(std::fs::symlink_metadata(upper.join("dev")).is_err());
    }

    #[test]
    fn a_layer_of_another_range_moves_into_the_sandbox_range() {
        if !nix::unistd::Uid::effective().is_root() {
            eprintln!("SKIPPED: changing owners needs root");
            return;
        }
        let t = tempfile::tempdir().unwrap();
        let upper = t.path().join("upper");
        let work = t.path().join("work");
        std::fs::create_dir_all(upper.join("home/user")).unwrap();
        std::fs::write(upper.join("home/user/f"), b"x").unwrap();
        std::os::unix::fs::lchown(upper.join("home/user/f"), Some(1000), Some(1000)).unwrap();
        std::os::unix::fs::symlink("f", upper.join("home/user/l")).unwrap();
        // A legacy layer: owned by host root.
        let base = 1_000_065_536;
        prepare(&upper, &work, IdRange { base }, false, &files()).unwrap();
        let m = std::fs::metadata(upper.join("home/user/f")).unwrap();
        assert_eq!((m.uid(), m.gid()), (base + 1000, base + 1000));
        let l = std::fs::symlink_metadata(upper.join("home/user/l")).unwrap();
        assert_eq!(l.uid(), base);
        assert_eq!(std::fs::metadata(&upper).unwrap().uid(), base);
    }
}
