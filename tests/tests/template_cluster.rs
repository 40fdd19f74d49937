//! Custom templates with the official E2B Python SDK through the gateway and two nodes
//! that share only the snapshot store (each has its own local template directory): a
//! build from `base` with `RUN`, `COPY`, `ENV` and a start command with a ready check;
//! sandboxes from it on both nodes (the one that did not build it fetches the template
//! from the shared store); a rebuild with one changed step served from the layer cache
//! up to that step; a failing `RUN` that publishes nothing.

use std::process::Command;

use agentenv_tests::{API_KEY, Cluster, e2b_python, node_templates, skip_reason, template_fetches};

#[test]
fn sdk_builds_a_template_on_one_node_and_sandboxes_start_from_it_on_both() {
    if let Some(r) = skip_reason() {
        eprintln!("SKIPPED: {r}");
        return;
    }
    let py = e2b_python().expect("E2B SDK virtual environment");
    let dirs = tempfile::tempdir().unwrap();
    let tpl: Vec<String> = (0..2)
        .map(|i| node_templates(&dirs.path().join(format!("node-{i}"))))
        .collect();
    let cluster = Cluster::start_with(2, 17, &|i| {
        vec![("AENV_TEMPLATE_PATH".to_string(), tpl[i as usize].clone())]
    });
    cluster.wait_nodes_listed(2);
    let gw = format!("http://{}", cluster.gateway);
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/e2b_templates.py"
    );
    let out = Command::new(&py)
        .arg(script)
        .arg("sdk-web")
        .env("E2B_API_URL", &gw)
        .env("E2B_SANDBOX_URL", &gw)
        .env("E2B_API_KEY", API_KEY)
        .output()
        .expect("run the SDK script");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "SDK script failed:\n{stderr}\n{stdout}"
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
    assert!(!first.iter().any(|l| l.starts_with("CACHED")), "{first:?}");
    assert_eq!(v["exists"], true);
    assert_eq!(v["exists_missing"], false);
    // The rebuild changed only the second RUN (through its ENV): the RUN and COPY
    // before it come from the cache, the changed steps run.
    let second = logs("second");
    let cached: Vec<&String> = second.iter().filter(|l| l.starts_with("CACHED")).collect();
    assert_eq!(cached.len(), 2, "RUN and COPY cached: {second:?}");
    assert!(cached[0].contains("RUN mkdir -p /srv/www"), "{cached:?}");
    assert!(cached[1].contains("COPY app /opt/app"), "{cached:?}");
    assert!(
        second.iter().any(|l| l.starts_with("[3/4] ENV")),
        "the changed ENV runs: {second:?}"
    );
    assert_eq!(v["second"]["template_id"], v["first"]["template_id"]);
    assert_ne!(v["second"]["build_id"], v["first"]["build_id"]);

    for s in v["sandboxes"].as_array().unwrap() {
        assert_eq!(s["file"], "hello from the template\n");
        assert_eq!(s["nested"], "nested\n");
        assert_eq!(s["link"], "hello.txt", "the symlink is kept");
        assert_eq!(s["marker"], "marker=two", "the newest build");
        assert_eq!(s["env"], "hi from env");
        assert_eq!(s["served"], "built-42", "the start command runs");
    }
    // The two sandboxes landed on the two nodes; each fetched the template once from
    // the shared store (neither had it: the build ran in a build sandbox).
    let fetches: Vec<u64> = cluster
        .nodes
        .iter()
        .map(|n| template_fetches(n.addr))
        .collect();
    assert_eq!(fetches, vec![1, 1], "one template fetch per node");

    let bad = v["bad"].as_str().unwrap();
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
