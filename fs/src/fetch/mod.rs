//! The fetcher: turns cache misses into verified chunks.
//!
//! "Chunk" here means a blob's *unit* ([`BlobHandle::toc`]): a chunk stored whole, or one piece of a
//! pieced chunk ([`strata_registry::pieces`]), fetched, checked and kept alone.
//!
//! On a miss for chunk *i* of a blob, the first reader becomes the *leader*: it claims chunk *i* and the
//! missing chunks that follow it in the blob (their frames adjacent in the object, up to `max_span`
//! compressed bytes), fetches all their frames with one range request under a deadline, decompresses,
//! checks every chunk against its digest, and inserts the good ones into the cache. Other readers of a
//! claimed chunk wait for the leader (single flight) — never longer than the deadline. Data that fails
//! its digest is fetched once more, then reported as corrupt; it never reaches a reader or the cache.
//! Claims are per chunk, so a blob whose store is failing never blocks reads of another blob.
//!
//! The leader fetches only the frame of the chunk it was asked for; the claimed followers go out as a
//! second range request on a background thread. A reader thus waits for one round trip and its own
//! frame (not for the whole span to cross the link and be decompressed and checked), while the followers
//! — which sequential and nearby reads are likely to want next — arrive in parallel. The followers'
//! request is streamed ([`Store::get_range_streamed`]): each follower is checked, cached and handed to
//! its waiting readers as soon as its frame is in, so a reader that wants an early follower waits for
//! that frame, not for the whole span to cross the link (over the 20 ms / 1 Gbit/s link of
//! `benches/coldstart.py`, a 4 MiB span's cold import took 5 % less than with the whole-span wait;
//! BENCHMARKS.md). Prefetch runs ([`Fetcher::fetch_chunks`]) are streamed the same way.
//!
//! Programs also read *behind* a miss: a package's modules, a data directory's files or a library's pages
//! in another order than the blob's (of the 40 misses of the fat image's cold import over the link, 13
//! were within 1 MiB before an earlier miss). With `max_behind` set, a miss also claims the missing
//! chunks whose frames lie within that many compressed bytes before its own and fetches them in a third,
//! streamed request in the background. Off by default: it trades bytes for time (1 MiB: −7 to −9 % time
//! for +3 points of the image's bytes over the link; BENCHMARKS.md).
//!
//! With `max_stream` set, a miss also moves a background thread that walks the blob on from the miss,
//! fetching what is missing, its decompression at the lowest priority ([`stream`]): on a `file://`
//! store, where fetching costs CPU rather than round trips, this uses the CPU a cold start leaves idle.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use strata_registry::digest::Digest;
use strata_registry::store::{Store, StoreError};
use strata_registry::toc::Toc;

mod error;
mod handle;
mod home;
mod land;
mod stream;

pub use error::FetchError;
pub use handle::BlobHandle;
pub use home::ChunkHome;

use crate::cache::{CacheError, ChunkCache, Verified};
use crate::groups::Groups;
use crate::metrics::{Metrics, Wait};
use crate::workers::Workers;

/// Bytes of one chunk, ready to read.
pub enum ChunkBytes {
    /// Checked against its digest when read from the cache (see [`crate::cache`]).
    Cached(Verified),
    /// Fetched but not (or no longer) in the cache, e.g. a cache smaller than a chunk.
    Memory(Arc<[u8]>),
    /// Chunk `.1` kept by its blob's home ([`ChunkHome`]), not in the cache.
    Home(Arc<dyn ChunkHome>, usize),
}

impl ChunkBytes {
    /// Copies `buf.len()` bytes at `offset` of the chunk into `buf`.
    pub fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), FetchError> {
        match self {
            ChunkBytes::Cached(p) => p
                .read_at(buf, offset)
                .map_err(|e| FetchError::Cache(Arc::new(e))),
            ChunkBytes::Memory(m) => {
                let past = || {
                    FetchError::Cache(Arc::new(CacheError::PastEnd {
                        offset,
                        len: buf.len(),
                        size: m.len() as u64,
                    }))
                };
                let start = usize::try_from(offset).map_err(|_| past())?;
                let src = start
                    .checked_add(buf.len())
                    .and_then(|end| m.get(start..end))
                    .ok_or_else(past)?;
                buf.copy_from_slice(src);
                Ok(())
            }
            ChunkBytes::Home(h, j) => h.read_at(*j, buf, offset).map_err(|e| FetchError::Home {
                index: *j,
                source: Arc::new(e),
            }),
        }
    }
}

/// How a flight ended: the chunk's verified bytes, or why there are none (`None`: not yet).
type Outcome = Option<ChunkResult>;

/// Chunks read ahead of a sequential read from the cache (see [`Fetcher::read_ahead`]).
pub const READ_AHEAD: usize = 8;

/// The first chunk to read ahead when a sequential read enters chunk `i` and the window ends at `end`:
/// chunks before `ahead` were read ahead already, if `ahead` is this run's (within `(i, end]`); an
/// `ahead` elsewhere is an earlier run's.
fn ahead_from(ahead: usize, i: usize, end: usize) -> usize {
    match ahead > i && ahead <= end {
        true => ahead,
        false => i + 1,
    }
}

/// One fetched chunk, or why it could not be had.
type ChunkResult = Result<Arc<[u8]>, FetchError>;

struct Flight {
    done: Mutex<Outcome>,
    cv: Condvar,
}

impl Flight {
    /// The fetch's outcome, waiting up to `left` for it (`None`: not done by then).
    fn wait(&self, left: Duration) -> Outcome {
        let guard = self.done.lock().unwrap_or_else(|p| p.into_inner());
        let (guard, _) = self
            .cv
            .wait_timeout_while(guard, left, |d| d.is_none())
            .unwrap_or_else(|p| p.into_inner());
        guard.clone()
    }

    /// Ends the flight with `outcome`, waking its readers.
    fn end(&self, outcome: ChunkResult) {
        let mut d = self.done.lock().unwrap_or_else(|p| p.into_inner());
        *d = Some(outcome);
        self.cv.notify_all();
    }
}

/// Fetches chunks into the cache; shared by every blob the node serves.
pub struct Fetcher {
    store: Arc<Store>,
    cache: Arc<ChunkCache>,
    inflight: Mutex<HashMap<Digest, Arc<Flight>>>,
    /// Largest compressed span of one range request.
    pub max_span: u64,
    /// Compressed bytes before a miss fetched with it, in a third request in the background (0: none;
    /// see the module documentation).
    pub max_behind: u64,
    /// How long a read may wait for data.
    pub deadline: Duration,
    metrics: Arc<Metrics>,
    /// Blobs whose needed chunks a prefetch plan is fetching: a demand read of one fetches only its own
    /// frame (the plan knows better than fetching ahead what will be read).
    planned: std::sync::RwLock<std::collections::HashSet<Digest>>,
    /// Threads for the followers' and read-behind requests, shared with the slow-read schedulers.
    workers: Workers,
    /// Compressed bytes of a miss's directory group fetched with it in the background (0: none; see
    /// [`crate::groups`]).
    pub max_group: u64,
    groups: Groups,
    /// Compressed bytes of a blob walked after a miss at idle priority, fetching what is missing (0:
    /// none; see [`stream`]).
    pub max_stream: u64,
    streamer: stream::Streamer,
}

impl Fetcher {
    /// A fetcher over `store` filling `cache`.
    pub fn new(
        store: Arc<Store>,
        cache: Arc<ChunkCache>,
        metrics: Arc<Metrics>,
        max_span: u64,
        deadline: Duration,
    ) -> Fetcher {
        Fetcher {
            store,
            cache,
            inflight: Mutex::new(HashMap::new()),
            max_span,
            max_behind: 0,
            deadline,
            metrics,
            planned: Default::default(),
            workers: Workers::default(),
            max_group: 0,
            groups: Groups::default(),
            max_stream: 0,
            streamer: stream::Streamer::default(),
        }
    }

    /// The mounted layers' directory groups, for misses to fetch their neighbours with `max_group`.
    pub fn groups(&self) -> &Groups {
        &self.groups
    }

    /// The pool background fetches run on; the slow-read schedulers of the node's servers share it.
    pub fn workers(&self) -> &Workers {
        &self.workers
    }

    /// Marks blobs as covered by a prefetch plan being warmed (`true`) or no longer (`false`).
    pub fn set_planned(&self, blobs: &[Digest], on: bool) {
        let mut p = self.planned.write().unwrap_or_else(|p| p.into_inner());
        for b in blobs {
            match on {
                true => p.insert(*b),
                false => p.remove(b),
            };
        }
    }

    fn is_planned(&self, blob: &Digest) -> bool {
        let p = self.planned.read().unwrap_or_else(|p| p.into_inner());
        p.contains(blob)
    }

    /// Fetches the given chunks of `blob` that are neither cached nor being fetched, each run of
    /// neighbouring ones in one range request, and caches them (prefetch). Returns the chunks fetched
    /// and the compressed bytes requested.
    pub fn fetch_chunks(
        &self,
        blob: &BlobHandle,
        chunks: &[usize],
    ) -> Result<(u64, u64), FetchError> {
        let toc = &blob.toc;
        let present = self.present(blob);
        let (claimed, mut flights) = {
            let mut inflight = self.lock();
            let (mut claimed, mut flights) = (Vec::new(), Vec::new());
            for &j in chunks {
                let Some(c) = toc.chunks.get(j) else {
                    continue;
                };
                // Claimed one by one: a chunk listed twice (or stored twice) is fetched once.
                if inflight.contains_key(&c.digest) || present(j) {
                    continue;
                }
                claimed.push(j);
                flights.extend(claim(&mut inflight, toc, &[j]));
            }
            (claimed, flights)
        };
        let runs: Vec<(Vec<usize>, Vec<Arc<Flight>>)> = stream::frame_runs(toc, &claimed)
            .into_iter()
            .map(|r| {
                let rest = flights.split_off(r.len());
                (r, std::mem::replace(&mut flights, rest))
            })
            .collect();
        let (mut count, mut bytes) = (0, 0);
        let mut first_err = None;
        for (claimed, flights) in &runs {
            count += claimed.len() as u64;
            let r = span(toc, claimed);
            bytes += r.end - r.start;
            if let Err(e) = self.complete_streamed(blob, claimed, flights) {
                first_err.get_or_insert(e);
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok((count, bytes)),
        }
    }

    /// The cache this fetcher fills.
    pub fn cache(&self) -> &Arc<ChunkCache> {
        &self.cache
    }

    /// Whether chunk `j` of `blob` needs no fetch: kept by the blob's home or in the cache (a test
    /// made once per run of chunks: the home is looked up here, not per chunk).
    fn present<'a>(&'a self, blob: &'a BlobHandle) -> impl Fn(usize) -> bool + 'a {
        let home = blob.home();
        move |j| {
            home.as_ref().is_some_and(|h| h.has(j))
                || blob
                    .toc
                    .chunks
                    .get(j)
                    .is_some_and(|c| self.cache.contains(&c.digest))
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Digest, Arc<Flight>>> {
        self.inflight.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A read entered chunk `i` of `blob`. When that continues a sequential read (the previous read
    /// entered chunk `i - 1`), the cache starts reading the next [`READ_AHEAD`] cached
    /// chunks from disk (each chunk once), so that the disk works on several at a time.
    pub fn read_ahead(&self, blob: &BlobHandle, i: usize) {
        let last = blob.last.swap(i, Ordering::Relaxed);
        if last == i || last.wrapping_add(1) != i {
            return;
        }
        let end = (i + 1 + READ_AHEAD).min(blob.toc.chunks.len());
        // Racing readers at worst advise a chunk twice or not at all: it is a hint.
        let ahead = blob.ahead.swap(end, Ordering::Relaxed);
        for c in blob
            .toc
            .chunks
            .get(ahead_from(ahead, i, end)..end)
            .unwrap_or(&[])
        {
            self.cache.advise(&c.digest);
        }
    }

    /// Chunk `i` of `blob` if the cache has it; nothing is fetched.
    pub fn cached(&self, blob: &BlobHandle, i: usize) -> Result<Option<ChunkBytes>, FetchError> {
        let c = blob.toc.chunks.get(i).ok_or(FetchError::NoChunk {
            blob: blob.blob.digest,
            index: i,
        })?;
        if let Some(h) = blob.home().filter(|h| h.has(i)) {
            return Ok(Some(ChunkBytes::Home(h, i)));
        }
        Ok(self.cache.get(&c.digest).map(|p| {
            self.metrics.cache_hit(&blob.blob.digest);
            ChunkBytes::Cached(p)
        }))
    }

    /// Chunk `i` of `blob` if it is in the cache or on its way there (a fetch in flight, waited for up
    /// to the deadline); `None` otherwise — nothing new is fetched. What reading ahead into `fanotify`
    /// mode's view files takes: the chunks a miss's fetch brought besides its own.
    pub fn landed(&self, blob: &BlobHandle, i: usize) -> Result<Option<ChunkBytes>, FetchError> {
        if let Some(b) = self.cached(blob, i)? {
            return Ok(Some(b));
        }
        let c = blob.toc.chunks[i];
        let Some(flight) = self.lock().get(&c.digest).cloned() else {
            return Ok(None);
        };
        match flight.wait(self.deadline) {
            Some(Ok(bytes)) => Ok(Some(ChunkBytes::Memory(bytes))),
            Some(Err(e)) => Err(e),
            None => Ok(None),
        }
    }

    /// Chunk `i` of `blob`, verified.
    pub fn chunk(
        self: &Arc<Self>,
        blob: &Arc<BlobHandle>,
        i: usize,
    ) -> Result<ChunkBytes, FetchError> {
        let c = *blob.toc.chunks.get(i).ok_or(FetchError::NoChunk {
            blob: blob.blob.digest,
            index: i,
        })?;
        let start = Instant::now();
        loop {
            if let Some(b) = self.cached(blob, i)? {
                return Ok(b);
            }
            let waiting = self.lock().get(&c.digest).cloned();
            match waiting {
                Some(flight) => {
                    let left = self.deadline.saturating_sub(start.elapsed());
                    match flight.wait(left) {
                        None => {
                            return Err(FetchError::Timeout {
                                blob: blob.blob.digest,
                                after: self.deadline,
                            })
                        }
                        Some(Err(e)) => return Err(e),
                        Some(Ok(bytes)) => {
                            self.metrics.waited(Wait::Joined, start.elapsed());
                            return Ok(ChunkBytes::Memory(bytes));
                        }
                    }
                }
                None => {
                    if let Some(r) = self.lead(blob, i) {
                        self.metrics.cache_miss(&blob.blob.digest);
                        self.metrics.waited(Wait::Led, start.elapsed());
                        return r;
                    }
                    // Someone claimed it between our look and our claim: wait for them.
                }
            }
        }
    }

    /// Claims chunk `i` and its missing followers, fetches them, completes their flights. `None` if
    /// another reader claimed chunk `i` first.
    fn lead(
        self: &Arc<Self>,
        blob: &Arc<BlobHandle>,
        i: usize,
    ) -> Option<Result<ChunkBytes, FetchError>> {
        let toc = &blob.toc;
        let span: u64;
        let unplanned = !self.is_planned(&blob.blob.digest);
        let present = self.present(blob);
        let (claimed, flights, behind, behind_flights, mine_at) = {
            let mut inflight = self.lock();
            if inflight.contains_key(&toc.chunks[i].digest) {
                return None;
            }
            let max_span = match unplanned {
                true => self.max_span,
                false => 0,
            };
            let taken = |j: usize| inflight.contains_key(&toc.chunks[j].digest) || present(j);
            let (claimed, mine_at) = around(toc, i, max_span, &taken);
            let base = toc.frames[toc.chunks[i].frame as usize].offset;
            // Where misses land, for studying layouts (`STRATA_LOG=strata_fs::fetch=debug`).
            tracing::debug!(blob = %blob.blob.digest, chunk = i, at = base, span = max_span,
                claimed = claimed.len(), "miss");
            // A planned blob fetches nothing around its misses (`max_span` 0 above).
            let mut behind = match max_span == 0 || self.max_behind == 0 {
                true => Vec::new(),
                false => self.behind(toc, i, &inflight, &present),
            };
            // A miss in a pieced chunk brings the chunk's earlier pieces too, in the background: a
            // whole chunk's reader has them all after one miss, and a piece's must not pay a round trip
            // more for reading back within its chunk.
            if max_span > 0 {
                let start = blob.chunk_start(i);
                behind.extend((start..i).filter(|&j| !taken(j)));
                behind.sort_unstable();
                behind.dedup();
            }
            let flights = claim(&mut inflight, toc, &claimed);
            let behind_flights = claim(&mut inflight, toc, &behind);
            let frames: std::collections::BTreeSet<usize> = claimed
                .iter()
                .chain(&behind)
                .map(|&j| toc.chunks[j].frame as usize)
                .collect();
            span = frames
                .iter()
                .map(|&f| toc.frames[f].compressed as u64)
                .sum();
            (claimed, flights, behind, behind_flights, mine_at)
        };
        if !behind.is_empty() {
            let (me, b) = (self.clone(), blob.clone());
            self.workers.run_or_here(move || {
                let _ = me.complete_streamed(&b, &behind, &behind_flights);
            });
        }
        // The rest of the miss's directory, and the stretch after it (a planned blob's plan knows
        // better than either).
        let charged = match unplanned {
            true => span + self.beyond(blob, i, &claimed),
            false => span,
        };
        // Charged to the reader's sandbox (outside the lock: it reads /proc).
        self.metrics.attribution.miss(charged);
        // The chunks of chunk `i`'s own frame are fetched here; the followers (later frames) in a second
        // request on a background thread, so that the reader waits only for its own frame's transfer,
        // decompression and check, while the followers arrive in parallel.
        let own = claimed
            .iter()
            .take_while(|&&j| toc.chunks[j].frame == toc.chunks[i].frame)
            .count();
        if own < claimed.len() {
            let rest = claimed[own..].to_vec();
            let rest_flights = flights[own..].to_vec();
            let (me, b) = (self.clone(), blob.clone());
            // Errors reach the followers' readers through their flights.
            let queued = self.workers.run(move || {
                let _ = me.complete_streamed(&b, &rest, &rest_flights);
            });
            if queued.is_err() {
                // No thread to spare: fetch the followers here, after our own frame.
                let out = self.complete(blob, &claimed[..own], 2);
                self.land(blob, &claimed[..own], &flights[..own], &out);
                let _ = self.complete_streamed(blob, &claimed[own..], &flights[own..]);
                return Some(self.mine(blob, out, mine_at));
            }
        }
        let out = self.complete(blob, &claimed[..own], 2);
        self.land_mine(blob, &claimed[..own], &flights[..own], &out);
        Some(self.mine(blob, out, mine_at))
    }

    /// Starts the background work beyond a miss of chunk `i` that claimed `claimed`: its directory's
    /// group (`max_group`) and the streamer's walk on from it (`max_stream`). Returns the group's
    /// compressed bytes, charged with the miss (the streamer charges its own as it goes).
    fn beyond(self: &Arc<Self>, blob: &Arc<BlobHandle>, i: usize, claimed: &[usize]) -> u64 {
        if let Some(&last) = claimed.last() {
            stream::Streamer::missed(self, blob, last + 1);
        }
        if self.max_group == 0 {
            return 0;
        }
        let present = self.present(blob);
        let (group, bytes) = self
            .groups
            .missing(blob, i, claimed, &present, self.max_group);
        if group.is_empty() {
            return 0;
        }
        let (me, b) = (self.clone(), blob.clone());
        self.workers.run_or_here(move || {
            let _ = me.fetch_chunks(&b, &group);
        });
        bytes
    }

    /// The missing chunks right before chunk `i` (the run of them whose frames lie within
    /// `max_behind` compressed bytes before chunk `i`'s frame, not cached or claimed), ascending.
    fn behind(
        &self,
        toc: &Toc,
        i: usize,
        inflight: &HashMap<Digest, Arc<Flight>>,
        present: impl Fn(usize) -> bool,
    ) -> Vec<usize> {
        let own = toc.chunks[i].frame as usize;
        let base = toc.frames[own].offset;
        let mut out = Vec::new();
        for j in (0..i).rev() {
            let c = &toc.chunks[j];
            let f = c.frame as usize;
            if f == own {
                continue;
            }
            if base - toc.frames[f].offset > self.max_behind
                || inflight.contains_key(&c.digest)
                || present(j)
            {
                break;
            }
            out.push(j);
        }
        out.reverse();
        out
    }

    /// Fetches `claimed` chunks (one request, `attempts` at most while a chunk fails its check) and
    /// checks them: each chunk's bytes or error, in `claimed` order, for [`Self::land`] to hand to their
    /// flights.
    fn complete(&self, blob: &BlobHandle, claimed: &[usize], attempts: usize) -> Vec<ChunkResult> {
        match self.fetch_run(blob, claimed, attempts) {
            Ok(results) => results,
            Err(e) => vec![Err(e); claimed.len()],
        }
    }

    /// Fetches `claimed` chunks in one request whose body is checked as it arrives: each chunk's flight
    /// completes as soon as its frame is in and checked, so that a reader waiting for an early chunk of
    /// a long run waits for that chunk's bytes, not for the whole run to cross the link. Chunks that
    /// fail their check are fetched once more (as [`Self::complete`] does); when the request fails, the
    /// chunks not completed yet get its error.
    fn complete_streamed(
        &self,
        blob: &BlobHandle,
        claimed: &[usize],
        flights: &[Arc<Flight>],
    ) -> Result<(), FetchError> {
        let toc = &blob.toc;
        if claimed.is_empty() {
            return Ok(());
        }
        let range = span(toc, claimed);
        let mut buf: Vec<u8> = Vec::with_capacity((range.end - range.start) as usize);
        // `claimed[..done]` are completed, or set aside in `bad` for another fetch.
        let (mut done, mut bad) = (0usize, Vec::new());
        let t = Instant::now();
        let mut sink = |piece: &[u8]| {
            buf.extend_from_slice(piece);
            let have = range.start + buf.len() as u64;
            let ready = claimed[done..]
                .iter()
                .take_while(|&&j| {
                    let f = &toc.frames[toc.chunks[j].frame as usize];
                    f.offset + f.compressed as u64 <= have
                })
                .count();
            if ready == 0 {
                return;
            }
            let part = &claimed[done..done + ready];
            let (mut js, mut fs, mut rs) = (Vec::new(), Vec::new(), Vec::new());
            for (k, r) in (done..).zip(self.checked(blob, part, &buf, range.start)) {
                match r {
                    Ok(b) => {
                        js.push(claimed[k]);
                        fs.push(flights[k].clone());
                        rs.push(Ok(b));
                    }
                    Err(_) => bad.push(k),
                }
            }
            self.land(blob, &js, &fs, &rs);
            done += ready;
        };
        let streamed = self
            .store
            .get_range_streamed(&blob.key, range.clone(), &mut sink)
            .map_err(|e| store_error(blob, e));
        self.metrics
            .fetched(&blob.blob.digest, buf.len() as u64, t.elapsed());
        if !bad.is_empty() && streamed.is_ok() {
            self.metrics.error("corrupt");
            tracing::warn!(blob = %blob.blob.digest, "chunk failed verification; fetching again");
            let again: Vec<usize> = bad.iter().map(|&k| claimed[k]).collect();
            let again_flights: Vec<Arc<Flight>> = bad.iter().map(|&k| flights[k].clone()).collect();
            let results = self.complete(blob, &again, 1);
            self.land(blob, &again, &again_flights, &results);
            bad.clear();
        }
        let left = match &streamed {
            Err(e) => Some(e.clone()),
            Ok(()) if done < claimed.len() => Some(FetchError::ShortAnswer {
                blob: blob.blob.digest,
                range: range.clone(),
            }),
            Ok(()) => None,
        };
        if let Some(e) = left {
            for k in bad.into_iter().chain(done..claimed.len()) {
                self.fail(blob, claimed[k], &flights[k], e.clone());
            }
            return Err(e);
        }
        Ok(())
    }

    /// The leader's own chunk (claimed `at`, after its frame's missing chunks before it) out of its
    /// fetch.
    fn mine(
        &self,
        blob: &BlobHandle,
        fetched: Vec<ChunkResult>,
        at: usize,
    ) -> Result<ChunkBytes, FetchError> {
        match fetched.into_iter().nth(at) {
            // Its bytes are at hand: no need to read them back from the cache.
            Some(Ok(bytes)) => Ok(ChunkBytes::Memory(bytes)),
            Some(Err(e)) => Err(e),
            None => Err(FetchError::NothingFetched {
                blob: blob.blob.digest,
            }),
        }
    }

    /// Fetches the frames of `claimed` chunks in one request (`attempts` times at most while a chunk fails
    /// its digest) and checks them. Returns each chunk's bytes or error, in `claimed` order.
    fn fetch_run(
        &self,
        blob: &BlobHandle,
        claimed: &[usize],
        attempts: usize,
    ) -> Result<Vec<ChunkResult>, FetchError> {
        if claimed.is_empty() {
            return Ok(Vec::new());
        }
        let range = span(&blob.toc, claimed);
        let mut out = Vec::new();
        for attempt in 0..attempts {
            let bytes = self.read_range(blob, range.clone())?;
            out = self.checked(blob, claimed, &bytes, range.start);
            if out.iter().all(Result::is_ok) {
                break;
            }
            self.metrics.error("corrupt");
            if attempt == 0 {
                tracing::warn!(blob = %blob.blob.digest, "chunk failed verification; fetching again");
            }
        }
        Ok(out)
    }

    /// Bytes `range` of `blob`'s object, in one request, counted in the metrics.
    fn read_range(
        &self,
        blob: &BlobHandle,
        range: std::ops::Range<u64>,
    ) -> Result<impl std::ops::Deref<Target = [u8]>, FetchError> {
        let t = Instant::now();
        let bytes = self
            .store
            .get_range(&blob.key, range)
            .map_err(|e| store_error(blob, e))?;
        self.metrics
            .fetched(&blob.blob.digest, bytes.len() as u64, t.elapsed());
        Ok(bytes)
    }
}

/// What a miss of chunk `i` claims, in blob order, and where `i` is among them. Chunk `i`'s own frame
/// is fetched and decompressed whole: each of its missing chunks comes with it, before `i` and after,
/// whatever the span (a group frame's small files; without this, 21 of the fat image's 174 cold misses
/// fetched a frame fetched before). Then the *followers*: the missing chunks of the frames right after
/// it, while their frames end within `max_span` compressed bytes of its frame's start and no frame is
/// skipped (a taken chunk inside a follower frame is skipped; a frame that is taken ends the run).
fn around(
    toc: &Toc,
    i: usize,
    max_span: u64,
    taken: &dyn Fn(usize) -> bool,
) -> (Vec<usize>, usize) {
    let first_frame = toc.chunks[i].frame as usize;
    let base = toc.frames[first_frame].offset;
    let first = (0..i)
        .rev()
        .take_while(|&j| toc.chunks[j].frame as usize == first_frame)
        .last()
        .unwrap_or(i);
    let mut claimed: Vec<usize> = (first..i).filter(|&j| !taken(j)).collect();
    let mine_at = claimed.len();
    let mut last_frame = first_frame;
    for (j, c) in toc.chunks.iter().enumerate().skip(i) {
        let f = c.frame as usize;
        if f == first_frame {
            if j == i || !taken(j) {
                claimed.push(j);
            }
            continue;
        }
        let end = toc.frames[f].offset + toc.frames[f].compressed as u64;
        if f > last_frame + 1 || end - base > max_span || taken(j) {
            // Within a follower frame, skip a taken chunk; past it, stop.
            if f != last_frame {
                break;
            }
            continue;
        }
        last_frame = f;
        claimed.push(j);
    }
    (claimed, mine_at)
}

/// Claims chunks of `toc` for fetching: a flight for each, registered in `inflight`.
fn claim(
    inflight: &mut HashMap<Digest, Arc<Flight>>,
    toc: &Toc,
    chunks: &[usize],
) -> Vec<Arc<Flight>> {
    chunks
        .iter()
        .map(|&j| {
            let f = Arc::new(Flight {
                done: Mutex::new(None),
                cv: Condvar::new(),
            });
            inflight.insert(toc.chunks[j].digest, f.clone());
            f
        })
        .collect()
}

fn store_error(blob: &BlobHandle, e: StoreError) -> FetchError {
    match e {
        StoreError::Timeout { after, .. } => FetchError::Timeout {
            blob: blob.blob.digest,
            after,
        },
        other => FetchError::Store {
            blob: blob.blob.digest,
            source: Arc::new(other),
        },
    }
}

/// The byte range of the object holding the frames of `claimed` (non-empty, ascending) chunks.
fn span(toc: &Toc, claimed: &[usize]) -> std::ops::Range<u64> {
    let frame = |k: usize| &toc.frames[toc.chunks[claimed[k]].frame as usize];
    let (first, last) = (frame(0), frame(claimed.len() - 1));
    first.offset..last.offset + last.compressed as u64
}

#[cfg(test)]
mod pieces_tests;
#[cfg(test)]
mod tests;
