//! How a VM ends: the [`ExitReason`], and the [`ExitState`] that records the first one.
//!
//! A leaf module: the legacy devices (the i8042's reset line, the debug-exit port) and the
//! vCPU threads record the guest's end here, and the VM waits on it, without the devices
//! knowing the VM.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::sync::{lock, wait, wait_timeout};

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
        let mut r = lock(&self.reason);
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
        lock(&self.reason).clone()
    }

    /// Blocks until a reason is recorded.
    pub fn wait(&self) -> ExitReason {
        let mut r = lock(&self.reason);
        loop {
            if let Some(reason) = r.as_ref() {
                return reason.clone();
            }
            r = wait(&self.cv, r);
        }
    }

    /// Blocks until a reason is recorded or `timeout` passes.
    pub fn wait_timeout(&self, timeout: Duration) -> Option<ExitReason> {
        let deadline = Instant::now() + timeout;
        let mut r = lock(&self.reason);
        loop {
            if let Some(reason) = r.as_ref() {
                return Some(reason.clone());
            }
            let now = Instant::now();
            if now >= deadline {
                return None;
            }
            r = wait_timeout(&self.cv, r, deadline - now).0;
        }
    }
}
