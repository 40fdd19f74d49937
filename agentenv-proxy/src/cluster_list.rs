//! `GET /sandboxes` and `GET /v2/sandboxes` across the cluster: ask every
//! node, merge newest first, deduplicate, and page with `x-next-token`.

use std::collections::BTreeMap;

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;

/// The sandbox id used as the cursor when no `nextToken` is given.
pub const MAX_CURSOR_ID: &str = "ffffffff-ffff-ffff-ffff-ffffffffffff";

/// Bad pagination parameters (answered with 400).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PageError {
    #[error("invalid limit: {0:?} is not an integer")]
    Limit(String),
    #[error("invalid next token: {0}")]
    Token(String),
}

/// A timestamp that reads RFC 3339 and writes Go's RFC3339Nano form
/// (fraction without trailing zeros, `Z` for UTC, the original offset
/// otherwise). Missing means Go's zero time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timestamp(pub OffsetDateTime);

impl Default for Timestamp {
    fn default() -> Self {
        let date = time::Date::from_calendar_date(1, time::Month::January, 1).expect("valid date");
        Self(date.midnight().assume_utc())
    }
}

impl Timestamp {
    pub fn parse(s: &str) -> Result<Self, time::error::Parse> {
        OffsetDateTime::parse(s, &Rfc3339).map(Self)
    }

    /// Go's `time.RFC3339Nano` layout.
    pub fn format(&self) -> String {
        let t = self.0;
        let mut out = format!(
            "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}",
            t.year(),
            u8::from(t.month()),
            t.day(),
            t.hour(),
            t.minute(),
            t.second()
        );
        let nanos = t.nanosecond();
        if nanos > 0 {
            let frac = format!("{nanos:09}");
            out.push('.');
            out.push_str(frac.trim_end_matches('0'));
        }
        let off = t.offset();
        if off.is_utc() {
            out.push('Z');
        } else {
            let secs = off.whole_seconds();
            let sign = if secs < 0 { '-' } else { '+' };
            let secs = secs.unsigned_abs();
            out.push_str(&format!(
                "{sign}{:02}:{:02}",
                secs / 3600,
                (secs % 3600) / 60
            ));
        }
        out
    }

    fn utc(&self) -> Self {
        Self(self.0.to_offset(time::UtcOffset::UTC))
    }
}

impl Serialize for Timestamp {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.format())
    }
}

impl<'de> Deserialize<'de> for Timestamp {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        match Option::<String>::deserialize(d)? {
            None => Ok(Self::default()),
            Some(s) => Self::parse(&s).map_err(serde::de::Error::custom),
        }
    }
}

/// One sandbox of a node's list, with exactly the fields the gateway relays.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ListedSandbox {
    #[serde(rename = "templateID", default)]
    pub template_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub alias: Option<String>,
    #[serde(rename = "sandboxID", default)]
    pub sandbox_id: String,
    #[serde(rename = "clientID", default)]
    pub client_id: String,
    #[serde(rename = "startedAt", default)]
    pub started_at: Timestamp,
    #[serde(rename = "endAt", default)]
    pub end_at: Timestamp,
    #[serde(rename = "cpuCount", default)]
    pub cpu_count: u32,
    #[serde(rename = "memoryMB", default)]
    pub memory_mb: u32,
    #[serde(rename = "diskSizeMB", default)]
    pub disk_size_mb: u32,
    #[serde(
        default,
        skip_serializing_if = "BTreeMap::is_empty",
        deserialize_with = "null_as_empty"
    )]
    pub metadata: BTreeMap<String, String>,
    #[serde(default)]
    pub state: String,
    #[serde(rename = "envdVersion", default)]
    pub envd_version: String,
}

fn null_as_empty<'de, D: Deserializer<'de>>(d: D) -> Result<BTreeMap<String, String>, D::Error> {
    Ok(Option::deserialize(d)?.unwrap_or_default())
}

/// Sorts newest first (then by id) and keeps the first, newest, entry of
/// each sandbox id.
pub fn merge(mut items: Vec<ListedSandbox>) -> Vec<ListedSandbox> {
    items.sort_by(|a, b| {
        b.started_at
            .0
            .cmp(&a.started_at.0)
            .then_with(|| a.sandbox_id.cmp(&b.sandbox_id))
    });
    let mut seen = std::collections::HashSet::new();
    items.retain(|i| seen.insert(i.sandbox_id.clone()));
    items
}

/// Parses `limit`: absent or empty means unlimited.
pub fn parse_limit(query: &[(String, String)]) -> Result<Option<i64>, PageError> {
    match query
        .iter()
        .find(|(k, _)| k == "limit")
        .map(|(_, v)| v.as_str())
    {
        None | Some("") => Ok(None),
        Some(v) => v
            .parse()
            .map(Some)
            .map_err(|_| PageError::Limit(v.to_string())),
    }
}

fn is_uuid_shaped(id: &str) -> bool {
    id.len() == 36
        && id.bytes().enumerate().all(|(i, b)| match i {
            8 | 13 | 18 | 23 => b == b'-',
            _ => b.is_ascii_hexdigit(),
        })
}

/// Decodes a `nextToken` into its cursor; no token means "from now".
pub fn parse_token(
    token: Option<&str>,
    now: OffsetDateTime,
) -> Result<(Timestamp, String), PageError> {
    let token = match token {
        None | Some("") => return Ok((Timestamp(now), MAX_CURSOR_ID.to_string())),
        Some(t) => t,
    };
    let decoded = URL_SAFE
        .decode(token)
        .map_err(|e| PageError::Token(format!("error decoding cursor: {e}")))?;
    let decoded =
        String::from_utf8(decoded).map_err(|_| PageError::Token("invalid cursor format".into()))?;
    let (ts, id) = decoded
        .split_once("__")
        .ok_or_else(|| PageError::Token("invalid cursor format".into()))?;
    let ts = Timestamp::parse(ts)
        .map_err(|e| PageError::Token(format!("invalid timestamp format in cursor: {e}")))?;
    if !is_uuid_shaped(id) {
        return Err(PageError::Token(format!(
            "invalid sandbox id in cursor: {id}"
        )));
    }
    Ok((ts, id.to_string()))
}

/// The token that continues after `last`.
pub fn make_token(last: &ListedSandbox) -> String {
    URL_SAFE.encode(format!(
        "{}__{}",
        last.started_at.utc().format(),
        last.sandbox_id
    ))
}

/// One page of the merged list, and the token for the next page when the
/// page is full.
pub fn paginate(
    items: Vec<ListedSandbox>,
    cursor: (Timestamp, String),
    limit: Option<i64>,
) -> (Vec<ListedSandbox>, Option<String>) {
    let (ct, cid) = cursor;
    let mut page: Vec<ListedSandbox> = items
        .into_iter()
        .filter(|i| i.started_at.0 < ct.0 || (i.started_at.0 == ct.0 && i.sandbox_id > cid))
        .collect();
    match limit {
        None => (page, None),
        Some(l) if l <= 0 => (Vec::new(), None),
        Some(l) => {
            let l = usize::try_from(l).unwrap_or(usize::MAX);
            page.truncate(l);
            let token = (page.len() == l).then(|| make_token(page.last().expect("page is full")));
            (page, token)
        }
    }
}

/// Parses a raw query like Go's `url.ParseQuery` (`+` is a space); pairs
/// that do not decode are skipped.
pub fn parse_query(raw: &str) -> Vec<(String, String)> {
    raw.split('&')
        .filter(|p| !p.is_empty())
        .filter_map(|pair| {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            Some((unescape(k)?, unescape(v)?))
        })
        .collect()
}

fn unescape(s: &str) -> Option<String> {
    let s = s.replace('+', " ");
    percent_encoding::percent_decode_str(&s)
        .decode_utf8()
        .ok()
        .map(|c| c.into_owned())
}

/// Go's `url.QueryEscape`.
pub fn query_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for &b in s.as_bytes() {
        match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                out.push(b as char)
            }
            b' ' => out.push('+'),
            _ => out.push_str(&format!("%{b:02X}")),
        }
    }
    out
}

/// The query sent to nodes for `/v2/sandboxes`: `limit` and `nextToken`
/// removed, the rest re-encoded with keys sorted.
pub fn v2_upstream_query(pairs: &[(String, String)]) -> String {
    let mut kept: Vec<&(String, String)> = pairs
        .iter()
        .filter(|(k, _)| k != "limit" && k != "nextToken")
        .collect();
    kept.sort_by(|a, b| a.0.cmp(&b.0));
    kept.iter()
        .map(|(k, v)| format!("{}={}", query_escape(k), query_escape(v)))
        .collect::<Vec<_>>()
        .join("&")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn item(id: &str, started: &str) -> ListedSandbox {
        serde_json::from_value(
            serde_json::json!({"sandboxID": id, "startedAt": started, "templateID": "base"}),
        )
        .unwrap()
    }

    #[test]
    fn timestamps_keep_offsets_and_trim_fraction_zeros() {
        for s in [
            "2026-01-01T00:00:02Z",
            "2026-01-01T00:00:02.5Z",
            "2026-01-01T00:00:02.123456789+02:00",
            "2026-01-01T00:00:02-07:30",
        ] {
            assert_eq!(Timestamp::parse(s).unwrap().format(), s);
        }
        assert_eq!(
            Timestamp::parse("2026-01-01T00:00:02.500000Z")
                .unwrap()
                .format(),
            "2026-01-01T00:00:02.5Z"
        );
        assert_eq!(Timestamp::default().format(), "0001-01-01T00:00:00Z");
    }

    #[test]
    fn unknown_fields_are_dropped_and_empty_optionals_omitted() {
        let v: ListedSandbox = serde_json::from_str(
            r#"{"templateID":"t","sandboxID":"s","clientID":"c","startedAt":"2026-01-01T00:00:00Z","endAt":"2026-01-01T01:00:00Z","cpuCount":2,"memoryMB":512,"diskSizeMB":1024,"metadata":null,"state":"running","envdVersion":"0.2","extra":1}"#,
        )
        .unwrap();
        assert_eq!(
            serde_json::to_string(&v).unwrap(),
            r#"{"templateID":"t","sandboxID":"s","clientID":"c","startedAt":"2026-01-01T00:00:00Z","endAt":"2026-01-01T01:00:00Z","cpuCount":2,"memoryMB":512,"diskSizeMB":1024,"state":"running","envdVersion":"0.2"}"#
        );
    }

    #[test]
    fn merge_orders_newest_first_then_by_id_and_keeps_the_newest_duplicate() {
        let merged = merge(vec![
            item("b", "2026-01-01T00:00:01Z"),
            item("dup", "2026-01-01T00:00:00Z"),
            item("a", "2026-01-01T00:00:01Z"),
            item("dup", "2026-01-01T00:00:03Z"),
        ]);
        let ids: Vec<_> = merged
            .iter()
            .map(|i| (i.sandbox_id.as_str(), i.started_at.format()))
            .collect();
        assert_eq!(
            ids,
            [
                ("dup", "2026-01-01T00:00:03Z".to_string()),
                ("a", "2026-01-01T00:00:01Z".to_string()),
                ("b", "2026-01-01T00:00:01Z".to_string()),
            ]
        );
    }

    #[test]
    fn pages_follow_the_token_and_the_last_page_has_none() {
        let ids = [
            "00000000-0000-0000-0000-000000000001",
            "00000000-0000-0000-0000-000000000002",
            "00000000-0000-0000-0000-000000000003",
        ];
        let items = merge(vec![
            item(ids[0], "2026-01-01T00:00:03Z"),
            item(ids[1], "2026-01-01T00:00:02Z"),
            item(ids[2], "2026-01-01T00:00:02Z"),
        ]);
        let now = OffsetDateTime::now_utc();
        let (page, token) = paginate(items.clone(), parse_token(None, now).unwrap(), Some(2));
        assert_eq!(
            page.iter()
                .map(|i| i.sandbox_id.as_str())
                .collect::<Vec<_>>(),
            [ids[0], ids[1]]
        );
        let token = token.unwrap();
        let (page, next) = paginate(
            items.clone(),
            parse_token(Some(&token), now).unwrap(),
            Some(2),
        );
        assert_eq!(
            page.iter()
                .map(|i| i.sandbox_id.as_str())
                .collect::<Vec<_>>(),
            [ids[2]]
        );
        assert_eq!(next, None);
        let (page, next) = paginate(items, parse_token(None, now).unwrap(), Some(0));
        assert!(page.is_empty() && next.is_none());
    }

    #[test]
    fn bad_tokens_and_limits_are_reported() {
        let now = OffsetDateTime::now_utc();
        assert!(
            parse_token(Some("!!!"), now)
                .unwrap_err()
                .to_string()
                .starts_with("invalid next token: error decoding cursor")
        );
        let no_sep = URL_SAFE.encode("2026-01-01T00:00:00Z");
        assert_eq!(
            parse_token(Some(&no_sep), now).unwrap_err().to_string(),
            "invalid next token: invalid cursor format"
        );
        let bad_id = URL_SAFE.encode("2026-01-01T00:00:00Z__sbx");
        assert_eq!(
            parse_token(Some(&bad_id), now).unwrap_err().to_string(),
            "invalid next token: invalid sandbox id in cursor: sbx"
        );
        let q = parse_query("limit=abc");
        assert_eq!(
            parse_limit(&q).unwrap_err().to_string(),
            "invalid limit: \"abc\" is not an integer"
        );
        assert_eq!(parse_limit(&parse_query("limit=")).unwrap(), None);
        assert_eq!(parse_limit(&parse_query("limit=3")).unwrap(), Some(3));
    }

    #[test]
    fn v2_queries_drop_paging_keys_and_sort_the_rest() {
        let q = parse_query("state=running&limit=2&metadata=team%3Dalpha&nextToken=abc&a=x+y");
        assert_eq!(
            v2_upstream_query(&q),
            "a=x+y&metadata=team%3Dalpha&state=running"
        );
    }
}
