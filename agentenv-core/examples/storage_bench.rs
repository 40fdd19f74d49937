//! Throughput of the `Storage` seam on the `fs` service (a local directory standing in for
//! a shared mount) against a plain file copy on the same disk, measured in the same run.
//!
//! `cargo run --release -p agentenv-core --example storage_bench [MiB] [rounds]`

use std::path::Path;
use std::time::{Duration, Instant};

use agentenv_core::storage::{OpendalStorage, Storage, StorageConfig};

fn mib_s(bytes: u64, d: Duration) -> f64 {
    bytes as f64 / (1 << 20) as f64 / d.as_secs_f64()
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

async fn copy_reference(src: &Path, dst: &Path) -> Duration {
    let t = Instant::now();
    tokio::fs::copy(src, dst).await.expect("copy");
    let f = tokio::fs::File::open(dst).await.expect("open");
    f.sync_all().await.expect("sync");
    t.elapsed()
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let mib: u64 = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(256);
    let rounds: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(5);
    let bytes = mib << 20;
    let dir = tempfile::tempdir_in(std::env::var_os("TMPDIR").unwrap_or_else(|| "/var/tmp".into()))
        .expect("temp dir");
    let src = dir.path().join("src.bin");
    {
        use std::io::Write;
        let mut f = std::io::BufWriter::new(std::fs::File::create(&src).expect("create"));
        let block: Vec<u8> = (0..1 << 20).map(|i: u32| (i * 31 % 251) as u8).collect();
        for _ in 0..mib {
            f.write_all(&block).expect("write");
        }
    }
    let store = OpendalStorage::open(&StorageConfig::Fs {
        root: dir.path().join("store"),
    })
    .expect("open store");
    store.check().await.expect("check");

    let (mut copy, mut put, mut get, mut stream) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for i in 0..rounds {
        copy.push(copy_reference(&src, &dir.path().join(format!("copy-{i}"))).await);
        let t = Instant::now();
        store
            .put_file(&format!("artifacts/s{i}/layer"), &src)
            .await
            .expect("put");
        put.push(t.elapsed());
        let t = Instant::now();
        let n = store
            .get_file(
                &format!("artifacts/s{i}/layer"),
                &dir.path().join(format!("get-{i}")),
            )
            .await
            .expect("get");
        get.push(t.elapsed());
        assert_eq!(n, bytes);
        // The streamed path (what an S3 upload takes): from an AsyncRead, 1 MiB buffers.
        let t = Instant::now();
        let mut f = tokio::fs::File::open(&src).await.expect("open");
        let n = store
            .put(&format!("artifacts/s{i}/streamed"), &mut f)
            .await
            .expect("put");
        stream.push(t.elapsed());
        assert_eq!(n, bytes);
        let _ = std::fs::remove_file(dir.path().join(format!("copy-{i}")));
        let _ = std::fs::remove_file(dir.path().join(format!("get-{i}")));
        store
            .delete_prefix(&format!("artifacts/s{i}/"))
            .await
            .expect("delete");
    }
    let (c, p, g, st) = (median(copy), median(put), median(get), median(stream));
    println!("storage fs: {mib} MiB object, median of {rounds} rounds");
    println!(
        "  reference (tokio::fs::copy + fsync)   {:>8.1} MiB/s  {:>8.1} ms",
        mib_s(bytes, c),
        c.as_secs_f64() * 1e3
    );
    println!(
        "  put_file (kernel copy, fsync, rename) {:>8.1} MiB/s  {:>8.1} ms  ratio {:.2}x reference time",
        mib_s(bytes, p),
        p.as_secs_f64() * 1e3,
        p.as_secs_f64() / c.as_secs_f64()
    );
    println!(
        "  get_file (kernel copy, fsync, rename) {:>8.1} MiB/s  {:>8.1} ms  ratio {:.2}x reference time",
        mib_s(bytes, g),
        g.as_secs_f64() * 1e3,
        g.as_secs_f64() / c.as_secs_f64()
    );
    println!(
        "  put (AsyncRead stream, fsync)         {:>8.1} MiB/s  {:>8.1} ms  ratio {:.2}x reference time",
        mib_s(bytes, st),
        st.as_secs_f64() * 1e3,
        st.as_secs_f64() / c.as_secs_f64()
    );
}
