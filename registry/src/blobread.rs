//! Reading verified bytes out of a blob.
//!
//! A [`BlobReader`] holds a blob's verified table of contents and turns requests for chunks into range
//! reads of the frames holding them: neighbouring frames are fetched in one request (up to a cap), each
//! frame is decompressed, and each chunk is checked against its digest before the caller sees it. This is
//! the path `strata cat` and `strata materialize` use; the node daemon adds caching on top of the same
//! codec.

use std::ops::Range;

use crate::model::BlobRef;
use crate::store::{key, Store, StoreError};
use crate::toc::{decompress, verified_chunk, ChunkEntry, Toc};

/// Largest compressed span fetched in one request.
pub const MAX_SPAN: u64 = 16 << 20;

/// Verified reads of one blob.
pub struct BlobReader<'s> {
    store: &'s Store,
    key: String,
    pub blob: BlobRef,
    pub toc: Toc,
}

impl<'s> BlobReader<'s> {
    /// Fetches and verifies the blob's table of contents.
    pub fn open(store: &'s Store, blob: &BlobRef) -> Result<BlobReader<'s>, StoreError> {
        let toc = store.get_toc(blob)?;
        Ok(BlobReader {
            store,
            key: key::blob(&blob.digest),
            blob: blob.clone(),
            toc,
        })
    }

    fn bad(&self, why: String) -> StoreError {
        StoreError::Malformed {
            key: self.key.clone(),
            why,
        }
    }

    /// Fetches frames `frames` (contiguous in the object) in one request and decompresses each.
    fn fetch_frames(&self, frames: Range<usize>) -> Result<Vec<Vec<u8>>, StoreError> {
        let fs = &self.toc.frames[frames];
        let (Some(first), Some(last)) = (fs.first(), fs.last()) else {
            return Ok(Vec::new());
        };
        let start = first.offset;
        let end = last.offset + last.compressed as u64;
        let bytes = self.store.get_range(&self.key, start..end)?;
        let mut out = Vec::with_capacity(fs.len());
        for f in fs {
            let lo = (f.offset - start) as usize;
            let hi = lo + f.compressed as usize;
            let raw = bytes
                .get(lo..hi)
                .ok_or_else(|| self.bad("frame outside the fetched range".into()))?;
            out.push(
                decompress(raw, f.uncompressed as usize)
                    .map_err(|e| self.bad(format!("frame at {}: {e}", f.offset)))?,
            );
        }
        Ok(out)
    }

    /// Calls `f` with every chunk in `chunks` (indices into the TOC, ascending), verified, fetching
    /// neighbouring frames together up to [`MAX_SPAN`] bytes per request. A pieced chunk comes whole:
    /// its pieces' frames joined and checked against the chunk's digest.
    pub fn for_each_chunk(
        &self,
        chunks: Range<usize>,
        mut f: impl FnMut(&ChunkEntry, &[u8]) -> Result<(), StoreError>,
    ) -> Result<(), StoreError> {
        let toc = &self.toc;
        if chunks.end > toc.chunks.len() || chunks.start > chunks.end {
            return Err(self.bad("chunk index out of range".into()));
        }
        let mut i = chunks.start;
        while i < chunks.end {
            // Gather the run of chunks whose frames are adjacent and fit the span.
            let first_frame = toc.chunks[i].frame as usize;
            let mut last_frame = first_frame;
            let mut j = i;
            while j < chunks.end {
                let fr = toc.frames_of(j);
                if fr.start < first_frame || fr.start > last_frame + 1 {
                    break;
                }
                let end = &toc.frames[fr.end - 1];
                let span = end.offset + end.compressed as u64 - toc.frames[first_frame].offset;
                if span > MAX_SPAN && fr.start != first_frame {
                    break;
                }
                last_frame = last_frame.max(fr.end - 1);
                j += 1;
            }
            let frames = self.fetch_frames(first_frame..last_frame + 1)?;
            for k in i..j {
                let c = &toc.chunks[k];
                let fr = toc.frames_of(k);
                if fr.len() == 1 {
                    let frame = &frames[fr.start - first_frame];
                    let bytes = verified_chunk(c, frame).map_err(|e| self.bad(e.to_string()))?;
                    f(c, bytes)?;
                    continue;
                }
                let bytes = frames[fr.start - first_frame..fr.end - first_frame].concat();
                if !c.digest.matches(&bytes) {
                    return Err(self.bad(format!("chunk {} failed verification", c.digest)));
                }
                f(c, &bytes)?;
            }
            i = j;
        }
        Ok(())
    }

    /// The verified bytes of the chunk that starts at view block `block`.
    pub fn chunk_at_block(&self, block: u64) -> Result<Vec<u8>, StoreError> {
        let i = self
            .toc
            .chunk_at(block)
            .filter(|&i| self.toc.chunks[i].block as u64 == block)
            .ok_or_else(|| self.bad(format!("no chunk starts at block {block}")))?;
        let mut out = Vec::new();
        self.for_each_chunk(i..i + 1, |_, b| {
            out = b.to_vec();
            Ok(())
        })?;
        Ok(out)
    }
}
