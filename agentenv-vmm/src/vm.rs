//! The VM lifecycle: build from a validated configuration (or a snapshot), run one thread
//! per vCPU, pause (vCPUs parked, devices quiesced), resume, snapshot, stop.
//!
//! ## vCPU threads and kicks
//! Each vCPU runs on its own thread, which holds the vCPU's lock while it is inside the
//! guest. To pause, the controller asks for it, then kicks every vCPU thread with
//! [`VCPU_KICK_SIGNAL`]: the signal handler sets the vCPU's `immediate_exit` byte, so
//! `KVM_RUN` returns at once whether the signal arrived inside or just before it. The
//! thread releases the vCPU lock, counts itself parked and waits; the controller waits
//! until every live vCPU thread has acknowledged. Snapshot code reads vCPU state only
//! while the vCPUs are parked.
//!
//! The exit loop allocates nothing per exit: port I/O and MMIO go through two buses
//! (sorted ranges, binary search), counters are atomics.
//!
//! ## The watchdog
//! A thread per VM ([`crate::watchdog`]) watches the vCPU threads: each publishes a run
//! sequence number around `KVM_RUN`. A vCPU inside one `KVM_RUN` for a whole period
//! ([`crate::config::WatchdogConfig`], 1 s by default) is kicked once and looks at its
//! registers when back; that is all a healthy VM pays (busy guests do stay inside
//! `KVM_RUN` for long, and are not stopped for it). The VM is stopped with
//! [`ExitReason::Error`] when a kicked vCPU does not come back from `KVM_RUN` within the
//! timeout (2 s by default; the kicks of `pause` and `stop` count too), or when a vCPU
//! sits on a `VMMCALL`/`VMCALL` with unchanged registers for the timeout (kvm_pvm never
//! completes a hypercall at CPL0: `KVM_RUN` spins in the host, although kicks still end
//! it). `wait`, `pause` and `stop` then return with that error instead of hanging; a
//! thread stuck in the host is abandoned by `stop` (it holds its own references to the
//! VM's memory and file descriptors, so nothing it may touch is freed under it). Parked
//! vCPUs are outside `KVM_RUN` and are never kicked, so pause, resume and snapshots are
//! unaffected.
//!
//! ## Devices
//! Port I/O: the 8250 UART at 0x3f8 (IRQ 4 through an irqfd), the i8042 at 0x60/0x64
//! (`out 0x64, 0xfe` ends the VM with [`ExitReason::Reset`]) and the debug-exit port 0x501
//! ([`ExitReason::Done`]). Virtio-mmio device `n` sits at `0xd000_0000 + n * 0x1000` with
//! IRQ `5 + n` (an irqfd on that GSI, routed by the in-kernel IOAPIC and PIC); each queue
//! `q` has an ioeventfd on `QueueNotify` (offset 0x50, 4 bytes, datamatch `q`), so queue
//! notifications never exit to the VMM. Each device is announced on the kernel command
//! line as `virtio_mmio.device=4K@<base>:<irq>`.

use std::cell::Cell;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Once};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use vm_memory::{GuestMemoryBackend, GuestMemoryRegion};
use vmm_sys_util::eventfd::EventFd;
use vmm_sys_util::signal::{Killable, register_signal_handler};

use crate::arch::{self, cpuid, mptable, regs};
use crate::config::{ConfigError, MemoryBacking, VmConfig};
use crate::devices::legacy::{self, DebugExit, I8042, SerialDevice};
use crate::devices::virtio::VirtioDevice;
use crate::devices::virtio::balloon::Balloon;
pub use crate::devices::virtio::balloon::BalloonStats;
use crate::devices::virtio::block::Block;
use crate::devices::virtio::mmio::{MmioTransport, NOTIFY_OFFSET};
use crate::devices::virtio::net::Net;
use crate::devices::virtio::rng::Rng;
use crate::devices::virtio::vsock::Vsock;
use crate::devices::{Bus, BusError, InterruptLine, SharedDevice};
use crate::hypervisor::kvm::KvmHypervisor;
use crate::hypervisor::{
    Hypervisor, HypervisorError, HypervisorVcpu, HypervisorVm, IoEventAddr, IoEventMatch,
    MemorySlot, Regs, VcpuExit,
};
use crate::loader;
use crate::memory::{self, Backing, GuestMemoryMmap, MemoryError};
use crate::snapshot::{self, SnapshotError};
use crate::watchdog::{self, Progress, Watchdog};

/// The signal that kicks a vCPU thread out of the guest (`SIGRTMIN + 1`).
pub fn vcpu_kick_signal() -> libc::c_int {
    vmm_sys_util::signal::SIGRTMIN() + VCPU_KICK_SIGNAL
}
/// Offset of the kick signal from `SIGRTMIN`.
pub const VCPU_KICK_SIGNAL: libc::c_int = 1;

/// How long `pause` waits for every vCPU to park.
const PAUSE_TIMEOUT: Duration = Duration::from_secs(5);

/// Why a VM ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "reason", content = "detail")]
pub enum ExitReason {
    /// The guest wrote this value to the debug-exit port (0x501).
    Done(u32),
    /// The guest pulsed the i8042 reset line (`out 0x64, 0xfe`), or asked for a reset.
    Reset,
    /// The guest shut down (triple fault or a shutdown request).
    Shutdown,
    /// The guest halted a vCPU with no way to wake it.
    Halted,
    /// The VMM stopped the VM.
    Stopped,
    /// The hypervisor failed to run the guest.
    Error(String),
}

/// Where a VM's end is recorded; the first reason wins.
#[derive(Default)]
pub struct ExitState {
    set: AtomicBool,
    reason: Mutex<Option<ExitReason>>,
    cv: Condvar,
}

impl ExitState {
    /// Records why the VM ended (ignored when a reason is already recorded).
    pub fn set(&self, reason: ExitReason) {
        let mut r = self.reason.lock().unwrap_or_else(|p| p.into_inner());
        if r.is_none() {
            *r = Some(reason);
            self.set.store(true, Ordering::Release);
            self.cv.notify_all();
        }
    }

    pub fn is_set(&self) -> bool {
        self.set.load(Ordering::Acquire)
    }

    pub fn get(&self) -> Option<ExitReason> {
        self.reason
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Blocks until a reason is recorded.
    pub fn wait(&self) -> ExitReason {
        let mut r = self.reason.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(reason) = r.as_ref() {
                return reason.clone();
            }
            r = self.cv.wait(r).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Blocks until a reason is recorded or `timeout` passes.
    pub fn wait_timeout(&self, timeout: Duration) -> Option<ExitReason> {
        let deadline = Instant::now() + timeout;
        let mut r = self.reason.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(reason) = r.as_ref() {
                return Some(reason.clone());
            }
            let now = Instant::now();
            if now >= deadline {
                return None;
            }
            r = self
                .cv
                .wait_timeout(r, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

/// A full snapshot holds every page; a diff snapshot holds the pages written since the
/// previous snapshot of this VM (see [`crate::snapshot`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SnapshotKind {
    Full,
    Diff,
}

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

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Want {
    Run,
    Pause,
    Stop,
}

struct Ctl {
    want: Want,
    parked: usize,
    alive: usize,
    /// Per vCPU: its thread was started and has not ended.
    running: Vec<bool>,
}

/// Threads that may be kicked; `joined` is set before any is joined, so a kick never
/// reaches a joined thread.
struct Kicker {
    threads: Vec<JoinHandle<()>>,
    joined: bool,
}

/// One virtio device on the MMIO bus.
pub struct VirtioSlot {
    pub id: String,
    pub base: u64,
    pub irq: u32,
    pub transport: Arc<Mutex<MmioTransport>>,
    pub device: Arc<Mutex<dyn VirtioDevice>>,
    irqfd: Arc<EventFd>,
}

pub(crate) struct Shared {
    pub(crate) hv_vm: Box<dyn HypervisorVm>,
    pub(crate) mem: GuestMemoryMmap,
    pio: Bus,
    mmio: Bus,
    pub(crate) exit: Arc<ExitState>,
    ctl: Mutex<Ctl>,
    ctl_cv: Condvar,
    kicker: Mutex<Kicker>,
    pub(crate) vcpus: Vec<Arc<Mutex<Box<dyn HypervisorVcpu>>>>,
    counters: Counters,
    watchdog: Watchdog,
}

impl Shared {
    fn ctl(&self) -> MutexGuard<'_, Ctl> {
        self.ctl.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Kicks every vCPU thread out of the guest.
    fn kick_all(&self) {
        // Recorded first: a vCPU still in the same `KVM_RUN` after the watchdog's timeout
        // did not come back from this kick.
        self.watchdog.note_kicks();
        let k = self.kicker.lock().unwrap_or_else(|p| p.into_inner());
        if k.joined {
            return;
        }
        for t in &k.threads {
            // A thread that already ended is a zombie until joined; the kill is harmless.
            let _ = t.kill(vcpu_kick_signal());
        }
    }

    /// Kicks vCPU `idx`'s thread (for the watchdog).
    fn kick_one(&self, idx: usize) {
        let k = self.kicker.lock().unwrap_or_else(|p| p.into_inner());
        if k.joined {
            return;
        }
        if let Some(t) = k.threads.get(idx) {
            let _ = t.kill(vcpu_kick_signal());
        }
    }

    /// The watchdog found vCPU `idx` still inside `KVM_RUN` a timeout after a kick: the VM
    /// ends with an error and the other vCPUs are stopped.
    fn vcpu_stuck(&self, idx: usize) {
        let msg = self.stuck_message(idx);
        tracing::error!(vcpu = idx, "{msg}");
        self.stop_with(ExitReason::Error(msg));
    }

    fn stuck_message(&self, idx: usize) -> String {
        format!(
            "vCPU {idx} did not return from KVM_RUN within {:?} of a kick (the host's KVM is stuck in the guest, e.g. a VMMCALL under kvm_pvm); the VM was stopped",
            self.watchdog.timeout()
        )
    }

    /// Ends the VM with `reason` (unless it has one) and tells every vCPU to stop. The
    /// stop is asked first, so whoever sees the reason also finds the VM stopping (and
    /// `pause` refuses it).
    fn stop_with(&self, reason: ExitReason) {
        {
            let mut ctl = self.ctl();
            ctl.want = Want::Stop;
            self.ctl_cv.notify_all();
        }
        self.exit.set(reason);
        self.kick_all();
    }

    /// The VM's error when the watchdog gave up a vCPU thread.
    fn stuck_error(&self) -> Option<VmError> {
        let idx = (0..self.vcpus.len()).find(|&i| self.watchdog.is_stuck(i))?;
        Some(VmError::VcpuStuck(match self.exit.get() {
            Some(ExitReason::Error(msg)) => msg,
            // The watchdog is about to record it.
            _ => self.stuck_message(idx),
        }))
    }
}

/// A live VM.
pub struct Vm {
    config: VmConfig,
    hypervisor: Arc<dyn Hypervisor>,
    shared: Arc<Shared>,
    virtio: Vec<VirtioSlot>,
    balloon: Option<Arc<Mutex<Balloon>>>,
    serial: Arc<Mutex<SerialDevice>>,
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

thread_local! {
    /// The `immediate_exit` byte of the vCPU this thread runs (null on other threads).
    static IMMEDIATE_EXIT: Cell<*mut u8> = const { Cell::new(std::ptr::null_mut()) };
}

extern "C" fn kick_handler(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {
    let p = IMMEDIATE_EXIT.with(|c| c.get());
    if !p.is_null() {
        // SAFETY: the pointer was set by this thread to the `immediate_exit` byte of the
        // vCPU it runs, which lives as long as the thread's loop (it is reset to null
        // before the vCPU can be dropped). A volatile byte store is async-signal-safe.
        unsafe { std::ptr::write_volatile(p, 1) };
    }
}

fn install_kick_handler() -> Result<(), VmError> {
    static ONCE: Once = Once::new();
    static mut RESULT: i32 = 0;
    ONCE.call_once(|| {
        if let Err(e) = register_signal_handler(vcpu_kick_signal(), kick_handler) {
            // SAFETY: written once inside `call_once`, read only after it completed.
            unsafe { RESULT = e.errno() };
        }
    });
    // SAFETY: `call_once` has completed, so no write is in progress.
    let errno = unsafe { RESULT };
    if errno != 0 {
        return Err(VmError::Thread(std::io::Error::from_raw_os_error(errno)));
    }
    Ok(())
}

/// How a VM is being built.
enum Boot<'a> {
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
        config.validate()?;
        let hv: Arc<dyn Hypervisor> = Arc::new(KvmHypervisor::new()?);
        Self::build(hv, config, Boot::Kernel, &default_devices, None)
    }

    /// Like [`Vm::new`] with the virtio devices built by `devices` instead of from the
    /// configuration's device lists (tests, embedders with their own devices).
    pub fn with_devices(config: VmConfig, devices: &DeviceFactory) -> Result<Vm, VmError> {
        config.validate()?;
        let hv: Arc<dyn Hypervisor> = Arc::new(KvmHypervisor::new()?);
        Self::build(hv, config, Boot::Kernel, devices, None)
    }

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
        config.validate_for_restore(usize::from(crate::config::MAX_VCPUS))?;
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
        *vm.last_snapshot_memory
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = Some(mem_file);
        Ok(vm)
    }

    fn build(
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
        let size = config.memory_mib << 20;
        let backing = match (&restore_memory, &config.memory_backing) {
            (Some(p), _) => Backing::PrivateFile(p),
            (None, MemoryBacking::Anonymous) => Backing::Anonymous,
            (None, MemoryBacking::File { path }) => Backing::SharedFile(path),
        };
        let anonymous_memory = matches!(backing, Backing::Anonymous);
        let mem = memory::create(size, backing, config.track_dirty_pages)?;
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
        hv_vm.set_tss_address(arch::KVM_TSS_ADDRESS)?;
        hv_vm.create_irqchip()?;
        hv_vm.create_pit2()?;

        let exit = Arc::new(ExitState::default());
        let mut pio = Bus::new();
        let serial_out: Box<dyn std::io::Write + Send> = match &config.serial_output {
            Some(path) => {
                let f = File::options()
                    .create(true)
                    .append(true)
                    .open(path)
                    .map_err(|source| VmError::SerialOutput {
                        path: path.clone(),
                        source,
                    })?;
                Box::new(std::io::LineWriter::new(f))
            }
            None => Box::new(std::io::sink()),
        };
        let serial_irq = EventFd::new(libc::EFD_NONBLOCK).map_err(VmError::EventFd)?;
        hv_vm.register_irqfd(&serial_irq, legacy::SERIAL_IRQ)?;
        let serial = Arc::new(Mutex::new(
            SerialDevice::new(serial_irq, serial_out).map_err(VmError::EventFd)?,
        ));
        let serial_bus: SharedDevice = serial.clone();
        pio.insert(serial_bus, legacy::SERIAL_PORT, legacy::SERIAL_PORT_LEN)?;
        let i8042: SharedDevice = Arc::new(Mutex::new(I8042::new(exit.clone())));
        pio.insert(i8042, legacy::I8042_PORT, legacy::I8042_PORT_LEN)?;
        let debug: SharedDevice = Arc::new(Mutex::new(DebugExit::new(exit.clone())));
        pio.insert(debug, legacy::DEBUG_EXIT_PORT, legacy::DEBUG_EXIT_PORT_LEN)?;

        // Virtio devices at fixed slots, one IRQ each.
        let mut mmio = Bus::new();
        let mut virtio = Vec::new();
        let mut device_list = devices(&config, &mem)?;
        let balloon = match &config.balloon {
            Some(b) => {
                let dev = Balloon::new(b.amount_mib, b.deflate_on_oom, b.stats_polling_interval_s)
                    .map_err(|e| VmError::Device {
                        id: "balloon".into(),
                        reason: e.to_string(),
                    })?;
                let dev = Arc::new(Mutex::new(dev));
                device_list.push(("balloon".to_string(), dev.clone()));
                Some(dev)
            }
            None => None,
        };
        for (n, (id, device)) in device_list.into_iter().enumerate() {
            let base = arch::VIRTIO_MMIO_START + n as u64 * arch::VIRTIO_MMIO_SLOT;
            let irq = arch::VIRTIO_IRQ_BASE + n as u32;
            let irqfd = Arc::new(EventFd::new(libc::EFD_NONBLOCK).map_err(VmError::EventFd)?);
            hv_vm.register_irqfd(&irqfd, irq)?;
            let line: Arc<dyn InterruptLine> = irqfd.clone();
            let transport = MmioTransport::new(mem.clone(), device.clone(), line).map_err(|e| {
                VmError::Device {
                    id: id.clone(),
                    reason: e.to_string(),
                }
            })?;
            for (q, evt) in transport.queue_events().iter().enumerate() {
                hv_vm.register_ioevent(
                    evt,
                    IoEventAddr::Mmio(base + NOTIFY_OFFSET),
                    IoEventMatch::U32(q as u32),
                )?;
            }
            let transport = Arc::new(Mutex::new(transport));
            let as_bus: SharedDevice = transport.clone();
            mmio.insert(as_bus, base, arch::VIRTIO_MMIO_SLOT)?;
            virtio.push(VirtioSlot {
                id,
                base,
                irq,
                transport,
                device,
                irqfd,
            });
        }

        let dev_args: Vec<(u64, u64, u32)> = virtio
            .iter()
            .map(|s| (s.base, arch::VIRTIO_MMIO_SLOT, s.irq))
            .collect();
        let user_cmdline = match root_cmdline(&config) {
            Some(root) if config.cmdline.is_empty() => root,
            Some(root) => format!("{} {root}", config.cmdline),
            None => config.cmdline.clone(),
        };
        let cmdline = loader::build_cmdline(&user_cmdline, &dev_args)?;
        let cmdline_str = cmdline
            .as_cstring()
            .map(|c| c.to_string_lossy().into_owned())
            .unwrap_or_default();

        // vCPUs.
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
            let vcpu = hv_vm.create_vcpu(id)?;
            vcpus.push(vcpu);
        }

        match boot {
            Boot::Kernel => {
                let entry = loader::load(&mem, &config.kernel, config.initrd.as_deref(), &cmdline)?;
                mptable::setup(&mem, config.vcpus)?;
                regs::write_boot_tables(&mem, entry.mode)
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
            Boot::Restore(state) => {
                if let Some(saved) = &state.serial {
                    serial
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .restore_state(saved)
                        .map_err(|reason| VmError::Device {
                            id: "serial".into(),
                            reason,
                        })?;
                }
                hv_vm.restore_state(&state.vm)?;
                for (vcpu, saved) in vcpus.iter().zip(&state.vcpus) {
                    vcpu.restore_state(saved)?;
                }
                if state.devices.len() != virtio.len() {
                    return Err(SnapshotError::Mismatch(format!(
                        "the snapshot has {} virtio devices, the configuration {}",
                        state.devices.len(),
                        virtio.len()
                    ))
                    .into());
                }
                for (slot, saved) in virtio.iter().zip(&state.devices) {
                    if saved.id != slot.id {
                        return Err(SnapshotError::Mismatch(format!(
                            "virtio slot at {:#x} is {:?} in the snapshot, {:?} in the configuration",
                            slot.base, saved.id, slot.id
                        ))
                        .into());
                    }
                    let mut t = slot.transport.lock().unwrap_or_else(|p| p.into_inner());
                    t.restore_state(&saved.transport)
                        .map_err(|e| VmError::Device {
                            id: slot.id.clone(),
                            reason: e.to_string(),
                        })?;
                    // Paused until resume.
                    t.quiesce();
                }
            }
        }

        let restored = matches!(boot, Boot::Restore(_));
        let n = vcpus.len();
        let shared = Arc::new(Shared {
            hv_vm,
            mem,
            pio,
            mmio,
            exit,
            ctl: Mutex::new(Ctl {
                want: if restored { Want::Pause } else { Want::Run },
                parked: 0,
                alive: 0,
                running: vec![false; n],
            }),
            ctl_cv: Condvar::new(),
            kicker: Mutex::new(Kicker {
                threads: Vec::with_capacity(n),
                joined: false,
            }),
            vcpus: vcpus.into_iter().map(|v| Arc::new(Mutex::new(v))).collect(),
            counters: Counters::default(),
            watchdog: Watchdog::new(n, config.watchdog.period(), config.watchdog.timeout()),
        });
        tracing::info!(
            vcpus = config.vcpus,
            memory_mib = config.memory_mib,
            virtio_devices = virtio.len(),
            restored,
            "VM built"
        );
        Ok(Vm {
            config,
            hypervisor: hv,
            shared,
            virtio,
            balloon,
            serial,
            cmdline: cmdline_str,
            started: Mutex::new(false),
            msrs: Mutex::new(None),
            last_snapshot_memory: Mutex::new(None),
            anonymous_memory,
            watchdog_thread: Mutex::new(None),
            stopped: false,
        })
    }

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
        &self.virtio
    }

    /// Starts the vCPU threads (a restored VM starts parked; `resume` runs it).
    pub fn start(&mut self) -> Result<(), VmError> {
        self.spawn_vcpus()
    }

    fn spawn_vcpus(&self) -> Result<(), VmError> {
        let mut started = self.started.lock().unwrap_or_else(|p| p.into_inner());
        if *started {
            return Err(VmError::State("already started"));
        }
        if self.stopped {
            return Err(VmError::State("stopped"));
        }
        let mut kicker = self.shared.kicker.lock().unwrap_or_else(|p| p.into_inner());
        for idx in 0..self.shared.vcpus.len() {
            let shared = self.shared.clone();
            {
                let mut ctl = shared.ctl();
                ctl.alive += 1;
                ctl.running[idx] = true;
            }
            let handle = std::thread::Builder::new()
                .name(format!("vcpu{idx}"))
                .spawn(move || vcpu_thread(shared, idx));
            match handle {
                Ok(h) => kicker.threads.push(h),
                Err(e) => {
                    {
                        let mut ctl = self.shared.ctl();
                        ctl.alive -= 1;
                        ctl.running[idx] = false;
                    }
                    drop(kicker);
                    self.shared.exit.set(ExitReason::Error(format!(
                        "starting vCPU thread {idx} failed: {e}"
                    )));
                    self.request(Want::Stop);
                    return Err(VmError::Thread(e));
                }
            }
        }
        drop(kicker);
        *started = true;
        let shared = self.shared.clone();
        let handle = std::thread::Builder::new()
            .name("vcpu-watchdog".into())
            .spawn(move || {
                shared
                    .watchdog
                    .run(|idx| shared.kick_one(idx), |idx| shared.vcpu_stuck(idx))
            });
        match handle {
            Ok(h) => {
                *self
                    .watchdog_thread
                    .lock()
                    .unwrap_or_else(|p| p.into_inner()) = Some(h);
                Ok(())
            }
            Err(e) => {
                self.shared.exit.set(ExitReason::Error(format!(
                    "starting the vCPU watchdog thread failed: {e}"
                )));
                self.request(Want::Stop);
                Err(VmError::Thread(e))
            }
        }
    }

    fn request(&self, want: Want) {
        {
            let mut ctl = self.shared.ctl();
            if ctl.want == Want::Stop {
                return;
            }
            ctl.want = want;
            self.shared.ctl_cv.notify_all();
        }
        if want != Want::Run {
            self.shared.kick_all();
        }
    }

    /// Parks every vCPU (waits until each acknowledged), then quiesces the devices.
    pub fn pause(&self) -> Result<(), VmError> {
        if !*self.started.lock().unwrap_or_else(|p| p.into_inner()) {
            return Err(VmError::State("not started"));
        }
        {
            let ctl = self.shared.ctl();
            if ctl.want == Want::Stop {
                return Err(VmError::State("stopped"));
            }
        }
        self.request(Want::Pause);
        let deadline = Instant::now() + PAUSE_TIMEOUT;
        let mut ctl = self.shared.ctl();
        while ctl.parked < ctl.alive {
            if let Some(e) = self.shared.stuck_error() {
                return Err(e);
            }
            let now = Instant::now();
            if now >= deadline {
                drop(ctl);
                self.request(Want::Run);
                return Err(VmError::PauseTimeout(PAUSE_TIMEOUT));
            }
            // Re-kick now and then: a thread between its state check and `KVM_RUN`
            // sees `immediate_exit`, but one still starting up may not have set it yet.
            let wait = (deadline - now).min(Duration::from_millis(20));
            let (c, timeout) = self
                .shared
                .ctl_cv
                .wait_timeout(ctl, wait)
                .unwrap_or_else(|p| p.into_inner());
            ctl = c;
            if timeout.timed_out() && ctl.parked < ctl.alive {
                drop(ctl);
                self.shared.kick_all();
                ctl = self.shared.ctl();
            }
        }
        drop(ctl);
        for slot in &self.virtio {
            slot.transport
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .quiesce();
        }
        self.shared.counters.pauses.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Restarts the devices and unparks the vCPUs (starts them for a restored VM).
    pub fn resume(&self) -> Result<(), VmError> {
        if self.shared.ctl().want == Want::Stop {
            return Err(VmError::State("stopped"));
        }
        for slot in &self.virtio {
            slot.transport
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .resume()
                .map_err(|e| VmError::Device {
                    id: slot.id.clone(),
                    reason: e.to_string(),
                })?;
        }
        self.request(Want::Run);
        let started = *self.started.lock().unwrap_or_else(|p| p.into_inner());
        if !started {
            self.spawn_vcpus()?;
        }
        Ok(())
    }

    fn is_parked(&self) -> bool {
        let started = *self.started.lock().unwrap_or_else(|p| p.into_inner());
        let ctl = self.shared.ctl();
        !started || (ctl.want == Want::Pause && ctl.parked == ctl.alive)
    }

    fn readable_msrs(&self) -> Result<Vec<u32>, VmError> {
        let mut cached = self.msrs.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(list) = cached.as_ref() {
            return Ok(list.clone());
        }
        let mut list = self.hypervisor.msr_index_list()?;
        let vcpu = self.shared.vcpus[0]
            .lock()
            .unwrap_or_else(|p| p.into_inner());
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
            let v = v.lock().unwrap_or_else(|p| p.into_inner());
            vcpus.push(v.save_state(&msrs)?);
        }
        let vm = self.shared.hv_vm.save_state()?;
        let mut devices = Vec::with_capacity(self.virtio.len());
        for slot in &self.virtio {
            let mut t = slot.transport.lock().unwrap_or_else(|p| p.into_inner());
            let transport = t.save_state().map_err(|e| VmError::Device {
                id: slot.id.clone(),
                reason: e.to_string(),
            })?;
            devices.push(snapshot::DeviceState {
                id: slot.id.clone(),
                transport,
            });
        }
        std::fs::create_dir_all(dir).map_err(|e| SnapshotError::Io {
            path: dir.to_path_buf(),
            source: e,
        })?;
        let mut base = self
            .last_snapshot_memory
            .lock()
            .unwrap_or_else(|p| p.into_inner());
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
        let state = snapshot::SnapshotState {
            memory_bytes: memory::total_size(&self.shared.mem),
            kind,
            dirty_pages: dirty_list,
            vcpus,
            vm,
            devices,
            serial: Some(
                self.serial
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .save_state(),
            ),
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

    fn balloon(&self) -> Result<MutexGuard<'_, Balloon>, VmError> {
        match &self.balloon {
            Some(b) => Ok(b.lock().unwrap_or_else(|p| p.into_inner())),
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
            .map_err(|e| VmError::Device {
                id: "balloon".into(),
                reason: e.to_string(),
            })
    }

    /// The balloon's sizes and the guest's latest memory statistics.
    pub fn balloon_stats(&self) -> Result<BalloonStats, VmError> {
        Ok(self.balloon()?.stats())
    }

    /// Ends the vCPU threads, joins them and returns why the VM ended. A vCPU thread the
    /// watchdog found stuck in the hypervisor is not waited for: it is left to end on its
    /// own (it holds its own references to what it uses).
    pub fn stop(&mut self) -> Result<ExitReason, VmError> {
        self.shared.stop_with(ExitReason::Stopped);
        // Wait until every thread left its loop (so none is in KVM_RUN) or was given up by
        // the watchdog (which does so a timeout after the kick above), then join.
        let limit = PAUSE_TIMEOUT + self.shared.watchdog.timeout();
        let deadline = Instant::now() + limit;
        let waiting = |ctl: &Ctl| {
            ctl.running
                .iter()
                .enumerate()
                .any(|(i, &r)| r && !self.shared.watchdog.is_stuck(i))
        };
        loop {
            let ctl = self.shared.ctl();
            if !waiting(&ctl) {
                break;
            }
            if Instant::now() >= deadline {
                return Err(VmError::PauseTimeout(limit));
            }
            let _ = self
                .shared
                .ctl_cv
                .wait_timeout(ctl, Duration::from_millis(10));
            self.shared.kick_all();
        }
        self.shared.watchdog.shutdown();
        if let Some(t) = self
            .watchdog_thread
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
        {
            let _ = t.join();
        }
        let threads = {
            let mut k = self.shared.kicker.lock().unwrap_or_else(|p| p.into_inner());
            k.joined = true;
            std::mem::take(&mut k.threads)
        };
        for (idx, t) in threads.into_iter().enumerate() {
            if self.shared.watchdog.is_stuck(idx) && !t.is_finished() {
                tracing::warn!(
                    vcpu = idx,
                    "vCPU thread left behind inside KVM_RUN; it ends when the hypervisor lets it go"
                );
                continue;
            }
            let _ = t.join();
        }
        for slot in &self.virtio {
            slot.transport
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .quiesce();
            let _ = self.shared.hv_vm.unregister_irqfd(&slot.irqfd, slot.irq);
        }
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
            virtio_devices: self.virtio.len() as u64,
            exit_reason: self.shared.exit.get(),
            devices: self
                .virtio
                .iter()
                .map(|slot| {
                    let transport = slot
                        .transport
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .metrics();
                    let device = slot
                        .device
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .metrics();
                    (
                        slot.id.clone(),
                        serde_json::json!({ "transport": transport, "device": device }),
                    )
                })
                .collect(),
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
            .ok_or(VmError::State("without that vCPU"))?
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        Ok(v.get_regs()?)
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

/// The virtio devices of a configuration, in slot order: drives (the root drive first, so
/// it is `/dev/vda`), network interfaces, vsock, rng. (The VM adds the balloon itself, last,
/// to keep a handle for its controls.)
pub fn default_devices(
    config: &VmConfig,
    _mem: &GuestMemoryMmap,
) -> Result<VirtioDevices, VmError> {
    let mut out: VirtioDevices = Vec::new();
    let mut drives: Vec<_> = config.drives.iter().collect();
    drives.sort_by_key(|d| !d.is_root);
    for d in drives {
        let dev = Block::new(&d.id, &d.path, d.read_only).map_err(|e| VmError::Device {
            id: d.id.clone(),
            reason: e.to_string(),
        })?;
        out.push((d.id.clone(), Arc::new(Mutex::new(dev))));
    }
    for n in &config.net {
        let mac = crate::config::parse_mac(&n.guest_mac).ok_or_else(|| VmError::Device {
            id: n.id.clone(),
            reason: format!("guest_mac {:?} is not a MAC address", n.guest_mac),
        })?;
        let dev = Net::new(n.id.clone(), &n.tap, mac).map_err(|e| VmError::Device {
            id: n.id.clone(),
            reason: e.to_string(),
        })?;
        out.push((n.id.clone(), Arc::new(Mutex::new(dev))));
    }
    if let Some(v) = &config.vsock {
        let dev = Vsock::new(u64::from(v.guest_cid), &v.uds_path).map_err(|e| VmError::Device {
            id: "vsock".into(),
            reason: e.to_string(),
        })?;
        out.push(("vsock".to_string(), Arc::new(Mutex::new(dev))));
    }
    if config.rng {
        out.push(("rng".to_string(), Arc::new(Mutex::new(Rng::new()))));
    }
    Ok(out)
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

/// What ended a burst of guest execution.
enum Burst {
    /// Kicked: look at the control state.
    Kicked,
    /// The VM ended.
    Exit,
}

/// Accounts a vCPU thread's end, also when it unwinds from a panic (a bug): the VM then
/// ends with an error instead of leaving `pause`/`stop` waiting for it.
struct VcpuThreadGuard<'a> {
    shared: &'a Shared,
    idx: usize,
}

impl Drop for VcpuThreadGuard<'_> {
    fn drop(&mut self) {
        IMMEDIATE_EXIT.with(|c| c.set(std::ptr::null_mut()));
        if std::thread::panicking() {
            self.shared.exit.set(ExitReason::Error(format!(
                "vCPU {} thread panicked",
                self.idx
            )));
        }
        let panicking = std::thread::panicking();
        {
            let mut ctl = self.shared.ctl();
            if panicking {
                ctl.want = Want::Stop;
            }
            ctl.alive -= 1;
            ctl.running[self.idx] = false;
            self.shared.ctl_cv.notify_all();
        }
        if panicking {
            self.shared.kick_all();
        }
    }
}

fn vcpu_thread(shared: Arc<Shared>, idx: usize) {
    let _guard = VcpuThreadGuard {
        shared: &shared,
        idx,
    };
    vcpu_loop(&shared, idx);
}

fn vcpu_loop(shared: &Shared, idx: usize) {
    let vcpu_lock = shared.vcpus[idx].clone();
    {
        let mut v = vcpu_lock.lock().unwrap_or_else(|p| p.into_inner());
        let flag = v.immediate_exit_flag();
        IMMEDIATE_EXIT.with(|c| c.set(flag));
    }
    let mut progress = Progress::default();
    loop {
        {
            let mut ctl = shared.ctl();
            loop {
                match ctl.want {
                    Want::Run => break,
                    Want::Pause => {
                        // Time spent parked is no stall.
                        progress.reset();
                        ctl.parked += 1;
                        shared.ctl_cv.notify_all();
                        while ctl.want == Want::Pause {
                            ctl = shared.ctl_cv.wait(ctl).unwrap_or_else(|p| p.into_inner());
                        }
                        ctl.parked -= 1;
                    }
                    Want::Stop => return,
                }
            }
        }
        let burst = {
            let mut v = vcpu_lock.lock().unwrap_or_else(|p| p.into_inner());
            run_burst(v.as_mut(), shared, idx, &mut progress)
        };
        if let Burst::Exit = burst {
            // The guest ended: every vCPU stops; `stop`/`wait` collect the reason.
            {
                let mut ctl = shared.ctl();
                ctl.want = Want::Stop;
                shared.ctl_cv.notify_all();
            }
            shared.kick_all();
        }
    }
}

fn run_burst(
    vcpu: &mut dyn HypervisorVcpu,
    shared: &Shared,
    idx: usize,
    progress: &mut Progress,
) -> Burst {
    let c = &shared.counters;
    let wd = &shared.watchdog;
    loop {
        if shared.exit.is_set() {
            return Burst::Exit;
        }
        wd.entering(idx);
        let exit = vcpu.run();
        wd.returned(idx);
        if !matches!(exit, Ok(VcpuExit::Intr)) {
            progress.reset();
        }
        match exit {
            Ok(VcpuExit::IoOut(port, data)) => {
                c.io_out.fetch_add(1, Ordering::Relaxed);
                if !shared.pio.write(u64::from(port), data) {
                    c.unhandled.fetch_add(1, Ordering::Relaxed);
                }
            }
            Ok(VcpuExit::IoIn(port, data)) => {
                c.io_in.fetch_add(1, Ordering::Relaxed);
                if !shared.pio.read(u64::from(port), data) {
                    c.unhandled.fetch_add(1, Ordering::Relaxed);
                    data.fill(0xff);
                }
            }
            Ok(VcpuExit::MmioWrite(addr, data)) => {
                c.mmio_write.fetch_add(1, Ordering::Relaxed);
                if !shared.mmio.write(addr, data) {
                    c.unhandled.fetch_add(1, Ordering::Relaxed);
                }
            }
            Ok(VcpuExit::MmioRead(addr, data)) => {
                c.mmio_read.fetch_add(1, Ordering::Relaxed);
                if !shared.mmio.read(addr, data) {
                    c.unhandled.fetch_add(1, Ordering::Relaxed);
                    data.fill(0);
                }
            }
            Ok(VcpuExit::Intr) => {
                c.intr.fetch_add(1, Ordering::Relaxed);
                vcpu.set_immediate_exit(false);
                if !wd.take_probe(idx) {
                    // Kicked to park or stop: time spent parked is no stall.
                    progress.reset();
                } else if let Some(msg) = stalled(vcpu, shared, idx, progress) {
                    tracing::error!(vcpu = idx, "{msg}");
                    shared.stop_with(ExitReason::Error(msg));
                    return Burst::Exit;
                }
                return Burst::Kicked;
            }
            Ok(VcpuExit::Hlt) => shared.exit.set(ExitReason::Halted),
            Ok(VcpuExit::Shutdown) => shared.exit.set(ExitReason::Shutdown),
            Ok(VcpuExit::SystemEvent(kind)) => shared.exit.set(match kind {
                kvm_bindings::KVM_SYSTEM_EVENT_RESET => ExitReason::Reset,
                kvm_bindings::KVM_SYSTEM_EVENT_SHUTDOWN => ExitReason::Shutdown,
                other => ExitReason::Error(format!("system event {other}")),
            }),
            Ok(VcpuExit::FailEntry(reason)) => shared.exit.set(ExitReason::Error(format!(
                "vCPU {} could not enter the guest (hardware reason {reason:#x})",
                vcpu.id()
            ))),
            Ok(VcpuExit::InternalError) => {
                let rip = vcpu.get_regs().map(|r| r.rip).unwrap_or_default();
                shared.exit.set(ExitReason::Error(format!(
                    "vCPU {} hit a hypervisor internal error at rip {rip:#x}",
                    vcpu.id()
                )))
            }
            Ok(VcpuExit::Unknown(n)) => shared.exit.set(ExitReason::Error(format!(
                "vCPU {} exited with unhandled reason {n}",
                vcpu.id()
            ))),
            Err(e) => shared
                .exit
                .set(ExitReason::Error(format!("vCPU {}: {e}", vcpu.id()))),
        }
    }
}

/// Rule 2 of the watchdog, at its kick: the vCPU's registers are sampled; `Some` (the
/// VM's error) once they stayed on a hypercall without progress for the timeout.
fn stalled(
    vcpu: &dyn HypervisorVcpu,
    shared: &Shared,
    idx: usize,
    progress: &mut Progress,
) -> Option<String> {
    let Ok(regs) = vcpu.get_regs() else {
        progress.reset();
        return None;
    };
    let timeout = shared.watchdog.timeout();
    let stall = progress.sample(&regs, Instant::now(), timeout, |r| {
        hypercall_at(vcpu, &shared.mem, r)
    })?;
    Some(format!(
        "vCPU {idx} is stuck on a hypercall instruction ({}) at rip {:#x}: no progress for {timeout:?} (the host's KVM does not complete hypercalls from guest kernel mode, e.g. a VMMCALL under kvm_pvm); the VM was stopped",
        stall.instruction, stall.rip
    ))
}

/// The hypercall instruction (`VMMCALL`, `VMCALL`) at the vCPU's `rip`, if that is one.
fn hypercall_at(
    vcpu: &dyn HypervisorVcpu,
    mem: &GuestMemoryMmap,
    regs: &Regs,
) -> Option<&'static str> {
    use vm_memory::{Bytes, GuestAddress};
    let sregs = vcpu.get_sregs().ok()?;
    let long_mode = sregs.efer & arch::regs::EFER_LMA != 0 && sregs.cs.l != 0;
    let linear = if long_mode {
        regs.rip
    } else {
        sregs.cs.base.wrapping_add(regs.rip) & 0xffff_ffff
    };
    let mut code = [0u8; 3];
    for (i, b) in code.iter_mut().enumerate() {
        let gpa = vcpu.translate(linear.wrapping_add(i as u64)).ok()??;
        *b = mem.read_obj(GuestAddress(gpa)).ok()?;
    }
    watchdog::hypercall_name(code)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hypervisor::fake::{FakeExit, FakeHypervisor, StuckGate};

    /// A minimal 64-bit ELF with one loadable segment at 1 MiB.
    fn tiny_elf(dir: &Path) -> PathBuf {
        let code = [0xf4u8]; // hlt
        let mut b = vec![0u8; 0x78];
        b[..4].copy_from_slice(b"\x7fELF");
        b[4] = 2; // 64-bit
        b[5] = 1; // little endian
        b[6] = 1;
        b[16..18].copy_from_slice(&2u16.to_le_bytes()); // ET_EXEC
        b[18..20].copy_from_slice(&62u16.to_le_bytes()); // x86_64
        b[20..24].copy_from_slice(&1u32.to_le_bytes());
        b[24..32].copy_from_slice(&0x10_0000u64.to_le_bytes()); // entry
        b[32..40].copy_from_slice(&64u64.to_le_bytes()); // phoff
        b[52..54].copy_from_slice(&64u16.to_le_bytes());
        b[54..56].copy_from_slice(&56u16.to_le_bytes());
        b[56..58].copy_from_slice(&1u16.to_le_bytes());
        let ph = &mut b[64..120];
        ph[0..4].copy_from_slice(&1u32.to_le_bytes()); // PT_LOAD
        ph[4..8].copy_from_slice(&5u32.to_le_bytes());
        ph[8..16].copy_from_slice(&0x78u64.to_le_bytes()); // offset
        ph[16..24].copy_from_slice(&0x10_0000u64.to_le_bytes());
        ph[24..32].copy_from_slice(&0x10_0000u64.to_le_bytes());
        ph[32..40].copy_from_slice(&1u64.to_le_bytes());
        ph[40..48].copy_from_slice(&1u64.to_le_bytes());
        b.extend_from_slice(&code);
        let p = dir.join("vmlinux");
        std::fs::write(&p, b).unwrap();
        p
    }

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
    fn a_panicking_vcpu_thread_ends_the_vm_with_an_error_and_stop_still_returns() {
        let dir = tempfile::tempdir().unwrap();
        let mut config = VmConfig::new(tiny_elf(dir.path()));
        config.memory_mib = 16;
        let fake = Arc::new(FakeHypervisor::new(vec![FakeExit::Panic]));
        let mut vm = Vm::build(fake, config, Boot::Kernel, &default_devices, None).unwrap();
        vm.start().unwrap();
        assert_eq!(
            vm.wait(),
            ExitReason::Error("vCPU 0 thread panicked".into())
        );
        assert!(matches!(vm.stop().unwrap(), ExitReason::Error(_)));
        assert!(matches!(vm.pause(), Err(VmError::State(_))));
    }

    fn watched(dir: &Path, period_ms: u64, timeout_ms: u64) -> VmConfig {
        let mut config = VmConfig::new(tiny_elf(dir));
        config.memory_mib = 16;
        config.watchdog = crate::config::WatchdogConfig {
            period_ms,
            timeout_ms,
        };
        config
    }

    const HANG: Duration = Duration::from_secs(30);

    #[test]
    fn a_vcpu_that_does_not_come_back_from_a_kick_ends_the_vm_and_stop_leaves_it() {
        let dir = tempfile::tempdir().unwrap();
        let gate = Arc::new(StuckGate::default());
        let fake = Arc::new(FakeHypervisor::new(vec![FakeExit::Stuck(gate.clone())]));
        let mut vm = Vm::build(
            fake,
            watched(dir.path(), 10, 50),
            Boot::Kernel,
            &default_devices,
            None,
        )
        .unwrap();
        vm.start().unwrap();
        let reason = vm
            .wait_timeout(HANG)
            .expect("the watchdog did not stop the VM");
        let expected = ExitReason::Error(
            "vCPU 0 did not return from KVM_RUN within 50ms of a kick (the host's KVM is stuck in the guest, e.g. a VMMCALL under kvm_pvm); the VM was stopped".into(),
        );
        assert_eq!(reason, expected);
        assert!(matches!(vm.pause(), Err(VmError::State("stopped"))));
        // `stop` returns although the thread is still inside `run`.
        assert_eq!(vm.stop().unwrap(), expected);
        assert!(!gate.release.load(Ordering::Acquire));
        assert_eq!(vm.metrics().exit_reason, Some(expected));
        drop(vm);
        // Let the abandoned thread go; it ends by itself.
        gate.release.store(true, Ordering::Release);
    }

    #[test]
    fn pause_returns_the_watchdog_error_when_a_vcpu_does_not_come_back_from_its_kick() {
        let dir = tempfile::tempdir().unwrap();
        let gate = Arc::new(StuckGate::default());
        let fake = Arc::new(FakeHypervisor::new(vec![FakeExit::Stuck(gate.clone())]));
        // The watchdog's own period is long: only the kick of `pause` counts.
        let mut vm = Vm::build(
            fake,
            watched(dir.path(), 60_000, 50),
            Boot::Kernel,
            &default_devices,
            None,
        )
        .unwrap();
        vm.start().unwrap();
        let deadline = Instant::now() + HANG;
        while !gate.entered.load(Ordering::Acquire) {
            assert!(Instant::now() < deadline);
            std::thread::yield_now();
        }
        match vm.pause() {
            Err(VmError::VcpuStuck(msg)) => {
                assert!(
                    msg.starts_with("vCPU 0 did not return from KVM_RUN within 50ms"),
                    "{msg}"
                )
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(vm.stop().unwrap(), ExitReason::Error(_)));
        gate.release.store(true, Ordering::Release);
    }

    #[test]
    fn a_vcpu_stuck_on_a_vmmcall_ends_the_vm_and_its_thread_is_joined() {
        let dir = tempfile::tempdir().unwrap();
        let fake = Arc::new(FakeHypervisor::new(vec![FakeExit::Spin]));
        let mut vm = Vm::build(
            fake,
            watched(dir.path(), 10, 300),
            Boot::Kernel,
            &default_devices,
            None,
        )
        .unwrap();
        // The fake vCPU sits at rip 0, unpaged: put a VMMCALL there.
        use vm_memory::{Bytes, GuestAddress};
        vm.guest_memory()
            .write_slice(&[0x0f, 0x01, 0xd9], GuestAddress(0))
            .unwrap();
        vm.start().unwrap();
        let reason = vm
            .wait_timeout(HANG)
            .expect("the watchdog did not stop the VM");
        assert_eq!(
            reason,
            ExitReason::Error("vCPU 0 is stuck on a hypercall instruction (VMMCALL) at rip 0x0: no progress for 300ms (the host's KVM does not complete hypercalls from guest kernel mode, e.g. a VMMCALL under kvm_pvm); the VM was stopped".into())
        );
        assert!(vm.metrics().exits_interrupted >= u64::from(watchdog::MIN_STALL_SAMPLES));
        assert_eq!(vm.stop().unwrap(), reason);
        // The vCPU thread itself was never stuck: it was joined.
        assert!(!vm.shared.watchdog.any_stuck());
        assert!(vm.shared.ctl().running.iter().all(|r| !r));
    }

    #[test]
    fn a_vcpu_spinning_elsewhere_is_kicked_each_period_and_keeps_running() {
        let dir = tempfile::tempdir().unwrap();
        let fake = Arc::new(FakeHypervisor::new(vec![FakeExit::Spin]));
        let mut vm = Vm::build(
            fake,
            watched(dir.path(), 10, 5000),
            Boot::Kernel,
            &default_devices,
            None,
        )
        .unwrap();
        // `jmp $` at rip 0: unchanged registers, but no hypercall.
        use vm_memory::{Bytes, GuestAddress};
        vm.guest_memory()
            .write_slice(&[0xeb, 0xfe, 0x90], GuestAddress(0))
            .unwrap();
        vm.start().unwrap();
        let deadline = Instant::now() + HANG;
        while vm.metrics().exits_interrupted < 10 {
            assert!(Instant::now() < deadline, "the watchdog does not kick");
            assert_eq!(vm.wait_timeout(Duration::from_millis(5)), None);
        }
        assert_eq!(vm.wait_timeout(Duration::ZERO), None);
        // Pause and resume still work with the watchdog kicking.
        vm.pause().unwrap();
        vm.resume().unwrap();
        assert_eq!(vm.stop().unwrap(), ExitReason::Stopped);
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
