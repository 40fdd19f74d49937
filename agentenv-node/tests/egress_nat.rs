//! Source NAT of sandbox egress with real jail sandboxes, real iptables and fake
//! internets in network namespaces (see `agentenv_testkit::internet`): with `snat` (the
//! default) a sandbox's traffic leaves with the uplink's address, follows an uplink added
//! after the node started and an address changed under it, and no MASQUERADE rule is
//! involved; `masquerade` still works. Node slots 90 and 91, internet slots 90 to 92.

mod node_common;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::process::Command;
use std::time::Duration;

use agentenv_node::host::net::{NatMode, is_sandbox_interface};
use agentenv_testkit::Wait;
use agentenv_testkit::internet::{ECHO_PORT, Internet};
use node_common::{Node, create, rules_common, sh_ok};

/// Connects to `<ip>:8080` with a timeout of `<secs>`: prints `OK <greeting>` or
/// `ERR <exception>`.
const CONNECT: &str = r#"
import socket, sys
try:
    s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3]))
    print("OK", s.recv(100).decode().strip())
except Exception as e:
    print("ERR", type(e).__name__)
"#;

async fn node(home: &std::path::Path, slot: u8, net: &Internet, nat: NatMode) -> Node {
    let mut cfg = node_common::config(home, slot);
    cfg.jail_dns_servers = Some(vec![net.dns()]);
    cfg.net_nat = nat;
    Node::start(cfg).await
}

/// A sandbox with internet access and the connect script.
async fn sandbox(addr: SocketAddr) -> String {
    let id = create(addr, r#"{"templateID":"base"}"#).await;
    sh_ok(
        addr,
        &id,
        &format!("cat > /tmp/c.py <<'PYEOF'\n{CONNECT}\nPYEOF"),
    )
    .await;
    id
}

/// One connection from the sandbox to the echo server at `ip`.
async fn connect(addr: SocketAddr, id: &str, ip: Ipv4Addr, timeout_secs: u32) -> String {
    sh_ok(
        addr,
        id,
        &format!("python3 /tmp/c.py {ip} {ECHO_PORT} {timeout_secs}"),
    )
    .await
}

/// Polls with a deadline until a connection from the sandbox to web-a of `net` succeeds
/// and web-a saw it come from `source`.
async fn wait_egress_from(addr: SocketAddr, id: &str, net: &Internet, source: Ipv4Addr) {
    Wait::new(
        format!("a connection to {} from {source}", net.ip(2)),
        Duration::from_secs(20),
    )
    .every(Duration::from_millis(100))
    .until(|| async {
        let r = connect(addr, id, net.ip(2), 1).await;
        let peer = net.last_peer("web-a");
        if r == "OK hello web-a" && peer == Some(IpAddr::V4(source)) {
            Ok(())
        } else {
            Err(format!("{r}, web-a's last peer {peer:?}"))
        }
    })
    .await;
}

/// The rules of the node's NAT chain (`-A AGENTENV-<PREFIX>-NAT …`).
fn nat_rules(prefix: &str) -> Vec<String> {
    let chain = format!("AGENTENV-{}-NAT", prefix.to_ascii_uppercase());
    rules_common::chain_lines(prefix)
        .into_iter()
        .filter(|l| l.starts_with(&format!("-A {chain} ")))
        .collect()
}

/// Every rule of the host's nat table that names `pool`.
fn nat_table_lines_of(pool: &str) -> Vec<String> {
    let out = Command::new("iptables-save")
        .args(["-t", "nat"])
        .output()
        .expect("iptables-save");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.contains(pool))
        .map(str::to_string)
        .collect()
}

fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().expect("ip");
    assert!(
        out.status.success(),
        "ip {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sandbox_egress_is_snated_to_the_uplink_address_and_follows_new_uplinks_and_addresses() {
    require_node!();
    let slot = 90;
    let net = Internet::start(90);
    let home = tempfile::tempdir().unwrap();
    let node = node(home.path(), slot, &net, NatMode::Snat).await;
    let prefix = node_common::iface_prefix(slot);
    let pool = node_common::address_pool(slot);

    // One SNAT rule per uplink, to its address; no MASQUERADE for the pool anywhere.
    let rules = nat_rules(&prefix);
    let want = format!(
        "-s {pool} -o {} -j SNAT --to-source {}",
        net.host_if(),
        net.ip(1)
    );
    assert!(
        rules.iter().any(|r| r.ends_with(&want)),
        "{want:?} missing: {rules:#?}"
    );
    let of_pool = nat_table_lines_of(&pool);
    assert!(
        of_pool.iter().all(|l| !l.contains("MASQUERADE")),
        "{of_pool:#?}"
    );

    let id = sandbox(node.addr).await;
    assert_eq!(
        connect(node.addr, &id, net.ip(2), 10).await,
        "OK hello web-a"
    );
    assert_eq!(
        net.last_peer("web-a"),
        Some(IpAddr::V4(net.ip(1))),
        "the peer sees the host's address"
    );

    // An uplink that comes after the node started carries egress within seconds.
    let late = Internet::start(91);
    wait_egress_from(node.addr, &id, &late, late.ip(1)).await;

    // So does its new address when it changes.
    let moved = Ipv4Addr::new(198, 18, 91, 9);
    ip(&[
        "addr",
        "del",
        &format!("{}/24", late.ip(1)),
        "dev",
        &late.host_if(),
    ]);
    ip(&[
        "addr",
        "add",
        &format!("{moved}/24"),
        "dev",
        &late.host_if(),
    ]);
    wait_egress_from(node.addr, &id, &late, moved).await;

    // Nothing of a sandbox is an uplink: the addresses come from the host's namespace
    // only, and the sandboxes' own interfaces (this node's and others') are left out.
    let rules = nat_rules(&prefix);
    let pool_net: agentenv_node::host::net::Ipv4Net = pool.parse().unwrap();
    for r in rules.iter().filter(|r| r.contains(&format!("-s {pool} "))) {
        let words: Vec<&str> = r.split_whitespace().collect();
        let after = |flag: &str| {
            words
                .iter()
                .position(|w| *w == flag)
                .map(|i| words[i + 1])
                .unwrap_or_else(|| panic!("{flag} missing in {r}"))
        };
        assert!(!is_sandbox_interface(after("-o")), "{r}");
        let to: Ipv4Addr = after("--to-source").parse().unwrap();
        assert!(!pool_net.contains(to), "{r}");
    }
    node.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_masquerade_setting_still_masquerades_sandbox_egress() {
    require_node!();
    let slot = 91;
    let net = Internet::start(92);
    let home = tempfile::tempdir().unwrap();
    let node = node(home.path(), slot, &net, NatMode::Masquerade).await;
    let prefix = node_common::iface_prefix(slot);
    let pool = node_common::address_pool(slot);
    assert_eq!(
        nat_rules(&prefix),
        vec![format!(
            "-A AGENTENV-{}-NAT -s {pool} ! -o {prefix}+ -j MASQUERADE",
            prefix.to_ascii_uppercase()
        )]
    );
    let id = sandbox(node.addr).await;
    assert_eq!(
        connect(node.addr, &id, net.ip(2), 10).await,
        "OK hello web-a"
    );
    assert_eq!(net.last_peer("web-a"), Some(IpAddr::V4(net.ip(1))));
    node.stop().await;
}
