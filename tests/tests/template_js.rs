//! Custom templates with the official E2B JS SDK (npm `e2b`, the version locked in
//! `fixtures/js/package-lock.json`) through the gateway and two nodes that share only the
//! snapshot store: the same flows as `template_cluster.rs` with the Python SDK. The JS SDK
//! differs on the wire (its own directory `filesHash`, uploads of all COPY steps in
//! parallel, chunked JSON bodies, `resolveSymlinks`/`gzip` on COPY steps, status polls
//! without `limit`), so this checks the template API against those too.

use std::process::Command;

use agentenv_tests::{API_KEY, Cluster, e2b_js, node_templates, skip_reason, template_fetches};

/// The node indices of this test (address pools 10.15.8.0/24 and 10.15.9.0/24,
/// interface prefixes `ci` and `cj`): no other test uses them.
const FIRST_IDX: u8 = 8;

#[test]
fn js_sdk_builds_a_template_and_sandboxes_start_from_it_on_both_nodes() {
    if let Some(r) = skip_reason() {
        eprintln!("SKIPPED: {r}");
        return;
    }
    let js = e2b_js().expect("E2B JS SDK installed with npm ci");
    let dirs = tempfile::tempdir().unwrap();
    let tpl: Vec<String> = (0..2)
        .map(|i| node_templates(&dirs.path().join(format!("node-{i}"))))
        .collect();
    let cluster = Cluster::start_with(2, FIRST_IDX, &|i| {
        vec![("AENV_TEMPLATE_PATH".to_string(), tpl[i as usize].clone())]
    });
    cluster.wait_nodes_listed(2);
    let gw = format!("http://{}", cluster.gateway);
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/e2b_templates.mjs"
    );
    let out = Command::new("node")
        .arg(script)
        .arg("js-web")
        .env("E2B_JS_DIR", &js)
        .env("E2B_API_URL", &gw)
        .env("E2B_SANDBOX_URL", &gw)
        .env("E2B_API_KEY", API_KEY)
        .output()
        .expect("run the JS SDK script");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "JS SDK script failed:\n{stderr}\n{stdout}"
    );
    let v: serde_json::Value = serde_json::from_str(stdout.trim()).expect("JSON from the script");
    let logs = |k: &str| -> Vec<String> {
        v[k]["logs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|l| l.as_str().unwrap().to_string())
            .collect()
    };
    let first = logs("first");
    assert!(
        first.iter().any(|l| l == "hello from the template"),
        "the RUN step's output is in the build log: {first:?}"
    );
    for src in ["app", "app/link.txt"] {
        assert!(
            first.iter().any(|l| *l == format!("Uploaded '{src}'")),
            "the files of COPY {src} were uploaded: {first:?}"
        );
    }
    assert!(!first.iter().any(|l| l.starts_with("CACHED")), "{first:?}");
    assert_eq!(v["exists"], true);
    assert_eq!(v["exists_missing"], false);
    // The rebuild changed only the ENV (and so the second RUN and the last COPY after it):
    // the RUN and COPY before it come from the cache, the changed steps run.
    let second = logs("second");
    for src in ["app", "app/link.txt"] {
        assert!(
            second
                .iter()
                .any(|l| *l == format!("Skipping upload of '{src}', already cached")),
            "the same files of COPY {src} are not uploaded again: {second:?}"
        );
    }
    let cached: Vec<&String> = second.iter().filter(|l| l.starts_with("CACHED")).collect();
    assert_eq!(cached.len(), 2, "RUN and COPY cached: {second:?}");
    assert!(cached[0].contains("RUN mkdir -p /srv/www"), "{cached:?}");
    assert!(cached[1].contains("COPY app /opt/app"), "{cached:?}");
    assert!(
        second.iter().any(|l| l.starts_with("[3/5] ENV")),
        "the changed ENV runs: {second:?}"
    );
    assert_eq!(v["second"]["template_id"], v["first"]["template_id"]);
    assert_ne!(v["second"]["build_id"], v["first"]["build_id"]);

    let sandboxes = v["sandboxes"].as_array().unwrap();
    assert_eq!(sandboxes.len(), 2);
    for s in sandboxes {
        assert_eq!(s["file"], "hello from the template\n");
        assert_eq!(s["nested"], "nested\n");
        assert_eq!(s["link"], "hello.txt", "the symlink is kept");
        assert_eq!(
            s["resolved"], "regular file 640\nhello from the template",
            "COPY with resolveSymlinks, gzip false and a mode"
        );
        assert_eq!(s["marker"], "marker=two", "the newest build");
        assert_eq!(s["env"], "hi from env");
        assert_eq!(s["served"], "built-42", "the start command runs");
    }
    // The two sandboxes landed on the two nodes (round robin); each fetched the template
    // once from the shared store (the build ran in a build sandbox).
    let fetches: Vec<u64> = cluster
        .nodes
        .iter()
        .map(|n| template_fetches(n.addr))
        .collect();
    assert_eq!(fetches, vec![1, 1], "one template fetch per node");

    let bad = v["bad"].as_str().unwrap();
    assert!(bad.starts_with("BuildError: "), "a BuildError: {bad}");
    assert!(bad.contains("exit code 7"), "{bad}");
    assert!(
        bad.contains("about-to-fail"),
        "the failing step's output: {bad}"
    );
    assert_eq!(v["bad_status"], "error");
    assert_eq!(v["bad_step"], "1", "the failing step");
    assert!(
        v["bad_reason"].as_str().unwrap().contains("exit code 7"),
        "{}",
        v["bad_reason"]
    );
    assert_eq!(
        v["bad_exists"], false,
        "a template with no finished build is not there"
    );
    let bad_create = v["bad_create"].as_str().unwrap();
    assert!(
        bad_create.contains("no ready build") || bad_create.contains("not found"),
        "{bad_create}"
    );
}
