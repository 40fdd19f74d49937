//! Egress rules with the official E2B Python SDK through the gateway and two nodes,
//! against a fake internet in a network namespace the test makes (web servers and a DNS
//! server of its own, see `agentenv_testkit::internet`): names allowed over HTTP and
//! HTTPS under a deny of everything, addresses denied, `update_network` replacing the
//! rules live, and no internet at all.

use agentenv_testkit::internet::{ECHO_PORT, Internet};
use agentenv_tests::{Cluster, e2b_python, run_sdk_script, skip_reason};

const FIRST_IDX: u8 = 22;
/// The fake internet's slot: `198.18.41.0/24`.
const NET_SLOT: u8 = 41;

#[test]
fn the_sdk_allows_names_denies_addresses_and_replaces_rules_live() {
    if let Some(r) = skip_reason() {
        eprintln!("SKIPPED: {r}");
        return;
    }
    let py = e2b_python().expect("E2B SDK virtual environment");
    let net = Internet::start(NET_SLOT);
    let dns = net.dns().to_string();
    let cluster = Cluster::start_with(2, FIRST_IDX, &|_| {
        vec![("AENV_JAIL_DNS_SERVERS".to_string(), dns.clone())]
    });
    cluster.wait_nodes_listed(2);
    let dir = tempfile::tempdir().unwrap();
    let ca = dir.path().join("ca.pem");
    std::fs::write(&ca, &net.ca_pem).unwrap();
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/e2b_egress.py");
    let v = run_sdk_script(
        &py,
        script,
        &[
            &ca.display().to_string(),
            &net.ip(2).to_string(),
            &net.ip(3).to_string(),
            &ECHO_PORT.to_string(),
        ],
        cluster.gateway,
        &[],
    );
    let refused = |s: &serde_json::Value| s.as_str().is_some_and(|s| s.starts_with("ERR"));

    let named = &v["named"];
    assert_eq!(named["http_allowed"], "OK web-a", "{named}");
    assert_eq!(named["https_allowed"], "OK web-a", "{named}");
    assert!(refused(&named["http_other"]), "{named}");
    assert!(refused(&named["https_other"]), "{named}");
    assert!(
        refused(&named["tcp_allowed_other_port"]),
        "a name is allowed for HTTP and TLS only: {named}"
    );
    assert_eq!(
        named["info"]["allow_out"],
        serde_json::json!(["allowed.test"])
    );
    assert_eq!(named["info"]["deny_out"], serde_json::json!(["0.0.0.0/0"]));

    let c = &v["cidr"];
    let ok = |s: &serde_json::Value, who: &str| s == &serde_json::json!(format!("OK hello {who}"));
    assert!(
        ok(&c["created"][0], "web-a") && refused(&c["created"][1]),
        "{c}"
    );
    assert!(
        refused(&c["replaced"][0]) && ok(&c["replaced"][1], "web-b"),
        "{c}"
    );
    assert!(
        ok(&c["cleared"][0], "web-a") && ok(&c["cleared"][1], "web-b"),
        "{c}"
    );
    assert!(
        refused(&c["offline_but_b"][0]) && ok(&c["offline_but_b"][1], "web-b"),
        "allowOut wins over no internet: {c}"
    );

    let off = &v["offline"];
    assert!(refused(&off["tcp"]), "{off}");
    assert!(refused(&off["dns"]), "{off}");
    assert_eq!(off["info"], false);
}
