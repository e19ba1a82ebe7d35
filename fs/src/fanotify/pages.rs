//! One copy in memory: a view file's pages are dropped once the kernel has had time to read them.
//!
//! View files are written and read through the page cache (EROFS mounts them without `directio`).
//! A reader's miss then costs a copy into memory, not a disk write and a disk read before the read
//! may go on: measured on the fat image's cold `import numpy, pandas`, filling with direct I/O made
//! `fanotify` mode 1.62× the kernel without a plan and 1.53× with one, buffered 1.27–1.30× and
//! 1.14× (`file` mode 1.47× and 1.14× in the same runs; BENCHMARKS.md). But every byte a sandbox
//! reads would then sit in memory twice — in EROFS's page cache and in the view file's.
//!
//! So each view file keeps a list of the ranges touched lately ([`Touched`]): the chunks written into
//! it (dirty) and the ranges of the events allowed (the kernel reads them into the view file's page
//! cache right after the answer). A background pass ([`drop_pass`], every [`PASS`]) takes the ranges
//! read at least [`READ_DELAY`] ago and those written at least [`DELAY`] ago, writes the dirty pages
//! of those ranges out if it takes a written one (`sync_file_range`, [`ViewFile::write_out`]: the
//! younger ones stay unwritten), and tells the kernel it will not need them
//! (`POSIX_FADV_DONTNEED`), which drops the clean pages. EROFS keeps its own copy of what it read; a
//! page it evicts later comes back from the view file on disk (an event, allowed at once). A step
//! that holds a write not yet [`DELAY`] old is not advised away before that write is due — neither a
//! read range in it nor, in a complete file, the step itself: advising dirty pages away starts their
//! writeback, and ext4's block allocation for it holds the file's block-map lock that the fills
//! writing the file need ([`Touched::take_before`]).
//!
//! A complete view file is no longer watched, so its reads are not reported. The pass asks the
//! kernel which of its 2 MiB steps are cached (`cachestat`, halving a range only while it has any:
//! one call for an untouched file) and drops the steps it already saw cached on the pass before —
//! at least [`PASS`] old, long consumed by whoever read them. Dropping the whole file on every pass
//! instead evicted the backing file's read-ahead before EROFS had copied it: a warm sequential read
//! of 1 GiB read 1.09–1.13 GiB from the disk (now 1.00) at 0.89× the kernel's speed (now 1.10×, run
//! for run; `benches/loopmode.py`, BENCHMARKS.md). So a byte that was in the view file
//! already stays in memory twice for a few hundred milliseconds at most; a byte a miss had to fill,
//! up to [`DELAY`] (written pages are dropped only once written out, with the written range).
//!
//! Safe by construction: dropping a page never changes what a read sees — a clean page's bytes are on
//! disk, a dirty page is not dropped, a page being read is locked and skipped. The delay only decides
//! how long a second copy may live: what a plan or a miss's followers fill ahead of a reader stays in
//! memory for [`DELAY`] (unless a read of a neighbour in the same 2 MiB drops it sooner), then comes
//! from the disk.

use std::fs::File;
use std::io;
use std::os::fd::AsFd;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use rustix::fs::{fadvise, Advice};
use strata_registry::store::direct::{drop_pages, widened, DROP_STEP};

use super::sys::cached_pages;
use super::views::ViewFile;

/// How often the pages of touched view files are dropped.
pub const PASS: Duration = Duration::from_millis(100);
/// How long a range the kernel was allowed to read stays in the page cache at least: it reads it
/// right after the answer, within a millisecond or so; the rest is margin.
pub const READ_DELAY: Duration = Duration::from_millis(200);
/// How long a range written stays at least: what a plan or a miss's followers fill ahead of the
/// readers waits this long for them in memory, then they read it from the disk.
pub const DELAY: Duration = Duration::from_secs(2);

/// Ranges of one view file touched lately: `(offset, len, written, when)`.
#[derive(Default)]
pub struct Touched {
    ranges: Mutex<Vec<(u64, u64, bool, Instant)>>,
    /// Of a complete file: the steps seen cached on earlier passes, `(start, first seen)`, ascending.
    seen: Mutex<Vec<(u64, Instant)>>,
}

impl Touched {
    /// Notes `len` bytes at `offset` as touched now (`written`: the pages may be dirty).
    pub fn note(&self, offset: u64, len: u64, written: bool) {
        let mut r = self.ranges.lock().unwrap_or_else(|p| p.into_inner());
        r.push((offset, len, written, Instant::now()));
    }

    /// Takes the ranges read before `read_cutoff` and those written before `cutoff`, widened to whole
    /// steps of the kernel's largest folios (`direct::widened`: it drops only whole folios inside a
    /// range) and merged where they overlap or meet, and whether any of them was written.
    ///
    /// A read range whose steps hold a write not yet due stays for a later pass: advising pages away
    /// starts the writeback of the dirty ones among them (`POSIX_FADV_DONTNEED` does), and ext4 then
    /// allocates their blocks holding the file's block-map lock — reading the group's block bitmap
    /// from the disk if it is cold — while the fills writing the same file wait for that lock. A cold
    /// import saw a miss wait 10 ms that way, and the streamer 12 ms (`perf sched timehist`).
    fn take_before(&self, read_cutoff: Instant, cutoff: Instant) -> (Vec<(u64, u64)>, bool) {
        let mut r = self.ranges.lock().unwrap_or_else(|p| p.into_inner());
        let young = young_writes(&r, cutoff);
        let mut due = Vec::new();
        let mut written = false;
        r.retain(|&(o, n, w, at)| {
            if at > if w { cutoff } else { read_cutoff } {
                return true;
            }
            let (start, len) = widened(o, n);
            let end = start + len;
            if !w && overlaps(&young, start, len) {
                return true;
            }
            due.push((start, end));
            written |= w;
            false
        });
        drop(r);
        due.sort_unstable();
        let mut merged: Vec<(u64, u64)> = Vec::with_capacity(due.len());
        for (s, e) in due {
            match merged.last_mut() {
                Some(last) if s <= last.1 => last.1 = last.1.max(e),
                _ => merged.push((s, e)),
            }
        }
        (
            merged.into_iter().map(|(s, e)| (s, e - s)).collect(),
            written,
        )
    }

    /// The steps of the writes noted after `cutoff` (not yet due), as `(offset, len)`.
    fn young_writes(&self, cutoff: Instant) -> Vec<(u64, u64)> {
        young_writes(
            &self.ranges.lock().unwrap_or_else(|p| p.into_inner()),
            cutoff,
        )
    }

    /// Of the steps `cached` now (ascending starts), those first seen cached at or before `cutoff`,
    /// as ranges `(offset, len)` of adjacent steps; the others are remembered as seen `at` (unless
    /// seen before), and steps no longer cached are forgotten.
    fn age(&self, cached: &[u64], at: Instant, cutoff: Instant) -> Vec<(u64, u64)> {
        let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        let mut kept = Vec::new();
        let mut due: Vec<(u64, u64)> = Vec::new();
        for &step in cached {
            let first = match seen.binary_search_by_key(&step, |&(s, _)| s) {
                Ok(i) => seen[i].1,
                Err(_) => at,
            };
            if first > cutoff {
                kept.push((step, first));
                continue;
            }
            match due.last_mut() {
                Some(last) if last.0 + last.1 == step => last.1 += DROP_STEP,
                _ => due.push((step, DROP_STEP)),
            }
        }
        *seen = kept;
        due
    }
}

/// The whole steps of the writes among `ranges` noted after `cutoff`.
fn young_writes(ranges: &[(u64, u64, bool, Instant)], cutoff: Instant) -> Vec<(u64, u64)> {
    ranges
        .iter()
        .filter(|&&(_, _, w, at)| w && at > cutoff)
        .map(|&(o, n, _, _)| widened(o, n))
        .collect()
}

/// Whether `len` bytes at `start` meet any of `ranges`.
fn overlaps(ranges: &[(u64, u64)], start: u64, len: u64) -> bool {
    ranges
        .iter()
        .any(|&(s, l)| s < start + len && start < s + l)
}

/// The whole steps of `runs` (ascending `(offset, len)` in steps) that meet none of `young`, merged
/// into runs again.
fn without(runs: &[(u64, u64)], young: &[(u64, u64)]) -> Vec<(u64, u64)> {
    let mut out: Vec<(u64, u64)> = Vec::new();
    let steps = runs
        .iter()
        .flat_map(|&(o, n)| (o..o + n).step_by(DROP_STEP as usize));
    for step in steps.filter(|&o| !overlaps(young, o, DROP_STEP)) {
        match out.last_mut() {
            Some(last) if last.0 + last.1 == step => last.1 += DROP_STEP,
            _ => out.push((step, DROP_STEP)),
        }
    }
    out
}

/// The starts of the [`DROP_STEP`]s of `file`'s first `size` bytes that have pages in the page
/// cache, ascending. A range's halves are asked about only while it has any: an untouched file
/// costs one `cachestat`, a run of cached steps about two per step plus two per halving.
fn cached_steps(file: &File, size: u64) -> io::Result<Vec<u64>> {
    let mut out = Vec::new();
    // Ranges in steps, `[lo, hi)`; the lower half popped first, so starts come out ascending.
    let mut stack = vec![(0, size.div_ceil(DROP_STEP))];
    while let Some((lo, hi)) = stack.pop() {
        if lo >= hi || cached_pages(file.as_fd(), lo * DROP_STEP, (hi - lo) * DROP_STEP)? == 0 {
            continue;
        }
        if hi - lo == 1 {
            out.push(lo * DROP_STEP);
            continue;
        }
        let mid = lo + (hi - lo) / 2;
        stack.push((mid, hi));
        stack.push((lo, mid));
    }
    Ok(out)
}

/// Drops the steps of a complete view file seen cached since a pass before `now` (not reported
/// read: [`Touched::age`]), but those holding a write noted after `write_cutoff` (their pages may be
/// dirty: see [`Touched::take_before`]; they are seen again on a later pass); the whole file if the
/// kernel cannot say which are cached.
fn drop_complete(v: &ViewFile, now: Instant, write_cutoff: Instant) -> usize {
    let cutoff = now.checked_sub(PASS).unwrap_or(now);
    match cached_steps(v.cached(), v.blob.toc.view_size()) {
        Ok(cached) => {
            let young = v.touched.young_writes(write_cutoff);
            let due = v.touched.age(&cached, Instant::now(), cutoff);
            let runs = without(&due, &young);
            for &(o, n) in &runs {
                drop_pages(v.cached(), o, n);
            }
            runs.len()
        }
        Err(e) => {
            tracing::debug!(path = %v.path.display(), error = %e, "cachestat failed: the whole file's pages dropped");
            // `None`: to the end of the file.
            match fadvise(v.cached(), 0, None, Advice::DontNeed) {
                Ok(()) => 1,
                Err(e) => {
                    tracing::debug!(path = %v.path.display(), error = %e, "view file pages not dropped");
                    0
                }
            }
        }
    }
}

/// Writes the dirty pages of `ranges` (`(offset, len)`) of `file` to disk and waits for them: the
/// pass drops only clean pages. Only those ranges — the file's younger dirty pages stay unwritten
/// until their own pass, and no journal commit is forced, as `fdatasync` of the whole file did. Not a
/// durability barrier: a view file is a cache whose chunks are checked again after a crash. One
/// range at a time (starting every range's writeback before waiting for any made no difference to
/// a paced reader, BENCHMARKS.md, twenty-eighth session). `libc`: rustix has no `sync_file_range`.
pub(super) fn write_out(file: &File, ranges: &[(u64, u64)]) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let flags = libc::SYNC_FILE_RANGE_WAIT_BEFORE
        | libc::SYNC_FILE_RANGE_WRITE
        | libc::SYNC_FILE_RANGE_WAIT_AFTER;
    for &(o, n) in ranges {
        let (Ok(o), Ok(n)) = (i64::try_from(o), i64::try_from(n)) else {
            return Err(io::ErrorKind::InvalidInput.into());
        };
        // SAFETY: a system call on a descriptor `file` keeps open; no memory is passed.
        if unsafe { libc::sync_file_range(file.as_raw_fd(), o, n, flags) } != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// What a pass dropped.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Dropped {
    /// Ranges advised away.
    pub ranges: usize,
    /// Files whose due written ranges were written out first.
    pub written_out: usize,
}

/// Drops the pages of `views` read before `now - READ_DELAY` or written before `now - DELAY` (and
/// those of the complete ones seen cached on a pass before `now - PASS`). A file whose due ranges
/// cannot be written out keeps them for the next pass.
pub fn drop_pass(views: &[std::sync::Arc<ViewFile>], now: Instant) -> Dropped {
    let cutoff = now.checked_sub(DELAY).unwrap_or(now);
    let read_cutoff = now.checked_sub(READ_DELAY).unwrap_or(now);
    let mut out = Dropped::default();
    for v in views {
        let whole = v.unmarked.load(std::sync::atomic::Ordering::Acquire);
        let (ranges, written) = v.touched.take_before(read_cutoff, cutoff);
        if written {
            if let Err(e) = v.write_out(&ranges) {
                tracing::warn!(path = %v.path.display(), error = %e, "view file not written out: its pages stay cached");
                for &(o, n) in &ranges {
                    v.touched.note(o, n, true);
                }
                continue;
            }
            out.written_out += 1;
        }
        if whole {
            out.ranges += drop_complete(v, now, cutoff);
            continue;
        }
        for (o, n) in ranges {
            drop_pages(v.cached(), o, n);
            out.ranges += 1;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn due_ranges_are_merged_and_young_ones_kept() {
        let t = Touched::default();
        t.note(8192, 4096, false);
        t.note(0, 4096, true);
        t.note(4096, 4096, false);
        t.note(1 << 20, 4096, false);
        t.note(8 << 20, 4096, true);
        let cutoff = Instant::now();
        std::thread::sleep(Duration::from_millis(2));
        t.note(1 << 30, 4096, true);
        let (due, written) = t.take_before(cutoff, cutoff);
        // Widened to 2 MiB steps: the four first ranges become one.
        assert_eq!(due, vec![(0, 2 << 20), (8 << 20, 2 << 20)]);
        assert!(written);
        let (again, _) = t.take_before(cutoff, cutoff);
        assert!(again.is_empty(), "taken ranges are gone");
        let (young, written) = t.take_before(Instant::now(), Instant::now());
        assert_eq!(young, vec![(1 << 30, 2 << 20)]);
        assert!(written);
    }

    #[test]
    fn writing_out_leaves_other_ranges_dirty() {
        use super::super::sys::page_counts;
        use std::os::unix::fs::FileExt;
        // On the disk's filesystem (tmpfs keeps no dirty pages to write).
        let dir = tempfile::tempdir_in("/var/tmp").expect("tempdir");
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(dir.path().join("view"))
            .expect("open");
        let mib = 1u64 << 20;
        for (i, at) in [0, 8, 16].into_iter().enumerate() {
            f.write_all_at(&vec![7 + i as u8; mib as usize], at * mib)
                .expect("write");
        }
        let dirty = |o| page_counts(f.as_fd(), o, mib).expect("cachestat").1;
        let keeps_dirty = dirty(0) > 0;
        if !strata_registry::testing::require(
            "a disk filesystem under /var/tmp (not tmpfs)",
            keeps_dirty,
        ) {
            return;
        }
        write_out(&f, &[(0, mib), (16 * mib, mib)]).expect("write out");
        assert_eq!(dirty(0), 0, "a range written out is clean");
        assert_eq!(dirty(16 * mib), 0, "so is the other one of the call");
        assert!(dirty(8 * mib) > 0, "the range between is still dirty");
        write_out(&f, &[(8 * mib, mib)]).expect("write out");
        assert_eq!(dirty(8 * mib), 0);
        assert!(write_out(&f, &[(u64::MAX, 1)]).is_err(), "past any offset");
    }

    #[test]
    fn a_complete_files_steps_with_young_writes_stay() {
        let s = DROP_STEP;
        let runs = [(0, 3 * s), (5 * s, s), (8 * s, 2 * s)];
        // A write inside the second step, and one across the last two.
        let young = [(s, s), (8 * s + 4096, s)];
        assert_eq!(without(&runs, &young), vec![(0, s), (2 * s, s), (5 * s, s)]);
        assert_eq!(without(&runs, &[]), runs.to_vec());
        assert_eq!(without(&[], &young), vec![]);
    }

    #[test]
    fn a_read_beside_a_write_not_yet_due_waits_for_it() {
        let t = Touched::default();
        t.note(0, 4096, true);
        t.note((2 << 20) + 4096, 4096, false);
        t.note(1 << 20, 4096, false);
        t.note(3 << 20, 4096, true);
        let written = Instant::now();
        std::thread::sleep(Duration::from_millis(2));
        let (due, w) = t.take_before(Instant::now(), written - Duration::from_secs(1));
        // The read in the first step waits with the write beside it; the one in the next step, whose
        // write is there too, as well: nothing is taken yet.
        assert_eq!(due, vec![]);
        assert!(!w);
        // Once the writes are due, all go together, written out first.
        let (due, w) = t.take_before(Instant::now(), Instant::now());
        assert_eq!(due, vec![(0, 4 << 20)]);
        assert!(w);
        // A read in a step no write touches goes at once.
        t.note(8 << 20, 4096, true);
        t.note(16 << 20, 4096, false);
        let (due, w) = t.take_before(Instant::now(), Instant::now() - Duration::from_secs(1));
        assert_eq!(due, vec![(16 << 20, 2 << 20)]);
        assert!(!w);
    }

    proptest::proptest! {
        /// Whatever was noted, what a pass takes is sorted, disjoint, in whole steps, and covers
        /// every due range but the reads held back (in a step with a write not yet due); what it
        /// leaves is exactly the ranges not yet due and those reads.
        #[test]
        fn taken_ranges_cover_every_due_range_once(
            notes in proptest::collection::vec((0u64..64 << 20, 1u64..4 << 20, proptest::bool::ANY, proptest::bool::ANY), 0..40),
        ) {
            let t = Touched::default();
            let young = Instant::now() + Duration::from_secs(3600);
            for &(o, n, w, due) in &notes {
                // A range not due is noted "in the future" (after the cutoff).
                let at = if due { Instant::now() } else { young };
                t.ranges.lock().unwrap().push((o, n, w, at));
            }
            let cutoff = Instant::now();
            let (taken, written) = t.take_before(cutoff, cutoff);
            let step = strata_registry::store::direct::DROP_STEP;
            for w in taken.windows(2) {
                proptest::prop_assert!(w[0].0 + w[0].1 < w[1].0, "sorted, disjoint, not touching");
            }
            for &(o, n) in &taken {
                proptest::prop_assert!(o % step == 0 && n % step == 0 && n > 0);
            }
            let steps = |o: u64, n: u64| (o / step, (o + n).div_ceil(step));
            let held = |&(o, n, w, due): &(u64, u64, bool, bool)| {
                let (a, b) = steps(o, n);
                due && !w && notes.iter().any(|&(o2, n2, w2, due2)| {
                    let (c, d) = steps(o2, n2);
                    w2 && !due2 && c < b && a < d
                })
            };
            for note in &notes {
                let &(o, n, _, due) = note;
                if due && !held(note) {
                    let covered = taken.iter().any(|&(s, l)| s <= o && o + n <= s + l);
                    proptest::prop_assert!(covered, "{o}+{n} not covered by {taken:?}");
                }
            }
            proptest::prop_assert_eq!(written, notes.iter().any(|&(_, _, w, due)| w && due));
            let left = t.ranges.lock().unwrap().len();
            proptest::prop_assert_eq!(left, notes.iter().filter(|n| !n.3 || held(n)).count());
        }
    }

    proptest::proptest! {
        /// Against a model of passes `PASS` apart: a step is dropped when it was cached on this pass
        /// and seen (not dropped) on the one before; dropped or uncached steps start over.
        #[test]
        fn complete_files_drop_steps_seen_on_the_pass_before(
            passes in proptest::collection::vec(proptest::collection::btree_set(0u64..24, 0..24), 1..12),
        ) {
            let t = Touched::default();
            let t0 = Instant::now();
            let mut seen = std::collections::BTreeSet::new();
            for (k, cached) in passes.iter().enumerate() {
                let now = t0 + PASS * (k as u32 + 1);
                let starts: Vec<u64> = cached.iter().map(|s| s * DROP_STEP).collect();
                let due = t.age(&starts, now, now - PASS);
                let want: std::collections::BTreeSet<u64> = cached.intersection(&seen).copied().collect();
                let mut got = std::collections::BTreeSet::new();
                for w in due.windows(2) {
                    proptest::prop_assert!(w[0].0 + w[0].1 < w[1].0, "adjacent steps merged");
                }
                for &(o, n) in &due {
                    got.extend((o / DROP_STEP)..(o + n) / DROP_STEP);
                }
                proptest::prop_assert_eq!(&got, &want);
                seen = cached.difference(&want).copied().collect();
            }
        }
    }

    #[test]
    fn the_cached_steps_of_a_file_are_found() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("view");
        let size = 15 * (1 << 20) + 100;
        std::fs::write(&path, vec![7u8; size as usize]).expect("write");
        let f = File::open(&path).expect("open");
        f.sync_all().expect("sync");
        fadvise(&f, 0, None, Advice::DontNeed).expect("fadvise");
        assert_eq!(
            cached_steps(&f, size).expect("cachestat"),
            Vec::<u64>::new(),
            "clean pages dropped (the test directory must be on a disk, not tmpfs)"
        );
        fadvise(&f, 0, None, Advice::Random).expect("no read-ahead");
        let mut b = [0u8; 1];
        for at in [2 << 20, 3 << 20, 10 << 20, (12 << 20) + 4096, size - 1] {
            std::os::unix::fs::FileExt::read_exact_at(&f, &mut b, at).expect("read");
        }
        assert_eq!(
            cached_steps(&f, size).expect("cachestat"),
            vec![2 << 20, 10 << 20, 12 << 20, 14 << 20]
        );
    }

    #[test]
    fn reads_go_sooner_than_writes() {
        let t = Touched::default();
        t.note(0, 4096, true);
        t.note(4 << 20, 4096, false);
        let now = Instant::now();
        std::thread::sleep(Duration::from_millis(2));
        let (due, written) = t.take_before(now, now - Duration::from_secs(1));
        assert_eq!((due, written), (vec![(4 << 20, 2 << 20)], false));
        let (due, written) = t.take_before(now, now);
        assert_eq!((due, written), (vec![(0, 2 << 20)], true));
    }
}
