//! Who may call: the access token (`X-Access-Token`, compared in constant
//! time), signed `/files` URLs, and the user named by Basic authorization.

use base64::Engine as _;
use http::{HeaderMap, Method, header};
use subtle::ConstantTimeEq;

use crate::connect::{Code, ConnectError};
use crate::query::query_param;

/// Whether `X-Access-Token` matches `expected` (anything passes without a
/// token).
pub(super) fn token_ok(expected: Option<&str>, headers: &HeaderMap) -> bool {
    let Some(expected) = expected else {
        return true;
    };
    let Some(got) = headers.get("x-access-token") else {
        return false;
    };
    bool::from(got.as_bytes().ct_eq(expected.as_bytes()))
}

/// Checks a signed `/files` URL: `signature=v1_<b64(sha256(
/// "<path>:<read|write>:<username>:<token>[:<expiration>]"))>` and an
/// optional `signature_expiration` (Unix seconds) not in the past.
pub(super) fn signed_url_ok(token: Option<&str>, method: &Method, query: Option<&str>) -> bool {
    use sha2::Digest;
    let Some(token) = token else {
        return true;
    };
    let param = |k: &str| query_param(query, k);
    let Some(sig) = param("signature") else {
        return false;
    };
    let op = if method == Method::GET {
        "read"
    } else {
        "write"
    };
    let path = param("path").unwrap_or_default();
    let user = param("username").unwrap_or_default();
    let mut raw = format!("{path}:{op}:{user}:{token}");
    if let Some(exp) = param("signature_expiration") {
        let Ok(exp) = exp.parse::<u64>() else {
            return false;
        };
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(u64::MAX);
        if exp < now {
            return false;
        }
        raw.push_str(&format!(":{exp}"));
    }
    let digest = sha2::Sha256::digest(raw.as_bytes());
    let want = format!(
        "v1_{}",
        base64::engine::general_purpose::STANDARD_NO_PAD.encode(digest)
    );
    bool::from(sig.as_bytes().ct_eq(want.as_bytes()))
}

/// The user named by a Basic `Authorization` header, if any.
pub(super) fn basic_auth_user(headers: &HeaderMap) -> Result<Option<String>, ConnectError> {
    let Some(v) = headers.get(header::AUTHORIZATION) else {
        return Ok(None);
    };
    let bad = || {
        ConnectError::new(
            Code::Unauthenticated,
            "Authorization must be `Basic base64(\"<user>:\")`",
        )
    };
    let s = v.to_str().map_err(|_| bad())?;
    let Some(b64) = s
        .strip_prefix("Basic ")
        .or_else(|| s.strip_prefix("basic "))
    else {
        return Err(bad());
    };
    let raw = base64::engine::general_purpose::STANDARD
        .decode(b64.trim())
        .map_err(|_| bad())?;
    let text = String::from_utf8(raw).map_err(|_| bad())?;
    let user = text.split(':').next().unwrap_or("").to_string();
    Ok(if user.is_empty() { None } else { Some(user) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    #[test]
    fn basic_auth_user_parsing() {
        let mut h = HeaderMap::new();
        assert_eq!(basic_auth_user(&h).unwrap(), None);
        h.insert(
            header::AUTHORIZATION,
            HeaderValue::from_static("Basic dXNlcjo="),
        );
        assert_eq!(basic_auth_user(&h).unwrap().as_deref(), Some("user"));
        h.insert(header::AUTHORIZATION, HeaderValue::from_static("Bearer x"));
        assert!(basic_auth_user(&h).is_err());
    }

    #[test]
    fn tokens_are_required_only_once_set() {
        let mut h = HeaderMap::new();
        assert!(token_ok(None, &h));
        assert!(!token_ok(Some("t"), &h));
        h.insert("x-access-token", HeaderValue::from_static("t"));
        assert!(token_ok(Some("t"), &h));
        assert!(!token_ok(Some("u"), &h));
        assert!(signed_url_ok(None, &Method::GET, None));
        assert!(!signed_url_ok(Some("t"), &Method::GET, Some("path=/a")));
    }
}
