//! The `aenv` command line: sandboxes, files, templates and snapshots on an AgentENV
//! server (a gateway or a single node), with the credentials written by `aenv auth`.
//!
//! Control-plane calls are REST with `X-API-Key`; exec, the interactive shell and file
//! transfers speak Connect (binary protobuf) to the in-sandbox agent through the same
//! base URL, routed by the `x-agentenv-sandbox-id` and `x-agentenv-target-port` headers.
//!
//! Each command is a module of [`commands`] with its argument struct and its `run`;
//! the REST client is [`api`] with the bodies it sends and reads typed in [`model`];
//! [`shell`], [`files`] and [`process`] hold what the data-plane commands share.

pub mod api;
pub mod archive;
pub mod args;
pub mod commands;
pub mod complete;
pub mod credentials;
pub mod dockerfile;
pub mod files;
pub mod model;
pub mod output;
pub mod process;
pub mod shell;
pub mod term;

use clap::Parser;

use agentenv_guest::client::ClientError;
use api::ApiError;
use credentials::CredentialsError;

pub use commands::Command;

/// The TTL `start`, `connect` and `resume` ask for, in seconds.
pub const DEFAULT_TIMEOUT_SECS: u64 = 300;

/// Errors of the CLI commands.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    #[error(transparent)]
    Credentials(#[from] CredentialsError),
    #[error(transparent)]
    Api(#[from] ApiError),
    #[error("sandbox {0} is paused; run `aenv resume {0}` first")]
    Paused(String),
    #[error("sandbox {id}: {source}")]
    Agent { id: String, source: ClientError },
    #[error("{0}")]
    Usage(String),
    #[error("{what}: {source}")]
    Io {
        what: String,
        source: std::io::Error,
    },
    #[error(transparent)]
    Files(#[from] files::FilesError),
    #[error("{}: {source}", path.display())]
    Dockerfile {
        path: std::path::PathBuf,
        source: dockerfile::DockerfileError,
    },
    #[error(transparent)]
    Shell(#[from] shell::ShellError),
    #[error(
        "the process stream ended without an exit event (the sandbox may have been paused or deleted)"
    )]
    NoExitEvent,
}

/// Maps an I/O error to [`CliError::Io`] saying what was being done.
pub fn io_err(what: &str) -> impl FnOnce(std::io::Error) -> CliError + '_ {
    move |source| CliError::Io {
        what: what.to_string(),
        source,
    }
}

const AFTER_HELP: &str = "\
Examples:
  aenv auth                          # save the server URL and API key
  aenv start base                    # new sandbox from template `base`, interactive shell
  aenv exec <id> uname -a            # run one command
  aenv ls --state running            # list sandboxes
  aenv rm <id>                       # delete a sandbox

Credentials live in $XDG_CONFIG_HOME/aenv/credentials (default ~/.config/aenv/credentials).";

/// The command line of `aenv`.
#[derive(Debug, Parser)]
#[command(name = "aenv", version, about = "AENV CLI: sandboxes, files, templates and snapshots on an AgentENV server", after_help = AFTER_HELP)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

/// Runs a parsed command line; returns the process exit code.
pub async fn run(cli: Cli) -> Result<i32, CliError> {
    commands::run(cli.command).await
}
