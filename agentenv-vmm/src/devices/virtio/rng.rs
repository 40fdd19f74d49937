//! virtio-rng (entropy device): fills the driver's device-writable buffers from the host
//! kernel's CSPRNG (`getrandom(2)`), at most [`MAX_BYTES_PER_REQUEST`] per request.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Serialize};
use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::virtio_ids::VIRTIO_ID_RNG;
use virtio_bindings::virtio_ring::VIRTIO_RING_F_EVENT_IDX;
use virtio_queue::{DescriptorChain, Queue};
use vm_memory::Bytes;
use vmm_sys_util::eventfd::EventFd;

use super::persist::{Persist, StateError};
use super::queue_util::collect_chain;
use super::single_queue::{RequestWorker, ServeRequest};
use super::worker::{Worker, stop_worker};
use super::{ActivateContext, ActivateError, VirtioDevice, check_inactive};
use crate::memory::GuestMemoryMmap;

/// Entries of the request queue.
pub const QUEUE_SIZE: u16 = 256;
/// Bytes given for one request at most; the driver asks again for more.
pub const MAX_BYTES_PER_REQUEST: usize = 64 * 1024;

/// Counters of the entropy device.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct RngMetrics {
    /// Requests completed with entropy.
    pub requests: u64,
    /// Bytes of entropy given to the guest.
    pub bytes: u64,
    /// Requests refused (malformed chain, no writable buffer, entropy source failure).
    pub errors: u64,
}

#[derive(Default)]
struct Counters {
    requests: AtomicU64,
    bytes: AtomicU64,
    errors: AtomicU64,
}

/// The virtio entropy device.
pub struct Rng {
    acked_features: u64,
    counters: Arc<Counters>,
    worker: Option<Worker<RequestWorker<RngRequests>>>,
}

impl Default for Rng {
    fn default() -> Self {
        Self::new()
    }
}

impl Rng {
    pub fn new() -> Self {
        Self {
            acked_features: 0,
            counters: Arc::new(Counters::default()),
            worker: None,
        }
    }

    pub fn metrics(&self) -> RngMetrics {
        RngMetrics {
            requests: self.counters.requests.load(Ordering::Relaxed),
            bytes: self.counters.bytes.load(Ordering::Relaxed),
            errors: self.counters.errors.load(Ordering::Relaxed),
        }
    }

    /// Whether the worker thread is serving requests.
    pub fn is_running(&self) -> bool {
        self.worker.as_ref().is_some_and(|w| w.is_running())
    }
}

/// Fills `buf` from the kernel CSPRNG.
fn fill_random(buf: &mut [u8]) -> std::io::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        let rest = &mut buf[done..];
        // SAFETY: `rest` is a valid, writable buffer of `rest.len()` bytes for the duration
        // of the call; getrandom writes at most that many bytes.
        let n = unsafe { libc::getrandom(rest.as_mut_ptr().cast(), rest.len(), 0) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        done += n as usize;
    }
    Ok(())
}

/// What the worker needs to serve requests.
struct RngRequests {
    counters: Arc<Counters>,
    buf: Vec<u8>,
}

impl ServeRequest for RngRequests {
    fn serve(&mut self, chain: DescriptorChain<&GuestMemoryMmap>, mem: &GuestMemoryMmap) -> u32 {
        let head = chain.head_index();
        match Self::fill(mem, &mut self.buf, chain) {
            Ok(n) => {
                self.counters.requests.fetch_add(1, Ordering::Relaxed);
                self.counters.bytes.fetch_add(n as u64, Ordering::Relaxed);
                n as u32
            }
            Err(why) => {
                self.counters.errors.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(head, "virtio-rng: request refused: {why}");
                0
            }
        }
    }
}

impl RngRequests {
    fn fill(
        mem: &GuestMemoryMmap,
        buf: &mut Vec<u8>,
        chain: DescriptorChain<&GuestMemoryMmap>,
    ) -> Result<usize, String> {
        let descs = collect_chain(chain, mem).map_err(|e| e.to_string())?;
        if descs.iter().any(|d| !d.write) {
            return Err(
                "a request buffer is device-readable; entropy buffers must be writable".into(),
            );
        }
        let mut written = 0usize;
        for d in descs {
            if written == MAX_BYTES_PER_REQUEST {
                break;
            }
            // An empty buffer holds nothing, but the ones after it still count.
            let n = (d.len as usize).min(MAX_BYTES_PER_REQUEST - written);
            if n == 0 {
                continue;
            }
            buf.resize(n, 0);
            fill_random(&mut buf[..n]).map_err(|e| format!("getrandom failed: {e}"))?;
            mem.write_slice(&buf[..n], d.addr)
                .map_err(|e| format!("writing guest memory failed: {e}"))?;
            written += n;
        }
        if written == 0 {
            return Err("the request has no room for entropy".into());
        }
        Ok(written)
    }
}

impl VirtioDevice for Rng {
    fn device_type(&self) -> u32 {
        VIRTIO_ID_RNG
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &[QUEUE_SIZE]
    }

    fn avail_features(&self) -> u64 {
        (1 << VIRTIO_F_VERSION_1) | (1 << VIRTIO_RING_F_EVENT_IDX)
    }

    fn set_acked_features(&mut self, features: u64) {
        self.acked_features = features & self.avail_features();
    }

    fn read_config(&self, _offset: u64, data: &mut [u8]) {
        // The entropy device has no configuration space.
        data.fill(0);
    }

    fn write_config(&mut self, _offset: u64, _data: &[u8]) {}

    fn activate(&mut self, ctx: ActivateContext) -> Result<(), ActivateError> {
        check_inactive(&self.worker, "the entropy device")?;
        let queue = ctx.into_single_queue()?;
        let requests = RngRequests {
            counters: self.counters.clone(),
            buf: Vec::new(),
        };
        self.worker = Some(RequestWorker::spawn("virtio-rng", queue, requests)?);
        Ok(())
    }

    fn deactivate(&mut self) -> Option<(Vec<Queue>, Vec<EventFd>)> {
        stop_worker(&mut self.worker).map(RequestWorker::into_queues)
    }

    fn metrics(&self) -> serde_json::Value {
        serde_json::to_value(Self::metrics(self)).unwrap_or_default()
    }
}

/// The entropy device keeps no state of its own; the version alone is saved.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RngState {}

impl Persist for Rng {
    type State = RngState;
    const STATE_VERSION: u32 = 1;
    const NAME: &'static str = "virtio-rng";

    fn save(&self) -> RngState {
        RngState {}
    }

    fn restore(&mut self, _state: RngState) -> Result<(), StateError> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::virtio::VirtioInterrupt;
    use crate::devices::virtio::testing::{BadChain, Driver, guest_memory, is_dirty, rd, wr};
    use virtio_queue::QueueT;
    use vm_memory::GuestAddress;

    const MEM: usize = 0x40_0000;

    fn activate(dev: &mut Rng, mem: &GuestMemoryMmap, drv: &Driver) -> Arc<EventFd> {
        let kick = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        let line = Arc::new(EventFd::new(libc::EFD_NONBLOCK).unwrap());
        dev.activate(ActivateContext {
            mem: mem.clone(),
            interrupt: Arc::new(VirtioInterrupt::new(line.clone())),
            queues: vec![drv.queue()],
            queue_events: vec![kick],
        })
        .unwrap();
        line
    }

    #[test]
    fn rng_fills_writable_buffers_and_marks_them_dirty() {
        let mem = guest_memory(MEM);
        let mut drv = Driver::new(&mem, 0, 16);
        // Pending before activation: served at start.
        drv.add(&[wr(0x10_0000, 64), wr(0x10_1000, 32)]);
        let mut dev = Rng::new();
        let line = activate(&mut dev, &mem, &drv);
        let used = drv.wait_used(1);
        assert_eq!(used.len(), 96);
        let mut a = [0u8; 64];
        mem.read_slice(&mut a, GuestAddress(0x10_0000)).unwrap();
        assert_ne!(a, [0u8; 64], "64 random bytes are not all zero");
        assert!(is_dirty(&mem, 0x10_0000));
        assert!(is_dirty(&mem, 0x10_1000));
        assert_eq!(
            line.read().unwrap(),
            1,
            "the used-buffer interrupt was raised"
        );
        assert_eq!(dev.metrics().bytes, 96);
        assert_eq!(VirtioDevice::metrics(&dev)["bytes"], 96);
        assert!(dev.is_running());
        let (queues, events) = dev.deactivate().unwrap();
        assert_eq!(queues[0].next_used(), 1);
        assert_eq!(events.len(), 1);
    }

    #[test]
    fn rng_fills_the_buffers_after_an_empty_one() {
        // Found by the property test below: an empty first buffer used to end the fill, so
        // the request was refused with nothing written.
        let mem = guest_memory(MEM);
        let mut drv = Driver::new(&mem, 0, 16);
        drv.add(&[wr(0x10_0000, 0), wr(0x10_1000, 32)]);
        let mut dev = Rng::new();
        activate(&mut dev, &mem, &drv);
        assert_eq!(drv.wait_used(1).len(), 32);
        assert_eq!(dev.metrics().errors, 0);
        assert!(is_dirty(&mem, 0x10_1000));
        dev.deactivate();
    }

    #[test]
    fn rng_caps_one_request() {
        let mem = guest_memory(MEM);
        let mut drv = Driver::new(&mem, 0, 16);
        drv.add(&[wr(0x10_0000, 0x20_0000)]);
        let mut dev = Rng::new();
        activate(&mut dev, &mem, &drv);
        assert_eq!(drv.wait_used(1).len() as usize, MAX_BYTES_PER_REQUEST);
        dev.deactivate();
    }

    #[test]
    fn malformed_rng_requests_are_skipped_and_the_worker_serves_the_next() {
        let mem = guest_memory(MEM);
        let mut drv = Driver::new(&mem, 0, 16);
        let mut dev = Rng::new();
        let kick = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        let notify = kick.try_clone().unwrap();
        let line = Arc::new(EventFd::new(libc::EFD_NONBLOCK).unwrap());
        dev.activate(ActivateContext {
            mem: mem.clone(),
            interrupt: Arc::new(VirtioInterrupt::new(line)),
            queues: vec![drv.queue()],
            queue_events: vec![kick],
        })
        .unwrap();
        let bad: [BadChain; 6] = [
            ("a loop", |d| {
                d.add_loop(&[wr(0x10_0000, 16), wr(0x10_1000, 16)]);
            }),
            ("a next index past the table", |d| {
                d.add_dangling(wr(0x10_0000, 16));
            }),
            ("a buffer outside guest memory", |d| {
                d.add(&[wr(MEM as u64 + 0x1000, 16)]);
            }),
            ("an oversized length", |d| {
                d.add(&[wr(0x10_0000, u32::MAX)]);
            }),
            ("too short: no room", |d| {
                d.add(&[wr(0x10_0000, 0)]);
            }),
            ("wrong direction", |d| {
                d.add(&[rd(0x10_0000, 16)]);
            }),
        ];
        let mut n = 0;
        for (i, (what, add_bad)) in bad.iter().enumerate() {
            add_bad(&mut drv);
            notify.write(1).unwrap();
            n += 1;
            assert_eq!(drv.wait_used(n).len(), 0, "{what}: completed with nothing");
            assert_eq!(dev.metrics().errors, i as u64 + 1);
            assert!(dev.is_running(), "worker died on {what}");
            drv.add(&[wr(0x11_0000, 8)]);
            notify.write(1).unwrap();
            n += 1;
            assert_eq!(
                drv.wait_used(n).len(),
                8,
                "good request after {what} served"
            );
        }
        assert_eq!(dev.metrics().requests, 6);
        dev.deactivate().unwrap();
    }

    #[test]
    fn rng_serves_a_driver_through_the_mmio_transport() {
        use crate::devices::BusDevice;
        use crate::devices::virtio::mmio::{MmioTransport, status};
        use std::sync::Mutex;
        let mem = guest_memory(MEM);
        let mut drv = Driver::new(&mem, 0x20_0000, 16);
        let dev = Arc::new(Mutex::new(Rng::new()));
        let line = Arc::new(EventFd::new(libc::EFD_NONBLOCK).unwrap());
        let mut t = MmioTransport::new(mem.clone(), dev.clone(), line.clone()).unwrap();
        let w = |t: &mut MmioTransport, off: u64, v: u32| t.write(off, &v.to_le_bytes());
        w(&mut t, 0x70, status::ACKNOWLEDGE | status::DRIVER);
        w(&mut t, 0x24, 1);
        w(&mut t, 0x20, 1); // VIRTIO_F_VERSION_1 is bit 32
        w(
            &mut t,
            0x70,
            status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK,
        );
        w(&mut t, 0x30, 0);
        w(&mut t, 0x38, 16);
        let q = drv.queue();
        w(&mut t, 0x80, q.desc_table() as u32);
        w(&mut t, 0x90, q.avail_ring() as u32);
        w(&mut t, 0xa0, q.used_ring() as u32);
        w(&mut t, 0x44, 1);
        w(
            &mut t,
            0x70,
            status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK | status::DRIVER_OK,
        );
        assert!(t.is_activated());
        drv.add(&[wr(0x10_0000, 32)]);
        // No ioeventfd here: the QueueNotify write reaches the transport.
        w(&mut t, 0x50, 0);
        assert_eq!(drv.wait_used(1).len(), 32);
        let mut isr = [0u8; 4];
        t.read(0x60, &mut isr);
        assert_eq!(
            u32::from_le_bytes(isr),
            1,
            "InterruptStatus shows a used buffer"
        );
        assert_eq!(line.read().unwrap(), 1);
        // Reset stops the worker.
        w(&mut t, 0x70, 0);
        assert!(!dev.lock().unwrap().is_running());
    }

    #[test]
    fn rng_refuses_activation_without_its_queue() {
        let mem = guest_memory(MEM);
        let mut dev = Rng::new();
        let line = Arc::new(EventFd::new(libc::EFD_NONBLOCK).unwrap());
        let err = dev
            .activate(ActivateContext {
                mem,
                interrupt: Arc::new(VirtioInterrupt::new(line)),
                queues: vec![],
                queue_events: vec![],
            })
            .unwrap_err();
        assert!(matches!(err, ActivateError::QueueCount { got: 0, want: 1 }));
    }
}

#[cfg(test)]
mod proptests {
    //! The request queue of a hostile driver against the entropy device.

    use proptest::prelude::*;

    use super::*;
    use crate::devices::virtio::VirtioInterrupt;
    use crate::devices::virtio::hostile::{self, ByteSet, Snapshot};
    use crate::devices::virtio::queue_util::{drain_queue, notify_used};

    proptest! {
        #![proptest_config(hostile::config())]

        #[test]
        fn rng_requests_from_any_queue_fill_exactly_the_writable_bytes_they_report_and_nothing_else(
            q in hostile::queue(hostile::chain(0.85)),
            seed: u64,
        ) {
            let mem = hostile::guest_memory();
            hostile::fill(&mem, seed);
            let (queue, layout) = q.build(&mem, 0);
            let offered = hostile::offered(&mem, &layout);
            let counters = Arc::new(Counters::default());
            let mut requests = RngRequests { counters: counters.clone(), buf: Vec::new() };
            let snapshot = Snapshot::take(&mem);

            let m = mem.clone();
            let interrupt = VirtioInterrupt::new(Arc::new(EventFd::new(libc::EFD_NONBLOCK).unwrap()));
            hostile::bounded(move || {
                let mut queue = queue;
                drain_queue(&mut queue, &m, |chain| requests.serve(chain, &m));
                notify_used(&mut queue, &m, &interrupt);
            });

            // A chain that ends, lies in guest memory and is all device-writable gets its
            // first min(length, 64 KiB) bytes filled and reports exactly that; any other
            // chain is returned empty and untouched.
            let used = hostile::used(&mem, &layout, &offered)?;
            let returnable = offered.iter().filter(|c| c.head < layout.size).count();
            prop_assert_eq!(used.len(), returnable, "a request was left on the ring");
            let mut allowed = ByteSet::default();
            hostile::allow_used_ring(&mut allowed, &layout);
            let mut filled = Vec::new();
            for (len, chain) in &used {
                let servable = chain.terminated
                    && chain.all_writable()
                    && chain.buffers_in_memory(&mem);
                let want = if servable {
                    chain.writable_len().min(MAX_BYTES_PER_REQUEST as u64)
                } else {
                    0
                };
                prop_assert_eq!(u64::from(*len), want, "used length of {:?}", chain);
                for (addr, n) in chain.writable_prefix(want) {
                    allowed.insert(addr, n);
                    filled.push((addr, n));
                }
            }
            let changes = snapshot.changes(&mem);
            changes.check(&allowed, true)?;
            for (addr, n) in filled {
                let pages = (addr & !0xfff..addr + n).step_by(0x1000);
                for page in pages {
                    prop_assert!(changes.dirty_pages.contains(&page), "filled page {:#x} is not dirty", page);
                }
            }
            let c = |a: &AtomicU64| a.load(Ordering::Relaxed);
            prop_assert_eq!(c(&counters.requests) + c(&counters.errors), offered.len() as u64);
            prop_assert_eq!(c(&counters.bytes), used.iter().map(|(l, _)| u64::from(*l)).sum::<u64>());
        }
    }
}
