//! What the filesystem calls report and share: [`EntryInfo`] of a path
//! (type, Go-style mode text, owner names, `user.e2b.*` metadata), the
//! errors of the service, and directories created for a user.

use std::collections::HashMap;
use std::io;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;

use crate::connect::{Code, ConnectError};
use crate::paths::clean;
use crate::proto::filesystem::{EntryInfo, FileType};
use crate::users::{IdNames, User};
use crate::wkt::Timestamp;

/// Prefix of the extended attributes that carry user metadata.
const METADATA_XATTR_PREFIX: &str = "user.e2b.";

/// Errors of the filesystem module.
#[derive(Debug, thiserror::Error)]
pub enum FsError {
    #[error("{path}: {source}")]
    Io { path: String, source: io::Error },
    #[error("{0} is not a directory")]
    NotADirectory(String),
    #[error("{0} already exists")]
    Exists(String),
    #[error("setting up the watch on {path}: {source}")]
    Watch { path: String, source: io::Error },
}

impl From<FsError> for ConnectError {
    fn from(e: FsError) -> Self {
        match &e {
            FsError::Io { source, .. } | FsError::Watch { source, .. } => {
                let mut c = ConnectError::from_io(source, "");
                c.message = e.to_string();
                c
            }
            FsError::NotADirectory(_) => ConnectError::invalid_argument(e.to_string()),
            FsError::Exists(_) => ConnectError::new(Code::AlreadyExists, e.to_string()),
        }
    }
}

pub(crate) fn io_err(path: &Path) -> impl FnOnce(io::Error) -> FsError + '_ {
    move |source| FsError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// Go-style mode text (`drwxr-xr-x`, `Lrwxrwxrwx`, `dtrwxrwxrwx`).
pub fn mode_string(mode: u32) -> String {
    let fmt = mode & libc::S_IFMT;
    let mut s = String::new();
    match fmt {
        libc::S_IFDIR => s.push('d'),
        libc::S_IFLNK => s.push('L'),
        libc::S_IFBLK => s.push('D'),
        libc::S_IFIFO => s.push('p'),
        libc::S_IFSOCK => s.push('S'),
        libc::S_IFCHR => s.push_str("Dc"),
        _ => {}
    }
    if mode & libc::S_ISUID != 0 {
        s.push('u');
    }
    if mode & libc::S_ISGID != 0 {
        s.push('g');
    }
    if mode & libc::S_ISVTX != 0 {
        s.push('t');
    }
    if s.is_empty() {
        s.push('-');
    }
    let rwx = b"rwxrwxrwx";
    for (i, c) in rwx.iter().enumerate() {
        if mode & (1 << (8 - i)) != 0 {
            s.push(*c as char);
        } else {
            s.push('-');
        }
    }
    s
}

fn file_type_of(md: &std::fs::Metadata) -> FileType {
    let ft = md.file_type();
    if ft.is_dir() {
        FileType::Directory
    } else if ft.is_symlink() {
        FileType::Symlink
    } else {
        FileType::File
    }
}

/// Reads `user.e2b.*` extended attributes of `path` (not following links).
fn read_metadata(path: &Path) -> HashMap<String, String> {
    use std::os::unix::ffi::OsStrExt;
    let mut out = HashMap::new();
    let Ok(cpath) = std::ffi::CString::new(path.as_os_str().as_bytes()) else {
        return out;
    };
    let mut names = vec![0u8; 4096];
    // SAFETY: `names` is valid for writes of `names.len()` bytes and `cpath`
    // is NUL-terminated.
    let n = unsafe { libc::llistxattr(cpath.as_ptr(), names.as_mut_ptr().cast(), names.len()) };
    if n <= 0 {
        return out;
    }
    for name in names[..n as usize].split(|b| *b == 0) {
        let Ok(name_s) = std::str::from_utf8(name) else {
            continue;
        };
        let Some(key) = name_s.strip_prefix(METADATA_XATTR_PREFIX) else {
            continue;
        };
        let Ok(cname) = std::ffi::CString::new(name) else {
            continue;
        };
        let mut val = vec![0u8; 4096];
        // SAFETY: `val` is valid for `val.len()` bytes; both names are
        // NUL-terminated.
        let m = unsafe {
            libc::lgetxattr(
                cpath.as_ptr(),
                cname.as_ptr(),
                val.as_mut_ptr().cast(),
                val.len(),
            )
        };
        if m >= 0 {
            out.insert(
                key.to_string(),
                String::from_utf8_lossy(&val[..m as usize]).into_owned(),
            );
        }
    }
    out
}

/// Builds the `EntryInfo` of `path`.
pub fn entry_info(path: &Path, names: &IdNames) -> Result<EntryInfo, FsError> {
    let lmd = std::fs::symlink_metadata(path).map_err(io_err(path))?;
    let is_symlink = lmd.file_type().is_symlink();
    let (ty, symlink_target) = if is_symlink {
        let target = std::fs::read_link(path).ok().map(|t| {
            let abs = if t.is_absolute() {
                t
            } else {
                path.parent().unwrap_or(Path::new("/")).join(t)
            };
            clean(&abs).display().to_string()
        });
        let ty = match std::fs::metadata(path) {
            Ok(md) => file_type_of(&md),
            Err(_) => FileType::Symlink,
        };
        (ty, target)
    } else {
        (file_type_of(&lmd), None)
    };
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "/".into());
    Ok(EntryInfo {
        name,
        r#type: ty as i32,
        path: path.display().to_string(),
        size: lmd.size() as i64,
        mode: lmd.permissions().mode() & 0o777,
        permissions: mode_string(lmd.mode()),
        owner: names.user(lmd.uid()),
        group: names.group(lmd.gid()),
        modified_time: Some(Timestamp {
            seconds: lmd.mtime(),
            nanos: lmd.mtime_nsec() as i32,
        }),
        symlink_target,
        metadata: read_metadata(path),
        is_symlink,
    })
}

/// Changes the owner of `path` to the user (when the agent is root).
pub fn chown_to(path: &Path, user: &User) {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0
        && let Err(e) = std::os::unix::fs::lchown(path, Some(user.uid), Some(user.gid))
    {
        tracing::debug!(path = %path.display(), error = %e, "chown");
    }
}

/// Creates `dir` and missing parents, giving new ones to `user`.
pub fn make_dirs(dir: &Path, user: &User) -> io::Result<()> {
    let mut missing = Vec::new();
    let mut cur = Some(dir);
    while let Some(p) = cur {
        if p.exists() {
            break;
        }
        missing.push(p.to_path_buf());
        cur = p.parent();
    }
    std::fs::create_dir_all(dir)?;
    for p in missing.iter().rev() {
        chown_to(p, user);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mode_strings_follow_go() {
        assert_eq!(mode_string(libc::S_IFDIR | 0o755), "drwxr-xr-x");
        assert_eq!(mode_string(libc::S_IFREG | 0o644), "-rw-r--r--");
        assert_eq!(mode_string(libc::S_IFLNK | 0o777), "Lrwxrwxrwx");
        assert_eq!(
            mode_string(libc::S_IFDIR | libc::S_ISVTX | 0o777),
            "dtrwxrwxrwx"
        );
    }
}
