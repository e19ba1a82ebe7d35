//! Bytes fetched and time waited per sandbox: each read miss is charged to the sandbox of the process
//! that read, and so is every wait of a read for a chunk not in the cache.
//!
//! A sandbox's layer mounts are shared with every other sandbox of the node that uses those layers, so a
//! per-layer or per-blob counter cannot say which sandbox made the node fetch. The reader can: every FUSE
//! request carries the pid of the process it is made for, and a process's root directory
//! (`/proc/PID/root`) is its sandbox's rootfs — the overlay's root, whose device and inode are the
//! sandbox's own, whether bubblewrap, runc or `chroot` started it. The blob server passes the request's
//! pid down to the fetcher ([`with_reader`]); when a read misses and the fetcher asks the store for a
//! span ([`crate::fetch`]), the span's compressed bytes are charged to that root ([`Attribution::miss`]).
//! The `stat` of `/proc/PID/root` happens only on a miss or a wait for another's fetch (once per
//! request), which waits for a store round trip anyway.
//!
//! What is counted, exactly: the compressed bytes of the store ranges a miss requested (the missed chunk's
//! frame and the frames fetched with it: the span after it, before it with `max_fetch_behind`, and what
//! the streamer fetches after it with `max_fetch_stream`), once,
//! charged to the first reader that missed. A chunk already cached or already on its way for another
//! reader costs the second reader nothing. Not charged to any sandbox (reported in the status as
//! `fetched_unattributed`): reads by processes whose root is no running sandbox's (the host reading a
//! rootfs path, a runtime's helper), reads the kernel makes from its own threads (loop devices in `loop`
//! mode read on kernel workers), and requests made for no process. Prefetch (plan warming) reads no
//! file: its bytes are in `prefetch` of the status, per image.
//!
//! Waits are charged the same way ([`Attribution::waited`]): the time each read of a sandbox's processes
//! waited for a chunk not in the cache — its own fetch, or another reader's or a prefetch's it joined
//! (the same time as the `strata_read_wait_seconds` histogram, per sandbox). It is what a lazy image cost
//! the sandbox's programs: "the pull is fast but the app is slow" made visible, sandbox by sandbox.
//!
//! The counters live in memory, keyed by root; the daemon folds a sandbox's count into its record
//! (`Sandbox::charged`, in [`crate::control`]) when the sandbox stops, before an upgrade or restart hands
//! the node on, and every few seconds, so the figure survives a successor and a restart.

use std::cell::Cell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// A directory's device and inode: what identifies a rootfs as some process's root.
pub type RootKey = (u64, u64);

/// The device and inode of directory `dir` (following symlinks, as `/proc/PID/root` is followed).
///
/// `statx` with `AT_STATX_DONT_SYNC`: a device and an inode number are known without asking the
/// filesystem, so a process whose root is on a FUSE or network filesystem that does not answer (a
/// dead server, a hung NFS mount) cannot make a `/proc` scan — or a FUSE worker charging a miss —
/// wait for it. The result equals `stat`'s (`st_dev`, `st_ino`).
pub fn root_key(dir: &std::path::Path) -> Option<RootKey> {
    use rustix::fs::{makedev, statx, AtFlags, StatxFlags, CWD};
    let sx = statx(CWD, dir, AtFlags::STATX_DONT_SYNC, StatxFlags::INO).ok()?;
    Some((makedev(sx.stx_dev_major, sx.stx_dev_minor), sx.stx_ino))
}

/// The root directory of process `pid` (as seen from this process), if it can be told.
pub fn process_root(pid: u32) -> Option<RootKey> {
    root_key(std::path::Path::new(&format!("/proc/{pid}/root")))
}

/// The process a request is made for, and its root once looked up (`None` until then; `Some(None)`:
/// it cannot be read).
type Reader = (u32, Option<Option<RootKey>>);

thread_local! {
    static READER: Cell<Reader> = const { Cell::new((0, None)) };
}

/// Runs `f` with `pid` as the process its fetches are charged to.
pub fn with_reader<T>(pid: u32, f: impl FnOnce() -> T) -> T {
    let before = READER.with(|r| r.replace((pid, None)));
    let out = f();
    READER.with(|r| r.set(before));
    out
}

/// The process the current request is made for (0: none), for work done for it later on another
/// thread ([`with_reader`] there).
pub fn reader() -> u32 {
    READER.with(|r| r.get().0)
}

/// The current reader's pid (0: none) and root: looked up at the first charge of a request and kept
/// for the rest of it — a miss charges its bytes and then its wait, with one `statx`.
fn reader_root() -> (u32, Option<RootKey>) {
    READER.with(|r| match r.get() {
        (0, _) => (0, None),
        (pid, Some(root)) => (pid, root),
        (pid, None) => {
            let root = process_root(pid);
            r.set((pid, Some(root)));
            (pid, root)
        }
    })
}

/// What one root's reads cost the node; a sandbox's record keeps it (as `fetched_bytes` and
/// `read_wait_us`; a record without them reads as nothing charged).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct Charge {
    /// Compressed bytes fetched for its misses.
    #[serde(rename = "fetched_bytes")]
    pub bytes: u64,
    /// Microseconds its reads waited for chunks not in the cache.
    #[serde(rename = "read_wait_us")]
    pub wait_us: u64,
}

impl std::ops::AddAssign for Charge {
    fn add_assign(&mut self, o: Charge) {
        self.bytes += o.bytes;
        self.wait_us += o.wait_us;
    }
}

/// Fetched bytes and waits by the root directory of the process that read.
#[derive(Default)]
pub struct Attribution {
    by_root: Mutex<HashMap<RootKey, Charge>>,
    /// Misses of a process whose root could not be read (it exited, or the pid is not in our view).
    lost: AtomicU64,
    /// Bumped at every charge: a flush with nothing new to write is skipped.
    changes: AtomicU64,
    /// `changes` at the last flush.
    flushed: AtomicU64,
    /// This process handed the node on: it writes no more records.
    retired: std::sync::atomic::AtomicBool,
}

impl Attribution {
    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<RootKey, Charge>> {
        self.by_root.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Adds `c` to the current reader's root; `c`'s bytes count as lost when the root cannot be read.
    /// Nothing is charged outside [`with_reader`] (prefetch, internal reads).
    fn charge(&self, c: Charge) {
        if c == Charge::default() {
            return;
        }
        let (pid, root) = reader_root();
        if pid == 0 {
            return;
        }
        match root {
            Some(k) => *self.map().entry(k).or_default() += c,
            None => {
                self.lost.fetch_add(c.bytes, Ordering::Relaxed);
            }
        }
        self.changes.fetch_add(1, Ordering::Relaxed);
    }

    /// A miss of the current reader made the node fetch `bytes`.
    pub fn miss(&self, bytes: u64) {
        self.charge(Charge { bytes, wait_us: 0 });
    }

    /// A read of the current reader waited `took` for a chunk not in the cache.
    pub fn waited(&self, took: std::time::Duration) {
        let wait_us = u64::try_from(took.as_micros()).unwrap_or(u64::MAX);
        self.charge(Charge { bytes: 0, wait_us });
    }

    /// What was charged to `root` and not yet taken.
    pub fn peek(&self, root: RootKey) -> Charge {
        self.map().get(&root).copied().unwrap_or_default()
    }

    /// What was charged to `root`, forgotten here (the caller keeps it).
    pub fn take(&self, root: RootKey) -> Charge {
        self.map().remove(&root).unwrap_or_default()
    }

    /// Whether anything was charged since the last call (the control plane's flush skips writing
    /// records when nothing was).
    pub fn changed_since_last_look(&self) -> bool {
        let seen = self.changes.load(Ordering::Relaxed);
        seen != self.flushed.swap(seen, Ordering::Relaxed)
    }

    /// This process handed the node on: its records are a successor's now.
    pub fn retire(&self) {
        self.retired.store(true, Ordering::Relaxed);
    }

    /// Whether [`Attribution::retire`] was called.
    pub fn is_retired(&self) -> bool {
        self.retired.load(Ordering::Relaxed)
    }

    /// Bytes charged to no root `is_sandbox` accepts, and to unreadable roots.
    pub fn unattributed(&self, is_sandbox: impl Fn(&RootKey) -> bool) -> u64 {
        let other: u64 = self
            .map()
            .iter()
            .filter(|(k, _)| !is_sandbox(k))
            .map(|(_, v)| v.bytes)
            .sum();
        other + self.lost.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn root_keys_are_stats_device_and_inode() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().expect("tempdir");
        for p in [
            std::path::Path::new("/"),
            dir.path(),
            std::path::Path::new("/proc/self/root"),
        ] {
            let m = std::fs::metadata(p).expect("stat");
            assert_eq!(root_key(p), Some((m.dev(), m.ino())), "{}", p.display());
        }
        assert_eq!(root_key(&dir.path().join("missing")), None);
    }

    #[test]
    fn misses_are_charged_to_the_readers_root_and_only_inside_with_reader() {
        let a = Attribution::default();
        a.miss(100); // no reader: prefetch, not charged
        assert_eq!(a.unattributed(|_| false), 0);
        let me = std::process::id();
        let root = process_root(me).expect("own root");
        with_reader(me, || a.miss(10));
        with_reader(me, || a.miss(5));
        with_reader(me, || a.waited(std::time::Duration::from_micros(1500)));
        a.waited(std::time::Duration::from_secs(1)); // no reader: not charged
        let charged = Charge {
            bytes: 15,
            wait_us: 1500,
        };
        assert_eq!(a.peek(root), charged);
        assert_eq!(a.unattributed(|k| *k == root), 0);
        assert_eq!(a.unattributed(|_| false), 15);
        // A pid that does not exist: counted, but as no sandbox's.
        with_reader(u32::MAX - 1, || a.miss(7));
        assert_eq!(a.unattributed(|k| *k == root), 7);
        assert_eq!(a.take(root), charged);
        assert_eq!(a.peek(root), Charge::default());
        // The reader is reset after with_reader.
        a.miss(1);
        assert_eq!(a.peek(root), Charge::default());
    }
}
