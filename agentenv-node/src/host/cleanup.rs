//! The background cleanup of deleted sandboxes.
//!
//! A delete answers once the sandbox can no longer run: its processes are dead and it is
//! gone from the backend's table. What is left (unmounting its layer, letting its network
//! namespace and veth pair go, removing its cgroup, giving back its address and id
//! range, removing its directory) is a job of this queue. A job holds the sandbox's
//! resources until it is done, so an address, a namespace or an id range is handed to a
//! new sandbox only after the cleanup of the one that had it finished.
//!
//! A job that fails is logged and counted, then retried with the start-up
//! reconciliation's cleaning of one sandbox directory (which gives back only what still
//! names that directory); a job still failing after [`MAX_ATTEMPTS`] is left to the next
//! start's reconciliation. Jobs a node process does not finish (it died, or its shutdown
//! did not wait) are the same leftovers: the next start's reconciliation removes them.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::sync::Notify;

/// Attempts of a cleanup job (the first one included) before it is left to the next
/// start's reconciliation.
pub const MAX_ATTEMPTS: u32 = 5;

/// The first pause between two attempts; it doubles each time.
const FIRST_RETRY: Duration = Duration::from_millis(200);

/// Durations of finished jobs kept for [`CleanupStats::recent`].
const RECENT: usize = 256;

/// What the cleanup queue did so far.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CleanupStats {
    /// Jobs queued and not finished yet.
    pub pending: usize,
    /// Jobs finished (cleaned, or given up on).
    pub finished: u64,
    /// Failed attempts (each one logged).
    pub failures: u64,
    /// Jobs given up on after [`MAX_ATTEMPTS`] (left to the next start).
    pub abandoned: u64,
    /// How long the most recent finished jobs took, oldest first.
    pub recent: Vec<Duration>,
}

/// The queue of cleanups in progress.
#[derive(Debug, Default)]
pub struct CleanupQueue {
    pending: AtomicUsize,
    finished: AtomicU64,
    failures: AtomicU64,
    abandoned: AtomicU64,
    recent: Mutex<std::collections::VecDeque<Duration>>,
    idle: Notify,
    finished_one: Notify,
}

/// One job in the queue: counted as pending until dropped.
struct Pending(Arc<CleanupQueue>);

impl Drop for Pending {
    fn drop(&mut self) {
        self.0.finished.fetch_add(1, Ordering::SeqCst);
        if self.0.pending.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.0.idle.notify_waiters();
        }
        self.0.finished_one.notify_waiters();
    }
}

impl CleanupQueue {
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// Cleans up `what` in the background: `first` once, then `retry` (with a growing
    /// pause) while the last attempt failed, at most [`MAX_ATTEMPTS`] attempts in all.
    pub fn push<F, R, RF>(self: &Arc<Self>, what: String, first: F, retry: R)
    where
        F: Future<Output = Result<(), String>> + Send + 'static,
        R: Fn() -> RF + Send + 'static,
        RF: Future<Output = Result<(), String>> + Send + 'static,
    {
        self.pending.fetch_add(1, Ordering::SeqCst);
        let job = Pending(self.clone());
        tokio::spawn(async move {
            let started = Instant::now();
            let mut result = first.await;
            let mut attempt = 1;
            let mut pause = FIRST_RETRY;
            while let Err(e) = result {
                job.0.failures.fetch_add(1, Ordering::SeqCst);
                if attempt >= MAX_ATTEMPTS {
                    job.0.abandoned.fetch_add(1, Ordering::SeqCst);
                    tracing::error!(sandbox = %what, attempt, error = %e, "cleaning up a deleted sandbox failed; the next start's reconciliation removes what is left");
                    break;
                }
                tracing::warn!(sandbox = %what, attempt, error = %e, "cleaning up a deleted sandbox failed; retrying");
                tokio::time::sleep(pause).await;
                pause *= 2;
                attempt += 1;
                result = retry().await;
            }
            let mut recent = job.0.recent.lock();
            if recent.len() == RECENT {
                recent.pop_front();
            }
            recent.push_back(started.elapsed());
            drop(recent);
            tracing::debug!(sandbox = %what, took = ?started.elapsed(), "deleted sandbox cleaned up");
            drop(job);
        });
    }

    /// Jobs queued and not finished yet.
    pub fn pending(&self) -> usize {
        self.pending.load(Ordering::SeqCst)
    }

    /// What the queue did so far.
    pub fn stats(&self) -> CleanupStats {
        CleanupStats {
            pending: self.pending(),
            finished: self.finished.load(Ordering::SeqCst),
            failures: self.failures.load(Ordering::SeqCst),
            abandoned: self.abandoned.load(Ordering::SeqCst),
            recent: self.recent.lock().iter().copied().collect(),
        }
    }

    /// Waits until a pending job finishes (at once when none is pending) or `timeout`
    /// passed: a create that found its pool exhausted tries again then.
    pub async fn wait_any(&self, timeout: Duration) {
        let one = self.finished_one.notified();
        tokio::pin!(one);
        one.as_mut().enable();
        if self.pending() == 0 {
            return;
        }
        let _ = tokio::time::timeout(timeout, one).await;
    }

    /// Waits until no job is pending or `timeout` passed; whether the queue is empty.
    pub async fn drain(&self, timeout: Duration) -> bool {
        let wait = async {
            loop {
                let idle = self.idle.notified();
                tokio::pin!(idle);
                idle.as_mut().enable();
                if self.pending() == 0 {
                    return;
                }
                idle.await;
            }
        };
        tokio::time::timeout(timeout, wait).await.is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn drain_waits_for_every_job_and_failures_are_retried() {
        let q = CleanupQueue::new();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        q.push(
            "a".into(),
            async move {
                let _ = rx.await;
                Ok(())
            },
            || async { Ok(()) },
        );
        let tries = Arc::new(AtomicUsize::new(0));
        let t = tries.clone();
        q.push("b".into(), async { Err("busy".to_string()) }, move || {
            let t = t.clone();
            async move {
                if t.fetch_add(1, Ordering::SeqCst) == 0 {
                    Err("still busy".to_string())
                } else {
                    Ok(())
                }
            }
        });
        assert_eq!(q.pending(), 2);
        assert!(!q.drain(Duration::from_millis(10)).await);
        tx.send(()).unwrap();
        assert!(q.drain(Duration::from_secs(30)).await);
        let s = q.stats();
        assert_eq!(
            (s.pending, s.finished, s.failures, s.abandoned),
            (0, 2, 2, 0)
        );
        assert_eq!(tries.load(Ordering::SeqCst), 2);
    }
}
