//! What a volume is on the store: its record (id, name, creation time), signed; its
//! access token, derived; and the rules for names and mount paths.

use hmac::{Hmac, Mac};
use serde::{Deserialize, Serialize};
use sha2::Sha256;
use subtle::ConstantTimeEq;

use super::VolumeError;

/// Longest volume name.
pub const MAX_NAME_LEN: usize = 63;

/// Most volumes one sandbox mounts.
pub const MAX_MOUNTS: usize = 16;

/// Longest mount path, in bytes.
pub const MAX_MOUNT_PATH: usize = 1024;

/// Where a volume may not be mounted: the sandbox's kernel and device file systems
/// and the agent's own directory (and anything beneath them).
const RESERVED_MOUNT_DIRS: &[&str] = &["/proc", "/sys", "/dev", "/agentenv"];

/// What the record key is derived for (see [`VolumeKey::from_seed`]).
const KEY_CONTEXT: &[u8] = b"agentenv volume v1";

/// Checks a volume name: 1 to 63 characters from `[A-Za-z0-9_-]`.
pub fn validate_name(name: &str) -> Result<(), VolumeError> {
    let ok = !name.is_empty()
        && name.len() <= MAX_NAME_LEN
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    if ok {
        Ok(())
    } else {
        Err(VolumeError::InvalidName(name.to_string()))
    }
}

/// Checks where a volume is mounted inside a sandbox: an absolute, normalized path (no
/// `.`, `..`, empty components or trailing `/`), not `/`, not under `/proc`, `/sys`,
/// `/dev` or the agent's `/agentenv`; the message says what to change.
pub fn validate_mount_path(path: &str) -> Result<(), String> {
    let bad = |why: &str| {
        Err(format!(
            "invalid volume mount path {path:?}: {why}, e.g. \"/mnt/data\""
        ))
    };
    if !path.starts_with('/') {
        return bad("use an absolute path");
    }
    if path == "/" {
        return bad("a volume cannot replace the sandbox's root");
    }
    if path.len() > MAX_MOUNT_PATH {
        return bad(&format!("use at most {MAX_MOUNT_PATH} bytes"));
    }
    if path.contains('\0') {
        return bad("a path has no NUL byte");
    }
    for c in path[1..].split('/') {
        if c.is_empty() || c == "." || c == ".." {
            return bad(
                "write it normalized: no empty, `.` or `..` components and no trailing `/`",
            );
        }
        if c.len() > 255 {
            return bad("a component has at most 255 bytes");
        }
    }
    for dir in RESERVED_MOUNT_DIRS {
        if is_within(path, dir) {
            return bad(&format!(
                "{dir} belongs to the sandbox's system, choose a path outside it"
            ));
        }
    }
    Ok(())
}

/// Whether `path` is `dir` or beneath it (both normalized and absolute).
pub fn is_within(path: &str, dir: &str) -> bool {
    path == dir
        || path
            .strip_prefix(dir)
            .is_some_and(|rest| rest.starts_with('/'))
}

/// Checks the mounts of one sandbox: each path valid, at most [`MAX_MOUNTS`], no path
/// twice and none beneath another (a volume is not mounted inside another).
pub fn validate_mounts<'a>(
    mounts: impl IntoIterator<Item = (&'a str, &'a str)>,
) -> Result<(), String> {
    let mut seen: Vec<&str> = Vec::new();
    for (name, path) in mounts {
        validate_name(name).map_err(|e| e.to_string())?;
        validate_mount_path(path)?;
        if seen.len() == MAX_MOUNTS {
            return Err(format!(
                "too many volume mounts: a sandbox mounts at most {MAX_MOUNTS} volumes"
            ));
        }
        for other in &seen {
            if *other == path {
                return Err(format!(
                    "volume mount path {path:?} is given twice: mount one volume per path"
                ));
            }
            if is_within(path, other) || is_within(other, path) {
                let (outer, inner) = if is_within(path, other) {
                    (*other, path)
                } else {
                    (path, *other)
                };
                return Err(format!(
                    "volume mount path {inner:?} is inside the mount {outer:?}: volumes do not nest, choose paths side by side"
                ));
            }
        }
        seen.push(path);
    }
    Ok(())
}

/// The record of a volume: what every node reads to find it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct VolumeRecord {
    pub version: u32,
    pub id: String,
    pub name: String,
    pub created_at_ms: u64,
}

/// A signed object on the store: the body (JSON) and the hex HMAC over its key and body.
#[derive(Debug, Serialize, Deserialize)]
pub(super) struct Envelope {
    pub body: String,
    pub signature: String,
}

/// The key that signs volume records and derives volume tokens:
/// HMAC-SHA256(seed, "agentenv volume v1"). Nodes that share a store must share the seed
/// (`AENV_SANDBOX_ACCESS_TOKEN_HASH_SEED`), as for snapshots and templates.
#[derive(Clone)]
pub struct VolumeKey([u8; 32]);

impl std::fmt::Debug for VolumeKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("VolumeKey(..)")
    }
}

fn hmac(key: &[u8], parts: &[&[u8]]) -> [u8; 32] {
    let mut m = <Hmac<Sha256> as Mac>::new_from_slice(key).expect("HMAC takes any key length");
    for p in parts {
        m.update(&(p.len() as u64).to_be_bytes());
        m.update(p);
    }
    m.finalize().into_bytes().into()
}

impl VolumeKey {
    /// The key of a node whose token seed is `seed`.
    pub fn from_seed(seed: &str) -> Self {
        Self(hmac(seed.as_bytes(), &[KEY_CONTEXT]))
    }

    /// The envelope of `body` stored under `key`.
    pub(super) fn seal(&self, key: &str, body: String) -> Envelope {
        let signature = hex::encode(hmac(&self.0, &[b"object", key.as_bytes(), body.as_bytes()]));
        Envelope { body, signature }
    }

    /// Whether `env` was sealed for `key` with this key (constant-time).
    pub(super) fn verifies(&self, key: &str, env: &Envelope) -> bool {
        let Ok(given) = hex::decode(&env.signature) else {
            return false;
        };
        let want = hmac(&self.0, &[b"object", key.as_bytes(), env.body.as_bytes()]);
        bool::from(want[..].ct_eq(&given))
    }

    /// The access token of volume `id` (what `POST /volumes` and `GET /volumes/{id}`
    /// return, and the content API takes as `Authorization: Bearer`): derived, never
    /// stored, so reading the store does not give it away.
    pub fn token(&self, id: &str) -> String {
        hex::encode(hmac(&self.0, &[b"token", id.as_bytes()]))
    }

    /// Whether `given` is volume `id`'s token (constant-time).
    pub fn token_ok(&self, id: &str, given: &str) -> bool {
        let want = self.token(id);
        want.len() == given.len() && bool::from(want.as_bytes().ct_eq(given.as_bytes()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_short_and_plain() {
        for ok in ["a", "my-vol_1", &"x".repeat(63), "UPPER"] {
            assert!(validate_name(ok).is_ok(), "{ok}");
        }
        for bad in ["", &"x".repeat(64), "a b", "a/b", "..", "a.b", "é"] {
            let e = validate_name(bad).unwrap_err().to_string();
            assert!(e.contains("1 to 63 characters from [A-Za-z0-9_-]"), "{e}");
        }
    }

    #[test]
    fn mount_paths_are_absolute_normalized_and_outside_the_system() {
        for ok in [
            "/mnt/v",
            "/data",
            "/home/user/work",
            "/procfs",
            "/devices/x",
        ] {
            assert!(validate_mount_path(ok).is_ok(), "{ok}");
        }
        for (bad, why) in [
            ("mnt/v", "absolute"),
            ("/", "root"),
            ("/mnt/", "normalized"),
            ("/mnt//v", "normalized"),
            ("/mnt/./v", "normalized"),
            ("/mnt/../etc", "normalized"),
            ("/proc", "/proc belongs"),
            ("/proc/sys", "/proc belongs"),
            ("/sys/fs/cgroup", "/sys belongs"),
            ("/dev/shm", "/dev belongs"),
            ("/agentenv", "/agentenv belongs"),
            ("/agentenv/x", "/agentenv belongs"),
            ("/a\0b", "NUL"),
        ] {
            let e = validate_mount_path(bad).unwrap_err();
            assert!(e.contains(why), "{bad:?}: {e}");
            assert!(e.contains("e.g. \"/mnt/data\""), "{e}");
        }
        assert!(validate_mount_path(&format!("/{}", "a".repeat(256))).is_err());
        assert!(
            validate_mount_path(&format!("/{}", "a/".repeat(600).trim_end_matches('/'))).is_err()
        );
    }

    #[test]
    fn a_sandbox_mounts_few_volumes_side_by_side() {
        assert!(validate_mounts([("a", "/mnt/a"), ("b", "/mnt/b"), ("a", "/mnt/ab")]).is_ok());
        let e = validate_mounts([("a", "/mnt/a"), ("b", "/mnt/a")]).unwrap_err();
        assert!(e.contains("given twice"), "{e}");
        let e = validate_mounts([("a", "/mnt/a/b"), ("b", "/mnt/a")]).unwrap_err();
        assert!(
            e.contains("\"/mnt/a/b\" is inside the mount \"/mnt/a\""),
            "{e}"
        );
        let e = validate_mounts([("a b", "/mnt/a")]).unwrap_err();
        assert!(e.contains("invalid volume name"), "{e}");
        let many: Vec<(String, String)> = (0..=MAX_MOUNTS)
            .map(|i| ("v".to_string(), format!("/m/{i}")))
            .collect();
        let e = validate_mounts(many.iter().map(|(n, p)| (n.as_str(), p.as_str()))).unwrap_err();
        assert!(e.contains("at most 16"), "{e}");
    }

    #[test]
    fn envelopes_and_tokens_are_bound_to_their_key_and_volume() {
        let k = VolumeKey::from_seed("seed");
        let env = k.seal("volumes/records/a.json", "{}".into());
        assert!(k.verifies("volumes/records/a.json", &env));
        assert!(!k.verifies("volumes/records/b.json", &env), "moved");
        assert!(!VolumeKey::from_seed("other").verifies("volumes/records/a.json", &env));
        let tampered = Envelope {
            body: "{\"x\":1}".into(),
            signature: env.signature.clone(),
        };
        assert!(!k.verifies("volumes/records/a.json", &tampered));
        let t = k.token("vol-1");
        assert_eq!(t.len(), 64);
        assert!(k.token_ok("vol-1", &t));
        assert!(!k.token_ok("vol-2", &t));
        assert!(!k.token_ok("vol-1", &t[..63]));
        assert_ne!(VolumeKey::from_seed("other").token("vol-1"), t);
    }
}
