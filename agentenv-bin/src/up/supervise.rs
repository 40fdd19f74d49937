//! The child processes of `agentenv up`: started in their own process group (Ctrl-C
//! reaches `agentenv up` alone) and stopped with it even when it is killed outright;
//! their output logged to `<data>/logs/<name>.log`, shown when worth showing, and read
//! for the line that says a child is ready; stopped with SIGTERM, SIGKILL after 30 s.

use std::io::Write as _;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader};
use tokio::process::{Child, Command};
use tokio::sync::mpsc;

use super::UpError;
use super::config::fs_err;
use super::output::{LogLine, Out, Progress, shown_line};

/// How many of a child's last lines an early exit reports.
const TAIL_LINES: usize = 20;
/// How long a stop waits for a child after SIGTERM before it sends SIGKILL.
const STOP_GRACE: Duration = Duration::from_secs(30);

/// One output line of child `child`, parsed when it is a JSON log line.
struct Line {
    child: usize,
    log: Option<LogLine>,
}

struct ChildProc {
    name: String,
    child: Child,
    log: PathBuf,
    tail: Arc<parking_lot::Mutex<std::collections::VecDeque<String>>>,
}

impl ChildProc {
    fn tail(&self) -> String {
        self.tail
            .lock()
            .iter()
            .cloned()
            .collect::<Vec<_>>()
            .join("\n")
    }
}

/// A child that exited on its own: name, exit status, log file.
pub(crate) type Died = (String, String, PathBuf);

/// The running children and their output.
pub(crate) struct Supervisor {
    out: Out,
    verbose: bool,
    logs: PathBuf,
    children: Vec<ChildProc>,
    lines: mpsc::UnboundedReceiver<Line>,
    tx: mpsc::UnboundedSender<Line>,
}

impl Supervisor {
    /// No children yet; their logs go to `logs`.
    pub fn new(out: Out, verbose: bool, logs: PathBuf) -> Self {
        let (tx, lines) = mpsc::unbounded_channel();
        Self {
            out,
            verbose,
            logs,
            children: Vec::new(),
            lines,
            tx,
        }
    }

    /// Starts `cmd` as child `name`; returns its index.
    pub fn spawn(&mut self, name: &str, mut cmd: Command) -> Result<usize, UpError> {
        let idx = self.children.len();
        let log = self.logs.join(format!("{name}.log"));
        let mut file = std::fs::File::create(&log).map_err(fs_err("creating", &log))?;
        cmd.env("LOG_FORMAT", "json")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            // Own process group: Ctrl-C reaches `agentenv up` alone, which deletes the
            // sandboxes before it stops the nodes.
            .process_group(0);
        // SAFETY: the closure runs in the forked child before exec and calls only
        // async-signal-safe functions (prctl, getppid).
        unsafe {
            cmd.pre_exec(|| {
                // Stop with the parent even when it is killed outright.
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if libc::getppid() == 1 {
                    return Err(std::io::Error::other("parent already exited"));
                }
                Ok(())
            });
        }
        let mut child = cmd.spawn().map_err(|source| UpError::Spawn {
            name: name.into(),
            source,
        })?;
        let tail = Arc::new(parking_lot::Mutex::new(std::collections::VecDeque::new()));
        let (ltx, mut lrx) = mpsc::unbounded_channel::<String>();
        if let Some(o) = child.stdout.take() {
            forward_lines(o, ltx.clone());
        }
        if let Some(e) = child.stderr.take() {
            forward_lines(e, ltx.clone());
        }
        drop(ltx);
        let tx = self.tx.clone();
        let out = self.out.clone();
        let verbose = self.verbose;
        let tag = name.to_string();
        let tail2 = tail.clone();
        tokio::spawn(async move {
            let mut progress = Progress::default();
            while let Some(l) = lrx.recv().await {
                let _ = writeln!(file, "{l}");
                {
                    let mut t = tail2.lock();
                    if t.len() == TAIL_LINES {
                        t.pop_front();
                    }
                    t.push_back(l.clone());
                }
                let log = serde_json::from_str::<LogLine>(&l).ok();
                if let Some(show) = shown_line(log.as_ref(), &l, verbose)
                    && (verbose || !progress.repeats(&show))
                {
                    out(&format!("  [{tag}] {show}"));
                }
                let _ = tx.send(Line { child: idx, log });
            }
        });
        self.children.push(ChildProc {
            name: name.into(),
            child,
            log,
            tail,
        });
        Ok(idx)
    }

    /// Waits until child `idx` logs `message`; returns that line. Fails when the child
    /// exits first (with its last lines) or `limit` passes.
    pub async fn wait_logged(
        &mut self,
        idx: usize,
        message: &'static str,
        limit: Duration,
    ) -> Result<LogLine, UpError> {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            tokio::select! {
                l = self.lines.recv() => {
                    if let Some(Line { child, log: Some(l) }) = l
                        && child == idx
                        && l.message == message
                    {
                        return Ok(l);
                    }
                }
                st = self.children[idx].child.wait() => {
                    // Let the reader tasks drain the last lines first.
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    let c = &self.children[idx];
                    return Err(UpError::EarlyExit {
                        name: c.name.clone(),
                        status: status_text(st),
                        tail: c.tail(),
                    });
                }
                _ = tokio::time::sleep_until(deadline) => {
                    let c = &self.children[idx];
                    return Err(UpError::NotReady {
                        name: c.name.clone(),
                        message,
                        limit,
                        log: c.log.clone(),
                    });
                }
            }
        }
    }

    /// Forgets the lines read so far (their echo and log already happened).
    pub fn drain(&mut self) {
        while self.lines.try_recv().is_ok() {}
    }

    /// Whether a child named `name` was started.
    pub fn has(&self, name: &str) -> bool {
        self.children.iter().any(|c| c.name == name)
    }

    /// Runs until `shutdown` resolves (`None`) or a child exits (`Some`); the lines
    /// read meanwhile are only echoed and logged.
    pub async fn watch(&mut self, shutdown: impl std::future::Future<Output = ()>) -> Option<Died> {
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                _ = &mut shutdown => return None,
                l = self.lines.recv() => { l?; }
                d = wait_any(&mut self.children) => return Some(d),
            }
        }
    }

    /// SIGTERM to the children whose name matches, then waits (SIGKILL after 30 s).
    pub async fn stop_matching(&mut self, which: impl Fn(&str) -> bool) {
        let say = self.out.clone();
        for c in self.children.iter_mut().filter(|c| which(&c.name)) {
            if let Some(pid) = c.child.id() {
                // SAFETY: kill with a pid of our own child and a valid signal number.
                unsafe { libc::kill(pid as i32, libc::SIGTERM) };
                match tokio::time::timeout(STOP_GRACE, c.child.wait()).await {
                    Ok(_) => say(&format!("  {} stopped", c.name)),
                    Err(_) => {
                        let _ = c.child.kill().await;
                        say(&format!("  {} killed (no exit within 30 s)", c.name));
                    }
                }
            }
        }
    }
}

/// Sends each line `from` reads to `to`, until the end or an error.
fn forward_lines(from: impl AsyncRead + Unpin + Send + 'static, to: mpsc::UnboundedSender<String>) {
    tokio::spawn(async move {
        let mut r = BufReader::new(from).lines();
        while let Ok(Some(l)) = r.next_line().await {
            let _ = to.send(l);
        }
    });
}

fn status_text(st: std::io::Result<std::process::ExitStatus>) -> String {
    st.map(|s| s.to_string()).unwrap_or_else(|e| e.to_string())
}

/// The first child to exit; never, with no children.
async fn wait_any(children: &mut [ChildProc]) -> Died {
    let waits: Vec<_> = children
        .iter_mut()
        .map(|c| {
            Box::pin(async move {
                let st = c.child.wait().await;
                (c.name.clone(), status_text(st), c.log.clone())
            })
        })
        .collect();
    if waits.is_empty() {
        return std::future::pending().await;
    }
    futures::future::select_all(waits).await.0
}
