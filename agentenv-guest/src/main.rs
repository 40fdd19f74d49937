//! `agentenv-guest`: the in-sandbox agent (envd-compatible). With `--init`
//! it runs as PID 1 and supervises the agent.

use std::net::{IpAddr, SocketAddr};

use anyhow::Context as _;
use clap::Parser;

use agentenv_guest::server::{
    AgentOptions, AgentState, bind_and_serve, inherited_listener, serve_inherited,
};

/// The in-sandbox agent of AgentENV (envd-compatible).
#[derive(Debug, Parser)]
#[command(name = "agentenv-guest", version)]
struct Args {
    /// Port to listen on.
    #[arg(long, env = "AGENTENV_GUEST_PORT", default_value_t = agentenv_guest::DEFAULT_PORT)]
    port: u16,
    /// Address to listen on.
    #[arg(long, env = "AGENTENV_GUEST_ADDR", default_value = "0.0.0.0")]
    addr: IpAddr,
    /// User for calls that name none, until /init sets one (default: the
    /// account the agent runs as).
    #[arg(long, env = "AGENTENV_GUEST_DEFAULT_USER")]
    default_user: Option<String>,
    /// Working directory for processes that name none (default: the user's home).
    #[arg(long, env = "AGENTENV_GUEST_DEFAULT_WORKDIR")]
    default_workdir: Option<String>,
    /// Access token required from the start (otherwise only after /init sets one).
    #[arg(long, env = "AGENTENV_GUEST_ACCESS_TOKEN", hide_env_values = true)]
    access_token: Option<String>,
    /// Let /init set the system clock (on by default in init mode).
    #[arg(long)]
    set_clock: bool,
    /// Run as PID 1: mount /proc, /sys, /dev, /dev/pts, /dev/shm, /tmp as
    /// needed, reap orphans, forward signals, restart the agent if it dies.
    #[arg(long)]
    init: bool,
}

fn main() -> anyhow::Result<()> {
    // No other process of the sandbox, root included, may read or write the agent's
    // memory or descriptors through /proc: for a non-dumpable process that needs
    // CAP_SYS_PTRACE, which sandboxes never hold. (Programs the agent runs are dumpable
    // again after their exec.)
    // SAFETY: prctl(PR_SET_DUMPABLE, 0) takes plain integers.
    unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0) };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    if args.init {
        // The agent runs as our child with the same flags minus --init.
        let mut child_args: Vec<std::ffi::OsString> = std::env::args_os()
            .skip(1)
            .filter(|a| a != "--init")
            .collect();
        if !child_args.iter().any(|a| a == "--set-clock") {
            child_args.push("--set-clock".into());
        }
        let code = agentenv_guest::pid1::run(child_args).context("init mode")?;
        std::process::exit(code);
    }
    // Taken before the runtime opens descriptors of its own.
    let inherited = inherited_listener();
    let opts = AgentOptions {
        default_user: args.default_user,
        default_workdir: args.default_workdir,
        access_token: args.access_token,
        set_clock: args.set_clock,
        accounts: Default::default(),
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    rt.block_on(async move {
        let state = AgentState::new(opts);
        let addr = SocketAddr::new(args.addr, args.port);
        let shutdown_state = state.clone();
        let shutdown = async move {
            let mut term =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
                    .expect("installing the SIGTERM handler");
            tokio::select! {
                _ = term.recv() => {},
                _ = tokio::signal::ctrl_c() => {},
            }
            tracing::info!("stopping");
            shutdown_state.processes.kill_all();
        };
        match inherited {
            Some(l) => serve_inherited(l, state, shutdown).await,
            None => bind_and_serve(addr, state, shutdown).await,
        }
        .context("serving")
    })
}
