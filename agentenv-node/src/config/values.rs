//! The values of settings: numbers and booleans with the key in their errors, ranges,
//! pool sizes, paths under `$AENV_HOME`, the host's name.

use std::path::{Path, PathBuf};

use agentenv_core::config::BoolSyntax;

use super::{ConfigError, invalid};

/// Expands a leading `$AENV_HOME` and resolves a relative path against `base`.
pub(super) fn expand_home(p: PathBuf, home: &Path, base: &Path) -> PathBuf {
    let s = p.to_string_lossy();
    if let Some(rest) = s.strip_prefix("$AENV_HOME") {
        return home.join(rest.trim_start_matches('/'));
    }
    if p.is_relative() { base.join(p) } else { p }
}

pub(super) fn parse_bool(key: &'static str, v: &str) -> Result<bool, ConfigError> {
    agentenv_core::config::parse_bool(v, BoolSyntax::WithWords)
        .ok_or_else(|| invalid(key, v, "use true or false"))
}

/// The most network namespaces the jail may keep ready.
const MAX_NET_POOL_SIZE: usize = 1024;

fn parse_u64(key: &'static str, v: &str) -> Result<u64, ConfigError> {
    v.trim()
        .parse()
        .map_err(|_| invalid(key, v, "use a whole number"))
}

/// The whole number in environment variable `key`, if set.
pub(super) fn env_u64(
    env: &dyn Fn(&str) -> Option<String>,
    key: &'static str,
) -> Result<Option<u64>, ConfigError> {
    env(key).map(|v| parse_u64(key, &v)).transpose()
}

/// The number in `key`, `default` when unset; outside `range` it is refused.
pub(super) fn env_in(
    env: &dyn Fn(&str) -> Option<String>,
    key: &'static str,
    default: u64,
    range: std::ops::RangeInclusive<u64>,
) -> Result<u64, ConfigError> {
    let n = env_u64(env, key)?.unwrap_or(default);
    if !range.contains(&n) {
        let fix = format!("use {} to {}", range.start(), range.end());
        return Err(invalid(key, n.to_string(), fix));
    }
    Ok(n)
}

/// A pool size: at most [`MAX_NET_POOL_SIZE`], 0 turns the pool off.
pub(super) fn pool_size(key: &'static str, n: u64) -> Result<usize, ConfigError> {
    usize::try_from(n)
        .ok()
        .filter(|n| *n <= MAX_NET_POOL_SIZE)
        .ok_or_else(|| {
            invalid(
                key,
                n.to_string(),
                "use at most 1024 (0 turns the pool off)",
            )
        })
}

pub(super) fn hostname() -> String {
    nix::unistd::gethostname()
        .ok()
        .and_then(|h| h.into_string().ok())
        .unwrap_or_else(|| "node".into())
}
