//! `GET /sandboxes` and `GET /v2/sandboxes` across the cluster: what each
//! node is asked, how its pages are followed, and how the answers are merged
//! (by start time, newest first unless `order=asc` asks for oldest first,
//! then by id, deduplicated) into the page a client gets.
//!
//! A v2 page is a window of the merged list after one cursor, the
//! (`startedAt`, `sandboxID`) of the last item of the previous page, in the
//! list's [`Order`] (the client sends the same `order` with every page, as
//! it does to a single node: the token does not carry it). Every
//! node is asked for its items after that cursor, `limit` of them at most
//! (in node pages of at most [`NODE_PAGE_LIMIT`], following the node's
//! `x-next-token`); the merged window holds the first `limit` of their
//! union. The window never reaches past an item of a node that has more
//! beyond what it gave, so walking the pages returns every sandbox once.

use std::cmp::Ordering;
use std::collections::BTreeMap;

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;

/// The page size of `/v2/sandboxes` when the client gives no `limit`, as E2B.
pub const DEFAULT_LIMIT: i64 = 100;
/// The largest `limit` a node accepts for one page.
pub const NODE_PAGE_LIMIT: usize = 100;

/// Bad pagination parameters (answered with 400).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PageError {
    #[error("invalid limit: {0:?} is not an integer")]
    Limit(String),
    #[error("invalid next token: {0}")]
    Token(String),
    /// The node's own message for the same mistake.
    #[error("invalid order {0:?}: use asc or desc")]
    Order(String),
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

/// A volume mounted into a listed sandbox.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeMount {
    #[serde(default)]
    pub name: String,
    #[serde(default)]
    pub path: String,
}

/// One sandbox of a node's list, with exactly the fields the gateway relays.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ListedSandbox {
    #[serde(rename = "templateID", default)]
    pub template_id: String,
    #[serde(
        default,
        skip_serializing_if = "is_blank",
        deserialize_with = "null_as_default"
    )]
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
        deserialize_with = "null_as_default"
    )]
    pub metadata: BTreeMap<String, String>,
    #[serde(default)]
    pub state: String,
    #[serde(rename = "envdVersion", default)]
    pub envd_version: String,
    #[serde(
        rename = "volumeMounts",
        default,
        skip_serializing_if = "Vec::is_empty",
        deserialize_with = "null_as_default"
    )]
    pub volume_mounts: Vec<VolumeMount>,
    #[serde(
        rename = "envdUnresponsiveAtPause",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub envd_unresponsive_at_pause: Option<bool>,
    /// The node that listed it: set by the gateway (whatever a node sends),
    /// not a field of a node's own list.
    #[serde(rename = "nodeID", default, skip_serializing_if = "Option::is_none")]
    pub node_id: Option<String>,
}

fn is_blank(alias: &Option<String>) -> bool {
    alias.as_deref().is_none_or(str::is_empty)
}

fn null_as_default<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de> + Default,
{
    Ok(Option::deserialize(d)?.unwrap_or_default())
}

/// The order of a list, as a node sorts it: by start time, newest first
/// (`desc`, the default, and always for `GET /sandboxes`) or oldest first
/// (`asc`), then by id (ascending either way).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Order {
    #[default]
    Desc,
    Asc,
}

impl Order {
    /// Compares two items in this order.
    pub fn compare(self, a: &ListedSandbox, b: &ListedSandbox) -> Ordering {
        let by_time = a.started_at.0.cmp(&b.started_at.0);
        let by_time = match self {
            Order::Desc => by_time.reverse(),
            Order::Asc => by_time,
        };
        by_time.then_with(|| a.sandbox_id.cmp(&b.sandbox_id))
    }

    /// The value of the `order` query key.
    pub fn as_str(self) -> &'static str {
        match self {
            Order::Desc => "desc",
            Order::Asc => "asc",
        }
    }
}

/// The order of every list without `order`: newest first, then by id.
pub fn list_order(a: &ListedSandbox, b: &ListedSandbox) -> Ordering {
    Order::Desc.compare(a, b)
}

/// Sorts in `order` and keeps one entry of each sandbox id: its newest
/// (in either order, as a sandbox listed by two nodes is current where it
/// started last).
pub fn merge(mut items: Vec<ListedSandbox>, order: Order) -> Vec<ListedSandbox> {
    items.sort_by(list_order);
    let mut seen = std::collections::HashSet::new();
    items.retain(|i| seen.insert(i.sandbox_id.clone()));
    if order != Order::Desc {
        items.sort_by(|a, b| order.compare(a, b));
    }
    items
}

/// Parses `order` as a node does: `asc`, `desc`, or absent or empty
/// (`None`: the default, newest first). Of repeated keys the first counts,
/// as for `limit`.
pub fn parse_order(query: &[(String, String)]) -> Result<Option<Order>, PageError> {
    match query
        .iter()
        .find(|(k, _)| k == "order")
        .map(|(_, v)| v.as_str())
    {
        None | Some("") => Ok(None),
        Some("desc") => Ok(Some(Order::Desc)),
        Some("asc") => Ok(Some(Order::Asc)),
        Some(other) => Err(PageError::Order(other.to_string())),
    }
}

/// Parses `limit`: absent or empty means [`DEFAULT_LIMIT`].
pub fn parse_limit(query: &[(String, String)]) -> Result<i64, PageError> {
    match query
        .iter()
        .find(|(k, _)| k == "limit")
        .map(|(_, v)| v.as_str())
    {
        None | Some("") => Ok(DEFAULT_LIMIT),
        Some(v) => v.parse().map_err(|_| PageError::Limit(v.to_string())),
    }
}

fn is_uuid_shaped(id: &str) -> bool {
    id.len() == 36
        && id.bytes().enumerate().all(|(i, b)| match i {
            8 | 13 | 18 | 23 => b == b'-',
            _ => b.is_ascii_hexdigit(),
        })
}

/// Where a page starts: after the item with this start time and id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cursor {
    pub started_at: Timestamp,
    pub sandbox_id: String,
}

impl Cursor {
    /// The cursor just after `item`.
    pub fn after(item: &ListedSandbox) -> Self {
        Self {
            started_at: item.started_at,
            sandbox_id: item.sandbox_id.clone(),
        }
    }

    /// Whether `item` comes after the cursor in `order`.
    pub fn precedes(&self, item: &ListedSandbox, order: Order) -> bool {
        let past = match order {
            Order::Desc => item.started_at.0 < self.started_at.0,
            Order::Asc => item.started_at.0 > self.started_at.0,
        };
        past || (item.started_at.0 == self.started_at.0 && item.sandbox_id > self.sandbox_id)
    }

    /// The client's `nextToken`: URL-safe base64 (padded) of
    /// `<startedAt, RFC 3339 in UTC>__<sandboxID>`.
    pub fn token(&self) -> String {
        URL_SAFE.encode(format!(
            "{}__{}",
            self.started_at.utc().format(),
            self.sandbox_id
        ))
    }

    /// The same cursor as a node's `nextToken` for a list in `order`. A node
    /// reads the time to the millisecond (as it writes it), so a finer time
    /// is moved back, towards the items before the cursor: newest first,
    /// rounded up; oldest first, rounded down and one millisecond further,
    /// so that items the node reads as started in the cursor's millisecond
    /// are kept whatever their id. The node then answers a superset, which
    /// [`Cursor::precedes`] trims.
    pub fn node_token(&self, order: Order) -> String {
        let t = self.started_at.0.to_offset(time::UtcOffset::UTC);
        let sub_ms = i64::from(t.nanosecond() % 1_000_000);
        let t = match order {
            _ if sub_ms == 0 => t,
            Order::Desc => t + time::Duration::nanoseconds(1_000_000 - sub_ms),
            Order::Asc => t - time::Duration::nanoseconds(sub_ms + 1_000_000),
        };
        let t = t.format(&Rfc3339).unwrap_or_default();
        URL_SAFE.encode(format!("{t}__{}", self.sandbox_id))
    }
}

/// Decodes a client's `nextToken`; no token means the first page.
pub fn parse_token(token: Option<&str>) -> Result<Option<Cursor>, PageError> {
    let token = match token {
        None | Some("") => return Ok(None),
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
    let started_at = Timestamp::parse(ts)
        .map_err(|e| PageError::Token(format!("invalid timestamp format in cursor: {e}")))?;
    if !is_uuid_shaped(id) {
        return Err(PageError::Token(format!(
            "invalid sandbox id in cursor: {id}"
        )));
    }
    Ok(Some(Cursor {
        started_at,
        sandbox_id: id.to_string(),
    }))
}

/// The token of the page that continues after `last`.
pub fn make_token(last: &ListedSandbox) -> String {
    Cursor::after(last).token()
}

/// What to ask a node for next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeRequest {
    /// The node's `limit` (`None`: none is sent, for the unpaged v1 list).
    pub limit: Option<usize>,
    /// The node's `nextToken`.
    pub token: Option<String>,
}

/// How one node's pages ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WalkEnd {
    /// Still walking.
    Open,
    /// The node has nothing more.
    Exhausted,
    /// Enough was taken; the node has more.
    Enough,
    /// The node gave a token that goes nowhere (an empty page or the same
    /// token again): what it gave so far is kept, the rest is not asked.
    Stalled,
}

/// One node's items after a cursor, collected page by page: [`next_request`]
/// says what to ask, [`take_page`] takes the answer, until it says `None`.
///
/// [`next_request`]: NodeWalk::next_request
/// [`take_page`]: NodeWalk::take_page
#[derive(Debug, Clone)]
pub struct NodeWalk {
    cursor: Option<Cursor>,
    order: Order,
    want: Option<usize>,
    items: Vec<ListedSandbox>,
    token: Option<String>,
    end: WalkEnd,
}

impl NodeWalk {
    /// Items after `cursor` (all, without one) in `order` (the order the
    /// node is asked for), `want` of them at most (all, without it). With
    /// `want`, every page asked has a `limit`.
    pub fn new(cursor: Option<Cursor>, want: Option<usize>, order: Order) -> Self {
        Self {
            token: cursor.as_ref().map(|c| c.node_token(order)),
            cursor,
            order,
            want,
            items: Vec::new(),
            end: WalkEnd::Open,
        }
    }

    /// The next page to ask for, or `None` when the walk is over.
    pub fn next_request(&self) -> Option<NodeRequest> {
        if self.end != WalkEnd::Open {
            return None;
        }
        let limit = self
            .want
            .map(|w| w.saturating_sub(self.items.len()).clamp(1, NODE_PAGE_LIMIT));
        Some(NodeRequest {
            limit,
            token: self.token.clone(),
        })
    }

    /// Takes one page the node answered and its `x-next-token`.
    pub fn take_page(&mut self, page: Vec<ListedSandbox>, next: Option<String>) -> WalkEnd {
        let progressed = !page.is_empty();
        let (cursor, order) = (self.cursor.as_ref(), self.order);
        self.items.extend(
            page.into_iter()
                .filter(|i| cursor.is_none_or(|c| c.precedes(i, order))),
        );
        self.end = match next {
            None => WalkEnd::Exhausted,
            Some(t) if !progressed || self.token.as_deref() == Some(t.as_str()) => WalkEnd::Stalled,
            Some(t) => {
                self.token = Some(t);
                if self.want.is_some_and(|w| self.items.len() >= w) {
                    WalkEnd::Enough
                } else {
                    WalkEnd::Open
                }
            }
        };
        self.end
    }

    /// What the node gave.
    pub fn finish(self) -> NodeList {
        NodeList {
            items: self.items,
            has_more: self.end == WalkEnd::Enough,
        }
    }
}

/// One node's items after the cursor, and whether it holds more after them.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct NodeList {
    pub items: Vec<ListedSandbox>,
    pub has_more: bool,
}

/// The client's page of the nodes' lists (each after the same cursor, in
/// `order`): the first `limit` items of their merge, never past the last
/// item of a node that has more, and the token of the next page when
/// anything is left.
pub fn page(
    lists: Vec<NodeList>,
    limit: usize,
    order: Order,
) -> (Vec<ListedSandbox>, Option<String>) {
    // Items past a node's last one may be missing from the merge: the node
    // has not given what lies between.
    let horizon = lists
        .iter()
        .filter(|l| l.has_more)
        .filter_map(|l| l.items.iter().max_by(|a, b| order.compare(a, b)))
        .min_by(|a, b| order.compare(a, b))
        .cloned();
    let any_more = lists.iter().any(|l| l.has_more);
    let merged = merge(lists.into_iter().flat_map(|l| l.items).collect(), order);
    let total = merged.len();
    let page: Vec<ListedSandbox> = merged
        .into_iter()
        .take_while(|i| {
            horizon
                .as_ref()
                .is_none_or(|h| order.compare(i, h) != Ordering::Greater)
        })
        .take(limit)
        .collect();
    let more = any_more || page.len() < total;
    let next = match page.last() {
        Some(last) if more => Some(make_token(last)),
        _ => None,
    };
    (page, next)
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

/// The query of one v2 page asked of a node: the client's keys other than
/// `limit`, `nextToken` and `order`, then the walk's own and the `order` the
/// gateway read (one, so that a node never reads another from repeated
/// keys; none when the client gave none), re-encoded with keys sorted.
pub fn v2_node_query(
    pairs: &[(String, String)],
    order: Option<Order>,
    req: &NodeRequest,
) -> String {
    let mut kept: Vec<(&str, &str)> = pairs
        .iter()
        .filter(|(k, _)| k != "limit" && k != "nextToken" && k != "order")
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    if let Some(o) = order {
        kept.push(("order", o.as_str()));
    }
    let limit = req.limit.map(|l| l.to_string());
    if let Some(l) = &limit {
        kept.push(("limit", l));
    }
    if let Some(t) = &req.token {
        kept.push(("nextToken", t));
    }
    kept.sort_by(|a, b| a.0.cmp(b.0));
    kept.iter()
        .map(|(k, v)| format!("{}={}", query_escape(k), query_escape(v)))
        .collect::<Vec<_>>()
        .join("&")
}

/// The query of one v1 page asked of a node: the client's raw query as it
/// came, with the node's `nextToken` added when the node pages it.
pub fn v1_node_query(raw: &str, req: &NodeRequest) -> String {
    match &req.token {
        None => raw.to_string(),
        Some(t) if raw.is_empty() => format!("nextToken={}", query_escape(t)),
        Some(t) => format!("{raw}&nextToken={}", query_escape(t)),
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn item(id: &str, started: &str) -> ListedSandbox {
        serde_json::from_value(
            serde_json::json!({"sandboxID": id, "startedAt": started, "templateID": "base"}),
        )
        .unwrap()
    }

    fn uuid(n: u32) -> String {
        format!("00000000-0000-4000-8000-{n:012x}")
    }

    /// `ms` after 2026-01-01T00:00:00Z.
    fn at_ms(id: &str, ms: u64) -> ListedSandbox {
        let base = OffsetDateTime::from_unix_timestamp(1_767_225_600).unwrap();
        let t = base + time::Duration::milliseconds(ms as i64);
        item(id, &t.format(&Rfc3339).unwrap())
    }

    fn ids(items: &[ListedSandbox]) -> Vec<&str> {
        items.iter().map(|i| i.sandbox_id.as_str()).collect()
    }

    /// A node's answer to one list page, as agentenv-node pages
    /// (`api::model::ListQuery::apply`, `paginate`): items sorted by start
    /// time in `order` (newest first, or oldest first for `Asc`) then by id,
    /// those after the token's (ms, id) in that order, `limit` of them (100
    /// without one; more is refused), and a token for the last one only when
    /// more follow.
    fn node_answer(
        node: &[ListedSandbox],
        req: &NodeRequest,
        order: Order,
    ) -> (Vec<ListedSandbox>, Option<String>) {
        let limit = req.limit.unwrap_or(100);
        assert!(limit <= 100, "a node refuses limit {limit}");
        let after = req.token.as_deref().map(|t| {
            let raw = String::from_utf8(URL_SAFE.decode(t).unwrap()).unwrap();
            let (ts, id) = raw.split_once("__").unwrap();
            let ms = OffsetDateTime::parse(ts, &Rfc3339)
                .unwrap()
                .unix_timestamp_nanos()
                / 1_000_000;
            (ms, id.to_string())
        });
        let ms = |i: &ListedSandbox| i.started_at.0.unix_timestamp_nanos() / 1_000_000;
        let mut sorted = node.to_vec();
        sorted.sort_by(|a, b| {
            let by_ms = ms(a).cmp(&ms(b));
            let by_ms = if order == Order::Asc {
                by_ms
            } else {
                by_ms.reverse()
            };
            by_ms.then_with(|| a.sandbox_id.cmp(&b.sandbox_id))
        });
        let mut page: Vec<ListedSandbox> = sorted
            .into_iter()
            .filter(|i| match &after {
                None => true,
                Some((t, id)) => {
                    let past = if order == Order::Asc {
                        ms(i) > *t
                    } else {
                        ms(i) < *t
                    };
                    past || (ms(i) == *t && i.sandbox_id > *id)
                }
            })
            .collect();
        let more = page.len() > limit;
        page.truncate(limit);
        let next = if more {
            page.last().map(|l| {
                let t = l.started_at.0.format(&Rfc3339).unwrap();
                URL_SAFE.encode(format!("{t}__{}", l.sandbox_id))
            })
        } else {
            None
        };
        (page, next)
    }

    /// Walks one node after `cursor` in `order`.
    fn walk_in(
        node: &[ListedSandbox],
        cursor: Option<Cursor>,
        want: Option<usize>,
        order: Order,
    ) -> (NodeList, Vec<NodeRequest>) {
        let mut w = NodeWalk::new(cursor, want, order);
        let mut asked = Vec::new();
        while let Some(req) = w.next_request() {
            let (items, next) = node_answer(node, &req, order);
            asked.push(req);
            w.take_page(items, next);
        }
        (w.finish(), asked)
    }

    /// Walks one node after `cursor`, newest first.
    fn walk(
        node: &[ListedSandbox],
        cursor: Option<Cursor>,
        want: Option<usize>,
    ) -> (NodeList, Vec<NodeRequest>) {
        walk_in(node, cursor, want, Order::Desc)
    }

    /// Every page of the cluster `nodes` with `limit` in `order`, as a client
    /// walks them.
    fn all_pages(
        nodes: &[Vec<ListedSandbox>],
        limit: usize,
        order: Order,
    ) -> Vec<Vec<ListedSandbox>> {
        let mut pages = Vec::new();
        let mut token: Option<String> = None;
        loop {
            let cursor = parse_token(token.as_deref()).unwrap();
            let lists = nodes
                .iter()
                .map(|n| walk_in(n, cursor.clone(), Some(limit), order).0)
                .collect();
            let (items, next) = page(lists, limit, order);
            if let Some(t) = &next {
                assert_eq!(*t, make_token(items.last().unwrap()));
            }
            pages.push(items);
            match next {
                Some(t) => token = Some(t),
                None => return pages,
            }
            assert!(pages.len() < 10_000, "the walk does not end");
        }
    }

    /// The sizes of the pages of `total` items walked `limit` at a time.
    fn page_sizes(total: usize, limit: usize) -> Vec<usize> {
        let mut want = vec![limit; total / limit];
        if total % limit != 0 || want.is_empty() {
            want.push(total % limit);
        }
        want
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
            r#"{"templateID":"t","alias":"","sandboxID":"s","clientID":"c","startedAt":"2026-01-01T00:00:00Z","endAt":"2026-01-01T01:00:00Z","cpuCount":2,"memoryMB":512,"diskSizeMB":1024,"metadata":null,"state":"running","envdVersion":"0.2","volumeMounts":null,"extra":1}"#,
        )
        .unwrap();
        assert_eq!(
            serde_json::to_string(&v).unwrap(),
            r#"{"templateID":"t","sandboxID":"s","clientID":"c","startedAt":"2026-01-01T00:00:00Z","endAt":"2026-01-01T01:00:00Z","cpuCount":2,"memoryMB":512,"diskSizeMB":1024,"state":"running","envdVersion":"0.2"}"#
        );
    }

    #[test]
    fn volume_mounts_and_envd_unresponsive_at_pause_are_relayed() {
        let v: ListedSandbox = serde_json::from_str(
            r#"{"templateID":"t","alias":"base","sandboxID":"s","startedAt":"2026-01-01T00:00:00Z","metadata":{"team":"a"},"state":"paused","envdVersion":"0.2","volumeMounts":[{"name":"data","path":"/mnt/data","extra":1}],"envdUnresponsiveAtPause":false}"#,
        )
        .unwrap();
        let out = serde_json::to_value(&v).unwrap();
        assert_eq!(out["alias"], "base");
        assert_eq!(out["metadata"], serde_json::json!({"team": "a"}));
        assert_eq!(
            out["volumeMounts"],
            serde_json::json!([{"name": "data", "path": "/mnt/data"}])
        );
        assert_eq!(out["envdUnresponsiveAtPause"], false);
    }

    #[test]
    fn merge_orders_newest_first_then_by_id_and_keeps_the_newest_duplicate() {
        let merged = merge(
            vec![
                item("b", "2026-01-01T00:00:01Z"),
                item("dup", "2026-01-01T00:00:00Z"),
                item("a", "2026-01-01T00:00:01Z"),
                item("dup", "2026-01-01T00:00:03Z"),
            ],
            Order::Desc,
        );
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
    fn merge_ascending_orders_oldest_first_then_by_id_and_keeps_the_newest_duplicate() {
        let merged = merge(
            vec![
                item("b", "2026-01-01T00:00:01Z"),
                item("dup", "2026-01-01T00:00:00Z"),
                item("c", "2026-01-01T00:00:00.5Z"),
                item("a", "2026-01-01T00:00:01Z"),
                item("dup", "2026-01-01T00:00:03Z"),
            ],
            Order::Asc,
        );
        let ids: Vec<_> = merged
            .iter()
            .map(|i| (i.sandbox_id.as_str(), i.started_at.format()))
            .collect();
        assert_eq!(
            ids,
            [
                ("c", "2026-01-01T00:00:00.5Z".to_string()),
                ("a", "2026-01-01T00:00:01Z".to_string()),
                ("b", "2026-01-01T00:00:01Z".to_string()),
                ("dup", "2026-01-01T00:00:03Z".to_string()),
            ],
            "ties stay by id ascending; the newer duplicate wins in either order"
        );
    }

    #[test]
    fn order_is_read_as_the_node_reads_it() {
        let order = |q: &str| parse_order(&parse_query(q));
        assert_eq!(order(""), Ok(None));
        assert_eq!(order("order="), Ok(None));
        assert_eq!(order("order=desc"), Ok(Some(Order::Desc)));
        assert_eq!(order("order=asc&limit=3"), Ok(Some(Order::Asc)));
        assert_eq!(order("order=asc&order=desc"), Ok(Some(Order::Asc)));
        assert_eq!(
            order("order=sideways").unwrap_err().to_string(),
            "invalid order \"sideways\": use asc or desc"
        );
        assert_eq!(
            order("order=ASC").unwrap_err().to_string(),
            "invalid order \"ASC\": use asc or desc"
        );
        assert_eq!(
            order("order=%22x%22").unwrap_err().to_string(),
            "invalid order \"\\\"x\\\"\": use asc or desc",
            "quoted as the node quotes it"
        );
    }

    #[test]
    fn a_full_last_page_has_no_token_when_no_node_has_more() {
        let node = vec![at_ms(&uuid(1), 3), at_ms(&uuid(2), 2)];
        let (list, _) = walk(&node, None, Some(2));
        assert!(!list.has_more);
        let (items, next) = page(vec![list], 2, Order::Desc);
        assert_eq!(ids(&items), [uuid(1), uuid(2)]);
        assert_eq!(next, None, "the page is full but nothing follows");
    }

    #[test]
    fn a_node_with_more_gives_a_token_and_the_next_page_follows_it() {
        let node: Vec<_> = (0..3).map(|i| at_ms(&uuid(i), 10 - u64::from(i))).collect();
        let (list, asked) = walk(&node, None, Some(2));
        assert!(list.has_more);
        assert_eq!(
            asked,
            [NodeRequest {
                limit: Some(2),
                token: None
            }]
        );
        let (items, next) = page(vec![list], 2, Order::Desc);
        assert_eq!(ids(&items), [uuid(0), uuid(1)]);
        let cursor = parse_token(next.as_deref()).unwrap();
        let (list, asked) = walk(&node, cursor, Some(2));
        assert_eq!(
            asked[0].token.as_deref(),
            Some(make_token(&node[1]).as_str()),
            "a millisecond cursor reaches the node in the node's own format"
        );
        let (items, next) = page(vec![list], 2, Order::Desc);
        assert_eq!(ids(&items), [uuid(2)]);
        assert_eq!(next, None);
    }

    #[test]
    fn a_node_is_followed_past_its_page_cap_until_the_limit() {
        let node: Vec<_> = (0..250)
            .map(|i| at_ms(&uuid(i), u64::from(i / 3)))
            .collect();
        let mut node = node;
        node.sort_by(list_order);
        let (list, asked) = walk(&node, None, Some(230));
        assert_eq!(list.items.len(), 230);
        assert!(list.has_more);
        let limits: Vec<_> = asked.iter().map(|r| r.limit).collect();
        assert_eq!(limits, [Some(100), Some(100), Some(30)]);
        let (list, asked) = walk(&node, None, None);
        assert_eq!(list.items.len(), 250);
        assert!(!list.has_more);
        assert_eq!(asked.len(), 3, "v1 follows a paging node to its end");
    }

    #[test]
    fn a_page_never_reaches_past_a_node_that_has_more() {
        // Node a gave 2 of its items and has more; one of the two sits, newer,
        // on node b too. Deduplicated, the merge holds 3 items, but b's oldest
        // must wait: a's next items may come before it.
        let a = NodeList {
            items: vec![at_ms(&uuid(2), 8), at_ms(&uuid(1), 7)],
            has_more: true,
        };
        let b = NodeList {
            items: vec![at_ms(&uuid(2), 10), at_ms(&uuid(5), 2)],
            has_more: false,
        };
        let (items, next) = page(vec![a, b], 3, Order::Desc);
        assert_eq!(ids(&items), [uuid(2), uuid(1)]);
        assert_eq!(next, Some(make_token(&at_ms(&uuid(1), 7))));
    }

    #[test]
    fn an_ascending_page_never_reaches_past_a_node_that_has_more() {
        // Node a gave its 2 oldest items and has more; b gave all of its own.
        // b's item at 9 ms must wait: a's next items (after 7 ms) may come
        // before it. b's item at 7 ms ties a's last one and sorts before it
        // by id, so it is in.
        let a = NodeList {
            items: vec![at_ms(&uuid(1), 2), at_ms(&uuid(4), 7)],
            has_more: true,
        };
        let b = NodeList {
            items: vec![at_ms(&uuid(3), 7), at_ms(&uuid(5), 7), at_ms(&uuid(2), 9)],
            has_more: false,
        };
        let (items, next) = page(vec![a.clone(), b.clone()], 10, Order::Asc);
        assert_eq!(ids(&items), [uuid(1), uuid(3), uuid(4)]);
        assert_eq!(next, Some(make_token(&at_ms(&uuid(4), 7))));
        // The limit cuts first.
        let (items, next) = page(vec![a, b.clone()], 2, Order::Asc);
        assert_eq!(ids(&items), [uuid(1), uuid(3)]);
        assert_eq!(next, Some(make_token(&at_ms(&uuid(3), 7))));
        // No node with more: all of it, and no token.
        let (items, next) = page(vec![b], 3, Order::Asc);
        assert_eq!(ids(&items), [uuid(3), uuid(5), uuid(2)]);
        assert_eq!(next, None);
    }

    #[test]
    fn an_ascending_walk_asks_the_node_for_oldest_first_after_the_cursor() {
        let node: Vec<_> = (0..5)
            .map(|i| at_ms(&uuid(i), 10 + u64::from(i / 2)))
            .collect();
        let (list, asked) = walk_in(&node, None, Some(3), Order::Asc);
        assert!(list.has_more);
        assert_eq!(asked.len(), 1);
        let (items, next) = page(vec![list], 3, Order::Asc);
        assert_eq!(ids(&items), [uuid(0), uuid(1), uuid(2)]);
        let cursor = parse_token(next.as_deref()).unwrap();
        let (list, asked) = walk_in(&node, cursor, Some(3), Order::Asc);
        assert_eq!(
            asked[0].token.as_deref(),
            Some(make_token(&node[2]).as_str()),
            "the same token format as newest first"
        );
        let (items, next) = page(vec![list], 3, Order::Asc);
        assert_eq!(ids(&items), [uuid(3), uuid(4)]);
        assert_eq!(next, None);
    }

    #[test]
    fn a_node_token_that_goes_nowhere_ends_the_walk() {
        let mut w = NodeWalk::new(None, Some(10), Order::Desc);
        assert_eq!(
            w.take_page(vec![at_ms(&uuid(1), 1)], Some("t1".into())),
            WalkEnd::Open
        );
        assert_eq!(w.next_request().unwrap().token.as_deref(), Some("t1"));
        assert_eq!(
            w.take_page(vec![at_ms(&uuid(2), 0)], Some("t1".into())),
            WalkEnd::Stalled
        );
        assert_eq!(w.next_request(), None);
        let mut w = NodeWalk::new(None, None, Order::Desc);
        assert_eq!(w.take_page(vec![], Some("t".into())), WalkEnd::Stalled);
        assert!(!w.finish().has_more);
    }

    #[test]
    fn items_a_node_gives_before_the_cursor_are_dropped() {
        // A node that ignores the cursor answers everything again.
        let cursor = Cursor::after(&at_ms(&uuid(2), 5));
        let mut w = NodeWalk::new(Some(cursor.clone()), Some(10), Order::Desc);
        let everything = vec![
            at_ms(&uuid(1), 6),
            at_ms(&uuid(2), 5),
            at_ms(&uuid(3), 5),
            at_ms(&uuid(4), 4),
            at_ms(&uuid(0), 5),
        ];
        w.take_page(everything.clone(), None);
        assert_eq!(ids(&w.finish().items), [uuid(3), uuid(4)]);
        // Oldest first, the same cursor keeps the later ones and, in its
        // millisecond, still the larger ids.
        let mut w = NodeWalk::new(Some(cursor), Some(10), Order::Asc);
        w.take_page(everything, None);
        assert_eq!(ids(&w.finish().items), [uuid(1), uuid(3)]);
    }

    #[test]
    fn node_tokens_are_the_nodes_millisecond_format_rounded_up() {
        let id = uuid(7);
        let c = Cursor::after(&item(&id, "2026-01-01T00:00:02.5Z"));
        for order in [Order::Desc, Order::Asc] {
            assert_eq!(
                c.node_token(order),
                URL_SAFE.encode(format!("2026-01-01T00:00:02.5Z__{id}"))
            );
            assert_eq!(c.node_token(order), c.token());
        }
        let c = Cursor::after(&item(&id, "2026-01-01T02:00:02.0001+02:00"));
        assert_eq!(
            c.node_token(Order::Desc),
            URL_SAFE.encode(format!("2026-01-01T00:00:02.001Z__{id}"))
        );
        assert_eq!(
            c.token(),
            URL_SAFE.encode(format!("2026-01-01T00:00:02.0001Z__{id}"))
        );
    }

    #[test]
    fn ascending_node_tokens_are_rounded_down_a_millisecond_further() {
        let id = uuid(7);
        let c = Cursor::after(&item(&id, "2026-01-01T02:00:02.0015+02:00"));
        assert_eq!(
            c.node_token(Order::Asc),
            URL_SAFE.encode(format!("2026-01-01T00:00:02Z__{id}"))
        );
        // The node's answer to that token holds every item after the cursor,
        // those a node reads as started in the cursor's millisecond (1 ms)
        // with a smaller id too; the walk trims what is not after it.
        let node = vec![
            item(&uuid(1), "2026-01-01T00:00:02.001Z"),
            item(&uuid(2), "2026-01-01T00:00:02.0016Z"),
            item(&uuid(9), "2026-01-01T00:00:02.0015Z"),
            item(&uuid(3), "2026-01-01T00:00:02.002Z"),
        ];
        let (list, _) = walk_in(&node, Some(c), Some(10), Order::Asc);
        assert_eq!(ids(&list.items), [uuid(2), uuid(9), uuid(3)]);
    }

    #[test]
    fn bad_tokens_and_limits_are_reported() {
        assert!(
            parse_token(Some("!!!"))
                .unwrap_err()
                .to_string()
                .starts_with("invalid next token: error decoding cursor")
        );
        let no_sep = URL_SAFE.encode("2026-01-01T00:00:00Z");
        assert_eq!(
            parse_token(Some(&no_sep)).unwrap_err().to_string(),
            "invalid next token: invalid cursor format"
        );
        let bad_id = URL_SAFE.encode("2026-01-01T00:00:00Z__sbx");
        assert_eq!(
            parse_token(Some(&bad_id)).unwrap_err().to_string(),
            "invalid next token: invalid sandbox id in cursor: sbx"
        );
        assert_eq!(parse_token(Some("")).unwrap(), None);
        let q = parse_query("limit=abc");
        assert_eq!(
            parse_limit(&q).unwrap_err().to_string(),
            "invalid limit: \"abc\" is not an integer"
        );
        assert_eq!(parse_limit(&parse_query("")).unwrap(), 100);
        assert_eq!(parse_limit(&parse_query("limit=")).unwrap(), 100);
        assert_eq!(parse_limit(&parse_query("limit=3")).unwrap(), 3);
        assert_eq!(parse_limit(&parse_query("limit=500")).unwrap(), 500);
    }

    #[test]
    fn node_queries_replace_the_paging_keys_and_sort_v2_keys() {
        let q = parse_query("state=running&limit=2&metadata=team%3Dalpha&nextToken=abc&a=x+y");
        let req = NodeRequest {
            limit: Some(2),
            token: Some("dG9r==".into()),
        };
        assert_eq!(
            v2_node_query(&q, None, &req),
            "a=x+y&limit=2&metadata=team%3Dalpha&nextToken=dG9r%3D%3D&state=running"
        );
        let first = NodeRequest {
            limit: Some(100),
            token: None,
        };
        assert_eq!(v2_node_query(&[], None, &first), "limit=100");
        // The order the gateway read, once, whatever the client repeated.
        let q = parse_query(
            "order=asc&template=web&order=desc&startedAfter=2026-01-01T00%3A00%3A00%2B00%3A00",
        );
        assert_eq!(
            v2_node_query(&q, Some(Order::Asc), &first),
            "limit=100&order=asc&startedAfter=2026-01-01T00%3A00%3A00%2B00%3A00&template=web"
        );
        assert_eq!(
            v2_node_query(&parse_query("order=desc"), Some(Order::Desc), &first),
            "limit=100&order=desc"
        );
        let v1 = NodeRequest {
            limit: None,
            token: Some("dG9r==".into()),
        };
        assert_eq!(
            v1_node_query("metadata=team%3Dalpha", &v1),
            "metadata=team%3Dalpha&nextToken=dG9r%3D%3D"
        );
        assert_eq!(v1_node_query("", &v1), "nextToken=dG9r%3D%3D");
        assert_eq!(
            v1_node_query(
                "a=1",
                &NodeRequest {
                    limit: None,
                    token: None
                }
            ),
            "a=1"
        );
    }

    /// 250 and 130 sandboxes; several share a millisecond on one node and
    /// across both.
    fn two_tied_nodes() -> [Vec<ListedSandbox>; 2] {
        let a: Vec<_> = (0..250)
            .map(|i| at_ms(&uuid(i * 7 % 1000), u64::from(i / 5)))
            .collect();
        let b: Vec<_> = (0..130)
            .map(|i| at_ms(&uuid(1000 + i * 13 % 500), 20 + u64::from(i / 4)))
            .collect();
        [a, b]
    }

    #[test]
    fn walking_two_nodes_with_tied_start_times_returns_each_sandbox_once() {
        let nodes = two_tied_nodes();
        let expected = merge(nodes.iter().flatten().cloned().collect(), Order::Desc);
        assert_eq!(expected.len(), 380);
        for limit in [1, 50, 99, 100, 101, 190, 380, 500] {
            let pages = all_pages(&nodes, limit, Order::Desc);
            let sizes: Vec<usize> = pages.iter().map(Vec::len).collect();
            assert_eq!(sizes, page_sizes(380, limit), "limit {limit}");
            let walked: Vec<ListedSandbox> = pages.into_iter().flatten().collect();
            assert_eq!(ids(&walked), ids(&expected), "limit {limit}");
        }
    }

    #[test]
    fn walking_two_nodes_oldest_first_returns_each_sandbox_once_in_that_order() {
        let nodes = two_tied_nodes();
        let expected = merge(nodes.iter().flatten().cloned().collect(), Order::Asc);
        assert_eq!(expected.len(), 380);
        let mut newest_first = merge(expected.clone(), Order::Desc);
        newest_first.reverse();
        assert_ne!(
            ids(&expected),
            ids(&newest_first),
            "ties by id do not make oldest first the reverse of newest first"
        );
        for limit in [1, 3, 50, 99, 100, 101, 190, 380, 500] {
            let pages = all_pages(&nodes, limit, Order::Asc);
            let sizes: Vec<usize> = pages.iter().map(Vec::len).collect();
            assert_eq!(sizes, page_sizes(380, limit), "limit {limit}");
            let walked: Vec<ListedSandbox> = pages.into_iter().flatten().collect();
            assert_eq!(ids(&walked), ids(&expected), "limit {limit}");
        }
    }

    fn cluster() -> impl Strategy<Value = (Vec<Vec<ListedSandbox>>, usize, Order)> {
        let node = prop::collection::vec(0u64..40, 0..160);
        let order = prop_oneof![Just(Order::Desc), Just(Order::Asc)];
        (prop::collection::vec(node, 1..4), 1usize..230, order).prop_map(|(nodes, limit, order)| {
            let mut n = 0;
            let nodes = nodes
                .into_iter()
                .map(|times| {
                    let mut items: Vec<_> = times
                        .into_iter()
                        .map(|ms| {
                            n += 1;
                            // Ids that do not follow the node or the time.
                            at_ms(&uuid(n * 7919 % 100_003), ms)
                        })
                        .collect();
                    items.sort_by(list_order);
                    items
                })
                .collect();
            (nodes, limit, order)
        })
    }

    proptest! {
        #[test]
        fn any_cluster_walked_with_any_limit_gives_every_sandbox_once_in_order(
            (nodes, limit, order) in cluster()
        ) {
            let expected = merge(nodes.iter().flatten().cloned().collect(), order);
            let pages = all_pages(&nodes, limit, order);
            let (last, full) = pages.split_last().unwrap();
            prop_assert!(full.iter().all(|p| p.len() == limit));
            prop_assert!(last.len() <= limit);
            prop_assert!(!last.is_empty() || pages.len() == 1);
            let walked: Vec<ListedSandbox> = pages.into_iter().flatten().collect();
            prop_assert_eq!(ids(&walked), ids(&expected));
        }
    }
}
