//! The cluster credential: a shared secret that gateways and nodes send to the
//! scheduler in the `authorization` metadata of every gRPC call (`Bearer
//! <token>`), so that nobody else can send heartbeats, record bindings or
//! unregister nodes. It is read from a file (the same rules as the API key's
//! secret file: a regular file, 32–256 URL-safe characters) named by
//! `cluster_token_file` in the control-plane config or `AENV_CLUSTER_TOKEN_FILE`
//! on a node.

use std::fmt;
use std::path::Path;
use std::sync::Arc;

use subtle::ConstantTimeEq;
use tonic::metadata::MetadataValue;
use tonic::service::Interceptor;

use crate::api_key::{ApiKeyError, read_secret, validate};

/// The metadata key the credential travels in.
pub const METADATA_KEY: &str = "authorization";

/// Why a cluster token could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum ClusterTokenError {
    #[error("cluster token file {path}: {source}")]
    File {
        path: String,
        #[source]
        source: ApiKeyError,
    },
}

/// A cluster credential.
#[derive(Clone)]
pub struct ClusterToken {
    /// `Bearer <token>`, as sent.
    bearer: Arc<str>,
}

impl fmt::Debug for ClusterToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ClusterToken(…)")
    }
}

impl ClusterToken {
    /// A token from its text (32–256 URL-safe characters).
    pub fn new(token: &str, origin: &str) -> Result<Self, ApiKeyError> {
        validate(token, origin)?;
        Ok(Self {
            bearer: format!("Bearer {token}").into(),
        })
    }

    /// Reads the token from `path` (a regular file; one trailing newline is
    /// ignored).
    pub fn from_file(path: &Path) -> Result<Self, ClusterTokenError> {
        let err = |source| ClusterTokenError::File {
            path: path.display().to_string(),
            source,
        };
        let text = read_secret(path).map_err(err)?;
        Self::new(&text, &path.display().to_string()).map_err(err)
    }

    /// Reads the token from `path` when one is named (an empty path: none).
    pub fn from_optional_file(path: &str) -> Result<Option<Self>, ClusterTokenError> {
        if path.trim().is_empty() {
            return Ok(None);
        }
        Self::from_file(Path::new(path.trim())).map(Some)
    }

    /// Whether the `authorization` metadata `value` carries this token (compared
    /// in constant time).
    pub fn verify(&self, value: &[u8]) -> bool {
        value.len() == self.bearer.len() && bool::from(value.ct_eq(self.bearer.as_bytes()))
    }

    fn metadata(&self) -> MetadataValue<tonic::metadata::Ascii> {
        MetadataValue::try_from(&*self.bearer).expect("a validated token is ASCII")
    }
}

/// A client interceptor that sends the cluster credential with every call
/// (nothing when there is none).
#[derive(Clone, Debug, Default)]
pub struct SendClusterToken(pub Option<ClusterToken>);

impl Interceptor for SendClusterToken {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(t) = &self.0 {
            req.metadata_mut().insert(METADATA_KEY, t.metadata());
        }
        Ok(req)
    }
}

/// How a gateway or node reaches the scheduler: the cluster credential and,
/// for `https` links, TLS trusting a private CA (and presenting a client
/// certificate for mutual TLS).
#[derive(Clone, Debug, Default)]
pub struct SchedulerLink {
    pub token: Option<ClusterToken>,
    pub tls: Option<tonic::transport::ClientTlsConfig>,
}

impl SchedulerLink {
    /// The link described by a token file (empty: none) and a TLS client
    /// section (empty `ca_file`: plain TCP).
    pub fn from_config(
        token_file: &str,
        tls: &crate::config::TlsConnect,
    ) -> Result<Self, SchedulerLinkError> {
        let token = ClusterToken::from_optional_file(token_file)?;
        let tls = if tls.enabled() {
            let read = |path: &str| {
                std::fs::read(path.trim())
                    .map_err(|e| SchedulerLinkError::Tls(format!("{path}: {e}")))
            };
            let mut cfg = tonic::transport::ClientTlsConfig::new()
                .ca_certificate(tonic::transport::Certificate::from_pem(read(&tls.ca_file)?));
            if let Some((cert, key)) = tls.identity() {
                cfg = cfg.identity(tonic::transport::Identity::from_pem(
                    read(cert)?,
                    read(key)?,
                ));
            }
            Some(cfg)
        } else {
            None
        };
        Ok(Self { token, tls })
    }

    /// The URL scheme of the link.
    pub fn scheme(&self) -> &'static str {
        if self.tls.is_some() { "https" } else { "http" }
    }
}

/// Why a scheduler link could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum SchedulerLinkError {
    #[error(transparent)]
    Token(#[from] ClusterTokenError),
    #[error("scheduler TLS: {0}")]
    Tls(String),
}

#[cfg(test)]
mod tests {
    use super::*;

    const TOKEN: &str = "0123456789abcdef0123456789abcdef";

    #[test]
    fn verify_accepts_the_bearer_form_only() {
        let t = ClusterToken::new(TOKEN, "test").unwrap();
        assert!(t.verify(format!("Bearer {TOKEN}").as_bytes()));
        assert!(!t.verify(TOKEN.as_bytes()));
        assert!(!t.verify(format!("Bearer {TOKEN}x").as_bytes()));
        assert!(!t.verify(b""));
    }

    #[test]
    fn short_or_odd_tokens_are_refused() {
        assert!(ClusterToken::new("short", "test").is_err());
        assert!(ClusterToken::new(&format!("{TOKEN} "), "test").is_err());
    }

    #[test]
    fn the_interceptor_adds_the_metadata() {
        let t = ClusterToken::new(TOKEN, "test").unwrap();
        let req = SendClusterToken(Some(t))
            .call(tonic::Request::new(()))
            .unwrap();
        assert_eq!(
            req.metadata().get(METADATA_KEY).unwrap(),
            &format!("Bearer {TOKEN}")
        );
        let req = SendClusterToken(None)
            .call(tonic::Request::new(()))
            .unwrap();
        assert!(req.metadata().get(METADATA_KEY).is_none());
    }
}
