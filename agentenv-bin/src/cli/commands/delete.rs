//! `aenv rm`: delete sandboxes, one after the other (the first failure stops).

use clap::Args;
use clap_complete::ArgValueCandidates;

use crate::cli::api::Api;
use crate::cli::{CliError, complete};

/// Delete sandboxes.
#[derive(Debug, Args)]
#[command(
    visible_alias = "rm",
    after_help = "Examples:\n  aenv rm <id>\n  aenv rm <id1> <id2>"
)]
pub struct DeleteArgs {
    #[arg(required = true, add = ArgValueCandidates::new(complete::any))]
    pub sandbox_ids: Vec<String>,
}

/// Deletes each sandbox in turn.
pub async fn run(api: &Api, args: DeleteArgs) -> Result<i32, CliError> {
    for id in args.sandbox_ids {
        api.delete(&id).await?;
        println!("Deleted sandbox {id}");
    }
    Ok(0)
}
