//! Directory watches with inotify: streamed (`WatchDir`) or polled
//! (`CreateWatcher`, `GetWatcherEvents`, `RemoveWatcher`; the registry is
//! [`crate::state::watchers`]).

use std::collections::HashMap;
use std::ffi::OsString;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use inotify::{EventMask, Inotify, WatchDescriptor, WatchMask};
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;

use crate::connect::{CallInfo, Code, ConnectError, MessageStream, with_keepalives};
use crate::fileio::unique_u64;
use crate::paths::resolve;
use crate::proto::filesystem::{
    CreateWatcherRequest, CreateWatcherResponse, EventType, FilesystemEvent,
    GetWatcherEventsRequest, GetWatcherEventsResponse, RemoveWatcherRequest, RemoveWatcherResponse,
    WatchDirRequest, WatchDirResponse, watch_dir_response,
};
use crate::state::AgentState;
use crate::state::watchers::PendingEvents;
use crate::users::{IdNames, User};

use super::entry::{FsError, entry_info, io_err};

/// Keepalive interval of WatchDir streams.
const WATCH_KEEPALIVE: Duration = Duration::from_secs(50);

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

/// What to watch.
struct WatchSpec<'a> {
    path: &'a str,
    recursive: bool,
    include_entry: bool,
    allow_network_mounts: bool,
}

/// Starts a watch; events go to `sink` until it returns false or `closed`
/// completes.
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
    let root = resolve(path, &user.home);
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

/// The [`WatchSpec`] of a request message: `WatchDirRequest` and
/// `CreateWatcherRequest` carry the same watch fields.
macro_rules! watch_spec {
    ($req:expr) => {
        WatchSpec {
            path: &$req.path,
            recursive: $req.recursive,
            include_entry: $req.include_entry,
            allow_network_mounts: $req.allow_network_mounts,
        }
    };
}

pub(super) async fn watch_dir(
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
        watch_spec!(req),
        move |fe| tx.send(fe).is_ok(),
        async move { closed_tx.closed().await },
    )?;
    use watch_dir_response::Event;
    let response = |ev| WatchDirResponse { event: Some(ev) };
    Ok(with_keepalives(
        response(Event::Start(watch_dir_response::StartEvent {})),
        UnboundedReceiverStream::new(rx).map(move |fe| response(Event::Filesystem(fe))),
        WATCH_KEEPALIVE,
        response(Event::Keepalive(watch_dir_response::KeepAlive {})),
    ))
}

pub(super) fn create_watcher(
    state: &AgentState,
    info: &CallInfo,
    req: CreateWatcherRequest,
) -> Result<CreateWatcherResponse, ConnectError> {
    let user = state.caller(&info.headers)?;
    let events = PendingEvents::default();
    let sink = events.clone();
    let task = start_watch(
        state,
        &user,
        watch_spec!(req),
        move |fe| {
            sink.push(fe);
            true
        },
        std::future::pending(),
    )?;
    let id = format!("{:016x}{:016x}", unique_u64(), unique_u64());
    state.watchers.insert(id.clone(), events, task);
    Ok(CreateWatcherResponse { watcher_id: id })
}

pub(super) fn get_watcher_events(
    state: &AgentState,
    req: GetWatcherEventsRequest,
) -> Result<GetWatcherEventsResponse, ConnectError> {
    let events = state.watchers.take_events(&req.watcher_id)?;
    Ok(GetWatcherEventsResponse { events })
}

pub(super) fn remove_watcher(
    state: &AgentState,
    req: RemoveWatcherRequest,
) -> Result<RemoveWatcherResponse, ConnectError> {
    state.watchers.remove(&req.watcher_id)?;
    Ok(RemoveWatcherResponse {})
}
