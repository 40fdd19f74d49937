//! Cheaper login shells in `base`.
//!
//! The E2B SDKs run every command as `/bin/bash -l -c <cmd>`, so each command pays for the
//! login scripts. Debian's read as they come cost two extra processes per shell: `/etc/profile`
//! runs `id -u` in a command substitution to tell root from other users, and root's
//! `~/.profile` runs `mesg n` (which only matters on a terminal). Together they are about
//! 2.5 ms of the 4.4 ms a `bash -l -c true` takes in `base` on a 2-core host.
//!
//! The rewrite keeps what the scripts do: `/etc/profile` asks bash's `EUID` first and runs
//! `id -u` only in shells without it (dash); `mesg n` runs when standard input is a
//! terminal. Files that do not read as Debian ships them are left alone. (Bash takes `EUID`
//! from its environment when one is given there, so a command started with `EUID` in its
//! environment gets the `PATH` of that user id; nothing else depends on it.)

use std::path::Path;

/// `/etc/profile`: the root test as Debian writes it, and its replacement.
const PROFILE_ID: &str = "\"$(id -u)\"";
const PROFILE_ID_FAST: &str = "\"${EUID:-$(id -u)}\"";

/// Root's `.profile`: the `mesg` line as Debian writes it, and its replacement.
const MESG: &str = "mesg n 2> /dev/null || true";
const MESG_ON_TTY: &str = "if [ -t 0 ]; then mesg n 2> /dev/null || true; fi";

/// Rewrites the login scripts of the root filesystem at `rootfs`; returns which files
/// changed (paths relative to the root).
pub fn lighten_login_scripts(rootfs: &Path) -> std::io::Result<Vec<&'static str>> {
    let mut changed = Vec::new();
    for (file, from, to) in [
        ("etc/profile", PROFILE_ID, PROFILE_ID_FAST),
        ("root/.profile", MESG, MESG_ON_TTY),
    ] {
        if rewrite(&rootfs.join(file), from, to)? {
            changed.push(file);
        }
    }
    Ok(changed)
}

/// Replaces every `from` in the file by `to`; false when the file is missing, a symlink
/// (never followed out of the root filesystem), holds no `from`, or was rewritten before.
fn rewrite(path: &Path, from: &str, to: &str) -> std::io::Result<bool> {
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_file() => {}
        Ok(_) => return Ok(false),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(e),
    }
    let text = std::fs::read_to_string(path)?;
    if !text.contains(from) || text.contains(to) {
        return Ok(false);
    }
    std::fs::write(path, text.replace(from, to))?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;

    const DEBIAN_PROFILE: &str = "if [ \"$(id -u)\" -eq 0 ]; then\n  PATH=\"/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin\"\nelse\n  PATH=\"/usr/local/bin:/usr/bin:/bin\"\nfi\nexport PATH\n";
    const DEBIAN_ROOT_PROFILE: &str =
        "if [ \"$BASH\" ]; then\n  :\nfi\n\nmesg n 2> /dev/null || true\n";

    fn root_with_debian_scripts() -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("etc")).unwrap();
        std::fs::create_dir_all(dir.path().join("root")).unwrap();
        std::fs::write(dir.path().join("etc/profile"), DEBIAN_PROFILE).unwrap();
        std::fs::write(dir.path().join("root/.profile"), DEBIAN_ROOT_PROFILE).unwrap();
        dir
    }

    #[test]
    fn rewrites_debian_login_scripts_and_is_idempotent() {
        let dir = root_with_debian_scripts();
        let changed = lighten_login_scripts(dir.path()).unwrap();
        assert_eq!(changed, vec!["etc/profile", "root/.profile"]);
        let profile = std::fs::read_to_string(dir.path().join("etc/profile")).unwrap();
        assert!(
            profile.contains("[ \"${EUID:-$(id -u)}\" -eq 0 ]"),
            "{profile}"
        );
        let root = std::fs::read_to_string(dir.path().join("root/.profile")).unwrap();
        assert!(root.contains("if [ -t 0 ]; then mesg n"), "{root}");
        // A second pass finds nothing left to change.
        assert!(lighten_login_scripts(dir.path()).unwrap().is_empty());
    }

    #[test]
    fn rewritten_profile_still_tells_root_from_other_users_in_bash_and_sh() {
        let dir = root_with_debian_scripts();
        lighten_login_scripts(dir.path()).unwrap();
        let profile = dir.path().join("etc/profile");
        let script = format!(". {}; echo \"$PATH\"", profile.display());
        let uid = nix::unistd::geteuid().as_raw();
        let want_sbin = uid == 0;
        for shell in ["bash", "sh"] {
            let out = Command::new(shell).arg("-c").arg(&script).output().unwrap();
            assert!(out.status.success(), "{shell}: {out:?}");
            let path = String::from_utf8_lossy(&out.stdout);
            assert_eq!(path.contains("/usr/sbin"), want_sbin, "{shell}: {path}");
        }
    }

    #[test]
    fn leaves_other_files_and_symlinks_alone() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("etc")).unwrap();
        std::fs::create_dir_all(dir.path().join("root")).unwrap();
        std::fs::write(dir.path().join("etc/profile"), "export PATH=/bin\n").unwrap();
        let outside = dir.path().join("outside");
        std::fs::write(&outside, DEBIAN_ROOT_PROFILE).unwrap();
        std::os::unix::fs::symlink(&outside, dir.path().join("root/.profile")).unwrap();
        assert!(lighten_login_scripts(dir.path()).unwrap().is_empty());
        assert_eq!(
            std::fs::read_to_string(&outside).unwrap(),
            DEBIAN_ROOT_PROFILE
        );
        assert_eq!(
            std::fs::read_to_string(dir.path().join("etc/profile")).unwrap(),
            "export PATH=/bin\n"
        );
    }
}
