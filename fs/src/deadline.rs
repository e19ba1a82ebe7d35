//! Every read that waits for a store is answered by its deadline, whatever the store does — in both
//! data paths: `file` and `loop` modes' blob server ([`crate::slowread`]) and `fanotify` mode's fill
//! threads ([`crate::fanotify`]).
//!
//! A thread serving a read answers it once its bytes are in or its fetch failed. Most stores fail a
//! fetch by the read deadline themselves (the fetcher's own timeout), but a read of a shared
//! filesystem whose only copy is gone blocks in the kernel for minutes (a MooseFS client retries;
//! found by the multi-client tier: a read hung past 60 s with a 3 s deadline), and a thread blocked
//! there cannot answer. So each such read is armed here with its deadline ([`Reaper::arm`]) and a
//! reaper thread hands any read still unanswered when its deadline passes to its `late` handler,
//! which answers `EIO`. A read is answered exactly once: whoever takes its [`Once`] (or, in the blob
//! server, its FUSE reply) first answers; the other finds it taken and drops its answer.
//!
//! **Failing fast for a moment** ([`FailFast`]). When a read of a blob missed its deadline, reads of
//! that blob that need its store fail at once for the next [`FAIL_FAST`] (cached data is still
//! served; a store that fails quickly, e.g. refuses connections, is simply asked again). Linux
//! answers a failed read or read-ahead by reading again at once with a smaller size: without this,
//! one `read(2)` from a store that does not answer waited twice the deadline (the silent-store suite:
//! 6.0 s with a read timeout of 3 s).

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use strata_registry::digest::Digest;

/// How long reads of a blob fail at once after one of its reads missed its deadline.
pub const FAIL_FAST: Duration = Duration::from_secs(1);

/// The blobs whose reads fail at once for now, and until when. See the module documentation.
#[derive(Default)]
pub struct FailFast(Mutex<HashMap<Digest, Instant>>);

impl FailFast {
    /// Notes that a read of `blob` missed its deadline now: its reads that need the store fail at
    /// once for [`FAIL_FAST`].
    pub fn timed_out(&self, blob: Digest) {
        let now = Instant::now();
        let mut f = self.lock();
        f.retain(|_, until| *until > now);
        f.insert(blob, now + FAIL_FAST);
    }

    /// Whether reads of `blob` that need its store must fail at once.
    pub fn failing(&self, blob: &Digest) -> bool {
        self.lock()
            .get(blob)
            .is_some_and(|until| *until > Instant::now())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Digest, Instant>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// An event's right to be answered, taken once.
#[derive(Default)]
pub struct Once(AtomicBool);

impl Once {
    /// Whether the caller is the one to answer (the first to ask).
    pub fn take(&self) -> bool {
        !self.0.swap(true, Ordering::AcqRel)
    }

    /// Whether it was taken (the event was answered).
    pub fn taken(&self) -> bool {
        self.0.load(Ordering::Acquire)
    }
}

type Late<T> = Box<dyn Fn(T) + Send + Sync>;

struct Shared<T> {
    timers: Mutex<BTreeMap<(Instant, u64), T>>,
    cv: Condvar,
    seq: AtomicU64,
    stop: AtomicBool,
    late: Late<T>,
}

/// Calls its `late` handler with each armed item whose deadline passes before it is disarmed.
pub struct Reaper<T: Send + 'static> {
    shared: Arc<Shared<T>>,
}

/// An armed item: disarmed when dropped.
pub struct Timer<T: Send + 'static> {
    key: (Instant, u64),
    shared: Arc<Shared<T>>,
}

impl<T: Send + 'static> Reaper<T> {
    /// A reaper whose thread (named `name`) calls `late` (with no lock held) for each item not
    /// disarmed in time.
    pub fn new(name: &str, late: impl Fn(T) + Send + Sync + 'static) -> std::io::Result<Reaper<T>> {
        let shared = Arc::new(Shared {
            timers: Mutex::new(BTreeMap::new()),
            cv: Condvar::new(),
            seq: AtomicU64::new(0),
            stop: AtomicBool::new(false),
            late: Box::new(late),
        });
        let s = shared.clone();
        std::thread::Builder::new()
            .name(name.into())
            .spawn(move || reap(&s))?;
        Ok(Reaper { shared })
    }

    /// Arms `item` to be handed to `late` at `at`, unless the returned timer is dropped first.
    pub fn arm(&self, at: Instant, item: T) -> Timer<T> {
        let key = (at, self.shared.seq.fetch_add(1, Ordering::Relaxed));
        let mut t = self.shared.lock();
        let first = t.keys().next().is_none_or(|k| key < *k);
        t.insert(key, item);
        drop(t);
        if first {
            self.shared.cv.notify_all();
        }
        Timer {
            key,
            shared: self.shared.clone(),
        }
    }
}

impl<T: Send + 'static> Drop for Reaper<T> {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        self.shared.cv.notify_all();
    }
}

impl<T: Send + 'static> Drop for Timer<T> {
    fn drop(&mut self) {
        self.shared.lock().remove(&self.key);
    }
}

impl<T> Shared<T> {
    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<(Instant, u64), T>> {
        self.timers.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The reaper's thread: hands each item whose deadline passed to `late`, until the reaper is
/// dropped.
fn reap<T>(s: &Shared<T>) {
    let mut t = s.lock();
    while !s.stop.load(Ordering::Acquire) {
        let now = Instant::now();
        match t.first_key_value().map(|(k, _)| *k) {
            Some(k) if k.0 <= now => {
                if let Some(item) = t.remove(&k) {
                    drop(t);
                    (s.late)(item);
                    t = s.lock();
                }
            }
            Some(k) => {
                t =
                    s.cv.wait_timeout(t, k.0 - now)
                        .map_or_else(|p| p.into_inner().0, |r| r.0)
            }
            None => {
                t =
                    s.cv.wait_timeout(t, Duration::from_secs(1))
                        .map_or_else(|p| p.into_inner().0, |r| r.0)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    #[test]
    fn a_blob_fails_fast_for_a_moment_after_a_timeout_and_others_never() {
        let f = FailFast::default();
        let (a, b) = (Digest([1; 32]), Digest([2; 32]));
        assert!(!f.failing(&a));
        f.timed_out(a);
        assert!(f.failing(&a) && !f.failing(&b));
        std::thread::sleep(FAIL_FAST + Duration::from_millis(50));
        assert!(!f.failing(&a));
    }

    #[test]
    fn an_item_not_disarmed_is_late_once_and_a_disarmed_one_never() {
        let late = Arc::new(Mutex::new(Vec::new()));
        let l = late.clone();
        let r = Reaper::new("test-deadline", move |i: u32| l.lock().unwrap().push(i)).unwrap();
        let now = Instant::now();
        let _a = r.arm(now + Duration::from_millis(50), 1);
        let b = r.arm(now + Duration::from_millis(20), 2);
        let _c = r.arm(now + Duration::from_millis(10), 3);
        drop(b);
        std::thread::sleep(Duration::from_millis(300));
        assert_eq!(*late.lock().unwrap(), [3, 1]);
    }

    #[test]
    fn an_event_is_answered_by_whoever_takes_it_first() {
        let once = Arc::new(Once::default());
        let answers = Arc::new(AtomicUsize::new(0));
        let (o, n) = (once.clone(), answers.clone());
        let r = Reaper::new("test-deadline", move |(): ()| {
            if o.take() {
                n.fetch_add(1, Ordering::AcqRel);
            }
        })
        .unwrap();
        let _t = r.arm(Instant::now(), ());
        std::thread::sleep(Duration::from_millis(100));
        // The fill thread, done late: the reaper answered.
        assert!(!once.take());
        assert_eq!(answers.load(Ordering::Acquire), 1);
    }
}
