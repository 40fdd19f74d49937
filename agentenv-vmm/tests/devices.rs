//! A VM with every device the configuration can ask for (except net, which needs a tap):
//! each is announced on the kernel command line at its own slot and IRQ, the balloon's
//! controls work, and the VM's metrics report every device.

mod common;
mod support;

use std::time::Duration;

use agentenv_vmm::config::{BalloonConfig, DriveConfig, VsockConfig};
use agentenv_vmm::{ExitReason, Vm, VmConfig};
use common::*;
use support::ending_kernel;

#[test]
fn every_configured_device_is_announced_and_the_balloon_is_controllable() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data.img");
    let root = dir.path().join("root.img");
    std::fs::write(&data, vec![0u8; 4096]).unwrap();
    std::fs::write(&root, vec![0u8; 4096]).unwrap();
    let mut c = VmConfig::new(ending_kernel(dir.path()));
    c.memory_mib = 64;
    c.drives = vec![
        DriveConfig {
            id: "data".into(),
            path: data,
            read_only: true,
            is_root: false,
        },
        DriveConfig {
            id: "root".into(),
            path: root,
            read_only: true,
            is_root: true,
        },
    ];
    c.vsock = Some(VsockConfig {
        guest_cid: 3,
        uds_path: dir.path().join("v.sock"),
    });
    c.balloon = Some(BalloonConfig {
        amount_mib: 0,
        deflate_on_oom: true,
        stats_polling_interval_s: 1,
    });
    c.rng = true;
    let mut vm = Vm::new(c).unwrap();

    let ids: Vec<&str> = vm.virtio_devices().iter().map(|s| s.id.as_str()).collect();
    assert_eq!(ids, ["root", "data", "vsock", "rng", "balloon"]);
    let cmdline = vm.cmdline().to_string();
    assert!(cmdline.starts_with("root=/dev/vda ro "), "{cmdline}");
    for (n, slot) in vm.virtio_devices().iter().enumerate() {
        let want = format!(
            "virtio_mmio.device=4K@{:#x}:{}",
            0xd000_0000u64 + n as u64 * 0x1000,
            5 + n
        );
        assert!(cmdline.contains(&want), "{want} missing from {cmdline}");
        assert_eq!(slot.irq, 5 + n as u32);
    }

    vm.balloon_set_target(16).unwrap();
    let stats = vm.balloon_stats().unwrap();
    assert_eq!(stats.target_mib, 16);
    assert_eq!(stats.target_pages, 16 * 256);
    let e = vm.balloon_set_target(65).unwrap_err();
    assert!(
        e.to_string().contains("more than the guest's 64 MiB"),
        "{e}"
    );

    vm.start().unwrap();
    assert_eq!(
        vm.wait_timeout(Duration::from_secs(30)),
        Some(ExitReason::Done(0))
    );
    vm.stop().unwrap();
    let m = vm.metrics();
    assert_eq!(m.virtio_devices, 5);
    assert_eq!(
        m.devices.keys().map(String::as_str).collect::<Vec<_>>(),
        ["balloon", "data", "rng", "root", "vsock"]
    );
    assert!(m.devices["root"]["transport"].is_object());
    let json = serde_json::to_value(&m).unwrap();
    assert_eq!(json["exit_reason"]["reason"], "done");
}

#[test]
fn balloon_controls_without_a_balloon_say_how_to_get_one() {
    if !kvm_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let c = VmConfig::new(ending_kernel(dir.path()));
    let vm = Vm::new(c).unwrap();
    let e = vm.balloon_set_target(1).unwrap_err();
    assert!(e.to_string().contains("configure `balloon`"), "{e}");
    assert!(vm.balloon_stats().is_err());
}
