//! `filesystem.Filesystem`: stat, list, make, move, remove, and directory
//! watches (inotify), streamed or polled.

use std::collections::HashMap;
use std::ffi::OsString;
use std::io;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use http::{Request, Response};
use hyper::body::Incoming;
use inotify::{EventMask, Inotify, WatchDescriptor, WatchMask};
use parking_lot::Mutex;
use tokio::sync::mpsc;

use crate::connect::{self, CallInfo, Code, ConnectError, MessageStream, RespBody};
use crate::proto::filesystem::{
    CreateWatcherRequest, CreateWatcherResponse, EntryInfo, EventType, FileType, FilesystemEvent,
    GetWatcherEventsRequest, GetWatcherEventsResponse, ListDirRequest, ListDirResponse,
    MakeDirRequest, MakeDirResponse, MoveRequest, MoveResponse, RemoveRequest, RemoveResponse,
    RemoveWatcherRequest, RemoveWatcherResponse, StatRequest, StatResponse, WatchDirRequest,
    WatchDirResponse, watch_dir_response,
};
use crate::server::AgentState;
use crate::users::{IdNames, User};

/// Largest number of events a polling watcher keeps between polls.
const MAX_PENDING_EVENTS: usize = 65_536;
/// Keepalive interval of WatchDir streams.
const WATCH_KEEPALIVE: Duration = Duration::from_secs(50);
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

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> FsError + '_ {
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
            crate::paths::clean(&abs).display().to_string()
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
        modified_time: Some(crate::wkt::Timestamp {
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

fn stat(
    state: &AgentState,
    info: &CallInfo,
    req: StatRequest,
) -> Result<StatResponse, ConnectError> {
    let user = state.caller(&info.headers)?;
    let path = crate::paths::resolve(&req.path, &user.home);
    Ok(StatResponse {
        entry: Some(entry_info(&path, &state.accounts().id_names())?),
    })
}

fn make_dir(
    state: &AgentState,
    info: &CallInfo,
    req: MakeDirRequest,
) -> Result<MakeDirResponse, ConnectError> {
    let user = state.caller(&info.headers)?;
    let path = crate::paths::resolve(&req.path, &user.home);
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
        entry: Some(entry_info(&path, &state.accounts().id_names())?),
    })
}

fn move_entry(
    state: &AgentState,
    info: &CallInfo,
    req: MoveRequest,
) -> Result<MoveResponse, ConnectError> {
    let user = state.caller(&info.headers)?;
    let src = crate::paths::resolve(&req.source, &user.home);
    let dst = crate::paths::resolve(&req.destination, &user.home);
    std::fs::symlink_metadata(&src).map_err(io_err(&src))?;
    if let Some(parent) = dst.parent() {
        make_dirs(parent, &user).map_err(io_err(parent))?;
    }
    std::fs::rename(&src, &dst).map_err(io_err(&dst))?;
    Ok(MoveResponse {
        entry: Some(entry_info(&dst, &state.accounts().id_names())?),
    })
}

fn remove(
    state: &AgentState,
    info: &CallInfo,
    req: RemoveRequest,
) -> Result<RemoveResponse, ConnectError> {
    let user = state.caller(&info.headers)?;
    let path = crate::paths::resolve(&req.path, &user.home);
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

fn list_dir(
    state: &AgentState,
    info: &CallInfo,
    req: ListDirRequest,
) -> Result<ListDirResponse, ConnectError> {
    let user = state.caller(&info.headers)?;
    let root = crate::paths::resolve(&req.path, &user.home);
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

// ---------------------------------------------------------------- watches

/// One directory watch, feeding events to a callback.
struct Watch {
    root: PathBuf,
    recursive: bool,
    include_entry: bool,
    dirs: HashMap<WatchDescriptor, PathBuf>,
}

fn watch_mask() -> WatchMask {
    WatchMask::CREATE
        | WatchMask::MODIFY
        | WatchMask::DELETE
        | WatchMask::DELETE_SELF
        | WatchMask::MOVED_FROM
        | WatchMask::MOVED_TO
        | WatchMask::MOVE_SELF
        | WatchMask::ATTRIB
}

impl Watch {
    fn add_tree(&mut self, watches: &mut inotify::Watches, dir: &Path) -> io::Result<()> {
        let wd = watches.add(dir, watch_mask() | WatchMask::ONLYDIR)?;
        self.dirs.insert(wd, dir.to_path_buf());
        if self.recursive
            && let Ok(rd) = std::fs::read_dir(dir)
        {
            for e in rd.flatten() {
                if e.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                    let _ = self.add_tree(watches, &e.path());
                }
            }
        }
        Ok(())
    }

    fn convert(
        &mut self,
        watches: &mut inotify::Watches,
        ev: inotify::Event<OsString>,
        names: &IdNames,
    ) -> Vec<FilesystemEvent> {
        if ev.mask.contains(EventMask::IGNORED) {
            self.dirs.remove(&ev.wd);
            return Vec::new();
        }
        let Some(dir) = self.dirs.get(&ev.wd).cloned() else {
            return Vec::new();
        };
        let full = match &ev.name {
            Some(n) => dir.join(n),
            None => dir.clone(),
        };
        let ty = if ev.mask.intersects(EventMask::CREATE | EventMask::MOVED_TO) {
            EventType::Create
        } else if ev.mask.contains(EventMask::MODIFY) {
            EventType::Write
        } else if ev
            .mask
            .intersects(EventMask::DELETE | EventMask::DELETE_SELF)
        {
            EventType::Remove
        } else if ev
            .mask
            .intersects(EventMask::MOVED_FROM | EventMask::MOVE_SELF)
        {
            EventType::Rename
        } else if ev.mask.contains(EventMask::ATTRIB) {
            EventType::Chmod
        } else {
            return Vec::new();
        };
        // The watched directory's own removal or move is reported once, for
        // the root only.
        if ev.name.is_none() && full != self.root {
            return Vec::new();
        }
        if self.recursive && ty == EventType::Create && ev.mask.contains(EventMask::ISDIR) {
            let _ = self.add_tree(watches, &full);
        }
        let name = full
            .strip_prefix(&self.root)
            .map(|p| p.display().to_string())
            .unwrap_or_else(|_| full.display().to_string());
        let entry = if self.include_entry {
            entry_info(&full, names).ok()
        } else {
            None
        };
        vec![FilesystemEvent {
            name,
            r#type: ty as i32,
            entry,
        }]
    }
}

/// The kind of network filesystem `path` is on, if it is on one.
fn network_fs_kind(path: &Path) -> Option<&'static str> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).ok()?;
    // SAFETY: statfs is plain data; zeroed is a valid value.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is NUL-terminated and `st` is a valid out pointer.
    if unsafe { libc::statfs(c.as_ptr(), &mut st) } != 0 {
        return None;
    }
    match st.f_type as u32 {
        0x6969 => Some("NFS"),
        0xFF53_4D42 => Some("CIFS"),
        0x517B => Some("SMB"),
        0xFE53_4D42 => Some("SMB2"),
        0x6573_5546 => Some("FUSE"),
        _ => None,
    }
}

/// Starts a watch; events go to `sink` until it returns false.
/// What to watch.
struct WatchSpec<'a> {
    path: &'a str,
    recursive: bool,
    include_entry: bool,
    allow_network_mounts: bool,
}

fn start_watch(
    state: &AgentState,
    user: &User,
    spec: WatchSpec<'_>,
    mut sink: impl FnMut(FilesystemEvent) -> bool + Send + 'static,
    closed: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<tokio::task::JoinHandle<()>, ConnectError> {
    let WatchSpec {
        path,
        recursive,
        include_entry,
        allow_network_mounts,
    } = spec;
    let root = crate::paths::resolve(path, &user.home);
    let md = std::fs::metadata(&root).map_err(io_err(&root))?;
    if !md.is_dir() {
        return Err(FsError::NotADirectory(root.display().to_string()).into());
    }
    if !allow_network_mounts && let Some(kind) = network_fs_kind(&root) {
        return Err(ConnectError::new(
            Code::FailedPrecondition,
            format!(
                "{} is on a {kind} network mount, where change events may be missed; \
                 set allow_network_mounts to watch it anyway",
                root.display()
            ),
        ));
    }
    let wrap = |source| FsError::Watch {
        path: root.display().to_string(),
        source,
    };
    let inotify = Inotify::init().map_err(wrap)?;
    let mut watches = inotify.watches();
    let mut watch = Watch {
        root: root.clone(),
        recursive,
        include_entry,
        dirs: HashMap::new(),
    };
    watch.add_tree(&mut watches, &root).map_err(wrap)?;
    let mut stream = inotify
        .into_event_stream(vec![0u8; 64 * 1024])
        .map_err(wrap)?;
    let names = state.accounts().id_names();
    Ok(tokio::spawn(async move {
        tokio::pin!(closed);
        loop {
            let ev = tokio::select! {
                ev = stream.next() => ev,
                _ = &mut closed => break,
            };
            match ev {
                Some(Ok(ev)) => {
                    for fe in watch.convert(&mut watches, ev, &names) {
                        if !sink(fe) {
                            return;
                        }
                    }
                }
                Some(Err(e)) => {
                    tracing::warn!(error = %e, "reading inotify events");
                    break;
                }
                None => break,
            }
            if watch.dirs.is_empty() {
                break;
            }
        }
    }))
}

async fn watch_dir(
    state: Arc<AgentState>,
    info: CallInfo,
    req: WatchDirRequest,
) -> Result<MessageStream<WatchDirResponse>, ConnectError> {
    let user = state.caller(&info.headers)?;
    let (tx, rx) = mpsc::unbounded_channel::<FilesystemEvent>();
    let closed_tx = tx.clone();
    start_watch(
        &state,
        &user,
        WatchSpec {
            path: &req.path,
            recursive: req.recursive,
            include_entry: req.include_entry,
            allow_network_mounts: req.allow_network_mounts,
        },
        move |fe| tx.send(fe).is_ok(),
        async move { closed_tx.closed().await },
    )?;
    let start = WatchDirResponse {
        event: Some(watch_dir_response::Event::Start(
            watch_dir_response::StartEvent {},
        )),
    };
    let mut ticker = tokio::time::interval_at(
        tokio::time::Instant::now() + WATCH_KEEPALIVE,
        WATCH_KEEPALIVE,
    );
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let tail = futures::stream::unfold((rx, ticker), |(mut rx, mut ticker)| async move {
        let ev = tokio::select! {
            fe = rx.recv() => watch_dir_response::Event::Filesystem(fe?),
            _ = ticker.tick() => watch_dir_response::Event::Keepalive(watch_dir_response::KeepAlive {}),
        };
        Some((Ok(WatchDirResponse { event: Some(ev) }), (rx, ticker)))
    });
    Ok(futures::stream::iter([Ok(start)]).chain(tail).boxed())
}

/// A polling watcher (CreateWatcher / GetWatcherEvents / RemoveWatcher).
#[derive(Debug)]
struct PollWatcher {
    events: Arc<Mutex<Vec<FilesystemEvent>>>,
    task: tokio::task::JoinHandle<()>,
}

/// Registry of polling watchers.
#[derive(Debug, Default)]
pub struct Watchers {
    map: Mutex<HashMap<String, PollWatcher>>,
}

impl Watchers {
    /// Number of active polling watchers.
    pub fn len(&self) -> usize {
        self.map.lock().len()
    }

    /// Whether no polling watcher is active.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

fn create_watcher(
    state: &AgentState,
    info: &CallInfo,
    req: CreateWatcherRequest,
) -> Result<CreateWatcherResponse, ConnectError> {
    let user = state.caller(&info.headers)?;
    let events = Arc::new(Mutex::new(Vec::new()));
    let sink_events = events.clone();
    let task = start_watch(
        state,
        &user,
        WatchSpec {
            path: &req.path,
            recursive: req.recursive,
            include_entry: req.include_entry,
            allow_network_mounts: req.allow_network_mounts,
        },
        move |fe| {
            let mut ev = sink_events.lock();
            if ev.len() >= MAX_PENDING_EVENTS {
                ev.remove(0);
            }
            ev.push(fe);
            true
        },
        std::future::pending(),
    )?;
    let id = format!(
        "{:016x}{:016x}",
        crate::fileio::unique_u64(),
        crate::fileio::unique_u64()
    );
    state
        .watchers
        .map
        .lock()
        .insert(id.clone(), PollWatcher { events, task });
    Ok(CreateWatcherResponse { watcher_id: id })
}

fn get_watcher_events(
    state: &AgentState,
    req: GetWatcherEventsRequest,
) -> Result<GetWatcherEventsResponse, ConnectError> {
    let map = state.watchers.map.lock();
    let w = map.get(&req.watcher_id).ok_or_else(|| {
        ConnectError::not_found(format!("watcher {:?} not found", req.watcher_id))
    })?;
    let events = std::mem::take(&mut *w.events.lock());
    Ok(GetWatcherEventsResponse { events })
}

fn remove_watcher(
    state: &AgentState,
    req: RemoveWatcherRequest,
) -> Result<RemoveWatcherResponse, ConnectError> {
    let w = state
        .watchers
        .map
        .lock()
        .remove(&req.watcher_id)
        .ok_or_else(|| {
            ConnectError::not_found(format!("watcher {:?} not found", req.watcher_id))
        })?;
    w.task.abort();
    Ok(RemoveWatcherResponse {})
}

/// Dispatches `/filesystem.Filesystem/<Method>`.
pub async fn route(state: Arc<AgentState>, req: Request<Incoming>) -> Response<RespBody> {
    let method = req
        .uri()
        .path()
        .trim_start_matches("/filesystem.Filesystem/")
        .to_string();
    let s = state;
    match method.as_str() {
        "Stat" => connect::unary(req, |i, r| async move { stat(&s, &i, r) }).await,
        "MakeDir" => connect::unary(req, |i, r| async move { make_dir(&s, &i, r) }).await,
        "Move" => connect::unary(req, |i, r| async move { move_entry(&s, &i, r) }).await,
        "ListDir" => connect::unary(req, |i, r| async move { list_dir(&s, &i, r) }).await,
        "Remove" => connect::unary(req, |i, r| async move { remove(&s, &i, r) }).await,
        "WatchDir" => connect::server_stream(req, |i, r| watch_dir(s, i, r)).await,
        "CreateWatcher" => {
            connect::unary(req, |i, r| async move { create_watcher(&s, &i, r) }).await
        }
        "GetWatcherEvents" => {
            connect::unary(req, |_, r| async move { get_watcher_events(&s, r) }).await
        }
        "RemoveWatcher" => connect::unary(req, |_, r| async move { remove_watcher(&s, r) }).await,
        _ => ConnectError::new(
            Code::Unimplemented,
            format!("filesystem.Filesystem has no method {method:?}"),
        )
        .into_unary_response(),
    }
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
