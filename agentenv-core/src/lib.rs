//! Shared vocabulary of AgentENV: the control-plane config and its duration
//! syntax, logging and metrics setup, the JSON error body, and the generated
//! protobuf types.

#![forbid(unsafe_code)]

pub mod api_key;
mod choice;
pub mod cluster_auth;
pub mod config;
pub mod cpu_template;
pub mod duration;
pub mod error;
pub mod idempotency;
pub mod logging;
pub mod metrics;
pub mod proto;
pub mod serving;
pub mod storage;
pub mod tls;

pub use config::{Config, ConfigError, LoadOptions, Loaded, Service};
