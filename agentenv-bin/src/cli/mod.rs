//! The `aenv` command line: sandboxes, files, templates and snapshots on an AgentENV
//! server (a gateway or a single node), with the credentials written by `aenv auth`.
//!
//! Control-plane calls are REST with `X-API-Key`; exec, the interactive shell and file
//! transfers speak Connect (binary protobuf) to the in-sandbox agent through the same
//! base URL, routed by the `x-agentenv-sandbox-id` and `x-agentenv-target-port` headers.

pub mod api;
pub mod complete;
pub mod credentials;
pub mod dockerfile;
pub mod files;
pub mod output;
pub mod shell;
pub mod term;

use std::io::{BufRead, IsTerminal, Write};

use clap::{Args, Parser, Subcommand, ValueEnum};
use clap_complete::ArgValueCandidates;
use futures::StreamExt;
use tokio::io::AsyncWriteExt;

use agentenv_guest::client::ClientError;
use agentenv_guest::proto::process as pr;
use api::{Api, ApiError};
use credentials::{Credentials, CredentialsError};
use output::Format;

/// How long `exec` waits after a Ctrl-C's SIGTERM before it sends SIGKILL.
pub const KILL_GRACE: std::time::Duration = std::time::Duration::from_secs(3);

/// The TTL `start`, `connect` and `resume` ask for, in seconds.
pub const DEFAULT_TIMEOUT_SECS: u64 = 300;

/// Errors of the CLI commands.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    #[error(transparent)]
    Credentials(#[from] CredentialsError),
    #[error(transparent)]
    Api(#[from] ApiError),
    #[error("sandbox {0} is paused; run `aenv resume {0}` first")]
    Paused(String),
    #[error("sandbox {id}: {source}")]
    Agent { id: String, source: ClientError },
    #[error("{0}")]
    Usage(String),
    #[error("{what}: {source}")]
    Io {
        what: String,
        source: std::io::Error,
    },
    #[error(transparent)]
    Files(#[from] files::FilesError),
    #[error("{}: {source}", path.display())]
    Dockerfile {
        path: std::path::PathBuf,
        source: dockerfile::DockerfileError,
    },
    #[error(transparent)]
    Shell(#[from] shell::ShellError),
    #[error(
        "the process stream ended without an exit event (the sandbox may have been paused or deleted)"
    )]
    NoExitEvent,
}

const AFTER_HELP: &str = "\
Examples:
  aenv auth                          # save the server URL and API key
  aenv start base                    # new sandbox from template `base`, interactive shell
  aenv exec <id> uname -a            # run one command
  aenv ls --state running            # list sandboxes
  aenv rm <id>                       # delete a sandbox

Credentials live in $XDG_CONFIG_HOME/aenv/credentials (default ~/.config/aenv/credentials).";

/// The command line of `aenv`.
#[derive(Debug, Parser)]
#[command(name = "aenv", version, about = "AENV CLI: sandboxes, files, templates and snapshots on an AgentENV server", after_help = AFTER_HELP)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

/// `--output` values.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum OutputArg {
    Table,
    Json,
}

#[derive(Debug, Args)]
pub struct OutputOpt {
    /// Output format (default: table on a terminal, JSON otherwise).
    #[arg(long, short = 'o', value_enum)]
    pub output: Option<OutputArg>,
}

impl OutputOpt {
    fn format(&self) -> Format {
        match self.output {
            Some(OutputArg::Table) => Format::Table,
            Some(OutputArg::Json) => Format::Json,
            None if std::io::stdout().is_terminal() => Format::Table,
            None => Format::Json,
        }
    }
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Save the server URL and API key (checked against the server first).
    #[command(after_help = "\
Examples:
  aenv auth                                        # prompts for both
  aenv auth --url http://10.0.0.5:8000 --api-key \"$KEY\"
  echo \"$KEY\" | aenv auth --url http://10.0.0.5:8000 --api-key-stdin
  AENV_URL=http://10.0.0.5:8000 AENV_API_KEY=$KEY aenv auth")]
    Auth {
        /// Server URL (gateway or node).
        #[arg(long, env = "AENV_URL")]
        url: Option<String>,
        /// API key (prefer --api-key-stdin: arguments are visible to other users).
        #[arg(long, env = "AENV_API_KEY", hide_env_values = true)]
        api_key: Option<String>,
        /// Read the API key from the first line of standard input.
        #[arg(long, conflicts_with = "api_key")]
        api_key_stdin: bool,
        /// Save without checking the URL and key against the server.
        #[arg(long)]
        no_verify: bool,
    },
    /// List sandboxes (every page).
    #[command(
        visible_alias = "ls",
        after_help = "\
Examples:
  aenv ls
  aenv ls --state paused
  aenv ls --metadata team=ml --metadata env=dev -o json | jq '.[].sandboxID'"
    )]
    List {
        #[command(flatten)]
        output: OutputOpt,
        /// Only sandboxes in this state (running or paused); repeatable.
        #[arg(long, value_parser = ["running", "paused"])]
        state: Vec<String>,
        /// Only sandboxes whose metadata has KEY=VALUE; repeatable (all must match).
        #[arg(long, value_name = "KEY=VALUE", value_parser = parse_kv)]
        metadata: Vec<(String, String)>,
        /// Sandboxes per request (every page is fetched either way).
        #[arg(long, hide = true, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..=100))]
        page_size: u32,
    },
    /// Create a sandbox and open an interactive shell in it.
    #[command(after_help = "\
Examples:
  aenv start base                   # shell in a new sandbox from template `base`
  aenv start base -d                # print only the new sandbox ID
  aenv start base --timeout 3600 --metadata owner=me
Resource overrides (--cpu, --memory, --disk-size-mb) work only with --cold.")]
    Start {
        /// Template name, alias or ID (an OCI image with --cold).
        target: String,
        /// Seconds until the sandbox times out.
        #[arg(long, default_value_t = DEFAULT_TIMEOUT_SECS)]
        timeout: u64,
        /// Require an access token for the sandbox's agent.
        #[arg(long)]
        secure: bool,
        /// Boot from an OCI image (POST /sandboxes-cold).
        #[arg(long)]
        cold: bool,
        /// vCPUs (with --cold).
        #[arg(long, visible_alias = "cpu-count")]
        cpu: Option<u32>,
        /// Memory in MiB (with --cold).
        #[arg(long, visible_alias = "memory-mb", alias = "mem")]
        memory: Option<u32>,
        /// Root disk size in MiB, a multiple of 1024 (with --cold).
        #[arg(long, visible_alias = "disk-mb", value_parser = parse_disk)]
        disk_size_mb: Option<u64>,
        /// Metadata KEY=VALUE; repeatable.
        #[arg(long, value_name = "KEY=VALUE", value_parser = parse_kv)]
        metadata: Vec<(String, String)>,
        /// Print only the sandbox ID; do not attach.
        #[arg(short, long)]
        detach: bool,
    },
    /// Attach an interactive shell to a sandbox (resumes it when paused).
    #[command(
        visible_alias = "cn",
        after_help = "\
Examples:
  aenv cn <id>
Exit codes: the shell's exit code; 130 when the sandbox is paused, deleted or lost."
    )]
    Connect {
        #[arg(add = ArgValueCandidates::new(complete::any))]
        sandbox_id: String,
    },
    /// Run one command in a sandbox (no shell); exits with its exit code.
    #[command(after_help = "\
Examples:
  aenv exec <id> ls -la /tmp
  aenv exec <id> sh -c 'echo $HOME; exit 3'; echo $?     # prints 3
  aenv exec --env A=1 --cwd /tmp <id> env
  tar c ./src | aenv exec -i <id> tar x -C /tmp      # stream local input
Standard output and standard error are forwarded separately. Ctrl-C sends SIGTERM to
the remote command, SIGKILL 3 s later (or on a second Ctrl-C), and exits with 130.")]
    Exec {
        /// Environment variable KEY=VALUE for the command; repeatable.
        #[arg(long, short = 'e', value_name = "KEY=VALUE", value_parser = parse_kv)]
        env: Vec<(String, String)>,
        /// Working directory.
        #[arg(long)]
        cwd: Option<String>,
        /// Stream local standard input to the command (closed at end of input).
        #[arg(long, short = 'i')]
        stdin: bool,
        #[arg(add = ArgValueCandidates::new(complete::running))]
        sandbox_id: String,
        /// The program and its arguments.
        #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true)]
        command: Vec<String>,
    },
    /// Pause a sandbox (memory and files are kept).
    #[command(after_help = "Example:\n  aenv pause <id>")]
    Pause {
        #[arg(add = ArgValueCandidates::new(complete::running))]
        sandbox_id: String,
    },
    /// Resume a paused sandbox.
    #[command(after_help = "Example:\n  aenv resume <id> --timeout 600")]
    Resume {
        #[arg(add = ArgValueCandidates::new(complete::paused))]
        sandbox_id: String,
        /// New time to live in seconds.
        #[arg(long, default_value_t = DEFAULT_TIMEOUT_SECS)]
        timeout: u64,
    },
    /// Set a sandbox's remaining time to live.
    #[command(after_help = "Example:\n  aenv timeout <id> 3600")]
    Timeout {
        #[arg(add = ArgValueCandidates::new(complete::running))]
        sandbox_id: String,
        seconds: u64,
    },
    /// Delete sandboxes.
    #[command(
        visible_alias = "rm",
        after_help = "Examples:\n  aenv rm <id>\n  aenv rm <id1> <id2>"
    )]
    Delete {
        #[arg(required = true, add = ArgValueCandidates::new(complete::any))]
        sandbox_ids: Vec<String>,
    },
    /// Upload a file or directory into a sandbox (existing files are replaced).
    #[command(after_help = "\
Examples:
  aenv upload <id> ./data.csv /home/user/data.csv
  aenv upload <id> ./data.csv /home/user/        # keeps the name
  aenv upload <id> ./project /home/user/          # directory tree -> /home/user/project")]
    Upload {
        #[arg(add = ArgValueCandidates::new(complete::running))]
        sandbox_id: String,
        local_path: std::path::PathBuf,
        remote_path: String,
        /// Act as this user in the sandbox.
        #[arg(long)]
        user: Option<String>,
    },
    /// Download a file or directory from a sandbox.
    #[command(after_help = "\
Examples:
  aenv download <id> /home/user/out.txt            # -> ./out.txt
  aenv download <id> /home/user/results ./        # directory tree -> ./results
  aenv download <id> /etc/hosts hosts --force      # replace an existing file")]
    Download {
        #[arg(add = ArgValueCandidates::new(complete::running))]
        sandbox_id: String,
        remote_path: String,
        local_path: Option<std::path::PathBuf>,
        #[arg(long)]
        user: Option<String>,
        /// Replace existing local files.
        #[arg(long, short)]
        force: bool,
    },
    /// Build a template from an OCI image and wait for it (unless --detach).
    #[command(after_help = "\
Examples:
  aenv pull ubuntu:22.04                       # template `ubuntu`
  aenv pull python:3.12-slim --name py --cpu 2 --memory 1024
  aenv pull nginx:latest --start-cmd 'nginx -g \"daemon off;\"' --probe 80 -d")]
    Pull {
        /// Image reference, e.g. ubuntu:22.04.
        image: String,
        /// Template name (default: the image's last path component without tag).
        #[arg(long)]
        name: Option<String>,
        #[arg(long, visible_alias = "cpu-count")]
        cpu: Option<u32>,
        /// Memory in MiB.
        #[arg(long, visible_alias = "memory-mb", alias = "mem")]
        memory: Option<u32>,
        /// Command started when a sandbox boots from the template.
        #[arg(long)]
        start_cmd: Option<String>,
        /// Command whose success marks the start command ready.
        #[arg(long)]
        ready_cmd: Option<String>,
        /// Ready when this TCP port accepts connections.
        #[arg(long, value_name = "PORT", conflicts_with = "ready_cmd")]
        probe: Option<u16>,
        /// Start the build and return.
        #[arg(short, long)]
        detach: bool,
        /// Give up waiting after this many seconds.
        #[arg(long, conflicts_with = "detach")]
        timeout: Option<u64>,
    },
    /// Start a template build from a Dockerfile (RUN, ENV, ARG, WORKDIR, USER, CMD,
    /// ENTRYPOINT); does not wait.
    #[command(after_help = "\
Examples:
  aenv build ./Dockerfile --name my-env
  aenv build ./Dockerfile --name my-env --image ubuntu:24.04 --cpu 2 --memory 2048
  aenv template watch <template-id>               # follow the build
COPY and ADD are not supported yet; EXPOSE, VOLUME and LABEL are ignored.")]
    Build {
        dockerfile: std::path::PathBuf,
        /// Template name.
        #[arg(long, required = true)]
        name: String,
        #[arg(long, visible_alias = "cpu-count")]
        cpu: Option<u32>,
        /// Memory in MiB.
        #[arg(long, visible_alias = "memory-mb", alias = "mem")]
        memory: Option<u32>,
        /// Base image (overrides the Dockerfile's first usable FROM).
        #[arg(long, visible_alias = "user-image")]
        image: Option<String>,
    },
    /// Templates (list, delete, watch a build).
    #[command(
        visible_alias = "templates",
        subcommand,
        after_help = "Examples:\n  aenv template ls\n  aenv template watch ubuntu\n  aenv template rm ubuntu"
    )]
    Template(TemplateCmd),
    /// Snapshots of sandboxes.
    #[command(
        visible_alias = "snap",
        subcommand,
        after_help = "Examples:\n  aenv snapshot create <id> --name before-upgrade\n  aenv snapshot ls --sandbox-id <id>\nDelete a snapshot with `aenv template rm <snapshot>`."
    )]
    Snapshot(SnapshotCmd),
    /// Print a shell completion script.
    #[command(after_help = "\
Examples:
  aenv completion bash > /etc/bash_completion.d/aenv
  aenv completion zsh > \"${fpath[1]}/_aenv\"
  aenv completion fish > ~/.config/fish/completions/aenv.fish")]
    Completion { shell: clap_complete::Shell },
}

#[derive(Debug, Subcommand)]
pub enum TemplateCmd {
    /// List templates.
    #[command(
        visible_alias = "ls",
        after_help = "Example:\n  aenv template ls -o json"
    )]
    List {
        #[command(flatten)]
        output: OutputOpt,
    },
    /// Delete a template (name or ID); also deletes snapshots.
    #[command(
        visible_alias = "rm",
        after_help = "Example:\n  aenv template rm my-template"
    )]
    Delete { template: String },
    /// Follow a template build until it is ready or fails.
    #[command(after_help = "Example:\n  aenv template watch my-template")]
    Watch { template: String },
}

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

fn parse_kv(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
        _ => Err(format!("expected KEY=VALUE, got {s:?}")),
    }
}

fn parse_disk(s: &str) -> Result<u64, String> {
    let n: u64 = s
        .parse()
        .map_err(|_| "disk size must be a positive integer in MiB".to_string())?;
    if n == 0 || n % 1024 != 0 {
        return Err("disk size must be greater than 0 and divisible by 1024 MiB".into());
    }
    Ok(n)
}

fn io_err(what: &str) -> impl FnOnce(std::io::Error) -> CliError + '_ {
    move |source| CliError::Io {
        what: what.to_string(),
        source,
    }
}

/// Runs a parsed command line; returns the process exit code.
pub async fn run(cli: Cli) -> Result<i32, CliError> {
    match cli.command {
        Command::Auth {
            url,
            api_key,
            api_key_stdin,
            no_verify,
        } => auth(url, api_key, api_key_stdin, no_verify).await,
        Command::Completion { shell } => {
            // The script calls back into this binary: by name when it was run from PATH,
            // else by its absolute path.
            let argv0 = std::env::args().next().unwrap_or_else(|| "aenv".into());
            let completer = if argv0.contains('/') {
                std::env::current_exe()
                    .map(|p| p.display().to_string())
                    .unwrap_or(argv0)
            } else {
                argv0
            };
            let mut out = Vec::new();
            complete::write_registration(shell, &completer, &mut out)
                .map_err(io_err("writing the script"))?;
            match std::io::stdout().write_all(&out) {
                Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
                    Err(io_err("writing the script")(e))
                }
                _ => Ok(0),
            }
        }
        cmd => {
            let api = Api::new(&credentials::load()?)?;
            with_api(&api, cmd).await
        }
    }
}

async fn with_api(api: &Api, cmd: Command) -> Result<i32, CliError> {
    match cmd {
        Command::Auth { .. } | Command::Completion { .. } => Ok(0),
        Command::List {
            output,
            state,
            metadata,
            page_size,
        } => {
            let mut q = Vec::new();
            if !state.is_empty() {
                q.push(("state".to_string(), state.join(",")));
            }
            if !metadata.is_empty() {
                let m: Vec<(String, String)> = metadata;
                q.push(("metadata".to_string(), api::encode_query(&m)));
            }
            let mut items = api.list_all(&q, page_size).await?;
            // Older servers ignore filters; apply them here as well.
            items.retain(|s| {
                (state.is_empty() || s.state.as_ref().is_some_and(|st| state.contains(st)))
                    && m_match(&q, s)
            });
            output::sandboxes(&items, output.format()).map_err(io_err("writing the list"))?;
            Ok(0)
        }
        Command::Start {
            target,
            timeout,
            secure,
            cold,
            cpu,
            memory,
            disk_size_mb,
            metadata,
            detach,
        } => {
            if !cold && (cpu.is_some() || memory.is_some() || disk_size_mb.is_some()) {
                return Err(CliError::Usage(
                    "--cpu-count, --memory-mb, and --disk-size-mb require --cold".into(),
                ));
            }
            let mut body = if cold {
                serde_json::json!({"image": target, "timeout": timeout})
            } else {
                serde_json::json!({"templateID": target, "timeout": timeout})
            };
            if secure {
                body["secure"] = true.into();
            }
            if !metadata.is_empty() {
                body["metadata"] = metadata
                    .into_iter()
                    .map(|(k, v)| (k, serde_json::Value::String(v)))
                    .collect::<serde_json::Map<_, _>>()
                    .into();
            }
            if let Some(c) = cpu {
                body["cpuCount"] = c.into();
            }
            if let Some(m) = memory {
                body["memoryMB"] = m.into();
            }
            if let Some(d) = disk_size_mb {
                body["diskSizeMB"] = d.into();
            }
            let spinner = output::spinner(&format!("Starting sandbox from {target}"));
            let sb = if cold {
                let (v, _) = api
                    .json_call(http::Method::POST, "/sandboxes-cold", Some(&body))
                    .await?;
                serde_json::from_value::<api::Sandbox>(v).map_err(|e| ApiError::BadResponse {
                    path: "/sandboxes-cold".into(),
                    reason: e.to_string(),
                })?
            } else {
                api.create(&body).await?
            };
            if let Some(s) = spinner {
                s.finish_and_clear();
            }
            if detach {
                println!("{}", sb.sandbox_id);
                return Ok(0);
            }
            eprintln!("Started sandbox {}", sb.sandbox_id);
            Ok(shell::attach(api, &sb.sandbox_id).await?)
        }
        Command::Connect { sandbox_id } => Ok(shell::attach(api, &sandbox_id).await?),
        Command::Exec {
            env,
            cwd,
            stdin,
            sandbox_id,
            command,
        } => exec(api, &sandbox_id, command, env, cwd, stdin).await,
        Command::Pause { sandbox_id } => {
            api.pause(&sandbox_id).await?;
            println!("Paused {sandbox_id}");
            Ok(0)
        }
        Command::Resume {
            sandbox_id,
            timeout,
        } => {
            api.connect(&sandbox_id, timeout).await?;
            println!("Resumed {sandbox_id}");
            Ok(0)
        }
        Command::Timeout {
            sandbox_id,
            seconds,
        } => {
            api.set_timeout(&sandbox_id, seconds).await?;
            println!("Timeout for {sandbox_id} set to {seconds}s");
            Ok(0)
        }
        Command::Delete { sandbox_ids } => {
            for id in sandbox_ids {
                api.delete(&id).await?;
                println!("Deleted sandbox {id}");
            }
            Ok(0)
        }
        Command::Upload {
            sandbox_id,
            local_path,
            remote_path,
            user,
        } => {
            let agent = agent_for(api, &sandbox_id, user.as_deref()).await?;
            let msg = files::upload(&agent, &sandbox_id, &local_path, &remote_path).await?;
            println!("{msg}");
            Ok(0)
        }
        Command::Download {
            sandbox_id,
            remote_path,
            local_path,
            user,
            force,
        } => {
            let agent = agent_for(api, &sandbox_id, user.as_deref()).await?;
            let msg = files::download(
                &agent,
                &sandbox_id,
                &remote_path,
                local_path.as_deref(),
                force,
            )
            .await?;
            println!("{msg}");
            Ok(0)
        }
        Command::Pull {
            image,
            name,
            cpu,
            memory,
            start_cmd,
            ready_cmd,
            probe,
            detach,
            timeout,
        } => {
            pull(
                api, image, name, cpu, memory, start_cmd, ready_cmd, probe, detach, timeout,
            )
            .await
        }
        Command::Build {
            dockerfile,
            name,
            cpu,
            memory,
            image,
        } => build(api, &dockerfile, name, cpu, memory, image).await,
        Command::Template(t) => template(api, t).await,
        Command::Snapshot(s) => snapshot(api, s).await,
    }
}

fn m_match(q: &[(String, String)], s: &api::ListedSandbox) -> bool {
    let Some((_, enc)) = q.iter().find(|(k, _)| k == "metadata") else {
        return true;
    };
    let md = s.metadata.clone().unwrap_or_default();
    enc.split('&').all(|pair| {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        let k = unescape(k);
        let v = unescape(v);
        md.get(&k).is_some_and(|x| *x == v)
    })
}

fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%'
            && i + 2 < b.len()
            && let Ok(h) = std::str::from_utf8(&b[i + 1..i + 3])
            && let Ok(v) = u8::from_str_radix(h, 16)
        {
            out.push(v);
            i += 3;
            continue;
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The agent client of a running sandbox (with its access token).
async fn agent_for(
    api: &Api,
    id: &str,
    user: Option<&str>,
) -> Result<agentenv_guest::client::GuestClient, CliError> {
    let d = api.get(id).await?;
    if d.state.as_deref() == Some("paused") {
        return Err(CliError::Paused(id.to_string()));
    }
    let mut c = api.agent(id, d.envd_access_token.as_deref())?;
    if let Some(u) = user {
        c = c.with_user(u);
    }
    Ok(c)
}

/// `aenv exec`: one process, no shell, stdout and stderr forwarded as they come.
/// With `stdin`, local standard input is streamed to the process (closed at EOF). A
/// local Ctrl-C sends SIGTERM to the remote process (SIGKILL after [`KILL_GRACE`], or at
/// once on a second Ctrl-C) and the command exits with 130.
async fn exec(
    api: &Api,
    id: &str,
    command: Vec<String>,
    env: Vec<(String, String)>,
    cwd: Option<String>,
    stdin: bool,
) -> Result<i32, CliError> {
    let agent = agent_for(api, id, None).await?;
    let mut words = command.into_iter();
    let cmd = words.next().unwrap_or_default();
    let req = pr::StartRequest {
        process: Some(pr::ProcessConfig {
            cmd,
            args: words.collect(),
            envs: env.into_iter().collect(),
            cwd,
        }),
        stdin: Some(stdin),
        ..Default::default()
    };
    let agent_err = |source| CliError::Agent {
        id: id.to_string(),
        source,
    };
    let mut stream = agent.start(&req).await.map_err(agent_err)?;
    let mut out = tokio::io::stdout();
    let mut err = tokio::io::stderr();
    let mut pid = None;
    let mut interrupts = 0u32;
    let mut input_started = false;
    use pr::process_event::Event;
    use pr::process_event::data_event::Output;
    // Registered before the first event so that no Ctrl-C is lost.
    let mut sigint = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())
        .map_err(io_err("installing the Ctrl-C handler"))?;
    // After a SIGTERM, SIGKILL follows if the command has not ended within the grace time.
    let mut kill_at: Option<tokio::time::Instant> = None;
    loop {
        let msg = tokio::select! {
            m = stream.next() => m,
            _ = sigint.recv() => {
                interrupts += 1;
                let Some(p) = pid else { return Ok(130) };
                if interrupts == 1 {
                    let _ = agent.send_signal(selector(p), pr::Signal::Sigterm).await;
                    kill_at = Some(tokio::time::Instant::now() + KILL_GRACE);
                } else {
                    let _ = agent.send_signal(selector(p), pr::Signal::Sigkill).await;
                    kill_at = None;
                }
                continue;
            }
            _ = async {
                match kill_at {
                    Some(t) => tokio::time::sleep_until(t).await,
                    None => std::future::pending().await,
                }
            } => {
                kill_at = None;
                if let Some(p) = pid {
                    let _ = agent.send_signal(selector(p), pr::Signal::Sigkill).await;
                }
                continue;
            }
        };
        let Some(msg) = msg else { break };
        let ev = match msg {
            Ok(m) => m.event.and_then(|e| e.event),
            Err(e) => return Err(gone_or(api, id, agent_err(e)).await),
        };
        match ev {
            Some(Event::Start(st)) => {
                pid = Some(st.pid);
                if stdin && !input_started {
                    input_started = true;
                    forward_stdin(agent.clone(), st.pid);
                }
            }
            Some(Event::Data(d)) => match d.output {
                Some(Output::Stdout(b)) | Some(Output::Pty(b)) => {
                    let w = async {
                        out.write_all(&b).await?;
                        out.flush().await
                    }
                    .await;
                    if let Err(e) = w {
                        return broken_pipe(&agent, pid, e, "writing stdout").await;
                    }
                }
                Some(Output::Stderr(b)) => {
                    let w = async {
                        err.write_all(&b).await?;
                        err.flush().await
                    }
                    .await;
                    if let Err(e) = w {
                        return broken_pipe(&agent, pid, e, "writing stderr").await;
                    }
                }
                None => {}
            },
            Some(Event::End(e)) => {
                if let Some(m) = e.error.as_deref().filter(|m| !m.is_empty()) {
                    eprintln!("aenv: {m}");
                }
                return Ok(if interrupts > 0 { 130 } else { exit_code(&e) });
            }
            _ => {}
        }
    }
    Err(gone_or(api, id, CliError::NoExitEvent).await)
}

/// A closed local output (e.g. `aenv exec … | head`) stops the remote command and
/// exits like a process killed by SIGPIPE (141); other write errors are reported.
async fn broken_pipe(
    agent: &agentenv_guest::client::GuestClient,
    pid: Option<u32>,
    e: std::io::Error,
    what: &str,
) -> Result<i32, CliError> {
    if let Some(p) = pid {
        let _ = agent.send_signal(selector(p), pr::Signal::Sigkill).await;
    }
    if e.kind() == std::io::ErrorKind::BrokenPipe {
        Ok(141)
    } else {
        Err(io_err(what)(e))
    }
}

fn selector(pid: u32) -> pr::ProcessSelector {
    pr::ProcessSelector {
        selector: Some(pr::process_selector::Selector::Pid(pid)),
    }
}

/// Streams local standard input to process `pid`, then closes its stdin.
fn forward_stdin(agent: agentenv_guest::client::GuestClient, pid: u32) {
    tokio::spawn(async move {
        use tokio::io::AsyncReadExt;
        let (tx, task) = agent.stream_input(selector(pid), false);
        let mut input = tokio::io::stdin();
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            match input.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if !tx.send(buf[..n].to_vec()).await {
                        break;
                    }
                }
            }
        }
        drop(tx);
        let _ = task.await;
        let _ = agent.close_stdin(selector(pid)).await;
    });
}

/// When a process stream breaks, says why if the sandbox was paused or deleted.
async fn gone_or(api: &Api, id: &str, e: CliError) -> CliError {
    match api.get_opt(id).await {
        Ok(None) => CliError::Api(ApiError::SandboxNotFound(id.to_string())),
        Ok(Some(d)) if d.state.as_deref() == Some("paused") => CliError::Paused(id.to_string()),
        _ => e,
    }
}

/// The local exit code for a remote end event: the code, or 128+signal when a signal
/// ended the process (as a shell reports it).
pub fn exit_code(e: &pr::process_event::EndEvent) -> i32 {
    if e.exited || e.exit_code >= 0 {
        return e.exit_code.clamp(0, 255);
    }
    let sig = match e.status.strip_prefix("signal: ").unwrap_or("") {
        "hangup" => 1,
        "interrupt" => 2,
        "quit" => 3,
        "aborted" => 6,
        "killed" => 9,
        "segmentation fault" => 11,
        "broken pipe" => 13,
        "terminated" => 15,
        _ => 0,
    };
    if sig == 0 { 1 } else { 128 + sig }
}

async fn auth(
    url: Option<String>,
    api_key: Option<String>,
    api_key_stdin: bool,
    no_verify: bool,
) -> Result<i32, CliError> {
    let path = credentials::path()?;
    let existing = credentials::load_from(&path).ok();
    let stdin = std::io::stdin();
    let read_line = |prompt: &str| -> Result<String, CliError> {
        eprint!("{prompt}");
        let _ = std::io::stderr().flush();
        let mut s = String::new();
        stdin
            .lock()
            .read_line(&mut s)
            .map_err(io_err("reading standard input"))?;
        Ok(s.trim().to_string())
    };
    let key = if api_key_stdin {
        Some(read_line("")?)
    } else {
        api_key
    };
    let url = match url {
        Some(u) => u.trim().to_string(),
        None => {
            let default = existing
                .as_ref()
                .map(|c| c.url.clone())
                .unwrap_or_else(|| "http://localhost:8000".into());
            let u = read_line(&format!("AENV server URL [{default}]: "))?;
            if u.is_empty() { default } else { u }
        }
    };
    let key = match key {
        Some(k) => k.trim().to_string(),
        None if std::io::stdin().is_terminal() => rpassword::prompt_password("API key: ")
            .map_err(io_err("reading the API key"))?
            .trim()
            .to_string(),
        None => read_line("API key: ")?,
    };
    if key.is_empty() {
        return Err(CliError::Usage("API key cannot be empty".into()));
    }
    let creds = Credentials { url, api_key: key };
    let api = Api::new(&creds)?;
    if !no_verify {
        api.verify().await?;
    }
    credentials::save_to(&path, &creds)?;
    println!("Credentials saved to {}.", path.display());
    Ok(0)
}

async fn resolve_template(api: &Api, t: &str) -> Result<String, CliError> {
    let is_uuid = t.len() == 36 && t.bytes().filter(|b| *b == b'-').count() == 4;
    if is_uuid {
        return Ok(t.to_string());
    }
    let path = format!("/templates/aliases/{}", api::seg(t));
    let (v, _) = api.json_call(http::Method::GET, &path, None).await?;
    v.get("templateID")
        .and_then(|x| x.as_str())
        .map(str::to_string)
        .ok_or_else(|| {
            CliError::Api(ApiError::BadResponse {
                path,
                reason: "no templateID".into(),
            })
        })
}

async fn template(api: &Api, cmd: TemplateCmd) -> Result<i32, CliError> {
    match cmd {
        TemplateCmd::List { output } => {
            let (v, _) = api
                .json_call(http::Method::GET, "/v2/templates", None)
                .await?;
            output::templates(&v, output.format()).map_err(io_err("writing the list"))?;
            Ok(0)
        }
        TemplateCmd::Delete { template } => {
            let id = resolve_template(api, &template).await?;
            api.json_call(
                http::Method::DELETE,
                &format!("/templates/{}", api::seg(&id)),
                None,
            )
            .await?;
            println!("Deleted template {id}");
            Ok(0)
        }
        TemplateCmd::Watch { template } => {
            let id = resolve_template(api, &template).await?;
            // The build ID of a template is its template ID.
            watch_build(api, &id, &id, &template, None).await
        }
    }
}

/// Polls a build's status once a second until it is ready, fails or `limit` passes.
async fn watch_build(
    api: &Api,
    tid: &str,
    bid: &str,
    name: &str,
    limit: Option<u64>,
) -> Result<i32, CliError> {
    let path = format!(
        "/templates/{}/builds/{}/status",
        api::seg(tid),
        api::seg(bid)
    );
    let bar = output::spinner("Build status: ...");
    let finish = || {
        if let Some(b) = &bar {
            b.finish_and_clear();
        }
    };
    let deadline = limit.map(|s| tokio::time::Instant::now() + std::time::Duration::from_secs(s));
    let mut unknown_seen = std::collections::BTreeSet::new();
    loop {
        let (v, _) = api.json_call(http::Method::GET, &path, None).await?;
        if v["templateID"].as_str().is_some_and(|t| t != tid)
            || v["buildID"].as_str().is_some_and(|b| b != bid)
        {
            finish();
            return Err(CliError::Usage("Build status response mismatch".into()));
        }
        match v["status"].as_str().unwrap_or("") {
            "ready" => {
                finish();
                println!("Build succeeded: template {tid} is ready.");
                return Ok(0);
            }
            "error" => {
                finish();
                let msg = v["reason"]["message"].as_str().unwrap_or("unknown reason");
                let step = v["reason"]["step"]
                    .as_str()
                    .map(|s| format!(" (step: {s})"))
                    .unwrap_or_default();
                return Err(CliError::Usage(format!("Build failed: {msg}{step}")));
            }
            s @ ("waiting" | "building") => {
                if let Some(b) = &bar {
                    b.set_message(format!("Build status: {s}"));
                }
            }
            other => {
                if unknown_seen.insert(other.to_string()) {
                    eprintln!("Build returned unknown status: {other}");
                }
            }
        }
        if deadline.is_some_and(|d| tokio::time::Instant::now() >= d) {
            finish();
            return Err(CliError::Usage(format!(
                "Timed out waiting for build. Resume with: aenv template watch {name}"
            )));
        }
        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    }
}

/// Creates a template and starts its build from a Dockerfile.
async fn build(
    api: &Api,
    path: &std::path::Path,
    name: String,
    cpu: Option<u32>,
    memory: Option<u32>,
    image: Option<String>,
) -> Result<i32, CliError> {
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
    let from = image
        .or(plan.from_image)
        .ok_or_else(|| derr(dockerfile::DockerfileError::NoBase))?;
    let mut body = serde_json::json!({ "name": name });
    if let Some(c) = cpu {
        body["cpuCount"] = c.into();
    }
    if let Some(m) = memory {
        body["memoryMB"] = m.into();
    }
    let (v, _) = api
        .json_call(http::Method::POST, "/v3/templates", Some(&body))
        .await?;
    let field = |k: &str| {
        v[k].as_str().map(str::to_string).ok_or_else(|| {
            CliError::Api(ApiError::BadResponse {
                path: "/v3/templates".into(),
                reason: format!("no {k}"),
            })
        })
    };
    let (tid, bid) = (field("templateID")?, field("buildID")?);
    let mut req = serde_json::json!({ "fromImage": from, "steps": plan.steps });
    if let Some(c) = plan.start_cmd {
        req["startCmd"] = c.into();
    }
    let p = format!("/v2/templates/{}/builds/{}", api::seg(&tid), api::seg(&bid));
    api.json_call(http::Method::POST, &p, Some(&req)).await?;
    println!("Created template {tid} (build {bid})");
    println!("Build started.");
    println!("Watch with: aenv template watch {tid}");
    Ok(0)
}

/// The default template name for an image: its last path component without tag or
/// digest (`docker.io/library/ubuntu:22.04` → `ubuntu`).
pub fn image_leaf(image: &str) -> String {
    let no_digest = image.split('@').next().unwrap_or(image);
    let leaf = no_digest.rsplit('/').next().unwrap_or(no_digest);
    leaf.split(':').next().unwrap_or(leaf).to_string()
}

#[allow(clippy::too_many_arguments)]
async fn pull(
    api: &Api,
    image: String,
    name: Option<String>,
    cpu: Option<u32>,
    memory: Option<u32>,
    start_cmd: Option<String>,
    ready_cmd: Option<String>,
    probe: Option<u16>,
    detach: bool,
    timeout: Option<u64>,
) -> Result<i32, CliError> {
    let name = name.unwrap_or_else(|| image_leaf(&image));
    let mut body = serde_json::json!({ "name": name });
    if let Some(c) = cpu {
        body["cpuCount"] = c.into();
    }
    if let Some(m) = memory {
        body["memoryMB"] = m.into();
    }
    let (v, _) = api
        .json_call(http::Method::POST, "/v3/templates", Some(&body))
        .await?;
    let field = |k: &str| {
        v[k].as_str().map(str::to_string).ok_or_else(|| {
            CliError::Api(ApiError::BadResponse {
                path: "/v3/templates".into(),
                reason: format!("no {k}"),
            })
        })
    };
    let (tid, bid) = (field("templateID")?, field("buildID")?);
    let mut build = serde_json::json!({ "fromImage": image });
    if let Some(c) = start_cmd {
        build["startCmd"] = c.into();
    }
    if let Some(p) = probe {
        build["readyCmd"] = format!(": >/dev/tcp/127.0.0.1/{p}").into();
    } else if let Some(c) = ready_cmd {
        build["readyCmd"] = c.into();
    }
    let path = format!("/v2/templates/{}/builds/{}", api::seg(&tid), api::seg(&bid));
    api.json_call(http::Method::POST, &path, Some(&build))
        .await?;
    println!("Created template {tid} (build {bid})");
    if detach {
        println!("Build started.");
        println!("Watch with: aenv template watch {name}");
        return Ok(0);
    }
    watch_build(api, &tid, &bid, &name, timeout).await
}

async fn snapshot(api: &Api, cmd: SnapshotCmd) -> Result<i32, CliError> {
    match cmd {
        SnapshotCmd::Create { sandbox_id, name } => {
            let body = match name {
                Some(n) => serde_json::json!({ "name": n }),
                None => serde_json::json!({}),
            };
            let path = format!("/sandboxes/{}/snapshots", api::seg(&sandbox_id));
            let (v, _) = api
                .json_call(http::Method::POST, &path, Some(&body))
                .await?;
            println!(
                "Created snapshot {}",
                v["snapshotID"].as_str().unwrap_or("?")
            );
            if let Some(r) = v["imageRef"].as_str() {
                println!("Image: {r}");
            }
            Ok(0)
        }
        SnapshotCmd::List { sandbox_id, output } => {
            let mut all = Vec::new();
            let mut token: Option<String> = None;
            loop {
                let mut q = vec![("limit".to_string(), "100".to_string())];
                if let Some(s) = &sandbox_id {
                    q.push(("sandboxID".into(), s.clone()));
                }
                if let Some(t) = &token {
                    q.push(("nextToken".into(), t.clone()));
                }
                let path = format!("/snapshots?{}", api::encode_query(&q));
                let (v, next) = api.json_call(http::Method::GET, &path, None).await?;
                if let serde_json::Value::Array(a) = v {
                    all.extend(a);
                }
                token = next;
                if token.is_none() {
                    break;
                }
            }
            output::snapshots(&all, output.format()).map_err(io_err("writing the list"))?;
            Ok(0)
        }
    }
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

    #[test]
    fn exit_codes_follow_shell_conventions() {
        let end = |code, exited, status: &str| pr::process_event::EndEvent {
            exit_code: code,
            exited,
            status: status.into(),
            error: None,
        };
        assert_eq!(exit_code(&end(7, true, "exit status 7")), 7);
        assert_eq!(exit_code(&end(-1, false, "signal: killed")), 137);
        assert_eq!(exit_code(&end(-1, false, "signal: terminated")), 143);
        assert_eq!(exit_code(&end(-1, false, "weird")), 1);
    }

    #[test]
    fn disk_sizes_must_be_positive_multiples_of_1024() {
        assert_eq!(parse_disk("2048"), Ok(2048));
        assert!(parse_disk("0").is_err());
        assert!(
            parse_disk("1000")
                .unwrap_err()
                .contains("divisible by 1024")
        );
        assert!(parse_disk("x").unwrap_err().contains("positive integer"));
    }

    #[test]
    fn metadata_filters_match_all_pairs_locally() {
        let s = api::ListedSandbox {
            sandbox_id: "id".into(),
            template_id: None,
            alias: None,
            state: None,
            cpu_count: None,
            memory_mb: None,
            disk_size_mb: None,
            started_at: None,
            end_at: None,
            metadata: Some([("a".to_string(), "x=y".to_string())].into()),
        };
        let q = |pairs: &[(&str, &str)]| {
            let v: Vec<(String, String)> = pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            vec![("metadata".to_string(), api::encode_query(&v))]
        };
        assert!(m_match(&q(&[("a", "x=y")]), &s));
        assert!(!m_match(&q(&[("a", "x=y"), ("b", "1")]), &s));
        assert!(m_match(&[], &s));
    }
}
