//! `agentenv-vmm`: one process per microVM, controlled over a unix socket.
//!
//! ```text
//! agentenv-vmm --config vm.json --api-sock api.sock [--restore <snapshot dir>] [--start]
//!              [--log-file vmm.log] [--seccomp strict|off]
//! ```
//!
//! The VM is built (or restored) from the configuration first; only then is the API socket
//! bound and the seccomp filter installed, so a bad configuration ends the process with one
//! line naming the field, before anything listens. The process exits when the VM is
//! stopped over the socket or the guest ends (reset, debug-exit port, error). A guest that
//! failed (the vCPU watchdog's verdict included: a vCPU stuck in the hypervisor) is
//! logged at error level, shown by `status` as `exit_reason` until the process is gone,
//! and ends the process with status 2 and one line on stderr.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context as _;
use clap::{Parser, ValueEnum};
use serde_json::{Value, json};

use agentenv_vmm::control::{self, Action, ControlServer, Handler};
use agentenv_vmm::{ExitReason, SnapshotKind, Vm, VmConfig};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum SeccompMode {
    /// Install the VMM's allow-list; any other system call kills the process.
    Strict,
    /// No filter (debugging only).
    Off,
}

/// The AgentENV microVM monitor: one VM per process.
#[derive(Debug, Parser)]
#[command(name = "agentenv-vmm", version)]
struct Args {
    /// The VM configuration (JSON).
    #[arg(long, value_name = "vm.json")]
    config: PathBuf,
    /// The control socket to listen on.
    #[arg(long, value_name = "PATH")]
    api_sock: PathBuf,
    /// Restore the VM from this snapshot directory instead of booting the kernel.
    #[arg(long, value_name = "DIR")]
    restore: Option<PathBuf>,
    /// Write logs here instead of stderr.
    #[arg(long, value_name = "PATH")]
    log_file: Option<PathBuf>,
    /// The system call filter.
    #[arg(long, value_enum, default_value = "strict")]
    seccomp: SeccompMode,
    /// Run the VM right away (boot, or continue the restored VM) instead of waiting for
    /// the `start` action.
    #[arg(long)]
    start: bool,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum State {
    /// Built or restored, vCPUs not running yet.
    Created,
    Running,
    Paused,
    Exited(ExitReason),
}

impl State {
    fn name(&self) -> &'static str {
        match self {
            State::Created => "created",
            State::Running => "running",
            State::Paused => "paused",
            State::Exited(_) => "exited",
        }
    }
}

struct Vmm {
    vm: Vm,
    state: State,
    restored: bool,
}

impl Vmm {
    fn start(&mut self) -> Result<(), String> {
        match self.state {
            State::Created => {
                if self.restored {
                    self.vm.resume().map_err(|e| e.to_string())?;
                } else {
                    self.vm.start().map_err(|e| e.to_string())?;
                }
                self.state = State::Running;
                Ok(())
            }
            State::Running => Ok(()),
            State::Paused => Err("the VM is paused: use resume".into()),
            State::Exited(_) => Err("the VM has ended".into()),
        }
    }

    fn status(&self) -> Value {
        let mut v = json!({ "state": self.state.name() });
        if let State::Exited(r) = &self.state {
            v["exit_reason"] = serde_json::to_value(r).unwrap_or(Value::Null);
        }
        v
    }
}

impl Handler for Vmm {
    fn handle(&mut self, action: Action) -> Result<Value, String> {
        if let State::Exited(r) = &self.state
            && !matches!(action, Action::Status | Action::Metrics | Action::Stop)
        {
            return Err(format!("the VM has ended ({r:?})"));
        }
        match action {
            Action::Start => self.start().map(|()| self.status()),
            Action::Pause => match self.state {
                State::Paused => Ok(self.status()),
                State::Created => Err("the VM has not started: send start first".into()),
                _ => {
                    self.vm.pause().map_err(|e| e.to_string())?;
                    self.state = State::Paused;
                    Ok(self.status())
                }
            },
            Action::Resume => match self.state {
                State::Running => Ok(self.status()),
                State::Created => self.start().map(|()| self.status()),
                _ => {
                    self.vm.resume().map_err(|e| e.to_string())?;
                    self.state = State::Running;
                    Ok(self.status())
                }
            },
            Action::Snapshot { dir, kind } => {
                if self.state == State::Running {
                    return Err("the VM is running: pause it before taking a snapshot".into());
                }
                std::fs::create_dir_all(&dir)
                    .map_err(|e| format!("creating {}: {e}", dir.display()))?;
                let kind = match kind {
                    control::SnapshotKind::Full => SnapshotKind::Full,
                    control::SnapshotKind::Diff => SnapshotKind::Diff,
                };
                let info = self.vm.snapshot(&dir, kind).map_err(|e| e.to_string())?;
                serde_json::to_value(info).map_err(|e| e.to_string())
            }
            Action::BalloonSetTarget { mib } => {
                self.vm.balloon_set_target(mib).map_err(|e| e.to_string())?;
                Ok(json!({ "target_mib": mib }))
            }
            Action::BalloonStats => {
                let stats = self.vm.balloon_stats().map_err(|e| e.to_string())?;
                serde_json::to_value(stats).map_err(|e| e.to_string())
            }
            Action::Metrics => {
                let mut v = serde_json::to_value(self.vm.metrics()).map_err(|e| e.to_string())?;
                v["state"] = json!(self.state.name());
                if let Some(rss) = rss_bytes() {
                    v["rss_bytes"] = json!(rss);
                }
                Ok(v)
            }
            Action::Stop => {
                let reason = if let State::Exited(r) = &self.state {
                    r.clone()
                } else {
                    self.vm.stop().map_err(|e| e.to_string())?
                };
                self.state = State::Exited(reason);
                Ok(self.status())
            }
            Action::Status => Ok(self.status()),
        }
    }

    fn finished(&mut self) -> bool {
        if let State::Exited(_) = self.state {
            return true;
        }
        if let Some(reason) = self.vm.wait_timeout(Duration::ZERO) {
            match &reason {
                ExitReason::Error(error) => tracing::error!(%error, "the guest failed"),
                _ => tracing::info!(?reason, "the guest ended"),
            }
            self.state = State::Exited(reason);
            return true;
        }
        false
    }
}

/// The process's resident memory, from /proc/self/statm.
fn rss_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = text.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * 4096)
}

fn init_logging(log_file: Option<&Path>) -> anyhow::Result<()> {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt().with_env_filter(filter);
    match log_file {
        Some(p) => {
            let f = std::fs::File::options()
                .create(true)
                .append(true)
                .open(p)
                .with_context(|| format!("opening the log file {}", p.display()))?;
            builder
                .with_ansi(false)
                .with_writer(std::sync::Mutex::new(f))
                .init();
        }
        // Colours only on a terminal: a node passes a log file as standard error.
        None => builder
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .with_writer(std::io::stderr)
            .init(),
    }
    Ok(())
}

fn load_config(path: &Path) -> anyhow::Result<VmConfig> {
    let raw = std::fs::read(path)
        .with_context(|| format!("reading the VM configuration {}", path.display()))?;
    let cfg: VmConfig = serde_json::from_slice(&raw)
        .with_context(|| format!("parsing the VM configuration {}", path.display()))?;
    cfg.validate()
        .with_context(|| format!("invalid VM configuration {}", path.display()))?;
    Ok(cfg)
}

fn run(args: Args) -> anyhow::Result<Option<ExitReason>> {
    init_logging(args.log_file.as_deref())?;
    let cfg = load_config(&args.config)?;
    let (vm, restored) = match &args.restore {
        Some(dir) => (
            Vm::restore(cfg, dir)
                .with_context(|| format!("restoring the VM from {}", dir.display()))?,
            true,
        ),
        None => (Vm::new(cfg).context("building the VM")?, false),
    };
    let server = ControlServer::bind(&args.api_sock)?;
    let mut vmm = Vmm {
        vm,
        state: State::Created,
        restored,
    };
    if args.start {
        vmm.start()
            .map_err(|e| anyhow::anyhow!("starting the VM: {e}"))?;
    }
    match args.seccomp {
        SeccompMode::Strict => {
            let filters =
                agentenv_vmm::seccomp::vmm_filters(seccompiler::SeccompAction::KillProcess)?;
            agentenv_seccomp::install_all_threads(&filters)?;
        }
        SeccompMode::Off => tracing::warn!("seccomp filter off"),
    }
    tracing::info!(
        api = %args.api_sock.display(),
        state = vmm.state.name(),
        restored,
        "VMM ready"
    );
    control::serve(&server, &mut vmm);
    let reason = match &vmm.state {
        State::Exited(r) => Some(r.clone()),
        _ => None,
    };
    if let Some(r) = &reason {
        tracing::info!(reason = ?r, "VMM exiting");
    }
    drop(server);
    Ok(reason)
}

fn main() {
    let args = Args::parse();
    match run(args) {
        Ok(Some(ExitReason::Error(e))) => {
            eprintln!("agentenv-vmm: the guest failed: {e}");
            std::process::exit(2);
        }
        Ok(_) => {}
        Err(e) => {
            // One line: every cause, outermost first.
            let msg: Vec<String> = e.chain().map(|c| c.to_string()).collect();
            eprintln!("agentenv-vmm: {}", msg.join(": "));
            std::process::exit(1);
        }
    }
}
