//! The console's security on a real gateway and scheduler on loopback: no
//! session, no data; state changes need the CSRF token; a cookie is good only
//! at the gateway that issued it; sockets refuse foreign origins before the
//! upgrade; sign-out ends the session at once; the API key never comes back;
//! the cookie's flags; a turned-off console is 404; routing headers never
//! take a console request to a sandbox.

mod common;

use std::net::SocketAddr;

use agentenv_proxy::GatewayOptions;
use bytes::Bytes;
use common::*;
use futures::StreamExt;
use http::{HeaderMap, Method, Request, StatusCode};
use http_body_util::Full;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;

/// A gateway with one ready node (an echo node holding `sbx-1`).
async fn gateway() -> (Cluster, FakeNode, Log) {
    gateway_with(options()).await
}

async fn gateway_with(opts: GatewayOptions) -> (Cluster, FakeNode, Log) {
    let (node, log) = FakeNode::echo().await;
    let c = Cluster::ready(&[("node-a", &node.endpoint)], opts).await;
    c.heartbeat("node-a", &["sbx-1"]).await;
    (c, node, log)
}

fn origin(addr: SocketAddr) -> String {
    format!("http://{addr}")
}

/// A console request: `cookie` and `csrf` when given, the page's own Origin.
fn console_req(
    c: &Cluster,
    method: Method,
    path: &str,
    cookie: Option<&str>,
    csrf: Option<&str>,
    body: &str,
) -> Request<Full<Bytes>> {
    let mut b = Request::builder()
        .method(method)
        .uri(c.url(path))
        .header("origin", origin(c.addr))
        .header("content-type", "application/json");
    if let Some(k) = cookie {
        b = b.header("cookie", k);
    }
    if let Some(t) = csrf {
        b = b.header("x-csrf-token", t);
    }
    b.body(Full::new(Bytes::from(body.to_string()))).unwrap()
}

/// Signs in; the `Cookie` header value to send, the CSRF token and the
/// `Set-Cookie` the gateway answered.
async fn sign_in(c: &Cluster) -> (String, String, String) {
    let body = format!(r#"{{"apiKey":"{API_KEY}"}}"#);
    let (st, h, b) = send(console_req(
        c,
        Method::POST,
        "/console/api/session",
        None,
        None,
        &body,
    ))
    .await;
    assert_eq!(st, StatusCode::OK, "{}", String::from_utf8_lossy(&b));
    let set = h["set-cookie"].to_str().unwrap().to_string();
    let value = set.split(';').next().unwrap().to_string();
    let csrf = json(&b)["csrfToken"].as_str().unwrap().to_string();
    (value, csrf, set)
}

/// Asserts the API key is nowhere in an answer.
fn no_key(h: &HeaderMap, b: &[u8]) {
    assert!(
        !String::from_utf8_lossy(b).contains(API_KEY),
        "the key in a body"
    );
    for (n, v) in h {
        assert!(
            !String::from_utf8_lossy(v.as_bytes()).contains(API_KEY),
            "the key in header {n}"
        );
    }
}

/// A WebSocket handshake to `path`; the refusal's status, or the socket.
type Socket =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

/// The next JSON text message of an events socket.
async fn next_json(s: &mut Socket) -> serde_json::Value {
    let Some(Ok(Message::Text(t))) = s.next().await else {
        panic!("the events socket ended")
    };
    serde_json::from_str(t.as_str()).unwrap()
}

async fn ws(
    addr: SocketAddr,
    path: &str,
    cookie: Option<&str>,
    origin: Option<&str>,
) -> Result<Socket, (StatusCode, String)> {
    let mut req = format!("ws://{addr}{path}").into_client_request().unwrap();
    if let Some(k) = cookie {
        req.headers_mut().insert("cookie", k.parse().unwrap());
    }
    if let Some(o) = origin {
        req.headers_mut().insert("origin", o.parse().unwrap());
    }
    match tokio_tungstenite::connect_async(req).await {
        Ok((s, _)) => Ok(s),
        Err(tokio_tungstenite::tungstenite::Error::Http(resp)) => {
            let body = resp
                .body()
                .as_ref()
                .map(|b| String::from_utf8_lossy(b).into_owned())
                .unwrap_or_default();
            Err((resp.status(), body))
        }
        Err(e) => panic!("handshake to {path}: {e}"),
    }
}

const API_ROUTES: [(&str, &str); 8] = [
    ("GET", "/console/api/session"),
    ("GET", "/console/api/rest/nodes"),
    ("GET", "/console/api/rest/v2/sandboxes"),
    ("POST", "/console/api/rest/sandboxes"),
    ("DELETE", "/console/api/rest/sandboxes/sbx-1"),
    ("GET", "/console/api/sandboxes/sbx-1/dir?path=/"),
    (
        "GET",
        "/console/api/sandboxes/sbx-1/file?path=/etc/hostname",
    ),
    ("POST", "/console/api/sandboxes/sbx-1/file?path=/tmp/x"),
];

#[tokio::test]
async fn without_a_session_every_api_route_is_401_with_no_data() {
    let (c, _node, log) = gateway().await;
    for (method, path) in API_ROUTES {
        let m = Method::from_bytes(method.as_bytes()).unwrap();
        let (st, h, b) = send(console_req(&c, m, path, None, None, "{}")).await;
        assert_eq!(st, StatusCode::UNAUTHORIZED, "{method} {path}");
        assert_eq!(
            json(&b),
            serde_json::json!({"code": 401, "message": "sign in first"})
        );
        no_key(&h, &b);
        // A cookie the gateway never issued is no session either.
        let m = Method::from_bytes(method.as_bytes()).unwrap();
        let forged =
            "agentenv_console=00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff";
        let (st, _, _) = send(console_req(&c, m, path, Some(forged), None, "{}")).await;
        assert_eq!(
            st,
            StatusCode::UNAUTHORIZED,
            "{method} {path} with a forged cookie"
        );
    }
    for path in [
        "/console/api/events",
        "/console/api/sandboxes/sbx-1/terminal?cols=80&rows=24",
    ] {
        let (st, body) = ws(c.addr, path, None, Some(&origin(c.addr)))
            .await
            .expect_err("no upgrade without a session");
        assert_eq!(st, StatusCode::UNAUTHORIZED, "{path}");
        assert!(body.contains("sign in first"), "{path}: {body}");
    }
    assert!(log.lock().is_empty(), "nothing reached the node");
}

#[tokio::test]
async fn a_wrong_or_missing_api_key_does_not_sign_in() {
    let (c, _node, _) = gateway().await;
    for body in [
        r#"{"apiKey":"e2b_0123456789abcdef0123456789abcdef0124"}"#.to_string(),
        r#"{"apiKey":""}"#.to_string(),
        "{}".to_string(),
        "not json".to_string(),
    ] {
        let (st, h, b) = send(console_req(
            &c,
            Method::POST,
            "/console/api/session",
            None,
            None,
            &body,
        ))
        .await;
        assert_eq!(st, StatusCode::UNAUTHORIZED, "{body}");
        assert_eq!(json(&b)["message"], "invalid API key");
        assert!(h.get("set-cookie").is_none());
    }
    // Another site's page cannot sign in with a key it guessed either.
    let mut req = console_req(
        &c,
        Method::POST,
        "/console/api/session",
        None,
        None,
        &format!(r#"{{"apiKey":"{API_KEY}"}}"#),
    );
    req.headers_mut()
        .insert("origin", "http://evil.example".parse().unwrap());
    let (st, _, b) = send(req).await;
    assert_eq!(st, StatusCode::FORBIDDEN);
    assert_eq!(json(&b)["message"], "cross-origin request refused");
}

#[tokio::test]
async fn the_session_cookie_is_http_only_strict_and_scoped_and_the_key_never_comes_back() {
    let (c, _node, log) = gateway().await;
    let (cookie, csrf, set) = sign_in(&c).await;
    assert!(set.starts_with("agentenv_console="), "{set}");
    let flags: Vec<&str> = set.split(';').map(str::trim).collect();
    for f in [
        "HttpOnly",
        "SameSite=Strict",
        "Path=/console",
        "Max-Age=43200",
    ] {
        assert!(flags.contains(&f), "{f} in {set}");
    }
    assert!(
        !flags.contains(&"Secure"),
        "plain HTTP: no Secure flag: {set}"
    );
    assert_eq!(cookie.len(), "agentenv_console=".len() + 64);

    let (st, h, b) = send(console_req(
        &c,
        Method::GET,
        "/console/api/session",
        Some(&cookie),
        None,
        "",
    ))
    .await;
    assert_eq!(st, StatusCode::OK);
    assert_eq!(json(&b)["csrfToken"], csrf.as_str());
    assert!(json(&b)["expiresAtUnixMs"].as_u64().unwrap() > 0);
    assert_eq!(h["cache-control"], "no-store");
    no_key(&h, &b);

    // A pass-through call reaches the node with the key, and with none of
    // the console's own credentials.
    let (st, h, b) = send(console_req(
        &c,
        Method::GET,
        "/console/api/rest/nodes",
        Some(&cookie),
        None,
        "",
    ))
    .await;
    assert_eq!(st, StatusCode::OK);
    assert_eq!(json(&b)[0]["id"], "node-a");
    no_key(&h, &b);
    let (st, _, _) = send(console_req(
        &c,
        Method::POST,
        "/console/api/rest/sandboxes/sbx-1/pause",
        Some(&cookie),
        Some(&csrf),
        "{}",
    ))
    .await;
    assert_eq!(st, StatusCode::OK);
    let seen = log.lock().last().cloned().expect("the node got the call");
    assert_eq!(seen.uri, "/sandboxes/sbx-1/pause");
    assert_eq!(seen.headers["x-api-key"], API_KEY);
    assert!(seen.headers.get("cookie").is_none());
    assert!(seen.headers.get("x-csrf-token").is_none());
}

#[tokio::test]
async fn state_changing_calls_need_the_csrf_token() {
    let (c, _node, log) = gateway().await;
    let (cookie, csrf, _) = sign_in(&c).await;
    let wrong = "0".repeat(csrf.len());
    for token in [None, Some(wrong.as_str()), Some("short")] {
        for (method, path) in [
            (Method::POST, "/console/api/rest/sandboxes/sbx-1/pause"),
            (Method::DELETE, "/console/api/rest/sandboxes/sbx-1"),
            (
                Method::POST,
                "/console/api/sandboxes/sbx-1/file?path=/tmp/x",
            ),
            (Method::DELETE, "/console/api/session"),
        ] {
            let (st, _, b) = send(console_req(
                &c,
                method.clone(),
                path,
                Some(&cookie),
                token,
                "{}",
            ))
            .await;
            assert_eq!(st, StatusCode::FORBIDDEN, "{method} {path} with {token:?}");
            assert_eq!(
                json(&b)["message"],
                "missing or wrong CSRF token: reload the console"
            );
        }
    }
    assert!(log.lock().is_empty(), "nothing reached the node");
    // A foreign Origin is refused even with the token.
    let mut req = console_req(
        &c,
        Method::POST,
        "/console/api/rest/sandboxes/sbx-1/pause",
        Some(&cookie),
        Some(&csrf),
        "{}",
    );
    req.headers_mut()
        .insert("origin", "http://evil.example".parse().unwrap());
    assert_eq!(send(req).await.0, StatusCode::FORBIDDEN);
    // With the token the call goes through; the session is still there.
    let (st, _, _) = send(console_req(
        &c,
        Method::POST,
        "/console/api/rest/sandboxes/sbx-1/pause",
        Some(&cookie),
        Some(&csrf),
        "{}",
    ))
    .await;
    assert_eq!(st, StatusCode::OK);
    assert_eq!(log.lock().len(), 1);
}

#[tokio::test]
async fn a_cookie_from_one_gateway_is_refused_by_another() {
    let (a, _na, _) = gateway().await;
    let (b, _nb, _) = gateway().await;
    let (cookie, csrf, _) = sign_in(&a).await;
    let (st, _, _) = send(console_req(
        &b,
        Method::GET,
        "/console/api/session",
        Some(&cookie),
        None,
        "",
    ))
    .await;
    assert_eq!(st, StatusCode::UNAUTHORIZED);
    let (st, _, _) = send(console_req(
        &b,
        Method::GET,
        "/console/api/rest/nodes",
        Some(&cookie),
        None,
        "",
    ))
    .await;
    assert_eq!(st, StatusCode::UNAUTHORIZED);
    let (st, _, _) = send(console_req(
        &b,
        Method::DELETE,
        "/console/api/rest/sandboxes/sbx-1",
        Some(&cookie),
        Some(&csrf),
        "",
    ))
    .await;
    assert_eq!(st, StatusCode::UNAUTHORIZED);
    assert!(
        ws(
            b.addr,
            "/console/api/events",
            Some(&cookie),
            Some(&origin(b.addr))
        )
        .await
        .is_err()
    );
    // Still good where it was issued.
    let (st, _, _) = send(console_req(
        &a,
        Method::GET,
        "/console/api/session",
        Some(&cookie),
        None,
        "",
    ))
    .await;
    assert_eq!(st, StatusCode::OK);
}

#[tokio::test]
async fn sockets_refuse_a_foreign_or_missing_origin_before_the_upgrade() {
    let (c, _node, log) = gateway().await;
    let (cookie, _, _) = sign_in(&c).await;
    for path in [
        "/console/api/events",
        "/console/api/sandboxes/sbx-1/terminal?cols=80&rows=24",
    ] {
        for o in [Some("http://evil.example"), Some("null"), None] {
            let (st, body) = ws(c.addr, path, Some(&cookie), o)
                .await
                .expect_err("no upgrade");
            assert_eq!(st, StatusCode::FORBIDDEN, "{path} from {o:?}");
            assert!(body.contains("cross-origin request refused"), "{body}");
        }
    }
    assert!(log.lock().is_empty(), "the terminal never reached the node");
    // The page's own origin is upgraded and gets the nodes.
    let mut s = ws(
        c.addr,
        "/console/api/events",
        Some(&cookie),
        Some(&origin(c.addr)),
    )
    .await
    .expect("upgraded");
    let nodes = loop {
        let v = next_json(&mut s).await;
        if v["type"] == "nodes" {
            break v;
        }
    };
    assert_eq!(nodes["items"][0]["id"], "node-a");
}

#[tokio::test]
async fn sign_out_ends_the_session_and_its_sockets() {
    let (c, _node, _) = gateway().await;
    let (cookie, csrf, _) = sign_in(&c).await;
    let mut s = ws(
        c.addr,
        "/console/api/events",
        Some(&cookie),
        Some(&origin(c.addr)),
    )
    .await
    .expect("upgraded");
    let (st, h, _) = send(console_req(
        &c,
        Method::DELETE,
        "/console/api/session",
        Some(&cookie),
        Some(&csrf),
        "",
    ))
    .await;
    assert_eq!(st, StatusCode::NO_CONTENT);
    let cleared = h["set-cookie"].to_str().unwrap();
    assert!(
        cleared.starts_with("agentenv_console=;") && cleared.contains("Max-Age=0"),
        "{cleared}"
    );
    for path in ["/console/api/session", "/console/api/rest/nodes"] {
        let (st, _, _) = send(console_req(&c, Method::GET, path, Some(&cookie), None, "")).await;
        assert_eq!(st, StatusCode::UNAUTHORIZED, "{path}");
    }
    let closed = loop {
        match s.next().await {
            Some(Ok(Message::Close(f))) => break f.expect("a close frame"),
            Some(Ok(_)) => continue,
            other => panic!("no close frame: {other:?}"),
        }
    };
    assert_eq!(u16::from(closed.code), 4001);
    assert_eq!(closed.reason.as_str(), "signed out");
}

#[tokio::test]
async fn console_answers_carry_the_security_headers() {
    let (c, _node, _) = gateway().await;
    let (st, h, _) = send(Request::get(c.url("/console")).empty()).await;
    assert_eq!(st, StatusCode::PERMANENT_REDIRECT);
    assert_eq!(h["location"], "/console/");
    let (st, h, b) = send(Request::get(c.url("/console/")).empty()).await;
    assert_eq!(st, StatusCode::OK);
    assert!(h["content-type"].to_str().unwrap().starts_with("text/html"));
    assert!(String::from_utf8_lossy(&b).contains("<html"));
    assert!(
        h["content-security-policy"]
            .to_str()
            .unwrap()
            .contains("frame-ancestors 'none'")
    );
    assert_eq!(h["x-content-type-options"], "nosniff");
    assert_eq!(h["referrer-policy"], "no-referrer");
    assert_eq!(h["x-frame-options"], "DENY");
    assert_eq!(h["cache-control"], "no-cache");
    let etag = h["etag"].clone();
    let (st, _, _) = send(
        Request::get(c.url("/console/"))
            .header("if-none-match", etag)
            .empty(),
    )
    .await;
    assert_eq!(st, StatusCode::NOT_MODIFIED);
    let (st, h, _) = send(Request::get(c.url("/console/assets/nope.js")).empty()).await;
    assert_eq!(st, StatusCode::NOT_FOUND);
    assert_eq!(h["x-frame-options"], "DENY");
    let (st, h, _) = send(Request::get(c.url("/console/api/session")).empty()).await;
    assert_eq!(st, StatusCode::UNAUTHORIZED);
    assert_eq!(h["cache-control"], "no-store");
    assert!(h.contains_key("content-security-policy"));
}

#[tokio::test]
async fn the_pass_through_refuses_the_data_plane_and_the_gateways_own_paths() {
    let (c, _node, log) = gateway().await;
    let (cookie, _, _) = sign_in(&c).await;
    for path in [
        "metrics",
        "health",
        "proxy/x",
        "files?path=/etc/passwd",
        "process.Process/List",
        "console/api/session",
        "sandboxes/..%2F..%2Fhealth",
        "sandboxes/%2e%2e/metrics",
    ] {
        let (st, _, b) = send(console_req(
            &c,
            Method::GET,
            &format!("/console/api/rest/{path}"),
            Some(&cookie),
            None,
            "",
        ))
        .await;
        assert_eq!(st, StatusCode::NOT_FOUND, "{path}");
        assert_eq!(json(&b)["message"], "not a console API path", "{path}");
    }
    assert!(log.lock().is_empty());
}

#[tokio::test]
async fn routing_headers_never_take_a_console_request_to_a_sandbox() {
    let (c, _node, log) = gateway().await;
    for path in ["/console/", "/console/api/session"] {
        for route in [
            [("e2b-sandbox-id", "sbx-1"), ("e2b-sandbox-port", "49983")],
            [
                ("x-agentenv-sandbox-id", "sbx-1"),
                ("x-agentenv-target-port", "49983"),
            ],
        ] {
            let mut b = Request::get(c.url(path));
            for (k, v) in route {
                b = b.header(k, v);
            }
            let (st, h, _) = send(b.empty()).await;
            assert!(
                st == StatusCode::OK || st == StatusCode::UNAUTHORIZED,
                "{path}: {st}"
            );
            assert!(h.contains_key("content-security-policy"), "{path}");
        }
    }
    assert!(log.lock().is_empty(), "nothing was proxied");
}

#[tokio::test]
async fn a_turned_off_console_is_404_and_nothing_else_changes() {
    let mut opts = options();
    opts.console.enabled = false;
    let (c, _node, _) = gateway_with(opts).await;
    for path in [
        "/console",
        "/console/",
        "/console/api/session",
        "/console/assets/app.js",
    ] {
        let (st, _, b) = send(Request::get(c.url(path)).empty()).await;
        assert_eq!(st, StatusCode::NOT_FOUND, "{path}");
        assert_eq!(
            json(&b),
            serde_json::json!({"code": 404, "message": "the console is turned off (gateway.console.enabled)"})
        );
    }
    let (st, _, _) = get(&c.url("/nodes")).await;
    assert_eq!(st, StatusCode::OK);
}

#[tokio::test]
async fn under_tls_the_cookie_is_secure_and_the_origin_is_https() {
    let (c, _node, _) = gateway().await;
    // An embedding server that terminates TLS mounts `service_tls`.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let gw = c.gateway.clone();
    tokio::spawn(async move {
        loop {
            let (s, remote) = listener.accept().await.unwrap();
            let svc = gw.service_tls(remote);
            tokio::spawn(
                hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(s), svc)
                    .with_upgrades(),
            );
        }
    });
    let body = format!(r#"{{"apiKey":"{API_KEY}"}}"#);
    let signin = |o: &str| {
        Request::post(format!("http://{addr}/console/api/session"))
            .header("origin", o)
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body.clone())))
            .unwrap()
    };
    let (st, _, _) = send(signin(&format!("http://{addr}"))).await;
    assert_eq!(
        st,
        StatusCode::FORBIDDEN,
        "an http origin on a TLS connection"
    );
    let (st, h, _) = send(signin(&format!("https://{addr}"))).await;
    assert_eq!(st, StatusCode::OK);
    let set = h["set-cookie"].to_str().unwrap();
    assert!(set.split(';').any(|f| f.trim() == "Secure"), "{set}");
}

#[tokio::test]
async fn behind_a_tls_proxy_the_forwarded_scheme_counts() {
    let (c, _node, _) = gateway().await;
    let body = format!(r#"{{"apiKey":"{API_KEY}"}}"#);
    let signin = |o: String| {
        Request::post(c.url("/console/api/session"))
            .header("origin", o)
            .header("x-forwarded-proto", "https")
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body.clone())))
            .unwrap()
    };
    let (st, _, _) = send(signin(format!("http://{}", c.addr))).await;
    assert_eq!(st, StatusCode::FORBIDDEN);
    let (st, h, _) = send(signin(format!("https://{}", c.addr))).await;
    assert_eq!(st, StatusCode::OK);
    let set = h["set-cookie"].to_str().unwrap();
    assert!(set.split(';').any(|f| f.trim() == "Secure"), "{set}");
}

#[tokio::test]
async fn an_unused_session_expires_after_its_ttl() {
    let mut opts = options();
    opts.console.session_ttl = std::time::Duration::from_millis(1500);
    let (c, _node, _) = gateway_with(opts).await;
    let (cookie, _, set) = sign_in(&c).await;
    assert!(set.contains("Max-Age=2"), "{set}");
    let (st, _, _) = send(console_req(
        &c,
        Method::GET,
        "/console/api/rest/nodes",
        Some(&cookie),
        None,
        "",
    ))
    .await;
    assert_eq!(st, StatusCode::OK);
    tokio::time::sleep(std::time::Duration::from_millis(1600)).await;
    for path in ["/console/api/session", "/console/api/rest/nodes"] {
        let (st, _, _) = send(console_req(&c, Method::GET, path, Some(&cookie), None, "")).await;
        assert_eq!(st, StatusCode::UNAUTHORIZED, "{path}");
    }
}

#[tokio::test]
async fn the_events_socket_says_when_no_node_reports() {
    // Listed in the scheduler's config, but no heartbeat yet.
    let c = Cluster::start(&[("node-a", "http://127.0.0.1:9")], options()).await;
    let (cookie, _, _) = sign_in(&c).await;
    let mut s = ws(
        c.addr,
        "/console/api/events",
        Some(&cookie),
        Some(&origin(c.addr)),
    )
    .await
    .expect("upgraded");
    let error = loop {
        let v = next_json(&mut s).await;
        if v["type"] == "error" {
            break v;
        }
    };
    assert!(
        error["message"]
            .as_str()
            .unwrap()
            .contains("no nodes are reporting: check the scheduler (docs/troubleshooting.md)"),
        "{error}"
    );
    // A node reports: its data follows.
    c.heartbeat("node-a", &[]).await;
    loop {
        let v = next_json(&mut s).await;
        if v["type"] == "nodes" && v["items"][0]["id"] == "node-a" {
            break;
        }
    }
}

#[tokio::test]
async fn a_hundred_pages_share_one_poller() {
    let (c, _node, _) = gateway().await;
    let (cookie, _, _) = sign_in(&c).await;
    let mut pages = Vec::new();
    for _ in 0..100 {
        pages.push(
            ws(
                c.addr,
                "/console/api/events",
                Some(&cookie),
                Some(&origin(c.addr)),
            )
            .await
            .expect("upgraded"),
        );
    }
    for s in &mut pages {
        loop {
            if next_json(s).await["type"] == "nodes" {
                break;
            }
        }
    }
    // A poller per page would have asked for the nodes at least once per page.
    let asked = c.count("ListObservedNodes");
    assert!((1..50).contains(&asked), "{asked} node lists for 100 pages");
}

#[tokio::test]
async fn a_hung_node_holds_up_only_the_sandbox_list_which_reports_it() {
    // A node that takes connections and never answers.
    let hung = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("http://{}", hung.local_addr().unwrap());
    let holder = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((conn, _)) = hung.accept().await {
            held.push(conn);
        }
    });
    let c = Cluster::ready(&[("node-a", &endpoint)], options()).await;
    let (cookie, _, _) = sign_in(&c).await;
    let mut s = ws(
        c.addr,
        "/console/api/events",
        Some(&cookie),
        Some(&origin(c.addr)),
    )
    .await
    .expect("upgraded");
    let mut nodes_before_error = 0;
    let error = loop {
        let v = next_json(&mut s).await;
        match v["type"].as_str() {
            Some("nodes") => nodes_before_error += 1,
            Some("error") => break v,
            Some("sandboxes") => panic!("a list from a node that never answers: {v}"),
            _ => {}
        }
    };
    assert_eq!(nodes_before_error, 1, "the nodes came at once");
    // The list gives up on the node (the request timeout) or the poller on the
    // list (10 s), whichever comes first: either way the page is told.
    assert_eq!(error["list"], "sandboxes", "{error}");
    let message = error["message"].as_str().unwrap();
    assert!(
        message.contains("a node may be hung") || message.contains("cluster list unavailable"),
        "{error}"
    );
    holder.abort();
}
