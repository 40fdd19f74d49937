//! `aenv resume`: resume a paused sandbox with a new time to live.

use clap::Args;
use clap_complete::ArgValueCandidates;

use crate::cli::api::Api;
use crate::cli::{CliError, DEFAULT_TIMEOUT_SECS, complete};

/// Resume a paused sandbox.
#[derive(Debug, Args)]
#[command(after_help = "Example:\n  aenv resume <id> --timeout 600")]
pub struct ResumeArgs {
    #[arg(add = ArgValueCandidates::new(complete::paused))]
    pub sandbox_id: String,
    /// New time to live in seconds.
    #[arg(long, default_value_t = DEFAULT_TIMEOUT_SECS)]
    pub timeout: u64,
}

/// Resumes the sandbox (`POST /sandboxes/{id}/connect` with the new TTL).
pub async fn run(api: &Api, args: ResumeArgs) -> Result<i32, CliError> {
    api.connect(&args.sandbox_id, args.timeout).await?;
    println!("Resumed {}", args.sandbox_id);
    Ok(0)
}
