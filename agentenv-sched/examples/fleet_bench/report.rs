//! The side-by-side table and the targets.

use crate::Opts;
use crate::fleet::{Recorded, Series};
use crate::server::{ProcStats, StoreKind};

/// What one store's run measured.
#[derive(Default)]
pub struct Figures {
    pub warmup_secs: f64,
    pub warmup_checked: usize,
    pub warmup_found: usize,
    pub warmup_bindings: Option<u64>,
    pub rss_after_warmup_kib: u64,
    pub measured_secs: f64,
    pub sched: ProcStats,
    pub sched_cpu: f64,
    pub redis: Option<ProcStats>,
    pub redis_cpu: f64,
    pub load_cpu: f64,
    pub bindings: Option<u64>,
    pub recorded: Option<Recorded>,
    /// /proc/loadavg's 1-minute figure at the end of the measured phase.
    pub load_avg: String,
}

const RSS_TARGET_KIB: u64 = 1024 * 1024;
const P99_TARGET_MS: f64 = 2.0;
/// Heartbeats must be ingested at this share of the offered rate for the
/// Schedule target to count as "while ingesting".
const INGEST_SHARE: f64 = 0.99;

fn mib(kib: u64) -> String {
    format!("{} MiB", kib / 1024)
}

fn thousands(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

fn lat(s: &Series, quantiles: &[f64]) -> String {
    if s.ok == 0 {
        return "no calls".into();
    }
    quantiles
        .iter()
        .map(|&q| format!("{:.2}", s.ms(q)))
        .collect::<Vec<_>>()
        .join(" / ")
        + " ms"
}

fn problems(s: &Series) -> String {
    let mut p = Vec::new();
    if s.errors > 0 {
        p.push(format!(
            "{} errors ({})",
            s.errors,
            s.last_error.as_deref().unwrap_or("")
        ));
    }
    if s.not_found > 0 {
        p.push(format!("{} not found", s.not_found));
    }
    if s.dropped > 0 {
        p.push(format!("{} not sent (generator saturated)", s.dropped));
    }
    p.join(", ")
}

fn verdict(pass: bool) -> &'static str {
    if pass { "PASS" } else { "MISS" }
}

/// The heartbeats/s achieved during the measured phase.
fn ingest(f: &Figures, r: &Recorded) -> f64 {
    r.heartbeat.lock().ok as f64 / f.measured_secs
}

pub fn print(o: &Opts, results: &[(StoreKind, Result<Figures, String>)]) {
    let offered = o.nodes as f64 / o.interval.as_secs_f64();
    type Row<'a> = (&'a str, Box<dyn Fn(&Figures, &Recorded) -> String + 'a>);
    let rows: Vec<Row> = vec![
        (
            "warm-up: all bindings loaded in",
            Box::new(|f, _| {
                format!(
                    "{:.1} s ({:.0} hb/s)",
                    f.warmup_secs,
                    o.nodes as f64 / f.warmup_secs
                )
            }),
        ),
        (
            "  bindings found (sampled lookups)",
            Box::new(|f, _| format!("{}/{}", f.warmup_found, f.warmup_checked)),
        ),
        (
            "heartbeats/s achieved / offered",
            Box::new(|f, r| format!("{:.0} / {offered:.0}", ingest(f, r))),
        ),
        (
            "Heartbeat p50 / p99",
            Box::new(|_, r| lat(&r.heartbeat.lock(), &[0.5, 0.99])),
        ),
        (
            "Schedule p50 / p99 / p99.9",
            Box::new(|_, r| lat(&r.schedule.lock(), &[0.5, 0.99, 0.999])),
        ),
        (
            "RecordAssignment p50 / p99",
            Box::new(|_, r| lat(&r.record.lock(), &[0.5, 0.99])),
        ),
        (
            "LookupNode p50 / p99",
            Box::new(|_, r| lat(&r.lookup.lock(), &[0.5, 0.99])),
        ),
        (
            "reference: health p50 / p99 / p99.9",
            Box::new(|_, r| lat(&r.health.lock(), &[0.5, 0.99, 0.999])),
        ),
        (
            "creates / lookups done",
            Box::new(|_, r| {
                format!(
                    "{} / {}",
                    thousands(r.record.lock().ok),
                    thousands(r.lookup.lock().ok)
                )
            }),
        ),
        (
            "bindings after warm-up / at end",
            Box::new(|f, _| {
                let n = |v: Option<u64>| v.map_or("?".into(), thousands);
                format!("{} / {}", n(f.warmup_bindings), n(f.bindings))
            }),
        ),
        (
            "scheduler RSS after warm-up",
            Box::new(|f, _| mib(f.rss_after_warmup_kib)),
        ),
        (
            "scheduler RSS at end / peak",
            Box::new(|f, _| format!("{} / {}", mib(f.sched.rss_kib), mib(f.sched.hwm_kib))),
        ),
        (
            "CPU s: scheduler / Redis / load gen",
            Box::new(|f, _| {
                let redis = f
                    .redis
                    .map_or("-".to_string(), |_| format!("{:.1}", f.redis_cpu));
                format!("{:.1} / {redis} / {:.1}", f.sched_cpu, f.load_cpu)
            }),
        ),
        (
            "  share of the measured wall time",
            Box::new(|f, _| {
                let pct = |s: f64| format!("{:.0}%", 100.0 * s / f.measured_secs);
                let redis = f.redis.map_or("-".to_string(), |_| pct(f.redis_cpu));
                format!("{} / {redis} / {}", pct(f.sched_cpu), pct(f.load_cpu))
            }),
        ),
        (
            "machine load average (1 min) at end",
            Box::new(|f, _| f.load_avg.clone()),
        ),
        (
            "Redis RSS at end",
            Box::new(|f, _| f.redis.map_or("-".into(), |r| mib(r.rss_kib))),
        ),
    ];
    print!("{:<38}", "");
    for (kind, _) in results {
        print!(" {:>30}", format!("{} store", kind.name()));
    }
    println!();
    for (name, value) in &rows {
        print!("{name:<38}");
        for (_, r) in results {
            let cell = match r {
                Ok(f) => f.recorded.as_ref().map_or("-".into(), |rec| value(f, rec)),
                Err(_) => "n/a".into(),
            };
            print!(" {cell:>30}");
        }
        println!();
    }
    for (kind, r) in results {
        match r {
            Err(e) => println!("\n{} store: not measured: {e}", kind.name()),
            Ok(f) => {
                let Some(rec) = &f.recorded else { continue };
                for (what, s) in [
                    ("Heartbeat", &rec.heartbeat),
                    ("Schedule", &rec.schedule),
                    ("RecordAssignment", &rec.record),
                    ("LookupNode", &rec.lookup),
                    ("health", &rec.health),
                ] {
                    let p = problems(&s.lock());
                    if !p.is_empty() {
                        println!("{} store, {what}: {p}", kind.name());
                    }
                }
            }
        }
    }

    println!("\ntargets:");
    let bindings = o.nodes * o.per_node;
    for (kind, r) in results {
        let Ok(f) = r else { continue };
        let Some(rec) = &f.recorded else { continue };
        if *kind == StoreKind::Memory {
            let peak = f.sched.hwm_kib;
            println!(
                "  {} RSS < 1 GB with {} bindings, in-memory store: peak {}{}",
                verdict(peak < RSS_TARGET_KIB),
                thousands(bindings as u64),
                mib(peak),
                if bindings < 1_000_000 {
                    " (fewer bindings than the target's 1,000,000)"
                } else {
                    ""
                }
            );
        }
        let rate = ingest(f, rec);
        let p99 = rec.schedule.lock().ms(0.99);
        let ingesting = rate >= offered * INGEST_SHARE;
        println!(
            "  {} Schedule p99 < 2 ms while ingesting {offered:.0} heartbeats/s, {} store: p99 {p99:.2} ms at {rate:.0} heartbeats/s",
            verdict(p99 < P99_TARGET_MS && ingesting),
            kind.name()
        );
        if *kind == StoreKind::Redis {
            let p99 = rec.lookup.lock().ms(0.99);
            println!(
                "  {} LookupNode p99 < 2 ms with Redis: {p99:.2} ms",
                verdict(p99 < P99_TARGET_MS)
            );
        }
    }
}
