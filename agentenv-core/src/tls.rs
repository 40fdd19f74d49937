//! TLS for every link of a cluster, with rustls: server certificates read from
//! PEM files and reloaded in place (new handshakes take the new certificate,
//! open connections keep theirs), private CAs from PEM files for clients and
//! for client-certificate checks (mutual TLS).

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use parking_lot::RwLock;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert, WebPkiClientVerifier};
use rustls::sign::CertifiedKey;
use rustls::{ClientConfig, RootCertStore, ServerConfig};

/// Why TLS could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{what} {}: {message}", path.display())]
    File {
        what: &'static str,
        path: PathBuf,
        message: String,
    },
    #[error("TLS setup: {0}")]
    Rustls(#[from] rustls::Error),
    #[error("client CA {}: {message}", path.display())]
    Verifier { path: PathBuf, message: String },
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Reads every certificate of a PEM file (a chain: leaf first).
pub fn read_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let err = |message: String| TlsError::File {
        what: "certificate file",
        path: path.to_path_buf(),
        message,
    };
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| err(e.to_string()))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| err(e.to_string()))?;
    if certs.is_empty() {
        return Err(err("holds no PEM certificate (BEGIN CERTIFICATE)".into()));
    }
    Ok(certs)
}

/// Reads the private key of a PEM file (PKCS#8, PKCS#1 or SEC1).
pub fn read_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    PrivateKeyDer::from_pem_file(path).map_err(|e| TlsError::File {
        what: "private key file",
        path: path.to_path_buf(),
        message: format!("{e} (expected a PEM private key)"),
    })
}

/// The certificates of a CA file as a trust store.
pub fn read_roots(path: &Path) -> Result<RootCertStore, TlsError> {
    let mut roots = RootCertStore::empty();
    for cert in read_certs(path)? {
        roots.add(cert).map_err(|e| TlsError::File {
            what: "CA file",
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
    }
    Ok(roots)
}

/// A certificate and key from files, checked to belong together.
fn certified_key(cert: &Path, key: &Path) -> Result<Arc<CertifiedKey>, TlsError> {
    let chain = read_certs(cert)?;
    let key_der = read_key(key)?;
    let signing = provider()
        .key_provider
        .load_private_key(key_der)
        .map_err(|e| TlsError::File {
            what: "private key file",
            path: key.to_path_buf(),
            message: e.to_string(),
        })?;
    let ck = CertifiedKey::new(chain, signing);
    ck.keys_match().map_err(|e| TlsError::File {
        what: "private key file",
        path: key.to_path_buf(),
        message: format!("does not match the certificate in {}: {e}", cert.display()),
    })?;
    Ok(Arc::new(ck))
}

/// A server certificate read from files that [`ReloadingCert::reload`] reads
/// again: handshakes after a reload present the new certificate; connections
/// already open are not touched.
pub struct ReloadingCert {
    cert: PathBuf,
    key: PathBuf,
    current: RwLock<Arc<CertifiedKey>>,
}

impl fmt::Debug for ReloadingCert {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReloadingCert")
            .field("cert", &self.cert)
            .field("key", &self.key)
            .finish()
    }
}

impl ReloadingCert {
    /// Reads `cert` (PEM chain) and `key` (PEM private key).
    pub fn load(cert: &Path, key: &Path) -> Result<Arc<Self>, TlsError> {
        Ok(Arc::new(Self {
            current: RwLock::new(certified_key(cert, key)?),
            cert: cert.to_path_buf(),
            key: key.to_path_buf(),
        }))
    }

    /// Reads the files again; on any error the old certificate stays in use.
    pub fn reload(&self) -> Result<(), TlsError> {
        let fresh = certified_key(&self.cert, &self.key)?;
        *self.current.write() = fresh;
        Ok(())
    }
}

impl ResolvesServerCert for ReloadingCert {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current.read().clone())
    }
}

/// A server configuration presenting `cert`, offering `alpn` (e.g. `h2`,
/// `http/1.1`), and, with `client_ca`, requiring client certificates signed by
/// that CA (mutual TLS).
pub fn server_config(
    cert: Arc<ReloadingCert>,
    client_ca: Option<&Path>,
    alpn: &[&[u8]],
) -> Result<Arc<ServerConfig>, TlsError> {
    let builder =
        ServerConfig::builder_with_provider(provider()).with_safe_default_protocol_versions()?;
    let builder = match client_ca {
        Some(ca) => {
            let verifier =
                WebPkiClientVerifier::builder_with_provider(Arc::new(read_roots(ca)?), provider())
                    .build()
                    .map_err(|e| TlsError::Verifier {
                        path: ca.to_path_buf(),
                        message: e.to_string(),
                    })?;
            builder.with_client_cert_verifier(verifier)
        }
        None => builder.with_no_client_auth(),
    };
    let mut cfg = builder.with_cert_resolver(cert);
    cfg.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Ok(Arc::new(cfg))
}

/// A client configuration trusting the CAs of `ca` (a private PKI), presenting
/// `identity` (certificate and key files) when the server asks for one.
pub fn client_config(
    ca: &Path,
    identity: Option<(&Path, &Path)>,
    alpn: &[&[u8]],
) -> Result<Arc<ClientConfig>, TlsError> {
    let builder = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_root_certificates(read_roots(ca)?);
    let mut cfg = match identity {
        Some((cert, key)) => builder.with_client_auth_cert(read_certs(cert)?, read_key(key)?)?,
        None => builder.with_no_client_auth(),
    };
    cfg.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Ok(Arc::new(cfg))
}

/// A client configuration trusting the system's CAs: the certificates of
/// `SSL_CERT_FILE` / `SSL_CERT_DIR` when set (a private CA such as the one
/// `agentenv up --tls` makes), else the distribution's bundle.
pub fn system_client_config(alpn: &[&[u8]]) -> Result<Arc<ClientConfig>, TlsError> {
    let found = rustls_native_certs::load_native_certs();
    let mut roots = RootCertStore::empty();
    let (added, _) = roots.add_parsable_certificates(found.certs);
    if added == 0 {
        let why = found
            .errors
            .first()
            .map_or_else(|| "none found".to_string(), |e| e.to_string());
        return Err(TlsError::File {
            what: "system CA certificates",
            path: std::env::var_os("SSL_CERT_FILE")
                .map_or_else(|| PathBuf::from("/etc/ssl/certs"), PathBuf::from),
            message: format!("{why} (set SSL_CERT_FILE to a PEM file of the CA to trust)"),
        });
    }
    let mut cfg = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();
    cfg.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Ok(Arc::new(cfg))
}
