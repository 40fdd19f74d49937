//! A test double of the hypervisor seam: records every call in order and plays a scripted
//! list of exits to the vCPU loop.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use vmm_sys_util::eventfd::EventFd;

use super::*;

/// A scripted exit (owned data; `run` lends it out like KVM's run area does).
#[derive(Debug, Clone)]
pub enum FakeExit {
    IoIn(u16, usize),
    IoOut(u16, Vec<u8>),
    MmioRead(u64, usize),
    MmioWrite(u64, Vec<u8>),
    /// The "hypervisor" panics (stands in for a bug on the vCPU thread).
    Panic,
    /// The guest runs without exits until kicked (`immediate_exit`), and stays on this
    /// entry: every later `run` spins again (a guest stuck on one instruction).
    Spin,
    /// `run` does not return, kicked or not, until the gate is released (a hypervisor
    /// stuck in the guest); then it returns as interrupted.
    Stuck(Arc<StuckGate>),
}

/// Holds a [`FakeExit::Stuck`] vCPU inside `run`.
#[derive(Debug, Default)]
pub struct StuckGate {
    /// Set when the vCPU is inside `run`.
    pub entered: AtomicBool,
    /// Set by the test to let it go.
    pub release: AtomicBool,
}

#[derive(Default)]
pub struct FakeLog {
    pub calls: Mutex<Vec<String>>,
    /// What the vCPU got back for each `IoIn`/`MmioRead`.
    pub reads: Mutex<Vec<Vec<u8>>>,
}

impl FakeLog {
    fn push(&self, s: impl Into<String>) {
        self.calls.lock().unwrap().push(s.into());
    }
}

pub struct FakeHypervisor {
    pub log: Arc<FakeLog>,
    pub exits: Mutex<VecDeque<FakeExit>>,
}

impl FakeHypervisor {
    pub fn new(exits: Vec<FakeExit>) -> Self {
        Self {
            log: Arc::default(),
            exits: Mutex::new(exits.into()),
        }
    }
}

impl Hypervisor for FakeHypervisor {
    fn create_vm(&self) -> Result<Box<dyn HypervisorVm>> {
        self.log.push("create_vm");
        Ok(Box::new(FakeVm {
            log: self.log.clone(),
            exits: Arc::new(Mutex::new(self.exits.lock().unwrap().drain(..).collect())),
        }))
    }
    fn max_vcpus(&self) -> usize {
        8
    }
    fn supported_cpuid(&self) -> Result<Vec<CpuIdEntry>> {
        Ok(vec![
            CpuIdEntry {
                function: 0,
                eax: 0xd,
                ebx: u32::from_le_bytes(*b"Auth"),
                edx: u32::from_le_bytes(*b"enti"),
                ecx: u32::from_le_bytes(*b"cAMD"),
                ..Default::default()
            },
            CpuIdEntry {
                function: 1,
                eax: 0x00a00f11,
                ecx: 0xffff_ffff,
                edx: 0xffff_ffff,
                ..Default::default()
            },
        ])
    }
    fn msr_index_list(&self) -> Result<Vec<u32>> {
        Ok(vec![0x10, 0x174])
    }
    fn check_extension(&self, cap: u32) -> bool {
        // Pretends to lack capability 9999 only.
        cap != 9999
    }
}

pub struct FakeVm {
    log: Arc<FakeLog>,
    exits: Arc<Mutex<VecDeque<FakeExit>>>,
}

impl HypervisorVm for FakeVm {
    unsafe fn set_memory_slot(&self, slot: MemorySlot) -> Result<()> {
        self.log.push(format!(
            "set_memory_slot {} {:#x}+{:#x} dirty={}",
            slot.slot, slot.guest_addr, slot.size, slot.log_dirty
        ));
        Ok(())
    }
    fn create_irqchip(&self) -> Result<()> {
        self.log.push("create_irqchip");
        Ok(())
    }
    fn create_pit2(&self) -> Result<()> {
        self.log.push("create_pit2");
        Ok(())
    }
    fn set_tss_address(&self, addr: u64) -> Result<()> {
        self.log.push(format!("set_tss_address {addr:#x}"));
        Ok(())
    }
    fn set_identity_map_address(&self, addr: u64) -> Result<()> {
        self.log.push(format!("set_identity_map_address {addr:#x}"));
        Ok(())
    }
    fn register_irqfd(&self, _fd: &EventFd, gsi: u32) -> Result<()> {
        self.log.push(format!("register_irqfd {gsi}"));
        Ok(())
    }
    fn unregister_irqfd(&self, _fd: &EventFd, gsi: u32) -> Result<()> {
        self.log.push(format!("unregister_irqfd {gsi}"));
        Ok(())
    }
    fn register_ioevent(&self, _: &EventFd, addr: IoEventAddr, m: IoEventMatch) -> Result<()> {
        self.log.push(format!("register_ioevent {addr:?} {m:?}"));
        Ok(())
    }
    fn unregister_ioevent(&self, _: &EventFd, addr: IoEventAddr, m: IoEventMatch) -> Result<()> {
        self.log.push(format!("unregister_ioevent {addr:?} {m:?}"));
        Ok(())
    }
    fn get_dirty_log(&self, _slot: u32, size: u64) -> Result<Vec<u64>> {
        Ok(vec![0; (size as usize / 4096).div_ceil(64)])
    }
    fn get_clock(&self) -> Result<ClockData> {
        Ok(ClockData::default())
    }
    fn set_clock(&self, _: &ClockData) -> Result<()> {
        Ok(())
    }
    fn get_irqchip(&self, chip_id: u32) -> Result<IrqChipState> {
        Ok(IrqChipState {
            chip_id,
            ..Default::default()
        })
    }
    fn set_irqchip(&self, _: &IrqChipState) -> Result<()> {
        Ok(())
    }
    fn get_pit2(&self) -> Result<PitState> {
        Ok(PitState::default())
    }
    fn set_pit2(&self, _: &PitState) -> Result<()> {
        Ok(())
    }
    fn create_vcpu(&self, id: u8) -> Result<Box<dyn HypervisorVcpu>> {
        self.log.push(format!("create_vcpu {id}"));
        Ok(Box::new(FakeVcpu {
            id,
            log: self.log.clone(),
            exits: self.exits.clone(),
            current: None,
            buf: vec![0; 8],
            immediate_exit: Box::new(0),
        }))
    }
}

pub struct FakeVcpu {
    id: u8,
    log: Arc<FakeLog>,
    exits: Arc<Mutex<VecDeque<FakeExit>>>,
    current: Option<FakeExit>,
    buf: Vec<u8>,
    immediate_exit: Box<u8>,
}

impl HypervisorVcpu for FakeVcpu {
    fn id(&self) -> u8 {
        self.id
    }
    fn run(&mut self) -> Result<VcpuExit<'_>> {
        // Hand what the VMM put in the buffer for the previous read to the "guest".
        if let Some(FakeExit::IoIn(_, n) | FakeExit::MmioRead(_, n)) = self.current.take() {
            self.log.reads.lock().unwrap().push(self.buf[..n].to_vec());
        }
        if *self.immediate_exit != 0 {
            return Ok(VcpuExit::Intr);
        }
        let head = self.exits.lock().unwrap().front().cloned();
        match head {
            Some(FakeExit::Spin) => {
                let flag = &*self.immediate_exit as *const u8;
                loop {
                    // SAFETY: the byte is owned by this vCPU and lives as long as it; the
                    // kick handler on this thread writes it, so it is read volatile.
                    if unsafe { std::ptr::read_volatile(flag) } != 0 {
                        return Ok(VcpuExit::Intr);
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
            Some(FakeExit::Stuck(gate)) => {
                gate.entered.store(true, Ordering::Release);
                while !gate.release.load(Ordering::Acquire) {
                    std::thread::sleep(Duration::from_millis(1));
                }
                self.exits.lock().unwrap().pop_front();
                return Ok(VcpuExit::Intr);
            }
            _ => {}
        }
        let Some(exit) = self.exits.lock().unwrap().pop_front() else {
            return Ok(VcpuExit::Shutdown);
        };
        self.current = Some(exit.clone());
        Ok(match exit {
            FakeExit::IoIn(port, n) => VcpuExit::IoIn(port, &mut self.buf[..n]),
            FakeExit::IoOut(port, data) => {
                self.buf[..data.len()].copy_from_slice(&data);
                VcpuExit::IoOut(port, &self.buf[..data.len()])
            }
            FakeExit::MmioRead(addr, n) => VcpuExit::MmioRead(addr, &mut self.buf[..n]),
            FakeExit::MmioWrite(addr, data) => {
                self.buf[..data.len()].copy_from_slice(&data);
                VcpuExit::MmioWrite(addr, &self.buf[..data.len()])
            }
            FakeExit::Panic => panic!("scripted panic"),
            FakeExit::Spin | FakeExit::Stuck(_) => unreachable!("handled above"),
        })
    }
    fn immediate_exit_flag(&mut self) -> *mut u8 {
        &mut *self.immediate_exit as *mut u8
    }
    fn set_immediate_exit(&mut self, on: bool) {
        *self.immediate_exit = u8::from(on);
    }
    fn get_regs(&self) -> Result<Regs> {
        Ok(Regs::default())
    }
    fn translate(&self, gva: u64) -> Result<Option<u64>> {
        // Identity: the fake guest does not page.
        Ok(Some(gva))
    }
    fn set_regs(&self, regs: &Regs) -> Result<()> {
        self.log
            .push(format!("vcpu{} set_regs rip={:#x}", self.id, regs.rip));
        Ok(())
    }
    fn get_sregs(&self) -> Result<SpecialRegs> {
        Ok(SpecialRegs::default())
    }
    fn set_sregs(&self, _: &SpecialRegs) -> Result<()> {
        self.log.push(format!("vcpu{} set_sregs", self.id));
        Ok(())
    }
    fn get_fpu(&self) -> Result<FpuState> {
        Ok(FpuState::default())
    }
    fn set_fpu(&self, _: &FpuState) -> Result<()> {
        self.log.push(format!("vcpu{} set_fpu", self.id));
        Ok(())
    }
    fn get_xsave(&self) -> Result<XsaveState> {
        Ok(XsaveState::default())
    }
    fn set_xsave(&self, _: &XsaveState) -> Result<()> {
        Ok(())
    }
    fn get_xcrs(&self) -> Result<ExtendedControlRegs> {
        Ok(ExtendedControlRegs::default())
    }
    fn set_xcrs(&self, _: &ExtendedControlRegs) -> Result<()> {
        Ok(())
    }
    fn get_msrs(&self, indices: &[u32]) -> Result<Vec<MsrEntry>> {
        // Every MSR reads as all ones.
        Ok(indices
            .iter()
            .map(|&index| MsrEntry {
                index,
                data: u64::MAX,
                ..Default::default()
            })
            .collect())
    }
    fn set_msrs(&self, msrs: &[MsrEntry]) -> Result<usize> {
        let list: Vec<String> = msrs
            .iter()
            .map(|m| format!("{:#x}={:#x}", m.index, m.data))
            .collect();
        self.log.push(format!(
            "vcpu{} set_msrs {} {}",
            self.id,
            msrs.len(),
            list.join(",")
        ));
        Ok(msrs.len())
    }
    fn get_lapic(&self) -> Result<LapicState> {
        Ok(LapicState::default())
    }
    fn set_lapic(&self, _: &LapicState) -> Result<()> {
        self.log.push(format!("vcpu{} set_lapic", self.id));
        Ok(())
    }
    fn get_mp_state(&self) -> Result<MpState> {
        Ok(MpState::default())
    }
    fn set_mp_state(&self, _: MpState) -> Result<()> {
        Ok(())
    }
    fn get_vcpu_events(&self) -> Result<VcpuEvents> {
        Ok(VcpuEvents::default())
    }
    fn set_vcpu_events(&self, _: &VcpuEvents) -> Result<()> {
        Ok(())
    }
    fn get_cpuid(&self) -> Result<Vec<CpuIdEntry>> {
        Ok(Vec::new())
    }
    fn set_cpuid(&self, entries: &[CpuIdEntry]) -> Result<()> {
        self.log
            .push(format!("vcpu{} set_cpuid {}", self.id, entries.len()));
        Ok(())
    }
}
