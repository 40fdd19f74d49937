//! The jail backend end to end: real namespaces, cgroups, veth pairs and overlay roots,
//! with a small PID 1 of the tests' own (tests/fixtures/test_agent.py).
//! Needs root; each test says so and returns when it cannot run here.

mod common;

use std::net::Ipv4Addr;
use std::os::unix::fs::MetadataExt;
use std::time::{Duration, Instant};

use agentenv_node::backend::agent::probe_health;
use agentenv_node::backend::jail::JailBackend;
use agentenv_node::backend::{BackendError, KeptState, SandboxBackend, SandboxState};
use agentenv_node::host::spawn::KEPT_CAPABILITIES;
use agentenv_testkit::{Wait, eventually_blocking};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn test_agent_answers_at_the_sandbox_address_and_runs_a_command() {
    require_jail!();
    let (b, _data) = common::backend().await;
    let mut spec = common::spec(&common::id("hello"));
    spec.env
        .insert("GREETING".into(), "hi from the host".into());
    let info = common::create_ready(&b, spec).await;
    assert_eq!(info.state, SandboxState::Running);
    let out = common::sh(
        &info,
        "echo \"$GREETING\"; cat /etc/debian_version; hostname; id -u",
    )
    .await;
    assert_eq!(out.exit, 0, "{out:?}");
    let lines: Vec<&str> = out.stdout.lines().collect();
    assert_eq!(lines[0], "hi from the host");
    assert!(lines[1].starts_with("12."), "bookworm: {lines:?}");
    assert_eq!(lines[2], info.id);
    assert_eq!(lines[3], "0");
    // PID 1 is the agent, in init mode.
    let out = common::sh(&info, "cat /proc/1/cmdline | tr '\\0' ' '").await;
    assert!(
        out.stdout.contains("/agentenv/agentenv-guest --init"),
        "{out:?}"
    );
    // Writes land in the sandbox's own layer, not in the template.
    let out = common::sh(&info, "echo changed > /etc/motd && cat /etc/motd").await;
    assert_eq!(out.stdout, "changed\n");
    assert_eq!(b.get(&info.id).await.unwrap(), info);
    assert_eq!(b.list().await, vec![info.clone()]);
    b.destroy(&info.id).await.unwrap();
    assert!(b.list().await.is_empty());
    let tpl = b.templates().get("base").unwrap();
    assert_ne!(
        std::fs::read_to_string(tpl.rootfs.join("etc/motd")).unwrap_or_default(),
        "changed\n"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_limit_kills_an_allocation_beyond_it() {
    require_jail!();
    let (b, _data) = common::backend().await;
    let mut spec = common::spec(&common::id("mem"));
    spec.memory_mb = 64;
    let info = common::create_ready(&b, spec).await;
    let usage = b.usage(&info.id).await.unwrap();
    assert_eq!(usage.memory_limit_bytes, 64 << 20);
    let alloc = |mib: u32| format!("b = b'x' * ({mib} << 20); print(len(b) >> 20)");
    let small = common::exec(&info, &["python3", "-c", &alloc(16)]).await;
    assert_eq!((small.exit, small.stdout.trim()), (0, "16"), "{small:?}");
    let big = common::exec(&info, &["python3", "-c", &alloc(256)]).await;
    assert_eq!(big.exit, -9, "killed by the OOM killer: {big:?}");
    // The sandbox survives its process being killed.
    assert_eq!(common::sh(&info, "echo alive").await.stdout, "alive\n");
    b.destroy(&info.id).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cpu_limit_holds_under_a_busy_loop() {
    require_jail!();
    let (b, _data) = common::backend().await;
    let mut spec = common::spec(&common::id("cpu"));
    spec.cpu_count = 1;
    let info = common::create_ready(&b, spec).await;
    let cpu_dir = b
        .cgroup_dirs(&info.id)
        .into_iter()
        .find(|d| d.join("cpu.cfs_quota_us").exists() || d.join("cpu.max").exists())
        .expect("a cpu cgroup");
    let quota = std::fs::read_to_string(cpu_dir.join("cpu.cfs_quota_us"))
        .or_else(|_| std::fs::read_to_string(cpu_dir.join("cpu.max")))
        .unwrap();
    assert!(
        quota.starts_with("100000"),
        "one CPU per 100 ms period: {quota}"
    );
    let before = b.usage(&info.id).await.unwrap().cpu_time;
    let start = Instant::now();
    // Two busy loops: without the limit they would use both of the host's CPUs.
    let out = common::sh(
        &info,
        "timeout 3 sh -c 'while :; do :; done' & timeout 3 sh -c 'while :; do :; done'; wait; echo done",
    )
    .await;
    let wall = start.elapsed();
    assert_eq!(out.stdout, "done\n", "{out:?}");
    let used = b.usage(&info.id).await.unwrap().cpu_time - before;
    let share = used.as_secs_f64() / wall.as_secs_f64();
    eprintln!("cpu share with cpuCount=1: {share:.2} ({used:?} in {wall:?})");
    assert!(share < 1.35, "the quota of 1 CPU held: {share:.2}");
    assert!(share > 0.3, "the loops ran: {share:.2}");
    b.destroy(&info.id).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sandbox_cannot_see_host_processes_mounts_networks_or_other_sandboxes() {
    require_jail!();
    let (b, data) = common::backend().await;
    let a = common::create_ready(&b, common::spec(&common::id("iso-a"))).await;
    let other = common::create_ready(&b, common::spec(&common::id("iso-b"))).await;
    common::spawn_bg(&other, "exec sleep 4242").await;

    // Processes: only the sandbox's own.
    let ps = common::exec(&a, &["ps", "-eo", "pid,args"]).await;
    let lines: Vec<&str> = ps.stdout.lines().skip(1).collect();
    assert!(
        lines.len() <= 4,
        "only the agent, the shell and ps: {lines:?}"
    );
    assert!(
        lines.iter().any(|l| l.trim().starts_with("1 ")),
        "{lines:?}"
    );
    assert!(
        !ps.stdout.contains("sleep 4242"),
        "the other sandbox is invisible: {ps:?}"
    );
    let me = std::env::current_exe().unwrap();
    let me = me.file_name().unwrap().to_string_lossy();
    assert!(
        !ps.stdout.contains(me.as_ref()),
        "host processes are invisible: {ps:?}"
    );

    // Mounts: only the sandbox's root and its pseudo file systems.
    let mounts = common::sh(&a, "cut -d' ' -f5 /proc/self/mountinfo").await;
    for m in mounts.stdout.lines() {
        let ok = m == "/"
            || ["/proc", "/sys", "/dev", "/agentenv/"]
                .iter()
                .any(|p| m.starts_with(p));
        assert!(ok, "unexpected mount {m} in\n{}", mounts.stdout);
    }
    let data_dir = data.path().display().to_string();
    let ls = common::sh(&a, &format!("ls {data_dir} /work 2>&1; echo end")).await;
    assert!(
        ls.stdout.contains("No such file"),
        "host paths are absent: {ls:?}"
    );

    // Network: lo and eth0 only, with the sandbox's address. They are in the sandbox's
    // own namespace, so nothing the tenant does to them reaches the host's NAT rules:
    // those follow the addresses of the host's namespace only (`host::net::nat`), and
    // egress_nat.rs checks that no sandbox interface or address becomes an uplink.
    let links = common::sh(&a, "ip -o link | cut -d: -f2 | tr -d ' ' | cut -d@ -f1").await;
    assert_eq!(links.stdout.lines().collect::<Vec<_>>(), vec!["lo", "eth0"]);
    let addrs = common::sh(&a, "ip -o -4 addr | awk '{print $4}'").await;
    assert_eq!(
        addrs.stdout.lines().collect::<Vec<_>>(),
        vec!["127.0.0.1/8".to_string(), format!("{}/30", a.address.ip)]
    );

    // Host listeners are unreachable: through the gateway and through the host's addresses.
    let listener = std::net::TcpListener::bind("0.0.0.0:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let gateway = Ipv4Addr::from(u32::from(a.address.ip) - 1);
    let r = common::try_connect(&a, gateway, port).await;
    assert!(common::is_blocked(&r), "gateway {gateway}:{port}: {r}");
    for ip in host_global_addresses() {
        let r = common::try_connect(&a, ip, port).await;
        assert!(common::is_blocked(&r), "host address {ip}:{port}: {r}");
    }
    // The other sandbox is unreachable.
    let r = common::try_connect(&a, other.address.ip, 49983).await;
    assert!(common::is_blocked(&r), "other sandbox: {r}");
    // ... while the node reaches both.
    probe_health(a.address.agent()).await.unwrap();
    probe_health(other.address.agent()).await.unwrap();
    drop(listener);
    b.destroy(&a.id).await.unwrap();
    b.destroy(&other.id).await.unwrap();
}

/// The host's own global IPv4 addresses, sandbox gateways excluded.
fn host_global_addresses() -> Vec<Ipv4Addr> {
    common::host_addresses()
        .lines()
        .filter(|l| l.contains("scope global"))
        .filter_map(|l| l.split_whitespace().nth(3))
        .filter_map(|a| a.split('/').next()?.parse::<Ipv4Addr>().ok())
        .filter(|ip| {
            !"10.12.0.0/16"
                .parse::<agentenv_node::host::net::Ipv4Net>()
                .unwrap()
                .contains(*ip)
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seccomp_capabilities_and_no_new_privs_restrict_the_sandbox() {
    require_jail!();
    let (b, _data) = common::backend().await;
    let info = common::create_ready(&b, common::spec(&common::id("sec"))).await;
    // keyctl works for any process without the filter; here it fails with EPERM.
    let code = format!(
        "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nr = libc.syscall({}, 0, -3, 0)\nprint(r, ctypes.get_errno())\nr = libc.syscall({}, 0, 0, 0)\nprint(r, ctypes.get_errno())\n",
        libc::SYS_keyctl,
        libc::SYS_ptrace,
    );
    let out = common::exec(&info, &["python3", "-c", &code]).await;
    let eperm = format!("-1 {}", libc::EPERM);
    assert_eq!(
        out.stdout.lines().collect::<Vec<_>>(),
        vec![eperm.as_str(), eperm.as_str()],
        "{out:?}"
    );
    let status = common::sh(
        &info,
        "grep -E '^(Seccomp|NoNewPrivs|CapBnd|CapEff):' /proc/self/status",
    )
    .await;
    let field = |name: &str| {
        status
            .stdout
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{name}:")))
            .map(|v| v.trim().to_string())
            .unwrap_or_default()
    };
    assert_eq!(field("Seccomp"), "2", "{status:?}");
    assert_eq!(field("NoNewPrivs"), "1");
    let want: u64 = KEPT_CAPABILITIES
        .iter()
        .map(|c| c.bitmask())
        .fold(0, |a, b| a | b);
    assert_eq!(u64::from_str_radix(&field("CapBnd"), 16).unwrap(), want);
    assert_eq!(u64::from_str_radix(&field("CapEff"), 16).unwrap(), want);
    // Mounting, loading modules and writing kernel settings all fail.
    let out = common::sh(
        &info,
        "mount -t tmpfs none /mnt 2>&1; echo mount=$?; echo 1 > /proc/sys/vm/drop_caches 2>&1; echo sysctl=$?; echo b > /proc/sysrq-trigger 2>&1; echo sysrq=$?",
    )
    .await;
    assert!(
        out.stdout.contains("mount=32") || out.stdout.contains("mount=1"),
        "{out:?}"
    );
    assert!(!out.stdout.contains("sysctl=0"), "{out:?}");
    assert!(!out.stdout.contains("sysrq=0"), "{out:?}");
    b.destroy(&info.id).await.unwrap();
}

/// Reads the counter the sandbox writes to /tmp/counter, through its writable layer.
fn read_counter(b: &agentenv_node::backend::jail::JailBackend, id: &str) -> Option<u64> {
    std::fs::read_to_string(b.layer_mount(id).join("upper/tmp/counter"))
        .ok()?
        .trim()
        .parse()
        .ok()
}

async fn counter_above(b: &agentenv_node::backend::jail::JailBackend, id: &str, above: u64) -> u64 {
    Wait::new(
        format_args!("the counter to pass {above}"),
        Duration::from_secs(10),
    )
    .every(Duration::from_millis(5))
    .until(|| std::future::ready(read_counter(b, id).filter(|v| *v > above)))
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pause_stops_a_counter_and_resume_continues_it() {
    require_jail!();
    let (b, _data) = common::backend().await;
    let info = common::create_ready(&b, common::spec(&common::id("pause"))).await;
    common::spawn_bg(&info, "i=0; while :; do i=$((i+1)); echo $i > /tmp/counter.new; mv /tmp/counter.new /tmp/counter; sleep 0.01; done").await;
    let running = counter_above(&b, &info.id, 3).await;
    b.pause(&info.id).await.unwrap();
    assert_eq!(b.get(&info.id).await.unwrap().state, SandboxState::Paused);
    b.pause(&info.id).await.unwrap(); // pausing a paused sandbox succeeds
    let frozen = read_counter(&b, &info.id).unwrap();
    assert!(frozen >= running);
    // Observe the paused sandbox over an interval in which the counter would advance ~30 times.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        read_counter(&b, &info.id).unwrap(),
        frozen,
        "the counter stopped while paused"
    );
    let probe = tokio::time::timeout(
        Duration::from_millis(300),
        probe_health(info.address.agent()),
    )
    .await;
    assert!(
        !matches!(probe, Ok(Ok(()))),
        "the agent does not answer while paused"
    );
    let resumed = b.resume(&info.id).await.unwrap();
    assert_eq!(resumed.state, SandboxState::Running);
    assert_eq!(resumed.address, info.address);
    counter_above(&b, &info.id, frozen).await;
    // The processes kept their state: the counter continues from where it stopped.
    let after = read_counter(&b, &info.id).unwrap();
    assert!(
        after > frozen && after < frozen + 1000,
        "{frozen} -> {after}"
    );
    probe_health(info.address.agent()).await.unwrap();
    b.destroy(&info.id).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn destroy_leaves_nothing_behind() {
    require_jail!();
    let (b, _data) = common::backend().await;
    let links_before = b.host_interfaces().await;
    let pooled_before = b.pooled_interfaces();
    let info = common::create_ready(&b, common::spec(&common::id("destroy"))).await;
    common::spawn_bg(&info, "exec sleep 1000").await;
    let t = common::traces(&b, &info);
    let ns_now = common::host_namespaces();
    for n in &t.namespaces {
        let host = std::fs::metadata(format!("/proc/self/ns/{}", n.0))
            .unwrap()
            .ino();
        assert!(
            n.1 != host && ns_now.contains(n),
            "{n:?} is the sandbox's own, not the host's"
        );
    }
    assert!(b.host_interfaces().await.contains(&t.host_if));
    // The link was made for the sandbox, or ahead of time in the namespace pool.
    assert!(!links_before.contains(&t.host_if) || pooled_before.contains(&t.host_if));
    assert!(common::host_addresses().contains(&format!("inet {}/30", t.gateway)));
    assert!(b.address_reserved(t.ip));
    b.destroy(&info.id).await.unwrap();
    common::assert_gone(&b, &t);
    assert!(matches!(
        b.destroy(&info.id).await,
        Err(agentenv_node::backend::BackendError::NotFound(_))
    ));
    // What is left are the pooled namespaces; after shutdown, nothing at all.
    let pool = PoolTraces::of(&b);
    b.shutdown().await;
    pool.assert_gone(&b);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn destroying_a_paused_sandbox_leaves_nothing_behind() {
    require_jail!();
    let (b, _data) = common::backend().await;
    let info = common::create_ready(&b, common::spec(&common::id("pdestroy"))).await;
    let t = common::traces(&b, &info);
    b.pause(&info.id).await.unwrap();
    b.destroy(&info.id).await.unwrap();
    common::assert_gone(&b, &t);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_concurrent_sandboxes_leave_nothing_behind() {
    require_jail!();
    let (b, _data) = common::backend().await;
    let b = std::sync::Arc::new(b);
    let ids: Vec<String> = (0..20).map(|i| common::id(&format!("many{i}"))).collect();
    let created = futures::future::join_all(ids.iter().map(|id| {
        let b = b.clone();
        let mut spec = common::spec(id);
        spec.memory_mb = 64;
        async move { common::create_ready(&b, spec).await }
    }))
    .await;
    let addrs: std::collections::HashSet<_> = created.iter().map(|i| i.address.ip).collect();
    assert_eq!(addrs.len(), 20, "distinct addresses");
    let traces: Vec<_> = created.iter().map(|i| common::traces(&b, i)).collect();
    for info in &created {
        assert_eq!(common::sh(info, "hostname").await.stdout.trim(), info.id);
    }
    let results = futures::future::join_all(ids.iter().map(|id| {
        let b = b.clone();
        async move { b.destroy(id).await }
    }))
    .await;
    for r in results {
        r.unwrap();
    }
    for t in &traces {
        common::assert_gone(&b, t);
    }
    assert!(b.list().await.is_empty());
    let pool = PoolTraces::of(&b);
    b.shutdown().await;
    pool.assert_gone(&b);
}

/// A network namespace standing in for the internet: 198.51.100.1 (TEST-NET-2) with a
/// TCP server that answers with the peer address it sees, routed from the host. The
/// addresses are fixed, so one fake internet exists at a time on the host: tests in other
/// processes wait for it (an exclusive lock on a file held as long as the value lives).
struct FakeInternet {
    ns: String,
    host_if: String,
    server: std::process::Child,
    _exclusive: std::fs::File,
}

const INTERNET_IP: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 1);
const INTERNET_HOST_SIDE: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 2);
const INTERNET_PORT: u16 = 8080;

impl FakeInternet {
    fn start() -> Self {
        let lock =
            std::fs::File::create(std::env::temp_dir().join("agentenv-test-inet.lock")).unwrap();
        // SAFETY: flock on a file descriptor this function owns.
        let rc = unsafe { libc::flock(std::os::fd::AsRawFd::as_raw_fd(&lock), libc::LOCK_EX) };
        assert_eq!(rc, 0, "flock: {}", std::io::Error::last_os_error());
        let ns = format!("agentenv-test-inet-{}", std::process::id());
        let host_if = format!("tinet{}", std::process::id() % 1_000_000);
        let run = |args: &[&str]| {
            let out = std::process::Command::new("ip")
                .args(args)
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "ip {args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        };
        run(&["netns", "add", &ns]);
        run(&[
            "link", "add", &host_if, "type", "veth", "peer", "name", "eth0", "netns", &ns,
        ]);
        run(&[
            "addr",
            "add",
            &format!("{INTERNET_HOST_SIDE}/24"),
            "dev",
            &host_if,
        ]);
        run(&["link", "set", &host_if, "up"]);
        run(&[
            "-n",
            &ns,
            "addr",
            "add",
            &format!("{INTERNET_IP}/24"),
            "dev",
            "eth0",
        ]);
        run(&["-n", &ns, "link", "set", "eth0", "up"]);
        run(&["-n", &ns, "link", "set", "lo", "up"]);
        let code = format!(
            "import socket\ns=socket.socket()\ns.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\ns.bind(('{INTERNET_IP}', {INTERNET_PORT}))\ns.listen(16)\nwhile True:\n    c, a = s.accept()\n    c.sendall(a[0].encode())\n    c.close()\n"
        );
        let server = std::process::Command::new("ip")
            .args(["netns", "exec", &ns, "python3", "-c", &code])
            .spawn()
            .unwrap();
        let me = Self {
            ns,
            host_if,
            server,
            _exclusive: lock,
        };
        eventually_blocking(
            "the fake internet server to start",
            Duration::from_secs(10),
            || {
                std::net::TcpStream::connect_timeout(
                    &(INTERNET_IP, INTERNET_PORT).into(),
                    Duration::from_millis(200),
                )
            },
        );
        me
    }
}

impl Drop for FakeInternet {
    fn drop(&mut self) {
        let _ = self.server.kill();
        let _ = self.server.wait();
        // The link first, at once: a namespace goes a while after its name, with the
        // veth in it, and the next fake internet of this process takes the same names.
        let _ = std::process::Command::new("ip")
            .args(["link", "del", &self.host_if])
            .status();
        let _ = std::process::Command::new("ip")
            .args(["netns", "del", &self.ns])
            .status();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn egress_goes_through_nat_only_when_internet_access_is_allowed() {
    require_jail!();
    let (b, _data) = common::backend().await;
    let internet = FakeInternet::start();
    let open = common::create_ready(&b, common::spec(&common::id("egress-on"))).await;
    let mut closed_spec = common::spec(&common::id("egress-off"));
    closed_spec.allow_internet_access = false;
    let closed = common::create_ready(&b, closed_spec).await;
    assert_internet_access(&open, &closed).await;
    // The node still reaches the closed sandbox.
    probe_health(closed.address.agent()).await.unwrap();
    b.destroy(&open.id).await.unwrap();
    b.destroy(&closed.id).await.unwrap();
    drop(internet);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconcile_cleans_up_after_a_crashed_node_process() {
    require_jail!();
    let data = tempfile::tempdir().unwrap();
    let mut cfg = common::config(data.path());
    // A crashed process's layer pool would stay locked by this (living) test process.
    cfg.layer_pool_size = 0;
    let (crashed, _unused) = common::backend_with(|c| *c = cfg.clone()).await;
    let info = common::create_ready(&crashed, common::spec(&common::id("crash"))).await;
    common::spawn_bg(&info, "exec sleep 1000").await;
    let t = common::traces(&crashed, &info);
    // The node process "crashes": its in-memory state is lost, the sandbox runs on.
    std::mem::forget(crashed);
    let restarted = agentenv_node::backend::jail::JailBackend::new(cfg)
        .await
        .unwrap();
    let report = restarted.reconcile(&[]).await.unwrap();
    assert_eq!(report.removed_sandboxes, vec![info.id.clone()]);
    Wait::new(
        "PID 1 of the leftover sandbox to be reaped",
        Duration::from_secs(5),
    )
    .every(Duration::from_millis(5))
    .until(|| std::future::ready(!std::path::Path::new(&format!("/proc/{}", t.pid)).exists()))
    .await;
    common::assert_gone(&restarted, &t);
    // A second pass finds nothing.
    let again = restarted.reconcile(&[]).await.unwrap();
    assert!(again.removed_sandboxes.is_empty(), "{again:?}");
}

/// Asserts that `open` reaches the fake internet (NAT'd to the host's address) and
/// `closed` does not.
async fn assert_internet_access(
    open: &agentenv_node::backend::SandboxInfo,
    closed: &agentenv_node::backend::SandboxInfo,
) {
    let r = common::try_connect(open, INTERNET_IP, INTERNET_PORT).await;
    assert_eq!(
        r,
        format!("connected {INTERNET_HOST_SIDE}"),
        "NAT'd to the host's address"
    );
    let r = common::try_connect(closed, INTERNET_IP, INTERNET_PORT).await;
    assert!(common::is_blocked(&r), "no internet access: {r}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kept_layer_is_reused_and_reconcile_removes_unreferenced_ones() {
    require_jail!();
    let data = tempfile::tempdir().unwrap();
    let cfg = common::config(data.path());
    let (b, _unused) = common::backend_with(|c| *c = cfg.clone()).await;
    let first = common::create_ready(&b, common::spec(&common::id("keep"))).await;
    let out = common::sh(&first, "echo mine > /root/file && rm /etc/issue && sync").await;
    assert_eq!(out.exit, 0, "{out:?}");
    // Only a paused sandbox is kept.
    let refused = b.keep(&first.id).await.unwrap_err();
    assert!(
        matches!(refused, BackendError::InvalidState { .. }),
        "{refused}"
    );
    let t = common::traces(&b, &first);
    b.pause(&first.id).await.unwrap();
    let kept = b.keep(&first.id).await.unwrap();
    assert_eq!(kept.path.parent(), Some(b.kept_dir()));
    assert!(kept.path.join("disk/layer.img").is_file());
    // Everything but the layer is released.
    common::assert_gone(&b, &t);
    assert!(matches!(
        b.get(&first.id).await,
        Err(BackendError::NotFound(_))
    ));

    // A create from the kept layer has the sandbox's files, at a new address.
    let mut spec = common::spec(&first.id);
    spec.kept = Some(kept.clone());
    let again = common::create_ready(&b, spec).await;
    let out = common::sh(
        &again,
        "cat /root/file; test -e /etc/issue && echo issue-back || echo issue-gone; cat /etc/hostname",
    )
    .await;
    assert_eq!(
        out.stdout,
        format!("mine\nissue-gone\n{}\n", first.id),
        "{out:?}"
    );
    assert!(!kept.path.exists(), "the sandbox took the layer over");
    let t = common::traces(&b, &again);
    b.pause(&again.id).await.unwrap();
    let referenced = b.keep(&again.id).await.unwrap();
    common::assert_gone(&b, &t);
    let other = common::create_ready(&b, common::spec(&common::id("stray"))).await;
    let t_other = common::traces(&b, &other);
    b.pause(&other.id).await.unwrap();
    let stray = b.keep(&other.id).await.unwrap();
    common::assert_gone(&b, &t_other);

    // A kept path outside the backend's kept directory is refused.
    let mut bad = common::spec(&common::id("bad"));
    bad.kept = Some(KeptState {
        path: data.path().to_path_buf(),
    });
    let e = b.create(bad).await.unwrap_err();
    assert!(matches!(e, BackendError::BadKeptState { .. }), "{e}");

    // After a restart, reconciliation keeps the referenced layer and removes the other.
    drop(b);
    let restarted = agentenv_node::backend::jail::JailBackend::new(cfg)
        .await
        .unwrap();
    let report = restarted
        .reconcile(std::slice::from_ref(&referenced))
        .await
        .unwrap();
    assert!(report.removed_sandboxes.is_empty(), "{report:?}");
    assert!(
        report
            .removed_other
            .contains(&format!("kept state {}", stray.path.display())),
        "{report:?}"
    );
    assert!(!stray.path.exists());
    assert!(referenced.path.join("disk/layer.img").is_file());
    // Discarding the last one leaves the kept directory empty.
    restarted.discard_kept(&referenced).await.unwrap();
    assert!(!referenced.path.exists());
    let left: Vec<_> = std::fs::read_dir(restarted.kept_dir()).unwrap().collect();
    assert!(left.is_empty(), "{left:?}");
    let again = restarted.reconcile(&[]).await.unwrap();
    assert!(
        again.removed_sandboxes.is_empty()
            && !again
                .removed_other
                .iter()
                .any(|r| r.starts_with("kept state")),
        "{again:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconcile_kills_and_removes_a_cgroup_without_an_address() {
    require_jail!();
    let (b, _data) = common::backend().await;
    let live = common::create_ready(&b, common::spec(&common::id("live"))).await;
    // A cgroup as a crash between its creation and its sandbox's record would leave it,
    // with a process inside.
    let orphan = common::id("orphan");
    let dirs = b.cgroup_dirs(&orphan);
    for d in &dirs {
        std::fs::create_dir(d).unwrap();
    }
    let mut stray = std::process::Command::new("sleep")
        .arg("1000")
        .spawn()
        .unwrap();
    for d in &dirs {
        std::fs::write(d.join("cgroup.procs"), stray.id().to_string()).unwrap();
    }
    let report = b.reconcile(&[]).await.unwrap();
    assert!(
        report.removed_other.contains(&format!("cgroup {orphan}")),
        "{report:?}"
    );
    for d in &dirs {
        assert!(!d.exists(), "{} removed", d.display());
    }
    let status = stray.wait().unwrap();
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(libc::SIGKILL)
    );
    // The live sandbox is untouched.
    assert!(report.removed_sandboxes.is_empty(), "{report:?}");
    assert_eq!(common::sh(&live, "echo ok").await.stdout, "ok\n");
    b.destroy(&live.id).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn process_limit_stops_a_fork_loop() {
    require_jail!();
    let (b, _data) = common::backend().await;
    let mut spec = common::spec(&common::id("pids"));
    spec.max_processes = Some(24);
    let info = common::create_ready(&b, spec).await;
    let code = "import os, time\nn = 0\nfor i in range(100):\n    try:\n        pid = os.fork()\n    except OSError as e:\n        print('refused', e.errno)\n        break\n    if pid == 0:\n        os.closerange(0, 3)\n        time.sleep(30)\n        os._exit(0)\n    n += 1\nprint('forked', n)\n";
    let out = common::exec(&info, &["python3", "-c", code]).await;
    let lines: Vec<&str> = out.stdout.lines().collect();
    assert_eq!(
        lines.first().copied(),
        Some(format!("refused {}", libc::EAGAIN).as_str()),
        "{out:?}"
    );
    let forked: u32 = lines[1].strip_prefix("forked ").unwrap().parse().unwrap();
    assert!(forked < 24, "{forked} forks under a limit of 24");
    let usage = b.usage(&info.id).await.unwrap();
    assert!(usage.processes <= 24, "{usage:?}");
    b.destroy(&info.id).await.unwrap();
}

/// What the namespace pool of a backend holds: links, addresses, its directory.
///
/// Tests in parallel reuse a released address (and so its link name) at once: a link is
/// known by its index, a reservation by its owner.
struct PoolTraces {
    /// Name and index of each pooled link.
    links: Vec<(String, u32)>,
    addresses: Vec<Ipv4Addr>,
    dirs: Vec<std::path::PathBuf>,
}

/// The index of a host link, if it exists.
fn link_index(name: &str) -> Option<u32> {
    std::fs::read_to_string(format!("/sys/class/net/{name}/ifindex"))
        .ok()?
        .trim()
        .parse()
        .ok()
}

impl PoolTraces {
    fn of(b: &JailBackend) -> Self {
        let names = b.pooled_interfaces();
        let addresses = names
            .iter()
            .map(|l| {
                let slot = agentenv_node::host::net::slot_of_ifname(&common::iface_prefix(), l)
                    .expect("a pooled interface name");
                slot.sandbox_ip()
            })
            .collect();
        let links = names
            .into_iter()
            .map(|l| {
                let idx = link_index(&l).expect("a pooled link exists");
                (l, idx)
            })
            .collect();
        let dirs = std::fs::read_dir(b.net_pool_dir())
            .map(|d| d.flatten().map(|e| e.path()).collect())
            .unwrap_or_default();
        Self {
            links,
            addresses,
            dirs,
        }
    }

    fn names(&self) -> Vec<&str> {
        self.links.iter().map(|(n, _)| n.as_str()).collect()
    }

    fn owned_by_pool(&self, b: &JailBackend, ip: Ipv4Addr) -> bool {
        b.address_owner(ip).is_some_and(|o| self.dirs.contains(&o))
    }

    /// Asserts that all of it is there: links, reservations, the directory.
    fn assert_present(&self, b: &JailBackend) {
        for (l, idx) in &self.links {
            assert_eq!(link_index(l), Some(*idx), "pooled link {l} missing");
        }
        for ip in &self.addresses {
            assert!(
                self.owned_by_pool(b, *ip),
                "pooled address {ip} not reserved"
            );
        }
        for d in &self.dirs {
            assert!(d.is_dir(), "pool directory {} missing", d.display());
        }
    }

    /// Asserts that none of it is left and the backend's pool is empty.
    fn assert_gone(&self, b: &JailBackend) {
        self.assert_released(b);
        assert!(b.pooled_interfaces().is_empty());
        assert_eq!(b.net_pool_stats().ready, 0);
    }

    /// Asserts that none of it is left.
    fn assert_released(&self, b: &JailBackend) {
        for (l, idx) in &self.links {
            assert_ne!(link_index(l), Some(*idx), "pooled link {l} left behind");
        }
        for ip in &self.addresses {
            assert!(
                !self.owned_by_pool(b, *ip),
                "pooled address {ip} still reserved"
            );
        }
        for d in &self.dirs {
            assert!(!d.exists(), "pool directory {} left behind", d.display());
        }
    }
}

/// Waits until the backend's namespace pool has `n` namespaces ready.
async fn pool_ready(b: &JailBackend, n: usize) {
    Wait::new(
        format_args!("the namespace pool to fill to {n}"),
        Duration::from_secs(20),
    )
    .every(Duration::from_millis(5))
    .until(|| {
        let st = b.net_pool_stats();
        std::future::ready(if st.ready >= n {
            Ok(())
        } else {
            Err(format!("{st:?}"))
        })
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn creates_take_pooled_namespaces_and_the_pool_refills_after_each_take() {
    require_jail!();
    let (b, _data) = common::backend_with(|c| c.net_pool_size = 2).await;
    pool_ready(&b, 2).await;
    let before = b.net_pool_stats();
    assert_eq!((before.size, before.taken, before.built_inline), (2, 0, 0));
    let pooled = b.pooled_interfaces();
    assert_eq!(pooled.len(), 2);
    let links_before = b.host_interfaces().await;
    for l in &pooled {
        assert!(
            links_before.contains(l),
            "pooled link {l} exists on the host"
        );
    }

    // Two creates take both pooled namespaces: their links are the pooled ones.
    let one = common::create_ready(&b, common::spec(&common::id("pool-a"))).await;
    let two = common::create_ready(&b, common::spec(&common::id("pool-b"))).await;
    let st = b.net_pool_stats();
    assert_eq!((st.taken, st.built_inline), (2, 0), "{st:?}");
    let mut used = vec![
        b.host_interface(&one.id).unwrap(),
        b.host_interface(&two.id).unwrap(),
    ];
    used.sort();
    let mut pooled_sorted = pooled.clone();
    pooled_sorted.sort();
    assert_eq!(
        used, pooled_sorted,
        "the sandboxes run on the pooled namespaces"
    );
    for info in [&one, &two] {
        assert_eq!(common::sh(info, "hostname").await.stdout.trim(), info.id);
    }

    // The pool refills in the background with new namespaces.
    pool_ready(&b, 2).await;
    let refilled = b.pooled_interfaces();
    assert!(
        refilled.iter().all(|l| !pooled.contains(l)),
        "{refilled:?} vs {pooled:?}"
    );
    assert!(b.net_pool_stats().built >= 4);

    // With the pool off, creates make their own namespace.
    let (off, _data_off) = common::backend_with(|c| c.net_pool_size = 0).await;
    let three = common::create_ready(&off, common::spec(&common::id("pool-off"))).await;
    let st = off.net_pool_stats();
    assert_eq!((st.size, st.taken, st.built_inline, st.built), (0, 0, 1, 0));
    off.destroy(&three.id).await.unwrap();

    let traces = [common::traces(&b, &one), common::traces(&b, &two)];
    b.destroy(&one.id).await.unwrap();
    b.destroy(&two.id).await.unwrap();
    for t in &traces {
        common::assert_gone(&b, t);
    }
    let pool = PoolTraces::of(&b);
    assert_eq!(pool.links.len(), 2);
    b.shutdown().await;
    pool.assert_gone(&b);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn egress_policy_is_applied_to_pooled_namespaces() {
    require_jail!();
    let (b, _data) = common::backend_with(|c| c.net_pool_size = 2).await;
    let internet = FakeInternet::start();
    pool_ready(&b, 2).await;
    let open = common::create_ready(&b, common::spec(&common::id("pegress-on"))).await;
    let mut closed_spec = common::spec(&common::id("pegress-off"));
    closed_spec.allow_internet_access = false;
    let closed = common::create_ready(&b, closed_spec).await;
    let st = b.net_pool_stats();
    assert_eq!(
        (st.taken, st.built_inline),
        (2, 0),
        "both took a pooled namespace: {st:?}"
    );
    // The host interface says the policy.
    let p = common::iface_prefix();
    assert!(
        b.host_interface(&open.id)
            .unwrap()
            .starts_with(&format!("{p}i"))
    );
    assert!(
        b.host_interface(&closed.id)
            .unwrap()
            .starts_with(&format!("{p}n"))
    );
    assert_internet_access(&open, &closed).await;
    // The node reaches both, and the renamed one still has its address and route.
    probe_health(open.address.agent()).await.unwrap();
    probe_health(closed.address.agent()).await.unwrap();
    let route = common::sh(&closed, "ip -4 route show default").await;
    assert!(
        route.stdout.contains(&format!(
            "via {}",
            Ipv4Addr::from(u32::from(closed.address.ip) - 1)
        )),
        "{route:?}"
    );
    let t = common::traces(&b, &closed);
    b.destroy(&open.id).await.unwrap();
    b.destroy(&closed.id).await.unwrap();
    common::assert_gone(&b, &t);
    let pool = PoolTraces::of(&b);
    b.shutdown().await;
    pool.assert_gone(&b);
    drop(internet);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconcile_releases_the_namespace_pool_of_a_crashed_node_process() {
    require_jail!();
    let data = tempfile::tempdir().unwrap();
    let mut cfg = common::config(data.path());
    cfg.net_pool_size = 2;
    // A crashed process's layer pool would stay locked by this (living) test process.
    cfg.layer_pool_size = 0;
    let (crashed, _unused) = common::backend_with(|c| *c = cfg.clone()).await;
    pool_ready(&crashed, 2).await;
    let left = PoolTraces::of(&crashed);
    assert_eq!(left.links.len(), 2);
    assert_eq!(left.dirs.len(), 1);
    // The node process "crashes": its pool's links and reservations stay.
    std::mem::forget(crashed);
    let restarted = JailBackend::new(cfg).await.unwrap();
    pool_ready(&restarted, 2).await;
    let report = restarted.reconcile(&[]).await.unwrap();
    assert!(report.removed_sandboxes.is_empty(), "{report:?}");
    for l in left.names() {
        assert!(
            report.removed_other.contains(&format!("link {l}")),
            "{l} in {report:?}"
        );
    }
    for ip in &left.addresses {
        assert!(
            report.removed_other.contains(&format!("address {ip}")),
            "{ip} in {report:?}"
        );
    }
    left.assert_released(&restarted);
    // The restarted backend's own pool is untouched, and serves a create.
    let own = PoolTraces::of(&restarted);
    assert_eq!((own.links.len(), own.dirs.len()), (2, 1));
    own.assert_present(&restarted);
    let info = common::create_ready(&restarted, common::spec(&common::id("after"))).await;
    assert_eq!(restarted.net_pool_stats().taken, 1);
    restarted.destroy(&info.id).await.unwrap();
    // A second pass finds nothing of either pool (other tests' leftovers may show).
    let own = PoolTraces::of(&restarted);
    let again = restarted.reconcile(&[]).await.unwrap();
    assert!(again.removed_sandboxes.is_empty(), "{again:?}");
    assert!(
        !again
            .removed_other
            .iter()
            .any(|r| r.starts_with("namespace pool")
                || own.names().iter().any(|l| r == &format!("link {l}"))),
        "{again:?}"
    );
    own.assert_present(&restarted);
    restarted.shutdown().await;
    own.assert_gone(&restarted);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_backend_releases_its_namespace_pool() {
    require_jail!();
    let (b, data) = common::backend_with(|c| c.net_pool_size = 3).await;
    pool_ready(&b, 3).await;
    let pool = PoolTraces::of(&b);
    drop(b);
    // A fresh backend on the same data directory (its pool off) sees nothing left.
    let (check, _unused) = common::backend_with(|c| {
        *c = common::config(data.path());
        c.net_pool_size = 0;
    })
    .await;
    pool.assert_released(&check);
    let report = check.reconcile(&[]).await.unwrap();
    assert!(
        !report
            .removed_other
            .iter()
            .any(|r| r.starts_with("namespace pool")),
        "{report:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn root_inside_is_an_unprivileged_host_uid_that_owns_what_it_writes() {
    require_jail!();
    let (b, _data) = common::backend().await;
    let info = common::create_ready(&b, common::spec(&common::id("ids"))).await;
    let base = b.id_base(&info.id).unwrap();
    assert!(base >= 65536, "root inside is not a host system id: {base}");
    // On the host, PID 1 runs as the range's base id.
    let pid = b.pid(&info.id).unwrap();
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let uids = status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .unwrap()
        .split_whitespace()
        .map(|u| u.parse::<u32>().unwrap())
        .collect::<Vec<_>>();
    assert_eq!(uids, vec![base; 4], "{status}");
    // Inside it is root, the template (owned by host root on disk) is root's, and the
    // map is the range.
    let out = common::sh(
        &info,
        "id -u; stat -c %u:%g /etc/passwd /usr/bin; cat /proc/self/uid_map; echo mine > /root/mine; stat -c %u /root/mine; umask",
    )
    .await;
    assert_eq!(out.exit, 0, "{out:?}");
    let lines: Vec<&str> = out.stdout.lines().collect();
    assert_eq!(lines[0], "0", "{out:?}");
    assert_eq!(lines[1], "0:0");
    assert_eq!(lines[2], "0:0");
    assert_eq!(
        lines[3].split_whitespace().collect::<Vec<_>>(),
        vec!["0", &base.to_string(), "65536"]
    );
    assert_eq!(lines[4], "0");
    assert_eq!(lines[5], "0022", "the agent's children get umask 022");
    // On the host the file belongs to the range, the template stays host root's.
    let mine = std::fs::metadata(b.layer_mount(&info.id).join("upper/root/mine")).unwrap();
    assert_eq!((mine.uid(), mine.gid()), (base, base));
    let template = b
        .templates()
        .ensure(agentenv_node::template::BASE_TEMPLATE, common::progress())
        .await
        .unwrap();
    let passwd = std::fs::metadata(template.rootfs.join("etc/passwd")).unwrap();
    assert_eq!((passwd.uid(), passwd.gid()), (0, 0));
    // Any id inside is the range's id on the host; one outside the range cannot be
    // given (it has no mapping).
    let out = common::sh(
        &info,
        "touch /tmp/probe-file /tmp/far && chown 1234:1234 /tmp/probe-file && stat -c %u /tmp/probe-file; chown 70000 /tmp/far 2>/dev/null && echo far-owned; true",
    )
    .await;
    assert_eq!(out.exit, 0, "{out:?}");
    assert!(!out.stdout.contains("far-owned"), "{out:?}");
    let inside: u32 = out.stdout.trim().parse().unwrap();
    assert_eq!(inside, 1234);
    let probe = std::fs::metadata(b.layer_mount(&info.id).join("upper/tmp/probe-file")).unwrap();
    assert_eq!(probe.uid(), base + inside);
    b.destroy(&info.id).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exhausted_id_pool_refuses_a_create_and_leaves_nothing_of_it() {
    require_jail!();
    // A pool of one range of this test process's own (reservations are host-wide).
    let first = 3_000_000_000u32 + (std::process::id() % 10_000) * 65536;
    let (b, _data) = common::backend_with(|c| {
        c.id_pool = format!("{first}:65536").parse().unwrap();
    })
    .await;
    let one = common::create_ready(&b, common::spec(&common::id("one"))).await;
    assert_eq!(b.id_base(&one.id), Some(first));
    let links = b.host_interfaces().await;
    let second = common::id("two");
    let e = b.create(common::spec(&second)).await.unwrap_err();
    assert!(matches!(e, BackendError::IdPoolExhausted { .. }), "{e:?}");
    assert!(e.to_string().contains("AENV_JAIL_ID_POOL"), "{e}");
    // Nothing of the refused create: no directory, cgroup, link or address.
    assert!(!b.sandbox_dir(&second).exists());
    assert!(b.cgroup_dirs(&second).iter().all(|d| !d.exists()));
    assert_eq!(b.host_interfaces().await.len(), links.len());
    assert!(matches!(
        b.get(&second).await,
        Err(BackendError::NotFound(_))
    ));
    // The range comes back with the sandbox that held it.
    b.destroy(&one.id).await.unwrap();
    let two = common::create_ready(&b, common::spec(&second)).await;
    assert_eq!(b.id_base(&two.id), Some(first));
    b.destroy(&two.id).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_writable_layer_is_capped_at_the_disk_size_with_enospc_inside() {
    require_jail!();
    let (b, _data) = common::backend().await;
    let mut spec = common::spec(&common::id("disk"));
    spec.disk_size_mb = Some(64);
    let info = common::create_ready(&b, spec).await;
    let out = common::sh(
        &info,
        "dd if=/dev/zero of=/root/fill bs=1M count=200 2>&1; echo status=$?; df -m / | tail -1",
    )
    .await;
    assert!(out.stdout.contains("No space left on device"), "{out:?}");
    assert!(!out.stdout.contains("status=0"), "{out:?}");
    let written = std::fs::metadata(b.layer_mount(&info.id).join("upper/root/fill"))
        .unwrap()
        .len();
    assert!(
        written <= 64 << 20,
        "wrote {written} bytes past a 64 MiB cap"
    );
    // The sandbox still works after a full disk once the file goes.
    let out = common::sh(
        &info,
        "rm /root/fill && echo ok > /root/after && cat /root/after",
    )
    .await;
    assert_eq!(out.stdout.trim(), "ok", "{out:?}");
    // A size out of bounds is refused before anything is made.
    let mut bad = common::spec(&common::id("disk-bad"));
    bad.disk_size_mb = Some(1);
    let e = b.create(bad.clone()).await.unwrap_err();
    assert!(matches!(e, BackendError::InvalidLimits(_)), "{e:?}");
    assert!(!b.sandbox_dir(&bad.id).exists());
    b.destroy(&info.id).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconcile_leaves_the_sandboxes_of_a_node_with_another_address_pool_alone() {
    require_jail!();
    // Two node processes on one host, one runtime directory and cgroup parent, distinct
    // address pools: one's reconciliation must not take the other's sandboxes for
    // leftovers.
    let (a, _data_a) = common::backend().await;
    let info = common::create_ready(&a, common::spec(&common::id("other-pool"))).await;
    let pool = format!("10.19.{}.0/24", std::process::id() % 250);
    let (b, _data_b) = common::backend_with(|c| {
        c.address_pool = pool.parse().unwrap();
    })
    .await;
    let report = b.reconcile(&[]).await.unwrap();
    assert!(
        !report.removed_other.iter().any(|r| r.contains(&info.id)),
        "{report:?}"
    );
    assert!(a.cgroup_dirs(&info.id).iter().all(|d| d.is_dir()));
    let out = common::sh(&info, "echo alive").await;
    assert_eq!(out.stdout.trim(), "alive", "{out:?}");
    a.destroy(&info.id).await.unwrap();
}
