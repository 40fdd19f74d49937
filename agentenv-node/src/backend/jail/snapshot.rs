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
//!
//! Both directions treat the layer as the tenant's: archiving walks it and unpacking
//! creates every entry through [`SafeDir`], so the node never follows a link in it, and
//! an archive whose entries would land outside the layer (absolute paths, `..`, a path
//! through a symlink, a hard link out of it), or that holds devices other than
//! whiteouts, is refused with an error naming the entry. With an id shift (the base of
//! the sandbox's id range), owners are archived relative to the range and shifted into
//! the new sandbox's range on unpack.

use std::ffi::OsStr;
use std::io::{Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};
use std::time::{Duration, SystemTime};

use nix::sys::stat::{SFlag, major, makedev, minor};

use super::{JailBackend, JailRuntime, Sandbox};
use crate::backend::{BackendError, KeptState, SnapshotCapture};
use crate::config::BackendKind;
use crate::host::ids::IDS_PER_SANDBOX;
use crate::host::safefs::{SafeDir, SafeFsError};
use crate::host::setup;
use crate::host::{Runtime, disk, foreign_capture};

/// Name of the layer archive in a capture (tar, zstd-compressed).
pub const LAYER_FILE: &str = "layer.tar.zst";

/// An uncompressed layer archive, also accepted when starting from a snapshot.
pub const LAYER_FILE_PLAIN: &str = "layer.tar";

/// zstd level of layer archives: fast, since the sandbox is frozen while it runs.
const ZSTD_LEVEL: i32 = 1;

const XATTR_PAX_PREFIX: &str = "SCHILY.xattr.";

/// The id a file owned by an id outside the sandbox's range is archived as: the
/// overflow id, which is how the sandbox itself sees such a file.
const OVERFLOW_ID: u32 = 65_534;

/// Errors of archiving and unpacking a writable layer.
#[derive(Debug, thiserror::Error)]
pub enum LayerError {
    #[error("layer archive entry {entry:?}: {reason}; the layer is refused")]
    Refused { entry: String, reason: String },
    #[error("layer archive entry {entry:?}: {source}; the layer is refused")]
    Entry {
        entry: String,
        #[source]
        source: SafeFsError,
    },
    #[error("the writable layer: {0}")]
    Fs(#[from] SafeFsError),
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
}

fn io(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> LayerError {
    let context = context.into();
    move |source| LayerError::Io { context, source }
}

/// The id archived for the host id `id` of a file: relative to the sandbox's range when
/// `id_shift` is its base (an id outside the range becomes the overflow id, as the
/// sandbox saw it); as it is without a shift.
fn archived_id(id: u32, id_shift: Option<u32>) -> u32 {
    match id_shift {
        None => id,
        Some(base) => id
            .checked_sub(base)
            .filter(|r| *r < IDS_PER_SANDBOX)
            .unwrap_or(OVERFLOW_ID),
    }
}

/// The host id for the archived id `id`: `base + id` with a shift (`id` must lie in a
/// sandbox's range, so a layer never hands files to ids of another range), `id` without.
fn host_id(id: u64, id_shift: Option<u32>) -> Result<u32, String> {
    match id_shift {
        None => u32::try_from(id)
            .ok()
            .filter(|i| *i != u32::MAX)
            .ok_or_else(|| format!("the owner id {id} is not a valid id")),
        Some(base) => u32::try_from(id)
            .ok()
            .filter(|i| *i < IDS_PER_SANDBOX)
            .and_then(|i| base.checked_add(i))
            .ok_or_else(|| {
                format!("the owner id {id} lies outside a sandbox's ids (0..{IDS_PER_SANDBOX})")
            }),
    }
}

/// Archives the directory `upper` into the file `out` (zstd-compressed when its name
/// ends with `.zst`); returns the archive's size. Owners are stored relative to
/// `id_shift` (the base of the sandbox's id range) when given, as they are otherwise.
///
/// Runs while the sandbox is frozen, but never relies on it: `upper` is walked through
/// [`SafeDir`], so no link in it is ever followed and a regular file is opened only after
/// it was checked to be one (opening a device node the tenant planted could have side
/// effects on the host).
pub fn archive_layer(upper: &Path, out: &Path, id_shift: Option<u32>) -> Result<u64, LayerError> {
    let ctx = || format!("writing the layer archive {}", out.display());
    let file = std::fs::File::create(out).map_err(io(ctx()))?;
    let w = std::io::BufWriter::with_capacity(1 << 20, file);
    let w = if out.extension().is_some_and(|e| e == "zst") {
        let enc = zstd::Encoder::new(w, ZSTD_LEVEL).map_err(io(ctx()))?;
        write_layer(upper, enc, id_shift)?
            .finish()
            .map_err(io(ctx()))?
    } else {
        write_layer(upper, w, id_shift)?
    };
    let file = w.into_inner().map_err(|e| io(ctx())(e.into_error()))?;
    Ok(file.metadata().map_err(io(ctx()))?.len())
}

/// Writes the tar stream of `upper` into `w` and returns `w`.
fn write_layer<W: Write>(upper: &Path, w: W, id_shift: Option<u32>) -> Result<W, LayerError> {
    let root = SafeDir::open(upper)?;
    let mut b = tar::Builder::new(w);
    let tar_err = |name: &Path| io(format!("archiving {}", name.display()));
    // Directories still to walk, by path: each is opened from the root with `openat2`
    // when its turn comes (links refused), so the walk holds one descriptor per level
    // at most.
    let mut stack: Vec<PathBuf> = vec![PathBuf::new()];
    while let Some(rel) = stack.pop() {
        let dir = root.open_dir(&rel)?;
        for entry in dir.entries()? {
            let name = rel.join(&entry);
            // Gone since the listing (the sandbox is frozen; nothing else writes there).
            let Some(st) = dir.stat_nofollow(&entry)? else {
                continue;
            };
            let kind = SFlag::from_bits_truncate(st.st_mode & SFlag::S_IFMT.bits());
            if kind == SFlag::S_IFSOCK {
                // A socket is an endpoint of a running process: nothing to keep.
                continue;
            }
            let whiteout = kind == SFlag::S_IFCHR && st.st_rdev == makedev(0, 0);
            if matches!(kind, SFlag::S_IFCHR | SFlag::S_IFBLK) && !whiteout {
                // Unusable inside (the layer is mounted nodev) and refused by
                // `unpack_layer`: left out rather than making the snapshot unusable.
                tracing::warn!(entry = %name.display(), "a device node in a writable layer is left out of its snapshot");
                continue;
            }
            let xattrs: Vec<(String, Vec<u8>)> = dir
                .xattrs_nofollow(&entry)
                .unwrap_or_default()
                .into_iter()
                .filter_map(|(k, v)| Some((format!("{XATTR_PAX_PREFIX}{}", k.to_str()?), v)))
                .collect();
            if !xattrs.is_empty() {
                b.append_pax_extensions(xattrs.iter().map(|(k, v)| (k.as_str(), v.as_slice())))
                    .map_err(tar_err(&name))?;
            }
            let mut h = tar::Header::new_gnu();
            h.set_mode(st.st_mode & 0o7777);
            h.set_uid(archived_id(st.st_uid, id_shift).into());
            h.set_gid(archived_id(st.st_gid, id_shift).into());
            h.set_mtime(st.st_mtime.max(0) as u64);
            h.set_size(0);
            match kind {
                SFlag::S_IFDIR => {
                    h.set_entry_type(tar::EntryType::Directory);
                    b.append_data(&mut h, &name, std::io::empty())
                        .map_err(tar_err(&name))?;
                    stack.push(name);
                }
                SFlag::S_IFREG => {
                    let f = dir.open_file(&entry)?;
                    // The header describes what was opened, not what was listed.
                    let meta = f.metadata().map_err(tar_err(&name))?;
                    h.set_entry_type(tar::EntryType::Regular);
                    h.set_size(meta.len());
                    b.append_data(&mut h, &name, f.take(meta.len()))
                        .map_err(tar_err(&name))?;
                }
                SFlag::S_IFLNK => {
                    let target = dir.read_link(&entry)?;
                    h.set_entry_type(tar::EntryType::Symlink);
                    b.append_link(&mut h, &name, &target)
                        .map_err(tar_err(&name))?;
                }
                _ => {
                    // Whiteouts (character devices 0:0) and FIFOs.
                    h.set_entry_type(if whiteout {
                        tar::EntryType::Char
                    } else {
                        tar::EntryType::Fifo
                    });
                    h.set_device_major(major(st.st_rdev) as u32)
                        .map_err(tar_err(&name))?;
                    h.set_device_minor(minor(st.st_rdev) as u32)
                        .map_err(tar_err(&name))?;
                    b.append_data(&mut h, &name, std::io::empty())
                        .map_err(tar_err(&name))?;
                }
            }
        }
    }
    b.into_inner().map_err(io("finishing the layer archive"))
}

/// A path of the archive as a path beneath the layer, or why it is not one.
fn layer_path(p: &Path) -> Result<PathBuf, String> {
    let mut out = PathBuf::new();
    for c in p.components() {
        match c {
            Component::Normal(n) => out.push(n),
            Component::CurDir => {}
            Component::RootDir | Component::Prefix(_) => {
                return Err("an absolute path leaves the layer".into());
            }
            Component::ParentDir => return Err("a `..` leaves the layer".into()),
        }
    }
    Ok(out)
}

/// Extended attributes a layer may carry back. Everything else is dropped: other
/// `trusted.overlay.*` attributes steer how the overlay resolves names (redirects,
/// metacopy origins) and are its own bookkeeping; `security.*` labels other than file
/// capabilities belong to the host's policy; ACLs name ids the shift does not rewrite.
fn restorable_xattr(key: &str, id_shift: Option<u32>) -> bool {
    key.starts_with("user.")
        || key == "trusted.overlay.opaque"
        || key == "security.capability"
        || (id_shift.is_none()
            && (key == "system.posix_acl_access" || key == "system.posix_acl_default"))
}

/// Unpacks a layer archive made by [`archive_layer`] into the (empty) directory `upper`,
/// adding `id_shift` (the base of the sandbox's id range) to every owner when given.
///
/// The archive is untrusted: every entry is created through [`SafeDir`], so nothing is
/// written through a link (a file under a path an earlier entry made a symlink is
/// refused) and nothing outside `upper`. Refused, naming the entry: absolute paths and
/// `..`; hard links to outside the layer, to a link or to a directory; block devices and
/// character devices other than the overlay's whiteout (0:0). On an error the caller
/// removes `upper`: nothing of the layer is used.
pub fn unpack_layer(archive: &Path, upper: &Path, id_shift: Option<u32>) -> Result<(), LayerError> {
    let ctx = || format!("reading the layer archive {}", archive.display());
    let file = std::fs::File::open(archive).map_err(io(ctx()))?;
    let r = std::io::BufReader::with_capacity(1 << 20, file);
    if archive.extension().is_some_and(|e| e == "zst") {
        read_layer(
            zstd::Decoder::with_buffer(r).map_err(io(ctx()))?,
            upper,
            id_shift,
        )
    } else {
        read_layer(r, upper, id_shift)
    }
}

fn read_layer<R: Read>(r: R, upper: &Path, id_shift: Option<u32>) -> Result<(), LayerError> {
    let mut root = SafeDir::open(upper)?;
    if let Some(base) = id_shift {
        // Parents an archive leaves implicit belong to the sandbox's root.
        root = root.with_owner(base, base);
    }
    let mut a = tar::Archive::new(r);
    // Directories get their modes and times last: entries created inside change them.
    let mut dirs: Vec<(PathBuf, u32, u64)> = Vec::new();
    for entry in a.entries().map_err(io("reading the layer archive"))? {
        let mut entry = entry.map_err(io("reading the layer archive"))?;
        let shown = String::from_utf8_lossy(&entry.path_bytes()).into_owned();
        let refused = |reason: String| LayerError::Refused {
            entry: shown.clone(),
            reason,
        };
        let fs = |source: SafeFsError| LayerError::Entry {
            entry: shown.clone(),
            source,
        };
        let kind = entry.header().entry_type();
        if kind == tar::EntryType::XGlobalHeader {
            continue;
        }
        let raw = entry
            .path()
            .map_err(|e| refused(format!("an unreadable path ({e})")))?;
        let rel = layer_path(&raw).map_err(&refused)?;
        if rel.as_os_str().is_empty() {
            // The layer's own root (`./`): `upper` is the caller's.
            continue;
        }
        let h = entry.header();
        let bad = |e: std::io::Error| refused(format!("a bad header ({e})"));
        let mode = h.mode().map_err(bad)? & 0o7777;
        let uid = host_id(h.uid().map_err(bad)?, id_shift).map_err(&refused)?;
        let gid = host_id(h.gid().map_err(bad)?, id_shift).map_err(&refused)?;
        let mtime = h.mtime().map_err(bad)?;
        // Read now (the header is borrowed); checked for device entries only.
        let device = h
            .device_major()
            .and_then(|major| Ok((major.unwrap_or(0), h.device_minor()?.unwrap_or(0))));
        let xattrs: Vec<(String, Vec<u8>)> = match entry.pax_extensions().map_err(bad)? {
            Some(exts) => exts
                .filter_map(Result::ok)
                .filter_map(|e| {
                    let key = e.key().ok()?.strip_prefix(XATTR_PAX_PREFIX)?.to_string();
                    Some((key, e.value_bytes().to_vec()))
                })
                .filter(|(k, _)| restorable_xattr(k, id_shift))
                .collect(),
            None => Vec::new(),
        };
        let (parent, name) = match (rel.parent(), rel.file_name()) {
            (Some(p), Some(n)) => (p.to_path_buf(), n.to_os_string()),
            _ => return Err(refused("not a path beneath the layer".into())),
        };
        let name = Path::new(&name);
        match kind {
            tar::EntryType::Directory => {
                root.create_dir_all(&rel, 0o700).map_err(fs)?;
                root.chown_nofollow(&rel, uid, gid).map_err(fs)?;
                dirs.push((rel.clone(), mode, mtime));
            }
            tar::EntryType::Regular | tar::EntryType::Continuous | tar::EntryType::GNUSparse => {
                // setuid and setgid bits are kept as archived: the overlay is mounted
                // nosuid (which also disables file capabilities), so inside the sandbox
                // they grant nothing, and the node never runs files of a layer.
                let dir = root.create_dir_all(&parent, 0o755).map_err(fs)?;
                dir.remove_non_dir(name).map_err(fs)?;
                let mut f = dir.create_file(name, 0o600).map_err(fs)?;
                std::io::copy(&mut entry, &mut f).map_err(io(format!("unpacking {shown}")))?;
                // The owner first: chown clears setuid bits, the mode then sets them.
                nix::unistd::fchown(
                    &f,
                    Some(nix::unistd::Uid::from_raw(uid)),
                    Some(nix::unistd::Gid::from_raw(gid)),
                )
                .map_err(|e| io(format!("unpacking {shown}"))(e.into()))?;
                nix::sys::stat::fchmod(&f, nix::sys::stat::Mode::from_bits_truncate(mode))
                    .map_err(|e| io(format!("unpacking {shown}"))(e.into()))?;
                drop(f);
                finish(&dir, name, &xattrs, mtime).map_err(fs)?;
            }
            tar::EntryType::Symlink => {
                // Any target: a link is created, never followed.
                let target = entry
                    .link_name()
                    .map_err(bad)?
                    .ok_or_else(|| refused("a symlink without a target".into()))?;
                let dir = root.create_dir_all(&parent, 0o755).map_err(fs)?;
                dir.remove_non_dir(name).map_err(fs)?;
                dir.symlink_at(name, &target).map_err(fs)?;
                dir.chown_nofollow(name, uid, gid).map_err(fs)?;
                finish(&dir, name, &xattrs, mtime).map_err(fs)?;
            }
            tar::EntryType::Link => {
                let target = entry
                    .link_name()
                    .map_err(bad)?
                    .ok_or_else(|| refused("a hard link without a target".into()))?;
                let target = layer_path(&target).map_err(|why| {
                    refused(format!("a hard link to {}: {why}", target.display()))
                })?;
                root.create_dir_all(&parent, 0o755).map_err(fs)?;
                root.remove_non_dir(&rel).map_err(fs)?;
                root.hard_link_within(&target, &rel).map_err(fs)?;
            }
            tar::EntryType::Char | tar::EntryType::Block | tar::EntryType::Fifo => {
                let dev = match kind {
                    tar::EntryType::Fifo => 0,
                    tar::EntryType::Block => {
                        return Err(refused(
                            "a block device: a layer holds no devices but whiteouts".into(),
                        ));
                    }
                    _ => {
                        let (major, minor) = device.map_err(bad)?;
                        if (major, minor) != (0, 0) {
                            return Err(refused(format!(
                                "a character device {major}:{minor}: a layer holds no devices but whiteouts (0:0)"
                            )));
                        }
                        makedev(0, 0)
                    }
                };
                let sflag = match kind {
                    tar::EntryType::Fifo => SFlag::S_IFIFO,
                    _ => SFlag::S_IFCHR,
                };
                let dir = root.create_dir_all(&parent, 0o755).map_err(fs)?;
                dir.remove_non_dir(name).map_err(fs)?;
                dir.mknod_at(name, sflag, mode, dev).map_err(fs)?;
                dir.chown_nofollow(name, uid, gid).map_err(fs)?;
                dir.chmod_nofollow(name, mode).map_err(fs)?;
                finish(&dir, name, &xattrs, mtime).map_err(fs)?;
            }
            other => {
                return Err(refused(format!(
                    "an entry of type {:?}, which a layer never holds",
                    other
                )));
            }
        }
        if kind == tar::EntryType::Directory {
            for (k, v) in &xattrs {
                root.set_xattr_nofollow(&rel, k, v).map_err(fs)?;
            }
        }
    }
    for (rel, mode, mtime) in dirs.iter().rev() {
        let fs = |source: SafeFsError| LayerError::Entry {
            entry: rel.display().to_string(),
            source,
        };
        root.chmod_nofollow(rel, *mode).map_err(fs)?;
        root.set_times(rel, None, Some(epoch(*mtime))).map_err(fs)?;
    }
    Ok(())
}

fn epoch(secs: u64) -> SystemTime {
    SystemTime::UNIX_EPOCH + Duration::from_secs(secs)
}

/// The extended attributes and modification time of a new entry `name` in `dir`.
fn finish(
    dir: &SafeDir,
    name: &Path,
    xattrs: &[(String, Vec<u8>)],
    mtime: u64,
) -> Result<(), SafeFsError> {
    for (k, v) in xattrs {
        dir.set_xattr_nofollow(name, OsStr::from_bytes(k.as_bytes()), v)?;
    }
    dir.set_times(name, None, Some(epoch(mtime)))
}

/// Moves a kept layer of the older layout (`upper/` and `work/` as plain directories of
/// the sandbox directory `dir`) into the mounted layer whose `upper/` is `upper`.
pub(super) fn move_legacy_layer(dir: &Path, upper: &Path) -> Result<(), BackendError> {
    let tar = dir.join("legacy-layer.tar");
    let moved = archive_layer(&dir.join("upper"), &tar, None)
        .and_then(|_| unpack_layer(&tar, upper, Some(0)))
        .map_err(|e| setup(format!("moving a kept layer onto its own file system: {e}")));
    let _ = std::fs::remove_file(&tar);
    moved?;
    for d in ["upper", "work"] {
        std::fs::remove_dir_all(dir.join(d))
            .map_err(|e| BackendError::io(format!("removing the old {d}/"), e))?;
    }
    tracing::info!(dir = %dir.display(), "a kept layer moved onto its own file system");
    Ok(())
}

impl JailBackend {
    /// Freezes the sandbox, archives its writable layer into `dir`, thaws it.
    pub(super) async fn capture(
        &self,
        sbx: &Sandbox,
        dir: &Path,
    ) -> Result<SnapshotCapture, BackendError> {
        JailRuntime::pause(self, sbx).await?;
        let upper = super::layer_mount(&sbx.host.dir).join(disk::UPPER_DIR);
        let out = dir.join(LAYER_FILE);
        // Owners relative to the sandbox's id range (as the sandbox sees them): a sandbox
        // started from the capture gets its own range.
        let base = sbx.host.ids.base;
        let archived = tokio::task::spawn_blocking(move || archive_layer(&upper, &out, Some(base)))
            .await
            .map_err(|e| setup(format!("archive task: {e}")));
        let thawed = JailRuntime::resume(self, sbx).await;
        let size = archived?.map_err(|e| setup(format!("archiving the writable layer: {e}")))?;
        thawed?;
        tracing::debug!(id = %sbx.id(), size, "writable layer captured");
        Ok(SnapshotCapture::new(
            BackendKind::Jail,
            vec![LAYER_FILE.into()],
        ))
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
        let (Some(BackendKind::Jail), Some(layer)) = (capture.kind(), layer) else {
            return Err(foreign_capture(capture, dir, "a jail"));
        };
        let path = self.host.new_kept_path("snapshot");
        let archive = dir.join(layer);
        let (p, blank, mb) = (
            path.clone(),
            self.runtime.blank_dir.clone(),
            self.cfg().disk_size_mb,
        );
        let result = tokio::task::spawn_blocking(move || -> Result<(), String> {
            let disk_dir = p.join(super::DISK_DIR);
            std::fs::create_dir_all(&disk_dir)
                .map_err(|e| format!("creating {}: {e}", disk_dir.display()))?;
            let image = disk_dir.join(disk::LAYER_IMAGE);
            disk::create_layer_image(&blank, mb, &image).map_err(|e| e.to_string())?;
            let layer = disk::mount_layer(&image, &disk_dir.join(disk::LAYER_DIR))
                .map_err(|e| e.to_string())?;
            // Ids stay relative to a range (0..65536, anything else refused); the create
            // that starts from the layer moves them into its sandbox's range.
            match unpack_layer(&archive, &layer.upper(), Some(0)) {
                Ok(()) => layer.unmount().map_err(|e| e.to_string()),
                Err(e) => {
                    let _ = layer.discard();
                    Err(e.to_string())
                }
            }
        })
        .await
        .map_err(|e| setup(format!("unpack task: {e}")))?;
        if let Err(e) = result {
            // Whatever the archive made goes (removal never follows its links).
            let _ = self.host.remove_dir(&path);
            return Err(setup(format!(
                "unpacking the snapshot's writable layer: {e}"
            )));
        }
        Ok(KeptState { path })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};

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
            sizes.push(archive_layer(up, &archive, None).unwrap());
            let dst = out.path().join("upper");
            std::fs::create_dir(&dst).unwrap();
            unpack_layer(&archive, &dst, None).unwrap();
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
        let e = unpack_layer(&archive, &dst, None).unwrap_err();
        assert!(e.to_string().contains("leaves the layer"), "{e}");
        assert!(!out.path().join("escape").exists());
    }

    /// One raw tar entry: names are written as bytes, so `..` and absolute paths get in.
    struct Raw<'a> {
        kind: tar::EntryType,
        name: &'a [u8],
        link: &'a [u8],
        data: &'a [u8],
        dev: (u32, u32),
        mode: u32,
    }

    fn raw(kind: tar::EntryType, name: &str) -> Raw<'_> {
        Raw {
            kind,
            name: name.as_bytes(),
            link: b"",
            data: b"",
            dev: (0, 0),
            mode: 0o644,
        }
    }

    fn evil_archive(path: &Path, entries: &[Raw<'_>]) {
        let mut b = tar::Builder::new(std::fs::File::create(path).unwrap());
        for e in entries {
            let mut h = tar::Header::new_gnu();
            h.set_entry_type(e.kind);
            h.set_size(e.data.len() as u64);
            h.set_mode(e.mode);
            h.set_mtime(1_700_000_000);
            h.set_uid(0);
            h.set_gid(0);
            h.set_device_major(e.dev.0).unwrap();
            h.set_device_minor(e.dev.1).unwrap();
            let g = h.as_gnu_mut().unwrap();
            g.name = [0; 100];
            g.name[..e.name.len()].copy_from_slice(e.name);
            g.linkname = [0; 100];
            g.linkname[..e.link.len()].copy_from_slice(e.link);
            h.set_cksum();
            b.append(&h, e.data).unwrap();
        }
        b.finish().unwrap();
    }

    /// A layer directory and a victim directory outside it, with one file.
    struct Scene {
        t: tempfile::TempDir,
        upper: PathBuf,
        victim: PathBuf,
    }

    impl Scene {
        fn new() -> Scene {
            let t = tempfile::tempdir().unwrap();
            let upper = t.path().join("upper");
            let victim = t.path().join("victim");
            std::fs::create_dir(&upper).unwrap();
            std::fs::create_dir(&victim).unwrap();
            std::fs::write(victim.join("keep"), b"host").unwrap();
            std::fs::write(t.path().join("outside"), b"host").unwrap();
            Scene { t, upper, victim }
        }

        /// Unpacks `entries`; returns the error, after checking nothing outside changed.
        fn refused(&self, entries: &[Raw<'_>]) -> String {
            let archive = self.t.path().join("evil.tar");
            evil_archive(&archive, entries);
            let e = unpack_layer(&archive, &self.upper, None)
                .expect_err("the archive is refused")
                .to_string();
            let names: Vec<_> = std::fs::read_dir(&self.victim)
                .unwrap()
                .map(|e| e.unwrap().file_name())
                .collect();
            assert_eq!(names, ["keep"], "the victim directory changed: {e}");
            assert_eq!(std::fs::read(self.victim.join("keep")).unwrap(), b"host");
            let m = std::fs::metadata(self.t.path().join("outside")).unwrap();
            assert_eq!(m.nlink(), 1, "{e}");
            let mut top: Vec<_> = std::fs::read_dir(self.t.path())
                .unwrap()
                .map(|e| e.unwrap().file_name().into_string().unwrap())
                .collect();
            top.sort();
            assert_eq!(top, ["evil.tar", "outside", "upper", "victim"], "{e}");
            e
        }
    }

    #[test]
    fn escaping_archives_are_refused_and_write_nothing_outside() {
        let passwd_links = std::fs::metadata("/etc/passwd").unwrap().nlink();
        let tmp_marker = format!("aenv-escape-{:016x}", rand::random::<u64>());

        let s = Scene::new();
        let e = s.refused(&[raw(tar::EntryType::Regular, "../escape")]);
        assert!(
            e.contains("\"../escape\"") && e.contains("leaves the layer"),
            "{e}"
        );

        let s = Scene::new();
        let abs = format!("{}/abs", s.victim.display());
        let e = s.refused(&[raw(tar::EntryType::Regular, &abs)]);
        assert!(e.contains(&abs) && e.contains("absolute path"), "{e}");

        // A symlink to the victim, then a file and a directory through it.
        let s = Scene::new();
        let victim = s.victim.display().to_string();
        for through in [
            raw(tar::EntryType::Regular, "a/file"),
            raw(tar::EntryType::Directory, "a/sub/"),
            Raw {
                link: b"x",
                ..raw(tar::EntryType::Symlink, "a/l")
            },
            raw(tar::EntryType::Fifo, "a/p"),
        ] {
            let e = s.refused(&[
                Raw {
                    link: victim.as_bytes(),
                    ..raw(tar::EntryType::Symlink, "a")
                },
                through,
            ]);
            assert!(
                e.contains("\"a/") && e.contains("`a` is a symbolic link"),
                "{e}"
            );
            std::fs::remove_file(s.upper.join("a")).unwrap();
        }

        // A relative symlink climbing out, then a file through it.
        let s = Scene::new();
        let x = format!("a/{tmp_marker}");
        let e = s.refused(&[
            Raw {
                link: b"../../../../../../../../tmp",
                ..raw(tar::EntryType::Symlink, "a")
            },
            raw(tar::EntryType::Regular, &x),
        ]);
        assert!(e.contains(&x) && e.contains("symbolic link"), "{e}");
        assert!(!Path::new("/tmp").join(&tmp_marker).exists());

        // Hard links: out of the layer (absolute, `..`) and to a symlink.
        let s = Scene::new();
        let e = s.refused(&[Raw {
            link: b"/etc/passwd",
            ..raw(tar::EntryType::Link, "pw")
        }]);
        assert!(e.contains("\"pw\"") && e.contains("/etc/passwd"), "{e}");
        let e = s.refused(&[Raw {
            link: b"../outside",
            ..raw(tar::EntryType::Link, "out")
        }]);
        assert!(
            e.contains("\"out\"") && e.contains("leaves the layer"),
            "{e}"
        );
        let keep = s.victim.join("keep").display().to_string();
        let e = s.refused(&[
            Raw {
                link: keep.as_bytes(),
                ..raw(tar::EntryType::Symlink, "l")
            },
            Raw {
                link: b"l",
                ..raw(tar::EntryType::Link, "h")
            },
        ]);
        assert!(e.contains("\"h\"") && e.contains("a symbolic link"), "{e}");
        assert_eq!(
            std::fs::metadata("/etc/passwd").unwrap().nlink(),
            passwd_links
        );

        // Devices: a block device, and a character device that is no whiteout.
        let s = Scene::new();
        let e = s.refused(&[Raw {
            dev: (8, 0),
            ..raw(tar::EntryType::Block, "sda")
        }]);
        assert!(e.contains("\"sda\"") && e.contains("block device"), "{e}");
        let e = s.refused(&[Raw {
            dev: (1, 1),
            ..raw(tar::EntryType::Char, "mem")
        }]);
        assert!(
            e.contains("\"mem\"") && e.contains("character device 1:1"),
            "{e}"
        );
        assert!(!s.upper.join("sda").exists() && !s.upper.join("mem").exists());
    }

    #[test]
    fn fifos_setuid_files_and_inner_hard_links_are_kept() {
        let s = Scene::new();
        let archive = s.t.path().join("ok.tar");
        evil_archive(
            &archive,
            &[
                raw(tar::EntryType::Directory, "bin/"),
                Raw {
                    data: b"#!/bin/sh\n",
                    mode: 0o4755,
                    ..raw(tar::EntryType::Regular, "bin/tool")
                },
                Raw {
                    link: b"bin/tool",
                    ..raw(tar::EntryType::Link, "bin/tool2")
                },
                Raw {
                    mode: 0o620,
                    ..raw(tar::EntryType::Fifo, "pipe")
                },
                // Implicit parents are created.
                raw(tar::EntryType::Regular, "deep/er/file"),
            ],
        );
        unpack_layer(&archive, &s.upper, None).unwrap();
        // setuid is kept: the overlay is mounted nosuid.
        let m = std::fs::metadata(s.upper.join("bin/tool")).unwrap();
        assert_eq!(m.mode() & 0o7777, 0o4755);
        assert_eq!(m.nlink(), 2);
        assert_eq!(m.mtime(), 1_700_000_000);
        let p = std::fs::symlink_metadata(s.upper.join("pipe")).unwrap();
        assert!(p.file_type().is_fifo());
        assert_eq!(p.mode() & 0o7777, 0o620);
        assert!(s.upper.join("deep/er/file").is_file());
    }

    #[test]
    fn owners_are_stored_relative_to_the_sandbox_range() {
        let base_a = 1_000_000_000;
        let base_b = 1_000_065_536;
        let src = tempfile::tempdir().unwrap();
        let up = src.path();
        std::fs::create_dir(up.join("home")).unwrap();
        std::os::unix::fs::lchown(up.join("home"), Some(base_a + 1000), Some(base_a + 1000))
            .unwrap();
        std::fs::write(up.join("home/f"), b"x").unwrap();
        std::os::unix::fs::lchown(up.join("home/f"), Some(base_a), Some(base_a + 5)).unwrap();
        // Host root's file: outside the range, it was the overflow id inside.
        std::fs::write(up.join("rootfile"), b"y").unwrap();
        std::os::unix::fs::symlink("f", up.join("home/l")).unwrap();
        std::os::unix::fs::lchown(up.join("home/l"), Some(base_a + 7), Some(base_a + 7)).unwrap();

        let out = tempfile::tempdir().unwrap();
        let archive = out.path().join(LAYER_FILE_PLAIN);
        archive_layer(up, &archive, Some(base_a)).unwrap();
        let mut a = tar::Archive::new(std::fs::File::open(&archive).unwrap());
        let owners: Vec<(String, u64, u64)> = a
            .entries()
            .unwrap()
            .map(|e| {
                let e = e.unwrap();
                let h = e.header();
                (
                    e.path().unwrap().display().to_string(),
                    h.uid().unwrap(),
                    h.gid().unwrap(),
                )
            })
            .collect();
        assert!(owners.contains(&("home".into(), 1000, 1000)), "{owners:?}");
        assert!(owners.contains(&("home/f".into(), 0, 5)), "{owners:?}");
        assert!(owners.contains(&("home/l".into(), 7, 7)), "{owners:?}");
        assert!(
            owners.contains(&("rootfile".into(), 65_534, 65_534)),
            "{owners:?}"
        );

        let dst = out.path().join("upper");
        std::fs::create_dir(&dst).unwrap();
        unpack_layer(&archive, &dst, Some(base_b)).unwrap();
        let ids = |p: &str| {
            let m = std::fs::symlink_metadata(dst.join(p)).unwrap();
            (m.uid(), m.gid())
        };
        assert_eq!(ids("home"), (base_b + 1000, base_b + 1000));
        assert_eq!(ids("home/f"), (base_b, base_b + 5));
        assert_eq!(ids("home/l"), (base_b + 7, base_b + 7));
        assert_eq!(ids("rootfile"), (base_b + 65_534, base_b + 65_534));

        // An owner outside a sandbox's range is refused when shifting.
        let s = Scene::new();
        let archive = s.t.path().join("evil.tar");
        {
            let mut b = tar::Builder::new(std::fs::File::create(&archive).unwrap());
            let mut h = tar::Header::new_gnu();
            h.set_entry_type(tar::EntryType::Regular);
            h.set_size(0);
            h.set_mode(0o644);
            h.set_uid(70_000);
            h.set_gid(0);
            h.set_cksum();
            b.append_data(&mut h, "f", std::io::empty()).unwrap();
            b.finish().unwrap();
        }
        let e = unpack_layer(&archive, &s.upper, Some(base_b))
            .unwrap_err()
            .to_string();
        assert!(e.contains("\"f\"") && e.contains("70000"), "{e}");
    }

    #[test]
    fn archiving_never_follows_links_or_opens_devices() {
        // The layer holds links to host files and directories and a device node; the
        // archive holds the links themselves, nothing of the host.
        let s = Scene::new();
        std::os::unix::fs::symlink(&s.victim, s.upper.join("dir")).unwrap();
        std::os::unix::fs::symlink(s.victim.join("keep"), s.upper.join("file")).unwrap();
        nix::sys::stat::mknod(
            &s.upper.join("null"),
            SFlag::S_IFCHR,
            nix::sys::stat::Mode::from_bits_truncate(0o666),
            makedev(1, 3),
        )
        .unwrap();
        let archive = s.t.path().join("layer.tar");
        archive_layer(&s.upper, &archive, None).unwrap();
        let raw = std::fs::read(&archive).unwrap();
        assert!(
            !raw.windows(4).any(|w| w == b"host"),
            "host file content in the archive"
        );
        let mut a = tar::Archive::new(raw.as_slice());
        let kinds: Vec<(String, tar::EntryType)> = a
            .entries()
            .unwrap()
            .map(|e| {
                let e = e.unwrap();
                (
                    e.path().unwrap().display().to_string(),
                    e.header().entry_type(),
                )
            })
            .collect();
        // A device node other than a whiteout is left out (unpacking would refuse it).
        assert_eq!(
            kinds,
            [
                ("dir".to_string(), tar::EntryType::Symlink),
                ("file".to_string(), tar::EntryType::Symlink),
            ]
        );
        // The upper directory itself must not be a link.
        let l = s.t.path().join("l");
        std::os::unix::fs::symlink(&s.upper, &l).unwrap();
        assert!(archive_layer(&l, &s.t.path().join("x.tar"), None).is_err());
        std::fs::remove_file(&l).unwrap();
        std::fs::remove_file(s.t.path().join("x.tar")).unwrap();
    }
}
