//! Reused threads for the data plane's background work: the fetcher's follower and read-behind
//! requests ([`crate::fetch`]) and the slow-read scheduler's per-blob threads ([`crate::slowread`]).
//!
//! **Why not a thread per job.** Each cold miss used to start one or two threads (the followers' request,
//! the slow read's worker), and each new thread paid for its start (a `clone`, a stack mapping) and —
//! the larger part — for a fresh zstd decompression context on its first frame: the context is
//! per-thread ([`strata_registry::toc::decompress`]), about 100 KiB of tables set up again. A thread
//! kept here keeps its context.
//!
//! **Why elastic, not a fixed pool.** Jobs block, and on each other: a slow read waits for its chunk's
//! fetch, whose followers are another job; a leader waits for the store. A fixed pool whose threads all
//! wait on jobs queued behind them would hang until the deadlines answered `EIO`. So a job never queues
//! behind busy threads: it goes to an idle thread if one is waiting, and otherwise a new thread starts —
//! the concurrency of a spawn per job, without its cost when threads are free. A thread idle for
//! `idle_for` ends unless at most `keep` threads would then be left idle, so a burst's threads do not
//! stay forever, and the few a steady trickle of misses needs are always there.
//!
//! **Bounded, where jobs do not wait on each other** ([`Workers::bounded`]). `fanotify` mode's fill
//! threads each wait on a store read, never on another fill: a blob whose store hangs must not take
//! every thread (its reads would queue the others behind theirs — found by the faults suite: a healthy
//! blob's 16 reads took 92 s beside 256 reads of a hung one with a fixed 16), but a thread per event
//! without a bound is a thread per waiting reader. There, past `max` threads a job queues for the next
//! thread done.
//!
//! **Where its threads run.** A thread inherits the CPUs its starter may use, and a starter may be
//! pinned for a while (`fanotify` mode's event loop keeps to its readers' CPU, [`crate::fanotify::follow`]):
//! so each new thread takes the CPUs the pool's maker could use when it made the pool.
//!
//! Invariants (under the lock): `idle` counts the threads waiting for a job; every queued job is taken
//! by one of them or by a busy thread when it is done (a job is queued only when `idle > jobs.len()`
//! or `max` threads live, else it starts a thread of its own); `threads` counts live threads, and a job
//! that panics still leaves its thread counted correctly (the panic is caught and logged; the thread
//! goes on). When the last handle of a pool is dropped, its threads end once the jobs queued are done.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

type Job = Box<dyn FnOnce() + Send + 'static>;

/// A job the pool could not run (no thread could be started): the caller runs it, or drops it.
pub struct NotStarted {
    pub job: Job,
    pub error: std::io::Error,
}

/// An elastic pool of named threads; cloning shares it.
#[derive(Clone)]
pub struct Workers {
    shared: Arc<Shared>,
    /// Held by every handle, not by the threads: its drop ends them ([`Open`]).
    _open: Arc<Open>,
}

/// Ends the pool's threads when the last handle goes.
struct Open(Arc<Shared>);

impl Drop for Open {
    fn drop(&mut self) {
        self.0.lock().closed = true;
        self.0.wake.notify_all();
    }
}

struct Shared {
    name: &'static str,
    idle_for: Duration,
    keep: usize,
    /// Threads at most (`usize::MAX`: unbounded).
    max: usize,
    state: Mutex<State>,
    wake: Condvar,
    started: AtomicU64,
    /// The CPUs the pool's threads may use: its maker's when it made the pool.
    cpus: Option<rustix::thread::CpuSet>,
}

#[derive(Default)]
struct State {
    jobs: VecDeque<Job>,
    idle: usize,
    threads: usize,
    /// No handle is left: threads end once the queue is empty.
    closed: bool,
}

/// How long a thread beyond the kept ones waits for work before it ends.
pub const IDLE_FOR: Duration = Duration::from_secs(30);
/// Idle threads kept however long they wait.
pub const KEEP: usize = 4;

impl Workers {
    /// A pool whose threads are named `name` and end after `idle_for` without work, keeping `keep`.
    pub fn new(name: &'static str, idle_for: Duration, keep: usize) -> Workers {
        Workers::bounded(name, idle_for, keep, usize::MAX)
    }

    /// [`Workers::new`] with at most `max` threads: past them, jobs queue (see the module
    /// documentation: only for jobs that never wait on each other).
    pub fn bounded(name: &'static str, idle_for: Duration, keep: usize, max: usize) -> Workers {
        let shared = Arc::new(Shared {
            name,
            idle_for,
            keep,
            max: max.max(1),
            state: Mutex::new(State::default()),
            wake: Condvar::new(),
            started: AtomicU64::new(0),
            cpus: rustix::thread::sched_getaffinity(None).ok(),
        });
        Workers {
            _open: Arc::new(Open(shared.clone())),
            shared,
        }
    }

    /// Runs `job` on an idle thread, or on a new one when none is idle (below the bound; at it, on
    /// the next thread free).
    pub fn run(&self, job: impl FnOnce() + Send + 'static) -> Result<(), NotStarted> {
        let job: Job = Box::new(job);
        {
            let mut st = self.shared.lock();
            if st.idle > st.jobs.len() || st.threads >= self.shared.max {
                st.jobs.push_back(job);
                drop(st);
                self.shared.wake.notify_one();
                return Ok(());
            }
            st.threads += 1;
        }
        // The job travels to the new thread in a slot the caller can take back if no thread starts.
        let slot = Arc::new(Mutex::new(Some(job)));
        let (theirs, shared) = (slot.clone(), self.shared.clone());
        let spawned = std::thread::Builder::new()
            .name(self.shared.name.into())
            .spawn(move || {
                if let Some(set) = &shared.cpus {
                    if let Err(e) = rustix::thread::sched_setaffinity(None, set) {
                        tracing::debug!(pool = shared.name, error = %e, "a worker's CPUs");
                    }
                }
                let first = theirs.lock().unwrap_or_else(|p| p.into_inner()).take();
                if let Some(job) = first {
                    shared.work(job);
                }
                shared.serve();
            });
        match spawned {
            Ok(_) => {
                self.shared.started.fetch_add(1, Ordering::Relaxed);
                Ok(())
            }
            Err(error) => {
                self.shared.lock().threads -= 1;
                let job = slot.lock().unwrap_or_else(|p| p.into_inner()).take();
                match job {
                    Some(job) => Err(NotStarted { job, error }),
                    // Unreachable: the closure holding the other end never ran.
                    None => Ok(()),
                }
            }
        }
    }

    /// Runs `job` on the pool, or here when no thread can be started.
    pub fn run_or_here(&self, job: impl FnOnce() + Send + 'static) {
        if let Err(NotStarted { job, error }) = self.run(job) {
            tracing::warn!(pool = self.shared.name, %error, "no thread to spare: running here");
            job();
        }
    }

    /// Threads started so far (for tests and status).
    pub fn started(&self) -> u64 {
        self.shared.started.load(Ordering::Relaxed)
    }

    /// For `GET /v1/status`: threads live and idle, and started since the daemon began (a cold start
    /// that starts about as many threads as it has misses is not reusing them).
    pub fn status(&self) -> serde_json::Value {
        let (threads, idle) = self.threads();
        serde_json::json!({"threads": threads, "idle": idle, "started": self.started()})
    }

    /// Live threads and idle ones.
    pub fn threads(&self) -> (usize, usize) {
        let st = self.shared.lock();
        (st.threads, st.idle)
    }

    /// Whether every job given to the pool has run to its end (none queued, every thread idle).
    pub fn quiet(&self) -> bool {
        let st = self.shared.lock();
        st.jobs.is_empty() && st.idle == st.threads
    }
}

impl Default for Workers {
    fn default() -> Workers {
        Workers::new("strata-work", IDLE_FOR, KEEP)
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn work(&self, job: Job) {
        if std::panic::catch_unwind(std::panic::AssertUnwindSafe(job)).is_err() {
            tracing::error!(pool = self.name, "a background job panicked");
        }
    }

    /// Takes queued jobs until the thread has been idle for `idle_for` with enough others idle.
    fn serve(&self) {
        loop {
            let job = {
                let mut st = self.lock();
                loop {
                    if let Some(job) = st.jobs.pop_front() {
                        break job;
                    }
                    if st.closed {
                        st.threads -= 1;
                        return;
                    }
                    st.idle += 1;
                    let (guard, waited) = self
                        .wake
                        .wait_timeout(st, self.idle_for)
                        .unwrap_or_else(|p| p.into_inner());
                    st = guard;
                    st.idle -= 1;
                    if waited.timed_out() && st.jobs.is_empty() && st.idle >= self.keep {
                        st.threads -= 1;
                        return;
                    }
                }
            };
            self.work(job);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testkit::wait_until;
    use std::sync::mpsc;
    use std::time::Instant;

    #[test]
    fn jobs_run_one_after_another_on_one_thread() {
        let w = Workers::new("t-reuse", IDLE_FOR, KEEP);
        let (tx, rx) = mpsc::channel();
        for i in 0..50 {
            let tx = tx.clone();
            w.run(move || tx.send((i, std::thread::current().id())).unwrap())
                .map_err(|e| e.error)
                .unwrap();
            let (got, _) = rx.recv().unwrap();
            assert_eq!(got, i);
            // The thread is back to waiting before the next job comes.
            wait_until("the thread to idle", || w.threads() == (1, 1));
        }
        assert_eq!(w.started(), 1, "one thread served all fifty jobs");
    }

    #[test]
    fn jobs_that_wait_on_each_other_never_queue_behind_busy_threads() {
        // Every job waits until all have started: on a fixed pool of fewer than 20 threads this would
        // hang; here every job gets a thread.
        let w = Workers::new("t-barrier", IDLE_FOR, KEEP);
        let n = 20;
        let running = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let (done_tx, done_rx) = mpsc::channel();
        for _ in 0..n {
            let (running, done) = (running.clone(), done_tx.clone());
            w.run(move || {
                running.fetch_add(1, Ordering::SeqCst);
                let end = Instant::now() + Duration::from_secs(10);
                while running.load(Ordering::SeqCst) < n && Instant::now() < end {
                    std::thread::sleep(Duration::from_millis(1));
                }
                done.send(running.load(Ordering::SeqCst)).unwrap();
            })
            .map_err(|e| e.error)
            .unwrap();
        }
        for _ in 0..n {
            assert_eq!(
                done_rx.recv().unwrap(),
                n,
                "a job ran before all had started"
            );
        }
        assert_eq!(w.started(), n as u64);
    }

    #[test]
    fn threads_beyond_the_kept_ones_end_when_idle() {
        let w = Workers::new("t-idle", Duration::from_millis(50), 2);
        let (tx, rx) = mpsc::channel::<()>();
        let rx = Arc::new(Mutex::new(rx));
        for _ in 0..6 {
            let rx = rx.clone();
            // Each holds its thread until released, so six threads start.
            w.run(move || {
                let _ = rx.lock().unwrap().recv();
            })
            .map_err(|e| e.error)
            .unwrap();
        }
        assert_eq!(w.started(), 6);
        for _ in 0..6 {
            tx.send(()).unwrap();
        }
        wait_until("surplus threads to end", || w.threads() == (2, 2));
        // The kept ones serve the next jobs.
        let (done, got) = mpsc::channel();
        w.run(move || done.send(()).unwrap())
            .map_err(|e| e.error)
            .unwrap();
        got.recv().unwrap();
        assert_eq!(w.started(), 6);
    }

    #[test]
    fn a_bounded_pool_queues_past_its_bound_and_runs_every_job() {
        let w = Workers::bounded("t-bound", IDLE_FOR, 1, 4);
        let (tx, rx) = mpsc::channel::<()>();
        let rx = Arc::new(Mutex::new(rx));
        let done = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        for _ in 0..10 {
            let (rx, done) = (rx.clone(), done.clone());
            w.run(move || {
                let _ = rx.lock().unwrap().recv();
                done.fetch_add(1, Ordering::SeqCst);
            })
            .map_err(|e| e.error)
            .unwrap();
        }
        assert_eq!(w.started(), 4, "no more threads than the bound");
        for _ in 0..10 {
            tx.send(()).unwrap();
        }
        wait_until("the queued jobs", || done.load(Ordering::SeqCst) == 10);
    }

    #[test]
    fn the_threads_end_when_the_last_handle_goes_after_the_queued_jobs() {
        let w = Workers::bounded("t-close", IDLE_FOR, KEEP, 1);
        let shared = w.shared.clone();
        let (tx, rx) = mpsc::channel();
        for i in 0..3 {
            let tx = tx.clone();
            w.run(move || {
                std::thread::sleep(Duration::from_millis(20));
                tx.send(i).unwrap();
            })
            .map_err(|e| e.error)
            .unwrap();
        }
        drop(w);
        let got: Vec<i32> = (0..3).map(|_| rx.recv().unwrap()).collect();
        assert_eq!(got, [0, 1, 2], "queued jobs still ran");
        wait_until("the kept thread to end", || shared.lock().threads == 0);
    }

    #[test]
    fn a_panicking_job_leaves_the_pool_serving() {
        let w = Workers::new("t-panic", IDLE_FOR, KEEP);
        w.run(|| panic!("on purpose")).map_err(|e| e.error).unwrap();
        wait_until("the thread to idle", || w.threads() == (1, 1));
        let (tx, rx) = mpsc::channel();
        w.run(move || tx.send(7).unwrap())
            .map_err(|e| e.error)
            .unwrap();
        assert_eq!(rx.recv().unwrap(), 7);
        assert_eq!(w.started(), 1);
    }

    #[test]
    fn a_thread_started_by_a_pinned_caller_runs_where_the_pools_maker_could() {
        let all = rustix::thread::sched_getaffinity(None).expect("affinity");
        let Some(first) = (0..rustix::thread::CpuSet::MAX_CPU).find(|&c| all.is_set(c)) else {
            return;
        };
        let w = Workers::new("t-cpus", IDLE_FOR, KEEP);
        let (tx, rx) = mpsc::channel();
        let w2 = w.clone();
        std::thread::spawn(move || {
            let mut one = rustix::thread::CpuSet::new();
            one.set(first);
            rustix::thread::sched_setaffinity(None, &one).expect("pin the caller");
            w2.run(move || {
                let got = rustix::thread::sched_getaffinity(None).expect("worker's affinity");
                tx.send(got).expect("send");
            })
            .map_err(|e| e.error)
            .expect("start a worker");
        })
        .join()
        .expect("caller");
        assert!(
            rx.recv().expect("the job ran") == all,
            "the worker kept the caller's pin"
        );
    }
}
