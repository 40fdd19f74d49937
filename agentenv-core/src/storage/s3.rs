//! The S3 backend: settings of an S3-compatible store (AWS S3, Alibaba OSS, MinIO, ...)
//! and the OpenDAL operator over them.

use std::fmt;

use opendal::Operator;
use opendal::layers::RetryLayer;

use super::StorageError;
use super::key::validate_key;

/// S3 bucket addressing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AddressingStyle {
    /// `https://<bucket>.<endpoint host>/<key>`
    Virtual,
    /// `https://<endpoint host>/<bucket>/<key>`
    Path,
}

/// Settings of an S3-compatible store.
#[derive(Clone, PartialEq, Eq)]
pub struct S3Config {
    /// `http://` or `https://` URL of the service.
    pub endpoint: String,
    pub bucket: String,
    /// Key prefix inside the bucket (may be empty).
    pub prefix: String,
    pub region: String,
    pub access_key_id: String,
    pub secret_access_key: String,
    pub security_token: Option<String>,
    /// `None` picks virtual-host style for Alibaba OSS endpoints, path style otherwise.
    pub addressing_style: Option<AddressingStyle>,
}

impl fmt::Debug for S3Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("S3Config")
            .field("endpoint", &self.endpoint)
            .field("bucket", &self.bucket)
            .field("prefix", &self.prefix)
            .field("region", &self.region)
            .field("access_key_id", &self.access_key_id)
            .field("secret_access_key", &"<redacted>")
            .field(
                "security_token",
                &self.security_token.as_ref().map(|_| "<redacted>"),
            )
            .field("addressing_style", &self.addressing_style)
            .finish()
    }
}

impl S3Config {
    fn virtual_host(&self) -> bool {
        match self.addressing_style {
            Some(AddressingStyle::Virtual) => true,
            Some(AddressingStyle::Path) => false,
            None => self.endpoint.contains("aliyuncs.com"),
        }
    }
}

/// The OpenDAL operator on the bucket `c` names, after checking what cannot work.
pub(super) fn operator(c: &S3Config, retry: RetryLayer) -> Result<Operator, StorageError> {
    if !(c.endpoint.starts_with("http://") || c.endpoint.starts_with("https://")) {
        return Err(StorageError::Config(format!(
            "the endpoint {:?} needs a scheme, e.g. https://oss-cn-hangzhou.aliyuncs.com",
            c.endpoint
        )));
    }
    if c.bucket.trim().is_empty() {
        return Err(StorageError::Config("the bucket is not set".into()));
    }
    if c.region.trim().is_empty() {
        return Err(StorageError::Config(
            "the region is not set (S3-compatible stores need one; use the provider's region name, or \"auto\")".into(),
        ));
    }
    if c.access_key_id.is_empty() || c.secret_access_key.is_empty() {
        return Err(StorageError::Config(
            "the access key id and secret must both be set".into(),
        ));
    }
    let prefix = c.prefix.trim_matches('/');
    if !prefix.is_empty() {
        validate_key(prefix)?;
    }
    let mut b = opendal::services::S3::default()
        .endpoint(&c.endpoint)
        .bucket(&c.bucket)
        .region(&c.region)
        .root(&format!("/{prefix}"))
        .access_key_id(&c.access_key_id)
        .secret_access_key(&c.secret_access_key)
        .disable_config_load()
        .disable_ec2_metadata();
    if let Some(t) = &c.security_token {
        b = b.session_token(t);
    }
    if c.virtual_host() {
        b = b.enable_virtual_host_style();
    }
    Ok(Operator::new(b)
        .map_err(|e| StorageError::Config(e.to_string()))?
        .layer(retry)
        .finish())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::{OpendalStorage, StorageConfig};

    #[test]
    fn s3_config_rejects_what_cannot_work_and_redacts_secrets() {
        let base = S3Config {
            endpoint: "http://127.0.0.1:9".into(),
            bucket: "b".into(),
            prefix: "p/".into(),
            region: "us-east-1".into(),
            access_key_id: "ak".into(),
            secret_access_key: "very-secret".into(),
            security_token: Some("tok-secret".into()),
            addressing_style: None,
        };
        let dbg = format!("{base:?}");
        assert!(
            !dbg.contains("very-secret") && !dbg.contains("tok-secret"),
            "{dbg}"
        );
        assert!(OpendalStorage::open(&StorageConfig::S3(base.clone())).is_ok());
        let mut c = base.clone();
        c.endpoint = "127.0.0.1:9".into();
        let e = OpendalStorage::open(&StorageConfig::S3(c)).unwrap_err();
        assert!(e.to_string().contains("scheme"), "{e}");
        let mut c = base.clone();
        c.region = String::new();
        let e = OpendalStorage::open(&StorageConfig::S3(c)).unwrap_err();
        assert!(e.to_string().contains("region"), "{e}");
        let mut c = base;
        c.secret_access_key = String::new();
        let e = OpendalStorage::open(&StorageConfig::S3(c)).unwrap_err();
        assert!(e.to_string().contains("secret"), "{e}");
        let e = OpendalStorage::open(&StorageConfig::Fs {
            root: "relative".into(),
        })
        .unwrap_err();
        assert!(e.to_string().contains("absolute"), "{e}");
    }

    #[test]
    fn oss_endpoints_default_to_virtual_host_addressing() {
        let mut c = S3Config {
            endpoint: "https://oss-cn-hangzhou.aliyuncs.com".into(),
            bucket: "b".into(),
            prefix: String::new(),
            region: "cn-hangzhou".into(),
            access_key_id: "a".into(),
            secret_access_key: "s".into(),
            security_token: None,
            addressing_style: None,
        };
        assert!(c.virtual_host());
        c.endpoint = "http://127.0.0.1:9000".into();
        assert!(!c.virtual_host());
        c.addressing_style = Some(AddressingStyle::Virtual);
        assert!(c.virtual_host());
    }
}
