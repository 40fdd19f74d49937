//! Bad input to the node's REST API: each answer has the documented status and a JSON
//! message, and nothing half-created is left behind.

mod node_common;

use node_common::{API_KEY, Node, api, create, request};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_json_errors_and_leave_nothing_behind() {
    require_node!();
    let home = tempfile::tempdir().unwrap();
    let node = Node::start(node_common::config(home.path(), 30)).await;
    let addr = node.addr;
    // Bad bodies of `POST /v2/sandboxes`: 400 with a message naming what is wrong.
    let bad_creates: &[(&str, &str)] = &[
        ("{\"templateID\":", "invalid JSON body"),
        ("[1,2]", "invalid JSON body"),
        (r#"{"templateID":"base","timeout":"soon"}"#, "timeout"),
        (r#"{"templateID":"base","timeout":-5}"#, "timeout"),
        (r#"{"templateID":"base","metadata":{"a":1}}"#, "metadata"),
        (r#"{"templateID":42}"#, "templateID"),
        (r#"{}"#, "templateID is required"),
        (
            r#"{"templateID":"no-such-template"}"#,
            "template no-such-template not found",
        ),
        (r#"{"templateID":"../etc"}"#, "not found"),
        (r#"{"templateID":"base","cpuCount":0}"#, "cpuCount"),
        (r#"{"templateID":"base","cpuCount":4096}"#, "cpuCount"),
        (r#"{"templateID":"base","memoryMB":1}"#, "memoryMB"),
        (r#"{"templateID":"base","memoryMB":999999999}"#, "memoryMB"),
        (r#"{"templateID":"base","timeout":999999999}"#, "timeout"),
    ];
    // An id that is not a UUID names no sandbox: 404, as the gateway answers.
    let others: &[(&str, &str, &str, u16, &str)] = &[
        (
            "GET",
            "/sandboxes/not-a-uuid",
            "",
            404,
            "sandbox ids are UUIDs",
        ),
        (
            "DELETE",
            "/sandboxes/..%2F..%2Fetc",
            "",
            404,
            "sandbox ids are UUIDs",
        ),
        (
            "POST",
            "/sandboxes/x/pause",
            "",
            404,
            "sandbox ids are UUIDs",
        ),
        (
            "POST",
            "/sandboxes/x/fork",
            "",
            404,
            "sandbox ids are UUIDs",
        ),
        (
            "POST",
            "/sandboxes/01936f8e-72f5-7000-8000-000000000001/fork",
            r#"{"count":0}"#,
            400,
            "count must be between 1 and 20",
        ),
        (
            "POST",
            "/sandboxes/01936f8e-72f5-7000-8000-000000000001/fork",
            r#"{"count":21}"#,
            400,
            "count must be between 1 and 20",
        ),
        (
            "POST",
            "/sandboxes/01936f8e-72f5-7000-8000-000000000001/fork",
            "",
            404,
            "not found",
        ),
        (
            "POST",
            "/v2/sandboxes",
            r#"{"templateID":"base","autoPauseMemory":false,"autoResume":{"enabled":true}}"#,
            400,
            "autoResume cannot be combined with autoPauseMemory: false",
        ),
        (
            "GET",
            "/sandboxes/01936f8e-72f5-7000-8000-000000000001",
            "",
            404,
            "sandbox 01936f8e-72f5-7000-8000-000000000001 not found",
        ),
        (
            "POST",
            "/sandboxes/01936f8e-72f5-7000-8000-000000000001/connect",
            "{}",
            404,
            "not found",
        ),
        (
            "POST",
            "/sandboxes/01936f8e-72f5-7000-8000-000000000001/timeout",
            r#"{"timeout":"x"}"#,
            400,
            "timeout",
        ),
        ("GET", "/v2/sandboxes?limit=abc", "", 400, "limit"),
        ("GET", "/v2/sandboxes?state=zombie", "", 400, "state"),
        (
            "GET",
            "/nodes/other-node",
            "",
            404,
            "node other-node not found",
        ),
        ("POST", "/proxy/x", "", 400, "routing header"),
    ];
    let cases = bad_creates
        .iter()
        .map(|&(body, needle)| ("POST", "/v2/sandboxes", body, 400, needle))
        .chain(others.iter().copied());
    for (m, p, body, status, needle) in cases {
        let r = api(addr, m, p, body).await;
        assert_eq!(r.status, status, "{m} {p} {body}: {}", r.text());
        let v = r.json();
        assert_eq!(v["code"], status, "{m} {p}");
        let msg = v["message"].as_str().unwrap();
        assert!(
            msg.contains(needle),
            "{m} {p} {body}: {msg:?} lacks {needle:?}"
        );
    }
    // Unknown fields are ignored.
    let id = create(addr, r#"{"templateID":"base","autoPauseMemory":true,"iam":{"role":"x"},"volumeMounts":[],"mcp":{},"future":[1,2,3]}"#).await;
    // Nothing half-created: only the one good sandbox exists, in the node and the backend.
    let list = api(addr, "GET", "/v2/sandboxes", "").await.json();
    assert_eq!(list.as_array().unwrap().len(), 1);
    assert_eq!(node.orch.list().len(), 1);
    let sandboxes = home.path().join("jail/sandboxes");
    let dirs: Vec<_> = std::fs::read_dir(&sandboxes)
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert_eq!(
        dirs,
        vec![std::ffi::OsString::from(&id)],
        "only the good sandbox has a directory"
    );
    let n = api(addr, "GET", "/nodes", "").await.json();
    assert_eq!(n[0]["createSuccesses"], 1);
    node.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_during_shutdown_get_503() {
    require_node!();
    let home = tempfile::tempdir().unwrap();
    let node = Node::start(node_common::config(home.path(), 31)).await;
    let addr = node.addr;
    let id = create(addr, r#"{"templateID":"base"}"#).await;
    node.orch.begin_shutdown();
    for (m, p) in [
        ("POST", "/v2/sandboxes".to_string()),
        ("POST", format!("/sandboxes/{id}/pause")),
        ("DELETE", format!("/sandboxes/{id}")),
        ("POST", format!("/sandboxes/{id}/connect")),
    ] {
        let r = api(addr, m, &p, r#"{"templateID":"base"}"#).await;
        assert_eq!(r.status, 503, "{m} {p}: {}", r.text());
        assert!(
            r.json()["message"]
                .as_str()
                .unwrap()
                .contains("shutting down")
        );
    }
    // Reads still work.
    let r = request(
        addr,
        "GET",
        &format!("/sandboxes/{id}"),
        &[("x-api-key", API_KEY)],
        "",
    )
    .await;
    assert_eq!(r.status, 200);
    node.stop().await;
    // Shutdown paused and recorded it.
    assert!(
        home.path()
            .join("persisted-sandboxes")
            .join(format!("{id}.json"))
            .is_file()
    );
}
