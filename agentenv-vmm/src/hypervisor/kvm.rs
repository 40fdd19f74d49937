//! The hypervisor seam over KVM (kvm-ioctls).

use kvm_bindings::{
    CpuId, KVM_MAX_CPUID_ENTRIES, KVM_MEM_LOG_DIRTY_PAGES, KVM_PIT_SPEAKER_DUMMY, Msrs,
    kvm_pit_config, kvm_userspace_memory_region,
};
use std::sync::OnceLock;

use kvm_ioctls::{Kvm, VcpuFd, VmFd};
use vmm_sys_util::eventfd::EventFd;

use super::{
    ClockData, CpuIdEntry, ExtendedControlRegs, FpuState, Hypervisor, HypervisorError,
    HypervisorVcpu, HypervisorVm, IoEventAddr, IoEventMatch, IrqChipState, LapicState, MemorySlot,
    MpState, MsrEntry, PitState, Regs, Result, SpecialRegs, VcpuEvents, VcpuExit, XsaveState,
};

const MAX_MSRS_PER_CALL: usize = kvm_bindings::KVM_MAX_MSR_ENTRIES;

/// Turns a failed kvm-ioctls call into a [`HypervisorError`] naming the ioctl, so every
/// wrapper below is the call and its name.
trait Ioctl<T> {
    fn ioctl(self, op: &'static str) -> Result<T>;
}

impl<T> Ioctl<T> for std::result::Result<T, kvm_ioctls::Error> {
    fn ioctl(self, op: &'static str) -> Result<T> {
        self.map_err(|e| HypervisorError::ioctl(op, e))
    }
}

/// KVM through `/dev/kvm`.
pub struct KvmHypervisor {
    kvm: Kvm,
}

impl KvmHypervisor {
    pub fn new() -> Result<Self> {
        let kvm = Kvm::new().map_err(|e| HypervisorError::Open {
            path: "/dev/kvm".into(),
            source: e.into(),
        })?;
        let version = kvm.get_api_version();
        if version != 12 {
            return Err(HypervisorError::Unsupported(format!(
                "KVM API version {version}, expected 12"
            )));
        }
        Ok(Self { kvm })
    }

    /// Whether `/dev/kvm` is served by the PVM module (guest kernel mode is emulated there).
    pub fn is_pvm() -> bool {
        std::path::Path::new("/sys/module/kvm_pvm").exists()
    }
}

/// A property of the host, asked of KVM once per process and kept in `cache`.
fn once_per_process<T: Clone>(
    cache: &'static OnceLock<T>,
    ask: impl FnOnce() -> Result<T>,
) -> Result<T> {
    if let Some(v) = cache.get() {
        return Ok(v.clone());
    }
    let v = ask()?;
    Ok(cache.get_or_init(|| v).clone())
}

impl Hypervisor for KvmHypervisor {
    fn create_vm(&self) -> Result<Box<dyn HypervisorVm>> {
        let vm = self.kvm.create_vm().ioctl("KVM_CREATE_VM")?;
        Ok(Box::new(KvmVm { vm }))
    }

    fn max_vcpus(&self) -> usize {
        self.kvm.get_max_vcpus()
    }

    fn supported_cpuid(&self) -> Result<Vec<CpuIdEntry>> {
        static CACHE: OnceLock<Vec<CpuIdEntry>> = OnceLock::new();
        once_per_process(&CACHE, || {
            let cpuid = self
                .kvm
                .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
                .ioctl("KVM_GET_SUPPORTED_CPUID")?;
            Ok(cpuid.as_slice().to_vec())
        })
    }

    fn check_extension(&self, cap: u32) -> bool {
        self.kvm.check_extension_raw(libc::c_ulong::from(cap)) > 0
    }

    fn msr_index_list(&self) -> Result<Vec<u32>> {
        static CACHE: OnceLock<Vec<u32>> = OnceLock::new();
        once_per_process(&CACHE, || {
            let list = self
                .kvm
                .get_msr_index_list()
                .ioctl("KVM_GET_MSR_INDEX_LIST")?;
            Ok(list.as_slice().to_vec())
        })
    }
}

/// A KVM VM.
pub struct KvmVm {
    vm: VmFd,
}

impl KvmVm {
    /// Assigns (`assign`) or deassigns an ioeventfd. KVM tells "any value" from "this
    /// value" by the datamatch's type (`NoDatamatch` has no size), hence the two calls.
    fn ioevent(
        &self,
        assign: bool,
        fd: &EventFd,
        addr: IoEventAddr,
        datamatch: IoEventMatch,
    ) -> Result<()> {
        let addr = match addr {
            IoEventAddr::Pio(a) => kvm_ioctls::IoEventAddress::Pio(a),
            IoEventAddr::Mmio(a) => kvm_ioctls::IoEventAddress::Mmio(a),
        };
        match datamatch {
            IoEventMatch::Any => self.ioevent_with(assign, fd, &addr, kvm_ioctls::NoDatamatch),
            IoEventMatch::U32(v) => self.ioevent_with(assign, fd, &addr, v),
        }
    }

    fn ioevent_with<T: Into<u64>>(
        &self,
        assign: bool,
        fd: &EventFd,
        addr: &kvm_ioctls::IoEventAddress,
        datamatch: T,
    ) -> Result<()> {
        if assign {
            self.vm
                .register_ioevent(fd, addr, datamatch)
                .ioctl("KVM_IOEVENTFD")
        } else {
            self.vm
                .unregister_ioevent(fd, addr, datamatch)
                .ioctl("KVM_IOEVENTFD (deassign)")
        }
    }
}

impl HypervisorVm for KvmVm {
    unsafe fn set_memory_slot(&self, slot: MemorySlot) -> Result<()> {
        let region = kvm_userspace_memory_region {
            slot: slot.slot,
            flags: if slot.log_dirty {
                KVM_MEM_LOG_DIRTY_PAGES
            } else {
                0
            },
            guest_phys_addr: slot.guest_addr,
            memory_size: slot.size,
            userspace_addr: slot.host_addr,
        };
        // SAFETY: the caller guarantees the host range stays mapped for the slot's life.
        unsafe { self.vm.set_user_memory_region(region) }.ioctl("KVM_SET_USER_MEMORY_REGION")
    }

    fn create_irqchip(&self) -> Result<()> {
        self.vm.create_irq_chip().ioctl("KVM_CREATE_IRQCHIP")
    }

    fn create_pit2(&self) -> Result<()> {
        let config = kvm_pit_config {
            flags: KVM_PIT_SPEAKER_DUMMY,
            ..Default::default()
        };
        self.vm.create_pit2(config).ioctl("KVM_CREATE_PIT2")
    }

    fn set_tss_address(&self, addr: u64) -> Result<()> {
        self.vm
            .set_tss_address(addr as usize)
            .ioctl("KVM_SET_TSS_ADDR")
    }

    fn set_identity_map_address(&self, addr: u64) -> Result<()> {
        self.vm
            .set_identity_map_address(addr)
            .ioctl("KVM_SET_IDENTITY_MAP_ADDR")
    }

    fn register_irqfd(&self, fd: &EventFd, gsi: u32) -> Result<()> {
        self.vm.register_irqfd(fd, gsi).ioctl("KVM_IRQFD")
    }

    fn unregister_irqfd(&self, fd: &EventFd, gsi: u32) -> Result<()> {
        self.vm
            .unregister_irqfd(fd, gsi)
            .ioctl("KVM_IRQFD (deassign)")
    }

    fn register_ioevent(
        &self,
        fd: &EventFd,
        addr: IoEventAddr,
        datamatch: IoEventMatch,
    ) -> Result<()> {
        self.ioevent(true, fd, addr, datamatch)
    }

    fn unregister_ioevent(
        &self,
        fd: &EventFd,
        addr: IoEventAddr,
        datamatch: IoEventMatch,
    ) -> Result<()> {
        self.ioevent(false, fd, addr, datamatch)
    }

    fn get_dirty_log(&self, slot: u32, size: u64) -> Result<Vec<u64>> {
        self.vm
            .get_dirty_log(slot, size as usize)
            .ioctl("KVM_GET_DIRTY_LOG")
    }

    fn get_clock(&self) -> Result<ClockData> {
        self.vm.get_clock().ioctl("KVM_GET_CLOCK")
    }

    fn set_clock(&self, clock: &ClockData) -> Result<()> {
        self.vm.set_clock(clock).ioctl("KVM_SET_CLOCK")
    }

    fn get_irqchip(&self, chip_id: u32) -> Result<IrqChipState> {
        let mut chip = IrqChipState {
            chip_id,
            ..Default::default()
        };
        self.vm.get_irqchip(&mut chip).ioctl("KVM_GET_IRQCHIP")?;
        Ok(chip)
    }

    fn set_irqchip(&self, state: &IrqChipState) -> Result<()> {
        self.vm.set_irqchip(state).ioctl("KVM_SET_IRQCHIP")
    }

    fn get_pit2(&self) -> Result<PitState> {
        self.vm.get_pit2().ioctl("KVM_GET_PIT2")
    }

    fn set_pit2(&self, state: &PitState) -> Result<()> {
        self.vm.set_pit2(state).ioctl("KVM_SET_PIT2")
    }

    fn create_vcpu(&self, id: u8) -> Result<Box<dyn HypervisorVcpu>> {
        let vcpu = self
            .vm
            .create_vcpu(u64::from(id))
            .ioctl("KVM_CREATE_VCPU")?;
        Ok(Box::new(KvmVcpu { id, vcpu }))
    }
}

/// A KVM vCPU.
pub struct KvmVcpu {
    id: u8,
    vcpu: VcpuFd,
}

impl HypervisorVcpu for KvmVcpu {
    fn id(&self) -> u8 {
        self.id
    }

    fn run(&mut self) -> Result<VcpuExit<'_>> {
        use kvm_ioctls::VcpuExit as K;
        match self.vcpu.run() {
            Ok(exit) => Ok(match exit {
                K::IoIn(port, data) => VcpuExit::IoIn(port, data),
                K::IoOut(port, data) => VcpuExit::IoOut(port, data),
                K::MmioRead(addr, data) => VcpuExit::MmioRead(addr, data),
                K::MmioWrite(addr, data) => VcpuExit::MmioWrite(addr, data),
                K::Shutdown => VcpuExit::Shutdown,
                K::Hlt => VcpuExit::Hlt,
                K::Intr => VcpuExit::Intr,
                K::SystemEvent(kind, _) => VcpuExit::SystemEvent(kind),
                K::FailEntry(reason, _) => VcpuExit::FailEntry(reason),
                K::InternalError => VcpuExit::InternalError,
                K::Unsupported(n) => VcpuExit::Unknown(n),
                _ => VcpuExit::Unknown(u32::MAX),
            }),
            Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => Ok(VcpuExit::Intr),
            Err(e) => Err(HypervisorError::ioctl("KVM_RUN", e)),
        }
    }

    fn immediate_exit_flag(&mut self) -> *mut u8 {
        &mut self.vcpu.get_kvm_run().immediate_exit as *mut u8
    }

    fn set_immediate_exit(&mut self, on: bool) {
        self.vcpu.set_kvm_immediate_exit(u8::from(on));
    }

    fn get_regs(&self) -> Result<Regs> {
        self.vcpu.get_regs().ioctl("KVM_GET_REGS")
    }

    fn set_regs(&self, regs: &Regs) -> Result<()> {
        self.vcpu.set_regs(regs).ioctl("KVM_SET_REGS")
    }

    fn translate(&self, gva: u64) -> Result<Option<u64>> {
        let t = self.vcpu.translate_gva(gva).ioctl("KVM_TRANSLATE")?;
        Ok((t.valid != 0).then_some(t.physical_address))
    }

    fn get_sregs(&self) -> Result<SpecialRegs> {
        self.vcpu.get_sregs().ioctl("KVM_GET_SREGS")
    }

    fn set_sregs(&self, sregs: &SpecialRegs) -> Result<()> {
        self.vcpu.set_sregs(sregs).ioctl("KVM_SET_SREGS")
    }

    fn get_fpu(&self) -> Result<FpuState> {
        self.vcpu.get_fpu().ioctl("KVM_GET_FPU")
    }

    fn set_fpu(&self, fpu: &FpuState) -> Result<()> {
        self.vcpu.set_fpu(fpu).ioctl("KVM_SET_FPU")
    }

    fn get_xsave(&self) -> Result<XsaveState> {
        self.vcpu.get_xsave().ioctl("KVM_GET_XSAVE")
    }

    fn set_xsave(&self, xsave: &XsaveState) -> Result<()> {
        // SAFETY: `xsave` is a whole `kvm_xsave` (4 KiB); no extended XSAVE features are
        // enabled in this process with arch_prctl, so KVM reads no more than that.
        unsafe { self.vcpu.set_xsave(xsave) }.ioctl("KVM_SET_XSAVE")
    }

    fn get_xcrs(&self) -> Result<ExtendedControlRegs> {
        self.vcpu.get_xcrs().ioctl("KVM_GET_XCRS")
    }

    fn set_xcrs(&self, xcrs: &ExtendedControlRegs) -> Result<()> {
        self.vcpu.set_xcrs(xcrs).ioctl("KVM_SET_XCRS")
    }

    fn get_msrs(&self, indices: &[u32]) -> Result<Vec<MsrEntry>> {
        let mut out = Vec::with_capacity(indices.len());
        for chunk in indices.chunks(MAX_MSRS_PER_CALL) {
            let entries: Vec<MsrEntry> = chunk
                .iter()
                .map(|&index| MsrEntry {
                    index,
                    ..Default::default()
                })
                .collect();
            let mut msrs = Msrs::from_entries(&entries)
                .map_err(|e| HypervisorError::Unsupported(format!("MSR list: {e:?}")))?;
            let n = self.vcpu.get_msrs(&mut msrs).ioctl("KVM_GET_MSRS")?;
            out.extend_from_slice(&msrs.as_slice()[..n]);
            if n < chunk.len() {
                break;
            }
        }
        Ok(out)
    }

    fn set_msrs(&self, msrs: &[MsrEntry]) -> Result<usize> {
        let mut total = 0;
        for chunk in msrs.chunks(MAX_MSRS_PER_CALL) {
            let list = Msrs::from_entries(chunk)
                .map_err(|e| HypervisorError::Unsupported(format!("MSR list: {e:?}")))?;
            let n = self.vcpu.set_msrs(&list).ioctl("KVM_SET_MSRS")?;
            total += n;
            if n < chunk.len() {
                break;
            }
        }
        Ok(total)
    }

    fn get_lapic(&self) -> Result<LapicState> {
        self.vcpu.get_lapic().ioctl("KVM_GET_LAPIC")
    }

    fn set_lapic(&self, lapic: &LapicState) -> Result<()> {
        self.vcpu.set_lapic(lapic).ioctl("KVM_SET_LAPIC")
    }

    fn get_mp_state(&self) -> Result<MpState> {
        self.vcpu.get_mp_state().ioctl("KVM_GET_MP_STATE")
    }

    fn set_mp_state(&self, state: MpState) -> Result<()> {
        self.vcpu.set_mp_state(state).ioctl("KVM_SET_MP_STATE")
    }

    fn get_vcpu_events(&self) -> Result<VcpuEvents> {
        self.vcpu.get_vcpu_events().ioctl("KVM_GET_VCPU_EVENTS")
    }

    fn set_vcpu_events(&self, events: &VcpuEvents) -> Result<()> {
        self.vcpu
            .set_vcpu_events(events)
            .ioctl("KVM_SET_VCPU_EVENTS")
    }

    fn get_cpuid(&self) -> Result<Vec<CpuIdEntry>> {
        let cpuid = self
            .vcpu
            .get_cpuid2(KVM_MAX_CPUID_ENTRIES)
            .ioctl("KVM_GET_CPUID2")?;
        Ok(cpuid.as_slice().to_vec())
    }

    fn set_cpuid(&self, entries: &[CpuIdEntry]) -> Result<()> {
        let cpuid = CpuId::from_entries(entries)
            .map_err(|e| HypervisorError::Unsupported(format!("CPUID table: {e:?}")))?;
        self.vcpu.set_cpuid2(&cpuid).ioctl("KVM_SET_CPUID2")
    }
}
