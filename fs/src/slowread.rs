//! Reads that must wait for the network, off the FUSE workers, bounded per blob, answered by a deadline.
//!
//! A FUSE worker answers a read itself when every chunk it needs is cached. Otherwise it gives the read
//! to this scheduler ([`SlowReads::submit`]), which runs it on the worker itself while fewer than
//! `max_inline` workers are doing so, and otherwise on the blob's own threads while the worker goes back
//! to the device: a store that hangs holds at most `max_inline` workers (all but [`FREE_WORKERS`]), so
//! it cannot stall the reads of other blobs, or of cached data, on the node.
//!
//! **Why some reads stay on the worker.** Handing a read over wakes another thread, and on a virtual
//! machine a wake-up of an idle CPU costs far more than a futex: the fat image's cold import (218 reads
//! that fetch) took 0.652 s handed over and 0.600 s served on the worker (median of 6 alternated runs,
//! lower in all 6; `benches/coldstart.py local`). A read on the worker is registered with the deadline
//! like any other, so a hung store still gets its readers `EIO` in time; only the worker waits longer.
//!
//! **Bounded per blob.** Each blob has a queue and at most `per_blob` threads working on it (each runs
//! the blob's queued reads one after another, then goes back to the node's pool, [`crate::workers`],
//! which keeps it — and its decompression context — for the next miss). Reads of a blob whose store hangs pile up as
//! queued memory, not threads; another blob gets threads of its own at once.
//!
//! **A deadline that holds whatever the store does** ([`crate::deadline`]). Every read is answered by
//! its deadline: the reaper answers `EIO` to any read not answered in time — queued, or held by a
//! thread still blocked in a fetch (which ends by itself later, under the store's own timeout, and then
//! finds its read answered). Each read is answered exactly once: whoever takes its [`Reply`] first
//! answers. After a read of a blob missed its deadline, reads of that blob that need the network fail
//! at once for a moment ([`crate::deadline::FailFast`]; cached data is still served: those reads
//! never come here).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use strata_registry::digest::Digest;

use rustix::io::Errno;

use crate::deadline::{FailFast, Reaper, Timer};
use crate::fuse::session::Reply;
use crate::workers::Workers;

/// Submitting threads (FUSE workers) kept free of reads that fetch, for everything else.
pub const FREE_WORKERS: usize = 2;

/// A slow read's failure: the errno, and whether the blob's store is unavailable (it timed out, as
/// opposed to, say, corrupt data or a refused connection).
pub struct SlowError {
    pub errno: Errno,
    pub unavailable: bool,
}

/// A read waiting to be served.
struct Pending {
    blob: Digest,
    reply: Mutex<Option<Reply>>,
}

impl Pending {
    fn take(&self) -> Option<Reply> {
        self.reply.lock().unwrap_or_else(|p| p.into_inner()).take()
    }
    fn answered(&self) -> bool {
        self.reply
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_none()
    }
}

/// What a slow read does once it has a thread: the bytes to answer, or the errno.
pub type Work = Box<dyn FnOnce() -> Result<Vec<u8>, SlowError> + Send>;

struct Job {
    pending: Arc<Pending>,
    work: Work,
    /// Disarmed once the work is done.
    timer: Timer<Arc<Pending>>,
}

#[derive(Default)]
struct Queue {
    jobs: VecDeque<Job>,
    threads: usize,
}

struct Shared {
    queues: Mutex<HashMap<Digest, Queue>>,
    failing: FailFast,
    per_blob: usize,
    /// Called with the number of reads answered `EIO` by the deadline.
    on_timeout: Box<dyn Fn() + Send + Sync>,
}

/// The scheduler of slow reads.
pub struct SlowReads {
    shared: Arc<Shared>,
    reaper: Reaper<Arc<Pending>>,
    workers: Workers,
    pub deadline: Duration,
    /// Reads the submitting threads may serve themselves at once (0: none; see the module
    /// documentation).
    max_inline: usize,
    /// Reads being served by their submitting threads now.
    inline: AtomicUsize,
    /// Reads their submitting threads served, since the start.
    served_inline: AtomicUsize,
}

impl SlowReads {
    /// A scheduler with at most `per_blob` threads per blob (taken from `workers`) and reads answered
    /// by `deadline`; `on_timeout` counts reads that missed it.
    pub fn new(
        workers: Workers,
        per_blob: usize,
        deadline: Duration,
        on_timeout: Box<dyn Fn() + Send + Sync>,
    ) -> std::io::Result<SlowReads> {
        let shared = Arc::new(Shared {
            queues: Mutex::new(HashMap::new()),
            failing: FailFast::default(),
            per_blob: per_blob.max(1),
            on_timeout,
        });
        let s = shared.clone();
        let reaper = Reaper::new("strata-deadline", move |p: Arc<Pending>| {
            if let Some(reply) = p.take() {
                reply.error(Errno::IO);
                (s.on_timeout)();
                s.failing.timed_out(p.blob);
            }
        })?;
        Ok(SlowReads {
            shared,
            reaper,
            workers,
            deadline,
            max_inline: 0,
            inline: AtomicUsize::new(0),
            served_inline: AtomicUsize::new(0),
        })
    }

    /// Reads the threads that submitted them served themselves, so far.
    pub fn served_inline(&self) -> usize {
        self.served_inline.load(Ordering::Relaxed)
    }

    /// Lets the threads that submit reads — `workers` of them — serve up to all but [`FREE_WORKERS`]
    /// reads at once themselves (see the module documentation).
    pub fn set_workers(&mut self, workers: usize) {
        self.max_inline = workers.saturating_sub(FREE_WORKERS);
    }

    /// Queues a read of `blob`; `work` runs on a thread of the blob's (unless the deadline passes
    /// first, and then `reply` gets `EIO`).
    pub fn submit(&self, blob: Digest, reply: Reply, work: Work) {
        if self.shared.failing.failing(&blob) {
            (self.shared.on_timeout)();
            return reply.error(Errno::IO);
        }
        let pending = Arc::new(Pending {
            blob,
            reply: Mutex::new(Some(reply)),
        });
        let timer = self
            .reaper
            .arm(Instant::now() + self.deadline, pending.clone());
        if self.inline.fetch_add(1, Ordering::AcqRel) < self.max_inline {
            self.served_inline.fetch_add(1, Ordering::Relaxed);
            self.shared.serve(
                blob,
                Job {
                    pending,
                    work,
                    timer,
                },
            );
            self.inline.fetch_sub(1, Ordering::AcqRel);
            return;
        }
        self.inline.fetch_sub(1, Ordering::AcqRel);
        let spawn = {
            let mut qs = self.shared.lock_queues();
            let q = qs.entry(blob).or_default();
            q.jobs.push_back(Job {
                pending,
                work,
                timer,
            });
            let spawn = q.threads < self.shared.per_blob;
            if spawn {
                q.threads += 1;
            }
            spawn
        };
        if spawn {
            let s = self.shared.clone();
            if self.workers.run(move || drain(&s, blob)).is_err() {
                // No thread to spare: the reads stay queued for the blob's other threads, or the
                // deadline answers them.
                let mut qs = self.shared.lock_queues();
                if let Some(q) = qs.get_mut(&blob) {
                    q.threads -= 1;
                }
            }
        }
    }
}

impl Shared {
    fn lock_queues(&self) -> std::sync::MutexGuard<'_, HashMap<Digest, Queue>> {
        self.queues.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// One of a blob's threads: runs its queued reads until none is left.
fn drain(s: &Shared, blob: Digest) {
    loop {
        let job = {
            let mut qs = s.lock_queues();
            let Some(q) = qs.get_mut(&blob) else { return };
            match q.jobs.pop_front() {
                Some(j) => j,
                None => {
                    q.threads -= 1;
                    if q.threads == 0 {
                        qs.remove(&blob);
                    }
                    return;
                }
            }
        };
        s.serve(blob, job);
    }
}

impl Shared {
    /// Runs one read: skipped if the deadline already answered it; otherwise the work answers it,
    /// unless the deadline takes the reply first (then the work's answer goes nowhere).
    fn serve(&self, blob: Digest, job: Job) {
        if job.pending.answered() {
            return;
        }
        let result = (job.work)();
        drop(job.timer);
        if let Err(SlowError {
            unavailable: true, ..
        }) = &result
        {
            self.failing.timed_out(blob);
        }
        if let Some(reply) = job.pending.take() {
            match result {
                Ok(bytes) => reply.data(&[&bytes]),
                Err(e) => reply.error(e.errno),
            }
        }
    }
}
