//! Applying one image layer (a tar archive) onto a root filesystem directory.
//!
//! Layers stack: each one adds and replaces files of the ones below it and removes some
//! of them with *whiteouts*, in either of two conventions, both understood here:
//!
//! * OCI (and Docker): an entry `.wh.<name>` removes `<name>` of the layers below; an
//!   entry `.wh..wh..opq` in a directory empties it of what the layers below put there.
//! * overlayfs (what `archive_layer` of the jail writes): a character device 0:0 removes
//!   its path; a directory carrying the PAX record
//!   `SCHILY.xattr.trusted.overlay.opaque=y` is emptied before its children are applied.
//!
//! Whiteouts only ever remove what lower layers left: an entry this same layer created is
//! kept, whatever the order of the archive.
//!
//! A layer is hostile (anyone can craft an image): every entry is created through
//! [`SafeDir`], which resolves paths with `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)`
//! and acts on the last component without following it. So a path with `..`, a path
//! through a symlink (one the layer itself planted, `a -> /etc` then `a/passwd`, or one a
//! lower layer left), a hard link to something outside the root: the layer is refused
//! with an error naming the entry, and nothing is ever written outside `root`. A leading
//! `/` is dropped (as tar does): paths are relative to the root either way. Device nodes
//! and FIFOs (other than whiteouts) are skipped and counted: a root filesystem for a
//! sandbox gets its devices from the node.
//!
//! Owners are kept as archived (numeric), so are modes (setuid included: the sandbox's
//! root is mounted `nosuid` and the node never runs files of a template) and mtimes.
//! Extended attributes are not restored.

use std::collections::HashSet;
use std::ffi::OsStr;
use std::io::Read;
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};
use std::time::{Duration, SystemTime};

use crate::host::safefs::{SafeDir, SafeFsError};

/// Prefix of an OCI whiteout's name.
pub const WHITEOUT_PREFIX: &str = ".wh.";
/// Name of an OCI opaque-directory marker.
pub const OPAQUE_MARKER: &str = ".wh..wh..opq";
/// PAX record of overlayfs' opaque-directory attribute.
const OVERLAY_OPAQUE_PAX: &str = "SCHILY.xattr.trusted.overlay.opaque";

/// Errors of applying a layer. `entry` is the archive's path of the entry (lossy UTF-8).
#[derive(Debug, thiserror::Error)]
pub enum ApplyError {
    #[error(
        "layer entry {entry:?}: {reason}; the layer is refused (the image is malformed or hostile)"
    )]
    Refused { entry: String, reason: String },
    #[error("layer entry {entry:?}: {source}; the layer is refused")]
    Entry {
        entry: String,
        #[source]
        source: SafeFsError,
    },
    #[error(
        "the layer has more than {limit} entries; raise ApplyOptions::max_entries if the image is trusted"
    )]
    TooManyEntries { limit: u64 },
    #[error("the root filesystem {}: {source}", root.display())]
    Root {
        root: PathBuf,
        #[source]
        source: SafeFsError,
    },
    #[error("reading the layer archive: {0} (the layer is truncated or not a tar archive)")]
    Read(#[source] std::io::Error),
    #[error("writing {entry:?}: {source}")]
    Write {
        entry: String,
        #[source]
        source: std::io::Error,
    },
}

/// Limits of [`apply_layer`].
#[derive(Debug, Clone)]
pub struct ApplyOptions {
    /// Most entries one layer may hold.
    pub max_entries: u64,
    /// Longest path of an entry (or a hard link's target), in bytes.
    pub max_path_len: usize,
}

impl Default for ApplyOptions {
    fn default() -> Self {
        Self {
            max_entries: 1_000_000,
            max_path_len: 4096,
        }
    }
}

/// What [`apply_layer`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ApplyStats {
    pub files: u64,
    pub dirs: u64,
    pub symlinks: u64,
    pub hard_links: u64,
    /// Whiteouts of either convention (removing a path).
    pub whiteouts: u64,
    /// Opaque directories of either convention.
    pub opaque_dirs: u64,
    /// Device nodes and FIFOs skipped.
    pub skipped_devices: u64,
    /// Entries of other types skipped (sockets, unknown types).
    pub skipped_other: u64,
    /// Bytes of file content written.
    pub bytes: u64,
}

/// `p` relative to the root: `.` and a leading `/` dropped, `..` refused, lengths bounded.
fn clean_path(p: &Path, opts: &ApplyOptions) -> Result<PathBuf, String> {
    if p.as_os_str().len() > opts.max_path_len {
        return Err(format!(
            "a path of {} bytes (at most {} allowed)",
            p.as_os_str().len(),
            opts.max_path_len
        ));
    }
    let mut out = PathBuf::new();
    for c in p.components() {
        match c {
            Component::Normal(n) => {
                if n.len() > 255 {
                    return Err(format!("a name of {} bytes (at most 255)", n.len()));
                }
                out.push(n)
            }
            Component::CurDir | Component::RootDir => {}
            Component::Prefix(_) => return Err("a path prefix".into()),
            Component::ParentDir => return Err("a `..` would leave the root".into()),
        }
    }
    Ok(out)
}

fn epoch(secs: u64) -> SystemTime {
    SystemTime::UNIX_EPOCH + Duration::from_secs(secs)
}

/// Applies the tar layer read from `reader` onto the root filesystem `root` (see the
/// module docs). On an error the root is left partly applied: the caller discards it.
pub fn apply_layer(
    reader: impl Read,
    root: &Path,
    opts: &ApplyOptions,
) -> Result<ApplyStats, ApplyError> {
    let root_dir = SafeDir::open(root).map_err(|source| ApplyError::Root {
        root: root.to_path_buf(),
        source,
    })?;
    Applier {
        root: root_dir,
        opts,
        stats: ApplyStats::default(),
        created: HashSet::new(),
        dirs: Vec::new(),
    }
    .run(reader)
}

struct Applier<'a> {
    root: SafeDir,
    opts: &'a ApplyOptions,
    stats: ApplyStats,
    /// Paths this layer created: whiteouts and opaque markers leave them alone.
    created: HashSet<PathBuf>,
    /// Directories (path, mode, mtime) to finish last: creating entries in them changes
    /// their times, and a read-only mode must not get in the way.
    dirs: Vec<(PathBuf, u32, u64)>,
}

impl Applier<'_> {
    fn run(mut self, reader: impl Read) -> Result<ApplyStats, ApplyError> {
        let mut archive = tar::Archive::new(reader);
        let mut count = 0u64;
        for entry in archive.entries().map_err(ApplyError::Read)? {
            let entry = entry.map_err(ApplyError::Read)?;
            count += 1;
            if count > self.opts.max_entries {
                return Err(ApplyError::TooManyEntries {
                    limit: self.opts.max_entries,
                });
            }
            self.entry(entry)?;
        }
        for (rel, mode, mtime) in std::mem::take(&mut self.dirs).iter().rev() {
            let fs = |source| ApplyError::Entry {
                entry: rel.display().to_string(),
                source,
            };
            // A later entry may have replaced the directory: only finish a directory.
            if !rel.as_os_str().is_empty() {
                match self.root.stat_nofollow(rel).map_err(fs)? {
                    Some(st) if st.st_mode & libc::S_IFMT == libc::S_IFDIR => {}
                    _ => continue,
                }
            }
            self.root.chmod_nofollow(rel, *mode).map_err(fs)?;
            self.root
                .set_times(rel, None, Some(epoch(*mtime)))
                .map_err(fs)?;
        }
        Ok(self.stats)
    }

    fn entry<R: Read>(&mut self, mut entry: tar::Entry<'_, R>) -> Result<(), ApplyError> {
        let shown = String::from_utf8_lossy(&entry.path_bytes()).into_owned();
        let refused = |reason: String| ApplyError::Refused {
            entry: shown.clone(),
            reason,
        };
        let fs = |source: SafeFsError| ApplyError::Entry {
            entry: shown.clone(),
            source,
        };
        let kind = entry.header().entry_type();
        if matches!(
            kind,
            tar::EntryType::XGlobalHeader | tar::EntryType::XHeader
        ) {
            return Ok(());
        }
        let raw = entry
            .path()
            .map_err(|e| refused(format!("an unreadable path ({e})")))?
            .into_owned();
        let rel = clean_path(&raw, self.opts).map_err(&refused)?;
        let h = entry.header();
        let bad = |e: std::io::Error| refused(format!("a bad header ({e})"));
        let mode = h.mode().map_err(bad)? & 0o7777;
        let uid = u32::try_from(h.uid().map_err(bad)?)
            .map_err(|_| refused("an owner id beyond 32 bits".into()))?;
        let gid = u32::try_from(h.gid().map_err(bad)?)
            .map_err(|_| refused("a group id beyond 32 bits".into()))?;
        let mtime = h.mtime().map_err(bad)?;
        let device = (
            h.device_major().ok().flatten().unwrap_or(0),
            h.device_minor().ok().flatten().unwrap_or(0),
        );
        let opaque_pax = match entry.pax_extensions().map_err(bad)? {
            Some(exts) => exts
                .filter_map(Result::ok)
                .any(|e| e.key().ok() == Some(OVERLAY_OPAQUE_PAX) && e.value_bytes() == b"y"),
            None => false,
        };

        if rel.as_os_str().is_empty() {
            // The layer's own root (`./`): only its mode and times.
            if kind == tar::EntryType::Directory {
                if opaque_pax {
                    self.make_opaque(Path::new("")).map_err(fs)?;
                }
                self.dirs.push((rel, mode, mtime));
            }
            return Ok(());
        }
        let (parent, name) = match (rel.parent(), rel.file_name()) {
            (Some(p), Some(n)) => (p.to_path_buf(), n.to_os_string()),
            _ => return Err(refused("not a path beneath the root".into())),
        };

        // OCI whiteouts.
        if let Some(hidden) = name.as_bytes().strip_prefix(WHITEOUT_PREFIX.as_bytes()) {
            if name == OPAQUE_MARKER {
                self.make_opaque(&parent).map_err(fs)?;
                self.stats.opaque_dirs += 1;
            } else {
                if hidden.is_empty() || hidden == b"." || hidden == b".." {
                    return Err(refused("a whiteout naming no entry".into()));
                }
                self.white_out(&parent.join(OsStr::from_bytes(hidden)))
                    .map_err(fs)?;
                self.stats.whiteouts += 1;
            }
            return Ok(());
        }

        match kind {
            tar::EntryType::Directory => {
                // A directory replacing a directory merges; anything else goes.
                self.root.remove_non_dir(&rel).map_err(fs)?;
                self.root.create_dir_all(&rel, 0o700).map_err(fs)?;
                self.root.chown_nofollow(&rel, uid, gid).map_err(fs)?;
                if opaque_pax {
                    self.make_opaque(&rel).map_err(fs)?;
                    self.stats.opaque_dirs += 1;
                }
                self.created.insert(rel.clone());
                self.dirs.push((rel, mode, mtime));
                self.stats.dirs += 1;
            }
            tar::EntryType::Regular | tar::EntryType::Continuous | tar::EntryType::GNUSparse => {
                let dir = self.root.create_dir_all(&parent, 0o755).map_err(fs)?;
                let name = Path::new(&name);
                dir.remove_all(name).map_err(fs)?;
                let mut f = dir.create_file(name, 0o600).map_err(fs)?;
                let n = std::io::copy(&mut entry, &mut f).map_err(|source| ApplyError::Write {
                    entry: shown.clone(),
                    source,
                })?;
                let io = |e: nix::errno::Errno| ApplyError::Write {
                    entry: shown.clone(),
                    source: e.into(),
                };
                // The owner first: chown clears setuid bits, the mode then sets them.
                nix::unistd::fchown(
                    &f,
                    Some(nix::unistd::Uid::from_raw(uid)),
                    Some(nix::unistd::Gid::from_raw(gid)),
                )
                .map_err(io)?;
                nix::sys::stat::fchmod(&f, nix::sys::stat::Mode::from_bits_truncate(mode))
                    .map_err(io)?;
                drop(f);
                dir.set_times(name, None, Some(epoch(mtime))).map_err(fs)?;
                self.created.insert(rel);
                self.stats.files += 1;
                self.stats.bytes += n;
            }
            tar::EntryType::Symlink => {
                // Any target: the link is created, never followed.
                let target = entry
                    .link_name()
                    .map_err(bad)?
                    .ok_or_else(|| refused("a symlink without a target".into()))?;
                if target.as_os_str().len() > self.opts.max_path_len {
                    return Err(refused("a symlink target too long".into()));
                }
                let dir = self.root.create_dir_all(&parent, 0o755).map_err(fs)?;
                let name = Path::new(&name);
                dir.remove_all(name).map_err(fs)?;
                dir.symlink_at(name, &target).map_err(fs)?;
                dir.chown_nofollow(name, uid, gid).map_err(fs)?;
                dir.set_times(name, None, Some(epoch(mtime))).map_err(fs)?;
                self.created.insert(rel);
                self.stats.symlinks += 1;
            }
            tar::EntryType::Link => {
                let raw_target = entry
                    .link_name()
                    .map_err(bad)?
                    .ok_or_else(|| refused("a hard link without a target".into()))?;
                let target = clean_path(&raw_target, self.opts).map_err(|why| {
                    refused(format!("a hard link to {}: {why}", raw_target.display()))
                })?;
                if target.as_os_str().is_empty() || target == rel {
                    return Err(refused(format!(
                        "a hard link to {} (itself or the root)",
                        raw_target.display()
                    )));
                }
                self.root.create_dir_all(&parent, 0o755).map_err(fs)?;
                // The target is checked before anything at `rel` goes.
                match self.root.stat_nofollow(&target).map_err(fs)? {
                    Some(st) if st.st_mode & libc::S_IFMT == libc::S_IFREG => {}
                    Some(_) => {
                        return Err(refused(format!(
                            "a hard link to {}, which is not a regular file",
                            target.display()
                        )));
                    }
                    None => {
                        return Err(refused(format!(
                            "a hard link to {}, which does not exist in the root",
                            target.display()
                        )));
                    }
                }
                self.root.remove_all(&rel).map_err(fs)?;
                self.root.hard_link_within(&target, &rel).map_err(fs)?;
                self.created.insert(rel);
                self.stats.hard_links += 1;
            }
            tar::EntryType::Char if device == (0, 0) => {
                self.white_out(&rel).map_err(fs)?;
                self.stats.whiteouts += 1;
            }
            tar::EntryType::Char | tar::EntryType::Block | tar::EntryType::Fifo => {
                tracing::debug!(entry = %shown, "skipping a device node or FIFO of a layer");
                self.stats.skipped_devices += 1;
            }
            other => {
                tracing::debug!(entry = %shown, kind = ?other, "skipping a layer entry of an unsupported type");
                self.stats.skipped_other += 1;
            }
        }
        Ok(())
    }

    /// Removes `rel` (a whole tree) unless this layer created it. A parent that does not
    /// exist means there is nothing to remove.
    fn white_out(&mut self, rel: &Path) -> Result<(), SafeFsError> {
        if self.created.contains(rel) {
            return Ok(());
        }
        match self.root.remove_all(rel) {
            Ok(_) => Ok(()),
            Err(SafeFsError::NotDirectory { .. }) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Empties the directory `rel` of what lower layers put there (entries this layer
    /// created stay). A missing directory is created by the entries that follow.
    fn make_opaque(&mut self, rel: &Path) -> Result<(), SafeFsError> {
        let dir = match self.root.open_dir(rel) {
            Ok(d) => d,
            Err(e) if e.is_not_found() => return Ok(()),
            Err(e) => return Err(e),
        };
        for name in dir.entries()? {
            if !self.created.contains(&rel.join(&name)) {
                dir.remove_all(&name)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    /// Builds a tar archive from entries added by `f`.
    fn layer(f: impl FnOnce(&mut tar::Builder<Vec<u8>>)) -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        f(&mut b);
        b.into_inner().unwrap()
    }

    fn header(kind: tar::EntryType, mode: u32, size: u64) -> tar::Header {
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(kind);
        h.set_mode(mode);
        h.set_size(size);
        h.set_uid(0);
        h.set_gid(0);
        h.set_mtime(1_000_000);
        h
    }

    fn file(b: &mut tar::Builder<Vec<u8>>, path: &str, data: &[u8]) {
        let mut h = header(tar::EntryType::Regular, 0o644, data.len() as u64);
        b.append_data(&mut h, path, data).unwrap();
    }

    fn dir(b: &mut tar::Builder<Vec<u8>>, path: &str) {
        let mut h = header(tar::EntryType::Directory, 0o755, 0);
        b.append_data(&mut h, path, std::io::empty()).unwrap();
    }

    fn symlink(b: &mut tar::Builder<Vec<u8>>, path: &str, target: &str) {
        let mut h = header(tar::EntryType::Symlink, 0o777, 0);
        b.append_link(&mut h, path, target).unwrap();
    }

    fn hardlink(b: &mut tar::Builder<Vec<u8>>, path: &str, target: &str) {
        let mut h = header(tar::EntryType::Link, 0o644, 0);
        b.append_link(&mut h, path, target).unwrap();
    }

    /// An entry with a raw name written into the header bytes (the tar crate refuses
    /// `..` and absolute paths when building, as a hostile tool would not).
    fn raw(b: &mut tar::Builder<Vec<u8>>, kind: tar::EntryType, name: &[u8], link: &[u8]) {
        let mut h = header(kind, 0o644, 0);
        {
            let g = h.as_gnu_mut().unwrap();
            g.name[..name.len()].copy_from_slice(name);
            g.linkname[..link.len()].copy_from_slice(link);
        }
        h.set_cksum();
        b.append(&h, std::io::empty()).unwrap();
    }

    fn apply(root: &Path, data: &[u8]) -> Result<ApplyStats, ApplyError> {
        apply_layer(data, root, &ApplyOptions::default())
    }

    /// A root and a victim directory next to it.
    fn setup() -> (tempfile::TempDir, PathBuf, PathBuf) {
        let t = tempfile::tempdir().unwrap();
        let root = t.path().join("root");
        let victim = t.path().join("victim");
        std::fs::create_dir(&root).unwrap();
        std::fs::create_dir(&victim).unwrap();
        std::fs::write(victim.join("passwd"), b"host").unwrap();
        (t, root, victim)
    }

    fn victim_unchanged(victim: &Path) {
        let names: Vec<_> = std::fs::read_dir(victim)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["passwd"], "the victim directory changed");
        assert_eq!(std::fs::read(victim.join("passwd")).unwrap(), b"host");
    }

    #[test]
    fn apply_keeps_owners_modes_times_and_links() {
        let (_t, root, _v) = setup();
        let data = layer(|b| {
            dir(b, "./");
            dir(b, "usr/bin");
            let mut h = header(tar::EntryType::Regular, 0o4755, 3);
            h.set_uid(1234);
            h.set_gid(5678);
            b.append_data(&mut h, "usr/bin/su", &b"elf"[..]).unwrap();
            symlink(b, "bin", "usr/bin");
            hardlink(b, "usr/bin/su2", "usr/bin/su");
            let mut h = header(tar::EntryType::Fifo, 0o644, 0);
            b.append_data(&mut h, "fifo", std::io::empty()).unwrap();
            let mut h = header(tar::EntryType::Block, 0o644, 0);
            h.set_device_major(8).unwrap();
            b.append_data(&mut h, "sda", std::io::empty()).unwrap();
        });
        let stats = apply(&root, &data).unwrap();
        assert_eq!(
            (stats.files, stats.dirs, stats.symlinks, stats.hard_links),
            (1, 1, 1, 1)
        );
        assert_eq!(stats.skipped_devices, 2);
        assert_eq!(stats.bytes, 3);
        let m = std::fs::metadata(root.join("usr/bin/su")).unwrap();
        assert_eq!(m.mode() & 0o7777, 0o4755);
        assert_eq!((m.uid(), m.gid()), (1234, 5678));
        assert_eq!(m.mtime(), 1_000_000);
        assert_eq!(m.nlink(), 2);
        assert_eq!(
            std::fs::read_link(root.join("bin")).unwrap(),
            Path::new("usr/bin")
        );
        let d = std::fs::metadata(root.join("usr/bin")).unwrap();
        assert_eq!((d.mode() & 0o7777, d.mtime()), (0o755, 1_000_000));
        assert!(!root.join("fifo").exists() && !root.join("sda").exists());
    }

    #[test]
    fn apply_oci_whiteouts_and_opaque_dirs() {
        let (_t, root, _v) = setup();
        apply(
            &root,
            &layer(|b| {
                file(b, "a/keep", b"1");
                file(b, "a/gone", b"1");
                dir(b, "a/gonedir");
                file(b, "a/gonedir/x", b"1");
                file(b, "o/lower1", b"1");
                dir(b, "o/lowerdir");
                file(b, "o/lowerdir/y", b"1");
            }),
        )
        .unwrap();
        let stats = apply(
            &root,
            &layer(|b| {
                file(b, "a/.wh.gone", b"");
                file(b, "a/.wh.gonedir", b"");
                file(b, "a/.wh.never-there", b"");
                file(b, "nodir/.wh.x", b"");
                // This layer's own file, then the opaque marker after it: the file stays.
                file(b, "o/upper-before", b"2");
                file(b, "o/.wh..wh..opq", b"");
                file(b, "o/upper-after", b"2");
            }),
        )
        .unwrap();
        assert_eq!((stats.whiteouts, stats.opaque_dirs), (4, 1));
        assert!(root.join("a/keep").exists());
        assert!(!root.join("a/gone").exists());
        assert!(!root.join("a/gonedir").exists());
        assert!(!root.join("a/.wh.gone").exists());
        let mut names: Vec<_> = std::fs::read_dir(root.join("o"))
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        assert_eq!(names, ["upper-after", "upper-before"]);
    }

    #[test]
    fn apply_overlay_whiteouts_and_opaque_dirs() {
        let (_t, root, _v) = setup();
        apply(
            &root,
            &layer(|b| {
                file(b, "a/gone", b"1");
                file(b, "a/keep", b"1");
                file(b, "o/lower", b"1");
            }),
        )
        .unwrap();
        let stats = apply(
            &root,
            &layer(|b| {
                let mut h = header(tar::EntryType::Char, 0, 0);
                h.set_device_major(0).unwrap();
                h.set_device_minor(0).unwrap();
                b.append_data(&mut h, "a/gone", std::io::empty()).unwrap();
                let mut h = header(tar::EntryType::Directory, 0o755, 0);
                b.append_pax_extensions([(OVERLAY_OPAQUE_PAX, &b"y"[..])])
                    .unwrap();
                b.append_data(&mut h, "o", std::io::empty()).unwrap();
                file(b, "o/upper", b"2");
                // A real character device is skipped, not created.
                let mut h = header(tar::EntryType::Char, 0o666, 0);
                h.set_device_major(1).unwrap();
                h.set_device_minor(3).unwrap();
                b.append_data(&mut h, "null", std::io::empty()).unwrap();
            }),
        )
        .unwrap();
        assert_eq!(
            (stats.whiteouts, stats.opaque_dirs, stats.skipped_devices),
            (1, 1, 1)
        );
        assert!(!root.join("a/gone").exists());
        assert!(root.join("a/keep").exists());
        assert!(!root.join("o/lower").exists());
        assert!(root.join("o/upper").exists());
        assert!(!root.join("null").exists());
        assert!(
            xattr::get(root.join("o"), "trusted.overlay.opaque")
                .unwrap()
                .is_none()
        );
    }

    #[test]
    fn apply_replaces_whatever_is_at_a_path() {
        let (_t, root, _v) = setup();
        apply(
            &root,
            &layer(|b| {
                file(b, "was-file", b"1");
                dir(b, "was-dir");
                file(b, "was-dir/inner", b"1");
                symlink(b, "was-link", "/etc");
                dir(b, "merge");
                file(b, "merge/lower", b"1");
            }),
        )
        .unwrap();
        apply(
            &root,
            &layer(|b| {
                dir(b, "was-file");
                file(b, "was-file/x", b"2");
                file(b, "was-dir", b"now a file");
                file(b, "was-link", b"now a file");
                dir(b, "merge");
                file(b, "merge/upper", b"2");
            }),
        )
        .unwrap();
        assert!(root.join("was-file").is_dir());
        assert!(root.join("was-file/x").is_file());
        assert_eq!(std::fs::read(root.join("was-dir")).unwrap(), b"now a file");
        let m = std::fs::symlink_metadata(root.join("was-link")).unwrap();
        assert!(m.is_file());
        assert!(root.join("merge/lower").exists() && root.join("merge/upper").exists());
    }

    #[test]
    fn apply_refuses_a_path_through_a_planted_symlink() {
        let (_t, root, victim) = setup();
        let data = layer(|b| {
            symlink(b, "a", victim.to_str().unwrap());
            file(b, "a/passwd", b"pwned");
        });
        let e = apply(&root, &data).unwrap_err();
        assert!(
            matches!(&e, ApplyError::Entry { entry, source: SafeFsError::Symlink { .. } } if entry == "a/passwd"),
            "{e:?}"
        );
        victim_unchanged(&victim);
        // Relative links climbing out, through a directory, for every kind of entry.
        for (kind, link) in [
            (tar::EntryType::Regular, ""),
            (tar::EntryType::Directory, ""),
            (tar::EntryType::Symlink, "x"),
            (tar::EntryType::Link, "d/f"),
        ] {
            let (_t, root, victim) = setup();
            let data = layer(|b| {
                dir(b, "d");
                file(b, "d/f", b"1");
                symlink(b, "d/up", "../../victim");
                raw(b, kind, b"d/up/passwd", link.as_bytes());
            });
            assert!(apply(&root, &data).is_err(), "{kind:?}");
            victim_unchanged(&victim);
        }
        // Whiteouts through a link remove nothing outside.
        let (_t, root, victim) = setup();
        let data = layer(|b| {
            symlink(b, "a", victim.to_str().unwrap());
            file(b, "a/.wh.passwd", b"");
            file(b, "a/.wh..wh..opq", b"");
        });
        assert!(apply(&root, &data).is_err());
        victim_unchanged(&victim);
        let (_t, root, victim) = setup();
        let data = layer(|b| {
            symlink(b, "a", victim.to_str().unwrap());
            let mut h = header(tar::EntryType::Char, 0, 0);
            b.append_data(&mut h, "a/passwd", std::io::empty()).unwrap();
        });
        assert!(apply(&root, &data).is_err());
        victim_unchanged(&victim);
    }

    #[test]
    fn apply_refuses_dotdot_and_confines_absolute_paths() {
        let (_t, root, victim) = setup();
        for name in [&b"../victim/passwd"[..], b"a/../../victim/passwd", b".."] {
            let data = layer(|b| raw(b, tar::EntryType::Regular, name, b""));
            let e = apply(&root, &data).unwrap_err();
            assert!(matches!(e, ApplyError::Refused { .. }), "{e:?}");
            assert!(e.to_string().contains("`..`"), "{e}");
        }
        victim_unchanged(&victim);
        // An absolute path lands inside the root.
        let abs = victim.join("passwd");
        let data = layer(|b| raw(b, tar::EntryType::Regular, abs.as_os_str().as_bytes(), b""));
        apply(&root, &data).unwrap();
        assert!(root.join(abs.strip_prefix("/").unwrap()).is_file());
        victim_unchanged(&victim);
    }

    #[test]
    fn apply_refuses_hard_links_leaving_the_root() {
        let (_t, root, victim) = setup();
        let target = victim.join("passwd");
        for link in [
            target.to_str().unwrap().as_bytes(),
            &b"../victim/passwd"[..],
            b"nonexistent",
            b"",
        ] {
            let data = layer(|b| raw(b, tar::EntryType::Link, b"x", link));
            let e = apply(&root, &data).unwrap_err();
            assert!(matches!(e, ApplyError::Refused { .. }), "{link:?}: {e:?}");
        }
        // Through a planted symlink to the victim directory.
        let data = layer(|b| {
            symlink(b, "v", victim.to_str().unwrap());
            raw(b, tar::EntryType::Link, b"x", b"v/passwd");
        });
        assert!(apply(&root, &data).is_err());
        // To a symlink or a directory inside.
        let data = layer(|b| {
            symlink(b, "l", victim.join("passwd").to_str().unwrap());
            raw(b, tar::EntryType::Link, b"x", b"l");
        });
        assert!(apply(&root, &data).is_err());
        let data = layer(|b| {
            dir(b, "d");
            raw(b, tar::EntryType::Link, b"x", b"d");
        });
        assert!(apply(&root, &data).is_err());
        assert!(!root.join("x").exists());
        assert_eq!(std::fs::metadata(&target).unwrap().nlink(), 1);
        victim_unchanged(&victim);
    }

    #[test]
    fn apply_refuses_huge_names_and_too_many_entries() {
        let (_t, root, _v) = setup();
        let long = "n".repeat(300);
        let data = layer(|b| file(b, &long, b"1"));
        let e = apply(&root, &data).unwrap_err();
        assert!(e.to_string().contains("at most 255"), "{e}");
        let deep = vec!["d"; 3000].join("/");
        let data = layer(|b| file(b, &deep, b"1"));
        let e = apply(&root, &data).unwrap_err();
        assert!(e.to_string().contains("at most 4096"), "{e}");
        let data = layer(|b| {
            for i in 0..5 {
                file(b, &format!("f{i}"), b"1");
            }
        });
        let opts = ApplyOptions {
            max_entries: 3,
            ..Default::default()
        };
        let e = apply_layer(&data[..], &root, &opts).unwrap_err();
        assert!(matches!(e, ApplyError::TooManyEntries { limit: 3 }), "{e}");
    }

    #[test]
    fn apply_refuses_a_root_that_is_a_symlink_and_truncated_archives() {
        let (t, root, victim) = setup();
        let link = t.path().join("link");
        std::os::unix::fs::symlink(&victim, &link).unwrap();
        let data = layer(|b| file(b, "passwd", b"x"));
        assert!(matches!(
            apply(&link, &data).unwrap_err(),
            ApplyError::Root { .. }
        ));
        victim_unchanged(&victim);
        let data = layer(|b| file(b, "big", &[7u8; 4096]));
        let e = apply(&root, &data[..1024]).unwrap_err();
        assert!(
            matches!(e, ApplyError::Read(_) | ApplyError::Write { .. }),
            "{e:?}"
        );
    }
}
