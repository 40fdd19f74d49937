//! A tap device opened by name, with the virtio-net header in front of every frame.
//!
//! The node creates the tap inside the sandbox's network namespace and the VMM runs in
//! that namespace, so the VMM only attaches to it by name (`TUNSETIFF` on an existing
//! interface attaches; on a missing one the kernel creates a tap that lives as long as
//! the file descriptor). The descriptor is non-blocking: reads answer `WouldBlock` when
//! no frame is queued, writes when the tap's queue is full.
//!
//! Every frame read or written starts with the 12-byte `virtio_net_hdr_v1`
//! (`TUNSETVNETHDRSZ`), which is exactly the header a virtio 1.0 driver puts in front of
//! its frames, so the header passes between the guest and the kernel unchanged.

use std::fs::{File, OpenOptions};
use std::io::{self, IoSlice, Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;

/// Size of the virtio-net header (`struct virtio_net_hdr_v1`, with `num_buffers`).
pub const VNET_HDR_LEN: usize = 12;

/// Why the tap could not be opened or configured.
#[derive(Debug, thiserror::Error)]
pub enum TapError {
    #[error(
        "tap name {0:?} is invalid: it must be 1 to 15 bytes without NUL (the interface name limit)"
    )]
    InvalidName(String),
    #[error(
        "cannot open /dev/net/tun (is the tun module loaded and the device node present?): {0}"
    )]
    OpenTun(#[source] io::Error),
    #[error(
        "cannot attach to tap {name:?} (TUNSETIFF; does the interface exist in this network namespace as a tap, not a tun, and is nobody else attached?): {source}"
    )]
    SetIff {
        name: String,
        #[source]
        source: io::Error,
    },
    #[error("cannot set the virtio-net header size of tap {name:?} (TUNSETVNETHDRSZ): {source}")]
    SetVnetHdrSize {
        name: String,
        #[source]
        source: io::Error,
    },
    #[error("cannot set offloads {flags:#x} on tap {name:?} (TUNSETOFFLOAD): {source}")]
    SetOffload {
        name: String,
        flags: u32,
        #[source]
        source: io::Error,
    },
}

/// An open tap device.
#[derive(Debug)]
pub struct Tap {
    file: File,
    name: String,
}

fn ifreq_with_name(name: &str) -> Result<libc::ifreq, TapError> {
    let bytes = name.as_bytes();
    if bytes.is_empty() || bytes.len() >= libc::IFNAMSIZ || bytes.contains(&0) {
        return Err(TapError::InvalidName(name.to_string()));
    }
    // SAFETY: `ifreq` is a plain C struct (arrays, integers, a union of such and a raw
    // pointer); all-zero bytes are a valid value of it.
    let mut ifr: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in ifr.ifr_name.iter_mut().zip(bytes) {
        *dst = *src as libc::c_char;
    }
    Ok(ifr)
}

impl Tap {
    /// Opens the tap `name` (non-blocking, no packet information, with the 12-byte
    /// virtio-net header) and turns every offload off until [`Tap::set_offload`] says
    /// which ones the guest accepted.
    pub fn open(name: &str) -> Result<Tap, TapError> {
        let mut ifr = ifreq_with_name(name)?;
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
            .open("/dev/net/tun")
            .map_err(TapError::OpenTun)?;
        ifr.ifr_ifru.ifru_flags = (libc::IFF_TAP | libc::IFF_NO_PI | libc::IFF_VNET_HDR) as i16;
        // SAFETY: TUNSETIFF reads and writes one `struct ifreq`; `ifr` is a valid, owned
        // `ifreq` that outlives the call, and `file` is an open tun descriptor.
        let ret = unsafe { libc::ioctl(file.as_raw_fd(), libc::TUNSETIFF, &mut ifr) };
        if ret < 0 {
            return Err(TapError::SetIff {
                name: name.to_string(),
                source: io::Error::last_os_error(),
            });
        }
        let tap = Tap {
            file,
            name: name.to_string(),
        };
        let hdr_len: libc::c_int = VNET_HDR_LEN as libc::c_int;
        // SAFETY: TUNSETVNETHDRSZ reads one `int` through the pointer; `hdr_len` lives on
        // the stack for the whole call.
        let ret = unsafe { libc::ioctl(tap.file.as_raw_fd(), libc::TUNSETVNETHDRSZ, &hdr_len) };
        if ret < 0 {
            return Err(TapError::SetVnetHdrSize {
                name: name.to_string(),
                source: io::Error::last_os_error(),
            });
        }
        tap.set_offload(0)?;
        Ok(tap)
    }

    /// The interface name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Tells the kernel which offloads the reader (the guest) accepts, as `TUN_F_*`
    /// flags: with `TUN_F_CSUM` the kernel may hand over frames with a partial checksum
    /// (`VIRTIO_NET_HDR_F_NEEDS_CSUM`), with `TUN_F_TSO4`/`TUN_F_TSO6` frames up to 64 KiB
    /// that the guest segments itself.
    pub fn set_offload(&self, flags: u32) -> Result<(), TapError> {
        // SAFETY: TUNSETOFFLOAD takes its argument by value (an unsigned long of flags);
        // no memory is passed.
        let ret = unsafe {
            libc::ioctl(
                self.file.as_raw_fd(),
                libc::TUNSETOFFLOAD,
                flags as libc::c_ulong,
            )
        };
        if ret < 0 {
            return Err(TapError::SetOffload {
                name: self.name.clone(),
                flags,
                source: io::Error::last_os_error(),
            });
        }
        Ok(())
    }

    /// Reads one frame (virtio-net header included); `WouldBlock` when none is queued.
    /// A buffer shorter than the frame gets the frame truncated, so callers pass one of
    /// at least 12 + 65535 + 14 bytes.
    pub fn read_frame(&self, buf: &mut [u8]) -> io::Result<usize> {
        (&self.file).read(buf)
    }

    /// Writes one frame (virtio-net header included) from several pieces.
    pub fn write_frame(&self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        (&self.file).write_vectored(bufs)
    }
}

#[cfg(test)]
impl Tap {
    /// A tap over any file that passes whole frames (one end of a datagram socket pair),
    /// for driving the device without a network namespace.
    pub(crate) fn from_file(file: File, name: &str) -> Tap {
        Tap {
            file,
            name: name.to_string(),
        }
    }
}

impl AsRawFd for Tap {
    fn as_raw_fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_longer_than_the_interface_limit_are_refused() {
        let err = Tap::open("a-name-that-is-too-long").unwrap_err();
        assert!(matches!(err, TapError::InvalidName(_)), "{err}");
        let err = Tap::open("").unwrap_err();
        assert!(matches!(err, TapError::InvalidName(_)), "{err}");
        let err = Tap::open("a\0b").unwrap_err();
        assert!(matches!(err, TapError::InvalidName(_)), "{err}");
    }
}
