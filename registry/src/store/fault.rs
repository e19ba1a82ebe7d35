//! [`FaultyStore`]: wraps any [`StoreBackend`] and makes it misbehave on purpose, for tests of what sits
//! above a store (the fetcher's single flight, deadlines, retries and corruption checks; the blob server).
//!
//! A test injects [`Fault`]s — delay, hang, error, corrupt — each aimed at a key (exact or by string
//! prefix), optionally at a byte range and at some operations, optionally for the first N matching calls
//! only. Faults are added and removed at any time, also while calls are blocked in them: a hang lasts
//! until its fault is removed ([`FaultyStore::remove`], [`FaultyStore::clear`]), until the call's
//! deadline (a range read then fails with [`StoreError::Timeout`], as a real backend must), or, for calls
//! without a deadline, until [`FaultyStore::set_hang_limit`] — so a test that forgets to release still ends.
//! Every call is counted per operation and key, and every range read's range is recorded, so a test can
//! assert "fetched once" or "in one request".
//!
//! A call goes through its matching faults in this order: delays (summed), hangs, errors, then the
//! wrapped backend (with what is left of the deadline), then corruption of the bytes it returns.
//!
//! ```
//! use std::sync::Arc;
//! use std::time::Duration;
//! use strata_registry::store::{Fault, FaultyStore, MemoryStore, Op, PutMode, Store, StoreBackend};
//!
//! let faults = Arc::new(FaultyStore::new(Arc::new(MemoryStore::new())));
//! faults.put("blobs/b", vec![7u8; 100].into(), PutMode::Overwrite).unwrap();
//! // The first read of bytes 0..10 fails, later ones succeed.
//! faults.inject(Fault::error().key("blobs/b").range(0..10).times(1));
//! let mut store = Store::with_backend(faults.clone());
//! store.range_deadline = Duration::from_millis(200);
//! assert!(store.get_range("blobs/b", 0..10).is_err());
//! assert_eq!(&store.get_range("blobs/b", 0..10).unwrap()[..], &[7u8; 10]);
//! // Reads of anything under blobs/ hang until released or the deadline.
//! let hang = faults.inject(Fault::hang().prefix("blobs/"));
//! assert!(matches!(store.get_range("blobs/b", 0..1), Err(e) if e.is_timeout()));
//! faults.remove(hang);
//! assert_eq!(faults.calls(Op::GetRange, "blobs/b"), 3);
//! ```

use std::collections::{HashMap, HashSet};
use std::ops::Range;
use std::path::Path;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use bytes::Bytes;

use super::object::{timeout, ObjectMeta, PutMode, StoreBackend, Version};
use super::StoreError;

/// A store operation, for aiming faults and counting calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Op {
    Get,
    GetRange,
    Head,
    Put,
    List,
    Delete,
}

/// What a fault does.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FaultKind {
    /// Wait this long before the call (bounded by the call's deadline).
    Delay(Duration),
    /// Block until the fault is removed, the deadline passes, or the hang limit.
    Hang,
    /// Block until the fault is removed or the hang limit, whatever the call's deadline: a read
    /// blocked in the kernel (a shared filesystem whose only copy is gone), which no timeout ends.
    Stuck,
    /// Fail with [`StoreError::Backend`] without calling the wrapped store.
    Error,
    /// Invert the returned bytes inside the fault's range (without a range: the first byte returned).
    Corrupt,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Target {
    Any,
    Key(String),
    Prefix(String),
}

/// One fault: what it does and which calls it hits. Build with [`Fault::delay`], [`Fault::hang`],
/// [`Fault::error`] or [`Fault::corrupt`], then narrow it; unnarrowed, it hits every call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fault {
    kind: FaultKind,
    target: Target,
    range: Option<Range<u64>>,
    ops: Option<Vec<Op>>,
    times: Option<u64>,
}

impl Fault {
    fn of(kind: FaultKind) -> Fault {
        Fault {
            kind,
            target: Target::Any,
            range: None,
            ops: None,
            times: None,
        }
    }
    pub fn delay(d: Duration) -> Fault {
        Fault::of(FaultKind::Delay(d))
    }
    pub fn hang() -> Fault {
        Fault::of(FaultKind::Hang)
    }
    pub fn stuck() -> Fault {
        Fault::of(FaultKind::Stuck)
    }
    pub fn error() -> Fault {
        Fault::of(FaultKind::Error)
    }
    pub fn corrupt() -> Fault {
        Fault::of(FaultKind::Corrupt)
    }
    /// Only calls on exactly this key (for a listing: this prefix).
    pub fn key(mut self, key: &str) -> Fault {
        self.target = Target::Key(key.to_string());
        self
    }
    /// Only calls on keys that start with `prefix` (as strings: `blobs/ab` hits `blobs/abc`).
    pub fn prefix(mut self, prefix: &str) -> Fault {
        self.target = Target::Prefix(prefix.to_string());
        self
    }
    /// Only reads of bytes that overlap `range` (whole-object reads always do); other operations are
    /// not hit.
    pub fn range(mut self, range: Range<u64>) -> Fault {
        self.range = Some(range);
        self
    }
    /// Only these operations.
    pub fn ops(mut self, ops: &[Op]) -> Fault {
        self.ops = Some(ops.to_vec());
        self
    }
    /// Only the next `n` calls it hits; then it is spent (a spent hang still holds the calls it caught
    /// until it is removed).
    pub fn times(mut self, n: u64) -> Fault {
        self.times = Some(n);
        self
    }

    fn hits(&self, op: Op, key: &str, range: Option<&Range<u64>>) -> bool {
        let target = match &self.target {
            Target::Any => true,
            Target::Key(k) => k == key,
            Target::Prefix(p) => key.starts_with(p.as_str()),
        };
        let ranged = match (&self.range, op, range) {
            (None, _, _) => true,
            (Some(_), Op::Get, _) => true,
            (Some(f), Op::GetRange, Some(r)) => f.start < r.end && r.start < f.end,
            (Some(_), _, _) => false,
        };
        let op_ok = self.ops.as_ref().is_none_or(|ops| ops.contains(&op));
        target && ranged && op_ok && self.times != Some(0)
    }
}

/// Names an injected fault, for [`FaultyStore::remove`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FaultId(u64);

#[derive(Default)]
struct State {
    faults: Vec<(FaultId, Fault)>,
    /// Hangs not yet released (a spent hang stays here until removed).
    holding: HashSet<FaultId>,
    next: u64,
    calls: HashMap<(Op, String), u64>,
    ranges: HashMap<String, Vec<Range<u64>>>,
}

/// A [`StoreBackend`] that injects faults into another. See the module documentation.
pub struct FaultyStore {
    inner: Arc<dyn StoreBackend>,
    state: Mutex<State>,
    changed: Condvar,
    hang_limit: Mutex<Duration>,
}

/// What a call must do before and after the wrapped store.
#[derive(Default)]
struct Plan {
    delay: Duration,
    hangs: Vec<FaultId>,
    /// A hang is [`FaultKind::Stuck`]: the call's deadline does not end it.
    stuck: bool,
    error: bool,
    corrupt: Vec<Option<Range<u64>>>,
}

impl FaultyStore {
    /// Wraps `inner`; no faults yet.
    pub fn new(inner: Arc<dyn StoreBackend>) -> FaultyStore {
        FaultyStore {
            inner,
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
            hang_limit: Mutex::new(Duration::from_secs(30)),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Counters and fault lists are consistent after every statement.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Adds a fault; it applies to calls that start from now on.
    pub fn inject(&self, fault: Fault) -> FaultId {
        let mut s = self.lock();
        s.next += 1;
        let id = FaultId(s.next);
        if matches!(fault.kind, FaultKind::Hang | FaultKind::Stuck) {
            s.holding.insert(id);
        }
        s.faults.push((id, fault));
        id
    }

    /// Removes a fault and releases the calls it holds.
    pub fn remove(&self, id: FaultId) {
        let mut s = self.lock();
        s.faults.retain(|(i, _)| *i != id);
        s.holding.remove(&id);
        self.changed.notify_all();
    }

    /// Removes every fault and releases every held call.
    pub fn clear(&self) {
        let mut s = self.lock();
        s.faults.clear();
        s.holding.clear();
        self.changed.notify_all();
    }

    /// How long a hang holds a call that has no deadline (default 30 s); it then fails with
    /// [`StoreError::Timeout`].
    pub fn set_hang_limit(&self, limit: Duration) {
        *self.hang_limit.lock().unwrap_or_else(|p| p.into_inner()) = limit;
    }

    /// Calls of `op` on `key` so far.
    pub fn calls(&self, op: Op, key: &str) -> u64 {
        let s = self.lock();
        s.calls.get(&(op, key.to_string())).copied().unwrap_or(0)
    }

    /// Reads of `key` so far, whole or ranged.
    pub fn reads(&self, key: &str) -> u64 {
        self.calls(Op::Get, key) + self.calls(Op::GetRange, key)
    }

    /// The ranges read from `key` so far, in call order.
    pub fn ranges(&self, key: &str) -> Vec<Range<u64>> {
        self.lock().ranges.get(key).cloned().unwrap_or_default()
    }

    /// Forgets every count and recorded range.
    pub fn reset_counts(&self) {
        let mut s = self.lock();
        s.calls.clear();
        s.ranges.clear();
    }

    /// Counts the call and takes what the matching faults say (using up their `times`).
    fn plan(&self, op: Op, key: &str, range: Option<&Range<u64>>) -> Plan {
        let mut s = self.lock();
        *s.calls.entry((op, key.to_string())).or_default() += 1;
        if let Some(r) = range {
            s.ranges.entry(key.to_string()).or_default().push(r.clone());
        }
        let mut plan = Plan::default();
        for (id, f) in s.faults.iter_mut() {
            if !f.hits(op, key, range) {
                continue;
            }
            if let Some(n) = f.times.as_mut() {
                *n -= 1;
            }
            match f.kind {
                FaultKind::Delay(d) => plan.delay += d,
                FaultKind::Hang => plan.hangs.push(*id),
                FaultKind::Stuck => {
                    plan.hangs.push(*id);
                    plan.stuck = true;
                }
                FaultKind::Error => plan.error = true,
                FaultKind::Corrupt => plan.corrupt.push(f.range.clone()),
            }
        }
        s.faults.retain(|(_, f)| f.times != Some(0));
        plan
    }

    /// Runs `call` after the plan's delays, hangs and errors, within `deadline` if it has one; the
    /// wrapped call gets what is left of the deadline.
    fn around<T>(
        &self,
        op: Op,
        key: &str,
        range: Option<&Range<u64>>,
        deadline: Option<Duration>,
        call: impl FnOnce(Option<Duration>) -> Result<T, StoreError>,
    ) -> Result<(T, Plan), StoreError> {
        let start = Instant::now();
        let plan = self.plan(op, key, range);
        let hang_limit = *self.hang_limit.lock().unwrap_or_else(|p| p.into_inner());
        let limit = match deadline {
            Some(d) if !plan.stuck => d,
            _ => hang_limit,
        };
        let timed_out = || timeout(self.inner.url(), key, limit);
        if plan.delay >= limit {
            std::thread::sleep(limit);
            return Err(timed_out());
        }
        std::thread::sleep(plan.delay);
        let mut s = self.lock();
        while plan.hangs.iter().any(|id| s.holding.contains(id)) {
            let left = limit.saturating_sub(start.elapsed());
            if left.is_zero() {
                return Err(timed_out());
            }
            s = self
                .changed
                .wait_timeout(s, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        drop(s);
        if plan.error {
            return Err(StoreError::Backend {
                url: self.inner.url().to_string(),
                key: key.to_string(),
                source: "injected fault".into(),
            });
        }
        // A stuck call, once released, goes on as the kernel's would (its deadline was not its).
        let left = match plan.stuck {
            true => deadline,
            false => deadline.map(|d| d.saturating_sub(start.elapsed())),
        };
        if left.is_some_and(|l| l.is_zero()) {
            return Err(timed_out());
        }
        Ok((call(left)?, plan))
    }
}

impl FaultyStore {
    /// A call without a deadline and without bytes to corrupt.
    fn pass<T>(
        &self,
        op: Op,
        key: &str,
        call: impl FnOnce() -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        Ok(self.around(op, key, None, None, |_| call())?.0)
    }
}

/// Inverts the bytes of `data` (which holds the object's bytes from `offset`) that the plan corrupts.
fn corrupt(plan: &Plan, data: Bytes, offset: u64) -> Bytes {
    if plan.corrupt.is_empty() || data.is_empty() {
        return data;
    }
    let mut v = data.to_vec();
    let end = offset + v.len() as u64;
    for r in &plan.corrupt {
        let (lo, hi) = match r {
            Some(r) => (r.start.max(offset), r.end.min(end)),
            None => (offset, offset + 1),
        };
        for b in v
            .iter_mut()
            .take((hi.max(lo) - offset) as usize)
            .skip((lo - offset) as usize)
        {
            *b ^= 0xff;
        }
    }
    Bytes::from(v)
}

impl StoreBackend for FaultyStore {
    fn url(&self) -> &str {
        self.inner.url()
    }

    fn get(&self, key: &str) -> Result<(Bytes, Version), StoreError> {
        let ((data, v), plan) = self.around(Op::Get, key, None, None, |_| self.inner.get(key))?;
        Ok((corrupt(&plan, data, 0), v))
    }

    fn get_range(
        &self,
        key: &str,
        range: Range<u64>,
        deadline: Duration,
    ) -> Result<Bytes, StoreError> {
        let r = range.clone();
        let (data, plan) =
            self.around(Op::GetRange, key, Some(&range), Some(deadline), |left| {
                self.inner.get_range(key, r, left.unwrap_or(deadline))
            })?;
        Ok(corrupt(&plan, data, range.start))
    }

    fn head(&self, key: &str) -> Result<Option<ObjectMeta>, StoreError> {
        self.pass(Op::Head, key, || self.inner.head(key))
    }

    fn put(&self, key: &str, data: Bytes, mode: PutMode) -> Result<Version, StoreError> {
        self.pass(Op::Put, key, || self.inner.put(key, data, mode))
    }

    fn put_file(&self, key: &str, file: &Path) -> Result<(), StoreError> {
        self.pass(Op::Put, key, || self.inner.put_file(key, file))
    }

    fn list_info(&self, prefix: &str) -> Result<Vec<ObjectMeta>, StoreError> {
        self.pass(Op::List, prefix, || self.inner.list_info(prefix))
    }

    fn delete(&self, key: &str) -> Result<(), StoreError> {
        self.pass(Op::Delete, key, || self.inner.delete(key))
    }
}

#[cfg(test)]
mod tests {
    use super::super::MemoryStore;
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    fn store_with(key: &str, data: &[u8]) -> Arc<FaultyStore> {
        let f = Arc::new(FaultyStore::new(Arc::new(MemoryStore::new())));
        f.put(key, Bytes::copy_from_slice(data), PutMode::Overwrite)
            .expect("put");
        f.reset_counts();
        f
    }

    #[test]
    fn a_hung_range_read_times_out_at_its_deadline() {
        let f = store_with("blobs/a", b"0123456789");
        f.inject(Fault::hang().key("blobs/a"));
        let mut store = super::super::Store::with_backend(f.clone());
        store.range_deadline = 300 * MS;
        let t = Instant::now();
        let r = store.get_range("blobs/a", 0..4);
        let took = t.elapsed();
        assert!(matches!(r, Err(StoreError::Timeout { .. })), "{r:?}");
        assert!(took >= 300 * MS && took < 800 * MS, "{took:?}");
        // Another key is not held.
        f.put("blobs/b", Bytes::from_static(b"b"), PutMode::Overwrite)
            .expect("put");
        assert_eq!(&store.get_range("blobs/b", 0..1).expect("b")[..], b"b");
    }

    #[test]
    fn removing_a_hang_releases_the_calls_it_holds() {
        let f = store_with("k", b"abc");
        let id = f.inject(Fault::hang().prefix("k").times(1));
        let t = Instant::now();
        std::thread::scope(|s| {
            let held = s.spawn(|| f.get_range("k", 1..3, Duration::from_secs(20)));
            while f.calls(Op::GetRange, "k") == 0 {
                std::thread::sleep(MS);
            }
            // The hang is spent: later calls pass while the first is still held.
            assert_eq!(&f.get("k").expect("get").0[..], b"abc");
            std::thread::sleep(50 * MS);
            assert!(!held.is_finished());
            f.remove(id);
            assert_eq!(&held.join().expect("thread").expect("read")[..], b"bc");
        });
        assert!(t.elapsed() < Duration::from_secs(5));
    }

    #[test]
    fn a_stuck_read_outlives_its_deadline_until_released() {
        let f = store_with("k", b"abc");
        let id = f.inject(Fault::stuck().key("k"));
        std::thread::scope(|s| {
            let held = s.spawn(|| f.get_range("k", 0..2, 50 * MS));
            std::thread::sleep(300 * MS);
            assert!(!held.is_finished(), "a stuck read ended at its deadline");
            f.remove(id);
            assert_eq!(&held.join().expect("thread").expect("read")[..], b"ab");
        });
        f.set_hang_limit(100 * MS);
        f.inject(Fault::stuck().key("k"));
        let t = Instant::now();
        assert!(f
            .get_range("k", 0..1, 10 * MS)
            .is_err_and(|e| e.is_timeout()));
        assert!(t.elapsed() >= 100 * MS);
    }

    #[test]
    fn a_hang_without_deadline_ends_at_the_hang_limit() {
        let f = store_with("k", b"abc");
        f.set_hang_limit(100 * MS);
        f.inject(Fault::hang());
        let t = Instant::now();
        assert!(f.head("k").is_err_and(|e| e.is_timeout()));
        assert!(t.elapsed() >= 100 * MS);
    }

    #[test]
    fn errors_for_the_first_calls_only() {
        let f = store_with("blobs/x", &[1; 64]);
        f.inject(Fault::error().key("blobs/x").times(2));
        for _ in 0..2 {
            let r = f.get_range("blobs/x", 0..8, Duration::from_secs(1));
            assert!(matches!(r, Err(StoreError::Backend { .. })), "{r:?}");
        }
        assert_eq!(
            f.get_range("blobs/x", 0..8, Duration::from_secs(1))
                .expect("third")
                .len(),
            8
        );
        assert_eq!(f.reads("blobs/x"), 3);
        assert_eq!(f.ranges("blobs/x"), vec![0..8, 0..8, 0..8]);
    }

    #[test]
    fn faults_aim_at_keys_ranges_and_operations() {
        let f = store_with("blobs/abc", &[0; 100]);
        f.put("meta/abc", Bytes::from_static(b"m"), PutMode::Overwrite)
            .expect("put");
        f.inject(
            Fault::error()
                .prefix("blobs/")
                .range(50..60)
                .ops(&[Op::GetRange]),
        );
        let d = Duration::from_secs(1);
        assert!(
            f.get_range("blobs/abc", 0..50, d).is_ok(),
            "before the range"
        );
        assert!(
            f.get_range("blobs/abc", 60..100, d).is_ok(),
            "after the range"
        );
        assert!(f.get_range("blobs/abc", 55..56, d).is_err(), "inside");
        assert!(f.get_range("blobs/abc", 40..70, d).is_err(), "overlapping");
        assert!(f.get("blobs/abc").is_ok(), "another operation");
        assert!(f.get_range("meta/abc", 0..1, d).is_ok(), "another key");
        f.clear();
        assert!(f.get_range("blobs/abc", 55..56, d).is_ok(), "cleared");
    }

    #[test]
    fn corruption_inverts_the_bytes_of_its_range_wherever_they_are_read() {
        let data: Vec<u8> = (0..100).collect();
        let f = store_with("b", &data);
        f.inject(Fault::corrupt().key("b").range(10..12));
        let d = Duration::from_secs(1);
        let got = f.get_range("b", 8..14, d).expect("read");
        assert_eq!(&got[..], &[8, 9, !10, !11, 12, 13]);
        let whole = f.get("b").expect("get").0;
        assert_eq!(
            (whole[9], whole[10], whole[11], whole[12]),
            (9, !10, !11, 12)
        );
        assert_eq!(&f.get_range("b", 20..22, d).expect("clean")[..], &[20, 21]);
        f.clear();
        f.inject(Fault::corrupt().times(1));
        assert_eq!(&f.get_range("b", 30..32, d).expect("first")[..], &[!30, 31]);
        assert_eq!(&f.get_range("b", 30..32, d).expect("second")[..], &[30, 31]);
    }

    #[test]
    fn delays_add_latency_and_respect_the_deadline() {
        let f = store_with("k", b"abc");
        f.inject(Fault::delay(100 * MS).key("k"));
        let t = Instant::now();
        assert!(f.get_range("k", 0..1, Duration::from_secs(2)).is_ok());
        assert!(t.elapsed() >= 100 * MS);
        f.inject(Fault::delay(Duration::from_secs(10)).key("k"));
        let t = Instant::now();
        let r = f.get_range("k", 0..1, 200 * MS);
        assert!(r.is_err_and(|e| e.is_timeout()));
        assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    }

    #[test]
    fn faults_change_while_reads_run() {
        let f = store_with("k", &[5; 16]);
        let stop = std::sync::atomic::AtomicBool::new(false);
        let (ok, failed) = std::thread::scope(|s| {
            let readers: Vec<_> = (0..4)
                .map(|_| {
                    s.spawn(|| {
                        let (mut ok, mut failed) = (0u64, 0u64);
                        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                            match f.get_range("k", 0..16, Duration::from_secs(5)) {
                                Ok(b) => {
                                    assert_eq!(&b[..], &[5; 16]);
                                    ok += 1
                                }
                                Err(_) => failed += 1,
                            }
                        }
                        (ok, failed)
                    })
                })
                .collect();
            std::thread::sleep(20 * MS);
            let id = f.inject(Fault::error());
            std::thread::sleep(20 * MS);
            f.remove(id);
            std::thread::sleep(20 * MS);
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
            readers
                .into_iter()
                .map(|r| r.join().expect("reader"))
                .fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1))
        });
        assert!(ok > 0 && failed > 0, "ok {ok}, failed {failed}");
        assert_eq!(f.reads("k"), ok + failed);
    }

    #[test]
    fn tags_move_by_compare_and_swap_on_any_backend() {
        use crate::model::TagName;
        let f = Arc::new(FaultyStore::new(Arc::new(MemoryStore::new())));
        let store = super::super::Store::with_backend(f.clone());
        let t = TagName::parse("img:v1").expect("tag");
        let d = crate::digest::Digest::of(b"manifest");
        store
            .put_bytes(&super::super::key::manifest(&d), b"manifest".to_vec())
            .expect("manifest");
        assert_eq!(store.tag_get(&t).expect("get"), None);
        store.tag_set(&t, None, &d).expect("create");
        let again = store.tag_set(&t, None, &d);
        assert!(
            matches!(again, Err(StoreError::TagConflict { .. })),
            "{again:?}"
        );
        let now = store.tag_get(&t).expect("get").expect("set");
        store.tag_set(&t, Some(&now), &d).expect("if-match");
        let stale = store.tag_set(&t, Some(&now), &d);
        assert!(
            matches!(stale, Err(StoreError::TagConflict { .. })),
            "{stale:?}"
        );
        assert_eq!(store.tags().expect("tags").good, vec![(t, d)]);
    }
}
