//! Pieces: a large chunk stored as independently compressed frames, each verified on its own.
//!
//! A chunk keeps its identity — the BLAKE3 digest of its bytes — so that dedup, the chunk index and
//! plans are unchanged. But a blob may store a chunk longer than its *piece size* (a power of two,
//! [`PIECE_SIZE`] suggested; `strata build --piece-size`) as several zstd frames, one per piece, so that
//! a reader who wants a few pages of a 1 MiB chunk fetches, decompresses and verifies 64 KiB instead of
//! the whole chunk.
//!
//! **Off by default, by measurement** (BENCHMARKS.md, "Pieces"): pieces cost ~6 % of stored bytes at
//! 64 KiB (each piece compresses alone), and on the fat image's cold `import numpy, pandas` they saved
//! nothing locally and cost ~10 % over a 20 ms link (more, smaller misses; a miss's fixed cost, not its
//! decompression, dominates there). They pay where reads are scattered pages of large files: 400 random
//! page reads across four large files took 28 % less locally.
//!
//! **Verifying a piece against its chunk's digest.** BLAKE3 is a tree hash over 1 KiB chunks, and a
//! piece of a power-of-two size at a multiple of that size in its chunk is a whole subtree of the chunk's
//! tree. Its *chaining value* (the subtree's hash, [`chaining_value`]) depends only on its bytes and its
//! offset. The table of contents records each piece's chaining value (an outboard tree of 32 bytes per
//! 64 KiB: 0.05 % of the data), and [`chunk_matches`] checks that a chunk's recorded chaining values
//! combine, as BLAKE3's tree does, into the chunk's digest; the TOC decoder runs that check for every
//! pieced chunk, so a table of contents whose pieces are not its chunks' never decodes. A fetched piece
//! is then checked against its chaining value: that proves the bytes are that piece of that chunk.
//!
//! **Keys.** A piece also has a *key*: the plain BLAKE3 digest of its bytes. Node caches name and
//! re-check what they hold by a digest of the bytes alone (a cache cannot know a piece's offset when it
//! finds a stray entry on disk), so the fetcher checks a fetched piece against both, its chaining value
//! and its key, before it caches it under its key. Two hashes of 64 KiB cost ~40 µs; decompressing and
//! hashing the rest of a 1 MiB chunk costs ~1 ms.
//!
//! **Units.** What the node fetches and caches are *units*: a chunk stored whole, or one piece of a
//! pieced chunk. [`units`] expands a table of contents into its units, in view order, each with the
//! chaining value check a piece needs. A blob without pieces has exactly its chunks as units, so plans and
//! caches from before pieces keep their meaning.

use std::ops::Range;

use blake3::hazmat::{self, ChainingValue, HasherExt, Mode};

use crate::digest::Digest;
use crate::toc::{ChunkEntry, Toc};

/// The suggested piece size: the bytes a miss fetches, decompresses and verifies at least.
pub const PIECE_SIZE: u32 = 64 << 10;
/// Smallest piece size: a whole number of view blocks and of BLAKE3's 1 KiB chunks, and no shorter than
/// the chunks builders group into shared frames (below 64 KiB), so that no grouped chunk is pieced.
pub const MIN_PIECE: u32 = 64 << 10;
/// Largest piece size (the largest chunk).
pub const MAX_PIECE: u32 = 16 << 20;

/// One piece of a pieced chunk, as the table of contents records it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Piece {
    /// BLAKE3 of the piece's bytes: its name in node caches.
    pub key: Digest,
    /// The piece's chaining value in its chunk's BLAKE3 tree.
    pub cv: ChainingValue,
}

/// Whether `size` is a valid piece size (a power of two in [`MIN_PIECE`]..=[`MAX_PIECE`]).
pub fn valid_size(size: u32) -> bool {
    size.is_power_of_two() && (MIN_PIECE..=MAX_PIECE).contains(&size)
}

/// How many pieces a chunk of `len` bytes has at piece size `size` (0: it is stored whole).
pub fn count(len: u32, size: u32) -> usize {
    match size > 0 && len > size {
        true => len.div_ceil(size) as usize,
        false => 0,
    }
}

/// The chaining value of `bytes`, the piece at `offset` of its chunk (a multiple of the piece size).
pub fn chaining_value(bytes: &[u8], offset: u64) -> ChainingValue {
    let mut h = blake3::Hasher::new();
    h.set_input_offset(offset);
    h.update(bytes);
    h.finalize_non_root()
}

/// Cuts `data` (a chunk longer than `size`) into pieces: each one's range in `data` and record.
pub fn cut(data: &[u8], size: u32) -> Vec<(Range<usize>, Piece)> {
    let size = size as usize;
    (0..data.len())
        .step_by(size)
        .map(|at| {
            let r = at..(at + size).min(data.len());
            let bytes = &data[r.clone()];
            let piece = Piece {
                key: Digest::of(bytes),
                cv: chaining_value(bytes, at as u64),
            };
            (r, piece)
        })
        .collect()
}

/// The chaining value (or, with `root`, the hash) of the subtree of `len` bytes whose pieces of `size`
/// bytes have the chaining values `cvs` (`cvs.len() == len.div_ceil(size)`, `len > size` when `root`).
fn subtree(cvs: &[ChainingValue], len: u64, size: u64, root: bool) -> ChainingValue {
    if cvs.len() == 1 {
        return cvs[0];
    }
    // BLAKE3's left subtree is the largest power of two of 1 KiB chunks below the length: at least one
    // piece, and a whole number of them.
    let left = hazmat::left_subtree_len(len);
    let n = (left / size) as usize;
    let l = subtree(&cvs[..n], left, size, false);
    let r = subtree(&cvs[n..], len - left, size, false);
    match root {
        true => *hazmat::merge_subtrees_root(&l, &r, Mode::Hash).as_bytes(),
        false => hazmat::merge_subtrees_non_root(&l, &r, Mode::Hash),
    }
}

/// Whether the chaining values `cvs` of the pieces (of `size` bytes, the last one shorter) of a chunk of
/// `len` bytes combine into the chunk's `digest`.
pub fn chunk_matches(digest: &Digest, len: u32, size: u32, cvs: &[ChainingValue]) -> bool {
    if cvs.len() != count(len, size) || cvs.len() < 2 {
        return false;
    }
    combine(cvs, u64::from(len), u64::from(size)) == *digest
}

/// The BLAKE3 digest of `len` bytes from the chaining values `cvs` of their pieces of `size` bytes (a
/// power of two of at least 1 KiB; the last piece shorter; at least two pieces).
pub fn combine(cvs: &[ChainingValue], len: u64, size: u64) -> Digest {
    debug_assert!(cvs.len() >= 2 && cvs.len() as u64 == len.div_ceil(size));
    Digest(subtree(cvs, len, size, true))
}

/// What checks a unit's bytes besides its key: a piece's chaining value and offset in its chunk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PieceCheck {
    pub cv: ChainingValue,
    pub offset: u64,
}

impl PieceCheck {
    /// Whether `bytes` are this piece.
    pub fn matches(&self, bytes: &[u8]) -> bool {
        chaining_value(bytes, self.offset) == self.cv
    }
}

/// `toc` as units: a table of contents whose chunks are the blob's chunks stored whole and the pieces of
/// its pieced chunks (each named by its key, in its own frame), and for each unit its piece check
/// (`None` for a whole chunk). A blob without pieces comes back as it is (not copied), with no checks.
pub fn units(toc: Toc) -> (Toc, Vec<Option<PieceCheck>>) {
    if toc.pieces.is_empty() {
        return (toc, Vec::new());
    }
    let mut chunks = Vec::with_capacity(toc.chunks.len() + toc.pieces.len());
    let mut checks = Vec::with_capacity(chunks.capacity());
    for (i, c) in toc.chunks.iter().enumerate() {
        let pieces = toc.pieces_of(i);
        if pieces.is_empty() {
            chunks.push(*c);
            checks.push(None);
            continue;
        }
        let size = toc.piece_size;
        for (k, (_, p)) in pieces.iter().enumerate() {
            let offset = k as u32 * size;
            chunks.push(ChunkEntry {
                block: c.block + offset / crate::toc::BLOCK_SIZE as u32,
                len: (c.len - offset).min(size),
                frame: c.frame + k as u32,
                frame_offset: 0,
                digest: p.key,
            });
            checks.push(Some(PieceCheck {
                cv: p.cv,
                offset: u64::from(offset),
            }));
        }
    }
    let unit_toc = Toc {
        frames: toc.frames,
        chunks,
        view_blocks: toc.view_blocks,
        ..Toc::default()
    };
    (unit_toc, checks)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn data(len: usize, seed: u32) -> Vec<u8> {
        (0..len as u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) ^ seed) as u8)
            .collect()
    }

    /// The chaining values of `d`'s pieces.
    fn cvs(d: &[u8], size: u32) -> Vec<ChainingValue> {
        cut(d, size).into_iter().map(|(_, p)| p.cv).collect()
    }

    #[test]
    fn a_megabyte_chunk_in_64k_pieces_matches_its_digest() {
        let d = data(1 << 20, 7);
        let ps = cvs(&d, PIECE_SIZE);
        assert_eq!(ps.len(), 16);
        assert!(chunk_matches(
            &Digest::of(&d),
            d.len() as u32,
            PIECE_SIZE,
            &ps
        ));
    }

    #[test]
    fn a_wrong_piece_or_order_does_not_match() {
        let d = data(300_000, 1);
        let digest = Digest::of(&d);
        let mut ps = cvs(&d, PIECE_SIZE);
        ps.swap(0, 1);
        assert!(!chunk_matches(&digest, d.len() as u32, PIECE_SIZE, &ps));
        ps.swap(0, 1);
        ps[4][0] ^= 1;
        assert!(!chunk_matches(&digest, d.len() as u32, PIECE_SIZE, &ps));
        ps[4][0] ^= 1;
        // A length claimed one byte short still combines (the tree's shape is the same): the length is
        // proved when the last piece's bytes are checked against its chaining value, which covers them.
        assert!(chunk_matches(&digest, d.len() as u32 - 1, PIECE_SIZE, &ps));
        let last = cut(&d, PIECE_SIZE).pop().expect("pieces").0;
        let short = &d[last.start..last.end - 1];
        let check = PieceCheck {
            cv: ps[4],
            offset: last.start as u64,
        };
        assert!(!check.matches(short));
        assert!(!chunk_matches(
            &digest,
            d.len() as u32,
            PIECE_SIZE,
            &ps[..4]
        ));
    }

    #[test]
    fn a_piece_is_checked_at_its_offset_only() {
        let d = data(200_000, 3);
        let cut = cut(&d, PIECE_SIZE);
        let (r, p) = &cut[1];
        let check = PieceCheck {
            cv: p.cv,
            offset: r.start as u64,
        };
        assert!(check.matches(&d[r.clone()]));
        // The same bytes as the first piece, or the right piece with a flipped byte, fail.
        assert!(!PieceCheck { offset: 0, ..check }.matches(&d[r.clone()]));
        let mut bad = d[r.clone()].to_vec();
        bad[100] ^= 1;
        assert!(!check.matches(&bad));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        /// Any chunk length past one piece, any valid piece size: the pieces' chaining values combine
        /// into BLAKE3 of the whole chunk, and each piece checks at its own offset.
        #[test]
        fn pieces_always_combine_into_the_digest(len in 4097usize..(3 << 20), shift in 10u32..=20) {
            let size = 1u32 << shift;
            prop_assume!(len > size as usize);
            let d = data(len, len as u32);
            let cut = cut(&d, size);
            prop_assert_eq!(cut.len(), count(len as u32, size));
            for (r, p) in &cut {
                let check = PieceCheck { cv: p.cv, offset: r.start as u64 };
                prop_assert!(check.matches(&d[r.clone()]));
                prop_assert!(p.key.matches(&d[r.clone()]));
            }
            let ps: Vec<ChainingValue> = cut.into_iter().map(|(_, p)| p.cv).collect();
            prop_assert!(chunk_matches(&Digest::of(&d), len as u32, size, &ps));
        }
    }
}
