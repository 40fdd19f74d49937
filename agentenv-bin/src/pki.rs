//! A certificate authority for a cluster and the certificates it signs (rcgen), as PEM
//! files: what `agentenv certs` writes for a static deployment and `agentenv up --tls`
//! for a local cluster.
//!
//! - `ca.pem`: the CA every process and client trusts (clients: `SSL_CERT_FILE`);
//!   `ca-key.pem` only where certificates are issued later (`agentenv certs ca`);
//!   `agentenv up` keeps the CA key in memory and never writes it;
//! - `<name>.pem` / `<name>-key.pem`: a certificate for `127.0.0.1`, `::1`,
//!   `localhost` and the addresses and names given, valid for both ends of a
//!   link (server and client authentication), so a node's certificate serves its
//!   API and identifies it to a scheduler that requires client certificates.
//!
//! Keys are written with mode 0600, in a directory of mode 0700 when it is made here.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SanType,
};

/// Why a certificate could not be made or read.
#[derive(Debug, thiserror::Error)]
pub enum PkiError {
    #[error("making {what}: {source}")]
    Make {
        what: String,
        #[source]
        source: rcgen::Error,
    },
    #[error("{what} {}: {source}", path.display())]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{} exists; pass --force to replace it", .0.display())]
    Exists(PathBuf),
    #[error("{} is not a CA made by `agentenv certs ca` ({reason}); make one with `agentenv certs ca --dir {}`", path.display(), dir.display())]
    BadCa {
        path: PathBuf,
        dir: PathBuf,
        reason: String,
    },
    #[error("--name {0:?}: use letters, digits, dots, dashes and underscores (it names the files)")]
    BadName(String),
}

/// A certificate and its key, as PEM files.
#[derive(Debug, Clone)]
pub struct Identity {
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// What a certificate is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Both ends of a link: a listener's certificate that also identifies its
    /// holder as a client (mutual TLS).
    Peer,
    /// A client only.
    Client,
}

/// What to issue.
#[derive(Debug, Clone)]
pub struct Request<'a> {
    /// Names the files `<name>.pem` and `<name>-key.pem` and the subject.
    pub name: &'a str,
    /// Addresses besides loopback.
    pub ips: &'a [IpAddr],
    /// DNS names besides `localhost`.
    pub dns: &'a [String],
    pub role: Role,
    /// Days of validity.
    pub days: u32,
    /// Replace existing files (a renewal).
    pub force: bool,
}

impl<'a> Request<'a> {
    /// A peer certificate for `name`, valid for 825 days (the longest that common
    /// clients accept for a leaf).
    pub fn peer(name: &'a str, ips: &'a [IpAddr]) -> Self {
        Self {
            name,
            ips,
            dns: &[],
            role: Role::Peer,
            days: 825,
            force: false,
        }
    }
}

/// A cluster's CA while it issues certificates.
pub struct Pki {
    dir: PathBuf,
    issuer: Issuer<'static, KeyPair>,
    /// The CA's certificate file.
    pub ca: PathBuf,
}

const CA_DAYS: i64 = 3650;

fn make_err(what: impl Into<String>) -> impl FnOnce(rcgen::Error) -> PkiError {
    let what = what.into();
    move |source| PkiError::Make { what, source }
}

fn io_err<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> PkiError + 'a {
    move |source| PkiError::Io {
        what,
        path: path.to_path_buf(),
        source,
    }
}

/// `days` from now, and a day ago (clocks differ a little between hosts).
fn validity(params: &mut CertificateParams, days: i64) {
    let now = time::OffsetDateTime::now_utc();
    params.not_before = now - time::Duration::days(1);
    params.not_after = now + time::Duration::days(days);
}

/// Makes `dir` (mode 0700) if it does not exist.
fn private_dir(dir: &Path) -> Result<(), PkiError> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(io_err("creating", dir))
}

impl Pki {
    /// A new CA in `dir` whose key is kept in memory only (`agentenv up --tls`).
    pub fn ephemeral(dir: &Path) -> Result<Pki, PkiError> {
        private_dir(dir)?;
        let (pki, _) = Self::make(dir, true)?;
        Ok(pki)
    }

    /// A new CA in `dir` with its key in `ca-key.pem`, to issue certificates later
    /// (`agentenv certs ca`). Refuses to replace an existing CA.
    pub fn init(dir: &Path) -> Result<Pki, PkiError> {
        private_dir(dir)?;
        for f in ["ca.pem", "ca-key.pem"] {
            if dir.join(f).exists() {
                return Err(PkiError::Exists(dir.join(f)));
            }
        }
        let (pki, key_pem) = Self::make(dir, true)?;
        write(&dir.join("ca-key.pem"), key_pem.as_bytes(), 0o600, false)?;
        Ok(pki)
    }

    /// The CA in `dir` (`ca.pem` and `ca-key.pem`, as [`Pki::init`] wrote them).
    pub fn open(dir: &Path) -> Result<Pki, PkiError> {
        let bad = |path: PathBuf, reason: String| PkiError::BadCa {
            path,
            dir: dir.to_path_buf(),
            reason,
        };
        let ca = dir.join("ca.pem");
        let key_path = dir.join("ca-key.pem");
        let cert_pem = std::fs::read_to_string(&ca).map_err(|e| bad(ca.clone(), e.to_string()))?;
        let key_pem =
            std::fs::read_to_string(&key_path).map_err(|e| bad(key_path.clone(), e.to_string()))?;
        let key = KeyPair::from_pem(&key_pem).map_err(|e| bad(key_path.clone(), e.to_string()))?;
        let issuer =
            Issuer::from_ca_cert_pem(&cert_pem, key).map_err(|e| bad(ca.clone(), e.to_string()))?;
        Ok(Pki {
            dir: dir.to_path_buf(),
            issuer,
            ca,
        })
    }

    /// Makes the CA certificate (`ca.pem`); returns the key's PEM.
    fn make(dir: &Path, write_cert: bool) -> Result<(Pki, String), PkiError> {
        let key = KeyPair::generate().map_err(make_err("the CA key"))?;
        let mut params =
            CertificateParams::new(Vec::<String>::new()).map_err(make_err("the CA certificate"))?;
        params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        params
            .distinguished_name
            .push(DnType::CommonName, "AgentENV cluster CA");
        validity(&mut params, CA_DAYS);
        let cert = params
            .self_signed(&key)
            .map_err(make_err("the CA certificate"))?;
        let ca = dir.join("ca.pem");
        if write_cert {
            write(&ca, cert.pem().as_bytes(), 0o644, true)?;
        }
        let key_pem = key.serialize_pem();
        Ok((
            Pki {
                dir: dir.to_path_buf(),
                issuer: Issuer::new(params, key),
                ca,
            },
            key_pem,
        ))
    }

    /// Issues a certificate into `<dir>/<name>.pem` and `<dir>/<name>-key.pem`.
    pub fn issue(&self, r: &Request<'_>) -> Result<Identity, PkiError> {
        if r.name.is_empty()
            || !r
                .name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
            || r.name.starts_with('.')
        {
            return Err(PkiError::BadName(r.name.to_string()));
        }
        let id = Identity {
            cert: self.dir.join(format!("{}.pem", r.name)),
            key: self.dir.join(format!("{}-key.pem", r.name)),
        };
        if !r.force {
            for p in [&id.cert, &id.key] {
                if p.exists() {
                    return Err(PkiError::Exists(p.clone()));
                }
            }
        }
        let what = format!("the certificate of {}", r.name);
        let key = KeyPair::generate().map_err(make_err(what.clone()))?;
        let mut params =
            CertificateParams::new(Vec::<String>::new()).map_err(make_err(what.clone()))?;
        params.distinguished_name.push(DnType::CommonName, r.name);
        params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        validity(&mut params, i64::from(r.days.max(1)));
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        if r.role == Role::Peer {
            params
                .extended_key_usages
                .push(ExtendedKeyUsagePurpose::ServerAuth);
            let mut ips = vec![
                IpAddr::V4(Ipv4Addr::LOCALHOST),
                IpAddr::V6(Ipv6Addr::LOCALHOST),
            ];
            for ip in r.ips {
                if !ip.is_unspecified() && !ips.contains(ip) {
                    ips.push(*ip);
                }
            }
            params.subject_alt_names = ips.into_iter().map(SanType::IpAddress).collect();
            let mut names = vec!["localhost".to_string()];
            names.extend(r.dns.iter().filter(|d| *d != "localhost").cloned());
            for n in names {
                let san = n
                    .clone()
                    .try_into()
                    .map_err(make_err(format!("{what} (name {n:?})")))?;
                params.subject_alt_names.push(SanType::DnsName(san));
            }
        }
        let cert = params
            .signed_by(&key, &self.issuer)
            .map_err(make_err(what))?;
        write(&id.cert, cert.pem().as_bytes(), 0o644, true)?;
        write(&id.key, key.serialize_pem().as_bytes(), 0o600, true)?;
        Ok(id)
    }
}

/// Writes `data` to `path` with `mode` (replacing it when `replace`), through a
/// temporary file renamed into place, so a reader never sees half a file.
fn write(path: &Path, data: &[u8], mode: u32, replace: bool) -> Result<(), PkiError> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt;
    if !replace && path.exists() {
        return Err(PkiError::Exists(path.to_path_buf()));
    }
    let tmp = path.with_extension("pem.new");
    let _ = std::fs::remove_file(&tmp);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(mode)
        .open(&tmp)
        .map_err(io_err("writing", &tmp))?;
    f.write_all(data).map_err(io_err("writing", &tmp))?;
    f.sync_all().map_err(io_err("writing", &tmp))?;
    std::fs::rename(&tmp, path).map_err(io_err("writing", path))
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

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

    fn server(id: &Identity, client_ca: Option<&Path>) -> Arc<rustls::ServerConfig> {
        let cert = agentenv_core::tls::ReloadingCert::load(&id.cert, &id.key).unwrap();
        agentenv_core::tls::server_config(cert, client_ca, &[b"http/1.1"]).unwrap()
    }

    fn client(ca: &Path, id: Option<&Identity>) -> Arc<rustls::ClientConfig> {
        let identity = id.map(|i| (i.cert.as_path(), i.key.as_path()));
        agentenv_core::tls::client_config(ca, identity, &[b"http/1.1"]).unwrap()
    }

    #[test]
    fn certificates_verify_against_the_ca_for_loopback_and_the_given_addresses_only() {
        let dir = tempfile::tempdir().unwrap();
        let pki = Pki::ephemeral(dir.path()).unwrap();
        let ips = ["10.1.2.3".parse().unwrap()];
        let dns = ["gw.example.test".to_string()];
        let gw = pki
            .issue(&Request {
                dns: &dns,
                ..Request::peer("gateway", &ips)
            })
            .unwrap();
        let (c, s) = (client(&pki.ca, None), server(&gw, None));
        for name in [
            "127.0.0.1",
            "::1",
            "localhost",
            "10.1.2.3",
            "gw.example.test",
        ] {
            handshake(c.clone(), s.clone(), name).unwrap_or_else(|e| panic!("{name}: {e}"));
        }
        let e = handshake(c, s, "10.9.9.9").unwrap_err();
        assert!(e.to_string().contains("certificate"), "{e}");
    }

    #[test]
    fn mutual_tls_admits_certificates_of_the_ca_only() {
        let dir = tempfile::tempdir().unwrap();
        let pki = Pki::ephemeral(dir.path()).unwrap();
        let sched = pki.issue(&Request::peer("scheduler", &[])).unwrap();
        let node = pki.issue(&Request::peer("node-a", &[])).unwrap();
        let only_client = pki
            .issue(&Request {
                role: Role::Client,
                ..Request::peer("cluster-client", &[])
            })
            .unwrap();
        let s = server(&sched, Some(&pki.ca));
        // A node's certificate identifies it as a client too.
        handshake(client(&pki.ca, Some(&node)), s.clone(), "127.0.0.1").unwrap();
        handshake(client(&pki.ca, Some(&only_client)), s.clone(), "127.0.0.1").unwrap();
        assert!(handshake(client(&pki.ca, None), s.clone(), "127.0.0.1").is_err());
        // A certificate of another CA is refused.
        let other = tempfile::tempdir().unwrap();
        let foreign_pki = Pki::ephemeral(other.path()).unwrap();
        let foreign = foreign_pki.issue(&Request::peer("node-x", &[])).unwrap();
        assert!(handshake(client(&pki.ca, Some(&foreign)), s, "127.0.0.1").is_err());
        // A client-only certificate cannot serve.
        let e = handshake(
            client(&pki.ca, None),
            server(&only_client, None),
            "127.0.0.1",
        );
        assert!(e.is_err());
    }

    #[test]
    fn a_saved_ca_issues_later_and_nothing_is_replaced_without_force() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let ca_dir = dir.path().join("pki");
        Pki::init(&ca_dir).unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&ca_dir), 0o700);
        assert_eq!(mode(&ca_dir.join("ca-key.pem")), 0o600);
        assert!(matches!(Pki::init(&ca_dir), Err(PkiError::Exists(_))));

        let pki = Pki::open(&ca_dir).unwrap();
        let node = pki.issue(&Request::peer("node-a", &[])).unwrap();
        assert_eq!(mode(&node.key), 0o600);
        handshake(client(&pki.ca, None), server(&node, None), "127.0.0.1").unwrap();
        let before = std::fs::read(&node.cert).unwrap();
        assert!(matches!(
            pki.issue(&Request::peer("node-a", &[])),
            Err(PkiError::Exists(_))
        ));
        assert_eq!(std::fs::read(&node.cert).unwrap(), before);
        let renewed = pki
            .issue(&Request {
                force: true,
                ..Request::peer("node-a", &[])
            })
            .unwrap();
        assert_ne!(std::fs::read(&renewed.cert).unwrap(), before);
        for bad in ["", "../x", ".hidden", "a/b", "sp ace"] {
            assert!(
                matches!(
                    pki.issue(&Request::peer(bad, &[])),
                    Err(PkiError::BadName(_))
                ),
                "{bad:?}"
            );
        }
        let e = Pki::open(dir.path()).err().unwrap().to_string();
        assert!(e.contains("agentenv certs ca"), "{e}");
    }

    #[test]
    fn an_ephemeral_ca_never_writes_its_key() {
        let dir = tempfile::tempdir().unwrap();
        let pki = Pki::ephemeral(dir.path()).unwrap();
        pki.issue(&Request::peer("gateway", &[])).unwrap();
        let mut names: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        assert_eq!(names, ["ca.pem", "gateway-key.pem", "gateway.pem"]);
    }
}
