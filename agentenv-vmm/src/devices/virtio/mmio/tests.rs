//! The transport's tests, and the test device and driver steps its rooms' tests share.

use serde::{Deserialize, Serialize};
use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use vm_memory::GuestAddress;

use super::registers::*;
use super::*;
use crate::devices::virtio::ActivateError;
use crate::devices::virtio::persist::{Persist, StateError};

pub(super) const QUEUE_MAX: u16 = 16;
pub(super) const MEM_SIZE: usize = 0x10_0000;

/// A device that records what the transport does to it.
#[derive(Default)]
pub(super) struct Recorder {
    pub(super) acked: u64,
    pub(super) activations: u32,
    pub(super) active: Option<(Vec<Queue>, Vec<EventFd>)>,
    pub(super) fail_activate: bool,
    pub(super) config: [u8; 8],
    pub(super) restored: Option<RecorderState>,
}

pub(super) const OFFERED: u64 = (1 << VIRTIO_F_VERSION_1) | (1 << 3);

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct RecorderState {
    config: Vec<u8>,
}

impl Persist for Recorder {
    type State = RecorderState;
    const STATE_VERSION: u32 = 1;
    const NAME: &'static str = "recorder";
    fn save(&self) -> RecorderState {
        RecorderState {
            config: self.config.to_vec(),
        }
    }
    fn restore(&mut self, state: RecorderState) -> Result<(), StateError> {
        self.restored = Some(state);
        Ok(())
    }
}

impl VirtioDevice for Recorder {
    fn device_type(&self) -> u32 {
        4
    }
    fn queue_max_sizes(&self) -> &[u16] {
        &[QUEUE_MAX, QUEUE_MAX]
    }
    fn avail_features(&self) -> u64 {
        OFFERED
    }
    fn set_acked_features(&mut self, features: u64) {
        self.acked = features;
    }
    fn read_config(&self, offset: u64, data: &mut [u8]) {
        for (i, b) in data.iter_mut().enumerate() {
            *b = self.config.get(offset as usize + i).copied().unwrap_or(0);
        }
    }
    fn write_config(&mut self, offset: u64, data: &[u8]) {
        for (i, b) in data.iter().enumerate() {
            if let Some(c) = self.config.get_mut(offset as usize + i) {
                *c = *b;
            }
        }
    }
    fn activate(&mut self, ctx: ActivateContext) -> Result<(), ActivateError> {
        if self.fail_activate {
            return Err(ActivateError::Other("refused by the test".into()));
        }
        self.activations += 1;
        self.active = Some((ctx.queues, ctx.queue_events));
        Ok(())
    }
    fn deactivate(&mut self) -> Option<(Vec<Queue>, Vec<EventFd>)> {
        self.active.take()
    }
}

pub(super) fn mem() -> GuestMemoryMmap {
    crate::devices::virtio::testing::guest_memory(MEM_SIZE)
}

pub(super) fn transport_with(dev: Recorder) -> (MmioTransport, Arc<Mutex<Recorder>>, Arc<EventFd>) {
    let dev = Arc::new(Mutex::new(dev));
    let line = Arc::new(EventFd::new(libc::EFD_NONBLOCK).unwrap());
    let t = MmioTransport::new(mem(), dev.clone(), line.clone()).unwrap();
    (t, dev, line)
}

pub(super) fn r(t: &mut MmioTransport, off: u64) -> u32 {
    let mut b = [0u8; 4];
    t.read(off, &mut b);
    u32::from_le_bytes(b)
}

pub(super) fn w(t: &mut MmioTransport, off: u64, v: u32) {
    t.write(off, &v.to_le_bytes());
}

pub(super) fn negotiate(t: &mut MmioTransport, features: u64) {
    w(t, REG_STATUS, status::ACKNOWLEDGE);
    w(t, REG_STATUS, status::ACKNOWLEDGE | status::DRIVER);
    w(t, REG_DRIVER_FEATURES_SEL, 0);
    w(t, REG_DRIVER_FEATURES, features as u32);
    w(t, REG_DRIVER_FEATURES_SEL, 1);
    w(t, REG_DRIVER_FEATURES, (features >> 32) as u32);
    w(
        t,
        REG_STATUS,
        status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK,
    );
}

pub(super) fn setup_queue(t: &mut MmioTransport, index: u32, base: u64) {
    w(t, REG_QUEUE_SEL, index);
    w(t, REG_QUEUE_NUM, u32::from(QUEUE_MAX));
    w(t, REG_QUEUE_DESC_LOW, base as u32);
    w(t, REG_QUEUE_DESC_HIGH, (base >> 32) as u32);
    w(t, REG_QUEUE_DRIVER_LOW, (base + 0x1000) as u32);
    w(t, REG_QUEUE_DRIVER_HIGH, 0);
    w(t, REG_QUEUE_DEVICE_LOW, (base + 0x2000) as u32);
    w(t, REG_QUEUE_DEVICE_HIGH, 0);
    w(t, REG_QUEUE_READY, 1);
}

pub(super) const ALL_OK: u32 =
    status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK | status::DRIVER_OK;

pub(super) fn bring_up(t: &mut MmioTransport) {
    negotiate(t, OFFERED);
    setup_queue(t, 0, 0x1_0000);
    setup_queue(t, 1, 0x2_0000);
    w(t, REG_STATUS, ALL_OK);
}

#[test]
fn identification_registers_describe_a_version_2_device() {
    let (mut t, _, _) = transport_with(Recorder::default());
    assert_eq!(r(&mut t, REG_MAGIC), 0x7472_6976);
    assert_eq!(r(&mut t, REG_VERSION), 2);
    assert_eq!(r(&mut t, REG_DEVICE_ID), 4);
    assert_eq!(r(&mut t, REG_VENDOR_ID), MMIO_VENDOR_ID);
    w(&mut t, REG_DEVICE_FEATURES_SEL, 0);
    assert_eq!(r(&mut t, REG_DEVICE_FEATURES), OFFERED as u32);
    w(&mut t, REG_DEVICE_FEATURES_SEL, 1);
    assert_eq!(r(&mut t, REG_DEVICE_FEATURES), (OFFERED >> 32) as u32);
    w(&mut t, REG_DEVICE_FEATURES_SEL, 2);
    assert_eq!(r(&mut t, REG_DEVICE_FEATURES), 0);
    w(&mut t, REG_QUEUE_SEL, 1);
    assert_eq!(r(&mut t, REG_QUEUE_NUM_MAX), u32::from(QUEUE_MAX));
    w(&mut t, REG_QUEUE_SEL, 2);
    assert_eq!(
        r(&mut t, REG_QUEUE_NUM_MAX),
        0,
        "a queue past the last one has size 0"
    );
    assert_eq!(t.metrics().bad_accesses, 0);
}

#[test]
fn feature_negotiation_acks_offered_features() {
    let (mut t, dev, _) = transport_with(Recorder::default());
    negotiate(&mut t, OFFERED);
    assert_ne!(r(&mut t, REG_STATUS) & status::FEATURES_OK, 0);
    assert_eq!(dev.lock().unwrap().acked, OFFERED);
    assert_eq!(t.acked_features(), OFFERED);
}

#[test]
fn features_ok_is_refused_when_the_driver_acks_unoffered_features() {
    let (mut t, dev, _) = transport_with(Recorder::default());
    negotiate(&mut t, OFFERED | (1 << 7));
    assert_eq!(r(&mut t, REG_STATUS) & status::FEATURES_OK, 0);
    assert_eq!(
        dev.lock().unwrap().acked,
        0,
        "the device never saw the bad ack"
    );
    assert!(t.metrics().bad_accesses >= 1);
    // Nor may it activate.
    w(&mut t, REG_STATUS, ALL_OK);
    assert!(!t.is_activated());
}

#[test]
fn features_ok_is_refused_without_version_1() {
    let (mut t, _, _) = transport_with(Recorder::default());
    negotiate(&mut t, 1 << 3);
    assert_eq!(r(&mut t, REG_STATUS) & status::FEATURES_OK, 0);
}

#[test]
fn queue_size_must_be_a_power_of_two_not_above_the_maximum() {
    let (mut t, _, _) = transport_with(Recorder::default());
    negotiate(&mut t, OFFERED);
    w(&mut t, REG_QUEUE_SEL, 0);
    let before = t.metrics().bad_accesses;
    w(&mut t, REG_QUEUE_NUM, 12);
    w(&mut t, REG_QUEUE_NUM, 32);
    w(&mut t, REG_QUEUE_NUM, 0);
    assert_eq!(t.metrics().bad_accesses, before + 3);
    w(&mut t, REG_QUEUE_NUM, 8);
    assert_eq!(t.metrics().bad_accesses, before + 3);
    assert_eq!(t.queues[0].size(), 8);
}

#[test]
fn queue_ready_is_refused_for_rings_outside_guest_memory_or_misaligned() {
    let (mut t, _, _) = transport_with(Recorder::default());
    negotiate(&mut t, OFFERED);
    // Descriptor table past the end of memory.
    setup_queue(&mut t, 0, MEM_SIZE as u64 - 0x100);
    assert_eq!(r(&mut t, REG_QUEUE_READY), 0);
    // Descriptor table misaligned.
    setup_queue(&mut t, 1, 0x1_0008);
    assert_eq!(r(&mut t, REG_QUEUE_READY), 0);
    // A good one is taken.
    setup_queue(&mut t, 1, 0x2_0000);
    assert_eq!(r(&mut t, REG_QUEUE_READY), 1);
    assert!(t.metrics().bad_accesses >= 2);
}

#[test]
fn queue_registers_are_ignored_before_features_ok() {
    let (mut t, _, _) = transport_with(Recorder::default());
    w(&mut t, REG_STATUS, status::ACKNOWLEDGE | status::DRIVER);
    w(&mut t, REG_QUEUE_SEL, 0);
    w(&mut t, REG_QUEUE_NUM, 4);
    assert_eq!(t.queues[0].size(), QUEUE_MAX);
    assert_eq!(t.metrics().bad_accesses, 1);
}

#[test]
fn driver_ok_activates_the_device_with_the_configured_queues() {
    let (mut t, dev, _) = transport_with(Recorder::default());
    bring_up(&mut t);
    assert!(t.is_activated());
    assert_eq!(r(&mut t, REG_STATUS), ALL_OK);
    let d = dev.lock().unwrap();
    assert_eq!(d.activations, 1);
    let (queues, events) = d.active.as_ref().unwrap();
    assert_eq!(queues.len(), 2);
    assert_eq!(events.len(), 2);
    assert!(queues[0].ready());
    assert_eq!(queues[1].desc_table(), 0x2_0000);
    assert_eq!(queues[1].avail_ring(), 0x2_1000);
    assert_eq!(queues[1].used_ring(), 0x2_2000);
    // Queue registers are frozen once DRIVER_OK is set.
    drop(d);
    w(&mut t, REG_QUEUE_SEL, 0);
    w(&mut t, REG_QUEUE_READY, 0);
    assert_eq!(r(&mut t, REG_QUEUE_READY), 1);
}

#[test]
fn queue_notify_write_signals_the_queue_event() {
    let (mut t, dev, _) = transport_with(Recorder::default());
    bring_up(&mut t);
    w(&mut t, REG_QUEUE_NOTIFY, 1);
    let d = dev.lock().unwrap();
    let (_, events) = d.active.as_ref().unwrap();
    assert_eq!(
        events[1].read().unwrap(),
        1,
        "the device's clone sees the notification"
    );
    assert!(events[0].read().is_err(), "queue 0 was not notified");
    drop(d);
    w(&mut t, REG_QUEUE_NOTIFY, 9);
    assert_eq!(t.metrics().bad_accesses, 1);
}

#[test]
fn writing_zero_to_status_resets_the_device_and_its_queues() {
    let (mut t, dev, line) = transport_with(Recorder::default());
    bring_up(&mut t);
    t.interrupt().signal_used_queue().unwrap();
    assert_eq!(line.read().unwrap(), 1);
    w(&mut t, REG_STATUS, 0);
    assert!(!t.is_activated());
    assert!(
        dev.lock().unwrap().active.is_none(),
        "device was deactivated"
    );
    assert_eq!(r(&mut t, REG_STATUS), 0);
    assert_eq!(r(&mut t, REG_INTERRUPT_STATUS), 0);
    w(&mut t, REG_QUEUE_SEL, 0);
    assert_eq!(r(&mut t, REG_QUEUE_READY), 0);
    assert_eq!(t.acked_features(), 0);
    // The driver can bring it up again.
    bring_up(&mut t);
    assert_eq!(dev.lock().unwrap().activations, 2);
    assert_eq!(t.metrics().resets, 1);
}

#[test]
fn failed_activation_sets_device_needs_reset_and_raises_config_change() {
    let (mut t, _, line) = transport_with(Recorder {
        fail_activate: true,
        ..Default::default()
    });
    bring_up(&mut t);
    assert!(!t.is_activated());
    assert_ne!(r(&mut t, REG_STATUS) & status::DEVICE_NEEDS_RESET, 0);
    assert_eq!(r(&mut t, REG_INTERRUPT_STATUS), INT_CONFIG_CHANGE_BIT);
    assert_eq!(line.read().unwrap(), 1);
    assert_eq!(t.metrics().activate_failures, 1);
    w(&mut t, REG_INTERRUPT_ACK, INT_CONFIG_CHANGE_BIT);
    assert_eq!(r(&mut t, REG_INTERRUPT_STATUS), 0);
}

const INT_CONFIG_CHANGE_BIT: u32 = super::super::INT_CONFIG_CHANGE;

#[test]
fn bad_accesses_read_zero_and_are_counted() {
    let (mut t, _, _) = transport_with(Recorder::default());
    let mut two = [0xffu8; 2];
    t.read(REG_MAGIC, &mut two);
    assert_eq!(two, [0, 0]);
    assert_eq!(r(&mut t, 0x0f0), 0, "unknown offset");
    assert_eq!(r(&mut t, REG_QUEUE_DESC_LOW), 0, "write-only register");
    t.write(REG_STATUS, &[1]);
    assert_eq!(r(&mut t, REG_STATUS), 0, "a 1-byte status write is ignored");
    let mut past = [0xffu8; 4];
    t.read(MMIO_LEN + 4, &mut past);
    assert_eq!(past, [0; 4]);
    w(&mut t, REG_MAGIC, 5);
    assert_eq!(t.metrics().bad_accesses, 6);
    // Status can only grow until a reset.
    w(&mut t, REG_STATUS, status::ACKNOWLEDGE | status::DRIVER);
    w(&mut t, REG_STATUS, status::ACKNOWLEDGE);
    assert_eq!(r(&mut t, REG_STATUS), status::ACKNOWLEDGE | status::DRIVER);
    // A device-only bit cannot be set by the driver.
    w(
        &mut t,
        REG_STATUS,
        status::ACKNOWLEDGE | status::DRIVER | status::DEVICE_NEEDS_RESET,
    );
    assert_eq!(r(&mut t, REG_STATUS), status::ACKNOWLEDGE | status::DRIVER);
}

#[test]
fn config_space_is_passed_to_the_device_at_any_width() {
    let (mut t, dev, _) = transport_with(Recorder::default());
    t.write(CONFIG_OFFSET + 2, &[0xab, 0xcd]);
    assert_eq!(dev.lock().unwrap().config[2..4], [0xab, 0xcd]);
    let mut b = [0u8; 1];
    t.read(CONFIG_OFFSET + 3, &mut b);
    assert_eq!(b, [0xcd]);
    let mut b8 = [0xffu8; 8];
    t.read(CONFIG_OFFSET + 4, &mut b8);
    assert_eq!(b8, [0; 8], "bytes past the config space read as zero");
}

#[test]
fn config_generation_changes_with_a_config_change() {
    let (mut t, _, _) = transport_with(Recorder::default());
    let g = r(&mut t, REG_CONFIG_GENERATION);
    t.interrupt().signal_config_change().unwrap();
    assert_eq!(r(&mut t, REG_CONFIG_GENERATION), g.wrapping_add(1));
}

#[test]
fn quiesce_and_resume_keep_the_queues() {
    let (mut t, dev, _) = transport_with(Recorder::default());
    bring_up(&mut t);
    dev.lock().unwrap().active.as_mut().unwrap().0[1].set_next_avail(3);
    t.quiesce();
    assert!(!t.is_activated());
    assert!(dev.lock().unwrap().active.is_none());
    t.resume().unwrap();
    assert!(t.is_activated());
    assert_eq!(
        dev.lock().unwrap().active.as_ref().unwrap().0[1].next_avail(),
        3
    );
}

#[test]
fn cmdline_arg_names_the_window_and_irq() {
    assert_eq!(
        cmdline_arg(0xd000_0000, 5),
        "virtio_mmio.device=4K@0xd0000000:5"
    );
}

/// Counts panics on device worker threads (the worker catches them, so a test would not
/// otherwise see one).
fn count_worker_panics() -> Arc<std::sync::atomic::AtomicU64> {
    static COUNT: std::sync::OnceLock<Arc<std::sync::atomic::AtomicU64>> =
        std::sync::OnceLock::new();
    COUNT
        .get_or_init(|| {
            let count = Arc::new(std::sync::atomic::AtomicU64::new(0));
            let c = count.clone();
            let prev = std::panic::take_hook();
            std::panic::set_hook(Box::new(move |info| {
                if std::thread::current()
                    .name()
                    .is_some_and(|n| n.starts_with("virtio-"))
                {
                    c.fetch_add(1, Ordering::SeqCst);
                }
                prev(info)
            }));
            count
        })
        .clone()
}

#[test]
fn random_guest_register_traffic_and_garbage_rings_never_panic() {
    use crate::devices::virtio::block::Block;
    use std::io::Write;
    use vm_memory::Bytes;
    let panics = count_worker_panics();
    let mut img = tempfile::NamedTempFile::new().unwrap();
    img.write_all(&vec![7u8; 64 * 512]).unwrap();
    let mem = crate::devices::virtio::testing::guest_memory(MEM_SIZE);
    // Guest memory full of garbage, so whatever rings the driver points at hold nonsense.
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let garbage: Vec<u8> = (0..MEM_SIZE).map(|_| next() as u8).collect();
    mem.write_slice(&garbage, GuestAddress(0)).unwrap();
    let dev = Arc::new(Mutex::new(Block::new("fuzz", img.path(), false).unwrap()));
    let line = Arc::new(EventFd::new(libc::EFD_NONBLOCK).unwrap());
    let mut t = MmioTransport::new(mem.clone(), dev.clone(), line).unwrap();
    let offsets = [
        REG_STATUS,
        REG_DRIVER_FEATURES,
        REG_DRIVER_FEATURES_SEL,
        REG_QUEUE_SEL,
        REG_QUEUE_NUM,
        REG_QUEUE_READY,
        REG_QUEUE_NOTIFY,
        REG_QUEUE_DESC_LOW,
        REG_QUEUE_DRIVER_LOW,
        REG_QUEUE_DEVICE_LOW,
        REG_QUEUE_DESC_HIGH,
        REG_INTERRUPT_ACK,
    ];
    let mut activations = 0;
    for i in 0..20_000u32 {
        let r = next();
        let width = [1usize, 2, 4, 4, 4, 8][(r % 6) as usize];
        let offset = if r & 0x100 != 0 {
            offsets[((r >> 16) % offsets.len() as u64) as usize]
        } else {
            (r >> 24) % 0x1100
        };
        // Values biased towards what makes progress: small numbers, status steps,
        // addresses inside guest memory.
        let value = match (r >> 40) % 4 {
            0 => (r >> 44) as u32 % 16,
            1 => [1, 3, 11, 15, 0][((r >> 44) % 5) as usize],
            2 => ((r >> 44) as u32 % MEM_SIZE as u32) & !0xf,
            _ => (r >> 32) as u32,
        };
        let bytes = u64::from(value).to_le_bytes();
        if r & 0x200 != 0 {
            let mut buf = [0u8; 8];
            t.read(offset, &mut buf[..width]);
        } else {
            t.write(offset, &bytes[..width]);
        }
        if t.is_activated() {
            activations += 1;
        }
        if i % 1000 == 0 {
            // Sometimes also a well-formed bring-up over random chains.
            t.write(REG_STATUS, &0u32.to_le_bytes());
            bring_up_over_random_chains(&mut t, &mut next);
        }
    }
    assert!(
        activations > 0,
        "the traffic did activate the device at times"
    );
    let m = dev.lock().unwrap().metrics();
    assert!(
        m.errors > 0,
        "the random chains were processed and refused: {m:?}"
    );
    // The transport still answers, and a proper driver still gets service.
    assert_eq!(r(&mut t, REG_MAGIC), MMIO_MAGIC);
    w(&mut t, REG_STATUS, 0);
    let mut drv = crate::devices::virtio::testing::Driver::new(&mem, 0x8_0000, 16);
    let features = dev.lock().unwrap().avail_features();
    crate::devices::virtio::testing::mmio_bring_up(&mut t, features, &[&drv]);
    assert!(t.is_activated());
    mem.write_obj(0u32, GuestAddress(0x1_0000)).unwrap(); // VIRTIO_BLK_T_IN
    mem.write_obj(0u32, GuestAddress(0x1_0004)).unwrap();
    mem.write_obj(3u64, GuestAddress(0x1_0008)).unwrap();
    use crate::devices::virtio::testing::{rd, wr};
    drv.add(&[rd(0x1_0000, 16), wr(0x2_0000, 512), wr(0x3_0000, 1)]);
    w(&mut t, REG_QUEUE_NOTIFY, 0);
    assert_eq!(drv.wait_used(1).len(), 513);
    assert_eq!(mem.read_obj::<u8>(GuestAddress(0x3_0000)).unwrap(), 0);
    assert_eq!(
        panics.load(Ordering::SeqCst),
        0,
        "no device worker panicked"
    );
}

/// Fills queue 0's rings at 0x1_0000 with random chains (random addresses, lengths,
/// flags and next indices; a valid available index) and brings the transport up.
fn bring_up_over_random_chains(t: &mut MmioTransport, next: &mut impl FnMut() -> u64) {
    use vm_memory::Bytes;
    let mem = t.mem.clone();
    for i in 0..u64::from(QUEUE_MAX) {
        let r = next();
        let addr = if r & 1 == 0 {
            (r >> 8) % MEM_SIZE as u64
        } else {
            r >> 4
        };
        let len = match (r >> 60) % 4 {
            0 => 1,
            1 => 16,
            2 => 512,
            _ => (r >> 20) as u32,
        };
        let flags = (r >> 36) as u16 & 0x7; // NEXT, WRITE, INDIRECT
        let next_idx = (r >> 40) as u16 % (QUEUE_MAX + 2);
        let desc = 0x1_0000 + i * 16;
        mem.write_obj(addr, GuestAddress(desc)).unwrap();
        mem.write_obj(len, GuestAddress(desc + 8)).unwrap();
        mem.write_obj(flags, GuestAddress(desc + 12)).unwrap();
        mem.write_obj(next_idx, GuestAddress(desc + 14)).unwrap();
        mem.write_obj(
            (next() % u64::from(QUEUE_MAX + 1)) as u16,
            GuestAddress(0x1_1004 + i * 2),
        )
        .unwrap();
    }
    mem.write_obj(0u16, GuestAddress(0x1_1000)).unwrap();
    mem.write_obj(
        (next() % u64::from(QUEUE_MAX) + 1) as u16,
        GuestAddress(0x1_1002),
    )
    .unwrap();
    let features = t.avail_features;
    negotiate(t, features);
    setup_queue(t, 0, 0x1_0000);
    w(t, REG_STATUS, ALL_OK);
}
