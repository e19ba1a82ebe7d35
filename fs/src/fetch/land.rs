//! Where fetched bytes land: decompressed, checked against their digests (a piece also against its
//! chaining value), then kept — by the blob's home ([`super::home`]) or the chunk cache.
//!
//! A flight ends with the chunk's verified bytes ([`super::Outcome`]), so its waiting readers are
//! answered from memory the moment the chunk is checked, before it is kept; the chunk's claim is
//! released only once it is kept, so a reader arriving in between finds the ended flight, not a miss
//! to fetch again. A failed chunk's claim is released first: the next read tries again.
//!
//! Keeping into the chunk cache (a megabyte's buffered write per chunk, ~80 µs) is thus off every
//! waiting reader's path; for the leader's own frame it runs on a worker after the leader answers its
//! reader ([`Fetcher::land_mine`]). A blob's home (`fanotify` mode's view file) is different: a home
//! chunk is written before its flight ends, because the view file's fill of the same chunk relies on
//! the fetch having written it ([`ChunkHome`]). Keeping home chunks inline on the fetching thread was
//! measured against a writer thread per streamed run: no gain on the cold 1 GiB read (368.9 against
//! 377.2 MB/s, median of 4 alternated rounds, `SETUPS=fanotify@old,fanotify@new benches/loopmode.py
//! run 4`).

use std::collections::HashMap;
use std::sync::Arc;

use strata_registry::toc::{decompress, decompress_shared, verified_chunk, FrameError};

use super::{BlobHandle, ChunkHome, ChunkResult, FetchError, Fetcher, Flight};

impl Fetcher {
    /// Decompresses the frames of `claimed` chunks out of `bytes` (the object from offset `start`) and
    /// checks each chunk against its digest; [`Self::land`] keeps the good ones.
    pub(super) fn checked(
        &self,
        blob: &BlobHandle,
        claimed: &[usize],
        bytes: &[u8],
        start: u64,
    ) -> Vec<ChunkResult> {
        let toc = &blob.toc;
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
            out.push(chunk.ok_or(FetchError::Corrupt {
                blob: blob.blob.digest,
                chunk: c.digest,
            }));
        }
        out
    }

    /// Ends the flights of `claimed` chunks with their `results` (same order): each good chunk is kept
    /// (before its flight ends if the blob has a home, after otherwise), each failed one's claim released.
    pub(super) fn land(
        &self,
        blob: &BlobHandle,
        claimed: &[usize],
        flights: &[Arc<Flight>],
        results: &[ChunkResult],
    ) {
        let home = blob.home();
        if let Some(h) = &home {
            self.keep_all(blob, Some(h.as_ref()), claimed, results);
        }
        self.announce(blob, claimed, flights, results);
        if home.is_none() {
            self.keep_all(blob, None, claimed, results);
        }
        self.release(blob, claimed, results);
    }

    /// [`Self::land`] for the leader's own frame: without a home, the keeping and the release run on a
    /// worker, so that the leader answers its reader first.
    pub(super) fn land_mine(
        self: &Arc<Self>,
        blob: &Arc<BlobHandle>,
        claimed: &[usize],
        flights: &[Arc<Flight>],
        results: &[ChunkResult],
    ) {
        if blob.home().is_some() {
            return self.land(blob, claimed, flights, results);
        }
        self.announce(blob, claimed, flights, results);
        let (me, b) = (self.clone(), blob.clone());
        let (claimed, results) = (claimed.to_vec(), results.to_vec());
        self.workers.run_or_here(move || {
            me.keep_all(&b, None, &claimed, &results);
            me.release(&b, &claimed, &results);
        });
    }

    /// Ends chunk `j`'s flight with error `e`, its claim released first (the next read tries again).
    pub(super) fn fail(&self, blob: &BlobHandle, j: usize, flight: &Flight, e: FetchError) {
        self.release(blob, &[j], &[]);
        flight.end(Err(e));
    }

    /// Ends each flight with its result; a failed chunk's claim is released first.
    fn announce(
        &self,
        blob: &BlobHandle,
        claimed: &[usize],
        flights: &[Arc<Flight>],
        results: &[ChunkResult],
    ) {
        for ((&j, f), r) in claimed.iter().zip(flights).zip(results) {
            match r {
                Ok(_) => f.end(r.clone()),
                Err(e) => self.fail(blob, j, f, e.clone()),
            }
        }
    }

    /// Releases the claims of the good chunks in `claimed` (every one when `results` is empty).
    fn release(&self, blob: &BlobHandle, claimed: &[usize], results: &[ChunkResult]) {
        let mut inflight = self.lock();
        for (k, &j) in claimed.iter().enumerate() {
            if results.get(k).is_none_or(Result::is_ok) {
                inflight.remove(&blob.toc.chunks[j].digest);
            }
        }
    }

    fn keep_all(
        &self,
        blob: &BlobHandle,
        home: Option<&dyn ChunkHome>,
        claimed: &[usize],
        results: &[ChunkResult],
    ) {
        for (&j, r) in claimed.iter().zip(results) {
            if let Ok(b) = r {
                self.keep(blob, home, j, b);
            }
        }
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
