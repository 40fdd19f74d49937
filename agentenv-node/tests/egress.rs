//! Per-sandbox egress rules with real jail sandboxes against a fake internet (see
//! `agentenv_testkit::internet`): addresses and CIDRs enforced in the sandbox's namespace, names
//! enforced by the node's egress proxy for HTTP and TLS, `PUT /network` replacing rules
//! live, rules surviving pause, resume and a node restart, and a tenant that tries to lift
//! its own rules. Test slots 32 to 35.

mod node_common;

use std::net::SocketAddr;
use std::time::Duration;

use agentenv_testkit::Wait;
use agentenv_testkit::internet::{ECHO_PORT, Internet};
use node_common::{Node, api, create, run};

/// What runs inside the sandboxes: one line, `OK …` or `ERR <exception> …`.
const CLIENT: &str = r#"
import socket, ssl, sys, urllib.request
def out(*a): print(*a, flush=True)
cmd = sys.argv[1]
try:
    if cmd == "get":
        ctx = ssl.create_default_context(cafile="/tmp/ca.pem")
        with urllib.request.urlopen(sys.argv[2], timeout=10, context=ctx) as r:
            out("OK", r.read().decode())
    elif cmd == "tcp":
        s = socket.create_connection((sys.argv[2], int(sys.argv[3])), timeout=10)
        out("OK", s.recv(100).decode().strip())
    elif cmd == "front":
        ip, port, name, tls = sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5] == "tls"
        s = socket.create_connection((ip, port), timeout=10)
        if tls:
            s = ssl.create_default_context(cafile="/tmp/ca.pem").wrap_socket(s, server_hostname=name)
        s.sendall(f"GET / HTTP/1.1\r\nHost: {name}\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while True:
            c = s.recv(4096)
            if not c:
                break
            data += c
        out("OK", data.decode().split("\r\n\r\n", 1)[1])
    elif cmd == "dns":
        out("OK", " ".join(sorted({a[4][0] for a in socket.getaddrinfo(sys.argv[2], 80, socket.AF_INET)})))
except Exception as e:
    out("ERR", type(e).__name__, e)
"#;

/// Runs `script` in sandbox `id`; its stdout and stderr.
async fn sh(addr: SocketAddr, id: &str, script: &str) -> String {
    let out = run(addr, id, None, script)
        .await
        .expect("running in the sandbox");
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Writes the client and the test CA into sandbox `id`.
async fn prepare(addr: SocketAddr, id: &str, net: &Internet) {
    let script = format!(
        "cat > /tmp/t.py <<'PYEOF'\n{CLIENT}\nPYEOF\ncat > /tmp/ca.pem <<'PEMEOF'\n{}PEMEOF\necho ready",
        net.ca_pem
    );
    assert_eq!(sh(addr, id, &script).await.trim(), "ready");
}

/// The client's answer to `args`.
async fn client(addr: SocketAddr, id: &str, args: &str) -> String {
    sh(addr, id, &format!("python3 /tmp/t.py {args}"))
        .await
        .trim()
        .to_string()
}

/// A node of `slot` whose sandboxes use the fake internet's nameserver.
async fn node(home: &std::path::Path, slot: u8, net: &Internet) -> Node {
    let mut cfg = node_common::config(home, slot);
    cfg.jail_dns_servers = Some(vec![net.dns()]);
    Node::start(cfg).await
}

/// Creates a sandbox with `body` and prepares it.
async fn sandbox(node: &Node, net: &Internet, body: &str) -> String {
    let id = create(node.addr, body).await;
    prepare(node.addr, &id, net).await;
    id
}

fn refused(answer: &str) -> bool {
    answer.starts_with("ERR")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn addresses_and_internet_access_are_enforced_in_the_sandbox_namespace() {
    require_node!();
    let slot = 32;
    let net = Internet::start(slot);
    let home = tempfile::tempdir().unwrap();
    let node = node(home.path(), slot, &net).await;
    let (a, b) = (net.ip(2), net.ip(3));

    // A denied address is refused at once; the rest of the internet is not.
    let deny_b = sandbox(
        &node,
        &net,
        &format!(r#"{{"templateID":"base","network":{{"denyOut":["{b}/32"]}}}}"#),
    )
    .await;
    let r = client(node.addr, &deny_b, &format!("tcp {b} {ECHO_PORT}")).await;
    assert!(r.starts_with("ERR ConnectionRefusedError"), "{r}");
    assert_eq!(
        client(node.addr, &deny_b, &format!("tcp {a} {ECHO_PORT}")).await,
        "OK hello web-a"
    );
    assert_eq!(net.connections("web-b"), 0, "web-b was never reached");

    // No internet: nothing goes out, nameservers neither.
    let offline = sandbox(
        &node,
        &net,
        r#"{"templateID":"base","allow_internet_access":false}"#,
    )
    .await;
    let r = client(node.addr, &offline, &format!("tcp {a} {ECHO_PORT}")).await;
    assert!(r.starts_with("ERR ConnectionRefusedError"), "{r}");
    let r = client(node.addr, &offline, "dns allowed.test").await;
    assert!(refused(&r), "DNS is refused too: {r}");
    let r = client(
        node.addr,
        &offline,
        &format!("front {a} 80 allowed.test http"),
    )
    .await;
    assert!(refused(&r), "no name is allowed, so no proxy either: {r}");

    // Allowed entries win over denied ones (and over no internet).
    let only_b = sandbox(
        &node,
        &net,
        &format!(
            r#"{{"templateID":"base","allow_internet_access":false,"network":{{"allowOut":["{b}"]}}}}"#
        ),
    )
    .await;
    assert_eq!(
        client(node.addr, &only_b, &format!("tcp {b} {ECHO_PORT}")).await,
        "OK hello web-b"
    );
    let r = client(node.addr, &only_b, &format!("tcp {a} {ECHO_PORT}")).await;
    assert!(r.starts_with("ERR ConnectionRefusedError"), "{r}");

    // The node still reaches every one of them (the data plane, replies of its own
    // connections), and the detail shows the rules.
    let d = api(node.addr, "GET", &format!("/sandboxes/{only_b}"), "")
        .await
        .json();
    assert_eq!(d["allowInternetAccess"], false);
    assert_eq!(d["network"]["allowOut"], serde_json::json!([b.to_string()]));
    assert_eq!(d["network"]["allowPublicTraffic"], true);
    let d = api(node.addr, "GET", &format!("/sandboxes/{deny_b}"), "")
        .await
        .json();
    assert_eq!(
        d["network"]["denyOut"],
        serde_json::json!([format!("{b}/32")])
    );
    node.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allowed_names_pass_the_proxy_over_http_and_tls_and_nothing_else_does() {
    require_node!();
    let slot = 33;
    let net = Internet::start(slot);
    let home = tempfile::tempdir().unwrap();
    let node = node(home.path(), slot, &net).await;
    let (a, decoy) = (net.ip(2), net.ip(4));
    let id = sandbox(
        &node,
        &net,
        r#"{"templateID":"base","network":{"denyOut":["0.0.0.0/0"],"allowOut":["Allowed.test","*.wild.test"]}}"#,
    )
    .await;
    let c = |args: String| {
        let id = id.clone();
        let addr = node.addr;
        async move { client(addr, &id, &args).await }
    };
    // The nameservers are reachable since a name is allowed.
    assert_eq!(c("dns allowed.test".into()).await, format!("OK {a}"));
    assert_eq!(c("get http://allowed.test/".into()).await, "OK web-a");
    assert_eq!(c("get https://allowed.test/".into()).await, "OK web-a");
    assert_eq!(
        c("get https://a.wild.test/".into()).await,
        "OK web-a",
        "below a wildcard"
    );
    for url in [
        "http://other.test/",
        "https://other.test/",
        "http://wild.test/",
        "https://wild.test/",
    ] {
        let r = c(format!("get {url}")).await;
        assert!(refused(&r), "{url}: {r}");
    }
    assert_eq!(
        net.connections("web-b"),
        0,
        "names not allowed never reach a server"
    );

    // An allowed name sent to another address reaches the allowed name's server only.
    assert_eq!(
        c(format!("front {decoy} 443 allowed.test tls")).await,
        "OK web-a"
    );
    assert_eq!(
        c(format!("front {decoy} 80 allowed.test http")).await,
        "OK web-a"
    );
    assert_eq!(
        net.connections("decoy"),
        0,
        "the decoy address was never reached"
    );

    // Other protocols and ports to a denied address are refused whatever the name.
    let r = c(format!("tcp {a} {ECHO_PORT}")).await;
    assert!(r.starts_with("ERR ConnectionRefusedError"), "{r}");
    // A connection that names nothing is closed by the proxy.
    let r = c(format!("front {a} 443 {a} tls")).await;
    assert!(refused(&r), "TLS without a server name: {r}");
    node.stop().await;
}

/// Sets sandbox `id`'s network with `body`; the status.
async fn put_network(addr: SocketAddr, id: &str, body: &str) -> node_common::Resp {
    api(addr, "PUT", &format!("/sandboxes/{id}/network"), body).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn put_network_replaces_rules_live_and_they_survive_pause_resume_and_a_restart() {
    require_node!();
    let slot = 34;
    let net = Internet::start(slot);
    let home = tempfile::tempdir().unwrap();
    let node = node(home.path(), slot, &net).await;
    let (a, b) = (net.ip(2), net.ip(3));
    let id = sandbox(&node, &net, r#"{"templateID":"base"}"#).await;
    let to_b = format!("tcp {b} {ECHO_PORT}");
    let to_a = format!("tcp {a} {ECHO_PORT}");
    assert_eq!(client(node.addr, &id, &to_b).await, "OK hello web-b");

    // Blocked, allowed again, blocked: each PUT is in force when it returns.
    let deny_b = format!(r#"{{"denyOut":["{b}"]}}"#);
    let r = put_network(node.addr, &id, &deny_b).await;
    assert_eq!(r.status, 204, "{}", r.text());
    assert!(
        client(node.addr, &id, &to_b)
            .await
            .starts_with("ERR ConnectionRefusedError")
    );
    let r = put_network(node.addr, &id, "{}").await;
    assert_eq!(r.status, 204, "{}", r.text());
    assert_eq!(
        client(node.addr, &id, &to_b).await,
        "OK hello web-b",
        "omitted fields clear"
    );
    let r = put_network(
        node.addr,
        &id,
        r#"{"allow_internet_access":false,"allowOut":["allowed.test"]}"#,
    )
    .await;
    assert_eq!(r.status, 204, "{}", r.text());
    assert!(client(node.addr, &id, &to_b).await.starts_with("ERR"));
    assert_eq!(
        client(node.addr, &id, "get http://allowed.test/").await,
        "OK web-a"
    );

    // Bad input: 400 naming the problem, and nothing changes.
    for (body, says) in [
        (r#"{"denyOut":["example.com"]}"#, "network.denyOut[0]"),
        (r#"{"allowOut":["10.0.0.0/33"]}"#, "network.allowOut[0]"),
        (r#"{"allowOut":["1.2.3"]}"#, "network.allowOut[0]"),
        (r#"{"egressProxy":{"address":"p:1080"}}"#, "egressProxy"),
        (
            r#"{"rules":{"a.test":[{"transform":{"headers":{"x":"y"}}}]}}"#,
            "network.rules",
        ),
        (r#"{"allowOut":"a.test"}"#, "allowOut"),
    ] {
        let r = put_network(node.addr, &id, body).await;
        assert_eq!(r.status, 400, "{body}: {}", r.text());
        assert!(
            r.json()["message"].as_str().unwrap().contains(says),
            "{body}: {}",
            r.text()
        );
    }
    let d = api(node.addr, "GET", &format!("/sandboxes/{id}"), "")
        .await
        .json();
    assert_eq!(
        d["network"]["allowOut"],
        serde_json::json!(["allowed.test"])
    );
    assert_eq!(d["allowInternetAccess"], false);
    assert!(client(node.addr, &id, &to_b).await.starts_with("ERR"));
    assert_eq!(
        client(node.addr, &id, "get http://allowed.test/").await,
        "OK web-a"
    );
    assert_eq!(
        put_network(node.addr, "01a245bc-0000-7000-8000-000000000000", "{}")
            .await
            .status,
        404
    );
    let before = node.orch.list().len();
    let r = api(
        node.addr,
        "POST",
        "/v2/sandboxes",
        r#"{"templateID":"base","network":{"denyOut":["*.test"]}}"#,
    )
    .await;
    assert_eq!(r.status, 400, "{}", r.text());
    assert_eq!(
        node.orch.list().len(),
        before,
        "a refused create makes nothing"
    );

    // Changed while paused: in force after the resume.
    assert_eq!(
        api(node.addr, "POST", &format!("/sandboxes/{id}/pause"), "")
            .await
            .status,
        204
    );
    let r = put_network(node.addr, &id, &deny_b).await;
    assert_eq!(r.status, 204, "{}", r.text());
    let r = api(node.addr, "POST", &format!("/sandboxes/{id}/resume"), "{}").await;
    assert_eq!(r.status, 201, "{}", r.text());
    assert!(
        client(node.addr, &id, &to_b)
            .await
            .starts_with("ERR ConnectionRefusedError")
    );
    assert_eq!(client(node.addr, &id, &to_a).await, "OK hello web-a");

    // A node restart: the sandbox starts again in a new namespace, with its rules.
    node.stop().await;
    let node = self::node(home.path(), slot, &net).await;
    let r = api(
        node.addr,
        "POST",
        &format!("/v2/sandboxes/{id}/connect"),
        "{}",
    )
    .await;
    assert_eq!(r.status, 201, "{}", r.text());
    prepare(node.addr, &id, &net).await;
    assert!(
        client(node.addr, &id, &to_b)
            .await
            .starts_with("ERR ConnectionRefusedError")
    );
    assert_eq!(client(node.addr, &id, &to_a).await, "OK hello web-a");
    let d = api(node.addr, "GET", &format!("/sandboxes/{id}"), "")
        .await
        .json();
    assert_eq!(d["network"]["denyOut"], serde_json::json!([b.to_string()]));
    // And a PUT on a sandbox the restart left paused is kept with its record.
    assert_eq!(
        api(node.addr, "POST", &format!("/sandboxes/{id}/pause"), "")
            .await
            .status,
        204
    );
    node.stop().await;
    let node = self::node(home.path(), slot, &net).await;
    let r = put_network(node.addr, &id, &format!(r#"{{"denyOut":["{a}"]}}"#)).await;
    assert_eq!(r.status, 204, "{}", r.text());
    let r = api(
        node.addr,
        "POST",
        &format!("/v2/sandboxes/{id}/connect"),
        "{}",
    )
    .await;
    assert_eq!(r.status, 201, "{}", r.text());
    prepare(node.addr, &id, &net).await;
    assert!(
        client(node.addr, &id, &to_a)
            .await
            .starts_with("ERR ConnectionRefusedError")
    );
    assert_eq!(client(node.addr, &id, &to_b).await, "OK hello web-b");
    node.stop().await;
}

/// What the tenant tries against its own rules, as root in its sandbox: every line says
/// `blocked …` when the attempt failed, `DONE …` when it went through.
const ATTACK: &str = r#"
import socket, struct
def attempt(what, f):
    try:
        r = f()
        print(what, "DONE" if r is None else r, flush=True)
    except Exception as e:
        print(what, "blocked", type(e).__name__, e, flush=True)

def nft_flush():
    # What `nft flush ruleset` sends: delete every table, in one nf_tables batch.
    s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 12)
    s.bind((0, 0))
    def msg(kind, flags, seq, res_id):
        return struct.pack("=IHHII", 20, kind, flags, seq, 0) + struct.pack("=BBH", 0, 0, socket.htons(res_id))
    s.send(msg(0x10, 1, 1, 10) + msg((10 << 8) | 2, 1 | 4, 2, 0) + msg(0x11, 1, 3, 10))
    reply = s.recv(65536)
    kind = struct.unpack_from("=H", reply, 4)[0]
    err = struct.unpack_from("=i", reply, 16)[0] if kind == 2 else None
    return None if err == 0 else "blocked errno %s" % err

def iptables_legacy():
    # iptables-legacy replaces tables through a raw socket.
    socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)

def packet_socket():
    socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(3))

def mark():
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, 36, 1)

def route_del():
    # RTM_DELROUTE of the default route over rtnetlink.
    s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0)
    s.bind((0, 0))
    rtm = struct.pack("=BBBBBBBBI", socket.AF_INET, 0, 0, 0, 254, 0, 0, 0, 0)
    s.send(struct.pack("=IHHII", 16 + len(rtm), 25, 1 | 4, 1, 0) + rtm)
    reply = s.recv(65536)
    err = struct.unpack_from("=i", reply, 16)[0]
    return None if err == 0 else "blocked errno %s" % err

def take_proxy_port():
    s = socket.socket()
    s.bind(("0.0.0.0", 1))
    s.listen()

attempt("nft-flush", nft_flush)
attempt("iptables-legacy", iptables_legacy)
attempt("packet-socket", packet_socket)
attempt("so-mark", mark)
attempt("route-del", route_del)
attempt("proxy-port", take_proxy_port)
"#;

/// Connects to `ip`, then waits for `/tmp/go` and sends a line: prints `connected`, then
/// `OK <echo>` or `ERR <exception>`.
const HOLD: &str = r#"
import os, socket, sys, time
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
print("connected", s.recv(100).decode().strip(), flush=True)
while not os.path.exists("/tmp/go"):
    time.sleep(0.01)
try:
    s.sendall(b"ping\n")
    d = s.recv(100)
    print("OK", d.decode().strip() if d else "closed", flush=True)
except Exception as e:
    print("ERR", type(e).__name__, flush=True)
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tenant_cannot_lift_its_rules_and_an_open_flow_to_a_newly_denied_address_is_cut() {
    require_node!();
    let slot = 35;
    let net = Internet::start(slot);
    let home = tempfile::tempdir().unwrap();
    let node = node(home.path(), slot, &net).await;
    let (a, b) = (net.ip(2), net.ip(3));
    let id = sandbox(
        &node,
        &net,
        &format!(r#"{{"templateID":"base","network":{{"denyOut":["{b}"]}}}}"#),
    )
    .await;
    let out = sh(
        node.addr,
        &id,
        &format!("python3 - <<'PYEOF'\n{ATTACK}\nPYEOF"),
    )
    .await;
    eprintln!("the tenant's attempts:\n{out}");
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 6, "{out}");
    for line in &lines {
        assert!(
            line.split_whitespace().nth(1) == Some("blocked"),
            "an attack went through: {out}"
        );
    }
    assert!(
        out.lines()
            .any(|l| l.starts_with("proxy-port blocked OSError") && l.contains("in use")),
        "{out}"
    );
    let r = client(node.addr, &id, &format!("tcp {b} {ECHO_PORT}")).await;
    assert!(
        r.starts_with("ERR ConnectionRefusedError"),
        "after the attacks: {r}"
    );

    // A connection to an address that is allowed now is cut when a PUT denies it.
    let script = format!(
        "cat > /tmp/hold.py <<'PYEOF'\n{HOLD}\nPYEOF\nsetsid python3 /tmp/hold.py {a} {ECHO_PORT} > /tmp/hold.out 2>&1 < /dev/null &"
    );
    sh(node.addr, &id, &script).await;
    let held = |want: &'static str| {
        let (addr, id) = (node.addr, id.clone());
        async move {
            let out = sh(addr, &id, "cat /tmp/hold.out 2>/dev/null").await;
            out.contains(want).then_some(out)
        }
    };
    Wait::new("the held connection", Duration::from_secs(10))
        .until(|| held("connected hello web-a"))
        .await;
    let r = put_network(node.addr, &id, &format!(r#"{{"denyOut":["{a}/32"]}}"#)).await;
    assert_eq!(r.status, 204, "{}", r.text());
    sh(node.addr, &id, "touch /tmp/go").await;
    let out = Wait::new(
        "the held connection's next exchange",
        Duration::from_secs(15),
    )
    .until(|| {
        let (addr, id) = (node.addr, id.clone());
        async move {
            let out = sh(addr, &id, "cat /tmp/hold.out").await;
            (out.lines().count() >= 2).then_some(out)
        }
    })
    .await;
    eprintln!("the held connection:\n{out}");
    assert!(
        out.lines().nth(1).is_some_and(|l| l.starts_with("ERR")),
        "the flow is cut at its next packet: {out}"
    );
    node.stop().await;
}
