//! Where fetched bytes land: decompressed, checked against their digests (a piece also against its
//! chaining value), then kept — by the blob's home ([`super::home`]) or the chunk cache.
//!
//! A chunk is kept before its flight completes, so a reader woken by the flight finds it where it looks.
//! Keeping inline on the fetching thread was measured against a writer thread per streamed run (the
//! fetching thread decompressing the next chunk while the writer wrote the last to a `fanotify` view
//! file): no gain on the cold 1 GiB read (368.9 against 377.2 MB/s, median of 4 alternated rounds,
//! `SETUPS=fanotify@old,fanotify@new benches/loopmode.py run 4`), so chunks are kept inline.

use std::collections::HashMap;
use std::sync::Arc;

use strata_registry::toc::{decompress, decompress_shared, verified_chunk, FrameError};

use super::{BlobHandle, ChunkHome, ChunkResult, FetchError, Fetcher};

impl Fetcher {
    /// Decompresses the frames of `claimed` chunks out of `bytes` (the object from offset `start`),
    /// checks each chunk against its digest and keeps the good ones (home or cache).
    pub(super) fn checked(
        &self,
        blob: &BlobHandle,
        claimed: &[usize],
        bytes: &[u8],
        start: u64,
    ) -> Vec<ChunkResult> {
        let toc = &blob.toc;
        let home = blob.home();
        let mut frames: HashMap<usize, Result<Vec<u8>, FrameError>> = HashMap::new();
        // Frame `f`'s compressed bytes in the fetched range, and its decompressed length.
        let frame = |f: usize| {
            let fr = &toc.frames[f];
            let lo = (fr.offset - start) as usize;
            let z = bytes.get(lo..lo + fr.compressed as usize).unwrap_or(&[]);
            (z, fr.uncompressed as usize)
        };
        let mut out = Vec::with_capacity(claimed.len());
        for &j in claimed {
            let c = &toc.chunks[j];
            let f = c.frame as usize;
            let chunk = if c.frame_offset == 0 && c.len == toc.frames[f].uncompressed {
                // A frame of this chunk alone (every chunk but tiny ones): its decompressed bytes
                // are the chunk's, decompressed into the allocation readers and the cache share.
                // A piece is checked against its chaining value too: that ties it to its chunk.
                let (z, len) = frame(f);
                decompress_shared(z, len)
                    .ok()
                    .filter(|b| c.digest.matches(b) && blob.piece_ok(j, b))
            } else {
                match frames.entry(f).or_insert_with(|| {
                    let (z, len) = frame(f);
                    decompress(z, len)
                }) {
                    Ok(fb) => verified_chunk(c, fb)
                        .ok()
                        .filter(|b| blob.piece_ok(j, b))
                        .map(Arc::<[u8]>::from),
                    Err(_) => None,
                }
            };
            if let Some(b) = &chunk {
                self.keep(blob, home.as_deref(), j, b);
            }
            out.push(chunk.ok_or(FetchError::Corrupt {
                blob: blob.blob.digest,
                chunk: c.digest,
            }));
        }
        out
    }

    /// Keeps verified chunk `j` of `blob`: in its home if it can take it, else in the cache. A cache
    /// that cannot take the chunk (a full disk) costs a later refetch, not this read: the bytes are
    /// verified and at hand.
    fn keep(&self, blob: &BlobHandle, home: Option<&dyn ChunkHome>, j: usize, b: &Arc<[u8]>) {
        if home.is_some_and(|h| h.take(j, b)) {
            return;
        }
        if let Err(e) = self.cache.insert_shared(&blob.toc.chunks[j].digest, b) {
            self.metrics.error("cache");
            tracing::warn!(error = %e, "chunk not cached; served from memory");
        }
    }
}
