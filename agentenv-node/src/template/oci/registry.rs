//! A client of the registry HTTP API v2 (the OCI distribution spec), read side only:
//! manifests and blobs, with anonymous, basic and bearer-token authentication and
//! redirects for blobs.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use base64::Engine;
use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode, Uri, header};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use parking_lot::Mutex;
use percent_encoding::{NON_ALPHANUMERIC, utf8_percent_encode};
use sha2::{Digest, Sha256};
use tokio::io::AsyncWriteExt;

use super::{OciError, RegistryAuth};

/// Most redirects followed for one request.
const MAX_REDIRECTS: usize = 5;
/// Largest token response read.
const MAX_TOKEN_BYTES: u64 = 1 << 20;
/// Largest error body kept for a message.
const MAX_ERROR_BYTES: u64 = 4096;

/// One registry, as the pull talks to it.
pub(crate) struct Registry {
    client: Client<HttpsConnector<HttpConnector>, Empty<Bytes>>,
    /// The registry's name, for messages.
    pub(crate) name: String,
    /// `scheme://host[:port]` of its API.
    base: String,
    auth: Option<RegistryAuth>,
    bearer: Mutex<Option<String>>,
    basic: AtomicBool,
    timeout: Duration,
}

/// A TLS configuration trusting the system's CAs and those of `extra_ca`.
pub(crate) fn tls_config(
    extra_ca: Option<&std::path::Path>,
) -> Result<Arc<rustls::ClientConfig>, OciError> {
    let mut roots = rustls::RootCertStore::empty();
    let found = rustls_native_certs::load_native_certs();
    roots.add_parsable_certificates(found.certs);
    if let Some(ca) = extra_ca {
        let certs = agentenv_core::tls::read_certs(ca).map_err(|e| OciError::Tls {
            reason: format!("the extra CA file {}: {e}", ca.display()),
        })?;
        for c in certs {
            roots.add(c).map_err(|e| OciError::Tls {
                reason: format!("a certificate of {}: {e}", ca.display()),
            })?;
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let cfg = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| OciError::Tls {
            reason: e.to_string(),
        })?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(Arc::new(cfg))
}

/// `WWW-Authenticate` challenge: its scheme and parameters.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Challenge {
    pub scheme: String,
    pub params: Vec<(String, String)>,
}

impl Challenge {
    fn param(&self, key: &str) -> Option<&str> {
        self.params
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(key))
            .map(|(_, v)| v.as_str())
    }
}

/// Parses `Bearer realm="…",service="…",scope="a,b"` (quoted values may hold commas).
pub(crate) fn parse_challenge(h: &str) -> Option<Challenge> {
    let h = h.trim();
    let (scheme, rest) = match h.split_once(' ') {
        Some((s, r)) => (s, r),
        None => (h, ""),
    };
    if scheme.is_empty() {
        return None;
    }
    let mut params = Vec::new();
    let mut chars = rest.chars().peekable();
    loop {
        while chars.peek().is_some_and(|c| *c == ',' || c.is_whitespace()) {
            chars.next();
        }
        let key: String =
            std::iter::from_fn(|| chars.next_if(|c| *c != '=' && *c != ',')).collect();
        if key.is_empty() {
            break;
        }
        if chars.next() != Some('=') {
            break;
        }
        let mut value = String::new();
        if chars.peek() == Some(&'"') {
            chars.next();
            while let Some(c) = chars.next() {
                match c {
                    '\\' => value.extend(chars.next()),
                    '"' => break,
                    c => value.push(c),
                }
            }
        } else {
            value = std::iter::from_fn(|| chars.next_if(|c| *c != ',')).collect();
        }
        params.push((key.trim().to_string(), value.trim().to_string()));
    }
    Some(Challenge {
        scheme: scheme.to_string(),
        params,
    })
}

fn same_origin(a: &Uri, b: &Uri) -> bool {
    a.scheme() == b.scheme() && a.authority() == b.authority()
}

impl Registry {
    pub(crate) fn new(
        name: &str,
        base: String,
        auth: Option<RegistryAuth>,
        tls: Arc<rustls::ClientConfig>,
        timeout: Duration,
    ) -> Self {
        let mut http = HttpConnector::new();
        http.enforce_http(false);
        http.set_nodelay(true);
        http.set_connect_timeout(Some(timeout));
        let https = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config((*tls).clone())
            .https_or_http()
            .enable_http1()
            .wrap_connector(http);
        let client = Client::builder(TokioExecutor::new()).build(https);
        Self {
            client,
            name: name.to_string(),
            base,
            auth,
            bearer: Mutex::new(None),
            basic: AtomicBool::new(false),
            timeout,
        }
    }

    fn unreachable(&self, url: &str, reason: impl std::fmt::Display) -> OciError {
        OciError::Unreachable {
            registry: self.name.clone(),
            url: url.to_string(),
            reason: reason.to_string(),
        }
    }

    fn basic_header(&self) -> Option<String> {
        self.auth.as_ref().map(|a| {
            let raw = format!("{}:{}", a.username, a.password);
            format!(
                "Basic {}",
                base64::engine::general_purpose::STANDARD.encode(raw)
            )
        })
    }

    async fn send(
        &self,
        url: &str,
        accept: Option<&str>,
        authorization: Option<String>,
        what: &str,
    ) -> Result<Response<Incoming>, OciError> {
        let mut req = Request::get(url).header(header::USER_AGENT, "agentenv-node");
        if let Some(a) = accept {
            req = req.header(header::ACCEPT, a);
        }
        if let Some(a) = authorization {
            req = req.header(header::AUTHORIZATION, a);
        }
        let req = req
            .body(Empty::new())
            .map_err(|e| self.unreachable(url, format!("a bad request URL ({e})")))?;
        match tokio::time::timeout(self.timeout, self.client.request(req)).await {
            Err(_) => Err(OciError::Timeout {
                registry: self.name.clone(),
                what: what.to_string(),
                timeout: self.timeout,
            }),
            Ok(Err(e)) => {
                use std::error::Error;
                let mut reason = e.to_string();
                let mut src = e.source();
                while let Some(s) = src {
                    reason = format!("{reason}: {s}");
                    src = s.source();
                }
                Err(self.unreachable(url, reason))
            }
            Ok(Ok(r)) => Ok(r),
        }
    }

    /// GETs `path` (beneath the API's base), authenticating as the registry asks
    /// (`scope` is the token scope), following redirects when `follow`.
    pub(crate) async fn get(
        &self,
        path: &str,
        accept: Option<&str>,
        scope: &str,
        follow: bool,
        what: &str,
    ) -> Result<Response<Incoming>, OciError> {
        let base: Uri = self
            .base
            .parse()
            .map_err(|e| self.unreachable(&self.base, format!("not a URL ({e})")))?;
        let mut url = format!("{}{path}", self.base);
        let mut to_registry = true;
        let mut authenticated = false;
        let mut hops = 0;
        loop {
            let authorization = if to_registry {
                match self.bearer.lock().clone() {
                    Some(t) => Some(format!("Bearer {t}")),
                    None if self.basic.load(Ordering::Relaxed) => self.basic_header(),
                    None => None,
                }
            } else {
                // Storage a registry redirects to gets no registry credentials.
                None
            };
            let resp = self.send(&url, accept, authorization, what).await?;
            let status = resp.status();
            if status == StatusCode::UNAUTHORIZED && to_registry && !authenticated {
                authenticated = true;
                let challenge = resp
                    .headers()
                    .get(header::WWW_AUTHENTICATE)
                    .and_then(|v| v.to_str().ok())
                    .and_then(parse_challenge);
                if self.authenticate(challenge, scope).await? {
                    continue;
                }
                return Ok(resp);
            }
            if follow && status.is_redirection() {
                hops += 1;
                if hops > MAX_REDIRECTS {
                    return Err(OciError::Registry {
                        registry: self.name.clone(),
                        what: what.to_string(),
                        status: status.as_u16(),
                        message: format!("more than {MAX_REDIRECTS} redirects"),
                    });
                }
                let location = resp
                    .headers()
                    .get(header::LOCATION)
                    .and_then(|v| v.to_str().ok())
                    .ok_or_else(|| OciError::Registry {
                        registry: self.name.clone(),
                        what: what.to_string(),
                        status: status.as_u16(),
                        message: "a redirect without a Location".into(),
                    })?;
                let current: Uri = url
                    .parse()
                    .map_err(|e| self.unreachable(&url, format!("not a URL ({e})")))?;
                url = if location.starts_with("http://") || location.starts_with("https://") {
                    location.to_string()
                } else if location.starts_with('/') {
                    format!(
                        "{}://{}{location}",
                        current.scheme_str().unwrap_or("https"),
                        current.authority().map(|a| a.as_str()).unwrap_or("")
                    )
                } else {
                    return Err(OciError::Registry {
                        registry: self.name.clone(),
                        what: what.to_string(),
                        status: status.as_u16(),
                        message: format!("a redirect to {location:?}, not a URL"),
                    });
                };
                let next: Uri = url
                    .parse()
                    .map_err(|e| self.unreachable(&url, format!("not a URL ({e})")))?;
                to_registry = same_origin(&next, &base);
                continue;
            }
            return Ok(resp);
        }
    }

    /// Answers a 401 challenge: `Ok(true)` when the request is worth retrying.
    async fn authenticate(
        &self,
        challenge: Option<Challenge>,
        scope: &str,
    ) -> Result<bool, OciError> {
        let Some(ch) = challenge else {
            return Ok(false);
        };
        if ch.scheme.eq_ignore_ascii_case("basic") {
            if self.auth.is_none() || self.basic.swap(true, Ordering::Relaxed) {
                return Ok(false);
            }
            return Ok(true);
        }
        if !ch.scheme.eq_ignore_ascii_case("bearer") {
            return Ok(false);
        }
        let realm = ch.param("realm").ok_or_else(|| OciError::Auth {
            registry: self.name.clone(),
            reason: "its Bearer challenge names no realm".into(),
        })?;
        if !(realm.starts_with("https://") || realm.starts_with("http://")) {
            return Err(OciError::Auth {
                registry: self.name.clone(),
                reason: format!("its token realm {realm:?} is not an http(s) URL"),
            });
        }
        let mut url = realm.to_string();
        let mut sep = if url.contains('?') { '&' } else { '?' };
        if let Some(service) = ch.param("service") {
            url.push_str(&format!(
                "{sep}service={}",
                utf8_percent_encode(service, NON_ALPHANUMERIC)
            ));
            sep = '&';
        }
        let scope = ch.param("scope").unwrap_or(scope);
        url.push_str(&format!(
            "{sep}scope={}",
            utf8_percent_encode(scope, NON_ALPHANUMERIC)
        ));
        let resp = self
            .send(&url, None, self.basic_header(), "an access token")
            .await?;
        let status = resp.status();
        if !status.is_success() {
            return Err(OciError::Auth {
                registry: self.name.clone(),
                reason: format!(
                    "its token service answered HTTP {} for scope {scope:?}: {}",
                    status.as_u16(),
                    if self.auth.is_some() {
                        "check the username and password"
                    } else {
                        "the repository may need credentials (RegistryAuth)"
                    }
                ),
            });
        }
        let body = self
            .read_bounded(resp, MAX_TOKEN_BYTES, "an access token")
            .await?;
        #[derive(serde::Deserialize)]
        struct Token {
            token: Option<String>,
            access_token: Option<String>,
        }
        let t: Token = serde_json::from_slice(&body).map_err(|e| OciError::Auth {
            registry: self.name.clone(),
            reason: format!("its token service sent no token ({e})"),
        })?;
        let token = t
            .token
            .or(t.access_token)
            .filter(|t| !t.is_empty())
            .ok_or_else(|| OciError::Auth {
                registry: self.name.clone(),
                reason: "its token service sent no token".into(),
            })?;
        *self.bearer.lock() = Some(token);
        Ok(true)
    }

    /// The error for an unsuccessful response about `what`.
    pub(crate) async fn status_error(&self, resp: Response<Incoming>, what: &str) -> OciError {
        let status = resp.status();
        let message = self
            .read_bounded(resp, MAX_ERROR_BYTES, what)
            .await
            .map(|b| String::from_utf8_lossy(&b).trim().to_string())
            .unwrap_or_default();
        match status {
            StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN => OciError::Auth {
                registry: self.name.clone(),
                reason: format!(
                    "it refused access to {what} (HTTP {}): {}",
                    status.as_u16(),
                    if self.auth.is_some() {
                        "check the username and password, and that the account may pull this repository"
                    } else {
                        "it needs credentials (RegistryAuth)"
                    }
                ),
            },
            StatusCode::NOT_FOUND => OciError::NotFound {
                registry: self.name.clone(),
                what: what.to_string(),
            },
            s => OciError::Registry {
                registry: self.name.clone(),
                what: what.to_string(),
                status: s.as_u16(),
                message,
            },
        }
    }

    /// Reads a whole body of at most `limit` bytes, each read within the timeout.
    pub(crate) async fn read_bounded(
        &self,
        resp: Response<Incoming>,
        limit: u64,
        what: &str,
    ) -> Result<Vec<u8>, OciError> {
        let declared = resp
            .headers()
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        if let Some(n) = declared.filter(|n| *n > limit) {
            return Err(OciError::TooLarge {
                what: what.to_string(),
                size: n,
                limit,
            });
        }
        let mut body = resp.into_body();
        let mut out = Vec::new();
        while let Some(frame) = self.next_frame(&mut body, what).await? {
            if out.len() as u64 + frame.len() as u64 > limit {
                return Err(OciError::TooLarge {
                    what: what.to_string(),
                    size: out.len() as u64 + frame.len() as u64,
                    limit,
                });
            }
            out.extend_from_slice(&frame);
        }
        Ok(out)
    }

    async fn next_frame(&self, body: &mut Incoming, what: &str) -> Result<Option<Bytes>, OciError> {
        loop {
            let frame = tokio::time::timeout(self.timeout, body.frame())
                .await
                .map_err(|_| OciError::Timeout {
                    registry: self.name.clone(),
                    what: what.to_string(),
                    timeout: self.timeout,
                })?;
            match frame {
                None => return Ok(None),
                Some(Err(e)) => {
                    return Err(OciError::Transfer {
                        registry: self.name.clone(),
                        what: what.to_string(),
                        reason: e.to_string(),
                    });
                }
                Some(Ok(f)) => {
                    if let Ok(data) = f.into_data() {
                        return Ok(Some(data));
                    }
                }
            }
        }
    }

    /// Streams the blob `digest` (`size` bytes) of `repository` into `out`, checking
    /// its size as it comes and its digest at the end.
    pub(crate) async fn fetch_blob(
        &self,
        repository: &str,
        digest: &str,
        size: u64,
        out: &mut tokio::fs::File,
        what: &str,
    ) -> Result<(), OciError> {
        let scope = format!("repository:{repository}:pull");
        let resp = self
            .get(
                &format!("/v2/{repository}/blobs/{digest}"),
                None,
                &scope,
                true,
                what,
            )
            .await?;
        if !resp.status().is_success() {
            return Err(self.status_error(resp, what).await);
        }
        let mut body = resp.into_body();
        let mut hasher = Sha256::new();
        let mut got = 0u64;
        while let Some(frame) = self.next_frame(&mut body, what).await? {
            got += frame.len() as u64;
            if got > size {
                return Err(OciError::SizeMismatch {
                    what: what.to_string(),
                    expected: size,
                    actual: format!("more than {size}"),
                });
            }
            hasher.update(&frame);
            out.write_all(&frame).await.map_err(|e| OciError::Cache {
                path: what.into(),
                source: e,
            })?;
        }
        if got != size {
            return Err(OciError::SizeMismatch {
                what: what.to_string(),
                expected: size,
                actual: got.to_string(),
            });
        }
        let actual = format!("sha256:{}", hex::encode(hasher.finalize()));
        if actual != digest {
            return Err(OciError::DigestMismatch {
                what: what.to_string(),
                expected: digest.to_string(),
                actual,
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn oci_bearer_challenges_are_parsed() {
        let c = parse_challenge(
            r#"Bearer realm="https://auth.example/token",service="reg.example",scope="repository:a/b:pull,push""#,
        )
        .unwrap();
        assert_eq!(c.scheme, "Bearer");
        assert_eq!(c.param("realm"), Some("https://auth.example/token"));
        assert_eq!(c.param("service"), Some("reg.example"));
        assert_eq!(c.param("scope"), Some("repository:a/b:pull,push"));
        let c = parse_challenge(r#"Basic realm="Registry Realm""#).unwrap();
        assert_eq!(c.scheme, "Basic");
        assert_eq!(c.param("realm"), Some("Registry Realm"));
        let c = parse_challenge("Bearer realm=https://a.example/t, service=x").unwrap();
        assert_eq!(c.param("service"), Some("x"));
        assert!(parse_challenge("").is_none());
    }
}
