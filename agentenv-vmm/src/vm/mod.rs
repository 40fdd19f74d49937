//! The VM lifecycle: build from a validated configuration (or a snapshot), run one thread
//! per vCPU, pause (vCPUs parked, devices quiesced), resume, snapshot, stop.
//!
//! Rooms, as in Firecracker's `builder.rs`, `vstate/vcpu.rs`, `device_manager/` and
//! `persist.rs`:
//! * `builder`: a [`Vm`] from a configuration: guest memory, irqchip and PIT, vCPUs and
//!   their CPU template, the kernel and its command line.
//! * `vcpu`: the vCPU threads and their protocol with the controller (kicks, park and
//!   resume, stop), the exit loop, and the watchdog's hookup.
//! * `device_manager`: the port I/O and MMIO buses, the legacy devices, the virtio-mmio
//!   slots with their irqfds and ioeventfds.
//! * `persist`: snapshots of the VM, its vCPUs and devices, and restoring one.
//!
//! Here: the [`Vm`] itself and its public controls.

mod builder;
mod device_manager;
mod persist;
#[cfg(test)]
mod test_util;
mod vcpu;

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use serde::{Deserialize, Serialize};

pub use self::builder::{DeviceFactory, VirtioDevices};
use self::device_manager::DeviceManager;
pub use self::device_manager::{VirtioSlot, default_devices};
pub use self::persist::SnapshotInfo;
use self::vcpu::Shared;
pub use self::vcpu::{VCPU_KICK_SIGNAL, vcpu_kick_signal};
use crate::arch::{mptable, regs};
use crate::config::{ConfigError, VmConfig};
use crate::devices::BusError;
use crate::devices::virtio::balloon::Balloon;
pub use crate::devices::virtio::balloon::BalloonStats;
pub use crate::exit::{ExitReason, ExitState};
use crate::hypervisor::{Hypervisor, HypervisorError};
use crate::loader;
use crate::memory::{GuestMemoryMmap, MemoryError};
use crate::snapshot::SnapshotError;
pub use crate::snapshot::SnapshotKind;
use crate::sync::lock;

/// How long `pause` waits for every vCPU to park.
const PAUSE_TIMEOUT: Duration = Duration::from_secs(5);

/// The VM's counters.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmMetrics {
    pub vcpus: u8,
    pub memory_mib: u64,
    pub exits_io_in: u64,
    pub exits_io_out: u64,
    pub exits_mmio_read: u64,
    pub exits_mmio_write: u64,
    pub exits_interrupted: u64,
    /// Accesses no device claimed.
    pub unhandled_accesses: u64,
    pub pauses: u64,
    pub snapshots: u64,
    pub virtio_devices: u64,
    pub exit_reason: Option<ExitReason>,
    /// Per virtio device (by id): the transport's and the device's counters.
    pub devices: std::collections::BTreeMap<String, serde_json::Value>,
}

#[derive(Default)]
struct Counters {
    io_in: AtomicU64,
    io_out: AtomicU64,
    mmio_read: AtomicU64,
    mmio_write: AtomicU64,
    intr: AtomicU64,
    unhandled: AtomicU64,
    pauses: AtomicU64,
    snapshots: AtomicU64,
}

/// Why a VM operation failed.
#[derive(Debug, thiserror::Error)]
pub enum VmError {
    #[error("invalid VM configuration: {0}")]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Hypervisor(#[from] HypervisorError),
    #[error("guest memory: {0}")]
    Memory(#[from] MemoryError),
    #[error("loading the guest: {0}")]
    Loader(#[from] loader::LoaderError),
    #[error("setting up vCPU {id}: {source}")]
    VcpuSetup { id: u8, source: regs::RegsError },
    #[error("writing the MP table: {0}")]
    MpTable(#[from] mptable::MpTableError),
    #[error("placing a device: {0}")]
    Bus(#[from] BusError),
    #[error("device {id}: {reason}")]
    Device { id: String, reason: String },
    #[error("the serial output {path:?} cannot be opened: {source}")]
    SerialOutput {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("creating an event fd: {0}")]
    EventFd(std::io::Error),
    #[error("starting a vCPU thread: {0}")]
    Thread(std::io::Error),
    #[error("the VM is {0}")]
    State(&'static str),
    #[error("vCPUs did not park within {0:?}; the VM keeps running")]
    PauseTimeout(Duration),
    /// The watchdog found a vCPU stuck in the hypervisor and stopped the VM.
    #[error("{0}")]
    VcpuStuck(String),
    #[error("snapshot: {0}")]
    Snapshot(#[from] SnapshotError),
    #[error("{0}")]
    Unsupported(String),
}

impl VmError {
    /// Device `id` failed with `reason`.
    fn device(id: impl Into<String>, reason: impl std::fmt::Display) -> Self {
        VmError::Device {
            id: id.into(),
            reason: reason.to_string(),
        }
    }
}

/// A live VM.
pub struct Vm {
    config: VmConfig,
    hypervisor: Arc<dyn Hypervisor>,
    shared: Arc<Shared>,
    devices: DeviceManager,
    /// The kernel command line the guest got.
    cmdline: String,
    started: Mutex<bool>,
    /// Readable MSRs, found on the first snapshot.
    msrs: Mutex<Option<Vec<u32>>>,
    /// The memory file of the last snapshot (the base of the next diff snapshot).
    last_snapshot_memory: Mutex<Option<PathBuf>>,
    /// Guest memory is private anonymous memory (not a file).
    anonymous_memory: bool,
    /// The watchdog thread, once the vCPUs run.
    watchdog_thread: Mutex<Option<JoinHandle<()>>>,
    stopped: bool,
}

impl Vm {
    /// The configuration the VM was built from.
    pub fn config(&self) -> &VmConfig {
        &self.config
    }

    /// The kernel command line given to the guest.
    pub fn cmdline(&self) -> &str {
        &self.cmdline
    }

    /// The guest's memory.
    pub fn guest_memory(&self) -> &GuestMemoryMmap {
        &self.shared.mem
    }

    /// The virtio devices, in slot order.
    pub fn virtio_devices(&self) -> &[VirtioSlot] {
        &self.devices.virtio
    }

    /// Starts the vCPU threads (a restored VM starts parked; `resume` runs it).
    pub fn start(&mut self) -> Result<(), VmError> {
        self.spawn_vcpus()
    }

    /// Parks every vCPU (waits until each acknowledged), then quiesces the devices.
    pub fn pause(&self) -> Result<(), VmError> {
        self.park_vcpus()?;
        self.devices.quiesce();
        self.shared.counters.pauses.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Restarts the devices and unparks the vCPUs (starts them for a restored VM).
    pub fn resume(&self) -> Result<(), VmError> {
        if self.shared.is_stopping() {
            return Err(VmError::State("stopped"));
        }
        self.devices.resume()?;
        self.unpark_vcpus()
    }

    fn balloon(&self) -> Result<MutexGuard<'_, Balloon>, VmError> {
        match &self.devices.balloon {
            Some(b) => Ok(lock(b)),
            None => Err(VmError::Unsupported(
                "the VM has no balloon device (configure `balloon`)".into(),
            )),
        }
    }

    /// Sets the balloon's target size: the guest is asked to give back `mib` MiB.
    pub fn balloon_set_target(&self, mib: u64) -> Result<(), VmError> {
        if mib > self.config.memory_mib {
            return Err(VmError::Unsupported(format!(
                "balloon target {mib} MiB is more than the guest's {} MiB",
                self.config.memory_mib
            )));
        }
        self.balloon()?
            .set_target_mib(mib)
            .map_err(|e| VmError::device("balloon", e))
    }

    /// The balloon's sizes and the guest's latest memory statistics.
    pub fn balloon_stats(&self) -> Result<BalloonStats, VmError> {
        Ok(self.balloon()?.stats())
    }

    /// Ends the vCPU threads, joins them and returns why the VM ended. A vCPU thread the
    /// watchdog found stuck in the hypervisor is not waited for: it is left to end on its
    /// own (it holds its own references to what it uses).
    pub fn stop(&mut self) -> Result<ExitReason, VmError> {
        self.stop_vcpus()?;
        self.devices.detach(self.shared.hv_vm.as_ref());
        self.stopped = true;
        Ok(self.wait())
    }

    /// Blocks until the guest ends (reset, the debug-exit port, an error, or `stop`).
    pub fn wait(&self) -> ExitReason {
        self.shared.exit.wait()
    }

    /// Like [`Vm::wait`] with a bound; `None` when the guest is still running.
    pub fn wait_timeout(&self, timeout: Duration) -> Option<ExitReason> {
        self.shared.exit.wait_timeout(timeout)
    }

    /// The VM's counters.
    pub fn metrics(&self) -> VmMetrics {
        let c = &self.shared.counters;
        VmMetrics {
            vcpus: self.config.vcpus,
            memory_mib: self.config.memory_mib,
            exits_io_in: c.io_in.load(Ordering::Relaxed),
            exits_io_out: c.io_out.load(Ordering::Relaxed),
            exits_mmio_read: c.mmio_read.load(Ordering::Relaxed),
            exits_mmio_write: c.mmio_write.load(Ordering::Relaxed),
            exits_interrupted: c.intr.load(Ordering::Relaxed),
            unhandled_accesses: c.unhandled.load(Ordering::Relaxed),
            pauses: c.pauses.load(Ordering::Relaxed),
            snapshots: c.snapshots.load(Ordering::Relaxed),
            virtio_devices: self.devices.virtio.len() as u64,
            exit_reason: self.shared.exit.get(),
            devices: self.devices.metrics(),
        }
    }

    /// The registers of vCPU `idx` (it must be parked, or the VM not started).
    pub fn vcpu_regs(&self, idx: usize) -> Result<crate::hypervisor::Regs, VmError> {
        if !self.is_parked() {
            return Err(VmError::State("running; pause it to read registers"));
        }
        let v = self
            .shared
            .vcpus
            .get(idx)
            .ok_or(VmError::State("without that vCPU"))?;
        Ok(lock(v).get_regs()?)
    }
}

impl Drop for Vm {
    fn drop(&mut self) {
        if !self.stopped {
            if let Err(e) = self.stop() {
                tracing::warn!("stopping the VM on drop: {e}");
            }
        }
    }
}
