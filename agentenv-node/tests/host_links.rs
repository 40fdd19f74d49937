//! The host end of a sandbox's veth pair, with real namespaces and netlink: it carries no
//! IPv6 (no link-local address to remove at delete) and a pooled one is renamed while it
//! stays up. Either would otherwise make the kernel's masquerade notifier walk the whole
//! conntrack table once more per sandbox (see the README, "Where a sustained cycle's CPU
//! goes").

use agentenv_node::host::net;
use agentenv_testkit::host_rules as rules_common;

fn skip_reason() -> Option<String> {
    if !nix::unistd::Uid::effective().is_root() {
        return Some("veth pairs and network namespaces need root".into());
    }
    None
}

fn sys(path: String) -> String {
    std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{path}: {e}"))
        .trim()
        .to_string()
}

#[tokio::test]
async fn a_pooled_host_link_has_no_ipv6_and_is_renamed_without_going_down() {
    if let Some(r) = skip_reason() {
        eprintln!("SKIPPED: {r}");
        return;
    }
    let (conn, host, _) = rtnetlink::new_connection().unwrap();
    tokio::spawn(conn);
    let prefix = rules_common::process_prefix('r');
    let slot = net::Slot {
        network: "10.16.2.4".parse().unwrap(),
    };
    // Named as the namespace pool names its links, then renamed to the policy's name.
    let pooled = format!("{prefix}p{:08x}", u32::from(slot.network));
    let (mut sandbox, ns) = net::create_sandbox_net_with_netlink(&host, slot, pooled.clone())
        .await
        .unwrap();
    if std::path::Path::new("/proc/sys/net/ipv6").exists() {
        assert_eq!(
            sys(format!("/proc/sys/net/ipv6/conf/{pooled}/disable_ipv6")),
            "1"
        );
    }
    let carrier = |name: &str| sys(format!("/sys/class/net/{name}/carrier_changes"));
    let before = carrier(&pooled);
    let name = slot.host_ifname(&prefix, true);
    net::rename_host_link(&host, &ns, &mut sandbox, name.clone())
        .await
        .unwrap();
    assert_eq!(sandbox.host_if, name);
    assert_eq!(
        carrier(&name),
        before,
        "the link kept its carrier through the rename"
    );
    assert_eq!(sys(format!("/sys/class/net/{name}/operstate")), "up");
    net::delete_link(&host, &name).await.unwrap();
}
