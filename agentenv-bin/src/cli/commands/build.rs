//! `aenv build`: a template build from a Dockerfile; does not wait.

use clap::Args;

use super::template::create_and_build;
use crate::cli::api::Api;
use crate::cli::args::TemplateSize;
use crate::cli::model::BuildRequest;
use crate::cli::{CliError, dockerfile};

/// Start a template build from a Dockerfile (RUN, ENV, ARG, WORKDIR, USER, CMD,
/// ENTRYPOINT); does not wait.
#[derive(Debug, Args)]
#[command(after_help = "\
Examples:
  aenv build ./Dockerfile --name my-env
  aenv build ./Dockerfile --name my-env --image ubuntu:24.04 --cpu 2 --memory 2048
  aenv template watch <template-id>               # follow the build
COPY and ADD are not supported yet; EXPOSE, VOLUME and LABEL are ignored.")]
pub struct BuildArgs {
    pub dockerfile: std::path::PathBuf,
    /// Template name.
    #[arg(long, required = true)]
    pub name: String,
    #[command(flatten)]
    pub size: TemplateSize,
    /// Base image (overrides the Dockerfile's first usable FROM).
    #[arg(long, visible_alias = "user-image")]
    pub image: Option<String>,
}

/// Reads the Dockerfile, creates the template and starts its build.
pub async fn run(api: &Api, args: BuildArgs) -> Result<i32, CliError> {
    let path = args.dockerfile.as_path();
    let text = std::fs::read_to_string(path).map_err(|source| CliError::Io {
        what: format!("reading {}", path.display()),
        source,
    })?;
    let derr = |source| CliError::Dockerfile {
        path: path.to_path_buf(),
        source,
    };
    let plan = dockerfile::parse(&text).map_err(derr)?;
    for w in &plan.warnings {
        eprintln!("{w}");
    }
    let from = args
        .image
        .or(plan.from_image)
        .ok_or_else(|| derr(dockerfile::DockerfileError::NoBase))?;
    let build = BuildRequest {
        from_image: from,
        steps: Some(plan.steps),
        start_cmd: plan.start_cmd,
        ready_cmd: None,
    };
    let (tid, _) = create_and_build(api, args.name, args.size, build).await?;
    println!("Build started.");
    println!("Watch with: aenv template watch {tid}");
    Ok(0)
}
