//! The files of one Dockerfile `COPY`/`ADD` source, as `aenv build` uploads them: every
//! path the source matches in the build context (directories recursively, symlinks kept
//! as links) in a tar.gz archive whose entry names are relative to the context,
//! and the `filesHash` the server keys the upload by.
//!
//! A source is a relative path (`*` and `?` allowed in a segment) inside the context:
//! an absolute path, a `..` that leaves the context, or a path through a symlink is
//! refused before anything is read or sent.
//!
//! The hash is the SHA-256 of `COPY <src> <dest>` and, entry by entry in archive order,
//! the entry's name, type, mode, size, link target and content (not its mtime or owner):
//! the same files give the same hash, whatever their timestamps.

use std::io::{Read, Write};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// Errors of archiving a `COPY` source.
#[derive(Debug, thiserror::Error)]
pub enum ArchiveError {
    #[error(
        "COPY source {src:?} is an absolute path: give a path relative to the build context {}",
        ctx.display()
    )]
    Absolute { src: String, ctx: PathBuf },
    #[error("COPY source {src:?} leaves the build context {}", ctx.display())]
    Escapes { src: String, ctx: PathBuf },
    #[error(
        "COPY source {src:?} goes through the symlink {link:?}: name the path it points to instead"
    )]
    ThroughSymlink { src: String, link: String },
    #[error("COPY source {src:?} matches nothing in the build context {}", ctx.display())]
    NoMatch { src: String, ctx: PathBuf },
    #[error("{}: only files, directories and symlinks can be copied", path.display())]
    Special { path: PathBuf },
    #[error("{}: the file changed while it was archived", path.display())]
    Changed { path: PathBuf },
    #[error("{what} {}: {source}", path.display())]
    Io {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
}

fn io<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> ArchiveError + 'a {
    move |source| ArchiveError::Io {
        what,
        path: path.to_path_buf(),
        source,
    }
}

/// A packed `COPY` source.
#[derive(Debug)]
pub struct Packed {
    /// The source as the server is told it (normalized, relative to the context).
    pub src: String,
    /// `filesHash`: lowercase hex SHA-256.
    pub hash: String,
    /// The archive (removed when dropped).
    pub file: tempfile::NamedTempFile,
    /// Its size in bytes.
    pub len: u64,
    /// How many entries it holds.
    pub entries: usize,
}

/// The source normalized: no `.`, empty or trailing segments, `..` resolved
/// lexically; `"."` for the context itself.
pub fn normalize(ctx: &Path, src: &str) -> Result<String, ArchiveError> {
    if src.starts_with('/') {
        return Err(ArchiveError::Absolute {
            src: src.into(),
            ctx: ctx.into(),
        });
    }
    let mut parts: Vec<&str> = Vec::new();
    for seg in src.split('/') {
        match seg {
            "" | "." => {}
            ".." => {
                if parts.pop().is_none() {
                    return Err(ArchiveError::Escapes {
                        src: src.into(),
                        ctx: ctx.into(),
                    });
                }
            }
            s => parts.push(s),
        }
    }
    Ok(if parts.is_empty() {
        ".".into()
    } else {
        parts.join("/")
    })
}

/// Whether `name` matches the shell pattern `pat` (`*`, `?`; a leading `.` must be
/// matched literally, as the shell does).
fn glob_match(pat: &[u8], name: &[u8]) -> bool {
    if name.first() == Some(&b'.') && pat.first() != Some(&b'.') {
        return false;
    }
    fn m(p: &[u8], n: &[u8]) -> bool {
        match (p.first(), n.first()) {
            (None, None) => true,
            (Some(b'*'), _) => m(&p[1..], n) || (!n.is_empty() && m(p, &n[1..])),
            (Some(b'?'), Some(_)) => m(&p[1..], &n[1..]),
            (Some(a), Some(b)) if a == b => m(&p[1..], &n[1..]),
            _ => false,
        }
    }
    m(pat, name)
}

fn is_glob(seg: &str) -> bool {
    seg.contains(['*', '?'])
}

/// The paths (relative to `ctx`) a normalized source matches, sorted.
fn matches(ctx: &Path, src: &str) -> Result<Vec<PathBuf>, ArchiveError> {
    if src == "." {
        return Ok(vec![PathBuf::new()]);
    }
    let segs: Vec<&str> = src.split('/').collect();
    let mut cur = vec![PathBuf::new()];
    for (i, seg) in segs.iter().enumerate() {
        let last = i + 1 == segs.len();
        let mut next = Vec::new();
        for base in &cur {
            let names: Vec<String> = if is_glob(seg) {
                let dir = ctx.join(base);
                let mut v = Vec::new();
                for e in std::fs::read_dir(&dir).map_err(io("reading", &dir))? {
                    let e = e.map_err(io("reading", &dir))?;
                    let n = e.file_name().to_string_lossy().into_owned();
                    if glob_match(seg.as_bytes(), n.as_bytes()) {
                        v.push(n);
                    }
                }
                v.sort();
                v
            } else {
                vec![seg.to_string()]
            };
            for n in names {
                let rel = base.join(&n);
                let md = match std::fs::symlink_metadata(ctx.join(&rel)) {
                    Ok(md) => md,
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                    Err(e) => return Err(io("reading", &ctx.join(&rel))(e)),
                };
                if !last && md.file_type().is_symlink() {
                    return Err(ArchiveError::ThroughSymlink {
                        src: src.into(),
                        link: rel.display().to_string(),
                    });
                }
                if last || md.is_dir() {
                    next.push(rel);
                }
            }
        }
        cur = next;
    }
    if cur.is_empty() {
        return Err(ArchiveError::NoMatch {
            src: src.into(),
            ctx: ctx.into(),
        });
    }
    Ok(cur)
}

/// One archive entry.
#[derive(Debug, PartialEq, Eq)]
enum Kind {
    Dir,
    File(u64),
    Link(PathBuf),
}

/// Every entry under the matched paths, depth first in name order (no entry for the
/// context itself).
fn walk(ctx: &Path, roots: &[PathBuf]) -> Result<Vec<(PathBuf, Kind, u32, u64)>, ArchiveError> {
    let mut out = Vec::new();
    let mut seen = std::collections::BTreeSet::new();
    let mut stack: Vec<PathBuf> = roots.iter().rev().cloned().collect();
    while let Some(rel) = stack.pop() {
        let abs = ctx.join(&rel);
        let md = std::fs::symlink_metadata(&abs).map_err(io("reading", &abs))?;
        let ft = md.file_type();
        let kind = if ft.is_symlink() {
            Kind::Link(std::fs::read_link(&abs).map_err(io("reading", &abs))?)
        } else if ft.is_dir() {
            let mut names: Vec<_> = std::fs::read_dir(&abs)
                .map_err(io("reading", &abs))?
                .map(|e| e.map(|e| e.file_name()))
                .collect::<Result<_, _>>()
                .map_err(io("reading", &abs))?;
            names.sort();
            for n in names.into_iter().rev() {
                stack.push(rel.join(n));
            }
            Kind::Dir
        } else if ft.is_file() {
            Kind::File(md.len())
        } else {
            return Err(ArchiveError::Special { path: abs });
        };
        if rel.as_os_str().is_empty() || !seen.insert(rel.clone()) {
            continue;
        }
        let mtime = u64::try_from(md.mtime()).unwrap_or(0);
        out.push((rel, kind, md.permissions().mode() & 0o7777, mtime));
    }
    Ok(out)
}

use sha2::{Digest, Sha256};

/// Packs what `src` matches under `ctx` for `COPY src dest` (blocking file I/O).
pub fn pack(ctx: &Path, src: &str, dest: &str) -> Result<Packed, ArchiveError> {
    let src = normalize(ctx, src)?;
    let roots = matches(ctx, &src)?;
    let entries = walk(ctx, &roots)?;
    let tmp = tempfile::NamedTempFile::new()
        .map_err(io("creating a temporary file in", &std::env::temp_dir()))?;
    let tmp_path = tmp.path().to_path_buf();
    let mut h = Sha256::new();
    h.update(format!("COPY {src} {dest}").as_bytes());
    let file = tmp.reopen().map_err(io("opening", &tmp_path))?;
    let gz = flate2::write::GzEncoder::new(
        std::io::BufWriter::with_capacity(1 << 20, file),
        flate2::Compression::fast(),
    );
    let mut tar = tar::Builder::new(gz);
    let header = |kind: tar::EntryType, mode: u32, size: u64, mtime: u64| {
        let mut hd = tar::Header::new_gnu();
        hd.set_entry_type(kind);
        hd.set_mode(mode);
        hd.set_size(size);
        hd.set_mtime(mtime);
        hd.set_uid(0);
        hd.set_gid(0);
        hd
    };
    for (rel, kind, mode, mtime) in &entries {
        let name = rel.to_string_lossy();
        h.update(name.as_bytes());
        h.update([0]);
        let abs = ctx.join(rel);
        match kind {
            Kind::Dir => {
                h.update(format!("d{mode}\0").as_bytes());
                let mut hd = header(tar::EntryType::Directory, *mode, 0, *mtime);
                tar.append_data(&mut hd, format!("{name}/"), std::io::empty())
                    .map_err(io("writing", &tmp_path))?;
            }
            Kind::Link(target) => {
                h.update(format!("l{}\0", target.to_string_lossy()).as_bytes());
                let mut hd = header(tar::EntryType::Symlink, 0o777, 0, *mtime);
                tar.append_link(&mut hd, &*name, target)
                    .map_err(io("writing", &tmp_path))?;
            }
            Kind::File(size) => {
                h.update(format!("f{mode}\0{size}\0").as_bytes());
                let mut hd = header(tar::EntryType::Regular, *mode, *size, *mtime);
                let f = std::fs::File::open(&abs).map_err(io("reading", &abs))?;
                // The content feeds the hash as the archive takes it.
                let mut counted = TeeRead {
                    r: f.take(*size),
                    h: &mut h,
                    n: 0,
                };
                tar.append_data(&mut hd, &*name, &mut counted)
                    .map_err(io("reading", &abs))?;
                if counted.n != *size {
                    return Err(ArchiveError::Changed { path: abs });
                }
            }
        }
    }
    let gz = tar.into_inner().map_err(io("writing", &tmp_path))?;
    let mut out = gz.finish().map_err(io("writing", &tmp_path))?;
    out.flush().map_err(io("writing", &tmp_path))?;
    drop(out);
    let len = std::fs::metadata(&tmp_path)
        .map_err(io("reading", &tmp_path))?
        .len();
    Ok(Packed {
        src,
        hash: hex::encode(h.finalize()),
        file: tmp,
        len,
        entries: entries.len(),
    })
}

/// A reader that feeds a hash and counts what it read.
struct TeeRead<'a, R: Read> {
    r: R,
    h: &'a mut Sha256,
    n: u64,
}

impl<R: Read> Read for TeeRead<'_, R> {
    fn read(&mut self, b: &mut [u8]) -> std::io::Result<usize> {
        let n = self.r.read(b)?;
        self.h.update(&b[..n]);
        self.n += n as u64;
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;

    fn ctx() -> tempfile::TempDir {
        let d = tempfile::tempdir().unwrap();
        let p = d.path();
        std::fs::create_dir_all(p.join("app/sub")).unwrap();
        std::fs::write(p.join("app/a.txt"), "a\n").unwrap();
        std::fs::write(p.join("app/sub/b.txt"), "b\n").unwrap();
        std::fs::write(p.join("app/.hidden"), "h").unwrap();
        std::os::unix::fs::symlink("a.txt", p.join("app/link.txt")).unwrap();
        std::fs::write(p.join("one.txt"), "1").unwrap();
        std::fs::write(p.join("two.txt"), "2").unwrap();
        d
    }

    /// `tar -tvzf` of the archive (GNU tar reads what we write).
    fn listing(p: &Packed) -> Vec<String> {
        let o = Command::new("tar")
            .arg("-tzf")
            .arg(p.file.path())
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8_lossy(&o.stdout)
            .lines()
            .map(str::to_string)
            .collect()
    }

    #[test]
    fn template_copy_archives_a_directory_recursively_with_symlinks_kept() {
        let d = ctx();
        let p = pack(d.path(), "./app/", "/opt/app").unwrap();
        assert_eq!(p.src, "app");
        assert_eq!(
            listing(&p),
            [
                "app/",
                "app/.hidden",
                "app/a.txt",
                "app/link.txt",
                "app/sub/",
                "app/sub/b.txt"
            ]
        );
        let out = tempfile::tempdir().unwrap();
        let st = Command::new("tar")
            .arg("-xzf")
            .arg(p.file.path())
            .arg("-C")
            .arg(out.path())
            .status()
            .unwrap();
        assert!(st.success());
        assert_eq!(
            std::fs::read_link(out.path().join("app/link.txt")).unwrap(),
            Path::new("a.txt")
        );
        assert_eq!(
            std::fs::read_to_string(out.path().join("app/sub/b.txt")).unwrap(),
            "b\n"
        );
        // gzip itself agrees with the stream's CRC and length.
        let st = Command::new("gzip")
            .arg("-t")
            .arg(p.file.path())
            .status()
            .unwrap();
        assert!(st.success());
    }

    #[test]
    fn template_copy_hash_depends_on_content_and_step_not_on_mtime() {
        let d = ctx();
        let a = pack(d.path(), "app", "/x").unwrap();
        assert_eq!(a.hash.len(), 64);
        let f = std::fs::File::options()
            .write(true)
            .open(d.path().join("app/a.txt"))
            .unwrap();
        f.set_modified(std::time::SystemTime::UNIX_EPOCH).unwrap();
        assert_eq!(pack(d.path(), "app", "/x").unwrap().hash, a.hash);
        assert_ne!(pack(d.path(), "app", "/y").unwrap().hash, a.hash);
        std::fs::write(d.path().join("app/a.txt"), "changed\n").unwrap();
        assert_ne!(pack(d.path(), "app", "/x").unwrap().hash, a.hash);
    }

    #[test]
    fn template_copy_of_globs_and_the_whole_context() {
        let d = ctx();
        let p = pack(d.path(), "*.txt", "/t/").unwrap();
        assert_eq!(listing(&p), ["one.txt", "two.txt"]);
        let p = pack(d.path(), "app/?.txt", "/t/").unwrap();
        assert_eq!(listing(&p), ["app/a.txt"]);
        let p = pack(d.path(), ".", "/t").unwrap();
        assert_eq!(p.src, ".");
        assert_eq!(listing(&p)[0], "app/");
        assert_eq!(p.entries, 8);
    }

    #[test]
    fn template_copy_long_names_use_pax_headers() {
        let d = tempfile::tempdir().unwrap();
        let long = "x".repeat(120);
        let deep = format!("{}/{}", "d".repeat(60), "e".repeat(90));
        std::fs::create_dir_all(d.path().join("t").join(&deep)).unwrap();
        std::fs::write(d.path().join("t").join(&long), "l").unwrap();
        std::os::unix::fs::symlink("y".repeat(150), d.path().join("t/l")).unwrap();
        let p = pack(d.path(), "t", "/t").unwrap();
        let names = listing(&p);
        assert!(names.contains(&format!("t/{long}")), "{names:?}");
        assert!(names.contains(&format!("t/{deep}/")), "{names:?}");
        let out = tempfile::tempdir().unwrap();
        assert!(
            Command::new("tar")
                .arg("-xzf")
                .arg(p.file.path())
                .arg("-C")
                .arg(out.path())
                .status()
                .unwrap()
                .success()
        );
        assert_eq!(
            std::fs::read_link(out.path().join("t/l")).unwrap(),
            Path::new(&"y".repeat(150))
        );
    }

    #[test]
    fn template_copy_refuses_escapes_from_the_context() {
        let d = ctx();
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("secret"), "s").unwrap();
        std::os::unix::fs::symlink(outside.path(), d.path().join("out")).unwrap();
        let e = pack(d.path(), "/etc/passwd", "/x").unwrap_err();
        assert!(matches!(e, ArchiveError::Absolute { .. }), "{e}");
        assert!(e.to_string().contains("absolute"), "{e}");
        let e = pack(d.path(), "../x", "/x").unwrap_err();
        assert!(matches!(e, ArchiveError::Escapes { .. }), "{e}");
        let e = pack(d.path(), "app/../../x", "/x").unwrap_err();
        assert!(e.to_string().contains("leaves the build context"), "{e}");
        let e = pack(d.path(), "out/secret", "/x").unwrap_err();
        assert!(matches!(e, ArchiveError::ThroughSymlink { .. }), "{e}");
        let e = pack(d.path(), "nope*", "/x").unwrap_err();
        assert!(matches!(e, ArchiveError::NoMatch { .. }), "{e}");
        // `a/../b` stays inside and is sent normalized.
        assert_eq!(
            pack(d.path(), "app/../one.txt", "/x").unwrap().src,
            "one.txt"
        );
        // A link itself is copied as a link, never followed.
        let p = pack(d.path(), "out", "/x").unwrap();
        assert_eq!(listing(&p), ["out"]);
    }
}
