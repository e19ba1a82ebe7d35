//! Loop devices: the kernel's block devices backed by a file, as `loop` mount mode needs them.
//!
//! Kernel EROFS before 6.12 mounts block devices only (`source` and every `device=`), so in `loop` mode
//! each blob file on stratad's FUSE mount (and each layer's local metadata file) is put behind a loop
//! device. This module is the kernel interface: the `<linux/loop.h>` structures (libc and rustix have
//! neither; their layouts are asserted below), `LOOP_CTL_GET_FREE` and `LOOP_CONFIGURE` (Linux 5.8+)
//! through `rustix::ioctl`, and the sysfs view (`/sys/block/loopN/loop/backing_file`) that finds a
//! device again by the file behind it.
//!
//! **Devices are configured read-only and autoclear**: the kernel detaches one when its last opener
//! closes it. The opener that matters is EROFS: a mount holds each of its block devices open for as long
//! as its superblock lives, so a loop device lives exactly as long as some layer mount uses it — also
//! across a kill of stratad (no process holds it), and it goes when the last such mount is gone, even if
//! no stratad runs then. A device this process has just configured is held by its [`LoopDev`] until the
//! mount has taken it; a stratad killed in between closes it by dying, which clears it.

use std::fs::File;
use std::io;
use std::os::fd::AsFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use rustix::ioctl::{self, Ioctl, IoctlOutput, Opcode};

const LO_NAME_SIZE: usize = 64;
const LO_KEY_SIZE: usize = 32;

/// `LO_FLAGS_READ_ONLY`.
pub const LO_FLAGS_READ_ONLY: u32 = 1;
/// `LO_FLAGS_AUTOCLEAR`: detach when the last opener closes the device.
pub const LO_FLAGS_AUTOCLEAR: u32 = 4;
/// `LO_FLAGS_DIRECT_IO`: read the backing file with direct I/O (no page cache of its own).
pub const LO_FLAGS_DIRECT_IO: u32 = 16;

const LOOP_GET_STATUS64: Opcode = 0x4C05;
const LOOP_CONFIGURE: Opcode = 0x4C0A;
const LOOP_CTL_GET_FREE: Opcode = 0x4C82;

/// `struct loop_info64`.
#[repr(C)]
#[derive(Clone, Copy)]
struct LoopInfo64 {
    lo_device: u64,
    lo_inode: u64,
    lo_rdevice: u64,
    lo_offset: u64,
    lo_sizelimit: u64,
    lo_number: u32,
    lo_encrypt_type: u32,
    lo_encrypt_key_size: u32,
    lo_flags: u32,
    lo_file_name: [u8; LO_NAME_SIZE],
    lo_crypt_name: [u8; LO_NAME_SIZE],
    lo_encrypt_key: [u8; LO_KEY_SIZE],
    lo_init: [u64; 2],
}

/// `struct loop_config`.
#[repr(C)]
struct LoopConfig {
    fd: u32,
    block_size: u32,
    info: LoopInfo64,
    reserved: [u64; 8],
}

// The kernel's layouts (include/uapi/linux/loop.h): a wrong size would have the kernel read garbage.
const _: () = assert!(std::mem::size_of::<LoopInfo64>() == 232);
const _: () = assert!(std::mem::offset_of!(LoopInfo64, lo_flags) == 52);
const _: () = assert!(std::mem::offset_of!(LoopInfo64, lo_file_name) == 56);
const _: () = assert!(std::mem::size_of::<LoopConfig>() == 304);
const _: () = assert!(std::mem::offset_of!(LoopConfig, info) == 8);

impl LoopInfo64 {
    fn zeroed() -> LoopInfo64 {
        LoopInfo64 {
            lo_device: 0,
            lo_inode: 0,
            lo_rdevice: 0,
            lo_offset: 0,
            lo_sizelimit: 0,
            lo_number: 0,
            lo_encrypt_type: 0,
            lo_encrypt_key_size: 0,
            lo_flags: 0,
            lo_file_name: [0; LO_NAME_SIZE],
            lo_crypt_name: [0; LO_NAME_SIZE],
            lo_encrypt_key: [0; LO_KEY_SIZE],
            lo_init: [0; 2],
        }
    }
}

/// `LOOP_CTL_GET_FREE`: the number of a free loop device (the kernel makes one if none is free).
struct GetFree;

// SAFETY: LOOP_CTL_GET_FREE takes no argument and returns the device number as the ioctl's result.
unsafe impl Ioctl for GetFree {
    type Output = u32;
    const IS_MUTATING: bool = false;
    fn opcode(&self) -> Opcode {
        LOOP_CTL_GET_FREE
    }
    fn as_ptr(&mut self) -> *mut std::ffi::c_void {
        std::ptr::null_mut()
    }
    unsafe fn output_from_ptr(
        out: IoctlOutput,
        _: *mut std::ffi::c_void,
    ) -> rustix::io::Result<u32> {
        u32::try_from(out).map_err(|_| rustix::io::Errno::RANGE)
    }
}

/// A loop device this process holds open: `/dev/loop<number>`.
#[derive(Debug)]
pub struct LoopDev {
    pub number: u32,
    file: File,
}

impl LoopDev {
    /// Its device node.
    pub fn path(&self) -> PathBuf {
        dev_path(self.number)
    }

    /// Whether it is bound to the file `backing` (same device and inode), checked on the open device,
    /// so that it cannot be cleared meanwhile.
    pub fn bound_to(&self, backing: &Path) -> bool {
        let Ok(m) = std::fs::metadata(backing) else {
            return false;
        };
        // SAFETY: LOOP_GET_STATUS64 writes one `struct loop_info64`, the type the getter holds.
        let getter = unsafe { ioctl::Getter::<LOOP_GET_STATUS64, LoopInfo64>::new() };
        // SAFETY: as above; the device is open for as long as the call.
        match unsafe { ioctl::ioctl(self.file.as_fd(), getter) } {
            Ok(info) => info.lo_inode == m.ino() && info.lo_device == m.dev(),
            Err(_) => false,
        }
    }
}

/// `/dev/loop<n>`.
pub fn dev_path(n: u32) -> PathBuf {
    PathBuf::from(format!("/dev/loop{n}"))
}

fn open_dev(n: u32) -> io::Result<File> {
    std::fs::OpenOptions::new().read(true).open(dev_path(n))
}

/// Binds a free loop device to `backing`, read-only and autoclear (see the module documentation),
/// with direct I/O if `direct_io`. Retries when another process takes the free device first.
pub fn attach(backing: &Path, direct_io: bool) -> io::Result<LoopDev> {
    let file = File::open(backing)?;
    let ctl = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/loop-control")?;
    let mut flags = LO_FLAGS_READ_ONLY | LO_FLAGS_AUTOCLEAR;
    if direct_io {
        flags |= LO_FLAGS_DIRECT_IO;
    }
    let mut last = io::Error::other("no free loop device");
    for _ in 0..16 {
        // SAFETY: GetFree passes no pointer.
        let n = unsafe { ioctl::ioctl(ctl.as_fd(), GetFree) }.map_err(io::Error::from)?;
        let dev = match open_dev(n) {
            Ok(d) => d,
            // udev or devtmpfs may not have made the node yet.
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                last = e;
                std::thread::sleep(std::time::Duration::from_millis(5));
                continue;
            }
            Err(e) => return Err(e),
        };
        let mut info = LoopInfo64::zeroed();
        info.lo_flags = flags;
        let name = backing.as_os_str().as_encoded_bytes();
        let len = name.len().min(LO_NAME_SIZE - 1);
        info.lo_file_name[..len].copy_from_slice(&name[..len]);
        let config = LoopConfig {
            fd: std::os::fd::AsRawFd::as_raw_fd(&file) as u32,
            block_size: 0,
            info,
            reserved: [0; 8],
        };
        // SAFETY: LOOP_CONFIGURE reads one `struct loop_config`, which the setter points at.
        let set = unsafe { ioctl::Setter::<LOOP_CONFIGURE, LoopConfig>::new(config) };
        match unsafe { ioctl::ioctl(dev.as_fd(), set) } {
            Ok(()) => {
                return Ok(LoopDev {
                    number: n,
                    file: dev,
                })
            }
            // Taken by someone else between GET_FREE and CONFIGURE: ask again.
            Err(rustix::io::Errno::BUSY) => last = io::Error::from(rustix::io::Errno::BUSY),
            Err(e) => return Err(e.into()),
        }
    }
    Err(last)
}

/// Opens loop device `n` if it is (still) bound to `backing`.
pub fn open_bound(n: u32, backing: &Path) -> Option<LoopDev> {
    let dev = LoopDev {
        number: n,
        file: open_dev(n).ok()?,
    };
    dev.bound_to(backing).then_some(dev)
}

/// Every bound loop device and its backing file, from sysfs.
pub fn bound() -> Vec<(u32, PathBuf)> {
    let Ok(entries) = std::fs::read_dir("/sys/block") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| {
            let name = e.file_name();
            let n: u32 = name.to_str()?.strip_prefix("loop")?.parse().ok()?;
            let backing = std::fs::read_to_string(e.path().join("loop/backing_file")).ok()?;
            Some((n, PathBuf::from(backing.trim_end_matches('\n'))))
        })
        .collect()
}

/// Whether loop device `n` reads its backing file with direct I/O.
pub fn direct_io(n: u32) -> bool {
    std::fs::read_to_string(format!("/sys/block/loop{n}/loop/dio")).is_ok_and(|s| s.trim() == "1")
}

/// A loop device bound to `backing`, found by its backing file (one another stratad configured before a
/// restart, say), opened and checked.
pub fn find(backing: &Path) -> Option<LoopDev> {
    bound()
        .into_iter()
        .filter(|(_, b)| b == backing)
        .find_map(|(n, _)| open_bound(n, backing))
}

/// Whether loop devices can be made here: `/dev/loop-control` opens.
pub fn available() -> io::Result<()> {
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/loop-control")
        .map(drop)
}
