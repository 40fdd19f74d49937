//! `aenv start`: a new sandbox from a template (or, with `--cold`, an OCI image), then
//! an interactive shell in it unless `--detach`.

use clap::Args;

use crate::cli::api::Api;
use crate::cli::args::{parse_disk, parse_kv};
use crate::cli::model::NewSandbox;
use crate::cli::{CliError, DEFAULT_TIMEOUT_SECS, output, shell};

/// Create a sandbox and open an interactive shell in it.
#[derive(Debug, Args)]
#[command(after_help = "\
Examples:
  aenv start base                   # shell in a new sandbox from template `base`
  aenv start base -d                # print only the new sandbox ID
  aenv start base --timeout 3600 --metadata owner=me
Resource overrides (--cpu, --memory, --disk-size-mb) work only with --cold.")]
pub struct StartArgs {
    /// Template name, alias or ID (an OCI image with --cold).
    pub target: String,
    /// Seconds until the sandbox times out.
    #[arg(long, default_value_t = DEFAULT_TIMEOUT_SECS)]
    pub timeout: u64,
    /// Accepted for compatibility and ignored: every sandbox's agent requires its
    /// access token.
    #[arg(long, hide = true)]
    pub secure: bool,
    /// Boot from an OCI image (POST /sandboxes-cold).
    #[arg(long)]
    pub cold: bool,
    /// vCPUs (with --cold).
    #[arg(long, visible_alias = "cpu-count")]
    pub cpu: Option<u32>,
    /// Memory in MiB (with --cold).
    #[arg(long, visible_alias = "memory-mb", alias = "mem")]
    pub memory: Option<u32>,
    /// Root disk size in MiB, a multiple of 1024 (with --cold).
    #[arg(long, visible_alias = "disk-mb", value_parser = parse_disk)]
    pub disk_size_mb: Option<u64>,
    /// Metadata KEY=VALUE; repeatable.
    #[arg(long, value_name = "KEY=VALUE", value_parser = parse_kv)]
    pub metadata: Vec<(String, String)>,
    /// Print only the sandbox ID; do not attach.
    #[arg(short, long)]
    pub detach: bool,
}

/// Creates the sandbox; prints its ID (`--detach`) or attaches a shell.
pub async fn run(api: &Api, args: StartArgs) -> Result<i32, CliError> {
    let sizes = args.cpu.is_some() || args.memory.is_some() || args.disk_size_mb.is_some();
    if !args.cold && sizes {
        return Err(CliError::Usage(
            "--cpu-count, --memory-mb, and --disk-size-mb require --cold".into(),
        ));
    }
    let spinner = output::spinner(&format!("Starting sandbox from {}", args.target));
    let (template_id, image) = if args.cold {
        (None, Some(args.target))
    } else {
        (Some(args.target), None)
    };
    let body = NewSandbox {
        template_id,
        image,
        timeout: args.timeout,
        secure: args.secure,
        metadata: args.metadata.into_iter().collect(),
        cpu_count: args.cpu,
        memory_mb: args.memory,
        disk_size_mb: args.disk_size_mb,
    };
    let sb = api.create(&body).await?;
    if let Some(s) = spinner {
        s.finish_and_clear();
    }
    if args.detach {
        println!("{}", sb.sandbox_id);
        return Ok(0);
    }
    eprintln!("Started sandbox {}", sb.sandbox_id);
    Ok(shell::attach(api, &sb.sandbox_id).await?)
}
