//! `aenv completion <shell>`: print the shell's registration script (see
//! [`crate::cli::complete`]).

use std::io::Write;

use clap::Args;

use crate::cli::{CliError, complete, io_err};

/// Print a shell completion script.
#[derive(Debug, Args)]
#[command(after_help = "\
Examples:
  aenv completion bash > /etc/bash_completion.d/aenv
  aenv completion zsh > \"${fpath[1]}/_aenv\"
  aenv completion fish > ~/.config/fish/completions/aenv.fish")]
pub struct CompletionArgs {
    pub shell: clap_complete::Shell,
}

/// Writes the script to stdout (a closed pipe is not an error).
pub fn run(args: CompletionArgs) -> Result<i32, CliError> {
    // The script calls back into this binary: by name when it was run from PATH, else
    // by its absolute path.
    let argv0 = std::env::args().next().unwrap_or_else(|| "aenv".into());
    let completer = if argv0.contains('/') {
        std::env::current_exe()
            .map(|p| p.display().to_string())
            .unwrap_or(argv0)
    } else {
        argv0
    };
    let mut out = Vec::new();
    complete::write_registration(args.shell, &completer, &mut out)
        .map_err(io_err("writing the script"))?;
    match std::io::stdout().write_all(&out) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
            Err(io_err("writing the script")(e))
        }
        _ => Ok(0),
    }
}
