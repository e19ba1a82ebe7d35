//! Counters the daemon exports at `/metrics`, in Prometheus text format.
//!
//! Per blob: bytes fetched, fetches, cache hits and misses; a fetch latency histogram; errors by kind;
//! reads served. Plain atomics and one mutex-guarded map keyed by blob: cheap enough for the read path.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use strata_registry::digest::Digest;

/// Upper bounds (seconds) of the fetch latency histogram.
pub const BUCKETS: [f64; 12] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0,
];

#[derive(Default, Clone, Copy)]
struct BlobCounters {
    fetched_bytes: u64,
    fetches: u64,
    hits: u64,
    misses: u64,
}

/// The daemon's counters.
#[derive(Default)]
pub struct Metrics {
    blobs: Mutex<BTreeMap<Digest, BlobCounters>>,
    errors: Mutex<BTreeMap<&'static str, u64>>,
    latency: [AtomicU64; BUCKETS.len() + 1],
    latency_sum_us: AtomicU64,
    pub reads: AtomicU64,
    pub read_bytes: AtomicU64,
    /// Fetched bytes by the sandbox whose read missed.
    pub attribution: crate::attribution::Attribution,
}

impl Metrics {
    fn blob(&self, d: &Digest, f: impl FnOnce(&mut BlobCounters)) {
        let mut m = self.blobs.lock().unwrap_or_else(|p| p.into_inner());
        f(m.entry(*d).or_default());
    }

    /// A read served from the cache.
    pub fn cache_hit(&self, d: &Digest) {
        self.blob(d, |c| c.hits += 1);
    }

    /// A read that had to fetch.
    pub fn cache_miss(&self, d: &Digest) {
        self.blob(d, |c| c.misses += 1);
    }

    /// One range request of `bytes` that took `took`.
    pub fn fetched(&self, d: &Digest, bytes: u64, took: Duration) {
        self.blob(d, |c| {
            c.fetched_bytes += bytes;
            c.fetches += 1;
        });
        let s = took.as_secs_f64();
        let i = BUCKETS
            .iter()
            .position(|b| s <= *b)
            .unwrap_or(BUCKETS.len());
        self.latency[i].fetch_add(1, Ordering::Relaxed);
        self.latency_sum_us
            .fetch_add(took.as_micros() as u64, Ordering::Relaxed);
    }

    /// A read of `n` bytes served.
    pub fn served(&self, n: usize) {
        self.reads.fetch_add(1, Ordering::Relaxed);
        self.read_bytes.fetch_add(n as u64, Ordering::Relaxed);
    }

    /// An error of `kind`.
    pub fn error(&self, kind: &'static str) {
        let mut m = self.errors.lock().unwrap_or_else(|p| p.into_inner());
        *m.entry(kind).or_default() += 1;
    }

    /// Bytes fetched for one blob so far.
    pub fn fetched_bytes(&self, d: &Digest) -> u64 {
        let m = self.blobs.lock().unwrap_or_else(|p| p.into_inner());
        m.get(d).map_or(0, |c| c.fetched_bytes)
    }

    /// Prometheus text exposition. `extra` lines (gauges the caller owns) are appended.
    pub fn render(&self, extra: &str) -> String {
        let mut out = String::new();
        let blobs = self.blobs.lock().unwrap_or_else(|p| p.into_inner()).clone();
        for (name, help, get) in [
            (
                "strata_fetched_bytes_total",
                "Compressed bytes fetched from the store",
                (|c: &BlobCounters| c.fetched_bytes) as fn(&BlobCounters) -> u64,
            ),
            (
                "strata_fetches_total",
                "Range requests made to the store",
                |c| c.fetches,
            ),
            (
                "strata_cache_hits_total",
                "Chunk reads served from the local cache",
                |c| c.hits,
            ),
            (
                "strata_cache_misses_total",
                "Chunk reads that had to fetch",
                |c| c.misses,
            ),
        ] {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
            for (d, c) in &blobs {
                let _ = writeln!(out, "{name}{{blob=\"{d}\"}} {}", get(c));
            }
        }
        let _ = writeln!(out, "# HELP strata_fetch_seconds Latency of range requests to the store\n# TYPE strata_fetch_seconds histogram");
        let mut cum = 0;
        for (i, b) in BUCKETS.iter().enumerate() {
            cum += self.latency[i].load(Ordering::Relaxed);
            let _ = writeln!(out, "strata_fetch_seconds_bucket{{le=\"{b}\"}} {cum}");
        }
        cum += self.latency[BUCKETS.len()].load(Ordering::Relaxed);
        let _ = writeln!(out, "strata_fetch_seconds_bucket{{le=\"+Inf\"}} {cum}");
        let _ = writeln!(
            out,
            "strata_fetch_seconds_sum {}\nstrata_fetch_seconds_count {cum}",
            self.latency_sum_us.load(Ordering::Relaxed) as f64 / 1e6
        );
        let _ = writeln!(
            out,
            "# HELP strata_errors_total Errors by kind\n# TYPE strata_errors_total counter"
        );
        for (k, v) in self.errors.lock().unwrap_or_else(|p| p.into_inner()).iter() {
            let _ = writeln!(out, "strata_errors_total{{kind=\"{k}\"}} {v}");
        }
        let _ = writeln!(
            out,
            "# HELP strata_reads_total FUSE reads served\n# TYPE strata_reads_total counter\nstrata_reads_total {}",
            self.reads.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            out,
            "# HELP strata_read_bytes_total Bytes returned by FUSE reads\n# TYPE strata_read_bytes_total counter\nstrata_read_bytes_total {}",
            self.read_bytes.load(Ordering::Relaxed)
        );
        out.push_str(extra);
        out
    }
}
