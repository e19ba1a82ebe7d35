//! Room on the view files' disk, kept the way `cachefilesd` keeps it for fscache.
//!
//! View files share a local disk with whatever else the node writes, and in `fanotify` mode the kernel
//! reads only the view file: a fill that finds the disk full must deny the read (`EIO`) where `file`
//! mode would still serve it from memory. Three defences, in the order they act:
//!
//! 1. **Free space kept.** Each eviction pass bounds the view files to `cache_size` *and* to what
//!    leaves `view_keep_free_percent` of the disk free ([`Room::bound`]): when other data grows, the
//!    view files shrink, least recently read chunks first and never under a reader
//!    ([`super::evict`]), instead of waiting for a fill to find the disk full.
//! 2. **Unused files deleted.** A fill that finds the disk full first gets every view file no mounted
//!    layer reads deleted (the daemon's relief), then tries once more.
//! 3. **A reserve.** `<views>/.reserve`, a file of `view_reserve_bytes` (at most 1/16 of the disk)
//!    allocated while the disk has room for it. If nothing else freed room, the reserve is deleted
//!    ([`Room::release`]) and the fill tries again: the fills of the next grace period, while eviction
//!    punches room, go through instead of failing. It is allocated again once the disk has room for it
//!    above the free space kept ([`Room::restore`]).
//!
//! What is left: a disk filled by other writers faster than eviction frees it (or by more than the
//! view files hold) still fails fills once the reserve is spent; the `relieved` and `reserve_released`
//! counters and a warning in the log say so before it does.

use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// The reserve's name in the view files' directory.
pub const RESERVE_NAME: &str = ".reserve";

/// The reserve's default size (`view_reserve_bytes`).
pub const RESERVE: u64 = 256 << 20;

/// The share of the disk kept free by default (`view_keep_free_percent`), as `cachefilesd`'s `bcull`
/// (7 %) and `bstop` (3 %) straddle.
pub const KEEP_FREE_PERCENT: f64 = 5.0;

/// Size and free space of a filesystem, in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Disk {
    pub total: u64,
    /// Free to an unprivileged writer (`f_bavail`): what is left before others find it full.
    pub avail: u64,
}

/// The view files' room on their disk: the free space to keep, and the reserve.
pub struct Room {
    dir: PathBuf,
    path: PathBuf,
    reserve: u64,
    keep_free_percent: f64,
    /// Bytes the reserve holds now.
    held: AtomicU64,
    /// Times the reserve was given up to a fill.
    pub released: AtomicU64,
    /// One restore or release at a time.
    lock: Mutex<()>,
}

impl Room {
    /// The room of the view files in `dir`; their reserve is `<dir>/.reserve` (on their filesystem,
    /// should `dir` be a disk of its own; not named by a digest, so never counted or trimmed as a
    /// view file). Allocates nothing until [`Room::restore`].
    pub fn new(dir: &Path, reserve: u64, keep_free_percent: f64) -> Room {
        let path = dir.join(RESERVE_NAME);
        let held = std::fs::metadata(&path).map_or(0, |m| {
            use std::os::unix::fs::MetadataExt;
            m.blocks() * 512
        });
        Room {
            dir: dir.to_path_buf(),
            path,
            reserve,
            keep_free_percent: keep_free_percent.clamp(0.0, 50.0),
            held: AtomicU64::new(held),
            released: AtomicU64::default(),
            lock: Mutex::new(()),
        }
    }

    /// The reserve file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Bytes the reserve holds now.
    pub fn held(&self) -> u64 {
        self.held.load(Ordering::Relaxed)
    }

    /// The view files' disk, now.
    pub fn disk(&self) -> io::Result<Disk> {
        let st = rustix::fs::statvfs(&self.dir)?;
        Ok(Disk {
            total: st.f_blocks.saturating_mul(st.f_frsize),
            avail: st.f_bavail.saturating_mul(st.f_frsize),
        })
    }

    /// The bytes the view files may take on a disk like `disk`, holding `views` bytes now: at most
    /// `cache_size`, and no more than leaves the share of the disk kept free. A disk that cannot be
    /// read bounds by `cache_size` alone.
    pub fn bound(&self, cache_size: u64, views: u64) -> u64 {
        match self.disk() {
            Ok(disk) => bound_for(cache_size, views, disk, self.keep_free_percent),
            Err(_) => cache_size,
        }
    }

    /// The reserve's size on `disk`: `view_reserve_bytes`, at most 1/16 of the disk, whole pages.
    fn wanted(&self, disk: Disk) -> u64 {
        self.reserve.min(disk.total / 16) & !4095
    }

    /// Allocates the reserve if it is not whole and the disk has room for it above the free space
    /// kept: the bytes it holds after.
    pub fn restore(&self) -> io::Result<u64> {
        self.restore_on(self.disk()?)
    }

    /// [`Room::restore`] on a disk found to be `disk`.
    fn restore_on(&self, disk: Disk) -> io::Result<u64> {
        let _one = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        let (want, held) = (self.wanted(disk), self.held());
        let keep = kept(disk.total, self.keep_free_percent);
        if held >= want || disk.avail < keep.saturating_add(want - held) {
            return Ok(held);
        }
        let file = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .open(&self.path)?;
        let fd = std::os::fd::AsFd::as_fd(&file);
        rustix::fs::fallocate(fd, rustix::fs::FallocateFlags::empty(), 0, want)?;
        self.held.store(want, Ordering::Relaxed);
        Ok(want)
    }

    /// Gives the reserve up (a fill found the disk full and nothing else could be freed): the bytes
    /// freed, 0 if there was no reserve.
    pub fn release(&self) -> u64 {
        let _one = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        let held = self.held.swap(0, Ordering::Relaxed);
        match std::fs::remove_file(&self.path) {
            Ok(()) if held > 0 => {
                self.released.fetch_add(1, Ordering::Relaxed);
                held
            }
            Ok(()) => 0,
            Err(e) => {
                if e.kind() != io::ErrorKind::NotFound {
                    tracing::warn!(path = %self.path.display(), error = %e,
                        "cannot delete the view files' reserve");
                }
                0
            }
        }
    }

    /// For the status: the reserve held, times released, and the disk.
    pub fn status(&self) -> serde_json::Value {
        let disk = self.disk().ok();
        serde_json::json!({
            "reserve_bytes": self.held(),
            "reserve_released": self.released.load(Ordering::Relaxed),
            "keep_free_bytes": disk.map(|d| kept(d.total, self.keep_free_percent)),
            "disk_avail_bytes": disk.map(|d| d.avail),
        })
    }
}

/// The bytes kept free on a disk of `total` bytes.
fn kept(total: u64, percent: f64) -> u64 {
    (total as f64 * percent / 100.0) as u64
}

/// [`Room::bound`] for a given disk: `min(cache_size, views + avail - kept)`, never below 0.
pub fn bound_for(cache_size: u64, views: u64, disk: Disk, keep_free_percent: f64) -> u64 {
    let room = views
        .saturating_add(disk.avail)
        .saturating_sub(kept(disk.total, keep_free_percent));
    cache_size.min(room)
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn disk(total: u64, avail: u64) -> Disk {
        Disk { total, avail }
    }

    #[test]
    fn the_bound_is_the_cache_size_while_the_disk_has_room() {
        assert_eq!(
            bound_for(10 * GIB, 4 * GIB, disk(100 * GIB, 50 * GIB), 5.0),
            10 * GIB
        );
    }

    #[test]
    fn other_data_growing_shrinks_the_bound_to_keep_the_free_share() {
        // 100 GiB disk, 5 % kept: 5 GiB. Views hold 8 GiB, 3 GiB free: they must give 2 GiB up.
        assert_eq!(
            bound_for(10 * GIB, 8 * GIB, disk(100 * GIB, 3 * GIB), 5.0),
            6 * GIB
        );
        // Others took everything: nothing may stay (eviction still keeps what was read last grace).
        assert_eq!(bound_for(10 * GIB, 2 * GIB, disk(100 * GIB, 0), 5.0), 0);
        // Nothing kept free: the disk's whole room.
        assert_eq!(
            bound_for(10 * GIB, 8 * GIB, disk(100 * GIB, 0), 0.0),
            8 * GIB
        );
    }

    #[test]
    fn the_reserve_is_made_released_and_made_again_only_with_room_above_the_kept_share() {
        let t = tempfile::tempdir().unwrap();
        let dir = t.path().join("views");
        std::fs::create_dir_all(&dir).unwrap();
        let room = Room::new(&dir, 1 << 20, 0.0);
        assert_eq!(room.path(), dir.join(".reserve"));
        assert_eq!(room.held(), 0);
        assert_eq!(room.restore().unwrap(), 1 << 20);
        let on_disk = |p: &Path| {
            use std::os::unix::fs::MetadataExt;
            std::fs::metadata(p).map_or(0, |m| m.blocks() * 512)
        };
        assert!(on_disk(room.path()) >= 1 << 20);
        // A second server finds it held.
        assert_eq!(Room::new(&dir, 1 << 20, 0.0).held(), on_disk(room.path()));
        assert_eq!(room.release(), 1 << 20);
        assert!(!room.path().exists());
        assert_eq!(room.release(), 0, "released twice");
        assert_eq!(room.released.load(Ordering::Relaxed), 1);
        // A disk without room for the reserve above the share kept free gets none back, whatever
        // the test's own disk has: 1 MiB more than the 5 % kept is needed.
        let total = room.disk().unwrap().total;
        let kept = kept(total, 5.0);
        let tight = Room::new(&dir, 1 << 20, 5.0);
        assert_eq!(
            tight.restore_on(disk(total, kept + (1 << 20) - 1)).unwrap(),
            0
        );
        assert!(!tight.path().exists());
        assert_eq!(
            tight.restore_on(disk(total, kept + (1 << 20))).unwrap(),
            1 << 20
        );
        assert!(tight.path().exists());
        assert_eq!(tight.release(), 1 << 20);
        assert_eq!(room.restore().unwrap(), 1 << 20);
    }
}
