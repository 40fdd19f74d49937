//! The in-sandbox agent of AgentENV, wire-compatible with E2B's envd.
//!
//! Every sandbox runs this agent. Clients (the official E2B SDKs, the `aenv`
//! CLI, the runtime node) reach it over HTTP on port 49983:
//!
//! * Connect RPC (`process.Process`, `filesystem.Filesystem`) over HTTP/1.1
//!   and HTTP/2 without TLS (h2c), with the JSON and the binary protobuf
//!   codecs ([`connect`], [`process`], [`filesystem`]);
//! * plain HTTP: `GET /health`, `POST /init`, `GET /envs`, `GET`/`POST /files`
//!   ([`server`], [`files`]);
//! * a Connect client with the binary codec for the node and the CLI
//!   ([`client`]);
//! * an init mode for running as PID 1 of a sandbox ([`pid1`]).
//!
//! # Running as PID 1 (jail backend)
//!
//! The jail backend starts the agent as the first process of a fresh PID and
//! mount namespace whose root is the sandbox's overlay root:
//!
//! ```text
//! /path/to/agentenv-guest --init [--port 49983] [--default-user root] [--default-workdir /root]
//! ```
//!
//! In init mode the process mounts `/proc`, `/sys`, `/dev` (devtmpfs, falling
//! back to a tmpfs with the basic device nodes), `/dev/pts`, `/dev/shm` and
//! `/tmp` when they are not mounted yet, then runs the agent as its child
//! (the same binary without `--init`, with the remaining flags), reaps every
//! orphaned process, forwards SIGTERM, SIGINT, SIGHUP, SIGUSR1 and SIGUSR2 to
//! the agent, and restarts the agent (after 100 ms, at most every second) if
//! it dies. SIGTERM makes init stop the agent and exit.
//!
//! Environment read by the agent: `AGENTENV_GUEST_PORT` (same as `--port`),
//! `AGENTENV_GUEST_ACCESS_TOKEN` (an access token enforced before any
//! `/init`), `AGENTENV_GUEST_DEFAULT_USER`, `AGENTENV_GUEST_DEFAULT_WORKDIR`,
//! `RUST_LOG` (log filter). The environment the agent itself gets is the base
//! environment of every process it starts (plus what `/init` adds). `PATH`
//! should be set; when it is not, a standard one is used.

pub mod client;
pub mod connect;
pub mod fileio;
pub mod files;
pub mod filesystem;
pub mod paths;
pub mod pid1;
pub mod process;
pub mod server;
pub mod users;

/// The envd version whose behaviour this agent implements; a control plane
/// reports it as `envdVersion` so that SDKs enable the matching features:
/// octet-stream and gzip uploads (0.5.7), file metadata (0.6.2), entries in
/// watch events (0.6.3), the network-mount watch option (0.6.4).
pub const ENVD_VERSION: &str = "0.6.4";

/// The port envd listens on, which SDKs assume.
pub const DEFAULT_PORT: u16 = 49983;

/// Generated protobuf types with serde support following the protobuf JSON
/// mapping.
pub mod proto {
    #![allow(missing_docs, clippy::all)]

    /// `package process`.
    pub mod process {
        include!(concat!(env!("OUT_DIR"), "/process.rs"));
        include!(concat!(env!("OUT_DIR"), "/process.serde.rs"));
    }

    /// `package filesystem`.
    pub mod filesystem {
        include!(concat!(env!("OUT_DIR"), "/filesystem.rs"));
        include!(concat!(env!("OUT_DIR"), "/filesystem.serde.rs"));
    }
}
