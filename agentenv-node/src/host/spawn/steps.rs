//! The mount steps that build a sandbox's root, collected by the parent before `clone`:
//! the jail's overlay root (the id-mapped template under the writable layer, /proc, /sys,
//! /dev with the standard devices, /dev/pts, /dev/shm, the agent binary, and the masked and
//! read-only paths under /proc) and the minimal root a jailed VMM gets.

use std::ffi::CString;
use std::os::fd::RawFd;
use std::path::Path;

use nix::mount::MsFlags;

use super::{Op, Root, STANDARD_DEVICES, SpawnError, Step, cpath, cstr};

/// Paths under /proc that are hidden (a file gets /dev/null mounted over it, a directory
/// an empty read-only tmpfs).
const MASKED_PATHS: &[&str] = &[
    "proc/kcore",
    "proc/keys",
    "proc/timer_list",
    "proc/sched_debug",
    "proc/latency_stats",
    "proc/acpi",
    "proc/scsi",
    "proc/asound",
];

/// Paths under /proc made read-only (host-wide kernel settings live there).
const READONLY_PATHS: &[&str] = &[
    "proc/sys",
    "proc/sysrq-trigger",
    "proc/bus",
    "proc/fs",
    "proc/irq",
];

/// The mount steps of a plan, collected in order.
pub(super) struct Steps(pub(super) Vec<Step>);

impl Steps {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn mount(
        &mut self,
        what: &'static str,
        src: Option<CString>,
        target: CString,
        fstype: Option<&str>,
        flags: MsFlags,
        data: Option<String>,
        optional: bool,
    ) -> Result<(), SpawnError> {
        self.0.push(Step {
            what,
            op: Op::Mount {
                src,
                target,
                fstype: fstype.map(cstr).transpose()?,
                flags,
                data: data.map(cstr).transpose()?,
            },
            optional,
        });
        Ok(())
    }

    fn op(&mut self, what: &'static str, op: Op) {
        self.0.push(Step {
            what,
            op,
            optional: false,
        });
    }

    /// Binds the host file `src` onto the new file `target`, remounted with `flags` added
    /// when there are any.
    fn bind_file(
        &mut self,
        what: &'static str,
        src: CString,
        target: CString,
        flags: MsFlags,
    ) -> Result<(), SpawnError> {
        self.op(
            "create a mount point",
            Op::Touch {
                path: target.clone(),
            },
        );
        self.mount(
            what,
            Some(src),
            target.clone(),
            None,
            MsFlags::MS_BIND,
            None,
            false,
        )?;
        if flags.is_empty() {
            return Ok(());
        }
        self.mount(
            what,
            None,
            target,
            None,
            MsFlags::MS_BIND | MsFlags::MS_REMOUNT | flags,
            None,
            false,
        )
    }
}

const NOSUID_NODEV_NOEXEC: MsFlags = MsFlags::MS_NOSUID
    .union(MsFlags::MS_NODEV)
    .union(MsFlags::MS_NOEXEC);

pub(super) fn overlay_steps(
    steps: &mut Steps,
    input: &Root<'_>,
    userns: Option<RawFd>,
) -> Result<(), SpawnError> {
    let Root::Overlay {
        lower,
        lower_mount,
        upper,
        work,
        root,
        base_id,
        agent_host_path,
        agent_guest_path,
    } = input
    else {
        return Ok(());
    };
    let at = |rel: &str| cpath(&root.join(rel));
    let lower_dir = match userns {
        Some(userns) => {
            steps.op(
                "mount the template id-mapped",
                Op::IdmapBind {
                    src: cpath(lower)?,
                    target: cpath(lower_mount)?,
                    userns,
                },
            );
            *lower_mount
        }
        None => *lower,
    };
    let overlay_opts = format!(
        "lowerdir={},upperdir={},workdir={}",
        lower_dir.display(),
        upper.display(),
        work.display()
    );
    steps.mount(
        "mount the overlay root",
        Some(cstr("overlay")?),
        cpath(root)?,
        Some("overlay"),
        MsFlags::MS_NODEV | MsFlags::MS_NOSUID,
        Some(overlay_opts),
        false,
    )?;
    steps.mount(
        "mount /proc",
        Some(cstr("proc")?),
        at("proc")?,
        Some("proc"),
        NOSUID_NODEV_NOEXEC,
        None,
        false,
    )?;
    steps.mount(
        "mount /sys",
        Some(cstr("sysfs")?),
        at("sys")?,
        Some("sysfs"),
        NOSUID_NODEV_NOEXEC | MsFlags::MS_RDONLY,
        None,
        false,
    )?;
    steps.mount(
        "mount /dev",
        Some(cstr("tmpfs")?),
        at("dev")?,
        Some("tmpfs"),
        NOSUID_NODEV_NOEXEC,
        Some(format!("mode=755,size=65536k,uid={base_id},gid={base_id}")),
        false,
    )?;
    // A bind keeps the host's /dev mount flags (set-id and exec bits mean nothing on a
    // device node): no remount.
    for (name, _, _) in STANDARD_DEVICES {
        steps.bind_file(
            "bind a device node",
            cstr(format!("/dev/{name}"))?,
            at(&format!("dev/{name}"))?,
            MsFlags::empty(),
        )?;
    }
    for dir in ["dev/pts", "dev/shm"] {
        steps.op(
            "create a /dev directory",
            Op::Mkdir {
                path: at(dir)?,
                mode: 0o755,
            },
        );
    }
    let links = std::iter::once(("ptmx", "pts/ptmx")).chain(agentenv_guest::devices::FD_LINKS);
    for (link, target) in links {
        let link = at(&format!("dev/{link}"))?;
        steps.op(
            "create a /dev link",
            Op::Symlink {
                target: cstr(target)?,
                link: link.clone(),
            },
        );
        steps.op(
            "own a /dev link",
            Op::Chown {
                path: link,
                uid: *base_id,
                gid: *base_id,
            },
        );
    }
    // Ptys belong to the sandbox's tty group (gid 5 inside).
    steps.mount(
        "mount /dev/pts",
        Some(cstr("devpts")?),
        at("dev/pts")?,
        Some("devpts"),
        MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC,
        Some(format!(
            "newinstance,ptmxmode=0666,mode=0620,gid={}",
            base_id + 5
        )),
        false,
    )?;
    steps.mount(
        "mount /dev/shm",
        Some(cstr("shm")?),
        at("dev/shm")?,
        Some("tmpfs"),
        NOSUID_NODEV_NOEXEC,
        Some(format!("mode=1777,size=65536k,uid={base_id},gid={base_id}")),
        false,
    )?;
    let agent_target = at(agent_guest_path.trim_start_matches('/'))?;
    steps.mount(
        "bind the agent binary",
        Some(cpath(agent_host_path)?),
        agent_target.clone(),
        None,
        MsFlags::MS_BIND,
        None,
        false,
    )?;
    steps.mount(
        "make the agent binary read-only",
        None,
        agent_target,
        None,
        MsFlags::MS_BIND
            | MsFlags::MS_REMOUNT
            | MsFlags::MS_RDONLY
            | MsFlags::MS_NOSUID
            | MsFlags::MS_NODEV,
        None,
        false,
    )?;
    for p in MASKED_PATHS {
        let target = at(p)?;
        let is_dir = Path::new("/").join(p).is_dir();
        if is_dir {
            steps.mount(
                "mask a /proc directory",
                Some(cstr("tmpfs")?),
                target,
                Some("tmpfs"),
                MsFlags::MS_RDONLY | NOSUID_NODEV_NOEXEC,
                Some("size=0".into()),
                true,
            )?;
        } else {
            steps.mount(
                "mask a /proc file",
                Some(at("dev/null")?),
                target,
                None,
                MsFlags::MS_BIND,
                None,
                true,
            )?;
        }
    }
    for p in READONLY_PATHS {
        let target = at(p)?;
        steps.mount(
            "bind a read-only /proc path",
            Some(target.clone()),
            target.clone(),
            None,
            MsFlags::MS_BIND | MsFlags::MS_REC,
            None,
            true,
        )?;
        steps.mount(
            "make a /proc path read-only",
            None,
            target,
            None,
            MsFlags::MS_BIND | MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY | NOSUID_NODEV_NOEXEC,
            None,
            true,
        )?;
    }
    Ok(())
}

pub(super) fn minimal_steps(steps: &mut Steps, input: &Root<'_>) -> Result<(), SpawnError> {
    let Root::Minimal {
        root,
        devices,
        owner,
        binds,
    } = input
    else {
        return Ok(());
    };
    let at = |rel: &str| cpath(&root.join(rel.trim_start_matches('/')));
    // pivot_root needs the new root to be a mount point.
    steps.mount(
        "bind the jail directory onto itself",
        Some(cpath(root)?),
        cpath(root)?,
        None,
        MsFlags::MS_BIND,
        None,
        false,
    )?;
    steps.mount(
        "restrict the jail directory",
        None,
        cpath(root)?,
        None,
        MsFlags::MS_BIND | MsFlags::MS_REMOUNT | MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        None,
        false,
    )?;
    steps.mount(
        "mount the jail's /dev",
        Some(cstr("tmpfs")?),
        at("dev")?,
        Some("tmpfs"),
        MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC,
        Some("mode=755,size=64k".into()),
        false,
    )?;
    for (name, major, minor) in devices.iter() {
        let path = at(&format!("dev/{name}"))?;
        if let Some(parent) = Path::new(name).parent()
            && !parent.as_os_str().is_empty()
        {
            steps.op(
                "create a /dev directory",
                Op::Mkdir {
                    path: at(&format!("dev/{}", parent.display()))?,
                    mode: 0o755,
                },
            );
        }
        steps.op(
            "create a device node",
            Op::Mknod {
                path: path.clone(),
                major: *major,
                minor: *minor,
            },
        );
        steps.op(
            "own a device node",
            Op::Chown {
                path,
                uid: owner.0,
                gid: owner.1,
            },
        );
    }
    for (src, target, writable) in binds.iter() {
        let mut flags = MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC;
        if !writable {
            flags |= MsFlags::MS_RDONLY;
        }
        steps.mount(
            "bind a file into the jail",
            Some(cpath(src)?),
            at(target)?,
            None,
            MsFlags::MS_BIND,
            None,
            false,
        )?;
        steps.mount(
            "restrict a file bound into the jail",
            None,
            at(target)?,
            None,
            MsFlags::MS_BIND | MsFlags::MS_REMOUNT | flags,
            None,
            false,
        )?;
    }
    Ok(())
}
