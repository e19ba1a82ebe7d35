//! Trace recording: the first touch of each chunk while a trace is on, in order.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use strata_registry::digest::Digest;

use crate::plan::PlanEntry;

/// Records chunk reads while on. Off (the normal state), [`Recorder::record`] is one atomic load.
#[derive(Default)]
pub struct Recorder {
    on: AtomicBool,
    inner: Mutex<Trace>,
}

#[derive(Default)]
struct Trace {
    seen: HashSet<PlanEntry>,
    order: Vec<PlanEntry>,
}

impl Recorder {
    fn lock(&self) -> std::sync::MutexGuard<'_, Trace> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Starts a trace; `false` if one is already running.
    pub fn start(&self) -> bool {
        let mut t = self.lock();
        if self.on.swap(true, Ordering::SeqCst) {
            return false;
        }
        *t = Trace::default();
        true
    }

    /// Whether a trace is running.
    pub fn is_on(&self) -> bool {
        self.on.load(Ordering::Relaxed)
    }

    /// Notes a read of chunk `chunk` of `blob` (first touch only).
    pub fn record(&self, blob: &Digest, chunk: u32) {
        if !self.on.load(Ordering::Relaxed) {
            return;
        }
        let e = PlanEntry { blob: *blob, chunk };
        let mut t = self.lock();
        if self.on.load(Ordering::Relaxed) && t.seen.insert(e) {
            t.order.push(e);
        }
    }

    /// Stops the trace and returns what it recorded, in order.
    pub fn stop(&self) -> Vec<PlanEntry> {
        let mut t = self.lock();
        self.on.store(false, Ordering::SeqCst);
        std::mem::take(&mut t.order)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_first_touches_in_order_only_while_on() {
        let r = Recorder::default();
        let (a, b) = (Digest::of(b"a"), Digest::of(b"b"));
        r.record(&a, 9);
        assert!(r.start());
        assert!(!r.start());
        for (d, c) in [(a, 3), (b, 1), (a, 3), (a, 4)] {
            r.record(&d, c);
        }
        let got = r.stop();
        let want: Vec<PlanEntry> = [(a, 3), (b, 1), (a, 4)]
            .iter()
            .map(|&(blob, chunk)| PlanEntry { blob, chunk })
            .collect();
        assert_eq!(got, want);
        r.record(&a, 5);
        assert!(r.start());
        assert!(r.stop().is_empty());
    }
}
