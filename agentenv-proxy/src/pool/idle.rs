//! Idle connections of one kind, kept per node authority in shards.
//!
//! One shard per thread that uses the pool (a thread picks its shard once):
//! a request takes and returns connections under a lock no other thread
//! touches; only when its own shard has none does it look into the others',
//! without waiting on their locks. Each shard keeps, per authority, a stack
//! of idle connections: the most recently used one is reused first, and the
//! oldest ones are the first to go when the stack is full or they stayed
//! idle longer than the idle timeout.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use http::uri::Authority;
use parking_lot::Mutex;
use tokio::time::Instant;

/// What the idle stacks ask of a connection.
pub(super) trait Reusable {
    /// It can take a request now (asked when it is checked out).
    fn is_ready(&self) -> bool;
    /// The node closed it (asked when it is returned and when idle
    /// connections are swept).
    fn is_closed(&self) -> bool;
}

/// Idle connections of one kind.
pub(super) struct IdleSet<C> {
    shards: Box<[Mutex<Shard<C>>]>,
    idle_timeout: Duration,
    max_per_authority: usize,
}

struct Shard<C> {
    /// Keyed by node authorities from the scheduler's configuration, not by
    /// client input: a fast hash is enough.
    idle: HashMap<Authority, Vec<Idle<C>>, rustc_hash::FxBuildHasher>,
}

impl<C> Default for Shard<C> {
    fn default() -> Self {
        Self {
            idle: HashMap::default(),
        }
    }
}

struct Idle<C> {
    conn: C,
    since: Instant,
}

/// Where a thread keeps its idle connections: threads are numbered on first
/// use and take shard `number % shards`.
fn thread_number() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static NUMBER: usize = NEXT.fetch_add(1, Ordering::Relaxed);
    }
    NUMBER.with(|n| *n)
}

impl<C: Reusable> IdleSet<C> {
    /// `shards` shards (at least one), closing connections idle for
    /// `idle_timeout` and keeping at most `max_per_authority` per authority
    /// in each shard.
    pub(super) fn new(shards: usize, idle_timeout: Duration, max_per_authority: usize) -> Self {
        Self {
            shards: (0..shards.max(1)).map(|_| Mutex::default()).collect(),
            idle_timeout,
            max_per_authority,
        }
    }

    fn own_shard(&self) -> usize {
        thread_number() % self.shards.len()
    }

    /// The most recently used idle connection that can take a request now:
    /// from this thread's shard, else (without waiting on a lock) from
    /// another thread's.
    pub(super) fn checkout(&self, authority: &Authority, now: Instant) -> Option<C> {
        let shards = &self.shards;
        let own = self.own_shard();
        if let Some(conn) = self.take(&mut shards[own].lock(), authority, now) {
            return Some(conn);
        }
        (1..shards.len())
            .map(|i| &shards[(own + i) % shards.len()])
            .find_map(|shard| self.take(&mut *shard.try_lock()?, authority, now))
    }

    fn take(&self, shard: &mut Shard<C>, authority: &Authority, now: Instant) -> Option<C> {
        let stack = shard.idle.get_mut(authority)?;
        while let Some(idle) = stack.pop() {
            if now.saturating_duration_since(idle.since) >= self.idle_timeout {
                // Everything below is older still.
                stack.clear();
                break;
            }
            if idle.conn.is_ready() {
                return Some(idle.conn);
            }
            // Closed by the node, or not (yet) able to take a request:
            // dropping it closes the connection.
        }
        None
    }

    /// Keeps `conn` in this thread's shard, unless the node closed it. A
    /// full stack makes room by closing its oldest connection.
    pub(super) fn release(&self, authority: &Authority, conn: C, now: Instant) {
        if conn.is_closed() {
            return;
        }
        let idle = Idle { conn, since: now };
        let mut shard = self.shards[self.own_shard()].lock();
        match shard.idle.get_mut(authority) {
            Some(stack) => {
                if stack.len() >= self.max_per_authority {
                    stack.remove(0);
                }
                stack.push(idle);
            }
            None => {
                shard.idle.insert(authority.clone(), vec![idle]);
            }
        }
    }

    /// Closes idle connections that expired or that the node closed.
    pub(super) fn evict_stale(&self, now: Instant) {
        for shard in self.shards.iter() {
            shard.lock().idle.retain(|_, stack| {
                stack.retain(|idle| {
                    now.saturating_duration_since(idle.since) < self.idle_timeout
                        && !idle.conn.is_closed()
                });
                !stack.is_empty()
            });
        }
    }

    /// Idle connections to `authority` across all shards, closed ones that
    /// were not looked at yet included.
    pub(super) fn count(&self, authority: &Authority) -> usize {
        self.shards
            .iter()
            .map(|s| s.lock().idle.get(authority).map_or(0, Vec::len))
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A connection that is ready unless closed.
    struct Conn {
        id: u32,
        closed: bool,
    }

    impl Reusable for Conn {
        fn is_ready(&self) -> bool {
            !self.closed
        }
        fn is_closed(&self) -> bool {
            self.closed
        }
    }

    fn conn(id: u32) -> Conn {
        Conn { id, closed: false }
    }

    fn authority(s: &'static str) -> Authority {
        Authority::from_static(s)
    }

    #[test]
    fn the_most_recent_connection_is_reused_and_the_oldest_makes_room() {
        let set = IdleSet::new(1, Duration::from_secs(90), 2);
        let (a, now) = (authority("node-a:80"), Instant::now());
        for id in 1..=3 {
            set.release(&a, conn(id), now);
        }
        assert_eq!(set.count(&a), 2);
        assert_eq!(set.checkout(&a, now).map(|c| c.id), Some(3));
        assert_eq!(set.checkout(&a, now).map(|c| c.id), Some(2));
        assert!(set.checkout(&a, now).is_none());
    }

    #[test]
    fn closed_connections_are_not_kept_nor_handed_out() {
        let set = IdleSet::new(1, Duration::from_secs(90), 8);
        let (a, now) = (authority("node-a:80"), Instant::now());
        set.release(
            &a,
            Conn {
                id: 1,
                closed: true,
            },
            now,
        );
        assert_eq!(set.count(&a), 0);
        set.release(&a, conn(2), now);
        set.shards[0].lock().idle.get_mut(&a).unwrap()[0]
            .conn
            .closed = true;
        assert!(set.checkout(&a, now).is_none());
    }

    #[test]
    fn idle_connections_past_the_timeout_are_closed() {
        let set = IdleSet::new(1, Duration::from_millis(100), 8);
        let (gone, live) = (authority("gone:80"), authority("live:80"));
        let t0 = Instant::now();
        set.release(&gone, conn(1), t0);
        assert_eq!(set.count(&gone), 1);
        let later = t0 + Duration::from_millis(150);
        set.release(&live, conn(2), later);
        // Past the timeout, a sweep closes it, whatever node it was for.
        set.evict_stale(later);
        assert_eq!(set.count(&gone), 0);
        assert_eq!(set.count(&live), 1);
        assert!(set.checkout(&gone, later).is_none());
        assert!(set.checkout(&live, later).is_some());
        // Checked out past the timeout, it is closed too.
        set.release(&live, conn(3), t0);
        assert!(set.checkout(&live, later).is_none());
    }

    #[test]
    fn another_threads_shard_is_looked_into_when_this_ones_is_empty() {
        let set = std::sync::Arc::new(IdleSet::new(2, Duration::from_secs(90), 8));
        let a = authority("node-a:80");
        let now = Instant::now();
        // Returned from two other threads: wherever they landed, this
        // thread finds them.
        for _ in 0..2 {
            let (set, a) = (set.clone(), a.clone());
            std::thread::spawn(move || set.release(&a, conn(1), now))
                .join()
                .unwrap();
        }
        assert_eq!(set.count(&a), 2);
        assert!(set.checkout(&a, now).is_some());
        assert!(set.checkout(&a, now).is_some());
        assert!(set.checkout(&a, now).is_none());
    }
}
