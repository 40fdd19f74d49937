//! The fleet benchmark keeps running: a `--quick` run of the example (a
//! scheduler process of its own, a small fleet heartbeating over gRPC, the
//! gateway's calls on top) finishes and prints every figure. No latency is
//! asserted: the benchmark prints figures, it does not judge this machine.

use std::path::PathBuf;
use std::process::Command;

/// The example binary of the profile this test was built with; built first
/// when the test run did not build examples (e.g. `--test fleet_bench_smoke`).
fn fleet_bench() -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    // target/<profile>/deps/<test> → target/<profile>/examples/fleet_bench
    let profile_dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("target/<profile> directory");
    let bench = profile_dir.join("examples").join("fleet_bench");
    if !bench.exists() {
        let mut build = Command::new(env!("CARGO"));
        build.args(["build", "-p", "agentenv-sched", "--example", "fleet_bench"]);
        if profile_dir.ends_with("release") {
            build.arg("--release");
        }
        let status = build
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .status()
            .expect("run cargo build --example fleet_bench");
        assert!(status.success(), "cargo build --example fleet_bench failed");
    }
    assert!(
        bench.exists(),
        "{} is missing: build it with `cargo build -p agentenv-sched --example fleet_bench`",
        bench.display()
    );
    bench
}

/// Runs `fleet_bench --quick --store <store>` and checks its table.
fn quick_run_prints_every_figure(store: &str) {
    let out = Command::new(fleet_bench())
        .args(["--quick", "--store", store])
        .output()
        .expect("run fleet_bench");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "fleet_bench --quick failed:\n{stdout}\n{stderr}"
    );
    let store_target =
        format!("Schedule p99 < 2 ms while ingesting 200 heartbeats/s, {store} store");
    for figure in [
        "heartbeats/s achieved / offered",
        "Heartbeat p50 / p99",
        "Schedule p50 / p99 / p99.9",
        "RecordAssignment p50 / p99",
        "LookupNode p50 / p99",
        "reference: health p50 / p99 / p99.9",
        "scheduler RSS at end / peak",
        "CPU s: scheduler / Redis / load gen",
        store_target.as_str(),
    ] {
        assert!(stdout.contains(figure), "no {figure:?} in:\n{stdout}");
    }
    assert!(
        !stdout.contains("n/a") && !stdout.contains("no calls") && !stdout.contains(" errors ("),
        "a figure was not measured or calls failed:\n{stdout}\n{stderr}"
    );
    // Every sampled sandbox of the warm-up was found, and the store held
    // the fleet's 200 x 20 bindings after it.
    assert!(
        stdout.contains("1000/1000"),
        "warm-up bindings missing:\n{stdout}"
    );
    assert!(
        stdout.contains("4,000 / "),
        "bindings after warm-up:\n{stdout}"
    );
}

#[test]
fn fleet_bench_quick_run_with_the_memory_store_prints_every_figure() {
    quick_run_prints_every_figure("memory");
}

/// Starts its own redis-server (the Debian package the tests install).
#[test]
fn fleet_bench_quick_run_with_the_redis_store_prints_every_figure() {
    quick_run_prints_every_figure("redis");
}
