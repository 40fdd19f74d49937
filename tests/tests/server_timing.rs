//! `Server-Timing` through the gateway: a create answers with every phase of the node's
//! create and the gateway's own entries, each a valid non-negative duration, the phases
//! of each side summing to no more than that side's total; and a tenant's data-plane
//! answer reaches the client as the tenant sent it, with nothing of the gateway's added.

use agentenv_tests::{API_KEY, Cluster};

/// Node phases this test names (the node's own test, `agentenv-node/tests/node_timing.rs`,
/// pins every phase and their order).
const NODE_PHASES: &[&str] = &["netns", "cgroup", "spawn", "agent_ready", "init"];

/// The gateway's phases of a create (before its total, `gateway`).
const GATEWAY_PHASES: &[&str] = &["route", "hint", "schedule", "upstream", "record"];

/// Each entry is rounded to 0.01 ms: a sum of `n` may exceed its total by `n` halves.
fn rounding(n: usize) -> f64 {
    0.005 * (n as f64 + 1.0)
}

fn header<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.as_str())
}

/// A create through the gateway answers every phase of the node and of the gateway,
/// within their totals.
fn create_answers_every_phase_within_the_totals(cluster: &Cluster) {
    // The first create may build the template; the second is the ordinary path.
    for round in 0..2 {
        let (st, headers, body) = agentenv_tests::http(
            cluster.gateway,
            "POST",
            "/v2/sandboxes",
            &[("x-api-key", API_KEY), ("content-type", "application/json")],
            r#"{"templateID":"base","timeout":60}"#,
        );
        assert_eq!(st, 201, "create: {body}");
        let value = header(&headers, "server-timing")
            .unwrap_or_else(|| panic!("no Server-Timing in {headers:?}"));
        let entries = agentenv_node::timing::parse(value)
            .unwrap_or_else(|| panic!("an entry without a valid non-negative dur: {value}"));
        let names: Vec<&str> = entries.iter().map(|(n, _)| n.as_str()).collect();
        let ms = |name: &str| {
            entries
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, d)| *d)
                .unwrap_or_else(|| panic!("round {round}: no `{name}` in {value}"))
        };
        for name in NODE_PHASES.iter().chain(GATEWAY_PHASES) {
            ms(name);
        }
        // The node's entries, then the gateway's, each side ending with its total.
        let node_at = names.iter().position(|n| *n == "node").expect("node");
        assert_eq!(names.last(), Some(&"gateway"), "{value}");
        assert!(
            names[..node_at]
                .iter()
                .all(|n| !GATEWAY_PHASES.contains(n) && *n != "gateway"),
            "only node phases before `node`: {value}"
        );
        let node_sum: f64 = entries[..node_at].iter().map(|(_, d)| d).sum();
        assert!(
            node_sum <= ms("node") + rounding(node_at),
            "node phases sum to {node_sum} ms, over the node's total: {value}"
        );
        let gw = &entries[node_at + 1..entries.len() - 1];
        let gw_sum: f64 = gw.iter().map(|(_, d)| d).sum();
        assert!(
            gw_sum <= ms("gateway") + rounding(gw.len()),
            "gateway phases sum to {gw_sum} ms, over the gateway's total: {value}"
        );
        assert!(
            ms("node") <= ms("upstream") + rounding(1),
            "the node's total is within the gateway's call to it: {value}"
        );
        assert!(ms("agent_ready") + ms("spawn") > 0.0, "{value}");
        let id = serde_json::from_str::<serde_json::Value>(&body).unwrap()["sandboxID"]
            .as_str()
            .expect("sandboxID")
            .to_string();
        let (st, _) =
            agentenv_tests::api(cluster.gateway, "DELETE", &format!("/sandboxes/{id}"), "");
        assert_eq!(st, 204);
    }
}

/// A tenant's data-plane answer keeps its own `Server-Timing` and gets no entry of the
/// gateway's, on the fast lane and on the hyper lane (`te` sends it there).
fn tenant_answer_keeps_its_server_timing(cluster: &Cluster) {
    let id = cluster.create(r#"{"templateID":"base","timeout":60}"#);
    let rt = tokio::runtime::Runtime::new().unwrap();
    // The tenant forges entries named like the node's and the gateway's.
    let forged = "node;dur=0.00, gateway;dur=0.00";
    let script = format!(
        r#"mkdir -p /srv && cat > /srv/s.py <<'EOF'
import http.server
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("Server-Timing", "{forged}")
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")
    def log_message(self, *a):
        pass
http.server.HTTPServer(("0.0.0.0", 8080), H).serve_forever()
EOF
(python3 /srv/s.py >/dev/null 2>&1 &)
for i in $(seq 100); do python3 -c 'import socket; socket.create_connection(("127.0.0.1", 8080))' 2>/dev/null && break; sleep 0.05; done
echo up"#
    );
    assert_eq!(cluster.sh(&rt, &id, &script), "up");
    for lane in [&[][..], &[("te", "trailers")][..]] {
        let mut h = vec![
            ("e2b-sandbox-id", id.as_str()),
            ("e2b-sandbox-port", "8080"),
        ];
        h.extend_from_slice(lane);
        let (st, headers, body) = agentenv_tests::http(cluster.gateway, "GET", "/x", &h, "");
        assert_eq!((st, body.as_str()), (200, "ok"), "{lane:?}");
        let values: Vec<&str> = headers
            .iter()
            .filter(|(k, _)| k == "server-timing")
            .map(|(_, v)| v.as_str())
            .collect();
        assert_eq!(
            values,
            [forged],
            "the tenant's header, untouched ({lane:?})"
        );
    }
    let (st, _) = agentenv_tests::api(cluster.gateway, "DELETE", &format!("/sandboxes/{id}"), "");
    assert_eq!(st, 204);
}

#[test]
fn creates_answer_node_and_gateway_phases_and_tenant_answers_keep_their_own_header() {
    if let Some(r) = agentenv_tests::skip_reason() {
        eprintln!("skipped: {r}");
        return;
    }
    // One cluster (index 34) for both: tests of one binary run at once.
    let cluster = Cluster::start(1, 34);
    create_answers_every_phase_within_the_totals(&cluster);
    tenant_answer_keeps_its_server_timing(&cluster);
}
