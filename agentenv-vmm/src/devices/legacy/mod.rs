//! Legacy port-I/O devices: the 8250 UART (COM1), the i8042 controller (its reset line
//! ends the VM) and the debug-exit port the VMM's test guests end with.
//!
//! ## The debug-exit port
//! A guest write to port [`DEBUG_EXIT_PORT`] (`0x501`, where QEMU's `isa-debug-exit` sits)
//! of 1, 2 or 4 bytes ends the VM with [`ExitReason::Done`] carrying the value written.
//! Reads return `0xff`. Linux never touches the port.

use std::io::Write;
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};

use vm_superio::{I8042Device, Serial, Trigger};
use vmm_sys_util::eventfd::EventFd;

use super::BusDevice;
use crate::exit::{ExitReason, ExitState};
use crate::sync::lock;

/// COM1.
pub const SERIAL_PORT: u64 = 0x3f8;
pub const SERIAL_PORT_LEN: u64 = 8;
/// COM1's IRQ.
pub const SERIAL_IRQ: u32 = 4;
/// The i8042 controller (data 0x60, command/status 0x64).
pub const I8042_PORT: u64 = 0x60;
pub const I8042_PORT_LEN: u64 = 5;
/// The debug-exit port.
pub const DEBUG_EXIT_PORT: u64 = 0x501;
pub const DEBUG_EXIT_PORT_LEN: u64 = 4;

/// A device of byte-wide registers on `LEN` consecutive ports (the UART, the i8042). Only
/// one-byte accesses inside its ports reach a register; any other read sees a floating
/// bus (all ones) and any other write is ignored.
trait ByteRegisters: Send {
    const LEN: u64;
    fn read_register(&mut self, reg: u8) -> u8;
    fn write_register(&mut self, reg: u8, value: u8);
}

impl<D: ByteRegisters> BusDevice for D {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        match data {
            [b] if offset < D::LEN => *b = self.read_register(offset as u8),
            _ => data.fill(0xff),
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if let [b] = data {
            if offset < D::LEN {
                self.write_register(offset as u8, *b);
            }
        }
    }
}

/// An [`EventFd`] as a vm-superio interrupt trigger (an irqfd in a VM).
pub struct EventFdTrigger(pub EventFd);

impl Trigger for EventFdTrigger {
    type E = std::io::Error;
    fn trigger(&self) -> std::io::Result<()> {
        self.0.write(1)
    }
}

/// Where the UART's output goes; shared so the UART can be rebuilt from a snapshot.
#[derive(Clone)]
pub struct SerialOut(Arc<Mutex<Box<dyn Write + Send>>>);

impl SerialOut {
    pub fn new(out: Box<dyn Write + Send>) -> Self {
        Self(Arc::new(Mutex::new(out)))
    }
}

impl Write for SerialOut {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        lock(&self.0).write(buf)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        lock(&self.0).flush()
    }
}

/// The UART's registers in a snapshot.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SerialSnapshot {
    pub baud_divisor_low: u8,
    pub baud_divisor_high: u8,
    pub interrupt_enable: u8,
    pub interrupt_identification: u8,
    pub line_control: u8,
    pub line_status: u8,
    pub modem_control: u8,
    pub modem_status: u8,
    pub scratch: u8,
    pub in_buffer: Vec<u8>,
}

/// Builds a `$to` from `$from`: vm-superio's `SerialState` and [`SerialSnapshot`] hold the
/// same registers under the same names.
macro_rules! copy_serial_registers {
    ($from:expr => $to:path) => {{
        let s = $from;
        $to {
            baud_divisor_low: s.baud_divisor_low,
            baud_divisor_high: s.baud_divisor_high,
            interrupt_enable: s.interrupt_enable,
            interrupt_identification: s.interrupt_identification,
            line_control: s.line_control,
            line_status: s.line_status,
            modem_control: s.modem_control,
            modem_status: s.modem_status,
            scratch: s.scratch,
            in_buffer: s.in_buffer,
        }
    }};
}

/// The 8250 UART: what the guest writes goes to `out`.
pub struct SerialDevice {
    serial: Serial<EventFdTrigger, vm_superio::serial::NoEvents, SerialOut>,
    irq: EventFd,
    out: SerialOut,
}

impl SerialDevice {
    pub fn new(irq: EventFd, out: Box<dyn Write + Send>) -> std::io::Result<Self> {
        let out = SerialOut::new(out);
        Ok(Self {
            serial: Serial::new(EventFdTrigger(irq.try_clone()?), out.clone()),
            irq,
            out,
        })
    }

    /// The registers, for a snapshot.
    pub fn save_state(&self) -> SerialSnapshot {
        copy_serial_registers!(self.serial.state() => SerialSnapshot)
    }

    /// Puts the registers of a snapshot back.
    pub fn restore_state(&mut self, s: &SerialSnapshot) -> Result<(), String> {
        let state = copy_serial_registers!(s.clone() => vm_superio::serial::SerialState);
        let irq = self.irq.try_clone().map_err(|e| e.to_string())?;
        self.serial = Serial::from_state(
            &state,
            EventFdTrigger(irq),
            vm_superio::serial::NoEvents,
            self.out.clone(),
        )
        .map_err(|e| format!("serial state: {e:?}"))?;
        Ok(())
    }
}

impl ByteRegisters for SerialDevice {
    const LEN: u64 = SERIAL_PORT_LEN;

    fn read_register(&mut self, reg: u8) -> u8 {
        self.serial.read(reg)
    }

    fn write_register(&mut self, reg: u8, value: u8) {
        if let Err(e) = self.serial.write(reg, value) {
            tracing::warn!("serial console write failed: {e:?}");
        }
        if reg == 0 && value == b'\n' {
            let _ = self.serial.writer_mut().flush();
        }
    }
}

/// Ends the VM with a given reason when triggered.
pub struct ExitTrigger {
    state: Arc<ExitState>,
    reason: ExitReason,
}

impl Trigger for ExitTrigger {
    type E = std::convert::Infallible;
    fn trigger(&self) -> Result<(), Self::E> {
        self.state.set(self.reason.clone());
        Ok(())
    }
}

/// The i8042 controller: `out 0x64, 0xfe` (pulse the reset line) ends the VM with
/// [`ExitReason::Reset`].
pub struct I8042 {
    dev: I8042Device<ExitTrigger>,
}

impl I8042 {
    pub fn new(exit: Arc<ExitState>) -> Self {
        Self {
            dev: I8042Device::new(ExitTrigger {
                state: exit,
                reason: ExitReason::Reset,
            }),
        }
    }
}

impl ByteRegisters for I8042 {
    const LEN: u64 = I8042_PORT_LEN;

    fn read_register(&mut self, reg: u8) -> u8 {
        self.dev.read(reg)
    }

    fn write_register(&mut self, reg: u8, value: u8) {
        let _ = self.dev.write(reg, value);
    }
}

/// The debug-exit port (see the module documentation).
pub struct DebugExit {
    exit: Arc<ExitState>,
}

impl DebugExit {
    pub fn new(exit: Arc<ExitState>) -> Self {
        Self { exit }
    }
}

impl BusDevice for DebugExit {
    fn read(&mut self, _offset: u64, data: &mut [u8]) {
        data.fill(0xff);
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if offset != 0 {
            return;
        }
        let mut b = [0u8; 4];
        let n = data.len().min(4);
        b[..n].copy_from_slice(&data[..n]);
        self.exit.set(ExitReason::Done(u32::from_le_bytes(b)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    #[derive(Clone, Default)]
    struct Sink(Arc<Mutex<Vec<u8>>>);
    impl Write for Sink {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn serial_writes_reach_the_output_and_raise_the_irq_when_enabled() {
        let sink = Sink::default();
        let irq = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        let mut s = SerialDevice::new(irq.try_clone().unwrap(), Box::new(sink.clone())).unwrap();
        // IER: THR-empty interrupt on.
        s.write(1, &[0x02]);
        for b in b"hi\n" {
            s.write(0, &[*b]);
        }
        assert_eq!(&*sink.0.lock().unwrap(), b"hi\n");
        assert!(irq.read().unwrap() >= 1);
        // LSR says the transmitter is empty.
        let mut lsr = [0u8];
        s.read(5, &mut lsr);
        assert_ne!(lsr[0] & 0x20, 0);

        // Registers survive a snapshot into a fresh device.
        s.write(3, &[0x03]); // LCR: 8N1
        s.write(7, &[0x5a]); // scratch
        let saved = s.save_state();
        let mut fresh =
            SerialDevice::new(irq.try_clone().unwrap(), Box::new(sink.clone())).unwrap();
        fresh.restore_state(&saved).unwrap();
        let mut b = [0u8];
        fresh.read(7, &mut b);
        assert_eq!(b[0], 0x5a);
        fresh.read(3, &mut b);
        assert_eq!(b[0], 0x03);
        fresh.write(0, b"x");
        assert_eq!(&*sink.0.lock().unwrap(), b"hi\nx");
    }

    #[test]
    fn i8042_reset_and_debug_exit_end_the_vm_with_their_reason() {
        let exit = Arc::new(ExitState::default());
        let mut k = I8042::new(exit.clone());
        k.write(4, &[0xfe]);
        assert_eq!(exit.get(), Some(ExitReason::Reset));

        let exit = Arc::new(ExitState::default());
        let mut d = DebugExit::new(exit.clone());
        d.write(0, &[0x2a, 0x01]);
        assert_eq!(exit.get(), Some(ExitReason::Done(0x12a)));
        // The first reason wins.
        d.write(0, &[7]);
        assert_eq!(exit.get(), Some(ExitReason::Done(0x12a)));
    }
}
