//! Warming a plan: its chunks fetched into the cache in the background, in order, a few requests at a
//! time, under a bandwidth cap.
//!
//! The plan is cut into jobs: windows of [`WarmOptions::window`] entries in plan order; inside a window
//! each blob's chunks are sorted and split into runs of neighbours (at most [`WarmOptions::run`]
//! chunks), so that a run is one range request while the order of first use is kept window by window.
//! Workers take jobs in order and hand them to the daemon's [`ChunkSource`], which skips what is cached
//! or already being fetched and fetches the rest through the same single-flight fetcher demand reads use:
//! a demand read that needs a chunk being prefetched waits for that one request, never for the queue.
//! After each job a worker pays for its bytes at `rate`, so the cap holds on average. Warming stops at
//! the end of the plan, when asked ([`WarmStats::stop`]), or after `max_errors` consecutive failures (a
//! store that is down).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;
use strata_registry::digest::Digest;

use crate::plan::PlanEntry;

/// What warming needs from the node.
pub trait ChunkSource: Send + Sync {
    /// Why a fetch failed (warming counts failures and gives up after `max_errors` in a row).
    type Error: std::error::Error + Send + Sync + 'static;

    /// Fetches those of `chunks` (ascending indexes into `blob`'s table of contents) that are neither
    /// cached nor being fetched, neighbours in one request; returns (chunks fetched, bytes fetched).
    fn fetch(&self, blob: &Digest, chunks: &[u32]) -> Result<(u64, u64), Self::Error>;
}

/// How hard to warm.
#[derive(Clone, Debug)]
pub struct WarmOptions {
    /// Concurrent requests.
    pub threads: usize,
    /// Bytes per second, averaged; 0 for no cap.
    pub rate: u64,
    /// Consecutive failures after which warming gives up.
    pub max_errors: u64,
    /// Plan entries regrouped together (order is kept between windows).
    pub window: usize,
    /// Most chunks in one request.
    pub run: usize,
}

impl Default for WarmOptions {
    fn default() -> Self {
        WarmOptions {
            threads: 4,
            rate: 256 << 20,
            max_errors: 8,
            window: 64,
            run: 4,
        }
    }
}

/// Progress of one warming run (shared with whoever reports it).
#[derive(Default, Debug, Serialize)]
pub struct WarmStats {
    pub planned: AtomicU64,
    /// Chunks fetched by warming.
    pub fetched: AtomicU64,
    pub bytes: AtomicU64,
    pub errors: AtomicU64,
    pub done: AtomicBool,
    /// Set to stop warming early.
    pub stop: AtomicBool,
}

/// Cuts a plan into jobs (see the module documentation).
pub fn jobs(entries: &[PlanEntry], window: usize, run: usize) -> Vec<(Digest, Vec<u32>)> {
    let mut out = Vec::new();
    for w in entries.chunks(window.max(1)) {
        // Blobs in order of first appearance in the window.
        let mut order: Vec<Digest> = Vec::new();
        let mut by_blob: BTreeMap<Digest, Vec<u32>> = BTreeMap::new();
        for e in w {
            let v = by_blob.entry(e.blob).or_default();
            if v.is_empty() {
                order.push(e.blob);
            }
            v.push(e.chunk);
        }
        for b in order {
            let Some(mut v) = by_blob.remove(&b) else {
                continue;
            };
            v.sort_unstable();
            v.dedup();
            let mut cur: Vec<u32> = Vec::new();
            for c in v {
                let next = cur.last().is_some_and(|&l| l + 1 == c);
                if !cur.is_empty() && (!next || cur.len() >= run.max(1)) {
                    out.push((b, std::mem::take(&mut cur)));
                }
                cur.push(c);
            }
            if !cur.is_empty() {
                out.push((b, cur));
            }
        }
    }
    out
}

/// Paces workers to an average byte rate.
struct Pacer {
    rate: u64,
    next: Mutex<Instant>,
}

impl Pacer {
    /// Reserves time for `bytes` and returns how long the caller should wait.
    fn pay(&self, bytes: u64) -> Duration {
        if self.rate == 0 {
            return Duration::ZERO;
        }
        let cost = Duration::from_secs_f64(bytes as f64 / self.rate as f64);
        let mut next = self.next.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        let start = (*next).max(now);
        *next = start + cost;
        start.saturating_duration_since(now)
    }
}

/// Starts warming `entries` in the background; returns at once. Progress and the end show in `stats`;
/// the handle joins when warming is over.
pub fn warm<S: ChunkSource + 'static>(
    entries: Arc<Vec<PlanEntry>>,
    src: Arc<S>,
    opts: WarmOptions,
    stats: Arc<WarmStats>,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    stats.planned.store(entries.len() as u64, Ordering::Relaxed);
    std::thread::Builder::new()
        .name("strata-prefetch".into())
        .spawn(move || {
            let jobs = jobs(&entries, opts.window, opts.run);
            let cursor = AtomicUsize::new(0);
            let failures = AtomicU64::new(0);
            let pacer = Pacer {
                rate: opts.rate,
                next: Mutex::new(Instant::now()),
            };
            std::thread::scope(|s| {
                for _ in 0..opts.threads.max(1) {
                    s.spawn(|| loop {
                        if stats.stop.load(Ordering::Relaxed)
                            || failures.load(Ordering::Relaxed) >= opts.max_errors
                        {
                            return;
                        }
                        let i = cursor.fetch_add(1, Ordering::Relaxed);
                        let Some((blob, chunks)) = jobs.get(i) else {
                            return;
                        };
                        match src.fetch(blob, chunks) {
                            Ok((n, bytes)) => {
                                failures.store(0, Ordering::Relaxed);
                                stats.fetched.fetch_add(n, Ordering::Relaxed);
                                stats.bytes.fetch_add(bytes, Ordering::Relaxed);
                                std::thread::sleep(pacer.pay(bytes));
                            }
                            Err(_) => {
                                failures.fetch_add(1, Ordering::Relaxed);
                                stats.errors.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                    });
                }
            });
            stats.done.store(true, Ordering::SeqCst);
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    /// A source with some chunks cached and some blobs failing, recording the requests.
    struct Fake {
        cached: HashSet<u32>,
        failing: bool,
        requests: Mutex<Vec<Vec<u32>>>,
    }

    #[derive(Debug, thiserror::Error)]
    #[error("down")]
    struct Down;

    impl ChunkSource for Fake {
        type Error = Down;

        fn fetch(&self, _blob: &Digest, chunks: &[u32]) -> Result<(u64, u64), Down> {
            if self.failing {
                return Err(Down);
            }
            let todo: Vec<u32> = chunks
                .iter()
                .copied()
                .filter(|c| !self.cached.contains(c))
                .collect();
            let n = todo.len() as u64;
            self.requests.lock().unwrap().push(todo);
            Ok((n, n * 1000))
        }
    }

    fn e(blob: &Digest, chunk: u32) -> PlanEntry {
        PlanEntry { blob: *blob, chunk }
    }

    #[test]
    fn jobs_keep_window_order_and_group_neighbours() {
        let (a, b) = (Digest::of(b"a"), Digest::of(b"b"));
        let plan = [
            e(&a, 5),
            e(&b, 1),
            e(&a, 3),
            e(&a, 4),
            e(&a, 9),
            e(&b, 2),
            e(&a, 6),
        ];
        let got = jobs(&plan, 4, 8);
        // Window 1: a{5,3,4} b{1}; window 2: a{9,6} b{2}.
        let want = vec![
            (a, vec![3, 4, 5]),
            (b, vec![1]),
            (a, vec![6]),
            (a, vec![9]),
            (b, vec![2]),
        ];
        assert_eq!(got, want);
        let long: Vec<PlanEntry> = (0..10).map(|c| e(&a, c)).collect();
        let got = jobs(&long, 64, 4);
        let runs: Vec<Vec<u32>> = got.into_iter().map(|(_, v)| v).collect();
        assert_eq!(runs, vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7], vec![8, 9]]);
    }

    fn run(src: Arc<Fake>, n: u32, opts: WarmOptions) -> Arc<WarmStats> {
        let blob = Digest::of(b"blob");
        let entries = Arc::new((0..n).map(|c| e(&blob, c)).collect());
        let stats = Arc::new(WarmStats::default());
        warm(entries, src, opts, stats.clone())
            .unwrap()
            .join()
            .unwrap();
        assert!(stats.done.load(Ordering::SeqCst));
        stats
    }

    #[test]
    fn fetches_what_is_missing_and_counts_it() {
        let src = Arc::new(Fake {
            cached: [1, 3].into(),
            failing: false,
            requests: Mutex::new(Vec::new()),
        });
        let opts = WarmOptions {
            threads: 1,
            rate: 0,
            run: 3,
            ..WarmOptions::default()
        };
        let stats = run(src.clone(), 6, opts);
        assert_eq!(*src.requests.lock().unwrap(), [vec![0, 2], vec![4, 5]]);
        assert_eq!(stats.fetched.load(Ordering::Relaxed), 4);
        assert_eq!(stats.bytes.load(Ordering::Relaxed), 4000);
    }

    #[test]
    fn gives_up_after_consecutive_errors_and_honours_the_cap() {
        let src = Arc::new(Fake {
            cached: HashSet::new(),
            failing: true,
            requests: Mutex::new(Vec::new()),
        });
        let opts = WarmOptions {
            threads: 2,
            rate: 0,
            max_errors: 3,
            run: 1,
            ..WarmOptions::default()
        };
        let stats = run(src, 100, opts);
        let errors = stats.errors.load(Ordering::Relaxed);
        assert!((3..=4).contains(&errors), "{errors} errors");
        // 10 chunks of 1000 bytes at 20,000 B/s: at least ~0.45 s.
        let src = Arc::new(Fake {
            cached: HashSet::new(),
            failing: false,
            requests: Mutex::new(Vec::new()),
        });
        let t = Instant::now();
        let opts = WarmOptions {
            threads: 4,
            rate: 20_000,
            run: 1,
            ..WarmOptions::default()
        };
        run(src, 10, opts);
        assert!(
            t.elapsed() >= Duration::from_millis(400),
            "{:?}",
            t.elapsed()
        );
    }
}
