//! Manifests, indexes and image configs, as much of them as a pull needs.

use serde::Deserialize;

pub const OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";
pub const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
pub const DOCKER_LIST: &str = "application/vnd.docker.distribution.manifest.list.v2+json";
pub const DOCKER_MANIFEST: &str = "application/vnd.docker.distribution.manifest.v2+json";

/// The Accept header of manifest requests.
pub const MANIFEST_ACCEPT: &str = "application/vnd.oci.image.index.v1+json, application/vnd.oci.image.manifest.v1+json, application/vnd.docker.distribution.manifest.list.v2+json, application/vnd.docker.distribution.manifest.v2+json";

/// A content descriptor.
#[derive(Debug, Clone, Deserialize)]
pub struct Descriptor {
    #[serde(rename = "mediaType", default)]
    pub media_type: String,
    pub digest: String,
    pub size: u64,
    #[serde(default)]
    pub platform: Option<Platform>,
    #[serde(default)]
    pub urls: Option<Vec<String>>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct Platform {
    pub architecture: String,
    pub os: String,
    #[serde(default)]
    pub variant: Option<String>,
}

/// An image manifest (OCI or Docker v2 schema 2).
#[derive(Debug, Clone, Deserialize)]
pub struct Manifest {
    #[serde(rename = "schemaVersion")]
    pub schema_version: u32,
    pub config: Descriptor,
    #[serde(default)]
    pub layers: Vec<Descriptor>,
}

/// An image index (OCI) or manifest list (Docker).
#[derive(Debug, Clone, Deserialize)]
pub struct Index {
    #[serde(rename = "schemaVersion")]
    pub schema_version: u32,
    pub manifests: Vec<Descriptor>,
}

/// What a manifest response turned out to be.
pub enum Fetched {
    Index(Index),
    Manifest(Manifest),
}

/// Parses a manifest response by its content type (or, when the registry sent none
/// useful, by its `mediaType` field and shape).
pub fn parse_manifest(content_type: &str, body: &[u8]) -> Result<Fetched, String> {
    let ct = content_type.split(';').next().unwrap_or("").trim();
    let kind = match ct {
        OCI_INDEX | DOCKER_LIST => "index",
        OCI_MANIFEST | DOCKER_MANIFEST => "manifest",
        _ => {
            #[derive(Deserialize)]
            struct Probe {
                #[serde(rename = "mediaType", default)]
                media_type: Option<String>,
                #[serde(default)]
                manifests: Option<serde_json::Value>,
            }
            let p: Probe = serde_json::from_slice(body).map_err(|e| e.to_string())?;
            match p.media_type.as_deref() {
                Some(OCI_INDEX | DOCKER_LIST) => "index",
                Some(OCI_MANIFEST | DOCKER_MANIFEST) => "manifest",
                Some(other) => return Err(format!("unsupported manifest media type {other:?}")),
                None if p.manifests.is_some() => "index",
                None => "manifest",
            }
        }
    };
    if kind == "index" {
        let i: Index = serde_json::from_slice(body).map_err(|e| e.to_string())?;
        if i.schema_version != 2 {
            return Err(format!(
                "schemaVersion {} (only 2 is supported)",
                i.schema_version
            ));
        }
        Ok(Fetched::Index(i))
    } else {
        let m: Manifest = serde_json::from_slice(body).map_err(|e| e.to_string())?;
        if m.schema_version != 2 {
            return Err(format!(
                "schemaVersion {} (only 2 is supported; schema 1 images are obsolete)",
                m.schema_version
            ));
        }
        Ok(Fetched::Manifest(m))
    }
}

/// The linux/amd64 entry of an index (a plain `amd64` preferred over a variant).
pub fn pick_linux_amd64(index: &Index) -> Option<&Descriptor> {
    let candidates = index.manifests.iter().filter(|d| {
        d.platform
            .as_ref()
            .is_some_and(|p| p.os == "linux" && p.architecture == "amd64")
    });
    let mut best = None;
    for d in candidates {
        let plain = d
            .platform
            .as_ref()
            .is_some_and(|p| p.variant.as_deref().is_none_or(|v| v == "v1"));
        if plain {
            return Some(d);
        }
        best.get_or_insert(d);
    }
    best
}

/// How a layer blob is compressed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerMediaType {
    Plain,
    Gzip,
    Zstd,
}

impl LayerMediaType {
    /// The compression of a layer media type; `None` for what is not a layer tar.
    pub fn from_media_type(mt: &str) -> Option<Self> {
        match mt {
            "application/vnd.oci.image.layer.v1.tar"
            | "application/vnd.oci.image.layer.nondistributable.v1.tar" => Some(Self::Plain),
            "application/vnd.oci.image.layer.v1.tar+gzip"
            | "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip"
            | "application/vnd.docker.image.rootfs.diff.tar.gzip" => Some(Self::Gzip),
            "application/vnd.oci.image.layer.v1.tar+zstd"
            | "application/vnd.oci.image.layer.nondistributable.v1.tar+zstd"
            | "application/vnd.docker.image.rootfs.diff.tar.zstd" => Some(Self::Zstd),
            _ => None,
        }
    }
}

/// What a sandbox needs of an image's config.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ImageConfig {
    pub architecture: String,
    pub os: String,
    /// `KEY=value` entries.
    pub env: Vec<String>,
    pub working_dir: Option<String>,
    pub user: Option<String>,
    pub entrypoint: Vec<String>,
    pub cmd: Vec<String>,
}

#[derive(Deserialize)]
struct RawConfig {
    #[serde(default)]
    architecture: String,
    #[serde(default)]
    os: String,
    #[serde(default)]
    config: Option<RawRunConfig>,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "PascalCase")]
struct RawRunConfig {
    #[serde(default)]
    env: Option<Vec<String>>,
    #[serde(default)]
    working_dir: Option<String>,
    #[serde(default)]
    user: Option<String>,
    #[serde(default)]
    entrypoint: Option<Vec<String>>,
    #[serde(default)]
    cmd: Option<Vec<String>>,
}

impl ImageConfig {
    /// Parses an image config blob.
    pub fn parse(raw: &[u8]) -> Result<Self, String> {
        let c: RawConfig = serde_json::from_slice(raw).map_err(|e| e.to_string())?;
        let r = c.config.unwrap_or_default();
        let nonempty = |s: Option<String>| s.filter(|s| !s.is_empty());
        Ok(Self {
            architecture: c.architecture,
            os: c.os,
            env: r.env.unwrap_or_default(),
            working_dir: nonempty(r.working_dir),
            user: nonempty(r.user),
            entrypoint: r.entrypoint.unwrap_or_default(),
            cmd: r.cmd.unwrap_or_default(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn oci_config_is_parsed() {
        let c = ImageConfig::parse(
            br#"{"architecture":"amd64","os":"linux","config":{"Env":["PATH=/usr/bin","A=b"],"WorkingDir":"/app","User":"1000:1000","Entrypoint":["/bin/sh","-c"],"Cmd":["echo hi"]},"rootfs":{"type":"layers","diff_ids":[]}}"#,
        )
        .unwrap();
        assert_eq!(c.env, ["PATH=/usr/bin", "A=b"]);
        assert_eq!(c.working_dir.as_deref(), Some("/app"));
        assert_eq!(c.user.as_deref(), Some("1000:1000"));
        assert_eq!(c.entrypoint, ["/bin/sh", "-c"]);
        assert_eq!(c.cmd, ["echo hi"]);
        let c = ImageConfig::parse(br#"{"architecture":"amd64","os":"linux","config":{"Entrypoint":null,"WorkingDir":""}}"#).unwrap();
        assert!(c.entrypoint.is_empty() && c.working_dir.is_none());
        assert!(ImageConfig::parse(b"[1]").is_err());
    }

    #[test]
    fn oci_index_picks_linux_amd64() {
        let d = |arch: &str, variant: Option<&str>, n: u8| {
            format!(
                r#"{{"mediaType":"{OCI_MANIFEST}","digest":"sha256:{}","size":1,"platform":{{"architecture":"{arch}","os":"linux"{}}}}}"#,
                format!("{n:x}").repeat(64),
                variant
                    .map(|v| format!(r#","variant":"{v}""#))
                    .unwrap_or_default()
            )
        };
        let body = format!(
            r#"{{"schemaVersion":2,"manifests":[{},{},{}]}}"#,
            d("arm64", Some("v8"), 1),
            d("amd64", Some("v3"), 2),
            d("amd64", None, 3)
        );
        let Fetched::Index(i) = parse_manifest(OCI_INDEX, body.as_bytes()).unwrap() else {
            panic!("not an index");
        };
        assert!(
            pick_linux_amd64(&i)
                .unwrap()
                .digest
                .starts_with("sha256:333")
        );
        let body = format!(
            r#"{{"schemaVersion":2,"manifests":[{}]}}"#,
            d("arm64", None, 1)
        );
        let Fetched::Index(i) = parse_manifest("application/json", body.as_bytes()).unwrap() else {
            panic!("not an index");
        };
        assert!(pick_linux_amd64(&i).is_none());
        assert!(
            parse_manifest(
                DOCKER_MANIFEST,
                br#"{"schemaVersion":1,"config":{"digest":"x","size":1}}"#
            )
            .is_err()
        );
    }
}
