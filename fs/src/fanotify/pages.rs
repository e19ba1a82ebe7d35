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
//! read at least [`READ_DELAY`] ago and those written at least [`DELAY`] ago, writes the file's dirty
//! pages out (`fdatasync`) if it takes a written one, and tells the kernel it will not need them
//! (`POSIX_FADV_DONTNEED`), which drops the clean pages. EROFS keeps its own copy of what it read; a
//! page it evicts later comes back from the view file on disk (an event, allowed at once). A complete
//! view file is no longer watched, so its reads are not reported: its whole cache is dropped on
//! every pass. So a byte that was in the view file already stays in memory twice for a few hundred
//! milliseconds at most; a byte a miss had to fill, up to [`DELAY`] (written pages are dropped only
//! once written out, with the written range).
//!
//! Safe by construction: dropping a page never changes what a read sees — a clean page's bytes are on
//! disk, a dirty page is not dropped, a page being read is locked and skipped. The delay only decides
//! how long a second copy may live: what a plan or a miss's followers fill ahead of a reader stays in
//! memory for [`DELAY`] (unless a read of a neighbour in the same 2 MiB drops it sooner), then comes
//! from the disk.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use rustix::fs::{fadvise, Advice};
use strata_registry::store::direct::{drop_pages, widened};

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
}

impl Touched {
    /// Notes `len` bytes at `offset` as touched now (`written`: the pages may be dirty).
    pub fn note(&self, offset: u64, len: u64, written: bool) {
        let mut r = self.ranges.lock().unwrap_or_else(|p| p.into_inner());
        r.push((offset, len, written, Instant::now()));
    }

    /// Takes the ranges read before `read_cutoff` and those written before `cutoff`, widened to whole steps of the kernel's largest
    /// folios (`direct::widened`: it drops only whole folios inside a range) and merged where they
    /// overlap or meet, and whether any of them was written.
    fn take_before(&self, read_cutoff: Instant, cutoff: Instant) -> (Vec<(u64, u64)>, bool) {
        let mut r = self.ranges.lock().unwrap_or_else(|p| p.into_inner());
        let mut due = Vec::new();
        let mut written = false;
        r.retain(|&(o, n, w, at)| {
            if at > if w { cutoff } else { read_cutoff } {
                return true;
            }
            let (start, len) = widened(o, n);
            due.push((start, start + len));
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
}

/// What a pass dropped.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Dropped {
    /// Ranges advised away.
    pub ranges: usize,
    /// Files whose dirty pages were written out first.
    pub synced: usize,
}

/// Drops the pages of `views` read before `now - READ_DELAY` or written before `now - DELAY` (and
/// every page of the complete ones). A file that cannot be synced keeps its ranges for the next pass.
pub fn drop_pass(views: &[std::sync::Arc<ViewFile>], now: Instant) -> Dropped {
    let cutoff = now.checked_sub(DELAY).unwrap_or(now);
    let read_cutoff = now.checked_sub(READ_DELAY).unwrap_or(now);
    let mut out = Dropped::default();
    for v in views {
        let whole = v.unmarked.load(std::sync::atomic::Ordering::Acquire);
        let (ranges, written) = v.touched.take_before(read_cutoff, cutoff);
        if written {
            if let Err(e) = v.sync() {
                tracing::warn!(path = %v.path.display(), error = %e, "view file not synced: its pages stay cached");
                for &(o, n) in &ranges {
                    v.touched.note(o, n, true);
                }
                continue;
            }
            out.synced += 1;
        }
        if whole {
            // `None`: to the end of the file.
            match fadvise(v.cached(), 0, None, Advice::DontNeed) {
                Ok(()) => out.ranges += 1,
                Err(e) => tracing::debug!(path = %v.path.display(), error = %e,
                    "view file pages not dropped"),
            }
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

    proptest::proptest! {
        /// Whatever was noted, what a pass takes is sorted, disjoint, in whole steps, and covers
        /// every due range; what it leaves is exactly the ranges not yet due.
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
            for &(o, n, _, due) in &notes {
                if due {
                    let covered = taken.iter().any(|&(s, l)| s <= o && o + n <= s + l);
                    proptest::prop_assert!(covered, "{o}+{n} not covered by {taken:?}");
                }
            }
            proptest::prop_assert_eq!(written, notes.iter().any(|&(_, _, w, due)| w && due));
            let left = t.ranges.lock().unwrap().len();
            proptest::prop_assert_eq!(left, notes.iter().filter(|n| !n.3).count());
        }
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
