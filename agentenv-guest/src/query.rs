//! URL query values: the agent decodes `/files` parameters (`path`,
//! `username`, signatures), the client encodes them.

/// Decodes `%XX` and `+` in a query component.
fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < b.len() => {
                let hex = std::str::from_utf8(&b[i + 1..i + 3]).ok();
                match hex.and_then(|h| u8::from_str_radix(h, 16).ok()) {
                    Some(v) => {
                        out.push(v);
                        i += 2;
                    }
                    None => out.push(b'%'),
                }
            }
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// One query parameter, percent-decoded.
pub fn query_param(query: Option<&str>, key: &str) -> Option<String> {
    query?.split('&').find_map(|kv| {
        let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
        (percent_decode(k) == key).then(|| percent_decode(v))
    })
}

/// Percent-encodes a query value (`/` and the unreserved characters kept).
pub fn encode_query(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.~/".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_params_are_percent_decoded() {
        let q = Some("path=%2Ftmp%2Fa%20b.txt&username=user&x=1+2");
        assert_eq!(query_param(q, "path").as_deref(), Some("/tmp/a b.txt"));
        assert_eq!(query_param(q, "username").as_deref(), Some("user"));
        assert_eq!(query_param(q, "x").as_deref(), Some("1 2"));
        assert_eq!(query_param(q, "missing"), None);
        assert_eq!(percent_decode("%zz%4"), "%zz%4");
    }

    #[test]
    fn encoded_values_decode_to_themselves() {
        let raw = "/tmp/a b+c&d=é%.txt";
        let enc = encode_query(raw);
        assert_eq!(enc, "/tmp/a%20b%2Bc%26d%3D%C3%A9%25.txt");
        assert_eq!(
            query_param(Some(&format!("path={enc}")), "path").as_deref(),
            Some(raw)
        );
    }
}
