//! The calls on a running process: `Connect` (re-attach to its events),
//! `List`, `SendInput`, `StreamInput`, `SendSignal`, `CloseStdin`, and
//! `Update` (terminal size).

use std::io;
use std::sync::Arc;

use futures::StreamExt;
use tokio::io::AsyncWriteExt;

use crate::connect::{CallInfo, Code, ConnectError, MessageStream};
use crate::proto::process::{
    CloseStdinRequest, CloseStdinResponse, ConnectRequest, ConnectResponse, ListResponse,
    ProcessInput, SendInputRequest, SendInputResponse, SendSignalRequest, SendSignalResponse,
    Signal, StreamInputRequest, StreamInputResponse, UpdateRequest, UpdateResponse, process_event,
    process_input, stream_input_request,
};
use crate::signal::signal_group;
use crate::state::AgentState;
use crate::state::processes::{Input, Proc};

use super::output::{event, event_stream, keepalive_interval};

/// `Connect`.
pub async fn connect(
    state: Arc<AgentState>,
    info: CallInfo,
    req: ConnectRequest,
) -> Result<MessageStream<ConnectResponse>, ConnectError> {
    let proc = state.processes.find(req.process.as_ref())?;
    let rx = proc.subscribe();
    let first = event(process_event::Event::Start(process_event::StartEvent {
        pid: proc.pid,
    }));
    Ok(event_stream(rx, keepalive_interval(&info), first, |e| {
        ConnectResponse { event: Some(e) }
    }))
}

/// `List`.
pub fn list(state: &AgentState) -> ListResponse {
    ListResponse {
        processes: state.processes.infos(),
    }
}

async fn write_input(proc: &Proc, input: Option<ProcessInput>) -> Result<(), ConnectError> {
    let data = match input.and_then(|i| i.input) {
        Some(process_input::Input::Stdin(d)) | Some(process_input::Input::Pty(d)) => d,
        None => {
            return Err(ConnectError::invalid_argument(
                "`input` (stdin or pty bytes) is required",
            ));
        }
    };
    let mut guard = proc.input.lock().await;
    let stdin_err =
        |e: io::Error| ConnectError::new(Code::FailedPrecondition, format!("writing stdin: {e}"));
    match guard.as_mut() {
        Some(Input::Pipe(p)) => {
            p.write_all(&data).await.map_err(stdin_err)?;
            p.flush().await.map_err(stdin_err)
        }
        Some(Input::Pty(m)) => m.write_all(&data).await.map_err(|e| {
            ConnectError::new(
                Code::FailedPrecondition,
                format!("writing to terminal: {e}"),
            )
        }),
        None => Err(ConnectError::new(
            Code::FailedPrecondition,
            format!(
                "process {} has no open stdin (started with stdin=false, or stdin was closed)",
                proc.pid
            ),
        )),
    }
}

/// `SendInput`.
pub async fn send_input(
    state: &AgentState,
    req: SendInputRequest,
) -> Result<SendInputResponse, ConnectError> {
    let proc = state.processes.find(req.process.as_ref())?;
    write_input(&proc, req.input).await?;
    Ok(SendInputResponse {})
}

/// `StreamInput`: the first message selects the process.
pub async fn stream_input(
    state: Arc<AgentState>,
    mut msgs: MessageStream<StreamInputRequest>,
) -> Result<StreamInputResponse, ConnectError> {
    use stream_input_request::Event as E;
    let proc = match msgs.next().await {
        Some(Ok(StreamInputRequest {
            event: Some(E::Start(s)),
        })) => state.processes.find(s.process.as_ref())?,
        Some(Err(e)) => return Err(e),
        Some(Ok(_)) => {
            return Err(ConnectError::invalid_argument(
                "the first StreamInput message must be `start` with the process selector",
            ));
        }
        None => return Ok(StreamInputResponse {}),
    };
    while let Some(m) = msgs.next().await {
        match m?.event {
            Some(E::Data(d)) => write_input(&proc, d.input).await?,
            Some(E::Keepalive(_)) | None => {}
            Some(E::Start(_)) => {
                return Err(ConnectError::invalid_argument(
                    "`start` may only be the first StreamInput message",
                ));
            }
        }
    }
    Ok(StreamInputResponse {})
}

/// `SendSignal`.
pub fn send_signal(
    state: &AgentState,
    req: SendSignalRequest,
) -> Result<SendSignalResponse, ConnectError> {
    let proc = state.processes.find(req.process.as_ref())?;
    let sig = match Signal::try_from(req.signal) {
        Ok(Signal::Sigkill) => libc::SIGKILL,
        Ok(Signal::Sigterm) => libc::SIGTERM,
        _ => {
            return Err(ConnectError::invalid_argument(
                "`signal` must be SIGNAL_SIGTERM or SIGNAL_SIGKILL",
            ));
        }
    };
    if let Err(e) = signal_group(proc.pid, sig) {
        return Err(ConnectError::from_io(
            &e,
            &format!("signalling process {}", proc.pid),
        ));
    }
    Ok(SendSignalResponse {})
}

/// `CloseStdin`.
pub async fn close_stdin(
    state: &AgentState,
    req: CloseStdinRequest,
) -> Result<CloseStdinResponse, ConnectError> {
    let proc = state.processes.find(req.process.as_ref())?;
    if proc.pty.is_some() {
        return Err(ConnectError::new(
            Code::FailedPrecondition,
            "a terminal process has no stdin pipe to close; send Ctrl-D (0x04) as input instead",
        ));
    }
    proc.input.lock().await.take();
    Ok(CloseStdinResponse {})
}

/// `Update`.
pub fn update(state: &AgentState, req: UpdateRequest) -> Result<UpdateResponse, ConnectError> {
    let proc = state.processes.find(req.process.as_ref())?;
    if let Some(size) = req.pty.and_then(|p| p.size) {
        let Some(m) = &proc.pty else {
            return Err(ConnectError::new(
                Code::FailedPrecondition,
                format!("process {} was not started with a terminal", proc.pid),
            ));
        };
        let cols = size.cols.clamp(1, u16::MAX as u32) as u16;
        let rows = size.rows.clamp(1, u16::MAX as u32) as u16;
        m.resize(cols, rows)
            .map_err(|e| ConnectError::from_io(&e, "resizing the terminal"))?;
    }
    Ok(UpdateResponse {})
}
