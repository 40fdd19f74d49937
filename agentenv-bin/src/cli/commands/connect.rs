//! `aenv connect`: an interactive shell in a sandbox (resumed when paused).

use clap::Args;
use clap_complete::ArgValueCandidates;

use crate::cli::api::Api;
use crate::cli::{CliError, complete, shell};

/// Attach an interactive shell to a sandbox (resumes it when paused).
#[derive(Debug, Args)]
#[command(
    visible_alias = "cn",
    after_help = "\
Examples:
  aenv cn <id>
Exit codes: the shell's exit code; 130 when the sandbox is paused, deleted or lost."
)]
pub struct ConnectArgs {
    #[arg(add = ArgValueCandidates::new(complete::any))]
    pub sandbox_id: String,
}

/// Attaches; the exit code is the shell's.
pub async fn run(api: &Api, args: ConnectArgs) -> Result<i32, CliError> {
    Ok(shell::attach(api, &args.sandbox_id).await?)
}
