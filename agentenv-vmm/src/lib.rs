//! agentenv-vmm: the microVM monitor of AgentENV, on KVM through rust-vmm crates.
//!
//! A [`config::VmConfig`] is checked as a whole before anything is created; only a valid
//! configuration becomes a live VM (guest memory, vCPUs, in-kernel irqchip and PIT, the
//! kernel loaded through linux-loader, legacy devices and virtio-mmio devices).
//!
//! Layout:
//! * [`hypervisor`]: the seam over KVM (`Hypervisor` → `HypervisorVm` → `HypervisorVcpu`),
//!   so a test double and other hypervisors fit.
//! * [`memory`]: guest memory (anonymous, or file-backed and shared for snapshots) and
//!   dirty-page tracking.
//! * [`arch`]: x86_64 setup (CPUID, MSRs, registers, page tables, MP table, layout).
//! * [`loader`]: the kernel, initrd and command line into guest memory.
//! * [`devices`]: the I/O and MMIO buses, the legacy devices (8250 UART, i8042, the
//!   debug-exit port) and the virtio-mmio transport with its devices.
//! * [`config`]: the validated VM configuration.
//! * [`cpu_template`]: the CPU template JSON, shared with the scheduler (the file is
//!   agentenv-core's, compiled here as a module: the VMM does not depend on agentenv-core).
//! * [`control`]: the control protocol of a VMM process (JSON lines over a unix socket)
//!   and the node's client of it.
//! * [`seccomp`]: the VMM process's system call filter.
//! * [`vm`]: the VM lifecycle (start, pause, resume, snapshot, stop): building, the vCPU
//!   threads, device management and persistence, each in its own room.
//! * [`exit`]: why a VM ended, recorded by the devices and vCPUs, awaited by the VM.
//! * [`watchdog`]: the vCPU watchdog, which stops a VM whose vCPU the host's hypervisor
//!   does not give back (kicked and not back from `KVM_RUN`, or stuck on a hypercall).
//! * [`snapshot`]: the snapshot format.
//! * [`sync`]: the one lock helper (a lock whose holder panicked is taken anyway).

pub mod arch;
pub mod config;
pub mod control;
#[path = "../../agentenv-core/src/cpu_template.rs"]
pub mod cpu_template;
pub mod devices;
pub mod exit;
pub mod hypervisor;
pub mod loader;
pub mod memory;
pub mod seccomp;
pub mod snapshot;
pub mod sync;
pub mod vm;
pub mod watchdog;

pub use config::VmConfig;
pub use vm::{ExitReason, SnapshotInfo, SnapshotKind, Vm, VmError, VmMetrics};
