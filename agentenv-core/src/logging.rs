//! Logging setup shared by every daemon: `log_level` and `log_format`
//! (`auto` = console on a terminal, JSON otherwise).

use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;
use tracing_subscriber::filter::LevelFilter;

crate::choice::text_enum! {
    /// Output format of the log (`log_format`).
    pub enum LogFormat {
        /// Console on a terminal, JSON otherwise.
        #[default]
        Auto = "auto",
        /// Human-readable lines.
        Console = "console",
        /// One JSON object per line.
        Json = "json",
    }
}

impl LogFormat {
    /// Parses `auto`, `console` or `json`, case-insensitively.
    pub fn parse(s: &str) -> Result<Self, String> {
        Self::from_name(&crate::choice::normalize(s))
            .ok_or_else(|| format!("unsupported log format {s:?}: use auto, console or json"))
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

crate::choice::text_enum! {
    /// Verbosity of the log (`log_level`). `warning` reads as `warn`;
    /// `dpanic`, `panic` and `fatal` read as `error` for compatibility.
    pub enum LogLevel {
        Trace = "trace",
        Debug = "debug",
        #[default]
        Info = "info",
        Warn = "warn" | "warning",
        Error = "error" | "dpanic" | "panic" | "fatal",
    }
}

impl LogLevel {
    /// Parses a log level name, case-insensitively.
    pub fn parse(s: &str) -> Result<Self, String> {
        Self::from_name(&crate::choice::normalize(s))
            .ok_or_else(|| format!("unknown log level {s:?}: use debug, info, warn or error"))
    }

    /// The tracing filter of this level; an `Unknown` level is an error.
    pub fn filter(&self) -> Result<LevelFilter, String> {
        Ok(match self {
            Self::Trace => LevelFilter::TRACE,
            Self::Debug => LevelFilter::DEBUG,
            Self::Info => LevelFilter::INFO,
            Self::Warn => LevelFilter::WARN,
            Self::Error => LevelFilter::ERROR,
            Self::Unknown(text) => return Self::parse(text).and_then(|l| l.filter()),
        })
    }
}

/// Parses a log level name (`debug`, `info`, `warn`, `error`; `dpanic`,
/// `panic` and `fatal` are accepted as `error` for compatibility).
pub fn parse_level(s: &str) -> Result<LevelFilter, String> {
    LogLevel::parse(s)?.filter()
}

/// Installs the global subscriber. `RUST_LOG`, when set, refines the level
/// per module. Calling it twice is harmless (the second call does nothing).
/// An `Unknown` level or format is an error.
pub fn init(level: &LogLevel, format: &LogFormat) -> Result<(), String> {
    let level = level.filter()?;
    let format = LogFormat::parse(format.as_str())?.resolve(std::io::stdout().is_terminal());
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

    #[test]
    fn unknown_text_is_kept_and_rejected_with_the_parse_message() {
        assert_eq!(LogLevel::from(" Warning "), LogLevel::Warn);
        let chatty = LogLevel::from("chatty");
        assert_eq!(chatty, LogLevel::Unknown("chatty".into()));
        assert_eq!(chatty, "chatty");
        assert_eq!(chatty.filter(), Err(LogLevel::parse("chatty").unwrap_err()));
        assert_eq!(LogFormat::from("JSON").to_string(), "json");
        assert!(!LogFormat::from("pretty").is_known());
    }
}
