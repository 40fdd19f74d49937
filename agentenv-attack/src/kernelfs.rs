//! Kernel interfaces in /proc and /sys: writes to host-wide settings (always the value
//! they hold already, or a value without effect, so that a success changes nothing),
//! cgroupfs, /proc/kcore and the addresses in /proc/kallsyms.

use crate::sys::{self, Fd};
use crate::{Attempt, Config, Outcome};

/// What to write to a settings file.
#[derive(Clone, Copy)]
enum Value {
    /// The value it holds (read first).
    Same,
    /// The selected word of a `a [b] c` list (transparent_hugepage).
    Selected,
    /// A fixed harmless value.
    Fixed(&'static str),
}

pub fn attempts(_cfg: &Config) -> Vec<Attempt> {
    let mut v = Vec::new();
    for (name, path, value) in [
        // 'h' prints the SysRq help to the kernel log: the harmless command.
        (
            "write-proc-sysrq-trigger",
            "/proc/sysrq-trigger",
            Value::Fixed("h"),
        ),
        (
            "write-proc-sys-kernel-hostname",
            "/proc/sys/kernel/hostname",
            Value::Same,
        ),
        // 4 only silences the message of later drops; nothing is dropped.
        (
            "write-proc-sys-vm-drop_caches",
            "/proc/sys/vm/drop_caches",
            Value::Fixed("4"),
        ),
        (
            "write-proc-sys-kernel-core_pattern",
            "/proc/sys/kernel/core_pattern",
            Value::Same,
        ),
        (
            "write-proc-sys-kernel-modprobe",
            "/proc/sys/kernel/modprobe",
            Value::Same,
        ),
        (
            "write-proc-sys-fs-inotify-max_user_instances",
            "/proc/sys/fs/inotify/max_user_instances",
            Value::Same,
        ),
        (
            "write-sys-kernel-mm-transparent_hugepage-enabled",
            "/sys/kernel/mm/transparent_hugepage/enabled",
            Value::Selected,
        ),
        (
            "write-sys-kernel-uevent_helper",
            "/sys/kernel/uevent_helper",
            Value::Same,
        ),
    ] {
        v.push(Attempt::new(name, move |_| write_setting(path, value)));
    }
    v.push(Attempt::new("write-sys-class-net-mtu", |_| {
        let dev = std::fs::read_dir("/sys/class/net")
            .ok()
            .and_then(|rd| {
                rd.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .find(|n| n != "lo")
            })
            .unwrap_or_else(|| "eth0".into());
        write_setting(&format!("/sys/class/net/{dev}/mtu"), Value::Same)
    }));
    v.push(Attempt::new("write-cgroupfs", |_| cgroupfs()));
    v.push(Attempt::new("read-proc-kcore", |_| kcore()));
    v.push(Attempt::new("read-proc-kallsyms", |_| kallsyms()));
    v
}

fn refused_open(path: &str, e: i32) -> Outcome {
    match e {
        libc::EROFS | libc::EACCES | libc::EPERM => Outcome::contained(format!(
            "opening {path} for writing refused: {}",
            sys::ename(e)
        )),
        libc::ENOENT => Outcome::contained(format!("{path} does not exist here")),
        _ => Outcome::inconclusive(format!("opening {path} for writing: {}", sys::ename(e))),
    }
}

fn write_setting(path: &str, value: Value) -> Outcome {
    let current = std::fs::read_to_string(path).ok();
    let data = match value {
        Value::Fixed(s) => s.to_string(),
        Value::Same => match &current {
            Some(c) => {
                let c = c.trim_end_matches('\n');
                format!("{c}\n")
            }
            None => {
                // Unreadable (or absent): opening for writing still tells.
                return match sys::open(path, libc::O_WRONLY) {
                    Ok(_) => Outcome::escaped(format!(
                        "{path} opened for writing (unreadable, so nothing was written)"
                    )),
                    Err(e) => refused_open(path, e),
                };
            }
        },
        Value::Selected => match current.as_deref().and_then(|c| {
            let start = c.find('[')?;
            let end = c[start..].find(']')?;
            Some(c[start + 1..start + end].to_string())
        }) {
            Some(s) => s,
            None => {
                return match sys::open(path, libc::O_WRONLY) {
                    Ok(_) => Outcome::escaped(format!(
                        "{path} opened for writing (no current value found, nothing written)"
                    )),
                    Err(e) => refused_open(path, e),
                };
            }
        },
    };
    let fd = match sys::open(path, libc::O_WRONLY) {
        Ok(fd) => fd,
        Err(e) => return refused_open(path, e),
    };
    if let Ok(st) = sys::fstat(&fd)
        && sys::is_chr(&st, 1, 3)
    {
        return Outcome::contained(format!("{path} is masked (/dev/null is mounted over it)"));
    }
    match sys::write(&fd, data.as_bytes()) {
        Ok(n) => Outcome::escaped(format!(
            "wrote {n} bytes ({:?}, the value it already had or a no-op) to {path}",
            data.trim_end()
        )),
        Err(e @ (libc::EROFS | libc::EACCES | libc::EPERM)) => {
            Outcome::contained(format!("writing {path} refused: {}", sys::ename(e)))
        }
        Err(e) => Outcome::inconclusive(format!(
            "{path} opened for writing; the write failed with {}",
            sys::ename(e)
        )),
    }
}

/// Every cgroup filesystem mounted in the sandbox must refuse changes: no new group,
/// no `release_agent`.
fn cgroupfs() -> Outcome {
    let mounts: Vec<String> = sys::mounts()
        .into_iter()
        .filter(|(_, t, _)| t == "cgroup" || t == "cgroup2")
        .map(|(p, _, _)| p)
        .collect();
    if mounts.is_empty() {
        return Outcome::contained(
            "no cgroup filesystem is mounted in the sandbox (mounting one: see mount-cgroup)",
        );
    }
    let mut changed = Vec::new();
    let mut refused = Vec::new();
    for m in &mounts {
        let dir = format!("{m}/attack-cg");
        match std::fs::create_dir(&dir) {
            Ok(()) => {
                let _ = std::fs::remove_dir(&dir);
                changed.push(format!("created {dir}"));
            }
            Err(e) => refused.push(format!("mkdir {dir}: {e}")),
        }
        let ra = format!("{m}/release_agent");
        if std::path::Path::new(&ra).exists() {
            match write_setting(&ra, Value::Same) {
                o if o.contained => refused.push(o.detail),
                o => changed.push(o.detail),
            }
        }
    }
    if changed.is_empty() {
        Outcome::contained(format!(
            "cgroupfs at {}: {}",
            mounts.join(", "),
            refused.join("; ")
        ))
    } else {
        Outcome::escaped(changed.join("; "))
    }
}

fn kcore() -> Outcome {
    let fd: Fd = match sys::open("/proc/kcore", libc::O_RDONLY) {
        Ok(fd) => fd,
        Err(e @ (libc::EACCES | libc::EPERM)) => {
            return Outcome::contained(format!("open refused: {}", sys::ename(e)));
        }
        Err(libc::ENOENT) => return Outcome::contained("/proc/kcore does not exist here"),
        Err(e) => return Outcome::inconclusive(format!("open: {}", sys::ename(e))),
    };
    if let Ok(st) = sys::fstat(&fd)
        && sys::is_chr(&st, 1, 3)
    {
        return Outcome::contained("masked (/dev/null is mounted over it)");
    }
    match sys::pread(&fd, 4, 0) {
        Ok(b) if b == b"\x7fELF" => Outcome::escaped("read the ELF header of the kernel's memory"),
        Ok(b) if b.is_empty() => Outcome::contained("opened but reads nothing"),
        Ok(b) => Outcome::escaped(format!("read {} bytes", b.len())),
        Err(e) => Outcome::contained(format!("read refused: {}", sys::ename(e))),
    }
}

fn kallsyms() -> Outcome {
    let text = match std::fs::read_to_string("/proc/kallsyms") {
        Ok(t) => t,
        Err(e) => return Outcome::contained(format!("unreadable: {e}")),
    };
    let mut lines = 0;
    let leaked: Vec<&str> = text
        .lines()
        .take(2000)
        .inspect(|_| lines += 1)
        .filter(|l| {
            l.split(' ')
                .next()
                .and_then(|a| u64::from_str_radix(a, 16).ok())
                .is_some_and(|a| a != 0)
        })
        .take(3)
        .collect();
    if leaked.is_empty() {
        Outcome::contained(format!(
            "{lines} symbols read, every address is 0 (kptr_restrict / no CAP_SYSLOG)"
        ))
    } else {
        Outcome::escaped(format!("kernel addresses visible: {}", leaked.join(" | ")))
    }
}
