//! `filesystem.Filesystem`: stat, list, make, move, remove (`ops.rs`), and
//! directory watches with inotify, streamed or polled (`watch.rs`); the
//! entries they report ([`entry`]).

pub mod entry;
mod ops;
mod watch;

use std::sync::Arc;

use http::{Request, Response};
use hyper::body::Incoming;

use crate::connect::{self, Code, ConnectError, RespBody};
use crate::state::AgentState;

pub use entry::{FsError, chown_to, entry_info, make_dirs, mode_string};

use ops::{list_dir, make_dir, move_entry, remove, stat};
use watch::{create_watcher, get_watcher_events, remove_watcher, watch_dir};

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
