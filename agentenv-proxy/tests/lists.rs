//! Cluster list fan-out, node list and detail, and the query-only scheduler.

mod common;

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use agentenv_core::config::{NodeConfig, SchedulerConfig};
use agentenv_core::proto::scheduler_v1 as pb;
use agentenv_core::proto::scheduler_v1::scheduler_server::Scheduler as _;
use agentenv_proxy::{Gateway, GatewayOptions, GrpcSchedulerClient};
use agentenv_sched::{MemoryBindingStore, Scheduler};
use common::*;
use http::{Request, StatusCode};
use http_body_util::Full;

fn sandbox(id: &str, started: &str) -> serde_json::Value {
    serde_json::json!({
        "templateID": "base", "sandboxID": id, "clientID": "c", "startedAt": started,
        "endAt": "2026-02-01T00:00:00Z", "cpuCount": 1, "memoryMB": 512, "diskSizeMB": 1024,
        "state": "running", "envdVersion": "0.2.0", "unknownField": true
    })
}

async fn list_node(items: serde_json::Value) -> (FakeNode, Log) {
    FakeNode::canned(
        StatusCode::OK,
        &[("content-type", "application/json")],
        items.to_string(),
    )
    .await
}

const MISSING: &str = "x-agentenv-missing-nodes";
/// 2026-01-01T00:00:00Z in ms.
const BASE_MS: u64 = 1_767_225_600_000;

/// The `metadata` filter {"a b": "c&d=e", "x": "y"} as the E2B SDKs send it:
/// each key and value percent-encoded, the pairs joined by `&`, the whole
/// encoded again as the value, which is then encoded in the URL.
const SDK_METADATA: &str = "metadata=a%252520b%3Dc%252526d%25253De%26x%3Dy";

fn sdk_metadata() -> BTreeMap<String, String> {
    BTreeMap::from([("a b".into(), "c&d=e".into()), ("x".into(), "y".into())])
}

/// `n` sandboxes of node `node`, `per_ms` of them created in each
/// millisecond from `BASE_MS + first_ms` on; every 10th is paused, every
/// 3rd started from template `web` (the others from `base`), every 4th
/// (from the 2nd) carries [`sdk_metadata`] and the next one all but one of
/// its values. Ids are UUIDs whose order follows neither the node nor the
/// time.
fn node_records(node: u32, n: u32, first_ms: u64, per_ms: u32) -> Vec<paging_node::Record> {
    (0..n)
        .map(|i| paging_node::Record {
            id: format!(
                "{:08x}-{node:04x}-4000-8000-{i:012x}",
                i.wrapping_mul(2_654_435_761)
            ),
            created_ms: BASE_MS + first_ms + u64::from(i / per_ms),
            state: if i % 10 == 9 { "paused" } else { "running" },
            template: if i % 3 == 0 { "web" } else { "base" },
            metadata: match i % 4 {
                1 => sdk_metadata(),
                2 => BTreeMap::from([("a b".into(), "c".into()), ("x".into(), "y".into())]),
                _ => BTreeMap::new(),
            },
        })
        .collect()
}

/// Node a: 250 sandboxes over 50 ms; node b: 130 over 33 ms, 30 of them the
/// same as a's. Several sandboxes share a millisecond on each node and across
/// both.
fn two_node_records() -> (Vec<paging_node::Record>, Vec<paging_node::Record>) {
    (node_records(0xa, 250, 0, 5), node_records(0xb, 130, 20, 4))
}

/// The ids of `records` in list order (newest first, then by id).
fn in_list_order<'a>(records: impl IntoIterator<Item = &'a paging_node::Record>) -> Vec<String> {
    paging_node::sorted(records.into_iter().cloned().collect())
        .into_iter()
        .map(|r| r.id)
        .collect()
}

/// The ids of `records` oldest first, then by id (`order=asc`).
fn in_asc_order<'a>(records: impl IntoIterator<Item = &'a paging_node::Record>) -> Vec<String> {
    paging_node::sorted_asc(records.into_iter().cloned().collect())
        .into_iter()
        .map(|r| r.id)
        .collect()
}

/// The sizes of the pages of `total` items walked `limit` at a time.
fn page_sizes(total: usize, limit: usize) -> Vec<usize> {
    let mut want = vec![limit; total / limit];
    if total % limit != 0 || want.is_empty() {
        want.push(total % limit);
    }
    want
}

/// Walks `/v2/sandboxes?<query>` page by page; every page's ids and the
/// next token it carried.
async fn walk_v2(c: &Cluster, query: &str) -> Vec<(Vec<String>, Option<String>)> {
    let mut pages = Vec::new();
    let mut token: Option<String> = None;
    loop {
        let mut url = format!("/v2/sandboxes?{query}");
        if let Some(t) = &token {
            url.push_str(&format!("&nextToken={}", t.replace('=', "%3D")));
        }
        let (status, headers, body) = get(&c.url(&url)).await;
        assert_eq!(
            status,
            StatusCode::OK,
            "{url}: {}",
            String::from_utf8_lossy(&body)
        );
        assert!(headers.get(MISSING).is_none());
        token = headers
            .get("x-next-token")
            .map(|t| t.to_str().unwrap().to_string());
        pages.push((ids(&body), token.clone()));
        if token.is_none() {
            return pages;
        }
        assert!(pages.len() < 1000, "the walk does not end");
    }
}

/// The query of every request in `log`, decoded as the node decodes it.
fn asked_queries(log: &Log) -> Vec<BTreeMap<String, String>> {
    log.lock()
        .iter()
        .map(|seen| paging_node::query_pairs(seen.uri.split_once('?').map_or("", |(_, q)| q)))
        .collect()
}

/// The `limit` of every request in `log`.
fn asked_limits(log: &Log) -> Vec<Option<usize>> {
    log.lock()
        .iter()
        .map(|seen| {
            let query = seen.uri.split_once('?').map_or("", |(_, q)| q);
            agentenv_proxy::cluster_list::parse_query(query)
                .into_iter()
                .find(|(k, _)| k == "limit")
                .map(|(_, v)| v.parse().unwrap())
        })
        .collect()
}

fn ids(body: &[u8]) -> Vec<String> {
    json(body)
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["sandboxID"].as_str().unwrap().to_string())
        .collect()
}

#[tokio::test]
async fn sandbox_list_fans_out_merges_newest_first_and_forwards_query_and_host() {
    let (a, log_a) = list_node(serde_json::json!([
        sandbox("a-old", "2026-01-01T00:00:01Z"),
        sandbox("dup", "2026-01-01T00:00:05Z"),
    ]))
    .await;
    let mut b_new = sandbox("b-new", "2026-01-01T00:00:03Z");
    b_new["volumeMounts"] = serde_json::json!([{"name": "data", "path": "/mnt/data"}]);
    b_new["envdUnresponsiveAtPause"] = true.into();
    let (b, log_b) = list_node(serde_json::json!([
        b_new,
        sandbox("dup", "2026-01-01T00:00:02Z"),
        sandbox("a-tie", "2026-01-01T00:00:03Z"),
    ]))
    .await;
    let c = Cluster::ready(
        &[("node-a", &a.endpoint), ("node-b", &b.endpoint)],
        options(),
    )
    .await;
    let (status, _, body) = send(
        Request::get(c.url("/sandboxes?metadata=team%3Dalpha"))
            .header("host", "api.example.test")
            .header("x-api-key", API_KEY)
            .empty(),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(ids(&body), ["dup", "a-tie", "b-new", "a-old"]);
    let v = json(&body);
    assert_eq!(
        v[0]["startedAt"], "2026-01-01T00:00:05Z",
        "the newer duplicate wins"
    );
    assert!(v[0].get("unknownField").is_none());
    assert!(v[0].get("alias").is_none() && v[0].get("metadata").is_none());
    assert!(v[0].get("volumeMounts").is_none() && v[0].get("envdUnresponsiveAtPause").is_none());
    assert_eq!(
        v[2]["volumeMounts"],
        serde_json::json!([{"name": "data", "path": "/mnt/data"}])
    );
    assert_eq!(v[2]["envdUnresponsiveAtPause"], true);
    // Each item names the node that listed it (the newer "dup" is node-a's).
    let nodes: Vec<&str> = v
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["nodeID"].as_str().unwrap())
        .collect();
    assert_eq!(nodes, ["node-a", "node-b", "node-b", "node-a"]);
    assert_eq!(
        v[0]["clientID"], "c",
        "clientID passes through as the node sent it"
    );
    for log in [&log_a, &log_b] {
        let seen = log.lock()[0].clone();
        assert_eq!(seen.uri, "/sandboxes?metadata=team%3Dalpha");
        assert_eq!(seen.headers["host"], "api.example.test");
        assert_eq!(seen.headers["x-forwarded-host"], "api.example.test");
        assert_eq!(
            seen.headers["x-forwarded-uri"],
            "/sandboxes?metadata=team%3Dalpha"
        );
        assert_eq!(seen.headers["x-api-key"], API_KEY);
    }
}

#[tokio::test]
async fn v2_list_pages_with_next_token_and_asks_nodes_after_the_cursor() {
    let (a, log_a) = list_node(serde_json::json!([
        sandbox(
            "00000000-0000-0000-0000-00000000000a",
            "2026-01-01T00:00:03Z"
        ),
        sandbox(
            "00000000-0000-0000-0000-00000000000c",
            "2026-01-01T00:00:01Z"
        ),
    ]))
    .await;
    let (b, _) = list_node(serde_json::json!([sandbox(
        "00000000-0000-0000-0000-00000000000b",
        "2026-01-01T00:00:02Z"
    )]))
    .await;
    let c = Cluster::ready(
        &[("node-a", &a.endpoint), ("node-b", &b.endpoint)],
        options(),
    )
    .await;
    let (status, headers, body) =
        get(&c.url("/v2/sandboxes?state=running&metadata=team%3Dalpha&limit=2")).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        ids(&body),
        [
            "00000000-0000-0000-0000-00000000000a",
            "00000000-0000-0000-0000-00000000000b"
        ]
    );
    let token = headers["x-next-token"].to_str().unwrap().to_string();
    assert_eq!(
        log_a.lock()[0].uri,
        "/v2/sandboxes?limit=2&metadata=team%3Dalpha&state=running"
    );

    // These nodes answer everything whatever they are asked: the gateway
    // still keeps only what comes after the cursor.
    let (status, headers, body) = get(&c.url(&format!(
        "/v2/sandboxes?state=running&limit=2&nextToken={token}"
    )))
    .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(ids(&body), ["00000000-0000-0000-0000-00000000000c"]);
    assert!(headers.get("x-next-token").is_none());
    let node_token =
        paging_node::encode_token(1_767_225_602_000, "00000000-0000-0000-0000-00000000000b");
    assert_eq!(
        log_a.lock()[1].uri,
        format!(
            "/v2/sandboxes?limit=2&nextToken={}&state=running",
            node_token.replace('=', "%3D")
        ),
        "the cursor reaches the node as the node's own token"
    );

    let (status, _, body) = get(&c.url("/v2/sandboxes?limit=abc")).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(message(&body).starts_with("invalid limit"));
    let (status, _, body) = get(&c.url("/v2/sandboxes?nextToken=%21%21")).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(message(&body).starts_with("invalid next token"));
    let (status, _, body) = get(&c.url("/v2/sandboxes?limit=0")).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(ids(&body), Vec::<String>::new());
}

#[tokio::test]
async fn a_node_answering_5xx_or_garbage_is_left_out_and_named() {
    let (a, _) = list_node(serde_json::json!([sandbox(
        "00000000-0000-0000-0000-00000000000a",
        "2026-01-01T00:00:03Z"
    )]))
    .await;
    let (bad, _) = FakeNode::canned(StatusCode::INTERNAL_SERVER_ERROR, &[], "boom").await;
    let (garbage, _) = FakeNode::canned(StatusCode::OK, &[], "{not a list").await;
    let c = Cluster::ready(
        &[
            ("node-a", &a.endpoint),
            ("node-b", &bad.endpoint),
            ("node-c", &garbage.endpoint),
        ],
        options(),
    )
    .await;
    for path in ["/sandboxes", "/v2/sandboxes"] {
        let (status, headers, body) = get(&c.url(path)).await;
        assert_eq!(status, StatusCode::OK, "{path}");
        assert_eq!(ids(&body), ["00000000-0000-0000-0000-00000000000a"]);
        assert_eq!(headers[MISSING], "node-b,node-c", "{path}");
    }

    let c = Cluster::ready(&[("node-c", &garbage.endpoint)], options()).await;
    let (status, headers, body) = get(&c.url("/sandboxes")).await;
    assert_eq!(status, StatusCode::BAD_GATEWAY);
    assert_eq!(message(&body), "cluster list unavailable");
    assert_eq!(headers[MISSING], "node-c");
}

#[tokio::test]
async fn an_upstream_4xx_fails_the_whole_list_with_that_status() {
    let (a, _) = paging_node::paging_node(node_records(0, 30, 0, 3), vec![]).await;
    let (denied, _) = FakeNode::canned(StatusCode::UNAUTHORIZED, &[], "").await;
    let c = Cluster::ready(
        &[("node-a", &a.endpoint), ("node-b", &denied.endpoint)],
        options(),
    )
    .await;
    for path in ["/sandboxes", "/v2/sandboxes?limit=10"] {
        let (status, headers, body) = get(&c.url(path)).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED, "{path}");
        assert!(body.is_empty());
        assert!(headers.get(MISSING).is_none());
    }
    let (refusing, _) = FakeNode::canned(StatusCode::BAD_REQUEST, &[], "{}").await;
    let c = Cluster::ready(
        &[("node-a", &a.endpoint), ("node-b", &refusing.endpoint)],
        options(),
    )
    .await;
    let (status, _, body) = get(&c.url("/v2/sandboxes?state=weird")).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(message(&body), "Bad Request");
    // The node's own message says what to fix: the client gets it.
    let (explaining, _) = FakeNode::canned(
        StatusCode::BAD_REQUEST,
        &[],
        r#"{"code":400,"message":"invalid state \"weird\": use running, paused or both"}"#,
    )
    .await;
    let c = Cluster::ready(
        &[("node-a", &a.endpoint), ("node-b", &explaining.endpoint)],
        options(),
    )
    .await;
    let (status, _, body) = get(&c.url("/v2/sandboxes?state=weird")).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(
        message(&body),
        "invalid state \"weird\": use running, paused or both"
    );
}

#[tokio::test]
async fn v2_pages_walk_every_sandbox_of_both_nodes_once_in_order_with_tied_start_times() {
    let (ra, rb) = two_node_records();
    let expected = in_list_order(ra.iter().chain(&rb));
    assert_eq!(expected.len(), 380);
    let (a, log_a) = paging_node::paging_node(ra, vec![]).await;
    let (b, log_b) = paging_node::paging_node(rb, vec![]).await;
    let c = Cluster::two_nodes(&a, &b).await;

    for limit in [50usize, 190, 250] {
        log_a.lock().clear();
        log_b.lock().clear();
        let pages = walk_v2(&c, &format!("limit={limit}")).await;
        let sizes: Vec<usize> = pages.iter().map(|(p, _)| p.len()).collect();
        let mut want = vec![limit; 380 / limit];
        if 380 % limit != 0 {
            want.push(380 % limit);
        }
        assert_eq!(sizes, want, "limit {limit}");
        let tokens: Vec<bool> = pages.iter().map(|(_, t)| t.is_some()).collect();
        let mut want_tokens = vec![true; pages.len() - 1];
        want_tokens.push(false);
        assert_eq!(
            tokens, want_tokens,
            "only the last page goes without a token"
        );
        let walked: Vec<String> = pages.into_iter().flat_map(|(p, _)| p).collect();
        assert_eq!(walked, expected, "limit {limit}");
        for log in [&log_a, &log_b] {
            assert!(
                asked_limits(log)
                    .iter()
                    .all(|l| l.is_some_and(|l| (1..=100).contains(&l))),
                "a node is always asked for 1..100 items: {:?}",
                asked_limits(log)
            );
        }
    }
    // Pages of 50 end inside groups of sandboxes started in the same
    // millisecond on both nodes: the cursor must split them.
    let started = |id: &str| {
        let (ra, rb) = two_node_records();
        ra.into_iter()
            .chain(rb)
            .find(|r| r.id == id)
            .unwrap()
            .created_ms
    };
    assert!(
        (1..380 / 50).any(|k| started(&expected[k * 50 - 1]) == started(&expected[k * 50])),
        "the data no longer puts a page boundary inside a millisecond"
    );

    // A page larger than a node's: its pages are followed.
    log_a.lock().clear();
    let (status, headers, body) = get(&c.url("/v2/sandboxes?limit=250")).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(ids(&body), expected[..250]);
    assert!(headers.contains_key("x-next-token"));
    assert_eq!(asked_limits(&log_a), [Some(100), Some(100), Some(50)]);
    let followed = log_a.lock()[1].uri.clone();
    assert!(
        followed.contains("nextToken="),
        "node a's own token is followed: {followed}"
    );
}

#[tokio::test]
async fn v2_pages_without_a_limit_hold_100_and_filters_reach_the_nodes() {
    let (ra, rb) = two_node_records();
    let expected = in_list_order(ra.iter().chain(&rb));
    let running = in_list_order(ra.iter().chain(&rb).filter(|r| r.state == "running"));
    let (a, log_a) = paging_node::paging_node(ra, vec![]).await;
    let (b, _) = paging_node::paging_node(rb, vec![]).await;
    let c = Cluster::two_nodes(&a, &b).await;

    let pages = walk_v2(&c, "").await;
    let sizes: Vec<usize> = pages.iter().map(|(p, _)| p.len()).collect();
    assert_eq!(sizes, [100, 100, 100, 80]);
    let walked: Vec<String> = pages.into_iter().flat_map(|(p, _)| p).collect();
    assert_eq!(walked, expected);

    log_a.lock().clear();
    let pages = walk_v2(&c, "state=running&limit=50").await;
    let walked: Vec<String> = pages.into_iter().flat_map(|(p, _)| p).collect();
    assert_eq!(walked, running);
    assert!(log_a.lock().iter().all(|s| s.uri.contains("state=running")));
}

#[tokio::test]
async fn v1_list_returns_every_running_sandbox_of_every_node() {
    let (ra, rb) = two_node_records();
    let running = in_list_order(ra.iter().chain(&rb).filter(|r| r.state == "running"));
    assert!(running.len() > 300);
    let (a, _) = paging_node::paging_node(ra, vec![]).await;
    let (b, _) = paging_node::paging_node(rb, vec![]).await;
    let c = Cluster::two_nodes(&a, &b).await;
    let (status, headers, body) = get(&c.url("/sandboxes")).await;
    assert_eq!(status, StatusCode::OK);
    assert!(headers.get("x-next-token").is_none());
    assert_eq!(ids(&body), running);
}

#[tokio::test]
async fn v2_pages_oldest_first_walk_every_sandbox_of_both_nodes_once_with_tied_start_times() {
    let (ra, rb) = two_node_records();
    let expected = in_asc_order(ra.iter().chain(&rb));
    assert_eq!(expected.len(), 380);
    let created: HashMap<String, u64> = ra
        .iter()
        .chain(&rb)
        .map(|r| (r.id.clone(), r.created_ms))
        .collect();
    let (a, log_a) = paging_node::paging_node(ra, vec![]).await;
    let (b, log_b) = paging_node::paging_node(rb, vec![]).await;
    let c = Cluster::two_nodes(&a, &b).await;

    for limit in [1usize, 7, 50, 99, 100, 101, 190, 250, 380, 400] {
        log_a.lock().clear();
        log_b.lock().clear();
        let pages = walk_v2(&c, &format!("order=asc&limit={limit}")).await;
        let sizes: Vec<usize> = pages.iter().map(|(p, _)| p.len()).collect();
        assert_eq!(sizes, page_sizes(380, limit), "limit {limit}");
        let (last, full) = pages.split_last().unwrap();
        assert_eq!(last.1, None, "limit {limit}: the last page has no token");
        for (page, token) in full {
            let last_id = page.last().unwrap();
            assert_eq!(
                token.as_deref(),
                Some(paging_node::encode_token(created[last_id], last_id).as_str()),
                "limit {limit}: the token is the cursor of the page's last item"
            );
        }
        let walked: Vec<String> = pages.into_iter().flat_map(|(p, _)| p).collect();
        assert_eq!(walked, expected, "limit {limit}");
        for log in [&log_a, &log_b] {
            for q in asked_queries(log) {
                assert_eq!(q["order"], "asc", "every node is asked oldest first");
                let l: usize = q["limit"].parse().unwrap();
                assert!((1..=100).contains(&l), "a node is asked for {l}");
            }
        }
    }
    // Pages of 50 end inside groups of sandboxes started in the same
    // millisecond on both nodes: the cursor must split them.
    let started = |id: &String| created[id];
    assert!(
        (1..380 / 50).any(|k| started(&expected[k * 50 - 1]) == started(&expected[k * 50])),
        "the data no longer puts a page boundary inside a millisecond"
    );
    assert!(
        expected
            .windows(2)
            .any(|w| started(&w[0]) == started(&w[1]) && w[0][9..13] != w[1][9..13]),
        "the data no longer ties start times across the nodes"
    );

    // A page larger than a node's: its pages are followed, oldest first.
    log_a.lock().clear();
    let (status, headers, body) = get(&c.url("/v2/sandboxes?order=asc&limit=250")).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(ids(&body), expected[..250]);
    let token = headers["x-next-token"].to_str().unwrap().to_string();
    assert_eq!(asked_limits(&log_a), [Some(100), Some(100), Some(50)]);
    assert!(
        asked_queries(&log_a)[1].contains_key("nextToken"),
        "node a's own token is followed"
    );
    // The next page starts right after, in the same order.
    let (status, _, body) = get(&c.url(&format!(
        "/v2/sandboxes?order=asc&limit=250&nextToken={}",
        token.replace('=', "%3D")
    )))
    .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(ids(&body), expected[250..]);
}

#[tokio::test]
async fn order_desc_given_is_the_default_and_the_v1_list_stays_newest_first() {
    let (ra, rb) = two_node_records();
    let running = in_list_order(ra.iter().chain(&rb).filter(|r| r.state == "running"));
    let (a, log_a) = paging_node::paging_node(ra, vec![]).await;
    let (b, log_b) = paging_node::paging_node(rb, vec![]).await;
    let c = Cluster::two_nodes(&a, &b).await;

    let default = walk_v2(&c, "limit=50").await;
    assert!(
        asked_queries(&log_a)
            .iter()
            .all(|q| !q.contains_key("order")),
        "without order the nodes are asked as before"
    );
    for query in [
        "order=desc&limit=50",
        "limit=50&order=desc",
        "order=&limit=50",
    ] {
        log_a.lock().clear();
        let given = walk_v2(&c, query).await;
        assert_eq!(given, default, "{query}: the same pages and tokens");
        let asked = asked_queries(&log_a);
        assert!(!asked.is_empty());
        for q in asked {
            let want = (query != "order=&limit=50").then_some("desc");
            assert_eq!(q.get("order").map(String::as_str), want, "{query}");
        }
    }
    let asc = walk_v2(&c, "order=asc&limit=50").await;
    let mut asc_ids: Vec<String> = asc.into_iter().flat_map(|(p, _)| p).collect();
    let default_ids: Vec<String> = default.into_iter().flat_map(|(p, _)| p).collect();
    asc_ids.sort();
    let mut sorted_default = default_ids.clone();
    sorted_default.sort();
    assert_eq!(asc_ids, sorted_default, "the same sandboxes either way");

    // GET /sandboxes has no order: newest first whatever the query says.
    log_a.lock().clear();
    log_b.lock().clear();
    let (status, _, body) = get(&c.url("/sandboxes?order=asc")).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(ids(&body), running);
    for log in [&log_a, &log_b] {
        assert_eq!(log.lock()[0].uri, "/sandboxes?order=asc");
    }
    let (status, _, body) = get(&c.url("/sandboxes?order=sideways")).await;
    assert_eq!(status, StatusCode::OK, "the v1 list reads no order");
    assert_eq!(ids(&body), running);
}

#[tokio::test]
async fn a_bad_order_is_refused_by_the_gateway_before_any_node_is_asked() {
    let (a, log_a) = paging_node::paging_node(node_records(0, 30, 0, 3), vec![]).await;
    let (b, log_b) = paging_node::paging_node(node_records(1, 30, 0, 3), vec![]).await;
    let c = Cluster::two_nodes(&a, &b).await;
    let token = paging_node::encode_token(BASE_MS, "00000000-0000-4000-8000-000000000000");
    for (query, bad) in [
        ("order=sideways".to_string(), "sideways"),
        ("order=ASC&limit=5".to_string(), "ASC"),
        ("limit=0&order=oldest".to_string(), "oldest"),
        ("order=asc%20".to_string(), "asc "),
        (format!("order=up&nextToken={token}"), "up"),
    ] {
        let (status, headers, body) = get(&c.url(&format!("/v2/sandboxes?{query}"))).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{query}");
        assert_eq!(
            message(&body),
            format!("invalid order {bad:?}: use asc or desc"),
            "{query}"
        );
        assert!(headers.get("x-next-token").is_none());
        assert!(
            log_a.lock().is_empty() && log_b.lock().is_empty(),
            "{query}"
        );
        // The node says the same.
        let (status, _, node_body) = get(&format!("{}/v2/sandboxes?{query}", a.endpoint)).await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        assert_eq!(message(&node_body), message(&body), "{query}");
        log_a.lock().clear();
    }
}

#[tokio::test]
async fn filters_reach_the_nodes_with_their_encoding_intact() {
    let (ra, rb) = two_node_records();
    let all: Vec<_> = ra.iter().chain(&rb).cloned().collect();
    let (a, log_a) = paging_node::paging_node(ra, vec![]).await;
    let (b, log_b) = paging_node::paging_node(rb, vec![]).await;
    let c = Cluster::two_nodes(&a, &b).await;

    // The metadata filter as the SDKs double-encode it.
    let tagged = in_list_order(all.iter().filter(|r| r.metadata == sdk_metadata()));
    assert!(tagged.len() > 50);
    let pages = walk_v2(&c, &format!("{SDK_METADATA}&limit=20")).await;
    let walked: Vec<String> = pages.into_iter().flat_map(|(p, _)| p).collect();
    assert_eq!(walked, tagged);
    for log in [&log_a, &log_b] {
        let seen = log.lock().clone();
        assert!(seen.len() > 1);
        for s in seen {
            let query = s.uri.split_once('?').unwrap().1;
            assert!(
                query.split('&').any(|p| p == SDK_METADATA),
                "the value arrives as the SDK sent it: {query}"
            );
            let pairs = paging_node::query_pairs(query);
            assert_eq!(
                paging_node::metadata_filter(&pairs).unwrap(),
                sdk_metadata()
            );
        }
    }

    // The v1 list forwards the query as it came.
    log_a.lock().clear();
    let (status, _, body) = get(&c.url(&format!("/sandboxes?{SDK_METADATA}"))).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        ids(&body),
        in_list_order(
            all.iter()
                .filter(|r| r.metadata == sdk_metadata() && r.state == "running")
        )
    );
    assert_eq!(log_a.lock()[0].uri, format!("/sandboxes?{SDK_METADATA}"));

    // template, startedAfter (an offset whose `+` must stay encoded), state
    // and metadata, oldest first.
    let after_ms = BASE_MS + 20;
    let want = in_asc_order(all.iter().filter(|r| {
        r.template == "base"
            && r.created_ms > after_ms
            && r.state == "running"
            && r.metadata.get("x").is_some_and(|x| x == "y")
    }));
    assert!(want.len() > 30);
    let filters = "template=base&startedAfter=2026-01-01T01%3A00%3A00.020%2B01%3A00\
                   &state=running&metadata=x%253Dy&order=asc";
    log_a.lock().clear();
    log_b.lock().clear();
    let pages = walk_v2(&c, &format!("{filters}&limit=30")).await;
    let walked: Vec<String> = pages.into_iter().flat_map(|(p, _)| p).collect();
    assert_eq!(walked, want);
    let sent = paging_node::query_pairs(filters);
    assert_eq!(sent["startedAfter"], "2026-01-01T01:00:00.020+01:00");
    for log in [&log_a, &log_b] {
        let asked = asked_queries(log);
        assert!(!asked.is_empty());
        for mut q in asked {
            q.remove("limit");
            q.remove("nextToken");
            assert_eq!(
                q, sent,
                "every filter reaches the node as the client sent it"
            );
        }
    }
}

#[tokio::test]
async fn a_stopped_node_is_left_out_and_named_in_the_missing_nodes_header() {
    let (ra, rb) = two_node_records();
    let only_a = in_list_order(&ra);
    let only_a_running = in_list_order(ra.iter().filter(|r| r.state == "running"));
    let (a, _) = paging_node::paging_node(ra, vec![]).await;
    let (b, _) = paging_node::paging_node(rb, vec![]).await;
    let c = Cluster::two_nodes(&a, &b).await;
    b.stop().await;

    let (status, headers, body) = get(&c.url("/sandboxes")).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(headers[MISSING], "node-b");
    assert_eq!(ids(&body), only_a_running);

    let mut walked = Vec::new();
    let mut token: Option<String> = None;
    let mut requests = 1;
    loop {
        let mut url = "/v2/sandboxes?limit=100".to_string();
        if let Some(t) = &token {
            url.push_str(&format!("&nextToken={t}"));
        }
        let (status, headers, body) = get(&c.url(&url)).await;
        requests += 1;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(headers[MISSING], "node-b");
        walked.extend(ids(&body));
        token = headers
            .get("x-next-token")
            .map(|t| t.to_str().unwrap().to_string());
        if token.is_none() {
            break;
        }
    }
    assert_eq!(walked, only_a);
    let series = r#"agentenv_gateway_cluster_list_missing_nodes_total{node_id="node-b"}"#;
    assert_eq!(
        metric_value(&c.metrics_text(), series),
        Some(f64::from(requests)),
        "{}",
        c.metrics_text()
    );
    assert_eq!(
        metric_value(
            &c.metrics_text(),
            r#"agentenv_gateway_cluster_list_missing_nodes_total{node_id="node-a"}"#
        ),
        None
    );
}

#[tokio::test]
async fn every_node_down_gives_502_naming_them_all() {
    let (a, _) = paging_node::paging_node(node_records(0, 3, 0, 1), vec![]).await;
    let (b, _) = paging_node::paging_node(node_records(1, 3, 0, 1), vec![]).await;
    let c = Cluster::two_nodes(&a, &b).await;
    a.stop().await;
    b.stop().await;
    for path in ["/sandboxes", "/v2/sandboxes", "/v2/sandboxes?limit=5"] {
        let (status, headers, body) = get(&c.url(path)).await;
        assert_eq!(status, StatusCode::BAD_GATEWAY, "{path}");
        assert_eq!(message(&body), "cluster list unavailable");
        assert_eq!(headers[MISSING], "node-a,node-b");
    }
}

#[tokio::test]
async fn a_node_that_does_not_answer_in_time_is_left_out() {
    let (a, _) = paging_node::paging_node(node_records(0, 3, 0, 1), vec![]).await;
    let hanging = FakeNode::hanging().await;
    let opts = GatewayOptions {
        request_timeout: std::time::Duration::from_millis(300),
        ..options()
    };
    let c = Cluster::ready(
        &[("node-a", &a.endpoint), ("node-b", &hanging.endpoint)],
        opts,
    )
    .await;
    let (status, headers, body) = get(&c.url("/v2/sandboxes")).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(headers[MISSING], "node-b");
    assert_eq!(ids(&body).len(), 3);
}

#[tokio::test]
async fn snapshot_list_pages_pass_through_unchanged_past_100() {
    let snapshots: Vec<_> = node_records(0x5, 250, 0, 3)
        .into_iter()
        .map(|r| paging_node::Record {
            state: "running",
            ..r
        })
        .collect();
    let expected = in_list_order(&snapshots);
    let created: std::collections::HashMap<String, u64> = snapshots
        .iter()
        .map(|r| (r.id.clone(), r.created_ms))
        .collect();
    let (node, log) = paging_node::paging_node(vec![], snapshots).await;
    let c = Cluster::ready(&[("node-a", &node.endpoint)], options()).await;
    for (query, sizes) in [("limit=100", vec![100, 100, 50]), ("", vec![100, 100, 50])] {
        log.lock().clear();
        let mut walked = Vec::new();
        let mut got_sizes = Vec::new();
        let mut token: Option<String> = None;
        loop {
            let mut q = query.to_string();
            if let Some(t) = &token {
                if !q.is_empty() {
                    q.push('&');
                }
                q.push_str(&format!("nextToken={}", t.replace('=', "%3D")));
            }
            let url = if q.is_empty() {
                "/snapshots".to_string()
            } else {
                format!("/snapshots?{q}")
            };
            let (status, headers, body) = get(&c.url(&url)).await;
            assert_eq!(status, StatusCode::OK, "{url}");
            assert_eq!(
                log.lock().last().unwrap().uri,
                url,
                "the query reaches the node as sent"
            );
            let page: Vec<String> = json(&body)
                .as_array()
                .unwrap()
                .iter()
                .map(|s| s["snapshotID"].as_str().unwrap().to_string())
                .collect();
            got_sizes.push(page.len());
            walked.extend(page);
            token = headers
                .get("x-next-token")
                .map(|t| t.to_str().unwrap().to_string());
            if let Some(t) = &token {
                let last = walked.last().unwrap();
                assert_eq!(
                    *t,
                    paging_node::encode_token(created[last], last),
                    "the node's token is relayed as the node gave it"
                );
            }
            if token.is_none() {
                break;
            }
        }
        assert_eq!(got_sizes, sizes, "{query:?}");
        assert_eq!(walked, expected, "{query:?}");
    }
}

#[tokio::test]
async fn an_empty_cluster_list_is_502() {
    let c = Cluster::ready(&[], options()).await;
    let (status, _, body) = get(&c.url("/sandboxes")).await;
    assert_eq!(status, StatusCode::BAD_GATEWAY);
    assert_eq!(message(&body), "cluster list unavailable");
}

#[tokio::test]
async fn node_list_filters_by_cluster_and_reports_status() {
    let (a, _) = FakeNode::echo().await;
    let (b, _) = FakeNode::echo().await;
    let c = Cluster::start(
        &[("node-a", &a.endpoint), ("node-b", &b.endpoint)],
        options(),
    )
    .await;
    c.heartbeat_in("node-a", "cluster-1", &["s1", "s2"]).await;
    c.heartbeat_in("node-b", "cluster-2", &[]).await;
    let (status, headers, body) = get(&c.url("/nodes?clusterID=cluster-1")).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(headers["content-type"], "application/json");
    assert!(body.ends_with(b"\n"));
    let v = json(&body);
    let list = v.as_array().unwrap();
    assert_eq!(list.len(), 1);
    assert_eq!(list[0]["id"], "node-a");
    assert_eq!(list[0]["status"], "ready");
    assert_eq!(list[0]["clusterID"], "cluster-1");
    assert_eq!(c.count("ListObservedNodes"), 1);
    let (_, _, body) = get(&c.url("/nodes/")).await;
    assert_eq!(json(&body).as_array().unwrap().len(), 2);
}

#[tokio::test]
async fn node_detail_is_resolved_by_the_scheduler_and_proxied_to_the_node() {
    let (a, log) = FakeNode::echo().await;
    let c = Cluster::start(&[("node-a", &a.endpoint)], options()).await;
    c.heartbeat_in("node-a", "cluster-1", &[]).await;
    let (status, _, body) = get(&c.url("/nodes/node-a?clusterID=cluster-1")).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(json(&body)["uri"], "/nodes/node-a?clusterID=cluster-1");
    assert_eq!(log.lock().len(), 1);
    assert_eq!(c.count("GetNode"), 1);
    let (status, _, body) = get(&c.url("/nodes/node-zz")).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(message(&body), "observed node not found");
}

#[tokio::test]
async fn lookups_use_the_query_only_scheduler_and_records_the_primary_over_grpc() {
    let (node, _) = FakeNode::canned(
        StatusCode::CREATED,
        &[("x-agentenv-sandbox-id", "sbx-new")],
        "{}",
    )
    .await;
    let config = SchedulerConfig {
        nodes: vec![NodeConfig {
            id: "node-a".into(),
            endpoint: node.endpoint.clone(),
        }],
        ..SchedulerConfig::default()
    };
    // The primary and the replica keep separate bindings, so an answer tells
    // which of them was asked.
    let primary = Scheduler::builder(config.clone()).build().unwrap();
    let replica_store = Arc::new(MemoryBindingStore::new(config.binding_ttl));
    let replica = Scheduler::builder(config.clone())
        .query_only(true)
        .binding_store(replica_store.clone())
        .build()
        .unwrap();
    let primary_svc = primary.service();
    primary_svc
        .heartbeat(tonic::Request::new(pb::HeartbeatRequest {
            node_id: "node-a".into(),
            service_instance_id: "i".into(),
            snapshot: Some(pb::NodeSnapshot {
                status: pb::NodeStatus::Ready as i32,
                ..Default::default()
            }),
            ..Default::default()
        }))
        .await
        .unwrap();
    use agentenv_sched::BindingStore;
    replica_store
        .record(
            "sbx-replica",
            &pb::Node {
                node_id: "node-a".into(),
                endpoint: node.endpoint.clone(),
            },
            tokio::time::Instant::now(),
        )
        .await
        .unwrap();

    let serve = |s: Scheduler| async move {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move { s.serve(l, std::future::pending()).await.unwrap() });
        addr
    };
    let primary_addr = serve(primary).await;
    let replica_addr = serve(replica).await;

    let client =
        GrpcSchedulerClient::connect_lazy(&primary_addr.to_string(), &replica_addr.to_string())
            .unwrap();
    let gateway = Gateway::new(client, options()).unwrap();
    let (addr, _stop, _task) = serve_gateway(gateway).await;

    let (status, _, _) = get(&format!("http://{addr}/sandboxes/sbx-replica")).await;
    assert_eq!(
        status,
        StatusCode::CREATED,
        "found only in the replica's bindings"
    );

    let (status, _, _) = send(
        Request::post(format!("http://{addr}/sandboxes"))
            .header("x-api-key", API_KEY)
            .body(Full::from("{}"))
            .unwrap(),
    )
    .await;
    assert_eq!(status, StatusCode::CREATED);
    let recorded = primary_svc
        .lookup_node(tonic::Request::new(pb::LookupNodeRequest {
            sandbox_id: "sbx-new".into(),
        }))
        .await
        .unwrap();
    assert_eq!(
        recorded.into_inner().node.unwrap().node_id,
        "node-a",
        "recorded on the primary"
    );
    // ... and therefore unknown to the replica the gateway looks up with.
    let (status, _, body) = get(&format!("http://{addr}/sandboxes/sbx-new")).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(message(&body), "sandbox assignment not found");
}

#[tokio::test]
async fn a_scheduler_that_is_down_gives_503() {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dead = l.local_addr().unwrap();
    drop(l);
    let client = GrpcSchedulerClient::connect_lazy(&dead.to_string(), "").unwrap();
    let gateway = Gateway::new(client, options()).unwrap();
    let (addr, _stop, _task) = serve_gateway(gateway).await;
    let (status, _, body) = get(&format!("http://{addr}/sandboxes/sbx-1")).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(
        message(&body).starts_with("scheduler unreachable: "),
        "{}",
        message(&body)
    );
    let (status, _, _) = send(Request::get(format!("http://{addr}/health")).empty()).await;
    assert_eq!(
        status,
        StatusCode::NO_CONTENT,
        "health does not depend on the scheduler"
    );
}
