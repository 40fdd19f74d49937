//! Credentials of the node: the platform API key, the sandbox access-token seed and the
//! per-sandbox tokens derived from it.
//!
//! * The API key (`X-API-Key`, exactly one header) guards the control plane only.
//! * The envd token of a sandbox is `hex(HMAC-SHA256(seed, "<sandbox id>"))`, the traffic
//!   token `hex(HMAC-SHA256(seed, "sandbox-traffic-<sandbox id>"))`. Both are derived on
//!   demand and never stored.
//! * Secrets the node generates itself live in `<home>/secrets/` (mode 0700), one file
//!   each (mode 0600), created without ever replacing an existing file.

use std::io::{Read, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use hmac::{Hmac, Mac};
use http::HeaderMap;
use sha2::Sha256;
use subtle::ConstantTimeEq;

/// The managed API key file under `<home>/secrets/`.
pub const API_KEY_FILE: &str = "api-key";
/// The managed token seed file under `<home>/secrets/`.
pub const SEED_FILE: &str = "sandbox-access-token-hash-seed";
/// Largest secret file read.
const MAX_SECRET: u64 = 4096;

/// Errors of credential handling.
#[derive(Debug, thiserror::Error)]
pub enum AccessError {
    #[error("{context} ({}): {source}", path.display())]
    Io {
        context: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "secret file {} is unsafe: {reason}; fix its owner and mode (chmod 600) or remove it",
        path.display()
    )]
    Unsafe { path: PathBuf, reason: String },
    #[error("the API key from {origin} is invalid: {reason}")]
    InvalidKey { origin: String, reason: String },
    #[error("the sandbox access-token seed from {0} is empty: set a non-empty value")]
    EmptySeed(String),
}

fn io_err(context: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> AccessError {
    let path = path.to_path_buf();
    move |source| AccessError::Io {
        context,
        path,
        source,
    }
}

/// Where the API key came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyOrigin {
    Env,
    SecretFile,
    Managed,
    Generated,
}

/// Resolves the API key: `env` (the value of `AENV_API_KEY`), else the file
/// `secret_file` (`/run/secrets/api-key`) when it exists, else the managed file
/// `<home>/secrets/api-key`, else a new `e2b_<64 hex>` key stored there.
pub fn resolve_api_key(
    env: Option<String>,
    secret_file: &Path,
    home: &Path,
) -> Result<(String, KeyOrigin), AccessError> {
    if let Some(k) = env {
        validate_key(&k, "AENV_API_KEY")?;
        return Ok((k, KeyOrigin::Env));
    }
    if secret_file.exists() {
        let key = agentenv_core::api_key::load_from(None, secret_file).map_err(|e| {
            AccessError::InvalidKey {
                origin: secret_file.display().to_string(),
                reason: e.to_string(),
            }
        })?;
        return Ok((key, KeyOrigin::SecretFile));
    }
    let (key, created) = managed_secret(home, API_KEY_FILE, || format!("e2b_{}", random_hex(32)))?;
    let key = key.trim_end_matches(['\n', '\r']).to_string();
    validate_key(
        &key,
        &home
            .join("secrets")
            .join(API_KEY_FILE)
            .display()
            .to_string(),
    )?;
    Ok((
        key,
        if created {
            KeyOrigin::Generated
        } else {
            KeyOrigin::Managed
        },
    ))
}

fn validate_key(key: &str, origin: &str) -> Result<(), AccessError> {
    agentenv_core::api_key::validate(key, origin).map_err(|e| AccessError::InvalidKey {
        origin: origin.to_string(),
        reason: e.to_string(),
    })
}

/// Resolves the token seed: `explicit` (env or config, trimmed, non-empty), else the
/// managed file `<home>/secrets/sandbox-access-token-hash-seed` (created with 64 hex).
pub fn resolve_seed(explicit: Option<String>, home: &Path) -> Result<String, AccessError> {
    if let Some(s) = explicit {
        let s = s.trim().to_string();
        if s.is_empty() {
            return Err(AccessError::EmptySeed(
                "AENV_SANDBOX_ACCESS_TOKEN_HASH_SEED".into(),
            ));
        }
        return Ok(s);
    }
    let (seed, _) = managed_secret(home, SEED_FILE, || format!("{}\n", random_hex(32)))?;
    let seed = seed.trim().to_string();
    if seed.is_empty() {
        return Err(AccessError::EmptySeed(
            home.join("secrets").join(SEED_FILE).display().to_string(),
        ));
    }
    Ok(seed)
}

/// `n` random bytes as lowercase hex.
pub fn random_hex(n: usize) -> String {
    let mut bytes = vec![0u8; n];
    rand::fill(&mut bytes[..]);
    hex::encode(bytes)
}

/// Reads `<home>/secrets/<name>` or creates it with `make()`. Returns the content and
/// whether it was created. Never replaces an existing file: a new file is written to a
/// temporary name, synced and hard-linked into place, so a concurrent creator wins or
/// loses as a whole.
pub fn managed_secret(
    home: &Path,
    name: &str,
    make: impl FnOnce() -> String,
) -> Result<(String, bool), AccessError> {
    let dir = home.join("secrets");
    std::fs::create_dir_all(&dir).map_err(io_err("creating the secrets directory", &dir))?;
    let meta =
        std::fs::symlink_metadata(&dir).map_err(io_err("reading the secrets directory", &dir))?;
    if meta.file_type().is_symlink() || !meta.is_dir() {
        return Err(AccessError::Unsafe {
            path: dir,
            reason: "not a directory (or a symlink)".into(),
        });
    }
    let euid = nix::unistd::geteuid().as_raw();
    if meta.uid() != euid {
        return Err(AccessError::Unsafe {
            path: dir,
            reason: format!("owned by uid {}, not {euid}", meta.uid()),
        });
    }
    if meta.mode() & 0o777 != 0o700 {
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700))
            .map_err(io_err("tightening the secrets directory to 0700", &dir))?;
    }
    let path = dir.join(name);
    if let Some(s) = read_secret(&path)? {
        return Ok((s, false));
    }
    let tmp = dir.join(format!(".{name}.tmp-{}", random_hex(6)));
    let content = make();
    {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&tmp)
            .map_err(io_err("creating a secret file", &tmp))?;
        f.write_all(content.as_bytes())
            .and_then(|_| f.sync_all())
            .map_err(io_err("writing a secret file", &tmp))?;
    }
    let linked = std::fs::hard_link(&tmp, &path);
    let _ = std::fs::remove_file(&tmp);
    match linked {
        Ok(()) => {
            if let Ok(d) = std::fs::File::open(&dir) {
                let _ = d.sync_all();
            }
            Ok((content, true))
        }
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            // Another process created it first: use theirs.
            match read_secret(&path)? {
                Some(s) => Ok((s, false)),
                None => Err(AccessError::Io {
                    context: "reading a secret file",
                    path,
                    source: e,
                }),
            }
        }
        Err(e) => Err(AccessError::Io {
            context: "linking a secret file",
            path,
            source: e,
        }),
    }
}

/// Reads a managed secret: a regular file (no symlink) owned by us with mode 0600.
fn read_secret(path: &Path) -> Result<Option<String>, AccessError> {
    let f = match std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
    {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
            return Err(AccessError::Unsafe {
                path: path.to_path_buf(),
                reason: "a symlink".into(),
            });
        }
        Err(e) => return Err(io_err("opening a secret file", path)(e)),
    };
    let meta = f
        .metadata()
        .map_err(io_err("reading a secret file", path))?;
    let unsafe_ = |reason: String| AccessError::Unsafe {
        path: path.to_path_buf(),
        reason,
    };
    if !meta.is_file() {
        return Err(unsafe_("not a regular file".into()));
    }
    let euid = nix::unistd::geteuid().as_raw();
    if meta.uid() != euid {
        return Err(unsafe_(format!("owned by uid {}, not {euid}", meta.uid())));
    }
    if meta.mode() & 0o777 != 0o600 {
        return Err(unsafe_(format!("mode {:o}, not 600", meta.mode() & 0o777)));
    }
    let mut s = String::new();
    f.take(MAX_SECRET)
        .read_to_string(&mut s)
        .map_err(io_err("reading a secret file", path))?;
    Ok(Some(s))
}

/// Whether `headers` carry exactly one `X-API-Key` equal to `key` (constant time).
pub fn api_key_ok(headers: &HeaderMap, key: &str) -> bool {
    let mut values = headers.get_all("x-api-key").iter();
    let (Some(v), None) = (values.next(), values.next()) else {
        return false;
    };
    bool::from(v.as_bytes().ct_eq(key.as_bytes()))
}

/// Derives and checks sandbox tokens.
#[derive(Clone)]
pub struct TokenIssuer {
    seed: Vec<u8>,
}

impl std::fmt::Debug for TokenIssuer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TokenIssuer(..)")
    }
}

impl TokenIssuer {
    /// A token issuer keyed by the seed's UTF-8 bytes (not hex-decoded).
    pub fn new(seed: &str) -> Self {
        Self {
            seed: seed.as_bytes().to_vec(),
        }
    }

    fn mac(&self, msg: &str) -> [u8; 32] {
        let mut m = <Hmac<Sha256> as Mac>::new_from_slice(&self.seed)
            .expect("HMAC accepts keys of any length");
        m.update(msg.as_bytes());
        m.finalize().into_bytes().into()
    }

    /// The envd token of a sandbox (64 lowercase hex).
    pub fn envd_token(&self, sandbox_id: &str) -> String {
        hex::encode(self.mac(sandbox_id))
    }

    /// The traffic token of a sandbox (64 lowercase hex).
    pub fn traffic_token(&self, sandbox_id: &str) -> String {
        hex::encode(self.mac(&format!("sandbox-traffic-{sandbox_id}")))
    }

    fn verify(&self, msg: &str, candidate: &[u8]) -> bool {
        let Ok(bytes) = hex::decode(candidate) else {
            return false;
        };
        if bytes.len() != 32 {
            return false;
        }
        bool::from(self.mac(msg)[..].ct_eq(&bytes))
    }

    /// Checks a candidate envd token.
    pub fn verify_envd(&self, sandbox_id: &str, candidate: &[u8]) -> bool {
        self.verify(sandbox_id, candidate)
    }

    /// Checks a candidate traffic token.
    pub fn verify_traffic(&self, sandbox_id: &str, candidate: &[u8]) -> bool {
        self.verify(&format!("sandbox-traffic-{sandbox_id}"), candidate)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID: &str = "01936f8e-72f5-7000-8000-000000000001";

    #[test]
    fn tokens_match_the_reference_vector() {
        let t = TokenIssuer::new("test-seed");
        assert_eq!(
            t.envd_token(ID),
            "4f00f2a93a87c37161ae01c59b6d4f84506668113441277e9f6272dd4bfae1a7"
        );
        assert_eq!(
            t.traffic_token(ID),
            "586547d7c10facb0f4871297fdbfd9d2b4376f4b02b2e1487646c1c87a293bd8"
        );
        assert!(t.verify_envd(ID, t.envd_token(ID).as_bytes()));
        assert!(!t.verify_envd(ID, t.traffic_token(ID).as_bytes()));
        assert!(t.verify_traffic(ID, t.traffic_token(ID).as_bytes()));
        assert!(!t.verify_envd(ID, b"zz"));
        assert!(!t.verify_envd(ID, b"00"));
        let other = "01936f8e-72f5-7000-8000-000000000002";
        assert!(!t.verify_envd(other, t.envd_token(ID).as_bytes()));
    }

    #[test]
    fn api_key_needs_exactly_one_matching_header() {
        let key = "k".repeat(40);
        let mut h = HeaderMap::new();
        assert!(!api_key_ok(&h, &key));
        h.insert("x-api-key", key.parse().unwrap());
        assert!(api_key_ok(&h, &key));
        h.append("X-API-Key", key.parse().unwrap());
        assert!(!api_key_ok(&h, &key), "two headers are refused");
        let mut h = HeaderMap::new();
        h.insert("x-api-key", "wrong".parse().unwrap());
        assert!(!api_key_ok(&h, &key));
    }

    #[test]
    fn generated_key_is_stored_0600_and_never_replaced() {
        let home = tempfile::tempdir().unwrap();
        let none = home.path().join("no-such-secret");
        let (k1, o1) = resolve_api_key(None, &none, home.path()).unwrap();
        assert_eq!(o1, KeyOrigin::Generated);
        assert!(k1.starts_with("e2b_") && k1.len() == 68, "{k1}");
        assert!(k1[4..].bytes().all(|b| b.is_ascii_hexdigit()));
        let path = home.path().join("secrets").join(API_KEY_FILE);
        let meta = std::fs::metadata(&path).unwrap();
        assert_eq!(meta.mode() & 0o777, 0o600);
        let dir_meta = std::fs::metadata(home.path().join("secrets")).unwrap();
        assert_eq!(dir_meta.mode() & 0o777, 0o700);
        let (k2, o2) = resolve_api_key(None, &none, home.path()).unwrap();
        assert_eq!((k2.as_str(), o2), (k1.as_str(), KeyOrigin::Managed));
        let env = "x".repeat(32);
        let (k3, o3) = resolve_api_key(Some(env.clone()), &none, home.path()).unwrap();
        assert_eq!((k3, o3), (env, KeyOrigin::Env));
        assert_eq!(std::fs::read_to_string(&path).unwrap(), k1);
        // A too-open file is refused with the fix named.
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = resolve_api_key(None, &none, home.path()).unwrap_err();
        assert!(e.to_string().contains("chmod 600"), "{e}");
    }

    #[test]
    fn seed_is_generated_once_and_explicit_seed_wins() {
        let home = tempfile::tempdir().unwrap();
        let s1 = resolve_seed(None, home.path()).unwrap();
        assert_eq!(s1.len(), 64);
        assert_eq!(resolve_seed(None, home.path()).unwrap(), s1);
        assert_eq!(
            resolve_seed(Some("  abc ".into()), home.path()).unwrap(),
            "abc"
        );
        assert!(resolve_seed(Some("  ".into()), home.path()).is_err());
    }
}
