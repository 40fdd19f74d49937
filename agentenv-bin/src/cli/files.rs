//! `aenv upload` and `aenv download`: files and directory trees, streamed through the
//! sandbox's agent (`/files`, `Filesystem/Stat|ListDir|MakeDir`), with progress bars.

use std::path::{Path, PathBuf};

use agentenv_guest::client::{ClientError, GuestClient};
use agentenv_guest::connect::Code;
use agentenv_guest::proto::filesystem as fsp;

use super::output::transfer_bar;

/// Errors of file transfers.
#[derive(Debug, thiserror::Error)]
pub enum FilesError {
    #[error("{}: {source}", path.display())]
    Local {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{} is a symlink; upload the file it points to instead", .0.display())]
    Symlink(PathBuf),
    #[error("{} is not a regular file or directory", .0.display())]
    Special(PathBuf),
    #[error("remote path does not exist: {0}")]
    RemoteMissing(String),
    #[error("remote path {0:?} must be absolute and must not contain `..` for directory transfers")]
    RemotePath(String),
    #[error("remote {0} is a symlink or special file; it is skipped only when named explicitly")]
    RemoteSpecial(String),
    #[error("local download destination already exists: {}; use --force to replace it", .0.display())]
    Exists(PathBuf),
    #[error("the parent directory of {} does not exist", .0.display())]
    NoParent(PathBuf),
    #[error("sandbox {id}: {source}")]
    Agent { id: String, source: ClientError },
    #[error(
        "the sandbox listed an entry named {0:?} in {1}, which would be written outside the destination; nothing was downloaded"
    )]
    UnsafeEntry(String, String),
}

/// Whether a directory entry's name, as a sandbox reports it, stays inside the
/// directory it is joined to: one path component, not `.` or `..`, no NUL. The
/// sandbox is not trusted: its agent can send any name.
fn safe_entry_name(name: &str) -> bool {
    !name.is_empty() && name != "." && name != ".." && !name.contains(['/', '\0'])
}

fn local(path: &Path) -> impl FnOnce(std::io::Error) -> FilesError + '_ {
    move |source| FilesError::Local {
        path: path.to_path_buf(),
        source,
    }
}

fn basename(p: &str) -> String {
    p.trim_end_matches('/')
        .rsplit('/')
        .next()
        .unwrap_or("")
        .to_string()
}

fn join_remote(dir: &str, name: &str) -> String {
    format!("{}/{}", dir.trim_end_matches('/'), name)
}

fn check_remote_dir_path(p: &str) -> Result<(), FilesError> {
    if !p.starts_with('/') || p.split('/').any(|c| c == "..") {
        return Err(FilesError::RemotePath(p.to_string()));
    }
    Ok(())
}

/// Uploads `local_path` (file or directory) to `remote`; returns the summary line.
pub async fn upload(
    agent: &GuestClient,
    id: &str,
    local_path: &Path,
    remote: &str,
) -> Result<String, FilesError> {
    let aerr = |source| FilesError::Agent {
        id: id.to_string(),
        source,
    };
    let meta = std::fs::symlink_metadata(local_path).map_err(local(local_path))?;
    let name = local_path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    if meta.file_type().is_symlink() {
        return Err(FilesError::Symlink(local_path.to_path_buf()));
    }
    if meta.is_file() {
        let dest = if remote.ends_with('/') {
            join_remote(remote, &name)
        } else {
            match agent.stat(remote).await {
                Ok(e) if e.r#type == fsp::FileType::Directory as i32 => join_remote(remote, &name),
                _ => remote.to_string(),
            }
        };
        let bar = transfer_bar("Uploading", meta.len());
        upload_one(agent, local_path, &dest, &bar)
            .await
            .map_err(aerr)?;
        bar.finish_and_clear();
        return Ok(format!("Uploaded {} to {id}:{dest}", local_path.display()));
    }
    if !meta.is_dir() {
        return Err(FilesError::Special(local_path.to_path_buf()));
    }
    check_remote_dir_path(remote)?;
    let root = match agent.stat(remote).await {
        Ok(e) if e.r#type == fsp::FileType::Directory as i32 => join_remote(remote, &name),
        Ok(_) => remote.to_string(),
        Err(e) if e.code() == Some(Code::NotFound) => {
            if remote.ends_with('/') {
                join_remote(remote, &name)
            } else {
                remote.to_string()
            }
        }
        Err(e) => return Err(aerr(e)),
    };
    // Walk first: every problem is reported before anything is sent.
    let mut dirs = vec![String::new()];
    let mut files: Vec<(PathBuf, String, u64)> = Vec::new();
    walk_local(local_path, "", &mut dirs, &mut files)?;
    let total: u64 = files.iter().map(|f| f.2).sum();
    for d in &dirs {
        let p = if d.is_empty() {
            root.clone()
        } else {
            join_remote(&root, d)
        };
        agent.make_dir(&p).await.or_else(|e| {
            if e.code() == Some(Code::AlreadyExists) {
                Ok(())
            } else {
                Err(aerr(e))
            }
        })?;
    }
    let bar = transfer_bar("Uploading", total);
    for (lp, rel, _) in &files {
        upload_one(agent, lp, &join_remote(&root, rel), &bar)
            .await
            .map_err(aerr)?;
    }
    bar.finish_and_clear();
    Ok(format!(
        "Uploaded directory {} to {id}:{root}",
        local_path.display()
    ))
}

fn walk_local(
    dir: &Path,
    rel: &str,
    dirs: &mut Vec<String>,
    files: &mut Vec<(PathBuf, String, u64)>,
) -> Result<(), FilesError> {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .map_err(local(dir))?
        .collect::<Result<_, _>>()
        .map_err(local(dir))?;
    entries.sort_by_key(|e| e.file_name());
    for e in entries {
        let p = e.path();
        let name = e.file_name().to_string_lossy().into_owned();
        let r = if rel.is_empty() {
            name
        } else {
            format!("{rel}/{name}")
        };
        let m = std::fs::symlink_metadata(&p).map_err(local(&p))?;
        if m.file_type().is_symlink() {
            return Err(FilesError::Symlink(p));
        } else if m.is_dir() {
            dirs.push(r.clone());
            walk_local(&p, &r, dirs, files)?;
        } else if m.is_file() {
            files.push((p, r, m.len()));
        } else {
            return Err(FilesError::Special(p));
        }
    }
    Ok(())
}

async fn upload_one(
    agent: &GuestClient,
    local_path: &Path,
    remote: &str,
    bar: &indicatif::ProgressBar,
) -> Result<(), ClientError> {
    let bar = bar.clone();
    agent
        .upload_file_with_progress(local_path, remote, move |n| bar.inc(n))
        .await
}

/// Downloads `remote` (file or directory); returns the summary line.
pub async fn download(
    agent: &GuestClient,
    id: &str,
    remote: &str,
    local_path: Option<&Path>,
    force: bool,
) -> Result<String, FilesError> {
    let aerr = |source| FilesError::Agent {
        id: id.to_string(),
        source,
    };
    let entry = match agent.stat(remote).await {
        Ok(e) => e,
        Err(e) if e.code() == Some(Code::NotFound) => {
            return Err(FilesError::RemoteMissing(remote.to_string()));
        }
        Err(e) => return Err(aerr(e)),
    };
    let name = basename(remote);
    let dest = match local_path {
        None => PathBuf::from(&name),
        Some(p) if p.is_dir() || p.to_string_lossy().ends_with('/') => p.join(&name),
        Some(p) => p.to_path_buf(),
    };
    let parent = match dest.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    if !parent.is_dir() {
        return Err(FilesError::NoParent(dest));
    }
    if entry.r#type == fsp::FileType::Directory as i32 {
        check_remote_dir_path(remote)?;
        let mut dirs = vec![String::new()];
        let mut files: Vec<(String, String, u64)> = Vec::new();
        walk_remote(agent, id, remote, "", &mut dirs, &mut files).await?;
        // Check every local target before writing anything.
        if dest.exists() && !dest.is_dir() {
            return Err(FilesError::Exists(dest));
        }
        for (_, rel, _) in &files {
            let t = dest.join(rel);
            if t.is_dir() || (t.exists() && !force) {
                return Err(FilesError::Exists(t));
            }
        }
        for d in &dirs {
            let t = if d.is_empty() {
                dest.clone()
            } else {
                dest.join(d)
            };
            std::fs::create_dir_all(&t).map_err(local(&t))?;
        }
        let total = files.iter().map(|f| f.2).sum();
        let bar = transfer_bar("Downloading", total);
        for (rp, rel, _) in &files {
            download_one(agent, id, rp, &dest.join(rel), force, &bar).await?;
        }
        bar.finish_and_clear();
        return Ok(format!(
            "Downloaded directory {id}:{remote} to {}",
            dest.display()
        ));
    }
    if entry.r#type != fsp::FileType::File as i32 {
        return Err(FilesError::RemoteSpecial(remote.to_string()));
    }
    if dest.exists() && !force {
        return Err(FilesError::Exists(dest));
    }
    let bar = transfer_bar("Downloading", entry.size.max(0) as u64);
    download_one(agent, id, remote, &dest, force, &bar).await?;
    bar.finish_and_clear();
    Ok(format!("Downloaded {id}:{remote} to {}", dest.display()))
}

fn walk_remote<'a>(
    agent: &'a GuestClient,
    id: &'a str,
    dir: &'a str,
    rel: &'a str,
    dirs: &'a mut Vec<String>,
    files: &'a mut Vec<(String, String, u64)>,
) -> futures::future::BoxFuture<'a, Result<(), FilesError>> {
    Box::pin(async move {
        let mut entries = agent
            .list_dir(dir, 1)
            .await
            .map_err(|source| FilesError::Agent {
                id: id.to_string(),
                source,
            })?;
        entries.sort_by(|a, b| a.name.cmp(&b.name));
        if let Some(bad) = entries.iter().find(|e| !safe_entry_name(&e.name)) {
            return Err(FilesError::UnsafeEntry(bad.name.clone(), dir.to_string()));
        }
        for e in entries {
            let r = if rel.is_empty() {
                e.name.clone()
            } else {
                format!("{rel}/{}", e.name)
            };
            let path = join_remote(dir, &e.name);
            if e.symlink_target.is_some() {
                continue;
            }
            if e.r#type == fsp::FileType::Directory as i32 {
                dirs.push(r.clone());
                walk_remote(agent, id, &path, &r, dirs, files).await?;
            } else if e.r#type == fsp::FileType::File as i32 {
                files.push((path, r, e.size.max(0) as u64));
            }
        }
        Ok(())
    })
}

async fn download_one(
    agent: &GuestClient,
    id: &str,
    remote: &str,
    dest: &Path,
    force: bool,
    bar: &indicatif::ProgressBar,
) -> Result<(), FilesError> {
    let dir = match dest.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let tmp = tempfile::Builder::new()
        .prefix(".aenv-download-")
        .tempfile_in(&dir)
        .map_err(local(&dir))?;
    let res = async {
        let f = tmp.reopen().map_err(local(tmp.path()))?;
        let bar = bar.clone();
        agent
            .download_into(remote, f, move |n| bar.inc(n))
            .await
            .map_err(|source| match source {
                ClientError::Io { source, .. } => FilesError::Local {
                    path: dest.to_path_buf(),
                    source,
                },
                source => FilesError::Agent {
                    id: id.to_string(),
                    source,
                },
            })?;
        let f = tmp.reopen().map_err(local(tmp.path()))?;
        tokio::task::spawn_blocking(move || f.sync_all())
            .await
            .map_err(|e| FilesError::Local {
                path: dest.to_path_buf(),
                source: std::io::Error::other(e),
            })?
            .map_err(local(dest))?;
        Ok::<_, FilesError>(())
    }
    .await;
    res?;
    if force {
        tmp.persist(dest).map_err(|e| FilesError::Local {
            path: dest.to_path_buf(),
            source: e.error,
        })?;
    } else {
        tmp.persist_noclobber(dest).map_err(|e| {
            if e.error.kind() == std::io::ErrorKind::AlreadyExists {
                FilesError::Exists(dest.to_path_buf())
            } else {
                FilesError::Local {
                    path: dest.to_path_buf(),
                    source: e.error,
                }
            }
        })?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entry_names_that_leave_the_destination_are_unsafe() {
        for ok in ["a", "a.txt", "..a", "a..", ".hidden", "with space"] {
            assert!(safe_entry_name(ok), "{ok}");
        }
        for bad in ["", ".", "..", "../x", "a/b", "/etc", "a\0b"] {
            assert!(!safe_entry_name(bad), "{bad:?}");
        }
    }

    #[test]
    fn remote_paths_for_directories_must_be_absolute_without_dotdot() {
        assert!(check_remote_dir_path("/home/user").is_ok());
        assert!(check_remote_dir_path("home").is_err());
        assert!(check_remote_dir_path("/a/../b").is_err());
        assert_eq!(basename("/a/b/"), "b");
        assert_eq!(join_remote("/a/", "x"), "/a/x");
    }
}
