//! Kernel mounts through the new mount API.
//!
//! A layer is mounted as kernel EROFS: the metadata image is the `source` and every blob of its device
//! table is passed as one `device=` option. In `file` mode (Linux 6.12+) these are regular files (the blob
//! files on the daemon's FUSE mount); in `loop` mode block devices ([`crate::loopdev`]) backed by them. util-linux `mount -t erofs` would insert a loop device and cannot pass regular-file
//! devices, and `mount(2)` options are limited to one page, so this uses `fsopen`/`fsconfig` (one call per
//! device, no length limit), `fsmount` and `move_mount`.
//!
//! The kernel refuses a metadata file on a stacked or memory filesystem (tmpfs, overlayfs): keep it on a
//! disk filesystem. Every device must be given, in device-table order: without them the kernel reads the
//! chunks from the metadata file's own address space (zeros).
//!
//! The daemon mounts its layers with EROFS's `directio` option (Linux 6.13+): EROFS then reads the blob
//! files on the FUSE mount with direct I/O instead of through their page cache, which would hold a second
//! copy of every byte EROFS already caches (user complaint: "page cache held twice"). Measured on the
//! 1 GiB sequential read benchmark: 2 GiB of page cache instead of 3 (the third copy is the chunk cache's
//! files), the same warm throughput, and a faster first read.
//!
//! **Images are untrusted.** A rootfs is handed to code nobody vetted, built from layers anyone may have
//! pushed, so every mount here is `nodev` and `nosuid`: a device node packed in an image shows up (`ls`,
//! `stat`, `pack_diff` keep it) but cannot be opened (`EACCES`) — a runtime gives the sandbox its own
//! `/dev` — and a setuid binary or a file capability in an image grants nothing, neither to a host user
//! who reaches the rootfs path nor inside the sandbox (which runs its own `root` if it needs one). Not
//! `noexec`: sandboxes run the image's programs. The overlay also follows no `redirect` xattr a lower
//! layer may carry and creates no metacopy-only files (`redirect_dir=nofollow`, `metacopy=off`, whatever
//! the kernel's defaults): a layer cannot make a path show another file's data, and an upper directory
//! always holds whole files, as `pack_diff` reads them.

use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};

use rustix::fs::CWD;
use rustix::mount::{
    fsconfig_create, fsconfig_set_string, fsmount, fsopen, move_mount, FsMountFlags, FsOpenFlags,
    MountAttrFlags, MoveMountFlags, UnmountFlags,
};

/// A mount or unmount that failed: which step, on which path, the errno, and what the kernel logged.
#[derive(Debug, thiserror::Error)]
#[error("{step} ({path}): {source}{}", log_suffix(.log))]
pub struct MountError {
    /// The failing step, e.g. `fsconfig device` or `move_mount`.
    pub step: &'static str,
    /// The path the step was about.
    pub path: PathBuf,
    #[source]
    pub source: io::Error,
    /// Messages the kernel attached to the filesystem context (`e erofs: ...`), if any.
    pub log: Vec<String>,
}

impl MountError {
    /// The errno of the failure.
    pub fn errno(&self) -> Option<i32> {
        self.source.raw_os_error()
    }
}

fn log_suffix(log: &[String]) -> String {
    if log.is_empty() {
        String::new()
    } else {
        format!(" [kernel: {}]", log.join("; "))
    }
}

fn fail(
    step: &'static str,
    path: &Path,
    errno: rustix::io::Errno,
    fs_fd: Option<&OwnedFd>,
) -> MountError {
    MountError {
        step,
        path: path.to_path_buf(),
        source: io::Error::from(errno),
        log: fs_fd.map(drain_log).unwrap_or_default(),
    }
}

/// Reads the messages queued on a filesystem context fd (each read returns one; ENODATA when empty).
fn drain_log(fs_fd: &OwnedFd) -> Vec<String> {
    let mut out = Vec::new();
    let mut buf = [0u8; 1024];
    while out.len() < 32 {
        match rustix::io::read(fs_fd.as_fd(), &mut buf[..]) {
            Ok(n) if n > 0 => out.push(String::from_utf8_lossy(&buf[..n]).trim_end().to_string()),
            _ => break,
        }
    }
    out
}

/// An absolute form of `p` (relative paths are resolved against the current directory, as the kernel
/// would do at `fsconfig` time, but without depending on when that happens).
fn absolute(p: &Path) -> PathBuf {
    std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf())
}

/// Mounts the EROFS image `meta` read-only at `target`, file-backed, with `devices` as its extra devices
/// (in device-table order: the first is device id 1).
pub fn mount_erofs(meta: &Path, devices: &[PathBuf], target: &Path) -> Result<(), MountError> {
    mount_erofs_with(meta, devices, target, false)
}

/// [`mount_erofs`], optionally with EROFS's `directio` option: the kernel then reads the device files
/// with direct I/O, so their data is not cached a second time in the devices' own page cache (for the
/// daemon's blob files on FUSE: one copy of a layer's data in memory, EROFS's, instead of two). A kernel
/// without the option (before 6.13) mounts without it.
pub fn mount_erofs_with(
    meta: &Path,
    devices: &[PathBuf],
    target: &Path,
    directio: bool,
) -> Result<(), MountError> {
    let mnt = erofs_mount_fd(meta, devices, directio)?;
    attach(&mnt, target)
}

/// Attaches the detached mount `mnt` at `target`.
fn attach(mnt: &OwnedFd, target: &Path) -> Result<(), MountError> {
    move_mount(
        mnt.as_fd(),
        "",
        CWD,
        target,
        MoveMountFlags::MOVE_MOUNT_F_EMPTY_PATH,
    )
    .map_err(|e| fail("move_mount", target, e, None))
}

/// `struct fs_sysfs_path` of `FS_IOC_GETFSSYSFSPATH` (Linux 6.10): a length and up to 128 bytes.
#[repr(C)]
struct SysfsPath {
    len: u8,
    name: [u8; 128],
}

/// `_IOR(0x15, 1, struct fs_sysfs_path)`.
const FS_IOC_GETFSSYSFSPATH: libc::c_ulong = 0x8081_1501;

/// Sets the read-ahead (KiB) of the filesystem mounted at `target`, found through its sysfs name
/// (`FS_IOC_GETFSSYSFSPATH`, Linux 6.10+; file-backed EROFS names its backing-device info after its
/// superblock: `/sys/class/bdi/erofs-N/read_ahead_kb`).
pub fn set_read_ahead(target: &Path, kb: u32) -> io::Result<()> {
    let dir = std::fs::File::open(target)?;
    let mut p = SysfsPath {
        len: 0,
        name: [0; 128],
    };
    // SAFETY: the ioctl writes at most `size_of::<SysfsPath>()` bytes into `p`, which outlives the call.
    let r = unsafe {
        libc::ioctl(
            std::os::fd::AsRawFd::as_raw_fd(&dir),
            FS_IOC_GETFSSYSFSPATH,
            &mut p as *mut SysfsPath,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    let path = String::from_utf8_lossy(&p.name[..usize::from(p.len).min(128)]).into_owned();
    let name = path.rsplit('/').next().unwrap_or_default();
    if name.is_empty() || name.contains("..") {
        return Err(io::Error::other(format!("sysfs name {path:?}")));
    }
    std::fs::write(
        Path::new("/sys/class/bdi").join(name).join("read_ahead_kb"),
        kb.to_string(),
    )
}

/// Whether the kernel mounts EROFS image `source` (a file or a block device) with `devices`: the
/// superblock is made and a mount created, but never attached anywhere (it goes when this returns).
/// What the mount-mode probe ([`crate::control::modes`]) tries.
pub fn try_erofs(source: &Path, devices: &[PathBuf]) -> Result<(), MountError> {
    erofs_mount_fd(source, devices, false).map(drop)
}

/// A detached read-only EROFS mount of `meta` with `devices` (see [`mount_erofs_with`]).
fn erofs_mount_fd(meta: &Path, devices: &[PathBuf], directio: bool) -> Result<OwnedFd, MountError> {
    let meta = absolute(meta);
    let fs_fd = fsopen("erofs", FsOpenFlags::FSOPEN_CLOEXEC)
        .map_err(|e| fail("fsopen erofs", &meta, e, None))?;
    // A read-only superblock: opens its block devices read-only, as read-only loop devices need
    // (opened for writing, they refuse with EACCES).
    rustix::mount::fsconfig_set_flag(fs_fd.as_fd(), "ro")
        .map_err(|e| fail("fsconfig ro", &meta, e, Some(&fs_fd)))?;
    fsconfig_set_string(fs_fd.as_fd(), "source", &meta)
        .map_err(|e| fail("fsconfig source", &meta, e, Some(&fs_fd)))?;
    for dev in devices {
        let dev = absolute(dev);
        fsconfig_set_string(fs_fd.as_fd(), "device", &dev)
            .map_err(|e| fail("fsconfig device", &dev, e, Some(&fs_fd)))?;
    }
    if directio {
        // Linux 6.13 and later; an older kernel refuses the option and mounts as before.
        if let Err(e) = rustix::mount::fsconfig_set_flag(fs_fd.as_fd(), "directio") {
            let log = drain_log(&fs_fd);
            tracing::warn!(error = %e, kernel = ?log, "EROFS directio refused; mounting without it");
        }
    }
    fsconfig_create(fs_fd.as_fd()).map_err(|e| fail("fsconfig create", &meta, e, Some(&fs_fd)))?;
    fsmount(
        fs_fd.as_fd(),
        FsMountFlags::FSMOUNT_CLOEXEC,
        MountAttrFlags::MOUNT_ATTR_RDONLY | untrusted(),
    )
    .map_err(|e| fail("fsmount", &meta, e, Some(&fs_fd)))
}

/// The mount attributes of every mount of image data (see the module documentation).
fn untrusted() -> MountAttrFlags {
    MountAttrFlags::MOUNT_ATTR_NODEV | MountAttrFlags::MOUNT_ATTR_NOSUID
}

/// Unmounts `target`; `lazy` detaches it now and lets the kernel finish when it is no longer busy.
pub fn unmount(target: &Path, lazy: bool) -> Result<(), MountError> {
    let flags = if lazy {
        UnmountFlags::DETACH
    } else {
        UnmountFlags::empty()
    };
    rustix::mount::unmount(target, flags).map_err(|e| fail("umount", target, e, None))
}

/// Mounts an overlay at `target`: `lowers` top first, with `upper` and `work` (same filesystem). Each
/// lower directory is its own `lowerdir+` option, so the number of layers is not limited by the size of
/// one option string.
/// Whether overlay takes one `lowerdir+` option per layer (Linux 6.8+). Older kernels (Debian 12's and
/// AL2023's 6.1) parse overlay's options the legacy way: one `lowerdir=top:…:bottom` string, and every
/// option together within one page (about 40 layers at stratad's path lengths).
/// Asked once per process: every sandbox's overlay needs the answer.
fn lowerdir_plus() -> bool {
    static PLUS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *PLUS.get_or_init(|| {
        crate::kernelcheck::running_kernel()
            .is_ok_and(|k| k >= strata_erofs::features::KernelVersion::new(6, 8))
    })
}

/// `top:…:bottom`, with the characters overlay's option parser treats specially (`:`, `,`, `\`)
/// escaped by a backslash.
pub fn lowerdir_option(lowers: &[PathBuf]) -> String {
    let escape = |p: &PathBuf| {
        let mut out = String::new();
        for c in p.to_string_lossy().chars() {
            if matches!(c, ':' | ',' | '\\') {
                out.push('\\');
            }
            out.push(c);
        }
        out
    };
    lowers.iter().map(escape).collect::<Vec<_>>().join(":")
}

pub fn mount_overlay(
    lowers: &[PathBuf],
    upper: &Path,
    work: &Path,
    target: &Path,
) -> Result<(), MountError> {
    let fs_fd = fsopen("overlay", FsOpenFlags::FSOPEN_CLOEXEC)
        .map_err(|e| fail("fsopen overlay", target, e, None))?;
    let lowers: Vec<PathBuf> = lowers.iter().map(|l| absolute(l)).collect();
    if lowerdir_plus() {
        for l in &lowers {
            fsconfig_set_string(fs_fd.as_fd(), "lowerdir+", l)
                .map_err(|e| fail("fsconfig lowerdir+", l, e, Some(&fs_fd)))?;
        }
    } else {
        let joined = lowerdir_option(&lowers);
        fsconfig_set_string(fs_fd.as_fd(), "lowerdir", &joined)
            .map_err(|e| fail("fsconfig lowerdir", target, e, Some(&fs_fd)))?;
    }
    let upper = absolute(upper);
    let work = absolute(work);
    fsconfig_set_string(fs_fd.as_fd(), "upperdir", &upper)
        .map_err(|e| fail("fsconfig upperdir", &upper, e, Some(&fs_fd)))?;
    fsconfig_set_string(fs_fd.as_fd(), "workdir", &work)
        .map_err(|e| fail("fsconfig workdir", &work, e, Some(&fs_fd)))?;
    for (key, value) in [("redirect_dir", "nofollow"), ("metacopy", "off")] {
        fsconfig_set_string(fs_fd.as_fd(), key, value)
            .map_err(|e| fail("fsconfig overlay option", target, e, Some(&fs_fd)))?;
    }
    fsconfig_create(fs_fd.as_fd()).map_err(|e| fail("fsconfig create", target, e, Some(&fs_fd)))?;
    let mnt = fsmount(fs_fd.as_fd(), FsMountFlags::FSMOUNT_CLOEXEC, untrusted())
        .map_err(|e| fail("fsmount overlay", target, e, Some(&fs_fd)))?;
    attach(&mnt, target)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_legacy_lowerdir_string_is_top_first_with_special_characters_escaped() {
        let lowers = [
            PathBuf::from("/run/strata/layers/top"),
            PathBuf::from("/odd/a:b,c\\d"),
        ];
        assert_eq!(
            lowerdir_option(&lowers),
            "/run/strata/layers/top:/odd/a\\:b\\,c\\\\d"
        );
    }
}
