//! Pieces shared by the AgentENV binaries: Go-style flags and signal handling, the
//! `aenv` command line ([`cli`]), `agentenv up` ([`up`]) and the one small HTTP client of
//! `agentenv up` and the cross-process tests ([`http_client`]).

pub mod cli;
pub mod http_client;
pub mod pki;
pub mod up;

/// Rewrites Go-style single-dash long flags (`-config x`, `-query-only`) to
/// the double-dash form clap parses. Single-letter flags and values are left
/// alone, and everything after `--` is passed through.
pub fn go_style_args<I: IntoIterator<Item = String>>(args: I) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = false;
    for a in args {
        if rest || out.is_empty() {
            out.push(a);
            continue;
        }
        if a == "--" {
            rest = true;
            out.push(a);
            continue;
        }
        let is_go_long = a.starts_with('-')
            && !a.starts_with("--")
            && a.len() > 2
            && a.as_bytes()[1].is_ascii_alphabetic();
        out.push(if is_go_long { format!("-{a}") } else { a });
    }
    out
}

/// Runs a daemon's async `main` on a multi-threaded runtime. A failure is
/// printed as one line, `<name>: <error and its causes>`, and exits 1.
pub fn run_daemon<F>(name: &str, main: F) -> std::process::ExitCode
where
    F: std::future::Future<Output = anyhow::Result<()>>,
{
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("{name}: cannot start the async runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    match runtime.block_on(main) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{name}: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// The control-plane config of the scheduler or the gateway: loaded from `path` (with
/// the environment's overrides), logging started as it says, its warnings logged.
pub fn load_control_plane(
    path: Option<&std::path::Path>,
    options: agentenv_core::config::LoadOptions,
) -> anyhow::Result<agentenv_core::config::Config> {
    use anyhow::Context;
    let loaded =
        agentenv_core::config::Config::load(path, options).context("load config failed")?;
    let config = loaded.config;
    agentenv_core::logging::init(&config.log_level, &config.log_format)
        .map_err(anyhow::Error::msg)?;
    for w in &loaded.warnings {
        tracing::warn!("{w}");
    }
    Ok(config)
}

/// Resolves when the process receives SIGINT or SIGTERM.
pub async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).expect("install SIGTERM handler");
    let mut int = signal(SignalKind::interrupt()).expect("install SIGINT handler");
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM received, shutting down"),
        _ = int.recv() => tracing::info!("SIGINT received, shutting down"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(v: &[&str]) -> Vec<String> {
        go_style_args(v.iter().map(|s| s.to_string()))
    }

    #[test]
    fn single_dash_long_flags_become_double_dash() {
        assert_eq!(
            args(&["bin", "-config", "/etc/x.json", "-query-only"]),
            ["bin", "--config", "/etc/x.json", "--query-only"]
        );
        assert_eq!(args(&["bin", "-config=/x"]), ["bin", "--config=/x"]);
        assert_eq!(args(&["bin", "--config", "-h"]), ["bin", "--config", "-h"]);
        assert_eq!(args(&["bin", "--", "-config"]), ["bin", "--", "-config"]);
    }
}
