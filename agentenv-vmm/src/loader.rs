//! Loading the guest: the kernel (ELF vmlinux, with its PVH note when present, or a
//! bzImage) through linux-loader, the initrd, the command line, and the boot parameters
//! the kernel reads (the Linux zero page, or the PVH start info).

use std::fs::File;
use std::path::Path;

use linux_loader::cmdline::Cmdline;
use linux_loader::loader::bootparam::{boot_e820_entry, boot_params, setup_header};
use linux_loader::loader::elf::PvhBootCapability;
use linux_loader::loader::{BzImage, Elf, KernelLoader, load_cmdline};
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend};

use crate::arch::regs::EntryMode;
use crate::arch::*;
use crate::config::{KernelFormat, kernel_format};
use crate::memory::GuestMemoryMmap;

/// Why the guest could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum LoaderError {
    #[error("kernel: {0}")]
    KernelFile(String),
    #[error("kernel {path:?}: {source}")]
    Load {
        path: String,
        source: linux_loader::loader::Error,
    },
    #[error("initrd {path:?}: {reason}")]
    Initrd { path: String, reason: String },
    #[error("kernel command line: {0}")]
    Cmdline(String),
    #[error("writing the boot parameters failed: {0}")]
    Memory(#[from] vm_memory::GuestMemoryError),
}

/// Where and how the boot vCPU enters the kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BootEntry {
    pub entry: u64,
    pub mode: EntryMode,
    pub kernel_end: u64,
    pub initrd: Option<(u64, u64)>,
}

const KERNEL_BOOT_FLAG_MAGIC: u16 = 0xaa55;
const KERNEL_HDR_MAGIC: u32 = 0x5372_6448;
const KERNEL_LOADER_OTHER: u8 = 0xff;
const KERNEL_MIN_ALIGNMENT_BYTES: u32 = 0x0100_0000;
const DEFAULT_INITRD_ADDR_MAX: u64 = 0x7fff_ffff;
const PVH_START_MAGIC: u32 = 0x336e_c578;

/// The parameters the VMM appends to the user's command line.
pub const DEFAULT_CMDLINE_PARAMS: &str = "console=ttyS0 reboot=k panic=1 pci=off";

/// Builds the kernel command line: the user's, the VMM's own parameters (those the user
/// did not set), and one `virtio_mmio.device=` per device `(base, size, irq)`.
pub fn build_cmdline(user: &str, devices: &[(u64, u64, u32)]) -> Result<Cmdline, LoaderError> {
    let mut cmdline = Cmdline::try_from(user, crate::config::CMDLINE_MAX)
        .map_err(|e| LoaderError::Cmdline(e.to_string()))?;
    for param in DEFAULT_CMDLINE_PARAMS.split(' ') {
        let key = param.split('=').next().unwrap_or(param);
        let set = user
            .split_whitespace()
            .any(|w| w == key || w.starts_with(&format!("{key}=")));
        if !set {
            cmdline
                .insert_str(param)
                .map_err(|e| LoaderError::Cmdline(e.to_string()))?;
        }
    }
    for &(base, size, irq) in devices {
        cmdline
            .add_virtio_mmio_device(size, GuestAddress(base), irq, None)
            .map_err(|e| LoaderError::Cmdline(e.to_string()))?;
    }
    Ok(cmdline)
}

fn lowmem_end(mem: &GuestMemoryMmap) -> u64 {
    let end = mem.last_addr().0 + 1;
    end.min(MMIO_GAP_START)
}

/// Loads the kernel, the initrd and the command line, and writes the boot parameters.
pub fn load(
    mem: &GuestMemoryMmap,
    kernel: &Path,
    initrd: Option<&Path>,
    cmdline: &Cmdline,
) -> Result<BootEntry, LoaderError> {
    let format = kernel_format(kernel).map_err(LoaderError::KernelFile)?;
    let mut file =
        File::open(kernel).map_err(|e| LoaderError::KernelFile(format!("{kernel:?}: {e}")))?;
    let load_err = |source| LoaderError::Load {
        path: kernel.display().to_string(),
        source,
    };
    let (entry, mode, kernel_end, header) = match format {
        KernelFormat::Elf => {
            let r = Elf::load(mem, None, &mut file, Some(GuestAddress(HIMEM_START)))
                .map_err(load_err)?;
            match r.pvh_boot_cap {
                PvhBootCapability::PvhEntryPresent(addr) => {
                    (addr.0, EntryMode::Pvh, r.kernel_end, None)
                }
                _ => (r.kernel_load.0, EntryMode::Long64, r.kernel_end, None),
            }
        }
        KernelFormat::BzImage => {
            let r = BzImage::load(mem, None, &mut file, Some(GuestAddress(HIMEM_START)))
                .map_err(load_err)?;
            // The 64-bit entry point of a bzImage is 0x200 past its load address.
            (
                r.kernel_load.0 + 0x200,
                EntryMode::Long64,
                r.kernel_end,
                r.setup_header,
            )
        }
    };

    let cmdline_len = cmdline
        .as_cstring()
        .map_err(|e| LoaderError::Cmdline(e.to_string()))?
        .as_bytes_with_nul()
        .len();
    load_cmdline(mem, GuestAddress(CMDLINE_START), cmdline)
        .map_err(|e| LoaderError::Cmdline(e.to_string()))?;

    let initrd_addr_max = header
        .map(|h| u64::from(h.initrd_addr_max))
        .filter(|&m| m != 0)
        .unwrap_or(DEFAULT_INITRD_ADDR_MAX);
    let initrd = match initrd {
        Some(path) => Some(load_initrd(mem, path, kernel_end, initrd_addr_max)?),
        None => None,
    };

    match mode {
        EntryMode::Long64 => write_zero_page(mem, header, cmdline_len, initrd)?,
        EntryMode::Pvh => write_pvh_start_info(mem, initrd)?,
    }
    Ok(BootEntry {
        entry,
        mode,
        kernel_end,
        initrd,
    })
}

fn load_initrd(
    mem: &GuestMemoryMmap,
    path: &Path,
    kernel_end: u64,
    addr_max: u64,
) -> Result<(u64, u64), LoaderError> {
    let err = |reason: String| LoaderError::Initrd {
        path: path.display().to_string(),
        reason,
    };
    let mut f = File::open(path).map_err(|e| err(e.to_string()))?;
    let size = f.metadata().map_err(|e| err(e.to_string()))?.len();
    let top = lowmem_end(mem).min(addr_max + 1);
    let addr = top
        .checked_sub(size)
        .map(|a| a & !(PAGE_ALIGN - 1))
        .filter(|&a| a >= kernel_end)
        .ok_or_else(|| {
            err(format!(
                "{size} bytes do not fit between the kernel end {kernel_end:#x} and {top:#x}"
            ))
        })?;
    mem.read_exact_volatile_from(GuestAddress(addr), &mut f, size as usize)
        .map_err(|e| err(e.to_string()))?;
    Ok((addr, size))
}

const PAGE_ALIGN: u64 = 0x1000;

fn write_zero_page(
    mem: &GuestMemoryMmap,
    header: Option<setup_header>,
    cmdline_len: usize,
    initrd: Option<(u64, u64)>,
) -> Result<(), LoaderError> {
    let mut params = boot_params::default();
    if let Some(h) = header {
        params.hdr = h;
    }
    params.hdr.type_of_loader = KERNEL_LOADER_OTHER;
    params.hdr.boot_flag = KERNEL_BOOT_FLAG_MAGIC;
    params.hdr.header = KERNEL_HDR_MAGIC;
    params.hdr.cmd_line_ptr = CMDLINE_START as u32;
    params.hdr.cmdline_size = cmdline_len as u32;
    params.hdr.kernel_alignment = KERNEL_MIN_ALIGNMENT_BYTES;
    if params.hdr.initrd_addr_max == 0 {
        params.hdr.initrd_addr_max = DEFAULT_INITRD_ADDR_MAX as u32;
    }
    if let Some((addr, size)) = initrd {
        params.hdr.ramdisk_image = addr as u32;
        params.hdr.ramdisk_size = size as u32;
    }
    let size = mem.last_addr().0 + 1 - mmio_gap_len(mem);
    let map = e820_map(size);
    for (slot, (addr, len, kind)) in params.e820_table.iter_mut().zip(&map) {
        *slot = boot_e820_entry {
            addr: *addr,
            size: *len,
            r#type: *kind,
        };
    }
    params.e820_entries = map.len() as u8;
    mem.write_obj(params, GuestAddress(ZERO_PAGE_START))?;
    Ok(())
}

fn mmio_gap_len(mem: &GuestMemoryMmap) -> u64 {
    if mem.last_addr().0 >= MMIO_GAP_END {
        MMIO_GAP_END - MMIO_GAP_START
    } else {
        0
    }
}

fn write_pvh_start_info(
    mem: &GuestMemoryMmap,
    initrd: Option<(u64, u64)>,
) -> Result<(), LoaderError> {
    let size = mem.last_addr().0 + 1 - mmio_gap_len(mem);
    let map = e820_map(size);
    // hvm_memmap_table_entry: addr u64, size u64, type u32, reserved u32.
    let mut memmap = Vec::with_capacity(map.len() * 24);
    for (addr, len, kind) in &map {
        memmap.extend_from_slice(&addr.to_le_bytes());
        memmap.extend_from_slice(&len.to_le_bytes());
        memmap.extend_from_slice(&kind.to_le_bytes());
        memmap.extend_from_slice(&0u32.to_le_bytes());
    }
    mem.write_slice(&memmap, GuestAddress(PVH_MEMMAP_START))?;
    let modlist = PVH_MEMMAP_START + memmap.len() as u64;
    let mut nr_modules = 0u32;
    if let Some((addr, size)) = initrd {
        // hvm_modlist_entry: paddr, size, cmdline_paddr, reserved (u64 each).
        let mut m = Vec::with_capacity(32);
        for v in [addr, size, 0, 0] {
            m.extend_from_slice(&v.to_le_bytes());
        }
        mem.write_slice(&m, GuestAddress(modlist))?;
        nr_modules = 1;
    }
    // hvm_start_info (56 bytes).
    let mut info = Vec::with_capacity(56);
    info.extend_from_slice(&PVH_START_MAGIC.to_le_bytes());
    info.extend_from_slice(&1u32.to_le_bytes()); // version
    info.extend_from_slice(&0u32.to_le_bytes()); // flags
    info.extend_from_slice(&nr_modules.to_le_bytes());
    info.extend_from_slice(&(if nr_modules > 0 { modlist } else { 0 }).to_le_bytes());
    info.extend_from_slice(&CMDLINE_START.to_le_bytes());
    info.extend_from_slice(&0u64.to_le_bytes()); // rsdp
    info.extend_from_slice(&PVH_MEMMAP_START.to_le_bytes());
    info.extend_from_slice(&(map.len() as u32).to_le_bytes());
    info.extend_from_slice(&0u32.to_le_bytes());
    mem.write_slice(&info, GuestAddress(PVH_INFO_START))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::{Backing, create};

    /// A bzImage with one setup sector, loaded high, with the given `initrd_addr_max`.
    fn bzimage(dir: &Path, initrd_addr_max: u32) -> std::path::PathBuf {
        let mut b = vec![0u8; 2 * 512];
        b[0x1f1] = 1;
        b[0x1fe..0x200].copy_from_slice(&0xaa55u16.to_le_bytes());
        b[0x202..0x206].copy_from_slice(b"HdrS");
        b[0x206..0x208].copy_from_slice(&0x020fu16.to_le_bytes());
        b[0x211] = 1;
        b[0x214..0x218].copy_from_slice(&0x10_0000u32.to_le_bytes());
        b[0x22c..0x230].copy_from_slice(&initrd_addr_max.to_le_bytes());
        b.extend_from_slice(&[0xf4; 0x1000]);
        let p = dir.join("bzImage");
        std::fs::write(&p, b).unwrap();
        p
    }

    #[test]
    fn initrd_goes_page_aligned_below_initrd_addr_max_and_the_zero_page_says_where() {
        let dir = tempfile::tempdir().unwrap();
        let mem = create(64 << 20, Backing::Anonymous, false).unwrap();
        let initrd = dir.path().join("initrd");
        std::fs::write(&initrd, vec![0xa5u8; 10_000]).unwrap();
        let kernel = bzimage(dir.path(), 0x01ff_ffff);
        let cmdline = build_cmdline("init=/bin/sh", &[]).unwrap();
        let e = load(&mem, &kernel, Some(&initrd), &cmdline).unwrap();
        assert_eq!(e.entry, 0x10_0200);
        assert_eq!(e.mode, EntryMode::Long64);
        let (addr, size) = e.initrd.unwrap();
        assert_eq!(size, 10_000);
        assert_eq!(addr % 0x1000, 0);
        assert!(addr + size <= 0x0200_0000, "{addr:#x}");
        assert!(addr >= e.kernel_end);
        assert_eq!(
            mem.read_obj::<u8>(GuestAddress(addr + 9_999)).unwrap(),
            0xa5
        );
        let params: boot_params = mem.read_obj(GuestAddress(ZERO_PAGE_START)).unwrap();
        let (image, rsize) = (params.hdr.ramdisk_image, params.hdr.ramdisk_size);
        assert_eq!((u64::from(image), u64::from(rsize)), (addr, size));
        assert_eq!({ params.hdr.cmd_line_ptr }, CMDLINE_START as u32);
        assert_eq!({ params.hdr.type_of_loader }, 0xff);
        assert_eq!(params.e820_entries, 3);
        let mut cl = vec![0u8; 12];
        mem.read_slice(&mut cl, GuestAddress(CMDLINE_START))
            .unwrap();
        assert_eq!(&cl, b"init=/bin/sh");
    }

    #[test]
    fn an_initrd_that_does_not_fit_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let mem = create(16 << 20, Backing::Anonymous, false).unwrap();
        let initrd = dir.path().join("initrd");
        std::fs::write(&initrd, vec![0u8; 15 << 20]).unwrap();
        let kernel = bzimage(dir.path(), 0);
        let cmdline = build_cmdline("", &[]).unwrap();
        let e = load(&mem, &kernel, Some(&initrd), &cmdline).unwrap_err();
        assert!(e.to_string().contains("do not fit"), "{e}");
    }

    #[test]
    fn cmdline_gets_console_and_devices_but_keeps_user_settings() {
        let c = build_cmdline("console=hvc0 root=/dev/vda", &[(0xd000_0000, 0x1000, 5)]).unwrap();
        let s = c.as_cstring().unwrap().into_string().unwrap();
        assert!(s.starts_with("console=hvc0 root=/dev/vda"));
        assert!(!s.contains("console=ttyS0"));
        assert!(s.contains("reboot=k panic=1 pci=off"));
        assert!(s.ends_with("virtio_mmio.device=4K@0xd0000000:5"), "{s}");
    }
}
