//! The gateway's API key: read from `AENV_API_KEY`, or else from the secret
//! file `/run/secrets/api-key`, and validated (32–256 URL-safe characters).

use std::ffi::OsString;
use std::io::Read;
use std::path::{Path, PathBuf};

/// The environment variable that holds the key.
pub const API_KEY_ENV: &str = "AENV_API_KEY";
/// Where the key is read from when the environment variable is absent.
pub const DEFAULT_SECRET_PATH: &str = "/run/secrets/api-key";
/// At most this many bytes of the secret file are read.
const MAX_READ: u64 = 259;
const MIN_LEN: usize = 32;
const MAX_LEN: usize = 256;

/// Why no usable API key was found.
#[derive(Debug, thiserror::Error)]
pub enum ApiKeyError {
    #[error("{API_KEY_ENV} must be set or {} must exist", path.display())]
    Missing { path: PathBuf },
    #[error("read secret {}: {source}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("read secret {}: must be a regular file", path.display())]
    NotRegularFile { path: PathBuf },
    #[error(
        "API key from {origin} must contain between 32 and 256 URL-safe characters (A-Z, a-z, 0-9, '.', '_', '~', '-')"
    )]
    Invalid { origin: String },
}

/// Loads the key from the process environment or [`DEFAULT_SECRET_PATH`].
pub fn load() -> Result<String, ApiKeyError> {
    load_from(
        std::env::var_os(API_KEY_ENV),
        Path::new(DEFAULT_SECRET_PATH),
    )
}

/// Loads the key: `env` (the value of `AENV_API_KEY`) wins whenever it is
/// present, even when empty; otherwise the secret file at `path` is read.
pub fn load_from(env: Option<OsString>, path: &Path) -> Result<String, ApiKeyError> {
    if let Some(value) = env {
        let key = value.into_string().map_err(|_| ApiKeyError::Invalid {
            origin: API_KEY_ENV.into(),
        })?;
        validate(&key, API_KEY_ENV)?;
        return Ok(key);
    }
    let key = read_secret(path)?;
    validate(&key, &path.display().to_string())?;
    Ok(key)
}

/// Checks length 32..=256 and the `[A-Za-z0-9._~-]` alphabet.
pub fn validate(key: &str, origin: &str) -> Result<(), ApiKeyError> {
    let ok = (MIN_LEN..=MAX_LEN).contains(&key.len())
        && key
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'~' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(ApiKeyError::Invalid {
            origin: origin.into(),
        })
    }
}

/// Reads a secret file: symlinks are followed, anything but a regular file
/// (a FIFO, a directory) is refused before it is opened, at most 259 bytes
/// are read, and one trailing `\n` then one trailing `\r` are removed.
pub(crate) fn read_secret(path: &Path) -> Result<String, ApiKeyError> {
    let read_err = |source: std::io::Error| ApiKeyError::Read {
        path: path.to_path_buf(),
        source,
    };
    let meta = match std::fs::metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(ApiKeyError::Missing {
                path: path.to_path_buf(),
            });
        }
        Err(e) => return Err(read_err(e)),
    };
    if !meta.is_file() {
        return Err(ApiKeyError::NotRegularFile {
            path: path.to_path_buf(),
        });
    }
    let file = std::fs::File::open(path).map_err(read_err)?;
    // The path may have been swapped between the check and the open.
    if !file.metadata().map_err(read_err)?.is_file() {
        return Err(ApiKeyError::NotRegularFile {
            path: path.to_path_buf(),
        });
    }
    let mut bytes = Vec::new();
    file.take(MAX_READ)
        .read_to_end(&mut bytes)
        .map_err(read_err)?;
    if bytes.last() == Some(&b'\n') {
        bytes.pop();
    }
    if bytes.last() == Some(&b'\r') {
        bytes.pop();
    }
    // Non-UTF-8 bytes can never pass validation; keep them visible as such.
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = "e2b_0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

    #[test]
    fn a_68_char_e2b_key_is_valid_and_malformed_keys_are_not() {
        assert_eq!(GOOD.len(), 68);
        assert!(validate(GOOD, "x").is_ok());
        let bad = [
            String::new(),
            "too-short".into(),
            format!(" {}", &GOOD[1..]),
            format!("{GOOD}\n"),
            "a".repeat(31),
            "a".repeat(257),
            format!("{}!", "a".repeat(31)),
        ];
        for key in bad {
            let err = validate(&key, API_KEY_ENV).unwrap_err();
            assert_eq!(
                err.to_string(),
                "API key from AENV_API_KEY must contain between 32 and 256 URL-safe characters (A-Z, a-z, 0-9, '.', '_', '~', '-')",
                "{key:?}"
            );
        }
        assert!(validate(&"a".repeat(32), "x").is_ok());
        assert!(validate(&"Az09._~-".repeat(32), "x").is_ok());
    }

    #[test]
    fn the_key_is_read_from_the_environment() {
        let dir = tempfile::tempdir().unwrap();
        let key = load_from(Some(GOOD.into()), &dir.path().join("absent")).unwrap();
        assert_eq!(key, GOOD);
    }

    #[test]
    fn an_empty_environment_value_is_an_error_without_falling_back_to_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("api-key");
        std::fs::write(&path, GOOD).unwrap();
        let err = load_from(Some(OsString::new()), &path).unwrap_err();
        assert!(
            matches!(err, ApiKeyError::Invalid { ref origin } if origin == API_KEY_ENV),
            "{err}"
        );
    }

    #[test]
    fn the_key_is_read_from_the_file_without_its_line_ending() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("api-key");
        std::fs::write(&path, format!("{GOOD}\n")).unwrap();
        assert_eq!(load_from(None, &path).unwrap(), GOOD);
        std::fs::write(&path, format!("{GOOD}\r\n")).unwrap();
        assert_eq!(load_from(None, &path).unwrap(), GOOD);
        std::fs::write(&path, format!("{GOOD}\n\n")).unwrap();
        let err = load_from(None, &path).unwrap_err();
        assert!(
            err.to_string()
                .starts_with(&format!("API key from {}", path.display())),
            "{err}"
        );
    }

    #[test]
    fn a_file_longer_than_the_limit_is_rejected() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("api-key");
        std::fs::write(&path, "a".repeat(400)).unwrap();
        assert!(matches!(
            load_from(None, &path),
            Err(ApiKeyError::Invalid { .. })
        ));
        std::fs::write(&path, format!("{}\n", "a".repeat(256))).unwrap();
        assert_eq!(load_from(None, &path).unwrap().len(), 256);
    }

    #[test]
    fn a_missing_file_without_the_variable_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("api-key");
        let err = load_from(None, &path).unwrap_err();
        assert_eq!(
            err.to_string(),
            format!("AENV_API_KEY must be set or {} must exist", path.display())
        );
    }

    #[test]
    fn a_fifo_at_the_secret_path_is_rejected_without_blocking() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("api-key");
        let made = std::process::Command::new("mkfifo").arg(&path).status();
        match made {
            Ok(s) if s.success() => {}
            other => {
                eprintln!("skipping: cannot create a FIFO with mkfifo ({other:?})");
                return;
            }
        }
        let err = load_from(None, &path).unwrap_err();
        assert!(matches!(err, ApiKeyError::NotRegularFile { .. }), "{err}");
        assert!(err.to_string().ends_with("must be a regular file"));
    }

    #[test]
    fn a_symlinked_secret_file_is_accepted() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("real-key");
        std::fs::write(&target, format!("{GOOD}\n")).unwrap();
        let link = dir.path().join("api-key");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        assert_eq!(load_from(None, &link).unwrap(), GOOD);
    }

    #[test]
    fn a_directory_is_not_a_secret_file() {
        let dir = tempfile::tempdir().unwrap();
        assert!(matches!(
            load_from(None, dir.path()),
            Err(ApiKeyError::NotRegularFile { .. })
        ));
    }
}
