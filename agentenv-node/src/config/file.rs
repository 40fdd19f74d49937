//! The TOML file's shape: its tables and keys, the `backend` key that is either a sandbox
//! backend's name or the repository tables, and the `oss` repository's settings (the
//! `[backend.oss]` keys under `AENV_OSS_*` variables).

use std::path::{Path, PathBuf};

use agentenv_core::storage::{AddressingStyle, S3Config};
use serde::Deserialize;

use super::{ConfigError, invalid};

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct FileConfig {
    pub(super) api_addr: Option<String>,
    pub(super) home_path: Option<PathBuf>,
    pub(super) runtime_path: Option<PathBuf>,
    /// The sandbox backend name (`backend = "jail"`), or the snapshot repository tables
    /// `[backend.posix_fs]` and `[backend.oss]`.
    pub(super) backend: Option<toml::Value>,
    pub(super) guest_binary_path: Option<PathBuf>,
    pub(super) guest_init_mode: Option<bool>,
    pub(super) guest_inherit_listener: Option<bool>,
    pub(super) guest_kernel_path: Option<PathBuf>,
    pub(super) vmm_binary_path: Option<PathBuf>,
    pub(super) template_path: Option<PathBuf>,
    #[serde(default)]
    pub(super) node_identity: FileIdentity,
    #[serde(default)]
    pub(super) cluster: FileCluster,
    #[serde(default)]
    pub(super) observability: FileObservability,
    #[serde(default)]
    pub(super) sandbox: FileSandbox,
    #[serde(default)]
    pub(super) sandbox_proxy: FileProxy,
    #[serde(default)]
    pub(super) template: FileTemplate,
    #[serde(default)]
    pub(super) orchestrator: FileOrchestrator,
    #[serde(default)]
    pub(super) machine: FileMachine,
    #[serde(default)]
    pub(super) jail: FileJail,
    #[serde(default)]
    pub(super) snapshot: FileSnapshot,
    #[serde(default)]
    pub(super) pool: FilePool,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct FileIdentity {
    pub(super) node_id: Option<String>,
    pub(super) cluster_id: Option<String>,
    pub(super) service_instance_id: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct FileCluster {
    pub(super) scheduler_endpoint: Option<String>,
    pub(super) cluster_token_file: Option<PathBuf>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct FileObservability {
    #[serde(default)]
    pub(super) scheduler_report: FileReport,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct FileReport {
    pub(super) enabled: Option<bool>,
    pub(super) interval_secs: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct FileSandbox {
    pub(super) access_token_hash_seed: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct FileProxy {
    pub(super) domains: Option<Vec<String>>,
    pub(super) upload_idle_timeout_ms: Option<u64>,
    pub(super) response_header_timeout_ms: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct FileTemplate {
    pub(super) build_concurrency: Option<u64>,
    pub(super) step_timeout_secs: Option<u64>,
    pub(super) ready_timeout_secs: Option<u64>,
    pub(super) default_registry: Option<String>,
    pub(super) insecure_registries: Option<Vec<String>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct FileOrchestrator {
    pub(super) auto_evict_interval_ms: Option<u64>,
    pub(super) default_sandbox_timeout_secs: Option<u64>,
    pub(super) auto_resume_min_sandbox_timeout_secs: Option<u64>,
    pub(super) agent_ready_timeout_secs: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct FileMachine {
    pub(super) vcpu_count: Option<u32>,
    pub(super) mem_size_mib: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct FileJail {
    pub(super) address_pool: Option<String>,
    pub(super) iface_prefix: Option<String>,
    pub(super) cgroup_parent: Option<String>,
    pub(super) net_pool_size: Option<u64>,
    pub(super) id_pool: Option<String>,
    pub(super) disk_size_mb: Option<u64>,
    pub(super) layer_pool_size: Option<u64>,
    pub(super) dns_servers: Option<Vec<String>>,
    pub(super) nat: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct FileSnapshot {
    pub(super) repository_backend: Option<String>,
    pub(super) local_cache_path: Option<PathBuf>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct FilePosixFs {
    pub(super) snapshot_store: Option<PathBuf>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct FileOss {
    pub(super) endpoint: Option<String>,
    pub(super) bucket: Option<String>,
    pub(super) prefix: Option<String>,
    pub(super) region: Option<String>,
    pub(super) addressing_style: Option<String>,
    pub(super) access_key_id: Option<String>,
    pub(super) access_key_secret: Option<String>,
    pub(super) security_token: Option<String>,
}

/// The `backend` key: a sandbox backend name, or the repository tables.
#[derive(Debug, Default)]
pub(super) struct BackendKey {
    pub(super) name: Option<String>,
    pub(super) posix_fs: FilePosixFs,
    pub(super) oss: FileOss,
}

pub(super) fn backend_key(v: Option<toml::Value>, path: &Path) -> Result<BackendKey, ConfigError> {
    let toml_err = |message: String| ConfigError::Toml {
        path: path.to_path_buf(),
        message,
    };
    let mut out = BackendKey::default();
    match v {
        None => {}
        Some(toml::Value::String(s)) => out.name = Some(s),
        Some(toml::Value::Table(t)) => {
            for (k, v) in t {
                match k.as_str() {
                    "posix_fs" => {
                        out.posix_fs = v
                            .try_into()
                            .map_err(|e| toml_err(format!("[backend.posix_fs]: {e}")))?
                    }
                    "oss" => {
                        out.oss = v
                            .try_into()
                            .map_err(|e| toml_err(format!("[backend.oss]: {e}")))?
                    }
                    other => {
                        return Err(toml_err(format!(
                            "unknown table [backend.{other}]: use [backend.posix_fs] or [backend.oss] (with those tables, choose the sandbox backend with AENV_BACKEND)"
                        )));
                    }
                }
            }
        }
        Some(other) => {
            return Err(toml_err(format!(
                "backend = {other}: use a sandbox backend name (\"jail\", \"microvm\", \"auto\") or the tables [backend.posix_fs] / [backend.oss]"
            )));
        }
    }
    Ok(out)
}

/// The `oss` repository: `[backend.oss]` keys, overridden by `AENV_OSS_*` variables.
pub(super) fn oss_config(
    f: FileOss,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<S3Config, ConfigError> {
    let need = |key: &'static str, v: Option<String>, example: &str| {
        v.map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty())
            .ok_or_else(|| {
                invalid(
                    key,
                    "",
                    format!("the oss snapshot repository needs it (e.g. {example}); set it or use repository_backend = \"posix_fs\""),
                )
            })
    };
    let endpoint = need(
        "AENV_OSS_ENDPOINT",
        env("AENV_OSS_ENDPOINT").or(f.endpoint),
        "https://oss-cn-hangzhou.aliyuncs.com",
    )?;
    if !(endpoint.starts_with("http://") || endpoint.starts_with("https://")) {
        return Err(invalid(
            "AENV_OSS_ENDPOINT",
            endpoint,
            "write it as a URL with a scheme, e.g. https://oss-cn-hangzhou.aliyuncs.com",
        ));
    }
    let bucket = need(
        "AENV_OSS_BUCKET",
        env("AENV_OSS_BUCKET").or(f.bucket),
        "agentenv-snapshots",
    )?;
    let region = need(
        "AENV_OSS_REGION",
        env("AENV_OSS_REGION").or(f.region),
        "cn-hangzhou",
    )?;
    let access_key_id = need(
        "AENV_OSS_ACCESS_KEY_ID",
        env("AENV_OSS_ACCESS_KEY_ID").or(f.access_key_id),
        "the key id of an account that may read and write the bucket",
    )?;
    let secret_access_key = need(
        "AENV_OSS_ACCESS_KEY_SECRET",
        env("AENV_OSS_ACCESS_KEY_SECRET").or(f.access_key_secret),
        "the secret of that key",
    )?;
    let addressing_style = match env("AENV_OSS_ADDRESSING_STYLE").or(f.addressing_style) {
        None => None,
        Some(s) => match s.trim() {
            "" => None,
            "virtual" => Some(AddressingStyle::Virtual),
            "path" => Some(AddressingStyle::Path),
            other => {
                return Err(invalid(
                    "AENV_OSS_ADDRESSING_STYLE",
                    other,
                    "use virtual or path, or leave it unset to detect it from the endpoint",
                ));
            }
        },
    };
    Ok(S3Config {
        endpoint,
        bucket,
        prefix: env("AENV_OSS_PREFIX").or(f.prefix).unwrap_or_default(),
        region,
        access_key_id,
        secret_access_key,
        security_token: env("AENV_OSS_SECURITY_TOKEN").or(f.security_token),
        addressing_style,
    })
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct FilePool {
    pub(super) templates: Option<std::collections::BTreeMap<String, u64>>,
    pub(super) max_per_template: Option<u64>,
    pub(super) demand_window_ms: Option<u64>,
    pub(super) memory_reserve_mb: Option<u64>,
    pub(super) refill_concurrency: Option<u64>,
}
