//! The hypervisor seam: what the VMM needs from a hypervisor, as three traits over the
//! handle types of the hypervisor (`Hypervisor` → `HypervisorVm` → `HypervisorVcpu`).
//!
//! [`kvm`] implements them over kvm-ioctls. The rest of the VMM only sees the traits and
//! the plain-data state types below (re-exported from kvm-bindings, which already carry
//! serde), so a test double or another backend fits without touching the VMM.

#[cfg(test)]
pub(crate) mod fake;
pub mod kvm;

use std::sync::Arc;

use serde::{Deserialize, Serialize};
use vmm_sys_util::eventfd::EventFd;

pub use kvm_bindings::{
    kvm_clock_data as ClockData, kvm_cpuid_entry2 as CpuIdEntry, kvm_fpu as FpuState,
    kvm_irqchip as IrqChipState, kvm_lapic_state as LapicState, kvm_mp_state as MpState,
    kvm_msr_entry as MsrEntry, kvm_pit_state2 as PitState, kvm_regs as Regs,
    kvm_sregs as SpecialRegs, kvm_vcpu_events as VcpuEvents, kvm_xcrs as ExtendedControlRegs,
    kvm_xsave as XsaveState,
};

/// Why a hypervisor call failed: the operation, and the OS error behind it.
#[derive(Debug, thiserror::Error)]
pub enum HypervisorError {
    #[error(
        "cannot open the hypervisor device {path}: {source} (is KVM available and are we allowed to use /dev/kvm?)"
    )]
    Open {
        path: String,
        source: std::io::Error,
    },
    #[error("{op} failed: {source}")]
    Ioctl {
        op: &'static str,
        source: std::io::Error,
    },
    #[error("{0}")]
    Unsupported(String),
}

impl HypervisorError {
    pub(crate) fn ioctl(op: &'static str, e: impl Into<std::io::Error>) -> Self {
        HypervisorError::Ioctl {
            op,
            source: e.into(),
        }
    }
}

pub type Result<T> = std::result::Result<T, HypervisorError>;

/// What made `run` return. Data slices point into the vCPU's shared run area: an `IoIn` or
/// `MmioRead` handler fills them, and the next `run` hands them to the guest.
#[derive(Debug)]
pub enum VcpuExit<'a> {
    IoIn(u16, &'a mut [u8]),
    IoOut(u16, &'a [u8]),
    MmioRead(u64, &'a mut [u8]),
    MmioWrite(u64, &'a [u8]),
    /// The guest shut down (triple fault).
    Shutdown,
    /// The guest executed HLT (only without an in-kernel irqchip).
    Hlt,
    /// `run` was interrupted by a signal, or `immediate_exit` was set.
    Intr,
    /// A system event (reset, shutdown, crash) reported by the hypervisor.
    SystemEvent(u32),
    /// The hypervisor could not enter the guest (hardware reason code).
    FailEntry(u64),
    /// The hypervisor hit an internal error (e.g. an instruction it cannot emulate).
    InternalError,
    /// Any other exit, by its number.
    Unknown(u32),
}

/// A memory slot: guest-physical range backed by host memory at `host_addr`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemorySlot {
    pub slot: u32,
    pub guest_addr: u64,
    pub size: u64,
    pub host_addr: u64,
    /// Track the guest's writes in the hypervisor's dirty log.
    pub log_dirty: bool,
}

/// Whether an ioeventfd fires on any write or only on one value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoEventMatch {
    Any,
    U32(u32),
}

/// Where an ioeventfd listens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoEventAddr {
    Pio(u64),
    Mmio(u64),
}

/// The in-kernel interrupt controllers' and timers' state of one VM.
#[derive(Clone, Serialize, Deserialize)]
pub struct VmState {
    pub pic_master: IrqChipState,
    pub pic_slave: IrqChipState,
    pub ioapic: IrqChipState,
    pub pit: PitState,
    pub clock: ClockData,
}

/// The whole architectural state of one vCPU.
#[derive(Serialize, Deserialize)]
pub struct VcpuState {
    pub id: u8,
    pub cpuid: Vec<CpuIdEntry>,
    pub regs: Regs,
    pub sregs: SpecialRegs,
    pub fpu_via_xsave: XsaveState,
    pub xcrs: ExtendedControlRegs,
    pub msrs: Vec<MsrEntry>,
    pub lapic: LapicState,
    pub mp_state: MpState,
    pub events: VcpuEvents,
}

/// A hypervisor: creates VMs and answers what the host supports.
pub trait Hypervisor: Send + Sync {
    fn create_vm(&self) -> Result<Box<dyn HypervisorVm>>;
    /// The most vCPUs one VM may have.
    fn max_vcpus(&self) -> usize;
    /// The CPUID table the hypervisor can give a guest.
    fn supported_cpuid(&self) -> Result<Vec<CpuIdEntry>>;
    /// The MSRs whose state is saved and restored.
    fn msr_index_list(&self) -> Result<Vec<u32>>;
    /// Whether the hypervisor has capability `cap` (a `KVM_CAP_*` number for KVM).
    fn check_extension(&self, cap: u32) -> bool;
}

/// One VM: memory, interrupts and the in-kernel devices.
pub trait HypervisorVm: Send + Sync {
    /// # Safety
    /// `slot.host_addr..+size` must stay mapped, and must not be reused, until the slot is
    /// removed or the VM is dropped.
    unsafe fn set_memory_slot(&self, slot: MemorySlot) -> Result<()>;
    /// Creates the in-kernel PIC + IOAPIC + LAPICs.
    fn create_irqchip(&self) -> Result<()>;
    /// Creates the in-kernel PIT (i8254).
    fn create_pit2(&self) -> Result<()>;
    fn set_tss_address(&self, addr: u64) -> Result<()>;
    fn set_identity_map_address(&self, addr: u64) -> Result<()>;
    fn register_irqfd(&self, fd: &EventFd, gsi: u32) -> Result<()>;
    fn unregister_irqfd(&self, fd: &EventFd, gsi: u32) -> Result<()>;
    fn register_ioevent(
        &self,
        fd: &EventFd,
        addr: IoEventAddr,
        datamatch: IoEventMatch,
    ) -> Result<()>;
    fn unregister_ioevent(
        &self,
        fd: &EventFd,
        addr: IoEventAddr,
        datamatch: IoEventMatch,
    ) -> Result<()>;
    /// The slot's dirty bitmap (one bit per 4 KiB page, in u64 words), reset by the read.
    fn get_dirty_log(&self, slot: u32, size: u64) -> Result<Vec<u64>>;
    fn get_clock(&self) -> Result<ClockData>;
    fn set_clock(&self, clock: &ClockData) -> Result<()>;
    /// `chip_id`: 0 PIC master, 1 PIC slave, 2 IOAPIC.
    fn get_irqchip(&self, chip_id: u32) -> Result<IrqChipState>;
    fn set_irqchip(&self, state: &IrqChipState) -> Result<()>;
    fn get_pit2(&self) -> Result<PitState>;
    fn set_pit2(&self, state: &PitState) -> Result<()>;
    fn create_vcpu(&self, id: u8) -> Result<Box<dyn HypervisorVcpu>>;

    /// The in-kernel state of the VM as one value.
    fn save_state(&self) -> Result<VmState> {
        Ok(VmState {
            pic_master: self.get_irqchip(0)?,
            pic_slave: self.get_irqchip(1)?,
            ioapic: self.get_irqchip(2)?,
            pit: self.get_pit2()?,
            clock: self.get_clock()?,
        })
    }

    /// Restores what [`HypervisorVm::save_state`] produced.
    fn restore_state(&self, state: &VmState) -> Result<()> {
        self.set_pit2(&state.pit)?;
        let mut clock = state.clock;
        // Only the clock value is restored: the host TSC and realtime of another process
        // mean nothing here.
        clock.flags = 0;
        self.set_clock(&clock)?;
        self.set_irqchip(&state.pic_master)?;
        self.set_irqchip(&state.pic_slave)?;
        self.set_irqchip(&state.ioapic)?;
        Ok(())
    }
}

/// One vCPU. `run` is called only by the thread that owns it; the state calls are made
/// while it is parked.
pub trait HypervisorVcpu: Send {
    fn id(&self) -> u8;
    fn run(&mut self) -> Result<VcpuExit<'_>>;
    /// The `immediate_exit` byte of the run area: setting it to 1 makes the current or
    /// next `run` return [`VcpuExit::Intr`]. The pointer stays valid while the vCPU lives.
    fn immediate_exit_flag(&mut self) -> *mut u8;
    fn set_immediate_exit(&mut self, on: bool);

    fn get_regs(&self) -> Result<Regs>;
    fn set_regs(&self, regs: &Regs) -> Result<()>;
    /// The guest-physical address of the guest linear address `gva` under the vCPU's
    /// current paging; `None` when it is not mapped.
    fn translate(&self, gva: u64) -> Result<Option<u64>>;
    fn get_sregs(&self) -> Result<SpecialRegs>;
    fn set_sregs(&self, sregs: &SpecialRegs) -> Result<()>;
    fn get_fpu(&self) -> Result<FpuState>;
    fn set_fpu(&self, fpu: &FpuState) -> Result<()>;
    fn get_xsave(&self) -> Result<XsaveState>;
    fn set_xsave(&self, xsave: &XsaveState) -> Result<()>;
    fn get_xcrs(&self) -> Result<ExtendedControlRegs>;
    fn set_xcrs(&self, xcrs: &ExtendedControlRegs) -> Result<()>;
    /// Reads the given MSRs; the result holds those the hypervisor could read, in order.
    fn get_msrs(&self, indices: &[u32]) -> Result<Vec<MsrEntry>>;
    /// Writes MSRs; returns how many were written.
    fn set_msrs(&self, msrs: &[MsrEntry]) -> Result<usize>;
    fn get_lapic(&self) -> Result<LapicState>;
    fn set_lapic(&self, lapic: &LapicState) -> Result<()>;
    fn get_mp_state(&self) -> Result<MpState>;
    fn set_mp_state(&self, state: MpState) -> Result<()>;
    fn get_vcpu_events(&self) -> Result<VcpuEvents>;
    fn set_vcpu_events(&self, events: &VcpuEvents) -> Result<()>;
    fn get_cpuid(&self) -> Result<Vec<CpuIdEntry>>;
    fn set_cpuid(&self, entries: &[CpuIdEntry]) -> Result<()>;

    /// The whole state of the vCPU (it must be parked). `msr_indices` from
    /// [`Hypervisor::msr_index_list`].
    fn save_state(&self, msr_indices: &[u32]) -> Result<VcpuState> {
        Ok(VcpuState {
            id: self.id(),
            cpuid: self.get_cpuid()?,
            mp_state: self.get_mp_state()?,
            regs: self.get_regs()?,
            sregs: self.get_sregs()?,
            fpu_via_xsave: self.get_xsave()?,
            xcrs: self.get_xcrs()?,
            msrs: self.get_msrs(msr_indices)?,
            lapic: self.get_lapic()?,
            events: self.get_vcpu_events()?,
        })
    }

    /// Restores what [`HypervisorVcpu::save_state`] produced, in the order KVM needs.
    fn restore_state(&self, state: &VcpuState) -> Result<()> {
        self.set_cpuid(&state.cpuid)?;
        self.set_mp_state(state.mp_state)?;
        self.set_regs(&state.regs)?;
        self.set_sregs(&state.sregs)?;
        self.set_xsave(&state.fpu_via_xsave)?;
        self.set_xcrs(&state.xcrs)?;
        let n = self.set_msrs(&state.msrs)?;
        if n != state.msrs.len() {
            let failed = state.msrs.get(n).map(|m| m.index).unwrap_or_default();
            return Err(HypervisorError::Unsupported(format!(
                "restoring MSRs stopped at MSR {failed:#x} ({n} of {} restored)",
                state.msrs.len()
            )));
        }
        self.set_lapic(&state.lapic)?;
        self.set_vcpu_events(&state.events)?;
        Ok(())
    }
}

/// A shared hypervisor handle.
pub type SharedHypervisor = Arc<dyn Hypervisor>;
