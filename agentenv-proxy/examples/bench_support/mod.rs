//! What the gateway benchmarks share: driving wrk, medians, CPU seconds of
//! threads, the load average.

use std::path::Path;
use std::process::Command;

#[derive(Debug, Clone, Copy)]
pub struct Run {
    pub rps: f64,
    pub p50_us: f64,
    pub p99_us: f64,
    /// CPU time the proxy itself spent per request (µs); NaN for direct.
    pub cpu_us: f64,
}

pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// Each figure's median over the runs.
pub fn median_run(runs: &[Run]) -> Run {
    let of = |f: fn(&Run) -> f64| median(runs.iter().map(f).collect());
    Run {
        rps: of(|r| r.rps),
        p50_us: of(|r| r.p50_us),
        p99_us: of(|r| r.p99_us),
        cpu_us: of(|r| r.cpu_us),
    }
}

/// The 1, 5 and 15 minute load averages: the machine may be shared, and
/// numbers measured under load are not comparable.
pub fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".into())
}

/// Clock ticks per second of /proc stat times.
pub fn clock_ticks() -> f64 {
    Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok())
        .unwrap_or(100.0)
}

/// (ppid, utime + stime in ticks) from a /proc stat line.
pub fn stat_times(path: &Path) -> Option<(u32, u64)> {
    let text = std::fs::read_to_string(path).ok()?;
    // Fields after the command name, which ends with the last ')'.
    let rest = &text[text.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ppid = f.get(1)?.parse().ok()?;
    let ticks = f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?;
    Some((ppid, ticks))
}

/// CPU seconds used so far by this process's threads named `prefix…`.
pub fn threads_cpu_seconds(prefix: &str) -> f64 {
    let mut ticks = 0;
    for entry in std::fs::read_dir("/proc/self/task")
        .into_iter()
        .flatten()
        .flatten()
    {
        let comm = std::fs::read_to_string(entry.path().join("comm")).unwrap_or_default();
        if comm.starts_with(prefix)
            && let Some((_, t)) = stat_times(&entry.path().join("stat"))
        {
            ticks += t;
        }
    }
    ticks as f64 / clock_ticks()
}

pub fn which(tool: &str) -> Option<String> {
    let out = Command::new("sh")
        .arg("-c")
        .arg(format!("command -v {tool}"))
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

pub fn wrk(url: &str, conns: usize, secs: u64) -> Run {
    let threads = conns.min(2);
    let out = Command::new("wrk")
        .args([
            "-t",
            &threads.to_string(),
            "-c",
            &conns.to_string(),
            "-d",
            &format!("{secs}s"),
            "--latency",
        ])
        .args([
            "-H",
            "e2b-sandbox-id: sbx-bench",
            "-H",
            "e2b-sandbox-port: 49983",
        ])
        .arg(url)
        .output()
        .expect("run wrk");
    let text = String::from_utf8_lossy(&out.stdout);
    let field = |prefix: &str| -> Option<&str> {
        text.lines()
            .map(str::trim)
            .find(|l| l.starts_with(prefix))
            .and_then(|l| l[prefix.len()..].split_whitespace().next())
    };
    let rps: f64 = field("Requests/sec:")
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| {
            panic!(
                "wrk output:\n{text}{}",
                String::from_utf8_lossy(&out.stderr)
            )
        });
    if let Some(errors) = text
        .lines()
        .find(|l| l.contains("Non-2xx") || l.contains("Socket errors"))
    {
        eprintln!("bench: wrk against {url} reported: {}", errors.trim());
    }
    Run {
        rps,
        p50_us: field("50%").map(micros).expect("p50"),
        p99_us: field("99%").map(micros).expect("p99"),
        cpu_us: f64::NAN,
    }
}

pub fn micros(v: &str) -> f64 {
    let split = v.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(v.len());
    let (n, unit) = v.split_at(split);
    let n: f64 = n.parse().unwrap_or(f64::NAN);
    match unit {
        "us" => n,
        "ms" => n * 1e3,
        "s" => n * 1e6,
        "m" => n * 60e6,
        _ => f64::NAN,
    }
}
