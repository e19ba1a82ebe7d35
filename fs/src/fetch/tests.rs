//! The fetcher over the fault-injecting store: single flight, deadline, corruption and errors.

use std::time::{Duration, Instant};

use std::sync::{Condvar, Mutex};

use strata_registry::store::{Fault, ObjectMeta, Op, PutMode, StoreBackend, Version};

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

/// A blob of frames of `chunks[f]` chunks each, every frame 100 compressed bytes.
fn toc_of(chunks: &[u32]) -> Toc {
    let mut toc = Toc {
        frames: Vec::new(),
        chunks: Vec::new(),
        view_blocks: 0,
        piece_size: 0,
        pieces: Vec::new(),
    };
    for (f, &n) in chunks.iter().enumerate() {
        toc.frames.push(strata_registry::toc::Frame {
            offset: 100 * f as u64,
            compressed: 100,
            uncompressed: 4096 * n,
        });
        for k in 0..n {
            let block = toc.chunks.len() as u32;
            toc.chunks.push(strata_registry::toc::ChunkEntry {
                block,
                len: 4096,
                frame: f as u32,
                frame_offset: 4096 * k,
                digest: Digest([block as u8; 32]),
            });
        }
    }
    toc
}

#[test]
fn a_miss_claims_its_whole_frame_then_followers_within_the_span() {
    // Frames: [0 1 2] [3] [4 5] [6] [7]; a miss of chunk 1.
    let toc = toc_of(&[3, 1, 2, 1, 1]);
    let none = |_: usize| false;
    // No span: the own frame only, the reader's chunk second.
    assert_eq!(around(&toc, 1, 0, &none), (vec![0, 1, 2], 1));
    // Frames ending within 300 bytes of the own frame's start: frames 1 and 2 follow.
    assert_eq!(around(&toc, 1, 300, &none), (vec![0, 1, 2, 3, 4, 5], 1));
    // Taken chunks of the own frame are left out, the reader's never; a taken chunk inside a
    // follower frame is skipped, and a follower frame that is taken ends the run.
    let taken = |j: usize| matches!(j, 0 | 1 | 5 | 6);
    assert_eq!(around(&toc, 1, 1000, &taken), (vec![1, 2, 3, 4], 0));
    // The last chunk of a blob: nothing follows.
    assert_eq!(around(&toc, 7, 1000, &none), (vec![7], 0));
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
    // Cached now (once the leader's worker kept it): no request at all.
    crate::testkit::wait_until("the chunk kept", || {
        kit.fetcher.cached(&blob, 0).expect("cached").is_some()
    });
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

/// A backend whose streamed reads hand over the first `first` bytes, then wait for the gate to open
/// before handing over the rest; a gate set to fail fails that read and every read after it.
struct Gated {
    inner: Arc<dyn StoreBackend>,
    first: u64,
    gate: Mutex<Option<bool>>,
    cv: Condvar,
}

impl Gated {
    fn open(&self, ok: bool) {
        *self.gate.lock().expect("gate") = Some(ok);
        self.cv.notify_all();
    }
}

impl StoreBackend for Gated {
    fn url(&self) -> &str {
        "gated://"
    }
    fn get(&self, key: &str) -> Result<(bytes::Bytes, Version), StoreError> {
        self.inner.get(key)
    }
    fn get_range(
        &self,
        key: &str,
        range: std::ops::Range<u64>,
        deadline: Duration,
    ) -> Result<bytes::Bytes, StoreError> {
        if *self.gate.lock().expect("gate") == Some(false) {
            return Err(reset(key));
        }
        self.inner.get_range(key, range, deadline)
    }
    fn get_range_streamed(
        &self,
        key: &str,
        range: std::ops::Range<u64>,
        deadline: Duration,
        sink: &mut dyn FnMut(&[u8]),
    ) -> Result<(), StoreError> {
        let all = self.inner.get_range(key, range, deadline)?;
        let cut = (self.first as usize).min(all.len());
        sink(&all[..cut]);
        let gate = self.gate.lock().expect("gate");
        let gate = self
            .cv
            .wait_while(gate, |g| g.is_none())
            .expect("gate wait");
        match *gate {
            Some(true) => {
                sink(&all[cut..]);
                Ok(())
            }
            _ => Err(reset(key)),
        }
    }
    fn head(&self, key: &str) -> Result<Option<ObjectMeta>, StoreError> {
        self.inner.head(key)
    }
    fn put(&self, key: &str, data: bytes::Bytes, mode: PutMode) -> Result<Version, StoreError> {
        self.inner.put(key, data, mode)
    }
    fn list_info(&self, prefix: &str) -> Result<Vec<ObjectMeta>, StoreError> {
        self.inner.list_info(prefix)
    }
    fn delete(&self, key: &str) -> Result<(), StoreError> {
        self.inner.delete(key)
    }
}

fn reset(key: &str) -> StoreError {
    StoreError::Backend {
        url: "gated://".into(),
        key: key.into(),
        source: "connection reset".into(),
    }
}

/// A fetcher that reads ahead (followers) over `kit`'s blobs through a [`Gated`] backend that lets the
/// first follower's frame through and holds the rest.
/// (The cache's directory is returned too: it must outlive the fetcher.)
fn gated(kit: &Kit, blob: &BlobHandle) -> (Arc<Fetcher>, Arc<Gated>, tempfile::TempDir) {
    let f1 = &blob.toc.frames[1];
    let gate = Arc::new(Gated {
        inner: kit.mem.clone(),
        first: f1.compressed as u64,
        gate: Mutex::new(None),
        cv: Condvar::new(),
    });
    let store = Arc::new(Store::with_backend(gate.clone()));
    let dir = tempfile::tempdir().expect("tempdir");
    let cache = ChunkCache::open(dir.path(), 1 << 30).expect("cache");
    let fetcher = Fetcher::new(
        store,
        cache,
        kit.metrics.clone(),
        1 << 20,
        Duration::from_secs(20),
    );
    (Arc::new(fetcher), gate, dir)
}

#[test]
fn followers_are_served_as_their_frames_arrive() {
    let kit = Kit::new(Duration::from_secs(20));
    let chunks: Vec<Vec<u8>> = (0..4).map(|i| bytes(32 << 10, 10 + i)).collect();
    let (blob, _) = kit.blob(&chunks);
    let blob = Arc::new(blob);
    let (fetcher, gate, _dir) = gated(&kit, &blob);
    // Chunk 0 is the leader's own frame; chunks 1..4 follow in one streamed request.
    let got = fetcher.chunk(&blob, 0).expect("chunk 0");
    assert_eq!(read(&got, chunks[0].len()), chunks[0]);
    // Chunk 1's frame is in while the rest of the request is held: its reader does not wait for it.
    let (tx, rx) = std::sync::mpsc::channel();
    let (f, b) = (fetcher.clone(), blob.clone());
    let reader = std::thread::spawn(move || {
        let _ = tx.send(f.chunk(&b, 1).map(|c| read(&c, 32 << 10)));
    });
    let first = rx.recv_timeout(Duration::from_secs(10));
    gate.open(true);
    reader.join().expect("reader");
    assert_eq!(
        first
            .expect("chunk 1 served while the request was still held")
            .expect("chunk 1"),
        chunks[1]
    );
    for (i, want) in chunks.iter().enumerate().skip(2) {
        let got = fetcher.chunk(&blob, i).expect("later follower");
        assert_eq!(read(&got, want.len()), *want);
    }
}

#[test]
fn a_stream_cut_short_fails_only_the_followers_not_yet_in() {
    let kit = Kit::new(Duration::from_secs(20));
    let chunks: Vec<Vec<u8>> = (0..4).map(|i| bytes(32 << 10, 20 + i)).collect();
    let (blob, _) = kit.blob(&chunks);
    let blob = Arc::new(blob);
    let (fetcher, gate, _dir) = gated(&kit, &blob);
    fetcher.chunk(&blob, 0).expect("chunk 0");
    let got = fetcher
        .chunk(&blob, 1)
        .expect("chunk 1 arrived before the cut");
    assert_eq!(read(&got, chunks[1].len()), chunks[1]);
    gate.open(false);
    // Chunk 2 was claimed by the cut request: its reader gets the store's error (waiting for that
    // request, or asking again after it failed: the store fails from now on) and nothing is cached;
    // chunk 1, checked before the cut, stays cached and is served without the store.
    let r = fetcher.chunk(&blob, 2);
    assert!(
        matches!(r, Err(FetchError::Store { .. })),
        "{:?}",
        r.map(|_| ())
    );
    assert!(fetcher.cached(&blob, 2).expect("lookup").is_none());
    assert!(fetcher.cached(&blob, 1).expect("lookup").is_some());
    assert!(fetcher.chunk(&blob, 1).is_ok());
}

#[test]
fn a_corrupt_follower_is_fetched_again_and_the_others_are_served() {
    let kit = Kit::new(Duration::from_secs(5));
    let chunks: Vec<Vec<u8>> = (0..4).map(|i| bytes(32 << 10, 30 + i)).collect();
    let (blob, k) = kit.blob(&chunks);
    let blob = Arc::new(blob);
    let fetcher = Arc::new(Fetcher::new(
        kit.store.clone(),
        kit.fetcher.cache().clone(),
        kit.metrics.clone(),
        1 << 20,
        Duration::from_secs(5),
    ));
    // One byte of chunk 2's frame is flipped on the first read that covers it (the followers' request).
    let f2 = &blob.toc.frames[2];
    kit.faults.inject(
        Fault::corrupt()
            .key(&k)
            .ops(&[Op::GetRange])
            .range(f2.offset + 5..f2.offset + 6)
            .times(1),
    );
    kit.faults.reset_counts();
    fetcher.chunk(&blob, 0).expect("chunk 0");
    // The followers arrive on their own thread: wait for them (no reader asks meanwhile).
    let deadline = Instant::now() + Duration::from_secs(10);
    while (1..4).any(|i| {
        fetcher
            .cached(&blob, i)
            .map(|c| c.is_none())
            .unwrap_or(true)
    }) {
        assert!(Instant::now() < deadline, "followers not cached");
        std::thread::sleep(Duration::from_millis(10));
    }
    // The leader's frame, the followers, and chunk 2's frame once more.
    let ranges = kit.faults.ranges(&k);
    assert_eq!(kit.faults.calls(Op::GetRange, &k), 3, "{ranges:?}");
    let again = f2.offset..f2.offset + f2.compressed as u64;
    assert!(ranges.contains(&again), "{ranges:?}");
    for (i, want) in chunks.iter().enumerate() {
        let got = fetcher.chunk(&blob, i).expect("chunk");
        assert_eq!(read(&got, want.len()), *want, "chunk {i}");
    }
}

#[test]
fn a_miss_fetches_the_missing_chunks_behind_it_in_the_background() {
    let kit = Kit::new(Duration::from_secs(5));
    let chunks: Vec<Vec<u8>> = (0..6).map(|i| bytes(32 << 10, 40 + i)).collect();
    let (blob, k) = kit.blob(&chunks);
    let blob = Arc::new(blob);
    let mut f = Fetcher::new(
        kit.store.clone(),
        kit.fetcher.cache().clone(),
        kit.metrics.clone(),
        1 << 20,
        Duration::from_secs(5),
    );
    // Behind chunk 4: chunks 2 and 3 (within two frames' bytes), not chunk 1 (too far) nor chunk 0.
    f.max_behind = blob.toc.frames[4].offset - blob.toc.frames[2].offset;
    let f = Arc::new(f);
    kit.faults.reset_counts();
    f.chunk(&blob, 4).expect("chunk 4");
    for (i, want) in chunks.iter().enumerate() {
        let got = f.chunk(&blob, i).expect("chunk");
        assert_eq!(read(&got, want.len()), *want, "chunk {i}");
    }
    let ranges = kit.faults.ranges(&k);
    let frame = |i: usize| blob.toc.frames[i].offset;
    let behind = frame(2)..frame(3) + blob.toc.frames[3].compressed as u64;
    assert!(ranges.contains(&behind), "{ranges:?}");
    // Chunk 1 was not fetched behind chunk 4: its own read fetched it (and chunk 0 before it).
    assert!(
        ranges
            .iter()
            .any(|r| r.start == frame(1) || r.start == frame(0)),
        "{ranges:?}"
    );
    // Without a bound nothing is fetched behind.
    assert_eq!(kit.fetcher.max_behind, 0);
}

#[test]
fn landed_waits_for_a_fetch_in_flight_and_never_starts_one() {
    let kit = Kit::new(Duration::from_secs(5));
    let data = bytes(64 << 10, 7);
    let (blob, k) = kit.blob(std::slice::from_ref(&data));
    let blob = Arc::new(blob);
    kit.faults.reset_counts();
    // Neither cached nor in flight: nothing, and no request.
    assert!(kit.fetcher.landed(&blob, 0).expect("landed").is_none());
    assert_eq!(kit.faults.reads(&k), 0, "landed fetched");
    // In flight (a slow fetch by a reader): waited for, then the bytes.
    let slow = kit.faults.inject(
        Fault::delay(Duration::from_millis(200))
            .key(&k)
            .ops(&[Op::GetRange]),
    );
    let reader = {
        let (f, b) = (kit.fetcher.clone(), blob.clone());
        std::thread::spawn(move || f.chunk(&b, 0).map(|c| read(&c, 64 << 10)))
    };
    std::thread::sleep(Duration::from_millis(50));
    let got = kit
        .fetcher
        .landed(&blob, 0)
        .expect("landed")
        .expect("bytes");
    assert_eq!(read(&got, 64 << 10), data);
    assert_eq!(reader.join().expect("reader").expect("chunk"), data);
    assert_eq!(kit.faults.reads(&k), 1, "one request in all");
    kit.faults.remove(slow);
}

#[test]
fn the_background_work_of_every_miss_runs_on_reused_threads() {
    let kit = Kit::new(Duration::from_secs(20));
    let chunks: Vec<Vec<u8>> = (0..30).map(|i| bytes(32 << 10, 40 + i)).collect();
    let (blob, _) = kit.blob(&chunks);
    let blob = Arc::new(blob);
    let dir = tempfile::tempdir().expect("tempdir");
    let cache = ChunkCache::open(dir.path(), 1 << 30).expect("cache");
    // Each miss claims its own frame and the next one or two (the followers, a background job).
    let fetcher = Fetcher::new(
        kit.store.clone(),
        cache,
        kit.metrics.clone(),
        100 << 10,
        Duration::from_secs(20),
    );
    let fetcher = Arc::new(fetcher);
    let mut misses = 0;
    for (i, want) in chunks.iter().enumerate() {
        if fetcher.cached(&blob, i).expect("cached").is_none() {
            misses += 1;
        }
        let got = fetcher.chunk(&blob, i).expect("chunk");
        assert_eq!(read(&got, want.len()), *want);
        // A miss's jobs (its followers' request, keeping its own frame) are over once none is queued
        // and their threads wait again (else the next miss would, rightly, start another thread
        // rather than queue behind a busy one).
        crate::testkit::wait_until("the miss's jobs done", || fetcher.workers().quiet());
    }
    assert!(misses >= 10, "{misses} misses");
    // Two jobs at once at most: the followers' request and the leader's keeping.
    let started = fetcher.workers().started();
    assert!(started <= 2, "{started} threads for {misses} misses");
}

#[test]
fn a_miss_in_a_group_frame_keeps_every_missing_chunk_of_the_frame() {
    let kit = Kit::new(Duration::from_secs(5));
    let small: Vec<Vec<u8>> = (0..4)
        .map(|n| bytes(3000 + n * 500, 40 + n as u64))
        .collect();
    let (blob, k) = kit.group_blob(&small);
    let blob = Arc::new(blob);
    kit.faults.reset_counts();
    // The third file is read first: the frame brings the ones before it too, not only the one after.
    let got = kit.fetcher.chunk(&blob, 2).expect("chunk 2");
    assert_eq!(read(&got, small[2].len()), small[2]);
    for (j, want) in small.iter().enumerate() {
        // The leader keeps its frame's chunks after answering its reader, on a worker.
        let cached = || kit.fetcher.cached(&blob, j).expect("lookup");
        crate::testkit::wait_until("the frame kept", || cached().is_some());
        let c = cached();
        assert_eq!(
            read(&c.expect("kept with the frame"), want.len()),
            *want,
            "chunk {j}"
        );
    }
    assert_eq!(
        kit.faults.calls(Op::GetRange, &k),
        1,
        "one fetch of the frame"
    );
}
