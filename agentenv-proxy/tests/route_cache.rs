//! The routes the gateway keeps (`route_cache_ttl`): requests of a sandbox whose route
//! is kept do not ask the scheduler, a create keeps the route it recorded, a delete
//! forgets it, and a node that answers that it lost the sandbox makes the next request
//! ask again — on both lanes (hyper's and the fast lane).

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bytes::Bytes;
use common::*;
use http::{Request, Response, StatusCode};
use http_body_util::Full;

fn kept(ttl: Duration) -> agentenv_proxy::GatewayOptions {
    agentenv_proxy::GatewayOptions {
        route_cache_ttl: ttl,
        ..options()
    }
}

/// A data-plane request for `sandbox`; `slow` sends a header the fast lane leaves to
/// hyper (`TE`), so the request takes the other lane.
fn data_plane(c: &Cluster, sandbox: &str, slow: bool) -> Request<Full<Bytes>> {
    let mut b = Request::get(c.url("/files?path=/etc/hostname")).e2b_route(sandbox, "49983");
    if slow {
        b = b.header("te", "trailers");
    }
    b.empty()
}

fn route_cache_counter(c: &Cluster, result: &str) -> f64 {
    metric_value(
        &c.metrics_text(),
        &format!("agentenv_gateway_route_cache_lookups_total{{result=\"{result}\"}}"),
    )
    .unwrap_or(0.0)
}

#[tokio::test]
async fn kept_routes_spare_the_scheduler_a_lookup_per_request_on_both_lanes() {
    let (node, log) = FakeNode::echo().await;
    let c = Cluster::with_sandbox(&node.endpoint, kept(Duration::from_secs(60))).await;
    for slow in [false, true, false, true, false, true] {
        let (status, _, _) = send(data_plane(&c, "sbx-1", slow)).await;
        assert_eq!(status, StatusCode::OK);
    }
    assert_eq!(log.lock().len(), 6, "every request reached the node");
    assert_eq!(c.count("LookupNode"), 1, "only the first request asked");
    assert_eq!(route_cache_counter(&c, "hit"), 5.0);
    assert_eq!(route_cache_counter(&c, "miss"), 1.0);

    // Without kept routes every request asks.
    let c = Cluster::with_sandbox(&node.endpoint, kept(Duration::ZERO)).await;
    for slow in [false, true, false] {
        let (status, _, _) = send(data_plane(&c, "sbx-1", slow)).await;
        assert_eq!(status, StatusCode::OK);
    }
    assert_eq!(c.count("LookupNode"), 3);
    assert_eq!(route_cache_counter(&c, "hit"), 0.0);
}

#[tokio::test]
async fn a_route_expires_after_its_ttl() {
    let (node, _) = FakeNode::echo().await;
    let c = Cluster::with_sandbox(&node.endpoint, kept(Duration::from_millis(200))).await;
    send(data_plane(&c, "sbx-1", false)).await;
    send(data_plane(&c, "sbx-1", false)).await;
    assert_eq!(c.count("LookupNode"), 1);
    tokio::time::sleep(Duration::from_millis(300)).await;
    send(data_plane(&c, "sbx-1", false)).await;
    assert_eq!(c.count("LookupNode"), 2, "an expired route is asked again");
}

#[tokio::test]
async fn a_create_keeps_the_route_it_recorded() {
    let (node, _) = FakeNode::logging(|seen| {
        if seen.method == "POST" {
            let mut r = Response::new(agentenv_proxy::body::full(
                r#"{"sandboxID":"sbx-new","clientID":"c"}"#,
            ));
            *r.status_mut() = StatusCode::CREATED;
            r
        } else {
            Response::new(agentenv_proxy::body::full("ok"))
        }
    })
    .await;
    let c = Cluster::ready(&[("node-a", &node.endpoint)], kept(Duration::from_secs(60))).await;
    let create = Request::post(c.url("/sandboxes"))
        .header("x-api-key", API_KEY)
        .header("content-type", "application/json")
        .body(Full::from(r#"{"templateID":"base"}"#))
        .unwrap();
    let (status, _, _) = send(create).await;
    assert_eq!(status, StatusCode::CREATED);
    eventually("the create is recorded", || {
        c.count("RecordAssignment") == 1
    })
    .await;
    for slow in [false, true] {
        let (status, _, body) = send(data_plane(&c, "sbx-new", slow)).await;
        assert_eq!(status, StatusCode::OK, "{body:?}");
    }
    assert_eq!(c.count("LookupNode"), 0, "the create's route was kept");
}

#[tokio::test]
async fn a_delete_through_the_gateway_forgets_the_route() {
    for slow in [false, true] {
        let (node, _) = FakeNode::echo().await;
        let c = Cluster::with_sandbox(&node.endpoint, kept(Duration::from_secs(60))).await;
        send(data_plane(&c, "sbx-1", slow)).await;
        let mut delete = Request::delete(c.url("/sandboxes/sbx-1")).header("x-api-key", API_KEY);
        if slow {
            delete = delete.header("te", "trailers");
        }
        let (status, _, _) = send(delete.empty()).await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(c.count("LookupNode"), 1, "the delete used the kept route");
        send(data_plane(&c, "sbx-1", slow)).await;
        assert_eq!(
            c.count("LookupNode"),
            2,
            "after the delete the scheduler is asked again (slow lane: {slow})"
        );
    }
}

#[tokio::test]
async fn a_node_that_lost_the_sandbox_makes_the_next_request_ask_again() {
    for slow in [false, true] {
        // node-a holds sbx-m until it moves; then it answers as a node does for a
        // sandbox it does not have.
        let holds = Arc::new(AtomicBool::new(true));
        let h = holds.clone();
        let (node_a, log_a) = FakeNode::logging(move |_| {
            if h.load(Ordering::SeqCst) {
                Response::new(agentenv_proxy::body::full("from a"))
            } else {
                let mut r = Response::new(agentenv_proxy::body::full(
                    r#"{"code":502,"message":"The sandbox sbx-m was not found"}"#,
                ));
                *r.status_mut() = StatusCode::BAD_GATEWAY;
                r
            }
        })
        .await;
        let (node_b, log_b) = FakeNode::echo().await;
        let c = Cluster::ready(
            &[("node-a", &node_a.endpoint), ("node-b", &node_b.endpoint)],
            kept(Duration::from_secs(60)),
        )
        .await;
        c.heartbeat("node-a", &["sbx-m"]).await;
        assert_eq!(send(data_plane(&c, "sbx-m", slow)).await.0, StatusCode::OK);

        // The sandbox moves to node-b behind this gateway's back.
        holds.store(false, Ordering::SeqCst);
        c.heartbeat("node-a", &[]).await;
        c.heartbeat("node-b", &["sbx-m"]).await;
        assert_eq!(c.lookup("sbx-m").await.unwrap().node_id, "node-b");

        // The kept route still names node-a, which says it lost the sandbox...
        let (status, _, _) = send(data_plane(&c, "sbx-m", slow)).await;
        assert_eq!(status, StatusCode::BAD_GATEWAY);
        assert_eq!(log_a.lock().len(), 2);
        // ...so the next request asks the scheduler and reaches node-b.
        let (status, _, _) = send(data_plane(&c, "sbx-m", slow)).await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(log_b.lock().len(), 1, "slow lane: {slow}");
        assert_eq!(c.count("LookupNode"), 2);
    }
}

#[tokio::test]
async fn a_node_that_cannot_be_reached_makes_the_next_request_ask_again() {
    for slow in [false, true] {
        // An address nothing listens on: connections are refused.
        let refused = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            format!("http://{}", l.local_addr().unwrap())
        };
        let c = Cluster::with_sandbox(&refused, kept(Duration::from_secs(60))).await;
        for n in 1..=2 {
            let (status, _, _) = send(data_plane(&c, "sbx-1", slow)).await;
            assert!(status.is_server_error(), "{status}");
            assert_eq!(c.count("LookupNode"), n, "slow lane: {slow}");
        }
    }
}

#[tokio::test]
async fn unknown_ids_are_never_kept_so_a_client_spraying_them_grows_nothing() {
    let (node, log) = FakeNode::echo().await;
    let c = Cluster::with_sandbox(&node.endpoint, kept(Duration::from_secs(60))).await;
    for (n, slow) in (1..=20).zip([false, true].into_iter().cycle()) {
        let id = format!("sbx-made-up-{n}");
        let (status, _, _) = send(data_plane(&c, &id, slow)).await;
        assert_eq!(status, StatusCode::NOT_FOUND, "{id}");
    }
    // Asked again, a made-up id is asked of the scheduler again (nothing was kept).
    send(data_plane(&c, "sbx-made-up-1", false)).await;
    assert_eq!(c.count("LookupNode"), 21);
    assert!(log.lock().is_empty(), "no made-up id reached the node");
    assert_eq!(route_cache_counter(&c, "hit"), 0.0);
    // The real sandbox's route is kept as before.
    send(data_plane(&c, "sbx-1", false)).await;
    send(data_plane(&c, "sbx-1", true)).await;
    assert_eq!(c.count("LookupNode"), 22);
}
