//! One module per `aenv` command, each with its argument struct (its help text included)
//! and its `run`; [`Command`] lists them in the order `aenv --help` shows.

pub mod auth;
pub mod build;
pub mod completion;
pub mod connect;
pub mod delete;
pub mod download;
pub mod exec;
pub mod list;
pub mod node;
pub mod node_move;
pub mod pause;
pub mod pull;
pub mod resume;
pub mod snapshot;
pub mod start;
pub mod template;
pub mod timeout;
pub mod upload;

use clap::Subcommand;

use super::CliError;
use super::api::Api;
use super::credentials;

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    Auth(auth::AuthArgs),
    List(list::ListArgs),
    Start(start::StartArgs),
    Connect(connect::ConnectArgs),
    Exec(exec::ExecArgs),
    Pause(pause::PauseArgs),
    Resume(resume::ResumeArgs),
    Timeout(timeout::TimeoutArgs),
    Delete(delete::DeleteArgs),
    Upload(upload::UploadArgs),
    Download(download::DownloadArgs),
    Pull(pull::PullArgs),
    Build(build::BuildArgs),
    /// Templates (list, delete, watch a build).
    #[command(
        visible_alias = "templates",
        subcommand,
        after_help = "Examples:\n  aenv template ls\n  aenv template watch ubuntu\n  aenv template rm ubuntu"
    )]
    Template(template::TemplateCmd),
    /// Snapshots of sandboxes.
    #[command(
        visible_alias = "snap",
        subcommand,
        after_help = "Examples:\n  aenv snapshot create <id> --name before-upgrade\n  aenv snapshot ls --sandbox-id <id>\nDelete a snapshot with `aenv template rm <snapshot>`."
    )]
    Snapshot(snapshot::SnapshotCmd),
    /// Runtime nodes (list, drain, undrain).
    #[command(
        visible_alias = "nodes",
        subcommand,
        after_help = "Examples:\n  aenv node ls\n  aenv node drain node-b\n  aenv node undrain node-b"
    )]
    Node(node::NodeCmd),
    Completion(completion::CompletionArgs),
}

/// Runs one command; returns the process exit code. Every command but `auth` and
/// `completion` needs the saved credentials.
pub async fn run(command: Command) -> Result<i32, CliError> {
    let api = match command {
        Command::Auth(a) => return auth::run(a).await,
        Command::Completion(a) => return completion::run(a),
        _ => Api::new(&credentials::load()?)?,
    };
    match command {
        Command::Auth(_) | Command::Completion(_) => Ok(0),
        Command::List(a) => list::run(&api, a).await,
        Command::Start(a) => start::run(&api, a).await,
        Command::Connect(a) => connect::run(&api, a).await,
        Command::Exec(a) => exec::run(&api, a).await,
        Command::Pause(a) => pause::run(&api, a).await,
        Command::Resume(a) => resume::run(&api, a).await,
        Command::Timeout(a) => timeout::run(&api, a).await,
        Command::Delete(a) => delete::run(&api, a).await,
        Command::Upload(a) => upload::run(&api, a).await,
        Command::Download(a) => download::run(&api, a).await,
        Command::Pull(a) => pull::run(&api, a).await,
        Command::Node(c) => node::run(&api, c).await,
        Command::Build(a) => build::run(&api, a).await,
        Command::Template(c) => template::run(&api, c).await,
        Command::Snapshot(c) => snapshot::run(&api, c).await,
    }
}
