//! Logging setup shared by every daemon: `log_level` and `log_format`
//! (`auto` = console on a terminal, JSON otherwise).

use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;
use tracing_subscriber::filter::LevelFilter;

/// Output format of the log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    Auto,
    Console,
    Json,
}

impl LogFormat {
    /// Parses `auto`, `console` or `json`, case-insensitively.
    pub fn parse(s: &str) -> Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(Self::Auto),
            "console" => Ok(Self::Console),
            "json" => Ok(Self::Json),
            _ => Err(format!(
                "unsupported log format {s:?}: use auto, console or json"
            )),
        }
    }

    /// Resolves `auto`: console when stdout is a terminal, JSON otherwise.
    pub fn resolve(self, stdout_is_terminal: bool) -> Self {
        match self {
            Self::Auto if stdout_is_terminal => Self::Console,
            Self::Auto => Self::Json,
            other => other,
        }
    }
}

/// Parses a log level name (`debug`, `info`, `warn`, `error`; `dpanic`,
/// `panic` and `fatal` are accepted as `error` for compatibility).
pub fn parse_level(s: &str) -> Result<LevelFilter, String> {
    match s.trim().to_ascii_lowercase().as_str() {
        "trace" => Ok(LevelFilter::TRACE),
        "debug" => Ok(LevelFilter::DEBUG),
        "info" => Ok(LevelFilter::INFO),
        "warn" | "warning" => Ok(LevelFilter::WARN),
        "error" | "dpanic" | "panic" | "fatal" => Ok(LevelFilter::ERROR),
        _ => Err(format!(
            "unknown log level {s:?}: use debug, info, warn or error"
        )),
    }
}

/// Installs the global subscriber. `RUST_LOG`, when set, refines the level
/// per module. Calling it twice is harmless (the second call does nothing).
pub fn init(level: &str, format: &str) -> Result<(), String> {
    let level = parse_level(level)?;
    let format = LogFormat::parse(format)?.resolve(std::io::stdout().is_terminal());
    let filter = EnvFilter::builder()
        .with_default_directive(level.into())
        .from_env_lossy();
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stdout);
    // `try_init` fails only when a subscriber is already installed (tests,
    // embedding services); that one stays in charge.
    match format {
        LogFormat::Json => builder
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .try_init()
            .ok(),
        _ => builder.try_init().ok(),
    };
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_is_console_on_a_terminal_and_json_otherwise() {
        assert_eq!(LogFormat::Auto.resolve(true), LogFormat::Console);
        assert_eq!(LogFormat::Auto.resolve(false), LogFormat::Json);
        assert_eq!(LogFormat::Console.resolve(false), LogFormat::Console);
    }

    #[test]
    fn formats_are_case_insensitive_and_pretty_is_rejected() {
        assert_eq!(LogFormat::parse("console"), Ok(LogFormat::Console));
        assert_eq!(LogFormat::parse("JSON"), Ok(LogFormat::Json));
        assert_eq!(LogFormat::parse("Auto"), Ok(LogFormat::Auto));
        let err = LogFormat::parse("pretty").unwrap_err();
        assert!(
            err.contains("pretty") && err.contains("auto, console or json"),
            "{err}"
        );
    }

    #[test]
    fn levels_parse_and_unknown_levels_are_errors() {
        assert_eq!(parse_level("debug"), Ok(LevelFilter::DEBUG));
        assert_eq!(parse_level("WARN"), Ok(LevelFilter::WARN));
        assert_eq!(parse_level("fatal"), Ok(LevelFilter::ERROR));
        assert!(parse_level("verbose").is_err());
    }
}
