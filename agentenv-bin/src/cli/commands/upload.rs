//! `aenv upload`: a local file or directory tree into a sandbox.

use clap::Args;
use clap_complete::ArgValueCandidates;

use crate::cli::api::Api;
use crate::cli::process::agent_for;
use crate::cli::{CliError, complete, files};

/// Upload a file or directory into a sandbox (existing files are replaced).
#[derive(Debug, Args)]
#[command(after_help = "\
Examples:
  aenv upload <id> ./data.csv /home/user/data.csv
  aenv upload <id> ./data.csv /home/user/        # keeps the name
  aenv upload <id> ./project /home/user/          # directory tree -> /home/user/project")]
pub struct UploadArgs {
    #[arg(add = ArgValueCandidates::new(complete::running))]
    pub sandbox_id: String,
    pub local_path: std::path::PathBuf,
    pub remote_path: String,
    /// Act as this user in the sandbox.
    #[arg(long)]
    pub user: Option<String>,
}

/// Uploads through the sandbox's agent.
pub async fn run(api: &Api, args: UploadArgs) -> Result<i32, CliError> {
    let id = &args.sandbox_id;
    let agent = agent_for(api, id, args.user.as_deref()).await?;
    let msg = files::upload(&agent, id, &args.local_path, &args.remote_path).await?;
    println!("{msg}");
    Ok(0)
}
