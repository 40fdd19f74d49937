//! `agentenv-gateway`: the gateway daemon.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use agentenv_core::config::{LoadOptions, Service, resolve_listen_addr};
use agentenv_proxy::{Gateway, GatewayOptions, GrpcSchedulerClient};
use anyhow::Context;
use clap::Parser;

/// The one address clients use: authenticates with the API key, routes
/// sandbox requests to their node through the scheduler, relays streams and
/// WebSockets, and lists sandboxes across the cluster. Serves HTTP and
/// Prometheus metrics.
#[derive(Parser)]
#[command(
    name = "agentenv-gateway",
    version,
    after_help = "The API key comes from AENV_API_KEY, or else from /run/secrets/api-key.\n\nExamples:\n  AENV_API_KEY=$(cat key) agentenv-gateway -config /etc/agentenv/control-plane.json\n  GATEWAY_SCHEDULER_ADDR=10.0.0.5:9090 agentenv-gateway -config cp.json\n\nFlags may be written with one dash (-config) or two (--config)."
)]
struct Args {
    /// The control-plane JSON config (defaults apply when omitted).
    #[arg(long, value_name = "PATH")]
    config: Option<PathBuf>,
}

fn main() -> ExitCode {
    let args = Args::parse_from(agentenv_bin::go_style_args(std::env::args()));
    agentenv_bin::run_daemon("agentenv-gateway", run(args))
}

async fn run(args: Args) -> anyhow::Result<()> {
    let config = agentenv_bin::load_control_plane(
        args.config.as_deref(),
        LoadOptions {
            service: Service::Gateway,
            query_only: false,
        },
    )?;
    let api_key = agentenv_core::api_key::load().context("load API key failed")?;
    let g = config.gateway;
    let http_addr = resolve_listen_addr(&g.http_listen_addr)
        .map_err(anyhow::Error::msg)
        .context("gateway.http_listen_addr")?;
    let metrics_addr = resolve_listen_addr(&g.metrics_listen_addr)
        .map_err(anyhow::Error::msg)
        .context("gateway.metrics_listen_addr")?;
    let scheduler =
        GrpcSchedulerClient::connect_lazy(&g.scheduler_addr, &g.query_only_scheduler_addr)
            .context("connect scheduler failed")?;
    let gateway = Gateway::new(scheduler, GatewayOptions::from_config(&g, api_key))
        .context("init gateway server failed")?;

    let metrics = tokio::net::TcpListener::bind(metrics_addr)
        .await
        .with_context(|| format!("cannot listen on gateway.metrics_listen_addr {metrics_addr}"))?;
    let metrics_local = metrics.local_addr()?;
    // One single-threaded runtime per core, each with its own listener
    // (SO_REUSEPORT) and upstream pool.
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    let server = gateway
        .serve_threads(http_addr, threads, agentenv_bin::shutdown_signal())
        .with_context(|| format!("cannot listen on gateway.http_listen_addr {http_addr}"))?;
    let http_local = server.local_addr();

    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let metrics_task = tokio::spawn(agentenv_core::metrics::serve(
        metrics,
        gateway.metrics().registry(),
        async move {
            let _ = stop_rx.await;
        },
    ));
    tracing::info!(
        http_addr = %http_local,
        metrics_addr = %metrics_local,
        scheduler_addr = %g.scheduler_addr,
        query_only_scheduler_addr = %g.query_only_scheduler_addr,
        proxy_domains = ?g.sandbox_proxy_domains,
        threads,
        "gateway listening"
    );
    server.wait().await;
    let _ = stop_tx.send(());
    let _ = tokio::time::timeout(Duration::from_secs(5), metrics_task).await;
    tracing::info!("gateway stopped");
    Ok(())
}
