//! The fetcher over pieced chunks: a miss waits for one piece (fetched, decompressed and verified alone)
//! while the chunk's earlier pieces come behind it, and a piece is served only when it is its chunk's
//! (its chaining value), whatever its key says.

use std::sync::Arc;
use std::time::Duration;

use strata_registry::pieces::PIECE_SIZE;
use strata_registry::store::Op;

use crate::testkit::{bytes, Kit};

const PIECE: usize = PIECE_SIZE as usize;

#[test]
fn a_miss_in_a_pieced_chunk_waits_for_one_piece_and_brings_those_behind() {
    let kit = Kit::new(Duration::from_secs(5));
    let big = bytes(1 << 20, 1);
    let small = bytes(10_000, 2);
    let (blob, k) = kit.pieced_blob(&[big.clone(), small.clone()], PIECE_SIZE, None);
    let blob = Arc::new(blob);
    assert_eq!(blob.toc.chunks.len(), 17, "16 pieces and a whole chunk");
    assert_eq!(blob.chunk_units(0), 0..16);
    assert_eq!(blob.chunk_units(16), 16..17);
    kit.faults.reset_counts();
    let got = kit.fetcher.chunk(&blob, 5).expect("piece 5");
    let mut buf = vec![0u8; PIECE];
    got.read_at(&mut buf, 0).expect("read");
    assert_eq!(buf, big[5 * PIECE..6 * PIECE]);
    // The chunk's earlier pieces follow in the background (a whole chunk's reader would have them);
    // nothing after piece 5 (the kit fetches no followers).
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while (0..5).any(|j| kit.fetcher.cached(&blob, j).expect("lookup").is_none()) {
        assert!(
            std::time::Instant::now() < deadline,
            "earlier pieces never came"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(
        kit.faults.calls(Op::GetRange, &k),
        2,
        "own piece, then the ones behind"
    );
    let fetched = kit.metrics.fetched_bytes(&blob.blob.digest);
    let frames: u64 = (0..6)
        .map(|f| u64::from(blob.toc.frames[f].compressed))
        .sum();
    assert_eq!(fetched, frames, "pieces 0 to 5, not the chunk");
    for j in 6..16 {
        assert!(
            kit.fetcher.cached(&blob, j).expect("lookup").is_none(),
            "piece {j}"
        );
    }
    let tail = kit.fetcher.chunk(&blob, 16).expect("whole chunk");
    let mut buf = vec![0u8; small.len()];
    tail.read_at(&mut buf, 0).expect("read");
    assert_eq!(buf, small);
}

#[test]
fn a_piece_whose_key_lies_is_never_served_or_cached() {
    let kit = Kit::new(Duration::from_secs(5));
    let big = bytes(1 << 20, 3);
    // Piece 3 stored as other bytes, named by their own key: they pass the key, not the chaining value.
    let forged = vec![7u8; PIECE];
    let (blob, _) = kit.pieced_blob(std::slice::from_ref(&big), PIECE_SIZE, Some((0, 3, forged)));
    let blob = Arc::new(blob);
    let err = kit.fetcher.chunk(&blob, 3).err().expect("refused");
    assert!(
        matches!(err, crate::fetch::FetchError::Corrupt { .. }),
        "{err}"
    );
    assert!(kit.fetcher.cached(&blob, 3).expect("lookup").is_none());
    // Its neighbours are sound.
    let got = kit.fetcher.chunk(&blob, 2).expect("piece 2");
    let mut buf = vec![0u8; PIECE];
    got.read_at(&mut buf, 0).expect("read");
    assert_eq!(buf, big[2 * PIECE..3 * PIECE]);
}
