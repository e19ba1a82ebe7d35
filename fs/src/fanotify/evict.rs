//! The cache bound under mounted layers: chunks punched out of view files, never under a reader.
//!
//! View files no mounted layer reads are deleted whole when a layer is released (`Views::trim`).
//! A file a mounted layer reads can only lose chunks: its least recently used ones are punched out
//! (`fallocate(PUNCH_HOLE)`), to be fetched again on their next read. The danger is a read the server
//! already allowed: the kernel reads the range *after* the answer, and a punch between the two would
//! let it read zeros. So eviction is in two steps, [`GRACE`] apart:
//!
//! 1. **Mark.** The chosen chunks are marked evicting ([`ViewFile::mark_evicting`]): no longer counted
//!    filled, so a read of one is no longer allowed at once but goes to a fill thread, which takes it
//!    back (its bytes are still in the file) and then allows it. A complete file, no longer watched,
//!    is watched again first. From now on no read of these chunks is allowed without the server
//!    taking them back.
//! 2. **Punch**, at least [`GRACE`] later, of the chunks still marked ([`ViewFile::punch_evicting`]).
//!    Every read allowed without a take-back was allowed before the mark, so it has had the grace to
//!    read: a reader is between the answer and its read for the length of one kernel call (no
//!    return to user space, no stop signal in between); the grace is thousands of times that.
//!    Writers of chunk bytes hold the file's punch lock shared, a punch alone, so that no punch lands
//!    between a write and the state that says the chunk is there.
//!
//! A server that starts on view files an earlier one filled knows none of their chunks (it checks
//! each on first use); those that take disk (`SEEK_DATA`) are evicted first, marked apart: taken
//! back, they are checked like any other.
//!
//! A mount that opened its view file while the file was not watched would never report a read
//! (Linux decides at open), so [`super::Server::mounting`] makes sure every mount opens them watched;
//! mounts a predecessor made may not have (versions before eviction did not), so the daemon lets
//! eviction touch only blobs that no layer mounted without that assurance reads (a marker beside
//! each layer mount says it was, for successors).

use std::sync::atomic::AtomicU64;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use strata_registry::digest::Digest;

use std::io;
use std::path::Path;
use std::sync::atomic::Ordering;

use strata_registry::toc::BLOCK_SIZE;

use super::views::{ViewFile, EVICTING, EVICTING_UNCHECKED, FILLED, HOLE, UNKNOWN};

/// How long a marked chunk waits before it is punched (`view_evict_grace_secs`'s default).
pub const GRACE: Duration = Duration::from_secs(30);

/// Seconds since this process first asked, from 1 (0 is "not used since the server started").
pub fn clock() -> u32 {
    static START: OnceLock<Instant> = OnceLock::new();
    let start = *START.get_or_init(Instant::now);
    u32::try_from(start.elapsed().as_secs())
        .unwrap_or(u32::MAX - 1)
        .saturating_add(1)
}

/// What eviction did, for the status.
#[derive(Default)]
pub struct Stats {
    /// Chunks punched out of view files.
    pub chunks: AtomicU64,
    /// Bytes punched out.
    pub bytes: AtomicU64,
}

/// What one pass did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Pass {
    /// Chunks and bytes punched (marked a grace ago).
    pub punched: (usize, u64),
    /// Bytes newly marked.
    pub marked: u64,
}

/// One pass over `views` (the view files of blobs eviction may touch) against `bound`, the view
/// files' disk use being `disk` bytes: punches what was marked at least `grace` ago, then marks
/// the least recently used chunks that take disk — none used in the last `grace` — until what the
/// files take less what is marked fits the bound. `watch` watches a complete file again.
pub fn pass(
    views: &[Arc<ViewFile>],
    disk: u64,
    bound: u64,
    grace: Duration,
    watch: impl Fn(&std::path::Path) -> std::io::Result<()>,
) -> Pass {
    let now = Instant::now();
    let cutoff = now.checked_sub(grace).unwrap_or(now);
    let mut out = Pass::default();
    for v in views {
        let (c, b) = v.punch_evicting(cutoff);
        out.punched.0 += c;
        out.punched.1 += b;
    }
    let pending: u64 = views.iter().map(|v| v.evicting_bytes()).sum();
    let excess = disk
        .saturating_sub(out.punched.1)
        .saturating_sub(pending)
        .saturating_sub(bound);
    if excess == 0 {
        return out;
    }
    let before = clock().saturating_sub(u32::try_from(grace.as_secs()).unwrap_or(u32::MAX));
    for (v, chunks) in choose(views, before, excess) {
        match v.mark_evicting(&chunks, now, &watch) {
            Ok(b) => out.marked += b,
            Err(e) => tracing::warn!(path = %v.path.display(), error = %e,
                "cannot watch a view file again: none of its chunks evicted"),
        }
    }
    out
}

/// The least recently used chunks of `views` that take disk ([`ViewFile::evictable`]), used at or
/// before `before`, until they make
/// `excess` bytes: grouped by file.
fn choose(views: &[Arc<ViewFile>], before: u32, excess: u64) -> Vec<(Arc<ViewFile>, Vec<usize>)> {
    let mut all: Vec<(u32, usize, usize, u64)> = Vec::new();
    for (f, v) in views.iter().enumerate() {
        all.extend(
            v.evictable(before)
                .into_iter()
                .map(|(u, i, b)| (u, f, i, b)),
        );
    }
    all.sort_unstable();
    let mut per_file: Vec<Vec<usize>> = vec![Vec::new(); views.len()];
    let mut sum = 0;
    for (_, f, i, b) in all {
        if sum >= excess {
            break;
        }
        per_file[f].push(i);
        sum += b;
    }
    views
        .iter()
        .cloned()
        .zip(per_file)
        .filter(|(_, c)| !c.is_empty())
        .collect()
}

/// The blobs eviction may touch: read by layers mounted with their view files watched (`true`), by
/// none mounted without that assurance.
pub fn allowed<'a>(
    layers: impl Iterator<Item = (bool, &'a [Digest])>,
) -> std::collections::HashSet<Digest> {
    let mut watched = std::collections::HashSet::new();
    let mut unsure = std::collections::HashSet::new();
    for (sure, blobs) in layers {
        match sure {
            true => watched.extend(blobs.iter().copied()),
            false => unsure.extend(blobs.iter().copied()),
        }
    }
    watched.retain(|d| !unsure.contains(d));
    watched
}

/// The per-file half of eviction: which chunks take disk, marking, punching.
impl ViewFile {
    /// The byte ranges of the file that hold data (`SEEK_DATA`, `SEEK_HOLE`): `(start, end)`.
    fn data_ranges(&self) -> io::Result<Vec<(u64, u64)>> {
        use rustix::fs::{seek, SeekFrom};
        let mut out = Vec::new();
        let mut at = 0;
        loop {
            let start = match seek(&self.file, SeekFrom::Data(at)) {
                Ok(s) => s,
                Err(rustix::io::Errno::NXIO) => return Ok(out),
                Err(e) => return Err(e.into()),
            };
            let end = seek(&self.file, SeekFrom::Hole(start))?;
            out.push((start, end));
            at = end;
        }
    }

    /// Chunks that take disk, last used at or before `before` ([`super::evict::clock`]): the filled
    /// ones, and those not checked yet that have data on disk (an earlier server's; never used by
    /// this one). `(last used, chunk, bytes a punch frees)`.
    pub fn evictable(&self, before: u32) -> Vec<(u32, usize, u64)> {
        let data = match self.data_ranges() {
            Ok(d) => d,
            Err(e) => {
                tracing::debug!(path = %self.path.display(), error = %e, "SEEK_DATA: unchecked chunks not evicted");
                Vec::new()
            }
        };
        // Chunks lie in the file in their order, as do the data ranges: one walk over both.
        let mut next = 0;
        let mut on_disk = |at: u64, len: u64| {
            while data.get(next).is_some_and(|&(_, e)| e <= at) {
                next += 1;
            }
            data.get(next).is_some_and(|&(s, _)| s < at + len)
        };
        let mut out = Vec::new();
        for (i, c) in self.blob.toc.chunks.iter().enumerate() {
            let used = self.used[i].load(Ordering::Relaxed);
            let (at, len) = (c.block as u64 * BLOCK_SIZE, c.blocks() * BLOCK_SIZE);
            let takes = match self.chunks[i].load(Ordering::Acquire) {
                FILLED => true,
                UNKNOWN => on_disk(at, len),
                _ => false,
            };
            if used <= before && takes {
                out.push((used, i, len));
            }
        }
        out
    }

    /// Marks `chunks` for eviction (those still filled, or not checked yet), noting `now`; `watch` is
    /// called first if
    /// the file was complete and no longer watched (a read of a chunk punched later must be
    /// reported). Returns the bytes marked.
    pub fn mark_evicting(
        &self,
        chunks: &[usize],
        now: Instant,
        watch: impl FnOnce(&Path) -> io::Result<()>,
    ) -> io::Result<u64> {
        let _watch = self.watch.lock().unwrap_or_else(|p| p.into_inner());
        if self.unmarked.load(Ordering::Acquire) {
            watch(&self.path)?;
            self.unmarked.store(false, Ordering::Release);
        }
        let mut marked = self.evicting.lock().unwrap_or_else(|p| p.into_inner());
        let mut bytes = 0;
        for &i in chunks {
            let Some(c) = self.blob.toc.chunks.get(i) else {
                continue;
            };
            let state = &self.chunks[i];
            let filled = state
                .compare_exchange(FILLED, EVICTING, Ordering::AcqRel, Ordering::Acquire)
                .is_ok();
            let unchecked = !filled
                && state
                    .compare_exchange(
                        UNKNOWN,
                        EVICTING_UNCHECKED,
                        Ordering::AcqRel,
                        Ordering::Acquire,
                    )
                    .is_ok();
            if filled {
                self.filled.fetch_sub(1, Ordering::AcqRel);
            }
            if filled || unchecked {
                marked.push((i, now));
                bytes += c.blocks() * BLOCK_SIZE;
            }
        }
        Ok(bytes)
    }

    /// Whether chunk `i` is marked for eviction.
    fn evicting(&self, i: usize) -> bool {
        matches!(
            self.chunks[i].load(Ordering::Acquire),
            EVICTING | EVICTING_UNCHECKED
        )
    }

    /// Bytes of the chunks marked for eviction and not yet punched or taken back.
    pub fn evicting_bytes(&self) -> u64 {
        let marked = self.evicting.lock().unwrap_or_else(|p| p.into_inner());
        marked
            .iter()
            .filter(|&&(i, _)| self.evicting(i))
            .map(|&(i, _)| self.blob.toc.chunks[i].blocks() * BLOCK_SIZE)
            .sum()
    }

    /// Punches out the chunks marked [`EVICTING`] at or before `cutoff` and still marked (each a
    /// hole again, fetched on its next read): `(chunks, bytes)`. A chunk whose punch fails is
    /// taken back.
    pub fn punch_evicting(&self, cutoff: Instant) -> (usize, u64) {
        let due: Vec<usize> = {
            let mut marked = self.evicting.lock().unwrap_or_else(|p| p.into_inner());
            let mut due = Vec::new();
            marked.retain(|&(i, at)| {
                let still = self.evicting(i);
                if still && at <= cutoff {
                    due.push(i);
                }
                still && at > cutoff
            });
            due
        };
        let (mut chunks, mut bytes) = (0, 0);
        let _punch = self.punch.write().unwrap_or_else(|p| p.into_inner());
        for i in due {
            if !self.evicting(i) {
                continue;
            }
            let c = self.blob.toc.chunks[i];
            let (at, len) = (c.block as u64 * BLOCK_SIZE, c.blocks() * BLOCK_SIZE);
            let flags =
                rustix::fs::FallocateFlags::PUNCH_HOLE | rustix::fs::FallocateFlags::KEEP_SIZE;
            match self.own(at, len, || {
                rustix::fs::fallocate(&self.file, flags, at, len)
            }) {
                Ok(()) => {
                    self.chunks[i].store(HOLE, Ordering::Release);
                    chunks += 1;
                    bytes += len;
                }
                Err(e) => {
                    tracing::warn!(path = %self.path.display(), chunk = i, error = %e,
                        "cannot punch a chunk out of a view file: kept");
                    if self.chunks[i].swap(UNKNOWN, Ordering::AcqRel) == EVICTING {
                        self.chunks[i].store(FILLED, Ordering::Release);
                        self.filled.fetch_add(1, Ordering::AcqRel);
                    }
                }
            }
        }
        (chunks, bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_blobs_no_inherited_layer_reads_may_be_evicted() {
        let d = |b: u8| Digest::of(&[b]);
        let (a, b, c) = ([d(1), d(2)], [d(2), d(3)], [d(4)]);
        let got = allowed([(true, &a[..]), (false, &b[..]), (true, &c[..])].into_iter());
        assert_eq!(got, [d(1), d(4)].into_iter().collect());
    }
}
