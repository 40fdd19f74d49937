//! A fake internet for the egress tests: a network namespace joined to the host by a veth,
//! with addresses outside every denied range (`198.18.<slot>.0/24`), web servers (HTTP on
//! 80, HTTPS on 443 with a certificate of the test's own CA, a TCP greeting and echo on
//! 8080) on three of them, and a DNS server answering the test names.
//!
//! | address | name(s)                    | serves as |
//! |---------|----------------------------|-----------|
//! | `.2`    | `allowed.test`, `a.wild.test` | `web-a` |
//! | `.3`    | `other.test`, `wild.test`  | `web-b`   |
//! | `.4`    | `decoy.test`               | `decoy`   |
//! | `.53`   | DNS                        |           |
//!
//! Every server counts the connections it accepted, so a test can tell that a server was
//! never reached, and keeps the source address of the last one (what NAT made of it).

use std::convert::Infallible;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use hickory_resolver::proto::op::{Message, MessageType, OpCode, ResponseCode};
use hickory_resolver::proto::rr::rdata::A;
use hickory_resolver::proto::rr::{RData, Record, RecordType};
use http_body_util::Full;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

/// The identities of the three servers, by the last byte of their address.
pub const SERVERS: [(u8, &str); 3] = [(2, "web-a"), (3, "web-b"), (4, "decoy")];
/// The last byte of the DNS server's address.
pub const DNS_HOST: u8 = 53;
/// The port of the greeting and echo server.
pub const ECHO_PORT: u16 = 8080;

/// The fake internet of one test slot.
pub struct Internet {
    pub slot: u8,
    ns: String,
    /// The CA that signed the HTTPS servers' certificate, PEM.
    pub ca_pem: String,
    counts: Arc<[AtomicUsize; 3]>,
    peers: Peers,
    rt: Option<tokio::runtime::Runtime>,
}

/// The source address of each server's last connection.
type Peers = Arc<[Mutex<Option<IpAddr>>; 3]>;

/// What a server records of each connection: one more, and where it came from.
#[derive(Clone)]
struct Seen {
    counts: Arc<[AtomicUsize; 3]>,
    peers: Peers,
    i: usize,
}

impl Seen {
    fn record(&self, peer: SocketAddr) {
        self.counts[self.i].fetch_add(1, Ordering::SeqCst);
        *self.peers[self.i].lock().unwrap_or_else(|e| e.into_inner()) = Some(peer.ip());
    }
}

impl Internet {
    /// The address `198.18.<slot>.<host>`.
    pub fn ip(&self, host: u8) -> Ipv4Addr {
        Ipv4Addr::new(198, 18, self.slot, host)
    }

    /// The DNS server's address.
    pub fn dns(&self) -> Ipv4Addr {
        self.ip(DNS_HOST)
    }

    /// Connections the server `name` (`web-a`, `web-b`, `decoy`) accepted so far.
    pub fn connections(&self, name: &str) -> usize {
        let i = SERVERS
            .iter()
            .position(|(_, n)| *n == name)
            .expect("a server name");
        self.counts[i].load(Ordering::SeqCst)
    }

    /// The source address of the last connection the server `name` accepted.
    pub fn last_peer(&self, name: &str) -> Option<IpAddr> {
        let i = SERVERS
            .iter()
            .position(|(_, n)| *n == name)
            .expect("a server name");
        *self.peers[i].lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The name of the host's end of the veth to this internet.
    pub fn host_if(&self) -> String {
        format!("xeg{}", self.slot)
    }

    /// Makes the namespace, the veth and the servers of `slot` (what an earlier run of
    /// the slot left goes first).
    pub fn start(slot: u8) -> Self {
        let ns = format!("agentenv-egress-{slot}");
        let host_if = format!("xeg{slot}");
        let _ = std::process::Command::new("ip")
            .args(["netns", "del", &ns])
            .stderr(std::process::Stdio::null())
            .status();
        let _ = std::process::Command::new("ip")
            .args(["link", "del", &host_if])
            .stderr(std::process::Stdio::null())
            .status();
        let net = |host: u8| format!("198.18.{slot}.{host}");
        ip(&["netns", "add", &ns]);
        ip(&[
            "link", "add", &host_if, "type", "veth", "peer", "name", "eth0", "netns", &ns,
        ]);
        ip(&["addr", "add", &format!("{}/24", net(1)), "dev", &host_if]);
        ip(&["link", "set", &host_if, "up"]);
        for (host, _) in SERVERS {
            ip(&[
                "-n",
                &ns,
                "addr",
                "add",
                &format!("{}/24", net(host)),
                "dev",
                "eth0",
            ]);
        }
        ip(&[
            "-n",
            &ns,
            "addr",
            "add",
            &format!("{}/24", net(DNS_HOST)),
            "dev",
            "eth0",
        ]);
        ip(&["-n", &ns, "link", "set", "eth0", "up"]);
        ip(&["-n", &ns, "link", "set", "lo", "up"]);

        let (ca_pem, tls) = tls_config();
        let counts: Arc<[AtomicUsize; 3]> = Arc::new(Default::default());
        let peers: Peers = Arc::new(Default::default());
        // The servers run on a runtime of their own: a test's runtime may stop a node and
        // start another while they serve.
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let ns_path = format!("/run/netns/{ns}");
        for (i, (host, name)) in SERVERS.into_iter().enumerate() {
            let addr = Ipv4Addr::new(198, 18, slot, host);
            let (http, https, echo) = (
                listen_in(&ns_path, (addr, 80).into()),
                listen_in(&ns_path, (addr, 443).into()),
                listen_in(&ns_path, (addr, ECHO_PORT).into()),
            );
            let _guard = rt.enter();
            let acceptor = tokio_rustls::TlsAcceptor::from(tls.clone());
            let seen = Seen {
                counts: counts.clone(),
                peers: peers.clone(),
                i,
            };
            rt.spawn(serve_http(http, name, seen.clone(), None));
            rt.spawn(serve_http(https, name, seen.clone(), Some(acceptor)));
            rt.spawn(serve_echo(echo, name, seen));
        }
        let udp = udp_in(
            &ns_path,
            (Ipv4Addr::new(198, 18, slot, DNS_HOST), 53).into(),
        );
        {
            let _guard = rt.enter();
            rt.spawn(serve_dns(udp, slot));
        }
        Internet {
            slot,
            ns,
            ca_pem,
            counts,
            peers,
            rt: Some(rt),
        }
    }
}

impl Drop for Internet {
    fn drop(&mut self) {
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
        // The host end goes with its peer; the namespace may outlive its name a while
        // (a copy of its mount in a mount namespace made meanwhile holds it).
        let _ = std::process::Command::new("ip")
            .args(["link", "del", &format!("xeg{}", self.slot)])
            .status();
        let _ = std::process::Command::new("ip")
            .args(["netns", "del", &self.ns])
            .status();
    }
}

fn ip(args: &[&str]) {
    let out = std::process::Command::new("ip")
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "ip {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Runs `f` on a thread inside the namespace at `ns_path`.
fn in_ns<T: Send + 'static>(ns_path: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let file = std::fs::File::open(ns_path).unwrap();
    std::thread::spawn(move || {
        nix::sched::setns(file.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
        f()
    })
    .join()
    .unwrap()
}

fn listen_in(ns_path: &str, addr: SocketAddr) -> std::net::TcpListener {
    in_ns(ns_path, move || {
        let l = std::net::TcpListener::bind(addr).unwrap();
        l.set_nonblocking(true).unwrap();
        l
    })
}

fn udp_in(ns_path: &str, addr: SocketAddr) -> std::net::UdpSocket {
    in_ns(ns_path, move || {
        let s = std::net::UdpSocket::bind(addr).unwrap();
        s.set_nonblocking(true).unwrap();
        s
    })
}

/// A server configuration with a certificate for every test name, and its CA's PEM.
fn tls_config() -> (String, Arc<rustls::ServerConfig>) {
    use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
    let ca_key = KeyPair::generate().unwrap();
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    // Distinct names: a leaf named like its issuer looks self-signed to OpenSSL.
    ca.distinguished_name
        .push(rcgen::DnType::CommonName, "agentenv egress test CA");
    let ca_cert = ca.self_signed(&ca_key).unwrap();
    let issuer = Issuer::new(ca, ca_key);
    let key = KeyPair::generate().unwrap();
    let names = [
        "allowed.test",
        "other.test",
        "wild.test",
        "*.wild.test",
        "decoy.test",
    ];
    let mut leaf = CertificateParams::new(names.map(String::from).to_vec()).unwrap();
    leaf.distinguished_name
        .push(rcgen::DnType::CommonName, "allowed.test");
    let leaf = leaf.signed_by(&key, &issuer).unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let cfg = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(
            vec![leaf.der().clone()],
            rustls::pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into()),
        )
        .unwrap();
    (ca_cert.pem(), Arc::new(cfg))
}

/// Answers every request with the server's name, over plain HTTP or TLS.
async fn serve_http(
    l: std::net::TcpListener,
    name: &'static str,
    seen: Seen,
    tls: Option<tokio_rustls::TlsAcceptor>,
) {
    let l = tokio::net::TcpListener::from_std(l).unwrap();
    loop {
        let Ok((stream, peer)) = l.accept().await else {
            continue;
        };
        seen.record(peer);
        let tls = tls.clone();
        tokio::spawn(async move {
            let svc = hyper::service::service_fn(move |_req| async move {
                Ok::<_, Infallible>(hyper::Response::new(Full::new(Bytes::from_static(
                    name.as_bytes(),
                ))))
            });
            let http = hyper::server::conn::http1::Builder::new();
            match tls {
                Some(acceptor) => {
                    if let Ok(s) = acceptor.accept(stream).await {
                        let _ = http.serve_connection(TokioIo::new(s), svc).await;
                    }
                }
                None => {
                    let _ = http.serve_connection(TokioIo::new(stream), svc).await;
                }
            }
        });
    }
}

/// Greets with `hello <name>`, then echoes each line back.
async fn serve_echo(l: std::net::TcpListener, name: &'static str, seen: Seen) {
    let l = tokio::net::TcpListener::from_std(l).unwrap();
    loop {
        let Ok((stream, peer)) = l.accept().await else {
            continue;
        };
        seen.record(peer);
        tokio::spawn(async move {
            let (r, mut w) = stream.into_split();
            if w.write_all(format!("hello {name}\n").as_bytes())
                .await
                .is_err()
            {
                return;
            }
            let mut lines = BufReader::new(r).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                if w.write_all(format!("{line}\n").as_bytes()).await.is_err() {
                    return;
                }
            }
        });
    }
}

/// The address a test name resolves to.
fn lookup(slot: u8, name: &str) -> Option<Ipv4Addr> {
    let host = match name {
        "allowed.test" | "a.wild.test" => 2,
        "other.test" | "wild.test" => 3,
        "decoy.test" => 4,
        _ => return None,
    };
    Some(Ipv4Addr::new(198, 18, slot, host))
}

/// Answers A queries for the test names; other types of known names get no answer,
/// unknown names NXDOMAIN.
async fn serve_dns(s: std::net::UdpSocket, slot: u8) {
    let s = tokio::net::UdpSocket::from_std(s).unwrap();
    let mut buf = [0u8; 1500];
    loop {
        let Ok((n, peer)) = s.recv_from(&mut buf).await else {
            continue;
        };
        let Ok(q) = Message::from_vec(&buf[..n]) else {
            continue;
        };
        let mut resp = Message::new(q.metadata.id, MessageType::Response, OpCode::Query);
        resp.metadata.recursion_desired = q.metadata.recursion_desired;
        resp.metadata.recursion_available = true;
        resp.metadata.authoritative = true;
        for query in &q.queries {
            resp.add_query(query.clone());
            let name = query
                .name()
                .to_ascii()
                .trim_end_matches('.')
                .to_ascii_lowercase();
            match lookup(slot, &name) {
                Some(ip) if query.query_type() == RecordType::A => {
                    resp.add_answer(Record::from_rdata(
                        query.name().clone(),
                        60,
                        RData::A(A(ip)),
                    ));
                }
                Some(_) => {}
                None => resp.metadata.response_code = ResponseCode::NXDomain,
            }
        }
        if let Ok(bytes) = resp.to_vec() {
            let _ = s.send_to(&bytes, peer).await;
        }
    }
}
