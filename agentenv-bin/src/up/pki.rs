//! `agentenv up --tls`: a certificate authority made for this cluster and the
//! certificates it signs, written under `<data dir>/tls/`:
//!
//! - `ca.pem`: the CA every process and client trusts (give it to clients as
//!   `SSL_CERT_FILE`); its private key is never written, so nothing else can be
//!   signed with it once the cluster is up;
//! - `gateway.pem`/`gateway-key.pem`, `scheduler.pem`/`…`, `<node id>.pem`/`…`:
//!   server certificates for `127.0.0.1`, `::1`, `localhost` and the gateway's
//!   listen address;
//! - `cluster-client.pem`/`…`: the client certificate the gateway and the nodes
//!   present to the scheduler and the gateway to the nodes (mutual TLS on those
//!   links), which `agentenv up` itself uses to reach the nodes.
//!
//! Keys are written with mode 0600 in a directory of mode 0700.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SanType,
};

use super::UpError;
use super::config::fs_err;

/// A certificate and its key, as PEM files.
#[derive(Debug, Clone)]
pub struct Identity {
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// The cluster's CA (while it issues) and the client identity it made.
pub struct Pki {
    dir: PathBuf,
    issuer: Issuer<'static, KeyPair>,
    /// The CA's certificate file.
    pub ca: PathBuf,
    /// The client certificate of the cluster's own processes.
    pub client: Identity,
}

/// Why a certificate could not be made.
fn cert_err(what: &str, e: rcgen::Error) -> UpError {
    UpError::Tls(format!("making {what}: {e}"))
}

impl Pki {
    /// Makes the CA and the cluster's client certificate in `<data_dir>/tls`.
    pub fn create(data_dir: &Path) -> Result<Pki, UpError> {
        use std::os::unix::fs::DirBuilderExt;
        let dir = data_dir.join("tls");
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&dir)
            .map_err(fs_err("creating", &dir))?;
        let key = KeyPair::generate().map_err(|e| cert_err("the CA key", e))?;
        let mut params = CertificateParams::new(Vec::<String>::new())
            .map_err(|e| cert_err("the CA certificate", e))?;
        params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        params
            .distinguished_name
            .push(DnType::CommonName, "agentenv up local CA");
        let cert = params
            .self_signed(&key)
            .map_err(|e| cert_err("the CA certificate", e))?;
        let ca = dir.join("ca.pem");
        write(&ca, cert.pem().as_bytes(), 0o644)?;
        let mut pki = Pki {
            issuer: Issuer::new(params, key),
            ca,
            client: Identity {
                cert: PathBuf::new(),
                key: PathBuf::new(),
            },
            dir,
        };
        pki.client = pki.issue("cluster-client", &[], Role::Client)?;
        Ok(pki)
    }

    /// A server certificate for `name` valid for loopback and `extra` addresses.
    pub fn server(&self, name: &str, extra: &[IpAddr]) -> Result<Identity, UpError> {
        self.issue(name, extra, Role::Server)
    }

    fn issue(&self, name: &str, extra: &[IpAddr], role: Role) -> Result<Identity, UpError> {
        let what = format!("the certificate of {name}");
        let key = KeyPair::generate().map_err(|e| cert_err(&what, e))?;
        let mut params =
            CertificateParams::new(Vec::<String>::new()).map_err(|e| cert_err(&what, e))?;
        params.distinguished_name.push(DnType::CommonName, name);
        params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        match role {
            Role::Server => {
                params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
                let mut ips = vec![
                    IpAddr::V4(Ipv4Addr::LOCALHOST),
                    IpAddr::V6(Ipv6Addr::LOCALHOST),
                ];
                ips.extend(extra.iter().filter(|ip| !ip.is_unspecified()));
                ips.dedup();
                params.subject_alt_names = ips.into_iter().map(SanType::IpAddress).collect();
                params.subject_alt_names.push(SanType::DnsName(
                    "localhost".try_into().map_err(|e| cert_err(&what, e))?,
                ));
            }
            Role::Client => {
                params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
            }
        }
        let cert = params
            .signed_by(&key, &self.issuer)
            .map_err(|e| cert_err(&what, e))?;
        let id = Identity {
            cert: self.dir.join(format!("{name}.pem")),
            key: self.dir.join(format!("{name}-key.pem")),
        };
        write(&id.cert, cert.pem().as_bytes(), 0o644)?;
        write(&id.key, key.serialize_pem().as_bytes(), 0o600)?;
        Ok(id)
    }

    /// A client configuration trusting the CA and presenting the cluster's client
    /// certificate (HTTP/1.1 by ALPN).
    pub fn client_config(&self) -> Result<Arc<rustls::ClientConfig>, UpError> {
        agentenv_core::tls::client_config(
            &self.ca,
            Some((&self.client.cert, &self.client.key)),
            &[b"http/1.1"],
        )
        .map_err(|e| UpError::Tls(e.to_string()))
    }
}

/// What a certificate is for.
#[derive(Clone, Copy)]
enum Role {
    Server,
    Client,
}

/// Writes `data` to a new file `path` with `mode`.
fn write(path: &Path, data: &[u8], mode: u32) -> Result<(), UpError> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(mode)
        .open(path)
        .map_err(fs_err("writing", path))?;
    f.write_all(data).map_err(fs_err("writing", path))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustls::pki_types::ServerName;

    /// A whole handshake in memory between `client` (asking for `name`) and
    /// `server`; the first error either side raises.
    fn handshake(
        client: Arc<rustls::ClientConfig>,
        server: Arc<rustls::ServerConfig>,
        name: &str,
    ) -> Result<(), rustls::Error> {
        let name = ServerName::try_from(name.to_string()).unwrap();
        let mut c = rustls::ClientConnection::new(client, name)?;
        let mut s = rustls::ServerConnection::new(server)?;
        for _ in 0..10 {
            let mut wire = Vec::new();
            while c.wants_write() {
                c.write_tls(&mut wire).unwrap();
            }
            s.read_tls(&mut &wire[..]).unwrap();
            s.process_new_packets()?;
            let mut wire = Vec::new();
            while s.wants_write() {
                s.write_tls(&mut wire).unwrap();
            }
            c.read_tls(&mut &wire[..]).unwrap();
            c.process_new_packets()?;
            if !c.is_handshaking() && !s.is_handshaking() {
                return Ok(());
            }
        }
        panic!("the handshake did not finish");
    }

    #[test]
    fn server_certificates_verify_against_the_ca_for_loopback_and_the_listen_address() {
        let dir = tempfile::tempdir().unwrap();
        let pki = Pki::create(dir.path()).unwrap();
        let gw = pki
            .server("gateway", &["10.1.2.3".parse().unwrap()])
            .unwrap();
        let cert = agentenv_core::tls::ReloadingCert::load(&gw.cert, &gw.key).unwrap();
        let server = agentenv_core::tls::server_config(cert, None, &[b"http/1.1"]).unwrap();
        let client = agentenv_core::tls::client_config(&pki.ca, None, &[b"http/1.1"]).unwrap();
        for name in ["127.0.0.1", "::1", "localhost", "10.1.2.3"] {
            handshake(client.clone(), server.clone(), name)
                .unwrap_or_else(|e| panic!("{name}: {e}"));
        }
        let e = handshake(client, server, "10.9.9.9").unwrap_err();
        assert!(e.to_string().contains("certificate"), "{e}");
    }

    #[test]
    fn mutual_tls_admits_the_cluster_client_certificate_only() {
        let dir = tempfile::tempdir().unwrap();
        let pki = Pki::create(dir.path()).unwrap();
        let sched = pki.server("scheduler", &[]).unwrap();
        let cert = agentenv_core::tls::ReloadingCert::load(&sched.cert, &sched.key).unwrap();
        let server =
            agentenv_core::tls::server_config(cert, Some(&pki.ca), &[b"http/1.1"]).unwrap();
        handshake(pki.client_config().unwrap(), server.clone(), "127.0.0.1").unwrap();
        let anonymous = agentenv_core::tls::client_config(&pki.ca, None, &[b"http/1.1"]).unwrap();
        assert!(handshake(anonymous, server, "127.0.0.1").is_err());
    }

    #[test]
    fn keys_are_private_and_the_ca_key_is_never_written() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let pki = Pki::create(dir.path()).unwrap();
        let gw = pki.server("gateway", &[]).unwrap();
        for key in [&gw.key, &pki.client.key] {
            let mode = std::fs::metadata(key).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o600, "{}", key.display());
        }
        let tls_dir = std::fs::metadata(dir.path().join("tls")).unwrap();
        assert_eq!(tls_dir.permissions().mode() & 0o777, 0o700);
        let mut names: Vec<String> = std::fs::read_dir(dir.path().join("tls"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        assert_eq!(
            names,
            [
                "ca.pem",
                "cluster-client-key.pem",
                "cluster-client.pem",
                "gateway-key.pem",
                "gateway.pem"
            ]
        );
    }
}
