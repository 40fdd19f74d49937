//! `aenv download`: a file or directory tree from a sandbox.

use clap::Args;
use clap_complete::ArgValueCandidates;

use crate::cli::api::Api;
use crate::cli::process::agent_for;
use crate::cli::{CliError, complete, files};

/// Download a file or directory from a sandbox.
#[derive(Debug, Args)]
#[command(after_help = "\
Examples:
  aenv download <id> /home/user/out.txt            # -> ./out.txt
  aenv download <id> /home/user/results ./        # directory tree -> ./results
  aenv download <id> /etc/hosts hosts --force      # replace an existing file")]
pub struct DownloadArgs {
    #[arg(add = ArgValueCandidates::new(complete::running))]
    pub sandbox_id: String,
    pub remote_path: String,
    pub local_path: Option<std::path::PathBuf>,
    #[arg(long)]
    pub user: Option<String>,
    /// Replace existing local files.
    #[arg(long, short)]
    pub force: bool,
}

/// Downloads through the sandbox's agent.
pub async fn run(api: &Api, args: DownloadArgs) -> Result<i32, CliError> {
    let id = &args.sandbox_id;
    let agent = agent_for(api, id, args.user.as_deref()).await?;
    let local = args.local_path.as_deref();
    let msg = files::download(&agent, id, &args.remote_path, local, args.force).await?;
    println!("{msg}");
    Ok(0)
}
