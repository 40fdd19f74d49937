//! The gateway mounted inside another service: `/admin/*` is answered by the
//! host service, everything else goes to the gateway. The scheduler runs in
//! the same process and is called directly (no gRPC hop).
//!
//! `cargo run -p agentenv-proxy --example gateway_embedded` then, in another shell:
//! `curl -i localhost:8088/admin/hello` and `curl -i localhost:8088/health`.

use std::convert::Infallible;
use std::sync::Arc;

use agentenv_core::config::{GatewayConfig, NodeConfig, SchedulerConfig};
use agentenv_proxy::body::full;
use agentenv_proxy::{Gateway, GatewayOptions, InProcessScheduler};
use hyper::body::Incoming;
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let scheduler = agentenv_sched::Scheduler::builder(SchedulerConfig {
        nodes: vec![NodeConfig {
            id: "node-a".into(),
            endpoint: "http://127.0.0.1:8000".into(),
        }],
        ..SchedulerConfig::default()
    })
    .build()?;
    let gateway = Gateway::new(
        InProcessScheduler::new(Arc::new(scheduler.service())),
        GatewayOptions::from_config(
            &GatewayConfig::default(),
            "example_api_key_0123456789abcdef0123",
        ),
    )?;

    let listener = tokio::net::TcpListener::bind("127.0.0.1:8088").await?;
    println!("listening on http://{}", listener.local_addr()?);
    loop {
        let (stream, remote) = listener.accept().await?;
        stream.set_nodelay(true)?;
        let gateway = gateway.clone();
        tokio::spawn(async move {
            let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
                let gateway = gateway.clone();
                async move {
                    if req.uri().path().starts_with("/admin/") {
                        return Ok::<_, Infallible>(Response::new(full(
                            "answered by the host service\n",
                        )));
                    }
                    // Everything else: the gateway, with the client's address
                    // for X-Forwarded-For.
                    Ok(gateway.handle(req, remote).await)
                }
            });
            let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                .serve_connection_with_upgrades(TokioIo::new(stream), svc)
                .await;
        });
    }
}
