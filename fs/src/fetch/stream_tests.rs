//! The streamer: which chunks a step takes, where cursors go, and a real stream through the fetcher.

use std::time::Duration;

use super::*;
use crate::testkit::{bytes, wait_until, Kit};
use strata_registry::digest::Digest;
use strata_registry::toc::{ChunkEntry, Frame, Toc};

/// A blob whose frames hold `chunks[f]` chunks each, every frame 100 compressed bytes.
fn handle(chunks: &[u32]) -> Arc<BlobHandle> {
    let mut toc = Toc::default();
    for (f, &n) in chunks.iter().enumerate() {
        toc.frames.push(Frame {
            offset: 100 * f as u64,
            compressed: 100,
            uncompressed: 4096 * n,
        });
        for k in 0..n {
            let block = toc.chunks.len() as u32;
            toc.chunks.push(ChunkEntry {
                block,
                len: 4096,
                frame: f as u32,
                frame_offset: 4096 * k,
                digest: Digest([block as u8; 32]),
            });
        }
    }
    let blob = strata_registry::model::BlobRef {
        digest: Digest([7; 32]),
        size: 100 * chunks.len() as u64,
        view_size: 4096 * toc.chunks.len() as u64,
        toc_offset: 100 * chunks.len() as u64,
        toc_len: 0,
        toc_digest: Digest([0; 32]),
        chunks: toc.chunks.len() as u64,
    };
    Arc::new(BlobHandle::new(&blob, toc))
}

#[test]
fn a_step_counts_each_frame_once_and_takes_at_least_one_chunk() {
    // Frames: [0 1 2] [3] [4 5] [6].
    let b = handle(&[3, 1, 2, 1]);
    assert_eq!(next_run(&b, 0, 100), (vec![0, 1, 2], 100));
    assert_eq!(next_run(&b, 1, 200), (vec![1, 2, 3], 200));
    assert_eq!(next_run(&b, 3, 1), (vec![3], 100));
    assert_eq!(next_run(&b, 0, 10_000), ((0..7).collect(), 400));
    assert_eq!(next_run(&b, 7, 100), (vec![], 0));
}

fn cursors(s: &State) -> Vec<(usize, u64)> {
    s.cursors.iter().map(|c| (c.next, c.left)).collect()
}

#[test]
fn the_latest_miss_goes_first_and_moves_a_cursor_it_falls_in() {
    let (a, b) = (handle(&[1; 8000]), handle(&[1; 10]));
    let mut s = State::default();
    assert!(s.place(&a, 10, 1000, 0), "the first cursor starts a thread");
    assert!(!s.place(&b, 3, 1000, 0), "one thread at a time");
    assert_eq!(cursors(&s), [(3, 1000), (10, 1000)]);
    // Within a's cursor's stretch (offsets 1,000..2,000): that cursor moves, renewed, to the front.
    s.place(&a, 15, 1000, 0);
    assert_eq!(cursors(&s), [(15, 1000), (3, 1000)]);
    // Far past it: a new region.
    for (k, at) in [5000, 6000, 7000].into_iter().enumerate() {
        s.place(&a, at, 1000, 0);
        assert_eq!(s.cursors.len(), (3 + k).min(CURSORS));
    }
    assert_eq!(cursors(&s)[0], (7000, 1000));
    assert_eq!(
        cursors(&s)[CURSORS - 1],
        (15, 1000),
        "the oldest cursor dropped"
    );
    // A cursor stepped goes back behind later ones, before earlier ones.
    let mut c = s.take().expect("a cursor");
    assert_eq!(c.next, 7000);
    c.next = 7003;
    s.place(&b, 5, 1000, 0);
    s.requeue(c);
    assert_eq!(cursors(&s)[..2], [(5, 1000), (7003, 1000)]);
    // No cursor left: the thread ends, and the next miss starts one.
    while s.take().is_some() {}
    assert!(!s.running);
    assert!(s.place(&a, 1, 1000, 0));
}

/// A blob of `chunks` in `kit`'s store, and a fetcher of its own over it that fetches a miss's frame
/// alone (span 1), for a test to set `max_stream` on.
fn fetcher_of(kit: &Kit, chunks: &[Vec<u8>]) -> (Arc<BlobHandle>, Fetcher) {
    let (blob, _) = kit.blob(chunks);
    let f = Fetcher::new(
        kit.store.clone(),
        kit.fetcher.cache().clone(),
        kit.metrics.clone(),
        1,
        Duration::from_secs(5),
    );
    (Arc::new(blob), f)
}

#[test]
fn a_miss_streams_the_chunks_after_it_within_the_bound() {
    let kit = Kit::new(Duration::from_secs(5));
    let chunks: Vec<Vec<u8>> = (0..20).map(|i| bytes(32 << 10, 60 + i)).collect();
    let (blob, mut f) = fetcher_of(&kit, &chunks);
    // From chunk 2 (after the miss of chunk 1), frames 2..=13 end within this bound: ~384 KiB of
    // random data, more than one step's, so the cursor is stepped, requeued and stepped again.
    let frame = |i: usize| blob.toc.frames[i].offset;
    f.max_stream = frame(14) - frame(2);
    assert!(f.max_stream > UNIT);
    let f = Arc::new(f);
    f.chunk(&blob, 1).expect("chunk 1");
    let cached = |i: usize| f.cache().contains(&blob.toc.chunks[i].digest);
    wait_until("chunks 2..=13 streamed", || (2..=13).all(cached));
    wait_until("the streamer stopped", || !f.streamer.lock().running);
    assert!(
        !cached(0) && !(14..20).any(cached),
        "nothing outside the bound"
    );
    let text = kit.metrics.render(&Default::default());
    let streamed = frame(14) - frame(2);
    assert!(
        text.contains(&format!("strata_streamed_bytes_total {streamed}\n")),
        "{text}"
    );
    for (i, want) in chunks.iter().enumerate() {
        let got = f.chunk(&blob, i).expect("chunk");
        let mut v = vec![0u8; want.len()];
        got.read_at(&mut v, 0).expect("read");
        assert_eq!(v, *want, "chunk {i}");
    }
}

#[test]
fn a_planned_blob_streams_nothing() {
    let kit = Kit::new(Duration::from_secs(5));
    let chunks: Vec<Vec<u8>> = (0..6).map(|i| bytes(32 << 10, 80 + i)).collect();
    let (blob, mut f) = fetcher_of(&kit, &chunks);
    f.max_stream = 1 << 30;
    let f = Arc::new(f);
    f.set_planned(&[blob.blob.digest], true);
    f.chunk(&blob, 0).expect("chunk 0");
    std::thread::sleep(Duration::from_millis(100));
    assert!(!f.streamer.lock().running);
    assert!((1..6).all(|i| !f.cache().contains(&blob.toc.chunks[i].digest)));
}
