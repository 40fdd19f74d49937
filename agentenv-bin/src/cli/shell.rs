//! The interactive shell of `aenv start` and `aenv connect`: a PTY process in the
//! sandbox, local raw mode, input over `Process/StreamInput`, output from the `Start`
//! stream, window resizes forwarded, and a watchdog that notices a paused or deleted
//! sandbox.

use std::io::{Read, Write};
use std::time::Duration;

use agentenv_guest::client::{ClientError, GuestClient};
use agentenv_guest::proto::process as pr;
use futures::StreamExt;
use tokio::sync::mpsc;

use super::DEFAULT_TIMEOUT_SECS;
use super::api::{Api, ApiError};
use super::process::{Gone, exit_code, gone, selector};
use super::term::{self, RawGuard, TermError};

/// Exit code when the session ends because the sandbox went away.
pub const GONE_EXIT: i32 = 130;
const WATCHDOG_EVERY: Duration = Duration::from_secs(2);
const KEEPALIVE_EVERY: Duration = Duration::from_secs(10);
const REFRESH_EVERY: Duration = Duration::from_secs(60);
const READY_WITHIN: Duration = Duration::from_secs(30);

/// Errors of the interactive session.
#[derive(Debug, thiserror::Error)]
pub enum ShellError {
    #[error(transparent)]
    Api(#[from] ApiError),
    #[error("sandbox {id}: starting a shell: {source}")]
    Start { id: String, source: ClientError },
    #[error(transparent)]
    Term(#[from] TermError),
    #[error(
        "sandbox {0} envd not healthy within 30s; check it with `aenv exec {0} true` or recreate it"
    )]
    NotReady(String),
}

enum Ending {
    Exited(i32),
    Paused,
    Deleted,
    Lost,
}

fn remote_term() -> String {
    const KNOWN: &[&str] = &[
        "xterm",
        "xterm-256color",
        "screen",
        "screen-256color",
        "tmux",
        "tmux-256color",
        "linux",
        "vt100",
        "vt220",
        "dumb",
    ];
    match std::env::var("TERM") {
        Ok(t) if KNOWN.contains(&t.as_str()) => t,
        _ => "xterm-256color".into(),
    }
}

async fn start_shell(
    agent: &GuestClient,
    cmd: &str,
    cols: u16,
    rows: u16,
) -> Result<agentenv_guest::client::ResponseStream<pr::StartResponse>, ClientError> {
    let mut envs: std::collections::HashMap<String, String> = Default::default();
    envs.insert("TERM".into(), remote_term());
    for k in ["COLORTERM", "LANG", "LC_ALL", "LC_CTYPE"] {
        if let Ok(v) = std::env::var(k) {
            envs.insert(k.into(), v);
        }
    }
    let req = pr::StartRequest {
        process: Some(pr::ProcessConfig {
            cmd: cmd.into(),
            args: vec!["-l".into()],
            envs: envs.into_iter().collect(),
            cwd: None,
        }),
        pty: Some(pr::Pty {
            size: Some(pr::pty::Size {
                cols: cols.into(),
                rows: rows.into(),
            }),
        }),
        stdin: Some(true),
        ..Default::default()
    };
    agent.start(&req).await
}

/// Attaches an interactive shell to sandbox `id` (resuming it when paused); returns the
/// exit code (the shell's, or 130 when the sandbox is paused, deleted or lost).
pub async fn attach(api: &Api, id: &str) -> Result<i32, ShellError> {
    let sb = api.connect(id, DEFAULT_TIMEOUT_SECS).await?;
    let agent = api.agent(id, sb.envd_access_token.as_deref())?;
    wait_ready(&agent, id).await?;
    let (cols, rows) = term::size().unwrap_or((80, 24));
    let mut stream = match start_shell(&agent, "/bin/bash", cols, rows).await {
        Ok(s) => s,
        Err(_) => start_shell(&agent, "/bin/sh", cols, rows)
            .await
            .map_err(|source| ShellError::Start {
                id: id.to_string(),
                source,
            })?,
    };
    // Wait for the start event (the pid).
    use pr::process_event::Event;
    let pid = loop {
        match stream.next().await {
            Some(Ok(m)) => {
                if let Some(Event::Start(s)) = m.event.and_then(|e| e.event) {
                    break s.pid;
                }
            }
            Some(Err(source)) => {
                return Err(ShellError::Start {
                    id: id.to_string(),
                    source,
                });
            }
            None => {
                return Err(ShellError::Start {
                    id: id.to_string(),
                    source: ClientError::Protocol {
                        path: "/process.Process/Start".into(),
                        reason: "the stream ended before the start event".into(),
                    },
                });
            }
        }
    };
    let guard = RawGuard::enter()?;
    let ending = session(api, id, &agent, stream, selector(pid)).await;
    drop(guard);
    let code = match ending {
        Ending::Exited(c) => {
            eprintln!("\r\nTerminal session ended. Re-run `aenv cn {id}` to reconnect.");
            c
        }
        Ending::Paused => {
            eprintln!("\r\nSandbox {id} has been paused. Run `aenv resume {id}` to resume it.");
            GONE_EXIT
        }
        Ending::Deleted => {
            eprintln!("\r\nSandbox {id} no longer exists.");
            GONE_EXIT
        }
        Ending::Lost => {
            eprintln!(
                "\r\nTerminal session lost contact with sandbox {id}. Re-run `aenv cn {id}` to reconnect."
            );
            GONE_EXIT
        }
    };
    Ok(code)
}

/// Waits until the sandbox's agent answers `Process/List` (a fresh or just resumed
/// sandbox may need a moment).
async fn wait_ready(agent: &GuestClient, id: &str) -> Result<(), ShellError> {
    let deadline = tokio::time::Instant::now() + READY_WITHIN;
    loop {
        if let Ok(Ok(_)) = tokio::time::timeout(Duration::from_millis(500), agent.list()).await {
            return Ok(());
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(ShellError::NotReady(id.to_string()));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Reads standard input on its own thread (a blocking read cannot be cancelled; the
/// process exits after the session, so the thread never holds anything up).
fn stdin_reader() -> mpsc::Receiver<Vec<u8>> {
    let (tx, rx) = mpsc::channel(16);
    std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        let mut stdin = std::io::stdin().lock();
        loop {
            match stdin.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if tx.blocking_send(buf[..n].to_vec()).is_err() {
                        break;
                    }
                }
            }
        }
    });
    rx
}

/// How the session ends when the sandbox went away.
async fn ended(api: &Api, id: &str) -> Option<Ending> {
    gone(api, id).await.map(|g| match g {
        Gone::Deleted => Ending::Deleted,
        Gone::Paused => Ending::Paused,
    })
}

async fn session(
    api: &Api,
    id: &str,
    agent: &GuestClient,
    stream: agentenv_guest::client::ResponseStream<pr::StartResponse>,
    sel: pr::ProcessSelector,
) -> Ending {
    let mut stream: Events = stream.map(|r| r.map(|m| m.event)).boxed();
    use pr::process_event::Event;
    use pr::process_event::data_event::Output;
    // The input call runs as its own task; a failed one is noticed when sending to it.
    let (mut input, _input_task) = agent.stream_input(sel.clone(), true);
    let mut stdin = stdin_reader();
    let mut stdin_open = true;
    let mut winch =
        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::window_change()).ok();
    let mut watchdog = tokio::time::interval(WATCHDOG_EVERY);
    watchdog.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut keepalive = tokio::time::interval(KEEPALIVE_EVERY);
    let mut refresh = tokio::time::interval(REFRESH_EVERY);
    let mut active = false;
    let mut out = std::io::stdout();
    let mut reconnects = 0u32;
    loop {
        tokio::select! {
            msg = stream.next() => match msg {
                Some(Ok(m)) => match m.and_then(|e| e.event) {
                    Some(Event::Data(d)) => {
                        if let Some(Output::Pty(b) | Output::Stdout(b) | Output::Stderr(b)) = d.output {
                            let _ = out.write_all(&b);
                            let _ = out.flush();
                        }
                    }
                    Some(Event::End(e)) => return Ending::Exited(exit_code(&e)),
                    _ => {}
                },
                Some(Err(_)) | None => {
                    // The output stream broke: the sandbox went away, or the connection
                    // did; re-attach to the same process when the sandbox is still there.
                    if let Some(e) = ended(api, id).await {
                        return e;
                    }
                    reconnects += 1;
                    if reconnects > 3 {
                        return Ending::Lost;
                    }
                    tokio::time::sleep(Duration::from_millis(300)).await;
                    match agent.connect(sel.clone()).await {
                        Ok(s) => {
                            stream = s.map(|r| r.map(|m| m.event)).boxed();
                        }
                        Err(_) => {
                            if let Some(e) = ended(api, id).await {
                                return e;
                            }
                            return Ending::Lost;
                        }
                    }
                }
            },
            data = stdin.recv(), if stdin_open => match data {
                Some(d) => {
                    active = true;
                    if !input.send(d.clone()).await {
                        // The input stream ended: open a new one, and send this chunk
                        // with a unary call so it is not lost.
                        let _ = agent.send_input(sel.clone(), d, true).await;
                        let (i, _task) = agent.stream_input(sel.clone(), true);
                        input = i;
                    }
                }
                None => stdin_open = false,
            },
            _ = async { match winch.as_mut() { Some(w) => w.recv().await, None => std::future::pending().await } } => {
                if let Some((c, r)) = term::size() {
                    let _ = agent.resize_pty(sel.clone(), c.into(), r.into()).await;
                }
            }
            _ = keepalive.tick() => {
                // An empty chunk keeps the input stream's body from idling out in proxies.
                let _ = input.send(Vec::new()).await;
            }
            _ = refresh.tick() => {
                if active {
                    active = false;
                    let _ = api.refresh(id, DEFAULT_TIMEOUT_SECS).await;
                }
            }
            _ = watchdog.tick() => {
                if let Some(e) = ended(api, id).await {
                    return e;
                }
            }
        }
    }
}

type Events = futures::stream::BoxStream<'static, Result<Option<pr::ProcessEvent>, ClientError>>;
