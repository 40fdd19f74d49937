//! The name a connection asks for, read from its first bytes: the server name (SNI) of a
//! TLS ClientHello (parsed by rustls's [`Acceptor`]), or the `Host` header of an HTTP/1.x
//! request head (parsed by `httparse`). Reads are bounded ([`MAX_HEAD`]); the bytes read
//! are kept, to be sent on to the server.

use rustls::server::Acceptor;
use tokio::io::{AsyncRead, AsyncReadExt};

use super::policy::normalize_name;

/// The most bytes read before a name must be known: a ClientHello with large key shares
/// fits, as does a request head with its headers.
pub const MAX_HEAD: usize = 16 * 1024;

/// What a connection speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    Tls,
    Http,
}

/// The name a connection asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sniffed {
    pub protocol: Protocol,
    /// Normalized (lowercase, no trailing dot, no port).
    pub name: String,
}

/// Why a connection's name is unknown.
#[derive(Debug, thiserror::Error)]
pub enum SniffError {
    #[error("neither a TLS ClientHello nor an HTTP/1.x request")]
    NotWeb,
    #[error("the {0:?} connection names no server (no SNI, no Host header)")]
    NoName(Protocol),
    #[error("{0:?} is not a domain name")]
    BadName(String),
    #[error("malformed {protocol:?} start: {reason}")]
    Malformed { protocol: Protocol, reason: String },
    #[error("no name within the first {MAX_HEAD} bytes")]
    TooLarge,
    #[error("the connection ended before it named a server")]
    Closed,
    #[error("reading: {0}")]
    Io(#[from] std::io::Error),
}

/// The name in `buf` (a connection's first bytes), or `None` if more bytes are needed.
pub fn sniff(buf: &[u8]) -> Result<Option<Sniffed>, SniffError> {
    match buf.first() {
        None => Ok(None),
        Some(0x16) => sniff_tls(buf),
        Some(b) if b.is_ascii_uppercase() => sniff_http(buf),
        Some(_) => Err(SniffError::NotWeb),
    }
}

fn sniff_tls(buf: &[u8]) -> Result<Option<Sniffed>, SniffError> {
    let malformed = |reason: String| SniffError::Malformed {
        protocol: Protocol::Tls,
        reason,
    };
    let mut acceptor = Acceptor::default();
    let mut rest = buf;
    loop {
        // `read_tls` takes what its buffer holds at a time.
        let n = acceptor
            .read_tls(&mut rest)
            .map_err(|e| malformed(e.to_string()))?;
        match acceptor.accept() {
            Ok(Some(accepted)) => {
                let hello = accepted.client_hello();
                let raw = hello
                    .server_name()
                    .ok_or(SniffError::NoName(Protocol::Tls))?;
                let name = normalize_name(raw).ok_or_else(|| SniffError::BadName(raw.into()))?;
                return Ok(Some(Sniffed {
                    protocol: Protocol::Tls,
                    name,
                }));
            }
            Ok(None) if rest.is_empty() || n == 0 => return Ok(None),
            Ok(None) => {}
            Err((e, _alert)) => return Err(malformed(e.to_string())),
        }
    }
}

fn sniff_http(buf: &[u8]) -> Result<Option<Sniffed>, SniffError> {
    let mut headers = [httparse::EMPTY_HEADER; 64];
    let mut req = httparse::Request::new(&mut headers);
    match req.parse(buf) {
        Ok(httparse::Status::Partial) => return Ok(None),
        Ok(httparse::Status::Complete(_)) => {}
        Err(e) => {
            return Err(SniffError::Malformed {
                protocol: Protocol::Http,
                reason: e.to_string(),
            });
        }
    }
    let mut hosts = req
        .headers
        .iter()
        .filter(|h| h.name.eq_ignore_ascii_case("host"));
    let host = hosts.next().ok_or(SniffError::NoName(Protocol::Http))?;
    if hosts.next().is_some() {
        return Err(SniffError::Malformed {
            protocol: Protocol::Http,
            reason: "more than one Host header".into(),
        });
    }
    let value = std::str::from_utf8(host.value)
        .map_err(|_| SniffError::BadName(String::from_utf8_lossy(host.value).into_owned()))?
        .trim();
    // `name:port`; an IPv6 literal (`[…]`) is no name.
    let name = match value.rsplit_once(':') {
        Some((n, port)) if port.bytes().all(|b| b.is_ascii_digit()) => n,
        _ => value,
    };
    let name = normalize_name(name).ok_or_else(|| SniffError::BadName(value.into()))?;
    Ok(Some(Sniffed {
        protocol: Protocol::Http,
        name,
    }))
}

/// Reads from `r` into `buf` until its start names a server; `buf` keeps every byte read.
pub async fn read_name<R: AsyncRead + Unpin>(
    r: &mut R,
    buf: &mut Vec<u8>,
) -> Result<Sniffed, SniffError> {
    let mut chunk = [0u8; 4096];
    loop {
        if let Some(s) = sniff(buf)? {
            return Ok(s);
        }
        if buf.len() >= MAX_HEAD {
            return Err(SniffError::TooLarge);
        }
        let want = chunk.len().min(MAX_HEAD - buf.len());
        let n = r.read(&mut chunk[..want]).await?;
        if n == 0 {
            return Err(SniffError::Closed);
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    /// The first flight of a real rustls client for `name`.
    fn client_hello(name: &str) -> Vec<u8> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(rustls::RootCertStore::empty())
            .with_no_client_auth();
        let server = rustls::pki_types::ServerName::try_from(name.to_string()).unwrap();
        let mut conn = rustls::ClientConnection::new(Arc::new(config), server).unwrap();
        let mut out = Vec::new();
        while conn.wants_write() {
            conn.write_tls(&mut out).unwrap();
        }
        out
    }

    #[test]
    fn the_server_name_of_a_real_client_hello_is_found() {
        let hello = client_hello("API.Example.com");
        let s = sniff(&hello).unwrap().unwrap();
        assert_eq!(s.protocol, Protocol::Tls);
        assert_eq!(s.name, "api.example.com");
    }

    #[test]
    fn a_partial_client_hello_asks_for_more_at_every_cut() {
        let hello = client_hello("example.com");
        for cut in 1..hello.len() {
            assert!(
                sniff(&hello[..cut]).unwrap().is_none(),
                "a cut at {cut} of {} gave an answer",
                hello.len()
            );
        }
    }

    #[tokio::test]
    async fn a_client_hello_arriving_byte_by_byte_is_read_whole_and_kept() {
        let hello = client_hello("example.com");
        let (mut client, mut server) = tokio::io::duplex(1);
        let sent = hello.clone();
        tokio::spawn(async move {
            use tokio::io::AsyncWriteExt;
            for b in sent {
                client.write_all(&[b]).await.unwrap();
            }
        });
        let mut buf = Vec::new();
        let s = read_name(&mut server, &mut buf).await.unwrap();
        assert_eq!(s.name, "example.com");
        assert_eq!(buf, hello, "every byte read is kept for the server");
    }

    #[test]
    fn a_client_hello_without_a_name_is_refused() {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(rustls::RootCertStore::empty())
            .with_no_client_auth();
        // An IP address as the server name: rustls sends no SNI.
        let server = rustls::pki_types::ServerName::try_from("198.18.0.2").unwrap();
        let mut conn = rustls::ClientConnection::new(Arc::new(config), server).unwrap();
        let mut out = Vec::new();
        conn.write_tls(&mut out).unwrap();
        assert!(matches!(
            sniff(&out),
            Err(SniffError::NoName(Protocol::Tls))
        ));
    }

    #[test]
    fn garbage_after_a_handshake_byte_is_malformed() {
        let mut bad = client_hello("example.com");
        bad[5] = 0x02; // a ServerHello, not a ClientHello
        assert!(matches!(
            sniff(&bad),
            Err(SniffError::Malformed {
                protocol: Protocol::Tls,
                ..
            })
        ));
    }

    #[test]
    fn the_host_of_an_http_request_head_is_found_without_its_port() {
        let req = b"GET /x HTTP/1.1\r\nUser-Agent: t\r\nHost: Example.COM:8080\r\n\r\n";
        let s = sniff(req).unwrap().unwrap();
        assert_eq!(
            (s.protocol, s.name.as_str()),
            (Protocol::Http, "example.com")
        );
        for cut in 1..req.len() - 1 {
            assert!(sniff(&req[..cut]).unwrap().is_none(), "cut at {cut}");
        }
    }

    #[test]
    fn http_heads_without_one_valid_host_are_refused() {
        let cases: [(&[u8], &str); 5] = [
            (b"GET / HTTP/1.0\r\n\r\n", "NoName"),
            (b"GET / HTTP/1.1\r\nHost: 198.18.0.2\r\n\r\n", "BadName"),
            (b"GET / HTTP/1.1\r\nHost: [::1]:80\r\n\r\n", "BadName"),
            (
                b"GET / HTTP/1.1\r\nHost: a.com\r\nHost: b.com\r\n\r\n",
                "Malformed",
            ),
            (b"GET / HTTP/1.1\r\nHo st: a.com\r\n\r\n", "Malformed"),
        ];
        for (req, want) in cases {
            let got = format!("{:?}", sniff(req));
            assert!(
                got.contains(want),
                "{:?}: {got}",
                String::from_utf8_lossy(req)
            );
        }
        assert!(matches!(sniff(b"\x00\x01"), Err(SniffError::NotWeb)));
        assert!(matches!(
            sniff(b"SSH-2.0-OpenSSH\r\n"),
            Err(SniffError::Malformed { .. })
        ));
    }

    #[tokio::test]
    async fn a_head_that_never_names_a_server_stops_at_the_bound() {
        let mut endless = b"GET / HTTP/1.1\r\nX-Pad: ".to_vec();
        endless.resize(MAX_HEAD * 2, b'a');
        let mut r = &endless[..];
        let mut buf = Vec::new();
        let e = read_name(&mut r, &mut buf).await.unwrap_err();
        assert!(matches!(e, SniffError::TooLarge), "{e}");
        assert!(buf.len() <= MAX_HEAD);
        let mut closed = &b"GET / HTTP/1.1\r\nHost: a"[..];
        assert!(matches!(
            read_name(&mut closed, &mut Vec::new()).await,
            Err(SniffError::Closed)
        ));
    }
}
