//! The vCPU watchdog: notices a vCPU that the host's hypervisor does not give back, and
//! has the VM stopped with a clear error instead of hanging.
//!
//! ## Why
//! On the development machines `/dev/kvm` is `kvm_pvm`, a private PVM variant that never
//! completes a guest `VMMCALL` (or `VMCALL`) at CPL0: `KVM_RUN` spins in the host kernel
//! (the vCPU thread at 100 % system time), the guest's `rip` stays on the instruction and
//! the VMM sees no exit, so the guest hangs forever. (Before spinning, KVM rewrites the
//! guest's `VMMCALL` into `VMCALL` in guest memory, as it does for the other CPU vendor's
//! hypercall instruction.) Measured there (host kernel 6.18, `kvm_pvm` with
//! `pvm_native=Y`): the kick signal still ends that `KVM_RUN` (200 kicks, each back within
//! 7 ms; the thread re-enters and spins again), and so do SIGKILL and `exit_group`; nothing
//! is left behind. A hypervisor bug of the other kind, a `KVM_RUN` that does not come back
//! when kicked, would hang `pause` and `stop` as well.
//!
//! ## What a healthy VM pays
//! Each vCPU thread bumps a run sequence number when it enters `KVM_RUN` and when it
//! returns (odd: inside): two atomic adds per exit. The watchdog thread wakes once per
//! period (and at the deadlines below). A vCPU that has been inside one `KVM_RUN` for a
//! whole period is kicked once, so a guest that computes without exits gets one extra
//! exit and one `KVM_GET_REGS` per period; parked vCPUs (pause, snapshot) are outside
//! `KVM_RUN` and are never kicked.
//!
//! ## The two rules
//! 1. **Kicked and not back.** A vCPU still inside the same `KVM_RUN` `timeout` after it
//!    was kicked (by the watchdog, or by `pause`/`stop`) is stuck in the host. Staying in
//!    `KVM_RUN` for long is not (a busy guest computes without exits, an idle one halts in
//!    the in-kernel irqchip); not coming back from a kick is. The VM ends with
//!    [`ExitReason::Error`](crate::exit::ExitReason) naming the vCPU, and the stuck thread
//!    is abandoned: it keeps its references to the VM's memory and file descriptors, and
//!    `stop` returns without joining it.
//! 2. **Stuck on a hypercall.** The watchdog's kick also asks the vCPU thread to look at
//!    its vCPU once it is back. Registers (`rip`, `rflags`, every general register) that
//!    are the same at [`MIN_STALL_SAMPLES`] samples in a row, spanning at least `timeout`
//!    with no exit in between, on a `VMMCALL` or `VMCALL` instruction, mean the host does
//!    not complete the hypercall (rule 1 never fires for kvm_pvm's, since kicks work): the
//!    VM ends with an error naming the vCPU, the instruction and `rip`. A halted idle
//!    guest or a `jmp $` loop also keeps its registers, is not on a hypercall, and is left
//!    alone. Where the host completes hypercalls, `rip` moves past the instruction; only a
//!    guest looping on a hypercall with the very same registers, and caught on it at every
//!    sample, could look stuck.
//!
//! The timings come from [`WatchdogConfig`](crate::config::WatchdogConfig) (period 1 s,
//! timeout 2 s by default): a vCPU stuck in the host is noticed within about two periods
//! plus the timeout, one stuck on a hypercall within about one period plus the longer of
//! the timeout and two periods (3 s with the defaults, measured).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::hypervisor::Regs;
use crate::sync::{lock, wait_timeout};

/// Samples with unchanged registers on a hypercall before rule 2 stops the VM.
pub const MIN_STALL_SAMPLES: u32 = 3;

/// What one vCPU thread publishes.
#[derive(Default)]
struct VcpuWatch {
    /// Bumped on entering `KVM_RUN` and on returning: odd while inside.
    seq: AtomicU64,
    /// Set by the watchdog before its kick: look at the registers once back.
    probe: AtomicBool,
    /// Rule 1 found the vCPU stuck in the host; its thread is abandoned.
    stuck: AtomicBool,
}

/// What the watchdog knows about one vCPU's current run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Track {
    /// The run sequence number last seen.
    seq: u64,
    /// Since when the vCPU is known to be inside this run (`None`: outside `KVM_RUN`).
    since: Option<Instant>,
    /// When this run was kicked.
    kicked: Option<Instant>,
}

struct State {
    tracks: Vec<Track>,
    shutdown: bool,
}

/// What one look at the vCPUs found.
#[derive(Debug, PartialEq, Eq)]
struct Step {
    /// vCPUs to kick (their kick is recorded).
    kick: Vec<usize>,
    /// vCPUs still inside the run they were kicked in, `timeout` after the kick.
    stuck: Vec<usize>,
    /// When to look again.
    next: Instant,
}

/// One look at the vCPUs: `seqs[i]` is vCPU `i`'s run sequence number now, `stuck[i]`
/// whether it was given up already.
fn step(
    tracks: &mut [Track],
    seqs: &[u64],
    stuck: &[bool],
    now: Instant,
    period: Duration,
    timeout: Duration,
) -> Step {
    let mut out = Step {
        kick: Vec::new(),
        stuck: Vec::new(),
        next: now + period,
    };
    for (i, t) in tracks.iter_mut().enumerate() {
        if stuck[i] {
            continue;
        }
        let seq = seqs[i];
        if seq != t.seq {
            // Another run (or outside `KVM_RUN`). A run that began after a kick began no
            // earlier than the kick; otherwise it is known from now on.
            let from = t.kicked.unwrap_or(now);
            *t = Track {
                seq,
                since: (seq % 2 == 1).then_some(from),
                kicked: None,
            };
        }
        let Some(since) = t.since else {
            continue;
        };
        match t.kicked {
            Some(k) if now >= k + timeout => out.stuck.push(i),
            Some(k) => out.next = out.next.min(k + timeout),
            None if now >= since + period => {
                t.kicked = Some(now);
                out.kick.push(i);
                out.next = out.next.min(now + timeout);
            }
            None => out.next = out.next.min(since + period),
        }
    }
    out
}

/// The watchdog of one VM's vCPUs: the per-vCPU counters the vCPU threads publish and the
/// state of the watchdog thread ([`Watchdog::run`]).
pub struct Watchdog {
    period: Duration,
    timeout: Duration,
    vcpus: Box<[VcpuWatch]>,
    state: Mutex<State>,
    cv: Condvar,
}

impl Watchdog {
    /// A watchdog for `vcpus` vCPUs.
    pub fn new(vcpus: usize, period: Duration, timeout: Duration) -> Self {
        Self {
            period,
            timeout,
            vcpus: (0..vcpus).map(|_| VcpuWatch::default()).collect(),
            state: Mutex::new(State {
                tracks: vec![Track::default(); vcpus],
                shutdown: false,
            }),
            cv: Condvar::new(),
        }
    }

    /// How long a kicked vCPU may take to come back (and a hypercall to make progress).
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    fn state(&self) -> MutexGuard<'_, State> {
        lock(&self.state)
    }

    /// vCPU `idx` enters `KVM_RUN` (called on its thread, right before).
    #[inline]
    pub fn entering(&self, idx: usize) {
        self.vcpus[idx].seq.fetch_add(1, Ordering::Release);
    }

    /// vCPU `idx` is back from `KVM_RUN` (called on its thread, right after).
    #[inline]
    pub fn returned(&self, idx: usize) {
        self.vcpus[idx].seq.fetch_add(1, Ordering::Release);
    }

    /// Whether the watchdog's kick asked vCPU `idx` to look at its registers (cleared).
    pub fn take_probe(&self, idx: usize) -> bool {
        self.vcpus[idx].probe.swap(false, Ordering::AcqRel)
    }

    /// Whether vCPU `idx` was found stuck in the host (rule 1); its thread is given up.
    pub fn is_stuck(&self, idx: usize) -> bool {
        self.vcpus
            .get(idx)
            .is_some_and(|v| v.stuck.load(Ordering::Acquire))
    }

    /// Whether any vCPU was found stuck in the host.
    pub fn any_stuck(&self) -> bool {
        (0..self.vcpus.len()).any(|i| self.is_stuck(i))
    }

    /// Records that every vCPU now inside `KVM_RUN` is being kicked by someone else
    /// (`pause`, `stop`): each must be back within the timeout. Call it before sending the
    /// signals, so a run that begins after them is never taken for a kicked one.
    pub fn note_kicks(&self) {
        let now = Instant::now();
        let mut st = self.state();
        for (v, t) in self.vcpus.iter().zip(st.tracks.iter_mut()) {
            let seq = v.seq.load(Ordering::Acquire);
            if seq % 2 == 0 {
                continue;
            }
            if seq != t.seq {
                *t = Track {
                    seq,
                    since: Some(now),
                    kicked: Some(now),
                };
            } else if t.kicked.is_none() {
                t.since.get_or_insert(now);
                t.kicked = Some(now);
            }
        }
        self.cv.notify_all();
    }

    /// Ends [`Watchdog::run`].
    pub fn shutdown(&self) {
        self.state().shutdown = true;
        self.cv.notify_all();
    }

    /// The watchdog thread's loop, until [`Watchdog::shutdown`]: `kick(i)` kicks vCPU
    /// `i`'s thread, `stuck(i)` is called once for a vCPU found stuck in the host, before
    /// it is marked (so whoever sees [`Watchdog::is_stuck`] finds what `stuck` recorded).
    /// Neither is called with the watchdog's lock held.
    pub fn run(&self, kick: impl Fn(usize), stuck: impl Fn(usize)) {
        let mut st = self.state();
        loop {
            if st.shutdown {
                return;
            }
            let now = Instant::now();
            let seqs: Vec<u64> = self
                .vcpus
                .iter()
                .map(|v| v.seq.load(Ordering::Acquire))
                .collect();
            let given_up: Vec<bool> = (0..self.vcpus.len()).map(|i| self.is_stuck(i)).collect();
            let found = step(
                &mut st.tracks,
                &seqs,
                &given_up,
                now,
                self.period,
                self.timeout,
            );
            if found.kick.is_empty() && found.stuck.is_empty() {
                let wait = found.next.saturating_duration_since(now);
                st = wait_timeout(&self.cv, st, wait).0;
                continue;
            }
            for &i in &found.kick {
                self.vcpus[i].probe.store(true, Ordering::Release);
            }
            drop(st);
            for &i in &found.kick {
                kick(i);
            }
            for &i in &found.stuck {
                stuck(i);
                self.vcpus[i].stuck.store(true, Ordering::Release);
            }
            st = self.state();
        }
    }
}

/// The hypercall instruction these bytes start with, if any.
pub fn hypercall_name(code: [u8; 3]) -> Option<&'static str> {
    match code {
        [0x0f, 0x01, 0xd9] => Some("VMMCALL"),
        [0x0f, 0x01, 0xc1] => Some("VMCALL"),
        _ => None,
    }
}

/// A vCPU that made no progress on a hypercall (rule 2).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stall {
    pub instruction: &'static str,
    pub rip: u64,
}

/// Rule 2 on one vCPU thread: the registers seen at the watchdog's samples since the
/// vCPU's last exit.
#[derive(Default)]
pub struct Progress {
    /// The first sample of the current unchanged stretch, its time, and the hypercall
    /// instruction at its `rip` (if it is one).
    first: Option<(Regs, Instant, Option<&'static str>)>,
    samples: u32,
}

impl Progress {
    /// The vCPU exited (or was parked): it is not stuck.
    #[inline]
    pub fn reset(&mut self) {
        if self.first.is_some() {
            self.first = None;
            self.samples = 0;
        }
    }

    /// One sample taken at a watchdog kick. `hypercall` names the instruction at `rip` if it
    /// is a hypercall (asked only when the registers changed). `Some` once the registers
    /// stayed the same on a hypercall for [`MIN_STALL_SAMPLES`] samples spanning `timeout`.
    pub fn sample(
        &mut self,
        regs: &Regs,
        now: Instant,
        timeout: Duration,
        hypercall: impl FnOnce(&Regs) -> Option<&'static str>,
    ) -> Option<Stall> {
        if let Some((first, since, instruction)) = &self.first
            && first == regs
        {
            let instruction = (*instruction)?;
            self.samples += 1;
            if self.samples >= MIN_STALL_SAMPLES && now.duration_since(*since) >= timeout {
                return Some(Stall {
                    instruction,
                    rip: regs.rip,
                });
            }
            return None;
        }
        self.first = Some((*regs, now, hypercall(regs)));
        self.samples = 1;
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: Duration = Duration::from_millis(1000);
    const T: Duration = Duration::from_millis(2000);

    fn ms(t0: Instant, n: u64) -> Instant {
        t0 + Duration::from_millis(n)
    }

    #[test]
    fn a_long_run_is_kicked_once_per_period_and_a_vcpu_that_comes_back_is_fine() {
        let t0 = Instant::now();
        let mut tracks = vec![Track::default(); 2];
        let no = [false, false];
        // vCPU 0 enters a run, vCPU 1 stays outside KVM_RUN (parked).
        let s = step(&mut tracks, &[1, 0], &no, t0, P, T);
        assert!(s.kick.is_empty() && s.stuck.is_empty());
        assert_eq!(s.next, ms(t0, 1000));
        let s = step(&mut tracks, &[1, 0], &no, ms(t0, 999), P, T);
        assert!(s.kick.is_empty());
        assert_eq!(s.next, ms(t0, 1000));
        // A whole period in one run: kicked, and the kick's deadline is when to look next.
        let s = step(&mut tracks, &[1, 0], &no, ms(t0, 1000), P, T);
        assert_eq!(s.kick, vec![0]);
        assert_eq!(s.next, ms(t0, 2000));
        // Back and in again (seq 3): the new run counts from the kick, so the next kick
        // comes a period after the last one.
        let s = step(&mut tracks, &[3, 0], &no, ms(t0, 1500), P, T);
        assert!(s.kick.is_empty() && s.stuck.is_empty());
        assert_eq!(s.next, ms(t0, 2000));
        let s = step(&mut tracks, &[3, 0], &no, ms(t0, 2000), P, T);
        assert_eq!(s.kick, vec![0]);
        // Back, and outside KVM_RUN (parked for a long time): never kicked, never stuck.
        for n in [2100, 10_000, 100_000] {
            let s = step(&mut tracks, &[4, 0], &no, ms(t0, n), P, T);
            assert!(s.kick.is_empty() && s.stuck.is_empty(), "{n}");
        }
    }

    #[test]
    fn a_kicked_vcpu_still_in_the_same_run_after_the_timeout_is_stuck() {
        let t0 = Instant::now();
        let mut tracks = vec![Track::default(); 1];
        let no = [false];
        step(&mut tracks, &[7], &no, t0, P, T);
        assert_eq!(
            step(&mut tracks, &[7], &no, ms(t0, 1000), P, T).kick,
            vec![0]
        );
        let s = step(&mut tracks, &[7], &no, ms(t0, 2999), P, T);
        assert!(s.stuck.is_empty() && s.kick.is_empty());
        assert_eq!(s.next, ms(t0, 3000));
        assert_eq!(
            step(&mut tracks, &[7], &no, ms(t0, 3000), P, T).stuck,
            vec![0]
        );
        // Once given up, it is not reported again.
        let s = step(&mut tracks, &[7], &[true], ms(t0, 9000), P, T);
        assert!(s.stuck.is_empty() && s.kick.is_empty());
    }

    #[test]
    fn kicks_by_pause_or_stop_start_the_timeout_and_later_runs_are_not_blamed() {
        let wd = Watchdog::new(2, P, T);
        wd.entering(0);
        wd.note_kicks();
        let t = wd.state().tracks.clone();
        assert_eq!(t[0].seq, 1);
        assert!(t[0].kicked.is_some());
        assert_eq!(t[1], Track::default(), "vCPU 1 is outside KVM_RUN");
        let kicked = t[0].kicked.unwrap();
        // A second kick keeps the first one's time.
        wd.note_kicks();
        assert_eq!(wd.state().tracks[0].kicked, Some(kicked));
        // Back and in again: the new run was not kicked.
        wd.returned(0);
        wd.entering(0);
        let mut st = wd.state();
        let s = step(&mut st.tracks, &[3, 0], &[false, false], kicked + T, P, T);
        assert!(s.stuck.is_empty(), "{s:?}");
        // It counts from the earlier kick, so it is due a kick of its own, timed from now.
        assert_eq!(s.kick, vec![0]);
        assert_eq!(st.tracks[0].kicked, Some(kicked + T));
    }

    #[test]
    fn run_kicks_probes_and_reports_a_stuck_vcpu_once_then_shuts_down() {
        use std::sync::Arc;
        let wd = Arc::new(Watchdog::new(
            1,
            Duration::from_millis(10),
            Duration::from_millis(30),
        ));
        wd.entering(0);
        let kicks = Arc::new(AtomicU64::new(0));
        let reports = Arc::new(AtomicU64::new(0));
        let th = {
            let (wd, kicks, reports) = (wd.clone(), kicks.clone(), reports.clone());
            std::thread::spawn(move || {
                wd.run(
                    |_| {
                        kicks.fetch_add(1, Ordering::SeqCst);
                    },
                    |_| {
                        reports.fetch_add(1, Ordering::SeqCst);
                    },
                )
            })
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        while !wd.is_stuck(0) {
            assert!(Instant::now() < deadline, "never declared stuck");
            std::thread::yield_now();
        }
        assert!(wd.any_stuck());
        assert!(wd.take_probe(0), "the kick asked for a look");
        assert!(!wd.take_probe(0));
        wd.shutdown();
        th.join().unwrap();
        assert_eq!(kicks.load(Ordering::SeqCst), 1);
        assert_eq!(reports.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn unchanged_registers_on_a_hypercall_for_the_timeout_are_a_stall() {
        let t0 = Instant::now();
        let regs = Regs {
            rip: 0x10_000a,
            rax: 1,
            ..Default::default()
        };
        let on_vmmcall = |_: &Regs| hypercall_name([0x0f, 0x01, 0xd9]);
        let mut p = Progress::default();
        assert_eq!(p.sample(&regs, t0, T, on_vmmcall), None);
        assert_eq!(p.sample(&regs, ms(t0, 1000), T, on_vmmcall), None);
        // Three samples, but not yet spanning the timeout.
        assert_eq!(p.sample(&regs, ms(t0, 1999), T, on_vmmcall), None);
        assert_eq!(
            p.sample(&regs, ms(t0, 2000), T, on_vmmcall),
            Some(Stall {
                instruction: "VMMCALL",
                rip: 0x10_000a
            })
        );
        // Two samples spanning the timeout are not enough.
        let mut p = Progress::default();
        p.sample(&regs, t0, T, on_vmmcall);
        assert_eq!(p.sample(&regs, ms(t0, 5000), T, on_vmmcall), None);
        // An exit in between starts over.
        let mut p = Progress::default();
        p.sample(&regs, t0, T, on_vmmcall);
        p.sample(&regs, ms(t0, 1000), T, on_vmmcall);
        p.reset();
        assert_eq!(p.sample(&regs, ms(t0, 2000), T, on_vmmcall), None);
        assert_eq!(p.sample(&regs, ms(t0, 3000), T, on_vmmcall), None);
        // A register that moves starts over.
        let mut p = Progress::default();
        p.sample(&regs, t0, T, on_vmmcall);
        p.sample(&regs, ms(t0, 1000), T, on_vmmcall);
        let moved = Regs { rax: 2, ..regs };
        assert_eq!(p.sample(&moved, ms(t0, 2000), T, on_vmmcall), None);
        assert_eq!(p.sample(&moved, ms(t0, 3000), T, on_vmmcall), None);
    }

    #[test]
    fn unchanged_registers_elsewhere_are_not_a_stall() {
        let t0 = Instant::now();
        let regs = Regs {
            rip: 0x10_0000,
            ..Default::default()
        };
        // `hlt; jmp` of an idle guest, or `jmp $`.
        let mut asked = 0;
        let mut p = Progress::default();
        for n in 0..10 {
            let r = p.sample(&regs, ms(t0, n * 1000), T, |_| {
                asked += 1;
                hypercall_name([0xeb, 0xfe, 0x00])
            });
            assert_eq!(r, None);
        }
        assert_eq!(
            asked, 1,
            "the instruction is read again only when registers change"
        );
        assert_eq!(hypercall_name([0x0f, 0x01, 0xc1]), Some("VMCALL"));
        assert_eq!(hypercall_name([0x0f, 0x01, 0xd8]), None);
    }
}
