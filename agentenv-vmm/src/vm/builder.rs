//! Building a [`Vm`]: guest memory and its slots, irqchip and PIT, the devices, the vCPUs
//! with their CPU template, and the kernel with its command line (or, for a restore, the
//! saved state in place of the kernel).

use std::path::Path;
use std::sync::{Arc, Mutex};

use vm_memory::{GuestMemoryBackend, GuestMemoryRegion};

use super::device_manager::{Buses, DeviceManager, default_devices};
use super::persist;
use super::vcpu::{Shared, VcpuParts, install_kick_handler};
use super::{Vm, VmError};
use crate::arch::{self, cpuid, mptable, regs};
use crate::config::{MemoryBacking, VmConfig};
use crate::devices::virtio::VirtioDevice;
use crate::exit::ExitState;
use crate::hypervisor::kvm::KvmHypervisor;
use crate::hypervisor::{Hypervisor, HypervisorVcpu, HypervisorVm, MemorySlot};
use crate::loader;
use crate::memory::{self, Backing, GuestMemoryMmap};
use crate::snapshot;

/// How a VM is being built.
pub(super) enum Boot<'a> {
    Kernel,
    Restore(&'a snapshot::SnapshotState),
}

/// Virtio devices with their ids, in slot order.
pub type VirtioDevices = Vec<(String, Arc<Mutex<dyn VirtioDevice>>)>;

/// Builds the virtio devices of a configuration.
pub type DeviceFactory = dyn Fn(&VmConfig, &GuestMemoryMmap) -> Result<VirtioDevices, VmError>;

impl Vm {
    /// Validates `config` whole, then builds memory, vCPUs, irqchip+PIT, devices, loads the
    /// kernel.
    pub fn new(config: VmConfig) -> Result<Vm, VmError> {
        Self::with_devices(config, &default_devices)
    }

    /// Like [`Vm::new`] with the virtio devices built by `devices` instead of from the
    /// configuration's device lists (tests, embedders with their own devices).
    pub fn with_devices(config: VmConfig, devices: &DeviceFactory) -> Result<Vm, VmError> {
        config.validate()?;
        let hv: Arc<dyn Hypervisor> = Arc::new(KvmHypervisor::new()?);
        Self::build(hv, config, Boot::Kernel, devices, None)
    }

    pub(super) fn build(
        hv: Arc<dyn Hypervisor>,
        config: VmConfig,
        boot: Boot<'_>,
        devices: &DeviceFactory,
        restore_memory: Option<&Path>,
    ) -> Result<Vm, VmError> {
        let max = hv.max_vcpus();
        match boot {
            Boot::Kernel => config.validate_with_max_vcpus(max)?,
            Boot::Restore(_) => config.validate_for_restore(max)?,
        }
        install_kick_handler()?;

        let hv_vm = hv.create_vm()?;
        let backing = match (&restore_memory, &config.memory_backing) {
            (Some(p), _) => Backing::PrivateFile(p),
            (None, MemoryBacking::Anonymous) => Backing::Anonymous,
            (None, MemoryBacking::File { path }) => Backing::SharedFile(path),
        };
        let anonymous_memory = matches!(backing, Backing::Anonymous);
        let mem = create_memory(hv_vm.as_ref(), &config, backing)?;
        hv_vm.set_tss_address(arch::KVM_TSS_ADDRESS)?;
        hv_vm.create_irqchip()?;
        hv_vm.create_pit2()?;

        let exit = Arc::new(ExitState::default());
        let (devices, buses) = DeviceManager::new(hv_vm.as_ref(), &mem, &config, &exit, devices)?;
        let user_cmdline = match root_cmdline(&config) {
            Some(root) if config.cmdline.is_empty() => root,
            Some(root) => format!("{} {root}", config.cmdline),
            None => config.cmdline.clone(),
        };
        let cmdline = loader::build_cmdline(&user_cmdline, &devices.cmdline_devices())?;
        let cmdline_str = cmdline
            .as_cstring()
            .map(|c| c.to_string_lossy().into_owned())
            .unwrap_or_default();

        let vcpus = create_vcpus(hv.as_ref(), hv_vm.as_ref(), &config, &mem, &boot, &cmdline)?;
        if let Boot::Restore(state) = boot {
            persist::restore_state(state, hv_vm.as_ref(), &vcpus, &devices)?;
        }

        let restored = matches!(boot, Boot::Restore(_));
        let Buses { pio, mmio } = buses;
        let parts = VcpuParts {
            hv_vm,
            mem,
            pio,
            mmio,
            exit,
            vcpus,
        };
        let shared = Arc::new(Shared::new(parts, &config.watchdog, restored));
        tracing::info!(
            vcpus = config.vcpus,
            memory_mib = config.memory_mib,
            virtio_devices = devices.virtio.len(),
            restored,
            "VM built"
        );
        Ok(Vm {
            config,
            hypervisor: hv,
            shared,
            devices,
            cmdline: cmdline_str,
            started: Mutex::new(false),
            msrs: Mutex::new(None),
            last_snapshot_memory: Mutex::new(None),
            anonymous_memory,
            watchdog_thread: Mutex::new(None),
            stopped: false,
        })
    }
}

/// Guest memory, each region a memory slot of the VM.
fn create_memory(
    hv_vm: &dyn HypervisorVm,
    config: &VmConfig,
    backing: Backing<'_>,
) -> Result<GuestMemoryMmap, VmError> {
    let mem = memory::create(config.memory_mib << 20, backing, config.track_dirty_pages)?;
    for (slot, region) in mem.iter().enumerate() {
        let host_addr = region.as_ptr() as u64;
        // SAFETY: the region is owned by `mem`, which the VM keeps (in `Shared`) for
        // as long as the hypervisor VM exists, and never unmaps or remaps.
        unsafe {
            hv_vm.set_memory_slot(MemorySlot {
                slot: slot as u32,
                guest_addr: region.start_addr().0,
                size: region.len(),
                host_addr,
                log_dirty: config.track_dirty_pages,
            })
        }?;
    }
    Ok(mem)
}

/// The vCPUs; for a kernel boot also the kernel in memory, the boot tables and each
/// vCPU's CPUID, registers and template MSRs (a restore sets them from the snapshot).
fn create_vcpus(
    hv: &dyn Hypervisor,
    hv_vm: &dyn HypervisorVm,
    config: &VmConfig,
    mem: &GuestMemoryMmap,
    boot: &Boot<'_>,
    cmdline: &linux_loader::cmdline::Cmdline,
) -> Result<Vec<Box<dyn HypervisorVcpu>>, VmError> {
    let supported = hv.supported_cpuid()?;
    let (masks, msr_masks) = match &config.cpu_template {
        Some(t) => {
            for cap in t.required_kvm_capabilities()? {
                if !hv.check_extension(cap) {
                    return Err(VmError::Unsupported(format!(
                        "cpu_template.kvm_capabilities: this host's hypervisor lacks capability {cap}; use a template made for this cluster"
                    )));
                }
            }
            (t.cpuid_masks()?, t.msr_masks()?)
        }
        None => (Vec::new(), Vec::new()),
    };
    let mut vcpus = Vec::with_capacity(usize::from(config.vcpus));
    for id in 0..config.vcpus {
        vcpus.push(hv_vm.create_vcpu(id)?);
    }
    if let Boot::Kernel = boot {
        let entry = loader::load(mem, &config.kernel, config.initrd.as_deref(), cmdline)?;
        mptable::setup(mem, config.vcpus)?;
        regs::write_boot_tables(mem, entry.mode)
            .map_err(|source| VmError::VcpuSetup { id: 0, source })?;
        for vcpu in &vcpus {
            let table = cpuid::vcpu_cpuid(&supported, vcpu.id(), config.vcpus, &masks);
            vcpu.set_cpuid(&table)?;
            regs::setup_vcpu(vcpu.as_ref(), entry.entry, entry.mode).map_err(|source| {
                VmError::VcpuSetup {
                    id: vcpu.id(),
                    source,
                }
            })?;
            apply_msr_masks(vcpu.as_ref(), &msr_masks)?;
        }
    }
    Ok(vcpus)
}

/// The root-drive parameters for the kernel command line (`root=/dev/vda rw`), unless the
/// user's command line sets `root=` itself.
fn root_cmdline(config: &VmConfig) -> Option<String> {
    let root = config.drives.iter().find(|d| d.is_root)?;
    if config
        .cmdline
        .split_whitespace()
        .any(|w| w.starts_with("root="))
    {
        return None;
    }
    Some(format!(
        "root=/dev/vda {}",
        if root.read_only { "ro" } else { "rw" }
    ))
}

/// Masks the template's MSRs on a vCPU: each keeps only the bits its mask allows.
fn apply_msr_masks(vcpu: &dyn HypervisorVcpu, masks: &[(u32, u64)]) -> Result<(), VmError> {
    if masks.is_empty() {
        return Ok(());
    }
    let indices: Vec<u32> = masks.iter().map(|m| m.0).collect();
    let mut values = vcpu.get_msrs(&indices)?;
    if values.len() != indices.len() {
        let missing = indices[values.len()];
        return Err(VmError::Unsupported(format!(
            "cpu_template.msr_modifiers: MSR {missing:#x} cannot be read on this host"
        )));
    }
    for (v, (_, keep)) in values.iter_mut().zip(masks) {
        v.data &= keep;
    }
    let set = vcpu.set_msrs(&values)?;
    if set != values.len() {
        return Err(VmError::Unsupported(format!(
            "cpu_template.msr_modifiers: MSR {:#x} cannot be written on this host",
            values[set].index
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::exit::ExitReason;
    use crate::hypervisor::fake::{FakeExit, FakeHypervisor};
    use crate::vm::test_util::tiny_elf;

    #[test]
    fn cpu_template_masks_msrs_and_requires_its_kvm_capabilities() {
        let dir = tempfile::tempdir().unwrap();
        let mut config = VmConfig::new(tiny_elf(dir.path()));
        config.memory_mib = 16;
        config.cpu_template = crate::config::CpuTemplate::from_json(
            r#"{"kvm_capabilities":["1"],"msr_modifiers":[{"addr":"0x10a","bitmap":"0b0000000000000000000000000000000000000000000000000000000000000110"}]}"#,
        )
        .unwrap();
        let fake = Arc::new(FakeHypervisor::new(Vec::new()));
        let log = fake.log.clone();
        drop(Vm::build(fake, config.clone(), Boot::Kernel, &default_devices, None).unwrap());
        let calls = log.calls.lock().unwrap().clone();
        assert!(
            calls.iter().any(|c| c == "vcpu0 set_msrs 1 0x10a=0x6"),
            "{calls:?}"
        );
        config.cpu_template.as_mut().unwrap().kvm_capabilities = vec!["9999".into()];
        let fake = Arc::new(FakeHypervisor::new(Vec::new()));
        let e = Vm::build(fake, config, Boot::Kernel, &default_devices, None)
            .err()
            .unwrap();
        assert!(e.to_string().contains("lacks capability 9999"), "{e}");
    }

    #[test]
    fn vm_is_built_in_order_and_exits_are_dispatched_through_the_seam() {
        let dir = tempfile::tempdir().unwrap();
        let mut config = VmConfig::new(tiny_elf(dir.path()));
        config.vcpus = 2;
        config.memory_mib = 16;
        config.serial_output = Some(dir.path().join("serial.log"));
        let exits = vec![
            FakeExit::IoOut(0x3f8, b"o".to_vec()),
            FakeExit::IoOut(0x3f8, b"k".to_vec()),
            FakeExit::IoOut(0x3f8, b"\n".to_vec()),
            FakeExit::IoIn(0x1234, 1),
            FakeExit::MmioRead(0xd000_0000, 4),
            FakeExit::MmioWrite(0xd000_0000, vec![1, 2, 3, 4]),
            FakeExit::IoOut(0x501, vec![7, 0]),
        ];
        let fake = Arc::new(FakeHypervisor::new(Vec::new()));
        let log = fake.log.clone();
        let hv: Arc<dyn Hypervisor> = fake.clone();
        let vm = Vm::build(hv, config.clone(), Boot::Kernel, &default_devices, None).unwrap();
        let calls = log.calls.lock().unwrap().clone();
        let pos = |s: &str| {
            calls
                .iter()
                .position(|c| c.starts_with(s))
                .unwrap_or_else(|| panic!("{s} not called: {calls:?}"))
        };
        assert!(pos("create_vm") < pos("set_memory_slot 0 0x0+0x1000000 dirty=false"));
        assert!(pos("set_memory_slot") < pos("create_irqchip"));
        assert!(pos("create_irqchip") < pos("create_pit2"));
        assert!(pos("register_irqfd 4") < pos("create_vcpu 0"));
        assert!(pos("vcpu0 set_cpuid") < pos("vcpu0 set_msrs"));
        assert!(pos("vcpu0 set_lapic") < pos("vcpu0 set_regs rip=0x100000"));
        // Only the boot vCPU gets entry registers; the other waits for INIT/SIPI.
        assert!(calls.iter().all(|c| !c.starts_with("vcpu1 set_regs")));
        assert!(vm.cmdline().contains("console=ttyS0"));

        drop(vm);

        // Run a one-vCPU VM through the scripted exits (the AP of a two-vCPU VM would wait
        // for INIT/SIPI, which the double does not model).
        config.vcpus = 1;
        let fake = Arc::new(FakeHypervisor::new(exits));
        let log = fake.log.clone();
        let hv: Arc<dyn Hypervisor> = fake;
        let mut vm = Vm::build(hv, config, Boot::Kernel, &default_devices, None).unwrap();
        vm.start().unwrap();
        assert_eq!(vm.wait(), ExitReason::Done(7));
        assert_eq!(vm.stop().unwrap(), ExitReason::Done(7));
        let reads = log.reads.lock().unwrap().clone();
        assert_eq!(reads, vec![vec![0xff], vec![0, 0, 0, 0]]);
        let m = vm.metrics();
        assert_eq!(m.exits_io_out, 4);
        assert_eq!(m.exits_mmio_write, 1);
        assert_eq!(m.unhandled_accesses, 3);
        let serial = std::fs::read_to_string(dir.path().join("serial.log")).unwrap();
        assert_eq!(serial, "ok\n");
    }
}
