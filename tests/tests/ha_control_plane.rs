//! A control plane that survives its own failures, with real processes on loopback: a
//! `redis-server`, a primary scheduler keeping bindings there, query-only replicas, gateways
//! and one `agentenv-node` with real sandboxes. The primary is killed with SIGKILL and
//! restarted on its address, replicas and Redis are killed, and requests through the
//! gateways show what keeps working.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use agentenv_testkit::eventually_blocking;
use agentenv_testkit::redis::RedisServer;
use agentenv_tests::control_plane::{
    ClientLoop, config, kill_hard, start_gateway, start_scheduler, write_config,
};
use agentenv_tests::{
    API_KEY, NodeProc, Proc, api, envd_token, free_port, http, skip_reason, start_node,
    wait_observed,
};

/// Redis, a primary scheduler on a fixed address keeping bindings there, and one node
/// reporting to it. (Fields drop in this order: the node first, so it can still
/// unregister.)
struct Ha {
    _node: NodeProc,
    primary: Proc,
    primary_addr: String,
    primary_config: PathBuf,
    config: serde_json::Value,
    redis: RedisServer,
    dir: tempfile::TempDir,
}

impl Ha {
    fn start(idx: u8) -> Ha {
        let redis = RedisServer::start();
        let dir = tempfile::tempdir().unwrap();
        let id = format!("node-{idx}");
        let node_addr = SocketAddr::from(([127, 0, 0, 1], free_port()));
        let mut config = config(&[(id.clone(), node_addr)]);
        config["scheduler"]["redis_addr"] = redis.addr().into();
        let mut primary = config.clone();
        primary["scheduler"]["grpc_listen_addr"] = format!("127.0.0.1:{}", free_port()).into();
        let primary_config = write_config(dir.path(), "primary", &primary);
        let (primary, primary_addr) = start_scheduler("primary", &primary_config, &[]);
        let node = start_node(
            idx,
            &id,
            node_addr,
            tempfile::tempdir().unwrap(),
            Some(&primary_addr),
        );
        wait_observed(&primary_addr, &[id]);
        Ha {
            _node: node,
            primary,
            primary_addr,
            primary_config,
            config,
            redis,
            dir,
        }
    }

    /// A query-only scheduler on the same Redis.
    fn replica(&self, name: &str) -> (Proc, String) {
        let path = write_config(self.dir.path(), name, &self.config);
        start_scheduler(name, &path, &["-query-only"])
    }

    /// A gateway sending everything to the primary, and lookups to `replica` if given.
    fn gateway(&self, name: &str, replica: Option<&str>) -> (Proc, SocketAddr) {
        let mut c = self.config.clone();
        c["gateway"]["scheduler_addr"] = self.primary_addr.clone().into();
        c["gateway"]["query_only_scheduler_addr"] = replica.unwrap_or_default().into();
        // Every request asks the schedulers: these tests check what they know (the
        // bindings in Redis, the replicas' answers), which kept routes would answer for
        // them.
        c["gateway"]["route_cache_ttl"] = "0s".into();
        start_gateway(name, &write_config(self.dir.path(), name, &c))
    }

    /// The primary started again on its address after a kill.
    fn restart_primary(&mut self) {
        let (proc, addr) = start_scheduler("primary", &self.primary_config, &[]);
        assert_eq!(addr, self.primary_addr);
        self.primary = proc;
    }
}

fn create(gw: SocketAddr) -> (u16, serde_json::Value) {
    api(gw, "POST", "/v2/sandboxes", r#"{"templateID":"base"}"#)
}

fn create_ok(gw: SocketAddr) -> String {
    let (st, v) = create(gw);
    assert_eq!(st, 201, "{v}");
    v["sandboxID"].as_str().unwrap().to_string()
}

/// A data-plane call: the sandbox's `/etc/hostname` (its id) through its agent.
fn hostname(gw: SocketAddr, id: &str) -> (u16, String) {
    let (st, _, body) = http(
        gw,
        "GET",
        "/files?path=/etc/hostname",
        &[
            ("e2b-sandbox-id", id),
            ("e2b-sandbox-port", "49983"),
            ("x-access-token", &envd_token(id)),
        ],
        "",
    );
    (st, body.trim().to_string())
}

/// A path-routed control-plane call: `GET /sandboxes/{id}`.
fn info(gw: SocketAddr, id: &str) -> (u16, String) {
    let (st, _, body) = http(
        gw,
        "GET",
        &format!("/sandboxes/{id}"),
        &[("x-api-key", API_KEY)],
        "",
    );
    (st, body)
}

/// A client loop alternating a data-plane call and `GET /sandboxes/{id}`.
fn load(gw: SocketAddr, id: &str) -> ClientLoop {
    let id = id.to_string();
    let n = AtomicUsize::new(0);
    ClientLoop::start(move || {
        if n.fetch_add(1, Ordering::Relaxed) % 2 == 0 {
            hostname(gw, &id)
        } else {
            info(gw, &id)
        }
    })
}

fn message(body: &str) -> String {
    serde_json::from_str::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v["message"].as_str().map(str::to_string))
        .unwrap_or_else(|| body.to_string())
}

fn statuses(answers: &[(u16, String)]) -> Vec<u16> {
    answers.iter().map(|(st, _)| *st).collect()
}

#[test]
fn a_primary_killed_and_restarted_under_load_loses_no_binding() {
    if let Some(r) = skip_reason() {
        eprintln!("SKIPPED: {r}");
        return;
    }
    let mut ha = Ha::start(28);
    let (_replica, replica_addr) = ha.replica("replica");
    let (_gw_primary, via_primary) = ha.gateway("gateway-primary", None);
    let (_gw_replica, via_replica) = ha.gateway("gateway-replica", Some(&replica_addr));
    let id = create_ok(via_primary);
    assert_eq!(hostname(via_replica, &id), (200, id.clone()));

    let (a, b) = (load(via_primary, &id), load(via_replica, &id));
    a.wait_for_more(0, 10);
    b.wait_for_more(0, 10);
    kill_hard(&mut ha.primary);
    let (a_down, b_down) = (a.count(), b.count());
    a.wait_for_more(a_down, 10);
    b.wait_for_more(b_down, 10);
    ha.restart_primary();
    let (a_up, b_up) = (a.count(), b.count());
    // The gateway reconnects to the restarted primary; then every answer is a 200.
    eventually_blocking(
        "the gateway on the primary to answer 200 again",
        Duration::from_secs(60),
        || {
            a.since(a_up)
                .iter()
                .rev()
                .take(10)
                .all(|(st, _)| *st == 200)
                && a.count() >= a_up + 10
        },
    );
    b.wait_for_more(b_up, 10);
    let (a, b) = (a.finish(), b.finish());

    for (gw, answers) in [("via the primary", &a), ("via the replica", &b)] {
        assert!(
            answers.iter().all(|(st, _)| *st != 404),
            "{gw}: a binding was lost: {:?}",
            answers.iter().find(|(st, _)| *st == 404)
        );
    }
    assert!(
        b.iter().all(|(st, _)| *st == 200),
        "with the replica up, nothing fails: {:?}",
        statuses(&b)
    );
    // 503 while the primary cannot be reached; 502 for a call cut by the kill.
    assert!(
        a.iter().all(|(st, _)| [200, 502, 503].contains(st)),
        "without a scheduler the gateway answers 503: {:?}",
        statuses(&a)
    );
    assert!(
        a[a_down..a_up].iter().any(|(st, _)| *st == 503),
        "the gateway on the primary noticed the outage: {:?}",
        statuses(&a[a_down..a_up])
    );
}

#[test]
fn with_two_replicas_a_dead_primary_keeps_routing_and_refuses_creates_with_503() {
    if let Some(r) = skip_reason() {
        eprintln!("SKIPPED: {r}");
        return;
    }
    let mut ha = Ha::start(26);
    let (mut replica_1, replica_1_addr) = ha.replica("replica-1");
    let (_replica_2, replica_2_addr) = ha.replica("replica-2");
    let (_g1, gw1) = ha.gateway("gateway-1", Some(&replica_1_addr));
    let (_g2, gw2) = ha.gateway("gateway-2", Some(&replica_2_addr));
    let running = create_ok(gw1);
    let paused = create_ok(gw2);
    let (st, v) = api(gw1, "POST", &format!("/sandboxes/{paused}/pause"), "");
    assert_eq!(st, 204, "{v}");

    kill_hard(&mut ha.primary);
    for gw in [gw1, gw2] {
        assert_eq!(hostname(gw, &running), (200, running.clone()));
        assert_eq!(info(gw, &running).0, 200);
        let (st, body) = info(gw, &paused);
        assert_eq!(st, 200, "{body}");
    }
    // Pause and resume of existing sandboxes are routed by their ids.
    let (st, v) = api(gw1, "POST", &format!("/sandboxes/{running}/pause"), "");
    assert_eq!(st, 204, "{v}");
    let (st, v) = api(gw2, "POST", &format!("/sandboxes/{running}/resume"), "{}");
    assert_eq!(st, 201, "{v}");
    assert_eq!(hostname(gw1, &running), (200, running.clone()));
    let (st, v) = api(gw1, "POST", &format!("/sandboxes/{paused}/resume"), "{}");
    assert_eq!(st, 201, "{v}");
    assert_eq!(hostname(gw2, &paused), (200, paused.clone()));

    // Placement needs the primary: a clear 503 naming it.
    for gw in [gw1, gw2] {
        let (st, v) = create(gw);
        assert_eq!(st, 503, "{v}");
        let msg = v["message"].as_str().unwrap_or_default();
        assert!(
            msg.starts_with("scheduler unreachable: ") && msg.contains(&ha.primary_addr),
            "{msg}"
        );
    }

    ha.restart_primary();
    let fresh = eventually_blocking(
        "creates to work again once the primary is back",
        Duration::from_secs(120),
        || {
            let (st, v) = create(gw1);
            if st == 201 {
                Ok(v["sandboxID"].as_str().unwrap_or_default().to_string())
            } else {
                Err(format!("{st} {v}"))
            }
        },
    );

    // A dead replica: its gateway's lookups go to the primary.
    kill_hard(&mut replica_1);
    for id in [&running, &paused, &fresh] {
        assert_eq!(hostname(gw1, id), (200, id.clone()));
        assert_eq!(info(gw1, id).0, 200);
    }
    for id in [&running, &paused, &fresh] {
        let (st, _) = api(gw2, "DELETE", &format!("/sandboxes/{id}"), "");
        assert_eq!(st, 204);
    }
}

#[test]
fn redis_killed_mid_run_gives_503_binding_store_unavailable_for_unknown_ids_and_the_scheduler_recovers()
 {
    if let Some(r) = skip_reason() {
        eprintln!("SKIPPED: {r}");
        return;
    }
    let mut ha = Ha::start(27);
    let (_g, gw) = ha.gateway("gateway", None);
    let id = create_ok(gw);
    assert_eq!(hostname(gw, &id), (200, id.clone()));

    ha.redis.kill();
    // The primary routes the sandboxes it bound from its copy in memory ...
    assert_eq!(hostname(gw, &id), (200, id.clone()));
    // ... and cannot tell whether any other id exists.
    let unknown = "i0000000000000000000";
    for (st, body) in [hostname(gw, unknown), info(gw, unknown)] {
        assert_eq!(st, 503, "{body}");
        assert_eq!(message(&body), "binding store unavailable");
    }
    // Placement does not need Redis: the create succeeds; its binding reaches the
    // primary's memory, not Redis.
    let during = create_ok(gw);
    assert_eq!(hostname(gw, &during), (200, during.clone()));

    // An empty Redis on the same port: the same scheduler process reconnects, and the
    // node's next roster binds the sandbox again.
    let pid = ha.primary.pid();
    ha.redis.restart();
    eventually_blocking(
        "the sandbox to be routed again",
        Duration::from_secs(90),
        || {
            let answer = hostname(gw, &id);
            (answer == (200, id.clone())).then_some(()).ok_or(answer.0)
        },
    );
    let fresh = create_ok(gw);
    assert_eq!(hostname(gw, &fresh), (200, fresh.clone()));
    eventually_blocking(
        "the sandbox created during the outage to be routed by its roster",
        Duration::from_secs(30),
        || hostname(gw, &during) == (200, during.clone()),
    );
    assert_eq!(ha.primary.pid(), pid, "the scheduler was not restarted");
    for id in [&id, &fresh, &during] {
        let (st, _) = api(gw, "DELETE", &format!("/sandboxes/{id}"), "");
        assert_eq!(st, 204);
    }
}
