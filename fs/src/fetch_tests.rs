//! The fetcher over the fault-injecting store: single flight, deadline, corruption and errors.

use std::time::{Duration, Instant};

use strata_registry::store::{Fault, Op};

use super::*;
use crate::testkit::{bytes, Kit};

#[test]
fn read_ahead_window_moves_once_per_chunk_and_restarts() {
    // First sequential step into chunk 1 of 100 (nothing read ahead yet): chunks 2..10.
    assert_eq!(ahead_from(0, 1, 10), 2);
    // Into chunk 2: only chunk 10 is new.
    assert_eq!(ahead_from(10, 2, 11), 10);
    // A second pass from the start after the first ran to the end: the whole window again.
    assert_eq!(ahead_from(100, 1, 10), 2);
    // Near the end of the blob the window is cut short.
    assert_eq!(ahead_from(100, 99, 100), 100);
}

fn read(b: &ChunkBytes, n: usize) -> Vec<u8> {
    let mut v = vec![0u8; n];
    b.read_at(&mut v, 0).expect("read chunk");
    v
}

#[test]
fn concurrent_misses_of_one_chunk_make_one_request() {
    let kit = Kit::new(Duration::from_secs(5));
    let data = bytes(64 << 10, 1);
    let (blob, k) = kit.blob(std::slice::from_ref(&data));
    let blob = Arc::new(blob);
    kit.faults.reset_counts();
    let slow = kit.faults.inject(
        Fault::delay(Duration::from_millis(200))
            .key(&k)
            .ops(&[Op::GetRange]),
    );
    let got: Vec<Vec<u8>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..16)
            .map(|_| s.spawn(|| read(&kit.fetcher.chunk(&blob, 0).expect("chunk"), data.len())))
            .collect();
        hs.into_iter().map(|h| h.join().expect("thread")).collect()
    });
    assert!(got.iter().all(|g| *g == data));
    assert_eq!(kit.faults.calls(Op::GetRange, &k), 1, "single flight");
    kit.faults.remove(slow);
    // Cached now: no request at all.
    assert!(kit.fetcher.cached(&blob, 0).expect("cached").is_some());
    kit.fetcher.chunk(&blob, 0).expect("chunk");
    assert_eq!(kit.faults.calls(Op::GetRange, &k), 1);
}

#[test]
fn a_hung_store_fails_at_the_deadline_for_leader_and_waiters() {
    let deadline = Duration::from_millis(300);
    let kit = Kit::new(deadline);
    let (blob, k) = kit.blob(&[bytes(8 << 10, 2)]);
    let blob = Arc::new(blob);
    kit.faults
        .inject(Fault::hang().key(&k).ops(&[Op::GetRange]));
    let t = Instant::now();
    let results: Vec<_> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..8)
            .map(|_| s.spawn(|| kit.fetcher.chunk(&blob, 0).map(|_| ())))
            .collect();
        hs.into_iter().map(|h| h.join().expect("thread")).collect()
    });
    let took = t.elapsed();
    for r in results {
        assert!(matches!(r, Err(FetchError::Timeout { .. })), "{r:?}");
    }
    assert!(took >= deadline && took < deadline * 4, "{took:?}");
    kit.faults.clear();
    assert!(kit.fetcher.chunk(&blob, 0).is_ok(), "works again");
}

#[test]
fn corrupt_bytes_are_fetched_again_and_never_served_or_cached() {
    let kit = Kit::new(Duration::from_secs(5));
    let data = bytes(32 << 10, 3);
    let (blob, k) = kit.blob(&[data.clone(), bytes(32 << 10, 4)]);
    let blob = Arc::new(blob);
    // Corrupt once: the second fetch is clean.
    kit.faults.reset_counts();
    kit.faults
        .inject(Fault::corrupt().key(&k).ops(&[Op::GetRange]).times(1));
    let got = kit.fetcher.chunk(&blob, 0).expect("refetched");
    assert_eq!(read(&got, data.len()), data);
    assert_eq!(kit.faults.calls(Op::GetRange, &k), 2);
    // Corrupt always: an error, and nothing reaches the cache.
    kit.faults
        .inject(Fault::corrupt().key(&k).ops(&[Op::GetRange]));
    let r = kit.fetcher.chunk(&blob, 1);
    assert!(
        matches!(r, Err(FetchError::Corrupt { .. })),
        "{:?}",
        r.map(|_| ())
    );
    assert!(kit.fetcher.cached(&blob, 1).expect("lookup").is_none());
}

#[test]
fn a_store_error_fails_the_read_and_the_next_read_fetches_again() {
    let kit = Kit::new(Duration::from_secs(5));
    let data = bytes(16 << 10, 5);
    let (blob, k) = kit.blob(std::slice::from_ref(&data));
    let blob = Arc::new(blob);
    kit.faults
        .inject(Fault::error().key(&k).ops(&[Op::GetRange]).times(1));
    let r = kit.fetcher.chunk(&blob, 0);
    assert!(
        matches!(r, Err(FetchError::Store { .. })),
        "{:?}",
        r.map(|_| ())
    );
    let got = kit.fetcher.chunk(&blob, 0).expect("second read");
    assert_eq!(read(&got, data.len()), data);
}
