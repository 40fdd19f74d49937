//! Resolving client paths: relative paths start at the user's home, `~`
//! means the home, and `.`/`..` are resolved lexically (never above `/`).

use std::path::{Component, Path, PathBuf};

/// Resolves `path` for a user whose home is `home`.
pub fn resolve(path: &str, home: &Path) -> PathBuf {
    let joined = if path == "~" {
        home.to_path_buf()
    } else if let Some(rest) = path.strip_prefix("~/") {
        home.join(rest)
    } else if path.starts_with('/') {
        PathBuf::from(path)
    } else {
        home.join(path)
    };
    clean(&joined)
}

/// Lexical cleaning of an absolute path: drops `.`, applies `..`, and keeps
/// the result at or below `/`.
pub fn clean(path: &Path) -> PathBuf {
    let mut out = PathBuf::from("/");
    for c in path.components() {
        match c {
            Component::Normal(n) => out.push(n),
            Component::ParentDir => {
                out.pop();
            }
            Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resolves_relative_home_and_dotdot() {
        let home = Path::new("/home/user");
        assert_eq!(resolve("a/b", home), PathBuf::from("/home/user/a/b"));
        assert_eq!(resolve("~", home), PathBuf::from("/home/user"));
        assert_eq!(resolve("~/x", home), PathBuf::from("/home/user/x"));
        assert_eq!(resolve("/tmp/a/../b/./c", home), PathBuf::from("/tmp/b/c"));
        assert_eq!(resolve("/../../etc", home), PathBuf::from("/etc"));
        assert_eq!(resolve("../../../..", home), PathBuf::from("/"));
    }
}
