//! `aenv build`: a template built from a Dockerfile and its build context, followed
//! until ready unless `--detach`.

use std::path::PathBuf;

use clap::Args;

use super::template::{create_template, start_build, watch_build};
use crate::cli::api::{self, Api};
use crate::cli::args::{StartOpts, TemplateSize};
use crate::cli::model::{BuildRequest, FileLink};
use crate::cli::{CliError, archive, dockerfile};

/// Build a template from a Dockerfile and wait for it (unless --detach).
///
/// FROM, RUN, COPY, ADD (local files), ENV, ARG (as ENV), WORKDIR, USER, CMD and
/// ENTRYPOINT (the start command) are supported; `FROM base` starts from the built-in
/// template, any other FROM from that image.
#[derive(Debug, Args)]
#[command(after_help = "\
Examples:
  aenv build -f ./Dockerfile --name my-env            # context: the Dockerfile's directory
  aenv build --name my-env -f docker/Dockerfile .     # context: the current directory
  aenv build ./Dockerfile --name my-env --image ubuntu:24.04 --cpu 2 --memory 2048
  aenv build -f Dockerfile --name web --probe 8080 -d
  aenv template watch my-env                          # follow a detached build
COPY/ADD take local files and directories of the build context (symlinks are copied
as links; --chown and --chmod are honoured); URLs, --from, heredocs, HEALTHCHECK,
ONBUILD and SHELL are refused; EXPOSE, VOLUME and LABEL are ignored.")]
pub struct BuildArgs {
    /// The Dockerfile (also accepted as the first positional argument).
    #[arg(short = 'f', long = "file", value_name = "DOCKERFILE")]
    pub file: Option<PathBuf>,
    /// `[DOCKERFILE] [CONTEXT]` without -f, `[CONTEXT]` with it. The build context
    /// defaults to the Dockerfile's directory.
    #[arg(value_name = "PATH", num_args = 0..=2)]
    pub paths: Vec<PathBuf>,
    /// Template name (a new build of an existing template of that name, else a new one).
    #[arg(long, required = true)]
    pub name: String,
    #[command(flatten)]
    pub size: TemplateSize,
    /// Base image (overrides the Dockerfile's FROM; `base` is the built-in template).
    #[arg(long, visible_alias = "user-image")]
    pub image: Option<String>,
    #[command(flatten)]
    pub start: StartOpts,
    /// Start the build and return.
    #[arg(short, long)]
    pub detach: bool,
    /// Give up waiting after this many seconds.
    #[arg(long, conflicts_with = "detach")]
    pub timeout: Option<u64>,
}

/// The Dockerfile and the build context the arguments name.
fn locate(args: &BuildArgs) -> Result<(PathBuf, PathBuf), CliError> {
    let usage = |m: &str| CliError::Usage(m.to_string());
    let (file, ctx) = match (&args.file, args.paths.as_slice()) {
        (Some(f), []) => (f.clone(), None),
        (Some(f), [c]) => (f.clone(), Some(c.clone())),
        (Some(_), _) => {
            return Err(usage(
                "with -f, give at most one more path: the build context",
            ));
        }
        (None, [f]) => (f.clone(), None),
        (None, [f, c]) => (f.clone(), Some(c.clone())),
        (None, _) => {
            return Err(usage(
                "name the Dockerfile: aenv build -f <Dockerfile> --name <name> [CONTEXT]",
            ));
        }
    };
    let ctx = ctx.unwrap_or_else(|| match file.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    });
    if !ctx.is_dir() {
        return Err(CliError::Usage(format!(
            "the build context {} is not a directory",
            ctx.display()
        )));
    }
    Ok((file, ctx))
}

/// Reads the Dockerfile, packs and uploads its COPY sources, creates the template,
/// starts its build and (unless `--detach`) follows it.
pub async fn run(api: &Api, args: BuildArgs) -> Result<i32, CliError> {
    let (path, ctx) = locate(&args)?;
    let text = std::fs::read_to_string(&path).map_err(|source| CliError::Io {
        what: format!("reading {}", path.display()),
        source,
    })?;
    let derr = |source| CliError::Dockerfile {
        path: path.clone(),
        source,
    };
    let plan = dockerfile::parse(&text).map_err(derr)?;
    for w in &plan.warnings {
        eprintln!("{w}");
    }
    let from = args
        .image
        .clone()
        .or(plan.from_image)
        .ok_or_else(|| derr(dockerfile::DockerfileError::NoBase))?;
    // Every COPY source packed before anything is sent: a bad source fails here.
    let mut steps = plan.steps;
    let mut packed = Vec::new();
    for s in steps.iter_mut() {
        if s.kind != "COPY" {
            continue;
        }
        let ctx = ctx.clone();
        let (src, dest) = (s.args[0].clone(), s.args[1].clone());
        let p = tokio::task::spawn_blocking(move || archive::pack(&ctx, &src, &dest))
            .await
            .map_err(|e| CliError::Usage(format!("packing COPY files: {e}")))?
            .map_err(|e| CliError::Usage(format!("{}: {e}", path.display())))?;
        s.args[0] = p.src.clone();
        s.files_hash = Some(p.hash.clone());
        packed.push(p);
    }
    let (base_template, image) = if dockerfile::is_base(&from) {
        (Some("base".to_string()), None)
    } else {
        (None, Some(from))
    };
    let build = BuildRequest {
        from_template: base_template,
        from_image: image,
        from_image_registry: None,
        steps,
        start_cmd: args.start.start_cmd.clone().or(plan.start_cmd),
        ready_cmd: args.start.ready(),
    };
    let (tid, bid) = create_template(api, args.name.clone(), &args.size).await?;
    println!("Created template {tid} (build {bid})");
    for p in &packed {
        upload(api, &tid, p).await?;
    }
    start_build(api, &tid, &bid, &build).await?;
    if args.detach {
        println!("Build started.");
        println!("Watch with: aenv template watch {}", args.name);
        return Ok(0);
    }
    watch_build(api, &tid, &bid, &args.name, args.timeout).await
}

/// Uploads the files of one COPY unless the server has them already.
async fn upload(api: &Api, tid: &str, p: &archive::Packed) -> Result<(), CliError> {
    let path = format!("/templates/{}/files/{}", api::seg(tid), p.hash);
    let link: Option<FileLink> = api.get_json(&path).await?;
    let link = link.unwrap_or_default();
    match (link.present, link.url) {
        (false, Some(url)) => {
            api.put_file(&url, p.file.path(), p.len).await?;
            eprintln!(
                "Uploaded '{}' ({} entries, {} bytes)",
                p.src, p.entries, p.len
            );
        }
        (false, None) => {
            return Err(CliError::Usage(format!(
                "the server has not the files of '{}' and gave no upload link ({path})",
                p.src
            )));
        }
        (true, _) => eprintln!("Skipping upload of '{}', already cached", p.src),
    }
    Ok(())
}
