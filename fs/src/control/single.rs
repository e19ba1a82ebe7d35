//! One run at a time, shared: a caller that arrives while a run is in progress waits for it and takes
//! its result instead of running again.
//!
//! For the node's scrub (`POST /v1/scrub`, `strata daemon scrub`, the daily one): two scrubs at once
//! would read every cached byte twice for the same answer. Invariants: at most one `f` runs at a time;
//! a caller that waited returns the result of a run that ended after it arrived (the one it waited
//! for), or runs `f` itself if that run left none (it panicked); [`Single::last`] is the last result.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, TryLockError};

/// Runs one job at a time and shares its result with the callers that waited for it.
pub struct Single<R> {
    running: Mutex<()>,
    /// The last result, and the number of the run that produced it.
    last: Mutex<Option<(u64, R)>>,
    /// Runs started so far.
    runs: Mutex<u64>,
    /// Callers waiting for a run to end (for tests).
    waiting: AtomicUsize,
}

impl<R: Clone> Default for Single<R> {
    fn default() -> Single<R> {
        Single {
            running: Mutex::new(()),
            last: Mutex::new(None),
            runs: Mutex::new(0),
            waiting: AtomicUsize::new(0),
        }
    }
}

impl<R: Clone> Single<R> {
    /// `f`'s result, or — when another run is in progress — that run's, once it ends.
    pub fn run(&self, f: impl FnOnce() -> R) -> R {
        let _running = match self.running.try_lock() {
            Ok(g) => g,
            Err(TryLockError::Poisoned(p)) => p.into_inner(),
            Err(TryLockError::WouldBlock) => {
                // The run in progress started before this call: its result is as fresh as ours.
                let before = *self.runs.lock().unwrap_or_else(|p| p.into_inner());
                self.waiting.fetch_add(1, Ordering::AcqRel);
                let g = self.running.lock().unwrap_or_else(|p| p.into_inner());
                self.waiting.fetch_sub(1, Ordering::AcqRel);
                match self.last.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
                    Some((n, r)) if *n >= before => return r.clone(),
                    _ => g,
                }
            }
        };
        let n = {
            let mut runs = self.runs.lock().unwrap_or_else(|p| p.into_inner());
            *runs += 1;
            *runs
        };
        let r = f();
        *self.last.lock().unwrap_or_else(|p| p.into_inner()) = Some((n, r.clone()));
        r
    }

    /// The last run's result.
    pub fn last(&self) -> Option<R> {
        let last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        last.as_ref().map(|(_, r)| r.clone())
    }

    /// Callers waiting for the run in progress.
    pub fn waiting(&self) -> usize {
        self.waiting.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;
    use std::sync::Arc;

    use std::thread::JoinHandle;

    /// A run of `s` in progress on another thread, a second caller of `second` waiting behind it, and
    /// the flag that lets the first run end with `first`'s result.
    fn overlap(
        s: &Arc<Single<u32>>,
        first: impl FnOnce() -> u32 + Send + 'static,
        second: impl FnOnce() -> u32 + Send + 'static,
    ) -> (JoinHandle<u32>, JoinHandle<u32>, Arc<AtomicBool>) {
        let (started, release) = (flag(), flag());
        let a = {
            let (s, started, release) = (s.clone(), started.clone(), release.clone());
            std::thread::spawn(move || {
                s.run(|| {
                    started.store(true, Ordering::Release);
                    wait_for(&release);
                    first()
                })
            })
        };
        wait_for(&started);
        let b = {
            let s = s.clone();
            std::thread::spawn(move || s.run(second))
        };
        crate::testkit::wait_until("the second caller waiting", || s.waiting() == 1);
        (a, b, release)
    }

    fn flag() -> Arc<AtomicBool> {
        Arc::new(AtomicBool::new(false))
    }

    fn wait_for(f: &AtomicBool) {
        crate::testkit::wait_until("a flag", || f.load(Ordering::Acquire));
    }

    #[test]
    fn a_caller_arriving_during_a_run_takes_its_result() {
        let s: Arc<Single<u32>> = Arc::new(Single::default());
        let (first, second, release) =
            overlap(&s, || 7, || panic!("a second run while one is in progress"));
        release.store(true, Ordering::Release);
        assert_eq!(first.join().expect("first"), 7);
        assert_eq!(second.join().expect("second"), 7, "the first run's result");
        assert_eq!(s.last(), Some(7));
        // With none in progress, a call runs again.
        assert_eq!(s.run(|| 8), 8);
        assert_eq!(s.last(), Some(8));
    }

    #[test]
    fn a_caller_whose_run_panicked_runs_itself() {
        let s: Arc<Single<u32>> = Arc::new(Single::default());
        assert_eq!(s.run(|| 1), 1);
        let (first, second, release) = overlap(&s, || panic!("the scrub failed"), || 2);
        release.store(true, Ordering::Release);
        assert!(first.join().is_err());
        // Not the stale 1 of a run before it arrived: it ran itself.
        assert_eq!(second.join().expect("second"), 2);
    }
}
