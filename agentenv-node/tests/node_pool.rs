//! Pools of started sandboxes on a real node (jail backend): a create claims a pooled
//! sandbox and personalises it (environment, metadata, its own token), a pooled sandbox
//! is handed out once only and never again after its delete, creates a pool cannot serve
//! start a sandbox as always, `/nodes` reports pooled sandboxes apart, a template rebuild
//! drains the old build's pool, and memory pressure shrinks the pools before anything
//! else.

mod node_common;

use std::collections::{BTreeSet, HashSet};
use std::path::Path;
use std::time::Duration;

use agentenv_node::config::NodeConfig;
use agentenv_node::lifecycle::PoolSettings;
use node_common::{Node, api, create, delete, run, sh_ok};

/// Longest wait for a pool to reach a size (a deadline, not a measurement).
const FILL: Duration = Duration::from_secs(60);

fn pool_config(home: &Path, slot: u8, templates: &[(&str, usize)], max: usize) -> NodeConfig {
    let mut c = node_common::config(home, slot);
    c.pool = PoolSettings {
        templates: templates.iter().map(|(t, n)| (t.to_string(), *n)).collect(),
        max_per_template: max,
        // Far below what the host has: no pressure unless a test makes it.
        memory_reserve_mb: Some(0),
        ..PoolSettings::default()
    };
    c
}

/// Waits until `template`'s pool on `node` holds `n` sandboxes.
async fn wait_pool(node: &Node, template: &str, n: usize) {
    let deadline = tokio::time::Instant::now() + FILL;
    loop {
        let have = node.orch.pool_sizes().get(template).copied().unwrap_or(0);
        if have == n {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "pool of {template} holds {have}, not {n}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Sandbox directories of the node (pooled, running and being cleaned up).
fn sandbox_dirs(cfg_home: &Path) -> BTreeSet<String> {
    std::fs::read_dir(cfg_home.join("jail").join("sandboxes"))
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// The started sandboxes waiting in the node's pools: directories of sandboxes it does
/// not list, once deleted ones are cleaned up.
async fn pooled_ids(node: &Node, home: &Path) -> BTreeSet<String> {
    assert!(
        node.orch.drain_cleanups(FILL).await,
        "cleanups did not drain"
    );
    let shown: HashSet<String> = node.orch.list().into_iter().map(|r| r.id).collect();
    sandbox_dirs(home)
        .into_iter()
        .filter(|id| !shown.contains(id))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_create_claims_a_pooled_sandbox_once_and_personalises_it() {
    require_node!();
    let home = tempfile::tempdir().unwrap();
    let node = Node::start(pool_config(home.path(), 74, &[("base", 2)], 2)).await;
    let addr = node.addr;
    wait_pool(&node, "base", 2).await;
    let before = pooled_ids(&node, home.path()).await;
    assert_eq!(before.len(), 2, "{before:?}");

    // GET /nodes reports the pooled sandboxes apart from the running ones.
    let r = api(addr, "GET", "/nodes", "").await;
    assert_eq!(r.status, 200, "{}", r.text());
    let n = &r.json()[0];
    assert_eq!(n["sandboxCount"], 0, "{n}");
    assert_eq!(n["sandboxPooledCount"], 2, "{n}");
    assert_eq!(n["metrics"]["pooledAllocatedCPU"], 2, "{n}");
    assert_eq!(
        n["metrics"]["pooledAllocatedMemoryBytes"],
        2u64 * 256 * 1024 * 1024,
        "{n}"
    );
    assert_eq!(n["metrics"]["allocatedCPU"], 0, "{n}");

    // The create is served by the pool and personalised.
    let id = create(
        addr,
        r#"{"templateID":"base","timeout":120,"envVars":{"GREETING":"hello-pool"},"metadata":{"owner":"t74"}}"#,
    )
    .await;
    assert!(
        before.contains(&id),
        "{id} was not one of the pooled {before:?}"
    );
    let got = api(addr, "GET", &format!("/sandboxes/{id}"), "")
        .await
        .json();
    assert_eq!(got["metadata"]["owner"], "t74", "{got}");
    assert_eq!(got["state"], "running", "{got}");
    let out = sh_ok(addr, &id, "echo $GREETING; hostname; cat /etc/hostname").await;
    assert_eq!(out, format!("hello-pool\n{id}\n{id}"));
    // Its agent takes this sandbox's token only.
    assert!(run(addr, &id, Some("not-the-token"), "true").await.is_err());
    // Nobody ran anything there before the claim: the marker is new.
    sh_ok(addr, &id, "test ! -e /root/claimed && touch /root/claimed").await;
    // The tenant cannot reach a pooled sandbox's agent (it has no token yet: whoever
    // could reach it could take the sandbox the next create is given).
    wait_pool(&node, "base", 2).await;
    let probe_own = "timeout 2 bash -c 'echo > /dev/tcp/127.0.0.1/49983' 2>/dev/null && echo reached || echo refused";
    assert_eq!(
        sh_ok(addr, &id, probe_own).await,
        "reached",
        "the probe itself works"
    );
    for (pooled, at) in node.orch.pooled() {
        let probe = format!(
            "timeout 2 bash -c 'echo > /dev/tcp/{}/{}' 2>/dev/null && echo reached || echo refused",
            at.ip, at.agent_port
        );
        assert_eq!(
            sh_ok(addr, &id, &probe).await,
            "refused",
            "a tenant reached pooled sandbox {pooled}'s agent at {at:?}"
        );
    }

    // More creates than the pool holds: every one a sandbox of its own, none seen twice.
    let mut ids = vec![id.clone()];
    for _ in 0..5 {
        let id = create(addr, r#"{"templateID":"base","timeout":120}"#).await;
        sh_ok(addr, &id, "test ! -e /root/claimed && touch /root/claimed").await;
        ids.push(id);
    }
    let distinct: HashSet<&String> = ids.iter().collect();
    assert_eq!(distinct.len(), ids.len(), "{ids:?}");

    // A deleted sandbox never comes back from the pool.
    for id in &ids {
        assert_eq!(delete(addr, id).await.status, 204);
    }
    wait_pool(&node, "base", 2).await;
    let after = pooled_ids(&node, home.path()).await;
    for id in &ids {
        assert!(
            !after.contains(id),
            "deleted {id} is pooled again: {after:?}"
        );
    }
    for _ in 0..4 {
        let id = create(addr, r#"{"templateID":"base","timeout":120}"#).await;
        assert!(!ids.contains(&id), "{id} handed out twice");
        sh_ok(addr, &id, "test ! -e /root/claimed").await;
        ids.push(id);
    }

    // Creates a pool cannot serve start a sandbox as always and leave the pool alone.
    wait_pool(&node, "base", 2).await;
    let pooled = pooled_ids(&node, home.path()).await;
    for body in [
        r#"{"templateID":"base","timeout":120,"allow_internet_access":false}"#,
        r#"{"templateID":"base","timeout":120,"memoryMB":320}"#,
    ] {
        let id = create(addr, body).await;
        assert!(!pooled.contains(&id), "{body} was served by the pool");
        assert_eq!(node.orch.pool_sizes()["base"], 2);
    }
    let metrics = api(addr, "GET", "/metrics", "").await.text();
    assert!(metrics.contains("agentenv_pool_sandboxes 2"), "{metrics}");
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("agentenv_pool_events_total{event=\"claim\"}")),
        "{metrics}"
    );
    node.stop().await;
    // Shutdown destroys the pooled sandboxes with everything else.
    let left = sandbox_dirs(home.path());
    assert!(
        pooled.iter().all(|id| !left.contains(id)),
        "pooled sandboxes left after shutdown: {left:?}"
    );
}

/// Builds template `name` from `base` with a file saying `version`; waits for it.
/// Returns the template's id.
async fn build_version(addr: std::net::SocketAddr, name: &str, version: &str) -> String {
    let body = serde_json::json!({
        "fromTemplate": "base",
        "steps": [{"type": "RUN", "args": [format!("echo {version} > /etc/pool-version")], "force": false}],
    });
    let v = node_common::build_template(addr, name, &body).await;
    assert_eq!(v["status"], "ready", "{v}");
    v["templateID"].as_str().unwrap().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_template_rebuild_drains_the_old_builds_pool() {
    require_node!();
    let home = tempfile::tempdir().unwrap();
    node_common::ensure_base().await;
    let mut cfg = pool_config(home.path(), 75, &[("pooltpl", 2)], 2);
    cfg.template_path = agentenv_testkit::node::templates_with_base(&home.path().join("templates"));
    let node = Node::start(cfg).await;
    let addr = node.addr;
    let template_id = build_version(addr, "pooltpl", "v1").await;
    assert_ne!(template_id, "pooltpl");
    wait_pool(&node, "pooltpl", 2).await;
    let old = pooled_ids(&node, home.path()).await;
    assert_eq!(old.len(), 2, "{old:?}");
    let id = create(addr, r#"{"templateID":"pooltpl","timeout":120}"#).await;
    assert!(old.contains(&id), "the create was not served by the pool");
    assert_eq!(sh_ok(addr, &id, "cat /etc/pool-version").await, "v1");
    // Named by its id instead of its name, the template is served by the same pool.
    let by_id = create(
        addr,
        &format!(r#"{{"templateID":"{template_id}","timeout":120}}"#),
    )
    .await;
    assert!(
        old.contains(&by_id),
        "a create naming the template by its id was not served by its pool"
    );
    assert_eq!(sh_ok(addr, &by_id, "cat /etc/pool-version").await, "v1");
    wait_pool(&node, "pooltpl", 2).await;
    let v1_pooled = pooled_ids(&node, home.path()).await;
    let v1_pooled: BTreeSet<String> = v1_pooled
        .into_iter()
        .filter(|p| *p != id && *p != by_id)
        .collect();

    build_version(addr, "pooltpl", "v2").await;
    // Every create from now on gets the new build, pooled or not.
    for _ in 0..3 {
        let id = create(addr, r#"{"templateID":"pooltpl","timeout":120}"#).await;
        assert!(
            !v1_pooled.contains(&id),
            "{id} of the old build's pool was handed out"
        );
        assert_eq!(sh_ok(addr, &id, "cat /etc/pool-version").await, "v2");
    }
    // The old build's pooled sandboxes are destroyed; the pool refills from the new build.
    let deadline = tokio::time::Instant::now() + FILL;
    loop {
        let left: Vec<String> = sandbox_dirs(home.path())
            .intersection(&v1_pooled)
            .cloned()
            .collect();
        if left.is_empty() {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "old build's pooled sandboxes still there: {left:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    wait_pool(&node, "pooltpl", 2).await;
    let id = create(addr, r#"{"templateID":"pooltpl","timeout":120}"#).await;
    assert_eq!(sh_ok(addr, &id, "cat /etc/pool-version").await, "v2");
    let metrics = api(addr, "GET", "/metrics", "").await.text();
    let drained: u64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("agentenv_pool_events_total{event=\"drain\"} "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    assert!(drained >= 1, "{metrics}");
    node.stop().await;
}

/// The host's available memory in MiB.
fn mem_available_mb() -> u64 {
    let m = std::fs::read_to_string("/proc/meminfo").unwrap();
    m.lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap()
        / 1024
}

/// Memory the test process holds (every page touched) until dropped.
fn hold_memory(mb: usize) -> Vec<u8> {
    let mut v = vec![0u8; mb << 20];
    for i in (0..v.len()).step_by(4096) {
        v[i] = 1;
    }
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_pressure_shrinks_the_pool_before_touching_running_sandboxes() {
    require_node!();
    let home = tempfile::tempdir().unwrap();
    let mut cfg = pool_config(home.path(), 76, &[("base", 3)], 3);
    // The reserve sits 1.5 GiB below what is available now; the test then takes 3 GiB.
    let reserve = mem_available_mb().saturating_sub(1536);
    cfg.pool.memory_reserve_mb = Some(reserve);
    let node = Node::start(cfg).await;
    let addr = node.addr;
    let running = create(addr, r#"{"templateID":"base","timeout":300}"#).await;
    sh_ok(addr, &running, "echo busy > /root/work").await;
    wait_pool(&node, "base", 3).await;

    let held = hold_memory(3072);
    assert!(
        mem_available_mb() < reserve,
        "holding 3 GiB did not bring available memory below the reserve"
    );
    wait_pool(&node, "base", 0).await;
    // The running sandbox was not touched.
    assert_eq!(sh_ok(addr, &running, "cat /root/work").await, "busy");
    let usage = node.orch.pool_usage();
    assert!(usage.shrunk >= 3, "{usage:?}");
    // Nothing is started while memory is short.
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(node.orch.pool_usage().pooled, 0);
    assert_eq!(node.orch.pool_usage().starting, 0);

    drop(held);
    wait_pool(&node, "base", 3).await;
    assert_eq!(sh_ok(addr, &running, "cat /root/work").await, "busy");
    node.stop().await;
}
