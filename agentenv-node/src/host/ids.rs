//! Id ranges and user namespaces: sandbox root is an unprivileged host uid.
//!
//! Each sandbox gets its own range of [`IDS_PER_SANDBOX`] host uids and gids from a pool
//! (`AENV_JAIL_ID_POOL`, `first:count`, default [`DEFAULT_ID_POOL`]). Its user namespace
//! maps ids `0..65536` inside to `base..base+65536` on the host, so root inside is the host
//! uid `base`, which owns nothing outside the sandbox, and files the tenant writes belong to
//! its range on the host. Ranges are reserved host-wide like addresses (files
//! `<runtime>/ids/<base>` naming their owner), returned once a destroyed sandbox's cleanup
//! finished (a create that finds every range taken while cleanups are pending waits for
//! them, as it does for addresses) and reclaimed by reconciliation when their owner is
//! gone.
//!
//! The namespace is created by a short-lived helper task that first becomes the range's
//! base uid, so the namespace's owner is that uid: per-user kernel counters charged up the
//! namespace chain (inotify instances and watches, pending signals, message queues, locked
//! memory) land on the sandbox's own host uid, never on host root.

use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use super::reserve::{IndexName, Reservations, ReserveError};

/// Ids of one sandbox (uids and gids alike).
pub const IDS_PER_SANDBOX: u32 = 65536;

/// The default id pool: 15,258 ranges from uid 1,000,000,000, above the ranges distributions
/// hand out in /etc/subuid.
pub const DEFAULT_ID_POOL: &str = "1000000000:1000000000";

/// Errors of id ranges and user namespaces.
#[derive(Debug, thiserror::Error)]
pub enum IdError {
    #[error(
        "invalid id pool {0:?}: write it as <first id>:<number of ids>, with room for at least one range of 65536 ids below 4294967295 (e.g. {DEFAULT_ID_POOL})"
    )]
    InvalidPool(String),
    #[error(
        "no free id range in the pool {0}: destroy sandboxes or configure a larger AENV_JAIL_ID_POOL"
    )]
    Exhausted(IdPoolRange),
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
}

fn io_err(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> IdError {
    let context = context.into();
    move |source| IdError::Io { context, source }
}

/// The ids sandboxes may be given: `first..first+count`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IdPoolRange {
    pub first: u32,
    pub count: u32,
}

impl IdPoolRange {
    /// How many sandbox ranges fit.
    pub fn ranges(&self) -> u32 {
        self.count / IDS_PER_SANDBOX
    }
}

impl Default for IdPoolRange {
    fn default() -> Self {
        DEFAULT_ID_POOL.parse().expect("the default id pool parses")
    }
}

impl std::fmt::Display for IdPoolRange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.first, self.count)
    }
}

impl FromStr for IdPoolRange {
    type Err = IdError;

    fn from_str(s: &str) -> Result<Self, IdError> {
        let bad = || IdError::InvalidPool(s.to_string());
        let (first, count) = s.trim().split_once(':').ok_or_else(bad)?;
        let first: u32 = first.trim().parse().map_err(|_| bad())?;
        let count: u32 = count.trim().parse().map_err(|_| bad())?;
        // Uid 0 is host root and 4294967295 is "no id": ranges stay strictly between.
        let end = u64::from(first) + u64::from(count);
        if first == 0 || count < IDS_PER_SANDBOX || end > u64::from(u32::MAX) {
            return Err(bad());
        }
        Ok(Self { first, count })
    }
}

/// One sandbox's ids: host `base..base+65536` appear as `0..65536` inside.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct IdRange {
    pub base: u32,
}

impl IdRange {
    /// The host uid (and gid) of an id inside the sandbox.
    pub fn host_id(&self, inside: u32) -> u32 {
        self.base + inside
    }

    /// The `uid_map`/`gid_map` line of the range.
    pub fn map_line(&self) -> String {
        format!("0 {} {}\n", self.base, IDS_PER_SANDBOX)
    }

    /// A new user namespace mapping this range, owned by the range's base uid.
    pub fn user_namespace(&self) -> Result<OwnedFd, IdError> {
        new_user_namespace(self.base, &self.map_line())
    }
}

/// Reservation file names: the range's base id.
#[derive(Debug)]
struct RangeNames {
    pool: IdPoolRange,
}

impl IndexName for RangeNames {
    fn name(&self, idx: u32) -> String {
        (self.pool.first + idx * IDS_PER_SANDBOX).to_string()
    }

    fn parse(&self, name: &str) -> Option<u32> {
        let base: u32 = name.parse().ok()?;
        let off = base.checked_sub(self.pool.first)?;
        (off % IDS_PER_SANDBOX == 0).then_some(off / IDS_PER_SANDBOX)
    }
}

/// The host-wide pool of id ranges.
#[derive(Debug)]
pub struct IdPool {
    range: IdPoolRange,
    reservations: Reservations<RangeNames>,
}

impl IdPool {
    /// The pool `range`, with reservations under `<runtime_dir>/ids`.
    pub fn new(range: IdPoolRange, runtime_dir: &Path) -> Result<Self, IdError> {
        let dir = runtime_dir.join("ids");
        let reservations =
            Reservations::new(dir.clone(), range.ranges(), RangeNames { pool: range })
                .map_err(io_err(format!("creating {}", dir.display())))?;
        Ok(Self {
            range,
            reservations,
        })
    }

    /// The configured range.
    pub fn range(&self) -> IdPoolRange {
        self.range
    }

    fn index(&self, r: IdRange) -> Option<u32> {
        let off = r.base.checked_sub(self.range.first)?;
        let idx = off / IDS_PER_SANDBOX;
        (off % IDS_PER_SANDBOX == 0 && idx < self.range.ranges()).then_some(idx)
    }

    fn range_at(&self, idx: u32) -> IdRange {
        IdRange {
            base: self.range.first + idx * IDS_PER_SANDBOX,
        }
    }

    /// Reserves a free range for `owner` (a sandbox directory).
    pub fn reserve(&self, owner: &Path) -> Result<IdRange, IdError> {
        match self.reservations.reserve(owner) {
            Ok(idx) => Ok(self.range_at(idx)),
            Err(ReserveError::Exhausted) => Err(IdError::Exhausted(self.range)),
            Err(ReserveError::Io(context, source)) => Err(IdError::Io { context, source }),
        }
    }

    /// Hands a range over to `owner`.
    pub fn transfer(&self, r: IdRange, owner: &Path) -> Result<(), IdError> {
        let idx = self.index(r).ok_or_else(|| IdError::Io {
            context: format!("id range {} is not in the pool {}", r.base, self.range),
            source: std::io::Error::from(std::io::ErrorKind::InvalidInput),
        })?;
        self.reservations
            .transfer(idx, owner)
            .map_err(io_err(format!("handing over the id range {}", r.base)))
    }

    /// Returns a range to the pool.
    pub fn release(&self, r: IdRange) {
        if let Some(idx) = self.index(r) {
            self.reservations.release(idx);
        }
    }

    /// Every reservation of the pool on this host: `(range, owner)`.
    pub fn reservations(&self) -> Vec<(IdRange, PathBuf)> {
        self.reservations
            .list()
            .into_iter()
            .filter(|(idx, _)| *idx < self.range.ranges())
            .map(|(idx, owner)| (self.range_at(idx), owner))
            .collect()
    }

    /// Releases ranges whose owner directory is gone; returns them.
    pub fn release_orphans(&self) -> Vec<IdRange> {
        self.reservations
            .release_orphans()
            .into_iter()
            .map(|idx| self.range_at(idx))
            .collect()
    }
}

/// What the helper task of [`new_user_namespace`] runs: it becomes `uid`, enters a new user
/// namespace, reports through the pipe and waits to be killed.
struct HelperArgs {
    /// The uid to become first (`None`: stay root).
    uid: Option<u32>,
    ready_w: libc::c_int,
}

extern "C" fn helper_main(arg: *mut libc::c_void) -> libc::c_int {
    // SAFETY: `arg` points at the HelperArgs the parent keeps alive until this task is
    // reaped (the task shares the parent's memory).
    let args = unsafe { &*(arg as *const HelperArgs) };
    // Raw system calls on this task only (libc's setresuid would signal every thread of
    // the process, which this task shares memory with but is not part of).
    // SAFETY: plain integer arguments.
    let ok = unsafe {
        match args.uid {
            Some(id) => {
                libc::syscall(libc::SYS_setresgid, id, id, id) == 0
                    && libc::syscall(libc::SYS_setresuid, id, id, id) == 0
            }
            None => true,
        }
    } && {
        // SAFETY: plain integer argument.
        unsafe { libc::syscall(libc::SYS_unshare, libc::CLONE_NEWUSER) == 0 }
    };
    let byte: u8 = if ok { 1 } else { 0 };
    // SAFETY: writes one byte from the stack to the pipe; the loop only waits for the kill.
    unsafe {
        libc::syscall(libc::SYS_write, args.ready_w, &byte as *const u8, 1usize);
        loop {
            libc::syscall(libc::SYS_pause);
        }
    }
}

/// A new user namespace owned by host `uid` with `map` as its uid and gid map. Where the
/// host refuses user namespaces to unprivileged users (an AppArmor or sysctl restriction),
/// the namespace is owned by root instead, with a warning: the sandbox is as isolated, but
/// its per-user kernel counters are then charged to host root too.
fn new_user_namespace(uid: u32, map: &str) -> Result<OwnedFd, IdError> {
    static ROOT_OWNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if !ROOT_OWNED.load(std::sync::atomic::Ordering::Relaxed) {
        match user_namespace_as(Some(uid), map) {
            Ok(fd) => return Ok(fd),
            Err(HelperError::Refused) => {
                ROOT_OWNED.store(true, std::sync::atomic::Ordering::Relaxed);
                tracing::warn!(
                    "this host refuses user namespaces to unprivileged users; sandbox user namespaces are owned by root, so per-user kernel limits (inotify, signals) are shared with host root"
                );
            }
            Err(HelperError::Other(e)) => return Err(e),
        }
    }
    user_namespace_as(None, map).map_err(|e| match e {
        HelperError::Refused => io_err(
            "creating a user namespace (is user namespace support enabled, and /proc/sys/user/max_user_namespaces above 0?)",
        )(std::io::Error::from_raw_os_error(libc::EPERM)),
        HelperError::Other(e) => e,
    })
}

enum HelperError {
    /// The helper could not become the uid or create the namespace.
    Refused,
    Other(IdError),
}

fn user_namespace_as(uid: Option<u32>, map: &str) -> Result<OwnedFd, HelperError> {
    let (ready_r, ready_w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)
        .map_err(|e| HelperError::Other(io_err("creating a pipe")(e.into())))?;
    let args = HelperArgs {
        uid,
        ready_w: std::os::fd::AsRawFd::as_raw_fd(&ready_w),
    };
    let mut stack = vec![0u8; 16 * 1024];
    // SAFETY: the stack pointer is the end of a live buffer (stacks grow down) that outlives
    // the task (reaped below before it is dropped); CLONE_VM shares memory, so the task
    // must not allocate: `helper_main` only makes raw system calls.
    let pid = unsafe {
        libc::clone(
            helper_main,
            stack.as_mut_ptr().add(stack.len()).cast(),
            libc::CLONE_VM | libc::SIGCHLD,
            &args as *const HelperArgs as *mut libc::c_void,
        )
    };
    if pid < 0 {
        return Err(HelperError::Other(io_err(
            "starting the user namespace helper",
        )(
            std::io::Error::last_os_error()
        )));
    }
    let pid = nix::unistd::Pid::from_raw(pid);
    let result = (|| {
        let mut byte = [0u8; 1];
        loop {
            match nix::unistd::read(&ready_r, &mut byte) {
                Ok(1) => break,
                Ok(_) => {
                    return Err(HelperError::Other(io_err("the user namespace helper")(
                        std::io::ErrorKind::UnexpectedEof.into(),
                    )));
                }
                Err(nix::errno::Errno::EINTR) => continue,
                Err(e) => {
                    return Err(HelperError::Other(io_err("the user namespace helper")(
                        e.into(),
                    )));
                }
            }
        }
        if byte[0] != 1 {
            return Err(HelperError::Refused);
        }
        let other = |what: String| move |e| HelperError::Other(io_err(what)(e));
        for file in ["uid_map", "gid_map"] {
            let path = format!("/proc/{pid}/{file}");
            std::fs::write(&path, map).map_err(other(format!("writing {path}")))?;
        }
        let path = format!("/proc/{pid}/ns/user");
        let f = std::fs::File::open(&path).map_err(other(format!("opening {path}")))?;
        Ok(OwnedFd::from(f))
    })();
    let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
    let _ = nix::sys::wait::waitpid(pid, None);
    drop(stack);
    result
}

/// Probes that this kernel can give a directory an id-mapped mount (what the jail's
/// template root needs); the error says which kernel is needed.
pub fn check_idmapped_mounts(dir: &Path, range: IdRange) -> Result<(), String> {
    let userns = range.user_namespace().map_err(|e| e.to_string())?;
    let c = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes())
        .map_err(|_| format!("{} contains a NUL byte", dir.display()))?;
    let tree = super::spawn::open_tree_clone(&c).map_err(|e| {
        format!(
            "open_tree on {}: {e} (needs Linux 5.12 or later)",
            dir.display()
        )
    })?;
    super::spawn::set_idmap(&tree, std::os::fd::AsRawFd::as_raw_fd(&userns)).map_err(|e| {
        format!(
            "an id-mapped mount of {} failed: {e} (the jail needs Linux 5.19 or later and a file system with id-mapped mount support, such as ext4, xfs or btrfs)",
            dir.display()
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    #[test]
    fn pools_parse_with_room_for_a_range_and_say_how_to_write_them() {
        let p: IdPoolRange = "100000:131072".parse().unwrap();
        assert_eq!(p.ranges(), 2);
        assert_eq!(IdPoolRange::default().ranges(), 1_000_000_000 / 65536);
        for bad in ["", "0:65536", "1:100", "abc", "4294967000:65536", "5"] {
            let e = bad.parse::<IdPoolRange>().unwrap_err().to_string();
            assert!(e.contains("<first id>:<number of ids>"), "{bad}: {e}");
        }
    }

    #[test]
    fn ranges_are_reserved_per_owner_and_exhaustion_names_the_setting() {
        let dir = tempfile::tempdir().unwrap();
        let pool = IdPool::new("200000:131072".parse().unwrap(), dir.path()).unwrap();
        let owner = dir.path().join("a");
        std::fs::create_dir(&owner).unwrap();
        let a = pool.reserve(&owner).unwrap();
        let b = pool.reserve(&dir.path().join("b")).unwrap();
        assert_ne!(a, b);
        assert!([200000, 265536].contains(&a.base));
        let e = pool.reserve(&owner).unwrap_err().to_string();
        assert!(e.contains("AENV_JAIL_ID_POOL"), "{e}");
        // b's owner directory never existed: an orphan.
        assert_eq!(pool.release_orphans(), vec![b]);
        pool.release(a);
        assert!(pool.reservations().is_empty());
    }

    #[test]
    fn a_user_namespace_maps_the_range_and_is_owned_by_its_base_uid() {
        if !nix::unistd::Uid::effective().is_root() {
            eprintln!("SKIPPED: user namespaces with a foreign owner need root");
            return;
        }
        let r = IdRange {
            base: 1_234_567_808,
        };
        let ns = r.user_namespace().unwrap();
        // The namespace file's owner is the namespace's owner.
        let m = std::fs::metadata(format!(
            "/proc/self/fd/{}",
            std::os::fd::AsRawFd::as_raw_fd(&ns)
        ))
        .unwrap();
        assert!(m.ino() > 0);
        // NS_GET_OWNER_UID (_IO(0xb7, 0x4)) tells the owner.
        let mut uid: libc::uid_t = 0;
        // SAFETY: the ioctl writes one uid_t into `uid`.
        let rc = unsafe {
            libc::ioctl(
                std::os::fd::AsRawFd::as_raw_fd(&ns),
                0xb704 as _,
                &mut uid as *mut libc::uid_t,
            )
        };
        assert_eq!(rc, 0, "{}", std::io::Error::last_os_error());
        assert_eq!(uid, r.base);
    }

    #[test]
    fn a_file_system_without_id_mapped_mounts_is_refused_naming_the_kernel_needed() {
        if !nix::unistd::Uid::effective().is_root() {
            eprintln!("SKIPPED: id-mapped mounts need root");
            return;
        }
        // procfs supports no id mapping, on any kernel.
        let e = check_idmapped_mounts(
            Path::new("/proc"),
            IdRange {
                base: 1_000_000_000,
            },
        )
        .unwrap_err();
        assert!(e.contains("Linux 5.19 or later"), "{e}");
        assert!(e.contains("/proc"), "{e}");
    }

    #[test]
    fn this_kernel_supports_id_mapped_mounts_of_a_directory() {
        if !nix::unistd::Uid::effective().is_root() {
            eprintln!("SKIPPED: id-mapped mounts need root");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        check_idmapped_mounts(
            dir.path(),
            IdRange {
                base: 1_000_000_000,
            },
        )
        .unwrap();
    }
}
