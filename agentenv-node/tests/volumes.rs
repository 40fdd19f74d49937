//! Volumes through the node's REST API, with real jail sandboxes and a real shared
//! directory (two in-process nodes on one `posix_fs` store for "another node"), the
//! volume content API, a tenant's links against the node, and the `oss` store (moto's
//! S3 server from PyPI on loopback).

mod node_common;

use std::os::unix::fs::MetadataExt;
use std::path::Path;

use agentenv_core::storage::{OpendalStorage, Storage, StorageConfig};
use agentenv_node::config::NodeConfig;
use agentenv_testkit::moto::Moto;
use node_common::{Node, Resp, api, create, delete, request, sh_ok, snapshot};

/// A node on `slot` whose snapshot store (and so its volumes) is the shared `store`.
fn config_on(home: &Path, slot: u8, store: &Path) -> NodeConfig {
    let mut c = node_common::config(home, slot);
    c.snapshot_repository = StorageConfig::Fs {
        root: store.join("repository"),
    };
    assert_eq!(c.volume_path(), store.join("volumes"));
    c
}

/// A create body for template `base` mounting volume `name` at `path`.
fn mounting(template: &str, name: &str, path: &str) -> String {
    format!(
        r#"{{"templateID":"{template}","timeout":300,"volumeMounts":[{{"name":"{name}","path":"{path}"}}]}}"#
    )
}

/// Creates volume `name`; returns its id and token.
async fn new_volume(addr: std::net::SocketAddr, name: &str) -> (String, String) {
    let r = api(addr, "POST", "/volumes", &format!(r#"{{"name":"{name}"}}"#)).await;
    assert_eq!(r.status, 201, "{}", r.text());
    let v = r.json();
    assert_eq!(v["name"], name);
    (
        v["volumeID"].as_str().unwrap().to_string(),
        v["token"].as_str().unwrap().to_string(),
    )
}

/// A content API call with `token`.
async fn content(
    addr: std::net::SocketAddr,
    method: &str,
    path: &str,
    token: &str,
    body: &'static [u8],
) -> Resp {
    let auth = format!("Bearer {token}");
    request(addr, method, path, &[("authorization", &auth)], body).await
}

fn message(r: &Resp) -> String {
    r.json()["message"].as_str().unwrap_or_default().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_volume_is_shared_by_sandboxes_on_two_nodes_and_outlives_them() {
    require_node!();
    let store = tempfile::tempdir().unwrap();
    let (home_a, home_b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let node_a = Node::start(config_on(home_a.path(), 45, store.path())).await;
    let node_b = Node::start(config_on(home_b.path(), 46, store.path())).await;
    let (a, b) = (node_a.addr, node_b.addr);

    let (vid, token) = new_volume(a, "shared").await;
    assert_eq!(token.len(), 64);
    // The other node knows it: the records are on the shared store.
    let r = api(b, "GET", "/volumes", "").await;
    assert_eq!(r.status, 200);
    assert_eq!(
        r.json(),
        serde_json::json!([{"volumeID": vid, "name": "shared"}])
    );
    let r = api(b, "GET", &format!("/volumes/{vid}"), "").await;
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["token"], token.as_str());

    // Sandbox A writes as root, and hands a directory to uid 1000.
    let sa = create(a, &mounting("base", "shared", "/mnt/v")).await;
    let out = sh_ok(
        a,
        &sa,
        "echo from-a > /mnt/v/a.txt && mkdir /mnt/v/dir && chown 1000:1000 /mnt/v/dir && stat -c %u:%g /mnt/v/a.txt /mnt/v/dir && grep ' /mnt/v ' /proc/self/mounts",
    )
    .await;
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines[..2], ["0:0", "1000:1000"], "{out}");
    assert!(
        lines[2].contains("nosuid") && lines[2].contains("nodev") && lines[2].contains("rw"),
        "{out}"
    );
    // On the shared directory the ids are the ones sandboxes see.
    let data = store.path().join("volumes").join(&vid).join("data");
    assert_eq!(std::fs::metadata(data.join("a.txt")).unwrap().uid(), 0);
    assert_eq!(std::fs::metadata(data.join("dir")).unwrap().uid(), 1000);
    let r = api(a, "GET", &format!("/sandboxes/{sa}"), "").await;
    assert_eq!(
        r.json()["volumeMounts"],
        serde_json::json!([{"name": "shared", "path": "/mnt/v"}])
    );

    // Sandbox B on the other node, in another id range, sees the same files and owners.
    let sb = create(b, &mounting("base", "shared", "/data")).await;
    assert_eq!(
        sh_ok(
            b,
            &sb,
            "cat /data/a.txt && stat -c %u:%g /data/a.txt /data/dir && echo from-b > /data/dir/b.txt"
        )
        .await,
        "from-a\n0:0\n1000:1000"
    );
    // posix_fs shares live: A sees B's write at once.
    assert_eq!(sh_ok(a, &sa, "cat /mnt/v/dir/b.txt").await, "from-b");

    // A mounted volume is not deleted, from either node; nothing changes.
    for node in [a, b] {
        let r = api(node, "DELETE", &format!("/volumes/{vid}"), "").await;
        assert_eq!(r.status, 409, "{}", r.text());
        let m = message(&r);
        assert!(
            (m.contains(&sa) || m.contains(&sb)) && m.contains("delete the sandboxes"),
            "{m}"
        );
    }
    assert_eq!(
        api(a, "GET", &format!("/volumes/{vid}"), "").await.status,
        200
    );

    assert_eq!(delete(a, &sa).await.status, 204);
    assert_eq!(delete(b, &sb).await.status, 204);

    // A third sandbox still sees both files.
    let sc = create(a, &mounting("base", "shared", "/mnt/v")).await;
    assert_eq!(
        sh_ok(a, &sc, "cat /mnt/v/a.txt /mnt/v/dir/b.txt").await,
        "from-a\nfrom-b"
    );
    // Its mount survives a pause and a resume ...
    let r = api(a, "POST", &format!("/sandboxes/{sc}/pause"), "{}").await;
    assert_eq!(r.status, 204, "{}", r.text());
    let r = api(a, "POST", &format!("/v2/sandboxes/{sc}/connect"), "{}").await;
    assert_eq!(r.status, 201, "{}", r.text());
    sh_ok(a, &sc, "echo from-c > /mnt/v/c.txt").await;
    // ... and a node restart (the paused sandbox starts afresh from its record).
    let r = api(a, "POST", &format!("/sandboxes/{sc}/pause"), "{}").await;
    assert_eq!(r.status, 204, "{}", r.text());
    node_a.stop().await;
    let node_a = Node::start(config_on(home_a.path(), 45, store.path())).await;
    let a = node_a.addr;
    let r = api(a, "POST", &format!("/v2/sandboxes/{sc}/connect"), "{}").await;
    assert_eq!(r.status, 201, "{}", r.text());
    assert_eq!(
        sh_ok(a, &sc, "cat /mnt/v/a.txt /mnt/v/dir/b.txt /mnt/v/c.txt").await,
        "from-a\nfrom-b\nfrom-c"
    );
    // Still mounted, so still not deletable (the restart kept its lease).
    assert_eq!(
        api(b, "DELETE", &format!("/volumes/{vid}"), "")
            .await
            .status,
        409
    );
    assert_eq!(delete(a, &sc).await.status, 204);

    // Now it goes, with its files.
    let r = api(b, "DELETE", &format!("/volumes/{vid}"), "").await;
    assert_eq!(r.status, 204, "{}", r.text());
    assert!(!store.path().join("volumes").join(&vid).exists());
    assert_eq!(
        api(a, "GET", &format!("/volumes/{vid}"), "").await.status,
        404
    );
    assert_eq!(
        api(a, "GET", "/volumes", "").await.json(),
        serde_json::json!([])
    );
    node_a.stop().await;
    node_b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn volume_content_round_trips_with_the_token_and_bad_input_is_refused() {
    require_node!();
    let home = tempfile::tempdir().unwrap();
    let node = Node::start(node_common::config(home.path(), 47)).await;
    let addr = node.addr;
    let (vid, token) = new_volume(addr, "data").await;

    // Bad input: a clear 4xx naming the reason, and nothing changes.
    let r = api(addr, "POST", "/volumes", r#"{"name":"data"}"#).await;
    assert_eq!(r.status, 409, "{}", r.text());
    assert!(message(&r).contains("taken by volume") && message(&r).contains(&vid));
    for (body, why) in [
        (r#"{"name":"bad name"}"#, "1 to 63 characters"),
        (r#"{"name":""}"#, "1 to 63 characters"),
        (r#"{}"#, "name is required"),
        (r#"{"name":5}"#, "invalid JSON"),
    ] {
        let r = api(addr, "POST", "/volumes", body).await;
        assert_eq!(r.status, 400, "{body}: {}", r.text());
        assert_eq!(r.json()["code"], 400);
        assert!(message(&r).contains(why), "{body}: {}", message(&r));
    }
    assert_eq!(
        api(addr, "GET", "/volumes", "").await.json(),
        serde_json::json!([{"volumeID": vid, "name": "data"}])
    );
    let r = api(
        addr,
        "POST",
        "/v2/sandboxes",
        &mounting("base", "nope", "/mnt/v"),
    )
    .await;
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(
        message(&r).contains("volume \"nope\" not found"),
        "{}",
        message(&r)
    );
    for (mounts, why) in [
        (r#"[{"name":"data","path":"mnt/v"}]"#, "absolute"),
        (r#"[{"name":"data","path":"/proc/v"}]"#, "/proc"),
        (r#"[{"name":"data","path":"/agentenv"}]"#, "/agentenv"),
        (r#"[{"name":"data","path":"/mnt/../etc"}]"#, "normalized"),
        (r#"[{"name":"data","path":"/"}]"#, "root"),
        (
            r#"[{"name":"data","path":"/mnt/v"},{"name":"data","path":"/mnt/v/w"}]"#,
            "do not nest",
        ),
        (
            r#"[{"name":"data","path":"/mnt/v"},{"name":"data","path":"/mnt/v"}]"#,
            "given twice",
        ),
    ] {
        let body = format!(r#"{{"templateID":"base","volumeMounts":{mounts}}}"#);
        let r = api(addr, "POST", "/v2/sandboxes", &body).await;
        assert_eq!(r.status, 400, "{mounts}: {}", r.text());
        assert!(message(&r).contains(why), "{mounts}: {}", message(&r));
    }
    assert_eq!(
        api(addr, "GET", "/v2/sandboxes", "").await.json(),
        serde_json::json!([]),
        "no sandbox was made"
    );
    let unknown = agentenv_node::ids::new_sandbox_id();
    for (method, path) in [
        ("GET", format!("/volumes/{unknown}")),
        ("DELETE", format!("/volumes/{unknown}")),
        ("GET", "/volumes/not-an-id".to_string()),
        ("DELETE", "/volumes/not-an-id".to_string()),
    ] {
        let r = api(addr, method, &path, "").await;
        assert_eq!(r.status, 404, "{method} {path}: {}", r.text());
        assert_eq!(r.json()["code"], 404);
    }

    // The content API: the volume's token, not the API key.
    let base = format!("/volumecontent/{vid}");
    for auth in [
        None,
        Some("Bearer wrong"),
        Some(&*format!("Bearer {}x", &token[1..])),
    ] {
        let headers: Vec<(&str, &str)> = auth.iter().map(|a| ("authorization", *a)).collect();
        let r = request(addr, "GET", &format!("{base}/dir?path=%2F"), &headers, "").await;
        assert_eq!(r.status, 401, "{auth:?}");
    }
    let r = api(addr, "GET", &format!("{base}/dir?path=%2F"), "").await;
    assert_eq!(r.status, 401, "the API key is not the volume's token");
    let other = agentenv_node::ids::new_sandbox_id();
    let r = content(
        addr,
        "GET",
        &format!("/volumecontent/{other}/dir?path=%2F"),
        &token,
        b"",
    )
    .await;
    assert_eq!(r.status, 401, "a token opens its own volume only");

    // Write (Python's `+` for a space), list, stat, read, change, remove.
    let r = content(
        addr,
        "PUT",
        &format!("{base}/file?path=%2Fdocs%2Fa+b.txt&mode=416&uid=1000&gid=1000&force=true"),
        &token,
        b"hello volume",
    )
    .await;
    assert_eq!(r.status, 201, "{}", r.text());
    let e = r.json();
    assert_eq!(e["name"], "a b.txt");
    assert_eq!(e["path"], "/docs/a b.txt");
    assert_eq!(e["type"], "file");
    assert_eq!(
        (e["size"].as_u64(), e["mode"].as_u64()),
        (Some(12), Some(0o640))
    );
    assert_eq!(
        (e["uid"].as_u64(), e["gid"].as_u64()),
        (Some(1000), Some(1000))
    );
    assert!(e["mtime"].as_str().unwrap().ends_with('Z'));
    let r = content(
        addr,
        "GET",
        &format!("{base}/dir?path=%2F&depth=2"),
        &token,
        b"",
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let names: Vec<String> = r
        .json()
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["path"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(names, ["/docs", "/docs/a b.txt"]);
    let r = content(
        addr,
        "GET",
        &format!("{base}/file?path=%2Fdocs%2Fa%20b.txt"),
        &token,
        b"",
    )
    .await;
    assert_eq!(r.status, 200);
    assert_eq!(&r.body[..], b"hello volume");
    assert_eq!(r.headers["content-type"], "application/octet-stream");
    let r = content(
        addr,
        "POST",
        &format!("{base}/dir?path=%2Fdocs%2Fsub&mode=448"),
        &token,
        b"",
    )
    .await;
    assert_eq!(r.status, 201, "{}", r.text());
    assert_eq!(r.json()["type"], "directory");
    let r = content(
        addr,
        "POST",
        &format!("{base}/dir?path=%2Fdocs%2Fsub"),
        &token,
        b"",
    )
    .await;
    assert_eq!(r.status, 409, "{}", r.text());
    assert_eq!(r.json()["code"], "already_exists");
    let r = content(
        addr,
        "POST",
        &format!("{base}/dir?path=%2Fnone%2Fsub"),
        &token,
        b"",
    )
    .await;
    assert_eq!(r.status, 404, "without force the parent must exist");
    assert_eq!(r.json()["code"], "not_found");
    let r = request(
        addr,
        "PATCH",
        &format!("{base}/path?path=%2Fdocs%2Fa%20b.txt"),
        &[
            ("authorization", &format!("Bearer {token}")),
            ("content-type", "application/json"),
        ],
        r#"{"mode":384}"#,
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["mode"], 0o600);
    // A sandbox sees what the API wrote, with the same owner.
    let s = create(addr, &mounting("base", "data", "/mnt/data")).await;
    assert_eq!(
        sh_ok(addr, &s, "cat '/mnt/data/docs/a b.txt' && stat -c %u:%g:%a '/mnt/data/docs/a b.txt' /mnt/data/docs/sub").await,
        "hello volume1000:1000:600\n0:0:700"
    );
    sh_ok(addr, &s, "echo from-sandbox > /mnt/data/s.txt").await;
    // A snapshot of the sandbox does not take the volume's files with it.
    let r = snapshot(addr, &s, "{}").await;
    assert_eq!(r.status, 201, "{}", r.text());
    let snap = r.json()["snapshotID"].as_str().unwrap().to_string();
    let from_snap = create(addr, &format!(r#"{{"templateID":"{snap}","timeout":300}}"#)).await;
    assert_eq!(
        sh_ok(addr, &from_snap, "ls -A /mnt/data | wc -l").await,
        "0",
        "only the empty mount point is in the snapshot"
    );
    assert_eq!(delete(addr, &from_snap).await.status, 204);
    let r = content(
        addr,
        "GET",
        &format!("{base}/path?path=%2Fs.txt"),
        &token,
        b"",
    )
    .await;
    assert_eq!(
        (r.json()["uid"].as_u64(), r.json()["size"].as_u64()),
        (Some(0), Some(13))
    );
    assert_eq!(delete(addr, &s).await.status, 204);
    let r = content(
        addr,
        "DELETE",
        &format!("{base}/path?path=%2Fdocs"),
        &token,
        b"",
    )
    .await;
    assert_eq!(r.status, 204, "{}", r.text());
    for (method, path, status) in [
        ("GET", "path?path=%2Fdocs", 404),
        ("GET", "file?path=%2Fdocs%2Fa%20b.txt", 404),
        ("DELETE", "path?path=%2Fdocs", 404),
        ("DELETE", "path?path=%2F", 400),
        ("GET", "dir?path=%2F..%2Fetc", 400),
        ("GET", "dir", 400),
        ("GET", "dir?path=%2F&depth=0", 400),
        ("PUT", "file?path=%2Fx&uid=70000", 400),
        ("GET", "file?path=%2F", 400),
    ] {
        let r = content(addr, method, &format!("{base}/{path}"), &token, b"").await;
        assert_eq!(r.status, status, "{method} {path}: {}", r.text());
        assert!(
            r.json()["code"].is_string(),
            "{method} {path}: the code is a string"
        );
    }
    // A file over the cap is refused from its length, before its body is read.
    let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "PUT {base}/file?path=%2Fbig HTTP/1.1\r\nhost: node\r\nauthorization: Bearer {token}\r\ncontent-length: {}\r\n\r\n",
        (1u64 << 30) + 1
    );
    tokio::io::AsyncWriteExt::write_all(&mut conn, head.as_bytes())
        .await
        .unwrap();
    let mut answer = Vec::new();
    while !answer.windows(2).any(|w| w == b"\r\n") {
        let mut buf = [0u8; 512];
        let n = tokio::io::AsyncReadExt::read(&mut conn, &mut buf)
            .await
            .unwrap();
        assert!(n > 0, "the node closed without an answer");
        answer.extend_from_slice(&buf[..n]);
    }
    let status = String::from_utf8_lossy(&answer);
    assert!(status.starts_with("HTTP/1.1 413"), "{status}");
    let r = content(addr, "GET", &format!("{base}/dir?path=%2F"), &token, b"").await;
    assert_eq!(
        r.json().as_array().unwrap().len(),
        1,
        "only s.txt: {}",
        r.text()
    );
    assert_eq!(
        api(addr, "DELETE", &format!("/volumes/{vid}"), "")
            .await
            .status,
        204
    );
    let r = content(addr, "GET", &format!("{base}/dir?path=%2F"), &token, b"").await;
    assert_eq!(r.status, 404, "a deleted volume's content is gone");
    node.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_links_never_make_the_node_touch_host_files() {
    require_node!();
    let home = tempfile::tempdir().unwrap();
    let node = Node::start(node_common::config(home.path(), 48)).await;
    let addr = node.addr;
    // A host directory and file the tenant points its links at.
    let victim = tempfile::tempdir().unwrap();
    let v = victim.path().display().to_string();
    std::fs::write(victim.path().join("keep"), b"host file").unwrap();
    let victim_unchanged = || {
        let names: Vec<_> = std::fs::read_dir(victim.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["keep"], "the host directory changed");
        assert_eq!(
            std::fs::read(victim.path().join("keep")).unwrap(),
            b"host file"
        );
        let m = std::fs::metadata(victim.path().join("keep")).unwrap();
        assert_eq!((m.uid(), m.gid()), (0, 0));
        let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
        assert!(
            !mounts.contains(&v),
            "something is mounted on the host directory"
        );
    };
    let (vid, _) = new_volume(addr, "links").await;

    // Links at (and on the way to) the mount paths, kept in a snapshot of the sandbox.
    let src = create(addr, r#"{"templateID":"base","timeout":300}"#).await;
    sh_ok(
        addr,
        &src,
        &format!(
            "ln -s {v} /mnt/at && ln -s {v} /mnt/via && ln -s / /mnt/rootlink && echo x > /mnt/file"
        ),
    )
    .await;
    let r = snapshot(addr, &src, r#"{"name":"planted"}"#).await;
    assert_eq!(r.status, 201, "{}", r.text());
    assert_eq!(delete(addr, &src).await.status, 204);
    for (path, why) in [
        ("/mnt/at", "symbolic link"),
        ("/mnt/via/x", "symbolic link"),
        ("/mnt/rootlink/tmp", "symbolic link"),
        ("/mnt/file", "not a directory"),
    ] {
        let r = api(
            addr,
            "POST",
            "/v2/sandboxes",
            &mounting("planted", "links", path),
        )
        .await;
        assert_eq!(r.status, 400, "{path}: {}", r.text());
        let m = message(&r);
        assert!(m.contains(path) && m.contains(why), "{path}: {m}");
        victim_unchanged();
    }
    assert_eq!(
        api(addr, "GET", "/v2/sandboxes", "").await.json(),
        serde_json::json!([])
    );
    // The failed creates left no lease: the volume can go and come back.
    let r = api(addr, "DELETE", &format!("/volumes/{vid}"), "").await;
    assert_eq!(r.status, 204, "{}", r.text());
    let (vid, token) = new_volume(addr, "links").await;

    // Links inside the volume, pointing at the host.
    let s = create(addr, &mounting("base", "links", "/mnt/v")).await;
    sh_ok(
        addr,
        &s,
        &format!("ln -s {v} /mnt/v/host-dir && ln -s {v}/keep /mnt/v/host-file && mkfifo /mnt/v/fifo && mkdir /mnt/v/d && ln -s {v} /mnt/v/d/deep"),
    )
    .await;
    let base = format!("/volumecontent/{vid}");
    let r = content(
        addr,
        "GET",
        &format!("{base}/path?path=%2Fhost-file"),
        &token,
        b"",
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["type"], "symlink");
    assert_eq!(r.json()["target"], format!("{v}/keep"));
    for (method, path) in [
        ("GET", "file?path=%2Fhost-file"),
        ("GET", "file?path=%2Fhost-dir%2Fkeep"),
        ("GET", "dir?path=%2Fhost-dir"),
        ("GET", "dir?path=%2Fd%2Fdeep"),
        ("PUT", "file?path=%2Fhost-dir%2Fnew&force=true"),
        ("POST", "dir?path=%2Fhost-dir%2Fnew&force=true"),
        ("PATCH", "path?path=%2Fhost-dir%2Fkeep"),
        ("DELETE", "path?path=%2Fhost-dir%2Fkeep"),
        ("GET", "file?path=%2Ffifo"),
    ] {
        let body: &'static [u8] = if method == "PATCH" {
            br#"{"uid":5}"#
        } else {
            b"x"
        };
        let r = content(addr, method, &format!("{base}/{path}"), &token, body).await;
        assert_eq!(r.status, 400, "{method} {path}: {}", r.text());
        victim_unchanged();
    }
    // Listing shows the links as links; removing one removes the link.
    let r = content(
        addr,
        "GET",
        &format!("{base}/dir?path=%2F&depth=3"),
        &token,
        b"",
    )
    .await;
    let kinds: Vec<(String, String)> = r
        .json()
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            (
                e["path"].as_str().unwrap().into(),
                e["type"].as_str().unwrap().into(),
            )
        })
        .collect();
    assert!(
        kinds.contains(&("/host-dir".into(), "symlink".into())),
        "{kinds:?}"
    );
    assert!(
        kinds.contains(&("/fifo".into(), "unknown".into())),
        "{kinds:?}"
    );
    let r = content(
        addr,
        "DELETE",
        &format!("{base}/path?path=%2Fhost-dir"),
        &token,
        b"",
    )
    .await;
    assert_eq!(r.status, 204);
    victim_unchanged();
    // Deleting the sandbox and the volume removes the links, not what they point at.
    assert_eq!(delete(addr, &s).await.status, 204);
    let r = api(addr, "DELETE", &format!("/volumes/{vid}"), "").await;
    assert_eq!(r.status, 204, "{}", r.text());
    // The removal runs in the background: wait until the store has no deleted volume left.
    let volumes = home.path().join("snapshot-store/volumes");
    agentenv_testkit::eventually(
        "the deleted volume's files to be removed",
        std::time::Duration::from_secs(10),
        || async { std::fs::read_dir(&volumes).unwrap().next().is_none() },
    )
    .await;
    victim_unchanged();
    node.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oss_volume_is_uploaded_at_pause_and_delete_and_served_to_the_next_sandbox() {
    require_node!();
    let moto = tokio::task::spawn_blocking(|| {
        let m = Moto::start(false);
        m.create_bucket("aenv-volumes");
        m
    })
    .await
    .unwrap();
    let home = tempfile::tempdir().unwrap();
    let s3 = moto.config("aenv-volumes", "cluster-1/");
    let mut cfg = node_common::config(home.path(), 49);
    cfg.snapshot_repository = StorageConfig::S3(s3.clone());
    assert_eq!(cfg.volume_path(), home.path().join("volumes"));
    let node = Node::start(cfg).await;
    let addr = node.addr;
    let bucket = OpendalStorage::open(&StorageConfig::S3(s3)).unwrap();
    let (vid, token) = new_volume(addr, "objects").await;
    let prefix = format!("volumes/data/{vid}/");
    let objects = || async { bucket.list(&prefix).await.unwrap() };

    let s1 = create(addr, &mounting("base", "objects", "/mnt/o")).await;
    sh_ok(addr, &s1, "mkdir -p /mnt/o/d && echo one > /mnt/o/d/a.txt && echo gone > /mnt/o/old.txt && ln -s /etc/passwd /mnt/o/link").await;
    assert!(
        objects().await.is_empty(),
        "nothing is uploaded while it runs"
    );
    // A pause uploads (regular files only).
    assert_eq!(
        api(addr, "POST", &format!("/sandboxes/{s1}/pause"), "{}")
            .await
            .status,
        204
    );
    assert_eq!(
        objects().await,
        [format!("{prefix}d/a.txt"), format!("{prefix}old.txt")]
    );
    let r = api(addr, "POST", &format!("/v2/sandboxes/{s1}/connect"), "{}").await;
    assert_eq!(r.status, 201, "{}", r.text());
    sh_ok(
        addr,
        &s1,
        "echo two > /mnt/o/d/a.txt && rm /mnt/o/old.txt && echo new > /mnt/o/b.txt",
    )
    .await;
    // Delete uploads what changed and drops what went, and the node's copy goes.
    assert_eq!(delete(addr, &s1).await.status, 204);
    assert_eq!(
        objects().await,
        [format!("{prefix}b.txt"), format!("{prefix}d/a.txt")]
    );
    assert!(
        !home.path().join("volumes").join(&vid).exists(),
        "no copy left"
    );
    let mut got = Vec::new();
    bucket
        .get(&format!("{prefix}d/a.txt"), &mut got)
        .await
        .unwrap();
    assert_eq!(got, b"two\n");

    // The next sandbox gets the bucket's files; the content API serves them too.
    let s2 = create(addr, &mounting("base", "objects", "/data")).await;
    assert_eq!(
        sh_ok(addr, &s2, "cat /data/d/a.txt /data/b.txt; ls /data").await,
        "two\nnew\nb.txt\nd"
    );
    let r = content(
        addr,
        "GET",
        &format!("/volumecontent/{vid}/file?path=%2Fb.txt"),
        &token,
        b"",
    )
    .await;
    assert_eq!((r.status, &r.body[..]), (200, &b"new\n"[..]));
    let r = content(
        addr,
        "PUT",
        &format!("/volumecontent/{vid}/file?path=%2Fapi.txt"),
        &token,
        b"api",
    )
    .await;
    assert_eq!(r.status, 201, "{}", r.text());
    // The copy is shared on this node: the sandbox sees the API's write at once.
    assert_eq!(sh_ok(addr, &s2, "cat /data/api.txt").await, "api");
    assert_eq!(delete(addr, &s2).await.status, 204);
    assert!(objects().await.contains(&format!("{prefix}api.txt")));
    let r = api(addr, "DELETE", &format!("/volumes/{vid}"), "").await;
    assert_eq!(r.status, 204, "{}", r.text());
    assert!(objects().await.is_empty());
    node.stop().await;
}
