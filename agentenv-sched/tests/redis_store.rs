//! The Redis binding store against a real `redis-server`: the key layout and
//! value format other schedulers share, read back with raw commands, what it
//! leaves alone, and how it behaves when Redis goes away and comes back.

mod support;

use agentenv_core::proto::scheduler_v1::Node;
use agentenv_sched::{BindingStore, RedisBindingStore};
use agentenv_testkit::eventually;
use agentenv_testkit::redis::RedisServer;
use support::node;
use tokio::time::{Duration, Instant};

const TTL: Duration = Duration::from_secs(30);
const SANDBOX: &str = "agentenv:scheduler:bindings:sandbox:";
const NODE: &str = "agentenv:scheduler:bindings:node:";

fn ids(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

async fn setup() -> (RedisServer, RedisBindingStore) {
    let server = RedisServer::start();
    let store = RedisBindingStore::connect(&server.addr(), TTL)
        .await
        .unwrap();
    (server, store)
}

fn cmd(server: &RedisServer, args: &[&str]) -> String {
    server.command(args).unwrap()
}

/// Every key, sorted.
fn keys(server: &RedisServer) -> Vec<String> {
    let mut k: Vec<String> = cmd(server, &["KEYS", "*"])
        .lines()
        .map(str::to_string)
        .collect();
    k.sort();
    k
}

fn members(server: &RedisServer, node_id: &str) -> Vec<String> {
    let mut m: Vec<String> = cmd(server, &["SMEMBERS", &format!("{NODE}{node_id}")])
        .lines()
        .map(str::to_string)
        .collect();
    m.sort();
    m
}

#[tokio::test]
async fn a_binding_is_the_shared_json_with_positive_ttls_on_both_keys() {
    let (server, store) = setup().await;
    let now = Instant::now();
    store
        .record(
            " sbx-1 ",
            &Node {
                node_id: " node-a ".into(),
                endpoint: " http://node-a:8000 ".into(),
            },
            now,
        )
        .await
        .unwrap();
    assert_eq!(
        cmd(&server, &["GET", &format!("{SANDBOX}sbx-1")]),
        r#"{"node":{"node_id":"node-a","endpoint":"http://node-a:8000"}}"#,
        "trimmed id, node id and endpoint"
    );
    assert_eq!(members(&server, "node-a"), ["sbx-1"]);
    let pttl: i64 = cmd(&server, &["PTTL", &format!("{SANDBOX}sbx-1")])
        .parse()
        .unwrap();
    assert!(pttl > 0 && pttl <= 30_000, "binding PTTL {pttl}");
    let set_pttl: i64 = cmd(&server, &["PTTL", &format!("{NODE}node-a")])
        .parse()
        .unwrap();
    assert!(
        set_pttl > 30_000 && set_pttl <= 3_600_000,
        "node set PTTL {set_pttl}"
    );

    store
        .reconcile_node(&node("node-b"), &ids(&["sbx-2"]), now)
        .await
        .unwrap();
    assert_eq!(
        cmd(&server, &["GET", &format!("{SANDBOX}sbx-2")]),
        r#"{"node":{"node_id":"node-b","endpoint":"http://node-b:8000"}}"#
    );
    let pttl: i64 = cmd(&server, &["PTTL", &format!("{SANDBOX}sbx-2")])
        .parse()
        .unwrap();
    assert!(pttl > 0 && pttl <= 30_000, "reconciled binding PTTL {pttl}");
    let set_pttl: i64 = cmd(&server, &["PTTL", &format!("{NODE}node-b")])
        .parse()
        .unwrap();
    assert!(set_pttl > 30_000, "reconciled node set PTTL {set_pttl}");
}

#[tokio::test]
async fn a_binding_written_by_another_scheduler_is_read_and_get_trims() {
    let (server, store) = setup().await;
    cmd(
        &server,
        &[
            "SET",
            &format!("{SANDBOX}sbx-go"),
            r#"{"node":{"node_id":"node-a","endpoint":"http://10.0.0.1:8000"}}"#,
            "PX",
            "30000",
        ],
    );
    let found = store.get("  sbx-go ", Instant::now()).await.unwrap();
    assert_eq!(
        found,
        Some(Node {
            node_id: "node-a".into(),
            endpoint: "http://10.0.0.1:8000".into()
        })
    );
    assert_eq!(store.get("   ", Instant::now()).await.unwrap(), None);
}

#[tokio::test]
async fn malformed_records_are_misses_left_in_place() {
    let (server, store) = setup().await;
    let bad = [
        ("junk", "not json"),
        ("no-node", r#"{"other":1}"#),
        (
            "blank-id",
            r#"{"node":{"node_id":"","endpoint":"http://x:1"}}"#,
        ),
        (
            "blank-endpoint",
            r#"{"node":{"node_id":"a","endpoint":""}}"#,
        ),
        ("wrong-type", r#"{"node":"a"}"#),
    ];
    for (id, value) in bad {
        cmd(&server, &["SET", &format!("{SANDBOX}{id}"), value]);
    }
    for (id, value) in bad {
        assert_eq!(store.get(id, Instant::now()).await.unwrap(), None, "{id}");
        assert_eq!(
            cmd(&server, &["GET", &format!("{SANDBOX}{id}")]),
            value,
            "{id} left in place"
        );
    }
    // A record over a malformed one replaces it; reconciling over one too.
    store
        .record("junk", &node("a"), Instant::now())
        .await
        .unwrap();
    store
        .reconcile_node(&node("b"), &ids(&["wrong-type"]), Instant::now())
        .await
        .unwrap();
    assert_eq!(
        store
            .get("junk", Instant::now())
            .await
            .unwrap()
            .map(|n| n.node_id),
        Some("a".into())
    );
    assert_eq!(
        store
            .get("wrong-type", Instant::now())
            .await
            .unwrap()
            .map(|n| n.node_id),
        Some("b".into())
    );
}

#[tokio::test]
async fn blank_nodes_endpoints_and_ids_write_no_keys() {
    let (server, store) = setup().await;
    let now = Instant::now();
    let blank_endpoint = Node {
        node_id: "a".into(),
        endpoint: "  ".into(),
    };
    let blank_id = Node {
        node_id: " ".into(),
        endpoint: "http://a:8000".into(),
    };
    store.record("s", &blank_endpoint, now).await.unwrap();
    store.record("s", &blank_id, now).await.unwrap();
    store.record("  ", &node("a"), now).await.unwrap();
    store
        .reconcile_node(&blank_endpoint, &ids(&["s1", "s2"]), now)
        .await
        .unwrap();
    store
        .reconcile_node(&blank_id, &ids(&["s1"]), now)
        .await
        .unwrap();
    store
        .reconcile_node(&node("a"), &ids(&["", "  "]), now)
        .await
        .unwrap();
    store.forget_node(" ").await.unwrap();
    assert_eq!(keys(&server), Vec::<String>::new());
}

#[tokio::test]
async fn moves_update_both_node_sets_and_an_empty_roster_deletes_the_set() {
    let (server, store) = setup().await;
    let now = Instant::now();
    store
        .reconcile_node(&node("a"), &ids(&["s1", "s2"]), now)
        .await
        .unwrap();
    store.record("s1", &node("b"), now).await.unwrap();
    assert_eq!(members(&server, "a"), ["s2"]);
    assert_eq!(members(&server, "b"), ["s1"]);
    store
        .reconcile_node(&node("a"), &ids(&["s1", "s2"]), now)
        .await
        .unwrap();
    assert_eq!(members(&server, "a"), ["s1", "s2"]);
    assert_eq!(members(&server, "b"), Vec::<String>::new());
    store.reconcile_node(&node("a"), &[], now).await.unwrap();
    assert_eq!(
        cmd(&server, &["EXISTS", &format!("{NODE}a")]),
        "0",
        "an empty roster deletes the node's set"
    );
    // Only the keys of the layout are left (no binding, no empty set); the
    // pending set of b expires with the binding TTL.
    assert!(
        keys(&server)
            .iter()
            .all(|k| k == "agentenv:scheduler:pending:node:b"),
        "{:?}",
        keys(&server)
    );
}

#[tokio::test]
async fn a_big_roster_is_reconciled_in_one_call() {
    let (server, store) = setup().await;
    let roster: Vec<String> = (0..2500).map(|i| format!("s{i}")).collect();
    store
        .reconcile_node(&node("a"), &roster, Instant::now())
        .await
        .unwrap();
    assert_eq!(cmd(&server, &["SCARD", &format!("{NODE}a")]), "2500");
    assert_eq!(
        store
            .get("s2499", Instant::now())
            .await
            .unwrap()
            .map(|n| n.node_id),
        Some("a".into())
    );
    store
        .reconcile_node(&node("a"), &roster[..10], Instant::now())
        .await
        .unwrap();
    assert_eq!(cmd(&server, &["SCARD", &format!("{NODE}a")]), "10");
    // Ten bindings, the node's set, and when its bindings were last rewritten.
    assert_eq!(cmd(&server, &["DBSIZE"]), "12");
}

#[tokio::test]
async fn a_roster_soon_after_the_last_rewrites_only_new_ids_unless_the_node_changed() {
    let (server, store) = setup().await;
    let ids = |r: std::ops::Range<u32>| r.map(|i| format!("s{i}")).collect::<Vec<_>>();
    store
        .reconcile_node(&node("a"), &ids(0..3), Instant::now())
        .await
        .unwrap();
    // Shorten one binding's TTL by hand: a rewrite would restore it.
    cmd(&server, &["PEXPIRE", &format!("{SANDBOX}s0"), "5000"]);
    store
        .reconcile_node(&node("a"), &ids(0..4), Instant::now())
        .await
        .unwrap();
    let pttl = |id: &str| -> i64 {
        cmd(&server, &["PTTL", &format!("{SANDBOX}{id}")])
            .parse()
            .unwrap()
    };
    assert!(
        pttl("s0") <= 5000,
        "listed again within a third of the TTL: not rewritten"
    );
    assert!(pttl("s3") > 25_000, "a new id is written at once");
    // The node's endpoint changed: every binding is rewritten with it.
    let moved = Node {
        node_id: "a".into(),
        endpoint: "http://a-new:8000".into(),
    };
    store
        .reconcile_node(&moved, &ids(0..4), Instant::now())
        .await
        .unwrap();
    assert!(pttl("s0") > 25_000);
    assert_eq!(
        store
            .get("s0", Instant::now())
            .await
            .unwrap()
            .map(|n| n.endpoint),
        Some("http://a-new:8000".into())
    );
    // Once the mark is gone (a third of the TTL later), a roster rewrites them all.
    cmd(&server, &["PEXPIRE", &format!("{SANDBOX}s1"), "5000"]);
    cmd(&server, &["DEL", "agentenv:scheduler:pending:refreshed:a"]);
    store
        .reconcile_node(&moved, &ids(0..4), Instant::now())
        .await
        .unwrap();
    assert!(pttl("s1") > 25_000);
    let mark: i64 = cmd(&server, &["PTTL", "agentenv:scheduler:pending:refreshed:a"])
        .parse()
        .unwrap();
    assert!(
        mark > 0 && mark <= 10_000,
        "the mark lives a third of the TTL: {mark}"
    );
    // An empty roster drops the mark with the bindings.
    store
        .reconcile_node(&moved, &[], Instant::now())
        .await
        .unwrap();
    assert_eq!(cmd(&server, &["DBSIZE"]), "0");
}

#[tokio::test]
async fn two_stores_on_one_redis_see_the_same_bindings() {
    let (server, primary) = setup().await;
    let replica = RedisBindingStore::connect(&server.url(), TTL)
        .await
        .unwrap();
    primary
        .record("sbx", &node("a"), Instant::now())
        .await
        .unwrap();
    assert_eq!(
        replica.get("sbx", Instant::now()).await.unwrap(),
        Some(node("a"))
    );
}

#[tokio::test]
async fn connecting_to_nothing_fails_naming_the_address() {
    let port = agentenv_testkit::free_port();
    let err = RedisBindingStore::connect(&format!("127.0.0.1:{port}"), TTL)
        .await
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains(&format!("127.0.0.1:{port}")), "{err}");
    let err = RedisBindingStore::connect(&format!("redis://:secret@127.0.0.1:{port}/0"), TTL)
        .await
        .err()
        .unwrap()
        .to_string();
    assert!(!err.contains("secret"), "{err}");
    let err = RedisBindingStore::connect("localhost", TTL)
        .await
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("host:port"), "{err}");
}

#[tokio::test]
async fn operations_fail_while_redis_is_down_and_work_again_after_it_returns() {
    let (mut server, store) = setup().await;
    store
        .record("before", &node("a"), Instant::now())
        .await
        .unwrap();
    server.kill();
    let err = store.get("before", Instant::now()).await.unwrap_err();
    assert!(err.to_string().starts_with("binding store unavailable"));
    assert!(
        store
            .record("during", &node("a"), Instant::now())
            .await
            .is_err()
    );
    assert!(
        store
            .reconcile_node(&node("a"), &ids(&["x"]), Instant::now())
            .await
            .is_err()
    );
    server.restart();
    // The scripts are gone with the old server's memory; they are loaded again.
    eventually("the store to record again", Duration::from_secs(20), || {
        let store = store.clone();
        async move {
            store
                .record("after", &node("a"), Instant::now())
                .await
                .map_err(|e| e.to_string())
        }
    })
    .await;
    store
        .reconcile_node(&node("a"), &ids(&["after", "more"]), Instant::now())
        .await
        .unwrap();
    assert_eq!(
        store.get("more", Instant::now()).await.unwrap(),
        Some(node("a"))
    );
    assert_eq!(
        store.get("before", Instant::now()).await.unwrap(),
        None,
        "the old server's data is gone"
    );
}

#[tokio::test]
async fn the_password_and_database_of_a_url_are_used() {
    let server = RedisServer::start_with_password("s3cret-pw");
    let url = format!("redis://:s3cret-pw@127.0.0.1:{}/3", server.port());
    let store = RedisBindingStore::connect(&url, TTL).await.unwrap();
    store
        .record("sbx", &node("a"), Instant::now())
        .await
        .unwrap();
    assert_eq!(
        server
            .command_in_db(3, &["EXISTS", &format!("{SANDBOX}sbx")])
            .unwrap(),
        "1",
        "written to database 3"
    );
    assert_eq!(
        server.command(&["DBSIZE"]).unwrap(),
        "0",
        "not to database 0"
    );
    assert_eq!(
        store.get("sbx", Instant::now()).await.unwrap(),
        Some(node("a"))
    );
}

#[tokio::test]
async fn a_missing_or_wrong_password_fails_at_connect_without_printing_it() {
    let server = RedisServer::start_with_password("s3cret-pw");
    for addr in [
        server.addr(),
        format!("redis://:wrong-pw@127.0.0.1:{}/0", server.port()),
    ] {
        let err = RedisBindingStore::connect(&addr, TTL)
            .await
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains(&format!("127.0.0.1:{}", server.port())),
            "{err}"
        );
        assert!(!err.contains("wrong-pw"), "{err}");
    }
}
