//! Counters the daemon exports at `/metrics`, in the OpenMetrics text format (which Prometheus reads).
//!
//! What is counted: per blob, bytes fetched, range requests, cache hits and misses; the store's range
//! request latency; how long readers waited for chunks that were not in the cache, by whether the reader
//! fetched the chunk itself (`led`) or waited for another reader's fetch (`joined`) — the time a lazy
//! image costs its sandboxes, where `strata_fetch_seconds` is only the store's share of it; errors by
//! kind; reads served. Gauges and totals that other parts of the daemon own (the cache's size, sandboxes,
//! prefetch) are handed to [`Metrics::render`] at each scrape as [`NodeGauges`].
//!
//! The counters are `prometheus-client`'s (atomics; a family takes a read lock per update, cheap beside a
//! chunk read), and so is the text: a registry is assembled per scrape from clones that share the
//! counters' state.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue, LabelValueEncoder};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use strata_registry::digest::Digest;

/// Upper bounds (seconds) of the latency histograms.
pub const BUCKETS: [f64; 12] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0,
];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BlobLabel {
    blob: BlobName,
}

/// A blob's digest as a label value: kept as the digest (a cache hit counts without formatting or
/// allocating anything), written as `blake3:<hex>` only when scraped.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
struct BlobName(Digest);

impl EncodeLabelValue for BlobName {
    fn encode(&self, e: &mut LabelValueEncoder<'_>) -> std::fmt::Result {
        use std::fmt::Write;
        write!(e, "{}", self.0)
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabel {
    kind: &'static str,
}

/// How a reader got a chunk that was not in the cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Wait {
    /// It fetched the chunk itself.
    Led,
    /// It waited for another reader's (or a prefetch's) fetch of it.
    Joined,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabel {
    outcome: &'static str,
}

fn histogram() -> Histogram {
    Histogram::new(BUCKETS)
}

/// The daemon's counters.
pub struct Metrics {
    fetched_bytes: Family<BlobLabel, Counter>,
    fetches: Family<BlobLabel, Counter>,
    hits: Family<BlobLabel, Counter>,
    misses: Family<BlobLabel, Counter>,
    errors: Family<KindLabel, Counter>,
    latency: Histogram,
    waits: Family<OutcomeLabel, Histogram, fn() -> Histogram>,
    layer_fetches: Histogram,
    streamed: Counter,
    pub reads: AtomicU64,
    pub read_bytes: AtomicU64,
    /// Fetched bytes by the sandbox whose read missed.
    pub attribution: crate::attribution::Attribution,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            fetched_bytes: Family::default(),
            fetches: Family::default(),
            hits: Family::default(),
            misses: Family::default(),
            errors: Family::default(),
            latency: histogram(),
            waits: Family::new_with_constructor(histogram),
            layer_fetches: histogram(),
            streamed: Counter::default(),
            reads: AtomicU64::new(0),
            read_bytes: AtomicU64::new(0),
            attribution: Default::default(),
        }
    }
}

fn blob(d: &Digest) -> BlobLabel {
    BlobLabel { blob: BlobName(*d) }
}

/// What the rest of the daemon owns, read at a scrape.
#[derive(Clone, Copy, Debug, Default)]
pub struct NodeGauges {
    pub cache_bytes: u64,
    pub cache_capacity: u64,
    pub layers: u64,
    pub sandboxes: u64,
    pub prefetch_chunks: u64,
    pub prefetch_bytes: u64,
    pub cache_checked: u64,
    pub cache_rejected: u64,
}

impl Metrics {
    /// A read served from the cache.
    pub fn cache_hit(&self, d: &Digest) {
        self.hits.get_or_create(&blob(d)).inc();
    }

    /// A read that had to fetch.
    pub fn cache_miss(&self, d: &Digest) {
        self.misses.get_or_create(&blob(d)).inc();
    }

    /// One range request of `bytes` that took `took`.
    pub fn fetched(&self, d: &Digest, bytes: u64, took: Duration) {
        let b = blob(d);
        self.fetched_bytes.get_or_create(&b).inc_by(bytes);
        self.fetches.get_or_create(&b).inc();
        self.latency.observe(took.as_secs_f64());
    }

    /// A reader waited `took` for a chunk that was not in the cache: counted here, and charged to the
    /// reader's sandbox ([`crate::attribution`]).
    pub fn waited(&self, how: Wait, took: Duration) {
        self.attribution.waited(took);
        let outcome = match how {
            Wait::Led => "led",
            Wait::Joined => "joined",
        };
        self.waits
            .get_or_create(&OutcomeLabel { outcome })
            .observe(took.as_secs_f64());
    }

    /// A layer fetched for a mount (its descriptor, metadata and tables of contents) in `took`.
    pub fn layer_fetched(&self, took: Duration) {
        self.layer_fetches.observe(took.as_secs_f64());
    }

    /// The stream-ahead fetched `bytes` (counted in [`Self::fetched`] too).
    pub fn streamed(&self, bytes: u64) {
        self.streamed.inc_by(bytes);
    }

    /// A read of `n` bytes served.
    pub fn served(&self, n: usize) {
        self.reads.fetch_add(1, Ordering::Relaxed);
        self.read_bytes.fetch_add(n as u64, Ordering::Relaxed);
    }

    /// An error of `kind`.
    pub fn error(&self, kind: &'static str) {
        self.errors.get_or_create(&KindLabel { kind }).inc();
    }

    /// Bytes fetched for one blob so far.
    pub fn fetched_bytes(&self, d: &Digest) -> u64 {
        self.fetched_bytes.get(&blob(d)).map_or(0, |c| c.get())
    }

    /// The text exposition: the counters, then `node`'s gauges and totals.
    pub fn render(&self, node: &NodeGauges) -> String {
        let mut r = Registry::default();
        for (name, help, family) in [
            (
                "strata_fetched_bytes",
                "Compressed bytes fetched from the store",
                &self.fetched_bytes,
            ),
            (
                "strata_fetches",
                "Range requests made to the store",
                &self.fetches,
            ),
            (
                "strata_cache_hits",
                "Chunk reads served from the local cache",
                &self.hits,
            ),
            (
                "strata_cache_misses",
                "Chunk reads that had to fetch",
                &self.misses,
            ),
        ] {
            r.register(name, help, family.clone());
        }
        r.register(
            "strata_fetch_seconds",
            "Latency of range requests to the store",
            self.latency.clone(),
        );
        r.register(
            "strata_read_wait_seconds",
            "How long readers waited for chunks not in the cache, by whether the reader fetched (led) or waited for another fetch (joined)",
            self.waits.clone(),
        );
        r.register(
            "strata_layer_fetch_seconds",
            "Fetching a layer for its first mount on this node: its descriptor, metadata and tables of contents",
            self.layer_fetches.clone(),
        );
        r.register(
            "strata_streamed_bytes",
            "Compressed bytes fetched ahead of misses by the stream-ahead (part of strata_fetched_bytes)",
            self.streamed.clone(),
        );
        r.register("strata_errors", "Errors by kind", self.errors.clone());
        let total = |r: &mut Registry, name: &str, help: &str, v: u64| {
            r.register(name, help, ConstCounter::new(v))
        };
        total(
            &mut r,
            "strata_reads",
            "FUSE reads served",
            self.reads.load(Ordering::Relaxed),
        );
        total(
            &mut r,
            "strata_read_bytes",
            "Bytes returned by FUSE reads",
            self.read_bytes.load(Ordering::Relaxed),
        );
        self.register_node(&mut r, node);
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = encode(&mut out, &r);
        out
    }

    fn register_node(&self, r: &mut Registry, n: &NodeGauges) {
        for (name, help, v) in [
            (
                "strata_cache_bytes",
                "Bytes in the chunk cache",
                n.cache_bytes,
            ),
            (
                "strata_cache_capacity_bytes",
                "Chunk cache bound",
                n.cache_capacity,
            ),
            (
                "strata_layers_mounted",
                "Layers mounted on this node",
                n.layers,
            ),
            ("strata_sandboxes", "Sandboxes on this node", n.sandboxes),
        ] {
            r.register(name, help, ConstGauge::new(v as i64));
        }
        for (name, help, v) in [
            (
                "strata_prefetch_chunks",
                "Chunks fetched by prefetch",
                n.prefetch_chunks,
            ),
            (
                "strata_prefetch_bytes",
                "Bytes fetched by prefetch",
                n.prefetch_bytes,
            ),
            (
                "strata_cache_checked",
                "Cached chunks read from disk and checked against their digest",
                n.cache_checked,
            ),
            (
                "strata_cache_rejected",
                "Cached chunks that failed that check (dropped, fetched again)",
                n.cache_rejected,
            ),
        ] {
            r.register(name, help, ConstCounter::new(v));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_text_names_every_counter_as_before_and_the_read_waits() {
        let m = Metrics::default();
        let d = Digest::of(b"blob");
        m.cache_miss(&d);
        m.fetched(&d, 1000, Duration::from_millis(2));
        m.fetched(&d, 24, Duration::from_millis(20));
        m.waited(Wait::Led, Duration::from_micros(800));
        m.waited(Wait::Joined, Duration::from_millis(3));
        m.error("corrupt");
        m.served(4096);
        m.layer_fetched(Duration::from_millis(30));
        m.streamed(512);
        let node = NodeGauges {
            cache_bytes: 7,
            prefetch_bytes: 9,
            ..Default::default()
        };
        let text = m.render(&node);
        for line in [
            format!("strata_fetched_bytes_total{{blob=\"{d}\"}} 1024"),
            format!("strata_fetches_total{{blob=\"{d}\"}} 2"),
            format!("strata_cache_misses_total{{blob=\"{d}\"}} 1"),
            "strata_fetch_seconds_bucket{le=\"0.0025\"} 1".into(),
            "strata_fetch_seconds_bucket{le=\"+Inf\"} 2".into(),
            "strata_fetch_seconds_count 2".into(),
            "strata_read_wait_seconds_bucket{le=\"0.001\",outcome=\"led\"} 1".into(),
            "strata_read_wait_seconds_bucket{le=\"0.001\",outcome=\"joined\"} 0".into(),
            "strata_read_wait_seconds_count{outcome=\"joined\"} 1".into(),
            "strata_layer_fetch_seconds_count 1".into(),
            "strata_streamed_bytes_total 512".into(),
            "strata_errors_total{kind=\"corrupt\"} 1".into(),
            "strata_reads_total 1".into(),
            "strata_read_bytes_total 4096".into(),
            "strata_cache_bytes 7".into(),
            "strata_prefetch_bytes_total 9".into(),
            "# TYPE strata_read_wait_seconds histogram".into(),
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "no line {line:?} in\n{text}"
            );
        }
        assert_eq!(m.fetched_bytes(&d), 1024);
        assert_eq!(m.fetched_bytes(&Digest::of(b"other")), 0);
        assert!(text.ends_with("# EOF\n"), "{text}");
    }
}
