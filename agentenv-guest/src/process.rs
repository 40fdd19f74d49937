//! `process.Process`: starting processes (with pipes or a pseudo-terminal),
//! streaming their output, input, signals, terminal resize, and re-attaching.

use std::collections::HashMap;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt as _;
use std::os::unix::process::ExitStatusExt as _;
use std::path::PathBuf;
use std::process::{ExitStatus, Stdio};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use http::{Request, Response};
use hyper::body::Incoming;
use parking_lot::Mutex;
use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::process::{Child, ChildStdin};
use tokio::sync::mpsc;

use crate::connect::{self, CallInfo, Code, ConnectError, MessageStream, RespBody};
use crate::proto::process::{
    CloseStdinRequest, CloseStdinResponse, ConnectRequest, ConnectResponse, ListRequest,
    ListResponse, ProcessConfig, ProcessEvent, ProcessInfo, ProcessInput, ProcessSelector,
    SendInputRequest, SendInputResponse, SendSignalRequest, SendSignalResponse, Signal,
    StartRequest, StartResponse, StreamInputRequest, StreamInputResponse, UpdateRequest,
    UpdateResponse, process_event, process_input, process_selector, stream_input_request,
};
use crate::server::AgentState;
use crate::users::User;

/// How long output is still collected after the process exited while a
/// descendant keeps its output open.
const DRAIN_AFTER_EXIT: Duration = Duration::from_millis(50);
/// Default keepalive interval for event streams.
const DEFAULT_KEEPALIVE: Duration = Duration::from_secs(50);
/// Read size for process output.
const READ_CHUNK: usize = 32 * 1024;

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

/// Where input for a process goes.
#[derive(Debug)]
enum Input {
    Pipe(ChildStdin),
    Pty(Arc<PtyMaster>),
}

/// One running process.
#[derive(Debug)]
pub struct Proc {
    pid: u32,
    tag: Option<String>,
    config: ProcessConfig,
    input: tokio::sync::Mutex<Option<Input>>,
    pty: Option<Arc<PtyMaster>>,
    subscribers: Mutex<Vec<mpsc::Sender<ProcessEvent>>>,
}

impl Proc {
    fn subscribe(&self) -> mpsc::Receiver<ProcessEvent> {
        let (tx, rx) = mpsc::channel(64);
        self.subscribers.lock().push(tx);
        rx
    }

    async fn emit(&self, ev: ProcessEvent) {
        let subs: Vec<_> = self.subscribers.lock().clone();
        let mut dead = Vec::new();
        for s in &subs {
            if s.send(ev.clone()).await.is_err() {
                dead.push(s.clone());
            }
        }
        if !dead.is_empty() {
            self.subscribers
                .lock()
                .retain(|s| !dead.iter().any(|d| d.same_channel(s)));
        }
    }
}

/// The table of running processes.
#[derive(Debug, Default)]
pub struct ProcessTable {
    procs: Mutex<HashMap<u32, Arc<Proc>>>,
}

impl ProcessTable {
    fn find(&self, sel: Option<&ProcessSelector>) -> Result<Arc<Proc>, ConnectError> {
        let sel = sel.and_then(|s| s.selector.as_ref()).ok_or_else(|| {
            ConnectError::invalid_argument("a process selector (pid or tag) is required")
        })?;
        let procs = self.procs.lock();
        let found = match sel {
            process_selector::Selector::Pid(pid) => procs.get(pid).cloned(),
            process_selector::Selector::Tag(tag) => procs
                .values()
                .find(|p| p.tag.as_deref() == Some(tag.as_str()))
                .cloned(),
        };
        found.ok_or_else(|| {
            let what = match sel {
                process_selector::Selector::Pid(pid) => format!("pid {pid}"),
                process_selector::Selector::Tag(t) => format!("tag {t:?}"),
            };
            ConnectError::not_found(format!("process with {what} not found (not running)"))
        })
    }

    /// Number of running processes.
    pub fn len(&self) -> usize {
        self.procs.lock().len()
    }

    /// Whether no process is running.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Sends SIGKILL to every process (agent shutdown).
    pub fn kill_all(&self) {
        for pid in self.procs.lock().keys() {
            let _ = signal_group(*pid, libc::SIGKILL);
        }
    }
}

/// Signals a started process and everything in its process group (every
/// process starts as the leader of its own group or session), so a shell's
/// children go too; falls back to the process alone.
fn signal_group(pid: u32, sig: libc::c_int) -> io::Result<()> {
    let pid = pid as libc::pid_t;
    // SAFETY: kill has no memory-safety preconditions.
    if unsafe { libc::kill(-pid, sig) } == 0 {
        return Ok(());
    }
    // SAFETY: as above.
    if unsafe { libc::kill(pid, sig) } == 0 {
        return Ok(());
    }
    Err(io::Error::last_os_error())
}

/// A pseudo-terminal master, non-blocking, driven by tokio.
#[derive(Debug)]
pub struct PtyMaster {
    fd: AsyncFd<OwnedFd>,
}

/// Opens a pseudo-terminal pair: (master, slave).
fn open_pty(cols: u16, rows: u16) -> io::Result<(PtyMaster, OwnedFd)> {
    // SAFETY: posix_openpt takes flags only and returns a new fd or -1.
    let m = unsafe { libc::posix_openpt(libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC) };
    if m < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `m` is a freshly opened fd that nothing else owns.
    let master = unsafe { OwnedFd::from_raw_fd(m) };
    // SAFETY: grantpt/unlockpt only act on the fd, which is valid.
    if unsafe { libc::grantpt(m) } != 0 || unsafe { libc::unlockpt(m) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let mut name = [0 as libc::c_char; 128];
    // SAFETY: the buffer is valid for `name.len()` bytes and ptsname_r
    // NUL-terminates within it.
    if unsafe { libc::ptsname_r(m, name.as_mut_ptr(), name.len()) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `name` is NUL-terminated (ptsname_r succeeded).
    let s = unsafe {
        libc::open(
            name.as_ptr(),
            libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC,
        )
    };
    if s < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `s` is a freshly opened fd that nothing else owns.
    let slave = unsafe { OwnedFd::from_raw_fd(s) };
    set_winsize(m, cols, rows)?;
    // SAFETY: fcntl on a valid fd with standard flags.
    unsafe {
        let fl = libc::fcntl(m, libc::F_GETFL);
        libc::fcntl(m, libc::F_SETFL, fl | libc::O_NONBLOCK);
    }
    // SAFETY: `master` is an OwnedFd: it stays open and refers to the same
    // file description until the AsyncFd (its owner) is dropped.
    let fd = unsafe { AsyncFd::register(master) }.map_err(io::Error::from)?;
    Ok((PtyMaster { fd }, slave))
}

fn set_winsize(fd: i32, cols: u16, rows: u16) -> io::Result<()> {
    let ws = libc::winsize {
        ws_row: rows,
        ws_col: cols,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: TIOCSWINSZ reads a winsize struct that lives across the call.
    if unsafe { libc::ioctl(fd, libc::TIOCSWINSZ, &ws) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

impl PtyMaster {
    /// Reads output; `Ok(0)` once the terminal is closed (EIO).
    async fn read(&self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            let mut guard = self.fd.readable().await?;
            let r = guard.try_io(|fd| {
                // SAFETY: `buf` is valid for writes of `buf.len()` bytes.
                let n = unsafe { libc::read(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
                if n < 0 {
                    Err(io::Error::last_os_error())
                } else {
                    Ok(n as usize)
                }
            });
            match r {
                Ok(Ok(n)) => return Ok(n),
                Ok(Err(e)) if e.raw_os_error() == Some(libc::EIO) => return Ok(0),
                Ok(Err(e)) if e.kind() == io::ErrorKind::Interrupted => continue,
                Ok(Err(e)) => return Err(e),
                Err(_would_block) => continue,
            }
        }
    }

    async fn write_all(&self, mut data: &[u8]) -> io::Result<()> {
        while !data.is_empty() {
            let mut guard = self.fd.writable().await?;
            let r = guard.try_io(|fd| {
                // SAFETY: `data` is valid for reads of `data.len()` bytes.
                let n = unsafe { libc::write(fd.as_raw_fd(), data.as_ptr().cast(), data.len()) };
                if n < 0 {
                    Err(io::Error::last_os_error())
                } else {
                    Ok(n as usize)
                }
            });
            match r {
                Ok(Ok(n)) => data = &data[n..],
                Ok(Err(e)) if e.kind() == io::ErrorKind::Interrupted => {}
                Ok(Err(e)) => return Err(e),
                Err(_would_block) => {}
            }
        }
        Ok(())
    }

    fn resize(&self, cols: u16, rows: u16) -> io::Result<()> {
        set_winsize(self.fd.get_ref().as_raw_fd(), cols, rows)
    }
}

/// Go-style text for a wait status, as envd reports it.
pub fn exit_status_text(status: &ExitStatus) -> (i32, bool, String) {
    if let Some(code) = status.code() {
        return (code, true, format!("exit status {code}"));
    }
    let sig = status.signal().unwrap_or(0);
    let name = match sig {
        1 => "hangup",
        2 => "interrupt",
        3 => "quit",
        4 => "illegal instruction",
        5 => "trace/breakpoint trap",
        6 => "aborted",
        7 => "bus error",
        8 => "floating point exception",
        9 => "killed",
        10 => "user defined signal 1",
        11 => "segmentation fault",
        12 => "user defined signal 2",
        13 => "broken pipe",
        14 => "alarm clock",
        15 => "terminated",
        16 => "stack fault",
        17 => "child exited",
        18 => "continued",
        19 => "stopped (signal)",
        20 => "stopped",
        21 => "stopped (tty input)",
        22 => "stopped (tty output)",
        23 => "urgent I/O condition",
        24 => "CPU time limit exceeded",
        25 => "file size limit exceeded",
        26 => "virtual timer expired",
        27 => "profiling timer expired",
        28 => "window changed",
        29 => "I/O possible",
        30 => "power failure",
        31 => "bad system call",
        _ => "",
    };
    let mut text = if name.is_empty() {
        format!("signal: signal {sig}")
    } else {
        format!("signal: {name}")
    };
    if status.core_dumped() {
        text.push_str(" (core dumped)");
    }
    (-1, false, text)
}

fn event(e: process_event::Event) -> ProcessEvent {
    ProcessEvent { event: Some(e) }
}

fn data_event(out: process_event::data_event::Output) -> ProcessEvent {
    event(process_event::Event::Data(process_event::DataEvent {
        output: Some(out),
    }))
}

async fn read_opt<R: AsyncRead + Unpin>(r: &mut Option<R>, buf: &mut [u8]) -> io::Result<usize> {
    match r {
        Some(r) => r.read(buf).await,
        None => std::future::pending().await,
    }
}

enum Output {
    Pipes {
        stdout: Option<tokio::process::ChildStdout>,
        stderr: Option<tokio::process::ChildStderr>,
    },
    Pty(Arc<PtyMaster>),
}

/// Reads the process's output, waits for it, sends the end event, and
/// removes it from the table.
async fn pump(state: Arc<AgentState>, proc: Arc<Proc>, mut child: Child, output: Output) {
    use process_event::data_event::Output as O;
    let mut status: Option<io::Result<ExitStatus>> = None;
    let mut b1 = vec![0u8; READ_CHUNK];
    let mut b2 = vec![0u8; READ_CHUNK];
    let mut drain_until = tokio::time::Instant::now();
    match output {
        Output::Pipes {
            mut stdout,
            mut stderr,
        } => loop {
            if stdout.is_none() && stderr.is_none() && status.is_some() {
                break;
            }
            let exited = status.is_some();
            tokio::select! {
                r = read_opt(&mut stdout, &mut b1) => match r {
                    Ok(n) if n > 0 => proc.emit(data_event(O::Stdout(b1[..n].to_vec()))).await,
                    _ => stdout = None,
                },
                r = read_opt(&mut stderr, &mut b2) => match r {
                    Ok(n) if n > 0 => proc.emit(data_event(O::Stderr(b2[..n].to_vec()))).await,
                    _ => stderr = None,
                },
                s = child.wait(), if !exited => {
                    status = Some(s);
                    drain_until = tokio::time::Instant::now() + DRAIN_AFTER_EXIT;
                }
                _ = tokio::time::sleep_until(drain_until), if exited => break,
            }
        },
        Output::Pty(master) => {
            let mut open = true;
            loop {
                if !open && status.is_some() {
                    break;
                }
                let exited = status.is_some();
                tokio::select! {
                    r = master.read(&mut b1), if open => match r {
                        Ok(n) if n > 0 => proc.emit(data_event(O::Pty(b1[..n].to_vec()))).await,
                        _ => open = false,
                    },
                    s = child.wait(), if !exited => {
                        status = Some(s);
                        drain_until = tokio::time::Instant::now() + DRAIN_AFTER_EXIT;
                    }
                    _ = tokio::time::sleep_until(drain_until), if exited => break,
                }
            }
        }
    }
    let status = match status {
        Some(s) => s,
        None => child.wait().await,
    };
    state.processes.procs.lock().remove(&proc.pid);
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
    proc.subscribers.lock().clear();
}

/// Builds the environment for a process.
fn build_env(
    state: &AgentState,
    user: &User,
    req_envs: &HashMap<String, String>,
) -> Vec<(String, String)> {
    let mut env = crate::server::base_env();
    env.entry("PATH".into())
        .or_insert_with(|| "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into());
    env.insert("HOME".into(), user.home.display().to_string());
    env.insert("USER".into(), user.name.clone());
    env.insert("LOGNAME".into(), user.name.clone());
    env.extend(state.init_envs());
    env.extend(req_envs.iter().map(|(k, v)| (k.clone(), v.clone())));
    env.into_iter().collect()
}

fn keepalive_interval(info: &CallInfo) -> Duration {
    info.headers
        .get("keepalive-ping-interval")
        .and_then(|v| v.to_str().ok())
        .and_then(|s| s.trim().parse::<u64>().ok())
        .filter(|s| *s > 0)
        .map(Duration::from_secs)
        .unwrap_or(DEFAULT_KEEPALIVE)
}

/// Events from `rx` with keepalives in between.
fn event_stream<T: Send + 'static>(
    rx: mpsc::Receiver<ProcessEvent>,
    keepalive: Duration,
    first: ProcessEvent,
    wrap: fn(ProcessEvent) -> T,
) -> MessageStream<T> {
    let mut ticker = tokio::time::interval_at(tokio::time::Instant::now() + keepalive, keepalive);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let head = futures::stream::iter([Ok(wrap(first))]);
    let tail = futures::stream::unfold((rx, ticker), move |(mut rx, mut ticker)| async move {
        tokio::select! {
            ev = rx.recv() => ev.map(|e| (Ok(wrap(e)), (rx, ticker))),
            _ = ticker.tick() => Some((
                Ok(wrap(event(process_event::Event::Keepalive(process_event::KeepAlive {})))),
                (rx, ticker),
            )),
        }
    });
    head.chain(tail).boxed()
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
    let cwd: PathBuf = match config.cwd.as_deref().filter(|c| !c.is_empty()) {
        Some(c) => crate::paths::resolve(c, &user.home),
        None => state.default_workdir().unwrap_or_else(|| user.home.clone()),
    };
    // An account whose home does not exist (e.g. `nobody`) starts in `/`;
    // a directory the client asked for must exist.
    let cwd = if config.cwd.as_deref().is_none_or(str::is_empty) && !cwd.is_dir() {
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
    let env = build_env(&state, &user, &config.envs);

    let mut cmd = std::process::Command::new(&config.cmd);
    cmd.args(&config.args)
        .env_clear()
        .envs(env)
        .current_dir(&cwd);

    let pty = req.pty.map(|p| p.size.unwrap_or_default());
    let mut slave_for_parent = None;
    let (master, use_stdin) = match pty {
        Some(size) => {
            let cols = if size.cols == 0 {
                80
            } else {
                size.cols.min(u16::MAX as u32) as u16
            };
            let rows = if size.rows == 0 {
                24
            } else {
                size.rows.min(u16::MAX as u32) as u16
            };
            let (master, slave) = open_pty(cols, rows).map_err(ProcessError::Pty)?;
            let dup = |fd: &OwnedFd| fd.try_clone().map_err(ProcessError::Pty);
            cmd.stdin(Stdio::from(dup(&slave)?))
                .stdout(Stdio::from(dup(&slave)?))
                .stderr(Stdio::from(dup(&slave)?));
            if !config.envs.contains_key("TERM") {
                cmd.env("TERM", "xterm-256color");
            }
            slave_for_parent = Some(slave);
            (Some(Arc::new(master)), true)
        }
        None => {
            let use_stdin = req.stdin.unwrap_or(true);
            cmd.stdin(if use_stdin {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
            (None, use_stdin)
        }
    };

    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    let switch_user = euid == 0 && user.uid != 0;
    let is_pty = master.is_some();
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
        if switch_user && let Some(slave) = &slave_for_parent {
            // SAFETY: fchown on a valid fd.
            unsafe { libc::fchown(slave.as_raw_fd(), uid, gid) };
        }
    }
    if !is_pty {
        cmd.process_group(0);
    }

    let mut child = tokio::process::Command::from(cmd)
        .kill_on_drop(false)
        .spawn()
        .map_err(|source| ProcessError::Spawn {
            cmd: config.cmd.clone(),
            source,
        })?;
    drop(slave_for_parent);
    let pid = child.id().unwrap_or(0);

    let (input, output) = match &master {
        Some(m) => (Some(Input::Pty(m.clone())), Output::Pty(m.clone())),
        None => (
            if use_stdin {
                child.stdin.take().map(Input::Pipe)
            } else {
                None
            },
            Output::Pipes {
                stdout: child.stdout.take(),
                stderr: child.stderr.take(),
            },
        ),
    };
    let proc = Arc::new(Proc {
        pid,
        tag: req.tag.clone(),
        config,
        input: tokio::sync::Mutex::new(input),
        pty: master,
        subscribers: Mutex::new(Vec::new()),
    });
    let rx = proc.subscribe();
    state.processes.procs.lock().insert(pid, proc.clone());
    tracing::debug!(pid, cmd = %proc.config.cmd, "process started");
    tokio::spawn(pump(state.clone(), proc, child, output));

    // A Start call with a deadline bounds the process's life too.
    if let Some(t) = info.timeout {
        let state = state.clone();
        tokio::spawn(async move {
            tokio::time::sleep(t).await;
            if state.processes.procs.lock().contains_key(&pid) {
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
    let procs = state.processes.procs.lock();
    let mut processes: Vec<ProcessInfo> = procs
        .values()
        .map(|p| ProcessInfo {
            config: Some(p.config.clone()),
            pid: p.pid,
            tag: p.tag.clone(),
        })
        .collect();
    processes.sort_by_key(|p| p.pid);
    ListResponse { processes }
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
    match guard.as_mut() {
        Some(Input::Pipe(p)) => {
            p.write_all(&data).await.map_err(|e| {
                ConnectError::new(Code::FailedPrecondition, format!("writing stdin: {e}"))
            })?;
            p.flush().await.map_err(|e| {
                ConnectError::new(Code::FailedPrecondition, format!("writing stdin: {e}"))
            })
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_status_text_matches_envd() {
        let st = ExitStatus::from_raw(3 << 8);
        assert_eq!(exit_status_text(&st), (3, true, "exit status 3".into()));
        let st = ExitStatus::from_raw(libc::SIGKILL);
        assert_eq!(exit_status_text(&st), (-1, false, "signal: killed".into()));
        let st = ExitStatus::from_raw(libc::SIGTERM);
        assert_eq!(exit_status_text(&st).2, "signal: terminated");
    }
}
