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
        self.bind([what, what], src, target, MsFlags::empty(), flags, false)
    }

    /// Binds `src` onto `target` (`rec`: with the mounts beneath, `MS_REC`), then
    /// remounts the bind with `flags` added when there are any; `what` names the two
    /// steps.
    fn bind(
        &mut self,
        what: [&'static str; 2],
        src: CString,
        target: CString,
        rec: MsFlags,
        flags: MsFlags,
        optional: bool,
    ) -> Result<(), SpawnError> {
        let bind = MsFlags::MS_BIND | rec;
        self.mount(
            what[0],
            Some(src),
            target.clone(),
            None,
            bind,
            None,
            optional,
        )?;
        if flags.is_empty() {
            return Ok(());
        }
        let remount = MsFlags::MS_BIND | MsFlags::MS_REMOUNT | flags;
        self.mount(what[1], None, target, None, remount, None, optional)
    }

    /// Mounts a new file system of type `fstype`, named after its type, on `target`.
    fn filesystem(
        &mut self,
        what: &'static str,
        fstype: &str,
        target: CString,
        flags: MsFlags,
        data: Option<String>,
    ) -> Result<(), SpawnError> {
        self.mount(
            what,
            Some(cstr(fstype)?),
            target,
            Some(fstype),
            flags,
            data,
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
        volumes,
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
    let dev = format!("mode=755,size=65536k,uid={base_id},gid={base_id}");
    let read_only = NOSUID_NODEV_NOEXEC | MsFlags::MS_RDONLY;
    for (what, fstype, dir, flags, data) in [
        ("mount /proc", "proc", "proc", NOSUID_NODEV_NOEXEC, None),
        ("mount /sys", "sysfs", "sys", read_only, None),
        ("mount /dev", "tmpfs", "dev", NOSUID_NODEV_NOEXEC, Some(dev)),
    ] {
        steps.filesystem(what, fstype, at(dir)?, flags, data)?;
    }
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
    let pts = format!("newinstance,ptmxmode=0666,mode=0620,gid={}", base_id + 5);
    let nosuid_noexec = MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC;
    steps.filesystem(
        "mount /dev/pts",
        "devpts",
        at("dev/pts")?,
        nosuid_noexec,
        Some(pts),
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
    steps.bind(
        ["bind the agent binary", "make the agent binary read-only"],
        cpath(agent_host_path)?,
        at(agent_guest_path.trim_start_matches('/'))?,
        MsFlags::empty(),
        MsFlags::MS_RDONLY | MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
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
        steps.bind(
            ["bind a read-only /proc path", "make a /proc path read-only"],
            target.clone(),
            target,
            MsFlags::MS_REC,
            MsFlags::MS_RDONLY | NOSUID_NODEV_NOEXEC,
            true,
        )?;
    }
    if !volumes.is_empty() {
        let userns = userns.ok_or(SpawnError::VolumesNeedUserNs)?;
        for v in volumes.iter() {
            steps.op(
                "bind a volume",
                Op::VolumeBind {
                    src: cpath(&v.host)?,
                    root: cpath(root)?,
                    components: v
                        .path
                        .split('/')
                        .filter(|c| !c.is_empty())
                        .map(cstr)
                        .collect::<Result<_, _>>()?,
                    owner: *base_id,
                    userns,
                },
            );
        }
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
    steps.bind(
        [
            "bind the jail directory onto itself",
            "restrict the jail directory",
        ],
        cpath(root)?,
        cpath(root)?,
        MsFlags::empty(),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        false,
    )?;
    steps.filesystem(
        "mount the jail's /dev",
        "tmpfs",
        at("dev")?,
        MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC,
        Some("mode=755,size=64k".into()),
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
        steps.bind(
            [
                "bind a file into the jail",
                "restrict a file bound into the jail",
            ],
            cpath(src)?,
            at(target)?,
            MsFlags::empty(),
            flags,
            false,
        )?;
    }
    Ok(())
}
