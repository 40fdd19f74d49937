//! Starting a process (`Start`): its command, environment, working
//! directory, user, and standard streams (pipes or a pseudo-terminal).

use std::collections::HashMap;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::Stdio;

use std::sync::Arc;
use tokio::net::unix::pipe;

use crate::connect::{CallInfo, Code, ConnectError, MessageStream};
use crate::paths::resolve;
use crate::proto::process::pty::Size as PtySize;
use crate::proto::process::{ProcessConfig, StartRequest, StartResponse, process_event};
use crate::pty::{PtyMaster, open_pty};
use crate::signal::signal_group;
use crate::state::processes::{Input, Proc};
use crate::state::{AgentState, base_env};
use crate::users::User;

use super::output::{Exit, Output, event, event_stream, keepalive_interval, pump};
use super::posix;

/// Errors of the process module.
#[derive(Debug, thiserror::Error)]
pub enum ProcessError {
    #[error("opening a pseudo-terminal: {0}")]
    Pty(io::Error),
    #[error("starting {cmd:?}: {source}")]
    Spawn { cmd: String, source: io::Error },
}

impl From<ProcessError> for ConnectError {
    fn from(e: ProcessError) -> Self {
        match &e {
            ProcessError::Spawn { source, .. } if source.kind() == io::ErrorKind::NotFound => {
                ConnectError::new(Code::NotFound, e.to_string())
            }
            ProcessError::Spawn { source, .. } if source.kind() == io::ErrorKind::InvalidInput => {
                ConnectError::invalid_argument(e.to_string())
            }
            ProcessError::Spawn { source, .. }
                if source.kind() == io::ErrorKind::PermissionDenied =>
            {
                ConnectError::new(Code::PermissionDenied, e.to_string())
            }
            _ => ConnectError::internal(e.to_string()),
        }
    }
}

/// Builds the environment for a process.
fn build_env(
    state: &AgentState,
    user: &User,
    req_envs: &HashMap<String, String>,
) -> Vec<(String, String)> {
    let mut env = base_env();
    env.entry("PATH".into())
        .or_insert_with(|| "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into());
    env.insert("HOME".into(), user.home.display().to_string());
    env.insert("USER".into(), user.name.clone());
    env.insert("LOGNAME".into(), user.name.clone());
    env.extend(state.init_envs());
    env.extend(req_envs.iter().map(|(k, v)| (k.clone(), v.clone())));
    env.into_iter().collect()
}

/// The directory a process starts in: the one asked for (which must
/// exist), else the default directory or the user's home, else `/`.
fn working_dir(
    state: &AgentState,
    user: &User,
    asked: Option<&str>,
) -> Result<PathBuf, ConnectError> {
    let cwd: PathBuf = match asked.filter(|c| !c.is_empty()) {
        Some(c) => resolve(c, &user.home),
        None => state.default_workdir().unwrap_or_else(|| user.home.clone()),
    };
    // An account whose home does not exist (e.g. `nobody`) starts in `/`;
    // a directory the client asked for must exist.
    let cwd = if asked.is_none_or(str::is_empty) && !cwd.is_dir() {
        PathBuf::from("/")
    } else {
        cwd
    };
    if !cwd.is_dir() {
        return Err(ConnectError::invalid_argument(format!(
            "working directory {} does not exist or is not a directory",
            cwd.display()
        )));
    }
    Ok(cwd)
}

/// How a process's standard streams are connected.
struct Stdio3 {
    /// The terminal's master side, for a process with a terminal.
    master: Option<Arc<PtyMaster>>,
    /// The terminal's slave side, kept by the agent until the spawn.
    slave: Option<OwnedFd>,
    /// Whether the process reads input from the agent.
    use_stdin: bool,
}

/// Connects stdin, stdout and stderr to a new terminal of `size` (0 cols
/// or rows: 80x24), or to pipes (stdin to /dev/null unless `stdin`).
fn attach_stdio(
    cmd: &mut std::process::Command,
    pty: Option<PtySize>,
    stdin: Option<bool>,
    envs: &HashMap<String, String>,
) -> Result<Stdio3, ProcessError> {
    let Some(size) = pty else {
        let use_stdin = stdin.unwrap_or(true);
        cmd.stdin(if use_stdin {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
        return Ok(Stdio3 {
            master: None,
            slave: None,
            use_stdin,
        });
    };
    let dim = |n: u32, default: u16| {
        if n == 0 {
            default
        } else {
            n.min(u16::MAX as u32) as u16
        }
    };
    let (master, slave) =
        open_pty(dim(size.cols, 80), dim(size.rows, 24)).map_err(ProcessError::Pty)?;
    let dup = |fd: &OwnedFd| fd.try_clone().map_err(ProcessError::Pty);
    cmd.stdin(Stdio::from(dup(&slave)?))
        .stdout(Stdio::from(dup(&slave)?))
        .stderr(Stdio::from(dup(&slave)?));
    if !envs.contains_key("TERM") {
        cmd.env("TERM", "xterm-256color");
    }
    Ok(Stdio3 {
        master: Some(Arc::new(master)),
        slave: Some(slave),
        use_stdin: true,
    })
}

/// Whether a process for `user` changes user: the agent runs as root and `user` is not.
fn switches_user(user: &User) -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 && user.uid != 0 }
}

/// Makes the process run as `user` (when the agent is root), and a
/// terminal process the leader of a new session with its terminal as the
/// controlling one; any other process leads a process group of its own.
fn run_as(cmd: &mut std::process::Command, user: &User, stdio: &Stdio3) {
    let switch_user = switches_user(user);
    let is_pty = stdio.master.is_some();
    if switch_user || is_pty {
        let groups: Vec<libc::gid_t> = user.groups.clone();
        let (uid, gid) = (user.uid, user.gid);
        // SAFETY: the closure only calls async-signal-safe functions
        // (setsid, ioctl, setgroups, setgid, setuid) and allocates nothing.
        unsafe {
            cmd.pre_exec(move || {
                if is_pty {
                    if libc::setsid() < 0 {
                        return Err(io::Error::last_os_error());
                    }
                    if libc::ioctl(0, libc::TIOCSCTTY as _, 0) < 0 {
                        return Err(io::Error::last_os_error());
                    }
                }
                if switch_user
                    && (libc::setgroups(groups.len(), groups.as_ptr()) < 0
                        || libc::setgid(gid) < 0
                        || libc::setuid(uid) < 0)
                {
                    return Err(io::Error::last_os_error());
                }
                Ok(())
            });
        }
        if switch_user && let Some(slave) = &stdio.slave {
            // SAFETY: fchown on a valid fd.
            unsafe { libc::fchown(slave.as_raw_fd(), uid, gid) };
        }
    }
    if !is_pty {
        cmd.process_group(0);
    }
}

/// A started process, however it was started.
struct Started {
    pid: u32,
    exit: Exit,
    input: Option<Input>,
    output: Output,
    master: Option<Arc<PtyMaster>>,
}

/// Starts a plain process (pipes, no terminal, no change of user) with
/// `posix_spawn` ([`super::posix`]). `None` when it cannot be started that
/// way (std starts it then).
fn spawn_plain(
    user: &User,
    pty: bool,
    config: &ProcessConfig,
    env: &[(String, String)],
    cwd: &Path,
    stdin: Option<bool>,
) -> Option<Result<Started, ProcessError>> {
    if pty || switches_user(user) || !posix::available() {
        return None;
    }
    let path = env
        .iter()
        .find(|(k, _)| k == "PATH")
        .map(|(_, v)| v.as_str());
    let file = posix::program(&config.cmd, path)?;
    let use_stdin = stdin.unwrap_or(true);
    let spawned = match posix::spawn(&file, &config.cmd, &config.args, env, cwd, use_stdin) {
        Err(source) => {
            return Some(Err(ProcessError::Spawn {
                cmd: config.cmd.clone(),
                source,
            }));
        }
        Ok(s) => s,
    };
    let pipe_err = |source| ProcessError::Spawn {
        cmd: config.cmd.clone(),
        source,
    };
    let wrap = || -> io::Result<Started> {
        Ok(Started {
            pid: spawned.pid,
            input: match spawned.stdin {
                Some(fd) => Some(Input::Pipe(pipe::Sender::from_owned_fd(fd)?)),
                None => None,
            },
            output: Output::Pipes {
                stdout: Some(pipe::Receiver::from_owned_fd(spawned.stdout)?),
                stderr: Some(pipe::Receiver::from_owned_fd(spawned.stderr)?),
            },
            exit: Exit::Pidfd(spawned.exit),
            master: None,
        })
    };
    Some(wrap().map_err(pipe_err))
}

/// Starts a process with std (a terminal, another user, or what
/// [`spawn_plain`] leaves).
fn spawn_std(
    user: &User,
    pty_size: Option<PtySize>,
    stdin: Option<bool>,
    config: &ProcessConfig,
    env: Vec<(String, String)>,
    cwd: &Path,
) -> Result<Started, ConnectError> {
    let mut cmd = std::process::Command::new(&config.cmd);
    cmd.args(&config.args)
        .env_clear()
        .envs(env)
        .current_dir(cwd);
    let stdio = attach_stdio(&mut cmd, pty_size, stdin, &config.envs)?;
    run_as(&mut cmd, user, &stdio);

    let spawn_err = |source| ProcessError::Spawn {
        cmd: config.cmd.clone(),
        source,
    };
    let mut child = tokio::process::Command::from(cmd)
        .kill_on_drop(false)
        .spawn()
        .map_err(spawn_err)?;
    let Stdio3 {
        master,
        slave,
        use_stdin,
    } = stdio;
    drop(slave);
    let pid = child.id().unwrap_or(0);
    let receiver = |fd: io::Result<OwnedFd>| fd.and_then(pipe::Receiver::from_owned_fd);
    let (input, output) = match &master {
        Some(m) => (Some(Input::Pty(m.clone())), Output::Pty(m.clone())),
        None => {
            let input = match child.stdin.take().filter(|_| use_stdin) {
                Some(s) => Some(Input::Pipe(
                    s.into_owned_fd()
                        .and_then(pipe::Sender::from_owned_fd)
                        .map_err(spawn_err)?,
                )),
                None => None,
            };
            let stdout = child.stdout.take().map(|p| receiver(p.into_owned_fd()));
            let stderr = child.stderr.take().map(|p| receiver(p.into_owned_fd()));
            (
                input,
                Output::Pipes {
                    stdout: stdout.transpose().map_err(spawn_err)?,
                    stderr: stderr.transpose().map_err(spawn_err)?,
                },
            )
        }
    };
    Ok(Started {
        pid,
        exit: Exit::Child(child),
        input,
        output,
        master,
    })
}

/// `Start`.
pub async fn start(
    state: Arc<AgentState>,
    info: CallInfo,
    req: StartRequest,
) -> Result<MessageStream<StartResponse>, ConnectError> {
    let user = state.caller(&info.headers)?;
    let config = req.process.ok_or_else(|| {
        ConnectError::invalid_argument("`process` (cmd, args, envs, cwd) is required")
    })?;
    if config.cmd.is_empty() {
        return Err(ConnectError::invalid_argument(
            "`process.cmd` must not be empty",
        ));
    }
    let cwd = working_dir(&state, &user, config.cwd.as_deref())?;
    let env = build_env(&state, &user, &config.envs);
    let pty_size = req.pty.map(|p| p.size.unwrap_or_default());

    let started = match spawn_plain(&user, pty_size.is_some(), &config, &env, &cwd, req.stdin) {
        Some(s) => s?,
        None => spawn_std(&user, pty_size, req.stdin, &config, env, &cwd)?,
    };
    let Started {
        pid,
        exit,
        input,
        output,
        master,
    } = started;
    let proc = Arc::new(Proc::new(pid, req.tag.clone(), config, input, master));
    let rx = proc.subscribe();
    state.processes.insert(proc.clone());
    tracing::debug!(pid, cmd = %proc.config.cmd, "process started");
    tokio::spawn(pump(state.clone(), proc, exit, output));

    // A Start call with a deadline bounds the process's life too.
    if let Some(t) = info.timeout {
        let state = state.clone();
        tokio::spawn(async move {
            tokio::time::sleep(t).await;
            if state.processes.contains(pid) {
                let _ = signal_group(pid, libc::SIGKILL);
            }
        });
    }

    let first = event(process_event::Event::Start(process_event::StartEvent {
        pid,
    }));
    Ok(event_stream(rx, keepalive_interval(&info), first, |e| {
        StartResponse { event: Some(e) }
    }))
}
