//! Benchmark of the agent against references measured in the same run:
//!
//! * `Process/Start` round trip of `/bin/true` through the agent (Rust
//!   client, binary codec, one kept-alive HTTP/1.1 connection) vs. spawning
//!   `/bin/true` directly: p50/p99 and the overhead;
//! * upload and download throughput of a 256 MiB file vs. `cp` on the same
//!   disk.
//!
//! Run: `cargo run --release -p agentenv-guest --example guest_bench`
//! (`BENCH_ITERS` and `BENCH_MIB` change the sizes).

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use agentenv_guest::client::{GuestClient, collect_output};
use agentenv_guest::proto::process as pr;
use agentenv_guest::server::{AgentOptions, AgentState, serve};
use futures::StreamExt;
use tokio::io::AsyncWriteExt;

/// Writes dirty pages back before a timed copy, so that no copy pays for
/// the write-back of the one before it.
fn settle() {
    // SAFETY: sync(2) takes no arguments and cannot fail.
    unsafe { libc::sync() };
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let idx = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[idx.min(sorted.len() - 1)]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

async fn start_true(c: &GuestClient) {
    let req = pr::StartRequest {
        process: Some(pr::ProcessConfig {
            cmd: "/bin/true".into(),
            ..Default::default()
        }),
        stdin: Some(false),
        ..Default::default()
    };
    let stream = c.start(&req).await.expect("Process/Start");
    let out = collect_output(stream.map(|r| r.map(|m| m.event)))
        .await
        .expect("process events");
    assert_eq!(out.end.expect("end event").exit_code, 0);
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let iters = env_usize("BENCH_ITERS", 1000);
    let mib = env_usize("BENCH_MIB", 256);

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let state: Arc<AgentState> = AgentState::new(AgentOptions::default());
    tokio::spawn(serve(listener, state, std::future::pending()));
    let c = GuestClient::new(&format!("http://{addr}"))?;

    // ---------------------------------------------------------------- start
    for _ in 0..50 {
        start_true(&c).await;
        std::process::Command::new("/bin/true").status()?;
    }
    let mut direct = Vec::with_capacity(iters);
    let mut agent = Vec::with_capacity(iters);
    // Interleaved, so both see the same machine state.
    for _ in 0..iters {
        let t = Instant::now();
        let st = tokio::process::Command::new("/bin/true").status().await?;
        direct.push(t.elapsed());
        assert!(st.success());
        let t = Instant::now();
        start_true(&c).await;
        agent.push(t.elapsed());
    }
    direct.sort();
    agent.sort();
    let (d50, d99) = (percentile(&direct, 0.5), percentile(&direct, 0.99));
    let (a50, a99) = (percentile(&agent, 0.5), percentile(&agent, 0.99));
    println!(
        "Process/Start of /bin/true, {iters} runs each (agent: Rust client, binary codec, HTTP/1.1 keep-alive)"
    );
    println!(
        "  direct spawn      p50 {:8.3} ms   p99 {:8.3} ms",
        ms(d50),
        ms(d99)
    );
    println!(
        "  through agent     p50 {:8.3} ms   p99 {:8.3} ms",
        ms(a50),
        ms(a99)
    );
    println!(
        "  overhead          p50 {:8.3} ms   p99 {:8.3} ms   ratio p50 {:.2}x   (target: < 1 ms p50 overhead: {})",
        ms(a50.saturating_sub(d50)),
        ms(a99.saturating_sub(d99)),
        a50.as_secs_f64() / d50.as_secs_f64(),
        if a50.saturating_sub(d50) < Duration::from_millis(1) {
            "met"
        } else {
            "NOT met"
        }
    );

    // ------------------------------------------------------------ throughput
    let work = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/bench-tmp");
    std::fs::create_dir_all(&work)?;
    let dir = tempfile::tempdir_in(&work)?;
    let src = dir.path().join("src.bin");
    {
        let mut f = tokio::fs::File::create(&src).await?;
        let mut buf = vec![0u8; 1 << 20];
        let mut seed = 0x2545_F491_4F6C_DD1Du64;
        for _ in 0..mib {
            for chunk in buf.chunks_mut(8) {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                chunk.copy_from_slice(&seed.to_le_bytes()[..chunk.len()]);
            }
            f.write_all(&buf).await?;
        }
        f.flush().await?;
    }
    let bytes = (mib as f64) * 1024.0 * 1024.0;
    let rate = |d: Duration| bytes / d.as_secs_f64() / (1024.0 * 1024.0);
    // Interleaved rounds, best of each: the machine's load hits all alike.
    let runs = env_usize("BENCH_ROUNDS", 5);
    let cp_dst = dir.path().join("cp.bin");
    let up_dst = dir.path().join("up.bin");
    let down_dst = dir.path().join("down.bin");
    let (mut cp, mut up, mut down) = (Duration::MAX, Duration::MAX, Duration::MAX);
    let (mut up_s, mut down_s) = (Duration::MAX, Duration::MAX);
    for _ in 0..runs {
        let _ = std::fs::remove_file(&cp_dst);
        settle();
        let t = Instant::now();
        let st = tokio::process::Command::new("cp")
            .arg(&src)
            .arg(&cp_dst)
            .status()
            .await?;
        cp = cp.min(t.elapsed());
        assert!(st.success());

        let _ = std::fs::remove_file(&up_dst);
        settle();
        let t = Instant::now();
        c.upload_file(&src, up_dst.to_str().unwrap()).await?;
        up = up.min(t.elapsed());

        let _ = std::fs::remove_file(&down_dst);
        settle();
        let t = Instant::now();
        let n = c.download_to_file(src.to_str().unwrap(), &down_dst).await?;
        down = down.min(t.elapsed());
        assert_eq!(n as f64, bytes);

        // The same through the streaming API (hyper both ways).
        let _ = std::fs::remove_file(&up_dst);
        settle();
        let t = Instant::now();
        c.upload(
            up_dst.to_str().unwrap(),
            agentenv_guest::fileio::read_stream(std::fs::File::open(&src)?),
        )
        .await?;
        up_s = up_s.min(t.elapsed());
        let _ = std::fs::remove_file(&down_dst);
        settle();
        let t = Instant::now();
        let stream = c.download(src.to_str().unwrap()).await?;
        let n = agentenv_guest::fileio::write_stream(std::fs::File::create(&down_dst)?, stream)
            .await
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        down_s = down_s.min(t.elapsed());
        assert_eq!(n as f64, bytes);
    }
    println!(
        "File transfer of {mib} MiB on the same disk ({}), best of {runs}",
        work.display()
    );
    println!("  cp                {:8.1} MiB/s", rate(cp));
    println!(
        "  upload (POST)     {:8.1} MiB/s   {:5.1}% of cp (target >= 50%: {})",
        rate(up),
        100.0 * cp.as_secs_f64() / up.as_secs_f64(),
        if cp.as_secs_f64() / up.as_secs_f64() >= 0.5 {
            "met"
        } else {
            "NOT met"
        }
    );
    println!(
        "  download (GET)    {:8.1} MiB/s   {:5.1}% of cp (target >= 50%: {})",
        rate(down),
        100.0 * cp.as_secs_f64() / down.as_secs_f64(),
        if cp.as_secs_f64() / down.as_secs_f64() >= 0.5 {
            "met"
        } else {
            "NOT met"
        }
    );
    println!(
        "  streamed upload   {:8.1} MiB/s   {:5.1}% of cp (client through hyper, for comparison)",
        rate(up_s),
        100.0 * cp.as_secs_f64() / up_s.as_secs_f64()
    );
    println!(
        "  streamed download {:8.1} MiB/s   {:5.1}% of cp (client through hyper, for comparison)",
        rate(down_s),
        100.0 * cp.as_secs_f64() / down_s.as_secs_f64()
    );
    Ok(())
}
