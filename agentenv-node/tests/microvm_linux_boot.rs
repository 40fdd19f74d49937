//! A real Linux guest through the microvm backend: the guest kernel built by
//! agentenv-vmm/guest/build-kernel.sh boots the `base` template's disk image with
//! `agentenv-guest` as init, and a command runs through the data plane (the agent's
//! Connect API at the sandbox address).
//!
//! It needs hardware KVM. Under `kvm_pvm` (the development and CI machines) guest kernel
//! code is emulated and a guest's system calls never reach its kernel, so no Linux guest
//! reaches userspace (docs/microvm.md, "Choosing the backend"): the test says so and
//! returns.

mod node_common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use agentenv_guest::client::GuestClient;
use agentenv_node::backend::SandboxBackend;
use agentenv_node::backend::agent::wait_ready;
use agentenv_node::backend::microvm::{MicrovmBackend, MicrovmConfig, unavailable_reason};

/// The guest kernel: `AENV_GUEST_KERNEL_PATH`, else the cached build of build-kernel.sh
/// (built on first use: about 15 minutes on 2 cores).
fn guest_kernel() -> PathBuf {
    if let Some(p) = std::env::var_os("AENV_GUEST_KERNEL_PATH") {
        return PathBuf::from(p);
    }
    let script =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../agentenv-vmm/guest/build-kernel.sh");
    let out = std::process::Command::new(&script)
        .stderr(std::process::Stdio::inherit())
        .output()
        .expect("running build-kernel.sh");
    assert!(out.status.success(), "build-kernel.sh failed");
    let dir = String::from_utf8_lossy(&out.stdout).trim().to_string();
    PathBuf::from(dir).join("vmlinux")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_linux_guest_boots_with_the_agent_as_init_and_runs_a_command() {
    if Path::new("/sys/module/kvm_pvm").exists() {
        println!(
            "NOT RUN HERE: /dev/kvm is served by kvm_pvm: guest kernel code is emulated and guest system calls fail, so no Linux guest reaches userspace (docs/microvm.md); this test runs on hosts with hardware KVM"
        );
        return;
    }
    if !Path::new("/dev/kvm").exists() {
        println!("NOT RUN HERE: /dev/kvm is missing: booting a Linux guest needs hardware KVM");
        return;
    }
    require_node!();
    let kernel = guest_kernel();
    let vmm = agentenv_testkit::bins::static_vmm_binary();
    if let Some(reason) = unavailable_reason(&kernel, &vmm) {
        panic!("hardware KVM is present but microVMs cannot run: {reason}");
    }
    node_common::ensure_base().await;
    let data = tempfile::tempdir().unwrap();
    let agent = node_common::guest_binary().unwrap();
    let mut cfg = MicrovmConfig::new(data.path(), &agent, &vmm, &kernel);
    cfg.templates.root = PathBuf::from(node_common::TEMPLATE_CACHE);
    cfg.cgroup_parent = "agentenv-test-vm".into();
    cfg.iface_prefix = node_common::rules_common::process_prefix('l');
    node_common::rules_common::remove_at_exit(&cfg.iface_prefix, &cfg.runtime_dir);
    let b = MicrovmBackend::new(cfg).await.unwrap();
    let mut spec = agentenv_node::backend::SandboxSpec::new(
        format!("linux-{:08x}", rand::random::<u32>()),
        "base",
    );
    spec.cpu_count = 1;
    spec.memory_mb = 512;
    let started = std::time::Instant::now();
    let info = b.create(spec).await.unwrap();
    let ready = wait_ready(
        info.address.agent(),
        Duration::from_secs(60),
        Duration::from_millis(5),
    )
    .await;
    if let Err(e) = ready {
        let serial =
            std::fs::read_to_string(b.sandbox_dir(&info.id).join("serial.log")).unwrap_or_default();
        b.destroy(&info.id).await.unwrap();
        panic!("the agent did not answer: {e}\nserial console:\n{serial}");
    }
    println!("boot → agent ready: {:?}", started.elapsed());
    let client = GuestClient::new(&format!("http://{}", info.address.agent())).unwrap();
    let out = client
        .run(
            "/bin/sh",
            &[
                "-c",
                "echo hello from $(uname -s); cat /proc/1/cmdline | tr '\\0' ' '",
            ],
        )
        .await
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines[0], "hello from Linux", "{text}");
    assert!(lines[1].starts_with("/agentenv/agentenv-guest"), "{text}");

    // Pause (snapshot) and resume (restore), then the agent answers again.
    b.pause(&info.id).await.unwrap();
    let started = std::time::Instant::now();
    let info = b.resume(&info.id).await.unwrap();
    wait_ready(
        info.address.agent(),
        Duration::from_secs(30),
        Duration::from_millis(2),
    )
    .await
    .unwrap();
    println!("restore → agent ready: {:?}", started.elapsed());
    b.destroy(&info.id).await.unwrap();
}
