//! Warming a plan: its chunks fetched into the cache in the background, in order, a few at a time, under
//! a bandwidth cap.
//!
//! Workers take plan entries in order from a shared cursor, skip chunks already cached, and fetch the
//! rest through the daemon's [`ChunkSource`] (which merges neighbouring chunks into one request and makes
//! concurrent misses on a chunk share one fetch, so a demand read that needs a chunk being prefetched waits
//! for that fetch, never for the queue). After each fetch a worker pays for the bytes at `rate`: the cap
//! holds on average over the run. Warming stops at the end of the plan, when asked to
//! ([`WarmStats::stop`]), or after `max_errors` consecutive failures (a store that is down).

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::plan::PlanEntry;

/// What warming needs from the node.
pub trait ChunkSource: Send + Sync {
    /// True when the chunk is in the local cache.
    fn cached(&self, e: &PlanEntry) -> bool;
    /// Fetches the chunk (and whatever neighbours the source merges in) into the cache; returns the
    /// bytes it fetched, for the bandwidth cap.
    fn fetch(&self, e: &PlanEntry) -> Result<u64, String>;
}

/// How hard to warm.
#[derive(Clone, Debug)]
pub struct WarmOptions {
    /// Concurrent fetches.
    pub threads: usize,
    /// Bytes per second, averaged; 0 for no cap.
    pub rate: u64,
    /// Consecutive failures after which warming gives up.
    pub max_errors: u64,
}

impl Default for WarmOptions {
    fn default() -> Self {
        WarmOptions {
            threads: 4,
            rate: 256 << 20,
            max_errors: 8,
        }
    }
}

/// Progress of one warming run (shared with whoever reports it).
#[derive(Default, Debug, Serialize)]
pub struct WarmStats {
    pub planned: AtomicU64,
    /// Chunks fetched by warming.
    pub fetched: AtomicU64,
    /// Chunks found cached (or fetched meanwhile by a demand read or a merged neighbour).
    pub skipped: AtomicU64,
    pub bytes: AtomicU64,
    pub errors: AtomicU64,
    pub done: AtomicBool,
    /// Set to stop warming early.
    pub stop: AtomicBool,
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

/// Starts warming `entries` in the background; returns at once. Progress and the end show in `stats`.
pub fn warm(
    entries: Arc<Vec<PlanEntry>>,
    src: Arc<dyn ChunkSource>,
    opts: WarmOptions,
    stats: Arc<WarmStats>,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    stats.planned.store(entries.len() as u64, Ordering::Relaxed);
    std::thread::Builder::new()
        .name("strata-prefetch".into())
        .spawn(move || {
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
                        let Some(e) = entries.get(i) else {
                            return;
                        };
                        if src.cached(e) {
                            stats.skipped.fetch_add(1, Ordering::Relaxed);
                            continue;
                        }
                        match src.fetch(e) {
                            Ok(n) => {
                                failures.store(0, Ordering::Relaxed);
                                stats.fetched.fetch_add(1, Ordering::Relaxed);
                                stats.bytes.fetch_add(n, Ordering::Relaxed);
                                std::thread::sleep(pacer.pay(n));
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
    use strata_registry::digest::Digest;

    /// A source with some chunks cached, some failing, recording fetch order.
    struct Fake {
        cached: HashSet<u32>,
        failing: HashSet<u32>,
        fetched: Mutex<Vec<u32>>,
    }

    impl ChunkSource for Fake {
        fn cached(&self, e: &PlanEntry) -> bool {
            self.cached.contains(&e.chunk)
        }
        fn fetch(&self, e: &PlanEntry) -> Result<u64, String> {
            if self.failing.contains(&e.chunk) {
                return Err("down".into());
            }
            self.fetched.lock().unwrap().push(e.chunk);
            Ok(1000)
        }
    }

    fn plan(n: u32) -> Arc<Vec<PlanEntry>> {
        let blob = Digest::of(b"blob");
        Arc::new((0..n).map(|chunk| PlanEntry { blob, chunk }).collect())
    }

    fn run(src: Arc<Fake>, entries: Arc<Vec<PlanEntry>>, opts: WarmOptions) -> Arc<WarmStats> {
        let stats = Arc::new(WarmStats::default());
        warm(entries, src, opts, stats.clone())
            .unwrap()
            .join()
            .unwrap();
        assert!(stats.done.load(Ordering::SeqCst));
        stats
    }

    #[test]
    fn fetches_what_is_missing_in_order_and_skips_the_cached() {
        let src = Arc::new(Fake {
            cached: [1, 3].into(),
            failing: HashSet::new(),
            fetched: Mutex::new(Vec::new()),
        });
        let opts = WarmOptions {
            threads: 1,
            rate: 0,
            max_errors: 8,
        };
        let stats = run(src.clone(), plan(6), opts);
        assert_eq!(*src.fetched.lock().unwrap(), [0, 2, 4, 5]);
        assert_eq!(stats.fetched.load(Ordering::Relaxed), 4);
        assert_eq!(stats.skipped.load(Ordering::Relaxed), 2);
        assert_eq!(stats.bytes.load(Ordering::Relaxed), 4000);
    }

    #[test]
    fn gives_up_after_consecutive_errors_and_honours_the_cap() {
        let src = Arc::new(Fake {
            cached: HashSet::new(),
            failing: (0..100).collect(),
            fetched: Mutex::new(Vec::new()),
        });
        let opts = WarmOptions {
            threads: 2,
            rate: 0,
            max_errors: 3,
        };
        let stats = run(src, plan(100), opts);
        let errors = stats.errors.load(Ordering::Relaxed);
        assert!((3..=4).contains(&errors), "{errors} errors");
        // 10 chunks of 1000 bytes at 20,000 B/s: at least ~0.45 s.
        let src = Arc::new(Fake {
            cached: HashSet::new(),
            failing: HashSet::new(),
            fetched: Mutex::new(Vec::new()),
        });
        let t = Instant::now();
        let opts = WarmOptions {
            threads: 4,
            rate: 20_000,
            max_errors: 3,
        };
        run(src, plan(10), opts);
        assert!(
            t.elapsed() >= Duration::from_millis(400),
            "{:?}",
            t.elapsed()
        );
    }
}
