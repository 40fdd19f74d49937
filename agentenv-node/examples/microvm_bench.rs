//! Lifecycle latency of the microvm backend, against the jail backend measured in the same
//! run.
//!
//! ```text
//! cargo run --release -p agentenv-node --example microvm_bench [-- --count N]
//! ```
//!
//! The microVMs run a small guest program (it prints and halts: on machines whose KVM is
//! `kvm_pvm` no Linux guest reaches userspace), so the numbers are the backend's own:
//! create (disk copy, namespace, tap, cgroup, VMM start until it answers), pause (vCPUs
//! parked, full snapshot of a 64 MiB guest, VMM stopped), resume (a new VMM restored from
//! the snapshot), destroy, and the delete a node does (kill; the rest in the cleanup
//! queue). The reference is the jail backend doing the same operations on
//! the `base` template with the tests' agent (create returns once PID 1 runs, pause and
//! resume freeze and thaw the cgroup). Also printed: the VMM's resident memory. Needs
//! root and `/dev/kvm`.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use agentenv_node::backend::jail::{JailBackend, JailConfig};
use agentenv_node::backend::microvm::{MicrovmBackend, MicrovmConfig};
use agentenv_node::backend::{SandboxBackend, SandboxSpec};
use agentenv_node::template::TemplateMeta;
use agentenv_testkit::bins::static_vmm_binary;
use agentenv_testkit::vmm as guest;
use anyhow::{Context, bail};

const OPS: [&str; 5] = ["create", "pause", "resume", "destroy", "delete"];

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1e3)
}

/// Runs create, pause, resume, destroy `count` times, and `count` times a create and the
/// delete a node does (`kill`: it answers once nothing of the sandbox runs, the rest goes
/// to the cleanup queue, drained before the next round); durations per operation.
async fn lifecycle(
    b: &dyn SandboxBackend,
    template: &str,
    memory_mb: u64,
    prefix: &str,
    count: usize,
) -> anyhow::Result<Vec<Vec<Duration>>> {
    let mut out = vec![Vec::with_capacity(count); OPS.len()];
    for i in 0..count {
        let mut spec = SandboxSpec::new(
            format!("{prefix}-{i}-{:06x}", rand::random::<u32>() >> 8),
            template,
        );
        spec.cpu_count = 1;
        spec.memory_mb = memory_mb;
        let id = spec.id.clone();
        let t = Instant::now();
        b.create(spec).await.context("create")?;
        out[0].push(t.elapsed());
        let t = Instant::now();
        b.pause(&id).await.context("pause")?;
        out[1].push(t.elapsed());
        let t = Instant::now();
        b.resume(&id).await.context("resume")?;
        out[2].push(t.elapsed());
        let t = Instant::now();
        b.destroy(&id).await.context("destroy")?;
        out[3].push(t.elapsed());

        let mut spec = SandboxSpec::new(
            format!("{prefix}-k{i}-{:06x}", rand::random::<u32>() >> 8),
            template,
        );
        spec.cpu_count = 1;
        spec.memory_mb = memory_mb;
        let id = spec.id.clone();
        b.create(spec).await.context("create")?;
        let t = Instant::now();
        b.kill(&id).await.context("delete")?;
        out[4].push(t.elapsed());
        if !b.drain_cleanups(Duration::from_secs(30)).await {
            bail!("the cleanup queue did not drain");
        }
    }
    for v in &mut out {
        v.sort();
    }
    Ok(out)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let mut count = 20usize;
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--count" => count = it.next().context("--count needs a number")?.parse()?,
            other => bail!("unknown argument {other}; use --count N"),
        }
    }
    if count < 2 {
        bail!("--count must be at least 2");
    }
    if !nix::unistd::Uid::effective().is_root() || !Path::new("/dev/kvm").exists() {
        bail!("needs root and /dev/kvm");
    }
    let data = tempfile::tempdir()?;
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));

    // microvm: a one-file template and the halting guest program.
    let templates = data.path().join("templates");
    std::fs::create_dir_all(templates.join("tiny/rootfs/etc"))?;
    std::fs::write(templates.join("tiny/rootfs/etc/hostname"), "tiny\n")?;
    let meta = TemplateMeta {
        name: "tiny".into(),
        built_at: 1,
        source: "bench".into(),
    };
    std::fs::write(
        templates.join("tiny/template.json"),
        serde_json::to_vec(&meta)?,
    )?;
    let agent = data.path().join("agent");
    std::fs::write(&agent, b"\x7fELF not run")?;
    let kernel = guest::halting_guest(data.path());
    let mut m = MicrovmConfig::new(data.path().join("vm"), &agent, static_vmm_binary(), kernel);
    m.templates.root = templates;
    m.cgroup_parent = "agentenv-bench".into();
    m.iface_prefix = "bv".into();
    m.address_pool = "10.15.200.0/24".parse()?;
    let vm_rules = (m.iface_prefix.clone(), m.runtime_dir.clone());
    let vm = MicrovmBackend::new_unchecked(m).await?;

    // jail: the base template of the tests and their agent.
    let mut j = JailConfig::new(
        data.path().join("jail"),
        root.join("tests/fixtures/test_agent.py"),
    );
    j.templates.root = PathBuf::from("/var/cache/agentenv-test/templates");
    j.cgroup_parent = "agentenv-bench".into();
    j.iface_prefix = "bj".into();
    j.address_pool = "10.15.201.0/24".parse()?;
    let jail_rules = (j.iface_prefix.clone(), j.runtime_dir.clone());
    let jail = JailBackend::new(j).await?;

    // Warm-up: the template image is built once, the base template checked once.
    lifecycle(&vm, "tiny", 64, "bvw", 1).await?;
    lifecycle(&jail, "base", 64, "bjw", 1).await?;

    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!("load before: {}", load.trim());
    let v = lifecycle(&vm, "tiny", 64, "bv", count).await?;
    let jl = lifecycle(&jail, "base", 64, "bj", count).await?;
    println!(
        "{count} sandboxes one after another (microvm: 64 MiB guest program; jail: base template, test agent)"
    );
    println!(
        "{:<8} {:>12} {:>12} {:>12} {:>12} {:>10}",
        "op", "microvm p50", "microvm p99", "jail p50", "jail p99", "p50 ratio"
    );
    for (k, op) in OPS.iter().enumerate() {
        let (a, b) = (percentile(&v[k], 0.5), percentile(&jl[k], 0.5));
        println!(
            "{:<8} {:>12} {:>12} {:>12} {:>12} {:>9.1}x",
            op,
            ms(a),
            ms(percentile(&v[k], 0.99)),
            ms(b),
            ms(percentile(&jl[k], 0.99)),
            a.as_secs_f64() / b.as_secs_f64().max(1e-9)
        );
    }

    // The VMM's own memory: resident set of a running VMM whose guest touched little.
    let mut spec = SandboxSpec::new(format!("bvm-{:06x}", rand::random::<u32>() >> 8), "tiny");
    spec.cpu_count = 1;
    spec.memory_mb = 64;
    let id = spec.id.clone();
    vm.create(spec).await?;
    // Read from the host: the jailed VMM has no /proc of its own to report it from.
    let pid = vm.vmm_pid(&id).context("no VMM process")?;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let rss = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|kib| kib.parse::<u64>().ok())
        .context("no VmRSS in the VMM's status")?
        * 1024;
    println!(
        "VMM resident memory with a 64 MiB guest that touched a few pages: {:.1} MiB",
        rss as f64 / (1 << 20) as f64
    );
    vm.destroy(&id).await?;
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!("load after: {}", load.trim());
    // Leave no host firewall chains of the two prefixes behind.
    jail.shutdown().await;
    for (prefix, runtime_dir) in [vm_rules, jail_rules] {
        if let Err(e) = agentenv_node::host::net::uninstall_host_rules(
            &prefix,
            &runtime_dir,
            std::time::Duration::from_secs(5),
        )
        .await
        {
            eprintln!("host firewall rules of {prefix} stay: {e}");
        }
    }
    Ok(())
}
