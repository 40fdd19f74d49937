//! A started process's output: reading its pipes or terminal, the events
//! sent to every listener (start, data, end, keepalives), and its end.

use std::io;
use std::process::ExitStatus;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use tokio::io::AsyncReadExt;
use tokio::net::unix::pipe;
use tokio::process::Child;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use crate::connect::{CallInfo, MessageStream, with_keepalives};
use crate::proto::process::{ProcessEvent, process_event};
use crate::pty::PtyMaster;
use crate::signal::exit_status_text;
use crate::state::AgentState;
use crate::state::processes::Proc;

/// How long output is still collected after the process exited while a
/// descendant keeps its output open.
const DRAIN_AFTER_EXIT: Duration = Duration::from_millis(50);
/// Default keepalive interval for event streams.
const DEFAULT_KEEPALIVE: Duration = Duration::from_secs(50);
/// Read size for process output.
const READ_CHUNK: usize = 32 * 1024;

pub(super) fn event(e: process_event::Event) -> ProcessEvent {
    ProcessEvent { event: Some(e) }
}

fn data_event(out: process_event::data_event::Output) -> ProcessEvent {
    event(process_event::Event::Data(process_event::DataEvent {
        output: Some(out),
    }))
}

/// Where a process's output comes from.
pub(super) enum Output {
    Pipes {
        stdout: Option<pipe::Receiver>,
        stderr: Option<pipe::Receiver>,
    },
    Pty(Arc<PtyMaster>),
}

impl Output {
    /// The one or two streams to read.
    fn sources(self) -> [Option<Source>; 2] {
        match self {
            Output::Pipes { stdout, stderr } => {
                [stdout.map(Source::Stdout), stderr.map(Source::Stderr)]
            }
            Output::Pty(master) => [Some(Source::Pty(master)), None],
        }
    }
}

/// One stream of a process's output.
enum Source {
    Stdout(pipe::Receiver),
    Stderr(pipe::Receiver),
    Pty(Arc<PtyMaster>),
}

impl Source {
    async fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Source::Stdout(r) => r.read(buf).await,
            Source::Stderr(r) => r.read(buf).await,
            Source::Pty(m) => m.read(buf).await,
        }
    }

    /// The event that carries `data` read from this stream.
    fn event(&self, data: &[u8]) -> ProcessEvent {
        use process_event::data_event::Output as O;
        let data = data.to_vec();
        data_event(match self {
            Source::Stdout(_) => O::Stdout(data),
            Source::Stderr(_) => O::Stderr(data),
            Source::Pty(_) => O::Pty(data),
        })
    }
}

/// Reads from `src`; never completes once it is closed (`None`).
async fn read_opt(src: &mut Option<Source>, buf: &mut [u8]) -> io::Result<usize> {
    match src {
        Some(s) => s.read(buf).await,
        None => std::future::pending().await,
    }
}

/// Sends what a read of `src` returned to the listeners, or closes `src`
/// when it ended or failed.
async fn forward(proc: &Proc, src: &mut Option<Source>, read: io::Result<usize>, buf: &[u8]) {
    let n = match read {
        Ok(n) if n > 0 => n,
        _ => {
            *src = None;
            return;
        }
    };
    if let Some(s) = src {
        proc.emit(s.event(&buf[..n])).await;
    }
}

/// How the end of a process is awaited: std's child through tokio, or a
/// pidfd ([`super::posix`]).
pub(super) enum Exit {
    Child(Child),
    Pidfd(super::posix::PidfdExit),
}

impl Exit {
    /// Cancel-safe; after the first answer, the same status again.
    async fn wait(&mut self) -> io::Result<ExitStatus> {
        match self {
            Exit::Child(c) => c.wait().await,
            Exit::Pidfd(p) => p.wait().await,
        }
    }
}

/// Reads the process's output, waits for it, sends the end event, and
/// removes it from the table.
pub(super) async fn pump(state: Arc<AgentState>, proc: Arc<Proc>, mut child: Exit, output: Output) {
    let mut status: Option<io::Result<ExitStatus>> = None;
    let mut b1 = vec![0u8; READ_CHUNK];
    let mut b2 = vec![0u8; READ_CHUNK];
    let mut drain_until = tokio::time::Instant::now();
    let [mut out1, mut out2] = output.sources();
    loop {
        if out1.is_none() && out2.is_none() && status.is_some() {
            break;
        }
        let exited = status.is_some();
        tokio::select! {
            r = read_opt(&mut out1, &mut b1) => forward(&proc, &mut out1, r, &b1).await,
            r = read_opt(&mut out2, &mut b2) => forward(&proc, &mut out2, r, &b2).await,
            s = child.wait(), if !exited => {
                status = Some(s);
                drain_until = tokio::time::Instant::now() + DRAIN_AFTER_EXIT;
            }
            _ = tokio::time::sleep_until(drain_until), if exited => break,
        }
    }
    let status = match status {
        Some(s) => s,
        None => child.wait().await,
    };
    state.processes.remove(proc.pid);
    proc.input.lock().await.take();
    let end = match status {
        Ok(st) => {
            let (exit_code, exited, status) = exit_status_text(&st);
            process_event::EndEvent {
                exit_code,
                exited,
                status,
                error: None,
            }
        }
        Err(e) => process_event::EndEvent {
            exit_code: -1,
            exited: false,
            status: "unknown".into(),
            error: Some(format!("waiting for the process: {e}")),
        },
    };
    tracing::debug!(pid = proc.pid, status = %end.status, "process ended");
    proc.emit(event(process_event::Event::End(end))).await;
    proc.unsubscribe_all();
}

/// The keepalive interval a client asks for (`Keepalive-Ping-Interval`,
/// seconds), or the default.
pub(super) fn keepalive_interval(info: &CallInfo) -> Duration {
    info.headers
        .get("keepalive-ping-interval")
        .and_then(|v| v.to_str().ok())
        .and_then(|s| s.trim().parse::<u64>().ok())
        .filter(|s| *s > 0)
        .map(Duration::from_secs)
        .unwrap_or(DEFAULT_KEEPALIVE)
}

/// `first`, then the events from `rx`, with keepalives in between.
pub(super) fn event_stream<T: Clone + Send + 'static>(
    rx: mpsc::Receiver<ProcessEvent>,
    keepalive: Duration,
    first: ProcessEvent,
    wrap: fn(ProcessEvent) -> T,
) -> MessageStream<T> {
    let ping = event(process_event::Event::Keepalive(process_event::KeepAlive {}));
    with_keepalives(
        wrap(first),
        ReceiverStream::new(rx).map(wrap),
        keepalive,
        wrap(ping),
    )
}
