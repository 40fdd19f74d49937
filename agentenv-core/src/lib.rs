//! Shared vocabulary of AgentENV: the control-plane config and its duration
//! syntax, logging and metrics setup, the JSON error body, and the generated
//! protobuf types.

pub mod api_key;
pub mod config;
pub mod duration;
pub mod error;
pub mod logging;
pub mod metrics;
pub mod proto;
pub mod storage;

pub use config::{Config, ConfigError, LoadOptions, Loaded, Service};
