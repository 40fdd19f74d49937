//! `agentenv-node`: the runtime node daemon (the `aenv` service).

use std::path::PathBuf;
use std::process::ExitCode;

use agentenv_core::logging::{LogFormat, LogLevel};
use agentenv_node::config::NodeConfig;
use agentenv_node::daemon::Daemon;
use anyhow::Context;
use clap::Parser;

/// Runs agent sandboxes on this host and serves the E2B-compatible REST API and the
/// sandbox data plane on one address (API_ADDR).
#[derive(Parser)]
#[command(
    name = "agentenv-node",
    version,
    after_help = "Configuration comes from the environment (as in /etc/default/aenv): API_ADDR, AENV_NODE_ID, AENV_API_KEY, AENV_SANDBOX_ACCESS_TOKEN_HASH_SEED, AENV_HOME_PATH, AENV_BACKEND=auto|jail|microvm, AENV_GUEST_BINARY_PATH, AENV_OBSERVABILITY_SCHEDULER_REPORT_ENABLED, AENV_OBSERVABILITY_SCHEDULER_ENDPOINT=http://host:port, AENV_OBSERVABILITY_REPORT_INTERVAL_SECS; environment values override the TOML file.\n\nFlags may be written with one dash (-config) or two (--config)."
)]
struct Args {
    /// A TOML config file (also AENV_CONFIG_PATH).
    #[arg(long, value_name = "PATH")]
    config: Option<PathBuf>,
}

fn main() -> ExitCode {
    let args = Args::parse_from(agentenv_bin::go_style_args(std::env::args()));
    agentenv_bin::run_daemon("agentenv-node", run(args))
}

async fn run(args: Args) -> anyhow::Result<()> {
    let format = std::env::var("AENV_LOG_FORMAT")
        .or_else(|_| std::env::var("LOG_FORMAT"))
        .map_or(LogFormat::Auto, |f| match f.as_str() {
            "compact" | "pretty" => LogFormat::Console,
            _ => LogFormat::from(f),
        });
    agentenv_core::logging::init(&LogLevel::Info, &format).map_err(anyhow::Error::msg)?;
    let cfg = NodeConfig::from_env(args.config.as_deref()).context("invalid configuration")?;
    let node_id = cfg.node_id.clone();
    let daemon = Daemon::start(cfg).await.context("node start failed")?;
    tracing::info!(
        api_addr = %daemon.local_addr(),
        node_id = %node_id,
        "node listening"
    );
    daemon.run(agentenv_bin::shutdown_signal()).await;
    Ok(())
}
