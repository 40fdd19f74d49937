//! `aenv timeout`: set a sandbox's remaining time to live.

use clap::Args;
use clap_complete::ArgValueCandidates;

use crate::cli::api::Api;
use crate::cli::{CliError, complete};

/// Set a sandbox's remaining time to live.
#[derive(Debug, Args)]
#[command(after_help = "Example:\n  aenv timeout <id> 3600")]
pub struct TimeoutArgs {
    #[arg(add = ArgValueCandidates::new(complete::running))]
    pub sandbox_id: String,
    pub seconds: u64,
}

/// Sets the sandbox's time to live.
pub async fn run(api: &Api, args: TimeoutArgs) -> Result<i32, CliError> {
    api.set_timeout(&args.sandbox_id, args.seconds).await?;
    println!("Timeout for {} set to {}s", args.sandbox_id, args.seconds);
    Ok(0)
}
