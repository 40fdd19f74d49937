//! Snapshots of jail sandboxes: the overlay's writable layer (`upper/`) as a tar archive,
//! compressed with zstd.
//!
//! Capture freezes the sandbox's cgroup so no process writes while the layer is read,
//! archives `upper/` and thaws: the sandbox keeps running. The archive keeps what the
//! overlay needs: file modes, owners, times, symlinks, extended attributes (as PAX
//! `SCHILY.xattr.*` records; overlayfs marks opaque directories with
//! `trusted.overlay.opaque`) and whiteouts (character devices 0:0 that hide a lower
//! file). Starting from a snapshot unpacks the archive into a fresh `upper/` under the
//! backend's kept directory and creates the sandbox on it, over the same template:
//! the files come back, the processes start afresh.

use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Component, Path, PathBuf};

use super::{JailBackend, setup};
use crate::backend::{BackendError, KeptState, SandboxState, SnapshotCapture};

/// Name of the layer archive in a capture (tar, zstd-compressed).
pub const LAYER_FILE: &str = "layer.tar.zst";

/// An uncompressed layer archive, also accepted when starting from a snapshot.
pub const LAYER_FILE_PLAIN: &str = "layer.tar";

/// zstd level of layer archives: fast, since the sandbox is frozen while it runs.
const ZSTD_LEVEL: i32 = 1;

const XATTR_PAX_PREFIX: &str = "SCHILY.xattr.";

/// Archives the directory `upper` into the file `out` (zstd-compressed when its name
/// ends with `.zst`); returns the archive's size.
pub fn archive_layer(upper: &Path, out: &Path) -> std::io::Result<u64> {
    let file = std::fs::File::create(out)?;
    let w = std::io::BufWriter::with_capacity(1 << 20, file);
    if out.extension().is_some_and(|e| e == "zst") {
        let enc = zstd::Encoder::new(w, ZSTD_LEVEL)?;
        let enc = write_layer(upper, enc)?;
        let w = enc.finish()?;
        let file = w.into_inner().map_err(|e| e.into_error())?;
        return Ok(file.metadata()?.len());
    }
    let w = write_layer(upper, w)?;
    let file = w.into_inner().map_err(|e| e.into_error())?;
    Ok(file.metadata()?.len())
}

/// Writes the tar stream of `upper` into `w` and returns `w`.
fn write_layer<W: std::io::Write>(upper: &Path, w: W) -> std::io::Result<W> {
    let mut b = tar::Builder::new(w);
    b.follow_symlinks(false);
    b.mode(tar::HeaderMode::Complete);
    let mut stack: Vec<PathBuf> = vec![PathBuf::new()];
    while let Some(rel) = stack.pop() {
        let dir = upper.join(&rel);
        let mut entries: Vec<_> = std::fs::read_dir(&dir)?.collect::<Result<_, _>>()?;
        entries.sort_by_key(|e| e.file_name());
        for e in entries {
            let path = e.path();
            let name = rel.join(e.file_name());
            let xattrs: Vec<(String, Vec<u8>)> = xattr::list(&path)
                .map(|names| {
                    names
                        .filter_map(|n| {
                            let key = n.to_str()?.to_string();
                            let value = xattr::get(&path, &n).ok().flatten()?;
                            Some((format!("{XATTR_PAX_PREFIX}{key}"), value))
                        })
                        .collect()
                })
                .unwrap_or_default();
            if !xattrs.is_empty() {
                b.append_pax_extensions(xattrs.iter().map(|(k, v)| (k.as_str(), v.as_slice())))?;
            }
            let ft = e.file_type()?;
            if ft.is_dir() || ft.is_file() || ft.is_symlink() {
                b.append_path_with_name(&path, &name)?;
            } else if ft.is_socket() {
                // A socket is an endpoint of a running process: nothing to keep.
                continue;
            } else {
                // Whiteouts (0:0), other devices, FIFOs: the header is built here, the
                // crate would name these by their host path.
                let meta = std::fs::symlink_metadata(&path)?;
                let kind = if ft.is_char_device() {
                    tar::EntryType::Char
                } else if ft.is_block_device() {
                    tar::EntryType::Block
                } else {
                    tar::EntryType::Fifo
                };
                let mut h = tar::Header::new_gnu();
                h.set_metadata_in_mode(&meta, tar::HeaderMode::Complete);
                h.set_entry_type(kind);
                h.set_size(0);
                let rdev = meta.rdev();
                h.set_device_major(nix::sys::stat::major(rdev) as u32)?;
                h.set_device_minor(nix::sys::stat::minor(rdev) as u32)?;
                b.append_data(&mut h, &name, std::io::empty())?;
            }
            if ft.is_dir() {
                stack.push(name);
            }
        }
    }
    b.into_inner()
}

/// A relative path without `..`, or an error naming it.
fn safe_relative(p: &Path) -> std::io::Result<PathBuf> {
    let mut out = PathBuf::new();
    for c in p.components() {
        match c {
            Component::Normal(n) => out.push(n),
            Component::CurDir => {}
            _ => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!("archive entry {} leaves the layer", p.display()),
                ));
            }
        }
    }
    Ok(out)
}

/// Unpacks a layer archive made by [`archive_layer`] into the (empty) directory `upper`.
pub fn unpack_layer(archive: &Path, upper: &Path) -> std::io::Result<()> {
    let file = std::fs::File::open(archive)?;
    let r = std::io::BufReader::with_capacity(1 << 20, file);
    if archive.extension().is_some_and(|e| e == "zst") {
        read_layer(zstd::Decoder::with_buffer(r)?, upper)
    } else {
        read_layer(r, upper)
    }
}

fn read_layer<R: std::io::Read>(r: R, upper: &Path) -> std::io::Result<()> {
    use nix::sys::stat::{Mode, SFlag, makedev, mknod};
    let mut a = tar::Archive::new(r);
    a.set_preserve_permissions(true);
    a.set_preserve_ownerships(true);
    a.set_preserve_mtime(true);
    a.set_overwrite(true);
    // Extended attributes are set below, for every kind of entry (the crate sets them on
    // regular files only).
    a.set_unpack_xattrs(false);
    for entry in a.entries()? {
        let mut entry = entry?;
        let rel = safe_relative(&entry.path()?)?;
        if rel.as_os_str().is_empty() {
            continue;
        }
        let xattrs: Vec<(String, Vec<u8>)> = match entry.pax_extensions()? {
            Some(exts) => exts
                .filter_map(Result::ok)
                .filter_map(|e| {
                    let key = e.key().ok()?.strip_prefix(XATTR_PAX_PREFIX)?.to_string();
                    Some((key, e.value_bytes().to_vec()))
                })
                .collect(),
            None => Vec::new(),
        };
        let dst = upper.join(&rel);
        let kind = entry.header().entry_type();
        if kind.is_character_special() || kind.is_block_special() || kind.is_fifo() {
            let h = entry.header();
            let major = h.device_major()?.unwrap_or(0);
            let minor = h.device_minor()?.unwrap_or(0);
            let mode = h.mode()? & 0o7777;
            let sflag = if kind.is_character_special() {
                SFlag::S_IFCHR
            } else if kind.is_block_special() {
                SFlag::S_IFBLK
            } else {
                SFlag::S_IFIFO
            };
            if let Some(parent) = dst.parent() {
                std::fs::create_dir_all(parent)?;
            }
            let _ = std::fs::remove_file(&dst);
            mknod(
                &dst,
                sflag,
                Mode::from_bits_truncate(mode),
                makedev(major.into(), minor.into()),
            )
            .map_err(std::io::Error::from)?;
            let (uid, gid) = (h.uid()? as u32, h.gid()? as u32);
            std::os::unix::fs::lchown(&dst, Some(uid), Some(gid))?;
        } else if !entry.unpack_in(upper)? {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("archive entry {} leaves the layer", rel.display()),
            ));
        }
        for (k, v) in xattrs {
            xattr::set(&dst, &k, &v)?;
        }
    }
    Ok(())
}

impl JailBackend {
    /// Freezes the sandbox, archives its writable layer into `dir`, thaws it.
    pub(super) async fn capture(
        &self,
        id: &str,
        dir: &Path,
    ) -> Result<SnapshotCapture, BackendError> {
        let sbx = self.sandboxes.ready(id)?;
        let _op = sbx.op.lock().await;
        let state = sbx.info.lock().unwrap_or_else(|e| e.into_inner()).state;
        if state != SandboxState::Running {
            return Err(BackendError::InvalidState {
                id: id.to_string(),
                state,
                needed: SandboxState::Running,
            });
        }
        sbx.cgroup
            .freeze(self.cfg.op_timeout)
            .await
            .map_err(setup)?;
        let upper = sbx.dir.join("upper");
        let out = dir.join(LAYER_FILE);
        let archived = tokio::task::spawn_blocking(move || archive_layer(&upper, &out))
            .await
            .map_err(|e| setup(format!("archive task: {e}")));
        let thawed = sbx.cgroup.thaw(self.cfg.op_timeout).await.map_err(setup);
        let size = archived?.map_err(|e| BackendError::io("archiving the writable layer", e))?;
        thawed?;
        tracing::debug!(id, size, "writable layer captured");
        Ok(SnapshotCapture {
            backend: "jail".into(),
            files: vec![LAYER_FILE.into()],
        })
    }

    /// Unpacks a capture's layer into a new kept directory a create can start from.
    pub(super) async fn import(
        &self,
        capture: &SnapshotCapture,
        dir: &Path,
    ) -> Result<KeptState, BackendError> {
        let layer = [LAYER_FILE, LAYER_FILE_PLAIN]
            .into_iter()
            .find(|l| capture.files.iter().any(|f| f == l));
        let (true, Some(layer)) = (capture.backend == "jail", layer) else {
            return Err(BackendError::BadKeptState {
                path: dir.to_path_buf(),
                reason: format!(
                    "it was taken by the {} backend, not by a jail (files {:?})",
                    capture.backend, capture.files
                ),
            });
        };
        let nonce: u64 = rand::random();
        let path = self.kept_dir.join(format!("snapshot.{nonce:016x}"));
        let archive = dir.join(layer);
        let p = path.clone();
        let result = tokio::task::spawn_blocking(move || -> std::io::Result<()> {
            std::fs::create_dir(&p)?;
            std::fs::create_dir(p.join("work"))?;
            std::fs::create_dir(p.join("upper"))?;
            unpack_layer(&archive, &p.join("upper"))
        })
        .await
        .map_err(|e| setup(format!("unpack task: {e}")))?;
        if let Err(e) = result {
            let _ = self.remove_dir(&path);
            return Err(BackendError::io("unpacking a snapshot's writable layer", e));
        }
        Ok(KeptState { path })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn a_layer_round_trips_files_modes_links_xattrs_and_whiteouts() {
        // Whiteouts (mknod) and trusted.* attributes need root, as the node itself does.
        let src = tempfile::tempdir().unwrap();
        let up = src.path();
        std::fs::create_dir_all(up.join("home/user/.cache")).unwrap();
        std::fs::write(up.join("home/user/notes.txt"), b"hello snapshot").unwrap();
        std::fs::set_permissions(
            up.join("home/user/notes.txt"),
            std::fs::Permissions::from_mode(0o640),
        )
        .unwrap();
        std::os::unix::fs::lchown(up.join("home/user/notes.txt"), Some(1000), Some(1000)).unwrap();
        std::os::unix::fs::symlink("notes.txt", up.join("home/user/link")).unwrap();
        std::fs::create_dir(up.join("opaque")).unwrap();
        xattr::set(up.join("opaque"), "trusted.overlay.opaque", b"y").unwrap();
        nix::sys::stat::mknod(
            &up.join("home/deleted"),
            nix::sys::stat::SFlag::S_IFCHR,
            nix::sys::stat::Mode::empty(),
            nix::sys::stat::makedev(0, 0),
        )
        .unwrap();

        nix::unistd::mkfifo(
            &up.join("fifo"),
            nix::sys::stat::Mode::from_bits_truncate(0o600),
        )
        .unwrap();
        let _sock = std::os::unix::net::UnixListener::bind(up.join("agent.sock")).unwrap();

        std::fs::write(
            up.join("big.log"),
            "a log line that repeats\n".repeat(40_000),
        )
        .unwrap();

        let mut sizes = Vec::new();
        for name in [LAYER_FILE, LAYER_FILE_PLAIN] {
            let out = tempfile::tempdir().unwrap();
            let archive = out.path().join(name);
            sizes.push(archive_layer(up, &archive).unwrap());
            let dst = out.path().join("upper");
            std::fs::create_dir(&dst).unwrap();
            unpack_layer(&archive, &dst).unwrap();
            check_layer(&dst);
        }
        assert!(
            sizes[0] * 10 < sizes[1],
            "the zstd archive is much smaller: {sizes:?}"
        );
    }

    fn check_layer(dst: &Path) {
        assert_eq!(
            std::fs::read(dst.join("big.log")).unwrap().len(),
            "a log line that repeats\n".len() * 40_000
        );
        assert_eq!(
            std::fs::read(dst.join("home/user/notes.txt")).unwrap(),
            b"hello snapshot"
        );
        let m = std::fs::metadata(dst.join("home/user/notes.txt")).unwrap();
        assert_eq!(m.mode() & 0o7777, 0o640);
        assert_eq!((m.uid(), m.gid()), (1000, 1000));
        assert_eq!(
            std::fs::read_link(dst.join("home/user/link")).unwrap(),
            Path::new("notes.txt")
        );
        assert!(dst.join("home/user/.cache").is_dir());
        assert_eq!(
            xattr::get(dst.join("opaque"), "trusted.overlay.opaque").unwrap(),
            Some(b"y".to_vec())
        );
        let w = std::fs::symlink_metadata(dst.join("home/deleted")).unwrap();
        assert!(w.file_type().is_char_device());
        assert_eq!(w.rdev(), 0);
        assert!(
            std::fs::symlink_metadata(dst.join("fifo"))
                .unwrap()
                .file_type()
                .is_fifo()
        );
        // Sockets belong to running processes and are left out.
        assert!(!dst.join("agent.sock").exists());
    }

    #[test]
    fn an_archive_entry_outside_the_layer_is_refused() {
        let out = tempfile::tempdir().unwrap();
        let archive = out.path().join("evil.tar");
        {
            let mut b = tar::Builder::new(std::fs::File::create(&archive).unwrap());
            let mut h = tar::Header::new_gnu();
            h.set_size(1);
            h.set_mode(0o644);
            h.set_entry_type(tar::EntryType::Regular);
            // set_path refuses "..", so write the name bytes directly.
            h.as_gnu_mut().unwrap().name[..9].copy_from_slice(b"../escape");
            h.set_cksum();
            b.append(&h, &b"x"[..]).unwrap();
            b.finish().unwrap();
        }
        let dst = out.path().join("upper");
        std::fs::create_dir(&dst).unwrap();
        let e = unpack_layer(&archive, &dst).unwrap_err();
        assert!(e.to_string().contains("leaves the layer"), "{e}");
        assert!(!out.path().join("escape").exists());
    }
}
