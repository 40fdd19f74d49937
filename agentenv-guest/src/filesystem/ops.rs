//! The one-shot filesystem calls: `Stat`, `MakeDir`, `Move`, `Remove`,
//! `ListDir`. Paths are resolved against the caller's home.

use std::io;
use std::path::{Path, PathBuf};

use crate::connect::{CallInfo, ConnectError};
use crate::paths::resolve;
use crate::proto::filesystem::{
    EntryInfo, FileType, ListDirRequest, ListDirResponse, MakeDirRequest, MakeDirResponse,
    MoveRequest, MoveResponse, RemoveRequest, RemoveResponse, StatRequest, StatResponse,
};
use crate::state::AgentState;
use crate::users::User;

use super::entry::{FsError, entry_info, io_err, make_dirs};

/// The caller, and `path` resolved against their home.
fn caller_path(
    state: &AgentState,
    info: &CallInfo,
    path: &str,
) -> Result<(User, PathBuf), ConnectError> {
    let user = state.caller(&info.headers)?;
    let path = resolve(path, &user.home);
    Ok((user, path))
}

/// The `EntryInfo` of `path`, owners named from the agent's account files.
fn entry_of(state: &AgentState, path: &Path) -> Result<EntryInfo, FsError> {
    entry_info(path, &state.accounts().id_names())
}

pub(super) fn stat(
    state: &AgentState,
    info: &CallInfo,
    req: StatRequest,
) -> Result<StatResponse, ConnectError> {
    let (_, path) = caller_path(state, info, &req.path)?;
    Ok(StatResponse {
        entry: Some(entry_of(state, &path)?),
    })
}

pub(super) fn make_dir(
    state: &AgentState,
    info: &CallInfo,
    req: MakeDirRequest,
) -> Result<MakeDirResponse, ConnectError> {
    let (user, path) = caller_path(state, info, &req.path)?;
    match std::fs::symlink_metadata(&path) {
        Ok(md) if md.is_dir() => {
            return Err(FsError::Exists(format!("directory {}", path.display())).into());
        }
        Ok(_) => {
            return Err(FsError::Exists(format!("{} (not a directory)", path.display())).into());
        }
        Err(_) => {}
    }
    make_dirs(&path, &user).map_err(io_err(&path))?;
    Ok(MakeDirResponse {
        entry: Some(entry_of(state, &path)?),
    })
}

pub(super) fn move_entry(
    state: &AgentState,
    info: &CallInfo,
    req: MoveRequest,
) -> Result<MoveResponse, ConnectError> {
    let (user, src) = caller_path(state, info, &req.source)?;
    let dst = resolve(&req.destination, &user.home);
    std::fs::symlink_metadata(&src).map_err(io_err(&src))?;
    if let Some(parent) = dst.parent() {
        make_dirs(parent, &user).map_err(io_err(parent))?;
    }
    std::fs::rename(&src, &dst).map_err(io_err(&dst))?;
    Ok(MoveResponse {
        entry: Some(entry_of(state, &dst)?),
    })
}

pub(super) fn remove(
    state: &AgentState,
    info: &CallInfo,
    req: RemoveRequest,
) -> Result<RemoveResponse, ConnectError> {
    let (_, path) = caller_path(state, info, &req.path)?;
    if path == Path::new("/") {
        return Err(ConnectError::invalid_argument("refusing to remove /"));
    }
    match std::fs::symlink_metadata(&path) {
        Ok(md) if md.is_dir() => std::fs::remove_dir_all(&path).map_err(io_err(&path))?,
        Ok(_) => std::fs::remove_file(&path).map_err(io_err(&path))?,
        // Like envd: removing what is not there succeeds.
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(io_err(&path)(e).into()),
    }
    Ok(RemoveResponse {})
}

pub(super) fn list_dir(
    state: &AgentState,
    info: &CallInfo,
    req: ListDirRequest,
) -> Result<ListDirResponse, ConnectError> {
    let (_, root) = caller_path(state, info, &req.path)?;
    let md = std::fs::metadata(&root).map_err(io_err(&root))?;
    if !md.is_dir() {
        return Err(FsError::NotADirectory(root.display().to_string()).into());
    }
    let depth = req.depth.max(1);
    let names = state.accounts().id_names();
    let mut entries = Vec::new();
    let mut stack = vec![(root, 1u32)];
    while let Some((dir, level)) = stack.pop() {
        let rd = match std::fs::read_dir(&dir) {
            Ok(rd) => rd,
            Err(e) if level == 1 => return Err(io_err(&dir)(e).into()),
            Err(_) => continue,
        };
        let mut children: Vec<PathBuf> = rd.filter_map(|e| e.ok().map(|e| e.path())).collect();
        children.sort();
        for child in children {
            let Ok(info) = entry_info(&child, &names) else {
                continue;
            };
            if info.r#type == FileType::Directory as i32 && !info.is_symlink && level < depth {
                stack.push((child.clone(), level + 1));
            }
            entries.push(info);
        }
    }
    Ok(ListDirResponse { entries })
}
