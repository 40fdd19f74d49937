//! Heads: parsing a request head in place and deciding whether the fast
//! lane takes it (writing its upstream header block if so), parsing a
//! node's response head and rewriting it for the client, and the heads of
//! the gateway's own answers. Hop-by-hop and forwarding headers are
//! rewritten as the hyper lane's `forward` module does.

use std::io;
use std::mem::MaybeUninit;
use std::ops::Range;

use http::Method;

use super::Peer;
use super::framing::Framing;
use crate::routing::{
    API_KEY_HEADER, E2B_SANDBOX_ID_HEADER, E2B_SANDBOX_PORT_HEADER, NODE_ID_HEADER, RouteSource,
    SANDBOX_ID_HEADER, TARGET_PORT_HEADER, is_proxy_path, records_assignment, route_label,
};
use crate::server::route::{Decision, Router, RoutingFacts, decode_path};

/// A head larger than this is left to hyper (which answers 431).
pub(super) const MAX_HEAD: usize = 64 * 1024;
/// As many header lines as hyper accepts.
const MAX_HEADERS: usize = 100;

/// Where the sandbox id of a request is.
pub(super) enum IdSpan {
    Buf(Range<usize>),
    Owned(String),
}

/// A request the fast lane takes, with its upstream header block already
/// in `Client::out`.
pub(super) struct Plan {
    pub(super) head_len: usize,
    pub(super) method: Method,
    pub(super) route: &'static str,
    pub(super) path: Range<usize>,
    pub(super) query: Option<Range<usize>>,
    pub(super) id: IdSpan,
    pub(super) source: RouteSource,
    /// Data-plane routes go under `/proxy` (kept once if already there).
    pub(super) under_proxy: bool,
    pub(super) content_length: u64,
    /// The client sent `Connection: close`.
    pub(super) close: bool,
}

pub(super) enum Analysis {
    Ready(Plan),
    Partial,
    Handover,
}

/// What the fast lane needs from the request headers.
#[derive(Default)]
struct Facts<'b> {
    host: Option<&'b [u8]>,
    content_length: Option<u64>,
    sandbox_id: Option<&'b str>,
    e2b_sandbox_id: Option<&'b str>,
    has_port: bool,
    api_keys: usize,
    api_key: &'b [u8],
    close: bool,
    /// Header names listed in `Connection` (besides close/keep-alive).
    named: ConnectionNamed<'b>,
}

/// The value as `HeaderValue::to_str` sees it: visible ASCII and tabs only.
/// A `Content-Length` value: decimal digits only (around optional spaces and
/// tabs), no sign, no overflow. `str::parse` would take `+5`, which other
/// parsers on the path may read differently.
pub(super) fn content_length(v: &[u8]) -> Option<u64> {
    let ows = |b: &u8| *b == b' ' || *b == b'\t';
    let start = v.iter().position(|b| !ows(b)).unwrap_or(v.len());
    let end = v.iter().rposition(|b| !ows(b)).map_or(start, |i| i + 1);
    let v = &v[start..end];
    if v.is_empty() || !v.iter().all(u8::is_ascii_digit) {
        return None;
    }
    v.iter().try_fold(0u64, |n, &d| {
        n.checked_mul(10)?.checked_add(u64::from(d - b'0'))
    })
}

fn text(v: &[u8]) -> Option<&str> {
    v.iter()
        .all(|&b| b == b'\t' || (32..127).contains(&b))
        .then(|| std::str::from_utf8(v).ok())
        .flatten()
}

/// The first non-blank value wins, as `routing::header_str` does.
fn first_nonblank<'b>(slot: &mut Option<&'b str>, v: &'b [u8]) {
    if slot.is_none()
        && let Some(t) = text(v).map(str::trim)
        && !t.is_empty()
    {
        *slot = Some(t);
    }
}

/// A request target of plain URI characters (a subset of what hyper
/// accepts; anything else goes to hyper, which decides).
fn plain_target(t: &str) -> bool {
    t.starts_with('/')
        && t.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-._~!$&'()*+,;=:@/%?".contains(&b))
}

/// The header names the fast lane looks at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Hdr {
    Other,
    Host,
    ContentLength,
    TransferEncoding,
    Upgrade,
    Expect,
    Te,
    Trailer,
    Connection,
    KeepAlive,
    ProxyConnection,
    ProxyAuthenticate,
    ProxyAuthorization,
    ContentType,
    ConnectProtocolVersion,
    Accept,
    ApiKey,
    SandboxId,
    E2bSandboxId,
    TargetPort,
    E2bSandboxPort,
    Forwarded,
    XForwardedHost,
    XForwardedProto,
    XForwardedFor,
    XForwardedMethod,
    XForwardedUri,
    Date,
    NodeId,
}

/// A header name, compared once (by length first) against the names above.
fn classify(name: &str) -> Hdr {
    use Hdr::*;
    let candidates: &[(&str, Hdr)] = match name.len() {
        2 => &[("te", Te)],
        4 => &[("host", Host), ("date", Date)],
        6 => &[("expect", Expect), ("accept", Accept)],
        7 => &[("upgrade", Upgrade), ("trailer", Trailer)],
        9 => &[(API_KEY_HEADER, ApiKey), ("forwarded", Forwarded)],
        10 => &[("connection", Connection), ("keep-alive", KeepAlive)],
        12 => &[("content-type", ContentType)],
        14 => &[
            ("content-length", ContentLength),
            (E2B_SANDBOX_ID_HEADER, E2bSandboxId),
        ],
        15 => &[
            ("x-forwarded-for", XForwardedFor),
            ("x-forwarded-uri", XForwardedUri),
        ],
        16 => &[
            (E2B_SANDBOX_PORT_HEADER, E2bSandboxPort),
            ("proxy-connection", ProxyConnection),
            ("x-forwarded-host", XForwardedHost),
        ],
        17 => &[
            ("transfer-encoding", TransferEncoding),
            ("x-forwarded-proto", XForwardedProto),
        ],
        18 => &[
            ("proxy-authenticate", ProxyAuthenticate),
            ("x-forwarded-method", XForwardedMethod),
            (NODE_ID_HEADER, NodeId),
        ],
        19 => &[("proxy-authorization", ProxyAuthorization)],
        21 => &[(SANDBOX_ID_HEADER, SandboxId)],
        22 => &[(TARGET_PORT_HEADER, TargetPort)],
        24 => &[("connect-protocol-version", ConnectProtocolVersion)],
        _ => return Other,
    };
    candidates
        .iter()
        .find(|(n, _)| n.eq_ignore_ascii_case(name))
        .map_or(Other, |&(_, h)| h)
}

/// Hop-by-hop headers: never relayed in either direction (`Trailer` is
/// kept on responses, as in the hyper path).
fn hop_by_hop(h: Hdr) -> bool {
    use Hdr::*;
    matches!(
        h,
        Connection
            | KeepAlive
            | ProxyConnection
            | ProxyAuthenticate
            | ProxyAuthorization
            | Te
            | TransferEncoding
            | Upgrade
    )
}

/// Request headers that never go upstream as the client sent them.
fn dropped_upstream(h: Hdr, host_routed: bool) -> bool {
    use Hdr::*;
    hop_by_hop(h)
        || matches!(
            h,
            Trailer
                | Forwarded
                | XForwardedHost
                | XForwardedProto
                | XForwardedFor
                | XForwardedMethod
                | XForwardedUri
                | Host
        )
        || (host_routed && matches!(h, SandboxId | TargetPort))
}

fn push_header(out: &mut Vec<u8>, name: &[u8], value: &[u8]) {
    out.extend_from_slice(name);
    out.extend_from_slice(b": ");
    out.extend_from_slice(value);
    out.extend_from_slice(b"\r\n");
}

/// Offsets of `s` within `buf`, when it is a slice of it.
fn span_in(buf: &[u8], s: &str) -> Option<Range<usize>> {
    let start = (s.as_ptr() as usize).checked_sub(buf.as_ptr() as usize)?;
    (start + s.len() <= buf.len()).then_some(start..start + s.len())
}

/// A response head, rewritten for the client into `Client::out`.
pub(super) struct RespHead {
    pub(super) status: u16,
    pub(super) framing: Framing,
    /// The node will close its side (`Connection: close`).
    pub(super) upstream_close: bool,
}

/// What a response head is read for.
pub(super) struct Expect<'a> {
    pub(super) head_request: bool,
    /// The client asked to close after this response.
    pub(super) client_close: bool,
    /// `x-agentenv-node-id` for the response (debug mode).
    pub(super) debug_node: Option<&'a str>,
}

/// Header names a `Connection` header lists (besides `close`): hop-by-hop
/// for this message alone. The fast lane keeps up to eight.
#[derive(Default)]
struct ConnectionNamed<'b> {
    names: [&'b str; 8],
    len: usize,
}

impl<'b> ConnectionNamed<'b> {
    fn is_full(&self) -> bool {
        self.len == self.names.len()
    }

    /// Adds `name` unless eight are listed already.
    fn push(&mut self, name: &'b str) {
        if !self.is_full() {
            self.names[self.len] = name;
            self.len += 1;
        }
    }

    #[inline]
    fn contains(&self, name: &str) -> bool {
        self.names[..self.len]
            .iter()
            .any(|n| n.eq_ignore_ascii_case(name))
    }
}

/// Parses the head at the start of `buf` and decides whether the fast
/// lane takes it; if so, writes its upstream header block into `out`.
pub(super) fn analyze(router: &Router, buf: &[u8], out: &mut Vec<u8>, peer: &Peer) -> Analysis {
    // Left uninitialized: httparse writes what it parses.
    let mut headers = [const { MaybeUninit::uninit() }; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut []);
    let head_len = match req.parse_with_uninit_headers(buf, &mut headers) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => return Analysis::Partial,
        Err(_) => return Analysis::Handover,
    };
    let (Some(1), Some(method), Some(target)) = (req.version, req.method, req.path) else {
        return Analysis::Handover;
    };
    if !plain_target(target) {
        return Analysis::Handover;
    }
    let Ok(method) = Method::from_bytes(method.as_bytes()) else {
        return Analysis::Handover;
    };
    if method == Method::CONNECT {
        return Analysis::Handover;
    }
    let mut f = Facts::default();
    let mut kinds = [Hdr::Other; MAX_HEADERS];
    for (h, kind) in req.headers.iter().zip(kinds.iter_mut()) {
        let value = h.value;
        *kind = classify(h.name);
        match *kind {
            Hdr::Host => {
                f.host.get_or_insert(value);
            }
            Hdr::ContentLength => {
                let n = content_length(value);
                match (n, f.content_length) {
                    (Some(n), None) => f.content_length = Some(n),
                    _ => return Analysis::Handover,
                }
            }
            Hdr::TransferEncoding | Hdr::Upgrade | Hdr::Expect | Hdr::Te => {
                return Analysis::Handover;
            }
            Hdr::Connection => {
                let Some(v) = text(value) else {
                    return Analysis::Handover;
                };
                for token in v.split(',').map(str::trim).filter(|t| !t.is_empty()) {
                    if token.eq_ignore_ascii_case("close") {
                        f.close = true;
                    } else if token.eq_ignore_ascii_case("upgrade") || f.named.is_full() {
                        return Analysis::Handover;
                    } else if !token.eq_ignore_ascii_case("keep-alive") {
                        f.named.push(token);
                    }
                }
            }
            Hdr::ContentType => {
                let ct = value.trim_ascii();
                let starts =
                    |p: &[u8]| ct.get(..p.len()).is_some_and(|x| x.eq_ignore_ascii_case(p));
                if starts(b"application/grpc") || starts(b"application/connect+") {
                    return Analysis::Handover;
                }
            }
            Hdr::ConnectProtocolVersion if text(value).is_some_and(|t| !t.trim().is_empty()) => {
                return Analysis::Handover;
            }
            Hdr::Accept
                if text(value)
                    .is_some_and(|t| t.trim().eq_ignore_ascii_case("text/event-stream")) =>
            {
                return Analysis::Handover;
            }
            Hdr::ApiKey => {
                f.api_keys += 1;
                f.api_key = value;
            }
            Hdr::SandboxId => first_nonblank(&mut f.sandbox_id, value),
            Hdr::E2bSandboxId => first_nonblank(&mut f.e2b_sandbox_id, value),
            Hdr::TargetPort | Hdr::E2bSandboxPort => {
                f.has_port |= text(value).is_some_and(|t| !t.trim().is_empty());
            }
            _ => {}
        }
    }
    let (path, query) = match target.split_once('?') {
        Some((p, q)) => (p, Some(q)),
        None => (target, None),
    };
    let Some(decoded) = decode_path(path) else {
        return Analysis::Handover;
    };
    let host_route = router.host_route(f.host.and_then(text).unwrap_or(""));
    // The console is hyper's: its answers are the gateway's own.
    if matches!(host_route, Ok(None)) && crate::console::is_console_path(&decoded) {
        return Analysis::Handover;
    }
    let facts = RoutingFacts {
        method: &method,
        decoded: &decoded,
        host_route: &host_route,
        sandbox_id: f.sandbox_id.or(f.e2b_sandbox_id),
        has_port: f.has_port,
    };
    let authorized = || f.api_keys == 1 && router.key_matches(f.api_key);
    let (id, source) = match router.decide(&facts, authorized) {
        Decision::Route {
            id: Some(id),
            source,
        } if !records_assignment(&method, &decoded, source) => (id, source),
        _ => return Analysis::Handover,
    };
    let id = match span_in(buf, id) {
        Some(r) => IdSpan::Buf(r),
        None => IdSpan::Owned(id.to_string()),
    };
    let host_routed = source == RouteSource::Host;
    let data_plane = source.is_data_plane();
    out.clear();
    for (h, &kind) in req.headers.iter().zip(kinds.iter()) {
        if dropped_upstream(kind, host_routed)
            || (data_plane && kind == Hdr::ApiKey)
            || f.named.contains(h.name)
        {
            continue;
        }
        push_header(out, h.name.as_bytes(), h.value);
    }
    if let Some(host) = f.host {
        push_header(out, b"host", host);
        push_header(out, b"x-forwarded-host", host);
    }
    push_header(out, b"x-forwarded-for", peer.xff.as_bytes());
    push_header(out, b"x-forwarded-proto", peer.proto());
    push_header(out, b"x-forwarded-method", method.as_str().as_bytes());
    push_header(out, b"x-forwarded-uri", target.as_bytes());
    if let Ok(Some(r)) = &host_route {
        push_header(out, SANDBOX_ID_HEADER.as_bytes(), r.sandbox_id.as_bytes());
        push_header(
            out,
            TARGET_PORT_HEADER.as_bytes(),
            r.port.to_string().as_bytes(),
        );
    }
    Analysis::Ready(Plan {
        head_len,
        route: route_label(&decoded),
        method,
        path: span_in(buf, path).expect("the path is part of the head"),
        query: query.and_then(|q| span_in(buf, q)),
        id,
        source,
        under_proxy: source.is_data_plane() && !is_proxy_path(&decoded),
        content_length: f.content_length.unwrap_or(0),
        close: f.close,
    })
}

/// `Some((head length, None))` for a 1xx answer, `Some((len, Some(head)))`
/// for the final one, `None` when incomplete.
pub(super) fn parse_response_head(
    buf: &[u8],
    out: &mut Vec<u8>,
    expect: &Expect<'_>,
) -> io::Result<Option<(usize, Option<RespHead>)>> {
    let debug_node = expect.debug_node;
    let mut headers = [const { MaybeUninit::uninit() }; MAX_HEADERS];
    let mut resp = httparse::Response::new(&mut []);
    let len = match httparse::ParserConfig::default().parse_response_with_uninit_headers(
        &mut resp,
        buf,
        &mut headers,
    ) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(e) => return Err(io::Error::other(format!("bad response head: {e}"))),
    };
    let status = resp.code.unwrap_or(0);
    if status == 101 {
        return Err(io::Error::other("unexpected 101 Switching Protocols"));
    }
    if (100..200).contains(&status) {
        return Ok(Some((len, None)));
    }
    let mut length = None;
    let mut chunked = None;
    let mut upstream_close = false;
    let mut has_date = false;
    let mut named = ConnectionNamed::default();
    let mut kinds = [Hdr::Other; MAX_HEADERS];
    for (h, kind) in resp.headers.iter().zip(kinds.iter_mut()) {
        *kind = classify(h.name);
        match *kind {
            Hdr::ContentLength => {
                let n = content_length(h.value);
                match (n, length) {
                    (Some(n), None) => length = Some(n),
                    (Some(n), Some(m)) if n == m => {}
                    _ => return Err(io::Error::other("bad Content-Length")),
                }
            }
            Hdr::TransferEncoding => {
                let last = text(h.value)
                    .and_then(|v| v.rsplit(',').next())
                    .map(str::trim)
                    .unwrap_or("");
                chunked = Some(last.eq_ignore_ascii_case("chunked"));
            }
            Hdr::Connection => {
                for token in text(h.value).unwrap_or("").split(',').map(str::trim) {
                    if token.eq_ignore_ascii_case("close") {
                        upstream_close = true;
                    } else if !token.is_empty() {
                        named.push(token);
                    }
                }
            }
            Hdr::Date => has_date = true,
            _ => {}
        }
    }
    let framing = if expect.head_request || status == 204 || status == 304 {
        Framing::Empty
    } else {
        match (chunked, length) {
            (Some(true), _) => Framing::Chunked,
            (Some(false), _) => Framing::Close,
            (None, Some(0)) => Framing::Empty,
            (None, Some(n)) => Framing::Length(n),
            (None, None) => Framing::Close,
        }
    };
    // httparse checked: three digits.
    start_status_line(out, status, resp.reason.unwrap_or(""));
    for (h, &kind) in resp.headers.iter().zip(kinds.iter()) {
        if hop_by_hop(kind)
            || (kind == Hdr::NodeId && debug_node.is_some())
            || (kind == Hdr::ContentLength && framing == Framing::Chunked)
            || named.contains(h.name)
        {
            continue;
        }
        push_header(out, h.name.as_bytes(), h.value);
    }
    if framing == Framing::Chunked {
        push_header(out, b"transfer-encoding", b"chunked");
    }
    if !has_date {
        push_header(out, b"date", &http_date());
    }
    if let Some(node) = debug_node {
        push_header(out, NODE_ID_HEADER.as_bytes(), node.as_bytes());
    }
    end_head(out, expect.client_close || framing == Framing::Close);
    Ok(Some((
        len,
        Some(RespHead {
            status,
            framing,
            upstream_close,
        }),
    )))
}

/// The head of an answer of the gateway's own (an error) whose whole body
/// is `body_len` bytes, into `out`.
pub(super) fn own_answer_head(
    out: &mut Vec<u8>,
    parts: &http::response::Parts,
    body_len: usize,
    close: bool,
) {
    start_status_line(
        out,
        parts.status.as_u16(),
        parts.status.canonical_reason().unwrap_or(""),
    );
    for (name, value) in &parts.headers {
        push_header(out, name.as_str().as_bytes(), value.as_bytes());
    }
    push_header(out, b"content-length", body_len.to_string().as_bytes());
    push_header(out, b"date", &http_date());
    end_head(out, close);
}

/// Starts `out` with the status line of a three-digit `status`.
fn start_status_line(out: &mut Vec<u8>, status: u16, reason: &str) {
    out.clear();
    out.extend_from_slice(b"HTTP/1.1 ");
    out.extend_from_slice(&[
        b'0' + (status / 100 % 10) as u8,
        b'0' + (status / 10 % 10) as u8,
        b'0' + (status % 10) as u8,
    ]);
    out.push(b' ');
    out.extend_from_slice(reason.as_bytes());
    out.extend_from_slice(b"\r\n");
}

/// Ends the head in `out`, asking to close the connection after this
/// message if `close`.
fn end_head(out: &mut Vec<u8>, close: bool) {
    if close {
        push_header(out, b"connection", b"close");
    }
    out.extend_from_slice(b"\r\n");
}

/// The current time as an HTTP date, formatted once a second per thread.
fn http_date() -> [u8; 29] {
    thread_local! {
        static CACHED: std::cell::Cell<(u64, [u8; 29])> = const { std::cell::Cell::new((0, [0; 29])) };
    }
    let now = std::time::SystemTime::now();
    let secs = now
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    CACHED.with(|c| {
        let (at, date) = c.get();
        if at == secs && date[0] != 0 {
            return date;
        }
        let mut out = [0u8; 29];
        let s = httpdate::fmt_http_date(now);
        let n = s.len().min(29);
        out[..n].copy_from_slice(&s.as_bytes()[..n]);
        c.set((secs, out));
        out
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_length_takes_digits_only() {
        assert_eq!(content_length(b"0"), Some(0));
        assert_eq!(content_length(b" 42\t"), Some(42));
        assert_eq!(content_length(b"18446744073709551615"), Some(u64::MAX));
        for bad in [
            &b"+5"[..],
            b"-1",
            b"",
            b" ",
            b"5 5",
            b"0x10",
            b"1e3",
            b"18446744073709551616",
        ] {
            assert_eq!(
                content_length(bad),
                None,
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    #[test]
    fn response_heads_are_rewritten_for_the_client() {
        let raw =
            b"HTTP/1.1 200 Fine\r\nConnection: x-hop, close\r\nx-hop: 1\r\nkeep-alive: t=1\r\n\
                    content-length: 3\r\nx-agentenv-node-id: spoofed\r\nX-Kept: y\r\n\r\nabc";
        let mut out = Vec::new();
        let expect = Expect {
            head_request: false,
            client_close: false,
            debug_node: Some("node-a"),
        };
        let (len, head) = parse_response_head(raw, &mut out, &expect)
            .unwrap()
            .unwrap();
        let head = head.unwrap();
        assert_eq!(len, raw.len() - 3);
        assert_eq!(head.status, 200);
        assert_eq!(head.framing, Framing::Length(3));
        assert!(head.upstream_close);
        let text = String::from_utf8(out).unwrap();
        assert!(text.starts_with("HTTP/1.1 200 Fine\r\n"), "{text}");
        assert!(text.contains("content-length: 3\r\n"), "{text}");
        assert!(text.contains("X-Kept: y\r\n"), "{text}");
        assert!(text.contains("x-agentenv-node-id: node-a\r\n"), "{text}");
        assert!(text.contains("\r\ndate: "), "{text}");
        for gone in ["x-hop", "keep-alive", "Connection", "spoofed"] {
            assert!(!text.contains(gone), "{gone} in {text}");
        }
        assert!(text.ends_with("\r\n\r\n"));
    }

    #[test]
    fn response_framing_follows_the_head() {
        let framing = |raw: &[u8], head_request: bool| {
            let expect = Expect {
                head_request,
                client_close: false,
                debug_node: None,
            };
            let mut out = Vec::new();
            parse_response_head(raw, &mut out, &expect)
                .unwrap()
                .unwrap()
                .1
                .unwrap()
                .framing
        };
        let chunked =
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip, chunked\r\ncontent-length: 9\r\n\r\n";
        assert_eq!(framing(chunked, false), Framing::Chunked);
        let gzip_only = b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip\r\n\r\n";
        assert_eq!(framing(gzip_only, false), Framing::Close);
        assert_eq!(framing(b"HTTP/1.1 200 OK\r\n\r\n", false), Framing::Close);
        assert_eq!(
            framing(b"HTTP/1.1 204 No Content\r\n\r\n", false),
            Framing::Empty
        );
        let sized = b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n";
        assert_eq!(framing(sized, true), Framing::Empty);
        assert_eq!(framing(sized, false), Framing::Length(5));
        let mut out = Vec::new();
        let expect = Expect {
            head_request: false,
            client_close: false,
            debug_node: None,
        };
        let conflicting = b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\ncontent-length: 6\r\n\r\n";
        assert!(parse_response_head(conflicting, &mut out, &expect).is_err());
        let early = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\n";
        assert!(matches!(
            parse_response_head(early, &mut out, &expect),
            Ok(Some((25, None)))
        ));
    }

    #[test]
    fn only_plain_origin_form_targets_take_the_fast_lane() {
        assert!(plain_target("/a/b-c_d.e~f?x=1&y=%20"));
        assert!(!plain_target("http://host/a"));
        assert!(!plain_target("*"));
        assert!(!plain_target("/a#frag"));
        assert!(!plain_target("/a b"));
        assert!(!plain_target("/a\"quoted\""));
    }

    #[test]
    fn header_names_are_classified_whatever_their_case() {
        assert_eq!(classify("Host"), Hdr::Host);
        assert_eq!(classify("CONTENT-LENGTH"), Hdr::ContentLength);
        assert_eq!(classify(SANDBOX_ID_HEADER), Hdr::SandboxId);
        assert_eq!(classify(E2B_SANDBOX_ID_HEADER), Hdr::E2bSandboxId);
        assert_eq!(classify(TARGET_PORT_HEADER), Hdr::TargetPort);
        assert_eq!(classify(E2B_SANDBOX_PORT_HEADER), Hdr::E2bSandboxPort);
        assert_eq!(classify(API_KEY_HEADER), Hdr::ApiKey);
        assert_eq!(classify(NODE_ID_HEADER), Hdr::NodeId);
        assert_eq!(classify("X-Forwarded-Uri"), Hdr::XForwardedUri);
        assert_eq!(classify("x-forwarded-hosts"), Hdr::Other);
        assert_eq!(classify("content-lengtx"), Hdr::Other);
        assert!(hop_by_hop(classify("Keep-Alive")));
        assert!(!hop_by_hop(classify("trailer")));
        assert!(dropped_upstream(classify("trailer"), false));
        assert!(!dropped_upstream(classify(SANDBOX_ID_HEADER), false));
        assert!(dropped_upstream(classify(SANDBOX_ID_HEADER), true));
    }
    #[test]
    fn hop_by_hop_headers_are_the_hyper_paths() {
        for name in crate::forward::HOP_BY_HOP
            .iter()
            .chain([&http::header::UPGRADE])
        {
            let h = classify(name.as_str());
            if *name == http::header::TRAILER {
                // Kept on responses (for HTTP/1.1 trailers), dropped upstream.
                assert!(!hop_by_hop(h) && dropped_upstream(h, false));
            } else {
                assert!(hop_by_hop(h), "{name} is hop-by-hop in the hyper path");
            }
        }
    }

    #[test]
    fn http_dates_are_rfc_7231() {
        let d = http_date();
        let s = std::str::from_utf8(&d).unwrap();
        assert!(s.ends_with(" GMT"), "{s}");
        assert!(httpdate::parse_http_date(s).is_ok(), "{s}");
    }

    mod props {
        use proptest::prelude::*;

        use super::*;
        use crate::server::route::Router;
        use crate::server::{ClientLimits, GatewayOptions};

        fn router() -> Router {
            Router::new(&GatewayOptions {
                api_key: "k".repeat(32),
                request_timeout: std::time::Duration::from_secs(1),
                forward_response_size: 0,
                sandbox_proxy_domains: vec!["sb.example.com".into()],
                debug_mode: false,
                limits: ClientLimits::default(),
                console: Default::default(),
                route_cache_ttl: std::time::Duration::ZERO,
            })
            .unwrap()
        }

        fn peer() -> Peer {
            Peer {
                xff: http::HeaderValue::from_static("10.0.0.1"),
                tls: false,
            }
        }

        /// Request heads made of plausible pieces, so that parsing gets deep.
        fn head() -> impl Strategy<Value = Vec<u8>> {
            let method = prop_oneof![
                Just("GET"),
                Just("POST"),
                Just("DELETE"),
                Just("BREW"),
                Just("G\x01T")
            ];
            let path = prop_oneof![
                Just("/sandboxes/01936f8e-72f5-7000-8000-000000000001/pause".to_string()),
                Just("/proxy/x".to_string()),
                Just("/%zz".to_string()),
                "/[a-z0-9%./]{0,30}".prop_map(|s| s),
            ];
            let header = prop_oneof![
                Just("content-length: 5".to_string()),
                Just("content-length: +5".to_string()),
                Just("content-length: 99999999999999999999999".to_string()),
                Just("transfer-encoding: chunked".to_string()),
                Just("host: 49983-01936f8e-72f5-7000-8000-000000000001.sb.example.com".to_string()),
                Just("e2b-sandbox-id: 01936f8e-72f5-7000-8000-000000000001".to_string()),
                Just("e2b-sandbox-port: 49983".to_string()),
                Just("x-api-key: kkk".to_string()),
                Just("connection: close, x-a".to_string()),
                "[a-z-]{1,12}: [ -~]{0,20}".prop_map(|s| s),
            ];
            (
                method,
                path,
                proptest::collection::vec(header, 0..8),
                any::<bool>(),
            )
                .prop_map(|(m, p, hs, complete)| {
                    let mut h = format!("{m} {p} HTTP/1.1\r\n");
                    for x in hs {
                        h.push_str(&x);
                        h.push_str("\r\n");
                    }
                    if complete {
                        h.push_str("\r\n");
                    }
                    h.into_bytes()
                })
        }

        proptest! {
            #[test]
            fn head_analysis_never_panics_on_any_bytes(buf in proptest::collection::vec(any::<u8>(), 0..512)) {
                let mut out = Vec::new();
                let _ = analyze(&router(), &buf, &mut out, &peer());
            }

            #[test]
            fn head_analysis_never_panics_on_plausible_heads(buf in head()) {
                let mut out = Vec::new();
                let _ = analyze(&router(), &buf, &mut out, &peer());
            }

            #[test]
            fn content_length_reads_every_decimal_and_nothing_else(n: u64, junk in "[^0-9 \t]{1,3}") {
                prop_assert_eq!(content_length(n.to_string().as_bytes()), Some(n));
                let bad = format!("{n}{junk}");
                prop_assert_eq!(content_length(bad.as_bytes()), None);
            }
        }
    }
}
