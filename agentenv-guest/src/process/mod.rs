//! `process.Process`: starting processes with pipes or a pseudo-terminal
//! (`spawn.rs`), streaming their output (`output.rs`), input, signals,
//! terminal resize, and re-attaching (`control.rs`). The table of running
//! processes is part of the agent's state ([`crate::state::processes`]).

mod control;
mod output;
mod posix;
mod spawn;

use std::sync::Arc;

use http::{Request, Response};
use hyper::body::Incoming;

use crate::connect::{self, Code, ConnectError, RespBody};
use crate::proto::process::ListRequest;
use crate::state::AgentState;

pub use crate::signal::exit_status_text;
pub use crate::state::processes::{Proc, ProcessTable};
pub use control::{close_stdin, connect, list, send_input, send_signal, stream_input, update};
pub use spawn::{ProcessError, start};

/// Dispatches `/process.Process/<Method>`.
pub async fn route(state: Arc<AgentState>, req: Request<Incoming>) -> Response<RespBody> {
    let method = req
        .uri()
        .path()
        .trim_start_matches("/process.Process/")
        .to_string();
    let s = state;
    match method.as_str() {
        "Start" => connect::server_stream(req, |i, r| start(s, i, r)).await,
        "Connect" => connect::server_stream(req, |i, r| connect(s, i, r)).await,
        "List" => connect::unary(req, |_, _r: ListRequest| async move { Ok(list(&s)) }).await,
        "SendInput" => connect::unary(req, |_, r| async move { send_input(&s, r).await }).await,
        "StreamInput" => connect::client_stream(req, |_, m| stream_input(s, m)).await,
        "SendSignal" => connect::unary(req, |_, r| async move { send_signal(&s, r) }).await,
        "CloseStdin" => connect::unary(req, |_, r| async move { close_stdin(&s, r).await }).await,
        "Update" => connect::unary(req, |_, r| async move { update(&s, r) }).await,
        _ => ConnectError::new(
            Code::Unimplemented,
            format!("process.Process has no method {method:?}"),
        )
        .into_unary_response(),
    }
}
