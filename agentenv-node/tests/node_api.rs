//! The node daemon in-process on loopback with the jail backend and the real guest
//! agent: REST create/get/list/delete and the data plane to the agent.

mod node_common;

use node_common::{API_KEY, Node, api, create, delete, request, run};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn create_get_list_delete_and_commands_through_the_data_plane() {
    require_node!();
    let home = tempfile::tempdir().unwrap();
    let node = Node::start(node_common::config(home.path(), 1)).await;
    let addr = node.addr;

    let r = request(addr, "GET", "/health", &[], "").await;
    assert_eq!((r.status, r.body.len()), (204, 0));

    let id = create(
        addr,
        r#"{"templateID":"base","metadata":{"team":"a"},"envVars":{"FROM_API":"yes"},"iam":{"x":1}}"#,
    )
    .await;
    let got = api(addr, "GET", &format!("/sandboxes/{id}"), "").await;
    assert_eq!(got.status, 200, "{}", got.text());
    let upper = api(
        addr,
        "GET",
        &format!("/sandboxes/{}", id.to_uppercase()),
        "",
    )
    .await;
    assert_eq!(upper.status, 200, "ids are case-insensitive UUIDs");
    let v = got.json();
    assert_eq!(v["sandboxID"], id.as_str());
    assert_eq!(v["templateID"], "base");
    assert_eq!(v["state"], "running");
    assert_eq!(v["metadata"]["team"], "a");
    assert_eq!(v["lifecycle"]["onTimeout"], "pause");

    // The command runs inside the sandbox, with the create's envVars.
    let out = run(addr, &id, None, "echo $FROM_API; hostname")
        .await
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), format!("yes\n{id}\n"));

    // The agent is the sandbox's PID 1, in init mode.
    let out = run(addr, &id, None, "tr '\\0' ' ' < /proc/1/cmdline")
        .await
        .unwrap();
    let cmdline = String::from_utf8_lossy(&out.stdout);
    assert!(
        cmdline.starts_with("/agentenv/agentenv-guest --init"),
        "{cmdline}"
    );

    // /proxy/... forwards the rest of the path to the agent.
    let token = node_common::envd_token(&id);
    let h = request(
        addr,
        "GET",
        "/proxy/health",
        &[("e2b-sandbox-id", &id), ("x-access-token", &token)],
        "",
    )
    .await;
    assert_eq!(h.status, 204, "{}", h.text());

    // GET /health with routing headers stays the node's own health.
    let own = request(addr, "GET", "/health", &[("e2b-sandbox-id", &id)], "").await;
    assert_eq!(own.status, 204);

    let v1 = api(addr, "GET", "/sandboxes", "").await.json();
    assert!(
        v1.as_array()
            .unwrap()
            .iter()
            .any(|s| s["sandboxID"] == id.as_str())
    );
    let v2 = api(
        addr,
        "GET",
        "/v2/sandboxes?metadata=team%3Da&state=running",
        "",
    )
    .await;
    assert_eq!(v2.status, 200);
    assert_eq!(v2.json().as_array().unwrap().len(), 1);
    let none = api(addr, "GET", "/v2/sandboxes?metadata=team%3Db", "")
        .await
        .json();
    assert_eq!(none.as_array().unwrap().len(), 0);

    let d = delete(addr, &id).await;
    assert_eq!(d.status, 204, "{}", d.text());
    let gone = api(addr, "GET", &format!("/sandboxes/{id}"), "").await;
    assert_eq!(gone.status, 404);
    assert_eq!(gone.json()["message"], format!("sandbox {id} not found"));
    let again = delete(addr, &id).await;
    assert_eq!(again.status, 404);

    // The data plane reports a gone sandbox the way the E2B SDK recognises.
    let p = request(
        addr,
        "GET",
        "/health",
        &[
            ("x-agentenv-sandbox-id", &id),
            ("e2b-sandbox-port", "49983"),
        ],
        "",
    )
    .await;
    assert_eq!(p.status, 204, "a matched route stays control plane");
    let p = request(
        addr,
        "POST",
        "/process.Process/List",
        &[("e2b-sandbox-id", &id), ("x-access-token", &token)],
        "{}",
    )
    .await;
    assert_eq!(p.status, 502);
    assert_eq!(
        p.json()["message"],
        format!("The sandbox {id} was not found")
    );
    node.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn v2_list_pages_with_next_token() {
    require_node!();
    let home = tempfile::tempdir().unwrap();
    let node = Node::start(node_common::config(home.path(), 2)).await;
    let addr = node.addr;
    let mut ids = Vec::new();
    for _ in 0..3 {
        ids.push(create(addr, r#"{"templateID":"base","metadata":{"page":"x"}}"#).await);
    }
    let mut seen = Vec::new();
    let mut token = String::new();
    loop {
        let path = if token.is_empty() {
            "/v2/sandboxes?limit=2&metadata=page%3Dx".to_string()
        } else {
            format!("/v2/sandboxes?limit=2&metadata=page%3Dx&nextToken={token}")
        };
        let r = api(addr, "GET", &path, "").await;
        assert_eq!(r.status, 200, "{}", r.text());
        for s in r.json().as_array().unwrap() {
            seen.push(s["sandboxID"].as_str().unwrap().to_string());
        }
        match r.headers.get("x-next-token") {
            Some(t) => token = t.to_str().unwrap().to_string(),
            None => break,
        }
    }
    // Newest first, each exactly once.
    let mut expected = ids.clone();
    expected.reverse();
    assert_eq!(seen, expected);
    let bad = api(addr, "GET", "/v2/sandboxes?nextToken=%%%", "").await;
    assert_eq!(bad.status, 400);
    let _ = API_KEY;
    node.stop().await;
}
