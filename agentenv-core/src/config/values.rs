//! Checks and conversions of single values: node lists, URLs and gRPC targets, durations,
//! booleans and numbers from the environment, JSON errors without their position.

use std::collections::HashSet;
use std::fmt;
use std::time::Duration;

use serde::Deserializer;

use super::{ConfigError, NodeConfig};
use crate::duration::{parse_go_duration_nanos, parse_positive_duration};

pub(super) fn validate_nodes(nodes: &[NodeConfig]) -> Result<(), ConfigError> {
    if nodes.is_empty() {
        return Err(ConfigError::invalid(
            "scheduler.nodes",
            "must not be empty: list every runtime node as {\"id\": \"node-a\", \"endpoint\": \"http://10.0.0.21:8000\"}",
        ));
    }
    let mut seen = HashSet::new();
    for (i, n) in nodes.iter().enumerate() {
        let key = format!("scheduler.nodes[{i}]");
        if n.id.trim().is_empty() {
            return Err(ConfigError::invalid(
                format!("{key}.id"),
                "is required (the node's AENV_NODE_ID)",
            ));
        }
        if n.id.trim() != n.id {
            return Err(ConfigError::invalid(
                format!("{key}.id"),
                format!(
                    "{:?} has surrounding white space; write {:?}",
                    n.id,
                    n.id.trim()
                ),
            ));
        }
        if n.endpoint.trim().is_empty() {
            return Err(ConfigError::invalid(
                format!("{key}.endpoint"),
                format!(
                    "is required for node {:?}, e.g. \"http://10.0.0.21:8000\"",
                    n.id
                ),
            ));
        }
        validate_http_url(&format!("{key}.endpoint"), &n.endpoint)?;
        if !seen.insert(n.id.as_str()) {
            return Err(ConfigError::invalid(
                format!("{key}.id"),
                format!("duplicate node id {:?}: every node needs its own id", n.id),
            ));
        }
    }
    Ok(())
}

/// Checks that `value` is an absolute `http://` or `https://` URL with a host.
pub fn validate_http_url(key: &str, value: &str) -> Result<(), ConfigError> {
    let rest = value
        .strip_prefix("http://")
        .or_else(|| value.strip_prefix("https://"));
    let Some(rest) = rest else {
        return Err(ConfigError::invalid(
            key,
            format!("{value:?} must start with http:// or https://, e.g. \"http://{value}\""),
        ));
    };
    let host = rest.split(['/', '?', '#']).next().unwrap_or("");
    if host.is_empty() || host.contains(char::is_whitespace) {
        return Err(ConfigError::invalid(
            key,
            format!("{value:?} has no valid host"),
        ));
    }
    Ok(())
}

pub(super) fn validate_grpc_target(
    key: &str,
    value: &str,
    required: bool,
) -> Result<(), ConfigError> {
    let v = value.trim();
    if v.is_empty() {
        if required {
            return Err(ConfigError::invalid(
                key,
                "is required, e.g. \"127.0.0.1:9090\"",
            ));
        }
        return Ok(());
    }
    if let Some((scheme, rest)) = v.split_once("://") {
        return Err(ConfigError::invalid(
            key,
            format!(
                "{v:?} must be host:port without a scheme: write {rest:?} instead of {scheme}://{rest}"
            ),
        ));
    }
    match v.rsplit_once(':') {
        Some((host, port)) if !host.is_empty() && port.parse::<u16>().is_ok() => Ok(()),
        _ => Err(ConfigError::invalid(
            key,
            format!("{v:?} must be host:port, e.g. \"127.0.0.1:9090\""),
        )),
    }
}

pub(super) fn env_duration(var: &'static str, value: &str) -> Result<Duration, ConfigError> {
    parse_positive_duration(value).map_err(|message| ConfigError::Env {
        var,
        value: value.to_string(),
        message,
    })
}

pub(super) fn env_bool(var: &'static str, value: &str) -> Result<bool, ConfigError> {
    parse_bool(value, BoolSyntax::Plain).ok_or_else(|| ConfigError::Env {
        var,
        value: value.to_string(),
        message: "expected true or false (also 1/0, t/f)".into(),
    })
}

pub(super) fn env_int(var: &'static str, value: &str) -> Result<i64, ConfigError> {
    value.parse().map_err(|_| ConfigError::Env {
        var,
        value: value.to_string(),
        message: "expected an integer".into(),
    })
}

/// Which spellings a boolean setting accepts (see [`parse_bool`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BoolSyntax {
    /// `1`/`0`, `t`/`f`, `true`/`false` only (the control-plane environment,
    /// e.g. `GATEWAY_DEBUG_MODE`, where `yes` is an error).
    Plain,
    /// Also `yes`/`no`, `on`/`off`, and blank text as false (the node's
    /// environment variables).
    WithWords,
}

/// The boolean parser of every config layer (environment variables, files):
/// `1`, `t`, `true` and `0`, `f`, `false`, compared case-insensitively after
/// trimming, plus the words of [`BoolSyntax::WithWords`] where `syntax`
/// allows them. Anything else is `None`, for the caller to report with the
/// key.
pub fn parse_bool(v: &str, syntax: BoolSyntax) -> Option<bool> {
    let words = syntax == BoolSyntax::WithWords;
    match v.trim().to_ascii_lowercase().as_str() {
        "1" | "t" | "true" => Some(true),
        "0" | "f" | "false" => Some(false),
        "yes" | "on" if words => Some(true),
        "no" | "off" | "" if words => Some(false),
        _ => None,
    }
}

/// A required choice: blank text says which values exist, other text must
/// parse.
pub(super) fn required_choice<T>(
    key: &str,
    choices: &str,
    text: &str,
    parse: fn(&str) -> Result<T, String>,
) -> Result<T, ConfigError> {
    if text.trim().is_empty() {
        return Err(ConfigError::invalid(
            key,
            format!("is required (one of {choices})"),
        ));
    }
    parse(text).map_err(|m| ConfigError::invalid(key, m))
}

pub(super) fn strip_position(e: &serde_json::Error) -> String {
    let s = e.to_string();
    match s.rfind(" at line ") {
        Some(i) => s[..i].to_string(),
        None => s,
    }
}

pub(super) fn de_duration<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
    d.deserialize_any(DurationVisitor { zero_ok: false })
}

/// Like [`de_duration`], and `"0s"` is a valid value too.
pub(super) fn de_duration_or_zero<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
    d.deserialize_any(DurationVisitor { zero_ok: true })
}

/// [`env_duration`] that takes `0s` too.
pub(super) fn env_duration_or_zero(
    var: &'static str,
    value: &str,
) -> Result<Duration, ConfigError> {
    parse_duration_or_zero(value).map_err(|message| ConfigError::Env {
        var,
        value: value.to_string(),
        message,
    })
}

/// A Go duration string, zero or more.
fn parse_duration_or_zero(v: &str) -> Result<Duration, String> {
    let nanos = parse_go_duration_nanos(v)
        .map_err(|e| format!("must be a duration string like \"30s\": {e}"))?;
    u64::try_from(nanos).map(Duration::from_nanos).map_err(|_| {
        format!(
            "must not be negative, got {:?} (e.g. \"1s\", or \"0s\")",
            v.trim()
        )
    })
}

struct DurationVisitor {
    zero_ok: bool,
}

impl serde::de::Visitor<'_> for DurationVisitor {
    type Value = Duration;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a duration string like \"30s\"")
    }
    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Duration, E> {
        if self.zero_ok {
            return parse_duration_or_zero(v).map_err(E::custom);
        }
        parse_go_duration_nanos(v)
            .map_err(|e| E::custom(format!("must be a duration string like \"30s\": {e}")))?;
        parse_positive_duration(v).map_err(E::custom)
    }
    fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Duration, E> {
        Err(E::custom(format!(
            "must be a duration string like \"30s\", got numeric value {v}; write \"{v}s\""
        )))
    }
    fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Duration, E> {
        Err(E::custom(format!(
            "must be a duration string like \"30s\", got numeric value {v}; write \"{v}s\""
        )))
    }
    fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<Duration, E> {
        Err(E::custom(format!(
            "must be a duration string like \"30s\", got numeric value {v}"
        )))
    }
    fn visit_unit<E: serde::de::Error>(self) -> Result<Duration, E> {
        Err(E::custom(
            "must be a duration string like \"30s\", got null",
        ))
    }
    fn visit_bool<E: serde::de::Error>(self, _: bool) -> Result<Duration, E> {
        Err(E::custom(
            "must be a duration string like \"30s\", got a boolean",
        ))
    }
}
