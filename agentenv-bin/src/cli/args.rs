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
    fn pairs_need_a_key() {
        assert_eq!(parse_kv("a=b=c"), Ok(("a".into(), "b=c".into())));
        assert_eq!(parse_kv("a="), Ok(("a".into(), "".into())));
        assert!(parse_kv("=b").is_err());
        assert!(parse_kv("ab").is_err());
    }
}
