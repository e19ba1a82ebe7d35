//! Streaming ahead of misses on idle CPU: [`Streamer`].
//!
//! Without a plan, a cold start is a series of misses, and each reader waits for its own (a store read,
//! decompression of a whole frame, a check): on the fat image's import ~150 of them, 0.3 s summed, while
//! the machine's CPUs are idle half of the time (BENCHMARKS.md, ninth session). Fetching more with each
//! miss (a longer span, fetching behind) cut the waits but not the import: the extra decompression ran
//! at the importing program's priority and took the CPU it needed.
//!
//! The streamer fetches ahead of misses with CPU nobody else wants: after a miss, one background thread
//! walks the blob forward from the end of what the miss fetched, in chunk order (the layout's: files
//! read together are stored together), fetching the chunks that are neither cached nor in flight —
//! verified and kept like any fetch — for up to `max_stream` compressed bytes of the
//! blob. Programs read several regions in turn (Python's bytecode, then the libraries its extension
//! modules load), so the streamer keeps a few *cursors*, the latest miss's first: a miss inside a
//! cursor's stretch moves that cursor to it and renews its budget; one elsewhere starts a new cursor.
//!
//! It steps [`UNIT`] compressed bytes at a time, and claims nothing while it works: each step reads the
//! chunks neither cached nor in flight, decompresses and checks them at the lowest priority, and only
//! then claims the ones still missing, to keep them and hand them to any reader that came for them
//! meanwhile. A reader thus never waits for a thread the scheduler may starve (no priority inversion;
//! nor does the store's tripwire see a starved read); at worst it fetches a chunk the streamer is
//! fetching too. A blob a plan is warming streams nothing (the plan knows
//! better). The thread ends when no cursor is left; the next miss starts another. What it fetches is
//! charged to the sandbox whose miss placed the cursor, like the span a miss fetches ([`attribution`]).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use strata_registry::toc::Toc;

use super::{span, BlobHandle, FetchError, Fetcher};
use crate::attribution;

/// Compressed bytes of the blob walked in one step (a range request per run of adjacent missing frames).
pub const UNIT: u64 = 256 << 10;

/// Cursors kept at once: the regions a program is reading in turn.
const CURSORS: usize = 4;

/// Where the streamer goes next in one blob.
struct Cursor {
    blob: Arc<BlobHandle>,
    /// The next chunk to look at.
    next: usize,
    /// Compressed bytes of the blob still to walk.
    left: u64,
    /// When the miss that placed it came (higher: later); the latest goes first.
    stamp: u64,
    /// The process whose miss placed it: what it fetches is charged to that process's sandbox.
    reader: u32,
}

#[derive(Default)]
struct State {
    /// Latest first.
    cursors: VecDeque<Cursor>,
    /// Whether a streaming thread is running.
    running: bool,
    stamps: u64,
}

impl State {
    /// A miss of `blob` fetched up to chunk `from` (exclusive): the latest cursor now walks `max`
    /// bytes from there. A cursor of the blob whose stretch holds `from` is moved, not kept besides.
    /// Whether a thread must start.
    fn place(&mut self, blob: &Arc<BlobHandle>, from: usize, max: u64, reader: u32) -> bool {
        let at = offset(blob, from);
        self.stamps += 1;
        let within = self.cursors.iter().position(|c| {
            let here = offset(&c.blob, c.next.min(c.blob.toc.chunks.len() - 1));
            Arc::ptr_eq(&c.blob, blob) && at + UNIT >= here && at <= here + c.left
        });
        if let Some(k) = within {
            self.cursors.remove(k);
        }
        self.cursors.push_front(Cursor {
            blob: blob.clone(),
            next: from,
            left: max,
            stamp: self.stamps,
            reader,
        });
        self.cursors.truncate(CURSORS);
        !std::mem::replace(&mut self.running, true)
    }

    /// A cursor after a step goes back in the order of its miss, unless later ones fill the slots.
    fn requeue(&mut self, c: Cursor) {
        let at = self
            .cursors
            .iter()
            .position(|o| o.stamp < c.stamp)
            .unwrap_or(self.cursors.len());
        if at < CURSORS {
            self.cursors.insert(at, c);
            self.cursors.truncate(CURSORS);
        }
    }

    /// The latest cursor, taken out to step; `None` ends the thread (`running` cleared).
    fn take(&mut self) -> Option<Cursor> {
        let c = self.cursors.pop_front();
        self.running = c.is_some();
        c
    }
}

/// The fetcher's stream-ahead (see the module documentation).
#[derive(Default)]
pub struct Streamer {
    state: Mutex<State>,
}

impl Streamer {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A miss of `blob` fetched up to chunk `from` (exclusive): stream on from there.
    pub(super) fn missed(fetcher: &Arc<Fetcher>, blob: &Arc<BlobHandle>, from: usize) {
        let max = fetcher.max_stream;
        if max == 0 || from >= blob.toc.chunks.len() {
            return;
        }
        let reader = attribution::reader();
        if !fetcher.streamer.lock().place(blob, from, max, reader) {
            return;
        }
        // A thread of its own, not one of the fetcher's workers: a thread whose priority could not be
        // raised back (no `CAP_SYS_NICE`) must not go on to serve misses.
        let me = fetcher.clone();
        let spawned = std::thread::Builder::new()
            .name("strata-stream".into())
            .spawn(move || me.stream());
        if spawned.is_err() {
            fetcher.streamer.lock().running = false;
        }
    }
}

impl Fetcher {
    /// The streaming thread: steps the latest cursor until none is left.
    fn stream(self: Arc<Self>) {
        let mut nice = Nice::default();
        loop {
            // Not `while let`: the guard would live through the step, and a miss placing a cursor
            // would wait for it.
            let next = self.streamer.lock().take();
            let Some(mut c) = next else { return };
            let (run, walked) = next_run(&c.blob, c.next, c.left.min(UNIT));
            c.next += run.len();
            c.left = c.left.saturating_sub(walked);
            if self.is_planned(&c.blob.blob.digest) {
                continue;
            }
            match self.stream_step(&c.blob, &run, &mut nice) {
                Ok(bytes) => {
                    attribution::with_reader(c.reader, || self.metrics.attribution.miss(bytes))
                }
                // A failing store ends the cursor; the chunks' readers will see why.
                Err(_) => continue,
            }
            if c.left > 0 && c.next < c.blob.toc.chunks.len() {
                self.streamer.lock().requeue(c);
            }
        }
    }

    /// Fetches the chunks of `run` neither cached nor in flight, without claiming them: decompressed
    /// and checked at the lowest priority, then claimed only to be kept and handed to any reader that
    /// came for them meanwhile. A reader never waits for this thread; at worst it fetches a chunk
    /// this thread is fetching too. Returns the compressed bytes fetched.
    fn stream_step(
        &self,
        blob: &BlobHandle,
        run: &[usize],
        nice: &mut Nice,
    ) -> Result<u64, FetchError> {
        let toc = &blob.toc;
        let missing: Vec<usize> = {
            let present = self.present(blob);
            let inflight = self.lock();
            run.iter()
                .copied()
                .filter(|&j| !present(j) && !inflight.contains_key(&toc.chunks[j].digest))
                .collect()
        };
        let mut fetched = 0;
        for part in frame_runs(toc, &missing) {
            let range = span(toc, &part);
            let bytes = self.read_range(blob, range.clone())?;
            self.metrics.streamed(bytes.len() as u64);
            fetched += bytes.len() as u64;
            nice.low();
            let results = self.checked(blob, &part, &bytes, range.start);
            nice.normal();
            let (mut js, mut fs, mut rs) = (Vec::new(), Vec::new(), Vec::new());
            {
                let present = self.present(blob);
                let mut inflight = self.lock();
                for (&j, r) in part.iter().zip(results) {
                    if r.is_ok() && !present(j) && !inflight.contains_key(&toc.chunks[j].digest) {
                        fs.extend(super::claim(&mut inflight, toc, &[j]));
                        js.push(j);
                        rs.push(r);
                    }
                }
            }
            self.land(blob, &js, &fs, &rs);
        }
        Ok(fetched)
    }
}

/// The streaming thread's priority: the lowest while it decompresses (CPU nobody else wants), its own
/// while it reads and keeps — so that neither a reader's claim nor the store's tripwire ever waits for
/// a thread the scheduler starves. Raising it back needs `CAP_SYS_NICE` (stratad has it as root);
/// without it the thread stays low.
#[derive(Default)]
struct Nice {
    /// The thread's own nice value, once read.
    own: Option<i32>,
}

impl Nice {
    fn low(&mut self) {
        use rustix::process::{getpriority_process, setpriority_process};
        if self.own.is_none() {
            self.own = getpriority_process(None).ok();
        }
        // `None`: the calling thread (Linux keeps nice values per thread).
        let _ = setpriority_process(None, 19);
    }

    fn normal(&self) {
        if let Some(n) = self.own {
            let _ = rustix::process::setpriority_process(None, n);
        }
    }
}

/// `chunks` (ascending) in runs whose frames are adjacent in the object: one range request each.
pub(super) fn frame_runs(toc: &Toc, chunks: &[usize]) -> Vec<Vec<usize>> {
    let mut runs: Vec<Vec<usize>> = Vec::new();
    for &j in chunks {
        let f = toc.chunks[j].frame;
        match runs.last_mut() {
            Some(r)
                if r.last().is_some_and(|&p| {
                    let fp = toc.chunks[p].frame;
                    f == fp || f == fp + 1
                }) =>
            {
                r.push(j)
            }
            _ => runs.push(vec![j]),
        }
    }
    runs
}

/// The compressed offset in the blob of chunk `i`'s frame.
fn offset(blob: &BlobHandle, i: usize) -> u64 {
    let toc = &blob.toc;
    toc.frames[toc.chunks[i].frame as usize].offset
}

/// The chunks from `from` on whose frames add up to `budget` compressed bytes (at least one chunk;
/// a frame counted once however many chunks it holds), and the bytes walked.
fn next_run(blob: &BlobHandle, from: usize, budget: u64) -> (Vec<usize>, u64) {
    let toc = &blob.toc;
    let (mut run, mut walked, mut last) = (Vec::new(), 0u64, None);
    for (j, c) in toc.chunks.iter().enumerate().skip(from) {
        if last != Some(c.frame) {
            if walked >= budget {
                break;
            }
            walked += u64::from(toc.frames[c.frame as usize].compressed);
            last = Some(c.frame);
        }
        run.push(j);
    }
    (run, walked)
}

#[cfg(test)]
#[path = "stream_tests.rs"]
mod tests;
