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
//! A mount that opened its view file while the file was not watched would never report a read
//! (Linux decides at open), so [`super::Server::mounting`] makes sure every mount opens them watched;
//! mounts a predecessor made may not have (versions before eviction did not), so the daemon lets
//! eviction touch only blobs that no layer mounted without that assurance reads (a marker beside
//! each layer mount says it was, for successors).

use std::sync::atomic::AtomicU64;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use strata_registry::digest::Digest;

use super::views::ViewFile;

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
/// the least recently used filled chunks — none used in the last `grace` — until what the files
/// take less what is marked fits the bound. `watch` watches a complete file again.
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

/// The least recently used filled chunks of `views`, used at or before `before`, until they make
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

    #[test]
    fn the_clock_starts_at_one() {
        assert!(clock() >= 1);
    }
}
