//! The device nodes every sandbox's `/dev` holds, whoever makes it: the agent in init
//! mode on a bare root (`pid1`), the node's jail (which binds the host's nodes of these
//! numbers and allows exactly them in the sandbox's device cgroup), a VM's devtmpfs.

/// `(name under /dev, major, minor)` of the basic character devices.
pub const BASIC_DEVICES: [(&str, u32, u32); 6] = [
    ("null", 1, 3),
    ("zero", 1, 5),
    ("full", 1, 7),
    ("random", 1, 8),
    ("urandom", 1, 9),
    ("tty", 5, 0),
];

/// `(link under /dev, target)` of the standard links to the process's descriptors.
pub const FD_LINKS: [(&str, &str); 4] = [
    ("fd", "/proc/self/fd"),
    ("stdin", "/proc/self/fd/0"),
    ("stdout", "/proc/self/fd/1"),
    ("stderr", "/proc/self/fd/2"),
];
