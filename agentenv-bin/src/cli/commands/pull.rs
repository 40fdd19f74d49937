//! `aenv pull`: a template built from an OCI image, followed until ready unless
//! `--detach`.

use clap::Args;

use super::template::{create_and_build, watch_build};
use crate::cli::CliError;
use crate::cli::api::Api;
use crate::cli::args::{StartOpts, TemplateSize};
use crate::cli::model::BuildRequest;

/// Build a template from an OCI image and wait for it (unless --detach).
#[derive(Debug, Args)]
#[command(after_help = "\
Examples:
  aenv pull ubuntu:22.04                       # template `ubuntu`
  aenv pull python:3.12-slim --name py --cpu 2 --memory 1024
  aenv pull nginx:latest --start-cmd 'nginx -g \"daemon off;\"' --probe 80 -d
  AENV_REGISTRY_PASSWORD=... aenv pull registry.example/team/app:1 --registry-user ci
  aenv template watch nginx                    # follow a detached build")]
pub struct PullArgs {
    /// Image reference, e.g. ubuntu:22.04.
    pub image: String,
    /// Template name (default: the image's last path component without tag).
    #[arg(long)]
    pub name: Option<String>,
    #[command(flatten)]
    pub size: TemplateSize,
    #[command(flatten)]
    pub start: StartOpts,
    /// User name at the image's registry; the password comes from the environment
    /// variable AENV_REGISTRY_PASSWORD (never a flag: it would show in the process list).
    #[arg(long, value_name = "USER")]
    pub registry_user: Option<String>,
    /// Start the build and return.
    #[arg(short, long)]
    pub detach: bool,
    /// Give up waiting after this many seconds.
    #[arg(long, conflicts_with = "detach")]
    pub timeout: Option<u64>,
}

/// Creates the template, starts its build and (unless `--detach`) follows it.
pub async fn run(api: &Api, args: PullArgs) -> Result<i32, CliError> {
    let name = args.name.unwrap_or_else(|| image_leaf(&args.image));
    let from_image_registry = match args.registry_user {
        None => None,
        Some(user) => {
            let password = std::env::var("AENV_REGISTRY_PASSWORD").map_err(|_| {
                CliError::Usage(
                    "--registry-user needs the password in AENV_REGISTRY_PASSWORD".into(),
                )
            })?;
            Some(serde_json::json!({"type": "registry", "username": user, "password": password}))
        }
    };
    let build = BuildRequest {
        from_image: Some(args.image),
        from_image_registry,
        ready_cmd: args.start.ready(),
        start_cmd: args.start.start_cmd,
        ..Default::default()
    };
    let (tid, bid) = create_and_build(api, name.clone(), args.size, build).await?;
    if args.detach {
        println!("Build started.");
        println!("Watch with: aenv template watch {name}");
        return Ok(0);
    }
    watch_build(api, &tid, &bid, &name, args.timeout).await
}

/// The default template name for an image: its last path component without tag or
/// digest (`docker.io/library/ubuntu:22.04` → `ubuntu`).
pub fn image_leaf(image: &str) -> String {
    let no_digest = image.split('@').next().unwrap_or(image);
    let leaf = no_digest.rsplit('/').next().unwrap_or(no_digest);
    leaf.split(':').next().unwrap_or(leaf).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn image_leaf_drops_registry_path_tag_and_digest() {
        assert_eq!(image_leaf("ubuntu:22.04"), "ubuntu");
        assert_eq!(image_leaf("docker.io/library/python:3.12-slim"), "python");
        assert_eq!(image_leaf("ghcr.io/o/app@sha256:abc"), "app");
        assert_eq!(image_leaf("localhost:5000/x/y"), "y");
    }
}
