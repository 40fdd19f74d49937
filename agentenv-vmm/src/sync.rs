//! The one way this crate takes a lock: a lock whose holder panicked is taken anyway.
//!
//! What the VMM keeps behind its locks is plain data (counters, device registers, the vCPU
//! control state) that a panicking thread leaves consistent enough to go on with; a panic
//! in one thread (a bug, caught and reported where it happens) must not wedge `pause`,
//! `stop` or the control thread behind a poisoned lock.

use std::sync::{Condvar, Mutex, MutexGuard, PoisonError, WaitTimeoutResult};
use std::time::Duration;

/// Locks `m`, also when a thread panicked while holding it.
pub fn lock<T: ?Sized>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// [`Condvar::wait`], also when a thread panicked while holding the lock.
pub fn wait<'a, T>(cv: &Condvar, guard: MutexGuard<'a, T>) -> MutexGuard<'a, T> {
    cv.wait(guard).unwrap_or_else(PoisonError::into_inner)
}

/// [`Condvar::wait_timeout`], also when a thread panicked while holding the lock.
pub fn wait_timeout<'a, T>(
    cv: &Condvar,
    guard: MutexGuard<'a, T>,
    timeout: Duration,
) -> (MutexGuard<'a, T>, WaitTimeoutResult) {
    cv.wait_timeout(guard, timeout)
        .unwrap_or_else(PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn a_lock_poisoned_by_a_panic_is_taken_with_its_data() {
        let m = Arc::new(Mutex::new(1));
        let m2 = m.clone();
        let _ = std::thread::spawn(move || {
            let mut g = m2.lock().unwrap();
            *g = 2;
            panic!("poison it");
        })
        .join();
        assert!(m.is_poisoned());
        assert_eq!(*lock(&m), 2);
        let cv = Condvar::new();
        let (g, r) = wait_timeout(&cv, lock(&m), Duration::from_millis(1));
        assert!(r.timed_out());
        assert_eq!(*g, 2);
    }
}
