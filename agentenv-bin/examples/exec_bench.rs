//! `aenv exec <id> true` against the raw API call it stands for, on a real local
//! cluster (scheduler, gateway, one node with the jail backend) on loopback.
//!
//! Reference: one `Process/Start` Connect call for `true` through the gateway, made
//! in-process on a fresh connection, read to its end event. Measured: the whole `aenv
//! exec <id> true` process (start-up, credentials, `GET /sandboxes/{id}`, the same call,
//! exit). Both are interleaved so machine noise hits both alike.
//!
//! Run: `cargo run --release -p agentenv-bin --example exec_bench [-- <iterations>]`
//! (root; `AGENTENV_GUEST_BIN` or a built static agent, as for the cluster tests).

use std::process::Command;
use std::time::{Duration, Instant};

use agentenv_guest::client::GuestClient;
use agentenv_guest::proto::process as pr;
use agentenv_tests::{API_KEY, Cluster, api, binary, skip_reason};
use futures::StreamExt;

fn pct(v: &mut [Duration], p: f64) -> Duration {
    v.sort();
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    v[i]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

async fn raw_start_true(base: &str, id: &str) -> i32 {
    let c = GuestClient::new(base)
        .expect("client")
        .with_header("x-agentenv-sandbox-id", id)
        .expect("header")
        .with_header("x-agentenv-target-port", "49983")
        .expect("header");
    let req = pr::StartRequest {
        process: Some(pr::ProcessConfig {
            cmd: "true".into(),
            ..Default::default()
        }),
        stdin: Some(false),
        ..Default::default()
    };
    let mut s = c.start(&req).await.expect("Process/Start");
    while let Some(m) = s.next().await {
        if let Some(pr::process_event::Event::End(e)) =
            m.expect("event").event.and_then(|e| e.event)
        {
            return e.exit_code;
        }
    }
    panic!("no end event")
}

fn main() {
    if let Some(r) = skip_reason() {
        eprintln!("SKIPPED: {r}");
        return;
    }
    let n: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(200);
    let aenv = binary("aenv").expect("the aenv binary");
    let cluster = Cluster::start(1, 2);
    let base = format!("http://{}", cluster.gateway);
    // The node must have reported to the scheduler before a create can be placed.
    let deadline = Instant::now() + Duration::from_secs(30);
    while api(cluster.gateway, "GET", "/nodes", "")
        .1
        .as_array()
        .map(Vec::len)
        != Some(1)
    {
        assert!(
            Instant::now() < deadline,
            "the node never reached the scheduler"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let (st, v) = api(
        cluster.gateway,
        "POST",
        "/sandboxes",
        r#"{"templateID":"base","timeout":600}"#,
    );
    assert_eq!(st, 201, "create: {v}");
    let id = v["sandboxID"].as_str().expect("sandboxID").to_string();

    let cfg = tempfile::tempdir().expect("config dir");
    let creds = cfg.path().join("aenv/credentials");
    std::fs::create_dir_all(creds.parent().unwrap()).unwrap();
    std::fs::write(
        &creds,
        format!("url = \"{base}\"\napi_key = \"{API_KEY}\"\n"),
    )
    .unwrap();

    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let run_aenv = || {
        let t = Instant::now();
        let st = Command::new(&aenv)
            .args(["exec", &id, "true"])
            .env("XDG_CONFIG_HOME", cfg.path())
            .status()
            .expect("run aenv");
        assert!(st.success(), "aenv exec failed: {st}");
        t.elapsed()
    };
    let run_raw = || {
        let t = Instant::now();
        assert_eq!(rt.block_on(raw_start_true(&base, &id)), 0);
        t.elapsed()
    };
    for _ in 0..10 {
        run_aenv();
        run_raw();
    }
    let mut raw = Vec::with_capacity(n);
    let mut cli = Vec::with_capacity(n);
    for _ in 0..n {
        raw.push(run_raw());
        cli.push(run_aenv());
    }
    let (r50, r99) = (pct(&mut raw, 0.5), pct(&mut raw, 0.99));
    let (c50, c99) = (pct(&mut cli, 0.5), pct(&mut cli, 0.99));
    println!("exec `true` through the gateway, {n} runs each, interleaved");
    println!(
        "  raw Process/Start call   p50 {:7.2} ms   p99 {:7.2} ms",
        ms(r50),
        ms(r99)
    );
    println!(
        "  aenv exec <id> true      p50 {:7.2} ms   p99 {:7.2} ms",
        ms(c50),
        ms(c99)
    );
    println!(
        "  aenv overhead            p50 {:+7.2} ms   p99 {:+7.2} ms   (target: within 20 ms)",
        ms(c50) - ms(r50),
        ms(c99) - ms(r99)
    );
    let _ = api(cluster.gateway, "DELETE", &format!("/sandboxes/{id}"), "");
}
