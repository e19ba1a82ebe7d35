//! Store-wide chunk index: lookups per second in the builder's RocksDB cache as the store grows, against
//! an in-memory hash map of the same chunks (the peer: what `--parent` dedup keeps in memory).
//!
//! For each size N (default 10 K, 1 M, 10 M chunks; `INDEX_BENCH_SIZES=10000,1000000`): fills a fresh
//! cache with N chunk entries in segments of 4,096 chunks (as a sync adds them), reopens it read-only as a
//! build does, then times LOOKUPS (default 200,000) lookups of chunks it holds and as many of chunks it
//! does not, on one thread, in random order. Prints a markdown table.
//!
//! Run: `cargo bench -p strata-registry --bench index_lookup` (directory: `INDEX_BENCH_DIR`, default
//! `/var/tmp/strata-bench/index`; about 1.2 GB for 10 M chunks, removed after each size).

use std::collections::HashMap;
use std::hint::black_box;
use std::time::{Duration, Instant};

use strata_registry::digest::Digest;
use strata_registry::index::cache::IndexCache;
use strata_registry::index::Segment;
use strata_registry::model::BlobRef;
use strata_registry::toc::{ChunkEntry, Toc};

const SEGMENT: u64 = 4096;

fn chunk(i: u64) -> Digest {
    Digest::of(&i.to_le_bytes())
}

fn segment(first: u64, n: u64) -> Segment {
    let toc = Toc {
        frames: Vec::new(),
        chunks: (0..n)
            .map(|j| ChunkEntry {
                block: j as u32 * 256,
                len: 1 << 20,
                frame: j as u32,
                frame_offset: 0,
                digest: chunk(first + j),
            })
            .collect(),
        view_blocks: n * 256,
        ..Toc::default()
    };
    let blob = BlobRef {
        digest: Digest::of(format!("blob {first}").as_bytes()),
        size: 0,
        view_size: toc.view_size(),
        toc_offset: 0,
        toc_len: 0,
        toc_digest: Digest::of(b""),
        chunks: n,
    };
    Segment { blob, toc }
}

/// A fixed pseudo-random sequence (xorshift), so every run looks up the same chunks.
fn picks(n: u64, count: usize, seed: u64) -> Vec<u64> {
    let mut x = seed | 1;
    (0..count)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % n
        })
        .collect()
}

fn rate(count: usize, d: Duration) -> String {
    format!(
        "{:.0} k/s ({:.2} µs)",
        count as f64 / d.as_secs_f64() / 1e3,
        d.as_secs_f64() * 1e6 / count as f64
    )
}

fn main() {
    let sizes: Vec<u64> = std::env::var("INDEX_BENCH_SIZES")
        .unwrap_or_else(|_| "10000,1000000,10000000".into())
        .split(',')
        .filter_map(|s| s.trim().parse().ok())
        .collect();
    let lookups: usize = std::env::var("LOOKUPS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(200_000);
    let base = std::path::PathBuf::from(
        std::env::var("INDEX_BENCH_DIR").unwrap_or_else(|_| "/var/tmp/strata-bench/index".into()),
    );
    println!("| chunks | fill (chunks/s) | cache on disk | lookup, present | lookup, absent | peer: HashMap lookup, present | peer: HashMap memory |");
    println!("|---|---|---|---|---|---|---|");
    for n in sizes {
        let dir = base.join(format!("n{n}"));
        let _ = std::fs::remove_dir_all(&dir);
        let start = Instant::now();
        {
            let mut rw = IndexCache::open_rw(&dir, Duration::ZERO)
                .expect("open")
                .expect("not locked");
            let mut first = 0;
            while first < n {
                rw.add(&segment(first, SEGMENT.min(n - first)))
                    .expect("add");
                first += SEGMENT;
            }
            rw.settle().expect("settle");
        }
        let fill = start.elapsed();
        let disk: u64 = walk_size(&dir);
        let ro = IndexCache::open_ro(&dir).expect("open ro");
        let present = picks(n, lookups, 7);
        let t = Instant::now();
        for i in &present {
            let h = ro.lookup(&chunk(*i)).expect("lookup");
            assert_eq!(h.len(), 1);
            black_box(h);
        }
        let t_present = t.elapsed();
        let t = Instant::now();
        for i in picks(n, lookups, 11) {
            let h = ro.lookup(&chunk(n + i)).expect("lookup");
            assert!(h.is_empty());
            black_box(h);
        }
        let t_absent = t.elapsed();
        drop(ro);
        let _ = std::fs::remove_dir_all(&dir);
        // Peer: the same chunks in memory, as a build's parent map holds them.
        let map: HashMap<Digest, (u32, u32)> =
            (0..n).map(|i| (chunk(i), (i as u32, 0u32))).collect();
        let mem = map.capacity() * (32 + 8 + 1);
        let t = Instant::now();
        for i in &present {
            black_box(map.get(&chunk(*i)));
        }
        let t_map = t.elapsed();
        drop(map);
        println!(
            "| {n} | {:.0} k/s ({:.1} s) | {:.0} MB | {} | {} | {} | {:.0} MB |",
            n as f64 / fill.as_secs_f64() / 1e3,
            fill.as_secs_f64(),
            disk as f64 / 1e6,
            rate(lookups, t_present),
            rate(lookups, t_absent),
            rate(lookups, t_map),
            mem as f64 / 1e6
        );
    }
}

fn walk_size(dir: &std::path::Path) -> u64 {
    std::fs::read_dir(dir)
        .map(|r| {
            r.filter_map(Result::ok)
                .filter_map(|e| e.metadata().ok())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0)
}
