//! `agentenv-scheduler`: the scheduler daemon.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use agentenv_core::config::{Config, LoadOptions, Service, resolve_listen_addr};
use agentenv_sched::{Scheduler, SchedulerService};
use anyhow::Context;
use clap::Parser;

/// Places AgentENV sandboxes on runtime nodes: holds the node list, takes
/// heartbeats, tracks which node owns which sandbox. Serves scheduler.v1 gRPC
/// and Prometheus metrics.
#[derive(Parser)]
#[command(
    name = "agentenv-scheduler",
    version,
    after_help = "Examples:\n  agentenv-scheduler -config /etc/agentenv/control-plane.json\n  SCHEDULER_STRATEGY=least_loaded agentenv-scheduler -config cp.json\n\nSIGHUP (systemctl reload agentenv-scheduler) re-reads the config file: a valid file's\nscheduler.nodes list is applied at once (removed nodes keep serving their sandboxes\nuntil those are gone); an invalid file changes nothing. Other keys need a restart.\n\nFlags may be written with one dash (-config) or two (--config)."
)]
struct Args {
    /// The control-plane JSON config (defaults apply when omitted).
    #[arg(long, value_name = "PATH")]
    config: Option<PathBuf>,
    /// Serve only LookupNode, reading bindings from the Redis in
    /// scheduler.redis_addr that a primary scheduler writes (a replica for
    /// gateways' query_only_scheduler_addr); every other call is UNIMPLEMENTED.
    #[arg(long)]
    query_only: bool,
}

/// How long in-flight calls may take to finish after a shutdown signal.
const DRAIN: Duration = Duration::from_secs(10);

fn main() -> ExitCode {
    let args = Args::parse_from(agentenv_bin::go_style_args(std::env::args()));
    agentenv_bin::run_daemon("agentenv-scheduler", run(args))
}

async fn run(args: Args) -> anyhow::Result<()> {
    let options = LoadOptions {
        service: Service::Scheduler,
        query_only: args.query_only,
    };
    let config = agentenv_bin::load_control_plane(args.config.as_deref(), options)?;
    // Installed before anything is served, so an early SIGHUP is not fatal.
    let hangup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())
        .context("install SIGHUP handler")?;
    let s = config.scheduler.clone();
    let grpc_addr = resolve_listen_addr(&s.grpc_listen_addr).map_err(anyhow::Error::msg)?;
    // Config loading refused an exposed scheduler without a credential unless the
    // operator chose so; say so once.
    if s.cluster_token_file.trim().is_empty()
        && !agentenv_core::config::is_loopback_listen_addr(&s.grpc_listen_addr)
    {
        tracing::warn!(
            grpc_listen_addr = %s.grpc_listen_addr,
            "scheduler.insecure_no_auth: the scheduler is reachable from other hosts without a cluster credential; anyone who reaches it can send heartbeats and bindings"
        );
    }
    let metrics_addr = resolve_listen_addr(&s.metrics_listen_addr).map_err(anyhow::Error::msg)?;
    let scheduler = Scheduler::builder(s.clone())
        .query_only(args.query_only)
        .build_async()
        .await?;
    let binding_store = if s.redis_addr.trim().is_empty() {
        "memory"
    } else {
        "redis"
    };

    let grpc = tokio::net::TcpListener::bind(grpc_addr)
        .await
        .with_context(|| format!("cannot listen on scheduler.grpc_listen_addr {grpc_addr}"))?;
    let metrics = tokio::net::TcpListener::bind(metrics_addr)
        .await
        .with_context(|| {
            format!("cannot listen on scheduler.metrics_listen_addr {metrics_addr}")
        })?;
    let reload_task = tokio::spawn(reload_on_hangup(
        hangup,
        args.config.clone(),
        options,
        config,
        scheduler.service(),
    ));
    let grpc_local = grpc.local_addr()?;
    let metrics_local = metrics.local_addr()?;

    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let wait_stop = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|stop| *stop).await;
    };
    let metrics_task = tokio::spawn(agentenv_core::metrics::serve(
        metrics,
        scheduler.metrics_registry(),
        wait_stop(stop_rx.clone()),
    ));
    tracing::info!(
        grpc_addr = %grpc_local,
        metrics_addr = %metrics_local,
        strategy = %s.strategy,
        nodes = s.nodes.len(),
        query_only = args.query_only,
        binding_store,
        "scheduler listening"
    );
    let server = scheduler.serve(grpc, wait_stop(stop_rx));
    tokio::pin!(server);
    tokio::select! {
        result = &mut server => {
            result.context("gRPC server failed")?;
            return Ok(());
        }
        _ = agentenv_bin::shutdown_signal() => {}
    }
    let _ = stop_tx.send(true);
    match tokio::time::timeout(DRAIN, &mut server).await {
        Ok(result) => result.context("gRPC server failed")?,
        Err(_) => {
            tracing::warn!("in-flight calls did not finish within {DRAIN:?}; stopping anyway")
        }
    }
    reload_task.abort();
    let _ = tokio::time::timeout(Duration::from_secs(5), metrics_task).await;
    tracing::info!("scheduler stopped");
    Ok(())
}

/// On every SIGHUP: loads and validates the whole config again (same file,
/// same environment overrides) and applies its node list; a config that does
/// not load changes nothing.
async fn reload_on_hangup(
    mut hangup: tokio::signal::unix::Signal,
    path: Option<PathBuf>,
    options: LoadOptions,
    mut running: Config,
    service: SchedulerService,
) {
    while hangup.recv().await.is_some() {
        tracing::info!("SIGHUP received, reloading the config");
        let loaded = match Config::load(path.as_deref(), options) {
            Ok(l) => l,
            Err(e) => {
                service.reload_failed(&e);
                continue;
            }
        };
        for w in &loaded.warnings {
            tracing::warn!("{w}");
        }
        let new = loaded.config;
        if new.log_level != running.log_level || new.log_format != running.log_format {
            tracing::warn!(
                "config reload: log_level/log_format changed but only take effect after a restart of the scheduler"
            );
        }
        service.reload_config(&running.scheduler, &new.scheduler);
        running.scheduler.nodes = new.scheduler.nodes;
    }
}
