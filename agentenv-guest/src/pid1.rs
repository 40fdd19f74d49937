//! Init mode: the agent binary as PID 1 of a sandbox.
//!
//! Mounts the pseudo filesystems a fresh mount namespace lacks, runs the
//! agent as a child, reaps every orphan, forwards signals to the agent, and
//! restarts it when it dies. See the crate documentation for the command line.

use std::ffi::{CString, OsString};
use std::io;
use std::path::Path;
use std::time::{Duration, Instant};

/// Errors of init mode.
#[derive(Debug, thiserror::Error)]
pub enum Pid1Error {
    #[error("mounting {what} on {target}: {source}")]
    Mount {
        what: &'static str,
        target: String,
        source: io::Error,
    },
    #[error("finding the agent binary (/proc/self/exe): {0}")]
    Exe(io::Error),
    #[error("setting up signal handling: {0}")]
    Signals(io::Error),
}

/// Shortest time between two starts of the agent.
const MIN_RESTART_INTERVAL: Duration = Duration::from_secs(1);
/// Delay before restarting a dead agent.
const RESTART_DELAY: Duration = Duration::from_millis(100);
/// How long a stopping agent gets before SIGKILL.
const STOP_GRACE: Duration = Duration::from_secs(5);

const FORWARDED: [libc::c_int; 5] = [
    libc::SIGTERM,
    libc::SIGINT,
    libc::SIGHUP,
    libc::SIGUSR1,
    libc::SIGUSR2,
];

fn is_mountpoint(target: &str) -> bool {
    std::fs::read_to_string("/proc/self/mountinfo")
        .map(|m| m.lines().any(|l| l.split(' ').nth(4) == Some(target)))
        .unwrap_or(false)
}

/// True when /proc is mounted and `/proc/self` names this process, i.e. the
/// proc instance belongs to our PID namespace.
fn proc_shows_our_namespace() -> bool {
    // SAFETY: getpid has no preconditions.
    let pid = unsafe { libc::getpid() };
    std::fs::read_link("/proc/self")
        .ok()
        .and_then(|p| p.to_str().and_then(|s| s.parse::<libc::pid_t>().ok()))
        == Some(pid)
}

fn mount(
    what: &'static str,
    fstype: &str,
    target: &str,
    flags: libc::c_ulong,
    data: &str,
) -> Result<(), Pid1Error> {
    let err = |source| Pid1Error::Mount {
        what,
        target: target.to_string(),
        source,
    };
    std::fs::create_dir_all(target).map_err(err)?;
    let src = CString::new(fstype).map_err(|_| err(io::ErrorKind::InvalidInput.into()))?;
    let tgt = CString::new(target).map_err(|_| err(io::ErrorKind::InvalidInput.into()))?;
    let dat = CString::new(data).map_err(|_| err(io::ErrorKind::InvalidInput.into()))?;
    // SAFETY: all pointers are NUL-terminated strings that outlive the call.
    let rc = unsafe {
        libc::mount(
            src.as_ptr(),
            tgt.as_ptr(),
            src.as_ptr(),
            flags,
            dat.as_ptr().cast(),
        )
    };
    if rc != 0 {
        return Err(err(io::Error::last_os_error()));
    }
    Ok(())
}

/// Mounts a `fstype` file system (named by its type) on `target` unless something
/// is mounted there already; says whether it mounted.
fn mount_unless_mounted(
    fstype: &'static str,
    target: &str,
    flags: libc::c_ulong,
    data: &str,
) -> Result<bool, Pid1Error> {
    if is_mountpoint(target) {
        return Ok(false);
    }
    mount(fstype, fstype, target, flags, data)?;
    Ok(true)
}

/// Mounts /proc, /sys, /dev, /dev/pts, /dev/shm and (when not writable)
/// /tmp, skipping those already mounted.
pub fn mount_pseudo_filesystems() -> Result<(), Pid1Error> {
    let nosuid_nodev_noexec = libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC;
    // An inherited /proc of another PID namespace shows the wrong processes:
    // mount a fresh one (our mount namespace is private). A /proc that already
    // belongs to our namespace (the jail mounts one before exec, and a jail
    // may not mount) is kept.
    if !proc_shows_our_namespace() {
        mount("proc", "proc", "/proc", nosuid_nodev_noexec, "")?;
    }
    if !is_mountpoint("/sys")
        && let Err(e) = mount(
            "sysfs",
            "sysfs",
            "/sys",
            nosuid_nodev_noexec | libc::MS_RDONLY,
            "",
        )
    {
        // A PID namespace without its own network namespace cannot mount
        // sysfs; the agent works without it.
        tracing::warn!(error = %e, "/sys not mounted");
    }
    // No /dev at all (a bare root): a tmpfs with the basic devices only,
    // never the host's full devtmpfs. (A VM kernel mounts its own devtmpfs.)
    if !is_mountpoint("/dev") && !Path::new("/dev/null").exists() {
        mount("tmpfs", "tmpfs", "/dev", libc::MS_NOSUID, "mode=0755")?;
        make_basic_devices();
    }
    let devpts = "newinstance,ptmxmode=0666,mode=0620";
    if mount_unless_mounted(
        "devpts",
        "/dev/pts",
        libc::MS_NOSUID | libc::MS_NOEXEC,
        devpts,
    )? {
        // The namespace's own pty instance is reached through /dev/ptmx.
        let _ = std::fs::remove_file("/dev/ptmx");
        let _ = std::os::unix::fs::symlink("pts/ptmx", "/dev/ptmx");
    }
    mount_unless_mounted(
        "tmpfs",
        "/dev/shm",
        libc::MS_NOSUID | libc::MS_NODEV,
        "mode=1777",
    )?;
    let tmp_writable = {
        let probe = Path::new("/tmp/.agentenv-guest-probe");
        let ok = std::fs::write(probe, b"").is_ok();
        let _ = std::fs::remove_file(probe);
        ok
    };
    if !tmp_writable {
        mount(
            "tmpfs",
            "tmpfs",
            "/tmp",
            libc::MS_NOSUID | libc::MS_NODEV,
            "mode=1777",
        )?;
    }
    Ok(())
}

fn make_basic_devices() {
    for (link, target) in crate::devices::FD_LINKS {
        let _ = std::os::unix::fs::symlink(target, format!("/dev/{link}"));
    }
    for (name, major, minor) in crate::devices::BASIC_DEVICES {
        let Ok(path) = CString::new(format!("/dev/{name}")) else {
            continue;
        };
        // SAFETY: `path` is NUL-terminated; mknod has no other preconditions.
        unsafe {
            libc::mknod(
                path.as_ptr(),
                libc::S_IFCHR | 0o666,
                libc::makedev(major, minor),
            );
        }
    }
}

fn sigset(signals: &[libc::c_int]) -> libc::sigset_t {
    // SAFETY: sigset_t is plain data; sigemptyset initializes it.
    let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a valid sigset_t.
    unsafe {
        libc::sigemptyset(&mut set);
        for s in signals {
            libc::sigaddset(&mut set, *s);
        }
    }
    set
}

fn spawn_agent(exe: &Path, args: &[OsString]) -> Option<libc::pid_t> {
    use std::os::unix::process::CommandExt;
    let mut cmd = std::process::Command::new(exe);
    cmd.args(args);
    // Init blocks the signals it waits for; the agent and every process it
    // starts must not inherit that mask (SIGTERM and Ctrl-C would do nothing).
    // SAFETY: the closure runs in the forked child before exec and only calls
    // the async-signal-safe sigemptyset and sigprocmask.
    unsafe {
        cmd.pre_exec(|| {
            let mut empty: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut empty);
            if libc::sigprocmask(libc::SIG_SETMASK, &empty, std::ptr::null_mut()) != 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }
    match cmd.spawn() {
        Ok(child) => {
            let pid = child.id() as libc::pid_t;
            // The child is reaped by the waitpid(-1) loop, not through `child`.
            std::mem::forget(child);
            tracing::info!(pid, "agent started");
            Some(pid)
        }
        Err(e) => {
            tracing::error!(error = %e, "starting the agent failed");
            None
        }
    }
}

/// The resolver configuration the kernel's IP autoconfiguration (`ip=` on a VM's command
/// line) published in `pnp` (`/proc/net/pnp`): its `nameserver`, `domain` and `search`
/// lines. `None` when it names no nameserver.
fn resolv_conf_from_pnp(pnp: &str) -> Option<String> {
    let lines: Vec<&str> = pnp
        .lines()
        .map(str::trim)
        .filter(|l| {
            let key = l.split_whitespace().next().unwrap_or("");
            matches!(key, "nameserver" | "domain" | "search") && l.split_whitespace().count() > 1
        })
        .collect();
    lines
        .iter()
        .any(|l| l.starts_with("nameserver"))
        .then(|| lines.join("\n") + "\n")
}

/// A VM guest learns its DNS servers from the kernel's command line only; when the root
/// filesystem's resolver file names none, write the ones the kernel published. A jail
/// (no `/proc/net/pnp`) and a root that already has nameservers are left as they are.
fn resolver_from_kernel(pnp: &Path, resolv_conf: &Path) {
    let Ok(pnp) = std::fs::read_to_string(pnp) else {
        return;
    };
    let Some(conf) = resolv_conf_from_pnp(&pnp) else {
        return;
    };
    let current = std::fs::read_to_string(resolv_conf).unwrap_or_default();
    if current
        .lines()
        .any(|l| l.trim_start().starts_with("nameserver"))
    {
        return;
    }
    // A dangling symlink (e.g. to a resolver daemon's file) is replaced by a file.
    let _ = std::fs::remove_file(resolv_conf);
    if let Err(e) = std::fs::write(resolv_conf, conf) {
        tracing::warn!(path = %resolv_conf.display(), error = %e, "could not write the resolver configuration");
    }
}

/// Runs init mode; returns the exit code for the whole sandbox.
pub fn run(agent_args: Vec<OsString>) -> Result<i32, Pid1Error> {
    mount_pseudo_filesystems()?;
    resolver_from_kernel(Path::new("/proc/net/pnp"), Path::new("/etc/resolv.conf"));
    let exe = std::fs::read_link("/proc/self/exe").map_err(Pid1Error::Exe)?;
    let mut all = FORWARDED.to_vec();
    all.push(libc::SIGCHLD);
    let set = sigset(&all);
    // SAFETY: `set` is a valid sigset; blocking signals in this
    // single-threaded process lets sigtimedwait receive them.
    if unsafe { libc::sigprocmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) } != 0 {
        return Err(Pid1Error::Signals(io::Error::last_os_error()));
    }

    let mut agent = spawn_agent(&exe, &agent_args);
    let mut last_start = Instant::now();
    let mut restart_at: Option<Instant> = agent
        .is_none()
        .then(|| Instant::now() + MIN_RESTART_INTERVAL);
    let mut stopping: Option<Instant> = None;
    loop {
        let ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 100_000_000,
        };
        // SAFETY: `set` and `ts` are valid; the info pointer may be null.
        let sig = unsafe { libc::sigtimedwait(&set, std::ptr::null_mut(), &ts) };
        if sig == libc::SIGCHLD || sig < 0 {
            // Reap everything that has exited.
            loop {
                let mut status = 0;
                // SAFETY: `status` is a valid out pointer.
                let pid = unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG) };
                if pid <= 0 {
                    break;
                }
                if Some(pid) == agent {
                    agent = None;
                    if stopping.is_some() {
                        tracing::info!("agent stopped; init exits");
                        return Ok(0);
                    }
                    tracing::warn!(pid, status, "agent died; restarting it");
                    let earliest = last_start + MIN_RESTART_INTERVAL;
                    restart_at = Some(earliest.max(Instant::now() + RESTART_DELAY));
                }
            }
        } else if FORWARDED.contains(&sig) {
            if let Some(pid) = agent {
                // SAFETY: kill has no memory-safety preconditions.
                unsafe { libc::kill(pid, sig) };
            }
            if sig == libc::SIGTERM || sig == libc::SIGINT {
                if agent.is_none() {
                    return Ok(0);
                }
                stopping.get_or_insert(Instant::now() + STOP_GRACE);
            }
        }
        if let Some(deadline) = stopping
            && Instant::now() >= deadline
            && let Some(pid) = agent
        {
            // SAFETY: kill has no memory-safety preconditions.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        if stopping.is_none()
            && let Some(at) = restart_at
            && Instant::now() >= at
        {
            restart_at = None;
            last_start = Instant::now();
            agent = spawn_agent(&exe, &agent_args);
            if agent.is_none() {
                restart_at = Some(Instant::now() + MIN_RESTART_INTERVAL);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PNP: &str =
        "#MANUAL\nnameserver 10.12.0.1\nnameserver 1.1.1.1\ndomain sbx.local\nbootserver 0.0.0.0\n";

    #[test]
    fn the_kernels_nameservers_become_the_resolver_configuration() {
        assert_eq!(
            resolv_conf_from_pnp(PNP).as_deref(),
            Some("nameserver 10.12.0.1\nnameserver 1.1.1.1\ndomain sbx.local\n")
        );
        assert_eq!(resolv_conf_from_pnp("#MANUAL\nbootserver 0.0.0.0\n"), None);
        assert_eq!(resolv_conf_from_pnp(""), None);
    }

    #[test]
    fn resolver_file_is_written_only_when_it_names_no_nameserver() {
        let dir = tempfile::tempdir().unwrap();
        let pnp = dir.path().join("pnp");
        let conf = dir.path().join("resolv.conf");
        std::fs::write(&pnp, PNP).unwrap();

        // Missing: written.
        resolver_from_kernel(&pnp, &conf);
        let written = std::fs::read_to_string(&conf).unwrap();
        assert!(written.starts_with("nameserver 10.12.0.1\n"), "{written}");

        // Already names a nameserver: kept.
        std::fs::write(&conf, "nameserver 192.0.2.53\n").unwrap();
        resolver_from_kernel(&pnp, &conf);
        assert_eq!(
            std::fs::read_to_string(&conf).unwrap(),
            "nameserver 192.0.2.53\n"
        );

        // A dangling symlink: replaced by a file.
        std::fs::remove_file(&conf).unwrap();
        std::os::unix::fs::symlink(dir.path().join("nowhere"), &conf).unwrap();
        resolver_from_kernel(&pnp, &conf);
        assert!(!std::fs::symlink_metadata(&conf).unwrap().is_symlink());
        assert!(std::fs::read_to_string(&conf).unwrap().contains("1.1.1.1"));

        // No /proc/net/pnp (a jail): nothing touched.
        std::fs::remove_file(&conf).unwrap();
        resolver_from_kernel(&dir.path().join("absent"), &conf);
        assert!(!conf.exists());
    }
}
