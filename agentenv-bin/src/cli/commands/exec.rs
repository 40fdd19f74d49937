//! `aenv exec`: one process, no shell, stdout and stderr forwarded as they come; exits
//! with the process's exit code.
//!
//! With `--stdin`, local standard input is streamed to the process (closed at EOF). A
//! local Ctrl-C sends SIGTERM to the remote process (SIGKILL after [`KILL_GRACE`], or at
//! once on a second Ctrl-C) and the command exits with 130.

use clap::Args;
use clap_complete::ArgValueCandidates;
use futures::StreamExt;
use tokio::io::{AsyncWrite, AsyncWriteExt};

use agentenv_guest::client::GuestClient;
use agentenv_guest::proto::process as pr;

use crate::cli::api::{Api, ApiError};
use crate::cli::args::parse_kv;
use crate::cli::process::{Gone, agent_for, exit_code, gone, selector};
use crate::cli::{CliError, complete, io_err};

/// How long `exec` waits after a Ctrl-C's SIGTERM before it sends SIGKILL.
pub const KILL_GRACE: std::time::Duration = std::time::Duration::from_secs(3);

/// Run one command in a sandbox (no shell); exits with its exit code.
#[derive(Debug, Args)]
#[command(after_help = "\
Examples:
  aenv exec <id> ls -la /tmp
  aenv exec <id> sh -c 'echo $HOME; exit 3'; echo $?     # prints 3
  aenv exec --env A=1 --cwd /tmp <id> env
  tar c ./src | aenv exec -i <id> tar x -C /tmp      # stream local input
Standard output and standard error are forwarded separately. Ctrl-C sends SIGTERM to
the remote command, SIGKILL 3 s later (or on a second Ctrl-C), and exits with 130.")]
pub struct ExecArgs {
    /// Environment variable KEY=VALUE for the command; repeatable.
    #[arg(long, short = 'e', value_name = "KEY=VALUE", value_parser = parse_kv)]
    pub env: Vec<(String, String)>,
    /// Working directory.
    #[arg(long)]
    pub cwd: Option<String>,
    /// Stream local standard input to the command (closed at end of input).
    #[arg(long, short = 'i')]
    pub stdin: bool,
    #[arg(add = ArgValueCandidates::new(complete::running))]
    pub sandbox_id: String,
    /// The program and its arguments.
    #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true)]
    pub command: Vec<String>,
}

/// Runs the command; returns its exit code (130 after a Ctrl-C, 141 when the local
/// output was closed).
pub async fn run(api: &Api, args: ExecArgs) -> Result<i32, CliError> {
    let id = args.sandbox_id.as_str();
    let agent = agent_for(api, id, None).await?;
    let mut words = args.command.into_iter();
    let cmd = words.next().unwrap_or_default();
    let req = pr::StartRequest {
        process: Some(pr::ProcessConfig {
            cmd,
            args: words.collect(),
            envs: args.env.into_iter().collect(),
            cwd: args.cwd,
        }),
        stdin: Some(args.stdin),
        ..Default::default()
    };
    let agent_err = |source| CliError::Agent {
        id: id.to_string(),
        source,
    };
    let mut stream = agent.start(&req).await.map_err(agent_err)?;
    let mut out = tokio::io::stdout();
    let mut err = tokio::io::stderr();
    let mut pid = None;
    let mut interrupts = 0u32;
    let mut input_started = false;
    use pr::process_event::Event;
    use pr::process_event::data_event::Output;
    // Registered before the first event so that no Ctrl-C is lost.
    let mut sigint = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())
        .map_err(io_err("installing the Ctrl-C handler"))?;
    // After a SIGTERM, SIGKILL follows if the command has not ended within the grace time.
    let mut kill_at: Option<tokio::time::Instant> = None;
    loop {
        let msg = tokio::select! {
            m = stream.next() => m,
            _ = sigint.recv() => {
                interrupts += 1;
                let Some(p) = pid else { return Ok(130) };
                if interrupts == 1 {
                    let _ = agent.send_signal(selector(p), pr::Signal::Sigterm).await;
                    kill_at = Some(tokio::time::Instant::now() + KILL_GRACE);
                } else {
                    let _ = agent.send_signal(selector(p), pr::Signal::Sigkill).await;
                    kill_at = None;
                }
                continue;
            }
            _ = async {
                match kill_at {
                    Some(t) => tokio::time::sleep_until(t).await,
                    None => std::future::pending().await,
                }
            } => {
                kill_at = None;
                if let Some(p) = pid {
                    let _ = agent.send_signal(selector(p), pr::Signal::Sigkill).await;
                }
                continue;
            }
        };
        let Some(msg) = msg else { break };
        let ev = match msg {
            Ok(m) => m.event.and_then(|e| e.event),
            Err(e) => return Err(gone_or(api, id, agent_err(e)).await),
        };
        match ev {
            Some(Event::Start(st)) => {
                pid = Some(st.pid);
                if args.stdin && !input_started {
                    input_started = true;
                    forward_stdin(agent.clone(), st.pid);
                }
            }
            Some(Event::Data(d)) => {
                let written = match d.output {
                    Some(Output::Stdout(b)) | Some(Output::Pty(b)) => write_all(&mut out, &b)
                        .await
                        .map_err(|e| (e, "writing stdout")),
                    Some(Output::Stderr(b)) => write_all(&mut err, &b)
                        .await
                        .map_err(|e| (e, "writing stderr")),
                    None => Ok(()),
                };
                if let Err((e, what)) = written {
                    return broken_pipe(&agent, pid, e, what).await;
                }
            }
            Some(Event::End(e)) => {
                if let Some(m) = e.error.as_deref().filter(|m| !m.is_empty()) {
                    eprintln!("aenv: {m}");
                }
                return Ok(if interrupts > 0 { 130 } else { exit_code(&e) });
            }
            _ => {}
        }
    }
    Err(gone_or(api, id, CliError::NoExitEvent).await)
}

/// Writes and flushes one chunk of output.
async fn write_all(w: &mut (impl AsyncWrite + Unpin), b: &[u8]) -> std::io::Result<()> {
    w.write_all(b).await?;
    w.flush().await
}

/// A closed local output (e.g. `aenv exec … | head`) stops the remote command and
/// exits like a process killed by SIGPIPE (141); other write errors are reported.
async fn broken_pipe(
    agent: &GuestClient,
    pid: Option<u32>,
    e: std::io::Error,
    what: &str,
) -> Result<i32, CliError> {
    if let Some(p) = pid {
        let _ = agent.send_signal(selector(p), pr::Signal::Sigkill).await;
    }
    if e.kind() == std::io::ErrorKind::BrokenPipe {
        Ok(141)
    } else {
        Err(io_err(what)(e))
    }
}

/// Streams local standard input to process `pid`, then closes its stdin.
fn forward_stdin(agent: GuestClient, pid: u32) {
    tokio::spawn(async move {
        use tokio::io::AsyncReadExt;
        let (tx, task) = agent.stream_input(selector(pid), false);
        let mut input = tokio::io::stdin();
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            match input.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if !tx.send(buf[..n].to_vec()).await {
                        break;
                    }
                }
            }
        }
        drop(tx);
        let _ = task.await;
        let _ = agent.close_stdin(selector(pid)).await;
    });
}

/// When a process stream breaks, says why if the sandbox was paused or deleted.
async fn gone_or(api: &Api, id: &str, e: CliError) -> CliError {
    match gone(api, id).await {
        Some(Gone::Deleted) => CliError::Api(ApiError::SandboxNotFound(id.to_string())),
        Some(Gone::Paused) => CliError::Paused(id.to_string()),
        None => e,
    }
}
