//! Snapshots of a paused VM (its vCPUs, the VM's interrupt controllers and clock, the
//! devices, guest memory) and restoring one into a fresh VM; the format is
//! [`crate::snapshot`]'s.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use serde::{Deserialize, Serialize};
use vm_memory::{GuestMemoryBackend, GuestMemoryRegion};

use super::builder::Boot;
use super::device_manager::{DeviceManager, default_devices};
use super::{DeviceFactory, Vm, VmError};
use crate::arch::cpuid;
use crate::config::{MAX_VCPUS, VmConfig};
use crate::hypervisor::kvm::KvmHypervisor;
use crate::hypervisor::{Hypervisor, HypervisorVcpu, HypervisorVm};
use crate::memory;
use crate::snapshot::{self, SnapshotError, SnapshotKind, SnapshotState};
use crate::sync::lock;

/// What a snapshot wrote.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotInfo {
    pub dir: PathBuf,
    pub kind: SnapshotKind,
    /// Guest memory size.
    pub memory_bytes: u64,
    /// Pages written to the memory file by this snapshot.
    pub pages_written: u64,
    /// Size of the state file.
    pub state_bytes: u64,
    pub duration_us: u64,
}

impl Vm {
    /// Restores a snapshot into a fresh VM (paused until `resume`).
    pub fn restore(config: VmConfig, snapshot_dir: &Path) -> Result<Vm, VmError> {
        Self::restore_with_devices(config, snapshot_dir, &default_devices)
    }

    /// [`Vm::restore`] with the virtio devices built by `devices`.
    pub fn restore_with_devices(
        config: VmConfig,
        snapshot_dir: &Path,
        devices: &DeviceFactory,
    ) -> Result<Vm, VmError> {
        config.validate_for_restore(usize::from(MAX_VCPUS))?;
        let hv: Arc<dyn Hypervisor> = Arc::new(KvmHypervisor::new()?);
        let host_model = cpuid::cpu_model(&hv.supported_cpuid()?);
        let state = snapshot::read_state(snapshot_dir, &host_model)?;
        if state.memory_bytes != config.memory_mib << 20 {
            return Err(SnapshotError::Mismatch(format!(
                "the snapshot has {} MiB of memory, the configuration {} MiB",
                state.memory_bytes >> 20,
                config.memory_mib
            ))
            .into());
        }
        if state.vcpus.len() != usize::from(config.vcpus) {
            return Err(SnapshotError::Mismatch(format!(
                "the snapshot has {} vCPUs, the configuration {}",
                state.vcpus.len(),
                config.vcpus
            ))
            .into());
        }
        let mem_file = snapshot_dir.join(snapshot::MEMORY_FILE);
        let vm = Self::build(hv, config, Boot::Restore(&state), devices, Some(&mem_file))?;
        *lock(&vm.last_snapshot_memory) = Some(mem_file);
        Ok(vm)
    }

    fn readable_msrs(&self) -> Result<Vec<u32>, VmError> {
        let mut cached = lock(&self.msrs);
        if let Some(list) = cached.as_ref() {
            return Ok(list.clone());
        }
        let mut list = self.hypervisor.msr_index_list()?;
        let vcpu = lock(&self.shared.vcpus[0]);
        // Drop the MSRs the hypervisor lists but cannot read.
        loop {
            let got = vcpu.get_msrs(&list)?;
            if got.len() == list.len() {
                break;
            }
            list.remove(got.len());
        }
        *cached = Some(list.clone());
        Ok(list)
    }

    /// Writes a snapshot of the paused VM to `dir` (see [`crate::snapshot`]).
    pub fn snapshot(&self, dir: &Path, kind: SnapshotKind) -> Result<SnapshotInfo, VmError> {
        if !self.is_parked() {
            return Err(VmError::State("running; pause it before taking a snapshot"));
        }
        let started = Instant::now();
        let msrs = self.readable_msrs()?;
        let mut vcpus = Vec::with_capacity(self.shared.vcpus.len());
        for v in &self.shared.vcpus {
            vcpus.push(lock(v).save_state(&msrs)?);
        }
        let vm = self.shared.hv_vm.save_state()?;
        let devices = self.devices.save_state()?;
        std::fs::create_dir_all(dir).map_err(|e| SnapshotError::Io {
            path: dir.to_path_buf(),
            source: e,
        })?;
        let mut base = lock(&self.last_snapshot_memory);
        let mem_path = dir.join(snapshot::MEMORY_FILE);
        let (pages_written, dirty_list) = match kind {
            SnapshotKind::Full => (
                snapshot::write_full_memory(&self.shared.mem, &mem_path, self.anonymous_memory)?,
                None,
            ),
            SnapshotKind::Diff => {
                if !self.config.track_dirty_pages {
                    return Err(VmError::Unsupported(
                        "a diff snapshot needs track_dirty_pages in the VM configuration".into(),
                    ));
                }
                let Some(base_path) = base.as_ref() else {
                    return Err(VmError::Unsupported(
                        "a diff snapshot needs a previous snapshot of this VM; take a full one first"
                            .into(),
                    ));
                };
                let dirty = self.dirty_pages()?;
                let written =
                    snapshot::write_diff_memory(&self.shared.mem, base_path, &mem_path, &dirty)?;
                (written.len() as u64, Some(written))
            }
        };
        // From here, dirty pages are counted from this snapshot.
        if self.config.track_dirty_pages && kind == SnapshotKind::Full {
            self.dirty_pages()?;
        }
        let state = SnapshotState {
            memory_bytes: memory::total_size(&self.shared.mem),
            kind,
            dirty_pages: dirty_list,
            vcpus,
            vm,
            devices,
            serial: Some(lock(&self.devices.serial).save_state()),
        };
        let model = cpuid::cpu_model(&self.hypervisor.supported_cpuid()?);
        let state_bytes = snapshot::write_state(dir, &model, &state)?;
        *base = Some(mem_path);
        self.shared
            .counters
            .snapshots
            .fetch_add(1, Ordering::Relaxed);
        Ok(SnapshotInfo {
            dir: dir.to_path_buf(),
            kind,
            memory_bytes: state.memory_bytes,
            pages_written,
            state_bytes,
            duration_us: started.elapsed().as_micros() as u64,
        })
    }

    /// Guest-physical page numbers written since the last call (KVM's log of vCPU writes
    /// OR the device bitmaps), resetting both.
    pub fn dirty_pages(&self) -> Result<Vec<u64>, VmError> {
        let mut out = Vec::new();
        for (slot, region) in self.shared.mem.iter().enumerate() {
            let log = self.shared.hv_vm.get_dirty_log(slot as u32, region.len())?;
            let base_page = region.start_addr().0 / memory::PAGE_SIZE as u64;
            let bitmap = region.get_mmap();
            let pages = region.len() / memory::PAGE_SIZE as u64;
            for page in 0..pages {
                let kvm = log
                    .get((page / 64) as usize)
                    .is_some_and(|w| w & (1 << (page % 64)) != 0);
                let dev = bitmap
                    .bitmap()
                    .as_ref()
                    .is_some_and(|b| b.is_bit_set(page as usize));
                if kvm || dev {
                    out.push(base_page + page);
                }
            }
        }
        memory::reset_dirty_bitmaps(&self.shared.mem);
        Ok(out)
    }
}

impl DeviceManager {
    /// Each virtio device's transport and device state, in slot order.
    fn save_state(&self) -> Result<Vec<snapshot::DeviceState>, VmError> {
        self.virtio
            .iter()
            .map(|slot| {
                let transport = lock(&slot.transport)
                    .save_state()
                    .map_err(|e| VmError::device(&slot.id, e))?;
                Ok(snapshot::DeviceState {
                    id: slot.id.clone(),
                    transport,
                })
            })
            .collect()
    }

    /// Puts the UART's saved registers back.
    fn restore_serial(&self, state: &SnapshotState) -> Result<(), VmError> {
        if let Some(saved) = &state.serial {
            lock(&self.serial)
                .restore_state(saved)
                .map_err(|reason| VmError::device("serial", reason))?;
        }
        Ok(())
    }

    /// Puts the saved virtio devices back into the slots of the configuration (which must
    /// hold the same devices in the same order), leaving them quiesced until `resume`.
    fn restore_virtio(&self, state: &SnapshotState) -> Result<(), VmError> {
        if state.devices.len() != self.virtio.len() {
            return Err(SnapshotError::Mismatch(format!(
                "the snapshot has {} virtio devices, the configuration {}",
                state.devices.len(),
                self.virtio.len()
            ))
            .into());
        }
        for (slot, saved) in self.virtio.iter().zip(&state.devices) {
            if saved.id != slot.id {
                return Err(SnapshotError::Mismatch(format!(
                    "virtio slot at {:#x} is {:?} in the snapshot, {:?} in the configuration",
                    slot.base, saved.id, slot.id
                ))
                .into());
            }
            let mut t = lock(&slot.transport);
            t.restore_state(&saved.transport)
                .map_err(|e| VmError::device(&slot.id, e))?;
            // Paused until resume.
            t.quiesce();
        }
        Ok(())
    }
}

/// Puts a snapshot's state into a freshly built VM: the UART, the VM's interrupt
/// controllers and clock, every vCPU, the virtio devices.
pub(super) fn restore_state(
    state: &SnapshotState,
    hv_vm: &dyn HypervisorVm,
    vcpus: &[Box<dyn HypervisorVcpu>],
    devices: &DeviceManager,
) -> Result<(), VmError> {
    devices.restore_serial(state)?;
    hv_vm.restore_state(&state.vm)?;
    for (vcpu, saved) in vcpus.iter().zip(&state.vcpus) {
        vcpu.restore_state(saved)?;
    }
    devices.restore_virtio(state)
}
