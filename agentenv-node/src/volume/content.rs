//! The file operations of the volume content API (`/volumecontent/{id}/dir|path|file`)
//! on a volume's data directory: list, status, make a directory, change owner and mode,
//! remove, read and write files.
//!
//! Every file of a volume was written by some tenant. Every operation resolves its path
//! beneath the data directory through [`SafeDir`]: a symlink on the way is refused and a
//! symlink at the path is reported as one (never followed); devices, FIFOs and sockets
//! are never opened. Paths are the volume's own, absolute (`/` is the data directory);
//! owners are the ids sandboxes see (0..65535).

use std::ffi::OsString;
use std::fs::File;
use std::path::{Component, Path, PathBuf};
use std::time::{Duration, SystemTime};

use nix::sys::stat::{FileStat, SFlag};
use serde::Serialize;

use crate::host::safefs::{SafeDir, SafeFsError};

/// Deepest listing (`depth`).
pub const MAX_DEPTH: u32 = 32;

/// Most entries one listing returns.
pub const MAX_ENTRIES: usize = 10_000;

/// Highest uid or gid on a volume (sandboxes map 0..65535).
pub const MAX_ID: u32 = 65_535;

/// Errors of content operations; the API maps each to a status.
#[derive(Debug, thiserror::Error)]
pub enum ContentError {
    #[error(
        "invalid path {0:?}: use an absolute path inside the volume, e.g. \"/dir/file.txt\", without `..`"
    )]
    BadPath(String),
    #[error("path {0} not found")]
    NotFound(String),
    #[error("{path} is {what}: {hint}")]
    WrongType {
        path: String,
        what: &'static str,
        hint: &'static str,
    },
    #[error("{0} already exists")]
    Exists(String),
    #[error("{0}")]
    BadRequest(String),
    #[error(
        "{path} has more than {MAX_ENTRIES} entries within depth {depth}: list a smaller depth or a subdirectory"
    )]
    TooMany { path: String, depth: u32 },
    #[error("{path}: {source}")]
    Files {
        path: String,
        #[source]
        source: SafeFsError,
    },
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
}

type Result<T> = std::result::Result<T, ContentError>;

/// A path of the volume: what the client wrote (for messages) and the relative path
/// beneath the data directory (empty for `/`).
#[derive(Debug, Clone)]
pub struct VolPath {
    pub shown: String,
    pub rel: PathBuf,
}

impl VolPath {
    /// Parses a path of the API: absolute (a relative one is taken from `/`), `.` and
    /// empty components dropped, `..` refused.
    pub fn parse(p: &str) -> Result<Self> {
        if p.is_empty() || p.contains('\0') || p.len() > 4096 {
            return Err(ContentError::BadPath(p.to_string()));
        }
        let mut rel = PathBuf::new();
        for c in Path::new(p).components() {
            match c {
                Component::Normal(n) => rel.push(n),
                Component::RootDir | Component::CurDir => {}
                Component::ParentDir | Component::Prefix(_) => {
                    return Err(ContentError::BadPath(p.to_string()));
                }
            }
        }
        Ok(Self {
            shown: format!("/{}", rel.display()),
            rel,
        })
    }

    pub fn is_root(&self) -> bool {
        self.rel.as_os_str().is_empty()
    }

    fn child(&self, name: &std::ffi::OsStr) -> Self {
        let rel = self.rel.join(name);
        Self {
            shown: format!("/{}", rel.display()),
            rel,
        }
    }
}

/// The type of an entry, as the API names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum EntryType {
    Unknown,
    File,
    Directory,
    Symlink,
}

/// The `VolumeEntryStat` model.
#[derive(Debug, Clone, Serialize)]
pub struct Entry {
    pub name: String,
    #[serde(rename = "type")]
    pub kind: EntryType,
    pub path: String,
    pub size: u64,
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub atime: String,
    pub mtime: String,
    pub ctime: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub target: Option<String>,
}

fn kind_of(st: &FileStat) -> SFlag {
    SFlag::from_bits_truncate(st.st_mode & SFlag::S_IFMT.bits())
}

fn time(sec: i64, nsec: i64) -> String {
    let t = if sec >= 0 {
        SystemTime::UNIX_EPOCH + Duration::new(sec as u64, nsec.clamp(0, 999_999_999) as u32)
    } else {
        SystemTime::UNIX_EPOCH
    };
    crate::clock::time_rfc3339(t)
}

/// Maps a [`SafeFsError`] about `p` to what the client sees.
fn files(p: &VolPath) -> impl FnOnce(SafeFsError) -> ContentError + '_ {
    move |e| match e {
        e if e.is_not_found() => ContentError::NotFound(p.shown.clone()),
        SafeFsError::Symlink { component, .. } => ContentError::WrongType {
            path: format!("/{}", component.display()),
            what: "a symbolic link",
            hint: "the volume API does not follow links; use the path the link points to",
        },
        SafeFsError::NotDirectory { component, .. } => ContentError::WrongType {
            path: format!("/{}", component.display()),
            what: "not a directory",
            hint: "a path goes through directories only",
        },
        SafeFsError::BadPath { .. } => ContentError::BadPath(p.shown.clone()),
        other => ContentError::Files {
            path: p.shown.clone(),
            source: other,
        },
    }
}

/// The entry at `p` (not followed).
pub fn stat(data: &SafeDir, p: &VolPath) -> Result<Entry> {
    let st = if p.is_root() {
        nix::sys::stat::fstat(data).map_err(|e| ContentError::Io {
            context: "reading the status of /".into(),
            source: e.into(),
        })?
    } else {
        data.stat_nofollow(&p.rel)
            .map_err(files(p))?
            .ok_or_else(|| ContentError::NotFound(p.shown.clone()))?
    };
    let kind = match kind_of(&st) {
        SFlag::S_IFDIR => EntryType::Directory,
        SFlag::S_IFREG => EntryType::File,
        SFlag::S_IFLNK => EntryType::Symlink,
        _ => EntryType::Unknown,
    };
    let target = if kind == EntryType::Symlink {
        Some(
            data.read_link(&p.rel)
                .map_err(files(p))?
                .to_string_lossy()
                .into_owned(),
        )
    } else {
        None
    };
    Ok(Entry {
        name: p
            .rel
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "/".into()),
        kind,
        path: p.shown.clone(),
        size: st.st_size.max(0) as u64,
        mode: st.st_mode & 0o7777,
        uid: st.st_uid,
        gid: st.st_gid,
        atime: time(st.st_atime, st.st_atime_nsec),
        mtime: time(st.st_mtime, st.st_mtime_nsec),
        ctime: time(st.st_ctime, st.st_ctime_nsec),
        target,
    })
}

/// The directory `p`, which must be one.
fn open_dir(data: &SafeDir, p: &VolPath) -> Result<SafeDir> {
    match data.open_dir(&p.rel) {
        Ok(d) => Ok(d),
        Err(e) if !e.is_not_found() && !p.is_root() => {
            // Say what is there instead of a directory.
            let entry = stat(data, p)?;
            if entry.kind != EntryType::Directory {
                return Err(ContentError::WrongType {
                    path: p.shown.clone(),
                    what: match entry.kind {
                        EntryType::Symlink => "a symbolic link",
                        _ => "not a directory",
                    },
                    hint: "list or make entries in a directory",
                });
            }
            Err(files(p)(e))
        }
        Err(e) => Err(files(p)(e)),
    }
}

/// The entries beneath the directory `p`, `depth` levels deep (1: its own entries),
/// in name order, each directory's entries after it.
pub fn list(data: &SafeDir, p: &VolPath, depth: u32) -> Result<Vec<Entry>> {
    if depth == 0 || depth > MAX_DEPTH {
        return Err(ContentError::BadRequest(format!(
            "invalid depth {depth}: use 1 to {MAX_DEPTH}"
        )));
    }
    let dir = open_dir(data, p)?;
    let mut out = Vec::new();
    walk(data, &dir, p, depth, &mut out, depth)?;
    Ok(out)
}

fn walk(
    data: &SafeDir,
    dir: &SafeDir,
    p: &VolPath,
    left: u32,
    out: &mut Vec<Entry>,
    depth: u32,
) -> Result<()> {
    for name in dir.entries().map_err(files(p))? {
        let child = p.child(&name);
        let entry = match stat(data, &child) {
            Ok(e) => e,
            // Removed since the listing.
            Err(ContentError::NotFound(_)) => continue,
            Err(e) => return Err(e),
        };
        if out.len() == MAX_ENTRIES {
            return Err(ContentError::TooMany {
                path: p.shown.clone(),
                depth,
            });
        }
        let is_dir = entry.kind == EntryType::Directory;
        out.push(entry);
        if is_dir && left > 1 {
            match dir.open_dir(&name) {
                Ok(sub) => walk(data, &sub, &child, left - 1, out, depth)?,
                // Replaced by something else since: its entry says what it was.
                Err(_) => continue,
            }
        }
    }
    Ok(())
}

/// Checks an owner or mode the client gave.
pub fn check_meta(uid: Option<u32>, gid: Option<u32>, mode: Option<u32>) -> Result<()> {
    for (what, id) in [("uid", uid), ("gid", gid)] {
        if let Some(id) = id
            && id > MAX_ID
        {
            return Err(ContentError::BadRequest(format!(
                "invalid {what} {id}: volumes hold the ids sandboxes see, 0 to {MAX_ID}"
            )));
        }
    }
    if let Some(m) = mode
        && m > 0o7777
    {
        return Err(ContentError::BadRequest(format!(
            "invalid mode {m} ({m:o} octal): use permission bits only, at most 4095 (0o7777)"
        )));
    }
    Ok(())
}

/// Makes the directory `p` (mode `mode`, owner `uid:gid`); with `parents`, missing
/// parents too (same owner and mode) and an existing directory is fine.
pub fn make_dir(
    data: &SafeDir,
    p: &VolPath,
    uid: u32,
    gid: u32,
    mode: u32,
    parents: bool,
) -> Result<Entry> {
    if p.is_root() {
        return if parents {
            stat(data, p)
        } else {
            Err(ContentError::Exists(p.shown.clone()))
        };
    }
    let owned = data.open_dir("").map_err(files(p))?.with_owner(uid, gid);
    if let Some(existing) = data.stat_nofollow(&p.rel).map_err(files(p))? {
        if parents && kind_of(&existing) == SFlag::S_IFDIR {
            return stat(data, p);
        }
        return Err(ContentError::Exists(p.shown.clone()));
    }
    if !parents {
        let parent = p.rel.parent().unwrap_or(Path::new(""));
        owned.open_dir(parent).map_err(files(p))?;
    }
    owned.create_dir_all(&p.rel, mode).map_err(files(p))?;
    stat(data, p)
}

/// Changes the owner and mode of `p` itself (a link's own owner; a link has no mode).
pub fn set_meta(
    data: &SafeDir,
    p: &VolPath,
    uid: Option<u32>,
    gid: Option<u32>,
    mode: Option<u32>,
) -> Result<Entry> {
    let before = stat(data, p)?;
    if uid.is_some() || gid.is_some() {
        data.chown_nofollow(&p.rel, uid.unwrap_or(before.uid), gid.unwrap_or(before.gid))
            .map_err(files(p))?;
    }
    if let Some(m) = mode {
        data.chmod_nofollow(&p.rel, m).map_err(files(p))?;
    }
    stat(data, p)
}

/// Removes `p` (a directory with everything beneath it; a link itself).
pub fn remove(data: &SafeDir, p: &VolPath) -> Result<()> {
    if p.is_root() {
        return Err(ContentError::BadRequest(
            "the volume's root directory cannot be removed: remove its entries, or delete the volume".into(),
        ));
    }
    match data.remove_all(&p.rel).map_err(files(p))? {
        true => Ok(()),
        false => Err(ContentError::NotFound(p.shown.clone())),
    }
}

/// Opens the regular file `p` for reading; returns it and its size.
pub fn open_read(data: &SafeDir, p: &VolPath) -> Result<(File, u64)> {
    let entry = stat(data, p)?;
    if entry.kind != EntryType::File {
        return Err(ContentError::WrongType {
            path: p.shown.clone(),
            what: match entry.kind {
                EntryType::Directory => "a directory",
                EntryType::Symlink => "a symbolic link",
                _ => "not a regular file",
            },
            hint: "only regular files are read; links are not followed",
        });
    }
    // Opens only a regular file (checked again on the descriptor).
    let f = data.open_file(&p.rel).map_err(files(p))?;
    let size = f.metadata().map(|m| m.len()).unwrap_or(entry.size);
    Ok((f, size))
}

/// A file being written: a new file beside the target, renamed over it by
/// [`Upload::commit`] (a reader sees the old file or the whole new one).
#[derive(Debug)]
pub struct Upload {
    dir: SafeDir,
    tmp: OsString,
    name: OsString,
    path: VolPath,
}

/// Starts writing the file `p`: its directory must exist unless `parents` (then missing
/// directories are made, mode 0755, owner `uid:gid`); a directory at `p` is refused.
pub fn begin_write(
    data: &SafeDir,
    p: &VolPath,
    uid: u32,
    gid: u32,
    parents: bool,
) -> Result<(Upload, File)> {
    let (Some(parent), Some(name)) = (p.rel.parent(), p.rel.file_name()) else {
        return Err(ContentError::WrongType {
            path: p.shown.clone(),
            what: "the volume's root directory",
            hint: "write a file inside it",
        });
    };
    let owned = data.open_dir("").map_err(files(p))?.with_owner(uid, gid);
    let dir = if parents {
        owned.create_dir_all(parent, 0o755)
    } else {
        owned.open_dir(parent)
    }
    .map_err(files(p))?;
    if let Some(st) = dir.stat_nofollow(name).map_err(files(p))?
        && kind_of(&st) == SFlag::S_IFDIR
    {
        return Err(ContentError::WrongType {
            path: p.shown.clone(),
            what: "a directory",
            hint: "remove it first, or write to another path",
        });
    }
    let tmp = OsString::from(format!(".aenv-upload-{:016x}", rand::random::<u64>()));
    let file = dir.create_file(&tmp, 0o600).map_err(files(p))?;
    Ok((
        Upload {
            dir,
            tmp,
            name: name.to_os_string(),
            path: p.clone(),
        },
        file,
    ))
}

impl Upload {
    /// Gives the written file its owner and mode and puts it in place.
    pub fn commit(self, data: &SafeDir, uid: u32, gid: u32, mode: u32) -> Result<Entry> {
        let p = self.path.clone();
        let r = (|| {
            self.dir
                .chown_nofollow(&self.tmp, uid, gid)
                .map_err(files(&p))?;
            self.dir
                .chmod_nofollow(&self.tmp, mode)
                .map_err(files(&p))?;
            // A directory appeared at the path meanwhile: rename(2) refuses (EISDIR),
            // nothing is replaced.
            nix::fcntl::renameat(
                &self.dir,
                self.tmp.as_os_str(),
                &self.dir,
                self.name.as_os_str(),
            )
            .map_err(|e| ContentError::Io {
                context: format!("putting {} in place", p.shown),
                source: e.into(),
            })
        })();
        if let Err(e) = r {
            self.abort();
            return Err(e);
        }
        stat(data, &p)
    }

    /// Drops the partly written file.
    pub fn abort(&self) {
        let _ = self.dir.remove_non_dir(&self.tmp);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    fn vp(p: &str) -> VolPath {
        VolPath::parse(p).unwrap()
    }

    /// A volume's data directory and a host directory beside it that must not change.
    fn setup() -> (tempfile::TempDir, SafeDir, PathBuf) {
        let t = tempfile::tempdir().unwrap();
        let data = t.path().join("data");
        let host = t.path().join("host");
        std::fs::create_dir(&data).unwrap();
        std::fs::create_dir(&host).unwrap();
        std::fs::write(host.join("secret"), b"host secret").unwrap();
        let d = SafeDir::open(&data).unwrap();
        (t, d, host)
    }

    #[test]
    fn paths_are_the_volumes_own() {
        assert_eq!(vp("/a/b").rel, PathBuf::from("a/b"));
        assert_eq!(vp("a/./b/").rel, PathBuf::from("a/b"));
        assert_eq!(vp("/").shown, "/");
        assert!(vp("//").is_root());
        for bad in ["", "/a/../b", "..", "/a\0b"] {
            assert!(
                matches!(VolPath::parse(bad), Err(ContentError::BadPath(_))),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn write_list_stat_read_chmod_remove() {
        let (_t, d, _host) = setup();
        let (up, mut f) = begin_write(&d, &vp("/dir/a.txt"), 1000, 1000, true).unwrap();
        f.write_all(b"hello").unwrap();
        drop(f);
        let e = up.commit(&d, 1000, 1000, 0o640).unwrap();
        assert_eq!(
            (e.kind, e.size, e.mode, e.uid, e.gid),
            (EntryType::File, 5, 0o640, 1000, 1000)
        );
        assert_eq!((e.name.as_str(), e.path.as_str()), ("a.txt", "/dir/a.txt"));
        // Overwrite, no temporary file left.
        let (up, mut f) = begin_write(&d, &vp("/dir/a.txt"), 0, 0, false).unwrap();
        f.write_all(b"bye").unwrap();
        up.commit(&d, 0, 0, 0o644).unwrap();
        let (mut f, size) = open_read(&d, &vp("/dir/a.txt")).unwrap();
        let mut s = String::new();
        f.read_to_string(&mut s).unwrap();
        assert_eq!((s.as_str(), size), ("bye", 3));
        make_dir(&d, &vp("/dir/sub/deep"), 5, 6, 0o700, true).unwrap();
        let all = list(&d, &vp("/"), 3).unwrap();
        let paths: Vec<&str> = all.iter().map(|e| e.path.as_str()).collect();
        assert_eq!(
            paths,
            ["/dir", "/dir/a.txt", "/dir/sub", "/dir/sub/deep"],
            "each directory's entries after it"
        );
        assert_eq!(list(&d, &vp("/"), 1).unwrap().len(), 1);
        let e = set_meta(&d, &vp("/dir/a.txt"), Some(7), None, Some(0o600)).unwrap();
        assert_eq!((e.uid, e.gid, e.mode), (7, 0, 0o600));
        // Errors say what is wrong.
        assert!(matches!(
            make_dir(&d, &vp("/dir"), 0, 0, 0o755, false),
            Err(ContentError::Exists(_))
        ));
        assert!(make_dir(&d, &vp("/dir"), 0, 0, 0o755, true).is_ok());
        assert!(matches!(
            make_dir(&d, &vp("/none/x"), 0, 0, 0o755, false),
            Err(ContentError::NotFound(_))
        ));
        assert!(matches!(
            begin_write(&d, &vp("/none/x"), 0, 0, false),
            Err(ContentError::NotFound(_))
        ));
        assert!(matches!(
            begin_write(&d, &vp("/dir"), 0, 0, false),
            Err(ContentError::WrongType { .. })
        ));
        assert!(matches!(
            open_read(&d, &vp("/dir")),
            Err(ContentError::WrongType { .. })
        ));
        assert!(matches!(
            list(&d, &vp("/dir/a.txt"), 1),
            Err(ContentError::WrongType { .. })
        ));
        assert!(matches!(
            list(&d, &vp("/"), 0),
            Err(ContentError::BadRequest(_))
        ));
        assert!(check_meta(Some(65_536), None, None).is_err());
        assert!(check_meta(None, None, Some(0o10000)).is_err());
        assert!(check_meta(Some(65_535), Some(0), Some(0o4755)).is_ok());
        remove(&d, &vp("/dir")).unwrap();
        assert!(matches!(
            stat(&d, &vp("/dir")),
            Err(ContentError::NotFound(_))
        ));
        assert!(matches!(
            remove(&d, &vp("/dir")),
            Err(ContentError::NotFound(_))
        ));
        assert!(matches!(
            remove(&d, &vp("/")),
            Err(ContentError::BadRequest(_))
        ));
        assert!(d.entries().unwrap().is_empty(), "nothing left behind");
    }

    #[test]
    fn a_tenants_links_are_reported_never_followed() {
        let (t, d, host) = setup();
        let data = t.path().join("data");
        let before = {
            use std::os::unix::fs::MetadataExt;
            let m = std::fs::metadata(host.join("secret")).unwrap();
            (m.uid(), m.mode() & 0o777)
        };
        std::os::unix::fs::symlink(&host, data.join("to-host")).unwrap();
        std::os::unix::fs::symlink(host.join("secret"), data.join("secret-link")).unwrap();
        let e = stat(&d, &vp("/to-host")).unwrap();
        assert_eq!(e.kind, EntryType::Symlink);
        assert_eq!(e.target.as_deref(), Some(host.to_str().unwrap()));
        for r in [
            open_read(&d, &vp("/secret-link")).map(drop),
            open_read(&d, &vp("/to-host/secret")).map(drop),
            list(&d, &vp("/to-host"), 1).map(drop),
            begin_write(&d, &vp("/to-host/new"), 0, 0, true).map(drop),
            make_dir(&d, &vp("/to-host/dir"), 0, 0, 0o755, true).map(drop),
            set_meta(&d, &vp("/to-host/secret"), Some(5), None, None).map(drop),
            remove(&d, &vp("/to-host/secret")),
        ] {
            let e = r.unwrap_err();
            assert!(
                matches!(
                    e,
                    ContentError::WrongType {
                        what: "a symbolic link",
                        ..
                    }
                ),
                "{e}"
            );
        }
        // Changing or removing the link acts on the link.
        set_meta(&d, &vp("/secret-link"), Some(9), Some(9), Some(0o777)).unwrap();
        let (up, mut f) = begin_write(&d, &vp("/secret-link"), 0, 0, false).unwrap();
        f.write_all(b"replaced").unwrap();
        up.commit(&d, 0, 0, 0o644).unwrap();
        assert_eq!(stat(&d, &vp("/secret-link")).unwrap().kind, EntryType::File);
        remove(&d, &vp("/to-host")).unwrap();
        // A FIFO is reported, never opened.
        nix::unistd::mkfifo(
            &data.join("fifo"),
            nix::sys::stat::Mode::from_bits_truncate(0o644),
        )
        .unwrap();
        assert_eq!(stat(&d, &vp("/fifo")).unwrap().kind, EntryType::Unknown);
        assert!(open_read(&d, &vp("/fifo")).is_err());
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::metadata(host.join("secret")).unwrap();
        assert_eq!(std::fs::read(host.join("secret")).unwrap(), b"host secret");
        assert_eq!((m.uid(), m.mode() & 0o777), before);
        assert_eq!(std::fs::read_dir(&host).unwrap().count(), 1);
    }
}
