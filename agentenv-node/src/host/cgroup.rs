//! Per-sandbox cgroups on cgroup v1 or v2, behind one small interface.
//!
//! v1: one directory per hierarchy that carries a controller we use (`cpu`, `cpuacct`,
//! `memory`, `pids`, `freezer`, `devices`; co-mounted controllers share a directory). v2:
//! one directory in the unified hierarchy, with `cpu`, `memory` and `pids` enabled in the
//! parent's `cgroup.subtree_control` and the built-in freezer.
//!
//! Devices ([`SandboxCgroup::restrict_devices`], rules in [`super::devices`]): the v1
//! `devices` controller, or on v2 a `BPF_PROG_TYPE_CGROUP_DEVICE` program attached to the
//! sandbox's directory. A host without either is refused: root in a sandbox could create
//! and open any host device node.
//!
//! Sandbox cgroups live under `<parent>/<sandbox id>`, where `<parent>` is relative to the
//! node's own cgroup (or absolute from the hierarchy root when it starts with `/`).

use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::time::Instant;

use super::devices::{self, DeviceError, DeviceRule};

/// Errors of the cgroup layer.
#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    #[error(
        "no usable cgroup hierarchy: need cgroup v1 with cpu, cpuacct, memory, pids, freezer and devices mounted, or cgroup v2 with cpu, memory and pids available and cgroup device BPF programs ({0})"
    )]
    Unsupported(String),
    #[error(transparent)]
    Devices(#[from] DeviceError),
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
    #[error("cgroup {path} did not reach state {want} within {timeout:?}")]
    Timeout {
        path: String,
        want: &'static str,
        timeout: Duration,
    },
}

fn io_err(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> CgroupError {
    let context = context.into();
    move |source| CgroupError::Io { context, source }
}

/// How long a freeze or thaw is waited for by polling between yields, before sleeping.
const STATE_SPIN: Duration = Duration::from_millis(1);

/// The controllers the jail needs on cgroup v1.
pub const V1_CONTROLLERS: &[&str] = &["cpu", "cpuacct", "memory", "pids", "freezer", "devices"];
/// The controllers the jail enables on cgroup v2.
pub const V2_CONTROLLERS: &[&str] = &["cpu", "memory", "pids"];

/// Which hierarchy the host uses, and where the node's own cgroups are.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Hierarchy {
    /// `(controllers of the mount, mount point, the node's cgroup in it)` per hierarchy.
    V1(Vec<V1Mount>),
    /// Mount point of the unified hierarchy and the node's cgroup in it.
    V2 { mount: PathBuf, own: PathBuf },
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct V1Mount {
    pub controllers: Vec<String>,
    pub mount: PathBuf,
    pub own: PathBuf,
}

/// Limits of one sandbox.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    pub cpus: u32,
    pub memory_bytes: u64,
    pub max_processes: u32,
}

/// What a sandbox uses now.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    pub cpu_ns: u64,
    pub memory_bytes: u64,
    pub memory_limit_bytes: u64,
    pub processes: u64,
    /// Page cache (v1 `total_cache`, v2 `file` of `memory.stat`).
    pub cache_bytes: u64,
}

/// The value of `key` in a `memory.stat` text (0 when absent).
fn stat_value(stat: &str, key: &str) -> u64 {
    stat.lines()
        .filter_map(|l| l.split_once(' '))
        .find(|(k, _)| *k == key)
        .and_then(|(_, v)| v.trim().parse().ok())
        .unwrap_or(0)
}

/// CFS period used for CPU quotas.
pub const CPU_PERIOD_US: u64 = 100_000;

impl Hierarchy {
    /// Detects the host's hierarchy from `/proc/self/mountinfo` and `/proc/self/cgroup`.
    /// cgroup v1 is used when it carries every controller of [`V1_CONTROLLERS`], else v2.
    /// On v2 it also loads the device program once, so that a kernel without cgroup
    /// device BPF programs is refused here rather than at the first sandbox.
    pub fn detect() -> Result<Self, CgroupError> {
        let mountinfo = std::fs::read_to_string("/proc/self/mountinfo")
            .map_err(io_err("reading /proc/self/mountinfo"))?;
        let own = std::fs::read_to_string("/proc/self/cgroup")
            .map_err(io_err("reading /proc/self/cgroup"))?;
        let h = Self::from_texts(&mountinfo, &own, |p| {
            std::fs::read_to_string(p.join("cgroup.controllers")).ok()
        })?;
        if let Hierarchy::V2 { mount, .. } = &h {
            devices::check_bpf_support().map_err(|e| {
                CgroupError::Unsupported(format!(
                    "cgroup v2 at {} needs cgroup device BPF programs to keep sandboxes from using host devices: {e}",
                    mount.display()
                ))
            })?;
        }
        Ok(h)
    }

    /// [`Hierarchy::detect`] on given texts; `controllers_of` reads a v2 cgroup's
    /// `cgroup.controllers`.
    pub fn from_texts(
        mountinfo: &str,
        own_cgroup: &str,
        controllers_of: impl Fn(&Path) -> Option<String>,
    ) -> Result<Self, CgroupError> {
        let mut v1 = Vec::new();
        let mut v2_mount = None;
        for line in mountinfo.lines() {
            // id parent maj:min root mountpoint options [optional...] - fstype source superopts
            let Some((left, right)) = line.split_once(" - ") else {
                continue;
            };
            let fields: Vec<&str> = left.split(' ').collect();
            let rfields: Vec<&str> = right.split(' ').collect();
            if fields.len() < 5 || rfields.len() < 3 {
                continue;
            }
            let (root, mount) = (fields[3], fields[4]);
            match rfields[0] {
                "cgroup" if root == "/" => {
                    let controllers: Vec<String> = rfields[2]
                        .split(',')
                        .filter(|o| V1_CONTROLLERS.contains(o))
                        .map(str::to_string)
                        .collect();
                    if !controllers.is_empty() {
                        v1.push((controllers, PathBuf::from(mount)));
                    }
                }
                "cgroup2" if root == "/" && v2_mount.is_none() => {
                    v2_mount = Some(PathBuf::from(mount));
                }
                _ => {}
            }
        }
        let mut own_v1 = Vec::new();
        let mut own_v2 = None;
        for line in own_cgroup.lines() {
            let mut parts = line.splitn(3, ':');
            let (_, ctrls, path) = match (parts.next(), parts.next(), parts.next()) {
                (Some(a), Some(b), Some(c)) => (a, b, c),
                _ => continue,
            };
            if ctrls.is_empty() {
                own_v2 = Some(PathBuf::from(path));
            } else {
                own_v1.push((
                    ctrls.split(',').map(str::to_string).collect::<Vec<_>>(),
                    PathBuf::from(path),
                ));
            }
        }
        let has_v1 = |c: &str| v1.iter().any(|(cs, _)| cs.iter().any(|x| x == c));
        let missing_v1: Vec<&str> = V1_CONTROLLERS
            .iter()
            .copied()
            .filter(|c| !has_v1(c))
            .collect();
        if missing_v1.is_empty() {
            let mounts = v1
                .into_iter()
                .map(|(controllers, mount)| {
                    let own = own_v1
                        .iter()
                        .find(|(cs, _)| cs.iter().any(|c| controllers.contains(c)))
                        .map(|(_, p)| p.clone())
                        .unwrap_or_else(|| PathBuf::from("/"));
                    V1Mount {
                        controllers,
                        mount,
                        own,
                    }
                })
                .collect();
            return Ok(Hierarchy::V1(mounts));
        }
        let mut v2_missing = None;
        if let Some(mount) = v2_mount {
            let own = own_v2.unwrap_or_else(|| PathBuf::from("/"));
            let available = controllers_of(&mount).unwrap_or_default();
            let missing: Vec<&str> = V2_CONTROLLERS
                .iter()
                .copied()
                .filter(|c| !available.split_whitespace().any(|a| a == *c))
                .collect();
            if missing.is_empty() {
                return Ok(Hierarchy::V2 { mount, own });
            }
            v2_missing = Some(format!(
                "cgroup v2 at {} lacks {}",
                mount.display(),
                missing.join(", ")
            ));
        }
        // A v1 host that lacks some of our controllers (a hybrid host's unified hierarchy
        // carries none of them): say what v1 lacks.
        if !v1.is_empty() {
            let mut msg = format!("cgroup v1 lacks {}", missing_v1.join(", "));
            if missing_v1.contains(&"devices") {
                msg.push_str(
                    "; sandboxes must not run without the devices controller, or root in a sandbox could create and open host device nodes: mount it (mount -t cgroup -o devices cgroup /sys/fs/cgroup/devices)",
                );
            }
            return Err(CgroupError::Unsupported(msg));
        }
        Err(CgroupError::Unsupported(
            v2_missing.unwrap_or_else(|| "no cgroup mounts found".into()),
        ))
    }

    pub fn version(&self) -> u8 {
        match self {
            Hierarchy::V1(_) => 1,
            Hierarchy::V2 { .. } => 2,
        }
    }

    /// The parent directories sandbox cgroups are created in (one per v1 hierarchy).
    fn parent_dirs(&self, parent: &str) -> Vec<PathBuf> {
        let join = |mount: &Path, own: &Path| {
            let base = if parent.starts_with('/') {
                mount.to_path_buf()
            } else {
                mount.join(own.strip_prefix("/").unwrap_or(own))
            };
            base.join(parent.trim_start_matches('/'))
        };
        match self {
            Hierarchy::V1(mounts) => mounts.iter().map(|m| join(&m.mount, &m.own)).collect(),
            Hierarchy::V2 { mount, own } => vec![join(mount, own)],
        }
    }

    /// Creates the parent cgroups (and on v2 enables the controllers down to them).
    pub fn prepare_parent(&self, parent: &str) -> Result<(), CgroupError> {
        for dir in self.parent_dirs(parent) {
            std::fs::create_dir_all(&dir).map_err(io_err(format!("creating {}", dir.display())))?;
        }
        if let Hierarchy::V2 { mount, .. } = self {
            let dir = &self.parent_dirs(parent)[0];
            // Enable controllers on every level from the mount point down to the parent.
            let rel = dir.strip_prefix(mount).unwrap_or(Path::new(""));
            let mut level = mount.clone();
            let enable = V2_CONTROLLERS
                .iter()
                .map(|c| format!("+{c}"))
                .collect::<Vec<_>>()
                .join(" ");
            let mut levels = vec![level.clone()];
            for comp in rel.components() {
                level = level.join(comp);
                levels.push(level.clone());
            }
            for l in levels {
                let f = l.join("cgroup.subtree_control");
                std::fs::write(&f, &enable).map_err(io_err(format!(
                    "enabling {enable} in {} (on cgroup v2 the parent must be a delegated cgroup without processes; set the jail's cgroup_parent)",
                    f.display()
                )))?;
            }
        }
        Ok(())
    }

    /// The cgroup of sandbox `id` (not created yet).
    pub fn sandbox(&self, parent: &str, id: &str) -> SandboxCgroup {
        SandboxCgroup {
            version: self.version(),
            dirs: self
                .parent_dirs(parent)
                .into_iter()
                .map(|d| d.join(id))
                .collect(),
            controllers: match self {
                Hierarchy::V1(mounts) => mounts.iter().map(|m| m.controllers.clone()).collect(),
                Hierarchy::V2 { .. } => {
                    vec![V2_CONTROLLERS.iter().map(|s| s.to_string()).collect()]
                }
            },
        }
    }

    /// Names of the sandbox cgroups that exist under `parent`.
    pub fn list(&self, parent: &str) -> Vec<String> {
        let mut names = std::collections::BTreeSet::new();
        for dir in self.parent_dirs(parent) {
            if let Ok(entries) = std::fs::read_dir(&dir) {
                for e in entries.flatten() {
                    if e.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                        names.insert(e.file_name().to_string_lossy().into_owned());
                    }
                }
            }
        }
        names.into_iter().collect()
    }
}

/// The cgroup(s) of one sandbox.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SandboxCgroup {
    version: u8,
    dirs: Vec<PathBuf>,
    controllers: Vec<Vec<String>>,
}

impl SandboxCgroup {
    /// The cgroup directories (one per v1 hierarchy, one on v2).
    pub fn dirs(&self) -> &[PathBuf] {
        &self.dirs
    }

    fn dir_with(&self, controller: &str) -> &Path {
        self.controllers
            .iter()
            .position(|cs| cs.iter().any(|c| c == controller))
            .map(|i| self.dirs[i].as_path())
            .unwrap_or(self.dirs[0].as_path())
    }

    /// The `cgroup.procs` files a process writes `0` to in order to join.
    pub fn procs_files(&self) -> Vec<PathBuf> {
        self.dirs.iter().map(|d| d.join("cgroup.procs")).collect()
    }

    /// The files a single-threaded process writes `0` to in order to join: `tasks` on
    /// v1, `cgroup.procs` on v2.
    ///
    /// On v1, moving the writing thread itself (`0` to `tasks`) skips the host-wide lock
    /// that moving a whole process takes (`cgroup_threadgroup_rwsem`, whose write side
    /// waits for an RCU grace period and for every fork and exit on the host); for a
    /// process with one thread both move the same. v2 moves processes only.
    pub fn join_files(&self) -> Vec<PathBuf> {
        let file = if self.version == 1 {
            "tasks"
        } else {
            "cgroup.procs"
        };
        self.dirs.iter().map(|d| d.join(file)).collect()
    }

    /// Restricts the devices the cgroup's processes may use to `rules` (for example
    /// [`devices::STANDARD`] or [`devices::MICROVM`]); everything else is denied, `mknod`
    /// included unless a rule grants it. Call it right after [`SandboxCgroup::create`],
    /// before any process joins. Calling it again replaces the list.
    ///
    /// v1: `a` to `devices.deny`, then one `devices.allow` line per rule (so a failure
    /// part-way leaves fewer devices allowed, never more). v2: attaches a cgroup device
    /// BPF program built from the rules (see [`devices`]), which stays attached until the
    /// cgroup is removed.
    pub fn restrict_devices(&self, rules: &[DeviceRule]) -> Result<(), CgroupError> {
        devices::validate(rules)?;
        if self.version != 1 {
            devices::attach_bpf(&self.dirs[0], rules)?;
            return Ok(());
        }
        let dir = self
            .controllers
            .iter()
            .position(|cs| cs.iter().any(|c| c == "devices"))
            .map(|i| &self.dirs[i])
            .ok_or_else(|| {
                CgroupError::Unsupported(
                    "this cgroup v1 hierarchy has no devices controller, so sandbox devices cannot be restricted".into(),
                )
            })?;
        let deny = dir.join("devices.deny");
        std::fs::write(&deny, "a").map_err(io_err(format!(
            "writing \"a\" to {} (denying every device)",
            deny.display()
        )))?;
        let allow = dir.join("devices.allow");
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .open(&allow)
            .map_err(io_err(format!("opening {}", allow.display())))?;
        for line in devices::v1_lines(rules) {
            // One rule per write(2): the kernel parses each write on its own.
            std::io::Write::write_all(&mut file, line.as_bytes())
                .map_err(io_err(format!("writing {line:?} to {}", allow.display())))?;
        }
        Ok(())
    }

    fn write(&self, controller: &str, file: &str, value: &str) -> Result<(), CgroupError> {
        let path = self.dir_with(controller).join(file);
        std::fs::write(&path, value)
            .map_err(io_err(format!("writing {value:?} to {}", path.display())))
    }

    fn read(&self, controller: &str, file: &str) -> Result<String, CgroupError> {
        let path = self.dir_with(controller).join(file);
        std::fs::read_to_string(&path).map_err(io_err(format!("reading {}", path.display())))
    }

    /// Creates the directories and sets the limits. On failure the directories are removed.
    pub fn create(&self, limits: Limits) -> Result<(), CgroupError> {
        let result = self.create_inner(limits);
        if result.is_err() {
            for d in &self.dirs {
                let _ = std::fs::remove_dir(d);
            }
        }
        result
    }

    fn create_inner(&self, limits: Limits) -> Result<(), CgroupError> {
        for d in &self.dirs {
            std::fs::create_dir(d).map_err(io_err(format!("creating {}", d.display())))?;
        }
        let quota = u64::from(limits.cpus) * CPU_PERIOD_US;
        let mem = limits.memory_bytes.to_string();
        let pids = limits.max_processes.to_string();
        if self.version == 1 {
            self.write("cpu", "cpu.cfs_period_us", &CPU_PERIOD_US.to_string())?;
            self.write("cpu", "cpu.cfs_quota_us", &quota.to_string())?;
            self.write("memory", "memory.limit_in_bytes", &mem)?;
            // Swap counts against the same limit where swap accounting exists.
            if self
                .dir_with("memory")
                .join("memory.memsw.limit_in_bytes")
                .exists()
            {
                self.write("memory", "memory.memsw.limit_in_bytes", &mem)?;
            }
            self.write("pids", "pids.max", &pids)?;
        } else {
            self.write("cpu", "cpu.max", &format!("{quota} {CPU_PERIOD_US}"))?;
            self.write("memory", "memory.max", &mem)?;
            if self.dir_with("memory").join("memory.swap.max").exists() {
                self.write("memory", "memory.swap.max", "0")?;
            }
            self.write("pids", "pids.max", &pids)?;
        }
        Ok(())
    }

    /// Processes in the cgroup.
    pub fn pids(&self) -> Vec<i32> {
        self.read(
            if self.version == 1 { "pids" } else { "cpu" },
            "cgroup.procs",
        )
        .map(|s| s.lines().filter_map(|l| l.trim().parse().ok()).collect())
        .unwrap_or_default()
    }

    /// Freezes every process; returns once all are frozen.
    pub async fn freeze(&self, timeout: Duration) -> Result<(), CgroupError> {
        if self.version == 1 {
            self.write("freezer", "freezer.state", "FROZEN")?;
            self.wait_for(
                "freezer",
                "freezer.state",
                "FROZEN",
                |s| s.trim() == "FROZEN",
                timeout,
            )
            .await
        } else {
            self.write("cpu", "cgroup.freeze", "1")?;
            self.wait_for(
                "cpu",
                "cgroup.events",
                "frozen 1",
                |s| s.lines().any(|l| l.trim() == "frozen 1"),
                timeout,
            )
            .await
        }
    }

    /// Thaws every process; returns once none is frozen.
    pub async fn thaw(&self, timeout: Duration) -> Result<(), CgroupError> {
        if self.version == 1 {
            self.write("freezer", "freezer.state", "THAWED")?;
            self.wait_for(
                "freezer",
                "freezer.state",
                "THAWED",
                |s| s.trim() == "THAWED",
                timeout,
            )
            .await
        } else {
            self.write("cpu", "cgroup.freeze", "0")?;
            self.wait_for(
                "cpu",
                "cgroup.events",
                "frozen 0",
                |s| s.lines().any(|l| l.trim() == "frozen 0"),
                timeout,
            )
            .await
        }
    }

    async fn wait_for(
        &self,
        controller: &str,
        file: &str,
        want: &'static str,
        done: impl Fn(&str) -> bool,
        timeout: Duration,
    ) -> Result<(), CgroupError> {
        // A freeze or thaw usually completes within tens of microseconds: the state is
        // polled between yields for a moment (a timer's sleep lasts at least its 1 ms
        // tick), then with sleeps.
        let spin_until = std::time::Instant::now() + STATE_SPIN;
        let deadline = Instant::now() + timeout;
        let mut pause = Duration::from_millis(1);
        loop {
            if done(&self.read(controller, file)?) {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(CgroupError::Timeout {
                    path: self.dir_with(controller).display().to_string(),
                    want,
                    timeout,
                });
            }
            if std::time::Instant::now() < spin_until {
                tokio::task::yield_now().await;
                continue;
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_millis(5));
        }
    }

    /// Whether the cgroup is frozen (or freezing).
    pub fn is_frozen(&self) -> bool {
        if self.version == 1 {
            self.read("freezer", "freezer.state")
                .map(|s| s.trim() != "THAWED")
                .unwrap_or(false)
        } else {
            self.read("cpu", "cgroup.freeze")
                .map(|s| s.trim() == "1")
                .unwrap_or(false)
        }
    }

    /// Sends SIGKILL to every process in the cgroup (frozen ones included) while none can
    /// fork, and thaws it so that they die: once this returns, no process of the cgroup
    /// runs user code again (they may still be exiting).
    pub async fn signal_kill(&self, timeout: Duration) -> Result<(), CgroupError> {
        if self.version == 2 && self.dirs[0].join("cgroup.kill").exists() {
            self.write("cpu", "cgroup.kill", "1")?;
        } else {
            // Freeze so nothing forks while we kill, kill, then thaw so the kills land.
            let frozen = self.freeze(timeout).await;
            for pid in self.pids() {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
            let thawed = self.thaw(timeout).await;
            return frozen.and(thawed);
        }
        self.thaw(timeout).await
    }

    /// Kills every process in the cgroup (frozen ones included) and waits until it is
    /// empty.
    pub async fn kill_all(&self, timeout: Duration) -> Result<(), CgroupError> {
        let deadline = Instant::now() + timeout;
        let _ = self.signal_kill(timeout).await;
        let mut pause = Duration::from_micros(100);
        loop {
            if self.pids().is_empty() {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(CgroupError::Timeout {
                    path: self.dirs[0].display().to_string(),
                    want: "empty",
                    timeout,
                });
            }
            for pid in self.pids() {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_millis(10));
        }
    }

    /// Removes the directories (the cgroup must be empty); retries while the kernel still
    /// reports it busy.
    pub async fn remove(&self, timeout: Duration) -> Result<(), CgroupError> {
        let deadline = Instant::now() + timeout;
        for d in &self.dirs {
            loop {
                match std::fs::remove_dir(d) {
                    Ok(()) => break,
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => break,
                    Err(e)
                        if Instant::now() < deadline && e.raw_os_error() == Some(libc::EBUSY) =>
                    {
                        tokio::time::sleep(Duration::from_millis(1)).await;
                    }
                    Err(e) => return Err(io_err(format!("removing {}", d.display()))(e)),
                }
            }
        }
        Ok(())
    }

    /// Whether any of the directories still exists.
    pub fn exists(&self) -> bool {
        self.dirs.iter().any(|d| d.exists())
    }

    /// Current usage.
    pub fn usage(&self) -> Result<Usage, CgroupError> {
        let num = |s: String| s.trim().parse::<u64>().unwrap_or(u64::MAX);
        if self.version == 1 {
            Ok(Usage {
                cpu_ns: num(self.read("cpuacct", "cpuacct.usage")?),
                memory_bytes: num(self.read("memory", "memory.usage_in_bytes")?),
                memory_limit_bytes: num(self.read("memory", "memory.limit_in_bytes")?),
                processes: num(self.read("pids", "pids.current")?),
                cache_bytes: stat_value(&self.read("memory", "memory.stat")?, "total_cache"),
            })
        } else {
            let stat = self.read("cpu", "cpu.stat")?;
            let usec = stat
                .lines()
                .find_map(|l| l.strip_prefix("usage_usec "))
                .and_then(|v| v.trim().parse::<u64>().ok())
                .unwrap_or(0);
            let max = self.read("memory", "memory.max")?;
            Ok(Usage {
                cpu_ns: usec * 1000,
                memory_bytes: num(self.read("memory", "memory.current")?),
                memory_limit_bytes: if max.trim() == "max" {
                    u64::MAX
                } else {
                    num(max)
                },
                processes: num(self.read("pids", "pids.current")?),
                cache_bytes: stat_value(&self.read("memory", "memory.stat")?, "file"),
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_stat_values_are_read_by_key() {
        let v1 = "cache 4096\nrss 8192\ntotal_cache 12288\ntotal_rss 8192\n";
        assert_eq!(stat_value(v1, "total_cache"), 12288);
        assert_eq!(stat_value(v1, "cache"), 4096);
        let v2 = "anon 100\nfile 2048\nfile_mapped 5\n";
        assert_eq!(stat_value(v2, "file"), 2048);
        assert_eq!(stat_value(v2, "missing"), 0);
    }

    const MOUNTINFO_V1: &str = "\
30 23 0:26 / /sys/fs/cgroup ro,nosuid - tmpfs tmpfs ro,mode=755
31 30 0:27 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw
32 30 0:28 / /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct
33 30 0:29 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory
34 30 0:30 / /sys/fs/cgroup/pids rw - cgroup cgroup rw,pids
35 30 0:31 / /sys/fs/cgroup/freezer rw - cgroup cgroup rw,freezer
36 30 0:32 / /sys/fs/cgroup/systemd rw - cgroup cgroup rw,xattr,name=systemd
37 30 0:33 / /sys/fs/cgroup/devices rw - cgroup cgroup rw,devices
";
    const OWN_V1: &str = "6:devices:/svc/a\n5:freezer:/\n4:pids:/\n3:memory:/svc/a\n2:cpu,cpuacct:/\n1:name=systemd:/\n0::/\n";

    #[test]
    fn v1_is_detected_with_comounted_controllers_and_own_cgroups() {
        let h = Hierarchy::from_texts(MOUNTINFO_V1, OWN_V1, |_| None).unwrap();
        assert_eq!(h.version(), 1);
        let cg = h.sandbox("agentenv", "sbx1");
        let dirs: Vec<String> = cg.dirs().iter().map(|d| d.display().to_string()).collect();
        assert_eq!(
            dirs,
            vec![
                "/sys/fs/cgroup/cpu,cpuacct/agentenv/sbx1",
                "/sys/fs/cgroup/memory/svc/a/agentenv/sbx1",
                "/sys/fs/cgroup/pids/agentenv/sbx1",
                "/sys/fs/cgroup/freezer/agentenv/sbx1",
                "/sys/fs/cgroup/devices/svc/a/agentenv/sbx1",
            ]
        );
        assert_eq!(
            cg.join_files()[0],
            Path::new("/sys/fs/cgroup/cpu,cpuacct/agentenv/sbx1/tasks")
        );
        assert_eq!(cg.join_files().len(), 5);
        assert_eq!(
            cg.dir_with("devices"),
            Path::new("/sys/fs/cgroup/devices/svc/a/agentenv/sbx1")
        );
        assert_eq!(
            cg.dir_with("cpuacct"),
            Path::new("/sys/fs/cgroup/cpu,cpuacct/agentenv/sbx1")
        );
        assert_eq!(
            cg.dir_with("memory"),
            Path::new("/sys/fs/cgroup/memory/svc/a/agentenv/sbx1")
        );
        // An absolute parent ignores the node's own cgroup.
        let abs = h.sandbox("/x", "s");
        assert_eq!(
            abs.dir_with("memory"),
            Path::new("/sys/fs/cgroup/memory/x/s")
        );
    }

    #[test]
    fn v2_is_detected_when_v1_lacks_controllers() {
        let mi = "31 23 0:27 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n";
        let h = Hierarchy::from_texts(mi, "0::/system.slice/aenv.service\n", |_| {
            Some("cpuset cpu io memory pids\n".into())
        })
        .unwrap();
        assert_eq!(
            h,
            Hierarchy::V2 {
                mount: "/sys/fs/cgroup".into(),
                own: "/system.slice/aenv.service".into()
            }
        );
        let cg = h.sandbox("agentenv", "s1");
        assert_eq!(
            cg.procs_files(),
            vec![PathBuf::from(
                "/sys/fs/cgroup/system.slice/aenv.service/agentenv/s1/cgroup.procs"
            )]
        );
        assert_eq!(cg.join_files(), cg.procs_files());
    }

    /// The hierarchies of this kind of host: every v1 controller in its own mount, and an
    /// empty unified hierarchy beside them.
    const MOUNTINFO_HYBRID: &str = "\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
33 31 0:30 / /sys/fs/cgroup/cpuacct rw,relatime - cgroup cgroup rw,cpuacct
34 31 0:31 / /sys/fs/cgroup/cpuset rw,relatime - cgroup cgroup rw,cpuset
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
36 31 0:33 / /sys/fs/cgroup/devices rw,relatime - cgroup cgroup rw,devices
37 31 0:34 / /sys/fs/cgroup/freezer rw,relatime - cgroup cgroup rw,freezer
38 31 0:35 / /sys/fs/cgroup/blkio rw,relatime - cgroup cgroup rw,blkio
39 31 0:36 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
";
    const OWN_HYBRID: &str = "9:name=systemd:/\n8:pids:/\n7:blkio:/\n6:freezer:/\n5:devices:/\n4:memory:/process_api/b7\n3:cpuset:/\n2:cpuacct:/\n1:cpu:/\n0::/\n";

    #[test]
    fn v1_with_separate_mounts_includes_the_devices_hierarchy() {
        let h =
            Hierarchy::from_texts(MOUNTINFO_HYBRID, OWN_HYBRID, |_| Some(String::new())).unwrap();
        let Hierarchy::V1(mounts) = &h else {
            panic!("{h:?}")
        };
        let names: Vec<&str> = mounts
            .iter()
            .flat_map(|m| m.controllers.iter().map(String::as_str))
            .collect();
        // cpuset and blkio are not ours; name=systemd is not a controller.
        assert_eq!(
            names,
            ["cpu", "cpuacct", "memory", "devices", "freezer", "pids"]
        );
        let cg = h.sandbox("agentenv", "s");
        assert_eq!(
            cg.dir_with("devices"),
            Path::new("/sys/fs/cgroup/devices/agentenv/s")
        );
        assert_eq!(
            cg.dir_with("memory"),
            Path::new("/sys/fs/cgroup/memory/process_api/b7/agentenv/s")
        );
        assert!(
            cg.join_files()
                .contains(&PathBuf::from("/sys/fs/cgroup/devices/agentenv/s/tasks"))
        );
    }

    #[test]
    fn v1_without_devices_is_refused_saying_why() {
        let mi: String = MOUNTINFO_HYBRID
            .lines()
            .filter(|l| !l.contains("devices"))
            .map(|l| format!("{l}\n"))
            .collect();
        let err = Hierarchy::from_texts(&mi, OWN_HYBRID, |_| Some(String::new())).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("cgroup v1 lacks devices"), "{msg}");
        assert!(
            msg.contains("must not run without the devices controller"),
            "{msg}"
        );
        assert!(msg.contains("mount -t cgroup -o devices"), "{msg}");
        // Without the unified mount too: the same answer.
        let mi: String = mi
            .lines()
            .filter(|l| !l.contains("cgroup2"))
            .map(|l| format!("{l}\n"))
            .collect();
        let err = Hierarchy::from_texts(&mi, OWN_HYBRID, |_| None).unwrap_err();
        assert!(err.to_string().contains("cgroup v1 lacks devices"), "{err}");
    }

    #[test]
    fn v1_missing_several_controllers_names_them_all() {
        let mi = "32 30 0:28 / /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct\n";
        let err = Hierarchy::from_texts(mi, "", |_| None).unwrap_err();
        assert!(
            err.to_string()
                .contains("cgroup v1 lacks memory, pids, freezer, devices"),
            "{err}"
        );
    }

    #[test]
    fn v2_with_controllers_wins_over_an_incomplete_v1() {
        // A v2 host that still mounts a v1 hierarchy by name only (or a lone v1
        // controller): devices are handled by BPF there.
        let mi = "\
31 23 0:27 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw
32 23 0:28 / /run/misc rw - cgroup cgroup rw,devices
";
        let h = Hierarchy::from_texts(mi, "0::/\n", |_| Some("cpu memory pids".into())).unwrap();
        assert_eq!(h.version(), 2);
    }

    #[test]
    fn restrict_devices_on_a_v1_hierarchy_without_devices_is_an_error() {
        let h = Hierarchy::V1(vec![V1Mount {
            controllers: vec!["memory".into()],
            mount: "/nonexistent/memory".into(),
            own: "/".into(),
        }]);
        let err = h
            .sandbox("p", "s")
            .restrict_devices(devices::STANDARD)
            .unwrap_err();
        assert!(err.to_string().contains("no devices controller"), "{err}");
        // Invalid rules are refused before anything is written.
        let bad = [DeviceRule::new(
            devices::DeviceKind::Char,
            Some(1),
            Some(3),
            devices::Access::NONE,
        )];
        let err = h.sandbox("p", "s").restrict_devices(&bad).unwrap_err();
        assert!(matches!(err, CgroupError::Devices(_)), "{err}");
    }

    #[test]
    fn v2_without_controllers_is_unsupported_with_a_reason() {
        let mi = "31 23 0:27 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n";
        let err = Hierarchy::from_texts(mi, "0::/\n", |_| Some(String::new())).unwrap_err();
        assert!(err.to_string().contains("lacks cpu, memory, pids"), "{err}");
    }
}
