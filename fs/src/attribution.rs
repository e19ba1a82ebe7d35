//! Bytes fetched per sandbox: each read miss is charged to the sandbox of the process that read.
//!
//! A sandbox's layer mounts are shared with every other sandbox of the node that uses those layers, so a
//! per-layer or per-blob counter cannot say which sandbox made the node fetch. The reader can: every FUSE
//! request carries the pid of the process it is made for, and a process's root directory
//! (`/proc/PID/root`) is its sandbox's rootfs — the overlay's root, whose device and inode are the
//! sandbox's own, whether bubblewrap, runc or `chroot` started it. The blob server passes the request's
//! pid down to the fetcher ([`with_reader`]); when a read misses and the fetcher asks the store for a
//! span ([`crate::fetch`]), the span's compressed bytes are charged to that root ([`Attribution::miss`]).
//! The `stat` of `/proc/PID/root` happens only on a miss, which waits for a store round trip anyway.
//!
//! What is counted, exactly: the compressed bytes of the store ranges a miss requested (the missed chunk's
//! frame and the frames fetched with it: the span after it, and before it with `max_fetch_behind`), once,
//! charged to the first reader that missed. A chunk already cached or already on its way for another
//! reader costs the second reader nothing. Not charged to any sandbox (reported in the status as
//! `fetched_unattributed`): reads by processes whose root is no running sandbox's (the host reading a
//! rootfs path, a runtime's helper), reads the kernel makes from its own threads (loop devices in `loop`
//! mode read on kernel workers), and requests made for no process. Prefetch (plan warming) reads no
//! file: its bytes are in `prefetch` of the status, per image.
//!
//! The counters live in memory, keyed by root; the daemon folds a sandbox's count into its record
//! ([`crate::state::Sandbox::fetched_bytes`]) when the sandbox stops, before an upgrade or restart hands
//! the node on, and every few seconds, so the figure survives a successor and a restart.

use std::cell::Cell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use crate::state::{process_root, RootKey};

thread_local! {
    static READER: Cell<u32> = const { Cell::new(0) };
}

/// Runs `f` with `pid` as the process its fetches are charged to.
pub fn with_reader<T>(pid: u32, f: impl FnOnce() -> T) -> T {
    let before = READER.with(|r| r.replace(pid));
    let out = f();
    READER.with(|r| r.set(before));
    out
}

/// Fetched bytes by the root directory of the process that missed.
#[derive(Default)]
pub struct Attribution {
    by_root: Mutex<HashMap<RootKey, u64>>,
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
    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<RootKey, u64>> {
        self.by_root.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A miss of the current reader made the node fetch `bytes`. Nothing is charged outside
    /// [`with_reader`] (prefetch, internal reads).
    pub fn miss(&self, bytes: u64) {
        let pid = READER.with(Cell::get);
        if pid == 0 || bytes == 0 {
            return;
        }
        match process_root(pid) {
            Some(k) => *self.map().entry(k).or_default() += bytes,
            None => {
                self.lost.fetch_add(bytes, Ordering::Relaxed);
            }
        }
        self.changes.fetch_add(1, Ordering::Relaxed);
    }

    /// Bytes charged to `root` and not yet taken.
    pub fn peek(&self, root: RootKey) -> u64 {
        self.map().get(&root).copied().unwrap_or(0)
    }

    /// Bytes charged to `root`, forgotten here (the caller keeps them).
    pub fn take(&self, root: RootKey) -> u64 {
        self.map().remove(&root).unwrap_or(0)
    }

    /// Bytes charged to no root `is_sandbox` accepts, and to unreadable roots.
    pub fn unattributed(&self, is_sandbox: impl Fn(&RootKey) -> bool) -> u64 {
        let other: u64 = self
            .map()
            .iter()
            .filter(|(k, _)| !is_sandbox(k))
            .map(|(_, v)| v)
            .sum();
        other + self.lost.load(Ordering::Relaxed)
    }
}

/// Seconds between two writes of the counts into the sandboxes' records.
pub const FLUSH_EVERY: std::time::Duration = std::time::Duration::from_secs(5);

impl crate::daemon::Daemon {
    /// Bytes fetched for sandbox `sb`'s misses: what its record holds (as the node has it now, if it is
    /// still there) and what was charged since.
    pub fn fetched_by(&self, sb: &crate::state::Sandbox) -> u64 {
        let st = self.lock();
        let cur = st.sandboxes.get(&sb.id).unwrap_or(sb);
        let live = cur.root.map_or(0, |k| self.metrics.attribution.peek(k));
        cur.fetched_bytes + live
    }

    /// Bytes fetched for misses of no running sandbox (see the module documentation).
    pub fn fetched_unattributed(&self) -> u64 {
        let st = self.lock();
        let roots: std::collections::HashSet<RootKey> =
            st.sandboxes.values().filter_map(|s| s.root).collect();
        self.metrics.attribution.unattributed(|k| roots.contains(k))
    }

    /// Moves the counts charged since the last flush into the running sandboxes' records, and writes
    /// those records. Nothing is written when nothing was charged.
    pub fn flush_fetched(&self) {
        let a = &self.metrics.attribution;
        let seen = a.changes.load(Ordering::Relaxed);
        if seen == a.flushed.swap(seen, Ordering::Relaxed) {
            return;
        }
        let changed: Vec<crate::state::Sandbox> = {
            let mut st = self.lock();
            st.sandboxes
                .values_mut()
                .filter_map(|s| {
                    let n = a.take(s.root?);
                    s.fetched_bytes += n;
                    (n > 0).then(|| s.clone())
                })
                .collect()
        };
        for s in changed {
            if let Err(e) = self.node.save_sandbox(&s) {
                tracing::warn!(sandbox = s.id, error = %e, "recording bytes fetched");
            }
        }
    }

    /// Flushes the counts every [`FLUSH_EVERY`] while the daemon lives and serves.
    pub(crate) fn start_flushing(self: &std::sync::Arc<Self>) {
        let weak = std::sync::Arc::downgrade(self);
        let spawned = std::thread::Builder::new()
            .name("strata-fetched".into())
            .spawn(move || loop {
                std::thread::sleep(FLUSH_EVERY);
                match weak.upgrade() {
                    Some(d) if !d.metrics.attribution.retired.load(Ordering::Relaxed) => {
                        d.flush_fetched()
                    }
                    _ => return,
                }
            });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "no thread to record bytes fetched: recorded at stops only");
        }
    }

    /// The last flush of this process: before a successor takes the node over (nothing is charged
    /// here after it, and nothing is written: the records are the successor's).
    pub(crate) fn retire_fetched(&self) {
        self.flush_fetched();
        self.metrics
            .attribution
            .retired
            .store(true, Ordering::Relaxed);
    }

    /// Stored bytes of the image of manifest `m` as `strata images` counts them
    /// ([`strata_registry::store::Store::image_size`]), asked of the store once per image; `None` when
    /// not known yet and `compute` is false, or when the store cannot say.
    pub fn image_bytes(&self, m: &strata_registry::digest::Digest, compute: bool) -> Option<u64> {
        if let Some(n) = self.lock().image_sizes.get(m) {
            return Some(*n);
        }
        if !compute {
            return None;
        }
        let manifest = self.store.get_manifest(m).ok()?;
        let (stored, _) = self.store.image_size(&manifest).ok()?;
        self.lock().image_sizes.insert(*m, stored);
        Some(stored)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn misses_are_charged_to_the_readers_root_and_only_inside_with_reader() {
        let a = Attribution::default();
        a.miss(100); // no reader: prefetch, not charged
        assert_eq!(a.unattributed(|_| false), 0);
        let me = std::process::id();
        let root = process_root(me).expect("own root");
        with_reader(me, || a.miss(10));
        with_reader(me, || a.miss(5));
        assert_eq!(a.peek(root), 15);
        assert_eq!(a.unattributed(|k| *k == root), 0);
        assert_eq!(a.unattributed(|_| false), 15);
        // A pid that does not exist: counted, but as no sandbox's.
        with_reader(u32::MAX - 1, || a.miss(7));
        assert_eq!(a.unattributed(|k| *k == root), 7);
        assert_eq!(a.take(root), 15);
        assert_eq!(a.peek(root), 0);
        // The reader is reset after with_reader.
        a.miss(1);
        assert_eq!(a.peek(root), 0);
    }
}
