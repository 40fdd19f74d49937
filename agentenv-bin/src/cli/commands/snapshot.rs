//! `aenv snapshot create|ls`: snapshots of sandboxes.

use clap::Subcommand;
use clap_complete::ArgValueCandidates;
use http::Method;

use crate::cli::api::{self, Api};
use crate::cli::args::OutputOpt;
use crate::cli::model::{Listed, NewSnapshot, SnapshotCreated, SnapshotInfo};
use crate::cli::{CliError, complete, io_err, output};

/// `aenv snapshot` subcommands.
#[derive(Debug, Subcommand)]
pub enum SnapshotCmd {
    /// Snapshot a sandbox.
    #[command(after_help = "Example:\n  aenv snapshot create <id> --name my-snap")]
    Create {
        #[arg(add = ArgValueCandidates::new(complete::running))]
        sandbox_id: String,
        #[arg(long)]
        name: Option<String>,
    },
    /// List snapshots (every page).
    #[command(
        visible_alias = "ls",
        after_help = "Example:\n  aenv snapshot ls --sandbox-id <id>"
    )]
    List {
        #[arg(long)]
        sandbox_id: Option<String>,
        #[command(flatten)]
        output: OutputOpt,
    },
}

/// Runs one snapshot subcommand.
pub async fn run(api: &Api, cmd: SnapshotCmd) -> Result<i32, CliError> {
    match cmd {
        SnapshotCmd::Create { sandbox_id, name } => {
            let path = format!("/sandboxes/{}/snapshots", api::seg(&sandbox_id));
            let created: Option<SnapshotCreated> = api
                .send(Method::POST, &path, Some(&NewSnapshot { name }))
                .await?;
            let created = created.unwrap_or_default();
            println!(
                "Created snapshot {}",
                created.snapshot_id.as_deref().unwrap_or("?")
            );
            if let Some(r) = created.image_ref {
                println!("Image: {r}");
            }
            Ok(0)
        }
        SnapshotCmd::List { sandbox_id, output } => {
            let mut q = vec![("limit".to_string(), "100".to_string())];
            if let Some(s) = sandbox_id {
                q.push(("sandboxID".into(), s));
            }
            let all: Vec<Listed<SnapshotInfo>> = api.all_pages("/snapshots", &q).await?;
            output::snapshots(&all, output.format()).map_err(io_err("writing the list"))?;
            Ok(0)
        }
    }
}
