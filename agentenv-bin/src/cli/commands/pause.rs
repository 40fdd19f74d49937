//! `aenv pause`: pause a running sandbox.

use clap::Args;
use clap_complete::ArgValueCandidates;

use crate::cli::api::Api;
use crate::cli::{CliError, complete};

/// Pause a sandbox (memory and files are kept).
#[derive(Debug, Args)]
#[command(after_help = "Example:\n  aenv pause <id>")]
pub struct PauseArgs {
    #[arg(add = ArgValueCandidates::new(complete::running))]
    pub sandbox_id: String,
}

/// Pauses the sandbox.
pub async fn run(api: &Api, args: PauseArgs) -> Result<i32, CliError> {
    api.pause(&args.sandbox_id).await?;
    println!("Paused {}", args.sandbox_id);
    Ok(0)
}
