//! A blob's table of contents and the chunk codec.
//!
//! A blob object is a run of zstd frames, then its table of contents (TOC), then a 64-byte footer:
//!
//! ```text
//! [frame 0][frame 1]...[frame n-1][TOC][footer]
//! ```
//!
//! Each frame holds one chunk, or a small group of consecutive tiny chunks (file tails, small files), so
//! that tiny files compress together. The TOC maps every chunk to its place in the blob's *uncompressed
//! view* — the address space the kernel reads through the EROFS device table, where each chunk starts on a
//! 4 KiB block — and to the frame holding it and its digest. A reader needs the TOC (one range read,
//! verified against the digest the layer descriptor records) and then one range read per frame run; every
//! chunk is checked against its BLAKE3 digest before use.
//!
//! A chunk longer than the blob's *piece size* may instead be stored as several frames, one per piece,
//! each verified on its own against the chunk's digest ([`crate::pieces`]): a reader of a few pages then
//! fetches and decompresses one piece, not the whole chunk.
//!
//! TOC encoding (little endian): magic `STRATOC1`, `version u32` (1: no pieces, 2: pieces), `frames
//! u32`, `chunks u32`, `piece_size u32` (0 in version 1), `view_blocks u64`; then `frames` records of
//! `offset u64, compressed u32, uncompressed u32`; then `chunks` records sorted by block of `block u32,
//! len u32, frame u32, frame_offset u32, digest [32]`; then, in version 2, a record of `key [32], cv
//! [32]` for every piece of every chunk longer than `piece_size`, in chunk order. Such a chunk's record
//! names its first frame (offset 0); its pieces are that frame and the ones after it, one each. Footer:
//! magic `STRATBLB`, `version u32`, `reserved u32`, `toc_offset u64`, `toc_len u64`, `toc digest [32]`.

use crate::digest::Digest;
use crate::pieces::{self, Piece};

/// EROFS block size: chunk positions in the uncompressed view are multiples of it.
pub const BLOCK_SIZE: u64 = 4096;
/// Size of the blob footer.
pub const FOOTER_LEN: usize = 64;

const TOC_MAGIC: &[u8; 8] = b"STRATOC1";
const FOOTER_MAGIC: &[u8; 8] = b"STRATBLB";
const TOC_HEADER: usize = 32;
const FRAME_REC: usize = 16;
const CHUNK_REC: usize = 48;
const PIECE_REC: usize = 64;

/// One zstd frame in the blob object.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Frame {
    /// Byte offset of the frame in the blob object.
    pub offset: u64,
    /// Compressed length.
    pub compressed: u32,
    /// Decompressed length.
    pub uncompressed: u32,
}

/// One chunk in the blob's uncompressed view.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChunkEntry {
    /// First 4 KiB block of the chunk in the uncompressed view.
    pub block: u32,
    /// Uncompressed length in bytes.
    pub len: u32,
    /// Index of the frame holding it.
    pub frame: u32,
    /// Offset of the chunk in the decompressed frame.
    pub frame_offset: u32,
    /// BLAKE3 of the uncompressed bytes.
    pub digest: Digest,
}

impl ChunkEntry {
    /// Number of view blocks the chunk occupies.
    pub fn blocks(&self) -> u64 {
        (self.len as u64).div_ceil(BLOCK_SIZE)
    }
}

/// Why a TOC or footer could not be decoded.
#[derive(Debug, thiserror::Error)]
pub enum TocError {
    #[error("blob table of contents is malformed: {0}")]
    Malformed(&'static str),
    #[error("blob footer is malformed: {0}")]
    Footer(&'static str),
    #[error("chunk {digest} failed verification: {why}")]
    BadChunk { digest: Digest, why: String },
}

/// A blob's table of contents.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Toc {
    pub frames: Vec<Frame>,
    /// Sorted by `block`, non-overlapping.
    pub chunks: Vec<ChunkEntry>,
    /// Size of the uncompressed view in blocks.
    pub view_blocks: u64,
    /// Piece size: every chunk longer than this is stored in pieces (0: none is).
    pub piece_size: u32,
    /// The pieces of every chunk longer than `piece_size`, in chunk order, each with its chunk's index.
    pub pieces: Vec<(u32, Piece)>,
}

/// Where the TOC sits, as the footer (and the layer descriptor) records it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Footer {
    pub toc_offset: u64,
    pub toc_len: u64,
    pub toc_digest: Digest,
}

fn u32_at(b: &[u8], off: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[off..off + 4]);
    u32::from_le_bytes(a)
}

fn u64_at(b: &[u8], off: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[off..off + 8]);
    u64::from_le_bytes(a)
}

impl Toc {
    /// Size of the uncompressed view in bytes.
    pub fn view_size(&self) -> u64 {
        self.view_blocks * BLOCK_SIZE
    }

    /// The chunk covering view block `block`, if any.
    pub fn chunk_at(&self, block: u64) -> Option<usize> {
        let i = self.chunks.partition_point(|c| (c.block as u64) <= block);
        let i = i.checked_sub(1)?;
        let c = &self.chunks[i];
        (block < c.block as u64 + c.blocks()).then_some(i)
    }

    /// The pieces of chunk `i` (empty: it is stored whole).
    pub fn pieces_of(&self, i: usize) -> &[(u32, Piece)] {
        let i = i as u32;
        let lo = self.pieces.partition_point(|(c, _)| *c < i);
        let hi = self.pieces.partition_point(|(c, _)| *c <= i);
        &self.pieces[lo..hi]
    }

    /// The frames holding chunk `i`: its frame, or the frames of its pieces.
    pub fn frames_of(&self, i: usize) -> std::ops::Range<usize> {
        let c = &self.chunks[i];
        let n = pieces::count(c.len, self.piece_size).max(1);
        c.frame as usize..c.frame as usize + n
    }

    /// Encodes the TOC (version 1 when it has no piece size, so that older readers read it).
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(
            TOC_HEADER
                + self.frames.len() * FRAME_REC
                + self.chunks.len() * CHUNK_REC
                + self.pieces.len() * PIECE_REC,
        );
        let version: u32 = match self.piece_size {
            0 => 1,
            _ => 2,
        };
        out.extend_from_slice(TOC_MAGIC);
        out.extend_from_slice(&version.to_le_bytes());
        out.extend_from_slice(&(self.frames.len() as u32).to_le_bytes());
        out.extend_from_slice(&(self.chunks.len() as u32).to_le_bytes());
        out.extend_from_slice(&self.piece_size.to_le_bytes());
        out.extend_from_slice(&self.view_blocks.to_le_bytes());
        for f in &self.frames {
            out.extend_from_slice(&f.offset.to_le_bytes());
            out.extend_from_slice(&f.compressed.to_le_bytes());
            out.extend_from_slice(&f.uncompressed.to_le_bytes());
        }
        for c in &self.chunks {
            out.extend_from_slice(&c.block.to_le_bytes());
            out.extend_from_slice(&c.len.to_le_bytes());
            out.extend_from_slice(&c.frame.to_le_bytes());
            out.extend_from_slice(&c.frame_offset.to_le_bytes());
            out.extend_from_slice(&c.digest.0);
        }
        for (_, p) in &self.pieces {
            out.extend_from_slice(&p.key.0);
            out.extend_from_slice(&p.cv);
        }
        out
    }

    /// Decodes and checks a TOC: records in bounds, chunks sorted, inside their frames and the view, and
    /// every pieced chunk's pieces in frames of their own, combining into the chunk's digest.
    pub fn decode(b: &[u8]) -> Result<Toc, TocError> {
        use TocError::Malformed as M;
        if b.len() < TOC_HEADER || &b[..8] != TOC_MAGIC {
            return Err(M("bad magic"));
        }
        let piece_size = match (u32_at(b, 8), u32_at(b, 20)) {
            (1, _) => 0,
            (2, size) if pieces::valid_size(size) => size,
            (2, _) => return Err(M("piece size not a power of two from 64 KiB to 16 MiB")),
            _ => return Err(M("unknown version")),
        };
        let nframes = u32_at(b, 12) as usize;
        let nchunks = u32_at(b, 16) as usize;
        let view_blocks = u64_at(b, 24);
        // An EROFS device counts its blocks in 32 bits; past that, the view's size in bytes could
        // also overflow (found by `fuzzing::toc`).
        if view_blocks > u64::from(u32::MAX) {
            return Err(M(
                "view larger than an EROFS device can address (2^32 blocks)",
            ));
        }
        let records = nframes
            .checked_mul(FRAME_REC)
            .and_then(|f| nchunks.checked_mul(CHUNK_REC).map(|c| (f, c)))
            .and_then(|(f, c)| f.checked_add(c))
            .and_then(|n| n.checked_add(TOC_HEADER))
            .ok_or(M("record counts overflow"))?;
        if b.len() < records {
            return Err(M("length does not match record counts"));
        }
        let frames: Vec<Frame> = (0..nframes)
            .map(|i| {
                let o = TOC_HEADER + i * FRAME_REC;
                Frame {
                    offset: u64_at(b, o),
                    compressed: u32_at(b, o + 8),
                    uncompressed: u32_at(b, o + 12),
                }
            })
            .collect();
        let base = TOC_HEADER + nframes * FRAME_REC;
        let chunks: Vec<ChunkEntry> = (0..nchunks)
            .map(|i| chunk_record(&b[base + i * CHUNK_REC..base + (i + 1) * CHUNK_REC]))
            .collect();
        let npieces: usize = chunks
            .iter()
            .map(|c| pieces::count(c.len, piece_size))
            .sum();
        if npieces
            .checked_mul(PIECE_REC)
            .and_then(|n| n.checked_add(records))
            != Some(b.len())
        {
            return Err(M("length does not match record counts"));
        }
        let mut toc = Toc {
            frames,
            chunks,
            view_blocks,
            piece_size,
            pieces: Vec::with_capacity(npieces),
        };
        let mut at = records;
        for i in 0..toc.chunks.len() {
            for _ in 0..pieces::count(toc.chunks[i].len, piece_size) {
                let mut key = [0u8; 32];
                key.copy_from_slice(&b[at..at + 32]);
                let mut cv = [0u8; 32];
                cv.copy_from_slice(&b[at + 32..at + PIECE_REC]);
                toc.pieces.push((
                    i as u32,
                    Piece {
                        key: Digest(key),
                        cv,
                    },
                ));
                at += PIECE_REC;
            }
        }
        toc.check()?;
        Ok(toc)
    }

    /// Checks decoded records: chunks sorted, within the view and their frames, pieces sound.
    fn check(&self) -> Result<(), TocError> {
        use TocError::Malformed as M;
        let mut next_free = 0u64;
        for (i, c) in self.chunks.iter().enumerate() {
            self.check_frames(i)?;
            if (c.block as u64) < next_free {
                return Err(M("chunks unsorted or overlapping"));
            }
            next_free = c.block as u64 + c.blocks().max(1);
            if next_free > self.view_blocks {
                return Err(M("chunk beyond the view"));
            }
        }
        Ok(())
    }

    /// Checks that chunk `i` lies within its frame, or that its pieces fill frames of their own and
    /// combine into its digest.
    fn check_frames(&self, i: usize) -> Result<(), TocError> {
        use TocError::Malformed as M;
        let c = &self.chunks[i];
        let pieces = self.pieces_of(i);
        if pieces.is_empty() {
            let frame = self
                .frames
                .get(c.frame as usize)
                .ok_or(M("chunk names a missing frame"))?;
            if c.frame_offset as u64 + c.len as u64 > frame.uncompressed as u64 {
                return Err(M("chunk extends past its frame"));
            }
            return Ok(());
        }
        let frames = self
            .frames
            .get(self.frames_of(i))
            .ok_or(M("pieced chunk names missing frames"))?;
        let size = self.piece_size;
        let sizes_fit = frames
            .iter()
            .enumerate()
            .all(|(k, f)| f.uncompressed == (c.len - k as u32 * size).min(size));
        if c.frame_offset != 0 || !sizes_fit {
            return Err(M("pieces do not fill frames of their own"));
        }
        let cvs: Vec<_> = pieces.iter().map(|(_, p)| p.cv).collect();
        if !pieces::chunk_matches(&c.digest, c.len, size, &cvs) {
            return Err(M("pieces do not combine into their chunk's digest"));
        }
        Ok(())
    }
}

fn chunk_record(r: &[u8]) -> ChunkEntry {
    let mut d = [0u8; 32];
    d.copy_from_slice(&r[16..48]);
    ChunkEntry {
        block: u32_at(r, 0),
        len: u32_at(r, 4),
        frame: u32_at(r, 8),
        frame_offset: u32_at(r, 12),
        digest: Digest(d),
    }
}

impl Footer {
    /// Encodes the footer.
    pub fn encode(&self) -> [u8; FOOTER_LEN] {
        let mut out = [0u8; FOOTER_LEN];
        out[..8].copy_from_slice(FOOTER_MAGIC);
        out[8..12].copy_from_slice(&1u32.to_le_bytes());
        out[16..24].copy_from_slice(&self.toc_offset.to_le_bytes());
        out[24..32].copy_from_slice(&self.toc_len.to_le_bytes());
        out[32..64].copy_from_slice(&self.toc_digest.0);
        out
    }

    /// Decodes a footer (the last [`FOOTER_LEN`] bytes of a blob object of `blob_len` bytes).
    pub fn decode(b: &[u8], blob_len: u64) -> Result<Footer, TocError> {
        use TocError::Footer as F;
        if b.len() != FOOTER_LEN || &b[..8] != FOOTER_MAGIC {
            return Err(F("bad magic"));
        }
        if u32_at(b, 8) != 1 {
            return Err(F("unknown version"));
        }
        let mut d = [0u8; 32];
        d.copy_from_slice(&b[32..64]);
        let f = Footer {
            toc_offset: u64_at(b, 16),
            toc_len: u64_at(b, 24),
            toc_digest: Digest(d),
        };
        let end = f.toc_offset.checked_add(f.toc_len).ok_or(F("overflow"))?;
        if end.checked_add(FOOTER_LEN as u64) != Some(blob_len) {
            return Err(F("table of contents does not end at the footer"));
        }
        Ok(f)
    }
}

/// Compresses one frame's bytes with zstd at `level`.
pub fn compress(data: &[u8], level: i32) -> Vec<u8> {
    // Compressing from memory into memory cannot fail short of allocation failure.
    zstd::bulk::compress(data, level).unwrap_or_else(|_| Vec::new())
}

/// Why a frame did not decompress to what its table of contents says.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    #[error("not a valid zstd frame of at most {len} bytes: {source}")]
    Zstd {
        len: usize,
        #[source]
        source: std::io::Error,
    },
    #[error("frame decompressed to {got} bytes, expected {expected}")]
    Length { got: usize, expected: usize },
}

thread_local! {
    /// Each thread's zstd decompression context, made on its first frame and reused: a context is
    /// ~100 KiB of tables that `zstd::bulk::decompress` would allocate and set up again per frame.
    static DCTX: std::cell::RefCell<Option<zstd::bulk::Decompressor<'static>>> =
        const { std::cell::RefCell::new(None) };
}

/// Decompresses a frame that must hold exactly `len` bytes (on this thread's reused context).
pub fn decompress(frame: &[u8], len: usize) -> Result<Vec<u8>, FrameError> {
    let mut out = vec![0u8; len];
    decompress_into(frame, &mut out)?;
    Ok(out)
}

/// [`decompress`] straight into a shared allocation: what a node keeps in memory and hands to readers
/// is then the decompressed buffer itself, not a copy of it (a `Vec` turned into an `Arc<[u8]>` is
/// copied: a megabyte per chunk, and its page faults).
pub fn decompress_shared(frame: &[u8], len: usize) -> Result<std::sync::Arc<[u8]>, FrameError> {
    let mut out: std::sync::Arc<[u8]> = std::iter::repeat_n(0u8, len).collect();
    // A new allocation has no other owner: `make_mut` hands it out without copying.
    decompress_into(frame, std::sync::Arc::make_mut(&mut out))?;
    Ok(out)
}

/// Decompresses a frame that must fill `out` exactly.
fn decompress_into(frame: &[u8], out: &mut [u8]) -> Result<(), FrameError> {
    let len = out.len();
    let zstd_error = |source| FrameError::Zstd { len, source };
    let got = DCTX.with(|cell| {
        let mut slot = cell.borrow_mut();
        let dctx = match slot.as_mut() {
            Some(d) => d,
            None => slot.insert(zstd::bulk::Decompressor::new().map_err(zstd_error)?),
        };
        dctx.decompress_to_buffer(frame, out).map_err(zstd_error)
    })?;
    if got != len {
        return Err(FrameError::Length { got, expected: len });
    }
    Ok(())
}

/// Takes chunk `c` out of its decompressed frame and checks its digest.
pub fn verified_chunk<'a>(c: &ChunkEntry, frame: &'a [u8]) -> Result<&'a [u8], TocError> {
    let start = c.frame_offset as usize;
    let bytes = frame
        .get(start..start + c.len as usize)
        .ok_or_else(|| TocError::BadChunk {
            digest: c.digest,
            why: "outside its frame".into(),
        })?;
    if !c.digest.matches(bytes) {
        return Err(TocError::BadChunk {
            digest: c.digest,
            why: "digest mismatch".into(),
        });
    }
    Ok(bytes)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn sample() -> Toc {
        Toc {
            frames: vec![
                Frame {
                    offset: 0,
                    compressed: 10,
                    uncompressed: 8192,
                },
                Frame {
                    offset: 10,
                    compressed: 5,
                    uncompressed: 100,
                },
            ],
            chunks: vec![
                ChunkEntry {
                    block: 0,
                    len: 8192,
                    frame: 0,
                    frame_offset: 0,
                    digest: Digest::of(b"a"),
                },
                ChunkEntry {
                    block: 2,
                    len: 60,
                    frame: 1,
                    frame_offset: 0,
                    digest: Digest::of(b"b"),
                },
                ChunkEntry {
                    block: 3,
                    len: 40,
                    frame: 1,
                    frame_offset: 60,
                    digest: Digest::of(b"c"),
                },
            ],
            view_blocks: 4,
            ..Toc::default()
        }
    }

    /// A blob view of a 200,000-byte chunk in four 64 KiB pieces, then the sample's grouped chunks.
    pub(crate) fn pieced() -> (Toc, Vec<u8>) {
        let data: Vec<u8> = (0..200_000u32).map(|i| (i * 31 % 253) as u8).collect();
        let mut t = Toc {
            piece_size: pieces::PIECE_SIZE,
            ..Toc::default()
        };
        for (k, (r, p)) in pieces::cut(&data, pieces::PIECE_SIZE)
            .into_iter()
            .enumerate()
        {
            t.frames.push(Frame {
                offset: k as u64 * 100,
                compressed: 100,
                uncompressed: r.len() as u32,
            });
            t.pieces.push((0, p));
        }
        t.chunks.push(ChunkEntry {
            block: 0,
            len: data.len() as u32,
            frame: 0,
            frame_offset: 0,
            digest: Digest::of(&data),
        });
        let blocks = (data.len() as u64).div_ceil(BLOCK_SIZE) as u32;
        let s = sample();
        t.frames.push(Frame {
            offset: 400,
            ..s.frames[1]
        });
        for c in &s.chunks[1..] {
            t.chunks.push(ChunkEntry {
                block: blocks + c.block - 2,
                frame: 4,
                ..*c
            });
        }
        t.view_blocks = blocks as u64 + 2;
        (t, data)
    }

    #[test]
    fn pieced_round_trip_and_units() {
        let (t, data) = pieced();
        let back = Toc::decode(&t.encode()).expect("decodes");
        assert_eq!(back, t);
        assert_eq!(back.frames_of(0), 0..4);
        assert_eq!(back.frames_of(1), 4..5);
        let (units, checks) = pieces::units(back.clone());
        assert_eq!(units.chunks.len(), 6);
        assert_eq!(checks.iter().filter(|c| c.is_some()).count(), 4);
        for (u, check) in units.chunks.iter().zip(&checks).take(4) {
            let at = u.block as usize * BLOCK_SIZE as usize;
            let bytes = &data[at..at + u.len as usize];
            assert!(u.digest.matches(bytes));
            assert!(check.expect("a piece").matches(bytes));
        }
        assert_eq!(units.chunks[4].digest, back.chunks[1].digest);
        assert_eq!(
            units.chunk_at(17),
            Some(1),
            "block 17 is in the second piece"
        );
    }

    #[test]
    fn pieces_that_do_not_make_their_chunk_are_refused() {
        let (t, _) = pieced();
        let mut bad = t.clone();
        bad.pieces[2].1.cv[5] ^= 1;
        assert!(
            Toc::decode(&bad.encode()).is_err(),
            "a wrong chaining value"
        );
        let mut bad = t.clone();
        bad.frames[1].uncompressed -= 1;
        assert!(
            Toc::decode(&bad.encode()).is_err(),
            "a frame not the piece's size"
        );
        let mut bad = t.clone();
        bad.piece_size = 3 << 16;
        assert!(
            Toc::decode(&bad.encode()).is_err(),
            "a piece size not a power of two"
        );
        let enc = t.encode();
        assert!(
            Toc::decode(&enc[..enc.len() - 1]).is_err(),
            "a cut piece record"
        );
    }

    #[test]
    fn round_trip_and_lookup() {
        let t = sample();
        let back = Toc::decode(&t.encode()).unwrap();
        assert_eq!(back, t);
        assert_eq!(t.chunk_at(0), Some(0));
        assert_eq!(t.chunk_at(1), Some(0));
        assert_eq!(t.chunk_at(2), Some(1));
        assert_eq!(t.chunk_at(3), Some(2));
        assert_eq!(t.chunk_at(4), None);
    }

    #[test]
    fn rejects_damage() {
        let enc = sample().encode();
        for cut in [0, 5, enc.len() - 1] {
            assert!(Toc::decode(&enc[..cut]).is_err());
        }
        let mut bad = enc.clone();
        bad[TOC_HEADER + 2 * FRAME_REC + CHUNK_REC] = 9; // second chunk's block beyond view
        assert!(Toc::decode(&bad).is_err());
        // A view no device can address, whose size in bytes would overflow (found by fuzzing).
        let mut huge = enc.clone();
        huge[24..32].copy_from_slice(&(1u64 << 53).to_le_bytes());
        assert!(Toc::decode(&huge).is_err());
    }

    #[test]
    fn footer_round_trip() {
        let f = Footer {
            toc_offset: 100,
            toc_len: 50,
            toc_digest: Digest::of(b"t"),
        };
        assert_eq!(Footer::decode(&f.encode(), 214).unwrap(), f);
        assert!(Footer::decode(&f.encode(), 215).is_err());
    }

    #[test]
    fn codec_verifies() {
        let data = vec![7u8; 5000];
        let z = compress(&data, 3);
        let back = decompress(&z, data.len()).unwrap();
        let c = ChunkEntry {
            block: 0,
            len: 5000,
            frame: 0,
            frame_offset: 0,
            digest: Digest::of(&data),
        };
        assert!(verified_chunk(&c, &back).is_ok());
        let mut wrong = back.clone();
        wrong[3] = 0;
        assert!(verified_chunk(&c, &wrong).is_err());
        assert!(decompress(&z, 4999).is_err());
    }

    #[test]
    fn the_reused_context_survives_bad_frames() {
        let data: Vec<u8> = (0..70_000u32).map(|i| (i * 7 % 251) as u8).collect();
        let z = compress(&data, 3);
        for _ in 0..3 {
            assert_eq!(decompress(&z, data.len()).expect("good frame"), data);
            assert!(
                decompress(&z[..z.len() / 2], data.len()).is_err(),
                "truncated"
            );
            assert!(decompress(b"not zstd at all", 100).is_err(), "garbage");
            assert!(decompress(&z, data.len() - 1).is_err(), "too small");
        }
        assert_eq!(decompress(&compress(b"", 3), 0).expect("empty"), b"");
    }
}
