//! Pulling OCI images from a registry into a layer cache and flattening them into a root
//! filesystem.
//!
//! [`pull`] resolves a reference ([`ImageRef`]; an unqualified name goes to the default
//! registry of [`reference::default_registry`], no public registry is built in), fetches
//! the manifest (an OCI index or Docker manifest list resolves to linux/amd64), the
//! config and every layer blob not yet in the [`LayerCache`], verifying each blob's size
//! as it streams and its sha256 digest before it enters the cache.
//! [`PulledImage::unpack_into`] then applies the layers in order with
//! [`crate::template::apply`].
//!
//! # Why a client of our own
//!
//! The registry client is written here over hyper (http for loopback and insecure
//! registries, https with rustls, the system roots and an optional extra CA). The
//! `oci-client` crate (0.18) was evaluated first: it reads manifests, error and token
//! responses whole with no bound (a hostile registry can exhaust the node's memory), has
//! no overall request timeout, builds on reqwest 0.13 whose rustls feature brings
//! aws-lc-rs (the workspace uses ring), and its `Reference` resolves unqualified names
//! to a public registry, which this project must not do. The read side of the
//! distribution API needed here (manifests, blobs, redirects, basic and bearer auth) is
//! small, and written here it is bounded everywhere.
//!
//! # Limits
//!
//! Every request and every body read has [`PullOptions::request_timeout`]; manifests and
//! configs are at most [`PullOptions::max_manifest_bytes`]; the layers and config of one
//! image at most [`PullOptions::max_image_bytes`] together. Credentials
//! ([`RegistryAuth`]) go to the registry and its token service only, never to storage a
//! blob request is redirected to, and are never logged.
//!
//! # Docker Hub's `library/`
//!
//! A single-component name resolved against the default registry (`python`) is asked
//! for as written first; when the registry answers that it does not exist (404, or a
//! refusal after authentication, which is how Docker Hub answers for a repository that
//! does not exist), it is asked for as `library/<name>`: Docker Hub's convention is
//! followed for whichever registry keeps its official images there, without naming one.

pub mod cache;
pub mod manifest;
pub mod reference;
mod registry;

use std::fmt;
use std::io::{BufReader, Read};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use sha2::{Digest, Sha256};

pub use cache::LayerCache;
pub use manifest::{ImageConfig, LayerMediaType};
pub use reference::{DEFAULT_REGISTRY_ENV, ImageRef, REGISTRIES_CONF, RegistriesConf};

use crate::template::apply::{ApplyError, ApplyOptions, ApplyStats, apply_layer};
use manifest::{Fetched, MANIFEST_ACCEPT, Manifest};
use registry::Registry;

/// Progress of a pull: one line at a time.
pub type Progress = Arc<dyn Fn(&str) + Send + Sync>;

/// Errors of pulling and unpacking an image.
#[derive(Debug, thiserror::Error)]
pub enum OciError {
    #[error(
        "image {name:?} names no registry: set AENV_OCI_DEFAULT_REGISTRY (or the node's template.default_registry), list one in /etc/containers/registries.conf unqualified-search-registries, or use a full reference like registry.example/{name}"
    )]
    NoRegistry { name: String },
    #[error("invalid image reference {reference:?}: {reason}")]
    BadReference { reference: String, reason: String },
    #[error("reading {}: {reason}; fix the file or set AENV_OCI_DEFAULT_REGISTRY", path.display())]
    Config { path: PathBuf, reason: String },
    #[error(
        "registry {registry} is unreachable ({url}): {reason}; check the registry's name and port, and list a plain-HTTP registry in insecure_registries"
    )]
    Unreachable {
        registry: String,
        url: String,
        reason: String,
    },
    #[error(
        "registry {registry} did not answer for {what} within {timeout:?}; check the network or raise request_timeout"
    )]
    Timeout {
        registry: String,
        what: String,
        timeout: Duration,
    },
    #[error("fetching {what} from registry {registry} broke off: {reason}; try again")]
    Transfer {
        registry: String,
        what: String,
        reason: String,
    },
    #[error("registry {registry} refused authentication: {reason}")]
    Auth { registry: String, reason: String },
    #[error("{what} not found on registry {registry}: check the repository name and tag")]
    NotFound { registry: String, what: String },
    #[error("registry {registry} answered HTTP {status} for {what}: {message}")]
    Registry {
        registry: String,
        what: String,
        status: u16,
        message: String,
    },
    #[error("the manifest of {reference}: {reason}")]
    BadManifest { reference: String, reason: String },
    #[error("{reference} has no linux/amd64 image (it has: {available})")]
    NoPlatform {
        reference: String,
        available: String,
    },
    #[error("{reference}: {reason}")]
    Unsupported { reference: String, reason: String },
    #[error(
        "{what}: its content has digest {actual}, not {expected}; the registry sent corrupt or tampered data, and nothing of it was cached"
    )]
    DigestMismatch {
        what: String,
        expected: String,
        actual: String,
    },
    #[error(
        "{what}: {actual} bytes instead of the {expected} its manifest declares; the registry sent corrupt data, and nothing of it was cached"
    )]
    SizeMismatch {
        what: String,
        expected: u64,
        actual: String,
    },
    #[error(
        "{what} is {size} bytes, more than the limit of {limit}; raise the limit in PullOptions if the image is trusted"
    )]
    TooLarge { what: String, size: u64, limit: u64 },
    #[error("TLS setup: {reason}")]
    Tls { reason: String },
    #[error("the layer cache at {}: {source}", path.display())]
    Cache {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("unpacking layer {layer}: {source}")]
    Apply {
        layer: String,
        #[source]
        source: Box<ApplyError>,
    },
    #[error("the root filesystem {}: {reason}", path.display())]
    Rootfs { path: PathBuf, reason: String },
}

/// Credentials for a registry. The password never appears in `Debug` output or logs.
#[derive(Clone)]
pub struct RegistryAuth {
    pub username: String,
    pub password: String,
}

impl fmt::Debug for RegistryAuth {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RegistryAuth")
            .field("username", &self.username)
            .field("password", &"<redacted>")
            .finish()
    }
}

/// How to pull.
#[derive(Debug, Clone)]
pub struct PullOptions {
    /// Registry of unqualified names (the node's `template.default_registry`); else
    /// [`DEFAULT_REGISTRY_ENV`], else `registries_conf`.
    pub default_registry: Option<String>,
    /// containers-registries.conf(5) to read `unqualified-search-registries` and
    /// `[[registry]]` `location`/`insecure` from.
    pub registries_conf: PathBuf,
    pub auth: Option<RegistryAuth>,
    /// Registries (`host[:port]`) spoken to over plain HTTP. Loopback ones always are.
    pub insecure_registries: Vec<String>,
    /// A PEM file of CAs trusted besides the system's.
    pub extra_ca_file: Option<PathBuf>,
    /// Deadline of each request and of each read of a body.
    pub request_timeout: Duration,
    /// Largest manifest or config accepted.
    pub max_manifest_bytes: u64,
    /// Largest image (config and layers, compressed) accepted.
    pub max_image_bytes: u64,
}

impl Default for PullOptions {
    fn default() -> Self {
        Self {
            default_registry: None,
            registries_conf: PathBuf::from(REGISTRIES_CONF),
            auth: None,
            insecure_registries: Vec::new(),
            extra_ca_file: None,
            request_timeout: Duration::from_secs(30),
            max_manifest_bytes: 4 << 20,
            max_image_bytes: 16 << 30,
        }
    }
}

/// One layer of a pulled image, in the cache.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CachedLayer {
    pub digest: String,
    pub media_type: LayerMediaType,
    pub size: u64,
    pub path: PathBuf,
}

/// What a pull transferred.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PullReport {
    pub layers_fetched: usize,
    pub layers_cached: usize,
    /// Bytes of layers downloaded (the config and manifests not counted).
    pub bytes_fetched: u64,
}

/// A pulled image: its layers are in the cache.
#[derive(Debug, Clone)]
pub struct PulledImage {
    /// The reference resolved: registry and repository as pulled, pinned to
    /// `manifest_digest`.
    pub reference: ImageRef,
    /// Digest of the image manifest (the linux/amd64 one of an index).
    pub manifest_digest: String,
    /// Digest of the index it was picked from, when the reference named one.
    pub index_digest: Option<String>,
    pub config: ImageConfig,
    /// Bottom layer first.
    pub layers: Vec<CachedLayer>,
    pub report: PullReport,
}

/// Human size: `12.3 MiB`.
fn human(bytes: u64) -> String {
    const UNITS: [&str; 4] = ["KiB", "MiB", "GiB", "TiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut v = bytes as f64 / 1024.0;
    let mut unit = 0;
    while v >= 1024.0 && unit < UNITS.len() - 1 {
        v /= 1024.0;
        unit += 1;
    }
    format!("{v:.1} {}", UNITS[unit])
}

fn short_digest(d: &str) -> String {
    let hex = d.strip_prefix("sha256:").unwrap_or(d);
    format!("sha256:{}…", &hex[..hex.len().min(12)])
}

fn is_loopback(host: &str) -> bool {
    let h = host
        .rsplit_once(':')
        .filter(|(h, p)| {
            !h.is_empty() && p.bytes().all(|b| b.is_ascii_digit()) && !h.ends_with(':')
        })
        .map_or(host, |(h, _)| h);
    let h = h.trim_start_matches('[').trim_end_matches(']');
    h == "localhost"
        || h.parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// The repositories to try for `r`: as written, then `library/<name>` for a short
/// name (see the module docs).
fn candidates(r: &ImageRef) -> Vec<ImageRef> {
    let mut out = vec![r.clone()];
    if r.short_name {
        out.push(ImageRef {
            repository: format!("library/{}", r.repository),
            short_name: false,
            ..r.clone()
        });
    }
    out
}

/// Resolves `reference` (the default registry from `opts` for an unqualified name).
pub fn resolve_reference(reference: &str, opts: &PullOptions) -> Result<ImageRef, OciError> {
    match ImageRef::parse_qualified(reference)? {
        Some(r) => Ok(r),
        None => {
            let reg = reference::default_registry(
                opts.default_registry.as_deref(),
                &opts.registries_conf,
                reference,
            )?;
            ImageRef::parse_with_default(reference, &reg)
        }
    }
}

/// Pulls `reference` into `cache` (see the module docs).
pub async fn pull(
    reference: &str,
    opts: &PullOptions,
    cache: &LayerCache,
    progress: Progress,
) -> Result<PulledImage, OciError> {
    let image = resolve_reference(reference, opts)?;
    let conf = RegistriesConf::read(&opts.registries_conf)?;
    let entry = conf.entry(&image.registry);
    let host = entry
        .and_then(|e| e.location.clone())
        .unwrap_or_else(|| image.registry.clone());
    let plain = is_loopback(&host)
        || entry.is_some_and(|e| e.insecure)
        || opts
            .insecure_registries
            .iter()
            .any(|r| r == &image.registry || r == &host);
    let base = format!("{}://{host}", if plain { "http" } else { "https" });
    let tls = registry::tls_config(opts.extra_ca_file.as_deref())?;
    let reg = Registry::new(
        &image.registry,
        base,
        opts.auth.clone(),
        tls,
        opts.request_timeout,
    );
    tracing::debug!(reference = %image, registry = %reg.name, "pulling an image");
    progress(&format!("pulling {image}"));

    let mut first_err = None;
    let mut found = None;
    for cand in candidates(&image) {
        match fetch_manifest(&reg, &cand, opts).await {
            Ok(m) => {
                found = Some((cand, m));
                break;
            }
            Err(e @ (OciError::NotFound { .. } | OciError::Auth { .. })) if first_err.is_none() => {
                first_err = Some(e)
            }
            Err(e) => return Err(first_err.unwrap_or(e)),
        }
    }
    let Some((image, (manifest, manifest_digest, index_digest))) = found else {
        return Err(first_err.expect("at least one candidate was tried"));
    };
    let shown = image.to_string();

    // Sizes before anything is downloaded.
    if manifest.config.size > opts.max_manifest_bytes {
        return Err(OciError::TooLarge {
            what: format!("the config of {shown}"),
            size: manifest.config.size,
            limit: opts.max_manifest_bytes,
        });
    }
    let total = manifest
        .layers
        .iter()
        .fold(manifest.config.size, |a, l| a.saturating_add(l.size));
    if total > opts.max_image_bytes {
        return Err(OciError::TooLarge {
            what: format!("image {shown}"),
            size: total,
            limit: opts.max_image_bytes,
        });
    }
    let mut kinds = Vec::with_capacity(manifest.layers.len());
    for l in &manifest.layers {
        if !reference::valid_digest(&l.digest) {
            return Err(OciError::BadManifest {
                reference: shown.clone(),
                reason: format!("layer digest {:?} is not sha256:<64 hex>", l.digest),
            });
        }
        if l.urls.as_ref().is_some_and(|u| !u.is_empty()) {
            return Err(OciError::Unsupported {
                reference: shown.clone(),
                reason: format!(
                    "layer {} is a foreign layer fetched from elsewhere, which the node does not download",
                    l.digest
                ),
            });
        }
        let kind = LayerMediaType::from_media_type(&l.media_type).ok_or_else(|| {
            OciError::Unsupported {
                reference: shown.clone(),
                reason: format!(
                    "layer {} has media type {:?}; supported: tar, tar+gzip, tar+zstd",
                    l.digest, l.media_type
                ),
            }
        })?;
        kinds.push(kind);
    }
    if !reference::valid_digest(&manifest.config.digest) {
        return Err(OciError::BadManifest {
            reference: shown.clone(),
            reason: format!(
                "config digest {:?} is not sha256:<64 hex>",
                manifest.config.digest
            ),
        });
    }

    // The config.
    let scope = format!("repository:{}:pull", image.repository);
    let what = format!("the config {} of {shown}", manifest.config.digest);
    let resp = reg
        .get(
            &format!("/v2/{}/blobs/{}", image.repository, manifest.config.digest),
            None,
            &scope,
            true,
            &what,
        )
        .await?;
    if !resp.status().is_success() {
        return Err(reg.status_error(resp, &what).await);
    }
    let raw = reg
        .read_bounded(resp, manifest.config.size, &what)
        .await
        .map_err(|e| match e {
            OciError::TooLarge { size, .. } => OciError::SizeMismatch {
                what: what.clone(),
                expected: manifest.config.size,
                actual: format!("{size} or more"),
            },
            e => e,
        })?;
    check_blob(&raw, &manifest.config.digest, manifest.config.size, &what)?;
    let config = ImageConfig::parse(&raw).map_err(|e| OciError::BadManifest {
        reference: shown.clone(),
        reason: format!("its config is not an image config ({e})"),
    })?;

    // The layers.
    let n = manifest.layers.len();
    let mut report = PullReport::default();
    let mut layers = Vec::with_capacity(n);
    for (i, (l, kind)) in manifest.layers.iter().zip(kinds).enumerate() {
        let label = format!("layer {}/{n} {}", i + 1, short_digest(&l.digest));
        let path = match cache.lookup(&l.digest, l.size) {
            Some(p) => {
                progress(&format!("{label} ({}) cached", human(l.size)));
                report.layers_cached += 1;
                p
            }
            None => {
                progress(&format!("pulling {label} ({})", human(l.size)));
                let (mut f, tmp) = cache.temp_file().await?;
                let what = format!("layer {} of {shown}", l.digest);
                let fetched = reg
                    .fetch_blob(&image.repository, &l.digest, l.size, &mut f, &what)
                    .await;
                let fetched = match fetched {
                    Ok(()) => f.sync_all().await.map_err(|source| OciError::Cache {
                        path: tmp.clone(),
                        source,
                    }),
                    Err(e) => Err(e),
                };
                drop(f);
                if let Err(e) = fetched {
                    let _ = tokio::fs::remove_file(&tmp).await;
                    return Err(e);
                }
                let p = cache.commit(&tmp, &l.digest).await?;
                report.layers_fetched += 1;
                report.bytes_fetched += l.size;
                p
            }
        };
        layers.push(CachedLayer {
            digest: l.digest.clone(),
            media_type: kind,
            size: l.size,
            path,
        });
    }
    progress(&format!(
        "pulled {shown}@{manifest_digest}: {} layers fetched ({}), {} cached",
        report.layers_fetched,
        human(report.bytes_fetched),
        report.layers_cached
    ));
    Ok(PulledImage {
        reference: image.with_digest(&manifest_digest),
        manifest_digest,
        index_digest,
        config,
        layers,
        report,
    })
}

fn sha256_of(raw: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(raw)))
}

fn check_blob(raw: &[u8], digest: &str, size: u64, what: &str) -> Result<(), OciError> {
    if raw.len() as u64 != size {
        return Err(OciError::SizeMismatch {
            what: what.to_string(),
            expected: size,
            actual: raw.len().to_string(),
        });
    }
    let actual = sha256_of(raw);
    if actual != digest {
        return Err(OciError::DigestMismatch {
            what: what.to_string(),
            expected: digest.to_string(),
            actual,
        });
    }
    Ok(())
}

/// Fetches the manifest of `image` (by digest or tag), resolving an index to its
/// linux/amd64 manifest: (manifest, its digest, the index's digest).
async fn fetch_manifest(
    reg: &Registry,
    image: &ImageRef,
    opts: &PullOptions,
) -> Result<(Manifest, String, Option<String>), OciError> {
    let shown = image.to_string();
    let (first, digest) = fetch_one(reg, image, image.manifest_ref(), opts).await?;
    match first {
        Fetched::Manifest(m) => Ok((m, digest, None)),
        Fetched::Index(index) => {
            let Some(d) = manifest::pick_linux_amd64(&index) else {
                let available = index
                    .manifests
                    .iter()
                    .filter_map(|d| d.platform.as_ref())
                    .map(|p| match &p.variant {
                        Some(v) => format!("{}/{}/{v}", p.os, p.architecture),
                        None => format!("{}/{}", p.os, p.architecture),
                    })
                    .collect::<Vec<_>>()
                    .join(", ");
                return Err(OciError::NoPlatform {
                    reference: shown,
                    available,
                });
            };
            if !reference::valid_digest(&d.digest) {
                return Err(OciError::BadManifest {
                    reference: shown,
                    reason: format!("its index names {:?}, not a sha256 digest", d.digest),
                });
            }
            match fetch_one(reg, image, &d.digest, opts).await? {
                (Fetched::Manifest(m), md) => Ok((m, md, Some(digest))),
                (Fetched::Index(_), _) => Err(OciError::BadManifest {
                    reference: shown,
                    reason: "its index points at another index".into(),
                }),
            }
        }
    }
}

/// One manifest request; the body's digest is checked when `reference` is a digest.
async fn fetch_one(
    reg: &Registry,
    image: &ImageRef,
    reference: &str,
    opts: &PullOptions,
) -> Result<(Fetched, String), OciError> {
    let what = format!(
        "manifest {}/{}{}{reference}",
        image.registry,
        image.repository,
        if reference.starts_with("sha256:") {
            "@"
        } else {
            ":"
        }
    );
    let scope = format!("repository:{}:pull", image.repository);
    let resp = reg
        .get(
            &format!("/v2/{}/manifests/{reference}", image.repository),
            Some(MANIFEST_ACCEPT),
            &scope,
            false,
            &what,
        )
        .await?;
    if !resp.status().is_success() {
        return Err(reg.status_error(resp, &what).await);
    }
    let content_type = resp
        .headers()
        .get(hyper::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    let body = reg
        .read_bounded(resp, opts.max_manifest_bytes, &what)
        .await?;
    let digest = sha256_of(&body);
    if reference.starts_with("sha256:") && digest != reference {
        return Err(OciError::DigestMismatch {
            what,
            expected: reference.to_string(),
            actual: digest,
        });
    }
    let fetched =
        manifest::parse_manifest(&content_type, &body).map_err(|reason| OciError::BadManifest {
            reference: image.to_string(),
            reason,
        })?;
    Ok((fetched, digest))
}

impl PulledImage {
    /// Flattens the layers, bottom first, into `rootfs`: an empty directory (created if
    /// missing). Blocking: run it on a blocking thread.
    pub fn unpack_into(&self, rootfs: &Path) -> Result<Vec<ApplyStats>, OciError> {
        self.unpack_into_with(rootfs, &ApplyOptions::default())
    }

    /// [`Self::unpack_into`] with explicit limits.
    pub fn unpack_into_with(
        &self,
        rootfs: &Path,
        opts: &ApplyOptions,
    ) -> Result<Vec<ApplyStats>, OciError> {
        let rootfs_err = |reason: String| OciError::Rootfs {
            path: rootfs.to_path_buf(),
            reason,
        };
        match std::fs::read_dir(rootfs) {
            Ok(mut it) => {
                if it.next().is_some() {
                    return Err(rootfs_err(
                        "not empty; an image is unpacked into an empty directory".into(),
                    ));
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                std::fs::create_dir_all(rootfs).map_err(|e| rootfs_err(e.to_string()))?;
            }
            Err(e) => return Err(rootfs_err(e.to_string())),
        }
        let mut stats = Vec::with_capacity(self.layers.len());
        for l in &self.layers {
            let apply_err = |source| OciError::Apply {
                layer: l.digest.clone(),
                source: Box::new(source),
            };
            let f = std::fs::File::open(&l.path).map_err(|source| OciError::Cache {
                path: l.path.clone(),
                source,
            })?;
            let r = BufReader::with_capacity(1 << 20, f);
            let reader: Box<dyn Read> = match l.media_type {
                LayerMediaType::Plain => Box::new(r),
                LayerMediaType::Gzip => Box::new(flate2::read::MultiGzDecoder::new(r)),
                LayerMediaType::Zstd => Box::new(
                    zstd::Decoder::with_buffer(r).map_err(|e| apply_err(ApplyError::Read(e)))?,
                ),
            };
            stats.push(apply_layer(reader, rootfs, opts).map_err(apply_err)?);
        }
        Ok(stats)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn oci_loopback_hosts_are_plain_http() {
        for h in [
            "127.0.0.1:5000",
            "localhost",
            "[::1]:5000",
            "127.1.2.3",
            "localhost:80",
        ] {
            assert!(is_loopback(h), "{h}");
        }
        for h in ["reg.example", "10.0.0.1:5000", "[2001:db8::1]:443"] {
            assert!(!is_loopback(h), "{h}");
        }
    }

    #[test]
    fn oci_short_names_also_try_library() {
        let r = ImageRef::parse_with_default("python:3", "reg.example").unwrap();
        let c = candidates(&r);
        assert_eq!(c.len(), 2);
        assert_eq!(c[1].to_string(), "reg.example/library/python:3");
        let r = ImageRef::parse_with_default("org/python:3", "reg.example").unwrap();
        assert_eq!(candidates(&r).len(), 1);
    }

    #[test]
    fn oci_sizes_and_secrets_are_shown_right() {
        assert_eq!(human(12_900_000), "12.3 MiB");
        assert_eq!(human(10), "10 B");
        let a = RegistryAuth {
            username: "u".into(),
            password: "hunter2".into(),
        };
        assert!(!format!("{a:?}").contains("hunter2"));
    }
}
