//! Argument pieces several commands share: the output format, `KEY=VALUE` pairs, disk
//! sizes, and a template's CPU and memory.

use std::io::IsTerminal;

use clap::{Args, ValueEnum};

use super::output::Format;

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
    /// The format asked for, else a table on a terminal and JSON otherwise.
    pub fn format(&self) -> Format {
        match self.output {
            Some(OutputArg::Table) => Format::Table,
            Some(OutputArg::Json) => Format::Json,
            None if std::io::stdout().is_terminal() => Format::Table,
            None => Format::Json,
        }
    }
}

/// The resources of a template a command creates (`pull`, `build`).
#[derive(Debug, Args)]
pub struct TemplateSize {
    #[arg(long, visible_alias = "cpu-count")]
    pub cpu: Option<u32>,
    /// Memory in MiB.
    #[arg(long, visible_alias = "memory-mb", alias = "mem")]
    pub memory: Option<u32>,
}

/// How sandboxes of a template a command builds start (`pull`, `build`).
#[derive(Debug, Args)]
pub struct StartOpts {
    /// Command started when a sandbox boots from the template (run with /bin/sh -c).
    #[arg(long)]
    pub start_cmd: Option<String>,
    /// Command (run with /bin/sh -c) whose success marks the start command ready.
    #[arg(long)]
    pub ready_cmd: Option<String>,
    /// Ready when something listens on this TCP port.
    #[arg(long, value_name = "PORT", conflicts_with = "ready_cmd")]
    pub probe: Option<u16>,
}

impl StartOpts {
    /// The ready command: `--ready-cmd`, else the `--probe` check.
    pub fn ready(&self) -> Option<String> {
        match self.probe {
            Some(p) => Some(port_probe(p)),
            None => self.ready_cmd.clone(),
        }
    }
}

/// A POSIX-sh command that succeeds once a TCP socket listens on `port` (reads
/// `/proc/net/tcp{,6}`: no bash, ss or nc needed in the image).
pub fn port_probe(port: u16) -> String {
    format!(
        "grep -Eq ':{port:04X} [0-9A-F]+:[0-9A-F]{{4}} 0A ' /proc/net/tcp /proc/net/tcp6 2>/dev/null"
    )
}

/// Parses `KEY=VALUE` (a non-empty key).
pub fn parse_kv(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
        _ => Err(format!("expected KEY=VALUE, got {s:?}")),
    }
}

/// Parses a disk size in MiB: positive and a multiple of 1024.
pub fn parse_disk(s: &str) -> Result<u64, String> {
    let n: u64 = s
        .parse()
        .map_err(|_| "disk size must be a positive integer in MiB".to_string())?;
    if n == 0 || n % 1024 != 0 {
        return Err("disk size must be greater than 0 and divisible by 1024 MiB".into());
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn template_port_probe_reads_listening_sockets_with_plain_sh() {
        assert_eq!(
            port_probe(8080),
            "grep -Eq ':1F90 [0-9A-F]+:[0-9A-F]{4} 0A ' /proc/net/tcp /proc/net/tcp6 2>/dev/null"
        );
        // This machine's own listening sockets answer it.
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let ok = |p: u16| {
            std::process::Command::new("/bin/sh")
                .arg("-c")
                .arg(port_probe(p))
                .status()
                .unwrap()
                .success()
        };
        assert!(ok(port));
        drop(l);
        assert!(!ok(port));
    }

    #[test]
    fn pairs_need_a_key() {
        assert_eq!(parse_kv("a=b=c"), Ok(("a".into(), "b=c".into())));
        assert_eq!(parse_kv("a="), Ok(("a".into(), "".into())));
        assert!(parse_kv("=b").is_err());
        assert!(parse_kv("ab").is_err());
    }
}
