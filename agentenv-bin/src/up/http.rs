//! A minimal HTTP/1.1 client for talking to the local cluster (one request per
//! connection, `Connection: close`), and the Connect streaming envelope codec.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Errors of one HTTP exchange.
#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    #[error("cannot connect to {addr}: {source}")]
    Connect {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("{method} {path} on {addr}: {source}")]
    Io {
        method: String,
        path: String,
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("{method} {path} on {addr}: no answer within {timeout:?}")]
    Timeout {
        method: String,
        path: String,
        addr: SocketAddr,
        timeout: Duration,
    },
    #[error("{method} {path} on {addr}: malformed HTTP response")]
    Malformed {
        method: String,
        path: String,
        addr: SocketAddr,
    },
}

/// A response: status, lower-cased headers and the whole body.
#[derive(Debug, Clone)]
pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Response {
    /// The body parsed as JSON (`Null` when it is not JSON).
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or(serde_json::Value::Null)
    }

    /// The body as text.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// Sends one request and reads the whole response.
pub async fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
    timeout: Duration,
) -> Result<Response, HttpError> {
    let io = |source| HttpError::Io {
        method: method.into(),
        path: path.into(),
        addr,
        source,
    };
    let exchange = async {
        let mut s = TcpStream::connect(addr)
            .await
            .map_err(|source| HttpError::Connect { addr, source })?;
        s.set_nodelay(true).map_err(io)?;
        let mut head = format!(
            "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Length: {}\r\n",
            body.len()
        );
        for (k, v) in headers {
            head.push_str(&format!("{k}: {v}\r\n"));
        }
        head.push_str("\r\n");
        s.write_all(head.as_bytes()).await.map_err(io)?;
        s.write_all(body).await.map_err(io)?;
        let mut raw = Vec::new();
        s.read_to_end(&mut raw).await.map_err(io)?;
        Ok::<_, HttpError>(raw)
    };
    let raw = tokio::time::timeout(timeout, exchange)
        .await
        .map_err(|_| HttpError::Timeout {
            method: method.into(),
            path: path.into(),
            addr,
            timeout,
        })??;
    parse_response(&raw).ok_or_else(|| HttpError::Malformed {
        method: method.into(),
        path: path.into(),
        addr,
    })
}

fn parse_response(raw: &[u8]) -> Option<Response> {
    let end = raw.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = std::str::from_utf8(&raw[..end]).ok()?;
    let rest = &raw[end + 4..];
    let mut lines = head.split("\r\n");
    let status: u16 = lines.next()?.split_whitespace().nth(1)?.parse().ok()?;
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    let chunked = headers
        .iter()
        .any(|(k, v)| k == "transfer-encoding" && v.to_ascii_lowercase().contains("chunked"));
    let body = if chunked {
        dechunk(rest)?
    } else {
        rest.to_vec()
    };
    Some(Response {
        status,
        headers,
        body,
    })
}

fn dechunk(mut s: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        let eol = s.windows(2).position(|w| w == b"\r\n")?;
        let size_text = std::str::from_utf8(&s[..eol]).ok()?;
        let size_text = size_text.split(';').next()?.trim();
        let n = usize::from_str_radix(size_text, 16).ok()?;
        s = &s[eol + 2..];
        if n == 0 {
            return Some(out);
        }
        if s.len() < n {
            return None;
        }
        out.extend_from_slice(&s[..n]);
        s = s.get(n + 2..).unwrap_or(&[]);
    }
}

/// One Connect streaming envelope around `payload`.
pub fn envelope(payload: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(payload.len() + 5);
    v.push(0);
    v.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    v.extend_from_slice(payload);
    v
}

/// Splits a Connect stream into `(flags, payload)` envelopes; `None` if it is truncated.
pub fn split_envelopes(mut body: &[u8]) -> Option<Vec<(u8, Vec<u8>)>> {
    let mut out = Vec::new();
    while !body.is_empty() {
        if body.len() < 5 {
            return None;
        }
        let flags = body[0];
        let n = u32::from_be_bytes([body[1], body[2], body[3], body[4]]) as usize;
        let payload = body.get(5..5 + n)?;
        out.push((flags, payload.to_vec()));
        body = &body[5 + n..];
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunked_responses_are_joined_and_envelopes_round_trip() {
        let raw = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nX-A: b\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n";
        let r = parse_response(raw).unwrap();
        assert_eq!(r.status, 200);
        assert_eq!(r.body, b"abcde");
        assert!(r.headers.contains(&("x-a".into(), "b".into())));
        let mut stream = envelope(b"{\"a\":1}");
        stream.extend(envelope(b""));
        let parts = split_envelopes(&stream).unwrap();
        assert_eq!(parts, vec![(0, b"{\"a\":1}".to_vec()), (0, Vec::new())]);
        assert!(split_envelopes(&stream[..3]).is_none());
        assert!(parse_response(b"garbage").is_none());
    }
}
