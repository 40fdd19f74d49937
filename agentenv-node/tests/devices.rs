//! The device allow-list for real, on cgroup v1 (the `devices` controller) and v2 (a
//! cgroup device BPF program on a cgroup2 directory): a forked child joins a restricted
//! cgroup and tries to open and create device nodes; the same probes run first in an
//! unrestricted child, so every denial is shown to come from the cgroup.
//!
//! Needs root. v1 tests need the v1 `devices` hierarchy (they skip, saying so, on a v2
//! host); v2 tests use the host's cgroup2 mount, or mount one in a temporary directory
//! (device programs attach to cgroup2 directories whatever controllers are enabled).

use std::ffi::CString;
use std::io::Read;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use agentenv_node::host::cgroup::{Hierarchy, Limits, SandboxCgroup};
use agentenv_node::host::devices::{self, DeviceRule};

fn skip_reason() -> Option<&'static str> {
    if !nix::unistd::Uid::effective().is_root() {
        return Some("device cgroups and BPF programs need root");
    }
    None
}

fn cstr(p: impl AsRef<Path>) -> CString {
    CString::new(p.as_ref().as_os_str().as_bytes()).unwrap()
}

/// A unique name for this test's cgroups.
fn unique(test: &str) -> String {
    format!("agentenv-test-devices-{}-{test}", std::process::id())
}

// ---------------------------------------------------------------------------------------
// Probes: what a child does, with raw system calls only (it is forked from a threaded
// process, so it must not allocate or take locks).

enum Op {
    Open {
        path: CString,
        flags: libc::c_int,
    },
    Mknod {
        path: CString,
        mode: libc::mode_t,
        dev: libc::dev_t,
    },
    /// In a private mount namespace, mounts an overlay and unlinks a file of its lower
    /// layer, which makes overlayfs create a whiteout (a 0:0 character device) in the
    /// upper layer, as deleting a file in a jail's root does. A failing setup step is
    /// reported as `1000 * step + errno`.
    OverlayUnlink {
        merged: CString,
        data: CString,
        file: CString,
    },
}

struct Probe {
    what: String,
    op: Op,
    /// Expected in the restricted child: 0 (success) or an errno.
    want: i32,
    /// Whether it must succeed without restriction (else the probe would prove nothing).
    control_works: bool,
}

fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(-1)
}

fn run_op(op: &Op) -> i32 {
    // SAFETY: plain system calls on NUL-terminated strings that outlive the call; a
    // descriptor that opens is closed right away.
    unsafe {
        match op {
            Op::Open { path, flags } => {
                let fd = libc::open(path.as_ptr(), flags | libc::O_CLOEXEC | libc::O_NOCTTY);
                if fd < 0 {
                    return errno();
                }
                libc::close(fd);
                0
            }
            Op::Mknod { path, mode, dev } => {
                if libc::mknod(path.as_ptr(), *mode, *dev) < 0 {
                    errno()
                } else {
                    0
                }
            }
            Op::OverlayUnlink { merged, data, file } => {
                if libc::unshare(libc::CLONE_NEWNS) < 0 {
                    return 1000 + errno();
                }
                let none = std::ptr::null();
                if libc::mount(
                    none,
                    c"/".as_ptr(),
                    none,
                    libc::MS_REC | libc::MS_PRIVATE,
                    std::ptr::null(),
                ) < 0
                {
                    return 2000 + errno();
                }
                if libc::mount(
                    c"overlay".as_ptr(),
                    merged.as_ptr(),
                    c"overlay".as_ptr(),
                    0,
                    data.as_ptr().cast(),
                ) < 0
                {
                    return 3000 + errno();
                }
                if libc::unlink(file.as_ptr()) < 0 {
                    return errno();
                }
                0
            }
        }
    }
}

const MAX_PROBES: usize = 16;

/// Forks a child that writes its pid to each of `join` (none: stays where it is), runs
/// every probe and reports the outcomes; returns them.
fn in_child(join: &[PathBuf], probes: &[Probe]) -> Vec<i32> {
    assert!(probes.len() <= MAX_PROBES);
    let join: Vec<CString> = join.iter().map(cstr).collect();
    let (r, w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).unwrap();
    let w_raw = w.as_raw_fd();
    // SAFETY: the child only makes system calls on memory prepared before the fork (no
    // allocation, no locks) and ends in _exit.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
    if pid == 0 {
        // SAFETY: as above; `join` and `probes` are the parent's, copied by fork.
        unsafe {
            for f in &join {
                let fd = libc::open(f.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
                if fd < 0 || libc::write(fd, c"0".as_ptr().cast(), 1) != 1 {
                    libc::_exit(100);
                }
                libc::close(fd);
            }
            let mut out = [0i32; MAX_PROBES];
            for (i, p) in probes.iter().enumerate() {
                out[i] = run_op(&p.op);
            }
            let len = probes.len() * 4;
            if libc::write(w_raw, out.as_ptr().cast(), len) != len as isize {
                libc::_exit(101);
            }
            libc::_exit(0);
        }
    }
    let child = Child(pid);
    drop(w);
    let mut bytes = Vec::new();
    std::fs::File::from(r).read_to_end(&mut bytes).unwrap();
    let status = child.wait();
    assert_eq!(
        status, 0,
        "the probe child failed (exit 100: it could not join the cgroup via {join:?})"
    );
    bytes
        .chunks_exact(4)
        .map(|c| i32::from_ne_bytes(c.try_into().unwrap()))
        .collect()
}

/// A forked child, killed and reaped if the test fails before it is waited for.
struct Child(libc::pid_t);

impl Child {
    fn wait(self) -> i32 {
        let mut status = 0;
        // SAFETY: waits for our own child.
        let r = unsafe { libc::waitpid(self.0, &mut status, 0) };
        assert_eq!(r, self.0);
        std::mem::forget(self);
        if libc::WIFEXITED(status) {
            libc::WEXITSTATUS(status)
        } else {
            -status
        }
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        // SAFETY: kills and reaps our own child.
        unsafe {
            libc::kill(self.0, libc::SIGKILL);
            libc::waitpid(self.0, std::ptr::null_mut(), 0);
        }
    }
}

/// Removes cgroup directories (children first) when dropped, even after a failed
/// assertion.
struct CgroupDirs(Vec<PathBuf>);

impl Drop for CgroupDirs {
    fn drop(&mut self) {
        for d in &self.0 {
            // A cgroup whose last process was just reaped may still be busy for a moment.
            for _ in 0..400 {
                match std::fs::remove_dir(d) {
                    Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {
                        std::thread::sleep(std::time::Duration::from_millis(5))
                    }
                    Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                        eprintln!("removing {}: {e}", d.display());
                        break;
                    }
                    _ => break,
                }
            }
        }
    }
}

/// `major:minor` of a block device this (unrestricted) process can open read-only: the
/// root disk when it can, else the first other one (some hosts refuse their root disk to
/// everyone), and a description of which it is.
fn a_block_device(scratch: &Path) -> Option<(u32, u32, &'static str)> {
    let parse = |s: &str| -> Option<(u32, u32)> {
        let (a, b) = s.trim().split_once(':')?;
        Some((a.parse().ok()?, b.parse().ok()?))
    };
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    let root = mountinfo.lines().find_map(|l| {
        let f: Vec<&str> = l.split(' ').collect();
        (f.len() > 4 && f[4] == "/").then(|| parse(f[2])).flatten()
    });
    let mut others: Vec<(u32, u32)> = std::fs::read_dir("/sys/dev/block")
        .ok()?
        .flatten()
        .filter_map(|e| parse(&e.file_name().to_string_lossy()))
        .collect();
    others.sort();
    let candidates = root
        .filter(|&(major, _)| major != 0)
        .map(|d| (d, "the root disk"))
        .into_iter()
        .chain(others.into_iter().map(|d| (d, "a block device")));
    for ((major, minor), what) in candidates {
        let node = scratch.join(format!("probe-{major}-{minor}"));
        let made = nix::sys::stat::mknod(
            &node,
            nix::sys::stat::SFlag::S_IFBLK,
            nix::sys::stat::Mode::from_bits_truncate(0o600),
            libc::makedev(major, minor),
        );
        let opens = made.is_ok() && std::fs::File::open(&node).is_ok();
        let _ = std::fs::remove_file(&node);
        if opens {
            return Some((major, minor, what));
        }
        eprintln!("block device {major}:{minor} ({what}) does not open here even unrestricted");
    }
    None
}

/// The files and nodes one run of the probes works on, in `dir`.
fn probes(dir: &Path, microvm: bool) -> Vec<Probe> {
    let node = |name: &str, mode: libc::mode_t, major: u32, minor: u32| {
        let p = dir.join(name);
        nix::sys::stat::mknod(
            &p,
            nix::sys::stat::SFlag::from_bits_truncate(mode),
            nix::sys::stat::Mode::from_bits_truncate(0o600),
            libc::makedev(major, minor),
        )
        .unwrap_or_else(|e| panic!("mknod {} (outside any restriction): {e}", p.display()));
        cstr(p)
    };
    let eperm_unless = |allowed: bool| if allowed { 0 } else { libc::EPERM };
    let mut v = vec![
        Probe {
            what: "open /dev/null rw".into(),
            op: Op::Open {
                path: c"/dev/null".into(),
                flags: libc::O_RDWR,
            },
            want: 0,
            control_works: true,
        },
        Probe {
            what: "open /dev/urandom r".into(),
            op: Op::Open {
                path: c"/dev/urandom".into(),
                flags: libc::O_RDONLY,
            },
            want: 0,
            control_works: true,
        },
        Probe {
            what: "open a 1:3 node made beforehand rw".into(),
            op: Op::Open {
                path: node("null", libc::S_IFCHR, 1, 3),
                flags: libc::O_RDWR,
            },
            want: 0,
            control_works: true,
        },
        Probe {
            what: "mknod c 1:3 (allowed device, no mknod right)".into(),
            op: Op::Mknod {
                path: cstr(dir.join("new-null")),
                mode: libc::S_IFCHR | 0o600,
                dev: libc::makedev(1, 3),
            },
            want: libc::EPERM,
            control_works: true,
        },
        Probe {
            what: "mknod c 10:232 (kvm)".into(),
            op: Op::Mknod {
                path: cstr(dir.join("new-kvm")),
                mode: libc::S_IFCHR | 0o600,
                dev: libc::makedev(10, 232),
            },
            want: libc::EPERM,
            control_works: true,
        },
        Probe {
            what: "open a 1:1 (/dev/mem) node made beforehand r".into(),
            op: Op::Open {
                path: node("mem", libc::S_IFCHR, 1, 1),
                flags: libc::O_RDONLY,
            },
            want: libc::EPERM,
            // Kernel lockdown may refuse /dev/mem to anyone.
            control_works: false,
        },
    ];
    if Path::new("/dev/kvm").exists() {
        v.push(Probe {
            what: "open /dev/kvm rw".into(),
            op: Op::Open {
                path: c"/dev/kvm".into(),
                flags: libc::O_RDWR,
            },
            want: eperm_unless(microvm),
            control_works: true,
        });
    } else {
        eprintln!("no /dev/kvm on this host: its probe is left out");
    }
    if Path::new("/dev/net/tun").exists() {
        v.push(Probe {
            what: "open /dev/net/tun rw".into(),
            op: Op::Open {
                path: c"/dev/net/tun".into(),
                flags: libc::O_RDWR,
            },
            want: eperm_unless(microvm),
            control_works: true,
        });
    } else {
        eprintln!("no /dev/net/tun on this host: its probe is left out");
    }
    if let Some((major, minor, which)) = a_block_device(dir) {
        v.push(Probe {
            what: format!("open a node of block device {major}:{minor} ({which}) r"),
            op: Op::Open {
                path: node("disk", libc::S_IFBLK, major, minor),
                flags: libc::O_RDONLY,
            },
            want: libc::EPERM,
            control_works: true,
        });
        v.push(Probe {
            what: format!("mknod b {major}:{minor}"),
            op: Op::Mknod {
                path: cstr(dir.join("new-disk")),
                mode: libc::S_IFBLK | 0o600,
                dev: libc::makedev(major, minor),
            },
            want: libc::EPERM,
            control_works: true,
        });
    } else {
        eprintln!("no block device on this host: its probes are left out");
    }
    let ov = dir.join("overlay");
    for d in ["lower", "upper", "work", "merged"] {
        std::fs::create_dir_all(ov.join(d)).unwrap();
    }
    std::fs::write(ov.join("lower/f"), "lower").unwrap();
    v.push(Probe {
        what: "delete a lower-layer file through overlayfs (whiteout c 0:0)".into(),
        op: Op::OverlayUnlink {
            merged: cstr(ov.join("merged")),
            data: CString::new(format!(
                "lowerdir={},upperdir={},workdir={}",
                ov.join("lower").display(),
                ov.join("upper").display(),
                ov.join("work").display()
            ))
            .unwrap(),
            file: cstr(ov.join("merged/f")),
        },
        want: 0,
        control_works: true,
    });
    v
}

fn describe(code: i32) -> String {
    match code {
        0 => "ok".into(),
        c if c >= 1000 => format!(
            "setup step {} failed: {}",
            c / 1000,
            std::io::Error::from_raw_os_error(c % 1000)
        ),
        c => std::io::Error::from_raw_os_error(c).to_string(),
    }
}

/// Runs the probes unrestricted and then in the cgroup (`join`), and checks both.
fn check(join: &[PathBuf], microvm: bool) {
    let control_dir = tempfile::tempdir().unwrap();
    let control = probes(control_dir.path(), microvm);
    let got = in_child(&[], &control);
    let mut report = String::from("without restriction:\n");
    let mut bad = false;
    for (p, g) in control.iter().zip(&got) {
        report.push_str(&format!("  {:<70} {}\n", p.what, describe(*g)));
        bad |= p.control_works && *g != 0;
    }
    // The overlay's whiteout is a 0:0 character device in the upper layer.
    assert_whiteout(control_dir.path());
    let dir = tempfile::tempdir().unwrap();
    let restricted = probes(dir.path(), microvm);
    let got = in_child(join, &restricted);
    report.push_str("in the restricted cgroup (want → got):\n");
    for (p, g) in restricted.iter().zip(&got) {
        let mark = if *g == p.want { "" } else { "   <-- WRONG" };
        report.push_str(&format!(
            "  {:<70} {} → {}{mark}\n",
            p.what,
            describe(p.want),
            describe(*g)
        ));
        bad |= *g != p.want;
    }
    eprintln!("{report}");
    assert!(!bad, "{report}");
    assert_whiteout(dir.path());
}

fn assert_whiteout(dir: &Path) {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let wh = dir.join("overlay/upper/f");
    let m = std::fs::symlink_metadata(&wh).unwrap();
    assert!(
        m.file_type().is_char_device() && m.rdev() == 0,
        "{} is no whiteout",
        wh.display()
    );
}

// ---------------------------------------------------------------------------------------
// cgroup v1

/// A sandbox cgroup made the way the jail makes one (every v1 hierarchy, limits), or
/// `None` (with the reason printed) when the host has no v1 devices hierarchy.
fn v1_sandbox(test: &str) -> Option<(SandboxCgroup, CgroupDirs)> {
    let h = match Hierarchy::detect() {
        Ok(h @ Hierarchy::V1(_)) => h,
        Ok(_) => {
            eprintln!("skipped: this host uses cgroup v2 (the v2 tests cover it)");
            return None;
        }
        Err(e) => {
            eprintln!("skipped: no usable cgroup v1 hierarchy with devices: {e}");
            return None;
        }
    };
    let parent = unique(test);
    h.prepare_parent(&parent).unwrap();
    let cg = h.sandbox(&parent, "sbx");
    let mut dirs: Vec<PathBuf> = cg.dirs().to_vec();
    dirs.extend(cg.dirs().iter().map(|d| d.parent().unwrap().to_path_buf()));
    let guard = CgroupDirs(dirs);
    cg.create(Limits {
        cpus: 1,
        memory_bytes: 256 << 20,
        max_processes: 64,
    })
    .unwrap();
    Some((cg, guard))
}

fn devices_dir(cg: &SandboxCgroup) -> PathBuf {
    cg.dirs()
        .iter()
        .find(|d| d.join("devices.list").exists())
        .expect("a devices directory among the sandbox's cgroups")
        .clone()
}

fn sorted(mut v: Vec<String>) -> Vec<String> {
    v.sort();
    v
}

#[test]
fn v1_standard_rules_deny_host_devices_and_mknod() {
    if let Some(r) = skip_reason() {
        eprintln!("skipped: {r}");
        return;
    }
    let Some((cg, _guard)) = v1_sandbox("v1std") else {
        return;
    };
    cg.restrict_devices(devices::STANDARD).unwrap();
    let list = std::fs::read_to_string(devices_dir(&cg).join("devices.list")).unwrap();
    assert_eq!(
        sorted(list.lines().map(str::to_string).collect()),
        sorted(devices::v1_lines(devices::STANDARD)),
        "devices.list"
    );
    check(&cg.join_files(), false);
}

#[test]
fn v1_microvm_rules_replace_the_standard_ones_and_allow_kvm_and_tun() {
    if let Some(r) = skip_reason() {
        eprintln!("skipped: {r}");
        return;
    }
    let Some((cg, _guard)) = v1_sandbox("v1vm") else {
        return;
    };
    cg.restrict_devices(devices::STANDARD).unwrap();
    cg.restrict_devices(devices::MICROVM).unwrap();
    let list = std::fs::read_to_string(devices_dir(&cg).join("devices.list")).unwrap();
    assert_eq!(
        sorted(list.lines().map(str::to_string).collect()),
        sorted(devices::v1_lines(devices::MICROVM)),
        "devices.list"
    );
    check(&cg.join_files(), true);
}

// ---------------------------------------------------------------------------------------
// cgroup v2

/// A cgroup2 mount: the host's, or one made in a temporary directory for the test (also
/// when `AGENTENV_TEST_OWN_CGROUP2` is set).
struct Cgroup2 {
    mount: PathBuf,
    /// Unmounted before its directory is removed (fields drop in order).
    _made: Option<(Unmount, tempfile::TempDir)>,
}

struct Unmount(PathBuf);

impl Drop for Unmount {
    fn drop(&mut self) {
        let _ = nix::mount::umount2(&self.0, nix::mount::MntFlags::MNT_DETACH);
    }
}

fn cgroup2() -> Cgroup2 {
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let found = mountinfo.lines().find_map(|l| {
        let (left, right) = l.split_once(" - ")?;
        let f: Vec<&str> = left.split(' ').collect();
        (right.starts_with("cgroup2 ") && f.get(3) == Some(&"/")).then(|| PathBuf::from(f[4]))
    });
    // AGENTENV_TEST_OWN_CGROUP2=1 takes the path of hosts without a cgroup2 mount.
    if let Some(mount) = found.filter(|_| std::env::var_os("AGENTENV_TEST_OWN_CGROUP2").is_none()) {
        return Cgroup2 { mount, _made: None };
    }
    let dir = tempfile::tempdir().unwrap();
    nix::mount::mount(
        Some("cgroup2"),
        dir.path(),
        Some("cgroup2"),
        nix::mount::MsFlags::empty(),
        None::<&str>,
    )
    .expect("mounting cgroup2 for the test");
    let mount = dir.path().to_path_buf();
    Cgroup2 {
        mount: mount.clone(),
        _made: Some((Unmount(mount), dir)),
    }
}

/// A v2 sandbox cgroup under `<cgroup2 mount>/<unique>/sbx`. Created by hand: the limits
/// of `create` need controllers this host's unified hierarchy does not carry, and the
/// device program needs none.
fn v2_sandbox(cg2: &Cgroup2, test: &str) -> (SandboxCgroup, CgroupDirs) {
    let h = Hierarchy::V2 {
        mount: cg2.mount.clone(),
        own: "/".into(),
    };
    let parent = format!("/{}", unique(test));
    let cg = h.sandbox(&parent, "sbx");
    let dir = cg.dirs()[0].clone();
    let guard = CgroupDirs(vec![dir.clone(), dir.parent().unwrap().to_path_buf()]);
    std::fs::create_dir_all(&dir).unwrap();
    (cg, guard)
}

#[test]
fn v2_standard_program_denies_host_devices_and_mknod() {
    if let Some(r) = skip_reason() {
        eprintln!("skipped: {r}");
        return;
    }
    let cg2 = cgroup2();
    let (cg, _guard) = v2_sandbox(&cg2, "v2std");
    cg.restrict_devices(devices::STANDARD).unwrap();
    check(&cg.join_files(), false);
}

#[test]
fn v2_microvm_program_replaces_the_standard_one_and_allows_kvm_and_tun() {
    if let Some(r) = skip_reason() {
        eprintln!("skipped: {r}");
        return;
    }
    let cg2 = cgroup2();
    let (cg, _guard) = v2_sandbox(&cg2, "v2vm");
    cg.restrict_devices(devices::STANDARD).unwrap();
    cg.restrict_devices(devices::MICROVM).unwrap();
    check(&cg.join_files(), true);
}

#[test]
fn v2_custom_rules_with_wildcards_and_any_kind() {
    if let Some(r) = skip_reason() {
        eprintln!("skipped: {r}");
        return;
    }
    let cg2 = cgroup2();
    let (cg, _guard) = v2_sandbox(&cg2, "v2custom");
    // Any kind, major 1, any minor, read only: /dev/null opens for reading, not writing.
    let rules = [DeviceRule::new(
        devices::DeviceKind::Any,
        Some(1),
        None,
        devices::Access::READ,
    )];
    cg.restrict_devices(&rules).unwrap();
    let probes = [
        Probe {
            what: "open /dev/null r".into(),
            op: Op::Open {
                path: c"/dev/null".into(),
                flags: libc::O_RDONLY,
            },
            want: 0,
            control_works: true,
        },
        Probe {
            what: "open /dev/null w".into(),
            op: Op::Open {
                path: c"/dev/null".into(),
                flags: libc::O_WRONLY,
            },
            want: libc::EPERM,
            control_works: true,
        },
        Probe {
            what: "open /dev/tty r (5:0)".into(),
            op: Op::Open {
                path: c"/dev/tty".into(),
                flags: libc::O_RDONLY,
            },
            want: libc::EPERM,
            control_works: false,
        },
    ];
    let got = in_child(&cg.join_files(), &probes);
    for (p, g) in probes.iter().zip(&got) {
        assert_eq!(*g, p.want, "{}: got {}", p.what, describe(*g));
    }
}

#[test]
fn v2_attach_to_a_directory_that_is_no_cgroup_says_why() {
    if let Some(r) = skip_reason() {
        eprintln!("skipped: {r}");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let err = devices::attach_bpf(dir.path(), devices::STANDARD).unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("attaching the device BPF program"), "{msg}");
    assert!(msg.contains("cgroup v2 directory"), "{msg}");
    // The program itself loads: only the target was wrong.
    devices::check_bpf_support().unwrap();
}
