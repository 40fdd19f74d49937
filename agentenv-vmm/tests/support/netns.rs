//! A network namespace of a test's own holding a tap, and the frames the virtio-net tests
//! exchange through it. Shared by the device's unit tests (which include this file by path)
//! and the integration tests (through `support`).
//!
//! [`in_netns`] runs a closure on a thread that unshares its network namespace: the tap,
//! its address, every socket and whatever the thread starts (a device's worker, a VM's
//! threads) live there and vanish with the thread, also when an assertion fails.
#![allow(dead_code)]

use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::process::Command;
use std::time::{Duration, Instant};

/// The tap's MAC in every test namespace.
pub const TAP_MAC: [u8; 6] = [0x02, 0x00, 0x00, 0x00, 0x00, 0x01];

/// Runs `f` on a thread in a fresh network namespace holding the tap `tap` (address `cidr`,
/// MAC [`TAP_MAC`], up, IPv6 off so the kernel sends nothing unasked).
pub fn in_netns<R: Send>(tap: &str, cidr: &str, f: impl FnOnce() -> R + Send) -> R {
    std::thread::scope(|s| {
        s.spawn(|| {
            // SAFETY: unshare only changes this thread's namespace membership.
            let ret = unsafe { libc::unshare(libc::CLONE_NEWNET) };
            assert_eq!(
                ret,
                0,
                "unshare(CLONE_NEWNET) failed (the test needs root): {}",
                std::io::Error::last_os_error()
            );
            for knob in ["all", "default"] {
                let _ = std::fs::write(format!("/proc/sys/net/ipv6/conf/{knob}/disable_ipv6"), "1");
            }
            ip(&["link", "set", "lo", "up"]);
            ip(&["tuntap", "add", "dev", tap, "mode", "tap"]);
            ip(&["link", "set", "dev", tap, "address", &mac_str(&TAP_MAC)]);
            ip(&["addr", "add", cidr, "dev", tap]);
            ip(&["link", "set", "dev", tap, "up"]);
            f()
        })
        .join()
        .unwrap_or_else(|e| std::panic::resume_unwind(e))
    })
}

/// Runs `ip` with `args` and checks that it succeeded.
pub fn ip(args: &[&str]) {
    let out = Command::new("ip")
        .args(args)
        .output()
        .expect("running ip (package iproute2)");
    assert!(
        out.status.success(),
        "ip {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `aa:bb:cc:dd:ee:ff`.
pub fn mac_str(mac: &[u8; 6]) -> String {
    mac.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

/// `ip -j link show` of `tap` in this thread's namespace.
pub fn link(tap: &str) -> serde_json::Value {
    let out = Command::new("ip")
        .args(["-j", "link", "show", "dev", tap])
        .output()
        .expect("running ip (package iproute2)");
    assert!(
        out.status.success(),
        "ip link show {tap}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    v[0].clone()
}

/// Whether something is attached to the tap of [`link`].
pub fn has_carrier(link: &serde_json::Value) -> bool {
    link["flags"]
        .as_array()
        .is_some_and(|f| f.iter().any(|x| x == "LOWER_UP"))
}

/// Waits until the kernel transmits on the tap: attaching the device turns the carrier
/// on, and until the link watcher has swapped the `noop` queueing discipline for a real
/// one every frame the kernel sends to the tap is dropped.
pub fn wait_tap_transmits(tap: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let l = link(tap);
        if l["operstate"] == "UP" && l["qdisc"] != "noop" {
            return;
        }
        assert!(Instant::now() < deadline, "tap never came up: {l}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// An `AF_PACKET` socket bound to `tap` that sees the frames of `ethertype` crossing it
/// (`ETH_P_ALL`: every frame, both ways); a receive waits at most 10 s.
pub fn packet_socket(tap: &str, ethertype: u16) -> OwnedFd {
    let protocol = ethertype.to_be();
    // SAFETY: plain socket(2) call; the result is checked before use.
    let fd = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW, i32::from(protocol)) };
    assert!(
        fd >= 0,
        "AF_PACKET socket: {}",
        std::io::Error::last_os_error()
    );
    // SAFETY: `fd` is a fresh descriptor owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let name = CString::new(tap).unwrap();
    // SAFETY: `name` is a NUL-terminated string that outlives the call.
    let ifindex = unsafe { libc::if_nametoindex(name.as_ptr()) };
    assert!(ifindex > 0, "no interface {tap} in the test's namespace");
    // SAFETY: all-zero is a valid sockaddr_ll.
    let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
    sll.sll_family = libc::AF_PACKET as u16;
    sll.sll_protocol = protocol;
    sll.sll_ifindex = ifindex as i32;
    // SAFETY: `sll` is a valid sockaddr_ll of the length given.
    let ret = unsafe {
        libc::bind(
            fd.as_raw_fd(),
            (&sll as *const libc::sockaddr_ll).cast(),
            std::mem::size_of::<libc::sockaddr_ll>() as u32,
        )
    };
    assert_eq!(
        ret,
        0,
        "bind AF_PACKET: {}",
        std::io::Error::last_os_error()
    );
    let tv = libc::timeval {
        tv_sec: 10,
        tv_usec: 0,
    };
    // SAFETY: SO_RCVTIMEO takes a timeval of the length given.
    let ret = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            (&tv as *const libc::timeval).cast(),
            std::mem::size_of::<libc::timeval>() as u32,
        )
    };
    assert_eq!(ret, 0, "SO_RCVTIMEO: {}", std::io::Error::last_os_error());
    fd
}

/// The next frame on the socket (waits at most 10 s).
pub fn recv_frame(fd: &OwnedFd) -> Vec<u8> {
    let mut buf = vec![0u8; 2048];
    // SAFETY: `buf` is writable for its whole length.
    let n = unsafe { libc::recv(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
    assert!(
        n > 0,
        "no frame on the tap within 10 s: {}",
        std::io::Error::last_os_error()
    );
    buf.truncate(n as usize);
    buf
}

/// Sends `frame` whole on the socket.
pub fn send_frame(fd: &OwnedFd, frame: &[u8]) {
    // SAFETY: `frame` is readable for its whole length.
    let n = unsafe { libc::send(fd.as_raw_fd(), frame.as_ptr().cast(), frame.len(), 0) };
    assert_eq!(
        n,
        frame.len() as isize,
        "send on the tap: {}",
        std::io::Error::last_os_error()
    );
}

/// A broadcast ARP request "who has `target_ip`, tell `sender_ip`" from `sender_mac`.
pub fn arp_request(sender_mac: [u8; 6], sender_ip: [u8; 4], target_ip: [u8; 4]) -> Vec<u8> {
    let mut f = Vec::new();
    f.extend_from_slice(&[0xff; 6]);
    f.extend_from_slice(&sender_mac);
    f.extend_from_slice(&[0x08, 0x06]);
    f.extend_from_slice(&[0, 1, 8, 0, 6, 4, 0, 1]); // Ethernet/IPv4, request
    f.extend_from_slice(&sender_mac);
    f.extend_from_slice(&sender_ip);
    f.extend_from_slice(&[0; 6]);
    f.extend_from_slice(&target_ip);
    f
}

/// Checks that `f` is the kernel's ARP reply from the tap (`tap_ip`) to the guest's request
/// ([`arp_request`] from `guest_mac`, `guest_ip`).
pub fn assert_arp_reply(f: &[u8], guest_mac: [u8; 6], guest_ip: [u8; 4], tap_ip: [u8; 4]) {
    assert!(f.len() >= 42, "frame too short for ARP: {f:02x?}");
    assert_eq!(&f[0..6], &guest_mac, "destination is the guest: {f:02x?}");
    assert_eq!(&f[6..12], &TAP_MAC, "source is the tap: {f:02x?}");
    assert_eq!(&f[12..14], &[0x08, 0x06], "ARP: {f:02x?}");
    assert_eq!(&f[20..22], &[0, 2], "an ARP reply: {f:02x?}");
    assert_eq!(&f[22..28], &TAP_MAC, "the tap's MAC answers: {f:02x?}");
    assert_eq!(&f[28..32], &tap_ip, "for the tap's address: {f:02x?}");
    assert_eq!(&f[32..38], &guest_mac, "to the guest's MAC: {f:02x?}");
    assert_eq!(&f[38..42], &guest_ip, "and address: {f:02x?}");
}
