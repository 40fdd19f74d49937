//! `process.Process` calls: start (and run to completion), re-attach,
//! list, input (one-shot or streamed), signals, stdin close, terminal
//! resize.

use futures::{Stream, StreamExt};
use tokio::sync::mpsc;

use crate::proto::process as pr;

use super::rpc::ResponseStream;
use super::transport::{ClientError, GuestClient};

impl GuestClient {
    /// `Process/Start`.
    pub async fn start(
        &self,
        req: &pr::StartRequest,
    ) -> Result<ResponseStream<pr::StartResponse>, ClientError> {
        self.server_stream("/process.Process/Start", req).await
    }

    /// Runs `cmd args…` without stdin and collects its output.
    pub async fn run(&self, cmd: &str, args: &[&str]) -> Result<ProcessOutput, ClientError> {
        let req = pr::StartRequest {
            process: Some(pr::ProcessConfig {
                cmd: cmd.to_string(),
                args: args.iter().map(|a| a.to_string()).collect(),
                ..Default::default()
            }),
            stdin: Some(false),
            ..Default::default()
        };
        let stream = self.start(&req).await?;
        collect_output(stream.map(|r| r.map(|m| m.event))).await
    }

    /// `Process/Connect`.
    pub async fn connect(
        &self,
        process: pr::ProcessSelector,
    ) -> Result<ResponseStream<pr::ConnectResponse>, ClientError> {
        self.server_stream(
            "/process.Process/Connect",
            &pr::ConnectRequest {
                process: Some(process),
            },
        )
        .await
    }

    /// `Process/List`.
    pub async fn list(&self) -> Result<Vec<pr::ProcessInfo>, ClientError> {
        let r: pr::ListResponse = self
            .unary("/process.Process/List", &pr::ListRequest {})
            .await?;
        Ok(r.processes)
    }

    /// `Process/SendInput` (stdin bytes, or terminal bytes when `pty`).
    pub async fn send_input(
        &self,
        process: pr::ProcessSelector,
        data: Vec<u8>,
        pty: bool,
    ) -> Result<(), ClientError> {
        let _: pr::SendInputResponse = self
            .unary(
                "/process.Process/SendInput",
                &pr::SendInputRequest {
                    process: Some(process),
                    input: Some(process_input(data, pty)),
                },
            )
            .await?;
        Ok(())
    }

    /// Opens a `Process/StreamInput` for `process`; returns a sender and
    /// the task that finishes the call once the sender is dropped.
    pub fn stream_input(
        &self,
        process: pr::ProcessSelector,
        pty: bool,
    ) -> (
        InputSender,
        tokio::task::JoinHandle<Result<(), ClientError>>,
    ) {
        let (tx, rx) = mpsc::channel::<Option<Vec<u8>>>(16);
        let start = pr::StreamInputRequest {
            event: Some(pr::stream_input_request::Event::Start(
                pr::stream_input_request::StartEvent {
                    process: Some(process),
                },
            )),
        };
        let data = tokio_stream::wrappers::ReceiverStream::new(rx).map(move |d| {
            let Some(d) = d else {
                return pr::StreamInputRequest {
                    event: Some(pr::stream_input_request::Event::Keepalive(
                        pr::stream_input_request::KeepAlive {},
                    )),
                };
            };
            pr::StreamInputRequest {
                event: Some(pr::stream_input_request::Event::Data(
                    pr::stream_input_request::DataEvent {
                        input: Some(process_input(d, pty)),
                    },
                )),
            }
        });
        let msgs = futures::stream::iter([start]).chain(data);
        let this = self.clone();
        let task = tokio::spawn(async move {
            let _: pr::StreamInputResponse = this
                .client_stream("/process.Process/StreamInput", msgs)
                .await?;
            Ok(())
        });
        (InputSender { tx }, task)
    }

    /// `Process/SendSignal`.
    pub async fn send_signal(
        &self,
        process: pr::ProcessSelector,
        signal: pr::Signal,
    ) -> Result<(), ClientError> {
        let _: pr::SendSignalResponse = self
            .unary(
                "/process.Process/SendSignal",
                &pr::SendSignalRequest {
                    process: Some(process),
                    signal: signal as i32,
                },
            )
            .await?;
        Ok(())
    }

    /// `Process/CloseStdin`.
    pub async fn close_stdin(&self, process: pr::ProcessSelector) -> Result<(), ClientError> {
        let _: pr::CloseStdinResponse = self
            .unary(
                "/process.Process/CloseStdin",
                &pr::CloseStdinRequest {
                    process: Some(process),
                },
            )
            .await?;
        Ok(())
    }

    /// `Process/Update` with a new terminal size.
    pub async fn resize_pty(
        &self,
        process: pr::ProcessSelector,
        cols: u32,
        rows: u32,
    ) -> Result<(), ClientError> {
        let _: pr::UpdateResponse = self
            .unary(
                "/process.Process/Update",
                &pr::UpdateRequest {
                    process: Some(process),
                    pty: Some(pr::Pty {
                        size: Some(pr::pty::Size { cols, rows }),
                    }),
                },
            )
            .await?;
        Ok(())
    }
}

/// Sends input into an open `StreamInput` call.
#[derive(Debug, Clone)]
pub struct InputSender {
    tx: mpsc::Sender<Option<Vec<u8>>>,
}

impl InputSender {
    /// Queues bytes; false when the call has ended.
    pub async fn send(&self, data: Vec<u8>) -> bool {
        self.tx.send(Some(data)).await.is_ok()
    }

    /// Sends a keepalive message, which keeps proxies with an idle timeout
    /// from closing a quiet input stream; false when the call has ended.
    pub async fn keepalive(&self) -> bool {
        self.tx.send(None).await.is_ok()
    }
}

/// Output of [`GuestClient::run`].
#[derive(Debug, Clone, Default)]
pub struct ProcessOutput {
    pub pid: u32,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    pub pty: Vec<u8>,
    pub end: Option<pr::process_event::EndEvent>,
}

/// Collects a process event stream into its output and end event.
pub async fn collect_output<S>(mut events: S) -> Result<ProcessOutput, ClientError>
where
    S: Stream<Item = Result<Option<pr::ProcessEvent>, ClientError>> + Unpin,
{
    use pr::process_event::Event;
    use pr::process_event::data_event::Output;
    let mut out = ProcessOutput::default();
    while let Some(ev) = events.next().await {
        match ev?.and_then(|e| e.event) {
            Some(Event::Start(s)) => out.pid = s.pid,
            Some(Event::Data(d)) => match d.output {
                Some(Output::Stdout(b)) => out.stdout.extend_from_slice(&b),
                Some(Output::Stderr(b)) => out.stderr.extend_from_slice(&b),
                Some(Output::Pty(b)) => out.pty.extend_from_slice(&b),
                None => {}
            },
            Some(Event::End(e)) => out.end = Some(e),
            Some(Event::Keepalive(_)) | None => {}
        }
    }
    Ok(out)
}

/// Input bytes for a process's stdin, or its terminal when `pty`.
fn process_input(data: Vec<u8>, pty: bool) -> pr::ProcessInput {
    let input = if pty {
        pr::process_input::Input::Pty(data)
    } else {
        pr::process_input::Input::Stdin(data)
    };
    pr::ProcessInput { input: Some(input) }
}
