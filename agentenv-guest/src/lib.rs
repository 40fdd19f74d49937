//! The in-sandbox agent of AgentENV, wire-compatible with E2B's envd.
//!
//! Every sandbox runs this agent. Clients (the official E2B SDKs, the `aenv`
//! CLI, the runtime node) reach it over HTTP on port 49983:
//!
//! * Connect RPC (`process.Process`, `filesystem.Filesystem`) over HTTP/1.1
//!   and HTTP/2 without TLS (h2c), with the JSON and the binary protobuf
//!   codecs ([`connect`], [`process`], [`filesystem`]);
//! * plain HTTP: `GET /health`, `POST /init`, `GET /envs`, `GET /metrics`,
//!   `GET`/`POST /files`, `POST /files/compose`
//!   ([`server`], [`files`]), with the shared state in [`state`];
//! * a Connect client with the binary codec for the node and the CLI
//!   ([`client`]);
//! * an init mode for running as PID 1 of a sandbox ([`pid1`]).
//!
//! # Running as PID 1 (jail backend)
//!
//! The jail backend starts the agent as the first process of a fresh PID and
//! mount namespace (private mount propagation) whose root is the sandbox's
//! overlay root, inside the sandbox's network namespace:
//!
//! ```text
//! /path/to/agentenv-guest --init [--addr 0.0.0.0] [--port 49983] \
//!     [--default-user root] [--default-workdir /root] [--access-token T]
//! ```
//!
//! In init mode the process, being PID 1, mounts a fresh `/proc`, then
//! `/sys` (skipped with a warning when the kernel refuses it), `/dev` when
//! the root has no `/dev/null` (a tmpfs with null, zero, full, random,
//! urandom, tty and the fd links, never the host's devtmpfs),
//! `/dev/pts` (a new devpts instance, `/dev/ptmx` linked to it), `/dev/shm`,
//! and a tmpfs on `/tmp` if `/tmp` is not writable; whatever is already
//! mounted is left alone. It then runs the agent as its child (the same
//! binary, the same flags without `--init`, plus `--set-clock` so `/init`
//! can set the clock), reaps every orphan, forwards SIGTERM, SIGINT, SIGHUP,
//! SIGUSR1 and SIGUSR2 to the agent, and restarts the agent (after 100 ms,
//! at most once a second) if it dies. SIGTERM or SIGINT makes init stop the
//! agent (SIGKILL after 5 s) and exit with 0.
//!
//! The binary is statically linked (`build-static.sh`) and never calls NSS:
//! users and groups come from the root's `/etc/passwd` and `/etc/group`; a
//! root without them still works for the agent's own account.
//!
//! Environment read by the agent: `AGENTENV_GUEST_LISTEN_FD` (an inherited
//! listening socket served instead of `--addr`/`--port`, see [`LISTEN_FD_ENV`]),
//! `AGENTENV_GUEST_PORT`, `AGENTENV_GUEST_ADDR`,
//! `AGENTENV_GUEST_ACCESS_TOKEN` (a token enforced before any `/init`),
//! `AGENTENV_GUEST_DEFAULT_USER`, `AGENTENV_GUEST_DEFAULT_WORKDIR` (the same
//! as the flags), `RUST_LOG` (log filter, default `info`, logs on stderr).
//! The agent's own environment is the base environment of every process it
//! starts, with `/init`'s `envVars`, then the request's `envs` on top; `PATH`
//! falls back to a standard one when unset.
//!
//! # Access token and `/init`
//!
//! `POST /init` takes `{envVars?, accessToken?, defaultUser?, defaultWorkdir?,
//! timestamp?}` (other keys ignored) and answers 204. Once a token is set,
//! every request but `GET /health` needs `X-Access-Token` (compared in
//! constant time) — `/init` itself included — or, for `/files`, a signed URL
//! (`signature=v1_…`, optional `signature_expiration`) as the E2B SDKs make.

// The modules form layers, each importing only those below it:
//
//   server            routing, /init, /envs, /health, /metrics, serving
//   fastpath          the zero-copy upload path in front of hyper
//   process, filesystem, files   the handlers
//   state             AgentState and what hangs off it (process table,
//                     watchers, access checks)
//   responses, connect, pty, signal, query, paths, users, fileio, splice,
//   rewind, metrics, wkt          leaves
//
// The client (`client`, with `rawfile`) sits beside the server and shares
// only the leaves (`connect`, `fileio`, `query`, `splice`) with it.
pub mod client;
pub mod connect;
pub mod devices;
mod fastpath;
pub mod fileio;
pub mod files;
pub mod filesystem;
pub mod metrics;
pub mod paths;
pub mod pid1;
pub mod process;
mod pty;
mod query;
mod rawfile;
mod responses;
pub mod rewind;
pub mod server;
mod signal;
mod splice;
pub mod state;
pub mod users;
pub mod wkt;

/// The envd version whose behaviour this agent implements; a control plane
/// reports it as `envdVersion` so that SDKs enable the matching features:
/// octet-stream and gzip uploads (0.5.7), file metadata (0.6.2), entries in
/// watch events (0.6.3), the network-mount watch option (0.6.4).
pub const ENVD_VERSION: &str = "0.6.4";

/// The port envd listens on, which SDKs assume.
pub const DEFAULT_PORT: u16 = 49983;

/// The variable naming a listening TCP socket the agent inherits and serves instead
/// of binding its own (the jail makes it before the agent runs, so a client's first
/// connection waits in its backlog rather than being refused). Init mode keeps it open
/// for every start of the agent; the agent closes it on exec of the processes it runs.
pub const LISTEN_FD_ENV: &str = "AGENTENV_GUEST_LISTEN_FD";

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
