//! The rest of the sandbox API with the official E2B SDKs, Python and JS, through the
//! gateway and two nodes (separate processes on loopback): fork, metrics, logs of a
//! template's start command, volumes shared by sandboxes, an idempotent create, lists in
//! pages.

use agentenv_tests::{Cluster, e2b_js, e2b_python, node_templates, run_sdk_script, skip_reason};

const FIRST_IDX: u8 = 12;

#[test]
fn both_sdks_fork_measure_log_share_volumes_and_retry_creates_through_the_gateway() {
    if let Some(r) = skip_reason() {
        eprintln!("SKIPPED: {r}");
        return;
    }
    let py = e2b_python().expect("E2B SDK virtual environment");
    let js = e2b_js().expect("E2B JS SDK");
    let dirs = tempfile::tempdir().unwrap();
    let tpl: Vec<String> = (0..2)
        .map(|i| node_templates(&dirs.path().join(format!("node-{i}"))))
        .collect();
    let cluster = Cluster::start_with(2, FIRST_IDX, &|i| {
        vec![
            ("AENV_TEMPLATE_PATH".to_string(), tpl[i as usize].clone()),
            ("AENV_METRICS_INTERVAL_MS".to_string(), "300".to_string()),
        ]
    });
    cluster.wait_nodes_listed(2);
    let nonce = format!("{:08x}", rand::random::<u32>());
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/e2b_sandbox_api.py"
    );
    let v = run_sdk_script(&py, script, &[&nonce], cluster.gateway, &[]);

    // Fork: two running sandboxes with the source's files; the source runs on unchanged.
    assert_eq!(v["fork_kinds"], serde_json::json!(["Sandbox", "Sandbox"]));
    let src = &v["source_after"];
    for f in v["forks"].as_array().unwrap() {
        assert_ne!(f["id"], src["id"]);
        assert_eq!(f["file"], "forked-file");
        assert_eq!(f["sum"], src["sum"]);
        assert_eq!(f["host"], f["id"]);
        assert_eq!(f["metadata"]["suite"], nonce.as_str());
    }
    assert_eq!(
        src["file"], "forked-file",
        "a fork's write stays in the fork"
    );
    assert_eq!(src["other_fork"], "forked-file");
    assert_eq!(src["running"], true);
    assert_eq!(src["end_unchanged"], true);

    // Metrics after a busy command.
    let m = &v["metrics"];
    assert!(m["max_cpu"].as_f64().unwrap() > 0.0, "{m}");
    assert!(m["max_mem"].as_u64().unwrap() > 0, "{m}");
    // The node's defaults: 2 CPUs, 512 MiB.
    assert_eq!(m["mem_total"].as_u64().unwrap(), 512 << 20, "{m}");
    assert!(m["disk_total"].as_u64().unwrap() > 0, "{m}");
    assert_eq!(m["cpu_count"], 2);
    assert!(
        v["reversed_range"].as_str().unwrap().starts_with("400: "),
        "a reversed range: {}",
        v["reversed_range"]
    );

    // Logs: the start command's output, stdout as info and stderr as error.
    let logs = &v["logs"];
    assert_eq!(logs["status"], 200);
    let entries = logs["entries"].as_array().unwrap();
    assert!(
        entries
            .iter()
            .any(|e| e[0] == "info" && e[1].as_str().unwrap().contains("start-said-42")),
        "{logs}"
    );
    assert!(
        entries
            .iter()
            .any(|e| e[0] == "error" && e[1].as_str().unwrap().contains("start-complained")),
        "{logs}"
    );
    assert!(
        v["logs_v1"]["lines"]
            .as_array()
            .unwrap()
            .iter()
            .any(|l| l.as_str().unwrap().contains("start-said-42")),
        "{}",
        v["logs_v1"]
    );

    // Volumes.
    let vol = &v["volume"];
    assert_eq!(vol["name"], format!("vol-{nonce}"));
    assert_eq!(vol["read"], "from-the-writer");
    assert_eq!(vol["owner"], "0", "root inside owns what root inside wrote");
    assert_eq!(
        vol["mounts"],
        serde_json::json!([{"name": format!("vol-{nonce}"), "path": "/mnt/v"}])
    );
    assert_eq!(vol["after_both"], "from-the-writer\nfrom-the-reader");
    assert_eq!(vol["content_read"], "from-the-writer\nfrom-the-reader\n");
    assert_eq!(vol["content_list"], serde_json::json!(["d", "note.txt"]));
    assert_eq!(vol["listed"], true);
    assert_eq!(vol["destroyed"], true);
    assert_eq!(vol["destroyed_again"], false);

    // The idempotent create.
    let idem = &v["idempotent"];
    assert_eq!(idem["first"], idem["again"]);
    assert_eq!(idem["listed"], serde_json::json!([idem["first"]]));
    assert_eq!(idem["runs"], "same");

    // The JS SDK: fork, metrics, the list in pages.
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/e2b_sandbox_api.mjs"
    );
    let js_nonce = format!("js-{nonce}");
    let j = run_sdk_script(
        std::path::Path::new("node"),
        script,
        &[&js_nonce],
        cluster.gateway,
        &[("E2B_JS_DIR", &js.display().to_string())],
    );
    let forks = j["forks"].as_array().unwrap();
    assert_eq!(forks.len(), 2, "{j}");
    for f in forks {
        assert_eq!(f["file"], "js-forked", "{f}");
    }
    assert_eq!(j["source"]["running"], true);
    assert!(j["metrics"]["maxCpu"].as_f64().unwrap() > 0.0, "{j}");
    assert!(j["metrics"]["maxMem"].as_u64().unwrap() > 0, "{j}");
    let mut ids: Vec<&str> = j["list"]["ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap())
        .collect();
    assert_eq!(j["list"]["pages"], 2, "{j}");
    ids.sort();
    let mut want: Vec<&str> = forks
        .iter()
        .map(|f| f["id"].as_str().unwrap())
        .chain([j["source"]["id"].as_str().unwrap()])
        .collect();
    want.sort();
    assert_eq!(ids, want, "every sandbox once");
}
