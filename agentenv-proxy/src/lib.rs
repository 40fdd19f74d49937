//! The AgentENV gateway as a library: API-key authentication, routing by
//! host, path, header or placement through a scheduler, a streaming reverse
//! proxy with WebSocket upgrades, and the cluster-wide sandbox list.
//!
//! A [`Gateway`] is built from a [`SchedulerClient`] and [`GatewayOptions`];
//! run it with [`Gateway::serve`] (which adds an HTTP/1.1 fast lane for
//! ordinary proxied requests), or mount [`Gateway::service`] in another
//! hyper server next to other routes.

#![forbid(unsafe_code)]

pub mod body;
pub mod client;
pub mod cluster_list;
mod console;
pub mod forward;
pub mod hint;
pub mod host_route;
pub mod metrics;
pub mod nodes;
pub mod pool;
pub mod route_cache;
pub mod routing;
pub mod server;

pub use client::{ClientError, GrpcSchedulerClient, InProcessScheduler, SchedulerClient};
pub use metrics::GatewayMetrics;
pub use server::{
    ClientLimits, ClientTls, Gateway, GatewayError, GatewayOptions, GatewayService, ServeHandle,
};
