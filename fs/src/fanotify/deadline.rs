//! Every read answered by its deadline, whatever the store does.
//!
//! A fill thread answers its event once its range is filled or its fetch failed. Most stores fail a
//! fetch by the read deadline themselves (the fetcher's own timeout), but a read of a shared
//! filesystem whose only copy is gone blocks in the kernel for minutes (a MooseFS client retries;
//! found by the multi-client tier in this mode: a read hung past 60 s with a 3 s deadline), and a
//! thread blocked there cannot answer. So each event taken by a fill thread is armed here with its
//! deadline ([`Reaper::arm`]) — a read a successor adopts from a dead server too, its deadline counted
//! from the successor's start; a reaper thread denies (`EIO`) any event still unanswered when its
//! deadline passes, as `file` mode's blob server does (`crate::slowread`). An event is answered
//! exactly once: whoever takes its [`Once`] first answers. The event's descriptor stays with the fill
//! thread, closed when it is done, so the number cannot go to another event while that thread might
//! still hold it.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

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
    /// A reaper whose thread calls `late` (with no lock held) for each item not disarmed in time.
    pub fn new(late: impl Fn(T) + Send + Sync + 'static) -> std::io::Result<Reaper<T>> {
        let shared = Arc::new(Shared {
            timers: Mutex::new(BTreeMap::new()),
            cv: Condvar::new(),
            seq: AtomicU64::new(0),
            stop: AtomicBool::new(false),
            late: Box::new(late),
        });
        let s = shared.clone();
        std::thread::Builder::new()
            .name("fan-deadline".into())
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
    fn an_item_not_disarmed_is_late_once_and_a_disarmed_one_never() {
        let late = Arc::new(Mutex::new(Vec::new()));
        let l = late.clone();
        let r = Reaper::new(move |i: u32| l.lock().unwrap().push(i)).unwrap();
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
        let r = Reaper::new(move |(): ()| {
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
