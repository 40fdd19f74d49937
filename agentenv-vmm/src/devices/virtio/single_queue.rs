//! Devices with one request queue (block, rng): taking the queue from the driver's setup
//! at activation, and the worker that serves it.
//!
//! The device supplies what one request means ([`ServeRequest`]); the worker drains the
//! queue on each notification (and once at start, for what was queued before), puts every
//! chain on the used ring and raises one interrupt per batch.

use std::os::unix::io::AsRawFd;
use std::sync::Arc;

use virtio_queue::{DescriptorChain, Queue, QueueT};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::eventfd::EventFd;

use super::queue_util::{drain_queue, notify_used};
use super::worker::{Worker, WorkerCtl, WorkerHandler};
use super::{ActivateContext, ActivateError, VirtioInterrupt};
use crate::memory::GuestMemoryMmap;

/// The one queue of a single-queue device, with what it needs to serve it.
pub struct SingleQueue {
    pub mem: GuestMemoryMmap,
    pub interrupt: Arc<VirtioInterrupt>,
    pub queue: Queue,
    pub event: EventFd,
}

impl ActivateContext {
    /// The queue of a device with one request queue, which the driver must have set up.
    pub fn into_single_queue(self) -> Result<SingleQueue, ActivateError> {
        self.check_queue_count(1)?;
        let (Some(queue), Some(event)) = (
            self.queues.into_iter().next(),
            self.queue_events.into_iter().next(),
        ) else {
            return Err(ActivateError::QueueCount { got: 0, want: 1 });
        };
        if !queue.ready() {
            return Err(ActivateError::Other(
                "the request queue was not set up".into(),
            ));
        }
        Ok(SingleQueue {
            mem: self.mem,
            interrupt: self.interrupt,
            queue,
            event,
        })
    }
}

/// What a single-queue device does with one request.
pub trait ServeRequest: Send + 'static {
    /// Serves one chain; returns the bytes written into its device-writable buffers.
    fn serve(&mut self, chain: DescriptorChain<&GuestMemoryMmap>, mem: &GuestMemoryMmap) -> u32;
}

/// The worker of a single-queue device.
pub struct RequestWorker<S> {
    queue: SingleQueue,
    server: S,
}

impl<S: ServeRequest> RequestWorker<S> {
    /// Starts the worker thread `name` serving `queue` with `server`.
    pub fn spawn(name: &str, queue: SingleQueue, server: S) -> Result<Worker<Self>, ActivateError> {
        let fd = queue.event.as_raw_fd();
        Worker::spawn(name, Self { queue, server }, &[(fd, 0)])
            .map_err(|e| ActivateError::Other(e.to_string()))
    }

    /// The queue and its event, for the transport (after the worker stopped).
    pub fn into_queues(self) -> (Vec<Queue>, Vec<EventFd>) {
        (vec![self.queue.queue], vec![self.queue.event])
    }

    fn process_queue(&mut self) {
        let SingleQueue {
            mem,
            interrupt,
            queue,
            ..
        } = &mut self.queue;
        let server = &mut self.server;
        if drain_queue(queue, mem, |chain| server.serve(chain, mem)) {
            notify_used(queue, mem, interrupt);
        }
    }
}

impl<S: ServeRequest> WorkerHandler for RequestWorker<S> {
    fn on_start(&mut self, _ctl: &WorkerCtl) {
        self.process_queue();
    }

    fn handle_event(&mut self, _ctl: &WorkerCtl, _token: u64, _events: EventSet) {
        // The counter may be zero if a notification raced with the start; nothing to do then.
        let _ = self.queue.event.read();
        self.process_queue();
    }
}
