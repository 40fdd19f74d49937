//! The host firewall chains of an interface prefix, with real iptables: installed, then
//! removed without a trace; never while an interface of the prefix exists; never those of
//! another prefix.

use agentenv_testkit::host_rules as rules_common;

use std::path::Path;
use std::process::Command;

use agentenv_node::host::net::{self, HostRules, Ipv4Net, NatMode, NetError};

fn skip_reason() -> Option<String> {
    if !nix::unistd::Uid::effective().is_root() {
        return Some("changing the host's iptables rules needs root".into());
    }
    match Command::new("iptables").arg("--version").output() {
        Ok(o) if o.status.success() => None,
        _ => Some("no iptables: install it (scripts/apt-packages.txt lists it)".into()),
    }
}

/// The nodes' default runtime directory: its lock serializes with their installs, and it
/// outlives the test for the removal at exit.
fn runtime_dir() -> &'static Path {
    let d = Path::new("/run/agentenv");
    std::fs::create_dir_all(d).unwrap();
    d
}

fn rules(prefix: &str) -> HostRules {
    HostRules {
        iface_prefix: prefix.into(),
        pool: "10.16.0.0/24".parse().unwrap(),
        denied: Ipv4Net::default_denied(),
        dns: vec!["10.0.0.2".parse().unwrap()],
        nat: NatMode::Snat,
    }
}

fn ip(args: &[&str]) {
    let st = Command::new("ip").args(args).status().expect("ip");
    assert!(st.success(), "ip {args:?} failed");
}

/// A veth pair on the host (its peer's name is no sandbox interface's), deleted on drop.
struct Link(String);

impl Link {
    fn add(name: String, peer: &str) -> Link {
        ip(&["link", "add", &name, "type", "veth", "peer", "name", peer]);
        Link(name)
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["link", "del", &self.0]).status();
    }
}

#[tokio::test]
async fn install_then_uninstall_leaves_no_chain_and_no_jump_and_spares_other_prefixes() {
    if let Some(r) = skip_reason() {
        eprintln!("SKIPPED: {r}");
        return;
    }
    let run = runtime_dir();
    let p = rules_common::process_prefix('h');
    // A prefix that starts with `p`: its chains' names start with p's too.
    let longer = format!("{p}a");
    rules_common::remove_at_exit(&p, run);
    rules_common::remove_at_exit(&longer, run);

    rules(&p).install(run).await.unwrap();
    rules(&longer).install(run).await.unwrap();
    // A second pool of the same prefix adds its NAT rule to the same chain.
    let mut other_pool = rules(&p);
    other_pool.pool = "10.16.1.0/24".parse().unwrap();
    other_pool.nat = NatMode::Masquerade;
    other_pool.install(run).await.unwrap();
    // A jump added twice (by hand, or by an older node) goes too.
    let st = Command::new("iptables")
        .args(["-w", "-I", "FORWARD", "-j", &net::host_chain(&p, "FWD")])
        .status()
        .unwrap();
    assert!(st.success());

    let up = format!("AGENTENV-{}-", p.to_ascii_uppercase());
    let installed = rules_common::chain_lines(&p);
    for needle in [
        format!(":{up}IN "),
        format!(":{up}FWD "),
        format!(":{up}NAT "),
        format!("-A INPUT -j {up}IN"),
        format!("-A POSTROUTING -j {up}NAT"),
        "-s 10.16.1.0/24 ! -o {p}+ -j MASQUERADE".replace("{p}", &p),
    ] {
        assert!(
            installed.iter().any(|l| l.contains(&needle)),
            "{needle:?} missing after install: {installed:#?}"
        );
    }
    assert_eq!(
        installed
            .iter()
            .filter(|l| **l == format!("-A FORWARD -j {up}FWD"))
            .count(),
        2
    );
    let longer_before = rules_common::chain_lines(&longer);
    assert!(!longer_before.is_empty());

    net::uninstall_host_rules(&p, run, rules_common::LINGER)
        .await
        .unwrap();
    assert_eq!(rules_common::chain_lines(&p), Vec::<String>::new());
    assert_eq!(
        rules_common::chain_lines(&longer),
        longer_before,
        "the chains of {longer} are not {p}'s"
    );
    // Absent chains are fine.
    net::uninstall_host_rules(&p, run, rules_common::LINGER)
        .await
        .unwrap();

    net::uninstall_host_rules(&longer, run, rules_common::LINGER)
        .await
        .unwrap();
    assert_eq!(rules_common::chain_lines(&longer), Vec::<String>::new());
}

#[tokio::test]
async fn uninstall_is_refused_while_an_interface_of_the_prefix_exists() {
    if let Some(r) = skip_reason() {
        eprintln!("SKIPPED: {r}");
        return;
    }
    let run = runtime_dir();
    // Not the other test's prefix: the two run at once in this process.
    let p = rules_common::process_prefix('g');
    rules_common::remove_at_exit(&p, run);
    rules(&p).install(run).await.unwrap();
    let installed = rules_common::chain_lines(&p);

    // An interface of a longer prefix is not this prefix's.
    let slot = net::Slot {
        network: "10.16.0.4".parse().unwrap(),
    };
    let foreign = Link::add(slot.host_ifname(&format!("{p}i"), true), &format!("{p}x"));
    let sandbox = Link::add(slot.host_ifname(&p, false), &format!("{p}y"));
    let e = net::uninstall_host_rules(&p, run, std::time::Duration::from_millis(50))
        .await
        .expect_err("refused");
    match &e {
        NetError::RulesInUse { prefix, interfaces } => {
            assert_eq!(prefix, &p);
            assert_eq!(interfaces, &vec![sandbox.0.clone()]);
        }
        other => panic!("unexpected error: {other}"),
    }
    assert!(e.to_string().contains(&sandbox.0), "{e}");
    assert_eq!(rules_common::chain_lines(&p), installed, "rules stay");

    drop(sandbox);
    net::uninstall_host_rules(&p, run, rules_common::LINGER)
        .await
        .unwrap();
    assert_eq!(rules_common::chain_lines(&p), Vec::<String>::new());
    drop(foreign);
}
