//! The vCPU threads and their protocol with the controller.
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

use std::cell::Cell;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Once};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use vmm_sys_util::signal::{Killable, register_signal_handler};

use super::{Counters, ExitReason, ExitState, PAUSE_TIMEOUT, Vm, VmError};
use crate::arch;
use crate::config::WatchdogConfig;
use crate::devices::Bus;
use crate::hypervisor::{HypervisorVcpu, HypervisorVm, Regs, VcpuExit};
use crate::memory::GuestMemoryMmap;
use crate::sync::{lock, wait, wait_timeout};
use crate::watchdog::{self, Progress, Watchdog};

/// The signal that kicks a vCPU thread out of the guest (`SIGRTMIN + 1`).
pub fn vcpu_kick_signal() -> libc::c_int {
    vmm_sys_util::signal::SIGRTMIN() + VCPU_KICK_SIGNAL
}
/// Offset of the kick signal from `SIGRTMIN`.
pub const VCPU_KICK_SIGNAL: libc::c_int = 1;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Want {
    Run,
    Pause,
    Stop,
}

pub(super) struct Ctl {
    want: Want,
    parked: usize,
    alive: usize,
    /// Per vCPU: its thread was started and has not ended.
    pub(super) running: Vec<bool>,
}

/// Threads that may be kicked; `joined` is set before any is joined, so a kick never
/// reaches a joined thread.
struct Kicker {
    threads: Vec<JoinHandle<()>>,
    joined: bool,
}

/// What the vCPU threads share with the controller (the [`Vm`]).
pub(super) struct Shared {
    pub(super) hv_vm: Box<dyn HypervisorVm>,
    pub(super) mem: GuestMemoryMmap,
    pio: Bus,
    mmio: Bus,
    pub(super) exit: Arc<ExitState>,
    ctl: Mutex<Ctl>,
    ctl_cv: Condvar,
    kicker: Mutex<Kicker>,
    pub(super) vcpus: Vec<Arc<Mutex<Box<dyn HypervisorVcpu>>>>,
    pub(super) counters: Counters,
    pub(super) watchdog: Watchdog,
}

/// What [`Shared::new`] takes: the VM's parts the vCPU threads use.
pub(super) struct VcpuParts {
    pub hv_vm: Box<dyn HypervisorVm>,
    pub mem: GuestMemoryMmap,
    pub pio: Bus,
    pub mmio: Bus,
    pub exit: Arc<ExitState>,
    pub vcpus: Vec<Box<dyn HypervisorVcpu>>,
}

impl Shared {
    /// The vCPUs of a VM, not started yet; they will start parked when `parked` (a
    /// restored VM runs on `resume`).
    pub(super) fn new(parts: VcpuParts, watchdog: &WatchdogConfig, parked: bool) -> Self {
        let n = parts.vcpus.len();
        Shared {
            hv_vm: parts.hv_vm,
            mem: parts.mem,
            pio: parts.pio,
            mmio: parts.mmio,
            exit: parts.exit,
            ctl: Mutex::new(Ctl {
                want: if parked { Want::Pause } else { Want::Run },
                parked: 0,
                alive: 0,
                running: vec![false; n],
            }),
            ctl_cv: Condvar::new(),
            kicker: Mutex::new(Kicker {
                threads: Vec::with_capacity(n),
                joined: false,
            }),
            vcpus: parts
                .vcpus
                .into_iter()
                .map(|v| Arc::new(Mutex::new(v)))
                .collect(),
            counters: Counters::default(),
            watchdog: Watchdog::new(n, watchdog.period(), watchdog.timeout()),
        }
    }

    pub(super) fn ctl(&self) -> MutexGuard<'_, Ctl> {
        lock(&self.ctl)
    }

    /// Whether the VM was told to stop (by `stop`, the guest's end, or the watchdog).
    pub(super) fn is_stopping(&self) -> bool {
        self.ctl().want == Want::Stop
    }

    /// Tells every vCPU what to do next; a VM that is stopping stays stopping.
    fn request(&self, want: Want) {
        {
            let mut ctl = self.ctl();
            if ctl.want == Want::Stop {
                return;
            }
            ctl.want = want;
            self.ctl_cv.notify_all();
        }
        if want != Want::Run {
            self.kick_all();
        }
    }

    /// Kicks every vCPU thread out of the guest.
    fn kick_all(&self) {
        // Recorded first: a vCPU still in the same `KVM_RUN` after the watchdog's timeout
        // did not come back from this kick.
        self.watchdog.note_kicks();
        let k = lock(&self.kicker);
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
        let k = lock(&self.kicker);
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

    /// Asks every vCPU to stop (they still have to be kicked out of the guest).
    fn ask_stop(&self) {
        let mut ctl = self.ctl();
        ctl.want = Want::Stop;
        self.ctl_cv.notify_all();
    }

    /// Ends the VM with `reason` (unless it has one) and tells every vCPU to stop. The
    /// stop is asked first, so whoever sees the reason also finds the VM stopping (and
    /// `pause` refuses it).
    fn stop_with(&self, reason: ExitReason) {
        self.ask_stop();
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

/// The controller's side of the protocol.
impl Vm {
    pub(super) fn spawn_vcpus(&self) -> Result<(), VmError> {
        let mut started = lock(&self.started);
        if *started {
            return Err(VmError::State("already started"));
        }
        if self.stopped {
            return Err(VmError::State("stopped"));
        }
        let mut kicker = lock(&self.shared.kicker);
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
                    return Err(self.start_failed(format!("vCPU thread {idx}"), e));
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
                *lock(&self.watchdog_thread) = Some(h);
                Ok(())
            }
            Err(e) => Err(self.start_failed("the vCPU watchdog thread".into(), e)),
        }
    }

    /// Starting `what` failed: the VM ends with that error.
    fn start_failed(&self, what: String, e: std::io::Error) -> VmError {
        self.shared
            .exit
            .set(ExitReason::Error(format!("starting {what} failed: {e}")));
        self.shared.request(Want::Stop);
        VmError::Thread(e)
    }

    /// Parks every vCPU and waits until each acknowledged.
    pub(super) fn park_vcpus(&self) -> Result<(), VmError> {
        if !*lock(&self.started) {
            return Err(VmError::State("not started"));
        }
        if self.shared.is_stopping() {
            return Err(VmError::State("stopped"));
        }
        let shared = &self.shared;
        shared.request(Want::Pause);
        let deadline = Instant::now() + PAUSE_TIMEOUT;
        let mut ctl = shared.ctl();
        while ctl.parked < ctl.alive {
            if let Some(e) = shared.stuck_error() {
                return Err(e);
            }
            let now = Instant::now();
            if now >= deadline {
                drop(ctl);
                shared.request(Want::Run);
                return Err(VmError::PauseTimeout(PAUSE_TIMEOUT));
            }
            // Re-kick now and then: a thread between its state check and `KVM_RUN`
            // sees `immediate_exit`, but one still starting up may not have set it yet.
            let pause = (deadline - now).min(Duration::from_millis(20));
            let (c, timeout) = wait_timeout(&shared.ctl_cv, ctl, pause);
            ctl = c;
            if timeout.timed_out() && ctl.parked < ctl.alive {
                drop(ctl);
                shared.kick_all();
                ctl = shared.ctl();
            }
        }
        Ok(())
    }

    /// Lets the vCPUs run (starts their threads for a restored VM).
    pub(super) fn unpark_vcpus(&self) -> Result<(), VmError> {
        self.shared.request(Want::Run);
        let started = *lock(&self.started);
        if !started {
            self.spawn_vcpus()?;
        }
        Ok(())
    }

    /// Whether no vCPU runs: all parked, or not started.
    pub(super) fn is_parked(&self) -> bool {
        let started = *lock(&self.started);
        let ctl = self.shared.ctl();
        !started || (ctl.want == Want::Pause && ctl.parked == ctl.alive)
    }

    /// Stops the vCPU threads and the watchdog, and joins them (but a thread the
    /// watchdog gave up).
    pub(super) fn stop_vcpus(&mut self) -> Result<(), VmError> {
        let shared = &self.shared;
        shared.stop_with(ExitReason::Stopped);
        // Wait until every thread left its loop (so none is in KVM_RUN) or was given up by
        // the watchdog (which does so a timeout after the kick above), then join.
        let limit = PAUSE_TIMEOUT + shared.watchdog.timeout();
        let deadline = Instant::now() + limit;
        let waiting = |ctl: &Ctl| {
            ctl.running
                .iter()
                .enumerate()
                .any(|(i, &r)| r && !shared.watchdog.is_stuck(i))
        };
        loop {
            let ctl = shared.ctl();
            if !waiting(&ctl) {
                break;
            }
            if Instant::now() >= deadline {
                return Err(VmError::PauseTimeout(limit));
            }
            let _ = wait_timeout(&shared.ctl_cv, ctl, Duration::from_millis(10));
            shared.kick_all();
        }
        shared.watchdog.shutdown();
        if let Some(t) = lock(&self.watchdog_thread).take() {
            let _ = t.join();
        }
        let threads = {
            let mut k = lock(&shared.kicker);
            k.joined = true;
            std::mem::take(&mut k.threads)
        };
        for (idx, t) in threads.into_iter().enumerate() {
            if shared.watchdog.is_stuck(idx) && !t.is_finished() {
                tracing::warn!(
                    vcpu = idx,
                    "vCPU thread left behind inside KVM_RUN; it ends when the hypervisor lets it go"
                );
                continue;
            }
            let _ = t.join();
        }
        Ok(())
    }
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

/// Installs the kick signal's handler (once per process).
pub(super) fn install_kick_handler() -> Result<(), VmError> {
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
        let mut v = lock(&vcpu_lock);
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
                            ctl = wait(&shared.ctl_cv, ctl);
                        }
                        ctl.parked -= 1;
                    }
                    Want::Stop => return,
                }
            }
        }
        let burst = run_burst(lock(&vcpu_lock).as_mut(), shared, idx, &mut progress);
        if let Burst::Exit = burst {
            // The guest ended: every vCPU stops; `stop`/`wait` collect the reason.
            shared.ask_stop();
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
    use std::path::Path;

    use super::*;
    use crate::config::VmConfig;
    use crate::hypervisor::fake::{FakeExit, FakeHypervisor, StuckGate};
    use crate::vm::builder::Boot;
    use crate::vm::default_devices;
    use crate::vm::test_util::tiny_elf;

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
}
