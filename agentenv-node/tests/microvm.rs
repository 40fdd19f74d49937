//! The microvm backend driven with a small guest program as its "kernel" (the agent never
//! answers, so these tests pin the VM lifecycle, not the agent): the VMM runs inside the
//! sandbox's network namespace and cgroup with the tap attached; pause leaves a snapshot
//! and no VMM; resume restores a VMM from it; keep/create and capture/import restore it;
//! destroy, a kill with its background cleanup, and reconcile leave no process,
//! namespace, link, cgroup, file or address.

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::time::Duration;

use agentenv_node::backend::microvm::{MicrovmBackend, MicrovmConfig};
use agentenv_node::backend::{BackendError, SandboxBackend, SandboxSpec, SandboxState};
use agentenv_node::template::TemplateMeta;
use agentenv_testkit::Wait;
use agentenv_testkit::bins::static_vmm_binary;
use agentenv_testkit::host_rules as rules_common;
use agentenv_testkit::vmm as guest;
use agentenv_vmm::snapshot::{MEMORY_FILE, STATE_FILE};

const TIMEOUT: Duration = Duration::from_secs(30);

/// Why these tests cannot run here, if they cannot.
fn skip_reason() -> Option<String> {
    if !nix::unistd::Uid::effective().is_root() {
        return Some("the microvm backend needs root (namespaces, cgroups, taps)".into());
    }
    if !Path::new("/dev/kvm").exists() {
        return Some("/dev/kvm is missing".into());
    }
    None
}

macro_rules! require_microvm {
    () => {
        if let Some(reason) = skip_reason() {
            println!("SKIPPED: {reason}");
            return;
        }
    };
}

/// A template store with one small template, `tiny`.
fn tiny_template(root: &Path) {
    let t = root.join("tiny");
    std::fs::create_dir_all(t.join("rootfs/etc")).unwrap();
    std::fs::write(t.join("rootfs/etc/hostname"), "tiny\n").unwrap();
    let meta = TemplateMeta {
        name: "tiny".into(),
        built_at: 1,
        source: "test".into(),
    };
    std::fs::write(t.join("template.json"), serde_json::to_vec(&meta).unwrap()).unwrap();
}

/// A backend on `data` whose sandbox addresses come from `10.17.<net>.0/24`: each test has
/// its own network, so no other test reuses its addresses and link names meanwhile.
async fn backend(data: &Path, net: u8) -> MicrovmBackend {
    agentenv_testkit::node::init_tracing();
    let kernel = guest::halting_guest(data);
    let agent = data.join("agentenv-guest");
    std::fs::write(&agent, b"\x7fELF the agent never runs in these tests").unwrap();
    let mut cfg = MicrovmConfig::new(data, &agent, static_vmm_binary(), kernel);
    cfg.templates.root = data.join("templates");
    tiny_template(&cfg.templates.root);
    cfg.cgroup_parent = "agentenv-test-vm".into();
    // This test process's own prefix: its host chains go when the process exits.
    cfg.iface_prefix = rules_common::process_prefix('v');
    rules_common::remove_at_exit(&cfg.iface_prefix, &cfg.runtime_dir);
    // Apart from the cluster tests' node pools (10.15.<idx>.0/24), which reserve
    // addresses in another runtime directory.
    cfg.address_pool = format!("10.17.{net}.0/24").parse().unwrap();
    // The guest program is a plain ELF, not a Linux kernel: KVM under kvm_pvm runs it.
    MicrovmBackend::new_unchecked(cfg).await.unwrap()
}

fn spec(id: &str) -> SandboxSpec {
    let mut s = SandboxSpec::new(id, "tiny");
    s.cpu_count = 1;
    s.memory_mb = 32;
    s
}

fn id(name: &str) -> String {
    format!("{name}-{:08x}", rand::random::<u32>())
}

fn netns_inode(pid: i32) -> u64 {
    std::fs::metadata(format!("/proc/{pid}/ns/net"))
        .unwrap()
        .ino()
}

fn alive(pid: i32) -> bool {
    // A reaped process has no /proc entry; a zombie has state Z.
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| {
            s.rsplit_once(") ")
                .is_some_and(|(_, rest)| !rest.starts_with('Z'))
        })
        .unwrap_or(false)
}

async fn wait_gone(pid: i32) {
    Wait::new(format_args!("pid {pid} to end"), TIMEOUT)
        .every(Duration::from_millis(5))
        .until(|| std::future::ready(!alive(pid)))
        .await;
}

/// The interface the VMM attached to: `iff:` in the fdinfo of its /dev/net/tun descriptor.
fn vmm_taps(pid: i32) -> Vec<String> {
    // A tun descriptor's fdinfo names its interface (`iff:`); the path it was opened by is
    // the VMM's jail's, which the host may not resolve.
    let mut out = Vec::new();
    for e in std::fs::read_dir(format!("/proc/{pid}/fdinfo"))
        .unwrap()
        .flatten()
    {
        let info = std::fs::read_to_string(e.path()).unwrap_or_default();
        if let Some(l) = info.lines().find_map(|l| l.strip_prefix("iff:")) {
            out.push(l.trim().to_string());
        }
    }
    out
}

async fn serial_contains(dir: &Path, text: &str) -> bool {
    Wait::new(format_args!("{text:?} on the serial console"), TIMEOUT)
        .every(Duration::from_millis(5))
        .try_until(|| {
            std::future::ready(
                std::fs::read_to_string(dir.join("jail/run/serial.log"))
                    .unwrap_or_default()
                    .contains(text),
            )
        })
        .await
        .is_ok()
}

/// Checks that a running sandbox's VMM sits in its namespace and cgroup with the tap.
async fn assert_vmm_in_place(b: &MicrovmBackend, id: &str) -> i32 {
    let pid = b.vmm_pid(id).expect("a VMM runs");
    assert!(alive(pid));
    let host_ns = std::fs::metadata("/proc/self/ns/net").unwrap().ino();
    assert_ne!(
        netns_inode(pid),
        host_ns,
        "the VMM runs in the sandbox namespace"
    );
    let dirs = b.cgroup_dirs(id);
    assert!(!dirs.is_empty());
    for d in &dirs {
        let procs = std::fs::read_to_string(d.join("cgroup.procs")).unwrap();
        assert!(
            procs.lines().any(|l| l.trim() == pid.to_string()),
            "VMM {pid} not in {}: {procs}",
            d.display()
        );
    }
    let tap = b
        .run_in_sandbox(id, "ip", &["-d", "addr", "show", "dev", "tap0"])
        .unwrap();
    assert!(tap.contains("tun type tap"), "{tap}");
    assert!(tap.contains("inet 169.254.0.22/30"), "{tap}");
    let eth0 = b
        .run_in_sandbox(id, "ip", &["-4", "addr", "show", "dev", "eth0"])
        .unwrap();
    let ip = b.get(id).await.unwrap().address.ip;
    assert!(eth0.contains(&format!("inet {ip}/30")), "{eth0}");
    let nat = b
        .run_in_sandbox(id, "iptables", &["-w", "-t", "nat", "-S"])
        .unwrap();
    assert!(
        nat.contains(&format!(
            "-A PREROUTING -d {ip}/32 -i eth0 -j DNAT --to-destination 169.254.0.21"
        )),
        "{nat}"
    );
    assert!(
        nat.contains(&format!(
            "-A POSTROUTING -s 169.254.0.21/32 -o eth0 -j SNAT --to-source {ip}"
        )),
        "{nat}"
    );
    let forwarding = b
        .run_in_sandbox(id, "cat", &["/proc/sys/net/ipv4/ip_forward"])
        .unwrap();
    assert_eq!(forwarding.trim(), "1");
    assert_eq!(
        vmm_taps(pid),
        vec!["tap0".to_string()],
        "the VMM attached to tap0"
    );
    let proc_status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    assert!(
        proc_status.lines().any(|l| l == "Seccomp:\t2"),
        "the VMM runs under its seccomp filter"
    );
    // The jailer: an unprivileged uid of the pool, no capabilities, no environment, and
    // the sandbox's jail directory as its root.
    let field = |name: &str| {
        proc_status
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{name}:\t")))
            .unwrap_or_default()
            .to_string()
    };
    let uids: Vec<u32> = field("Uid")
        .split_whitespace()
        .map(|u| u.parse().unwrap())
        .collect();
    assert_eq!(uids.len(), 4, "{proc_status}");
    assert!(uids.iter().all(|u| *u == uids[0]), "{proc_status}");
    assert!(
        uids[0] >= 100_000,
        "the VMM runs as a pool id: {proc_status}"
    );
    for caps in ["CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"] {
        assert_eq!(field(caps), "0000000000000000", "{caps}: {proc_status}");
    }
    assert_eq!(field("NoNewPrivs"), "1");
    assert!(
        std::fs::read(format!("/proc/{pid}/environ"))
            .unwrap()
            .is_empty(),
        "the VMM's environment is empty"
    );
    let jail = std::fs::metadata(b.sandbox_dir(id).join("jail")).unwrap();
    let root = std::fs::metadata(format!("/proc/{pid}/root/")).unwrap();
    assert_eq!(
        (root.dev(), root.ino()),
        (jail.dev(), jail.ino()),
        "the VMM's root is its jail directory"
    );
    let seen: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/root/"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    for name in &seen {
        assert!(
            ["vm.json", "vmlinux", "rootfs.ext4", "dev", "run"].contains(&name.as_str()),
            "unexpected {name} in the VMM's jail: {seen:?}"
        );
    }
    let status = b.vmm_client(id).unwrap().status().await.unwrap();
    assert_eq!(status["state"], "running");
    pid
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn create_pause_resume_destroy_runs_the_vmm_in_the_sandbox_and_leaves_nothing() {
    require_microvm!();
    let data = tempfile::tempdir().unwrap();
    let b = backend(data.path(), 1).await;
    let links_before = b.host_interfaces().await;
    let sid = id("life");
    let info = b.create(spec(&sid)).await.unwrap();
    let dir = b.sandbox_dir(&sid);
    assert_eq!(info.state, SandboxState::Running);
    assert!(b.address_reserved(info.address.ip));
    let host_if = b.host_interface(&sid).unwrap();
    assert!(b.host_interfaces().await.contains(&host_if));
    assert!(!links_before.contains(&host_if));
    let pid = assert_vmm_in_place(&b, &sid).await;
    let ns = netns_inode(pid);
    assert!(serial_contains(&dir, "ready").await, "the guest ran");
    let vm: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("jail/vm.json")).unwrap()).unwrap();
    let cmdline = vm["cmdline"].as_str().unwrap();
    assert!(
        cmdline.contains(&format!(
            "ip=169.254.0.21::169.254.0.22:255.255.255.252:{sid}:eth0:off"
        )),
        "{cmdline}"
    );
    assert!(
        cmdline.contains("init=/agentenv/agentenv-guest"),
        "{cmdline}"
    );
    assert!(dir.join("jail/rootfs.ext4").is_file());
    let usage = b.usage(&sid).await.unwrap();
    assert!(usage.memory_limit_bytes >= 32 << 20, "{usage:?}");
    assert!(usage.processes >= 1, "{usage:?}");

    b.pause(&sid).await.unwrap();
    assert_eq!(b.get(&sid).await.unwrap().state, SandboxState::Paused);
    assert!(dir.join("jail/run/snapshot").join(STATE_FILE).is_file());
    assert!(dir.join("jail/run/snapshot").join(MEMORY_FILE).is_file());
    wait_gone(pid).await;
    assert_eq!(b.vmm_pid(&sid), None);
    // Pausing again is a no-op.
    b.pause(&sid).await.unwrap();
    // The sandbox keeps its network while paused.
    assert!(
        b.run_in_sandbox(&sid, "ip", &["link", "show", "tap0"])
            .is_ok()
    );

    let resumed = b.resume(&sid).await.unwrap();
    assert_eq!(resumed.state, SandboxState::Running);
    assert_eq!(resumed.address, info.address);
    let pid2 = assert_vmm_in_place(&b, &sid).await;
    assert_ne!(pid2, pid);
    assert_eq!(netns_inode(pid2), ns, "restored into the same namespace");
    assert!(
        std::fs::read_to_string(dir.join("vmm.log"))
            .unwrap()
            .contains("restored=true"),
        "the second VMM restored the snapshot"
    );
    let client = b.vmm_client(&sid).unwrap();
    let m = client.metrics().await.unwrap();
    assert_eq!(m["state"], "running");
    // rootfs, eth0, balloon, rng
    assert_eq!(m["virtio_devices"], 4, "{m}");
    client.balloon_set_target(8).await.unwrap();
    let stats = client.balloon_stats().await.unwrap();
    assert_eq!(stats["target_mib"], 8, "{stats}");

    let cgroups = b.cgroup_dirs(&sid);
    b.destroy(&sid).await.unwrap();
    wait_gone(pid2).await;
    assert!(!dir.exists(), "the sandbox directory is gone");
    for d in &cgroups {
        assert!(!d.exists(), "{} is left", d.display());
    }
    assert!(!b.address_reserved(info.address.ip));
    // The host end of the veth goes only with the namespace holding its peer: the
    // namespace is gone too (its inode number may already serve another namespace).
    assert!(!b.host_interfaces().await.contains(&host_if));
    assert!(matches!(
        b.destroy(&sid).await,
        Err(BackendError::NotFound(_))
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kill_answers_with_the_vmm_killed_and_the_cleanup_queue_gives_back_the_rest() {
    require_microvm!();
    let data = tempfile::tempdir().unwrap();
    let b = backend(data.path(), 6).await;
    let sid = id("kill");
    let info = b.create(spec(&sid)).await.unwrap();
    let dir = b.sandbox_dir(&sid);
    let pid = assert_vmm_in_place(&b, &sid).await;
    let host_if = b.host_interface(&sid).unwrap();
    let cgroups = b.cgroup_dirs(&sid);

    b.kill(&sid).await.unwrap();
    // At once: the VMM runs no more and the backend no longer knows the sandbox.
    assert!(
        !agentenv_testkit::node::runs_on(pid),
        "the VMM (pid {pid}) still runs after the kill"
    );
    assert!(matches!(b.get(&sid).await, Err(BackendError::NotFound(_))));
    assert!(matches!(b.kill(&sid).await, Err(BackendError::NotFound(_))));

    // The queue gives back the rest, and nothing failed on the way.
    assert!(
        b.drain_cleanups(TIMEOUT).await,
        "the cleanup did not finish"
    );
    wait_gone(pid).await;
    assert!(!dir.exists(), "the sandbox directory is left");
    for d in &cgroups {
        assert!(!d.exists(), "{} is left", d.display());
    }
    assert!(!b.address_reserved(info.address.ip));
    assert!(!b.host_interfaces().await.contains(&host_if));
    // It was the queue's job (a backend without one destroys in the kill itself).
    let stats = b.cleanups();
    assert_eq!(
        (
            stats.finished,
            stats.failures,
            stats.abandoned,
            stats.pending
        ),
        (1, 0, 0, 0),
        "{stats:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kept_snapshot_restores_with_its_memory_size_and_reconcile_drops_unreferenced_ones() {
    require_microvm!();
    let data = tempfile::tempdir().unwrap();
    let b = backend(data.path(), 2).await;
    let sid = id("keep");
    let info = b.create(spec(&sid)).await.unwrap();
    let e = b.keep(&sid).await.unwrap_err();
    assert!(matches!(e, BackendError::InvalidState { .. }), "{e}");
    b.pause(&sid).await.unwrap();
    let kept = b.keep(&sid).await.unwrap();
    assert!(
        kept.path
            .join("jail/run/snapshot")
            .join(STATE_FILE)
            .is_file()
    );
    assert!(
        !b.address_reserved(info.address.ip),
        "keep releases the address"
    );
    assert!(b.get(&sid).await.is_err());

    let mut again = spec(&sid);
    again.kept = Some(kept.clone());
    let info2 = b.create(again).await.unwrap();
    assert_eq!(info2.memory_mb, 32);
    assert!(!kept.path.exists(), "create takes the kept state over");
    assert_vmm_in_place(&b, &sid).await;
    b.pause(&sid).await.unwrap();
    let kept2 = b.keep(&sid).await.unwrap();

    // Reconcile keeps what is referenced and removes the rest.
    let report = b.reconcile(std::slice::from_ref(&kept2)).await.unwrap();
    assert!(kept2.path.exists(), "{report:?}");
    let report = b.reconcile(&[]).await.unwrap();
    assert!(!kept2.path.exists(), "{report:?}");
    b.discard_kept(&kept2).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_capture_of_a_running_sandbox_starts_new_sandboxes_next_to_it() {
    require_microvm!();
    let data = tempfile::tempdir().unwrap();
    let b = backend(data.path(), 3).await;
    let sid = id("src");
    let info = b.create(spec(&sid)).await.unwrap();
    let pid = b.vmm_pid(&sid).unwrap();
    let capture_dir = data.path().join("capture");
    std::fs::create_dir(&capture_dir).unwrap();
    let capture = b.snapshot(&sid, &capture_dir).await.unwrap();
    assert_eq!(capture.backend, "microvm");
    for f in &capture.files {
        assert!(capture_dir.join(f).is_file(), "{f} missing");
    }
    assert!(capture.files.iter().any(|f| f == STATE_FILE));
    // The source runs on in the same VMM.
    assert_eq!(b.vmm_pid(&sid), Some(pid));
    assert_eq!(b.get(&sid).await.unwrap().state, SandboxState::Running);
    assert_eq!(
        b.vmm_client(&sid).unwrap().status().await.unwrap()["state"],
        "running"
    );

    let kept = b.import_snapshot(&capture, &capture_dir).await.unwrap();
    let fork = id("fork");
    let mut s = spec(&fork);
    s.kept = Some(kept);
    let finfo = b.create(s).await.unwrap();
    assert_ne!(
        finfo.address.ip, info.address.ip,
        "each sandbox has its address"
    );
    assert_vmm_in_place(&b, &fork).await;
    assert!(
        std::fs::read_to_string(b.sandbox_dir(&fork).join("vmm.log"))
            .unwrap()
            .contains("restored=true"),
        "the fork restored the capture"
    );
    // A capture of another backend is refused.
    let bad = agentenv_node::backend::SnapshotCapture {
        backend: "jail".into(),
        files: vec!["layer.tar".into()],
    };
    let e = b.import_snapshot(&bad, &capture_dir).await.unwrap_err();
    assert!(e.to_string().contains("not by a microVM"), "{e}");
    b.destroy(&fork).await.unwrap();
    b.destroy(&sid).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconcile_cleans_up_after_a_node_process_that_died() {
    require_microvm!();
    let data = tempfile::tempdir().unwrap();
    let sid = id("crash");
    let (pid, ip, cgroups, host_if) = {
        let b = backend(data.path(), 4).await;
        let info = b.create(spec(&sid)).await.unwrap();
        let pid = b.vmm_pid(&sid).unwrap();
        let r = (
            pid,
            info.address.ip,
            b.cgroup_dirs(&sid),
            b.host_interface(&sid).unwrap(),
        );
        // The backend goes away without destroying: a crashed node.
        std::mem::forget(b);
        r
    };
    assert!(alive(pid));
    let b = backend(data.path(), 4).await;
    let report = b.reconcile(&[]).await.unwrap();
    assert_eq!(report.removed_sandboxes, vec![sid.clone()], "{report:?}");
    wait_gone(pid).await;
    for d in &cgroups {
        assert!(!d.exists(), "{} is left", d.display());
    }
    assert!(!b.address_reserved(ip));
    assert!(!b.host_interfaces().await.contains(&host_if));
    assert!(!b.sandbox_dir(&sid).exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vmm_that_cannot_start_leaves_nothing_and_says_why() {
    require_microvm!();
    let data = tempfile::tempdir().unwrap();
    let b = backend(data.path(), 5).await;
    let sid = id("bad");
    let mut s = spec(&sid);
    s.memory_mb = 8;
    let e = b.create(s).await.unwrap_err();
    assert!(e.to_string().contains("memoryMB"), "{e}");
    let mut s = spec(&sid);
    s.template = "missing".into();
    let e = b.create(s).await.unwrap_err();
    assert!(matches!(e, BackendError::UnknownTemplate(_)), "{e}");
    assert!(!b.sandbox_dir(&sid).exists());
    assert!(b.cgroup_dirs(&sid).iter().all(|d| !d.exists()));
}
