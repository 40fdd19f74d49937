//! A delete answers once the sandbox is dead and gone from the node's lists; its jail
//! resources (cgroup, layer mount, namespace and veth, address, id range, directory) are
//! given back by the backend's cleanup queue, never to a new sandbox before that, and a
//! node that stops with cleanups pending leaves nothing behind after its next start.

mod node_common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use agentenv_node::config::NodeConfig;
use agentenv_node::host::ids::IdPool;
use agentenv_node::host::net::{AddressPool, Slot};
use node_common::{Node, api, create, delete, sh_ok};

/// Longest wait for the cleanup queue to drain (a deadline, not a measurement).
const DRAIN: Duration = Duration::from_secs(60);

fn sandbox_dir(cfg: &NodeConfig, id: &str) -> PathBuf {
    cfg.home.join("jail").join("sandboxes").join(id)
}

/// The cgroup directories named `id` under the test node's cgroup parent, in every
/// mounted hierarchy.
fn cgroup_dirs(cfg: &NodeConfig, id: &str) -> Vec<PathBuf> {
    fn walk(dir: &Path, depth: usize, parent: &str, id: &str, out: &mut Vec<PathBuf>) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for e in entries.flatten() {
            let p = e.path();
            if !e.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                continue;
            }
            if e.file_name() == id && p.to_string_lossy().contains(parent) {
                out.push(p);
            } else if depth > 0 {
                walk(&p, depth - 1, parent, id, out);
            }
        }
    }
    let mut out = Vec::new();
    walk(
        Path::new("/sys/fs/cgroup"),
        8,
        &cfg.jail_cgroup_parent,
        id,
        &mut out,
    );
    out
}

/// Host pids of the processes in sandbox `id`'s cgroup.
fn host_pids(cfg: &NodeConfig, id: &str) -> Vec<i32> {
    let mut pids: Vec<i32> = cgroup_dirs(cfg, id)
        .iter()
        .filter_map(|d| std::fs::read_to_string(d.join("cgroup.procs")).ok())
        .flat_map(|s| {
            s.lines()
                .filter_map(|l| l.trim().parse().ok())
                .collect::<Vec<i32>>()
        })
        .collect();
    pids.sort();
    pids.dedup();
    pids
}

/// Whether host process `pid` belongs to sandbox `id`'s cgroup and may still run: it is
/// neither exiting nor a zombie, and no SIGKILL is pending for it.
fn runs_in_sandbox(pid: i32, id: &str) -> bool {
    let member = std::fs::read_to_string(format!("/proc/{pid}/cgroup"))
        .map(|s| s.lines().any(|l| l.ends_with(&format!("/{id}"))))
        .unwrap_or(false);
    member && agentenv_testkit::node::runs_on(pid)
}

fn address_pool(cfg: &NodeConfig) -> AddressPool {
    AddressPool::new(cfg.jail_address_pool.parse().unwrap(), &cfg.runtime_path).unwrap()
}

/// The address reservation held by directory `dir`.
fn address_of(cfg: &NodeConfig, dir: &Path) -> Option<Slot> {
    address_pool(cfg)
        .reservations()
        .into_iter()
        .find(|(_, owner)| owner == dir)
        .map(|(s, _)| s)
}

/// Whether an id range is reserved for directory `dir`.
fn holds_ids(cfg: &NodeConfig, dir: &Path) -> bool {
    IdPool::new(cfg.jail_id_pool, &cfg.runtime_path)
        .unwrap()
        .reservations()
        .iter()
        .any(|(_, owner)| owner == dir)
}

/// Whether anything is mounted at or under `dir`.
fn has_mounts(dir: &Path) -> bool {
    let dir = dir.to_string_lossy().into_owned();
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap()
        .lines()
        .any(|l| l.split(' ').nth(4).is_some_and(|m| m.starts_with(&dir)))
}

/// Whether a host interface of address `slot` exists.
fn has_link(cfg: &NodeConfig, slot: Slot) -> bool {
    [true, false].into_iter().any(|internet| {
        Path::new("/sys/class/net")
            .join(slot.host_ifname(&cfg.jail_iface_prefix, internet))
            .exists()
    })
}

/// What is left of sandbox `id` (its address was `slot`) on the host; empty when nothing.
fn leftovers(cfg: &NodeConfig, id: &str, slot: Slot) -> Vec<String> {
    let dir = sandbox_dir(cfg, id);
    let mut left = Vec::new();
    if dir.exists() {
        left.push(format!("directory {}", dir.display()));
    }
    if has_mounts(&dir) {
        left.push("a mount under its directory".into());
    }
    let cgroups = cgroup_dirs(cfg, id);
    if !cgroups.is_empty() {
        left.push(format!("cgroups {cgroups:?}"));
    }
    if address_of(cfg, &dir).is_some() {
        left.push(format!("address {}", slot.sandbox_ip()));
    }
    // An address given back may be another sandbox's (or a pooled namespace's) now.
    let reused = address_pool(cfg)
        .reservations()
        .iter()
        .any(|(s, owner)| *s == slot && owner != &dir);
    if has_link(cfg, slot) && !reused {
        left.push(format!("host interface of {}", slot.sandbox_ip()));
    }
    if holds_ids(cfg, &dir) {
        left.push("id range".into());
    }
    left
}

/// Starts, in sandbox `id`, a tree of seven shells that ignore SIGTERM, and waits until
/// the host sees them; their host pids.
async fn start_tree(addr: std::net::SocketAddr, cfg: &NodeConfig, id: &str) -> Vec<i32> {
    let script = r#"cat > /tmp/tree.sh <<'EOF'
trap '' TERM
d=${1:-0}
if [ "$d" -lt 2 ]; then
  for i in 1 2; do sh /tmp/tree.sh $((d+1)) & done
fi
while :; do sleep 1; done
EOF
nohup sh /tmp/tree.sh 0 </dev/null >/dev/null 2>&1 &
echo started"#;
    assert_eq!(sh_ok(addr, id, script).await, "started");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let shells = sh_ok(
            addr,
            id,
            "cat /proc/[0-9]*/comm 2>/dev/null | grep -c '^sh$' || true",
        )
        .await;
        if shells.parse::<u32>().unwrap_or(0) >= 7 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the process tree did not start: {shells} shells"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    host_pids(cfg, id)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleted_sandbox_with_a_sigterm_ignoring_process_tree_is_gone_at_once_and_cleaned_once_the_queue_drains()
 {
    require_node!();
    let home = tempfile::tempdir().unwrap();
    let cfg = node_common::config(home.path(), 63);
    let node = Node::start(cfg.clone()).await;
    let addr = node.addr;
    let id = create(addr, r#"{"templateID":"base"}"#).await;
    let dir = sandbox_dir(&cfg, &id);
    let slot = address_of(&cfg, &dir).expect("the sandbox holds an address");
    assert!(has_link(&cfg, slot) && has_mounts(&dir) && holds_ids(&cfg, &dir));
    let pids = start_tree(addr, &cfg, &id).await;
    assert!(pids.len() >= 8, "the tree and the agent run: {pids:?}");

    let r = delete(addr, &id).await;
    assert_eq!(r.status, 204, "{}", r.text());
    // At once: killed (none runs again; the kernel may still be ending them), unknown,
    // unlisted.
    let alive: Vec<i32> = pids
        .iter()
        .copied()
        .filter(|p| runs_in_sandbox(*p, &id))
        .collect();
    assert!(alive.is_empty(), "processes outlived the delete: {alive:?}");
    assert_eq!(
        api(addr, "GET", &format!("/sandboxes/{id}"), "")
            .await
            .status,
        404
    );
    let listed = api(addr, "GET", "/v2/sandboxes", "").await.json();
    assert!(
        !listed.to_string().contains(&id),
        "a deleted sandbox is listed: {listed}"
    );
    assert_eq!(delete(addr, &id).await.status, 404);

    assert!(
        node.orch.drain_cleanups(DRAIN).await,
        "the cleanup queue drains"
    );
    let left = leftovers(&cfg, &id, slot);
    assert!(left.is_empty(), "left behind: {left:?}");
    let stats = node.orch.cleanups();
    assert_eq!((stats.pending, stats.failures), (0, 0), "{stats:?}");
    let metrics = api(addr, "GET", "/metrics", "").await.text();
    assert!(
        metrics.contains("agentenv_sandbox_cleanups_pending 0"),
        "the gauge of pending cleanups is shown"
    );
    node.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn creates_right_after_many_deletes_get_fresh_resources_and_keep_them_when_the_cleanups_finish()
 {
    require_node!();
    let home = tempfile::tempdir().unwrap();
    let mut cfg = node_common::config(home.path(), 64);
    // Four addresses and no pooled namespaces: every new sandbox takes the address of a
    // deleted one, which it may have only once that one's cleanup finished.
    cfg.jail_address_pool = cfg.jail_address_pool.replace("/26", "/28");
    cfg.jail_net_pool_size = 0;
    let node = Node::start(cfg.clone()).await;
    let addr = node.addr;
    let mut deleted: Vec<(String, Slot)> = Vec::new();
    for round in 0..3 {
        // Right after the previous round's deletes answered.
        let ids: Vec<String> =
            futures::future::join_all((0..4).map(|_| create(addr, r#"{"templateID":"base"}"#)))
                .await;
        let mut mine: Vec<(String, Slot)> = Vec::new();
        for id in &ids {
            let slot = address_of(&cfg, &sandbox_dir(&cfg, id))
                .unwrap_or_else(|| panic!("round {round}: {id} holds no address"));
            assert!(
                mine.iter().all(|(_, s)| *s != slot),
                "round {round}: two sandboxes share {}",
                slot.sandbox_ip()
            );
            mine.push((id.clone(), slot));
        }
        // The cleanups of the sandboxes deleted before take nothing the new ones hold.
        assert!(
            node.orch.drain_cleanups(DRAIN).await,
            "the cleanup queue drains"
        );
        for (id, slot) in &mine {
            assert_eq!(
                sh_ok(addr, id, "echo alive").await,
                "alive",
                "round {round}"
            );
            assert!(
                has_link(&cfg, *slot),
                "round {round}: {id} has its interface"
            );
            assert_eq!(
                address_of(&cfg, &sandbox_dir(&cfg, id)),
                Some(*slot),
                "round {round}: {id} keeps its address"
            );
            assert!(
                has_mounts(&sandbox_dir(&cfg, id)),
                "round {round}: {id} keeps its layer"
            );
        }
        let deletes = futures::future::join_all(ids.iter().map(|id| delete(addr, id))).await;
        assert!(deletes.iter().all(|r| r.status == 204), "{deletes:?}");
        deleted.extend(mine);
    }
    assert!(
        node.orch.drain_cleanups(DRAIN).await,
        "the cleanup queue drains"
    );
    for (id, slot) in &deleted {
        let left = leftovers(&cfg, id, *slot);
        assert!(left.is_empty(), "{id} left behind: {left:?}");
    }
    node.stop().await;
}

/// The node runs on a runtime of its own, dropped at once after the deletes answer (as a
/// crash would end it); the next node on the same directories cleans up at start.
#[test]
fn a_node_stopped_with_cleanups_pending_leaves_nothing_behind_after_its_next_start() {
    require_node!();
    let home = tempfile::tempdir().unwrap();
    let cfg = node_common::config(home.path(), 65);
    let runtime = || {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap()
    };
    let first = runtime();
    let deleted: Vec<(String, Slot)> = first.block_on(async {
        let node = Node::start(cfg.clone()).await;
        let addr = node.addr;
        let ids: Vec<String> =
            futures::future::join_all((0..3).map(|_| create(addr, r#"{"templateID":"base"}"#)))
                .await;
        let slots: Vec<Slot> = ids
            .iter()
            .map(|id| address_of(&cfg, &sandbox_dir(&cfg, id)).unwrap())
            .collect();
        let deletes = futures::future::join_all(ids.iter().map(|id| delete(addr, id))).await;
        assert!(deletes.iter().all(|r| r.status == 204), "{deletes:?}");
        assert!(
            node.orch.cleanups().pending > 0,
            "the cleanups are still under way when the node goes"
        );
        std::mem::forget(node);
        ids.into_iter().zip(slots).collect()
    });
    first.shutdown_background();
    let left: Vec<Vec<String>> = deleted
        .iter()
        .map(|(id, slot)| leftovers(&cfg, id, *slot))
        .collect();
    assert!(
        left.iter().any(|l| !l.is_empty()),
        "the stopped node left its cleanups undone"
    );

    let second = runtime();
    second.block_on(async {
        let node = Node::start(cfg.clone()).await;
        for (id, slot) in &deleted {
            let left = leftovers(&cfg, id, *slot);
            assert!(
                left.is_empty(),
                "{id} left behind after the restart: {left:?}"
            );
        }
        // The node works on the addresses it got back.
        let id = create(node.addr, r#"{"templateID":"base"}"#).await;
        assert_eq!(sh_ok(node.addr, &id, "echo alive").await, "alive");
        assert_eq!(delete(node.addr, &id).await.status, 204);
        node.stop().await;
    });
}

/// Two id ranges for the node of test slot `slot`, above the default pool (which ends at
/// 2,000,000,000), so no other test node takes them.
fn two_id_ranges(slot: u8) -> agentenv_node::host::ids::IdPoolRange {
    let first = 3_000_000_000u32 + u32::from(slot) * 4 * agentenv_node::host::ids::IDS_PER_SANDBOX;
    format!("{first}:{}", 2 * agentenv_node::host::ids::IDS_PER_SANDBOX)
        .parse()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn creates_right_after_deletes_wait_for_the_id_ranges_being_cleaned_up_and_fail_only_when_none_is()
 {
    require_node!();
    let home = tempfile::tempdir().unwrap();
    let mut cfg = node_common::config(home.path(), 66);
    // Two id ranges and plenty of addresses: ids run out first.
    cfg.jail_id_pool = two_id_ranges(66);
    let node = Node::start(cfg.clone()).await;
    let addr = node.addr;
    let first: Vec<String> =
        futures::future::join_all((0..2).map(|_| create(addr, r#"{"templateID":"base"}"#))).await;
    // Every range is taken and no cleanup is pending: a create fails at once, naming
    // the setting.
    let r = api(addr, "POST", "/v2/sandboxes", r#"{"templateID":"base"}"#).await;
    assert_eq!(r.status, 503, "{}", r.text());
    assert!(r.text().contains("AENV_JAIL_ID_POOL"), "{}", r.text());

    let deletes = futures::future::join_all(first.iter().map(|id| delete(addr, id))).await;
    assert!(deletes.iter().all(|r| r.status == 204), "{deletes:?}");
    let pending = node.orch.cleanups().pending;
    assert!(
        pending > 0,
        "the cleanups are still under way when the creates are sent"
    );
    // Right after the deletes answered: the ranges come back as their cleanups finish,
    // and the creates wait for them instead of failing.
    let second: Vec<String> =
        futures::future::join_all((0..2).map(|_| create(addr, r#"{"templateID":"base"}"#))).await;
    for id in &second {
        assert_eq!(sh_ok(addr, id, "echo alive").await, "alive");
        assert!(
            holds_ids(&cfg, &sandbox_dir(&cfg, id)),
            "{id} holds a range"
        );
    }
    let deletes = futures::future::join_all(second.iter().map(|id| delete(addr, id))).await;
    assert!(deletes.iter().all(|r| r.status == 204), "{deletes:?}");
    assert!(
        node.orch.drain_cleanups(DRAIN).await,
        "the cleanup queue drains"
    );
    for id in first.iter().chain(&second) {
        assert!(
            !holds_ids(&cfg, &sandbox_dir(&cfg, id)),
            "{id} kept its range"
        );
    }
    node.stop().await;
}
