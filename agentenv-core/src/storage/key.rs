//! Storage keys: relative, `/`-separated paths, checked before any backend sees them.

use super::StorageError;

/// Checks a storage key: relative, `/`-separated, no empty, `.` or `..` segments.
pub fn validate_key(key: &str) -> Result<(), StorageError> {
    let ok = !key.is_empty()
        && !key.starts_with('/')
        && !key.ends_with('/')
        && !key.contains('\0')
        && key
            .split('/')
            .all(|s| !s.is_empty() && s != "." && s != "..");
    if ok {
        Ok(())
    } else {
        Err(StorageError::InvalidKey(key.to_string()))
    }
}

/// Checks a list prefix: empty, or a key followed by `/`.
pub(super) fn validate_prefix(prefix: &str) -> Result<(), StorageError> {
    if prefix.is_empty() {
        return Ok(());
    }
    match prefix.strip_suffix('/') {
        Some(p) => validate_key(p),
        None => Err(StorageError::InvalidKey(prefix.to_string())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_relative_paths_without_dot_segments() {
        for ok in ["a", "catalog/records/x.json", "snapshots/id/layer.tar"] {
            assert!(validate_key(ok).is_ok(), "{ok}");
        }
        for bad in ["", "/a", "a/", "a//b", "../x", "a/./b", "a/../b", "a\0b"] {
            assert!(validate_key(bad).is_err(), "{bad:?}");
        }
        assert!(validate_prefix("").is_ok());
        assert!(validate_prefix("catalog/").is_ok());
        assert!(validate_prefix("catalog").is_err());
    }
}
