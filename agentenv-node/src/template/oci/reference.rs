//! Image references (`registry/repository:tag@digest`) and the default registry of
//! unqualified names.

use std::fmt;
use std::path::Path;

use super::OciError;

/// Environment variable naming the registry of unqualified image names.
pub const DEFAULT_REGISTRY_ENV: &str = "AENV_OCI_DEFAULT_REGISTRY";
/// The host's containers configuration, read for `unqualified-search-registries`.
pub const REGISTRIES_CONF: &str = "/etc/containers/registries.conf";

/// A parsed image reference.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageRef {
    /// Host (and port) of the registry, as written.
    pub registry: String,
    /// Repository path inside the registry (`org/img`).
    pub repository: String,
    /// Tag; `latest` when neither a tag nor a digest was given.
    pub tag: Option<String>,
    /// `sha256:<hex>` when the reference pins one.
    pub digest: Option<String>,
    /// The name had no registry part and a single path component (`python`): on a
    /// registry following Docker Hub's convention it lives under `library/`.
    pub(crate) short_name: bool,
}

impl fmt::Display for ImageRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.registry, self.repository)?;
        if let Some(t) = &self.tag {
            write!(f, ":{t}")?;
        }
        if let Some(d) = &self.digest {
            write!(f, "@{d}")?;
        }
        Ok(())
    }
}

fn bad(reference: &str, reason: impl Into<String>) -> OciError {
    OciError::BadReference {
        reference: reference.to_string(),
        reason: reason.into(),
    }
}

/// Whether `s` is `sha256:` and 64 lowercase hex digits.
pub(crate) fn valid_digest(s: &str) -> bool {
    s.strip_prefix("sha256:").is_some_and(|h| {
        h.len() == 64
            && h.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    })
}

fn valid_component(c: &str) -> bool {
    !c.is_empty()
        && c.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-".contains(&b))
        && c.as_bytes()[0].is_ascii_alphanumeric()
        && c.as_bytes()[c.len() - 1].is_ascii_alphanumeric()
}

fn valid_tag(t: &str) -> bool {
    !t.is_empty()
        && t.len() <= 128
        && (t.as_bytes()[0].is_ascii_alphanumeric() || t.as_bytes()[0] == b'_')
        && t.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"_.-".contains(&b))
}

fn valid_registry(r: &str) -> bool {
    !r.is_empty()
        && r.len() <= 255
        && r.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b".-:[]".contains(&b))
}

impl ImageRef {
    /// Parses a reference that names its registry (`registry.example/org/img:tag`,
    /// `127.0.0.1:5000/x@sha256:…`); `Ok(None)` when it names none (`python:3.11`).
    pub fn parse_qualified(reference: &str) -> Result<Option<Self>, OciError> {
        Self::split(reference, None)
    }

    /// Parses `reference`; an unqualified name goes to `default_registry`.
    pub fn parse_with_default(reference: &str, default_registry: &str) -> Result<Self, OciError> {
        Self::split(reference, Some(default_registry))
            .map(|r| r.expect("a default registry was given"))
    }

    /// Parses `reference`; an unqualified name goes to the default registry of the
    /// environment or the host (see [`default_registry`]).
    pub fn parse(reference: &str) -> Result<Self, OciError> {
        match Self::parse_qualified(reference)? {
            Some(r) => Ok(r),
            None => {
                let reg = default_registry(None, Path::new(REGISTRIES_CONF), reference)?;
                Self::parse_with_default(reference, &reg)
            }
        }
    }

    fn split(reference: &str, default: Option<&str>) -> Result<Option<Self>, OciError> {
        if reference.is_empty() || reference.len() > 512 {
            return Err(bad(reference, "a reference has 1 to 512 characters"));
        }
        let (rest, digest) = match reference.rsplit_once('@') {
            Some((r, d)) => {
                if !valid_digest(d) {
                    return Err(bad(
                        reference,
                        "the digest must be sha256: and 64 lowercase hex digits",
                    ));
                }
                (r, Some(d.to_string()))
            }
            None => (reference, None),
        };
        let (first, after) = match rest.split_once('/') {
            Some((f, a)) => (f, Some(a)),
            None => (rest, None),
        };
        let qualified =
            after.is_some() && (first.contains('.') || first.contains(':') || first == "localhost");
        let (registry, path) = match (qualified, after) {
            (true, Some(a)) => (first.to_string(), a),
            _ => match default {
                Some(d) => (d.trim_end_matches('/').to_string(), rest),
                None => return Ok(None),
            },
        };
        if !valid_registry(&registry) {
            return Err(bad(
                reference,
                format!("{registry:?} is not a registry host"),
            ));
        }
        let last_slash = path.rfind('/').map_or(0, |i| i + 1);
        let (repository, tag) = match path[last_slash..].rsplit_once(':') {
            Some((_, t)) => (&path[..path.len() - t.len() - 1], Some(t.to_string())),
            None => (path, None),
        };
        if let Some(t) = &tag {
            if !valid_tag(t) {
                return Err(bad(
                    reference,
                    format!("{t:?} is not a tag ([A-Za-z0-9_.-], at most 128)"),
                ));
            }
        }
        if repository.len() > 255 || !repository.split('/').all(valid_component) {
            return Err(bad(
                reference,
                format!(
                    "{repository:?} is not a repository: lowercase letters, digits and `._-` between slashes"
                ),
            ));
        }
        let tag = match (&tag, &digest) {
            (None, None) => Some("latest".to_string()),
            _ => tag,
        };
        Ok(Some(Self {
            registry,
            short_name: !qualified && !repository.contains('/'),
            repository: repository.to_string(),
            tag,
            digest,
        }))
    }

    /// What to ask the registry's manifests endpoint for: the digest if pinned, else
    /// the tag.
    pub fn manifest_ref(&self) -> &str {
        self.digest
            .as_deref()
            .or(self.tag.as_deref())
            .unwrap_or("latest")
    }

    /// This reference pinned to `digest`.
    pub fn with_digest(&self, digest: &str) -> Self {
        Self {
            digest: Some(digest.to_string()),
            ..self.clone()
        }
    }
}

/// The registry of unqualified image names: `explicit` (the caller's setting, the node's
/// `template.default_registry`), else [`DEFAULT_REGISTRY_ENV`], else the first entry of
/// `unqualified-search-registries` in `registries_conf`, else an error saying so.
pub fn default_registry(
    explicit: Option<&str>,
    registries_conf: &Path,
    name: &str,
) -> Result<String, OciError> {
    if let Some(r) = explicit.filter(|r| !r.trim().is_empty()) {
        return Ok(r.trim().to_string());
    }
    if let Some(r) = std::env::var(DEFAULT_REGISTRY_ENV)
        .ok()
        .filter(|r| !r.trim().is_empty())
    {
        return Ok(r.trim().to_string());
    }
    if let Some(r) = RegistriesConf::read(registries_conf)?
        .unqualified_search_registries
        .into_iter()
        .find(|r| !r.trim().is_empty())
    {
        return Ok(r.trim().to_string());
    }
    Err(OciError::NoRegistry {
        name: name.to_string(),
    })
}

/// What the node reads of containers-registries.conf(5).
#[derive(Debug, Default, serde::Deserialize)]
pub struct RegistriesConf {
    #[serde(default, rename = "unqualified-search-registries")]
    pub unqualified_search_registries: Vec<String>,
    #[serde(default)]
    pub registry: Vec<RegistryEntry>,
}

/// A `[[registry]]` table: where a registry name is served and whether over plain HTTP.
#[derive(Debug, Clone, Default, serde::Deserialize)]
pub struct RegistryEntry {
    #[serde(default)]
    pub prefix: Option<String>,
    #[serde(default)]
    pub location: Option<String>,
    #[serde(default)]
    pub insecure: bool,
}

impl RegistriesConf {
    /// Reads `path`; a missing file is an empty configuration.
    pub fn read(path: &Path) -> Result<Self, OciError> {
        let raw = match std::fs::read_to_string(path) {
            Ok(r) => r,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Self::default()),
            Err(e) => {
                return Err(OciError::Config {
                    path: path.to_path_buf(),
                    reason: e.to_string(),
                });
            }
        };
        toml::from_str(&raw).map_err(|e| OciError::Config {
            path: path.to_path_buf(),
            reason: e.to_string(),
        })
    }

    /// The `[[registry]]` entry whose prefix (or location) is exactly `registry`.
    pub fn entry(&self, registry: &str) -> Option<&RegistryEntry> {
        self.registry.iter().find(|e| {
            e.prefix.as_deref().or(e.location.as_deref()) == Some(registry)
                || e.location.as_deref() == Some(registry)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const D: &str = "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

    #[test]
    fn oci_reference_forms() {
        let r = ImageRef::parse_with_default("python:3.11-slim", "reg.example").unwrap();
        assert_eq!(
            (
                r.registry.as_str(),
                r.repository.as_str(),
                r.tag.as_deref(),
                r.digest.as_deref()
            ),
            ("reg.example", "python", Some("3.11-slim"), None)
        );
        assert!(r.short_name);
        let r = ImageRef::parse_qualified(&format!("ghcr.io/org/img@{D}"))
            .unwrap()
            .unwrap();
        assert_eq!(
            (r.registry.as_str(), r.repository.as_str(), r.tag.as_deref()),
            ("ghcr.io", "org/img", None)
        );
        assert_eq!(r.digest.as_deref(), Some(D));
        assert_eq!(r.manifest_ref(), D);
        let r = ImageRef::parse_qualified("127.0.0.1:5000/x/y:tag")
            .unwrap()
            .unwrap();
        assert_eq!(
            (r.registry.as_str(), r.repository.as_str(), r.tag.as_deref()),
            ("127.0.0.1:5000", "x/y", Some("tag"))
        );
        assert!(!r.short_name);
        assert_eq!(r.to_string(), "127.0.0.1:5000/x/y:tag");
        let r = ImageRef::parse_with_default("img", "reg.example:5000").unwrap();
        assert_eq!(r.tag.as_deref(), Some("latest"));
        assert_eq!(r.to_string(), "reg.example:5000/img:latest");
        let r = ImageRef::parse_with_default("org/img", "reg.example").unwrap();
        assert_eq!(r.repository, "org/img");
        assert!(!r.short_name);
        let r = ImageRef::parse_qualified("localhost/img").unwrap().unwrap();
        assert_eq!(r.registry, "localhost");
        assert!(ImageRef::parse_qualified("img:1").unwrap().is_none());
        assert!(ImageRef::parse_qualified("org/img").unwrap().is_none());
        let r = ImageRef::parse_qualified(&format!("reg.example/a:t@{D}"))
            .unwrap()
            .unwrap();
        assert_eq!((r.tag.as_deref(), r.manifest_ref()), (Some("t"), D));
    }

    #[test]
    fn oci_bad_references_are_refused() {
        for bad in [
            "",
            "reg.example/UPPER",
            "reg.example/a:bad/tag",
            "reg.example/a@sha256:xyz",
            "reg.example/a@md5:0123",
            "reg.example//a",
            "reg.example/a:",
            "reg.example/-a",
            "bad host!/a",
        ] {
            assert!(
                matches!(
                    ImageRef::parse_with_default(bad, "reg.example"),
                    Err(OciError::BadReference { .. })
                ),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn oci_default_registry_sources() {
        let dir = tempfile::tempdir().unwrap();
        let conf = dir.path().join("registries.conf");
        // The explicit setting wins (the environment is not consulted then).
        assert_eq!(
            default_registry(Some("mine.example"), &conf, "img").unwrap(),
            "mine.example"
        );
        // Tests run in one process: only read the variable, never set it.
        if std::env::var_os(DEFAULT_REGISTRY_ENV).is_none() {
            let e = default_registry(None, &conf, "img").unwrap_err();
            let msg = e.to_string();
            assert!(msg.contains("AENV_OCI_DEFAULT_REGISTRY"), "{msg}");
            assert!(msg.contains("registries.conf"), "{msg}");
            assert!(msg.contains("registry.example/img"), "{msg}");
            std::fs::write(
                &conf,
                "unqualified-search-registries = [\"first.example\", \"second.example\"]\n\
                 [[registry]]\nprefix = \"first.example\"\nlocation = \"mirror.example:5000\"\ninsecure = true\n",
            )
            .unwrap();
            assert_eq!(
                default_registry(None, &conf, "img").unwrap(),
                "first.example"
            );
            let c = RegistriesConf::read(&conf).unwrap();
            let e = c.entry("first.example").unwrap();
            assert_eq!(e.location.as_deref(), Some("mirror.example:5000"));
            assert!(e.insecure);
            std::fs::write(&conf, "unqualified-search-registries = 3").unwrap();
            assert!(matches!(
                default_registry(None, &conf, "img"),
                Err(OciError::Config { .. })
            ));
        }
    }
}
