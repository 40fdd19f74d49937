//! The VM's devices: the buses the vCPU exit loop dispatches to, the legacy devices, and
//! the virtio-mmio slots with their interrupt and notification wiring.
//!
//! Port I/O: the 8250 UART at 0x3f8 (IRQ 4 through an irqfd), the i8042 at 0x60/0x64
//! (`out 0x64, 0xfe` ends the VM with [`ExitReason::Reset`](crate::exit::ExitReason)) and
//! the debug-exit port 0x501 ([`ExitReason::Done`](crate::exit::ExitReason)). Virtio-mmio
//! device `n` sits at `0xd000_0000 + n * 0x1000` with IRQ `5 + n` (an irqfd on that GSI,
//! routed by the in-kernel IOAPIC and PIC); each queue `q` has an ioeventfd on
//! `QueueNotify` (offset 0x50, 4 bytes, datamatch `q`), so queue notifications never exit
//! to the VMM. Each device is announced on the kernel command line as
//! `virtio_mmio.device=4K@<base>:<irq>`.

use std::collections::BTreeMap;
use std::fs::File;
use std::sync::{Arc, Mutex};

use vmm_sys_util::eventfd::EventFd;

use super::{DeviceFactory, VirtioDevices, VmError};
use crate::arch;
use crate::config::VmConfig;
use crate::devices::legacy::{self, DebugExit, I8042, SerialDevice};
use crate::devices::virtio::VirtioDevice;
use crate::devices::virtio::balloon::Balloon;
use crate::devices::virtio::block::Block;
use crate::devices::virtio::mmio::{MmioTransport, NOTIFY_OFFSET};
use crate::devices::virtio::net::Net;
use crate::devices::virtio::rng::Rng;
use crate::devices::virtio::vsock::Vsock;
use crate::devices::{Bus, InterruptLine, SharedDevice};
use crate::exit::ExitState;
use crate::hypervisor::{HypervisorVm, IoEventAddr, IoEventMatch};
use crate::memory::GuestMemoryMmap;
use crate::sync::lock;

/// One virtio device on the MMIO bus.
pub struct VirtioSlot {
    pub id: String,
    pub base: u64,
    pub irq: u32,
    pub transport: Arc<Mutex<MmioTransport>>,
    pub device: Arc<Mutex<dyn VirtioDevice>>,
    irqfd: Arc<EventFd>,
}

/// The buses the vCPU threads dispatch guest accesses to.
pub(super) struct Buses {
    pub pio: Bus,
    pub mmio: Bus,
}

/// The devices of a VM, as the controller sees them.
pub(super) struct DeviceManager {
    /// In slot order.
    pub(super) virtio: Vec<VirtioSlot>,
    pub(super) serial: Arc<Mutex<SerialDevice>>,
    pub(super) balloon: Option<Arc<Mutex<Balloon>>>,
}

impl DeviceManager {
    /// Creates the legacy devices and the virtio devices of `config` (built by `devices`,
    /// then the balloon) and wires them to the VM: irqfds, ioeventfds, bus ranges.
    pub(super) fn new(
        hv_vm: &dyn HypervisorVm,
        mem: &GuestMemoryMmap,
        config: &VmConfig,
        exit: &Arc<ExitState>,
        devices: &DeviceFactory,
    ) -> Result<(Self, Buses), VmError> {
        let mut pio = Bus::new();
        let serial = attach_legacy(hv_vm, config, exit, &mut pio)?;

        // Virtio devices at fixed slots, one IRQ each.
        let mut device_list = devices(config, mem)?;
        let balloon = match &config.balloon {
            Some(b) => {
                let dev = Balloon::new(b.amount_mib, b.deflate_on_oom, b.stats_polling_interval_s)
                    .map_err(|e| VmError::device("balloon", e))?;
                let dev = Arc::new(Mutex::new(dev));
                device_list.push(("balloon".to_string(), dev.clone()));
                Some(dev)
            }
            None => None,
        };
        let mut mmio = Bus::new();
        let mut virtio = Vec::with_capacity(device_list.len());
        for (n, (id, device)) in device_list.into_iter().enumerate() {
            virtio.push(attach_virtio(hv_vm, mem, &mut mmio, n, id, device)?);
        }
        let manager = DeviceManager {
            virtio,
            serial,
            balloon,
        };
        Ok((manager, Buses { pio, mmio }))
    }

    /// Each virtio device's window and IRQ, for the kernel command line.
    pub(super) fn cmdline_devices(&self) -> Vec<(u64, u64, u32)> {
        self.virtio
            .iter()
            .map(|s| (s.base, arch::VIRTIO_MMIO_SLOT, s.irq))
            .collect()
    }

    /// Stops every virtio device's worker (pause, stop, restore).
    pub(super) fn quiesce(&self) {
        for slot in &self.virtio {
            lock(&slot.transport).quiesce();
        }
    }

    /// Restarts the devices [`DeviceManager::quiesce`] stopped.
    pub(super) fn resume(&self) -> Result<(), VmError> {
        for slot in &self.virtio {
            lock(&slot.transport)
                .resume()
                .map_err(|e| VmError::device(&slot.id, e))?;
        }
        Ok(())
    }

    /// Stops the devices for good and takes their interrupts off the VM.
    pub(super) fn detach(&self, hv_vm: &dyn HypervisorVm) {
        for slot in &self.virtio {
            lock(&slot.transport).quiesce();
            let _ = hv_vm.unregister_irqfd(&slot.irqfd, slot.irq);
        }
    }

    /// Per virtio device (by id): the transport's and the device's counters.
    pub(super) fn metrics(&self) -> BTreeMap<String, serde_json::Value> {
        self.virtio
            .iter()
            .map(|slot| {
                let transport = lock(&slot.transport).metrics();
                let device = lock(&slot.device).metrics();
                (
                    slot.id.clone(),
                    serde_json::json!({ "transport": transport, "device": device }),
                )
            })
            .collect()
    }
}

/// The UART (its output to the configured file), the i8042 and the debug-exit port.
fn attach_legacy(
    hv_vm: &dyn HypervisorVm,
    config: &VmConfig,
    exit: &Arc<ExitState>,
    pio: &mut Bus,
) -> Result<Arc<Mutex<SerialDevice>>, VmError> {
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
    Ok(serial)
}

/// Puts `device` in virtio slot `n`: its transport on the MMIO bus, an irqfd on its IRQ,
/// an ioeventfd per queue.
fn attach_virtio(
    hv_vm: &dyn HypervisorVm,
    mem: &GuestMemoryMmap,
    mmio: &mut Bus,
    n: usize,
    id: String,
    device: Arc<Mutex<dyn VirtioDevice>>,
) -> Result<VirtioSlot, VmError> {
    let base = arch::VIRTIO_MMIO_START + n as u64 * arch::VIRTIO_MMIO_SLOT;
    let irq = arch::VIRTIO_IRQ_BASE + n as u32;
    let irqfd = Arc::new(EventFd::new(libc::EFD_NONBLOCK).map_err(VmError::EventFd)?);
    hv_vm.register_irqfd(&irqfd, irq)?;
    let line: Arc<dyn InterruptLine> = irqfd.clone();
    let transport = MmioTransport::new(mem.clone(), device.clone(), line)
        .map_err(|e| VmError::device(&id, e))?;
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
    Ok(VirtioSlot {
        id,
        base,
        irq,
        transport,
        device,
        irqfd,
    })
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
        let dev = Block::new(&d.id, &d.path, d.read_only).map_err(|e| VmError::device(&d.id, e))?;
        out.push((d.id.clone(), Arc::new(Mutex::new(dev))));
    }
    for n in &config.net {
        let mac = crate::config::parse_mac(&n.guest_mac).ok_or_else(|| {
            VmError::device(
                &n.id,
                format_args!("guest_mac {:?} is not a MAC address", n.guest_mac),
            )
        })?;
        let dev = Net::new(n.id.clone(), &n.tap, mac).map_err(|e| VmError::device(&n.id, e))?;
        out.push((n.id.clone(), Arc::new(Mutex::new(dev))));
    }
    if let Some(v) = &config.vsock {
        let dev = Vsock::new(u64::from(v.guest_cid), &v.uds_path)
            .map_err(|e| VmError::device("vsock", e))?;
        out.push(("vsock".to_string(), Arc::new(Mutex::new(dev))));
    }
    if config.rng {
        out.push(("rng".to_string(), Arc::new(Mutex::new(Rng::new()))));
    }
    Ok(out)
}
