//! `fanotify` mount mode's data path: EROFS mounts local view files, the kernel asks before it reads.
//!
//! In `file` and `loop` modes every byte EROFS reads from a blob crosses FUSE, cached or not. Here each
//! blob's uncompressed view is a local sparse file ([`views`]) that EROFS mounts directly (file-backed,
//! `directio`); the files are watched by a *pre-content* fanotify group (Linux 6.14+). Before the
//! kernel reads a range of a view file it reports a `FAN_PRE_ACCESS` event with the range and waits;
//! the server makes sure every chunk in the range is in the file — fetch, decompress, verify, write —
//! and only then allows the read. A range already filled is allowed at once by the thread that read
//! the event: cached bytes are read by the kernel from the local file, with no copy through this
//! process, and once read they sit in EROFS's page cache and cause no event at all.
//!
//! **The view files are the cache.** Each view file is its blob's *home* ([`crate::fetch::ChunkHome`]):
//! the fetcher writes every chunk of the blob it verifies — the reader's own, the followers a miss
//! brings in the background, a plan's prefetch — straight into the view file, not into the chunk
//! cache. A fetched chunk is written to disk once, read back by nobody but the kernel, and held on disk
//! once. A reader whose misses follow one another (a sequential read) also gets chunks another mode
//! left in the chunk cache filled after its own range is answered (nothing is fetched for that); and a
//! view file whose every chunk is filled is no longer watched, so its reads cost no event at all — the
//! kernel's speed.
//!
//! **No read sees a hole.** An event is allowed only after every chunk it covers was written and
//! verified; a fetch that fails or misses the read deadline denies the read with `EIO` — and a fill
//! blocked in its store past the deadline has its read denied by a reaper meanwhile ([`deadline`]);
//! fill threads are started while all are busy, up to a bound, so a hung blob holds up no other
//! ([`crate::workers::Workers::bounded`]). The server's
//! own accesses to a view file (see [`views`]) are the only events allowed unfilled. A write that
//! finds the disk full asks the daemon for room first ([`Server::on_full`]: it deletes the view files
//! no mounted layer reads) and is tried once more; only then is the read denied.
//!
//! **Survival.** The group's descriptor is kept by the node's keeper (the holder or systemd's store,
//! as FUSE connections are: name [`GROUP`]), so marks and waiting readers outlive a server. A read the
//! kernel reported to a server that died waits in the group for an answer that only the dead server's
//! descriptor number can give — the kernel matches answers by that number, not by the process. So each
//! server records every event it takes in a journal kept beside the group ([`JOURNAL`]; the FUSE
//! request journal's shared-memory slots, [`crate::fuse::journal`]): blob, range, reader and the
//! descriptor number; cleared after the answer. A successor answers every recorded event once its
//! range is filled. Until then it holds each recorded number in its own descriptor table (a
//! placeholder `dup`ed to exactly that number, or the number is already taken): the kernel then cannot
//! give the number to a new event, so no answer can reach an event it was not meant for (the kernel
//! answers the oldest event of a number). Events are read in batches straight into shared memory kept
//! with the journal ([`area`]), so a server killed between a read and its records strands nothing: a
//! successor finds the batch there, records what no slot holds, fills each range (in every view file
//! when the dead server had not yet learned the event's blob) and answers it. The numbers are taken
//! and held when the successor is made ([`Server::new`]), before its start opens more descriptors.

pub mod area;
mod events;
pub mod evict;
pub mod follow;
pub mod pages;
pub mod room;
pub mod sys;
pub mod views;

use std::os::fd::{OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;

use strata_registry::digest::Digest;

use crate::blobfs::BlobTable;
use crate::deadline;
use crate::fetch::{BlobHandle, FetchError, Fetcher};
use crate::fuse::journal::{Journal, Leftover};
use crate::metrics::Metrics;
use crate::workers::Workers;
use area::EventArea;
use sys::{Answer, Group};
use views::{FillError, ViewFile, Views};

/// The keeper's name for the group's descriptor.
pub const GROUP: &str = "fanotify-group";
/// The keeper's name for the event journal's.
pub const JOURNAL: &str = "fanotify-journal";
/// Slots in the event journal: more than the fill workers ever have in flight.
const JOURNAL_SLOTS: usize = 1024;
/// Threads filling ranges, kept (each waits on fetches; a local store keeps few busy).
const WORKERS: usize = 16;
/// Threads filling ranges at most: more are started while all are busy, up to half what the journal
/// records ([`Workers::bounded`]).
const MAX_WORKERS: usize = JOURNAL_SLOTS / 2;
/// How long a fill thread started for a burst waits for more before it ends.
const FILL_IDLE: std::time::Duration = std::time::Duration::from_secs(5);
/// Chunks filled ahead of a sequential reader's miss (the blob server's read-ahead, `fetch::READ_AHEAD`).
const READ_AHEAD: usize = crate::fetch::READ_AHEAD;
/// How often the event loop looks at its stop flag.
const POLL_MS: i32 = 200;

/// Counters for the metrics page and tests.
#[derive(Default)]
pub struct Stats {
    /// Events allowed at once (every chunk already filled).
    pub hits: AtomicU64,
    /// Events that filled chunks first.
    pub fills: AtomicU64,
    /// Events denied (fetch failed or timed out).
    pub denied: AtomicU64,
    /// Events a predecessor left, answered by this server.
    pub adopted: AtomicU64,
    /// Fills that found the disk full and were tried again after the daemon freed room.
    pub relieved: AtomicU64,
}

/// A read taken and not yet answered: what its fill thread and the reaper share.
struct Pending {
    number: RawFd,
    /// Its journal record, cleared after the answer.
    slot: Option<usize>,
    /// The view files its range is filled in: its blob's; every one for a read a predecessor left
    /// before it knew the blob.
    views: Vec<Arc<ViewFile>>,
    offset: u64,
    count: u64,
    pid: u32,
    /// A predecessor read the event (and may have answered it before it died).
    adopted: bool,
    /// Taken by whoever answers: the fill thread, or the reaper at the deadline ([`deadline`]).
    once: deadline::Once,
}

/// A read to fill, then answer, on a fill thread ([`Context::hand`]).
struct Job {
    read: Arc<Pending>,
    /// Holds the event's number until after the answer, so that it cannot go to another event
    /// before: the event's descriptor, or for a read a predecessor left the placeholder this server
    /// took (see the module documentation).
    hold: Option<OwnedFd>,
    /// Disarmed when the job is done.
    _timer: Option<deadline::Timer<Arc<Pending>>>,
}

impl Job {
    /// `read`, armed to be denied at `due` unless answered before.
    fn armed(
        read: Pending,
        hold: Option<OwnedFd>,
        reaper: Option<&deadline::Reaper<Arc<Pending>>>,
        due: std::time::Instant,
    ) -> Job {
        let read = Arc::new(read);
        Job {
            _timer: reaper.map(|r| r.arm(due, read.clone())),
            read,
            hold,
        }
    }
}

/// A journal record's blob when the event's blob was not known: every view file is filled.
const ANY_BLOB: Digest = Digest([0; 32]);

/// The pre-content server of a node.
pub struct Server {
    group: Arc<Group>,
    journal: Arc<Journal>,
    pub views: Arc<Views>,
    fetcher: Arc<Fetcher>,
    metrics: Arc<Metrics>,
    /// The node's blobs: its recorder (`strata trace`, plan recording) hears of every range read.
    table: Arc<BlobTable>,
    pub stats: Arc<Stats>,
    stop: Arc<AtomicBool>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    /// What a predecessor left, each number held: taken when the server is made, answered by `run`.
    left: Mutex<Vec<(Leftover, Option<OwnedFd>)>>,
    relief: Arc<OnceLock<Relief>>,
    failing: Arc<deadline::FailFast>,
    /// What eviction punched out ([`Server::evict`]).
    pub evicted: evict::Stats,
    /// Held by an eviction pass; [`Server::stop`] waits for it, so no punch follows a handover.
    evicting: Mutex<()>,
    /// The view files' free space kept and their reserve ([`room`]), when the node keeps them.
    pub room: Option<room::Room>,
    /// Whether the event loop keeps to its readers' CPU ([`follow`]; on unless turned off).
    follow: bool,
    /// The event loop's thread id, once it runs (0 before).
    loop_tid: Arc<std::sync::atomic::AtomicI32>,
}

/// Frees disk space for the view files when a fill finds their disk full: whether it freed any.
pub type Relief = Box<dyn Fn() -> bool + Send + Sync>;

/// Why the server could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("fanotify pre-content group: {0}")]
    Group(std::io::Error),
    #[error("fanotify event journal: {0}")]
    Journal(std::io::Error),
    #[error("view files in {dir}: {source}")]
    Views {
        dir: PathBuf,
        source: std::io::Error,
    },
}

impl Server {
    /// A server on `kept` (a predecessor's group and journal, adopted) or on a new group. Does not
    /// read events until [`Server::run`].
    pub fn new(
        views_dir: &Path,
        kept: Option<(OwnedFd, OwnedFd)>,
        fetcher: Arc<Fetcher>,
        metrics: Arc<Metrics>,
        table: Arc<BlobTable>,
    ) -> Result<Server, StartError> {
        let (group, journal, left) = match kept {
            Some((g, j)) => {
                let (group, journal) = (
                    Group::from_fd(g),
                    Journal::from_fd(j).map_err(StartError::Journal)?,
                );
                let left = take_leftovers(&group, &journal);
                (group, journal, left)
            }
            None => (
                Group::new().map_err(StartError::Group)?,
                Journal::create_with(JOURNAL_SLOTS).map_err(StartError::Journal)?,
                Vec::new(),
            ),
        };
        let views = Views::new(views_dir).map_err(|source| StartError::Views {
            dir: views_dir.to_path_buf(),
            source,
        })?;
        Ok(Server {
            group: Arc::new(group),
            journal: Arc::new(journal),
            views: Arc::new(views),
            fetcher,
            metrics,
            table,
            stats: Arc::default(),
            stop: Arc::default(),
            threads: Mutex::default(),
            left: Mutex::new(left),
            relief: Arc::default(),
            failing: Arc::default(),
            evicted: evict::Stats::default(),
            evicting: Mutex::new(()),
            room: None,
            follow: true,
            loop_tid: Arc::default(),
        })
    }

    /// This server with the view files' room kept as `room` says (before it is shared).
    pub fn with_room(mut self, room: room::Room) -> Server {
        self.room = Some(room);
        self
    }

    /// The event loop thread's id, once [`Server::run`] started it.
    pub fn loop_tid(&self) -> Option<i32> {
        Some(self.loop_tid.load(Ordering::Acquire)).filter(|&t| t > 0)
    }

    /// Whether the event loop keeps to the CPU of the readers it answers ([`follow`]).
    pub fn following_readers(mut self, on: bool) -> Server {
        self.follow = on;
        self
    }

    /// The descriptors to keep for successors: `(name, descriptor)`.
    pub fn kept(&self) -> [(&'static str, std::os::fd::BorrowedFd<'_>); 2] {
        [(GROUP, self.group.fd()), (JOURNAL, self.journal.fd())]
    }

    /// The view file of `blob`, opened and watched if it was not open yet.
    pub fn view(&self, blob: &Arc<BlobHandle>) -> std::io::Result<PathBuf> {
        let g = self.group.clone();
        Ok(self.views.open(blob, |p| g.mark(p))?.path.clone())
    }

    /// [`Server::view`] for a mount about to open the file, which must be watched when it does:
    /// Linux decides at open whether a descriptor reports pre-content events (whether its file is
    /// watched then), so a mount that opened an unwatched file would never ask before it reads — a
    /// chunk a scrub found bad and made a hole would be read as it is on disk (seen on 6.18: a
    /// descriptor opened while its file was unwatched reported no event once the file was watched
    /// again). So a complete file is watched again, and stays so until [`Server::mounted`].
    pub fn mounting(&self, blob: &Arc<BlobHandle>) -> std::io::Result<PathBuf> {
        let g = self.group.clone();
        let v = self.views.open(blob, |p| g.mark(p))?;
        let _watch = v.watch.lock().unwrap_or_else(|p| p.into_inner());
        if v.unmarked.load(Ordering::Acquire) {
            self.group.mark(&v.path)?;
            v.unmarked.store(false, Ordering::Release);
        }
        v.opening.fetch_add(1, Ordering::AcqRel);
        Ok(v.path.clone())
    }

    /// A mount opened the view files of `blobs` ([`Server::mounting`]), or failed to: the complete
    /// ones are no longer watched (their reads then cost no event).
    pub fn mounted(&self, blobs: &[Digest]) {
        let ctx = self.context();
        for d in blobs {
            if let Some(v) = self.views.get(d) {
                let _ = v
                    .opening
                    .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1));
                ctx.unmark_if_complete(&v);
            }
        }
    }

    /// Sets what a fill that finds the view files' disk full calls before it tries once more (the
    /// daemon deletes the view files no mounted layer reads). Set once; later calls are ignored.
    pub fn on_full(&self, relief: Relief) {
        let _ = self.relief.set(relief);
    }

    /// One eviction pass ([`evict`]): the view files of `allowed` blobs lose their least recently
    /// used chunks until all view files — `disk` bytes now ([`Views::disk_bytes`], which the caller
    /// has just counted) — fit `bound` (or nothing more may go), each punched out `grace` after it
    /// was marked.
    pub fn evict(
        &self,
        allowed: &std::collections::HashSet<Digest>,
        bound: u64,
        grace: std::time::Duration,
        disk: u64,
    ) -> evict::Pass {
        let _pass = self.evicting.lock().unwrap_or_else(|p| p.into_inner());
        if self.stop.load(Ordering::Acquire) {
            return evict::Pass::default();
        }
        let views: Vec<_> = self
            .views
            .all()
            .into_iter()
            .filter(|v| allowed.contains(&v.blob.blob.digest))
            .collect();
        let p = evict::pass(&views, disk, bound, grace, |path| self.group.mark(path));
        self.evicted
            .chunks
            .fetch_add(p.punched.0 as u64, Ordering::Relaxed);
        self.evicted.bytes.fetch_add(p.punched.1, Ordering::Relaxed);
        p
    }

    /// Trims the view files to `bound` bytes, keeping every blob in `used` ([`Views::trim`]).
    pub fn trim(&self, used: &std::collections::HashSet<Digest>, bound: u64) -> (u64, u64) {
        self.views.trim(used, bound, |p| {
            if let Err(e) = self.group.unmark(p) {
                tracing::debug!(path = %p.display(), error = %e, "unwatching a trimmed view file");
            }
        })
    }

    /// Answers what a predecessor left (every range filled first), then serves events until
    /// [`Server::stop`]. Every blob whose view file may be read must have been opened ([`Server::view`])
    /// before: events for files the server does not know are denied.
    pub fn run(&self) {
        let ctx = Arc::new(self.context());
        let fills = Workers::bounded("fan-fill", FILL_IDLE, WORKERS, MAX_WORKERS);
        let late = self.context();
        let reaper = deadline::Reaper::new("fan-deadline", move |l| late.late(l))
            .map_err(|e| tracing::error!(error = %e, "no deadline thread: a read whose store blocks waits for it"))
            .ok();
        let due = std::time::Instant::now() + self.fetcher.deadline;
        for (read, hold) in self.leftover_reads() {
            ctx.hand(&fills, Job::armed(read, hold, reaper.as_ref(), due));
        }
        let mut threads = self.threads.lock().unwrap_or_else(|p| p.into_inner());
        let (stop, views) = (self.stop.clone(), self.views.clone());
        match std::thread::Builder::new()
            .name("fan-pages".into())
            .spawn(move || drop_pages(&views, &stop))
        {
            Ok(t) => threads.push(t),
            Err(e) => {
                tracing::error!(error = %e, "cannot start the view files' page dropper: read data stays cached twice")
            }
        }
        let (stop, views, tid) = (self.stop.clone(), self.views.clone(), self.loop_tid.clone());
        match std::thread::Builder::new()
            .name("fan-events".into())
            .spawn(move || {
                tid.store(
                    rustix::thread::gettid().as_raw_nonzero().get(),
                    Ordering::Release,
                );
                events::event_loop(&ctx, &views, &stop, &fills, reaper.as_ref())
            }) {
            Ok(t) => threads.push(t),
            Err(e) => tracing::error!(error = %e, "cannot start the fanotify event loop"),
        }
    }

    /// Checks the data at rest of every open view file ([`ViewFile::scrub`]). A file with a bad
    /// chunk that was no longer watched (complete) is watched again, so the chunk's next read refills
    /// it. Returns the files and what was checked.
    pub fn scrub(&self) -> (usize, views::Scrubbed) {
        let files = self.views.all();
        let mut sum = views::Scrubbed::default();
        for v in &files {
            let s = v.scrub();
            let _watch = v.watch.lock().unwrap_or_else(|p| p.into_inner());
            if s.bad > 0 && v.unmarked.swap(false, Ordering::AcqRel) {
                if let Err(e) = self.group.mark(&v.path) {
                    tracing::error!(path = %v.path.display(), error = %e,
                        "scrub: cannot watch a view file with a bad chunk again: its reads are not refilled");
                }
            }
            sum += s;
        }
        (files.len(), sum)
    }

    /// Counters and the journal's state, for `GET /v1/status`.
    pub fn status(&self) -> serde_json::Value {
        let n = |c: &AtomicU64| c.load(Ordering::Relaxed);
        serde_json::json!({
            "hits": n(&self.stats.hits),
            "fills": n(&self.stats.fills),
            "denied": n(&self.stats.denied),
            "adopted": n(&self.stats.adopted),
            "relieved": n(&self.stats.relieved),
            "evicted_chunks": n(&self.evicted.chunks),
            "evicted_bytes": n(&self.evicted.bytes),
            "evicting_bytes": self.views.all().iter().map(|v| v.evicting_bytes()).sum::<u64>(),
            "unrecorded": n(&self.journal.unrecorded),
            "views": self.views.len(),
            "kept_chunks": self.views.all().iter().map(|v| v.kept()).sum::<usize>(),
            "disk_bytes": self.views.disk_bytes(),
            "room": self.room.as_ref().map(|r| r.status()),
        })
    }

    /// Stops reading events (a handover or shutdown); ranges being filled are finished and answered.
    pub fn stop(&self) {
        self.stop.store(true, Ordering::Release);
        // A successor knows nothing of this server's marks: no punch may come after this returns.
        drop(self.evicting.lock().unwrap_or_else(|p| p.into_inner()));
    }

    fn context(&self) -> Context {
        Context {
            group: self.group.clone(),
            journal: self.journal.clone(),
            fetcher: self.fetcher.clone(),
            metrics: self.metrics.clone(),
            table: self.table.clone(),
            stats: self.stats.clone(),
            relief: self.relief.clone(),
            failing: self.failing.clone(),
            follow: self.follow,
        }
    }

    /// The reads a predecessor left (taken and held by [`Server::new`]). Call before reading new
    /// events, with every view file open ([`Server::view`]).
    fn leftover_reads(&self) -> Vec<(Pending, Option<OwnedFd>)> {
        let left = std::mem::take(&mut *self.left.lock().unwrap_or_else(|p| p.into_inner()));
        if !left.is_empty() {
            tracing::info!(
                events = left.len(),
                "answering reads a previous server left"
            );
        }
        let mut jobs = Vec::new();
        for (l, hold) in left {
            let Some((digest, offset, count, pid)) = decode(&l.bytes) else {
                tracing::error!(slot = l.slot, "unreadable fanotify journal record: dropped");
                self.journal.clear(l.slot);
                continue;
            };
            let number = (l.unique - 1) as RawFd;
            self.stats.adopted.fetch_add(1, Ordering::Relaxed);
            let views = match digest {
                ANY_BLOB => self.views.all(),
                d => self.views.get(&d).into_iter().collect(),
            };
            if views.is_empty() && digest != ANY_BLOB {
                tracing::error!(blob = %digest, "a left read of a blob this server does not serve: denied");
                let _ = self.group.answer(number, Answer::Deny(libc::EIO));
                self.journal.clear(l.slot);
                continue;
            }
            let read = Pending {
                number,
                slot: Some(l.slot),
                views,
                offset,
                count,
                pid,
                adopted: true,
                once: deadline::Once::default(),
            };
            jobs.push((read, hold));
        }
        jobs
    }
}

/// Takes what a dead predecessor left (before this server reads an event): the reads in its journal,
/// and those of its last batch in the event area that it had not recorded — recorded now, so that a
/// successor of this server finds them too if it dies first. The predecessor's own accesses and
/// events without content are answered at once (nothing to fill). Every number left is held
/// ([`hold_number`]).
fn take_leftovers(group: &Group, journal: &Journal) -> Vec<(Leftover, Option<OwnedFd>)> {
    let mut left = journal.slot_leftovers();
    let stranded = EventArea::of(journal)
        .map(|a| a.stranded())
        .unwrap_or_default();
    for (ev, blob) in stranded.events {
        let Some(number) = ev.fd else { continue };
        let unique = number as u64 + 1;
        if left.iter().any(|l| l.unique == unique) {
            continue; // recorded: the same event (its number stayed taken until it was cleared)
        }
        match ev.range.filter(|_| ev.mask & sys::FAN_PRE_ACCESS != 0) {
            Some((offset, count)) if ev.pid != stranded.pid => {
                let bytes = encode(&blob.unwrap_or(ANY_BLOB), offset, count, ev.pid);
                let slot = journal.record(unique, &bytes).unwrap_or(usize::MAX);
                left.push(Leftover {
                    slot,
                    unique,
                    bytes,
                });
            }
            _ => {
                if let Err(e) = group.answer(number, Answer::Allow) {
                    tracing::debug!(fd = number, error = %e, "a left event needing no fill");
                }
            }
        }
    }
    left.into_iter()
        .map(|l| {
            let hold = hold_number((l.unique - 1) as RawFd);
            (l, hold)
        })
        .collect()
}

/// Takes descriptor number `n` in this process with a placeholder, if it is free: `None` if it is
/// already taken (then the kernel cannot give it to an event either).
fn hold_number(n: RawFd) -> Option<OwnedFd> {
    // SAFETY: F_GETFD only asks whether the number is open.
    if n < 0 || unsafe { libc::fcntl(n, libc::F_GETFD) } >= 0 {
        return None;
    }
    use std::os::fd::AsRawFd;
    let placeholder = OwnedFd::from(std::fs::File::open("/dev/null").ok()?);
    if placeholder.as_raw_fd() == n {
        return Some(placeholder);
    }
    // F_DUPFD_CLOEXEC takes the lowest free number at or above `n`: exactly `n` unless another thread
    // took it since the check (then it is taken, which is as good).
    let got = rustix::io::fcntl_dupfd_cloexec(&placeholder, n).ok()?;
    (got.as_raw_fd() == n).then_some(got)
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop();
    }
}

/// What the event loop and the fill threads share.
#[derive(Clone)]
struct Context {
    group: Arc<Group>,
    journal: Arc<Journal>,
    fetcher: Arc<Fetcher>,
    metrics: Arc<Metrics>,
    table: Arc<BlobTable>,
    stats: Arc<Stats>,
    relief: Arc<OnceLock<Relief>>,
    /// Blobs whose reads fail at once for a moment: one of their fetches missed the deadline.
    failing: Arc<deadline::FailFast>,
    /// Whether the event loop keeps to its readers' CPU ([`follow`]).
    follow: bool,
}

impl Context {
    /// Fills the chunks under a range: the answer to give (the caller counts the fill). A disk found
    /// full gets one more try if the daemon could free room ([`Server::on_full`]).
    fn fill(&self, view: &ViewFile, offset: u64, count: u64, pid: u32) -> Answer {
        let range = view.chunks_in(offset, count);
        if self.failing.failing(&view.blob.blob.digest) && !view.filled(range.clone()) {
            self.stats.denied.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(blob = %view.blob.blob.digest, offset, count,
                "read denied: a fetch of its blob missed the deadline just now");
            return Answer::Deny(libc::EIO);
        }
        let mut filled = view.fill(&self.fetcher, range.clone(), pid);
        if filled.as_ref().is_err_and(FillError::is_full) && self.relief.get().is_some_and(|r| r())
        {
            self.stats.relieved.fetch_add(1, Ordering::Relaxed);
            filled = view.fill(&self.fetcher, range, pid);
        }
        match filled {
            Ok(()) => Answer::Allow,
            Err(e) => {
                if matches!(e, FillError::Fetch(FetchError::Timeout { .. })) {
                    self.failing.timed_out(view.blob.blob.digest);
                }
                self.stats.denied.fetch_add(1, Ordering::Relaxed);
                self.metrics.error(match &e {
                    FillError::Fetch(f) => f.kind(),
                    _ => "cache",
                });
                tracing::warn!(blob = %view.blob.blob.digest, offset, count, error = %e,
                    "read denied: range not filled");
                Answer::Deny(libc::EIO)
            }
        }
    }

    /// Hands `job` to a fill thread (here, if none can be started).
    fn hand(self: &Arc<Self>, fills: &Workers, job: Job) {
        let ctx = self.clone();
        fills.run_or_here(move || ctx.work(job));
    }

    /// Fills a job's range and answers it, unless the reaper denied it while it waited for a thread.
    fn work(&self, job: Job) {
        if job.read.once.taken() {
            return;
        }
        if job.read.adopted {
            self.adopt(job)
        } else {
            self.finish(job)
        }
    }

    /// Answers a read once (unless the reaper did: the fill outlived the deadline) and clears its
    /// record. A read a predecessor left may have been answered by it before it died: nothing waits
    /// on that number then (`ENOENT`).
    fn answer_once(&self, read: &Pending, answer: Answer) {
        if read.once.take() {
            self.answer_taken(read, answer);
        }
    }

    /// [`Context::answer_once`] by the one that took the read's right to answer.
    fn answer_taken(&self, read: &Pending, answer: Answer) {
        match self.group.answer(read.number, answer) {
            Err(e) if read.adopted && e.raw_os_error() == Some(libc::ENOENT) => {
                tracing::debug!(fd = read.number, "a left event was answered already")
            }
            Err(e) => {
                tracing::error!(fd = read.number, error = %e, "cannot answer a fanotify event")
            }
            Ok(()) => {}
        }
        if let Some(s) = read.slot {
            self.journal.clear(s);
        }
    }

    /// Fills a new event's range, answers it, then reads ahead for a sequential reader.
    fn finish(&self, job: Job) {
        let read = &job.read;
        let view = &read.views[0];
        let range = view.chunks_in(read.offset, read.count);
        let sequential = view.follows(&range);
        let answer = self.fill(view, read.offset, read.count, read.pid);
        if answer == Answer::Allow {
            self.stats.fills.fetch_add(1, Ordering::Relaxed);
            view.touched.note(read.offset, read.count, false);
            view.note_used(range.clone());
        }
        self.answer_once(read, answer);
        drop(job.hold);
        if sequential && answer == Answer::Allow {
            // After the answer: the reader goes on while this thread fills what it reads next —
            // only chunks the chunk cache holds (the miss's followers write themselves here as
            // they land): reading ahead fetches nothing more. Not for scattered misses: filling their
            // neighbours as well cut the cold import's misses from 454 to 291 but not its time
            // (1.25 s against 1.30 s, runs vary by ±0.15 s), for more disk writes and CPU. A
            // failure is the next read's to report.
            let ahead = view.ahead(&range, READ_AHEAD);
            if let Err(e) = view.fill_cached(&self.fetcher, ahead) {
                tracing::debug!(blob = %view.blob.blob.digest, error = %e, "read-ahead failed");
            }
        }
        self.unmark_if_complete(view);
    }

    /// Denies a read whose fill thread has not answered it by the deadline (its fetch is blocked in
    /// the store: [`deadline`]); reads of its blob that need the store then fail at once for a moment.
    /// Reads a successor adopted are under the same deadline, counted from its start.
    fn late(&self, read: Arc<Pending>) {
        if !read.once.take() {
            return;
        }
        self.stats.denied.fetch_add(1, Ordering::Relaxed);
        self.metrics.error("timeout");
        // Not every blob for a read whose blob its dead server never learned: one stuck store
        // must not fail the others' reads.
        if let [v] = &read.views[..] {
            self.failing.timed_out(v.blob.blob.digest);
        }
        tracing::warn!(offset = read.offset, count = read.count, adopted = read.adopted,
            blob = %read.views.first().map(|v| v.blob.blob.digest.to_string()).unwrap_or_default(),
            "read denied: not filled by the deadline (the store does not answer)");
        self.answer_taken(&read, Answer::Deny(libc::EIO));
    }

    /// Fills what a predecessor left, then answers it: allowed only if its range is in every view
    /// file it was filled in.
    fn adopt(&self, job: Job) {
        let read = &job.read;
        let mut answer = Answer::Allow;
        for v in &read.views {
            if self.fill(v, read.offset, read.count, read.pid) != Answer::Allow {
                answer = Answer::Deny(libc::EIO);
            }
        }
        // One event, one fill, however many view files a range of an unknown blob was filled in.
        if answer == Answer::Allow {
            self.stats.fills.fetch_add(1, Ordering::Relaxed);
        }
        self.answer_once(read, answer);
        drop(job.hold);
        for v in &read.views {
            self.unmark_if_complete(v);
        }
    }

    /// Stops watching a view file once every chunk is in it: its reads then cost no event at all.
    fn unmark_if_complete(&self, view: &ViewFile) {
        let _watch = view.watch.lock().unwrap_or_else(|p| p.into_inner());
        if view.opening.load(Ordering::Acquire) > 0 {
            return;
        }
        if view.complete() && !view.unmarked.swap(true, Ordering::AcqRel) {
            match self.group.unmark(&view.path) {
                Ok(()) => {
                    tracing::debug!(blob = %view.blob.blob.digest, "view file complete: unwatched")
                }
                Err(e) => tracing::warn!(blob = %view.blob.blob.digest, error = %e,
                    "cannot unwatch a complete view file"),
            }
        }
    }

    fn answer(&self, number: RawFd, answer: Answer) {
        if let Err(e) = self.group.answer(number, answer) {
            tracing::error!(fd = number, error = %e, "cannot answer a fanotify event");
        }
    }
}

/// Drops the view files' pages the kernel has had ([`pages`]) until `stop`, and once more after it
/// (a handover: the successor starts with nothing noted).
fn drop_pages(views: &Views, stop: &AtomicBool) {
    while !stop.load(Ordering::Acquire) {
        std::thread::sleep(pages::PASS);
        pages::drop_pass(&views.all(), std::time::Instant::now());
    }
    let later = std::time::Instant::now() + pages::DELAY;
    pages::drop_pass(&views.all(), later);
}

/// A journal record: blob digest, offset, count, reader.
fn encode(d: &Digest, offset: u64, count: u64, pid: u32) -> Vec<u8> {
    let mut b = Vec::with_capacity(52);
    b.extend_from_slice(&d.0);
    b.extend_from_slice(&offset.to_le_bytes());
    b.extend_from_slice(&count.to_le_bytes());
    b.extend_from_slice(&pid.to_le_bytes());
    b
}

fn decode(b: &[u8]) -> Option<(Digest, u64, u64, u32)> {
    let b: &[u8; 52] = b.try_into().ok()?;
    let mut d = [0u8; 32];
    d.copy_from_slice(&b[..32]);
    let u64_at = |o: usize| {
        let mut x = [0u8; 8];
        x.copy_from_slice(&b[o..o + 8]);
        u64::from_le_bytes(x)
    };
    let pid = u32::from_le_bytes([b[48], b[49], b[50], b[51]]);
    Some((Digest(d), u64_at(32), u64_at(40), pid))
}

#[cfg(test)]
#[path = "tests.rs"]
mod tests;
