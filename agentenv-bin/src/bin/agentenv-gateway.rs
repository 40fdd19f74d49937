//! `agentenv-gateway`: the gateway daemon.

use std::path::{Path, PathBuf};
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
    let link = agentenv_core::cluster_auth::SchedulerLink::from_config(
        &g.cluster_token_file,
        &g.scheduler_tls,
    )
    .context("gateway.cluster_token_file / gateway.scheduler_tls")?;
    let scheduler = GrpcSchedulerClient::connect_lazy_with(
        &g.scheduler_addr,
        &g.query_only_scheduler_addr,
        &link,
    )
    .context("connect scheduler failed")?;
    let mut gateway = Gateway::new(scheduler, GatewayOptions::from_config(&g, api_key))
        .context("init gateway server failed")?;
    if g.node_tls.enabled() {
        let identity = g
            .node_tls
            .identity()
            .map(|(c, k)| (Path::new(c), Path::new(k)));
        let tls = agentenv_core::tls::client_config(
            Path::new(g.node_tls.ca_file.trim()),
            identity,
            &[b"http/1.1"],
        )
        .context("gateway.node_tls")?;
        gateway = gateway.with_upstream_tls(tls);
    }
    let mut reloading = None;
    if g.tls.enabled() {
        let cert = agentenv_core::tls::ReloadingCert::load(
            Path::new(g.tls.cert_file.trim()),
            Path::new(g.tls.key_file.trim()),
        )
        .context("gateway.tls")?;
        let client_ca = Some(g.tls.client_ca_file.trim())
            .filter(|p| !p.is_empty())
            .map(Path::new);
        let tls = agentenv_core::tls::server_config(cert.clone(), client_ca, &[b"h2", b"http/1.1"])
            .context("gateway.tls")?;
        gateway = gateway.with_tls(tls);
        reloading = Some(cert);
    }
    if let Some(cert) = reloading {
        // SIGHUP reads the certificate and key again; open connections keep theirs.
        let mut hup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())
            .context("installing the SIGHUP handler")?;
        tokio::spawn(async move {
            while hup.recv().await.is_some() {
                match cert.reload() {
                    Ok(()) => tracing::info!("reloaded the TLS certificate (SIGHUP)"),
                    Err(e) => {
                        tracing::error!(error = %e, "TLS certificate reload failed; the old certificate stays in use")
                    }
                }
            }
        });
    }

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
        tls = g.tls.enabled(),
        "gateway listening"
    );
    server.wait().await;
    let _ = stop_tx.send(());
    let _ = tokio::time::timeout(Duration::from_secs(5), metrics_task).await;
    tracing::info!("gateway stopped");
    Ok(())
}
