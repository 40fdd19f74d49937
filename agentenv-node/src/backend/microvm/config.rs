//! Configuration of the microvm backend: [`MicrovmConfig`], its defaults and the host
//! layer's configuration derived from it, and [`unavailable_reason`], which says why a
//! host cannot run microVMs.

use std::ops::{Deref, DerefMut};
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::config::BackendKind;
use crate::host::{HostConfig, HostedConfig, devices};

/// The kernel arguments every guest gets before the backend's own.
/// (The VMM adds the serial console and the virtio-mmio devices itself.)
pub const DEFAULT_BOOT_ARGS: &str = "reboot=k panic=1 pci=off";
/// Configuration of the microvm backend.
#[derive(Clone, Debug)]
pub struct MicrovmConfig {
    /// The settings both backends have (`data_dir`, `address_pool`, …), reached through
    /// `Deref`: sandboxes live in `<data_dir>/microvm`; the agent binary is installed
    /// into template images as init.
    pub hosted: HostedConfig,
    /// The `agentenv-vmm` binary.
    pub vmm_binary: PathBuf,
    /// The guest kernel (an uncompressed vmlinux or a bzImage).
    pub kernel: PathBuf,
    /// Kernel arguments before the backend's (`root=`, `ip=`, `init=`).
    pub boot_args: String,
    /// Where template disk images are cached.
    pub image_dir: PathBuf,
    /// Memory the VMM process itself may use beyond the guest's, in MiB.
    pub vmm_overhead_mib: u64,
    /// Most threads of one VMM process.
    pub vmm_max_threads: u32,
    /// Install the VMM's seccomp filter (`--seccomp strict`).
    pub seccomp: bool,
    /// Attach the root disk and network device to the VM (a guest program without
    /// drivers may run without them).
    pub attach_devices: bool,
    /// How long a snapshot may take.
    pub snapshot_timeout: Duration,
}

impl MicrovmConfig {
    /// Defaults for a node with data under `data_dir`.
    pub fn new(
        data_dir: impl Into<PathBuf>,
        agent_binary: impl Into<PathBuf>,
        vmm_binary: impl Into<PathBuf>,
        kernel: impl Into<PathBuf>,
    ) -> Self {
        let hosted = HostedConfig {
            iface_prefix: "av".into(),
            cgroup_parent: "agentenv-vm".into(),
            op_timeout: Duration::from_secs(10),
            ..HostedConfig::new(data_dir, agent_binary)
        };
        Self {
            image_dir: hosted.data_dir.join("microvm").join("images"),
            hosted,
            vmm_binary: vmm_binary.into(),
            kernel: kernel.into(),
            boot_args: DEFAULT_BOOT_ARGS.into(),
            vmm_overhead_mib: 64,
            vmm_max_threads: 256,
            seccomp: true,
            attach_devices: true,
            snapshot_timeout: Duration::from_secs(120),
        }
    }

    pub(super) fn host(&self) -> HostConfig {
        self.hosted.host(BackendKind::Microvm, 0, devices::MICROVM)
    }
}

impl Deref for MicrovmConfig {
    type Target = HostedConfig;

    fn deref(&self) -> &HostedConfig {
        &self.hosted
    }
}

impl DerefMut for MicrovmConfig {
    fn deref_mut(&mut self) -> &mut HostedConfig {
        &mut self.hosted
    }
}

/// Why this host cannot run microVM sandboxes, if it cannot: no `/dev/kvm`, KVM served
/// by `kvm_pvm` (no Linux guest reaches userspace there), no guest kernel or no VMM
/// binary. The message says what is missing and how to fix it.
pub fn unavailable_reason(kernel: &Path, vmm_binary: &Path) -> Option<String> {
    unavailable_reason_at(
        Path::new("/dev/kvm"),
        Path::new("/sys/module/kvm_pvm"),
        kernel,
        vmm_binary,
    )
}

fn unavailable_reason_at(
    dev_kvm: &Path,
    pvm_module: &Path,
    kernel: &Path,
    vmm_binary: &Path,
) -> Option<String> {
    if !dev_kvm.exists() {
        return Some(format!(
            "{} is missing: this host has no KVM (enable virtualization or load kvm_intel/kvm_amd)",
            dev_kvm.display()
        ));
    }
    if pvm_module.exists() {
        return Some(format!(
            "{} is served by kvm_pvm ({} exists): guest kernel code is emulated there and no Linux guest reaches userspace; run microVMs on a host with hardware KVM",
            dev_kvm.display(),
            pvm_module.display()
        ));
    }
    if !kernel.is_file() {
        return Some(format!(
            "no guest kernel at {}: build it with agentenv-vmm/guest/build-kernel.sh and set AENV_GUEST_KERNEL_PATH to its vmlinux",
            kernel.display()
        ));
    }
    if !vmm_binary.is_file() {
        return Some(format!(
            "no agentenv-vmm binary at {}: install it (deploy/install.sh) or set AENV_VMM_BINARY_PATH",
            vmm_binary.display()
        ));
    }
    None
}
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn availability_names_what_is_missing() {
        let dir = tempfile::tempdir().unwrap();
        let present = dir.path().join("present");
        std::fs::write(&present, b"x").unwrap();
        let absent = dir.path().join("absent");
        let r = unavailable_reason_at(&absent, &absent, &present, &present).unwrap();
        assert!(r.contains("has no KVM"), "{r}");
        let r = unavailable_reason_at(&present, &present, &present, &present).unwrap();
        assert!(r.contains("kvm_pvm"), "{r}");
        let r = unavailable_reason_at(&present, &absent, &absent, &present).unwrap();
        assert!(r.contains("AENV_GUEST_KERNEL_PATH"), "{r}");
        let r = unavailable_reason_at(&present, &absent, &present, &absent).unwrap();
        assert!(r.contains("AENV_VMM_BINARY_PATH"), "{r}");
        assert_eq!(
            unavailable_reason_at(&present, &absent, &present, &present),
            None
        );
    }
}
