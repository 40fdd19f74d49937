//! `aenv auth`: save the server URL and API key, checked against the server first.

use std::io::{BufRead, IsTerminal, Write};

use clap::Args;

use crate::cli::api::Api;
use crate::cli::credentials::{self, Credentials};
use crate::cli::{CliError, io_err};

/// Save the server URL and API key (checked against the server first).
#[derive(Debug, Args)]
#[command(after_help = "\
Examples:
  aenv auth                                        # prompts for both
  aenv auth --url http://10.0.0.5:8000 --api-key \"$KEY\"
  echo \"$KEY\" | aenv auth --url http://10.0.0.5:8000 --api-key-stdin
  AENV_URL=http://10.0.0.5:8000 AENV_API_KEY=$KEY aenv auth")]
pub struct AuthArgs {
    /// Server URL (gateway or node).
    #[arg(long, env = "AENV_URL")]
    pub url: Option<String>,
    /// API key (prefer --api-key-stdin: arguments are visible to other users).
    #[arg(long, env = "AENV_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Read the API key from the first line of standard input.
    #[arg(long, conflicts_with = "api_key")]
    pub api_key_stdin: bool,
    /// Save without checking the URL and key against the server.
    #[arg(long)]
    pub no_verify: bool,
}

/// Asks for what the flags left out, checks the key (unless `--no-verify`) and saves.
pub async fn run(args: AuthArgs) -> Result<i32, CliError> {
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
    let key = if args.api_key_stdin {
        Some(read_line("")?)
    } else {
        args.api_key
    };
    let url = match args.url {
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
    if !args.no_verify {
        api.verify().await?;
    }
    credentials::save_to(&path, &creds)?;
    println!("Credentials saved to {}.", path.display());
    Ok(0)
}
