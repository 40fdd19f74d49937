//! The console's gateway side against a real cluster on loopback (scheduler, gateway,
//! two nodes with the jail backend): sign in, both nodes through the REST pass-through,
//! a sandbox created through it, the events socket showing the sandbox and then its
//! removal, a terminal socket running a shell that survives a dropped socket, resize,
//! a file uploaded, listed and read back, and a hundred open pages each given the live
//! list.

use std::time::Duration;

use agentenv_tests::{API_KEY, Cluster, http, skip_reason};
use futures::{SinkExt, StreamExt};
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;

type Ws =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

/// How long a socket may stay silent before the test gives up (a hang guard).
const QUIET: Duration = Duration::from_secs(90);

struct Page {
    gw: std::net::SocketAddr,
    origin: String,
    cookie: String,
    csrf: String,
}

impl Page {
    fn sign_in(gw: std::net::SocketAddr) -> Page {
        let origin = format!("http://{gw}");
        let (st, h, b) = http(
            gw,
            "POST",
            "/console/api/session",
            &[("content-type", "application/json"), ("origin", &origin)],
            &format!(r#"{{"apiKey":"{API_KEY}"}}"#),
        );
        assert_eq!(st, 200, "sign in: {b}");
        let set = h
            .iter()
            .find(|(k, _)| k == "set-cookie")
            .map(|(_, v)| v.clone())
            .expect("a session cookie");
        let cookie = set.split(';').next().unwrap().to_string();
        let v: serde_json::Value = serde_json::from_str(&b).unwrap();
        Page {
            gw,
            origin,
            cookie,
            csrf: v["csrfToken"].as_str().unwrap().to_string(),
        }
    }

    /// A console API call; status, headers and body.
    fn call(&self, method: &str, path: &str, body: &str) -> (u16, Vec<(String, String)>, String) {
        http(
            self.gw,
            method,
            path,
            &[
                ("cookie", &self.cookie),
                ("origin", &self.origin),
                ("x-csrf-token", &self.csrf),
                ("content-type", "application/json"),
            ],
            body,
        )
    }

    fn json(&self, method: &str, path: &str, body: &str) -> (u16, serde_json::Value) {
        let (st, _, b) = self.call(method, path, body);
        (
            st,
            serde_json::from_str(&b).unwrap_or(serde_json::Value::Null),
        )
    }

    async fn socket(&self, path: &str) -> Ws {
        let mut req = format!("ws://{}{path}", self.gw)
            .into_client_request()
            .unwrap();
        req.headers_mut()
            .insert("cookie", self.cookie.parse().unwrap());
        req.headers_mut()
            .insert("origin", self.origin.parse().unwrap());
        tokio_tungstenite::connect_async(req)
            .await
            .unwrap_or_else(|e| panic!("opening {path}: {e}"))
            .0
    }
}

/// The next message of a socket (pings skipped).
async fn next(ws: &mut Ws) -> Message {
    loop {
        match tokio::time::timeout(QUIET, ws.next()).await {
            Ok(Some(Ok(Message::Ping(_) | Message::Pong(_)))) => continue,
            Ok(Some(Ok(m))) => return m,
            Ok(other) => panic!("the socket ended: {other:?}"),
            Err(_) => panic!("the socket was silent for {QUIET:?}"),
        }
    }
}

/// Reads events until a `sandboxes` message satisfies `cond`.
async fn sandboxes_until(ws: &mut Ws, cond: impl Fn(&[serde_json::Value]) -> bool) {
    loop {
        if let Message::Text(t) = next(ws).await {
            let v: serde_json::Value = serde_json::from_str(t.as_str()).unwrap();
            if v["type"] == "sandboxes" && cond(v["items"].as_array().unwrap()) {
                return;
            }
        } else {
            panic!("events are text messages");
        }
    }
}

/// Reads terminal output until it contains `needle`; the text seen.
async fn output_until(ws: &mut Ws, needle: &str) -> String {
    let mut seen = Vec::new();
    loop {
        match next(ws).await {
            Message::Binary(b) => {
                seen.extend_from_slice(&b);
                let text = String::from_utf8_lossy(&seen).into_owned();
                if text.contains(needle) {
                    return text;
                }
            }
            Message::Text(t) => panic!("terminal message while waiting for {needle:?}: {t}"),
            other => panic!("terminal ended while waiting for {needle:?}: {other:?}"),
        }
    }
}

/// The pid of the terminal's `started` message.
async fn started(ws: &mut Ws) -> u64 {
    match next(ws).await {
        Message::Text(t) => {
            let v: serde_json::Value = serde_json::from_str(t.as_str()).unwrap();
            assert_eq!(v["type"], "started", "{v}");
            v["pid"].as_u64().expect("a pid")
        }
        other => panic!("the first terminal message: {other:?}"),
    }
}

async fn keys(ws: &mut Ws, s: &str) {
    ws.send(Message::binary(s.as_bytes().to_vec()))
        .await
        .unwrap();
}

#[test]
fn console_drives_a_two_node_cluster() {
    if let Some(r) = skip_reason() {
        eprintln!("SKIPPED: {r}");
        return;
    }
    let cluster = Cluster::start(2, 30);
    cluster.wait_nodes_listed(2);
    let page = Page::sign_in(cluster.gateway);
    let rt = tokio::runtime::Runtime::new().unwrap();

    // Both nodes, as the gateway lists them.
    let (st, nodes) = page.json("GET", "/console/api/rest/nodes", "");
    assert_eq!(st, 200, "{nodes}");
    let mut ids: Vec<&str> = nodes
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n["id"].as_str().unwrap())
        .collect();
    ids.sort();
    assert_eq!(ids, ["node-30", "node-31"]);

    let mut events = rt.block_on(page.socket("/console/api/events"));

    // A sandbox made through the pass-through shows up on the events socket.
    let (st, created) = page.json(
        "POST",
        "/console/api/rest/sandboxes",
        r#"{"templateID":"base","timeout":300,"metadata":{"via":"console"}}"#,
    );
    assert_eq!(st, 201, "{created}");
    let id = created["sandboxID"].as_str().unwrap().to_string();
    rt.block_on(sandboxes_until(&mut events, |items| {
        items.iter().any(|s| s["sandboxID"] == id.as_str())
    }));

    // A shell: output, a resize, and a socket dropped and re-attached by pid.
    let term = format!("/console/api/sandboxes/{id}/terminal?cols=80&rows=24");
    let pid = rt.block_on(async {
        let mut t = page.socket(&term).await;
        let pid = started(&mut t).await;
        keys(&mut t, "export CONSOLE_MARK=kept-$((40+2))\r").await;
        keys(&mut t, "echo console-$((6*7))\r").await;
        output_until(&mut t, "console-42").await;
        t.send(Message::text(r#"{"type":"resize","cols":123,"rows":45}"#))
            .await
            .unwrap();
        keys(&mut t, "stty size\r").await;
        output_until(&mut t, "45 123").await;
        drop(t);
        pid
    });
    rt.block_on(async {
        let mut t = page.socket(&format!("{term}&pid={pid}")).await;
        assert_eq!(started(&mut t).await, pid);
        keys(&mut t, "echo mark=$CONSOLE_MARK\r").await;
        output_until(&mut t, "mark=kept-42").await;
        // The shell exits: the page is told its code, then the socket closes.
        keys(&mut t, "exit 3\r").await;
        let exit = loop {
            match next(&mut t).await {
                Message::Binary(_) => continue,
                Message::Text(m) => {
                    break serde_json::from_str::<serde_json::Value>(m.as_str()).unwrap();
                }
                other => panic!("no exit message: {other:?}"),
            }
        };
        assert_eq!(exit, serde_json::json!({"type": "exit", "code": 3}));
        match next(&mut t).await {
            Message::Close(Some(f)) => assert_eq!(u16::from(f.code), 1000),
            other => panic!("no close after the exit: {other:?}"),
        }
    });

    // A file uploaded, listed and read back.
    let content = "uploaded through the console\n";
    let (st, _, b) = page.call(
        "POST",
        &format!("/console/api/sandboxes/{id}/file?path=/tmp/console-up/a%20file.txt"),
        content,
    );
    assert_eq!(st, 204, "{b}");
    let (st, dir) = page.json(
        "GET",
        &format!("/console/api/sandboxes/{id}/dir?path=/tmp/console-up"),
        "",
    );
    assert_eq!(st, 200, "{dir}");
    assert_eq!(dir["path"], "/tmp/console-up");
    let entry = &dir["entries"][0];
    assert_eq!(entry["name"], "a file.txt", "{dir}");
    assert_eq!(entry["path"], "/tmp/console-up/a file.txt");
    assert_eq!(entry["type"], "file");
    assert_eq!(entry["size"], content.len());
    assert!(entry["modifiedUnixMs"].as_i64().unwrap() > 0, "{dir}");
    let (st, h, b) = page.call(
        "GET",
        &format!("/console/api/sandboxes/{id}/file?path=/tmp/console-up/a%20file.txt"),
        "",
    );
    assert_eq!(st, 200);
    assert_eq!(b, content);
    let disposition = h
        .iter()
        .find(|(k, _)| k == "content-disposition")
        .map(|(_, v)| v.as_str());
    assert_eq!(
        disposition,
        Some("attachment; filename=\"a file.txt\"; filename*=UTF-8''a%20file%2Etxt")
    );
    let (st, _) = page.json(
        "GET",
        &format!("/console/api/sandboxes/{id}/dir?path=/no/such/dir"),
        "",
    );
    assert_eq!(st, 404);
    let (st, _) = page.json(
        "GET",
        &format!("/console/api/sandboxes/{id}/dir?path=relative"),
        "",
    );
    assert_eq!(st, 400);

    // A hundred open pages each get the live list (what they cost the gateway is
    // measured by `agentenv-proxy/examples/console_bench.rs`).
    let pages = rt.block_on(async {
        let mut pages = Vec::new();
        for _ in 0..100 {
            let mut p = page.socket("/console/api/events").await;
            sandboxes_until(&mut p, |items| {
                items.iter().any(|s| s["sandboxID"] == id.as_str())
            })
            .await;
            pages.push(p);
        }
        pages
    });
    drop(pages);

    // Paused: its files and terminal say to resume it first.
    let (st, _, b) = page.call(
        "POST",
        &format!("/console/api/rest/sandboxes/{id}/pause"),
        "",
    );
    assert!(st == 204 || st == 200, "pause: {st} {b}");
    rt.block_on(sandboxes_until(&mut events, |items| {
        items
            .iter()
            .any(|s| s["sandboxID"] == id.as_str() && s["state"] == "paused")
    }));
    let (st, v) = page.json(
        "GET",
        &format!("/console/api/sandboxes/{id}/dir?path=/"),
        "",
    );
    assert_eq!(st, 409, "{v}");
    assert_eq!(
        v["message"],
        format!("sandbox {id} is paused: resume it first")
    );

    // Killed through the pass-through: the events socket shows it gone.
    let (st, _, b) = page.call("DELETE", &format!("/console/api/rest/sandboxes/{id}"), "");
    assert_eq!(st, 204, "{b}");
    rt.block_on(sandboxes_until(&mut events, |items| {
        !items.iter().any(|s| s["sandboxID"] == id.as_str())
    }));
    let (st, _) = page.json(
        "GET",
        &format!("/console/api/sandboxes/{id}/dir?path=/"),
        "",
    );
    assert_eq!(st, 404);
}
