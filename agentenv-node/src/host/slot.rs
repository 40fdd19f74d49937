//! What one sandbox holds on the host: [`SandboxHost::claim`] takes it as a [`Claim`]
//! (given back on drop unless committed), [`Claim::commit`] turns it into the sandbox's
//! [`HostSlot`], and [`SandboxHost::release`] gives it back when the sandbox goes.

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use super::cgroup::{Limits, SandboxCgroup};
use super::ids::IdRange;
use super::net::{SandboxNet, Slot};
use super::{DirHook, SandboxHost, StateFile, ids, net, netpool, setup};
use crate::backend::{BackendError, SandboxSpec};
use crate::egress::SandboxEgress;
use crate::timing::Lap;

impl SandboxHost {
    /// Takes what the sandbox of `spec` needs on the host: its directory (its kept
    /// state's, when it names one), an id range, an address with a network namespace (ready from the pool when
    /// it has one), a cgroup with `limits` and the host's device allow-list. Dropping
    /// the claim before [`Claim::commit`] gives everything back.
    pub async fn claim(
        &self,
        spec: &SandboxSpec,
        limits: Limits,
    ) -> Result<Claim<'_>, BackendError> {
        let (id, kept, internet) = (
            spec.id.as_str(),
            spec.kept.as_ref(),
            spec.allow_internet_access,
        );
        let mut phases = Lap::new();
        let dir = self.sandbox_dir(id);
        let mut claim = Claim {
            host: self,
            armed: true,
            dir: dir.clone(),
            kept: None,
            ids: None,
            slot: None,
            link: None,
            cgroup: None,
            net: None,
            egress: None,
            pid: None,
            undo_hooks: Vec::new(),
        };
        match kept {
            Some(kept) => {
                std::fs::rename(&kept.path, &dir).map_err(|e| {
                    BackendError::io(
                        format!("moving {} to {}", kept.path.display(), dir.display()),
                        e,
                    )
                })?;
                claim.kept = Some(kept.path.clone());
            }
            None => std::fs::create_dir_all(&dir)
                .map_err(|e| BackendError::io(format!("creating {}", dir.display()), e))?,
        }
        phases.mark("dir");
        claim.ids = Some(self.reserve_ids(&dir).await?);
        phases.mark("ids");

        let (slot, pooled) = self.reserve_net(&dir).await?;
        claim.slot = Some(slot);
        let host_if = slot.host_ifname(&self.cfg.hosted.iface_prefix, internet);
        let sandbox_net = match pooled {
            Some(mut p) => {
                claim.link = Some(p.net.host_if.clone());
                if p.net.host_if != host_if {
                    // The host rules key on the name: it says the egress policy.
                    net::rename_host_link(&self.netlink, &p.ns, &mut p.net, host_if.clone())
                        .await
                        .map_err(setup)?;
                    claim.link = Some(host_if.clone());
                }
                p.net
            }
            None => {
                // The slot is ours now: a link already named after it is a leftover of a
                // process that died without cleaning up.
                for internet in [true, false] {
                    let name = slot.host_ifname(&self.cfg.hosted.iface_prefix, internet);
                    if let Ok(true) = net::delete_link(&self.netlink, &name).await {
                        tracing::warn!(link = %name, "deleted a leftover link of a reused address");
                    }
                }
                claim.link = Some(host_if.clone());
                self.netpool.note_inline();
                net::create_sandbox_net(&self.netlink, slot, host_if.clone())
                    .await
                    .map_err(setup)?
            }
        };
        claim.net = Some(sandbox_net);
        phases.mark("netns");
        claim.egress = Some(self.start_egress(spec, &mut claim).await?);
        phases.mark("egress");

        let cg = self.hierarchy.sandbox(&self.cfg.hosted.cgroup_parent, id);
        cg.create(limits).map_err(setup)?;
        claim.cgroup = Some(cg);
        // Before any process joins: nothing of the sandbox ever sees another device.
        claim
            .cgroup()
            .restrict_devices(self.cfg.devices)
            .map_err(setup)?;
        phases.mark("cgroup");
        Ok(claim)
    }

    /// Applies the egress policy of `spec` in the claimed namespace and serves its egress
    /// proxy, before any process of the sandbox exists.
    async fn start_egress(
        &self,
        spec: &SandboxSpec,
        claim: &mut Claim<'_>,
    ) -> Result<SandboxEgress, BackendError> {
        let net = claim.net.as_mut().expect("the namespace is claimed");
        let netns = net
            .netns
            .try_clone()
            .map_err(|e| BackendError::io("duplicating the namespace descriptor", e))?;
        let listener = net.proxy_listener.take();
        SandboxEgress::start(
            &spec.id,
            netns,
            listener,
            net::EGRESS_PROXY_PORT,
            self.dns.clone(),
            spec.egress.clone(),
        )
        .await
        .map_err(setup)
    }

    /// An id range for a new sandbox whose directory is `dir`. When every range is
    /// taken and deleted sandboxes are still being cleaned up, waits (up to the host's
    /// operation timeout) for their ranges to come back.
    async fn reserve_ids(&self, dir: &Path) -> Result<IdRange, BackendError> {
        let deadline = tokio::time::Instant::now() + self.cfg.hosted.op_timeout;
        loop {
            match self.ids.reserve(dir) {
                Ok(range) => return Ok(range),
                // Ranges of deleted sandboxes come back once their cleanup is done.
                Err(ids::IdError::Exhausted(_))
                    if self.cleanups.pending() > 0 && tokio::time::Instant::now() < deadline =>
                {
                    self.cleanups
                        .wait_any(deadline - tokio::time::Instant::now())
                        .await;
                }
                Err(ids::IdError::Exhausted(_)) => {
                    return Err(BackendError::IdPoolExhausted {
                        pool: self.ids.range().to_string(),
                    });
                }
                Err(other) => return Err(setup(other)),
            }
        }
    }

    /// The address of a new sandbox whose directory is `dir`, with a ready network
    /// namespace when the pool has one (its reservation then names `dir`).
    async fn reserve_net(
        &self,
        dir: &Path,
    ) -> Result<(Slot, Option<netpool::PooledNet>), BackendError> {
        let deadline = tokio::time::Instant::now() + self.cfg.hosted.op_timeout;
        let p = loop {
            if let Some(p) = self.netpool.take() {
                break p;
            }
            match self.pool.reserve(dir) {
                Ok(slot) => return Ok((slot, None)),
                // Addresses of deleted sandboxes come back once their cleanup is done.
                Err(net::NetError::Exhausted(_))
                    if self.cleanups.pending() > 0 && tokio::time::Instant::now() < deadline =>
                {
                    self.cleanups
                        .wait_any(deadline - tokio::time::Instant::now())
                        .await;
                }
                // The pool may hold the last free addresses in namespaces being made.
                Err(net::NetError::Exhausted(pool)) => {
                    break self
                        .netpool
                        .take_in_flight(self.cfg.hosted.op_timeout)
                        .await
                        .ok_or_else(|| BackendError::AddressPoolExhausted {
                            pool: pool.to_string(),
                        })?;
                }
                Err(other) => return Err(setup(other)),
            }
        };
        let slot = p.net.slot;
        if let Err(e) = self.pool.transfer(slot, dir) {
            drop(p);
            self.pool.release(slot);
            return Err(setup(e));
        }
        Ok((slot, Some(p)))
    }

    /// Kills whatever is left in a sandbox's cgroup (thawing it first) and waits until
    /// it is empty.
    pub async fn stop_processes(&self, slot: &HostSlot) -> Result<(), BackendError> {
        let timeout = self.cfg.hosted.op_timeout;
        if slot.cgroup.is_frozen() {
            let _ = slot.cgroup.thaw(timeout).await;
        }
        if !slot.cgroup.pids().is_empty() {
            slot.cgroup.kill_all(timeout).await.map_err(setup)?;
        }
        Ok(())
    }

    /// Gives back what a sandbox held: kills what is left in its cgroup (the backend has
    /// stopped its own process), lets its network namespace go and waits for the kernel to
    /// delete its veth pair, removes the cgroup, returns its address and id range, and
    /// removes its directory, after `finish` has run on it (to unmount what the backend
    /// mounted there, or to move what is to be kept out of it). Every step runs; errors
    /// are collected.
    pub async fn release(
        &self,
        slot: &HostSlot,
        finish: Option<&DirHook<'_>>,
    ) -> Result<(), BackendError> {
        let timeout = self.cfg.hosted.op_timeout;
        let mut errors = Vec::new();
        if let Err(e) = self.stop_processes(slot).await {
            errors.push(e.to_string());
        }
        // Its sockets in the namespace go before the namespace.
        slot.egress.shutdown().await;
        let net = slot.net.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(n) = net {
            // With its processes gone, closing the namespace lets the kernel delete the
            // veth pair; it batches concurrent teardowns, which deleting each link by
            // hand would serialize. Wait for that, then free the address.
            let (host_if, addr) = (n.host_if.clone(), n.slot);
            drop(n);
            if let Err(e) = net::wait_link_gone(&self.netlink, &host_if, timeout).await {
                tracing::warn!(link = %host_if, error = %e, "veth outlived its namespace; deleting it");
                if let Err(e) = net::delete_link(&self.netlink, &host_if).await {
                    errors.push(e.to_string());
                }
            }
            // The cgroup goes before the address: a cgroup without a reservation is a
            // leftover (see `reconcile`).
            if let Err(e) = slot.cgroup.remove(timeout).await {
                errors.push(e.to_string());
            }
            self.pool.release(addr);
        } else if let Err(e) = slot.cgroup.remove(timeout).await {
            errors.push(e.to_string());
        }
        self.ids.release(slot.ids);
        if let Some(finish) = finish
            && let Err(e) = finish(&slot.dir)
        {
            errors.push(e);
        }
        if let Err(e) = self.remove_dir(&slot.dir) {
            errors.push(e);
        }
        if errors.is_empty() {
            Ok(())
        } else {
            Err(setup(errors.join("; ")))
        }
    }
}

/// What one sandbox holds on the host while it exists.
#[derive(Debug)]
pub struct HostSlot {
    /// The sandbox's directory.
    pub dir: PathBuf,
    pub cgroup: SandboxCgroup,
    pub ids: IdRange,
    /// The network namespace (taken when the sandbox goes).
    pub net: Mutex<Option<SandboxNet>>,
    /// Its egress rules and proxy.
    pub egress: SandboxEgress,
    pub slot: Slot,
    pub host_if: String,
    pub created_at: SystemTime,
}

impl HostSlot {
    /// SIGKILL to the sandbox's main process (`main`: PID 1 of a jail, a microVM's VMM),
    /// then to everything else in its cgroup while none can fork: nothing of the sandbox
    /// runs again once this returns (the kernel may still be ending them).
    pub async fn kill_all(&self, main: Option<Pid>, timeout: Duration) -> Result<(), BackendError> {
        if let Some(pid) = main {
            let _ = kill(pid, Signal::SIGKILL);
        }
        self.cgroup.signal_kill(timeout).await.map_err(setup)
    }

    /// The sandbox's address.
    pub fn ip(&self) -> Ipv4Addr {
        self.slot.sandbox_ip()
    }

    /// Runs `f` on the network namespace, if the sandbox still has it.
    pub fn with_net<T>(&self, f: impl FnOnce(&SandboxNet) -> T) -> Option<T> {
        let net = self.net.lock().unwrap_or_else(|e| e.into_inner());
        net.as_ref().map(f)
    }

    /// The state file of the slot for `spec`.
    pub fn state(&self, spec: &SandboxSpec) -> StateFile {
        StateFile {
            id: spec.id.clone(),
            template: spec.template.clone(),
            pid: None,
            host_if: self.host_if.clone(),
            slot: self.slot.network,
            created_at: self
                .created_at
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
            id_base: Some(self.ids.base),
            cpu_count: None,
            memory_mb: None,
        }
    }
}
/// Everything a sandbox being created holds on the host; given back on drop unless
/// committed.
pub struct Claim<'a> {
    host: &'a SandboxHost,
    armed: bool,
    dir: PathBuf,
    /// The kept state the directory was made from: it goes back there.
    kept: Option<PathBuf>,
    ids: Option<IdRange>,
    slot: Option<Slot>,
    link: Option<String>,
    cgroup: Option<SandboxCgroup>,
    net: Option<SandboxNet>,
    egress: Option<SandboxEgress>,
    pid: Option<Pid>,
    /// Run on undo once the processes are gone, before the directory is removed.
    undo_hooks: Vec<Box<dyn FnOnce() + Send>>,
}

impl Claim<'_> {
    /// Runs `hook` if the create fails, after the slot's processes are gone and before
    /// its directory is removed (to unmount what the backend mounted there).
    pub fn on_undo(&mut self, hook: impl FnOnce() + Send + 'static) {
        self.undo_hooks.push(Box::new(hook));
    }

    /// The sandbox's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The sandbox's id range.
    pub fn ids(&self) -> IdRange {
        self.ids.expect("a claim has its ids")
    }

    /// The sandbox's address slot.
    pub fn slot(&self) -> Slot {
        self.slot.expect("a claim has its slot")
    }

    /// The host interface.
    pub fn host_if(&self) -> &str {
        self.link.as_deref().unwrap_or_default()
    }

    /// The cgroup.
    pub fn cgroup(&self) -> &SandboxCgroup {
        self.cgroup.as_ref().expect("a claim has its cgroup")
    }

    /// The network namespace.
    pub fn net(&self) -> &SandboxNet {
        self.net.as_ref().expect("a claim has its namespace")
    }

    /// A process started in the slot: killed (and reaped) if the create fails.
    pub fn set_pid(&mut self, pid: i32) {
        self.pid = Some(Pid::from_raw(pid));
    }

    /// The create succeeded: the sandbox holds it all now.
    pub fn commit(mut self) -> HostSlot {
        self.armed = false;
        HostSlot {
            dir: self.dir.clone(),
            cgroup: self.cgroup.take().expect("a claim has its cgroup"),
            ids: self.ids.expect("a claim has its ids"),
            net: Mutex::new(self.net.take()),
            egress: self.egress.take().expect("a claim has its egress"),
            slot: self.slot.expect("a claim has its slot"),
            host_if: self.link.take().unwrap_or_default(),
            created_at: SystemTime::now(),
        }
    }
}

impl Drop for Claim<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        if let Some(pid) = self.pid {
            let _ = kill(pid, Signal::SIGKILL);
            let _ = nix::sys::wait::waitpid(pid, None);
        }
        if let Some(cg) = self.cgroup.take() {
            for p in cg.pids() {
                let _ = kill(Pid::from_raw(p), Signal::SIGKILL);
            }
            // The directories can go once the processes are gone; a leftover is removed
            // by the next reconciliation.
            for _ in 0..100 {
                if cg.pids().is_empty() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            for d in cg.dirs() {
                let _ = std::fs::remove_dir(d);
            }
        }
        for hook in self.undo_hooks.drain(..).rev() {
            hook();
        }
        drop(self.egress.take());
        drop(self.net.take());
        if let Some(link) = self.link.take() {
            // Netlink is async; `ip` does the same synchronously from a destructor.
            let _ = std::process::Command::new("ip")
                .args(["link", "del", &link])
                .stderr(std::process::Stdio::null())
                .status();
        }
        if let Some(slot) = self.slot {
            self.host.pool.release(slot);
        }
        if let Some(ids) = self.ids {
            self.host.ids.release(ids);
        }
        if let Some(kept) = &self.kept {
            if let Err(e) = std::fs::rename(&self.dir, kept) {
                tracing::warn!(path = %kept.display(), error = %e, "returning a kept state after a failed create");
            }
        } else {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}
