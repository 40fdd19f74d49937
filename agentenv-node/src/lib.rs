//! The AgentENV runtime node as a library.

pub mod access;
pub mod api;
pub mod backend;
pub mod clock;
pub mod config;
pub mod daemon;
pub mod dataplane;
pub mod egress;
pub mod host;
pub mod ids;
pub mod lifecycle;
pub mod observe;
pub mod reporter;
pub mod snapshot;
pub mod template;
pub mod timing;
pub mod volume;
