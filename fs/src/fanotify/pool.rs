//! The fill threads: a few kept, more started while every one is busy, so that no blob's reads wait
//! behind another's.
//!
//! A fill may wait for its store up to the read deadline (`read_timeout_secs`). With a fixed number of
//! threads, a blob whose store hangs would take every one of them with reads that each wait the whole
//! deadline, one after another, and every other blob's reads would queue behind: found by the faults
//! suite in this mode (a healthy blob's 16 reads took 92 s beside 256 reads of a hung one, 60 ms
//! alone). So the pool grows: work handed over while no thread is idle starts one more, up to a
//! bound, and a thread started so exits after it has been idle a while. `file` mode's blob server
//! does the same with its per-blob threads; the bound here is what the event journal can record
//! (every event a thread holds is in flight).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

/// How long a thread started for a burst waits for more work before it exits.
const IDLE_EXIT: Duration = Duration::from_secs(5);

/// A pool of threads running `handle` on the work sent to it.
pub struct Pool<W: Send + 'static> {
    tx: mpsc::Sender<W>,
    shared: Arc<Shared<W>>,
}

struct Shared<W> {
    rx: Mutex<mpsc::Receiver<W>>,
    /// Threads waiting for work.
    idle: AtomicUsize,
    /// Work sent and not yet taken.
    pending: AtomicUsize,
    /// Threads alive.
    live: AtomicUsize,
    max: usize,
    name: &'static str,
    handle: Box<dyn Fn(W) + Send + Sync>,
}

impl<W: Send + 'static> Pool<W> {
    /// A pool of `kept` threads (named `<name>-<i>`) that grows to `max` while all are busy.
    pub fn new(
        name: &'static str,
        kept: usize,
        max: usize,
        handle: impl Fn(W) + Send + Sync + 'static,
    ) -> Pool<W> {
        let (tx, rx) = mpsc::channel();
        let shared = Arc::new(Shared {
            rx: Mutex::new(rx),
            idle: AtomicUsize::new(0),
            pending: AtomicUsize::new(0),
            live: AtomicUsize::new(0),
            max: max.max(kept).max(1),
            name,
            handle: Box::new(handle),
        });
        let pool = Pool { tx, shared };
        for _ in 0..kept.max(1) {
            pool.start(true);
        }
        pool
    }

    /// Hands `work` to a thread, starting one more if the idle ones are all spoken for (by work
    /// sent before) and the bound allows; the work back if no thread can take it (none could be
    /// started). The counts are read apart, so a race may start a thread too many, never one too
    /// few: a thread stops counting itself idle before it counts its work taken.
    pub fn send(&self, work: W) -> Result<(), W> {
        let s = &self.shared;
        let waiting = s.pending.fetch_add(1, Ordering::AcqRel) + 1;
        if s.idle.load(Ordering::Acquire) < waiting && s.live.load(Ordering::Acquire) < s.max {
            self.start(false);
        }
        if s.live.load(Ordering::Acquire) == 0 {
            s.pending.fetch_sub(1, Ordering::AcqRel);
            return Err(work);
        }
        self.tx.send(work).map_err(|e| {
            s.pending.fetch_sub(1, Ordering::AcqRel);
            e.0
        })
    }

    /// Threads alive now.
    pub fn threads(&self) -> usize {
        self.shared.live.load(Ordering::Acquire)
    }

    fn start(&self, kept: bool) {
        let shared = self.shared.clone();
        let n = shared.live.fetch_add(1, Ordering::AcqRel);
        let spawned = std::thread::Builder::new()
            .name(format!("{}-{n}", shared.name))
            .spawn(move || work(&shared, kept));
        if let Err(e) = spawned {
            self.shared.live.fetch_sub(1, Ordering::AcqRel);
            tracing::error!(error = %e, pool = self.shared.name, "cannot start a thread");
        }
    }
}

/// A thread's life: work until the pool is dropped (or, for a thread started for a burst, until it
/// has been idle for [`IDLE_EXIT`]).
fn work<W>(s: &Shared<W>, kept: bool) {
    loop {
        s.idle.fetch_add(1, Ordering::AcqRel);
        let got = {
            let rx = s.rx.lock().unwrap_or_else(|p| p.into_inner());
            match kept {
                true => rx.recv().ok(),
                false => rx.recv_timeout(IDLE_EXIT).ok(),
            }
        };
        s.idle.fetch_sub(1, Ordering::AcqRel);
        match got {
            Some(w) => {
                s.pending.fetch_sub(1, Ordering::AcqRel);
                (s.handle)(w)
            }
            None => break,
        }
    }
    s.live.fetch_sub(1, Ordering::AcqRel);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Condvar;
    use std::time::Instant;

    /// A gate the work waits on until it is opened.
    #[derive(Default)]
    struct Gate(Mutex<bool>, Condvar);

    impl Gate {
        fn wait(&self) {
            let mut open = self.0.lock().unwrap();
            while !*open {
                open = self.1.wait(open).unwrap();
            }
        }
        fn open(&self) {
            *self.0.lock().unwrap() = true;
            self.1.notify_all();
        }
    }

    #[test]
    fn work_sent_while_every_thread_is_busy_gets_a_new_thread() {
        let gate = Arc::new(Gate::default());
        let done = Arc::new(AtomicUsize::new(0));
        let (g, d) = (gate.clone(), done.clone());
        // Work 0..32 blocks (a hung store); work 100 does not and must not wait for it.
        let pool = Pool::new("t", 2, 64, move |w: usize| {
            if w < 100 {
                g.wait();
            }
            d.fetch_add(1, Ordering::AcqRel);
        });
        for w in 0..32 {
            pool.send(w).unwrap();
        }
        pool.send(100).unwrap();
        let t = Instant::now();
        while done.load(Ordering::Acquire) == 0 {
            assert!(t.elapsed() < Duration::from_secs(10), "work 100 waited");
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(pool.threads() >= 33, "{} threads", pool.threads());
        gate.open();
        while done.load(Ordering::Acquire) < 33 {
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "blocked work not done"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    #[test]
    fn the_pool_grows_no_further_than_its_bound() {
        let gate = Arc::new(Gate::default());
        let done = Arc::new(AtomicUsize::new(0));
        let (g, d) = (gate.clone(), done.clone());
        let pool = Pool::new("t", 1, 4, move |_: usize| {
            g.wait();
            d.fetch_add(1, Ordering::AcqRel);
        });
        for w in 0..10 {
            pool.send(w).unwrap();
        }
        assert_eq!(pool.threads(), 4);
        gate.open();
        let t = Instant::now();
        while done.load(Ordering::Acquire) < 10 {
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "queued work not done"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}
