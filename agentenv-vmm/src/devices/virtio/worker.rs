//! The worker thread of an active virtio device.
//!
//! A device hands a [`WorkerHandler`] (which owns its queues, their notification events and
//! whatever backend it needs) to [`Worker::spawn`] together with the file descriptors to
//! watch. The thread epolls those descriptors plus a private stop event and calls
//! [`WorkerHandler::handle_event`] with the token the descriptor was registered with.
//! [`Worker::stop`] wakes the thread through the stop event, joins it and gives the handler
//! back, so the device can return its queues to the transport.
//!
//! A handler may watch more descriptors while it runs (a vsock connection, a timer) through
//! the [`WorkerCtl`] it is given. A panic inside a handler is caught, logged and counted:
//! the thread keeps serving the next event and the queues are never lost.

use std::os::unix::io::{AsRawFd, RawFd};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread::JoinHandle;

use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::EventFd;

/// The token reserved for the worker's own stop event; a handler never sees it.
pub const STOP_TOKEN: u64 = u64::MAX;

/// How many ready descriptors one `epoll_wait` returns at most.
const EVENT_BATCH: usize = 32;

/// Why a worker could not be started or stopped cleanly.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    #[error("creating the worker's epoll or stop event failed: {0}")]
    Setup(std::io::Error),
    #[error("watching descriptor {fd} (token {token}) failed: {source}")]
    Watch {
        fd: RawFd,
        token: u64,
        source: std::io::Error,
    },
    #[error("token {0} is reserved for the worker's stop event")]
    ReservedToken(u64),
    #[error("starting the worker thread {name:?} failed: {source}")]
    Spawn {
        name: String,
        source: std::io::Error,
    },
    #[error("signalling the worker thread to stop failed: {0}")]
    Stop(std::io::Error),
    #[error("the worker thread ended abnormally; its handler (and queues) are lost")]
    Lost,
}

/// What a device runs on its worker thread.
pub trait WorkerHandler: Send + 'static {
    /// Called once on the worker thread before the first wait: process what is already
    /// pending (after a restore the guest may have queued requests that no notification
    /// will announce again).
    fn on_start(&mut self, _ctl: &WorkerCtl) {}

    /// `token` became ready with `events`.
    fn handle_event(&mut self, ctl: &WorkerCtl, token: u64, events: EventSet);
}

/// Lets a running handler change the set of watched descriptors.
pub struct WorkerCtl {
    epoll: Epoll,
}

impl WorkerCtl {
    /// Starts watching `fd` for `events`; readiness is reported with `token`.
    pub fn add(&self, fd: RawFd, token: u64, events: EventSet) -> Result<(), WorkerError> {
        if token == STOP_TOKEN {
            return Err(WorkerError::ReservedToken(token));
        }
        self.epoll
            .ctl(ControlOperation::Add, fd, EpollEvent::new(events, token))
            .map_err(|source| WorkerError::Watch { fd, token, source })
    }

    /// Changes the events or the token of a watched descriptor.
    pub fn modify(&self, fd: RawFd, token: u64, events: EventSet) -> Result<(), WorkerError> {
        if token == STOP_TOKEN {
            return Err(WorkerError::ReservedToken(token));
        }
        self.epoll
            .ctl(ControlOperation::Modify, fd, EpollEvent::new(events, token))
            .map_err(|source| WorkerError::Watch { fd, token, source })
    }

    /// Stops watching `fd` (do this before closing it).
    pub fn remove(&self, fd: RawFd) -> Result<(), WorkerError> {
        self.epoll
            .ctl(ControlOperation::Delete, fd, EpollEvent::default())
            .map_err(|source| WorkerError::Watch {
                fd,
                token: 0,
                source,
            })
    }
}

#[cfg(test)]
impl WorkerCtl {
    /// A control over an epoll of its own, for calling a handler without its thread.
    pub(crate) fn for_test() -> Self {
        WorkerCtl {
            epoll: Epoll::new().unwrap(),
        }
    }
}

/// A running worker thread that owns a handler of type `H`.
pub struct Worker<H: WorkerHandler> {
    name: String,
    stop: EventFd,
    thread: Option<JoinHandle<H>>,
    panics: Arc<AtomicU64>,
}

impl<H: WorkerHandler> Worker<H> {
    /// Starts a thread named `name` that watches each `(fd, token)` of `sources` for input
    /// and calls `handler` for each readiness. The descriptors must stay open while they are
    /// watched (normally the handler owns them).
    pub fn spawn(name: &str, handler: H, sources: &[(RawFd, u64)]) -> Result<Self, WorkerError> {
        let epoll = Epoll::new().map_err(WorkerError::Setup)?;
        let stop = EventFd::new(libc::EFD_NONBLOCK).map_err(WorkerError::Setup)?;
        let ctl = WorkerCtl { epoll };
        ctl.epoll
            .ctl(
                ControlOperation::Add,
                stop.as_raw_fd(),
                EpollEvent::new(EventSet::IN, STOP_TOKEN),
            )
            .map_err(|source| WorkerError::Watch {
                fd: stop.as_raw_fd(),
                token: STOP_TOKEN,
                source,
            })?;
        for &(fd, token) in sources {
            ctl.add(fd, token, EventSet::IN)?;
        }
        let panics = Arc::new(AtomicU64::new(0));
        let thread_panics = panics.clone();
        let thread_name = name.to_string();
        let thread = std::thread::Builder::new()
            .name(name.to_string())
            .spawn(move || run(thread_name, ctl, handler, thread_panics))
            .map_err(|source| WorkerError::Spawn {
                name: name.to_string(),
                source,
            })?;
        Ok(Self {
            name: name.to_string(),
            stop,
            thread: Some(thread),
            panics,
        })
    }

    /// Whether the thread is still serving events.
    pub fn is_running(&self) -> bool {
        self.thread.as_ref().is_some_and(|t| !t.is_finished())
    }

    /// How many times a handler call panicked (each was caught; the thread went on).
    pub fn handler_panics(&self) -> u64 {
        self.panics.load(Ordering::Relaxed)
    }

    /// Stops the thread, waits for it and returns the handler.
    pub fn stop(mut self) -> Result<H, WorkerError> {
        let thread = self.thread.take().ok_or(WorkerError::Lost)?;
        self.stop.write(1).map_err(WorkerError::Stop)?;
        thread.join().map_err(|_| {
            tracing::error!(worker = %self.name, "virtio worker thread panicked");
            WorkerError::Lost
        })
    }
}

impl<H: WorkerHandler> Drop for Worker<H> {
    fn drop(&mut self) {
        if let Some(thread) = self.thread.take() {
            if self.stop.write(1).is_ok() {
                let _ = thread.join();
            }
        }
    }
}

/// Stops the worker in `slot` (a device's worker, `None` while the device is not active)
/// and hands its handler back. A worker that does not stop cleanly is logged and gives
/// `None`: its queues are lost and the transport keeps the configuration it had.
pub fn stop_worker<H: WorkerHandler>(slot: &mut Option<Worker<H>>) -> Option<H> {
    let worker = slot.take()?;
    let name = worker.name.clone();
    match worker.stop() {
        Ok(handler) => Some(handler),
        Err(e) => {
            tracing::error!(worker = %name, error = %e, "virtio: stopping the device's worker failed");
            None
        }
    }
}

fn run<H: WorkerHandler>(
    name: String,
    ctl: WorkerCtl,
    mut handler: H,
    panics: Arc<AtomicU64>,
) -> H {
    if catch_unwind(AssertUnwindSafe(|| handler.on_start(&ctl))).is_err() {
        panics.fetch_add(1, Ordering::Relaxed);
        tracing::error!(worker = %name, "virtio worker start handler panicked; continuing");
    }
    let mut events = vec![EpollEvent::default(); EVENT_BATCH];
    loop {
        let n = match ctl.epoll.wait(-1, &mut events) {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => {
                tracing::error!(worker = %name, error = %e, "virtio worker epoll_wait failed; stopping");
                return handler;
            }
        };
        for ev in &events[..n] {
            let token = ev.data();
            if token == STOP_TOKEN {
                return handler;
            }
            let set = ev.event_set();
            if catch_unwind(AssertUnwindSafe(|| handler.handle_event(&ctl, token, set))).is_err() {
                panics.fetch_add(1, Ordering::Relaxed);
                tracing::error!(worker = %name, token, "virtio worker handler panicked; continuing");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;
    use std::time::Duration;

    struct Echo {
        evt: EventFd,
        seen: mpsc::Sender<(u64, u64)>,
        handled: u64,
    }

    impl WorkerHandler for Echo {
        fn handle_event(&mut self, _ctl: &WorkerCtl, token: u64, _events: EventSet) {
            let v = self.evt.read().unwrap_or(0);
            self.handled += 1;
            if v == 99 {
                panic!("handler bug");
            }
            let _ = self.seen.send((token, v));
        }
    }

    fn echo() -> (Echo, mpsc::Receiver<(u64, u64)>, EventFd) {
        let evt = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        let kick = evt.try_clone().unwrap();
        let (tx, rx) = mpsc::channel();
        (
            Echo {
                evt,
                seen: tx,
                handled: 0,
            },
            rx,
            kick,
        )
    }

    #[test]
    fn worker_calls_handler_with_token_and_stop_returns_handler() {
        let (h, rx, kick) = echo();
        let fd = h.evt.as_raw_fd();
        let w = Worker::spawn("test-worker", h, &[(fd, 7)]).unwrap();
        kick.write(3).unwrap();
        assert_eq!(rx.recv_timeout(Duration::from_secs(5)).unwrap(), (7, 3));
        assert!(w.is_running());
        let h = w.stop().unwrap();
        assert_eq!(h.handled, 1);
    }

    #[test]
    fn worker_survives_a_panicking_handler() {
        let (h, rx, kick) = echo();
        let fd = h.evt.as_raw_fd();
        let w = Worker::spawn("test-worker-panic", h, &[(fd, 1)]).unwrap();
        kick.write(99).unwrap();
        // The panic is caught; the next event is still served.
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while w.handler_panics() == 0 {
            assert!(std::time::Instant::now() < deadline, "panic never counted");
            std::thread::yield_now();
        }
        kick.write(5).unwrap();
        assert_eq!(rx.recv_timeout(Duration::from_secs(5)).unwrap(), (1, 5));
        assert!(w.is_running());
        let h = w.stop().unwrap();
        assert_eq!(h.handled, 2);
    }

    #[test]
    fn stop_token_is_reserved() {
        let (h, _rx, _kick) = echo();
        let fd = h.evt.as_raw_fd();
        assert!(matches!(
            Worker::spawn("test-worker-reserved", h, &[(fd, STOP_TOKEN)]),
            Err(WorkerError::ReservedToken(_))
        ));
    }
}
