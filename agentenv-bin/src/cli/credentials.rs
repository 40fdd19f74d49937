//! The credentials file written by `aenv auth`: TOML with `url` and `api_key`, at
//! `$XDG_CONFIG_HOME/aenv/credentials` (or `~/.config/aenv/credentials`), mode 0600.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// Errors of loading or saving credentials.
#[derive(Debug, thiserror::Error)]
pub enum CredentialsError {
    #[error(
        "not authenticated — run `aenv auth` first (expected credentials at {})",
        .0.display()
    )]
    Missing(PathBuf),
    #[error(
        "neither XDG_CONFIG_HOME nor HOME is set; set one of them so aenv can find its credentials"
    )]
    NoConfigDir,
    #[error("reading {}: {source}", path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("parsing {}: {source}; run `aenv auth` to rewrite it", path.display())]
    Parse {
        path: PathBuf,
        source: toml::de::Error,
    },
    #[error("writing {}: {source}", path.display())]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// Server URL and API key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Credentials {
    pub url: String,
    pub api_key: String,
}

/// Where the credentials file lives.
pub fn path() -> Result<PathBuf, CredentialsError> {
    if let Some(x) = std::env::var_os("XDG_CONFIG_HOME").filter(|v| !v.is_empty()) {
        let p = PathBuf::from(x);
        if p.is_absolute() {
            return Ok(p.join("aenv/credentials"));
        }
    }
    match std::env::var_os("HOME").filter(|v| !v.is_empty()) {
        Some(h) => Ok(PathBuf::from(h).join(".config/aenv/credentials")),
        None => Err(CredentialsError::NoConfigDir),
    }
}

/// Loads the credentials file at `path`.
pub fn load_from(path: &Path) -> Result<Credentials, CredentialsError> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(CredentialsError::Missing(path.to_path_buf()));
        }
        Err(source) => {
            return Err(CredentialsError::Read {
                path: path.to_path_buf(),
                source,
            });
        }
    };
    toml::from_str(&text).map_err(|source| CredentialsError::Parse {
        path: path.to_path_buf(),
        source,
    })
}

/// Loads the credentials from the default location.
pub fn load() -> Result<Credentials, CredentialsError> {
    load_from(&path()?)
}

/// Writes `creds` to `path` atomically with mode 0600 from the start (never readable by
/// others, not even briefly).
pub fn save_to(path: &Path, creds: &Credentials) -> Result<(), CredentialsError> {
    let werr = |source| CredentialsError::Write {
        path: path.to_path_buf(),
        source,
    };
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(werr)?;
    let text = toml::to_string(creds).map_err(|e| werr(std::io::Error::other(e)))?;
    let tmp = dir.join(format!(".credentials.{}.tmp", std::process::id()));
    let res = (|| {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)?;
        f.write_all(text.as_bytes())?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if res.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    res.map_err(werr)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn saved_credentials_round_trip_with_mode_0600() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("aenv/credentials");
        let c = Credentials {
            url: "http://127.0.0.1:8000".into(),
            api_key: "k".into(),
        };
        save_to(&p, &c).unwrap();
        assert_eq!(load_from(&p).unwrap(), c);
        let mode = std::fs::metadata(&p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
    }

    #[test]
    fn unknown_keys_are_ignored_and_bad_toml_names_the_file() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("credentials");
        std::fs::write(&p, "url = \"http://x\"\napi_key = \"k\"\nextra = 1\n").unwrap();
        assert_eq!(load_from(&p).unwrap().api_key, "k");
        std::fs::write(&p, "url = ").unwrap();
        let e = load_from(&p).unwrap_err().to_string();
        assert!(e.starts_with(&format!("parsing {}", p.display())), "{e}");
    }

    #[test]
    fn a_missing_file_says_to_run_auth() {
        let e = load_from(Path::new("/nonexistent/aenv/credentials"))
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "not authenticated — run `aenv auth` first (expected credentials at /nonexistent/aenv/credentials)"
        );
    }
}
