//! The TLS sections of the control-plane config (a listener's certificate, a
//! client link's CA) and which listen addresses count as loopback.

use serde::Deserialize;

use super::ConfigError;

/// A TLS listener: its certificate chain and key (PEM files) and, for mutual
/// TLS, the CA that client certificates must chain to. An empty `cert_file`
/// means plain TCP.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(default)]
pub struct TlsListen {
    pub cert_file: String,
    pub key_file: String,
    pub client_ca_file: String,
}

impl TlsListen {
    /// Whether TLS is configured.
    pub fn enabled(&self) -> bool {
        !self.cert_file.trim().is_empty()
    }

    pub(super) fn validate(&self, key: &str) -> Result<(), ConfigError> {
        match (
            self.cert_file.trim().is_empty(),
            self.key_file.trim().is_empty(),
        ) {
            (true, true) if self.client_ca_file.trim().is_empty() => Ok(()),
            (false, false) => Ok(()),
            _ => Err(ConfigError::invalid(
                key,
                "set cert_file and key_file together (PEM files); client_ca_file needs them too",
            )),
        }
    }
}

/// A TLS client link: the CA file that the server's certificate must chain to
/// (a private PKI) and, for mutual TLS, this side's certificate and key. An
/// empty `ca_file` means plain TCP.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(default)]
pub struct TlsConnect {
    pub ca_file: String,
    pub cert_file: String,
    pub key_file: String,
}

impl TlsConnect {
    /// Whether TLS is configured.
    pub fn enabled(&self) -> bool {
        !self.ca_file.trim().is_empty()
    }

    /// The client certificate and key files, when both are set.
    pub fn identity(&self) -> Option<(&str, &str)> {
        let (c, k) = (self.cert_file.trim(), self.key_file.trim());
        (!c.is_empty() && !k.is_empty()).then_some((c, k))
    }

    pub(super) fn validate(&self, key: &str) -> Result<(), ConfigError> {
        if self.cert_file.trim().is_empty() != self.key_file.trim().is_empty() {
            return Err(ConfigError::invalid(
                key,
                "set cert_file and key_file together (the client certificate for mutual TLS)",
            ));
        }
        if !self.enabled() && !self.cert_file.trim().is_empty() {
            return Err(ConfigError::invalid(
                key,
                "a client certificate needs ca_file (the CA the server's certificate chains to)",
            ));
        }
        Ok(())
    }
}
