//! Template builds through the node's REST API with real jail build sandboxes: bad
//! input of every kind gets a clear status and publishes nothing; upload links are
//! signed and checked; a layer or build record changed in the shared store is refused.

mod node_common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use node_common::{Node, api, create, request, run};

/// A node whose template directory holds only `base` (hard links into the shared test
/// cache), so what it materializes is its own and goes with the test.
async fn node(home: &Path, slot: u8, step_timeout: Duration) -> Node {
    agentenv_testkit::node::ensure_base().await;
    let tpl = agentenv_testkit::node::templates_with_base(&home.join("templates"));
    let mut c = node_common::config(home, slot);
    c.template_path = tpl;
    c.template_step_timeout = step_timeout;
    c.oci_insecure_registries = vec!["127.0.0.1:1".into()];
    Node::start(c).await
}

/// `POST /v3/templates` for `name`: (template id, build id).
async fn new_build(addr: std::net::SocketAddr, name: &str) -> (String, String) {
    let r = api(
        addr,
        "POST",
        "/v3/templates",
        &format!(r#"{{"name":"{name}","cpuCount":1,"memoryMB":256}}"#),
    )
    .await;
    assert_eq!(r.status, 202, "{}", r.text());
    let v = r.json();
    for k in [
        "templateID",
        "buildID",
        "public",
        "names",
        "tags",
        "aliases",
    ] {
        assert!(!v[k].is_null(), "{k} in {v}");
    }
    (
        v["templateID"].as_str().unwrap().to_string(),
        v["buildID"].as_str().unwrap().to_string(),
    )
}

/// Starts the build with `body` and waits for it to end; returns the last status.
async fn build(
    addr: std::net::SocketAddr,
    name: &str,
    body: serde_json::Value,
) -> serde_json::Value {
    let (tid, bid) = new_build(addr, name).await;
    let r = api(
        addr,
        "POST",
        &format!("/v2/templates/{tid}/builds/{bid}"),
        &body.to_string(),
    )
    .await;
    assert_eq!(r.status, 202, "{}", r.text());
    node_common::wait_build(addr, &tid, &bid).await
}

/// The build failed at `step` with a message containing `want`; nothing is published
/// under `name`.
async fn assert_failed(
    addr: std::net::SocketAddr,
    name: &str,
    v: &serde_json::Value,
    step: &str,
    want: &str,
) {
    assert_eq!(v["status"], "error", "{v}");
    let msg = v["reason"]["message"].as_str().unwrap_or_default();
    assert!(msg.contains(want), "{msg:?} lacks {want:?}");
    assert_eq!(v["reason"]["step"], step, "{v}");
    let logged = v["logEntries"].as_array().unwrap();
    assert!(
        logged
            .iter()
            .any(|l| l["level"] == "error" && l["message"].as_str().unwrap().contains(want)),
        "the log says why: {logged:?}"
    );
    let r = api(addr, "GET", &format!("/templates/aliases/{name}"), "").await;
    assert_eq!(
        r.status,
        404,
        "nothing published under {name}: {}",
        r.text()
    );
    let r = api(
        addr,
        "POST",
        "/v2/sandboxes",
        &format!(r#"{{"templateID":"{name}"}}"#),
    )
    .await;
    assert!(
        r.status == 404 || r.status == 400,
        "no sandbox from {name}: {} {}",
        r.status,
        r.text()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_build_input_gets_a_clear_status_and_publishes_nothing() {
    require_node!();
    let home = tempfile::tempdir().unwrap();
    let node = node(home.path(), 60, Duration::from_secs(2)).await;
    let addr = node.addr;

    let v = build(
        addr,
        "bad-base",
        serde_json::json!({"fromTemplate": "no-such-template", "steps": []}),
    )
    .await;
    assert_failed(addr, "bad-base", &v, "base", "does not exist").await;

    let v = build(
        addr,
        "bad-registry",
        serde_json::json!({"fromImage": "127.0.0.1:1/nothing/here:1", "steps": []}),
    )
    .await;
    assert_failed(addr, "bad-registry", &v, "base", "127.0.0.1:1").await;

    let hash = "ab".repeat(32);
    let v = build(addr, "bad-files", serde_json::json!({
        "fromTemplate": "base",
        "steps": [{"type": "COPY", "args": ["app", "/app", "", ""], "filesHash": hash, "force": false}]
    }))
    .await;
    assert_failed(addr, "bad-files", &v, "1", "never uploaded").await;

    let v = build(
        addr,
        "bad-timeout",
        serde_json::json!({
            "fromTemplate": "base",
            "steps": [
                {"type": "RUN", "args": ["echo quick"], "force": false},
                {"type": "RUN", "args": ["sleep 30"], "force": false}
            ]
        }),
    )
    .await;
    assert_failed(addr, "bad-timeout", &v, "2", "time limit").await;

    let v = build(addr, "bad-run", serde_json::json!({
        "fromTemplate": "base",
        "steps": [{"type": "RUN", "args": ["echo the-output-of-the-step; exit 3"], "force": false}]
    }))
    .await;
    assert_failed(addr, "bad-run", &v, "1", "exit code 3").await;
    assert!(
        v["reason"]["message"]
            .as_str()
            .unwrap()
            .contains("the-output-of-the-step"),
        "{v}"
    );

    // Refused at once: an unknown step type (named), malformed COPY, both bases.
    let (tid, bid) = new_build(addr, "bad-steps").await;
    for (body, want) in [
        (
            serde_json::json!({"steps": [{"type": "ONBUILD", "args": ["x"]}]}),
            "\"ONBUILD\" is not supported",
        ),
        (
            serde_json::json!({"steps": [{"type": "COPY", "args": ["a", "/b"]}]}),
            "filesHash",
        ),
        (
            serde_json::json!({"fromTemplate": "base", "fromImage": "x", "steps": []}),
            "not both",
        ),
    ] {
        let r = api(
            addr,
            "POST",
            &format!("/v2/templates/{tid}/builds/{bid}"),
            &body.to_string(),
        )
        .await;
        assert_eq!(r.status, 400, "{}", r.text());
        assert!(
            r.json()["message"].as_str().unwrap().contains(want),
            "{}",
            r.text()
        );
    }
    // Names: the built-in one, malformed ones, one a snapshot holds.
    for (name, status) in [("base", 400), ("Bad Name", 400), ("-x", 400)] {
        let r = api(
            addr,
            "POST",
            "/v3/templates",
            &format!(r#"{{"name":"{name}"}}"#),
        )
        .await;
        assert_eq!(r.status, status, "{name}: {}", r.text());
    }
    let sbx = create(addr, r#"{"templateID":"base","timeout":60}"#).await;
    let r = api(
        addr,
        "POST",
        &format!("/sandboxes/{sbx}/snapshots"),
        r#"{"name":"snap-taken"}"#,
    )
    .await;
    assert_eq!(r.status, 201, "{}", r.text());
    let r = api(addr, "POST", "/v3/templates", r#"{"name":"snap-taken"}"#).await;
    assert_eq!(r.status, 409, "{}", r.text());
    assert!(
        r.json()["message"].as_str().unwrap().contains("snapshot"),
        "{}",
        r.text()
    );
    // Unknown templates and builds.
    let r = api(
        addr,
        "GET",
        &format!("/templates/{tid}/builds/{}/status", uuid_like()),
        "",
    )
    .await;
    assert_eq!(r.status, 404, "{}", r.text());
    let r = api(addr, "GET", "/templates/nothing-here/builds/x/status", "").await;
    assert_eq!(r.status, 404, "{}", r.text());
    // Nothing failed left a local template behind.
    let left: Vec<String> = std::fs::read_dir(home.path().join("templates"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| !n.starts_with('.') && n != "base")
        .collect();
    assert!(left.is_empty(), "{left:?}");
    node.stop().await;
}

fn uuid_like() -> &'static str {
    "01936f8e-72f5-7000-8000-000000000001"
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upload_links_are_signed_and_a_build_copies_the_files() {
    require_node!();
    let home = tempfile::tempdir().unwrap();
    let node = node(home.path(), 61, Duration::from_secs(120)).await;
    let addr = node.addr;
    let (tid, bid) = new_build(addr, "uploads").await;
    let hash = "cd".repeat(32);
    // The link needs the API key; the upload needs the link's signature, not the key.
    let r = request(
        addr,
        "GET",
        &format!("/templates/{tid}/files/{hash}"),
        &[],
        "",
    )
    .await;
    assert_eq!(r.status, 401);
    let r = api(addr, "GET", &format!("/templates/{tid}/files/{hash}"), "").await;
    assert_eq!(r.status, 201, "{}", r.text());
    assert_eq!(r.json()["present"], false);
    let url = r.json()["url"].as_str().unwrap().to_string();
    let path = url
        .strip_prefix(&format!("http://{addr}"))
        .expect("a link to this node")
        .to_string();
    // A tar.gz of app/hello.txt and a symlink, as the SDK makes it.
    let archive = {
        let mut b = tar::Builder::new(flate2::write::GzEncoder::new(
            Vec::new(),
            flate2::Compression::fast(),
        ));
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(tar::EntryType::Directory);
        h.set_mode(0o755);
        h.set_size(0);
        b.append_data(&mut h, "app", std::io::empty()).unwrap();
        let mut h = tar::Header::new_gnu();
        h.set_mode(0o644);
        h.set_size(6);
        b.append_data(&mut h, "app/hello.txt", &b"hello\n"[..])
            .unwrap();
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(tar::EntryType::Symlink);
        h.set_size(0);
        b.append_link(&mut h, "app/link", "hello.txt").unwrap();
        b.into_inner().unwrap().finish().unwrap()
    };
    for bad in [
        path.replace("signature=", "signature=00"),
        path.replace("expires=", "expires=1"),
        path.replace(&hash, &"ef".repeat(32)),
        format!("/templates/{tid}/files/{hash}"),
    ] {
        let r = request(addr, "PUT", &bad, &[], archive.clone()).await;
        assert_eq!(r.status, 403, "{bad}: {}", r.text());
    }
    let r = request(addr, "PUT", &path, &[], archive.clone()).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let r = api(addr, "GET", &format!("/templates/{tid}/files/{hash}"), "").await;
    assert_eq!(r.json(), serde_json::json!({"present": true}));

    let body = serde_json::json!({
        "fromTemplate": "base",
        "steps": [
            {"type": "USER", "args": ["worker"], "force": false},
            {"type": "WORKDIR", "args": ["/srv"], "force": false},
            {"type": "COPY", "args": ["app", "dest/", "worker:worker", "0750"], "filesHash": hash, "force": false},
            {"type": "RUN", "args": ["id -un > whoami && pwd > where"], "force": false}
        ]
    });
    let r = api(
        addr,
        "POST",
        &format!("/v2/templates/{tid}/builds/{bid}"),
        &body.to_string(),
    )
    .await;
    assert_eq!(r.status, 202, "{}", r.text());
    let v = node_common::wait_build(addr, &tid, &bid).await;
    assert_eq!(v["status"], "ready", "{v}");
    let r = api(
        addr,
        "POST",
        "/v2/sandboxes",
        r#"{"templateID":"uploads","timeout":60}"#,
    )
    .await;
    assert_eq!(r.status, 201, "{}", r.text());
    assert_eq!(r.json()["templateID"], tid.as_str());
    assert_eq!(r.json()["alias"], "uploads");
    let id = r.json()["sandboxID"].as_str().unwrap().to_string();
    let out = run(
        addr,
        &id,
        None,
        "cat /srv/dest/hello.txt; readlink /srv/dest/link; stat -c '%U %a' /srv/dest/hello.txt; cat /srv/whoami /srv/where",
    )
    .await
    .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "hello\nhello.txt\nworker 750\nworker\n/srv\n"
    );
    node.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_layer_or_build_changed_in_the_store_is_refused() {
    require_node!();
    let home = tempfile::tempdir().unwrap();
    let node = node(home.path(), 62, Duration::from_secs(120)).await;
    let addr = node.addr;
    let v = build(
        addr,
        "tamper",
        serde_json::json!({
            "fromTemplate": "base",
            "steps": [{"type": "RUN", "args": ["echo original > /etc/tamper"], "force": false}]
        }),
    )
    .await;
    assert_eq!(v["status"], "ready", "{v}");
    let store = home.path().join("snapshot-store/repository/templates");
    // Someone with write access to the store swaps the layer's content.
    let layers: Vec<PathBuf> = std::fs::read_dir(store.join("layers"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .collect();
    assert_eq!(layers.len(), 1, "{layers:?}");
    let forged = {
        let mut b = tar::Builder::new(Vec::new());
        let mut h = tar::Header::new_gnu();
        h.set_mode(0o644);
        h.set_size(7);
        b.append_data(&mut h, "etc/tamper", &b"forged\n"[..])
            .unwrap();
        zstd::encode_all(&b.into_inner().unwrap()[..], 1).unwrap()
    };
    let original = std::fs::read(&layers[0]).unwrap();
    std::fs::write(&layers[0], &forged).unwrap();
    let r = api(
        addr,
        "POST",
        "/v2/sandboxes",
        r#"{"templateID":"tamper","timeout":60}"#,
    )
    .await;
    assert_eq!(r.status, 500, "{}", r.text());
    assert!(
        r.json()["message"].as_str().unwrap().contains("refused"),
        "{}",
        r.text()
    );
    // And a build record edited to point elsewhere does not verify.
    std::fs::write(&layers[0], &original).unwrap();
    let builds: Vec<PathBuf> = std::fs::read_dir(store.join("builds"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .collect();
    let text = std::fs::read_to_string(&builds[0]).unwrap();
    std::fs::write(
        &builds[0],
        text.replace("\\\"cpu_count\\\":1", "\\\"cpu_count\\\":2"),
    )
    .unwrap();
    let r = api(
        addr,
        "POST",
        "/v2/sandboxes",
        r#"{"templateID":"tamper","timeout":60}"#,
    )
    .await;
    assert!(r.status >= 400, "{}", r.text());
    assert!(r.text().contains("refused"), "{}", r.text());
    std::fs::write(&builds[0], text).unwrap();
    // Untouched, it starts.
    let id = create(addr, r#"{"templateID":"tamper","timeout":60}"#).await;
    let out = run(addr, &id, None, "cat /etc/tamper").await.unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "original\n");
    node.stop().await;
}
