//! When a local directory's range reads may run on their caller's thread.
//!
//! A `file://` store's range is read with direct I/O. Through the backend's runtime that read ran on a
//! blocking-pool thread the caller waited for: two hand-overs between threads per read, and on a
//! virtual machine each wakes another CPU, dearer than the read itself (the fat image's cold import
//! took 0.625 s that way and 0.594 s with its reads on the callers' threads, median of 8 alternated
//! runs, `benches/coldstart.py local`). So a range read runs on its caller's thread.
//!
//! What that gives up is the deadline: a blocking read cannot be cut short, so a directory that hangs
//! (a shared filesystem that lost its servers) would hold its callers past it. Hence this tripwire:
//! while a read on a caller's thread has been running for longer than `slow`, and for `cool` after one
//! took that long, reads go through the runtime again, under their deadline; at most the reads already
//! running when the directory hung are held.
//!
//! A trip is logged (a warning, once per trip, not per read): it is the operator's only sign that
//! the directory under the store — often a shared filesystem — answered slowly.
//!
//! Invariants (under the lock): `running` holds the start of every read between [`Tripwire::begin`]
//! and its [`Ticket`]'s drop; `tripped_until` only moves forward.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long a read may run on its caller's thread before reads go under the deadline again.
pub const SLOW: Duration = Duration::from_millis(250);

/// How long reads go under the deadline after one was slow.
pub const COOL: Duration = Duration::from_secs(10);

/// Decides, read by read, whether a read may run on its caller's thread (see the module documentation).
pub struct Tripwire {
    slow: Duration,
    cool: Duration,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    running: HashMap<u64, Instant>,
    next: u64,
    tripped_until: Option<Instant>,
}

/// A read allowed on its caller's thread; dropped when it ends.
pub struct Ticket<'a> {
    wire: &'a Tripwire,
    id: u64,
    start: Instant,
}

impl Default for Tripwire {
    fn default() -> Tripwire {
        Tripwire::new(SLOW, COOL)
    }
}

impl Tripwire {
    /// A tripwire that trips at reads slower than `slow`, for `cool`.
    pub fn new(slow: Duration, cool: Duration) -> Tripwire {
        Tripwire {
            slow,
            cool,
            state: Mutex::new(State::default()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A ticket to read on the caller's thread, or `None`: read under the deadline.
    pub fn begin(&self) -> Option<Ticket<'_>> {
        let now = Instant::now();
        let mut st = self.lock();
        if st
            .running
            .values()
            .any(|&t| now.duration_since(t) > self.slow)
        {
            trip(&mut st, now, self.cool, self.slow);
        }
        if st.tripped_until.is_some_and(|until| now < until) {
            return None;
        }
        let id = st.next;
        st.next += 1;
        st.running.insert(id, now);
        Some(Ticket {
            wire: self,
            id,
            start: now,
        })
    }

    /// Whether reads go under the deadline now.
    pub fn tripped(&self) -> bool {
        self.lock()
            .tripped_until
            .is_some_and(|until| Instant::now() < until)
    }
}

/// Trips at `now` for `cool`; warns when reads were not under the deadline already.
fn trip(st: &mut State, now: Instant, cool: Duration, slow: Duration) {
    let until = now + cool;
    if st.tripped_until.is_none_or(|t| t <= now) {
        tracing::warn!(
            slow_ms = slow.as_millis() as u64,
            for_s = cool.as_secs_f64(),
            "a local store read took too long: reads go under their deadline for a while"
        );
    }
    if st.tripped_until.is_none_or(|t| t < until) {
        st.tripped_until = Some(until);
    }
}

impl Drop for Ticket<'_> {
    fn drop(&mut self) {
        let now = Instant::now();
        let mut st = self.wire.lock();
        st.running.remove(&self.id);
        if now.duration_since(self.start) > self.wire.slow {
            trip(&mut st, now, self.wire.cool, self.wire.slow);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SLOW: Duration = Duration::from_millis(40);
    const COOL: Duration = Duration::from_millis(200);

    #[test]
    fn fast_reads_stay_on_their_threads() {
        let w = Tripwire::new(SLOW, COOL);
        for _ in 0..100 {
            let a = w.begin().expect("a ticket");
            let b = w.begin().expect("another, at once");
            drop((a, b));
        }
        assert!(!w.tripped());
    }

    #[test]
    fn a_read_running_too_long_sends_new_reads_under_the_deadline() {
        let w = Tripwire::new(SLOW, COOL);
        let hung = w.begin().expect("a ticket");
        assert!(w.begin().is_some(), "not slow yet");
        std::thread::sleep(SLOW * 2);
        assert!(w.begin().is_none(), "one read hangs");
        drop(hung);
        // It ended slow: the wire stays tripped for the cool-down, then lets reads through again.
        assert!(w.begin().is_none());
        std::thread::sleep(COOL + SLOW);
        assert!(w.begin().is_some(), "cooled down");
    }

    #[test]
    fn a_read_that_ended_slow_trips_the_wire_too() {
        let w = Tripwire::new(SLOW, COOL);
        let t = w.begin().expect("a ticket");
        std::thread::sleep(SLOW * 2);
        drop(t);
        assert!(w.tripped());
        assert!(w.begin().is_none());
    }
}
