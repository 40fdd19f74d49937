//! A warm pool of sandbox network namespaces.
//!
//! Making a network namespace with its veth pair takes a few netlink requests that the
//! kernel serializes (under RTNL) across every sandbox being created at once. The pool
//! makes them ahead of time: a create takes a ready namespace and a background task makes
//! the next one, never on a create's critical path.
//!
//! A pooled namespace is complete: its address is reserved, the host end of its veth is
//! named for internet access (`<prefix>i…`), both ends are up and addressed and the
//! default route is set. A create that asks for no internet access renames the host end
//! (`<prefix>n…`), which is what the host rules key on (see [`super::net`]).
//!
//! Reservations of pooled namespaces name the pool's directory
//! `<data>/jail/netpool/<instance>` as their owner; a create hands its reservation over to
//! the sandbox's directory. The directory exists as long as the pool, so other node
//! processes never take its reservations for leftovers; a directory of another instance
//! is what a crashed node process left, and reconciliation releases its reservations and
//! links (see [`leftovers`]).

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rtnetlink::Handle;
use tokio::sync::Notify;

use super::net::{self, AddressPool, NetError, NsNetlink, SandboxNet, Slot};

/// How long a failed build waits before the pool tries again.
const RETRY_AFTER: Duration = Duration::from_secs(1);
/// How long releasing a pooled namespace may wait for its veth to go.
const RELEASE_TIMEOUT: Duration = Duration::from_secs(5);

/// A ready namespace taken from the pool.
#[derive(Debug)]
pub struct PooledNet {
    /// The namespace and its host interface (named for internet access).
    pub net: SandboxNet,
    /// A netlink connection inside the namespace.
    pub ns: NsNetlink,
}

/// What the pool did so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NetPoolStats {
    /// Namespaces the pool keeps ready (0: the pool is off).
    pub size: usize,
    /// Namespaces ready now.
    pub ready: usize,
    /// Namespaces being made now.
    pub building: usize,
    /// Creates that took a pooled namespace.
    pub taken: u64,
    /// Creates that made their namespace themselves (the pool was empty).
    pub built_inline: u64,
    /// Namespaces the pool made.
    pub built: u64,
}

struct State {
    ready: VecDeque<PooledNet>,
    building: usize,
    closed: bool,
}

struct Shared {
    size: usize,
    iface_prefix: String,
    owner: PathBuf,
    addresses: Arc<AddressPool>,
    netlink: Handle,
    state: Mutex<State>,
    /// A take happened (or the pool closes): refill.
    wake: Notify,
    /// A build finished (its namespace is ready, or it failed).
    finished: Notify,
    taken: AtomicU64,
    built_inline: AtomicU64,
    built: AtomicU64,
}

impl Shared {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The pool of one backend. Dropping it releases what it holds (synchronously, best
/// effort); [`NetPool::shutdown`] does the same and waits for the kernel.
pub struct NetPool {
    shared: Arc<Shared>,
    task: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl NetPool {
    /// Starts a pool of `size` namespaces (0: none) owned by the directory `owner`
    /// (created here), and its refill task.
    pub fn start(
        size: usize,
        iface_prefix: &str,
        owner: PathBuf,
        addresses: Arc<AddressPool>,
        netlink: Handle,
    ) -> Result<Self, NetError> {
        std::fs::create_dir_all(&owner).map_err(|source| NetError::Io {
            context: format!("creating {}", owner.display()),
            source,
        })?;
        let shared = Arc::new(Shared {
            size,
            iface_prefix: iface_prefix.to_string(),
            owner,
            addresses,
            netlink,
            state: Mutex::new(State {
                ready: VecDeque::new(),
                building: 0,
                closed: false,
            }),
            wake: Notify::new(),
            finished: Notify::new(),
            taken: AtomicU64::new(0),
            built_inline: AtomicU64::new(0),
            built: AtomicU64::new(0),
        });
        let task = (size > 0).then(|| tokio::spawn(refill(shared.clone())));
        Ok(Self {
            shared,
            task: Mutex::new(task),
        })
    }

    /// The directory the pool's reservations name as their owner.
    pub fn owner(&self) -> &Path {
        &self.shared.owner
    }

    /// A ready namespace, if there is one; either way the pool refills in the background.
    pub fn take(&self) -> Option<PooledNet> {
        if self.shared.size == 0 {
            return None;
        }
        let taken = self.shared.state().ready.pop_front();
        if taken.is_some() {
            self.shared.taken.fetch_add(1, Ordering::Relaxed);
        }
        self.shared.wake.notify_one();
        taken
    }

    /// Waits (at most `timeout`) for a namespace being made, when none is ready: what a
    /// create does when every free address is held by the pool.
    pub async fn take_in_flight(&self, timeout: Duration) -> Option<PooledNet> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let finished = self.shared.finished.notified();
            tokio::pin!(finished);
            finished.as_mut().enable();
            {
                let mut st = self.shared.state();
                if let Some(p) = st.ready.pop_front() {
                    drop(st);
                    self.shared.taken.fetch_add(1, Ordering::Relaxed);
                    self.shared.wake.notify_one();
                    return Some(p);
                }
                if st.building == 0 || st.closed {
                    return None;
                }
            }
            if tokio::time::timeout_at(deadline, finished).await.is_err() {
                return None;
            }
        }
    }

    /// Counts a create that made its namespace itself.
    pub fn note_inline(&self) {
        self.shared.built_inline.fetch_add(1, Ordering::Relaxed);
    }

    pub fn stats(&self) -> NetPoolStats {
        let st = self.shared.state();
        NetPoolStats {
            size: self.shared.size,
            ready: st.ready.len(),
            building: st.building,
            taken: self.shared.taken.load(Ordering::Relaxed),
            built_inline: self.shared.built_inline.load(Ordering::Relaxed),
            built: self.shared.built.load(Ordering::Relaxed),
        }
    }

    /// Host interfaces of the namespaces ready now.
    pub fn interfaces(&self) -> Vec<String> {
        self.shared
            .state()
            .ready
            .iter()
            .map(|p| p.net.host_if.clone())
            .collect()
    }

    /// Stops refilling and releases every pooled namespace and its address, waiting until
    /// the kernel has removed their links.
    pub async fn shutdown(&self) {
        self.shared.state().closed = true;
        self.shared.wake.notify_one();
        let task = self.task.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(task) = task {
            // The task ends after the build in progress (whose namespace it releases).
            let _ = task.await;
        }
        let ready: Vec<PooledNet> = self.shared.state().ready.drain(..).collect();
        futures::future::join_all(ready.into_iter().map(|p| release(&self.shared, p))).await;
        if let Err(e) = std::fs::remove_dir(&self.shared.owner) {
            if e.kind() != std::io::ErrorKind::NotFound {
                tracing::warn!(path = %self.shared.owner.display(), error = %e, "removing the namespace pool's directory");
            }
        }
    }
}

impl Drop for NetPool {
    fn drop(&mut self) {
        let ready: Vec<PooledNet> = {
            let mut st = self.shared.state();
            st.closed = true;
            st.ready.drain(..).collect()
        };
        if let Some(task) = self.task.lock().unwrap_or_else(|e| e.into_inner()).take() {
            task.abort();
        }
        if ready.is_empty() && !self.shared.owner.exists() {
            return;
        }
        // Without a runtime to wait on: delete the links with `ip` (synchronous), then
        // free the addresses. Builds cut short hold reservations too: all of the pool's go.
        let known: Vec<(Slot, String)> = ready
            .iter()
            .map(|p| (p.net.slot, p.net.host_if.clone()))
            .collect();
        drop(ready);
        let del = |name: &str| {
            let _ = std::process::Command::new("ip")
                .args(["link", "del", name])
                .stderr(std::process::Stdio::null())
                .status();
        };
        for (slot, owner) in self.shared.addresses.reservations() {
            if owner != self.shared.owner {
                continue;
            }
            match known.iter().find(|(s, _)| *s == slot) {
                Some((_, name)) => del(name),
                None => {
                    for internet in [true, false] {
                        del(&slot.host_ifname(&self.shared.iface_prefix, internet));
                    }
                }
            }
            self.shared.addresses.release(slot);
        }
        let _ = std::fs::remove_dir(&self.shared.owner);
    }
}

/// Closes a pooled namespace (the kernel deletes its veth), waits for its link to go and
/// frees its address.
async fn release(shared: &Shared, p: PooledNet) {
    let (host_if, slot) = (p.net.host_if.clone(), p.net.slot);
    drop(p);
    if let Err(e) = net::wait_link_gone(&shared.netlink, &host_if, RELEASE_TIMEOUT).await {
        tracing::warn!(link = %host_if, error = %e, "pooled veth outlived its namespace; deleting it");
        if let Err(e) = net::delete_link(&shared.netlink, &host_if).await {
            tracing::warn!(link = %host_if, error = %e, "deleting a pooled veth");
        }
    }
    shared.addresses.release(slot);
}

/// Makes one namespace for the pool.
async fn build(shared: &Shared) -> Result<PooledNet, NetError> {
    let slot = shared.addresses.reserve(&shared.owner)?;
    let host_if = slot.host_ifname(&shared.iface_prefix, true);
    match net::create_sandbox_net_with_netlink(&shared.netlink, slot, host_if).await {
        Ok((net, ns)) => Ok(PooledNet { net, ns }),
        Err(e) => {
            shared.addresses.release(slot);
            Err(e)
        }
    }
}

/// Keeps the pool full: makes namespaces one at a time until `size` are ready, then waits
/// for a take. Ends when the pool closes.
async fn refill(shared: Arc<Shared>) {
    loop {
        loop {
            {
                let mut st = shared.state();
                if st.closed {
                    return;
                }
                if st.ready.len() + st.building >= shared.size {
                    break;
                }
                st.building += 1;
            }
            let result = build(&shared).await;
            // What to do once the lock is released.
            enum Next {
                Continue,
                Release(PooledNet),
                Wait,
                Retry,
            }
            let next = {
                let mut st = shared.state();
                st.building -= 1;
                match result {
                    Ok(p) if st.closed => Next::Release(p),
                    Ok(p) => {
                        st.ready.push_back(p);
                        shared.built.fetch_add(1, Ordering::Relaxed);
                        Next::Continue
                    }
                    // Every address is taken: wait for the next take (a destroy frees one).
                    Err(NetError::Exhausted(pool)) => {
                        tracing::debug!(%pool, "namespace pool: no free address");
                        Next::Wait
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "namespace pool: making a namespace failed");
                        Next::Retry
                    }
                }
            };
            shared.finished.notify_waiters();
            let retry = match next {
                Next::Continue => continue,
                Next::Release(p) => {
                    release(&shared, p).await;
                    return;
                }
                Next::Wait => false,
                Next::Retry => true,
            };
            if retry {
                tokio::time::sleep(RETRY_AFTER).await;
                continue;
            }
            break;
        }
        shared.wake.notified().await;
    }
}

/// Releases what the pools of other (crashed) instances left in `pools_dir`, except the
/// pool owned by `own`: their links and reservations, then their directories. Returns
/// what it removed, for the reconciliation report.
pub async fn leftovers(
    pools_dir: &Path,
    own: &Path,
    addresses: &AddressPool,
    netlink: &Handle,
    iface_prefix: &str,
) -> Vec<String> {
    let mut removed = Vec::new();
    let Ok(entries) = std::fs::read_dir(pools_dir) else {
        return removed;
    };
    let stale: Vec<PathBuf> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| p != own)
        .collect();
    if stale.is_empty() {
        return removed;
    }
    for (slot, owner) in addresses.reservations() {
        if !stale.contains(&owner) {
            continue;
        }
        release_slot(addresses, netlink, iface_prefix, slot, &mut removed).await;
    }
    for dir in stale {
        match std::fs::remove_dir_all(&dir) {
            Ok(()) => removed.push(format!("namespace pool {}", dir.display())),
            Err(e) => {
                tracing::warn!(path = %dir.display(), error = %e, "removing a leftover namespace pool")
            }
        }
    }
    removed
}

async fn release_slot(
    addresses: &AddressPool,
    netlink: &Handle,
    iface_prefix: &str,
    slot: Slot,
    removed: &mut Vec<String>,
) {
    for internet in [true, false] {
        let name = slot.host_ifname(iface_prefix, internet);
        if let Ok(true) = net::delete_link(netlink, &name).await {
            removed.push(format!("link {name}"));
        }
    }
    addresses.release(slot);
    removed.push(format!("address {}", slot.sandbox_ip()));
}
